#!/usr/bin/env bash
# Every vime op on the H200 against the CPU kernel, forward and backward, bf16, real Qwen3-4B
# shapes, in one command (issue 6, item 1). On the GPU machine, from the repo root:
#
#   scripts/gpu/check_kernels.sh [OUT_DIR]
#
# Needs gpu-carry/{device-env.sh, cuda_vs_cpu.xz, COMMIT}: the test binary of
# kernels/tests/cuda_vs_cpu.rs, built here with
#   cargo test --release -p vime-kernels --features cuda --test cuda_vs_cpu --no-run
# Ends with one verdict line.
set -euo pipefail
OUT=${1:-${OUT:-/tmp/check_kernels_out}}
mkdir -p "$OUT"
source gpu-carry/device-env.sh
BIN=/tmp/cuda_vs_cpu
[ -x "$BIN" ] || { xz -dc gpu-carry/cuda_vs_cpu.xz > "$BIN" && chmod +x "$BIN"; }
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(cat gpu-carry/COMMIT 2>/dev/null || echo unknown)"
  echo "command: scripts/gpu/check_kernels.sh $*"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
} | tee "$OUT/check_kernels.txt"
"$BIN" --nocapture --test-threads 1 2>&1 | tee -a "$OUT/check_kernels.txt"
