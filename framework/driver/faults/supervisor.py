"""The driver's side of recovery: restart and shrink relaunches, and where a restarted rank resumes.

- ``restart``: the elastic agent (:func:`framework.driver.launcher.launch_ranks`) restarts all ranks up
  to ``resilience.max_restarts`` times when one exits (crash, watchdog, failed save); every
  restarted rank resumes from the newest *valid* checkpoint
  (:func:`framework.rank.faults.restart.resume_path`), not from the one the driver started with.
- ``shrink``: once those restarts are used up, the driver relaunches with fewer ranks
  (``resilience.shrink_to``: one less, a fraction or a size; fewer still if the global batch
  would not divide: :mod:`framework.driver.faults.elastic`), keeping ``global_batch_size`` and
  ``micro_batch_size`` and re-deriving ``grad_accum_steps``; the MLflow tags ``world_size`` and
  ``layout`` follow (:func:`~framework.driver.faults.elastic.shrink_tags`); the DDP checkpoint loads at the new
  world size (replicated weights and optimizer state; the data position is global, in samples);
  per-rank RNG states are mapped as the checkpoint code maps them for any resume at another
  world size (:class:`~framework.rank.checkpoint.periodic.PeriodicCheckpoint`), and Lightning's
  micro-batch counter is re-aligned to the new ``grad_accum_steps``
  (:func:`framework.rank.faults.guard.align_batch_counter`). Each shrink gets ``max_restarts``
  restarts of its own.
- ``none``: ``trainer.max_restarts`` as without this package; every other policy: no restarts
  (a crash ends the run FAILED).
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

from framework.base.config.schema import ConfigError
from framework.base.faults.events import FaultLog
from framework.base.launch import LaunchSpec
from framework.driver.faults.elastic import resolve_shrunk, shrink_tags

__all__ = [
    "ShrinkImpossible",
    "end_lost_node0_run",
    "failure_reason",
    "max_restarts_for",
    "resolve_shrunk",
    "supervise",
]


class ShrinkImpossible(RuntimeError):
    """The ranks failed under ``resilience.policy=shrink`` and no smaller layout keeps the global batch."""


def _warn(msg: str) -> None:
    print(f"trainlab: warning: {msg}", file=sys.stderr, flush=True)


def max_restarts_for(run: Any) -> int:
    """Elastic restarts per launch under ``run.resilience.policy`` (see the module docstring)."""
    policy = run.resilience.policy
    if policy == "none":
        return run.trainer.max_restarts
    return run.resilience.max_restarts if policy in ("restart", "shrink") else 0


def supervise(launch: LaunchSpec, tracker: Any = None) -> None:
    """Run this node's ranks to completion under the resilience policy: the one restart loop of every driver.

    One node, or node 0 of several (the driver that owns the run): every run writes
    ``driver_start``/``driver_end`` to the run's event log and logs goodput, its parts, the
    restart parts of each attempt and the ``fault/``/``recovery/`` figures
    (:mod:`framework.driver.faults.accounting`), faults or none. Without faults or a policy the ranks
    start as :func:`framework.driver.launcher.launch_ranks` starts them (``trainer.max_restarts``).
    With them the ranks get the fault schedule; after a failure node 0 relaunches every node
    (:func:`_relaunch_nodes`) while restarts are left, and each shrink relaunches the ranks with
    the run resolved at the smaller world size (:func:`resolve_shrunk`).

    Node ``k > 0`` (``launch.nodes.node_rank > 0``; node 0's driver records the run): no event log,
    no fault schedule, no figures; under ``resilience=restart`` it joins node 0 again after a
    failure (:func:`_rejoin_node0`), up to ``resilience.max_restarts`` times.

    Raises:
        ChildFailedError: the ranks failed and the policy has no recovery left (node k > 0: any
            exception of :func:`~framework.driver.launcher.launch_ranks`).
        ShrinkImpossible: the ranks failed under ``shrink`` and no smaller layout keeps the
            global batch (the one-line reason of :func:`~framework.driver.faults.elastic.resolve_shrunk`).
        SystemExit: code 1, node k > 0 whose node 0 no longer answers (its run ended FAILED:
            :func:`end_lost_node0_run`).
    """
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError

    from framework.base.faults.schedule import build_schedule, faults_enabled
    from framework.driver.launcher import launch_ranks

    run = launch.resolved.run
    lead = launch.nodes is None or launch.nodes.node_rank == 0  # the driver that owns the run
    log = FaultLog(launch.run_dir) if lead else None
    shrinks: list = []  # (before, after, resumed step) of each shrink, for the MLflow tags
    if lead:
        log.append("driver_start", world_size=launch.resolved.world_size)
    try:
        if lead and not faults_enabled(run):
            launch_ranks(launch)
            return
        if lead:
            launch = launch.replace(fault_schedule=build_schedule(run, launch.resolved.world_size), launch_index=0)
            if (
                tracker is not None
            ):  # what was injected, for the compare report (fault.name says "none" for listed events)
                kinds = sorted({e["kind"] for e in launch.fault_schedule})
                tracker.set_tags({"fault.kinds": ",".join(kinds) or "none", "resilience.policy": run.resilience.policy})
            # several nodes: a relaunch whose rendezvous times out (a lost node did not come back) failed as well
            caught: tuple = (ChildFailedError, DistError, RendezvousError)
        else:
            caught = (Exception,)
        node_restarts = 0  # several nodes: the drivers' relaunches of every node (the agent restarts none)
        while True:
            if not lead:
                _announce_node(launch)
            try:
                launch_ranks(launch, max_restarts=0 if launch.nodes else max_restarts_for(run))
                if not lead:
                    print(f"{_node_label(launch)}: ranks finished; node 0's driver records the run", flush=True)
                return
            except caught as err:
                if isinstance(err, SignalException) or (not isinstance(err, ChildFailedError) and launch.nodes is None):
                    raise  # a signal is the caller's (preemption); one node: only the ranks' failure is recovered
                aborts = [r for r in log.read() if r.get("ev") == "abort"] if lead else []
                if aborts:
                    print(
                        f"trainlab: error: the resilience policy aborted the run in step {aborts[-1]['step']}:"
                        f" {aborts[-1]['faults']} faults detected > resilience.max_faults",
                        file=sys.stderr,
                        flush=True,
                    )
                restarts_left = node_restarts < max_restarts_for(run) and (lead or run.resilience.policy == "restart")
                if not aborts and launch.nodes is not None and restarts_left:
                    node_restarts += 1
                    if lead:
                        launch = _relaunch_nodes(launch, log, err, node_restarts, max_restarts_for(run))
                        continue
                    launch = _rejoin_node0(launch, err, node_restarts, max_restarts_for(run))
                    continue
                if aborts or run.resilience.policy != "shrink" or not lead:
                    raise
                launch = _shrink(launch, log, tracker, shrinks)
                run = launch.resolved.run
    finally:
        if lead:
            log.append("driver_end")
            report_figures(log.read(), tracker)


def _shrink(launch: LaunchSpec, log: FaultLog, tracker: Any, shrinks: list) -> LaunchSpec:
    """The launch after a shrink (``resilience.policy=shrink``, the restarts used up): the run resolved at
    the smaller world size (:func:`resolve_shrunk`), from the newest valid checkpoint, on node 0 alone.
    Logged as a ``shrink`` record; ``shrinks`` (before, after, resumed step) gets it and the MLflow tags follow.

    Raises:
        ShrinkImpossible: no smaller layout keeps the global batch.
    """
    from framework.base.checkpoint.format import latest_valid_step

    resolved = launch.resolved
    try:
        new_resolved = resolve_shrunk(resolved.run, resolved.world_size)
    except ConfigError as err:
        raise ShrinkImpossible(str(err)) from None
    latest, step = latest_valid_step(resolved.checkpoint_dir, warn=_warn)
    log.append(
        "shrink",
        from_world=resolved.world_size,
        to_world=new_resolved.world_size,
        step=step,
        grad_accum_steps=new_resolved.grad_accum_steps,
    )
    print(
        f"trainlab: resilience: shrinking {resolved.world_size} -> {new_resolved.world_size} ranks,"
        f" resuming from {latest or 'the start'} | {new_resolved.batch_summary()}",
        file=sys.stderr,
        flush=True,
    )
    shrinks.append((resolved, new_resolved, step))
    _set_tags(tracker, shrink_tags(shrinks))
    return launch.replace(
        resolved=new_resolved,
        resume_from=str(latest) if latest else None,
        launch_index=launch.launch_index + 1,
        shrunk_at_step=step,
        nodes=None,
    )  # several nodes: node 0 goes on alone, on a rendezvous of its own


def _relaunch_nodes(launch: LaunchSpec, log: FaultLog, err: Exception, restart: int, max_restarts: int) -> LaunchSpec:
    """Node 0 of a multi-node run whose ranks failed (a rank crashed, or a node was lost: its ranks' peers
    see the connection close): the launch of restart ``restart`` of every node, from the newest valid checkpoint.

    The elastic agent cannot do it (measured, torch 2.13, ``torchrun`` static rendezvous with
    ``--max-restarts 2``, node 1 killed): node 0's agent restarts its ranks at once, without
    waiting for the lost node; each restarted rank reads the dead rank's gloo address from the
    failed round's keys in the agent's store (``connectFullMesh … Connection refused``) and fails
    within 2 s, so both restarts were spent 4 s after the kill and node 0's agent exited before
    node 1's command came back. So every driver starts a fresh agent (a fresh store at the same endpoint); node 0's agent
    waits up to ``rendezvous.timeout_s`` for the other nodes: their drivers' same command, started
    again by the scheduler (or their own relaunch under ``restart``: :func:`_rejoin_node0`).
    Logged as a ``node_restart`` record; the ranks' ``start`` record after a failed attempt makes it a
    restart in the recovery figures (``recovery/restarts``).
    """
    latest, step = restart_checkpoint(launch)
    log.append("node_restart", restart=restart, step=step, reason=failure_reason(err)[:300])
    print(
        f"trainlab: resilience: the ranks failed (a lost node, or a crashed rank); restart {restart}/{max_restarts} of"
        f" all {launch.nodes.nnodes} nodes from {latest or 'the start'}; waiting up to rendezvous.timeout_s="
        f"{launch.nodes.timeout_s} s for every node (start a lost node's command again)",
        file=sys.stderr,
        flush=True,
    )
    return launch.replace(resume_from=str(latest) if latest else None, launch_index=launch.launch_index + 1)


def _node_label(launch: LaunchSpec) -> str:
    return f"trainlab: node {launch.nodes.node_rank}"


def _announce_node(launch: LaunchSpec) -> None:
    """Node k > 0, before each launch: which ranks it runs, where they meet, the checkpoint they resume."""
    nodes, per_node = launch.nodes, launch.resolved.nproc_per_node
    print(
        f"{_node_label(launch)} of {nodes.nnodes}: ranks {nodes.node_rank * per_node}.."
        f"{(nodes.node_rank + 1) * per_node - 1}, rendezvous {nodes.endpoint}"
        + (f", resuming from {launch.resume_from}" if launch.resume_from else ""),
        flush=True,
    )


def _rejoin_node0(launch: LaunchSpec, err: Exception, restart: int, max_restarts: int) -> LaunchSpec:
    """Node k > 0 whose ranks failed, under ``resilience=restart``: the launch of restart ``restart``, joining
    node 0 again (whose driver relaunches every node: :func:`_relaunch_nodes`) from the checkpoint node 0
    resumes from (:func:`restart_checkpoint`).

    Raises:
        SystemExit: code 1 when node 0's endpoint no longer answers within ``rendezvous.timeout_s`` (one
            line, not the agent's store timeout and C++ trace); the run's MLflow run ends FAILED
            (:func:`end_lost_node0_run`).
    """
    from framework.driver.nodes import check_endpoint

    me = _node_label(launch)
    print(
        f"{me}: the ranks failed ({failure_reason(err)}); restart {restart}/{max_restarts}: joining node 0 again",
        file=sys.stderr,
        flush=True,
    )
    try:
        check_endpoint(launch.nodes)
    except ConfigError as lost:
        print(f"{me}: error: {lost}", file=sys.stderr, flush=True)
        end_lost_node0_run(launch, f"{failure_reason(err)}; then {lost}")
        raise SystemExit(1)
    latest, _ = restart_checkpoint(launch)  # node 0's relaunch starts its ranks whatever the step: so does this node
    return launch.replace(launch_index=restart, resume_from=str(latest) if latest else None)


def restart_checkpoint(launch: LaunchSpec) -> tuple[Any, int]:
    """``(path or None, step)`` every node of a multi-node run resumes from after a failure: the newest valid
    checkpoint in the shared folder, whatever ``resume`` said at the start (node 0's relaunch,
    :func:`_relaunch_nodes`, and node k's rejoin, :func:`_rejoin_node0`, both read it, so that every rank
    of the restart loads the same step); ``(None, 0)``: the start."""
    from framework.base.checkpoint.format import latest_valid_step

    return latest_valid_step(launch.resolved.checkpoint_dir, warn=_warn)


def follower_resume(launch: LaunchSpec) -> LaunchSpec | None:
    """Node k > 0, before its first launch: ``launch`` resuming from the checkpoint
    :func:`~framework.base.checkpoint.resume.select_resume` chooses in the shared folder (the folder node 0
    reads: the same choice), or None when that checkpoint is at ``trainer.max_steps`` already (nothing to
    train). A rejoin after a failure resumes from :func:`restart_checkpoint` instead (:func:`_rejoin_node0`)."""
    from framework.base.checkpoint.resume import select_resume

    run = launch.resolved.run
    resume = select_resume(run.resume, launch.resolved.checkpoint_dir, warn=_warn)
    if resume.step >= run.trainer.max_steps and run.resume == "auto":
        print(
            f"{_node_label(launch)}: checkpoint at step {resume.step} >= trainer.max_steps={run.trainer.max_steps}:"
            " nothing to train",
            flush=True,
        )
        return None
    return launch.replace(resume_from=resume.path)


def end_lost_node0_run(launch: LaunchSpec, reason: str) -> None:
    """Node k > 0 whose ranks failed while node 0's endpoint no longer answers: node 0 (which owns the
    run's MLflow run) is gone, so this node ends that run FAILED with the reason (tag ``error``), when
    the tracking store is the same (a shared URI) and the run is still RUNNING. Never raises."""
    import socket

    run, nodes = launch.resolved.run, launch.nodes
    try:
        with socket.create_connection((nodes.host, nodes.port), timeout=2):
            return  # node 0 is alive: its driver records the run
    except OSError:
        pass
    if not run.tracking.enabled:
        return
    try:
        from framework.base.tracking import DriverRun

        tracker = DriverRun(run.tracking.uri, run.experiment_name)
        run_id = tracker.find(f"{run.experiment_name}/{run.run_name}")
        if run_id is None or tracker.client.get_run(run_id).info.status != "RUNNING":
            return
        why = f"node 0 lost (rendezvous.endpoint={nodes.endpoint} no longer answers); node {nodes.node_rank}: {reason}"
        tracker.client.set_tag(run_id, "error", why)
        tracker.client.set_terminated(run_id, status="FAILED")
        print(
            f"trainlab: node {nodes.node_rank}: ended the run's MLflow run {run_id} FAILED: {why}",
            file=sys.stderr,
            flush=True,
        )
    except Exception as err:  # the exit status already says the training failed
        _warn(f"could not end the run's MLflow run: {err}")


def _set_tags(tracker: Any, tags: dict[str, str]) -> None:
    """Best-effort MLflow tags (the launch in force after a shrink)."""
    if tracker is None:
        return
    try:
        tracker.set_tags(tags)
    except Exception as err:  # tracking never masks the training outcome
        _warn(f"could not update the MLflow tags after the shrink: {err}")


def report_figures(records: list[dict[str, Any]], tracker: Any) -> dict[str, float]:
    """Print and log (into ``tracker``'s MLflow run) goodput and the recovery figures of the event log ``records``.

    The run totals are logged at the last step the run reached (the step they concern); each
    attempt's start-up parts as ``restart/<part>_s`` at the step it resumed from (one point per
    attempt). Returns the totals. Tracking errors only warn.
    """
    from framework.driver.faults.accounting import goodput_figures, recovery_figures

    figures = recovery_figures(records)
    _, attempts = goodput_figures(records)
    steps = [r["step"] for r in records if r.get("ev") == "step"]
    last = max(steps) if steps else 0
    print("trainlab: goodput/recovery | " + " | ".join(f"{k} {v:.4g}" for k, v in figures.items()), flush=True)
    for i, a in enumerate(attempts):
        print(
            f"trainlab: attempt {i} ({'restart' if a['restart'] else 'start'} at step {a['step']:.0f}) | "
            + " | ".join(f"{k} {v:.2f}" for k, v in a.items() if k.endswith("_s")),
            flush=True,
        )
    if tracker is not None:
        try:
            tracker.log_metrics(figures, step=last)
            for a in attempts:
                tracker.log_metrics({f"restart/{k}": v for k, v in a.items() if k.endswith("_s")}, step=int(a["step"]))
        except Exception as err:  # tracking never masks the training outcome
            _warn(f"could not log the recovery figures to MLflow: {err}")
    return figures


PEER_ERRORS = (
    "closed by peer",
    "reset by peer",
    "Broken pipe",
    "Connection refused",
    "was aborted",
    "Socket Timeout",
    "DistNetworkError",
    "DistStoreError",
)
"""Exception text of a rank that failed because a peer had (its collective or store lost the peer)."""


def root_failure(failures: dict[int, Any]) -> tuple[int, Any]:
    """The rank that failed first, and its ``ProcessFailure``, among a ``ChildFailedError``'s ``failures``
    (global rank -> failure).

    torch's own choice (``ChildFailedError.get_first_failure``, the one its banner names) takes
    the smallest timestamp, but the timestamps are whole seconds and mean different things: a
    rank that raised records when it raised (after its peer died: a gloo ``Connection closed by
    peer``), a rank killed by a signal has none and gets the agent's clock when the agent noticed.
    So the banner named rank 0 (exit 1, its peer gone) for a SIGKILLed rank 1. Here, among the
    failures within 1 s of the earliest, the first is a rank killed by a signal, then one whose
    exception is not a lost peer's (:data:`PEER_ERRORS`), then the earliest, then the lowest rank.
    """
    t0 = min(f.timestamp for f in failures.values())
    near = [(r, f) for r, f in failures.items() if f.timestamp <= t0 + 1]
    return min(
        near,
        key=lambda rf: (
            rf[1].exitcode >= 0,
            any(p in _exception_text(rf[1]) for p in PEER_ERRORS),
            rf[1].timestamp,
            rf[0],
        ),
    )


def _exception_text(failure: Any) -> str:
    message = failure.message
    if isinstance(message, dict):
        return str(message.get("extraInfo", {}).get("py_callstack") or message.get("message") or "")
    return str(message or "")


_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Failure|Abort)\w*)(:|$)")


def _last_line(text: str, limit: int = 300) -> str:
    """The last line of a traceback that names an exception (``RuntimeError: ...``), past the C++ frames
    (``At:`` / ``file(line): func``) that torch appends to some; cut to ``limit`` characters."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    named = [ln for ln in lines if _EXCEPTION_LINE.match(ln)]
    line = named[-1] if named else (lines[-1] if lines else "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def failure_reason(err: BaseException) -> str:
    """The one-line root cause of a failed launch: for torch elastic's ``ChildFailedError``, the first
    rank to fail (:func:`root_failure`), its exit code or signal and the last line of its exception,
    e.g. ``rank 1 (pid 4242) was killed by SIGKILL (exit code -9)`` or
    ``rank 0 exited with code 1: RuntimeError: boom``, and how many ranks failed in all; for any
    other exception its first line that is not a separator (``====``)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if isinstance(err, ChildFailedError) and err.failures:
        rank, f = root_failure(err.failures)
        if f.exitcode < 0:
            why = f"rank {rank} (pid {f.pid}) was killed by {f.signal_name()} (exit code {f.exitcode})"
        else:
            last = (
                _last_line(_exception_text(f)) if os.path.isfile(f.error_file) else ""
            )  # else torch's placeholder text
            why = f"rank {rank} (pid {f.pid}) exited with code {f.exitcode}" + (
                f": {last}" if last else " (no exception recorded)"
            )
        others = len(err.failures) - 1
        return why + (f"; {others} other rank(s) failed after it" if others else "")
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip().strip("=-") and ln.strip()]
    return lines[0] if lines else type(err).__name__
