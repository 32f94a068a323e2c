"""Checkpoint policies on a >= 50M-parameter preset: blocking vs full save time, full vs delta bytes.

    python benchmarks/checkpoint_bench.py                       # gpt_50m, 3 saves per policy, CPU
    python benchmarks/checkpoint_bench.py --model gpt2_124m --saves 5 --dir /fast/disk

Builds the preset's GPT and AdamW, takes real optimizer steps on random tokens (so the
optimizer state exists and the weights move between saves), and saves the same state dict
that Lightning hands to trainlab's ``FolderCheckpointIO`` (model + optimizer + step) through
the three policies:

- ``sync``: the step is held for the whole save (write + fsync + sha256 + rename).
- ``async``: the step is held only for the copy to CPU memory; ``save_s`` is measured to the
  renamed folder (the background write, here with nothing else running).
- ``incremental``: the first save is full, the next ones XOR+zlib deltas against it, each
  after ``--steps-between`` optimizer steps.

Prints a table of medians over ``--saves`` saves per policy. Every figure depends on the disk
and on how many cores are free; run on the machine you care about.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from framework.base.checkpoint.io import FolderCheckpointIO  # noqa: E402
from framework.base.config.schema import ModelConfig  # noqa: E402
from framework.base.model import GPT  # noqa: E402


def build(model_name: str, vocab_size: int, lr: float, seed: int = 0) -> tuple[GPT, torch.optim.Optimizer]:
    """The preset ``conf/model/<model_name>.yaml`` as a GPT with an AdamW optimizer."""
    cfg = OmegaConf.to_object(
        OmegaConf.merge(
            OmegaConf.structured(ModelConfig), OmegaConf.load(REPO / "conf" / "model" / f"{model_name}.yaml")
        )
    )
    torch.manual_seed(seed)
    model = GPT(cfg, vocab_size=cfg.vocab_size or vocab_size)
    return model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


def train_steps(model: GPT, opt: torch.optim.Optimizer, n: int, *, batch: int, seq_len: int) -> None:
    """``n`` AdamW steps on random tokens."""
    for _ in range(n):
        x = torch.randint(0, model.vocab_size, (batch, seq_len + 1))
        model(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def run_policy(name: str, model: GPT, opt: torch.optim.Optimizer, out: Path, args) -> list[dict]:
    """Save ``args.saves`` times under policy ``name``; one dict per save (blocking_s, save_s, bytes, kind)."""
    io = FolderCheckpointIO(
        keep_last_k=2,
        asynchronous=name == "async",
        full_every_n_saves=args.saves + 1 if name == "incremental" else 1,
        manifest_fields={"benchmark": name},
        tokens_per_step=args.batch * args.seq_len,
    )
    rows = []
    step = 0
    for _ in range(args.saves):
        train_steps(model, opt, args.steps_between, batch=args.batch, seq_len=args.seq_len)
        step += args.steps_between
        state = {"global_step": step, "state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()]}
        start = time.perf_counter()
        io.save_checkpoint(state, out / name / f"step{step:08d}")
        blocking = time.perf_counter() - start
        io.wait()
        (result,) = io.pop_results()
        if result.error:
            raise RuntimeError(result.error)
        rows.append(
            {
                "blocking_s": blocking,
                "save_s": result.save_s,
                "bytes": result.bytes,
                "kind": result.kind,
                "delta_ratio": result.delta_ratio,
            }
        )
    io.teardown()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", default="gpt_50m", help="conf/model/<name>.yaml preset (>= 50M parameters for the issue's figures)"
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=4096,
        help="vocabulary when the preset leaves it null (the default tokenizer's)",
    )
    p.add_argument("--saves", type=int, default=3, help="saves per policy (medians are reported)")
    p.add_argument("--steps-between", type=int, default=1, help="optimizer steps between two saves")
    p.add_argument("--batch", type=int, default=2, help="sequences per optimizer step")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate")
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary folder, deleted after)")
    args = p.parse_args()

    model, opt = build(args.model, args.vocab_size, args.lr)
    n_params = sum(t.numel() for t in model.parameters())
    print(
        f"model {args.model}: {n_params:,} parameters; {args.saves} saves per policy, {args.steps_between} optimizer"
        f" step(s) between saves; torch {torch.__version__}, {torch.get_num_threads()} threads",
        flush=True,
    )
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        results = {name: run_policy(name, model, opt, Path(tmp), args) for name in ("sync", "async", "incremental")}

    def med(rows, key):
        return statistics.median(r[key] for r in rows)

    sync_save = med(results["sync"], "save_s")
    full_bytes = med(results["sync"], "bytes")
    print(
        f"\n{'policy':<22} {'blocking_s':>10} {'save_s':>8} {'blocking/sync_save':>19} {'MB/save':>9} {'bytes/full':>11}"
    )
    for name, rows in results.items():
        groups = (
            [
                ("incremental (full)", [r for r in rows if r["kind"] == "full"]),
                ("incremental (delta)", [r for r in rows if r["kind"] == "delta"]),
            ]
            if name == "incremental"
            else [(name, rows)]
        )
        for label, g in groups:
            if g:
                print(
                    f"{label:<22} {med(g, 'blocking_s'):>10.3f} {med(g, 'save_s'):>8.3f} {med(g, 'blocking_s') / sync_save:>19.3f}"
                    f" {med(g, 'bytes') / 1e6:>9.1f} {med(g, 'bytes') / full_bytes:>11.3f}"
                )
    print("\nper save (blocking_s / save_s), in order; the first async save also allocates its CPU buffers:")
    for name, rows in results.items():
        print(f"  {name:<12} " + "  ".join(f"{r['blocking_s']:.3f}/{r['save_s']:.3f}" for r in rows))


if __name__ == "__main__":
    main()
