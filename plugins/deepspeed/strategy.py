"""Lightning's ``DeepSpeedStrategy``, configured to run on CPU ranks as well as on GPUs.

Lightning refuses a non-CUDA accelerator in ``DeepSpeedStrategy.setup_environment``;
DeepSpeed itself runs on CPU through its CPU accelerator (``DS_ACCELERATOR=cpu``) and a
gloo process group. :class:`ZeroStrategy` changes only what stands in the way, by
subclassing (neither library is patched):

- ``setup_environment`` / ``setup_distributed`` skip the CUDA-only checks on CPU (on CUDA
  they are Lightning's own);
- ``model_sharded_context`` builds the whole model before ``deepspeed.initialize`` partitions
  it (instead of ``deepspeed.zero.Init``), so every stage starts from exactly the weights
  ``single`` starts from (the GPT initialises its weights after construction);
- ``backward`` calls ``engine.backward(loss, scale_wrt_gas=False)``: Lightning already divides
  each micro-batch loss by ``accumulate_grad_batches``, and DeepSpeed would divide again
  (gradients 1/grad_accum_steps too small, which changes clipping and AdamW's epsilon);
- after each optimizer step the step's ``grad_norm`` (``LMModule.step_state``) is DeepSpeed's global gradient
  norm (partitioned gradients are not on the parameters, so the module cannot compute it);
- checkpoints are DeepSpeed's own, inside trainlab's step folders
  (:mod:`plugins.deepspeed.checkpoint`).

Optimizer and schedule: the module's ``torch.optim.AdamW`` and LambdaLR are handed to
``deepspeed.initialize`` as client optimizer and scheduler (``zero_allow_untested_optimizer``);
ZeRO runs that AdamW on its fp32 partitions, and Lightning steps the scheduler. Clipping is
DeepSpeed's ``gradient_clipping`` (global L2 norm, coefficient ``max_norm / (norm + 1e-6)``
as in ``torch.nn.utils.clip_grad_norm_``). No ``fp16``/``bf16`` section is written for
``32-true``, so parameters, gradients and optimizer state stay fp32.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from lightning_fabric.utilities.seed import reset_seed
from pytorch_lightning.accelerators.cuda import CUDAAccelerator
from pytorch_lightning.strategies import DDPStrategy, DeepSpeedStrategy

from framework.base.distributed import process_group_backend, resolve_accelerator
from plugins.deepspeed import merge_dicts


def deepspeed_config(cfg: Any, resolved: Any) -> dict[str, Any]:
    """The DeepSpeed config dict for ``cfg`` (a :class:`DeepSpeedConfig`): trainlab's keys with the
    user's DeepSpeed config (``parallelism.ds_config`` / ``ds_config_path``) merged over them.

    ``gradient_accumulation_steps`` and ``gradient_clipping`` are filled in by Lightning from the
    Trainer (``accumulate_grad_batches``, ``gradient_clip_val``); ``bf16`` by Lightning's
    precision handling for ``bf16-mixed``. The user's keys that contradict the run were refused
    before any rank started (:func:`plugins.deepspeed.check_user_ds_config`).
    """
    zero: dict[str, Any] = {
        "stage": cfg.zero_stage,
        "overlap_comm": cfg.overlap_comm,
        "contiguous_gradients": cfg.contiguous_gradients,
        "reduce_bucket_size": cfg.reduce_bucket_size,
        "allgather_bucket_size": cfg.allgather_bucket_size,
        # Stage 3 partitions every parameter, as in ZeRO §5 (DeepSpeed's default keeps tensors
        # under 1e5 elements whole on every rank, which the cost model would have to list).
        "stage3_param_persistence_threshold": 0,
        "stage3_max_live_parameters": cfg.max_live_parameters,
        "stage3_max_reuse_distance": cfg.max_reuse_distance,
    }
    if cfg.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": cfg.offload_optimizer, "pin_memory": True}
    if cfg.offload_param != "none":
        zero["offload_param"] = {"device": cfg.offload_param, "pin_memory": True}
    ours = {
        "train_micro_batch_size_per_gpu": resolved.micro_batch_size,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # the module's torch.optim.AdamW
        "zero_force_ds_cpu_optimizer": False,  # keep that AdamW under offload too (same update as single)
        "steps_per_print": 1 << 30,  # DeepSpeed's own progress lines off: trainlab logs
        "wall_clock_breakdown": False,
    }
    merged = merge_dicts(ours, cfg.user_ds_config())
    # Lightning writes it from accumulate_grad_batches and refuses it in the config; the plugin's
    # validate has checked that the user's value (if any) is the run's.
    merged.pop("gradient_accumulation_steps", None)
    return merged


def build_strategy(cfg: Any, resolved: Any) -> ZeroStrategy:
    """A :class:`ZeroStrategy` for ``cfg`` on this machine's accelerator (gloo on CPU, NCCL on CUDA)."""
    import logging
    import warnings

    # DeepSpeed calls torch's all_gather_into_tensor / reduce_scatter_tensor, which warn on every call.
    warnings.filterwarnings(
        "ignore", message=r".*torch\.distributed\.\w+_tensor` is deprecated", category=FutureWarning
    )
    accelerator = resolve_accelerator(resolved.run.trainer.accelerator)
    # DeepSpeed picks its accelerator once, at first use; say which before it is imported.
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if accelerator == "cuda" else "cpu")
    if accelerator == "cpu":
        import deepspeed.ops

        # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce kernel at start-up
        # (a C++ toolchain and about a minute per fresh machine; two ranks compile under one file
        # lock) that only its inference all-reduce uses. Mark it unavailable: gloo does the
        # training collectives. (DeepSpeed keeps this dict for the process so that edits persist.)
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return ZeroStrategy(
        config=deepspeed_config(cfg, resolved),
        process_group_backend=process_group_backend(cfg.backend, accelerator),
        timeout=timedelta(seconds=cfg.timeout_s),
        logging_level=logging.WARNING,
    )


