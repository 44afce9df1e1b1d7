#!/usr/bin/env bash
# GRPO with a REAL vLLM 0.26 as the rollout engine on one H200 (issue 16, item 4): a random-init
# Qwen3-0.6B-shaped checkpoint, GSM8K test prompts (tests/assets/math, chat template, deepscaler
# reward), two runs, each against a freshly started vLLM on the same checkpoint:
#   A. --colocate, IPC sync each step through vime's worker extension (vLLM sleeps while vime
#      trains; the sync wakes its weights, streams, wakes its KV cache);
#   B. the disk fallback (--update-weight-transport disk: an HF folder vLLM reloads through
#      /collective_rpc reload_weights; vLLM 0.26 has no /update_weight_version, vime keeps the
#      version).
# Per step it prints the trainer-vs-vLLM log-prob gap (rollout/log_probs_abs_diff: the mean
# |delta logp| between vLLM's sampling log-probs and the trainer's recomputed ones) and the sync
# time. Verdict "VLLM GRPO: PASS" when both runs finish all rollouts with a gap below 0.05 at
# every step (bf16; the same weights on both sides) and a sync each step.
#
#   scripts/gpu/vllm_grpo.sh [OUT_DIR]
#
# Needs gpu-carry/{device-env.sh, vime-train.xz, COMMIT, vkit/PARTS.sha256, vkit/install.sh} and
# the kit's parts carried to /tmp/vkit-parts (scripts/gpu/vllm_kit_part.sh).
set -uo pipefail
OUT=${1:-${OUT:-/tmp/vllm_grpo_out}}
mkdir -p "$OUT"
source gpu-carry/device-env.sh
source scripts/gpu/with_vllm.sh || { echo "VLLM GRPO: FAIL (kit install)"; exit 1; }
[ -x /tmp/vime-train ] || { xz -dc gpu-carry/vime-train.xz > /tmp/vime-train && chmod +x /tmp/vime-train; }
LOG="$OUT/vllm_grpo.txt"
W=$(mktemp -d)
PORT=18811
URL=http://127.0.0.1:$PORT
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(cat gpu-carry/COMMIT 2>/dev/null || echo unknown)"
  echo "command: scripts/gpu/vllm_grpo.sh $*"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)'
} 2>&1 | tee "$LOG"
python3 scripts/gpu/random_qwen3.py qwen3-0.6b "$W/ckpt" "$VKIT_TOKENIZER" 2>&1 | tail -1 | tee -a "$LOG"

VPID=
start_vllm() {
  setsid env VLLM_SERVER_DEV_MODE=1 python3 -m vllm.entrypoints.openai.api_server --model "$W/ckpt" \
    --port $PORT --dtype bfloat16 --gpu-memory-utilization 0.35 --enforce-eager --enable-sleep-mode \
    --worker-extension-cls vime_vllm_ext.VimeWorkerExtension --max-model-len 4096 > "$OUT/vllm_$1.log" 2>&1 &
  VPID=$!
  for _ in $(seq 1 150); do
    curl -sf $URL/health >/dev/null && return 0
    kill -0 $VPID 2>/dev/null || break
    sleep 2
  done
  echo "vLLM did not come up" | tee -a "$LOG"; tail -40 "$OUT/vllm_$1.log" | tee -a "$LOG"; return 1
}
stop_vllm() { [ -n "$VPID" ] && { kill -TERM -- -$VPID 2>/dev/null; sleep 5; kill -KILL -- -$VPID 2>/dev/null; }; VPID=; }
trap stop_vllm EXIT

FLAGS=(--hf-checkpoint "$W/ckpt" --prompt-data tests/assets/math/gsm8k-test.prompt-label.jsonl
       --input-key prompt --label-key label --apply-chat-template
       --apply-chat-template-kwargs '{"enable_thinking": false}' --rm-type deepscaler
       --rollout-batch-size 8 --n-samples-per-prompt 4 --num-steps-per-rollout 1 --num-rollout 3
       --rollout-max-response-len 64 --rollout-temperature 1.0 --lr 1e-5 --max-tokens-per-gpu 8192
       --use-dynamic-batch-size --dtype bf16 --device cuda --no-progress
       --rollout-engine vllm --vllm-url $URL)
status=0
run() {  # run NAME FLAGS...
  local name=$1; shift
  echo "== $name: $*" | tee -a "$LOG"
  start_vllm "$name" || { status=1; return; }
  /tmp/vime-train "${FLAGS[@]}" "$@" --save "$W/$name" > "$OUT/$name.txt" 2>&1
  local rc=$?
  tail -6 "$OUT/$name.txt" >> "$LOG"
  [ $rc = 0 ] || { echo "$name: vime-train FAILED ($rc)" | tee -a "$LOG"; tail -30 "$OUT/$name.txt" | tee -a "$LOG"; status=1; }
  cp "$W/$name/metrics.jsonl" "$OUT/${name}_metrics.jsonl" 2>/dev/null
  stop_vllm
}
run colocated_ipc --colocate --update-weight-transport ipc --update-weight-protocol worker-extension
run disk --update-weight-transport disk

python3 - "$OUT" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
out, bad = sys.argv[1], 0
for name in ("colocated_ipc", "disk"):
    try:
        rows = [json.loads(l) for l in open(f"{out}/{name}_metrics.jsonl")]
    except Exception as e:
        print(f"{name}: no metrics ({e})"); bad += 1; continue
    print(f"{name}: {len(rows)} rollouts")
    for r in rows:
        gap, st = r.get("rollout/log_probs_abs_diff"), r.get("perf/sync_time")
        print(f"  step {r['step']}: log_probs_abs_diff {gap} raw_reward {r.get('rollout/raw_reward')} "
              f"response_len {r.get('rollout/response_len')} sync_time {st} "
              f"transfer {r.get('perf/sync_transfer_time')} wake_weights {r.get('perf/sync_wake_weights_time')} "
              f"gpu_used_gb asleep/awake {r.get('perf/gpu_used_gb_engines_asleep')}/{r.get('perf/gpu_used_gb_engines_awake')}")
        bad += gap is None or gap > 0.05 or st is None
    bad += len(rows) < 3
print("VLLM GRPO:", "PASS" if not bad else "FAIL")
sys.exit(1 if bad else 0)
PY
[ "${PIPESTATUS[0]}" = 0 ] || status=1
exit "$status"
