"""The cost model beside measurement, on every layout this machine holds (issue 15, item 5).

Runs each layout (single, ddp, zero1-3, fsdp, tp2, pp2 x schedule x m, dp2xtp2, dp2xpp2,
tp2xpp2) for a few steps of ``gpt_tiny`` (and, where it runs in reasonable time, ``gpt_50m``)
through the driver, each under ``flock /tmp/trainlab-heavy.lock``, 1 thread per rank on the
multi-rank layouts, and prints per layout predicted / measured:

- comm payload bytes per step by kind (``perf/comm_bytes_<kind>`` vs the plugin's figure from
  :mod:`framework.base.cost.comm`): must be exact;
- model-state bytes per rank (``mem/model_states_bytes`` vs :mod:`framework.base.cost.memory`): 5%;
- peak activation bytes per rank (``mem/activation_peak_bytes``, saved-tensor hooks, max over
  ranks, vs :func:`gpt_activation_bytes`, Korthikanti et al. 2022 Table 2 adapted to trainlab's
  GPT; the cost model's own 16-bit figure is printed beside it): 10%;
- pipeline bubble (``perf/pp_bubble_frac`` vs :func:`bubble_with_handoff`: the schedule's idle
  fraction with measured stage times and per-micro-batch hand-off): 0.05 absolute;
- step time (``perf/step_time_s_mean`` vs :func:`predicted_step_s`): 20%; and the Spearman rank
  correlation of predicted and measured step time over the layouts (>= 0.8).

**Step time on this CPU** (the cost model is built for GPUs, where FLOPs and bytes set the step):
:func:`framework.base.cost.steptime.step_time` with inputs measured here, none fitted to the
validation runs:

- the compute rate: the *marginal* FLOP rate of the model's forward + backward in one process at
  1 thread (:func:`measure_rates`: the model and its nano twin, below, each timed; rate =
  FLOPs difference / time difference), per micro-batch size, and the optimizer's bytes/s the same
  way;
- the effective cores: two ranks training at once each run ``slowdown`` times slower than one
  alone (:func:`concurrent_slowdown`: two ``single`` runs at once against one), so a layout of 2+
  ranks gets ``1 / slowdown`` of the rates, and one of more ranks than cores also ``cores / ranks``;
- ``step_overhead_s``, the framework's fixed time per step (Python per op and per parameter,
  DTensor dispatch, DeepSpeed's and FSDP's hooks, Lightning's loop, gloo latency): the measured
  step of **the same layout with a nano model** (the same depth, ``d_model`` 32, 4 heads: the
  same ops and parameter tensors at ~1/150 of the FLOPs) minus what the cost model gives that
  nano run;
- the collectives at gloo's measured alpha and bandwidth (4 KiB-32 MiB), and none of them hidden: on
  a CPU gloo's threads copy and reduce on the cores the ranks compute on (``dp_overlap``,
  ``zero3_prefetch``, ``param_gather_overlap`` = 0).

    python benchmarks/cost_model_validation.py [--models gpt_tiny gpt_50m]
        [--layouts NAME ...] [--steps 10] [--workdir bench-cost-model] [--out FILE.md] [--reuse]
        [--bubble-parts parts.json]

It takes ``/tmp/trainlab-heavy.lock`` itself (once per model, for all its runs). ``--reuse`` reads
the metrics of runs already in ``--workdir`` instead of running them again (no lock);
``--bubble-parts`` is the JSON ``benchmarks/pp_bubble_parts.py --json`` wrote (measured stage
times and hand-off per schedule and m: the bubble model's inputs).

**Adapters** (marked ``ADAPTER``): the cost model's activation figure
(:func:`framework.base.cost.activations.activation_bytes_per_rank`, Table 2 with ``act_bytes`` and
``dropout``) is printed beside ours, but it keeps the ``s x s`` scores unless recompute is
selective (fused attention keeps none), counts the embedding output (we keep only the token ids),
leaves out the final norm's and the head's inputs, the attention's log-sum-exp and the LayerNorm
statistics, divides the logits by ``t`` (our head is replicated) and keeps one micro-batch on
the last stage under GPipe (it keeps ``m``): :func:`gpt_activation_bytes` and :func:`inflight`
carry trainlab's GPT exactly. The step-time inputs above are this machine's: the cost model
alone (``conf/cluster/local_cpu``: GEMM rate, no overhead) is printed beside them.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

LOCK = "/tmp/trainlab-heavy.lock"
GLOBAL_BATCH = 16  # sequences per optimizer step, every layout (seq_len 128: 2,048 tokens)


@dataclass(frozen=True)
class Layout:
    """One run: plugin, degrees, schedule and micro-batching at the global batch of 16 sequences."""

    name: str
    plugin: str
    world: int
    dp: int = 1
    tp: int = 1
    pp: int = 1
    schedule: str = "1f1b"
    v: int = 1
    m: int = 1  # micro-batches per optimizer step per rank (grad_accum_steps / pipeline micro-batches)
    global_batch: int = GLOBAL_BATCH  # sequences per optimizer step

    @property
    def micro_batch_size(self) -> int:
        return self.global_batch // (self.dp * self.m)

    def overrides(self) -> list[str]:
        o = [
            f"parallelism={self.plugin}",
            f"trainer.micro_batch_size={self.micro_batch_size}",
            f"trainer.global_batch_size={self.global_batch}",
            "trainer.grad_accum_steps=null",
        ]
        if self.plugin != "single":
            o.append(f"parallelism.world_size={self.world}")
        if self.plugin in ("tp", "pp"):
            o += [
                f"parallelism.tp_degree={self.tp}",
                f"parallelism.pp_degree={self.pp}",
                f"parallelism.schedule={self.schedule}",
                f"parallelism.virtual_stages={self.v}",
            ]
        # 1 thread per rank everywhere: single as the ddp ranks (its default, 2 threads, times erratically on
        # 2 shared cores); 4 ranks get 1 by default (cores // ranks, at least 1; an explicit 1 x 4 > 2 cores is
        # refused) and are oversubscribed 2x (the step-time adapter's core share).
        if self.world <= 2:
            o.append("trainer.threads_per_rank=1")
        return o


def layouts() -> list[Layout]:
    """Every layout a 2-core machine holds at 2 or 4 ranks (see the module docstring)."""
    out = [
        Layout("single", "single", 1, m=2),
        Layout("ddp", "ddp", 2, dp=2),
        Layout("zero1", "zero1", 2, dp=2),
        Layout("zero2", "zero2", 2, dp=2),
        Layout("zero3", "zero3", 2, dp=2),
        Layout("fsdp", "fsdp", 2, dp=2),
        Layout("tp2", "tp", 2, tp=2, m=2),
    ]
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)):
        for m in (2, 4, 8):
            out.append(Layout(f"pp2-{schedule}-m{m}", "pp", 2, pp=2, schedule=schedule, v=v, m=m))
    out += [
        Layout("dp2tp2", "tp", 4, dp=2, tp=2),
        Layout("dp2pp2", "pp", 4, dp=2, pp=2, m=4),
        Layout("tp2pp2", "pp", 4, tp=2, pp=2, m=4),
    ]
    return out


# gpt_50m (~60M parameters, ~0.37 TFLOP per step of 8 sequences) takes ~8-20 s per step on 2 shared cores:
# a subset at a global batch of 8, 4 steps (1 warm-up). Left out: zero1/zero2 (the same compute as ddp), the
# pipeline schedules but 1F1B at m = 4, dp2pp2 and tp2pp2 (4 ranks at half a core each).
GPT50M = dict(
    global_batch=8, steps=4, warmup=1, layouts=("single", "ddp", "zero3", "fsdp", "tp2", "pp2-1f1b-m4", "dp2tp2")
)


# -- running ---------------------------------------------------------------------------------------

NANO = {"d_model": 32, "n_head": 4}
"""The nano twin of a model: the same depth, vocabulary and sequence, ``d_model`` 32 (the framework's per-op and
per-tensor work at ~1/150 of gpt_tiny's FLOPs); its measured step is the layout's framework overhead."""


def run_layout(
    model: str, lay: Layout, *, steps: int, warmup: int, work: Path, reuse: bool, nano: bool = False
) -> dict:
    """Train ``lay`` for ``steps`` steps (the caller holds the heavy-job lock); returns the run's last value of each
    metric. ``nano``: the model's :data:`NANO` twin (run name ``<model>-nano-<layout>``)."""
    name = f"{model}-nano-{lay.name}" if nano else f"{model}-{lay.name}"
    run_dir = work / "outputs" / "default" / name
    metrics = run_dir / "metrics.jsonl"
    if not (reuse and metrics.exists()):
        cmd = [
            sys.executable,
            "-m",
            "framework.train",
            f"model={model}",
            *lay.overrides(),
            "checkpoint=none",
            "tracking=none",
            "trainer.progress_bar=false",
            f"trainer.max_steps={steps}",
            f"trainer.log_every_n_steps={steps}",
            f"trainer.warmup_steps_excluded={warmup}",
            "trainer.val_sequences=8",
            "trainer.val_every_n_steps=1000",
            "resume=never",
            f"run_name={name}",
        ]
        if nano:
            cmd += [f"model.{k}={v}" for k, v in NANO.items()]
        if metrics.exists():
            metrics.unlink()
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        done = subprocess.run(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if done.returncode != 0:
            print(done.stdout[-3000:], file=sys.stderr)
            raise RuntimeError(f"{name}: exit code {done.returncode}")
    out: dict = {}
    for line in metrics.read_text().splitlines():
        out.update(json.loads(line))
    summary = run_dir / "summary.json"
    if summary.exists():
        out.update(json.loads(summary.read_text()))
    return out


# -- ADAPTER: activation memory of trainlab's GPT ---------------------------------------------------


def gpt_activation_bytes(
    *,
    n_layer: int,
    d_model: int,
    n_head: int,
    d_ff: int,
    vocab: int,
    seq_len: int,
    micro_batch_size: int,
    tp: int = 1,
    act_bytes: int = 4,
) -> dict[str, float]:
    """Bytes trainlab's GPT saves for backward per micro-batch, by part (fp32, no dropout, fused attention).

    Korthikanti et al. 2022 §4.1 / Table 2 (``s·b·h·(34 + 5·a·s/h)`` at 2 bytes) adapted, per layer
    (s tokens, b sequences, h hidden, a heads, f MLP width, e = ``act_bytes``, t = TP degree):

    - not split by TP: the two LayerNorm inputs ``2·e·sbh``, the attention and MLP inputs (the
      LayerNorm outputs the QKV and fc GEMMs keep) ``2·e·sbh``; LayerNorm mean and rstd
      ``2·2·4·sb`` (fp32; not in Table 2);
    - split by TP: Q, K, V (one ``qkv`` output) ``3·e·sbh/t``, the attention output (= the
      projection input: CPU flash attention writes ``[b, s, a, d]``, so the reshape is a view)
      ``e·sbh/t``, the GELU input and output ``2·e·sbf/t``, the attention's log-sum-exp
      ``4·b·a·s/t`` (fp32);
    - not held: the ``5·a·s²·b`` softmax / score terms (fused attention keeps no ``s x s`` matrix)
      and the dropout masks ``2·sbh`` (``dropout=0``).

    Table 2's ``34`` = 2 x 16 elements + 2 mask bytes; our 16 elements are the same tensors.
    Outside the layers: on the first stage the token ids (int64, ``ids = 8·sb``) and positions
    (``pos = 8·s``); on the last, ``head = 2·e·sbh + 8·sb + 4·sbV + 8``: ``ln_f``'s input and stats, the
    head's input, the fp32 ``log_softmax`` output (the head is replicated under TP: not divided)
    and two fp32 scalars (the loss's weight sum, and the token-weighted loss's denominator that its
    division keeps), and the targets (int64, ``targets = 8·sb``).

    Returns ``{"layer", "ids", "pos", "head", "targets"}`` in bytes per micro-batch.
    """
    s, b, h, a, f, e, t = seq_len, micro_batch_size, d_model, n_head, d_ff, act_bytes, tp
    layer = 4 * e * s * b * h + 16 * s * b + (4 * e * s * b * h + 2 * e * s * b * f + 4 * b * a * s) / t
    return {
        "layer": layer,
        "ids": 8 * s * b,
        "pos": 8 * s,
        "head": 2 * e * s * b * h + 8 * s * b + 4 * s * b * vocab + 8,
        "targets": 8 * s * b,
    }


def inflight(schedule: str, *, pp: int, m: int, v: int, stage: int) -> float:
    """Micro-batches a pipeline rank holds at its peak, in units of one micro-batch through its ``L/p`` layers.

    GPipe: every stage runs all ``m`` forwards before any backward. 1F1B: stage ``k`` warms up
    with ``p - k`` forwards (at most ``m``). Interleaved (torch's ``ScheduleInterleaved1F1B``, ``v``
    chunks of ``L/(p·v)`` layers): rank ``k`` warms up with ``(v-1)·p + 2·(p-1-k)`` chunk forwards, +1
    for its first 1F1B forward, at most ``v·m``; divided by ``v`` to count in ``L/p`` units.
    """
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(pp - stage, m))
    chunks = min((v - 1) * pp + 2 * (pp - 1 - stage) + 1, v * m)
    return chunks / v


def predicted_activation_bytes(cfg: dict, lay: Layout) -> float:
    """The largest pipeline rank's peak activation bytes (max over stages).

    Each in-flight micro-batch holds its layers' activations (and, under GPipe, the last stage its
    head's); positions are made per forward. Token ids and targets are saved as views: a pipeline
    schedule splits the step's ``[m·b, s]`` batch into micro-batch views of one storage, so any
    micro-batch in flight keeps all ``m`` alive (``m·8·sb`` each); under gradient accumulation each
    micro-batch is its own loader batch.
    """
    parts = gpt_activation_bytes(
        n_layer=cfg["n_layer"],
        d_model=cfg["d_model"],
        n_head=cfg["n_head"],
        d_ff=cfg["d_ff"],
        vocab=cfg["vocab"],
        seq_len=cfg["seq_len"],
        micro_batch_size=lay.micro_batch_size,
        tp=lay.tp,
    )
    whole_batch = lay.m if lay.pp > 1 else 1
    best = 0.0
    for stage in range(lay.pp):
        n = inflight(lay.schedule, pp=lay.pp, m=lay.m, v=lay.v, stage=stage)
        total = parts["layer"] * cfg["n_layer"] / lay.pp * n
        if stage == 0:
            total += parts["ids"] * whole_batch + parts["pos"] * math.ceil(n)
        if stage == lay.pp - 1:
            total += parts["head"] * (math.ceil(n) if lay.schedule == "gpipe" else 1) + parts["targets"] * whole_batch
        best = max(best, total)
    return best


def cost_model_activation_bytes(cfg: dict, lay: Layout) -> float:
    """The cost model's own figure (:func:`framework.base.cost.activations.activation_bytes_per_rank`) for our runs: fp32
    (``act_bytes=4``), no dropout, and ``recompute="selective"`` standing in for fused attention (no ``s x s`` scores)."""
    from framework.base.cost.activations import activation_bytes_per_rank

    shape = _shape(cfg)
    sched = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B"}[lay.schedule]
    return activation_bytes_per_rank(
        shape,
        micro_batch_size=lay.micro_batch_size,
        tp=lay.tp,
        pp=lay.pp,
        n_microbatches=lay.m,
        sequence_parallel=False,
        recompute="selective",
        schedule=sched,
        virtual_stages=lay.v,
        act_bytes=4,
        dropout=False,
    )["total"]


# -- step time: the cost model on conf/cluster/local_cpu --------------------------------------------


def local_cpu(cache_dir: Path):
    """``conf/cluster/local_cpu.yaml`` with its measured figures (GEMM rate of one rank at 1 thread, gloo alpha and
    bandwidth by kind: :func:`framework.base.metrics.local_cpu.load_or_measure_local_cpu`, cached in ``cache_dir``)."""
    from omegaconf import OmegaConf

    from framework.base.metrics.local_cpu import cluster_of

    raw = OmegaConf.to_container(
        OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "cluster" / "local_cpu.yaml")
    )
    return cluster_of(raw, where="cluster=local_cpu", cache_dir=str(cache_dir))


