"""``kernels.fused``: the small steps of a Llama-style decode step, fused so that one token runs about nine kernels
per layer instead of about forty-five. Batch 1, one token.

* :func:`add_rms_norm`: ``residual + x`` and transformers' ``LlamaRMSNorm`` of the sum in one kernel
  (``weight * (h * rsqrt(mean(h**2) + eps)).to(dtype)``, float32 inside, rounded where transformers rounds).
* :func:`matmul_4bit_segments`: up to three 4-bit projections of the same input (q, k and v) in one launch,
  reading each weight as bitsandbytes stores it (:mod:`vramguard.run.kernels.nf4`): no copy of the weights.
* :func:`matmul_4bit_glu`: ``silu(x @ G.T) * (x @ U.T)`` (LlamaMLP's gate and up) in one launch: program ``n`` reads
  row ``n`` of both weights and writes the product, rounded as transformers rounds each of the three results.
* :func:`rope_cache_write`: rotary embedding of q and k (transformers' ``apply_rotary_pos_emb``: ``q * cos +
  rotate_half(q) * sin``, each product and the sum rounded to the activation dtype), k and v written into the
  static cache at the position read on the device, and the cache layer's length counter set to ``position + 1``.

Each has a torch reference in the same module's terms (the ``reference_*`` functions) that the tests compare
against, and the decode step checks each on the model's own weights before use
(:mod:`vramguard.run.fused_step`).
"""

from __future__ import annotations

from vramguard.run.kernels import nf4

# Warps per program of the fused 4-bit kernels; None: half of nf4.default_warps (four pieces per thread: on the
# H200 at Llama-3.1-8B's shapes, gate/up 36.0 us per layer at 1 warp against 38.0 at 2 and 41.9 at 4, q/k/v 13.9
# against 14.0 and 14.6; benchmarks/gpu_decode_fused.py).
WARPS = None

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = tl = None


def reference_add_rms_norm(x, residual, weight, eps: float):
    """transformers' ``residual + x`` then ``LlamaRMSNorm``: (normed, sum); ``residual`` None: no add."""
    import torch
    h = x if residual is None else residual + x
    f = h.float()
    normed = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(h.dtype), h


def reference_rope(x, cos, sin):
    """``x * cos + rotate_half(x) * sin`` over the last dimension (transformers' ``apply_rotary_pos_emb``)."""
    import torch
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


