"""``gpupipe train``: one loop that reads top to bottom — data, model, precision, accumulation, DDP, checkpoints.

``train()`` sets the run up into a ``Run`` (what every epoch reads) and loops over epochs; ``train_one_epoch()`` runs
its micro-steps, ``end_epoch()`` evaluates, logs and saves. The helpers below them follow in the order ``train()``
calls them; what it builds (loaders, model, optimizer, schedule, EMA, loss) is in ``build``. Precision (autocast,
fp16's scaler, clipping, the optimizer step) is ``precision.Precision``; what a checkpoint holds is
``checkpoint.TrainState``. Teardown (the logger, the process group) is in one place: the
``ExitStack`` of ``train()``.
"""

from __future__ import annotations

import contextlib
import shlex
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from torch import nn

from ..data.loader import Loader
from ..errors import GpupipeError
from ..mix import Mix
from .build import build_criterion, build_loaders, build_model, build_state, check_model_name
from .checkpoint import TrainState
from .config import TrainConfig, to_yaml
from .distributed import Distributed
from .elastic import fit_world_size
from .feedback import CTFeedback
from .logging import Meter, RunLogger
from .nonfinite import LossWatch
from .precision import Precision
from .resume import checkpoint_path, moves_schedule, resume_state, resuming, save_checkpoint
from .stop import (
    LoaderStalled,
    StopSignals,
    WorkerLost,
    guard_run,
    interrupt_point,
    next_batch,
    resume_command,
    stop_requested,
    stopped,
)

DATA_WAIT_WARN = 0.20


@dataclass
class Run:
    """A run as its epochs see it, built once by ``train()``."""

    cfg: TrainConfig
    dist: Distributed
    state: TrainState  # the bare model, optimizer, scheduler, precision, EMA and step count: what a checkpoint holds
    run_model: nn.Module  # the model as called: DDP-wrapped, compiled
    train_loader: Loader
    val_loader: Loader | None
    criterion: nn.Module
    mix: Mix | None
    logger: RunLogger
    steps_per_epoch: int  # optimizer steps
    stop: StopSignals  # a SIGINT or SIGTERM asked the run to save and stop
    feedback: CTFeedback | None = None  # --aa ctaugment: the probe batches that move its weights
    warm: bool = False  # the train loader has delivered a batch in this process (its start-up is behind it)

    @property
    def micro_batches(self) -> int:
        """Micro-batches per epoch: a tail shorter than ``--accum`` is left out."""
        return self.steps_per_epoch * self.cfg.accum


