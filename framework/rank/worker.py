"""One rank: build data, model, plugin strategy and a Lightning Trainer, resume, and fit.

Started by the elastic agent (see :mod:`framework.driver.launcher`) as
``python -m framework.rank.worker <launch.json>``; the launch file holds the
:class:`~framework.base.launch.LaunchSpec` (the run the driver resolved, the MLflow run id, the
checkpoint to resume from), which the rank reads back without validating again. Rank and world
size come from the environment the agent sets (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR/PORT), which Lightning reads too.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import record

from framework.base.launch import LaunchSpec


def _die_with_parent() -> None:
    """Make this rank die when the elastic agent dies (Linux).

    The agent starts each rank in a session of its own, so a SIGKILL of the driver (which hosts
    the agent) would otherwise leave orphaned ranks training on, writing checkpoints and
    metrics next to the run that replaces them.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    parent = os.getppid()
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _release_the_servers_lifeline() -> None:
    """Close this rank's copy of the forkserver's "alive" pipe, so that the server, and with it this rank
    (:func:`_die_with_parent`), ends when the driver dies.

    The forkserver exits when its alive pipe has no writer left, but every process it forks inherits the
    write end (Python's ``multiprocessing.forkserver``, ``_forkserver_alive_fd``), so a SIGKILL of the driver
    alone left the server and its ranks training on. A rank starts no process through the forkserver, the
    only use of that fd in a child.
    """
    from multiprocessing import forkserver

    server = forkserver._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        server._forkserver_alive_fd = None
        try:
            os.close(fd)
        except OSError:
            pass


def _quiet_libraries() -> None:
    # Lightning explains its own choices at length on every rank; keep warnings and errors only.
    # (Called after importing Lightning, which sets its loggers to INFO at import time.)
    import pytorch_lightning  # noqa: F401

    for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*PossibleUserWarning.*")
    warnings.filterwarnings("ignore", message=".*Consider setting `persistent_workers=True`.*")
    warnings.filterwarnings("ignore", message=".*gloo.*")
    # Our data module restores the sample position itself (consumed samples in its state).
    warnings.filterwarnings("ignore", message=".*is not resumable.*")
    # Validation is ValidationLoss's job (fixed windows at fixed steps), not Lightning's val loop.
    warnings.filterwarnings("ignore", message=".*`val_dataloader` but have no `validation_step`.*")
    warnings.filterwarnings("ignore", message=".*`isinstance\\(treespec, LeafSpec\\)` is deprecated.*")
    # The elastic agent starts the ranks, also inside a Slurm job (one driver per node): Lightning's hint
    # to start them with srun, printed wherever Slurm is installed, does not apply.
    warnings.filterwarnings("ignore", message=".*The `srun` command is available on your system but is not used.*")


