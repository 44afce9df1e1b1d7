#!/usr/bin/env python3
"""The torch contenders of the training-throughput benchmark (issue 7): the same step as
`vime-train bench-step` (trainer/src/bench.rs), timed the same way and printed in the same RESULT
format, so that scripts/gpu/bench_train.sh can parse vime and these alike.

    python3 scripts/gpu/bench_train_torch.py --system hf|hf-compile|megatron|megatron-te \\
        --model qwen3-4b|qwen3-0.6b|tiny --seq-len 4096 --micro-batch M --grad-accum K \\
        --recompute none|full --steps 20 --warmup 3 [--device cuda|cpu] [--json OUT]

Per optimizer step: K micro-batches of M random sequences of --seq-len tokens each (one sequence
per batch row, no packing), forward + backward of the mean per-token cross entropy, gradients
accumulated over the K micro-batches, global-norm clipping at 1.0, AdamW (lr 1e-6, betas
0.9/0.999, eps 1e-8, weight decay 0.1 on matrices only, none on 1-D params, as Megatron does).
Random init with a fixed seed (N(0, 0.02) matrices, unit norm gains), random token ids.
Printed: the median (over --steps, after --warmup untimed steps) of the CUDA-synchronised step
time, split into forward+backward and optimizer (clipping included, as in vime); tokens/s; model
TFLOP/s from vime's `flops_per_token` (recompute's extra forward not counted); MFU against 989
(H200 dense bf16 spec) and 790 (measured matmul ceiling) TFLOP/s; peak memory.

Contenders:
  hf          transformers' Qwen3ForCausalLM, attn_implementation="sdpa", fp32 parameters (the
              master weights) under torch.autocast(bfloat16), torch.optim.AdamW(fused=True),
              torch.nn.utils.clip_grad_norm_; --recompute full = gradient_checkpointing_enable()
              (non-reentrant torch.utils.checkpoint per decoder layer).
  hf-compile  the same with torch.compile(model).
  megatron    Megatron-Core 0.19.2 GPTModel from the local layer spec (no Transformer Engine, no
              Apex) with its core attention swapped for torch SDPA (SDPACoreAttention below),
              RMSNorm, qk-layernorm, SwiGLU, RoPE (base 1e6), tied embeddings, no biases, no
              dropout; bf16 parameters (Float16Module, as Megatron-LM's get_model wraps them),
              fp32 gradient buffers (grad_reduce_in_fp32, which Megatron-LM forces for bf16),
              DistributedDataParallel + the distributed optimizer (fp32 master weights and
              moments), Megatron's own forward_backward_no_pipelining schedule and
              finalize_model_grads; single process (world size 1, NCCL). --recompute full =
              recompute_granularity "full", method "uniform", 1 layer per unit. CUDA only.
              Without TE/Apex Megatron falls back to torch.optim.AdamW (foreach); by default
              this script flips its param groups to torch's fused AdamW kernel, the counterpart
              of the TE/Apex FusedAdam a real Megatron install uses (--megatron-fused-adam off
              keeps the fallback as Megatron builds it). --megatron-fusions on (default) turns on
              the fusions that Megatron-LM enables by default and that need neither TE nor Apex
              (bias-SwiGLU, bias-dropout-add; both torch.compile'd by megatron.core.jit); off =
              none. The native fused cross entropy stays off (Megatron-LM's default; on the CPU
              its gradients differed from the unfused loss by ~1e-3 relative in fp32).
              Likewise --megatron-foreach on (default) replaces Megatron's no-Apex fallbacks for
              the gradient-norm and multi-tensor-scale helpers (per-tensor Python loops, a host
              sync per tensor in the norm) with torch._foreach equivalents of Apex's kernels.
  megatron-te Megatron-Core 0.19.2 with Transformer Engine, as slime's Megatron-LM runs it
              (--transformer-impl transformer_engine, its default): the layer spec of
              get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True) (TE's fused RMSNorm +
              QKV / FC1 linears, TE's DotProductAttention, TE row-parallel linears), TE's fused
              RoPE (apply_rope_fusion, on by default in Megatron-LM), gradient accumulation fused
              into TE's weight-gradient GEMMs (gradient_accumulation_fusion, on by default), TE's
              FusedAdam and multi-tensor l2norm/scale (Megatron-Core picks them when TE imports),
              the bias-SwiGLU and bias-dropout-add fusions; everything else as `megatron`.
              Attention: TE chooses its backend; the GPU image has no flash-attn package (slime's
              --attention-backend flash needs one), so it runs cuDNN's fused attention, the
              kernels vime's attention runs too. The chosen backend is printed (NVTE_DEBUG).
              Needs Transformer Engine importable: scripts/gpu/te_kit.sh installs it.

Peak memory is torch.cuda.max_memory_reserved() over the timed steps: vime reports the sampled
used device memory (total - free), which includes its pool's cached blocks, i.e. the counterpart
of torch's "reserved", not "allocated".

Megatron-Core on the GPU machine (which cannot download): from the repo root, HERE (a machine with
PyPI), fetch the wheel into the git-ignored .whl/ folder:

    grep -qx '/.whl/' .git/info/exclude || echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \\
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \\
        --platform manylinux2014_x86_64 -d .whl megatron-core==0.19.2
    # -> .whl/megatron_core-0.19.2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl
    #    (2.4 MB; Requires-Python >= 3.12, the GPU image has 3.12.3)

and on the GPU machine (the run tool's `carry: [".whl"]`), before the benchmark:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site

Its non-optional dependencies (`unzip -p .whl/megatron_core-*.whl '*/METADATA' | grep
^Requires-Dist`, the lines without `extra ==`) are only torch>=2.6.0, numpy and packaging>=24.2,
all in the GPU image (torch 2.11, numpy 2.x, packaging). The extras (training, mlm, dev, te, ssm:
transformer-engine, apex-free fusions, wandb, ...) are not needed: without transformer_engine and
apex Megatron-Core imports with warnings and falls back to torch norms and torch optimizers.
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

# (hidden, intermediate, layers, heads, kv_heads, head_dim, vocab, tied) -- Qwen3 config.json
# values; shared: rms_norm_eps 1e-6, rope_theta 1e6, no attention bias, silu.
MODELS = {
    "qwen3-0.6b": dict(hidden=1024, inter=3072, layers=28, heads=16, kv=8, head_dim=128,
                       vocab=151936, tied=True),
    "qwen3-1.7b": dict(hidden=2048, inter=6144, layers=28, heads=16, kv=8, head_dim=128,
                       vocab=151936, tied=True),
    "qwen3-4b": dict(hidden=2560, inter=9728, layers=36, heads=32, kv=8, head_dim=128,
                     vocab=151936, tied=True),
    # CPU smoke test only.
    "tiny": dict(hidden=64, inter=128, layers=2, heads=4, kv=2, head_dim=16, vocab=1000,
                 tied=True),
}
RMS_EPS = 1e-6
ROPE_THETA = 1e6
INIT_STD = 0.02
LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 1e-6, (0.9, 0.999), 1e-8, 0.1, 1.0
SEED, DATA_SEED = 1234, 99


def flops_per_token(m, seq_len):
    """vime's `flops_per_token` (trainer/src/bench.rs), term for term: 6 x every matmul weight
    (q, k, v, o, gate, up, down per layer, and the LM head) + the causal attention term
    12 x layers x (s + 1) / 2 keys x heads x head_dim (QK^T and PV, 2 flops per multiply-add,
    x3 for forward and backward)."""
    h, i, l = float(m["hidden"]), float(m["inter"]), float(m["layers"])
    qh, kvh, d = float(m["heads"]), float(m["kv"]), float(m["head_dim"])
    per_layer = h * qh * d + 2.0 * h * kvh * d + qh * d * h + 3.0 * h * i
    matmul = l * per_layer + h * float(m["vocab"])
    keys = (seq_len + 1.0) / 2.0
    return 6.0 * matmul + 12.0 * l * keys * qh * d


def median(v):
    """vime's median: the element at len/2 of the sorted list (the upper one for even counts)."""
    v = sorted(v)
    return v[len(v) // 2]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_batches(args, m, device):
    """K micro-batches of [M, S] random token ids (fixed seed, drawn on the CPU)."""
    g = torch.Generator().manual_seed(DATA_SEED)
    return [
        torch.randint(0, m["vocab"], (args.micro_batch, args.seq_len), generator=g).to(device)
        for _ in range(args.grad_accum)
    ]


def report(args, n_params, fb, optim, total, peak_bytes, last_loss):
    m = MODELS[args.model]
    fpt = flops_per_token(m, args.seq_len)
    tokens_per_step = args.micro_batch * args.seq_len * args.grad_accum
    fb, optim, step = median(fb), median(optim), median(total)
    tps = tokens_per_step / step
    tflops = tps * fpt / 1e12
    peak_gib = peak_bytes / float(1 << 30)
    out = {
        "system": args.system,
        "model": args.model,
        "params": n_params,
        "dtype": "bf16",
        "recompute": args.recompute,
        "seq_len": args.seq_len,
        "tokens_per_micro_batch": args.micro_batch * args.seq_len,
        "micro_batch_sequences": args.micro_batch,
        "micro_batches": args.grad_accum,
        "steps": args.steps,
        "step_s": step,
        "fwd_bwd_s": fb,
        "optimizer_s": optim,
        "tokens_per_s": tps,
        "flops_per_token": fpt,
        "model_tflops": tflops,
        "mfu_989": tflops / 989.0,
        "mfu_790": tflops / 790.0,
        "peak_mem_gib": peak_gib,
        "peak_mem_kind": "torch.cuda.max_memory_reserved",
        "final_loss": last_loss,
        "torch": torch.__version__,
    }
    # The exact format of vime's line (trainer/src/bench.rs, `run`).
    print(
        f"RESULT {args.system} {args.model} seq {args.seq_len} tokens/step {tokens_per_step} "
        f"recompute {args.recompute}: step {step:.3f} s (fwd+bwd {fb:.3f}, optimizer {optim:.3f}), "
        f"{tps:.0f} tokens/s, {tflops:.0f} TFLOP/s, MFU {100.0 * tflops / 989.0:.1f}% of 989 / "
        f"{100.0 * tflops / 790.0:.1f}% of 790, peak mem {peak_gib:.1f} GiB",
        flush=True,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


def timed_steps(args, device, fwd_bwd, opt_step):
    """The step loop every torch contender shares, timed as vime's bench-step times its own:
    --warmup untimed steps, then --steps timed ones, each `fwd_bwd()` (returns the loss of its
    last micro-batch, or None) and then `opt_step()` (returns a suffix for the warm-up log line
    and a warning or None), each phase CUDA-synchronised. Peak memory counts from the first timed
    step. Returns the per-step fwd+bwd, optimizer and total seconds and the last loss."""
    fb, optim, total = [], [], []
    last_loss = float("nan")
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            peak_reset(device)
        s0 = time.perf_counter()
        loss = fwd_bwd()
        sync(device)
        s1 = time.perf_counter()
        log, warning = opt_step()
        sync(device)
        s2 = time.perf_counter()
        if warning:
            print(f"  step {step}: {warning}", file=sys.stderr)
        if loss is not None:
            last_loss = loss
        if step >= args.warmup:
            fb.append(s1 - s0)
            optim.append(s2 - s1)
            total.append(s2 - s0)
        else:
            print(f"  warm-up step {step}: {s2 - s0:.3f} s{log}", file=sys.stderr, flush=True)
    return fb, optim, total, last_loss


def peak_reset(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_read(device):
    # Reserved (allocated + the caching allocator's cached blocks), comparable to vime's sampled
    # used device memory, which includes its stream-ordered pool's cache.
    return torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0


# --------------------------------------------------------------------------------------------
# HF transformers (hf, hf-compile)
# --------------------------------------------------------------------------------------------


def run_hf(args, device):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    m = MODELS[args.model]
    cfg = Qwen3Config(
        vocab_size=m["vocab"],
        hidden_size=m["hidden"],
        intermediate_size=m["inter"],
        num_hidden_layers=m["layers"],
        num_attention_heads=m["heads"],
        num_key_value_heads=m["kv"],
        head_dim=m["head_dim"],
        hidden_act="silu",
        max_position_embeddings=max(40960, args.seq_len),
        initializer_range=INIT_STD,
        rms_norm_eps=RMS_EPS,
        use_cache=False,
        tie_word_embeddings=m["tied"],
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        attention_bias=False,
        use_sliding_window=False,
        max_window_layers=m["layers"],
        attention_dropout=0.0,
        dtype="float32",
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(SEED)
    t0 = time.perf_counter()
    # Initialise directly on the device (random N(0, 0.02), unit norm gains: HF's _init_weights).
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    model = model.to(device=device, dtype=torch.float32)
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    model.train()
    if args.recompute == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = [p for p in model.parameters() if p.requires_grad]  # tied weight counted once
    n_params = sum(p.numel() for p in params)
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, **fused)
    fwd = torch.compile(model) if args.system == "hf-compile" else model
    sync(device)
    print(
        f"bench_train_torch: {args.system} {args.model} ({n_params / 1e9:.3f}B params), fp32 master "
        f"+ bf16 autocast, sdpa, recompute {args.recompute}, {args.grad_accum} x {args.micro_batch} "
        f"x {args.seq_len} tokens per step, built in {time.perf_counter() - t0:.1f}s",
        file=sys.stderr,
        flush=True,
    )

    batches = make_batches(args, m, device)

    def fwd_bwd():
        opt.zero_grad(set_to_none=True)
        for ids in batches:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = fwd(input_ids=ids, labels=ids, use_cache=False)
            (out.loss / args.grad_accum).backward()
        return out.loss.detach()

    def opt_step():
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        return "", None

    fb, optim, total, last_loss = timed_steps(args, device, fwd_bwd, opt_step)
    return report(args, n_params, fb, optim, total, peak_read(device), float(last_loss))


# --------------------------------------------------------------------------------------------
# Megatron-Core (megatron)
# --------------------------------------------------------------------------------------------


def make_sdpa_core_attention():
    """A core-attention module for Megatron-Core's local spec that calls torch SDPA.

    Built like megatron.core.transformer.dot_product_attention.DotProductAttention (the
    CoreAttentionBuilder keywords: config, layer_number, attn_mask_type, attention_type,
    cp_comm_type, softmax_scale, pg_collection) and called like it (query, key, value,
    attention_mask, *, attn_mask_type, attention_bias, packed_seq_params). Inputs [s, b, heads,
    head_dim] (key/value with the kv heads), output [s, b, heads * head_dim]."""
    from megatron.core.transformer.module import MegatronModule

    class SDPACoreAttention(MegatronModule):
        def __init__(self, config, layer_number, attn_mask_type, attention_type,
                     attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                     pg_collection=None):
            super().__init__(config=config)
            assert config.context_parallel_size == 1, "SDPACoreAttention: no context parallelism"
            assert config.tensor_model_parallel_size == 1, "SDPACoreAttention: no tensor parallelism"
            self.layer_number = max(1, layer_number)
            self.attn_mask_type = attn_mask_type
            self.softmax_scale = softmax_scale  # None: SDPA's 1/sqrt(head_dim), as Megatron's
            self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

        def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None):
            assert packed_seq_params is None, "SDPACoreAttention: no packed sequences"
            assert attention_bias is None, "SDPACoreAttention: no attention bias"
            # [s, b, n, d] -> [b, n, s, d] (views; SDPA needs only a unit last stride)
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = F.scaled_dot_product_attention(
                q, k, v,
                dropout_p=self.dropout_p if self.training else 0.0,
                is_causal=True,
                scale=self.softmax_scale,
                enable_gqa=True,
            )
            # [b, n, s, d] -> [s, b, n * d]
            b, n, s, d = out.shape
            return out.permute(2, 0, 1, 3).reshape(s, b, n * d)

    return SDPACoreAttention


def megatron_config(args, m, cpu_init=False, bf16=True):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fusions = args.megatron_fusions == "on"
    te = args.system == "megatron-te"
    rec = {}
    if args.recompute == "full":
        rec = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return TransformerConfig(
        num_layers=m["layers"],
        hidden_size=m["hidden"],
        ffn_hidden_size=m["inter"],
        num_attention_heads=m["heads"],
        num_query_groups=m["kv"],
        kv_channels=m["head_dim"],
        normalization="RMSNorm",
        layernorm_epsilon=RMS_EPS,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=INIT_STD,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        context_parallel_size=1,
        sequence_parallel=False,
        use_cpu_initialization=cpu_init,
        # Megatron-LM's default fusions that need neither Transformer Engine nor Apex.
        bias_activation_fusion=fusions,
        bias_dropout_fusion=fusions,
        # Off by default in Megatron-LM too (--cross-entropy-loss-fusion).
        cross_entropy_loss_fusion=False,
        # Without TE: these need TE (rope fusion) or Apex (the others), off. With TE:
        # Megatron-LM's defaults (fused RoPE, wgrad accumulation in TE's GEMMs); the masked
        # softmax and persistent layer norm are for the unfused attention / Apex, unused here.
        apply_rope_fusion=te and fusions,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=te,
        persist_layer_norm=False,
        **rec,
    )


def build_megatron_model(args, m, config):
    """GPTModel from the local spec with SDPA core attention, or (megatron-te) from the
    Transformer Engine spec (unwrapped, not yet on a device)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs

    if args.system == "megatron-te":
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
        spec.submodules.self_attention.submodules.core_attention = make_sdpa_core_attention()
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=m["vocab"],
        max_sequence_length=args.seq_len,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=m["tied"],
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=int(ROPE_THETA),
    )


def inner_torch_optimizers(opt):
    """The torch optimizers inside a Megatron (Chained / Distributed) optimizer."""
    subs = getattr(opt, "chained_optimizers", None)
    if subs is not None:
        return [o for s in subs for o in inner_torch_optimizers(s)]
    inner = getattr(opt, "optimizer", None)
    return [inner] if isinstance(inner, torch.optim.Optimizer) else []


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for megatron.core.utils.local_multi_tensor_l2_norm (apex's multi_tensor_l2norm):
    the same (norm as a 1-element fp32 tensor, None), from torch._foreach_norm, with no host sync
    per tensor."""
    norms = torch._foreach_norm(tensor_lists[0], 2.0)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), 2.0)
    return total.reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """Drop-in for megatron.core.utils.local_multi_tensor_scale (apex's multi_tensor_scale):
    dst = src * scale, over lists, in a few foreach kernels instead of one launch per tensor."""
    src, dst = tensor_lists
    if len(src) == 0:
        return
    if any(a is not b for a, b in zip(src, dst)):
        torch._foreach_copy_(dst, src)
    if scale != 1.0:
        torch._foreach_mul_(dst, scale)


