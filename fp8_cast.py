"""fp8.py's cast in one pass over memory: an extension of fp8.py, its `quantize` as a Triton kernel.

fp8.quantize, the version to read, is a chain of PyTorch operations, each a pass over the whole
tensor: x in fp32, x·s, |x·s|, the comparisons that count what saturates and what flushes to zero,
the clamp, the NaN `where`, the cast; ten full-size temporaries, five of them fp32. Delayed scaling
records the amax too (two more passes), and the backward's matmuls want the codes transposed
(another copy). On a GPU a cast is nothing but memory traffic, and it is most of fp8's time
(README: `_scaled_mm` was 6% of it). This kernel reads x once and writes its codes once and, where
the backward needs them, the transposed codes from the same tile: TransformerEngine's
cast-transpose. The statistics ride along: the amax of x (what delayed scaling records), the
saturated and the flushed counts.

    a delayed cast of a bf16 x, with the transposed codes    passes    bytes moved per element
    fp8.py: the amax, quantize, the transposed copy            16        77 (48 read, 29 written)
    cast_transpose                                             1         4 (2 read, 1 + 1 written)

(tests/bench_fp8_cast.py measures both: every PyTorch operation's inputs and outputs, and the
kernel's own loads and stores as the Triton interpreter runs them.)

The kernel needs the scale before it starts, which delayed scaling has (the history's, fixed for
the step), so nothing waits; current scaling must read the whole tensor for its amax first and
stays on the PyTorch path, the exact reference. fp8.Scaling sends its casts here on a GPU under
delayed scaling (`fused`); the tests run the kernel in the interpreter, bit for bit fp8.quantize.

The codes are made with integer operations on the bits of x·s, rounding to nearest, ties to even,
as torch's cast does; not with Triton's float8 conversion, whose results the interpreter does not
give bit for bit. A float32 is sign | 8 exponent bits (bias 127) | 23 mantissa bits, and an fp8
normal keeps the top MANTISSA of them, so the code rounds there (a carry bumps the exponent):

    code = (|bits| + 2^(22 - MANTISSA) - 1 + lsb) >> (23 - MANTISSA), then re-biased

Below the format's smallest normal the code is the value counted in subnormal steps, 2^(1 - BIAS
- MANTISSA), rounded the same way (the largest subnormal rounds up into the smallest normal's code
by itself). Magnitudes past the top saturate to it (an integer min: float bits order as their
values), ±inf becomes NaN, a NaN stays NaN.
"""

import contextlib
import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the PyTorch path needs no Triton
    triton = None

# A program casts TILES tiles of BLOCK x BLOCK (a tile's transpose is a tile), then adds its
# statistics to the tensor's once. On a GPU small tiles, few registers (tests/test_kernels_aot.py
# compiles them); in the interpreter, where an operation costs the same at any size, one big tile.
GPU_LAUNCH, INTERPRETER_LAUNCH = (32, 8), (128, 1)
FORMATS = {torch.float8_e4m3fn: (3, 7), torch.float8_e5m2: (2, 15)}  # mantissa bits, exponent bias


def constants(fmt: torch.dtype) -> dict[str, float | int]:
    """The format as the kernel takes it: its field widths, the top value's bits, and fp8.py's
    thresholds of what saturates (past the top by half an ulp) and what flushes (half a subnormal
    step)."""
    mantissa, bias = FORMATS[fmt]
    top = torch.finfo(fmt).max
    return dict(MANTISSA=mantissa, BIAS=bias, TOP_BITS=int(torch.tensor(top).view(torch.int32)),
                PAST=top + 2.0 ** (math.floor(math.log2(top)) - mantissa - 1),
                TINY=torch.finfo(fmt).smallest_normal * 2.0 ** -mantissa / 2)


