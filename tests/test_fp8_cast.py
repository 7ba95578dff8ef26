"""fp8_cast.py's fused cast in the Triton interpreter (conftest sets TRITON_INTERPRET=1), bit for bit
against fp8.quantize: every bf16 and fp16 value, fp32 values at every rounding boundary, the codes,
the transposed codes, what saturates, what flushes and the amax; then fp8.py's fused path against its
PyTorch path, a Linear over several steps and a tiny training run: the same bits. (The kernel compiled
for sm_89 and sm_90: tests/test_kernels_aot.py; run on a GPU: `check_fused`, which tests/test_gpu.py calls.)"""

import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch

import fp8
import fp8_cast
from fp8 import E4M3, E5M2

FORMATS = [E4M3, E5M2]
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy: signaling NaNs


def assert_casts_alike(x, fmt, scale, launch=None):
    """cast_transpose(x) against fp8.quantize(x): codes and transposed codes bit for bit (NaN's sign
    too), the same counts, the same amax (both NaN, or the same bits)."""
    want = fp8.quantize(x, fmt, scale)
    q, q_t, overflow, underflow, amax = fp8_cast.cast_transpose(x, fmt, scale, cols=True, launch=launch)
    codes = want.data.view(torch.uint8)
    assert torch.equal(q.view(torch.uint8), codes), f"{(q.view(torch.uint8) != codes).sum()} codes differ"
    assert torch.equal(q_t.view(torch.uint8), codes.t())
    assert (overflow.item(), underflow.item()) == (want.overflow.item(), want.underflow.item())
    ref = x.abs().amax().float()
    assert amax.dtype == torch.float32 and (amax.isnan().item() and ref.isnan().item() or amax.item() == ref.item())
    return want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", FORMATS, ids=["e4m3", "e5m2"])
def test_every_16_bit_value_casts_as_quantize(fmt, dtype):
    """All 65,536 bit patterns of the input type (±0, subnormals, every normal, ±inf, NaNs), at a scale
    of 1 and at one that is no power of two (x·s rounds in fp32 first): some saturate, some flush."""
    x = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype).reshape(256, 256)
    for scale in (1.0, 0.37):
        want = assert_casts_alike(x, fmt, torch.tensor(scale))
        assert want.overflow.item() > 0 and want.underflow.item() > 0
        assert_casts_alike(x.nan_to_num(0.0, 0.0, 0.0), fmt, torch.tensor(scale))  # a finite amax


def boundaries(fmt):
    """fp32 values where the cast decides: every midpoint between neighbouring fp8 values (a tie: to
    even) and the fp32 numbers either side of it, the saturation and flush thresholds and theirs, ±0,
    ±inf, ±NaN; both signs."""
    values = torch.arange(256, dtype=torch.uint8).view(fmt).float()
    values = values[values.isfinite() & (values >= 0)].unique()  # sorted, 0 to max
    mids = (values[1:] + values[:-1]) / 2  # exact in fp32
    edges = torch.cat([mids, values, torch.tensor([fp8.rounds_past_max(fmt), fp8.smallest_subnormal(fmt) / 2,
                                                   fp8.fmt_max(fmt) * 4, 1e-30])])
    near = torch.cat([edges, edges.nextafter(torch.tensor(math.inf)), edges.nextafter(torch.tensor(0.0))])
    special = torch.tensor([math.inf, math.nan])
    return torch.cat([near, -near, special, -special])


@pytest.mark.parametrize("fmt", FORMATS, ids=["e4m3", "e5m2"])
def test_fp32_values_at_every_rounding_boundary_cast_as_quantize(fmt):
    """Ties, their neighbours and the thresholds, and random fp32 bit patterns of every exponent, in a
    ragged (37, n) tile, under the interpreter's launch and the GPU's (several programs, each walking
    several tiles), and read through a transposed view (strided rows)."""
    gen = torch.Generator().manual_seed(0)
    random_bits = torch.randint(-2**31, 2**31 - 1, (37 * 60,), generator=gen, dtype=torch.int64)
    x = torch.cat([boundaries(fmt), random_bits.to(torch.int32).view(torch.float32)])
    x = torch.cat([x, torch.zeros(-len(x) % 37)]).reshape(37, -1)
    for launch in (None, fp8_cast.GPU_LAUNCH):
        assert_casts_alike(x, fmt, torch.tensor(1.0), launch)
        assert_casts_alike(x.t(), fmt, torch.tensor(1.0), launch)
    finite = x.nan_to_num(0.0, 0.0, 0.0) * 1e-3
    want = assert_casts_alike(finite, fmt, fp8.scale_for(finite.abs().amax(), fmt))
    assert want.overflow.item() == 0 and want.underflow.item() > 0


