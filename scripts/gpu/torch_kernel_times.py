"""torch's equivalents of vime's kernels, timed at the shapes of
kernels/tests/cuda_vs_cpu.rs::timings_at_qwen3_4b_shapes, and the side-by-side table.

    python3 scripts/gpu/torch_kernel_times.py VIME_TIMES.txt

VIME_TIMES.txt holds the `TIME ...` lines the vime test printed. Same protocol on both sides:
median of 20 runs after 2 warm-ups, CUDA-synchronised; forward, and forward + backward of
sum(y * w) with a fixed f32 w. torch contenders: F.rms_norm, HF's rotate_half RoPE (eager),
F.silu(g) * u (eager), SDPA with the FlashAttention-2 backend and with the cuDNN backend (causal,
GQA via enable_gqa), the LM head as slime computes it (bf16 logits -> f32 log_softmax -> gather +
entropy), and torch.optim.AdamW(fused=True) on one flat f32 parameter of 2^28 elements.
Attention FLOPs are counted causal-once: forward 4*s^2*d*H/2 per sequence, fwd+bwd 3x that.
"""
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

dev = "cuda"
bf = torch.bfloat16
torch.manual_seed(0)


def median_ms(f, iters=20):
    for _ in range(2):
        f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        f()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t) * 1e3)
    ts.sort()
    return ts[iters // 2]


def time_op(name, shape, op, inputs):
    xs = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
    y = op(*xs)
    w = torch.randn(y.shape, device=dev, dtype=torch.float32)

    def fwd():
        with torch.no_grad():
            op(*xs)

    def both():
        for x in xs:
            x.grad = None
        (op(*xs).float() * w).sum().backward()

    f, b = median_ms(fwd), median_ms(both)
    # the objective's own cost, through a trivial op (y * 1) of the same output shape and dtype
    z = torch.zeros_like(y).requires_grad_(True)

    def base():
        z.grad = None
        ((z * 1.0).float() * w).sum().backward()

    o = median_ms(base)
    print(f"TIME {name} {shape} fwd_ms {f:.4f} fwdbwd_ms {b:.4f} objective_ms {o:.4f}", flush=True)
    return f, b, o


def rope_hf(x, cos, sin):
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def main():
    t = 4096
    res = {}
    x = torch.randn(t, 2560, device=dev, dtype=bf)
    w = (torch.randn(2560, device=dev) * 0.1 + 1).to(bf)
    res[("rms_norm", "4096x2560")] = time_op("torch_rms_norm", "4096x2560", lambda a, b: F.rms_norm(a, (2560,), b, 1e-6), [x, w])
    q = torch.randn(t, 32, 128, device=dev, dtype=bf)
    wn = (torch.randn(128, device=dev) * 0.1 + 1).to(bf)
    res[("rms_norm", "4096x32x128")] = time_op("torch_rms_norm", "4096x32x128", lambda a, b: F.rms_norm(a, (128,), b, 1e-6), [q, wn])
    inv = 1.0 / (1e6 ** (torch.arange(0, 128, 2, device=dev, dtype=torch.float32) / 128))
    ang = torch.arange(t, device=dev, dtype=torch.float32)[:, None] * inv[None]
    emb = torch.cat([ang, ang], -1)
    cos, sin = emb.cos()[:, None, :].to(bf), emb.sin()[:, None, :].to(bf)
    res[("rope", "4096x32x128")] = time_op("torch_rope_eager", "4096x32x128", lambda a: rope_hf(a, cos, sin), [q])
    g = torch.randn(t, 9728, device=dev, dtype=bf) * 2
    u = torch.randn(t, 9728, device=dev, dtype=bf)
    res[("swiglu", "4096x9728")] = time_op("torch_swiglu_eager", "4096x9728", lambda a, b: F.silu(a) * b, [g, u])

    attn = {}
    for seqs, ln in [(1, 4096), (2, 2048), (1, 8192)]:
        qa = torch.randn(seqs, 32, ln, 128, device=dev, dtype=bf)
        ka = torch.randn(seqs, 8, ln, 128, device=dev, dtype=bf)
        va = torch.randn(seqs, 8, ln, 128, device=dev, dtype=bf)
        shape = f"{seqs}x{ln}_h32_kv8_d128"
        for backend, tag in [(SDPBackend.FLASH_ATTENTION, "flash"), (SDPBackend.CUDNN_ATTENTION, "cudnn")]:
            try:
                with sdpa_kernel(backend):
                    attn[(tag, shape)] = time_op(
                        f"torch_sdpa_{tag}", shape,
                        lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True),
                        [qa, ka, va])
            except RuntimeError as e:  # a backend that refuses the shape
                print(f"TIME torch_sdpa_{tag} {shape} unavailable: {str(e).splitlines()[0]}")
        if ("flash", shape) not in attn:
            # FlashAttention-2 backend without GQA support: expand K/V to 32 heads.
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                attn[("flash", shape)] = time_op(
                    "torch_sdpa_flash_repeat_kv", shape,
                    lambda a, b, c: F.scaled_dot_product_attention(
                        a, b.repeat_interleave(4, 1), c.repeat_interleave(4, 1), is_causal=True),
                    [qa, ka, va])
    h = torch.randn(t, 2560, device=dev, dtype=bf)
    lm = torch.randn(151936, 2560, device=dev, dtype=bf) * 0.02
    tg = torch.randint(0, 151936, (t,), device=dev)

    def lm_head(a, b):
        logp = torch.log_softmax((a @ b.t()).float(), -1)
        ent = -(logp.exp() * logp).sum(-1)
        return torch.cat([logp.gather(-1, tg[:, None])[:, 0], ent])

    res[("lm_head_logprob_entropy", "4096x2560_v151936")] = time_op("torch_lm_head", "4096x2560_v151936", lm_head, [h, lm])
    del h, lm
    n = 1 << 28
    p = torch.zeros(n, device=dev, dtype=torch.float32, requires_grad=True)
    p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW([p], lr=3e-4, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1, fused=True)
    adam_ms = median_ms(lambda: opt.step())
    print(f"TIME torch_adamw_fused {n} step_ms {adam_ms:.4f}", flush=True)
    del p, opt
    torch.cuda.empty_cache()

    if len(sys.argv) < 2:
        return
    vime = {}
    vime_adam = None
    for line in open(sys.argv[1]):
        parts = line.split()
        if len(parts) >= 7 and parts[0] == "TIME" and parts[3] == "fwd_ms":
            vime[(parts[1], parts[2])] = (float(parts[4]), float(parts[6]), float(parts[8]) if len(parts) >= 9 else 0.0)
        elif len(parts) >= 5 and parts[0] == "TIME" and parts[1] == "adamw":
            vime_adam = float(parts[4])
    print()
    print("f+b: forward + backward of sum(y * w); net: f+b minus the objective's own cost (same objective")
    print("through y * 1). Attention TFLOP/s from the net f+b time.")
    print(f"{'op':<24} {'shape':<20} {'vime fwd':>9} {'torch fwd':>9} {'vime f+b':>9} {'torch f+b':>9} {'vime net':>9} {'torch net':>9}  torch/vime (net)")
    # vime's attention rows are per kernel ("attention[flash]", "attention[cudnn]"; "attention" before)
    vime_attn = sorted({op for op, _ in vime if op.startswith("attention")})
    rows = [(k, res[k], "torch") for k in res] + [
        ((op, s), v, f"sdpa_{tag}") for (tag, s), v in attn.items() for op in vime_attn]
    for (op, shape), (tf, tb, to), who in rows:
        if (op, shape) not in vime:
            continue
        vf, vb, vo = vime[(op, shape)]
        vn, tn = vb - vo, tb - to
        extra = ""
        if op.startswith("attention"):
            seqs, ln = shape.split("_")[0].split("x")
            flops = 3 * int(seqs) * 4 * int(ln) ** 2 * 128 * 32 / 2
            extra = f"   vime {flops / vn / 1e9:.0f} TFLOP/s, {who} {flops / tn / 1e9:.0f} TFLOP/s"
        print(f"{op:<24} {shape:<20} {vf:9.3f} {tf:9.3f} {vb:9.3f} {tb:9.3f} {vn:9.3f} {tn:9.3f}  {tn / vn:5.2f}x ({who}){extra}")
    if vime_adam is not None:
        print(f"{'adamw (2^28 params)':<24} {'one step':<20} {'':>9} {'':>9} {vime_adam:9.3f} {adam_ms:9.3f} {'':>9} {'':>9}  {adam_ms / vime_adam:5.2f}x (torch fused AdamW)")


if __name__ == "__main__":
    main()
