"""Goodput, its parts and the recovery figures from the run's event log (a pure function of its records).

The records are the run's timeline (:class:`~framework.rank.callbacks.goodput.RunTimeline`:
``start``/``step``/``end``, written in every run), the driver's ``driver_start``/``driver_end``
and the fault machinery's (``injected``, ``detected``, ``skipped``, ``rollback``, ...); see
:mod:`framework.base.faults.events`. Steps are optimizer steps; times are seconds of wall clock.

An **attempt** is one start of the ranks (a ``start`` record): the first, an elastic restart, a
shrink relaunch, or the same command run again after a failure. An attempt *failed* when no
``end`` record follows it; the next attempt is then a **restart**.

Goodput (``goodput`` = ``goodput/productive_s`` / ``goodput/wall_s``; the definition of
STYLE.md, "productive step time / wall-clock time"). The wall time (the driver invocations,
``driver_start`` to ``driver_end``) is cut into:

- ``productive_s``: the last execution of each step, unless its update was dropped; a step's
  time runs from the end of the step before it (or the attempt's start) to its own end, less
  the checkpoint blocking and validation in between (so it holds data wait, forward/backward,
  optimizer);
- ``checkpoint_s``: seconds checkpoint saves held training (every save, replayed steps' too);
- ``validation_s``: validation passes;
- ``lost_s``: work done again or thrown away: executions of a step that was run again later
  (after a restart or rollback), steps whose update was dropped, and the part of a failed
  attempt's in-flight step before the failure;
- ``detect_s``: from a failure (the ``injected`` record that ended the attempt; without one, its
  last record) to the next attempt's process start, or to the end of the driver invocation;
- ``startup_s``: the first attempt's start-up (driver start -> training starts) and the last
  attempt's shutdown (training end -> driver end);
- ``restart_s``: the later attempts' start-ups, in parts (per attempt also as ``restart/*``):
  ``process_start`` (process created -> worker ``main``: interpreter and torch imports; for the
  first attempt of a driver invocation from the driver's start: the elastic agent too),
  ``setup`` (-> ``fit`` called: Lightning import, data, model, plugin, Trainer), ``rendezvous``
  (-> process group up), ``ckpt_load`` (-> checkpoint read and handed over, model configured),
  ``restore`` (-> training starts: strategy setup, optimizer state, data fast-forward);
  ``restart/first_step_s`` is the attempt's first step (already in ``productive_s``/``lost_s``);
- ``unaccounted_s``: wall minus the parts above (records missing, e.g. a crash before training
  started); small when the log is complete.

``goodput/ettr``: the effective training time ratio as MegaScale computes it, "number of
iterations x iteration training time / total training time": distinct steps completed x the
median productive step time, over the wall time (slow first steps and stragglers count at the
median, so it sits above ``goodput`` by their excess).

Recovery figures:

- ``fault/injected``: distinct scheduled events that fired (on any rank).
- ``fault/detected``: detections: the step guard's (non-finite, loss/grad spike), the hang
  watchdog's, straggler episodes, corrupt checkpoints passed over on resume, and rank failures
  seen as a restart (one per restart not already explained by a hang detection).
- ``fault/detect_latency_steps``: mean over detections of (step of the detection - step of the
  latest injected fault before it); ``fault/detect_latency_s`` the same in seconds.
- ``recovery/restarts``: attempts after a failed attempt (elastic restarts, shrink relaunches,
  and the same command run again after a failure).
- ``recovery/rollbacks``, ``recovery/skipped_steps``: in-process rollbacks; dropped updates.
- ``recovery/recomputed_steps``: completed executions of a step that ran again later (a step
  in flight at a crash never completed and is not counted; a step rolled back is).
- ``recovery/time_s``: sum over injected faults of the time from the fault to the end of the
  first step at or past the faulted step (training past it again).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

RESTART_PARTS = ("process_start", "setup", "rendezvous", "ckpt_load", "restore")
"""The start-up parts of an attempt, in order (``restart/<part>_s``)."""

GOODPUT_PARTS = ("productive", "checkpoint", "validation", "lost", "detect", "startup", "restart")
"""The parts of the wall time (``goodput/<part>_s``); with ``unaccounted`` they sum to ``wall``."""


def _invocations(records: list[dict[str, Any]], now: float) -> list[tuple[float, float, list[dict[str, Any]]]]:
    """``(start, end, records)`` per driver invocation; records before the first ``driver_start`` go to the first."""
    out: list[tuple[float, float, list[dict[str, Any]]]] = []
    cur: list[dict[str, Any]] | None = None
    t0 = None
    for r in records:
        if r["ev"] == "driver_start":
            if cur is not None and t0 is not None:  # no driver_end: the driver was killed
                out.append((t0, cur[-1]["t"] if cur else t0, cur))
            t0, cur = r["t"], []
        elif r["ev"] == "driver_end":
            if t0 is not None:
                out.append((t0, r["t"], cur or []))
            t0, cur = None, None
        elif cur is not None:
            cur.append(r)
    if t0 is not None:
        out.append((t0, now, cur or []))
    return out


def attempt_parts(start: dict[str, Any], begin: float) -> dict[str, float]:
    """Start-up seconds of one attempt by part (:data:`RESTART_PARTS`), from its ``start`` record.

    ``begin``: when the attempt's start-up began (its process creation, or the driver's start
    for the first attempt of a driver invocation). A mark missing from the record (an older
    log) puts its time in the next part.
    """
    t = start["t"]
    marks = [begin, start.get("t_main"), start.get("t_fit"), start.get("t_rdzv"), start.get("t_loaded"), t]
    parts: dict[str, float] = {}
    prev = begin
    for name, mark in zip(RESTART_PARTS, marks[1:]):
        if mark is None or mark < prev:
            parts[name] = 0.0
            continue
        parts[name] = min(mark, t) - prev
        prev = min(mark, t)
    return parts


def recovery_figures(records: list[dict[str, Any]], now: float | None = None) -> dict[str, float]:
    """The ``fault/``, ``recovery/`` and ``goodput`` metrics of a run's event log records (write order)."""
    now = time.time() if now is None else now
    figures = _fault_figures(records)
    figures.update(goodput_figures(records, now)[0])
    return figures


