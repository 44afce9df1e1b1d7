#!/usr/bin/env bash
# Weight streaming over CUDA IPC on one H200 (issue 15), trainer and vime-serve in two processes
# on the same GPU:
#   A. `vime-train bench-sync`: a random-init Qwen3-4B (bf16, 8.04 GB, 16 buckets of 512 MiB) is
#      synced 5 times (+1 untimed first sync) to a vime-serve started with --load-format dummy and
#      --weight-transfer-config '{"backend":"ipc"}', colocated (the engine sleeps, wakes its
#      weights, receives, wakes its KV cache). Every sync sends new values. Afterwards the engine's
#      per-tensor checksums must equal the trainer's for every tensor.
#   B. A GRPO run with --colocate and vime-serve as the engine (reverse-digits task, a tiny random
#      Qwen3 with head_dim 128, 4 rollouts): the sync runs over IPC each step and the log-prob gap
#      between trainer and engine (rollout/log_probs_abs_diff) is printed per step.
# On the GPU machine, from the repo root:
#
#   scripts/gpu/sync_ipc.sh [OUT_DIR]
#
# Needs gpu-carry/{device-env.sh, vime-train.xz, vime-serve.xz, COMMIT}.
# Verdicts: "SYNC IPC BIT-EXACT: PASS" (every tensor's checksum equal), "SYNC IPC GOAL <= 50 ms:
# PASS|MISS" (median colocated sync wall time), "SYNC GRPO COLOCATE: PASS" (the run finishes, every
# step reports a sync over ipc and a log-prob gap), and "SYNC IPC VERDICT: PASS" when the first and
# third pass (the 50 ms goal is reported, not required).
set -uo pipefail
OUT=${1:-${OUT:-/tmp/sync_ipc_out}}
mkdir -p "$OUT"
source gpu-carry/device-env.sh
for b in vime-train vime-serve; do
  [ -x /tmp/$b ] || { xz -dc gpu-carry/$b.xz > /tmp/$b && chmod +x /tmp/$b; }
done
LOG="$OUT/sync_ipc.txt"
W=$(mktemp -d)
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(cat gpu-carry/COMMIT 2>/dev/null || echo unknown)"
  echo "command: scripts/gpu/sync_ipc.sh $*"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
} | tee "$LOG"
status=0
mkdir -p "$W/q4b"
cat > "$W/q4b/config.json" <<'JSON'
{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 2560,
 "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
 "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 40960,
 "tie_word_embeddings": true, "attention_bias": false, "hidden_act": "silu", "use_sliding_window": false,
 "max_window_layers": 36, "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645}
JSON
PORT=18611
serve() {  # serve DIR PORT LOGFILE [flags]
  local dir=$1 port=$2 log=$3; shift 3
  /tmp/vime-serve "$dir" --port "$port" --device cuda --dtype bfloat16 --dev-mode \
    --weight-transfer-config '{"backend":"ipc"}' --enable-sleep-mode "$@" > "$log" 2>&1 &
  echo $!
}
mem() { nvidia-smi --query-gpu=memory.used --format=csv,noheader | tee -a "$LOG"; }

echo "== A. bench-sync, Qwen3-4B shapes, ipc, colocated" | tee -a "$LOG"
SPID=$(serve "$W/q4b" $PORT "$OUT/serve_4b.txt" --load-format dummy)
/tmp/vime-train bench-sync --model qwen3-4b --engine-url http://127.0.0.1:$PORT --transport ipc \
  --colocate --syncs 5 2> "$OUT/bench_sync.err" | tee "$OUT/bench_sync.json"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "bench-sync FAILED" | tee -a "$LOG"; status=1; }
cat "$OUT/bench_sync.err" >> "$LOG"
echo "GPU memory with both processes up:" | tee -a "$LOG"; mem
kill $SPID 2>/dev/null; wait $SPID 2>/dev/null
tail -5 "$OUT/serve_4b.txt" >> "$LOG"
python3 - "$OUT/bench_sync.json" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
try:
    r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
except Exception as e:
    print("no bench-sync result:", e); print("SYNC IPC BIT-EXACT: FAIL"); sys.exit(1)
