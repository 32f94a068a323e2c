"""An Optuna search over trainlab jobs (``hydra/sweeper=optuna``), with trainlab's failure semantics.

Hydra's Optuna sweeper (``hydra-optuna-sweeper``: search space, samplers, ``params``, grid
handling) is used as it is, except for the loop that hands each job's result to the study,
which :class:`OptunaSearch` (a subclass of its implementation) replaces:

- A trial is COMPLETE only with a finite objective from a job whose training stayed finite
  (:func:`framework.driver.sweep.objective_of`); otherwise it is FAIL, with its one-line reason as the
  trial's user attribute ``fail_reason`` (and the child run's tag ``sweep.fail_reason``). The
  library's loop tells the study a NaN as COMPLETE, which Optuna refuses, then tells it FAIL *with*
  the NaN, which Optuna refuses again: the exception ended the search with the trial RUNNING.
- ``max_failure_rate`` is the share of ``n_trials`` that may FAIL (the library: per batch of
  ``n_jobs``, so one failed trial of a one-job batch stopped any search under 1.0). The search
  goes on while ``failed <= floor(max_failure_rate x n_trials)``; past it, it stops asking for
  trials. Within the budget, with at least one COMPLETE trial, it writes
  ``<sweep dir>/optimization_results.yaml`` (best params and value, trial counts) and the command
  exits 0; otherwise the sweep's parent run ends FAILED with the reason and the command exits 1
  (:data:`framework.driver.sweep.SEARCH`).
- A grid (``sampler=grid``) whose last point fails ends as a grid that completes (Optuna's
  GridSampler stops the study from its ``after_trial`` hook, which raises outside ``optimize``).
- ``storage=sqlite:///...`` works with SQLAlchemy 2 (:func:`study_storage`).

The Hydra plugin class is :class:`hydra_plugins.trainlab_search.TrainlabOptunaSweeper` (Hydra loads
sweepers only from the ``hydra_plugins`` package); :func:`framework.driver.cli.register_optuna_sweeper`
stores its config as the ``hydra/sweeper=optuna`` option, over the library's.
"""

from __future__ import annotations

import functools
import logging
import math
from pathlib import Path
from typing import Any

import optuna
from hydra_plugins.hydra_optuna_sweeper._impl import OptunaSweeperImpl, create_params_from_overrides
from omegaconf import OmegaConf

log = logging.getLogger(__name__)

FAIL_REASON_ATTR = "fail_reason"
"""The user attribute of a FAIL trial: why it scored nothing (one line)."""


def study_storage(url: Any) -> Any:
    """The study's storage for ``hydra.sweeper.storage``: None (in memory) and non-SQLite URLs as
    given; for ``sqlite:///...`` an ``optuna.storages.RDBStorage`` on a database whose schema
    version is stamped first in a committed transaction. (optuna 2.10, the last that
    hydra-optuna-sweeper admits, stamps it on a connection it never commits; SQLAlchemy 2 has no
    autocommit, so the stamp was rolled back and optuna's schema check failed with a bare
    ``AssertionError``.)"""
    if not isinstance(url, str) or not url.startswith("sqlite:"):
        return url
    from alembic.migration import MigrationContext
    from optuna.storages._rdb import models
    from optuna.storages._rdb.storage import _VersionManager
    from sqlalchemy import create_engine

    engine = create_engine(url)
    try:
        models.BaseModel.metadata.create_all(engine)
        versions = _VersionManager.__new__(_VersionManager)  # only its alembic script (no connection of its own)
        versions.url, versions.engine = url, engine
        script = versions._create_alembic_script()
        with engine.begin() as connection:
            context = MigrationContext.configure(connection)
            if context.get_current_revision() is None:
                context.stamp(script, script.get_current_head())
    finally:
        engine.dispose()
    return optuna.storages.RDBStorage(url)


def trial_result(ret: Any) -> tuple[float | None, str]:
    """``(objective, "")`` of a finished job (a Hydra ``JobReturn``), or ``(None, reason)``: the job
    raised, returned nothing (its reason from the outcome it recorded in its output folder,
    :func:`framework.driver.sweep.read_outcome`) or a value that is not a finite number."""
    from hydra.core.utils import JobStatus

    from framework.driver.sweep import read_outcome

    if ret.status != JobStatus.COMPLETED:
        err = getattr(ret, "_return_value", None)
        lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
        return None, f"the job raised {type(err).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    value = ret.return_value
    if value is None:
        outcome = None
        try:
            outcome = read_outcome(Path(ret.hydra_cfg.hydra.runtime.output_dir))
        except Exception:
            pass
        if outcome is not None and outcome.reason:
            return None, outcome.reason if outcome.status == "FINISHED" else f"{outcome.status}: {outcome.reason}"
        return None, "the job returned no objective"
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None, f"the job returned {value!r}, not a number"
    if not math.isfinite(value):
        return None, f"the objective is {value} (not finite)"
    return value, ""


