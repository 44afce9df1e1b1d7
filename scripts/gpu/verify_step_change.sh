#!/usr/bin/env bash
# One device call that checks a change to the training step (issue 21): the kernel check
# (every_op + engine_ops of kernels/tests/cuda_vs_cpu.rs), the step A/B against a base binary at
# 0.6B (and 4B where the card holds it), a 0.6B timeline of the new binary, and HF parity. Each
# part prints its verdict line; everything lands under OUT_DIR. On the GPU machine, from the repo
# root, with gpu-carry/ holding device-env.sh, cupti/, vime-train.xz + COMMIT (new),
# vime-train-base.xz + COMMIT-base, and cuda_vs_cpu.xz (the new commit's test binary: strip and
# xz `cargo test --release -p vime-kernels --features cudnn --test cuda_vs_cpu --no-run`):
#
#   scripts/gpu/verify_step_change.sh [OUT_DIR]      (about 330 s on an H100, 5 parts)
#
# Used for benches/results/2026-12-05-perf-next.md.
set -uo pipefail
OUT=${1:-${OUT:-/tmp/verify_out}}
mkdir -p "$OUT"
source gpu-carry/device-env.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
xz -dc gpu-carry/cuda_vs_cpu.xz > /tmp/cvc && chmod +x /tmp/cvc
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(cat gpu-carry/COMMIT)"
  echo "command: /tmp/cvc every_op engine_ops --nocapture --test-threads 1"
  cat "$OUT/gpu.txt"
} > "$OUT/every_op.txt"
s=$(date +%s)
timeout 260 /tmp/cvc every_op engine_ops --nocapture --test-threads 1 >> "$OUT/every_op.txt" 2>&1
echo "checks rc $? in $(( $(date +%s) - s )) s"
grep -E 'VERDICT| FAIL$|test result' "$OUT/every_op.txt" | cut -c1-200 | tail -8
s=$(date +%s)
MODELS=qwen3-0.6b ROUNDS=4 timeout 100 scripts/gpu/ab_step.sh "$OUT/ab06" > "$OUT/ab06.log" 2>&1
echo "ab 0.6b rc $? in $(( $(date +%s) - s )) s"; tail -1 "$OUT/ab06/ab-step.txt"
if grep -q H100 "$OUT/gpu.txt"; then
  echo "ab 4b skipped: Qwen3-4B does not fit an 80 GB card"
else
  s=$(date +%s)
  MODELS=qwen3-4b ROUNDS=3 timeout 100 scripts/gpu/ab_step.sh "$OUT/ab4" > "$OUT/ab4.log" 2>&1
  echo "ab 4b rc $? in $(( $(date +%s) - s )) s"; tail -1 "$OUT/ab4/ab-step.txt"
fi
xz -dc gpu-carry/vime-train.xz > /tmp/vime-train && chmod +x /tmp/vime-train
s=$(date +%s)
MODEL=qwen3-0.6b STEPS=4 WARMUP=1 API=0 timeout 60 scripts/gpu/timeline.sh "$OUT/tl06" > "$OUT/tl06.log" 2>&1
echo "timeline rc $? in $(( $(date +%s) - s )) s"
s=$(date +%s)
timeout 150 bash scripts/gpu/hf_parity.sh "$OUT/hf" > "$OUT/hf.log" 2>&1
echo "hf rc $? in $(( $(date +%s) - s )) s"; grep -E 'VERDICT' "$OUT/hf/hf_parity.txt" | tail -1
