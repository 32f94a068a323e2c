"""``python -m framework.base.cost.whatif RUN_ID [--tracking-uri URI]``: what a step of a measured trainlab
run gains when each component gets 1 ms shorter, given what overlaps what
(:func:`framework.base.cost.steptime.whatif` on :func:`~framework.base.cost.steptime.breakdown_from_metrics`
of the run's latest breakdown metrics in MLflow)."""

from __future__ import annotations

import argparse
import sys

from framework.base.cost.steptime import breakdown_from_metrics, whatif


def main(argv: list[str] | None = None) -> int:
    """Print the measured breakdown and the gain per component (ms of step per ms shorter)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_id", help="MLflow run id of a trainlab training run")
    ap.add_argument("--tracking-uri", default="sqlite:///mlruns.db", help="MLflow tracking URI")
    ap.add_argument("--delta-ms", type=float, default=1.0, help="how much shorter each component gets (ms)")
    args = ap.parse_args(argv)
    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=args.tracking_uri)
    try:
        metrics = client.get_run(args.run_id).data.metrics
    except Exception as err:  # noqa: BLE001 - one line for any lookup failure
        print(
            f"trainlab: error: run_id={args.run_id!r} not found at {args.tracking_uri}: {str(err).splitlines()[0]}",
            file=sys.stderr,
        )
        return 2
    b = breakdown_from_metrics(metrics)
    print(
        f"measured step {b.step_time() * 1e3:.2f} ms: data_wait {b.data_wait * 1e3:.2f}, forward {b.forward * 1e3:.2f}, "
        f"backward {b.backward * 1e3:.2f}, optimizer {b.optimizer * 1e3:.2f}, ckpt {b.checkpoint_blocking * 1e3:.2f}, "
        f"other {b.other * 1e3:.2f}"
        + "".join(f", {c.name} {c.time_s * 1e3:.2f} (exposed tail {c.tail_s * 1e3:.2f})" for c in b.collectives)
    )
    for k, g in sorted(whatif(b, args.delta_ms / 1e3).items(), key=lambda kv: -kv[1]):
        print(f"  {k:<22} -{args.delta_ms:g} ms -> step -{g * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
