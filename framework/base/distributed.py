"""Process-level settings shared by the launcher, the worker and the plugins.

CPU ranks share the machine's cores: with R ranks on a node each rank gets
``cores // R`` intra-op threads (at least 1), because R ranks x T threads > cores makes every
rank thrash (gloo collectives then wait on descheduled peers). On CUDA each rank drives one GPU
and the cap only limits the host-side thread pool.
"""

from __future__ import annotations

import os

import torch


def resolve_accelerator(accelerator: str) -> str:
    """``auto`` becomes ``cuda`` when a GPU is visible, else ``cpu``.

    Raises:
        ValueError: ``cuda`` was asked for and no GPU is visible.
    """
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.accelerator='cuda' but no CUDA device is visible; allowed here: auto, cpu")
    return accelerator


def process_group_backend(backend: str, accelerator: str) -> str:
    """``auto`` becomes NCCL on CUDA and gloo on CPU."""
    if backend == "auto":
        return "nccl" if accelerator == "cuda" else "gloo"
    return backend


def cap_threads(n: int) -> None:
    """Cap this process's torch intra-op threads (and children's OpenMP pools) at ``n``."""
    os.environ["OMP_NUM_THREADS"] = str(n)
    os.environ["MKL_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)
