"""Deterministic, resumable, split-invariant batch sampler.

The sample stream is defined once for the whole run, independent of how it is split:

- global sample ``g = 0, 1, 2, ...`` is window ``perm_e[p]`` with epoch ``e = g // N`` and
  position ``p = g % N`` (``N`` = number of windows), where
  ``perm_e = torch.randperm(N, generator=torch.Generator().manual_seed(seed + e))``;
- optimizer step ``k`` consumes global samples ``[k*B, (k+1)*B)``, ``B`` = global batch size;
- with ``A = B // (micro_batch_size * dp_size)`` micro-steps per step, rank ``r`` at micro-step
  ``j`` of step ``k`` takes the ``micro_batch_size`` samples starting at
  ``k*B + j*(micro_batch_size*dp_size) + r*micro_batch_size``.

So the union over ranks and micro-steps of step ``k``'s batches is the same multiset of
windows for every ``(dp_size, micro_batch_size)`` split of ``B`` - the property that makes the
loss of ``single`` and ``ddp`` (or any accumulation) comparable step by step. The position is a
function of the step alone, so resuming at step ``k`` needs only ``start_step=k``.

Epochs are whole passes over a fresh permutation; a step may straddle an epoch boundary (it
then mixes the tail of one permutation with the head of the next).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Sampler


class StepBatchSampler(Sampler[list[int]]):
    """Yields this rank's micro-batches (lists of window indices) for steps ``start_step .. max_steps-1``.

    Order: step-major, then micro-step ``0 .. A-1``. ``len = (max_steps - start_step) * A``.
    Every yielded list has ``micro_batch_size`` indices in ``[0, num_windows)``.
    """

    def __init__(
        self,
        num_windows: int,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        start_step: int = 0,
        max_steps: int,
        first_sample: int | None = None,
    ) -> None:
        """
        Args:
            num_windows: ``N``, windows in the dataset (> 0).
            global_batch_size: ``B``, sequences per optimizer step over all DP ranks.
            micro_batch_size: sequences per rank per forward/backward.
            dp_rank: this rank's data-parallel index, ``0 <= dp_rank < dp_size``.
            dp_size: data-parallel degree (ranks holding model replicas / shards of the batch).
            seed: base seed; epoch ``e`` uses ``seed + e``. Same on every rank.
            start_step: first optimizer step to yield (resume point), ``0 <= start_step <= max_steps``.
            max_steps: one past the last optimizer step.
            first_sample: global sample index at which ``start_step`` begins; None = ``start_step *
                global_batch_size`` (the run kept one global batch). Given after a resume at another
                global batch (an elastic shrink with ``resilience.shrink_batch=scale``): the stream goes on
                at the sample the checkpoint reached, ``global_batch_size`` samples a step from there.

        Raises:
            ValueError: a non-positive size, ``dp_rank`` out of range, ``micro_batch_size *
                dp_size`` not dividing ``global_batch_size``, or ``start_step`` out of range.
        """
        if num_windows <= 0:
            raise ValueError(f"num_windows={num_windows} must be > 0 (corpus shorter than one window?)")
        sizes = {"global_batch_size": global_batch_size, "micro_batch_size": micro_batch_size, "dp_size": dp_size}
        for name, v in sizes.items():
            if v <= 0:
                raise ValueError(f"{name}={v} must be > 0")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        if global_batch_size % (micro_batch_size * dp_size) != 0:
            raise ValueError(
                f"global_batch_size={global_batch_size} must be a multiple of "
                f"micro_batch_size={micro_batch_size} * dp_size={dp_size}"
            )
        if not 0 <= start_step <= max_steps:
            raise ValueError(f"start_step={start_step} must be in [0, max_steps={max_steps}]")
        if first_sample is not None and first_sample < 0:
            raise ValueError(f"first_sample={first_sample} must be >= 0")
        self.num_windows = num_windows
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.start_step = start_step
        self.max_steps = max_steps
        self.first_sample = first_sample
        self._perms: dict[int, np.ndarray] = {}  # epoch -> permutation (at most 2 kept)

    @property
    def grad_accum_steps(self) -> int:
        """``A = global_batch_size // (micro_batch_size * dp_size)``."""
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    def __len__(self) -> int:
        return (self.max_steps - self.start_step) * self.grad_accum_steps

    def __iter__(self) -> Iterator[list[int]]:
        mbs = self.micro_batch_size
        for k in range(self.start_step, self.max_steps):
            for j in range(self.grad_accum_steps):
                first = self.step_first_sample(k) + j * mbs * self.dp_size + self.dp_rank * mbs
                yield self.windows(first, mbs)

    def step_first_sample(self, step: int) -> int:
        """Global sample index of the first sample of optimizer step ``step``: ``step * B``, or, after
        a resume at another global batch (``first_sample`` given), ``first_sample + (step - start_step) * B``."""
        if self.first_sample is None:
            return step * self.global_batch_size
        return self.first_sample + (step - self.start_step) * self.global_batch_size

    def windows(self, first: int, count: int) -> list[int]:
        """Window indices of global samples ``first .. first + count - 1``."""
        out = []
        for g in range(first, first + count):
            e, p = divmod(g, self.num_windows)
            out.append(int(self._perm(e)[p]))
        return out

    def step_windows(self, step: int) -> list[int]:
        """All ``global_batch_size`` window indices of optimizer step ``step`` (every rank), in order."""
        return self.windows(self.step_first_sample(step), self.global_batch_size)

    def _perm(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            perm = torch.randperm(self.num_windows, generator=gen).numpy()  # numpy: fast scalar reads
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = perm
        return perm
