#!/usr/bin/env bash
# Issue 21's table, one command per row, on a fresh GPU machine:
#
#   scripts/gpu/bench_rows.sh ROW [OUT_DIR]        ROW = 4b | 4b-256k | 0.6b | 4b-ragged | 4b-recompute | 8b | 4b-fp8 | 4b-256k-fp8
#
# Every row is the bench-step optimizer step of scripts/gpu/bench_train.sh (random-init Qwen3
# release shapes, bf16 compute, fp32 master weights + AdamW, clipping at 1.0, s = 4096):
#   4b            Qwen3-4B, 8192 tokens per step (2 x 4096), no recompute; vime and Megatron-Core
#                 (needs megatron-core in .whl/, see bench_train.sh). Goal: vime >= 19,500 tokens/s
#                 and >= 1.3x Megatron-Core in the same run.
#   4b-256k       Qwen3-4B, 262,144 tokens per step (32 micro-batches of 2 x 4096: gradient
#                 accumulation, as RL steps are), no recompute; vime. Goal >= 21,000 tokens/s.
#   0.6b          Qwen3-0.6B, 8192 tokens per step, no recompute; vime and Megatron-Core.
#                 Goal: vime >= 90,000 tokens/s.
#                 Both rows also run Megatron-Core with Transformer Engine (bench_train_torch.py
#                 --system megatron-te) when TE is installed in TE_SITE (default /tmp/te-site;
#                 scripts/gpu/te_kit.sh), and print vime/megatron-te beside the goal's ratio.
#   4b-ragged     Qwen3-4B, RL-shaped: 64 samples per step, prompts of 64-511 tokens, responses
#                 log-normal (median 1024, log-sd 1: a long tail, capped at 4096 a sample), packed
#                 by the trainer's dynamic batching at --max-tokens-per-gpu 9216 (slime's 4B
#                 setting), no recompute; against the equal-length step (2 x 4096) in the same
#                 run. Goal: model TFLOP/s within 5 % of the equal-length step's (tokens/s is
#                 printed too; it is higher for shorter samples, which need less attention a token,
#                 so the FLOP rate is the fair comparison).
#   4b-recompute  Qwen3-4B, 8192 tokens per step, full recompute against none in the same run.
#                 Goal: >= 0.78x of no-recompute's tokens/s.
#   8b            Qwen3-8B, 8192 tokens per step, no recompute then full recompute: recorded,
#                 whichever fits one H200 (AdamW's fp32 master weights and moments are 12 bytes a
#                 parameter, 98 GB for 8.2 B).
#   4b-fp8        Qwen3-4B, 8192 tokens per step, no recompute: the blocks' linear layers in FP8
#                 (--fp8-format hybrid --fp8-recipe tensorwise) against bf16 in the same run.
#                 Stretch goal >= 25,000 tokens/s; its log-prob error is scripts/gpu/fp8_error.sh.
#   4b-256k-fp8   The 4b-256k row with FP8 linear layers (each weight quantized once a step).
#                 The FP8 rows' recipe is FP8_RECIPE (default tensorwise; delayed: activations and
#                 gradients scaled by amax histories, no amax pass).
# Needs gpu-carry/{device-env.sh, vime-train.xz, COMMIT}. Settings: STEPS (default 10; 3 for
# 4b-256k), WARMUP (default 2; 1 for 4b-256k), TIMEOUT per contender (default 300).
# Ends with `BENCH_ROW <row> VERDICT: ...: PASS|FAIL|RECORDED`; exit status 0 on PASS or RECORDED.
set -uo pipefail
ROW=${1:?usage: bench_rows.sh ROW [OUT_DIR]}
OUT=${2:-${OUT:-/tmp/bench_rows_out}}/$ROW
mkdir -p "$OUT"
export RESULTS_DIR=/tmp/bench_rows_results/$ROW
export RESET=1 TIMEOUT=${TIMEOUT:-300} STEPS=${STEPS:-10} WARMUP=${WARMUP:-2} SEQS=4096
# Where te_kit.sh installed Transformer Engine; bench_train.sh runs megatron-te from it.
export TE_SITE=${TE_SITE:-/tmp/te-site}
# The FP8 rows' --fp8-recipe.
FP8_RECIPE=${FP8_RECIPE:-tensorwise}
source gpu-carry/device-env.sh
BIN=/tmp/vime-train
[ -x "$BIN" ] || { xz -dc gpu-carry/vime-train.xz > "$BIN" && chmod +x "$BIN"; }
LOG="$OUT/bench_rows.txt"
echo "bench_rows.sh $ROW: $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(cat gpu-carry/COMMIT 2>/dev/null || echo unknown)" | tee "$LOG"

