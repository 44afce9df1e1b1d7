#!/usr/bin/env bash
# Every vime CUDA kernel on the H200 against the CPU kernel of the same op, forward and backward,
# bf16, real Qwen3-4B shapes, plus the fused AdamW against the CPU update (issue 6, item 1); then
# the kernels' timings next to torch's equivalents on the same shapes. One command, on the GPU
# machine, from the repo root:
#
#   scripts/gpu/check_kernels.sh [OUT_DIR]
#
# Needs gpu-carry/{device-env.sh, cuda_vs_cpu.xz, COMMIT} (and optionally flash_harness.xz, the
# standalone attention harness, whose timings are then appended, and vocab_parallel.xz, see below): the test binary of
# kernels/tests/cuda_vs_cpu.rs, built here with
#   cargo test --release -p vime-kernels --features cudnn --test cuda_vs_cpu --no-run
# (`--features cudnn` after `source scripts/gpu/cudnn-headers.sh` also checks cuDNN's attention;
# `--features cuda` checks vime's own kernels only)
# and the machine's python3 with torch. Ends with the verdict line of the correctness check.
set -uo pipefail
OUT=${1:-${OUT:-/tmp/check_kernels_out}}
mkdir -p "$OUT"
source gpu-carry/device-env.sh
BIN=/tmp/cuda_vs_cpu
[ -x "$BIN" ] || { xz -dc gpu-carry/cuda_vs_cpu.xz > "$BIN" && chmod +x "$BIN"; }
LOG="$OUT/check_kernels.txt"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(cat gpu-carry/COMMIT 2>/dev/null || echo unknown)"
  echo "command: scripts/gpu/check_kernels.sh $*"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
} | tee "$LOG"
"$BIN" every_op --nocapture --test-threads 1 2>&1 | tee -a "$LOG"
check=${PIPESTATUS[0]}
# The built-in engine's device ops (sampling, KV-cache row writes).
"$BIN" engine_ops --nocapture --test-threads 1 2>&1 | tee -a "$LOG"
[ "${PIPESTATUS[0]}" = 0 ] || check=1
echo "--- timings (median of 20 after 2 warm-ups; fwd, and fwd + bwd of sum(y * w)) ---" | tee -a "$LOG"
"$BIN" timings --nocapture --test-threads 1 2>&1 | tee "$OUT/vime_times.txt" | tee -a "$LOG"
PYTHONUNBUFFERED=1 python3 scripts/gpu/torch_kernel_times.py "$OUT/vime_times.txt" 2>&1 | tee -a "$LOG"
if [ -f gpu-carry/flash_harness.xz ]; then
  # The attention kernels alone (kernels/cuda/harness/flash_harness.cu, built here with
  # nvcc -O3 -std=c++17 -arch=sm_90 -lineinfo kernels/cuda/harness/flash_harness.cu).
  echo "--- flash harness ---" | tee -a "$LOG"
  xz -dc gpu-carry/flash_harness.xz > /tmp/flash_harness && chmod +x /tmp/flash_harness
  /tmp/flash_harness 2>&1 | tee -a "$LOG"
fi
if [ -f gpu-carry/vocab_parallel.xz ]; then
  # The vocab-parallel log-prob/entropy (tensor parallelism) at TP 1 and 2 on this GPU, against the
  # fused CUDA kernel: the test binary of models/qwen3/tests/vocab_parallel.rs, built with
  #   cargo test --release -p vime-qwen3 --features cuda --test vocab_parallel --no-run
  echo "--- vocab-parallel LM head on CUDA ---" | tee -a "$LOG"
  xz -dc gpu-carry/vocab_parallel.xz > /tmp/vocab_parallel && chmod +x /tmp/vocab_parallel
  /tmp/vocab_parallel cuda_ --nocapture --test-threads 1 2>&1 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" = 0 ] || check=1
  grep "VOCAB_PARALLEL CUDA VERDICT" "$LOG" | tail -1
fi
grep "CHECK_KERNELS VERDICT" "$LOG" | tail -1
exit "$check"
