#!/usr/bin/env bash
# Before/after throughput of one change on the H200 (issue 14: the block redesign, the kernel
# configuration as a value and the ZeRO-1 optimizer must not slow the one-GPU step): the same
# `vime-train bench-step` workload run by two binaries in one call, interleaved A B A B so that
# drift of the machine hits both alike. On the GPU machine, from the repo root:
#
#   scripts/gpu/bench_redesign.sh [OUT_DIR]
#
# Needs gpu-carry/{device-env.sh, vime-train-before.xz, COMMIT-before, vime-train.xz, COMMIT}
# (both built with --features cudnn after `source scripts/gpu/cudnn-headers.sh`).
# Settings: MODEL=qwen3-4b SEQ=4096 TOKENS=8192 RECOMPUTE=none STEPS=20 WARMUP=3 ROUNDS=2
#   TOL=0.02 (the after binary may be at most this fraction slower: the noise seen between runs of
#   one binary, 1.7 % for Megatron-Core in benches/results/2026-11-30-bench-train-h200-cudnn.md)
# Ends with
#   BENCH_REDESIGN VERDICT: after X tokens/s vs before Y tokens/s (ratio R, tolerance TOL): PASS|FAIL
set -uo pipefail
OUT=${1:-${OUT:-/tmp/bench_redesign_out}}
MODEL=${MODEL:-qwen3-4b}
SEQ=${SEQ:-4096}
TOKENS=${TOKENS:-8192}
RECOMPUTE=${RECOMPUTE:-none}
STEPS=${STEPS:-20}
WARMUP=${WARMUP:-3}
ROUNDS=${ROUNDS:-2}
TOL=${TOL:-0.02}
mkdir -p "$OUT"
source gpu-carry/device-env.sh
for v in before after; do
  src=gpu-carry/vime-train.xz
  [ "$v" = before ] && src=gpu-carry/vime-train-before.xz
  [ -x "/tmp/vime-train-$v" ] || { xz -dc "$src" > "/tmp/vime-train-$v" && chmod +x "/tmp/vime-train-$v"; }
done
LOG="$OUT/bench_redesign.txt"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit before: $(cat gpu-carry/COMMIT-before 2>/dev/null || echo unknown)"
  echo "commit after: $(cat gpu-carry/COMMIT 2>/dev/null || echo unknown)"
  echo "command: MODEL=$MODEL SEQ=$SEQ TOKENS=$TOKENS RECOMPUTE=$RECOMPUTE STEPS=$STEPS ROUNDS=$ROUNDS scripts/gpu/bench_redesign.sh $*"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
} | tee "$LOG"
for r in $(seq 1 "$ROUNDS"); do
  for v in before after; do
    echo "== round $r: $v" | tee -a "$LOG"
    "/tmp/vime-train-$v" bench-step --model "$MODEL" --seq-len "$SEQ" --max-tokens-per-gpu "$TOKENS" \
      --recompute "$RECOMPUTE" --steps "$STEPS" --warmup "$WARMUP" 2>&1 | sed "s/^RESULT/RESULT $v/" | tee -a "$LOG"
  done
done
python3 - "$LOG" "$TOL" <<'PY'
import re, statistics, sys
log, tol = sys.argv[1], float(sys.argv[2])
tps = {"before": [], "after": []}
for line in open(log):
    m = re.match(r"RESULT (before|after) .*?, ([0-9.]+) tokens/s", line)
    if m:
        tps[m.group(1)].append(float(m.group(2)))
if not tps["before"] or not tps["after"]:
    print("BENCH_REDESIGN VERDICT: missing RESULT lines: FAIL")
    sys.exit(1)
b, a = statistics.median(tps["before"]), statistics.median(tps["after"])
print(f"before: {tps['before']}  after: {tps['after']}")
ok = a >= b * (1 - tol)
print(f"BENCH_REDESIGN VERDICT: after {a:.0f} tokens/s vs before {b:.0f} tokens/s (ratio {a/b:.3f}, tolerance {tol}): {'PASS' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
PY
