"""Sweeps of any key: one parent MLflow run, one FINISHED child per job, resumed as a whole.

Each sweep of the issue (``checkpoint.every_n_steps``, ``trainer.max_steps``, ``data.num_workers``,
``optim.lr`` x ``parallelism=single,ddp``) ends with its jobs as distinct FINISHED child runs of
one parent; the first two sweep keys that do not name a run by default (they used to map both
jobs to one run and die on its lock). gpt_tiny, 2-3 steps, one MLflow store per module.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from framework.driver.compare import swept_values
from tests.integration.conftest import Runner, wait_for

FAST = [
    "parallelism=single",
    "trainer.global_batch_size=4",
    "trainer.micro_batch_size=4",
    "trainer.warmup_steps_excluded=0",
    "trainer.val_sequences=8",
    "tracking.system_metrics_interval_s=0",
]


@pytest.fixture(scope="module")
def store(tmp_path_factory, data_cache) -> Runner:
    return Runner(tmp_path_factory.mktemp("sweep"), data_cache)


def _client(runner: Runner) -> MlflowClient:
    return MlflowClient(tracking_uri=f"sqlite:///{runner.workdir}/mlruns.db")


def _sweep(runner: Runner, experiment: str) -> tuple[object, list]:
    """(the experiment's one parent run, its children)."""
    client = _client(runner)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("trainlab.sweep") == "parent"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == len(runs) - 1, "every run of the experiment is the parent or one of its children"
    return parent, children


def _sweep_dir(runner: Runner, experiment: str) -> str:
    (d,) = [p.name for p in (runner.workdir / "outputs" / experiment).iterdir() if p.is_dir()]
    return d


def _check_finished_children(parent, children, key: str, values: list[str]) -> None:
    """Per swept key: a FINISHED child per value, named by it, holding it as a param, in its own folders."""
    assert all(c.info.status == "FINISHED" for c in children), [
        (c.info.run_name, c.data.tags.get("error")) for c in children
    ]
    by_value = {}
    for c in children:
        by_value.setdefault(c.data.params[key], []).append(c)
        swept = swept_values(c.data.tags["trainlab.swept"])  # its swept values, as written on the command line
        assert float(swept[key]) == float(c.data.params[key])
        short = key.rsplit(".", 1)[-1]  # the short run name: the swept values first, then the last part of each key
        shown, _, names = c.info.run_name.partition(" (")
        assert swept[key] == shown.split(", ")[names.rstrip(")").split(", ").index(short)]
    assert sorted(by_value, key=float) == values
    assert len({c.data.params["run_name"] for c in children}) == len(
        children
    )  # no shared folder (checkpoints/<exp>/<run_name>) or lock
    assert len({c.data.tags["trainlab.run_key"] for c in children}) == len(children)
    assert parent.data.params["sweep.keys"].split(",").count(key) == 1


def test_sweeps_of_keys_left_out_of_run_names_end_in_distinct_finished_children(store):
    """-m checkpoint.every_n_steps=1,2 x trainer.max_steps=2,3: four jobs (both keys are excluded from
    default run names), four FINISHED children of one parent; the compare report lands on the parent."""
    store.run(
        "-m",
        "checkpoint.every_n_steps=1,2",
        "trainer.max_steps=2,3",
        "experiment_name=excluded",
        "experiment_description='What does saving every step cost?'",
        *FAST,
    )
    parent, children = _sweep(store, "excluded")
    experiment = _client(store).get_experiment_by_name("excluded")
    assert (
        experiment.tags["mlflow.note.content"] == "What does saving every step cost?"
    )  # the UI's experiment description
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # the UI's model-training view
    assert (
        "experiment_description" not in parent.data.params and "experiment_description" not in children[0].data.params
    )
    assert len(children) == 4
    _check_finished_children(parent, children, "checkpoint.every_n_steps", ["1", "2"])
    _check_finished_children(parent, children, "trainer.max_steps", ["2", "3"])
    client = _client(store)
    for c in children:  # each job trained its own steps and saved at its own interval
        steps = int(c.data.params["trainer.max_steps"])
        note = c.data.tags["mlflow.note.content"]  # the run description, after a warning when the machine was contended
        assert note.startswith("single dp1-tp1-pp1 | ") or (
            note.startswith("WARNING: measured under contention") and ". single dp1-tp1-pp1 | " in note
        ), note
        assert c.data.metrics["summary/tokens_per_sec"] > 0 and "checkpoint.dir" not in c.data.params
        assert [m.step for m in client.get_metric_history(c.info.run_id, "train/loss")][-1] == steps
        every = int(c.data.params["checkpoint.every_n_steps"])
        saved = [m.step for m in client.get_metric_history(c.info.run_id, "ckpt/save_s")]
        assert saved == sorted({s for s in range(1, steps + 1) if s % every == 0} | {steps})  # + checkpoint.save_last
        assert (store.workdir / "checkpoints" / "excluded" / c.data.params["run_name"] / f"step{steps:08d}").is_dir()
        (dataset,) = client.get_run(c.info.run_id).inputs.dataset_inputs  # the token cache, as the run's dataset
        assert dataset.dataset.name == c.data.params["data.name"] and len(dataset.dataset.digest) == 16
        assert json.loads(dataset.dataset.profile)["train_tokens"] > 0
        assert [(t.key, t.value) for t in dataset.tags] == [("mlflow.data.context", "train")]
    assert parent.info.status == "FINISHED"
    assert parent.data.metrics["sweep/jobs"] == parent.data.metrics["sweep/jobs_finished"] == 4
    assert parent.data.params["sweep.checkpoint.every_n_steps"] == "1,2"
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"compare.csv", "compare.json", "compare.md"} <= artifacts
    local = Path(client.download_artifacts(parent.info.run_id, "compare.csv", str(store.workdir)))
    rows = list(csv.DictReader(open(local)))
    assert [(r["checkpoint.every_n_steps"], r["trainer.max_steps"]) for r in rows] == [
        ("1", "2"),
        ("1", "3"),
        ("2", "2"),
        ("2", "3"),
    ]


