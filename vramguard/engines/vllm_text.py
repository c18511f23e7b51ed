"""A :class:`~vramguard.engines.vllm.VllmPlan` as text and as JSON (printing apart from computing)."""

from __future__ import annotations

import re
import shlex
import textwrap

from vramguard.engines.vllm import VllmPlan
from vramguard.units import GiB


def _g(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def _command_words(p: VllmPlan, model_ref: str, port: int | None = None) -> list[str]:
    """``[NAME=value ...] vllm serve MODEL`` (the variables of :meth:`VllmPlan.env`) then one shell-quoted
    ``--flag value`` per flag of :meth:`VllmPlan.flags`, then ``--port`` when given."""
    env = [f"{k}={shlex.quote(v)}" for k, v in p.env().items()]
    words = [" ".join(env + [shlex.quote(x) for x in ("vllm", "serve", model_ref)])]
    for flag, value in p.flags().items():
        words.append(f"--{flag}" if value is True else f"--{flag} {shlex.quote(str(value))}")
    return words + ([f"--port {port}"] if port is not None else [])


def serve_command(p: VllmPlan, model_ref: str, port: int | None = None) -> str:
    """``vllm serve MODEL --flag value ...`` with every flag of :meth:`VllmPlan.flags` (shell-quoted), preceded by
    the variables of :meth:`VllmPlan.env`."""
    return " ".join(_command_words(p, model_ref, port))


def command_lines(p: VllmPlan, model_ref: str, width: int, port: int | None = None) -> list[str]:
    """:func:`serve_command` broken into shell lines of at most ``width`` characters (where a flag allows it),
    each but the last ending in `` \\`` and the ones after the first indented: it pastes into a shell as is."""
    lines, cur = [], ""
    for word in _command_words(p, model_ref, port):
        pad = "    " if lines else ""
        if cur and len(pad + cur + " " + word) + 2 > width:
            lines.append(pad + cur)
            cur = word
        else:
            cur = f"{cur} {word}" if cur else word
    lines.append(("    " if lines else "") + cur)
    return [line + " \\" for line in lines[:-1]] + lines[-1:]


def wrapped(lines: list[str], width: int) -> list[str]:
    """Each line folded to ``width`` characters at spaces: a continuation lines up under the line's parenthesis, or
    under the text after its label (the first run of 2 or more spaces), or 2 columns in."""
    out = []
    for line in lines:
        if len(line) <= width:
            out.append(line)
            continue
        lead = len(line) - len(line.lstrip())
        paren, label = line.find("  ("), re.match(r"\s*\S.*?\s{2,}", line)
        hang = (paren + 3 if 0 < paren < width // 2 else
                label.end() if label and label.end() < width // 2 else lead + 2)
        out += textwrap.wrap(line, width, subsequent_indent=" " * hang, break_long_words=False,
                             break_on_hyphens=False)
    return out


def plan_to_json(p: VllmPlan, model_ref: str) -> dict:
    """Raw ints (bytes, tokens) and the flags; ``refusal`` is vLLM's start-up error or null."""
    s = p.settings
    return {
        "engine": "vllm", "model": p.model, "gpu": p.gpu.label, "total_bytes": p.total_bytes,
        "flags": p.flags(), "command": serve_command(p, model_ref),
        "budget": {"gpu_memory_utilization": s.gpu_memory_utilization, "requested_bytes": p.requested_bytes,
                   "free_at_start_bytes": p.free_at_start_bytes},
        "per_gpu": {"weights_bytes": p.weights_bytes, "weights_by_stage_bytes": list(p.weights_by_stage),
                    "activation_bytes": p.activation_bytes, "forward_peak_bytes": p.forward_peak_bytes,
                    "sampler_peak_bytes": p.sampler_peak_bytes, "non_torch_bytes": p.non_torch_bytes,
                    "nccl_bytes": p.nccl_bytes, "cudagraph_bytes": p.cudagraph_bytes,
                    "cudagraph_in_budget": s.cudagraph_in_budget, "nccl_in_budget": s.nccl_in_budget,
                    "sampler": s.sampler, "available_kv_bytes": p.available_kv_bytes, "lora_bytes": p.lora_bytes,
                    "vision_bytes": p.vision_bytes, "encoder_peak_bytes": p.encoder_peak_bytes},
        "weight_format": p.weight_format, "vllm_version": s.vllm_version, "vllm_engine": s.engine,
        "kv_cache": {"groups": [{"kind": g.kind, "num_layers": g.num_layers, "page_bytes": g.page_bytes,
                                 "sliding_window": g.sliding_window} for g in p.kv_groups],
                     "padding_layers": p.padding_layers, "block_size": s.block_size, "num_blocks": p.num_blocks,
                     "kv_tokens": p.kv_tokens, "kv_tokens_by_blocks": p.kv_tokens_by_blocks,
                     "max_model_len": p.max_model_len,
                     "max_concurrency": round(p.max_concurrency, 4), "request_kv_bytes": p.request_kv_bytes,
                     "largest_max_model_len": p.largest_model_len},
        "max_num_seqs": p.max_num_seqs, "max_num_batched_tokens": p.max_num_batched_tokens,
        "starts": p.starts, "refusal": p.refusal, "refused_by": p.refused_by, "notes": list(p.notes),
        "env": p.env(), "fixes": _fixes(p) if p.refusal else [],
        "fit_tensor_parallel_size": p.fit_tp.settings.tensor_parallel_size if p.fit_tp else None,
        "fit_gpu": p.fit_card.gpu.name if p.fit_card else None,
    }


def plan_lines(p: VllmPlan, model_ref: str, width: int | None = None, words=None) -> list[str]:
    """The plan as text: each term of vLLM's budget with where it comes from, then the two log lines, then the
    ``vllm serve`` command; with ``width``, every line fits that many characters (the command as shell lines);
    ``words`` rewrites the fix lines (the CLI: ``field=value`` as its flags)."""
    s = p.settings
    tp, pp = s.tensor_parallel_size, s.pipeline_parallel_size
    graphs = "in the budget (vLLM >= 0.21)" if s.cudagraph_in_budget else "outside the budget"
    lines = [
        (f"vLLM plan for {p.model} on {p.gpu.label} x {tp * pp} (tensor parallel {tp}, pipeline parallel {pp}), "
         f"{p.dtype}, one GPU's share:"),
        (f"  budget        {_g(p.requested_bytes)} = {_g(p.total_bytes)} total x gpu_memory_utilization "
         f"{s.gpu_memory_utilization}"),
        f"  - weights     {_g(p.weights_bytes)}  (sharded per rank, vocabulary padded to 64; 'Model loading took')"
        + (f"; {p.weight_format}" if p.weight_format != "none" else ""),
        (f"  - activation  {_g(p.activation_bytes)}  (profile run: forward of {p.max_num_batched_tokens:,} tokens "
         f"{_g(p.forward_peak_bytes)}, sampler on {min(p.max_num_seqs, p.max_num_batched_tokens):,} requests "
         f"{_g(p.sampler_peak_bytes)}; the larger)"),
        f"  - non-torch   {_g(p.non_torch_bytes)}  (kernels loaded during the profile run)",
    ]
    if p.lora_bytes:
        lines.insert(3, f"      of which {_g(p.lora_bytes)} of LoRA slots (max_loras {s.max_loras} x rank "
                        f"{s.max_lora_rank}, every wrapped linear)")
    if p.vision_bytes:
        lines.insert(3, f"      of which {_g(p.vision_bytes)} of vision encoder and projector (first stage)")
    if p.encoder_peak_bytes:
        lines.insert(-1, f"    vision encoder profile {_g(p.encoder_peak_bytes)} (its largest images; in the "
                         "activation when larger)")
    if p.nccl_bytes:
        if s.nccl_in_budget:
            lines.append(f"  - NCCL        {_g(p.nccl_bytes)}  (NCCL buffers, TP/PP >= 2, in the non-torch term)")
        else:
            lines.append(f"    NCCL        {_g(p.nccl_bytes)}  (NCCL buffers, TP/PP >= 2: allocated before vLLM's "
                         "start snapshot, outside the budget)")
    sign = "-" if s.cudagraph_in_budget else " "
    lines.append(f"  {sign} CUDA graphs {_g(p.cudagraph_bytes)}  ({graphs})")
    if p.available_kv_bytes < 0:  # a size below zero is no size: say by how much the terms above overrun
        lines.append(f"  = KV cache    none: the terms above exceed the budget by {_g(-p.available_kv_bytes)} "
                     "('Available KV cache memory' below zero)")
    else:
        lines.append(f"  = KV cache    {_g(p.available_kv_bytes)}  ('Available KV cache memory')")
    groups = ", ".join(f"{g.num_layers} x {g.kind}" + (f" (window {g.sliding_window:,})" if g.sliding_window else "")
                       for g in p.kv_groups)
    lines.append(f"  KV groups     {len(p.kv_groups)}: {groups}; page {p.kv_groups[0].page_bytes:,} B per layer "
                 f"per block of {s.block_size}; {p.num_blocks:,} blocks" if p.kv_groups else "  no KV cache")
    if p.padding_layers:
        lines.append(f"  padding       {p.padding_layers} layers added to even the groups")
    if p.refused_by != "weights_load":  # vLLM stops while loading: it never gets to log its KV cache
        # vLLM's own words and format (kv_cache_utils: "%s tokens" of f"{n:,}", "%.2fx" without separators), so that
        # its log can be compared line for line
        lines += [
            f"vLLM will log:  GPU KV cache size: {p.kv_tokens:,} tokens",
            (f"                Maximum concurrency for {p.max_model_len:,} tokens per request: "
             f"{p.max_concurrency:.2f}x"),
        ]
    if p.refusal:
        lines.append(f"vLLM will refuse to start: {p.refusal}")
        lines += [words(x) for x in _fixes(p)] if words else _fixes(p)
    lines += [f"note: {n}" for n in p.notes]
    label = "command:" if not p.refusal else "command as planned (vLLM refuses it: apply a fix above first):"
    if width is None:
        return lines + [f"{label} " + serve_command(p, model_ref)]
    return wrapped(lines, width) + [label] + ["  " + x for x in command_lines(p, model_ref, width - 2)]


def _fit_text(alt: VllmPlan, what: str) -> str:
    """``what`` then the weights and KV cache per GPU of the plan ``alt`` (and its longest request when the
    asked one does not fit)."""
    text = (f"{what} ({_g(alt.weights_bytes)} of weights per GPU, {_g(alt.available_kv_bytes)} left for the KV "
            "cache")
    if alt.refused_by == "max_model_len":
        text += f"; with max_model_len={alt.largest_model_len} or less"
    return text + ")"


def _memory_fixes(p: VllmPlan) -> list[str]:
    """The fixes of a plan whose weights, or weights and profile run, leave no KV cache: the parallel size and the
    card that leave room (as found by the planner), a quantized checkpoint, and fewer batched tokens only when the
    activation peak is what is short."""
    s = p.settings
    if p.refused_by in ("weights_load", "weights_budget"):
        head = (f"fix: the weights alone take {_g(max(p.weights_by_stage))} per GPU, above the budget of "
                f"{_g(p.requested_bytes)} ({p.gpu.label} x gpu_memory_utilization {s.gpu_memory_utilization}): ")
    else:
        head = "fix: "
    ways = []
    if p.fit_tp:
        ways.append(_fit_text(p.fit_tp, f"tensor_parallel_size={p.fit_tp.settings.tensor_parallel_size}"))
    ways.append("a quantized checkpoint (8-bit weights take about half, 4-bit about a quarter)")
    if p.fit_card:
        ways.append(_fit_text(p.fit_card, f"a larger card, the catalog's {p.fit_card.gpu.name} "
                                          f"({p.fit_card.gpu.label}, {_g(p.fit_card.total_bytes)})"))
    if p.refused_by == "kv_cache" and p.activation_bytes > -p.available_kv_bytes:
        ways.append(f"max_num_batched_tokens={max(1, p.max_num_batched_tokens // 2)} or less (a smaller profile run)")
    tail = "" if p.fit_card else " (no catalog card holds it at this tensor parallel size)"
    return [head + "; or ".join(ways) + tail]


def _fixes(p: VllmPlan) -> list[str]:
    """The fix lines of a refused plan (``field=value`` in the library's words)."""
    if p.refused_by == "max_model_len_limit":
        return [f"fix: max_model_len={p.model_max_len} or less (the model's max_position_embeddings), or set "
                "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 in the environment to run past the positions the model was "
                "trained on"]
    if p.refused_by in ("weights_load", "weights_budget", "kv_cache"):
        return _memory_fixes(p)
    out = []
    if p.free_at_start_bytes < p.requested_bytes:
        top = p.free_at_start_bytes / p.total_bytes
        out.append(f"fix: gpu_memory_utilization={int(top * 100) / 100:.2f} or less (free at start "
                   f"{_g(p.free_at_start_bytes)} after the CUDA context)")
    else:
        out.append(f"fix: max_model_len={p.largest_model_len} (the longest one request that fits), "
                   f"tensor_parallel_size={2 * p.settings.tensor_parallel_size} or more, or kv_cache_dtype=fp8")
    return out
