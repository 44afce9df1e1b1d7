#!/usr/bin/env bash
# vime's built-in engine (through vime-serve) against real vLLM 0.26 (the vLLM kit) on the same
# random checkpoint, same prompts, same lengths, one GPU, in one run (issue 20). For each model:
# serve it with vLLM (CUDA graphs on, as users run it), time every (batch, length) cell with
# scripts/gpu/engine_vs_vllm.py, stop it; then the same with vime-serve; then print the table and
# the ratio vime / vLLM per cell. Goal: >= 0.8x at batch 64 and 256.
#
#   MODELS="qwen3-0.6b qwen3-4b" BATCHES=1,16,64,256 LENS=256,4096 scripts/gpu/engine_vs_vllm.sh [OUT_DIR]
#
# ENGINES="vllm vime" (default both; "vime" alone re-times vime against an earlier run's vLLM cells,
# which VLLM_CELLS=FILE (a cells.jsonl) brings into the table).
# VIME_SERVE_FLAGS="--true-on-policy-mode" adds flags to vime-serve (its cells keep the name vime).
# SKIP="4096:256" leaves cells out (len:batch, space-separated) where the device budget does not
# stretch; they are listed as not run. Needs gpu-carry/{device-env.sh, vime-serve.xz, COMMIT,
# vkit/PARTS.sha256, vkit/install.sh} and the kit's parts in /tmp/vkit-parts
# (scripts/gpu/vllm_kit_part.sh). Ends with "ENGINE VS VLLM VERDICT: ...".
set -uo pipefail
OUT=${1:-${OUT:-/tmp/engine_vs_vllm_out}}
mkdir -p "$OUT"
source gpu-carry/device-env.sh
case " ${ENGINES:-vllm vime} " in
  *" vllm "*) source scripts/gpu/with_vllm.sh || { echo "ENGINE VS VLLM VERDICT: FAIL (kit install)"; exit 1; } ;;
  *) VKIT_TOKENIZER=tests/assets/qwen3-tokenizer ;;
