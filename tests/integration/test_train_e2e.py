"""End to end through the driver, elastic agent, Lightning and MLflow on CPU ranks (gloo)."""

from __future__ import annotations

import signal

import pytest
from mlflow.tracking import MlflowClient

from framework.base.testing.conformance import VAL_EVERY, PluginCase
from framework.rank.module import warmup_cosine
from tests.integration.conftest import REF_STEPS, job_runs, kill_group, losses, shared_run, wait_for

pytestmark = pytest.mark.slow

# Per-step losses of different batch splits agree to float32 rounding: the same windows form
# each global batch, only the order of the sums differs. 1e-5 relative is ~100x that noise.
PARITY_RTOL = 1e-5


ACCUM = shared_run(
    "accum",
    "parallelism=single",
    "trainer.micro_batch_size=2",
    f"trainer.max_steps={REF_STEPS}",
    "trainer.log_every_n_steps=1",
    "checkpoint=none",
    "tracking=none",
    "trainer.global_batch_size=8",
    "trainer.grad_accum_steps=null",
    "trainer.val_sequences=16",
    used_by=__name__,
)
FSDP3_VAL = shared_run(
    "fsdp3-val",
    "parallelism=fsdp",
    "parallelism.world_size=3",
    "trainer.global_batch_size=12",
    "trainer.micro_batch_size=2",
    "trainer.max_steps=5",
    "trainer.val_every_n_steps=2",
    "trainer.log_every_n_steps=1",
    "trainer.warmup_steps_excluded=1",
    "trainer.val_sequences=16",
    "checkpoint=none",
    "tracking=none",
    used_by=__name__,
)


def test_gradient_accumulation_gives_the_same_losses(shared_runs, single_ref):
    """`single` with 4 micro-batches of 2 against `single` with one of 8 (the session's reference run:
    tests/integration/conftest.py). ddp's and fsdp's splits of the same global batch (2 ranks x 2 x 2), their
    learning rates, bytes and model states: the conformance suite (test_conformance.py, loss_parity and bytes)."""
    records = {"ref": single_ref, "accum": shared_runs.records(ACCUM)}
    ref, accum = losses(records["ref"]), losses(records["accum"])
    # The LR schedule counts optimizer steps, not micro-batches: same lr at every step for both splits.
    expected = {
        k: 3e-3 * warmup_cosine(k - 1, warmup_steps=20, max_steps=REF_STEPS, min_lr_ratio=0.1)
        for k in range(1, REF_STEPS + 1)
    }
    for recs in records.values():
        assert {int(r["step"]): r["train/lr"] for r in recs if "train/lr" in r} == pytest.approx(expected, rel=1e-9)
    assert sorted(ref) == list(range(1, REF_STEPS + 1))
    assert min(ref.values()) < ref[1] - 0.5, "the reference run must actually learn for the comparison to mean anything"
    for step in ref:
        assert accum[step] == pytest.approx(ref[step], rel=PARITY_RTOL), f"single mbs2 x accum4, step {step}"


@pytest.mark.parametrize("ranks", [2, 3])
def test_fsdp_bytes_on_steps_with_validation_equal_the_model(request, conformance, ranks):
    """Issue 12: the meter counts training collectives only, so a step that runs a validation pass
    (whose forwards all-gather every parameter) logs the model's bytes: at 2 ranks 22,972,416 (it
    logged 38,287,360 when validation's all-gathers were counted). At 3 ranks FSDP2 pads dim 0 to
    a multiple of 3; the model follows the parameter shapes, so bytes and model states are exact too.
    2 ranks: the conformance suite's fsdp run (global batch 8, micro-batch 2; shared with test_conformance);
    3 ranks: a shared run of the session (global batch 12, validation every 2 steps)."""
    if ranks == 2:
        records = conformance.plugin_run(PluginCase("fsdp", select=("parallelism=fsdp",))).records
        val_steps = {VAL_EVERY, 2 * VAL_EVERY}
    else:
        records = request.getfixturevalue("shared_runs").records(FSDP3_VAL)
        val_steps = {2, 4}
    comm = {int(r["step"]): r for r in records if "perf/comm_bytes" in r}
    assert {int(r["step"]) for r in records if "val/loss" in r} >= val_steps and val_steps <= set(comm)
    for step, r in comm.items():
        for key in (
            "perf/comm_bytes",
            "perf/comm_bytes_allgather",
            "perf/comm_bytes_reduce_scatter",
            "perf/comm_bytes_wire",
        ):
            assert r[key] == r[f"{key}_model"] > 0, (step, key)
        assert r["mem/model_states_bytes"] == r["mem/model_states_bytes_model"], step
    if ranks == 2:
        assert [comm[s]["perf/comm_bytes"] for s in sorted(val_steps)] == [22_972_416] * len(val_steps)


