"""CTAugment's feedback loop in the loaders: every backend draws each batch from the weights snapshot its clock names,
in the decode workers or on the device; updates reach the draws; a resumed run draws as the straight one; a probe
loader's records are what it applied."""

import dataclasses
import pickle

import pytest
import torch

import gpupipe
from gpupipe.augment import CTAugment, Policy
from gpupipe.augment.adaptive import lag_for
from gpupipe.augment.ctaugment.feedback import WeightsClock
from gpupipe.bench.host_budget import meta_loader
from gpupipe.recipe import Recipe

from .common_utils import CPU_LOADER_BACKENDS, DECODERS, make_folder

SIZE = 40


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """3 classes x 4 JPEGs: 3 batches of 4 per epoch."""
    return make_folder(tmp_path_factory.mktemp("ct"), 3, 4)


def _loader(folder, backend="pillow", aa="ctaugment", *, device_path=False, **kw):
    args = {**dict(batch_size=4, num_workers=0, normalize=False, device="cpu", seed=3), **kw}
    if args["num_workers"] > 0:
        args["prefetch_factor"] = 1  # DataLoader's queue: workers * 1 batches ahead
    loader = gpupipe.build_loader(folder, backend, recipe=Recipe(SIZE, auto_augment=aa), **args)
    if device_path and hasattr(loader, "_data"):
        # as on CUDA: the workers only crop; the device stage augments, batched
        loader.placement = dataclasses.replace(loader.placement, augment="device")
        loader._data.augment = None
    return loader


_PROBE = CTAugment(SIZE, depth=1, probe=True)


def _feedback(cta: CTAugment, g: int) -> None:
    """A fixed function of the step: rotations in the first bins fail, the rest are scored by a formula."""
    records = _PROBE.records(0, [(g, j) for j in range(6)]) + [(("rotate", ((j % 5 + 0.5) / 17,)),) for j in range(6)]
    cta.update(records, [(g * 7 + j) % 5 / 4 for j in range(6)] + [0.0] * 6)


def _run(loader, epochs, saves=None):
    """Batches of ``epochs`` with the feedback after each; (g, images, weights the batch drew from) per batch. With
    ``saves`` (a dict), the loader's state after each step goes there, by step."""
    out = []
    for epoch in epochs:
        loader.set_epoch(epoch)
        for images, _ in loader:
            g = epoch * len(loader) + loader.state_dict()["batch"] - 1
            out.append((g, images, loader.snapshots.for_batch(g)))
            _feedback(loader.ctaugment, g)
            if saves is not None:
                saves[g] = pickle.loads(pickle.dumps(loader.state_dict()))
    return out


@pytest.mark.parametrize(
    ("backend", "device_path", "workers"),
    [(b, False, 1) for b in DECODERS] + [(b, True, 0) for b in CPU_LOADER_BACKENDS],
)
def test_each_batch_draws_from_its_snapshot_on_every_backend_and_path(folder, backend, device_path, workers):
    """The pixels are the plain crops with ``Policy.draw(seed, epoch, index, snapshot of the batch)`` applied, in a
    decode worker (the snapshot sent with the keys) or on the device (sent with the batch); the updates reach the
    draws within the clock's lag."""
    loader = _loader(folder, backend, device_path=device_path, num_workers=workers)
    assert loader.snapshots.lag == lag_for(0 if device_path else workers * 1)  # prefetch_factor 1
    assert loader.weights_clock is loader.snapshots  # its public name
    ran = _run(loader, [0, 1])
    plain = _loader(folder, backend, aa=None)
    policy = Policy(Recipe(SIZE, auto_augment="ctaugment"))
    for epoch in (0, 1):
        plain.set_epoch(epoch)
        keys = plain.sampler.batches(epoch)
        for k, (crops, _) in enumerate(plain):
            g, images, weights = ran[epoch * len(plain) + k]
            expected = policy.apply(crops, [policy.draw(3, epoch, i, weights) for i in keys[k]])
            assert torch.equal(images, expected), (backend, g)
    assert ran[0][2].rates == (1.0,) * len(ran[0][2].rates)
    assert ran[-1][2].rates != ran[0][2].rates  # the feedback reached the draws


@pytest.mark.parametrize("backend", CPU_LOADER_BACKENDS)
def test_a_resumed_run_draws_exactly_as_the_straight_one(folder, backend):
    workers = 1 if backend in DECODERS else 0
    straight = _loader(folder, backend, num_workers=workers)
    saves: dict = {}
    whole = _run(straight, [0, 1], saves)
    at = len(straight) + 1  # epoch 1, batch 1
    saved = saves[at - 1]
    assert saved["batch"] == 1 and len(saved["ctaugment"]["policy"]["rates"]) == 303
    resumed = _loader(folder, backend, num_workers=workers)
    resumed.load_state_dict(saved)
    rest = []
    resumed.set_epoch(1)
    for images, _ in resumed:
        g = len(resumed) + resumed.state_dict()["batch"] - 1
        rest.append(images)
        _feedback(resumed.ctaugment, g)
    assert len(rest) == len(whole) - at
    for (_g, a, _w), b in zip(whole[at:], rest, strict=True):
        assert torch.equal(a, b)
    assert resumed.ctaugment.rates == straight.ctaugment.rates
    # the rates alone would not do: the batches in flight at the save drew from older snapshots
    assert (
        saved["ctaugment"]["clock"]["snapshots"][at - 1 - resumed.snapshots.lag].tolist()
        != saved["ctaugment"]["policy"]["rates"].tolist()
    )


