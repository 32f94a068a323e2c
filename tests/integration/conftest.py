"""Helpers to run the real driver (``python -m framework.train``) in a scratch folder.

Every run uses a small slice of the stdlib corpus (``data.max_bytes``) and a small vocabulary,
tokenized once per test session into a shared cache, so a run costs seconds, not minutes.
Multi-rank runs use gloo on CPU with 1 thread per rank on a 2-core machine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from framework.tracking import read_jsonl_metrics

SMALL_DATA = ["data.max_bytes=1500000", "data.vocab_size=1024", "data.seq_len=64"]


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data_cache")


class Runner:
    """Runs the driver with ``cwd`` = a scratch folder (so mlruns.db, outputs/ and checkpoints/ land there)."""

    def __init__(self, workdir: Path, cache: Path) -> None:
        self.workdir = workdir
        self.cache = cache

    def args(self, *overrides: str) -> list[str]:
        flags = [o for o in overrides if o.startswith("-")]  # e.g. -m must precede the overrides
        rest = [o for o in overrides if not o.startswith("-")]
        return [sys.executable, "-m", "framework.train", *flags, *SMALL_DATA, f"data.cache_dir={self.cache}",
                "trainer.progress_bar=false", *rest]

    def run(self, *overrides: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(self.args(*overrides), cwd=self.workdir, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"driver exited {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-6000:]}")
        return proc

    def start(self, *overrides: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start the driver in its own process group (so a signal reaches it and its ranks, like Ctrl-C).

        ``env``: extra environment variables for the driver and its ranks.
        """
        return subprocess.Popen(self.args(*overrides), cwd=self.workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True, env={**os.environ, **(env or {})})

    def metrics(self, run_name: str, experiment: str = "default") -> list[dict]:
        return read_jsonl_metrics(self.workdir / "outputs" / experiment / run_name / "metrics.jsonl")


def job_runs(client, experiment: str) -> list:
    """The experiment's training runs: a sweep's parent run (tag ``trainlab.sweep=parent``) left out."""
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return [r for r in runs if r.data.tags.get("trainlab.sweep") != "parent"]


def losses(records: list[dict]) -> dict[int, float]:
    """step -> train/loss (the last record wins when a resumed run re-logs a step)."""
    return {int(r["step"]): r["train/loss"] for r in records if "train/loss" in r}


def wait_for(predicate, timeout: float, proc: subprocess.Popen | None = None) -> None:
    t0 = time.time()
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process ended early ({proc.returncode}):\n{proc.stdout.read()[-4000:]}")
        if time.time() - t0 > timeout:
            raise AssertionError("timed out waiting")
        time.sleep(0.2)


def kill_group(proc: subprocess.Popen, sig: int) -> None:
    os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture()
def runner(tmp_path, data_cache) -> Runner:
    return Runner(tmp_path, data_cache)
