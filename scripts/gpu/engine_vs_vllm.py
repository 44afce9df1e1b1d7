#!/usr/bin/env python3
"""One contender's decode speed (issue 20): sends the same prompts at the same lengths to an
OpenAI-compatible /v1/completions server (real vLLM, or vime-serve over vime's built-in engine)
and prints one JSON line per (batch, length) cell.

    python3 scripts/gpu/engine_vs_vllm.py --url http://127.0.0.1:8011 --name vllm --model-tag 0.6b \
        --tokenizer DIR --prompts tests/assets/math/gsm8k-smoke.jsonl --batches 1,16,64,256 \
        --lens 256,4096 [--model NAME]

A cell sends B prompts in ONE request (`prompt` = a list of token-id lists; both servers run them
as one batch), `max_tokens = ignore_eos = LEN` so every sequence decodes exactly LEN tokens,
temperature 1, a fixed seed per prompt. Prompts: GSM8K questions in Qwen3's chat format (about 80
tokens), cycled to fill B. The cell's `tokens_per_s` is the completion tokens the server reports
(checked to be B x LEN) over the request's wall time, prefill included (~80 tokens per sequence
against LEN decoded). One warm-up request (8 x 16 tokens) runs first on each server.
"""
import argparse
import json
import sys
import time
import urllib.request

from tokenizers import Tokenizer


def post(url, body, timeout):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def prompts(path, tok_dir, n):
    tok = Tokenizer.from_file(f"{tok_dir}/tokenizer.json")
    qs = [json.loads(line)["prompt"] for line in open(path) if line.strip()]
    ids = [tok.encode(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).ids
           for q in qs]
    return [ids[i % len(ids)] for i in range(n)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--model-tag", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--lens", default="256,4096")
    ap.add_argument("--timeout", type=float, default=900)
    a = ap.parse_args()
    batches = [int(x) for x in a.batches.split(",") if x]
    lens = [int(x) for x in a.lens.split(",") if x]
    all_prompts = prompts(a.prompts, a.tokenizer, max(batches + [8]))

    def body(b, n):
        d = {"prompt": all_prompts[:b], "max_tokens": n, "ignore_eos": True, "temperature": 1.0,
             "top_p": 1.0, "seed": 1234, "return_token_ids": True}
        if a.model:
            d["model"] = a.model
        return d

    post(a.url, body(8, 16), a.timeout)
    for n in lens:
        for b in batches:
            t0 = time.perf_counter()
            try:
                r = post(a.url, body(b, n), a.timeout)
            except Exception as e:  # a cell that fails is reported, the others still run
                print(json.dumps({"engine": a.name, "model": a.model_tag, "batch": b, "len": n, "error": str(e)}), flush=True)
                continue
            wall = time.perf_counter() - t0
            got = r.get("usage", {}).get("completion_tokens")
            lens_ok = all(len(c.get("token_ids") or []) == n for c in r["choices"])
            print(json.dumps({"engine": a.name, "model": a.model_tag, "batch": b, "len": n,
                              "completion_tokens": got, "every_choice_len": lens_ok,
                              "wall_s": round(wall, 3), "tokens_per_s": round((got or 0) / wall, 1)}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
