"""The run's event log (the fault log): one JSON object per line in ``<run_dir>/faults.jsonl``, appended by every rank.

Ranks restart and the driver may relaunch them at another world size, but the run folder
stays, so this file is where "what already happened" lives: an injector reads it at start and
never fires an event twice (also when its step is replayed after a recovery), and the driver
turns it into the recovery figures (:mod:`framework.driver.faults.accounting`).

Records (``ev`` field; ``t`` = Unix time in seconds, ``step`` = optimizer step, 1-based):

- ``driver_start`` / ``driver_end``: a driver invocation (wall-time bounds for goodput).
- ``start``: rank 0 began training (``launch`` = driver relaunch index, ``restart`` = elastic
  restart count, ``world_size``, ``grad_accum_steps``, ``step`` = step resumed from, and the
  attempt's start-up marks ``t_proc``, ``t_main``, ``t_fit``, ``t_rdzv``, ``t_loaded``);
  written in every run by :class:`~framework.rank.callbacks.goodput.RunTimeline`, as are ``step``
  and ``end``.
- ``injected``: a rank fired event ``id`` (``kind``, ``step``, ``rank``); written (and fsync'd)
  before the fault acts, so a crash cannot lose it.
- ``detected``: a detector flagged a fault (``detector``, ``step``, ``rank``; hang: ``stalled_s``).
- ``step``: rank 0 finished step ``step`` (``d`` = its seconds since the step before, less
  ``c`` checkpoint blocking and ``v`` validation; ``rolled_back`` when a rollback rewound it).
- ``end``: training finished (``c``/``v`` of the final save and validation).
- ``skipped``: a rank dropped step ``step``'s update (``rank``, ``reason``).
- ``rollback``: the ranks went back from ``from_step`` to the snapshot at ``to_step``.
- ``resume_skipped_corrupt``: a restarted rank passed over a corrupt checkpoint (``path``).
- ``shrink``: the driver relaunched with fewer ranks (``from_world``, ``to_world``; several nodes: node 0 alone).
- ``node_restart``: node 0's driver of a multi-node run relaunched every node's ranks after they failed
  (``restart``: its number, ``step``: the checkpoint resumed, ``reason``: the failure's first line);
  :func:`framework.driver.faults.supervisor.supervise`.
- ``abort``: the policy gave up after ``faults`` detected faults.
- ``preempted``: the ranks stopped for a preemption (``signal``, ``step_at_signal``, ``saved_step``,
  ``t_signal``: when rank 0 got the signal); :mod:`framework.base.faults.preemption`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

LOG_NAME = "faults.jsonl"


class FaultLog:
    """Append-only JSON-lines log shared by the ranks and the driver of one run.

    Each record is one ``write`` of one line on an ``O_APPEND`` descriptor, followed by
    ``fsync``: lines of concurrent writers never interleave, and a record survives the
    SIGKILL that may follow it.
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOG_NAME

    def append(self, ev: str, *, sync: bool = True, **fields: Any) -> dict[str, Any]:
        """Append record ``{"ev": ev, "t": now, **fields}``; returns it.

        ``sync=False`` skips the ``fsync``: the line still survives the writer's SIGKILL (it is in
        the page cache), only not a crash of the machine; for per-step records, where an fsync
        per step would show in the step time.
        """
        rec = {"ev": ev, "t": time.time(), **fields}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(rec) + "\n").encode())
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        return rec

    def read(self) -> list[dict[str, Any]]:
        """Every record, in write order (a torn last line, if any, is ignored)."""
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out

    def fired_ids(self) -> set[str]:
        """Ids of ``injected`` records (``"<event id>@<rank>"``)."""
        return {f"{r['id']}@{r['rank']}" for r in self.read() if r.get("ev") == "injected"}

    def remove(self) -> None:
        """Delete the log (a fresh start of the run)."""
        self.path.unlink(missing_ok=True)
