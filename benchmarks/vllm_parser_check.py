"""Parse the `vllm serve` lines `vramguard export --to vllm` writes with vLLM's own argument parser and EngineArgs.

Needs vLLM installed (not a vramguard dependency); on a machine without a GPU, run with VLLM_TARGET_DEVICE=cpu:
    VLLM_TARGET_DEVICE=cpu python benchmarks/vllm_parser_check.py
"""

import shlex

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.common.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

from vramguard.engines.vllm import VllmSettings, plan_vllm
from vramguard.export import export
from vramguard.hardware import gpu_from_catalog
from vramguard.resolve import resolve_model

CASES = [("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct", "h100",
          VllmSettings(max_model_len=16384, tensor_parallel_size=2, kv_cache_dtype="fp8")),
         ("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", "l40s",
          VllmSettings(max_model_len=32768, pipeline_parallel_size=2, enforce_eager=True,
                       hybrid_kv_cache_manager=False, kv_offloading_size_bytes=16 * 2**30)),
         ("gemma-2-9b", "google/gemma-2-9b-it", "rtx-4090", VllmSettings(max_model_len=8192))]

if __name__ == "__main__":
    import vllm
    print("vLLM", vllm.__version__)
    for model, ref, card, s in CASES:
        line = export(plan_vllm(resolve_model(model), gpu_from_catalog(card), s), ref, "vllm")
        ns = make_arg_parser(FlexibleArgumentParser()).parse_args(shlex.split(line)[2:])
        ea = AsyncEngineArgs.from_cli_args(ns)
        print(line)
        print(f"  -> EngineArgs: model={ns.model_tag} tp={ea.tensor_parallel_size} pp={ea.pipeline_parallel_size} "
              f"max_model_len={ea.max_model_len} gpu_memory_utilization={ea.gpu_memory_utilization} "
              f"kv_cache_dtype={ea.kv_cache_dtype} max_num_seqs={ea.max_num_seqs} "
              f"max_num_batched_tokens={ea.max_num_batched_tokens} enforce_eager={ea.enforce_eager} "
              f"kv_offloading_size={ea.kv_offloading_size}")
