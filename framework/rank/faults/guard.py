"""The resilience policy, per rank: detect faults each step and skip, roll back or abort.

:class:`FaultGuard` runs in every rank after the injector. In ``on_before_optimizer_step``
(gradients complete, optimizer not yet stepped) it gathers the step's health
(:func:`~framework.rank.faults.detect.gather_health`: one collective), and on a fault applies
``resilience.policy``:

- ``skip_step`` (also ``restart``/``shrink``, whose own business is crashes): drop the update on
  every rank (``StepState.drop_update``, :mod:`framework.rank.step`: the module's optimizer finds no
  gradient when it steps, whatever wraps it, so weights, AdamW moments and step counts stay; the LR schedule does not
  advance, it counts applied updates); the data position advances (the batch is consumed, as in
  a skipped iteration of Megatron-LM or an overflow step of DeepSpeed).
- ``rollback``: drop the update, then go back to the in-memory snapshot
  (:class:`~framework.rank.checkpoint.memory.MemorySnapshot`) and replay the steps after it with the
  same batches (``rollback_skip_window``: without the offending step's update). See
  :func:`rewind_to_snapshot` for how the step counter and the data stream are rewound.
- ``abort``: like ``skip_step`` until ``max_faults`` faults were detected (``max_faults``:
  null = 0), then every rank raises :class:`FaultAbort`; the run ends FAILED.
- ``none``: detections are logged, nothing else happens.

``resilience.skip_steps`` drops the listed steps' updates unconditionally (a known-bad data
window; also the fault-free reference of a skipped step). Crashes and hangs are the driver's
and the elastic agent's business (:mod:`framework.driver.faults.supervisor`); the watchdog lives here.

The guard judges a step once, at its last micro-batch (a strategy that accumulates itself,
DeepSpeed, calls ``on_before_optimizer_step`` on every micro-batch), and the gradient norm the
run logs for it is the one the decision rests on (:attr:`~framework.rank.faults.detect.StepHealth.reported_grad_norm`).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import pytorch_lightning as pl

from framework.base.config.schema import ResilienceConfig
from framework.base.faults.events import FaultLog
from framework.rank.callbacks.clock import StepClock
from framework.rank.checkpoint.memory import MemorySnapshot
from framework.rank.faults.audit import local_state, max_abs_diff, max_abs_diff_by_part
from framework.rank.faults.detect import RunningMean, Watchdog, gather_health
from framework.rank.faults.lightning_adapter import align_batch_counter, closes_optimizer_step, set_optimizer_step


class FaultAbort(RuntimeError):
    """The resilience policy gave up: more faults than ``resilience.max_faults``."""


def rewind_to_snapshot(trainer: pl.Trainer, step: int, clock: StepClock) -> None:
    """Rewind training to optimizer step ``step``: Lightning's step counter and the data stream
    (:func:`~framework.rank.faults.lightning_adapter.set_optimizer_step`), and the run's step clock
    (:class:`~framework.rank.callbacks.clock.StepClock`, which the metric callbacks read).

    The caller then ends the epoch (``StepState.end_epoch_requested``): the next epoch re-iterates
    the loader from ``step`` with fresh in-epoch counters, so gradient accumulation stays
    aligned to step boundaries.
    """
    set_optimizer_step(trainer, step)
    clock.on_rollback(step)


def rewarmup_factor(step: int, shrunk_at_step: int | None, rewarmup_steps: int) -> float:
    """LR multiplier of optimizer step ``step + 1`` (``step`` = ``trainer.global_step`` before it)
    after a shrink that resumed from ``shrunk_at_step``: ``(k + 1) / rewarmup_steps`` for the
    ``k``-th step after the resume (``k = step - shrunk_at_step`` in ``[0, rewarmup_steps)``),
    else 1. Applied on top of the LR schedule (linear re-warm-up, as a fresh warm-up)."""
    if shrunk_at_step is None or rewarmup_steps <= 0:
        return 1.0
    k = step - shrunk_at_step
    return (k + 1) / rewarmup_steps if 0 <= k < rewarmup_steps else 1.0


class FaultGuard(pl.Callback):
    """Per-step detection and the in-process part of the resilience policy (see the module docstring).

    Args:
        cfg: ``resilience`` config.
        rank: global rank (rank 0 writes the shared records).
        log: the run's fault log.
        segment: ``"<launch>.<restart>"``, which (re)start of the ranks this is.
        launch_index: driver relaunch count (0 until the first shrink).
        shrunk_at_step: step the run resumed from after its last shrink (LR re-warm-up), or None.
        clock: the run's step clock (rewound with a rollback).
        snapshot: the run's in-memory snapshot (what a rollback restores), or None.
    """

    def __init__(
        self,
        *,
        cfg: ResilienceConfig,
        rank: int,
        log: FaultLog,
        segment: str,
        launch_index: int,
        clock: StepClock,
        snapshot: MemorySnapshot | None = None,
        shrunk_at_step: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.rank = rank
        self.fault_log = log
        self.segment = segment
        self.launch_index = launch_index
        self.shrunk_at = shrunk_at_step
        self.skip_steps = set(cfg.skip_steps)
        self.max_faults = cfg.max_faults if cfg.max_faults is not None else (0 if cfg.policy == "abort" else None)
        self.faults = sum(
            1
            for r in log.read()
            if r.get("ev") == "detected" and r.get("action") not in (None, "none") and r.get("rank") == 0
        )
        self.loss_stat = RunningMean(cfg.stat_beta, cfg.stat_warmup_steps)
        self.grad_stat = RunningMean(cfg.stat_beta, cfg.stat_warmup_steps)
        self.watchdog = Watchdog(cfg.hang_timeout_s, self._hung) if cfg.hang_timeout_s > 0 else None
        self.clock = clock
        self.snapshot = snapshot
        self._trainer: pl.Trainer | None = None
        self._step = -1
        self._t_step = 0.0
        self._skipped = False
        self._rollback_to: int | None = None
        self._restore: str | None = None  # rollback restore: await_epoch -> next_batch -> done
        self._straggling = False
        self._accepted = 0
        self._audit_before: dict | None = None  # resilience.audit_skips: this rank's state before a dropped update

    # -- records ----------------------------------------------------------------------------
    def _record(self, ev: str, **fields: Any) -> None:
        if self.rank == 0:
            self.fault_log.append(ev, seg=self.segment, **fields)

    def _hung(self, stalled_s: float) -> None:
        step = self._trainer.global_step + 1 if self._trainer is not None else -1
        self.fault_log.append(
            "detected",
            detector="hang_watchdog",
            step=step,
            rank=self.rank,
            seg=self.segment,
            stalled_s=stalled_s,
            action="restart",
        )
        print(
            f"trainlab: fault: rank {self.rank} made no progress for {stalled_s:.1f} s (step {step});"
            f" exiting for a restart",
            file=sys.stderr,
            flush=True,
        )

    # -- hooks ------------------------------------------------------------------------------
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._trainer = trainer
        if self.watchdog is not None:
            self.watchdog.start()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # a new epoch began (TrainStep cleared StepState.end_epoch_requested)
        if self._restore == "await_epoch":
            self._restore = "next_batch"

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.watchdog is not None:
            self.watchdog.beat()
        if pl_module.step_state.end_epoch_requested:
            return  # this batch is dropped: the module ends the epoch (rollback)
        if self._step == -1 and self._restore is None and align_batch_counter(trainer) and self.rank == 0:
            print(
                f"trainlab: resumed at grad_accum_steps={trainer.accumulate_grad_batches}: micro-batch counter"
                f" re-aligned to step {trainer.global_step}",
                file=sys.stderr,
                flush=True,
            )
        if self._restore == "next_batch":
            # First batch of the epoch after a rollback: the new loader iterator exists (its creation
            # draws from torch's RNG) and Lightning's extra scheduler step at the epoch end is past.
            self._restore = None
            self.snapshot.restore(trainer)
        elif self.cfg.policy == "rollback" and self.snapshot is not None and self.snapshot.step is None:
            self.snapshot.take(trainer)  # something to roll back to before the first periodic snapshot
        step = trainer.global_step + 1
        if step != self._step:
            self._step, self._t_step, self._skipped = step, time.perf_counter(), False

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        if not closes_optimizer_step(trainer):
            return  # a micro-batch inside accumulation (a strategy that accumulates itself calls this hook)
        step = self._step
        state = pl_module.step_state
        n = max(1, state.micro_batches)
        grad_norm = float(pl_module.plugin.grad_norm(pl_module))  # the one gradient-norm function (the run logs it too)
        health = gather_health(
            grad_norm=grad_norm,
            loss=float(state.loss_sum) / n,
            busy_s=time.perf_counter() - self._t_step,
            device=pl_module.device,
        )
        if self.watchdog is not None:
            self.watchdog.beat()
        straggler = (
            health.straggler(self.cfg.straggler_factor, self.cfg.straggler_min_s)
            if self._accepted >= self.cfg.stat_warmup_steps
            else None
        )
        if straggler is not None and not self._straggling:
            self._record(
                "detected", detector="straggler", step=step, rank=straggler, action="none", busy_s=health.busy_s
            )
        self._straggling = straggler is not None
        detector = None
        if health.nonfinite:
            detector = "nonfinite_grad" if health.grad_nonfinite else "nonfinite_loss"
        elif self.loss_stat.is_spike(health.loss, self.cfg.loss_spike_factor):
            detector = "loss_spike"
        elif self.grad_stat.is_spike(health.grad_norm, self.cfg.grad_spike_factor):
            detector = "grad_spike"
        # The norm logged for this step (the module's hook, which runs after this one, takes it):
        # on a detection the value the decision rests on, e.g. rank 1's NaN where rank 0's norm is finite.
        state.judged_grad_norm = health.reported_grad_norm if detector is not None else grad_norm
        if detector is not None:
            self._on_fault(detector, step, health, pl_module)
        elif step in self.skip_steps:
            self._drop_update(pl_module, step, "skip_steps")
        else:
            self._accepted += 1
            self.loss_stat.update(health.loss)
            self.grad_stat.update(health.grad_norm)
        factor = rewarmup_factor(trainer.global_step, self.shrunk_at, self.cfg.rewarmup_steps)
        if factor != 1.0:  # after a shrink; the scheduler resets lr every step: no compounding
            for group in optimizer.param_groups:
                group["lr"] *= factor

    def _on_fault(self, detector: str, step: int, health: Any, pl_module: Any) -> None:
        policy = self.cfg.policy
        action = {"none": "none", "rollback": "rollback"}.get(policy, "skip_step")
        self.faults += 1 if action != "none" else 0
        self._record(
            "detected",
            detector=detector,
            step=step,
            rank=0,
            action=action,
            loss=health.loss,
            grad_norm=health.reported_grad_norm,
        )
        if self.rank == 0:
            print(
                f"trainlab: fault: {detector} detected in step {step} (loss {health.loss:.4g}, grad norm"
                f" {health.reported_grad_norm:.4g}); policy {policy}: {action}",
                file=sys.stderr,
                flush=True,
            )
        if self.max_faults is not None and self.faults > self.max_faults:
            self._record("abort", step=step, faults=self.faults)
            raise FaultAbort(
                f"resilience: {self.faults} faults detected > resilience.max_faults={self.max_faults}"
                f" (last: {detector} in step {step}); aborting"
            )
        if action == "none":
            return
        self._drop_update(pl_module, step, detector)
        if action == "rollback":
            self._rollback_to = self.snapshot.step if self.snapshot is not None else None

    def _drop_update(self, pl_module: Any, step: int, reason: str) -> None:
        if self.cfg.audit_skips:
            self._audit_before = local_state(pl_module.trainer)
        pl_module.step_state.drop(reason)  # the optimizer step finds no gradients; the LR schedule stays
        self._skipped = True
        self.fault_log.append("skipped", step=step, rank=self.rank, reason=reason, seg=self.segment)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != self._step:
            return  # inside gradient accumulation
        if self.watchdog is not None:
            self.watchdog.beat()
        if self._audit_before is not None:  # after the optimizer step and the scheduler: nothing may have moved
            before, self._audit_before = self._audit_before, None
            after = local_state(trainer)
            self.fault_log.append(
                "skip_audit",
                step=self._step,
                rank=self.rank,
                seg=self.segment,
                tensors=len(before),
                max_abs_diff=max_abs_diff(before, after),
                parts=max_abs_diff_by_part(before, after),
            )
        if self._rollback_to is not None:
            to, self._rollback_to = self._rollback_to, None
            if self.cfg.rollback_skip_window:
                self.skip_steps.add(self._step)
            self._record("rollback", from_step=self._step, to_step=to)
            rewind_to_snapshot(trainer, to, self.clock)
            pl_module.step_state.end_epoch_requested = True
            self._restore = "await_epoch"
            self._step = -1
            return

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()


def build_fault_callbacks(
    launch: Any, *, rank: int, log: FaultLog, segment: str, clock: StepClock, snapshot: MemorySnapshot | None = None
) -> list[pl.Callback]:
    """``[FaultInjector, FaultGuard]`` for this rank, or ``[]`` when the run has no faults and no policy.

    ``launch``: the driver's :class:`~framework.base.launch.LaunchSpec` (the run, its fault schedule,
    which launch this is); ``log``: the run's event log the rank opened; ``segment``: which (re)start
    of the ranks this is (:func:`framework.rank.faults.restart.restart_label`); ``clock``, ``snapshot``: the run's step clock and in-memory snapshot
    (None without one). Both run in the step's ``faults`` phase (:mod:`framework.rank.step`): after the
    metric callbacks and before the checkpoint ones (a rollback must rewind the step before a save
    or snapshot of that step is taken).
    """
    from framework.base.faults.schedule import faults_enabled
    from framework.rank.faults.inject import FaultInjector

    run = launch.resolved.run
    if not faults_enabled(run):
        return []
    return [
        FaultInjector(
            schedule=launch.fault_schedule, rank=rank, log=log, checkpoint_dir=launch.resolved.checkpoint_dir
        ),
        FaultGuard(
            cfg=run.resilience,
            rank=rank,
            log=log,
            segment=segment,
            launch_index=launch.launch_index,
            clock=clock,
            snapshot=snapshot,
            shrunk_at_step=launch.shrunk_at_step,
        ),
    ]
