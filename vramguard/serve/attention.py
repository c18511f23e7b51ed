"""The continuous-batching engine's attention: :mod:`vramguard.run.kernels.varlen_attention` on transformers' paged
cache, where the installed transformers and the model allow it; transformers' own paged SDPA otherwise.

transformers 5.17's continuous batching calls the attention function named ``paged|<name>`` with the paged cache
in its keyword arguments (``cache``, ``read_index``, ``write_index``, ``cu_seq_lens_q/k``, ``max_seqlen_q/k``;
``transformers/integrations/sdpa_paged.py`` is its SDPA function). The function registered here
(:data:`ATTN_NAME`, through transformers' public ``AttentionInterface``) writes and reads the cache exactly as that
one does (``cache.update``) and computes the attention per request instead of under one block-diagonal mask. The
engine builds no mask for a name other than ``paged|eager`` / ``paged|sdpa``
(``continuous_batching/utils.attn_mask_is_needed``). transformers 5.24 accepts no custom name for continuous batching
(``switch_to_cb_friendly_attn`` raises): the engine then keeps transformers' own.

Used only when every layer is full causal attention (no sliding window, soft-capping or sinks), the head size suits
the kernel, and :func:`self_check` agrees with a float64 reference on the model's device.
"""

from __future__ import annotations

import threading
import warnings

ATTN_NAME = "paged|vramguard_varlen"
ENABLED = True  # False: the engine keeps transformers' paged attention (for comparisons)
TOLERANCE = 2e-2  # relative (Frobenius); bfloat16 rounding alone is about 4e-3


def paged_varlen_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention-function signature for continuous batching (``query`` ``[1, H, T, D]``, ``key`` /
    ``value`` ``[1, Hkv, T, D]``, the step's paged-cache arguments in ``kwargs``); returns ``([1, T, H, D], None)``.

    Raises:
        ValueError: called without the paged cache (a standard forward), or with a dropout.
    """
    from vramguard.run.kernels.varlen_attention import varlen_attention
    cache = kwargs.get("cache")
    if cache is None or dropout:
        raise ValueError(f"{ATTN_NAME} runs inside continuous batching only (it needs the paged cache and no dropout)"
                         "; use 'sdpa' for a standard forward")
    read_index, write_index = kwargs["read_index"], kwargs["write_index"]
    rows, k, v = _cache_rows(cache, module.layer_idx, key, value, read_index, write_index)
    cu_k, max_k = kwargs["cu_seq_lens_k"], kwargs["max_seqlen_k"]
    if isinstance(cu_k, dict):  # one layer type (checked by eligible()): the dict holds it alone
        cu_k, max_k = next(iter(cu_k.values())), next(iter(max_k.values()))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q = query[0].transpose(0, 1)
    cu_q, max_q = kwargs["cu_seq_lens_q"], int(kwargs["max_seqlen_q"])
    host = _step_offsets(module.layer_idx, cu_q, cu_k, q.is_cuda) if max_q > 1 else None
    out = varlen_attention(q, k, v, cu_q, cu_k, max_q, int(max_k), scale, use_triton=q.is_cuda, read_index=rows,
                           host=host)
    return out.unsqueeze(0), None


_STEP = threading.local()  # per engine thread: the host offsets of the step being computed


def _step_offsets(layer_idx: int, cu_q, cu_k, use_triton: bool):
    """The step's offsets on the host, read once per forward (at its first layer, or when the offsets tensors are
    other objects than the last layer's) rather than once per layer: each read waits for the GPU."""
    from vramguard.run.kernels.varlen_attention import host_offsets
    key = (id(cu_q), id(cu_k), use_triton)
    if layer_idx == 0 or getattr(_STEP, "key", None) != key:
        _STEP.key, _STEP.host = key, host_offsets(cu_q, cu_k, use_triton)
    return _STEP.host


_EMPTY: dict = {}


def _cache_rows(cache, layer_idx: int, key, value, read_index, write_index):
    """Write the step's keys and values into the paged cache; returns (read rows, keys, values) for the attention:
    the cache's own tensors and the layer's read index (no copy of the cache), or ``None`` and the packed keys and
    values when nothing is read back (only fresh prefills) or this transformers' cache layout is not the known one
    (then ``cache.update`` gathers them, as transformers' SDPA path does)."""
    groups = getattr(cache, "layer_index_to_group_indices", None)
    if groups is None or not hasattr(cache, "key_cache"):
        k, v = cache.update(key_states=key, value_states=value, layer_idx=layer_idx, read_index=read_index,
                            write_index=write_index)
        return None, k, v
    group, in_group = groups[layer_idx]
    rows = read_index[group]
    if rows.numel() == 0:  # nothing to read: update() writes and returns the new states
        k, v = cache.update(key_states=key, value_states=value, layer_idx=layer_idx, read_index=read_index,
                            write_index=write_index)
        return None, k, v
    empty = _EMPTY.get(rows.device)
    if empty is None:
        empty = _EMPTY[rows.device] = rows.new_empty(0)
    cache.update(key_states=key, value_states=value, layer_idx=layer_idx, read_index=[empty] * len(read_index),
                 write_index=write_index)  # the write-only path
    return rows, cache.key_cache[in_group], cache.value_cache[in_group]


def eligible(model) -> str | None:
    """Why the model must keep transformers' attention (None: this one can run it): a layer that is not full causal
    attention, a head size the kernel does not take, or no CUDA device."""
    import torch
    cfg = model.config.get_text_config()
    if not torch.cuda.is_available() or not next(model.parameters()).is_cuda:
        return "the model is not on a CUDA device"
    types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"} or getattr(cfg, "sliding_window", None) not in (None, 0):
        return f"layers other than full attention ({', '.join(sorted(types))}; sliding window " \
               f"{getattr(cfg, 'sliding_window', None)})"
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, name, None):
            return f"{name} is set"
    if getattr(cfg, "model_type", "") in ("gpt_oss",):
        return "attention sinks"
    heads = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    if heads % kv or d < 16 or d & (d - 1):
        return f"head_dim {d} with {heads} heads over {kv} KV heads (the kernel takes a power of two >= 16)"
    return None