def train(cfg: TrainConfig, model: nn.Module | None = None) -> dict:
    """Train; returns the last epoch's metrics (``{}`` when the resumed run had already finished). ``model``
    replaces the timm model named in ``cfg``."""
    with contextlib.ExitStack() as teardown:  # the one place the logger and the process group are closed
        dist = Distributed(cfg.device, cfg.dist_timeout_s)
        stop = guard_run(cfg.out, dist, teardown)  # the process group closed, --out locked, signals: stop requests
        ckpt_path = checkpoint_path(cfg)
        resume = resuming(cfg, Path(cfg.out), ckpt_path)  # the checkpoint to resume; refuses to overwrite a run first
        # another number of ranks than the checkpoint's: the per-rank batch or --accum that keep its global batch
        cfg, ranks_note = fit_world_size(cfg, resume, dist.world_size) if resume else (cfg, None)
        if model is None:
            check_model_name(cfg.model)
        torch.manual_seed(cfg.seed)
        if dist.device.type == "cuda":
            # the fastest conv kernels, picked once per input shape: a resolution schedule's new size (and the eval
            # size) costs one search, in the first steps at that size, then runs as fast as a fixed size
            torch.backends.cudnn.benchmark = True

        # Data: every rank reads its own shard, and every rank takes the same number of steps.
        train_loader, val_loader, feedback = build_loaders(cfg, dist.device)
        steps_per_epoch = optimizer_steps(len(train_loader), cfg.accum)
        num_classes = len(train_loader.dataset.classes)

        # Model, optimizer, schedule, precision, loss.
        model = model if model is not None else build_model(cfg, num_classes)
        state = build_state(cfg, model, dist.device, steps_per_epoch)
        state.classes = list(train_loader.dataset.classes)  # saved: `gpupipe eval` labels held-out data with them
        criterion, mix = build_criterion(cfg, num_classes)

        # Resume: everything that decides the rest of the run, the loader's position included.
        resumed = resume_state(cfg, resume, state, train_loader, dist) if resume else None
        meter, changed, data_note = resumed or (Meter(), [], None)
        start = train_loader.state_dict()  # epoch 0, batch 0 on a new run

        # DDP after the resume: it starts every rank from rank 0's weights. Compile last, around what runs.
        run_model = dist.wrap(model)
        run_model = cast(nn.Module, torch.compile(run_model)) if cfg.compile else run_model  # an OptimizedModule
        total = steps_per_epoch * cfg.accum
        logger = RunLogger(Path(cfg.out), enabled=dist.is_main, total=total, world_size=dist.world_size)
        teardown.callback(logger.close)
        loaders = (train_loader, val_loader)
        run = Run(cfg, dist, state, run_model, *loaders, criterion, mix, logger, steps_per_epoch, stop, feedback)
        if dist.is_main:
            write_config(Path(cfg.out), cfg, resume is not None, changed, state.step, logger)
        if start["epoch"] >= cfg.epochs:
            logger.note(
                f"{ckpt_path}: the run already finished its {plural(cfg.epochs, 'epoch')}; nothing to do (to train "
                "longer, raise --epochs with --allow-config-change)"
            )
            return {}
        logger.note(startup_line(run, resume))  # before the first progress line, which comes log_every batches later
        if resume:
            where = f"epoch {start['epoch']}, batch {start['batch']} (optimizer step {state.step})"
            logger.note(f"resumed from {where} of {resume}")
        for note in (ranks_note, data_note):
            if note:
                logger.note(note)

        metrics = run_epochs(run, start["epoch"], meter)
        logger.note(finished_line(cfg, ckpt_path))
        return metrics


def run_epochs(run: Run, first_epoch: int, meter: Meter) -> dict:
    """The epochs from ``first_epoch`` on (the resumed one from the loader's position); the last one's metrics."""
    metrics: dict = {}
    for epoch in range(first_epoch, run.cfg.epochs):
        run.train_loader.set_epoch(epoch)  # the resumed epoch keeps the checkpoint's position
        first = run.train_loader.state_dict()["batch"]
        meter = meter if first > 0 else Meter()  # a resumed epoch goes on with its sums
        if first >= run.micro_batches:  # the checkpoint was the epoch's last step
            continue
        train_one_epoch(run, epoch, first, meter)
        metrics = end_epoch(run, epoch, meter)
    return metrics


def plural(n: int, word: str, words: str | None = None) -> str:
    """``1 epoch``, ``2 epochs``."""
    return f"{n} {word if n == 1 else words or word + 's'}"


def startup_line(run: Run, resume: Path | None = None) -> str:
    """What the run is about to do, in one line: the first thing a log shows. Batches are counted as the progress
    line counts them (micro-batches), with the optimizer steps they make under accumulation."""
    cfg, data = run.cfg, run.train_loader.dataset
    val = f" ({len(run.val_loader.dataset)} held out)" if run.val_loader is not None else ""
    ranks = f" x {run.dist.world_size} ranks" if run.dist.world_size > 1 else ""
    init = f"resumed from {resume}" if resume else f"weights from {cfg.pretrained}" if cfg.pretrained else "random init"
    steps = f" ({plural(run.steps_per_epoch, 'optimizer step')})" if cfg.accum > 1 else ""
    return (
        f"training {cfg.model} ({init}) on {len(data)} samples{val}, {len(data.classes)} classes: backend "
        f"{run.train_loader.backend}, device {run.dist.device} ({torch.get_num_threads()} torch threads), "
        f"{plural(run.micro_batches, 'batch', 'batches')} per epoch{steps} x "
        f"{plural(cfg.epochs, 'epoch')}, batch {cfg.batch_size}{ranks} x accum {cfg.accum}, images "
        f"{sizes_line(run.train_loader.recipe, cfg.epochs)}; run folder {cfg.out} (checkpoint {checkpoint_path(cfg)})"
    )


