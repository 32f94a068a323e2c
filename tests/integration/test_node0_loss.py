"""Node 0 lost (its driver and ranks SIGKILLed; it hosts the rendezvous and the MLflow run): node 1, under
``resilience=restart``, waits for node 0's endpoint at most ``rendezvous.timeout_s``, then exits 1 with one
line (not the agent's store timeout behind a C++ stack trace), and ends the run's MLflow run FAILED with the
reason (both nodes on one tracking store). Two loopback nodes x 1 rank, DDP, gpt_tiny."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
from mlflow.tracking import MlflowClient

from framework.driver.nodes import MARKER
from tests.integration.conftest import wait_for
from tests.integration.test_multinode import _free_port

pytestmark = pytest.mark.slow


def test_losing_node0_ends_node1_in_one_line_and_the_run_failed(runner):
    shared, node1_cwd = runner.workdir / "shared", runner.workdir / "node1"
    node1_cwd.mkdir()
    uri = f"sqlite:///{runner.workdir}/mlruns.db"
    runner._seed_mlflow_store()
    two = [
        "parallelism=ddp",
        "parallelism.world_size=2",
        "parallelism.nnodes=2",
        "trainer.threads_per_rank=1",
        f"checkpoint.dir={shared}",
        f"rendezvous.endpoint=127.0.0.1:{_free_port()}",
        "rendezvous.timeout_s=15",
        "trainer.max_steps=300",
        "checkpoint.every_n_steps=3",
        "trainer.global_batch_size=4",
        "trainer.micro_batch_size=2",
        "trainer.val_sequences=8",
        "tracking.system_metrics_interval_s=0",
        f"tracking.uri={uri}",
        "run_name=lost0",
        "resilience=restart",
        "resilience.max_restarts=1",
    ]
    log0 = runner.workdir / "node0.log"
    node0 = subprocess.Popen(
        runner.args(*two, "rendezvous.node_rank=0"),
        cwd=runner.workdir,
        stdout=log0.open("w"),
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    # node 1 starts once node 0 listens and has marked the shared folder, so rendezvous.timeout_s (15 s) bounds
    # only node 1's start-up for node 0's rendezvous (~5 s on 2 cores) and, at the end, its wait for the lost node 0
    wait_for(lambda: (shared / MARKER).is_file() or node0.poll() is not None, timeout=120)
    log1 = runner.workdir / "node1.log"
    node1 = subprocess.Popen(
        runner.args(*two, "rendezvous.node_rank=1"),
        cwd=node1_cwd,
        stdout=log1.open("w"),
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    wait_for(lambda: any(shared.glob("step*/manifest.json")) or node0.poll() is not None, timeout=400)
    assert node0.poll() is None, log0.read_text()[-3000:]
    os.killpg(node0.pid, signal.SIGKILL)
    node0.wait()
    assert node1.wait(timeout=300) == 1
    lines = [ln for ln in log1.read_text().splitlines() if ln.startswith("trainlab: node 1")]
    assert "restart 1/1: joining node 0 again" in lines[-3]
    assert lines[-2].startswith("trainlab: node 1: error: rendezvous.endpoint=127.0.0.1:")
    assert "cannot be reached from node 1 within rendezvous.timeout_s=15 s" in lines[-2]
    assert "frame #" not in log1.read_text().split(lines[-3])[1]  # no C++ stack trace after the restart
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("default").experiment_id])
    assert run.info.status == "FAILED" and run.data.tags["error"].startswith("node 0 lost (rendezvous.endpoint=")
