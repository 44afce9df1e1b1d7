#!/usr/bin/env bash
# `vime-train --vllm-launch` with a REAL vLLM 0.26 on one H200 (issue 16, item 5): vime starts
# `vllm serve` itself (VLLM_SERVER_DEV_MODE=1, its own process group, logs under --vllm-log-dir),
# waits for health, runs a colocated GRPO (IPC sync through the worker extension), and stops the
# engine when it exits; then again, interrupted with SIGINT during training. After each run no
# vLLM process may be left.
# Verdict "VLLM LAUNCH: PASS" when the first run finishes its 2 rollouts, the second exits on the
# signal, and no `vllm.entrypoints` process survives either.
#
#   scripts/gpu/vllm_launch.sh [OUT_DIR]
#
# Needs gpu-carry/{device-env.sh, vime-train.xz, COMMIT, vkit/PARTS.sha256, vkit/install.sh} and
# the kit's parts carried to /tmp/vkit-parts (scripts/gpu/vllm_kit_part.sh).
set -uo pipefail
OUT=${1:-${OUT:-/tmp/vllm_launch_out}}
mkdir -p "$OUT"
source gpu-carry/device-env.sh
source scripts/gpu/with_vllm.sh || { echo "VLLM LAUNCH: FAIL (kit install)"; exit 1; }
[ -x /tmp/vime-train ] || { xz -dc gpu-carry/vime-train.xz > /tmp/vime-train && chmod +x /tmp/vime-train; }
LOG="$OUT/vllm_launch.txt"
W=$(mktemp -d)
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(cat gpu-carry/COMMIT 2>/dev/null || echo unknown)"
  echo "command: scripts/gpu/vllm_launch.sh $*"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
} 2>&1 | tee "$LOG"
python3 scripts/gpu/random_qwen3.py qwen3-0.6b "$W/ckpt" "$VKIT_TOKENIZER" 2>&1 | tail -1 | tee -a "$LOG"
FLAGS=(--hf-checkpoint "$W/ckpt" --prompt-data tests/assets/math/gsm8k-test.prompt-label.jsonl
       --input-key prompt --label-key label --apply-chat-template
       --apply-chat-template-kwargs '{"enable_thinking": false}' --rm-type deepscaler
       --rollout-batch-size 4 --n-samples-per-prompt 4 --num-steps-per-rollout 1
       --rollout-max-response-len 32 --lr 1e-5 --max-tokens-per-gpu 8192 --use-dynamic-batch-size
       --dtype bf16 --device cuda --no-progress
       --rollout-engine vllm --vllm-launch
       --vllm-command "python3 -m vllm.entrypoints.cli.main serve --enforce-eager --max-model-len 4096"
       --vllm-gpu-memory-utilization 0.3 --vllm-enable-sleep-mode
       --vllm-worker-extension-cls vime_vllm_ext.VimeWorkerExtension --vllm-health-timeout 300
       --colocate --update-weight-transport ipc --update-weight-protocol worker-extension)
status=0
left() { pgrep -f "vllm.entrypoints" | wc -l; }

echo "== 1. launched engine, 2 rollouts" | tee -a "$LOG"
timeout 400 /tmp/vime-train "${FLAGS[@]}" --num-rollout 2 --save "$W/run1" --vllm-log-dir "$OUT/logs1" \
  > "$OUT/run1.txt" 2>&1
rc=$?
tail -4 "$OUT/run1.txt" | tee -a "$LOG"
sleep 3
n=$(left)
echo "run 1: exit $rc, vLLM processes left: $n, rollouts in metrics: $(wc -l < "$W/run1/metrics.jsonl" 2>/dev/null)" | tee -a "$LOG"
[ "$rc" = 0 ] && [ "$n" = 0 ] && [ "$(wc -l < "$W/run1/metrics.jsonl" 2>/dev/null)" = 2 ] || status=1
pkill -9 -f vllm.entrypoints 2>/dev/null

echo "== 2. SIGINT while training" | tee -a "$LOG"
/tmp/vime-train "${FLAGS[@]}" --num-rollout 50 --save "$W/run2" --vllm-log-dir "$OUT/logs2" > "$OUT/run2.txt" 2>&1 &
TPID=$!
for _ in $(seq 1 200); do
  [ -s "$W/run2/metrics.jsonl" ] && break
  kill -0 $TPID 2>/dev/null || break
  sleep 1
done
kill -INT $TPID 2>/dev/null
for _ in $(seq 1 60); do kill -0 $TPID 2>/dev/null || break; sleep 1; done
kill -0 $TPID 2>/dev/null && { echo "run 2: vime-train still running 60 s after SIGINT" | tee -a "$LOG"; kill -9 $TPID; status=1; }
wait $TPID; rc=$?
sleep 3
n=$(left)
tail -4 "$OUT/run2.txt" | tee -a "$LOG"
echo "run 2: exit $rc after SIGINT, vLLM processes left: $n, rollouts in metrics: $(wc -l < "$W/run2/metrics.jsonl" 2>/dev/null)" | tee -a "$LOG"
[ "$n" = 0 ] || status=1
[ -s "$W/run2/metrics.jsonl" ] || status=1
pkill -9 -f vllm.entrypoints 2>/dev/null
ls "$OUT/logs1" | tee -a "$LOG"
rm -rf "$W"
if [ "$status" = 0 ]; then echo "VLLM LAUNCH: PASS" | tee -a "$LOG"; else echo "VLLM LAUNCH: FAIL" | tee -a "$LOG"; fi
exit "$status"
