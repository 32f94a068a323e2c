"""Model-state bytes per rank: weights, gradients, optimizer state (ZeRO, Rajbhandari et al. 2020).

One formula, :func:`model_states_per_rank`: weights, gradients and optimizer state of one rank for
a ZeRO stage (:data:`ZERO_STAGES`: 0 = plain DDP all-reduce, 1, 2, 3; FSDP full shard = stage 3), a
precision (:data:`PRECISIONS`) and an accounting (:data:`ACCOUNTINGS`): ``paper`` (ZeRO §3.1 and
§5, Fig. 1) or ``master_copy`` (what DeepSpeed's ZeRO optimizers allocate: an fp32 master copy in
every precision, the fp32 copy of the gradient partition in mixed precision). The planner prices
with it (TP shards the block matrices, PP gives a rank ``ceil(L/p)`` layers: :func:`stage_params`),
and the plugins' exact figures for a live run (:func:`replicated_adamw_model_states_bytes`,
:func:`zero_model_states_bytes`, :func:`fsdp_model_states_bytes`, :func:`adamw_fp32_local_states_bytes`,
measured equal to torch's storages in the tests) call it too, adding what only a live run has
(AdamW's per-tensor step counters, FSDP's padded shards).

Precision (:data:`PRECISIONS`): ``fp32`` keeps 4 B weights, 4 B gradients, 8 B AdamW moments
(16 B/param, trainlab's CPU runs); ``bf16`` (mixed precision with fp32 master weights, ZeRO §3.1)
keeps 2 B weights, 2 B gradients and K = 12 B of optimizer state (fp32 master + two moments):
``(2 + 2 + 12)·Ψ = 16Ψ``. Megatron's fp32 main-grad buffer (~18 B/param) is ``bf16_main_grad``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from framework.base.cost.comm import ModelStats, fsdp_padded_numel

# --- the plugins' figures (each one the planner's breakdown, :func:`model_states_per_rank`) ---


def precision_of(stats: ModelStats) -> str:
    """The :data:`PRECISIONS` name of a live run's parameters: 4-byte parameters ``fp32`` (trainlab's
    CPU runs, and Lightning's ``bf16-mixed`` autocast, which keeps fp32 parameters), 2-byte ``bf16``
    (DeepSpeed's ``bf16``/``fp16`` sections cast the model; fp32 master in the optimizer).

    Raises:
        ValueError: any other parameter size.
    """
    names = {4: "fp32", 2: "bf16"}
    if stats.param_bytes not in names:
        raise ValueError(f"param_bytes={stats.param_bytes} has no precision; allowed: 4 (fp32), 2 (bf16)")
    return names[stats.param_bytes]


def replicated_adamw_model_states_bytes(stats: ModelStats) -> int:
    """Model-state bytes of a rank holding a full replica trained with torch's AdamW (single, DDP).

    :func:`model_states_per_rank` at ZeRO stage 0 in the paper's accounting (``fp32``: 4 + 4 + 8
    = 16 B/param), plus torch's one fp32 ``step`` counter per parameter tensor (4 bytes each).
    """
    st = model_states_per_rank(stats.num_params, dp=1, zero_stage=0, precision=precision_of(stats))
    return int(st.total) + 4 * stats.num_param_tensors


def zero_model_states_bytes(stats: ModelStats, *, zero_stage: int, dp_degree: int, grad_accum_steps: int) -> int:
    """DeepSpeed ZeRO model-state bytes of one rank (``plugins/deepspeed/cost.py`` table):
    :func:`model_states_per_rank` with ``accounting="master_copy"`` in the parameters' precision
    (:func:`precision_of`). AdamW's step counters and partition padding are left out.

    Raises:
        ValueError: ``zero_stage`` not in 0-3, or parameters neither 4 nor 2 bytes.
    """
    st = model_states_per_rank(
        stats.num_params,
        dp=dp_degree,
        zero_stage=zero_stage,
        precision=precision_of(stats),
        accounting="master_copy",
        grad_accum_steps=grad_accum_steps,
    )
    return int(st.total)


def fsdp_model_states_bytes(stats: ModelStats, *, dp_degree: int) -> int:
    """FSDP2 (ZeRO-3): :func:`model_states_per_rank` of ``Ψ_shard`` at stage 3 and ``dp = 1`` (the
    shard is already divided) + 4 B per tensor; ``Ψ_shard`` the largest rank's elements
    (``ceil(d0/dp)`` rows of every parameter, :func:`~framework.base.cost.comm.fsdp_padded_numel`).
    FSDP2 keeps the parameters' dtype for weights, gradients and AdamW moments (paper accounting)."""
    shard = fsdp_padded_numel(stats, dp_degree) // dp_degree
    st = model_states_per_rank(shard, dp=1, zero_stage=0, precision=precision_of(stats))
    return int(st.total) + 4 * stats.num_param_tensors


