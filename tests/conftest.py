"""Shared test fixtures and the suite's tiers.

Every test under ``tests/integration/`` (the real driver, ranks and rendezvous) is marked ``slow``, as are
unit tests that start Python processes; ``make test-fast`` (``pytest -m "not slow"``) runs the rest.

Multi-rank tests start real gloo process groups on CPU; each rank gets
``cores // ranks`` threads (framework.base.distributed), so 2 ranks on 2 cores use 1 thread each.
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"
INTEGRATION = Path(__file__).resolve().parent / "integration"


def pytest_collection_modifyitems(config, items):
    """Mark every integration test ``slow`` (the fast tier, ``-m "not slow"``, leaves them out)."""
    for item in items:
        if INTEGRATION in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.slow)


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
