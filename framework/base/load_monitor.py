"""What competes with a run for the machine: a load monitor, and the ``contended`` verdict.

A throughput measured while other jobs load the machine is not the machine's throughput. The
driver (:mod:`framework.driver.train`) runs a :class:`LoadMonitor` for the length of the ranks'
training: a daemon thread that every ``tracking.load_interval_s`` seconds (default 5) samples

- ``load/other_cpu_share``: the CPU time of every process *outside* this run's process tree (the
  driver, its forkserver, ranks, data-loader workers) over the interval, as a fraction of all the
  machine's cores: ``(Δ busy jiffies of /proc/stat / HZ − Δ CPU seconds of the run's tree) /
  (Δ wall × cores)`` (busy = user + nice + system + irq + softirq; psutil for the tree);
- ``load/steal_frac``: CPU steal (a hypervisor running other guests on our cores), Δ steal / Δ total of /proc/stat;
- ``load/loadavg_1m``: the 1-minute load average (``os.getloadavg``; it counts this run's own ranks too);
- ``load/gpu_other_procs``: on CUDA, processes of other process trees on the GPUs (nvidia-ml-py,
  when installed; else not logged).

When training ends the samples go to the run's MLflow run (metrics ``load/*`` at steps 1, 2, ..
and their means ``load/*_mean``), to ``load.json`` in the run folder, and a verdict: tag
``contended=true`` when the mean other-process share is ≥ ``tracking.contended_cpu_share``
(default 0.10: other processes kept a tenth of the machine's cores busy), or the mean steal ≥
:data:`STEAL_THRESHOLD`, or another process used a GPU; tag ``contended.reason`` says which. A
contended run is warned about in the driver's summary and its description, and flagged in the
compare report. The cost is one read of /proc/stat and of the tree's CPU times per interval
(benchmarks/plain_vs_trainlab.py measures it).
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CONTENDED_TAG = "contended"
REASON_TAG = "contended.reason"
LOAD_FILE = "load.json"
STEAL_THRESHOLD = 0.05
"""Mean CPU steal (fraction of CPU time) at or above which a run is contended."""


def read_cpu_jiffies(path: str = "/proc/stat") -> tuple[float, float, float] | None:
    """``(busy, total, steal)`` jiffies of all CPUs from the ``cpu`` line of ``/proc/stat`` (None where it cannot be read).

    busy = user + nice + system + irq + softirq (guest time is inside user); total adds idle,
    iowait and steal.
    """
    try:
        with open(path, encoding="ascii") as f:
            parts = f.readline().split()
    except OSError:
        return None
    if not parts or parts[0] != "cpu":
        return None
    v = [float(x) for x in parts[1:]] + [0.0] * 8
    user, nice, system, idle, iowait, irq, softirq, steal = v[:8]
    busy = user + nice + system + irq + softirq
    return busy, busy + idle + iowait + steal, steal


def other_cpu_share(d_busy_s: float, d_tree_s: float, d_wall_s: float, cores: int) -> float:
    """CPU share of the other processes over an interval: ``max(0, Δbusy − Δtree) / (Δwall × cores)``, in [0, 1].

    Args:
        d_busy_s: CPU-seconds all processes were busy (from /proc/stat).
        d_tree_s: CPU-seconds of this run's process tree.
        d_wall_s: the interval (s, > 0).
        cores: logical CPUs.
    """
    if d_wall_s <= 0 or cores <= 0:
        return 0.0
    return min(1.0, max(0.0, d_busy_s - d_tree_s) / (d_wall_s * cores))


def contention_verdict(means: dict[str, float], cpu_threshold: float) -> str:
    """The reason a run is contended ('' when it is not), from the means of its samples."""
    reasons = []
    share = means.get("load/other_cpu_share_mean")
    if share is not None and share >= cpu_threshold:
        reasons.append(f"other processes used {100 * share:.0f}% of the CPUs (threshold {100 * cpu_threshold:.0f}%)")
    steal = means.get("load/steal_frac_mean")
    if steal is not None and steal >= STEAL_THRESHOLD:
        reasons.append(f"CPU steal {100 * steal:.0f}% (threshold {100 * STEAL_THRESHOLD:.0f}%)")
    gpu = means.get("load/gpu_other_procs_max")
    if gpu:
        reasons.append(f"{gpu:.0f} other process(es) on the GPU(s)")
    return "; ".join(reasons)


@dataclass
class LoadRecord:
    """A run's samples (``[{"t": s since start, "load/..": value}]``), their means/maxima, and the verdict."""

    interval_s: float
    cpu_threshold: float
    samples: list[dict[str, float]] = field(default_factory=list)
    means: dict[str, float] = field(default_factory=dict)
    reason: str = ""

    @property
    def contended(self) -> bool:
        return bool(self.reason)


