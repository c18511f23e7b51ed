"""``kernels.decode_attention``: one query token against a static KV cache, over the filled length only.

The method is split-K ("flash-decoding", Dao et al. 2023, https://crfm.stanford.edu/2023/10/12/flashdecoding.html):
the cache length is cut into ``splits`` chunks; program ``(kv_head, split)`` computes the softmax-weighted sum of
its chunk for the ``G`` query heads that share ``kv_head`` (GQA: query head ``h`` reads KV head ``h // G``, as
transformers' ``repeat_kv`` does, but nothing is copied), keeping the running max and sum (online softmax,
Milakov & Gimelshein 2018); a second kernel merges the chunks. The filled length is ``position + 1``, read from the
device, so chunks past it read nothing and one captured CUDA graph serves every length: decode reads the KV bytes
that exist, not the static cache's full length, and needs no attention mask.

:func:`reference_decode_attention` is the same function in torch (``repeat_kv`` then a softmax over the filled
slots), for the tests. :func:`register` adds :data:`ATTN_NAME` to transformers' ``AttentionInterface``; a model
switched to it (``model.set_attn_implementation``) runs decode steps here and anything else through SDPA.
"""

from __future__ import annotations

import math

ATTN_NAME = "vramguard_decode"
BLOCK_L = 64  # keys per inner step
TARGET_PROGRAMS = 256  # split programs to aim for (about two per multiprocessor on an H200's 132)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = tl = None


def reference_decode_attention(q, k, v, position: int, scaling: float):
    """Float64 ``softmax(q k^T * scaling) v`` over cache slots ``0..position``; ``q`` ``[1, H, 1, D]``, ``k`` and ``v``
    ``[1, Hkv, L, D]``. Returns ``[1, 1, H, D]`` (transformers' attention output layout)."""
    import torch
    g = q.shape[1] // k.shape[1]
    kk = k[:, :, : position + 1].double().repeat_interleave(g, dim=1)
    vv = v[:, :, : position + 1].double().repeat_interleave(g, dim=1)
    w = torch.softmax((q.double() @ kk.transpose(-1, -2)) * scaling, dim=-1)
    return (w @ vv).transpose(1, 2)


