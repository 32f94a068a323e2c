"""Slurm through Hydra (issue 17 item 3): a sweep submitted with ``hydra/launcher=submitit_slurm`` to a
real one-node Slurm (Debian's slurm-wlm, started by scripts/slurm/start_local_slurm.sh), one Slurm job
per sweep point, each a FINISHED child run of the sweep's parent. Skipped, with the reason, where Slurm
is not installed or cannot be started (the script needs root)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.integration.conftest import Runner, shared_run

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
START = REPO / "scripts" / "slurm" / "start_local_slurm.sh"
TINY = [
    "model.n_layer=2",
    "model.n_head=2",
    "model.d_model=64",
    "trainer.val_sequences=8",
    "tracking.system_metrics_interval_s=0",
    "trainer.warmup_steps_excluded=0",
]


@pytest.fixture(scope="module")
def slurm() -> None:
    """A running local Slurm, or the test is skipped with the reason."""
    if shutil.which("sbatch") is None:
        pytest.skip(
            f"Slurm is not installed (no sbatch on PATH): {START.relative_to(REPO)} --install, as root, installs and starts it"
        )
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
        lines.append(
            " ".join(
                f"{k}={fields.get(k)}"
                for k in (
                    "JobId",
                    "ArrayJobId",
                    "ArrayTaskId",
                    "JobName",
                    "JobState",
                    "ExitCode",
                    "Restarts",
                    "RunTime",
                    "NodeList",
                    "NumCPUs",
                )
            )
        )
    return lines


def test_sweep_submitted_to_slurm_ends_in_finished_children(slurm, tmp_path, data_cache):
    runner = Runner(tmp_path, data_cache)
    proc = runner.run(
        "-m",
        "hydra/launcher=submitit_slurm",
        "parallelism=single,ddp",
        *TINY,
        "trainer.max_steps=3",
        "trainer.global_batch_size=4",
        "trainer.micro_batch_size=2",
        "checkpoint=none",
        "experiment_name=slurm",
        "slurm.timeout_min=10",
        timeout=540,
    )
    assert "Submitit 'slurm' sweep output dir" in proc.stdout + proc.stderr
    # one Slurm job per sweep point: submitit's folders are named <array job>_<task>
    job_ids = sorted(
        p.name for p in (tmp_path / "outputs" / "slurm" / ".submitit").iterdir() if re.fullmatch(r"\d+_\d+", p.name)
    )
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
    assert all(c.info.status == "FINISHED" for c in children), [
        (c.info.run_name, c.data.tags.get("error")) for c in children
    ]
    assert sorted((c.data.tags["plugin"], c.data.tags["world_size"]) for c in children) == [
        ("ddp", "2"),
        ("single", "1"),
    ]
    for c in children:  # each trained its steps inside its Slurm job
        assert c.data.metrics["train/steps"] == 3
        assert c.data.params["slurm.timeout_min"] == "10"
    assert parent.info.status == "FINISHED"
    assert parent.data.metrics["sweep/jobs"] == parent.data.metrics["sweep/jobs_finished"] == 2
    assert "sweep: 2 of 2 job(s) FINISHED" in proc.stdout  # the outcomes the jobs reported from their Slurm jobs


MAX_STEPS = 30
PREEMPT = [
    *TINY,
    f"trainer.max_steps={MAX_STEPS}",
    "trainer.log_every_n_steps=1",
    "checkpoint.every_n_steps=1000",
    "checkpoint.keep_last_k=3",
    "trainer.global_batch_size=8",
    "trainer.micro_batch_size=2",
]  # 4 / 2 micro-batches per step
if shutil.which("sbatch"):  # the uninterrupted runs, not under Slurm: the session's shared runs (conftest.shared_run)
    for _plugin in ("single", "ddp"):
        shared_run(f"requeue-ref-{_plugin}", f"parallelism={_plugin}", *PREEMPT, "tracking=none", used_by=__name__)


def test_submitit_signal_saves_the_step_requeues_the_job_and_it_resumes_exactly(
    slurm, tmp_path, data_cache, shared_runs
):
    """Each job of a 2-job sweep (single, ddp) gets submitit's preemption signal (SIGUSR2, what Slurm's
    ``--signal=USR2@<slurm.signal_delay_s>`` sends before the time limit) from ``scancel --signal`` a few
    steps in: its ranks finish the step and save it, then submitit requeues the job (``scontrol
    requeue``), and the requeued job resumes from that step and ends with the final checkpoint of an
    uninterrupted run, bitwise; its MLflow run ends FINISHED."""
    import time

    from framework.base.faults.preemption import PREEMPTED_TAG
    from framework.base.tracking import read_jsonl_metrics
    from tests.integration.conftest import losses, wait_for
    from tests.integration.test_checkpoint_resume import assert_bitwise_equal

    runner = Runner(tmp_path, data_cache)
    for plugin in ("single", "ddp"):  # the uninterrupted runs (made before the sweep takes the node's CPUs)
        shared_runs.run_dir(f"requeue-ref-{plugin}")
    sweep = runner.start(
        "-m",
        "hydra/launcher=submitit_slurm",
        "parallelism=single,ddp",
        *PREEMPT,
        # steps 4-30 sleep 0.25 s on rank 0 (no number changes) so that the signal lands in training even
        # when this process or scancel is slow: unslowed, the 27 steps take ~1.5 s (test_preemption)
        f"fault.events=[{{kind:slow_rank,step:4,ranks:[0],delay_s:0.25,duration_steps:{MAX_STEPS - 3}}}]",
        "experiment_name=requeue",
        "slurm.timeout_min=10",
    )
    exp_dir = tmp_path / "outputs" / "requeue"
    signalled = {}
    try:
        for task, plugin in enumerate(("single", "ddp")):  # (one job at a time: each takes the node's 2 CPUs)
            metrics = lambda: [p / "metrics.jsonl" for p in exp_dir.glob(f"*/parallelism={plugin}")]  # noqa: E731
            wait_for(
                lambda: any(len(losses(read_jsonl_metrics(m))) >= 3 for m in metrics() if m.exists()),
                timeout=300,
                proc=sweep,
            )
            (job_dir,) = [p for p in (exp_dir / ".submitit").iterdir() if p.name.endswith(f"_{task}")]
            subprocess.run(["scancel", "--signal=USR2", job_dir.name], check=True)
            signalled[plugin] = (job_dir.name, time.time())
        out, _ = sweep.communicate(timeout=480)
    finally:
        if sweep.poll() is None:
            sweep.kill()
    assert sweep.returncode == 0, out[-4000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlruns.db")
    runs = client.search_runs([client.get_experiment_by_name("requeue").experiment_id])
    print()
    for plugin, (job_id, _t_sent) in signalled.items():
        (run_dir,) = exp_dir.glob(f"*/parallelism={plugin}")
        (child,) = [r for r in runs if r.info.run_name == f"{plugin} (parallelism)"]
        assert child.info.status == "FINISHED" and PREEMPTED_TAG not in child.data.tags, child.data.tags.get("error")
        recs = [
            json.loads(line) for line in (run_dir / "faults.jsonl").read_text().splitlines() if '"preempted"' in line
        ]
        assert len(recs) == 1, recs
        rec = recs[0]
        assert rec["signal"] == "SIGUSR2" and rec["step_at_signal"] - 1 <= rec["saved_step"] <= rec["step_at_signal"]
        log = (exp_dir / ".submitit" / job_id / f"{job_id}_0_log.out").read_text()
        ckpt = tmp_path / "checkpoints" / "requeue" / run_dir.parent.name / run_dir.name
        assert f"trainlab: resuming from {ckpt.relative_to(tmp_path)}/step{rec['saved_step']:08d}" in log, log[-3000:]
        err = (exp_dir / ".submitit" / job_id / f"{job_id}_0_log.err").read_text()
        assert "submitit requeues the Slurm job" in err and "(0 finished steps lost)" in err, err[-3000:]
        (line,) = job_lines([job_id])
        assert "JobState=COMPLETED" in line and "Restarts=1" in line, line
        ref = losses(shared_runs.records(f"requeue-ref-{plugin}"))
        got = losses(read_jsonl_metrics(run_dir / "metrics.jsonl"))
        assert [got[s] for s in range(rec["saved_step"] + 1, MAX_STEPS + 1)] == [
            ref[s] for s in range(rec["saved_step"] + 1, MAX_STEPS + 1)
        ]
        ref_ckpt = shared_runs.checkpoint_dir(f"requeue-ref-{plugin}")
        assert_bitwise_equal(ckpt / f"step{MAX_STEPS:08d}", ref_ckpt / f"step{MAX_STEPS:08d}")
        print(
            f"{plugin}: SIGUSR2 in step {rec['step_at_signal']}, saved step {rec['saved_step']} (0 steps lost),"
            f" requeued: {line}; MLflow {child.info.status}"
        )
