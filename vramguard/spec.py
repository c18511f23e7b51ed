"""ModelSpec: the architecture numbers memory depends on, read from a Hugging Face ``config.json`` dict.

Only decoder-only causal LMs are modelled. Eleven families have a hand-written memory model that needs no torch
(recognised by ``model_type``); the structure that changes memory (GQA, ``head_dim`` overrides, sliding-window and
hybrid layers, tied embeddings, fused projections, MoE, extra norms) is explicit in the spec so that the memory model
never special-cases a family name. Any other architecture transformers can build gets a *generic* spec
(``generic=True``): its memory is taken from transformers itself (:mod:`vramguard.introspect`).

A hand family's config.json is read with :data:`CLASS_DEFAULTS`, the config classes' defaults (Gemma-2's
``tie_word_embeddings=True`` when config.json omits it, Gemma-3's ``sliding_window_pattern``), without importing
transformers (a test checks the table against ``AutoConfig`` for every family and catalog entry). Every other config
is read through transformers (``AutoConfig``), so its class's defaults apply.

Sources for the structure of each family: the modelling files of transformers 5.x
(``models/<family>/modeling_<family>.py``): llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, gemma, gemma2,
phi3.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from vramguard import diskcache
from vramguard.errors import ConfigError
from vramguard.introspect.build import config_from_dict, text_config
from vramguard.introspect.keys import canonical_json
from vramguard.settings import short_dtype

# model_type -> structural traits that are not in config.json itself
_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
    "mixtral": {"moe": True},
    "qwen2_moe": {"moe": True, "qkv_bias": True, "odd_window_layers": True},
    "qwen3_moe": {"moe": True, "qk_norm": True},
    "gemma": {"scaled_embeddings": True},
    "gemma2": {"scaled_embeddings": True, "norms_per_layer": 4, "alternating_sliding": True},
    "gemma3_text": {"scaled_embeddings": True, "norms_per_layer": 4, "qk_norm": True},
    "phi3": {"fused_qkv": True, "fused_gate_up": True},
}
SUPPORTED_MODEL_TYPES = tuple(sorted(_FAMILIES))

MAX_LAYERS = 4096  # a sanity bound: building a meta model of millions of layers would not finish

# The defaults of transformers' config classes for the fields a hand spec reads (the ``__init__`` defaults of
# models/<family>/configuration_<family>.py in transformers 5; a field whose default is derived from others, such as
# ``head_dim = hidden_size // num_attention_heads``, is left out and derived by :func:`_hand_spec`). A hand family's
# config.json is read with them, without importing transformers; tests/test_plan_speed.py checks every family and
# every catalog entry against ``AutoConfig``.
CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32, "intermediate_size": 11008,
              "vocab_size": 32000, "max_position_embeddings": 2048, "tie_word_embeddings": False,
              "attention_bias": False, "mlp_bias": False},
    "mistral": {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
                "sliding_window": 4096, "intermediate_size": 14336, "vocab_size": 32000,
                "max_position_embeddings": 131072, "tie_word_embeddings": False},
    "qwen2": {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 32, "num_hidden_layers": 32,
              "sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 28,
              "intermediate_size": 22016, "vocab_size": 151936, "max_position_embeddings": 32768,
              "tie_word_embeddings": False},
    "qwen3": {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128,
              "num_hidden_layers": 32, "sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 28,
              "intermediate_size": 22016, "vocab_size": 151936, "max_position_embeddings": 32768,
              "tie_word_embeddings": False, "attention_bias": False},
    "mixtral": {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
                "num_local_experts": 8, "intermediate_size": 14336, "vocab_size": 32000,
                "max_position_embeddings": 131072, "tie_word_embeddings": False, "num_experts_per_tok": 2},
    "qwen2_moe": {"hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 16, "num_hidden_layers": 24,
                  "sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 28, "num_experts": 60,
                  "intermediate_size": 5632, "vocab_size": 151936, "max_position_embeddings": 32768,
                  "tie_word_embeddings": False, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                  "shared_expert_intermediate_size": 5632},
    "qwen3_moe": {"hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4, "num_hidden_layers": 24,
                  "sliding_window": 4096, "use_sliding_window": False, "num_experts": 128,
                  "intermediate_size": 6144, "vocab_size": 151936, "max_position_embeddings": 32768,
                  "tie_word_embeddings": False, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                  "attention_bias": False},
    "gemma": {"hidden_size": 3072, "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256,
              "num_hidden_layers": 28, "intermediate_size": 24576, "vocab_size": 256000,
              "max_position_embeddings": 8192, "tie_word_embeddings": True, "attention_bias": False},
    "gemma2": {"hidden_size": 2304, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
               "num_hidden_layers": 26, "sliding_window": 4096, "intermediate_size": 9216, "vocab_size": 256000,
               "max_position_embeddings": 8192, "tie_word_embeddings": True, "attention_bias": False,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma3_text": {"hidden_size": 2304, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "num_hidden_layers": 26, "sliding_window": 4096, "sliding_window_pattern": 6,
                    "intermediate_size": 9216, "vocab_size": 262208, "max_position_embeddings": 131072,
                    "tie_word_embeddings": True, "attention_bias": False},
    "phi3": {"hidden_size": 3072, "num_attention_heads": 32, "num_hidden_layers": 32, "intermediate_size": 8192,
             "vocab_size": 32064, "max_position_embeddings": 4096, "tie_word_embeddings": False},
}

# True: a hand family's config.json is read through AutoConfig too, as every other config is (the reference path
# the tests compare the hand table with); False (the default): read with :data:`CLASS_DEFAULTS`, no transformers.
READ_FAMILIES_THROUGH_TRANSFORMERS = False


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of a decoder-only transformer, as memory sees it.

    Attributes (all counts are ints; no sizes in bytes here):
        name: catalog name, model id or path, as given.
        model_type: the ``model_type`` of config.json (``llama``, ``qwen2``...).
        hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim, vocab_size: as in
            config.json; ``head_dim`` is the config's override when present, else ``hidden_size // num_heads``.
        max_position_embeddings: the context length the model was built for (tokens).
        tie_word_embeddings: lm_head shares the embedding matrix (stored once).
        layer_types: per layer ``"full_attention"`` or ``"sliding_attention"``.
        sliding_window: window of the sliding layers in tokens, ``None`` when no layer slides.
        num_experts, num_experts_per_tok, moe_intermediate_size, shared_expert_intermediate_size: MoE (0 = dense).
        qkv_bias, o_bias, mlp_bias: whether those projections carry a bias vector.
        fused_qkv, fused_gate_up: projections stored as one matrix (Phi-3).
        norms_per_layer: RMSNorm vectors per decoder layer (2, or 4 for Gemma-2/3); ``qk_norm`` adds two of
            ``head_dim`` each.
        scaled_embeddings: the embeddings are multiplied by sqrt(hidden) into a new tensor (Gemma).
        attn_logit_softcapping, final_logit_softcapping: Gemma-2 soft-capping (None when absent).
        checkpoint_dtype: ``fp32`` / ``bf16`` / ``fp16`` as the checkpoint stores it, ``None`` when unknown.
        prequantized: the checkpoint's own ``quantization_config.quant_method`` (``bitsandbytes``, ``gptq``...).
        source: where the config came from (``catalog``, a path, ``hf-cache:<id>``).
        generic: memory comes from transformers itself (:mod:`vramguard.introspect`), not a hand-written model;
            the size fields above are then the text config's, for display and the serving pool.
        config_json: the config.json as given (canonical JSON text), for the generic path and agreement tests.
        checkpoint: what the checkpoint stores, from its safetensors headers
            (:class:`vramguard.hub.headers.CheckpointHeaders`), None when not read; a pre-quantized checkpoint's
            weights are planned from it (:mod:`vramguard.hub.prequant`).
    """

    name: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    fused_qkv: bool = False
    fused_gate_up: bool = False
    norms_per_layer: int = 2
    qk_norm: bool = False
    scaled_embeddings: bool = False
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    checkpoint_dtype: str | None = None
    prequantized: str | None = None
    source: str = "catalog"
    notes: tuple[str, ...] = field(default=())
    generic: bool = False
    config_json: str | None = field(default=None, repr=False, compare=False)
    checkpoint: Any = field(default=None, repr=False, compare=False)  # vramguard.hub.headers.CheckpointHeaders

    def config_dict(self) -> dict:
        """The config.json the spec was read from, parsed (an empty dict for a spec built by hand or unreadable
        text)."""
        try:
            found = json.loads(self.config_json) if self.config_json else {}
        except ValueError:
            return {}
        return found if isinstance(found, dict) else {}

    @property
    def gqa_groups(self) -> int:
        """Query heads per KV head (1 = multi-head attention, >1 = GQA, num_heads = MQA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def num_sliding_layers(self) -> int:
        return sum(1 for t in self.layer_types if t == "sliding_attention")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def _req(cfg: dict[str, Any], key: str, name: str, *alts: str) -> Any:
    for k in (key, *alts):
        if cfg.get(k) is not None:
            return cfg[k]
    raise ConfigError(f"config.json:{key}", None, "a value (memory depends on it)",
                      f"the config of {name} has no '{key}'; pass a complete config.json of a decoder-only model")


def _pos_int(value: Any, key: str, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"config.json:{key}", value, "a positive integer", f"fix '{key}' in the config of {name}")
    return value


def _layer_types(cfg: dict[str, Any], fam: dict[str, Any], n_layers: int, window: int | None) -> tuple[str, ...]:
    given = cfg.get("layer_types")
    if given:
        types = tuple("sliding_attention" if "sliding" in str(t) or str(t) == "local" else "full_attention"
                      for t in given)
        if len(types) != n_layers:
            raise ConfigError("config.json:layer_types", f"{len(types)} entries", f"{n_layers} (num_hidden_layers)",
                              "make layer_types list one type per layer")
        return types
    if window is None:
        return ("full_attention",) * n_layers
    if fam.get("alternating_sliding"):  # Gemma-2: even layers slide (modeling_gemma2.py, `layer_idx % 2 == 0`)
        return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers))
    pattern = cfg.get("sliding_window_pattern")
    if pattern:  # Gemma-3 style: every `pattern`-th layer is global
        return tuple("full_attention" if (i + 1) % int(pattern) == 0 else "sliding_attention" for i in range(n_layers))
    if cfg.get("use_sliding_window") is False:
        return ("full_attention",) * n_layers
    max_window_layers = cfg.get("max_window_layers")
    if max_window_layers is not None and cfg.get("use_sliding_window") and fam.get("odd_window_layers"):
        # Qwen2-MoE: the odd-numbered layers (1st, 3rd...) below max_window_layers slide (configuration_qwen2_moe.py)
        return tuple("sliding_attention" if i % 2 == 0 and i < max_window_layers else "full_attention"
                     for i in range(n_layers))
    if max_window_layers is not None and cfg.get("use_sliding_window"):
        return tuple("sliding_attention" if i >= max_window_layers else "full_attention" for i in range(n_layers))
    return ("sliding_attention",) * n_layers


def _through_transformers(cfg: dict[str, Any], name: str) -> tuple[dict[str, Any] | None, str | None]:
    """(the language model's config as transformers builds it, as a dict; the outer model_type), or (None, why)
    when transformers is not importable, or (None, None) when it rejects the config of a hand family. What
    transformers built is kept on disk (:mod:`vramguard.diskcache`, keyed by the config text, the name, the library
    versions and vramguard's code): a later read of the same config imports neither torch nor transformers."""
    path = diskcache.entry_key("config", canonical_json(cfg), name)
    found = diskcache.read(path)
    if isinstance(found, tuple) and len(found) == 2 and isinstance(found[0], dict):
        return found
    text, outer_type = _built_by_transformers(cfg, name)
    if text is not None:
        diskcache.write(path, (text, outer_type))
    return text, outer_type


def _built_by_transformers(cfg: dict[str, Any], name: str) -> tuple[dict[str, Any] | None, str | None]:
    """:func:`_through_transformers`, computed."""
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        return None, f"transformers is not importable ({str(e).splitlines()[0][:160]})"
    try:
        full = config_from_dict(cfg, name)
    except ConfigError as e:
        if cfg.get("model_type") in _FAMILIES or cfg.get("text_config"):
            return None, None  # a hand family read as config.json gives it (older transformers, odd keys)
        raise e from None
    tc = text_config(full)
    text = tc.to_dict()
    for standard, own in getattr(tc, "attribute_map", {}).items():  # the config class's own names of the standard
        if isinstance(own, str) and own in text:  # fields (ERNIE-4.5's moe_k is num_experts_per_tok)
            text.setdefault(standard, text[own])
    text.setdefault("torch_dtype", cfg.get("torch_dtype") or cfg.get("dtype"))
    if cfg.get("quantization_config"):
        text["quantization_config"] = cfg["quantization_config"]
    return text, full.model_type


def spec_from_config(cfg: dict[str, Any], name: str = "model", source: str = "config") -> ModelSpec:
    """Build a :class:`ModelSpec` from a config.json dict.

    A hand-written family (:data:`SUPPORTED_MODEL_TYPES`) gets its exact hand model; any other architecture that
    the installed transformers builds gets a generic spec. Multimodal wrappers whose outer ``model_type`` is not a
    hand family (Gemma-3's ``gemma3``) are generic, planned as ``AutoModelForCausalLM`` loads them.

    Raises:
        ConfigError: an encoder-decoder config, a ``model_type`` transformers does not know (or transformers is not
            installed and the family has no hand model), or a missing / non-positive size field.
    """
    raw_json = canonical_json(cfg)
    if cfg.get("is_encoder_decoder"):
        raise ConfigError("config.json:is_encoder_decoder", True, "decoder-only causal LMs",
                          "vramguard plans decoder-only models (Llama, Mistral, Qwen, Gemma, Phi...)")
    hand = cfg.get("model_type") in _FAMILIES and not cfg.get("text_config")
    text, outer_type = (None, None) if hand and not READ_FAMILIES_THROUGH_TRANSFORMERS else \
        _through_transformers(cfg, name)
    why_not = outer_type if text is None else None
    if text is not None and outer_type not in _FAMILIES:
        return _generic_spec(text, cfg, raw_json, name, source, outer_type)
    notes: list[str] = []
    if text is None:
        if cfg.get("text_config"):
            notes.append("multimodal config: only the language model (text_config) is planned; vision weights are "
                         "not (install transformers to plan the whole model)")
            merged = dict(cfg["text_config"])
            merged.setdefault("torch_dtype", cfg.get("torch_dtype") or cfg.get("dtype"))
            merged.setdefault("quantization_config", cfg.get("quantization_config"))
            cfg = merged
        model_type = cfg.get("model_type")
        if model_type not in _FAMILIES:
            raise ConfigError("config.json:model_type", model_type,
                              ", ".join(SUPPORTED_MODEL_TYPES) + " without transformers; any causal LM with it",
                              (f"{why_not}: " if why_not else "") + "install transformers to plan any architecture "
                              "it can load (pip install 'vramguard[gpu]'), or use a catalog name "
                              "(vramguard.catalog.models.MODELS)")
        cfg = {**CLASS_DEFAULTS.get(model_type, {}), **cfg}
    else:
        cfg = text
    return _hand_spec(cfg, name, source, notes, raw_json)


def _hand_spec(cfg: dict[str, Any], name: str, source: str, notes: list[str], raw_json: str) -> ModelSpec:
    model_type = cfg.get("model_type")
    fam = _FAMILIES[model_type]
    hidden = _pos_int(_req(cfg, "hidden_size", name), "hidden_size", name)
    heads = _pos_int(_req(cfg, "num_attention_heads", name), "num_attention_heads", name)
    kv_heads = _pos_int(cfg.get("num_key_value_heads") or heads, "num_key_value_heads", name)
    if heads % kv_heads:
        raise ConfigError("config.json:num_key_value_heads", kv_heads, f"a divisor of num_attention_heads={heads}",
                          "fix num_key_value_heads in the config")
    head_dim = _pos_int(cfg.get("head_dim") or hidden // heads, "head_dim", name)
    n_layers = _pos_int(_req(cfg, "num_hidden_layers", name), "num_hidden_layers", name)
    window = cfg.get("sliding_window")
    if window is not None and (cfg.get("use_sliding_window") is False):
        window = None
    layer_types = _layer_types(cfg, fam, n_layers, window)
    if window is None and "sliding_attention" in layer_types:
        raise ConfigError("config.json:sliding_window", None, "a window size when layer_types has sliding layers",
                          "set sliding_window in the config")
    if "sliding_attention" not in layer_types:
        window = None
    n_experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0) if fam.get("moe") else 0
    intermediate = _pos_int(_req(cfg, "intermediate_size", name), "intermediate_size", name)
    dtype_name = cfg.get("torch_dtype") or cfg.get("dtype")
    qcfg = cfg.get("quantization_config") or {}
    return ModelSpec(
        name=name, model_type=model_type, hidden_size=hidden, intermediate_size=intermediate,
        num_layers=n_layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        vocab_size=_pos_int(_req(cfg, "vocab_size", name), "vocab_size", name),
        max_position_embeddings=_pos_int(_req(cfg, "max_position_embeddings", name), "max_position_embeddings", name),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        layer_types=layer_types, sliding_window=int(window) if window else None,
        num_experts=n_experts,
        num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0) if n_experts else 0,
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or intermediate) if n_experts else 0,
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0) if n_experts else 0,
        qkv_bias=bool(fam.get("qkv_bias")) or bool(cfg.get("attention_bias", False)),
        o_bias=bool(cfg.get("attention_bias", False)) and model_type not in ("qwen2", "qwen2_moe"),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        fused_qkv=bool(fam.get("fused_qkv")), fused_gate_up=bool(fam.get("fused_gate_up")),
        norms_per_layer=int(fam.get("norms_per_layer", 2)), qk_norm=bool(fam.get("qk_norm")),
        scaled_embeddings=bool(fam.get("scaled_embeddings")),
        attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        checkpoint_dtype=short_dtype(dtype_name),
        prequantized=qcfg.get("quant_method") if isinstance(qcfg, dict) else None,
        source=source, notes=tuple(notes), config_json=raw_json,
    )


