"""Step time of a layout: compute at an achievable rate, collectives by an alpha-beta model on
their link, the pipeline bubble with a per-micro-batch hand-off, and what overlaps what.

**Collective time** (Hockney's alpha-beta model; bus-bandwidth factors of nccl-tests
PERFORMANCE.md): ``t = alpha·steps + wire_bytes / bandwidth``, with ``wire_bytes`` the ring
bytes one rank sends (:func:`~framework.base.cost.comm.ring_wire_bytes`: all-reduce ``2(n-1)/n·S``,
all-gather / reduce-scatter ``(n-1)/n·S``, p2p ``S``) and ``steps`` the ring's latency steps
(all-reduce ``2(n-1)``, all-gather / reduce-scatter ``n-1``, p2p 1), or ``2·log2 n`` for
an all-reduce with ``allreduce_algorithm = "tree"`` (NCCL's tree, same bus bandwidth). The
link is NVLink inside a node and the NIC between nodes (per GPU, per direction).

**Compute**: hardware FLOPs of the rank (:func:`~framework.base.cost.flops.hardware_flops_per_token`
divided over ``tp·pp``) at ``cluster.achievable_flops``; forward is a third of the model FLOPs,
backward two thirds plus any recomputed forward.

**Overlap** (every one a parameter of :class:`StepTimeParams`):

- TP collectives are exposed (``tp_overlap = 0``: Megatron's TP all-reduces sit between the GEMMs
  that need them).
- PP: each micro-batch slot pays a hand-off, the p2p of its activations forward and its gradient
  backward (``pp_handoff_exposed = 1``: blocking send/recv between the stages' compute), and the
  schedule's bubble ``(p-1)/v`` slots (Narayanan et al. 2021 §2.2).
- DP gradient reduction overlaps the backward of the last micro-batch except the last bucket
  (``dp_overlap = 1``, ``bucket_bytes``; PyTorch DDP / Megatron ``overlap_grad_reduce``); ZeRO's
  parameter all-gather after the optimizer overlaps the next forward's first micro-batch
  (``param_gather_overlap = 1``).
- ZeRO-3 / FSDP: the gathers and the reduce-scatter of a micro-batch overlap its compute by
  prefetching the next unit (``zero3_prefetch = 1``); the first unit's gather is exposed.
- Optimizer: memory-bound: per parameter of its shard, the state ``optimizer_state_passes`` times
  plus the gradient read and the weight write, at HBM bandwidth.

Step time = pipeline (``m + (p-1)/v`` slots, each a micro-batch's compute + exposed TP + exposed
ZeRO-3 + hand-off; the ``(p-1)/v`` idle slots are reported as ``bubble``, the ``m`` busy ones by
part) + exposed DP + optimizer + the fixed framework overhead per step (``step_overhead_s``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from framework.base.cost.collectives import Collective, layout_collectives
from framework.base.cost.comm import ZERO3_COLLECTIVES
from framework.base.cost.flops import hardware_flops_per_token, op_sac_recompute_flops_per_token
from framework.base.cost.memory import PRECISIONS, stage_layers, stage_params


@dataclass(frozen=True)
class StepTimeParams:
    """Named assumptions of the step-time model (module docstring). Defaults are stated, not fitted.

    Attributes:
        tp_overlap: fraction of TP collective time hidden behind compute (0: all exposed).
        pp_handoff_exposed: fraction of each micro-batch's p2p hand-off on the critical path.
        dp_overlap: fraction of the last micro-batch's backward the DP gradient reduction can hide in.
        bucket_bytes: the last gradient bucket, never hidden (DDP ``bucket_cap_mb`` 25 MB).
        param_gather_overlap: fraction of the next step's first forward that hides ZeRO's parameter all-gather.
        zero3_prefetch: fraction of a micro-batch's compute that hides its ZeRO-3 gathers/reduce-scatter.
        optimizer_state_passes: how often the optimizer step moves its state through HBM (2: read and
            write master weights and moments); it also reads the gradient and writes the weight once.
        allreduce_algorithm: ``ring`` or ``tree`` latency for all-reduces.
        handoff_s: fixed cost per micro-batch hand-off between pipeline stages (s).
        microbatch_overhead_s: fixed cost of every micro-batch's forward + backward (s: kernel
            launches, framework hooks; 0 on a large GPU model, seconds' fractions on small CPU runs).
        step_overhead_s: framework time per optimizer step that neither FLOPs nor bytes account for
            (s: Python per op and per parameter, hooks, the loop; 0 on a large GPU model). On the local
            CPU it is measured per layout: a run of the same layout with a near-zero-FLOP model of the
            same depth (``benchmarks/cost_model_validation.py``, "framework overhead").
        replicated_head: the output projection (``h x V``) runs whole on every TP rank (trainlab's TP
            plugin) instead of split over the vocabulary (Megatron's vocab-parallel head, the default).
        elementwise_bytes_per_h: memory-bound (non-GEMM) traffic of one layer per token per unit of hidden
            size, forward + backward (bytes: norms, activation functions, softmax over FlashAttention's
            tiles, dropout, residual adds, casts), at HBM bandwidth, a third in forward; split over TP.
            What makes a small hidden size slower per FLOP: its ratio to the GEMMs' ``24·h²`` FLOPs per
            token per layer falls as ``1/h`` (and grows with ``peak_flops / hbm_bandwidth``: H100 > A100).
            CALIBRATED with the achievable fractions on the fit set of ``benchmarks/published_runs.py``;
            None = the cluster file's ``elementwise_bytes_per_h`` (0 when it has none).
        op_sac: ``recompute = selective`` is torchtitan's op-level selective checkpointing, which also
            recomputes every second matmul of a block in backward
            (:func:`~framework.base.cost.flops.op_sac_recompute_flops_per_token`), not only the attention core;
            the memory model keeps its saved set (:func:`~framework.base.cost.activations.activation_bytes_per_layer`).
        torch_cross_entropy: the loss is PyTorch's ``F.cross_entropy`` on fp32 logits (torchtitan's
            ``loss_fn``), which holds three fp32 copies of a micro-batch's logits at the start of backward;
            False: Megatron's fused vocab-parallel cross-entropy, one (memory only,
            :func:`~framework.base.cost.activations.activation_bytes_per_rank`).
    """

    tp_overlap: float = 0.0
    pp_handoff_exposed: float = 1.0
    dp_overlap: float = 1.0
    bucket_bytes: float = 25e6
    param_gather_overlap: float = 1.0
    zero3_prefetch: float = 1.0
    optimizer_state_passes: float = 2.0
    allreduce_algorithm: str = "ring"
    handoff_s: float = 0.0
    microbatch_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    replicated_head: bool = False
    elementwise_bytes_per_h: float | None = None
    op_sac: bool = False
    torch_cross_entropy: bool = False


def latency_steps(kind: str, n: int, algorithm: str = "ring") -> float:
    """Latency steps of a collective over ``n`` ranks (module docstring)."""
    if n <= 1:
        return 0.0
    if kind == "allreduce":
        return 2.0 * math.ceil(math.log2(n)) if algorithm == "tree" else 2.0 * (n - 1)
    if kind in ("allgather", "reduce_scatter"):
        return float(n - 1)
    return 1.0


def collective_link(c: Collective, cluster):
    """The :class:`~framework.base.cost.hardware.Link` a collective runs on: NVLink inside a node; between
    nodes the NIC, whose bus bandwidth a group with ``k = c.ranks_per_node`` members per node
    multiplies by ``k`` (NCCL runs ``k`` rings in parallel, each leaving the node on another GPU's NIC,
    so a node's ``k`` NICs carry the ring's inter-node hops: bus bandwidth ``min(k·nic, nvlink)``,
    nccl-tests PERFORMANCE.md). A p2p hand-off uses one NIC."""
    link = cluster.link(c.inter_node)
    k = getattr(c, "ranks_per_node", 1)
    if not c.inter_node or k <= 1 or c.kind == "p2p" or link.by_kind:
        return link
    from framework.base.cost.hardware import Link

    return Link(alpha_s=link.alpha_s, bandwidth=min(k * link.bandwidth, cluster.nvlink.bandwidth))


def collective_time(c: Collective, link, *, algorithm: str = "ring", payload_bytes: float | None = None) -> float:
    """Seconds of one call of ``c`` (or of ``payload_bytes`` of the same kind and group) on ``link``
    (a :class:`~framework.base.cost.hardware.Link`): ``alpha·steps + wire_bytes / bandwidth``."""
    from framework.base.cost.comm import ring_wire_bytes

    alpha, bw = link.params(c.kind)
    size = c.payload_bytes if payload_bytes is None else payload_bytes
    wire = ring_wire_bytes(c.kind, size, c.group_size)
    return alpha * latency_steps(c.kind, c.group_size, algorithm) + wire / bw


@dataclass(frozen=True)
class StepTime:
    """Modelled time of one optimizer step on the busiest rank, by component (seconds).

    ``forward``/``backward`` are the whole step's compute (all micro-batches, recompute in
    backward); ``bubble`` the ``(p-1)/v`` idle slots (each as long as a busy one: compute + exposed
    TP + ZeRO-3 + hand-off); ``overhead`` the fixed framework time per step
    (:attr:`StepTimeParams.step_overhead_s`); ``tp_exposed``, ``pp_handoff``, ``zero3_exposed`` those of the ``m`` busy slots; the ``*_exposed`` parts what overlap leaves on the
    critical path; ``comm_total`` every collective's time, exposed or not, by collective name.
    """

    forward: float
    backward: float
    bubble: float
    tp_exposed: float
    pp_handoff: float
    zero3_exposed: float
    dp_exposed: float
    optimizer: float
    overhead: float = 0.0
    comm_total: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        """Step time (s)."""
        return (
            self.forward
            + self.backward
            + self.bubble
            + self.tp_exposed
            + self.pp_handoff
            + self.zero3_exposed
            + self.dp_exposed
            + self.optimizer
            + self.overhead
        )

    def parts(self) -> dict[str, float]:
        """The exposed components, by name (sum = :attr:`total`)."""
        return {
            "forward": self.forward,
            "backward": self.backward,
            "bubble": self.bubble,
            "tp_exposed": self.tp_exposed,
            "pp_handoff": self.pp_handoff,
            "zero3_exposed": self.zero3_exposed,
            "dp_exposed": self.dp_exposed,
            "optimizer": self.optimizer,
            "overhead": self.overhead,
        }


def step_time(
    shape, lay, cluster, params: StepTimeParams = StepTimeParams(), colls: list[Collective] | None = None
) -> StepTime:
    """Modelled step time of ``lay`` (:class:`~framework.base.cost.layout.PlanLayout`) for ``shape`` on ``cluster``."""
    colls = layout_collectives(shape, lay, cluster.gpus_per_node) if colls is None else colls
    m, p, v = lay.n_microbatches, lay.pp, lay.v
    tokens_mb = lay.micro_batch_size * shape.seq_len
    model_fpt = hardware_flops_per_token(shape, "none")
    hw_fpt = hardware_flops_per_token(shape, lay.recompute)
    rate = cluster.achievable_flops
    imbalance = stage_layers(shape.n_layer, p) * p / shape.n_layer  # the busiest stage's share of the layers, x p
    t_f = model_fpt / 3 * tokens_mb * imbalance / (lay.tp * p) / rate  # one micro-batch's forward on this rank
    if params.op_sac and lay.recompute == "selective":
        hw_fpt += op_sac_recompute_flops_per_token(shape)
    t_b = (2 * model_fpt / 3 + (hw_fpt - model_fpt)) * tokens_mb * imbalance / (lay.tp * p) / rate
    ew = params.elementwise_bytes_per_h
    ew = getattr(cluster, "elementwise_bytes_per_h", 0.0) if ew is None else ew
    if ew:  # memory-bound work per layer (StepTimeParams.elementwise_bytes_per_h)
        passes = 4 / 3 if lay.recompute == "full" else 1.0  # full recompute runs the forward third twice
        t_ew = ew * shape.d_model * tokens_mb * stage_layers(shape.n_layer, p) / lay.tp / cluster.hbm_bandwidth
        t_f += t_ew / 3
        t_b += t_ew * (2 / 3 + passes - 1)
    if (
        params.replicated_head and lay.tp > 1
    ):  # the head's 2hV (forward) and 4hV (backward) FLOPs per token, not divided by t
        head = 2 * shape.d_model * shape.vocab_size * tokens_mb * (1 - 1 / lay.tp) / rate
        t_f += head
        t_b += 2 * head
    t_b += params.microbatch_overhead_s  # counted with backward (one fixed cost per micro-batch)
    slot = t_f + t_b

    def t(c: Collective) -> float:
        return collective_time(c, collective_link(c, cluster), algorithm=params.allreduce_algorithm)

    comm_total: dict[str, float] = {}
    for c in colls:
        comm_total[c.name] = comm_total.get(c.name, 0.0) + t(c) * c.calls
    tp_mb = sum(t(c) * c.calls for c in colls if c.group == "tp") / m
    z3 = [c for c in colls if c.name in ZERO3_COLLECTIVES]
    z3_mb = sum(t(c) * c.calls for c in z3) / m
    z3_fwd = ZERO3_COLLECTIVES[0]  # the forward gather: its first unit is exposed
    z3_first = sum(t(c) for c in z3 if c.name == z3_fwd)  # one call = one layer's gather (the first is never hidden)
    z3_exposed_mb = (max(0.0, z3_mb - params.zero3_prefetch * slot) + z3_first) if z3 else 0.0
    hop = sum(t(c) for c in colls if c.name in ("pp_fwd", "pp_bwd")) * v  # one slot's hand-offs (each chunk's)
    hop = params.pp_handoff_exposed * hop + (params.handoff_s if p > 1 else 0.0)
    tp_exposed_mb = (1 - params.tp_overlap) * tp_mb
    slots = m + ((p - 1) / v if p > 1 else 0.0)
    bubble_slots = slots - m

    dp_grad = [c for c in colls if c.name in ("dp_grad", "embed_grad") and not c.per_microbatch]
    t_grad = sum(t(c) * c.calls for c in dp_grad)
    dp_exposed = 0.0
    if t_grad > 0:
        last = min(params.bucket_bytes, max(c.payload_bytes for c in dp_grad))
        tail = max(
            collective_time(c, collective_link(c, cluster), algorithm=params.allreduce_algorithm, payload_bytes=last)
            for c in dp_grad
        )
        dp_exposed = max(t_grad - params.dp_overlap * t_b, tail)
    z2 = [
        c for c in colls if c.name == "dp_grad" and c.per_microbatch
    ]  # ZeRO-2: per micro-batch, overlapped with its backward
    if z2:
        t_z2 = sum(t(c) for c in z2)
        dp_exposed += m * max(t_z2 - params.dp_overlap * t_b, 0.0) + t_z2 / stage_layers(shape.n_layer, p)
    gather = sum(t(c) * c.calls for c in colls if c.name == "dp_param")
    dp_exposed += max(gather - params.param_gather_overlap * t_f, 0.0)

    prec = PRECISIONS[lay.precision]
    psi = stage_params(shape, tp=lay.tp, pp=p, stage=0)
    shard = lay.dp if lay.zero_stage >= 1 else 1
    touched = params.optimizer_state_passes * prec.optimizer_bytes + prec.grad_bytes + prec.weight_bytes
    optimizer = psi / shard * touched / cluster.hbm_bandwidth
    hop = hop if p > 1 else 0.0
    full_slot = slot + tp_exposed_mb + z3_exposed_mb + hop  # a micro-batch slot on the critical path
    return StepTime(
        forward=m * t_f,
        backward=m * t_b,
        bubble=bubble_slots * full_slot,
        tp_exposed=m * tp_exposed_mb,
        pp_handoff=m * hop,
        zero3_exposed=m * z3_exposed_mb,
        dp_exposed=dp_exposed,
        optimizer=optimizer,
        overhead=params.step_overhead_s,
        comm_total=comm_total,
    )


# --- what-if from a measured breakdown -------------------------------------------------------


@dataclass(frozen=True)
class MeasuredCollective:
    """A measured collective: total seconds per step, the phase it overlaps (``backward``,
    ``forward`` or None: exposed) and its ``tail_s`` that cannot overlap (the last bucket)."""

    name: str
    time_s: float
    overlaps: str | None = None
    tail_s: float = 0.0


@dataclass(frozen=True)
class MeasuredBreakdown:
    """A measured step (seconds): the serial phases and the collectives with their overlaps."""

    data_wait: float = 0.0
    forward: float = 0.0
    backward: float = 0.0
    optimizer: float = 0.0
    checkpoint_blocking: float = 0.0
    other: float = 0.0
    collectives: tuple[MeasuredCollective, ...] = ()

    def step_time(self) -> float:
        """Critical path: each phase lasts ``max(phase, overlapping comm - tails) + tails``; the
        exposed collectives add; data wait, optimizer and checkpoint blocking are serial."""
        total = self.data_wait + self.optimizer + self.checkpoint_blocking + self.other
        for phase in ("forward", "backward"):
            over = [c for c in self.collectives if c.overlaps == phase]
            hidden = sum(max(c.time_s - c.tail_s, 0.0) for c in over)
            total += max(getattr(self, phase), hidden) + sum(min(c.tail_s, c.time_s) for c in over)
        total += sum(c.time_s for c in self.collectives if c.overlaps is None)
        return total


def whatif(b: MeasuredBreakdown, delta_s: float = 1e-3) -> dict[str, float]:
    """Seconds a step gains when each component gets ``delta_s`` shorter (floored at 0), given what
    overlaps what: a serial part gains ``delta_s``; a collective hidden behind its phase gains
    nothing until it is the longer of the two; shortening a phase that a longer collective hides
    behind gains nothing (the collective becomes exposed instead). Keys: the phases and the
    collectives' names."""
    base = b.step_time()
    out: dict[str, float] = {}
    for k in ("data_wait", "forward", "backward", "optimizer", "checkpoint_blocking", "other"):
        out[k] = base - replace(b, **{k: max(getattr(b, k) - delta_s, 0.0)}).step_time()
    for i, c in enumerate(b.collectives):
        shorter = replace(c, time_s=max(c.time_s - delta_s, 0.0), tail_s=min(c.tail_s, max(c.time_s - delta_s, 0.0)))
        colls = b.collectives[:i] + (shorter,) + b.collectives[i + 1 :]
        out[c.name] = base - replace(b, collectives=colls).step_time()
    return out


