"""`vramguard run` on the real SmolLM2-135M-Instruct against transformers' own greedy `generate`, on the GPU.

For each everyday chat prompt: transformers' `generate(do_sample=False)` on the model loaded as `run` loads it by
default on a CUDA device (NF4, double quant, bf16 compute, SDPA; its generation config's EOS), then
`python -m vramguard run FOLDER --prompt P --format json` in a new process (the default: NF4, fast decode where it
runs, the model's end tokens), and the same with `--no-fast-decode`. Each record: the token ids of each, whether
they are equal up to and including the stop, where they first differ, why `run` stopped, and the process's wall.

    python3 benchmarks/gpu_real_session.py --model SMOLLM2_FOLDER --out OUT   # OUT/real_session.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from benchmarks.common import emit  # noqa: E402

PROMPTS = ("Write one sentence about why the sky is blue.", "What is the capital of France?",
           "Name three primary colors.", "What is 12 times 12?", "Give me a short tip for sleeping better.")


def reference(folder: str, max_new: int) -> list[list[int]]:
    """transformers' greedy token ids of each prompt (NF4 as vramguard loads it on CUDA: double quant, bf16)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=q, dtype=torch.bfloat16,
                                                 attn_implementation="sdpa", device_map={"": 0})
    out = []
    for p in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True).to(0)
        g = model.generate(**ids, max_new_tokens=max_new, do_sample=False)
        out.append(g[0, ids["input_ids"].shape[1]:].tolist())
    del model
    torch.cuda.empty_cache()
    return out


def run_cli(folder: str, prompt: str, max_new: int, extra: list[str]) -> tuple[dict, float]:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "vramguard", "run", folder, "--prompt", prompt, "--max-new-tokens",
                        str(max_new), "--format", "json", *extra], capture_output=True, text=True, timeout=240)
    wall = time.perf_counter() - t0
    try:
        return json.loads(p.stdout), wall
    except json.JSONDecodeError:
        return {"error": p.stderr[-2000:], "rc": p.returncode}, wall


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    log = os.path.join(args.out, "real_session.jsonl")
    refs = reference(args.model, args.max_new_tokens)
    for prompt, ref in zip(PROMPTS, refs):
        for mode, extra in (("default", []), ("no_fast_decode", ["--no-fast-decode"])):
            r, wall = run_cli(args.model, prompt, args.max_new_tokens, extra)
            ids = r.get("token_ids", [])
            emit(log, {"prompt": prompt, "mode": mode, "reference_tokens": len(ref), "run_tokens": len(ids),
                       "equal": ids == ref, "first_difference": first_difference(ids, ref), "stop": r.get("stop"),
                       "stop_detail": r.get("stop_detail"), "strategy": r.get("strategy"),
                       "decode_ms_per_token": r.get("decode_ms_per_token"), "wall_s": round(wall, 2),
                       "text": r.get("text"), "error": r.get("error")})


if __name__ == "__main__":
    main()
