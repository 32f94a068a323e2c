"""Checkpoints: the folder format, save policies, deltas, sharded (DCP) checkpoints, resume selection.

Importing the package registers the kinds trainlab writes itself in the table of
:mod:`framework.base.checkpoint.kinds` (a plugin with its own files registers its kind in its
checkpoint module). The loaders import torch only when they are called, so the driver can
consult the table before any rank starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from framework.base.checkpoint.kinds import CheckpointKind, register_checkpoint_kind


def _load_full(path: Path) -> dict[str, Any]:
    from framework.base.checkpoint.format import STATE_FILE, safe_torch_load

    return safe_torch_load(path / STATE_FILE)


def _load_delta(path: Path) -> dict[str, Any]:
    from framework.base.checkpoint.delta import apply_delta
    from framework.base.checkpoint.format import STATE_FILE, read_manifest, safe_torch_load

    base = safe_torch_load(path.parent / read_manifest(path)["base"] / STATE_FILE)
    return apply_delta(base, safe_torch_load(path / STATE_FILE))


def _load_dcp_full(path: Path) -> dict[str, Any]:
    from framework.base.checkpoint.dcp import load_full_state

    return load_full_state(path)


def _load_dcp_shards(path: Path, tensors: dict[str, Any]) -> dict[str, Any]:
    from framework.base.checkpoint.dcp import load_shards

    return load_shards(path, tensors)


def _save_dcp(dirpath: Path, step: int, checkpoint: dict[str, Any], manifest: dict[str, Any]) -> Path | None:
    from framework.base.checkpoint.dcp import save_sharded

    return save_sharded(dirpath, step, checkpoint, manifest)


register_checkpoint_kind(CheckpointKind("full", "full checkpoints", load_full_state=_load_full))
register_checkpoint_kind(CheckpointKind("delta", "delta checkpoints", load_full_state=_load_delta))
register_checkpoint_kind(
    CheckpointKind(
        "dcp",
        "sharded (DCP) checkpoints",  # framework.base.checkpoint.dcp.KIND
        load_full_state=_load_dcp_full,
        load_into_shards=_load_dcp_shards,
        save_shards=_save_dcp,
    )
)
