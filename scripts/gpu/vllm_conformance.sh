#!/usr/bin/env bash
# vime's vLLM client against a REAL vLLM 0.26 and vllm-router 0.1.17 on one H200 (issue 16, items 1
# and 2). Two `vllm serve` engines (A, B) of a random Qwen3-0.6B-shaped checkpoint share the GPU
# (sleep mode, dev mode, vime's worker extension); a vllm-router starts with no workers.
#   1. Raw answers of the calls vime makes, captured for CI fixtures (conformance.jsonl): completions
#      with n=2 and a seed, with stop_token_ids, aborted by /pause?mode=abort mid-generation; a
#      request sent while paused; sleep level 2 and the reload; /get_world_size; the router's
#      /workers (POST, GET, DELETE, an unknown one), a completion through it, and with no workers.
#   2. `vime-train check-engines` on A and B directly (every check, sleep_2 included).
#   3. The same through the router (vime registers A and B with it).
#   4. A long rollout through the router while engine B is SIGKILLed (its whole process group): the
#      rollout must finish on A; how it survived (router retries, vime deregistering B) is printed.
# Verdict "VLLM CONFORMANCE: PASS" when 2 and 3 have no failed check and 4's rollout passed.
#
#   scripts/gpu/vllm_conformance.sh [OUT_DIR]
#
# Needs gpu-carry/{device-env.sh, vime-train.xz, COMMIT, vkit/PARTS.sha256, vkit/install.sh} and
# the kit's parts already carried to /tmp/vkit-parts (scripts/gpu/vllm_kit_part.sh).
set -uo pipefail
OUT=${1:-${OUT:-/tmp/vllm_conformance_out}}
mkdir -p "$OUT"
source gpu-carry/device-env.sh
source scripts/gpu/with_vllm.sh || { echo "VLLM CONFORMANCE: FAIL (kit install)"; exit 1; }
[ -x /tmp/vime-train ] || { xz -dc gpu-carry/vime-train.xz > /tmp/vime-train && chmod +x /tmp/vime-train; }
LOG="$OUT/vllm_conformance.txt"
W=$(mktemp -d)
PA=18741 PB=18742 PR=18750
A=http://127.0.0.1:$PA B=http://127.0.0.1:$PB R=http://127.0.0.1:$PR
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(cat gpu-carry/COMMIT 2>/dev/null || echo unknown)"
  echo "command: scripts/gpu/vllm_conformance.sh $*"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, vllm, importlib.metadata as m; print("torch", torch.__version__, "vllm", vllm.__version__, "vllm-router", m.version("vllm-router"))'
} 2>&1 | tee "$LOG"

python3 scripts/gpu/random_qwen3.py qwen3-0.6b "$W/ckpt" "$VKIT_TOKENIZER" 2>&1 | tail -1 | tee -a "$LOG"

engine() {  # engine PORT LOGNAME: one vLLM engine in its own process group
  setsid env VLLM_SERVER_DEV_MODE=1 python3 -m vllm.entrypoints.openai.api_server --model "$W/ckpt" \
    --port "$1" --dtype bfloat16 --gpu-memory-utilization 0.3 --enforce-eager --enable-sleep-mode \
    --worker-extension-cls vime_vllm_ext.VimeWorkerExtension --max-model-len 4096 > "$OUT/$2.log" 2>&1 &
  echo $!
}
APID=$(engine $PA vllm-a)
sleep 20  # let A take its memory first: vLLM checks free memory at start
BPID=$(engine $PB vllm-b)
setsid python3 -m vllm_router.launch_router --host 127.0.0.1 --port $PR --policy round_robin \
  > "$OUT/router.log" 2>&1 &
RPID=$!
stop() { for p in $APID $BPID $RPID; do kill -TERM -- -$p 2>/dev/null; done; sleep 3
         for p in $APID $BPID $RPID; do kill -KILL -- -$p 2>/dev/null; done; }
trap stop EXIT
for _ in $(seq 1 150); do
  curl -sf $A/health >/dev/null && curl -sf $B/health >/dev/null && curl -sf $R/health >/dev/null && break
  sleep 2
done
for u in $A $B $R; do
  curl -sf $u/health >/dev/null || { echo "$u did not come up"; tail -40 "$OUT"/vllm-a.log "$OUT"/vllm-b.log "$OUT"/router.log | tee -a "$LOG"; echo "VLLM CONFORMANCE: FAIL"; exit 1; }
done
echo "engines A=$A B=$B and router $R healthy" | tee -a "$LOG"
status=0

echo "== 1. raw answers (conformance.jsonl)" | tee -a "$LOG"
A=$A R=$R CKPT="$W/ckpt" python3 - "$OUT/conformance.jsonl" <<'PY' 2>&1 | tee -a "$LOG"
import json, os, sys, threading, time, urllib.parse, urllib.request, urllib.error
A, R, ckpt = os.environ["A"], os.environ["R"], os.environ["CKPT"]
out = open(sys.argv[1], "w")
PROMPT = [9707, 11, 1879, 0, 1124, 374, 264]
def call(name, base, m, p, b=None, timeout=60, record=True):
    req = urllib.request.Request(base + p, method=m, data=None if b is None else json.dumps(b).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.time()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    except Exception as e:  # timeouts: recorded as such
        status, text = None, f"{type(e).__name__}: {e}"
    try:
        body = json.loads(text) if text.strip() else None
    except ValueError:
        body = text
    rec = {"name": name, "target": "router" if base == R else "engine", "method": m, "path": p, "request": b,
           "status": status, "response": body, "seconds": round(time.time() - t0, 3)}
    if record:
        out.write(json.dumps(rec) + "\n"); out.flush()
    print(f"{name}: {m} {p} -> {status} {json.dumps(body)[:160]}")
    return rec
def comp(**kw):
    b = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "logprobs": 0, "return_token_ids": True, "n": 1}
    b.update(kw); return b
