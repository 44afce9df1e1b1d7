#!/usr/bin/env bash
# The CPU demo (the README's main command): vime writes its own verifiable task, warms a tiny
# random Qwen3 up with SFT, then trains it with GRPO, all on CPU.
#
#   scripts/cpu_demo.sh [OUT_DIR]        (default: runs/cpu-demo)
#
# 1. `vime-train make-task reverse`: digit-string reversal ("52813=" -> "31825"), 4000 train and
#    200 held-out eval prompts, a character-level tokenizer, a 400k-parameter random Qwen3.
# 2. SFT (`--loss-type sft`): 60 steps of 64 samples; the model ends up partly right.
# 3. GRPO (`--advantage-estimator grpo --rm-type exact_match`): 150 rollouts of 32 prompts x 8
#    samples, one on-policy optimizer step each, evaluating pass@1/pass@8 on the held-out prompts
#    every 10.
#
# Outputs: OUT_DIR/{sft,grpo}/metrics.jsonl, tensorboard/, curves.png and checkpoints
# (iter_*/hf loads in HF transformers). Re-running resumes from the last checkpoint (--load).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/cpu-demo}
cargo build --release -p vime-trainer --bin vime-train
BIN=target/release/vime-train
mkdir -p "$OUT"

if [ ! -f "$OUT/task/model/config.json" ]; then
  $BIN make-task reverse --out "$OUT/task" --n-train 4000 --n-eval 200 --seed 0
fi

COMMON=(--prompt-data "$OUT/task/train.jsonl" --label-key label --rollout-shuffle
        --eval-prompt-data rev "$OUT/task/eval.jsonl" --n-samples-per-eval-prompt 8
        --rollout-max-response-len 8 --rm-type exact_match --weight-decay 0
        --use-dynamic-batch-size --max-tokens-per-gpu 4096)

t0=$(date +%s)
$BIN --hf-checkpoint "$OUT/task/model" --loss-type sft "${COMMON[@]}" \
  --rollout-batch-size 64 --num-rollout 60 --lr 1e-2 --lr-warmup-iters 10 \
  --eval-interval 60 --skip-eval-before-train \
  --save "$OUT/sft" --load "$OUT/sft" --save-interval 60
t1=$(date +%s)
$BIN --hf-checkpoint "$OUT/sft/iter_0000060/hf" "${COMMON[@]}" \
  --advantage-estimator grpo --rollout-batch-size 32 --n-samples-per-prompt 8 \
  --num-rollout 150 --lr 1e-3 \
  --eval-interval 10 --save "$OUT/grpo" --load "$OUT/grpo" --save-interval 50
t2=$(date +%s)

python3 - "$OUT/grpo/metrics.jsonl" <<'PY' 2>/dev/null || true
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
ev = [r for r in rows if "eval/rev/pass@1" in r]
print(f"eval pass@1: {ev[0]['eval/rev/pass@1']:.3f} (SFT start) -> {ev[-1]['eval/rev/pass@1']:.3f} (after GRPO); "
      f"pass@8: {ev[0]['eval/rev/pass@8']:.3f} -> {ev[-1]['eval/rev/pass@8']:.3f}")
PY
echo "SFT $((t1 - t0)) s, GRPO $((t2 - t1)) s; curves: $OUT/grpo/curves.png"
