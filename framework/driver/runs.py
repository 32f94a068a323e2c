"""What every run of the driver shares, single run or sweep job: its validation, locks, the MLflow UI link, failed jobs.

- :func:`resolve_run`: a composed config typed, validated and its first shrink checked once per
  run in this process (the precheck of a single run, or a sweep's check of its jobs, validates it;
  the job reuses that).
- :func:`hold_lock` / :func:`hold_locks`: one driver per run folder and checkpoint folder (and per
  sweep); a second process gets a one-line error naming the first (exit code 2).
- :func:`ui_link` / :func:`ui_command`: where to see a run in the MLflow UI.
- :data:`FAILED_JOBS` and :func:`record_failure`: the runs of this process that ended FAILED
  (``run_dir/error.txt``, stderr); :func:`framework.driver.cli.main` exits 1 when a sweep has any.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

_VALIDATED: list[tuple[Any, Any]] = []
"""(run with ``run_name`` and ``checkpoint.dir`` blanked, its :class:`~framework.base.resolved.ResolvedRun`)
of every run this process validated (:func:`resolve_run`)."""


def _identity_free(run: Any) -> Any:
    """``run`` without what names it (``run_name``, ``checkpoint.dir``): the validation reads neither."""
    return dataclasses.replace(run, run_name="-", checkpoint=dataclasses.replace(run.checkpoint, dir=None))


def resolve_run(cfg: Any) -> Any:
    """The composed config ``cfg`` (a Hydra ``DictConfig``) typed (:func:`framework.base.load.load_run_config`),
    validated (:func:`framework.driver.validate.validate`) and its first shrink checked
    (:func:`framework.driver.faults.elastic.check_first_shrink`): a
    :class:`~framework.base.resolved.ResolvedRun`.

    The validation runs once per run: a run this process validated already (the precheck of a single
    run, which composes it as Hydra's job, :func:`framework.driver.cli.precheck`; a sweep's check of its
    jobs before the first starts, under a placeholder name, :func:`framework.driver.sweep.check_jobs`) is
    not validated again, only renamed (``run``, ``checkpoint_dir``), since no rule reads ``run_name`` or
    ``checkpoint.dir``.

    Raises:
        ConfigError: any bad value, one line.
    """
    from framework.base.load import load_run_config
    from framework.driver.faults.elastic import check_first_shrink
    from framework.driver.validate import checkpoint_dir_of, validate

    run = load_run_config(cfg)
    key = _identity_free(run)
    for seen, resolved in _VALIDATED:
        if seen == key:
            return dataclasses.replace(resolved, run=run, checkpoint_dir=checkpoint_dir_of(run))
    resolved = validate(run)
    check_first_shrink(resolved)  # validates the shrunk run, so it is not part of validate()
    _VALIDATED.append((key, resolved))
    return resolved


FAILED_JOBS: list[str] = []
"""Run names of this process's sweep jobs that ended FAILED (the driver and the sweep's end append;
:func:`framework.driver.cli.main` exits 1 when there are any)."""


def hold_lock(folder: Path, what: str) -> Any:
    """Lock ``folder/.trainlab.lock`` for this process and write its pid there; returns the open
    file (closing it releases the lock). Exits 2 with ``another trainlab process (pid N) is running
    in <folder> (the same <what>)`` when another process holds it."""
    import fcntl

    from framework.base.config import fail

    folder.mkdir(parents=True, exist_ok=True)
    f = open(folder / ".trainlab.lock", "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        pid = f.read().strip() or "?"
        f.close()
        fail(
            f"another trainlab process (pid {pid}) is running in {folder} (the same {what}); wait for it to end"
            + (", or set another run_name" if what == "run" else "")
        )
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f


@contextlib.contextmanager
def hold_locks(folders: Sequence[Path], what: str = "run") -> Iterator[None]:
    """Hold :func:`hold_lock` on every folder of ``folders`` (in order) for the ``with`` block; all are
    released when it ends. Exits 2 (one line) when another process holds one."""
    locks = []
    try:
        for folder in folders:
            locks.append(hold_lock(Path(folder), what))
        yield
    finally:
        for f in locks:
            f.close()


def ui_link(uri: str, experiment_id: str, run_id: str | None = None) -> str:
    """The MLflow UI page of a run (or of an experiment's runs): on the tracking server itself
    (``http(s)://`` URI), else on a local ``mlflow ui`` (``http://127.0.0.1:5000``)."""
    base = uri.rstrip("/") if uri.startswith(("http://", "https://")) else "http://127.0.0.1:5000"
    return f"{base}/#/experiments/{experiment_id}" + (f"/runs/{run_id}" if run_id else "")


def ui_command(uri: str) -> str:
    """The command that serves the MLflow UI of tracking store ``uri`` (this interpreter's ``mlflow``
    when installed beside it, else ``mlflow`` on the PATH)."""
    mlflow_bin = Path(sys.executable).parent / "mlflow"
    return f"{mlflow_bin if mlflow_bin.exists() else 'mlflow'} ui --backend-store-uri {uri}"


def record_failure(run_dir: Path, run_name: str, error: str, *, in_sweep: bool) -> None:
    """Report a failed training (``error``: its one-line root cause, then the details): stderr and
    ``run_dir/error.txt``; exit 1 unless ``in_sweep`` (there the run ends FAILED, its name joins
    :data:`FAILED_JOBS`, the next job starts, and :func:`framework.driver.cli.main` exits 1 at the end).

    Raises:
        SystemExit: code 1, outside a sweep.
    """
    print(f"trainlab: error: training failed: {error}", file=sys.stderr, flush=True)
    # Kept with the run: in a sweep the driver's stderr scrolls past (or is captured and lost).
    (run_dir / "error.txt").write_text(error + "\n")
    if not in_sweep:  # in a sweep the run ends FAILED and the next job starts (e.g. a fault x policy grid)
        raise SystemExit(1)
    FAILED_JOBS.append(run_name)
