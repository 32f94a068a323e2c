"""Checkpoint kinds: how a checkpoint of each manifest ``kind`` loads (and a sharded one saves), in one table that plugins register into.

Every checkpoint folder's manifest names its ``kind`` (:mod:`framework.base.checkpoint.format`). The
checkpoint package registers the kinds trainlab itself writes (``full``, ``delta``, ``dcp``: see
:mod:`framework.base.checkpoint`); a plugin that writes its own files registers its kind when its
checkpoint module is imported. Loading code asks this table, never compares kind names:

- :func:`framework.base.checkpoint.format.load_state` gathers any kind with a ``load_full_state``
  into one full Lightning checkpoint dict (for plugins that hold full tensors);
- a sharded plugin reads a kind with a ``load_into_shards`` straight into its live shards
  (:func:`framework.base.checkpoint.dcp.load_into_sharded`), and any other kind through its full state;
- the driver decides with :func:`can_load` whether a plugin can resume from a checkpoint
  (:mod:`framework.base.checkpoint.resume`), before any rank starts;
- saving dispatches on the kind the plugin declares it writes
  (:class:`framework.base.checkpoint.io.FolderCheckpointIO`'s ``kind``): a kind with a ``save_shards``
  is written by every rank, any other as one full state (or by the plugin's own strategy).

This module imports neither torch nor Lightning (the driver imports it); loaders import what
they need when they are called.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from framework.base.checkpoint.errors import CheckpointError


@dataclass(frozen=True)
class CheckpointKind:
    """How checkpoints of one manifest ``kind`` load.

    Attributes:
        name: the manifest's ``kind`` (``full``, ``delta``, ``dcp``, or a plugin's own).
        description: what these checkpoints are, for messages ("sharded (DCP) checkpoints").
        load_full_state: ``path -> dict``: the whole training state of an intact checkpoint
            folder as one Lightning checkpoint dict (full tensors, optimizer states keyed by
            position), in one process without a process group. None: the checkpoint does not
            gather into a full state; only plugins that write this kind load it.
        load_into_shards: ``(path, tensors) -> rest``: fill ``tensors`` (a flat ``{key: live
            tensor}`` dict in :func:`framework.base.checkpoint.dcp.split_checkpoint`'s keys; DTensor
            shards included) in place from the checkpoint, resharding as needed, and return the
            rest of the state (everything but model and optimizer tensors). Collective (every
            rank calls it). None: sharded plugins load the kind through ``load_full_state``.
        save_shards: ``(dirpath, step, checkpoint, manifest) -> folder``: the save of a plugin that
            declares this kind (``PluginCapabilities.checkpoint_format``) when every rank holds a
            different part of the state: collective, every rank writes its part of Lightning's
            ``checkpoint`` dict as folder ``dirpath/step%08d`` with the manifest entries
            ``manifest``; returns the final folder on rank 0, None elsewhere. None: the
            checkpoint IO writes one full state on the rank Lightning saves on (``full`` and
            ``delta`` folders), or the plugin's strategy writes its own files.
    """

    name: str
    description: str
    load_full_state: Callable[[Path], dict[str, Any]] | None = None
    load_into_shards: Callable[[Path, dict[str, Any]], dict[str, Any]] | None = None
    save_shards: Callable[[Path, int, dict[str, Any], dict[str, Any]], Path | None] | None = None


_KINDS: dict[str, CheckpointKind] = {}


def register_checkpoint_kind(kind: CheckpointKind) -> CheckpointKind:
    """Add ``kind`` to the table and return it; registering an equal entry again is a no-op.

    Raises:
        ValueError: another, different entry is already registered under ``kind.name``.
    """
    known = _KINDS.get(kind.name)
    if known is not None and known != kind:
        raise ValueError(f"checkpoint kind {kind.name!r} is registered twice: {known} and {kind}")
    _KINDS[kind.name] = kind
    return kind


def known_kinds() -> list[str]:
    """Sorted names of the registered kinds (of this process: a plugin's kind once its module is imported)."""
    return sorted(_KINDS)


def get_checkpoint_kind(name: str) -> CheckpointKind:
    """The registered entry of kind ``name``.

    Raises:
        CheckpointError: no kind of that name is registered (the message lists the known ones).
    """
    kind = _KINDS.get(name)
    if kind is None:
        raise CheckpointError(
            f"unknown checkpoint kind {name!r}; known: {', '.join(known_kinds())}"
            " (a plugin's own kind is known once that plugin is loaded)"
        )
    return kind


def gathers_into_full_state(name: str) -> bool:
    """Whether checkpoints of kind ``name`` gather into one full state (False for an unregistered kind)."""
    kind = _KINDS.get(name)
    return kind is not None and kind.load_full_state is not None


def can_load(kind_name: str, *, writes: str, loads_full_state: bool) -> bool:
    """Whether a plugin can resume from a checkpoint of kind ``kind_name``.

    A plugin loads the kind it writes (``writes``), and, when ``loads_full_state``, every kind
    that gathers into a full state (:func:`gathers_into_full_state`). A kind that is not
    registered in this process loads only into the plugin that writes it.
    """
    return kind_name == writes or (loads_full_state and gathers_into_full_state(kind_name))
