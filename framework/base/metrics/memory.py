"""Memory a rank actually holds: peak process memory and model-state bytes.

- :func:`peak_memory_bytes`: on CUDA ``torch.cuda.max_memory_allocated`` (tensors allocated by
  PyTorch's caching allocator, not the reserved pool); on CPU the process's peak resident set
  size (``getrusage(RUSAGE_SELF).ru_maxrss``), which also holds the Python interpreter and the
  torch libraries (a few hundred MB before any tensor).
- :func:`model_states_bytes`: parameters + gradients + optimizer state, summed over *distinct*
  tensor storages, so a tied weight, or gradients that are views into DDP's buckets, count once.
  Which tensors a rank holds is the plugin's answer (:meth:`~framework.base.plugin.ParallelPlugin.held_state`;
  :func:`torch_held_state` for plain torch modules and optimizers). The cost model for it is the
  plugin's ``model_states_bytes`` (ZeRO §3.1).
- :class:`SavedTensorMeter`: activation memory, the bytes of the tensors autograd saves for
  backward (``torch.autograd.graph.saved_tensors_hooks``), live and peak; parameters (and views
  of them, e.g. a Linear's transposed weight) are model state and not counted. Independent of
  the allocator and the device, so it is exact on CPU and comparable with Korthikanti et al.
  2022 (Table 2), which counts the same thing.
"""

from __future__ import annotations

import math
import resource
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from framework.base.cost.comm import ModelStats


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


