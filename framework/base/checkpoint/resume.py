"""Resume selection: which checkpoint a run starts from, and whether its plugin can load it.

The driver calls :func:`check_resume_request` while it validates the config (every refusal is a
one-line :class:`~framework.base.config.schema.ConfigError` before any rank starts), then
:func:`select_resume` once it holds the run's lock. ``resume`` is the config's value: ``auto``
(the newest intact checkpoint in ``checkpoint.dir``, if any), ``never`` (a fresh start; refused
while ``checkpoint.dir`` holds checkpoints) or the path of one checkpoint folder.

Which plugin loads which checkpoint kind is the table's (:func:`framework.base.checkpoint.kinds.can_load`);
nothing here names a plugin. No torch or Lightning is imported here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from framework.base.checkpoint.format import find_latest_valid, list_checkpoints, read_manifest, verify
from framework.base.checkpoint.kinds import can_load, gathers_into_full_state
from framework.base.config.schema import ConfigError

AUTO = "auto"
NEVER = "never"


@dataclass(frozen=True)
class ResumeChoice:
    """The checkpoint a run resumes from: ``path`` (None: a fresh start) and its ``step`` (0 when fresh)."""

    path: str | None
    step: int


def check_resume_request(
    resume: str,
    checkpoint_dir: str | Path,
    plugin_name: str,
    *,
    writes: str,
    loads_full_state: bool,
    writers: Callable[[str], Sequence[str]] | None = None,
) -> None:
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
            this plugin cannot load (:func:`framework.base.checkpoint.kinds.can_load`); or
            ``resume=never`` while ``checkpoint_dir`` already holds checkpoints.
    """
    if resume not in (AUTO, NEVER):
        problems = verify(resume)
        if problems:
            raise ConfigError(
                f"resume={resume!r}: not a usable checkpoint folder ({problems[0]}); allowed: auto, never,"
                " or an intact checkpoint folder"
            )
        kind = read_manifest(resume)["kind"]
        if not can_load(kind, writes=writes, loads_full_state=loads_full_state):
            names = list(writers(writes if gathers_into_full_state(kind) else kind) or []) if writers else []
            if gathers_into_full_state(kind):  # the plugin loads only its own kind: another checkpoint is needed
                allowed = f"a checkpoint written by {'|'.join(names)}" if names else f"a {writes!r} checkpoint"
            else:  # a kind that only its own plugin loads: another plugin is needed
                allowed = f"parallelism={'|'.join(names)}" if names else f"a plugin that writes {kind!r} checkpoints"
            raise ConfigError(
                f"resume={resume!r}: a {kind!r} checkpoint cannot be loaded by plugin {plugin_name!r};"
                f" allowed: {allowed}"
            )
    existing = list_checkpoints(checkpoint_dir)
    if resume == NEVER and existing:
        raise ConfigError(
            f"resume=never but checkpoint.dir={checkpoint_dir} already holds checkpoints"
            f" (up to step {existing[-1][0]}); remove it or choose another checkpoint.dir"
        )


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


RESUME_CONFIG_SECTIONS = ("model", "optim", "data")
RESUME_CONFIG_KEYS = ("trainer.global_batch_size", "trainer.seed")
RESUME_CONFIG_IGNORED = (
    "model.name",
    "model.activation_checkpointing",
    "data.cache_dir",
    "data.num_workers",
    "data.prefetch_factor",
    "data.pin_memory",
    "data.mode",
)
"""What a checkpoint's stored configuration holds (manifest ``config``): the keys that decide what is
trained -- model shape, optimizer and schedule, data and tokenizer, the global batch and seed -- less
those that change how, not what (loader workers, caches, activation checkpointing, the preset's name).
The layout (plugin, degrees, micro-batch size) is not among them: a checkpoint resumes at another."""


def resume_config(run: Any) -> dict[str, Any]:
    """The flattened ``key -> value`` of :data:`RESUME_CONFIG_SECTIONS` and :data:`RESUME_CONFIG_KEYS`
    of a :class:`~framework.base.config.schema.RunConfig` (what the manifest stores as ``config``)."""
    found: dict[str, Any] = {}
    for section in RESUME_CONFIG_SECTIONS:
        for k, v in dataclasses.asdict(getattr(run, section)).items():
            found[f"{section}.{k}"] = v
    for key in RESUME_CONFIG_KEYS:
        section, name = key.split(".")
        found[key] = getattr(getattr(run, section), name)
    return {k: v for k, v in found.items() if k not in RESUME_CONFIG_IGNORED}


def config_changes(stored: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``key -> (checkpoint's value, this run's value)`` for every key of ``stored`` whose value differs."""
    return {k: (v, current.get(k)) for k, v in stored.items() if k in current and current[k] != v}


def check_resume_config(resume: str, checkpoint_dir: str | Path, run: Any) -> dict[str, tuple[Any, Any]]:
    """Compare the configuration stored in the checkpoint this run would resume from (the newest one
    whose manifest reads for ``auto``, the named folder otherwise) with the run's; returns the changes
    that ``run.resume_allow_changed`` allows (for the run's record), {} without a checkpoint or one
    written before the manifest stored its configuration.

    Raises:
        ConfigError: a key differs that ``resume_allow_changed`` does not name (one line, each key with
            both values), or ``resume_allow_changed`` names a key that is not compared.
    """
    current = resume_config(run)
    unknown = [k for k in run.resume_allow_changed if k not in current]
    if unknown:
        raise ConfigError(
            f"resume_allow_changed names {', '.join(unknown)}, not a key a resume compares;"
            f" allowed: keys of {', '.join(RESUME_CONFIG_SECTIONS)} and {', '.join(RESUME_CONFIG_KEYS)}"
        )
    if resume == NEVER:
        return {}
    path = resume if resume != AUTO else None
    if path is None:
        for _step, folder in reversed(list_checkpoints(checkpoint_dir)):
            try:
                read_manifest(folder)
            except Exception:
                continue
            path = folder
            break
    if path is None:
        return {}
    stored = read_manifest(path).get("config")
    if not stored:
        return {}
    changes = config_changes(stored, current)
    refused = {k: c for k, c in changes.items() if k not in run.resume_allow_changed}
    if refused:
        listed = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in refused.items())
        raise ConfigError(
            f"resume from {path}: this run's configuration differs from the checkpoint's: {listed};"
            f" resume it unchanged, start elsewhere (another checkpoint.dir, or resume=never in an empty one),"
            f" or allow the change: resume_allow_changed=[{','.join(refused)}]"
        )
    return changes