def build_trainer_and_fit(launch: LaunchSpec, marks: dict[str, float] | None = None) -> None:
    """Train this rank as the driver's launch object describes; rank 0 writes ``run_dir/summary.json``.

    The run arrives resolved (layout, batch split) and is not validated again here. ``marks``:
    start-up times so far (Unix seconds, ``t_proc``/``t_main``), for the run's timeline
    (:class:`~framework.rank.callbacks.goodput.RunTimeline`), which adds ``t_fit``.
    """
    import pytorch_lightning as pl

    from framework.base.data.tokens import TokenCache
    from framework.base.distributed import cap_threads, resolve_accelerator
    from framework.base.faults.events import FaultLog
    from framework.base.metrics.emit import MetricEmitter
    from framework.base.registry import get_plugin_class
    from framework.rank.data import TextDataModule
    from framework.rank.faults.restart import restart_label, resume_path
    from framework.rank.module import LMModule

    resolved, run = launch.resolved, launch.resolved.run
    rank = int(os.environ.get("RANK", "0"))
    # ranks x threads <= cores, or CPU ranks thrash (the driver's count: ResolvedRun.threads_per_rank).
    cap_threads(resolved.threads_per_rank)
    log, segment = FaultLog(launch.run_dir), restart_label(launch)  # the run's event log; which (re)start this is
    accelerator = resolve_accelerator(run.trainer.accelerator)
    pl.seed_everything(run.trainer.seed, verbose=False)  # python, numpy, torch (CPU and CUDA): same on every rank

    plugin = get_plugin_class(run.parallelism.name)(run.parallelism)
    cache = TokenCache.open(launch.token_cache_dir)  # built by the driver before any rank started
    vocab_size = run.model.vocab_size or cache.vocab_size
    # A plugin that owns micro-batching (a pipeline schedule) gets a step's micro-batches in one batch.
    datamodule = TextDataModule(
        run.data,
        global_batch_size=resolved.global_batch_size,
        micro_batch_size=resolved.loader_batch_size,
        dp_rank=resolved.layout.dp_rank(rank),  # TP and PP peers read the same data
        dp_size=resolved.layout.dp,
        max_steps=run.trainer.max_steps,
        val_sequences=run.trainer.val_sequences,
        cache_dir=launch.token_cache_dir,
    )
    module = LMModule(resolved, vocab_size=vocab_size, plugin=plugin)
    sinks, outbox = _metric_sinks(launch, rank)
    emit = MetricEmitter(sinks, enabled=rank == 0)  # the one way this rank sends metrics
    flops = _flops_setup(run, vocab_size, accelerator, outbox)
    marks = {} if marks is None else marks
    step_metrics, train_step, ckpt_plugins = _build_step(
        launch, plugin, rank, module.step_state, emit, flops, marks, log, segment
    )
    trainer = _build_trainer(resolved, plugin, accelerator, [train_step], ckpt_plugins, launch.run_dir)
    ckpt_path = resume_path(launch, rank, log, segment)  # after an elastic restart: the newest valid checkpoint
    marks["t_fit"] = time.time()
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    if trainer.is_global_zero:
        summary = {**step_metrics.summary, "flops_per_token": float(flops.per_token), "peak_flops": flops.peak}
        if step_metrics.calibration_error is not None:  # MFU > 1: not logged; the peak is measured again
            summary["mfu_calibration_error"] = _recalibrate(
                run, accelerator, flops, step_metrics.calibration_error, outbox
            )
        (launch.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))


def _metric_sinks(launch: LaunchSpec, rank: int) -> tuple[list, Any]:
    """This rank's metric sinks (the run's ``metrics.jsonl``; on rank 0 of a tracked run also the outbox the
    driver sends to its MLflow run, :class:`~framework.base.tracking.MetricOutbox`) and that outbox or None."""
    from framework.base.tracking import JsonlMetricSink, MetricOutbox, outbox_path

    sinks: list = [JsonlMetricSink(launch.run_dir / "metrics.jsonl")]
    outbox = None
    if launch.mlflow_run_id and rank == 0:
        outbox = MetricOutbox(outbox_path(launch.run_dir, launch.mlflow_run_id))
        sinks.append(outbox)
    return sinks, outbox


@dataclass(frozen=True)
class _Flops:
    """MFU inputs: this device's peak FLOP/s and the model's FLOPs per token (model and hardware count)."""

    peak: float
    per_token: int
    hardware_per_token: int


def _flops_setup(run: Any, vocab_size: int, accelerator: str, outbox: Any) -> _Flops:
    """Peak FLOP/s of this rank's device (measured or looked up) and the configured GPT's FLOPs per token;
    how they were obtained goes to the MLflow run's params when ``outbox`` (rank 0's) is given."""
    import torch

    from framework.base.metrics.flops import FLOPS_CONVENTION, peak_flops_info
    from framework.base.model import build_model  # only for the FLOPs count of the configured shape

    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if accelerator == "cuda" else torch.device("cpu")
    )
    info = peak_flops_info(
        device, dtype=_peak_dtype(run), threads=torch.get_num_threads(), cache_dir=run.data.cache_dir
    )
    peak, peak_method = info.flops, info.method
    with torch.device("meta"):
        shape = build_model(run.model, vocab_size=vocab_size)
        flops = _Flops(
            peak=peak,
            per_token=shape.flops_per_token(run.data.seq_len),
            hardware_per_token=shape.hardware_flops_per_token(run.data.seq_len),
        )
    if outbox is not None:
        outbox.log_params(
            {
                "mfu.peak_flops_per_device": f"{peak:.4g}",
                "mfu.peak_flops_method": peak_method,
                **(
                    {
                        "mfu.peak_measured_at": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(info.measured_at)),
                        "mfu.peak_other_cpu_share": f"{info.other_cpu_share:.2f}",
                    }
                    if info.other_cpu_share is not None
                    else {}
                ),
                "mfu.flops_convention": FLOPS_CONVENTION,
                "mfu.flops_per_token": str(flops.per_token),
            }
        )
    return flops


