"""The fault-kind registry: a fault kind is one module in this package (and its preset ``conf/fault/<kind>.yaml``).

Each module defines a :class:`FaultKind` subclass and registers it with :func:`register_fault_kind`;
the package imports every module in it the first time the registry is read (:func:`fault_kinds`),
so adding a kind touches no other code: the config check (:func:`framework.base.faults.schedule.check_fault_config`)
takes the allowed names and each kind's own rules from here, the random process its defaults, and
the injector (:class:`framework.rank.faults.inject.FaultInjector`) its action. ``python -m
framework.base.faults.kinds`` lists the registered kinds with their one-line summaries.

A kind acts in three places of a step on its ranks (all optional):

- :meth:`FaultKind.start`: once, in the first micro-batch of the event's step, after the event
  is recorded in the fault log (crash, hang, corrupt a file, set the step state's ``loss_transform``);
  it may return a :class:`Acting` that keeps acting until its ``last_step``;
- :meth:`Acting.on_batch`: every micro-batch while acting (e.g. replace the batch);
- :meth:`Acting.before_optimizer_step`: at each ``on_before_optimizer_step`` while acting, after
  the gradient sync (e.g. poison or delay the gradients' use).

Modules here import only the standard library and this package at import time (the driver reads
the registry to validate a config); torch and framework code are imported inside the hooks.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Optional

if TYPE_CHECKING:
    from framework.base.config.schema import RunConfig


@dataclass
class FaultContext:
    """Where a fault acts: this rank's ``step`` (the optimizer step, 1-based), ``rank``, the Lightning
    ``trainer`` and ``module`` (the LMModule), and the run's ``checkpoint_dir``."""

    step: int
    rank: int
    trainer: Any
    module: Any
    checkpoint_dir: str


class Acting:
    """A fault that keeps acting after it fired, through optimizer step ``last_step`` (inclusive)."""

    def __init__(self, last_step: int) -> None:
        self.last_step = last_step

    def on_batch(self, ctx: FaultContext, batch: Any) -> None:
        """Each micro-batch of a step it acts in (``batch``: ``(x, y, ...)`` token tensors, changed in place)."""

    def before_optimizer_step(self, ctx: FaultContext) -> None:
        """At Lightning's ``on_before_optimizer_step`` of a step it acts in (after the gradient sync)."""


class FaultKind:
    """One fault kind. Subclass, set :attr:`name` and :attr:`summary`, override what the kind does,
    and decorate the class with :func:`register_fault_kind`.

    Event fields every kind may read (``framework.base.config.schema.FaultEventConfig``): ``step``,
    ``ranks``, ``factor``, ``delay_s``, ``duration_steps``.
    """

    name: ClassVar[str]
    summary: ClassVar[str] = ""  # one line: what happens on the faulty ranks

    def check(self, run: RunConfig) -> list[str]:
        """Rules of a run that schedules this kind (listed or drawn at random): one line per problem,
        naming the key and what is allowed. Default: none."""
        return []

    def random_event(self, event: dict[str, Any]) -> dict[str, Any]:
        """An event of this kind drawn by the random process (``fault.mtbf_steps``), given the event
        with the schema's defaults; returns the event to schedule. Default: unchanged."""
        return event

    def start(self, event: dict[str, Any], ctx: FaultContext) -> Acting | None:
        """Make the fault happen on this rank (see the module docstring). Default: nothing."""
        return None


_KINDS: dict[str, FaultKind] = {}
_discovered = False


def register_fault_kind(cls: type[FaultKind]) -> type[FaultKind]:
    """Class decorator: register one instance of ``cls`` under ``cls.name``.

    Raises:
        ValueError: another class is already registered under that name.
    """
    known = _KINDS.get(cls.name)
    if known is not None and type(known) is not cls:
        raise ValueError(
            f"fault kind {cls.name!r} is registered twice: {type(known).__qualname__} and {cls.__qualname__}"
        )
    _KINDS[cls.name] = cls()
    return cls


def _discover() -> None:
    global _discovered
    if not _discovered:
        _discovered = True
        for info in pkgutil.iter_modules(__path__):
            if not info.name.startswith("_"):
                importlib.import_module(f"{__name__}.{info.name}")


def fault_kinds() -> dict[str, FaultKind]:
    """Every registered kind by name (the modules of this package, imported on first use)."""
    _discover()
    return dict(_KINDS)


def fault_kind_names() -> list[str]:
    """Sorted names of the registered kinds: the values ``fault.events[].kind`` and ``fault.random_kinds`` allow."""
    return sorted(fault_kinds())


def get_fault_kind(name: str) -> FaultKind:
    """The registered kind ``name``.

    Raises:
        KeyError: no such kind (the message lists the registered ones).
    """
    kinds = fault_kinds()
    if name not in kinds:
        raise KeyError(f"{name!r} is not a fault kind; allowed: {', '.join(sorted(kinds))}")
    return kinds[name]