def _fault_figures(records: list[dict[str, Any]]) -> dict[str, float]:
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

    restarts = 0
    last_step: int | None = None
    ended_cleanly = True
    hang_in_attempt = False
    for r in records:
        ev = r["ev"]
        if ev == "start":
            if last_step is not None and not ended_cleanly:  # the attempt before failed
                restarts += 1
                if not hang_in_attempt:
                    detections.append(
                        {"ev": "detected", "detector": "rank_failure", "t": r["t"], "step": last_step + 1}
                    )
            last_step, ended_cleanly, hang_in_attempt = r.get("step", 0), False, False
        elif ev == "step":
            last_step = r["step"] if not r.get("rolled_back") else last_step
        elif ev == "end":
            ended_cleanly = True
        elif ev == "detected" and r.get("detector") == "hang_watchdog":
            hang_in_attempt = True
        elif ev == "rollback":
            last_step = r["to_step"]

    executions: dict[int, int] = {}
    for r in records:
        if r["ev"] == "step":
            executions[r["step"]] = executions.get(r["step"], 0) + 1
    recomputed = sum(n - 1 for n in executions.values())  # every execution but the last ran again

    latencies_steps, latencies_s = [], []
    for d in detections:
        before = [i for i in injected if i["t"] <= d["t"] and i["step"] <= d.get("step", i["step"])]
        if before:
            cause = before[-1]
            latencies_steps.append(max(0, d.get("step", cause["step"]) - cause["step"]))
            latencies_s.append(max(0.0, d["t"] - cause["t"]))

    step_records = [r for r in records if r["ev"] == "step" and not r.get("rolled_back")]
    recovery_s = 0.0
    for inj in first_injection.values():
        past = next((s for s in step_records if s["t"] > inj["t"] and s["step"] >= inj["step"]), None)
        if past is not None:
            recovery_s += past["t"] - inj["t"]

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else 0.0

    return {
        "fault/injected": float(len(first_injection)),
        "fault/detected": float(len(detections)),
        "fault/detect_latency_steps": mean(latencies_steps),
        "fault/detect_latency_s": mean(latencies_s),
        "recovery/restarts": float(restarts),
        "recovery/rollbacks": float(sum(1 for r in records if r["ev"] == "rollback")),
        "recovery/skipped_steps": float(len({r["step"] for r in records if r["ev"] == "skipped"})),
        "recovery/recomputed_steps": float(recomputed),
        "recovery/time_s": recovery_s,
    }


