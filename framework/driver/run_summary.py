"""The few figures a run leads with in the MLflow UI: ``summary/*`` metrics with units, and a one-line description.

The driver logs them when a run ends (:func:`framework.driver.train.run_job`), from the run's
``summary.json`` (rank 0's run-level means) and ``metrics.jsonl`` (the last logged step-time
fractions, the peak memory over every logged step and rank):

- ``summary/tokens_per_sec`` (tokens/s, whole job, timed steps), ``summary/mfu`` (fraction),
  ``summary/peak_mem_GiB`` (``mem/peak_bytes`` max over ranks and steps, GiB),
  ``summary/step_time_ms`` (mean optimizer-step time, ms), ``summary/comm_share`` and
  ``summary/data_wait_share`` (fractions of step time), rounded to what the figure can tell
  (3 significant digits);
- the run description (MLflow's ``mlflow.note.content``), e.g.
  ``ddp dp2-tp1-pp1 | 2,230 tokens/s | MFU 0.108 of 6.14e+10 FLOP/s | peak 0.633 GiB | comm 12.0% | data wait 1.0%``.
  The MFU denominator (the peak FLOP/s, measured per run on CPU) is named, so two runs whose
  MFU were computed against different peaks say so.

A figure a run did not log is left out of both (never logged as 0).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from math import floor, log10
from typing import Any

GIB = 1024**3


def _round(x: float, digits: int = 3) -> float:
    """``x`` to ``digits`` significant digits."""
    return 0.0 if x == 0 else round(x, digits - 1 - floor(log10(abs(x))))


def _last(records: Sequence[Mapping[str, float]], key: str) -> float | None:
    vals = [r[key] for r in records if key in r]
    return vals[-1] if vals else None


def summary_metrics(summary: Mapping[str, Any], records: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """``summary/*`` metrics of a run from its ``summary.json`` dict and ``metrics.jsonl`` records (see the module docstring)."""
    peaks = [r["mem/peak_bytes"] for r in records if "mem/peak_bytes" in r]
    raw = {
        "summary/tokens_per_sec": summary.get("perf/tokens_per_sec_mean"),
        "summary/mfu": summary.get("perf/mfu_mean"),
        "summary/peak_mem_GiB": max(peaks) / GIB if peaks else None,
        "summary/step_time_ms": summary["perf/step_time_s_mean"] * 1e3 if "perf/step_time_s_mean" in summary else None,
        "summary/comm_share": _last(records, "perf/comm_frac_mean"),
        "summary/data_wait_share": _last(records, "perf/data_wait_frac_mean"),
    }
    return {k: _round(float(v)) for k, v in raw.items() if v is not None}


def run_description(plugin: str, layout: str, metrics: Mapping[str, float], peak_flops: float | None) -> str:
    """The one-line description of a run from :func:`summary_metrics` (figures it lacks are left out)."""
    parts = [f"{plugin} {layout}"]
    if "summary/tokens_per_sec" in metrics:
        parts.append(f"{metrics['summary/tokens_per_sec']:,.0f} tokens/s")
    if "summary/mfu" in metrics:
        parts.append(f"MFU {metrics['summary/mfu']:.3g}" + (f" of {peak_flops:.3g} FLOP/s" if peak_flops else ""))
    if "summary/peak_mem_GiB" in metrics:
        parts.append(f"peak {metrics['summary/peak_mem_GiB']:.3g} GiB")
    if "summary/comm_share" in metrics:
        parts.append(f"comm {100 * metrics['summary/comm_share']:.1f}%")
    if "summary/data_wait_share" in metrics:
        parts.append(f"data wait {100 * metrics['summary/data_wait_share']:.1f}%")
    return " | ".join(parts)