def test_ctrl_c_run_resumes_to_the_same_losses(runner):
    """Ctrl-C -> exit 130, MLflow KILLED; the same command resumes the same MLflow run to FINISHED with the
    uninterrupted losses. (SIGKILL of the driver, ranks dying with it and the bitwise resume after it:
    tests/integration/test_checkpoint_resume.py.)"""
    name = "stopped"
    common = [
        "parallelism=ddp",
        "trainer.max_steps=30",
        "trainer.log_every_n_steps=1",
        "checkpoint.every_n_steps=10",
        "trainer.global_batch_size=8",
        "trainer.micro_batch_size=2",
        f"run_name={name}",
    ]
    # The uninterrupted reference, in its own checkpoint folder and experiment.
    runner.run(*common, "experiment_name=ref")
    ref = losses(runner.metrics(name, experiment="ref"))

    # Steps 11-30 sleep 0.5 s each (a slow_rank fault; sleeping changes no number), so that the
    # Ctrl-C lands in training even when this process is starved of CPU: without it the 20 steps
    # took ~2.5 s, and in 2 of ~5 loaded suites the signal came after the last step (the run had
    # finished, the resume had nothing to train and the MLflow run stayed KILLED).
    interrupted = [*common, "fault.events=[{kind:slow_rank,step:11,ranks:[0],delay_s:0.5,duration_steps:20}]"]
    proc = runner.start(*interrupted)
    ckpt_dir = runner.workdir / "checkpoints" / "default" / name
    wait_for(lambda: (ckpt_dir / "step00000010" / "manifest.json").exists(), timeout=300, proc=proc)
    kill_group(proc, signal.SIGINT)
    client = MlflowClient(tracking_uri=f"sqlite:///{runner.workdir}/mlruns.db")
    (stopped,) = client.search_runs([client.get_experiment_by_name("default").experiment_id])
    assert proc.returncode == 130 and stopped.info.status == "KILLED"
    reached = max(losses(runner.metrics(name)))
    assert reached < 30, f"the Ctrl-C came after the last step ({reached}): nothing was left to resume"

    again = runner.run(*interrupted)
    assert "resuming from" in again.stdout
    records = runner.metrics(name)
    got = losses(records)
    assert max(got) == 30
    assert [r["train/steps"] for r in records if "train/steps" in r][-1] == 30
    for step in range(11, 31):
        assert got[step] == pytest.approx(ref[step], rel=1e-6), f"step {step} after resume"
    runs = client.search_runs([client.get_experiment_by_name("default").experiment_id])
    assert len(runs) == 1, "the resumed run continues the same MLflow run"
    assert runs[0].info.status == "FINISHED"
    # the steps logged after checkpoint 10 before Ctrl-C ran again after the resume; MLflow holds each once
    replayed = len([r for r in records if "train/loss" in r]) - 30  # metrics.jsonl keeps every execution
    history = [m.step for m in client.get_metric_history(runs[0].info.run_id, "train/loss")]
    assert len(history) == len(set(history)), f"one point per step ({replayed} steps were replayed)"
    # every step once, the checkpoint step 10 too: its metrics are sent before its save, so a Ctrl-C right
    # after the save (the resumed run starts at 11) loses none of them
    assert sorted(history) == list(range(1, 31))

    # A Ctrl-C after the last step's save (while the ranks exit) leaves a complete run KILLED; the same
    # command has nothing to train and ends it FINISHED (the reference run stands in for it, marked KILLED).
    (done,) = client.search_runs([client.get_experiment_by_name("ref").experiment_id])
    client.set_terminated(done.info.run_id, status="KILLED")
    closed = runner.run(*common, "experiment_name=ref")
    assert "nothing to train" in closed.stdout and f"MLflow run {done.info.run_id} was left KILLED" in closed.stdout
    (closed_run,) = client.search_runs([client.get_experiment_by_name("ref").experiment_id])
    assert closed_run.info.status == "FINISHED" and closed_run.info.end_time > done.info.end_time
    done = closed_run
    # a complete run that is FINISHED stays as it is
    again = runner.run(*common, "experiment_name=ref")
    assert "nothing to train" in again.stdout and "was left KILLED" not in again.stdout
    (same,) = client.search_runs([client.get_experiment_by_name("ref").experiment_id])
    assert same.info.end_time == done.info.end_time


def test_a_driver_sigkilled_alone_takes_its_rank_server_and_ranks_with_it(runner):
    """SIGKILL of the driver process only (not its group): the rank server and the ranks it forked end too,
    instead of training on beside the run that replaces them (framework/rank/worker.py)."""
    import os

    import psutil

    from framework.base.tracking import read_jsonl_metrics

    proc = runner.start(
        "parallelism=ddp",
        "trainer.max_steps=100000",
        "trainer.log_every_n_steps=1",
        "checkpoint=none",
        "run_name=alone",
    )
    metrics = runner.workdir / "outputs" / "default" / "alone" / "metrics.jsonl"
    wait_for(lambda: len(losses(read_jsonl_metrics(metrics))) >= 2, timeout=300, proc=proc)
    family = psutil.Process(proc.pid).children(recursive=True)
    ranks = [p for p in family if p.ppid() != proc.pid]  # forked by the rank server
    assert len(ranks) >= 2, [p.cmdline() for p in family]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    try:
        _, alive = psutil.wait_procs(family, timeout=20)
        assert not alive, [(p.pid, p.cmdline()[:4]) for p in alive]
    finally:
        for p in family:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


