#!/usr/bin/env bash
# The built-in engine's decode speed on the GPU (issue 20): a GRPO rollout of random-init Qwen3-0.6B
# (the real shape, scripts/gpu/random_qwen3.py), GSM8K prompts with the chat template, temperature
# 1, top-p 1, N sequences of up to LEN new tokens (a random model almost never emits EOS, so nearly
# every sequence runs to LEN), bf16 on CUDA, through `vime-train` (one rollout, one step). Reports
# the run's `perf/rollout_tokens_per_s` for each binary in BINS (e.g. before and after a change,
# in the same run) and, for binaries that have it, the engine's own profile (VIME_ENGINE_PROFILE=1:
# seconds per phase of a step). On the GPU machine, from the repo root:
#
#   BINS="gpu-carry/vime-train-OLD.xz gpu-carry/vime-train.xz" scripts/gpu/engine_speed.sh [OUT_DIR]
#
# Settings: PROMPTS_PER_ROLLOUT=16 SAMPLES=4 (N = 64), LEN=256. Needs gpu-carry/device-env.sh and
# python3 with torch + transformers. Ends with one `ENGINE SPEED` line per binary.
set -uo pipefail
OUT=${1:-${OUT:-/tmp/engine_speed_out}}
mkdir -p "$OUT"
source gpu-carry/device-env.sh
BINS=${BINS:-gpu-carry/vime-train.xz}
P=${PROMPTS_PER_ROLLOUT:-16}; S=${SAMPLES:-4}; LEN=${LEN:-256}
LOG="$OUT/engine_speed.txt"
W=$(mktemp -d)
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(cat gpu-carry/COMMIT 2>/dev/null || echo unknown)"
  echo "command: BINS=\"$BINS\" PROMPTS_PER_ROLLOUT=$P SAMPLES=$S LEN=$LEN scripts/gpu/engine_speed.sh $*"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
} | tee "$LOG"
python3 scripts/gpu/random_qwen3.py qwen3-0.6b "$W/ckpt" tests/assets/qwen3-tokenizer 2>&1 | tail -1 | tee -a "$LOG"
for b in $BINS; do
  name=$(basename "$b" .xz)
  xz -dc "$b" > "$W/$name" && chmod +x "$W/$name"
  VIME_ENGINE_PROFILE=1 "$W/$name" --hf-checkpoint "$W/ckpt" --prompt-data tests/assets/math/gsm8k-smoke.jsonl \
    --input-key prompt --label-key label --apply-chat-template --rm-type deepscaler \
    --advantage-estimator grpo --num-rollout 1 --rollout-batch-size "$P" --n-samples-per-prompt "$S" \
    --rollout-max-response-len "$LEN" --rollout-temperature 1.0 --device cuda --dtype bf16 \
    --save "$W/run-$name" --no-progress > "$OUT/$name.txt" 2>&1
  rc=$?
  tps=$(grep -o '"perf/rollout_tokens_per_s": *[0-9.e+-]*' "$W/run-$name/metrics.jsonl" 2>/dev/null | head -1 | awk -F: '{print $2}')
  grep "ENGINE PROFILE" "$OUT/$name.txt" | tail -1 | tee -a "$LOG"
  echo "ENGINE SPEED $name: rc $rc, N=$((P * S)) LEN=$LEN, perf/rollout_tokens_per_s =${tps:- missing}" | tee -a "$LOG"
done
rm -rf "$W"
