"""The collectives of one optimizer step of a layout, by group and link (planner side).

Per rank of the busiest pipeline stage, per optimizer step; payload bytes as in
:mod:`framework.base.cost.comm` (all-gather: the gathered size; reduce-scatter: the input) and ring
bytes on the wire by :func:`~framework.base.cost.comm.ring_wire_bytes` (nccl-tests PERFORMANCE.md).
This module places calls on groups and links; which calls a ZeRO stage and a TP layer make is
:mod:`framework.base.cost.comm`'s (:func:`~framework.base.cost.comm.dp_collectives`,
:func:`~framework.base.cost.comm.tp_calls_per_microbatch`), the formulas the plugins' figures use too.

- **TP** (Shoeybi et al. 2019 Fig. 4; Narayanan et al. 2021 §3.2): per layer and micro-batch 2
  all-reduces of ``b·s·h`` activations forward and 2 backward; with SP each becomes an
  all-gather + a reduce-scatter (Korthikanti et al. 2022 §4.2.2); full recompute re-runs the
  forward's 2 (Megatron recomputes the whole layer). Activation bytes: 2 (bf16) or 4 (fp32).
- **DP**, by ZeRO stage: 0 one all-reduce of the gradients per step (ZeRO §7.1); 1
  (Megatron distributed optimizer) a reduce-scatter of the gradients and an all-gather of the
  updated weights per step; 2 the reduce-scatter on every micro-batch (the gradients are kept
  sharded); 3 per micro-batch and per layer (FSDP's unit: one transformer block) an all-gather for
  forward, one for backward and a reduce-scatter (ZeRO §7.2: 1.5x DP), named :data:`~framework.base.cost.comm.ZERO3_COLLECTIVES`:
  ``m·L_stage`` calls of one layer's bytes each, so every layer pays the collective's latency.
- **PP** (Narayanan et al. 2021 §3.2, §2.2.2): per micro-batch ``b·s·h`` activations to the
  next stage and the same gradient back, ``/t`` with SP (the scatter/gather optimisation),
  times ``v`` with interleaving; plus the tied-embedding gradient all-reduce between the first
  and last stage once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

from framework.base.cost.comm import dp_collectives, ring_wire_bytes, tp_calls_per_microbatch
from framework.base.cost.memory import PRECISIONS, stage_params


@dataclass(frozen=True)
class Collective:
    """One kind of collective call a rank makes, with how often.

    Attributes:
        name: what it is for (``tp_fwd``, ``tp_bwd``, ``dp_grad``, ``dp_param``, ``zero3_fwd``,
            ``zero3_bwd``, ``zero3_grad``, ``pp_fwd``, ``pp_bwd``, ``embed_grad``).
        kind: ``allreduce`` | ``allgather`` | ``reduce_scatter`` | ``p2p``.
        group: mesh axis (``tp``, ``dp``, ``pp``).
        group_size: ranks n in the group.
        inter_node: the group spans nodes (NIC) or not (NVLink).
        payload_bytes: bytes per call.
        calls: calls per optimizer step.
        per_microbatch: the calls repeat with every micro-batch (``calls = m·calls_per_mb``).
        ranks_per_node: members of the group inside one node (``k``); a group spanning nodes with
            ``k > 1`` runs ``k`` rings in parallel, each crossing a node boundary on its own NIC
            (:func:`~framework.base.cost.steptime.collective_link`).
    """

    name: str
    kind: str
    group: str
    group_size: int
    inter_node: bool
    payload_bytes: float
    calls: float
    per_microbatch: bool
    ranks_per_node: int = 1

    @property
    def wire_bytes_per_call(self) -> float:
        """Ring bytes one rank sends per call."""
        return ring_wire_bytes(self.kind, self.payload_bytes, self.group_size)

    @property
    def wire_bytes(self) -> float:
        """Ring bytes one rank sends per step."""
        return self.wire_bytes_per_call * self.calls

    @property
    def link(self) -> str:
        """``nic`` or ``nvlink``."""
        return "nic" if self.inter_node else "nvlink"


def layout_collectives(shape, lay, gpus_per_node: int) -> list[Collective]:
    """Every collective one rank of the first pipeline stage runs in one step (module docstring).

    Args:
        shape: :class:`~framework.base.cost.shape.ModelShape`.
        lay: :class:`~framework.base.cost.layout.PlanLayout`.
        gpus_per_node: ranks per node (decides NVLink vs NIC per group).
    """
    prec = PRECISIONS[lay.precision]
    act_bytes = 4 if lay.precision == "fp32" else 2
    b, s, h = lay.micro_batch_size, shape.seq_len, shape.d_model
    m, t, p, d = lay.n_microbatches, lay.tp, lay.pp, lay.dp
    layers = -(-shape.n_layer // p)  # the busiest stage: ceil(L/p)
    out: list[Collective] = []
    if t > 1:
        tp_inter = lay.group_inter_node("tp", gpus_per_node)
        k = lay.group_ranks_per_node("tp", gpus_per_node)
        act = b * s * h * act_bytes
        fwd_calls, bwd_calls = tp_calls_per_microbatch(n_layer=layers, recompute=lay.recompute)
        if lay.sequence_parallel:
            for name, calls in (("tp_fwd", fwd_calls), ("tp_bwd", bwd_calls)):
                out.append(Collective(name + "_ag", "allgather", "tp", t, tp_inter, act, calls * m, True, k))
                out.append(Collective(name + "_rs", "reduce_scatter", "tp", t, tp_inter, act, calls * m, True, k))
        else:
            out.append(Collective("tp_fwd", "allreduce", "tp", t, tp_inter, act, fwd_calls * m, True, k))
            out.append(Collective("tp_bwd", "allreduce", "tp", t, tp_inter, act, bwd_calls * m, True, k))
    psi = stage_params(shape, tp=t, pp=p, stage=0)
    if d > 1:
        dpi = lay.group_inter_node("dp", gpus_per_node)
        k = lay.group_ranks_per_node("dp", gpus_per_node)
        g, w = psi * prec.grad_bytes, psi * prec.weight_bytes
        for c in dp_collectives(lay.zero_stage, grad_reduce="reduce_scatter"):
            size = w if c.tensor == "params" else g
            if lay.zero_stage == 3:  # FSDP's unit is one transformer block: every layer pays the collective's latency
                out.append(Collective(c.name, c.kind, "dp", d, dpi, size / layers, m * layers, True, k))
            else:
                out.append(
                    Collective(c.name, c.kind, "dp", d, dpi, size, m if c.per_microbatch else 1, c.per_microbatch, k)
                )
    if p > 1:
        ppi = lay.group_inter_node("pp", gpus_per_node)
        act = b * s * h * act_bytes / (t if lay.sequence_parallel else 1)
        out.append(Collective("pp_fwd", "p2p", "pp", 2, ppi, act, m * lay.v, True))
        out.append(Collective("pp_bwd", "p2p", "pp", 2, ppi, act, m * lay.v, True))
        out.append(
            Collective("embed_grad", "allreduce", "pp", 2, ppi, shape.vocab_size * h / t * prec.grad_bytes, 1, False)
        )
    return out


def bytes_by_link(colls: list[Collective]) -> dict[str, float]:
    """Ring wire bytes per rank per step summed by link (``nvlink``, ``nic``)."""
    out = {"nvlink": 0.0, "nic": 0.0}
    for c in colls:
        out[c.link] += c.wire_bytes
    return out


def bytes_by_collective(colls: list[Collective]) -> dict[str, float]:
    """Ring wire bytes per rank per step by collective name."""
    out: dict[str, float] = {}
    for c in colls:
        out[c.name] = out.get(c.name, 0.0) + c.wire_bytes
    return out