def self_check(device, dtype, heads: int, kv_heads: int, head_dim: int) -> float:
    """The relative difference of :func:`~vramguard.run.kernels.varlen_attention.varlen_attention` from its float64
    reference on a packed step of one fresh prefill, one prefill chunk and two decodes, on ``device`` in ``dtype``.

    Raises:
        RuntimeError: a difference of :data:`TOLERANCE` or more (or NaN), or the kernel failed to compile or run.
    """
    import torch

    from vramguard.run.kernels.varlen_attention import reference_varlen_attention, varlen_attention
    g = torch.Generator(device=device).manual_seed(0)
    lq, lk = [5, 3, 1, 1], [5, 9, 70, 130]
    cu_q = [0]
    cu_k = [0]
    for a, b in zip(lq, lk):
        cu_q.append(cu_q[-1] + a)
        cu_k.append(cu_k[-1] + b)
    q = torch.randn((cu_q[-1], heads, head_dim), generator=g, device=device).to(dtype)
    k = torch.randn((cu_k[-1], kv_heads, head_dim), generator=g, device=device).to(dtype)
    v = torch.randn((cu_k[-1], kv_heads, head_dim), generator=g, device=device).to(dtype)
    scale = head_dim ** -0.5
    want = reference_varlen_attention(q.cpu(), k.cpu(), v.cpu(), cu_q, cu_k, scale)
    worst = 0.0
    for rows in (slice(0, 4), slice(2, 4)):  # the mixed step, then decodes only
        cq = torch.tensor([c - cu_q[rows.start] for c in cu_q[rows.start:rows.stop + 1]], device=device,
                          dtype=torch.int32)
        ck = torch.tensor([c - cu_k[rows.start] for c in cu_k[rows.start:rows.stop + 1]], device=device,
                          dtype=torch.int32)
        qs = q[cu_q[rows.start]:cu_q[rows.stop]]
        ks, vs = k[cu_k[rows.start]:cu_k[rows.stop]], v[cu_k[rows.start]:cu_k[rows.stop]]
        got = varlen_attention(qs, ks, vs, cq, ck, max(lq[rows]), max(lk[rows]), scale, use_triton=q.is_cuda)
        ref = want[cu_q[rows.start]:cu_q[rows.stop]]
        err = float((got.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-30))
        if not err < TOLERANCE:
            raise RuntimeError(f"it differs from a float64 reference by {err:.3g} (relative)")
        worst = max(worst, err)
    return worst


def choose(model) -> tuple[str | None, str]:
    """Register :data:`ATTN_NAME` and switch ``model`` to it when :func:`eligible` and :func:`self_check` allow.
    Returns (the attention implementation it had, or None when nothing was switched; a note saying which attention
    the engine runs and why)."""
    why = eligible(model) if ENABLED else "vramguard's varlen attention switched off"
    if why is not None:
        return None, f"attention: transformers' paged attention ({why})"
    cfg = model.config.get_text_config()
    heads = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    p = next(model.parameters())
    dtype = model.dtype if model.dtype.is_floating_point else p.dtype
    try:
        err = self_check(p.device, dtype, heads, kv, d)
    except Exception as e:  # noqa: BLE001 - a kernel that fails its check is not used: report why
        return None, (f"attention: transformers' paged attention (vramguard's varlen attention failed its check: "
                      f"{type(e).__name__}: {str(e).splitlines()[0][:160]})")
    from transformers import AttentionInterface
    AttentionInterface.register(ATTN_NAME, paged_varlen_attention)
    before = model.config._attn_implementation
    try:
        with warnings.catch_warnings():  # 5.24 warns that the paged| prefix is deprecated, then refuses the name
            warnings.simplefilter("ignore", FutureWarning)
            model.set_attn_implementation(ATTN_NAME)
    except (ValueError, KeyError) as e:  # transformers >= 5.18 drops the paged| prefix of custom names
        if model.config._attn_implementation != before:
            model.set_attn_implementation(before)
        return None, (f"attention: transformers' paged attention (this transformers refused ours: "
                      f"{str(e).splitlines()[0][:120]})")
    return before, (f"attention: vramguard's varlen paged attention (per request, GQA without copies; checked "
                    f"against a float64 reference: {err:.1e} relative)")
