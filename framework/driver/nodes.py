"""Multi-node runs: which node this driver is, where the rendezvous is, and the checks made before any rank starts.

Every node runs the same command (``python -m framework.train parallelism.nnodes=N …``) with its
own ``rendezvous.node_rank`` (under Slurm: ``$SLURM_NODEID``). Each node's driver starts that
node's ranks with torch's elastic agent (:mod:`framework.driver.launcher`), which joins torch's
*static* TCP rendezvous at ``rendezvous.endpoint`` (node 0's agent hosts it; the rendezvous
``torchrun --node-rank --master-addr --master-port`` uses). Static, not c10d: the c10d
rendezvous numbers the nodes by sorting their (hostname, pid), so node 0's driver -- the one
that owns the MLflow run and the output folder, and whose ranks must hold global rank 0, which
logs -- could get any node rank.

- Node 0's driver validates, opens the MLflow run, makes the output folder, and writes the
  marker :data:`MARKER` into the checkpoint folder.
- Node ``k > 0``'s driver opens no MLflow run and makes no output folder: its Hydra folder, launch
  file and the agent's logs go to ``<checkpoint_dir>/nodes/node<k>`` (:func:`node_dir`). Before
  its ranks start it checks that node 0's endpoint answers (:func:`check_endpoint`) and that it
  sees node 0's marker (:func:`wait_for_shared_folder`): checkpoints are written by rank 0 and
  read by every rank, so the folder must be one that every node sees (a shared filesystem).

Ranks on node ``k`` are ``k * nproc_per_node + local_rank``; with the layout's order (TP
fastest, :mod:`framework.base.layout`), a TP group stays inside a node when ``tp_degree`` divides
``nproc_per_node`` (checked), and DP/PP groups span the nodes.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections.abc import Mapping
from pathlib import Path

from framework.base.config.schema import ConfigError
from framework.base.launch import NodeSpec

MARKER = ".trainlab-node0.json"
"""Node 0's marker in the checkpoint folder: ``{"id": <rendezvous id>, "t": <Unix time>}``."""

NODE_POLICIES = ("restart", "shrink")
"""The resilience policies of a multi-node run: a lost node is restarted by the drivers, or node 0 goes on alone
(:func:`framework.driver.faults.supervisor.supervise`)."""

SLURM_PORT = 29500
"""The rendezvous port under Slurm when ``rendezvous.endpoint`` is null (torchrun's default port)."""


def resolve_nodes(run, env: Mapping[str, str] = os.environ) -> NodeSpec | None:
    """This driver's :class:`NodeSpec` from ``run.rendezvous`` (null values from Slurm's ``env``); None on one node.

    Raises:
        ConfigError: no endpoint (outside Slurm), a node rank outside ``0..nnodes-1``, or a
            setting a multi-node run does not support yet (fault injection, restarts).
    """
    par, rdzv = run.parallelism, run.rendezvous
    if par.nnodes == 1:
        return None
    slurm = "SLURM_JOB_ID" in env
    errors = []
    endpoint = rdzv.endpoint
    if endpoint is None and slurm and env.get("SLURM_LAUNCH_NODE_IPADDR"):
        endpoint = f"{env['SLURM_LAUNCH_NODE_IPADDR']}:{SLURM_PORT}"
    if endpoint is None:
        errors.append(
            f"rendezvous.endpoint is required with parallelism.nnodes={par.nnodes}: node 0's host:port, the"
            " same on every node (e.g. node0.cluster:29500; under Slurm it comes from SLURM_LAUNCH_NODE_IPADDR)"
        )
    node_rank = rdzv.node_rank if rdzv.node_rank is not None else int(env.get("SLURM_NODEID", "0"))
    if not 0 <= node_rank < par.nnodes:
        errors.append(
            f"rendezvous.node_rank={node_rank} is not a node of parallelism.nnodes={par.nnodes}"
            f" (allowed: 0..{par.nnodes - 1})"
        )
    from framework.base.faults.schedule import faults_enabled

    if faults_enabled(run) and (
        run.resilience.policy not in NODE_POLICIES
        or run.fault.events
        or run.fault.mtbf_steps > 0
        or run.resilience.skip_steps
    ):
        errors.append(
            f"fault={run.fault.name} / resilience={run.resilience.policy}: fault injection and the in-process"
            f" policies run on one node only yet (parallelism.nnodes={par.nnodes}; allowed: fault=none"
            f" resilience={'|'.join(('none', *NODE_POLICIES))})"
        )
    if run.trainer.max_restarts:
        errors.append(
            f"trainer.max_restarts={run.trainer.max_restarts}: the elastic agent cannot restart ranks across"
            f" nodes with the static rendezvous (allowed with parallelism.nnodes={par.nnodes}: 0; use"
            " resilience=restart, whose restarts the drivers make)"
        )
    if errors:
        raise ConfigError("; ".join(errors))
    # the agent names its log folder after the id: path-safe characters only
    rdzv_id = re.sub(r"[^\w.-]", "_", rdzv.id or env.get("SLURM_JOB_ID") or f"{run.experiment_name}.{run.run_name}")
    return NodeSpec(
        nnodes=par.nnodes, node_rank=node_rank, endpoint=endpoint, rdzv_id=rdzv_id, timeout_s=rdzv.timeout_s
    )


