"""Build a run's checkpointing from ``checkpoint.*``: the Trainer plugin and the callbacks.

Kept out of :mod:`framework.rank.worker` so that the worker stays one call: ``plugins, callbacks =
build_checkpointing(...)``; the plugins go to ``pl.Trainer``, the callbacks into the step's
``checkpoint`` phase (:mod:`framework.rank.step`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

from framework.base.checkpoint.io import FolderCheckpointIO
from framework.base.checkpoint.resume import resume_config
from framework.base.config.schema import run_to_dict
from framework.base.metrics.emit import MetricEmitter
from framework.base.resolved import ResolvedRun
from framework.rank.checkpoint.memory import MemorySnapshot
from framework.rank.checkpoint.periodic import PeriodicCheckpoint


def config_hash(resolved: ResolvedRun) -> str:
    """sha256 (hex) of the resolved run config as sorted JSON: equal hashes = the same config."""
    text = json.dumps(run_to_dict(resolved.run), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def manifest_fields(resolved: ResolvedRun, *, is_global_zero: bool) -> dict[str, Any]:
    """The descriptive manifest entries of this run: layout, config hash, library versions."""
    from framework.base.tracking import git_commit

    layout = resolved.layout
    return {
        "layout": {
            "plugin": resolved.plugin_name,
            "world_size": resolved.world_size,
            "dp": layout.dp,
            "tp": layout.tp,
            "pp": layout.pp,
        },
        "config_hash": config_hash(resolved),
        "config": resume_config(
            resolved.run
        ),  # compared when a run resumes from it (framework/base/checkpoint/resume.py)
        "versions": {
            "torch": torch.__version__,
            "pytorch_lightning": pl.__version__,
            # git runs on rank 0 only: the manifest is written there
            "trainlab": git_commit(Path(__file__).resolve().parents[3]) if is_global_zero else "",
        },
    }


def build_checkpointing(
    resolved: ResolvedRun,
    *,
    is_global_zero: bool,
    emit: MetricEmitter,
    checkpoint_kind: str,
    on_time_spent: Callable[[float], None] | None = None,
    before_save: Callable[[], None] | None = None,
) -> tuple[list[Any], list[pl.Callback]]:
    """``(plugins, callbacks)`` implementing ``resolved.run.checkpoint`` (``emit``: the run's metric emitter).

    ``checkpoint_kind``: the kind the run's plugin declares it writes
    (``plugin.capabilities.checkpoint_format``); saves dispatch on it (:class:`FolderCheckpointIO`).

    ``before_save`` is called on every rank right before each save (the worker sends the step's
    buffered metrics, so that no checkpoint covers a step missing from MLflow).

    The plugins always hold the folder ``CheckpointIO`` (so resuming reads folders safely even
    when this run saves nothing); the callbacks are empty when nothing is saved or snapshotted.
    """
    ck = resolved.run.checkpoint
    io = FolderCheckpointIO(
        keep_last_k=ck.keep_last_k,
        asynchronous=ck.mode == "async",
        full_every_n_saves=ck.full_every_n_saves,
        manifest_fields=manifest_fields(resolved, is_global_zero=is_global_zero),
        tokens_per_step=resolved.tokens_per_step,
        kind=checkpoint_kind,
    )
    callbacks: list[pl.Callback] = []
    if ck.memory_every_n_steps > 0:
        callbacks.append(MemorySnapshot(every_n_steps=ck.memory_every_n_steps))
    # Always present: it also restores the RNG states of a resumed run.
    callbacks.append(
        PeriodicCheckpoint(
            dirpath=resolved.checkpoint_dir,
            io=io,
            every_n_steps=ck.every_n_steps,
            save_last=ck.save_last,
            emit=emit,
            on_time_spent=on_time_spent,
            before_save=before_save,
        )
    )
    return [io], callbacks
