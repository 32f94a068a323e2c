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
