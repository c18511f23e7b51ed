"""``kernels.nf4``: ``x @ W.T`` for a few rows of ``x`` with ``W`` in bitsandbytes' 4-bit format, read as stored.

bitsandbytes' layout (``bitsandbytes.functional.quantize_4bit``; checked against ``dequantize_4bit`` in the tests):

* ``W`` (``[N, K]``, out_features x in_features) is flattened row-major and cut into blocks of ``blocksize``
  (64 for transformers' default) consecutive elements; element ``i`` is ``code[q_i] * absmax[i // blocksize]``.
* ``q_i`` is 4 bits; byte ``i // 2`` of the packed uint8 tensor holds element ``2j`` in its high nibble and ``2j + 1``
  in its low nibble. ``code`` is the 16-value NF4 (or FP4) table, ``bitsandbytes.functional.get_4bit_type``.
* Double quant (``bnb_4bit_use_double_quant``): ``absmax`` is stored as uint8 ``a8`` with a second level,
  ``absmax[b] = code2[a8[b]] * absmax2[b // 256] + offset`` (``code2``: the 256-value dynamic map, ``absmax2``:
  float32 per 256 blocks, ``offset``: the float32 mean subtracted before the second quantization). bitsandbytes'
  own ``gemm_4bit`` op takes the same arguments (``absmax_8bit``, ``absmax_code``, ``absmax_offset``).

:func:`matmul_4bit` reads each packed byte once and never writes a dequantized weight: one program per
output feature reads its row of ``W`` in one pass (a 16-byte load per thread) and computes that output for every
row of ``x`` (up to :data:`MAX_ROWS`), with the block scale applied after each block's partial sum (one multiply
per 32 elements, not per element) and float32 accumulation. Each nibble's value is looked up in registers with
byte permutes (:func:`lut_asm`, the table rounded to float16, for 16-bit ``x`` on CUDA) or gathered from the
float32 table (float32 ``x``, Triton's interpreter, or :data:`LUT` off). :func:`reference_matmul` is the same math
in torch (float64 on request) for the tests and the GPU check.

:func:`vramguard.run.kernels.route.gemm_4bit_route` sends bitsandbytes' ``gemm_4bit`` calls with at most
:data:`MAX_ROWS` rows to :func:`matmul_4bit`.
"""

from __future__ import annotations

import functools

MAX_ROWS = 8  # rows of x one launch takes; more go back to bitsandbytes (its kernels are built for larger batches)
SECOND_LEVEL_BLOCK = 256  # double quant: absmax blocks per absmax2 value (bitsandbytes' gemm_4bit requires 256)
LUT = True  # on CUDA, look the 4-bit values up in registers (lut_asm); False: gather them from the table
# the register table's 16-bit type: float16 holds the NF4 values to 3.3e-4 (relative), bfloat16 to 3.1e-3 (one
# shift instead of a conversion per value; benchmarks/quality.py's fused_lut_bf16 path measures the difference)
LUT_TABLE = "float16"
_LUT_CACHE: dict = {}

try:  # optional: without triton only the torch reference runs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = tl = None


def reference_absmax(absmax, absmax2=None, code2=None, offset=None):
    """Float32 per-block scales ``[blocks]``: ``absmax`` itself, or with double quant
    ``code2[absmax] * absmax2[b // 256] + offset`` (``absmax`` uint8 then)."""
    if absmax2 is None:
        return absmax.float()
    second = absmax2.float().repeat_interleave(SECOND_LEVEL_BLOCK)[: absmax.numel()]
    return code2.float()[absmax.long()] * second + offset.float()


def reference_dequantize(packed, shape, blocksize: int, code, absmax, absmax2=None, code2=None, offset=None,
                         dtype=None):
    """``W`` ``[N, K]`` from bitsandbytes' packed bytes, in ``dtype`` (default float32; float64 for references).

    Args:
        packed: uint8, ``N * K / 2`` bytes (any shape; bitsandbytes keeps ``[N*K/2, 1]``).
        shape: ``(N, K)``. blocksize: elements per absmax. code: the 16 4-bit values.
        absmax, absmax2, code2, offset: see the module docstring (the last three only with double quant).
    """
    import torch
    dtype = dtype or torch.float32
    b = packed.reshape(-1).view(torch.uint8)
    idx = torch.stack([b >> 4, b & 15], dim=-1).reshape(-1).long()
    scale = reference_absmax(absmax, absmax2, code2, offset).to(dtype)
    w = code.to(dtype)[idx].view(-1, blocksize) * scale.view(-1, 1)
    return w.view(shape[0], shape[1])


