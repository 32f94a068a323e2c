"""``fsdp``: fully sharded data parallelism with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Parameters, gradients and optimizer state are sharded over the ``dp`` ranks (ZeRO-3,
Rajbhandari et al. 2020 §5). ``fully_shard`` is applied to every transformer block and then to
the root module, so each block's parameters are all-gathered just before it runs and freed
after (``reshard_after_forward=True``, ZeRO-3-like: 3Ψ communicated per step), or kept
gathered from forward to backward (``False``, ZeRO-2-like: 2Ψ, more memory).

Lightning integration: :class:`~plugins.fsdp_strategy.FSDP2Strategy`, a
:class:`~framework.base.mesh_strategy.LayoutStrategy` (Lightning's
``ModelParallelStrategy`` on the run's ``("pp", "dp", "tp")`` mesh) calls
``LightningModule.configure_model``, which applies :meth:`FSDPPlugin.parallel_plan` with
:func:`framework.base.parallelize.parallelize_gpt`. Works on CPU (gloo) and CUDA (NCCL) unchanged.

Checkpoints: every rank writes its own shards with torch Distributed Checkpoint
(:class:`~framework.base.checkpoint.sharded_strategy.ShardedCheckpointing` on the strategy), so a checkpoint
loads at any other world size, into ``fsdp`` (resharded) or ``single``/``ddp`` (gathered); and
``fsdp`` resumes from a ``single``/``ddp`` checkpoint. Synchronous full saves only.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from framework.base.config.schema import ConfigError, ParallelConfig
from framework.base.cost.comm import CommEstimate, ModelStats, fsdp_comm_volume
from framework.base.cost.memory import fsdp_model_states_bytes
from framework.base.distributed import process_group_backend, resolve_accelerator
from framework.base.metrics.timing import CommMeter, call_group
from framework.base.parallelize import ParallelPlan
from framework.base.plugin import ParallelPlugin, PluginCapabilities
from framework.base.registry import register_plugin

MIXED_PRECISION = ("none", "bf16")


PAYLOAD_KWARG = {"allgather": "output_tensor", "reduce_scatter": "input"}
"""Keyword of the payload tensor in the functions of :func:`fsdp2_collectives` (same in both torch generations)."""


def fsdp2_collectives() -> list[tuple[str, str, int]]:
    """``(torch.distributed function name, kind, positional index of the payload tensor)`` of the
    collectives FSDP2 calls in this torch: ``all_gather_single`` / ``reduce_scatter_single`` where
    they exist (torch 2.13), else ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (torch
    2.4-2.11, e.g. the CUDA image of the GPU check). Both take (output, input, ...)."""
    import torch.distributed as dist

    gather = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    scatter = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    return [(gather, "allgather", 0), (scatter, "reduce_scatter", 1)]


@dataclass
class FSDPConfig(ParallelConfig):
    """FSDP2 options."""

    name: str = "fsdp"
    world_size: int = 2
    reshard_after_forward: bool = (
        True  # True: free gathered params after forward (ZeRO-3); False: keep them (ZeRO-2-like)
    )
    mixed_precision: str = "none"  # none | bf16 (bf16 params for compute, fp32 gradient reduction; GPU)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mixed_precision not in MIXED_PRECISION:
            raise ConfigError(
                f"parallelism.mixed_precision={self.mixed_precision!r} is not allowed; allowed: {', '.join(MIXED_PRECISION)}"
            )


@register_plugin
class FSDPPlugin(ParallelPlugin):
    """FSDP2 over all ranks (dp = world_size)."""

    name = "fsdp"
    config_cls = FSDPConfig
    # Sharded (DCP) checkpoints: synchronous full saves; in-memory snapshots work (DTensor state).
    capabilities = PluginCapabilities(
        checkpoint_format="dcp", async_save=False, incremental_save=False, mesh_axes=("dp",)
    )

    def build_strategy(self, resolved: Any) -> Any:
        from plugins.fsdp_strategy import FSDP2Strategy  # Lightning: imported by the ranks only

        accelerator = resolve_accelerator(resolved.run.trainer.accelerator)
        return FSDP2Strategy(
            layout=resolved.layout,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend(self.cfg.backend, accelerator),
            timeout_s=self.cfg.timeout_s,
        )

    @property
    def zero_stage(self) -> int:
        """3: ``fully_shard`` shards weights, gradients and optimizer state over the dp group (ZeRO-3)."""
        return 3

    def comm_volume(self, stats: ModelStats, resolved: Any) -> CommEstimate:
        """Payload bytes per rank per optimizer step (ZeRO §7.2: 3Ψ with resharding, 2Ψ without), on the dp group.

        Every micro-batch all-gathers the full parameters for forward (Ψ) and, with
        ``reshard_after_forward``, again for backward (Ψ), and reduce-scatters the full gradients
        (Ψ); with ``grad_accum_steps`` micro-batches that repeats per micro-batch (FSDP2 reduces
        on each backward). All-gather payload = the gathered size, reduce-scatter payload = the
        input size (the ``S`` of the ring formulas). FSDP2 moves dim-0-padded shards, so Ψ here
        is ``dp x`` the padded shard (:func:`~framework.base.cost.comm.fsdp_padded_numel` of the
        parameter shapes; Ψ itself when every dim 0 divides by dp). Measured equal, byte for byte,
        on 2 and 3 CPU ranks (``tests/integration/test_train_e2e.py``, ``test_perf_e2e.py``).
        """
        return fsdp_comm_volume(
            stats,
            dp_degree=resolved.layout.dp,
            grad_accum_steps=resolved.grad_accum_steps,
            reshard_after_forward=self.cfg.reshard_after_forward,
        )

    def model_states_bytes(self, stats: ModelStats, resolved: Any) -> int:
        """ZeRO-3 (§5, Fig. 1): parameters, gradients and fp32 AdamW state all sharded over dp.

        ``(param_bytes + grad_bytes + 8) * Ψ_shard`` plus one 4-byte AdamW step counter per
        parameter tensor, with ``Ψ_shard`` the largest rank's (rank 0's) elements: ``ceil(d0 / dp)``
        rows of every parameter (FSDP2's padded shards, :func:`~framework.base.cost.comm.fsdp_padded_numel`).
        """
        return fsdp_model_states_bytes(stats, dp_degree=resolved.layout.dp)

    def install_comm_meter(self, model: Any, meter: CommMeter) -> None:
        """Meter FSDP2's collectives by wrapping the ``torch.distributed`` functions it calls
        (:func:`fsdp2_collectives`) for this process: payload = the gathered output / the reduced
        input, in bytes. Completion is marked when the call returns. Every call is reported; the
        framework's window decides which count (training forward/backward only, not validation)."""
        import torch.distributed as dist

        def wrap(name: str, kind: str, payload_arg: int):
            inner = getattr(dist, name)
            if getattr(inner, "_trainlab_metered", False):
                inner = inner._trainlab_inner

            def metered(*args, **kwargs):
                t = args[payload_arg] if len(args) > payload_arg else kwargs[PAYLOAD_KWARG[kind]]
                rec = meter.launch(kind, t.numel() * t.element_size(), call_group(inner, args, kwargs))
                out = inner(*args, **kwargs)
                meter.complete(rec)
                return out

            metered._trainlab_metered = True
            metered._trainlab_inner = inner
            setattr(dist, name, metered)

        for name, kind, payload_arg in fsdp2_collectives():
            wrap(name, kind, payload_arg)

    def parallel_plan(self, model: torch.nn.Module, module: Any) -> ParallelPlan:
        """DP wrapper: ``fully_shard`` on the ``dp`` mesh (each block, then the root: embeddings,
        final norm, tied head), with ``reshard_after_forward`` and the mixed-precision policy."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kwargs: dict[str, Any] = {
            "mesh": module.device_mesh["dp"],
            "reshard_after_forward": self.cfg.reshard_after_forward,
        }
        if self.cfg.mixed_precision == "bf16":
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return ParallelPlan(dp=partial(fully_shard, **kwargs))

    def configure_model(self, model: torch.nn.Module, module: Any) -> torch.nn.Module:
        """After the plan: without ``reshard_after_forward``, each unit reshards after an evaluation
        forward (:func:`reshard_after_evaluation`)."""
        if not self.cfg.reshard_after_forward:
            for unit in (*model.blocks, model):
                unit.register_forward_hook(reshard_after_evaluation)
        return model


def reshard_after_evaluation(unit: Any, args: Any, output: Any) -> None:
    """Reshard an FSDP unit after a forward without autograd (validation); a forward hook.

    A unit that keeps its parameters gathered after forward (``reshard_after_forward=False``, or
    FSDP2's root unit by default, as in ``plugins/megatron``) frees them after backward; an
    evaluation forward has none, so a validation pass left the whole model gathered until the next
    training backward (ZeRO-2-like memory turned into a full replica) and the next step skipped its
    first all-gathers. Resharding here keeps every training step at the modelled bytes.
    """
    if not torch.is_grad_enabled():
        unit.reshard()
