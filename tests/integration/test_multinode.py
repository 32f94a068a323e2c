"""Two nodes on this machine (issue 17 items 1, 2, 4): two drivers on loopback, 2 gloo ranks each (1 thread
per rank), give the per-step losses of one node with 4 ranks at the same global batch, for ddp and fsdp
(sharded); node 0's driver
owns the MLflow run and the output folder, node 1's makes neither; bad multi-node input is one line.
"""

from __future__ import annotations

import socket
import subprocess

import pytest
from mlflow.tracking import MlflowClient

from tests.integration.conftest import Runner, losses

pytestmark = pytest.mark.slow

# The same 4 ranks, the same global batch split the same way: only the process placement differs, so
# the losses agree to float32 summation noise at most (measured: bitwise equal); 1e-6 relative.
PARITY_RTOL = 1e-6
COMMON = ["model.n_layer=2", "model.n_head=2", "model.d_model=64", "trainer.val_sequences=16", "trainer.max_steps=6",
          "trainer.log_every_n_steps=1", "trainer.global_batch_size=8", "trainer.micro_batch_size=2",
          "parallelism.world_size=4", "checkpoint.every_n_steps=3"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PLUGINS = ("ddp", "fsdp")  # fsdp: the sharded plugin (parameters, gradients and optimizer state sharded over the 4 ranks)


def _two_nodes(runner, overrides: list[str], shared, node1_cwd) -> tuple[subprocess.CompletedProcess, str]:
    """Node 1 (its own working folder) and node 0 (``runner``'s) with the same command; returns (node 0's run, node 1's output)."""
    node1_cwd.mkdir(exist_ok=True)
    two = [*overrides, "parallelism.nnodes=2", "trainer.threads_per_rank=1", f"checkpoint.dir={shared}",
           f"rendezvous.endpoint=127.0.0.1:{_free_port()}", "rendezvous.timeout_s=120"]
    node1 = subprocess.Popen(runner.args(*two, "rendezvous.node_rank=1"), cwd=node1_cwd, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    node0 = runner.run(*two, "rendezvous.node_rank=0")
    out1, _ = node1.communicate(timeout=300)
    assert node1.returncode == 0, out1[-4000:]
    return node0, out1


@pytest.fixture(scope="module")
def parity(tmp_path_factory, data_cache):
    """Per plugin: the losses of one node with 4 ranks (experiment one_node) and of two loopback nodes x 2 ranks
    (experiment default, run ``nodes_<plugin>``), one scratch folder."""
    runner = Runner(tmp_path_factory.mktemp("multinode"), data_cache)
    out = {}
    for plugin in PLUGINS:
        common = [*COMMON, f"parallelism={plugin}", f"run_name=nodes_{plugin}"]
        runner.run(*common, "experiment_name=one_node", "tracking=none")
        shared = runner.workdir / f"shared_{plugin}"
        node0, out1 = _two_nodes(runner, common, shared, runner.workdir / f"node1_{plugin}")
        out[plugin] = dict(ref=losses(runner.metrics(f"nodes_{plugin}", experiment="one_node")),
                           got=losses(runner.metrics(f"nodes_{plugin}")), node0=node0, out1=out1, shared=shared)
    return runner, out


@pytest.mark.parametrize("plugin", PLUGINS)
def test_two_loopback_nodes_match_one_node_with_four_ranks(parity, plugin):
    runner, runs = parity
    r = runs[plugin]
    assert "node 1 of 2: ranks 2..3" in r["out1"]
    ref, got = r["ref"], r["got"]
    assert sorted(got) == sorted(ref) == list(range(1, 7))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=PARITY_RTOL), f"{plugin} step {step}"
    # node 0 owns the run: one MLflow run, in node 0's folder; node 1 wrote nothing outside the shared folder
    client = MlflowClient(tracking_uri=f"sqlite:///{runner.workdir}/mlruns.db")
    (run,) = client.search_runs([client.get_experiment_by_name("default").experiment_id],
                                f"tags.mlflow.runName = 'nodes_{plugin}'")
    assert run.info.status == "FINISHED" and run.data.tags["world_size"] == "4"
    assert [p.name for p in (runner.workdir / f"node1_{plugin}").iterdir()] == []
    assert sorted(p.name for p in r["shared"].glob("step*")) == ["step00000003", "step00000006"]
    assert (r["shared"] / "nodes" / "node1" / "launch.json").is_file()
    assert "summary" in r["node0"].stdout


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
