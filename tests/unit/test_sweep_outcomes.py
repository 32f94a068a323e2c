"""What a sweep concludes: the best job in the objective's direction, a job's objective (any logged
figure, non-finite training refused), the parent run ended on every path, the compare table replaced
(framework/driver/sweep.py, framework/driver/compare.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from framework.base.config.schema import ConfigError
from framework.driver.sweep import JobOutcome, best_outcome, nonfinite_training, objective_direction, objective_of


def _outcomes() -> list[JobOutcome]:
    # the lr sweep: Optuna (minimize) named lr=3e-3 (6.1552); the max picked lr=1e-4 (6.2293)
    return [
        JobOutcome("lr=0.0001", ["optim.lr=0.0001"], "FINISHED", objective=6.2293),
        JobOutcome("lr=0.003", ["optim.lr=0.003"], "FINISHED", objective=6.1552),
        JobOutcome("lr=0.1", ["optim.lr=0.1"], "FINISHED", reason="training went non-finite", objective=None),
        JobOutcome("lr=0", ["optim.lr=0"], "FAILED", reason="optim.lr must be > 0"),
    ]


def test_the_best_job_follows_the_direction():
    assert best_outcome(_outcomes(), "minimize").name == "lr=0.003"
    assert best_outcome(_outcomes(), "maximize").name == "lr=0.0001"
    assert best_outcome(_outcomes()[2:], "minimize") is None  # none scored


@pytest.mark.parametrize(
    "objective, explicit, sweeper, expected",
    [
        ("val/loss_final", None, None, "minimize"),
        ("train/loss_final", None, None, "minimize"),
        ("perf/step_time_s_mean", None, None, "minimize"),
        ("summary/peak_mem_GiB", None, None, "minimize"),
        ("perf/tokens_per_sec_mean", None, None, "maximize"),
        ("perf/mfu_mean", None, None, "maximize"),
        ("goodput", None, None, "maximize"),
        ("perf/tokens_per_sec_mean", None, "minimize", "minimize"),  # what the Optuna search does wins over the name
        ("val/loss_final", "maximize", None, "maximize"),
        ("val/loss_final", "minimize", ["minimize"], "minimize"),
    ],
)
def test_the_direction_comes_from_the_setting_the_sweeper_or_the_metric(objective, explicit, sweeper, expected):
    assert objective_direction(objective, explicit, sweeper) == expected


@pytest.mark.parametrize(
    "explicit, sweeper, message",
    [
        ("up", None, "hydra.callbacks.trainlab_sweep.direction='up': allowed values are maximize, minimize"),
        (
            "maximize",
            "minimize",
            "hydra.callbacks.trainlab_sweep.direction=maximize but hydra.sweeper.direction=minimize",
        ),
        (None, ["minimize", "maximize"], "trainlab's sweeps have one objective"),
    ],
)
def test_a_bad_or_conflicting_direction_is_one_line(explicit, sweeper, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")) as err:
        objective_direction("val/loss_final", explicit, sweeper)
    assert "\n" not in str(err.value)


def _run_dir(tmp_path: Path, records: list[dict], summary: dict | None = None, faults: list[dict] = ()) -> Path:
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if summary is not None:
        (tmp_path / "summary.json").write_text(json.dumps(summary))
    (tmp_path / "faults.jsonl").write_text("".join(json.dumps(r) + "\n" for r in faults))
    return tmp_path


def test_every_end_of_run_metric_can_be_the_objective(tmp_path):
    run = _run_dir(
        tmp_path,
        [
            {"step": 2, "train/loss": 6.5, "val/loss": 6.6},
            {"step": 4, "train/loss": 6.3, "val/loss": 6.4},
            {
                "step": 4,
                "val/loss_initial": 6.9,
                "val/loss_final": 6.4,
                "train/loss_final": 6.3,
                "mem/peak_bytes": 2**30,
            },
        ],
        {"perf/tokens_per_sec_mean": 1234.5, "train/steps": 4, "perf/step_time_s_mean": 0.25},
    )
    assert objective_of(run, "val/loss_final") == (6.4, "")  # a metrics.jsonl figure, not in summary.json
    assert objective_of(run, "perf/tokens_per_sec_mean") == (1234.5, "")
    assert objective_of(run, "summary/step_time_ms") == (250.0, "")
    assert objective_of(run, "summary/peak_mem_GiB") == (1.0, "")
    value, reason = objective_of(run, "val/loss_fnal")
    assert value is None and reason == "the run logged no val/loss_fnal (it has val/loss_final, val/loss_initial)"


def test_a_run_whose_training_went_non_finite_scores_nothing(tmp_path):
    run = _run_dir(
        tmp_path,
        [{"step": 2, "train/loss": 6.5}, {"step": 4, "train/loss": math.nan, "train/grad_norm": math.nan}],
        {"perf/tokens_per_sec_mean": 999.0},
    )  # the throughput of a NaN run is a normal number
    assert nonfinite_training(run) == "train/loss = nan at step 4"
    assert objective_of(run, "perf/tokens_per_sec_mean") == (
        None,
        "training went non-finite: train/loss = nan at step 4",
    )


def test_a_step_the_guard_dropped_does_not_count_but_a_non_finite_objective_does(tmp_path):
    run = _run_dir(
        tmp_path,
        [
            {"step": 2, "train/loss": 6.5, "train/grad_norm": math.nan},
            {"step": 4, "train/loss": 6.3},
            {"step": 4, "val/loss_final": math.inf},
        ],
        {},
        faults=[{"ev": "detected", "detector": "nonfinite_grad", "step": 2, "action": "skip_step"}],
    )
    assert nonfinite_training(run) == "val/loss_final = inf at step 4"
    (run / "metrics.jsonl").write_text(
        json.dumps({"step": 2, "train/loss": 6.5, "train/grad_norm": math.nan})
        + "\n"
        + json.dumps({"step": 4, "train/loss": 6.3, "perf/hfu_mean": math.nan})
        + "\n"
    )
    assert nonfinite_training(run) == ""  # the skipped step's NaN norm is the value the guard judged
    assert objective_of(run, "perf/hfu_mean") == (None, "perf/hfu_mean = nan (not finite)")
    assert objective_of(run, "perf/tokens_per_sec_mean")[1] == (
        "no perf/tokens_per_sec_mean: no timed step (trainer.max_steps <= trainer.warmup_steps_excluded)"
    )
