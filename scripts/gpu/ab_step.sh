#!/usr/bin/env bash
# Same-machine A/B of vime-train binaries on the training step (issue 21): bench-step with each
# binary in turn, ROUNDS times, the order reversed every other round (base new, new base, ...):
# in the first runs of this script (one order each round) the binary run last was the slowest in
# three of four groups, an order effect as large as the changes measured. Prints every RESULT
# line and the median step time of each against the first. On the GPU machine, from the repo
# root:
#
#   scripts/gpu/ab_step.sh [OUT_DIR]   MODELS="qwen3-0.6b qwen3-4b" BINS="base new" ROUNDS=4 STEPS=8
#                                      RECOMPUTE=none EXTRA=""
#
# Binary NAME is gpu-carry/vime-train-NAME.xz (`new`: gpu-carry/vime-train.xz), described by
# gpu-carry/COMMIT-NAME (`new`: COMMIT); BIN_<NAME>=OTHER runs binary OTHER under the name NAME,
# with ENV_<NAME>="VAR=VALUE ..." in its environment (e.g. BINS="base new lt0" BIN_lt0=new
# ENV_lt0=VIME_GEMM_AUTOTUNE=0) and ARGS_<NAME>="--flag value" added to its bench-step flags
# (e.g. BINS="base new bf" BIN_bf=new ARGS_bf="--lm-head-logits bf16"). Ends with
# `AB STEP (<model>): ...` per model.
set -uo pipefail
OUT=${1:-${OUT:-/tmp/ab_step_out}}
MODELS=${MODELS:-"qwen3-0.6b qwen3-4b"}
BINS=${BINS:-"base new"}
ROUNDS=${ROUNDS:-4}
STEPS=${STEPS:-8}
RECOMPUTE=${RECOMPUTE:-none}
EXTRA=${EXTRA:-}
mkdir -p "$OUT"
source gpu-carry/device-env.sh
xzof() { [ "$1" = new ] && echo gpu-carry/vime-train.xz || echo "gpu-carry/vime-train-$1.xz"; }
commitof() { [ "$1" = new ] && cat gpu-carry/COMMIT 2>/dev/null || cat "gpu-carry/COMMIT-$1" 2>/dev/null || echo unknown; }
binof() { local v="BIN_$1"; echo "${!v:-$1}"; }
envof() { local v="ENV_$1"; echo "${!v:-}"; }
argsof() { local v="ARGS_$1"; echo "${!v:-}"; }
for b in $BINS; do
  x=$(binof "$b")
  [ -x "/tmp/vime-train-ab-$x" ] || { xz -dc "$(xzof "$x")" > "/tmp/vime-train-ab-$x" && chmod +x "/tmp/vime-train-ab-$x"; }
done
LOG="$OUT/ab-step.txt"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  for b in $BINS; do echo "$b: $(commitof "$(binof "$b")") $(envof "$b") $(argsof "$b")"; done
  echo "command: MODELS='$MODELS' BINS='$BINS' ROUNDS=$ROUNDS STEPS=$STEPS RECOMPUTE=$RECOMPUTE EXTRA='$EXTRA' scripts/gpu/ab_step.sh"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
} | tee -a "$LOG"
for m in $MODELS; do
  for ((r = 0; r < ROUNDS; r++)); do
    order=$BINS
    [ $((r % 2)) = 1 ] && order=$(echo "$BINS" | tr ' ' '\n' | tac | tr '\n' ' ')
    for b in $order; do
      # shellcheck disable=SC2086
      line=$(env $(envof "$b") timeout 300 "/tmp/vime-train-ab-$(binof "$b")" bench-step --model "$m" --seq-len 4096 --max-tokens-per-gpu 8192 \
        --recompute "$RECOMPUTE" --steps "$STEPS" --warmup 2 $EXTRA $(argsof "$b") 2>&1 | grep -E '^RESULT|rror' | tail -1)
      echo "$b $line" | tee -a "$LOG"
    done
  done
  python3 - "$m" "$LOG" "$BINS" "$EXTRA" <<'PY' | tee -a "$LOG"
import re, statistics, sys
m, log, bins, extra = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4]
t = {b: [] for b in bins}
for line in open(log):
    # The step time from tokens/step over tokens/s (5 digits; the printed step has 3 decimals).
    g = re.match(r"(\S+) RESULT vime (\S+) .*?tokens/step (\d+) .*?, (\d+) tokens/s", line)
    if g and g.group(1) in t and g.group(2) == m:
        t[g.group(1)].append(round(int(g.group(3)) / int(g.group(4)), 5))
if any(not v for v in t.values()):
    print(f"AB STEP ({m} {extra}): FAIL (a binary did not run: {t})")
else:
    med = {b: statistics.median(v) for b, v in t.items()}
    ref = med[bins[0]]
    print(f"AB STEP ({m} {extra}): " + ", ".join(
        f"{b} {med[b]:.4f} s {t[b]} ({100 * (med[b] / ref - 1):+.2f} %)" for b in bins))
PY
done
