"""Counting host-device synchronisations: the calls that make the host wait for the device.

A CUDA step runs ahead of the host only while nothing reads a device value back: ``.item()``,
``.tolist()``, ``.cpu()`` / ``.numpy()`` / ``.to("cpu")``, and the Python conversions of a
tensor (``bool()`` — an ``if`` on a tensor —, ``float()``, ``int()``, formatting) each wait until
every queued kernel has run, so the next step's kernels are queued only then and the device
idles for the host's launch latency. A training step should have none except where it logs
(the loss, the gradient norm, timings every ``log_every_n_steps``).

:class:`HostSyncCounter` counts them on any device, the CPU included, with a
:class:`torch.overrides.TorchFunctionMode`: every call of those tensor methods in its window
is recorded with its call site, on CPU tensors too (there they cost nothing, but the same call
on a GPU run waits). A call on a tensor made on the host and never moved (e.g. a count built in
the data loader) is recorded as well; the call site tells. On CUDA the device itself can
report the syncs it performs (``torch.cuda.set_sync_debug_mode``, used by
:class:`CudaSyncCounter`), which also sees syncs inside torch's own C++ code (``nonzero``,
boolean-mask indexing, a CPU scalar read of a CUDA tensor).
"""

from __future__ import annotations

import contextlib
import os
import threading
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

SYNC_METHODS = {
    torch.Tensor.item: "item",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.cpu: "cpu",
    torch.Tensor.numpy: "numpy",
    torch.Tensor.__bool__: "bool",
    torch.Tensor.__float__: "float",
    torch.Tensor.__int__: "int",
    torch.Tensor.__index__: "index",
    torch.Tensor.__format__: "format",
}
"""Tensor methods that read a value back to the host (their names in the records)."""

_OWN_FILES = (os.path.abspath(__file__), os.path.abspath(torch.overrides.__file__))
_HOST = threading.local()


@contextlib.contextmanager
def host_read() -> Iterator[None]:
    """Marks reads of tensors that live on the host on every device (e.g. a flag all-reduced over a gloo CPU
    group): :class:`HostSyncCounter` does not count them (on a CPU run it cannot tell them from device tensors)."""
    _HOST.depth = getattr(_HOST, "depth", 0) + 1
    try:
        yield
    finally:
        _HOST.depth -= 1


def _call_site() -> str:
    """``file:line (function)`` of the innermost frame outside this module and torch's overrides."""
    for frame in reversed(traceback.extract_stack()):
        if os.path.abspath(frame.filename) not in _OWN_FILES and "/torch/_tensor.py" not in frame.filename:
            path = frame.filename
            for marker in ("/framework/", "/plugins/", "/site-packages/"):
                if marker in path:
                    path = path[path.index(marker) + 1 :]
                    break
            return f"{path}:{frame.lineno} ({frame.name})"
    return "?"


def _is_to_host(func: Any, args: tuple, kwargs: dict) -> bool:
    """``tensor.to(...)`` of a tensor off the CPU with a CPU device among its arguments (on a CPU
    run, ``.to(device)`` is the move to the run's device, not a read-back)."""
    if func is not torch.Tensor.to or not args or not isinstance(args[0], torch.Tensor) or args[0].device.type == "cpu":
        return False
    for a in (*args[1:], *kwargs.values()):
        if isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu":
            return True
    return False


class HostSyncCounter(TorchFunctionMode):
    """Records each call of :data:`SYNC_METHODS` (and ``.to("cpu")``) while active: ``(kind, call site)``.

    Use as a context manager, or :meth:`start` / :meth:`stop` around a window that spans hooks.
    Costs a Python call per torch operation while active (a measurement tool, not for timed runs).

    Attributes:
        records: ``(kind, site)`` of every call since the last :meth:`take`.
    """

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, str]] = []
        self._active = False

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        kind = SYNC_METHODS.get(func)
        if kind is None and _is_to_host(func, args, kwargs):
            kind = "to_cpu"
        if kind is not None and not getattr(_HOST, "depth", 0):
            self.records.append((kind, _call_site()))
        return func(*args, **kwargs)

    def start(self) -> None:
        """Enter the mode (idempotent)."""
        if not self._active:
            self.__enter__()
            self._active = True

    def stop(self) -> None:
        """Leave the mode (idempotent). Must be called on the thread that started it, with modes entered after it left."""
        if self._active:
            self.__exit__(None, None, None)
            self._active = False

    def take(self) -> list[tuple[str, str]]:
        """The records so far; clears them."""
        out, self.records = self.records, []
        return out


class CudaSyncCounter:
    """The syncs the CUDA runtime performs in a window, from ``torch.cuda.set_sync_debug_mode("warn")``'s
    warnings (each carries the Python call site). Same interface as :class:`HostSyncCounter`."""

    MESSAGE = "synchronizing"

    def __init__(self) -> None:
        self.records: list[tuple[str, str]] = []
        self._catch: warnings.catch_warnings | None = None
        self._log: list = []

    def start(self) -> None:
        if self._catch is None:
            self._catch = warnings.catch_warnings(record=True)
            self._log = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> None:
        if self._catch is not None:
            torch.cuda.set_sync_debug_mode("default")
            self._catch.__exit__(None, None, None)
            self._catch = None
            self.records += [
                ("cuda_sync", f"{w.filename}:{w.lineno}") for w in self._log if self.MESSAGE in str(w.message)
            ]
            self._log = []

    def take(self) -> list[tuple[str, str]]:
        out, self.records = self.records, []
        return out


def summarize(records: list[tuple[str, str]], top: int = 8) -> str:
    """``kind at site xN; ...`` of the ``top`` most frequent records."""
    return "; ".join(f"{kind} at {site} x{n}" for (kind, site), n in Counter(records).most_common(top))
