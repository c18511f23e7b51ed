"""``fused_step``: one batch-1 decode step of a Llama-style model with bitsandbytes 4-bit weights, as nine kernels
per layer (:mod:`vramguard.run.kernels.fused`) instead of the forty-odd of transformers' forward.

Per layer: residual add + RMSNorm; q, k and v in one 4-bit launch; rotary embedding + the cache write (the layer's
length counter set on the device); split-K decode attention (two kernels); o; residual add + RMSNorm; gate and up
with SiLU times up in one launch; down. Then the final norm and the model's own ``lm_head`` and embedding modules.
The weights are read where bitsandbytes keeps them (nothing is copied) and the rotary table is the model's own
rotary embedding evaluated once at every cache position.

It computes what transformers' ``LlamaDecoderLayer.forward`` computes (``models/llama/modeling_llama.py``), with
the roundings of the activation dtype where transformers rounds; :func:`build` checks every kernel on the model's
own weights against the module it replaces, then one whole step against the unfused step, before it is used.
"""

from __future__ import annotations

import sys

from vramguard.run.kernels import decode_attention, fused, nf4  # modules: the tests reload them interpreted
from vramguard.runtime.device import is_oom

FAMILIES = ("llama", "mistral")  # model types whose decoder layer is exactly the one above
TOLERANCE = 2e-2  # relative (Frobenius) per kernel; bfloat16 rounding of the outputs alone is about 4e-3
STEP_TOLERANCE = 0.1  # relative, the logits of a whole step: 32 layers of bfloat16 rounding against a wrong kernel
ROPE_CHECK_POSITION = 63  # the position the rotary kernel is checked at (a scratch cache of 64 slots)
_PROJ = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
         ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))


def _config_problem(model) -> str | None:
    cfg = model.config
    kind = getattr(cfg, "model_type", None)
    if kind not in FAMILIES:
        return f"model_type {kind!r} (the fused step knows {', '.join(FAMILIES)})"
    if getattr(cfg, "hidden_act", None) not in ("silu", "swish"):
        return f"hidden_act {getattr(cfg, 'hidden_act', None)!r} (the fused MLP is SiLU)"
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        return "projection biases (the fused projections have none)"
    if (getattr(cfg, "pretraining_tp", 1) or 1) != 1:
        return f"pretraining_tp {cfg.pretraining_tp}"
    inner = getattr(model, "model", None)
    if any(getattr(inner, n, None) is None for n in ("embed_tokens", "norm", "rotary_emb", "layers")) or \
            getattr(model, "lm_head", None) is None:
        return "no model.embed_tokens / norm / rotary_emb / layers / lm_head"
    return None


def _layer_problem(layer, cache_layer, dtype) -> str | None:
    for blk, name in _PROJ:
        mod = getattr(getattr(layer, blk, None), name, None)
        qs = getattr(getattr(mod, "weight", None), "quant_state", None)
        if qs is None:
            return f"{blk}.{name} is not a bitsandbytes 4-bit layer"
        if qs.quant_type not in ("nf4", "fp4") or getattr(mod, "bias", None) is not None:
            return f"{blk}.{name}: quant_type {qs.quant_type!r} or a bias"
        if getattr(qs, "packing_format_for_cpu", False):  # bitsandbytes.functional._convert_weight_packed_for_cpu
            return f"{blk}.{name}: bitsandbytes repacked the weight for its CPU kernel (another layout)"
    for n in ("input_layernorm", "post_attention_layernorm"):
        w = getattr(getattr(layer, n, None), "weight", None)
        if w is None or w.dtype != dtype or getattr(getattr(layer, n), "variance_epsilon", None) is None:
            return f"{n}: no RMSNorm weight in the activations' dtype {dtype}"
    for n in ("keys", "values", "cumulative_length"):
        if not hasattr(cache_layer, n):
            return f"the static cache layer has no {n} tensor"
    return None


def fused_support(model, cache) -> tuple[bool, str]:
    """Whether :class:`FusedDecodeStep` can run ``model`` with ``cache`` (a transformers ``StaticCache`` after the
    prefill): (ok, reason). Needs a Llama-style model (:data:`FAMILIES`, SiLU MLP, no biases) whose seven
    projections per layer are bitsandbytes 4-bit layers, RMSNorm weights in the activations' dtype, and static
    cache layers with ``keys``, ``values`` and an on-device ``cumulative_length``."""
    why = _config_problem(model)
    if why:
        return False, why
    inner = model.model
    dtype = inner.embed_tokens.weight.dtype
    if len(cache.layers) != len(inner.layers):
        return False, f"{len(cache.layers)} cache layers for {len(inner.layers)} decoder layers"
    for i, (layer, cl) in enumerate(zip(inner.layers, cache.layers)):
        why = _layer_problem(layer, cl, dtype)
        if why:
            return False, f"layer {i}: {why}"
    return True, "Llama-style layers with 4-bit projections"