def patch_megatron_multi_tensor_helpers():
    """Without TE/Apex, Megatron-Core's gradient clipping and main->model copies fall back to
    per-tensor Python loops (local_multi_tensor_l2_norm syncs with the host once per tensor).
    Swap in the foreach versions above, where (and only where) those fallbacks are in use."""
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as mopt
    from megatron.core import utils as mutils

    patched = []
    if clip_grads.l2_norm_impl is mutils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm
        patched.append("clip_grads.l2_norm_impl")
    for mod, name in [(clip_grads, "clip_grads"), (mopt, "optimizer")]:
        if getattr(mod, "multi_tensor_scale_impl", None) is mutils.local_multi_tensor_scale:
            mod.multi_tensor_scale_impl = foreach_scale
            patched.append(f"{name}.multi_tensor_scale_impl")
    return patched


def install_apex_wgrad_standin(device):
    """Megatron-LM as slime runs it (NVIDIA's container) has Apex's fused_weight_gradient_mlp_cuda:
    with gradient_accumulation_fusion the output layer (a Megatron ColumnParallelLinear, not a TE
    module) accumulates its weight gradient into the fp32 main grad in one GEMM (beta = 1, fp32
    output). The GPU image has no Apex, and Megatron-Core refuses the fusion without it. This
    stand-in module does the same GEMM with Transformer Engine's cuBLASLt wrapper (accumulate into
    an fp32 output), the call TE's own linears make for their fused weight gradients. Checked
    here against the unfused sum on small shapes before use."""
    import types

    from transformer_engine.pytorch.cpp_extensions import general_gemm

    def wgrad_gemm_accum(total_input, grad_output, main_grad):
        # main_grad[out, in] += grad_output[t, out]^T @ total_input[t, in]
        general_gemm(total_input, grad_output, out_dtype=main_grad.dtype, layout="NT",
                     out=main_grad, accumulate=True, grad=True)

    g = torch.Generator(device="cpu").manual_seed(7)
    x = torch.randn(96, 64, generator=g).to(device, torch.bfloat16)
    dy = torch.randn(96, 80, generator=g).to(device, torch.bfloat16)
    acc = torch.randn(80, 64, generator=g).to(device)
    want = acc + dy.float().t() @ x.float()
    wgrad_gemm_accum(x, dy, acc)
    err = ((acc - want).abs().max() / want.abs().max()).item()
    if not err < 1e-3:
        sys.exit(f"bench_train_torch: the wgrad-accumulation stand-in is off by {err:.2e}")
    mod = types.ModuleType("fused_weight_gradient_mlp_cuda")
    mod.wgrad_gemm_accum_fp32 = wgrad_gemm_accum
    sys.modules["fused_weight_gradient_mlp_cuda"] = mod
    return err


