"""Lightning DataModule over a prepared token cache.

One Lightning "epoch" is the whole run: the train loader yields every micro-batch of steps
``start_step .. max_steps-1`` (see :class:`~framework.rank.data.sampler.StepBatchSampler`), so the
Trainer must stop on ``max_steps`` and validate on a batch count (``val_check_interval =
val_every_n_steps * grad_accum_steps`` batches, ``check_val_every_n_epoch=None``).

Train batches are ``(x, y, n)``: ``n`` is the number of valid targets in the whole optimizer
step over all data-parallel ranks (:class:`~framework.rank.data.step_tokens.StepTokenCounts`), the
denominator of the step's token-weighted loss. With ``data.mask_document_boundaries`` the
target after every ``<|endoftext|>`` is ignored (train and val windows alike).

Trainer settings this module relies on:

- ``use_distributed_sampler=False``: the batch sampler already shards by ``dp_rank``; Lightning
  would otherwise try to rebuild it around a ``DistributedSampler`` and fail.
- ``accumulate_grad_batches = grad_accum_steps`` (unless the plugin owns micro-batching).

Resume: ``state_dict()`` records the consumed samples (``global_step * global_batch_size``);
Lightning calls ``load_state_dict`` before ``train_dataloader()``, which then starts at
``start_step = consumed_samples // global_batch_size``.
"""

from __future__ import annotations

import logging
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from framework.base.config.schema import DataConfig
from framework.base.data.dataset import OnTheFlyWindowDataset, WindowDataset
from framework.base.data.tokens import TokenCache, load_token_cache
from framework.base.metrics.timing import comm_paused
from framework.rank.callbacks.preemption import ignore_in_loader_worker
from framework.rank.data.sampler import StepBatchSampler
from framework.rank.data.step_tokens import StepTokenCounts

log = logging.getLogger(__name__)


class _LightningSteps(StepBatchSampler):
    """A :class:`StepBatchSampler` whose ``len`` counts from step 0, as Lightning's loop does.

    On a mid-run resume Lightning restores its in-epoch batch counter to the batches already
    done (``start_step * A``) and ends the epoch when that counter reaches ``len(loader)``;
    with the plain length ``(max_steps - start_step) * A`` it would stop early and re-iterate
    the loader as a new epoch. Iteration is unchanged: it still starts at ``start_step``.
    """

    def __len__(self) -> int:
        return self.max_steps * self.grad_accum_steps


