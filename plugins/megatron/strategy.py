"""The Lightning strategy of the ``tp`` and ``pp`` plugins.

:class:`MeshStrategy` is Lightning's ``ModelParallelStrategy`` (process group, device,
``configure_model`` hook, optimizer set-up) with a named 3-D device mesh ``("pp", "dp", "tp")``
instead of its 2-D ``("data_parallel", "tensor_parallel")`` one; rank
``r = (pp_i * dp + dp_i) * tp + tp_i`` (tp innermost, as in Megatron-LM and torchtitan, so TP
peers are neighbours).

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

from datetime import timedelta
from typing import Any

import torch
from pytorch_lightning.strategies import ModelParallelStrategy

from plugins.megatron.checkpoint import MeshCheckpointing

MESH_DIMS = ("pp", "dp", "tp")


class MeshStrategy(MeshCheckpointing, ModelParallelStrategy):
    """ModelParallelStrategy on a ``pp x dp x tp`` mesh; ``pipelined`` skips Lightning's backward call.

    Checkpoints are sharded (DCP) and keyed by the unsplit GPT's names
    (:mod:`plugins.megatron.checkpoint`).

    Args:
        pp, dp, tp: mesh degrees (their product is the world size).
        pipelined: True when a pipeline schedule does the backward inside the forward.
        process_group_backend: ``gloo`` or ``nccl``.
        timeout_s: collective timeout (seconds).
    """

    def __init__(self, *, pp: int, dp: int, tp: int, pipelined: bool, process_group_backend: str, timeout_s: int) -> None:
        super().__init__(
            data_parallel_size=dp,
            tensor_parallel_size=tp,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=timeout_s),
        )
        self.degrees = (pp, dp, tp)
        self.pipelined = pipelined

    def setup_environment(self) -> None:
        # Strategy.setup_environment (accelerator), then the process group, then our mesh.
        super(ModelParallelStrategy, self).setup_environment()
        self._setup_distributed()
        from torch.distributed.device_mesh import init_device_mesh

        if torch.distributed.get_world_size() != self.degrees[0] * self.degrees[1] * self.degrees[2]:
            raise RuntimeError(f"world size {torch.distributed.get_world_size()} != pp x dp x tp = {self.degrees}")
        self._device_mesh = init_device_mesh(self.root_device.type, self.degrees, mesh_dim_names=MESH_DIMS)
        self.lightning_module._device_mesh = self._device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        mesh = self.device_mesh["dp"]
        return {"num_replicas": mesh.size(), "rank": mesh.get_local_rank()}

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
