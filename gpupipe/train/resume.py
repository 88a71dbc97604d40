"""A run's checkpoint in ``--out``: whether this run resumes it, what may change on resume, restoring and saving it.

What a checkpoint holds is ``checkpoint.TrainState`` (and ``checkpoint.save``/``restore``); this module is the run's
side: the refusals before any data is read, the settings compared with the saved ones, the loader's position.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from dataclasses import asdict, fields
from pathlib import Path

from ..data.loader import Loader
from ..sources.named import resolved
from . import checkpoint, elastic
from .checkpoint import TrainState
from .config import RESUME_CHANGEABLE, RESUME_FIXED, RUN_MODE, TrainConfig
from .distributed import Distributed
from .logging import Meter


def resuming(cfg: TrainConfig, out: Path, ckpt_path: Path) -> Path | None:
    """The checkpoint this run resumes from (``--resume-from``'s, or ``out``'s last), or None for a new run. Refuses,
    before any data is read, to overwrite a run or to resume one that saved no checkpoint. (A run that saved none
    holds nothing to lose: a new run in its folder keeps its config beside, see ``loop.write_config``.)"""
    if cfg.resume_from is not None:
        if not Path(cfg.resume_from).is_file():
            raise FileNotFoundError(f"--resume-from {cfg.resume_from}: no such checkpoint file")
        return Path(cfg.resume_from)
    resume = ckpt_path.exists() and (cfg.resume or cfg.resume_or_start)
    if ckpt_path.exists() and not resume:
        raise FileExistsError(f"{ckpt_path} exists: pass --resume to continue that run, or choose another --out")
    if cfg.resume and not resume and not cfg.resume_or_start:
        raise FileNotFoundError(
            f"--resume: no checkpoint at {ckpt_path}: check --out, or drop --resume to start a "
            "new run (--resume-or-start starts one when there is nothing to resume)"
        )
    if not resume and not _run_config_or_none(out / "config.yaml"):
        raise FileExistsError(
            f"{out / 'config.yaml'} is not a gpupipe train run's config: choose another --out (a run writes its "
            "settings, metrics and checkpoints there)"
        )
    return ckpt_path if resume else None


def _run_config_or_none(path: Path) -> bool:
    """Whether ``path`` is absent or holds a train run's settings (a run that saved no checkpoint: a new run in its
    folder keeps them beside its own): a YAML mapping with most of the run's keys, as every ``config.yaml`` a run
    writes has them all. A file of the user's own under that name is not taken for one (and renamed) nor added to."""
    import yaml  # (omegaconf's)

    try:
        text = path.read_text()
    except FileNotFoundError:
        return True
    except (OSError, UnicodeDecodeError):
        return False
    try:
        settings = yaml.safe_load(text)
    except yaml.YAMLError:
        return False
    names = {f.name for f in fields(TrainConfig) if f.name not in RUN_MODE}
    return isinstance(settings, dict) and len(names & settings.keys()) >= 0.9 * len(names)


def resume_state(
    cfg: TrainConfig, ckpt_path: Path, state: TrainState, loader: Loader, dist: Distributed
) -> tuple[Meter, list[str], str | None]:
    """Restores ``state`` and ``loader`` from the checkpoint; returns the resumed epoch's sums so far, the settings
    changed since (``check_resumable``) and a notice when files were added or removed since (``on_changed_data``).
    The ranks are ``dist``'s, as the loader's sampler deals by them."""
    saved = checkpoint.load_for_resume(ckpt_path)
    world = dist.world_size  # another number of ranks: the batch and accum it fitted (elastic.py)
    changed = check_resumable(elastic.as_saved_at(saved.get("config", {}), world), cfg, ckpt_path)
    check_classes(saved.get("classes"), list(loader.dataset.classes), ckpt_path)
    checkpoint.restore(saved, state)  # model, optimizer, scaler, scheduler, EMA, step count, RNG states
    checkpoint.restore_rank_buffers(saved, state.model, dist.rank, world)  # DDP: each rank its own
    elastic.continue_schedule(state, saved.get("config", {}), cfg, world)
    position, notice = on_changed_data(saved["loader"], loader, ckpt_path)
    with elastic.quiet_resume_notices():  # fit_world_size's line says it
        loader.load_state_dict(position)  # the same sample of the epoch, whatever the number of ranks
    running = rank_running(saved, dist.rank, world) if position is saved["loader"] else {}
    return Meter(**running), changed, notice