@functools.cache
def plan_layout(lay: Layout):
    """The cost model's :class:`~framework.base.cost.layout.PlanLayout` of a run: its overrides composed and validated as
    the driver does, then :func:`framework.driver.plan.runs.plan_layout_of` with the ZeRO stage its plugin declares
    (``ParallelPlugin.zero_stage``; fp32: the runs' ``32-true``)."""
    from hydra import compose, initialize_config_dir

    from framework.base.registry import get_plugin_class
    from framework.driver.cli import CONF_DIR
    from framework.driver.plan.runs import default_run_with, plan_layout_of
    from framework.driver.validate import load_run_config, validate

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*lay.overrides(), "checkpoint=none", "run_name=plan"])
    resolved = validate(load_run_config(cfg))
    plugin = get_plugin_class(resolved.plugin_name)(resolved.run.parallelism)
    return plan_layout_of(resolved, plugin.zero_stage, run_with=default_run_with())


def _rate_worker(cfg: dict, sizes: tuple, iters: int, out) -> None:
    """The process of :func:`measure_rates`: at 1 thread, per micro-batch size, the median seconds of the model's
    and its nano twin's forward + backward and of their AdamW step."""
    import statistics
    import time

    import torch

    from framework.base.config.schema import ModelConfig
    from framework.base.model import GPT

    torch.set_num_threads(1)  # one rank = one thread (ranks x threads <= cores; the runs' setting)
    nets = {}
    for which, dims in (("model", {"d_model": cfg["d_model"], "n_head": cfg["n_head"]}), ("nano", NANO)):
        torch.manual_seed(0)
        gpt = GPT(ModelConfig(n_layer=cfg["n_layer"], max_seq_len=256, **dims), cfg["vocab"])
        nets[which] = (gpt, torch.optim.AdamW(gpt.parameters(), lr=1e-4))
    times: dict = {}
    for b in sizes:
        x, y = torch.randint(0, cfg["vocab"], (2, b, cfg["seq_len"])).unbind(0)
        for i in range(iters + 1):  # the first is a warm-up; model and nano alternate, so drift hits both alike
            for which, (gpt, opt) in nets.items():
                t0 = time.perf_counter()
                gpt(x, y).backward()
                t1 = time.perf_counter()
                opt.step()
                t2 = time.perf_counter()
                opt.zero_grad()  # set_to_none, as Lightning does: the next backward allocates the grads again
                if i:
                    times.setdefault(f"{which}/{b}", []).append((t1 - t0, t2 - t1))
    res = {k: (statistics.median(t[0] for t in v), statistics.median(t[1] for t in v)) for k, v in times.items()}
    out.put(res)


