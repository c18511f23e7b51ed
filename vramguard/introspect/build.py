"""The model as transformers builds it: its config with class defaults, its module tree on the meta device, and the
modules the bitsandbytes quantizer really converts. Needs torch and transformers; allocates no memory.

Sources (transformers 5.17-5.24): ``AutoConfig.for_model`` applies the config class's defaults (a config.json
without ``tie_word_embeddings`` gets the class's value); ``AutoModelForCausalLM.from_config`` under
``torch.device("meta")`` builds the same module tree ``from_pretrained`` fills; ``PreTrainedModel.tie_weights``
shares tied parameters; ``_get_dtype_plan`` keeps ``_keep_in_fp32_modules`` in float32; the quantizer's own
``preprocess_model`` (``quantizers/quantizer_bnb_4bit.py``, ``integrations/bitsandbytes.py::replace_with_bnb_linear``)
swaps ``nn.Linear`` and ``Conv1D`` outside ``get_modules_to_not_convert`` for bitsandbytes layers, so fused MoE
experts (3-D ``nn.Parameter``) stay 16-bit exactly where transformers leaves them so.
"""

from __future__ import annotations

import contextlib
import copy
import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from vramguard.errors import ConfigError
from vramguard.extras import import_bitsandbytes

from vramguard.settings import TORCH_DTYPE_NAMES as TORCH_DTYPES


def _torch_dtype(name: str):
    import torch
    return getattr(torch, TORCH_DTYPES[name])


@contextlib.contextmanager
def _quiet():
    """transformers logs warnings while building some configs and models (deprecated keys, kernels not found) and
    while replaying them (reference fallbacks of missing kernels): hold them back, errors still show."""
    import warnings

    from transformers.utils import logging as hf_logging
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


def config_from_dict(cfg: dict[str, Any], name: str = "model"):
    """The ``PretrainedConfig`` transformers builds from a config.json dict, class defaults applied.

    Raises:
        ConfigError: the ``model_type`` is unknown to the installed transformers, or the config is rejected by it.
    """
    from transformers import AutoConfig, PretrainedConfig
    decode = getattr(PretrainedConfig, "_decode_special_floats", None)  # {"__float__": "Infinity"} as saved
    cfg = decode(cfg) if decode else cfg
    model_type = cfg.get("model_type")
    if not model_type:
        raise ConfigError("config.json:model_type", None, "the model_type of a transformers architecture",
                          f"the config of {name} names no model_type")
    kwargs = {k: v for k, v in cfg.items() if k not in ("model_type", "transformers_version")}
    try:
        with _quiet():
            return AutoConfig.for_model(model_type, **kwargs)
    except ValueError as e:
        import transformers
        raise ConfigError("config.json:model_type", model_type,
                          f"a model_type transformers {transformers.__version__} knows",
                          "upgrade transformers if the architecture is newer "
                          f"({str(e).splitlines()[0][:120]})") from None
    except Exception as e:  # noqa: BLE001 - transformers' config validation raises many types
        raise ConfigError("config.json", name, "a config transformers accepts",
                          f"transformers rejected it: {type(e).__name__}: {str(e)[:200]}") from None


def text_config(config):
    """The language model's config (a multimodal wrapper's ``text_config``; the config itself otherwise)."""
    return config.get_text_config(decoder=True)


def attention_support(config) -> dict[str, bool]:
    """Which attention implementations the causal-LM class transformers loads for ``config`` accepts: its own
    ``_supports_sdpa`` and ``_supports_flash_attn`` flags (``PreTrainedModel._sdpa_can_dispatch`` refuses the
    load otherwise). Unknown classes are taken to accept both."""
    from transformers import AutoModelForCausalLM
    try:
        cls = AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ValueError):
        return {"sdpa": True, "flash_attention_2": True}
    return {"sdpa": bool(getattr(cls, "_supports_sdpa", True)),
            "flash_attention_2": bool(getattr(cls, "_supports_flash_attn", getattr(cls, "_supports_flash_attn_2",
                                                                                   True)))}


