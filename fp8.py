"""FP8 training's numerics: eight-bit matmuls that still learn (Micikevicius et al. 2022, "FP8 Formats
for Deep Learning").

Two formats, one byte each (Hopper, Ada and later GPUs multiply them at twice the bf16 rate):

    e4m3fn  sign | 4 exponent bits (bias 7)  | 3 mantissa bits    max 1.75·2^8  =   448, no infinities
    e5m2    sign | 5 exponent bits (bias 15) | 2 mantissa bits    max 1.75·2^15 = 57344, IEEE-like (±inf)

                 smallest subnormal   smallest normal   max      binades   ulp / value (normal)
    e4m3fn       2^-9  ≈ 0.00195      2^-6 ≈ 0.0156     448      17.8      2^-3: rounding error ≤ 2^-4 = 6.25%
    e5m2         2^-16 ≈ 1.5e-5       2^-14 ≈ 6.1e-5    57344    31.8      2^-2: rounding error ≤ 2^-3 = 12.5%
    (bf16        2^-133               2^-126            3.4e38   261       2^-7: ≤ 2^-8 = 0.4%)

    e4m3   0 ·subnormals· 2^-6 ┃········┃ 2^-5 ┃········┃ 2^-4  ...  2^7 ┃········┃ 2^8 ·······448
             (step 2^-9)        8 values a binade; each binade's step is twice the one before
    e5m2   0 ·subnormals· 2^-14 ┃····┃ 2^-13 ┃····┃  ...  2^15 ···57344 (then inf)
             (step 2^-16)       4 values a binade: half the precision, 14 more binades

Why e4m3 forward and e5m2 backward (the paper's section 3, and TransformerEngine's "HYBRID" recipe):
activations and weights sit in a few binades and want precision (3 mantissa bits); gradients spread
over many more binades (they shrink through the layers and over training, with heavy tails), so they
need range more than precision, and e5m2's 32 binades give it. Here, per Linear:

    forward    Y  = X Wᵀ         X e4m3, W e4m3   ─▶ fp32 / bf16
    backward   dX = dY W         dY e5m2, W e4m3  ─▶ the dtype of X
               dW = dYᵀ X        dY e5m2, X e4m3  ─▶ the dtype of W (the master weights stay as they are)
               db = Σ dY         in fp32 (a sum, not a matmul: nothing to gain in fp8)

Scaling. 17.8 binades is too few to hold a tensor where it happens to lie: a gradient of 1e-6 is
zero in e5m2, an activation of 600 is past e4m3's max. So every tensor is carried as (q, s) with
q = fp8(x·s) and x ≈ q / s, one fp32 scale per tensor ("per-tensor scaling"), chosen so the
tensor's largest magnitude lands at the top of the format:

    s = fmt_max / amax / 2^margin          (amax = max |x|; amax 0 or not finite: s = 1)

The margin leaves headroom (amax lands at fmt_max·2^-margin). Values beyond ±fmt_max saturate to
±fmt_max, and those that rounding would have taken past it (from fmt_max + half an ulp: 464 for
e4m3fn) are counted, never silent (`overflow`); values below half the smallest subnormal become 0
(`underflow`); ±inf becomes NaN, so a non-finite step is still caught by the loop. `torch._scaled_mm`
takes q_a, q_b and the inverses 1/s_a, 1/s_b; a GPU multiplies in fp8 with fp32 accumulation and applies
the inverses to the result, (q_a / s_a)(q_b / s_b) = q_a q_b / (s_a s_b); a CPU dequantizes the
operands and multiplies in fp32: the same values to fp32 rounding.

Current vs delayed scaling (where amax comes from):
- current ("dynamic"): the amax of this tensor now. Exact, but two passes over the tensor (amax,
  then cast), and when the tensor is split over ranks an all-reduce MAX before the cast.
- delayed (TransformerEngine's DelayedScaling): the scale comes from the max of the last `history`
  steps' amaxes (TE's default: 1024); the tensor's own amax is recorded while it is cast and enters
  the history after the step (`update`), reduced over ranks once per step. One pass, no collective
  before the cast, but the scale lags: a tensor whose amax jumps 100x in one step saturates in that
  step (the overflow count shows it), and the step after adapts. Before the first `update` there is
  no history, so the first step scales currently.

Finer scales (not built here; ideas for later): one scale per row (torchao's rowwise recipe), per
1x128 tile of activations and 128x128 block of weights (DeepSeek-V3's recipe), or per 32-element
block with a power-of-two e8m0 scale (the OCP Microscaling "MX" formats, native on Blackwell). An
outlier then costs only its own row or block's precision instead of the whole tensor's; the amax
becomes a vector; `_scaled_mm` takes scale_a (M, 1) and scale_b (1, N) for rows, and blocked
shapes for the rest; under tensor parallelism only rows split along K would need the reduction.

Every layout quantizes alike: the scale is a function of the amax, and the amax of a tensor split over
ranks must be the GLOBAL one, so each role takes a `reduce_max(t)` (`enable` gives an all-reduce MAX
through parallel.Grid, counted). With it an element gets the same fp8 bits on one rank as on eight,
given the same value. Data and pipeline parallelism and ZeRO give every matmul the same values as one
process (a data-parallel rank's micro-batch is one of its micro-steps), so they reproduce it to fp32's
tolerance. (A data- or context-parallel rank's output gradients are dp·cp times one process's,
its loss being the mean over its share of the tokens; its scales are as many times smaller, the bits
the same. The amax history keeps one process's units, so a checkpoint resumes at another layout:
`Scaling`'s unit.) Tensor and context parallelism add partial sums in another order: a value that
lands within fp32 rounding of an fp8 rounding boundary may round the other way, off by up to one fp8
ulp, so those layouts agree to about 1e-5 over a step rather than 1e-7 (tests/test_fp8.py states and
checks both).

Memory: X is saved for the backward in fp8 (1 byte, not 2 or 4). W is saved as it was given (under
ZeRO-3, a view of the unit's gathered buffer, which the backward gathers again) and quantized again
in the backward with the forward's scale: the same bits, and no fp8 copy of every layer held from
forward to backward. A cast under no_grad (evaluation, sampling, recomputation's first forward) uses
the scale but records nothing; recomputation's second forward records, so each cast counts once.

The fast path (fp8_cast.py): on a GPU under delayed scaling each cast is one Triton kernel that
reads the tensor once and writes its codes, and the transposed codes the backward's matmuls take
(TransformerEngine's cast-transpose), with the amax and the counts reduced in the same pass: the
same bits as `quantize`. There a weight, whose scale and value are fixed for the step, is cast once
per optimizer step: its codes and their transpose (2 bytes a weight) are kept to the step's end,
its saturations counted once. ZeRO-3 gathers its weights per use, so it casts once per gather.

`_scaled_mm`'s contract (CUDA's, the strictest; the CPU accepts more, but this file keeps CUDA's
everywhere so the code that passes here runs on an H100): 2-D operands, the first row-major, the
second column-major; the contraction dim and the second operand's columns multiples of 16 (padded
with zeros here: exact, the padding adds zero products); per-tensor scales are fp32 tensors of one
element; out_dtype must be given (its default is fp8); e5m2 x e5m2 is refused (never needed here);
compute capability 8.9 or newer (`fp8_supported` says where it cannot run). On a CPU with AMX the call
is routed past oneDNN (`aten_cpu_kernel`), whose fp8 kernel there is ~1000x slower than ATen's.
"""