call("version", A, "GET", "/version")
call("world_size", A, "GET", "/get_world_size")
call("n2_seeded", A, "POST", "/v1/completions", comp(n=2, seed=3, temperature=1.0, max_tokens=6))
call("seeded_again", A, "POST", "/v1/completions", comp(seed=3, temperature=1.0, max_tokens=6))
g = call("greedy", A, "POST", "/v1/completions", comp())
stop = g["response"]["choices"][0]["token_ids"][2]
call("stop_token_ids", A, "POST", "/v1/completions", comp(stop_token_ids=[stop]))
# A long request in flight over /pause?mode=abort; then a request sent while paused.
res = {}
th = threading.Thread(target=lambda: res.update(r=call("aborted_by_pause", A, "POST", "/v1/completions",
                                                        comp(max_tokens=3000, temperature=1.0, seed=5), timeout=120)))
th.start(); time.sleep(1.5)
call("pause_abort", A, "POST", "/pause?mode=abort")
th.join()
call("is_paused", A, "GET", "/is_paused")
call("completion_while_paused_abort", A, "POST", "/v1/completions", comp(max_tokens=2), timeout=5)
call("resume", A, "POST", "/resume")
call("pause_keep", A, "POST", "/pause?mode=keep&clear_cache=false")
call("completion_while_paused_keep", A, "POST", "/v1/completions", comp(max_tokens=2), timeout=5)
call("resume_keep", A, "POST", "/resume")
call("sleep_2", A, "POST", "/sleep?level=2")
call("is_sleeping_2", A, "GET", "/is_sleeping")
call("wake_weights", A, "POST", "/wake_up?tags=weights")
call("reload_weights", A, "POST", "/collective_rpc", {"method": "reload_weights", "args": [], "kwargs": {"weights_path": ckpt}}, timeout=300)
call("wake_kv_cache", A, "POST", "/wake_up?tags=kv_cache")
call("is_sleeping_awake", A, "GET", "/is_sleeping")
g2 = call("greedy_after_sleep_2", A, "POST", "/v1/completions", comp())
same = g2["response"]["choices"][0]["token_ids"] == g["response"]["choices"][0]["token_ids"]
print("greedy after sleep level 2 + reload equals greedy before:", same)
call("reset_prefix_cache", A, "POST", "/reset_prefix_cache")
# The router.
call("router_health", R, "GET", "/health")
call("router_add_worker", R, "POST", "/workers", {"url": A})
call("router_list_workers", R, "GET", "/workers")
call("router_completion", R, "POST", "/v1/completions", comp())
call("router_add_worker_again", R, "POST", "/workers", {"url": A})
call("router_delete_worker", R, "DELETE", "/workers/" + urllib.parse.quote(A, safe=""))
call("router_delete_unknown_worker", R, "DELETE", "/workers/" + urllib.parse.quote("http://127.0.0.1:9", safe=""))
call("router_delete_worker_again", R, "DELETE", "/workers/" + urllib.parse.quote(A, safe=""))
call("router_list_workers_empty", R, "GET", "/workers")
call("router_completion_no_workers", R, "POST", "/v1/completions", comp(), timeout=30)
PY
[ "${PIPESTATUS[0]}" = 0 ] || status=1

CHECK=(/tmp/vime-train check-engines --hf-checkpoint "$W/ckpt" --check-pause-max-tokens 512)
echo "== 2. check-engines, direct" | tee -a "$LOG"
"${CHECK[@]}" --vllm-url $A --vllm-url $B --report "$OUT/check-direct.jsonl" 2>&1 | grep "check-engines" | tee -a "$LOG"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "direct: a check failed" | tee -a "$LOG"; status=1; }
echo "== 3. check-engines, through vllm-router" | tee -a "$LOG"
"${CHECK[@]}" --vllm-url $A --vllm-url $B --vllm-router-url $R --report "$OUT/check-router.jsonl" 2>&1 | grep "check-engines" | tee -a "$LOG"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "router: a check failed" | tee -a "$LOG"; status=1; }

echo "== 4. engine B killed behind the router mid-rollout" | tee -a "$LOG"
/tmp/vime-train check-engines --vllm-url $A --vllm-url $B --vllm-router-url $R --checks rollout \
  --check-rollout-requests 1024 --check-rollout-max-tokens 256 --report "$OUT/check-kill.jsonl" > "$OUT/check-kill.err" 2>&1 &
CPID=$!
sleep 6
echo "router workers before the kill: $(curl -s $R/workers)" | tee -a "$LOG"
kill -KILL -- -$BPID 2>/dev/null; echo "killed engine B (process group $BPID) at $(date -u +%H:%M:%S)" | tee -a "$LOG"
wait $CPID; krc=$?
grep "check-engines" "$OUT/check-kill.err" | tee -a "$LOG"
grep -c "retrying" "$OUT/check-kill.err" | sed 's/^/vime retries logged: /' | tee -a "$LOG"
grep "deregistered\|is down" "$OUT/check-kill.err" | head -3 | tee -a "$LOG"
echo "router workers after: $(curl -s $R/workers)" | tee -a "$LOG"
grep -i "error\|fail\|retry" "$OUT/router.log" | tail -5 | tee -a "$LOG"
[ "$krc" = 0 ] && grep -q '"status":"pass"' "$OUT/check-kill.jsonl" || { echo "the rollout did not survive the kill" | tee -a "$LOG"; status=1; }

echo "VLLM CONFORMANCE: $([ $status = 0 ] && echo PASS || echo FAIL)" | tee -a "$LOG"
exit "$status"
