#!/usr/bin/env bash
# The training step's GEMMs at a release shape (issue 21): `vime-train bench-gemm` times every
# linear layer's forward, input-gradient and weight-gradient GEMM as the block runs them (cuBLAS
# GemmEx, default algorithm), the same through cuBLASLt with each of its top heuristic algorithms,
# and fused q|k|v and gate|up layers. Prints the per-layer totals x layers and a verdict on the
# two questions it answers: does fusing q|k|v and gate|up pay, and how much could a per-shape
# algorithm choice take off a step. On the GPU machine, from the repo root:
#
#   scripts/gpu/bench_gemm.sh [OUT_DIR]        MODELS="qwen3-4b qwen3-0.6b" TOKENS=8192 ALGOS=16
#
# Needs gpu-carry/{device-env.sh, vime-train.xz (--features cuda or cudnn), COMMIT}.
set -uo pipefail
OUT=${1:-${OUT:-/tmp/bench_gemm_out}}
MODELS=${MODELS:-"qwen3-4b qwen3-0.6b"}
TOKENS=${TOKENS:-8192}
ALGOS=${ALGOS:-16}
mkdir -p "$OUT"
source gpu-carry/device-env.sh
BIN=${BIN:-/tmp/vime-train}
[ -x "$BIN" ] || { xz -dc gpu-carry/vime-train.xz > "$BIN" && chmod +x "$BIN"; }
for m in $MODELS; do
  LOG="$OUT/bench-gemm-$m.txt"
  {
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit: $(cat gpu-carry/COMMIT 2>/dev/null || echo unknown)"
    echo "command: MODELS=$m TOKENS=$TOKENS ALGOS=$ALGOS scripts/gpu/bench_gemm.sh"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    "$BIN" bench-gemm --model "$m" --tokens "$TOKENS" --algos "$ALGOS" 2>&1
  } | tee "$LOG"
  # TOTAL lines: "... x N layers: GemmEx / Lt[0] / Lt best ms".
  python3 - "$LOG" "$m" <<'PY'
import re, sys
log, model = sys.argv[1], sys.argv[2]
tot = {}
for line in open(log):
    m = re.match(r"TOTAL layer, (.*?): .*layers: ([\d.]+) / ([\d.]+) / ([\d.]+) ms", line)
    if m:
        tot[m.group(1)] = [float(m.group(i)) for i in (2, 3, 4)]
sep = tot.get("separate (as now)")
fus = tot.get("fused qkv + gate_up")
if not sep or not fus:
    print(f"BENCH GEMM VERDICT ({model}): FAIL (no totals in {log})")
    sys.exit(1)
fuse_gain = sep[0] - fus[0]
algo_gain = sep[0] - sep[2]
print(
    f"BENCH GEMM VERDICT ({model}): GEMMs of one 8192-token micro-batch {sep[0]:.1f} ms as run; "
    f"fusing q|k|v and gate|up {'pays' if fuse_gain > 0.01 * sep[0] else 'does not pay'} "
    f"({fuse_gain:+.1f} ms); the best of the cuBLASLt heuristic algorithms per GEMM "
    f"{'pays' if algo_gain > 0.02 * sep[0] else 'does not pay'} ({algo_gain:+.1f} ms, "
    f"{100 * algo_gain / sep[0]:.1f} %; an upper bound: the minimum of several noisy timings)"
)
PY
done
