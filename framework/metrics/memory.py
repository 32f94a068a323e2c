"""Memory a rank actually holds: peak process memory and model-state bytes.

- :func:`peak_memory_bytes`: on CUDA ``torch.cuda.max_memory_allocated`` (tensors allocated by
  PyTorch's caching allocator, not the reserved pool); on CPU the process's peak resident set
  size (``getrusage(RUSAGE_SELF).ru_maxrss``), which also holds the Python interpreter and the
  torch libraries (a few hundred MB before any tensor).
- :func:`model_states_bytes`: parameters + gradients + optimizer state, summed over *distinct*
  tensor storages, so a tied weight, or gradients that are views into DDP's buckets, count once.
  The cost model for it is the plugin's ``model_states_bytes`` (ZeRO §3.1).
"""

from __future__ import annotations

import resource
import sys
from typing import Iterable

import torch

from framework.metrics.comm import ModelStats


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process on ``device`` so far, in bytes (see the module docstring)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


def _storage_bytes(tensors: Iterable[torch.Tensor], seen: set[tuple[str, int]]) -> int:
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        if hasattr(t, "to_local"):  # a sharded DTensor (FSDP2, TP): count the shard this rank holds
            t = t.to_local()
        st = t.untyped_storage()
        key = (str(t.device), st.data_ptr())
        if key in seen or st.nbytes() == 0:
            continue
        seen.add(key)
        total += st.nbytes()
    return total


def model_states_bytes(params: Iterable[torch.nn.Parameter], optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state held by this rank.

    Returns:
        ``{"params", "grads", "optimizer", "total"}`` in bytes; each tensor storage counted once
        over all three (a gradient that is a view into a DDP bucket counts the bucket once).
    """
    params = list(params)
    seen: set[tuple[str, int]] = set()
    p = _storage_bytes(params, seen)
    g = _storage_bytes((q.grad for q in params if q.grad is not None), seen)
    o = 0
    if optimizer is not None:
        o = _storage_bytes((v for state in optimizer.state.values() for v in state.values()), seen)
    return {"params": p, "grads": g, "optimizer": o, "total": p + g + o}


def model_stats(module: torch.nn.Module) -> ModelStats:
    """:class:`ModelStats` of ``module``'s trainable parameters (a shared tensor counted once)."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the module has no trainable parameters")
    return ModelStats(
        num_params=sum(p.numel() for p in params),
        num_param_tensors=len(params),
        param_bytes=params[0].element_size(),
        grad_bytes=params[0].element_size(),
    )
