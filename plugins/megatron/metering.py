"""Counting what DTensor and the pipeline schedules really send.

- **Tensor parallel.** DTensor (``parallelize_module``'s Colwise/Rowwise/SequenceParallel
  styles) redistributes through PyTorch's *functional* collectives
  (``torch.distributed._functional_collectives``: ``all_reduce``, ``all_gather_single``,
  ``reduce_scatter_single``, ...), forward and backward. :func:`install_funcol_meter` wraps
  those module functions once per process so that each call reports its payload to the run's
  :class:`~framework.metrics.timing.CommMeter` (the same idea as
  ``torch.distributed.tensor.debug.CommDebugMode``, which counts calls but not bytes). Payload
  follows :mod:`framework.metrics.comm`: all-reduce and reduce-scatter = the input, all-gather
  = the gathered output (input x group size).
- **Pipeline parallel.** Each :class:`~torch.distributed.pipelining.PipelineStage` builds its
  point-to-point sends in ``get_fwd_send_ops`` / ``get_bwd_send_ops``;
  :func:`meter_stage_sends` wraps those two methods of one stage object and reports each send's
  tensor bytes as kind ``p2p`` (receives mirror the neighbour's sends and are not counted twice).

Only training counts: a gate (:class:`MeterGate`) is opened by a training forward (module in
train mode with autograd on) and closed by an evaluation forward, so validation passes and
the framework's own metric reductions are left out.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

# function name -> (kind, how to get payload bytes from (tensor, group size))
_FUNCOL: dict[str, tuple[str, Callable[[torch.Tensor, int], int]]] = {
    "all_reduce": ("allreduce", lambda t, n: t.numel() * t.element_size()),
    "all_gather_single": ("allgather", lambda t, n: t.numel() * t.element_size() * n),
    "all_gather_tensor": ("allgather", lambda t, n: t.numel() * t.element_size() * n),
    "all_gather_single_autograd": ("allgather", lambda t, n: t.numel() * t.element_size() * n),
    "all_gather_tensor_autograd": ("allgather", lambda t, n: t.numel() * t.element_size() * n),
    "reduce_scatter_single": ("reduce_scatter", lambda t, n: t.numel() * t.element_size()),
    "reduce_scatter_tensor": ("reduce_scatter", lambda t, n: t.numel() * t.element_size()),
    "reduce_scatter_single_autograd": ("reduce_scatter", lambda t, n: t.numel() * t.element_size()),
    "reduce_scatter_tensor_autograd": ("reduce_scatter", lambda t, n: t.numel() * t.element_size()),
}


class MeterGate:
    """Where metered collectives report, and whether they count right now.

    ``meter`` is the run's CommMeter (None before the breakdown callback installs it);
    ``open`` is set by :meth:`watch`'s forward pre-hook.
    """

    def __init__(self) -> None:
        self.meter: Any = None
        self.open = False

    def report(self, kind: str, nbytes: int) -> None:
        """Count one collective of ``nbytes`` payload bytes (no-op while closed)."""
        if self.meter is not None and self.open:
            self.meter.complete(self.meter.launch(kind, nbytes))

    def watch(self, module: torch.nn.Module) -> None:
        """Open the gate at each training forward of ``module``, close it at each evaluation forward."""

        def pre_hook(mod: torch.nn.Module, args: Any, kwargs: Any = None) -> None:
            self.open = mod.training and torch.is_grad_enabled()

        module.register_forward_pre_hook(pre_hook)


GATE = MeterGate()  # one per process: the functional collectives are process-wide functions


def _group_size(group: Any) -> int:
    from torch.distributed import _functional_collectives as funcol

    if isinstance(group, tuple) and len(group) == 2:  # (DeviceMesh, mesh_dim)
        mesh, dim = group
        return mesh.size(dim)
    if isinstance(group, list):
        return len(group)
    return funcol._resolve_group(group).size()


def install_funcol_meter() -> None:
    """Wrap the functional collectives DTensor calls (idempotent; see the module docstring)."""
    from torch.distributed import _functional_collectives as funcol

    for name, (kind, payload) in _FUNCOL.items():
        inner = getattr(funcol, name, None)
        if inner is None or getattr(inner, "_trainlab_metered", False):
            continue

        def make(inner=inner, kind=kind, payload=payload):
            @functools.wraps(inner)
            def metered(tensor: torch.Tensor, *args: Any, **kwargs: Any):
                group = kwargs.get("group")
                if group is None:  # positional: all_reduce(t, op, group) / all_gather(t, dim, group) / reduce_scatter(t, op, dim, group)
                    group = args[1] if kind in ("allreduce", "allgather") else args[2]
                GATE.report(kind, payload(tensor, _group_size(group) if kind == "allgather" else 1))
                return inner(tensor, *args, **kwargs)

            metered._trainlab_metered = True
            return metered

        setattr(funcol, name, make())


def meter_stage_sends(stage: Any) -> None:
    """Report the bytes of every forward-activation and backward-gradient send of ``stage`` (a PipelineStage)."""
    for method in ("get_fwd_send_ops", "get_bwd_send_ops"):
        inner = getattr(stage, method)

        def make(inner=inner):
            def metered(*args: Any, **kwargs: Any):
                ops = inner(*args, **kwargs)
                for op in ops:
                    GATE.report("p2p", op.tensor.numel() * op.tensor.element_size())
                return ops

            return metered

        setattr(stage, method, make())


def install_fsdp_meter() -> None:
    """Wrap the ``torch.distributed`` collectives FSDP2 calls (:func:`plugins.fsdp.fsdp2_collectives`) on the
    ``dp`` mesh dimension, so each call reports to :data:`GATE`: all-gather payload = the gathered
    output, reduce-scatter payload = the input. Idempotent."""
    import torch.distributed as dist

    from plugins.fsdp import PAYLOAD_KWARG, fsdp2_collectives

    for name, kind, arg in fsdp2_collectives():
        inner = getattr(dist, name, None)
        if inner is None or getattr(inner, "_trainlab_gated", False):
            continue

        def make(inner=inner, kind=kind, arg=arg):
            @functools.wraps(inner)
            def metered(*args: Any, **kwargs: Any):
                t = args[arg] if len(args) > arg else kwargs[PAYLOAD_KWARG[kind]]
                GATE.report(kind, t.numel() * t.element_size())
                return inner(*args, **kwargs)

            metered._trainlab_gated = True
            return metered

        setattr(dist, name, make())
