"""Preemption (issue 17 item 4): SIGTERM or SIGUSR1 to the driver makes every rank finish the optimizer
step it is in, save it and stop; the driver exits 75 with the MLflow run KILLED and tagged
``trainlab.preempted``; the same command resumes the same MLflow run to FINISHED with final weights
bitwise equal to an uninterrupted run's. No periodic checkpoint falls inside the run, so the only one
the resume can use is the preemption's; 2 micro-batches per step, so the signal lands inside
gradient accumulation as often as not.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from mlflow.tracking import MlflowClient

from framework.base.faults.preemption import EXIT_PREEMPTED, PREEMPTED_TAG
from tests.integration.conftest import losses, shared_run, wait_for
from tests.integration.test_checkpoint_resume import assert_bitwise_equal

pytestmark = pytest.mark.slow

MAX_STEPS = 40
COMMON = [
    "model.n_layer=2",
    "model.n_head=2",
    "model.d_model=64",
    "trainer.val_sequences=16",
    f"trainer.max_steps={MAX_STEPS}",
    "trainer.log_every_n_steps=1",
    "checkpoint.every_n_steps=1000",
    "checkpoint.keep_last_k=3",
    "trainer.global_batch_size=8",
]
# single gets Slurm's warning signal, ddp the scheduler's SIGTERM (both go the same way)
LAYOUT = {
    "single": (["parallelism=single", "trainer.micro_batch_size=4"], signal.SIGUSR1),
    "ddp": (["parallelism=ddp", "trainer.micro_batch_size=2"], signal.SIGTERM),
}


for _plugin, (_overrides, _) in LAYOUT.items():  # the uninterrupted runs: the session's shared runs (conftest)
    shared_run(f"preempt-ref-{_plugin}", *COMMON, *_overrides, "tracking=none", used_by=__name__)


@pytest.mark.parametrize("plugin", ["single", "ddp"])
def test_preempted_run_saves_its_step_and_resumes_exactly(runner, shared_runs, plugin):
    overrides, sig = LAYOUT[plugin]
    name = f"preempt_{plugin}"
    common = [*COMMON, *overrides, f"run_name={name}"]
    ref = losses(shared_runs.records(f"preempt-ref-{plugin}"))

    # Steps 4-40 sleep 0.25 s on rank 0 (a slow_rank fault, no number changes) so that the signal lands
    # in training even when this process is starved of CPU: unslowed, the 37 steps take ~2 s (the same
    # race made test_train_e2e's Ctrl-C arrive after the last step in loaded suites).
    common.append(f"fault.events=[{{kind:slow_rank,step:4,ranks:[0],delay_s:0.25,duration_steps:{MAX_STEPS - 3}}}]")
    proc = runner.start(*common)
    run_dir = runner.workdir / "outputs" / "default" / name
    wait_for(lambda: len(losses(runner.metrics(name))) >= 3, timeout=300, proc=proc)
    t_sent = time.time()
    proc.send_signal(sig)  # the driver only: it forwards the signal to its ranks
    out, _ = proc.communicate(timeout=120)
    exit_s = time.time() - t_sent
    assert proc.returncode == EXIT_PREEMPTED, out[-4000:]
    recs = [json.loads(line) for line in (run_dir / "faults.jsonl").read_text().splitlines() if '"preempted"' in line]
    assert len(recs) == 1, out[-4000:]
    rec = recs[0]
    steps_run = max(losses(runner.metrics(name)))
    # Every rank finished the step it was in and saved it: no finished step is lost. (A signal landing
    # between a step's end and the ranks' agreement on it stops at that step: saved = step_at_signal - 1.)
    assert rec["signal"] == sig.name and rec["saved_step"] == steps_run < MAX_STEPS
    assert rec["step_at_signal"] - 1 <= rec["saved_step"] <= rec["step_at_signal"]
    ckpt = runner.workdir / "checkpoints" / "default" / name
    assert [p.name for p in sorted(ckpt.glob("step*"))] == [f"step{steps_run:08d}"]
    client = MlflowClient(tracking_uri=f"sqlite:///{runner.workdir}/mlruns.db")
    (run,) = client.search_runs([client.get_experiment_by_name("default").experiment_id])
    assert run.info.status == "KILLED" and "(0 finished steps lost)" in run.data.tags[PREEMPTED_TAG]
    print(
        f"\n{plugin}: {sig.name} in step {rec['step_at_signal']}, saved step {rec['saved_step']}, 0 steps lost;"
        f" signal to driver exit {exit_s:.1f} s (measured by the test)"
    )

    again = runner.run(*common)
    assert f"resuming from {ckpt.relative_to(runner.workdir)}/step{steps_run:08d}" in again.stdout
    got = losses(runner.metrics(name))
    for step in range(steps_run + 1, MAX_STEPS + 1):
        assert got[step] == ref[step], f"step {step} after the resume"
    ref_ckpt = shared_runs.checkpoint_dir(f"preempt-ref-{plugin}")
    assert_bitwise_equal(ckpt / f"step{MAX_STEPS:08d}", ref_ckpt / f"step{MAX_STEPS:08d}")
    (run,) = client.search_runs([client.get_experiment_by_name("default").experiment_id])
    assert run.info.status == "FINISHED" and PREEMPTED_TAG not in run.data.tags


def test_ranks_that_saved_exit_without_waiting_out_the_grace_when_every_process_gets_the_signal(runner):
    """Slurm's ``scancel --signal=USR2`` reaches every process of the job (driver, rank server, ranks); the
    elastic agent then closes the ranks while they finish the step and save. Ranks that returned used to wait
    for the agent's "read your return value" event until it SIGKILLed them at ``trainer.stop_grace_s``
    (measured: exit 20.4 s after the signal with 20 s of grace, 'Unable to shutdown process ... forcefully
    exiting via 9' for both ranks; now 0.3 s, framework.driver.launcher.release_finished_ranks_on_close)."""
    proc = runner.start(
        "parallelism=ddp",
        "trainer.micro_batch_size=2",
        "trainer.global_batch_size=4",
        "trainer.max_steps=400",
        "trainer.val_sequences=8",
        "tracking=none",
        "trainer.stop_grace_s=60",
        "checkpoint.every_n_steps=1000",
        "run_name=group_signal",
    )
    wait_for(lambda: len(runner.metrics("group_signal")) >= 3, timeout=300, proc=proc)
    os.killpg(proc.pid, signal.SIGUSR2)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 75, out[-3000:]
    assert "Unable to shutdown process" not in out and "forcefully exiting" not in out
    assert "every rank finished the step and saved step" in out
