"""The errors of the checkpoint package (no torch: the driver raises them before any rank starts)."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing or bad manifest, checksum mismatch, missing base."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds pickled objects other than tensors and plain containers."""
