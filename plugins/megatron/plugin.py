"""The ``tp`` and ``pp`` plugins: one implementation, two presets.

``parallelism=tp`` (``conf/parallelism/tp.yaml``: 2 ranks, tp 2) and ``parallelism=pp``
(``pp.yaml``: 2 ranks, pp 2, 1F1B) share :class:`MegatronPlugin`; any ``dp x tp x pp`` layout
is an override away (``parallelism.tp_degree=2 parallelism.pp_degree=2
parallelism.world_size=4``). The plugin supplies a plan (:meth:`MegatronPlugin.parallel_plan`:
stage split, TP plan, DP wrapper: FSDP2 ``fully_shard`` or ``replicate`` on the ``dp`` mesh
dimension) that :func:`framework.base.parallelize.parallelize_gpt` applies in torchtitan's order:
pipeline split, TP on each stage, activation checkpointing, compile, DP.

Cost model (per rank per optimizer step, :mod:`framework.base.cost.comm`): TP payload per
micro-batch x ``grad_accum_steps`` micro-batches; PP sends; the tied-embedding all-reduce
between the first and last stage; with ``data_parallel=fsdp`` on dp > 1 and no pipeline, the
FSDP2 parameter all-gathers and gradient reduce-scatters of this rank's (TP-local) parameters.
All of it is metered (:mod:`plugins.megatron.metering`). Left out of both (not modelled yet):
FSDP2 inside pipeline stages (its re-gathers depend on the schedule) and ``data_parallel=ddp``
(``replicate``)'s gradient all-reduce.

Ring bytes on the wire (``perf/comm_bytes_wire``): each kind on its own group
(``CommEstimate.group_sizes``): TP collectives on the tp group, FSDP's all-gathers and
reduce-scatters on the dp group, the tied-embedding all-reduce on its 2-rank group (first and
last stage), p2p sends as they are. Exact whenever a kind runs on one group; a kind that runs on
two groups of different sizes gets the group of its larger part: the all-reduce under
``tp x pp`` with tp > 2 (TP's, not the embedding's 2 ranks) and the all-gathers/reduce-scatters
of sequence parallelism with FSDP on ``dp != tp`` (FSDP's dp group).
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
import torch.distributed as dist

from framework.base.cost.comm import (
    CommEstimate,
    ModelStats,
    pp_p2p_bytes_per_step,
    sp_norm_grad_allreduce_bytes,
    tp_payload_bytes_per_microbatch,
)
from framework.base.cost.memory import adamw_fp32_local_states_bytes
from framework.base.distributed import process_group_backend, resolve_accelerator
from framework.base.layout import ParallelLayout
from framework.base.metrics.timing import CommMeter
from framework.base.parallelize import ParallelPlan
from framework.base.plugin import ParallelPlugin, PluginCapabilities
from framework.base.registry import register_plugin
from plugins.fsdp import reshard_after_evaluation
from plugins.megatron.config import MegatronConfig, validate_run
from plugins.megatron.metering import METER, install_fsdp_meter, install_funcol_meter

# Parameters that column/row parallelism shards over tp (the rest are replicated on every TP rank).
_TP_SHARDED = re.compile(
    r"blocks\.\d+\.(attn\.qkv\.(weight|bias)|attn\.proj\.weight|mlp\.fc\.(weight|bias)|mlp\.proj\.weight)$"
)


class MegatronPlugin(ParallelPlugin):
    """Tensor + pipeline parallelism composed with data parallelism on a ``pp x dp x tp`` mesh."""

    name = "megatron"
    config_cls = MegatronConfig
    # Sharded (DCP) checkpoints keyed by the GPT's names: synchronous full saves, no in-memory
    # snapshots; with pp > 1 the pipeline schedule owns micro-batching.
    capabilities = PluginCapabilities(
        checkpoint_format="dcp",
        async_save=False,
        incremental_save=False,
        memory_snapshots=False,
        no_snapshots_reason="not tested with pipeline stages",
        mesh_axes=("pp", "dp", "tp"),
        owns_microbatching=True,
    )

    def __init__(self, cfg: MegatronConfig) -> None:
        super().__init__(cfg)
        self.runner = None  # PipelineRunner once the plan was applied (pp > 1)
        self.mesh = None
        self.layout: ParallelLayout | None = None  # the run's, once parallel_plan ran
        self._local_shapes: list[tuple[str, tuple[int, ...]]] = []
        self._busiest_pp_rank_shapes: list[tuple[int, ...]] | None = None  # with a pipeline (see _pipeline_plan)
        self._grad_norm: torch.Tensor | None = None

    # -- validation -------------------------------------------------------------------------
    def validate(self, resolved: Any) -> None:
        validate_run(self.cfg, resolved.run, pp_degree=resolved.layout.pp, grad_accum_steps=resolved.grad_accum_steps)

    # -- Lightning ------------------------------------------------------------------------
    def build_strategy(self, resolved: Any) -> Any:
        from plugins.megatron.strategy import MeshStrategy

        accelerator = resolve_accelerator(resolved.run.trainer.accelerator)
        return MeshStrategy(
            layout=resolved.layout,
            pipelined=resolved.owns_microbatching,
            process_group_backend=process_group_backend(self.cfg.backend, accelerator),
            timeout_s=self.cfg.timeout_s,
        )

    def parallel_plan(self, model: torch.nn.Module, module: Any) -> ParallelPlan:
        """Stage split (pp > 1), TP (+ SP without a pipeline) and DP (``data_parallel``) on the run's mesh."""
        self.mesh = module.device_mesh
        self.layout = lay = module.resolved.layout
        # checkpoint names and their order are the unsplit GPT's (plugins/megatron/checkpoint.py)
        module.trainer.strategy.param_order = [f"model.{n}" for n, _ in model.named_parameters()]
        plan = ParallelPlan(dp=self._wrap_dp if lay.dp > 1 else None)
        if lay.tp > 1:
            from plugins.megatron.tensor_parallel import apply_tp

            sp = self.cfg.sequence_parallel  # validate_run refuses it with a pipeline
            plan.tp = lambda piece: apply_tp(piece, self.mesh["tp"], sequence_parallel=sp)
        if lay.pp == 1:
            self._local_shapes = self._planned_shapes(model.named_parameters(), lay)
        else:
            plan.split, plan.assemble = self._pipeline_plan(model, module)
        return plan

    def configure_model(self, model: torch.nn.Module, module: Any) -> torch.nn.Module:
        """After the plan, with FSDP on dp: FSDP2 keeps a root unit gathered after forward, so it
        reshards after an evaluation forward (:func:`plugins.fsdp.reshard_after_evaluation`): the
        model's root without a pipeline; with one, every FSDP unit of this rank's stages (each stage
        chunk is a root of its own). Left gathered, the next training step skipped the stage's
        all-gather and then read its parameters from before the optimizer step: dp x pp runs with a
        validation pass left `single`'s losses by up to 3e-4 from the step after next."""
        lay = self.layout
        if lay.dp > 1 and self.cfg.data_parallel == "fsdp":
            if lay.pp == 1:
                model.register_forward_hook(reshard_after_evaluation)
            else:
                from torch.distributed.fsdp import FSDPModule

                for unit in model.modules():
                    if isinstance(unit, FSDPModule):
                        unit.register_forward_hook(reshard_after_evaluation)
        return model

    def _wrap_dp(self, mod: torch.nn.Module) -> torch.nn.Module:
        mesh = self.mesh["dp"]
        if self.cfg.data_parallel == "fsdp":
            from torch.distributed.fsdp import fully_shard

            return fully_shard(mod, mesh=mesh)
        from torch.distributed._composable.replicate_with_fsdp import replicate

        return replicate(mod, mesh=mesh)

    def _pipeline_plan(self, model: torch.nn.Module, module: Any) -> tuple[Any, Any]:
        """``(split, assemble)`` of the pipeline: this rank's stages of the GPT, then the
        :class:`~plugins.megatron.pipeline.PipelineRunner` that drives them."""
        from plugins.megatron.pipeline import GPTStage, PipelineRunner, split_layers

        resolved = module.resolved
        lay = resolved.layout
        mesh = self.mesh
        pp_mesh = mesh["pp"]
        pp_rank, p = pp_mesh.get_local_rank(), lay.pp
        n_stages = p * self.cfg.virtual_stages
        mine = [k for k in range(n_stages) if k % p == pp_rank]

        def split(gpt: torch.nn.Module) -> list[torch.nn.Module]:
            layers = split_layers(gpt.n_layer, n_stages)
            stages = [GPTStage(gpt, layers[k], first=k == 0, last=k == n_stages - 1) for k in mine]
            self._local_shapes = [sh for st in stages for sh in self._planned_shapes(st.named_parameters(), lay)]
            # Every pipeline rank's parameters, to model the busiest rank (the first with a GPT's position
            # embedding, the last with a Llama's untied head and final norm); shapes only, no stage built.
            params = dict(gpt.named_parameters())
            tied = not hasattr(gpt, "lm_head")
            ranks = []
            for r in range(p):
                named = []
                for k in range(r, n_stages, p):
                    prefixes = [f"blocks.{i}." for i in layers[k]]
                    if k == 0:
                        prefixes += ["wte.", "wpe."]
                    if k == n_stages - 1:
                        prefixes += ["ln_f.", "lm_head."]
                        if tied:
                            named.append(("head", params["wte.weight"]))
                    named += [(n, t) for n, t in params.items() if n.startswith(tuple(prefixes))]
                ranks.append([sh for _, sh in self._planned_shapes(named, lay)])
            self._busiest_pp_rank_shapes = max(ranks, key=adamw_fp32_local_states_bytes)
            return stages

        tied = not hasattr(model, "lm_head")

        def assemble(stages: list[torch.nn.Module]) -> torch.nn.Module:
            # The embedding group of every (dp, tp) coordinate: the ranks of its first and last stage.
            ranks = mesh.mesh  # [pp, dp, tp] global ranks
            embed_group = None
            for d in range(lay.dp if tied else 0):  # an untied head (Llama) has no copy to sync
                for t in range(lay.tp):
                    pair = sorted({int(ranks[0, d, t]), int(ranks[p - 1, d, t])})
                    g = dist.new_group(pair)
                    if dist.get_rank() in pair:
                        embed_group = g
            device = (
                module.trainer.strategy.root_device
            )  # where the stages will run (the model may still be on the CPU)
            self.runner = PipelineRunner(
                dict(zip(mine, stages)),
                num_stages=n_stages,
                pp_group=pp_mesh.get_group(),
                pp_rank=pp_rank,
                pp_size=p,
                embed_group=embed_group,
                schedule_name=self.cfg.schedule,
                n_microbatches=resolved.grad_accum_steps,
                micro_batch_size=resolved.micro_batch_size,
                seq_len=resolved.run.data.seq_len,
                d_model=model.d_model,
                vocab_size=model.vocab_size,
                device=device,
            )
            return self.runner

        return split, assemble

    @property
    def optimizer_foreach(self) -> bool | None:
        """False under TP: AdamW's multi-tensor (foreach) path rejects a parameter list mixing DTensor
        shards with plain tensors (the replicated embeddings and norms): ``aten._foreach_mul_.Scalar
        got mixed torch.Tensor and DTensor`` (torch 2.13, checked on CPU with ``foreach=True``; CUDA
        defaults to foreach). None = torch's choice."""
        return False if self.cfg.tp_degree > 1 else None

    def callbacks(self, resolved: Any, emit: Any) -> list:
        """Extra callbacks: the pipeline bubble meter when ``pp > 1``."""
        if resolved.layout.pp == 1:
            return []
        from plugins.megatron.bubble import PipelineBubble

        run = resolved.run
        return [
            PipelineBubble(
                runner=lambda: self.runner,
                pp=resolved.layout.pp,
                n_microbatches=resolved.grad_accum_steps,
                virtual_stages=self.cfg.virtual_stages,
                log_every_n_steps=run.trainer.log_every_n_steps,
                warmup_steps_excluded=run.trainer.warmup_steps_excluded,
                emit=emit,
            )
        ]

    # -- gradient norm and clipping (global over tp shards, pipeline stages and dp shards) --
    def _params(self, module: Any) -> list[torch.nn.Parameter]:
        head = self.runner.tied_params()[1] if self.runner is not None and self.runner.embed_group is not None else None
        return [p for p in module.parameters() if p.grad is not None and p is not head]

    def grad_norm(self, module: Any) -> torch.Tensor:
        """Global gradient L2 norm of the whole model (each parameter element once), a 0-dim float64 tensor
        on the module's device (read back only where the run logs it).

        Each rank sums the squares of its local gradient (shards), divided by the number of
        ranks holding the same elements (TP/DP replicas); one all-reduce over all ranks adds
        them. The pipeline's ``head`` copy is left out (it is ``wte``).
        """
        from torch.distributed.tensor import DTensor

        lay = module.resolved.layout
        local = torch.zeros((), dtype=torch.float64, device=module.device)
        for p in self._params(module):
            g = p.grad
            if isinstance(g, DTensor):
                if any(pl.is_partial() for pl in g.placements):  # e.g. sequence-parallel norms
                    g = p.grad = g.redistribute(placements=p.placements)
                names = g.device_mesh.mesh_dim_names or ()
                replicas = 1
                for dim_name in ("dp", "tp"):
                    if dim_name in names:
                        pl = g.placements[names.index(dim_name)]
                        replicas *= (
                            getattr(lay, dim_name) if pl.is_replicate() else 1
                        )  # Shard or FSDP's _StridedShard: 1
                    else:
                        replicas *= getattr(lay, dim_name)
                t = g.to_local()
            else:
                replicas, t = lay.dp * lay.tp, g
            local += t.double().pow(2).sum() / replicas
        dist.all_reduce(local)
        self._grad_norm = local.sqrt()
        return self._grad_norm

    def clip_gradients(self, module: Any, optimizer: Any, max_norm: float) -> None:
        """Scale every gradient by ``min(1, max_norm / (norm + 1e-6))`` (as ``torch.nn.utils.clip_grad_norm_``),
        on the device: no host read of the norm (a DTensor gradient is scaled through its local shard)."""
        norm = self._grad_norm if self._grad_norm is not None else self.grad_norm(module)
        self._grad_norm = None
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0).float()
        for p in module.parameters():
            if p.grad is not None:
                g = p.grad
                (g.to_local() if hasattr(g, "to_local") else g).mul_(coef)

    # -- cost model and metering ------------------------------------------------------------
    @property
    def zero_stage(self) -> int:
        """The dp dimension's sharding: 3 with ``parallelism.data_parallel=fsdp`` (FSDP2 full shard), 0 with ``ddp``."""
        return 3 if self.cfg.data_parallel == "fsdp" else 0

    def comm_volume(self, stats: ModelStats, resolved: Any) -> CommEstimate:
        """TP payload x micro-batches + this rank's PP sends + the tied-embedding all-reduce + FSDP on dp, each kind
        with its group's size (see the module docstring)."""
        lay = resolved.layout
        run = resolved.run
        b, s, h = resolved.micro_batch_size, run.data.seq_len, run.model.d_model
        m = resolved.grad_accum_steps
        out: dict[str, int] = {}
        # A pipeline rank runs only its stages' blocks.
        layers = (
            sum(len(c.blocks) for c in self.runner.chunks.values()) if self.runner is not None else run.model.n_layer
        )
        tp = tp_payload_bytes_per_microbatch(
            micro_batch_size=b,
            seq_len=s,
            d_model=h,
            n_layer=layers,
            tp=lay.tp,
            sequence_parallel=self.cfg.sequence_parallel,
            elem_bytes=stats.grad_bytes,
        )
        for k, v in tp.items():
            out[k] = out.get(k, 0) + v * m
        if lay.tp > 1 and self.cfg.sequence_parallel:
            out["allreduce"] = out.get("allreduce", 0) + sp_norm_grad_allreduce_bytes(
                n_layer=layers, d_model=h, bias=run.model.bias, elem_bytes=stats.grad_bytes
            )
        groups: dict[str, int] = dict.fromkeys(out, lay.tp)  # TP's collectives (and SP's norm all-reduce): the tp group
        if lay.pp > 1 and self.runner is not None:
            r = self.runner
            out["p2p"] = pp_p2p_bytes_per_step(
                stage_ids=r.stage_ids,
                num_stages=r.num_stages,
                n_microbatches=m,
                micro_batch_size=b,
                seq_len=s,
                d_model=h,
                elem_bytes=stats.grad_bytes,
            )
            if r.embed_group is not None:
                embed = math.prod(r.tied_params()[0].shape if r.has_first else r.tied_params()[1].shape)
                embed_local = embed // (lay.dp if self.cfg.data_parallel == "fsdp" and lay.dp > 1 else 1)
                out["allreduce"] = out.get("allreduce", 0) + embed_local * stats.grad_bytes * (
                    int(r.has_first) + int(r.has_last)
                )
                groups.setdefault("allreduce", 2)  # the embedding group: first and last stage
            groups["p2p"] = 2
        if self._fsdp_metered():
            # FSDP2 on the dp dimension (ZeRO §7.2), per micro-batch (Lightning accumulates through
            # FSDP's forward/backward): all-gather every unit's (TP-local, dp-padded) parameters
            # before forward and each block's again before backward - the root unit (embeddings,
            # ln_f) stays unsharded between forward and backward (FSDP2 does not reshard the root
            # after forward) - and reduce-scatter all gradients.
            def full(names_ok) -> int:
                return (
                    sum(sh[0] * lay.dp * math.prod(sh[1:]) for n, sh in self._local_shapes if names_ok(n))
                    * stats.param_bytes
                )

            every, blocks = full(lambda n: True), full(lambda n: n.startswith("blocks."))
            out["allgather"] = out.get("allgather", 0) + m * (every + blocks)
            out["reduce_scatter"] = out.get("reduce_scatter", 0) + m * every
            groups.update(allgather=lay.dp, reduce_scatter=lay.dp)
        return CommEstimate(payload_bytes=out, group_size=lay.tp, group_sizes=groups)

    def _fsdp_metered(self) -> bool:
        """FSDP2 on dp is metered and modelled without a pipeline; a pipeline stage's FSDP units
        re-gather and reshard by schedule (not modelled yet), so there it is left out of both."""
        lay = self.layout
        return lay.dp > 1 and lay.pp == 1 and self.cfg.data_parallel == "fsdp"

    def _planned_shapes(self, named: Any, lay: ParallelLayout) -> list[tuple[str, tuple[int, ...]]]:
        """Local shape of each parameter after TP (dim 0 of column-parallel, dim 1 of row-parallel weights / t) and FSDP (dim 0 / dp, rounded up)."""
        out = []
        for name, p in named:
            shape = list(p.shape)
            if lay.tp > 1 and _TP_SHARDED.search(name):
                dim = 1 if name.endswith("proj.weight") else 0
                shape[dim] //= lay.tp
            if lay.dp > 1 and self.cfg.data_parallel == "fsdp":
                shape[0] = -(-shape[0] // lay.dp)
            out.append((name, tuple(shape)))
        return out

    def model_states_bytes(self, stats: ModelStats, resolved: Any) -> int:
        """fp32 params + grads + AdamW moments of the parameters this rank holds (16 B each, ZeRO §3.1), plus 4 B per tensor.

        Local sizes from the layout: a column-parallel weight/bias holds ``1/t`` of its rows, a
        row-parallel weight ``1/t`` of its columns; a pipeline rank holds its stages (and the
        head copy on the last stage); FSDP holds ``ceil(rows/dp)`` rows of each. With a pipeline
        the busiest pipeline rank's (the measured figure is the max over ranks).
        """
        if self._busiest_pp_rank_shapes is not None:  # measured is the max over ranks: model the busiest pipeline rank
            return adamw_fp32_local_states_bytes(self._busiest_pp_rank_shapes)
        return adamw_fp32_local_states_bytes([s for _, s in self._local_shapes])

    def install_comm_meter(self, model: Any, meter: CommMeter) -> None:
        """Meter DTensor's functional collectives, the pipeline's sends and FSDP2's collectives (see :mod:`.metering`;
        the framework's window keeps validation and its own reductions out)."""
        install_funcol_meter()
        if self._fsdp_metered():
            install_fsdp_meter()
        METER.meter = meter


@register_plugin
class TPPlugin(MegatronPlugin):
    """``parallelism=tp``: tensor parallel (preset: 2 ranks, tp 2)."""

    name = "tp"


@register_plugin
class PPPlugin(MegatronPlugin):
    """``parallelism=pp``: pipeline parallel (preset: 2 ranks, pp 2, 1F1B)."""

    name = "pp"
