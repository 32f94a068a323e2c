"""MLflow tracking: the driver owns the run, rank 0 writes metrics into it.

The driver (which outlives every rank) creates or re-opens the run, logs params (the flattened
resolved config), tags and the resolved config artifact, and sets the final status, so a run
that fails ends FAILED (or KILLED on Ctrl-C), never stuck RUNNING. Rank 0 only writes metrics, to
the run folder's outbox (:class:`MetricOutbox`; ranks never import MLflow), and the driver sends them
to the run (:class:`MetricForwarder`). Every MLflow call during training is best-effort: a tracking
error is warned about once and never stops training.

A run is identified by ``experiment_name/run_name`` (tag ``trainlab.run_key``): running the same
command again resumes the checkpoint *and* continues the same MLflow run.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

RUN_KEY_TAG = "trainlab.run_key"
NOTE_TAG = "mlflow.note.content"  # MLflow's own: a run's or an experiment's description in the UI
KIND_TAG = "mlflow.experimentKind"  # MLflow 3's own: which UI an experiment opens in
SWEEP_TAG = "trainlab.sweep"  # "parent" on a sweep's parent run (framework.driver.sweep)
SWEPT_TAG = "trainlab.swept"  # on a child: its swept values, ``key=value,...``
OVERRIDES_TAG = "trainlab.overrides"  # on a child: the job's whole override string
PARENT_TAG = "mlflow.parentRunId"  # MLflow's own: the UI nests the child under the parent
# Paths and tracking settings: they differ between runs without changing what is trained, so they
# stay out of the params (the MLflow compare view would line runs up by them) and in the
# resolved_config.yaml artifact.
LEFT_OUT_PARAMS = frozenset(
    {
        "checkpoint.dir",
        "data.cache_dir",
        "derived.checkpoint_dir",
        "experiment_description",
        "tracking.uri",
        "tracking.enabled",
        "tracking.system_metrics_interval_s",
        "trainer.progress_bar",
    }
)
_BAD_KEY_CHARS = re.compile(r"[^\w/.\- ]")


def sanitize_key(key: str) -> str:
    """MLflow keys allow only letters, digits, ``_ - . /`` and space; replace anything else with ``_``."""
    return _BAD_KEY_CHARS.sub("_", key)


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": "1"}``; lists become their JSON text."""
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, (list, tuple)) else str(v)
    return out


