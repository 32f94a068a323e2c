"""The driver: ``python -m framework.train [overrides]`` (a Hydra app; ``-m`` sweeps).

One job = validate the config (every bad value is a one-line error, exit code 2, before any
rank starts or MLflow run opens) -> prepare the token cache -> open (or re-open) the MLflow
run -> start the ranks with the elastic agent -> set the run's final status -> print a summary.
"""

from __future__ import annotations

import hashlib
import json
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
        lines += [f"  MLflow run         {run_id} (experiment {experiment!r})", f"  see it with        mlflow ui --backend-store-uri {uri}"]
    print("\n".join(lines), flush=True)


def run_job(cfg: DictConfig, run_dir: Path) -> None:
    """Run one Hydra job (one MLflow run). Exits with code 2 on a configuration error."""
    from framework.checkpoint.periodic import find_latest_checkpoint, list_checkpoints
    from framework.config.validate import load_run_config, run_to_dict, validate

    try:
        run = load_run_config(cfg)
        resolved = validate(run)
        if run.resume not in ("auto", "never") and not Path(run.resume).is_file():
            raise ConfigError(f"resume={run.resume!r}: no such checkpoint file; allowed: auto, never, or a checkpoint path")
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

    resume_from = None
    if run.resume == "auto":
        latest = find_latest_checkpoint(resolved.checkpoint_dir)
        resume_from = str(latest) if latest else None
    elif run.resume != "never":
        resume_from = run.resume
    if resume_from:
        print(f"trainlab: resuming from {resume_from}", flush=True)
    if existing and existing[-1][0] >= run.trainer.max_steps and run.resume == "auto":
        print(
            f"trainlab: checkpoint at step {existing[-1][0]} >= trainer.max_steps={run.trainer.max_steps}: nothing to train"
            " (raise trainer.max_steps to continue, or use another checkpoint.dir)",
            flush=True,
        )
        return

    tracker = None
    run_id = None
    if run.tracking.enabled:
        from framework.tracking import DriverRun, flatten, git_commit

        tracker = DriverRun(run.tracking.uri, run.experiment_name)
        run_key = f"{run.experiment_name}/{run.run_name}"
        run_id = tracker.start(run_name=run.run_name, run_key=run_key, resume_run_id=tracker.find(run_key) if resume_from else None)
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

    from framework.launcher import launch_ranks, write_launch_file

    launch = {
        "config": run_to_dict(run),
        "run_dir": str(run_dir),
        "tracking_uri": run.tracking.uri,
        "mlflow_run_id": run_id,
        "resume_from": resume_from,
        "token_cache_dir": str(cache.dir),
    }
    launch_file = write_launch_file(run_dir / "launch.json", launch)
    monitor = None
    if tracker is not None and run.tracking.system_metrics_interval_s > 0:
        from framework.tracking import start_system_metrics

        monitor = start_system_metrics(run.tracking.uri, run_id, run.tracking.system_metrics_interval_s, resume=bool(resume_from))
    status = "FAILED"
    t0 = time.time()
    try:
        launch_ranks(resolved, launch_file, run_dir / "elastic")
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        print("trainlab: interrupted; the newest checkpoint resumes the run (run the same command again)", file=sys.stderr)
        raise SystemExit(130)
    except Exception as err:
        print(f"trainlab: error: training failed: {err}", file=sys.stderr, flush=True)
        raise SystemExit(1)
    finally:
        if monitor is not None:
            monitor.finish()
        if tracker is not None:
            try:
                tracker.log_metrics({"time/wall_s": time.time() - t0})
                metrics_file = run_dir / "metrics.jsonl"
                if metrics_file.exists():
                    tracker.log_artifact(metrics_file)
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
                _fail(f"{key}={choice!r} is not an option of config group {key!r}; available: {', '.join(options)}")


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    run_job(cfg, Path(HydraConfig.get().runtime.output_dir))


def main() -> None:
    """Console entry point: one Hydra job per call (``-m`` runs one per sweep point)."""
    check_group_choices(sys.argv[1:])
    _hydra_main()


if __name__ == "__main__":
    main()
