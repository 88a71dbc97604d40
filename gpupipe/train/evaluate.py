"""``gpupipe eval``: a checkpoint's loss and accuracy on held-out data, without training.

The model, its image size and its classes come from the checkpoint (the classes as the training set labelled them,
so a held-out folder with fewer classes is labelled right); the data is read by any backend, as in training.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .._names import escape as escape_name  # file names on one line, whatever their bytes
from .._options import ALLOW_OUTSIDE_ROOT_HELP, at_least
from ..errors import DecodeError, GpupipeError


def add_eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint", required=True, help="a `gpupipe train` checkpoint (OUT/checkpoints/last.pt), or the run's OUT"
    )
    p.add_argument("--data", required=True, help="held-out data: an ImageFolder directory, a CSV list, shards")
    p.add_argument("--backend", default="pillow", help="decode backend (default pillow)")
    p.add_argument("--batch-size", type=int, default=64, help="(default 64)")
    p.add_argument("--workers", type=at_least(0), help="decode workers (default: the usable cores, less one on CUDA)")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--ema", action="store_true", help="evaluate the EMA weights (a run with --model-ema)")
    p.add_argument("--on-error", choices=["raise", "skip"], default="raise", help="an undecodable file (default raise)")
    p.add_argument("--json", action="store_true", help="print the metrics as JSON")
    p.add_argument("--allow-outside-root", action="store_true", help=ALLOW_OUTSIDE_ROOT_HELP)
    p.add_argument(
        "--classes-from",
        help="the training data, whose classes label --data: only for an older checkpoint that records no class list",
    )


def run_eval(args) -> int:
    from .cli import require_train_extra

    require_train_extra("eval")
    if args.backend == "synthetic":
        raise ValueError(
            "--backend synthetic makes random images and labels, not --data's: an accuracy on them means nothing; "
            "pick a backend that decodes --data (pillow, turbojpeg, dali, nvjpeg, pillow-simd, auto)"
        )
    import timm  # defer: only training and evaluation need it

    from ..api import build_loader
    from .distributed import Distributed
    from .loop import evaluated
    from .precision import Precision

    saved, classes = _checkpoint_and_classes(args)
    config = saved.get("config", {})
    weights = saved["model_ema"] if args.ema else saved["model"]
    model = timm.create_model(_model_name(config, args.checkpoint), pretrained=False, num_classes=len(classes))
    model.load_state_dict(weights)
    side = config.get("eval_size") or config["image_size"]  # the run's validation side
    loader = build_loader(
        args.data,
        args.backend,
        batch_size=args.batch_size,
        train=False,
        image_size=side,
        device=args.device,
        num_workers=args.workers,
        on_error=args.on_error,
        class_to_idx={c: i for i, c in enumerate(classes)},
        allow_outside_root=args.allow_outside_root,
    )
    model.to(loader.device)
    dist = Distributed(str(loader.device))
    try:
        metrics, images = evaluated(model, loader, Precision(config.get("precision", "fp32"), loader.device), dist)
    except DecodeError as e:  # the first unreadable file stopped the evaluation: say how to go on, in flags
        raise GpupipeError(
            f"{e.fault}; to go on: --on-error skip leaves such files out, and `gpupipe check {args.data}` lists every "
            "unreadable file"
        ) from e
    finally:
        dist.close()
    metrics = {
        "checkpoint": str(Path(args.checkpoint)),
        "data": args.data,
        "images": images,  # those the metrics are over
        "skipped": [{"path": path, "reason": reason} for path, reason in loader.skipped],
        "weights": "ema" if args.ema else "model",
        **metrics,
    }
    if args.json:
        print(json.dumps(metrics))
        return 0
    what = f"{config['model']}{' EMA weights' if args.ema else ''} at {side} px, {_when(saved)} of {args.checkpoint}"
    _say(args.data, metrics, what, loader.skipped)
    return 0


def _say(data: str, metrics: dict, what: str, skipped: list[tuple[str, str]]) -> None:
    """The evaluation in words: its figures, over how many images, of which weights; the files left out."""
    print(
        f"{data}: val_acc {metrics['val_acc']:.4f}  val_loss {metrics['val_loss']:.4f}  ({metrics['images']} images, "
        f"{what})"
    )
    if skipped:
        path, reason = skipped[0]
        print(
            f"{len(skipped)} unreadable file(s) left out (--on-error skip), e.g. {escape_name(path)}: {reason}",
            file=sys.stderr,
        )


def _checkpoint_and_classes(args) -> tuple[dict, list[str]]:
    """The checkpoint (one line for a missing, broken or foreign file) and the classes that label ``--data``."""
    from ..sources.open import open_source

    run_folder = Path(args.checkpoint) / "checkpoints" / "last.pt"
    if Path(args.checkpoint).is_dir() and run_folder.is_file():  # a run's --out: its last checkpoint
        args.checkpoint = str(run_folder)
    elif Path(args.checkpoint).is_dir():
        raise IsADirectoryError(
            f"{args.checkpoint}: a folder, with no checkpoints/last.pt in it: pass a checkpoint file, or the --out "
            "folder of a `gpupipe train` run"
        )
    if not Path(args.checkpoint).is_file():  # not "cannot resume from it": eval resumes nothing
        raise FileNotFoundError(
            f"{args.checkpoint}: no such checkpoint file (`gpupipe train --out OUT` writes OUT/checkpoints/last.pt)"
        )
    saved = _load(Path(args.checkpoint))  # a broken or foreign file: one line naming it
    # The checkpoint's config is data, never an instruction: nothing it names is fetched, read or trusted.
    if not (classes := saved.get("classes")):  # an older checkpoint: the classes of the data it trained on
        if args.classes_from is None:
            raise ValueError(
                f"{args.checkpoint}: records no class list (an older checkpoint): pass --classes-from with the data "
                "it was trained on, to label --data as it was labelled"
            )
        classes = open_source(args.classes_from, allow_outside_root=args.allow_outside_root).classes
    if args.ema and not saved.get("model_ema"):
        raise ValueError(
            f"{args.checkpoint}: --ema, but the run kept no EMA weights (it ran without --model-ema): "
            "leave out --ema to evaluate its weights"
        )
    return saved, classes


def _load(path: Path) -> dict:
    """The checkpoint, its digest checked; an empty, truncated, damaged or foreign file is one line naming it and
    the newest good checkpoint kept beside it, which ``--checkpoint`` evaluates (eval resumes nothing: the training
    run's wording, "cannot resume from it", is not eval's)."""
    from . import checkpoint

    try:
        return checkpoint.load_for_resume(path)
    except checkpoint.CheckpointError as e:
        # load_for_resume's line is "{path}: cannot resume from it ({problem}); {what to resume from instead}"
        problem = str(e).removeprefix(f"{path}: cannot resume from it (").split("); ", 1)[0]
        raise checkpoint.CheckpointError(f"{path}: cannot evaluate it ({problem}); {_good_neighbour(path)}") from None


def _good_neighbour(path: Path) -> str:
    """What to evaluate instead of a bad ``path``: the newest good checkpoint kept beside it, if any."""
    from . import checkpoint

    good = checkpoint.newest_good(path)
    if good is None:
        return "no good checkpoint is kept beside it: evaluate another one, or restore a good copy"
    return f"the newest good checkpoint beside it is {good[0]}: evaluate it with --checkpoint {good[0]}"


def _model_name(config: dict, path) -> str:
    """The checkpoint's model: a timm architecture by its registered name only. A location (``hf-hub:...``,
    ``local-dir:...``) would have ``timm.create_model`` fetch or read what the checkpoint names."""
    import timm

    name = config.get("model")
    if not isinstance(name, str) or ":" in name or not timm.is_model(name):
        raise ValueError(
            f"{path}: names the model {name!r}, not a timm architecture name; eval builds only those (it fetches "
            "nothing a checkpoint names)"
        )
    return name


def _when(saved: dict) -> str:
    """Where the checkpoint was saved, in the numbers the training log uses (epochs from 0)."""
    position = saved.get("loader", {"epoch": saved["epoch"], "batch": 0})
    if position["batch"] == 0 and position["epoch"] > 0:  # saved at an epoch's end: the next one's start
        return f"after epoch {position['epoch'] - 1}"
    return f"epoch {position['epoch']}, batch {position['batch']}"
