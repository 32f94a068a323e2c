"""Start the ranks with PyTorch's elastic agent (the engine behind ``torchrun``).

The driver calls :func:`launch_ranks` in its own process; the agent spawns
``world_size / nnodes`` workers (``python -m framework.rank.worker launch.json``) on this node,
rendezvouses them (one node: c10d on a free local port; several: torch's static TCP rendezvous
at ``rendezvous.endpoint`` on node 0, :mod:`framework.driver.nodes`), restarts them up to ``trainer.max_restarts`` times when one fails,
and raises :class:`torch.distributed.elastic.multiprocessing.errors.ChildFailedError` (naming
the failed rank and its error) when they keep failing.

CPU ranks share the node's cores: the launcher sets ``OMP_NUM_THREADS`` to the run's
``threads_per_rank`` (:class:`~framework.base.resolved.ResolvedRun`: ``cores // ranks_per_node``
unless configured) for the children (the worker caps torch's pool at the same number), so
ranks x threads never exceeds the cores.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import uuid
from typing import Any

from framework.base.launch import LaunchSpec

PRELOAD_MODULES = [
    "torch",
    "pytorch_lightning",
    "framework.rank.worker",
    "framework.rank.module",
    "framework.rank.data",
    "framework.rank.callbacks.goodput",
    "framework.rank.faults.guard",
    "framework.rank.checkpoint.policy",
    "framework.rank.preloaded",  # last: freezes the objects of the imports above (copy-on-write in the ranks)
]
"""What the forkserver imports once when ``trainer.preload_ranks`` is on (:func:`start_rank_server`)."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_rank_server(resolved=None) -> None:
    """With ``trainer.preload_ranks`` (the default), start now the forkserver this node's ranks will fork from.

    The server imports :data:`PRELOAD_MODULES` (torch, Lightning, the worker: ~4 s of CPU on the
    2-core machine) in its own process, so on a machine with a free core that runs while the driver
    composes, validates (importing torch itself for the plugin class), tokenizes and opens its MLflow
    run, and every (re)start of the ranks forks from it instead of importing again. The driver starts
    it first thing (:func:`framework.driver.cli.main`, ``resolved`` None: before the config is read,
    unless the command line turns preloading off, :func:`preload_on_command_line`); later calls (a
    sweep's jobs, a shrink's relaunch) reuse it. One server per driver process.

    The ranks inherit the environment the server had when it started plus what the elastic agent
    sets per rank: the agent passes the driver's ``OMP_NUM_THREADS`` at launch (:func:`launch_ranks`
    sets it to the run's ``threads_per_rank``) and each rank caps torch's pool at the same number
    (:func:`framework.base.distributed.cap_threads`), so ranks x threads <= cores holds without the
    server knowing the run. Anything else a rank needs from the driver travels in ``launch.json``.

    The server lives in the driver's process group, and its ranks die with it (``PR_SET_PDEATHSIG``,
    :mod:`framework.rank.worker`): a preemption signal sent to the whole group (a scheduler's SIGTERM,
    Slurm's SIGUSR1/SIGUSR2 warning to every process of the job) would end the server by default
    and kill its ranks before they save. So it starts with :data:`~framework.base.faults.preemption.PREEMPT_SIGNALS`
    ignored (a disposition that survives ``exec``); each rank installs its own handlers for them.

    ``resolved``: the validated run (:class:`~framework.base.resolved.ResolvedRun`): nothing when its
    ``trainer.preload_ranks`` is off (a server started before the config was read then idles until
    :func:`stop_rank_server`); None: start regardless.
    The ranks never import MLflow (rank 0 writes an outbox the driver sends,
    :class:`~framework.base.tracking.MetricOutbox`), so the server is the same for tracked and untracked runs.
    """
    if resolved is not None and not resolved.run.trainer.preload_ranks:
        return
    import multiprocessing
    import signal
    import threading
    from multiprocessing import forkserver

    from framework.base.faults.preemption import PREEMPT_SIGNALS

    multiprocessing.set_forkserver_preload(PRELOAD_MODULES)
    if threading.current_thread() is not threading.main_thread():  # signal dispositions are the main thread's
        forkserver.ensure_running()
        return
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in PREEMPT_SIGNALS}
    try:
        forkserver.ensure_running()
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def preload_on_command_line(argv: list[str]) -> bool:
    """Whether the driver may start the rank server before it reads the config (:func:`start_rank_server`).

    True for a run or a local sweep on the command line ``argv`` (Hydra overrides, ``-m``), unless an
    override sets ``trainer.preload_ranks`` false or picks a Hydra launcher other than ``basic`` (a
    Slurm sweep's ranks run in its jobs, not under this driver), or another Hydra flag is given
    (``--help``, ``--cfg``: nothing runs). A preset that turns preloading off leaves an idle server
    (its cost: the imports, on the other core).
    """
    if any(arg.startswith("-") and arg not in ("-m", "--multirun") for arg in argv):
        return False
    preload = _override(argv, "trainer.preload_ranks")
    launcher = _override(argv, "hydra/launcher")
    return (preload is None or preload.lower() not in _FALSE) and (launcher is None or launcher == "basic")


