"""The Lightning strategy of the ``tp`` and ``pp`` plugins.

:class:`MeshStrategy` is the framework's :class:`~framework.base.mesh_strategy.LayoutStrategy`
(Lightning's ``ModelParallelStrategy`` on the run's ``("pp", "dp", "tp")`` mesh, rank
``r = (pp_i * dp + dp_i) * tp + tp_i``) with sharded checkpoints keyed by the GPT's names and, under
a pipeline, Lightning's backward left to the schedule.

Pipeline parallelism and Lightning's automatic optimization: a pipeline schedule runs the
forward *and* backward of all micro-batches of a step in one call
(``torch.distributed.pipelining``'s ``schedule.step``), so it cannot be split into Lightning's
per-micro-batch forward / ``backward()`` / accumulate cycle. The route taken here:

- the plugin *owns micro-batching* (``owns_microbatching``): the loader yields the whole
  per-dp-rank batch of a step (``micro_batch_size x grad_accum_steps`` sequences) and the
  Trainer runs with ``accumulate_grad_batches=1``;
- ``LMModule.training_step`` is unchanged: ``self.model(x, y)`` runs the schedule (the stage
  runner in :mod:`plugins.megatron.pipeline`) and returns the step's loss, already
  back-propagated;
- :meth:`MeshStrategy.backward` therefore calls Lightning's before/after-backward hooks but not
  ``loss.backward()``, and the optimizer's ``zero_grad`` (which Lightning calls between
  ``training_step`` and ``backward``) is left to the runner, which zeroes before each schedule step;

so the optimizer step, LR scheduler, gradient clipping hook, callbacks (StepMetrics,
ValidationLoss, StepBreakdown), checkpoints (:mod:`plugins.megatron.checkpoint`) and MLflow
logging run exactly as for every other plugin.
"""

from __future__ import annotations

from typing import Any

import torch

from framework.base.mesh_strategy import LayoutStrategy
from plugins.megatron.checkpoint import MeshCheckpointing


class MeshStrategy(MeshCheckpointing, LayoutStrategy):
    """The run's ``pp x dp x tp`` mesh strategy; ``pipelined`` skips Lightning's backward call.

    Checkpoints are sharded (DCP) and keyed by the unsplit GPT's names
    (:mod:`plugins.megatron.checkpoint`).

    Args:
        layout: the run's layout.
        pipelined: True when a pipeline schedule does the backward inside the forward.
        process_group_backend: ``gloo`` or ``nccl``.
        timeout_s: collective timeout (seconds).
    """

    def __init__(self, *, layout: Any, pipelined: bool, process_group_backend: str, timeout_s: int) -> None:
        super().__init__(
            layout=layout,
            process_group_backend=process_group_backend,
            timeout_s=timeout_s,
            save_distributed_checkpoint=True,
        )
        self.pipelined = pipelined

    def setup_optimizers(self, trainer: Any) -> None:
        """Lightning's optimizers; with a pipeline their ``zero_grad`` is a no-op (the runner zeroes before each step).

        Lightning's closure zeroes gradients *between* ``training_step`` and ``backward``; a
        pipeline schedule has already computed them inside ``training_step``.
        """
        super().setup_optimizers(trainer)
        if self.pipelined:
            for opt in self.optimizers:
                opt.zero_grad = _no_zero_grad

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Lightning's backward; with a pipeline schedule only its hooks (the schedule already ran backward)."""
        if not self.pipelined:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss


def _no_zero_grad(set_to_none: bool = True) -> None:
    """Stands in for ``optimizer.zero_grad`` under a pipeline (see :meth:`MeshStrategy.setup_optimizers`)."""
