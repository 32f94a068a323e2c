"""Step-time breakdown, comm bytes and memory on real runs, and the compare report over them.

One 2-run sweep (``single`` with 4 micro-batches per step, ``ddp`` on 2 gloo ranks with 2),
checkpoints on, then ``python -m framework.compare`` on its MLflow store.
"""

from __future__ import annotations

import csv
import math
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from framework.rank.callbacks.breakdown import CATEGORIES

pytestmark = pytest.mark.slow

EXPERIMENT = "perf"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, data_cache):
    from tests.integration.conftest import Runner, job_runs

    runner = Runner(tmp_path_factory.mktemp("perf"), data_cache)
    runner.run(
        "-m",
        "parallelism=single,ddp",
        f"experiment_name={EXPERIMENT}",
        "trainer.max_steps=12",
        "trainer.log_every_n_steps=4",
        "trainer.global_batch_size=8",
        "trainer.micro_batch_size=2",
        "checkpoint.every_n_steps=6",
        "trainer.val_sequences=16",
        "tracking.system_metrics_interval_s=1",
    )
    client = MlflowClient(tracking_uri=f"sqlite:///{runner.workdir}/mlruns.db")
    runs = job_runs(client, EXPERIMENT)  # the sweep's children
    return runner, client, {r.data.tags["plugin"]: r for r in runs}


def _records(runner, run) -> list[dict]:
    return runner.metrics(run.data.params["run_name"], experiment=EXPERIMENT)  # <sweep>/<job>


def test_the_sweep_records_two_finished_comparable_runs(sweep):
    runner, client, runs = sweep
    assert set(runs) == {"single", "ddp"} and len(runs) == 2
    for plugin, r in runs.items():
        assert r.info.status == "FINISHED", r.data.tags.get("error")
        assert r.data.tags["world_size"] == ("1" if plugin == "single" else "2")
        assert r.data.tags["git_commit"]
        assert r.data.params["parallelism.name"] == plugin
        assert r.data.params["derived.global_batch_size"] == "8"
        assert r.data.params["derived.grad_accum_steps"] == ("4" if plugin == "single" else "2")
        assert r.data.params["mfu.peak_flops_method"]
        for key in (
            "train/loss",
            "train/lr",
            "train/grad_norm",
            "perf/tokens_per_sec",
            "perf/mfu",
            "perf/step_time_s",
            "val/loss",
        ):
            assert key in r.data.metrics, (plugin, key)
        assert [m.step for m in client.get_metric_history(r.info.run_id, "train/loss")][-1] == 12
        assert "resolved_config.yaml" in [a.path for a in client.list_artifacts(r.info.run_id)]
    # no stray folders: one output folder per job (in the sweep's folder), nothing from other ranks
    (sweep_dir,) = [p for p in (runner.workdir / "outputs" / EXPERIMENT).iterdir() if p.is_dir()]
    out = sorted(p.name for p in sweep_dir.iterdir() if p.is_dir())
    assert out == ["parallelism=ddp", "parallelism=single"], out
    assert {r.info.run_name for r in runs.values()} == {
        "ddp (parallelism)",
        "single (parallelism)",
    }  # by its swept values


@pytest.mark.parametrize("plugin", ["single", "ddp"])
def test_breakdown_fractions_add_up_and_match_the_step_time(sweep, plugin):
    runner, client, runs = sweep
    run = runs[plugin]
    assert run.info.status == "FINISHED"
    for key in [f"perf/{c}_frac" for c in CATEGORIES] + [f"perf/{c}_frac_mean" for c in CATEGORIES]:
        assert key in run.data.metrics, key
    records = _records(runner, run)
    breakdown = {r["step"]: r for r in records if "perf/compute_frac" in r}
    assert sorted(breakdown) == [4, 8, 12]
    for step, r in breakdown.items():
        assert sum(r[f"perf/{c}_frac"] for c in CATEGORIES) == pytest.approx(1.0, abs=0.05), step
        assert all(r[f"perf/{c}_s"] >= 0 for c in CATEGORIES)
        assert r["perf/compute_frac"] > 0.1
    assert breakdown[8]["perf/ckpt_blocking_s"] > 0, "the save at step 6 blocks the window of steps 5-8"
    assert breakdown[4]["perf/ckpt_blocking_s"] == 0
    m = run.data.metrics
    assert sum(m[f"perf/{c}_frac_mean"] for c in CATEGORIES) == pytest.approx(1.0, abs=0.05)
    # An independent clock: StepMetrics times the same 9 steps (without checkpoint saves), plus the
    # tail from the last step's end to on_train_end (the breakdown's last metric write, Lightning's
    # epoch end: tens of ms), so its total may exceed the spans' sum by that much.
    spans_total = 9 * (m["perf/breakdown_step_s_mean"] - m["perf/ckpt_blocking_s_mean"])
    clock_total = 9 * m["perf/step_time_s_mean"]
    assert -0.01 <= clock_total - spans_total <= 0.05 * clock_total + 0.1, (clock_total, spans_total)
    if plugin == "single":
        assert all(r["perf/comm_frac"] == 0 and r["perf/comm_bytes"] == 0 for r in breakdown.values())
    else:
        assert all(r["perf/comm_s"] > 0 for r in breakdown.values())