def measure_rates(cfg: dict, sizes: tuple, *, iters: int) -> dict:
    """The marginal compute rate and optimizer bandwidth of ``cfg``'s GPT on this machine (one process at 1 thread,
    spawned so that this process's thread setting stays as it is).

    Returns ``{"flops_per_s": {b: FLOP/s}, "optimizer_bytes_per_s": bytes/s}``:
    FLOP/s = (hardware FLOPs of the model - of its nano twin, forward + backward of ``b`` sequences) / (time
    difference); bytes/s = (AdamW bytes touched of the model - of the twin) / (time difference), the bytes as the
    cost model counts them (``optimizer_state_passes`` x state + grad + weight, fp32). Differences leave out what
    both pay per op and per tensor (that is the layout's overhead, measured by its nano run).
    """
    import multiprocessing as mp

    from framework.base.cost.flops import hardware_flops_per_token
    from framework.base.cost.memory import PRECISIONS
    from framework.base.cost.steptime import StepTimeParams

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    worker = ctx.Process(target=_rate_worker, args=(cfg, sizes, iters, out))
    worker.start()
    r = out.get()
    worker.join()
    big, nano = _shape(cfg), _shape({**cfg, **NANO})
    fpt = hardware_flops_per_token(big, "none") - hardware_flops_per_token(nano, "none")
    prec = PRECISIONS["fp32"]
    per_param = StepTimeParams().optimizer_state_passes * prec.optimizer_bytes + prec.grad_bytes + prec.weight_bytes
    d_bytes = (_n_params(cfg) - _n_params({**cfg, **NANO})) * per_param
    rates = {b: fpt * b * cfg["seq_len"] / (r[f"model/{b}"][0] - r[f"nano/{b}"][0]) for b in sizes}
    opt_bw = d_bytes * len(sizes) / (sum(r[f"model/{b}"][1] for b in sizes) - sum(r[f"nano/{b}"][1] for b in sizes))
    return {"flops_per_s": rates, "optimizer_bytes_per_s": opt_bw}