class LoadMonitor:
    """Samples the machine's load in a daemon thread while a run trains (see the module docstring).

    Use as a context manager around the training; ``record`` holds the result after exit.

    Args:
        interval_s: seconds between samples; 0 disables the monitor.
        cpu_threshold: mean other-process CPU share at which the run is contended.
        cuda: look for other processes on the GPUs (nvidia-ml-py).
        run_dir: where ``load.json`` is written at exit (None: not written).
    """

    def __init__(
        self, interval_s: float = 5.0, cpu_threshold: float = 0.10, *, cuda: bool = False, run_dir: Path | None = None
    ) -> None:
        self.interval_s = float(interval_s)
        self.cpu_threshold = float(cpu_threshold)
        self.cuda = cuda
        self.run_dir = run_dir
        self.record: LoadRecord | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cores = os.cpu_count() or 1
        self._hz = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
        self._nvml: Any = None

    # -- sampling ----------------------------------------------------------------------------
    def _tree(self) -> tuple[float, set[int]]:
        """CPU-seconds of this process and its descendants (reaped children included), and their pids."""
        import psutil

        me = psutil.Process()
        procs = [me]
        try:
            procs += me.children(recursive=True)
        except psutil.Error:
            pass
        total, pids = 0.0, set()
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system + getattr(t, "children_user", 0.0) + getattr(t, "children_system", 0.0)
                pids.add(p.pid)
            except psutil.Error:
                continue
        return total, pids

    def _gpu_others(self, pids: set[int]) -> float | None:
        if not self.cuda:
            return None
        try:
            if self._nvml is None:
                import pynvml  # nvidia-ml-py

                pynvml.nvmlInit()
                self._nvml = pynvml
            n = self._nvml.nvmlDeviceGetCount()
            others = set()
            for i in range(n):
                h = self._nvml.nvmlDeviceGetHandleByIndex(i)
                for p in self._nvml.nvmlDeviceGetComputeRunningProcesses(h):
                    if p.pid not in pids:
                        others.add(p.pid)
            return float(len(others))
        except Exception:  # no nvidia-ml-py, no driver, or a container that hides the pids
            self.cuda = False
            return None

    def _snapshot(self) -> tuple[float, tuple[float, float, float] | None, float, set[int]]:
        tree, pids = self._tree()
        return time.perf_counter(), read_cpu_jiffies(), tree, pids

    def _sample(self, prev: tuple, now: tuple) -> dict[str, float]:
        t0, j0, c0, _ = prev
        t1, j1, c1, pids = now
        out: dict[str, float] = {"t": t1 - self._t_start}
        if j0 is not None and j1 is not None:
            d_total = j1[1] - j0[1]
            out["load/other_cpu_share"] = other_cpu_share(
                (j1[0] - j0[0]) / self._hz, max(0.0, c1 - c0), t1 - t0, self._cores
            )
            out["load/steal_frac"] = (j1[2] - j0[2]) / d_total if d_total > 0 else 0.0
        try:
            out["load/loadavg_1m"] = os.getloadavg()[0]
        except OSError:
            pass
        gpu = self._gpu_others(pids)
        if gpu is not None:
            out["load/gpu_other_procs"] = gpu
        return out

    def _loop(self) -> None:
        prev = self._snapshot()
        while not self._stop.wait(self.interval_s):
            now = self._snapshot()
            self._samples.append(self._sample(prev, now))
            prev = now
        now = self._snapshot()
        if (
            now[0] - prev[0] >= min(1.0, self.interval_s) or not self._samples
        ):  # the tail (or a run shorter than one interval)
            self._samples.append(self._sample(prev, now))

    # -- context manager --------------------------------------------------------------------
    def __enter__(self) -> LoadMonitor:
        if self.interval_s <= 0:
            return self
        self._samples: list[dict[str, float]] = []
        self._t_start = time.perf_counter()
        self._thread = threading.Thread(target=self._loop, name="trainlab-load-monitor", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=10)
        self.record = summarize_samples(self._samples, self.interval_s, self.cpu_threshold)
        if self.run_dir is not None:
            try:
                (Path(self.run_dir) / LOAD_FILE).write_text(json.dumps(asdict(self.record), indent=1))
            except OSError:
                pass


def summarize_samples(samples: list[dict[str, float]], interval_s: float, cpu_threshold: float) -> LoadRecord:
    """Means (``load/<x>_mean``), maxima (``load/<x>_max``) and the verdict of a run's samples."""
    means: dict[str, float] = {}
    keys = sorted({k for s in samples for k in s if k.startswith("load/")})
    for k in keys:
        vals = [s[k] for s in samples if k in s]
        means[f"{k}_mean"] = sum(vals) / len(vals)
        means[f"{k}_max"] = max(vals)
    return LoadRecord(interval_s, cpu_threshold, list(samples), means, contention_verdict(means, cpu_threshold))


def read_record(run_dir: Path) -> LoadRecord | None:
    """The run's ``load.json`` (None when the monitor was off or did not write it)."""
    try:
        return LoadRecord(**json.loads((Path(run_dir) / LOAD_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def log_record(tracker: Any, record: LoadRecord) -> None:
    """The samples (``load/*`` at steps 1, 2, ..), means and maxima, and tags ``contended`` and
    ``contended.reason`` on the driver's MLflow run (:class:`framework.base.tracking.DriverRun`)."""
    for i, s in enumerate(record.samples, start=1):
        tracker.log_metrics({k: v for k, v in s.items() if k.startswith("load/")}, step=i)
    if record.means:
        tracker.log_metrics(record.means, step=0)
    tracker.set_tags(
        {
            CONTENDED_TAG: "true" if record.contended else "false",
            REASON_TAG: record.reason
            or f"none (thresholds: other CPU share {record.cpu_threshold:g},"
            f" steal {STEAL_THRESHOLD:g}, other GPU processes 0)",
        }
    )


def warning(record: LoadRecord | None) -> str | None:
    """The one-line warning of a contended run, else None."""
    if record is None or not record.contended:
        return None
    return (
        f"measured under contention: {record.reason}; its throughput is not this machine's"
        " (re-run on an idle machine, or compare with sweep.repeats)"
    )