def git_commit(path: str | Path = ".") -> str:
    """The current git commit of ``path`` (with ``-dirty`` when there are uncommitted changes), or ``unknown``."""
    try:
        sha = subprocess.run(
            ["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class DriverRun:
    """The driver's handle on one MLflow run (create or resume, params, tags, artifacts, status)."""

    def __init__(self, uri: str, experiment_name: str, description: str = "") -> None:
        """Open (or create) the experiment ``experiment_name``; a non-empty ``description`` becomes
        its description in the UI (tag ``mlflow.note.content``), replacing an older one. An
        experiment without a kind is marked a model-training one (tag ``mlflow.experimentKind``),
        so MLflow 3's UI opens it on its training-runs view rather than its GenAI one."""
        from mlflow.tracking import MlflowClient

        # MLflow sets its loggers to INFO on import; keep its "Creating initial MLflow database
        # tables" chatter out of the run's output.
        logging.getLogger("mlflow").setLevel(logging.WARNING)
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(experiment_name)
        self.experiment_id = exp.experiment_id if exp else self.client.create_experiment(experiment_name)
        if description and (exp is None or exp.tags.get(NOTE_TAG) != description):
            self.client.set_experiment_tag(self.experiment_id, NOTE_TAG, description)
        if exp is None or KIND_TAG not in exp.tags:
            self.client.set_experiment_tag(self.experiment_id, KIND_TAG, "custom_model_development")
        self.run_id: str | None = None
        self.monitor: Any = None  # MLflow's system metrics monitor, when started (open_driver_run)

    def find(self, run_key: str) -> str | None:
        """Id of the newest run tagged ``trainlab.run_key == run_key`` in this experiment, or None."""
        run = find_run(self.client, self.experiment_id, run_key)
        return run.info.run_id if run else None

    def start(self, *, run_name: str, run_key: str, resume_run_id: str | None) -> str:
        """Re-open ``resume_run_id`` (status back to RUNNING) or create a new run; returns its id."""
        if resume_run_id is not None:
            self.client.update_run(resume_run_id, status="RUNNING")
            self.run_id = resume_run_id
        else:
            run = self.client.create_run(self.experiment_id, run_name=run_name, tags={RUN_KEY_TAG: run_key})
            self.run_id = run.info.run_id
        return self.run_id

    def log_params(self, params: Mapping[str, str]) -> None:
        """Log params (values cut to MLflow's limit); a value that changed on resume is logged as a tag instead."""
        from mlflow.entities import Param

        existing = self.client.get_run(self.run_id).data.params
        fresh = {k: v[:6000] for k, v in params.items() if k not in existing}
        changed = {f"changed.{k}": v[:5000] for k, v in params.items() if k in existing and existing[k] != v[:6000]}
        items = [Param(sanitize_key(k), v) for k, v in fresh.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])
        if changed:
            self.set_tags(changed)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        for k, v in tags.items():
            self.client.set_tag(self.run_id, sanitize_key(k), str(v))

    def clear_tag(self, key: str) -> None:
        """Remove tag ``key`` from the run if it has it."""
        if key in self.client.get_run(self.run_id).data.tags:
            self.client.delete_tag(self.run_id, key)

    def log_metrics(self, metrics: Mapping[str, float], step: int = 0) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id, metrics=[Metric(sanitize_key(k), float(v), ts, step) for k, v in metrics.items()]
        )

    def log_text(self, text: str, artifact_file: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / artifact_file
            path.write_text(text)
            self.client.log_artifact(self.run_id, str(path))

    def log_artifact(self, path: str | Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def end(self, status: str) -> None:
        """Set the terminal status: FINISHED, FAILED or KILLED."""
        self.client.set_terminated(self.run_id, status=status)

    def metric_history(self, key: str) -> list[tuple[int, float]]:
        return [(m.step, m.value) for m in self.client.get_metric_history(self.run_id, key)]


def find_run(client: Any, experiment_id: str, run_key: str) -> Any:
    """The newest MLflow run of ``experiment_id`` tagged ``trainlab.run_key == run_key``, or None."""
    runs = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_key}'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    return runs[0] if runs else None


def start_system_metrics(uri: str, run_id: str, interval_s: float, *, resume: bool) -> Any:
    """Start MLflow's system metrics monitor (``system/*``: CPU, memory, disk, network; GPU with
    ``nvidia-ml-py``) for ``run_id``, sampling every ``interval_s`` seconds in a daemon thread of
    the driver, i.e. the whole machine the ranks run on. Returns the monitor (call ``finish()``)
    or None when it could not start (warned, never raised: tracking must not stop training).
    """
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # its start/stop notes are noise
        monitor = SystemMetricsMonitor(run_id, sampling_interval=interval_s, resume_logging=resume, tracking_uri=uri)
        monitor.start()
        return monitor
    except Exception as err:  # e.g. psutil missing
        log.warning("MLflow system metrics are off: %s", err)
        return None


def _first_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return lines[0] if lines else type(err).__name__


def derived_params(resolved: Any, model: Any) -> dict[str, Any]:
    """Values the driver derived (layout, its nodes and the mesh axes whose groups cross nodes, the plugin's ZeRO
    stage, batch split in sequences, tokens per step, checkpoint folder) and the model's size (``model``: the
    configured GPT, e.g. on the meta device)."""
    from framework.base.registry import get_plugin_class

    lay = resolved.layout
    return {
        "derived.dp_degree": lay.dp,
        "derived.tp_degree": lay.tp,
        "derived.pp_degree": lay.pp,
        "derived.zero_stage": get_plugin_class(resolved.plugin_name)(resolved.run.parallelism).zero_stage,
        "derived.world_size": resolved.world_size,
        "derived.nnodes": lay.nnodes,
        "derived.nproc_per_node": lay.nproc_per_node,
        "derived.cross_node_axes": ",".join(lay.cross_node_axes()) or "none",
        "derived.micro_batch_size": resolved.micro_batch_size,
        "derived.grad_accum_steps": resolved.grad_accum_steps,
        "derived.global_batch_size": resolved.global_batch_size,
        "derived.tokens_per_step": resolved.tokens_per_step,
        "derived.checkpoint_dir": resolved.checkpoint_dir,
        "derived.vocab_size": model.vocab_size,
        "model.num_params": model.num_params(exclude_position_embedding=False),
        "model.num_flops_params": model.num_flops_params(),
    }


def open_driver_run(resolved: Any, model: Any, *, resumed: bool) -> DriverRun:
    """Open the run's MLflow run (re-open it when ``resumed``) and log what the run is.

    Params: the flattened config and :func:`derived_params`, less :data:`LEFT_OUT_PARAMS`; tags: plugin, world size, layout,
    git commit; artifact ``resolved_config.yaml``. Starts MLflow's system metrics
    (``tracking.system_metrics_interval_s`` > 0); :func:`finish_driver_run` stops them.

    Raises:
        ConfigError: the tracking URI cannot be used (a bad URI, an unreachable server), one line,
            before any rank starts.
    """
    from omegaconf import OmegaConf

    from framework.base.config.schema import ConfigError, run_to_dict

    run = resolved.run
    run_key = f"{run.experiment_name}/{run.run_name}"
    try:
        tracker = DriverRun(run.tracking.uri, run.experiment_name, run.experiment_description)
        tracker.start(run_name=run.run_name, run_key=run_key, resume_run_id=tracker.find(run_key) if resumed else None)
    except Exception as err:
        raise ConfigError(
            f"tracking.uri={run.tracking.uri!r}: {_first_line(err)} (allowed: a sqlite:///, file:// or"
            " http(s):// MLflow URI; or tracking=none)"
        ) from None
    config = run_to_dict(run)
    params = {**flatten(config), **{k: str(v) for k, v in derived_params(resolved, model).items()}}
    tracker.log_params({k: v for k, v in params.items() if k not in LEFT_OUT_PARAMS})  # all of it: resolved_config.yaml
    lay = resolved.layout
    tracker.set_tags(
        {
            "plugin": resolved.plugin_name,
            "world_size": resolved.world_size,
            "layout": lay.describe(),
            "git_commit": git_commit(Path(__file__).resolve().parents[2]),
        }
    )
    tracker.log_text(OmegaConf.to_yaml(OmegaConf.create(config)), "resolved_config.yaml")
    print(
        f"trainlab: MLflow run {tracker.run_id} in experiment {run.experiment_name!r} ({run.tracking.uri})", flush=True
    )
    if run.tracking.system_metrics_interval_s > 0:
        tracker.monitor = start_system_metrics(
            run.tracking.uri, tracker.run_id, run.tracking.system_metrics_interval_s, resume=resumed
        )
    return tracker


def log_token_cache_input(tracker: DriverRun, cache: Any, data: Any) -> None:
    """Log the run's token cache as its MLflow dataset input (the UI's "Datasets used" column); never raises.

    The dataset is named after the corpus (``data.name``), its digest is the cache key's hash (the
    same digest: the same files, tokenizer and split), its source the cache folder, and its profile
    the token and document counts and vocabulary size (from the cache's ``meta.json``).
    """
    from mlflow.entities import Dataset, DatasetInput, InputTag

    meta = cache.meta
    key = str(meta.get("key", cache.dir.name))
    profile = {
        "train_tokens": cache.train_tokens,
        "val_tokens": cache.val_tokens,
        "vocab_size": cache.vocab_size,
        **{k: meta[k] for k in ("train_docs", "val_docs") if k in meta},
    }
    try:
        dataset = Dataset(
            name=str(data.name),
            digest=key.rsplit("-", 1)[-1][:16],
            source_type="local",
            source=json.dumps({"uri": str(Path(cache.dir).resolve())}),
            profile=json.dumps(profile),
        )
        tracker.client.log_inputs(
            tracker.run_id, datasets=[DatasetInput(dataset, tags=[InputTag("mlflow.data.context", "train")])]
        )
    except Exception as err:  # tracking must not fail a run
        print(
            f"trainlab: warning: could not log the token cache as the run's dataset: {_first_line(err)}",
            file=sys.stderr,
            flush=True,
        )


def steps_done(run_dir: str | Path) -> int:
    """Optimizer steps the run has trained (``train/steps`` of its ``summary.json``; 0 without one)."""
    summary = Path(run_dir) / "summary.json"
    if summary.exists():
        return int(json.loads(summary.read_text()).get("train/steps", 0))
    return 0


def finish_driver_run(
    tracker: DriverRun, status: str, *, run_dir: Path, started_at: float, error: str | None, resumed: bool
) -> None:
    """Close the attempt's MLflow bookkeeping; never raises (a tracking error is a warning).

    Stops the system metrics, logs ``time/attempt_wall_s`` (seconds since ``started_at``, a
    ``time.time()``) at the step reached, the ``metrics.jsonl`` and ``faults.jsonl`` (the fault
    log of :mod:`framework.base.faults.events`, when the run has one) artifacts, the ``error`` tag and
    ``error.txt`` of a failed attempt (or clears an earlier attempt's tag when ``resumed``), the
    profiler traces, and sets ``status`` (FINISHED, FAILED or KILLED).
    """
    if tracker.monitor is not None:
        tracker.monitor.finish()
    try:
        tracker.log_metrics({"time/attempt_wall_s": time.time() - started_at}, step=steps_done(run_dir))
        for record in ("metrics.jsonl", "faults.jsonl"):  # every execution of every step; the fault log
            if (run_dir / record).exists():
                tracker.log_artifact(run_dir / record)
        if error is not None:  # why a FAILED run failed, next to its metrics in the MLflow UI
            # MLflow caps a tag's length: keep the head (exception, failed rank) and the tail.
            tracker.set_tags({"error": error if len(error) <= 4000 else f"{error[:1500]}\n...\n{error[-2400:]}"})
            tracker.log_artifact(run_dir / "error.txt")
        elif resumed:
            tracker.clear_tag("error")  # an earlier attempt failed; this one did not
        if (run_dir / "profile").is_dir():  # trainer.profile_steps traces, one per rank
            tracker.client.log_artifacts(tracker.run_id, str(run_dir / "profile"), artifact_path="profile")
        tracker.end(status)
    except Exception as err:  # never mask the training outcome with a tracking error
        print(f"trainlab: warning: could not finalise the MLflow run: {err}", file=sys.stderr)


def outbox_path(run_dir: str | Path, run_id: str) -> Path:
    """Rank 0's metrics for MLflow run ``run_id``, in the run folder: ``mlflow_outbox_<run_id>.jsonl``
    (:class:`MetricOutbox` writes it, :class:`MetricForwarder` in the driver sends it). Named by the run, so a
    folder whose run starts over as a new MLflow run (no checkpoint to resume) never sends the old one's points."""
    return Path(run_dir) / f"mlflow_outbox_{run_id}.jsonl"


class MetricOutbox:
    """Rank 0's metric sink for the driver's MLflow run: a buffer, flushed once per logged step into
    the run folder's outbox file (:func:`outbox_path`), which the driver's :class:`MetricForwarder` sends to MLflow.

    Rank 0 itself never imports MLflow: its client and SQL store cost ~2.3 s of CPU per rank server
    (measured on the 2-core machine), on the ranks' critical path before their first step, and the
    driver, which owns the run, has them loaded already.

    ``outbox(metrics, step)`` only buffers; :meth:`flush` appends everything buffered as one line per
    step, ``{"step": s, "ts": ms, "metrics": {key: value}}``, in one write
    (:class:`~framework.rank.callbacks.metric_flush.FlushMetrics` calls it once per logged optimizer
    step, after every callback has written that step's metrics; a checkpoint step also right before its
    save). Points buffered for one ``(key, step)`` merge, the last write winning (e.g. the run's peak
    memory written at the end replaces the last step's sample); the points of one flush share its
    timestamp (milliseconds since the epoch), which MLflow keeps. A step rolled back before its flush
    (:meth:`discard_after`) is never written: its replay is. Params and tags go as ``{"params": {...}}``
    and ``{"tags": {...}}`` lines.

    The file outlives the ranks and the driver: what a killed driver had not sent yet, the next driver
    of the same run sends (:class:`MetricForwarder` drops the points MLflow holds already). A line cut by
    a killed rank 0 is ended when the next rank 0 opens the file, and the forwarder skips it.
    Warns once on a write error and never raises (training goes on without MLflow).

    Args:
        path: the outbox file (:func:`outbox_path`); appended to, never truncated.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._warned = False
        self._pending: dict[int, dict[str, float]] = {}  # step -> key -> value
        self._end_a_cut_line()

    def _end_a_cut_line(self) -> None:
        """End the line an earlier rank 0 was killed in the middle of, so that it stays one unreadable line (the
        forwarder skips it) instead of swallowing this rank's first record."""
        try:
            with open(self.path, "rb+") as f:
                if f.seek(0, 2) and (f.seek(-1, 2), f.read(1))[1] != b"\n":
                    f.write(b"\n")
        except FileNotFoundError:
            pass
        except OSError as err:
            self._warn(err)

    def __call__(self, metrics: Mapping[str, float], step: int) -> None:
        bucket = self._pending.setdefault(int(step), {})
        for k, v in metrics.items():
            bucket[sanitize_key(k)] = float(v)

    def discard_after(self, step: int) -> None:
        """Drop buffered points of steps after ``step`` (training was rewound to ``step``)."""
        for s in [s for s in self._pending if s > step]:
            del self._pending[s]

    def flush(self) -> None:
        """Append the buffered points, one line per step in step order, in one write."""
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        ts = int(time.time() * 1000)
        self._append([{"step": step, "ts": ts, "metrics": pending[step]} for step in sorted(pending)])

    def log_params(self, params: Mapping[str, str]) -> None:
        """Params for the run (e.g. how the peak FLOP/s was obtained); a key the run holds already keeps its value."""
        self._append([{"params": {sanitize_key(k): str(v) for k, v in params.items()}}])

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Tags for the run (set, or replaced, when the driver sends them)."""
        self._append([{"tags": {sanitize_key(k): str(v) for k, v in tags.items()}}])

    def _append(self, records: list[dict]) -> None:
        try:
            with open(self.path, "a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in records))
        except OSError as err:  # tracking must never stop training
            self._warn(err)

    def _warn(self, err: BaseException) -> None:
        if not self._warned:
            log.warning("MLflow outbox not writable (training goes on; further errors are silent): %s", err)
            self._warned = True


class MetricForwarder:
    """The driver's side of :class:`MetricOutbox`: sends what rank 0 wrote to the MLflow run, every
    ``interval_s`` seconds in a daemon thread of the driver while the ranks run (a context manager),
    and the rest when it stops, before the driver finishes the run.

    **One point per step.** MLflow keeps every point it is sent and cannot delete one, so a step run
    again after a resume (or an elastic restart) must not be sent twice: a point whose step is at or
    below the newest step MLflow holds for its key is dropped. The newest step of each key is read
    from the run (one ``get_run``) before the first request, so a resumed run continues each key's
    history where it ended; MLflow therefore holds the *first* completed execution of a replayed step
    (exact resume makes it equal to the replay; after a shrink the replayed steps ran at the new world
    size, docs/metrics.md); ``metrics.jsonl`` keeps every execution in order.

    **Nothing lost, nothing sent twice.** How far the outbox was sent is kept next to it
    (``<outbox>.sent``: a byte offset, advanced only after MLflow accepted the lines before it), so the
    next driver of the run (after a kill, or with nothing left to train) starts there and sends what was
    left. A failed request (or ``get_run``) sends nothing more in this poll and is tried again at the next;
    the final drain stops at its first failure, so a hung tracking server delays the driver's end by one
    request's timeout at most (what is left goes with the next driver). Every poll sends its new points in
    one ``log_batch`` (more only past MLflow's 1000 metrics per request), with the timestamps rank 0 wrote.
    Warns once on a tracking error and never raises.

    Args:
        client: an ``MlflowClient`` (tests pass a stand-in with ``get_run``, ``log_batch``,
            ``log_param``, ``set_tag``).
        run_id: the driver's run.
        path: the outbox file (:func:`outbox_path`); it need not exist yet.
        interval_s: seconds between polls of the file (> 0).
    """

    MAX_METRICS_PER_REQUEST = 1000  # MLflow's log_batch limit

    def __init__(self, client: Any, run_id: str, path: str | Path, interval_s: float = 1.0) -> None:
        import threading

        self.client = client
        self.run_id = run_id
        self.path = Path(path)
        self.sent_path = self.path.with_name(self.path.name + ".sent")
        self.interval_s = interval_s
        self._offset = self._read_sent()  # bytes of the file MLflow holds (whole lines only)
        self._newest: dict[str, int] | None = None  # key -> newest step MLflow holds (None: not read yet)
        self._warned = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> MetricForwarder:
        import threading

        self._thread = threading.Thread(target=self._poll, name="trainlab-metric-forwarder", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.forward()

    def _poll(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.forward()

    def forward(self) -> int:
        """Send the outbox's complete lines not sent before, up to the first failed request; returns the
        points sent."""
        with self._lock:
            records, end = self._read_new()
            if not records:
                self._commit(end)
                return 0
            from mlflow.entities import Metric

            if self._newest is None:
                try:
                    self._newest = {
                        m.key: int(m.step) for m in self.client.get_run(self.run_id).data.to_proto().metrics
                    }
                except Exception as err:  # tried again at the next poll
                    self._warn(err)
                    return 0
            newest = dict(self._newest)
            batch = []
            for r in records:
                for k, v in r.get("params", {}).items():
                    try:  # an existing key keeps its value (MLflow refuses another)
                        self.client.log_param(self.run_id, k, v)
                    except Exception:
                        pass
                for k, v in r.get("tags", {}).items():
                    if not self._call(self.client.set_tag, self.run_id, k, v):
                        return 0
                step, ts = r.get("step"), r.get("ts", 0)
                for k, v in r.get("metrics", {}).items() if isinstance(step, int) else ():
                    if step > newest.get(k, -1):
                        batch.append(Metric(k, v, ts, step))
                        newest[k] = step
            sent = 0
            for i in range(0, len(batch), self.MAX_METRICS_PER_REQUEST):
                chunk = batch[i : i + self.MAX_METRICS_PER_REQUEST]
                if not self._call(self.client.log_batch, self.run_id, metrics=chunk):
                    return sent  # the offset stays: the next poll sends the rest (the points sent are dropped then)
                for m in chunk:
                    self._newest[m.key] = max(self._newest.get(m.key, -1), m.step)
                sent += len(chunk)
            self._commit(end)
            return sent

    def _read_new(self) -> tuple[list[dict], int]:
        """The complete lines after the sent offset (lines that are not JSON, cut by a killed rank 0, left out)
        and the offset after them."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return [], self._offset
        end = data.rfind(b"\n") + 1  # a line rank 0 is still writing waits for the next poll
        records = []
        for line in data[:end].splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # a line cut by a killed rank 0 (its next incarnation ended it, MetricOutbox)
                continue
            if isinstance(record, dict):
                records.append(record)
        return records, self._offset + end

    def _read_sent(self) -> int:
        try:
            return int(self.sent_path.read_text())
        except (FileNotFoundError, ValueError):
            return 0

    def _commit(self, end: int) -> None:
        if end != self._offset:
            self._offset = end
            try:
                self.sent_path.write_text(str(end))
            except OSError as err:  # the next driver re-reads more (its newest steps drop what MLflow holds)
                self._warn(err)

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> bool:
        try:
            fn(*args, **kwargs)
            return True
        except Exception as err:  # tracking must never stop training
            self._warn(err)
            return False

    def _warn(self, err: BaseException) -> None:
        if not self._warned:
            log.warning("MLflow logging failed (training goes on; further errors are silent): %s", err)
            self._warned = True


class JsonlMetricSink:
    """Appends ``{"step": ..., **metrics}`` lines to a file (works without MLflow; read by tests and the summary)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def __call__(self, metrics: Mapping[str, float], step: int) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": int(step), **{k: float(v) for k, v in metrics.items()}}) + "\n")


def read_jsonl_metrics(path: str | Path) -> list[dict[str, float]]:
    """All records of a :class:`JsonlMetricSink` file, in write order."""
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def sweep_children(client: Any, parent_run_id: str) -> list[Any]:
    """The parent's child runs, the newest per run key (a job re-run without a checkpoint makes a new run)."""
    parent = client.get_run(parent_run_id)
    runs = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.`{PARENT_TAG}` = '{parent_run_id}'",
        max_results=5000,
        order_by=["attributes.start_time DESC"],
    )
    newest: dict[str, Any] = {}
    for r in runs:
        newest.setdefault(r.data.tags.get(RUN_KEY_TAG, r.info.run_id), r)
    return list(newest.values())