class FusedDecodeStep:
    """The decode step described in the module docstring, on ``model``'s modules and ``cache``'s tensors.

    Args:
        model: a model :func:`fused_support` accepts. cache: its ``StaticCache`` (initialised by the prefill).
        max_cache_len: cache length in tokens (the rotary table's rows).

    Calling it with ``ids`` ``[1, 1]`` and ``position`` ``[1, 1]`` (long, on the device; the token is written at
    that slot) returns float32 logits ``[1, vocab]``. Every tensor it reads is fixed, so a CUDA graph can capture it.
    """

    def __init__(self, model, cache, max_cache_len: int):
        import torch

        inner = model.model
        cfg = model.config
        self.model, self.inner = model, inner
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        emb = inner.embed_tokens.weight
        positions = torch.arange(max_cache_len, device=emb.device).view(1, -1)
        cos, sin = inner.rotary_emb(torch.zeros(1, dtype=emb.dtype, device=emb.device), positions)
        self.cos, self.sin = cos.reshape(max_cache_len, -1).contiguous(), sin.reshape(max_cache_len, -1).contiguous()
        first = inner.layers[0].self_attn.q_proj.weight.quant_state
        self.code = nf4.code_table(first.quant_type, emb.device)
        self.layers = []
        for layer, cl in zip(inner.layers, cache.layers):
            a, m = layer.self_attn, layer.mlp
            self.layers.append({
                "ln1": layer.input_layernorm.weight, "eps1": float(layer.input_layernorm.variance_epsilon),
                "ln2": layer.post_attention_layernorm.weight,
                "eps2": float(layer.post_attention_layernorm.variance_epsilon),
                "qkv": [fused.weight_args(a.q_proj), fused.weight_args(a.k_proj), fused.weight_args(a.v_proj)],
                "o": fused.weight_args(a.o_proj), "gate": fused.weight_args(m.gate_proj),
                "up": fused.weight_args(m.up_proj),
                "down": fused.weight_args(m.down_proj), "keys": cl.keys, "values": cl.values,
                "length": cl.cumulative_length,
                "scaling": float(getattr(a, "scaling", cl.keys.shape[-1] ** -0.5))})
        self.norm_w, self.norm_eps = inner.norm.weight, float(inner.norm.variance_epsilon)

    def _matmul(self, x, w):
        scales = (w["absmax"], w["absmax2"], w["code2"], w["offset"]) if "absmax2" in w else (w["absmax"],)
        return nf4.matmul_4bit(x.view(1, -1), w["packed"], w["shape"], w["blocksize"], self.code, *scales)

    def layer(self, i: int, h, res, position):
        """Decoder layer ``i`` on hidden ``h`` and residual ``res`` (None before layer 0; ``[H]`` each): the next
        (``h``, ``res``), whose sum is the layer's output."""
        L = self.layers[i]
        x, res = fused.add_rms_norm(h, res, L["ln1"], L["eps1"])
        qkv = fused.matmul_4bit_segments(x, L["qkv"], self.code)
        q = fused.rope_cache_write(qkv, self.cos, self.sin, position, L["keys"], L["values"], self.heads, self.kv_heads,
                             L["length"])
        o = self._matmul(decode_attention.decode_attention(q, L["keys"], L["values"], position, L["scaling"]), L["o"])
        x, res = fused.add_rms_norm(o.view(-1), res, L["ln2"], L["eps2"])
        return self._matmul(fused.matmul_4bit_glu(x, L["gate"], L["up"], self.code), L["down"]).view(-1), res

    def __call__(self, ids, position):
        p = position.reshape(1)
        h, res = self.inner.embed_tokens(ids).reshape(-1), None
        for i in range(len(self.layers)):
            h, res = self.layer(i, h, res, p)
        x, _ = fused.add_rms_norm(h, res, self.norm_w, self.norm_eps)
        return self.model.lm_head(x.view(1, 1, -1))[:, -1, :].float()

    def set_lengths(self, filled: int) -> None:
        """Set every cache layer's length counter to ``filled`` (after a check step wrote a slot)."""
        for L in self.layers:
            L["length"].fill_(filled)


def _rel(got, want) -> float:
    got, want = got.float().reshape(-1), want.float().reshape(-1)
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _require(what: str, got, want, tol: float = TOLERANCE) -> float:
    err = _rel(got, want)
    if not err < tol:
        raise RuntimeError(f"{what} differs from transformers' modules by {err:.3g} (relative)")
    return err


