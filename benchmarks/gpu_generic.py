"""Measure plain transformers ``generate`` on architectures outside the hand-written families, against the generic
planner (transformers' own module tree, quantizer and a replay of its forward), on the GPU machine.

For each architecture below (published configs of the named models; random weights, since memory does not depend on
weight values), a bf16 checkpoint is written, loaded in bf16 and in NF4 (double quant, bf16 compute) with SDPA, and
``generate`` runs greedy for each prompt under a per-process cap (``--cap-gib``); a case that runs out of memory
under the cap is run again uncapped, so its peak is still measured. Each record carries the plan made on the same
machine (``vramguard.plan``: peak allocated, device need, the fit verdict for the cap) beside the measurement.

    python benchmarks/gpu_generic.py --archs olmoe-1b-7b starcoder2-7b --out results.jsonl
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.common import emit, save_random  # noqa: E402
from benchmarks.gpu_matrix import run_case, tensor_breakdown  # noqa: E402

GiB = 2**30

# config.json fields of the published models (the Hub repository in "source"), enough to build the same shapes
CONFIGS = {
    "olmoe-1b-7b": {"source": "allenai/OLMoE-1B-7B-0924", "model_type": "olmoe", "hidden_size": 2048,
                    "intermediate_size": 1024, "num_hidden_layers": 16, "num_attention_heads": 16,
                    "num_key_value_heads": 16, "num_experts": 64, "num_experts_per_tok": 8, "vocab_size": 50304,
                    "max_position_embeddings": 4096, "tie_word_embeddings": False},
    "deepseek-v2-lite": {"source": "deepseek-ai/DeepSeek-V2-Lite", "model_type": "deepseek_v2", "hidden_size": 2048,
                         "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
                         "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64,
                         "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
                         "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                         "v_head_dim": 128, "n_group": 1, "topk_group": 1, "vocab_size": 102400,
                         "max_position_embeddings": 163840, "tie_word_embeddings": False},
    "granite-hybrid-3b": {"source": "a Granite-4.0-H style hybrid (Mamba-2 + attention every 6th layer)",
                          "model_type": "granitemoehybrid", "hidden_size": 2048, "intermediate_size": 8192,
                          "shared_intermediate_size": 8192, "num_local_experts": 0, "num_hidden_layers": 24,
                          "num_attention_heads": 16, "num_key_value_heads": 4, "mamba_n_heads": 64,
                          "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1, "vocab_size": 100352,
                          "layer_types": ["attention" if (i + 1) % 6 == 0 else "mamba" for i in range(24)],
                          "max_position_embeddings": 131072, "tie_word_embeddings": True},
    "starcoder2-7b": {"source": "bigcode/starcoder2-7b", "model_type": "starcoder2", "hidden_size": 4608,
                      "intermediate_size": 18432, "num_hidden_layers": 32, "num_attention_heads": 36,
                      "num_key_value_heads": 4, "sliding_window": 4096, "vocab_size": 49152,
                      "max_position_embeddings": 16384, "tie_word_embeddings": False, "use_bias": True},
}


def build(arch: str, path: str) -> None:
    save_random(CONFIGS[arch]["model_type"],
                {k: v for k, v in CONFIGS[arch].items() if k not in ("source", "model_type")}, path)


def planned(path: str, quant: str, prompt: int, new: int, cap_bytes: int) -> dict:
    from vramguard import Settings, plan
    from vramguard.catalog.gpus import GpuSpec
    t0 = time.perf_counter()
    card = GpuSpec("cap", "capped H200", cap_bytes, (9, 0), 0)
    p = plan(path, Settings(quant=quant, attn="sdpa", prompt_tokens=prompt, max_new_tokens=new), gpus=[card],
             solve=False)
    e = p.estimate
    return {"plan_weights": e.weights.total_bytes, "plan_peak": e.peak_allocated_bytes,
            "plan_device": e.device_used_bytes, "plan_fits": p.cards[0].fits, "plan_generic": p.model.generic,
            "plan_secs": round(time.perf_counter() - t0, 2), "plan_phase": e.peak_phase}


def measure(args, arch: str) -> None:
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    path = os.path.join(args.ckpt_dir, arch)
    t0 = time.perf_counter()
    build(arch, path)
    emit(args.out, {"kind": "checkpoint", "model": arch, "secs": round(time.perf_counter() - t0, 1)})
    total = torch.cuda.mem_get_info()[1]
    cap = int(args.cap_gib * GiB)
    for quant in args.quants:
        kw = {}
        if quant == "nf4":
            kw["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=torch.bfloat16)
        torch.cuda.set_per_process_memory_fraction(1.0)
        before = torch.cuda.memory_allocated()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda:0",
                                                     attn_implementation="sdpa", **kw).eval()
        weights = torch.cuda.memory_allocated() - before
        emit(args.out, {"kind": "loaded", "model": arch, "quant": quant, "weights_bytes": weights,
                        "breakdown": tensor_breakdown(model)})
        model.generate(torch.randint(100, 1000, (1, 16)).cuda(), max_new_tokens=2, min_new_tokens=2,
                       do_sample=False, pad_token_id=0)
        for prompt in args.prompts:
            if prompt + args.new > CONFIGS[arch]["max_position_embeddings"]:
                continue
            pl = planned(path, quant, prompt, args.new, cap)
            torch.cuda.set_per_process_memory_fraction(cap / total)
            rec = run_case(model, CONFIGS[arch]["vocab_size"], 1, prompt, args.new)
            rec.update(kind="gen", model=arch, quant=quant, attn="sdpa", weights=weights, cap=cap, capped=True, **pl)
            emit(args.out, rec)
            if not rec.get("ok"):
                torch.cuda.set_per_process_memory_fraction(1.0)
                rec = run_case(model, CONFIGS[arch]["vocab_size"], 1, prompt, args.new)
                rec.update(kind="gen", model=arch, quant=quant, attn="sdpa", weights=weights, cap=None,
                           capped=False, **pl)
                emit(args.out, rec)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    shutil.rmtree(path, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--archs", nargs="+", default=list(CONFIGS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--cap-gib", type=float, default=24.0)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompts", type=int, nargs="+", default=[4000, 8000])
    ap.add_argument("--quants", nargs="+", default=["bf16", "nf4"])
    ap.add_argument("--ckpt-dir", default="/dev/shm/vg_generic")
    args = ap.parse_args()
    import transformers
    emit(args.out, {"kind": "versions", "torch": torch.__version__, "transformers": transformers.__version__,
                    "gpu": torch.cuda.get_device_name()})
    for arch in args.archs:
        try:
            measure(args, arch)
        except Exception as e:  # keep measuring the others; the record says what failed
            emit(args.out, {"kind": "arch_error", "model": arch, "err": repr(e)[:800]})
            shutil.rmtree(os.path.join(args.ckpt_dir, arch), ignore_errors=True)
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
