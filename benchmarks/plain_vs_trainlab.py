"""Benchmark (a): trainlab ``single`` vs a plain PyTorch loop, same model, batch and steps.

Both train the configured model (``model=``, the GPT by default) on windows of the same token
cache with AdamW, the warm-up + cosine schedule, gradient clipping and gradient accumulation
of the resolved config, in one process with the same thread count, on the same device (CUDA
when visible, as trainlab's ``accelerator=auto``). The plain loop takes the same GPU path as
trainlab: bf16 autocast when ``trainer.precision`` is ``bf16-mixed``, ``torch.compile`` when
``trainer.compile`` (of the whole model, as a plain script would), fused AdamW on CUDA and CPU. trainlab runs through its real driver
(``python -m framework.train parallelism=single tracking=none checkpoint=none``; its
``perf/tokens_per_sec_mean`` leaves out the first ``warmup_steps_excluded`` steps and
validation). The plain loop is timed the same way (after the same warm-up steps, no
validation). Each side runs ``--repeats`` times, alternating; the last line is the ratio of
the medians, ``ratio: X`` (trainlab / plain).

    python benchmarks/plain_vs_trainlab.py [--repeats 3] [--steps 60] [hydra overrides ...]

Timings on a shared or small machine are noisy: compare min/median/max, not one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # this checkout's framework, also where another is installed


def trainlab_tokens_per_sec(workdir: Path, steps: int, overrides: list[str], tag: str) -> float:
    """tokens/s of one trainlab ``single`` run through the driver (from its summary.json)."""
    name = f"bench-{tag}"
    cmd = [
        sys.executable,
        "-m",
        "framework.train",
        "parallelism=single",
        "tracking=none",
        "checkpoint=none",
        "trainer.progress_bar=false",
        f"trainer.max_steps={steps}",
        f"trainer.log_every_n_steps={steps}",
        f"trainer.val_every_n_steps={steps}",
        f"run_name={name}",
        "experiment_name=bench",
        *overrides,
    ]
    subprocess.run(cmd, cwd=workdir, check=True, stdout=subprocess.DEVNULL)
    return json.loads((workdir / "outputs" / "bench" / name / "summary.json").read_text())["perf/tokens_per_sec_mean"]


def plain_tokens_per_sec(overrides: list[str], steps: int) -> tuple[float, float]:
    """``(tokens/s, peak device memory bytes)`` of a plain PyTorch loop with the same resolved config (in this
    process; the peak is 0 on the CPU)."""
    from hydra import compose, initialize_config_dir

    import framework.driver.cli  # noqa: F401  (registers the run-name resolver)
    from framework.base.data.tokens import prepare_data
    from framework.base.distributed import cap_threads
    from framework.base.model import build_model
    from framework.driver.validate import load_run_config, validate
    from framework.rank.data import TextDataModule
    from framework.rank.module import adamw_implementation, warmup_cosine

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=["parallelism=single", "run_name=bench", f"trainer.max_steps={steps}", *overrides],
        )
    run = load_run_config(cfg)
    resolved = validate(run)
    cap_threads(resolved.threads_per_rank)
    cache = prepare_data(run.data, progress=False)
    dm = TextDataModule(
        run.data,
        global_batch_size=resolved.global_batch_size,
        micro_batch_size=resolved.micro_batch_size,
        dp_rank=0,
        dp_size=1,
        max_steps=steps,
        val_sequences=0,
        cache_dir=str(cache.dir),
    )
    torch.manual_seed(run.trainer.seed)
    model = build_model(run.model, vocab_size=run.model.vocab_size or cache.vocab_size)
    device = torch.device("cuda" if torch.cuda.is_available() and run.trainer.accelerator != "cpu" else "cpu")
    model.to(device)
    if run.trainer.compile:
        model.compile()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=run.trainer.precision.startswith("bf16"))
    o = run.optim
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        **adamw_implementation(None, device.type, run.trainer.precision),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: warmup_cosine(s, warmup_steps=o.warmup_steps, max_steps=steps, min_lr_ratio=o.min_lr_ratio)
    )
    accum = resolved.grad_accum_steps
    batches = iter(dm.train_dataloader())
    warmup = run.trainer.warmup_steps_excluded
    t0 = None
    for step in range(steps):
        if step == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        for _ in range(accum):
            x, y, n = (t.to(device, non_blocking=True) for t in next(batches))  # n: the step's valid targets
            with autocast:
                loss = model(x, y, n, accum)  # the token-weighted loss, as trainlab's module
            (loss / accum).backward()
        if o.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return resolved.tokens_per_step * (steps - warmup) / seconds, float(peak)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per run (default: %(default)s)")
    parser.add_argument("--workdir", default="bench-plain", help="folder for trainlab's outputs (default: %(default)s)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both sides (e.g. data.max_bytes=3000000)")
    args = parser.parse_args()
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    plain, lab = [], []
    for i in range(args.repeats):
        # The plain loop runs in a child process too, so both start cold and the same way.
        out = subprocess.run(
            [sys.executable, __file__, "--_plain", str(args.steps), *args.overrides],
            cwd=work,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        plain.append(float(out.strip().splitlines()[-1].split()[0]))
        lab.append(trainlab_tokens_per_sec(work, args.steps, args.overrides, str(i)))
        print(f"repeat {i}: plain {plain[-1]:,.0f} tokens/s, trainlab single {lab[-1]:,.0f} tokens/s", flush=True)
    for name, xs in (("plain", plain), ("trainlab", lab)):
        print(f"{name:9s} tokens/s min {min(xs):,.0f}  median {statistics.median(xs):,.0f}  max {max(xs):,.0f}")
    print(f"ratio: {statistics.median(lab) / statistics.median(plain):.3f}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--_plain":
        print(*plain_tokens_per_sec(sys.argv[3:], int(sys.argv[2])))  # last line: "tokens_per_sec peak_bytes"
    else:
        main()
