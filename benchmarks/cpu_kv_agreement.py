"""Quantized-KV agreement on random weights, by model size, on the CPU (float32): is the int4 cache's low agreement
on the GPU's random 8B model (benchmarks/gpu_identity.py) a property of random weights, or of the GPU path?

Two 4-layer random Llamas, a small one (hidden 512, head_dim 64, 2 KV heads, vocabulary 2,000) and one with
Llama-3-8B's dimensions (hidden 4,096, head_dim 128, 8 KV heads, vocabulary 128,256); prompt 512, greedy. For each,
the teacher-forced top-1 agreement (``gpu_identity.teacher_forced``) of the int4 and int8 caches (the settings of
vramguard's strategies, each line names its backend) with the float32 cache, and of the float32 cache with itself.

    python benchmarks/cpu_kv_agreement.py OUTDIR        # about 3 minutes on 2 cores
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.common import emit  # noqa: E402
from benchmarks.gpu_identity import teacher_forced  # noqa: E402

MODELS = {
    "small": dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
                  vocab_size=2000),
    "llama3_8b_dims": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                           vocab_size=128256, rope_theta=500000.0),
}


def main():
    import transformers

    from vramguard.run.generate import STRATEGIES
    out = os.path.join(sys.argv[1] if len(sys.argv) > 1 else "/tmp/kv_agreement", "results.jsonl")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    caches = {st.plan["kv_dtype"]: st.kwargs for st in STRATEGIES if st.plan.get("kv_dtype")}
    for name, dims in MODELS.items():
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(num_hidden_layers=4, max_position_embeddings=4096, **dims)
        m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
        new = 64 if name == "small" else 32
        ids = torch.randint(100, cfg.vocab_size - 100, (1, 512))
        ref = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0)[0, 512:].tolist()
        emit(out, {"model": name, "cache": "float32 (itself)", **teacher_forced(m, ids, ref, {})})
        for kv, kwargs in caches.items():
            kw = {"cache_implementation": kwargs["cache_implementation"], "cache_config": dict(kwargs["cache_config"])}
            emit(out, {"model": name, "cache": kv, "cache_config": kwargs["cache_config"],
                       **teacher_forced(m, ids, ref, kw)})
        del m


if __name__ == "__main__":
    main()
