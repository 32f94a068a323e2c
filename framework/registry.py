"""Parallelism plugin protocol and registry.

A plugin is a class with a registry ``name``, a ``config_cls`` (a subclass of
:class:`~framework.config.schema.ParallelConfig`) and methods that validate a run, build the
Lightning strategy and describe its layout. Plugins are found through the Python entry-point
group ``trainlab.parallelism`` (``pyproject.toml``: ``[project.entry-points."trainlab.parallelism"]``),
so a package outside this repository adds a backend the same way the built-in ones do.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from framework.config.schema import ConfigError, ParallelConfig

if TYPE_CHECKING:
    from framework.config.validate import ResolvedRun
    from framework.metrics.comm import CommEstimate, ModelStats
    from framework.metrics.timing import CommMeter

ENTRY_POINT_GROUP = "trainlab.parallelism"


@dataclass(frozen=True)
class ParallelLayout:
    """Degrees of one layout: ``world_size = dp * tp * pp``."""

    dp: int
    tp: int = 1
    pp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


@runtime_checkable
class ParallelPlugin(Protocol):
    """What every parallelism backend provides.

    Attributes:
        name: registry name == ``conf/parallelism/<name>.yaml`` == MLflow tag ``plugin``.
        config_cls: the plugin's config dataclass (subclass of ``ParallelConfig``).
        multi_process: False for plugins that always run exactly one rank.
    """

    name: ClassVar[str]
    config_cls: ClassVar[type[ParallelConfig]]

    def __init__(self, cfg: ParallelConfig) -> None: ...

    def validate(self, run: Any) -> None:
        """Raise ConfigError (naming the keys) for settings this plugin cannot run."""

    def layout(self) -> ParallelLayout:
        """The dp/tp/pp degrees this plugin will use for ``cfg.world_size`` ranks."""

    def build_strategy(self, run: "ResolvedRun") -> Any:
        """A ``pytorch_lightning`` Strategy (object or registered name) for this layout."""

    def comm_volume(self, stats: "ModelStats", run: "ResolvedRun") -> "CommEstimate":
        """Modelled payload bytes per rank per optimizer step, by collective kind (framework.metrics.comm)."""

    def model_states_bytes(self, stats: "ModelStats", run: "ResolvedRun") -> int:
        """Modelled bytes of parameters + gradients + optimizer state on one rank (ZeRO §3.1)."""

    def install_comm_meter(self, model: Any, meter: "CommMeter") -> None:
        """Make this plugin's training collectives report to ``meter`` (``model``: the strategy-wrapped model)."""

    # Optional hooks, looked up with getattr by the worker / LMModule (see plugins/megatron/plugin.py):
    #   configure_model(model, module) -> nn.Module   shard / split the GPT (ModelParallelStrategy calls it)
    #   dp_rank(rank) -> int                           the data shard a rank reads (TP/PP peers share one)
    #   owns_microbatching: bool                       the loader yields a step's micro-batches as one batch
    #   callbacks(resolved, sinks) -> list             extra Lightning callbacks (e.g. pipeline bubble)
    #   grad_norm(module) / clip_gradients(module, max_norm)   global norm when parameters are split over ranks
    #   optimizer_foreach: bool | None                 AdamW's foreach flag (None = torch's choice)


_PLUGINS: dict[str, type] = {}


def register_plugin(cls: type) -> type:
    """Class decorator: register ``cls`` under ``cls.name``.

    Raises:
        ValueError: another class is already registered under that name.
    """
    name = cls.name
    if name in _PLUGINS and _PLUGINS[name] is not cls:
        raise ValueError(f"parallelism plugin {name!r} is registered twice: {_PLUGINS[name]} and {cls}")
    _PLUGINS[name] = cls
    return cls


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    """Entry points of the group by name (nothing imported yet)."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _load_entry_point(ep: importlib.metadata.EntryPoint) -> type:
    cls = ep.load()
    if getattr(cls, "name", None) != ep.name:
        raise ValueError(f"entry point {ep.name!r} in {ENTRY_POINT_GROUP} loads {cls} whose name is {getattr(cls, 'name', None)!r}")
    return register_plugin(cls)


def available_plugins() -> list[str]:
    """Sorted names of every plugin (registered, or declared by an entry point); imports none of them."""
    return sorted(set(_PLUGINS) | set(_entry_points()))


def get_plugin_class(name: str) -> type:
    """Look a plugin class up by name, importing only that plugin's module.

    Loading lazily matters: importing every backend (DeepSpeed, the pipeline APIs) cost about
    4 s of CPU per process — in the driver's pre-check and again in every rank.

    Raises:
        ConfigError: no plugin has that name; the message lists the available names.
        ValueError: the entry point loads a class whose ``name`` differs, or clashes with another.
    """
    if name in _PLUGINS:
        return _PLUGINS[name]
    ep = _entry_points().get(name)
    if ep is None:
        raise ConfigError(f"parallelism.name={name!r} is not a known plugin; available: {', '.join(available_plugins())}")
    return _load_entry_point(ep)
