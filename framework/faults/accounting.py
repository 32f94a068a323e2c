"""Recovery figures from the fault log (a pure function of its records; the driver logs them).

Definitions (steps are optimizer steps; times are seconds of wall clock):

- ``fault/injected``: distinct scheduled events that fired (on any rank).
- ``fault/detected``: detections: the step guard's (non-finite, loss/grad spike), the hang
  watchdog's, straggler episodes, corrupt checkpoints passed over on resume, and rank failures
  seen as a restart of the ranks (one per restart not already explained by a hang detection).
- ``fault/detect_latency_steps``: mean over detections of (step of the detection - step of the
  latest injected fault before it); ``fault/detect_latency_s`` the same in seconds.
- ``recovery/restarts``: (re)starts of the ranks after the first of each driver invocation
  (elastic restarts and shrink relaunches).
- ``recovery/rollbacks``, ``recovery/skipped_steps``: in-process rollbacks; dropped updates.
- ``recovery/recomputed_steps``: steps run again: per restart, from the step resumed to the step
  in flight when the ranks stopped (the last finished step + 1, or the last one when they ended
  cleanly); per rollback, from the snapshot's step to the faulty step.
- ``recovery/time_s``: sum over injected faults of the time from the fault to the end of the
  first step at or past the faulted step (training past it again).
- ``goodput``: time spent on steps that count / wall time of the driver invocations. A step
  counts in its last execution, unless its update was dropped; its time is from its first
  micro-batch to the end of its optimizer step (data wait, validation and checkpoint saves between
  steps do not count; restarts, replays and skipped steps are lost time). Following the
  definition in STYLE.md ("productive step time / wall-clock time").
"""

from __future__ import annotations

import time
from typing import Any


def recovery_figures(records: list[dict[str, Any]], now: float | None = None) -> dict[str, float]:
    """The ``fault/``, ``recovery/`` and ``goodput`` metrics of a run's fault log records (write order)."""
    injected = [r for r in records if r["ev"] == "injected"]
    first_injection: dict[str, dict[str, Any]] = {}
    for r in injected:
        first_injection.setdefault(r["id"], r)

    detections: list[dict[str, Any]] = []
    seen = set()
    for r in records:
        if r["ev"] == "detected":
            key = (r.get("detector"), r.get("step"), r.get("seg"))
            if key not in seen:  # the watchdog of every rank may report the same hang
                seen.add(key)
                detections.append(r)
        elif r["ev"] == "resume_skipped_corrupt":
            detections.append({**r, "detector": "ckpt_corrupt"})

    restarts = rollbacks = recomputed = 0
    last_step: int | None = None
    ended_cleanly = False
    hang_in_segment = False
    for r in records:
        ev = r["ev"]
        if ev == "driver_start":
            continue
        if ev == "start":
            if last_step is not None or r.get("restart", 0) > 0 or r.get("launch", 0) > 0:
                if r.get("restart", 0) > 0 or r.get("launch", 0) > 0:
                    restarts += 1
                    if not hang_in_segment:
                        detections.append({"ev": "detected", "detector": "rank_failure", "t": r["t"],
                                           "step": (last_step or 0) + 1})
                if last_step is not None:
                    recomputed += max(0, last_step + (0 if ended_cleanly else 1) - r.get("step", 0))
            last_step, ended_cleanly, hang_in_segment = r.get("step", 0), False, False
        elif ev == "step":
            last_step = r["step"]
        elif ev == "end":
            ended_cleanly = True
        elif ev == "detected" and r.get("detector") == "hang_watchdog":
            hang_in_segment = True
        elif ev == "rollback":
            rollbacks += 1
            recomputed += r["from_step"] - r["to_step"]
            last_step = r["to_step"]

    latencies_steps, latencies_s = [], []
    for d in detections:
        before = [i for i in injected if i["t"] <= d["t"] and i["step"] <= d.get("step", i["step"])]
        if before:
            cause = before[-1]
            latencies_steps.append(max(0, d.get("step", cause["step"]) - cause["step"]))
            latencies_s.append(max(0.0, d["t"] - cause["t"]))

    step_records = [r for r in records if r["ev"] == "step"]
    recovery_s = 0.0
    for inj in first_injection.values():
        past = next((s for s in step_records if s["t"] > inj["t"] and s["step"] >= inj["step"]), None)
        if past is not None:
            recovery_s += past["t"] - inj["t"]

    final: dict[int, dict[str, Any]] = {}
    for s in step_records:
        final[s["step"]] = s  # the last execution of each step
    productive = sum(s["d"] for s in final.values() if not s.get("skipped"))
    wall, t0 = 0.0, None
    for r in records:
        if r["ev"] == "driver_start":
            t0 = r["t"]
        elif r["ev"] == "driver_end" and t0 is not None:
            wall, t0 = wall + r["t"] - t0, None
    if t0 is not None:
        wall += (now or time.time()) - t0

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else 0.0

    return {
        "fault/injected": float(len(first_injection)),
        "fault/detected": float(len(detections)),
        "fault/detect_latency_steps": mean(latencies_steps),
        "fault/detect_latency_s": mean(latencies_s),
        "recovery/restarts": float(restarts),
        "recovery/rollbacks": float(rollbacks),
        "recovery/skipped_steps": float(len({r["step"] for r in records if r["ev"] == "skipped"})),
        "recovery/recomputed_steps": float(recomputed),
        "recovery/time_s": recovery_s,
        "goodput": productive / wall if wall > 0 else 0.0,
    }