def node_dir(checkpoint_dir: str | Path, node_rank: int) -> Path:
    """Node ``node_rank``'s (> 0) folder for its launch file and agent logs, in the shared checkpoint folder."""
    return Path(checkpoint_dir) / "nodes" / f"node{node_rank}"


def hydra_run_dir(experiment_name: str, run_name: str, checkpoint_dir: str | None, node_rank: int | None) -> str:
    """The Hydra output folder of this node's driver: ``outputs/<experiment>/<run>`` on node 0 (and on
    one node), :func:`node_dir` on the others (the ``tl_run_dir`` resolver of ``conf/config.yaml``)."""
    rank = node_rank if node_rank is not None else int(os.environ.get("SLURM_NODEID", "0"))
    if rank <= 0:
        return f"outputs/{experiment_name}/{run_name}"
    return str(node_dir(checkpoint_dir or f"checkpoints/{experiment_name}/{run_name}", rank))


def hydra_sweep_subdir(experiment_name: str, run_name: str, checkpoint_dir: str | None, node_rank: int | None) -> str:
    """A sweep job's Hydra sub-folder (under ``hydra.sweep.dir`` = ``outputs/<experiment>``): the run name on
    node 0, and on the other nodes :func:`hydra_run_dir`'s folder as an absolute path (which replaces the sweep
    folder), so that a multi-node job of a sweep (e.g. ``-m hydra/launcher=submitit_slurm parallelism.nnodes=2``)
    keeps node k's files and lock out of node 0's run folder (the ``tl_sweep_subdir`` resolver)."""
    rank = node_rank if node_rank is not None else int(os.environ.get("SLURM_NODEID", "0"))
    if rank <= 0:
        return run_name
    return str(Path(hydra_run_dir(experiment_name, run_name, checkpoint_dir, rank)).absolute())


def check_endpoint(nodes: NodeSpec) -> None:
    """Node 0: it can listen on the endpoint. Other nodes: the endpoint answers within ``timeout_s``
    (node 0's agent listens there once node 0 has tokenized and opened its run).

    Raises:
        ConfigError: one line naming the endpoint.
    """
    if nodes.node_rank == 0:
        try:
            with socket.create_server((nodes.host, nodes.port)):
                return
        except OSError as err:
            why = (err.strerror or str(err)).split(" (while attempting")[0]  # create_server appends the address again
            raise ConfigError(
                f"rendezvous.endpoint={nodes.endpoint}: node 0 cannot listen there ({why}); it must"
                " be an address of node 0 and a free port"
            ) from None
    deadline = time.monotonic() + nodes.timeout_s
    while True:
        try:
            with socket.create_connection((nodes.host, nodes.port), timeout=2):
                return
        except OSError as err:
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"rendezvous.endpoint={nodes.endpoint} cannot be reached from node {nodes.node_rank}"
                    f" within rendezvous.timeout_s={nodes.timeout_s} s ({err.strerror or err}); start node 0"
                    " with the same command, or check the host and port"
                ) from None
            time.sleep(0.5)


def mark_shared_folder(checkpoint_dir: str | Path, nodes: NodeSpec) -> None:
    """Node 0: write :data:`MARKER` (this rendezvous id) into the checkpoint folder for the other nodes to find."""
    folder = Path(checkpoint_dir)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f"{MARKER}.tmp"
    tmp.write_text(json.dumps({"id": nodes.rdzv_id, "t": time.time()}))
    tmp.replace(folder / MARKER)


def wait_for_shared_folder(checkpoint_dir: str | Path, nodes: NodeSpec) -> None:
    """Node ``k > 0``: wait up to ``timeout_s`` for node 0's marker of this rendezvous id in the checkpoint folder.

    Raises:
        ConfigError: the marker never appeared: the folder is not the one node 0 writes (not shared).
    """
    path = Path(checkpoint_dir) / MARKER
    deadline = time.monotonic() + nodes.timeout_s
    while time.monotonic() <= deadline:
        try:
            if json.loads(path.read_text()).get("id") == nodes.rdzv_id:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    raise ConfigError(
        f"checkpoint folder {checkpoint_dir} is not shared: node {nodes.node_rank} does not see node 0's"
        f" marker {MARKER} (rendezvous id {nodes.rdzv_id!r}) within {nodes.timeout_s} s; every node must see"
        " the same folder (set checkpoint.dir to a shared filesystem path)"
    )
