"""HF-parity of vime's bf16 training math at real Qwen3 shapes (issue 6, item 3).

    python3 scripts/gpu/hf_parity.py make    --model 0.6b --dir D [--seed 0] [--seq-lens 1024,768,256]
    vime-train grad --hf-checkpoint D/model --batch D/batch.safetensors --output D/vime.safetensors \
                    --dtype bf16 --device cuda
    python3 scripts/gpu/hf_parity.py compare --dir D

`make` builds a random-init Qwen3ForCausalLM with the real Qwen3-0.6B or Qwen3-4B config (HF's
own initialisation, torch.manual_seed(seed)), stores it as bf16 safetensors (so every contender
uses the same, bf16-representable weights), and a packed batch: random token ids for sequences of
`--seq-lens`, N(0,1) weights `adv` (0 at each sequence's last token) and ent_coef 0.1.

`compare` runs HF transformers in fp32 (the reference) and in bf16 on the same weights, each
sequence separately (batch 1, positions 0..L-1, SDPA attention), for
    J = sum_i adv_i * logprob_i + ent_coef * sum_i entropy_i,
and compares vime's bf16 log-probs, entropies and dJ/dparam (from `vime-train grad`) with the fp32
reference. Errors are relative L2 norms over all tokens (log-probs: every position but each
sequence's last) and over all parameters together (gradients). Verdict: vime-bf16 vs HF-fp32 is
no worse than 1.5x HF-bf16 vs HF-fp32, for log-probs and for gradients. The last line says PASS or
FAIL; the exit status is 0 only for PASS.
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

# Verbatim sizes of Qwen/Qwen3-0.6B and Qwen/Qwen3-4B config.json (the rest is shared).
MODELS = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8),
    "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8),
    # Not a release: a small shape to check the script itself (on CPU with VIME_PARITY_DEVICE=cpu).
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
}
DEVICE = os.environ.get("VIME_PARITY_DEVICE", "cuda")
COMMON = dict(vocab_size=151936, head_dim=128, rms_norm_eps=1e-6, max_position_embeddings=40960,
              tie_word_embeddings=True, attention_bias=False, hidden_act="silu", bos_token_id=151643,
              eos_token_id=151645, initializer_range=0.02, use_sliding_window=False, attention_dropout=0.0)
ENT_COEF = 0.1


def config(name):
    kw = dict(COMMON)
    kw.update(MODELS[name])
    return Qwen3Config(**kw, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


def make(args):
    os.makedirs(args.dir, exist_ok=True)
    cfg = config(args.model)
    torch.manual_seed(args.seed)
    t = time.time()
    with torch.device(DEVICE):
        model = Qwen3ForCausalLM(cfg)
    model = model.to(torch.bfloat16)
    model.save_pretrained(os.path.join(args.dir, "model"), safe_serialization=True)
    print(f"made {args.model}: {sum(p.numel() for p in model.parameters()) / 1e9:.3f} B parameters, "
          f"saved bf16 in {time.time() - t:.1f} s", flush=True)
    del model
    g = torch.Generator().manual_seed(args.seed + 1)
    lens = [int(x) for x in args.seq_lens.split(",")]
    total = sum(lens)
    ids = torch.randint(0, cfg.vocab_size, (total,), generator=g, dtype=torch.int64)
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(lens), 0)), dtype=torch.int64)
    adv = torch.randn(total, generator=g, dtype=torch.float32)
    adv[cu[1:] - 1] = 0.0
    save_file({"input_ids": ids, "cu_seqlens": cu, "adv": adv, "ent_coef": torch.tensor([ENT_COEF])},
              os.path.join(args.dir, "batch.safetensors"))


def hf_run(model_dir, dtype, batch):
    model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(DEVICE)
    model.train()  # dropout is 0; train() only matters for gradient checkpointing flags
    ids, cu, adv = batch["input_ids"].to(DEVICE), batch["cu_seqlens"].tolist(), batch["adv"].to(DEVICE)
    lps, ents = [], []
    total = torch.zeros((), device=DEVICE, dtype=torch.float32)
    for s in range(len(cu) - 1):
        seq = ids[cu[s]:cu[s + 1]]
        logits = model(input_ids=seq[None]).logits[0].float()
        logp = torch.log_softmax(logits, -1)
        ent = -(logp.exp() * logp).sum(-1)
        lp = torch.zeros_like(ent)
        lp[:-1] = logp[:-1].gather(-1, seq[1:, None])[:, 0]
        total = total + (adv[cu[s]:cu[s + 1]] * lp).sum() + ENT_COEF * ent.sum()
        lps.append(lp.detach())
        ents.append(ent.detach())
    total.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters()}
    out = dict(logprobs=torch.cat(lps), entropy=torch.cat(ents), objective=total.item(), grads=grads)
    del model
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return out


def rel(a, b, mask=None):
    a, b = a.double(), b.double()
    if mask is not None:
        a, b = a[mask], b[mask]
    return ((a - b).norm() / b.norm()).item()


def grad_rel(grads, ref):
    num = sum(((grads[n].double() - ref[n].double()) ** 2).sum().item() for n in ref)
    den = sum((ref[n].double() ** 2).sum().item() for n in ref)
    worst = max(((grads[n].double() - ref[n].double()).norm() / ref[n].double().norm()).item() for n in ref)
    return math.sqrt(num / den), worst


def compare(args):
    batch = load_file(os.path.join(args.dir, "batch.safetensors"))
    model_dir = os.path.join(args.dir, "model")
    cu = batch["cu_seqlens"]
    mask = torch.ones(int(cu[-1]), dtype=torch.bool)
    mask[cu[1:] - 1] = False
    mask = mask.to(DEVICE)
    t = time.time()
    ref = hf_run(model_dir, torch.float32, batch)
    hfb = hf_run(model_dir, torch.bfloat16, batch)
    hf_secs = time.time() - t
    v = load_file(os.path.join(args.dir, args.vime), device=DEVICE)
    vg = {k[5:]: t for k, t in v.items() if k.startswith("grad.")}
    missing = sorted(set(ref["grads"]) - set(vg))
    extra = sorted(set(vg) - set(ref["grads"]))
    if missing or extra:
        print(f"parameter names differ: missing in vime {missing[:5]}, extra {extra[:5]}")
        print("VERDICT: FAIL (parameter names)")
        sys.exit(1)
    res = {
        "logprobs": (rel(hfb["logprobs"], ref["logprobs"], mask), rel(v["logprobs"], ref["logprobs"], mask)),
        "entropy": (rel(hfb["entropy"], ref["entropy"]), rel(v["entropy"], ref["entropy"])),
    }
    gb, gb_worst = grad_rel(hfb["grads"], ref["grads"])
    gv, gv_worst = grad_rel(vg, ref["grads"])
    res["gradients"] = (gb, gv)
    obj = (abs(hfb["objective"] - ref["objective"]) / abs(ref["objective"]),
           abs(v["objective"].item() - ref["objective"]) / abs(ref["objective"]))
    print(f"model {args.dir}: torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.cuda.get_device_name() if DEVICE == 'cuda' else 'cpu'}; tokens {int(cu[-1])} in {len(cu) - 1} sequences; HF runs {hf_secs:.1f} s")
    print(f"{'quantity':<12} {'HF-bf16 vs HF-fp32':>20} {'vime-bf16 vs HF-fp32':>22} {'ratio':>8}")
    ok = True
    for k, (b, vv) in res.items():
        ratio = vv / b if b > 0 else float("inf")
        print(f"{k:<12} {b:>20.3e} {vv:>22.3e} {ratio:>8.3f}")
        if k in ("logprobs", "gradients") and not vv <= 1.5 * b:
            ok = False
    print(f"{'objective':<12} {obj[0]:>20.3e} {obj[1]:>22.3e}")
    print(f"worst single-tensor gradient rel err: HF-bf16 {gb_worst:.3e}, vime-bf16 {gv_worst:.3e}")
    summary = {k: {"hf_bf16": b, "vime_bf16": vv} for k, (b, vv) in res.items()}
    name = "parity.json" if args.vime == "vime.safetensors" else args.vime.replace(".safetensors", "-parity.json")
    with open(os.path.join(args.dir, name), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"VERDICT: {'PASS' if ok else 'FAIL'} (vime-bf16 error <= 1.5x HF-bf16 error for log-probs and gradients)")
    sys.exit(0 if ok else 1)


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--model", choices=sorted(MODELS), required=True)
    m.add_argument("--dir", required=True)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--seq-lens", default="1024,768,256")
    c = sub.add_parser("compare")
    c.add_argument("--dir", required=True)
    c.add_argument("--vime", default="vime.safetensors",
                   help="vime's output in --dir to compare (default vime.safetensors; fp8_error.sh passes the FP8 run's)")
    args = ap.parse_args()
    make(args) if args.cmd == "make" else compare(args)


if __name__ == "__main__":
    main()
