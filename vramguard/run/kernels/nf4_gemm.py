"""``kernels.nf4_gemm``: ``x @ W.T`` for up to :data:`MAX_ROWS` rows of ``x`` (a continuous-batching decode step)
with ``W`` in bitsandbytes' 4-bit layout (:mod:`vramguard.run.kernels.nf4` describes it), each packed byte read once.

bitsandbytes 0.50 on an H100/H200 runs such a call (``bitsandbytes::gemm_4bit`` of 33 to 64 rows for every
Llama-3.1-8B projection, from 8 rows for all but gate/up: ``_gemm_4bit_use_custom_cuda``) as a dequantize of the
whole weight to the compute dtype followed by a cuBLAS GEMM: it writes and reads back 2 bytes per weight on top of
reading the 0.5 packed byte. Here one Triton program owns ``BN`` output features and a range of ``K`` (split-K
when ``N / BN`` alone would leave SMs idle): per quantization block it loads the packed bytes
``[blocksize / 2, BN]`` (contiguous along ``K``), looks their 4-bit values up (gathered from the float32 code
table, or with ``lut`` from registers), scales them by the block's absmax (double quant:
``code2[a8] * absmax2 + offset``) and rounds them to the compute dtype - with the gather, the value bitsandbytes'
dequantize writes - then multiplies the even and the odd columns of the ``[rows, blocksize]`` tile of ``x``
(loaded contiguously, split in registers) with them on the tensor cores (``tl.dot``, float32 accumulation).
Split-K partial sums go through a float32 buffer and one reduction kernel (deterministic, no atomics).

:func:`reference_gemm` is bitsandbytes' own arithmetic in torch (dequantize, then a matmul) for the tests.
"""

from __future__ import annotations

import functools

from vramguard.run.kernels import nf4  # a module, not names: the tests reload it interpreted

MAX_ROWS = 64  # rows of x one launch takes (one tile of rows); more stay with bitsandbytes
MIN_TILE = 16  # tl.dot's smallest side
TARGET_WAVES = 2  # split K until (N / BN) * splits reaches this many programs per SM
MIN_BLOCKS_PER_SPLIT = 8  # quantization blocks of K each split keeps at least

try:  # optional: without triton only the torch reference runs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = tl = None


def reference_gemm(x, packed, shape, blocksize: int, code, absmax, absmax2=None, code2=None, offset=None, bias=None):
    """bitsandbytes' fallback arithmetic: ``W`` dequantized to ``x.dtype`` (float32 math, one rounding), then
    ``x @ W.T (+ bias)`` in ``x.dtype``; ``[..., N]``."""
    w = nf4.reference_dequantize(packed, shape, blocksize, code, absmax, absmax2, code2, offset).to(x.dtype)
    out = x @ w.T
    return out + bias.to(x.dtype) if bias is not None else out


