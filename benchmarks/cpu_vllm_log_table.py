"""Print the table of `plan --engine vllm` against published vLLM startup logs (CPU, no vLLM, no network).

The cases, their settings and their sources are the lists of tests/test_vllm_accuracy.py; this prints every planned
value next to the logged one as a markdown table (the one in benchmarks/README.md and docs/engines.md).

    PYTHONPATH=$PWD python benchmarks/cpu_vllm_log_table.py
"""

from __future__ import annotations

import sys

from benchmarks.common import load_test_module
from vramguard.engines import vllm_kv as kv
from vramguard.engines import vllm_weights as w
from vramguard.units import GiB

def _name(model) -> str:
    if isinstance(model, dict):
        return {5120: "DeepSeek-R1-Distill-Qwen-14B" if model["model_type"] == "qwen2" else "Qwen/Qwen3-14B",
                2048: "Qwen/Qwen3-30B-A3B"}[model["hidden_size"]]
    return model


def _link(url: str) -> str:
    return f"[source]({url})"


def rows(m) -> list[str]:
    out = []
    for model, tp, logged, src in m.WEIGHTS:
        planned = w.rank_weights(m._spec(model), tp, 1, 2)[0].total_bytes / GiB
        out.append(f"| {_name(model)} | weights, TP {tp} | {logged} GiB | {planned:.4f} GiB | "
                   f"{(planned / logged - 1) * 100:+.2f}% | {_link(src)} |")
    for model, logged, src in ((m.R1_DISTILL_QWEN_14B, 13.9476, "https://github.com/vllm-project/vllm/issues/13061"),
                               ("google/gemma-3-1b-it", 1.9148, m.EOLE)):
        tp = 2 if isinstance(model, dict) else 1
        planned = w.rank_weights(m._spec(model), tp, 1, 2)[0].total_bytes / GiB
        out.append(f"| {_name(model)} | weights, TP {tp} (known miss) | {logged} GiB | {planned:.4f} GiB | "
                   f"**{(planned / logged - 1) * 100:+.2f}%** | {_link(src)} |")
    for model, tp, kv_gib, max_len, tokens, _conc, src in m.FROM_LOGGED_MEMORY:
        spec = m._spec(model)
        groups = kv.kv_groups(spec, list(spec.layer_types) or ["full_attention"] * spec.num_layers,
                              kv.page_bytes(spec, tp, 2, 16))
        blocks = kv.num_blocks(groups, int(kv_gib * GiB))
        planned = kv.kv_tokens_by_blocks(groups, blocks, 16)
        out.append(f"| {_name(model)} | KV from the logged {kv_gib} GiB, TP {tp}, {max_len:,} per request | "
                   f"{tokens:,} tokens | {planned:,} tokens | {(planned / tokens - 1) * 100:+.2f}% | {_link(src)} |")
    for model, gpu, settings, kv_gib, tokens, src in m.FULL_BUDGET:
        p = m._plan(model, gpu, **settings)
        what = f"full budget, {gpu.total_bytes / GiB:.2f} GiB x {p.settings.gpu_memory_utilization}, " \
               f"TP {p.settings.tensor_parallel_size}, sampler {p.settings.sampler}"
        got = f"{p.available_kv_bytes / GiB:.2f} GiB" + (f" = {p.kv_tokens_by_blocks:,} tokens" if tokens else "")
        err = (p.available_kv_bytes / GiB / kv_gib - 1) * 100
        if tokens:
            err = (p.kv_tokens_by_blocks / tokens - 1) * 100
        logged = f"{kv_gib} GiB" + (f" = {tokens:,} tokens" if tokens else "")
        out.append(f"| {_name(model)} | {what} | {logged} | {got} | {err:+.2f}% | {_link(src)} |")
    for model, total, util, max_len, blocks, src in m.V0_TOKENS:
        p = m._v0_plan(model, total, util, max_len)
        err = (p.kv_tokens_by_blocks / (blocks * 16) - 1) * 100
        out.append(f"| {model} | full budget (V0), {total} GiB x {util}, max_model_len {max_len:,} | {blocks * 16:,} "
                   f"tokens | {p.kv_tokens_by_blocks:,} tokens | {err:+.2f}% | {_link(src)} |")
    p = m._v0_plan("llama-3-8b", 79.22, 0.9, 8192)
    out.append(f"| llama-3-8b | full budget (V0), 79.22 GiB x 0.9, max_model_len 8,192 | 53.29 GiB | "
               f"{p.available_kv_bytes / GiB:.2f} GiB | {(p.available_kv_bytes / GiB / 53.29 - 1) * 100:+.2f}% | "
               f"{_link('https://github.com/vllm-project/vllm/pull/10511')} |")
    p = m._plan(m.FP8_70B, m._card(79.18), max_model_len=16000, max_num_batched_tokens=8192, max_num_seqs=1024,
                sampler="sort")
    out.append(f"| {m.FP8_70B} | full budget, 79.18 GiB x 0.9, TP 1 | -1.44 GiB, \"No available memory for the "
               f"cache blocks\" | {p.available_kv_bytes / GiB:.2f} GiB, \"{p.refusal}\" | refusal predicted | "
               f"{_link(m.LLM_D)} |")
    spec = m._spec("deepseek-ai/DeepSeek-V2-Lite-Chat")
    groups = kv.kv_groups(spec, ["full_attention"] * spec.num_layers, kv.page_bytes(spec, 1, 2, 16))
    need = kv.request_kv_bytes(groups, 32768, 8192, 16) / GiB
    out.append(f"| deepseek-ai/DeepSeek-V2-Lite-Chat | MLA: KV of one 32,768-token request | 0.95 GiB | "
               f"{need:.3f} GiB | {(need / 0.95 - 1) * 100:+.2f}% (0.95 is rounded) | "
               f"{_link('https://github.com/vllm-project/vllm/issues/15871')} |")
    return out


def main() -> int:
    m = load_test_module("test_vllm_accuracy")
    print("| model | check | vLLM logged | planned | error | source |")
    print("|---|---|---|---|---|---|")
    for line in rows(m):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