import contextlib
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fp8_cast
from parallel import placement

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MANTISSA_BITS = {E4M3: 3, E5M2: 2}
RECIPES = ("current", "delayed")
DEFAULT_HISTORY = 1024  # TransformerEngine's DelayedScaling default (amax_history_len)
ROLES = {"x": E4M3, "w": E4M3, "g": E5M2}  # the input, the weight, the output's gradient
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what _scaled_mm can write
FP32_MAX = torch.finfo(torch.float32).max

ReduceMax = Callable[[torch.Tensor], torch.Tensor]


def fmt_max(fmt: torch.dtype) -> float:
    """The largest finite value: 448 for e4m3fn, 57344 for e5m2."""
    return torch.finfo(fmt).max


def rounding_bound(fmt: torch.dtype) -> float:
    """Round-to-nearest's relative error for a normal value: half an ulp, 2^-(mantissa bits + 1)."""
    return 2.0 ** -(MANTISSA_BITS[fmt] + 1)


def smallest_subnormal(fmt: torch.dtype) -> float:
    """The spacing of the subnormals (and of the lowest normal binade): 2^-9 for e4m3fn, 2^-16 for e5m2."""
    return torch.finfo(fmt).smallest_normal * 2.0 ** -MANTISSA_BITS[fmt]


