"""The LightningModule: a GPT, its loss, AdamW and a warm-up + cosine LR schedule.

Gradient accumulation is Lightning's: with ``accumulate_grad_batches = grad_accum_steps`` it
divides each micro-batch loss by ``grad_accum_steps`` and (under DDP) skips the gradient
all-reduce on every micro-batch but the last.

**Token-weighted loss.** The optimizer step's loss is the mean cross-entropy over the valid
targets (``!= IGNORE_INDEX``) of the whole global batch, however it is split. Each micro-batch
arrives with ``n``, the step's valid targets over all data-parallel ranks
(:mod:`framework.data.step_tokens`), and its loss is its summed cross-entropy divided by
``n / (grad_accum_steps * dp_degree)`` (:func:`~framework.model.gpt.lm_loss`); Lightning's
``1 / grad_accum_steps`` (a pipeline schedule's, with pp) and the data-parallel mean then give
``sum(CE) / n``. A mean of micro-batch means would weigh a target of a micro-batch with few
valid targets more than one of a full micro-batch. Without ignored targets the denominator is
``micro_batch_size * seq_len`` and the loss is bit-identical to the plain mean.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import pytorch_lightning as pl
import torch

from framework.config.resolved import ResolvedRun
from framework.data.step_tokens import valid_targets
from framework.model import GPT
from framework.parallelize import parallelize_gpt
from framework.plugin import ParallelPlugin


def warmup_cosine(step: int, *, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier at optimizer step ``step`` (0-based): linear warm-up, then cosine to ``min_lr_ratio``.

    Counted in optimizer steps, never micro-batches (Lightning steps an ``interval="step"``
    scheduler once per optimizer step).
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


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
        # Sum of this rank's micro-batch losses in the current optimizer step (for logging).
        self.step_loss_sum = torch.zeros(())
        self.step_micro_batches = 0
        self.last_grad_norm = float("nan")
        self.last_lr = float("nan")
        # Fault-injection hooks (framework/faults): a loss -> loss map applied to every micro-batch
        # loss (inf_loss, loss_spike), and a request to end the epoch at the next batch (rollback).
        self.loss_transform: Any = None
        self.end_epoch_requested = False

    def configure_model(self) -> None:
        """Build the GPT (seeded, identical on every rank) and parallelize it by the plugin's plan.

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
            model = GPT(self.resolved.run.model, vocab_size=self.vocab_size)
        # The plugin's plan (pipeline split, TP, DP wrapper) with activation checkpointing and
        # compilation, in torchtitan's order; in-place throughout, so parameter names (and
        # checkpoint keys) stay the GPT's.
        run = self.resolved.run
        model = parallelize_gpt(model, self.plugin.parallel_plan(model, self),
                                activation_checkpointing=run.model.activation_checkpointing, compile=run.trainer.compile)
        self.model = self.plugin.configure_model(model, self)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y, n = batch
        r = self.resolved
        loss = self.model(x, y, n, r.grad_accum_steps * r.layout.dp)  # sum(CE) / (n / micro-batches of the step)
        if self.loss_transform is not None:
            loss = self.loss_transform(loss)
        self.step_loss_sum = self.step_loss_sum.to(loss.device) + loss.detach().float()
        self.step_micro_batches += 1
        return loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        # -1 tells Lightning to end the epoch here; the next one re-iterates the loader (rollback).
        return -1 if self.end_epoch_requested else None

    def take_step_loss(self) -> torch.Tensor:
        """This rank's mean micro-batch loss over the optimizer step just finished; resets the sum."""
        mean = self.step_loss_sum / max(1, self.step_micro_batches)
        self.step_loss_sum = torch.zeros((), device=mean.device)
        self.step_micro_batches = 0
        return mean

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
        self.last_grad_norm = self.plugin.grad_norm(self)
        self.last_lr = float(optimizer.param_groups[0]["lr"])

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        # Clipping by the global norm needs the plugin's norm when parameters are split over ranks.
        if gradient_clip_val:
            self.plugin.clip_gradients(self, optimizer, float(gradient_clip_val))

    def configure_optimizers(self) -> dict[str, Any]:
        o = self.resolved.run.optim
        decay = [p for p in self.model.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.requires_grad and p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            foreach=self.plugin.optimizer_foreach,  # a plugin may need the per-tensor loop (mixed DTensor/Tensor)
        )
        schedule = partial(
            warmup_cosine,
            warmup_steps=o.warmup_steps,
            max_steps=self.resolved.run.trainer.max_steps,
            min_lr_ratio=o.min_lr_ratio,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}
