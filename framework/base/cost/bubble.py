"""Pipeline bubble by schedule (Narayanan et al. 2021 §2.2) and micro-batches in flight.

With ``p`` stages, ``m`` micro-batches per optimizer step and ``v`` model chunks per rank
(interleaved 1F1B), each stage's ideal busy time is ``m·(t_f + t_b)`` and it idles
``(p-1)·(t_f + t_b)/v`` (GPipe and 1F1B: ``v = 1``). As a ratio to the ideal time the bubble is
``(p-1)/(v·m)`` (§2.2.1, §2.2.2); as a fraction of the step ``(p-1)/(v·m + p - 1)``, the
figure trainlab logs (``perf/pp_bubble_frac_model``).
"""

from __future__ import annotations

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")


def pp_bubble_fraction(*, pp: int, n_microbatches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a pipeline step: ``(p-1) / (v·m + p - 1)``.

    Narayanan et al. 2021 §2.2.1 (GPipe, 1F1B: bubble time / ideal time = ``(p-1)/m``) and
    §2.2.2 (interleaved with ``v`` chunks per rank: ``(p-1)/(v·m)``), expressed as a fraction
    of the whole step, ``x / (1 + x)``. Assumes equal forward/backward time in every stage.
    """
    if pp <= 1:
        return 0.0
    return (pp - 1) / (virtual_stages * n_microbatches + pp - 1)


def bubble_ratio(*, pp: int, n_microbatches: int, virtual_stages: int = 1) -> float:
    """Bubble time over ideal compute time, ``(p-1)/(v·m)`` (Narayanan et al. 2021 §2.2)."""
    if pp <= 1:
        return 0.0
    return (pp - 1) / (virtual_stages * n_microbatches)


def schedule_virtual_stages(schedule: str, virtual_stages: int) -> int:
    """``v`` of a schedule: GPipe and 1F1B run one chunk per rank whatever ``virtual_stages`` says.

    Raises:
        ValueError: unknown schedule.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"pp_schedule={schedule!r} is not allowed; allowed: {', '.join(SCHEDULES)}")
    return virtual_stages if schedule == "Interleaved1F1B" else 1


def microbatches_in_flight(*, schedule: str, pp: int, n_microbatches: int, virtual_stages: int = 1) -> float:
    """Micro-batches whose activations the *first* stage holds at its peak, in units of one
    micro-batch through that rank's ``L/p`` layers.

    GPipe: all ``m`` forwards run before any backward. 1F1B (PipeDream-Flush): ``min(p, m)``
    (Narayanan et al. 2021 §2.2.1). Interleaved 1F1B: ``p·(1 + (p-1)/(p·v))`` (Korthikanti et
    al. 2022 §4.2.3: the first stage's memory grows by ``1 + (p-1)/(p·v)``), at most ``m``.
    """
    if pp <= 1:
        return 1.0
    if schedule == "GPipe":
        return float(n_microbatches)
    if schedule == "1F1B" or virtual_stages <= 1:
        return float(min(pp, n_microbatches))
    return min(pp * (1.0 + (pp - 1) / (pp * virtual_stages)), float(n_microbatches))
