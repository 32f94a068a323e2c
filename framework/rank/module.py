"""The LightningModule: a decoder (GPT or Llama, ``model.arch``), its loss, AdamW and a warm-up + cosine LR schedule.

Gradient accumulation is Lightning's: with ``accumulate_grad_batches = grad_accum_steps`` it
divides each micro-batch loss by ``grad_accum_steps`` and (under DDP) skips the gradient
all-reduce on every micro-batch but the last.

**Token-weighted loss.** The optimizer step's loss is the mean cross-entropy over the valid
targets (``!= IGNORE_INDEX``) of the whole global batch, however it is split. Each micro-batch
arrives with ``n``, the step's valid targets over all data-parallel ranks
(:mod:`framework.rank.data.step_tokens`), and its loss is its summed cross-entropy divided by
``n / (grad_accum_steps * dp_degree)`` (:func:`~framework.base.model.gpt.lm_loss`); Lightning's
``1 / grad_accum_steps`` (a pipeline schedule's, with pp) and the data-parallel mean then give
``sum(CE) / n``. A mean of micro-batch means would weigh a target of a micro-batch with few
valid targets more than one of a full micro-batch. Without ignored targets the denominator is
``micro_batch_size * seq_len`` and the loss is bit-identical to the plain mean.

A step's update can be dropped (the fault guard, :mod:`framework.rank.faults.guard`, sets
``StepState.drop_update``, :mod:`framework.rank.step`): the optimizer step then changes no parameter
and no optimizer state, and the LR schedule does not advance. The schedule counts *applied*
updates, as DeepSpeed's engine (no scheduler step on a skipped step) and Megatron-LM/NeMo (the
scheduler advances only when the update succeeded) do, so ``optimizer_updates`` can be below
``trainer.global_step`` (steps attempted).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import pytorch_lightning as pl
import torch

from framework.base.model import build_model
from framework.base.parallelize import parallelize_gpt
from framework.base.plugin import ParallelPlugin
from framework.base.resolved import ResolvedRun
from framework.rank.data.step_tokens import valid_targets
from framework.rank.faults.lightning_adapter import closes_optimizer_step
from framework.rank.step import StepState


def warmup_cosine(step: int, *, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier for the update after ``step`` applied ones (0-based): linear warm-up, then cosine to ``min_lr_ratio``.

    Counted in applied optimizer updates, never micro-batches nor dropped steps (Lightning steps
    an ``interval="step"`` scheduler once per optimizer step, :meth:`LMModule.lr_scheduler_step`
    only when the update was applied). ``max_steps`` is ``trainer.max_steps``: after ``k`` dropped
    steps a run ends ``k`` updates short of the schedule's end.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def rescale_lr_state(checkpoint: dict[str, Any], lr: float) -> float:
    """Make a Lightning checkpoint resume at peak LR ``lr`` (``optim.lr`` of the run loading it); returns new/old.

    The LR scheduler's ``base_lrs`` and the optimizer's param groups (``lr``, ``initial_lr``) are
    restored from the checkpoint after ``configure_optimizers``, so without this a run resumed
    with another ``optim.lr`` would go on at the saved one. Used by an elastic shrink with
    ``resilience.shrink_batch=scale`` (the LR scaled with the global batch, Goyal et al. 2017
    §2.1); a plain resume has the saved LR and is left unchanged (ratio 1). Edits ``checkpoint``
    in place (keys ``lr_schedulers``, ``optimizer_states``; either may be absent).
    """
    ratio = 1.0
    for sched in checkpoint.get("lr_schedulers") or []:
        old = sched.get("base_lrs") or []
        if old and old[0] > 0 and not math.isclose(old[0], lr, rel_tol=1e-12):
            ratio = lr / old[0]
            sched["base_lrs"] = [b * ratio for b in old]
            if "_last_lr" in sched:
                sched["_last_lr"] = [x * ratio for x in sched["_last_lr"]]
    if ratio != 1.0:
        for opt in checkpoint.get("optimizer_states") or []:
            for group in opt.get("param_groups", []):
                group["lr"] = group["lr"] * ratio
                if "initial_lr" in group:
                    group["initial_lr"] = group["initial_lr"] * ratio
    return ratio


FUSED_ADAMW_DEVICES = ("cuda", "cpu")
"""Devices with a fused AdamW kernel in torch (one kernel for all parameters; its step counts stay on the device)."""


def adamw_implementation(plugin_foreach: bool | None, device_type: str, precision: str = "32-true") -> dict[str, bool]:
    """AdamW's implementation keyword: ``fused=True`` on a device with a fused kernel, unless the plugin
    needs the per-tensor loop (``plugin_foreach`` False: a parameter list mixing DTensor shards and plain
    tensors) or the precision is fp16 (``16-mixed``: Lightning unscales the gradients before clipping only
    for optimizers that do not unscale themselves, as fused ones do); else the plugin's ``foreach``
    choice (None: torch's).

    Fused rather than foreach: besides launching fewer kernels, its step counters live on the
    parameters' device, while the foreach and per-tensor paths keep them on the host and read each
    one back (``.item()``) every step (a device sync on CUDA when ``capturable`` is off).
    """
    if plugin_foreach is not False and device_type in FUSED_ADAMW_DEVICES and not precision.startswith("16"):
        return {"fused": True}
    return {"foreach": plugin_foreach}


def keep_implementation(optimizer: torch.optim.Optimizer) -> None:
    """``Optimizer.load_state_dict`` post-hook: this run's implementation flags (``fused``, ``foreach``, set at
    construction by :func:`adamw_implementation`) back in every parameter group, and each step counter where that
    implementation keeps it (fused: on the parameter's device; otherwise on the host), whatever the checkpoint's run
    used: a checkpoint of ``single`` (fused) resumed under tensor parallelism (the per-tensor loop) would otherwise
    run the fused kernel on DTensor shards."""
    for group in optimizer.param_groups:
        for key in ("fused", "foreach"):
            if key in optimizer.defaults:
                group[key] = optimizer.defaults[key]
        on_device = bool(group.get("fused")) or bool(group.get("capturable"))
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].to(p.device if on_device else torch.device("cpu"), torch.float32)


class LMModule(pl.LightningModule):
    """Causal language modelling on windows of ``seq_len + 1`` tokens.

    Train batches are ``(x, y, n)``: ``x``, ``y`` ``LongTensor[micro_batch_size, seq_len]`` and ``n``
    the step's valid targets over all data-parallel ranks (0-dim int64; see the module docstring).
    """

    def __init__(self, resolved: ResolvedRun, vocab_size: int, plugin: ParallelPlugin) -> None:
        super().__init__()
        self.resolved = resolved
        self.vocab_size = vocab_size
        self.plugin = plugin
        self.model: torch.nn.Module | None = None
        # What the step's phases tell each other (loss sum, dropped update, grad norm, LR, fault
        # transforms, a rollback's end of epoch): framework.rank.step, shared with the TrainStep callback.
        self.step_state = StepState()

    def configure_model(self) -> None:
        """Build the decoder (seeded, identical on every rank) and parallelize it by the plugin's plan.

        Idempotent, as Lightning requires: a second call does nothing.
        """
        if self.model is not None:
            return
        # Initialised on the CPU whatever the accelerator: Lightning builds the model under the
        # strategy's device (CUDA for single/ddp, CPU for ModelParallelStrategy), and CUDA's
        # generator draws other numbers than the CPU's for the same seed, so on a GPU fsdp and
        # single started from different weights (seen on an H200: step-5 loss 8.065 vs 8.129).
        # Every plugin moves or shards the model to its device afterwards.
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.manual_seed(self.resolved.run.trainer.seed)
            model = build_model(self.resolved.run.model, vocab_size=self.vocab_size)
        # The plugin's plan (pipeline split, TP, DP wrapper) with activation checkpointing and
        # compilation, in torchtitan's order; in-place throughout, so parameter names (and
        # checkpoint keys) stay the GPT's.
        run = self.resolved.run
        model = parallelize_gpt(
            model,
            self.plugin.parallel_plan(model, self),
            activation_checkpointing=run.model.activation_checkpointing,
            compile=run.trainer.compile,
        )
        self.model = self.plugin.configure_model(model, self)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y, n = batch
        r = self.resolved
        loss = self.model(x, y, n, r.grad_accum_steps * r.layout.dp)  # sum(CE) / (n / micro-batches of the step)
        return self.step_state.add_loss(loss)  # a scheduled loss fault applied; summed for the step's logged loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        # -1 tells Lightning to end the epoch here; the next one re-iterates the loader (rollback).
        return -1 if self.step_state.end_epoch_requested else None

    @property
    def optimizer_updates(self) -> int:
        """Optimizer updates applied so far (dropped steps excluded): the LR schedule's own count,
        saved in checkpoints and snapshots with it (``LambdaLR.last_epoch``)."""
        return int(self.lr_schedulers().last_epoch)

    @torch.no_grad()
    def eval_loss_sum(self, batches) -> torch.Tensor:
        """``[summed cross-entropy, valid targets]`` of this rank over ``batches`` of ``(x, y)``.

        Summed (not averaged) so that shards of different sizes combine exactly across ranks;
        their ratio is the token-weighted mean, as in training.
        """
        was_training = self.model.training
        self.model.eval()
        acc = torch.zeros(2, device=self.device)
        one = torch.ones((), dtype=torch.int64, device=self.device)
        for x, y in batches:
            x, y = x.to(self.device), y.to(self.device)
            with self.trainer.precision_plugin.forward_context():
                loss_sum = self.model(x, y, one).float()  # denominator 1: the sum
            acc[0] += loss_sum
            acc[1] += valid_targets(y)
        self.model.train(was_training)
        return acc

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Gradients here are complete (after the data-parallel reduction) and not yet clipped;
        # the plugin knows how its gradients are split over ranks (ParallelPlugin.grad_norm).
        if not closes_optimizer_step(self.trainer):
            return  # a strategy that accumulates itself calls this on every micro-batch
        s = self.step_state
        norm, s.judged_grad_norm = s.judged_grad_norm, None
        s.grad_norm = self.plugin.grad_norm(self) if norm is None else norm
        s.lr = float(optimizer.param_groups[0]["lr"])

    def _drop_if_requested(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Any:
        """Step pre-hook of the module's optimizer: with ``step_state.drop_update`` set, no parameter has a
        gradient when the update runs, so AdamW changes neither weights nor moments nor its step count.

        Two ways the optimizer is stepped, one hook: Lightning passes a closure that runs the
        forward, backward and ``on_before_optimizer_step`` (where the fault guard decides) inside
        ``step``, so the gradients are cleared when that closure returns; a wrapper that steps this
        optimizer itself after the backward, on its own tensors (DeepSpeed's ZeRO optimizers, on
        their fp32 partitions with the gradients they reduced), calls it without a closure, and
        they are cleared at once. Clearing ``p.grad`` of the module's parameters would reach the
        first case only.
        """

        def clear() -> None:
            if self.step_state.drop_update:
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        p.grad = None

        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args: (optimizer, closure?)
        if closure is None:
            clear()
            return None

        def closure_then_clear() -> Any:
            out = closure()
            clear()
            return out

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_clear}
        return (args[0], closure_then_clear, *args[2:]), kwargs

    def lr_scheduler_step(self, scheduler: Any, metric: Any = None) -> None:
        """Advance the LR schedule by one applied update; a dropped step leaves it (and the LR) as it was."""
        if not self.step_state.drop_update:
            scheduler.step()
            return
        # The LR the schedule set, undoing any in-step scaling (the post-shrink re-warm-up).
        for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ) -> None:
        # Clipping by the global norm needs the plugin's norm when parameters are split over ranks.
        if gradient_clip_val:
            self.plugin.clip_gradients(self, optimizer, float(gradient_clip_val))

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Resume at this run's ``optim.lr`` (:func:`rescale_lr_state`; differs only after a batch-scaling shrink)."""
        self._lr_rescaled = rescale_lr_state(checkpoint, self.resolved.run.optim.lr)

    def on_train_start(self) -> None:
        # A sharded strategy restores the optimizer inside load_checkpoint, before on_load_checkpoint: after an LR
        # rescale, the first resumed step takes its LR from the (rescaled) scheduler, as every later step does.
        if getattr(self, "_lr_rescaled", 1.0) != 1.0:
            scheduler = self.lr_schedulers()
            for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
                group["lr"] = lr

    def configure_optimizers(self) -> dict[str, Any]:
        o = self.resolved.run.optim
        decay = [p for p in self.model.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.requires_grad and p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            **adamw_implementation(
                self.plugin.optimizer_foreach, self.device.type, self.resolved.run.trainer.precision
            ),
        )
        schedule = partial(
            warmup_cosine,
            warmup_steps=o.warmup_steps,
            max_steps=self.resolved.run.trainer.max_steps,
            min_lr_ratio=o.min_lr_ratio,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        optimizer.register_step_pre_hook(self._drop_if_requested)
        optimizer.register_load_state_dict_post_hook(keep_implementation)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}
