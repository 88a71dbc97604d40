"""CTAugment: draws follow the weights, the feedback is FixMatch's, ranks agree, the snapshots make resume exact."""

import multiprocessing
import pickle
import random
from collections import Counter

import numpy as np
import pytest
import torch

from gpupipe.augment import Policy
from gpupipe.augment.ctaugment import CT_OPS, NUM_RATES, CTAugment, CTWeights, encode_records, proximity
from gpupipe.augment.ctaugment.policy import _to_op
from gpupipe.recipe import Recipe

from .common_utils import on_two_gloo_ranks

ROTATE = [name for name, _ in CT_OPS].index("rotate")


class FixMatchCTA:
    """The oracle: FixMatch's ``libml/ctaugment.py`` rate rules, line for line (numpy, float32 as there)."""

    def __init__(self, depth=2, th=0.8, decay=0.99):
        self.decay, self.depth, self.th = decay, depth, th
        self.rates = {k: tuple(np.ones(x, "f") for x in bins) for k, bins in CT_OPS}

    def rate_to_p(self, rate):
        p = rate + (1 - self.decay)
        p = p / p.max()
        p[p < self.th] = 0
        return p

    def update_rates(self, policy, proximity):
        for k, bins in policy:
            for p, rate in zip(bins, self.rates[k], strict=False):
                p = int(p * len(rate) * 0.999)
                rate[p] = rate[p] * self.decay + proximity * (1 - self.decay)

    def flat(self):
        return np.concatenate([r for k, _ in CT_OPS for r in self.rates[k]])


def _rates_with(op: str, values) -> list[float]:
    """All ones but ``op``'s first magnitude."""
    at = sum(sum(b) for name, b in CT_OPS[: [n for n, _ in CT_OPS].index(op)])
    rates = [1.0] * NUM_RATES
    rates[at : at + len(values)] = values
    return rates


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    df = len(counts) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def test_the_op_table_is_fixmatchs():
    assert len(CT_OPS) == 19 and NUM_RATES == 303
    bins = dict(CT_OPS)
    assert bins["identity"] == () and bins["posterize"] == (8,) and bins["rescale"] == (17, 6)
    assert all(b == (17,) for name, b in CT_OPS if name not in ("identity", "posterize", "rescale"))


def test_draws_follow_the_weights_and_skip_bins_under_the_threshold():
    # rotate's bins: decreasing rates, the last four under the threshold once normalised
    values = [1.0, 0.97, 0.95, 0.93, 0.9, 0.88, 0.86, 0.85, 0.84, 0.83, 0.82, 0.81, 0.8, 0.5, 0.3, 0.1, 0.0]
    cta = CTAugment(32)
    cta.rates = _rates_with("rotate", values)
    w = cta.weights()
    p = np.array(w.probabilities("rotate"))
    assert np.allclose(p, FixMatchCTA().rate_to_p(np.array(values, "f") + 0), atol=1e-6)
    assert (p[-4:] == 0).all() and (p[:13] > 0).all()
    counts = Counter()
    for i in range(60_000):
        for name, levels in cta.choose(0, 0, i, w).record:
            if name == "rotate":
                counts[int(levels[0] * 17)] += 1
    assert not set(counts) & {13, 14, 15, 16}  # under the threshold: never drawn
    drawn = np.array([counts[b] for b in range(13)], dtype=np.float64)
    assert drawn.sum() > 5000  # 2 layers, 1 op in 19
    assert _chi2_pvalue(drawn, p[:13] / p[:13].sum()) > 1e-3


def test_ops_are_drawn_uniformly_and_levels_fall_inside_their_bins():
    cta = CTAugment(32)
    w = CTWeights(_rates_with("posterize", [0.0] * 7 + [1.0]), 0.99, 0.8)
    ops, levels = Counter(), []
    for i in range(20_000):
        for name, lv in cta.choose(1, 2, i, w).record:
            ops[name] += 1
            if name == "posterize":
                levels.append(lv[0])
    assert _chi2_pvalue(np.array([ops[n] for n, _ in CT_OPS], dtype=np.float64), np.full(19, 1 / 19)) > 1e-3
    assert levels and all(7 / 8 <= v < 1 for v in levels)  # the only drawable bin, uniform inside it


def test_probe_draws_are_uniform_and_ignore_the_weights():
    probe = CTAugment(32, probe=True)
    probe.rates = _rates_with("rotate", [1.0] + [0.0] * 16)
    levels = [lv[0] for i in range(20_000) for name, lv in probe.choose(0, 0, i).record if name == "rotate"]
    counts = np.bincount([int(v * 17) for v in levels], minlength=17).astype(np.float64)
    assert _chi2_pvalue(counts, np.full(17, 1 / 17)) > 1e-3


