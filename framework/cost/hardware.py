"""Hardware as config: a cluster's per-GPU figures (``conf/cluster/*.yaml``) and the local CPU,
measured.

A cluster file names, per GPU: the dense BF16 peak and the fraction of it dense transformer
GEMMs achieve, HBM size and bandwidth, NVLink bandwidth per direction inside a node and the NIC
bandwidth between nodes (with a per-step latency alpha for each), power and a price per
GPU-hour (every assumption labelled as one in the file); optionally ``elementwise_bytes_per_h``, the
memory-bound traffic per layer per token per unit of hidden size (:class:`~framework.cost.steptime.StepTimeParams`;
0 when absent: the local CPU's measured GEMM rate absorbs it). ``local_cpu`` says ``measured`` for
what :func:`measure_local_cpu` fills in: the fp32 GEMM rate of one rank
(:func:`framework.metrics.flops.peak_flops`) and, per collective kind, gloo's alpha and bus
bandwidth from a 2-rank microbenchmark (all-reduce, all-gather, reduce-scatter, send/recv over 4 KiB-32 MiB,
least-squares fit of ``t = alpha_fit + wire_bytes / bw``), cached in
``<cache_dir>/local_cpu.json``.

Run ``python -m framework.cost.hardware`` to re-measure (2 processes: wrap in flock).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

REQUIRED = ("name", "gpus_per_node", "peak_flops", "achievable_fraction", "hbm_gib", "usable_memory_fraction",
            "hbm_bandwidth", "nvlink_bandwidth", "nvlink_alpha_s", "nic_bandwidth", "nic_alpha_s", "power_w",
            "price_per_gpu_hour")
"""Fields every ``conf/cluster/*.yaml`` must set (``measured`` allowed for the local CPU's)."""

KINDS = ("allreduce", "allgather", "reduce_scatter", "p2p")
CACHE_FILE = "local_cpu.json"


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


def cluster_from_dict(raw: Mapping[str, Any], *, where: str = "cluster", cache_dir: str = ".cache/cost",
                      measure: bool = True) -> Cluster:
    """A :class:`Cluster` from a ``conf/cluster`` mapping; ``measured`` values come from
    :func:`measure_local_cpu` (cached in ``cache_dir``; measured when absent and ``measure``).

    Raises:
        ClusterError: a missing field (all listed, one line) or a non-numeric / negative value.
    """
    missing = [k for k in REQUIRED if k not in raw or raw[k] is None]
    if missing:
        raise ClusterError(f"{where}: missing field(s) {', '.join('cluster.' + k for k in missing)}; required: {', '.join(REQUIRED)}")
    raw = dict(raw)
    kinds: dict[str, tuple[float, float]] = {}
    if any(raw[k] == "measured" for k in REQUIRED):
        m = load_or_measure_local_cpu(cache_dir, ranks=int(raw["gpus_per_node"]), measure=measure)
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
        name=str(raw["name"]), gpu=str(raw.get("gpu", "")), gpus_per_node=int(vals["gpus_per_node"]),
        peak_flops=vals["peak_flops"], achievable_fraction=vals["achievable_fraction"],
        hbm_bytes=vals["hbm_gib"] * 2**30, usable_memory_fraction=vals["usable_memory_fraction"],
        hbm_bandwidth=vals["hbm_bandwidth"],
        nvlink=Link(vals["nvlink_alpha_s"], vals["nvlink_bandwidth"], kinds),
        nic=Link(vals["nic_alpha_s"], vals["nic_bandwidth"], kinds),
        power_w=vals["power_w"], price_per_gpu_hour=vals["price_per_gpu_hour"],
        elementwise_bytes_per_h=_num(raw, "elementwise_bytes_per_h", where) if raw.get("elementwise_bytes_per_h") is not None else 0.0,
    )


# --- the local CPU microbenchmark ------------------------------------------------------------

SIZES = (4 << 10, 64 << 10, 512 << 10, 4 << 20, 32 << 20)  # payload bytes per call (32 MiB: DDP's 25 MB buckets, ZeRO-3's layer gathers)


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``t = a + x / bw`` over ``(x wire bytes, t seconds)``: returns ``(a, bw)``
    (a clamped at 0; a non-positive slope, i.e. noise, at 1e-15 s/byte)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    mt = sum(t for _, t in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (t - mt) for x, t in points) / sxx
    slope = max(slope, 1e-15)
    return max(mt - slope * mx, 0.0), 1.0 / slope


def _bench_rank(rank: int, world: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    res: dict[str, list] = {k: [] for k in ("allreduce", "allgather", "reduce_scatter", "p2p")}
    for size in SIZES:
        x = torch.zeros(size // 4)
        gathered = torch.zeros(world * (size // 4 // world) or 1)
        shard = torch.zeros(max(size // 4 // world, 1))
        ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        for kind in res:
            def op():
                if kind == "allreduce":
                    dist.all_reduce(x)
                elif kind == "allgather":
                    ag(gathered, shard)
                elif kind == "reduce_scatter":
                    rs(shard, gathered)  # the all-gather's output size is the reduce-scatter's input
                elif rank == 0:  # ping-pong: one send each way, halved below
                    dist.send(x, 1)
                    dist.recv(x, 1)
                elif rank == 1:
                    dist.recv(x, 0)
                    dist.send(x, 0)
            for _ in range(3):
                op()
            reps = 10 if size < (1 << 20) else 4
            best = float("inf")
            for _ in range(3):  # best of 3: other processes share the cores
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(reps):
                    op()
                dist.barrier()
                best = min(best, (time.perf_counter() - t0) / reps)
            res[kind].append((size, best / (2 if kind == "p2p" else 1)))
    if rank == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(res, f)
    dist.destroy_process_group()


def measure_local_cpu(cache_dir: str, *, ranks: int = 2) -> dict:
    """Measure this machine (module docstring) and cache it; returns the cached record.

    ``{"gemm_flops", "memory_gib", "ranks", "links": {kind: [alpha_s, bus_bandwidth]}}``, alpha
    per ring step and bandwidth in wire bytes/s (:func:`framework.cost.comm.ring_wire_bytes`).
    """
    import socket
    import tempfile

    import torch
    import torch.multiprocessing as mp

    from framework.cost.comm import ring_wire_bytes
    from framework.metrics.flops import peak_flops

    flops, _ = peak_flops(torch.device("cpu"), dtype="fp32", threads=1, cache_dir=cache_dir)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        mp.start_processes(_bench_rank, args=(ranks, port, out), nprocs=ranks, start_method="spawn")
        with open(out, encoding="utf-8") as f:
            raw = json.load(f)
    links = {}
    for kind, pts in raw.items():
        steps = {"allreduce": 2 * (ranks - 1), "allgather": ranks - 1, "reduce_scatter": ranks - 1, "p2p": 1}[kind]
        a, bw = _fit([(ring_wire_bytes(kind, s, ranks), t) for s, t in pts])
        links[kind] = [a / steps, bw]
    mem_kib = 0
    with open("/proc/meminfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    rec = {"gemm_flops": flops, "memory_gib": mem_kib / 2**20, "ranks": ranks, "links": links, "raw": raw,
           "measured_at": time.time()}
    os.makedirs(cache_dir, exist_ok=True)
    with open(os.path.join(cache_dir, CACHE_FILE), "w", encoding="utf-8") as f:
        json.dump(rec, f, indent=2)
    return rec


def load_or_measure_local_cpu(cache_dir: str, *, ranks: int = 2, measure: bool = True) -> dict:
    """The cached local-CPU record, measured first when absent (``measure``).

    Raises:
        ClusterError: no cache and ``measure`` is False.
    """
    path = os.path.join(cache_dir, CACHE_FILE)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    if not measure:
        raise ClusterError(f"cluster=local_cpu: no measurement cached at {path}; run python -m framework.cost.hardware")
    return measure_local_cpu(cache_dir, ranks=ranks)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m framework.cost.hardware",
                                 description="Measure this machine's GEMM rate and gloo collectives (2 ranks) for cluster=local_cpu "
                                             "and cache them (wrap in flock: it starts 2 processes).")
    ap.add_argument("cache_dir", nargs="?", default=".cache/cost", help="where local_cpu.json is written (default .cache/cost)")
    rec = measure_local_cpu(ap.parse_args().cache_dir)
    print(json.dumps({k: v for k, v in rec.items() if k != "raw"}, indent=2))
