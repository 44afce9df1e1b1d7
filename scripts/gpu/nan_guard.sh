#!/usr/bin/env bash
# What the trainer's NaN/Inf guard (--check-for-nan-in-loss-and-grad, on by default) costs a step:
# bench-step with --nan-guard off (the step alone), fused (the trainer's guard since 8ceb97e: the
# gradient norm's fused sums of squares) and sum-all (the guard before it: candle's one-block
# sum_all per gradient), at Qwen3-0.6B and 4B (18 of its 36 layers on an 80 GB card), one binary.
# On the GPU machine, from the repo root, with gpu-carry/{device-env.sh, vime-train.xz, COMMIT}:
#
#   scripts/gpu/nan_guard.sh [OUT_DIR]
set -uo pipefail
OUT=${1:-${OUT:-/tmp/nan_guard_out}}
mkdir -p "$OUT"
source gpu-carry/device-env.sh >/dev/null 2>&1
xz -dc gpu-carry/vime-train.xz > /tmp/vt && chmod +x /tmp/vt
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(cat gpu-carry/COMMIT 2>/dev/null || echo unknown)"
  echo "command: scripts/gpu/nan_guard.sh"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
} | tee "$OUT/nan_guard.txt"
L4=""
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100 && L4="--layers 18"
for m in "qwen3-0.6b" "qwen3-4b $L4"; do
  for g in off fused sum-all off; do
    echo "== $m --nan-guard $g" | tee -a "$OUT/nan_guard.txt"
    timeout 150 /tmp/vt bench-step --model $m --seq-len 4096 --max-tokens-per-gpu 8192 --steps 6 --warmup 2 \
      --nan-guard $g 2>&1 | grep -E "RESULT|HOST|rror" | tee -a "$OUT/nan_guard.txt"
  done
done