def _first_int(cfg: dict[str, Any], *keys: str) -> int | None:
    for k in keys:
        v = cfg.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _generic_spec(text: dict[str, Any], raw: dict[str, Any], raw_json: str, name: str, source: str,
                  outer_type: str | None) -> ModelSpec:
    """A spec whose memory comes from transformers (:mod:`vramguard.introspect`); the size fields are the text
    config's where it has them (attribute names differ by family: ``n_embd``, ``n_head``...), for display; ``raw``:
    the config.json object as given, before transformers' config class fills in its defaults."""
    for key in ("hidden_size", "n_embd", "num_attention_heads", "n_head", "num_hidden_layers", "n_layer",
                "num_key_value_heads", "vocab_size", "intermediate_size", "max_position_embeddings", "n_positions"):
        if key in text and text[key] is not None:
            _pos_int(text[key], key, name)
    layers_given = _first_int(text, "num_hidden_layers", "n_layer", "num_layers")
    if layers_given and layers_given > MAX_LAYERS:
        raise ConfigError("config.json:num_hidden_layers", layers_given, f"at most {MAX_LAYERS:,} layers",
                          "fix the config (published models have at most a few hundred layers)")
    hidden = _first_int(text, "hidden_size", "n_embd", "d_model") or 1
    heads = _first_int(text, "num_attention_heads", "n_head", "num_heads") or 1
    kv_heads = _first_int(text, "num_key_value_heads", "num_kv_heads", "multi_query_group_num") or heads
    if text.get("multi_query") is True and not text.get("num_kv_heads"):
        kv_heads = 1
    layers = _first_int(text, "num_hidden_layers", "n_layer", "num_layers") or 1
    ctx = _first_int(text, "max_position_embeddings", "n_positions", "seq_length", "max_seq_len")
    notes = [f"{outer_type or text.get('model_type')}: planned from transformers' own model (meta-device module "
             "tree, quantizer rules, a replay of the forward), not a hand-written model"]
    if outer_type and text.get("model_type") and outer_type != text.get("model_type"):
        notes.append(f"multimodal config ({outer_type}): the whole model AutoModelForCausalLM loads is planned, its "
                     "vision tower included; sizes shown are the language model's")
    given = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    missing = [k[0] for k in (("num_hidden_layers", "n_layer", "num_layers"), ("hidden_size", "n_embd", "d_model"),
                              ("vocab_size", "padded_vocab_size")) if _first_int(given, *k) is None]
    if missing:  # said, not filled in silently: transformers' config class supplies its defaults
        notes.append(f"config.json names no {', '.join(missing)}: transformers' config class fills in its own "
                     "default, and the plan is of the model it builds with it; if that is not your model, fix the "
                     "config")
    if ctx is None:
        ctx = 131072
        notes.append("the config sets no context length (ALiBi or similar): prompts up to 131,072 tokens are planned")
    window = text.get("sliding_window") if isinstance(text.get("sliding_window"), int) else None
    lt = text.get("layer_types")
    layer_types = tuple(str(t) for t in lt) if isinstance(lt, list) and len(lt) == layers else \
        ("full_attention",) * layers
    dtype_name = text.get("torch_dtype") or text.get("dtype")
    qcfg = text.get("quantization_config") or {}
    n_experts = _first_int(text, "num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts") or 0
    moe_size = _first_int(text, "moe_intermediate_size") or 0
    shared = _first_int(text, "n_shared_experts", "num_shared_experts", "moe_num_shared_experts") or 0
    return ModelSpec(
        name=name, model_type=outer_type or str(text.get("model_type")), hidden_size=hidden,
        intermediate_size=_first_int(text, "intermediate_size", "n_inner", "ffn_hidden_size") or 4 * hidden,
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads if heads % kv_heads == 0 else heads,
        head_dim=_first_int(text, "head_dim") or max(hidden // heads, 1),
        vocab_size=_first_int(text, "vocab_size", "padded_vocab_size") or 1, max_position_embeddings=ctx,
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)), layer_types=layer_types,
        sliding_window=window if any("sliding" in t for t in layer_types) else None,
        num_experts=n_experts, num_experts_per_tok=_first_int(text, "num_experts_per_tok", "moe_topk") or 0,
        moe_intermediate_size=moe_size,
        shared_expert_intermediate_size=_first_int(text, "shared_expert_intermediate_size") or moe_size * shared,
        checkpoint_dtype=short_dtype(dtype_name),
        prequantized=qcfg.get("quant_method") if isinstance(qcfg, dict) else None,
        source=source, notes=tuple(notes), generic=True, config_json=raw_json)