class Quantized(NamedTuple):
    data: torch.Tensor       # the fp8 tensor
    overflow: torch.Tensor   # int64 (): elements that rounding would take past ±max, saturated (±inf: NaN)
    underflow: torch.Tensor  # int64 (): nonzero elements that became zero


def scale_for(amax: torch.Tensor, fmt: torch.dtype, margin: float = 0.0) -> torch.Tensor:
    """s = fmt_max / amax / 2^margin (fp32, 0-dim): amax lands at fmt_max·2^-margin. Where amax is 0
    (an all-zero tensor: any scale is exact) or not finite (the step is lost anyway), s = 1; a tiny amax
    gives at most fp32's max, never inf."""
    s = (fmt_max(fmt) / amax.float() / 2.0 ** margin).clamp(max=FP32_MAX)
    return torch.where(torch.isfinite(amax) & (amax > 0), s, torch.ones_like(s))


def rounds_past_max(fmt: torch.dtype) -> float:
    """Where round-to-nearest would leave the format: fmt_max plus half an ulp of its binade (464 for
    e4m3fn, 61440 for e5m2). Below it the clamp changes nothing rounding would not."""
    return fmt_max(fmt) + 2.0 ** (math.floor(math.log2(fmt_max(fmt))) - MANTISSA_BITS[fmt] - 1)


