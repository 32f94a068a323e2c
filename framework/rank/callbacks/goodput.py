"""The run's timeline on rank 0, for goodput and the recovery counters of every run (faults or none).

:class:`RunTimeline` appends to the run's event log (``<run_dir>/faults.jsonl``,
:class:`~framework.base.faults.events.FaultLog`, which outlives restarts and driver invocations):

- ``start`` when training (re)starts (``on_train_start``): which launch and elastic restart this
  is, ``world_size``, ``grad_accum_steps``, the ``step`` resumed from, and the start-up marks of
  this attempt in Unix seconds: ``t_proc`` (the rank's process was created), ``t_main`` (the
  worker's ``main`` began: interpreter and ``torch`` imported), ``t_fit`` (data, model, plugin
  and Trainer built; ``fit`` called), ``t_rdzv`` (process group up: Lightning's ``setup`` hook),
  ``t_loaded`` (the checkpoint read and handed to the callbacks; null on a fresh start); the
  record's own ``t`` is the end of the restore (strategy set up, optimizer state, data position);
- ``step`` at the end of every optimizer step: ``d`` = its seconds from the end of the step
  before (or from ``start``) with the checkpoint blocking ``c`` and validation ``v`` that
  happened in between taken out (so ``d`` holds data wait, forward/backward and optimizer);
  ``rolled_back`` when the resilience policy rewound training in that step;
- ``end`` when training finished (``on_train_end``; ``c``/``v`` of the final save/validation).

:func:`framework.driver.faults.accounting.recovery_figures` turns these records into ``goodput``, its
parts and the ``recovery/*`` counters. It runs in the step's ``accounting`` phase
(:mod:`framework.rank.step`), after the parts that save, validate and roll back: a step's save and
validation run before it, and a rollback rewinds the step counter before it looks.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytorch_lightning as pl

from framework.rank.callbacks.clock import StepClock


def process_start_time() -> float:
    """Unix time (s) at which this process was created: now minus the process's age.

    The age is read on one clock, the kernel's boot clock: ``/proc/self/stat`` field 22 (the start
    time in clock ticks since boot) against ``CLOCK_BOOTTIME`` (resolution one tick, 10 ms). psutil's
    ``create_time()`` instead adds that start time to the boot time of ``/proc/stat``, which is in
    whole seconds: measured on this machine, 0.93 s before ``time.time()`` minus the boot clock, so a
    restarted rank appeared to start before the attempt it replaced had failed and the timeline's
    parts overlapped (``goodput/unaccounted_s`` -0.8 s). Elsewhere than Linux: psutil's figure, or
    ``time.time()`` (the start-up part then reads 0).
    """
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": fields 3, 4, ...
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return time.time() - max(0.0, age)
    except (OSError, ValueError, IndexError, AttributeError):  # no /proc or no CLOCK_BOOTTIME
        pass
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # psutil absent or unreadable
        return time.time()


class RunTimeline(pl.Callback):
    """Rank 0's ``start``/``step``/``end`` records of the run (see the module docstring).

    Args:
        log: the run's :class:`~framework.base.faults.events.FaultLog`.
        clock: the Trainer's step clock (checkpoint blocking and validation totals).
        segment: ``"<launch>.<restart>"``, which (re)start of the ranks this is.
        launch_index: the driver's relaunch count (0 until the first shrink).
        marks: the worker's start-up marks ``{"t_proc", "t_main", "t_fit"}`` (Unix seconds).
        enabled: False on ranks other than 0 (the callback then does nothing).
    """

    def __init__(
        self,
        *,
        log: Any,
        clock: StepClock,
        segment: str,
        launch_index: int,
        marks: dict[str, float],
        enabled: bool = True,
    ) -> None:
        self.event_log = log
        self.clock = clock
        self.segment = segment
        self.launch_index = launch_index
        self.marks = marks  # the worker adds t_fit after building the Trainer
        self.enabled = enabled
        self._t_rdzv: float | None = None
        self._t_loaded: float | None = None
        self._t_last = 0.0
        self._done = 0  # the last finished optimizer step (after a rollback: the step rewound to)
        self._c_last = self._v_last = 0.0

    def _append(self, ev: str, **fields: Any) -> None:
        if self.enabled:  # step records without fsync (they survive a killed rank, and cost no disk flush per step)
            self.event_log.append(ev, sync=ev != "step", seg=self.segment, **fields)

    def _since_last(self) -> tuple[float, float, float, float]:
        """``(now, d, c, v)`` since the last mark; moves the mark."""
        now = time.time()
        c, v = self.clock.checkpoint_s - self._c_last, self.clock.validation_s - self._v_last
        d = max(0.0, now - self._t_last - c - v)
        self._t_last, self._c_last, self._v_last = now, self.clock.checkpoint_s, self.clock.validation_s
        return now, d, c, v

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._t_rdzv = time.time()  # Lightning calls setup hooks after the process group is up

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._t_loaded = time.time()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rec_t = time.time()
        self._done = trainer.global_step
        self._t_last, self._c_last, self._v_last = rec_t, self.clock.checkpoint_s, self.clock.validation_s
        self._append(
            "start",
            launch=self.launch_index,
            restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            world_size=trainer.world_size,
            grad_accum_steps=trainer.accumulate_grad_batches,
            step=trainer.global_step,
            **self.marks,
            t_rdzv=self._t_rdzv,
            t_loaded=self._t_loaded,
        )

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.clock.step_ended:
            return  # inside gradient accumulation
        _, d, c, v = self._since_last()
        step = self._done + 1  # the step that just ran
        if trainer.global_step < step:  # a rollback rewound the counter in it: it ran and will run again
            self._append("step", step=step, d=d, c=c, v=v, rolled_back=True)
        else:
            self._append("step", step=step, d=d, c=c, v=v)
        self._done = trainer.global_step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _, d, c, v = self._since_last()
        self._append("end", step=trainer.global_step, d=d, c=c, v=v)
