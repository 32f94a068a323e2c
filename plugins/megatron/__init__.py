"""Megatron-style tensor and pipeline parallelism on PyTorch's native APIs (plugins ``tp`` and ``pp``).

- :mod:`.tensor_parallel`: DTensor ``parallelize_module`` plans (column/row parallel, sequence parallel);
- :mod:`.pipeline`: stages, tied embeddings and ``torch.distributed.pipelining`` schedules;
- :mod:`.strategy`: the Lightning strategy (``pp x dp x tp`` device mesh; the pipeline's backward);
- :mod:`.metering`: counting DTensor's functional collectives and the pipeline's sends;
- :mod:`.bubble`: measured vs modelled pipeline bubble;
- :mod:`.plugin`: the ``tp`` and ``pp`` plugin classes (validation, cost model, set-up).
"""

from plugins.megatron.plugin import PPPlugin, TPPlugin

__all__ = ["PPPlugin", "TPPlugin"]
