"""``python -m framework.checkpoint ls|verify|convert DIR``: inspect and convert checkpoint folders.

- ``ls DIR``: one line per checkpoint in DIR (step, kind, size, time, tokens seen) and any
  unfinished save left by a kill.
- ``verify DIR``: check manifests and sha256 checksums of every checkpoint in DIR (or of DIR
  itself when it is one checkpoint); exit code 1 when any is corrupt or none is found.
- ``convert DIR [--out FILE]``: write the model weights of checkpoint DIR (or of the newest
  intact checkpoint in DIR) as one ``torch.save`` file of ``{name: tensor}`` that loads into
  :class:`framework.base.model.GPT` (``load_state_dict``) with ``torch.load(weights_only=True)``.
  ``--full OUTDIR`` writes the whole training state as a one-file checkpoint folder instead.

Sharded (DCP) checkpoints of ``fsdp`` work with every command: ``convert`` gathers the shards
(no process group needed).

Every file is read with the weights-only unpickler; nothing in a checkpoint can run code.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

import torch

from framework.base.checkpoint.format import (
    MANIFEST,
    CheckpointError,
    find_latest_valid,
    list_checkpoints,
    load_state,
    read_manifest,
    verify,
    write_checkpoint,
)

MODEL_PREFIX = "model."  # LMModule holds the GPT as ``self.model``


def _targets(path: Path) -> list[Path]:
    return [path] if (path / MANIFEST).is_file() else [p for _, p in list_checkpoints(path)]


def cmd_ls(path: Path) -> int:
    """Print one line per checkpoint in ``path``; return the exit code (1 when there is none)."""
    rows = list_checkpoints(path)
    if not rows:
        print(f"no checkpoints in {path}", file=sys.stderr)
        return 1
    print(
        f"{'checkpoint':<14} {'step':>8} {'kind':<6} {'base':<14} {'layout':<12} {'MB':>9} {'tokens_seen':>12}  time (UTC)"
    )
    for step, p in rows:
        try:
            m = read_manifest(p)
        except CheckpointError as err:
            print(f"{p.name:<14} {step:>8} unreadable: {err}")
            continue
        when = dt.datetime.fromtimestamp(m["created_unix"], dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        lay = m.get("layout") or {}
        layout = f"{lay.get('plugin', '?')} x{lay.get('world_size', '?')}"
        print(
            f"{p.name:<14} {step:>8} {m['kind']:<6} {m['base'] or '-':<14} {layout:<12} {m['bytes'] / 1e6:>9.2f}"
            f" {m['tokens_seen']:>12,}  {when}"
        )
    for p in sorted(path.glob(".step*.tmp-*")):
        print(f"{p.name}: unfinished save (never loaded; removed when training restarts)")
    return 0


def cmd_verify(path: Path) -> int:
    """Verify every checkpoint in ``path`` (or ``path`` itself); return 1 when any fails or none exists."""
    targets = _targets(path)
    if not targets:
        print(f"no checkpoints in {path}", file=sys.stderr)
        return 1
    bad = 0
    for p in targets:
        problems = verify(p)
        if problems:
            bad += 1
            print(f"CORRUPT {p}: " + "; ".join(problems))
        else:
            print(f"ok      {p}")
    return 1 if bad else 0


def model_weights(state: dict) -> dict[str, torch.Tensor]:
    """The GPT's ``{name: tensor}`` from a loaded training state (Lightning's ``state_dict``, prefix removed)."""
    return {k[len(MODEL_PREFIX) :]: v for k, v in state["state_dict"].items() if k.startswith(MODEL_PREFIX)}


def cmd_convert(path: Path, out: Path | None, full_dir: Path | None = None) -> int:
    """Write the model weights of checkpoint ``path`` (or the newest intact one in it) to ``out``.

    With ``full_dir``: write instead the whole training state as a one-file (``state.pt``)
    checkpoint folder in ``full_dir`` (a sharded DCP checkpoint gathered), which ``single`` and
    ``ddp`` resume like their own.
    """
    ckpt = (
        path
        if (path / MANIFEST).is_file()
        else find_latest_valid(path, warn=lambda m: print(f"warning: {m}", file=sys.stderr))
    )
    if ckpt is None:
        print(f"no intact checkpoint in {path}", file=sys.stderr)
        return 1
    state = load_state(ckpt)
    if full_dir is not None:
        manifest = read_manifest(ckpt)
        fields = {k: v for k, v in manifest.items() if k in ("layout", "config_hash", "versions", "tokens_seen")}
        final = write_checkpoint(
            full_dir, manifest["step"], state, {**fields, "kind": "full", "base": None, "converted_from": str(ckpt)}
        )
        print(f"wrote {final}: full checkpoint of step {manifest['step']} (from {ckpt}, kind {manifest['kind']})")
        return 0
    weights = model_weights(state)
    out = out or Path(f"model_{ckpt.name}.pt")
    torch.save(weights, out)
    n = sum(t.numel() for t in weights.values())
    print(f"wrote {out}: {len(weights)} tensors, {n:,} parameters (from {ckpt})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run one command; returns the exit code (CheckpointError -> 1 with a message)."""
    parser = argparse.ArgumentParser(prog="python -m framework.checkpoint", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("ls", help="list checkpoints: step, kind, size, time").add_argument("dir", type=Path)
    sub.add_parser("verify", help="check checksums; exit 1 on corruption").add_argument("dir", type=Path)
    conv = sub.add_parser("convert", help="write the model weights as one torch.save file")
    conv.add_argument("dir", type=Path, help="a checkpoint folder, or a folder of them (the newest intact one)")
    conv.add_argument("--out", type=Path, default=None, help="output file (default: ./model_<checkpoint>.pt)")
    conv.add_argument(
        "--full",
        type=Path,
        default=None,
        metavar="DIR",
        help="write the whole training state as a one-file checkpoint folder in DIR instead",
    )
    args = parser.parse_args(argv)
    try:
        if args.cmd == "ls":
            return cmd_ls(args.dir)
        if args.cmd == "verify":
            return cmd_verify(args.dir)
        return cmd_convert(args.dir, args.out, args.full)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