def delayed_steps(fused: bool, keep: bool = True, steps: int = 3, micro: int = 2, seed: int = 0, device="cpu"):
    """fp8_linear over `steps` optimizer steps of `micro` micro-batches, delayed scaling, K and N not
    multiples of 16 (the matmuls pad); the activations jump 30x at step 2. -> every output and gradient,
    each step's statistics, and the casts made (their shapes and which codes they wrote)."""
    gen = torch.Generator().manual_seed(seed)
    w, b = (torch.randn(20, 24, generator=gen) * 0.1).to(device), torch.randn(20, generator=gen).to(device)
    state = fp8.Fp8LinearState("delayed", history=2, fused=fused, keep_weight=keep, device=device)
    calls, real = [], fp8_cast.cast_transpose

    def counting(x, fmt, scale, rows=True, cols=False, launch=None):
        calls.append((tuple(x.shape), rows, cols))
        return real(x, fmt, scale, rows, cols, launch)

    out, stats = [], []
    fp8_cast.cast_transpose = counting
    try:
        for step in range(steps):
            wr, br = w.clone().requires_grad_(), b.clone().requires_grad_()  # the step's parameters
            for _ in range(micro):
                x = (torch.randn(40, 24, generator=gen) * (30 if step == 1 else 1)).to(device).requires_grad_()
                y = fp8.fp8_linear(x, wr, br, state)
                y.backward((torch.randn(40, 20, generator=gen) * 1e-3).to(device))
                out += [y.detach(), x.grad, wr.grad.clone(), br.grad.clone()]
            stats.append(state.update())
            w = w - 0.01 * torch.randn(20, 24, generator=gen).to(device)  # the optimizer's step: a new weight
    finally:
        fp8_cast.cast_transpose = real
    return out, stats, calls


def test_fp8_linear_fused_equals_unfused_bit_for_bit_and_casts_its_weight_once_a_step():
    """Through the kernel (x's and dY's codes with their transposes, the weight's kept for the step)
    every output and gradient of every micro-batch is the PyTorch path's, bit for bit, and so are the
    steps' amaxes and scales. The weight is cast once per optimizer step once the history gives its
    scale (step 1 scales currently: cast in the forward, again in the backward); without keep_weight
    (ZeRO-3, which gathers it for the forward and again for the backward) once per gather."""
    (plain, plain_stats, _), (fused, fused_stats, calls) = delayed_steps(False), delayed_steps(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, fused, strict=True))
    for a, b in zip(plain_stats, fused_stats, strict=True):
        assert all(torch.equal(a[r]["amax"], b[r]["amax"]) and torch.equal(a[r]["scale"], b[r]["scale"])
                   for r in fp8.ROLES)
    assert fused_stats[1]["x"]["overflow"].item() > 0  # the jump saturated something: counts compared
    assert [fused_stats[i]["x"]["overflow"].item() for i in range(3)] == \
        [plain_stats[i]["x"]["overflow"].item() for i in range(3)]
    weight = Counter(c for c in calls if c[0] == (20, 24))
    assert weight == {((20, 24), True, False): 2, ((20, 24), False, True): 2, ((20, 24), True, True): 2}
    assert Counter(c[1:] for c in calls if c[0] == (40, 24)) == {(True, True): 6}  # x: cast-transpose
    _, _, per_gather = delayed_steps(True, keep=False)
    assert Counter(c for c in per_gather if c[0] == (20, 24)) == {((20, 24), True, False): 6,
                                                                  ((20, 24), False, True): 6}


def test_a_training_run_through_the_fused_cast_has_the_unfused_losses_bit_for_bit():
    """The tiny GPT (2 layers), delayed scaling, 3 steps of 2 micro-batches, every block Linear's casts
    through the kernel (fp8.enable(fused=True)) or through PyTorch: the same losses and final weights,
    bit for bit (same codes, same scales)."""
    import model as gpt
    import parallel

    data = torch.tensor(list(Path(json.__file__).with_name("decoder.py").read_bytes()))

    def train(fused):
        m = gpt.build(gpt.config_from_preset("tiny", vocab_size=257, n_layer=2), seed=0)
        fp8.enable(m, parallel.Grid(), "delayed", 2, fused=fused)
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
        gen, losses = torch.Generator().manual_seed(1), []
        for _ in range(3):
            for _ in range(2):
                starts = torch.randint(0, len(data) - 17, (4,), generator=gen).tolist()
                batch = torch.stack([data[i:i + 17] for i in starts])
                _, loss = m(batch[:, :-1], batch[:, 1:])
                (loss / 2).backward()
                losses.append(loss.item())
            opt.step()
            opt.zero_grad()
            fp8.end_step(m, parallel.Grid(), "delayed")
        return losses, list(m.parameters())

    (plain, plain_w), (fused, fused_w) = train(False), train(True)
    assert plain == fused and plain[-1] < plain[0], (plain, fused)
    assert all(torch.equal(a, b) for a, b in zip(plain_w, fused_w, strict=True))


def check_fused(device: str) -> None:
    """The kernel on `device` (tests/test_gpu.py runs this on a GPU, compiled; it dry-runs on a CPU in the
    interpreter): every bf16 value and fp32's rounding boundaries cast as fp8.quantize casts them there,
    and where _scaled_mm multiplies fp8, fp8_linear's steps give the same bits fused and not."""
    x = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256)
    for fmt in FORMATS:
        assert_casts_alike(x.to(device), fmt, torch.tensor(0.37, device=device))
        edges = boundaries(fmt)
        assert_casts_alike(torch.cat([edges, edges.new_zeros(-len(edges) % 64)]).reshape(64, -1).to(device), fmt,
                           torch.tensor(1.0, device=device))
    if fp8.fp8_supported(device) is None:
        (plain, _, _), (fused, _, calls) = delayed_steps(False, device=device), delayed_steps(True, device=device)
        assert all(torch.equal(a, b) for a, b in zip(plain, fused, strict=True)) and calls
    print(f"fp8_cast on {device}: quantize's bits" + (", fp8_linear's too" if fp8.fp8_supported(device) is None
                                                      else " (no fp8 matmul here)"))
