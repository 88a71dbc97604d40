"""gpupipe with Hugging Face Accelerate: ``prepare(model, optimizer)`` with the loader beside it, a mid-epoch
``save_state`` and a ``load_state`` that carries on from the very next batch. Two CPU processes:

    torchrun --standalone --nproc_per_node 2 examples/accelerate_loop.py DATA --out runs/acc --save-at 5 --stop-after 7
    torchrun --standalone --nproc_per_node 2 examples/accelerate_loop.py DATA --out runs/acc --resume

The loader is not given to ``prepare``: Accelerate wraps only ``torch.utils.data.DataLoader``s, and a gpupipe loader
already reads its own shard (its rank comes from the process group Accelerate set up) and delivers batches on the
device it was built for. ``register_for_checkpointing(loader)`` puts its position in every ``save_state``.
``--record`` writes what each rank trained on (one JSON line per batch), for the tests.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn

import gpupipe


class Net(nn.Module):
    def __init__(self, num_classes: int):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(8, num_classes)
        self.compute_dtype = torch.float32  # what the last forward computed in (Accelerate hands back float32)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.features(images))
        self.compute_dtype = logits.dtype
        return logits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data")
    p.add_argument("--out", required=True, help="where save_state writes (and load_state reads)")
    p.add_argument("--backend", default="pillow")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--precision", default="no", choices=["no", "bf16", "fp16"])
    p.add_argument("--save-at", type=int, help="save_state after this many steps")
    p.add_argument("--stop-after", type=int, help="stop after this many steps (as if killed)")
    p.add_argument("--resume", action="store_true", help="load_state from --out first")
    p.add_argument("--record", help="a folder: each rank's batches, one JSON line each")
    args = p.parse_args()

    accelerator = Accelerator(mixed_precision=args.precision, cpu=not torch.cuda.is_available())  # gloo on the CPU
    loader = gpupipe.build_loader(
        args.data,
        args.backend,
        batch_size=args.batch_size,
        image_size=args.image_size,
        num_workers=0,
        device=accelerator.device,  # the rank and world size: from the process group Accelerate started
    )
    torch.manual_seed(0)
    model = Net(len(loader.dataset.classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(loader)
    if args.resume:
        accelerator.load_state(args.out)  # model, optimizer, RNG states and the loader's position

    fit(args, accelerator, loader, model, optimizer)
    accelerator.print(f"done: {len(loader.dataset)} images, at {loader.state_dict()} ({loader.backend})")
    gloo = accelerator.state.backend == "gloo"
    accelerator.end_training()  # destroys the process group
    if gloo:
        # A gloo group that a DDP model used outlives destroy_process_group (torch 2.14 here): its worker threads still
        # run, and one that lets go of a finished collective while the interpreter shuts down aborts the process
        # ("terminate called without an active exception"), now and then on a busy machine. Everything is written
        # and closed by now: leave without the interpreter's shutdown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def fit(args, accelerator: Accelerator, loader, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    position = loader.state_dict()  # {"epoch", "batch"}: where the next batch comes from
    step = position["epoch"] * len(loader) + position["batch"]
    for epoch in range(position["epoch"], args.epochs):
        loader.set_epoch(epoch)  # a resumed epoch keeps its position
        for images, labels in loader:
            logits = model(images)  # under the Accelerator's autocast when --precision is set
            loss = nn.functional.cross_entropy(logits, labels)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if args.record:
                computed = accelerator.unwrap_model(model).compute_dtype
                record(args.record, accelerator.process_index, epoch, images, labels, computed)
            if step == args.save_at:
                accelerator.save_state(args.out)
            if step == args.stop_after:
                return
    if args.record and accelerator.is_main_process:
        weights = torch.cat([p.detach().flatten().float() for p in model.parameters()])
        (Path(args.record) / "weights.txt").write_text(hashlib.sha1(weights.numpy().tobytes()).hexdigest())


def record(folder: str, rank: int, epoch: int, images: torch.Tensor, labels: torch.Tensor, computed) -> None:
    line = {
        "epoch": epoch,
        "labels": labels.tolist(),
        "pixels": hashlib.sha1(images.cpu().contiguous().numpy().tobytes()).hexdigest(),
        "computed": str(computed),
    }
    with open(Path(folder) / f"rank{rank}.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
