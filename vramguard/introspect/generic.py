"""The planner's memory functions for any architecture, answered by transformers itself: weights from the meta-device
module tree and the quantizer's rules (:mod:`vramguard.introspect.build`), forward peaks and KV cache from a replay
of the real forward (:mod:`vramguard.introspect.replay`). Same return types as the hand-written family models in
:mod:`vramguard.memory`; :class:`vramguard.introspect.model.TransformersModel` answers the planner's
:class:`~vramguard.memory.model.MemoryModel` with them.

Two cache variants are not replayed but derived from the replayed 16-bit cache, by the same rules as the hand
models (:mod:`vramguard.memory.kv`): a quantized cache (int8/int4, transformers ``QuantizedCache``) stores each
attention K/V tensor in the quantized format; an offloaded cache keeps the two largest layers on the GPU.
"""

from __future__ import annotations

from functools import lru_cache

from vramguard.dtypes import TORCH_BYTES
from vramguard.errors import ConfigError, NotModelled, NotPlannable
from vramguard.hub.headers import read_local_header
from vramguard.introspect.build import (_quiet, cached_config, cached_structure, config_refused, meta_model,
                                      suspect_fields, text_config)
from vramguard.introspect.mixers import kernel_paths as paths
from vramguard.introspect.replay_trim import stretched_replay, trimmed_replay
from vramguard.memory.forward import ForwardPeak
from vramguard.memory.kv import SCALE_ZERO_BYTES, KvBytes
from vramguard.memory.model import LoadPlan
from vramguard.memory.runtime import RESERVE_SEGMENT_BYTES
from vramguard.memory.weights import LinearGroup, WeightBytes, quantized_tensor_bytes, rounded
from vramguard.settings import DTYPE_BYTES, KV_BITS, Settings, short_dtype


def _config(spec):
    if not spec.config_json:
        raise ConfigError("model", spec.name, "a model with its config.json",
                          "plan a model folder, a config.json or a catalog name")
    return cached_config(spec.config_json, spec.name)


def _text(spec):
    return text_config(_config(spec))


# ---- weights ------------------------------------------------------------------------------------------------------
def _structure(config_json: str, name: str, dtype: str, quant: str, double_quant: bool, compute: str):
    return cached_structure(config_json, name, dtype, quant, double_quant, compute)


def structure_of(spec, s: Settings):
    """The :class:`~vramguard.introspect.build.Structure` transformers loads for ``spec`` with ``s``."""
    return _structure(spec.config_json, spec.name, s.act_dtype, s.quant if s.is_bnb else s.weight_dtype,
                      s.double_quant, s.resolved_compute_dtype)


def weight_bytes(spec, s: Settings) -> WeightBytes:
    """Weight memory of the model transformers builds, every tensor rounded to 512 B as the allocator holds it.

    Quantized layers take the bitsandbytes layout of :func:`vramguard.memory.weights.quantized_tensor_bytes`;
    every other parameter the dtype the meta model gives it (``s.act_dtype``, float32 where transformers keeps a
    module in float32). Buffers (rotary ``inv_freq``...) are ``buffer_bytes``.
    """
    return weights_of(structure_of(spec, s), _embedding_names(spec), s)


def weights_of(st, embed_names: dict[str, frozenset[str]], s: Settings) -> WeightBytes:
    """:func:`weight_bytes` of the structure ``st`` with its embeddings' parameter names (``input``, ``output``)."""
    q_lin = q_state = dense = embed = lm_head = norms = bias = buffers = n_q = n_params = 0
    for t in st.tensors:
        if t.kind == "buffer":
            buffers += rounded(t.nbytes)
            continue
        n_params += t.numel
        if t.kind == "quantized":
            w, state = quantized_tensor_bytes(t.numel, t.dtype, s.double_quant, t.out_features)
            q_lin += w
            q_state += state
            n_q += t.numel
            continue
        nbytes = rounded(t.nbytes)
        if t.name in embed_names["output"]:
            lm_head += nbytes
        elif t.name in embed_names["input"]:
            embed += nbytes
        elif t.name.endswith("bias"):
            bias += nbytes
        elif len(t.shape) == 1:
            norms += nbytes
        else:
            dense += nbytes
    return WeightBytes(q_lin, q_state, dense, embed, lm_head, norms, bias, n_params, n_q, buffers)


