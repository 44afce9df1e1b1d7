#!/usr/bin/env bash
# The trainer's own step against bench-step (issue 21): do users get the table's tokens/s?
# bench-step times forward + backward + optimizer on synthetic packs; `vime-train` itself adds the
# data path, the sample packing, the NaN/Inf guard, the loss's bookkeeping, the metrics and the
# progress bar. This runs both on the same shape and prints the ratio:
#
#   - a random-init Qwen3 release shape written as an HF checkpoint (scripts/gpu/random_qwen3.py),
#   - a JSONL of SFT rows whose prompt + label + EOS are exactly SEQ (4096) tokens under the Qwen3
#     tokenizer (single-token words drawn at random, checked with the tokenizer before the run),
#   - `vime-train --loss-type sft`: ROWS samples a rollout, 2 samples (8192 tokens) an optimizer
#     step, dynamic batching at 8192 tokens a micro-batch, no recompute, bf16, AdamW: the 4b row's
#     step. Its `perf/train_tokens_per_s` (metrics.jsonl) is read from the last rollout (the first
#     builds the cuDNN graphs and the allocator's pool),
#   - `vime-train bench-step` on the same shape with --nan-guard fused (the trainer's guard) and off.
#
# SFT trains on the label tokens only; the step's matmuls and attention run over every token as in
# bench-step, and the LM head's loss pass covers the response. On the GPU machine, from the repo
# root, with gpu-carry/{device-env.sh, vime-train.xz, COMMIT}:
#
#   MODELS="qwen3-0.6b qwen3-4b" scripts/gpu/train_vs_bench.sh [OUT_DIR]
#
# MODE=grpo trains GRPO instead (the policy loss, its metrics, the old log-probs): the built-in
# engine samples 2 responses for each of ROWS/2 prompts up to SEQ tokens (a random-init model
# rarely samples EOS, so nearly every sample is SEQ long; rewards are 0, so are the advantages).
# ENTROPY_COEF (default 1e-3) keeps the gradients non-zero: with zero advantages alone every
# gradient is zero, and GEMMs on zeros likely draw less power and clock higher on a power-capped
# card (the 0.6B GRPO run at 0 came out 1.03x bench-step's, 2026-12-06). bench-step gets the same
# --entropy-coef, so that both sides run the entropy term's backward through the LM head. VIME_XZ
# names another packed binary (default gpu-carry/vime-train.xz), for comparing two builds.
#
# ESTIMATOR (default grpo) is MODE=grpo's --advantage-estimator (gspo: the per-sample sequence
# ratio; cispo).
#
# TRACE=1 runs the trainer and bench-step (fused guard) under scripts/gpu/cupti_trace.c (needs
# gpu-carry/cupti/ from scripts/gpu/cupti_trace.sh) with driver API records, and writes
# scripts/gpu/timeline.py's split of their last steps (the trainer's last 6, within its last rollout)
# to timeline-{train,bench}-<model>.txt: where the trainer's extra time a step goes. The tracer
# slows both a little; the untraced tokens/s are not measured then.
#
# Ends with one `TRAIN_VS_BENCH <mode> <model> VERDICT: ...: PASS|FAIL` a model: PASS when the trainer's
# tokens/s is at least 0.97x bench-step's with the same guard.
set -uo pipefail
OUT=${1:-${OUT:-/tmp/train_vs_bench_out}}
mkdir -p "$OUT"
MODELS=${MODELS:-qwen3-0.6b qwen3-4b}
SEQ=${SEQ:-4096}
ROWS=${ROWS:-16}
ROLLOUTS=${ROLLOUTS:-3}
MODE=${MODE:-sft}
ENTROPY_COEF=${ENTROPY_COEF:-1e-3}
VIME_XZ=${VIME_XZ:-gpu-carry/vime-train.xz}
TRACE=${TRACE:-0}
ESTIMATOR=${ESTIMATOR:-grpo}
# traced NAME: the environment that records a run's timeline into $W/trace-NAME.txt (TRACE=1).
traced() { [ "$TRACE" = 1 ] && echo "CUDA_INJECTION64_PATH=$PWD/gpu-carry/cupti/libvime_cupti_trace.so CUPTI_TRACE_OUT=$W/trace-$1.txt CUPTI_TRACE_API=1"; }
# timeline NAME STEPS: timeline.py's split of that trace's last STEPS steps, into the output.
timeline() {
  [ "$TRACE" = 1 ] || return 0
  python3 scripts/gpu/timeline.py "$W/trace-$1.txt" --steps "$2" --top 20 > "$OUT/timeline-$1.txt" 2>&1
  grep -E '^per step|^  [a-z_]+ +[0-9.]+ ms' "$OUT/timeline-$1.txt" | sed "s/^/  timeline $1: /" | tee -a "$LOG"
  rm -f "$W/trace-$1.txt"
}
source gpu-carry/device-env.sh >/dev/null 2>&1
BIN=$(mktemp /tmp/vime-train-XXXX)
xz -dc "$VIME_XZ" > "$BIN" && chmod +x "$BIN"
LOG="$OUT/train_vs_bench.txt"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(cat gpu-carry/COMMIT 2>/dev/null || echo unknown)"
  echo "command: MODE=$MODE ESTIMATOR=$ESTIMATOR ENTROPY_COEF=$ENTROPY_COEF MODELS=\"$MODELS\" SEQ=$SEQ ROWS=$ROWS ROLLOUTS=$ROLLOUTS VIME_XZ=$VIME_XZ scripts/gpu/train_vs_bench.sh"
  echo "binary: $VIME_XZ ($(sha256sum < "$VIME_XZ" | cut -c1-12))"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
} | tee "$LOG"
W=$(mktemp -d)
status=0
python3 - "$W/sft.jsonl" tests/assets/qwen3-tokenizer/tokenizer.json "$SEQ" "$ROWS" <<'EOF' 2>&1 | tee -a "$LOG" || status=1
import json, random, sys
from tokenizers import Tokenizer
out, tok_path, seq, rows = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
tok = Tokenizer.from_file(tok_path)
enc = lambda s: tok.encode(s, add_special_tokens=False).ids
words = ("time year people way day man thing woman life child world school state family student "
         "group country problem hand part place case week company system program question work "
         "government number night point home water room mother area money story fact month lot "
         "right study book eye job word business issue side kind head house service friend father "
         "power hour game line end member law car city community name president team minute idea "
         "kid body information back parent face others level office door health person art war "
         "history party result change morning reason research girl guy moment air teacher force").split()
