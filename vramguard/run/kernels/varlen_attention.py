"""``kernels.varlen_attention``: attention of packed variable-length sequences, as continuous batching lays them out.

Continuous batching packs every request of a step into one sequence: query tokens ``[T, H, D]`` with the cumulative
query lengths ``cu_q`` (``[S + 1]``), and each request's keys and values read back from the paged cache, packed the
same way: ``[Tk, Hkv, D]`` with ``cu_k``. Request ``s``'s queries are the last ``cu_q[s+1] - cu_q[s]`` positions of its
``cu_k[s+1] - cu_k[s]`` keys (causal, aligned bottom-right).

transformers' SDPA path for this layout copies the cache per layer (``repeat_kv`` to every query head) and attends
every query to every key of the step under a block-diagonal mask, so its work grows with the square of the requests.
Here:

* a request with one query token (a decode) runs :func:`decode_attention_varlen`: split-K ("flash-decoding", Dao et
  al. 2023, https://crfm.stanford.edu/2023/10/12/flashdecoding.html), program ``(request, kv_head, split)`` reads
  only its own keys for the ``G`` query heads of that KV head (GQA without copies) with an online softmax (Milakov
  & Gimelshein 2018), then a merge kernel combines the splits;
* a request with several query tokens (a prefill or a prefill chunk) runs PyTorch's SDPA on its own keys, causal
  aligned bottom-right (``torch.nn.attention.bias.causal_lower_right``).

:func:`reference_varlen_attention` is the same function in float64 torch (one softmax per request), for the tests.
"""

from __future__ import annotations

import math

BLOCK_L = 64  # keys per inner step of the decode kernel
TARGET_PROGRAMS = 512  # (request, kv head, split) programs to aim for: about four per multiprocessor on an H200

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = tl = None


def reference_varlen_attention(q, k, v, cu_q: list[int], cu_k: list[int], scaling: float):
    """Float64 causal attention per request, bottom-right aligned. ``q`` ``[T, H, D]``, ``k``/``v`` ``[Tk, Hkv, D]``,
    ``cu_q``/``cu_k`` host lists of ``S + 1`` offsets. Returns ``[T, H, D]`` float64."""
    import torch
    g = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s in range(len(cu_q) - 1):
        qs = q[cu_q[s]:cu_q[s + 1]].double().transpose(0, 1)  # [H, lq, D]
        ks = k[cu_k[s]:cu_k[s + 1]].double().repeat_interleave(g, dim=1).transpose(0, 1)
        vs = v[cu_k[s]:cu_k[s + 1]].double().repeat_interleave(g, dim=1).transpose(0, 1)
        lq, lk = qs.shape[1], ks.shape[1]
        allowed = torch.arange(lk)[None, :] <= (torch.arange(lq)[:, None] + lk - lq)
        w = (qs @ ks.transpose(-1, -2)) * scaling
        w = torch.softmax(w.masked_fill(~allowed, float("-inf")), dim=-1)
        out[cu_q[s]:cu_q[s + 1]] = (w @ vs).transpose(0, 1)
    return out


def split_plan(requests: int, kv_heads: int, max_len: int) -> tuple[int, int]:
    """(splits, keys per split) for ``requests`` decodes of at most ``max_len`` keys: about
    :data:`TARGET_PROGRAMS` programs in all, each split a multiple of :data:`BLOCK_L` keys."""
    want = max(1, math.ceil(TARGET_PROGRAMS / max(requests * kv_heads, 1)))
    splits = max(1, min(want, math.ceil(max_len / BLOCK_L)))
    chunk = math.ceil(math.ceil(max_len / splits) / BLOCK_L) * BLOCK_L
    return math.ceil(max_len / chunk), chunk