def test_ddp_allreduces_exactly_the_gradient_bytes_once_per_step(sweep):
    runner, client, runs = sweep
    run = runs["ddp"]
    assert run.data.params["derived.grad_accum_steps"] == "2", "accumulation: the first micro-batch must not sync"
    grad_bytes = int(run.data.params["model.num_params"]) * 4  # fp32 gradients, tied head counted once
    records = [r for r in _records(runner, run) if "perf/comm_bytes" in r]
    assert len(records) == 3
    for r in records:
        assert r["perf/comm_bytes_allreduce"] == grad_bytes
        assert r["perf/comm_bytes"] == r["perf/comm_bytes_model"] == grad_bytes
        assert r["perf/comm_bytes_wire"] == r["perf/comm_bytes_wire_model"] == grad_bytes  # 2(n-1)/n = 1 for n = 2


@pytest.mark.parametrize("plugin", ["single", "ddp"])
def test_model_state_memory_measured_equals_modelled(sweep, plugin):
    runner, client, runs = sweep
    m = runs[plugin].data.metrics
    psi = int(runs[plugin].data.params["model.num_params"])
    assert m["mem/model_states_bytes"] == m["mem/model_states_bytes_model"]
    assert 16 * psi < m["mem/model_states_bytes"] < 16 * psi + 4 * 1000  # + one 4-byte AdamW step per tensor
    assert m["mem/peak_bytes"] > m["mem/model_states_bytes"]
    assert m["perf/hfu"] == m["perf/mfu"], "no activation recomputation: HFU == MFU"
    assert 0 <= m["system/cpu_utilization_percentage"] <= 100, "MLflow system metrics are on"
    assert m["perf/tokens_per_sec_per_rank_mean"] == pytest.approx(
        m["perf/tokens_per_sec_mean"] / (1 if plugin == "single" else 2)
    )


def test_compare_report_prints_the_mlflow_figures_and_writes_plots(sweep):
    runner, client, runs = sweep
    out = runner.workdir / "report"
    proc = subprocess.run(
        [sys.executable, "-m", "framework.compare", "--experiment", EXPERIMENT, "--out", str(out)],
        cwd=runner.workdir,
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "MLFLOW_TRACKING_URI": f"sqlite:///{runner.workdir}/mlruns.db"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["plugin"]: r for r in csv.DictReader(open(out / "compare.csv"))}
    assert set(rows) == {"single", "ddp"}
    for plugin, run in runs.items():
        row, m = rows[plugin], run.data.metrics
        assert row["run_id"] == run.info.run_id
        assert row["layout"] == run.data.tags["layout"] and row["parallelism"] == plugin  # the swept key's column
        pairs = {
            "tokens_per_sec": "perf/tokens_per_sec_mean",
            "mfu": "perf/mfu_mean",
            "comm_bytes": "perf/comm_bytes",
            "final_loss": "train/loss_final",
            **{f"{c}_frac": f"perf/{c}_frac_mean" for c in CATEGORIES},
        }
        for col, key in pairs.items():
            assert math.isclose(float(row[col]), m[key], rel_tol=1e-9), (plugin, col)
        assert math.isclose(float(row["peak_mem_GiB"]) * 1024**3, m["mem/peak_bytes"], rel_tol=1e-9)
        line = next(
            ln for ln in proc.stdout.splitlines() if ln.split()[0] == plugin
        )  # rows labelled by the swept value
        for value in (
            f"{m['perf/mfu_mean']:.4f}",
            f"{m['perf/tokens_per_sec_mean']:,.0f}",
            f"{m['train/loss_final']:.4f}",
            f"{m['perf/compute_frac_mean']:.3f}",
            f"{m['perf/comm_bytes']:,.0f}",
        ):
            assert value in line.split(), (plugin, value, line)
    for name in ("loss.png", "throughput.png", "breakdown.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (out / name).stat().st_size > 5000
    exp_id = client.get_experiment_by_name(EXPERIMENT).experiment_id
    reports = client.search_runs([exp_id], filter_string="tags.`trainlab.report` = 'true'")
    assert len(reports) == 1
    assert {"compare.csv", "breakdown.png", "loss.png", "throughput.png"} <= {
        a.path for a in client.list_artifacts(reports[0].info.run_id)
    }


def test_profile_steps_store_a_trace_per_rank_as_mlflow_artifacts(runner):
    runner.run(
        "parallelism=ddp",
        "trainer.max_steps=4",
        "trainer.profile_steps=[2,3]",
        "checkpoint=none",
        "trainer.global_batch_size=4",
        "trainer.micro_batch_size=2",
        "tracking.system_metrics_interval_s=0",
    )
    client = MlflowClient(tracking_uri=f"sqlite:///{runner.workdir}/mlruns.db")
    (run,) = client.search_runs([client.get_experiment_by_name("default").experiment_id])
    names = sorted(a.path for a in client.list_artifacts(run.info.run_id, "profile"))
    assert names == ["profile/rank0-steps2-3.json", "profile/rank1-steps2-3.json"]
    trace = __import__("json").loads(
        open(client.download_artifacts(run.info.run_id, names[0], str(runner.workdir))).read()
    )
    ops = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::addmm" in ops or "aten::mm" in ops, "the trace holds the model's matmuls"
