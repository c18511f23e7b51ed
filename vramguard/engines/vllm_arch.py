"""The model vLLM builds from a config.json: its language model as a hand-style spec, the vision encoder of a
multimodal checkpoint, MLA's latent shapes, and the quantized storage of its layers.

Pure functions of a :class:`~vramguard.spec.ModelSpec` and its config.json; no torch, no transformers. Families
whose memory transformers' generic path plans (not a hand family) but that vLLM runs with model files of its own are
read here from the config, as vLLM's model files read them:

* ``gpt_oss`` (``vllm/model_executor/models/gpt_oss.py``): attention with biases and per-head sinks, a router with
  a bias, MoE experts of ``intermediate_size`` with biases (MXFP4 in the published checkpoints), alternating
  sliding (``sliding_window``) and full layers per ``layer_types``.
* ``deepseek_v2`` / ``deepseek_v3`` (``deepseek_v2.py``): MLA attention -- ``q_proj`` (or ``q_a_proj`` to
  ``q_lora_rank`` then ``q_b_proj``), ``kv_a_proj_with_mqa`` to ``kv_lora_rank + qk_rope_head_dim`` (replicated),
  ``kv_b_proj`` to ``heads x (qk_nope_head_dim + v_head_dim)``, ``o_proj`` from ``heads x v_head_dim``; dense MLPs
  for the first ``first_k_dense_replace`` layers, then ``n_routed_experts`` experts of ``moe_intermediate_size`` and
  ``n_shared_experts`` shared ones.
* ``granite`` (``vllm/model_executor/models/granite.py``, vLLM 0.19.0): Llama's layers and parameters (fused
  ``qkv_proj`` and ``gate_up_proj``, RMSNorms, tied embeddings where the config ties them); its
  ``embedding_multiplier``, ``residual_multiplier``, ``attention_multiplier`` and ``logits_scaling`` are scalars
  applied in the forward, so it is planned as the Llama family.
* multimodal wrappers (``mistral3.py`` with ``pixtral.py``'s encoder; ``gemma3_mm.py`` with ``siglip.py``): the
  ``text_config`` as its hand family, plus the vision encoder and projector vLLM loads beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from vramguard.engines.vllm_quant import WeightFormat, weight_format
from vramguard.errors import ConfigError
from vramguard.spec import ModelSpec, spec_from_config
from vramguard.plan.choice import choose

VLLM_FAMILIES = ("gpt_oss", "deepseek_v2", "deepseek_v3", "mistral3", "gemma3", "granite")


@dataclass(frozen=True)
class MlaShape:
    """DeepSeek's multi-head latent attention (config.json names)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    first_k_dense_replace: int


@dataclass(frozen=True)
class VisionTower:
    """A multimodal checkpoint's vision encoder and projector, as vLLM loads them (model dtype, whole on every
    rank of the first pipeline stage).

    Attributes:
        kind: ``pixtral`` (Mistral-3) or ``siglip`` (Gemma-3).
        params: parameters of the encoder and the projector.
        hidden_size, intermediate_size: the encoder's widths.
        max_patches: patches of the largest image the profile run encodes.
        tokens_per_image: language-model tokens that image becomes.
    """

    kind: str
    params: int
    hidden_size: int
    intermediate_size: int
    max_patches: int
    tokens_per_image: int


@dataclass(frozen=True)
class VllmModel:
    """What vLLM loads: ``text`` (a hand-style spec of the language model), its ``fmt`` and optional parts."""

    text: ModelSpec
    fmt: WeightFormat
    mla: MlaShape | None = None
    vision: VisionTower | None = None
    expert_bias: bool = False
    attention_sinks: bool = False


def vllm_model(spec: ModelSpec, quantization: str | None = None, hand_written: bool | None = None) -> VllmModel:
    """The :class:`VllmModel` of ``spec`` (``quantization``: vLLM's engine argument, e.g. ``bitsandbytes``;
    ``hand_written``: the memory model :func:`vramguard.plan.choice.choose` gives is a hand family's; None: asked
    of it here).

    Raises:
        ConfigError: a quantization format or a generic family vramguard does not model for vLLM.
    """
    cfg = spec.config_dict()
    fmt = weight_format(cfg, quantization)
    if hand_written is None:
        hand_written = not choose(spec).model.needs_transformers
    if hand_written:
        return VllmModel(spec, fmt)
    kind = str(cfg.get("model_type"))
    if kind == "gpt_oss":
        text = replace(spec, generic=False, model_type="gpt_oss", qkv_bias=True, o_bias=True,
                       moe_intermediate_size=int(cfg["intermediate_size"]),
                       num_experts_per_tok=int(cfg.get("num_experts_per_tok") or cfg.get("experts_per_token") or 4))
        return VllmModel(text, fmt, expert_bias=True, attention_sinks=True)
    if kind in ("deepseek_v2", "deepseek_v3"):
        return _deepseek(spec, cfg, fmt)
    if kind in ("mistral3", "gemma3"):
        return _multimodal(spec, cfg, kind, fmt)
    if kind == "granite":
        text = spec_from_config({**cfg, "model_type": "llama"}, name=spec.name, source=spec.source)
        return VllmModel(replace(text, config_json=spec.config_json), fmt)
    raise ConfigError("config.json:model_type", kind, "a family with a vLLM model here (hand families, "
                      + ", ".join(VLLM_FAMILIES) + ")", "plan it for transformers, the default engine")