def reference_matmul(x, packed, shape, blocksize: int, code, absmax, absmax2=None, code2=None, offset=None,
                     bias=None, dtype=None):
    """``x @ W.T (+ bias)`` through :func:`reference_dequantize`, computed in ``dtype`` (float32 by default)."""
    import torch
    dtype = dtype or torch.float32
    w = reference_dequantize(packed, shape, blocksize, code, absmax, absmax2, code2, offset, dtype)
    out = x.to(dtype) @ w.T
    return out + bias.to(dtype) if bias is not None else out


if tl is not None:
    @triton.jit
    def _load_row(w_ptr, am_ptr, am2_ptr, code2_ptr, off_ptr, code_ptr, n0, N, K: tl.constexpr, NH: tl.constexpr,
                  BS: tl.constexpr, NESTED: tl.constexpr, LUT_ASM: tl.constexpr, R: tl.constexpr,
                  LUT_F16: tl.constexpr):
        """Rows n0 .. n0+R-1 of W (those below N) as float32 values ``[R, NH, 16]`` of their even and odd elements
        (piece h, byte j = elements 32h + 2j and 32h + 2j + 1) and the per-piece block scales ``[R, NH]``: each
        row's packed bytes in one pass (one 16-byte load per thread; NH = K/32 rounded up to a power of two, the
        padding masked), each nibble's value gathered from ``code`` (64 bytes, cached) or, with LUT_ASM (the PTX
        of :func:`lut_asm`), looked up in registers with byte permutes (values rounded to float16, or bfloat16 where
        LUT_F16 is off)."""
        PB: tl.constexpr = BS // 32  # 16-byte pieces per quantization block
        base = n0.to(tl.int64)  # the first row: a scalar, so one row (R == 1) computes no per-thread row index
        ri = tl.arange(0, R)
        rh = tl.arange(0, NH)
        rj = tl.arange(0, 16)
        if R == 1:  # the grid has one program per row: every row exists
            ok = (rh < K // 32)[None, :] & (ri >= 0)[:, None]  # [R, NH]
        else:
            ok = (base + ri < N)[:, None] & (rh < K // 32)[None, :]
        pair = ri[:, None, None] * (K // 2) + rh[None, :, None] * 16 + rj[None, None, :]  # byte p: elements 2p, 2p+1
        q8 = tl.load(w_ptr + base * (K // 2) + pair, mask=ok[:, :, None], other=0)
        if LUT_ASM == "":
            q = q8.to(tl.int32)
            w_hi = tl.load(code_ptr + (q >> 4))  # element 2p: the high nibble
            w_lo = tl.load(code_ptr + (q & 15))
        else:
            w_hi, w_lo = lut_values(q8, LUT_ASM, LUT_F16)
        blk = base * (K // BS) + (ri[:, None] * (K // BS) + rh[None, :] // PB)  # [R, NH]
        if NESTED:
            a8 = tl.load(am_ptr + blk, mask=ok, other=0).to(tl.int32)
            scale = tl.load(code2_ptr + a8) * tl.load(am2_ptr + blk // 256, mask=ok, other=0.0) + tl.load(off_ptr)
        else:
            scale = tl.load(am_ptr + blk, mask=ok, other=0.0)
        return w_hi, w_lo, scale

    @triton.jit
    def lut_values(q8, LUT_ASM: tl.constexpr, LUT_F16: tl.constexpr):
        """Float32 values of each byte's high and low nibble (elements 2p and 2p + 1) looked up by the PTX of
        :func:`lut_asm`: one 16-bit pair per byte, the high half for the high nibble; float16 pairs (LUT_F16) or
        bfloat16 pairs (a bfloat16 value is the top half of its float32)."""
        wp = tl.inline_asm_elementwise(LUT_ASM, "=r,=r,=r,=r,r", [q8], dtype=tl.int32, is_pure=True, pack=4)
        if LUT_F16:
            hi = (wp >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            lo = wp.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        else:
            hi = (wp & -65536).to(tl.float32, bitcast=True)
            lo = (wp << 16).to(tl.float32, bitcast=True)
        return hi, lo

    @triton.jit
    def _load_x(x_ptr, ok, K: tl.constexpr, NH: tl.constexpr, X_PAIRS: tl.constexpr, X_BF16: tl.constexpr):
        """One row of x as float32 ``[1, NH, 16]`` even and odd elements, in :func:`_load_row`'s layout (``ok``: the
        row exists). X_PAIRS: x is 16-bit and read as int32 pairs (element 2p in the low half), 16-byte loads."""
        rh = tl.arange(0, NH)
        rj = tl.arange(0, 16)
        pair = rh[None, :, None] * 16 + rj[None, None, :]
        x_ok = (rh < K // 32)[None, :, None] & ok
        if X_PAIRS:
            xp = tl.load(x_ptr + pair, mask=x_ok, other=0)
            if X_BF16:
                x_even = (xp << 16).to(tl.float32, bitcast=True)
                x_odd = (xp & -65536).to(tl.float32, bitcast=True)
            else:
                x_even = (xp & 65535).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
                x_odd = ((xp >> 16) & 65535).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        else:
            x_even = tl.load(x_ptr + 2 * pair, mask=x_ok, other=0.0).to(tl.float32)
            x_odd = tl.load(x_ptr + 2 * pair + 1, mask=x_ok, other=0.0).to(tl.float32)
        return x_even, x_odd

    @triton.jit
    def _row_dot(w_hi, w_lo, scale, x_even, x_odd):
        """Float32 ``[R]``: the rows of W (:func:`_load_row`) times one row of x (:func:`_load_x`): partial sums of
        each thread's 32 elements, scaled by their block's absmax, then one reduction."""
        return tl.sum(tl.sum(w_hi * x_even + w_lo * x_odd, axis=2) * scale, axis=1)

    @triton.jit
    def _matmul_4bit_kernel(x_ptr, w_ptr, am_ptr, am2_ptr, code2_ptr, off_ptr, code_ptr, bias_ptr, out_ptr,
                            M, N, stride_xm, stride_om, K: tl.constexpr, NH: tl.constexpr, BS: tl.constexpr,
                            NESTED: tl.constexpr, HAS_BIAS: tl.constexpr, X_PAIRS: tl.constexpr,
                            X_BF16: tl.constexpr, M_PAD: tl.constexpr, LUT_ASM: tl.constexpr, R: tl.constexpr,
                            LUT_F16: tl.constexpr):
        """Program i computes out[:, n] for every row of x and the R outputs n from i*R, from those rows of W
        (:func:`_load_row`), read in one pass. No loop over K: every load is issued at once."""
        rows = tl.program_id(0) * R + tl.arange(0, R)
        w_hi, w_lo, scale = _load_row(w_ptr, am_ptr, am2_ptr, code2_ptr, off_ptr, code_ptr, tl.program_id(0) * R,
                                      N, K, NH, BS, NESTED, LUT_ASM, R, LUT_F16)
        for m in tl.static_range(M_PAD):
            x_even, x_odd = _load_x(x_ptr + m * stride_xm, m < M, K, NH, X_PAIRS, X_BF16)
            total = _row_dot(w_hi, w_lo, scale, x_even, x_odd)
            if HAS_BIAS:
                total += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
            tl.store(out_ptr + m * stride_om + rows, total.to(out_ptr.dtype.element_ty), mask=(rows < N) & (m < M))


def default_warps(k: int, rows: int = 1) -> int:
    """Warps per program for a row of ``k`` values: one thread per 16-byte piece at more than one row of x; at one
    row, two pieces per thread (on the H200, Llama-3.1-8B's shapes at one row: q 8.3 us at 2 warps against 8.7 at
    4, gate 22.3 against 24.4, down 26.0 at 8 against 27.0 at 16; ``benchmarks/gpu_speed_nf4.py``'s sweep)."""
    pieces = 1 << max(0, (k // 32 - 1).bit_length())
    return max(1, min(32, pieces // (32 if rows > 1 else 64)))


def rows_per_program(n: int, device) -> int:
    """Output rows per program: 1 on CUDA (one program per row keeps each row's loads in flight at once); under
    Triton's interpreter (the CPU tests), where each program costs milliseconds of Python, up to 256."""
    return 1 if device.type == "cuda" else min(256, 1 << (max(n, 1).bit_length() - 1))


def _lut_string(code) -> str:
    key = (code.data_ptr(), str(code.device), LUT_TABLE)
    if key not in _LUT_CACHE:
        _LUT_CACHE[key] = lut_asm(code, LUT_TABLE)
    return _LUT_CACHE[key]


def lut_f16() -> bool:
    """Whether :func:`lut_asm`'s table is float16 (:data:`LUT_TABLE`): the kernels' ``LUT_F16``."""
    return LUT_TABLE == "float16"


@functools.lru_cache(maxsize=None)
def _code_table(quant_type: str, device_str: str):
    import torch
    from bitsandbytes.functional import get_4bit_type
    return get_4bit_type(quant_type, device=torch.device(device_str)).float().contiguous()


def code_table(quant_type: str, device):
    """bitsandbytes' 16 values for ``quant_type`` ("nf4" or "fp4") as float32 on ``device`` (cached)."""
    return _code_table(quant_type, str(device))


def lut_asm(code, table: str = "bfloat16") -> str:
    """PTX for ``inline_asm_elementwise`` (pack 4): 4 packed bytes in, per byte one int32 holding the 16-bit
    values of its two nibbles (low nibble in the low half, high nibble in the high half), looked up in ``code``
    (16 values, rounded to ``table``: "float16" or "bfloat16") held as byte tables in 8 registers: for each nibble
    ``prmt`` picks its low and high byte from entries 0-7 and 8-15 and a third ``prmt`` chooses by the nibble's top
    bit (the byte-permute lookup of llama.cpp's ``get_int_from_table_16``), two more interleave the bytes into
    16-bit values. :func:`lut_values` turns them into float32.
    PTX ISA, ``prmt``:
    https://docs.nvidia.com/cuda/parallel-thread-execution/#data-movement-and-conversion-instructions-prmt
    """
    import torch
    if table not in ("float16", "bfloat16"):
        raise ValueError(f"lut_asm: table {table!r}: one of 'float16', 'bfloat16'")
    bits = code.detach().float().cpu().to(getattr(torch, table)).view(torch.int16).int() & 0xFFFF
    lo, hi = (bits & 0xFF).tolist(), (bits >> 8).tolist()
    words = [sum(t[4 * w + i] << (8 * i) for i in range(4)) for t in (lo, hi) for w in range(4)]
    regs = "".join(f"mov.b32 t{i}, {v:#010x}; " for i, v in enumerate(words))
    half = ("prmt.b32 a, t0, t1, {q}; prmt.b32 b, t2, t3, {q}; prmt.b32 l, a, b, {s}; "
            "prmt.b32 c, t4, t5, {q}; prmt.b32 d, t6, t7, {q}; prmt.b32 h, c, d, {s}; "
            "prmt.b32 {o0}, l, h, 0x5140; prmt.b32 {o1}, l, h, 0x7362; ")
    return ("{ .reg .b32 t0, t1, t2, t3, t4, t5, t6, t7, qm, s, qh, sh, a, b, c, d, l, h; " + regs
            + "and.b32 qm, $4, 0x77777777; and.b32 s, $4, 0x88888888; shr.u32 s, s, 1; or.b32 s, s, 0x32103210; "
            + half.format(q="qm", s="s", o0="$0", o1="$1")
            + "shr.u32 qh, qm, 16; shr.u32 sh, s, 16; "
            + half.format(q="qh", s="sh", o0="$2", o1="$3") + "}")



def checked_rows(x, packed, shape, blocksize: int, max_rows: int, what: str):
    """``(N, K, x as [rows, K] with unit stride, rows)`` for a 4-bit matmul of ``x [..., K]`` by the packed
    ``N x K`` weight (``N*K/2`` bytes, blocks of ``blocksize``, a multiple of 32, dividing K).

    Raises:
        ValueError: a size mismatch, a ``blocksize`` this layout cannot take, or more than ``max_rows`` rows
            (``what`` names the kernel in the message).
    """
    n, k = int(shape[0]), int(shape[1])
    if (x.shape[-1] != k or blocksize % 32 or k % blocksize
            or packed.numel() * packed.element_size() != n * k // 2):
        raise ValueError(f"{what}: x {tuple(x.shape)}, W {n}x{k} with blocksize {blocksize}, packed "
                         f"{packed.numel() * packed.element_size()} bytes: need x[..., {k}], blocksize a multiple "
                         "of 32, K % blocksize == 0 and N*K/2 bytes")
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    if rows > max_rows:
        raise ValueError(f"{what}: {rows} rows, at most {max_rows} per launch")
    return n, k, (x2 if x2.stride(-1) == 1 else x2.contiguous()), rows

def matmul_4bit(x, packed, shape, blocksize: int, code, absmax, absmax2=None, code2=None, offset=None, bias=None,
                num_warps: int | None = None, lut: bool | None = None):
    """``x @ W.T (+ bias)`` with ``W`` ``[N, K]`` in bitsandbytes' 4-bit layout (module docstring), by Triton.

    Args:
        x: ``[..., K]`` float16 / bfloat16 / float32 with at most :data:`MAX_ROWS` rows; the output has its dtype.
        packed: the packed bytes (``N * K / 2``, uint8 or a same-size view of another storage dtype).
        shape: ``(N, K)``; ``K`` must be a multiple of ``blocksize``, itself a multiple of 32.
        code: float32 ``[16]``. absmax: float32 ``[N*K/blocksize]``, or uint8 with ``absmax2`` (float32
            ``[ceil(blocks/256)]``), ``code2`` (float32 ``[256]``) and ``offset`` (float32 scalar tensor).
        num_warps: Triton warps per program (default: :func:`default_warps`).
        lut: look the 4-bit values up in registers (:func:`lut_asm`, values rounded to :data:`LUT_TABLE`; CUDA, 16-bit
            ``x`` only) rather than gather them from ``code``; None: :data:`LUT`. float32 ``x`` always gathers the
            float32 values (float32 compute stays exact).

    Returns:
        ``[..., N]`` in ``x.dtype``.

    Raises:
        ValueError: more rows than :data:`MAX_ROWS`, a ``K`` or ``blocksize`` this layout cannot take, or a size
            mismatch.
    """
    import torch
    n, k, x2, rows = checked_rows(x, packed, shape, blocksize, MAX_ROWS, "4-bit matmul")
    pairs = x2.dtype in (torch.bfloat16, torch.float16) and x2.data_ptr() % 4 == 0 and x2.stride(0) % 2 == 0
    xs = x2.view(torch.int32) if pairs else x2
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    pieces = triton.next_power_of_2(k // 32)
    nested = absmax2 is not None
    dummy = code
    r = rows_per_program(n, x.device)
    _matmul_4bit_kernel[(triton.cdiv(n, r),)](
        xs, packed.reshape(-1).view(torch.uint8), absmax.reshape(-1), absmax2.reshape(-1) if nested else dummy,
        code2 if nested else dummy, offset if nested else dummy, code, bias if bias is not None else dummy, out,
        rows, n, xs.stride(0), out.stride(0), K=k, NH=pieces, BS=blocksize, NESTED=nested, R=r,
        HAS_BIAS=bias is not None, X_PAIRS=pairs, X_BF16=x2.dtype == torch.bfloat16,
        M_PAD=triton.next_power_of_2(rows), num_warps=num_warps or default_warps(k, rows),
        LUT_ASM=_lut_string(code) if (LUT if lut is None else lut) and pairs and x.device.type == "cuda" else "",
        LUT_F16=lut_f16())
    return out.view(*x.shape[:-1], n)