@dataclass(frozen=True)
class TensorInfo:
    """One parameter or buffer the loaded model keeps on the GPU.

    ``kind`` is ``param``, ``buffer`` or ``quantized`` (a bitsandbytes layer's weight, ``quant`` its format);
    ``numel`` counts the original (unquantized) values; ``nbytes`` is ``numel x element size`` for 16/32-bit
    tensors (the quantized layout is computed by :mod:`vramguard.memory.weights`).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    numel: int
    nbytes: int
    kind: str
    out_features: int = 0


def _dtype_name(dt) -> str:
    return str(dt).removeprefix("torch.")


def _apply_dtype_plan(model, dtype) -> dict[str, str]:
    """Parameter names ``_keep_in_fp32_modules`` keeps in float32 for this dtype: transformers' dtype plan, matched
    as its loader matches it (``core_model_loading.build_glob_alternation`` and ``search``)."""
    plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
    if not plan:
        return {}
    from transformers.core_model_loading import build_glob_alternation
    alt, by_group, _ = build_glob_alternation(list(plan))
    out = {}
    for name, _ in model.named_parameters():
        hit = alt.search(name)
        if hit is not None and hit.lastgroup is not None:
            out[name] = _dtype_name(plan[by_group[hit.lastgroup]])
    return out


def _bnb_config(quant: str, double_quant: bool, compute_dtype: str):
    from transformers import BitsAndBytesConfig
    if quant == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant, bnb_4bit_use_double_quant=double_quant,
                              bnb_4bit_compute_dtype=_torch_dtype(compute_dtype))


def _quantize_meta(model, qcfg) -> tuple[set[str], str]:
    """Swap the layers bitsandbytes converts, as ``from_pretrained`` does; return their module names and how.

    With bitsandbytes importable this is transformers' own quantizer (``preprocess_model``). Without it, the same
    rule from transformers' own functions: ``nn.Linear`` (exact type) and ``Conv1D`` modules not matched by
    ``get_modules_to_not_convert`` (checked equal to the quantizer in the tests).
    """
    import torch
    try:
        bnb = import_bitsandbytes()  # its import-time notice held back: planning runs no kernel
        from transformers.quantizers import AutoHfQuantizer
        quantizer = AutoHfQuantizer.from_config(qcfg, pre_quantized=False)
        with _quiet(), torch.device("meta"):
            quantizer.preprocess_model(model=model, dtype=None, device_map={"": "cuda"}, checkpoint_files=None,
                                       use_kernels=False)
        names = {n for n, m in model.named_modules() if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))}
        return names, "transformers' bitsandbytes quantizer (preprocess_model)"
    except ImportError:
        pass
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import HfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module
    skip = HfQuantizer.get_modules_to_not_convert(model, qcfg.llm_int8_skip_modules, model._keep_in_fp32_modules)
    names = {n for n, m in model.named_modules()
             if (type(m) is torch.nn.Linear or isinstance(m, Conv1D)) and should_convert_module(n, skip)}
    return names, "transformers' get_modules_to_not_convert (bitsandbytes not installed)"


@dataclass(frozen=True)
class Structure:
    """What ``from_pretrained`` keeps for one model and settings: every tensor, tied ones once."""

    model_class: str
    tensors: tuple[TensorInfo, ...]
    quantized_modules: tuple[str, ...]
    quantizer_rule: str
    tied: tuple[str, ...]


def meta_model(config, dtype: str, attn: str = "eager"):
    """The model transformers builds for ``config`` on the meta device, weights tied (no memory is allocated).

    ``attn`` is the ``attn_implementation``; eager (the default) is accepted by every architecture.

    Raises:
        ConfigError: transformers has no causal-LM class for the config, or building it fails.
    """
    import torch
    from transformers import AutoModelForCausalLM
    try:
        with _quiet(), torch.device("meta"):
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=_torch_dtype(dtype),
                                                     attn_implementation=attn)
    except ValueError as e:
        first = str(e).splitlines()[0]
        if "attention implementation" in first:
            raise ConfigError("attn", attn, "an attention implementation the model class supports",
                              first.split(". Please")[0][:200]) from None
        raise ConfigError("config.json:model_type", getattr(config, "model_type", None),
                          "a causal language model (AutoModelForCausalLM)",
                          f"transformers has no causal-LM class for it ({first[:160]})") from None
    except (ArithmeticError, RuntimeError, TypeError, IndexError, KeyError, AttributeError) as e:
        raise config_refused(config, "building the model", e) from None
    model.tie_weights()
    model.eval()
    return model


# a config field whose name holds one of these counts or sizes something, and is at least 1 in any model
_SIZE_WORDS = ("size", "dim", "heads", "experts", "interval", "step", "kernel", "layers", "moe_k", "per_tok", "rank")


def suspect_fields(config) -> dict[str, int]:
    """The fields of ``config`` (and of its text config) that count or size something (:data:`_SIZE_WORDS`), are
    below 1 and differ from their class's default (``chunk_size_feed_forward=0`` is the default: no chunking): the
    values a model class divides by or makes tensors of."""
    out: dict[str, int] = {}
    text = getattr(config, "text_config", None)
    for cfg in (config,) if text is None or text is config else (config, text):
        try:
            defaults = vars(type(cfg)())
        except Exception:  # noqa: BLE001 - a class that cannot be built bare: every such field is a suspect
            defaults = {}
        for k, v in vars(cfg).items():
            if isinstance(v, int) and not isinstance(v, bool) and v < 1 and any(w in k for w in _SIZE_WORDS) \
                    and defaults.get(k, object()) != v:
                out[k] = v
    return out


def config_refused(config, what: str, e: Exception) -> ConfigError:
    """The ConfigError for transformers raising ``e`` while ``what`` (building the model, running its forward) for
    ``config``, naming its counts and sizes below 1 where there are any (:func:`suspect_fields`)."""
    first = (str(e).strip().splitlines() or [""])[0][:200]
    said = f"transformers raised {type(e).__name__} {what} ({first})"
    suspects = suspect_fields(config)
    if not suspects:
        return ConfigError("config.json", getattr(config, "model_type", None),
                           "a config transformers can build and run a model of",
                           f"{said}; compare the config's sizes and head counts with the published model's")
    (name, value), *others = suspects.items()
    also = f" (and {', '.join(f'{k}={v}' for k, v in others)})" if others else ""
    return ConfigError(f"config.json:{name}", value, "a count or size of at least 1",
                       f"{said}; set {name}{also} to the published model's value")


def structure(config, dtype: str, quant: str, double_quant: bool = True, compute_dtype: str | None = None,
              model=None) -> Structure:
    """Every parameter and buffer the loaded model keeps, with dtype, tying and quantization.

    ``quant``: ``nf4``/``fp4``/``int8`` (bitsandbytes) or ``bf16``/``fp16``/``fp32`` (unquantized, ``dtype``
    applies). ``model``: a meta model to reuse (it is modified when quantizing).
    """
    import torch
    model = model if model is not None else meta_model(config, dtype)
    fp32_keep = _apply_dtype_plan(model, _torch_dtype(dtype))
    qnames: set[str] = set()
    rule = "not quantized"
    if quant in ("nf4", "fp4", "int8"):
        qnames, rule = _quantize_meta(model, _bnb_config(quant, double_quant, compute_dtype or dtype))
    seen: dict[int, str] = {}
    tied: list[str] = []
    out: list[TensorInfo] = []
    quant_weights = {f"{n}.weight" for n in qnames}
    for name, p in model.named_parameters(remove_duplicate=False):
        key = id(p)
        if key in seen:
            tied.append(f"{name} = {seen[key]}")
            continue
        seen[key] = name
        if name in quant_weights:
            mod = model.get_submodule(name.rsplit(".", 1)[0])
            numel = int(mod.in_features) * int(mod.out_features) if hasattr(mod, "in_features") else p.numel()
            out.append(TensorInfo(name, (int(mod.out_features), int(mod.in_features)), quant, numel, 0,
                                  "quantized", int(mod.out_features)))
            continue
        dt = fp32_keep.get(name, _dtype_name(p.dtype))
        if name.rsplit(".", 1)[0] in qnames:  # a converted layer's bias: loaded in the model dtype (bitsandbytes
            dt = TORCH_DTYPES[dtype]           # creates it float32 on meta; tests check the loaded dtype)
        elem = torch.empty((), dtype=getattr(torch, dt)).element_size()
        out.append(TensorInfo(name, tuple(p.shape), dt, p.numel(), p.numel() * elem, "param"))
    for name, b in model.named_buffers(remove_duplicate=True):
        out.append(TensorInfo(name, tuple(b.shape), _dtype_name(b.dtype), b.numel(), b.numel() * b.element_size(),
                              "buffer"))
    return Structure(type(model).__name__, tuple(out), tuple(sorted(qnames)), rule, tuple(tied))


@lru_cache(maxsize=32)
def cached_structure(config_json: str, name: str, dtype: str, quant: str, double_quant: bool, compute: str):
    """:func:`structure` of the config ``config_json`` (:func:`cached_config`), memoized."""
    return structure(cached_config(config_json, name), dtype, quant, double_quant, compute)


@lru_cache(maxsize=8)
def cached_config(config_json: str, name: str):
    """:func:`config_from_dict` memoized by the config's JSON text (plans solve many settings on one config)."""
    return config_from_dict(json.loads(config_json), name)
