"""DeepSpeed ZeRO 1-3 on 2 CPU ranks (gloo, fp32) through the real driver.

One set of runs (the session's `single` reference run, tests/integration/conftest.py, and a
``-m parallelism=zero1,zero2,zero3`` sweep; 20 steps, global batch 8) serves the MLflow sweep check, the loss parity, the measured-vs-modelled bytes and
the resume reference.
"""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from tests.integration.conftest import Runner, job_runs, losses

pytestmark = pytest.mark.slow

# fp32 per-step losses agree to float32 rounding (measured: <= 3.5e-7 relative over 20 steps):
# ZeRO runs the same AdamW on flat fp32 partitions and sums the same micro-batch gradients.
PARITY_RTOL = 1e-5
STAGES = (1, 2, 3)
COMMON = [
    "trainer.max_steps=20",
    "trainer.log_every_n_steps=1",
    "trainer.warmup_steps_excluded=1",
    "trainer.global_batch_size=8",
    "trainer.grad_accum_steps=null",
    "trainer.val_sequences=16",
]
# Checkpoints at step 15 only (every 15 steps, no save at the end). Resumed runs stop at step 18:
# steps 1-20 are all LR warm-up (optim.warmup_steps=20), so the LR of steps 16-18 does not depend
# on trainer.max_steps (which the run name leaves out).
RESUMED = ["trainer.max_steps=18", *COMMON[1:]]
# DeepSpeed's scalar all-reduces (global grad norm, overflow flag; a few fp32 per step) are
# measured, not modelled.
SCALAR_BYTES = 64


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory, data_cache, single_ref) -> Runner:
    runner = Runner(tmp_path_factory.mktemp("zero"), data_cache)
    runner.ref = single_ref  # `single`, micro-batch 8, the same 20 steps
    # One sweep (MLflow on): 2 ranks x micro-batch 2 x grad_accum_steps 2; a checkpoint at step 15 for the resume tests.
    runner.run(
        "-m",
        "parallelism=zero1,zero2,zero3",
        "trainer.micro_batch_size=2",
        "checkpoint.every_n_steps=15",
        "checkpoint.save_last=False",
        *COMMON,
    )  # (a sweep names the run with Hydra's spelling, False)
    return runner


def _run_name(runner: Runner, stage: int) -> str:
    (path,) = (runner.workdir / "outputs" / "default").glob(f"*/parallelism=zero{stage}")  # <sweep>/<job>
    return str(path.relative_to(runner.workdir / "outputs" / "default"))


def test_the_sweep_records_three_finished_mlflow_runs(zero_runs):
    client = MlflowClient(tracking_uri=f"sqlite:///{zero_runs.workdir}/mlruns.db")
    runs = job_runs(client, "default")
    assert sorted(r.data.params["parallelism.zero_stage"] for r in runs) == ["1", "2", "3"]
    for r in runs:
        assert r.info.status == "FINISHED", r.data.tags.get("error")
        assert r.data.tags["plugin"] == "deepspeed"
        for key in ("train/loss", "perf/comm_bytes", "mem/model_states_bytes", "mem/model_states_bytes_model"):
            assert key in r.data.metrics, key
        assert [m.step for m in client.get_metric_history(r.info.run_id, "train/loss")][-1] == 20
        # The value the MLflow comparison shows (the latest) is a training step's, not a sample
        # taken after training, when ZeRO-1/2 have freed their gradients.
        m = r.data.metrics
        assert m["mem/model_states_bytes"] == pytest.approx(m["mem/model_states_bytes_model"], rel=0.05)


@pytest.mark.parametrize("stage", STAGES)
def test_zero_losses_equal_single(zero_runs, stage):
    ref = losses(zero_runs.ref)
    got = losses(zero_runs.metrics(_run_name(zero_runs, stage)))
    assert sorted(ref) == sorted(got) == list(range(1, 21))
    assert min(ref.values()) < ref[1] - 0.5, "the reference must learn for the comparison to mean anything"
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=PARITY_RTOL), f"zero{stage}, step {step}"
    norms = [r["train/grad_norm"] for r in zero_runs.metrics(_run_name(zero_runs, stage)) if "train/grad_norm" in r]
    ref_norms = [r["train/grad_norm"] for r in zero_runs.ref if "train/grad_norm" in r]
    assert norms == pytest.approx(ref_norms, rel=1e-4), "DeepSpeed's global gradient norm (before clipping)"


@pytest.mark.parametrize("stage", STAGES)
def test_measured_bytes_match_the_zero_model(zero_runs, stage):
    # Step 15 saves a checkpoint; its collectives (DeepSpeed's tag check) are outside the framework's window.
    records = [r for r in zero_runs.metrics(_run_name(zero_runs, stage)) if "perf/comm_bytes" in r]
    assert 15 in {r["step"] for r in records}
    assert len(records) >= 15
    for r in records:
        assert r["mem/model_states_bytes"] == pytest.approx(r["mem/model_states_bytes_model"], rel=0.05)
        kinds = {
            k[len("perf/comm_bytes_") : -len("_model")]
            for k in r
            if k.startswith("perf/comm_bytes_") and k.endswith("_model")
        }
        kinds -= {"wire", ""}  # perf/comm_bytes_model, perf/comm_bytes_wire_model: totals
        assert kinds, r
        for kind in kinds:
            assert abs(r[f"perf/comm_bytes_{kind}"] - r[f"perf/comm_bytes_{kind}_model"]) <= SCALAR_BYTES, (
                stage,
                kind,
                r,
            )
        assert r["perf/comm_bytes_model"] > 0


