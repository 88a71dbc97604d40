"""Per-image augmentation after the crop: RandAugment, AutoAugment, TrivialAugment, CTAugment (with its feedback,
:mod:`.ctaugment`), colour jitter, random erasing.

Where each part lives: :mod:`.parse` reads the recipe's settings (policy strings, jitter, erasing); :mod:`.ops`
is the op table (name -> kernel and timm's level function; a new op is one entry there); :mod:`.kernels` the
batched pixel kernels; :mod:`.policies` one class per policy and :class:`Policy`, which combines them;
:mod:`.plan` a batch's draws as columns; :mod:`.fused` the family calls that apply them; :mod:`.sample` the
per-sample driver.

Three steps, so every backend and device gives the same pixels for the same sample:

1. :meth:`Policy.plan` draws the ops of a batch of sample keys ``(seed, epoch, index)`` as columns (position k of
   every sample's record). RandAugment and random erasing draw the whole batch at once from each sample's
   counter-based key (:mod:`gpupipe.draws`: a hash of the key and a counter, so a sample's draws never depend on
   its batch or worker); the other policies from the sample's own stream ``random.Random(f"{seed}/{epoch}/{index}
   /aug")``. The crop's stream, :meth:`gpupipe.recipe.Recipe.train_draws`, is untouched, so the plain recipe keeps its
   pixels. :meth:`Policy.draw` is one sample's record.
2. :meth:`Policy.apply_plan` (or :meth:`Policy.apply`, from records) applies them to a (N,3,H,W) uint8 batch on
   its device, image by image in meaning but batched in work: per position, one call per family of ops over every
   image that draws one (:mod:`.fused`: all geometric ops are one warp, all pointwise ops and blends one call),
   each image with its own parameters. The decode workers call it with N=1, the GPU device stage with the whole
   batch; the kernels are elementwise or exact per image, so both give the same pixels.
3. :class:`SampleAugment` adds the user's ``transforms=`` (per image by default, or batch-wise) and is what the
   loader and the device stage hold.

Semantics: the strings mean what timm's ``rand_augment_transform`` / ``auto_augment_transform`` make of them (the
same op lists, level functions, ``m``, ``n``, ``p``, ``mstd``, ``mmax``, ``inc``; ``fill`` = the recipe mean, as
timm's ``create_transform``), ``"trivialaugment"`` is torchvision's ``TrivialAugmentWide`` (31 bins, fill 0,
nearest), ``color_jitter`` is torchvision's ``ColorJitter`` as timm builds it (one float: brightness = contrast =
saturation). The pixel maths are torchvision v2's tensor kernels (``autocontrast``, ``equalize``, ``invert`` are
called as they are; the blends take one factor per image), not PIL's: geometric ops sample bilinearly (timm picks
bilinear or bicubic at random), contrast blends with the mean of the uint8 grayscale.

Random erasing runs here, on uint8 before normalization (timm erases normalized floats): ``const`` fills with the
recipe mean (0 after normalization, as timm), ``rand``/``pixel`` with normal noise of the normalized space, i.e.
``mean + std * N(0, 1)`` per channel on the 0-255 scale, clamped to [0, 255] and rounded. The noise is a hash of
(sample, channel, row, column) looked up in a normal quantile table, so it is the same on any device and batch.
"""

from .ctaugment import CTAugment, CTWeights, proximity
from .ops import OPS, Op, OpSpec, Record
from .policies import AutoAugment, ColorJitter, Policy, RandAugment, RandomErasing, TrivialAugment
from .sample import SampleAugment, TransformsMode, as_transform

__all__ = [
    "OPS",
    "AutoAugment",
    "CTAugment",
    "CTWeights",
    "ColorJitter",
    "Op",
    "OpSpec",
    "Policy",
    "RandAugment",
    "RandomErasing",
    "Record",
    "SampleAugment",
    "TransformsMode",
    "TrivialAugment",
    "as_transform",
    "proximity",
]