_FALSE = ("false", "0", "no", "off", "null")
"""Override values that turn a boolean key off."""


def _override(argv: list[str], key: str) -> str | None:
    """The value the command line ``argv`` gives ``key`` (``key=v``, ``+key=v``, ``~key=v``), stripped; the last
    one wins, as in Hydra; None when no override names ``key``."""
    value = None
    for arg in argv:
        k, eq, v = arg.lstrip("+~").partition("=")
        if eq and k == key:
            value = v.strip()
    return value


DRIVER_ENV_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
"""Set in the driver's environment unless given (:func:`start_rank_server_early`): fail fast on an
unreachable MLflow server instead of minutes of retries (the driver is the only process that talks to MLflow)."""


def start_rank_server_early(argv: list[str]) -> None:
    """The driver's first step, before it imports Hydra: set :data:`DRIVER_ENV_DEFAULTS` and, where
    :func:`preload_on_command_line` allows, start the rank server (:func:`start_rank_server`), so that its
    imports run on the other core while the driver imports Hydra, composes and validates the config
    (importing torch itself for the plugin class).
    Measured with ``benchmarks/run_startup.py``. Idempotent: ``python -m framework.train`` calls it
    before importing the driver, :func:`framework.driver.cli.main` again.
    """
    for key, value in DRIVER_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if preload_on_command_line(argv):
        start_rank_server()


def stop_rank_server() -> None:
    """Kill the forkserver of :func:`start_rank_server`, if one runs; the driver calls it last.

    Left alone, the server would exit when the driver's end closes its pipe, but only after its
    interpreter's finalization with torch loaded (~1 s on the 2-core machine), holding the
    driver's stdout open meanwhile (a caller reading it to the end waits). Its ranks are done by
    then, and it holds no state. (The server's pid is not public in :mod:`multiprocessing.forkserver`.)
    """
    import signal
    from multiprocessing import forkserver

    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


LAUNCH_FILE = "launch.json"
"""The launch object's file in the run folder; every rank reads it (:meth:`LaunchSpec.read`)."""


def release_finished_ranks_on_close() -> None:
    """Let ranks that already returned exit at once when the elastic agent shuts its ranks down.

    With ``trainer.preload_ranks`` the ranks are functions run by torch's ``MultiprocessContext``:
    a rank that returned puts its value in a queue and then waits for the agent to say it read it
    (``_worker_finished_event``), which the agent sets only while it polls. When the agent itself
    got the preempting signal (a scheduler's signal to every process of the job: Slurm's
    ``scancel --signal=USR2``), it stops polling and closes the ranks with ``trainer.stop_grace_s``
    of grace: the ranks finished the step and saved in well under a second, then waited out the
    grace until SIGKILL (measured: exit 20.3 s after the signal with ``stop_grace_s=20``, the
    ranks' save done in the first second). Setting the event as the close begins releases them;
    ranks still in their step finish, save and exit when they return. (torch 2.13,
    ``torch/distributed/elastic/multiprocessing/api.py``.)
    """
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext

    close = MultiprocessContext._close
    if getattr(close, "releases_finished_ranks", False):
        return

    def _close(self: Any, death_sig: Any, timeout: int = 30) -> None:
        self._worker_finished_event.set()
        close(self, death_sig, timeout)

    _close.releases_finished_ranks = True  # type: ignore[attr-defined]
    MultiprocessContext._close = _close


