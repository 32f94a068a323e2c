"""Model-state bytes per rank: weights, gradients, optimizer state (ZeRO, Rajbhandari et al. 2020).

Two layers of functions:

- the plugins' exact figures for a live run (:func:`replicated_adamw_model_states_bytes`,
  :func:`zero_model_states_bytes`, :func:`fsdp_model_states_bytes`,
  :func:`adamw_fp32_local_states_bytes`), measured equal to torch's storages in the tests;
- the planner's breakdown for any layout (:func:`model_states_per_rank`): TP shards the block
  matrices, PP gives a rank ``L/p`` layers (+ embedding on the first stage, head on the last),
  the ZeRO stage of the dp group (:data:`ZERO_STAGES`: 0 = plain DDP all-reduce, 1, 2, 3; FSDP
  full shard = stage 3) divides optimizer state, then gradients, then weights by the dp degree
  (ZeRO §5, Fig. 1).

Precision (:data:`PRECISIONS`): ``fp32`` keeps 4 B weights, 4 B gradients, 8 B AdamW moments
(16 B/param, trainlab's CPU runs); ``bf16`` (mixed precision with fp32 master weights, ZeRO §3.1)
keeps 2 B weights, 2 B gradients and K = 12 B of optimizer state (fp32 master + two moments):
``(2 + 2 + 12)·Ψ = 16Ψ``. Megatron's fp32 main-grad buffer (~18 B/param) is ``bf16_main_grad``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from framework.cost.comm import ModelStats, fsdp_padded_numel


# --- the plugins' figures --------------------------------------------------------------------


def replicated_adamw_model_states_bytes(stats: ModelStats) -> int:
    """Model-state bytes of a rank holding a full replica trained with AdamW (single, DDP).

    ZeRO §3.1 counts ``(2 + 2 + K) * Psi`` for mixed-precision Adam (K = 12); here master
    weights and gradients are fp32 and AdamW keeps fp32 ``exp_avg`` and ``exp_avg_sq``, so
    ``param_bytes*Psi + grad_bytes*Psi + 8*Psi`` (= 16 bytes/param in fp32), plus torch's one
    fp32 ``step`` counter per parameter tensor (4 bytes each).
    """
    psi = stats.num_params
    return psi * stats.param_bytes + psi * stats.grad_bytes + 8 * psi + 4 * stats.num_param_tensors


def zero_model_states_bytes(stats: ModelStats, *, zero_stage: int, dp_degree: int, grad_accum_steps: int) -> int:
    """DeepSpeed ZeRO model-state bytes of one rank (fp32 training; ``plugins/deepspeed/cost.py`` table).

    DeepSpeed keeps an fp32 master copy of the rank's partition even for fp32 parameters, so
    the optimizer state is K = 12 B/param, partitioned from stage 1 on. Stage 0:
    ``4Ψ + 4Ψ + 8Ψ``; 1: ``4Ψ + 4Ψ + 12Ψ/N`` (full gradients between micro-batches when
    ``grad_accum_steps > 1``, else ``4Ψ/N``); 2: ``4Ψ + 4Ψ/N + 12Ψ/N``; 3: ``16Ψ/N``.

    Raises:
        ValueError: ``zero_stage`` not in 0-3.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage} is not allowed; allowed: 0, 1, 2, 3")
    psi, n, a = stats.num_params, dp_degree, grad_accum_steps
    p, g = stats.param_bytes * psi, stats.grad_bytes * psi
    if zero_stage == 0:
        return p + g + 8 * psi
    master = stats.param_bytes * psi  # DeepSpeed's fp32 master copy (K = 12 with AdamW's 8)
    optimizer = (master + 8 * psi) / n
    if zero_stage == 1:
        return int(p + (g if a > 1 else g / n) + optimizer)
    if zero_stage == 2:
        return int(p + g / n + optimizer)
    return int((p + g) / n + optimizer)


def fsdp_model_states_bytes(stats: ModelStats, *, dp_degree: int) -> int:
    """FSDP2 (ZeRO-3): ``(param_bytes + grad_bytes + 8)·Ψ_shard + 4·tensors``, ``Ψ_shard`` the
    largest rank's elements (``ceil(d0/dp)`` rows of every parameter, :func:`~framework.cost.comm.fsdp_padded_numel`)."""
    shard = fsdp_padded_numel(stats, dp_degree) // dp_degree
    return (stats.param_bytes + stats.grad_bytes + 8) * shard + 4 * stats.num_param_tensors


def adamw_fp32_local_states_bytes(local_shapes: list[tuple[int, ...]]) -> int:
    """fp32 weights + gradients + AdamW moments of the tensors a rank holds (16 B/element, ZeRO
    §3.1) plus AdamW's 4-byte step counter per tensor (the megatron plugin's figure)."""
    return 16 * sum(math.prod(s) for s in local_shapes) + 4 * len(local_shapes)


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


def model_states_per_rank(psi_local: float, *, dp: int, zero_stage: int, precision: str) -> StateBytes:
    """Bytes of weights, gradients and optimizer state of one rank holding ``psi_local`` parameters
    replicated over ``dp`` ranks, with ZeRO stage ``zero_stage`` (:data:`ZERO_STAGES`) and ``precision``
    (:data:`PRECISIONS`). ZeRO Fig. 1: stage 1 ``2Ψ + 2Ψ + KΨ/N``, stage 2 ``2Ψ + (2 + K)Ψ/N``,
    stage 3 ``(2 + 2 + K)Ψ/N`` (bf16).

    Raises:
        ValueError: ``zero_stage`` not in :data:`ZERO_STAGES` or unknown ``precision``.
    """
    if not is_zero_stage(zero_stage):
        raise ValueError(f"zero_stage={zero_stage!r} is not allowed; allowed: {', '.join(map(str, ZERO_STAGES))}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not allowed; allowed: {', '.join(PRECISIONS)}")
    p = PRECISIONS[precision]
    opt = p.optimizer_bytes * psi_local / (dp if zero_stage >= 1 else 1)
    grads = p.grad_bytes * psi_local / (dp if zero_stage >= 2 else 1)
    weights = p.weight_bytes * psi_local / (dp if zero_stage >= 3 else 1)
    return StateBytes(weights=weights, grads=grads, optimizer=opt)