def rank_running(saved: dict, rank: int, world_size: int) -> dict:
    """This rank's running sums of the interrupted epoch: its own, when the checkpoint kept every rank's (a mid-epoch
    one under DDP) and the run has as many ranks, so that the epoch's metrics (summed over ranks) are the straight
    run's. On another number of ranks, rank 0 carries the saved ranks' sums and the others none (each the mean time);
    a checkpoint that kept one rank's: those."""
    per_rank = saved.get("rank_running")
    if per_rank is None:
        return saved["running"]
    if len(per_rank) == world_size:
        return per_rank[rank]
    mean_time = sum(r["time"] for r in per_rank) / len(per_rank)
    if rank != 0:
        return {"time": mean_time}
    return {**{k: sum(r[k] for r in per_rank) for k in ("loss", "images", "wait")}, "time": mean_time}


def on_changed_data(position: dict, loader: Loader, path: Path) -> tuple[dict, str | None]:
    """The loader position to resume at, and a one-line notice when the data's files changed since the checkpoint
    (its classes are checked before: ``check_classes``). The epoch's order follows from its samples, so the
    checkpoint's place in it does not carry over to another set: the interrupted epoch starts again from its first
    batch, over the files there are now."""
    saved, now = position.get("order") or {}, loader.state_dict().get("order") or {}
    changed = [k for k in ("num_samples", "digest") if k in saved and k in now and saved[k] != now[k]]
    if not changed:
        return position, None
    epoch = int(position["epoch"])
    count = f"{saved['num_samples']} samples then, {now['num_samples']} now"
    notice = (
        f"{path}: the data changed since this checkpoint ({count}; the classes are the same): epoch {epoch} "
        "starts again from its first batch over the files there are now"
    )
    return {**{k: v for k, v in position.items() if k == "ctaugment"}, "epoch": epoch, "batch": 0}, notice


def _paths_resolved(saved: dict, cfg: TrainConfig) -> tuple[dict, dict]:
    """The saved and the current settings with ``data`` as a resolved path: a run started with ``--data
    data/sample`` resumes with ``--data /abs/path/data/sample`` from any folder (requeued jobs start elsewhere). The
    path was resolved when the checkpoint was saved (``data_resolved``); an older checkpoint's is resolved now."""
    now = asdict(cfg)
    if isinstance(now.get("data"), str):
        now["data"] = resolved(now["data"])
    if isinstance(saved.get("data"), str):
        saved = {**saved, "data": saved.get("data_resolved") or resolved(saved["data"])}
    return saved, now


def check_resumable(saved: dict, cfg: TrainConfig, path: Path) -> list[str]:
    """The changeable keys that differ from the checkpoint's run (allowed with ``allow_config_change``); a change
    to a fixed key, or an unallowed one, is a ``ValueError`` listing each ``key old -> new`` (paths resolved), the
    changeable ones changed beside a fixed one too."""
    saved, now = _paths_resolved(saved, cfg)

    def diff(keys):
        return [f"{k} {saved[k]!r} -> {now[k]!r}" for k in keys if k in saved and saved[k] != now[k]]

    fixed, changeable = diff(RESUME_FIXED), diff(RESUME_CHANGEABLE)
    if fixed:
        also = f" (also changed, which --allow-config-change allows: {'; '.join(changeable)})" if changeable else ""
        raise ValueError(
            f"{path}: cannot resume with {'; '.join(fixed)}: they decide the checkpoint's shapes or the "
            f"data order; restore them{_settings_file(cfg)}, or start a new run in another --out{also}"
        )
    if changeable and not cfg.allow_config_change:
        raise ValueError(
            f"{path}: the run was made with other settings: {'; '.join(changeable)}; restore them"
            f"{_settings_file(cfg)}, or pass --allow-config-change to resume with the new ones"
        )
    return changeable


