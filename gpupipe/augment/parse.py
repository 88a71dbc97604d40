"""The recipe's augmentation settings, read and checked: timm's policy strings (``rand-m9-mstd0.5-inc1``,
``original``, ``originalr``, ``trivialaugment``), colour jitter factors and random-erasing settings. Pure
functions, no gpupipe imports: :class:`gpupipe.Recipe` calls them when it is made, so a bad value fails there, not
in a decode worker."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from .._options import ERASE_MODES, EraseMode


@dataclass(frozen=True)
class RandAugmentConfig:
    """timm's ``rand-...`` string: ``m`` (magnitude), ``n`` (ops per image), ``p`` (each op's probability),
    ``mstd`` (magnitude noise; > 100: uniform), ``mmax`` (magnitude cap), ``inc`` (the increasing op list)."""

    m: int = 10
    n: int = 2
    p: float = 0.5
    mstd: float = 0.0
    mmax: int | None = None
    increasing: bool = False


@dataclass(frozen=True)
class AutoAugmentConfig:
    """AutoAugment's ImageNet policy: ``original`` or ``originalr`` (Posterize increasing), with ``mstd``."""

    variant: Literal["original", "originalr"] = "original"
    mstd: float = 0.0


@dataclass(frozen=True)
class TrivialAugmentConfig:
    """torchvision's ``TrivialAugmentWide``: no settings."""


@dataclass(frozen=True)
class CTAugmentConfig:
    """CTAugment (ReMixMatch, as FixMatch runs it): ``"ctaugment"`` with timm-style sections ``d`` (the rates'
    decay), ``t`` (the threshold under which a bin is not drawn), ``n`` (ops per image), and ``probe`` (draw every
    level uniformly and record it: the probe batches of the feedback). FixMatch's defaults."""

    depth: int = 2
    decay: float = 0.99
    threshold: float = 0.8
    probe: bool = False

    def __post_init__(self):
        if self.depth < 1:
            raise ValueError(f"ctaugment ops per image (n) must be >= 1, got {self.depth}")
        if not 0 < self.decay < 1:
            raise ValueError(f"ctaugment decay (d) must be in (0, 1), got {self.decay}")
        if not 0 <= self.threshold <= 1:
            raise ValueError(f"ctaugment threshold (t) must be in [0, 1], got {self.threshold}")


AutoAugmentSetting = RandAugmentConfig | AutoAugmentConfig | TrivialAugmentConfig | CTAugmentConfig


def split_config(config: str) -> tuple[str, dict[str, str]]:
    """``"rand-m9-mstd0.5"`` -> ``("rand", {"m": "9", "mstd": "0.5"})`` (timm's section syntax)."""
    head, *sections = config.split("-")
    out = {}
    for s in sections:
        parts = re.split(r"(\d.*)", s)
        if len(parts) >= 2:
            out[parts[0]] = parts[1]
    return head, out


def parse_auto_augment(text: str | None) -> AutoAugmentSetting | None:
    """The policy a recipe's ``auto_augment`` names; ``ValueError`` naming what is wrong."""
    if text is None:
        return None
    config = text.lower()
    head, kv = split_config(config)
    if head == "rand":
        return _rand_augment(config, kv)
    if config in ("trivialaugment", "trivialaugmentwide", "ta_wide"):
        return TrivialAugmentConfig()
    if head == "ctaugment":
        return parse_ctaugment(config)
    if head in ("original", "originalr"):
        if set(kv) - {"mstd"}:
            raise ValueError(f"unsupported AutoAugment section(s) in {config!r}; supported: mstd")
        return AutoAugmentConfig("original" if head == "original" else "originalr", float(kv.get("mstd", 0)))
    raise ValueError(
        f"auto_augment must be 'rand-...' (timm's RandAugment string), 'original', "
        f"'originalr', 'trivialaugment' or 'ctaugment[-d0.99-t0.8-n2][-probe]', got {text!r}"
    )


def _rand_augment(config: str, kv: dict[str, str]) -> RandAugmentConfig:
    unknown = set(kv) - {"m", "n", "p", "mstd", "mmax", "inc"}
    if unknown:
        raise ValueError(
            f"unsupported RandAugment section(s) {sorted(unknown)} in {config!r}; supported: m, n, p, mstd, mmax, inc"
        )
    return RandAugmentConfig(
        m=int(kv.get("m", 10)),
        n=int(kv.get("n", 2)),
        p=float(kv.get("p", 0.5)),
        mstd=float(kv.get("mstd", 0)),
        mmax=int(kv["mmax"]) if "mmax" in kv else None,
        increasing=bool(int(kv.get("inc", 0))),
    )


def parse_ctaugment(config: str) -> CTAugmentConfig:
    """``"ctaugment-d0.99-t0.8-n2"`` (any sections, any order) or ``"ctaugment-probe"``."""
    kw: dict = {}
    for s in config.lower().split("-")[1:]:
        key, value = s[:1], s[1:]
        try:
            if s == "probe":
                kw["probe"] = True
            elif key in ("d", "t") and value:
                kw["decay" if key == "d" else "threshold"] = float(value)
            elif key == "n" and value:
                kw["depth"] = int(value)
            else:
                raise ValueError
        except ValueError:
            raise ValueError(
                f"unsupported ctaugment section {s!r} in {config!r}; supported: d<decay>, t<threshold>, "
                "n<ops per image>, probe"
            ) from None
    return CTAugmentConfig(**kw)


def parse_color_jitter(cj: float | tuple[float, ...] | None) -> tuple[float, float, float, float] | None:
    """``color_jitter`` as (brightness, contrast, saturation, hue): one float is timm's (the same for the first
    three, no hue); three or four non-negative floats are torchvision's."""
    if cj is None:
        return None
    factors = (float(cj),) * 3 if isinstance(cj, (int, float)) else tuple(float(c) for c in cj)
    if len(factors) not in (3, 4) or min(factors) < 0:
        raise ValueError(f"color_jitter must be a float or 3 or 4 non-negative floats, got {factors}")
    b, c, s, *h = factors
    return b, c, s, h[0] if h else 0.0


def check_erasing(prob: float, mode: str, count: int) -> EraseMode:
    """Random erasing's settings (timm's ``re_prob``, ``re_mode``, ``re_count``) checked; the mode, as an
    :data:`EraseMode`."""
    if not 0 <= prob <= 1:
        raise ValueError(f"re_prob must be in [0, 1], got {prob}")
    if mode not in ERASE_MODES:
        raise ValueError(f"re_mode must be 'const', 'rand' or 'pixel', got {mode!r}")
    if count < 1:
        raise ValueError(f"re_count must be >= 1, got {count}")
    return mode