def finished_line(cfg: TrainConfig, ckpt_path: Path) -> str:
    """The last line of a run that finished its epochs: where it wrote, and the command that evaluates it."""
    held_out = shlex.quote(cfg.val) if cfg.val else "HELD_OUT_DATA"
    return (
        f"finished {plural(cfg.epochs, 'epoch')}: run folder {cfg.out}; evaluate its checkpoint with: gpupipe eval "
        f"--checkpoint {shlex.quote(str(ckpt_path))} --data {held_out}"
    )


def sizes_line(recipe, epochs: int) -> str:
    """The train image side(s) over the run and the eval side, in words: ``160 px (epochs 0-5), 192 px (6-9); eval
    224 px``."""
    sides = [recipe.train_size(e) for e in range(epochs)]
    runs = [(side, first) for first, side in enumerate(sides) if first == 0 or sides[first - 1] != side]
    ends = [first - 1 for _, first in runs[1:]] + [epochs - 1]
    words = [
        f"{side} px" + ("" if len(runs) == 1 else f" (epoch {a})" if a == b else f" (epochs {a}-{b})")
        for (side, a), b in zip(runs, ends, strict=True)
    ]
    return f"{', '.join(words)}; eval {recipe.eval_side} px"


def train_one_epoch(run: Run, epoch: int, first: int, meter: Meter) -> None:
    """The epoch's micro-batches from ``first`` on: forward and backward on each, an optimizer step on every
    ``cfg.accum``-th (``need_update``), progress every ``cfg.log_every``, a checkpoint every ``cfg.save_every`` steps.
    """
    cfg, state, n_batches = run.cfg, run.state, run.micro_batches
    run.run_model.train()
    run.logger.start_epoch(epoch, first)
    batches = iter(run.train_loader)
    watch = LossWatch()  # a NaN/inf loss stops the run before anything after it is saved
    if run.feedback is not None:
        run.feedback.start_epoch(epoch, first)
    meter.start()
    boundary = first  # where the last optimizer step left the epoch: what a save on a loader failure resumes from
    for batch_idx in range(first, n_batches):
        interrupt_point()  # a second Ctrl-C: here, between micro-batches, where no lock is held
        t_wait = time.perf_counter()
        images, labels = next_or_save(run, batches, epoch, boundary, meter)
        wait = time.perf_counter() - t_wait
        if not run.warm:  # the loader's start-up, not a wait of the steady state: reported as startup_s
            run.warm = True
            meter.started(wait)
            wait = 0.0
        targets = labels
        if run.mix is not None:  # its stream keyed by (seed, epoch, batch, rank): a resumed run mixes alike
            run.mix.set_key(cfg.seed, epoch, batch_idx, run.dist.rank)
            images, targets = run.mix(images, labels)
        need_update = (batch_idx + 1) % cfg.accum == 0
        loss = forward_backward(run, images, targets, all_reduce=need_update)
        if need_update:
            optimizer_step(state)
            boundary = batch_idx + 1
        if run.feedback is not None:  # FixMatch's loop: the model scores a probe batch, CTAugment's weights move
            run.feedback.step(state.model, state.precision)

        meter.update(loss, len(labels), wait)
        watch.add(batch_idx, state.step + (not need_update), loss)  # the optimizer step this micro-batch makes
        if (batch_idx + 1) % cfg.log_every == 0 or batch_idx + 1 == n_batches:
            meter.sync()  # one host sync every log_every micro-batches, not every one
            watch.check(epoch, checkpoint_path(cfg))
            run.logger.progress(batch_idx + 1, meter, last_lr(state), state.step)
        elif run.logger.due():  # between them, the progress shown at most half a second old (a host sync then)
            run.logger.progress(batch_idx + 1, meter.peek(), last_lr(state), state.step, scalars=False)
        if need_update and batch_idx + 1 < n_batches:  # the epoch's last step saves (and stops) in end_epoch
            step_boundary(run, watch, epoch, batch_idx + 1, meter)


