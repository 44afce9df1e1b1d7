#!/usr/bin/env bash
# The error FP8 linear layers add (issue 21's FP8 stretch: "reported together with the log-prob
# error it adds against bf16"). For each model: hf_parity.py's random-init checkpoint and packed
# batch (1024 + 768 + 256 tokens), `vime-train grad` in bf16, with --fp8-format hybrid
# --fp8-recipe tensorwise, and with --fp8-recipe delayed (Megatron's history settings, the defaults)
# after AMAX_WARMUP passes (default 2) on the batch's sequences rotated, so that the measured pass
# is scaled by other tensors' amaxes as in training (`vime-train grad --fp8-amax-warmup`); each
# compared with HF transformers in fp32 (and HF in bf16, the bf16 yardstick) by
# `hf_parity.py compare`. On the GPU machine, from the repo root:
#
#   scripts/gpu/fp8_error.sh [OUT_DIR]        MODELS="4b" (0.6b, 4b)
#
# Takes ~4 minutes a 4B model on an H200 (the checkpoint, three vime runs and four HF runs).
#
# Needs gpu-carry/{device-env.sh, vime-train.xz (--features cuda or cudnn), COMMIT} and the
# machine's python3 with torch + transformers. Ends with `FP8 ERROR VERDICT (...)`: RECORDED with
# the numbers (the bf16 run must pass its parity check, the FP8 run's errors must be finite and
# below 1), else FAIL.
set -uo pipefail
OUT=${1:-${OUT:-/tmp/fp8_error_out}}
MODELS=${MODELS:-"4b"}
mkdir -p "$OUT"
source gpu-carry/device-env.sh
BIN=/tmp/vime-train
[ -x "$BIN" ] || { xz -dc gpu-carry/vime-train.xz > "$BIN" && chmod +x "$BIN"; }
LOG="$OUT/fp8_error.txt"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(cat gpu-carry/COMMIT 2>/dev/null || echo unknown)"
  echo "command: MODELS=\"$MODELS\" scripts/gpu/fp8_error.sh"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
} | tee "$LOG"
verdict=RECORDED
summary=""
for m in $MODELS; do
  D=/tmp/fp8err-$m
  rm -rf "$D"
  python3 scripts/gpu/hf_parity.py make --model "$m" --dir "$D" 2>&1 | tee -a "$LOG"
  for mode in bf16 fp8 fp8d; do
    flags=(); out=vime.safetensors
    [ "$mode" = fp8 ] && { flags=(--fp8-format hybrid --fp8-recipe tensorwise); out=vime-fp8.safetensors; }
    [ "$mode" = fp8d ] && { flags=(--fp8-format hybrid --fp8-recipe delayed --fp8-amax-warmup "${AMAX_WARMUP:-2}"); out=vime-fp8d.safetensors; }
    echo "=== $m $mode" | tee -a "$LOG"
    "$BIN" grad --hf-checkpoint "$D/model" --batch "$D/batch.safetensors" --output "$D/$out" \
      --dtype bf16 --device cuda --recompute none "${flags[@]}" 2>&1 | tee -a "$LOG"
    python3 scripts/gpu/hf_parity.py compare --dir "$D" --vime "$out" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    [ "$mode" = bf16 ] && [ "$rc" != 0 ] && verdict=FAIL
  done
  cp "$D"/*parity.json "$OUT/" 2>/dev/null || true
  s=$(python3 - "$D" "$m" <<'PY'
import json, math, os, sys
d, m = sys.argv[1], sys.argv[2]
b = json.load(open(os.path.join(d, "parity.json")))
f = json.load(open(os.path.join(d, "vime-fp8-parity.json")))
g = json.load(open(os.path.join(d, "vime-fp8d-parity.json")))
ok = all(math.isfinite(x[k]["vime_bf16"]) and x[k]["vime_bf16"] < 1 for x in (f, g) for k in x)
parts = [f"{k} rel err vs HF-fp32: FP8 tensorwise {f[k]['vime_bf16']:.2e}, FP8 delayed {g[k]['vime_bf16']:.2e}, vime bf16 {b[k]['vime_bf16']:.2e}, HF bf16 {b[k]['hf_bf16']:.2e}" for k in ("logprobs", "entropy", "gradients")]
print(("OK " if ok else "BAD ") + f"qwen3-{m}: " + "; ".join(parts))
PY
)
  echo "$s" | tee -a "$LOG"
  case $s in OK*) ;; *) verdict=FAIL ;; esac
  summary="$summary ${s#* }"
  rm -rf "$D"
done
echo "FP8 ERROR VERDICT ($MODELS): $verdict:$summary" | tee -a "$LOG"
[ "$verdict" != FAIL ]