def test_a_sweep_run_again_continues_its_parent_and_children(store):
    """-m data.num_workers=0,2 (2 steps), then the same sweep to 3 steps: the same parent and child runs,
    each job resumed from its own checkpoint."""
    common = ["-m", "data.num_workers=0,2", "checkpoint.every_n_steps=1", "experiment_name=workers", *FAST]
    first = store.start(*common, "trainer.max_steps=2")
    wait_for(
        lambda: any(
            p.read_text() == str(first.pid) for p in (store.workdir / "outputs").glob("workers/*/.trainlab.lock")
        ),
        timeout=300,
        proc=first,
    )
    # the same command while the first runs: one line naming the other process, before any job
    second = store.run(*common, "trainer.max_steps=2", check=False)
    assert second.returncode == 2 and second.stderr.strip().splitlines() == [
        f"trainlab: error: another trainlab process (pid {first.pid}) is running in"
        f" {Path('outputs', 'workers', _sweep_dir(store, 'workers'))} (the same sweep); wait for it to end"
    ], second.stderr
    out, _ = first.communicate(timeout=900)  # (reading its pipe as it goes: a full pipe would block it)
    assert first.returncode == 0, out[-3000:]
    parent, children = _sweep(store, "workers")
    _check_finished_children(parent, children, "data.num_workers", ["0", "2"])
    proc = store.run(*common, "trainer.max_steps=3")
    assert proc.stdout.count("trainlab: resuming from") == 2
    parent2, children2 = _sweep(store, "workers")
    assert parent2.info.run_id == parent.info.run_id and parent2.info.status == "FINISHED"
    assert {c.info.run_id for c in children2} == {c.info.run_id for c in children}
    client = _client(store)
    for c in children2:
        assert c.info.status == "FINISHED" and c.data.metrics["train/steps"] == 3
        # the last step of each invocation (log_every_n_steps 10): both in the same run
        assert sorted({m.step for m in client.get_metric_history(c.info.run_id, "train/loss")}) == [2, 3]


def test_a_job_the_validation_refuses_is_a_failed_child_and_the_sweep_goes_on(store):
    proc = store.run(
        "-m",
        "trainer.micro_batch_size=3,4",
        "experiment_name=refused",
        "trainer.max_steps=2",
        *[o for o in FAST if not o.startswith("trainer.micro_batch_size")],
        check=False,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "trainlab: 1 sweep job(s) FAILED" in proc.stderr
    parent, children = _sweep(store, "refused")
    by_name = {c.info.run_name: c for c in children}
    assert sorted(by_name) == ["3 (micro_batch_size)", "4 (micro_batch_size)"]
    refused = by_name["3 (micro_batch_size)"]
    assert refused.info.status == "FAILED" and "not divisible by micro_batch_size" in refused.data.tags["error"]
    assert by_name["4 (micro_batch_size)"].info.status == "FINISHED"
    assert parent.data.metrics["sweep/jobs_failed"] == 1 and parent.data.metrics["sweep/jobs_finished"] == 1
    # when every job would be refused (a bad value in a key the sweep does not sweep), nothing starts
    none = store.run(
        "-m",
        "optim.lr=1e-3,3e-3",
        "trainer.micro_batch_size=3",
        "experiment_name=refused_all",
        *[o for o in FAST if not o.startswith("trainer.micro_batch_size")],
        check=False,
    )
    assert none.returncode == 2 and none.stderr.strip().splitlines() == [
        "trainlab: error: every job of this sweep is refused: trainer.global_batch_size=4 is not divisible by"
        " micro_batch_size 3 x dp_degree 1 = 3"
    ]
    assert not (store.workdir / "outputs" / "refused_all").exists()


def test_a_sweep_of_lr_by_plugin_starts_ranks_for_ddp_jobs(store):
    """The issue's -m optim.lr=1e-3,3e-3 parallelism=single,ddp: four children (two of 2 ranks), one parent,
    named by Hydra's spelling of the swept floats."""
    store.run(
        "-m",
        "optim.lr=1e-3,3e-3",
        "parallelism=single,ddp",
        "trainer.max_steps=2",
        "checkpoint=none",
        "experiment_name=lr_plugin",
        "trainer.micro_batch_size=2",  # global batch 4 = 2 x 2 ranks
        *[o for o in FAST[1:] if not o.startswith("trainer.micro_batch_size")],
    )
    parent, children = _sweep(store, "lr_plugin")
    assert len(children) == 4
    _check_finished_children(parent, children, "optim.lr", ["0.001", "0.003"])
    assert (
        sorted((c.data.tags["plugin"], c.data.tags["world_size"]) for c in children)
        == [("ddp", "2")] * 2 + [("single", "1")] * 2
    )
    assert (
        sorted(c.info.run_name for c in children)[0] == "0.001, ddp (lr, parallelism)"
    )  # (Hydra writes the job's 1e-3 so)
