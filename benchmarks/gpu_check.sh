#!/usr/bin/env bash
# GPU check on one CUDA device.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]
#       The 1B check (benchmarks/gpu_check.py, < 8 min on one H200): for gpt_1b and llama_1b at seq_len 2048,
#       bf16 + torch.compile + fused AdamW, trainlab `single` through the driver and the plain PyTorch loop of
#       benchmarks/plain_vs_trainlab.py, 50 steps each (10 of warm-up left out): MFU, trainlab / plain tokens/s,
#       host syncs per step (CUDA's own sync reports), peak memory vs the planner. Extra arguments after OUT_DIR
#       go to gpu_check.py (e.g. --steps 30, --no-compile, Hydra overrides).
#   bash benchmarks/gpu_check.sh --gpt2 [OUT_DIR [RUN...]]
#       GPT-2 small (124M) at seq_len 1024 in bf16 through the driver, one run per plugin on world_size 1:
#       single_bf16 single_bf16_compile ddp1_bf16 fsdp1_bf16 zero2_bf16 zero3_bf16 (default: all; zero* need DeepSpeed).
#
# Needs trainlab's dependencies importable (torch, pytorch-lightning, tokenizers, hydra-core, omegaconf; MLflow, Optuna
# and DeepSpeed are not needed by the 1B check). A checkout that is not pip-installed works: gpu_check.py declares the
# plugins' entry points itself.
set -uo pipefail
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
nvidia-smi -L 2>/dev/null || true
if [ "${1:-}" != "--gpt2" ]; then
  OUT=${1:-gpu_check_out}
  shift || true
  exec $PY benchmarks/gpu_check.py --out "$OUT" "$@"
fi
shift
OUT=${1:-gpu_check_out}
shift || true
RUNS=${*:-single_bf16 single_bf16_compile ddp1_bf16 fsdp1_bf16 zero2_bf16 zero3_bf16}
mkdir -p "$OUT"
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