if tl is not None:
    @triton.jit
    def _attend_block(q, k_ptr, v_ptr, ridx_ptr, offs, end, hk, rd, m_i, l_i, acc, scaling, stride_kt, stride_kh,
                      stride_vt, stride_vh, IEEE: tl.constexpr, INDEXED: tl.constexpr):
        """One block of keys ``offs`` (those < ``end``) into the online softmax (running max, sum, output); with
        INDEXED, key ``j`` is row ``ridx[j]`` of the cache (the paged cache's read index), else row ``j``."""
        ok = offs < end
        if INDEXED:
            rows = tl.load(ridx_ptr + offs, mask=ok, other=0).to(tl.int64)
        else:
            rows = offs.to(tl.int64)
        kt = tl.load(k_ptr + rows[:, None] * stride_kt + hk * stride_kh + rd[None, :], mask=ok[:, None], other=0.0)
        if IEEE:
            sc = tl.dot(q, tl.trans(kt), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(kt))
        sc = tl.where(ok[None, :], sc * scaling, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block with no key yet: weights 0, not NaN
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(sc - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt = tl.load(v_ptr + rows[:, None] * stride_vt + hk * stride_vh + rd[None, :], mask=ok[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        return m_new, l_i, acc

    @triton.jit
    def _request_query(i, seq_ptr, cu_q_ptr, HAS_SEQ: tl.constexpr):
        """Program ``i``'s request ``s`` (``seq_ptr[i]`` when HAS_SEQ, else ``i``), the row ``t`` of its last query
        token, and whether it has one (a padding request's offsets plateau: none)."""
        if HAS_SEQ:
            s = tl.load(seq_ptr + i)
        else:
            s = i
        t = tl.load(cu_q_ptr + s + 1) - 1
        return s, t, t >= tl.load(cu_q_ptr + s)

    @triton.jit
    def _varlen_split_kernel(q_ptr, k_ptr, v_ptr, ridx_ptr, cu_q_ptr, cu_k_ptr, seq_ptr, acc_ptr, ml_ptr, scaling,
                             chunk,
                             n_req, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                             H: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                             BL: tl.constexpr, HAS_SEQ: tl.constexpr, IEEE: tl.constexpr, DYNAMIC: tl.constexpr,
                             MAX_ITER: tl.constexpr, INDEXED: tl.constexpr):
        """Split ``sp`` of request ``i`` (``seq_ptr[i]`` when HAS_SEQ) for KV head ``hk``: its last query token
        against keys ``cu_k[s] + sp*chunk ..`` (at most ``chunk``): unnormalised output [G, D], max and sum [G].
        A request without query tokens (padding: offsets that plateau) reads nothing."""
        i = tl.program_id(0)
        hk = tl.program_id(1)
        sp = tl.program_id(2)
        s, t, has_q = _request_query(i, seq_ptr, cu_q_ptr, HAS_SEQ)
        k_end = tl.load(cu_k_ptr + s + 1)
        start = tl.load(cu_k_ptr + s) + sp * chunk
        end = tl.where(has_q, tl.minimum(k_end, start + chunk), start)
        rg = tl.arange(0, G_PAD)
        rd = tl.arange(0, D)
        rl = tl.arange(0, BL)
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        q = tl.load(q_ptr + t.to(tl.int64) * stride_qt + (hk * G + rg)[:, None] * stride_qh + rd[None, :],
                    mask=(rg < G)[:, None], other=0.0)
        if DYNAMIC:  # compiled: the loop runs over this split's keys only
            for it in range(0, tl.cdiv(end - start, BL)):
                m_i, l_i, acc = _attend_block(q, k_ptr, v_ptr, ridx_ptr, start + it * BL + rl, end, hk, rd, m_i, l_i,
                                              acc, scaling, stride_kt, stride_kh, stride_vt, stride_vh, IEEE, INDEXED)
        else:  # Triton's interpreter takes no runtime loop bound: the longest split's steps, masked
            for it in tl.static_range(MAX_ITER):
                m_i, l_i, acc = _attend_block(q, k_ptr, v_ptr, ridx_ptr, start + it * BL + rl, end, hk, rd, m_i, l_i,
                                              acc, scaling, stride_kt, stride_kh, stride_vt, stride_vh, IEEE, INDEXED)
        row = (sp * n_req + i) * H + hk * G + rg
        ok_g = rg < G
        tl.store(acc_ptr + row[:, None].to(tl.int64) * D + rd[None, :], acc, mask=ok_g[:, None])
        tl.store(ml_ptr + row.to(tl.int64) * 2, m_i, mask=ok_g)
        tl.store(ml_ptr + row.to(tl.int64) * 2 + 1, l_i, mask=ok_g)

    @triton.jit
    def _varlen_merge_kernel(acc_ptr, ml_ptr, cu_q_ptr, seq_ptr, out_ptr, n_req, splits, stride_ot, stride_oh,
                             H: tl.constexpr, D: tl.constexpr, S_PAD: tl.constexpr, HAS_SEQ: tl.constexpr):
        """Program (i, h): the splits of request i, query head h, merged with weights exp(m_s - max m) into the
        request's query row. Split 0 holds the request's first key, so the max is finite; an empty split has max
        -inf and sum 0 (weight 0). A request without query tokens writes nothing (and computes no NaN: every split
        of it is empty)."""
        i = tl.program_id(0)
        h = tl.program_id(1)
        s, t, has_q = _request_query(i, seq_ptr, cu_q_ptr, HAS_SEQ)
        rs = tl.arange(0, S_PAD)
        rd = tl.arange(0, D)
        ok = rs < splits
        row = ((rs * n_req + i) * H + h).to(tl.int64)
        m_s = tl.load(ml_ptr + row * 2, mask=ok, other=float("-inf"))
        l_s = tl.load(ml_ptr + row * 2 + 1, mask=ok, other=0.0)
        a_s = tl.load(acc_ptr + row[:, None] * D + rd[None, :], mask=ok[:, None], other=0.0)
        m_max = tl.max(m_s, axis=0)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # a request without queries: weights 0, not NaN
        w = tl.where(ok, tl.exp(m_s - m_max), 0.0)
        den = tl.sum(l_s * w, axis=0)
        res = tl.sum(a_s * w[:, None], axis=0) / tl.where(den == 0.0, 1.0, den)  # its row is not written anyway
        tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + rd, res.to(out_ptr.dtype.element_ty),
                 mask=(rd < D) & has_q)


def _interpreted() -> bool:
    import os
    return os.environ.get("TRITON_INTERPRET") == "1"


def decode_attention_varlen(q, k, v, cu_q, cu_k, out, max_len: int, scaling: float, read_index=None, seqs=None,
                            n_req: int | None = None) -> None:
    """Write into ``out`` the attention of each request's last query token over its own keys (a decode).

    Args:
        q: ``[T, H, D]``; k, v: ``[rows, Hkv, D]`` (last dimension contiguous), ``H % Hkv == 0``, ``D`` a power of
            two >= 16. cu_q, cu_k: int32/int64 device tensors of ``S + 1`` offsets (read on the device); a request
            whose query offsets do not advance (padding) is skipped.
        out: ``[T, H, D]``, written at each processed request's last query row only.
        max_len: an upper bound of the processed requests' key counts (host int; sizes the splits, so a CUDA graph
            captured with it serves any length up to it).
        read_index: optional int64 device tensor: key ``j`` of the packed keys is row ``read_index[j]`` of ``k`` /
            ``v`` (the paged cache itself); None: row ``j``.
        seqs: optional device tensor of the request indices to process (default: all ``S``); n_req: their count.

    Raises:
        ValueError: a shape the kernel does not take.
    """
    import torch
    h, d = q.shape[1], q.shape[2]
    hkv = k.shape[1]
    if h % hkv or d < 16 or d & (d - 1) or k.stride(-1) != 1 or v.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError(f"varlen decode attention: q {tuple(q.shape)}, k {tuple(k.shape)}: need heads a multiple "
                         "of KV heads, head_dim a power of two >= 16, contiguous last dims")
    n = int(n_req if n_req is not None else cu_q.numel() - 1)
    if n == 0:
        return
    g = h // hkv
    splits, chunk = split_plan(n, hkv, max(int(max_len), 1))
    acc = torch.empty((splits, n, h, d), dtype=torch.float32, device=q.device)
    ml = torch.empty((splits, n, h, 2), dtype=torch.float32, device=q.device)
    has_seq = seqs is not None
    interp = _interpreted()
    sp = seqs if has_seq else cu_q
    ridx = read_index if read_index is not None else cu_q
    _varlen_split_kernel[(n, hkv, splits)](
        q, k, v, ridx, cu_q, cu_k, sp, acc, ml, float(scaling), chunk, n, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), H=h, G=g, G_PAD=max(16, triton.next_power_of_2(g)), D=d,
        BL=BLOCK_L, HAS_SEQ=has_seq, IEEE=q.dtype == torch.float32, DYNAMIC=not interp,
        MAX_ITER=chunk // BLOCK_L if interp else 0, INDEXED=read_index is not None, num_warps=4)
    _varlen_merge_kernel[(n, h)](acc, ml, cu_q, sp, out, n, splits, out.stride(0), out.stride(1), H=h, D=d,
                                 S_PAD=max(2, triton.next_power_of_2(splits)), HAS_SEQ=has_seq, num_warps=4)


def _prefill_backends(q):
    """On CUDA, SDPA limited to its flash, memory-efficient and math backends for the step's prefills: the cuDNN
    backend (first in PyTorch's order on an H100/H200) builds an execution plan at the first call of each new
    (query, key) length pair, and a prefill chunk's lengths change with the step's mix of requests."""
    import contextlib
    if not q.is_cuda:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def prefill_attention(q, k, v, out, scaling: float) -> None:
    """One request's causal attention (bottom-right aligned) by PyTorch's SDPA, written into ``out``.
    ``q``/``out`` ``[lq, H, D]``, ``k``/``v`` ``[lk, Hkv, D]`` with ``lk >= lq``."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    g = q.shape[1] // k.shape[1]
    lq, lk = q.shape[0], k.shape[0]
    qh = q.transpose(0, 1).unsqueeze(0)
    kh = k.transpose(0, 1).unsqueeze(0)
    vh = v.transpose(0, 1).unsqueeze(0)
    if g > 1:  # GQA: one copy of this request's keys only (SDPA's enable_gqa is not taken by every backend)
        kh = kh.repeat_interleave(g, dim=1)
        vh = vh.repeat_interleave(g, dim=1)
    if lq == lk:
        res = sdpa(qh, kh, vh, is_causal=True, scale=scaling)
    elif lq == 1:
        res = sdpa(qh, kh, vh, scale=scaling)
    else:
        from torch.nn.attention.bias import causal_lower_right
        res = sdpa(qh, kh, vh, attn_mask=causal_lower_right(lq, lk), scale=scaling)
    out.copy_(res[0].transpose(0, 1))


def varlen_attention(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scaling: float, use_triton: bool = True,
                     read_index=None, host=None):
    """Causal attention of packed requests (module docstring): ``q`` ``[T, H, D]``; ``k``/``v`` ``[Tk, Hkv, D]``
    packed, or with ``read_index`` the paged cache's rows (:func:`decode_attention_varlen`); ``cu_q``/``cu_k`` device
    offsets, ``max_q``/``max_k`` host upper bounds of the per-request lengths. Returns ``[T, H, D]`` in ``q.dtype``
    (rows of padding requests zero). A step of decodes only (``max_q == 1``) reads nothing back to the host, so it can
    be captured in a CUDA graph; a step with a prefill reads the offsets once (one synchronisation).
    ``use_triton`` False: every request through SDPA. ``host``: the offsets already read, ``(cu_q list, cu_k
    list, decode request indices on the device or None)`` (a caller running several layers on one step reads them
    once: :func:`host_offsets`)."""
    import torch
    out = torch.zeros_like(q)
    if max_q == 1 and use_triton:
        decode_attention_varlen(q, k, v, cu_q, cu_k, out, max_k, scaling, read_index=read_index)
        return out
    lq, lk, seqs = host if host is not None else host_offsets(cu_q, cu_k, use_triton)
    decodes = []
    with _prefill_backends(q):
        for s in range(len(lq) - 1):
            if lq[s + 1] - lq[s] == 1 and use_triton:
                decodes.append(s)
            elif lq[s + 1] > lq[s]:
                keys = slice(lk[s], lk[s + 1])
                ks, vs = (k[keys], v[keys]) if read_index is None else (k.index_select(0, read_index[keys]),
                                                                        v.index_select(0, read_index[keys]))
                prefill_attention(q[lq[s]:lq[s + 1]], ks, vs, out[lq[s]:lq[s + 1]], scaling)
    if decodes:
        longest = max(lk[s + 1] - lk[s] for s in decodes)
        decode_attention_varlen(q, k, v, cu_q, cu_k, out, longest, scaling, read_index=read_index, seqs=seqs,
                                n_req=len(decodes))
    return out


def host_offsets(cu_q, cu_k, use_triton: bool = True):
    """``(cu_q, cu_k, decodes)``: the offsets as host lists (one synchronisation) and the indices of the requests
    with one query token as an int32 device tensor (None when there is none or ``use_triton`` is False)."""
    import torch
    lq, lk = cu_q.tolist(), cu_k.tolist()
    dec = [s for s in range(len(lq) - 1) if lq[s + 1] - lq[s] == 1] if use_triton else []
    return lq, lk, torch.tensor(dec, dtype=torch.int32, device=cu_q.device) if dec else None