if triton is not None:
    @triton.jit
    def _encode(xs, MANTISSA: tl.constexpr, BIAS: tl.constexpr, TOP_BITS: tl.constexpr):
        """fp32 -> its fp8 code, an int32 in [0, 255]: saturated, rounded to nearest even."""
        bits = xs.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        special = bits & 0x7FFFFFFF  # |xs|: from 0x7F800000 on, ±inf or NaN
        a = tl.minimum(special, TOP_BITS)  # saturated (infinities and NaNs too: replaced below)
        e = (a >> 23) - 127  # the unbiased exponent
        SHIFT: tl.constexpr = 23 - MANTISSA
        normal = (a + (1 << (SHIFT - 1)) - 1 + ((a >> SHIFT) & 1)) >> SHIFT
        normal -= (127 - BIAS) << MANTISSA
        sig = (a & 0x7FFFFF) | 0x800000  # 1.mantissa as a 24-bit integer
        s = tl.minimum(tl.maximum(SHIFT + 1 - BIAS - e, 1), 25)  # a subnormal step: 2^s of sig
        q = sig >> s
        half = (sig >> (s - 1)) & 1  # the first bit shifted out; sticky: any after it
        sticky = (sig & ((tl.full(s.shape, 1, tl.int32) << (s - 1)) - 1)) != 0
        subnormal = q + (half & (sticky.to(tl.int32) | (q & 1)))
        code = tl.where(e >= 1 - BIAS, normal, subnormal) | sign
        code = tl.where(special > 0x7F800000, 0x7F | sign, code)  # NaN stays NaN, as torch's
        return tl.where(special == 0x7F800000, 0x7F, code)  # ±inf becomes NaN

    @triton.jit
    def _cast_transpose(X, Q, QT, SCALE, STATS, M, N, sxm, sxn,
                        MANTISSA: tl.constexpr, BIAS: tl.constexpr, TOP_BITS: tl.constexpr,
                        PAST: tl.constexpr, TINY: tl.constexpr, BF16_BITS: tl.constexpr,
                        ROWS: tl.constexpr, COLS: tl.constexpr, BLOCK: tl.constexpr,
                        TILES: tl.constexpr):
        """One program: TILES tiles of (BLOCK, BLOCK) down a column of x (M, N) -> their codes in
        Q (M, N) (ROWS) and in QT (N, M) (COLS); then its part of STATS, [amax's bits, saturated,
        flushed], added once: integer max and sum are exact in any order, the same bits each run."""
        offs_n = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        scale = tl.load(SCALE)
        amax, over, under = 0, 0, 0
        for t in range(TILES):
            offs_m = ((tl.program_id(0) * TILES + t) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
            inside = (offs_m[:, None] < M) & (offs_n[None, :] < N)
            x = tl.load(X + offs_m[:, None] * sxm + offs_n[None, :] * sxn, mask=inside, other=0)
            if BF16_BITS:  # bf16 is fp32's upper half: the conversion is a shift, exact
                x = (x.to(tl.int32) << 16).to(tl.float32, bitcast=True)
            x = x.to(tl.float32)
            xs = x * scale  # in fp32, as fp8.quantize: one rounding before the cast's
            mag = tl.abs(xs)
            # the amax as the bits of |x|: integers order as the floats do, a NaN above any number
            amax = tl.maximum(amax, tl.max(tl.max(tl.abs(x).to(tl.int32, bitcast=True), 1), 0))
            over += tl.sum(tl.sum((mag >= PAST).to(tl.int32), 1), 0)
            under += tl.sum(tl.sum(((mag <= TINY) & (mag > 0)).to(tl.int32), 1), 0)
            code = _encode(xs, MANTISSA, BIAS, TOP_BITS).to(tl.uint8)
            if ROWS:
                tl.store(Q + offs_m[:, None] * N + offs_n[None, :], code, mask=inside)
            if COLS:  # the same tile, transposed: TransformerEngine's cast-transpose
                tl.store(QT + offs_n[:, None] * M + offs_m[None, :], tl.trans(code),
                         mask=tl.trans(inside))
        tl.atomic_max(STATS, amax.to(tl.int64))
        tl.atomic_add(STATS + 1, over.to(tl.int64))
        tl.atomic_add(STATS + 2, under.to(tl.int64))

    INTERPRETED = not isinstance(_cast_transpose, triton.runtime.JITFunction)  # TRITON_INTERPRET=1
else:
    INTERPRETED = False


def cast_transpose(x: torch.Tensor, fmt: torch.dtype, scale: torch.Tensor, rows: bool = True,
                   cols: bool = False, launch: tuple[int, int] | None = None) -> tuple:
    """fp8.quantize(x, fmt, scale) in one pass over x (M, N) (fp32, bf16 or fp16, any strides),
    and more: -> (q (M, N) or None, qT (N, M) or None, overflow, underflow, amax of |x|): the codes
    as `fmt` tensors (qT row-major, as a matmul's backward wants the transposed operand), the counts
    int64 and the amax fp32, 0-dim tensors on x's device: nothing is read back to the host."""
    M, N = x.shape
    stats = torch.zeros(3, dtype=torch.int64, device=x.device)
    q = torch.empty(M, N, dtype=torch.uint8, device=x.device) if rows else stats
    qT = torch.empty(N, M, dtype=torch.uint8, device=x.device) if cols else stats
    block, tiles = launch or (INTERPRETER_LAUNCH if INTERPRETED else GPU_LAUNCH)
    bf16 = x.dtype == torch.bfloat16  # read as int16: the interpreter's bf16 subnormals are wrong
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _cast_transpose[(triton.cdiv(M, block * tiles), triton.cdiv(N, block))](
            x.view(torch.int16) if bf16 else x, q, qT, scale.float().reshape(1), stats, M, N,
            x.stride(0), x.stride(1), **constants(fmt), BF16_BITS=bf16, ROWS=rows, COLS=cols,
            BLOCK=block, TILES=tiles)
    amax = stats[:1].to(torch.int32).view(torch.float32).reshape(())
    return q.view(fmt) if rows else None, qT.view(fmt) if cols else None, stats[1], stats[2], amax
