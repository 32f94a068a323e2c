"""Slurm through Hydra: ``-m hydra/launcher=submitit_slurm`` (or ``submitit_local``), hydra-submitit-launcher's launchers.

The launchers are the library's (``hydra_plugins.hydra_submitit_launcher``: one Slurm job per
sweep point, submitted as a job array by ``submitit``); trainlab only maps its config onto
their keys (:data:`SLURM_MAPPING`, :data:`LOCAL_MAPPING`: interpolations stored over the
library's ``hydra/launcher`` options by :func:`register_launchers`):

- ``nodes`` = ``parallelism.nnodes``, ``tasks_per_node`` = 1: one trainlab driver per node, which
  starts that node's ranks with the elastic agent (:mod:`framework.driver.launcher`); under Slurm the
  rendezvous is found from ``SLURM_*`` (:mod:`framework.driver.nodes`).
- ``cpus_per_task`` = ranks per node x cores per rank (:func:`cpus_per_task`), ``gpus_per_node``
  (:func:`gpus_per_node`), ``timeout_min``, ``partition``, ``signal_delay_s``, ``mem_gb``,
  ``max_num_timeout`` from the ``slurm`` section (:class:`framework.base.config.schema.SlurmConfig`).

The launcher is built once per sweep, from the command line without its swept values, so every
job of one sweep gets the same allocation.

Preemption under Slurm: submitit asks Slurm for its signal (``SIGUSR2``, ``--signal=USR2@<signal_delay_s>``)
before the time limit, and its handler in the job pickles the launcher and requeues the job
(``scontrol requeue``) at once. trainlab's driver takes that signal over while its ranks run
(they finish the step and save, :mod:`framework.base.faults.preemption`), and only then hands it to
submitit's handler (:func:`requeue_after_save`): the requeued job runs the same job again and
resumes from the saved step.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Callable
from typing import Any

from omegaconf import OmegaConf

SUBMITIT_LAUNCHERS = ("submitit_slurm", "submitit_local")
"""The ``hydra/launcher`` options of hydra-submitit-launcher that trainlab maps its config onto."""

SLURM_COMMANDS = ("sbatch", "srun")
"""What submitit runs: ``sbatch`` to submit, ``srun`` inside the job (it refuses to start without it on PATH)."""


def ranks_per_node(world_size: int, nnodes: int, nproc_per_node: int | None) -> int:
    """``parallelism.nproc_per_node``, or ``world_size // nnodes`` when it is null (at least 1)."""
    return max(1, nproc_per_node if nproc_per_node is not None else world_size // max(1, nnodes))


def cpus_per_task(
    world_size: int, nnodes: int, nproc_per_node: int | None, threads_per_rank: int | None, cpus_per_rank: int
) -> int:
    """Slurm's ``cpus_per_task`` for a node's one driver task: its ranks x cores per rank
    (``trainer.threads_per_rank`` when set, else ``slurm.cpus_per_rank``). The ``tl_slurm_cpus`` resolver."""
    return ranks_per_node(world_size, nnodes, nproc_per_node) * (threads_per_rank or cpus_per_rank)


def gpus_per_node(
    gpus: int | None, accelerator: str, world_size: int, nnodes: int, nproc_per_node: int | None
) -> int | None:
    """Slurm's ``gpus_per_node``: ``slurm.gpus_per_node`` when set, else one GPU per rank with
    ``trainer.accelerator=cuda``, else None (no GPUs asked). The ``tl_slurm_gpus`` resolver."""
    if gpus is not None:
        return gpus
    return ranks_per_node(world_size, nnodes, nproc_per_node) if accelerator == "cuda" else None


OmegaConf.register_new_resolver("tl_slurm_cpus", cpus_per_task, replace=True)
OmegaConf.register_new_resolver("tl_slurm_gpus", gpus_per_node, replace=True)


# (a plugin's preset may leave out nnodes / nproc_per_node, e.g. single: 1 node, world_size ranks)
_RANKS = "${parallelism.world_size},${oc.select:parallelism.nnodes,1},${oc.select:parallelism.nproc_per_node,null}"

LOCAL_MAPPING = {
    "nodes": 1,
    "tasks_per_node": 1,  # one trainlab driver; it starts the ranks (elastic agent)
    "cpus_per_task": "${tl_slurm_cpus:" + _RANKS + ",${trainer.threads_per_rank},${slurm.cpus_per_rank}}",
    "gpus_per_node": "${tl_slurm_gpus:${slurm.gpus_per_node},${trainer.accelerator}," + _RANKS + "}",
    "mem_gb": "${slurm.mem_gb}",
    "timeout_min": "${slurm.timeout_min}",
    "name": "trainlab",
}
"""``hydra/launcher=submitit_local``: the library's ``LocalQueueConf`` with these values (one node)."""

SLURM_MAPPING = {
    **LOCAL_MAPPING,
    "nodes": "${oc.select:parallelism.nnodes,1}",  # one task (trainlab driver) on each node
    "partition": "${slurm.partition}",
    "signal_delay_s": "${slurm.signal_delay_s}",
    "max_num_timeout": "${slurm.max_timeouts}",
}
"""``hydra/launcher=submitit_slurm``: the library's ``SlurmQueueConf`` with these values."""


def register_launchers() -> bool:
    """Store hydra-submitit-launcher's ``submitit_slurm`` / ``submitit_local`` options again, with
    :data:`SLURM_MAPPING` / :data:`LOCAL_MAPPING` merged in. The library registers its own when
    Hydra scans its plugins (once per process, executing each plugin's modules), so the scan is
    made first and this registration comes after it. Any key of the library's
    launcher can still be set on the command line (``hydra.launcher.<key>=...``). Returns False when
    the package is not installed."""
    try:
        from hydra.core.config_store import ConfigStore
        from hydra.core.plugins import Plugins
        from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf, SlurmQueueConf
    except ImportError:
        return False
    Plugins.instance()  # the scan (a no-op once made)
    store = ConfigStore.instance()
    for name, schema, mapping in (
        ("submitit_slurm", SlurmQueueConf, SLURM_MAPPING),
        ("submitit_local", LocalQueueConf, LOCAL_MAPPING),
    ):
        node = OmegaConf.merge(OmegaConf.structured(schema), mapping)
        store.store(group="hydra/launcher", name=name, node=node, provider="submitit_launcher")
    return True


def launcher_choice(argv: list[str]) -> str | None:
    """The ``hydra/launcher=<option>`` of a command line (the last one), or None."""
    found = None
    for arg in argv:
        key, _, value = arg.partition("=")
        if key.lstrip("+~") == "hydra/launcher" and value:
            found = value
    return found


def check_launcher(argv: list[str], which: Callable[[str], str | None] = shutil.which) -> str | None:
    """The one-line error for a submitit launcher that cannot work here, else None.

    ``submitit_slurm`` needs Slurm's ``sbatch`` and ``srun`` on PATH; both need the
    ``hydra-submitit-launcher`` package.
    """
    choice = launcher_choice(argv)
    if choice not in SUBMITIT_LAUNCHERS:
        return None
    if not register_launchers():
        return (
            f"hydra/launcher={choice} needs the hydra-submitit-launcher package, which is not installed"
            " (pip install hydra-submitit-launcher, or make setup)"
        )
    if choice == "submitit_slurm":
        missing = [c for c in SLURM_COMMANDS if which(c) is None]
        if missing:
            return (
                f"hydra/launcher=submitit_slurm needs Slurm, but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not on PATH: run on a"
                " Slurm login node, or install Slurm (Debian: apt-get install slurm-wlm munge; a one-node Slurm on"
                " this machine: scripts/slurm/start_local_slurm.sh --install); hydra/launcher=submitit_local runs"
                " the jobs on this machine"
            )
    return None


# --- preemption inside a submitit job ---------------------------------------------------------------


def submitit_job_signal() -> signal.Signals | None:
    """submitit's preemption/timeout signal (``SIGUSR2`` unless ``SUBMITIT_PREEMPT_SIGNAL`` says otherwise)
    when this process is a submitit Slurm job, else None."""
    if os.environ.get("SUBMITIT_EXECUTOR") != "slurm":
        return None
    return getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"), None)


class SubmititHandlers:
    """submitit's signal handlers of this job, saved when the driver starts (before the elastic
    agent installs its own), so the job can requeue once the ranks have saved."""

    def __init__(self) -> None:
        self.sig = submitit_job_signal()
        self.saved: dict[int, Any] = {}
        if self.sig is not None:
            self.saved = {s: signal.getsignal(s) for s in (self.sig, signal.SIGTERM, signal.SIGCONT)}

    def requeues(self, signal_name: str | None) -> bool:
        """Whether a preemption by ``signal_name`` is submitit's: the job requeues (SIGTERM does not:
        a scheduler that requeues on preemption does so itself, and ``scancel`` means stop)."""
        return self.sig is not None and signal_name == self.sig.name and callable(self.saved.get(self.sig))


def requeue_after_save(handlers: SubmititHandlers) -> None:
    """Hand submitit's signal to submitit's handler, now that the ranks have saved: it pickles the
    launcher's call again (``checkpoint()``), runs ``scontrol requeue <job>`` and exits the job
    (``sys.exit(-1)``, as after any submitit requeue; Slurm then ends the job's processes and starts the
    job again, which resumes from the saved step). submitit's SIGTERM/SIGCONT handlers (log and go on) are
    restored first, so the requeue's SIGTERM does not interrupt it.

    Raises:
        SystemExit: always, from submitit (or submitit's ``UncompletedJobError`` when it declines to
            requeue: timed out more than ``slurm.max_timeouts`` times).
    """
    assert handlers.sig is not None
    for sig, handler in handlers.saved.items():
        if sig != handlers.sig and handler is not None:
            signal.signal(sig, handler)
    handlers.saved[handlers.sig](handlers.sig, None)
