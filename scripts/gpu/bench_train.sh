#!/usr/bin/env bash
# Training throughput, vime against Megatron-Core and HF transformers on the H200 (issue 7): for
# each model in MODELS, sequence length in SEQS and recompute policy in RECOMPUTES, every system
# in SYSTEMS runs the same optimizer step (random-init Qwen3 release shapes, random tokens, bf16
# compute, fp32 master weights + AdamW, clipping at 1.0) on the SAME tokens per optimizer step,
# each in its own process under a timeout; a failure prints its error line and the loop goes on.
# vime is `vime-train bench-step` (trainer/src/bench.rs); the others are
# scripts/gpu/bench_train_torch.py (--system megatron|megatron-te|hf|hf-compile), which prints the same
# RESULT line. On the GPU machine, from the repo root:
#
#   scripts/gpu/bench_train.sh [OUT_DIR]
#
# Needs gpu-carry/{device-env.sh, vime-train.xz, COMMIT} (vime-train built with --features cudnn
# after `source scripts/gpu/cudnn-headers.sh`, as recorded in benches/results; a --features cuda
# build runs vime's own flash attention) and, for megatron, megatron-core 0.19.2
# importable or its wheel in .whl/ (installed here into /tmp/site; see the docstring of
# bench_train_torch.py for fetching it). Settings (environment):
#   MODELS="qwen3-4b qwen3-0.6b"  SEQS="4096"  RECOMPUTES="full none"
#   SYSTEMS="vime megatron hf hf-compile"  STEPS=20  WARMUP=3  TIMEOUT=480 (s per contender)
#     megatron-te (Megatron-Core with Transformer Engine) is not in the default: it needs TE in
#     TE_SITE (default /tmp/te-site), installed by scripts/gpu/te_kit.sh, and megatron-core.
#   TOKENS_PER_STEP=8192 (all models), or per model TOKENS_PER_STEP_qwen3_4b=..., _qwen3_0_6b=...
#   MB_VIME MB_MEGATRON MB_MEGATRON_TE MB_HF MB_HF_COMPILE: sequences per micro-batch (default 2, and 1 for
#     hf-compile, as in the issue's anchors); each system runs TOKENS_PER_STEP / (MB * seq)
#     micro-batches per step (must divide exactly).
#   VIME_FLAGS="": extra bench-step flags for vime, e.g. "--attention-backend flash" (vime's own
#     attention kernel instead of cuDNN's in a cudnn build).
# The recorded runs (benches/results/2026-11-30-bench-train-h200-*.md) used
#   MODELS=qwen3-4b RECOMPUTES=none TIMEOUT=170 scripts/gpu/bench_train.sh $OUT/bench
# so that one call fits the device tool's 10-minute limit (torch.compile alone warms up ~2 min).
#   RESULTS_DIR=/tmp/bench_train_results: RESULT lines kept across calls on a warm machine, so a
#     sweep can be split over several calls (one call is limited to 10 minutes); RESET=1 empties
#     it first; SUMMARY_ONLY=1 runs nothing and prints the table and verdict of what is there.
# Ends with the table of RESULT lines, vime/Megatron and vime/HF (best of hf, hf-compile) ratios
# of tokens/s per model and sequence length (each system at its best recompute policy), and
#   BENCH_TRAIN VERDICT: vime/megatron = X.XXx, vime/hf = Y.YYx on qwen3-4b seq 4096 (target >= 1.0x and >= 1.2x): PASS|FAIL
# (issue 7's goal). NO_VERDICT=1 prints the table without that line and exits 0: bench_rows.sh
# sets it, since each of its rows has its own goal and verdict, and a 0.6b row's log should not
# carry a FAIL about a 4B comparison it never ran.
set -uo pipefail
OUT=${1:-${OUT:-/tmp/bench_train_out}}
MODELS=${MODELS:-"qwen3-4b qwen3-0.6b"}
SEQS=${SEQS:-"4096"}
RECOMPUTES=${RECOMPUTES:-"full none"}
SYSTEMS=${SYSTEMS:-"vime megatron hf hf-compile"}
STEPS=${STEPS:-20}
WARMUP=${WARMUP:-3}
TIMEOUT=${TIMEOUT:-480}
TOKENS_PER_STEP=${TOKENS_PER_STEP:-8192}
MB_VIME=${MB_VIME:-2}
VIME_FLAGS=${VIME_FLAGS:-}
MB_MEGATRON=${MB_MEGATRON:-2}
MB_MEGATRON_TE=${MB_MEGATRON_TE:-2}
TE_SITE=${TE_SITE:-/tmp/te-site}
MB_HF=${MB_HF:-2}
MB_HF_COMPILE=${MB_HF_COMPILE:-1}
RESULTS_DIR=${RESULTS_DIR:-/tmp/bench_train_results}
PY=${PY:-python3}
VERDICT_MODEL=qwen3-4b
VERDICT_SEQ=4096
mkdir -p "$OUT" "$RESULTS_DIR"
[ "${RESET:-0}" = 1 ] && rm -f "$RESULTS_DIR"/*.result "$RESULTS_DIR"/*.json
source gpu-carry/device-env.sh
LOG="$OUT/bench_train.txt"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(cat gpu-carry/COMMIT 2>/dev/null || echo unknown)"
  echo "command: MODELS=\"$MODELS\" SEQS=\"$SEQS\" RECOMPUTES=\"$RECOMPUTES\" SYSTEMS=\"$SYSTEMS\" STEPS=$STEPS WARMUP=$WARMUP TOKENS_PER_STEP=$TOKENS_PER_STEP MB_VIME=$MB_VIME MB_MEGATRON=$MB_MEGATRON MB_HF=$MB_HF MB_HF_COMPILE=$MB_HF_COMPILE VIME_FLAGS=\"$VIME_FLAGS\" TIMEOUT=$TIMEOUT scripts/gpu/bench_train.sh $*"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' 2>&1
} | tee -a "$LOG"

if [ "${SUMMARY_ONLY:-0}" != 1 ]; then
  if [[ " $SYSTEMS " == *" vime "* ]]; then
    BIN=/tmp/vime-train
    [ -x "$BIN" ] || { xz -dc gpu-carry/vime-train.xz > "$BIN" && chmod +x "$BIN"; }
  fi
  if [[ " $SYSTEMS " == *" megatron"* ]] && ! $PY -c 'import megatron.core' >/dev/null 2>&1; then
    if compgen -G ".whl/megatron_core-*.whl" >/dev/null; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl 2>&1 | tee -a "$LOG"
      export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    $PY -c 'import megatron.core as m; print("megatron-core", m.__version__)' 2>&1 | tail -1 | tee -a "$LOG"
  fi

  for model in $MODELS; do
    var="TOKENS_PER_STEP_${model//[-.]/_}"
    tokens=${!var:-$TOKENS_PER_STEP}
    for seq in $SEQS; do
      for rec in $RECOMPUTES; do
        for sys in $SYSTEMS; do
          case $sys in
            vime) mb=$MB_VIME ;;
            megatron) mb=$MB_MEGATRON ;;
            megatron-te) mb=$MB_MEGATRON_TE ;;
            hf) mb=$MB_HF ;;
            hf-compile) mb=$MB_HF_COMPILE ;;
            *) echo "ERROR $sys: unknown system (vime, megatron, megatron-te, hf, hf-compile)" | tee -a "$LOG"; continue ;;
          esac
          key="$sys-$model-$seq-$rec"
          if (( tokens % (mb * seq) != 0 )); then
            echo "ERROR $key: $tokens tokens per step is not a multiple of $mb x $seq" | tee -a "$LOG"
            continue
          fi
          k=$(( tokens / (mb * seq) ))
          json="$RESULTS_DIR/$key.json"
          if [ "$sys" = vime ]; then
            cmd=("$BIN" bench-step --model "$model" --seq-len "$seq" --max-tokens-per-gpu $(( mb * seq ))
                 --micro-batches "$k" --recompute "$rec" --steps "$STEPS" --warmup "$WARMUP" --json "$json" $VIME_FLAGS)
          else
            # Transformer Engine only where asked for: with it importable, Megatron-Core also
            # swaps its optimizer and clipping kernels for TE's, which would change `megatron`.
            pp=${PYTHONPATH:-}
            [ "$sys" = megatron-te ] && pp=$TE_SITE${pp:+:$pp}
            cmd=(env PYTHONPATH="$pp" $PY scripts/gpu/bench_train_torch.py --system "$sys" --model "$model" --seq-len "$seq"
                 --micro-batch "$mb" --grad-accum "$k" --recompute "$rec" --steps "$STEPS"
                 --warmup "$WARMUP" --json "$json")
          fi
          run="$OUT/run-$key.txt"
          echo "=== $key: $mb x $seq tokens per micro-batch, $k micro-batches per step: ${cmd[*]}" | tee -a "$LOG"
          rm -f "$RESULTS_DIR/$key.result"
          PYTHONUNBUFFERED=1 timeout "$TIMEOUT" "${cmd[@]}" > "$run" 2>&1
          rc=$?
          cat "$run" >> "$LOG"
          if grep -q '^RESULT' "$run"; then
            grep '^RESULT' "$run" | tail -1 | tee "$RESULTS_DIR/$key.result"
          else
            if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
              why="timed out after ${TIMEOUT}s"
            else
              why=$(grep -E 'Error|error:|Exception|out of memory|OOM|panicked|Killed' "$run" | tail -1)
              [ -n "$why" ] || why=$(tail -1 "$run")
            fi
            echo "ERROR $key (exit $rc): $why" | tee -a "$LOG"
          fi
        done
      done
    done
  done
fi

# Summary over everything in RESULTS_DIR (this call's runs and earlier calls' on this machine).
SUMMARY="$OUT/bench_train_summary.txt"
{
  echo "--- RESULT lines ($RESULTS_DIR)"
  cat "$RESULTS_DIR"/*.result 2>/dev/null
  echo "--- tokens/s ratios (each system at its best recompute policy)"
  cat "$RESULTS_DIR"/*.result 2>/dev/null | awk -v vm="$VERDICT_MODEL" -v vs="$VERDICT_SEQ" -v nv="${NO_VERDICT:-0}" '
    # RESULT <system> <model> seq <S> tokens/step <T> recompute <R>: step ... , <N> tokens/s, ...
    $1 == "RESULT" {
      sys = $2; key = $3 " seq " $5; rec = $9; sub(/:$/, "", rec)
      tps = 0
      for (i = 2; i <= NF; i++) if ($i == "tokens/s,") tps = $(i - 1) + 0
      grp = (sys == "hf" || sys == "hf-compile") ? "hf" : sys
      if (tps > best[key, grp]) { best[key, grp] = tps; how[key, grp] = sys " recompute " rec }
      keys[key] = 1
    }
    END {
      for (key in keys) {
        v = best[key, "vime"]; m = best[key, "megatron"]; h = best[key, "hf"]; t = best[key, "megatron-te"]
        line = key ":"
        line = line sprintf(" vime %s, megatron %s, hf %s;", v ? sprintf("%.0f (%s)", v, how[key, "vime"]) : "n/a",
                            m ? sprintf("%.0f (%s)", m, how[key, "megatron"]) : "n/a",
                            h ? sprintf("%.0f (%s)", h, how[key, "hf"]) : "n/a")
        line = line sprintf(" vime/megatron = %s, vime/hf = %s", (v && m) ? sprintf("%.2fx", v / m) : "n/a",
                            (v && h) ? sprintf("%.2fx", v / h) : "n/a")
        if (t) line = line sprintf("; megatron-te %.0f (%s), vime/megatron-te = %s", t, how[key, "megatron-te"],
                                   v ? sprintf("%.2fx", v / t) : "n/a")
        print line
      }
      if (nv) exit
      key = vm " seq " vs
      v = best[key, "vime"]; m = best[key, "megatron"]; h = best[key, "hf"]
      rm = (v && m) ? v / m : 0; rh = (v && h) ? v / h : 0
      verdict = (rm >= 1.0 && rh >= 1.2) ? "PASS" : "FAIL"
      printf "BENCH_TRAIN VERDICT: vime/megatron = %s, vime/hf = %s on %s seq %s (target >= 1.0x and >= 1.2x): %s\n",
             rm ? sprintf("%.2fx", rm) : "n/a", rh ? sprintf("%.2fx", rh) : "n/a", vm, vs, verdict
    }'
} > "$SUMMARY"
cat "$SUMMARY" | tee -a "$LOG"
[ "${NO_VERDICT:-0}" = 1 ] && exit 0
grep -q 'BENCH_TRAIN VERDICT: .*: PASS$' "$SUMMARY"