def _recalibrate(run: Any, accelerator: str, flops: _Flops, achieved: float, outbox: Any) -> str:
    """A run's achieved FLOP/s per device exceeded its peak (MFU > 1, not logged): measure the peak
    again (the cache keeps the highest) and say so on stderr and in tag ``mfu.calibration_error``;
    returns that one line."""
    import torch

    from framework.base.metrics.flops import recalibrate

    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if accelerator == "cuda" else torch.device("cpu")
    )
    info = recalibrate(
        device, dtype=_peak_dtype(run), threads=torch.get_num_threads(), cache_dir=run.data.cache_dir, achieved=achieved
    )
    msg = (
        f"calibration error: the run achieved {achieved:.4g} FLOP/s per device, above the peak {flops.peak:.4g}"
        f" ({'measured under load' if info.under_load else 'measured'}); MFU not logged; peak measured again:"
        f" {info.flops:.4g} FLOP/s"
    )
    print(f"trainlab: warning: {msg}", file=sys.stderr, flush=True)
    if outbox is not None:
        outbox.set_tags({"mfu.calibration_error": msg})  # best effort: never raises
    return msg


def _peak_dtype(run: Any) -> str:
    p = run.trainer.precision
    return "bf16" if p.startswith("bf16") else ("fp16" if p.startswith("16") else "fp32")


def _step_metrics(resolved: Any, clock: Any, flops: _Flops, emit: Any) -> Any:
    """The step-metrics callback (loss, LR, tokens/s, MFU, grad norm, elastic figures) of this launch."""
    from framework.rank.callbacks.step_metrics import StepMetrics

    t = resolved.run.trainer
    return StepMetrics(
        clock=clock,
        tokens_per_step=resolved.tokens_per_step,
        flops_per_token=flops.per_token,
        peak_flops=flops.peak,
        num_devices=resolved.world_size,
        log_every_n_steps=t.log_every_n_steps,
        warmup_steps_excluded=t.warmup_steps_excluded,
        emit=emit,
        progress_bar=t.progress_bar,
        hardware_flops_per_token=flops.hardware_per_token,
        dp_degree=resolved.layout.dp,
        grad_accum_steps=resolved.grad_accum_steps,
    )


