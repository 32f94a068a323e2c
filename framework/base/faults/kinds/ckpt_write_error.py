"""``ckpt_write_error``: the next checkpoint write of the rank fails with ``OSError(ENOSPC)`` where the file
would be written (:func:`framework.base.checkpoint.format.write_checkpoint` as called by the checkpoint IO),
leaving no partial folder."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

from framework.base.faults.kinds import FaultContext, FaultKind, register_fault_kind


def arm_checkpoint_write_error() -> None:
    """Make the next checkpoint write of this process fail with ``OSError(ENOSPC)`` (one shot)."""
    import framework.base.checkpoint.io as ckio

    original = ckio.write_checkpoint

    def failing(*args: Any, **kwargs: Any) -> Path:
        ckio.write_checkpoint = original
        raise OSError(errno.ENOSPC, "injected checkpoint write error (fault kind ckpt_write_error)")

    ckio.write_checkpoint = failing


@register_fault_kind
class CkptWriteError(FaultKind):
    name = "ckpt_write_error"
    summary = "the next checkpoint save fails with ENOSPC (no partial folder left)"

    def start(self, event: dict[str, Any], ctx: FaultContext) -> None:
        arm_checkpoint_write_error()