class ZeroStrategy(DeepSpeedStrategy):
    """``DeepSpeedStrategy`` that also runs on CPU ranks (see the module docstring)."""

    def setup_environment(self) -> None:
        if isinstance(self.accelerator, CUDAAccelerator):
            super().setup_environment()
        else:  # Lightning's DeepSpeedStrategy stops CPU ranks here; DeepSpeed's CPU accelerator runs them
            DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        if isinstance(self.accelerator, CUDAAccelerator):
            return super().setup_distributed()
        # As Lightning's, minus its check that device indices equal local ranks (CPU devices have no index).
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> tuple[Any, Any]:
        """``deepspeed.initialize`` as Lightning calls it, with a device rank a CPU device has too.

        (Lightning passes ``root_device.index``, which is None for ``cpu``; DeepSpeed compares it with 0.)
        """
        import argparse

        import deepspeed

        device_rank = self.root_device.index if self.root_device.index is not None else self.local_rank
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=device_rank),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        yield  # the whole model first; deepspeed.initialize partitions it (same init as single)

    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        # Lightning has divided the loss by accumulate_grad_batches already.
        return super().backward(closure_loss, optimizer, *args, scale_wrt_gas=False, **kwargs)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """DeepSpeed's step (called on every micro-batch; it updates at the accumulation boundary)."""
        engine = self.deepspeed_engine
        before = engine.global_steps
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if engine.global_steps != before and engine.get_global_grad_norm() is not None:
            self.lightning_module.step_state.grad_norm = float(engine.get_global_grad_norm())
        return out

    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any = None) -> None:
        """DeepSpeed's checkpoint of every rank inside one trainlab step folder (see :mod:`plugins.deepspeed.checkpoint`)."""
        from plugins.deepspeed.checkpoint import save_folder

        save_folder(self, checkpoint, filepath)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Any = None) -> dict[str, Any]:
        """Load a step folder written by :meth:`save_checkpoint`, at this or another world size."""
        from plugins.deepspeed.checkpoint import load_folder

        return load_folder(self, checkpoint_path)
