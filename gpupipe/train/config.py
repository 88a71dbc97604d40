"""The training defaults, in one frozen dataclass; a YAML file and the command line override only what changes.

Merging is OmegaConf's (typed, with errors naming the unknown key), not a hand-written one.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, cast

PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("sgd", "adamw")
ON_ERROR = ("raise", "skip")
CHOICES = {
    "precision": PRECISIONS,
    "optimizer": OPTIMIZERS,
    "on_error": ON_ERROR,
    "remode": ("pixel", "rand", "const"),
}  # backend: the registry's names


# What a resume compares with the checkpoint's config. Fixed keys decide the checkpoint's shapes or the data order;
# changeable ones change the run's maths, so they need --allow-config-change; the rest (out, workers, ...) are free.
RESUME_FIXED = ("data", "model", "batch_size", "accum", "image_size", "seed", "optimizer", "model_ema")
RESUME_CHANGEABLE = (
    "epochs",
    "lr",
    "momentum",
    "weight_decay",
    "warmup_epochs",
    "label_smoothing",
    "clip",
    "precision",
    "backend",
    "aa",
    "color_jitter",
    "reprob",
    "remode",
    "recount",
    "mixup",
    "cutmix",
    "mixup_prob",
    "mixup_switch_prob",
    "model_ema_decay",
)


@dataclass(frozen=True)
class TrainConfig:
    data: str = "data/sample"
    val: str | None = None
    model: str = "resnet18"
    backend: str = "pillow"
    epochs: int = 10
    batch_size: int = 64
    accum: int = 1
    precision: str = "fp32"
    optimizer: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-5
    warmup_epochs: float = 1.0
    label_smoothing: float = 0.0  # also --smoothing, timm's name
    # augmentation, with timm's flag names (see gpupipe.augment and gpupipe.Mix)
    aa: str | None = None  # e.g. rand-m9-mstd0.5-inc1, original, trivialaugment
    color_jitter: float | None = None
    reprob: float = 0.0
    remode: str = "pixel"
    recount: int = 1
    mixup: float = 0.0  # MixUp alpha; 0: off
    cutmix: float = 0.0  # CutMix alpha; 0: off
    mixup_prob: float = 1.0
    mixup_switch_prob: float = 0.5
    model_ema: bool = False  # timm's ModelEmaV3, evaluated and checkpointed beside the model
    model_ema_decay: float = 0.9998
    clip: float | None = None
    channels_last: bool = False
    compile: bool = False
    workers: int | None = None
    image_size: int = 224
    device: str | None = None
    seed: int = 0
    out: str = "runs/train"
    resume: bool = False
    resume_or_start: bool = False
    allow_config_change: bool = False
    save_every: int = 0  # optimizer steps between mid-epoch checkpoints; 0: at epoch ends only
    on_error: str = "raise"
    log_every: int = 10
    dist_timeout_s: int = 600  # a rank that stops answering ends the run after this, instead of a hang

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        for name in ("epochs", "batch_size", "accum", "image_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.clip is not None and self.clip <= 0:
            raise ValueError(f"clip must be > 0, got {self.clip}")
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {', '.join(ON_ERROR)}, got {self.on_error!r}")


HELP = {  # the --help text of each field; a None default is explained here
    "data": "training data: an ImageFolder directory or a CSV list (path,label)",
    "val": "held-out data, labelled with --data's classes (default None: no validation)",
    "model": "a timm model name, randomly initialised",
    "backend": "decode/augment backend; auto: the fastest in this machine's latest `gpupipe bench` of --data",
    "epochs": "passes over --data",
    "batch_size": "images per micro-batch on each rank",
    "accum": "micro-batches per optimizer step (gradient accumulation)",
    "precision": "fp32, or autocast to bf16 / fp16 (fp16 adds a GradScaler)",
    "optimizer": "SGD with Nesterov momentum, or AdamW",
    "lr": "peak learning rate, after warm-up, then cosine decay",
    "momentum": "SGD momentum",
    "weight_decay": "weight decay (not on norms and biases)",
    "warmup_epochs": "linear warm-up length, in epochs",
    "label_smoothing": "cross-entropy label smoothing",
    "clip": "clip the gradient norm to this (default None: no clipping)",
    "channels_last": "channels_last memory format for model and batches",
    "compile": "torch.compile the model",
    "workers": "decode workers per rank (default None: every usable core)",
    "image_size": "training and validation image side",
    "device": "cpu or cuda (default None: cuda when available); under torchrun each rank takes its LOCAL_RANK GPU",
    "seed": "seed of the model init, the data order and the augmentation",
    "out": "run folder: checkpoints/last.pt, metrics.jsonl, tb/, config.yaml",
    "resume": "continue the run in --out from checkpoints/last.pt; refused when there is none",
    "resume_or_start": "resume when --out has a checkpoint, else start a new run (jobs that get re-queued)",
    "allow_config_change": "resume although these changed: "
    + ", ".join(RESUME_CHANGEABLE)
    + " (never: "
    + ", ".join(RESUME_FIXED)
    + ")",
    "save_every": "optimizer steps between mid-epoch checkpoints (0: at epoch ends only)",
    "on_error": "an undecodable file: raise an error naming it, or skip it (listed in the log and skipped.txt)",
    "log_every": "micro-batches between progress updates",
    "dist_timeout_s": "seconds before a rank that stops answering ends a DDP run, instead of a hang",
    "aa": "per-image auto-augmentation, timm's names: rand-m9-mstd0.5-inc1 (RandAugment), original (AutoAugment), "
    "trivialaugment (default None: off)",
    "color_jitter": "per-image colour jitter strength for brightness, contrast and saturation (default None: off)",
    "reprob": "per-image random-erasing probability (0: off)",
    "remode": "random-erasing fill: pixel (per-pixel noise), rand (per-channel) or const (the mean)",
    "recount": "random-erasing boxes per image",
    "mixup": "MixUp alpha (0: off); with --cutmix, timm's Mixup switches between them",
    "cutmix": "CutMix alpha (0: off)",
    "mixup_prob": "probability of mixing a batch when --mixup or --cutmix is on",
    "mixup_switch_prob": "probability of CutMix instead of MixUp when both are on",
    "model_ema": "keep an exponential moving average of the weights (timm's ModelEmaV3), evaluated and checkpointed",
    "model_ema_decay": "the EMA's decay per optimizer step",
}


def load_config(config_file: str | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Defaults <- YAML file <- explicit overrides (``None`` values in ``overrides`` mean "not given"). A broken
    file, an unknown key or a wrong value is a one-line ``ValueError`` naming the file, the line and the key."""
    from omegaconf import OmegaConf  # defer: only training needs it
    from omegaconf.errors import OmegaConfBaseException

    merged = OmegaConf.structured(TrainConfig)
    if config_file:
        text, lines = _read_yaml(config_file)
        try:
            merged = OmegaConf.merge(merged, OmegaConf.create(text))
        except OmegaConfBaseException as e:
            key = str(getattr(e, "full_key", "") or "")
            raise ValueError(f"{config_file}:{lines.get(key, '?')}: {key}: {str(e).splitlines()[0]}") from None
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    if given:
        merged = OmegaConf.merge(merged, given)
    return TrainConfig(**cast(dict[str, Any], OmegaConf.to_container(merged)))


def _read_yaml(path: str) -> tuple[str, dict[str, int]]:
    """The file's text and each top-level key's line; YAML errors and unknown keys (with the closest valid name)
    become one-line errors."""
    import difflib

    import yaml  # OmegaConf's own YAML library

    try:
        with open(path) as f:
            text = f.read()
        node = yaml.compose(text)
    except OSError as e:
        raise ValueError(f"{path}: cannot read the config file ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ValueError(f"{path}{where}: not valid YAML ({getattr(e, 'problem', None) or e})") from None
    if node is None:
        return "{}", {}
    if not isinstance(node, yaml.MappingNode):
        raise ValueError(f"{path}: expected 'key: value' lines, got a YAML {node.id}")
    names = [f.name for f in fields(TrainConfig)]
    lines = {}
    for key, _ in node.value:
        line = key.start_mark.line + 1
        if key.value not in names:
            close = difflib.get_close_matches(key.value, names, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(names)}"
            raise ValueError(f"{path}:{line}: unknown key '{key.value}'{hint}")
        lines[key.value] = line
    return text, lines


def to_yaml(cfg: TrainConfig) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml({f.name: getattr(cfg, f.name) for f in fields(cfg)})
