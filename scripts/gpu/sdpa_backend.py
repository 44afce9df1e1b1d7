#!/usr/bin/env python3
"""Which kernel torch's scaled_dot_product_attention picks for the benchmark's attention shape
(bf16, causal, 32 query / 8 kv heads, head_dim 128, 4096 tokens, enable_gqa as the Megatron and
HF contenders call it), and its forward+backward time, so the attention part of the comparison
in scripts/gpu/bench_train.sh can be read. Prints one line per backend."""
import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

B, H, HKV, T, D = 2, 32, 8, 4096, 128
q = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(B, HKV, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(B, HKV, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
try:
    choice = torch._fused_sdp_choice(q, k, v, None, 0.0, True, enable_gqa=True)
    print(f"sdpa default choice (torch {torch.__version__}): {SDPBackend(choice).name}")
except Exception as e:  # private API; the timings below still tell
    print(f"sdpa default choice: unknown ({e})")


def time_fb(ctx):
    def run():
        with ctx():
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        o.backward(torch.ones_like(o))
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        run()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / 10


flops = 4 * B * H * T * (T + 1) / 2 * D * 3.5  # fwd 2 GEMMs + bwd 5 GEMMs, causal
for name, ctx in [("default", contextlib.nullcontext), ("flash", lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)),
                  ("cudnn", lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION))]:
    try:
        ms = time_fb(ctx)
        print(f"sdpa {name:8s} fwd+bwd 2x4096: {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s at 3.5x causal fwd FLOPs)")
    except Exception as e:
        print(f"sdpa {name:8s}: not available ({str(e).splitlines()[0][:120]})")