def test_resume_auto_continues_a_zero3_run_exactly(zero_runs):
    from framework.base.checkpoint.format import read_manifest, verify

    name = _run_name(zero_runs, 3)
    ckpt = zero_runs.workdir / "checkpoints" / "default" / name / "step00000015"
    assert verify(ckpt) == [] and read_manifest(ckpt)["kind"] == "deepspeed"
    assert sum(f.endswith("optim_states.pt") for f in read_manifest(ckpt)["files"]) == 2, "one ZeRO shard per rank"
    ref = losses(zero_runs.metrics(name))
    # The sweep's zero3 job again, as a single run of its run_name: resume=auto finds step 15 (the run
    # saved no later one) and replays 16..18.
    again = zero_runs.run(
        "parallelism=zero3",
        "trainer.micro_batch_size=2",
        "checkpoint.every_n_steps=15",
        "checkpoint.save_last=False",
        f"run_name='{name}'",
        *RESUMED,
    )
    assert f"resuming from checkpoints/default/{name}/step00000015" in again.stdout
    got = losses(zero_runs.metrics(name))
    for step in range(16, 19):
        assert got[step] == pytest.approx(ref[step], rel=1e-6), f"zero3 resumed at 15, step {step}"


@pytest.mark.parametrize("stage", STAGES)
def test_zero_checkpoint_resumes_at_1_rank_and_back_at_2_ranks(zero_runs, stage):
    """2 ranks -> 1 rank -> 2 ranks through DeepSpeed's universal checkpoint, global batch 8 throughout.

    The sweep's step-15 checkpoint (2 ranks x micro 2 x accum 2) resumes on 1 rank (micro 2 x
    accum 4: Lightning's micro-batch counters rescaled 15 x 2 -> 15 x 4) for steps 16-18 and
    saves step 18 at world size 1; that resumes on 2 ranks at micro 4 x accum 1 (another split
    again) for steps 19-20. Every step's loss must be the uninterrupted sweep run's, and the
    accum-1 steps check the memory model where ZeRO-1/2 hold only a gradient partition.
    """
    name = _run_name(zero_runs, stage)
    ref = losses(zero_runs.metrics(name))
    two = zero_runs.workdir / "checkpoints" / "default" / name / "step00000015"
    zero_runs.run(
        f"parallelism=zero{stage}",
        "parallelism.world_size=1",
        "trainer.micro_batch_size=2",
        f"run_name=to1_{stage}",
        f"resume='{two}'",
        "checkpoint.every_n_steps=15",
        "tracking=none",
        *RESUMED,
    )
    assert (two.parent / ".universal" / two.name).is_dir()
    one = zero_runs.workdir / "checkpoints" / "default" / f"to1_{stage}" / "step00000018"
    zero_runs.run(
        f"parallelism=zero{stage}",
        "trainer.micro_batch_size=4",
        f"run_name=to2_{stage}",
        f"resume='{one}'",
        "checkpoint=none",
        "tracking=none",
        *COMMON,
    )
    got = {**losses(zero_runs.metrics(f"to1_{stage}")), **losses(zero_runs.metrics(f"to2_{stage}"))}
    assert sorted(got) == list(range(16, 21))
    for step in got:  # other splits of the same global batch: float32 rounding only
        assert got[step] == pytest.approx(ref[step], rel=PARITY_RTOL), f"zero{stage}, step {step}"
    at_accum_1 = [r for r in zero_runs.metrics(f"to2_{stage}") if "perf/comm_bytes" in r]
    assert at_accum_1
    for r in at_accum_1:
        assert r["mem/model_states_bytes"] == pytest.approx(r["mem/model_states_bytes_model"], rel=0.05), r


def test_a_deepspeed_checkpoint_is_refused_by_other_plugins_before_any_rank(zero_runs):
    """Found by trying: `single` accepted the folder, opened an MLflow run and failed in the rank (no state.pt)."""
    ckpt = zero_runs.workdir / "checkpoints" / "default" / _run_name(zero_runs, 1) / "step00000015"
    proc = zero_runs.run("parallelism=single", f"resume='{ckpt}'", "run_name=wrong_plugin", check=False)
    assert proc.returncode == 2
    assert [ln for ln in proc.stderr.splitlines() if ln.strip()] == [
        f"trainlab: error: resume={str(ckpt)!r}: a 'deepspeed' checkpoint cannot be loaded by plugin 'single';"
        " allowed: parallelism=zero1|zero2|zero3"
    ]


def test_bad_zero_stage_fails_before_any_rank(runner):
    proc = runner.run("parallelism=zero2", "parallelism.zero_stage=5", check=False)
    assert proc.returncode == 2
    assert [ln for ln in proc.stderr.splitlines() if ln.strip()] == [
        "trainlab: error: parallelism.zero_stage=5 is not a ZeRO stage; allowed: 0, 1, 2, 3"
    ]
    assert not list(runner.workdir.glob("outputs/**/launch.json"))
