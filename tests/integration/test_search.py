"""The Optuna search end to end (``hydra/sweeper=optuna``) and a sweep that dies in its sweeper.

A 4-trial grid on 2 ranks (gpt_tiny, 4 steps) whose points hold an invalid layout (ddp: global batch 2
does not divide into micro-batch 2 x 2 ranks) and a NaN fault (rank 1's gradients in step 2, no
recovery): it completes within its failure budget, exit 0, with the COMPLETE/FAIL counts, the best
trial under ``minimize`` of ``val/loss_final`` (an end-of-run metric that is not in summary.json),
the reasons on the trials (SQLite study) and the child runs, and a closed parent run.
"""

from __future__ import annotations

import optuna
import pytest
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from framework.driver.search import FAIL_REASON_ATTR, study_storage
from tests.integration.conftest import Runner

pytestmark = pytest.mark.slow

SEARCH = [
    "-m",
    "hydra/sweeper=optuna",
    "hydra/sweeper/sampler=grid",
    "hydra.sweeper.direction=minimize",
    "hydra.sweeper.n_trials=4",
    "hydra.sweeper.n_jobs=1",
    "hydra.sweeper.study_name=grid",
    "hydra.callbacks.trainlab_sweep.objective=val/loss_final",
]
TINY = [
    "parallelism.world_size=2",
    "trainer.global_batch_size=2",
    "trainer.micro_batch_size=2",
    "trainer.max_steps=4",
    "trainer.warmup_steps_excluded=0",
    "trainer.val_sequences=8",
    "checkpoint=none",
    "tracking.system_metrics_interval_s=0",
]


def _runs(runner: Runner, experiment: str):
    client = MlflowClient(tracking_uri=f"sqlite:///{runner.workdir}/mlruns.db")
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("trainlab.sweep") == "parent"]
    return parent, {r.data.tags["trainlab.swept"]: r for r in runs if r is not parent}  # by swept key=value


def test_a_grid_with_an_invalid_layout_and_a_nan_fault_completes_and_names_the_best(runner):
    storage = f"sqlite:///{runner.workdir}/study.db"
    proc = runner.run(
        *SEARCH,
        f"hydra.sweeper.storage={storage}",
        "hydra.sweeper.max_failure_rate=0.75",
        "parallelism=choice(ddp,tp)",
        "resilience=choice(skip_step,none)",
        "fault=nan_grad",
        "fault.events=[{kind:nan_grad,step:2,ranks:[1]}]",
        "experiment_name=grid",
        *TINY,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    study = optuna.load_study(study_name="grid", storage=study_storage(storage))
    by_point = {(t.params["parallelism"], t.params["resilience"]): t for t in study.trials}
    assert {p: t.state.name for p, t in by_point.items()} == {
        ("tp", "skip_step"): "COMPLETE",
        ("tp", "none"): "FAIL",
        ("ddp", "skip_step"): "FAIL",
        ("ddp", "none"): "FAIL",
    }
    nan_reason = by_point["tp", "none"].user_attrs[FAIL_REASON_ATTR]
    assert nan_reason.startswith("training went non-finite: train/loss = nan at step ")
    layout_reason = by_point["ddp", "none"].user_attrs[FAIL_REASON_ATTR]
    assert (
        layout_reason == "FAILED: trainer.global_batch_size=2 is not divisible by micro_batch_size 2 x dp_degree 2 = 4"
    )
    parent, children = _runs(runner, "grid")
    best = children["parallelism=tp,resilience=skip_step"]
    assert study.best_trial.value == pytest.approx(best.data.metrics["val/loss_final"])
    assert parent.info.status == "FINISHED" and parent.data.tags["sweep.best"] == "parallelism=tp resilience=skip_step"
    assert "Search: 4 trials, 1 COMPLETE, 3 FAIL (up to 3 may FAIL)." in parent.data.tags["mlflow.note.content"]
    assert children["parallelism=tp,resilience=none"].data.tags["sweep.fail_reason"] == nan_reason
    assert children["parallelism=ddp,resilience=none"].data.tags["sweep.fail_reason"] in layout_reason
    assert "trainlab: best job parallelism=tp,resilience=skip_step: val/loss_final = " in proc.stdout
    results = OmegaConf.load(runner.workdir / "outputs" / "grid" / "optimization_results.yaml")
    assert results.best_params == {"parallelism": "tp", "resilience": "skip_step"} and results.n_failed == 3


def test_a_search_over_its_failure_budget_exits_1_and_fails_the_parent(runner):
    # micro-batch 2 does not divide the global batch of 1 (refused layouts, no rank starts); the second FAIL is over 0.25 x 4 = 1
    proc = runner.run(
        *SEARCH,
        "hydra.sweeper.max_failure_rate=0.25",
        "trainer.micro_batch_size=choice(1,2)",
        "parallelism=choice(ddp,zero1)",
        "trainer.global_batch_size=1",
        "parallelism.world_size=1",
        "experiment_name=budget",
        *[
            o
            for o in TINY
            if not o.startswith(("trainer.micro_batch_size", "trainer.global_batch_size", "parallelism.world_size"))
        ],
        check=False,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "trainlab: error: the search failed: 2 of " in proc.stderr
    assert "trials FAILED, over max_failure_rate 0.25 x n_trials 4 = 1; the search stopped" in proc.stderr
    parent, children = _runs(runner, "budget")
    assert 2 <= len(children) <= 4 and parent.info.status == "FAILED"
    assert parent.data.tags["sweep.error"].startswith("2 of ")
    assert parent.data.metrics["sweep/jobs_failed"] == 2
    assert not (runner.workdir / "outputs" / "budget" / "optimization_results.yaml").exists()


def test_a_sweep_whose_sweeper_raises_ends_its_parent_failed_with_the_reason(runner):
    proc = runner.run(
        *SEARCH,
        "hydra.sweeper.storage=nosuchdb://x/y",
        "optim.lr=choice(1e-3,3e-3)",
        "experiment_name=broken",
        "trainer.micro_batch_size=1",
        *[o for o in TINY if not o.startswith("trainer.micro_batch_size")],
        check=False,
    )
    assert proc.returncode == 1
    parent, children = _runs(runner, "broken")
    assert parent.info.status == "FAILED" and not children
    assert parent.data.tags["sweep.error"].startswith(
        "NoSuchModuleError: Can't load plugin: sqlalchemy.dialects:nosuchdb"
    )
    assert parent.data.metrics["sweep/jobs"] == 0
    assert "trainlab: the sweep ended FAILED: NoSuchModuleError" in proc.stderr
