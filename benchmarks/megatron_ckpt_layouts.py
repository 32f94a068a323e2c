"""tp/pp checkpoints across layouts: next-step losses after a resume, against `single` and the uninterrupted run.

    python benchmarks/megatron_ckpt_layouts.py                       # every layout below (~10 min on 2 busy cores)
    python benchmarks/megatron_ckpt_layouts.py --layouts tp2 tp2pp2

Runs the real driver through :class:`framework.base.testing.conformance.Conformance` (CPU ranks,
gloo, fp32, ``model=gpt_tiny``, global batch 8, micro-batch 2, 8 steps, checkpoints at step 4
and 8). For each layout it trains uninterrupted, then resumes its step-4 checkpoint at the same
layout, as ``single``, and (the reverse) resumes ``single``'s step-4 checkpoint under the
layout; ``tp2pp2``'s checkpoint is also resumed as ``tp2`` and as ``pp2`` interleaved (v=2).
Prints the largest relative loss difference over steps 5-8 of each resume against the
uninterrupted run of the same layout and against ``single``'s. Loss values, not times: a busy
machine does not change them.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from framework.base.testing.conformance import SAVE_AT, STEPS, Conformance, RunResult

LAYOUTS = {
    "tp2": ("parallelism=tp",),
    "pp2": ("parallelism=pp",),
    "dp2tp2": ("parallelism=tp", "parallelism.world_size=4"),
    "dp2pp2": ("parallelism=pp", "parallelism.world_size=4"),
    "tp2pp2": ("parallelism=pp", "parallelism.tp_degree=2", "parallelism.world_size=4"),
}
CROSS = {
    "tp2": LAYOUTS["tp2"],
    "pp2-interleaved": ("parallelism=pp", "parallelism.schedule=interleaved_1f1b", "parallelism.virtual_stages=2"),
}


def max_rel(a: RunResult, b: RunResult, steps: range) -> float:
    """Largest ``|a - b| / |b|`` of the per-step losses over ``steps``."""
    return max(abs(a.losses[s] - b.losses[s]) / abs(b.losses[s]) for s in steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = ap.parse_args()
    after = range(SAVE_AT + 1, STEPS + 1)
    with tempfile.TemporaryDirectory() as tmp:
        c = Conformance(Path(tmp), Path(tmp) / "token_cache")
        ref = c.reference()
        print(f"{'checkpoint of':<10} {'resumed as':<18} {'vs same layout':>15} {'vs single':>10}")
        for name in args.layouts:
            sel = LAYOUTS[name]
            full = c.run(f"{name}-full", sel)
            ckpt = full.ckpt_dir / f"step{SAVE_AT:08d}"
            print(f"{name:<10} {'(uninterrupted)':<18} {'':>15} {max_rel(full, ref, range(1, STEPS + 1)):>10.1e}")
            same = c.run(f"{name}-again", sel, save_every=STEPS, resume=ckpt)
            print(f"{name:<10} {name:<18} {max_rel(same, full, after):>15.1e} {max_rel(same, ref, after):>10.1e}")
            single = c.run(f"{name}-as-single", ("parallelism=single",), save_every=0, resume=ckpt)
            print(
                f"{name:<10} {'single':<18} {max_rel(single, full, after):>15.1e} {max_rel(single, ref, after):>10.1e}"
            )
            rev = c.run(f"{name}-from-single", sel, save_every=0, resume=ref.ckpt_dir / f"step{SAVE_AT:08d}")
            print(f"{'single':<10} {name:<18} {max_rel(rev, full, after):>15.1e} {max_rel(rev, ref, after):>10.1e}")
            if name == "tp2pp2":
                for other, osel in CROSS.items():
                    got = c.run(f"{name}-as-{other}", osel, save_every=0, resume=ckpt)
                    print(
                        f"{name:<10} {other:<18} {max_rel(got, full, after):>15.1e} {max_rel(got, ref, after):>10.1e}"
                    )


if __name__ == "__main__":
    main()
