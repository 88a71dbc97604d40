"""gpupipe/train/elastic.py: ``gpupipe train --resume`` under another number of ranks keeps the global batch (per-rank
batch or --accum fitted, said in one line) and trains on the very samples the straight run would have from the
checkpoint on; where the global batch cannot be kept, the LR schedule goes on by samples seen."""

import os
import subprocess
import sys

import pytest
import torch

from gpupipe.train.build import build_state
from gpupipe.train.elastic import as_saved_at, continue_schedule, fit, fit_world_size

from .common_utils import REPO_ROOT, make_folder, train_args, train_config

PROBE = os.path.join(os.path.dirname(__file__), "probe.py")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("elastic"), 4, 8)  # 32 samples: 4 steps of 8


def _run(ranks: int, tag: str, stop_after: int, data, out, *extra: str) -> subprocess.CompletedProcess:
    """``gpupipe train`` (batch 4, a checkpoint every step) over ``ranks`` processes, recording each rank's train
    batches (tests/probe.py ``seen``); with ``stop_after``, every rank exits after that many batches."""
    args = [PROBE, "seen", tag, str(stop_after), "--", "train", *train_args(data, out, *extra, save_every=1)]
    launch = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    launch += [] if ranks == 1 else ["--nproc_per_node", str(ranks)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([*launch, *args], env=env, capture_output=True, text=True, timeout=300)


def _steps(out, tag: str, ranks: int, accum: int) -> list[list[tuple[int, int]]]:
    """Each optimizer step's samples as (epoch, index), all ranks' micro-batches joined."""
    per_rank = [torch.load(out / f"seen-{tag}-rank{r}.pt", weights_only=True) for r in range(ranks)]
    micro = [[key for batches in per_rank for key in batches[j]] for j in range(len(per_rank[0]))]
    return [sorted(tuple(k) for m in micro[j : j + accum] for k in m) for j in range(0, len(micro), accum)]


@pytest.mark.slow
@pytest.mark.parametrize(("before", "after", "said"), [(2, 1, "batch 4 x accum 2"), (1, 2, "batch 2 x accum 1")])
def test_a_run_stopped_mid_epoch_resumes_on_another_number_of_ranks_with_the_same_samples(
    data, tmp_path, before, after, said
):
    """Stopped after 2 of 4 steps at ``before`` ranks, resumed with the same flags at ``after``: the global batch of
    8 or 4 is kept (the per-rank batch or --accum fitted, said in one line), and each optimizer step from the
    checkpoint on trains on the samples of the straight run's step."""
    straight, stopped = tmp_path / "straight", tmp_path / "run"
    assert _run(before, "straight", 0, data, straight).returncode == 0
    assert _run(before, "stopped", 2, data, stopped).returncode != 0  # every rank exited, as a preempted job
    resumed = _run(after, "resumed", 0, data, stopped, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    text = resumed.stdout + resumed.stderr
    assert f"over {after} rank(s) now: {said} keep the global batch" in text, text
    accum = 2 if after < before else 1
    expected = _steps(straight, "straight", before, 1)
    assert _steps(stopped, "stopped", before, 1) == expected[:2]
    assert _steps(stopped, "resumed", after, accum) == expected[2:]  # the rest of epoch 0, then epoch 1


def test_fit_keeps_the_global_batch_where_whole_numbers_allow():
    assert fit(4, 1, 2, 1) == (4, 2)  # 2 ranks -> 1: accumulate twice
    assert fit(4, 1, 1, 2) == (2, 1)  # 1 rank -> 2: half the batch each
    assert fit(8, 2, 4, 2) == (8, 4)
    assert fit(6, 1, 2, 4) == (3, 1)
    assert fit(3, 1, 1, 2) == (3, 1)  # no whole share: unchanged (the global batch changes)
    saved = {"world_size": 2, "batch_size": 4, "accum": 1, "lr": 0.1}
    assert as_saved_at(saved, 1) == {**saved, "batch_size": 4, "accum": 2} and as_saved_at(saved, 2) == saved
    assert as_saved_at({"batch_size": 4}, 2) == {"batch_size": 4}  # an earlier version's: nothing to fit


def test_the_lr_schedule_goes_on_by_samples_seen(tmp_path):
    """A run of 8 samples a step stopped after 10 steps (one epoch), resumed taking 16 a step: the schedule is at step
    5 of the new one, one epoch in, with the LR the old one had there."""
    cfg = train_config(tmp_path, tmp_path, epochs=4, warmup_epochs=0.4)  # 4 steps, then 2: whole numbers
    old = build_state(cfg, torch.nn.Linear(2, 2), torch.device("cpu"), steps_per_epoch=10)
    for _ in range(10):
        old.optimizer.step()
        old.scheduler.step()
    lr = old.scheduler.get_last_lr()
    new = build_state(cfg, torch.nn.Linear(2, 2), torch.device("cpu"), steps_per_epoch=5)
    new.scheduler.load_state_dict(old.scheduler.state_dict())
    continue_schedule(new, {"world_size": 1, "batch_size": 8, "accum": 1}, cfg, world=2)  # 2 x batch 8
    assert new.scheduler.last_epoch == 5
    assert new.scheduler.get_last_lr() == pytest.approx(lr)
    assert [g["lr"] for g in new.optimizer.param_groups] == pytest.approx(lr)


def test_another_batch_under_another_number_of_ranks_is_refused_naming_both_layouts_and_the_flags(tmp_path):
    """2 ranks x batch 4 x accum 1 resumed on 1 rank with --batch-size 8 (the same global batch): the refusal said
    "batch_size 4 -> 8; accum 2 -> 1", values neither side had, and not that the number of ranks changed."""
    path = tmp_path / "last.pt"
    torch.save({"config": {"world_size": 2, "batch_size": 4, "accum": 1}, "loader": {"epoch": 0, "batch": 1}}, path)
    with pytest.raises(ValueError) as e:
        fit_world_size(train_config(tmp_path, tmp_path, batch_size=8), path, 1)
    assert str(e.value) == (
        f"{path}: saved with 2 rank(s) x batch 4 x accum 1 (global batch 8); asked: 1 rank(s) x batch 8 x accum 1 "
        "(global batch 8): the number of ranks changed, and the per-rank batch and accum resume as saved; pass "
        "--batch-size 4 --accum 1 (over 1 rank(s): batch 4 x accum 2), or start a new run in another --out"
    )
    for flags in ({"batch_size": 4}, {"batch_size": 4, "accum": 2}):  # what the line says, and its fit: both resume
        cfg, said = fit_world_size(train_config(tmp_path, tmp_path, **flags), path, 1)
        assert (cfg.batch_size, cfg.accum) == (4, 2) and said is not None


def test_the_number_of_ranks_changed_is_said_in_one_line(tmp_path):
    """Kept, not kept (the global batch changes) and unknown (a checkpoint of an earlier version, mid-epoch): each a
    line; the user's own other batch is left to the settings' comparison."""
    path = tmp_path / "last.pt"

    def saved(config: dict, batch: int = 2) -> None:
        torch.save({"config": config, "loader": {"epoch": 0, "batch": batch}}, path)

    saved({"world_size": 1, "batch_size": 8, "accum": 1})
    cfg, said = fit_world_size(train_config(tmp_path, tmp_path, batch_size=8), path, 2)
    assert (cfg.batch_size, cfg.accum) == (4, 1)
    assert said == (
        f"{path}: saved with 1 rank(s) x batch 8 x accum 1 (global batch 8); over 2 rank(s) now: batch 4 x accum 1 "
        "keep the global batch"
    )
    saved({"world_size": 1, "batch_size": 3, "accum": 1})
    cfg, said = fit_world_size(train_config(tmp_path, tmp_path, batch_size=3), path, 2)
    assert (cfg.batch_size, cfg.accum) == (3, 1) and said is not None and "\n" not in said
    assert said.endswith(
        "global batch 6: the epoch's remaining samples are re-split into steps of 6 and the LR schedule goes on by "
        "samples seen"
    )
    cfg, said = fit_world_size(train_config(tmp_path, tmp_path, batch_size=3), path, 1)
    assert said is None
    user = train_config(tmp_path, tmp_path, batch_size=5)
    with pytest.raises(ValueError, match=r"saved with 1 rank\(s\) x batch 3 x accum 1 .* asked: 2 rank\(s\) x batch 5"):
        fit_world_size(user, path, 2)  # neither the saved flags nor their fit: refused, saying which
    saved({"batch_size": 3, "accum": 1})  # an earlier version's checkpoint, mid-epoch
    cfg, said = fit_world_size(train_config(tmp_path, tmp_path, batch_size=3), path, 2)
    assert said is not None and "records no number of ranks" in said and "epoch 0 batch 2" in said
    saved({"batch_size": 3, "accum": 1}, batch=0)  # ... at an epoch's start: nothing to say
    assert fit_world_size(train_config(tmp_path, tmp_path, batch_size=3), path, 2)[1] is None
