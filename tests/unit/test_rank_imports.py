"""What a rank leaves unimported (framework/rank/worker.py)."""

from __future__ import annotations

import importlib
import sys

import pytest

from framework.rank.worker import _keep_mlflow_out


def test_a_rank_marks_mlflow_absent_and_deepspeed_imports_without_it(monkeypatch):
    # DeepSpeed's autotuner imports MLflow when it can (~1 s of CPU per rank); a rank never needs it.
    autotuner = pytest.importorskip("deepspeed.autotuning.autotuner")
    monkeypatch.delitem(sys.modules, "mlflow", raising=False)
    _keep_mlflow_out()
    with pytest.raises(ImportError):
        import mlflow  # noqa: F401
    try:
        importlib.reload(autotuner)  # as a rank's `import deepspeed` runs it
        assert autotuner.has_mlflow is False
        assert sys.modules["mlflow"] is None
    finally:
        monkeypatch.undo()
        importlib.reload(autotuner)


# What `python -m framework.train` looks like to multiprocessing when the driver starts its ranks: the driver runs
# as __main__, then, instead of training, forks one "rank" from a rank server that preloads what the real one does.
# The rank reports what it inherited and what it imported on its way to its target (spawn.prepare re-runs the
# parent's main module by name).
_DRIVER_THEN_ONE_RANK = """
import json, multiprocessing, runpy, sys
from framework.driver import cli
from framework.driver.launcher import PRELOAD_MODULES

REPORT = (
    "import gc, json, sys; json.dump({'frozen': gc.get_freeze_count(), 'tracked': len(gc.get_objects()),"
    " 'driver': sorted(m for m in sys.modules if m == 'hydra' or m.startswith('framework.driver'))}, open(%r, 'w'))"
)

def one_rank(app):
    multiprocessing.set_forkserver_preload(PRELOAD_MODULES)
    rank = multiprocessing.get_context("forkserver").Process(target=exec, args=(REPORT % sys.argv[-1],))
    rank.start()
    rank.join()
    sys.exit(rank.exitcode)

cli.main = one_rank  # the driver module ends with cli.main(app)
sys.argv = ["framework.train", "trainer.preload_ranks=false", sys.argv[-1]]  # no rank server started early
runpy.run_module("framework.train", run_name="__main__", alter_sys=True)  # what `python -m framework.train` does
"""


@pytest.mark.slow
def test_a_rank_forked_from_the_server_skips_the_driver_and_inherits_frozen_objects(tmp_path):
    """framework/train.py stays __main__ (a forked rank re-runs it, not framework.driver.train with Hydra), and the
    rank server's imports are frozen (framework/rank/preloaded.py), so collections in a rank do not walk them."""
    import json
    import subprocess

    report = tmp_path / "rank.json"
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER_THEN_ONE_RANK, str(report)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(report.read_text())
    assert got["driver"] == [], f"the rank imported the driver: {got['driver']}"
    assert got["frozen"] > 100_000, got  # torch and Lightning: ~400k objects
    assert got["tracked"] < got["frozen"] / 10, got  # what the rank made itself, not the server's imports