@lru_cache(maxsize=32)
def _embedding_names_cached(config_json: str, name: str) -> dict[str, frozenset[str]]:
    model = meta_model(cached_config(config_json, name), "bf16")
    out_mod, in_mod = model.get_output_embeddings(), model.get_input_embeddings()
    from torch import nn
    names: dict[str, set[str]] = {"input": set(), "output": set()}
    for n, m in model.named_modules():
        if out_mod is not None and m is out_mod:
            names["output"] |= {f"{n}.{p}" for p, _ in m.named_parameters()}
        if (in_mod is not None and m is in_mod) or isinstance(m, nn.Embedding):  # token and position tables
            names["input"] |= {f"{n}.{p}" for p, _ in m.named_parameters()}
    names["output"] -= names["input"]  # tied: counted once, as the embedding
    return {k: frozenset(v) for k, v in names.items()}


@lru_cache(maxsize=16)
def _learned_positions(config_json: str, name: str) -> int | None:
    from torch import nn

    model = meta_model(cached_config(config_json, name), "bf16")
    cfg = text_config(cached_config(config_json, name))
    ctx = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    inp = model.get_input_embeddings()
    for m in model.modules():
        if isinstance(m, nn.Embedding) and m is not inp and ctx and m.num_embeddings == ctx:
            return int(ctx)
    return None


def learned_positions(spec) -> int | None:
    """The number of learned position embeddings (GPT-2's ``wpe``: an ``nn.Embedding`` of the context's size beside
    the token embeddings), which no context setting can exceed; None for RoPE, ALiBi and other schemes."""
    return _learned_positions(spec.config_json, spec.name) if spec.config_json else None


def _embedding_names(spec) -> dict[str, frozenset[str]]:
    return _embedding_names_cached(spec.config_json, spec.name)


def linear_groups(spec, s: Settings | None = None) -> list[LinearGroup]:
    """The layers the quantizer converts (one group per shape), and the output embedding, for findings."""
    s = s or Settings()
    st = structure_of(spec, s if s.is_bnb else s.with_(quant="nf4"))
    shapes: dict[tuple[int, int], int] = {}
    for t in st.tensors:
        if t.kind == "quantized":
            shapes[t.shape] = shapes.get(t.shape, 0) + 1
    return [LinearGroup(f"linear {o}x{i}", o, i, n) for (o, i), n in sorted(shapes.items())]


# ---- the forward ------------------------------------------------------------------------------------------------
def _replay_model(config_json: str, name: str, dtype: str, attn: str, sdpa_kernel: str):
    from vramguard.introspect.replay import cached_replay_model
    return cached_replay_model(config_json, name, dtype, attn, sdpa_kernel)


@lru_cache(maxsize=512)
def _replayed(config_json: str, name: str, s: Settings, past: int, chunk: int):
    from vramguard.introspect.replay import replay
    found = stretched_replay(config_json, name, s, past, chunk)  # periodic in the tokens: from a few lengths
    if found is None:
        found = trimmed_replay(config_json, name, s, past, chunk)  # a few layers traced, the rest repeated
    if found is not None:
        return found
    model, _note = _replay_model(config_json, name, s.act_dtype, s.effective_attn, s.sdpa_kernel)
    quantized = set(_structure(config_json, name, s.act_dtype, s.quant, s.double_quant,
                               s.resolved_compute_dtype).quantized_modules) if s.is_bnb else set()
    cfg = text_config(cached_config(config_json, name))
    return replay(model, cfg, s, past, chunk, quantized)


