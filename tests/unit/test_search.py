"""The Optuna search's loop (framework/driver/search.py): FAIL trials with reasons, the failure budget over
``n_trials``, a grid whose last point fails, SQLite storage; with a launcher that returns Hydra
``JobReturn``s as trainlab's jobs do (an objective, None with the reason in the job's outcome file,
or an exception), so no job runs."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import optuna
import pytest
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

from framework.driver import sweep
from framework.driver.search import FAIL_REASON_ATTR, OptunaSearch, study_storage


class FakeLauncher:
    """Runs each trial's overrides through ``job(call_index, {key: value})`` -> a float, None (reason in the
    outcome file, as :func:`framework.driver.sweep.record_job` writes it) or an exception (the job raised)."""

    def __init__(self, tmp: Path, job) -> None:
        self.tmp, self.job, self.calls = tmp, job, 0

    def launch(self, overrides, initial_job_idx):
        returns = []
        for line in overrides:
            params = dict(o.split("=", 1) for o in line)
            out = self.tmp / f"job{self.calls}"
            out.mkdir()
            result = self.job(self.calls, params)
            self.calls += 1
            ret = JobReturn(
                overrides=list(line), hydra_cfg=OmegaConf.create({"hydra": {"runtime": {"output_dir": str(out)}}})
            )
            if isinstance(result, Exception):
                ret.status, ret._return_value = JobStatus.FAILED, result
            elif isinstance(result, tuple):  # (None, reason): the job recorded why it scored nothing
                (out / sweep.OUTCOME_FILE).write_text(
                    json.dumps(
                        {"name": "j", "overrides": [], "status": "FINISHED", "reason": result[1], "objective": None}
                    )
                )
                ret.status, ret._return_value = JobStatus.COMPLETED, None
            else:
                ret.status, ret._return_value = JobStatus.COMPLETED, result
            returns.append(ret)
        return returns


def _search(tmp: Path, job, *, n_trials=4, rate=0.75, storage=None, grid=True) -> tuple[OptunaSearch, FakeLauncher]:
    sampler = functools.partial(optuna.samplers.GridSampler) if grid else optuna.samplers.RandomSampler(seed=0)
    search = OptunaSearch(sampler, "minimize", storage, "t", n_trials, 1, rate, None, None, None)
    search.launcher = FakeLauncher(tmp, job)
    search.config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp / "sweep")}}})
    search.job_idx = 0
    sweep.SEARCH.clear()
    return search, search.launcher


def _job(call: int, params: dict):
    """By launch order (the grid's order is the sampler's): a score, a NaN, no objective, then the last raises."""
    if call == 1:
        return math.nan  # a NaN objective
    if call == 2:
        return (None, "training went non-finite: train/loss = nan at step 4")
    if call == 3:
        return RuntimeError("rank 1 died\nmore")  # the grid's last trial fails
    return float(params["x"])


def test_failed_trials_are_fail_with_their_reason_and_the_search_completes_within_budget(tmp_path):
    search, launcher = _search(tmp_path, _job, storage=f"sqlite:///{tmp_path}/study.db")
    search.sweep(["x=choice(1,2,3,4)"])
    study = optuna.load_study(study_name="t", storage=study_storage(f"sqlite:///{tmp_path}/study.db"))
    trials = sorted(study.trials, key=lambda t: t.number)
    assert launcher.calls == 4 and [t.state.name for t in trials] == ["COMPLETE", "FAIL", "FAIL", "FAIL"]
    assert [t.user_attrs.get(FAIL_REASON_ATTR) for t in trials] == [
        None,
        "the objective is nan (not finite)",
        "training went non-finite: train/loss = nan at step 4",
        "the job raised RuntimeError: rank 1 died",
    ]
    assert sorted(t.params["x"] for t in trials) == [1, 2, 3, 4]  # every grid point ran, the last one failed
    assert sweep.SEARCH["failed"] == 3 and "error" not in sweep.SEARCH
    results = OmegaConf.load(tmp_path / "sweep" / "optimization_results.yaml")
    assert results.best_value == study.best_value == trials[0].value and results.n_failed == 3


def test_over_the_failure_budget_the_search_stops_and_fails(tmp_path):
    # max_failure_rate 0.25 of 8 trials: up to 2 may FAIL; the third FAIL stops the search
    search, launcher = _search(tmp_path, lambda call, p: (None, "no objective"), n_trials=8, rate=0.25, grid=False)
    search.sweep(["x=interval(0,1)"])
    assert launcher.calls == 3
    assert sweep.SEARCH["error"] == (
        "3 of 3 trials FAILED, over max_failure_rate 0.25 x n_trials 8 = 2; the search stopped"
    )
    assert not (tmp_path / "sweep" / "optimization_results.yaml").exists()


def test_a_search_without_a_complete_trial_fails_even_within_budget(tmp_path):
    search, _ = _search(tmp_path, lambda call, p: (None, "no objective"), n_trials=2, rate=1.0)
    search.sweep(["x=choice(1,2)"])
    assert sweep.SEARCH["error"] == "no trial COMPLETE (2 of 2 FAILED)"


def test_a_sqlite_study_is_created_and_continued(tmp_path):
    url = f"sqlite:///{tmp_path}/s.db"
    for n in (1, 2):
        study = optuna.create_study(study_name="s", storage=study_storage(url), load_if_exists=True)
        study.tell(study.ask(), 1.0)
        assert len(study.trials) == n
    assert study_storage(None) is None and study_storage("postgresql://h/db") == "postgresql://h/db"


@pytest.mark.parametrize("rate", [0.0])
def test_a_nan_objective_with_no_budget_stops_at_once(tmp_path, rate):
    search, launcher = _search(tmp_path, lambda call, p: math.nan, n_trials=3, rate=rate)
    search.sweep(["x=choice(1,2,3)"])
    assert launcher.calls == 1 and "over max_failure_rate 0 x n_trials 3 = 0" in sweep.SEARCH["error"]
