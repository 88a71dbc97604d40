"""The "speed up training" write-up's CIFAR-10 run, fed by gpupipe: AlexNet (no pretrained weights) at 227 px,
batch 64, AdamW, autocast on CUDA, the training set held on the device.

What changes from the write-up's script: the dataset is the same torchvision ``CIFAR10`` object without its
``transform``; the ``DataLoader`` over ``Compose([Resize(227), ToTensor()])`` becomes one ``gpupipe.build_loader``
call that resizes on the device (``Recipe(227, crop="resize", flip_p=0)``: the whole 32x32 image upsampled, no crop,
no flip) and delivers normalised float batches already there; ``cache="device"`` decodes the set once and makes
every epoch's batches by indexing it, with no worker processes. The model, optimizer and loop are the write-up's.
The set is held as the recipe resizes it, 227x227: 7.7 GB for CIFAR-10's 50,000 training images and 1.5 GB for its
10,000 test images; on a GPU with less memory free (the write-up's 6 GB RTX 2060), ``--cache host`` holds them in
pinned host memory instead (a set that fits in neither is refused up front, with its size).

    python examples/cifar10_alexnet.py data/cifar --download          # CIFAR-10, fetched by torchvision; 20 epochs
    python -m gpupipe.bench.cifar data/cifar-photos --count 1000      # or a CIFAR-10-format set made locally
    python examples/cifar10_alexnet.py data/cifar-photos --epochs 1 --steps 20   # a quick run, on the CPU too

``--steps N`` stops each epoch, and the test pass, after N batches.
"""

from __future__ import annotations

import argparse
import time

import torch
import torchvision
from torch import nn

import gpupipe
from gpupipe.bench.cifar import cifar10  # torchvision's CIFAR10; for a locally made set, the same without checksums


def make_loader(dataset, device: torch.device, train: bool, args):
    """The write-up's ``Resize(227)`` and ``ToTensor()``, on the device, the set held as ``--cache`` says."""
    recipe = gpupipe.Recipe(227, crop="resize", flip_p=0.0)
    return gpupipe.build_loader(
        dataset,
        batch_size=args.batch_size,
        train=train,
        recipe=recipe,
        device=device,
        cache=args.cache,
        drop_last=False,
    )


def train_epoch(model, loader, optimizer, scaler, steps: int | None) -> tuple[float, int]:
    """One epoch (at most ``steps`` batches): the mean loss and the images seen."""
    criterion = nn.CrossEntropyLoss()
    device_type = next(model.parameters()).device.type
    model.train()
    total, seen = torch.zeros((), device=next(model.parameters()).device), 0
    for step, (images, labels) in enumerate(loader):
        if steps is not None and step >= steps:
            break
        with torch.autocast(device_type, enabled=device_type == "cuda"):
            loss = criterion(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        total += loss.detach() * len(labels)
        seen += len(labels)
    return float(total) / max(seen, 1), seen


@torch.no_grad()
def accuracy(model, loader, steps: int | None) -> float:
    """Top-1 on the test set (at most ``steps`` batches)."""
    model.eval()
    right, seen = 0, 0
    for step, (images, labels) in enumerate(loader):
        if steps is not None and step >= steps:
            break
        right += int((model(images).argmax(1) == labels).sum())
        seen += len(labels)
    return right / max(seen, 1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", help="the folder holding cifar-10-batches-py/")
    p.add_argument("--download", action="store_true", help="fetch CIFAR-10 into ROOT first (torchvision's download)")
    p.add_argument("--epochs", type=int, default=20, help="passes over the training set (default 20)")
    p.add_argument("--steps", type=int, help="at most this many batches an epoch, and of the test set (default: all)")
    p.add_argument("--batch-size", type=int, default=64, help="(default 64)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate (default 0.001)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="(default: cuda if any)")
    p.add_argument("--cache", default="device", choices=["device", "host"], help="where the decoded set is held")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    train_set = cifar10(args.root, train=True, download=args.download)  # no transform: gpupipe resizes
    test_set = cifar10(args.root, train=False, download=args.download)
    train_loader = make_loader(train_set, device, True, args)
    test_loader = make_loader(test_set, device, False, args)

    torch.manual_seed(0)
    model = torchvision.models.alexnet(num_classes=10).to(device)  # no weights: trained from scratch
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler(device.type, enabled=device.type == "cuda")  # autocast's fp16 gradients scaled

    start = time.perf_counter()
    for epoch in range(args.epochs):
        train_loader.set_epoch(epoch)
        t0 = time.perf_counter()
        loss, seen = train_epoch(model, train_loader, optimizer, scaler, args.steps)
        acc = accuracy(model, test_loader, args.steps)
        took = time.perf_counter() - t0
        print(f"epoch {epoch}: loss {loss:.4f}, test accuracy {acc:.2%}, {seen} images in {took:.1f} s", flush=True)
    print(f"{args.epochs} epochs in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