def quantize(x: torch.Tensor, fmt: torch.dtype, scale: torch.Tensor) -> Quantized:
    """fp8(x·scale), saturating at ±fmt_max, with the counts of what saturated (|x·scale| at or past
    `rounds_past_max`) and of what flushed to 0. The clamp is ours, not the cast's: torch's own cast of
    a too-large value differs by format (e5m2: inf; e4m3fn: 448 on this CPU, with no promise elsewhere)."""
    top = fmt_max(fmt)
    xs = x.float() * scale  # in fp32: one rounding (2^-24) before the cast's
    mag = xs.abs()
    overflow = (mag >= rounds_past_max(fmt)).sum()
    underflow = ((mag <= smallest_subnormal(fmt) / 2) & (mag > 0)).sum()  # ties round to even: to 0
    data = torch.where(mag == math.inf, torch.nan, xs.clamp(-top, top)).to(fmt)  # ±inf: NaN, not ±max
    return Quantized(data, overflow, underflow)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q / scale in fp32, as _scaled_mm applies it: times the inverse scale."""
    return q.float() * scale.reciprocal()


@contextlib.contextmanager
def aten_cpu_kernel(device: torch.device):
    """On a CPU with AMX, torch sends float8 _scaled_mm to oneDNN, whose fp8 kernel there is a reference
    loop (10 s for one of mini's Linears, where fp32 takes 10 ms). With oneDNN off for the call, ATen's
    own CPU kernel runs, fast: it dequantizes each operand (q times its inverse scale, in fp32) and
    multiplies in fp32. The result differs from oneDNN's in the last bits, within fp32 rounding."""
    if device.type != "cpu" or not torch.backends.mkldnn.enabled:
        yield
        return
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = True


def scaled_matmul(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """(a / scale_a) @ (b / scale_b) for fp8 a (M, K) and b (K, N) of any layout, through _scaled_mm:
    a made row-major, b column-major (copies of one byte per element where they are not), K and N
    padded with zeros to multiples of 16, the inverse scales passed as _scaled_mm wants them."""
    k, n = a.shape[1], b.shape[1]
    pad_k, pad_n = -k % 16, -n % 16
    if pad_k or pad_n:
        a, b = F.pad(a, (0, pad_k)), F.pad(b, (0, pad_n, 0, pad_k))  # zero products: the sum is unchanged
    with aten_cpu_kernel(a.device):
        y = torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=scale_a.reciprocal(),
                             scale_b=scale_b.reciprocal(), out_dtype=out_dtype)  # (M, N + pad_n)
    return y[:, :n].contiguous() if pad_n else y


class Scaling:
    """The scale of one tensor role (x, w or g of one Linear) and what its casts saw.

    `cast(t)` quantizes t: current scaling from t's amax now (reduced with `reduce_max` first, when t
    is split over ranks), delayed scaling from the history (current until the first `update`). Under
    grad mode it also records t's amax (the max over the step's casts) and the overflow and underflow
    counts. `update()`, once per optimizer step, rolls the step's amax into the history (newest first,
    as TE keeps it), takes the delayed scale from the history's max for the next step, resets the
    counts and returns the finished step's statistics. Everything stays on the device: no host reads.
    `fused`: cast through fp8_cast's kernel (None: on a GPU under delayed scaling); `keep`: on that
    path, keep the codes of a tensor's first cast in a step (a weight's) for the rest of the step.

    `unit`: how many times one process's values this rank's tensor holds. A data-parallel (or
    context-parallel) rank's loss is the mean over its 1/(dp·cp) of the batch's tokens, so the
    output gradients it casts are dp·cp times one process's (the gradient all-reduce averages them
    back); its scales are dp·cp times smaller, the fp8 bits the same. The history is kept in one
    process's units (amax / unit), so a checkpoint resumed at another layout takes the scales one
    process would, not ones off by the ratio of the two layouts for the history's length.
    """

    def __init__(self, fmt: torch.dtype, recipe: str = "current", history: int = DEFAULT_HISTORY,
                 margin: float = 0.0, reduce_max: ReduceMax | None = None, device="cpu",
                 fused: bool | None = None, keep: bool = False, unit: float = 1.0):
        if fmt not in MANTISSA_BITS:
            raise ValueError(f"fp8 format must be float8_e4m3fn or float8_e5m2, not {fmt}")
        if recipe not in RECIPES:
            raise ValueError(f"fp8 scaling recipe must be one of {', '.join(RECIPES)}, not {recipe!r}")
        if history < 1 or not (0 <= margin < 64):
            raise ValueError(f"fp8 amax history must be >= 1 (got {history}) and margin in [0, 64) (got {margin})")
        self.fmt, self.recipe, self.history, self.margin, self.reduce_max = fmt, recipe, history, margin, reduce_max
        self.unit = unit
        self.amax_history = torch.zeros(history, device=device)  # [0]: the newest step (unit 1)
        self.scale = torch.ones((), device=device)  # delayed: this step's; current: the last cast's
        self.updates = 0  # update() calls: steps recorded in the history
        self.fused, self.keep = fused, keep
        self._reset()

    def _reset(self) -> None:
        device = self.scale.device
        self.step_amax = torch.zeros((), device=device)  # max |t| over this step's casts (this rank's, for delayed)
        self.overflow = torch.zeros((), dtype=torch.int64, device=device)
        self.underflow = torch.zeros((), dtype=torch.int64, device=device)
        self.kept = None  # keep: ((t's address, version), (q, scale, qᵀ)) of this step

    def cast(self, t: torch.Tensor, record: bool = True, transpose: bool = False) -> tuple:
        """t in fp8 and the scale used: t ≈ q / scale. transpose: a third value, tᵀ's codes,
        row-major as the backward's matmuls take them: on the fused path written by the same pass
        (fp8_cast.py), else None."""
        t = t.detach()
        if (kept := self._kept(t)) is not None:
            return kept if transpose else kept[:2]
        fused, delayed = self._fused(t), self.recipe == "delayed" and self.updates > 0
        keep = record and self.keep and fused and delayed  # the history's scale: fixed for the step
        amax = None if fused and delayed else t.abs().amax().float()  # (fused: the kernel's)
        if not delayed:
            if self.reduce_max is not None:
                amax = self.reduce_max(amax)  # the whole tensor's, when t is one rank's part of it
            scale = scale_for(amax, self.fmt, self.margin)
        else:
            scale = self.scale
        if fused:  # one pass: the codes (and tᵀ's), the counts and the amax
            data, data_t, over, under, seen = fp8_cast.cast_transpose(t, self.fmt, scale,
                                                                       cols=transpose or keep)
            q, amax = Quantized(data, over, under), seen if amax is None else amax
        else:
            q, data_t = quantize(t, self.fmt, scale), None
        if record:
            self.scale = scale
            self.step_amax = torch.maximum(self.step_amax, amax)
            self.overflow, self.underflow = self.overflow + q.overflow, self.underflow + q.underflow
            if keep:  # the step's other casts of t take these codes
                self.kept = ((t.data_ptr(), t._version), (q.data, scale, data_t))
        return (q.data, scale, data_t) if transpose else (q.data, scale)

    def recast(self, t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """t's codes (N, K) again, for the backward, recording nothing: the kept ones, or cast anew
        (on the fused path as tᵀ's codes, so column-major, as dX = dY W wants W)."""
        if (kept := self._kept(t)) is not None:
            return kept[2].t()
        if self._fused(t):
            _, data_t, *_ = fp8_cast.cast_transpose(t.detach(), self.fmt, scale, rows=False,
                                                    cols=True)
            return data_t.t()
        return quantize(t, self.fmt, scale).data

    def _kept(self, t: torch.Tensor) -> tuple | None:
        """(q, scale, qᵀ) kept this step for t: the same tensor, not written to since."""
        return self.kept[1] if self.kept and self.kept[0] == (t.data_ptr(), t._version) else None

    def _fused(self, t: torch.Tensor) -> bool:
        """Through fp8_cast's kernel? `fused`; where it is None, on a GPU under delayed scaling."""
        on = self.fused if self.fused is not None else t.is_cuda and self.recipe == "delayed"
        return on and fp8_cast.triton is not None and t.dim() == 2 and t.dtype in OUT_DTYPES

    def update(self, reduce_max: ReduceMax | None = None) -> dict[str, torch.Tensor]:
        """End of an optimizer step. `reduce_max` spans every rank whose casts belong to this step's
        tensor (data-parallel ranks included: one process sees all of them), so the history, and the
        next delayed scale, are those of one process. Returns the finished step's amax, the scale it
        used and its overflow and underflow counts (this rank's casts; the amax at unit 1)."""
        amax = self.step_amax if reduce_max is None else reduce_max(self.step_amax)
        amax = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))  # a lost step leaves no trace
        amax = amax / self.unit  # one process's units (the class docstring)
        stats = {"amax": amax, "scale": self.scale, "overflow": self.overflow, "underflow": self.underflow}
        self.amax_history = torch.cat([amax.reshape(1), self.amax_history[:-1]])
        if self.recipe == "delayed":
            self.scale = self.delayed_scale()
        self.updates += 1
        self._reset()
        return stats

    def delayed_scale(self) -> torch.Tensor:
        """The scale of the history's largest amax, at this rank's unit (all zeros: as it was)."""
        top = self.amax_history.max() * self.unit
        return torch.where(top > 0, scale_for(top, self.fmt, self.margin), self.scale)

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the history and the scale (copies) and the settings they belong to."""
        return {"fmt": str(self.fmt).removeprefix("torch."), "recipe": self.recipe, "history": self.history,
                "margin": self.margin, "updates": self.updates,
                "amax_history": self.amax_history.clone(), "scale": self.scale.clone()}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("fmt", "recipe", "history", "margin"):
            if state[key] != mine[key]:
                raise ValueError(f"the checkpoint's fp8 scaling has {key} {state[key]!r}, this run {mine[key]!r}: "
                                 f"resume with the same --precision fp8 settings")
        device = self.scale.device
        self.amax_history = state["amax_history"].to(device, torch.float32).clone()
        self.scale = state["scale"].to(device, torch.float32).clone()
        self.updates = int(state["updates"])
        if self.recipe == "delayed" and self.updates:  # the saved scale is its layout's: take
            self.scale = self.delayed_scale()  # ours as update() did (at one layout: the same bits)
        self._reset()


class Fp8LinearState:
    """The three roles of one Linear: x (its input, e4m3), w (its weight, e4m3), g (its output's
    gradient, e5m2). `reduce_max` is one callable for all three or a dict by role (a column-parallel
    layer's x is whole on each rank while its w and g are split; a row-parallel layer's x and w
    split). `fused` and `keep_weight`: Scaling's `fused`, and its `keep` for w."""

    def __init__(self, recipe: str = "current", history: int = DEFAULT_HISTORY, margin: float = 0.0,
                 reduce_max: ReduceMax | dict[str, ReduceMax] | None = None, device="cpu",
                 fused: bool | None = None, keep_weight: bool = True, grad_unit: float = 1.0):
        hooks = reduce_max if isinstance(reduce_max, dict) else dict.fromkeys(ROLES, reduce_max)
        if not set(hooks) <= set(ROLES):
            raise ValueError(f"reduce_max roles must be among {', '.join(ROLES)}, not {', '.join(hooks)}")
        self.x, self.w, self.g = (Scaling(fmt, recipe, history, margin, hooks.get(role), device,
                                          fused, keep=keep_weight and role == "w",
                                          unit=grad_unit if role == "g" else 1.0)
                                  for role, fmt in ROLES.items())

    def roles(self) -> dict[str, Scaling]:
        return {"x": self.x, "w": self.w, "g": self.g}

    def update(self, reduce_max: ReduceMax | None = None) -> dict[str, dict[str, torch.Tensor]]:
        return {role: s.update(reduce_max) for role, s in self.roles().items()}

    def state_dict(self) -> dict:
        return {role: s.state_dict() for role, s in self.roles().items()}

    def load_state_dict(self, state: dict) -> None:
        for role, s in self.roles().items():
            s.load_state_dict(state[role])


