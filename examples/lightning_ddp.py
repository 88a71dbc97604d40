"""gpupipe inside Lightning: DDP on 2 CPU processes, a mid-epoch checkpoint every 2 optimizer steps, and a resume.

    python examples/lightning_ddp.py DATA --out runs/lightning                 # train; checkpoints in runs/lightning
    python examples/lightning_ddp.py DATA --out runs/lightning --ckpt runs/lightning/epoch=0-step=2.ckpt  # resume

``DATA`` is an ImageFolder (``gpupipe sample-data DATA`` makes one). Lightning launches the second process itself
(``strategy="ddp"``); each rank reads its own shard. ``--record`` writes what each rank trained and validated on
(labels and a checksum of the pixels, one JSON line per batch): the tests compare a resumed run's with a straight one's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

import gpupipe
from gpupipe.lightning import DataModule


class PlainDataModule(L.LightningDataModule):
    """What a user writes without ``gpupipe.lightning``: ``build_loader`` reads the rank from torch.distributed."""

    def __init__(self, train: str, val: str | None, **options):
        super().__init__()
        self.train, self.val, self.options = train, val, options

    def train_dataloader(self):
        return gpupipe.build_loader(self.train, train=True, **self.options)

    def val_dataloader(self):
        return gpupipe.build_loader(self.val, train=False, **self.options) if self.val else []


class Classifier(L.LightningModule):
    def __init__(self, num_classes: int, record: str | None = None):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes)
        )
        self.record = record

    def training_step(self, batch, batch_idx):
        images, labels = batch
        self._record("train", batch_idx, images, labels)
        loss = nn.functional.cross_entropy(self.net(images), labels)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        images, labels = batch
        self._record("val", batch_idx, images, labels)
        self.log("val_loss", nn.functional.cross_entropy(self.net(images), labels), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def _record(self, stage: str, batch_idx: int, images: torch.Tensor, labels: torch.Tensor) -> None:
        if self.record is None or self.trainer.sanity_checking:
            return
        line = {
            "stage": stage,
            "epoch": self.current_epoch,
            "batch": batch_idx,
            "labels": labels.tolist(),
            "pixels": hashlib.sha1(images.cpu().contiguous().numpy().tobytes()).hexdigest(),
        }
        with open(Path(self.record) / f"rank{self.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data")
    p.add_argument("--val", help="a validation ImageFolder")
    p.add_argument("--out", required=True)
    p.add_argument("--backend", default="pillow")
    p.add_argument("--ckpt", help="resume from this checkpoint")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--plain", action="store_true", help="a plain LightningDataModule instead of gpupipe's")
    p.add_argument("--record", help="a folder: each rank's batches, one JSON line each")
    p.add_argument("--keep", type=int, default=2, help="checkpoints kept, the newest (-1: every one)")
    args = p.parse_args()
    if args.record:
        Path(args.record).mkdir(parents=True, exist_ok=True)  # (as the accelerate example's)

    options = dict(batch_size=args.batch_size, image_size=args.image_size, num_workers=args.workers)
    if args.plain:
        data = PlainDataModule(args.data, args.val, backend=args.backend, device="cpu", **options)
    else:
        data = DataModule(args.data, args.val, backend=args.backend, **options)
    num_classes = len([d for d in Path(args.data).iterdir() if d.is_dir()])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=args.epochs,
        accumulate_grad_batches=args.accumulate,
        # a checkpoint every 2 optimizer steps (mid-epoch ones too), the newest --keep of them kept
        callbacks=[
            ModelCheckpoint(args.out, "{epoch}-{step}", "step", every_n_train_steps=2, save_top_k=args.keep, mode="max")
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Classifier(num_classes, args.record), datamodule=data, ckpt_path=args.ckpt)
    if trainer.is_global_zero:
        metrics = "  ".join(f"{k} {float(v):.4f}" for k, v in trainer.callback_metrics.items())
        kept = "every one" if args.keep < 0 else f"the newest {args.keep}"
        print(f"done: {metrics}; a checkpoint every 2 steps in {args.out} ({kept} kept)", flush=True)
    if torch.distributed.is_initialized():  # Lightning destroys only NCCL process groups
        gloo = torch.distributed.get_backend() == "gloo"
        torch.distributed.barrier()  # every rank past fit, and so done with the others
        torch.distributed.destroy_process_group()
        if gloo:
            # A gloo group that a DDP model used outlives destroy_process_group (torch 2.14 here): its worker threads
            # still run, and one that lets go of a finished collective while the interpreter shuts down aborts the
            # process ("terminate called without an active exception"). Everything is written by now: leave without
            # the interpreter's shutdown.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


if __name__ == "__main__":
    main()
