#!/usr/bin/env bash
# --true-on-policy-mode on the GPU (issue 20): the built-in engine's rollout log-probs against the
# trainer's own log-probs of the same tokens, every token of a 4B-shaped GRPO rollout. Two
# vime-train runs on the same random Qwen3-4B-shaped checkpoint (bf16, built-in engine, GSM8K
# prompts, ROLLOUTS rollouts of PROMPTS x N samples of up to LEN tokens, one train step each):
# one with --true-on-policy-mode, one without. Each step logs train_rollout_logprob_abs_diff, the
# mean over every loss token of |trainer log-prob - engine log-prob|: a mean of non-negative terms
# is exactly 0 only when every term is. Also printed: each run's rollout tokens/s and train step
# time (what the mode costs). An entropy term (ENTROPY, default 0.01) gives every step a nonzero
# gradient even when every reward is 0 (random weights), so each rollout after the first runs on
# weights the previous step changed and synced: the verdict requires train/grad_norm > 0 on every
# step of the mode's run.
#
#   MODEL=qwen3-4b LEN=256 PROMPTS=8 N=4 ROLLOUTS=2 ENTROPY=0.01 scripts/gpu/true_on_policy.sh [OUT_DIR]  (~4 min)
#
# Verdict: PASS when every step of the --true-on-policy-mode run logs a gap of exactly 0 (and
# the default run, for contrast, is printed whatever it logs). Needs gpu-carry/{device-env.sh,
# vime-train.xz, COMMIT} and python3 with torch + transformers (random_qwen3.py).
set -uo pipefail
OUT=${1:-${OUT:-/tmp/true_on_policy_out}}
mkdir -p "$OUT"
source gpu-carry/device-env.sh
MODEL=${MODEL:-qwen3-4b}
LEN=${LEN:-256}
PROMPTS=${PROMPTS:-8}
N=${N:-4}
ROLLOUTS=${ROLLOUTS:-2}
ENTROPY=${ENTROPY:-0.01}
BIN=/tmp/vime-train
[ -x "$BIN" ] || { xz -dc gpu-carry/vime-train.xz > "$BIN" && chmod +x "$BIN"; }
LOG="$OUT/true_on_policy.txt"
W=$(mktemp -d)
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(cat gpu-carry/COMMIT 2>/dev/null || echo unknown)"
  echo "command: MODEL=$MODEL LEN=$LEN PROMPTS=$PROMPTS N=$N ROLLOUTS=$ROLLOUTS ENTROPY=$ENTROPY scripts/gpu/true_on_policy.sh $*"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
} | tee "$LOG"
python3 scripts/gpu/random_qwen3.py "$MODEL" "$W/model" tests/assets/qwen3-tokenizer 2>&1 | tail -1 | tee -a "$LOG"
status=0
for mode in on off; do
  flag=""
  [ "$mode" = on ] && flag="--true-on-policy-mode"
  echo "--- vime-train $flag" | tee -a "$LOG"
  "$BIN" --hf-checkpoint "$W/model" --prompt-data tests/assets/math/gsm8k-smoke.jsonl --input-key prompt \
    --label-key label --rm-type math --advantage-estimator grpo --rollout-batch-size "$PROMPTS" \
    --n-samples-per-prompt "$N" --rollout-max-response-len "$LEN" --num-rollout "$ROLLOUTS" --lr 1e-6 \
    --entropy-coef "$ENTROPY" \
    --use-dynamic-batch-size --max-tokens-per-gpu 16384 --dtype bf16 --device cuda --no-progress \
    --log-dir "$W/$mode" $flag > "$OUT/train-$mode.txt" 2>&1
  rc=$?
  tail -4 "$OUT/train-$mode.txt" | tee -a "$LOG"
  [ "$rc" = 0 ] || { echo "vime-train ($mode) exited $rc" | tee -a "$LOG"; status=1; }
  cp "$W/$mode/metrics.jsonl" "$OUT/metrics-$mode.jsonl" 2>/dev/null
done
rm -rf "$W"
python3 - "$OUT" "$status" <<'PY' 2>&1 | tee -a "$LOG"
import json, os, sys
out, status = sys.argv[1], int(sys.argv[2])
def steps(mode):
    p = os.path.join(out, f"metrics-{mode}.jsonl")
    return [json.loads(l) for l in open(p) if l.strip()] if os.path.exists(p) else []
def pick(row, part):
    return next((v for k, v in row.items() if part in k), None)
gaps, gnorms = {}, {}
for mode in ("on", "off"):
    rows = steps(mode)
    gaps[mode] = [pick(r, "rollout_logprob_abs_diff") for r in rows]
    gnorms[mode] = [r.get("train/grad_norm") for r in rows]
    for i, r in enumerate(rows):
        print(f"{mode:>3} step {i + 1}: train_rollout_logprob_abs_diff {gaps[mode][i]!r}, "
              f"grad_norm {gnorms[mode][i]!r}, rollout tokens/s {pick(r, 'rollout_tokens_per_s')}, train s {pick(r, 'perf/train_time')}, log-probs s {pick(r, 'perf/log_probs_time')}")
on = gaps["on"]
moved = bool(gnorms["on"]) and all(g is not None and g > 0.0 for g in gnorms["on"])
ok = status == 0 and bool(on) and all(g is not None and g == 0.0 for g in on) and moved
print(f"TRUE ON POLICY VERDICT: {'PASS' if ok else 'FAIL'} (--true-on-policy-mode gaps {on}, grad norms {gnorms['on']}; default mode {gaps['off']})")
sys.exit(0 if ok else 1)
PY
