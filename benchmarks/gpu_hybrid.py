"""Measure plain transformers ``generate`` on layer families the generic planner claims, outside tests/archs.py, each
at two lengths, beside the plan of the same case made on the same machine (the same transformers version: the
reference PyTorch paths of the Mamba-2 scan differ between versions).

The default set: pure Mamba-2 (Mamba-Codestral's dimensions, 12 of its 64 layers; eager attention, the class refuses
SDPA) and three 2025 architectures: an MoE with shared experts (ERNIE-4.5-21B-A3B, 4 of its 28 layers), full
attention with NoPE layers (SmolLM3-3B, whole), sliding and full attention 3:1 (EXAONE-4.0-32B's dimensions, one
period of 4 layers). Also selectable: the parallel hybrid (Falcon-H1), Mamba-2 1.3B, short convolutions beside
attention (LFM2) and Qwen1.5-MoE (``--archs``).

Random weights (memory does not depend on their values) in the published models' dimensions (the "source" of each
config). Without ``mamba_ssm`` and ``causal_conv1d`` installed, transformers runs its reference PyTorch paths, and so
do these measurements: each record says which (``kernels``), and the plans follow the packages installed there
(``kernels='installed'``). Every case runs under a per-process cap (``--cap-gib``, default 60); one that runs out of
memory under it is recorded as such (peak at the failure). The plans are made in worker processes (their configs
only, no weights) while the GPU measures, with ``freed_before=True``: the measuring process has given a model's
memory back to CUDA before every case (each checkpoint is built on the GPU, then freed); each record says whether it
had (``process_freed``). ``--fresh``: the checkpoint is built by another process, this one only loads it (a user's
process), and the plans say ``freed_before=False``.

    python3 benchmarks/gpu_hybrid.py --out-dir benchmarks/results/h200_hybrid            # on the GPU machine
    python3 benchmarks/gpu_hybrid.py --out-dir /tmp/hybrid_smoke --tiny                  # CPU: plans only, tiny dims

Output: ``<out-dir>/gpu_hybrid.jsonl`` (one JSON object a line: ``versions``, ``loaded``, ``gen``);
``benchmarks/compare_hybrid.py`` computes the plan's error from it.
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
from benchmarks.common import emit, save_random

GiB = 2**30

CONFIGS = {
    "falcon-h1-1.5b-deep": {"source": "tiiuae/Falcon-H1-1.5B-Deep-Instruct", "model_type": "falcon_h1",
                            "hidden_size": 1280, "num_hidden_layers": 66, "num_attention_heads": 6,
                            "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 3072,
                            "mamba_d_ssm": 1536, "mamba_n_heads": 24, "mamba_d_head": 64, "mamba_d_state": 256,
                            "mamba_n_groups": 1, "mamba_chunk_size": 128, "mamba_d_conv": 4, "mamba_rms_norm": False,
                            "vocab_size": 65537, "max_position_embeddings": 131072, "tie_word_embeddings": False},
    "mamba2-1.3b": {"source": "state-spaces/mamba2-1.3b", "model_type": "mamba2", "hidden_size": 2048,
                    "num_hidden_layers": 48, "state_size": 128, "head_dim": 64, "num_heads": 64, "expand": 2,
                    "n_groups": 1, "chunk_size": 256, "conv_kernel": 4, "vocab_size": 50288,
                    "tie_word_embeddings": True, "attn": "eager"},
    "lfm2-1.2b": {"source": "LiquidAI/LFM2-1.2B", "model_type": "lfm2", "hidden_size": 2048, "num_hidden_layers": 16,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 12288,
                  "layer_types": ["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)],
                  "conv_L_cache": 3, "vocab_size": 65536, "max_position_embeddings": 128000,
                  "tie_word_embeddings": True},
    "qwen1.5-moe-a2.7b": {"source": "Qwen/Qwen1.5-MoE-A2.7B", "model_type": "qwen2_moe", "hidden_size": 2048,
                          "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
                          "intermediate_size": 5632, "moe_intermediate_size": 1408,
                          "shared_expert_intermediate_size": 5632, "num_experts": 60, "num_experts_per_tok": 4,
                          "vocab_size": 151936, "max_position_embeddings": 8192, "tie_word_embeddings": False},
    # pure Mamba-2 in Mamba-Codestral-7B's dimensions (transformers' Mamba2Config defaults are that model's), 12 of
    # its 64 layers: 1.6 B parameters; the class refuses SDPA, so it loads with eager attention
    "mamba-codestral-12l": {"source": "mistralai/Mamba-Codestral-7B-v0.1 (12 of 64 layers)", "model_type": "mamba2",
                            "attn": "eager", "hidden_size": 4096, "num_hidden_layers": 12, "state_size": 128,
                            "head_dim": 64, "num_heads": 128, "expand": 2, "n_groups": 8, "chunk_size": 256,
                            "conv_kernel": 4, "vocab_size": 32768, "tie_word_embeddings": False},
    # an MoE with shared experts beside 64 routed ones (2025), the dense first layer and 3 MoE layers of 28
    "ernie4.5-21b-a3b-4l": {"source": "baidu/ERNIE-4.5-21B-A3B-PT (4 of 28 layers)", "model_type": "ernie4_5_moe",
                            "hidden_size": 2560, "intermediate_size": 12288, "num_hidden_layers": 4,
                            "num_attention_heads": 20, "num_key_value_heads": 4, "moe_intermediate_size": 1536,
                            "moe_k": 6, "moe_num_experts": 64, "moe_num_shared_experts": 2, "moe_layer_start_index": 1,
                            "moe_layer_end_index": 3, "moe_layer_interval": 1, "vocab_size": 103424,
                            "max_position_embeddings": 131072, "tie_word_embeddings": True},
    # full attention with RoPE left out of every 4th layer (2025), the whole 3 B model
    "smollm3-3b": {"source": "HuggingFaceTB/SmolLM3-3B", "model_type": "smollm3", "hidden_size": 2048,
                   "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
                   "num_key_value_heads": 4, "no_rope_layer_interval": 4, "vocab_size": 128256,
                   "max_position_embeddings": 65536, "tie_word_embeddings": True},
    # 3 sliding-window (4,096) layers to 1 full-attention layer (2025), one period of EXAONE-4.0-32B's 64 layers
    "exaone4-32b-4l": {"source": "LGAI-EXAONE/EXAONE-4.0-32B (4 of 64 layers)", "model_type": "exaone4",
                       "hidden_size": 5120, "intermediate_size": 27392, "num_hidden_layers": 4,
                       "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "sliding_window": 4096,
                       "layer_types": ["sliding_attention"] * 3 + ["full_attention"], "vocab_size": 102400,
                       "max_position_embeddings": 131072, "tie_word_embeddings": False},
    # chunked attention (8,192-token chunks) with one full-attention NoPE layer, top-1 MoE over 16 experts and a
    # shared expert (2025): Llama-4-Scout's text model (transformers' Llama4TextConfig defaults), 2 of its 48 layers
    "llama4-scout-2l": {"source": "meta-llama/Llama-4-Scout-17B-16E (text, 2 of 48 layers)",
                        "model_type": "llama4_text", "num_hidden_layers": 2,
                        "layer_types": ["chunked_attention", "full_attention"], "no_rope_layers": [1, 0],
                        "moe_layers": [0, 1], "attention_chunk_size": 8192, "vocab_size": 202048,
                        "tie_word_embeddings": False},
    # gated DeltaNet linear attention 3:1 with full attention, 512 experts top 10 and a shared expert (2025):
    # Qwen3-Next-80B-A3B (transformers' Qwen3NextConfig defaults), one period of 4 of its 48 layers
    "qwen3-next-4l": {"source": "Qwen/Qwen3-Next-80B-A3B-Instruct (4 of 48 layers)", "model_type": "qwen3_next",
                      "num_hidden_layers": 4,
                      "layer_types": ["linear_attention"] * 3 + ["full_attention"], "vocab_size": 151936,
                      "tie_word_embeddings": False},
}
DEFAULT_ARCHS = ["mamba-codestral-12l", "ernie4.5-21b-a3b-4l", "smollm3-3b", "exaone4-32b-4l"]

# (architecture, quantization, prompt tokens, new tokens): the two Falcon-H1 runs a plan missed by 3x to 7x, then
# each other family at two lengths (Mamba-2's reference scan on transformers 5.17 holds float32 products of tokens x
# chunk x heads x d_state: ~16.8 MB a token at Codestral's 128 heads); EXAONE's lengths span its 4,096-token window
CASES = [
    ("falcon-h1-1.5b-deep", "bf16", 4096, 64), ("falcon-h1-1.5b-deep", "nf4", 8192, 32),
    ("mamba2-1.3b", "bf16", 1024, 32), ("mamba2-1.3b", "bf16", 2048, 32),
    ("lfm2-1.2b", "bf16", 4096, 32), ("lfm2-1.2b", "bf16", 8192, 32),
    ("qwen1.5-moe-a2.7b", "bf16", 2048, 32), ("qwen1.5-moe-a2.7b", "bf16", 4096, 32),
    ("mamba-codestral-12l", "bf16", 512, 32), ("mamba-codestral-12l", "bf16", 1024, 32),
    ("ernie4.5-21b-a3b-4l", "bf16", 4096, 32), ("ernie4.5-21b-a3b-4l", "bf16", 8192, 32),
    ("smollm3-3b", "bf16", 8192, 32), ("smollm3-3b", "bf16", 16384, 32),
    ("exaone4-32b-4l", "bf16", 2048, 32), ("exaone4-32b-4l", "bf16", 8192, 32),
    ("llama4-scout-2l", "bf16", 4096, 32), ("llama4-scout-2l", "bf16", 16384, 32),
    ("qwen3-next-4l", "bf16", 2048, 32), ("qwen3-next-4l", "bf16", 8192, 32),
    # where the forward outgrows the holes a MoE's load leaves reserved (experts stacked at load)
    ("qwen3-next-4l", "bf16", 32768, 32), ("ernie4.5-21b-a3b-4l", "bf16", 32768, 32),
    ("qwen1.5-moe-a2.7b", "bf16", 16384, 32),
    # ERNIE where its forward's largest tensors pass the load's largest hole (503 MB), Qwen3-Next between
    ("ernie4.5-21b-a3b-4l", "bf16", 16384, 32), ("qwen3-next-4l", "bf16", 16384, 32),
]

# --tiny: the same architectures at a few layers and small widths (a CPU check that configs build and plan)
TINY = {"hidden_size": 64, "intermediate_size": 128, "head_dim": 16, "num_attention_heads": 4,
        "num_key_value_heads": 2, "mamba_d_ssm": 64, "mamba_n_heads": 8, "mamba_d_head": 8, "mamba_d_state": 16,
        "mamba_chunk_size": 16, "state_size": 16, "num_heads": 8, "chunk_size": 16, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 256,
        "moe_num_experts": 4, "moe_k": 2, "sliding_window": 16, "n_groups": 1}


def config_fields(arch: str, tiny: bool) -> dict:
    """config.json fields of ``arch`` (without source and model_type); ``tiny``: scaled down to 4 layers."""
    fields = {k: v for k, v in CONFIGS[arch].items() if k not in ("source", "model_type", "attn")}
    if tiny:
        fields.update({k: v for k, v in TINY.items() if k in fields})
        if CONFIGS[arch]["model_type"] == "mamba2":
            fields["head_dim"] = 16  # hidden 64 x expand 2 = 8 heads x 16
        if "layer_types" in fields:
            fields["layer_types"] = fields["layer_types"][:4]
        if "moe_layer_end_index" in fields:
            fields["moe_layer_end_index"] = 3
        fields["num_hidden_layers"] = 4
        fields["pad_token_id"] = 0  # a class default beyond the tiny vocabulary (SmolLM3's 128,004)
    return fields


def kernels() -> dict:
    """Whether the packages whose kernels transformers binds in place of its reference paths are installed."""
    import importlib.util
    return {p: importlib.util.find_spec(p) is not None for p in ("mamba_ssm", "causal_conv1d", "fla")}


def attn_of(arch: str) -> str:
    """The attention implementation ``arch`` loads and is planned with (SDPA unless its class refuses it)."""
    return CONFIGS[arch].get("attn", "sdpa")


def planned(path: str, quant: str, prompt: int, new: int, cap_bytes: int, attn: str = "sdpa",
            freed_before: bool | None = None) -> dict:
    """The plan of the case against a card of ``cap_bytes`` (no solving) on the kernel path installed here, and how
    long it took."""
    from vramguard import Settings, plan
    from vramguard.catalog.gpus import GpuSpec
    t0 = time.perf_counter()
    card = GpuSpec("cap", "capped H200", cap_bytes, (9, 0), 0)
    p = plan(path, Settings(quant=quant, attn=attn, prompt_tokens=prompt, max_new_tokens=new, kernels="installed"),
             gpus=[card], solve=False, freed_before=freed_before)
    e = p.estimate
    return {"plan_weights": e.weights.total_bytes, "plan_peak": e.peak_allocated_bytes,
            "plan_reserved": e.peak_reserved_bytes, "plan_kv": e.kv_full.gpu_bytes,
            "plan_device": e.device_used_bytes, "plan_fits": p.cards[0].fits, "plan_phase": e.peak_phase,
            "plan_unverified": p.cards[0].unverified, "plan_freed_before": freed_before,
            "plan_kernel_path": None if p.kernel_path is None else p.kernel_path.why,
            "plan_findings": [f.code for f in p.findings], "plan_secs": round(time.perf_counter() - t0, 2)}


def _plan_case(config_dir: str, arch: str, quant: str, prompt: int, new: int, cap: int, freed: bool = True) -> dict:
    """:func:`planned` in a worker process (``freed_before``: ``freed``, True unless ``--fresh``: see the module
    docstring); its error as a field."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        return planned(config_dir, quant, prompt, new, cap, attn_of(arch), freed_before=freed)
    except Exception as e:  # noqa: BLE001 - the measurement is kept; the record says why the plan is missing
        return {"plan_error": repr(e)[:800]}


