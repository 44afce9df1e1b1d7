#!/usr/bin/env bash
# The log-prob (scoring) pass's extra device memory at 32k tokens (issue 18): a random Qwen3-4B
# checkpoint (scripts/gpu/random_qwen3.py), `vime-train logprobs` in bf16 on one sequence of
# 32768 tokens (in query chunks of 8192, the default, and unchunked) and on one of 16 tokens,
# device memory sampled every 50 ms with nvidia-smi. The difference of the peaks is what the long
# pass adds over weights, context and workspaces. Verdict "LOGPROB 32K: PASS" when the chunked
# pass adds <= 1 GiB (the issue's goal), chunked and unchunked log-probs agree in f32 (4096 tokens,
# max |delta| <= 1e-3) and within bf16 noise at 32k (mean |delta| <= 0.05).
#
#   scripts/gpu/logprob_32k.sh [OUT_DIR]
#
# Needs gpu-carry/{device-env.sh, vime-train.xz, COMMIT} and the machine's torch + transformers.
set -uo pipefail
OUT=${1:-${OUT:-/tmp/logprob_32k_out}}
mkdir -p "$OUT"
source gpu-carry/device-env.sh
[ -x /tmp/vime-train ] || { xz -dc gpu-carry/vime-train.xz > /tmp/vime-train && chmod +x /tmp/vime-train; }
LOG="$OUT/logprob_32k.txt"
W=$(mktemp -d)
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(cat gpu-carry/COMMIT 2>/dev/null || echo unknown)"
  echo "command: scripts/gpu/logprob_32k.sh $*"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
} | tee "$LOG"
mkdir -p "$W/tok"
python3 - "$W/tok" <<'PY'
import json, sys
# A tokenizer is not needed by `vime-train logprobs`; random_qwen3.py copies two files from a dir.
for f in ("tokenizer.json", "tokenizer_config.json"):
    json.dump({}, open(f"{sys.argv[1]}/{f}", "w"))
PY
python3 scripts/gpu/random_qwen3.py qwen3-4b "$W/ckpt" "$W/tok" 2>&1 | tail -1 | tee -a "$LOG"
python3 - "$W" <<'PY'
import json, random, sys
random.seed(0)
for name, n in (("long", 32768), ("short", 16), ("mid", 4096)):
    with open(f"{sys.argv[1]}/{name}.jsonl", "w") as f:
        f.write(json.dumps({"tokens": [random.randrange(151936) for _ in range(n)], "prompt_len": 1}) + "\n")
PY
peak_of() {  # peak_of NAME CHUNK: runs the pass (query chunks of CHUNK tokens), prints its peak MiB
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 50 > "$W/$1-$2.mem" &
  local smi=$!
  /tmp/vime-train logprobs --hf-checkpoint "$W/ckpt" --input "$W/$1.jsonl" --output "$W/$1-$2.out.jsonl" \
    --dtype bf16 --device cuda --max-tokens-per-batch 32768 --forward-chunk-tokens "$2" 2>&1 | tail -1 | tee -a "$LOG" >&2
  kill $smi 2>/dev/null; wait $smi 2>/dev/null
  sort -n "$W/$1-$2.mem" | tail -1
}
short=$(peak_of short 8192)
long=$(peak_of long 8192)
whole=$(peak_of long 65536)
echo "peak device memory: 16 tokens $short MiB; 32768 tokens in chunks of 8192: $long MiB, unchunked: $whole MiB" | tee -a "$LOG"
# Exactness of the chunking itself, in f32 (bf16 regroups roundings): 4096 tokens in chunks of 1024
# against unchunked.
for c in 1024 65536; do
  /tmp/vime-train logprobs --hf-checkpoint "$W/ckpt" --input "$W/mid.jsonl" --output "$W/mid-$c.out.jsonl" \
    --dtype f32 --device cuda --forward-chunk-tokens $c 2>&1 | tail -1 | tee -a "$LOG"
done
python3 - "$short" "$long" "$whole" "$W" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
s, l, u, w = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
def gap(x, y):
    a = json.loads(open(f"{w}/{x}.out.jsonl").readline())["logprobs"]
    b = json.loads(open(f"{w}/{y}.out.jsonl").readline())["logprobs"]
    d = [abs(p - q) for p, q in zip(a, b)]
    return sum(d) / len(d), max(d), len(d)
extra = (l - s) / 1024
print(f"the 32k log-prob pass adds {extra:.2f} GiB over the 16-token one ({(u - s) / 1024:.2f} GiB unchunked)")
mb, xb, nb = gap("long-8192", "long-65536")
print(f"bf16, 32k: chunked vs unchunked log-probs mean |delta| {mb:.2e}, max {xb:.2e} over {nb} tokens")
mf, xf, nf = gap("mid-1024", "mid-65536")
print(f"f32, 4096 tokens: chunks of 1024 vs unchunked mean |delta| {mf:.2e}, max {xf:.2e} over {nf} tokens")
ok = extra <= 1.0 and xf <= 1e-3 and mb <= 0.05
print("LOGPROB 32K:", "PASS" if ok else "FAIL",
      "(extra <= 1 GiB; f32 max |delta| <= 1e-3; bf16 mean |delta| <= 0.05, the bound of the vLLM parity checks)")
PY