class TextDataModule(pl.LightningDataModule):
    """Train/val loaders for one data-parallel rank.

    Train batches are ``(x, y, n)``: int64 tensors ``[micro_batch_size, data.seq_len]``, ``y`` =
    ``x`` shifted by one token (``IGNORE_INDEX`` at masked document boundaries), and ``n`` the
    step's valid targets over all data-parallel ranks (0-dim int64). Val batches are ``(x, y)``.
    """

    def __init__(
        self,
        cfg: DataConfig,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        max_steps: int,
        val_sequences: int,
        cache_dir: str | None = None,
    ) -> None:
        """
        Args:
            cfg: data config; its token cache must already exist (``prepare_data``).
            global_batch_size: sequences per optimizer step over all DP ranks.
            micro_batch_size: sequences per rank per forward/backward.
            dp_rank, dp_size: this rank's data-parallel index and the DP degree.
            max_steps: optimizer steps of the whole run.
            val_sequences: validation windows per pass over all ranks (0 = none); the same
                windows whatever the layout, so val loss compares across layouts.
            cache_dir: open this cache folder (``TokenCache.dir`` from the driver's
                ``prepare_data``) instead of looking ``cfg``'s key up; use it where ranks cannot
                recompute the key (e.g. another node whose input files have other mtimes).

        Raises:
            ValueError: ``micro_batch_size * dp_size`` does not divide ``global_batch_size``,
                or a size/rank is out of range.
        """
        super().__init__()
        if micro_batch_size <= 0 or dp_size <= 0 or global_batch_size % (micro_batch_size * dp_size) != 0:
            raise ValueError(
                f"global_batch_size={global_batch_size} must be a positive multiple of "
                f"micro_batch_size={micro_batch_size} * dp_size={dp_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        if val_sequences < 0:
            raise ValueError(f"val_sequences={val_sequences} must be >= 0")
        self.cfg = cfg
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.max_steps = max_steps
        self.val_sequences = val_sequences
        self.start_step = 0  # first optimizer step the train loader yields (set on resume)
        self.first_sample: int | None = None  # global sample at start_step after a resume at another global batch
        self.cache_dir = cache_dir
        self._cache: TokenCache | None = None
        self.train_set: WindowDataset | OnTheFlyWindowDataset | None = None
        self.val_set: WindowDataset | None = None

    # ------------------------------------------------------------------ cache and datasets

    @property
    def grad_accum_steps(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    @property
    def cache(self) -> TokenCache:
        """The token cache (opened on first use; raises FileNotFoundError if never built)."""
        if self._cache is None:
            self._cache = TokenCache.open(self.cache_dir) if self.cache_dir else load_token_cache(self.cfg)
        return self._cache

    @property
    def vocab_size(self) -> int:
        """Tokenizer vocabulary size from the cache meta (usable before ``setup``)."""
        return self.cache.vocab_size

    def setup(self, stage: str | None = None) -> None:
        """Open the train/val memmaps. Idempotent.

        Raises:
            FileNotFoundError: no cache for ``cfg`` (run ``prepare_data`` in the driver first).
            ValueError: train (or val, when ``val_sequences > 0``) is shorter than one window of
                ``data.seq_len + 1`` tokens.
        """
        if self.train_set is not None:
            return
        L = self.cfg.seq_len
        mask = self.cfg.mask_document_boundaries
        eot = self.cache.eot_id if mask else None
        if self.cfg.mode == "on_the_fly":
            train = OnTheFlyWindowDataset(self.cache.dir, "train", L, self.cache.eot_id, mask_document_boundaries=mask)
        else:
            train = WindowDataset(self.cache.open_train(), L, mask_eot_id=eot)
        val = WindowDataset(
            self.cache.open_val(), L, mask_eot_id=eot
        )  # validation is not the pipeline under study: always memmap
        for name, ds in (("train", train), ("val", val)):
            if len(ds) == 0 and (name == "train" or self.val_sequences > 0):
                raise ValueError(
                    f"data: the {name} split has {len(ds.tokens)} tokens, fewer than one window of "
                    f"data.seq_len+1={L + 1}; use more data, a larger data.val_fraction or a smaller data.seq_len"
                )
        self.train_set, self.val_set = train, val

    # ---------------------------------------------------------------------- dataloaders

    def _loader(self, dataset: WindowDataset, batch_sampler: Any) -> DataLoader:
        nw = self.cfg.num_workers
        pin = torch.cuda.is_available() if self.cfg.pin_memory is None else self.cfg.pin_memory
        return DataLoader(
            dataset,
            batch_sampler=batch_sampler,
            num_workers=nw,
            persistent_workers=nw > 0,
            prefetch_factor=self.cfg.prefetch_factor if nw > 0 else None,
            pin_memory=pin,
            worker_init_fn=ignore_in_loader_worker if nw > 0 else None,  # the rank stops them (preemption)
        )

    def train_dataloader(self) -> StepTokenCounts:
        """This rank's micro-batches for steps ``start_step .. max_steps-1``, each with its step's
        global valid-target count (:class:`~framework.rank.data.step_tokens.StepTokenCounts`)."""
        self.setup()
        sampler = _LightningSteps(
            len(self.train_set),
            global_batch_size=self.global_batch_size,
            micro_batch_size=self.micro_batch_size,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            seed=self.cfg.seed,
            start_step=self.start_step,
            max_steps=self.max_steps,
            first_sample=self.first_sample,
        )
        return StepTokenCounts(
            self._loader(self.train_set, sampler),
            micro_batches_per_step=self.grad_accum_steps,
            sum_over_ranks=self._sum_over_data_parallel,
        )

    def _sum_over_data_parallel(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` (a 0-dim int64 count) summed over the data-parallel ranks.

        One all-reduce over all ranks (on the strategy's device, outside every comm meter: it is
        the framework's, not the plugin's), divided by the ranks that read the same data
        (``world_size / dp_size``: the TP and PP peers of a data-parallel rank). Without a
        process group (one rank) ``local`` itself.
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return local
        total = local.to(self.trainer.strategy.root_device)
        with comm_paused():
            dist.all_reduce(total)
        return total // (dist.get_world_size() // self.dp_size)

    def val_batch_indices(self) -> list[list[int]]:
        """This rank's val micro-batches (window indices), the same on every call.

        A pass covers the first ``n = min(val_sequences, len(val split))`` val windows whatever
        the layout; rank ``r`` takes windows ``r, r + dp_size, ...`` in micro-batches of
        ``micro_batch_size`` (the last one may be shorter, and ranks may differ by one window:
        the caller averages by window count, not by batch).
        """
        self.setup()
        n = min(self.val_sequences, len(self.val_set))
        if n < self.val_sequences:
            log.warning("data: val split holds %d windows; using them all (asked for %d)", n, self.val_sequences)
        mine = list(range(self.dp_rank, n, self.dp_size))
        mbs = self.micro_batch_size
        return [mine[i : i + mbs] for i in range(0, len(mine), mbs)]

    def val_dataloader(self) -> DataLoader:
        """This rank's share of the fixed validation windows (see :meth:`val_batch_indices`)."""
        batches = self.val_batch_indices()  # runs setup()
        return self._loader(self.val_set, batches)

    # -------------------------------------------------------------------------- resume

    def consumed_samples(self, step: int) -> int:
        """Global samples consumed by the end of optimizer step ``step`` (``step * global_batch_size``
        unless the run resumed at another global batch: then from the sample it resumed at)."""
        if self.first_sample is None:
            return step * self.global_batch_size
        return self.first_sample + (step - self.start_step) * self.global_batch_size

    def state_dict(self) -> dict[str, Any]:
        """``{"consumed_samples", "global_batch_size", "step"}`` at the trainer's current step."""
        trainer = getattr(self, "trainer", None)
        step = trainer.global_step if trainer is not None else self.start_step
        return {
            "consumed_samples": self.consumed_samples(step),
            "global_batch_size": self.global_batch_size,
            "step": step,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the sample stream: ``start_step = consumed_samples // global_batch_size``.

        A checkpoint written at another global batch (an elastic shrink with
        ``resilience.shrink_batch=scale``; it records its ``step``) resumes at that step, reading
        on from sample ``consumed_samples`` (``first_sample``), ``global_batch_size`` a step.

        Raises:
            ValueError: ``consumed_samples`` is not a whole number of current global batches
                (and the checkpoint records no step).
        """
        consumed = int(state_dict["consumed_samples"])
        step = state_dict.get("step")
        if step is not None and consumed != int(step) * self.global_batch_size:
            self.start_step, self.first_sample = min(int(step), self.max_steps), consumed
            return
        if consumed % self.global_batch_size != 0:
            raise ValueError(
                f"checkpoint consumed {consumed} samples (global_batch_size was "
                f"{state_dict.get('global_batch_size')}), not a multiple of the current "
                f"global_batch_size={self.global_batch_size}; cannot resume at a step boundary"
            )
        step = consumed // self.global_batch_size
        if step > self.max_steps:
            log.warning("data: checkpoint is at step %d, past max_steps=%d; no batches left", step, self.max_steps)
        self.start_step = min(step, self.max_steps)
