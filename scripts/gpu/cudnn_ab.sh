#!/usr/bin/env bash
# cuDNN 9.19 (torch's wheel on the GPU machine) against 9.28 (scripts/gpu/cudnn_kit.sh) on the
# same vime-train binary: a quick 0.6B step with each, then kernel timelines (timeline.sh, API=0)
# of Qwen3-0.6B and Qwen3-4B (4B cut to 24 layers on an 80 GB card). Needs the kit's three parts
# staged (`cudnn_kit.sh part NN` in earlier calls on the same warm machine), gpu-carry/cupti,
# gpu-carry/vime-train.xz and gpu-carry/COMMIT.
# Ends with `CUDNN AB VERDICT: 9.28 PAYS|NO GAIN` from the 4B step's traced wall time (pays: at
# least 1 % less). Run on the GPU machine from the repo root: scripts/gpu/cudnn_ab.sh [OUT_DIR]
set -uo pipefail
OUT=${1:-${OUT:-/tmp/out}}
mkdir -p "$OUT"
# Where the kit unpacks 9.28; the wrapper below puts it first on the loader's path.
export DEST=/tmp/cudnn-9.28.1.4
bash scripts/gpu/cudnn_kit.sh install || exit 1
source gpu-carry/device-env.sh
xz -dc gpu-carry/vime-train.xz > /tmp/vime-train && chmod +x /tmp/vime-train
printf '#!/bin/bash\nexport LD_LIBRARY_PATH=%s:$LD_LIBRARY_PATH\nexec /tmp/vime-train "$@"\n' "$DEST" > /tmp/vt28 && chmod +x /tmp/vt28
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
L4=""; [ "$mem" -lt 100000 ] && L4="--layers 24"
for b in /tmp/vime-train /tmp/vt28; do
  $b bench-step --model qwen3-0.6b --seq-len 4096 --max-tokens-per-gpu 8192 --steps 6 --warmup 2 2>&1 | grep -E 'RESULT|cuDNN|rror' | sed "s|^|$b |" | tee -a "$OUT/quick.txt"
done
for m in qwen3-0.6b qwen3-4b; do
  x=""; [ $m = qwen3-4b ] && x="$L4"
  for t in 19 28; do
    b=/tmp/vime-train; [ $t = 28 ] && b=/tmp/vt28
    BIN=$b TAG=cudnn$t API=0 MODEL=$m STEPS=4 WARMUP=1 EXTRA="$x" bash scripts/gpu/timeline.sh "$OUT" > /dev/null 2>&1
  done
done
for f in "$OUT"/timeline-*.txt; do echo "== $f"; grep -E 'RESULT|per step|gemm |sdpa|cudnn|fusion' "$f" | head -14; done
wall() { grep -h 'per step: wall' "$OUT"/timeline-qwen3-4b-*-"$1".txt | sed -E 's/.*wall ([0-9.]+) ms.*/\1/'; }
a=$(wall cudnn19); b=$(wall cudnn28)
if [ -z "$a" ] || [ -z "$b" ]; then echo "CUDNN AB VERDICT: FAIL (a 4B timeline is missing)"; exit 1; fi
awk -v a="$a" -v b="$b" 'BEGIN { printf "CUDNN AB VERDICT: %s (4B traced step: 9.19 %.2f ms, 9.28 %.2f ms, %+.2f %%)\n", (b <= 0.99 * a ? "9.28 PAYS" : "NO GAIN"), a, b, 100 * (b / a - 1) }'
