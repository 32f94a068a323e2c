"""``ckpt_corrupt``: a byte in the middle of the newest complete checkpoint's ``state.pt`` is flipped (a
resume must pass over it by its checksum)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from framework.base.faults.kinds import FaultContext, FaultKind, register_fault_kind


def corrupt_newest_checkpoint(checkpoint_dir: str | Path) -> Path | None:
    """Flip one byte in the middle of the newest complete checkpoint's ``state.pt``; return its folder."""
    from framework.base.checkpoint.format import STATE_FILE, list_checkpoints

    found = list_checkpoints(checkpoint_dir)
    if not found:
        return None
    folder = found[-1][1]
    path = folder / STATE_FILE
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x5A]))
        f.flush()
        os.fsync(f.fileno())
    return folder


@register_fault_kind
class CkptCorrupt(FaultKind):
    name = "ckpt_corrupt"
    summary = "a flipped byte in the newest complete checkpoint"

    def start(self, event: dict[str, Any], ctx: FaultContext) -> None:
        folder = corrupt_newest_checkpoint(ctx.checkpoint_dir)
        print(f"trainlab: fault: corrupted {folder}", file=sys.stderr, flush=True)