def plans_in_background(args, archs: list[str], cap: int) -> dict:
    """Each case's plan, started now in ``--plan-workers`` processes (configs only) while the GPU measures: a
    future per (arch, quant, prompt, new)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from transformers import AutoConfig
    pool = ProcessPoolExecutor(args.plan_workers, mp_context=multiprocessing.get_context("spawn"))
    futures = {}
    for arch in archs:
        folder = os.path.join(args.ckpt_dir, arch + "-config")
        AutoConfig.for_model(CONFIGS[arch]["model_type"], **config_fields(arch, False)).save_pretrained(folder)
        for case in (c for c in args.cases if c[0] == arch):
            futures[case] = pool.submit(_plan_case, folder, *case, cap, not args.fresh)
    args.pool = pool
    return futures


def measure(args, arch: str, cases: list, plans: dict) -> None:
    """Build ``arch``, load it in each quantization its cases ask for, and run each case (its plan beside it)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from benchmarks.gpu_matrix import run_case, tensor_breakdown
    from vramguard.plan.allocator import process_freed_memory
    path = os.path.join(args.ckpt_dir, arch)
    t0 = time.perf_counter()
    if args.fresh:  # built and saved by another process: this one only loads it, as a user's does
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as builder:
            builder.submit(save_random, CONFIGS[arch]["model_type"], config_fields(arch, False), path).result()
    else:
        save_random(CONFIGS[arch]["model_type"], config_fields(arch, False), path)
    emit(args.out, {"kind": "checkpoint", "model": arch, "secs": round(time.perf_counter() - t0, 1)})
    total, cap = torch.cuda.mem_get_info()[1], int(args.cap_gib * GiB)
    vocab, attn = CONFIGS[arch]["vocab_size"], attn_of(arch)
    for quant in dict.fromkeys(q for _, q, _, _ in cases):
        kw = {}
        if quant == "nf4":
            kw["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=torch.bfloat16)
        torch.cuda.set_per_process_memory_fraction(1.0)
        before = torch.cuda.memory_allocated()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda:0",
                                                     attn_implementation=attn, **kw).eval()
        weights = torch.cuda.memory_allocated() - before
        emit(args.out, {"kind": "loaded", "model": arch, "quant": quant, "weights_bytes": weights,
                        "breakdown": tensor_breakdown(model)})
        model.generate(torch.randint(100, 1000, (1, 16)).cuda(), max_new_tokens=2, min_new_tokens=2,
                       do_sample=False, pad_token_id=0)
        for case in cases:
            if case[1] != quant:
                continue
            freed = process_freed_memory()
            torch.cuda.set_per_process_memory_fraction(cap / total)
            trace = os.path.join(args.out_dir, f"trace_{arch}_{quant}_{case[2]}.json.gz") if args.trace else None
            rec = run_case(model, vocab, 1, case[2], case[3], trace_path=trace)
            t_wait = time.perf_counter()
            try:
                pl = plans[case].result() if case in plans else {}
            except Exception as e:  # noqa: BLE001 - a worker that died: the measurement is kept
                pl = {"plan_error": repr(e)[:800]}
            rec.update(kind="gen", model=arch, quant=quant, attn=attn, weights=weights, cap=cap, process_freed=freed,
                       plan_wait_secs=round(time.perf_counter() - t_wait, 2), **pl)
            emit(args.out, rec)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    shutil.rmtree(path, ignore_errors=True)


