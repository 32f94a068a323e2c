"""Start the ranks with PyTorch's elastic agent (the engine behind ``torchrun``).

The driver calls :func:`launch_ranks` in its own process; the agent spawns
``world_size / nnodes`` workers (``python -m framework.worker launch.json``) on this node,
rendezvouses them over c10d, restarts them up to ``trainer.max_restarts`` times when one fails,
and raises :class:`torch.distributed.elastic.multiprocessing.errors.ChildFailedError` (naming
the failed rank and its error) when they keep failing.

CPU ranks share the node's cores: the launcher sets ``OMP_NUM_THREADS`` to
``cores // ranks_per_node`` for the children (the worker caps torch's pool the same way), so
ranks x threads never exceeds the cores.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import uuid
from pathlib import Path
from typing import Any

from framework.config.resolved import ResolvedRun
from framework.distributed import threads_per_rank


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_launch_file(path: Path, launch: dict[str, Any]) -> Path:
    """Write the launch description the workers read (resolved config, MLflow run, resume path)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(launch, indent=2, default=str))
    return path


def launch_ranks(resolved: ResolvedRun, launch_file: Path, log_dir: Path, max_restarts: int | None = None) -> None:
    """Run every rank of this node to completion.

    ``max_restarts``: elastic restarts of the ranks; None = ``trainer.max_restarts``.

    Raises:
        ChildFailedError: a rank failed and ``trainer.max_restarts`` restarts did not help.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    run = resolved.run
    nproc = resolved.nproc_per_node
    os.environ["OMP_NUM_THREADS"] = str(threads_per_rank(nproc, run.trainer.threads_per_rank))
    # Restarted ranks must not share the agent's rendezvous TCPStore: its keys outlive a round, so
    # a restarted rank can read a dead peer's gloo address (connection refused). Unshared, rank 0
    # hosts a fresh store each round.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=uuid.uuid4().hex[:12],
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        max_restarts=run.trainer.max_restarts if max_restarts is None else max_restarts,
        monitor_interval=0.2,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir)),
    )
    elastic_launch(config, entrypoint=sys.executable)("-u", "-m", "framework.worker", str(launch_file))
