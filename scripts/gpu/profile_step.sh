#!/usr/bin/env bash
# Where vime's training step spends GPU time (issue 7): one `vime-train bench-step` step under
# Nsight Compute, timing every kernel (gpu__time_duration, clocks not locked, caches not flushed),
# then scripts/gpu/kernel_classes.py sums the kernels by op class (GEMM, attention, norms/RoPE/
# SwiGLU, LM head, optimizer, candle elementwise/copies/fills/reductions) and prints the top
# kernels. The same step is also timed without ncu (bench-step's median), so
#   launch/host gaps = step wall time - sum of kernel times.
# On the GPU machine, from the repo root (needs gpu-carry/{device-env.sh, vime-train.xz}):
#
#   scripts/gpu/profile_step.sh [OUT_DIR]
#
# Settings: MODEL=qwen3-4b SEQ=4096 TOKENS=4096 (per micro-batch) RECOMPUTE=full
#   NCU=ncu (or a path) NCU_TIMEOUT=420
set -uo pipefail
OUT=${1:-${OUT:-/tmp/profile_step_out}}
MODEL=${MODEL:-qwen3-4b}
SEQ=${SEQ:-4096}
TOKENS=${TOKENS:-4096}
RECOMPUTE=${RECOMPUTE:-full}
NCU=${NCU:-ncu}
NCU_TIMEOUT=${NCU_TIMEOUT:-420}
mkdir -p "$OUT"
source gpu-carry/device-env.sh
BIN=/tmp/vime-train
[ -x "$BIN" ] || { xz -dc gpu-carry/vime-train.xz > "$BIN" && chmod +x "$BIN"; }
command -v "$NCU" >/dev/null || NCU=$(ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
tag="$MODEL-$SEQ-$TOKENS-$RECOMPUTE"
LOG="$OUT/profile-$tag.txt"
args=(bench-step --model "$MODEL" --seq-len "$SEQ" --max-tokens-per-gpu "$TOKENS" --recompute "$RECOMPUTE")
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(cat gpu-carry/COMMIT 2>/dev/null || echo unknown)"
  echo "command: MODEL=$MODEL SEQ=$SEQ TOKENS=$TOKENS RECOMPUTE=$RECOMPUTE scripts/gpu/profile_step.sh"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  "$NCU" --version | tail -1
  echo "--- wall time without ncu (median of 10 steps)"
  "$BIN" "${args[@]}" --steps 10 --warmup 2 2>&1 | grep -E '^RESULT|^step|Error|error' | tail -3
  echo "--- one step under ncu (warmup 0, steps 1)"
} 2>&1 | tee "$LOG"
timeout "$NCU_TIMEOUT" "$NCU" --metrics gpu__time_duration.sum --clock-control none --cache-control none \
  --csv --print-units base \
  "$BIN" "${args[@]}" --steps 1 --warmup 0 > "$OUT/ncu-$tag.csv" 2> "$OUT/ncu-$tag.err"
echo "ncu exit $?" | tee -a "$LOG"
tail -3 "$OUT/ncu-$tag.err" | tee -a "$LOG"
python3 scripts/gpu/kernel_classes.py "$OUT/ncu-$tag.csv" 2>&1 | tee -a "$LOG"
xz -T4 -6 -f "$OUT/ncu-$tag.csv"