def check_kernels(step: FusedDecodeStep) -> None:
    """Each fused kernel once on layer 0's own weights against the modules it replaces (bitsandbytes' layers,
    transformers' RMSNorm, SiLU and ``apply_rotary_pos_emb``), for random inputs from a generator of its own.

    Raises:
        RuntimeError: a relative difference of :data:`TOLERANCE` or more (or NaN), or a wrong cache write.
    """
    import torch

    layer, L = step.inner.layers[0], step.layers[0]
    dev, dt = L["ln1"].device, L["ln1"].dtype
    g = torch.Generator(device=dev).manual_seed(0)
    x, r = (torch.randn(L["ln1"].numel(), generator=g, device=dev).to(dt) for _ in range(2))
    got, total = fused.add_rms_norm(x, r, L["ln1"], L["eps1"])
    _require("the fused RMSNorm", got, layer.input_layernorm(r + x))
    _require("the fused residual add", total, r + x)
    a, m = layer.self_attn, layer.mlp
    xv = x.view(1, 1, -1)
    want = torch.cat([a.q_proj(xv), a.k_proj(xv), a.v_proj(xv)], dim=-1).reshape(-1)
    qkv = fused.matmul_4bit_segments(x, L["qkv"], step.code)
    _require("the fused q/k/v projection", qkv, want)
    _require("the fused gate/up (SiLU times up)", fused.matmul_4bit_glu(x, L["gate"], L["up"], step.code),
             m.act_fn(m.gate_proj(xv)) * m.up_proj(xv))
    p = min(ROPE_CHECK_POSITION, step.cos.shape[0] - 1)
    d, hq, hk = L["keys"].shape[-1], step.heads, step.kv_heads
    keys = torch.zeros((1, hk, p + 1, d), dtype=L["keys"].dtype, device=dev)
    values, length = torch.zeros_like(keys), torch.zeros((), dtype=torch.long, device=dev)
    q = fused.rope_cache_write(want, step.cos, step.sin, torch.tensor([p], device=dev), keys, values, hq, hk, length)
    cos, sin = step.cos[p].view(1, 1, 1, d), step.sin[p].view(1, 1, 1, d)
    rope = getattr(sys.modules.get(type(a).__module__), "apply_rotary_pos_emb", None)
    qh, kh = want[: hq * d].view(1, hq, 1, d), want[hq * d:(hq + hk) * d].view(1, hk, 1, d)
    if rope is not None:  # transformers' own function, from the attention module's file
        q_want, k_want = rope(qh, kh, cos[0], sin[0])
    else:
        q_want, k_want = fused.reference_rope(qh, cos, sin), fused.reference_rope(kh, cos, sin)
    _require("the fused rotary embedding (q)", q, q_want)
    _require("the fused rotary embedding (k, written to the cache)", keys[:, :, p:], k_want)
    if int(length) != p + 1 or not torch.equal(values[0, :, p].reshape(-1), want[(hq + hk) * d:]):
        raise RuntimeError(f"the fused cache write put the length at {int(length)} (want {p + 1}) or the values "
                           "elsewhere")


def build(model, cache, max_cache_len: int, filled: int, ids, position, unfused_step
          ) -> tuple[FusedDecodeStep | None, str]:
    """The checked fused step for ``model`` and ``cache`` after a prefill of ``filled`` tokens, or None and the
    reason it is not used. ``ids`` and ``position`` are the decoder's static buffers (set to the next token and to
    ``filled``); ``unfused_step()`` runs the decoder's ordinary step from them and returns its logits. After
    :func:`check_kernels`, one such step and one fused step are compared (:data:`STEP_TOLERANCE`), the length
    counters put back to ``filled`` after each (the slot both wrote is written again by the first real step).
    Returns (step, note): the note gives the step's measured relative difference.

    Raises:
        torch.OutOfMemoryError: from either step (the caller's OOM handling decides).
    """
    ok, why = fused_support(model, cache)
    if not ok:
        return None, f"fused step not used: {why}"
    step = None
    try:
        step = FusedDecodeStep(model, cache, max_cache_len)
        check_kernels(step)
        want = unfused_step()
        step.set_lengths(filled)
        err = _require("the fused step's logits", step(ids, position), want, STEP_TOLERANCE)
        return step, f"logits {err:.2g} from the unfused step (relative)"
    except Exception as e:  # noqa: BLE001 -- a compile failure or a disagreement: the unfused step runs
        if is_oom(e):
            raise
        return None, f"fused step off: {type(e).__name__}: {str(e).strip()[:300]}"
    finally:
        if step is not None:
            step.set_lengths(filled)
