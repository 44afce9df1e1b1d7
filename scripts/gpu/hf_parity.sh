#!/usr/bin/env bash
# HF parity at real Qwen3 shapes on the GPU machine, in one command (issue 6, item 3):
#
#   scripts/gpu/hf_parity.sh [OUT_DIR]          (from the repo root, on the GPU machine)
#
# Needs gpu-carry/ (device-env.sh, vime-train.xz built with --features cuda, or cudnn for cuDNN attention, COMMIT) beside the
# working tree, and the machine's python3 with torch + transformers. For Qwen3-0.6B and Qwen3-4B:
# `hf_parity.py make` (random init, bf16 safetensors, a packed batch of 1024 + 768 + 256 tokens),
# `vime-train grad --dtype bf16 --device cuda`, `hf_parity.py compare`. Ends with one verdict line.
set -euo pipefail
OUT=${1:-${OUT:-/tmp/hf_parity_out}}
MODELS=${MODELS:-"0.6b 4b"}
# Extra flags for `vime-train grad` (e.g. GRAD_ARGS="--lm-head-logits bf16").
GRAD_ARGS=${GRAD_ARGS:-}
mkdir -p "$OUT"
source gpu-carry/device-env.sh
BIN=/tmp/vime-train
[ -x "$BIN" ] || { xz -dc gpu-carry/vime-train.xz > "$BIN" && chmod +x "$BIN"; }
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(cat gpu-carry/COMMIT 2>/dev/null || echo unknown)"
  echo "command: GRAD_ARGS='$GRAD_ARGS' MODELS='$MODELS' scripts/gpu/hf_parity.sh $*"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
} | tee "$OUT/hf_parity.txt"
verdict=PASS
for m in $MODELS; do
  D=/tmp/parity-$m
  rm -rf "$D"
  python3 scripts/gpu/hf_parity.py make --model "$m" --dir "$D" 2>&1 | tee -a "$OUT/hf_parity.txt"
  "$BIN" grad --hf-checkpoint "$D/model" --batch "$D/batch.safetensors" --output "$D/vime.safetensors" \
    --dtype bf16 --device cuda --recompute full $GRAD_ARGS 2>&1 | tee -a "$OUT/hf_parity.txt"
  if ! python3 scripts/gpu/hf_parity.py compare --dir "$D" 2>&1 | tee -a "$OUT/hf_parity.txt"; then
    verdict=FAIL
  fi
  cp "$D/parity.json" "$OUT/parity-$m.json" 2>/dev/null || true
  rm -rf "$D"
done
echo "HF PARITY VERDICT ($MODELS${GRAD_ARGS:+, $GRAD_ARGS}): $verdict" | tee -a "$OUT/hf_parity.txt"
[ "$verdict" = PASS ]
