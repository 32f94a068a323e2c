"""Two nodes on this machine (issue 17 items 1, 2, 4): two drivers on loopback, 2 gloo ranks each (1 thread
per rank), give the per-step losses of one node with 4 ranks at the same global batch; node 0's driver
owns the MLflow run and the output folder, node 1's makes neither; bad multi-node input is one line.
"""

from __future__ import annotations

import socket
import subprocess

import pytest
from mlflow.tracking import MlflowClient

from tests.integration.conftest import losses

pytestmark = pytest.mark.slow

# The same 4 ranks, the same global batch split the same way: only the process placement differs, so
# the losses agree to float32 summation noise at most (measured: bitwise equal); 1e-6 relative.
PARITY_RTOL = 1e-6
COMMON = ["model.n_layer=2", "model.n_head=2", "model.d_model=64", "trainer.val_sequences=16", "trainer.max_steps=6",
          "trainer.log_every_n_steps=1", "trainer.global_batch_size=8", "trainer.micro_batch_size=2",
          "parallelism=ddp", "parallelism.world_size=4", "checkpoint.every_n_steps=3", "run_name=nodes"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_loopback_nodes_match_one_node_with_four_ranks(runner):
    runner.run(*COMMON, "experiment_name=one_node", "tracking=none")
    ref = losses(runner.metrics("nodes", experiment="one_node"))

    shared = runner.workdir / "shared"
    node1_cwd = runner.workdir / "node1"
    node1_cwd.mkdir()
    two = [*COMMON, "parallelism.nnodes=2", "trainer.threads_per_rank=1", f"checkpoint.dir={shared}",
           f"rendezvous.endpoint=127.0.0.1:{_free_port()}", "rendezvous.timeout_s=120"]
    node1 = subprocess.Popen(runner.args(*two, "rendezvous.node_rank=1"), cwd=node1_cwd, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    node0 = runner.run(*two, "rendezvous.node_rank=0")
    out1, _ = node1.communicate(timeout=300)
    assert node1.returncode == 0, out1[-4000:]
    assert "node 1 of 2: ranks 2..3" in out1

    got = losses(runner.metrics("nodes"))
    assert sorted(got) == sorted(ref) == list(range(1, 7))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=PARITY_RTOL), f"step {step}"
    # node 0 owns the run: one MLflow run, in node 0's folder; node 1 wrote nothing outside the shared folder
    client = MlflowClient(tracking_uri=f"sqlite:///{runner.workdir}/mlruns.db")
    (run,) = client.search_runs([client.get_experiment_by_name("default").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["world_size"] == "4"
    assert [p.name for p in node1_cwd.iterdir()] == []
    assert sorted(p.name for p in shared.glob("step*")) == ["step00000003", "step00000006"]
    assert (shared / "nodes" / "node1" / "launch.json").is_file()
    assert "summary" in node0.stdout


def test_bad_multinode_input_is_one_line(runner):
    tiny = ["parallelism=ddp", "parallelism.world_size=4", "parallelism.nnodes=2", "trainer.global_batch_size=8",
            "trainer.micro_batch_size=2", "rendezvous.timeout_s=3", "tracking=none"]
    mismatch = runner.run(*tiny, "parallelism.nproc_per_node=3", "rendezvous.endpoint=127.0.0.1:29400", check=False)
    assert mismatch.returncode == 2
    assert mismatch.stderr.strip() == ("trainlab: error: parallelism.nnodes=2 x parallelism.nproc_per_node=3 = 6"
                                       " != parallelism.world_size=4")

    port = _free_port()  # nothing listens there
    unreachable = runner.run(*tiny, f"rendezvous.endpoint=127.0.0.1:{port}", "rendezvous.node_rank=1", check=False)
    assert unreachable.returncode == 2
    (line,) = [ln for ln in unreachable.stderr.splitlines() if "error" in ln]
    assert line.startswith(f"trainlab: error: rendezvous.endpoint=127.0.0.1:{port} cannot be reached from node 1"
                           " within rendezvous.timeout_s=3 s")

    with socket.create_server(("127.0.0.1", 0)) as listening:  # an endpoint that answers, a folder node 0 never wrote
        port = listening.getsockname()[1]
        unshared = runner.run(*tiny, f"rendezvous.endpoint=127.0.0.1:{port}", "rendezvous.node_rank=1",
                              f"checkpoint.dir={runner.workdir / 'not_shared'}", check=False)
    assert unshared.returncode == 2
    (line,) = [ln for ln in unshared.stderr.splitlines() if "error" in ln]
    assert line.startswith(f"trainlab: error: checkpoint folder {runner.workdir / 'not_shared'} is not shared: node 1"
                           " does not see node 0's marker")
    assert not (runner.workdir / "outputs").exists()  # node 1 makes no output folder
    db = runner.workdir / "mlruns.db"
    if db.exists():  # and no MLflow run
        client = MlflowClient(tracking_uri=f"sqlite:///{db}")
        assert not [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
