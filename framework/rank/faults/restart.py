"""The rank's side of a restart: which checkpoint a rank starts from after the elastic agent restarted it.

The driver's side (when to restart, when to shrink) is :mod:`framework.driver.faults.supervisor`; this
module is imported by the ranks (:mod:`framework.rank.worker`) and imports neither.
"""

from __future__ import annotations

import os
import sys

from framework.base.faults.events import FaultLog
from framework.base.launch import LaunchSpec


def restart_count() -> int:
    """How many times the elastic agent restarted this launch's ranks (0: their first start)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def restart_label(launch: LaunchSpec) -> str:
    """Which (re)start of the ranks this rank is in: ``"<launch_index>.<elastic restart count>"``
    (``"0.0"``: the first start; a shrink or node relaunch raises the first number, an elastic
    restart the second); the ``seg`` of the rank's event-log records. Built once per rank (:mod:`framework.rank.worker`)."""
    return f"{launch.launch_index}.{restart_count()}"


def resume_path(launch: LaunchSpec, rank: int, log: FaultLog, segment: str) -> str | None:
    """The checkpoint this rank starts from: the launch's, or after an elastic restart the newest valid one.

    ``log``: the run's event log; ``segment``: :func:`restart_label`. A corrupt checkpoint passed
    over is warned about and, on rank 0, logged as a detection.
    """
    if restart_count() == 0:
        return launch.resume_from
    from framework.base.checkpoint.format import find_latest_valid

    def warn(msg: str) -> None:
        if rank == 0:
            print(f"trainlab: warning: {msg}", file=sys.stderr, flush=True)
            log.append("resume_skipped_corrupt", seg=segment, detail=msg)

    latest = find_latest_valid(launch.resolved.checkpoint_dir, warn=warn)
    if rank == 0:
        print(
            f"trainlab: restart {restart_count()}: resuming from {latest or 'the start'}", file=sys.stderr, flush=True
        )
    return str(latest) if latest else None