def _n_params(cfg: dict) -> int:
    from framework.base.config.schema import ModelConfig
    from framework.base.model import GPT

    gpt = GPT(
        ModelConfig(n_layer=cfg["n_layer"], n_head=cfg["n_head"], d_model=cfg["d_model"], max_seq_len=256), cfg["vocab"]
    )
    return sum(p.numel() for p in gpt.parameters())


def load_or_measure_rates(model: str, work: Path, sizes: tuple) -> dict:
    """:func:`measure_rates` of one process, cached in ``<work>/rates-<model>.json`` (the caller holds the lock
    unless the cache exists). Returns ``{"flops_per_s": {b: ...}, "optimizer_bytes_per_s": ...}``."""
    path = work / f"rates-{model}.json"
    if path.exists():
        raw = json.loads(path.read_text())
        return {
            "flops_per_s": {int(b): v for b, v in raw["flops_per_s"].items()},
            "optimizer_bytes_per_s": raw["optimizer_bytes_per_s"],
        }
    cfg = _model_cfg(model)
    iters = 20 if cfg["d_model"] <= 256 else 3
    print(f"measuring {model}'s forward+backward and AdamW rates ...", file=sys.stderr, flush=True)
    rates = measure_rates(cfg, sizes, iters=iters)
    path.write_text(json.dumps(rates, indent=1))
    return rates


