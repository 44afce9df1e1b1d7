"""Writes a random-init Qwen3 release shape as an HF checkpoint (bf16, transformers) with the Qwen3
tokenizer, for the real-vLLM scripts: python3 random_qwen3.py MODEL OUT_DIR TOKENIZER_DIR [SEED]
(MODEL: qwen3-0.6b | qwen3-4b; the shapes of Qwen3Config::preset)."""
import os
import shutil
import sys

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

model, out, tok = sys.argv[1:4]
seed = int(sys.argv[4]) if len(sys.argv) > 4 else 7
shapes = {"qwen3-0.6b": (1024, 3072, 28, 16, 8), "qwen3-4b": (2560, 9728, 36, 32, 8)}
h, i, l, a, kv = shapes[model]
cfg = Qwen3Config(hidden_size=h, intermediate_size=i, num_hidden_layers=l, num_attention_heads=a,
                  num_key_value_heads=kv, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                  rope_theta=1000000, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16")
torch.manual_seed(seed)
with torch.device("cuda"):
    m = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
m.save_pretrained(out)
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(tok, f), os.path.join(out, f))
print("checkpoint", model, sorted(os.listdir(out)))
