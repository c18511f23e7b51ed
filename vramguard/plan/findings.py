"""Findings of a plan: settings that will fail, waste memory or silently change what runs, with the bytes at
stake and the fix. Each finding is computed from the plan's own numbers (never a canned figure)."""

from __future__ import annotations

from vramguard.hub.prequant import uses_headers
from vramguard.memory.forward import eager_bytes_per_score, logits_bytes
from vramguard.memory.kv import SCALE_ZERO_BYTES
from vramguard.memory.model import MemoryModel
from vramguard.memory.runtime import CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES
from vramguard.plan.estimator import Finding, Plan
from vramguard.plan.rules import attention_map_bytes, dequantized_weight_bytes
from vramguard.settings import DTYPE_BYTES, KV_BITS
from vramguard.units import fmt_bytes, fmt_gib


def plan_findings(p: Plan, model: MemoryModel) -> list[Finding]:
    """All findings for plan ``p`` of ``model`` (see the module docstring), the model's own among them
    (:meth:`~vramguard.memory.model.MemoryModel.findings`)."""
    spec, s, est = p.model, p.settings, p.estimate
    weight_bytes = model.weight_bytes
    out: list[Finding] = [Finding("model_note", "info", n) for n in spec.notes]
    out += _head_findings(spec.config_dict())
    if spec.checkpoint_dtype == "fp32" and s.dtype is None and s.act_dtype != "fp32":
        f32 = weight_bytes(s.with_(quant="fp32" if s.quant in ("bf16", "fp16") else s.quant,
                                   dtype="fp32")).total_bytes
        out.append(Finding("checkpoint_fp32", "warn", f"the checkpoint's config says float32: this plan assumes "
                           f"dtype={s.act_dtype} is passed to from_pretrained; without it transformers 5 loads "
                           f"float32 (weights {fmt_bytes(f32)} against {fmt_bytes(est.weights.total_bytes)})",
                           f"pass dtype=torch.{'bfloat16' if s.act_dtype == 'bf16' else 'float16'}",
                           f32 - est.weights.total_bytes))
    half = s.with_(quant="bf16" if s.quant == "fp32" else s.quant, dtype="bf16")
    if s.attn == "flash_attention_2" and s.act_dtype == "fp32":
        f32 = est.weights.total_bytes
        b16 = weight_bytes(half).total_bytes
        out.append(Finding("fa2_needs_half", "fail",
                           "flash_attention_2 runs only in float16/bfloat16, and the parameters resolve to float32 "
                           f"(weights {fmt_bytes(f32)} in float32 against {fmt_bytes(b16)} in bfloat16)",
                           "pass dtype=torch.bfloat16 to from_pretrained (torch.float16 below compute capability 8.0)",
                           f32 - b16))
    elif s.act_dtype == "fp32":
        f32 = est.weights.total_bytes
        b16 = weight_bytes(half).total_bytes
        out.append(Finding("fp32_params", "warn", f"parameters in float32: weights {fmt_bytes(f32)} against "
                           f"{fmt_bytes(b16)} in bfloat16", "pass dtype=torch.bfloat16", f32 - b16))
    out.extend(model.findings(s))
    _card_findings(p, out, model)
    _attention_findings(p, out)
    _memory_findings(p, out)
    return out


LM_HEAD_MARKS = ("CausalLM", "LMHead", "ConditionalGeneration")  # in the class names of transformers' models with a
# language-model head (LlamaForCausalLM, GPT2LMHeadModel, ReformerModelWithLMHead, LlavaForConditionalGeneration)


def _head_findings(cfg: dict) -> list[Finding]:
    """A warning when config.json's ``architectures`` names only classes without a language-model head
    (``BertModel``, ``...ForSequenceClassification``): ``AutoModelForCausalLM`` then builds the head newly
    initialized, so the memory holds but the text is noise. Nothing for a config with ``auto_map`` (remote code
    names its own classes) or without ``architectures``; ``cfg``: the config.json, parsed."""
    archs = None if cfg.get("auto_map") else cfg.get("architectures")
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        return []
    if any(mark in a for a in archs for mark in LM_HEAD_MARKS):
        return []
    return [Finding("no_lm_head", "warn", f"config.json's architectures names {', '.join(archs)}: a checkpoint "
                    "without a language-model head; AutoModelForCausalLM, which generate loads, adds one newly "
                    "initialized, so the memory planned holds but the text generated is noise",
                    "plan the model's causal-LM checkpoint (architectures naming a ...ForCausalLM class)")]


