"""``deepspeed``: ZeRO stages 0-3 with DeepSpeed (``parallelism=zero1|zero2|zero3``).

One plugin; ``zero_stage`` picks what is partitioned over the data-parallel ranks
(Rajbhandari et al. 2020, §5): 1 the optimizer state, 2 also the gradients, 3 also the
parameters (0: plain data parallelism through DeepSpeed's engine).

- :mod:`plugins.deepspeed.strategy`: Lightning's ``DeepSpeedStrategy``, configured (not
  forked) so that it also runs on CPU ranks (DeepSpeed's CPU accelerator, gloo) and keeps
  fp32 AdamW semantics identical to ``single``.
- :mod:`plugins.deepspeed.cost`: the ZeRO cost model (model-state bytes per rank, payload
  bytes per collective per optimizer step) and the meter on DeepSpeed's communication backend.
- :mod:`plugins.deepspeed.checkpoint`: DeepSpeed's own checkpoint inside trainlab's step
  folder (manifest + sha256, atomic rename) and the conversion to DeepSpeed's universal
  checkpoint, which loads at another world size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from framework.checkpoint.kinds import CheckpointKind, register_checkpoint_kind
from framework.config.schema import ConfigError, ParallelConfig
from framework.cost.comm import CommEstimate, ModelStats
from framework.metrics.timing import CommMeter
from framework.plugin import ParallelPlugin, PluginCapabilities
from framework.registry import register_plugin

KIND = "deepspeed"  # manifest "kind" of a DeepSpeed checkpoint: DeepSpeed's files, loaded only by this plugin
register_checkpoint_kind(CheckpointKind(KIND, "DeepSpeed's own checkpoint files"))

ZERO_STAGES = (0, 1, 2, 3)
OFFLOAD_DEVICES = ("none", "cpu")


@dataclass
class DeepSpeedConfig(ParallelConfig):
    """DeepSpeed ZeRO options (names as in DeepSpeed's ``zero_optimization`` config section)."""

    name: str = "deepspeed"
    world_size: int = 2
    zero_stage: int = 1  # 0: DP only | 1: shard optimizer state | 2: + gradients | 3: + parameters
    overlap_comm: bool = False  # overlap gradient reduction with backward (two reduce buckets held)
    contiguous_gradients: bool = True  # copy reduced gradients into one contiguous buffer (less fragmentation)
    reduce_bucket_size: int = 50_000_000  # elements per gradient reduction bucket
    allgather_bucket_size: int = 50_000_000  # elements per parameter all-gather bucket (stages 1-2)
    offload_optimizer: str = "none"  # none | cpu: optimizer state and its update in CPU memory (ZeRO-Offload; needs CUDA)
    offload_param: str = "none"  # none | cpu: parameters in CPU memory between uses (ZeRO-Infinity; stage 3, CUDA)
    max_live_parameters: int = 1_000_000_000  # stage 3: most gathered parameter elements kept live (DeepSpeed's default)
    max_reuse_distance: int = 1_000_000_000  # stage 3: keep a gathered parameter if reused within this many elements

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.zero_stage not in ZERO_STAGES:
            raise ConfigError(f"parallelism.zero_stage={self.zero_stage} is not a ZeRO stage; allowed: 0, 1, 2, 3")
        for key in ("offload_optimizer", "offload_param"):
            if getattr(self, key) not in OFFLOAD_DEVICES:
                raise ConfigError(f"parallelism.{key}={getattr(self, key)!r} is not allowed; allowed: {', '.join(OFFLOAD_DEVICES)}")
        if self.offload_param != "none" and self.zero_stage != 3:
            raise ConfigError(
                f"parallelism.offload_param={self.offload_param!r} needs parallelism.zero_stage=3 (got {self.zero_stage});"
                " allowed with this stage: none"
            )
        if self.offload_optimizer != "none" and self.zero_stage == 0:
            raise ConfigError(
                f"parallelism.offload_optimizer={self.offload_optimizer!r} needs parallelism.zero_stage 1, 2 or 3 (got 0);"
                " allowed with stage 0: none"
            )
        for key in ("reduce_bucket_size", "allgather_bucket_size"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"parallelism.{key}={getattr(self, key)} must be > 0")
        for key in ("max_live_parameters", "max_reuse_distance"):
            if getattr(self, key) < 0:
                raise ConfigError(f"parallelism.{key}={getattr(self, key)} must be >= 0")


@register_plugin
class DeepSpeedPlugin(ParallelPlugin):
    """ZeRO data parallelism over all ranks (dp = world_size) with DeepSpeed's engine."""

    name = "deepspeed"
    config_cls = DeepSpeedConfig
    # Checkpoints are DeepSpeed's own files, saved by its engine: no async writer, no deltas, and
    # its ZeRO optimizers do not take back a torch state dict from an in-memory snapshot.
    capabilities = PluginCapabilities(
        checkpoint_format=KIND, loads_full_state=False, async_save=False, incremental_save=False,
        memory_snapshots=False, no_snapshots_reason="so no resilience=rollback; resilience=restart resumes from the last checkpoint",
        mesh_axes=("dp",),
    )

    def validate(self, resolved: Any) -> None:
        """Raise ConfigError for settings DeepSpeed cannot run here.

        Offloading moves state from accelerator memory to CPU memory; on CPU ranks everything
        already lives there, and DeepSpeed's offload paths expect an accelerator device.
        """
        import torch

        run, par = resolved.run, self.cfg
        on_cuda = run.trainer.accelerator == "cuda" or (run.trainer.accelerator == "auto" and torch.cuda.is_available())
        for key in ("offload_optimizer", "offload_param"):
            if getattr(par, key) != "none" and not on_cuda:
                raise ConfigError(
                    f"parallelism.{key}={getattr(par, key)!r} needs CUDA ranks (offload moves state from GPU to CPU"
                    " memory; CPU ranks hold everything in CPU memory already); allowed here: none"
                )
        if run.trainer.precision == "16-mixed" and not on_cuda:
            raise ConfigError("trainer.precision='16-mixed' with plugin 'deepspeed' needs CUDA ranks; allowed here: 32-true, bf16-mixed")

    def build_strategy(self, resolved: Any) -> Any:
        from plugins.deepspeed.strategy import build_strategy

        return build_strategy(self.cfg, resolved)

    def configure_model(self, model: Any, module: Any) -> Any:
        """Stage 3: declare the tied output head as used outside its module (after the plan: DeepSpeed
        shards through its engine, so the plan is empty).

        ZeRO-3 gathers a module's parameters only around that module's own forward; the GPT's
        head reuses ``wte.weight`` in the GPT's forward, so it is registered as an external
        parameter of the GPT (DeepSpeed then gathers it for the GPT's forward too).
        """
        if self.cfg.zero_stage == 3:
            import deepspeed

            deepspeed.zero.register_external_parameter(model, model.lm_head_weight)
        return model

    def comm_volume(self, stats: ModelStats, resolved: Any) -> CommEstimate:
        """Payload bytes per rank per optimizer step, by collective (see :mod:`plugins.deepspeed.cost`)."""
        from plugins.deepspeed.cost import zero_comm_volume

        return zero_comm_volume(stats, self.cfg, resolved)

    def model_states_bytes(self, stats: ModelStats, resolved: Any) -> int:
        """Bytes of parameters, gradients and optimizer state on one rank (ZeRO §5, see :mod:`plugins.deepspeed.cost`)."""
        from plugins.deepspeed.cost import zero_model_states_bytes

        return zero_model_states_bytes(stats, self.cfg, resolved)

    def install_comm_meter(self, model: Any, meter: CommMeter) -> None:
        """Report every collective DeepSpeed's communication backend runs to ``meter``."""
        from plugins.deepspeed.cost import meter_deepspeed_comm

        meter_deepspeed_comm(meter)