def step_boundary(run: Run, watch: LossWatch, epoch: int, batch: int, meter: Meter) -> None:
    """After an optimizer step inside the epoch: a stop request (SIGINT/SIGTERM) saves and ends the run; every
    ``--save-every`` steps a checkpoint. Neither saves weights made from a NaN/inf loss (``watch``)."""
    stopping = stop_requested(run.stop, run.dist, run.state.step)
    saving = bool(run.cfg.save_every) and run.state.step % run.cfg.save_every == 0
    if stopping or saving:
        meter.sync()
        watch.check(epoch, checkpoint_path(run.cfg))
    if stopping:
        where = save_at(run, epoch, batch, meter)
        run.logger.progress(batch, meter, last_lr(run.state), run.state.step, scalars=False, now=True)  # saved here
        raise stopped(run.stop, where, run.cfg.out)
    if saving:
        save_at(run, epoch, batch, meter)


def last_lr(state: TrainState) -> float:
    return float(state.scheduler.get_last_lr()[0])


def next_or_save(run: Run, batches: Iterator, epoch: int, boundary: int, meter: Meter):
    """The next batch. A loader that stalls past ``--loader-timeout-s`` or loses a worker ends the run in one line,
    after a checkpoint at the last optimizer-step boundary (``boundary``). Under DDP this rank writes it alone, with no
    collective: the other ranks wait for it in an all-reduce (and stop after ``--dist-timeout-s``), and their weights
    are the same as of that step."""
    try:
        return next_batch(batches, run.cfg.loader_timeout_s)
    except (LoaderStalled, WorkerLost) as e:
        where = save_at(run, epoch, boundary, meter, alone=run.dist.enabled)
        if run.stop.requested:  # a SIGTERM to the whole process group ends the workers too: a stop, not a failure
            raise stopped(run.stop, where, run.cfg.out) from None
        rank = f"rank {run.dist.rank}: " if run.dist.enabled else ""
        raise type(e)(f"{rank}{e}; checkpoint saved at {where}; resume with: {resume_command(run.cfg.out)}") from None


def save_at(run: Run, epoch: int, batch: int, meter: Meter, *, alone: bool = False) -> str:
    """A checkpoint that resumes at ``batch`` of ``epoch``; where, in words. ``alone``: see :func:`save_checkpoint`."""
    meter.sync()
    position = {**run.train_loader.state_dict(), **run.train_loader.position_at(epoch, batch)}  # at that batch
    save_checkpoint(run.state, position, meter, run.cfg, run.dist, alone=alone)
    return f"epoch {epoch}, batch {batch} (optimizer step {run.state.step})"


def forward_backward(run: Run, images: torch.Tensor, targets: torch.Tensor, all_reduce: bool) -> torch.Tensor:
    """One micro-batch's loss, its gradient added to the accumulated ones. Under DDP, gradients are all-reduced only
    on the micro-batch that ends an accumulation (``all_reduce``): ``no_sync()`` on the others."""
    ddp = cast(nn.parallel.DistributedDataParallel, run.run_model)  # its no_sync, under DDP (compiled forwards it)
    with ddp.no_sync() if run.dist.enabled and not all_reduce else contextlib.nullcontext():
        with run.state.precision.autocast():
            loss = run.criterion(run.run_model(images), targets)
        run.state.precision.backward(loss / run.cfg.accum)  # the accumulated gradient: the micro-batches' mean
    return loss


