"""The training defaults, in one frozen dataclass; a YAML file and the command line override only what changes.

Merging is OmegaConf's (typed, with errors naming the unknown key), not a hand-written one.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("sgd", "adamw")


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
        if self.on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {self.on_error!r}")


def load_config(config_file: str | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Defaults <- YAML file <- explicit overrides (``None`` values in ``overrides`` mean "not given")."""
    from omegaconf import OmegaConf  # defer: only training needs it

    merged = OmegaConf.structured(TrainConfig)
    if config_file:
        merged = OmegaConf.merge(merged, OmegaConf.load(config_file))
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    if given:
        merged = OmegaConf.merge(merged, given)
    return TrainConfig(**OmegaConf.to_container(merged))


def to_yaml(cfg: TrainConfig) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml({f.name: getattr(cfg, f.name) for f in fields(cfg)})
