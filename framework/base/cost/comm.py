"""Closed-form communication volumes per optimizer step: the plugins' ``comm_volume`` and the planner.

Every communication formula of the cost model is here: ring bytes on the wire
(:func:`ring_wire_bytes`), the collectives each ZeRO stage runs on the dp group
(:func:`dp_collectives`) and the TP collectives per layer (:func:`tp_calls_per_microbatch`). The
plugins' per-kind payloads (below) and the planner's per-call, per-link list of a layout
(:func:`framework.base.cost.collectives.layout_collectives`) are both sums over these; only the
implementation choice differs, and it is an argument: how a stage 1/2 reduces gradients
(``grad_reduce``: the paper's and Megatron's reduce-scatter, DeepSpeed's bucketed all-reduce).

A plugin states what it *should* communicate with ``comm_volume(stats, resolved) ->
CommEstimate``; :class:`~framework.rank.callbacks.breakdown.StepBreakdown` logs that next to what
its collectives actually carried (``perf/comm_bytes_model`` vs ``perf/comm_bytes``).

Two byte counts, both per rank per optimizer step (docs/references.md §3, nccl-tests
PERFORMANCE.md):

- **payload**: the size S of the buffers handed to the collectives (what ``perf/comm_bytes``
  measures: the sum of the tensors passed in);
- **ring bytes on the wire**: what a ring algorithm sends per rank, ``2(n-1)/n * S`` for an
  all-reduce and ``(n-1)/n * S`` for an all-gather or reduce-scatter of S total bytes, n the
  ranks of that collective's group (:attr:`CommEstimate.group_sizes`: one size per kind; a
  1-rank group sends nothing). ``perf/comm_bytes_wire`` applies these factors to the measured
  payload of each kind, ``perf/comm_bytes_wire_model`` to the modelled one.

DDP (Li et al. 2020; ZeRO §7.1): one all-reduce of all gradients per optimizer step (not per
micro-batch: ``no_sync`` skips it during accumulation), payload ``Psi * bytes_per_grad``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

KINDS = ("allreduce", "allgather", "reduce_scatter", "reduce", "broadcast", "p2p")


@dataclass(frozen=True)
class ModelStats:
    """What the cost models need to know about the model a rank trains.

    Attributes:
        num_params: trainable parameters Psi (elements; a tied weight counted once).
        num_param_tensors: trainable parameter tensors (AdamW keeps one step counter per tensor).
        param_bytes: bytes per parameter element (4 for fp32 master weights).
        grad_bytes: bytes per gradient element (the gradient dtype; 4 in fp32).
        param_shapes: the full (unsharded) shape of each trainable parameter tensor, in the
            module's order (a tied weight once); empty when unknown. A sharded plugin models
            its padding from them (:func:`dim0_sharded_numel`).
    """

    num_params: int
    num_param_tensors: int
    param_bytes: int = 4
    grad_bytes: int = 4
    param_shapes: tuple[tuple[int, ...], ...] = ()


def dim0_sharded_numel(shapes: tuple[tuple[int, ...], ...], n: int) -> int:
    """Elements of one rank's padded shards when every tensor of ``shapes`` is split on dim 0 over ``n`` ranks.

    FSDP2 (``fully_shard``) gives each rank ``ceil(d0 / n)`` rows of a ``d0 x ...`` parameter,
    padding the last ranks' shards with zeros, and its all-gathers and reduce-scatters move the
    padded shards: ``sum ceil(d0 / n) * prod(rest)`` elements per rank (``n`` times that
    gathered). A 0-d tensor counts as one row.

    Raises:
        ValueError: ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"n={n} ranks must be >= 1")
    return sum(-(-(s[0] if s else 1) // n) * math.prod(s[1:]) for s in shapes)


def ring_wire_bytes(kind: str, payload_bytes: float, n: int) -> float:
    """Bytes one rank sends for a ring collective of ``payload_bytes`` over ``n`` ranks.

    all-reduce ``2(n-1)/n * S``; all-gather / reduce-scatter ``(n-1)/n * S`` (S = the full
    gathered / reduced size); reduce / broadcast of S bytes ``(n-1)/n * S`` (a pipelined chain:
    every rank but one forwards S, averaged over the n ranks); p2p ``S``. Source: nccl-tests PERFORMANCE.md (bus bandwidth).

    Raises:
        ValueError: unknown ``kind`` or ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"n={n} ranks must be >= 1")
    if kind == "allreduce":
        return 2.0 * (n - 1) / n * payload_bytes
    if kind in ("allgather", "reduce_scatter", "reduce", "broadcast"):
        return (n - 1) / n * payload_bytes
    if kind == "p2p":
        return float(payload_bytes)
    raise ValueError(f"kind={kind!r} is not a collective kind; allowed: {', '.join(KINDS)}")


@dataclass(frozen=True)
class CommEstimate:
    """Modelled communication of one rank in one optimizer step.

    Attributes:
        payload_bytes: bytes handed to collectives, by kind (keys from :data:`KINDS`).
        group_size: ranks in the collectives' group (n in the ring formulas), for every kind
            not in ``group_sizes``.
        group_sizes: the group size of a kind whose collectives run on another group (e.g. a
            TP group for TP all-reduces, the dp group for FSDP's all-gathers); measured wire
            bytes use the same sizes (:meth:`wire_bytes`).
    """

    payload_bytes: dict[str, int] = field(default_factory=dict)
    group_size: int = 1
    group_sizes: dict[str, int] = field(default_factory=dict)

    def group_size_of(self, kind: str) -> int:
        """Ranks in the group of ``kind``'s collectives: ``group_sizes[kind]``, else ``group_size``."""
        return self.group_sizes.get(kind, self.group_size)

    def wire_bytes(self, payload_by_kind: dict[str, float]) -> float:
        """Ring bytes on the wire per rank for ``payload_by_kind`` (payload bytes by kind, modelled or
        measured), each kind on its own group (:meth:`group_size_of`, :func:`ring_wire_bytes`).

        Raises:
            ValueError: a kind not in :data:`KINDS`.
        """
        # summed in kind order, so equal payloads give bitwise equal figures (measured vs modelled)
        return sum(ring_wire_bytes(k, payload_by_kind[k], self.group_size_of(k)) for k in sorted(payload_by_kind))

    @property
    def total_payload_bytes(self) -> int:
        """Payload bytes summed over kinds."""
        return int(sum(self.payload_bytes.values()))

    @property
    def total_wire_bytes(self) -> float:
        """Modelled ring bytes on the wire per rank, summed over kinds (:meth:`wire_bytes`)."""
        return self.wire_bytes(self.payload_bytes)


ZERO3_COLLECTIVES = ("zero3_fwd", "zero3_bwd", "zero3_grad")
"""Names of ZeRO stage 3's per-micro-batch collectives (forward gather, backward gather, gradient
reduce-scatter), the ones its prefetch overlaps with compute (:func:`~framework.base.cost.steptime.step_time`)."""

GRAD_REDUCE = ("reduce_scatter", "allreduce")
"""How ZeRO stages 1 and 2 reduce the gradients (:func:`dp_collectives`): ``reduce_scatter`` (ZeRO §7.1,
Megatron's distributed optimizer: each rank receives its partition) or ``allreduce`` (DeepSpeed 0.19's
bucketed all-reduce, each rank keeping its partition: ``use_multi_rank_bucket_allreduce``)."""


@dataclass(frozen=True)
class DPCollective:
    """One collective the dp group runs for a ZeRO stage (:func:`dp_collectives`).

    Attributes:
        name: ``dp_grad``, ``dp_param`` or one of :data:`ZERO3_COLLECTIVES`.
        kind: a :data:`KINDS` entry.
        tensor: what it moves: ``grads`` (Ψ gradient elements) or ``params`` (Ψ weight elements).
        per_microbatch: it runs on every micro-batch (else once per optimizer step).
    """

    name: str
    kind: str
    tensor: str
    per_microbatch: bool


def dp_collectives(
    zero_stage: int, *, grad_reduce: str = "reduce_scatter", keeps_gathered: bool = False
) -> tuple[DPCollective, ...]:
    """The collectives a rank's dp group runs per optimizer step for ZeRO stage ``zero_stage`` (ZeRO §7; each
    moves all Ψ elements of ``tensor``; payload convention as :func:`ring_wire_bytes`).

    Stage 0: one all-reduce of the gradients per step (DDP; ``no_sync`` during accumulation). Stage 1:
    the gradients reduced once per step (``grad_reduce``) and the updated weights all-gathered. Stage 2:
    the gradient reduction on every micro-batch, the weights' all-gather once. Stage 3, per micro-batch:
    an all-gather of the weights for forward, another for backward unless ``keeps_gathered`` (parameters
    kept from forward to backward), and a reduce-scatter of the gradients (§7.2).

    Raises:
        ValueError: ``zero_stage`` not in 0-3, or ``grad_reduce`` not in :data:`GRAD_REDUCE`.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage} is not allowed; allowed: 0, 1, 2, 3")
    if grad_reduce not in GRAD_REDUCE:
        raise ValueError(f"grad_reduce={grad_reduce!r} is not allowed; allowed: {', '.join(GRAD_REDUCE)}")
    if zero_stage == 0:
        return (DPCollective("dp_grad", "allreduce", "grads", False),)
    if zero_stage in (1, 2):
        return (
            DPCollective("dp_grad", grad_reduce, "grads", zero_stage == 2),
            DPCollective("dp_param", "allgather", "params", False),
        )
    fwd, bwd, grad = ZERO3_COLLECTIVES
    gathers = (DPCollective(fwd, "allgather", "params", True),) + (
        () if keeps_gathered else (DPCollective(bwd, "allgather", "params", True),)
    )
    return gathers + (DPCollective(grad, "reduce_scatter", "grads", True),)


def dp_payload_bytes(
    calls: tuple[DPCollective, ...], *, params_bytes: int, grads_bytes: int, grad_accum_steps: int
) -> dict[str, int]:
    """Payload bytes per optimizer step by kind of the dp collectives ``calls``: each moves ``params_bytes`` or
    ``grads_bytes`` (all Ψ elements), ``grad_accum_steps`` times when it runs per micro-batch."""
    out: dict[str, int] = {}
    for c in calls:
        size = params_bytes if c.tensor == "params" else grads_bytes
        out[c.kind] = out.get(c.kind, 0) + size * (grad_accum_steps if c.per_microbatch else 1)
    return out


def ddp_comm_volume(stats: ModelStats, dp_degree: int) -> CommEstimate:
    """DDP: one all-reduce of every gradient per optimizer step; nothing when ``dp_degree == 1``."""
    if dp_degree <= 1:
        return CommEstimate(group_size=1)
    payload = dp_payload_bytes(
        dp_collectives(0),
        params_bytes=stats.num_params * stats.param_bytes,
        grads_bytes=stats.num_params * stats.grad_bytes,
        grad_accum_steps=1,
    )
    return CommEstimate(payload_bytes=payload, group_size=dp_degree)


def fsdp_padded_numel(stats: ModelStats, n: int) -> int:
    """Ψ as FSDP2 moves it over ``n`` ranks: ``n`` x one rank's dim-0-padded shard elements
    (without ``stats.param_shapes``: as if the parameters were one flat tensor of Ψ elements)."""
    return n * dim0_sharded_numel(stats.param_shapes or ((stats.num_params,),), n)


def fsdp_comm_volume(
    stats: ModelStats, *, dp_degree: int, grad_accum_steps: int, reshard_after_forward: bool
) -> CommEstimate:
    """FSDP2 / ZeRO-3 payload bytes per rank per optimizer step on the dp group (ZeRO §7.2; :func:`dp_collectives` stage 3).

    Every micro-batch all-gathers the full parameters for forward (Ψ) and, with
    ``reshard_after_forward``, again for backward (Ψ: 3Ψ per micro-batch with the reduce-scatter,
    2Ψ without), and reduce-scatters the full gradients (Ψ); FSDP2 reduces on each backward, so
    all of it repeats ``grad_accum_steps`` times. Ψ is FSDP2's padded size
    (:func:`fsdp_padded_numel`). All-gather payload = the gathered size, reduce-scatter = the input.
    """
    n = dp_degree
    if n <= 1:
        return CommEstimate(group_size=1)
    psi = fsdp_padded_numel(stats, n)
    payload = dp_payload_bytes(
        dp_collectives(3, keeps_gathered=not reshard_after_forward),
        params_bytes=psi * stats.param_bytes,
        grads_bytes=psi * stats.grad_bytes,
        grad_accum_steps=grad_accum_steps,
    )
    return CommEstimate(payload_bytes=payload, group_size=n)


def zero_comm_volume(
    stats: ModelStats, *, zero_stage: int, dp_degree: int, grad_accum_steps: int, stage3_keeps_gathered: bool = False
) -> CommEstimate:
    """DeepSpeed ZeRO payload bytes per rank per optimizer step, by collective, on the dp group
    (:func:`dp_collectives` with DeepSpeed's ``grad_reduce="allreduce"``).

    Stage 0: all-reduce of the gradients (Ψ·grad_bytes, once per step). Stage 1: that all-reduce
    at the boundary + an all-gather of the updated parameters. Stage 2: the all-reduce on every
    micro-batch (DeepSpeed's bucketed all-reduce, not the paper's reduce-scatter) + the
    all-gather. Stage 3: per micro-batch an all-gather for forward and (unless
    ``stage3_keeps_gathered``) again for backward, and a reduce-scatter of the gradients
    (ZeRO §7.2; DeepSpeed's behaviour as measured in ``plugins/deepspeed``).

    Raises:
        ValueError: ``zero_stage`` not in 0-3.
    """
    calls = dp_collectives(
        zero_stage, grad_reduce="allreduce", keeps_gathered=stage3_keeps_gathered
    )  # ValueError first
    if dp_degree <= 1:
        return CommEstimate(group_size=1)
    payload = dp_payload_bytes(
        calls,
        params_bytes=stats.num_params * stats.param_bytes,
        grads_bytes=stats.num_params * stats.grad_bytes,
        grad_accum_steps=grad_accum_steps,
    )
    return CommEstimate(payload_bytes=payload, group_size=dp_degree)


# --- Tensor and pipeline parallelism (plugins/megatron) ---------------------------------------


def tp_calls_per_microbatch(*, n_layer: int, recompute: str = "none") -> tuple[int, int]:
    """``(forward, backward)`` TP collectives one rank runs per micro-batch (Shoeybi et al. 2019 Fig. 4;
    Narayanan et al. 2021 §3.2): per layer two in forward (after the attention and MLP row-parallel
    projections) and two in backward (the column-parallel inputs' gradients), each of the ``b·s·h``
    activations; ``recompute="full"`` runs the forward's again in backward (Megatron recomputes the whole
    layer). Each is an all-reduce, or with sequence parallelism an all-gather + a reduce-scatter
    (Korthikanti et al. 2022 §4.2.2)."""
    return 2 * n_layer * (2 if recompute == "full" else 1), 2 * n_layer


def tp_payload_bytes_per_microbatch(
    *,
    micro_batch_size: int,
    seq_len: int,
    d_model: int,
    n_layer: int,
    tp: int,
    sequence_parallel: bool,
    elem_bytes: int = 4,
) -> dict[str, int]:
    """Tensor-parallel payload bytes one rank hands to collectives for one micro-batch (forward + backward).

    Megatron-LM (Shoeybi et al. 2019, Fig. 4; Narayanan et al. 2021 §3.2; :func:`tp_calls_per_microbatch`): per
    layer two all-reduces of the ``b·s·h`` activations in forward and two in backward:
    ``4·L·b·s·h`` elements. With sequence parallelism (Korthikanti et al. 2022 §4.2.2) each
    all-reduce becomes an all-gather + a reduce-scatter of the same ``b·s·h`` payload: ``4·L``
    of each, plus two all-gathers at the ends of the sequence-sharded region in trainlab's GPT
    (the embedding output's gradient into block 0, the last block's output into the replicated
    ``ln_f`` and head). Payload convention as :func:`ring_wire_bytes` (all-gather: the gathered
    size). The payload per rank does not depend on ``tp``; the ring bytes on the wire do.
    """
    if tp <= 1:
        return {}
    act = micro_batch_size * seq_len * d_model * elem_bytes
    calls = sum(tp_calls_per_microbatch(n_layer=n_layer))
    if not sequence_parallel:
        return {"allreduce": calls * act}
    return {"allgather": (calls + 2) * act, "reduce_scatter": calls * act}


def pp_p2p_bytes_per_step(
    *,
    stage_ids: list[int],
    num_stages: int,
    n_microbatches: int,
    micro_batch_size: int,
    seq_len: int,
    d_model: int,
    tp: int = 1,
    elem_bytes: int = 4,
) -> int:
    """Point-to-point bytes one pipeline rank *sends* per optimizer step.

    Narayanan et al. 2021 §3.2: per micro-batch and stage boundary, ``b·s·h`` activations
    forward and the same gradient backward. A rank holding stages ``stage_ids`` (of
    ``num_stages``; several with interleaving, which multiplies the p2p volume by ``v``, §2.2.2)
    sends forward from every stage but the last and backward from every stage but the first.
    Without the scatter/gather optimisation each TP rank sends the full ``b·s·h`` (``tp``
    does not divide it).
    """
    sends = sum((k != num_stages - 1) + (k != 0) for k in stage_ids)
    return sends * n_microbatches * micro_batch_size * seq_len * d_model * elem_bytes


def sp_norm_grad_allreduce_bytes(*, n_layer: int, d_model: int, bias: bool, elem_bytes: int = 4) -> int:
    """All-reduce payload per optimizer step for the LayerNorm gradients under sequence parallelism.

    Each TP rank normalises only its slice of the sequence, so the gradients of the replicated
    ``ln_1``/``ln_2`` weights (and biases) are partial sums; they are all-reduced once per step
    (after accumulation): ``L · 2 · (h + h·bias)`` elements (Korthikanti et al. 2022 §4.2.2).
    """
    return n_layer * 2 * (d_model + (d_model if bias else 0)) * elem_bytes
