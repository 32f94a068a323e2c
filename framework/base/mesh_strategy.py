"""A Lightning strategy on the run's one named device mesh.

:class:`LayoutStrategy` is Lightning's ``ModelParallelStrategy`` (process group, device, the
``configure_model`` hook, optimizer set-up) with the mesh built by
:meth:`framework.base.layout.ParallelLayout.build_device_mesh` — dimensions ``("pp", "dp", "tp")`` —
instead of Lightning's 2-D ``("data_parallel", "tensor_parallel")`` one. A plugin that shards or
splits the model (FSDP2, tensor and pipeline parallelism, an outside HSDP plugin) builds its
strategy from it and finds the mesh as ``module.device_mesh`` in
:meth:`framework.base.plugin.ParallelPlugin.parallel_plan` (``module.device_mesh["dp"]``). Works on
CPU (gloo) and CUDA (NCCL) unchanged. Imports Lightning: load it in the ranks only.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from pytorch_lightning.strategies import ModelParallelStrategy

from framework.base.layout import ParallelLayout


class LayoutStrategy(ModelParallelStrategy):
    """ModelParallelStrategy whose device mesh is the run's :class:`~framework.base.layout.ParallelLayout` mesh.

    Args:
        layout: the run's layout (``resolved.layout``).
        process_group_backend: ``gloo`` or ``nccl`` (:func:`framework.base.distributed.process_group_backend`).
        timeout_s: collective timeout (seconds).
        **kwargs: passed to ``ModelParallelStrategy`` (e.g. ``save_distributed_checkpoint``).
    """

    def __init__(self, *, layout: ParallelLayout, process_group_backend: str, timeout_s: int, **kwargs: Any) -> None:
        super().__init__(
            data_parallel_size=layout.dp,
            tensor_parallel_size=layout.tp,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=timeout_s),
            **kwargs,
        )
        self.layout = layout

    def setup_environment(self) -> None:
        # Strategy.setup_environment (accelerator), then the process group, then the run's mesh
        # (ModelParallelStrategy.setup_environment would build its own 2-D one).
        super(ModelParallelStrategy, self).setup_environment()
        self._setup_distributed()
        self._device_mesh = self.layout.build_device_mesh(self.root_device.type)
        self.lightning_module._device_mesh = self._device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        mesh = self.device_mesh["dp"]
        return {"num_replicas": mesh.size(), "rank": mesh.get_local_rank()}
