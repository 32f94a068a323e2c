"""A Hydra sweep (``python -m framework.train -m ...``): job identity, the parent MLflow run, outcomes.

A sweep is named by its command line (:func:`parse_sweep`): the overrides that name a run (as
Hydra's ``job.override_dirname`` does, ``hydra.job.config.override_dirname.exclude_keys`` left
out) plus every swept key with the values it sweeps, whether or not that key is excluded. A job
is named by its swept values (:func:`job_name`); its run name is ``<sweep>/<job>``, so its output
folder, checkpoint folder, lock and MLflow run are its own, any key can be swept, and two
different sweeps never share a run. Running the same sweep again continues it (each job resumes
as a single run does).

:class:`SweepCallback` (``hydra.callbacks.trainlab_sweep`` in ``conf/config.yaml``) hooks the
sweep through Hydra's callback API:

- ``on_multirun_start``: one-line errors before any job (a swept key that does not exist, with
  suggestions; a swept value of the wrong type); the sweep's lock (a second identical sweep gets
  the one-line error naming the other process); the parent MLflow run (tag
  ``trainlab.sweep=parent``; params ``sweep.keys`` and ``sweep.<key>``, the swept values; tag
  ``sweep.command``).
- each job (the driver, :mod:`framework.driver.train`): a child run (tag ``mlflow.parentRunId``) named by
  its swept values (:func:`attach_child`); a job whose config the validation refuses, or whose
  training fails, is a FAILED child with its one-line reason (:func:`record_job`).
- ``on_multirun_end``: the jobs' outcomes (metrics ``sweep/jobs``, ``sweep/jobs_finished``,
  ``sweep/jobs_failed`` and the run description on the parent), the best job by
  ``objective`` in its direction (:func:`objective_direction`; an Optuna search's best trial),
  and the compare report (:mod:`framework.driver.compare`) logged to the parent, which then ends
  FINISHED (FAILED when a search is over its failure budget: :data:`SEARCH`). A sweep that ends
  any other way has its parent ended by :func:`framework.driver.cli.main` (:func:`close_sweep`).

The driver returns each job's objective (:func:`objective_of`: ``objective``, default
``perf/tokens_per_sec_mean``, any figure the run logged; None for a failed job, one whose training
went non-finite, one without a finite objective or one over ``max_peak_mem_gib``), which is what
an Optuna search optimises (:mod:`framework.driver.search`); None makes a FAIL trial with its reason.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from framework.base.config import near_keys, path_safe
from framework.base.tracking import OVERRIDES_TAG, PARENT_TAG, SWEEP_TAG, SWEPT_TAG, sweep_children
from framework.driver.runs import FAILED_JOBS, hold_lock, ui_link

SWEEP_ENV = "TRAINLAB_SWEEP"  # the running sweep (JSON of :class:`Sweep`), read when a job's run name resolves
GIB = 1024**3


@dataclass
class Sweep:
    """One sweep: its name (path-safe), swept keys in command-line order, each key's sweep
    expression as written (``5,10``, ``choice(ddp,tp)``), its command and parent MLflow run."""

    name: str
    keys: list[str]
    values: dict[str, str]
    command: str = ""
    parent_run_id: str | None = None
    tracking_uri: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Sweep:
        return cls(**json.loads(text))


def parse_sweep(
    task_overrides: Sequence[str], sweeper_params: Mapping[str, Any] | None, exclude_keys: Sequence[str] = ()
) -> Sweep:
    """The sweep of a multirun: ``task_overrides`` as given on the command line (Hydra's
    ``hydra.overrides.task`` at ``on_multirun_start``), ``sweeper_params`` the sweeper's
    ``params`` (a preset's sweep; the command line wins for the same key). Swept keys are those
    whose value is a sweep (``a,b``, ``choice(..)``, ``range(..)``, ``interval(..)``); the name is
    the command line's sorted ``key=value`` overrides that are swept or not excluded (``sweep``
    when none: a preset's sweep is named by its ``experiment_name``, the folder above)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    lines = [f"{k}={v}" for k, v in (sweeper_params or {}).items()] + list(task_overrides)
    parsed = {}
    for o in OverridesParser.create().parse_overrides(lines):
        parsed[o.key_or_group] = o  # later (command line) wins
    keys = [k for k, o in parsed.items() if o.is_sweep_override()]
    values = {k: parsed[k].input_line.split("=", 1)[1] for k in keys}
    named = sorted(
        o.input_line.lstrip("+~")
        for o in OverridesParser.create().parse_overrides(list(task_overrides))
        if o.is_sweep_override() or o.key_or_group not in exclude_keys
    )
    return Sweep(name=path_safe(",".join(named)) if named else "sweep", keys=keys, values=values)


def job_name(task_overrides: Sequence[str], keys: Sequence[str]) -> str:
    """A job's name: its value of each swept key, ``key=value`` joined by ``,`` in ``keys`` order (path-safe)."""
    return path_safe(",".join(f"{k}={v}" for k, v in _values_of(task_overrides, keys).items())) or "job"


def display_name(task_overrides: Sequence[str], keys: Sequence[str]) -> str:
    """A job's short name for the MLflow UI: its swept values first, then the keys they belong to
    (``ddp, 5 (parallelism, every_n_steps)``), each key by its last dotted part (the whole key where
    that part is not unique). MLflow's run list cuts names at about 20 characters, so the values,
    which tell the jobs apart, lead."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    found = _values_of(task_overrides, keys)
    shown = [(s if last.count(s) == 1 else k, found[k]) for k, s in zip(keys, last) if k in found]
    if not shown:
        return "job"
    return ", ".join(v for _, v in shown) + " (" + ", ".join(k for k, _ in shown) + ")"


def job_label(task_overrides: Sequence[str], keys: Sequence[str]) -> str:
    """A job's label in the sweep's printed tables and best-job line: ``key=value`` joined by ``,``,
    each key by its last dotted part (the whole key where that part is not unique), e.g.
    ``every_n_steps=5,parallelism=ddp``. (Its MLflow run name, :func:`display_name`, leads with the values.)"""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    found = _values_of(task_overrides, keys)
    return ",".join(f"{s if last.count(s) == 1 else k}={found[k]}" for k, s in zip(keys, last) if k in found) or "job"


def current() -> Sweep | None:
    """The sweep this process is running, or None (set by :class:`SweepCallback` for the sweep's length)."""
    text = os.environ.get(SWEEP_ENV)
    return Sweep.from_json(text) if text else None


def sweep_run_name(override_dirname: str, task_overrides: Sequence[str] | None) -> str | None:
    """``<sweep>/<job>`` for a job of the running sweep, else None (the caller names a single run)."""
    sweep = current()
    if sweep is None or task_overrides is None:
        return None
    return f"{sweep.name}/{job_name(list(task_overrides), sweep.keys)}"


def job_checkpoint_dir(checkpoint_dir: str | None, run_name: str) -> str | None:
    """A sweep job's ``checkpoint.dir``: an explicit one that the sweep does not sweep is a root under
    which each job has its own folder, ``<checkpoint.dir>/<run_name>`` (``<sweep>/<job>``), so the jobs
    neither share nor resume each other's checkpoints; otherwise (null, swept, or not in a sweep) as given."""
    sweep = current()
    if sweep is None or not checkpoint_dir or "checkpoint.dir" in sweep.keys:
        return checkpoint_dir
    return str(Path(checkpoint_dir) / run_name)


# --- checks before any job ------------------------------------------------------------------


def _sweep_values(override: Any) -> list[Any]:
    """Values to check of a swept override: every value of a list/choice/range, both ends of an interval."""
    if override.is_interval_sweep():
        v = override.value()
        return [v.start, v.end]
    return list(override.sweep_iterator())


def check_sweep(config: DictConfig, task_overrides: Sequence[str]) -> None:
    """Refuse a sweep with a key that does not exist or a value of the wrong type, in one line,
    before any job (exit code 2). A key is checked against every plugin the sweep chooses
    (``parallelism=...``): every one of them must have it (a job whose overrides do not compose
    would stop the sweep), and at least one must take each value (a layout that the validation
    refuses is that job's failure, a FAILED child, and the sweep goes on)."""
    from hydra import compose
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from framework.base.config import fail
    from framework.base.config.schema import ConfigError
    from framework.base.tracking import flatten
    from framework.driver.validate import load_run_config

    params = _sweeper_params(config)
    lines = [f"{k}={v}" for k, v in params.items()] + list(task_overrides)
    parsed = {}
    for o in OverridesParser.create().parse_overrides(lines):
        parsed[o.key_or_group] = o
    fixed = [o.input_line for o in parsed.values() if not o.is_sweep_override()]
    swept = {k: o for k, o in parsed.items() if o.is_sweep_override()}
    if "experiment_name" in swept or "experiment" in swept:
        fail(
            "experiment_name cannot be swept: a sweep's jobs and its parent run share one MLflow experiment"
            " (run one sweep per experiment)"
        )
    if "run_name" in parsed:
        fail(
            "run_name cannot be set in a sweep: each job is named <sweep>/<its swept values>"
            " (leave run_name out, or run the jobs one by one)"
        )
    plugins = [str(v) for v in _sweep_values(swept["parallelism"])] if "parallelism" in swept else [None]
    searchpath = _searchpath_overrides(config)
    bases = {}
    for plugin in plugins:
        extra = [f"parallelism={plugin}"] if plugin else []
        try:
            bases[plugin] = compose(config_name="config", overrides=[*searchpath, *fixed, *extra, "run_name=check"])
        except Exception as err:
            fail(f"sweep: {_one_line(err)}")
    groups = [k for k in swept if is_config_group(k, searchpath)]
    for key, o in swept.items():
        if key in groups:  # options checked by cli.check_group_choices or by composing
            continue
        values = _sweep_values(o)
        known = [p for p, base in bases.items() if OmegaConf.select(base, key, default=_ABSENT) is not _ABSENT]
        if not known and not o.get_key_element().startswith("+"):
            names = sorted({k for base in bases.values() for k in flatten(OmegaConf.to_container(base, resolve=False))})
            near = near_keys(key, names)
            where = f" of plugin(s) {', '.join(p for p in plugins)}" if plugins != [None] else ""
            fail(
                f"swept key {key} is not a config key{where}; "
                + (
                    f"did you mean {', '.join(near)}?"
                    if near
                    else "see conf/ and framework/base/config/schema.py for the keys"
                )
            )
        missing = [p for p in bases if p not in known]
        if known and missing and not o.get_key_element().startswith("+"):
            fail(
                f"swept key {key} is not an option of plugin(s) {', '.join(missing)} that this sweep also runs"
                f" (only of {', '.join(known)}); sweep it with those plugins alone"
            )
        for value in values:
            errors = []
            for plugin in known or list(bases):
                cfg = bases[plugin].copy()
                OmegaConf.set_struct(cfg, False)
                OmegaConf.update(cfg, key, value, merge=False)
                try:
                    load_run_config(cfg)
                    break
                except ConfigError as err:
                    errors.append(str(err))
            else:
                fail(f"swept value {key}={value!r} ({type(value).__name__}): {errors[0]}")
    every_job_refused = check_jobs(fixed, swept, searchpath, groups)
    if every_job_refused:
        fail(every_job_refused)


MAX_CHECKED_JOBS = 256
"""Up to this many jobs of a sweep are validated before the first starts (:func:`check_jobs`)."""


def check_jobs(
    fixed: Sequence[str], swept: Mapping[str, Any], searchpath: Sequence[str] = (), groups: Sequence[str] | None = None
) -> str:
    """Validate the jobs of a sweep as a single run is validated (:func:`framework.driver.validate.validate`
    and the first shrink), before any job starts; returns the one-line refusal when every job is refused
    (a bad value in a key the sweep does not sweep, or a sweep none of whose points holds), else "" (at
    the first job that holds). A sweep some of whose jobs are refused (a grid's invalid layouts) runs:
    those are its FAILED jobs. Skipped for a search over an interval, or more than :data:`MAX_CHECKED_JOBS` jobs.
    ``searchpath``: the command line's ``hydra.searchpath`` overrides (:func:`is_config_group`); ``groups``: the swept
    keys that pick a config group's option, when the caller has found them already."""
    import itertools

    from hydra import compose

    from framework.base.config.schema import ConfigError
    from framework.driver.runs import resolve_run

    if any(o.is_interval_sweep() for o in swept.values()):
        return ""
    if groups is None:
        groups = [k for k in swept if is_config_group(k, searchpath)]
    values = {k: [str(v) if k in groups else v for v in _sweep_values(o)] for k, o in swept.items()}
    if math.prod(len(v) for v in values.values()) > MAX_CHECKED_JOBS:
        return ""
    refused: list[tuple[str, str]] = []
    total = 0
    for group_choice in itertools.product(*(values[g] for g in groups)):
        picked = [f"{swept[g].get_key_element()}={v}" for g, v in zip(groups, group_choice)]
        try:
            base = compose(config_name="config", overrides=[*searchpath, *fixed, *picked, "run_name=check"])
        except Exception as err:
            refused.append((",".join(picked), _one_line(err)))
            total += 1
            continue
        keys = [k for k in values if k not in groups]
        for choice in itertools.product(*(values[k] for k in keys)):
            total += 1
            cfg = base.copy()
            OmegaConf.set_struct(cfg, False)
            for k, v in zip(keys, choice):
                OmegaConf.update(cfg, k.lstrip("+~"), v, merge=False)
            try:
                resolve_run(cfg)  # the job reuses it (validated once per run)
                return ""
            except ConfigError as err:
                refused.append((",".join(picked + [f"{k}={v}" for k, v in zip(keys, choice)]), str(err)))
    if not total:
        return ""
    reasons = {r for _, r in refused}
    if len(reasons) == 1:
        return f"every job of this sweep is refused: {reasons.pop()}"
    return f"every job of this sweep is refused (the first, {refused[0][0]}: {refused[0][1]})"


_ABSENT = object()


def is_config_group(key: str, searchpath: Sequence[str] = ()) -> bool:
    """Whether the override key ``key`` (``+``/``~`` prefixes allowed) picks an option of a config group rather than
    setting a value: a folder of ``conf/``, a nested group (``hydra/launcher``), or a group on the search path that the
    command line adds (``searchpath``: its ``hydra.searchpath=[file://...]`` overrides; e.g. a folder of one's own run
    variants, each a ``# @package _global_`` file, swept as ``+variant=a,b``). Asks Hydra (which must be initialized)
    only for the last."""
    from hydra.core.global_hydra import GlobalHydra

    from framework.base.config import CONF_DIR

    key = key.lstrip("+~")
    if (CONF_DIR / key).is_dir() or "/" in key:
        return True
    if "." in key or not searchpath:
        return False
    loader = GlobalHydra.instance().config_loader()
    return bool(loader.get_group_options(key, config_name="config", overrides=list(searchpath)))


def _searchpath_overrides(config: DictConfig) -> list[str]:
    """The command line's ``hydra.searchpath`` overrides (their composition sees the groups they add)."""
    return [o for o in config.hydra.overrides.hydra if o.lstrip("+~").startswith("hydra.searchpath")]


def _sweeper_params(config: DictConfig) -> dict[str, Any]:
    """The sweeper's ``params`` (a preset's sweep or an Optuna search space) as a plain dict."""
    params = config.hydra.sweeper.get("params")
    return dict(OmegaConf.to_container(params, resolve=False)) if params else {}


def _one_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return lines[0] if lines else type(err).__name__


# --- the parent run and the children --------------------------------------------------------


def _client(uri: str) -> Any:
    import logging

    from mlflow.tracking import MlflowClient

    logging.getLogger("mlflow").setLevel(logging.WARNING)
    return MlflowClient(tracking_uri=uri)


def open_parent(uri: str, experiment: str, sweep: Sweep, description: str = "") -> str:
    """Create the sweep's parent run, or re-open the newest one of the same sweep; returns its id.
    A non-empty ``description`` (``experiment_description``) becomes the experiment's description.

    Raises:
        ConfigError: the tracking URI cannot be used (one line).
    """
    from framework.base.config.schema import ConfigError
    from framework.base.tracking import RUN_KEY_TAG, DriverRun

    try:
        tracker = DriverRun(uri, experiment, description)
        key = f"{experiment}/{sweep.name}"
        tracker.start(run_name=sweep.name, run_key=key, resume_run_id=tracker.find(key))
    except Exception as err:
        raise ConfigError(
            f"tracking.uri={uri!r}: {_one_line(err)} (allowed: a sqlite:///, file:// or http(s)://"
            " MLflow URI; or tracking=none)"
        ) from None
    tracker.set_tags(
        {
            SWEEP_TAG: "parent",
            RUN_KEY_TAG: key,
            "sweep.command": sweep.command,
            "mlflow.runName": short_sweep_name(sweep),
        }
    )
    tracker.log_params({"sweep.keys": ",".join(sweep.keys), **{f"sweep.{k}": v for k, v in sweep.values.items()}})
    return tracker.run_id


def short_sweep_name(sweep: Sweep) -> str:
    """The parent's display name: ``sweep <key>=<values> x ...`` (the whole name is the run key)."""
    return "sweep " + " x ".join(f"{k}={v}" for k, v in sweep.values.items())


def attach_child(tracker: Any, sweep: Sweep, task_overrides: Sequence[str]) -> None:
    """Make the driver's run a child of the sweep's parent: tag ``mlflow.parentRunId``, the short
    run name of its swept values, and its whole override string as tag ``trainlab.overrides``."""
    if sweep.parent_run_id is None:
        return
    from framework.driver.repeats import child_tags, hydra_job_num

    values = _values_of(task_overrides, sweep.keys)
    swept = ",".join(f"{k}={v}" for k, v in values.items())
    tracker.set_tags(
        {
            PARENT_TAG: sweep.parent_run_id,
            SWEPT_TAG: swept,
            OVERRIDES_TAG: " ".join(task_overrides),
            **child_tags(values, hydra_job_num()),
        }
    )
    tracker.client.update_run(tracker.run_id, name=display_name(task_overrides, sweep.keys))


def _values_of(task_overrides: Sequence[str], keys: Sequence[str]) -> dict[str, str]:
    """``{swept key: the job's value}`` in ``keys`` order."""
    found = {}
    for line in task_overrides:
        k, _, v = line.partition("=")
        found[k.lstrip("+~")] = v
    return {k: found[k] for k in keys if k in found}


@dataclass
class JobOutcome:
    """One job of this process's sweep: short name, swept overrides, status (FINISHED/FAILED/KILLED),
    one-line reason of a failure, the objective value (None when failed or over the memory limit)
    and peak memory (bytes, max over ranks)."""

    name: str
    overrides: list[str]
    status: str
    reason: str = ""
    objective: float | None = None
    peak_mem_bytes: float | None = None


OUTCOMES: list[JobOutcome] = []

OUTCOME_FILE = "sweep_outcome.json"
"""A job's :class:`JobOutcome` in its run folder (with the writer's ``pid`` and time ``t``): how the
sweep learns the outcomes of jobs run in other processes (``hydra/launcher=submitit_slurm``)."""


def remote_outcomes(sweep_dir: Path, since: float) -> list[JobOutcome]:
    """Outcomes that jobs in other processes wrote under ``sweep_dir`` (``<job>/`` :data:`OUTCOME_FILE`)
    since ``since`` (Unix seconds), by job name."""
    found = []
    for path in sorted(Path(sweep_dir).glob(f"*/{OUTCOME_FILE}")):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if rec.pop("pid", None) != os.getpid() and rec.pop("t", 0) >= since:
            found.append(JobOutcome(**rec))
    return found


def _settings() -> dict[str, Any]:
    """The sweep callback's settings (``hydra.callbacks.trainlab_sweep``) of the running job."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {}
    cb = HydraConfig.get().get("callbacks") or {}
    return dict(cb.get("trainlab_sweep") or {})


def job_metrics(run_dir: Path) -> dict[str, float]:
    """Every figure a job's run folder holds, by MLflow key: the last value of each key in
    ``metrics.jsonl`` (step metrics and the end-of-run ones such as ``val/loss_final``), then
    ``summary.json`` (rank 0's run-level means), then the ``summary/*`` figures
    (:func:`framework.driver.run_summary.summary_metrics`); a later source wins for the same key."""
    from framework.base.tracking import read_jsonl_metrics
    from framework.driver.run_summary import summary_metrics

    records = read_jsonl_metrics(run_dir / "metrics.jsonl")
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    found: dict[str, float] = {}
    for rec in records:
        found.update({k: v for k, v in rec.items() if isinstance(v, (int, float))})
    found.update({k: v for k, v in summary.items() if isinstance(v, (int, float))})
    found.update(summary_metrics(summary, records))
    return found


TRAINING_HEALTH_KEYS = ("train/loss", "train/loss_final", "val/loss", "val/loss_final", "train/grad_norm")
"""Figures whose non-finite value (in any logged step) means the job's training did not stay finite."""


def nonfinite_training(run_dir: Path) -> str:
    """The first non-finite training figure of a job (``"train/loss = nan at step 12"``), "" when its
    training stayed finite. A step whose update the fault guard dropped (``faults.jsonl``: ``detected``
    with action ``skip_step``/``rollback``, or ``skipped``) logged the values it judged; it does not count."""
    import math

    from framework.base.faults.events import LOG_NAME
    from framework.base.tracking import read_jsonl_metrics

    dropped = set()
    for rec in read_jsonl_metrics(run_dir / LOG_NAME):
        if rec.get("ev") == "skipped" or (
            rec.get("ev") == "detected" and rec.get("action") in ("skip_step", "rollback")
        ):
            dropped.add(rec.get("step"))
    for rec in read_jsonl_metrics(run_dir / "metrics.jsonl"):
        if rec.get("step") in dropped:
            continue
        for key in TRAINING_HEALTH_KEYS:
            value = rec.get(key)
            if isinstance(value, (int, float)) and not math.isfinite(value):
                return f"{key} = {value} at step {rec.get('step')}"
    return ""


def objective_of(run_dir: Path, objective_key: str) -> tuple[float | None, str]:
    """``(objective, "")`` for a job that trained, or ``(None, reason)``: the training went non-finite
    (:func:`nonfinite_training`), the run has no ``objective_key`` (naming the keys it has that
    resemble it), or the value is not finite."""
    import math

    unhealthy = nonfinite_training(run_dir)
    if unhealthy:
        return None, f"training went non-finite: {unhealthy}"
    metrics = job_metrics(run_dir)
    value = metrics.get(objective_key)
    if value is None:
        if (
            objective_key in ("perf/tokens_per_sec_mean", "perf/mfu_mean", "perf/step_time_s_mean")
            or objective_key.startswith("perf/")
            and objective_key.endswith("_mean")
        ):
            return None, f"no {objective_key}: no timed step (trainer.max_steps <= trainer.warmup_steps_excluded)"
        near = near_keys(objective_key, sorted(metrics))
        return None, f"the run logged no {objective_key}" + (f" (it has {', '.join(near)})" if near else "")
    if not math.isfinite(float(value)):
        return None, f"{objective_key} = {value} (not finite)"
    return float(value), ""


def record_job(run_dir: Path, status: str, reason: str = "", run_id: str | None = None) -> float | None:
    """Record the outcome of this process's current job (the driver calls it once per job);
    returns the job's objective (what an Optuna search optimises; :func:`objective_of`): None for a
    failed job, one whose training went non-finite, one without a finite objective, or one whose peak
    memory is over ``max_peak_mem_gib`` (a FAIL trial; the reason goes to the child run ``run_id``
    as tag ``sweep.fail_reason`` and to the sweep's table)."""
    from hydra.core.hydra_config import HydraConfig

    from framework.base.tracking import read_jsonl_metrics

    settings = _settings()
    objective_key = settings.get("objective") or "perf/tokens_per_sec_mean"
    limit = settings.get("max_peak_mem_gib")
    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    sweep = current()
    name = job_label(overrides, sweep.keys) if sweep else run_dir.name
    swept = [f"{k}={v}" for k, v in _values_of(overrides, sweep.keys).items()] if sweep else overrides
    peaks = [r["mem/peak_bytes"] for r in read_jsonl_metrics(run_dir / "metrics.jsonl") if "mem/peak_bytes" in r]
    peak = max(peaks) if peaks else None
    objective = None
    if status == "FINISHED":
        objective, reason = objective_of(run_dir, objective_key)
        if objective is not None and limit is not None and peak is not None and peak > float(limit) * GIB:
            reason = f"peak memory {peak / GIB:.3f} GiB > max_peak_mem_gib {float(limit):g}"
            objective = None
    outcome = JobOutcome(name, swept, status, reason, objective, peak)
    OUTCOMES.append(outcome)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / OUTCOME_FILE).write_text(json.dumps({**asdict(outcome), "pid": os.getpid(), "t": time.time()}))
    if reason and sweep is not None:
        print(f"trainlab: sweep job {name}: {status}: {reason}", file=sys.stderr, flush=True)
        if run_id and sweep.tracking_uri:
            try:
                _client(sweep.tracking_uri).set_tag(run_id, FAIL_REASON_TAG, reason)
            except Exception as err:  # tracking must not stop the sweep
                print(f"trainlab: warning: could not tag the job's run: {err}", file=sys.stderr)
    return objective


FAIL_REASON_TAG = "sweep.fail_reason"
"""Tag of a sweep's child run that scored no objective (a FAIL trial in a search): the one-line reason."""


def read_outcome(run_dir: Path) -> JobOutcome | None:
    """The :class:`JobOutcome` a job wrote in its run folder (:data:`OUTCOME_FILE`), None without one."""
    try:
        rec = json.loads((Path(run_dir) / OUTCOME_FILE).read_text())
    except (OSError, ValueError):
        return None
    rec.pop("pid", None)
    rec.pop("t", None)
    return JobOutcome(**rec)


def record_refused_job(cfg: DictConfig, run_dir: Path, reason: str) -> None:
    """A sweep job whose config the validation refused: ``run_dir/error.txt``, a FAILED child run
    with the one-line reason (tag ``error``), and a FAILED outcome. Never raises on a tracking error."""
    from hydra.core.hydra_config import HydraConfig

    from framework.base.tracking import DriverRun

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "error.txt").write_text(reason + "\n")
    record_job(run_dir, "FAILED", reason)
    sweep = current()
    tracking = cfg.get("tracking") or {}
    if sweep is None or sweep.parent_run_id is None or not tracking.get("enabled"):
        return
    overrides = list(HydraConfig.get().overrides.task)
    try:
        tracker = DriverRun(str(tracking.get("uri")), str(cfg.experiment_name))
        key = f"{cfg.experiment_name}/{cfg.run_name}"
        tracker.start(run_name=str(cfg.run_name), run_key=key, resume_run_id=tracker.find(key))
        attach_child(tracker, sweep, overrides)
        params = {}
        for line in overrides:
            k, _, v = line.partition("=")
            params[k.lstrip("+~")] = v
        tracker.log_params(params)
        tracker.set_tags({"error": reason, FAIL_REASON_TAG: reason})
        tracker.end("FAILED")
    except Exception as err:  # tracking must not stop the sweep
        print(f"trainlab: warning: could not record the refused job in MLflow: {err}", file=sys.stderr)


# --- the callback -----------------------------------------------------------------------------

_LOCK: list = []


class SweepCallback(Callback):
    """Hydra callback of every trainlab sweep (see the module docstring).

    Args:
        objective: the job metric a search optimises and the end-of-sweep report ranks by: any
            figure the run logs (``metrics.jsonl`` key, e.g. ``val/loss_final``, an end-of-run
            ``summary.json`` mean such as ``perf/tokens_per_sec_mean``, or a ``summary/*`` figure;
            :func:`job_metrics`).
        direction: ``maximize`` or ``minimize``; None: the Optuna sweeper's ``hydra.sweeper.direction``,
            else from the objective's name (:func:`objective_direction`).
        max_peak_mem_gib: a job whose ``mem/peak_bytes`` (max over ranks and steps) is over this
            many GiB scores no objective (a failed trial); None = no limit.
        report: run the compare report at the end of a sweep and log it to the parent run.

    Each job reads ``objective`` and ``max_peak_mem_gib`` from its own Hydra config
    (``hydra.callbacks.trainlab_sweep``) when it records its outcome (:func:`record_job`).
    """

    def __init__(
        self,
        objective: str = "perf/tokens_per_sec_mean",
        direction: str | None = None,
        max_peak_mem_gib: float | None = None,
        report: bool = True,
    ) -> None:
        self.objective = objective
        self.direction = direction
        self.max_peak_mem_gib = max_peak_mem_gib
        self.report = report
        self.sweep: Sweep | None = None
        self.started = 0.0  # when this sweep started (Unix seconds)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from framework.base.config import fail
        from framework.base.config.schema import ConfigError
        from framework.driver.repeats import REPEAT_KEY, repeat_values
        from framework.driver.repeats import install as install_repeats

        task = list(config.hydra.overrides.task)
        tasks = (config.hydra.get("launcher") or {}).get("tasks_per_node")
        if tasks is not None and str(tasks) != "1":
            fail(
                f"hydra.launcher.tasks_per_node={tasks}: trainlab runs one driver task per node, which starts that"
                " node's ranks itself; allowed: 1 (set the ranks with parallelism.world_size, parallelism.nnodes"
                " and parallelism.nproc_per_node)"
            )
        try:
            self.direction = objective_direction(self.objective, self.direction, config.hydra.sweeper.get("direction"))
        except ConfigError as err:
            fail(str(err))
        check_sweep(config, task)
        exclude = list(config.hydra.job.config.override_dirname.exclude_keys)
        params = _sweeper_params(config)
        sweep = parse_sweep(task, params, exclude)
        try:
            repeats = install_repeats(config)  # sweep.repeat first among the sweeper's params: the outer loop
        except ConfigError as err:
            fail(str(err))
        if repeats > 1:
            sweep.keys.append(REPEAT_KEY)
            sweep.values[REPEAT_KEY] = repeat_values(repeats)
        sweep.command = " ".join(["python -m framework.train", *sys.argv[1:]])
        _hold_lock(Path("outputs") / str(config.experiment_name) / sweep.name, "sweep")
        OUTCOMES.clear()
        SEARCH.clear()
        self.started = time.time()
        if config.tracking.enabled:
            try:
                sweep.tracking_uri = str(config.tracking.uri)
                sweep.parent_run_id = open_parent(
                    str(config.tracking.uri),
                    str(config.experiment_name),
                    sweep,
                    description=str(config.get("experiment_description") or ""),
                )
            except ConfigError as err:
                fail(str(err))
        self.sweep = sweep
        os.environ[SWEEP_ENV] = sweep.to_json()
        keys = ", ".join(f"{k}={v}" for k, v in sweep.values.items())
        print(
            f"trainlab: sweep {sweep.name!r} over {keys}; objective {self.objective} ({self.direction})"
            + (f"; parent MLflow run {sweep.parent_run_id}" if sweep.parent_run_id else ""),
            flush=True,
        )

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep = self.sweep
        if sweep is None:
            return
        # jobs a launcher ran in other processes (submitit: Slurm jobs) reported through their run folders
        remote = remote_outcomes(Path("outputs") / str(config.experiment_name) / sweep.name, self.started)
        OUTCOMES.extend(remote)
        FAILED_JOBS.extend(o.name for o in remote if o.status != "FINISHED")
        print("\n" + outcome_table(OUTCOMES, self.objective), flush=True)
        direction = self.direction or "maximize"
        best = best_outcome(OUTCOMES, direction)
        verdict_note = None
        if SEARCH.get("trials"):  # a search: its best trial
            if best is not None:
                print(
                    f"trainlab: best job {best.name}: {self.objective} = {best.objective:,.4g} ({direction})"
                    f" (overrides: {' '.join(best.overrides)})",
                    flush=True,
                )
        else:  # a sweep: per configuration, median of repeats, 95% CI, CV, verdict against the best
            from framework.driver.repeats import summary_table

            stats_table, best_line, verdict_note = summary_table(
                OUTCOMES, self.objective, maximize=direction != "minimize"
            )
            print("\n" + stats_table + ("\n" + best_line if best_line else ""), flush=True)
        failure = SEARCH.get("error", "")
        if failure:
            print(f"trainlab: error: the search failed: {failure}", file=sys.stderr, flush=True)
        if sweep.parent_run_id:
            uri = str(config.tracking.uri)
            if self.report:
                _report(uri, sweep)
            finish_parent(
                uri,
                sweep,
                OUTCOMES,
                self.objective,
                best,
                direction,
                status="FAILED" if failure else "FINISHED",
                reason=failure,
                verdict_note=verdict_note,
            )
            try:
                exp_id = _client(uri).get_run(sweep.parent_run_id).info.experiment_id
                print(
                    f"trainlab: the sweep in MLflow: parent run {sweep.parent_run_id};"
                    f" with `mlflow ui --backend-store-uri {uri}` open {ui_link(uri, exp_id, sweep.parent_run_id)};"
                    f" compare its experiment's runs: python -m framework.compare --experiment {config.experiment_name}"
                    + (f" --tracking-uri {uri}" if uri != "sqlite:///mlruns.db" else ""),
                    flush=True,
                )
            except Exception:  # the link is a convenience
                pass
        os.environ.pop(SWEEP_ENV, None)
        close_sweep()


SEARCH: dict[str, Any] = {}
"""What this process's search (:mod:`framework.driver.search`) concluded: ``trials``, ``complete``, ``failed``
and, when it did not complete within its failure budget or no trial completed, ``error`` (one line):
the sweep's end then fails the parent run with it and :func:`framework.driver.cli.main` exits 1. A search
within its budget exits 0 though some trials failed."""


def outcome_table(outcomes: Sequence[JobOutcome], objective: str) -> str:
    """The jobs of this sweep, one line each: name, status, objective, peak memory (GiB), then the reason of a failure."""
    from framework.base.tables import format_table

    rows = [
        {
            "job": o.name,
            "status": o.status,
            objective: o.objective,
            "peak_mem_GiB": None if o.peak_mem_bytes is None else o.peak_mem_bytes / GIB,
        }
        for o in outcomes
    ]
    cols = [("job", "", "", "s"), ("status", "", "", "s"), (objective, "", "", ",.4g"), ("peak_mem_GiB", "", "", ".3f")]
    lines = format_table(rows, cols, text_columns=2).splitlines()
    lines = [lines[0] + "  reason"] + [ln + (f"  {o.reason}" if o.reason else "") for ln, o in zip(lines[1:], outcomes)]
    finished = sum(o.status == "FINISHED" for o in outcomes)
    return f"sweep: {finished} of {len(outcomes)} job(s) FINISHED\n" + "\n".join(lines)


def best_outcome(outcomes: Sequence[JobOutcome], direction: str = "maximize") -> JobOutcome | None:
    """The job with the best objective in ``direction`` (``maximize``/``minimize``); None when none scored."""
    scored = [o for o in outcomes if o.objective is not None]
    if not scored:
        return None
    return (min if direction == "minimize" else max)(scored, key=lambda o: o.objective)


DIRECTIONS = ("maximize", "minimize")
_MINIMISED = ("loss", "time", "comm", "_s", "_ms", "bytes", "mem", "GiB", "wait", "bubble", "restarts", "recomputed")


def objective_direction(objective: str, explicit: str | None = None, sweeper: Any = None) -> str:
    """Whether the sweep's ``objective`` is maximised or minimised: ``explicit``
    (``hydra.callbacks.trainlab_sweep.direction``) when set, else the Optuna sweeper's
    ``hydra.sweeper.direction`` (``sweeper``; what the search optimises), else from the metric's name:
    a loss, a time (``_s``, ``_ms``), bytes, memory, a wait or bubble share, restarts or recomputed
    steps are minimised, everything else (tokens/s, MFU, goodput) maximised.

    Raises:
        ConfigError: a direction other than maximize/minimize, a multi-objective sweeper direction,
            or an explicit direction that disagrees with the sweeper's (one line).
    """
    from framework.base.config.schema import ConfigError

    if sweeper is not None and not isinstance(sweeper, str):  # a list: a multi-objective search
        values = [str(getattr(d, "name", d)) for d in sweeper]
        if len(values) != 1:
            raise ConfigError(
                f"hydra.sweeper.direction={values}: trainlab's sweeps have one objective"
                f" (hydra.callbacks.trainlab_sweep.objective={objective}); give one direction"
            )
        sweeper = values[0]
    for key, value in (("hydra.callbacks.trainlab_sweep.direction", explicit), ("hydra.sweeper.direction", sweeper)):
        if value is not None and str(value) not in DIRECTIONS:
            raise ConfigError(f"{key}={value!r}: allowed values are {', '.join(DIRECTIONS)}")
    if explicit and sweeper and explicit != sweeper:
        raise ConfigError(
            f"hydra.callbacks.trainlab_sweep.direction={explicit} but hydra.sweeper.direction={sweeper}:"
            " the search and the sweep's summary must rank one way (set one, or both alike)"
        )
    if explicit or sweeper:
        return str(explicit or sweeper)
    name = objective.rsplit("/", 1)[-1]
    return "minimize" if any(part in name for part in _MINIMISED) and "per_sec" not in name else "maximize"


def finish_parent(
    uri: str,
    sweep: Sweep,
    outcomes: Sequence[JobOutcome],
    objective: str,
    best: JobOutcome | None,
    direction: str = "maximize",
    status: str = "FINISHED",
    reason: str = "",
    verdict_note: str | None = None,
) -> None:
    """End the parent run with ``status`` (FINISHED, FAILED or KILLED): metrics ``sweep/jobs``,
    ``sweep/jobs_finished``, ``sweep/jobs_failed``, tag ``trainlab.jobs_finished``, the description
    (counts, the best job in ``direction``, or ``reason`` when the sweep ended early or failed: also
    tag ``sweep.error``) and tag ``sweep.best``. Counts are over the parent's children in MLflow (a
    resumed sweep counts the jobs of earlier invocations too), or this process's ``outcomes`` when
    it has more (jobs refused before MLflow). The description names ``verdict_note``
    (:func:`framework.driver.repeats.summary_table`: the best configuration and what is established against
    it) instead of the best job when given, then a table of the jobs (:func:`jobs_markdown`). Never raises."""
    try:
        client = _client(uri)
        children = sweep_children(client, sweep.parent_run_id)
        finished = sum(r.info.status == "FINISHED" for r in children)
        failed = sum(r.info.status == "FAILED" for r in children)
        jobs = len(children)
        if len(outcomes) > jobs:
            jobs, finished = len(outcomes), sum(o.status == "FINISHED" for o in outcomes)
            failed = sum(o.status == "FAILED" for o in outcomes)
        client.log_batch(
            sweep.parent_run_id,
            metrics=[
                _metric("sweep/jobs", jobs),
                _metric("sweep/jobs_finished", finished),
                _metric("sweep/jobs_failed", failed),
            ],
        )
        note = f"{finished} of {jobs} jobs FINISHED" + (f", {failed} FAILED" if failed else "")
        text = f"Sweep over {', '.join(sweep.keys)}: {note}."
        if SEARCH.get("trials"):
            text += (
                f" Search: {SEARCH['trials']} trials, {SEARCH['complete']} COMPLETE, {SEARCH['failed']} FAIL"
                f" (up to {SEARCH['budget']} may FAIL)."
            )
        if verdict_note:
            text += f" {verdict_note}"
        elif best is not None:
            text += f" Best ({objective}, {direction}): {best.name} = {best.objective:,.4g}."
        if reason:
            text += f" The sweep ended {status}: {reason}"
        if children:
            text += "\n\n" + jobs_markdown(children)
        tags = {"trainlab.jobs_finished": f"{finished}/{jobs}", "mlflow.note.content": text}
        if best is not None:
            tags["sweep.best"] = " ".join(best.overrides)
        if reason:
            tags["sweep.error"] = reason
        for k, v in tags.items():
            client.set_tag(sweep.parent_run_id, k, v)
        client.set_terminated(sweep.parent_run_id, status=status)
    except Exception as err:
        print(f"trainlab: warning: could not finalise the sweep's parent run: {err}", file=sys.stderr)


JOB_COLUMNS = (
    ("summary/tokens_per_sec", "tokens/s", ",.0f"),
    ("summary/mfu", "MFU", ".3g"),
    ("summary/step_time_ms", "step ms", ",.1f"),
    ("summary/peak_mem_GiB", "peak GiB", ".3g"),
)
"""The figures of each job in the parent's description: (child metric, column head, format)."""


def jobs_markdown(children: Sequence[Any]) -> str:
    """The sweep's jobs as a Markdown table for the parent run's description (MLflow renders it on the
    run's page): one row per child run (name, status, the :data:`JOB_COLUMNS` figures, a failure's
    reason), in name order; a figure a job did not log is ``-``."""
    head = ["job", "status", *(h for _, h, _ in JOB_COLUMNS), "reason"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in sorted(children, key=lambda r: r.info.run_name or ""):
        figures = [format(c.data.metrics[k], f) if k in c.data.metrics else "-" for k, _, f in JOB_COLUMNS]
        reason = (c.data.tags.get("error") or "").replace("|", "/").replace("\n", " ")
        lines.append("| " + " | ".join([c.info.run_name or c.info.run_id, c.info.status, *figures, reason]) + " |")
    return "\n".join(lines)


def _metric(key: str, value: float) -> Any:
    import time

    from mlflow.entities import Metric

    return Metric(key, float(value), int(time.time() * 1000), 0)


def _report(uri: str, sweep: Sweep) -> None:
    """The compare report of the sweep's children, logged to the parent (never raises)."""
    try:
        from framework.driver.compare import main as compare_main

        compare_main(["--parent-run", sweep.parent_run_id, "--tracking-uri", uri, "--quiet"])
    except Exception as err:
        print(f"trainlab: warning: the sweep's compare report failed: {err}", file=sys.stderr)


def close_sweep(status: str | None = None, reason: str = "") -> None:
    """Release the sweep's lock; with ``status`` (the sweep ended early: KILLED or FAILED) also end
    its parent run with it, the one-line ``reason`` and the counts of its jobs (:func:`finish_parent`).
    Called at the end of a sweep and by :func:`framework.driver.cli.main` on every early exit."""
    sweep = current()
    os.environ.pop(SWEEP_ENV, None)
    if status and sweep is not None and sweep.parent_run_id:
        finish_parent(sweep.tracking_uri, sweep, OUTCOMES, "", None, status=status, reason=reason or "ended early")
    while _LOCK:
        _LOCK.pop().close()


def _hold_lock(folder: Path, what: str) -> None:
    """Hold ``folder/.trainlab.lock`` (exit code 2, one line naming the other process, when held)."""
    f = hold_lock(folder, what)
    _LOCK.append(f)