def run_megatron(args, device):
    if device.type != "cuda":
        sys.exit("bench_train_torch: --system megatron needs --device cuda (Megatron-Core's DDP, "
                 "distributed optimizer and schedules are CUDA-only)")
    te_info = ""
    if args.system == "megatron-te":
        # TE's attention backend choice, printed at the first call.
        os.environ.setdefault("NVTE_DEBUG", "1")
        os.environ.setdefault("NVTE_DEBUG_LEVEL", "1")
        # TE dlopens libcudnn from CUDNN_HOME, else CUDA_HOME, else the loader's default, which
        # on the GPU image is a system cuDNN 9.14 whose sub-libraries then resolve to torch's
        # 9.19 ones: every cuDNN graph fails (SUBLIBRARY_LOADING_FAILED) and TE silently falls
        # back to unfused attention. Point it at torch's own cuDNN, the one vime runs on too.
        if not os.environ.get("CUDNN_HOME") and not os.environ.get("CUDNN_PATH"):
            import nvidia.cudnn

            os.environ["CUDNN_HOME"] = list(nvidia.cudnn.__path__)[0]
        import transformer_engine
        import transformer_engine.pytorch as te_pt

        err = install_apex_wgrad_standin(device)
        te_info = (f"transformer-engine {transformer_engine.__version__} "
                   f"(cuDNN {te_pt.get_cudnn_version()}; output-layer wgrad accumulation through "
                   f"TE's GEMM, checked to {err:.1e}), ")
    import megatron.core
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    # With TE, Megatron-Core uses TE's multi-tensor kernels and this patches nothing.
    patched = patch_megatron_multi_tensor_helpers() if args.megatron_foreach == "on" else []
    m = MODELS[args.model]
    # NVLink multicast stays off on the shared GPU hosts (KINDS.md); world size 1 needs none.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    torch.cuda.set_device(device)
    torch.distributed.init_process_group(backend="nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1
    )
    torch.manual_seed(SEED)
    model_parallel_cuda_manual_seed(SEED)

    t0 = time.perf_counter()
    config = megatron_config(args, m)
    model = build_megatron_model(args, m, config)
    # As Megatron-LM's get_model: to the GPU (torch norms are built on the host), then
    # Float16Module (bf16 params), then DDP with fp32 grad buffers for the distributed optimizer.
    model.cuda(torch.cuda.current_device())
    model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        use_distributed_optimizer=True,
        check_for_nan_in_grad=False,
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    n_params = sum(p.numel() for p in model.parameters())
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=LR,
        min_lr=LR,
        weight_decay=WEIGHT_DECAY,
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        adam_eps=EPS,
        clip_grad=CLIP,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_distributed_optimizer=True,
    )
    optimizer = get_megatron_optimizer(opt_config, [model])
    inner = inner_torch_optimizers(optimizer)
    adam_kind = ", ".join(sorted({type(o).__module__ + "." + type(o).__name__ for o in inner}))
    if args.megatron_fused_adam == "on":
        for o in inner:
            if isinstance(o, torch.optim.AdamW):
                o.defaults["fused"], o.defaults["foreach"] = True, False
                for g in o.param_groups:
                    g["fused"], g["foreach"] = True, False
                adam_kind += " (switched to fused=True)"
    # What Megatron-LM's training loop sets on the config before training.
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    forward_backward = get_forward_backward_func()
    sync(device)
    print(
        f"bench_train_torch: megatron-core {megatron.core.__version__} {te_info}{args.model} "
        f"({n_params / 1e9:.3f}B params), bf16 params + fp32 master (distributed optimizer: "
        f"{adam_kind}), {'TE spec' if te_info else 'local spec, sdpa'}, recompute "
        f"{args.recompute}, fusions {args.megatron_fusions}, "
        f"foreach helpers {', '.join(patched) or 'none'}, "
        f"{args.grad_accum} x {args.micro_batch} x {args.seq_len} tokens per step, built in "
        f"{time.perf_counter() - t0:.1f}s",
        file=sys.stderr,
        flush=True,
    )

    batches = make_batches(args, m, device)
    # Next-token labels (the last position wraps around; the loss covers all S positions).
    labels = [torch.roll(b, shifts=-1, dims=1) for b in batches]
    position_ids = torch.arange(args.seq_len, device=device).unsqueeze(0).expand(args.micro_batch, -1)

    def loss_func(output_tensor):
        # GPTModel with labels returns the per-token loss [b, s]; the legacy 2-tuple makes the
        # schedule divide by the number of micro-batches.
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach()}

    def forward_step(data_iterator, model):
        tokens, lab = next(data_iterator)
        out = model(tokens, position_ids, None, labels=lab)
        return out, loss_func

    def fwd_bwd():
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter(list(zip(batches, labels))),
            model=[model],
            num_microbatches=args.grad_accum,
            seq_length=args.seq_len,
            micro_batch_size=args.micro_batch,
            decoder_seq_length=args.seq_len,
            forward_only=False,
        )
        return losses[-1]["lm loss"] if losses else None

    def opt_step():
        ok, grad_norm, _ = optimizer.step()
        warning = None if ok else f"optimizer step skipped (grad norm {grad_norm})"
        return f", grad norm {grad_norm}", warning

    fb, optim, total, last_loss = timed_steps(args, device, fwd_bwd, opt_step)
    out = report(args, n_params, fb, optim, total, peak_read(device), float(last_loss))
    torch.distributed.destroy_process_group()
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system", required=True, choices=["hf", "hf-compile", "megatron", "megatron-te"])
    p.add_argument("--model", default="qwen3-4b", choices=sorted(MODELS))
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (batch row)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--recompute", default="none", choices=["none", "full"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--json", default=None, help="also write the result as JSON here")
    p.add_argument("--megatron-fusions", default="on", choices=["on", "off"],
                   help="megatron: the bias-SwiGLU and bias-dropout-add fusions")
    p.add_argument("--megatron-fused-adam", default="on", choices=["on", "off"],
                   help="megatron: switch its torch AdamW fallback to fused=True")
    p.add_argument("--megatron-foreach", default="on", choices=["on", "off"],
                   help="megatron: foreach stand-ins for Apex's multi-tensor l2norm/scale")
    args = p.parse_args(argv)
    if min(args.seq_len, args.micro_batch, args.grad_accum, args.steps) < 1 or args.warmup < 0:
        p.error("need --seq-len, --micro-batch, --grad-accum, --steps >= 1 and --warmup >= 0")
    if args.device == "cpu" and args.model != "tiny":
        p.error("--device cpu is a smoke test: use --model tiny")
    if args.system.startswith("megatron") and args.device != "cuda":
        p.error("--system megatron runs on CUDA only (Megatron-Core's DDP, distributed optimizer "
                "and schedules allocate on the GPU); --device cpu is for --system hf/hf-compile")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch sees no GPU")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if args.system.startswith("megatron"):
        run_megatron(args, device)
    else:
        run_hf(args, device)


if __name__ == "__main__":
    main()
