"""The parity table of a model under every plugin and layout: loss vs ``single`` and bytes measured vs modelled.

Runs (or, with ``--reuse DIR``, reads a finished pytest conformance folder's) runs of the
conformance suite (:mod:`framework.base.testing.conformance`; the cases of
``tests/integration/test_conformance.py``) and prints, per case: the largest relative
difference of its per-step losses from ``single``'s at the same global batch (fp32, CPU, 8
steps), and per step the collective payload bytes measured and modelled (total and by kind), the
ring bytes on the wire, and the model-state bytes per rank measured and modelled::

    python benchmarks/parity_table.py [--model llama_tiny] [--cases llama-fsdp llama-tp2sp ...]
    python benchmarks/parity_table.py --reuse /tmp/pytest-of-$USER/pytest-N/conformance0

Timings are not shown (they depend on the machine's load); losses and bytes do not.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from framework.base.cost.comm import KINDS  # noqa: E402
from framework.base.testing.conformance import STEPS, Conformance, RunResult  # noqa: E402
from framework.base.tracking import read_jsonl_metrics  # noqa: E402


class Reusing(Conformance):
    """A :class:`Conformance` that reads a run's outputs when its folder already holds them."""

    def run(self, run_name, overrides, **kw) -> RunResult:
        path = self.workdir / "outputs" / "default" / run_name / "metrics.jsonl"
        if run_name not in self._runs and path.exists():
            records = read_jsonl_metrics(path)
            losses = {int(r["step"]): r["train/loss"] for r in records if "train/loss" in r}
            self._runs[run_name] = RunResult(run_name, self.workdir / "checkpoints" / run_name, losses, records)
        return super().run(run_name, overrides, **kw)


def row(conf: Conformance, case) -> str:
    """One line of the table for ``case``."""
    ref, got = conf.reference(case.model), conf.plugin_run(case)
    steps = [s for s in range(1, STEPS + 1) if s in ref.losses and s in got.losses]
    diff = max(abs(got.losses[s] - ref.losses[s]) / abs(ref.losses[s]) for s in steps)
    comm = [
        r for r in got.records if "perf/comm_bytes" in r and "perf/comm_bytes_model" in r
    ]  # measured steps (not warm-up)
    if comm:
        kinds = [k for k in KINDS if f"perf/comm_bytes_{k}_model" in comm[0]]
        exact = all(r.get(f"perf/comm_bytes_{k}") == r[f"perf/comm_bytes_{k}_model"] for r in comm for k in kinds)
        r = comm[-1]
        by_kind = ", ".join(
            f"{k} {r.get(f'perf/comm_bytes_{k}', 0):,.0f}/{r[f'perf/comm_bytes_{k}_model']:,.0f}" for k in kinds
        )
        bytes_ = (
            f"{r.get('perf/comm_bytes', 0):,.0f} / {r['perf/comm_bytes_model']:,.0f} ({by_kind});"
            f" wire {r.get('perf/comm_bytes_wire', 0):,.0f} / {r['perf/comm_bytes_wire_model']:,.0f};"
            f" {'equal' if exact else 'DIFFER'} on {len(comm)} steps"
        )
    else:
        bytes_ = "(not metered)"
    mem = [r for r in got.records if "mem/model_states_bytes_model" in r]
    states = (
        f"{mem[-1]['mem/model_states_bytes']:,.0f} / {mem[-1]['mem/model_states_bytes_model']:,.0f}" if mem else "n/a"
    )
    return f"| {case.name} | {' '.join(case.select)} | {diff:.1e} | {bytes_} | {states} |"


def main() -> None:
    from tests.integration.test_conformance import CASES, LLAMA_CASES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama_tiny", help="the cases of this model (default: %(default)s)")
    parser.add_argument("--cases", nargs="*", help="case names (default: every case of --model)")
    parser.add_argument(
        "--reuse", type=Path, help="a conformance folder whose finished runs are read instead of re-run"
    )
    args = parser.parse_args()
    cases = [c for c in CASES + LLAMA_CASES if c.model == args.model and (not args.cases or c.name in args.cases)]
    work = args.reuse or Path(tempfile.mkdtemp(prefix="parity_table_"))
    conf = Reusing(work, work / "token_cache")
    print(
        f"{args.model}: loss vs single at global batch 8 (fp32, CPU, {STEPS} steps); bytes per step measured / modelled"
        " (payload by kind, ring wire bytes; the last logged step shown); model-state bytes per rank measured / modelled"
    )
    print("| case | overrides | max rel. loss diff | comm bytes per step | model states |\n|---|---|---|---|---|")
    for case in cases:
        print(row(conf, case), flush=True)


if __name__ == "__main__":
    main()