def _build_step(
    launch: LaunchSpec,
    plugin: Any,
    rank: int,
    state: Any,
    emit: Any,
    flops: _Flops,
    marks: dict[str, float],
    log: Any,
    segment: str,
) -> tuple[Any, Any, list]:
    """``(step_metrics, train_step, checkpoint_plugins)``: the step's parts, each in its phase
    (:data:`framework.rank.step.PHASES`; the order within a phase is the order below), in one
    :class:`~framework.rank.step.TrainStep`, the Trainer's only callback; ``state``: the module's
    :class:`~framework.rank.step.StepState`; ``emit``: the run's :class:`~framework.base.metrics.emit.MetricEmitter`;
    ``log``: the run's event log (:class:`~framework.base.faults.events.FaultLog`), opened once by the rank;
    ``segment``: which (re)start of the ranks this is (:func:`framework.rank.faults.restart.restart_label`).
    """
    from framework.base.distributed import resolve_accelerator
    from framework.rank.callbacks.activation_memory import ActivationMemory
    from framework.rank.callbacks.breakdown import StepBreakdown
    from framework.rank.callbacks.clock import StepClock
    from framework.rank.callbacks.goodput import RunTimeline
    from framework.rank.callbacks.metric_flush import FlushMetrics
    from framework.rank.callbacks.preemption import Preemption
    from framework.rank.callbacks.validation import ValidationLoss
    from framework.rank.checkpoint.memory import MemorySnapshot
    from framework.rank.checkpoint.periodic import PeriodicCheckpoint
    from framework.rank.checkpoint.policy import build_checkpointing
    from framework.rank.faults.guard import build_fault_callbacks
    from framework.rank.step import TrainStep

    resolved, trainer_cfg = launch.resolved, launch.resolved.run.trainer
    clock = StepClock()  # step ends and the seconds outside training, for every part that reads them
    step_metrics = _step_metrics(resolved, clock, flops, emit)
    log_every = trainer_cfg.log_every_n_steps
    breakdown = StepBreakdown(
        clock=clock,
        plugin=plugin,
        resolved=resolved,
        log_every_n_steps=log_every,
        warmup_steps_excluded=trainer_cfg.warmup_steps_excluded,
        emit=emit,
    )
    flush = FlushMetrics(clock=clock, emit=emit, on_time_spent=breakdown.add_logging_time) if emit.buffered else None
    # The folder CheckpointIO plugin and the checkpoint parts; on_time_spent gets the seconds the step was held;
    # a step's metrics so far are sent before its checkpoint is saved.
    ckpt_plugins, ckpt_callbacks = build_checkpointing(
        resolved,
        is_global_zero=rank == 0,
        emit=emit,
        checkpoint_kind=plugin.capabilities.checkpoint_format,
        on_time_spent=clock.add_checkpoint,
        before_save=flush.flush if flush is not None else None,
    )
    snapshot = next((cb for cb in ckpt_callbacks if isinstance(cb, MemorySnapshot)), None)
    (periodic,) = [cb for cb in ckpt_callbacks if isinstance(cb, PeriodicCheckpoint)]
    parts: list[tuple[str, Any]] = []
    if trainer_cfg.count_host_syncs:  # first of all: its window opens before any other part's batch start
        from framework.rank.callbacks.host_syncs import HostSyncs

        parts.append(
            (
                "probe",
                HostSyncs(
                    log_every_n_steps=log_every,
                    val_every_n_steps=trainer_cfg.val_every_n_steps,
                    emit=emit,
                    out_dir=launch.run_dir if rank == 0 else None,
                    cuda=resolve_accelerator(trainer_cfg.accelerator) == "cuda",
                ),
            )
        )
    if trainer_cfg.profile_steps is not None:
        from framework.rank.callbacks.profiler import StepProfiler

        first, last = trainer_cfg.profile_steps
        parts.append(("probe", StepProfiler(first=first, last=last, out_dir=launch.run_dir / "profile")))
    validation = ValidationLoss(
        every_n_steps=trainer_cfg.val_every_n_steps, emit=emit, on_time_spent=clock.add_validation
    )
    # compiled graphs save their own tensors (see ActivationMemory's docstring)
    activation = None if trainer_cfg.compile else ActivationMemory(clock=clock, log_every_n_steps=log_every, emit=emit)
    preemption = Preemption(clock=clock, checkpoint=periodic, log=log if rank == 0 else None, segment=segment)
    parts += [("boundary", clock), ("metrics", step_metrics), ("metrics", validation), ("metrics", activation)]
    parts += [
        ("faults", cb)
        for cb in build_fault_callbacks(launch, rank=rank, log=log, segment=segment, clock=clock, snapshot=snapshot)
    ]  # [] w/o faults
    parts += [("checkpoint", cb) for cb in ckpt_callbacks] + [("checkpoint", preemption)]
    parts += [
        ("plugin", cb) for cb in plugin.callbacks(resolved, emit)
    ]  # plugin-specific metrics (e.g. pipeline bubble)
    parts += [
        ("accounting", breakdown),
        (
            "accounting",
            RunTimeline(
                log=log, clock=clock, launch_index=launch.launch_index, segment=segment, marks=marks, enabled=rank == 0
            ),
        ),  # goodput and recovery counters
        ("send", flush),
    ]
    return step_metrics, TrainStep(state, parts), ckpt_plugins