class _Fp8Linear(torch.autograd.Function):
    """y = x Wᵀ + b with both matmuls of the backward in fp8 too (the table at the top)."""

    @staticmethod
    def forward(ctx, x, weight, bias, state: Fp8LinearState, out_dtype: torch.dtype, record: bool):
        xq, sx, xq_t = state.x.cast(x, record, transpose=True)  # (M, K) e4m3; fused: and (K, M)
        wq, sw = state.w.cast(weight, record)  # (N, K) e4m3: after ZeRO-3's gather, since it is the gathered W
        y = scaled_matmul(xq, wq.t(), sx, sw, out_dtype)  # (M, N); wq.t() is column-major as it is
        if bias is not None:
            y = y + bias.to(out_dtype)
        ctx.save_for_backward(xq if xq_t is None else xq_t.t(), weight, sx, sw)  # xq: 1 byte each
        ctx.state, ctx.x_dtype, ctx.bias_dtype = state, x.dtype, None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        xq, weight, sx, sw = ctx.saved_tensors
        dx = dw = db = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            gq, sg, gq_t = ctx.state.g.cast(dy, transpose=True)  # (M, N) e5m2; fused: and (N, M)
            if ctx.needs_input_grad[0]:
                wq = ctx.state.w.recast(weight, sw)  # the forward's bits again (already counted)
                dx = scaled_matmul(gq, wq, sg, sw, ctx.x_dtype)  # (M, N) @ (N, K)
            if ctx.needs_input_grad[1]:
                gq_t = gq.t() if gq_t is None else gq_t  # (N, M)
                dw = scaled_matmul(gq_t, xq, sg, sx, weight.dtype)  # (N, M) @ (M, K)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            db = dy.float().sum(0).to(ctx.bias_dtype)  # (N,), summed in fp32
        return dx, dw, db, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               state: Fp8LinearState) -> torch.Tensor:
    """F.linear(x, weight, bias) with its three matmuls in fp8 (x: (..., K), weight: (N, K)). The
    output has the dtype F.linear would give: autocast's where autocast is on, else x's."""
    if x.dtype not in OUT_DTYPES or weight.dtype not in OUT_DTYPES:
        raise TypeError(f"fp8_linear takes float32, bfloat16 or float16 x and weight, not {x.dtype} and {weight.dtype}")
    if x.shape[-1] != weight.shape[1] or (bias is not None and bias.shape != weight.shape[:1]):
        raise ValueError(f"fp8_linear: x {tuple(x.shape)}, weight {tuple(weight.shape)} and bias "
                         f"{None if bias is None else tuple(bias.shape)} do not fit y = x Wᵀ + b")
    kind = x.device.type
    out_dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
    with torch.autocast(kind, enabled=False):  # our casts are the precision; autocast must not add its own
        y = _Fp8Linear.apply(x.reshape(-1, x.shape[-1]), weight, bias, state, out_dtype, torch.is_grad_enabled())
    return y.reshape(*x.shape[:-1], weight.shape[0])


