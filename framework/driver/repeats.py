"""Repeats of a sweep (``sweep.repeats=N``) and the statistics of its outcome.

``python -m framework.train -m parallelism=single,ddp sweep.repeats=5`` runs each configuration 5
times. The repeat index is a swept key of its own, ``sweep.repeat=0,...,N-1``, put *first* among
the sweeper's params by :func:`install` (called by :class:`framework.driver.sweep.SweepCallback` before
Hydra's basic sweeper is made), and Hydra's sweeper varies its first key slowest: the jobs run
``single ddp single ddp ...`` (repeat 0 of every configuration, then repeat 1, ...), so a drift
of the machine's speed falls on every configuration alike. The order is recorded on each child
(tag ``trainlab.sweep_order``, Hydra's job number) and on the parent (param ``sweep.order``).

Each child is tagged with its configuration (``trainlab.config``: its swept values without the
repeat) and repeat index (``trainlab.repeat``); its name ends in ``repeat=k``. The sweep's summary
(:func:`summary_table`) and the compare report (:mod:`framework.driver.compare`) group the children by
configuration and give per configuration the median, its 95% bootstrap interval, the CV and a
verdict against the best (:mod:`framework.base.stats`).

``sweep.repeats`` is left out of the sweep's name, so raising it continues the same sweep (the
repeats done resume as finished; the new ones run).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

REPEAT_KEY = "sweep.repeat"
CONFIG_TAG = "trainlab.config"
REPEAT_TAG = "trainlab.repeat"
ORDER_TAG = "trainlab.sweep_order"


def repeat_values(n: int) -> str:
    """The sweep expression of ``n`` repeats: ``0,1,...,n-1``."""
    return ",".join(str(i) for i in range(n))


def install(config: Any) -> int:
    """Put ``sweep.repeat=0,...,N-1`` first among the sweeper's params of a multirun's ``config``
    (``N = sweep.repeats``), so it is the outer loop; returns N (1: nothing changed).

    Raises:
        ConfigError: ``sweep.repeats`` < 1, with a sweeper other than Hydra's basic one (an Optuna
            search repeats nothing), or with ``sweep.repeat`` also on the command line (one line).
    """
    from omegaconf import OmegaConf, open_dict, read_write

    from framework.base.config.schema import ConfigError

    n = int(OmegaConf.select(config, "sweep.repeats", default=1) or 1)
    if n < 1:
        raise ConfigError(f"sweep.repeats={n} must be >= 1 (runs of each configuration)")
    if n == 1:
        return 1
    target = str(OmegaConf.select(config, "hydra.sweeper._target_", default=""))
    if not target.endswith("BasicSweeper"):
        raise ConfigError(
            f"sweep.repeats={n} needs Hydra's basic sweeper (a grid), not {target or 'this sweeper'};"
            " an Optuna search repeats nothing (allowed: sweep.repeats=1 there)"
        )
    if any(str(o).lstrip("+~").startswith(REPEAT_KEY + "=") for o in config.hydra.overrides.task):
        raise ConfigError(f"{REPEAT_KEY} is set by sweep.repeats={n}; leave {REPEAT_KEY} off the command line")
    params = config.hydra.sweeper.get("params")
    old = dict(OmegaConf.to_container(params, resolve=False)) if params else {}
    with read_write(config.hydra), open_dict(config.hydra.sweeper):
        config.hydra.sweeper.params = {REPEAT_KEY: repeat_values(n), **old}  # first = slowest-varying
    return n


def child_tags(swept: Mapping[str, str], job_num: int | None) -> dict[str, str]:
    """Tags of a sweep's child from its swept values (``{key: value}``, repeat included when swept):
    its configuration, repeat index (0 when not repeated) and, when known, its place in the sweep's order."""
    config = ",".join(f"{k}={v}" for k, v in swept.items() if k != REPEAT_KEY)
    tags = {CONFIG_TAG: config or "job", REPEAT_TAG: str(swept.get(REPEAT_KEY, 0))}
    if job_num is not None:
        tags[ORDER_TAG] = str(job_num)
    return tags


def config_label(overrides: Sequence[str]) -> str:
    """A job's configuration from its swept overrides (``["parallelism=ddp", "sweep.repeat=2"]`` ->
    ``parallelism=ddp``): ``key=value`` joined by ``,``, each key by its last dotted part (the whole
    key where that part is not unique), the repeat left out. (The MLflow run name,
    :func:`framework.driver.sweep.display_name`, puts the values first instead.)"""
    pairs = [o.lstrip("+~").split("=", 1) for o in overrides if "=" in o]
    pairs = [(k, v) for k, v in pairs if k != REPEAT_KEY]
    last = [k.rsplit(".", 1)[-1] for k, _ in pairs]
    return ",".join(f"{s if last.count(s) == 1 else k}={v}" for (k, v), s in zip(pairs, last)) or "job"