def test_update_matches_fixmatch_on_hand_made_cases():
    cta = CTAugment(32)
    cta.update([(("rotate", (0.5,)), ("identity", ()))], [0.3])
    at = sum(sum(b) for _, b in CT_OPS[:ROTATE]) + 8  # int(0.5 * 17 * 0.999) = 8
    assert cta.rates[at] == pytest.approx(0.99 + 0.003)
    assert sum(r != 1.0 for r in cta.rates) == 1
    # a level of 1.0 lands in the last bin (the 0.999), twice on one bin is two steps, bools are 0/1 accuracy
    cta.update([(("solarize", (1.0,)), ("solarize", (0.999,)))], torch.tensor([False]))
    sol = sum(sum(b) for _, b in CT_OPS[: [n for n, _ in CT_OPS].index("solarize")]) + 16
    assert cta.rates[sol] == pytest.approx(0.99 * 0.99)


def test_update_matches_fixmatch_on_random_records():
    rng = random.Random(0)
    records, scores = [], []
    for _ in range(400):
        layers = []
        for _ in range(2):
            name, bins = CT_OPS[rng.randrange(19)]
            layers.append((name, tuple(rng.random() for _ in bins)))
        records.append(tuple(layers))
        scores.append(rng.random())
    oracle = FixMatchCTA()
    for r, s in zip(records, scores, strict=True):
        oracle.update_rates(r, s)
    cta = CTAugment(32)
    cta.update(records[:150], scores[:150])
    cta.update(records[150:], scores[150:])
    assert np.allclose(cta.rates, oracle.flat(), atol=1e-5)
    assert not np.allclose(cta.rates, 1.0)


def test_bad_records_and_strings_raise_value_error():
    cta = CTAugment(32)
    for records, scores in [([(("spin", (0.5,)),)], [1.0]), ([(("rotate", (1.5,)),)], [1.0]), ([()], [1.0, 0.0])]:
        with pytest.raises(ValueError):
            cta.update(records, scores)
    for s in ["ctaugment-x3", "ctaugment-d", "ctaugment-d1.5", "ctaugment-n0", "ctaugment-tq", "ctaug"]:
        with pytest.raises(ValueError):
            Recipe(auto_augment=s)
    c = CTAugment.from_string("CTAugment-d0.95-t0.7-n3-probe", 64)
    assert (c.decay, c.threshold, c.depth, c.probe, c.size) == (0.95, 0.7, 3, True, 64)


def test_proximity_is_fixmatchs():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.0, 0.0, 1.0]])
    expected = [1 - 0.5 * (0.3 + 0.2 + 0.1), 0.0]
    assert torch.allclose(proximity(probs, torch.tensor([0, 1])), torch.tensor(expected, dtype=torch.float64))


