"""The driver: ``python -m framework.train [overrides]`` (a Hydra app; ``-m`` sweeps).

One job = validate the config (every bad value is a one-line error, exit code 2, before any
rank starts or MLflow run opens) -> prepare the token cache -> open (or re-open) the MLflow
run -> start the ranks with the elastic agent -> set the run's final status -> print a summary.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from framework.config.schema import ConfigError


def run_name_from_overrides(override_dirname: str) -> str:
    """A stable, path-safe run name from Hydra's ``job.override_dirname`` (``default`` when empty)."""
    if not override_dirname:
        return "default"
    name = re.sub(r"[^\w.,=+\-]", "_", override_dirname)
    if len(name) > 140:  # keep folder names well under the 255-byte limit, still unique
        name = name[:120] + "-" + hashlib.sha1(name.encode()).hexdigest()[:10]
    return name


OmegaConf.register_new_resolver("tl_run_name", run_name_from_overrides, replace=True)


FULL_STATE_KINDS = ("full", "delta", "dcp")  # checkpoint kinds that gather into one full state


def can_load(caps, kind: str) -> bool:
    """Whether a plugin with capabilities ``caps`` resumes from a checkpoint of manifest kind ``kind``."""
    return kind == caps.checkpoint_format or (caps.loads_full_state and kind in FULL_STATE_KINDS)


def presets_writing(kind: str, conf_dir: Path | None = None) -> list[str]:
    """``conf/parallelism`` presets whose plugin writes checkpoints of manifest kind ``kind`` (imports every plugin class)."""
    from framework.registry import available_plugins, get_plugin_class

    conf_dir = conf_dir or CONF_DIR
    writers = {n for n in available_plugins() if get_plugin_class(n).capabilities.checkpoint_format == kind}
    return sorted(p.stem for p in (conf_dir / "parallelism").glob("*.yaml")
                  if re.search(r"^name:\s*(\S+)", p.read_text(), re.M).group(1) in writers)


def _first_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return lines[0] if lines else type(err).__name__


def _steps_done(run_dir: Path) -> int:
    summary = run_dir / "summary.json"
    if summary.exists():
        return int(json.loads(summary.read_text()).get("train/steps", 0))
    return 0


_LOCKS: list = []  # open lock files, held until the process exits


def _hold_run_lock(*dirs: Path) -> None:
    """Refuse to run two drivers on the same run folder or checkpoint folder at once (exit code 2)."""
    import fcntl

    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        f = open(d / ".trainlab.lock", "a+")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            _fail(f"another trainlab process is running in {d} (the same run); wait for it, or set another run_name")
        _LOCKS.append(f)