def _build_trainer(
    resolved: Any, plugin: Any, accelerator: str, callbacks: list, ckpt_plugins: list, run_dir: Path
) -> Any:
    """The Lightning ``Trainer``: the plugin's strategy, the run's precision, steps and accumulation;
    Lightning's own logging, checkpointing, validation loop and sampler are off (the step's parts do them)."""
    import pytorch_lightning as pl

    run = resolved.run
    return pl.Trainer(
        accelerator=accelerator,
        devices=resolved.nproc_per_node,
        num_nodes=resolved.layout.nnodes,
        strategy=plugin.build_strategy(resolved),
        precision=run.trainer.precision,
        max_steps=run.trainer.max_steps,
        max_epochs=-1,
        accumulate_grad_batches=resolved.trainer_accumulate_grad_batches,
        gradient_clip_val=run.optim.grad_clip or None,
        gradient_clip_algorithm="norm",
        callbacks=callbacks,
        plugins=ckpt_plugins,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        default_root_dir=str(run_dir),
    )


def _shutdown_process_group() -> None:
    """Tear the process group down before the interpreter exits.

    Left to interpreter exit, a live gloo group's threads are destroyed during C++ static
    destruction and the rank aborts ("terminate called without an active exception", SIGABRT)
    in roughly one run of five on CPU, turning a finished run into a failed one.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _keep_mlflow_out() -> None:
    """Mark MLflow absent in this rank: ``import mlflow`` raises ImportError from here on.

    A rank never talks to MLflow (rank 0 writes an outbox the driver sends,
    :class:`~framework.base.tracking.MetricOutbox`), but ``import deepspeed`` imports it when it is
    installed (its autotuner, which catches the ImportError): ~1 s of CPU per DeepSpeed rank on the
    2-core machine (``python -X importtime``), before the rendezvous. Any other import of it in a
    rank now fails loudly instead of adding that cost unseen.
    """
    sys.modules.setdefault("mlflow", None)


def run_rank(launch_file: str) -> int:
    """Entry point of one rank as a function (``trainer.preload_ranks``: forked from a forkserver
    that already imported :data:`framework.driver.launcher.PRELOAD_MODULES`); returns 0, the value the elastic agent waits
    for from every rank (multiprocessing then ends the process with ``os._exit``).
    """
    from framework.rank.callbacks.goodput import process_start_time

    marks = {"t_proc": process_start_time(), "t_main": time.time()}
    faulthandler.enable(all_threads=True)
    _die_with_parent()
    _release_the_servers_lifeline()
    _keep_mlflow_out()
    from framework.base.process_exit import kill_daemonic_children
    from framework.rank.callbacks.preemption import install_handlers

    install_handlers()  # a preemption during start-up stops the rank after its first step
    _quiet_libraries()
    build_trainer_and_fit(LaunchSpec.read(launch_file), marks)
    _shutdown_process_group()
    kill_daemonic_children()  # the loader workers: multiprocessing's join of them at return would hang
    return 0


@record
def main(argv: list[str] | None = None) -> None:
    """Entry point of one rank: ``python -m framework.rank.worker LAUNCH_JSON``."""
    t_main = time.time()  # interpreter up, torch imported (by this module's imports)
    from framework.rank.callbacks.goodput import process_start_time

    marks = {"t_proc": process_start_time(), "t_main": t_main}
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m framework.rank.worker LAUNCH_JSON")
    # A rank killed by a fatal signal (SIGABRT from a C++ std::terminate, SIGSEGV) prints every
    # thread's Python stack to stderr first; the elastic agent reports only the signal.
    faulthandler.enable(all_threads=True)
    _die_with_parent()
    _keep_mlflow_out()
    from framework.rank.callbacks.preemption import install_handlers

    install_handlers()  # a preemption during start-up stops the rank after its first step
    _quiet_libraries()
    build_trainer_and_fit(LaunchSpec.read(argv[0]), marks)
    _shutdown_process_group()
    from framework.base.process_exit import exit_process

    exit_process(0)


if __name__ == "__main__":
    main()
