"""The launch object: everything the driver hands the ranks of one launch, typed.

The driver validates the config once (:func:`framework.driver.validate.validate`), opens the
MLflow run, chooses the checkpoint to resume from, and writes a :class:`LaunchSpec` to the run's
``launch.json``; every rank reads it back (:meth:`LaunchSpec.read`) and never validates again.
The supervisor (:mod:`framework.driver.faults.supervisor`) adds the fault schedule and, on a shrink,
writes a new one with the run re-resolved at the smaller world size.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from framework.base.resolved import ResolvedRun


@dataclass(frozen=True)
class NodeSpec:
    """This node of a multi-node run (``parallelism.nnodes > 1``).

    Attributes:
        nnodes: nodes in the run.
        node_rank: this node, ``0 .. nnodes-1``.
        endpoint: ``host:port`` of the rendezvous, on node 0.
        rdzv_id: the rendezvous id, the same on every node (characters other than letters, digits, ``_.-`` become ``_``).
        timeout_s: seconds to wait for node 0's endpoint, the marker and the other nodes.
    """

    nnodes: int
    node_rank: int
    endpoint: str
    rdzv_id: str
    timeout_s: int

    @property
    def host(self) -> str:
        return self.endpoint.rpartition(":")[0]

    @property
    def port(self) -> int:
        return int(self.endpoint.rpartition(":")[2])


@dataclass(frozen=True)
class LaunchSpec:
    """What every rank of one launch starts from.

    Attributes:
        resolved: the validated run with its layout and batch split (built by the driver).
        run_dir: the run's output folder (metrics, summary, fault log, profiles).
        mlflow_run_id: the driver's MLflow run that rank 0 logs into (through its outbox); None without tracking.
        resume_from: the checkpoint folder the first start of the ranks loads; None: from scratch.
        token_cache_dir: the token cache the driver built before any rank started.
        fault_schedule: the faults to inject (JSON-able events of
            :func:`framework.base.faults.schedule.build_schedule`); empty without faults.
        launch_index: the driver's relaunch count (0 until the first shrink).
        shrunk_at_step: the checkpoint step the current (shrunk) launch resumed from; None before a shrink.
        nodes: this node of a multi-node run (:class:`~framework.base.launch.NodeSpec`); None on one node.
    """

    resolved: ResolvedRun
    run_dir: Path
    mlflow_run_id: str | None
    resume_from: str | None
    token_cache_dir: str
    fault_schedule: list[dict[str, Any]] = field(default_factory=list)
    launch_index: int = 0
    shrunk_at_step: int | None = None
    nodes: NodeSpec | None = None

    def replace(self, **changes: Any) -> LaunchSpec:
        """A copy with ``changes`` applied (e.g. the next launch after a shrink)."""
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        """The JSON text of ``launch.json``; inverse of :meth:`from_json`."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return json.dumps(
            {
                **data,
                "resolved": self.resolved.to_dict(),
                "run_dir": str(self.run_dir),
                "nodes": dataclasses.asdict(self.nodes) if self.nodes else None,
            },
            indent=2,
        )

    @classmethod
    def from_json(cls, text: str) -> LaunchSpec:
        """Parse :meth:`to_json`'s text; the resolved run is typed again, not re-validated.

        Raises:
            ConfigError: a config value fails its field's own check (the file was edited by hand).
        """
        from framework.base.load import resolved_from_dict

        data = json.loads(text)
        nodes = data.get("nodes")
        return cls(
            **{
                **data,
                "resolved": resolved_from_dict(data["resolved"]),
                "run_dir": Path(data["run_dir"]),
                "nodes": NodeSpec(**nodes) if nodes else None,
            }
        )

    def write(self, path: Path) -> Path:
        """Write to ``path`` (parent folders created); returns ``path``."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())
        return path

    @classmethod
    def read(cls, path: str | Path) -> LaunchSpec:
        """Read a file written by :meth:`write`."""
        return cls.from_json(Path(path).read_text())
