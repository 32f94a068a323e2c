"""The rank's side of a restart: which checkpoint a rank starts from after the elastic agent restarted it.

The driver's side (when to restart, when to shrink) is :mod:`framework.faults.supervisor`; this
module is imported by the ranks (:mod:`framework.worker`) and imports neither.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

from framework.faults.events import FaultLog
from framework.launch import LaunchSpec


def resume_path(launch: LaunchSpec, rank: int) -> Optional[str]:
    """The checkpoint this rank starts from: the launch's, or after an elastic restart the newest valid one.

    A corrupt checkpoint passed over is warned about and, on rank 0, logged as a detection.
    """
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        return launch.resume_from
    from framework.checkpoint.format import find_latest_valid

    log = FaultLog(launch.run_dir)
    segment = f"{launch.launch_index}.{os.environ['TORCHELASTIC_RESTART_COUNT']}"

    def warn(msg: str) -> None:
        if rank == 0:
            print(f"trainlab: warning: {msg}", file=sys.stderr, flush=True)
            log.append("resume_skipped_corrupt", seg=segment, detail=msg)

    latest = find_latest_valid(launch.resolved.checkpoint_dir, warn=warn)
    if rank == 0:
        print(f"trainlab: restart {os.environ['TORCHELASTIC_RESTART_COUNT']}: resuming from {latest or 'the start'}",
              file=sys.stderr, flush=True)
    return str(latest) if latest else None