def goodput_figures(
    records: list[dict[str, Any]], now: float | None = None
) -> tuple[dict[str, float], list[dict[str, float]]]:
    """``(figures, attempts)``: ``goodput``, ``goodput/<part>_s``, ``goodput/wall_s``, ``goodput/ettr``
    (see the module docstring), and per attempt ``{"step": resumed step, "restart": 0/1,
    "<part>_s": seconds for each of RESTART_PARTS, "first_step_s"}``."""
    now = time.time() if now is None else now
    parts = {p: 0.0 for p in GOODPUT_PARTS}
    wall = 0.0
    attempts: list[dict[str, float]] = []
    # the last execution of each step; an execution dropped its update when a skip record of it precedes it
    last_exec: dict[int, int] = {}  # step -> id() of its last record
    for r in records:
        if r["ev"] == "step":
            last_exec[r["step"]] = id(r)
    step_d: list[float] = []
    prev_failed = False  # the attempt before this one failed (across driver invocations too)
    for t0, t1, recs in _invocations(records, now):
        wall += t1 - t0
        idx = [i for i, r in enumerate(recs) if r["ev"] == "start"]
        if not idx:  # nothing started (a failure before training began)
            parts["startup" if not attempts else "restart"] += t1 - t0
            continue
        for k, si in enumerate(idx):
            start = recs[si]
            nxt = idx[k + 1] if k + 1 < len(idx) else len(recs)
            begin = t0 if k == 0 else start.get("t_proc", start["t"])
            a = attempt_parts(start, begin)
            kind = "restart" if prev_failed else "startup"
            parts[kind] += sum(a.values())
            body = recs[si + 1 : nxt]
            first = next((r for r in body if r["ev"] == "step"), None)
            attempts.append(
                {
                    "step": float(start.get("step", 0)),
                    "restart": float(prev_failed),
                    **{f"{p}_s": v for p, v in a.items()},
                    "first_step_s": float(first["d"]) if first else 0.0,
                }
            )
            t_last = start["t"]
            ended = None
            pending_skips: set[int] = set()
            for r in body:
                if r["ev"] == "skipped":
                    pending_skips.add(r["step"])
                elif r["ev"] == "step":
                    dropped = r["step"] in pending_skips
                    pending_skips.clear()
                    parts["checkpoint"] += r.get("c", 0.0)
                    parts["validation"] += r.get("v", 0.0)
                    if last_exec[r["step"]] == id(r) and not r.get("rolled_back") and not dropped:
                        parts["productive"] += r["d"]
                        step_d.append(r["d"])
                    else:
                        parts["lost"] += r["d"]
                    t_last = r["t"]
                elif r["ev"] == "end":
                    parts["checkpoint"] += r.get("c", 0.0)
                    parts["validation"] += r.get("v", 0.0)
                    parts["startup"] += r.get("d", 0.0)  # after the last step: shutdown
                    t_last, ended = r["t"], r
            t_next = t1 if k + 1 == len(idx) else recs[nxt].get("t_proc", recs[nxt]["t"])
            if ended is not None:
                parts["startup"] += max(0.0, t_next - t_last)  # shutdown
                prev_failed = False
            else:
                hits = [r["t"] for r in body if r["ev"] == "injected" and r["t"] >= t_last]
                t_fail = min(hits) if hits else t_last
                parts["lost"] += max(0.0, min(t_fail, t_next) - t_last)
                parts["detect"] += max(0.0, t_next - max(t_fail, t_last))
                prev_failed = True
        # before the first attempt of this invocation: counted in its process_start (begin = t0)
    figures = {f"goodput/{p}_s": v for p, v in parts.items()}
    figures["goodput/wall_s"] = wall
    figures["goodput/unaccounted_s"] = wall - sum(parts.values())
    figures["goodput"] = parts["productive"] / wall if wall > 0 else 0.0
    distinct = len({r["step"] for r in records if r["ev"] == "step" and not r.get("rolled_back")})
    figures["goodput/ettr"] = distinct * statistics.median(step_d) / wall if step_d and wall > 0 else 0.0
    return figures, attempts
