"""Checkpoint folders and resumes of sweeps and runs (gpt_tiny, single rank, a few steps):

- a sweep with an explicit ``checkpoint.dir``: each job has its own folder under it and trains all
  its steps (the jobs used to share the folder: job 2 resumed job 1's last step and trained nothing);
- a resume with another ``model.n_layer`` is refused in one line before any rank starts; a changed
  ``optim.lr`` resumes only when ``resume_allow_changed`` names it, and MLflow records it.
"""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from tests.integration.conftest import job_runs

pytestmark = pytest.mark.slow

FAST = [
    "parallelism=single",
    "trainer.global_batch_size=4",
    "trainer.micro_batch_size=4",
    "trainer.warmup_steps_excluded=0",
    "trainer.val_sequences=8",
    "tracking.system_metrics_interval_s=0",
]


def test_a_sweep_with_an_explicit_checkpoint_dir_gives_each_job_its_folder(runner):
    root = runner.workdir / "ck"
    proc = runner.run(
        "-m",
        "checkpoint.every_n_steps=2,4",
        f"checkpoint.dir={root}",
        "trainer.max_steps=4",
        "experiment_name=ckroot",
        *FAST,
    )
    assert "trainlab: resuming from" not in proc.stdout
    client = MlflowClient(tracking_uri=f"sqlite:///{runner.workdir}/mlruns.db")
    runs = job_runs(client, "ckroot")
    assert sorted(r.info.run_name for r in runs) == ["2 (every_n_steps)", "4 (every_n_steps)"]
    for r in runs:
        assert r.info.status == "FINISHED" and r.data.metrics["train/steps"] == 4
        own = root / r.data.params["run_name"]  # <root>/<sweep>/<job>
        assert (
            sorted(p.name for p in own.glob("step*")) == ["step00000004"]
            if r.info.run_name.startswith("4 ")
            else ["step00000002", "step00000004"]
        )
    assert len({r.data.params["run_name"] for r in runs}) == 2


def test_a_resume_under_another_configuration_is_refused_in_one_line(runner):
    ck = runner.workdir / "ck1"
    common = [f"checkpoint.dir={ck}", "checkpoint.every_n_steps=2", "model.n_layer=2", *FAST]
    runner.run(*common, "trainer.max_steps=2")
    proc = runner.run(
        *[c for c in common if c != "model.n_layer=2"], "model.n_layer=3", "trainer.max_steps=4", check=False
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"trainlab: error: resume from {ck / 'step00000002'}: this run's configuration differs from the checkpoint's:"
        " model.n_layer 2 -> 3; resume it unchanged, start elsewhere (another checkpoint.dir, or resume=never in an empty"
        " one), or allow the change: resume_allow_changed=[model.n_layer]"
    ]
    refused = runner.run(*common, "optim.lr=0.001", "trainer.max_steps=4", check=False)
    assert refused.returncode == 2 and "optim.lr 0.003 -> 0.001" in refused.stderr
    allowed = runner.run(*common, "optim.lr=0.001", "resume_allow_changed=[optim.lr]", "trainer.max_steps=4")
    assert f"trainlab: resuming from {ck / 'step00000002'}" in allowed.stdout
    client = MlflowClient(tracking_uri=f"sqlite:///{runner.workdir}/mlruns.db")
    (resumed,) = [r for r in job_runs(client, "default") if r.data.params.get("optim.lr") == "0.001"]
    assert resumed.data.tags["resume.changed"] == "optim.lr 0.003 -> 0.001"
    assert resumed.data.metrics["train/steps"] == 4
