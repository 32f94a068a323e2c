"""What changes when a checkpoint is resumed at another world size (or another micro-batching).

Model and optimizer state are resharded by :mod:`framework.base.checkpoint.dcp`; the data position
is a number of consumed samples (:class:`~framework.rank.data.TextDataModule`), independent of the
layout. Two more pieces of a checkpoint depend on the layout, and are mapped here:

- **per-rank RNG states** (:func:`rng_state_for_rank`): saved for every rank. At the same world
  size each rank gets its own back (exact resume). At another world size: when every saved
  rank holds the *same* state — the case for every data-parallel plugin here, since all ranks
  are seeded alike and draw the same numbers — every new rank gets that state, and the run
  continues exactly as an uninterrupted one would. When they differ (a plugin that seeds ranks
  differently), new rank ``r`` gets saved rank ``r % saved_world_size``'s state and a warning
  says the random streams are not those of an uninterrupted run.
- **Lightning's batch counter** (:func:`rescale_batch_progress`): Lightning counts
  micro-batches (``epoch_loop.batch_progress``) and closes an accumulation window when that
  count is a multiple of ``accumulate_grad_batches``. Resuming at another data-parallel degree
  with the same global batch changes the micro-batches per step, so the counter is rewritten to
  ``global_step * new_batches_per_step`` (plus the saved offset within a step, normally 0).
"""

from __future__ import annotations

from typing import Any

import torch


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def rng_state_for_rank(per_rank: list[Any], rank: int, world_size: int) -> tuple[Any | None, str | None]:
    """The saved RNG state rank ``rank`` of ``world_size`` restores, and a warning (or None).

    See the module docstring for the rule. Returns ``(None, warning)`` when nothing was saved.
    """
    n = len(per_rank)
    if n == 0:
        return None, "checkpoint holds no RNG states; RNGs start from the seed"
    if n == world_size:
        return per_rank[rank], None
    if all(_same(per_rank[0], s) for s in per_rank[1:]):
        return per_rank[0], None
    return per_rank[rank % n], (
        f"checkpoint holds different RNG states for its {n} ranks and this run has {world_size}; rank r restores"
        f" saved rank r % {n}'s, so random streams (dropout) differ from an uninterrupted run"
    )


PROGRESS_KEY = "epoch_loop.batch_progress"


def rescale_batch_progress(
    checkpoint: dict[str, Any], batches_per_step: int, saved_batches_per_step: int | None
) -> bool:
    """Rewrite Lightning's micro-batch counter of ``checkpoint`` for ``batches_per_step`` per optimizer step.

    ``saved_batches_per_step``: what the saving run used (None: inferred from the counter and
    ``global_step``). Returns True when something changed. Every counter (total and current:
    ready, started, processed, completed) moves by ``global_step * (new - saved)``, keeping
    its offset within the step.
    """
    step = int(checkpoint.get("global_step", 0))
    loop = checkpoint.get("loops", {}).get("fit_loop", {})
    progress = loop.get(PROGRESS_KEY)
    if step == 0 or progress is None:
        return False
    if saved_batches_per_step is None:
        saved_batches_per_step = int(progress["total"]["ready"]) // step
    shift = step * (batches_per_step - saved_batches_per_step)
    if shift == 0:
        return False
    for part in ("total", "current"):
        for key, value in progress[part].items():
            progress[part][key] = int(value) + shift
    return True
