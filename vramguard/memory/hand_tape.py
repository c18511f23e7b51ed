"""The allocation tape of ``generate``'s first forwards for a hand-written family, without torch: the same
``(key, bytes)`` / ``(key, -1)`` events, in the same order, as transformers' forward replayed on the meta device
under the storage tracker (:func:`vramguard.introspect.alloc_replay._trace`), written over value-less tensors
(:mod:`vramguard.memory.metatensor`) in the order of transformers 5's modelling code.

Sources (transformers 5.17-5.24): ``models/llama/modeling_llama.py`` (``LlamaRMSNorm``, ``LlamaRotaryEmbedding``,
``apply_rotary_pos_emb``, ``repeat_kv``, ``eager_attention_forward``, ``LlamaAttention``, ``LlamaMLP``,
``LlamaDecoderLayer``, ``LlamaModel``, ``LlamaForCausalLM``), ``integrations/sdpa_attention.py`` (grouped-query
SDPA without a mask), ``masking_utils.py`` (``create_causal_mask``: an unpadded batch skips the mask under SDPA;
eager gets a float mask from ``sdpa_mask`` and ``eager_mask``), ``cache_utils.py`` (``DynamicLayer.update``: one
``torch.cat`` a tensor). The bitsandbytes kernels' buffers and SDPA's fused kernel are those of
:func:`vramguard.introspect.alloc_replay._bnb_kernels` and ``_fused_sdpa_mode``.

Covered (:func:`covers`): the ``llama``, ``qwen2`` and ``mistral`` families (``Qwen2Model`` and ``MistralModel`` are
``LlamaModel`` with biases on q, k, v and another order of locals) without sliding-window layers, with SiLU and a
RoPE of type default, linear or llama3, a dynamic cache, an unpadded batch, eager attention or SDPA's flash-class
kernel, any dtype and bitsandbytes quantization.
Everything else is answered by transformers' own forward. ``tests/test_hand_tape.py`` compares the two event for
event.
"""

from __future__ import annotations

import json
from functools import lru_cache

from vramguard.memory.forward import BNB_4BIT_FUSED_MAX_ROWS, sdpa_runs_math
from vramguard.memory.metatensor import T, Tape, cat, linear, matmul
from vramguard.settings import DTYPE_BYTES, Settings

ROPE_TYPES = (None, "default", "linear", "llama3")  # computed once at init: the forward allocates the same
FAMILIES = ("llama", "qwen2", "mistral")


@lru_cache(maxsize=32)
def _config_facts(config_json: str) -> tuple[str | None, str | None]:
    """(hidden_act, rope type) as config.json gives them (None where it leaves them to the class: SiLU, default)."""
    raw = json.loads(config_json)
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else "unknown"
    return raw.get("hidden_act"), kind


def not_covered(spec, s: Settings) -> str | None:
    """Why the hand tape does not answer ``spec`` with ``s`` (None: it does)."""
    if spec.model_type not in FAMILIES or not spec.config_json:
        return f"no hand tape for {spec.model_type}" + ("" if spec.config_json else " without its config.json")
    if spec.sliding_window is not None or set(spec.layer_types) - {"full_attention"}:
        return "sliding-window layers (their masks)"
    act, rope = _config_facts(spec.config_json)
    if act not in (None, "silu") or rope not in ROPE_TYPES:
        return f"hidden_act {act!r} or RoPE type {rope!r}"
    if s.cache != "dynamic" or s.padded or s.output_attentions or s.logits != "last":
        return "a setting of the cache, padding or outputs"
    if s.effective_attn == "sdpa" and not sdpa_runs_math(s):
        return None
    return None if s.effective_attn == "eager" else f"attention {s.effective_attn} ({s.sdpa_kernel} kernel)"


def covers(spec, s: Settings) -> bool:
    """Whether :func:`forwards` answers ``spec`` with ``s``."""
    return not_covered(spec, s) is None


class _Cache:
    """``DynamicCache``: per layer, keys and values grown by ``torch.cat`` on the token dim."""

    def __init__(self) -> None:
        self.keys: dict[int, T] = {}
        self.values: dict[int, T] = {}

    def update(self, k: T, v: T, i: int) -> tuple[T, T]:
        self.keys[i] = cat([self.keys[i], k], -2) if i in self.keys else cat([k], -2)
        self.values[i] = cat([self.values[i], v], -2) if i in self.values else cat([v], -2)
        return self.keys[i], self.values[i]