class OptunaSearch(OptunaSweeperImpl):
    """The library's Optuna sweeper with trainlab's ask/launch/tell loop (see the module docstring);
    same arguments (``hydra.sweeper.*``)."""

    def sweep(self, arguments: list[str]) -> None:
        from framework.driver.sweep import SEARCH

        self._process_searchspace_config()
        distributions, fixed = create_params_from_overrides(self._parse_sweeper_params_config() + list(arguments))
        space = dict(self.search_space_distributions or {})
        space.update(distributions)
        if isinstance(self.sampler, functools.partial) and self.sampler.func == optuna.samplers.GridSampler:
            grid = {name: self._to_grid_sampler_choices(d) for name, d in space.items()}
            self.sampler = self.sampler(grid)
            self.n_trials = min(self.n_trials, math.prod(len(v) for v in grid.values()))
        for name in fixed:
            space.pop(name, None)
        directions = self._get_directions()
        study = optuna.create_study(
            study_name=self.study_name,
            storage=study_storage(self.storage),
            sampler=self.sampler,
            directions=directions,
            load_if_exists=True,
        )
        budget = math.floor(self.max_failure_rate * self.n_trials + 1e-9)
        SEARCH.update(trials=0, complete=0, failed=0, budget=budget, study=study.study_name)
        while SEARCH["trials"] < self.n_trials and SEARCH["failed"] <= budget:
            trials = [study.ask() for _ in range(min(self.n_jobs, self.n_trials - SEARCH["trials"]))]
            overrides = self._configure_trials(trials, space, fixed)
            returns = self.launcher.launch(overrides, initial_job_idx=self.job_idx)
            self.job_idx += len(returns)
            for trial, ret in zip(trials, returns):
                value, reason = trial_result(ret)
                SEARCH["trials"] += 1
                SEARCH["complete" if value is not None else "failed"] += 1
                if value is None:
                    trial.set_user_attr(FAIL_REASON_ATTR, reason)
                    log.warning(f"trial {trial.number} FAIL: {reason}")
                self._tell(study, trial, value)
        self._conclude(study, directions)

    @staticmethod
    def _tell(study: Any, trial: Any, value: float | None) -> None:
        """COMPLETE with ``value``, or FAIL (no value). The grid sampler's stop at the end of its
        grid is expected here (the study is not in ``optimize``) and ends nothing early."""
        state = optuna.trial.TrialState.COMPLETE if value is not None else optuna.trial.TrialState.FAIL
        try:
            study.tell(trial, state=state, values=[value] if value is not None else None)
        except RuntimeError as err:
            if "Study.stop" not in str(err):
                raise

    def _conclude(self, study: Any, directions: list[str]) -> None:
        """The search's verdict in :data:`framework.driver.sweep.SEARCH`, one summary line, and
        ``optimization_results.yaml`` when it completed within its failure budget."""
        from framework.driver.sweep import SEARCH

        done, failed, budget = SEARCH["trials"], SEARCH["failed"], SEARCH["budget"]
        line = (
            f"trainlab: search {study.study_name!r}: {done} trial(s), {SEARCH['complete']} COMPLETE, {failed} FAIL"
            f" (max_failure_rate {self.max_failure_rate:g} of n_trials {self.n_trials}: up to {budget} may FAIL)"
        )
        if failed > budget:
            SEARCH["error"] = (
                f"{failed} of {done} trials FAILED, over max_failure_rate {self.max_failure_rate:g} x"
                f" n_trials {self.n_trials} = {budget}; the search stopped"
            )
        elif not any(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials):
            SEARCH["error"] = f"no trial COMPLETE ({failed} of {done} FAILED)"
        print(line, flush=True)
        if "error" in SEARCH:
            return
        results: dict[str, Any] = {
            "name": "optuna",
            "n_trials": done,
            "n_complete": SEARCH["complete"],
            "n_failed": failed,
        }
        if len(directions) == 1:
            best = study.best_trial
            results.update(best_params=best.params, best_value=best.value, best_trial=best.number)
            SEARCH.update(best_params=dict(best.params), best_value=best.value)
            print(
                f"trainlab: search best trial #{best.number} ({directions[0]}): value {best.value:.6g},"
                f" params {best.params}",
                flush=True,
            )
        else:
            results["solutions"] = [{"params": t.params, "values": t.values} for t in study.best_trials]
        Path(self.config.hydra.sweep.dir).mkdir(parents=True, exist_ok=True)
        OmegaConf.save(OmegaConf.create(results), f"{self.config.hydra.sweep.dir}/optimization_results.yaml")
