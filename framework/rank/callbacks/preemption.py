"""Preemption: SIGTERM, or SIGUSR1/SIGUSR2 (Slurm's ``--signal`` warning; submitit asks for SIGUSR2), stops every rank after the
optimizer step in progress, with a checkpoint of that step, so no finished step is lost.

In each rank the signal only sets a flag (:func:`install_handlers`; nothing else is safe inside
a signal handler). At the end of every optimizer step the ranks all-reduce the flag with its time
and step (:func:`agree_on_signal`: one collective of three numbers per step, on a host-side gloo
group, so that reading it back does not wait for the device), so all of them agree on the same
step, time and step at the signal even when the signal reaches them at different moments or
reaches only some of them; on a set flag every rank saves
that step through the run's checkpoint callback (also under ``checkpoint=none``: a preempted
run must resume), rank 0 appends a ``preempted`` record to the run's event log
(:mod:`framework.base.faults.events`: signal, step at the signal, step saved, the signal's time),
and the ranks leave through Lightning's graceful stop (``trainer.should_stop``), exiting 0 so
that the elastic agent does not restart them. The driver reads the record and ends the run
*preempted* (:mod:`framework.base.faults.preemption`: exit status 75, MLflow status KILLED with
the tag ``trainlab.preempted``). The driver forwards the signals it gets to the
ranks through the elastic agent and waits ``trainer.stop_grace_s`` for them
(:mod:`framework.driver.launcher`).

Lightning's own SIGTERM handling (``pytorch_lightning`` 2.6, ``_SignalConnector``) does not fit:
it raises ``SIGTERMException`` at the next micro-batch, inside gradient accumulation and before
any save, and its handler runs a broadcast collective from inside the signal handler. So
:class:`Preemption` re-installs trainlab's handlers at ``on_train_start``, after Lightning
registered its own; Lightning restores the process's earlier handlers at teardown. Its training
loop's per-micro-batch broadcast of its SIGTERM flag (``_broadcast_sigterm_tensor``: a collective and
a device read per micro-batch) then relays a flag that nothing sets, and is skipped. Lightning's
SLURM auto-requeue (SIGUSR1 -> ``hpc_ckpt`` + ``scontrol requeue``) is replaced the same way:
trainlab's checkpoint is the resumable one.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist

from framework.base.faults.events import FaultLog
from framework.base.faults.preemption import PREEMPT_SIGNALS, PREEMPTED_EVENT
from framework.rank.callbacks.clock import StepClock
from framework.rank.checkpoint.periodic import PeriodicCheckpoint
from framework.rank.metrics.syncs import host_read


class _Received:
    """What the handler saw in this process: the first preempting signal, its time, the steps done then."""

    signum: int | None = None
    t: float | None = None
    steps_done: int | None = None
    progress = 0  # optimizer steps finished so far (kept by Preemption, read by the handler)


def _on_signal(signum: int, frame: Any) -> None:
    if _Received.signum is None:
        _Received.signum, _Received.t, _Received.steps_done = signum, time.time(), _Received.progress


class _Interrupt:
    """When this process got SIGINT (Unix seconds), or None."""

    t: float | None = None


def _on_interrupt(signum: int, frame: Any) -> None:
    _Interrupt.t = time.time()
    raise KeyboardInterrupt


def raise_if_interrupted() -> None:
    """Raise ``KeyboardInterrupt`` when SIGINT arrived and training goes on: its exception was swallowed.

    Python runs a signal handler at the next bytecode of the main thread; during backward that is
    mostly inside a ``__del__`` (the activation meter's saved tensors, :mod:`framework.base.metrics.memory`),
    where an exception is printed ("Exception ignored in ...") and dropped. Ranks Ctrl-C'd in backward
    trained on to ``trainer.max_steps`` (the flaky KILLED run of test_train_e2e's Ctrl-C test).
    """
    if _Interrupt.t is not None:
        raise KeyboardInterrupt("SIGINT (raised again: the first was dropped inside a __del__)")


def install_handlers() -> None:
    """Make :data:`PREEMPT_SIGNALS` set this process's preemption flag instead of ending it.

    Call from the main thread (Python runs signal handlers there); a rank calls it before
    building its Trainer (a signal during start-up then stops it after its first step), and
    :class:`Preemption` again over Lightning's handlers.

    It also gives SIGINT (Ctrl-C, or the elastic agent stopping the ranks) a handler raising
    KeyboardInterrupt (raised again by :func:`raise_if_interrupted` if it was dropped), which
    Lightning turns into a graceful stop: a process inherits an ignored SIGINT (a shell's background job has SIGINT and SIGQUIT ignored, and ranks forked
    from the ``trainer.preload_ranks`` server inherit the server's disposition), and a rank that
    ignored it trained on after Ctrl-C until the agent killed it.
    """
    signal.signal(signal.SIGINT, _on_interrupt)  # KeyboardInterrupt, remembered (raise_if_interrupted)
    for sig in PREEMPT_SIGNALS:
        signal.signal(sig, _on_signal)


def ignore_in_loader_worker(worker_id: int) -> None:
    """``DataLoader`` ``worker_init_fn``: a loader worker ignores :data:`PREEMPT_SIGNALS`.

    A signal sent to a rank's whole process group (the elastic agent's, Slurm's) reaches its
    loader workers too; killed by it, they would fail the rank in the middle of the step it is
    finishing. The rank ends them itself when it stops.
    """
    for sig in PREEMPT_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class Preemption(pl.Callback):
    """Stop after the optimizer step in progress when a preempting signal arrived (module docstring).

    Runs after the checkpoint callback in the step's ``checkpoint`` phase (a periodic save of the same
    step is then reused, not repeated) and after the :class:`StepClock`.

    Args:
        clock: the Trainer's step clock (which batch closed an optimizer step).
        checkpoint: the run's checkpoint callback; its :meth:`~PeriodicCheckpoint.save` writes the step.
        log: the run's event log on rank 0; None on other ranks.
        segment: ``"<launch>.<restart>"``, which (re)start of the ranks this is.
    """

    def __init__(self, *, clock: StepClock, checkpoint: PeriodicCheckpoint, log: FaultLog | None, segment: str) -> None:
        self.clock = clock
        self.checkpoint = checkpoint
        self.event_log = log  # not self.log: that name is taken on a Callback
        self.segment = segment

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _Received.progress = trainer.global_step
        install_handlers()  # over Lightning's, registered just before training starts
        # Lightning's handler no longer runs, so its per-micro-batch flag broadcast carries nothing (module docstring).
        epoch_loop = trainer.fit_loop.epoch_loop
        if hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
            epoch_loop._broadcast_sigterm_tensor = lambda: None
        self._group = None  # the default group when it is gloo (CPU); else a gloo group over the same ranks
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "gloo":
            self._group = dist.new_group(backend="gloo")

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        raise_if_interrupted()  # a Ctrl-C whose KeyboardInterrupt was dropped in backward stops here
        if not self.clock.step_ended:
            return  # inside gradient accumulation: the step is finished first
        _Received.progress = trainer.global_step
        signum, t_signal, steps_done = agree_on_signal(getattr(self, "_group", None))
        if not signum or trainer.global_step >= trainer.max_steps:
            return  # no signal, or the run is done anyway (its final save follows)
        step = trainer.global_step
        self.checkpoint.save(trainer)  # every rank; a save of this step already made is not repeated
        if self.event_log is not None:
            self.event_log.append(
                PREEMPTED_EVENT,
                seg=self.segment,
                signal=signal.Signals(signum).name,
                t_signal=t_signal,
                step_at_signal=None if steps_done is None else steps_done + 1,
                saved_step=step,
            )
        trainer.should_stop = True


def agree_on_signal(group: Any = None) -> tuple[int, float | None, int | None]:
    """What the ranks received, agreed by all: ``(signal number, earliest time any rank got it (Unix s),
    fewest optimizer steps done then)``; ``(0, None, None)`` when none did. One all-reduce (MAX over
    ``[signum, -t, -steps]``, a float64 host tensor, over ``group``: a gloo group, None = the default
    one) when distributed, so rank 0 records the signal's time and step also when only another rank
    got it (a signal sent to the ranks, not to the driver), and reading it back waits for no device."""
    mine = [
        float(_Received.signum or 0),
        -(_Received.t if _Received.t is not None else float("inf")),
        -(float(_Received.steps_done) if _Received.steps_done is not None else float("inf")),
    ]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor(mine, dtype=torch.float64)  # on the host: gloo, no device round trip
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        with host_read():
            mine = flag.tolist()
    signum, neg_t, neg_steps = mine
    if not signum:
        return 0, None, None
    return (
        int(signum),
        (-neg_t if neg_t != float("-inf") else None),
        (int(-neg_steps) if neg_steps != float("-inf") else None),
    )
