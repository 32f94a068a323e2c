"""The parallel layout of a run: degrees, rank coordinates and the one named device mesh.

``world_size = pp * dp * tp`` ranks on a 3-D mesh with dimension names :data:`MESH_DIM_NAMES`
``("pp", "dp", "tp")``, tp innermost (as in Megatron-LM and torchtitan: TP peers are
neighbouring ranks, so a node holds whole TP groups), so global rank
``r = (pp_i * dp + dp_i) * tp + tp_i``.

Built once, in the driver, from the ``parallelism`` config (:meth:`ParallelLayout.from_config`,
which derives ``dp_degree = -1`` and names every factor when they do not multiply to the world
size); ranks receive it inside the resolved run and never re-derive it. Every strategy builds its
device mesh with :meth:`ParallelLayout.build_device_mesh`, so every plugin sees the same axis names.
Shaped like torchtitan's ``ParallelDims``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from framework.base.config.schema import ConfigError

if TYPE_CHECKING:
    from framework.base.config.schema import ParallelConfig

MESH_DIM_NAMES = ("pp", "dp", "tp")
"""Names of the device-mesh dimensions, outermost first (``layout.build_device_mesh()["dp"]``)."""


@dataclass(frozen=True)
class ParallelLayout:
    """Degrees of one layout, each >= 1: ``world_size = dp * tp * pp``; ``nnodes`` nodes of equal size.

    Raises:
        ConfigError: a degree < 1, or ``world_size`` not a multiple of ``nnodes``.
    """

    dp: int
    tp: int = 1
    pp: int = 1
    nnodes: int = 1

    def __post_init__(self) -> None:
        for axis in ("dp", "tp", "pp", "nnodes"):
            if getattr(self, axis) < 1:
                raise ConfigError(f"parallel layout: {axis}={getattr(self, axis)} must be >= 1")
        if self.world_size % self.nnodes:
            raise ConfigError(
                f"parallelism.world_size={self.world_size} is not divisible by parallelism.nnodes={self.nnodes}"
            )

    @classmethod
    def from_config(cls, par: ParallelConfig) -> ParallelLayout:
        """The layout of a ``parallelism`` config; ``dp_degree = -1`` becomes ``world_size / (tp * pp)``.

        Raises:
            ConfigError: the degrees do not multiply to ``world_size`` (every factor named).
        """
        tp, pp = par.tp_degree, par.pp_degree
        if par.dp_degree == -1:
            if par.world_size % (tp * pp):
                raise ConfigError(
                    f"parallelism.world_size={par.world_size} is not divisible by tp_degree({tp}) x pp_degree({pp})"
                )
            dp = par.world_size // (tp * pp)
        else:
            dp = par.dp_degree
        if dp * tp * pp != par.world_size:
            raise ConfigError(
                f"parallelism.world_size={par.world_size} != dp_degree({dp}) x tp_degree({tp}) x pp_degree({pp}) = {dp * tp * pp}"
            )
        return cls(dp=dp, tp=tp, pp=pp, nnodes=par.nnodes)

    @property
    def world_size(self) -> int:
        """Ranks in all: ``dp * tp * pp``."""
        return self.dp * self.tp * self.pp

    @property
    def nproc_per_node(self) -> int:
        """Ranks per node: ``world_size / nnodes``."""
        return self.world_size // self.nnodes

    @property
    def shape(self) -> tuple[int, int, int]:
        """Mesh shape in :data:`MESH_DIM_NAMES` order: ``(pp, dp, tp)``."""
        return (self.pp, self.dp, self.tp)

    def degree(self, axis: str) -> int:
        """The degree of mesh axis ``axis`` (``"pp"``, ``"dp"`` or ``"tp"``).

        Raises:
            KeyError: an unknown axis name.
        """
        if axis not in MESH_DIM_NAMES:
            raise KeyError(f"unknown mesh axis {axis!r}; allowed: {', '.join(MESH_DIM_NAMES)}")
        return getattr(self, axis)

    def coordinates(self, rank: int) -> dict[str, int]:
        """``{"pp": i, "dp": j, "tp": k}`` of global ``rank`` on the mesh (tp innermost).

        Raises:
            ValueError: ``rank`` outside ``[0, world_size)``.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size})")
        return {"pp": rank // (self.dp * self.tp), "dp": (rank // self.tp) % self.dp, "tp": rank % self.tp}

    def dp_rank(self, rank: int) -> int:
        """Which data shard global ``rank`` reads: its ``dp`` coordinate (TP and PP peers read the same data)."""
        return self.coordinates(rank)["dp"]

    def node_of(self, rank: int) -> int:
        """The node of global ``rank``: ``rank // nproc_per_node`` (node ``k`` holds ranks ``k * nproc_per_node`` ..)."""
        return rank // self.nproc_per_node

    def nodes_per_group(self, axis: str) -> int:
        """The most nodes one process group of mesh axis ``axis`` spans (1: every such group is inside a node).

        A group of ``axis`` is the ranks that differ only in their ``axis`` coordinate. With TP
        innermost, a TP group stays in a node when ``tp`` divides ``nproc_per_node``; which of DP
        and PP cross nodes depends on the sizes (dp4 on 2 nodes: dp spans 2; dp2 x tp2 x pp2 on 2
        nodes of 4 ranks: each node is one pipeline stage, pp spans 2, dp 1). Enumerates the ranks
        (O(world_size)).

        Raises:
            KeyError: an unknown axis name.
        """
        self.degree(axis)  # KeyError on an unknown axis
        nodes: dict[tuple[int, ...], set[int]] = {}
        for rank in range(self.world_size):
            c = self.coordinates(rank)
            nodes.setdefault(tuple(v for k, v in c.items() if k != axis), set()).add(self.node_of(rank))
        return max(len(v) for v in nodes.values())

    def cross_node_axes(self) -> tuple[str, ...]:
        """The mesh axes (in :data:`MESH_DIM_NAMES` order) whose groups span more than one node: their
        collectives cross the network between nodes (MLflow param ``derived.cross_node_axes``)."""
        return tuple(a for a in MESH_DIM_NAMES if self.degree(a) > 1 and self.nodes_per_group(a) > 1)

    def describe(self) -> str:
        """``dp2-tp1-pp1``: the layout as a short tag (MLflow tag ``layout``)."""
        return f"dp{self.dp}-tp{self.tp}-pp{self.pp}"

    def build_device_mesh(self, device_type: str) -> Any:
        """The run's ``torch.distributed.DeviceMesh`` of shape :attr:`shape`, named :data:`MESH_DIM_NAMES`.

        Needs an initialised default process group of ``world_size`` ranks; select a dimension
        with ``mesh["dp"]`` (or several with ``mesh["dp", "tp"]``).

        Raises:
            RuntimeError: the process group's size differs from ``world_size``.
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if dist.get_world_size() != self.world_size:
            raise RuntimeError(
                f"process group of {dist.get_world_size()} ranks != pp({self.pp}) x dp({self.dp}) x tp({self.tp}) = {self.world_size}"
            )
        return init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIM_NAMES)
