"""A run and the planner's layout of it, both ways: :func:`plan_layout_of` and :func:`trainlab_overrides`.

The planner prices a :class:`~framework.base.cost.layout.PlanLayout`; trainlab runs a resolved config
(:class:`~framework.base.resolved.ResolvedRun`, whose degrees are a :class:`~framework.base.layout.ParallelLayout`).
These two functions are the only translation between them: :func:`trainlab_overrides` turns a
planner layout into the Hydra overrides of ``python -m framework.train``, :func:`plan_layout_of`
turns a resolved run (and its plugin's declared ZeRO stage) into the planner's layout. For every
layout trainlab can express (no notes from :func:`trainlab_overrides`), layout -> overrides ->
resolved run -> layout gives the layout back (``tests/unit/test_run_layout.py``, every plugin).
How a layout runs (which ``parallelism=`` preset per ZeRO stage, the schedules' names) is
``plan.run_with`` in ``conf/plan.yaml`` (:func:`default_run_with`): neither function names a plugin.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from framework.base.cost.layout import PlanLayout

PRECISION_OF_RUN = {"32-true": "fp32", "bf16-mixed": "bf16", "16-mixed": "bf16"}
"""``trainer.precision`` -> the planner's precision (:data:`framework.base.cost.memory.PRECISIONS`): mixed precision
is ZeRO §3.1's ``bf16`` accounting (fp16 keeps the same bytes); ``bf16_main_grad`` has no trainlab switch."""


def default_run_with() -> dict:
    """``plan.run_with`` of ``conf/plan.yaml``: how trainlab runs each kind of layout (:func:`trainlab_overrides`)."""
    from omegaconf import OmegaConf

    conf = Path(__file__).resolve().parents[3] / "conf" / "plan.yaml"
    return OmegaConf.to_container(OmegaConf.load(conf).plan.run_with, resolve=True)


def plan_layout_of(
    resolved: Any, zero_stage: int, *, run_with: Mapping[str, Any], state_accounting: str = "paper"
) -> PlanLayout:
    """The planner's layout of a resolved run (the inverse of :func:`trainlab_overrides`).

    Degrees from ``resolved.layout``; micro-batch and global batch (sequences) from the resolved batch
    split; ``zero_stage``: what the run's plugin declares (``ParallelPlugin.zero_stage``), 0 when the dp
    group is one rank (sharding over one rank is no sharding; the planner enumerates stage 0 only there);
    the schedule (pp > 1) from ``parallelism.schedule`` by the inverse of ``run_with["schedules"]``, and
    ``parallelism.virtual_stages`` under the interleaved schedule; ``sequence_parallel`` from
    ``parallelism.sequence_parallel`` (tp > 1); recompute ``full`` when ``model.activation_checkpointing``,
    else ``none``; precision by :data:`PRECISION_OF_RUN`; ``state_accounting`` as given (a pricing choice,
    not part of the run).

    Raises:
        ValueError: a schedule ``run_with["schedules"]`` does not name, or a layout :class:`PlanLayout` refuses.
    """
    import dataclasses

    lay = resolved.layout
    par = dataclasses.asdict(
        resolved.run.parallelism
    )  # the plugin's own keys (schedule, ...) read as config, not probed
    schedule, v = "1F1B", 1
    if lay.pp > 1:
        names = {run: plan for plan, run in run_with["schedules"].items()}
        if par.get("schedule") not in names:
            raise ValueError(
                f"parallelism.schedule={par.get('schedule')!r} has no planner schedule; "
                f"allowed: {', '.join(names)} (plan.run_with.schedules)"
            )
        schedule = names[par["schedule"]]
        v = int(par.get("virtual_stages", 1)) if schedule == "Interleaved1F1B" else 1
    return PlanLayout(
        dp=lay.dp,
        tp=lay.tp,
        pp=lay.pp,
        micro_batch_size=resolved.micro_batch_size,
        global_batch_size=resolved.global_batch_size,
        schedule=schedule,
        virtual_stages=v,
        zero_stage=zero_stage if lay.dp > 1 else 0,
        recompute="full" if resolved.run.model.activation_checkpointing else "none",
        sequence_parallel=bool(par.get("sequence_parallel", False)) and lay.tp > 1,
        precision=PRECISION_OF_RUN[resolved.run.trainer.precision],
        state_accounting=state_accounting,
    )


def trainlab_overrides(
    lay: PlanLayout, *, model: str, seq_len: int, nodes: int, run_with: dict
) -> tuple[str, list[str]]:
    """The Hydra overrides that run ``lay`` in trainlab, and notes on what trainlab cannot express
    (the inverse of :func:`plan_layout_of` where there are no notes).

    ``run_with`` (``plan.run_with`` in ``conf/plan.yaml``: the planner never names a plugin
    itself) lists, per ZeRO stage (entry ``i`` = stage ``i``, :data:`~framework.base.cost.memory.ZERO_STAGES`),
    a pure-DP layout's ``parallelism=`` override (``data_parallel``) and the override of a TP/PP
    layout's dp dimension (``model_parallel_dp``; null = no equivalent); it gives the overrides of
    a TP/PP layout (``model_parallel``) and the schedule names
    (``schedules``), and whether SP runs together with PP (``sequence_parallel_with_pp``). Full recompute is ``model.activation_checkpointing=true``; selective
    recompute has no trainlab switch yet.
    """
    notes = []
    o = [
        f"model={model}",
        f"data.seq_len={seq_len}",
        f"trainer.global_batch_size={lay.global_batch_size}",
        f"trainer.micro_batch_size={lay.micro_batch_size}",
        "trainer.grad_accum_steps=null",
    ]
    if lay.tp == 1 and lay.pp == 1:
        o.insert(0, run_with["data_parallel"][lay.zero_stage])
    else:
        o[:0] = [run_with["model_parallel"], f"parallelism.tp_degree={lay.tp}", f"parallelism.pp_degree={lay.pp}"]
        if lay.pp > 1:
            o.append(f"parallelism.schedule={run_with['schedules'][lay.schedule]}")
            if lay.v > 1:
                o.append(f"parallelism.virtual_stages={lay.v}")
        if lay.sequence_parallel and (lay.pp == 1 or run_with["sequence_parallel_with_pp"]):
            o.append("parallelism.sequence_parallel=true")
        elif lay.sequence_parallel:
            notes.append(
                "sequence parallelism with pp > 1: trainlab cannot run it yet (plan.run_with.sequence_parallel_with_pp)"
            )
        dp = run_with["model_parallel_dp"][lay.zero_stage]
        if dp:
            o.append(dp)
        else:
            notes.append(
                f"ZeRO stage {lay.zero_stage} with tp/pp has no trainlab equivalent (plan.run_with.model_parallel_dp)"
            )
    o[1:1] = [f"parallelism.world_size={lay.world_size}", f"parallelism.nnodes={nodes}"]
    if lay.recompute == "full":
        o.append("model.activation_checkpointing=true")
    elif lay.recompute == "selective":
        notes.append("selective recompute: no trainlab switch yet (runs without recompute)")
    if lay.precision.startswith("bf16"):
        o.append("trainer.precision=bf16-mixed")
    return " ".join(o), notes
