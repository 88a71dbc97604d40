"""``gpupipe train --aa ctaugment``: the probe batches move the weights, the checkpoint holds them, resume restores
them into the train loader."""

import dataclasses

import pytest
import torch

from gpupipe.recipe import Recipe
from gpupipe.train import checkpoint
from gpupipe.train.feedback import probe_recipe
from gpupipe.train.loop import build_loaders, train

from .common_utils import make_folder, train_config

pytest.importorskip("timm")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("train_ct"), 2, 4)


def test_probe_recipe_keeps_the_settings():
    recipe = Recipe(32, auto_augment="ctaugment-d0.9-n3", re_prob=0.25)
    assert probe_recipe(recipe) == dataclasses.replace(recipe, auto_augment="ctaugment-d0.9-n3-probe")
    assert probe_recipe(probe_recipe(recipe)) == probe_recipe(recipe)


@pytest.mark.slow  # trains
def test_training_moves_the_weights_and_checkpoints_them(data, tmp_path):
    # the default workers (every usable core): where the CPU workers normalise, and the probe batches must not see it
    cfg = train_config(data, tmp_path / "run", aa="ctaugment-d0.9", epochs=1, batch_size=4, workers=None)
    train(cfg)
    saved = checkpoint.load(tmp_path / "run" / "checkpoints" / "last.pt")
    state = saved["loader"]["ctaugment"]
    rates = state["policy"]["rates"]
    assert rates.dtype == torch.float64 and len(rates) == 303
    assert not torch.equal(rates, torch.ones(303))  # the probe batches' scores moved the bins they used
    assert state["clock"]["snapshots"]  # what the next batches draw from
    # a resumed run's train loader draws from these weights and snapshots
    loader, _, feedback = build_loaders(cfg, torch.device("cpu"))
    assert feedback is not None and feedback.probe.ctaugment.probe
    loader.load_state_dict(saved["loader"])
    assert loader.ctaugment.rates == rates.tolist()


@pytest.mark.slow
def test_a_killed_ctaugment_run_resumes_to_the_straight_runs_weights_and_rates(data, tmp_path):
    """The feedback's update is applied one step late (its scores reach the host without the host waiting for the
    GPU); the one still waiting is in the checkpoint, so a run killed mid-epoch and resumed ends with the straight
    run's weights and CTAugment rates."""
    import subprocess

    from .common_utils import killed_at_first_checkpoint, train_cli

    def cli(out, **extra):
        return train_cli(data, out, epochs=2, batch_size=2, save_every=1, aa="ctaugment-d0.9", **extra)

    subprocess.run(cli(tmp_path / "straight"), check=True)
    out = tmp_path / "killed"
    ckpt = killed_at_first_checkpoint(cli(out), out)
    subprocess.run(cli(out, resume=True), check=True)
    a, b = checkpoint.load(tmp_path / "straight" / "checkpoints" / "last.pt"), checkpoint.load(ckpt)
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    rates = [s["loader"]["ctaugment"]["policy"]["rates"] for s in (a, b)]
    assert torch.equal(*rates) and not torch.equal(rates[0], torch.ones(303))
    assert "pending" in a["loader"]["ctaugment"]["policy"]  # the last probe's update, applied by a next step