esac
MODELS=${MODELS:-qwen3-0.6b qwen3-4b}
BATCHES=${BATCHES:-1,16,64,256}
LENS=${LENS:-256,4096}
SKIP=${SKIP:-}
ENGINES=${ENGINES:-vllm vime}
VLLM_CELLS=${VLLM_CELLS:-}
LOG="$OUT/engine_vs_vllm.txt"
RES="$OUT/cells.jsonl"
: > "$RES"
[ -n "$VLLM_CELLS" ] && grep '"engine": "vllm"' "$VLLM_CELLS" | sed 's/}$/, "earlier_run": true}/' >> "$RES"
W=$(mktemp -d)
xz -dc gpu-carry/vime-serve.xz > "$W/vime-serve" && chmod +x "$W/vime-serve"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(cat gpu-carry/COMMIT 2>/dev/null || echo unknown)"
  echo "command: VIME_SERVE_FLAGS=\"${VIME_SERVE_FLAGS:-}\" MODELS=\"$MODELS\" BATCHES=$BATCHES LENS=$LENS SKIP=\"$SKIP\" ENGINES=\"$ENGINES\" VLLM_CELLS=$VLLM_CELLS scripts/gpu/engine_vs_vllm.sh $*"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import vllm; print('vllm', vllm.__version__)" 2>/dev/null | tail -1
} 2>&1 | tee "$LOG"
wait_health() {  # url pid seconds
  for _ in $(seq "$3"); do
    curl -sf "$1/health" >/dev/null && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 1
  done
  return 1
}
cells() {  # engine tag url
  local b n
  for n in ${LENS//,/ }; do
    local bs=""
    for b in ${BATCHES//,/ }; do
      case " $SKIP " in *" $n:$b "*) echo "{\"engine\": \"$1\", \"model\": \"$2\", \"batch\": $b, \"len\": $n, \"skipped\": true}" >> "$RES";; *) bs="$bs,$b";; esac
    done
    [ -n "$bs" ] && python3 scripts/gpu/engine_vs_vllm.py --url "$3" --name "$1" --model-tag "$2" \
      --tokenizer "$VKIT_TOKENIZER" --prompts tests/assets/math/gsm8k-smoke.jsonl \
      --batches "${bs#,}" --lens "$n" | tee -a "$RES"
  done
}
for m in $MODELS; do
  python3 scripts/gpu/random_qwen3.py "$m" "$W/$m" "$VKIT_TOKENIZER" 2>&1 | tail -1 | tee -a "$LOG"
  case " $ENGINES " in *" vllm "*) ;; *) skip_vllm=1;; esac
  if [ -z "${skip_vllm:-}" ]; then
  echo "--- $m: vLLM" | tee -a "$LOG"
  python3 -m vllm.entrypoints.openai.api_server --model "$W/$m" --port 8011 --seed 0 \
    --gpu-memory-utilization 0.6 --max-model-len 8192 --max-num-seqs 256 \
    > "$OUT/vllm-$m.log" 2>&1 &
  vp=$!
  if wait_health http://127.0.0.1:8011 $vp 600; then
    cells vllm "$m" http://127.0.0.1:8011
  else
    echo "vLLM did not come up; log tail:" | tee -a "$LOG"; tail -5 "$OUT/vllm-$m.log" | tee -a "$LOG"
  fi
  kill $vp 2>/dev/null; wait $vp 2>/dev/null
  pkill -f vllm.entrypoints 2>/dev/null; sleep 3
  fi
  echo "--- $m: vime-serve" | tee -a "$LOG"
  "$W/vime-serve" "$W/$m" --port 8012 --device cuda --dtype bfloat16 --max-num-seqs 256 --gpu-memory-utilization 0.6 \
    --max-num-batched-tokens 32768 --max-batch-size 256 ${VIME_SERVE_FLAGS:-} > "$OUT/vime-$m.log" 2>&1 &
  sp=$!
  if wait_health http://127.0.0.1:8012 $sp 300; then
    cells vime "$m" http://127.0.0.1:8012
  else
    echo "vime-serve did not come up; log tail:" | tee -a "$LOG"; tail -5 "$OUT/vime-$m.log" | tee -a "$LOG"
  fi
  kill $sp 2>/dev/null; wait $sp 2>/dev/null
  rm -rf "$W/$m"
done
python3 - "$RES" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
cell = {(r["model"], r["len"], r["batch"], r["engine"]): r for r in rows}
keys = sorted({(r["model"], r["len"], r["batch"]) for r in rows}, key=lambda k: (k[0], k[1], k[2]))
print("| model | len | batch | vLLM tok/s | vime tok/s | vime / vLLM |")
print("|---|---|---|---|---|---|")
goal = []
for k in keys:
    v, e = cell.get(k + ("vllm",), {}), cell.get(k + ("vime",), {})
    def fmt(r):
        if r.get("skipped") or not r: return "not run"
        if "error" in r: return "failed"
        return (f"{r['tokens_per_s']:,.0f}" + ("" if r.get("every_choice_len") else " (short!)")
                + (" (earlier run)" if r.get("earlier_run") else ""))
    ratio = ""
    if v.get("tokens_per_s") and e.get("tokens_per_s"):
        x = e["tokens_per_s"] / v["tokens_per_s"]
        ratio = f"{x:.2f}x"
        if k[2] in (64, 256):
            goal.append((k, x))
    print(f"| {k[0]} | {k[1]} | {k[2]} | {fmt(v)} | {fmt(e)} | {ratio} |")
# A run with no cell at batch 64 or 256 (BATCHES=1,16) judges nothing: NONE, not FAIL.
verdict = ("PASS" if all(x >= 0.8 for _, x in goal) else "FAIL") if goal else "NONE (no cell at batch 64 or 256)"
print(f"ENGINE VS VLLM VERDICT: {verdict} (goal >= 0.8x vLLM at batch 64 and 256; "
      + ", ".join(f"{k[0]} len {k[1]} batch {k[2]}: {x:.2f}x" for k, x in goal) + ")")
PY
rm -rf "$W"
