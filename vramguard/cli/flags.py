"""The one table from the library's words to the CLI's: a library field (``chunk_tokens``) to the option that
sets it (``--chunk-tokens``), a keyword argument and value with no option of the same name (``chat=False`` ->
``--raw``), a library object to the command that lists it. The library names its parameters; the CLI renders
every library text it prints through :func:`as_flags`."""

from __future__ import annotations

import re

# library field name -> the CLI option that sets it ("MODEL": the argument)
FIELD_FLAGS = {"batch": "--batch", "num_beams": "--num-beams", "num_return_sequences": "--num-return-sequences",
               "prompt_tokens": "--prompt-tokens", "max_new_tokens": "--max-new-tokens",
               "prefill_chunk": "--prefill-chunk", "kv_dtype": "--kv-dtype", "compute_dtype": "--compute-dtype",
               "dtype": "--dtype", "quant": "--quant", "attn": "--attn", "cache": "--cache", "context": "--context",
               "max_cache_len": "--max-cache-len", "temperature": "--temperature", "top_p": "--top-p",
               "top_k": "--top-k", "max_queue": "--max-queue", "max_running": "--max-running",
               "max_batch_tokens": "--max-batch-tokens", "page_size": "--page-size", "n_max": "--n-max",
               "default_max_tokens": "--default-max-tokens", "max_kv_blocks": "--max-kv-blocks", "gpus": "--gpus",
               "vram_budget": "--vram-budget", "port": "--port", "host": "--host", "model": "MODEL",
               "revision": "--revision", "tp": "--tp", "device_map": "--device-map", "max_memory": "--max-memory",
               "budget_bytes": "--vram-budget", "vary": "--vary", "since": "--since", "year": "--year",
               "file": "--file", "chat": "--chat-template", "prompt": "--prompt", "chunk_tokens": "--chunk-tokens",
               "files": "--context", "gpu": "--gpu", "vram": "--vram", "gpu/vram": "--gpu/--vram",
               "do_sample": "--do-sample", "alloc_conf": "--alloc-conf", "seed": "--seed", "api_key": "--api-key",
               "allowed_hosts": "--allowed-host",
               "greedy": "--greedy", "summarize": "--summarize", "auto": "--auto",
               "ignore_eos": "--ignore-eos", "kernels": "--kernels",
               # vLLM's engine arguments (plan --engine vllm, export)
               "tensor_parallel_size": "--tp", "pipeline_parallel_size": "--pp",
               "gpu_memory_utilization": "--gpu-memory-utilization", "max_model_len": "--max-model-len",
               "max_num_seqs": "--max-num-seqs", "max_num_batched_tokens": "--max-num-batched-tokens",
               "kv_cache_dtype": "--kv-cache-dtype", "replicas": "--replicas",
               "kv_offloading_size_bytes": "--kv-offload", "vllm_version": "--vllm-version",
               "max_lora_rank": "--max-lora-rank", "max_loras": "--max-loras"}
# a library keyword argument and value -> the CLI's words for it, where no option of that name takes the value
KWARG_FLAGS = {"chat=None": "no --chat-template", "chat=False": "--raw", "do_sample=True": "--do-sample",
               "greedy=True": "--greedy", "summarize=True": "--summarize", "auto=True": "--auto",
               "ignore_eos=True": "--ignore-eos"}
# a library object -> the command that shows it
OBJECT_COMMANDS = {"vramguard.catalog.models.MODELS": "vramguard plan --list-models",
                   "vramguard.catalog.gpus.GPUS": "vramguard plan --list-gpus"}
# keyword arguments of from_pretrained that library texts name as such, never as vramguard's options of that name
FROM_PRETRAINED_KWARGS = ("device_map", "max_memory")
_KWARG = re.compile(r"(?<![\w.-])([a-z_]+)=('[^']*'|[\w.\-/]+)")
_BARE = re.compile(r"(?<![\w.-])([a-z_]+)=(?=[\s,;:)]|$)")
# library arguments a fix names as a word, without a value ("leave alloc_conf out"): the CLI says the option
_WORDS = re.compile(r"(?<![\w.-])(alloc_conf)\b(?!=)")


def as_flags(text: str | None) -> str | None:
    """A library message in the CLI's words: each ``field=value`` of a known field becomes its option,
    ``chunk_tokens=200`` -> ``--chunk-tokens 200``, ``file='-'`` -> ``--file -``, ``chat=False`` -> ``--raw``; a
    bare ``vram_budget=`` (the parameter, no value) -> ``--vram-budget``; a Python value (``dtype=torch.float16``)
    and from_pretrained's own ``device_map=`` / ``max_memory=`` stay as written; a bare ``alloc_conf`` ->
    ``--alloc-conf``; a library object becomes the command that lists it. A line indented by 4 spaces is code
    and stays as written."""
    def flag(m: re.Match) -> str:
        name, value = m.group(1), m.group(2).strip("'")
        if f"{name}={value}" in KWARG_FLAGS:
            return KWARG_FLAGS[f"{name}={value}"]
        opt = FIELD_FLAGS.get(name)
        if opt is None or not opt.startswith("--") or value.startswith("torch.") or name in FROM_PRETRAINED_KWARGS:
            return m.group(0)
        return f"{opt} {value}"

    def bare(m: re.Match) -> str:
        opt = FIELD_FLAGS.get(m.group(1))
        keep = opt is None or not opt.startswith("--") or m.group(1) in FROM_PRETRAINED_KWARGS
        return m.group(0) if keep else opt
    if text is None:
        return None
    if "\n    " in text or text.startswith("    "):  # a line of code (indented by 4 spaces) stays as written
        return "\n".join(line if line.startswith("    ") else as_flags(line) for line in text.split("\n"))
    for obj, command in OBJECT_COMMANDS.items():
        text = text.replace(obj, command)
    return _WORDS.sub(lambda m: FIELD_FLAGS[m.group(1)], _BARE.sub(bare, _KWARG.sub(flag, text)))