def concurrent_slowdown(
    model: str, single: Layout, single_s: float, *, steps: int, warmup: int, work: Path, reuse: bool
) -> float:
    """How much slower one rank trains while another trains beside it: two ``single`` runs of ``model`` at once
    (1 thread each), their mean step time over ``single_s`` (the same run alone). This machine's effective cores:
    2 ranks on 2 cores get ``2 / slowdown`` cores' worth of compute (memory bandwidth, caches, page faults and the
    drivers' threads are shared; a synthetic forward+backward in two processes shows less than the training loop)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> float:
        lay = replace(single, name=f"single-concurrent{i}")
        return run_layout(model, lay, steps=steps, warmup=warmup, work=work, reuse=reuse)["perf/step_time_s_mean"]

    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(one, (1, 2)))
    return sum(both) / 2 / single_s


def step_time_s(cfg: dict, lay: Layout, cluster, cores: int) -> float:
    """The cost model alone: :func:`framework.base.cost.steptime.step_time` on ``local_cpu`` as configured (the GEMM rate of
    one rank, no overhead) x ``max(1, ranks / cores)`` (4 ranks of 1 thread share 2 cores)."""
    from framework.base.cost.steptime import step_time

    return step_time(_shape(cfg), plan_layout(lay), cluster).total * max(1.0, lay.world / cores)


def predicted_step_s(
    cfg: dict, lay: Layout, cluster, cores: int, rates: dict, slowdown: float, nano_measured_s: float
) -> tuple[float, float]:
    """Predicted seconds per optimizer step with this machine's measured inputs (module docstring), and the
    framework overhead per step it used.

    ``cluster`` is ``local_cpu`` with its compute rate and memory bandwidth replaced by ``rates`` (the marginal
    forward+backward FLOP/s at the layout's micro-batch size and optimizer bytes/s of one process), divided by
    ``slowdown`` (:func:`concurrent_slowdown`) when two or more ranks train at once, and times
    ``min(1, cores / ranks)``; ``step_overhead_s`` = ``nano_measured_s`` (the nano run of
    the same layout) - the cost model's time of that nano run on the same cluster; ``replicated_head`` (trainlab's
    TP plugin computes the whole output head on every TP rank); no overlap (``dp_overlap``, ``zero3_prefetch``,
    ``param_gather_overlap`` 0: gloo reduces and copies on the cores the ranks compute on).
    """
    from framework.base.cost.steptime import StepTimeParams, step_time

    share = min(1.0, cores / lay.world) / (slowdown if lay.world > 1 else 1.0)
    flops = rates["flops_per_s"].get(lay.micro_batch_size) or min(rates["flops_per_s"].values())
    cl = replace(
        cluster, peak_flops=flops * share, achievable_fraction=1.0, hbm_bandwidth=rates["optimizer_bytes_per_s"] * share
    )
    pl = plan_layout(lay)
    # Nothing overlaps on this CPU: gloo's threads reduce and copy on the cores the rank computes on (1 thread per
    # rank, ranks x threads <= cores). trainlab's TP plugin keeps the output head whole on every rank.
    params = StepTimeParams(dp_overlap=0.0, zero3_prefetch=0.0, param_gather_overlap=0.0, replicated_head=True)
    overhead = nano_measured_s - step_time(_shape({**cfg, **NANO}), pl, cl, params).total
    return step_time(_shape(cfg), pl, cl, replace(params, step_overhead_s=overhead)).total, overhead


def _shape(cfg: dict):
    from framework.base.cost.shape import ModelShape

    return ModelShape(
        n_layer=cfg["n_layer"],
        d_model=cfg["d_model"],
        n_head=cfg["n_head"],
        vocab_size=cfg["vocab"],
        seq_len=cfg["seq_len"],
        d_ff=cfg["d_ff"],
        max_seq_len=256,
    )


# -- the table --------------------------------------------------------------------------------------


def _model_cfg(model: str) -> dict:
    from omegaconf import OmegaConf

    conf = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "model" / f"{model}.yaml")
    return {
        "n_layer": conf.n_layer,
        "d_model": conf.d_model,
        "n_head": conf.n_head,
        "d_ff": conf.d_ff or 4 * conf.d_model,
        "vocab": conf.vocab_size or 4096,
        "seq_len": 128,
    }


def _spearman(x: list[float], y: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))


def _mib(x: float) -> str:
    return f"{x / 2**20:.2f}"


def _row(
    model: str, lay: Layout, r: dict, r_nano: dict, cluster, bubble_parts: dict, rates: dict, slowdown: float
) -> dict:
    """Predicted and measured figures of one run (``r_nano``: its nano twin's run; ``rates``: :func:`load_or_measure_rates`;
    ``slowdown``: :func:`concurrent_slowdown`)."""
    from framework.base.cost.bubble import pp_bubble_fraction

    cfg = _model_cfg(model)
    kinds = sorted(
        {
            k[len("perf/comm_bytes_") : -len("_model")]
            for k in r
            if k.startswith("perf/comm_bytes_") and k.endswith("_model")
        }
        - {"wire", ""}
    )
    comm = {k: (r.get(f"perf/comm_bytes_{k}", 0.0), r[f"perf/comm_bytes_{k}_model"]) for k in kinds}
    parts = bubble_parts.get(model, {}).get(f"{lay.schedule}-m{lay.m}") if lay.pp > 1 else None
    row = {
        "model": model,
        "layout": lay.name,
        "lay": lay,
        "comm": comm,
        "states": (r["mem/model_states_bytes"], r["mem/model_states_bytes_model"]),
        "act": (r.get("mem/activation_peak_bytes", float("nan")), predicted_activation_bytes(cfg, lay)),
        "act_cost_model": cost_model_activation_bytes(cfg, lay),
        "step": (r.get("perf/step_time_s_mean", float("nan")), step_time_s(cfg, lay, cluster, os.cpu_count() or 2)),
    }
    nano_s = r_nano.get("perf/step_time_s_mean", float("nan")) if r_nano else float("nan")
    row["step_measured_inputs"] = (
        predicted_step_s(cfg, lay, cluster, os.cpu_count() or 2, rates, slowdown, nano_s)
        if rates and slowdown == slowdown and nano_s == nano_s
        else (float("nan"), float("nan"))
    )
    row["nano_s"] = nano_s
    if lay.pp > 1:
        modelled = parts["model"] if parts and lay.dp == 1 and lay.tp == 1 else float("nan")
        row["bubble"] = (
            r.get("perf/pp_bubble_frac", float("nan")),
            pp_bubble_fraction(pp=lay.pp, n_microbatches=lay.m, virtual_stages=lay.v),
            modelled,
        )
    return row


def report(results: list, *, cluster, bubble_parts: dict, rates: dict, slowdowns: dict) -> str:
    """The markdown table of predicted / measured per layout, the misses, and the rank correlation per model.

    ``results``: ``(model, layout, run metrics, nano run metrics or None)``; ``rates``, ``slowdowns``: by model."""
    rows = [
        _row(model, lay, r, rn, cluster, bubble_parts, rates.get(model), slowdowns.get(model, float("nan")))
        for model, lay, r, rn in results
    ]
    lines = [
        "| model | layout | comm payload bytes/step, measured (= model unless shown) | model states MiB meas / model "
        "| activations MiB meas / model (err) [cost model: fp32, no dropout, selective] | bubble meas / formula / model "
        "| step s measured | cost model alone (err) | nano run s | overhead s | predicted (err) |",
        "|" + "---|" * 11,
    ]
    misses: list[str] = []
    for row in rows:
        name = f"{row['model']} {row['layout']}"
        comm = (
            ", ".join(f"{k} {m:,.0f}" + ("" if m == p else f" != {p:,.0f}") for k, (m, p) in row["comm"].items())
            or "none"
        )
        if any(m != p for m, p in row["comm"].values()):
            misses.append(f"{name}: comm bytes not exact")
        sm, sp = row["states"]
        if abs(sm - sp) > 0.05 * sp:
            misses.append(f"{name}: model states {sm:,.0f} vs {sp:,.0f} ({sm / sp - 1:+.1%})")
        am, ap = row["act"]
        if not abs(am / ap - 1) <= 0.10:
            misses.append(f"{name}: activations {am:,.0f} vs {ap:,.0f} ({am / ap - 1:+.1%})")
        bub = "-"
        if "bubble" in row:
            bm, bf, bp = row["bubble"]
            bub = f"{bm:.3f} / {bf:.3f} / " + ("-" if bp != bp else f"{bp:.3f}")
            if not abs(bm - bp) <= 0.05:
                misses.append(f"{name}: bubble {bm:.3f} vs model " + ("(none)" if bp != bp else f"{bp:.3f}"))
        tm, talone = row["step"]
        tp, overhead = row["step_measured_inputs"]
        if not abs(tm / tp - 1) <= 0.20:
            misses.append(f"{name}: step time {tm:.3f} s vs predicted {tp:.3f} s ({tm / tp - 1:+.0%})")
        lines.append(
            f"| {row['model']} | {row['layout']} | {comm} | {_mib(sm)} / {_mib(sp)} | {_mib(am)} / {_mib(ap)} "
            f"({am / ap - 1:+.1%}) [{_mib(row['act_cost_model'])}] | {bub} | {tm:.3f} | {talone:.3f} ({tm / talone - 1:+.0%}) "
            f"| {row['nano_s']:.3f} | {overhead:.3f} | {tp:.3f} ({tm / tp - 1:+.0%}) |"
        )
    out = "\n".join(lines) + "\n"
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model and r["step"][0] == r["step"][0]]
        if len(mine) > 2:
            rho_alone = _spearman([r["step"][1] for r in mine], [r["step"][0] for r in mine])
            ok = [r for r in mine if r["step_measured_inputs"][0] == r["step_measured_inputs"][0]]
            rho = (
                _spearman([r["step_measured_inputs"][0] for r in ok], [r["step"][0] for r in ok])
                if len(ok) > 2
                else float("nan")
            )
            within = sum(abs(r["step"][0] / r["step_measured_inputs"][0] - 1) <= 0.20 for r in ok)
            out += (
                f"\n{model}: Spearman rank correlation of predicted and measured step time over {len(ok)} layouts: "
                f"**{rho:.2f}** ({within} of {len(ok)} within 20%); the cost model alone: {rho_alone:.2f} over {len(mine)}"
            )
        r = rates.get(model)
        if r:
            out += (
                f"\n{model} inputs: forward+backward GFLOP/s of one process by micro-batch "
                + ", ".join(f"b={b}: {r['flops_per_s'][b] / 1e9:.1f}" for b in sorted(r["flops_per_s"]))
                + f"; AdamW GB/s {r['optimizer_bytes_per_s'] / 1e9:.2f}; slowdown (step time of two concurrent single runs "
                f"/ one alone) {slowdowns.get(model, float('nan')):.2f}"
            )
    return out + "\n\nMisses:\n" + ("\n".join(f"- {x}" for x in misses) if misses else "- none") + "\n"


def one_process_activations(model: str, micro_batch_sizes: tuple[int, ...] = (1, 4)) -> str:
    """Measured (one forward under :class:`~framework.base.metrics.memory.SavedTensorMeter`, this process, no ranks)
    vs modelled activation bytes of ``model`` per micro-batch size: a check of bigger shapes without the lock."""
    import torch

    from framework.base.config.schema import ModelConfig
    from framework.base.metrics.memory import SavedTensorMeter
    from framework.base.model import GPT

    cfg = _model_cfg(model)
    torch.manual_seed(0)
    gpt = GPT(
        ModelConfig(n_layer=cfg["n_layer"], n_head=cfg["n_head"], d_model=cfg["d_model"], max_seq_len=256), cfg["vocab"]
    )
    lines = []
    for b in micro_batch_sizes:
        x, y = torch.randint(0, cfg["vocab"], (2, b, cfg["seq_len"])).unbind(0)
        x, y = x.clone(), y.clone()  # ids and targets in storages of their own, as a loader batch holds them
        meter = SavedTensorMeter()
        with meter:
            loss = gpt(x, y)
        del loss
        lay = Layout("single", "single", 1, m=1, global_batch=b)
        lines.append(
            f"{model} b={b}: measured {meter.peak_bytes:,} bytes, model {predicted_activation_bytes(cfg, lay):,.0f}, "
            f"cost model {cost_model_activation_bytes(cfg, lay):,.0f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt_tiny", "gpt_50m"])
    parser.add_argument("--layouts", nargs="*", default=None, help="layout names (default: all)")
    parser.add_argument(
        "--steps", type=int, default=10, help="optimizer steps per gpt_tiny run, 3 left out of timing (gpt_50m: 4, 1)"
    )
    parser.add_argument("--workdir", default="bench-cost-model")
    parser.add_argument("--out", default=None, help="also write the table as markdown here")
    parser.add_argument("--reuse", action="store_true", help="read runs already in --workdir")
    parser.add_argument(
        "--activations-only",
        action="store_true",
        help="one forward per model in this process: measured vs modelled activation bytes, no runs",
    )
    parser.add_argument(
        "--bubble-parts",
        default=None,
        help="JSON from pp_bubble_parts.py --json-by-model: {model: {schedule-mM: {model, handoff_s, ...}}}",
    )
    args = parser.parse_args()
    if args.activations_only:
        print("\n".join(one_process_activations(model) for model in args.models))
        return
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    results, rates, slowdowns = [], {}, {}
    for model in args.models:
        steps, warmup = (args.steps, 3) if model != "gpt_50m" else (GPT50M["steps"], GPT50M["warmup"])
        todo = [
            lay
            for lay in layouts()
            if (not args.layouts or lay.name in args.layouts) and (model != "gpt_50m" or lay.name in GPT50M["layouts"])
        ]
        if model == "gpt_50m":
            todo = [replace(lay, global_batch=GPT50M["global_batch"]) for lay in todo]
        with open(LOCK, "a") as lock:  # one model's runs back to back, one heavy job at a time on the machine
            if not args.reuse:
                fcntl.flock(lock, fcntl.LOCK_EX)
            sizes = tuple(sorted({lay.micro_batch_size for lay in todo}))
            if not args.reuse or (work / f"rates-{model}.json").exists():
                rates[model] = load_or_measure_rates(model, work, sizes)
            measured = {}
            for i, lay in enumerate(todo):
                runs = []
                for nano in (False, True):
                    name = f"{model}-nano-{lay.name}" if nano else f"{model}-{lay.name}"
                    if args.reuse and not (work / "outputs" / "default" / name / "summary.json").exists():
                        print(f"no run {name} in {work}: left out", file=sys.stderr)
                        runs.append(None)
                        continue
                    print(f"[{i + 1}/{len(todo)}] running {name} ...", file=sys.stderr, flush=True)
                    runs.append(
                        run_layout(model, lay, steps=steps, warmup=warmup, work=work, reuse=args.reuse, nano=nano)
                    )
                if runs[0] is not None:
                    results.append((model, lay, runs[0], runs[1]))
                    measured[lay.name] = (lay, runs[0]["perf/step_time_s_mean"])
            if "single" in measured and (
                not args.reuse or (work / "outputs" / "default" / f"{model}-single-concurrent2").exists()
            ):
                print(f"running {model} single twice at once ...", file=sys.stderr, flush=True)
                slowdowns[model] = concurrent_slowdown(
                    model,
                    measured["single"][0],
                    measured["single"][1],
                    steps=steps,
                    warmup=warmup,
                    work=work,
                    reuse=args.reuse,
                )
    if not args.reuse:  # gloo alpha/beta and the GEMM rate, measured now (2 ranks: under the lock) unless cached
        with open(LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            cluster = local_cpu(work / ".cache" / "cost")
    else:
        cluster = local_cpu(work / ".cache" / "cost")
    parts = json.loads(Path(args.bubble_parts).read_text()) if args.bubble_parts else {}
    text = report(results, cluster=cluster, bubble_parts=parts, rates=rates, slowdowns=slowdowns)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
