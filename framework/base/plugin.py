"""The parallelism plugin contract: what a backend declares and what it implements.

A plugin subclasses :class:`ParallelPlugin`. It declares, in :class:`PluginCapabilities`, what the
framework needs to know without running it (the checkpoint format it writes, the checkpoint
policies it supports, the mesh axes it can use, whether its pipeline schedule owns
micro-batching); the framework reads those declarations (:func:`check_capabilities`, before any
rank starts) and never names a plugin or probes one for attributes. Every hook has a working
default here, so a plugin overrides only what it does differently.

Life of a plugin object: the driver builds one from the ``parallelism`` config to validate the
run (:meth:`ParallelPlugin.validate` gets the resolved run: layout and batch split already
derived, nothing to re-derive); each rank builds one to train.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from framework.base.config.schema import ConfigError, ParallelConfig

if TYPE_CHECKING:
    import torch

    from framework.base.cost.comm import CommEstimate, ModelStats
    from framework.base.layout import ParallelLayout
    from framework.base.metrics.memory import HeldState
    from framework.base.metrics.timing import CommMeter
    from framework.base.parallelize import ParallelPlan
    from framework.base.resolved import ResolvedRun


@dataclass(frozen=True)
class PluginCapabilities:
    """What a plugin can do, read by the framework before any rank starts.

    Attributes:
        checkpoint_format: the manifest ``kind`` of the checkpoints it writes (``full``: one
            state file, :mod:`framework.base.checkpoint.format`; ``dcp``: sharded,
            :mod:`framework.base.checkpoint.dcp`; or a kind the plugin registers itself in
            :mod:`framework.base.checkpoint.kinds`, e.g. ``deepspeed``).
        loads_full_state: it can resume from any checkpoint kind that gathers into one full
            state (``full``, ``delta``, ``dcp``), not only from its own format.
        async_save: supports ``checkpoint.mode=async`` (a background writer).
        incremental_save: supports ``checkpoint.full_every_n_saves > 1`` (delta saves).
        memory_snapshots: supports ``checkpoint.memory_every_n_steps > 0`` (in-memory
            snapshots; ``resilience=rollback`` needs them).
        no_snapshots_reason: said in the error when ``memory_snapshots`` is False.
        mesh_axes: the mesh axes (of ``pp``, ``dp``, ``tp``) whose degree may exceed 1; an
            empty tuple means exactly one rank.
        owns_microbatching: with ``pp > 1`` its pipeline schedule runs a step's micro-batches
            itself: the loader yields a step's ``micro_batch_size x grad_accum_steps`` sequences
            as one batch and Lightning does not accumulate.
    """

    checkpoint_format: str = "full"
    loads_full_state: bool = True
    async_save: bool = True
    incremental_save: bool = True
    memory_snapshots: bool = True
    no_snapshots_reason: str = ""
    mesh_axes: tuple[str, ...] = ("dp",)
    owns_microbatching: bool = False

    def owns_microbatching_for(self, layout: ParallelLayout) -> bool:
        """Whether the plugin runs a step's micro-batches itself on ``layout`` (a pipeline: pp > 1)."""
        return self.owns_microbatching and layout.pp > 1


