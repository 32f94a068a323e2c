"""Where each optimizer step's time goes, what it communicated and what memory it held.

Per optimizer step the wall time between two step ends is cut into consecutive spans by
marks taken in Lightning hooks (:mod:`framework.base.metrics.timing`: host clock on CPU, CUDA
events on the GPU timeline, no synchronisation inside a step):

============== ==========================================================================
category       spans (summed over the step's micro-batches)
============== ==========================================================================
data_wait      previous batch end -> ``on_train_batch_start``: fetching the batch, host->
               device copy, and under DDP Lightning's per-batch SIGTERM broadcast
compute        ``on_train_batch_start`` -> ``on_after_backward``: forward + backward, minus
               the exposed communication below
comm           exposed (not overlapped) gradient communication: from the launch of the last
               collective of a backward pass until ``backward()`` returns (DDP waits there
               for every bucket). Bucket all-reduces launched earlier overlap the rest of the
               backward and cannot be separated from compute; their launch->completion time
               is logged apart as ``perf/comm_inflight_s`` (not a fraction). ``single``: 0.
optimizer      ``on_before_optimizer_step`` -> optimizer step-post hook: grad-norm, clipping,
               AdamW update
ckpt_blocking  seconds a checkpoint save held the step (reported by the checkpoint callback to
               the step clock)
other          everything else: Lightning bookkeeping between hooks, LR scheduler, metric
               logging (the callbacks' writes and the per-step tracking request, see
               :meth:`StepBreakdown.add_logging_time`)
============== ==========================================================================

**What counts as communication** is the framework's decision, not the plugin's: the plugin's
meter hooks report every collective they see (``install_comm_meter``), and the
:class:`~framework.base.metrics.timing.CommMeter` counts them only inside the training window this
callback keeps (it runs in the step's ``accounting`` phase, :mod:`framework.rank.step`, so its hooks run after the
others' of the same name):

- open from ``on_train_batch_start`` (the training forward) to ``on_after_backward`` (the end of
  the backward, after the gradient reductions a backward waits for);
- open again from ``on_before_optimizer_step`` (after the other callbacks' hooks, e.g. the fault
  guard's health gather) until the optimizer step returns: the plugin's gradient norm and
  clipping, and what the step itself sends (DeepSpeed ZeRO-1/2's parameter all-gather). The
  end of the step is the step post-hook of the optimizer Lightning steps, or, for a wrapper
  without hooks (DeepSpeed's ZeRO optimizers), its ``step`` returning; at the latest
  ``on_train_batch_end`` closes it;
- closed everywhere else: the other callbacks' ``on_train_batch_end`` work (metric reductions,
  checkpoints), and validation, which also pauses every meter
  (:func:`~framework.base.metrics.timing.comm_paused`).

Validation passes are left out of the step (as from throughput). Its ``accounting`` phase comes
after every other part but :class:`~framework.rank.callbacks.metric_flush.FlushMetrics` (phase ``send``:
it only sends what the others wrote), so that the checkpoint and validation parts run inside the
step they belong to. The spans partition the step, so the fractions add to 1 up to clock
error; ``perf/breakdown_step_s`` (their sum) can be checked against ``perf/step_time_s``.

Logged on rank 0 at logging steps, as means over the post-warm-up steps since the last
logging step: ``perf/<category>_s``, ``perf/<category>_frac``, ``perf/breakdown_step_s``,
``perf/step_time_std_s``; ``perf/comm_bytes`` (payload bytes per step, measured by the
plugin's collectives through :class:`~framework.base.metrics.timing.CommMeter`), by kind
``perf/comm_bytes_<kind>``, ring bytes on the wire ``perf/comm_bytes_wire`` (derived from the
measured payload of each kind with the group size the plugin's estimate gives that kind), on
several nodes ``perf/comm_bytes_inter_node`` / ``perf/comm_bytes_intra_node`` (the payload of
collectives whose process group spans nodes / stays in one, from each collective's group), and
the plugin's model ``perf/comm_bytes_model`` / ``perf/comm_bytes_wire_model``; ``mem/peak_bytes`` (max over ranks),
``mem/model_states_bytes`` (the largest sample of a logged step -- after each backward, before
the optimizer step and at the step's end --, max over ranks) and ``mem/model_states_bytes_model``. At the end,
``mem/model_states_bytes`` is the largest of the logged steps' values (not a sample taken after
training, when ZeRO has freed its gradient partitions), and over all timed steps: ``perf/<category>_frac_mean``, ``perf/<category>_s_mean``,
``perf/step_time_std_s_run`` (standard deviation of the step times) and
``perf/breakdown_step_s_mean`` (which, less ``perf/ckpt_blocking_s_mean``, is StepMetrics'
``perf/step_time_s_mean`` up to this callback's last metric write). Per logged window the two
step times differ by which window pays for a metric write (StepMetrics writes before its clock
reads, this callback after), so compare them over the whole run.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch

from framework.base.cost.comm import CommEstimate
from framework.base.metrics.emit import MetricEmitter
from framework.base.metrics.memory import model_states_bytes, model_stats, peak_memory_bytes
from framework.base.metrics.timing import CommMeter, CommRecord, comm_paused, make_clock
from framework.rank.callbacks.clock import StepClock

CATEGORIES = ("data_wait", "compute", "comm", "optimizer", "ckpt_blocking", "other")


class _Step:
    """One finished optimizer step: its spans and host-measured adjustments (seconds)."""

    __slots__ = ("spans", "ckpt_s", "excluded_s", "carry_s", "comm")

    def __init__(self, spans: list, ckpt_s: float, excluded_s: float, carry_s: float, comm: list[CommRecord]) -> None:
        self.spans = spans
        self.ckpt_s = ckpt_s
        self.excluded_s = excluded_s
        self.carry_s = carry_s
        self.comm = comm


class StepBreakdown(pl.Callback):
    """Step-time breakdown, communication bytes and memory (see the module docstring).

    Step ends, warm-up and the seconds of validation and checkpoint saves come from the run's
    :class:`~framework.rank.callbacks.clock.StepClock`.

    Args:
        clock: the run's step clock (step ends, warm-up, validation and checkpoint seconds).
        plugin: the run's parallelism plugin (``comm_volume``, ``model_states_bytes``, ``held_state``,
            ``full_param_shape``, ``inner_optimizer``,
            ``install_comm_meter``).
        resolved: the validated run (passed to the plugin's cost model).
        log_every_n_steps: optimizer steps between logged points.
        warmup_steps_excluded: steps after a (re)start left out.
        emit: the run's metric emitter (writes on rank 0).
    """

    def __init__(
        self,
        *,
        clock: StepClock,
        plugin: Any,
        resolved: Any,
        log_every_n_steps: int,
        warmup_steps_excluded: int,
        emit: MetricEmitter,
    ) -> None:
        self.step_clock = clock
        self.plugin = plugin
        self.resolved = resolved
        self.log_every = log_every_n_steps
        self.warmup = warmup_steps_excluded
        self.emit = emit
        self.model_figures: dict[str, float] = {}
        self._totals: dict[str, float] = defaultdict(float)
        self._timed_steps = 0
        self._walls: list[float] = []  # wall time of every timed step (s), for the run's spread
        self._window: list[_Step] = []
        self._hook_handle = None
        self._unhook_step_end: Callable[[], None] | None = None
        self._states_peak = 0  # largest model-state bytes sampled within the current logged step
        self._states_run_peak = 0.0  # largest logged mem/model_states_bytes (max over ranks) of the run
        # seconds of logging to count in the next step; set here too: a flush on a failure before the first
        # step (a refused checkpoint) adds to it, and must not raise over the failure it reports
        self._carry_s = 0.0
        self._reset_step()

    # -- helpers -------------------------------------------------------------------------
    def _span(self, category: str, a: Any, b: Any) -> None:
        self._spans.append((category, a, b))

    def _reset_step(self) -> None:
        self._spans: list = []
        # the step clock's running totals when this step began (its checkpoint and validation seconds are the growth)
        self._ckpt_mark = self.step_clock.checkpoint_s
        self._validation_mark = self.step_clock.validation_s

    def _resolve(self, step: _Step) -> tuple[dict[str, float], float]:
        """Seconds per category of one step, and the in-flight seconds of its collectives."""
        sec: dict[str, float] = dict.fromkeys(CATEGORIES, 0.0)
        for cat, a, b in step.spans:
            sec[cat] += self.clock.seconds(a, b)
        # Checkpoint and validation ran inside the step's last "other" span; this callback's
        # own logging ran inside the next step's first data-wait span.
        sec["other"] = max(0.0, sec["other"] - step.ckpt_s - step.excluded_s) + step.carry_s
        sec["data_wait"] = max(0.0, sec["data_wait"] - step.carry_s)
        sec["ckpt_blocking"] = step.ckpt_s
        inflight = sum(self.clock.seconds(r.launched, r.completed) for r in step.comm if r.completed is not None)
        return sec, inflight

    def _states_now(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> int:
        return model_states_bytes(
            self.plugin.held_state(pl_module, trainer.optimizers[0] if trainer.optimizers else None)
        )["total"]

    def _sample_states(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Keep the largest model-state bytes seen within a step that will be logged.

        Sampled after each backward and before the optimizer step as well as at the step's end:
        some plugins hold gradients only within the step (DeepSpeed ZeRO frees them after it).
        """
        step = trainer.global_step + 1
        if step % self.log_every == 0 or step == trainer.max_steps:
            self._states_peak = max(self._states_peak, self._states_now(trainer, pl_module))

    def _memory(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, float]:
        """Peak memory and model-state bytes of this rank, max over ranks (a collective: call on all ranks)."""
        states = max(self._states_peak, self._states_now(trainer, pl_module))
        self._states_peak = 0
        local = torch.tensor(
            [peak_memory_bytes(pl_module.device), states], dtype=torch.float64, device=pl_module.device
        )
        with comm_paused():
            peak, total = trainer.strategy.reduce(local, reduce_op="max").tolist()
        self._states_run_peak = max(self._states_run_peak, total)
        return {"mem/peak_bytes": peak, "mem/model_states_bytes": total}

    # -- hooks ---------------------------------------------------------------------------
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.clock = make_clock(pl_module.device)
        self.meter = CommMeter(self.clock, ranks_per_node=self.resolved.layout.nproc_per_node)
        self.meter.close()  # counts inside the training window only (module docstring)
        self.plugin.install_comm_meter(trainer.strategy.model, self.meter)
        if trainer.optimizers:
            opt = trainer.optimizers[0]
            inner = self.plugin.inner_optimizer(opt)  # a wrapper's (DeepSpeed ZeRO's) torch optimizer is timed
            self._unhook_step_end = _after_step(opt, self.meter.close, hookable=inner is opt)
            self._hook_handle = inner.register_step_post_hook(self._after_optimizer_step)
        stats = model_stats(pl_module, self.plugin.full_param_shape)
        est = self.plugin.comm_volume(stats, self.resolved)
        self.estimate: CommEstimate = est
        self.model_figures = {
            "perf/comm_bytes_model": float(est.total_payload_bytes),
            "perf/comm_bytes_wire_model": float(est.total_wire_bytes),
            **{f"perf/comm_bytes_{k}_model": float(v) for k, v in est.payload_bytes.items()},
            "mem/model_states_bytes_model": float(self.plugin.model_states_bytes(stats, self.resolved)),
        }
        self._carry_s = 0.0
        self._reset_step()
        self._prev_end = self._last = self.clock.mark()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        t = self.clock.mark()
        self._span("data_wait", self._prev_end, t)
        self._last = t
        self.meter.open()  # the training forward begins

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        t = self.clock.mark()
        self._span("compute", self._last, t)
        self._last = t
        self._launch_before = self.meter.last_launch()

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.meter.close()  # the backward (and the reductions it waits for) ended
        self._sample_states(trainer, pl_module)
        t = self.clock.mark()
        launched = self.meter.last_launch()
        if launched is not None and launched is not self._launch_before:
            self._span("compute", self._last, launched)
            self._span("comm", launched, t)
        else:
            self._span("compute", self._last, t)
        self._last = t

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._sample_states(trainer, pl_module)
        t = self.clock.mark()
        self._span("other", self._last, t)
        self._last = self._opt_start = t
        self.meter.open()  # the plugin's gradient norm, clipping and the optimizer step (closed when it returns)

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        t = self.clock.mark()
        self._span("optimizer", self._opt_start, t)
        self._last = t

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.meter.close()  # normally closed already (after backward / the optimizer step)
        t = self.clock.mark()
        self._span("other", self._last, t)
        self._prev_end = self._last = t
        if not self.step_clock.step_ended:
            return  # inside gradient accumulation
        step = trainer.global_step
        clock = self.step_clock
        finished = _Step(
            self._spans,
            clock.checkpoint_s - self._ckpt_mark,
            clock.validation_s - self._validation_mark,
            self._carry_s,
            self.meter.take(),
        )
        self._reset_step()
        self._carry_s = 0.0
        if clock.steps_since_start > self.warmup:
            self._window.append(finished)
        if not (step % self.log_every == 0 or step == trainer.max_steps):
            return
        t0 = time.perf_counter()
        metrics = {**self.model_figures, **self._memory(trainer, pl_module)}
        if self._window:
            self.clock.wait(t)
            metrics.update(self._window_metrics())
        self.emit(metrics, step)
        self._window = []
        self._carry_s = time.perf_counter() - t0  # this logging delays the next batch: count it as "other"

    def _window_metrics(self) -> dict[str, float]:
        n = len(self._window)
        self._timed_steps += n
        sums: dict[str, float] = dict.fromkeys(CATEGORIES, 0.0)
        walls: list[float] = []
        inflight = 0.0
        bytes_by_kind: dict[str, int] = defaultdict(int)
        inter: int | None = 0
        for st in self._window:
            sec, fl = self._resolve(st)
            for k, v in sec.items():
                sums[k] += v
                self._totals[k] += v
            walls.append(sum(sec.values()))
            self._walls.append(walls[-1])
            inflight += fl
            for k, v in CommMeter.bytes_by_kind(st.comm).items():
                bytes_by_kind[k] += v
            step_inter = CommMeter.inter_node_bytes(st.comm)
            inter = None if inter is None or step_inter is None else inter + step_inter
        wall = sum(walls)
        out = {f"perf/{k}_s": v / n for k, v in sums.items()}
        out.update({f"perf/{k}_frac": (v / wall if wall > 0 else 0.0) for k, v in sums.items()})
        out["perf/breakdown_step_s"] = wall / n
        out["perf/step_time_std_s"] = statistics.stdev(walls) if n > 1 else 0.0
        out["perf/comm_inflight_s"] = inflight / n
        payload = {k: v / n for k, v in bytes_by_kind.items()}
        out["perf/comm_bytes"] = float(sum(payload.values()))
        out["perf/comm_bytes_wire"] = float(self.estimate.wire_bytes(payload))
        out.update({f"perf/comm_bytes_{k}": float(v) for k, v in payload.items()})
        if self.resolved.layout.nnodes > 1 and inter is not None:  # every collective's group known
            out["perf/comm_bytes_inter_node"] = inter / n
            out["perf/comm_bytes_intra_node"] = out["perf/comm_bytes"] - inter / n
        return out

    def add_logging_time(self, seconds: float) -> None:
        """Metrics were sent for ``seconds`` after this callback's step end (the per-step flush of the
        buffered tracking sink, :class:`~framework.rank.callbacks.metric_flush.FlushMetrics`): that time
        falls in the next step's first data-wait span and is counted as ``other``, like this
        callback's own logging."""
        self._carry_s += seconds

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.meter.close()  # an epoch ended by a skipped batch (rollback) never reaches on_train_batch_end

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.meter.close()
        if self._hook_handle is not None:
            self._hook_handle.remove()
            self._hook_handle = None
        if self._unhook_step_end is not None:
            self._unhook_step_end()
            self._unhook_step_end = None
        run_peak = self._states_run_peak
        metrics = self._memory(trainer, pl_module)
        # Keep the run's largest logged value, not this after-training sample: ZeRO-1/2 hold no
        # gradient partition after a step (less), and a pipeline stage's FSDP2 root unit is still
        # gathered after the last validation forward (more: the embeddings unsharded).
        metrics["mem/model_states_bytes"] = run_peak or metrics["mem/model_states_bytes"]
        total = sum(self._totals.values())
        if total > 0:
            metrics.update({f"perf/{k}_frac_mean": v / total for k, v in self._totals.items()})
            metrics.update({f"perf/{k}_s_mean": v / self._timed_steps for k, v in self._totals.items()})
            metrics["perf/breakdown_step_s_mean"] = total / self._timed_steps
            metrics["perf/step_time_std_s_run"] = statistics.stdev(self._walls) if len(self._walls) > 1 else 0.0
        self.emit(metrics, trainer.global_step)


def _after_step(optimizer: Any, fn: Callable[[], None], *, hookable: bool) -> Callable[[], None]:
    """Call ``fn()`` each time ``optimizer.step`` returns; returns the function that undoes it.

    ``hookable``: a torch optimizer: a step post-hook (public API). Otherwise a plugin's wrapper
    (:meth:`~framework.base.plugin.ParallelPlugin.inner_optimizer` is another object; e.g. DeepSpeed's ZeRO
    optimizers, which all-gather the updated parameters after their inner optimizer's step):
    its ``step`` is wrapped on the instance.
    """
    if hookable:
        handle = optimizer.register_step_post_hook(lambda *args: fn())
        return handle.remove
    had_own = "step" in vars(optimizer)
    inner = optimizer.step

    def step(*args: Any, **kwargs: Any) -> Any:
        try:
            return inner(*args, **kwargs)
        finally:
            fn()

    optimizer.step = step

    def undo() -> None:
        if had_own:
            optimizer.step = inner
        else:
            del optimizer.step

    return undo