def breakdown_from_metrics(m: dict, *, forward_share: float = 1 / 3) -> MeasuredBreakdown:
    """A :class:`MeasuredBreakdown` from a trainlab run's step-time breakdown metrics (seconds per step,
    ``framework/rank/callbacks/breakdown.py``; docs/metrics.md): ``perf/data_wait_s``, ``perf/compute_s``
    (split into forward and backward by ``forward_share``: the ``2N`` of ``6N``, an assumption),
    ``perf/optimizer_s``, ``perf/ckpt_blocking_s``, ``perf/other_s``, and the gradient
    communication as one collective overlapping backward: ``perf/comm_inflight_s`` long with the
    exposed ``perf/comm_s`` as its tail (the part from the last bucket's launch). Missing keys count 0;
    the ``_mean`` variants are used when the plain keys are absent.
    """

    def get(k: str) -> float:
        v = m.get(k, m.get(k.replace("_s", "_s_mean"), 0.0))
        return float(v or 0.0)

    compute, exposed = get("perf/compute_s"), get("perf/comm_s")
    inflight = max(get("perf/comm_inflight_s"), exposed)
    colls = (MeasuredCollective("dp_grad_reduction", inflight, "backward", tail_s=exposed),) if inflight > 0 else ()
    return MeasuredBreakdown(
        data_wait=get("perf/data_wait_s"),
        forward=forward_share * compute,
        backward=(1 - forward_share) * compute,
        optimizer=get("perf/optimizer_s"),
        checkpoint_blocking=get("perf/ckpt_blocking_s"),
        other=get("perf/other_s"),
        collectives=colls,
    )