def optimizer_step(state: TrainState) -> None:
    """The optimizer step at the end of an accumulation, then the schedule, the step count and the EMA."""
    state.precision.step(state.optimizer)  # fp16: a step its scaler skips (inf/NaN gradients) is counted on the GPU
    state.scheduler.step()  # by optimizer steps, skipped ones too (telling them apart here would make the host wait)
    state.optimizer.zero_grad(set_to_none=True)
    state.step += 1
    if state.ema is not None:
        state.ema.update(state.model, step=state.step)


def end_epoch(run: Run, epoch: int, meter: Meter) -> dict:
    """The epoch's metrics over all ranks, validation (of the model and its EMA), the log, and the checkpoint that
    resumes at the next epoch's start."""
    metrics = epoch_metrics(epoch, meter, run.dist)
    run.dist.average_buffers(run.state.model)  # BatchNorm statistics agree on every rank before evaluation, saving
    run.train_loader.set_epoch(epoch + 1)  # this epoch is done (a tail shorter than --accum is left unread)
    # kept if validation fails; right after the averaging, with no forward between: it gathers no rank's buffers
    save_checkpoint(run.state, run.train_loader.state_dict(), meter, run.cfg, run.dist)
    run.stop.validating = True  # (a stop asked now says it comes when validation ends)
    try:
        metrics.update(validate(run.run_model, run.state.ema, run.val_loader, run.state.precision, run.dist))
    finally:
        run.stop.validating = False
    metrics["lr"] = run.state.scheduler.get_last_lr()[0]
    metrics["skipped"] = len(run.train_loader.skipped)
    metrics["fallbacks"] = run.train_loader.fallbacks
    if run.state.precision.scaler.is_enabled():
        metrics["fp16_skipped_steps"] = run.state.precision.skipped_steps()  # read here, where the host waits anyway
    metrics["image_size"] = run.train_loader.recipe.train_size(epoch)  # the epoch's, under a resolution schedule
    skipped = [(path, reason, "train") for path, reason in run.train_loader.skipped]
    if run.val_loader is not None:  # (the same file in both, where validation reads the training data: twice)
        skipped += [(path, reason, "val") for path, reason in run.val_loader.skipped]
    run.logger.end_epoch(metrics, hint=data_wait_hint(metrics["data_wait"], run.cfg), skipped=skipped)
    if stop_requested(run.stop, run.dist):  # asked during the epoch's last step or its validation: saved just now
        raise stopped(run.stop, f"epoch {epoch + 1}, batch 0 (optimizer step {run.state.step})", run.cfg.out)
    return metrics


def optimizer_steps(batches: int, accum: int) -> int:
    """Optimizer steps per epoch; none is an error."""
    if batches // accum == 0:
        raise ValueError(f"{batches} batches per epoch make no optimizer step with --accum {accum}")
    return batches // accum


def write_config(out: Path, cfg: TrainConfig, resume: bool, changed: list[str], step: int, logger: RunLogger) -> None:
    """``out/config.yaml``: the run's settings. A resume with changed settings keeps the old file beside it."""
    config_file = out / "config.yaml"
    out.mkdir(parents=True, exist_ok=True)
    if changed and config_file.exists():  # keep the settings the run was started with
        kept = config_file.rename(out / f"config.before-step-{step}.yaml")
        then = "; the learning rate now follows the schedule of the new settings from this step"
        then = then if moves_schedule(changed) else ""
        logger.note(f"settings changed: {'; '.join(changed)} (the previous config is kept in {kept}){then}")
    elif not resume and config_file.exists() and config_file.read_text() != to_yaml(cfg):
        # a run that stopped before its first checkpoint (a bad file, a typo): this one is its retry
        differ = _line_diff(config_file.read_text(), to_yaml(cfg))
        kept = config_file.rename(out / "config.unfinished.yaml")
        logger.note(f"{out} held a run that saved no checkpoint ({differ}); starting afresh, its config kept in {kept}")
    if not resume or changed or not config_file.exists():
        config_file.write_text(to_yaml(cfg))