def smoke(args) -> None:
    """``--tiny``: build each architecture small on the CPU, save it and plan every case at a tenth of its length."""
    for arch in args.archs:
        path = os.path.join(args.ckpt_dir, arch + "-tiny")
        save_random(CONFIGS[arch]["model_type"], config_fields(arch, True), path)
        for a, quant, prompt, new in CASES:
            if a == arch:
                emit(args.out, {"kind": "plan", "model": arch, "quant": quant, "prompt": prompt // 16, "new": new,
                                **planned(path, quant, prompt // 16, new, int(args.cap_gib * GiB), attn_of(arch))})
        shutil.rmtree(path, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", required=True, help="folder for gpu_hybrid.jsonl")
    ap.add_argument("--archs", nargs="+", default=DEFAULT_ARCHS, choices=list(CONFIGS))
    ap.add_argument("--cap-gib", type=float, default=60.0)
    ap.add_argument("--ckpt-dir", default="/dev/shm/vg_hybrid")
    ap.add_argument("--plan-workers", type=int, default=6, help="processes planning while the GPU measures")
    ap.add_argument("--no-plan", action="store_true", help="measure only (plan later with compare_hybrid.py)")
    ap.add_argument("--tiny", action="store_true", help="CPU check: tiny dimensions, plans only")
    ap.add_argument("--fresh", action="store_true",
                    help="each checkpoint built in another process: this one loads it from disk, freeing nothing "
                         "before its first case, and plans with freed_before=False (one architecture a run)")
    ap.add_argument("--quants", nargs="+", default=["bf16", "nf4"],
                    help="only the cases in these formats (nf4 alone: a fresh process, no bf16 run before it)")
    ap.add_argument("--prompts", nargs="+", type=int, help="only the cases of these prompt lengths")
    ap.add_argument("--trace", action="store_true",
                    help="record each case's allocator trace (large pool, from the segments at its start) beside "
                         "the records: trace_<arch>_<quant>_<prompt>.json.gz, as benchmarks/replay_trace.py reads")
    args = ap.parse_args()
    args.cases = [c for c in CASES if c[1] in args.quants and (not args.prompts or c[2] in args.prompts)]
    os.makedirs(args.out_dir, exist_ok=True)
    args.out = os.path.join(args.out_dir, "gpu_hybrid.jsonl")
    import transformers
    missing = [a for a in args.archs if CONFIGS[a]["model_type"] not in transformers.CONFIG_MAPPING]
    emit(args.out, {"kind": "versions", "torch": torch.__version__, "transformers": transformers.__version__,
                    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                    "kernels": kernels(), "model_types_missing": missing})
    args.archs = [a for a in args.archs if a not in missing]
    if args.tiny or not torch.cuda.is_available():
        smoke(args)
        return
    t0 = time.perf_counter()
    plans = {} if args.no_plan else plans_in_background(args, args.archs, int(args.cap_gib * GiB))
    for arch in args.archs:
        try:
            measure(args, arch, [c for c in args.cases if c[0] == arch], plans)
        except Exception as e:  # noqa: BLE001 - keep measuring the others; the record says what failed
            emit(args.out, {"kind": "arch_error", "model": arch, "err": repr(e)[:800]})
            shutil.rmtree(os.path.join(args.ckpt_dir, arch), ignore_errors=True)
        gc.collect()
        torch.cuda.empty_cache()
    if plans:
        args.pool.shutdown(cancel_futures=True)
    emit(args.out, {"kind": "done", "secs": round(time.perf_counter() - t0, 1)})


if __name__ == "__main__":
    main()
