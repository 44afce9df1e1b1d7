#!/usr/bin/env bash
# The step's first wait after the host's post-backward work (47101f0) on a GPU: bench-step at
# Qwen3-0.6B with the binary before it (gpu-carry/vime-train-base.xz, COMMIT-base) against the one
# after (gpu-carry/vime-train.xz, COMMIT), ROUNDS rounds in alternating order, in bf16 and with
# FP8 delayed scaling; then a timeline of each binary in bf16, for the GPU's idle time between the
# backward's end and the optimizer's first kernel. The two binaries give the same bits; only where
# the host waits for the device moved. From the repo root on the GPU machine:
#
#   scripts/gpu/first_wait.sh [OUT_DIR]     MODEL=qwen3-0.6b ROUNDS=4 STEPS=8
#
# Needs gpu-carry/{device-env.sh, vime-train.xz, vime-train-base.xz, COMMIT, COMMIT-base, cupti/}.
# First, 4 deterministic steps (--deterministic-mode) with each binary, bf16 and FP8 delayed: the
# final losses must be equal (the changes move where the host waits, not what is computed).
# Ends with `FIRST WAIT VERDICT: PASS` when they are and the new binary's median step is at most
# the base's in both A/Bs.
set -uo pipefail
OUT=${1:-${OUT:-/tmp/first_wait_out}}
MODEL=${MODEL:-qwen3-0.6b}
mkdir -p "$OUT"
source gpu-carry/device-env.sh >/dev/null 2>&1
# The same bits: 4 deterministic steps with each binary, bf16 and FP8 delayed, the same final loss.
same=PASS
for mode in bf16 fp8d; do
  A=""; [ "$mode" = fp8d ] && A="--fp8-format hybrid --fp8-recipe delayed"
  for b in base new; do
    x=gpu-carry/vime-train.xz; [ "$b" = base ] && x=gpu-carry/vime-train-base.xz
    [ -x "/tmp/vime-train-fw-$b" ] || { xz -dc "$x" > "/tmp/vime-train-fw-$b" && chmod +x "/tmp/vime-train-fw-$b"; }
    # shellcheck disable=SC2086
    "/tmp/vime-train-fw-$b" bench-step --model "$MODEL" --seq-len 4096 --max-tokens-per-gpu 8192 --recompute none \
      --steps 4 --warmup 1 --deterministic-mode $A --json "$OUT/det-$b-$mode.json" > "$OUT/det-$b-$mode.txt" 2>&1
  done
  l=$(python3 -c 'import json,sys; print(*[json.load(open(f)).get("final_loss") for f in sys.argv[1:]])' \
    "$OUT/det-base-$mode.json" "$OUT/det-new-$mode.json" 2>/dev/null)
  echo "$mode: final loss after 4 deterministic steps, base and new: $l"
  read -r a b <<< "$l"
  [ -n "$a" ] && [ "$a" = "$b" ] || same=FAIL
done
abs=""
for mode in bf16 fp8d; do
  A=""; [ "$mode" = fp8d ] && A="--fp8-format hybrid --fp8-recipe delayed"
  MODELS=$MODEL ROUNDS=${ROUNDS:-4} STEPS=${STEPS:-8} BINS="base new" ARGS_base="$A" ARGS_new="$A" \
    scripts/gpu/ab_step.sh "$OUT/ab-$mode" > "$OUT/ab-$mode.log" 2>&1
  ab=$(grep '^AB STEP' "$OUT/ab-$mode/ab-step.txt" | tail -1)
  echo "$mode: $ab"
  abs="$abs|$ab"
done
for b in base new; do
  x=gpu-carry/vime-train.xz; [ "$b" = base ] && x=gpu-carry/vime-train-base.xz
  xz -dc "$x" > "/tmp/vime-train-fw-$b" && chmod +x "/tmp/vime-train-fw-$b"
  BIN=/tmp/vime-train-fw-$b MODEL=$MODEL STEPS=4 WARMUP=1 API=0 TAG=$b scripts/gpu/timeline.sh "$OUT/tl" > "$OUT/tl-$b.log" 2>&1
  echo "$b timeline:"; grep -hE "per step|before memcpy 9920" "$OUT"/tl/timeline-*-"$b".txt | head -4
done
v=$(python3 -c 'import re,sys
ok = []
for ab in sys.argv[1].split("|")[1:]:
    d = dict(re.findall(r"(base|new) ([0-9.]+) s", ab))
    ok.append("base" in d and "new" in d and float(d["new"]) <= float(d["base"]))
print("PASS" if ok and all(ok) else "FAIL")' "$abs")
[ "$same" = PASS ] || v=FAIL
echo "FIRST WAIT VERDICT: $v (same bits $same; $(echo "${abs#|}" | sed 's/|/; /'))"
