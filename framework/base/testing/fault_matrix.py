"""The fault x policy matrix: every fault kind under every resilience policy that claims to handle it.

Cheap by construction (it runs in CI): one rank (``parallelism=single``) of one thread, ``gpt_tiny`` on a
small corpus slice, 11 optimizer steps of 2 micro-batches, independent runs side by side (``lanes``), and
several cells per run: each policy gets
one run whose faults fire at different steps (numeric faults in steps 7-9, after the detectors'
warm-up; process faults before them under ``restart``, or in step 11 where the policy refuses them).
A faulty step logs its faulty loss (Inf, x10), so loss comparisons leave out steps 8 and 9 (and
the last step under ``restart``, whose batch is garbage); step 10 shows the effect of the three
dropped updates.
Two fault-free references serve every run: ``ref`` (uninterrupted) and ``ref_skip`` (the same
run told to drop steps 7, 8 and 9, ``resilience.skip_steps``).

What each policy claims (docs/faults.md) and how a cell is judged:

- ``skip_step`` (and numeric faults under ``restart``/``abort`` below ``max_faults``): the step
  is detected and its update dropped; the losses equal ``ref_skip``'s exactly.
- ``rollback``: detected, rolled back to the in-memory snapshot and replayed (the fault fires
  once); the final loss history equals the uninterrupted run's exactly.
- ``restart``: a crash, a hang (watchdog), a failed save or a corrupt newest checkpoint (read at
  the restart after a crash) restarts the ranks from the newest valid checkpoint; the run
  finishes with the losses of ``ref_skip`` exactly (its numeric faults were skipped).
- ``abort``: faults up to ``max_faults`` are skipped, the next ends the run FAILED (the abort
  record, the driver's error line).
- process faults under ``skip_step``/``rollback``/``abort`` (no restarts): the run ends FAILED.
- ``bad_batch`` is not detected (random tokens score below ``loss_spike_factor`` x the running
  mean) and ``slow_rank`` only shows as a straggler with 2+ ranks: both leave the run finished.

Left out, to stay cheap: ``shrink`` (needs 2+ ranks; with one rank it restarts like ``restart``;
the 2-rank shrink is tests/integration/test_faults.py), ``random`` (draws ``rank_crash`` and
``nan_grad``, covered here; its schedule is unit-tested), and process faults under ``abort``
beyond the ones listed (the same no-restart path as under ``skip_step``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

MAX_STEPS = 11
NUMERIC = {"nan_grad": 7, "inf_loss": 8, "loss_spike": 9}  # step of each numeric fault, in every run that has them
SKIPPED = tuple(NUMERIC.values())
SMALL = (
    "data.max_bytes=1500000",
    "data.vocab_size=1024",
    "data.seq_len=64",
    "model=gpt_tiny",
    "parallelism=single",
    "trainer.global_batch_size=4",
    "trainer.micro_batch_size=2",
    "trainer.grad_accum_steps=null",
    f"trainer.max_steps={MAX_STEPS}",
    "trainer.log_every_n_steps=1",
    "trainer.val_sequences=16",
    "trainer.val_every_n_steps=100",
    "trainer.warmup_steps_excluded=0",
    "trainer.progress_bar=false",
    "tracking=none",
    "checkpoint.every_n_steps=2",
    "checkpoint.keep_last_k=3",
    "resume=never",
    "resilience.stat_warmup_steps=2",  # spikes judged after 2 accepted steps (few steps in all)
    "trainer.threads_per_rank=1",
)  # every run alike (bitwise comparisons), and 2 runs side by side fit 2 cores


def _events(*events: str) -> str:
    return "fault.events=[" + ",".join(events) + "]"


NUMERIC_EVENTS = (
    "{kind:nan_grad,step:7,ranks:[0]}",
    "{kind:inf_loss,step:8,ranks:[0]}",
    "{kind:loss_spike,step:9,ranks:[0],factor:10}",
)
RUNS: dict[str, tuple[str, ...]] = {
    "ref": ("resilience=none",),
    "ref_skip": ("resilience=skip_step", f"resilience.skip_steps=[{','.join(map(str, SKIPPED))}]"),
    "skip_step": ("resilience=skip_step", _events(*NUMERIC_EVENTS, "{kind:rank_crash,step:11,ranks:[0]}")),
    "rollback": (
        "resilience=rollback",
        "checkpoint=memory",
        "checkpoint.every_n_steps=2",
        "checkpoint.memory_every_n_steps=2",
        "resilience.hang_timeout_s=5",
        _events(*NUMERIC_EVENTS, "{kind:hang,step:11,ranks:[0],delay_s:3600}"),
    ),
    "restart": (
        "resilience=restart",
        "resilience.max_restarts=3",
        "resilience.hang_timeout_s=5",
        _events(
            "{kind:slow_rank,step:2,ranks:[0],delay_s:0.05,duration_steps:2}",
            "{kind:hang,step:3,ranks:[0],delay_s:3600}",
            "{kind:ckpt_write_error,step:4,ranks:[0]}",
            "{kind:ckpt_corrupt,step:5,ranks:[0]}",
            "{kind:rank_crash,step:6,ranks:[0]}",
            *NUMERIC_EVENTS,
            "{kind:bad_batch,step:11,ranks:[0]}",
        ),
    ),
    "abort": ("resilience=abort", "resilience.max_faults=2", _events(*NUMERIC_EVENTS)),
}


@dataclass(frozen=True)
class Cell:
    """One fault kind under one policy: where it runs and what the policy claims."""

    fault: str
    policy: str
    run: str
    step: int
    expected: str  # skipped | rolled_back | restarted | refused | aborted | undetected | no_effect
    note: str = ""


CELLS = [
    *(Cell(k, "skip_step", "skip_step", s, "skipped") for k, s in NUMERIC.items()),
    Cell("rank_crash", "skip_step", "skip_step", 11, "refused", "no restarts: the run ends FAILED"),
    *(Cell(k, "rollback", "rollback", s, "rolled_back") for k, s in NUMERIC.items()),
    Cell("hang", "rollback", "rollback", 11, "refused", "watchdog exit, no restarts: FAILED"),
    Cell("slow_rank", "restart", "restart", 2, "no_effect", "1 rank: no straggler to compare (2+ ranks: logged)"),
    Cell("hang", "restart", "restart", 3, "restarted", "watchdog exit (5 s), resumed from step 2"),
    Cell(
        "ckpt_write_error", "restart", "restart", 4, "restarted", "the failed save ends the rank; resumed from step 2"
    ),
    Cell(
        "ckpt_corrupt",
        "restart",
        "restart",
        5,
        "restarted",
        "crash in step 6; the corrupt step-4 checkpoint is passed over",
    ),
    Cell("rank_crash", "restart", "restart", 6, "restarted"),
    *(
        Cell(k, "restart", "restart", s, "skipped", "numeric faults are skipped under restart")
        for k, s in NUMERIC.items()
    ),
    Cell("bad_batch", "restart", "restart", 11, "undetected", "trained on (loss below 3x the running mean)"),
    Cell("nan_grad", "abort", "abort", 7, "skipped", "fault 1 <= resilience.max_faults=2"),
    Cell("inf_loss", "abort", "abort", 8, "skipped", "fault 2 <= resilience.max_faults=2"),
    Cell("loss_spike", "abort", "abort", 9, "aborted", "fault 3 > max_faults: FAILED"),
]


@dataclass
class RunOutcome:
    """One driver run of the matrix: exit status, losses by step (the last logged wins), fault log."""

    name: str
    returncode: int
    losses: dict[int, float]
    val_final: float | None
    log: list[dict]
    stderr: str
    wall_s: float


@dataclass
class CellOutcome:
    cell: Cell
    observed: str
    loss_check: str  # what the run's losses were compared with, and the largest difference
    ok: bool
    problems: list[str] = field(default_factory=list)


def run_matrix(workdir: Path, cache_dir: Path, names: list[str] | None = None, lanes: int = 1) -> dict[str, RunOutcome]:
    """Run the matrix's driver runs in ``workdir`` (token cache ``cache_dir``), ``lanes`` of them at a time.

    The runs are independent (each its own run name and checkpoint folder; concurrent builds of the
    token cache are safe) and each rank runs one thread, so ``lanes`` up to the number of cores run
    side by side without oversubscribing them. ``restart`` (four starts of the rank) is started first.
    """
    names = names or list(RUNS)
    order = sorted(names, key=lambda n: n != "restart")
    with ThreadPoolExecutor(max_workers=max(1, lanes)) as pool:
        done = dict(zip(order, pool.map(lambda n: _run_one(workdir, cache_dir, n), order)))
    return {n: done[n] for n in names}


def _run_one(workdir: Path, cache_dir: Path, name: str) -> RunOutcome:
    args = [
        sys.executable,
        "-m",
        "framework.train",
        *SMALL,
        f"data.cache_dir={cache_dir}",
        *RUNS[name],
        f"run_name={name}",
        f"checkpoint.dir={workdir / 'checkpoints' / name}",
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(args, cwd=workdir, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    wall = time.perf_counter() - t0
    run_dir = workdir / "outputs" / "default" / name
    records = _read_jsonl(run_dir / "metrics.jsonl")
    losses = {int(r["step"]): r["train/loss"] for r in records if "train/loss" in r}
    val = next((r["val/loss_final"] for r in records if "val/loss_final" in r), None)
    return RunOutcome(name, proc.returncode, losses, val, _read_jsonl(run_dir / "faults.jsonl"), proc.stderr, wall)


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a record cut by a kill
    return rows


def _max_diff(got: dict[int, float], want: dict[int, float], steps: list[int]) -> float:
    if any(s not in got or s not in want for s in steps):
        return math.inf
    return max(abs(got[s] - want[s]) for s in steps)


FAULTY_LOSS = (NUMERIC["inf_loss"], NUMERIC["loss_spike"])  # steps that log their faulty loss (Inf, x10)
CLEAN = [s for s in range(1, MAX_STEPS) if s not in FAULTY_LOSS]  # steps 1-7 and 10


def _loss_check(run: RunOutcome, runs: dict[str, RunOutcome]) -> tuple[str, bool]:
    """The run's loss claim: (description with the largest |difference|, holds)."""
    ref, ref_skip = runs["ref"].losses, runs["ref_skip"].losses
    if run.name == "skip_step":
        d = _max_diff(run.losses, ref_skip, CLEAN)
        return f"steps 1-7, 10 vs ref_skip: {d:.3g}", d == 0.0
    if run.name == "rollback":  # the replays log the clean losses last
        d = _max_diff(run.losses, ref, list(range(1, MAX_STEPS)))
        return f"steps 1-10 vs ref: {d:.3g}", d == 0.0
    if run.name == "restart":
        d = _max_diff(run.losses, ref_skip, CLEAN)
        v = abs(run.val_final - runs["ref"].val_final) if run.val_final is not None else math.inf
        bad = run.losses.get(MAX_STEPS, 0.0) > ref_skip.get(MAX_STEPS, math.inf)  # the garbage batch was trained on
        return (
            f"steps 1-7, 10 vs ref_skip: {d:.3g}; step 11 (bad batch) {run.losses.get(MAX_STEPS, math.nan):.3f}"
            f" vs {ref_skip.get(MAX_STEPS, math.nan):.3f}; final val loss vs ref: {v:.3g}",
            d == 0.0 and bad,
        )
    if run.name == "abort":  # ends in step 9; step 8 logs Inf
        d = _max_diff(run.losses, ref_skip, list(range(1, NUMERIC["inf_loss"])))
        return f"steps 1-7 vs ref_skip: {d:.3g}", d == 0.0
    return "", True


