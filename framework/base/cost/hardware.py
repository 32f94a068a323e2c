"""Hardware as config: a cluster's per-GPU figures (``conf/cluster/*.yaml``), pure.

A cluster file names, per GPU: the dense BF16 peak and the fraction of it dense transformer
GEMMs achieve, HBM size and bandwidth, NVLink bandwidth per direction inside a node and the NIC
bandwidth between nodes (with a per-step latency alpha for each), power and a price per
GPU-hour (every assumption labelled as one in the file); optionally ``elementwise_bytes_per_h``, the
memory-bound traffic per layer per token per unit of hidden size (:class:`~framework.base.cost.steptime.StepTimeParams`;
0 when absent: the local CPU's measured GEMM rate absorbs it). ``local_cpu`` says ``measured`` for
what a measurement of this machine fills in: the record of
:func:`framework.base.metrics.local_cpu.load_or_measure_local_cpu` (the fp32 GEMM rate of one rank and,
per collective kind, gloo's alpha and bus bandwidth), passed to :func:`cluster_from_dict` as
``measured``. Nothing here measures or reads a file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

REQUIRED = (
    "name",
    "gpus_per_node",
    "peak_flops",
    "achievable_fraction",
    "hbm_gib",
    "usable_memory_fraction",
    "hbm_bandwidth",
    "nvlink_bandwidth",
    "nvlink_alpha_s",
    "nic_bandwidth",
    "nic_alpha_s",
    "power_w",
    "price_per_gpu_hour",
)
"""Fields every ``conf/cluster/*.yaml`` must set (``measured`` allowed for the local CPU's)."""

KINDS = ("allreduce", "allgather", "reduce_scatter", "p2p")


class ClusterError(ValueError):
    """A cluster file that is missing a field or has a bad value (one line)."""


@dataclass(frozen=True)
class Link:
    """One kind of link: per-step latency ``alpha_s`` (s) and bus bandwidth per GPU per direction
    (bytes/s); ``by_kind`` overrides both per collective kind (the local CPU's measured gloo)."""

    alpha_s: float
    bandwidth: float
    by_kind: dict[str, tuple[float, float]] = field(default_factory=dict)

    def params(self, kind: str) -> tuple[float, float]:
        """``(alpha_s, bandwidth)`` for a collective kind (``reduce_scatter`` falls back to ``allgather``'s)."""
        if kind in self.by_kind:
            return self.by_kind[kind]
        if kind == "reduce_scatter" and "allgather" in self.by_kind:
            return self.by_kind["allgather"]
        return self.alpha_s, self.bandwidth


@dataclass(frozen=True)
class Cluster:
    """Per-GPU figures of a cluster (units: FLOP/s, bytes, bytes/s, s, W, money per GPU-hour)."""

    name: str
    gpus_per_node: int
    peak_flops: float
    achievable_fraction: float
    hbm_bytes: float
    usable_memory_fraction: float
    hbm_bandwidth: float
    nvlink: Link
    nic: Link
    power_w: float
    price_per_gpu_hour: float
    gpu: str = ""
    elementwise_bytes_per_h: float = 0.0

    @property
    def achievable_flops(self) -> float:
        """FLOP/s a rank's dense GEMMs reach: ``peak_flops * achievable_fraction``."""
        return self.peak_flops * self.achievable_fraction

    @property
    def usable_memory_bytes(self) -> float:
        """Bytes a rank can fill with tensors: ``hbm_bytes * usable_memory_fraction``."""
        return self.hbm_bytes * self.usable_memory_fraction

    def link(self, inter_node: bool) -> Link:
        """The NIC between nodes, NVLink inside one."""
        return self.nic if inter_node else self.nvlink


def _num(raw: Mapping[str, Any], key: str, where: str) -> float:
    v = raw[key]
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise ClusterError(f"{where}: cluster.{key}={v!r} must be a number") from None
    if x < 0:
        raise ClusterError(f"{where}: cluster.{key}={v!r} must be >= 0")
    return x


def needs_measurement(raw: Mapping[str, Any]) -> bool:
    """Whether the ``conf/cluster`` mapping ``raw`` says ``measured`` for a required field (``local_cpu``)."""
    return any(raw.get(k) == "measured" for k in REQUIRED)


def cluster_from_dict(
    raw: Mapping[str, Any], *, where: str = "cluster", measured: Mapping[str, Any] | None = None
) -> Cluster:
    """A :class:`Cluster` from a ``conf/cluster`` mapping; fields that say ``measured`` come from the
    record ``measured`` (:func:`framework.base.metrics.local_cpu.load_or_measure_local_cpu`: ``gemm_flops``,
    ``memory_gib``, ``links`` ``{kind: [alpha_s, bus_bandwidth]}``).

    Raises:
        ClusterError: a missing field (all listed, one line), a non-numeric / negative value, or a
            ``measured`` field without a ``measured`` record.
    """
    missing = [k for k in REQUIRED if k not in raw or raw[k] is None]
    if missing:
        raise ClusterError(
            f"{where}: missing field(s) {', '.join('cluster.' + k for k in missing)}; required: {', '.join(REQUIRED)}"
        )
    raw = dict(raw)
    kinds: dict[str, tuple[float, float]] = {}
    if needs_measurement(raw):
        if measured is None:
            raise ClusterError(
                f"{where}: fields say 'measured' but no measurement was given; "
                "measure with python -m framework.base.metrics.local_cpu"
            )
        m = measured
        for k, v in (("peak_flops", m["gemm_flops"]), ("hbm_gib", m["memory_gib"] / int(raw["gpus_per_node"]))):
            if raw[k] == "measured":
                raw[k] = v
        kinds = {k: (float(a), float(b)) for k, (a, b) in m["links"].items()}
        for k in ("nvlink_bandwidth", "nic_bandwidth"):
            if raw[k] == "measured":
                raw[k] = kinds["allreduce"][1]
        for k in ("nvlink_alpha_s", "nic_alpha_s"):
            if raw[k] == "measured":
                raw[k] = kinds["allreduce"][0]
    vals = {k: _num(raw, k, where) for k in REQUIRED if k != "name"}
    for k in ("gpus_per_node", "peak_flops", "achievable_fraction", "hbm_gib", "nvlink_bandwidth", "nic_bandwidth"):
        if vals[k] <= 0:
            raise ClusterError(f"{where}: cluster.{k}={raw[k]!r} must be > 0")
    if not 0 < vals["usable_memory_fraction"] <= 1 or not 0 < vals["achievable_fraction"] <= 1:
        raise ClusterError(f"{where}: cluster.achievable_fraction and cluster.usable_memory_fraction must be in (0, 1]")
    return Cluster(
        name=str(raw["name"]),
        gpu=str(raw.get("gpu", "")),
        gpus_per_node=int(vals["gpus_per_node"]),
        peak_flops=vals["peak_flops"],
        achievable_fraction=vals["achievable_fraction"],
        hbm_bytes=vals["hbm_gib"] * 2**30,
        usable_memory_fraction=vals["usable_memory_fraction"],
        hbm_bandwidth=vals["hbm_bandwidth"],
        nvlink=Link(vals["nvlink_alpha_s"], vals["nvlink_bandwidth"], kinds),
        nic=Link(vals["nic_alpha_s"], vals["nic_bandwidth"], kinds),
        power_w=vals["power_w"],
        price_per_gpu_hour=vals["price_per_gpu_hour"],
        elementwise_bytes_per_h=_num(raw, "elementwise_bytes_per_h", where)
        if raw.get("elementwise_bytes_per_h") is not None
        else 0.0,
    )
