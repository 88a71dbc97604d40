"""The training defaults, in one frozen dataclass; a YAML file and the command line override only what changes.

Each field carries its ``--help`` text and its resume rule beside it (``opt(default, help, resume=...)``); string
options are ``Literal``s, whose values are the CLI's choices. Merging is OmegaConf's (typed, with errors naming the
unknown key), not a hand-written one.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import types
import typing
from dataclasses import dataclass, field, fields, make_dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

from .._options import ALLOW_OUTSIDE_ROOT_HELP, CropMode, EraseMode, OnError, PaddingMode, PrecisionName

if TYPE_CHECKING:  # the recipe imports numpy and torch: --help and argument errors must not wait for them
    from ..recipe import ResolutionSchedule

OptimizerName = Literal["sgd", "adamw"]
# What a resume compares with the checkpoint's config. "fixed" keys decide the checkpoint's shapes or the data order;
# "changeable" ones change the run's maths, so they need --allow-config-change; the rest (out, workers, ...) are free.
ResumeRule = Literal["fixed", "changeable"]


def opt(default: Any, help: str, *, resume: ResumeRule | None = None) -> Any:
    """A field with its default, its ``--help`` text (a None default is explained there) and its resume rule."""
    return field(default=default, metadata={"help": help, "resume": resume})


@dataclass(frozen=True)
class TrainConfig:
    data: str = opt(
        "data/sample",
        "training data: an ImageFolder directory, a CSV list (path,label), tar shards, Parquet files (a path, glob or "
        "folder), or a dataset object: module:callable, or module.Class:ROOT (torchvision.datasets.CIFAR10:ROOT)",
        resume="fixed",
    )
    val: str | None = opt(None, "held-out data, labelled with --data's classes (default None: no validation)")
    model: str = opt("resnet18", "a timm model name, randomly initialised unless --pretrained", resume="fixed")
    pretrained: str | None = opt(
        None,
        "start --model from this local weights file (.pth, .bin, .safetensors), loaded by timm; nothing is "
        "downloaded; a classifier for other classes is made anew (default None: random init)",
    )
    backend: str = opt(  # the registry's names, or auto
        "pillow",
        "decode/augment backend; auto: the fastest in this machine's latest `gpupipe bench` of --data",
        resume="changeable",
    )
    epochs: int = opt(10, "passes over --data", resume="changeable")
    batch_size: int = opt(64, "images per micro-batch on each rank", resume="fixed")
    accum: int = opt(1, "micro-batches per optimizer step (gradient accumulation)", resume="fixed")
    precision: PrecisionName = opt(
        "fp32", "fp32, or autocast to bf16 / fp16 (fp16 adds a GradScaler)", resume="changeable"
    )
    optimizer: OptimizerName = opt("sgd", "SGD with Nesterov momentum, or AdamW", resume="fixed")
    lr: float = opt(0.1, "peak learning rate, after warm-up, then cosine decay", resume="changeable")
    momentum: float = opt(0.9, "SGD momentum", resume="changeable")
    weight_decay: float = opt(5e-5, "weight decay (not on norms and biases)", resume="changeable")
    warmup_epochs: float = opt(1.0, "linear warm-up length, in epochs", resume="changeable")
    label_smoothing: float = opt(0.0, "cross-entropy label smoothing", resume="changeable")  # also --smoothing
    # augmentation, with timm's flag names (see gpupipe.augment and gpupipe.Mix)
    crop: CropMode = opt(
        "random-resized",
        "the train crop: random-resized (RandomResizedCrop, ImageNet's), pad (RandomCrop(--image-size, "
        "padding=--padding), CIFAR's) or resize (the whole image resized to --image-size); pad and resize evaluate "
        "the whole image resized",
        resume="changeable",
    )
    padding: int = opt(4, "--crop pad: pixels of padding on each side of the image", resume="changeable")
    padding_mode: PaddingMode = opt(
        "zero", "--crop pad: zero, or reflect (the image mirrored about its edge)", resume="changeable"
    )
    hflip: float = opt(0.5, "probability of a horizontal flip per train image", resume="changeable")
    aa: str | None = opt(
        None,
        "per-image auto-augmentation, timm's names: rand-m9-mstd0.5-inc1 (RandAugment), original (AutoAugment), "
        "trivialaugment; ctaugment[-d0.99-t0.8-n2] (CTAugment, its weights moved by a probe batch per step, "
        "FixMatch's loop) (default None: off)",
        resume="changeable",
    )
    color_jitter: float | None = opt(
        None,
        "per-image colour jitter strength for brightness, contrast and saturation (default None: off)",
        resume="changeable",
    )
    reprob: float = opt(0.0, "per-image random-erasing probability (0: off)", resume="changeable")
    remode: EraseMode = opt(
        "pixel",
        "random-erasing fill: pixel (per-pixel noise), rand (per-channel) or const (the mean)",
        resume="changeable",
    )
    recount: int = opt(1, "random-erasing boxes per image", resume="changeable")
    mixup: float = opt(
        0.0, "MixUp alpha (0: off); with --cutmix, timm's Mixup switches between them", resume="changeable"
    )
    cutmix: float = opt(0.0, "CutMix alpha (0: off)", resume="changeable")
    mixup_prob: float = opt(1.0, "probability of mixing a batch when --mixup or --cutmix is on", resume="changeable")
    mixup_switch_prob: float = opt(0.5, "probability of CutMix instead of MixUp when both are on", resume="changeable")
    model_ema: bool = opt(
        False,
        "keep an exponential moving average of the weights (timm's ModelEmaV3), evaluated and checkpointed",
        resume="fixed",
    )
    model_ema_decay: float = opt(0.9998, "the EMA's decay per optimizer step", resume="changeable")
    clip: float | None = opt(None, "clip the gradient norm to this (default None: no clipping)", resume="changeable")
    channels_last: bool = opt(False, "channels_last memory format for model and batches")
    compile: bool = opt(False, "torch.compile the model")
    workers: int | None = opt(
        None, "decode workers per rank (default None: the rank's share of the usable cores, less one on CUDA)"
    )
    shuffle_window: int | None = opt(
        None,
        "shards only: shuffle each epoch K shards at a time (the samples of K shards among themselves, each rank a "
        "contiguous part), so shards at a URL larger than the node's shard cache are fetched a group at a time; see "
        "build_loader (default None: a global shuffle)",
        resume="fixed",
    )
    cache: Literal["none", "device", "host"] = opt(
        "none",
        "device: decode the training and validation sets once and hold them on the device, every epoch's batches cut "
        "there (a small set: CIFAR's 50,000 32x32 images take 147 MiB); host: held in host memory; none: decode every "
        "epoch",
        resume="changeable",
    )
    cache_limit: str | None = opt(
        None,
        "data at a URL: bytes the node's shard cache may hold (e.g. 50GB; 0: no cache folder, range reads); "
        "default None: half the free space of its disk ($GPUPIPE_CACHE, else ~/.cache/gpupipe/shards)",
        resume="changeable",
    )
    image_size: int = opt(
        224, "training and validation image side (see --res-start, --res-end, --eval-size)", resume="fixed"
    )
    # progressive resizing (FFCV's ResNet recipes): the train side grows with the epoch, no loader rebuilt
    res_start: int | None = opt(
        None,
        "resolution schedule: the train image side up to --res-start-epoch, then linear to --res-end, rounded down to "
        "a multiple of --res-step (default None: --image-size; the schedule is on when this or --res-end is set)",
        resume="changeable",
    )
    res_end: int | None = opt(
        None,
        "resolution schedule: the train image side from --res-end-epoch on (default None: --image-size)",
        resume="changeable",
    )
    res_start_epoch: int = opt(
        0, "resolution schedule: the last epoch at --res-start (epochs count from 0)", resume="changeable"
    )
    res_end_epoch: int | None = opt(
        None, "resolution schedule: the first epoch at --res-end (default None: the last epoch)", resume="changeable"
    )
    res_step: int = opt(
        32, "resolution schedule: the sizes between the two ends are multiples of this", resume="changeable"
    )
    eval_size: int | None = opt(
        None, "validation image side, e.g. above the last train side (FixRes) (default None: --image-size)"
    )
    device: str | None = opt(
        None,
        "cpu or cuda (default None: cuda when available); under torchrun each rank takes its LOCAL_RANK GPU",
    )
    seed: int = opt(0, "seed of the model init, the data order and the augmentation", resume="fixed")
    out: str = opt("runs/train", "run folder: checkpoints/last.pt, metrics.jsonl, tb/, config.yaml")
    resume: bool = opt(False, "continue the run in --out from checkpoints/last.pt; refused when there is none")
    resume_or_start: bool = opt(
        False, "resume when --out has a checkpoint, else start a new run (jobs that get re-queued)"
    )
    allow_config_change: bool = opt(False, "resume although these changed: {changeable} (never: {fixed})")
    save_every: int = opt(0, "optimizer steps between mid-epoch checkpoints (0: at epoch ends only)")
    allow_outside_root: bool = opt(False, ALLOW_OUTSIDE_ROOT_HELP)
    keep_checkpoints: int = opt(
        2,
        "checkpoints kept in checkpoints/: last.pt's and the ones before it (step-*.pt), so that a damaged last.pt "
        "leaves an earlier one to resume from",
    )
    resume_from: str | None = opt(
        None,
        "resume from this checkpoint file (an earlier checkpoints/step-*.pt that a refused --resume named) instead "
        "of checkpoints/last.pt (default None)",
    )
    loader_timeout_s: float = opt(
        600.0, "seconds to wait for a batch before the run stops, naming the stalled loader worker (0: for ever)"
    )
    on_error: OnError = opt(
        "raise", "an undecodable file: raise an error naming it, or skip it (listed in the log and skipped.txt)"
    )
    log_every: int = opt(10, "micro-batches between progress updates")
    dist_timeout_s: int = opt(600, "seconds before a rank that stops answering ends a DDP run, instead of a hang")

    def __post_init__(self):
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(choice_error(name, getattr(self, name)))
        for name in ("epochs", "batch_size", "accum", "image_size", "keep_checkpoints", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for f in fields(self):  # a NaN compares false with every bound below: refused here, by name
            value = getattr(self, f.name)
            if isinstance(value, float) and math.isnan(value):
                raise ValueError(f"{f.name} must be a number, got nan")
        if not 0 <= self.lr < math.inf:
            raise ValueError(f"lr must be a finite number >= 0, got {self.lr}")
        if self.clip is not None and self.clip <= 0:
            raise ValueError(f"clip must be > 0, got {self.clip}")
        self._check_loader()
        self._check_resolution()
        self._check_crop()
        self._check_cache_limit()

    def _check_loader(self) -> None:
        if self.workers is not None and self.workers < 0:
            raise ValueError(f"workers must be >= 0, got {self.workers}")
        if self.loader_timeout_s < 0:
            raise ValueError(f"loader_timeout_s must be >= 0 (0: no timeout), got {self.loader_timeout_s}")

    def _check_crop(self) -> None:
        """``--padding`` and ``--hflip`` within their ranges (the crop's choices are checked with the others)."""
        if self.padding < 0:
            raise ValueError(f"padding must be >= 0, got {self.padding}")
        if not 0 <= self.hflip <= 1:
            raise ValueError(f"hflip must be a probability in [0, 1], got {self.hflip}")

    def _check_cache_limit(self) -> None:
        """``--cache-limit``: a size, parsed here (not when a loader is built); one line where it has no effect."""
        if self.cache_limit is None:
            return
        from ..sources.cache import parse_limit  # no torch

        try:
            parse_limit(self.cache_limit)
        except ValueError:
            raise ValueError(
                f"--cache-limit {self.cache_limit!r}: expected bytes or a size such as 50GB, 512MiB or 100k (powers "
                "of 1024), or 0 for no cache folder"
            ) from None
        if not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", self.data):
            _say_once(
                f"--cache-limit {self.cache_limit} has no effect: --data {self.data} is not at a URL (the shard cache "
                "keeps shards fetched from object storage)"
            )

    def _check_resolution(self) -> None:
        for name in ("res_start", "res_end", "eval_size", "res_step"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        end = self.res_end_epoch
        if self.res_start_epoch < 0 or (end is not None and end < 0):
            raise ValueError(f"res_start_epoch and res_end_epoch must be >= 0, got {self.res_start_epoch}, {end}")
        if self.res_start is None and self.res_end is None:
            given = [f"--{n.replace('_', '-')} {v}" for n, v, d in self._schedule_flags() if v != d]
            if given:
                raise ValueError(
                    f"{', '.join(given)}: the resolution schedule is off without --res-start or --res-end; set one, "
                    "or drop it"
                )
            return
        if end is not None and end <= self.res_start_epoch:
            raise ValueError(
                f"--res-end-epoch {end} must come after --res-start-epoch {self.res_start_epoch}: that is the last "
                f"epoch at --res-start, --res-end-epoch the first at --res-end (e.g. --res-end-epoch "
                f"{self.res_start_epoch + 1})"
            )
        _say_once(self._unfinished_schedule())

    def _schedule_flags(self) -> list[tuple[str, Any, Any]]:
        return [(n, getattr(self, n), _DEFAULTS[n]) for n in ("res_start_epoch", "res_end_epoch", "res_step")]

    def _unfinished_schedule(self) -> str | None:
        """One line when ``--epochs`` ends before the schedule reaches ``--res-end`` (None: it does). A warning, not
        a refusal: a run may be meant to go on, its ``--epochs`` extended on resume."""
        start, end = self.res_start or self.image_size, self.res_end or self.image_size
        last = self.epochs - 1
        reached = self.res_end_epoch if self.res_end_epoch is not None else max(last, self.res_start_epoch + 1)
        if start == end or reached <= last:
            return None
        at = self.train_size()
        side = at if isinstance(at, int) else at.at(last)
        epochs = f"--epochs {self.epochs} ends after epoch {last}"
        return (
            f"the resolution schedule reaches --res-end {end} at epoch {reached}, but {epochs} (epochs count from 0), "
            f"at side {side}: to finish it, resume with --allow-config-change --epochs {reached + 1} (or set "
            "--res-end-epoch, --res-start-epoch within the run)"
        )

    def train_size(self) -> int | ResolutionSchedule:
        """The train image side: ``image_size``, or the schedule from ``res_start`` to ``res_end`` when either is set
        (``res_end_epoch``: the last epoch by default)."""
        if self.res_start is None and self.res_end is None:
            return self.image_size
        last = max(self.epochs - 1, self.res_start_epoch) if self.res_end_epoch is None else self.res_end_epoch
        start, end = self.res_start or self.image_size, self.res_end or self.image_size
        from ..recipe import ResolutionSchedule

        return ResolutionSchedule(start, end, self.res_start_epoch, last, self.res_step)


_DEFAULTS = {f.name: f.default for f in fields(TrainConfig)}
_SAID: set[str] = set()  # a config is made again (resume, another number of ranks): each line said once


def _say_once(line: str | None) -> None:
    if line is not None and line not in _SAID:
        _SAID.add(line)
        logging.getLogger("gpupipe").warning(line)


def _resume_keys(rule: ResumeRule) -> tuple[str, ...]:
    return tuple(f.name for f in fields(TrainConfig) if f.metadata["resume"] == rule)


# Derived from the fields, for the loop, the CLI and the tests: one place to edit, beside each field.
HINTS = typing.get_type_hints(TrainConfig)
CHOICES = {
    f.name: typing.get_args(HINTS[f.name]) for f in fields(TrainConfig) if typing.get_origin(HINTS[f.name]) is Literal
}
RESUME_FIXED, RESUME_CHANGEABLE = _resume_keys("fixed"), _resume_keys("changeable")
HELP = {
    f.name: f.metadata["help"].format(changeable=", ".join(RESUME_CHANGEABLE), fixed=", ".join(RESUME_FIXED))
    for f in fields(TrainConfig)
}


def choice_error(name: str, value: Any) -> str:
    return f"{name} must be one of {', '.join(CHOICES[name])}, got {value!r}"


def load_config(config_file: str | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Defaults <- YAML file <- explicit overrides (``None`` values in ``overrides`` mean "not given"). A broken
    file, an unknown key or a wrong value is a one-line ``ValueError`` naming the file, the line and the key."""
    import yaml  # OmegaConf's own YAML library
    from omegaconf import OmegaConf  # defer: only training needs it
    from omegaconf.errors import OmegaConfBaseException

    merged = OmegaConf.structured(_schema())
    if config_file:
        text, lines = _read_yaml(config_file)
        try:
            merged = OmegaConf.merge(merged, OmegaConf.create(text))
        except OmegaConfBaseException as e:
            key = str(getattr(e, "full_key", "") or "")
            said = choice_error(key, getattr(e, "value", "?")) if key in CHOICES else f"{key}: {str(e).splitlines()[0]}"
            raise ValueError(f"{config_file}:{lines.get(key, '?')}: {said}") from None
        except yaml.YAMLError as e:  # a tag such as !!python/object/apply: never constructed, refused in one line
            mark = getattr(e, "problem_mark", None)
            where = f":{mark.line + 1}" if mark is not None else ""
            raise ValueError(f"{config_file}{where}: {getattr(e, 'problem', None) or e} (plain values only)") from None
        for key in CHOICES.keys() & lines.keys():  # the schema's str fields: their choices, checked here by line
            if (value := getattr(merged, key)) not in CHOICES[key]:
                raise ValueError(f"{config_file}:{lines[key]}: {choice_error(key, value)}")
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    if given:
        merged = OmegaConf.merge(merged, given)
    try:
        return TrainConfig(**cast(dict[str, Any], OmegaConf.to_container(merged)))
    except ValueError as e:  # "lr must be ...": a value the file set is named by its line, one a flag set by the flag
        key = str(e).split(" ", 1)[0]
        if config_file and key in lines and key not in given:
            raise ValueError(f"{config_file}:{lines[key]}: {e}") from None
        raise


@functools.cache
def _schema() -> type:
    """TrainConfig as OmegaConf types it: a ``Literal`` field as ``str`` (and ``X | None`` as ``Optional[X]``), since
    omegaconf 2.3, which Hydra pins, knows neither; the choices are checked by ``load_config`` and TrainConfig."""

    def plain(tp: Any) -> Any:
        args = typing.get_args(tp)
        if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
            return typing.Optional[plain(next(a for a in args if a is not type(None)))]  # noqa: UP045
        return str if typing.get_origin(tp) is Literal else tp

    specs = [(f.name, plain(HINTS[f.name]), field(default=f.default)) for f in fields(TrainConfig)]
    return make_dataclass("TrainConfig", specs, frozen=True)


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


# How a command runs, not what the run is: left out of a run's config.yaml, so that the file given back as --config
# starts a run (it resumed one only with --resume typed on the command line).
RUN_MODE = ("resume", "resume_or_start", "allow_config_change", "resume_from")


def run_mode_yaml(cfg: TrainConfig) -> str:
    """The run-mode settings that differ from their defaults, as YAML after a comment that says what they are
    (``--print-config``: they take effect, though the run's config.yaml leaves them out); "" when none does."""
    from omegaconf import OmegaConf

    changed = {
        f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name in RUN_MODE and getattr(cfg, f.name) != f.default
    }
    if not changed:
        return ""
    return "# how this command runs (left out of the run's config.yaml)\n" + OmegaConf.to_yaml(changed)


def to_yaml(cfg: TrainConfig) -> str:
    """The run's settings as YAML (``--print-config``, ``out/config.yaml``), the run-mode flags left out."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml({f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name not in RUN_MODE})