def test_bad_input_fails_before_any_rank_with_one_line(runner):
    proc = runner.run("parallelism.name=nope", check=False)
    assert proc.returncode == 2
    err_lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert err_lines == [
        "trainlab: error: parallelism.name='nope' is not a known plugin; available: ddp, deepspeed, fsdp, pp, single, tp"
    ]
    assert not list(runner.workdir.glob("outputs/**/launch.json"))
    db = runner.workdir / "mlruns.db"
    if db.exists():
        client = MlflowClient(tracking_uri=f"sqlite:///{db}")
        assert not [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]

    missing = runner.run("data=text_files", "data.paths=[/nonexistent/*.txt]", check=False)
    assert missing.returncode == 2
    assert "data.paths" in missing.stderr and "/nonexistent/*.txt" in missing.stderr

    # Issue 13 item 8: a global batch larger than the train split (the small corpus: about 7,800
    # windows of 64 tokens) ran, repeating windows inside every step; refused after tokenizing.
    huge = runner.run("trainer.global_batch_size=16384", "trainer.micro_batch_size=8192", check=False)
    assert (
        huge.returncode == 2
        and "trainlab: error: trainer.global_batch_size=16384 sequences is larger than the train split" in huge.stderr
    )
    assert not list(runner.workdir.glob("outputs/**/launch.json"))

    # An unknown top-level key (not a config group) got Hydra's 77-line traceback and exit 1.
    unknown = runner.run("nosuchkey=1", check=False)
    assert unknown.returncode == 2
    assert [ln for ln in unknown.stderr.splitlines() if ln.strip()] == [
        "trainlab: error: nosuchkey is not a config key; see conf/ and framework/base/config/schema.py for the keys"
        " (to add a new key write +nosuchkey=...)"
    ]


def test_a_rank_failure_ends_the_mlflow_run_failed(runner):
    # An intact checkpoint folder (checksums match) whose state file carries a code-running
    # pickle: the driver accepts it, every rank refuses to unpickle it and fails.
    from framework.base.checkpoint.format import write_checkpoint
    from tests.unit.test_checkpoint import _CreatesAFile

    marker = runner.workdir / "pwned"
    bad = write_checkpoint(
        runner.workdir / "foreign", 5, {"evil": _CreatesAFile(marker)}, {"kind": "full", "base": None}
    )
    proc = runner.run(
        "parallelism=single", "trainer.global_batch_size=8", "trainer.max_steps=5", f"resume={bad}", check=False
    )
    assert proc.returncode == 1
    assert "trainlab: error: training failed" in proc.stderr
    assert "refused to load" in proc.stdout + proc.stderr
    # the one-line reason names the refusal, not an error raised while reporting it
    (reason,) = [ln for ln in proc.stderr.splitlines() if "error: training failed" in ln]
    assert "refused to load" in reason, reason
    assert not marker.exists()
    client = MlflowClient(tracking_uri=f"sqlite:///{runner.workdir}/mlruns.db")
    runs = client.search_runs([client.get_experiment_by_name("default").experiment_id])
    assert [r.info.status for r in runs] == ["FAILED"]
    # Why it failed is kept with the run (a sweep's stderr is gone by the time someone reads the UI).
    (run_dir,) = {p.parent for p in runner.workdir.glob("outputs/default/*/launch.json")}
    tag, text = runs[0].data.tags["error"], (run_dir / "error.txt").read_text().strip()
    assert "refused to load" in tag
    # the tag is the error (its head and tail past 4,000 characters: MLflow's tag limit); error.txt is whole
    assert tag == text if len(text) <= 4000 else (tag.startswith(text[:1500]) and tag.endswith(text[-2400:]))

    # In a sweep the failed job does not stop the others, but the sweep's exit status reports it.
    sweep = runner.run(
        "-m",
        "parallelism=single",
        "trainer.global_batch_size=8",
        "trainer.max_steps=5",
        f"resume={bad}",
        "experiment_name=sweep",
        check=False,
    )
    assert sweep.returncode == 1, sweep.stderr[-3000:]
    assert "trainlab: 1 sweep job(s) FAILED" in sweep.stderr
    (swept,) = job_runs(client, "sweep")
    assert swept.info.status == "FAILED" and "refused to load" in swept.data.tags["error"]