single = [w for w in words if len(enc(" " + w)) == 1]
rng = random.Random(0)
prompt = "Write about" + "".join(" " + rng.choice(single) for _ in range(30)) + ":"
p = len(enc(prompt))
n_label = seq - p - 1  # the trainer appends one EOS after the label
with open(out, "w") as f:
    for _ in range(rows):
        label = "".join(" " + rng.choice(single) for _ in range(n_label))
        assert len(enc(label)) == n_label, "label tokenization is not one token a word"
        f.write(json.dumps({"prompt": prompt, "label": label}) + "\n")
print(f"data: {rows} rows, prompt {p} + label {n_label} + EOS = {seq} tokens each ({len(single)} words)")
open(out + ".prompt_len", "w").write(str(p))
EOF
for model in $MODELS; do
  echo "== $model" | tee -a "$LOG"
  python3 scripts/gpu/random_qwen3.py "$model" "$W/$model" tests/assets/qwen3-tokenizer 2>&1 | tail -1 | tee -a "$LOG"
  bflags=()
  if [ "$MODE" = grpo ]; then
    bflags=(--entropy-coef "$ENTROPY_COEF")
    task=(--advantage-estimator "$ESTIMATOR" --n-samples-per-prompt 2 --rollout-batch-size $(( ROWS / 2 ))
          --rollout-max-response-len $(( SEQ - $(cat "$W/sft.jsonl.prompt_len") )) --rm-type exact_match
          --entropy-coef "$ENTROPY_COEF")
  else
    task=(--loss-type sft --rollout-batch-size "$ROWS")
  fi
  timeout 400 env $(traced "train-$model") "$BIN" --hf-checkpoint "$W/$model" "${task[@]}" --prompt-data "$W/sft.jsonl" \
    --input-key prompt --label-key label --global-batch-size 2 --num-rollout "$ROLLOUTS" \
    --use-dynamic-batch-size --max-tokens-per-gpu $(( 2 * SEQ )) --lr 1e-6 --clip-grad 1.0 \
    --dtype bf16 --device cuda --no-progress --log-dir "$W/log-$model" > "$OUT/train-$model.txt" 2>&1
  rc=$?
  timeline "train-$model" 6
  tail -4 "$OUT/train-$model.txt" | cut -c1-400 | tee -a "$LOG"
  cp "$W/log-$model/metrics.jsonl" "$OUT/metrics-$model.jsonl" 2>/dev/null
  train=$(python3 -c 'import json,sys
rows=[json.loads(l) for l in open(sys.argv[1])]
r=[x for x in rows if "perf/train_tokens_per_s" in x]
print("%.0f %.3f %d" % (r[-1]["perf/train_tokens_per_s"], r[-1]["perf/train_time"], len(r)) if r else "0 0 0")' \
    "$W/log-$model/metrics.jsonl" 2>/dev/null || echo "0 0 0")
  read -r tps ttime nroll <<< "$train"
  echo "trainer ($MODE) rc $rc: $nroll rollouts; last: perf/train_tokens_per_s $tps, perf/train_time $ttime s" | tee -a "$LOG"
  python3 -c 'import json,sys
r=[json.loads(l) for l in open(sys.argv[1])][-1]
print("  last rollout:", {k: round(v, 4) for k, v in r.items() if k.startswith(("perf/", "rollout/response_len", "train/micro"))})' \
    "$W/log-$model/metrics.jsonl" 2>/dev/null | cut -c1-600 | tee -a "$LOG"
  declare -A bench=()
  for g in fused off; do
    t=; [ $g = fused ] && t=$(traced "bench-$model")
    timeout 200 env $t "$BIN" bench-step --model "$model" --seq-len "$SEQ" --max-tokens-per-gpu $(( 2 * SEQ )) \
      --micro-batches 1 --recompute none --steps 10 --warmup 2 --nan-guard "$g" "${bflags[@]}" > "$OUT/bench-$model-$g.txt" 2>&1
    line=$(grep -E '^RESULT|rror' "$OUT/bench-$model-$g.txt" | tail -1)
    echo "bench-step --nan-guard $g: $line" | tee -a "$LOG"
    grep -E '^HOST' "$OUT/bench-$model-$g.txt" | sed 's/^/  /' | tee -a "$LOG"
    [ $g = fused ] && timeline "bench-$model" 6
    bench[$g]=$(sed -n 's/.*, \([0-9]*\) tokens\/s.*/\1/p' <<< "$line")
  done
  b=${bench[fused]:-0}
  verdict=$(python3 -c 'import sys
t, b = float(sys.argv[1]), float(sys.argv[2] or 0)
r = t / b if b else 0
print("trainer %.0f tokens/s, bench-step (same guard) %.0f: %.3fx (goal >= 0.97x): %s" % (t, b, r, "PASS" if r >= 0.97 else "FAIL"))' "$tps" "$b")
  echo "TRAIN_VS_BENCH $MODE $model VERDICT: $verdict" | tee -a "$LOG"
  [[ $verdict == *PASS ]] || status=1
  rm -rf "$W/$model"
done
rm -rf "$W" "$BIN"
exit "$status"
