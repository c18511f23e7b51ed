"""What transformers builds and loads for a hand-written family, without torch: the module tree's tensors in the
order ``named_parameters`` lists them (:class:`~vramguard.introspect.build.Structure`), the load plan
(:class:`~vramguard.introspect.generic.LoadPlan`) and the breakpoints of the allocation tape, from the spec alone.
``tests/test_hand_tape.py`` checks each against transformers' meta model for the families it answers.

Sources (transformers 5.17-5.24): ``models/llama/modeling_llama.py`` (``LlamaModel``: ``embed_tokens``, then each
``LlamaDecoderLayer``: ``self_attn`` with ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``mlp`` with
``gate_proj``, ``up_proj``, ``down_proj``, ``input_layernorm``, ``post_attention_layernorm``; ``norm``;
``rotary_emb`` with the float32 buffers ``inv_freq`` and ``original_inv_freq``; then ``lm_head``, shared with
``embed_tokens`` when tied), and the Qwen2 and Mistral trees, the same; the bitsandbytes quantizer converts every
``nn.Linear`` but ``lm_head`` (``get_modules_to_not_convert``: the output embedding); no ``_keep_in_fp32_modules``
and no weight conversion at load (``conversion_mapping``) for these families.
"""

from __future__ import annotations

import json
from functools import lru_cache

from vramguard.introspect.build import Structure, TensorInfo
from vramguard.introspect.generic import load_plan_of, weights_of
from vramguard.introspect.layer_trim import MIN_SAVED_LAYERS, expand
from vramguard.memory import hand_tape
from vramguard.settings import DTYPE_BYTES, TORCH_DTYPE_NAMES, Settings

FAMILIES = ("llama", "qwen2", "mistral")
ENABLED = True  # False: every spec is answered by transformers (the reference the tests compare with)
BNB_BYTES = {"int8": 1}  # a converted weight's TensorInfo carries no bytes (memory.weights sizes it)


def covers(spec) -> bool:
    """Whether :func:`structure` and :func:`load_plan` answer ``spec``: a config.json of a family written here. A fact
    of the config, not of the memory model chosen for it (:func:`vramguard.plan.choice.choose`): what they answer is
    what transformers builds for that config, whichever model plans it."""
    return ENABLED and spec.model_type in FAMILIES and bool(spec.config_json)


def structure(spec, s: Settings) -> Structure:
    """:func:`vramguard.introspect.generic.structure_of` for a spec :func:`covers`."""
    quant = s.quant if s.is_bnb else s.weight_dtype
    return _structure(spec, s.act_dtype, quant)


CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}


@lru_cache(maxsize=32)
def _structure(spec, dtype: str, quant: str) -> Structure:
    H, h, kvh, d = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
    inter = spec.intermediate_size
    torch_dtype = TORCH_DTYPE_NAMES[dtype]
    elem = DTYPE_BYTES[dtype]
    bnb = quant in ("nf4", "fp4", "int8")
    out: list[TensorInfo] = []
    qnames: list[str] = []

    def param(name: str, shape: tuple[int, ...]) -> None:
        n = 1
        for x in shape:
            n *= x
        out.append(TensorInfo(name, shape, torch_dtype, n, n * elem, "param"))

    def linear(module: str, fin: int, fout: int, bias: bool) -> None:
        if bnb:
            qnames.append(module)
            out.append(TensorInfo(f"{module}.weight", (fout, fin), quant, fin * fout, 0, "quantized", fout))
        else:
            param(f"{module}.weight", (fout, fin))
        if bias:
            param(f"{module}.bias", (fout,))
    param("model.embed_tokens.weight", (spec.vocab_size, H))
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        for proj, fout in (("q_proj", h * d), ("k_proj", kvh * d), ("v_proj", kvh * d)):
            linear(f"{p}.self_attn.{proj}", H, fout, spec.qkv_bias)
        linear(f"{p}.self_attn.o_proj", h * d, H, spec.o_bias)
        for proj, fin, fout in (("gate_proj", H, inter), ("up_proj", H, inter), ("down_proj", inter, H)):
            linear(f"{p}.mlp.{proj}", fin, fout, spec.mlp_bias)
        param(f"{p}.input_layernorm.weight", (H,))
        param(f"{p}.post_attention_layernorm.weight", (H,))
    param("model.norm.weight", (H,))
    tied = ("lm_head.weight = model.embed_tokens.weight",) if spec.tie_word_embeddings else ()
    if not tied:
        param("lm_head.weight", (spec.vocab_size, H))
    for name in ("model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"):
        out.append(TensorInfo(name, (d // 2,), "float32", d // 2, d // 2 * 4, "buffer"))
    rule = "the bitsandbytes quantizer's rule (every nn.Linear but lm_head)" if bnb else "not quantized"
    return Structure(CLASSES[spec.model_type], tuple(out), tuple(sorted(qnames)), rule, tied)


def embedding_names(spec) -> dict[str, frozenset[str]]:
    """The input and output embeddings' parameter names (a tied output counted once, as the input)."""
    out = frozenset() if spec.tie_word_embeddings else frozenset({"lm_head.weight"})
    return {"input": frozenset({"model.embed_tokens.weight"}), "output": out}


def load_plan(spec, s: Settings):
    """:func:`vramguard.introspect.generic.load_plan` for a spec :func:`covers` (no weight is converted at load)."""
    st = structure(spec, s)
    return load_plan_of(weights_of(st, embedding_names(spec), s), st, {}, s)


def breakpoints(spec) -> tuple[int, ...]:
    """:func:`vramguard.introspect.alloc_replay._breakpoints` for a spec :func:`covers`: Llama's config class has
    none of ``sliding_window``, ``attention_chunk_size`` and ``original_max_position_embeddings``, so a config.json
    that names one at its top level keeps it as an attribute (``PretrainedConfig`` keeps unknown keys); Qwen2's and
    Mistral's have ``sliding_window``, None where no layer slides (the spec's)."""
    raw = json.loads(spec.config_json)
    keys = ("attention_chunk_size", "original_max_position_embeddings")
    found = {raw.get(k) for k in (keys if spec.model_type != "llama" else ("sliding_window", *keys))}
    if spec.model_type != "llama":
        found.add(spec.sliding_window)
    return tuple(sorted(v for v in found if isinstance(v, int) and not isinstance(v, bool) and v > 0))


TRACED_LAYERS = 5  # layer_trim's 3P + 2 decoder layers for a period P of 1


def forwards(spec, key: Settings, prompt: int, new: int, steps: int = 3) -> tuple:
    """:func:`vramguard.memory.hand_tape.forwards`, written for :data:`TRACED_LAYERS` decoder layers and expanded
    to the model's (:func:`vramguard.introspect.layer_trim.expand`: the same tape, keys included), as the replay
    of transformers' forward is."""
    from dataclasses import replace
    extra = spec.num_layers - TRACED_LAYERS
    if extra >= MIN_SAVED_LAYERS:
        starts: list = []
        traced = hand_tape.forwards(replace(spec, num_layers=TRACED_LAYERS), key, prompt, new, steps, starts)
        ran = [i for i, fw in enumerate(traced) if fw]
        found = expand(tuple(traced[i] for i in ran), [starts[i] for i in ran], 1, extra)
        if found is not None:
            return found + ((),) * (len(traced) - len(found))
    return hand_tape.forwards(spec, key, prompt, new, steps)
