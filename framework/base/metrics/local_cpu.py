"""This machine measured for ``cluster=local_cpu``: GEMM rate, memory and gloo's collectives, cached.

The cost model (:mod:`framework.base.cost`) is pure: a cluster file that says ``measured`` for a field
(``conf/cluster/local_cpu.yaml``) gets it from the record this module measures once and caches in
``<cache_dir>/local_cpu.json``: the fp32 GEMM rate of one rank at one thread
(:func:`framework.base.metrics.flops.peak_flops`), the RAM, and per collective kind gloo's alpha and bus
bandwidth from a 2-rank microbenchmark (all-reduce, all-gather, reduce-scatter, send/recv over
4 KiB-32 MiB, least-squares fit of ``t = alpha_fit + wire_bytes / bw``).
:func:`cluster_of` builds the :class:`~framework.base.cost.hardware.Cluster` of any cluster file,
measuring only where the file asks for it.

Run ``python -m framework.base.metrics.local_cpu`` to re-measure (2 processes: wrap in flock).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Any

from framework.base.cost.hardware import Cluster, ClusterError, cluster_from_dict, needs_measurement

CACHE_FILE = "local_cpu.json"
SIZES = (
    4 << 10,
    64 << 10,
    512 << 10,
    4 << 20,
    32 << 20,
)  # payload bytes per call (32 MiB: DDP's 25 MB buckets, ZeRO-3's layer gathers)


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
    per ring step and bandwidth in wire bytes/s (:func:`framework.base.cost.comm.ring_wire_bytes`).
    """
    import socket
    import tempfile

    import torch
    import torch.multiprocessing as mp

    from framework.base.cost.comm import ring_wire_bytes
    from framework.base.metrics.flops import peak_flops

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
    rec = {
        "gemm_flops": flops,
        "memory_gib": mem_kib / 2**20,
        "ranks": ranks,
        "links": links,
        "raw": raw,
        "measured_at": time.time(),
    }
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
        raise ClusterError(
            f"cluster=local_cpu: no measurement cached at {path}; run python -m framework.base.metrics.local_cpu"
        )
    return measure_local_cpu(cache_dir, ranks=ranks)


def cluster_of(
    raw: Mapping[str, Any], *, where: str = "cluster", cache_dir: str = ".cache/cost", measure: bool = True
) -> Cluster:
    """The :class:`~framework.base.cost.hardware.Cluster` of the ``conf/cluster`` mapping ``raw``; a file that
    says ``measured`` (``local_cpu``) gets this machine's cached record (:func:`load_or_measure_local_cpu`,
    ``gpus_per_node`` ranks; measured first when absent and ``measure``).

    Raises:
        ClusterError: a bad cluster file (:func:`~framework.base.cost.hardware.cluster_from_dict`), or no
            cached measurement and ``measure`` is False.
    """
    measured = None
    if needs_measurement(raw):
        measured = load_or_measure_local_cpu(cache_dir, ranks=int(raw["gpus_per_node"]), measure=measure)
    return cluster_from_dict(raw, where=where, measured=measured)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m framework.base.metrics.local_cpu",
        description="Measure this machine's GEMM rate and gloo collectives (2 ranks) for cluster=local_cpu "
        "and cache them (wrap in flock: it starts 2 processes).",
    )
    ap.add_argument(
        "cache_dir", nargs="?", default=".cache/cost", help="where local_cpu.json is written (default .cache/cost)"
    )
    rec = measure_local_cpu(ap.parse_args().cache_dir)
    print(json.dumps({k: v for k, v in rec.items() if k != "raw"}, indent=2))