def _deepseek(spec: ModelSpec, cfg: dict, fmt: WeightFormat) -> VllmModel:
    nope, rope = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    mla = MlaShape(q_lora_rank=cfg.get("q_lora_rank") or None, kv_lora_rank=int(cfg["kv_lora_rank"]),
                   qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=int(cfg["v_head_dim"]),
                   first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0))
    moe = int(cfg.get("moe_intermediate_size") or 0)
    text = replace(spec, generic=False, num_kv_heads=spec.num_heads, head_dim=nope + rope,
                   num_experts=int(cfg.get("n_routed_experts") or 0), moe_intermediate_size=moe,
                   num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
                   shared_expert_intermediate_size=int(cfg.get("n_shared_experts") or 0) * moe,
                   intermediate_size=int(cfg["intermediate_size"]), layer_types=("full_attention",) * spec.num_layers)
    return VllmModel(text, fmt, mla=mla)


def _multimodal(spec: ModelSpec, cfg: dict, kind: str, fmt: WeightFormat) -> VllmModel:
    text_cfg = dict(cfg.get("text_config") or {})
    text_cfg.setdefault("model_type", "mistral" if kind == "mistral3" else "gemma3_text")
    text_cfg.setdefault("torch_dtype", cfg.get("torch_dtype") or cfg.get("dtype"))
    text_cfg.setdefault("quantization_config", cfg.get("quantization_config"))
    text = spec_from_config(text_cfg, name=spec.name, source=spec.source)
    vision_cfg = cfg.get("vision_config") or {}
    vision = _pixtral(vision_cfg, text.hidden_size, cfg) if kind == "mistral3" else \
        _siglip(vision_cfg, text.hidden_size, int(cfg.get("mm_tokens_per_image") or 256))
    return VllmModel(replace(text, config_json=spec.config_json), fmt, vision=vision)


def _pixtral(v: dict, text_hidden: int, cfg: dict) -> VisionTower:
    """Pixtral's encoder (``pixtral.py::VisionTransformer``: a bias-free patch convolution, RMSNorms, attention
    and a gated MLP without biases) and Mistral-3's projector (``mistral3.py``: RMSNorm, a patch merger of
    ``spatial_merge_size**2`` patches, two linears to the text width, with biases when
    ``multimodal_projector_bias``)."""
    h, i = int(v.get("hidden_size", 1024)), int(v.get("intermediate_size", 4096))
    n = int(v.get("num_hidden_layers", 24))
    patch, image, ch = int(v.get("patch_size", 14)), int(v.get("image_size", 1540)), int(v.get("num_channels", 3))
    merge = int(cfg.get("spatial_merge_size", 2))
    encoder = ch * patch * patch * h + h + n * (4 * h * h + 3 * h * i + 2 * h)
    bias = bool(cfg.get("multimodal_projector_bias", False))
    projector = h + h * merge * merge * h + h * text_hidden + text_hidden * text_hidden + (2 * text_hidden if bias
                                                                                             else 0)
    patches = (image // patch) ** 2
    return VisionTower("pixtral", encoder + projector, h, i, patches, patches // (merge * merge))


def _siglip(v: dict, text_hidden: int, tokens_per_image: int) -> VisionTower:
    """SigLIP's encoder (``siglip.py``: patch convolution and position embeddings, attention and MLP with biases,
    two LayerNorms per layer, a final LayerNorm) and Gemma-3's projector (``gemma3_mm.py``: an RMSNorm and one
    ``vision x text`` matrix)."""
    h, i = int(v.get("hidden_size", 1152)), int(v.get("intermediate_size", 4304))
    n = int(v.get("num_hidden_layers", 27))
    patch, image, ch = int(v.get("patch_size", 14)), int(v.get("image_size", 896)), int(v.get("num_channels", 3))
    patches = (image // patch) ** 2
    encoder = ch * patch * patch * h + h + patches * h + n * (4 * (h * h + h) + 2 * h * i + i + h + 4 * h) + 2 * h
    return VisionTower("siglip", encoder + h + h * text_hidden, h, i, patches, tokens_per_image)