def _fail(msg: str) -> None:
    print(f"trainlab: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def _print_summary(run_dir: Path, run_id: str | None, uri: str, experiment: str) -> None:
    from framework.tracking import read_jsonl_metrics

    records = read_jsonl_metrics(run_dir / "metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}

    def last(key: str) -> float | None:
        vals = [r[key] for r in records if key in r]
        return vals[-1] if vals else None

    def fmt(v: float | None, spec: str) -> str:
        return "n/a" if v is None else format(v, spec)

    val_initial, val_final = last("val/loss_initial"), last("val/loss_final")
    lines = [
        "",
        "trainlab summary",
        f"  steps              {fmt(last('train/steps'), '.0f')}",
        f"  train loss (final) {fmt(last('train/loss_final'), '.4f')}",
        f"  val loss           {fmt(val_initial, '.4f')} -> {fmt(val_final, '.4f')}"
        + (f"  (x{val_final / val_initial:.3f})" if val_initial and val_final else ""),
        f"  tokens/s (mean)    {fmt(summary.get('perf/tokens_per_sec_mean'), ',.0f')}",
        f"  MFU (mean)         {fmt(summary.get('perf/mfu_mean'), '.3f')}",
        f"  metrics file       {run_dir / 'metrics.jsonl'}",
    ]
    if run_id:
        mlflow_bin = Path(sys.executable).parent / "mlflow"
        lines += [
            f"  MLflow run         {run_id} (experiment {experiment!r})",
            f"  see it with        {mlflow_bin if mlflow_bin.exists() else 'mlflow'} ui --backend-store-uri {uri}",
        ]
    print("\n".join(lines), flush=True)


_FAILED_JOBS: list[str] = []  # run names of this process's sweep jobs that ended FAILED


def _in_sweep() -> bool:
    """Whether this job is one of a Hydra multirun (``-m`` or a preset with ``hydra.mode: MULTIRUN``)."""
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def run_job(cfg: DictConfig, run_dir: Path) -> None:
    """Run one Hydra job (one MLflow run). Exits with code 2 on a configuration error."""
    from framework.checkpoint.format import find_latest_valid, list_checkpoints, read_manifest, verify
    from framework.config.validate import load_run_config, run_to_dict, validate
    from framework.registry import get_plugin_class

    try:
        run = load_run_config(cfg)
        resolved = validate(run)
        if run.resume not in ("auto", "never"):
            problems = verify(run.resume)
            if problems:
                raise ConfigError(f"resume={run.resume!r}: not a usable checkpoint folder ({problems[0]}); allowed: auto, never,"
                                  " or an intact checkpoint folder")
            # Which checkpoint kinds a plugin loads is its declared capability (framework.plugin).
            kind = read_manifest(run.resume)["kind"]
            caps = get_plugin_class(resolved.plugin_name).capabilities
            if not can_load(caps, kind):
                writers = "|".join(presets_writing(kind))
                allowed = (f"parallelism={writers}" if writers else f"a plugin that loads {kind!r} checkpoints") \
                    if kind not in FULL_STATE_KINDS else f"a checkpoint written by {'|'.join(presets_writing(caps.checkpoint_format))}"
                raise ConfigError(f"resume={run.resume!r}: a {kind!r} checkpoint cannot be loaded by plugin"
                                  f" {resolved.plugin_name!r}; allowed: {allowed}")
        existing = list_checkpoints(resolved.checkpoint_dir)
        if run.resume == "never" and existing:
            raise ConfigError(
                f"resume=never but checkpoint.dir={resolved.checkpoint_dir} already holds checkpoints"
                " (up to step {}); remove it or choose another checkpoint.dir".format(existing[-1][0])
            )
        from framework.data import prepare_data

        print(f"trainlab: {resolved.plugin_name} | {resolved.batch_summary()}", flush=True)
        cache = prepare_data(run.data)
        if run.model.vocab_size is not None and run.model.vocab_size < cache.vocab_size:
            raise ConfigError(f"model.vocab_size={run.model.vocab_size} < tokenizer vocabulary {cache.vocab_size}")
        from framework.model import GPT

        import torch

        with torch.device("meta"):
            model = GPT(run.model, vocab_size=run.model.vocab_size or cache.vocab_size)
        print(
            f"trainlab: model {run.model.name}: {model.num_params(exclude_position_embedding=False):,} parameters"
            f" ({model.num_flops_params():,} in 6N; vocab {model.vocab_size}, {run.model.n_layer} layers,"
            f" d_model {run.model.d_model})",
            flush=True,
        )
    except ConfigError as err:
        _fail(str(err))

    _hold_run_lock(run_dir, Path(resolved.checkpoint_dir))
    resume_from = None
    if run.resume == "auto":
        latest = find_latest_valid(
            resolved.checkpoint_dir, warn=lambda msg: print(f"trainlab: warning: {msg}", file=sys.stderr, flush=True)
        )
        resume_from = str(latest) if latest else None
    elif run.resume != "never":
        resume_from = run.resume
    if resume_from:
        print(f"trainlab: resuming from {resume_from}", flush=True)
    else:  # a fresh start: metrics of an earlier attempt without checkpoints must not mix in
        for stale in ("metrics.jsonl", "summary.json", "faults.jsonl"):
            (run_dir / stale).unlink(missing_ok=True)
    # The step of the checkpoint actually resumed (a newer corrupt one does not count).
    resume_step = read_manifest(resume_from)["step"] if resume_from else 0
    if resume_step >= run.trainer.max_steps and run.resume == "auto":
        print(
            f"trainlab: checkpoint at step {resume_step} >= trainer.max_steps={run.trainer.max_steps}: nothing to train"
            " (raise trainer.max_steps to continue, or use another checkpoint.dir)",
            flush=True,
        )
        return

    tracker = None
    run_id = None
    if run.tracking.enabled:
        from framework.tracking import DriverRun, flatten, git_commit

        # Fail fast on an unreachable server instead of MLflow's minutes of retries.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        run_key = f"{run.experiment_name}/{run.run_name}"
        try:
            tracker = DriverRun(run.tracking.uri, run.experiment_name)
            run_id = tracker.start(run_name=run.run_name, run_key=run_key, resume_run_id=tracker.find(run_key) if resume_from else None)
        except Exception as err:  # a bad URI, an unreachable server: one line, before any rank starts
            _fail(f"tracking.uri={run.tracking.uri!r}: {_first_line(err)} (allowed: a sqlite:///, file:// or http(s):// MLflow URI; or tracking=none)")
        derived = {
            "derived.dp_degree": resolved.layout.dp, "derived.tp_degree": resolved.layout.tp,
            "derived.pp_degree": resolved.layout.pp, "derived.world_size": resolved.world_size,
            "derived.micro_batch_size": resolved.micro_batch_size, "derived.grad_accum_steps": resolved.grad_accum_steps,
            "derived.global_batch_size": resolved.global_batch_size, "derived.tokens_per_step": resolved.tokens_per_step,
            "derived.checkpoint_dir": resolved.checkpoint_dir, "derived.vocab_size": model.vocab_size,
            "model.num_params": model.num_params(exclude_position_embedding=False),
            "model.num_flops_params": model.num_flops_params(),
        }
        tracker.log_params({**flatten(run_to_dict(run)), **{k: str(v) for k, v in derived.items()}})
        tracker.set_tags(
            {
                "plugin": resolved.plugin_name,
                "world_size": resolved.world_size,
                "layout": f"dp{resolved.layout.dp}-tp{resolved.layout.tp}-pp{resolved.layout.pp}",
                "git_commit": git_commit(Path(__file__).parent),
            }
        )
        tracker.log_text(OmegaConf.to_yaml(OmegaConf.create(run_to_dict(run))), "resolved_config.yaml")
        print(f"trainlab: MLflow run {run_id} in experiment {run.experiment_name!r} ({run.tracking.uri})", flush=True)

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from framework.faults.supervisor import supervise
    from framework.launch import LaunchSpec

    launch = LaunchSpec(resolved=resolved, run_dir=run_dir, mlflow_run_id=run_id, resume_from=resume_from,
                        token_cache_dir=str(cache.dir))
    monitor = None
    if tracker is not None and run.tracking.system_metrics_interval_s > 0:
        from framework.tracking import start_system_metrics

        monitor = start_system_metrics(run.tracking.uri, run_id, run.tracking.system_metrics_interval_s, resume=bool(resume_from))
    status = "FAILED"
    error: str | None = None
    (run_dir / "error.txt").unlink(missing_ok=True)  # a resumed run starts without its last failure
    t0 = time.time()
    try:
        supervise(launch, tracker)  # launch_ranks + restarts/shrink (framework/faults)
        status = "FINISHED"
    except (KeyboardInterrupt, SignalException):  # the elastic agent turns SIGINT/SIGTERM into SignalException
        status = "KILLED"
        print("trainlab: interrupted; the newest checkpoint resumes the run (run the same command again)", file=sys.stderr)
        raise SystemExit(130)
    except Exception as err:
        error = str(err).strip()
        print(f"trainlab: error: training failed: {err}", file=sys.stderr, flush=True)
        # Kept with the run: in a sweep the driver's stderr scrolls past (or is captured and lost).
        (run_dir / "error.txt").write_text(error + "\n")
        if not _in_sweep():  # in a sweep the run ends FAILED and the next job starts (e.g. a fault x policy grid)
            raise SystemExit(1)
        _FAILED_JOBS.append(run.run_name)  # the sweep's exit status says so at the end (main)
        return
    finally:
        if monitor is not None:
            monitor.finish()
        if tracker is not None:
            try:
                tracker.log_metrics({"time/attempt_wall_s": time.time() - t0}, step=_steps_done(run_dir))
                metrics_file = run_dir / "metrics.jsonl"
                if metrics_file.exists():
                    tracker.log_artifact(metrics_file)
                if error is not None:  # why a FAILED run failed, next to its metrics in the MLflow UI
                    # MLflow caps a tag's length: keep the head (exception, failed rank) and the tail.
                    tracker.set_tags({"error": error if len(error) <= 4000 else f"{error[:1500]}\n...\n{error[-2400:]}"})
                    tracker.log_artifact(run_dir / "error.txt")
                elif resume_from:
                    tracker.clear_tag("error")  # an earlier attempt failed; this one did not
                if (run_dir / "profile").is_dir():  # trainer.profile_steps traces, one per rank
                    tracker.client.log_artifacts(tracker.run_id, str(run_dir / "profile"), artifact_path="profile")
                tracker.end(status)
            except Exception as err:  # never mask the training outcome with a tracking error
                print(f"trainlab: warning: could not finalise the MLflow run: {err}", file=sys.stderr)
    _print_summary(run_dir, run_id, run.tracking.uri, run.experiment_name)


CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def check_group_choices(argv: list[str], conf_dir: Path = CONF_DIR) -> None:
    """Reject ``group=option`` overrides naming a missing option, in one line (exit code 2).

    Hydra would report these too, but over several lines with a hint about stack traces;
    this check runs first so every bad input reads the same way.
    """
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        if not key or "." in key or "/" in key or "(" in value or not (conf_dir / key).is_dir():
            continue
        options = sorted(p.stem for p in (conf_dir / key).glob("*.yaml"))
        for choice in (v.strip() for v in value.split(",")):
            if choice and choice != "null" and choice not in options:
                options = group_options(key, conf_dir)  # with installed packages' configs (e.g. an outside plugin's)
                if choice not in options:
                    _fail(f"{key}={choice!r} is not an option of config group {key!r}; available: {', '.join(options)}")


def group_options(group: str, conf_dir: Path = CONF_DIR) -> list[str]:
    """Options of config group ``group`` on Hydra's whole search path: ``conf/<group>/*.yaml`` plus
    those that installed packages add through a Hydra ``SearchPathPlugin`` (how an outside
    parallelism plugin ships ``parallelism/<name>.yaml``; see plugins/README.md)."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        return sorted(GlobalHydra.instance().config_loader().get_group_options(group))


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    run_job(cfg, Path(HydraConfig.get().runtime.output_dir))


def _one_line_hydra_error(err: BaseException, overrides: list[str]) -> str:
    """Hydra's multi-line composition errors as one line; a mistyped key gets suggestions."""
    import difflib

    text = str(err)
    m = re.search(r"Could not override '([^']+)'", text)
    if m:
        from hydra import compose, initialize_config_dir

        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            groups = [o for o in overrides  # e.g. parallelism=fsdp, to suggest that plugin's keys (not nosuchkey=1)
                      if "=" in o and "," not in o and (CONF_DIR / o.split("=")[0].lstrip("+~")).is_dir()]
            defaults = compose(config_name="config", overrides=["run_name=x", *groups])  # suggest the chosen plugin's keys
        from framework.tracking import flatten

        keys = list(flatten(OmegaConf.to_container(defaults, resolve=False)))
        near = difflib.get_close_matches(m.group(1), keys, n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(near)}?" if near else "see conf/ and framework/config/schema.py for the keys"
        return f"{m.group(1)} is not a config key; {hint} (to add a new key write +{m.group(1)}=...)"
    lines = [
        ln.strip() for ln in text.splitlines()
        if ln.strip() and "HYDRA_FULL_ERROR" not in ln and not ln.strip().startswith(("full_key", "object_type", "reference_type"))
    ]
    return " ".join(lines) or type(err).__name__


def precheck(argv: list[str]) -> None:
    """Compose and validate a single run's config before Hydra starts (no output folder yet).

    Every bad input becomes one ``trainlab: error:`` line and exit code 2. Sweeps (``-m``) and
    Hydra's own flags are left to Hydra (each job is validated when it starts).
    """
    check_group_choices(argv)
    if any(a.startswith("-") for a in argv):
        return
    from hydra import compose, initialize_config_dir

    from framework.config.validate import load_run_config, validate

    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=[*argv, "run_name=precheck"])
    except Exception as err:  # Hydra's override/composition errors
        _fail(_one_line_hydra_error(err, argv))
    if cfg.get("hydra", {}).get("mode") == "MULTIRUN":  # an experiment preset that sweeps
        return
    try:
        validate(load_run_config(cfg))
    except ConfigError as err:
        _fail(str(err))


def main() -> None:
    """Console entry point: one Hydra job per call (``-m`` runs one per sweep point).

    Ends the process through :func:`framework.distributed.exit_process` (no interpreter
    finalization) with the exit status the jobs asked for: 0, 1 (training failed; in a sweep:
    at least one job failed, after every job has run), 2 (bad input), 130 (interrupted).
    """
    try:
        precheck(sys.argv[1:])
        _hydra_main()
        code = 0
        if _FAILED_JOBS:
            print(f"trainlab: {len(_FAILED_JOBS)} sweep job(s) FAILED: {', '.join(_FAILED_JOBS)}"
                  " (each run's error.txt and MLflow tag 'error' say why)", file=sys.stderr)
            code = 1
    except KeyboardInterrupt:  # Ctrl-C before the ranks start (while composing, tokenizing, importing)
        print("trainlab: interrupted before training started", file=sys.stderr)
        code = 130
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            code = done.code or 0
        else:  # sys.exit("message"): printed to stderr, status 1, as Python does
            print(done.code, file=sys.stderr)
            code = 1
    from framework.distributed import exit_process

    exit_process(code)


if __name__ == "__main__":
    main()