def _card_findings(p: Plan, out: list, model: MemoryModel) -> None:
    """Weights larger than a card; settings the cards cannot run (FA2, bf16 below compute capability 8.0) and
    the compute dtype."""
    s, est = p.settings, p.estimate
    floor = est.weights.total_bytes + CUBLAS_WORKSPACE_BYTES + CUDA_CONTEXT_BYTES
    for card in p.cards:
        if floor > card.usable_bytes:
            out.append(Finding("weights_exceed_card", "fail",
                               f"the weights alone ({fmt_gib(est.weights.total_bytes)}, plus "
                               f"{fmt_gib(CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES)} of CUDA context and "
                               f"workspace) exceed {card.gpu.label} ({fmt_gib(card.usable_bytes)} usable): no "
                               "prompt, batch or KV setting can fit",
                               "a card with more memory, several GPUs (load_model splits with max_memory), a "
                               "smaller quantization" + (" (NF4)" if not s.is_4bit else "") + ", or a smaller model",
                               floor - card.usable_bytes))
    for card in p.cards:
        cc = card.gpu.compute_capability
        if cc is None or card.gpu.supports_flash_attn2:
            continue
        ccs = f"{cc[0]}.{cc[1]}"
        if s.attn == "flash_attention_2":
            out.append(Finding("fa2_compute_capability", "fail",
                               f"FlashAttention-2 needs compute capability >= 8.0; {card.gpu.label} has {ccs}",
                               "use attn_implementation='sdpa'"))
        if "bf16" in (s.act_dtype, s.resolved_compute_dtype) and not card.gpu.supports_bf16:
            out.append(Finding("bf16_not_native", "warn",
                               f"bfloat16 is not native below compute capability 8.0 ({card.gpu.label}: {ccs})",
                               "use float16 compute (bnb_4bit_compute_dtype=torch.float16, dtype=torch.float16)"))
    if s.is_4bit and s.resolved_compute_dtype != s.act_dtype:
        big, wide, narrow = dequantized_weight_bytes(model, s.resolved_compute_dtype, s.act_dtype)
        out.append(Finding("compute_dtype_mismatch", "warn",
                           f"4-bit compute dtype {s.resolved_compute_dtype} differs from the activation dtype "
                           f"{s.act_dtype}: every linear casts its input and dequantizes to "
                           f"{s.resolved_compute_dtype} (slow path, more memory): the largest dequantized weight "
                           f"({big.out_features} x {big.in_features}) is {fmt_bytes(wide)} against "
                           f"{fmt_bytes(narrow)}", f"set bnb_4bit_compute_dtype to {s.act_dtype}", wide - narrow))


def _attention_findings(p: Plan, out: list) -> None:
    """Attention paths that materialize scores or cannot run."""
    spec, s, est = p.model, p.settings, p.estimate
    if s.output_attentions:
        per_layer = attention_map_bytes(spec, s, s.act_dtype)
        out.append(Finding("output_attentions_eager", "warn",
                           "output_attentions=True needs eager attention (transformers' SDPA and flash paths cannot "
                           "return attention maps: older versions switch to eager silently, newer return None). "
                           f"Retained maps: {fmt_bytes(per_layer)} per layer, {fmt_gib(per_layer * spec.num_layers)} "
                           f"over {spec.num_layers} layers, plus a float32 softmax buffer of "
                           f"{fmt_bytes(per_layer * 4 // DTYPE_BYTES[s.act_dtype])} per layer while it runs",
                           "request attention maps only for the layers and lengths you need",
                           per_layer * spec.num_layers))
    if s.effective_attn == "eager" and not s.output_attentions and _has_softmax_attention(p):
        sc = s.sequences * spec.num_heads * s.prompt_tokens * s.prompt_tokens
        scores = fmt_bytes(sc * eager_bytes_per_score(s.act_dtype))
        out.append(Finding("eager_scores", "warn" if sc * 10 > est.weights.total_bytes // 4 else "info",
                           f"eager attention materializes the score matrix: {scores} per layer during prefill",
                           "use attn_implementation='sdpa' or 'flash_attention_2'"))
    if spec.attn_logit_softcapping and s.effective_attn == "sdpa":
        out.append(Finding("sdpa_softcap", "fail", f"{spec.model_type} uses attention logit soft-capping, which SDPA "
                           "does not implement", "use attn_implementation='eager' or 'flash_attention_2'"))


RECURRENT_LAYER_KINDS = frozenset({"linear_attention", "mamba", "conv"})  # transformers' cache layer kinds
# without a score matrix (Mamba/Mamba-2 mixers, linear attention, short convolutions: cache_utils.py)