def _observe(cell: Cell, run: RunOutcome) -> str:
    log = run.log
    det = [r for r in log if r["ev"] == "detected" and r.get("step") == cell.step and r.get("detector") != "straggler"]
    injected = [r for r in log if r["ev"] == "injected" and r["kind"] == cell.fault and r["step"] == cell.step]
    if not injected:
        return "not injected"
    t_inj = injected[0]["t"]
    if any(r["ev"] == "abort" and r["step"] == cell.step for r in log):
        return "aborted" if run.returncode != 0 else "abort record, but finished"
    if any(r["ev"] == "rollback" and r["from_step"] == cell.step for r in log):
        return "rolled_back"
    if any(d.get("action") == "skip_step" for d in det) and any(
        r["ev"] == "skipped" and r["step"] == cell.step for r in log
    ):
        return "skipped"
    restarts = [r for r in log if r["ev"] == "start" and r["t"] > t_inj and r["restart"] > 0]
    later_faults = [r for r in log if r["ev"] == "injected" and r["t"] > t_inj and r["kind"] != "ckpt_corrupt"]
    if cell.fault == "ckpt_corrupt":  # acts when the next restart reads it
        if restarts and any(r["ev"] == "resume_skipped_corrupt" for r in log):
            return "restarted"
    elif restarts and (not later_faults or restarts[0]["t"] < later_faults[0]["t"]):
        return "restarted"
    if run.returncode != 0 and not restarts and injected[0] == [r for r in log if r["ev"] == "injected"][-1]:
        return "refused"
    if run.returncode == 0 and not det:
        return "undetected" if cell.fault == "bad_batch" else "no_effect"
    return f"unexpected (rc {run.returncode}, detections {[d.get('detector') for d in det]})"


