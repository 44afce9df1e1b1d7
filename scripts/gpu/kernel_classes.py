#!/usr/bin/env python3
"""Sums an Nsight Compute CSV (`ncu --metrics gpu__time_duration.sum --csv --print-units base`,
as scripts/gpu/profile_step.sh writes it; lines that are not CSV rows, e.g. the program's own
output, are skipped) by op class and prints the classes and the top kernels.

    python3 scripts/gpu/kernel_classes.py ncu.csv [--top 25] [--skip-until REGEX] [--per REGEX]

Kernels before the first one matching --skip-until (default `vime_rmsnorm`, the first kernel of
a training step) are the program's setup (bench-step's random weights: curand, casts) and are
reported separately, not counted in the classes.

With --per REGEX the totals are also divided by the number of counted kernels matching it (e.g.
`--per vime_sample_gumbel`: one per decode step of the built-in engine), printed as "per step".

Classes (first match wins, on the kernel's function name):
  gemm        cuBLAS/cuBLASLt kernels (nvjet*, *gemm*, *xmma*, cutlass*)
  attention   vime_flash_* (vime's FlashAttention-2 forward/backward), vime_decode_* (decode)
  lm_head     vime_lmhead_* (log-prob/entropy statistics, dlogits)
  norm_rope_swiglu  vime_rmsnorm*, vime_rope*, vime_swiglu*, vime_colsum* (norm weight grads)
  optimizer   vime_adamw*, vime_sumsq*, vime_sum_partials (gradient norm)
  vime_cast   vime_f32_to_bf16
  engine      vime_rows_write* (KV cache append), vime_sample* (device sampler)
  residual_add  vime_add_bf16 (the residual adds not fused into a norm)
  other       everything else: candle's elementwise, copies, fills, casts, reductions, index ops
"""
import csv
import re
import sys
from collections import defaultdict

CLASSES = [
    ("gemm", re.compile(r"nvjet|gemm|xmma|cutlass|sm90_|sm80_", re.I)),
    ("attention", re.compile(r"vime_flash|vime_decode")),
    ("lm_head", re.compile(r"vime_lmhead")),
    ("norm_rope_swiglu", re.compile(r"vime_rmsnorm|vime_rope|vime_swiglu|vime_colsum")),
    ("optimizer", re.compile(r"vime_adamw|vime_sumsq|vime_sum_partials")),
    ("vime_cast", re.compile(r"vime_f32_to_bf16")),
    ("engine", re.compile(r"vime_rows_write|vime_sample")),
    ("residual_add", re.compile(r"vime_add_bf16")),
]


def short(name):
    # "void foo<...>(args)" -> "foo<...>"; keep it readable.
    name = re.sub(r"^void ", "", name)
    name = re.sub(r"\(.*$", "", name)
    return name[:90]


def main():
    path = sys.argv[1]
    top = 25
    if "--top" in sys.argv:
        top = int(sys.argv[sys.argv.index("--top") + 1])
    skip_until = re.compile(r"vime_rmsnorm")
    if "--skip-until" in sys.argv:
        skip_until = re.compile(sys.argv[sys.argv.index("--skip-until") + 1])
    per = re.compile(sys.argv[sys.argv.index("--per") + 1]) if "--per" in sys.argv else None
    per_n = 0
    started = False
    skipped_n, skipped_ns = 0, 0.0
    rows = [line for line in open(path, errors="replace") if line.startswith('"')]
    if not rows:
        sys.exit(f"{path}: no CSV rows (did ncu run?)")
    reader = csv.reader(rows)
    header = next(reader)
    try:
        i_name = header.index("Kernel Name")
        i_metric = header.index("Metric Name")
        i_value = header.index("Metric Value")
        i_id = header.index("ID")
    except ValueError:
        sys.exit(f"{path}: unexpected header {header}")
    by_class = defaultdict(float)
    count_class = defaultdict(int)
    by_kernel = defaultdict(float)
    count_kernel = defaultdict(int)
    seen = set()
    for r in reader:
        if len(r) <= max(i_name, i_metric, i_value) or r[i_metric] != "gpu__time_duration.sum":
            continue
        if r[i_id] in seen:
            continue
        seen.add(r[i_id])
        ns = float(r[i_value].replace(",", ""))
        name = r[i_name]
        started = started or bool(skip_until.search(name))
        if not started:
            skipped_n += 1
            skipped_ns += ns
            continue
        if per is not None and per.search(name):
            per_n += 1
        cls = next((c for c, rx in CLASSES if rx.search(name)), "other")
        by_class[cls] += ns
        count_class[cls] += 1
        k = short(name)
        by_kernel[k] += ns
        count_kernel[k] += 1
    total = sum(by_class.values())
    if total == 0:
        sys.exit(f"{path}: no kernel matched --skip-until {skip_until.pattern!r}")
    print(f"setup before the first {skip_until.pattern!r} kernel (not counted): {skipped_n} kernels, {skipped_ns / 1e6:.2f} ms")
    print(f"kernels: {len(seen) - skipped_n}, total GPU time {total / 1e6:.2f} ms")
    if per is not None and per_n:
        print(f"per step ({per_n} kernels matching {per.pattern!r}): {(len(seen) - skipped_n) / per_n:.0f} kernels, {total / 1e6 / per_n:.3f} ms GPU time")
    print(f"{'class':<18} {'ms':>9} {'%':>6} {'kernels':>8}" + (f" {'ms/step':>9} {'k/step':>7}" if per_n else ""))
    for c, ns in sorted(by_class.items(), key=lambda kv: -kv[1]):
        extra = f" {ns / 1e6 / per_n:9.3f} {count_class[c] / per_n:7.1f}" if per_n else ""
        print(f"{c:<18} {ns / 1e6:9.2f} {100 * ns / total:6.1f} {count_class[c]:8d}" + extra)
    print(f"--- top {top} kernels by total time")
    print(f"{'ms':>9} {'%':>6} {'calls':>6} {'us/call':>9}  kernel")
    for k, ns in sorted(by_kernel.items(), key=lambda kv: -kv[1])[:top]:
        n = count_kernel[k]
        print(f"{ns / 1e6:9.2f} {100 * ns / total:6.1f} {n:6d} {ns / n / 1e3:9.1f}  {k}")


if __name__ == "__main__":
    main()