def replayed(spec, s: Settings, past: int, chunk: int):
    """The replay of one forward, memoized on the settings it depends on (a quantized or offloaded cache is
    replayed as the dynamic 16-bit cache it is derived from; lengths other than a static cache's are arguments)."""
    same = {"batch": s.sequences, "num_beams": 1, "num_return_sequences": 1, "do_sample": False,
            "prefill_chunk": None, "max_cache_len": None, "kv_dtype": None}
    if s.cache == "static":
        canonical = s.with_(prompt_tokens=1, max_new_tokens=s.cache_len - 1, **same)
    else:
        canonical = s.with_(prompt_tokens=1, max_new_tokens=0, cache="dynamic", **same)
    try:
        return _replayed(spec.config_json, spec.name, canonical, past, chunk)
    except (ArithmeticError, RuntimeError, ValueError, TypeError, KeyError, IndexError, AttributeError,
            NotModelled) as e:
        config = cached_config(spec.config_json, spec.name)
        if suspect_fields(config):
            raise config_refused(config, "in its forward", e) from None
        where = f"{chunk} tokens after {past}" + (f", a {s.cache} cache" if s.cache != "dynamic" else "")
        raise NotPlannable("settings", where, "settings this architecture's forward runs with",
                           f"transformers' forward raised {type(e).__name__}: {str(e).splitlines()[0][:200]}; "
                           "try the default cache (dynamic) and attention (sdpa); where those fail too, compare "
                           "the config's head counts and sizes with the published model's (a count that does not "
                           "divide another, more experts per token than experts)") from None


def replay_note(spec, s: Settings) -> str | None:
    """What the replay substituted for ``s`` (an attention implementation transformers refuses), or None."""
    return _replay_model(spec.config_json, spec.name, s.act_dtype, s.effective_attn, s.sdpa_kernel)[1]


def kernel_paths(spec, s: Settings):
    """The kernel-backed functions of the forward replayed for ``s`` and the path each takes
    (:func:`vramguard.introspect.mixers.kernel_paths`)."""
    return paths(_replay_model(spec.config_json, spec.name, s.act_dtype, s.effective_attn, s.sdpa_kernel)[0])


def experts_path(spec, s: Settings) -> str | None:
    """The experts implementation the replayed forward of ``spec`` with ``s`` takes: the config's
    ``_experts_implementation`` as transformers resolved it on the model it built (``"grouped_mm"`` by default,
    ``"eager"`` where the class cannot dispatch; ``PreTrainedModel.get_correct_experts_implementation``), read off
    its first experts module that dispatches on it (``integrations.moe.use_experts_implementation``); None for a
    model without one."""
    model = _replay_model(spec.config_json, spec.name, s.act_dtype, s.effective_attn, s.sdpa_kernel)[0]
    for m in model.modules():
        if hasattr(m, "is_concatenated") and hasattr(m, "has_gate"):
            return getattr(getattr(m, "config", None), "_experts_implementation", None)
    return None


