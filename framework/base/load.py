"""Build the typed run config from a composed Hydra config (or a plain dict).

Single-field checks run in the dataclasses' ``__post_init__``; the ``parallelism`` node is
converted with its plugin's ``config_cls``. Cross-field rules are :mod:`framework.driver.validate`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from framework.base.config.schema import ConfigError, RunConfig
from framework.base.layout import ParallelLayout
from framework.base.registry import get_plugin_class
from framework.base.resolved import ResolvedRun


def _omegaconf_message(err: OmegaConfBaseException) -> str:
    """One line from an OmegaConf error: ``full.key: first line of the message``."""
    if isinstance(err.__cause__, ConfigError):
        return str(err.__cause__)
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if "is not a ListConfig" in first:
        first += " (write a list: key=[a,b])"
    key = getattr(err, "full_key", None)
    return f"{key}: {first}" if key else first


def _to_object(schema: Any, node: Any) -> Any:
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), node)
        return OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except OmegaConfBaseException as err:
        raise ConfigError(_omegaconf_message(err)) from None


def load_run_config(cfg: DictConfig | Mapping[str, Any]) -> RunConfig:
    """Build typed dataclasses from a composed config (Hydra ``DictConfig`` or plain dict).

    The ``parallelism`` node is converted with its plugin's ``config_cls``.

    Raises:
        ConfigError: a wrong type, an unknown key or a value out of range; one line.
    """
    if not isinstance(cfg, DictConfig):
        cfg = OmegaConf.create(dict(cfg))
    cfg = cfg.copy()
    OmegaConf.set_struct(cfg, False)
    if "hydra" in cfg:
        del cfg["hydra"]
    par_node = cfg.pop("parallelism", None) or {"name": "single"}
    run: RunConfig = _to_object(RunConfig, cfg)
    name = par_node.get("name", "single")
    plugin_cls = get_plugin_class(str(name))
    allowed = {f.name for f in dataclasses.fields(plugin_cls.config_cls)}
    unknown = sorted(set(par_node.keys()) - allowed)
    if unknown:
        raise ConfigError(
            f"parallelism.{unknown[0]} is not an option of plugin {name!r}; allowed: {', '.join(sorted(allowed))}"
        )
    run.parallelism = _to_object(plugin_cls.config_cls, par_node)
    return run


def resolved_from_dict(data: Mapping[str, Any]) -> ResolvedRun:
    """Rebuild a run the driver resolved (:meth:`ResolvedRun.to_dict`): typed again, not re-validated
    (no cross-field check runs in a rank)."""
    fields = {k: v for k, v in data.items() if k not in ("run", "layout")}
    return ResolvedRun(run=load_run_config(data["run"]), layout=ParallelLayout(**data["layout"]), **fields)