if tl is not None:
    @triton.jit
    def _gemm_4bit_kernel(x_ptr, w_ptr, am_ptr, am2_ptr, code2_ptr, off_ptr, code_ptr, bias_ptr, out_ptr,
                          M, N, K, K_SPLIT, stride_xm, stride_os, stride_om, BS: tl.constexpr, ITERS: tl.constexpr,
                          NESTED: tl.constexpr, HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                          PRECISION: tl.constexpr, DOT_F32: tl.constexpr, LUT_ASM: tl.constexpr,
                          LUT_F16: tl.constexpr):
        """Program (i, s): output features ``i*BN ..`` for every row of x over ``K[s*K_SPLIT : (s+1)*K_SPLIT]``
        (``ITERS`` blocks); writes ``out[s, m, n]`` (the final output when there is one split)."""
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        rm = tl.arange(0, BM)
        rp = tl.arange(0, BS // 2)  # byte p of a block: elements 2p (high nibble) and 2p + 1 (low nibble)
        rk = tl.arange(0, BS)
        n_ok = rn < N
        m_ok = rm < M
        w_cols = w_ptr + rn.to(tl.int64)[None, :] * (K // 2) + rp[:, None]  # [BS/2, BN], bytes contiguous along K
        x_rows = x_ptr + rm[:, None] * stride_xm + rk[None, :]  # [BM, BS], contiguous along K
        blk_cols = rn.to(tl.int64) * (K // BS)
        dt = x_ptr.dtype.element_ty
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        k_first = tl.program_id(1) * K_SPLIT
        for i in range(ITERS):
            k0 = k_first + i * BS
            q8 = tl.load(w_cols + k0 // 2, mask=n_ok[None, :], other=0)
            blk = blk_cols + k0 // BS
            if NESTED:
                a8 = tl.load(am_ptr + blk, mask=n_ok, other=0).to(tl.int32)
                scale = tl.load(code2_ptr + a8) * tl.load(am2_ptr + blk // 256, mask=n_ok, other=0.0)
                scale = scale + tl.load(off_ptr)
            else:
                scale = tl.load(am_ptr + blk, mask=n_ok, other=0.0)
            if LUT_ASM == "":
                q = q8.to(tl.int32)
                c_hi = tl.load(code_ptr + (q >> 4))
                c_lo = tl.load(code_ptr + (q & 15))
            else:  # one 16-bit pair per byte (vramguard.run.kernels.nf4.lut_asm), high half = element 2p
                c_hi, c_lo = nf4.lut_values(q8, LUT_ASM, LUT_F16)
            w_hi = (c_hi * scale[None, :]).to(dt)
            w_lo = (c_lo * scale[None, :]).to(dt)
            x = tl.load(x_rows + k0, mask=m_ok[:, None], other=0.0)
            x_even, x_odd = tl.split(tl.reshape(x, (BM, BS // 2, 2)))
            if DOT_F32:  # the same rounded values, multiplied in float32 (Triton's interpreter has no 16-bit dot)
                w_hi, w_lo = w_hi.to(tl.float32), w_lo.to(tl.float32)
                x_even, x_odd = x_even.to(tl.float32), x_odd.to(tl.float32)
            acc = tl.dot(x_even, w_hi, acc, input_precision=PRECISION)
            acc = tl.dot(x_odd, w_lo, acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        ptrs = out_ptr + tl.program_id(1) * stride_os + rm[:, None] * stride_om + rn[None, :]
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _sum_splits_kernel(part_ptr, bias_ptr, out_ptr, MN, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                           BLOCK: tl.constexpr):
        """``out[i] = sum_s part[s, i] (+ bias[i % N])`` in float32, rounded once to the output dtype."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < MN
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            total += tl.load(part_ptr + s * MN + i, mask=ok, other=0.0)
        if HAS_BIAS:
            total += tl.load(bias_ptr + i % N, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + i, total.to(out_ptr.dtype.element_ty), mask=ok)


@functools.lru_cache(maxsize=None)
def _sm_count(device_str: str) -> int:
    import torch
    return int(torch.cuda.get_device_properties(torch.device(device_str)).multi_processor_count)


@functools.lru_cache(maxsize=None)
def default_config(n: int, k: int, blocksize: int, rows: int, device_str: str,
                   bn: int = 128) -> tuple[int, int, int, int]:
    """(BN, splits, warps, stages) for ``N x K`` at ``rows`` rows: ``bn`` output features per program (4 warps at
    128, 8 above), ``K`` split in powers of two until the programs fill :data:`TARGET_WAVES` per SM (each split
    keeping at least :data:`MIN_BLOCKS_PER_SPLIT` blocks). On the CPU (Triton's interpreter, where each program
    costs milliseconds of Python and a larger block costs little more) one split of up to 256 features."""
    if not device_str.startswith("cuda"):
        return min(256, max(16, triton.next_power_of_2(n))), 1, 4, 1
    programs = -(-n // bn)
    want = TARGET_WAVES * _sm_count(device_str)
    blocks = k // blocksize
    splits = 1
    while programs * splits * 2 <= want and blocks % (splits * 2) == 0 and blocks // (splits * 2) >= \
            MIN_BLOCKS_PER_SPLIT:
        splits *= 2
    return bn, splits, 4 if bn <= 128 else 8, 3


def _lut(code, x, lut: bool) -> str:
    import torch
    if not (lut and x.is_cuda and x.dtype == torch.bfloat16):
        return ""
    return nf4._lut_string(code)


def gemm_4bit(x, packed, shape, blocksize: int, code, absmax, absmax2=None, code2=None, offset=None, bias=None,
              config: tuple[int, int, int, int] | None = None, lut: bool = False, bn: int = 128):
    """``x @ W.T (+ bias)`` for up to :data:`MAX_ROWS` rows, ``W`` ``[N, K]`` in bitsandbytes' 4-bit layout.

    Args:
        x: ``[..., K]`` bfloat16 / float16 / float32 (float32: exact products, ``input_precision="ieee"``).
        packed, shape, blocksize, code, absmax, absmax2, code2, offset, bias: as for
            :func:`vramguard.run.kernels.nf4.matmul_4bit`.
        config: (BN, splits, warps, stages) (for benchmarks); default :func:`default_config` with ``bn``.
        lut: look the 4-bit values up in registers (:func:`vramguard.run.kernels.nf4.lut_asm`: the code rounded to
            ``nf4.LUT_TABLE`` before the scale, so not bitsandbytes' exact values; CUDA and bfloat16 ``x`` only) rather
            than gather them from the float32 code.

    Returns:
        ``[..., N]`` in ``x.dtype``.

    Raises:
        ValueError: more than :data:`MAX_ROWS` rows, a ``K`` or ``blocksize`` this layout cannot take, a size
            mismatch, or a ``config`` whose splits do not divide K's blocks.
    """
    import torch

    n, k, x2, rows = nf4.checked_rows(x, packed, shape, blocksize, MAX_ROWS, "4-bit GEMM")
    bn, splits, warps, stages = config or default_config(n, k, blocksize, rows, str(x.device), bn)
    if (k // blocksize) % splits:
        raise ValueError(f"4-bit GEMM: {splits} splits of K {k} do not divide its {k // blocksize} blocks")
    bm = max(MIN_TILE, triton.next_power_of_2(rows))
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    part = out if splits == 1 else torch.empty((splits, rows, n), dtype=torch.float32, device=x.device)
    nested = absmax2 is not None
    dummy = code
    _gemm_4bit_kernel[(triton.cdiv(n, bn), splits)](
        x2, packed.reshape(-1).view(torch.uint8), absmax.reshape(-1), absmax2.reshape(-1) if nested else dummy,
        code2 if nested else dummy, offset if nested else dummy, code,
        bias if bias is not None and splits == 1 else dummy, part, rows, n, k, k // splits, x2.stride(0),
        part.stride(0) if splits > 1 else 0, part.stride(-2), BS=blocksize, ITERS=k // splits // blocksize,
        NESTED=nested,
        HAS_BIAS=bias is not None and splits == 1, BM=bm, BN=bn,
        PRECISION="ieee" if x2.dtype == torch.float32 or not x.is_cuda else None, DOT_F32=not x.is_cuda,
        LUT_ASM=_lut(code, x2, lut), LUT_F16=nf4.lut_f16(), num_warps=warps, num_stages=stages)
    if splits > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(rows * n, block),)](
            part, bias if bias is not None else dummy, out, rows * n, n, SPLITS=splits, HAS_BIAS=bias is not None,
            BLOCK=block)
    return out.view(*x.shape[:-1], n)
