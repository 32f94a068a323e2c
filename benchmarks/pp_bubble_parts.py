"""Why the measured pipeline bubble is larger than ``(p-1)/(v·m+p-1)``: the parts, measured on one timeline.

Runs trainlab's :class:`~plugins.megatron.pipeline.PipelineRunner` (the same stages, schedules and
busy/idle measurement as ``perf/pp_bubble_frac``) on 2 CPU ranks over gloo, 1 thread each, without
Lightning, and records every rank's forward / backward / loss spans with ``time.perf_counter``
(CLOCK_MONOTONIC: one clock for both processes on a host). From the timeline it measures

- ``f_k, b_k``: forward and backward seconds per micro-batch of each stage (stage imbalance: the
  last stage also runs ``ln_f``, the ``V x h`` head and the loss's backward; the first the embeddings);
- ``loss``: the last stage's cross-entropy forward (``_maybe_compute_loss``), outside
  ``forward_one_chunk`` and so counted as *idle* by the measurement;
- ``c``: the hand-off of one micro-batch between ranks: from the producer's compute end to the
  consumer's compute start when the consumer was already waiting (gloo send/recv of the
  ``[b, s, h]`` activation or its gradient, plus the schedule's Python between them);
- ``o``: a rank's local gap between two of its own computes that waited for nothing;

and predicts the idle fraction with :func:`bubble_model` (the cost model's bubble generalised to
unequal stages, loss outside the busy spans and a hand-off per crossing), beside the measured one
and ``(p-1)/(v·m+p-1)``.

    flock /tmp/trainlab-heavy.lock python benchmarks/pp_bubble_parts.py [--shape gpt_tiny|gpt_50m|bench] [--steps 6]
        [--m 2 4 8] [--json parts.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

SHAPES = {  # micro-batch = global_batch / m, or fixed (micro_batch)
    "gpt_tiny": dict(
        n_layer=4, d_model=128, n_head=4, vocab=4096, seq_len=128, global_batch=16
    ),  # the validation's runs
    "gpt_50m": dict(
        n_layer=8, d_model=768, n_head=12, vocab=4096, seq_len=128, global_batch=8
    ),  # the validation's gpt_50m runs
    "bench": dict(n_layer=8, d_model=256, n_head=8, vocab=4096, seq_len=128, micro_batch=2),  # benchmarks/pp_bubble.py
}
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2))


def _worker(rank: int, world: int, port: int, shape: dict, schedule: str, v: int, m: int, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from framework.base.config.schema import ModelConfig
    from framework.base.model import GPT
    from plugins.megatron.pipeline import GPTStage, PipelineRunner, split_layers

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    b = shape.get("micro_batch") or shape["global_batch"] // m
    gpt = GPT(
        ModelConfig(n_layer=shape["n_layer"], n_head=shape["n_head"], d_model=shape["d_model"], max_seq_len=256),
        shape["vocab"],
    )
    n_stages = world * v
    split = split_layers(shape["n_layer"], n_stages)
    stages = {
        k: GPTStage(gpt, split[k], first=k == 0, last=k == n_stages - 1) for k in range(n_stages) if k % world == rank
    }
    runner = PipelineRunner(
        stages,
        num_stages=n_stages,
        pp_group=dist.group.WORLD,
        pp_rank=rank,
        pp_size=world,
        embed_group=None,
        schedule_name=schedule,
        n_microbatches=m,
        micro_batch_size=b,
        seq_len=shape["seq_len"],
        d_model=shape["d_model"],
        vocab_size=shape["vocab"],
        device=torch.device("cpu"),
    )
    events: list = []

    def label(stage, method, kind):  # outermost wrapper: (kind, stage, micro-batch, start, end)
        inner = getattr(stage, method)

        def timed(mb, *args, **kwargs):
            t0 = time.perf_counter()
            r = inner(mb, *args, **kwargs)
            events.append((kind, stage.stage_index, mb, t0, time.perf_counter()))
            return r

        setattr(stage, method, timed)

    for st in runner.pipe_stages:
        label(st, "forward_one_chunk", "F")
        label(st, "backward_one_chunk", "B")
    sched = runner.schedule
    inner_loss = sched._maybe_compute_loss

    def loss_timed(stage, output, target_mbs, mb, *a, **k):
        t0 = time.perf_counter()
        r = inner_loss(stage, output, target_mbs, mb, *a, **k)
        if stage.is_last:
            events.append(("L", stage.stage_index, mb, t0, time.perf_counter()))
        return r

    sched._maybe_compute_loss = loss_timed
    inner_step = sched.step
    span: list = []

    def step_timed(*a, **k):  # the span PipelineRunner's wall time covers
        span[:] = [time.perf_counter()]
        r = inner_step(*a, **k)
        span.append(time.perf_counter())
        return r

    sched.step = step_timed
    opt = torch.optim.AdamW(runner.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    steps_out = []
    runner.train()
    for _ in range(steps):
        x = torch.randint(0, shape["vocab"], (m * b, shape["seq_len"]), generator=g)
        y = torch.randint(0, shape["vocab"], (m * b, shape["seq_len"]), generator=g)
        dist.barrier()
        events.clear()
        runner(x, y)
        recs = runner.take_step_records()
        steps_out.append({"events": list(events), "busy_wall": recs[-1], "span": list(span)})
        opt.step()
    Path(out, f"rank{rank}.json").write_text(json.dumps(steps_out))
    dist.destroy_process_group()


def measure(shape: dict, schedule: str, v: int, m: int, steps: int) -> list[list[dict]]:
    """Run the pipeline; per rank, per step: events and ``(busy_s, wall_s)``."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(2, port, shape, schedule, v, m, steps, out), nprocs=2, join=True)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]