def fp8_supported(device: torch.device | str) -> str | None:
    """None where _scaled_mm multiplies float8 on `device` (both of the pairs used here); else one line
    that says why not, for `--precision fp8` to refuse with."""
    device = torch.device(device)
    try:
        a, g = torch.zeros(16, 16, device=device, dtype=E4M3), torch.zeros(16, 16, device=device, dtype=E5M2)
        one = torch.ones((), device=device)
        scaled_matmul(a, a.t(), one, one, torch.float32)  # the forward's pair
        scaled_matmul(g, a, one, one, torch.float32)  # the backward's
    except Exception as e:  # noqa: BLE001 (any failure means "not here"; its first line says which)
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return f"fp8 needs torch._scaled_mm with float8 operands, which does not run on {device}: {reason}"
    return None


# ----------------------------------------------------------------------------- a model's Linears


def enable(model: torch.nn.Module, grid, recipe: str = "current", history: int = DEFAULT_HISTORY,
           fused: bool | None = None, keep_weights: bool = True) -> list:
    """--precision fp8: give every Linear of the transformer blocks (qkv, attention out, MLP in and out) the
    scaling of its three tensors; the embeddings, the norms and the output layer stay as they were.
    A tensor split over ranks takes its amax over them (`reduce_max`, an all-reduce MAX through the Grid,
    counted): tensor parallelism splits a column-parallel layer's w and output gradient (its weight's
    `shard` dim is 0) and a row-parallel layer's x and w (dim 1); context parallelism splits every x and
    gradient along the sequence. So a layout casts each element with the scale one process would
    (an output gradient, dp x cp times one process's, with a scale as many times smaller: `unit`).
    `fused`: the casts through fp8_cast's kernel (None: on a GPU under delayed scaling);
    `keep_weights` False under ZeRO-3, whose weights are gathered per use. Returns [(module name,
    Fp8LinearState)] in module order."""
    states = []
    for name, m in model.named_modules():
        if not name.startswith("transformer.h.") or not hasattr(type(m), "fp8"):
            continue
        spec = placement(m.weight).shard
        split = spec["dim"] if spec and spec["count"] > 1 else None
        groups = {"x": ["tp"] if split == 1 else [], "w": ["tp"] if split is not None else [],
                  "g": ["tp"] if split == 0 else []}
        if grid.cp > 1:
            groups["x"].append("cp")
            groups["g"].append("cp")
        m.fp8 = Fp8LinearState(recipe, history, reduce_max={r: _reduce_over(grid, gs) for r, gs in groups.items()},
                               device=grid.device, fused=fused, keep_weight=keep_weights,
                               grad_unit=grid.dp_cp)
        states.append((name, m.fp8))
    return states