ms = lambda k: f"{1e3 * r[k]:.2f} ms"
print(f"{r['bytes'] / 1e9:.3f} GB in {r['buckets']} buckets, {r['syncs']} timed syncs (medians):")
for k in ("median_wall_s", "median_prepare_s", "median_transfer_s", "median_stage_s", "median_engine_wait_s",
          "median_engine_load_s", "median_finish_s", "median_paused_s"):
    print(f"  {k}: {ms(k)}")
print(f"  median GB/s: {r['median_gb_per_s']:.1f}")
print(f"  handle exchange (HTTP) = engine_wait - engine_load: {1e3 * (r['median_engine_wait_s'] - r['median_engine_load_s']):.2f} ms")
print(f"GPU memory used (all processes): engine awake {r.get('gpu_used_gb_engine_awake')} GB, engine asleep {r.get('gpu_used_gb_engine_asleep')} GB")
print(f"checked {r.get('checked_tensors')} tensors, mismatched: {r.get('mismatched_tensors')}")
print("SYNC IPC BIT-EXACT:", "PASS" if r.get("bit_exact") else "FAIL")
print("SYNC IPC GOAL <= 50 ms:", "PASS" if r["median_wall_s"] <= 0.050 else "MISS")
sys.exit(0 if r.get("bit_exact") else 1)
PY
[ "${PIPESTATUS[0]}" = 0 ] || status=1

echo "== B. GRPO, --colocate, vime-serve over ipc" | tee -a "$LOG"
/tmp/vime-train make-task reverse --out "$W/task" --n-train 400 --n-eval 16 --seed 0 --head-dim 128 \
  --num-attention-heads 2 --num-key-value-heads 1 2>&1 | tail -2 | tee -a "$LOG"
PORT2=18612
SPID=$(serve "$W/task/model" $PORT2 "$OUT/serve_grpo.txt")
/tmp/vime-train --hf-checkpoint "$W/task/model" --prompt-data "$W/task/train.jsonl" --label-key label \
  --rollout-batch-size 16 --n-samples-per-prompt 4 --num-steps-per-rollout 1 --num-rollout 4 \
  --rollout-max-response-len 8 --rm-type exact_match --lr 1e-3 --entropy-coef 0.01 --use-dynamic-batch-size \
  --max-tokens-per-gpu 4096 --dtype bf16 --device cuda --no-progress \
  --rollout-engine vllm --vllm-url http://127.0.0.1:$PORT2 --colocate --update-weight-transport ipc \
  --save "$W/grpo" 2>&1 | tee "$OUT/grpo.txt" | tail -20 >> "$LOG"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "GRPO run FAILED" | tee -a "$LOG"; status=1; }
kill $SPID 2>/dev/null; wait $SPID 2>/dev/null
tail -8 "$OUT/serve_grpo.txt" >> "$LOG"
cp "$W/grpo/metrics.jsonl" "$OUT/grpo_metrics.jsonl" 2>/dev/null
python3 - "$OUT/grpo_metrics.jsonl" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
try:
    rows = [json.loads(l) for l in open(sys.argv[1])]
except Exception as e:
    print("no metrics:", e); print("SYNC GRPO COLOCATE: FAIL"); sys.exit(1)
bad = 0
for r in rows:
    gap, st, tr = r.get("rollout/log_probs_abs_diff"), r.get("perf/sync_time"), r.get("perf/sync_transfer_time")
    print(f"step {r['step']}: log_probs_abs_diff {gap} raw_reward {r.get('rollout/raw_reward')} "
          f"sync_time {st} transfer {tr} wake_weights {r.get('perf/sync_wake_weights_time')}")
    bad += gap is None or st is None or tr is None
ok = len(rows) >= 4 and not bad
print("SYNC GRPO COLOCATE:", "PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
PY
[ "${PIPESTATUS[0]}" = 0 ] || status=1
rm -rf "$W"
if [ "$status" = 0 ]; then echo "SYNC IPC VERDICT: PASS" | tee -a "$LOG"; else echo "SYNC IPC VERDICT: FAIL" | tee -a "$LOG"; fi
exit "$status"