# -- the model --------------------------------------------------------------------------------------


def _dep(kind: str, stage: int, mb: int, last: int) -> tuple | None:
    """The action whose result ``(kind, stage, mb)`` needs (None: the micro-batch's input)."""
    if kind == "F":
        return ("F", stage - 1, mb) if stage > 0 else None
    if kind == "L":
        return ("F", stage, mb)
    return ("L", stage, mb) if stage == last else ("B", stage + 1, mb)


def schedule_orders(schedule: str, *, pp: int, m: int) -> list[list[tuple]]:
    """Per rank, the actions of ``gpipe`` or ``1f1b`` in torch's order (one stage per rank; ``L`` after each last-stage ``F``).

    GPipe: all ``m`` forwards, then all backwards. 1F1B (torch ``Schedule1F1B``): ``min(m, p - r)``
    warm-up forwards, then backward / forward pairs, then the remaining backwards.

    Raises:
        ValueError: another schedule (interleaved orders come from a run: :func:`parts`).
    """
    orders = []
    for r in range(pp):
        fwd = lambda mb: [("F", r, mb)] + ([("L", r, mb)] if r == pp - 1 else [])  # noqa: E731
        if schedule == "gpipe":
            o = [a for mb in range(m) for a in fwd(mb)] + [("B", r, mb) for mb in range(m)]
        elif schedule == "1f1b":
            warm = min(m, pp - r)
            o = [a for mb in range(warm) for a in fwd(mb)]
            nf = warm
            for nb in range(m):
                o.append(("B", r, nb))
                if nf < m:
                    o += fwd(nf)
                    nf += 1
        else:
            raise ValueError(
                f"schedule={schedule!r}: orders are generated for gpipe and 1f1b (interleaved: interleaved_orders)"
            )
        orders.append(o)
    return orders


