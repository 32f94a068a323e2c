"""The command line around the driver: Hydra entry, one-line errors and exit codes.

``python -m framework.train [overrides]`` runs :func:`main` with the driver's Hydra app
(:mod:`framework.driver.train`). Before Hydra starts, :func:`precheck` composes a single run's config
as Hydra's job and validates it, so that every bad input is one ``trainlab: error:`` line with exit
code 2 (no output folder is made); the job then runs with that composition (:class:`SingleRun`:
composed once, validated once). Exit codes: 0 done, 1 training failed (in a sweep: at least one job
failed, after every job has run; in an Optuna search: over its failure budget or no trial
COMPLETE; or the sweeper, launcher or Hydra raised), 2 bad input, 75 preempted (SIGTERM/SIGUSR1/SIGUSR2; the same command
resumes: :mod:`framework.base.faults.preemption`), 130 interrupted.

Importing this module registers the ``tl_run_name`` resolver that ``conf/config.yaml`` names
runs with.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from framework.base.config import CONF_DIR, fail, near_keys, path_safe
from framework.base.config.schema import ConfigError
from framework.driver import slurm


def _find_trainlab_hydra_plugins() -> None:
    """Put this checkout's ``hydra_plugins/`` (trainlab's Optuna sweeper) on the ``hydra_plugins``
    namespace package's path, before Hydra scans its plugins: an editable install made before the
    folder existed maps only ``framework`` and ``plugins``, and a command may start from any folder."""
    import hydra_plugins

    here = str(Path(__file__).resolve().parents[2] / "hydra_plugins")
    if Path(here).is_dir() and here not in list(hydra_plugins.__path__):
        hydra_plugins.__path__.append(here)


_find_trainlab_hydra_plugins()
slurm.register_launchers()  # hydra/launcher=submitit_slurm|submitit_local with trainlab's resources mapped in


def register_optuna_sweeper() -> bool:
    """Store ``hydra/sweeper=optuna`` as trainlab's search (:mod:`framework.driver.search`, behind
    ``hydra_plugins.trainlab_search.TrainlabOptunaSweeper``) over hydra-optuna-sweeper's option,
    after Hydra's plugin scan (which executes the library's config module, storing its own). Every
    key of the library's sweeper keeps its meaning except ``max_failure_rate`` (a share of
    ``n_trials``, not of a batch). Returns False when hydra-optuna-sweeper is not installed."""
    try:
        from hydra.core.config_store import ConfigStore
        from hydra.core.plugins import Plugins
        from hydra_plugins.hydra_optuna_sweeper.config import OptunaSweeperConf
    except ImportError:
        return False
    Plugins.instance()  # the scan (a no-op once made)
    node = OmegaConf.structured(OptunaSweeperConf)
    node._target_ = "hydra_plugins.trainlab_search.TrainlabOptunaSweeper"
    ConfigStore.instance().store(group="hydra/sweeper", name="optuna", node=node, provider="trainlab")
    return True


register_optuna_sweeper()


def run_name_from_overrides(override_dirname: str, task_overrides: list[str] | None = None) -> str:
    """A stable, path-safe run name from Hydra's ``job.override_dirname`` (``default`` when empty).

    A job of a sweep (``task_overrides``: the job's ``hydra.overrides.task``) is named
    ``<sweep>/<its swept values>`` instead (:func:`framework.driver.sweep.sweep_run_name`), so every key
    that differs between the jobs of a sweep names them, excluded keys included.
    """
    if task_overrides is not None:
        from framework.driver.sweep import sweep_run_name

        in_sweep = sweep_run_name(override_dirname, list(task_overrides))
        if in_sweep is not None:
            return in_sweep
    if not override_dirname:
        return "default"
    return path_safe(override_dirname)


OmegaConf.register_new_resolver("tl_run_name", run_name_from_overrides, replace=True)


def run_dir_for_node(experiment_name: str, run_name: str, checkpoint_dir: str | None, node_rank: int | None) -> str:
    """The driver's Hydra output folder: the run's on node 0 (and on one node), a folder inside the shared
    checkpoint folder on the other nodes of a multi-node run (:func:`framework.driver.nodes.hydra_run_dir`)."""
    from framework.driver.nodes import hydra_run_dir

    return hydra_run_dir(experiment_name, run_name, checkpoint_dir, node_rank)


OmegaConf.register_new_resolver("tl_run_dir", run_dir_for_node, replace=True)


def sweep_subdir_for_node(
    experiment_name: str, run_name: str, checkpoint_dir: str | None, node_rank: int | None
) -> str:
    """A sweep job's Hydra sub-folder: the run name on node 0, node k's folder on the others
    (:func:`framework.driver.nodes.hydra_sweep_subdir`)."""
    from framework.driver.nodes import hydra_sweep_subdir
    from framework.driver.sweep import job_checkpoint_dir

    return hydra_sweep_subdir(experiment_name, run_name, job_checkpoint_dir(checkpoint_dir, run_name), node_rank)


OmegaConf.register_new_resolver("tl_sweep_subdir", sweep_subdir_for_node, replace=True)


def in_sweep() -> bool:
    """Whether this job is one of a Hydra multirun (``-m`` or a preset with ``hydra.mode: MULTIRUN``)."""
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def check_group_choices(argv: list[str], conf_dir: Path = CONF_DIR) -> None:
    """Reject ``group=option`` overrides naming a missing option, in one line (exit code 2).

    Hydra would report these too, but over several lines with a hint about stack traces;
    this check runs first so every bad input reads the same way.
    """
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        if not key or "." in key or "/" in key or "(" in value or not (conf_dir / key).is_dir():
            continue
        options = sorted(p.stem for p in (conf_dir / key).glob("*.yaml"))
        for choice in (v.strip() for v in value.split(",")):
            if choice and choice != "null" and choice not in options:
                options = group_options(key, conf_dir)  # with installed packages' configs (e.g. an outside plugin's)
                if choice not in options:
                    fail(f"{key}={choice!r} is not an option of config group {key!r}; available: {', '.join(options)}")


def group_options(group: str, conf_dir: Path = CONF_DIR) -> list[str]:
    """Options of config group ``group`` on Hydra's whole search path: ``conf/<group>/*.yaml`` plus
    those that installed packages add through a Hydra ``SearchPathPlugin`` (how an outside
    parallelism plugin ships ``parallelism/<name>.yaml``; see plugins/README.md)."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        return sorted(GlobalHydra.instance().config_loader().get_group_options(group))


def presets_writing(kind: str, conf_dir: Path | None = None) -> list[str]:
    """``conf/parallelism`` presets whose plugin writes checkpoints of manifest kind ``kind`` (imports every plugin class)."""
    from framework.base.registry import available_plugins, get_plugin_class

    conf_dir = conf_dir or CONF_DIR
    writers = {n for n in available_plugins() if get_plugin_class(n).capabilities.checkpoint_format == kind}
    return sorted(
        p.stem
        for p in (conf_dir / "parallelism").glob("*.yaml")
        if re.search(r"^name:\s*(\S+)", p.read_text(), re.M).group(1) in writers
    )


def _one_line_hydra_error(err: BaseException, overrides: list[str]) -> str:
    """Hydra's multi-line composition errors as one line; a mistyped key gets suggestions."""
    text = str(err)
    m = re.search(r"Could not override '([^']+)'", text)
    if m:
        from hydra import compose, initialize_config_dir

        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            groups = [
                o
                for o in overrides  # e.g. parallelism=fsdp, to suggest that plugin's keys (not nosuchkey=1)
                if "=" in o and "," not in o and (CONF_DIR / o.split("=")[0].lstrip("+~")).is_dir()
            ]
            defaults = compose(
                config_name="config", overrides=["run_name=x", *groups]
            )  # suggest the chosen plugin's keys
        from framework.base.tracking import flatten

        keys = list(flatten(OmegaConf.to_container(defaults, resolve=False)))
        near = near_keys(m.group(1), keys)
        hint = (
            f"did you mean {', '.join(near)}?" if near else "see conf/ and framework/base/config/schema.py for the keys"
        )
        return f"{m.group(1)} is not a config key; {hint} (to add a new key write +{m.group(1)}=...)"
    lines = [
        ln.strip()
        for ln in text.splitlines()
        if ln.strip()
        and "HYDRA_FULL_ERROR" not in ln
        and not ln.strip().startswith(("full_key", "object_type", "reference_type"))
    ]
    return " ".join(lines) or type(err).__name__


class SingleRun:
    """A single run composed once: Hydra's own composition of the job (``RunMode.RUN``, with its ``hydra``
    node, as ``Hydra.run`` composes it) and its validated :class:`~framework.base.resolved.ResolvedRun`.

    :func:`precheck` builds it; :meth:`run` starts the job with that config, so that a single run is
    composed once and validated once (before: the precheck's compose, then Hydra's ``get_mode`` and
    ``run`` composed it again). Mirrors ``hydra._internal.hydra.Hydra.run`` and ``_run_hydra`` of
    hydra-core 1.3 (pinned in ``pyproject.toml``); sweeps and Hydra's own flags still go through ``@hydra.main``.
    """

    def __init__(self, hydra: Any, cfg: Any, resolved: Any) -> None:
        self.hydra = hydra  # hydra._internal.hydra.Hydra, the process's GlobalHydra
        self.cfg = cfg  # the job's DictConfig, hydra node included
        self.resolved = resolved

    def run(self, app: Callable[[], None]) -> None:
        """Run ``app``'s task function (the undecorated function of a ``@hydra.main`` app) as Hydra's job:
        output folder, ``.hydra/`` files, logging, ``HydraConfig``, callbacks; the job's exception leaves as
        Hydra reports it (one message, then ``SystemExit(1)``; ``HYDRA_FULL_ERROR=1``: raised)."""
        from hydra._internal.callbacks import Callbacks
        from hydra._internal.utils import run_and_report
        from hydra.core.global_hydra import GlobalHydra
        from hydra.core.utils import run_job
        from hydra.types import HydraContext

        def job() -> None:
            callbacks = Callbacks(self.cfg)
            callbacks.on_run_start(config=self.cfg, config_name="config")
            ret = run_job(
                hydra_context=HydraContext(config_loader=self.hydra.config_loader, callbacks=callbacks),
                task_function=app.__wrapped__,
                config=self.cfg,
                job_dir_key="hydra.run.dir",
                job_subdir_key=None,
                configure_logging=True,
            )
            callbacks.on_run_end(config=self.cfg, config_name="config", job_return=ret)
            _ = ret.return_value  # raises the job's exception

        GlobalHydra.instance().clear()
        GlobalHydra.instance().initialize(self.hydra)
        try:
            run_and_report(job)
        finally:
            GlobalHydra.instance().clear()


def _compose_job(argv: list[str]) -> tuple[Any, Any]:
    """(Hydra, the job's config) as ``@hydra.main`` composes a run, in one composition: the driver's app's
    task name (``train``), the search path of ``conf/`` and its plugins, ``RunMode.RUN``, the overrides
    ``argv``. Where the config sets no ``hydra.mode``, the mode becomes RUN and ``hydra.mode=RUN`` is
    recorded among the Hydra overrides, as Hydra's ``_run_app`` and ``Hydra.run`` record it. Raises
    Hydra's composition errors."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode
    from omegaconf import read_write

    GlobalHydra.instance().clear()
    hydra = Hydra.create_main_hydra2(task_name="train", config_search_path=create_config_search_path(str(CONF_DIR)))
    try:
        cfg = hydra.compose_config(
            config_name="config", overrides=list(argv), with_log_configuration=True, run_mode=RunMode.RUN
        )
    finally:
        GlobalHydra.instance().clear()  # SingleRun.run holds it again while the job runs
    if cfg.hydra.mode is None:
        with read_write(cfg.hydra):
            cfg.hydra.mode = RunMode.RUN
            cfg.hydra.overrides.hydra.append("hydra.mode=RUN")
    return hydra, cfg


def precheck(argv: list[str]) -> SingleRun | None:
    """Compose and validate a single run's config before Hydra starts (no output folder yet).

    Every bad input becomes one ``trainlab: error:`` line and exit code 2. Sweeps (``-m``), an
    experiment preset that sweeps, and Hydra's own flags are left to Hydra (each job is validated
    when it starts). Returns the run composed once (:class:`SingleRun`, its ``resolved`` validated),
    None when left to Hydra.
    """
    check_group_choices(argv)
    launcher_error = slurm.check_launcher(argv)  # e.g. submitit_slurm without sbatch on PATH
    if launcher_error:
        fail(launcher_error)
    if any(a.startswith("-") for a in argv):
        return None
    from omegaconf import open_dict, read_write

    from framework.driver.runs import resolve_run

    try:
        hydra, cfg = _compose_job(argv)
    except Exception as err:  # Hydra's override/composition errors
        fail(_one_line_hydra_error(err, argv))
    if str(cfg.hydra.get("mode")).endswith("MULTIRUN"):  # an experiment preset that sweeps: its jobs are checked then
        return None
    if int(cfg.get("sweep", {}).get("repeats", 1) or 1) > 1:
        fail(
            f"sweep.repeats={cfg.sweep.repeats} repeats the jobs of a sweep; add -m and a swept key"
            " (e.g. -m sweep.label=a sweep.repeats=5 for one configuration)"
        )
    before = HydraConfig.instance().cfg
    HydraConfig.instance().set_config(cfg)  # run_name's resolver reads hydra:job.override_dirname
    try:
        job_cfg = cfg.copy()
        with read_write(job_cfg), open_dict(job_cfg):
            del job_cfg["hydra"]
        resolved = resolve_run(job_cfg)  # the job reuses it (validated once per run)
    except ConfigError as err:
        fail(str(err))
    finally:
        HydraConfig.instance().cfg = before  # run_job sets it for the job
    return SingleRun(hydra, cfg, resolved)


def _close_open_sweep(code: int, cause: BaseException | None) -> None:
    """End the parent run of a sweep that did not reach its end (a sweeper, launcher or Hydra
    exception, Ctrl-C, a preemption, bad input): KILLED for 130/75, else FAILED, with the one-line
    reason and its jobs' counts (:func:`framework.driver.sweep.close_sweep`); nothing when no sweep is open."""
    from framework.driver.sweep import close_sweep, current

    if current() is None:
        return
    from framework.base.faults.preemption import EXIT_PREEMPTED

    if code == 130:
        status, reason = "KILLED", "interrupted (exit 130)"
    elif code == EXIT_PREEMPTED:
        status, reason = "KILLED", f"preempted (exit {EXIT_PREEMPTED}); the same command continues the sweep"
    else:
        status = "FAILED"
        if cause is not None and not isinstance(cause, SystemExit):
            lines = [ln.strip() for ln in str(cause).splitlines() if ln.strip()]
            reason = f"{type(cause).__name__}: {lines[0] if lines else ''}".rstrip(": ") + f" (exit {code})"
        else:
            reason = f"exit {code}"
    print(f"trainlab: the sweep ended {status}: {reason}", file=sys.stderr, flush=True)
    close_sweep(status, reason)


