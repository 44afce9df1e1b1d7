#!/usr/bin/env bash
# Where a decode step of the built-in engine spends GPU time (issue 20): a GRPO rollout of
# random-init Qwen3 (scripts/gpu/random_qwen3.py, real shape), N sequences, under Nsight Compute
# for a window of kernels in the middle of decoding (--launch-skip / --launch-count), timing every
# kernel (gpu__time_duration); scripts/gpu/kernel_classes.py sums them by class per decode step
# (one vime_sample_gumbel per step). The same rollout without ncu gives the wall time per step
# (VIME_ENGINE_PROFILE=1), so host/launch gaps = wall per step - kernel sum per step.
# On the GPU machine, from the repo root (needs gpu-carry/{device-env.sh, vime-train.xz}):
#
#   scripts/gpu/profile_engine.sh [OUT_DIR]
#
# Settings: MODEL=qwen3-0.6b PROMPTS_PER_ROLLOUT=16 SAMPLES=4 (N = 64) LEN=128 SKIP=40000 COUNT=3000
#   NCU_TIMEOUT=420
set -uo pipefail
OUT=${1:-${OUT:-/tmp/profile_engine_out}}
MODEL=${MODEL:-qwen3-0.6b}
P=${PROMPTS_PER_ROLLOUT:-16}; S=${SAMPLES:-4}; LEN=${LEN:-128}
SKIP=${SKIP:-40000}; COUNT=${COUNT:-3000}; NCU_TIMEOUT=${NCU_TIMEOUT:-420}
mkdir -p "$OUT"
source gpu-carry/device-env.sh
NCU=${NCU:-ncu}
command -v "$NCU" >/dev/null || NCU=$(ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
W=$(mktemp -d)
BIN=$W/vime-train
xz -dc gpu-carry/vime-train.xz > "$BIN" && chmod +x "$BIN"
tag="$MODEL-n$((P * S))-len$LEN"
LOG="$OUT/profile-engine-$tag.txt"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(cat gpu-carry/COMMIT 2>/dev/null || echo unknown)"
  echo "command: MODEL=$MODEL PROMPTS_PER_ROLLOUT=$P SAMPLES=$S LEN=$LEN SKIP=$SKIP COUNT=$COUNT scripts/gpu/profile_engine.sh"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  "$NCU" --version | tail -1
} 2>&1 | tee "$LOG"
python3 scripts/gpu/random_qwen3.py "$MODEL" "$W/ckpt" tests/assets/qwen3-tokenizer 2>&1 | tail -1 | tee -a "$LOG"
run() {
  "$@" --hf-checkpoint "$W/ckpt" --prompt-data tests/assets/math/gsm8k-smoke.jsonl \
    --input-key prompt --label-key label --apply-chat-template --rm-type deepscaler \
    --advantage-estimator grpo --num-rollout 1 --rollout-batch-size "$P" --n-samples-per-prompt "$S" \
    --rollout-max-response-len "$LEN" --rollout-temperature 1.0 --device cuda --dtype bf16 \
    --save "$W/run-$RANDOM" --no-progress
}
echo "--- without ncu (twice: the first run on a fresh machine pays first-use costs)" | tee -a "$LOG"
for i in 1 2; do
  VIME_ENGINE_PROFILE=1 run "$BIN" 2>&1 | grep "ENGINE PROFILE" | tail -1 | tee -a "$LOG"
done
echo "--- under ncu: kernels $SKIP .. $((SKIP + COUNT))" | tee -a "$LOG"
timeout "$NCU_TIMEOUT" "$NCU" --metrics gpu__time_duration.sum --clock-control none --cache-control none \
  --launch-skip "$SKIP" --launch-count "$COUNT" --csv --print-units base \
  "$BIN" $(run echo) > "$OUT/ncu-engine-$tag.csv" 2> "$OUT/ncu-engine-$tag.err"
echo "ncu exit $?" | tee -a "$LOG"
tail -2 "$OUT/ncu-engine-$tag.err" | tee -a "$LOG"
python3 scripts/gpu/kernel_classes.py "$OUT/ncu-engine-$tag.csv" --skip-until 'vime_sample_gumbel(?!_merge)' \
  --per 'vime_sample_gumbel(?!_merge)' --top 20 2>&1 | tee -a "$LOG"
xz -T4 -6 -f "$OUT/ncu-engine-$tag.csv"
rm -rf "$W"