@pytest.mark.parametrize("backend", CPU_LOADER_BACKENDS)
def test_a_probe_loader_records_what_it_applied(folder, backend):
    probe = _loader(folder, backend, aa="ctaugment-probe")
    assert probe.snapshots is None and "ctaugment" not in probe.state_dict()
    plain = _loader(folder, backend, aa=None)
    policy = Policy(Recipe(SIZE, auto_augment="ctaugment-probe"))
    keys = plain.sampler.batches(0)
    for k, ((images, _), (crops, _)) in enumerate(zip(probe, plain, strict=True)):
        draws = [policy.ctaugment.choose(3, 0, i) for i in keys[k]]
        assert probe.records == [d.record for d in draws]
        assert torch.equal(images, policy.apply(crops, [d.ops for d in draws]))


def test_the_clock_keeps_only_what_the_next_batches_need():
    cta = CTAugment(SIZE)
    clock = WeightsClock(cta, lag=3)
    first = cta.weights()
    for g in range(10):
        assert clock.for_batch(g) is (first if g < 3 else clock._snaps[g - 3])
        clock.delivered(g)
        cta.update([(("blur", (0.5,)),)], [0.0])
    assert len(clock.state_dict()["snapshots"]) <= 5
    restored = WeightsClock(CTAugment(SIZE), lag=7)
    restored.load_state_dict(pickle.loads(pickle.dumps(clock.state_dict())))
    assert restored.lag == 3 and all(restored.for_batch(g).rates == clock.for_batch(g).rates for g in (10, 11, 12))


def _run_clock(lag: int, batches: int, resume_at: int | None = None, state=None):
    """A loader's use of the clock: batch g draws when it is dispatched (``lag - 1`` batches ahead, as the workers
    run), then is delivered, then the user's feedback updates the weights. Returns the draws from ``resume_at``."""
    cta = CTAugment(32)
    probe = CTAugment(32, depth=1, probe=True)
    clock = WeightsClock(cta, lag)
    start = 0
    if state is not None:
        cta.load_state_dict(state["policy"])
        clock.load_state_dict(state["clock"])
        start = resume_at
    draws, saved = {}, None
    for g in range(start, batches):
        for ahead in range(g, min(g + lag - 1, batches)):  # dispatch what the workers would have queued
            draws.setdefault(ahead, [cta.choose(0, 0, 8 * ahead + j, clock.for_batch(ahead)).record for j in range(8)])
        clock.delivered(g)
        records = probe.records(0, [(0, 8 * g + j) for j in range(8)])
        records += [(("rotate", ((j % 4 + 0.5) / 17,)),) for j in range(8)]  # rotate's first four bins fail
        cta.update(records, [(g * 7 + j) % 5 / 4 for j in range(8)] + [0.0] * 8)
        if resume_at is not None and g == resume_at - 1:
            saved = {"policy": cta.state_dict(), "clock": clock.state_dict()}
    return draws, saved


def test_snapshots_make_a_resumed_run_draw_as_the_straight_one():
    straight, saved = _run_clock(lag=4, batches=30, resume_at=17)
    resumed, _ = _run_clock(lag=4, batches=30, resume_at=17, state=pickle.loads(pickle.dumps(saved)))
    assert {g: straight[g] for g in resumed} == resumed and min(resumed) == 17
    rotations = [lv[0] for g in range(20, 30) for r in straight[g] for name, lv in r if name == "rotate"]
    assert rotations and min(rotations) >= 4 / 17  # the feedback reached the draws: the failing bins are gone


def _device_path_reference(folder):
    """The CPU loader whose device stage draws, as a loader for a GPU does: no decode worker draws (with one, a CPU
    loader's clock lags by its queue too: ``lag_for(1)``, not ``lag_for(0)``)."""
    return _loader(folder, num_workers=0, device_path=True)


@pytest.mark.parametrize("backend", ["pillow", "nvjpeg"])
@pytest.mark.parametrize("workers", [0, 1, 2])
def test_off_the_cpu_the_device_stage_draws_with_its_lag_whatever_the_workers(folder, backend, workers):
    """The lag rule for a device that is not the CPU (the meta device stands in for CUDA, as in the host-budget
    bench): the device stage draws, so the lag is ``lag_for(0)`` with any number of decode workers, and the CPU
    reference of the CUDA test below draws every batch from the same snapshot (it kept a 1-worker CPU loader's lag,
    3, and its rates differed from the CUDA loader's)."""
    recipe = Recipe(SIZE, auto_augment="ctaugment")
    meta = meta_loader(str(folder), backend, recipe, batch=4, workers=workers)
    assert meta.device.type == "meta" and meta.snapshots.lag == lag_for(0)
    reference = _run(_device_path_reference(folder), [0, 1])
    for (g, _, wa), (h, images, wb) in zip(reference, _run(meta, [0, 1]), strict=True):
        assert g == h and wa.rates == wb.rates, g
        assert images.device.type == "meta"
    assert reference[-1][2].rates != reference[0][2].rates  # the feedback reached the draws


@pytest.mark.gpu
def test_the_cuda_device_path_draws_what_the_cpu_workers_draw(folder):
    """With the same feedback, the batched CUDA path and the CPU device stage draw from the same snapshots."""
    cpu = _run(_device_path_reference(folder), [0, 1])
    cuda = _run(_loader(folder, num_workers=1, device="cuda"), [0, 1])
    for (g, a, wa), (h, b, wb) in zip(cpu, cuda, strict=True):
        assert g == h and wa.rates == wb.rates
        assert b.is_cuda and (b.cpu().float() - a.float()).abs().mean() < 1.0  # float rounding differs by device