def _quantized_kv(r, s: Settings) -> tuple[int, int]:
    """(bytes of the cache in ``s``'s quantized format, bytes of its largest layer in 16-bit), from the replayed
    16-bit attention K/V tensors (4-D, tokens on dim -2); other cache tensors are kept as they are."""
    total = largest16 = 0
    per_layer: dict[int, int] = {}
    bits = KV_BITS[s.resolved_kv_dtype]
    for layer, _attr, shape, dtype in r.cache_tensors:
        numel = 1
        for d in shape:
            numel *= d
        elem = DTYPE_BYTES.get(short_dtype(dtype) or "bf16", 2)
        per_layer[layer] = per_layer.get(layer, 0) + rounded(numel * elem)
        if len(shape) != 4:
            total += rounded(numel * elem)
            continue
        tokens = shape[-2]
        resid = min(tokens, s.kv_residual_length)
        per_tok = numel // max(tokens, 1)
        quant = (tokens - resid) * per_tok
        total += rounded(-(-quant * bits // 8)) + rounded(-(-quant // s.kv_group_size) * SCALE_ZERO_BYTES) \
            + rounded(resid * per_tok * elem)
    largest16 = max(per_layer.values(), default=0)
    return total, largest16


def forward_peak(spec, s: Settings, past: int, chunk: int, phase: str = "prefill") -> ForwardPeak:
    """Peak bytes above the weights of one forward (see the module docstring), as
    :func:`vramguard.memory.forward.forward_peak`."""
    r = replayed(spec, s, past, chunk)
    comps = dict(r.components)
    peak = r.peak_bytes
    kv16 = comps.get("kv_cache", 0)
    if s.resolved_kv_dtype in ("int8", "int4"):
        q, largest16 = _quantized_kv(r, s)
        extra = 4 * largest16 // 2 if past else 0  # QuantizedLayer.update: dequantized K, V and their concatenation
        comps["kv_cache"] = q + extra
        peak += q + extra - kv16
    elif s.cache == "offloaded":
        on_gpu = sum(sorted(r.cache_bytes)[-2:])
        comps["kv_cache"] = min(on_gpu, kv16)
        peak += comps["kv_cache"] - kv16
    return ForwardPeak(phase, past, chunk, peak, {k: v for k, v in comps.items() if v}, r.at, r.largest_alloc)


def kv_cache_bytes(spec, s: Settings, n_tokens: int, in_prefill_chunk: int = 0) -> KvBytes:
    """The cache transformers holds after ``n_tokens`` (every tensor of the cache object, allocator-rounded)."""
    r = replayed(spec, s, max(n_tokens - 1, 0), 1) if n_tokens > 1 else replayed(spec, s, 0, 1)
    per_layer = list(r.cache_bytes)
    total = sum(per_layer)
    if s.resolved_kv_dtype in ("int8", "int4"):
        total, _ = _quantized_kv(r, s)
    largest = max(per_layer, default=0) // 2
    full = sum(b for b, t in zip(per_layer, _layer_kinds(spec, len(per_layer))) if t != "sliding_attention")
    sliding = total - full if s.resolved_kv_dtype not in ("int8", "int4") else 0
    if s.cache == "offloaded":
        return KvBytes(sum(sorted(per_layer)[-2:]), total, full, sliding, n_tokens, largest)
    return KvBytes(total, 0, full if sliding else total, sliding, n_tokens, largest)


def _layer_kinds(spec, n: int) -> tuple[str, ...]:
    """Each layer's kind: the config.json's ``layer_types``, else those of the config transformers builds (Falcon-H1's
    ``hybrid``: attention and Mamba-2 side by side), else ``full_attention``; padded to ``n`` layers."""
    kinds = tuple(spec.layer_types)
    if set(kinds) <= {"full_attention"} and spec.config_json:
        named = getattr(_text(spec), "layer_types", None)
        if isinstance(named, (list, tuple)) and len(named) == spec.num_layers:
            kinds = tuple(str(t) for t in named)
    return kinds + ("full_attention",) * max(n - len(kinds), 0)


def _raw_per_layer(r) -> tuple[int, ...]:
    """Bytes of each layer's cache tensors without the allocator's rounding (growth per token is below 512 B on
    small models)."""
    per: dict[int, int] = {}
    for layer, _attr, shape, dtype in r.cache_tensors:
        n = 1
        for d in shape:
            n *= d
        per[layer] = per.get(layer, 0) + n * TORCH_BYTES.get(dtype, 2)
    return tuple(per.get(i, 0) for i in range(max(per) + 1)) if per else ()


def layer_kinds(spec) -> list[str]:
    """Each decoder layer's kind as the config names it (``full_attention``, ``sliding_attention``,
    ``linear_attention``, ``mamba``...; ``full_attention`` when the config lists none)."""
    return list(_layer_kinds(spec, spec.num_layers))[:spec.num_layers]


def kv_growth_per_token(spec, s: Settings, n_tokens: int) -> dict[str, int]:
    """Bytes the next token adds to each layer kind's cache once ``n_tokens`` are held, measured on the cache
    transformers creates (the replayed caches after ``n_tokens`` and ``n_tokens + 1``): a linear-attention or
    recurrent state adds 0, a sliding layer adds 0 once its window is full, an MLA layer its compressed latent."""
    after = _raw_per_layer(replayed(spec, s, n_tokens, 1))
    before = _raw_per_layer(replayed(spec, s, n_tokens - 1, 1)) if n_tokens >= 1 else (0,) * len(after)
    out: dict[str, int] = {}
    kinds = _layer_kinds(spec, len(after))
    for i, (a, b) in enumerate(zip(after, before)):
        out[kinds[i]] = out.get(kinds[i], 0) + max(a - b, 0)
    for k in layer_kinds(spec):
        out.setdefault(k, 0)
    return out


def kv_bytes_per_token(spec, s: Settings) -> int:
    """Bytes one more token adds to the cache at the run's length, over every layer (before allocator rounding)."""
    return sum(kv_growth_per_token(spec, s, max(s.total_tokens - 1, 1)).values())


# ---- loading ------------------------------------------------------------------------------------------------------
# the caching allocator rounds a large request up to 2 MiB (kRoundLarge, c10/cuda/CUDACachingAllocator.cpp)
WARMUP_ROUND = 2 << 20


def load_plan(spec, s: Settings) -> LoadPlan:
    """The :class:`LoadPlan` of ``spec`` loaded with ``s`` (any spec that carries its config.json).

    Raises:
        ConfigError: the spec has no config.json (planned from bare numbers).
    """
    _config(spec)
    st = structure_of(spec, s)
    return load_plan_of(weight_bytes(spec, s), st, _converted(spec, st), s)


def load_plan_of(w: WeightBytes, st, converted: dict[str, tuple[int, int]], s: Settings) -> LoadPlan:
    """:func:`load_plan` from the weights ``w``, the structure ``st`` and the parameters fused at load
    (``converted``: name -> (bytes, operations))."""
    per_quantized = {"nf4": 0.5, "fp4": 0.5, "int8": 1.0}
    warm = 0.0
    transient = 0
    for t in st.tensors:
        if t.kind == "buffer":
            continue
        if t.kind == "quantized":
            warm += t.numel * per_quantized[t.dtype]
            transient = max(transient, rounded(t.numel * DTYPE_BYTES[s.act_dtype]))
        else:
            warm += t.nbytes
    warmup = int(warm) // 2 * 2
    warmup = -(-warmup // WARMUP_ROUND) * WARMUP_ROUND
    for nbytes, n_ops in converted.values():
        transient = max(transient, nbytes * (1 + n_ops))
    return LoadPlan(w.total_bytes, warmup, transient, w.total_bytes + transient + RESERVE_SEGMENT_BYTES,
                    tuple(sorted(converted)))


@lru_cache(maxsize=16)
def _conversion_rules(config_json: str, name: str) -> tuple:
    """transformers' WeightConverters for the model (``conversion_mapping.get_model_conversion_mapping``) that
    change tensors (not renames): ``((source patterns, target patterns, number of operations, the operations'
    class names), ...)``."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter
    except ImportError:
        return ()
    with _quiet():
        rules = get_model_conversion_mapping(meta_model(cached_config(config_json, name), "bf16"))
    return tuple((tuple(r.source_patterns), tuple(r.target_patterns), len(r.operations),
                  tuple(type(o).__name__ for o in r.operations)) for r in rules
                 if isinstance(r, WeightConverter) and r.operations)


def _converted(spec, st) -> dict[str, tuple[int, int]]:
    """Parameters transformers fuses at load from several checkpoint tensors: name -> (bytes, operations)."""
    return {name: (rounded(t.nbytes), len(ops)) for name, (t, ops, _) in conversions(spec, st).items()}


def conversions(spec, st) -> dict[str, tuple]:
    """The parameters of structure ``st`` that transformers makes at load from several checkpoint tensors (a MoE's
    experts, stacked from one tensor per expert; ``core_model_loading.WeightConverter``): name -> (its
    :class:`~vramguard.introspect.build.TensorInfo`, the operations' class names in order, the number of source
    patterns, 0 where one conversion makes several parameters). A checkpoint whose headers show the parameter stored
    fused already has none; without headers every convertible parameter is listed (the larger load)."""
    import re
    keys = _checkpoint_keys(spec.source)
    out: dict[str, tuple] = {}
    for source_patterns, target_patterns, _n, ops in _conversion_rules(spec.config_json, spec.name):
        sources = [re.compile(p.replace(".", r"\.").replace("*", r"\d+")) for p in source_patterns]
        if keys is not None and not any(src.search(k) for src in sources for k in keys):
            continue  # stored already fused
        for t in st.tensors:
            if any(t.name.endswith(target) for target in target_patterns):
                out[t.name] = (t, ops, len(source_patterns) if len(target_patterns) == 1 else 0)
    return out


@lru_cache(maxsize=16)
def _checkpoint_keys(source: str) -> tuple[str, ...] | None:
    """Tensor names of the safetensors checkpoint in folder ``source`` (headers only), or None without one or when a
    header cannot be read (then every convertible parameter is planned as converted, the larger need)."""
    from pathlib import Path
    folder = Path(source)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return None
    keys: list[str] = []
    for f in files:
        try:  # the checked reader: a FIFO or a damaged file is refused, never waited on
            keys += [k for k in read_local_header(f)[0] if k != "__metadata__"]
        except (ConfigError, OSError):  # an unreadable header: the layout is unknown, planned as unfused
            return None
    return tuple(keys)