def adamw_fp32_local_states_bytes(local_shapes: list[tuple[int, ...]]) -> int:
    """fp32 weights + gradients + AdamW moments of the tensors a rank holds (:func:`model_states_per_rank`,
    stage 0, ``fp32``: 16 B/element, ZeRO §3.1) plus AdamW's 4-byte step counter per tensor (the megatron plugin's figure)."""
    n = sum(math.prod(s) for s in local_shapes)
    return int(model_states_per_rank(n, dp=1, zero_stage=0, precision="fp32").total) + 4 * len(local_shapes)


# --- the planner's breakdown -----------------------------------------------------------------


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter element of each model state.

    Attributes:
        weight_bytes: the weights the model computes with.
        grad_bytes: gradients (accumulation buffer).
        optimizer_bytes: optimizer state K (AdamW: 8 = two moments; + 4 for an fp32 master copy).
    """

    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision(4, 4, 8),  # trainlab's CPU runs: fp32 weights, grads, AdamW moments
    "bf16": Precision(2, 2, 12),  # ZeRO §3.1 mixed precision: (2 + 2 + K)Ψ, K = 12 (fp32 master + moments)
    "bf16_main_grad": Precision(2, 4, 12),  # Megatron: bf16 weights, fp32 main grads, fp32 master + moments (18 B)
}

ZERO_STAGES = (0, 1, 2, 3)
"""ZeRO stages (Rajbhandari et al. 2020 §5): what the dp group shards. 0: nothing (DDP, one
gradient all-reduce); 1: optimizer state (ZeRO-1 / Megatron distributed optimizer); 2: + gradients;
3: + weights (FSDP full shard)."""


def is_zero_stage(value) -> bool:
    """Whether ``value`` is an int (not a bool) in :data:`ZERO_STAGES`."""
    return isinstance(value, int) and not isinstance(value, bool) and value in ZERO_STAGES


def zero_label(zero_stage: int) -> str:
    """Short name of a ZeRO stage for labels and reports: ``none`` (stage 0), ``zero1`` .. ``zero3``."""
    return f"zero{zero_stage}" if zero_stage else "none"


@dataclass(frozen=True)
class StateBytes:
    """Model-state bytes of one rank, by part."""

    weights: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        """Sum of the parts (bytes)."""
        return self.weights + self.grads + self.optimizer


def stage_layers(n_layer: int, pp: int) -> int:
    """Layers of the busiest pipeline stage: ``ceil(L/p)`` (uneven splits put the remainder on some stages)."""
    return -(-n_layer // pp)


def stage_params(shape, *, tp: int, pp: int, stage: int) -> float:
    """Parameters one rank of pipeline ``stage`` (of ``pp``) holds under TP degree ``tp``.

    Layers ``ceil(L/p)`` (:func:`stage_layers`) (:meth:`ModelShape.layer_params`); the first stage adds the token (and
    position) embedding, vocab-parallel over ``tp``; the last stage the final norm and the
    output head (a tied head is a second copy of the embedding there when ``pp > 1``, as in
    Megatron and trainlab's pipeline).
    """
    sharded, replicated = shape.layer_params(tp)
    n = stage_layers(shape.n_layer, pp) * (sharded + replicated)
    if stage == 0:
        n += shape.embedding_params() / tp
    if stage == pp - 1:
        n += shape.head_params() - (0 if shape.tied_embeddings else shape.vocab_size * shape.d_model)
        if not shape.tied_embeddings or pp > 1:
            n += shape.vocab_size * shape.d_model / tp
    return n


ACCOUNTINGS = ("paper", "master_copy")
"""How model states are counted (:func:`model_states_per_rank`): ``paper`` is ZeRO §3.1 / §5 Fig. 1
(Rajbhandari et al. 2020); ``master_copy`` what DeepSpeed 0.19's ZeRO optimizers allocate."""


def model_states_per_rank(
    psi_local: float, *, dp: int, zero_stage: int, precision: str, accounting: str = "paper", grad_accum_steps: int = 1
) -> StateBytes:
    """Bytes of weights, gradients and optimizer state of one rank holding ``psi_local`` parameters
    replicated over ``dp`` ranks, with ZeRO stage ``zero_stage`` (:data:`ZERO_STAGES`) and ``precision``
    (:data:`PRECISIONS`: weight bytes w, gradient bytes g, optimizer bytes K). Ψ = ``psi_local``, N = ``dp``.

    ``accounting="paper"`` (ZeRO §3.1 and §5, Fig. 1): weights ``wΨ`` (``/N`` from stage 3),
    gradients ``gΨ`` (``/N`` from stage 2), optimizer ``KΨ`` (``/N`` from stage 1). bf16: stage 1
    ``2Ψ + 2Ψ + 12Ψ/N``, stage 2 ``2Ψ + 14Ψ/N``, stage 3 ``16Ψ/N``; fp32 (K = 8, AdamW moments, no
    master copy): 16Ψ, ``8Ψ + 8Ψ/N``, ``4Ψ + 12Ψ/N``, ``16Ψ/N``.

    ``accounting="master_copy"`` (DeepSpeed 0.19, ``runtime/zero/stage_1_and_2.py``, ``stage3.py``,
    ``runtime/bf16_optimizer.py``): in every stage >= 1 an fp32 master copy of the rank's partition
    next to the model's own weights, so K = 4 + 8 = 12 even when the model is fp32; gradients in the
    weights' dtype: stage 1 full ``wΨ`` while micro-batches accumulate (``grad_accum_steps > 1``),
    else only this rank's partition ``wΨ/N`` outlives backward; stage 2 the partition ``wΨ/N``
    (``grads_in_partition``); stage 3 ``wΨ/N``. Stage 0: fp32 is torch's AdamW on the model
    (``4Ψ + 4Ψ + 8Ψ``); bf16 is DeepSpeed's ``BF16_Optimizer``: bf16 weights and gradients, a full
    fp32 gradient accumulation buffer (``+4Ψ``) and fp32 master + moments of the partition
    (``12Ψ/N``; read from the source, not measured here). Measured on 2 CPU ranks with
    ``bf16-mixed`` (the model states between steps, ``mem/model_states_bytes``): ZeRO-1 (a = 2)
    ``10.0Ψ``, ZeRO-2 ``9.1Ψ``, ZeRO-3 ``8.0Ψ`` against ``10Ψ``, ``9Ψ``, ``8Ψ`` here. Not counted:
    the transient fp32 copy of the gradient partition the optimizer step makes in mixed precision
    (``flat_grad_partition.to(fp32)``, ``4Ψ/N``, freed within the step).

    Neither counts the reduce bucket (DeepSpeed ``reduce_bucket_size``), AdamW's step counters or padding.

    Raises:
        ValueError: ``zero_stage`` not in :data:`ZERO_STAGES`, unknown ``precision`` or ``accounting``,
            ``dp`` or ``grad_accum_steps`` < 1.
    """
    if not is_zero_stage(zero_stage):
        raise ValueError(f"zero_stage={zero_stage!r} is not allowed; allowed: {', '.join(map(str, ZERO_STAGES))}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not allowed; allowed: {', '.join(PRECISIONS)}")
    if accounting not in ACCOUNTINGS:
        raise ValueError(f"accounting={accounting!r} is not allowed; allowed: {', '.join(ACCOUNTINGS)}")
    if dp < 1 or grad_accum_steps < 1:
        raise ValueError(f"dp={dp} and grad_accum_steps={grad_accum_steps} must be >= 1")
    p = PRECISIONS[precision]
    if accounting == "paper":
        opt = p.optimizer_bytes * psi_local / (dp if zero_stage >= 1 else 1)
        grads = p.grad_bytes * psi_local / (dp if zero_stage >= 2 else 1)
        weights = p.weight_bytes * psi_local / (dp if zero_stage >= 3 else 1)
        return StateBytes(weights=weights, grads=grads, optimizer=opt)
    w = p.weight_bytes
    if zero_stage == 0:
        if w >= 4:
            return StateBytes(weights=4.0 * psi_local, grads=4.0 * psi_local, optimizer=8.0 * psi_local)
        return StateBytes(weights=w * psi_local, grads=(w + 4.0) * psi_local, optimizer=12.0 * psi_local / dp)
    weights = w * psi_local / (dp if zero_stage >= 3 else 1)
    full_grads = zero_stage == 1 and grad_accum_steps > 1
    grads = w * psi_local / (1 if full_grads else dp)
    return StateBytes(weights=weights, grads=grads, optimizer=12.0 * psi_local / dp)
