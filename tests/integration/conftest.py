"""Helpers to run the real driver (``python -m framework.train``) in a scratch folder.

Every run uses a small slice of the stdlib corpus (``data.max_bytes``) and a small vocabulary,
tokenized once per test session into a shared cache, so a run costs seconds, not minutes. A scratch
folder's MLflow store starts as a copy of an empty one made once per session (MLflow's schema
migrations take ~4-8 s of CPU for each new SQLite store).
Multi-rank runs use gloo on CPU with 1 thread per rank on a 2-core machine.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from framework.base.testing.conformance import SMALL_DATA as CONFORMANCE_DATA
from framework.base.testing.conformance import Conformance
from framework.base.tracking import read_jsonl_metrics
from tests.conftest import make_empty_mlflow_store

SMALL_DATA = list(CONFORMANCE_DATA)  # the conformance suite's slice: one token cache for both


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture(scope="session")
def conformance(tmp_path_factory, data_cache) -> Conformance:
    """The conformance suite's session runner (framework/base/testing/conformance.py), one for every module that uses it
    (test_conformance, test_train_e2e, test_sharded_checkpoint), on the session's token cache: the plugin's own fixture
    of that name tokenizes the same corpus again into a cache of its own (SMALL_DATA here and there)."""
    return Conformance(tmp_path_factory.mktemp("conformance"), data_cache)


class Runner:
    """Runs the driver with ``cwd`` = a scratch folder (so mlruns.db, outputs/ and checkpoints/ land there)."""

    def __init__(self, workdir: Path, cache: Path) -> None:
        self.workdir = workdir
        self.cache = cache

    def _seed_mlflow_store(self) -> None:
        """Copy the session's empty MLflow store to ``mlruns.db`` when the folder has none yet."""
        db = self.workdir / "mlruns.db"
        if not db.exists():
            shutil.copyfile(make_empty_mlflow_store(self.cache.parent / "mlflow_empty_store"), db)

    def args(self, *overrides: str) -> list[str]:
        flags = [o for o in overrides if o.startswith("-")]  # e.g. -m must precede the overrides
        rest = [o for o in overrides if not o.startswith("-")]
        return [
            sys.executable,
            "-m",
            "framework.train",
            *flags,
            *SMALL_DATA,
            f"data.cache_dir={self.cache}",
            "trainer.progress_bar=false",
            *rest,
        ]

    def run(self, *overrides: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        self._seed_mlflow_store()
        proc = subprocess.run(self.args(*overrides), cwd=self.workdir, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(
                f"driver exited {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-6000:]}"
            )
        return proc

    def start(self, *overrides: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start the driver in its own process group (so a signal reaches it and its ranks, like Ctrl-C).

        ``env``: extra environment variables for the driver and its ranks.
        """
        self._seed_mlflow_store()
        return subprocess.Popen(
            self.args(*overrides),
            cwd=self.workdir,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )

    def metrics(self, run_name: str, experiment: str = "default") -> list[dict]:
        return read_jsonl_metrics(self.workdir / "outputs" / experiment / run_name / "metrics.jsonl")

    def run_variants(
        self, variants: dict[str, list[str]], lanes: int = 2, check: bool = True, experiment: str | None = None
    ) -> dict[str, Path]:
        """Run independent runs (name -> overrides) as ``lanes`` Hydra sweeps, one driver and rank server per lane
        instead of per run (framework/base/testing/variants.py); returns name -> the run's output folder
        (:func:`records` reads its metrics, ``variants.checkpoint_dir`` its checkpoint folder) for the runs that
        finished; :meth:`why_not_finished` says why another did not. ``experiment``: one lane's experiment name.

        Raises:
            AssertionError: with ``check``, a run did not finish (its error, or the lane's output).
        """
        from framework.base.testing.variants import run_variants

        self._seed_mlflow_store()
        done = run_variants(self.workdir, self.args()[3:], variants, lanes=lanes, experiment=experiment)
        failed = [f"{name}: {self.why_not_finished(name)}" for name in variants if name not in done]
        assert not (check and failed), "runs that did not finish:\n" + "\n".join(failed)
        return done

    def why_not_finished(self, name: str) -> str:
        """The error of variant ``name`` of :meth:`run_variants` that did not finish (its ``error.txt``), or the end
        of its lane's output."""
        from framework.base.testing.variants import job_folder

        lane = next(p for p in self.workdir.glob("variants*-*") if (p / "variant" / f"{name}.yaml").is_file())
        run_dir = job_folder(self.workdir, lane.name, name) or next(
            (d for d in (self.workdir / "outputs").glob(f"*/*/variant={name}")), None
        )  # a one-lane batch with its own experiment
        error = run_dir / "error.txt" if run_dir else None
        return error.read_text() if error and error.is_file() else (lane / "sweep.log").read_text()[-4000:]


SHARED_RUNS: dict[str, tuple[str, tuple[str, ...]]] = {}
"""The session's shared runs (:func:`shared_run`): name -> (who reads it, its overrides)."""
_SWEEP_SETS = ("run_name", "experiment_name", "checkpoint.dir")
"""Keys a shared run may not set: its sweep names the run and the experiment, and appends the job to ``checkpoint.dir``."""


def shared_run(name: str, *overrides: str, used_by: str) -> str:
    """Declare, when a test module is imported, an independent run (no signal, no second node, nothing started
    while it runs) whose records or checkpoints its tests read. The session runs every declared run that a
    selected test needs in one batch of Hydra sweeps (:class:`SharedRuns`), one driver and one rank server per
    lane instead of one per run: on the 2-core machine a run of 8 steps started alone took 7.2 s to its first step
    (the driver's and the rank server's imports) and 8.3 s in all; a job of the batch mostly 1.5-2.7 s to its first step,
    with the two lanes sharing the cores.

    ``used_by``: the declaring module's ``__name__`` or a fixture's name: the run is made when a selected test that
    uses the ``shared_runs`` fixture is in that module or uses that fixture. Returns ``name`` (unique in the session).

    Raises:
        ValueError: ``name`` was declared already with other overrides, or an override sets ``run_name``,
            ``experiment_name`` or ``checkpoint.dir`` (the sweep sets them).
    """
    named = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] in _SWEEP_SETS]
    if named:
        raise ValueError(f"shared run {name!r}: {named}: its sweep job sets {', '.join(_SWEEP_SETS)} itself")
    if SHARED_RUNS.get(name, (used_by, overrides)) != (used_by, overrides):
        raise ValueError(f"shared run {name!r} is declared twice with different overrides")
    SHARED_RUNS[name] = (used_by, overrides)
    return name


class SharedRuns:
    """The session's shared runs (:func:`shared_run`), made together, in one scratch folder, when the first test that
    needs one sets up (so ``--durations`` shows their time as that test's ``setup``).

    Each run's numbers are those it gives alone (framework/base/testing/variants.py); its output and checkpoint
    folders are its sweep job's, so tests find them here, not under ``outputs/<experiment>/<run_name>``.
    """

    def __init__(self, runner: Runner, wanted: dict[str, tuple[str, ...]]) -> None:
        self.runner, self.wanted = runner, wanted
        self._done: dict[str, Path] | None = None

    def make(self) -> None:
        """Make every wanted run, in two lanes side by side (:meth:`Runner.run_variants`); a second call does nothing."""
        if self._done is None:
            self._done = self.runner.run_variants({n: list(o) for n, o in self.wanted.items()}, check=False)

    def run_dir(self, name: str) -> Path:
        """The output folder of shared run ``name`` (:meth:`make` first).

        Raises:
            KeyError: no selected test needs a run of that name (not declared, or ``used_by`` does not match).
            AssertionError: the run did not finish (its error).
        """
        if name not in self.wanted:
            raise KeyError(f"no shared run {name!r} is declared for the selected tests: {sorted(self.wanted)}")
        self.make()
        if name not in self._done:
            raise AssertionError(f"shared run {name} did not finish: {self.runner.why_not_finished(name)}")
        return self._done[name]

    def records(self, name: str) -> list[dict]:
        """The metric records of shared run ``name`` (:meth:`run_dir`)."""
        return records(self.run_dir(name))

    def checkpoint_dir(self, name: str) -> Path:
        """The checkpoint folder shared run ``name`` wrote (:meth:`run_dir`)."""
        from framework.base.testing.variants import checkpoint_dir

        return checkpoint_dir(self.run_dir(name), self.runner.workdir)


@pytest.fixture(scope="session")
def shared_runs(request, tmp_path_factory, data_cache) -> SharedRuns:
    """The shared runs (:func:`shared_run`) that the session's selected tests need: those declared for the modules
    and fixtures of the selected tests that use this fixture."""
    items = [i for i in request.session.items if "shared_runs" in getattr(i, "fixturenames", ())]
    users = {getattr(getattr(i, "module", None), "__name__", "") for i in items} | {
        f for i in items for f in i.fixturenames
    }
    wanted = {name: overrides for name, (used_by, overrides) in SHARED_RUNS.items() if used_by in users}
    runs = SharedRuns(Runner(tmp_path_factory.mktemp("shared_runs"), data_cache), wanted)
    runs.make()
    return runs


def records(run_dir: Path) -> list[dict]:
    """The metric records of the run whose output folder is ``run_dir``."""
    return read_jsonl_metrics(run_dir / "metrics.jsonl")


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


REF_STEPS = 20


REF = shared_run(
    "ref",
    "parallelism=single",
    "trainer.micro_batch_size=8",
    "trainer.global_batch_size=8",
    "trainer.grad_accum_steps=null",
    f"trainer.max_steps={REF_STEPS}",
    "trainer.log_every_n_steps=1",
    "trainer.val_every_n_steps=1000",
    "trainer.val_sequences=16",
    "checkpoint=none",
    "tracking=none",
    used_by="single_ref",
)


@pytest.fixture(scope="session")
def single_ref(shared_runs) -> list[dict]:
    """The metric records of `single` with one micro-batch of 8 (global batch 8) for ``REF_STEPS`` steps, every
    step logged: the one reference run of the layout-parity tests (test_train_e2e, test_megatron, test_deepspeed)."""
    return shared_runs.records(REF)
