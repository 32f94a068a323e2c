"""Slurm through Hydra (issue 17 item 3): a sweep submitted with ``hydra/launcher=submitit_slurm`` to a
real one-node Slurm (Debian's slurm-wlm, started by scripts/slurm/start_local_slurm.sh), one Slurm job
per sweep point, each a FINISHED child run of the sweep's parent. Skipped, with the reason, where Slurm
is not installed or cannot be started (the script needs root)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.integration.conftest import Runner

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
START = REPO / "scripts" / "slurm" / "start_local_slurm.sh"
TINY = ["model.n_layer=2", "model.n_head=2", "model.d_model=64", "trainer.val_sequences=8",
        "tracking.system_metrics_interval_s=0", "trainer.warmup_steps_excluded=0"]


@pytest.fixture(scope="module")
def slurm() -> None:
    """A running local Slurm, or the test is skipped with the reason."""
    if shutil.which("sbatch") is None:
        pytest.skip(f"Slurm is not installed (no sbatch on PATH): {START.relative_to(REPO)} --install, as root, installs and starts it")
    # (close_fds: the daemons it starts must not inherit a lock held by the test run, e.g. flock's)
    proc = subprocess.run(["bash", str(START)], capture_output=True, text=True, timeout=180, close_fds=True)
    if proc.returncode != 0:
        pytest.skip(f"Slurm is not running and {START.relative_to(REPO)} could not start it: {proc.stderr.strip()}")
    print(f"\n{proc.stdout.strip()}")


def job_lines(job_ids: list[str]) -> list[str]:
    """``scontrol show job -o`` for each job (accounting is off on the local Slurm: no sacct), shortened
    to id, name, state, exit code, run time, node, CPUs."""
    lines = []
    for jid in job_ids:
        out = subprocess.run(["scontrol", "show", "job", "-o", jid], capture_output=True, text=True).stdout
        fields = dict(re.findall(r"(\w+(?:/\w+)?)=(\S*)", out))
        lines.append(" ".join(f"{k}={fields.get(k)}" for k in ("JobId", "ArrayJobId", "ArrayTaskId", "JobName", "JobState",
                                                                 "ExitCode", "Restarts", "RunTime", "NodeList", "NumCPUs")))
    return lines


def test_sweep_submitted_to_slurm_ends_in_finished_children(slurm, tmp_path, data_cache):
    runner = Runner(tmp_path, data_cache)
    proc = runner.run("-m", "hydra/launcher=submitit_slurm", "parallelism=single,ddp", *TINY, "trainer.max_steps=3",
                      "trainer.global_batch_size=4", "trainer.micro_batch_size=2", "checkpoint=none",
                      "experiment_name=slurm", "slurm.timeout_min=10", timeout=540)
    assert "Submitit 'slurm' sweep output dir" in proc.stdout + proc.stderr
    # one Slurm job per sweep point: submitit's folders are named <array job>_<task>
    job_ids = sorted(p.name for p in (tmp_path / "outputs" / "slurm" / ".submitit").iterdir() if re.fullmatch(r"\d+_\d+", p.name))
    assert len(job_ids) == 2, job_ids
    lines = job_lines(job_ids)
    print("\n" + "\n".join(lines))
    assert all("JobState=COMPLETED" in ln and "ExitCode=0:0" in ln for ln in lines), lines

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlruns.db")
    runs = client.search_runs([client.get_experiment_by_name("slurm").experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("trainlab.sweep") == "parent"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == len(runs) - 1 == 2
    print("\n".join(f"MLflow {r.info.run_name}: {r.info.status}" for r in runs))
    assert all(c.info.status == "FINISHED" for c in children), [(c.info.run_name, c.data.tags.get("error")) for c in children]
    assert sorted((c.data.tags["plugin"], c.data.tags["world_size"]) for c in children) == [("ddp", "2"), ("single", "1")]
    for c in children:  # each trained its steps inside its Slurm job
        assert c.data.metrics["train/steps"] == 3
        assert c.data.params["slurm.timeout_min"] == "10"
    assert parent.info.status == "FINISHED"
    assert parent.data.metrics["sweep/jobs"] == parent.data.metrics["sweep/jobs_finished"] == 2
    assert "sweep: 2 of 2 job(s) FINISHED" in proc.stdout  # the outcomes the jobs reported from their Slurm jobs
