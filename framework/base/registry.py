"""Parallelism plugin registry: plugins by name, found through entry points.

Plugins are found through the Python entry-point group ``trainlab.parallelism``
(``pyproject.toml``: ``[project.entry-points."trainlab.parallelism"]``), so a package outside
this repository adds a backend the same way the built-in ones do. The contract a plugin
implements is :class:`framework.base.plugin.ParallelPlugin`.
"""

from __future__ import annotations

import importlib.metadata

from framework.base.config.schema import ConfigError
from framework.base.plugin import ParallelPlugin

ENTRY_POINT_GROUP = "trainlab.parallelism"

_PLUGINS: dict[str, type[ParallelPlugin]] = {}


def register_plugin(cls: type[ParallelPlugin]) -> type[ParallelPlugin]:
    """Class decorator: register ``cls`` under ``cls.name``.

    Raises:
        TypeError: ``cls`` is not a :class:`~framework.base.plugin.ParallelPlugin` subclass.
        ValueError: another class is already registered under that name.
    """
    if not (isinstance(cls, type) and issubclass(cls, ParallelPlugin)):
        raise TypeError(f"{cls!r} is not a subclass of framework.base.plugin.ParallelPlugin")
    name = cls.name
    if name in _PLUGINS and _PLUGINS[name] is not cls:
        raise ValueError(f"parallelism plugin {name!r} is registered twice: {_PLUGINS[name]} and {cls}")
    _PLUGINS[name] = cls
    return cls


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    """Entry points of the group by name (nothing imported yet)."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _load_entry_point(ep: importlib.metadata.EntryPoint) -> type[ParallelPlugin]:
    cls = ep.load()
    if isinstance(cls, type) and issubclass(cls, ParallelPlugin) and cls.name != ep.name:
        raise ValueError(f"entry point {ep.name!r} in {ENTRY_POINT_GROUP} loads {cls} whose name is {cls.name!r}")
    return register_plugin(cls)


def available_plugins() -> list[str]:
    """Sorted names of every plugin (registered, or declared by an entry point); imports none of them."""
    return sorted(set(_PLUGINS) | set(_entry_points()))


def get_plugin_class(name: str) -> type[ParallelPlugin]:
    """Look a plugin class up by name, importing only that plugin's module.

    Loading lazily matters: importing every backend (DeepSpeed, the pipeline APIs) cost about
    4 s of CPU per process — in the driver's pre-check and again in every rank.

    Raises:
        ConfigError: no plugin has that name; the message lists the available names.
        TypeError: the entry point loads something that is not a ParallelPlugin subclass.
        ValueError: the entry point loads a class whose ``name`` differs, or clashes with another.
    """
    if name in _PLUGINS:
        return _PLUGINS[name]
    ep = _entry_points().get(name)
    if ep is None:
        raise ConfigError(
            f"parallelism.name={name!r} is not a known plugin; available: {', '.join(available_plugins())}"
        )
    return _load_entry_point(ep)
