#!/usr/bin/env bash
# cuDNN's SDPA plans against each other in the training step (issue 21): cuDNN's heuristics
# (modes A and B) list several engine configs for the forward and the backward graph; vime runs
# mode A's first choice. This runs `vime-train bench-step` once with the default plans, then once
# per listed forward plan (backward at the default) and once per listed backward plan (forward at
# the default), through the measurement override VIME_CUDNN_SDPA_PLAN=F,B (kernels/src/cudnn.rs),
# and prints the step time of each against the default, measured again at the end for the noise.
# On the GPU machine, from the repo root:
#
#   scripts/gpu/cudnn_plans.sh [OUT_DIR]     MODELS="qwen3-0.6b qwen3-4b" STEPS=6 MAX_PLANS=8
#
# LAYERS_<model with - and . as _>=N runs that model with N layers (e.g. LAYERS_qwen3_4b=12: a
# third of the time, the same attention shape). Needs gpu-carry/{device-env.sh, vime-train.xz
# (--features cudnn), COMMIT}. Ends with `CUDNN PLANS VERDICT (<model>): ...` per model: the
# best plan pair, and whether it beats the default by more than the default's own spread.
set -uo pipefail
OUT=${1:-${OUT:-/tmp/cudnn_plans_out}}
MODELS=${MODELS:-"qwen3-0.6b qwen3-4b"}
STEPS=${STEPS:-6}
MAX_PLANS=${MAX_PLANS:-8}
mkdir -p "$OUT"
source gpu-carry/device-env.sh
BIN=${BIN:-/tmp/vime-train}
[ -x "$BIN" ] || { xz -dc gpu-carry/vime-train.xz > "$BIN" && chmod +x "$BIN"; }
LOG="$OUT/cudnn-plans.txt"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(cat gpu-carry/COMMIT 2>/dev/null || echo unknown)"
  echo "command: MODELS='$MODELS' STEPS=$STEPS MAX_PLANS=$MAX_PLANS scripts/gpu/cudnn_plans.sh"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
} | tee "$LOG"

# step MODEL FWD BWD: one bench-step; prints "step_s" (or "fail") and keeps the plan listing.
step() {
  local m=$1 f=$2 b=$3 key=${1//[-.]/_} extra=()
  local layers_var="LAYERS_$key"
  [ -n "${!layers_var:-}" ] && extra=(--layers "${!layers_var}")
  VIME_CUDNN_SDPA_PLAN="$f,$b" timeout 300 "$BIN" bench-step --model "$m" --seq-len 4096 \
    --max-tokens-per-gpu 8192 --steps "$STEPS" --warmup 2 "${extra[@]}" > /tmp/cudnn_plan_run.txt 2>&1
  grep '^cuDNN SDPA' /tmp/cudnn_plan_run.txt >> "$OUT/plans-$m.txt"
  local r
  r=$(grep '^RESULT' /tmp/cudnn_plan_run.txt)
  if [ -n "$r" ]; then
    echo "$m ${extra[*]} plan fwd=$f bwd=$b: $r" >> "$LOG"
    # tokens/step over tokens/s: 5 digits (the printed step time has 3 decimals)
    echo "$r" | sed -E 's#.*tokens/step ([0-9]+) .*, ([0-9]+) tokens/s.*#\1 \2#' | awk '{printf "%.5f\n", $1 / $2}'
  else
    echo "$m ${extra[*]} plan fwd=$f bwd=$b: FAILED: $(grep -iE 'error|panic' /tmp/cudnn_plan_run.txt | tail -1)" >> "$LOG"
    echo fail
  fi
}

for m in $MODELS; do
  rm -f "$OUT/plans-$m.txt"
  d0=$(step "$m" -1 -1)
  # Plan 0 of both lists: the listing (and mode A's first choice again, so it should equal d0).
  p0=$(step "$m" 0 0)
  nf=$(grep -m1 'forward plan 0 of' "$OUT/plans-$m.txt" | sed -E 's/.* of ([0-9]+):.*/\1/')
  nb=$(grep -m1 'backward plan 0 of' "$OUT/plans-$m.txt" | sed -E 's/.* of ([0-9]+):.*/\1/')
  echo "$m: ${nf:-?} forward plans, ${nb:-?} backward plans listed" | tee -a "$LOG"
  sort -u "$OUT/plans-$m.txt" | sort -t' ' -k3,3 -k5,5n | tee -a "$LOG"
  declare -A fwd=() bwd=()
  for ((i = 1; i < ${nf:-1} && i < MAX_PLANS; i++)); do fwd[$i]=$(step "$m" "$i" -1); done
  for ((i = 1; i < ${nb:-1} && i < MAX_PLANS; i++)); do bwd[$i]=$(step "$m" -1 "$i"); done
  d1=$(step "$m" -1 -1)
  python3 - "$m" "$d0" "$d1" "$p0" "$(declare -p fwd)" "$(declare -p bwd)" <<'PY' | tee -a "$LOG"
import re, sys
m, d0, d1, p0, fdecl, bdecl = sys.argv[1:7]
def parse(decl):
    return {int(k): v for k, v in re.findall(r'\[(\d+)\]="([^"]*)"', decl)}
num = lambda s: float(s) if re.fullmatch(r"[0-9.]+", s or "") else None
base = [x for x in (num(d0), num(d1)) if x]
if not base:
    print(f"CUDNN PLANS VERDICT ({m}): FAIL (the default plans did not run)")
    sys.exit(0)
ref, spread = sum(base) / len(base), (max(base) - min(base))
print(f"{m}: default plans {d0} / {d1} s (mean {ref:.4f}, spread {spread:.4f}); plan 0,0 {p0} s")
best = ("default", ref)
for name, d in (("fwd", parse(fdecl)), ("bwd", parse(bdecl))):
    for i, v in sorted(d.items()):
        x = num(v)
        print(f"  {name} plan {i}: {v} s" + (f" ({100 * (x / ref - 1):+.1f} %)" if x else ""))
        if x and x < best[1]:
            best = (f"{name} plan {i}", x)
gain = ref - best[1]
print(f"CUDNN PLANS VERDICT ({m}): best {best[0]} at {best[1]:.4f} s against the default's {ref:.4f} "
      f"({100 * gain / ref:.1f} %): {'PAYS' if gain > max(spread, 0.003 * ref) else 'no plan beats the default by more than its spread'}")
PY
done
