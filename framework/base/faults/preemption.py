"""The driver's side of a preemption: what the ranks saved, how many finished steps were lost, the exit status.

A preemption is SIGTERM, or SIGUSR1 (what Slurm's ``--signal=USR1@<seconds>`` sends ahead of
the end of a job's time), or SIGUSR2 (submitit's choice for the same warning), reaching the driver,
the ranks, or both. The driver forwards the
signals it gets to the ranks (the elastic agent, :mod:`framework.driver.launcher`); every rank
finishes the optimizer step it is in, saves it, and stops
(:class:`framework.rank.callbacks.preemption.Preemption`), and rank 0 writes a ``preempted`` record
to the run's event log. The driver then ends the run *preempted*: exit status
:data:`EXIT_PREEMPTED`, MLflow status KILLED (not FAILED: nothing crashed) with the tag
``trainlab.preempted``. Running the same command again resumes from the saved step
(``resume=auto``), and the run ends with the weights of an uninterrupted run.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from framework.base.faults.events import FaultLog

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
"""The signals that preempt a run: SIGTERM (a scheduler's), SIGUSR1 (Slurm's ``--signal`` warning as
usually asked), SIGUSR2 (submitit's: ``hydra/launcher=submitit_slurm`` asks Slurm for
``--signal=USR2@<slurm.signal_delay_s>``, :mod:`framework.driver.slurm`). Ctrl-C's SIGINT interrupts a run:
exit 130, no save."""

EXIT_PREEMPTED = 75
"""The driver's exit status after a preemption: ``EX_TEMPFAIL`` of sysexits.h (a temporary
failure: run the same command again to resume)."""

PREEMPTED_EVENT = "preempted"
"""The event-log record rank 0 writes when the ranks stopped for a preemption."""

PREEMPTED_TAG = "trainlab.preempted"
"""The MLflow tag of a run whose last attempt was preempted (removed when a later attempt ends otherwise)."""


@dataclass(frozen=True)
class Preempted:
    """How a preemption ended an attempt.

    Attributes:
        signal: the signal's name (``SIGTERM``, ``SIGUSR1`` or ``SIGUSR2``).
        saved: whether the ranks saved the step they were in (False: they were killed first,
            e.g. ``trainer.stop_grace_s`` was too short).
        step_at_signal: the optimizer step in progress when rank 0 got the signal (1-based); None
            when rank 0 did not get it itself, or the ranks did not save.
        saved_step: the step of the checkpoint the next attempt resumes from (0: none).
        steps_lost: finished optimizer steps after ``saved_step`` (they run again); the goal is 0.
        t_signal: when rank 0 got the signal (Unix seconds), or None.
        before_ranks: the driver got the signal before its ranks started (e.g. while node 0's
            agent waited for the other nodes): nothing ran in this attempt.
    """

    signal: str
    saved: bool
    step_at_signal: int | None
    saved_step: int
    steps_lost: int
    t_signal: float | None
    before_ranks: bool = False

    def describe(self, now: float | None = None) -> str:
        """One line: the signal, the steps, and the seconds from the signal to now (the driver's exit)."""
        now = time.time() if now is None else now
        took = f"; {now - self.t_signal:.1f} s from the signal to exit" if self.t_signal else ""
        if self.before_ranks:
            return (
                f"{self.signal} before the ranks started: nothing ran in this attempt; the newest checkpoint is step"
                f" {self.saved_step} ({self.steps_lost} finished steps lost){took}"
            )
        if self.saved:
            at = f" in step {self.step_at_signal}" if self.step_at_signal else ""
            return (
                f"{self.signal}{at}: every rank finished the step and saved step {self.saved_step}"
                f" ({self.steps_lost} finished steps lost){took}"
            )
        return (
            f"{self.signal}: the ranks stopped before they could save (trainer.stop_grace_s too short?); the newest"
            f" checkpoint is step {self.saved_step} ({self.steps_lost} finished steps lost){took}"
        )


def preemption_outcome(
    run_dir: Path,
    checkpoint_dir: str,
    *,
    since: float,
    signal_name: str | None = None,
    before_ranks: bool = False,
    t_signal: float | None = None,
) -> Preempted | None:
    """The preemption of the attempt that started at ``since`` (Unix seconds), or None when there was none.

    ``signal_name``: the preempting signal when the driver got it (then there is an outcome even
    if the ranks wrote no ``preempted`` record: they were killed before they saved).
    ``before_ranks``: the driver got it before its ranks started (:class:`EarlySignals`), at ``t_signal``.
    """
    records = [r for r in FaultLog(run_dir).read() if r.get("t", 0) >= since]
    marks = [r for r in records if r.get("ev") == PREEMPTED_EVENT]
    if not marks and signal_name is None:
        return None
    done = max((r["step"] for r in records if r.get("ev") == "step" and not r.get("rolled_back")), default=0)
    if marks:
        rec = marks[-1]
        return Preempted(
            signal=rec["signal"],
            saved=True,
            step_at_signal=rec.get("step_at_signal"),
            saved_step=rec["saved_step"],
            steps_lost=max(0, done - rec["saved_step"]),
            t_signal=rec.get("t_signal"),
        )
    from framework.base.checkpoint.format import latest_valid_step

    _, saved = latest_valid_step(checkpoint_dir, warn=lambda msg: None)
    return Preempted(
        signal=signal_name or "?",
        saved=False,
        step_at_signal=None,
        saved_step=saved,
        steps_lost=max(0, done - saved),
        t_signal=t_signal,
        before_ranks=before_ranks,
    )


class EarlySignals:
    """The driver's SIGTERM/SIGUSR1 from the opening of its MLflow run until the elastic agent starts the ranks.

    Until the agent starts the ranks (and installs its own handlers, which forward the signals to
    them), the driver's handler is Python's default: the driver would die at once and leave its
    MLflow run RUNNING. Inside the ``with`` block the signal raises torch's ``SignalException``
    in the driver's main thread (the driver ends the run preempted, :attr:`fired` says so). The
    main thread may be blocked in C++ for up to ``rendezvous.timeout_s`` -- node 0's agent waits
    in its TCPStore for the other nodes -- where a Python handler does not run until the call
    returns; so the signal also wakes a thread (``signal.set_wakeup_fd``), which calls
    ``on_blocked(signal)`` when, ``grace_s`` later, the main thread has still not run the
    handler and the agent has not replaced it (``on_blocked`` records the run and ends the
    process).

    Guards from the main thread only (``signal.signal`` and ``set_wakeup_fd`` are main-thread
    calls); entered from another thread it does nothing.
    """

    def __init__(self, on_blocked: Callable[[signal.Signals], None], grace_s: float = 1.0) -> None:
        self.on_blocked = on_blocked
        self.grace_s = grace_s
        self.fired: signal.Signals | None = None
        self.t_signal: float | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        self.fired = signal.Signals(signum)
        self.t_signal = self.t_signal or time.time()
        raise SignalException(f"driver got {self.fired.name} before its ranks started", sigval=self.fired)

    def ours(self, sig: signal.Signals) -> bool:
        """Whether ``sig`` still has this guard's handler (the agent has not started the ranks)."""
        return signal.getsignal(sig) == self._handler

    def _watch(self) -> None:
        while True:
            try:
                data = self._read.recv(64)
            except OSError:
                return
            if not data:
                return
            for num in data:
                sig = signal.Signals(num)
                if sig not in PREEMPT_SIGNALS or not self.ours(sig):
                    continue
                self.t_signal = self.t_signal or time.time()
                time.sleep(self.grace_s)
                if self.fired is None and self.ours(sig):  # the main thread is blocked: it never ran the handler
                    self.on_blocked(sig)

    def __enter__(self) -> EarlySignals:
        import socket
        import threading

        self._active = threading.current_thread() is threading.main_thread()
        if not self._active:  # signals are the main thread's to handle: nothing to guard from here
            return self
        self._read, self._write = socket.socketpair()
        self._write.setblocking(False)
        self._old_fd = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        for sig in PREEMPT_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handler)
        threading.Thread(target=self._watch, name="trainlab-early-signals", daemon=True).start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._active:
            return
        signal.set_wakeup_fd(self._old_fd)
        for sig, previous in self._previous.items():
            if self.ours(sig):  # the ranks never started: back to what was there before
                signal.signal(sig, previous)
        self._write.close()
        self._read.shutdown(2)
        self._read.close()


def record_preemption(tracker: Any, preempted: Preempted | None) -> None:
    """Tag the MLflow run preempted (and log ``preempt/steps_lost`` at the saved step), or remove an
    earlier attempt's tag when this one was not preempted; never raises."""
    try:
        if preempted is None:
            tracker.clear_tag(PREEMPTED_TAG)
            return
        tracker.set_tags({PREEMPTED_TAG: preempted.describe()})
        tracker.log_metrics({"preempt/steps_lost": float(preempted.steps_lost)}, step=preempted.saved_step)
    except Exception as err:  # tracking never masks the training outcome
        print(f"trainlab: warning: could not record the preemption in MLflow: {err}", file=sys.stderr, flush=True)
