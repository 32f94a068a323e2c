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

**A user's DeepSpeed config** (``parallelism.ds_config``, a dict, and/or
``parallelism.ds_config_path``, a JSON file; the dict wins over the file) is merged over the
config trainlab writes (:func:`plugins.deepspeed.strategy.deepspeed_config`), key by key in
nested sections. Three kinds of keys:

- keys trainlab derives from the run (:func:`check_user_ds_config`; the batch arithmetic
  ``train_micro_batch_size_per_gpu`` / ``gradient_accumulation_steps`` / ``train_batch_size``,
  ``gradient_clipping``, ``fp16``/``bf16``, ``zero_optimization.stage``) may repeat trainlab's
  value; another value is a one-line error before any rank starts, naming both. ``optimizer`` and
  ``scheduler`` sections are refused (the run's AdamW and schedule are ``optim.*``);
- keys trainlab also has as typed options (:data:`ZERO_TWINS`, e.g.
  ``zero_optimization.reduce_bucket_size`` = ``parallelism.reduce_bucket_size``): the user's
  value replaces the typed option, so the cost model and the logged params describe what
  DeepSpeed runs;
- every other key (``steps_per_print``, ``zero_optimization.round_robin_gradients``, ...) is
  DeepSpeed's alone and passes through.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from framework.base.checkpoint.kinds import CheckpointKind, register_checkpoint_kind
from framework.base.config.schema import ConfigError, ParallelConfig
from framework.base.cost.comm import CommEstimate, ModelStats
from framework.base.metrics.timing import CommMeter
from framework.base.plugin import ParallelPlugin, PluginCapabilities
from framework.base.registry import register_plugin

KIND = "deepspeed"  # manifest "kind" of a DeepSpeed checkpoint: DeepSpeed's files, loaded only by this plugin
register_checkpoint_kind(CheckpointKind(KIND, "DeepSpeed's own checkpoint files"))

ZERO_STAGES = (0, 1, 2, 3)
OFFLOAD_DEVICES = ("none", "cpu")

ZERO_TWINS = {
    "overlap_comm": "overlap_comm",
    "contiguous_gradients": "contiguous_gradients",
    "reduce_bucket_size": "reduce_bucket_size",
    "allgather_bucket_size": "allgather_bucket_size",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
}
"""``zero_optimization`` keys of a user's DeepSpeed config -> the typed option they replace
(the offload sections' ``device`` replaces ``offload_optimizer`` / ``offload_param`` too)."""


def merge_dicts(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``base`` updated by ``over``, recursively for keys whose values are dicts on both sides (new dict)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge_dicts(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


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
    offload_optimizer: str = (
        "none"  # none | cpu: optimizer state and its update in CPU memory (ZeRO-Offload; needs CUDA)
    )
    offload_param: str = "none"  # none | cpu: parameters in CPU memory between uses (ZeRO-Infinity; stage 3, CUDA)
    max_live_parameters: int = (
        1_000_000_000  # stage 3: most gathered parameter elements kept live (DeepSpeed's default)
    )
    max_reuse_distance: int = 1_000_000_000  # stage 3: keep a gathered parameter if reused within this many elements
    ds_config: dict[str, Any] = field(
        default_factory=dict
    )  # DeepSpeed config keys merged over trainlab's (module docstring)
    ds_config_path: str | None = None  # a DeepSpeed JSON config file, merged under ds_config

    def user_ds_config(self) -> dict[str, Any]:
        """The user's DeepSpeed config: the JSON file at ``ds_config_path`` (if any) updated by ``ds_config``.

        Raises:
            ConfigError: the file cannot be read or is not a JSON object (one line).
        """
        from_file: dict[str, Any] = {}
        if self.ds_config_path:
            try:
                with open(self.ds_config_path) as fh:
                    from_file = json.load(fh)
            except (OSError, ValueError) as e:
                reason = e.strerror if isinstance(e, OSError) else str(e).splitlines()[0]
                raise ConfigError(
                    f"parallelism.ds_config_path={self.ds_config_path!r}: cannot read a JSON DeepSpeed config ({reason})"
                ) from None
            if not isinstance(from_file, dict):
                raise ConfigError(
                    f"parallelism.ds_config_path={self.ds_config_path!r} holds a JSON {type(from_file).__name__}, not an object"
                )
        return merge_dicts(from_file, dict(self.ds_config))

    def _adopt_user_zero_options(self) -> None:
        """Take the user's values of :data:`ZERO_TWINS` (and offload devices) into the typed options;
        refuse a ``zero_optimization.stage`` other than ``zero_stage``."""
        zero = self.user_ds_config().get("zero_optimization", {})
        if not isinstance(zero, dict):
            raise ConfigError(f"parallelism.ds_config.zero_optimization={zero!r} must be a section (a dict)")
        if "stage" in zero and zero["stage"] != self.zero_stage:
            raise ConfigError(
                f"parallelism.ds_config.zero_optimization.stage={zero['stage']} contradicts parallelism.zero_stage={self.zero_stage};"
                " choose the stage with parallelism=zero1|zero2|zero3 or parallelism.zero_stage"
            )
        for key, name in ZERO_TWINS.items():
            if key not in zero:
                continue
            value, flag = zero[key], isinstance(getattr(self, name), bool)
            whole = isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer()
            if not (isinstance(value, bool) if flag else whole):
                raise ConfigError(
                    f"parallelism.ds_config.zero_optimization.{key}={value!r} must be"
                    f" {'true or false' if flag else 'a whole number'} (it sets parallelism.{name})"
                )
            setattr(self, name, value if flag else int(value))
        for name in ("offload_optimizer", "offload_param"):
            section = zero.get(name)
            if isinstance(section, dict) and "device" in section:
                setattr(self, name, section["device"])

    def __post_init__(self) -> None:
        super().__post_init__()
        self._adopt_user_zero_options()
        if self.zero_stage not in ZERO_STAGES:
            raise ConfigError(f"parallelism.zero_stage={self.zero_stage} is not a ZeRO stage; allowed: 0, 1, 2, 3")
        for key in ("offload_optimizer", "offload_param"):
            if getattr(self, key) not in OFFLOAD_DEVICES:
                raise ConfigError(
                    f"parallelism.{key}={getattr(self, key)!r} is not allowed; allowed: {', '.join(OFFLOAD_DEVICES)}"
                )
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


def check_user_ds_config(user: dict[str, Any], resolved: Any) -> None:
    """Refuse keys of a user's DeepSpeed config that contradict what trainlab derives from the run.

    Raises:
        ConfigError: one line naming the DeepSpeed key, its value and trainlab's.
    """
    run, layout = resolved.run, resolved.layout
    arithmetic = (
        f"global_batch_size {resolved.global_batch_size} = micro_batch_size {resolved.micro_batch_size}"
        f" x grad_accum_steps {resolved.grad_accum_steps} x dp_degree {layout.dp}"
    )
    batch = {
        "train_micro_batch_size_per_gpu": ("trainer.micro_batch_size", resolved.micro_batch_size),
        "gradient_accumulation_steps": ("trainer.grad_accum_steps", resolved.grad_accum_steps),
        "train_batch_size": ("trainer.global_batch_size", resolved.global_batch_size),
    }
    for key, (ours, value) in batch.items():
        if key in user and user[key] != value:
            raise ConfigError(
                f"parallelism.ds_config.{key}={user[key]} contradicts trainlab's batch arithmetic: {ours}={value}"
                f" ({arithmetic}); remove the key or set {ours}"
            )
    clip = float(run.optim.grad_clip or 0.0)
    if "gradient_clipping" in user and float(user["gradient_clipping"]) != clip:
        raise ConfigError(
            f"parallelism.ds_config.gradient_clipping={user['gradient_clipping']} contradicts optim.grad_clip={clip};"
            " remove the key or set optim.grad_clip"
        )
    for section, precision in (("fp16", "16-mixed"), ("bf16", "bf16-mixed")):
        enabled = isinstance(user.get(section), dict) and bool(user[section].get("enabled", False))
        if enabled and run.trainer.precision != precision:
            raise ConfigError(
                f"parallelism.ds_config.{section}.enabled=true contradicts trainer.precision={run.trainer.precision!r};"
                f" set trainer.precision={precision} instead"
            )
    for section in ("optimizer", "scheduler"):
        if section in user:
            raise ConfigError(
                f"parallelism.ds_config.{section} is not allowed: the run's AdamW and LR schedule are optim.*"
                " (trainlab hands them to DeepSpeed)"
            )


@register_plugin
class DeepSpeedPlugin(ParallelPlugin):
    """ZeRO data parallelism over all ranks (dp = world_size) with DeepSpeed's engine."""

    name = "deepspeed"
    config_cls = DeepSpeedConfig
    # Checkpoints are DeepSpeed's own files, saved by its engine: no async writer, no deltas, and
    # its ZeRO optimizers do not take back a torch state dict from an in-memory snapshot.
    capabilities = PluginCapabilities(
        checkpoint_format=KIND,
        loads_full_state=False,
        async_save=False,
        incremental_save=False,
        memory_snapshots=False,
        no_snapshots_reason="so no resilience=rollback; resilience=restart resumes from the last checkpoint",
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
            raise ConfigError(
                "trainer.precision='16-mixed' with plugin 'deepspeed' needs CUDA ranks; allowed here: 32-true, bf16-mixed"
            )
        check_user_ds_config(par.user_ds_config(), resolved)

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

    @property
    def zero_stage(self) -> int:
        """``parallelism.zero_stage``: what DeepSpeed shards over the dp group (0-3)."""
        return self.cfg.zero_stage

    def comm_volume(self, stats: ModelStats, resolved: Any) -> CommEstimate:
        """Payload bytes per rank per optimizer step, by collective (see :mod:`plugins.deepspeed.cost`)."""
        from plugins.deepspeed.cost import zero_comm_volume

        return zero_comm_volume(stats, self.cfg, resolved)

    def model_states_bytes(self, stats: ModelStats, resolved: Any) -> int:
        """Bytes of parameters, gradients and optimizer state on one rank (ZeRO §5, see :mod:`plugins.deepspeed.cost`)."""
        from plugins.deepspeed.cost import zero_model_states_bytes

        return zero_model_states_bytes(stats, self.cfg, resolved)

    def inner_optimizer(self, optimizer: Any) -> Any:
        """The torch AdamW DeepSpeed's ZeRO optimizers step on their fp32 partitions (``optimizer.optimizer``);
        ``optimizer`` itself when the engine hands the Trainer a torch optimizer."""
        import torch

        return optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer.optimizer

    def held_state(self, module: Any, optimizer: Any) -> Any:
        """The framework's default (:meth:`ParallelPlugin.held_state`) plus what DeepSpeed keeps outside it: each
        ZeRO-3 parameter's partition (``ds_tensor``; the parameter's own data is empty between uses) and the
        ZeRO optimizer's flat buffers (partitioned fp32 master weights and gradients, attributes of the wrapper)."""
        from framework.base.metrics.memory import held_tensors

        held = super().held_state(module, optimizer)
        held.params += [q.ds_tensor for q in held.params if hasattr(q, "ds_tensor")]
        if optimizer is not None and self.inner_optimizer(optimizer) is not optimizer:
            held.optimizer[:0] = [t for value in vars(optimizer).values() for t in held_tensors(value)]
        return held

    def full_param_shape(self, param: Any) -> tuple[int, ...]:
        """ZeRO-3 empties a parameter's data between uses; its full shape is ``ds_shape``."""
        return tuple(getattr(param, "ds_shape", param.shape))

    def install_comm_meter(self, model: Any, meter: CommMeter) -> None:
        """Report every collective DeepSpeed's communication backend runs to ``meter``."""
        from plugins.deepspeed.cost import meter_deepspeed_comm

        meter_deepspeed_comm(meter)