def _has_softmax_attention(p: Plan) -> bool:
    """Whether some layer of the planned model computes attention scores (False for a pure Mamba-2 model, whose
    layers the plan reports as ``linear_attention`` only: eager attention then changes nothing)."""
    return not p.layer_kinds or not set(p.layer_kinds) <= RECURRENT_LAYER_KINDS


def _times(a: int, b: int) -> str:
    """How ``a`` compares with ``b`` (``a >= b``), in words: "as large as" below twice, else "12.5 times"."""
    if b <= 0 or a < 2 * b:
        return "as large as"
    r = a / b
    return f"{r:,.1f} times" if r < 100 else f"{r:,.0f} times"


def _memory_findings(p: Plan, out: list) -> None:
    """Large KV caches and logits, MoE, pre-quantized checkpoints and sliding windows."""
    spec, s, est = p.model, p.settings, p.estimate
    if est.kv_full.gpu_bytes + est.kv_full.cpu_bytes >= est.weights.total_bytes:
        kv = est.kv_full.gpu_bytes + est.kv_full.cpu_bytes
        out.append(Finding("kv_as_large_as_weights", "warn",
                           f"the KV cache at {s.total_tokens:,} tokens ({fmt_bytes(kv)}) is "
                           f"{_times(kv, est.weights.total_bytes)} the weights ({fmt_bytes(est.weights.total_bytes)})",
                           "quantize the KV cache (kv_dtype=int8/int4) or shorten the context", kv))
    if s.resolved_kv_dtype in ("int8", "int4"):
        packed, extra = KV_BITS[s.resolved_kv_dtype] / 8, SCALE_ZERO_BYTES / s.kv_group_size
        kv = est.kv_full.gpu_bytes + est.kv_full.cpu_bytes
        out.append(Finding("kv_quantized_format", "info",
                           f"{s.resolved_kv_dtype} KV cache ({fmt_bytes(kv)} at {s.total_tokens:,} tokens): "
                           f"{packed:g} B per value plus a 16-bit scale and a 16-bit zero-point per group of "
                           f"{s.kv_group_size} values ({extra:g} B per value, +{100 * extra / packed:.1f}% over the "
                           f"packed values); the last {s.kv_residual_length} tokens stay in 16-bit "
                           "(transformers QuantizedCache)"))
    if s.logits == "all":
        native, fp32 = logits_bytes(spec, s.sequences, s.prompt_tokens, s.act_dtype)
        _, last = logits_bytes(spec, s.sequences, 1, s.act_dtype)
        out.append(Finding("logits_all_positions", "warn",
                           f"logits for all {s.prompt_tokens:,} positions: {fmt_gib(native, 3)} in {s.act_dtype} "
                           f"plus a float32 copy of {fmt_gib(fp32, 3)}, against {fmt_bytes(last)} for the last "
                           "position only", "keep logits for the positions you score (logits_to_keep), or score "
                           "in chunks", native + fp32))
    if spec.is_moe and s.is_bnb and est.weights.dense_linear_bytes:
        dense = est.weights.dense_linear_bytes
        out.append(Finding("moe_experts_16bit", "warn" if dense * 2 > est.weights.total_bytes else "info",
                           f"MoE experts stay in {s.act_dtype} under quant={s.quant}: transformers 5 stores them as "
                           "fused 3-D parameters, which bitsandbytes (nn.Linear only) does not convert; "
                           f"{fmt_gib(dense)} of the {fmt_gib(est.weights.total_bytes)} of weights are these",
                           "plan with the weights in 16-bit in mind (a larger card, several GPUs), or use a "
                           "checkpoint quantized with a method that converts 3-D expert weights", dense))
    if spec.prequantized and s.is_bnb and spec.prequantized != "bitsandbytes":
        own = uses_headers(spec)  # the weights are then the checkpoint's own tensors already
        out.append(Finding("prequantized", "info" if own else "warn", f"the checkpoint is already quantized "
                           f"({spec.prequantized}); quant={s.quant} does not apply to it"
                           + ("; its weights are planned from its headers" if own else ""),
                           None if own else "plan with the checkpoint's own format"))
    if spec.sliding_window and spec.num_sliding_layers:
        out.append(Finding("sliding_window", "info", f"{spec.num_sliding_layers} of {spec.num_layers} layers attend "
                           f"to a window of {spec.sliding_window:,} tokens; their KV cache stops growing there"))
