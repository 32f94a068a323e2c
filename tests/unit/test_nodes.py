"""Multi-node settings (framework/driver/nodes.py) and the driver's reading of a preemption (framework/base/faults/preemption.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import pytest

from framework.base.config.schema import ConfigError
from framework.base.faults.events import FaultLog
from framework.base.faults.preemption import preemption_outcome
from framework.base.launch import LaunchSpec
from framework.driver.nodes import (
    MARKER,
    hydra_run_dir,
    hydra_sweep_subdir,
    mark_shared_folder,
    resolve_nodes,
    wait_for_shared_folder,
)
from framework.driver.validate import load_run_config, validate

TWO_NODES = [
    "parallelism=ddp",
    "parallelism.world_size=4",
    "parallelism.nnodes=2",
    "trainer.global_batch_size=8",
    "trainer.micro_batch_size=2",
    "tracking=none",
    "checkpoint=none",
]


def test_nodes_come_from_the_config_or_from_slurm(compose):
    run = load_run_config(compose(*TWO_NODES, "rendezvous.endpoint=10.0.0.1:29400", "rendezvous.node_rank=1"))
    nodes = resolve_nodes(run, env={})
    assert (nodes.node_rank, nodes.endpoint, nodes.host, nodes.port) == (1, "10.0.0.1:29400", "10.0.0.1", 29400)
    assert nodes.rdzv_id == f"{run.experiment_name}.{run.run_name}".replace(
        "/", "_"
    )  # the same on every node of the same command
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NODEID": "1", "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.9"}
    nodes = resolve_nodes(load_run_config(compose(*TWO_NODES)), env=slurm)
    assert (nodes.node_rank, nodes.endpoint, nodes.rdzv_id) == (1, "10.0.0.9:29500", "4242")
    assert resolve_nodes(load_run_config(compose("parallelism=ddp", "tracking=none")), env=slurm) is None  # one node


def test_multinode_refusals_are_one_line_naming_the_key(compose):
    with pytest.raises(ConfigError, match=r"^rendezvous.endpoint is required with parallelism.nnodes=2"):
        resolve_nodes(load_run_config(compose(*TWO_NODES)), env={})
    with pytest.raises(
        ConfigError, match=r"^trainer.max_restarts=1: the elastic agent cannot restart ranks across nodes"
    ):
        resolve_nodes(load_run_config(compose(*TWO_NODES, "rendezvous.endpoint=h:1", "trainer.max_restarts=1")), env={})
    with pytest.raises(ConfigError, match=r"fault injection and the in-process policies run on one node only yet"):
        validate(
            load_run_config(compose(*TWO_NODES, "rendezvous.endpoint=h:1", "fault=rank_crash", "resilience=restart"))
        )
    with pytest.raises(ConfigError, match=r"allowed: fault=none resilience=none\|restart\|shrink"):
        validate(load_run_config(compose(*TWO_NODES, "rendezvous.endpoint=h:1", "resilience=rollback")))
    for policy in ("restart", "shrink"):  # a lost node: the drivers restart every node, or node 0 goes on alone
        assert (
            resolve_nodes(
                validate(load_run_config(compose(*TWO_NODES, "rendezvous.endpoint=h:1", f"resilience={policy}"))).run,
                env={},
            ).nnodes
            == 2
        )


def test_the_launch_file_carries_the_node_and_node_k_writes_into_the_shared_folder(compose, tmp_path):
    resolved = validate(load_run_config(compose(*TWO_NODES, "rendezvous.endpoint=127.0.0.1:29400")))
    nodes = resolve_nodes(resolved.run, env={})
    launch = LaunchSpec(
        resolved=resolved,
        run_dir=tmp_path,
        mlflow_run_id=None,
        resume_from=None,
        token_cache_dir=str(tmp_path),
        nodes=nodes,
    )
    assert LaunchSpec.read(launch.write(tmp_path / "launch.json")) == launch
    assert hydra_run_dir("e", "r", None, 0) == "outputs/e/r"
    assert hydra_run_dir("e", "r", "/shared/ck", 1) == "/shared/ck/nodes/node1"
    # a sweep job (under outputs/<experiment>): the run name on node 0, node k's folder (absolute) elsewhere
    assert hydra_sweep_subdir("e", "s/j", None, 0) == "s/j"
    assert hydra_sweep_subdir("e", "s/j", "/shared/ck", 1) == "/shared/ck/nodes/node1"
    assert os.path.join("outputs/e", hydra_sweep_subdir("e", "s/j", None, 2)) == str(
        Path("checkpoints/e/s/j/nodes/node2").absolute()
    )
    mark_shared_folder(tmp_path, nodes)
    wait_for_shared_folder(tmp_path, nodes)  # node 0's marker of this rendezvous: seen at once
    (tmp_path / MARKER).write_text(json.dumps({"id": "another job", "t": 0}))
    with pytest.raises(ConfigError, match="is not shared"):
        wait_for_shared_folder(tmp_path, dataclasses.replace(nodes, timeout_s=1))


def test_the_driver_reads_a_preemption_from_the_event_log(tmp_path):
    log = FaultLog(tmp_path)
    log.append("step", step=6)  # an earlier attempt's record is not this attempt's
    assert preemption_outcome(tmp_path, str(tmp_path / "ck"), since=time.time() + 1) is None
    since = time.time()
    for step in (7, 8, 9):
        log.append("step", step=step)
    log.append("preempted", signal="SIGTERM", step_at_signal=9, saved_step=9, t_signal=since)
    got = preemption_outcome(tmp_path, str(tmp_path / "ck"), since=since)
    assert (got.signal, got.saved, got.saved_step, got.steps_lost) == ("SIGTERM", True, 9, 0)
    assert got.describe(now=since + 2.5).endswith("saved step 9 (0 finished steps lost); 2.5 s from the signal to exit")
    # the driver got the signal, the ranks were killed before they saved: no checkpoint, 3 steps lost
    since2 = time.time()
    for step in (1, 2, 3):
        log.append("step", step=step)
    lost = preemption_outcome(tmp_path, str(tmp_path / "ck"), since=since2, signal_name="SIGUSR1")
    assert (lost.saved, lost.saved_step, lost.steps_lost) == (False, 0, 3)


def test_a_signal_before_the_ranks_start_is_its_own_preemption(tmp_path):
    out = preemption_outcome(
        tmp_path, str(tmp_path / "ck"), since=0.0, signal_name="SIGTERM", before_ranks=True, t_signal=100.0
    )
    assert (out.saved, out.saved_step, out.steps_lost) == (False, 0, 0)
    assert out.describe(now=101.5) == (
        "SIGTERM before the ranks started: nothing ran in this attempt; the newest"
        " checkpoint is step 0 (0 finished steps lost); 1.5 s from the signal to exit"
    )


def test_the_early_signal_guard_raises_in_the_main_thread_and_leaves_the_handlers_as_they_were():
    import os
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from framework.base.faults.preemption import EarlySignals

    before = signal.getsignal(signal.SIGUSR1)
    blocked = []
    guard = EarlySignals(blocked.append, grace_s=0.1)
    with pytest.raises(SignalException):
        with guard:
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(1.0)  # the handler runs here, in the main thread: the watcher does not call on_blocked
    assert guard.fired == signal.SIGUSR1 and blocked == []
    assert signal.getsignal(signal.SIGUSR1) == before


@pytest.mark.parametrize("resume", ["never", "first", "auto"])
def test_after_a_failure_every_node_resumes_from_the_same_checkpoint(compose, tmp_path, monkeypatch, resume):
    """Node 0's relaunch and node 1's rejoin take the same checkpoint, the newest valid one, whatever ``resume``
    said at the start (before: node 1 took ``resume``'s choice again, a fresh start under ``never`` or the named
    folder, while node 0's ranks resumed at the newest step); a corrupt newer one is passed over by both."""
    from framework.base.checkpoint.format import write_checkpoint
    from framework.driver.faults import supervisor

    ckpt = tmp_path / "ckpt"
    meta = {"kind": "full", "base": None, "tokens_seen": 0}
    first = write_checkpoint(ckpt, 2, {"w": 2}, meta)
    newest = write_checkpoint(ckpt, 4, {"w": 4}, meta)
    broken = write_checkpoint(ckpt, 6, {"w": 6}, meta)
    next(p for p in broken.iterdir() if p.name != "manifest.json").write_bytes(b"torn")
    resolved = validate(load_run_config(compose(*TWO_NODES, "rendezvous.endpoint=127.0.0.1:29400")))
    named = {"first": str(first)}.get(resume, resume)
    resolved = dataclasses.replace(
        resolved,
        run=dataclasses.replace(resolved.run, resume=named),
        checkpoint_dir=str(ckpt),
    )
    nodes = resolve_nodes(resolved.run, env={})
    launch = LaunchSpec(
        resolved=resolved,
        run_dir=tmp_path,
        mlflow_run_id=None,
        resume_from=None if resume == "never" else str(first),
        token_cache_dir=str(tmp_path),
        nodes=nodes,
    )
    node0 = supervisor._relaunch_nodes(launch, FaultLog(tmp_path), RuntimeError("rank 3 lost"), 1, 2)
    monkeypatch.setattr("framework.driver.nodes.check_endpoint", lambda nodes: None)  # node 0 answers
    node1 = supervisor._rejoin_node0(
        dataclasses.replace(launch, nodes=dataclasses.replace(nodes, node_rank=1)), RuntimeError("peer"), 1, 2
    )
    assert node0.resume_from == node1.resume_from == str(newest)
    assert node0.launch_index == node1.launch_index == 1
