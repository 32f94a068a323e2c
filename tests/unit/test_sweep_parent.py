"""A sweep's parent MLflow run on a local store: ended with status, reason and counts on an early exit,
the best job in the objective's direction on its tag, and a compare table that a second report
replaces instead of appending to (framework/driver/sweep.py, framework/driver/compare.py)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from mlflow.tracking import MlflowClient

from framework.base.tracking import PARENT_TAG
from framework.driver import sweep
from framework.driver.compare import log_to_run


@pytest.fixture()
def store(tmp_path, empty_mlflow_store):
    shutil.copyfile(empty_mlflow_store, tmp_path / "mlruns.db")
    uri = f"sqlite:///{tmp_path}/mlruns.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("e", artifact_location=str(tmp_path / "artifacts"))
    return uri, client, exp


def _parent_with_children(client, exp, statuses):
    parent = client.create_run(exp, run_name="sweep").info.run_id
    for i, status in enumerate(statuses):
        child = client.create_run(exp, run_name=f"job{i}", tags={PARENT_TAG: parent, "trainlab.run_key": f"e/s/job{i}"})
        client.set_terminated(child.info.run_id, status=status)
    return parent


def test_an_early_exit_ends_the_parent_with_reason_and_counts(store, monkeypatch):
    uri, client, exp = store
    parent = _parent_with_children(client, exp, ["FINISHED", "FAILED", "FAILED"])
    s = sweep.Sweep(
        name="s", keys=["optim.lr"], values={"optim.lr": "1e-3,3e-3,1e-2"}, parent_run_id=parent, tracking_uri=uri
    )
    monkeypatch.setenv(sweep.SWEEP_ENV, s.to_json())
    sweep.OUTCOMES.clear()
    sweep.SEARCH.clear()  # another test's search may have left its counts
    sweep.close_sweep("FAILED", "AssertionError: optuna storage (exit 1)")
    run = client.get_run(parent)
    assert run.info.status == "FAILED"
    assert run.data.tags["sweep.error"] == "AssertionError: optuna storage (exit 1)"
    assert run.data.metrics == {"sweep/jobs": 3, "sweep/jobs_finished": 1, "sweep/jobs_failed": 2}
    summary, _, jobs = run.data.tags["mlflow.note.content"].partition("\n\n")
    assert summary == (
        "Sweep over optim.lr: 1 of 3 jobs FINISHED, 2 FAILED. The sweep ended"
        " FAILED: AssertionError: optuna storage (exit 1)"
    )
    assert len(jobs.splitlines()) == 2 + 3  # then the jobs table: a header, its rule and a row per child
    assert sweep.current() is None and sweep.SWEEP_ENV not in os.environ


def test_the_parent_names_the_best_job_in_the_objectives_direction(store):
    uri, client, exp = store
    parent = _parent_with_children(client, exp, ["FINISHED", "FINISHED"])
    s = sweep.Sweep(
        name="s", keys=["optim.lr"], values={"optim.lr": "1e-4,3e-3"}, parent_run_id=parent, tracking_uri=uri
    )
    outcomes = [
        sweep.JobOutcome("lr=0.0001", ["optim.lr=0.0001"], "FINISHED", objective=6.2293),
        sweep.JobOutcome("lr=0.003", ["optim.lr=0.003"], "FINISHED", objective=6.1552),
    ]
    best = sweep.best_outcome(outcomes, "minimize")
    sweep.finish_parent(uri, s, outcomes, "val/loss_final", best, "minimize")
    run = client.get_run(parent)
    assert run.info.status == "FINISHED" and run.data.tags["sweep.best"] == "optim.lr=0.003"
    assert "Best (val/loss_final, minimize): lr=0.003 = 6.155." in run.data.tags["mlflow.note.content"]


def test_a_second_report_replaces_the_compare_table(store, tmp_path):
    uri, client, exp = store
    run = client.create_run(exp).info.run_id
    cols = [("job", "", "job", "s"), ("tokens_per_sec", "", "tokens_per_sec", ",.0f")]
    for tps in (100.0, 120.0):  # the sweep, then the same sweep run again
        log_to_run(
            client, run, [], [], [{"job": "a", "tokens_per_sec": tps}, {"job": "b", "tokens_per_sec": 2 * tps}], cols
        )
    table = json.loads((tmp_path / "artifacts" / run / "artifacts" / "compare.json").read_text())
    assert table["columns"] == ["job", "tokens_per_sec"] and table["data"] == [["a", 120.0], ["b", 240.0]]
    assert json.loads(client.get_run(run).data.tags["mlflow.loggedArtifacts"]) == [
        {"path": "compare.json", "type": "table"}
    ]
