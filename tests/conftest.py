"""Shared test fixtures and the suite's tiers.

Every test under ``tests/integration/`` (the real driver, ranks and rendezvous) is marked ``slow``, as are
unit tests that start Python processes; ``make test-fast`` (``pytest -m "not slow"``) runs the rest.

Multi-rank tests start real gloo process groups on CPU; each rank gets
``cores // ranks`` threads (framework.base.distributed), so 2 ranks on 2 cores use 1 thread each.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"
INTEGRATION = Path(__file__).resolve().parent / "integration"


def pytest_configure(config):
    """Under pytest-xdist (``make test-fast``: ``-n auto``, 2 workers on 2 cores) each worker caps torch at ``cores // workers``
    threads (at least 1), so that workers x threads <= cores: the workers' torch pools would otherwise
    oversubscribe the cores and thrash, as ranks would (framework.base.distributed.cap_threads)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        from framework.base.distributed import cap_threads

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        cap_threads(max(1, cores // workers))


def pytest_collection_modifyitems(config, items):
    """Mark every integration test ``slow`` (the fast tier, ``-m "not slow"``, leaves them out)."""
    for item in items:
        if INTEGRATION in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.slow)


def make_empty_mlflow_store(folder: Path) -> Path:
    """``folder/mlruns.db``: an MLflow SQLite store with its tables and nothing else, created when missing.

    MLflow's schema migrations take ~2-8 s of CPU per new SQLite store on the 2-core machine: a test copies
    this file instead (``shutil.copyfile``) and gets an empty store in milliseconds."""
    db = folder / "mlruns.db"
    if not db.exists():
        from mlflow.tracking import MlflowClient

        folder.mkdir(parents=True, exist_ok=True)
        MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()  # creates the tables
    return db


@pytest.fixture(scope="session")
def empty_mlflow_store(tmp_path_factory) -> Path:
    """An empty MLflow SQLite store for the session (:func:`make_empty_mlflow_store`); copy it, do not write to it."""
    return make_empty_mlflow_store(tmp_path_factory.mktemp("mlflow_empty_store"))


@pytest.fixture()
def compose():
    """Compose ``conf/config.yaml`` with overrides, as the driver would (run_name pinned)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import framework.driver.cli  # noqa: F401  (registers the run-name resolver)

    def _compose(*overrides: str):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return hydra_compose(config_name="config", overrides=["run_name=test", *overrides])

    return _compose