class ParallelPlugin:
    """Base class of every parallelism backend (built-in or from an outside package).

    Class attributes to set:
        name: registry name == ``conf/parallelism/<name>.yaml`` preset's ``name`` == MLflow tag ``plugin``.
        config_cls: the plugin's config dataclass (a subclass of ``ParallelConfig``).
        capabilities: a :class:`PluginCapabilities`.

    Must implement: :meth:`build_strategy`, :meth:`comm_volume`, :meth:`model_states_bytes`.
    A plugin that splits, shards or wraps the model returns a plan from :meth:`parallel_plan`.
    Everything else has a default that is right for a plugin that does nothing special there
    (plain torch modules, DDP, DTensor parameters); the measurement hooks (:meth:`held_state`,
    :meth:`full_param_shape`, :meth:`inner_optimizer`) are how the framework reads what a backend
    holds, so it never probes a backend's own attributes.
    """

    name: ClassVar[str]
    config_cls: ClassVar[type[ParallelConfig]] = ParallelConfig
    capabilities: ClassVar[PluginCapabilities] = PluginCapabilities()

    def __init__(self, cfg: ParallelConfig) -> None:
        self.cfg = cfg

    # -- before any rank starts ---------------------------------------------------------------
    def validate(self, resolved: ResolvedRun) -> None:
        """Raise :class:`ConfigError` (one line naming the keys) for settings this plugin cannot run.

        Called by the driver once the framework's own checks passed: ``resolved`` holds the
        layout and batch split. Capabilities (policies, mesh axes) are checked by the framework.
        """

    # -- in each rank ---------------------------------------------------------------------------
    def build_strategy(self, resolved: ResolvedRun) -> Any:
        """A Lightning ``Strategy`` (object or registered name) for ``resolved.layout``."""
        raise NotImplementedError(f"plugin {self.name!r} does not implement build_strategy")

    def parallel_plan(self, model: torch.nn.Module, module: Any) -> ParallelPlan:
        """What to apply to the freshly built GPT ``model``: a :class:`~framework.base.parallelize.ParallelPlan`
        (pipeline split, TP plan, DP wrapper, assembly), which
        :func:`~framework.base.parallelize.parallelize_gpt` applies in torchtitan's order together with
        activation checkpointing and compilation. ``module`` is the LightningModule
        (``module.device_mesh``: the run's ``("pp", "dp", "tp")`` mesh; ``module.resolved``).
        Default: an empty plan (the model stays whole; the strategy may wrap it, e.g. DDP)."""
        from framework.base.parallelize import ParallelPlan

        return ParallelPlan()

    def configure_model(self, model: torch.nn.Module, module: Any) -> torch.nn.Module:
        """After the plan was applied: anything a plan cannot express (e.g. registering a parameter
        used outside its module with ZeRO-3); returns what ``LMModule.model`` becomes. ``model``
        is :func:`~framework.base.parallelize.parallelize_gpt`'s result. Default: ``model`` unchanged."""
        return model

    def callbacks(self, resolved: ResolvedRun, emit: Any) -> list:
        """Extra Lightning callbacks of this plugin (e.g. a pipeline-bubble meter), sending their metrics
        through ``emit`` (:class:`~framework.base.metrics.emit.MetricEmitter`, ``emit(metrics, step)``;
        writes on rank 0 only). They run at the plugin's place in the step's order
        (:mod:`framework.rank.step`). Default: none."""
        return []

    @property
    def optimizer_foreach(self) -> bool | None:
        """AdamW's ``foreach`` flag; None = torch's choice (a plugin mixing DTensor shards and plain
        tensors in one parameter list needs False)."""
        return None

    def grad_norm(self, module: Any) -> float | torch.Tensor:
        """The global L2 norm of the gradients of ``module`` (after the data-parallel reduction,
        before clipping): the run's one gradient-norm function, logged as ``train/grad_norm`` and
        judged by the fault guard (:mod:`framework.rank.faults.detect`). A 0-dim tensor on the
        module's device (or a float): the run reads it back only where it logs or judges it, so a
        step without logging waits for no device value (:mod:`framework.rank.metrics.syncs`). Default: every rank holds
        whole gradients, or DTensor shards of them (FSDP2), whose norm is gathered with
        ``full_tensor``; 0.0 without gradients. Override when gradients are split otherwise
        (e.g. pipeline stages, a tied weight held twice)."""
        import torch

        grads = [p.grad for p in module.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def clip_gradients(self, module: Any, optimizer: Any, max_norm: float) -> None:
        """Scale gradients so that their global norm is at most ``max_norm``. Default: Lightning's
        norm clipping (right whenever :meth:`grad_norm`'s default is). Under bf16 autocast (no
        gradient scaler) its precision plugin's clipping is called directly: Lightning's
        ``clip_gradients`` refuses any fused optimizer under AMP, for fp16's unscaling, which bf16 has not."""
        from pytorch_lightning.plugins.precision import MixedPrecision

        precision = module.trainer.precision_plugin
        if isinstance(precision, MixedPrecision) and precision.scaler is None:
            precision.clip_grad_by_norm(optimizer, max_norm)
            return
        module.clip_gradients(optimizer, gradient_clip_val=max_norm, gradient_clip_algorithm="norm")

    # -- cost model and measurement ---------------------------------------------------------------
    @property
    def zero_stage(self) -> int:
        """What this plugin shards over the dp group, as a ZeRO stage (Rajbhandari et al. 2020 §5;
        :data:`framework.base.cost.memory.ZERO_STAGES`): 0 nothing (a replica per rank, one gradient
        all-reduce), 1 optimizer state, 2 + gradients, 3 + weights (FSDP full shard). The cost
        model's layout of a run reads it (:func:`framework.base.cost.layout.plan_layout_of`), logged as
        MLflow param ``derived.zero_stage``. Default: 0."""
        return 0

    def comm_volume(self, stats: ModelStats, resolved: ResolvedRun) -> CommEstimate:
        """Modelled payload bytes per rank per optimizer step, by collective kind (:mod:`framework.base.cost.comm`)."""
        raise NotImplementedError(f"plugin {self.name!r} does not implement comm_volume")

    def model_states_bytes(self, stats: ModelStats, resolved: ResolvedRun) -> int:
        """Modelled bytes of parameters + gradients + optimizer state on one rank (ZeRO §3.1)."""
        raise NotImplementedError(f"plugin {self.name!r} does not implement model_states_bytes")

    def held_state(self, module: torch.nn.Module, optimizer: Any) -> HeldState:
        """The model-state tensors this rank holds now (parameters, gradients, optimizer tensors), measured as
        ``mem/model_states_bytes`` by :func:`framework.base.metrics.memory.model_states_bytes`. ``module``: the
        LightningModule; ``optimizer``: the one the Trainer steps (``trainer.optimizers[0]``), or None.
        Default (:func:`~framework.base.metrics.memory.torch_held_state`): the module's parameters (DTensor
        shards count their local part), their gradients, and a torch optimizer's parameters, gradients and
        state. Override when the backend keeps state elsewhere (partitions beside the parameters, flat
        buffers in an optimizer wrapper)."""
        from framework.base.metrics.memory import torch_held_state

        return torch_held_state(module.parameters(), self.inner_optimizer(optimizer) if optimizer is not None else None)

    def full_param_shape(self, param: torch.nn.Parameter) -> tuple[int, ...]:
        """The full (unpartitioned) shape of a parameter of the model, for the cost model's
        :class:`~framework.base.cost.comm.ModelStats`. Default ``param.shape`` (a DTensor's is already the global
        shape). Override when the backend empties or replaces the parameter's data by a partition."""
        return tuple(param.shape)

    def inner_optimizer(self, optimizer: Any) -> torch.optim.Optimizer:
        """The torch optimizer that updates the parameters (its step post-hook marks the end of the
        update): ``optimizer`` itself by default; the torch optimizer inside when the backend hands the
        Trainer a wrapper of its own (which may do more after the inner step, e.g. gather parameters)."""
        return optimizer

    def install_comm_meter(self, model: Any, meter: CommMeter) -> None:
        """Make this plugin's training collectives report to ``meter`` (``model``: the strategy-wrapped
        model). Default: nothing to meter (a plugin that never communicates)."""


def check_capabilities(plugin: ParallelPlugin, run: Any, layout: ParallelLayout) -> None:
    """The framework's checks of a run against what ``plugin`` declares (:class:`PluginCapabilities`).

    Raises:
        ConfigError: a degree > 1 on a mesh axis the plugin does not use, or a checkpoint policy
            (async, incremental, in-memory snapshots) its checkpoint format does not implement;
            one line naming the key and what is allowed.
    """
    from framework.base.checkpoint.kinds import get_checkpoint_kind

    caps, name = plugin.capabilities, plugin.name
    if not caps.mesh_axes and layout.world_size != 1:
        raise ConfigError(
            f"parallelism.world_size={layout.world_size} (and every degree) must be 1 for plugin {name!r}"
            " (it runs one rank); use a data-parallel plugin for several ranks"
        )
    unused = [axis for axis in ("tp", "pp") if axis not in caps.mesh_axes and layout.degree(axis) > 1]
    if caps.mesh_axes and unused:
        raise ConfigError(
            f"parallelism.tp_degree={layout.tp}, pp_degree={layout.pp}: plugin {name!r} is data parallel only"
            f" (its mesh axes: {', '.join(caps.mesh_axes)}; allowed: 1); use a tensor/pipeline plugin"
        )
    ck = run.checkpoint
    saves = get_checkpoint_kind(caps.checkpoint_format).description
    if ck.mode != "sync" and not caps.async_save:
        raise ConfigError(
            f"checkpoint.mode={ck.mode!r}: plugin {name!r} saves {saves} synchronously only; allowed: sync"
        )
    if ck.full_every_n_saves != 1 and not caps.incremental_save:
        raise ConfigError(
            f"checkpoint.full_every_n_saves={ck.full_every_n_saves}: plugin {name!r} saves {saves}"
            " without deltas; allowed: 1"
        )
    if ck.memory_every_n_steps > 0 and not caps.memory_snapshots:
        raise ConfigError(
            f"checkpoint.memory_every_n_steps={ck.memory_every_n_steps}: plugin {name!r} does not keep"
            f" in-memory snapshots ({caps.no_snapshots_reason}); allowed: 0"
        )
