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
ready (for DDP, a comm hook does this per gradient bucket, see ``plugins/ddp.py``). A plugin says
*which* collectives are its own and reports them unconditionally; *when* they count is the
framework's decision: the meter has a window (:meth:`CommMeter.open` / :meth:`CommMeter.close`,
driven by :class:`~framework.rank.callbacks.breakdown.StepBreakdown` around a training step's
forward, backward and optimizer step) and drops what is reported while it is closed or paused
(:func:`comm_paused`, around the framework's own collectives such as validation).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
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
    """One collective: its kind, payload bytes, launch / completion marks, and whether its group spans nodes
    (``inter_node``: True/False, None when unknown)."""

    __slots__ = ("kind", "nbytes", "launched", "completed", "inter_node")

    def __init__(self, kind: str, nbytes: int, launched: Any, inter_node: bool | None = None) -> None:
        self.kind = kind
        self.nbytes = nbytes
        self.launched = launched
        self.completed: Any = None
        self.inter_node = inter_node


WORLD = "world"
"""``CommMeter.launch(..., group=WORLD)``: the collective runs on the default (world) process group."""


def call_group(fn: Any, args: tuple, kwargs: dict, name: str = "group") -> Any:
    """The ``group`` argument of a call ``fn(*args, **kwargs)`` of a ``torch.distributed`` collective (None when
    not given: the default group; None also when the arguments do not bind)."""
    import inspect

    if name in kwargs:
        return kwargs[name]
    try:
        sig = _SIGNATURES.get(fn) or _SIGNATURES.setdefault(fn, inspect.signature(fn))
        return sig.bind_partial(*args, **kwargs).arguments.get(name)
    except (TypeError, ValueError):
        return None


_SIGNATURES: dict[Any, Any] = {}


def group_spans_nodes(group: Any, ranks_per_node: int) -> bool | None:
    """Whether process group ``group`` holds ranks of more than one node (node of a global rank =
    ``rank // ranks_per_node``, the elastic agent's numbering: node ``k`` holds ranks ``k * ranks_per_node ..``).

    ``group``: a ``torch.distributed.ProcessGroup``, :data:`WORLD` or None (the default group), or
    a list of global ranks. Returns None when it cannot tell (no process group, no ``ranks_per_node``).
    """
    import torch.distributed as dist

    if ranks_per_node <= 0:
        return None
    if isinstance(group, (list, tuple)):
        ranks = list(group)
    else:
        if not dist.is_initialized():
            return None
        try:
            ranks = dist.get_process_group_ranks(dist.group.WORLD if group is None or group is WORLD else group)
        except Exception:  # not a process group (an unresolved name): unknown, never a metering failure
            return None
    return len({r // ranks_per_node for r in ranks}) > 1


class CommMeter:
    """Counts the bytes and times of a rank's training collectives, by kind.

    ``launch`` and ``complete`` may be called from other threads (gloo completes work in its
    own thread); ``take`` is called on the training thread once the step's collectives are done.
    Only collectives that report here are counted, and only while the meter is *counting*: open
    (:meth:`open` / :meth:`close`, the framework's training window; a new meter is open) and not
    paused (:meth:`paused`, :func:`comm_paused`). A collective reported while not counting is
    dropped: ``launch`` returns None and ``complete(None)`` does nothing.
    """

    def __init__(self, clock: HostClock | CudaEventClock, ranks_per_node: int | None = None) -> None:
        import os

        self.clock = clock
        # the agent's LOCAL_WORLD_SIZE: the ranks of one node (0: unknown; no node split)
        self.ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) if ranks_per_node is None else ranks_per_node
        self._spans: dict[int, tuple[Any, bool | None]] = {}  # id(group) -> (group, spans nodes)
        self._lock = threading.Lock()
        self._records: list[CommRecord] = []
        self._open = True
        self._pauses = 0
        _METERS.add(self)

    # -- the window (the framework's) --------------------------------------------------------
    def open(self) -> None:
        """Start counting (a training step's forward, backward or optimizer step begins)."""
        self._open = True

    def close(self) -> None:
        """Stop counting until the next :meth:`open`; what is reported meanwhile is dropped."""
        self._open = False

    @property
    def counting(self) -> bool:
        """True while open and not paused."""
        return self._open and self._pauses == 0

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Drop what is reported inside the ``with`` block (nestable; the window state is kept)."""
        with self._lock:
            self._pauses += 1
        try:
            yield
        finally:
            with self._lock:
                self._pauses -= 1

    # -- reports (the plugin's) ----------------------------------------------------------------
    def launch(self, kind: str, nbytes: int, group: Any = None) -> CommRecord | None:
        """Record the start of a collective of ``nbytes`` payload bytes on process group ``group``
        (a ``ProcessGroup``, a list of global ranks, or None/:data:`WORLD`: the default group);
        returns its record, or None when the meter is not counting (the collective is dropped)."""
        if not self.counting:
            return None
        rec = CommRecord(kind, int(nbytes), self.clock.mark(), self._spans_nodes(group))
        with self._lock:
            self._records.append(rec)
        return rec

    def complete(self, rec: CommRecord | None) -> None:
        """Record that ``rec``'s result is ready (on CUDA: an event ordered after the collective).
        None (a dropped launch) is ignored."""
        if rec is not None:
            rec.completed = self.clock.mark()

    def report(self, kind: str, nbytes: int, group: Any = None) -> None:
        """A collective whose launch and completion are not told apart: ``complete(launch(kind, nbytes, group))``."""
        self.complete(self.launch(kind, nbytes, group))

    def _spans_nodes(self, group: Any) -> bool | None:
        if isinstance(group, (list, tuple)):
            return group_spans_nodes(group, self.ranks_per_node)
        key = id(group)
        hit = self._spans.get(key)
        if hit is None or hit[0] is not group:  # (the group is kept, so its id is not reused)
            hit = (group, group_spans_nodes(group, self.ranks_per_node))
            self._spans[key] = hit
        return hit[1]

    # -- reading (the framework's) ---------------------------------------------------------------
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
    def inter_node_bytes(records: list[CommRecord]) -> int | None:
        """Payload bytes of ``records`` whose group spans nodes; None when a record's group is unknown."""
        if any(r.inter_node is None for r in records):
            return None
        return sum(r.nbytes for r in records if r.inter_node)

    @staticmethod
    def bytes_by_kind(records: list[CommRecord]) -> dict[str, int]:
        """Payload bytes of ``records`` summed by kind."""
        out: dict[str, int] = defaultdict(int)
        for r in records:
            out[r.kind] += r.nbytes
        return dict(out)


_METERS: weakref.WeakSet[CommMeter] = weakref.WeakSet()  # every live meter of this process


@contextmanager
def comm_paused() -> Iterator[None]:
    """Pause every :class:`CommMeter` of this process inside the ``with`` block.

    For the framework's own collectives (validation passes, metric reductions): a plugin whose
    meter wraps process-wide functions (``torch.distributed``, functional collectives) would
    otherwise count them as training traffic.
    """
    with ExitStack() as stack:
        for meter in list(_METERS):
            stack.enter_context(meter.paused())
        yield