def _reduce_over(grid, groups: list[str]) -> ReduceMax | None:
    if not any(grid.size(g) > 1 for g in groups):
        return None

    def reduce_max(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        for g in groups:
            grid.all_reduce(t, g, op=dist.ReduceOp.MAX)
        return t
    return reduce_max


def states(model: torch.nn.Module) -> list:
    """(module name, Fp8LinearState) of every Linear that `enable` gave one."""
    return [(name, m.fp8) for name, m in model.named_modules() if getattr(m, "fp8", None) is not None]


def end_step(model: torch.nn.Module, grid, recipe: str) -> list[torch.Tensor]:
    """After the optimizer step: every scaling rolls its step into its history. Under delayed scaling the
    next scale must be the one a single process would take, so each amax is first the max over every rank
    that cast a part of that tensor this step: one all-reduce MAX over tp, one over dp x cp, of 4 bytes per
    role per Linear this rank holds. Returns [this rank's saturated elements in the step] (a float on the
    device, read with the step's other numbers), or [] for a model without fp8."""
    scalings = [s for _, state in states(model) for s in state.roles().values()]
    if not scalings:
        return []
    overflow = sum((s.overflow for s in scalings), torch.zeros((), dtype=torch.int64, device=grid.device))
    if recipe == "delayed" and scalings:
        amax = torch.stack([s.step_amax for s in scalings])
        for group in ("tp", "dp_cp"):
            grid.all_reduce(amax, group, op=dist.ReduceOp.MAX)
        for s, a in zip(scalings, amax, strict=True):
            s.step_amax = a
    for s in scalings:
        s.update()
    return [overflow.float()]


def checkpoint_tensors(states: list) -> dict[str, torch.Tensor]:
    """What a checkpoint keeps of each scaling, by "<module>::fp8.<role>.<field>": the amax history, the scale
    and how many steps it has seen (its settings are the run's --fp8-* flags, checked with the precision)."""
    return {f"{name}::fp8.{role}.{field}": value for name, state in states for role, s in state.roles().items()
            for field, value in (("amax_history", s.amax_history), ("scale", s.scale),
                                 ("updates", torch.tensor(float(s.updates))))}  # a float: exact to 2^24 steps


def load_checkpoint_tensors(states: list, values: dict[str, torch.Tensor]) -> None:
    """The inverse of checkpoint_tensors, given every key it wrote."""
    for name, state in states:
        for role, s in state.roles().items():
            s.load_state_dict({**s.state_dict(), **{field: values[f"{name}::fp8.{role}.{field}"]
                                                    for field in ("amax_history", "scale", "updates")}})
