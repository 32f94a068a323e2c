"""The driver: ``python -m framework.train [overrides]`` (a Hydra app; ``-m`` sweeps).

One job (:func:`run_job`) = validate the config once (every bad value is a one-line error, exit
code 2, before any rank starts or MLflow run opens) -> prepare the token cache -> choose the
checkpoint to resume from -> open (or re-open) the MLflow run -> start the ranks with the typed
launch object (:class:`~framework.base.launch.LaunchSpec`) under the resilience policy -> set the
run's final status -> print a summary. The command line around it (precheck, one-line Hydra
errors, exit codes) is :mod:`framework.driver.cli`; MLflow bookkeeping is :mod:`framework.base.tracking`;
which checkpoint to resume, and whether the plugin can load it, is :mod:`framework.base.checkpoint.resume`.
A job of a sweep (``-m``) is also a child run of the sweep's parent and returns its objective;
the sweep around it is :mod:`framework.driver.sweep`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from framework.base.config.schema import ConfigError
from framework.base.resolved import ResolvedRun
from framework.driver import cli


def run_job(cfg: DictConfig, run_dir: Path) -> float | None:
    """Run one Hydra job (one MLflow run) whose output folder is ``run_dir``.

    Returns the job's objective in a sweep (:func:`framework.driver.sweep.record_job`: tokens/s by
    default, None when the job failed; what the Optuna sweeper maximises), else None. Exits with
    code 2 on a configuration error (in a sweep: the job is a FAILED child and the sweep goes on),
    1 when training failed outside a sweep (in a sweep the run ends FAILED and the job returns),
    130 when interrupted (Ctrl-C), 75 when preempted (SIGTERM/SIGUSR1/SIGUSR2: the ranks saved the step
    they were in; :mod:`framework.base.faults.preemption`); in a submitit Slurm job preempted by submitit's
    signal, submitit requeues the job instead (:func:`framework.driver.slurm.requeue_after_save`). The run's locks are held for the job and released when it ends.
    """
    from framework.driver import runs, sweep

    if cli.in_sweep():  # an explicit checkpoint.dir is the root of the jobs' own folders
        own = sweep.job_checkpoint_dir(cfg.checkpoint.dir, str(cfg.run_name))
        if own != cfg.checkpoint.dir:
            cfg = cfg.copy()
            with open_dict(cfg):
                cfg.checkpoint.dir = own
    try:
        resolved, cache, model = _resolve(cfg)
    except ConfigError as err:
        if not cli.in_sweep():
            cli.fail(str(err))
        print(f"trainlab: error: {err}", file=sys.stderr, flush=True)
        sweep.record_refused_job(cfg, run_dir, str(err))
        runs.FAILED_JOBS.append(str(cfg.run_name))
        return None
    from framework.driver.nodes import resolve_nodes

    nodes = resolve_nodes(resolved.run)  # None on one node; validated already
    if nodes is not None and nodes.node_rank > 0:  # no MLflow run, no output folder (node 0's driver keeps them)
        with runs.hold_locks([run_dir]):  # this node's folder in the shared checkpoint folder
            _run_other_node(resolved, cache, nodes, run_dir)
        return None
    with runs.hold_locks([run_dir, Path(resolved.checkpoint_dir)]):
        status, reason, run_id = _train(resolved, cache, model, run_dir, nodes)
    return sweep.record_job(run_dir, status, reason, run_id=run_id) if cli.in_sweep() else None


def _train(
    resolved: ResolvedRun, cache: Any, model: Any, run_dir: Path, nodes: Any = None
) -> tuple[str, str, str | None]:
    """Resume selection, the MLflow run, the ranks under the resilience policy, the final status;
    returns ``(status, one-line reason of a failure, MLflow run id or None)`` (FINISHED when there was
    nothing left to train).
    ``nodes``: node 0 of a multi-node run (:class:`~framework.base.launch.NodeSpec`), or None on one node."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from framework.base.faults.preemption import (
        EXIT_PREEMPTED,
        PREEMPT_SIGNALS,
        EarlySignals,
        preemption_outcome,
        record_preemption,
    )
    from framework.base.launch import LaunchSpec
    from framework.base.tracking import MetricForwarder, finish_driver_run, outbox_path
    from framework.driver.faults.supervisor import supervise
    from framework.driver.slurm import SubmititHandlers, requeue_after_save

    submitit_handlers = (
        SubmititHandlers()
    )  # in a submitit Slurm job: its requeue handler, before the agent installs its own
    run = resolved.run
    resume = _choose_resume(resolved, run_dir)
    if resume is None:
        return "FINISHED", "", _finish_interrupted_run(resolved, model, cache, run_dir)
    if nodes is not None:  # node 0: the endpoint is ours to listen on; the other nodes look for the marker
        from framework.driver.nodes import check_endpoint, mark_shared_folder

        try:
            check_endpoint(nodes)
        except ConfigError as err:
            cli.fail(str(err))
        mark_shared_folder(resolved.checkpoint_dir, nodes)
    tracker = _open_tracking(resolved, model, cache, resumed=bool(resume.path))
    launch = LaunchSpec(
        resolved=resolved,
        run_dir=run_dir,
        mlflow_run_id=tracker.run_id if tracker else None,
        resume_from=resume.path,
        token_cache_dir=str(cache.dir),
        nodes=nodes,
    )
    status, error, preempted = "FAILED", None, None
    (run_dir / "error.txt").unlink(missing_ok=True)  # a resumed run starts without its last failure
    started_at = time.time()

    def preempted_before_ranks(sig: Any) -> None:  # the main thread is blocked (node 0's agent waits for the nodes)
        outcome = preemption_outcome(
            run_dir,
            resolved.checkpoint_dir,
            since=started_at,
            signal_name=sig.name,
            before_ranks=True,
            t_signal=early.t_signal,
        )
        if tracker is not None:
            record_preemption(tracker, outcome)
            finish_driver_run(
                tracker, "KILLED", run_dir=run_dir, started_at=started_at, error=None, resumed=bool(resume.path)
            )
        print(
            f"trainlab: preempted: {outcome.describe()}; run the same command again to resume",
            file=sys.stderr,
            flush=True,
        )
        from framework.driver.sweep import close_sweep

        close_sweep("KILLED", f"preempted ({sig.name}) before the ranks started; the same command continues the sweep")
        os._exit(EXIT_PREEMPTED)

    early = EarlySignals(preempted_before_ranks)
    from framework.base.load_monitor import LoadMonitor

    monitor = LoadMonitor(
        run.tracking.load_interval_s,
        run.tracking.contended_cpu_share,
        cuda=run.trainer.accelerator == "cuda",
        run_dir=run_dir,
    )  # what competes with the run
    forwarder = (
        MetricForwarder(tracker.client, tracker.run_id, outbox_path(run_dir, tracker.run_id))
        if tracker is not None
        else nullcontext()
    )  # rank 0's metrics to the MLflow run, while the ranks run and all of them when they end
    try:
        with early, monitor, forwarder:
            supervise(launch, tracker)  # launch_ranks + restarts/shrink (framework/faults)
        preempted = preemption_outcome(run_dir, resolved.checkpoint_dir, since=started_at)  # the ranks got the signal
        status = "KILLED" if preempted else "FINISHED"
        if tracker is not None and not preempted:
            _log_run_summary(tracker, resolved, run_dir)
    except (
        KeyboardInterrupt,
        SignalException,
    ) as err:  # the elastic agent turns SIGINT/SIGTERM/SIGUSR1 into SignalException
        status = "KILLED"
        if getattr(err, "sigval", None) not in PREEMPT_SIGNALS:  # Ctrl-C
            print(
                "trainlab: interrupted; the newest checkpoint resumes the run (run the same command again)",
                file=sys.stderr,
            )
            raise SystemExit(130)
        preempted = preemption_outcome(
            run_dir,
            resolved.checkpoint_dir,
            since=started_at,
            signal_name=err.sigval.name,
            before_ranks=early.fired is not None,
            t_signal=early.t_signal,
        )
    except Exception as err:
        from framework.driver.faults.supervisor import failure_reason

        reason = failure_reason(err)  # the root cause (first rank to fail), then the whole report
        detail = str(err).strip()
        error = reason if not detail or detail == reason else f"{reason}\n{detail}"
        from framework.driver.runs import record_failure

        record_failure(run_dir, run.run_name, error, in_sweep=cli.in_sweep())
        return "FAILED", reason, tracker.run_id if tracker else None
    finally:
        if tracker is not None:
            record_preemption(tracker, preempted)
            finish_driver_run(
                tracker, status, run_dir=run_dir, started_at=started_at, error=error, resumed=bool(resume.path)
            )
    if preempted and submitit_handlers.requeues(preempted.signal):  # the ranks saved: now submitit requeues the job
        print(
            f"trainlab: preempted: {preempted.describe()}; submitit requeues the Slurm job, which resumes the run",
            file=sys.stderr,
            flush=True,
        )
        requeue_after_save(submitit_handlers)
    if preempted:
        print(
            f"trainlab: preempted: {preempted.describe()}; run the same command again to resume",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(EXIT_PREEMPTED)
    _print_summary(run_dir, tracker, run.tracking.uri, run.experiment_name)
    return "FINISHED", "", tracker.run_id if tracker else None


def _choose_resume(resolved: ResolvedRun, run_dir: Path) -> Any:
    """The checkpoint this attempt resumes from (:func:`framework.base.checkpoint.resume.select_resume`; ``auto``:
    the newest intact one), or None when it is at ``trainer.max_steps`` already (nothing to train). A fresh
    start removes an earlier attempt's metrics, summary and event log (they must not mix in)."""
    from framework.base.checkpoint.resume import select_resume

    run = resolved.run
    resume = select_resume(run.resume, resolved.checkpoint_dir, warn=_warn)
    if resume.path:
        print(f"trainlab: resuming from {resume.path}", flush=True)
    else:
        for stale in ("metrics.jsonl", "summary.json", "faults.jsonl", "load.json"):
            (run_dir / stale).unlink(missing_ok=True)
    if resume.step >= run.trainer.max_steps and run.resume == "auto":
        print(
            f"trainlab: checkpoint at step {resume.step} >= trainer.max_steps={run.trainer.max_steps}: nothing to"
            " train (raise trainer.max_steps to continue, or use another checkpoint.dir)",
            flush=True,
        )
        return None
    return resume


def _finish_interrupted_run(resolved: ResolvedRun, model: Any, cache: Any, run_dir: Path) -> str | None:
    """With nothing left to train, end the run's MLflow run FINISHED when it was left KILLED: the Ctrl-C or
    preemption came after the save at ``trainer.max_steps``, while the ranks were exiting, and the driver
    said "run the same command again". Logs the run's summary, clears the preempted tag, prints one line.
    Whatever the run's status, first sends rank 0's points that the last driver left in the outbox.
    Returns that run's id, or None (tracking off, no such run, any other status); never raises."""
    run = resolved.run
    if not run.tracking.enabled:
        return None
    from framework.base.tracking import MetricForwarder, outbox_path

    try:
        from mlflow import MlflowClient

        from framework.base.tracking import find_run

        client = MlflowClient(tracking_uri=run.tracking.uri)
        exp = client.get_experiment_by_name(run.experiment_name)  # None: never tracked (not created here)
        found = exp and find_run(client, exp.experiment_id, f"{run.experiment_name}/{run.run_name}")
        if not found:
            return None
        # rank 0's points the last driver left unsent (it was killed, or stopped during its final drain)
        MetricForwarder(client, found.info.run_id, outbox_path(run_dir, found.info.run_id)).forward()
        if found.info.status != "KILLED":
            return None
    except Exception as err:  # tracking must not fail a finished run
        _warn(f"could not read the run's MLflow status: {err}")
        return None
    from framework.base.faults.preemption import record_preemption
    from framework.base.tracking import finish_driver_run

    started_at = time.time()
    tracker = _open_tracking(resolved, model, cache, resumed=True)
    record_preemption(tracker, None)
    _log_run_summary(tracker, resolved, run_dir)
    finish_driver_run(tracker, "FINISHED", run_dir=run_dir, started_at=started_at, error=None, resumed=True)
    print(
        f"trainlab: MLflow run {tracker.run_id} was left KILLED after its last step was saved: FINISHED now", flush=True
    )
    return tracker.run_id


def _open_tracking(resolved: ResolvedRun, model: Any, cache: Any, *, resumed: bool) -> Any:
    """The job's MLflow run (:func:`framework.base.tracking.open_driver_run`; None with tracking off), re-opened
    when ``resumed``; on a fresh start the token cache is logged as its dataset input; in a sweep it
    becomes a child of the sweep's parent run. Exits 2 (one line) when the tracking URI cannot be used."""
    from framework.base.tracking import log_token_cache_input, open_driver_run
    from framework.driver import sweep

    run = resolved.run
    if not run.tracking.enabled:
        return None
    try:
        tracker = open_driver_run(resolved, model, resumed=resumed)
    except ConfigError as err:
        cli.fail(str(err))
    if not resumed:
        log_token_cache_input(tracker, cache, run.data)
    else:
        _record_allowed_changes(tracker, resolved)
    current = sweep.current()
    if current is not None:
        sweep.attach_child(tracker, current, list(HydraConfig.get().overrides.task))
    return tracker


def _record_allowed_changes(tracker: Any, resolved: ResolvedRun) -> None:
    """Tag ``resume.changed`` (``optim.lr 0.003 -> 0.001; ...``): what this resumed run changed from its
    checkpoint's configuration under ``resume_allow_changed`` (nothing when it changed nothing)."""
    from framework.base.checkpoint.resume import check_resume_config

    changes = check_resume_config(resolved.run.resume, resolved.checkpoint_dir, resolved.run)
    if changes:
        text = "; ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changes.items())
        tracker.set_tags({"resume.changed": text})
        print(f"trainlab: resuming with allowed changes: {text}", flush=True)


def _run_other_node(resolved: ResolvedRun, cache: Any, nodes: Any, node_dir: Path) -> None:
    """Node ``k > 0`` of a multi-node run: check node 0's endpoint and the shared checkpoint folder, then
    run this node's ranks to the end under the supervisor every driver uses
    (:func:`framework.driver.faults.supervisor.supervise`; :mod:`framework.driver.nodes`). Node 0's driver records the
    run; this one exits 0 when its ranks finished, 75 when preempted, 130 when interrupted, 1 when they failed."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from framework.base.faults.preemption import EXIT_PREEMPTED, PREEMPT_SIGNALS
    from framework.base.launch import LaunchSpec
    from framework.driver.faults.supervisor import end_lost_node0_run, failure_reason, follower_resume, supervise
    from framework.driver.nodes import check_endpoint, wait_for_shared_folder

    run, me = resolved.run, f"trainlab: node {nodes.node_rank}"
    try:
        check_endpoint(nodes)
        wait_for_shared_folder(resolved.checkpoint_dir, nodes)
    except ConfigError as err:
        cli.fail(str(err))
    launch = follower_resume(
        LaunchSpec(
            resolved=resolved,
            run_dir=node_dir,
            mlflow_run_id=None,
            resume_from=None,
            token_cache_dir=str(cache.dir),
            nodes=nodes,
        )
    )
    if launch is None:  # nothing left to train
        return
    try:
        supervise(launch)  # under resilience=restart it joins node 0 again after a failure
    except (KeyboardInterrupt, SignalException) as err:
        if getattr(err, "sigval", None) in PREEMPT_SIGNALS:
            print(f"{me}: preempted ({err.sigval.name}); node 0's driver records the run", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_PREEMPTED)
        print(f"{me}: interrupted", file=sys.stderr, flush=True)
        raise SystemExit(130)
    except Exception as err:
        alone = " (resilience=shrink: node 0 goes on alone)" if run.resilience.policy == "shrink" else ""
        print(f"{me}: error: training failed{alone}: {failure_reason(err)}\n{err}", file=sys.stderr, flush=True)
        end_lost_node0_run(launch, failure_reason(err))
        raise SystemExit(1)


def _resolve(cfg: DictConfig) -> tuple[ResolvedRun, Any, Any]:
    """Validate the config (once per run: :func:`framework.driver.runs.resolve_run`), check the resume request, build the token cache and the model's
    shape (on the meta device); returns ``(resolved, token_cache, model)``.

    Raises:
        ConfigError: any bad value, one line (the caller exits 2, or in a sweep fails the job).
    """
    from framework.driver.runs import resolve_run

    resolved = resolve_run(cfg)  # validated once per run: the precheck's or the sweep check's, when it did
    from framework.driver.launcher import start_rank_server

    start_rank_server(resolved)  # started by cli.main already, unless the command line could not tell (a no-op then)
    run = resolved.run
    _check_resume_request(resolved)
    from framework.base.data.dataset import check_global_batch_fits
    from framework.base.data.tokens import prepare_data  # imported once the config holds (as the model below)

    print(f"trainlab: {resolved.plugin_name} | {resolved.batch_summary()}", flush=True)
    cache = prepare_data(run.data)
    check_global_batch_fits(
        global_batch_size=resolved.global_batch_size, train_tokens=cache.train_tokens, seq_len=run.data.seq_len
    )
    if run.model.vocab_size is not None and run.model.vocab_size < cache.vocab_size:
        raise ConfigError(f"model.vocab_size={run.model.vocab_size} < tokenizer vocabulary {cache.vocab_size}")
    import torch

    from framework.base.model import build_model

    with torch.device("meta"):
        model = build_model(run.model, vocab_size=run.model.vocab_size or cache.vocab_size)
    print(
        f"trainlab: model {run.model.name}: {model.num_params(exclude_position_embedding=False):,} parameters"
        f" ({model.num_flops_params():,} in 6N; vocab {model.vocab_size}, {run.model.n_layer} layers,"
        f" d_model {run.model.d_model})",
        flush=True,
    )
    return resolved, cache, model


def _check_resume_request(resolved: ResolvedRun) -> None:
    """Refuse a ``resume`` value this run's plugin cannot honour (:func:`framework.base.checkpoint.resume.check_resume_request`).

    Raises:
        ConfigError: not an intact checkpoint folder, a kind the plugin cannot load,
            ``resume=never`` while ``checkpoint.dir`` holds checkpoints, or a checkpoint written under
            another configuration (:func:`framework.base.checkpoint.resume.check_resume_config`).
    """
    from framework.base.checkpoint.resume import check_resume_config, check_resume_request
    from framework.base.registry import get_plugin_class

    caps = get_plugin_class(resolved.plugin_name).capabilities
    check_resume_request(
        resolved.run.resume,
        resolved.checkpoint_dir,
        resolved.plugin_name,
        writes=caps.checkpoint_format,
        loads_full_state=caps.loads_full_state,
        writers=cli.presets_writing,
    )
    check_resume_config(resolved.run.resume, resolved.checkpoint_dir, resolved.run)


def _warn(msg: str) -> None:
    print(f"trainlab: warning: {msg}", file=sys.stderr, flush=True)


def _log_run_summary(tracker: Any, resolved: ResolvedRun, run_dir: Path) -> None:
    """The ``summary/*`` metrics, the load monitor's record (:mod:`framework.base.load_monitor`) and the
    one-line run description (:mod:`framework.driver.run_summary`; a contended run's starts with a warning); never raises."""
    from framework.base.load_monitor import log_record, read_record, warning
    from framework.base.tracking import NOTE_TAG, read_jsonl_metrics
    from framework.driver.run_summary import run_description, summary_metrics

    try:
        summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
        metrics = summary_metrics(summary, read_jsonl_metrics(run_dir / "metrics.jsonl"))
        if metrics:
            tracker.log_metrics(metrics, step=int(summary.get("train/steps", 0)))
        load = read_record(run_dir)
        if load is not None:
            log_record(tracker, load)
        warn = warning(load)
        tracker.set_tags(
            {
                NOTE_TAG: (f"WARNING: {warn}. " if warn else "")
                + run_description(resolved.plugin_name, resolved.layout.describe(), metrics, summary.get("peak_flops"))
            }
        )
    except Exception as err:  # tracking must not fail a finished run
        _warn(f"could not log the run's summary to MLflow: {err}")


def _print_summary(run_dir: Path, tracker: Any, uri: str, experiment: str) -> None:
    from framework.base.tracking import read_jsonl_metrics

    records = read_jsonl_metrics(run_dir / "metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}

    def last(key: str) -> float | None:
        vals = [r[key] for r in records if key in r]
        return vals[-1] if vals else None

    def fmt(v: float | None, spec: str) -> str:
        return "n/a" if v is None else format(v, spec)

    val_initial, val_final = last("val/loss_initial"), last("val/loss_final")
    lines = [
        "",
        "trainlab summary",
        f"  steps              {fmt(last('train/steps'), '.0f')}",
        f"  train loss (final) {fmt(last('train/loss_final'), '.4f')}",
        f"  val loss           {fmt(val_initial, '.4f')} -> {fmt(val_final, '.4f')}"
        + (f"  (x{val_final / val_initial:.3f})" if val_initial and val_final else ""),
        f"  tokens/s (mean)    {fmt(summary.get('perf/tokens_per_sec_mean'), ',.0f')}",
        f"  MFU (mean)         {fmt(summary.get('perf/mfu_mean'), '.3f')}",
        f"  metrics file       {run_dir / 'metrics.jsonl'}",
    ]
    from framework.base.load_monitor import read_record, warning

    warn = warning(read_record(run_dir))
    if warn:
        lines.append(f"  WARNING            {warn}")
    if tracker is not None:
        from framework.driver.runs import ui_command, ui_link

        lines += [
            f"  MLflow run         {tracker.run_id} (experiment {experiment!r})",
            f"  see it with        {ui_command(uri)}",
            f"  then open          {ui_link(uri, tracker.experiment_id, tracker.run_id)}",
        ]
    print("\n".join(lines), flush=True)


@hydra.main(version_base="1.3", config_path="../../conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> float | None:
    """The Hydra app: one job per call; this module's name names the Hydra job (``train``). Returns
    the job's objective in a sweep (what the Optuna sweeper maximises; None = a failed trial)."""
    return run_job(cfg, Path(HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    cli.main(_hydra_main)
