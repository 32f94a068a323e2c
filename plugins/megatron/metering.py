"""Counting what DTensor and the pipeline schedules really send.

- **Tensor parallel.** DTensor (``parallelize_module``'s Colwise/Rowwise/SequenceParallel
  styles) redistributes through PyTorch's *functional* collectives
  (``torch.distributed._functional_collectives``: ``all_reduce``, ``all_gather_single``,
  ``reduce_scatter_single``, ...), forward and backward. :func:`install_funcol_meter` wraps
  those module functions once per process so that each call reports its payload to the run's
  :class:`~framework.base.metrics.timing.CommMeter` (the same idea as
  ``torch.distributed.tensor.debug.CommDebugMode``, which counts calls but not bytes). Payload
  follows :mod:`framework.base.cost.comm`: all-reduce and reduce-scatter = the input, all-gather
  = the gathered output (input x group size).
- **Pipeline parallel.** Each :class:`~torch.distributed.pipelining.PipelineStage` builds its
  point-to-point sends in ``get_fwd_send_ops`` / ``get_bwd_send_ops``;
  :func:`meter_stage_sends` wraps those two methods of one stage object and reports each send's
  tensor bytes as kind ``p2p`` (receives mirror the neighbour's sends and are not counted twice).

Every call is reported to the run's meter (:data:`METER`); which calls count is the framework's
decision (:class:`~framework.rank.callbacks.breakdown.StepBreakdown`'s training window: a training
step's forward, backward and optimizer step; validation and the framework's own reductions are
left out).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from framework.base.metrics.timing import call_group

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


class MeterSlot:
    """The run's :class:`~framework.base.metrics.timing.CommMeter`, where the process-wide wrappers report.

    The functional collectives and ``torch.distributed`` functions are process-wide, so their
    wrappers find the meter here (None before the breakdown callback installs it).
    """

    def __init__(self) -> None:
        self.meter: Any = None

    def report(self, kind: str, nbytes: int, group: Any = None) -> None:
        """Report one collective of ``nbytes`` payload bytes on ``group`` (:meth:`CommMeter.launch`;
        nothing before a meter is installed)."""
        if self.meter is not None:
            self.meter.report(kind, nbytes, group)


METER = MeterSlot()  # one per process: the functional collectives are process-wide functions


def _group_size(group: Any) -> int:
    from torch.distributed import _functional_collectives as funcol

    if isinstance(group, tuple) and len(group) == 2:  # (DeviceMesh, mesh_dim)
        mesh, dim = group
        return mesh.size(dim)
    if isinstance(group, list):
        return len(group)
    return funcol._resolve_group(group).size()


def _process_group(group: Any) -> Any:
    """A functional collective's ``group`` as :meth:`CommMeter.launch` takes it: a ProcessGroup (a
    ``(DeviceMesh, dim)`` pair's, or a named group's), a list of ranks, or None when unresolvable
    (then the step's bytes are not split by node)."""
    from torch.distributed import _functional_collectives as funcol

    if isinstance(group, list):
        return group
    try:
        if isinstance(group, tuple) and len(group) == 2:
            mesh, dim = group
            return mesh.get_group(dim)
        return funcol._resolve_group(group)
    except Exception:
        return _UNKNOWN


_UNKNOWN = object()  # a group the meter cannot resolve (CommMeter: inter_node None)


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
                if (
                    group is None
                ):  # positional: all_reduce(t, op, group) / all_gather(t, dim, group) / reduce_scatter(t, op, dim, group)
                    group = args[1] if kind in ("allreduce", "allgather") else args[2]
                METER.report(
                    kind, payload(tensor, _group_size(group) if kind == "allgather" else 1), _process_group(group)
                )
                return inner(tensor, *args, **kwargs)

            metered._trainlab_metered = True
            return metered

        setattr(funcol, name, make())


def meter_stage_sends(stage: Any) -> None:
    """Report the bytes of every forward-activation and backward-gradient send of ``stage`` (a PipelineStage)."""
    import torch.distributed as dist

    for method in ("get_fwd_send_ops", "get_bwd_send_ops"):
        inner = getattr(stage, method)

        def make(inner=inner):
            def metered(*args: Any, **kwargs: Any):
                ops = inner(*args, **kwargs)
                for op in ops:
                    METER.report("p2p", op.tensor.numel() * op.tensor.element_size(), [dist.get_rank(), op.peer])
                return ops

            return metered

        setattr(stage, method, make())


def install_fsdp_meter() -> None:
    """Wrap the ``torch.distributed`` collectives FSDP2 calls (:func:`plugins.fsdp.fsdp2_collectives`) on the
    ``dp`` mesh dimension, so each call reports to :data:`METER`: all-gather payload = the gathered
    output, reduce-scatter payload = the input. Idempotent."""
    import torch.distributed as dist

    from plugins.fsdp import PAYLOAD_KWARG, fsdp2_collectives

    for name, kind, arg in fsdp2_collectives():
        inner = getattr(dist, name, None)
        if inner is None or getattr(inner, "_trainlab_metered_fsdp", False):
            continue

        def make(inner=inner, kind=kind, arg=arg):
            @functools.wraps(inner)
            def metered(*args: Any, **kwargs: Any):
                t = args[arg] if len(args) > arg else kwargs[PAYLOAD_KWARG[kind]]
                METER.report(kind, t.numel() * t.element_size(), call_group(inner, args, kwargs))
                return inner(*args, **kwargs)

            metered._trainlab_metered_fsdp = True
            return metered

        setattr(dist, name, make())