def name_rendezvous_events_cheaply() -> None:
    """Make torch's dynamic rendezvous name its events from frame objects instead of ``inspect.stack()``.

    Each event of the c10d rendezvous is named by ``dynamic_rendezvous.get_method_name``, which calls
    ``inspect.stack()`` twice: that builds a record for every frame of the driver's deep Hydra stack
    and looks up each frame's module and source lines. Measured with cProfile on the 2-core machine:
    18 calls per launch, ~60 ms each, ~1 s of the driver's CPU on the path before the ranks start.
    The replacement returns the same name (the function ``depth`` frames up, or ``no_method_name``)
    by walking frames (``sys._getframe``); it only names log events. Nothing when this torch has no
    such helper. Idempotent.
    """
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    except ImportError:  # pragma: no cover (an older or newer torch)
        return
    if not hasattr(dynamic_rendezvous, "get_method_name") or getattr(
        dynamic_rendezvous.get_method_name, "_trainlab", False
    ):
        return

    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name  # inspect.stack()[depth] is this frame's depth-th caller
        except ValueError:  # the stack is not that deep
            return "no_method_name"

    get_method_name._trainlab = True
    dynamic_rendezvous.get_method_name = get_method_name


def launch_ranks(launch: LaunchSpec, max_restarts: int | None = None) -> None:
    """Write ``launch`` to ``run_dir/launch.json`` and run every rank of this node to completion.

    ``max_restarts``: elastic restarts of the ranks; None = ``trainer.max_restarts``. The
    agent's per-rank logs go to ``run_dir/elastic``.

    Raises:
        ChildFailedError: a rank failed and ``trainer.max_restarts`` restarts did not help.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    name_rendezvous_events_cheaply()
    launch_file = launch.write(launch.run_dir / LAUNCH_FILE)
    run = launch.resolved.run
    nproc = launch.resolved.nproc_per_node
    os.environ["OMP_NUM_THREADS"] = str(launch.resolved.threads_per_rank)
    # Restarted ranks must not share the agent's rendezvous TCPStore: its keys outlive a round, so
    # a restarted rank can read a dead peer's gloo address (connection refused). Unshared, rank 0
    # hosts a fresh store each round.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    nodes = launch.nodes
    if nodes is None:  # one node: an elastic c10d rendezvous of this driver's ranks on a free local port
        rdzv = dict(
            min_nodes=1,
            max_nodes=1,
            run_id=uuid.uuid4().hex[:12],
            rdzv_backend="c10d",
            rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        )
    else:  # node ranks as configured: the static rendezvous, hosted by node 0's agent (framework/driver/nodes.py)
        rdzv = dict(
            min_nodes=nodes.nnodes,
            max_nodes=nodes.nnodes,
            run_id=nodes.rdzv_id,
            rdzv_backend="static",
            rdzv_endpoint=nodes.endpoint,
            rdzv_configs={"rank": nodes.node_rank, "timeout": nodes.timeout_s},
        )
        # (the ranks' process group meets in the agent's store at the endpoint: MASTER_ADDR/PORT = the endpoint)
    # Options of newer torch releases (signals_to_handle, shutdown_timeout: torch >= 2.12) are left out where
    # this torch's LaunchConfig lacks them (e.g. a GPU image's torch 2.11): the agent then keeps its defaults.
    known = {f.name for f in dataclasses.fields(LaunchConfig)}
    newer = {
        k: v
        for k, v in dict(
            # The agent forwards these to the ranks (SIGUSR1/SIGUSR2 too: Slurm's --signal warning, as usually
            # asked / as submitit asks it: framework.base.faults.preemption.PREEMPT_SIGNALS), then waits
            # stop_grace_s for them to finish the step and save (framework.rank.callbacks.preemption) before SIGKILL.
            signals_to_handle="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2",
            shutdown_timeout=run.trainer.stop_grace_s,
        ).items()
        if k in known
    }
    config = LaunchConfig(
        nproc_per_node=nproc,
        **rdzv,
        max_restarts=run.trainer.max_restarts if max_restarts is None else max_restarts,
        monitor_interval=0.2,
        **newer,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(launch.run_dir / "elastic")),
    )
    if run.trainer.preload_ranks:  # ranks fork from the server that imported torch, Lightning and the worker once
        from framework.rank.worker import run_rank

        release_finished_ranks_on_close()

        start_rank_server(launch.resolved)  # started already by the driver (a no-op then)
        config.start_method = "forkserver"
        elastic_launch(config, entrypoint=run_rank)(str(launch_file))
        return
    elastic_launch(config, entrypoint=sys.executable)("-u", "-m", "framework.rank.worker", str(launch_file))
