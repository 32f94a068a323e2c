"""Repeats of a sweep and the load monitor, end to end (gpt_tiny, a few steps).

- An A/A test: one configuration swept as two labels (``sweep.label=a,b``) with 5 repeats runs
  interleaved (a b a b ...), groups its 10 children by configuration, and reports the two
  ``indistinguishable`` (a false difference has a ~3.5% chance, framework/base/stats.py; the machine's
  drift falls on both labels alike). ~10 jobs of 20-60 s: marked slow.
- A run started while another process loads the machine is tagged ``contended=true``, logs
  ``load/*`` metrics and is warned about in its summary and description.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from tests.integration.conftest import Runner

FAST = [
    "parallelism=single",
    "trainer.global_batch_size=4",
    "trainer.micro_batch_size=4",
    "trainer.warmup_steps_excluded=2",
    "trainer.val_sequences=8",
    "tracking.system_metrics_interval_s=0",
    "trainer.log_every_n_steps=1",
    "checkpoint=none",
]


@pytest.fixture(scope="module")
def store(tmp_path_factory, data_cache) -> Runner:
    return Runner(tmp_path_factory.mktemp("repeats"), data_cache)


def _runs(runner: Runner, experiment: str) -> list:
    client = MlflowClient(tracking_uri=f"sqlite:///{runner.workdir}/mlruns.db")
    return client, client.search_runs([client.get_experiment_by_name(experiment).experiment_id], max_results=100)


@pytest.mark.slow
def test_an_aa_sweep_with_repeats_is_interleaved_and_indistinguishable(store):
    proc = store.run(
        "-m",
        "sweep.label=a,b",
        "sweep.repeats=5",
        "experiment_name=aa",
        "trainer.max_steps=8",
        "tracking.load_interval_s=1",
        *FAST,
        timeout=1500,
    )
    out = proc.stdout
    assert "trainlab: no established best" in out and "indistinguishable from label=" in out, out[-3000:]
    client, runs = _runs(store, "aa")
    (parent,) = [r for r in runs if r.data.tags.get("trainlab.sweep") == "parent"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 10 and all(c.info.status == "FINISHED" for c in children)
    order = sorted(children, key=lambda c: int(c.data.tags["trainlab.sweep_order"]))
    assert [(c.data.tags["trainlab.config"], c.data.tags["trainlab.repeat"]) for c in order] == [
        (f"sweep.label={lab}", str(i)) for i in range(5) for lab in "ab"
    ]  # a b a b ...: the repeat is the outer loop
    assert all(
        c.data.tags["contended"] in ("true", "false") and "load/other_cpu_share_mean" in c.data.metrics
        for c in children
    )
    assert "10 of 10 jobs FINISHED" in parent.data.tags["mlflow.note.content"]
    assert "No established best" in parent.data.tags["mlflow.note.content"]
    local = client.download_artifacts(parent.info.run_id, "compare.csv", str(store.workdir))
    rows = list(csv.DictReader(open(local)))
    assert sorted(r["sweep.label"] for r in rows) == ["a", "b"] and all(r["n"] == "5" for r in rows)
    verdicts = sorted(r["verdict"] for r in rows)
    assert verdicts[0].startswith("best (indistinguishable from") and verdicts[1].startswith("indistinguishable"), (
        verdicts
    )


def test_a_run_under_load_is_tagged_contended_and_warned(store):
    spin = "import time\nt=time.time()\nwhile time.time()-t<300: pass\n"
    pids = []
    for _ in range(2):  # two busy processes outside the run's tree (their parent shell exits)
        out = subprocess.run(
            ["sh", "-c", f"{sys.executable} -c '{spin}' >/dev/null 2>&1 & echo $!"],
            capture_output=True,
            text=True,
            check=True,
        )
        pids.append(int(out.stdout.strip()))
    try:
        proc = store.run("experiment_name=loaded", "trainer.max_steps=6", "tracking.load_interval_s=1", *FAST)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
    assert "WARNING            measured under contention: other processes used" in proc.stdout, proc.stdout[-2000:]
    _, (run,) = _runs(store, "loaded")
    assert run.data.tags["contended"] == "true" and "threshold 10%" in run.data.tags["contended.reason"]
    assert run.data.tags["mlflow.note.content"].startswith("WARNING: measured under contention")
    assert run.data.metrics["load/other_cpu_share_mean"] >= 0.10 and "load/loadavg_1m_max" in run.data.metrics
    assert "perf/mfu_mean" not in run.data.metrics or run.data.metrics["perf/mfu_mean"] <= 1.0  # never an MFU above 1


def test_repeats_without_a_sweep_are_refused_in_one_line(store):
    proc = store.run("sweep.repeats=3", "tracking=none", check=False)
    assert proc.returncode == 2 and proc.stderr.startswith(
        "trainlab: error: sweep.repeats=3 repeats the jobs of a sweep"
    )


def test_a_repeat_index_on_the_command_line_is_refused_before_any_job(store):
    proc = store.run("-m", "sweep.label=a,b", "sweep.repeats=2", "sweep.repeat=1", "tracking=none", check=False)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "trainlab: error: sweep.repeat is set by sweep.repeats=2; leave sweep.repeat off the command line"
    ), proc.stderr
