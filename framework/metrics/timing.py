"""Clocks that are correct on CPU and CUDA, and the meter that plugins' collectives report to.

A clock hands out *marks* during a step and turns pairs of marks into seconds later:

- :class:`HostClock` (CPU): a mark is ``time.perf_counter()``; CPU work is synchronous, so host
  time is the work's time.
- :class:`CudaEventClock` (CUDA): a mark is a ``torch.cuda.Event`` recorded on the current
  stream, so intervals are measured on the GPU timeline (a gap where the GPU waited for the
  host, e.g. for data, shows up as such). Nothing synchronises during a step; ``seconds`` is
  called at logging points, after :meth:`CudaEventClock.wait` on the newest mark.

:class:`CommMeter` is the one mechanism that counts communication: each plugin's collectives
call ``launch(kind, nbytes)`` when they start and ``complete(record)`` when their result is
ready (for DDP, a comm hook does this per gradient bucket, see ``plugins/ddp.py``).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any

import torch


class HostClock:
    """Marks are ``time.perf_counter()`` seconds."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, a: float, b: float) -> float:
        return b - a

    def wait(self, mark: Any) -> None:
        """Nothing to wait for on the host."""


class CudaEventClock:
    """Marks are CUDA events recorded on the current stream of ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def seconds(self, a: torch.cuda.Event, b: torch.cuda.Event) -> float:
        """Seconds from ``a`` to ``b`` on the GPU timeline (both must have completed)."""
        return a.elapsed_time(b) / 1e3

    def wait(self, mark: torch.cuda.Event) -> None:
        """Block the host until ``mark`` and all work queued on the device has run.

        A device-wide synchronisation (not just ``mark``'s stream): communication-completion
        marks are recorded on the streams the collectives' futures run their callbacks on.
        """
        mark.synchronize()
        torch.cuda.synchronize(self.device)


def make_clock(device: torch.device) -> HostClock | CudaEventClock:
    """:class:`CudaEventClock` for a CUDA device, else :class:`HostClock`."""
    return CudaEventClock(device) if device.type == "cuda" else HostClock()


class CommRecord:
    """One collective: its kind, payload bytes, and launch / completion marks."""

    __slots__ = ("kind", "nbytes", "launched", "completed")

    def __init__(self, kind: str, nbytes: int, launched: Any) -> None:
        self.kind = kind
        self.nbytes = nbytes
        self.launched = launched
        self.completed: Any = None


class CommMeter:
    """Counts the bytes and times of a rank's training collectives, by kind.

    ``launch`` and ``complete`` may be called from other threads (gloo completes work in its
    own thread); ``take`` is called on the training thread once the step's collectives are done.
    Only collectives that report here are counted: the framework's own metric reductions (a
    few scalars per logged step) and DDP's start-up broadcasts are not.
    """

    def __init__(self, clock: HostClock | CudaEventClock) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._records: list[CommRecord] = []

    def launch(self, kind: str, nbytes: int) -> CommRecord:
        """Record the start of a collective of ``nbytes`` payload bytes; returns its record."""
        rec = CommRecord(kind, int(nbytes), self.clock.mark())
        with self._lock:
            self._records.append(rec)
        return rec

    def complete(self, rec: CommRecord) -> None:
        """Record that ``rec``'s result is ready (on CUDA: an event ordered after the collective)."""
        rec.completed = self.clock.mark()

    def last_launch(self) -> Any:
        """Mark of the newest launch, or None when nothing was launched since the last ``take``."""
        with self._lock:
            return self._records[-1].launched if self._records else None

    def take(self) -> list[CommRecord]:
        """The records since the last call (and forget them)."""
        with self._lock:
            recs, self._records = self._records, []
        return recs

    @staticmethod
    def bytes_by_kind(records: list[CommRecord]) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for r in records:
            out[r.kind] += r.nbytes
        return dict(out)
