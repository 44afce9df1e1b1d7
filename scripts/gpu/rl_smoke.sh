#!/usr/bin/env bash
# The RL loop end to end on the GPU (a smoke run, not a learning benchmark): a tiny reverse-digits
# task with head_dim 128 (so training runs the fused CUDA kernels and, in a cudnn build, cuDNN
# attention on its variable-length packs, and the built-in engine's prefill/decoding runs the
# flash kernel), 40 bf16 SFT steps with eval, then 10 GRPO rollouts (16 prompts x 8 samples) with
# eval. On the GPU machine, from the repo root:
#
#   scripts/gpu/rl_smoke.sh [OUT_DIR]
#
# Needs gpu-carry/{device-env.sh, vime-train.xz, COMMIT}. VIME_FLAGS="..." adds flags to both
# training runs (e.g. "--attention-backend flash" to compare the attention kernels). Ends with "RL SMOKE: PASS" when both
# runs finish and the GRPO run's last eval line is printed; its pass@1 is for reading, not judged.
set -uo pipefail
OUT=${1:-${OUT:-/tmp/rl_smoke_out}}
mkdir -p "$OUT"
source gpu-carry/device-env.sh
BIN=/tmp/vime-train
[ -x "$BIN" ] || { xz -dc gpu-carry/vime-train.xz > "$BIN" && chmod +x "$BIN"; }
LOG="$OUT/rl_smoke.txt"
W=$(mktemp -d)
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(cat gpu-carry/COMMIT 2>/dev/null || echo unknown)"
  echo "command: VIME_FLAGS=\"${VIME_FLAGS:-}\" scripts/gpu/rl_smoke.sh $*"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
} | tee "$LOG"
DATA=(--prompt-data "$W/task/train.jsonl" --label-key label --rollout-shuffle
      --eval-prompt-data rev "$W/task/eval.jsonl" --n-samples-per-eval-prompt 4
      --rollout-max-response-len 8 --rm-type exact_match --weight-decay 0 --use-dynamic-batch-size
      --max-tokens-per-gpu 4096 --dtype bf16 --device cuda --no-progress ${VIME_FLAGS:-})
status=0
"$BIN" make-task reverse --out "$W/task" --n-train 2000 --n-eval 100 --seed 0 --head-dim 128 \
  --num-attention-heads 2 --num-key-value-heads 1 2>&1 | tee -a "$LOG" || status=1
"$BIN" --hf-checkpoint "$W/task/model" --loss-type sft "${DATA[@]}" --rollout-batch-size 64 \
  --num-rollout 40 --lr 1e-2 --lr-warmup-iters 10 --eval-interval 20 --save "$W/sft" \
  --save-interval 40 2>&1 | tee -a "$LOG"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
"$BIN" --hf-checkpoint "$W/sft/iter_0000040/hf" "${DATA[@]}" --advantage-estimator grpo \
  --rollout-batch-size 16 --n-samples-per-prompt 8 --num-rollout 10 --lr 1e-3 --eval-interval 10 \
  2>&1 | tee "$OUT/grpo.txt" | tee -a "$LOG"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
grep -q "^step 10 .*rev/pass@1" "$OUT/grpo.txt" || status=1
rm -rf "$W"
if [ "$status" = 0 ]; then echo "RL SMOKE: PASS" | tee -a "$LOG"; else echo "RL SMOKE: FAIL" | tee -a "$LOG"; fi
exit "$status"