# The settings the learning-rate schedule is drawn from: a resume that changes one follows the new schedule
SCHEDULE = ("epochs", "lr", "warmup_epochs")


def moves_schedule(changed: list[str]) -> bool:
    """Whether the ``key old -> new`` changes :func:`check_resumable` returned include a setting of the schedule."""
    return any(change.split(" ", 1)[0] in SCHEDULE for change in changed)


def _settings_file(cfg: TrainConfig) -> str:
    """Where the run's own settings are, as a command that resumes with them (a resume takes the command's options,
    not the run's: a bare ``--resume`` has the defaults)."""
    config = Path(cfg.out) / "config.yaml"
    return f" (the run's are in {config}: `gpupipe train --config {config} --resume`)" if config.exists() else ""


def check_classes(saved: list[str] | None, now: list[str], path: Path) -> None:
    """The data's classes must be the checkpoint's, in the same order: the model's outputs are their labels. A class
    added, removed or renamed since is a ``ValueError`` saying which (a checkpoint that kept no list is not checked)."""
    if saved is None or list(saved) == now:
        return
    added, removed = [c for c in now if c not in saved], [c for c in saved if c not in now]
    what = "; ".join(
        part
        for part in (
            f"added {', '.join(map(repr, added))}" if added else "",
            f"gone {', '.join(map(repr, removed))}" if removed else "",
        )
        if part
    )
    raise ValueError(
        f"{path}: the data's classes changed since this checkpoint ({what or 'same names, another order'}; "
        f"{len(saved)} then, {len(now)} now): its labels would mean other classes; restore the class folders, "
        "or start a new run in another --out"
    )


def save_checkpoint(
    state: TrainState, position: dict, meter: Meter, cfg: TrainConfig, dist: Distributed, *, alone: bool = False
) -> None:
    """``checkpoints/last.pt`` with the loader's ``position`` (its ``state_dict()``) to resume from. Every rank
    holds the same weights: rank 0 writes, the others wait for it. ``alone``: this rank writes, with no collective
    (under DDP, a rank whose loader failed while the others wait for it in an all-reduce: its weights are theirs, as of
    the last optimizer step). Writers take the folder's save lock, so two never rotate the kept files at once."""
    rank_buffers = None if alone else dist.gather_buffers(state.model)  # a collective: every rank, or none
    # mid-epoch (each rank's buffers gathered): each rank's running sums too, which the epoch's metrics add up
    rank_running = None if rank_buffers is None else dist.gather_sums(meter.state_dict())
    if dist.is_main or alone:
        config = {**asdict(cfg), "data_resolved": resolved(cfg.data)}  # resumable from another folder
        config["world_size"] = dist.world_size  # with batch_size and accum: the global batch (elastic.py)
        running = meter.state_dict()
        with _save_lock(checkpoint_path(cfg).parent):
            checkpoint.save(
                checkpoint_path(cfg),
                state,
                loader=position,
                running=running,
                config=config,
                keep=cfg.keep_checkpoints,
                rank_buffers=rank_buffers,
                rank_running=rank_running,
            )
    if not alone:
        dist.barrier()


@contextlib.contextmanager
def _save_lock(folder: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``folder/.save.lock`` while a checkpoint is written (released by the kernel however
    the writer ends)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".save.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def checkpoint_path(cfg: TrainConfig) -> Path:
    return Path(cfg.out) / "checkpoints" / "last.pt"