train() { NO_VERDICT=1 scripts/gpu/bench_train.sh "$OUT" >> "$LOG" 2>&1; }
# tokens/s, TFLOP/s of a bench_train result: field FIELD of $RESULTS_DIR/KEY.json, or 0.
field() { python3 -c 'import json,sys
try: print(json.load(open(sys.argv[1]))[sys.argv[2]])
except Exception: print(0)' "$RESULTS_DIR/$1.json" "$2"; }
verdict() { # ROW TEXT PASS|FAIL|RECORDED
  echo "BENCH_ROW $1 VERDICT: $2: $3" | tee -a "$LOG"
  [ "$3" != FAIL ]
}
ge() { python3 -c 'import sys; print(1 if float(sys.argv[1]) >= float(sys.argv[2]) else 0)' "$1" "$2"; }
ratio() { python3 -c 'import sys; a,b=map(float,sys.argv[1:]); print("%.3f" % (a/b if b else 0))' "$1" "$2"; }
errors() { grep '^ERROR' "$LOG" | sed 's/^/  /'; }

case $ROW in
  4b|0.6b)
    model=qwen3-$ROW
    goal=$([ "$ROW" = 4b ] && echo 19500 || echo 90000)
    systems="vime megatron"
    [ -d "$TE_SITE" ] && systems="$systems megatron-te"
    MODELS=$model RECOMPUTES=none SYSTEMS="$systems" train
    v=$(field "vime-$model-4096-none" tokens_per_s); m=$(field "megatron-$model-4096-none" tokens_per_s)
    r=$(ratio "$v" "$m"); errors
    if [[ $systems == *megatron-te* ]]; then
      t=$(field "megatron-te-$model-4096-none" tokens_per_s)
      echo "BENCH_ROW $ROW megatron-core + transformer-engine: $(printf %.0f "$t") tokens/s, vime/megatron-te = $(ratio "$v" "$t")x (0 = failed, see the ERROR lines)" | tee -a "$LOG"
    fi
    ok=$(ge "$v" "$goal")
    [ "$ROW" = 4b ] && ok=$(( ok * $(ge "$r" 1.3) ))
    verdict "$ROW" "$model s=4096 8192 tokens/step: vime $(printf %.0f "$v") tokens/s, megatron-core $(printf %.0f "$m"), vime/megatron = ${r}x (goal vime >= $goal$([ "$ROW" = 4b ] && echo ' and >= 1.3x'))" \
      "$([ "$ok" = 1 ] && echo PASS || echo FAIL)"
    ;;
  4b-256k)
    STEPS=${STEPS_256K:-3} WARMUP=${WARMUP_256K:-1} MODELS=qwen3-4b RECOMPUTES=none SYSTEMS=vime TOKENS_PER_STEP=262144 train
    v=$(field vime-qwen3-4b-4096-none tokens_per_s); errors
    verdict "$ROW" "qwen3-4b s=4096 262144 tokens/step (32 micro-batches): vime $(printf %.0f "$v") tokens/s (goal >= 21000)" \
      "$([ "$(ge "$v" 21000)" = 1 ] && echo PASS || echo FAIL)"
    ;;
  4b-recompute)
    MODELS=qwen3-4b RECOMPUTES="none full" SYSTEMS=vime train
    n=$(field vime-qwen3-4b-4096-none tokens_per_s); f=$(field vime-qwen3-4b-4096-full tokens_per_s)
    r=$(ratio "$f" "$n"); errors
    verdict "$ROW" "qwen3-4b s=4096 8192 tokens/step: full recompute $(printf %.0f "$f") tokens/s, none $(printf %.0f "$n"), full/none = ${r}x (goal >= 0.78x)" \
      "$([ "$(ge "$r" 0.78)" = 1 ] && echo PASS || echo FAIL)"
    ;;
  4b-ragged)
    MODELS=qwen3-4b RECOMPUTES=none SYSTEMS=vime train
    json="$RESULTS_DIR/ragged.json"
    cmd=("$BIN" bench-step --model qwen3-4b --seq-len 4096 --max-tokens-per-gpu 9216 --lengths ragged
         --samples 64 --response-median 1024 --response-sigma 1.0 --recompute none
         --steps "${STEPS_RAGGED:-5}" --warmup 1 --json "$json")
    echo "=== ragged: ${cmd[*]}" | tee -a "$LOG"
    timeout "$TIMEOUT" "${cmd[@]}" >> "$LOG" 2>&1 || echo "ERROR ragged (exit $?): $(grep -E 'Error|error' "$LOG" | tail -1)" | tee -a "$LOG"
    grep -E '^RESULT|^bench-step: ragged' "$LOG" | tail -3
    et=$(field vime-qwen3-4b-4096-none model_tflops); ev=$(field vime-qwen3-4b-4096-none tokens_per_s)
    rt=$(field ragged model_tflops); rv=$(field ragged tokens_per_s); fill=$(field ragged micro_batch_fill)
    r=$(ratio "$rt" "$et"); errors
    verdict "$ROW" "qwen3-4b ragged (64 samples, dynamic batching at 9216, micro-batches $(printf %.3f "$fill") full): $(printf %.0f "$rt") TFLOP/s, $(printf %.0f "$rv") tokens/s; equal-length 2 x 4096: $(printf %.0f "$et") TFLOP/s, $(printf %.0f "$ev") tokens/s; ragged/equal TFLOP/s = ${r}x (goal >= 0.95x)" \
      "$([ "$(ge "$r" 0.95)" = 1 ] && echo PASS || echo FAIL)"
    ;;
  8b)
    MODELS=qwen3-8b RECOMPUTES="none full" SYSTEMS=vime STEPS=${STEPS_8B:-5} WARMUP=1 train
    n=$(field vime-qwen3-8b-4096-none tokens_per_s); f=$(field vime-qwen3-8b-4096-full tokens_per_s)
    pn=$(field vime-qwen3-8b-4096-none peak_mem_gib); pf=$(field vime-qwen3-8b-4096-full peak_mem_gib)
    errors
    verdict "$ROW" "qwen3-8b s=4096 8192 tokens/step on one GPU: no recompute $(printf %.0f "$n") tokens/s (peak $(printf %.1f "$pn") GiB), full recompute $(printf %.0f "$f") tokens/s (peak $(printf %.1f "$pf") GiB); 0 = did not fit or failed, see the ERROR lines" RECORDED
    ;;
  4b-fp8)
    MODELS=qwen3-4b RECOMPUTES=none SYSTEMS=vime train
    RESULTS_DIR=$RESULTS_DIR/fp8 VIME_FLAGS="--fp8-format hybrid --fp8-recipe $FP8_RECIPE" MODELS=qwen3-4b \
      RECOMPUTES=none SYSTEMS=vime train
    b=$(field vime-qwen3-4b-4096-none tokens_per_s)
    f=$(RESULTS_DIR=$RESULTS_DIR/fp8 field vime-qwen3-4b-4096-none tokens_per_s)
    r=$(ratio "$f" "$b"); errors
    verdict "$ROW" "qwen3-4b s=4096 8192 tokens/step: FP8 (hybrid, $FP8_RECIPE) $(printf %.0f "$f") tokens/s, bf16 $(printf %.0f "$b"), fp8/bf16 = ${r}x (stretch goal >= 25000; the log-prob error: scripts/gpu/fp8_error.sh)" \
      "$([ "$(ge "$f" 25000)" = 1 ] && echo PASS || echo FAIL)"
    ;;
  4b-256k-fp8)
    STEPS=${STEPS_256K:-3} WARMUP=${WARMUP_256K:-1} VIME_FLAGS="--fp8-format hybrid --fp8-recipe $FP8_RECIPE" \
      MODELS=qwen3-4b RECOMPUTES=none SYSTEMS=vime TOKENS_PER_STEP=262144 train
    v=$(field vime-qwen3-4b-4096-none tokens_per_s); errors
    verdict "$ROW" "qwen3-4b s=4096 262144 tokens/step (32 micro-batches), FP8 linear layers ($FP8_RECIPE): vime $(printf %.0f "$v") tokens/s (the bf16 row's goal: >= 21000)" \
      "$([ "$(ge "$v" 21000)" = 1 ] && echo PASS || echo FAIL)"
    ;;
  *) echo "bench_rows.sh: unknown row $ROW (4b, 4b-256k, 0.6b, 4b-ragged, 4b-recompute, 8b, 4b-fp8, 4b-256k-fp8)" >&2; exit 2 ;;
esac