def evaluate(runs: dict[str, RunOutcome]) -> list[CellOutcome]:
    """Judge every cell of :data:`CELLS` against ``runs`` (from :func:`run_matrix`)."""
    checks = {name: _loss_check(run, runs) for name, run in runs.items()}
    out = []
    for cell in CELLS:
        run = runs[cell.run]
        observed = _observe(cell, run)
        text, loss_ok = checks[cell.run]
        problems = [] if observed == cell.expected else [f"observed {observed}, expected {cell.expected}"]
        if not loss_ok:
            problems.append(f"loss claim fails: {text}")
        out.append(CellOutcome(cell, observed, text, not problems, problems))
    return out


def markdown(outcomes: list[CellOutcome], runs: dict[str, RunOutcome]) -> str:
    """The matrix as a markdown table (fault, policy, expected, observed, loss difference), and the runs' wall times."""
    lines = ["| fault | policy | step | expected | observed | loss diff | note |", "|---|---|---|---|---|---|---|"]
    for o in outcomes:
        c = o.cell
        lines.append(
            f"| {c.fault} | {c.policy} | {c.step} | {c.expected} | {o.observed}{'' if o.ok else ' **FAIL**'} |"
            f" {o.loss_check} | {c.note} |"
        )
    lines.append("")
    lines.append(
        "runs: "
        + ", ".join(f"{r.name} {r.wall_s:.1f} s (rc {r.returncode})" for r in runs.values())
        + f"; total {sum(r.wall_s for r in runs.values()):.1f} s"
    )
    return "\n".join(lines)