def test_one_image_and_a_batch_give_the_same_pixels():
    policy = Policy(Recipe(32, auto_augment="ctaugment-n3-t0.5"))
    cta = policy.ctaugment
    w = CTWeights([random.Random(i).random() for i in range(NUM_RATES)], 0.99, 0.5)
    draws = [cta.choose(0, 1, i, w) for i in range(120)]
    assert [d.ops for d in draws] == [policy.draw(0, 1, i, w) for i in range(120)]
    assert {name for d in draws for name, _ in d.record} == {name for name, _ in CT_OPS}
    x = torch.randint(0, 256, (120, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    batched = policy.apply(x, [d.ops for d in draws])
    one_by_one = torch.stack([policy.apply(x[i : i + 1], [draws[i].ops])[0] for i in range(120)])
    assert torch.equal(batched, one_by_one) and batched.dtype == torch.uint8
    changed = (batched != x).flatten(1).any(1)
    assert changed.float().mean() > 0.8


def _draw_in_worker(args):
    weights, keys = args
    cta = CTAugment(32)
    return [cta.choose(5, e, i, weights) for e, i in keys]


def test_a_worker_draws_what_the_device_stage_draws_from_the_same_snapshot():
    """The decode workers get the batch's snapshot pickled with its keys; the device stage draws in the main
    process from the same snapshot: the same records and ops (hence pixels, see above)."""
    cta = CTAugment(32)
    cta.update(CTAugment(32, probe=True).records(0, [(0, i) for i in range(500)]), np.linspace(0, 1, 500))
    w = cta.weights()
    keys = [(3, i) for i in range(64)]
    with multiprocessing.get_context("fork").Pool(1) as pool:
        in_worker = pool.map(_draw_in_worker, [(w, keys)])[0]
    assert in_worker == [cta.choose(5, e, i, w) for e, i in keys]
    assert in_worker != [CTAugment(32).choose(5, e, i) for e, i in keys]  # the weights matter
    assert pickle.loads(pickle.dumps(w)).rates == w.rates


def test_state_round_trips_and_checks_its_size():
    a = CTAugment(32)
    a.update([(("blur", (0.2,)), ("rescale", (0.4, 0.9)))], [0.0])
    b = CTAugment(32)
    b.load_state_dict(pickle.loads(pickle.dumps(a.state_dict())))
    assert b.rates == a.rates and b.weights().rates == a.weights().rates
    with pytest.raises(ValueError):
        b.load_state_dict({"rates": torch.ones(5)})


def _updates() -> tuple:
    rank = torch.distributed.get_rank()
    cta, deferred = CTAugment(32), CTAugment(32)
    probe = CTAugment(32, probe=True)
    gathers, all_gather = [], torch.distributed.all_gather

    def counted(*args, **kwargs):
        gathers.append(1)
        return all_gather(*args, **kwargs)

    torch.distributed.all_gather = counted
    after_two, deferred_gathers = None, 0
    for step in range(3):
        n = 5 + rank  # ranks may hold different counts
        records = probe.records(rank, [(step, i) for i in range(n)])
        cta.update(records, torch.linspace(0, 1, n))
        before = len(gathers)
        deferred.update(records, torch.linspace(0, 1, n), defer=True, capacity=6)  # the probe batch's size
        deferred_gathers += len(gathers) - before
        if step == 1:
            after_two = cta.rates
    return cta.rates, deferred.rates, after_two, deferred_gathers


def test_two_ranks_agree_after_updates():
    results = on_two_gloo_ranks(_updates)
    got = {rank: r[0] for rank, r in results.items()}
    assert got[0] == got[1]
    for _rates, deferred, after_two, gathers in results.values():  # deferred: one step behind, one collective each
        assert deferred == after_two and gathers == 3
    # and they equal one process applying rank 0's records, then rank 1's, step by step
    one, probe = CTAugment(32), CTAugment(32, probe=True)
    for step in range(3):
        for rank in range(2):
            n = 5 + rank
            one.update(probe.records(rank, [(step, i) for i in range(n)]), torch.linspace(0, 1, n), distributed=False)
    assert np.allclose(got[0], one.rates, atol=1e-12)


def test_encode_records_uses_the_bins_offsets():
    codes = encode_records([(("identity", ()), ("rescale", (0.0, 1.0)))], 2)
    rescale = sum(sum(b) for name, b in CT_OPS[: [n for n, _ in CT_OPS].index("rescale")])
    assert codes.tolist() == [[-1, -1, rescale, rescale + 17 + 5]]


def test_its_own_ops_are_pils_as_fixmatch_calls_them():
    """blur, smooth and the blends against PIL, to the bit; posterize and solarize with FixMatch's level maps."""
    from PIL import Image, ImageFilter, ImageOps

    from gpupipe.augment import OPS, Op

    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)
    pil = Image.fromarray(a)
    policy = Policy(Recipe(24, auto_augment="ctaugment"))
    x = torch.from_numpy(a).permute(2, 0, 1)[None]

    def ours(name, *args):
        return policy.apply(x, [(Op(name, args),)])[0].permute(1, 2, 0).numpy()

    assert np.array_equal(ours("CtBlur", 1.0), np.asarray(pil.filter(ImageFilter.BLUR)))
    assert np.array_equal(ours("CtSmooth", 1.0), np.asarray(pil.filter(ImageFilter.SMOOTH)))
    assert np.array_equal(ours("CtInvert", 0.3), np.asarray(Image.blend(pil, ImageOps.invert(pil), 0.3)))
    assert np.array_equal(ours("CtBlur", 0.6), np.asarray(Image.blend(pil, pil.filter(ImageFilter.BLUR), 0.6)))
    for level in (0.0, 0.5, 0.99):
        post, sol = (_to_op(name, [level], random.Random(), 24) for name in ("posterize", "solarize"))
        assert np.array_equal(ours(post.name, *post.args), np.asarray(ImageOps.posterize(pil, 1 + int(level * 7.999))))
        assert np.array_equal(ours(sol.name, *sol.args), np.asarray(ImageOps.solarize(pil, int(level * 255.999))))
    assert {"CtBlur", "CtSmooth", "CtCutout", "CtRescaleBicubic"} <= set(OPS)


def test_a_deferred_update_reads_no_score_until_the_next_and_resumes_where_it_waited():
    """``update(defer=True)`` leaves its scores where they are (here on the meta device, which cannot be read) and
    applies the previous deferred update; the waiting one is in ``state_dict``, so a policy restored from it goes on
    as the one that was not interrupted; and the rates are those of the updates made at once, one step later."""
    rng = np.random.default_rng(1)
    batches = []
    for _ in range(4):
        records = CTAugment(32, probe=True).records(0, [(0, int(i)) for i in rng.integers(0, 1000, 8)])
        batches.append((records, torch.as_tensor(rng.random(8), dtype=torch.float64)))
    meta = CTAugment(32)
    meta.update(batches[0][0], batches[0][1].to("meta"), defer=True)  # nothing read: meta tensors have no values
    assert meta.rates == [1.0] * 303
    now, later = CTAugment(32), CTAugment(32)
    for k, (records, scores) in enumerate(batches):
        later.update(records, scores, defer=True)
        if k:
            now.update(*batches[k - 1])
        assert later.rates == now.rates
        if k == 1:  # a checkpoint between two steps, restored into a new policy
            restored = CTAugment(32)
            restored.load_state_dict(later.state_dict())
            later = restored
