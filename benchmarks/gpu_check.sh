#!/usr/bin/env bash
# GPU check on one CUDA device: the CUDA-only test, then GPT-2 small (124M) at seq_len 1024 in
# bf16 through the real driver with `single` (eager and torch.compile), `ddp` and `fsdp`
# (mixed_precision=bf16) and DeepSpeed ZeRO-2/3 on 1 GPU (NCCL). Prints each run's tokens/s, MFU
# and step time.
# Usage: bash benchmarks/gpu_check.sh [OUT_DIR [RUN...]]   (needs trainlab's dependencies importable)
#   RUN: single_bf16 single_bf16_compile ddp1_bf16 fsdp1_bf16 zero2_bf16 zero3_bf16 (default: all)
set -uo pipefail
OUT=${1:-gpu_check_out}
shift || true
RUNS=${*:-single_bf16 single_bf16_compile ddp1_bf16 fsdp1_bf16 zero2_bf16 zero3_bf16}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
nvidia-smi -L
$PY -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))'
$PY -m pytest -q -p no:cacheprovider tests/unit/test_perf_metrics.py -k cuda 2>&1 | tail -3

COMMON=(model=gpt2_124m data.seq_len=1024 trainer.micro_batch_size=16 trainer.global_batch_size=16
        trainer.max_steps=${MAX_STEPS:-150} trainer.val_every_n_steps=1000 trainer.val_sequences=64
        trainer.warmup_steps_excluded=20 trainer.log_every_n_steps=25 trainer.progress_bar=false
        checkpoint=none tracking=none experiment_name=gpu_check)
run() {  # run NAME OVERRIDES...
  local name=$1; shift
  local t0=$SECONDS
  $PY -m framework.train "${COMMON[@]}" run_name="$name" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name: exit $? in $((SECONDS - t0)) s"
  tail -n 12 "$OUT/$name.log"
  cp "outputs/gpu_check/$name/summary.json" "$OUT/$name.summary.json" 2>/dev/null || true
}
declare -A ARGS=(
  [single_bf16]="parallelism=single trainer.precision=bf16-mixed"
  [single_bf16_compile]="parallelism=single trainer.precision=bf16-mixed trainer.compile=true"
  [ddp1_bf16]="parallelism=ddp parallelism.world_size=1 trainer.precision=bf16-mixed"
  [fsdp1_bf16]="parallelism=fsdp parallelism.world_size=1 parallelism.mixed_precision=bf16"
  [zero2_bf16]="parallelism=zero2 parallelism.world_size=1 trainer.precision=bf16-mixed"
  [zero3_bf16]="parallelism=zero3 parallelism.world_size=1 trainer.precision=bf16-mixed"
)
for name in $RUNS; do
  # shellcheck disable=SC2086  # ARGS values are lists of overrides
  run "$name" ${ARGS[$name]}
done
