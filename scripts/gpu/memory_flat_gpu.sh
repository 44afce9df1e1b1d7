#!/usr/bin/env bash
# Device memory stays flat over a GPU RL run (issue 22's GPU row): a GRPO run with the built-in
# engine (its decode steps through CUDA graphs, captured anew every rollout) on a tiny
# reverse-digits task with head_dim 128 (the fused CUDA kernels and cuDNN attention train it),
# ROLLOUTS rollouts of 16 prompts x 8 samples, a checkpoint every 50. The curve is the run's own
# `perf/gpu_memory_used_gb` after every rollout (metrics.jsonl); binaries without that metric fall
# back to a poll of nvidia-smi every 0.5 s against the rollouts finished so far, too coarse for
# short runs (a rollout of this task takes ~0.15 s).
#
#   ROLLOUTS=1000 scripts/gpu/memory_flat_gpu.sh [OUT_DIR]      (~3 minutes)
#
# Verdict: the least-squares slope of the used memory over the rollouts after the first 10 %
# (which warm the pools and the graphs), in MiB per rollout, and the growth it extrapolates to
# over 1000 rollouts: PASS when that is under 64 MiB. Needs gpu-carry/{device-env.sh,
# vime-train.xz, COMMIT}. Writes memory.csv (seconds, rollouts done, MiB used) beside the log.
set -uo pipefail
OUT=${1:-${OUT:-/tmp/memory_flat_gpu_out}}
mkdir -p "$OUT"
source gpu-carry/device-env.sh
ROLLOUTS=${ROLLOUTS:-1000}
BIN=/tmp/vime-train
[ -x "$BIN" ] || { xz -dc gpu-carry/vime-train.xz > "$BIN" && chmod +x "$BIN"; }
LOG="$OUT/memory_flat_gpu.txt"
CSV="$OUT/memory.csv"
W=$(mktemp -d)
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(cat gpu-carry/COMMIT 2>/dev/null || echo unknown)"
  echo "command: ROLLOUTS=$ROLLOUTS scripts/gpu/memory_flat_gpu.sh $*"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
} | tee "$LOG"
"$BIN" make-task reverse --out "$W/task" --n-train 2000 --n-eval 100 --seed 0 --head-dim 128 \
  --num-attention-heads 2 --num-key-value-heads 1 > "$W/make-task.txt" 2>&1 || { cat "$W/make-task.txt"; exit 1; }
"$BIN" --hf-checkpoint "$W/task/model" --prompt-data "$W/task/train.jsonl" --label-key label \
  --rollout-shuffle --rollout-max-response-len 8 --rm-type exact_match --weight-decay 0 \
  --use-dynamic-batch-size --max-tokens-per-gpu 4096 --dtype bf16 --device cuda --no-progress \
  --advantage-estimator grpo --rollout-batch-size 16 --n-samples-per-prompt 8 \
  --num-rollout "$ROLLOUTS" --lr 1e-3 --save "$W/run" --save-interval 50 > "$OUT/train.txt" 2>&1 &
pid=$!
echo "seconds,rollouts,mib_used" > "$CSV"
t0=$(date +%s.%N)
while kill -0 $pid 2>/dev/null; do
  n=$(cat "$W/run/metrics.jsonl" 2>/dev/null | wc -l)
  m=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
  echo "$(awk -v a="$(date +%s.%N)" -v b="$t0" 'BEGIN { printf "%.2f", a - b }'),$n,$m" >> "$CSV"
  sleep 0.5
done
wait $pid
rc=$?
if [ "$rc" = 0 ]; then tail -3 "$OUT/train.txt"; else grep -a -m 5 -i "error" "$OUT/train.txt"; fi | tee -a "$LOG"
cp "$W/run/metrics.jsonl" "$OUT/metrics.jsonl" 2>/dev/null
python3 - "$CSV" "$ROLLOUTS" "$rc" "$OUT/metrics.jsonl" <<'PY' 2>&1 | tee -a "$LOG"
import csv, json, os, sys
rows = [(float(r["seconds"]), int(r["rollouts"]), float(r["mib_used"])) for r in csv.DictReader(open(sys.argv[1]))]
total, rc = int(sys.argv[2]), int(sys.argv[3])
# Per rollout: the run's own figure after each step (perf/gpu_memory_used_gb in metrics.jsonl,
# exact) where it has one; else the largest use the poll saw while the rollout ran.
per, source = {}, "nvidia-smi poll"
if os.path.exists(sys.argv[4]):
    for i, line in enumerate(open(sys.argv[4])):
        gb = json.loads(line).get("perf/gpu_memory_used_gb") if line.strip() else None
        if gb is not None:
            per[i + 1] = gb * 1e9 / 2**20
if per:
    source = "perf/gpu_memory_used_gb"
else:
    for _, n, m in rows:
        per[n] = max(per.get(n, 0.0), m)
print(f"per-rollout figure: {source}")
pts = sorted((n, m) for n, m in per.items() if n >= max(1, total // 10))
if len(pts) < 10 or rc != 0:
    print(f"GPU MEMORY FLAT VERDICT: FAIL (run exit {rc}, {len(pts)} rollouts sampled)")
    sys.exit(1)
xs, ys = [p[0] for p in pts], [p[1] for p in pts]
mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
slope = sum((x - mx) * (y - my) for x, y in pts) / max(sum((x - mx) ** 2 for x in xs), 1e-9)
first = max((m for n, m in per.items() if n < max(1, total // 10)), default=0.0)
print(f"rollouts sampled: {len(per)}; MiB used: first 10 % peak {first:.0f}, after it min {min(ys):.0f} max {max(ys):.0f}")
for n in sorted(per)[:: max(1, len(per) // 12)]:
    print(f"  after {n:4d} rollouts: {per[n]:.0f} MiB")
grow = slope * 1000
ok = grow < 64
print(f"GPU MEMORY FLAT VERDICT: {'PASS' if ok else 'FAIL'} (slope {slope:.3f} MiB/rollout over rollouts "
      f"{pts[0][0]}-{pts[-1][0]}: {grow:.1f} MiB per 1000 rollouts; bound 64)")
PY
rm -rf "$W"
