#!/usr/bin/env bash
# GPU check of sharded (DCP) checkpoints on one CUDA device (NCCL): fsdp (world_size 1) and
# single, gpt_tiny fp32, 8 steps, checkpoint at step 4; then each resumes the other's step-4
# checkpoint. Prints the per-step losses of steps 5..8 of all four runs: they must agree to
# float rounding (the CPU tests assert relative 1e-5).
# Usage: bash benchmarks/gpu_dcp_check.sh [OUT_DIR]   (needs trainlab's dependencies importable)
set -uo pipefail
OUT=$(realpath -m "${1:-gpu_dcp_check_out}")
mkdir -p "$OUT"
PY=${PY:-python3}
COMMON=(model=gpt_tiny trainer.accelerator=cuda trainer.global_batch_size=8 trainer.micro_batch_size=2
        trainer.grad_accum_steps=null trainer.max_steps=8 trainer.log_every_n_steps=1 trainer.progress_bar=false
        checkpoint.every_n_steps=4 checkpoint.keep_last_k=5 tracking=none experiment_name=gpu_dcp)
run() {  # run NAME OVERRIDES...
  local name=$1; shift
  $PY -m framework.train "${COMMON[@]}" run_name="$name" checkpoint.dir="$OUT/ckpt/$name" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name: exit $?"
}
run fsdp1 parallelism=fsdp parallelism.world_size=1 resume=never
run single parallelism=single resume=never
run single_from_fsdp parallelism=single resume="$OUT/ckpt/fsdp1/step00000004"
run fsdp1_from_single parallelism=fsdp parallelism.world_size=1 resume="$OUT/ckpt/single/step00000004"
$PY -m framework.checkpoint ls "$OUT/ckpt/fsdp1"
$PY - "$OUT" <<'EOF'
import sys
from framework.base.tracking import read_jsonl_metrics
for name in ("fsdp1", "single", "single_from_fsdp", "fsdp1_from_single"):
    recs = read_jsonl_metrics(f"outputs/gpu_dcp/{name}/metrics.jsonl")
    print(f"{name:<18}", {int(r["step"]): round(r["train/loss"], 6) for r in recs if "train/loss" in r and r["step"] > 4})
EOF