def _line_diff(old: str, new: str) -> str:
    """The settings two configs (YAML, one ``key: value`` a line) differ in, as ``key old -> new``."""
    a = dict(line.split(": ", 1) for line in old.splitlines() if ": " in line)
    b = dict(line.split(": ", 1) for line in new.splitlines() if ": " in line)
    return "; ".join(f"{k} {a.get(k, '-')} -> {b.get(k, '-')}" for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k))


def validate(run_model: nn.Module, ema, loader: Loader | None, precision: Precision, dist: Distributed) -> dict:
    """``val_loss`` and ``val_acc`` of the model, and of its EMA (``ema_val_...``); {} without validation data."""
    if loader is None:
        return {}
    with torch.random.fork_rng(devices=[dist.device] if dist.device.type == "cuda" else []):
        # the draws it makes (its DataLoader's seed) are not the training's: a run resumed from the checkpoint saved
        # before validation goes on with the same random state as the straight run
        metrics = evaluate(run_model, loader, precision, dist)
        if ema is not None:
            metrics.update({f"ema_{k}": v for k, v in evaluate(ema.module, loader, precision, dist).items()})
    return metrics


def evaluate(model: nn.Module, loader: Loader, precision: Precision, dist: Distributed) -> dict:
    """``val_loss`` and ``val_acc`` of ``model`` over every rank's share of ``loader``'s images."""
    return evaluated(model, loader, precision, dist)[0]


def evaluated(model: nn.Module, loader: Loader, precision: Precision, dist: Distributed) -> tuple[dict, int]:
    """As :func:`evaluate`, with the number of images the metrics are over (every rank's; a file left out under
    ``on_error="skip"`` is not among them)."""
    model.eval()
    sums, count = torch.zeros(2, dtype=torch.float64, device=loader.device), 0  # loss, correct: on the device
    criterion = nn.CrossEntropyLoss(reduction="sum")
    with torch.inference_mode():
        for images, labels in loader:
            interrupt_point()  # a second Ctrl-C: here, between batches (none came in a validation: 2 s, then anywhere)
            with precision.autocast():
                logits = model(images)
            sums[0] += criterion(logits.float(), labels)
            sums[1] += (logits.argmax(1) == labels).sum()
            count += len(labels)
    loss_sum, correct = sums.tolist()  # the one host sync of the evaluation
    loss_sum, correct, total = dist.all_reduce_sum([loss_sum, correct, count])
    if total == 0:  # every file skipped (--on-error skip): no metric, rather than a division by zero
        example = f", e.g. {loader.skipped[0][0]}: {loader.skipped[0][1]}" if loader.skipped else ""
        raise GpupipeError(
            f"{loader.dataset.root}: no image to evaluate on: all {len(loader.dataset)} were skipped as undecodable"
            f"{example}"
        )
    return {"val_loss": loss_sum / total, "val_acc": correct / total}, int(total)


def epoch_metrics(epoch: int, meter: Meter, dist: Distributed) -> dict:
    """The epoch's metrics over all ranks: mean loss, images per second (all ranks') and the share of time spent
    waiting for data."""
    sums = [meter.loss, meter.images, meter.wait, meter.time, meter.startup]
    loss, images, wait, elapsed, startup = dist.all_reduce_sum(sums)
    elapsed_mean = elapsed / dist.world_size
    metrics = {
        "epoch": epoch,
        "train_loss": loss / max(images, 1),
        "images_per_s": images / max(elapsed_mean, 1e-9),
        "data_wait": wait / max(elapsed, 1e-9),
    }
    if startup > 0:  # the epoch in which the loader started (the run's first, or the first after a resume)
        metrics["startup_s"] = startup / dist.world_size
    return metrics


def data_wait_hint(data_wait: float, cfg: TrainConfig) -> str | None:
    if data_wait <= DATA_WAIT_WARN:
        return None
    return (
        f"the model waited for data {data_wait:.0%} of the time: the loader is the bottleneck. Try "
        "`gpupipe bench --data ...` to find the fastest backend here (--backend dali on a GPU, turbojpeg or "
        f"pillow-simd on the CPU), or more --workers (now {cfg.workers or 'all cores'})."
    )