def interleaved_orders(*, pp: int, v: int, m: int) -> list[list[tuple]]:
    """Per rank, torch's ``ScheduleInterleaved1F1B`` actions (its own ``_calculate_single_rank_operations``, a
    private torch function: this follows torch's order, whatever version is installed), ``L`` after last-stage ``F``."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    sched = object.__new__(ScheduleInterleaved1F1B)  # the order needs only the sizes, not stages or a process group
    rounds = max(1, m // pp)
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = pp, v, m
    sched.number_of_rounds, sched.microbatches_per_round = rounds, m // rounds
    last = pp * v - 1
    orders = []
    for r in range(pp):
        o = []
        for a in sched._calculate_single_rank_operations(r):
            if a is None:
                continue
            kind = "F" if a.computation_type == _ComputationType.FORWARD else "B"
            o.append((kind, a.stage_index, a.microbatch_index))
            if kind == "F" and a.stage_index == last:
                o.append(("L", a.stage_index, a.microbatch_index))
        orders.append(o)
    return orders


def bubble_model(
    orders: list[list[tuple]],
    *,
    dur: dict,
    handoff_s: float,
    gap_s: float,
    head_s: float = 0.0,
    tail_s: float = 0.0,
    pp: int,
) -> list[float]:
    """Idle fraction of each rank, ``1 - busy / wall`` (:func:`pipeline_walls`)."""
    return [
        1.0 - busy / wall
        for busy, wall in pipeline_walls(
            orders, dur=dur, handoff_s=handoff_s, gap_s=gap_s, head_s=head_s, tail_s=tail_s, pp=pp
        )
    ]


def pipeline_walls(
    orders: list[list[tuple]],
    *,
    dur: dict,
    handoff_s: float,
    gap_s: float,
    head_s: float = 0.0,
    tail_s: float = 0.0,
    pp: int,
) -> list[tuple[float, float]]:
    """``(busy_s, wall_s)`` of each rank for a schedule run on a timeline (the measurement's definition:
    busy = forward and backward compute, wall = the rank's own ``schedule.step``, all ranks starting together).

    Args:
        orders: per rank, its actions in schedule order, ``(kind, stage, micro-batch)``; kind ``F``
            (forward), ``B`` (backward), ``L`` (the last stage's loss forward, run by the schedule
            outside the forward and therefore idle to the measurement).
        dur: seconds of ``(kind, stage)``: the stage imbalance.
        handoff_s: seconds from a producer's end to its consumer's start on another rank (send/recv).
        gap_s: seconds between two actions of one rank when the second waits for nothing.
        head_s / tail_s: seconds from the step's start to the first action / from the last to its end.
        pp: ranks; stage ``k`` runs on rank ``k % pp``.

    With equal stages and ``handoff_s = gap_s = head_s = tail_s = 0`` and no loss time this is
    ``(p-1)/(v·m+p-1)`` on every rank (Narayanan et al. 2021 §2.2): tested in
    ``tests/unit/test_pp_bubble_model.py``.
    """
    n_stages = max(st for o in orders for _, st, _ in o) + 1
    last = n_stages - 1
    done: dict[tuple, float] = {}
    free = [head_s] * pp
    pos = [0] * pp
    busy = [0.0] * pp
    first = [True] * pp
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                kind, st, mb = orders[r][pos[r]]
                dep = _dep(kind, st, mb, last)
                if dep is not None and dep not in done:
                    break
                ready = 0.0 if dep is None else done[dep] + (handoff_s if dep[1] % pp != r else 0.0)
                start = max(free[r] + (0.0 if first[r] else gap_s), ready)
                end = start + dur[(kind, st)]
                done[(kind, st, mb)] = end
                free[r], first[r] = end, False
                if kind != "L":
                    busy[r] += end - start
                pos[r] += 1
                moved = True
        if not moved:
            raise ValueError("the rank orders deadlock (an action waits for one that never runs)")
    return [(busy[r], free[r] + tail_s) for r in range(pp)]


# -- measurement -> parts ---------------------------------------------------------------------------


def parts(runs: list[list[dict]], warmup: int, stat: str = "mean") -> dict:
    """Stage times, hand-off, local gap, head and tail over the steps after ``warmup`` (``stat``: ``mean``, like the
    measured ratio of sums, or ``median``, robust to a descheduled rank); the rank orders; measured idle per rank."""
    pp = len(runs)
    dur: dict = {}
    handoff, gaps, heads, tails, idle = [], [], [], [], [[] for _ in range(pp)]
    orders = None
    for step in range(warmup, len(runs[0])):
        ev = {r: sorted(runs[r][step]["events"], key=lambda e: e[3]) for r in range(pp)}
        end_of = {(k, st, mb): t1 for r in ev for k, st, mb, t0, t1 in ev[r]}
        last = max(e[1] for r in ev for e in ev[r])
        orders = [[(k, st, mb) for k, st, mb, _, _ in ev[r]] for r in range(pp)]
        for r in range(pp):
            busy, wall = runs[r][step]["busy_wall"]
            idle[r].append(1 - busy / wall)
            t_start, t_end = runs[r][step]["span"]
            k0, st0, mb0 = ev[r][0][:3]
            if _dep(k0, st0, mb0, last) is None:  # a first compute that waits for no peer (rank 0's first forward)
                heads.append(ev[r][0][3] - t_start)
            tails.append(t_end - ev[r][-1][4])
            prev_end = None
            for k, st, mb, t0, t1 in ev[r]:
                dur.setdefault((k, st), []).append(t1 - t0)
                dep = _dep(k, st, mb, last)
                cross = dep is not None and dep[1] % pp != r
                if cross and prev_end is not None and prev_end <= end_of[dep]:
                    handoff.append(t0 - end_of[dep])  # this rank was waiting for the peer
                elif prev_end is not None and (dep is None or end_of[dep] <= prev_end):
                    gaps.append(t0 - prev_end)  # nothing to wait for
                prev_end = t1
    med = statistics.median if stat == "median" else statistics.mean
    return {
        "dur": {k: med(v) for k, v in dur.items()},
        "handoff_s": med(handoff) if handoff else 0.0,
        "gap_s": med(gaps) if gaps else 0.0,
        "head_s": med(heads),
        "tail_s": med(tails),
        "orders": orders,
        "measured": [statistics.mean(x) for x in idle],
        "n_handoff": len(handoff),
        "measured_steps": [[round(v, 3) for v in x] for x in idle],
    }


def explain(p: dict, *, pp: int) -> dict[str, float]:
    """Predicted mean idle fraction over ranks as each part is added: equal stages (the measurement's definition
    alone: below the formula, see :func:`bubble_model`), + imbalance, + loss, + hand-off and gaps, + head/tail."""
    d = p["dur"]
    n_st = max(st for _, st in d) + 1
    mean_f = sum(d[("F", s)] for s in range(n_st)) / n_st
    mean_b = sum(d[("B", s)] for s in range(n_st)) / n_st
    equal = {k: {"F": mean_f, "B": mean_b, "L": 0.0}[k[0]] for k in d}  # the measured forward/backward ratio
    no_loss = {k: (0.0 if k[0] == "L" else v) for k, v in d.items()}
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    o = p["orders"]
    return {
        "equal": mean(bubble_model(o, dur=equal, handoff_s=0, gap_s=0, pp=pp)),
        "+imbalance": mean(bubble_model(o, dur=no_loss, handoff_s=0, gap_s=0, pp=pp)),
        "+loss": mean(bubble_model(o, dur=d, handoff_s=0, gap_s=0, pp=pp)),
        "+handoff": mean(bubble_model(o, dur=d, handoff_s=p["handoff_s"], gap_s=p["gap_s"], pp=pp)),
        "+head/tail": mean(
            bubble_model(
                o, dur=d, handoff_s=p["handoff_s"], gap_s=p["gap_s"], head_s=p["head_s"], tail_s=p["tail_s"], pp=pp
            )
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gpt_tiny")
    parser.add_argument("--steps", type=int, default=6, help="steps per run; the first 2 are warm-up")
    parser.add_argument("--m", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--schedules", nargs="+", default=[name for name, _ in SCHEDULES])
    parser.add_argument("--json", default=None, help="write the parts of every run here")
    args = parser.parse_args()
    from framework.base.cost.bubble import pp_bubble_fraction

    shape = SHAPES[args.shape]
    dump = {}
    print(
        f"{'schedule':17s} {'m':>2s} {'formula':>7s} {'equal':>7s} {'+imbal':>7s} {'+loss':>7s} {'+hand':>7s} {'model':>7s} "
        f"{'measured':>8s} {'r0':>5s} {'r1':>5s} | {'f0 ms':>6s} {'b0 ms':>6s} {'f1 ms':>6s} {'b1 ms':>6s} {'loss':>5s} "
        f"{'c ms':>5s} {'gap':>5s} {'head':>5s} {'tail':>5s}"
    )
    for schedule, v in SCHEDULES:
        if schedule not in args.schedules:
            continue
        for m in args.m:
            runs = measure(shape, schedule, v, m, args.steps)
            p = parts(runs, warmup=2)
            e = explain(p, pp=2)
            e["model_median"] = explain(parts(runs, warmup=2, stat="median"), pp=2)["+head/tail"]
            meas = sum(p["measured"]) / 2
            d = p["dur"]
            n_st = max(st for _, st in d) + 1
            f0 = sum(d[("F", s)] for s in range(n_st) if s % 2 == 0) * 1e3
            b0 = sum(d[("B", s)] for s in range(n_st) if s % 2 == 0) * 1e3
            f1 = sum(d[("F", s)] for s in range(n_st) if s % 2 == 1) * 1e3
            b1 = sum(d[("B", s)] for s in range(n_st) if s % 2 == 1) * 1e3
            formula = pp_bubble_fraction(pp=2, n_microbatches=m, virtual_stages=v)
            print(
                f"{schedule:17s} {m:2d} {formula:7.3f} {e['equal']:7.3f} {e['+imbalance']:7.3f} {e['+loss']:7.3f} {e['+handoff']:7.3f} "
                f"{e['+head/tail']:7.3f} {meas:8.3f} {p['measured'][0]:5.2f} {p['measured'][1]:5.2f} | {f0:6.1f} {b0:6.1f} "
                f"{f1:6.1f} {b1:6.1f} {d[('L', n_st - 1)] * 1e3:5.1f} {p['handoff_s'] * 1e3:5.2f} {p['gap_s'] * 1e3:5.2f} "
                f"{p['head_s'] * 1e3:5.1f} {p['tail_s'] * 1e3:5.1f} | median-based model {e['model_median']:.3f}",
                flush=True,
            )
            dump[f"{schedule}-m{m}"] = {
                **{k: v for k, v in p.items() if k != "orders"},
                "dur": {f"{k}{s}": t for (k, s), t in d.items()},
                "explain": e,
                "formula": formula,
                "measured_mean": meas,
                "model": e["+head/tail"],
            }
    if args.json:
        path = Path(args.json)
        everything = json.loads(path.read_text()) if path.exists() else {}
        everything[args.shape] = dump  # one file, a key per shape (the validation reads gpt_tiny / gpt_50m)
        path.write_text(json.dumps(everything, indent=1))


if __name__ == "__main__":
    main()
