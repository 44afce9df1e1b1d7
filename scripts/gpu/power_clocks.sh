#!/usr/bin/env bash
# Is the training step power-capped? (issue 21: at 4B the GEMMs got slower when only memory-bound
# kernels got faster.) Runs `vime-train bench-step` per model while nvidia-smi samples the SM
# clock, power draw, the enforced power limit and the active clock-throttle reasons every 50 ms,
# then summarises the samples taken while the GPU was busy (power > 40 % of the limit). Prints
# one line per model and a verdict: POWER-CAPPED when most busy samples carry the SW power-cap
# throttle reason (bit 0x4) or draw >= 97 % of the limit, else NOT POWER-CAPPED.
# On the GPU machine, from the repo root (needs gpu-carry/{device-env.sh, vime-train.xz, COMMIT}):
#
#   scripts/gpu/power_clocks.sh [OUT_DIR]        MODELS="qwen3-4b qwen3-0.6b" STEPS=20 EXTRA=""
set -uo pipefail
OUT=${1:-${OUT:-/tmp/power_clocks_out}}
MODELS=${MODELS:-"qwen3-4b qwen3-0.6b"}
STEPS=${STEPS:-20}
EXTRA=${EXTRA:-}
mkdir -p "$OUT"
source gpu-carry/device-env.sh >/dev/null
BIN=${BIN:-/tmp/vime-train}
[ -x "$BIN" ] || { xz -dc gpu-carry/vime-train.xz > "$BIN" && chmod +x "$BIN"; }
LOG="$OUT/power_clocks.txt"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(cat gpu-carry/COMMIT 2>/dev/null || echo unknown)"
  echo "command: MODELS=\"$MODELS\" STEPS=$STEPS EXTRA='$EXTRA' scripts/gpu/power_clocks.sh"
  nvidia-smi --query-gpu=name,driver_version,power.limit,power.max_limit,clocks.max.sm,clocks.max.mem --format=csv
} | tee "$LOG"
# The throttle-reason field's name changed (clocks_event_reasons in newer drivers).
REASONS=clocks_throttle_reasons.active
nvidia-smi --query-gpu=$REASONS --format=csv,noheader >/dev/null 2>&1 || REASONS=clocks_event_reasons.active
for m in $MODELS; do
  S="$OUT/samples-$m.csv"
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,enforced.power.limit,temperature.gpu,$REASONS \
    --format=csv,noheader,nounits -lms 50 > "$S" &
  smi=$!
  # shellcheck disable=SC2086
  "$BIN" bench-step --model "$m" --seq-len 4096 --max-tokens-per-gpu 8192 --recompute none \
    --steps "$STEPS" --warmup 2 $EXTRA 2>&1 | grep -E '^RESULT|rror' | tee -a "$LOG"
  kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null
  python3 - "$m" "$S" <<'PY' | tee -a "$LOG"
import statistics as st, sys
model, path = sys.argv[1], sys.argv[2]
rows = []
for line in open(path):
    f = [x.strip() for x in line.split(",")]
    try:
        rows.append((float(f[1]), float(f[2]), float(f[3]), float(f[4]), float(f[5]), int(f[6], 16)))
    except (ValueError, IndexError):
        pass
busy = [r for r in rows if r[3] > 0 and r[2] > 0.4 * r[3]]
if not busy:
    print(f"POWER {model}: no busy samples of {len(rows)}")
    sys.exit(0)
cap = sum(1 for r in busy if r[5] & 0x4) / len(busy)
near = sum(1 for r in busy if r[2] >= 0.97 * r[3]) / len(busy)
q = lambda v, p: sorted(v)[min(len(v) - 1, int(p * len(v)))]
sm = [r[0] for r in busy]
pw = [r[2] for r in busy]
print(f"POWER {model}: {len(busy)} busy samples of {len(rows)}; SM clock median {st.median(sm):.0f} MHz "
      f"(p10 {q(sm, 0.1):.0f}, p90 {q(sm, 0.9):.0f}); mem clock {st.median([r[1] for r in busy]):.0f} MHz; "
      f"power median {st.median(pw):.0f} W (p90 {q(pw, 0.9):.0f}) of limit {busy[0][3]:.0f} W; "
      f"temperature max {max(r[4] for r in busy):.0f} C; SW power cap active in {100 * cap:.0f} % of samples, "
      f">= 97 % of the limit in {100 * near:.0f} %")
print(f"POWER VERDICT {model}: {'POWER-CAPPED' if max(cap, near) >= 0.5 else 'NOT POWER-CAPPED'}")
PY
done
