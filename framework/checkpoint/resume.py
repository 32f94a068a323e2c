"""Resume selection: which checkpoint a run starts from, and whether its plugin can load it.

The driver calls :func:`check_resume_request` while it validates the config (every refusal is a
one-line :class:`~framework.config.schema.ConfigError` before any rank starts), then
:func:`select_resume` once it holds the run's lock. ``resume`` is the config's value: ``auto``
(the newest intact checkpoint in ``checkpoint.dir``, if any), ``never`` (a fresh start; refused
while ``checkpoint.dir`` holds checkpoints) or the path of one checkpoint folder.

Which plugin loads which checkpoint kind is the table's (:func:`framework.checkpoint.kinds.can_load`);
nothing here names a plugin. No torch or Lightning is imported here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from framework.checkpoint.format import find_latest_valid, list_checkpoints, read_manifest, verify
from framework.checkpoint.kinds import can_load, gathers_into_full_state
from framework.config.schema import ConfigError

AUTO = "auto"
NEVER = "never"


@dataclass(frozen=True)
class ResumeChoice:
    """The checkpoint a run resumes from: ``path`` (None: a fresh start) and its ``step`` (0 when fresh)."""

    path: Optional[str]
    step: int


def check_resume_request(resume: str, checkpoint_dir: str | Path, plugin_name: str, *, writes: str,
                         loads_full_state: bool, writers: Optional[Callable[[str], Sequence[str]]] = None) -> None:
    """Refuse a ``resume`` value this run cannot honour (before any rank starts).

    Args:
        resume: the config's ``resume``: ``auto``, ``never`` or a checkpoint folder.
        checkpoint_dir: the run's ``checkpoint.dir``.
        plugin_name: the run's plugin, for messages.
        writes: the checkpoint kind the plugin writes (manifest ``kind``).
        loads_full_state: whether the plugin also loads every kind that gathers into a full state.
        writers: optional ``kind -> names`` of the ``parallelism`` config choices whose plugin
            writes that kind (e.g. ``["zero1", "zero2", "zero3"]``), for the "allowed:" part of
            the message; without it (or when it returns none) the message describes the plugin.

    Raises:
        ConfigError: ``resume`` is a folder that is not an intact checkpoint, or one of a kind
            this plugin cannot load (:func:`framework.checkpoint.kinds.can_load`); or
            ``resume=never`` while ``checkpoint_dir`` already holds checkpoints.
    """
    if resume not in (AUTO, NEVER):
        problems = verify(resume)
        if problems:
            raise ConfigError(f"resume={resume!r}: not a usable checkpoint folder ({problems[0]}); allowed: auto, never,"
                              " or an intact checkpoint folder")
        kind = read_manifest(resume)["kind"]
        if not can_load(kind, writes=writes, loads_full_state=loads_full_state):
            names = list(writers(writes if gathers_into_full_state(kind) else kind) or []) if writers else []
            if gathers_into_full_state(kind):  # the plugin loads only its own kind: another checkpoint is needed
                allowed = f"a checkpoint written by {'|'.join(names)}" if names else f"a {writes!r} checkpoint"
            else:  # a kind that only its own plugin loads: another plugin is needed
                allowed = f"parallelism={'|'.join(names)}" if names else f"a plugin that writes {kind!r} checkpoints"
            raise ConfigError(f"resume={resume!r}: a {kind!r} checkpoint cannot be loaded by plugin {plugin_name!r};"
                              f" allowed: {allowed}")
    existing = list_checkpoints(checkpoint_dir)
    if resume == NEVER and existing:
        raise ConfigError(f"resume=never but checkpoint.dir={checkpoint_dir} already holds checkpoints"
                          f" (up to step {existing[-1][0]}); remove it or choose another checkpoint.dir")


def select_resume(resume: str, checkpoint_dir: str | Path, warn: Callable[[str], None]) -> ResumeChoice:
    """The checkpoint to resume from for ``resume`` (checked by :func:`check_resume_request` first).

    ``auto``: the newest checkpoint in ``checkpoint_dir`` that passes verification; every newer
    one that fails is reported through ``warn`` and skipped (None when none is intact).
    ``never``: None. A folder: that folder. ``step`` is the resumed checkpoint's step (a newer
    corrupt one does not count), 0 for a fresh start.

    Raises:
        CheckpointError: the chosen folder's manifest cannot be read (it changed since it was checked).
    """
    if resume == AUTO:
        latest = find_latest_valid(checkpoint_dir, warn=warn)
        path = str(latest) if latest else None
    elif resume == NEVER:
        path = None
    else:
        path = resume
    return ResumeChoice(path=path, step=read_manifest(path)["step"] if path else 0)