def split_plan(max_len: int, kv_heads: int) -> tuple[int, int]:
    """(splits, iterations of :data:`BLOCK_L` keys per split) for a cache of ``max_len`` slots: about
    :data:`TARGET_PROGRAMS` programs in all, each chunk a multiple of :data:`BLOCK_L`."""
    want = max(1, TARGET_PROGRAMS // max(kv_heads, 1))
    iters = max(1, math.ceil(max_len / (want * BLOCK_L)))
    return math.ceil(max_len / (iters * BLOCK_L)), iters


if tl is not None:
    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, acc_ptr, ml_ptr, scaling,
                      stride_qh, stride_kh, stride_kl, stride_vh, stride_vl, SPLITS,
                      G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BL: tl.constexpr, ITERS: tl.constexpr,
                      IEEE: tl.constexpr):
        """One chunk of one KV head: unnormalised output [G_PAD, D], running max and sum [G_PAD]. ``SPLITS`` follows
        the cache length every :data:`BLOCK_L` x ``ITERS`` slots, so it is a run-time integer (as a constexpr each new
        prompt length would compile the kernel again, in every process); ``ITERS`` changes every
        ``TARGET_PROGRAMS / Hkv`` x :data:`BLOCK_L` slots (2,048 for 8 KV heads)."""
        hk = tl.program_id(0)
        sp = tl.program_id(1)
        length = tl.load(pos_ptr).to(tl.int32) + 1
        start = sp * (ITERS * BL)
        rg = tl.arange(0, G_PAD)
        rd = tl.arange(0, D)
        rl = tl.arange(0, BL)
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        if start < length:
            q = tl.load(q_ptr + (hk * G + rg)[:, None] * stride_qh + rd[None, :], mask=(rg < G)[:, None], other=0.0)
            for it in range(ITERS):
                offs = start + it * BL + rl
                ok = offs < length
                kt = tl.load(k_ptr + hk * stride_kh + offs[:, None] * stride_kl + rd[None, :], mask=ok[:, None],
                             other=0.0)
                if IEEE:
                    s = tl.dot(q, tl.trans(kt), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(kt))
                s = tl.where(ok[None, :], s * scaling, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                vt = tl.load(v_ptr + hk * stride_vh + offs[:, None] * stride_vl + rd[None, :], mask=ok[:, None],
                             other=0.0)
                if IEEE:
                    acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
                m_i = m_new
        base = (hk * SPLITS + sp) * G_PAD
        tl.store(acc_ptr + (base + rg)[:, None] * D + rd[None, :], acc)
        tl.store(ml_ptr + (base + rg) * 2, m_i)
        tl.store(ml_ptr + (base + rg) * 2 + 1, l_i)

    @triton.jit
    def _merge_kernel(acc_ptr, ml_ptr, out_ptr, SPLITS, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                      S_PAD: tl.constexpr):
        """Merge the chunks of query head hk*G + g (program (hk, g)) in one pass: weights exp(m_s - max m).
        Chunk 0 always holds key 0, so the max is finite; empty chunks carry max -inf and sum 0 (weight 0)."""
        hk = tl.program_id(0)
        g = tl.program_id(1)
        rs = tl.arange(0, S_PAD)
        rd = tl.arange(0, D)
        row = (hk * SPLITS + rs) * G_PAD + g
        ok = rs < SPLITS
        m_s = tl.load(ml_ptr + row * 2, mask=ok, other=float("-inf"))
        l_s = tl.load(ml_ptr + row * 2 + 1, mask=ok, other=0.0)
        a_s = tl.load(acc_ptr + row[:, None] * D + rd[None, :], mask=ok[:, None], other=0.0)
        w = tl.exp(m_s - tl.max(m_s, axis=0))
        out = tl.sum(a_s * w[:, None], axis=0) / tl.sum(l_s * w, axis=0)
        tl.store(out_ptr + (hk * G + g) * D + rd, out.to(out_ptr.dtype.element_ty))


def decode_attention(q, k, v, position, scaling: float):
    """Attention of one query token over cache slots ``0..position`` (``position``: long tensor, one element, on
    the device: read there, never on the host).

    Args:
        q: ``[1, H, 1, D]``; k, v: ``[1, Hkv, L, D]`` with ``H % Hkv == 0`` (the static cache's full tensors),
            last dimension contiguous. scaling: the softmax scale (``head_dim ** -0.5`` for Llama).

    Returns:
        ``[1, 1, H, D]`` in ``q.dtype``.

    Raises:
        ValueError: a shape this kernel does not take (batch or query length above 1, ``H % Hkv``, ``D`` not a
            power of two of at least 16).
    """
    import torch
    b, h, s, d = q.shape
    hkv, max_len = k.shape[1], k.shape[2]
    if b != 1 or s != 1 or h % hkv or d < 16 or d & (d - 1) or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(f"decode attention: q {tuple(q.shape)}, k {tuple(k.shape)}: need batch 1, one query, "
                         "heads a multiple of KV heads, head_dim a power of two >= 16, contiguous last dims")
    g = h // hkv
    g_pad = max(16, triton.next_power_of_2(g))
    splits, iters = split_plan(max_len, hkv)
    acc = torch.empty((hkv, splits, g_pad, d), dtype=torch.float32, device=q.device)
    ml = torch.empty((hkv, splits, g_pad, 2), dtype=torch.float32, device=q.device)
    out = torch.empty((1, 1, h, d), dtype=q.dtype, device=q.device)
    _split_kernel[(hkv, splits)](q, k, v, position, acc, ml, float(scaling), q.stride(1), k.stride(1), k.stride(2),
                                 v.stride(1), v.stride(2), splits, G=g, G_PAD=g_pad, D=d, BL=BLOCK_L, ITERS=iters,
                                 IEEE=q.dtype == torch.float32, num_warps=4)
    _merge_kernel[(hkv, g)](acc, ml, out, splits, G=g, G_PAD=g_pad, D=d, S_PAD=triton.next_power_of_2(splits),
                            num_warps=4)
    return out


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention-function signature: decode steps (one query, ``position_ids`` given) run
    :func:`decode_attention`; any other call goes to transformers' SDPA function unchanged."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    pos = kwargs.get("position_ids")
    if query.shape[0] == 1 and query.shape[2] == 1 and pos is not None and pos.numel() == 1 and not dropout:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return decode_attention(query, key, value, pos.reshape(1), scale), None
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)


def register() -> str:
    """Add :data:`ATTN_NAME` to transformers' ``AttentionInterface`` (idempotent); returns the name."""
    from transformers import AttentionInterface
    AttentionInterface.register(ATTN_NAME, _attention)
    return ATTN_NAME
