"""The ``fsdp`` plugin's Lightning strategy (:class:`FSDP2Strategy`), in a module of its own: importing
:mod:`plugins.fsdp` (the driver's pre-check and cost model, and :mod:`plugins.megatron`) must not import
Lightning, which only the ranks need (about 2.5 s of CPU per driver process)."""

from __future__ import annotations

from framework.base.checkpoint.sharded_strategy import ShardedCheckpointing
from framework.base.mesh_strategy import LayoutStrategy


class FSDP2Strategy(ShardedCheckpointing, LayoutStrategy):
    """The run's mesh strategy, checkpointing through trainlab's sharded (DCP) folders."""