def hydra_job_num() -> int | None:
    """This job's place in its sweep (Hydra's ``job.num``), None outside a Hydra job."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    num = HydraConfig.get().job.get("num")
    return None if num is None else int(num)


# --- the sweep's summary ----------------------------------------------------------------------


def summary_table(outcomes: Sequence[Any], objective: str, *, maximize: bool = True) -> tuple[str, str | None, str]:
    """Per configuration of a sweep's :class:`framework.driver.sweep.JobOutcome` list: repeats, median
    objective, 95% interval, CV, verdict against the best (:func:`framework.base.stats.verdicts`).

    Returns ``(table, best line or None, one sentence for the parent run's description)``.
    Jobs without an objective (failed, over the memory limit) are left out of the figures and
    counted in the ``failed`` column.
    """
    from framework.base.stats import established, summarize, verdicts
    from framework.base.tables import format_table

    groups: dict[str, list[float]] = {}
    failed: dict[str, int] = {}
    for o in outcomes:
        label = config_label(o.overrides)
        groups.setdefault(label, [])
        failed.setdefault(label, 0)
        if o.objective is None:
            failed[label] += 1
        else:
            groups[label].append(float(o.objective))
    words = ("faster", "slower") if _is_speed(objective) else ("higher", "lower")
    if not maximize and not _is_speed(objective):
        words = ("lower", "higher")
    verdict = verdicts({k: v for k, v in groups.items() if v}, maximize=maximize, words=words)
    rows = []
    for label, vals in groups.items():
        s = summarize(vals)
        rows.append(
            {
                "configuration": label,
                "n": len(vals),
                "failed": failed[label],
                "median": s.center if s else None,
                "ci": f"[{s.lo:,.1f}, {s.hi:,.1f}]" if s and s.lo is not None else "n/a",
                "cv_pct": 100 * s.cv if s and s.cv is not None else None,
                "verdict": str(verdict[label]) if label in verdict else "no objective",
            }
        )
    cols = [
        ("configuration", "", "", "s"),
        ("verdict", "", "", "s"),
        ("n", "", "", "d"),
        ("failed", "", "", "d"),
        (f"median {objective}", "", "", ",.1f"),
        ("95% CI (bootstrap)", "", "", "s"),
        ("CV %", "", "", ".1f"),
    ]
    data = [
        {
            "configuration": r["configuration"],
            "verdict": r["verdict"],
            "n": r["n"],
            "failed": r["failed"],
            f"median {objective}": r["median"],
            "95% CI (bootstrap)": r["ci"],
            "CV %": r["cv_pct"],
        }
        for r in rows
    ]
    table = "sweep: per configuration (median of repeats; verdicts against the best, docs/sweeps.md)\n" + format_table(
        data, cols, text_columns=2
    )
    best = next((k for k, v in verdict.items() if v.kind == "best"), None)
    if best is None:
        return table, None, "No configuration scored."
    v = verdict[best]
    med = next(r["median"] for r in rows if r["configuration"] == best)
    n = len(groups[best])
    if established(v):
        line = f"trainlab: best configuration {best}: median {objective} = {med:,.1f} (n={n}); {v.note}"
        note = f"Best ({objective}, median of {n}): {best} = {med:,.1f}, {v.note}."
    elif v.margin == "indistinguishable":
        line = (
            f"trainlab: no established best: {best} has the highest median {objective} = {med:,.1f} (n={n}), {v.note}"
        )
        note = f"No established best by {objective}: {best} leads ({med:,.1f}, median of {n}) but is {v.note}."
    else:  # too few repeats (or a single configuration)
        why = f" (not ranked: {v.note})" if v.note else ""
        line = f"trainlab: highest {objective}: {best} = {med:,.1f} (median of {n}){why}"
        note = f"Highest {objective}: {best} = {med:,.1f} (median of {n}){why}."
    overrides = next((o.overrides for o in outcomes if config_label(o.overrides) == best), [])
    line += f" (overrides: {' '.join(x for x in overrides if not x.startswith(REPEAT_KEY + '='))})"
    slower = [k for k, x in verdict.items() if x.kind == words[1]]
    if slower and n >= 2:
        note += (
            f" {words[1].capitalize()} than it, beyond the noise: "
            + "; ".join(f"{k} ({verdict[k]})" for k in slower)
            + "."
        )
    return table, line, note


def _is_speed(objective: str) -> bool:
    """Whether a figure is a speed (tokens/s, MFU, step time), whose better side is called faster."""
    return any(w in objective for w in ("tokens_per_sec", "mfu", "hfu", "step_time", "samples_per_sec"))
