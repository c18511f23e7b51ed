"""The generic plan's cost on the CPU: need evaluations, replays of transformers' forward and CPU seconds of one
``vramguard plan`` (the estimate, the card solvers and the ranked changes) for tiny random models of
tests/archs.py and a DeepSeek-V2-Lite-sized config.json, with every card's solved values (which must not change
when the solver gets faster).

    python benchmarks/cpu_plan_time.py --out benchmarks/results/cpu_plan_time/after.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# DeepSeek-V2-Lite's config.json fields (deepseek-ai/DeepSeek-V2-Lite): 27 layers, MLA, 64 routed experts
DSV2_LITE = {"model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 2048,
             "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
             "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64, "n_shared_experts": 2,
             "num_experts_per_tok": 6, "first_k_dense_replace": 1, "kv_lora_rank": 512, "q_lora_rank": None,
             "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 102400,
             "max_position_embeddings": 163840, "n_group": 1, "topk_group": 1, "topk_method": "greedy",
             "routed_scaling_factor": 1.0, "rms_norm_eps": 1e-6, "rope_theta": 10000,
             "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def measure(model: str, vram: str | None) -> dict:
    """One plan in this process (a fresh process per case: nothing memoized before it)."""
    from vramguard.introspect import generic
    from vramguard.plan import estimator, planner
    calls = {"need": 0}
    peak = estimator._peak

    def counted(spec, s):
        calls["need"] += 1
        return peak(spec, s)
    estimator._peak = counted
    t0 = time.process_time()
    p = planner.plan(model, vram=vram)
    cpu_s = time.process_time() - t0
    return {"need_evaluations": calls["need"], "replays": generic._replayed.cache_info().misses,
            "cpu_s": round(cpu_s, 2),
            "cards": [[c.gpu.name, c.max_prompt_tokens, c.max_new_tokens, c.max_batch] for c in p.cards],
            "changes": [[c.description, c.need_bytes] for c in p.changes]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--case", help="internal: run one case in this process")
    args = ap.parse_args()
    if args.case:
        model, _, vram = args.case.partition("@")
        print(json.dumps(measure(model, vram or None)))
        return
    import subprocess
    sys.path.insert(0, str(ROOT / "tests"))
    from archs import ARCHS
    from transformers import AutoConfig
    tmp = Path(tempfile.mkdtemp())
    cases = []
    for t in ("deepseek_v2", "qwen3_next", "olmoe", "bloom"):
        AutoConfig.for_model(t, **ARCHS[t]).save_pretrained(tmp / t)
        cases.append((t, str(tmp / t / "config.json"), None))
    (tmp / "dsv2lite").mkdir()
    (tmp / "dsv2lite" / "config.json").write_text(json.dumps(DSV2_LITE))
    cases.append(("DeepSeek-V2-Lite size", str(tmp / "dsv2lite" / "config.json"), "80GiB"))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        for name, path, vram in cases:
            r = subprocess.run([sys.executable, __file__, "--out", args.out, "--case", f"{path}@{vram or ''}"],
                               capture_output=True, text=True, check=True)
            rec = {"case": name, "vram": vram, **json.loads(r.stdout.strip().splitlines()[-1])}
            print(json.dumps(rec)[:300], flush=True)
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
