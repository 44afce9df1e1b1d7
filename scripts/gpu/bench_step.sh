#!/usr/bin/env bash
# The training step of vime on the H200 (issue 6, item 2): random-init Qwen3 release shapes,
# synthetic 4096-token sequences, bf16 compute, f32 master weights and AdamW, forward + backward
# + clipping + optimizer; median step time, tokens/s, MFU and sampled peak device memory for each
# configuration (`vime-train bench-step`, see trainer/src/bench.rs). On the GPU machine:
#
#   scripts/gpu/bench_step.sh [OUT_DIR]
#
# Needs gpu-carry/{device-env.sh, vime-train.xz, COMMIT}. CONFIGS overrides the list
# ("model:seq_len:tokens_per_micro_batch:recompute ...").
set -uo pipefail
OUT=${1:-${OUT:-/tmp/bench_step_out}}
CONFIGS=${CONFIGS:-"qwen3-4b:4096:4096:full qwen3-4b:4096:4096:none qwen3-0.6b:4096:16384:full qwen3-0.6b:4096:16384:none"}
STEPS=${STEPS:-10}
JSON_DIR=${JSON_DIR:-/tmp/bench_step_json}
mkdir -p "$OUT" "$JSON_DIR"
source gpu-carry/device-env.sh
BIN=/tmp/vime-train
[ -x "$BIN" ] || { xz -dc gpu-carry/vime-train.xz > "$BIN" && chmod +x "$BIN"; }
LOG="$OUT/bench_step.txt"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(cat gpu-carry/COMMIT 2>/dev/null || echo unknown)"
  echo "command: CONFIGS=\"$CONFIGS\" STEPS=$STEPS scripts/gpu/bench_step.sh $*"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
} | tee "$LOG"
status=0
for c in $CONFIGS; do
  IFS=: read -r model seq tokens rec <<<"$c"
  "$BIN" bench-step --model "$model" --seq-len "$seq" --max-tokens-per-gpu "$tokens" --recompute "$rec" \
    --steps "$STEPS" --warmup 2 --json "$JSON_DIR/bench-$model-$seq-$tokens-${rec//[:,]/_}.json" 2>&1 | tee -a "$LOG" || status=1
done
grep '^RESULT' "$LOG"
exit $status
