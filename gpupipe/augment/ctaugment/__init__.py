"""CTAugment (ReMixMatch's adaptive policy, as FixMatch runs it), whole: its op bins, weights and draws
(:mod:`.policy`), the update of its weights from the model's scores (:mod:`.update`), and its side of a loader
(:mod:`.feedback`: the loader hook, which snapshot each batch draws from, a probe loader's records)."""

from ..adaptive import LOADER_NAMES
from .feedback import CTAdaptive
from .policy import CT_OPS, NUM_RATES, CTAugment, CTDraw, CTRecord, CTWeights, encode_records
from .update import proximity

# ``loader.ctaugment``: the policy; ``loader.weights_clock``: which weights each batch draws from (None without it)
LOADER_NAMES.update(ctaugment=None, weights_clock=None)

__all__ = [
    "CT_OPS",
    "NUM_RATES",
    "CTAdaptive",
    "CTAugment",
    "CTDraw",
    "CTRecord",
    "CTWeights",
    "encode_records",
    "proximity",
]