def held_tensors(obj: object, depth: int = 0) -> Iterable[torch.Tensor]:
    """Tensors in ``obj`` when it is a tensor or a (nested, up to 3 deep) list/tuple/dict of them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 3 and isinstance(obj, dict):
        for v in obj.values():
            yield from held_tensors(v, depth + 1)
    elif depth < 3 and isinstance(obj, (list, tuple)):
        for v in obj:
            yield from held_tensors(v, depth + 1)


@dataclass
class HeldState:
    """The model-state tensors one rank holds, by part, as a plugin reports them
    (:meth:`framework.base.plugin.ParallelPlugin.held_state`). Lists may repeat a tensor or hold views
    into one buffer: :func:`model_states_bytes` counts each storage once.

    Attributes:
        params: parameters (and any partition of them a sharding backend keeps beside them).
        grads: gradients (of the parameters, and of whatever the optimizer steps).
        optimizer: every other tensor the optimizer holds (its parameters, e.g. fp32 master
            copies, and its state: AdamW's moments and step counters).
    """

    params: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    optimizer: list[torch.Tensor] = field(default_factory=list)


def torch_held_state(params: Iterable[torch.nn.Parameter], optimizer: object | None) -> HeldState:
    """:class:`HeldState` of ``params`` and a torch optimizer (None: no optimizer yet): the parameters, their
    gradients, and the optimizer's ``param_groups`` tensors, their gradients and its ``state`` tensors.
    The right answer for plain modules, DDP and DTensor (FSDP2, TP) parameters; an object that is not a
    ``torch.optim.Optimizer`` contributes nothing."""
    params = list(params)
    held = HeldState(params=params, grads=[q.grad for q in params if q.grad is not None])
    if isinstance(optimizer, torch.optim.Optimizer):
        for group in optimizer.param_groups:
            for q in group["params"]:
                held.optimizer.append(q)
                if q.grad is not None:
                    held.grads.append(q.grad)
        held.optimizer.extend(v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor))
    return held


def model_states_bytes(held: HeldState) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state held by this rank (see :class:`HeldState`).

    Returns:
        ``{"params", "grads", "optimizer", "total"}`` in bytes; each tensor storage counted once
        over all three, in that order (a gradient that is a view into a DDP bucket counts the
        bucket once; a DTensor counts its local shard; meta tensors count nothing).
    """
    seen: set[tuple[str, int]] = set()
    p = _storage_bytes(held.params, seen)
    g = _storage_bytes(held.grads, seen)
    o = _storage_bytes(held.optimizer, seen)
    return {"params": p, "grads": g, "optimizer": o, "total": p + g + o}


def model_stats(
    module: torch.nn.Module, full_shape: Callable[[torch.nn.Parameter], tuple[int, ...]] = lambda p: tuple(p.shape)
) -> ModelStats:
    """:class:`ModelStats` of ``module``'s trainable parameters (a shared tensor counted once), with their full shapes.

    ``full_shape``: a parameter's unpartitioned shape (the plugin's
    :meth:`~framework.base.plugin.ParallelPlugin.full_param_shape`; default ``p.shape``, which is already
    the global shape for a DTensor).

    Raises:
        ValueError: ``module`` has no trainable parameters.
    """
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the module has no trainable parameters")
    shapes = tuple(tuple(full_shape(p)) for p in params)
    return ModelStats(
        num_params=sum(math.prod(s) for s in shapes),
        num_param_tensors=len(params),
        param_bytes=params[0].element_size(),
        grad_bytes=params[0].element_size(),
        param_shapes=shapes,
    )


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter (FSDP's unsharded one and a DTensor parameter included) or a view of one (a Linear's
    transposed weight). A leaf that is not a parameter (a pipeline stage's received activation) is an activation."""
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


class _Saved:
    """What autograd keeps for one saved tensor while the meter is on: the tensor and its storage key.
    Freed with the graph (after backward, or when a forward's graph is dropped); the meter's count follows."""

    __slots__ = ("tensor", "key", "meter", "__weakref__")

    def __init__(self, tensor: torch.Tensor, key: Any, meter: SavedTensorMeter) -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        if self.key is not None:
            self.meter._release(self.key)


class SavedTensorMeter:
    """Live and peak bytes of the activations autograd holds for backward (see the module docstring).

    Use as a context manager around forward passes (``with meter: loss = model(x)``), or call
    :meth:`start` / :meth:`stop` from hooks. Each saved tensor is counted by the storage it lives
    in, once however many saved tensors share it (q, k and v are views of one ``qkv`` output), and
    released when the last saved tensor on that storage is freed (when backward has consumed the
    graph). A DTensor counts its local shard. Not counted: trainable leaves and views of them
    (model state), and tensors saved while the meter is off.

    Attributes:
        live_bytes: bytes of distinct saved storages alive now.
        peak_bytes: the largest ``live_bytes`` since the last :meth:`reset_peak` (bytes).
    """

    def __init__(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0
        self._refs: dict[Any, list[int]] = {}  # storage key -> [saved tensors alive on it, its bytes]
        self._ctx: Any = None

    def _pack(self, t: torch.Tensor) -> Any:
        local = t.to_local() if hasattr(t, "to_local") else t
        if _is_parameter(t) or local.device.type == "meta":
            return _Saved(t, None, self)
        # Keep a detached alias: the same storage, but no grad_fn, so a saved *output* (log_softmax's)
        # does not hold its own node alive in a reference cycle (which would outlive backward-less graphs).
        t = t.detach()
        st = local.untyped_storage()
        key = (str(local.device), st.data_ptr())
        ref = self._refs.get(key)
        if ref is None:
            self._refs[key] = [1, st.nbytes()]
            self.live_bytes += st.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        else:
            ref[0] += 1
        return _Saved(t, key, self)

    @staticmethod
    def _unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor

    def _release(self, key: Any) -> None:
        ref = self._refs.get(key)
        if ref is None:
            return
        ref[0] -= 1
        if ref[0] == 0:
            del self._refs[key]
            self.live_bytes -= ref[1]

    def reset_peak(self) -> None:
        """Start a new peak from the bytes alive now."""
        self.peak_bytes = self.live_bytes

    def start(self) -> None:
        """Count the tensors saved from now on (this thread's autograd)."""
        if self._ctx is None:
            self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._ctx.__enter__()

    def stop(self) -> None:
        """Stop counting new saved tensors (those already counted are still released when freed)."""
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            ctx.__exit__(None, None, None)

    def __enter__(self) -> SavedTensorMeter:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
