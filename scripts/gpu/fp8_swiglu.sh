#!/usr/bin/env bash
# FP8 delayed scaling's fused SwiGLU casts (vime_fp8_swiglu_cast, vime_fp8_swiglu_bwd_cast) on a
# GPU: the FP8 kernel check (the fused casts bit for bit against swiglu + cast, the delayed
# history against the CPU), then the step with the fused casts against the two-kernel path
# (bench-step --fp8-swiglu-cast separate) in one binary, ROUNDS rounds in alternating order, and
# a timeline of each. From the repo root on the GPU machine:
#
#   scripts/gpu/fp8_swiglu.sh [OUT_DIR]     MODEL=qwen3-0.6b ROUNDS=6 STEPS=6
#
# Needs gpu-carry/{device-env.sh, cuda_vs_cpu.xz, vime-train.xz, COMMIT}. Ends with
# `FP8 SWIGLU VERDICT: PASS` when the check passes and the fused step's median is below the
# separate one's.
set -uo pipefail
OUT=${1:-${OUT:-/tmp/fp8_swiglu_out}}
MODEL=${MODEL:-qwen3-0.6b}
mkdir -p "$OUT"
source gpu-carry/device-env.sh >/dev/null 2>&1
gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)
hdr() { echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"; echo "commit: $(cat gpu-carry/COMMIT 2>/dev/null || echo unknown)"; echo "command: $1"; echo "$gpu"; }
BIN=/tmp/cuda_vs_cpu
[ -x "$BIN" ] || { xz -dc gpu-carry/cuda_vs_cpu.xz > "$BIN" && chmod +x "$BIN"; }
hdr "cuda_vs_cpu fp8_on_cuda --nocapture --test-threads 1" > "$OUT/fp8_check.txt"
timeout 300 "$BIN" fp8_on_cuda --nocapture --test-threads 1 >> "$OUT/fp8_check.txt" 2>&1
grep -E '^fp8 (delayed|fused)|FP8 VERDICT' "$OUT/fp8_check.txt"
A="--fp8-format hybrid --fp8-recipe delayed"
MODELS=$MODEL ROUNDS=${ROUNDS:-6} STEPS=${STEPS:-6} BINS="sep fus" BIN_sep=new BIN_fus=new \
  ARGS_sep="$A --fp8-swiglu-cast separate" ARGS_fus="$A" scripts/gpu/ab_step.sh "$OUT/ab" > "$OUT/ab.log" 2>&1
ab=$(grep '^AB STEP' "$OUT/ab/ab-step.txt" | tail -1)
echo "$ab"
for c in separate fused; do
  MODEL=$MODEL STEPS=4 WARMUP=1 API=0 TAG=$c EXTRA="$A --fp8-swiglu-cast $c" scripts/gpu/timeline.sh "$OUT/tl" > "$OUT/tl-$c.log" 2>&1
  grep -hE "per step|vime_fp8_(cast|swiglu)|vime_swiglu" "$OUT"/tl/timeline-*-"$c".txt | head -6
done
check=FAIL; grep -q 'FP8 VERDICT: PASS' "$OUT/fp8_check.txt" && check=PASS
faster=$(python3 -c 'import re,sys
m = re.findall(r"(sep|fus) ([0-9.]+) s", sys.argv[1])
d = dict(m)
print(1 if "sep" in d and "fus" in d and float(d["fus"]) < float(d["sep"]) else 0)' "$ab")
v=FAIL; [ "$check" = PASS ] && [ "$faster" = 1 ] && v=PASS
echo "FP8 SWIGLU VERDICT: $v (kernel check $check; $ab)"
