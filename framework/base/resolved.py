"""The resolved run: a validated config with every derived value, built once by the driver.

:func:`framework.driver.validate.validate` builds it; the driver writes it into the launch file
(:meth:`ResolvedRun.to_dict`) and every rank reads it back
(:func:`framework.base.load.resolved_from_dict`)
without validating again. Plugins receive it and re-derive nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from framework.base.config.schema import RunConfig
from framework.base.layout import ParallelLayout


@dataclass(frozen=True)
class ResolvedRun:
    """A validated run with every derived value (batch sizes in sequences unless noted).

    ``global_batch_size = micro_batch_size * grad_accum_steps * layout.dp``;
    ``tokens_per_step = global_batch_size * seq_len`` (tokens).

    Attributes:
        run: the typed config.
        layout: degrees and mesh (:class:`~framework.base.layout.ParallelLayout`).
        micro_batch_size: sequences per rank per forward/backward.
        grad_accum_steps: micro-batches per optimizer step per rank.
        global_batch_size: sequences per optimizer step over all ranks.
        checkpoint_dir: where checkpoints go (``checkpoint.dir`` or the run's default folder).
        owns_microbatching: the plugin's pipeline schedule runs a step's micro-batches itself
            (the loader yields ``micro_batch_size * grad_accum_steps`` sequences per batch and
            Lightning does not accumulate).
        threads_per_rank: intra-op CPU threads of each rank on its node: ``trainer.threads_per_rank``,
            or null's ``cores // nproc_per_node`` (>= 1; the cores this driver may use), so ranks x
            threads <= cores. Computed once, by the validation on the node that runs the ranks; the
            launcher sets ``OMP_NUM_THREADS`` to it and every rank caps torch's pool at it.
    """

    run: RunConfig
    layout: ParallelLayout
    micro_batch_size: int
    grad_accum_steps: int
    global_batch_size: int
    checkpoint_dir: str
    owns_microbatching: bool = False
    threads_per_rank: int = 1

    @property
    def plugin_name(self) -> str:
        """The parallelism plugin's registry name."""
        return self.run.parallelism.name

    @property
    def world_size(self) -> int:
        """Ranks in all (``dp * tp * pp``)."""
        return self.layout.world_size

    @property
    def nproc_per_node(self) -> int:
        """Ranks per node."""
        return self.layout.nproc_per_node

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step over all ranks: ``global_batch_size * seq_len``."""
        return self.global_batch_size * self.run.data.seq_len

    @property
    def loader_batch_size(self) -> int:
        """Sequences per loader batch on one rank: a micro-batch, or a whole step's when the plugin owns micro-batching."""
        return self.micro_batch_size * (self.grad_accum_steps if self.owns_microbatching else 1)

    @property
    def trainer_accumulate_grad_batches(self) -> int:
        """Lightning's ``accumulate_grad_batches``: ``grad_accum_steps``, or 1 when the plugin owns micro-batching."""
        return 1 if self.owns_microbatching else self.grad_accum_steps

    def batch_summary(self) -> str:
        """Human-readable batch arithmetic, printed at start-up."""
        return (
            f"global_batch_size {self.global_batch_size} = micro_batch_size {self.micro_batch_size}"
            f" x grad_accum_steps {self.grad_accum_steps} x dp_degree {self.layout.dp}"
            f" | tokens/step {self.tokens_per_step:,} (seq_len {self.run.data.seq_len})"
            f" | world_size {self.world_size} = dp {self.layout.dp} x tp {self.layout.tp} x pp {self.layout.pp}"
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (the launch file's ``resolved``); inverse of :func:`framework.base.load.resolved_from_dict`."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("run", "layout")}
        return {**out, "run": dataclasses.asdict(self.run), "layout": dataclasses.asdict(self.layout)}