def main(app: Callable[[], None]) -> None:
    """Console entry point: run the Hydra ``app`` once per call (``-m``: once per sweep point).

    ``app`` is the driver's ``@hydra.main`` function (:mod:`framework.driver.train`; its module names
    the Hydra job). Ends the process through :func:`framework.base.process_exit.exit_process` (no
    interpreter finalization) with the exit status the jobs asked for: 0, 1 (training failed;
    in a sweep: at least one job failed, after every job has run), 2 (bad input), 75
    (preempted), 130 (interrupted).
    """
    from framework.driver.launcher import start_rank_server, start_rank_server_early

    start_rank_server_early(sys.argv[1:])  # a no-op when python -m framework.train started it already
    try:
        single = precheck(sys.argv[1:])
        if single is None:
            app()  # a sweep or Hydra's own flags: @hydra.main composes
        else:
            start_rank_server(single.resolved)  # a no-op when it runs already
            single.run(app)
        code = 0
        from framework.driver.runs import FAILED_JOBS
        from framework.driver.sweep import SEARCH

        if SEARCH:  # an Optuna search: its failure budget decides (framework/driver/search.py)
            code = 1 if SEARCH.get("error") else 0
        elif FAILED_JOBS:
            print(
                f"trainlab: {len(FAILED_JOBS)} sweep job(s) FAILED: {', '.join(FAILED_JOBS)}"
                " (each run's error.txt and MLflow tag 'error' say why)",
                file=sys.stderr,
            )
            code = 1
    except KeyboardInterrupt:  # Ctrl-C before the ranks start (while composing, tokenizing, importing)
        print("trainlab: interrupted before training started", file=sys.stderr)
        code, cause = 130, None
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            code = done.code or 0
        else:  # sys.exit("message"): printed to stderr, status 1, as Python does
            print(done.code, file=sys.stderr)
            code = 1
        cause = done.__context__  # Hydra reports a sweeper's or launcher's exception, then exits 1 inside its handler
    except Exception as err:  # HYDRA_FULL_ERROR=1: Hydra re-raises instead
        import traceback

        traceback.print_exc()
        code, cause = 1, err
    else:
        cause = None
    _close_open_sweep(code, cause)
    from framework.base.process_exit import exit_process
    from framework.driver.launcher import stop_rank_server

    stop_rank_server()
    exit_process(code)
