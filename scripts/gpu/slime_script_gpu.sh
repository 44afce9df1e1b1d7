#!/usr/bin/env bash
# A slime seed script on the GPU, unchanged but for paths and sizes (issue 19): seed 002's Qwen3-0.6B
# GRPO colocate script (tests/fixtures/slime-scripts/seed002-grpo-colocate-0.6b.args, its Megatron
# model flags included) against a random-init checkpoint of the real Qwen3-0.6B shape, with
# vime-train's defaults (--device auto, --dtype auto: CUDA and bf16 here). Then the mission's form,
# `vime-train --model qwen3-0.6b ...`, with the checkpoint found in a Hugging Face cache
# ($HF_HOME/hub snapshot layout). On the GPU machine, from the repo root:
#
#   scripts/gpu/slime_script_gpu.sh [OUT_DIR]
#
# Needs gpu-carry/{device-env.sh, vime-train.xz, COMMIT} and the machine's python3 with torch and
# transformers (scripts/gpu/random_qwen3.py writes the checkpoint). Ends with
#   SLIME SCRIPT GPU VERDICT: PASS|FAIL
# PASS: both runs exit 0, each prints `device: cuda (auto), dtype bf16 (auto)`, the first passes
# the 0.6B shape check and trains its 2 rollouts (metrics of step 2), the second finds the cached
# checkpoint.
set -uo pipefail
OUT=${1:-${OUT:-/tmp/slime_script_gpu_out}}
mkdir -p "$OUT"
source gpu-carry/device-env.sh
BIN=/tmp/vime-train
[ -x "$BIN" ] || { xz -dc gpu-carry/vime-train.xz > "$BIN" && chmod +x "$BIN"; }
LOG="$OUT/slime_script_gpu.txt"
W=$(mktemp -d)
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(cat gpu-carry/COMMIT 2>/dev/null || echo unknown)"
  echo "command: scripts/gpu/slime_script_gpu.sh $*"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
} | tee "$LOG"
SNAP="$W/hf/hub/models--Qwen--Qwen3-0.6B/snapshots/random0"
mkdir -p "$SNAP" "$W/hf/hub/models--Qwen--Qwen3-0.6B/refs"
echo random0 > "$W/hf/hub/models--Qwen--Qwen3-0.6B/refs/main"
python3 scripts/gpu/random_qwen3.py qwen3-0.6b "$SNAP" tests/assets/qwen3-tokenizer 2>&1 | tail -1 | tee -a "$LOG"
PROMPTS=tests/assets/math/gsm8k-smoke.jsonl
status=0
mapfile -t SCRIPT < <(grep -v '^# ' tests/fixtures/slime-scripts/seed002-grpo-colocate-0.6b.args)
echo "--- 1. seed 002's script, paths and sizes appended ---" | tee -a "$LOG"
"$BIN" "${SCRIPT[@]}" --hf-checkpoint "$SNAP" --ref-load "$SNAP" --prompt-data "$PROMPTS" \
  --save "$W/run1" --load "$W/run1" --num-rollout 2 --rollout-batch-size 8 --n-samples-per-prompt 4 \
  --global-batch-size 32 --rollout-max-response-len 64 --actor-num-gpus-per-node 1 --rollout-num-gpus 1 \
  --no-progress 2>&1 | tee "$OUT/run1.txt" | tee -a "$LOG"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
grep -q "vime: device: cuda (auto), dtype bf16 (auto)" "$OUT/run1.txt" || status=1
grep -q '"step":2' "$W/run1/metrics.jsonl" 2>/dev/null || grep -q '"step": 2' "$W/run1/metrics.jsonl" || status=1
echo "--- 2. vime-train --model qwen3-0.6b (HF cache) ---" | tee -a "$LOG"
HF_HOME="$W/hf" "$BIN" --model qwen3-0.6b --tp 1 --cp 1 --prompt-data "$PROMPTS" --input-key prompt \
  --label-key label --apply-chat-template --rm-type deepscaler --advantage-estimator grpo \
  --num-rollout 1 --rollout-batch-size 8 --n-samples-per-prompt 4 --rollout-max-response-len 64 \
  --recompute-granularity full --save "$W/run2" --no-progress 2>&1 | tee "$OUT/run2.txt" | tee -a "$LOG"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
grep -q "from the Hugging Face cache" "$OUT/run2.txt" || status=1
grep -q "vime: device: cuda (auto), dtype bf16 (auto)" "$OUT/run2.txt" || status=1
rm -rf "$W"
if [ "$status" = 0 ]; then v=PASS; else v=FAIL; fi
echo "SLIME SCRIPT GPU VERDICT: $v" | tee -a "$LOG"
exit "$status"
