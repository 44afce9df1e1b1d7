#!/usr/bin/env bash
# Where a training step's wall time goes, from a CUPTI timeline (issue 21): `vime-train
# bench-step` three times, (1) plain, for the step time, (2) under scripts/gpu/cupti_trace.c
# recording kernels, memcpys and memsets, (3) the same with every driver API call, then
# scripts/gpu/timeline.py splits each traced step into GPU busy time by op class and idle gaps
# and names the host calls behind the largest gaps. The tracer costs a little host time per
# launch, so (2)'s step is a bit longer than (1)'s and (3)'s longer still: (1) is the step time,
# (2) the busy/idle split, (3) what the host does.
# On the GPU machine, from the repo root (needs gpu-carry/{device-env.sh, vime-train.xz, COMMIT,
# cupti/} from scripts/gpu/cupti_trace.sh):
#
#   scripts/gpu/timeline.sh [OUT_DIR]
#
# Settings: MODEL=qwen3-4b SEQ=4096 TOKENS=8192 (per micro-batch) RECOMPUTE=none STEPS=6 WARMUP=2
#   MICRO=1 (micro-batches per step) API=1 (0: skip run 3) EXTRA="" (more bench-step flags)
#   BIN=/tmp/vime-train (another vime-train binary, e.g. an earlier commit's, for an A/B)
#   TAG="" (added to the output names)
set -uo pipefail
OUT=${1:-${OUT:-/tmp/timeline_out}}
MODEL=${MODEL:-qwen3-4b}
SEQ=${SEQ:-4096}
TOKENS=${TOKENS:-8192}
RECOMPUTE=${RECOMPUTE:-none}
STEPS=${STEPS:-6}
WARMUP=${WARMUP:-2}
MICRO=${MICRO:-1}
API=${API:-1}
EXTRA=${EXTRA:-}
TAG=${TAG:-}
mkdir -p "$OUT"
source gpu-carry/device-env.sh
BIN=${BIN:-/tmp/vime-train}
[ -x "$BIN" ] || { xz -dc gpu-carry/vime-train.xz > "$BIN" && chmod +x "$BIN"; }
LIB=$PWD/gpu-carry/cupti/libvime_cupti_trace.so
tag="$MODEL-$SEQ-$TOKENS-$RECOMPUTE-m$MICRO${EXTRA:+-x}${TAG:+-$TAG}"
LOG="$OUT/timeline-$tag.txt"
# shellcheck disable=SC2206
args=(bench-step --model "$MODEL" --seq-len "$SEQ" --max-tokens-per-gpu "$TOKENS" --recompute "$RECOMPUTE"
  --micro-batches "$MICRO" --steps "$STEPS" --warmup "$WARMUP" $EXTRA)
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(cat gpu-carry/COMMIT 2>/dev/null || echo unknown) (binary $BIN)"
  echo "command: MODEL=$MODEL SEQ=$SEQ TOKENS=$TOKENS RECOMPUTE=$RECOMPUTE STEPS=$STEPS WARMUP=$WARMUP MICRO=$MICRO EXTRA='$EXTRA' scripts/gpu/timeline.sh"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  echo "--- (1) plain"
  "$BIN" "${args[@]}" 2>&1 | grep -E '^RESULT|rror' | tail -3
  echo "--- (2) kernels traced"
  CUDA_INJECTION64_PATH=$LIB CUPTI_TRACE_OUT=/tmp/trace-k$TAG.txt "$BIN" "${args[@]}" 2>&1 | grep -E '^RESULT|rror|cupti' | tail -3
  python3 scripts/gpu/timeline.py /tmp/trace-k$TAG.txt --steps "$STEPS" --top 30
  if [ "$API" = 1 ]; then
    echo "--- (3) kernels and driver API traced"
    CUDA_INJECTION64_PATH=$LIB CUPTI_TRACE_OUT=/tmp/trace-a.txt CUPTI_TRACE_API=1 "$BIN" "${args[@]}" 2>&1 | grep -E '^RESULT|rror|cupti' | tail -3
    python3 scripts/gpu/timeline.py /tmp/trace-a.txt --steps "$STEPS" --top 20
  fi
} 2>&1 | tee "$LOG"
xz -T4 -6 -c /tmp/trace-k$TAG.txt > "$OUT/trace-k-$tag.txt.xz"
