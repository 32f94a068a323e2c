"""``rank_crash``: the rank's process SIGKILLs itself (no Python cleanup, like a machine failure)."""

from __future__ import annotations

import os
import signal
from typing import Any

from framework.base.faults.kinds import FaultContext, FaultKind, register_fault_kind


@register_fault_kind
class RankCrash(FaultKind):
    name = "rank_crash"
    summary = "the rank's process SIGKILLs itself"

    def start(self, event: dict[str, Any], ctx: FaultContext) -> None:
        os.kill(os.getpid(), signal.SIGKILL)
