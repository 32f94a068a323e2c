"""Each training micro-batch carries the count of valid targets in its whole optimizer step.

The loss of an optimizer step is the mean cross-entropy over the valid targets (``!=
IGNORE_INDEX``) of the whole global batch. A micro-batch's loss therefore needs the global
count before its backward runs: ``N`` summed over the step's micro-batches and over the
data-parallel ranks. :class:`StepTokenCounts` reads a step's micro-batches ahead (they are
this rank's next ``grad_accum_steps`` loader batches), counts their valid targets, sums the
count over the ranks once per step, and yields every micro-batch as ``(x, y, n)`` with ``n`` the
step's global count. That is how Hugging Face's Trainer gets ``num_items_in_batch``
(``get_batch_samples``: fetch the step's batches, count, gather over devices) and torchtitan its
``global_valid_tokens`` (count the micro-batches, all-reduce over the batch mesh).

The module divides each micro-batch's summed cross-entropy by ``n / (grad_accum_steps *
dp_degree)`` (:func:`framework.base.model.gpt.lm_loss`): Lightning then divides by
``grad_accum_steps`` (or the pipeline schedule by its micro-batch count) and the data-parallel
reduction averages over ``dp_degree`` ranks, so the gradients are those of ``sum(CE) / n``
with every plugin's own reductions unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from framework.base.model.gpt import IGNORE_INDEX

SumOverRanks = Callable[[torch.Tensor], torch.Tensor]
"""``local -> global``: a 0-dim int64 count summed over the data-parallel ranks (once each)."""


def valid_targets(y: torch.Tensor) -> torch.Tensor:
    """Number of targets that take a loss in ``y [..., s]`` (a 0-dim int64 tensor)."""
    return (y != IGNORE_INDEX).sum()


class StepTokenCounts:
    """Wraps a train loader of ``(x, y)`` micro-batches; yields ``(x, y, n)`` (see the module docstring).

    Args:
        loader: yields ``(x, y)``, int64 ``[micro_batch_size, seq_len]``, step-major: every
            ``micro_batches_per_step`` consecutive batches are one optimizer step (trainlab's
            :class:`~framework.rank.data.sampler.StepBatchSampler` ensures it).
        micro_batches_per_step: loader batches per optimizer step on this rank
            (``grad_accum_steps``; 1 when a pipeline schedule takes the step as one batch).
        sum_over_ranks: sums a count over the data-parallel ranks; called once per step, on
            every rank in the same order (a collective).

    ``n`` is a 0-dim int64 tensor on the device ``sum_over_ranks`` returns it on. ``len`` and
    ``batch_sampler`` are the loader's (Lightning and the fault guard read them).
    """

    def __init__(self, loader: Any, *, micro_batches_per_step: int, sum_over_ranks: SumOverRanks) -> None:
        if micro_batches_per_step < 1:
            raise ValueError(f"micro_batches_per_step={micro_batches_per_step} must be >= 1")
        self.loader = loader
        self.micro_batches_per_step = micro_batches_per_step
        self.sum_over_ranks = sum_over_ranks

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def batch_sampler(self) -> Any:
        return self.loader.batch_sampler

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        # The loader's iterator is made here, not at the first item: a DataLoader draws its base seed
        # from the global torch RNG when its iterator is made, and Lightning makes it before a resumed
        # run restores the RNG state (made lazily, the draw would come after the restore, and the
        # resumed run's RNG would be one draw ahead of the uninterrupted run's).
        return self._steps(iter(self.loader))

    def _steps(self, it: Iterator[Any]) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        while True:
            step: list[tuple[torch.Tensor, torch.Tensor]] = []
            for batch in it:
                step.append(batch)
                if len(step) == self.micro_batches_per_step:
                    break
            if not step:
                return
            n = self.sum_over_ranks(sum(valid_targets(y) for _, y in step))
            for x, y in step:
                yield x, y, n
            if len(step) < self.micro_batches_per_step:
                return