if tl is not None:
    @triton.jit
    def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, eps, N: tl.constexpr, BLOCK: tl.constexpr,
                             HAS_RES: tl.constexpr):
        """One program: sum = x + res (rounded to the activation dtype, stored), out = w * rms_norm(sum)."""
        r = tl.arange(0, BLOCK)
        ok = r < N
        h = tl.load(x_ptr + r, mask=ok, other=0.0).to(tl.float32)
        if HAS_RES:
            h = h + tl.load(res_ptr + r, mask=ok, other=0.0).to(tl.float32)
            h16 = h.to(sum_ptr.dtype.element_ty)
            tl.store(sum_ptr + r, h16, mask=ok)
            h = h16.to(tl.float32)
        inv = tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
        y = (h * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + r, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + r, (w * y).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _segments_kernel(x_ptr, code_ptr, out_ptr,
                         w0, a0, b0, c0, o0, w1, a1, b1, c1, o1, w2, a2, b2, c2, o2, N0, N1, N2,
                         K: tl.constexpr, NH: tl.constexpr, BS: tl.constexpr, NESTED: tl.constexpr,
                         X_PAIRS: tl.constexpr, X_BF16: tl.constexpr, LUT_ASM: tl.constexpr, R: tl.constexpr,
                         LUT_F16: tl.constexpr):
        """Program i: outputs i*R .. i*R+R-1 of [x @ W0.T, x @ W1.T, x @ W2.T] (N0, N1, N2 rows; R divides N0
        and N1, so a program stays in one weight)."""
        n = tl.program_id(0) * R
        x_even, x_odd = nf4._load_x(x_ptr, n >= 0, K, NH, X_PAIRS, X_BF16)
        if n < N0:
            w_hi, w_lo, scale = nf4._load_row(w0, a0, b0, c0, o0, code_ptr, n, N0, K, NH, BS, NESTED, LUT_ASM, R,
                                              LUT_F16)
        elif n < N0 + N1:
            w_hi, w_lo, scale = nf4._load_row(w1, a1, b1, c1, o1, code_ptr, n - N0, N1, K, NH, BS, NESTED, LUT_ASM,
                                              R, LUT_F16)
        else:
            w_hi, w_lo, scale = nf4._load_row(w2, a2, b2, c2, o2, code_ptr, n - N0 - N1, N2, K, NH, BS, NESTED,
                                              LUT_ASM, R, LUT_F16)
        rows = n + tl.arange(0, R)
        total = nf4._row_dot(w_hi, w_lo, scale, x_even, x_odd)
        tl.store(out_ptr + rows, total.to(out_ptr.dtype.element_ty), mask=rows < N0 + N1 + N2)

    @triton.jit
    def _glu_kernel(x_ptr, code_ptr, out_ptr, wg, ag, bg, cg, og, wu, au, bu, cu, ou, N,
                    K: tl.constexpr, NH: tl.constexpr, BS: tl.constexpr, NESTED: tl.constexpr,
                    X_PAIRS: tl.constexpr, X_BF16: tl.constexpr, LUT_ASM: tl.constexpr, R: tl.constexpr,
                         LUT_F16: tl.constexpr):
        """Program i, for its R outputs n: silu(g) * u for g = x @ G[n], u = x @ U[n]; g, silu(g), u and the
        product each rounded to the output dtype, as transformers' ``act_fn(gate_proj(x)) * up_proj(x)`` rounds."""
        n = tl.program_id(0) * R
        x_even, x_odd = nf4._load_x(x_ptr, n >= 0, K, NH, X_PAIRS, X_BF16)
        g_hi, g_lo, g_scale = nf4._load_row(wg, ag, bg, cg, og, code_ptr, n, N, K, NH, BS, NESTED, LUT_ASM, R,
                                            LUT_F16)
        u_hi, u_lo, u_scale = nf4._load_row(wu, au, bu, cu, ou, code_ptr, n, N, K, NH, BS, NESTED, LUT_ASM, R,
                                            LUT_F16)
        dt = out_ptr.dtype.element_ty
        g = nf4._row_dot(g_hi, g_lo, g_scale, x_even, x_odd).to(dt).to(tl.float32)
        u = nf4._row_dot(u_hi, u_lo, u_scale, x_even, x_odd).to(dt).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        rows = n + tl.arange(0, R)
        tl.store(out_ptr + rows, (s * u).to(dt), mask=rows < N)

    @triton.jit
    def _rope_cache_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, q_out_ptr, k_ptr, v_ptr, len_ptr,
                           stride_kh, stride_kl, stride_vh, stride_vl, HQ: tl.constexpr, HKV: tl.constexpr,
                           D: tl.constexpr, HAS_LEN: tl.constexpr):
        """Program h < HQ: query head h rotated into q_out; < HQ + HKV: key head rotated into the cache at the
        position; else value head copied there. Program 0 sets the length counter to position + 1."""
        h = tl.program_id(0)
        pos = tl.load(pos_ptr)
        rd = tl.arange(0, D)
        if h < HQ + HKV:
            dt = q_out_ptr.dtype.element_ty
            x = tl.load(qkv_ptr + h * D + rd).to(tl.float32)
            partner = tl.load(qkv_ptr + h * D + (rd + D // 2) % D).to(tl.float32)
            rot = tl.where(rd < D // 2, -partner, partner)  # rotate_half
            c = tl.load(cos_ptr + pos * D + rd).to(tl.float32)
            s = tl.load(sin_ptr + pos * D + rd).to(tl.float32)
            y = ((x * c).to(dt).to(tl.float32) + (rot * s).to(dt).to(tl.float32)).to(dt)
            if h < HQ:
                tl.store(q_out_ptr + h * D + rd, y)
            else:
                tl.store(k_ptr + (h - HQ) * stride_kh + pos * stride_kl + rd, y.to(k_ptr.dtype.element_ty))
        else:
            v = tl.load(qkv_ptr + h * D + rd)
            tl.store(v_ptr + (h - HQ - HKV) * stride_vh + pos * stride_vl + rd, v.to(v_ptr.dtype.element_ty))
        if HAS_LEN:
            if h == 0:
                tl.store(len_ptr, pos + 1)


def _x_mode(x):
    """(the x argument, X_PAIRS, X_BF16) for one contiguous row ``x`` ``[K]`` (16-bit x read as int32 pairs)."""
    import torch
    pairs = x.dtype in (torch.bfloat16, torch.float16) and x.data_ptr() % 4 == 0
    return (x.view(torch.int32) if pairs else x), pairs, x.dtype == torch.bfloat16


def _lut(code, x, pairs: bool) -> str:
    return nf4._lut_string(code) if nf4.LUT and pairs and x.device.type == "cuda" else ""


def _flat(w):
    """A weight's kernel arguments: (packed uint8, absmax, absmax2, code2, offset); the last three are ``absmax``
    again without double quant (unused then)."""
    import torch
    packed, absmax = w["packed"].reshape(-1).view(torch.uint8), w["absmax"].reshape(-1)
    if w.get("absmax2") is None:
        return packed, absmax, absmax, absmax, absmax
    return packed, absmax, w["absmax2"].reshape(-1), w["code2"], w["offset"]


def _geometry(x, weights):
    """(K, NH, blocksize, nested, warps) shared by ``weights`` (dicts of :func:`weight_args`), checked against x.

    Raises:
        ValueError: the weights disagree on K, blocksize or double quant, or x is not one row of K values.
    """
    k, bs, nested = weights[0]["shape"][1], weights[0]["blocksize"], weights[0].get("absmax2") is not None
    for w in weights:
        if (w["shape"][1], w["blocksize"], w.get("absmax2") is not None) != (k, bs, nested):
            raise ValueError(f"fused 4-bit matmul: weights differ in K, blocksize or double quant "
                             f"({[(v['shape'], v['blocksize']) for v in weights]})")
    if x.numel() != k or bs % 32 or k % bs:
        raise ValueError(f"fused 4-bit matmul: x {tuple(x.shape)} against K {k}, blocksize {bs}: need one row of K "
                         "values, blocksize a multiple of 32 and K a multiple of it")
    pieces = triton.next_power_of_2(k // 32)
    return k, pieces, bs, nested, WARPS or max(1, nf4.default_warps(k) // 2)


def weight_args(module) -> dict:
    """A bitsandbytes ``Linear4bit``'s packed weight and quantization state as :func:`matmul_4bit_segments` takes
    them: ``packed``, ``shape`` (N, K), ``blocksize``, ``quant_type``, ``absmax`` and with double quant
    ``absmax2``, ``code2``, ``offset`` (bitsandbytes' ``QuantState`` fields)."""
    import torch
    qs = module.weight.quant_state
    out = {"packed": module.weight, "shape": (int(qs.shape[0]), int(qs.shape[1])), "blocksize": int(qs.blocksize),
           "quant_type": qs.quant_type, "absmax": qs.absmax}
    if qs.nested:
        off = qs.offset if torch.is_tensor(qs.offset) else torch.tensor(float(qs.offset), device=qs.absmax.device)
        out.update(absmax2=qs.state2.absmax, code2=qs.state2.code, offset=off.float())
    return out


def matmul_4bit_segments(x, weights, code):
    """``cat([x @ W.T for W in weights], -1)`` for one row ``x`` (``[..., K]``, 1 row) and one to three 4-bit weights
    (:func:`weight_args`) sharing K, blocksize and double quant, in one launch. ``code``: the 16 values
    (:func:`vramguard.run.kernels.nf4.code_table`). Returns ``[sum N]`` in ``x.dtype``.

    Raises:
        ValueError: see :func:`_geometry`; more than three weights.
    """
    import torch
    if not 1 <= len(weights) <= 3:
        raise ValueError(f"fused 4-bit matmul: 1 to 3 weights, got {len(weights)}")
    x1 = x.reshape(-1).contiguous()
    k, nh, bs, nested, warps = _geometry(x1, weights)
    ns = [w["shape"][0] for w in weights] + [0, 0]
    flat = [_flat(w) for w in weights]
    flat += [flat[0]] * (3 - len(flat))
    out = torch.empty(sum(ns), dtype=x.dtype, device=x.device)
    xs, pairs, bf16 = _x_mode(x1)
    r = min(nf4.rows_per_program(n, x.device) for n in ns[:len(weights)])
    while ns[0] % r or ns[1] % r:
        r //= 2
    _segments_kernel[(triton.cdiv(sum(ns), r),)](xs, code, out, *flat[0], *flat[1], *flat[2], ns[0], ns[1], ns[2],
                                                 K=k, NH=nh, BS=bs, NESTED=nested, X_PAIRS=pairs, X_BF16=bf16,
                                                 LUT_ASM=_lut(code, x, pairs), R=r, LUT_F16=nf4.lut_f16(),
                                                 num_warps=warps)
    return out


def matmul_4bit_glu(x, gate, up, code):
    """``silu(x @ G.T) * (x @ U.T)`` for one row ``x`` (``[..., K]``) and two 4-bit weights of the same shape
    (:func:`weight_args`), in one launch. Returns ``[N]`` in ``x.dtype``.

    Raises:
        ValueError: see :func:`_geometry`; gate and up of different shapes.
    """
    import torch
    if gate["shape"] != up["shape"]:
        raise ValueError(f"fused gate/up: shapes {gate['shape']} and {up['shape']} differ")
    x1 = x.reshape(-1).contiguous()
    k, nh, bs, nested, warps = _geometry(x1, [gate, up])
    n = gate["shape"][0]
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    xs, pairs, bf16 = _x_mode(x1)
    r = nf4.rows_per_program(n, x.device)
    _glu_kernel[(triton.cdiv(n, r),)](xs, code, out, *_flat(gate), *_flat(up), n, K=k, NH=nh, BS=bs, NESTED=nested,
                                      X_PAIRS=pairs, X_BF16=bf16, LUT_ASM=_lut(code, x, pairs), R=r,
                                      LUT_F16=nf4.lut_f16(),
                                      num_warps=warps)
    return out


def add_rms_norm(x, residual, weight, eps: float, out=None, sum_out=None):
    """(``weight * rms_norm(residual + x)``, ``residual + x``) for one row (``[..., N]``); ``residual`` None: the
    norm of ``x`` alone and ``x`` returned as the sum. Outputs in ``x.dtype`` (``out`` / ``sum_out``: preallocated).

    Raises:
        ValueError: a shape or dtype mismatch (the weight must have the activations' dtype).
    """
    import torch
    n = x.shape[-1]
    if x.numel() != n or weight.numel() != n or weight.dtype != x.dtype or (
            residual is not None and (residual.numel() != n or residual.dtype != x.dtype)):
        raise ValueError(f"fused RMSNorm: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} "
                         f"{weight.dtype}: need one row and the weight in the activations' dtype")
    out = torch.empty_like(x) if out is None else out
    has_res = residual is not None
    total = (torch.empty_like(x) if sum_out is None else sum_out) if has_res else x
    block = triton.next_power_of_2(n)
    _add_rms_norm_kernel[(1,)](x, residual if has_res else x, weight, out, total, float(eps), N=n, BLOCK=block,
                               HAS_RES=has_res, num_warps=max(1, min(16, block // 256)))
    return out, total


def rope_cache_write(qkv, cos, sin, position, keys, values, heads: int, kv_heads: int, length=None):
    """Rotary embedding and the cache write of one token.

    Args:
        qkv: ``[(heads + 2 * kv_heads) * D]``, q then k then v heads (:func:`matmul_4bit_segments`' output).
        cos, sin: ``[max_len, D]`` tables (the model's rotary embedding at every position), activation dtype.
        position: long tensor, one element, on the device. keys, values: the layer's static cache ``[1, kv_heads,
            L, D]`` (last dimension contiguous). length: the layer's length counter (a long scalar tensor) to set to
            ``position + 1``, or None.

    Returns:
        rotated q, ``[1, heads, 1, D]`` in ``qkv.dtype``.

    Raises:
        ValueError: sizes that do not match.
    """
    import torch
    d = keys.shape[-1]
    if (qkv.numel() != (heads + 2 * kv_heads) * d or keys.shape[1] != kv_heads or cos.shape[-1] != d
            or keys.stride(-1) != 1 or values.stride(-1) != 1 or d % 2):
        raise ValueError(f"fused rotary: qkv {qkv.numel()} values for {heads} + 2 x {kv_heads} heads of {d}, cache "
                         f"{tuple(keys.shape)}: sizes do not match")
    q = torch.empty((1, heads, 1, d), dtype=qkv.dtype, device=qkv.device)
    _rope_cache_kernel[(heads + 2 * kv_heads,)](
        qkv, cos, sin, position, q, keys, values, length if length is not None else position,
        keys.stride(1), keys.stride(2), values.stride(1), values.stride(2), HQ=heads, HKV=kv_heads, D=d,
        HAS_LEN=length is not None, num_warps=1)
    return q
