#!/usr/bin/env bash
# One device call, in order of importance, each part only while LIMIT seconds (default 585) last:
# the kernel check (every_op + engine_ops of kernels/tests/cuda_vs_cpu.rs), HF parity (0.6B, 4B),
# scripts/gpu/train_vs_bench.sh in SFT (0.6B, and 4B on an H200), then GRPO at 0.6B with the new
# binary and with gpu-carry/tvb/vime-train-old.xz (the loss metrics read one at a time). Needs
# gpu-carry/{device-env.sh, vime-train.xz, COMMIT, cuda_vs_cpu.xz}. Outputs under $OUT.
# Used for benches/results/2026-12-06-train-vs-bench.md, where a cold H100 needed more than the
# 200 s it then gave the kernel check (now 260 s, as verify_step_change.sh gives it).
T0=$(date +%s); LIMIT=${LIMIT:-585}; left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
source gpu-carry/device-env.sh >/dev/null 2>&1
mkdir -p $OUT/verify
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $OUT/verify/gpu.txt
xz -dc gpu-carry/cuda_vs_cpu.xz > /tmp/cvc && chmod +x /tmp/cvc
{ echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"; echo "commit: $(cat gpu-carry/COMMIT)"
  echo "command: /tmp/cvc every_op engine_ops --nocapture --test-threads 1"; cat $OUT/verify/gpu.txt; } > $OUT/verify/every_op.txt
s=$(date +%s); timeout 260 /tmp/cvc every_op engine_ops --nocapture --test-threads 1 >> $OUT/verify/every_op.txt 2>&1
echo "checks rc $? in $(( $(date +%s) - s )) s"; grep -E 'VERDICT| FAIL$|test result' $OUT/verify/every_op.txt | cut -c1-200 | tail -6
xz -dc gpu-carry/vime-train.xz > /tmp/vime-train && chmod +x /tmp/vime-train
s=$(date +%s); timeout 150 bash scripts/gpu/hf_parity.sh $OUT/verify/hf > $OUT/verify/hf.log 2>&1
echo "hf rc $? in $(( $(date +%s) - s )) s"; grep -E 'VERDICT' $OUT/verify/hf/hf_parity.txt | tail -2
M="qwen3-0.6b"; grep -q H200 $OUT/verify/gpu.txt && [ $(left) -gt 300 ] && M="qwen3-0.6b qwen3-4b"
s=$(date +%s); MODE=sft MODELS="$M" timeout $(( $(left) - 10 )) bash scripts/gpu/train_vs_bench.sh $OUT/tvb-sft > $OUT/tvb-sft.log 2>&1
echo "sft rc $? in $(( $(date +%s) - s )) s"; grep -E 'VERDICT|trainer|bench-step|last rollout|HOST' $OUT/tvb-sft.log | cut -c1-500
for v in new old; do
  [ $(left) -gt 100 ] || { echo "grpo $v: no time left"; continue; }
  x=gpu-carry/vime-train.xz; [ $v = old ] && x=gpu-carry/tvb/vime-train-old.xz
  s=$(date +%s); MODE=grpo MODELS=qwen3-0.6b ROLLOUTS=2 VIME_XZ=$x timeout $(( $(left) - 5 )) bash scripts/gpu/train_vs_bench.sh $OUT/tvb-grpo-$v > $OUT/tvb-grpo-$v.log 2>&1
  echo "grpo $v rc $? in $(( $(date +%s) - s )) s"; grep -E 'VERDICT|trainer|bench-step|last rollout|HOST' $OUT/tvb-grpo-$v.log | cut -c1-500
done
