"""The one way a rank sends metrics: :class:`MetricEmitter`.

Every metric a rank reports (step metrics, validation, memory, checkpoint figures, the step-time
breakdown, a plugin's own, host syncs) goes through the run's one emitter, built by the worker
over the run's sinks (``metrics.jsonl`` and, on rank 0, the buffered MLflow outbox the driver sends,
:mod:`framework.base.tracking`). Only rank 0 writes: figures that need every rank (a reduction over
ranks) are reduced first, on every rank, and then emitted; on the other ranks ``emit`` does
nothing, so callers need not test the rank.

Sinks are callables ``sink(metrics, step)``; a sink that buffers (``flush()`` and
``discard_after(step)``, :class:`~framework.base.tracking.MetricOutbox`) is flushed by
:meth:`MetricEmitter.flush` (the step's last phase, :class:`~framework.rank.callbacks.metric_flush.FlushMetrics`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

MetricSink = Callable[[Mapping[str, float], int], None]
"""A metric destination: called with ``(metrics, step)``; ``step`` is the optimizer step (1-based) they belong to."""


class MetricEmitter:
    """Sends a rank's metrics to the run's sinks (rank 0 only; see the module docstring).

    Args:
        sinks: the run's metric sinks, each ``sink(metrics, step)``.
        enabled: whether this rank writes (True on global rank 0; False elsewhere: every call is a no-op
            except :meth:`flush`, which sends whatever the buffering sinks hold, i.e. nothing).
    """

    def __init__(self, sinks: Iterable[MetricSink] = (), *, enabled: bool = True) -> None:
        self.sinks = list(sinks)
        self.enabled = enabled

    def __call__(self, metrics: Mapping[str, float], step: int) -> None:
        """Write ``metrics`` (key -> value) for optimizer step ``step`` to every sink (rank 0 only)."""
        if self.enabled:
            for sink in self.sinks:
                sink(metrics, step)

    emit = __call__

    @property
    def buffered(self) -> list[Any]:
        """The sinks that buffer (have ``flush``): what :meth:`flush` sends."""
        return [s for s in self.sinks if hasattr(s, "flush")]

    def flush(self) -> None:
        """Send what the buffering sinks hold now (every rank may call it; only rank 0's hold anything)."""
        for sink in self.buffered:
            sink.flush()

    def discard_after(self, step: int) -> None:
        """Drop buffered, unsent points of steps after ``step`` (training was rewound to ``step``)."""
        for sink in self.buffered:
            sink.discard_after(step)