class _Llama:
    """``LlamaForCausalLM``'s forward over value-less tensors (see the module docstring)."""

    def __init__(self, spec, s: Settings) -> None:
        self.spec, self.s = spec, s
        self.act = s.act_dtype
        self.h, self.kvh, self.d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.quantized = s.is_bnb
        self.layer_starts: list[int] = []  # the index of each decoder layer's first event in the tape

    # ---- kernels around a quantized linear ------------------------------------------------------------------
    def _held(self, x: T, fin: int, fout: int):
        """What bitsandbytes holds while a converted layer runs (``alloc_replay._bnb_kernels``)."""
        s = self.s
        rows = x.numel() // x.shape[-1]
        if s.quant == "int8":
            return x.tape.new((rows * fin + rows * fout * 4,), "uint8")
        comp = DTYPE_BYTES[s.resolved_compute_dtype]  # a cast where the element size differs, as the replay has it
        cast = [x.tape.new((rows * fin * comp,), "uint8")] if comp != DTYPE_BYTES[self.act] else []
        if rows <= BNB_4BIT_FUSED_MAX_ROWS:
            return cast
        absmax = [x.tape.new((-(-fin * fout // 64) * 4,), "uint8") for _ in range(2)] if s.double_quant else []
        weight = x.tape.new((fin * fout * comp,), "uint8")
        return (cast, weight, *absmax[::-1])

    def lin(self, x: T, fin: int, fout: int, quantizable: bool = True) -> T:
        held = self._held(x, fin, fout) if quantizable and self.quantized else None
        out = linear(x, fout)
        del held
        return out

    # ---- modules --------------------------------------------------------------------------------------------
    def norm(self, hidden_states: T) -> T:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to("fp32")
        variance = hidden_states.unary().reduce_last()
        hidden_states = hidden_states.binary(variance.unary().unary())
        out = hidden_states.to(input_dtype).unary()
        del hidden_states, variance
        return out

    def rotary(self, x: T, position_ids: T) -> tuple[T, T]:
        inv_freq = T(x.tape, (self.d // 2,), (1,), "fp32", None)  # a buffer of the loaded model: no allocation
        freqs = position_ids.unsqueeze(-1).to("fp32").binary(inv_freq)
        emb = cat([freqs, freqs], -1)
        cos = emb.unary().unary()
        sin = emb.unary().unary()
        out = cos.to(self.act), sin.to(self.act)
        del freqs, emb, cos, sin, inv_freq
        return out

    def attention(self, i: int, hidden_states: T, mask: T | None, pe: tuple[T, T], cache: _Cache) -> tuple:
        H, h, kvh, d = self.spec.hidden_size, self.h, self.kvh, self.d
        input_shape = hidden_states.shape[:-1]
        query_states = self.lin(hidden_states, H, h * d).view(*input_shape, -1, d).transpose(1, 2)
        key_states = self.lin(hidden_states, H, kvh * d).view(*input_shape, -1, d).transpose(1, 2)
        value_states = self.lin(hidden_states, H, kvh * d).view(*input_shape, -1, d).transpose(1, 2)
        cos, sin = pe
        query_states, key_states = _apply_rotary(query_states, key_states, cos, sin)
        key_states, value_states = cache.update(key_states, value_states, i)
        if self.s.effective_attn == "eager":
            attn_output, attn_weights = self._eager(query_states, key_states, value_states, mask)
        else:  # SDPA's fused kernel: its output alone, laid out (batch, tokens, heads, head_dim)
            b, _, t, _ = query_states.shape
            attn_output = query_states.tape.new((b, t, h, d), self.act).transpose(1, 2)
            attn_output, attn_weights = attn_output.transpose(1, 2).contiguous(), None
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.lin(attn_output, h * d, H)
        del query_states, key_states, value_states, cos, sin
        return attn_output, attn_weights

    def _eager(self, query: T, key: T, value: T, mask: T | None) -> tuple[T, T]:
        key_states = _repeat_kv(key, self.h // self.kvh)
        value_states = _repeat_kv(value, self.h // self.kvh)
        attn_weights = matmul(query, key_states.transpose(2, 3)).unary()
        if mask is not None:
            attn_weights = attn_weights.binary(mask)
        attn_weights = attn_weights.to("fp32").unary().to(query.dtype)
        attn_output = matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous()
        del key_states, value_states
        return attn_output, attn_weights

    def mlp(self, x: T) -> T:
        H, inter = self.spec.hidden_size, self.spec.intermediate_size
        return self.lin(self.lin(x, H, inter).unary().binary(self.lin(x, H, inter)), inter, H)

    def layer(self, i: int, hidden_states: T, mask: T | None, pe: tuple[T, T], cache: _Cache) -> T:
        residual = hidden_states
        hidden_states = self.norm(hidden_states)
        hidden_states, _ = self.attention(i, hidden_states, mask, pe, cache)
        hidden_states = residual.binary(hidden_states)
        residual = hidden_states
        hidden_states = self.norm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual.binary(hidden_states)
        del residual, _
        return hidden_states

    def model(self, input_ids: T, attention_mask: T, position_ids: T, cache: _Cache, past: int) -> T:
        inputs_embeds = input_ids.tape.new((*input_ids.shape, self.spec.hidden_size), self.act)
        causal_mask = self.causal_mask(attention_mask, input_ids.shape[1], past)
        hidden_states = inputs_embeds
        position_embeddings = self.rotary(hidden_states, position_ids)
        for i in range(self.spec.num_layers):
            self.layer_starts.append(len(input_ids.tape.events))
            hidden_states = self.layer(i, hidden_states, causal_mask, position_embeddings, cache)
        hidden_states = self.norm(hidden_states)
        if self.spec.model_type == "qwen2":  # Qwen2Model: the mask in a dict, the embeddings in the mask's kwargs
            del causal_mask, inputs_embeds, position_embeddings
        else:
            del inputs_embeds, causal_mask, position_embeddings
        return hidden_states

    def causal_mask(self, attention_mask: T, q: int, past: int) -> T | None:
        """``create_causal_mask`` for an all-ones 2-D mask: SDPA checks it (``mask.bool()``, its sum against its
        size) and skips the mask; eager builds the boolean causal mask (``sdpa_mask`` without the skip) and turns it
        into a float mask of ``(batch, 1, q, kv)`` (``eager_mask``: ``torch.where(mask, 0, min)``)."""
        tape = attention_mask.tape
        b, kv = attention_mask.shape
        padding = attention_mask.to("bool")
        if self.s.effective_attn != "eager":
            total = padding.scalar("int64")
            same = total.scalar("bool")
            del total, same, padding
            return None
        batch_arange, head_arange = tape.new((b,), "int64"), tape.new((1,), "int64")
        q_idx = tape.new((q,), "int64").unary()
        kv_idx = tape.new((kv,), "int64").unary()
        one = tape.new((), "bool")
        causal = tape.new((q, kv), "bool")
        both = causal.unary()
        del causal, one
        picked = tape.new((b, kv), "bool")
        mask = tape.new((b, 1, q, kv), "bool")
        del picked, both, batch_arange, head_arange, q_idx, kv_idx
        zero = tape.new((), self.act)
        low = tape.new((), self.act)
        out = mask.to(self.act)
        del low, zero, mask, padding
        return out

    def forward(self, input_ids: T, attention_mask: T, position_ids: T, cache: _Cache, past: int) -> T:
        hidden_states = self.model(input_ids, attention_mask, position_ids, cache, past)
        b, t, H = hidden_states.shape
        logits = self.lin(hidden_states.narrow(1, t - 1, 1), H, self.spec.vocab_size, quantizable=False)
        del hidden_states
        return logits


def _rotate_half(x: T) -> T:
    half = x.shape[-1] // 2
    return cat([x.narrow(-1, half, half).unary(), x.narrow(-1, 0, half)], -1)


def _apply_rotary(q: T, k: T, cos: T, sin: T) -> tuple[T, T]:
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q_embed = q.binary(cos).binary(_rotate_half(q).binary(sin))
    k_embed = k.binary(cos).binary(_rotate_half(k).binary(sin))
    return q_embed, k_embed


def _repeat_kv(x: T, n_rep: int) -> T:
    if n_rep == 1:
        return x
    b, kvh, slen, d = x.shape
    return x.unsqueeze(2).expand(b, kvh, n_rep, slen, d).reshape(b, kvh * n_rep, slen, d)


def forwards(spec, key: Settings, prompt: int, new: int, steps: int = 3,
             layer_starts: list | None = None) -> tuple:
    """The events of the first ``min(new, steps)`` forwards of ``generate`` (the prefill, decode step 1, 2...), one
    tuple per forward, empty tuples up to three: :func:`vramguard.introspect.alloc_replay._cached_events` for a
    spec :func:`covers`. ``layer_starts``: a list that gets, per forward, the index of each decoder layer's first
    event within it (as :func:`vramguard.introspect.alloc_replay._trace` gives them)."""
    s = key.with_(prompt_tokens=prompt, max_new_tokens=new)
    model = _Llama(spec, s)
    tape = Tape()
    marks = _generate(model, tape, s.sequences, prompt, new, steps)
    events = tape.events
    marks += [len(events)] * (3 - len(marks))
    if layer_starts is not None:
        layer_starts += [[x - a for x in model.layer_starts if a <= x < b] for a, b in zip([0] + marks, marks)]
    return tuple(tuple(events[a:b]) for a, b in zip([0] + marks, marks))


def _generate(model: _Llama, tape: Tape, seqs: int, prompt: int, new: int, steps: int) -> list[int]:
    """``_trace``'s loop: the input ids and mask, each forward, the float32 copy of the last logits, the next ids
    and the grown mask; the index of the event after each forward."""
    marks: list[int] = []
    cache = _Cache()
    ids = tape.new((seqs, prompt), "int64")
    mask = tape.new((seqs, prompt), "int64")
    step_ids = ids
    for step in range(min(new, steps)):
        past = prompt + step - 1 if step else 0
        pos = tape.new((step_ids.shape[1],), "int64").unsqueeze(0).expand(seqs, -1)
        logits = model.forward(step_ids, mask, pos, cache, past)
        last = logits.select_last(1).to("fp32", copy=True)
        del logits, pos
        step_ids = last.reduce_last("int64", keepdim=False).unsqueeze(-1)
        del last
        ids = cat([ids, step_ids], -1)
        mask = cat([mask, tape.new((seqs, 1), "int64")], -1)
        marks.append(len(tape.events))
    del cache, ids, mask, step_ids
    return marks
