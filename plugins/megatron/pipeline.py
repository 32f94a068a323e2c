"""Pipeline parallelism for :class:`framework.base.model.GPT` with ``torch.distributed.pipelining``.

The model is cut by transformer blocks into ``S = pp_degree x virtual_stages`` stages
(contiguous blocks, the remainder spread over the first stages). Stage ``k`` lives on pipeline
rank ``k % pp`` (the looped placement of Narayanan et al. 2021 §2.2.2, which
``ScheduleInterleaved1F1B`` expects). The first stage also holds the token and position
embeddings; the last the final LayerNorm, the output head and the loss.

**Tied embeddings.** The GPT's head is its token embedding ``wte`` (a Llama's head is its own
``lm_head``, held by the last stage; nothing to sync, no embedding group). Under PP the first and the
last stage are on different ranks, so the last stage holds its own copy ``head`` (initialised
from ``wte``), and after every step the two gradients are all-reduced (summed) between the two
ranks that hold them (Megatron-LM's "embedding group"). Both copies then see the gradient the
tied weight has in the unsplit model and, with identical AdamW updates, stay equal. The sync
costs one all-reduce of ``V x h`` parameters per step; the gradient norm counts the weight once.

**Schedules** (``parallelism.schedule``): ``gpipe`` (all forwards, then all backwards;
Huang et al. 2019), ``1f1b`` (PipeDream-Flush; Narayanan et al. 2021 §2.2.1), and
``interleaved_1f1b`` (``virtual_stages`` chunks per rank, §2.2.2). Micro-batches per step =
``grad_accum_steps``; gradients are averaged over them by the schedule (``scale_grads``). Each
micro-batch's loss is its summed cross-entropy over the step's token-weighted denominator
(``num_tokens / num_micro_batches``, :func:`framework.base.model.gpt.lm_loss`), the same as without a
pipeline, so the step's loss is the mean over the global batch's valid targets.

**Bubble.** Each stage's forward and backward compute (``forward_one_chunk`` /
``backward_one_chunk``) is timed; a rank's idle fraction of a step is
``1 - busy / wall`` with ``wall`` the whole ``schedule.step``. The model is
:func:`framework.base.cost.comm.pp_bubble_fraction`.

Validation runs the stages in order with plain ``send``/``recv`` of the activations (any batch
size; no schedule), and broadcasts the loss over the pipeline group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from framework.base.metrics.timing import make_clock
from framework.base.model.gpt import check_seq_len, embed_tokens, lm_loss, output_logits
from plugins.megatron.metering import METER, meter_stage_sends


def split_layers(n_layer: int, n_stages: int) -> list[list[int]]:
    """Block indices of each of ``n_stages`` contiguous stages (sizes differ by at most one, larger first).

    Raises:
        ValueError: ``n_stages > n_layer`` (a stage without blocks) or ``n_stages < 1``.
    """
    if not 1 <= n_stages <= n_layer:
        raise ValueError(f"{n_stages} stages for {n_layer} layers: need 1 <= stages <= layers")
    base, extra = divmod(n_layer, n_stages)
    out, start = [], 0
    for k in range(n_stages):
        size = base + (1 if k < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


class GPTStage(nn.Module):
    """A slice of a GPT or a Llama: ``[b, s]`` token ids (first stage) or ``[b, s, h]`` hidden states in,
    ``[b, s, h]`` hidden states or ``[b, s, V]`` logits (last stage) out.

    Holds the model's own modules (no copies) and runs them with the model's own pieces
    (:func:`~framework.base.model.gpt.embed_tokens`, its blocks, :func:`~framework.base.model.gpt.output_logits`).
    Modules keep their model names (``blocks.<N>``, ``wte``, ``ln_f``, ``lm_head``), so a stage's
    parameter names are the model's. A Llama (no ``wpe``, untied ``lm_head``) needs no head copy.
    """

    def __init__(self, gpt: nn.Module, layer_ids: list[int], *, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.max_seq_len = gpt.max_seq_len
        self.tied = not hasattr(gpt, "lm_head")
        if first:
            self.wte, self.drop = gpt.wte, gpt.drop
            self.wpe = getattr(gpt, "wpe", None)  # None: rotary positions, applied in the attention
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in layer_ids})
        if last:
            self.ln_f = gpt.ln_f
            if self.tied:
                # The tied head's own copy on the last stage (see the module docstring).
                self.head = nn.Parameter(gpt.wte.weight.detach().clone())
            else:
                self.lm_head = gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            if self.wpe is not None:
                x = embed_tokens(x, self.wte, self.wpe, self.drop, self.max_seq_len)
            else:
                check_seq_len(x, self.max_seq_len)
                x = self.drop(self.wte(x))
        for block in self.blocks.values():
            x = block(x)
        if self.last:
            x = output_logits(x, self.ln_f, self.head if self.tied else self.lm_head.weight)
        return x


def gpt_param_name(runner_name: str) -> str | None:
    """The :class:`framework.base.model.GPT` name of a :class:`PipelineRunner` parameter (for checkpoints
    that load into an unsplit model), or None for the last stage's ``head`` copy (it equals ``wte``).

    ``chunks.<k>.blocks.<N>.attn.qkv.weight`` -> ``blocks.<N>.attn.qkv.weight``;
    ``chunks.0.wte.weight`` -> ``wte.weight``; ``chunks.<last>.head`` -> None.
    """
    parts = runner_name.split(".")
    if len(parts) < 3 or parts[0] != "chunks":
        raise ValueError(f"{runner_name!r} is not a pipeline runner parameter name (chunks.<k>.<name>)")
    rest = ".".join(parts[2:])
    return None if rest == "head" else rest


class PipelineRunner(nn.Module):
    """This rank's stages and the schedule that drives them; ``forward(x, y, num_tokens, num_micro_batches)``
    returns the step's loss.

    In training (module in train mode, autograd on) ``forward`` runs ``schedule.step`` over all
    micro-batches of ``x [m*b, s]`` / ``y [m*b, s]`` - forward and backward, each micro-batch's
    loss :func:`~framework.base.model.gpt.lm_loss` with ``num_tokens`` and ``num_micro_batches`` - syncs the tied
    embedding gradients and returns the mean of the micro-batch losses (a detached 0-dim fp32
    tensor, broadcast to every rank of the pipeline). In evaluation it returns the loss of a
    plain forward (``num_tokens`` None: the mean over the valid targets).
    """

    def __init__(
        self,
        stages: dict[int, GPTStage],
        *,
        num_stages: int,
        pp_group: Any,
        pp_rank: int,
        pp_size: int,
        embed_group: Any,
        schedule_name: str,
        n_microbatches: int,
        micro_batch_size: int,
        seq_len: int,
        d_model: int,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        super().__init__()
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        self.stage_ids = sorted(stages)
        self.chunks = nn.ModuleDict({str(k): stages[k] for k in self.stage_ids})  # parallelized already
        self.num_stages, self.pp_group, self.pp_rank, self.pp_size = num_stages, pp_group, pp_rank, pp_size
        self.embed_group = embed_group
        self.d_model, self.device = d_model, device
        self.has_first, self.has_last = 0 in stages, num_stages - 1 in stages
        self.clock = make_clock(device)
        self._denominator: tuple[Any, int] = (None, 1)  # this step's (num_tokens, num_micro_batches), see forward
        self.step_records: list[tuple[Any, Any, list[tuple[Any, Any]]]] = []  # (start, end, busy spans) per step
        self._busy: list[tuple[Any, Any]] = []
        b, s = micro_batch_size, seq_len
        self.pipe_stages = []
        for k in self.stage_ids:
            # Example tensors fix the shapes (no run-time shape inference); hidden states carry gradients.
            inp = (
                torch.zeros(b, s, dtype=torch.long, device=device)
                if k == 0
                else torch.zeros(b, s, d_model, device=device, requires_grad=True)
            )
            out = torch.zeros(b, s, vocab_size if k == num_stages - 1 else d_model, device=device, requires_grad=True)
            st = PipelineStage(
                self.chunks[str(k)], k, num_stages, device, input_args=(inp,), output_args=(out,), group=pp_group
            )
            meter_stage_sends(st)
            self._time_compute(st)
            self.pipe_stages.append(st)
        if schedule_name == "interleaved_1f1b":
            self.schedule = ScheduleInterleaved1F1B(self.pipe_stages, n_microbatches=n_microbatches, loss_fn=self._loss)
        else:
            cls = ScheduleGPipe if schedule_name == "gpipe" else Schedule1F1B
            self.schedule = cls(self.pipe_stages[0], n_microbatches=n_microbatches, loss_fn=self._loss)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The schedule's loss of one micro-batch: :func:`lm_loss` with this step's denominator."""
        return lm_loss(logits, targets, *self._denominator)

    def _time_compute(self, stage: Any) -> None:
        for method in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            inner = getattr(stage, method)

            def timed(*args: Any, _inner=inner, **kwargs: Any):
                a = self.clock.mark()
                out = _inner(*args, **kwargs)
                self._busy.append((a, self.clock.mark()))
                return out

            setattr(stage, method, timed)

    def tied_params(self) -> tuple[nn.Parameter | None, nn.Parameter | None]:
        """``(wte.weight on the first stage or None, head copy on the last stage or None)`` of this rank."""
        first = self.chunks["0"].wte.weight if self.has_first else None
        last = self.chunks[str(self.num_stages - 1)].head if self.has_last else None
        return first, last

    def forward(
        self, x: torch.Tensor, y: torch.Tensor, num_tokens: torch.Tensor | None = None, num_micro_batches: int = 1
    ) -> torch.Tensor:
        self._denominator = (num_tokens, num_micro_batches)
        if self.training and torch.is_grad_enabled():
            return self._train_step(x, y)
        return self._eval_loss(x, y)

    def _train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for p in self.parameters():  # the optimizer's zero_grad is a no-op under a pipeline (see strategy.py)
            p.grad = None
        start = self.clock.mark()
        self._busy = []
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {"return_outputs": False}
        if self.has_last:
            kwargs.update(target=y, losses=losses)
        if self.has_first:
            self.schedule.step(x, **kwargs)
        else:
            self.schedule.step(**kwargs)
        self.step_records.append((start, self.clock.mark(), self._busy))
        self._sync_tied_grads()
        loss = (
            torch.stack([v.detach().float() for v in losses]).mean()
            if self.has_last
            else torch.zeros((), device=x.device)
        )
        dist.broadcast(loss, group=self.pp_group, group_src=self.pp_size - 1)
        return loss

    def _sync_tied_grads(self) -> None:
        """Sum the gradients of ``wte`` (first stage) and its ``head`` copy (last stage)."""
        if self.embed_group is None:
            return
        for p in self.tied_params():
            if p is None:
                continue
            g = p.grad
            local = g.to_local() if hasattr(g, "to_local") else g
            METER.report("allreduce", local.numel() * local.element_size())
            dist.all_reduce(local, group=self.embed_group)

    @torch.no_grad()
    def _eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        b, s = x.shape
        act = None
        loss = torch.zeros((), device=x.device)
        for k in range(self.num_stages):
            if k % self.pp_size != self.pp_rank:
                continue
            if k == 0:
                inp = x
            else:
                inp = torch.empty(b, s, self.d_model, device=x.device)
                dist.recv(inp, group=self.pp_group, group_src=(k - 1) % self.pp_size)
            act = self.chunks[str(k)](inp)
            if k == self.num_stages - 1:
                loss = lm_loss(act, y, *self._denominator)
            else:
                dist.send(act.contiguous(), group=self.pp_group, group_dst=(k + 1) % self.pp_size)
        dist.broadcast(loss, group=self.pp_group, group_src=self.pp_size - 1)
        return loss

    def take_step_records(self) -> list[tuple[float, float]]:
        """``(busy_s, wall_s)`` of each training step since the last call (waits for the device on CUDA)."""
        recs, self.step_records = self.step_records, []
        if recs:
            self.clock.wait(recs[-1][1])
        return [(sum(self.clock.seconds(a, b) for a, b in busy), self.clock.seconds(s, e)) for s, e, busy in recs]
