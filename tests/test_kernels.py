"""The Triton attention kernel, checked numerically in the Triton interpreter (conftest sets
TRITON_INTERPRET=1), against a float64 reference computed from the same (rounded) inputs.

The interpreter runs each program one after another with numpy, so it proves the math, the masks
and the indexing, not speed or races; tests/test_kernels_aot.py proves the kernels compile well for
real GPUs, tests/test_gpu.py runs them on one. Sizes stay tiny (T <= 128): the interpreter is slow.

Also here: the custom ops pass torch.library.opcheck (their fake implementations agree with the real
ones), torch.compile of a block that calls the kernel matches eager, a block on SDPA stays one graph when
its sequence length is symbolic, and `triton_problem` says in one line why the kernel cannot run where it
cannot.

Grouped-query attention (the last section): 8 query heads over 1, 2, 4 and 8 kv heads, against K and V
repeated in float64; the packed (B, T, H + 2 H_kv, D) op against the unpacked one; and the bytes the
kernel path allocates, measured, with no room for a repeated K or V.
"""

import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT
from torch.utils._python_dispatch import TorchDispatchMode

import kernels
from kernels import attention, attention_math, flash_backward, flash_forward

TOL = {torch.float32: 1e-4, torch.float16: 1e-2}


def qkv_view(B, T, H, D, dtype, seed=0):
    """q, k, v as the model makes them: strided views into one fused (B, T, 3, H, D) projection."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, T, 3, H, D, generator=gen).to(dtype).requires_grad_()
    return qkv, qkv.permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, D), not contiguous


def reference(q, k, v, do):
    """Output and input gradients in float64 from the very same numbers the kernel saw."""
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    o = attention_math(q64, k64, v64)
    o.backward(do.double())
    return o, q64.grad, k64.grad, v64.grad


def run_triton(q, k, v, do):
    o = attention(q, k, v, "triton")
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    return o, dq, dk, dv


def assert_close(got, want, dtype, names=("o", "dq", "dk", "dv")):
    for name, g, w in zip(names, got, want, strict=True):
        assert g.shape == w.shape, name
        err = (g.double() - w).abs().max().item()
        assert err <= TOL[dtype], f"{name}: max abs error {err:.2e} > {TOL[dtype]:.0e}"


CASES = [(T, D, torch.float32) for T in (1, 17, 64, 100, 128) for D in (16, 64)]
CASES += [(T, D, torch.float16) for T, D in ((1, 32), (17, 128), (64, 32), (100, 64), (128, 16))]


@pytest.mark.parametrize("T,D,dtype", CASES, ids=[f"T{T}-D{D}-{str(dt)[6:]}" for T, D, dt in CASES])
def test_forward_and_gradients_match_float64(T, D, dtype):
    _, (q, k, v) = qkv_view(2, T, 2, D, dtype)
    do = torch.randn(2, 2, T, D, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert_close(run_triton(q, k, v, do), reference(q, k, v, do), dtype)


def test_separately_strided_inputs():
    """q, k, v with three different layouts, one whose last dimension is not contiguous."""
    B, H, T, D = 2, 3, 40, 32
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(B, T, H, D, generator=gen).transpose(1, 2).requires_grad_()  # (B, H, T, D) view
    k = torch.randn(B, H, T, D, generator=gen).requires_grad_()  # contiguous
    v = torch.randn(B, H, D, T, generator=gen).transpose(2, 3).requires_grad_()  # stride(-1) == T
    do = torch.randn(B, T, H, D, generator=gen).transpose(1, 2)
    assert_close(run_triton(q, k, v, do), reference(q, k, v, do), torch.float32)


@pytest.mark.parametrize("T", [17, 100])
def test_memory_past_the_sequence_is_never_read(T):
    """Each head's rows sit in a buffer padded with NaN: one unmasked load along T would spread it."""
    B, H, D, pad = 1, 2, 16, 16
    gen = torch.Generator().manual_seed(3)

    def padded(x):  # the same values, but every head continues into NaN
        buf = torch.full((B, H, T + pad, D), float("nan"))
        buf[:, :, :T] = x
        return buf[:, :, :T]

    q, k, v, do = (padded(torch.randn(B, H, T, D, generator=gen)) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    got = run_triton(q, k, v, do)
    assert all(torch.isfinite(g).all() for g in got)
    assert_close(got, reference(q, k, v, do), torch.float32)


@pytest.mark.parametrize("D", kernels.HEAD_DIMS)
def test_shipped_launch_configs_in_the_interpreter(D):
    """The GPU block sizes (not the small interpreter ones) on a sequence that spans several blocks."""
    cfg = kernels.SHIPPED[D, torch.float16]
    T = 2 * max(cfg.block_m, cfg.big) - 9  # several blocks, the last one ragged
    _, (q, k, v) = qkv_view(1, T, 1, D, torch.float16, seed=D)
    do = torch.randn(1, 1, T, D, generator=torch.Generator().manual_seed(5)).to(torch.float16)
    o, lse = flash_forward(q, k, v, cfg)
    grads = flash_backward(q, k, v, o, lse, do, cfg)
    assert_close((o, *grads), reference(q, k, v, do), torch.float16)


def test_log_sum_exp_is_saved_in_base_2():
    _, (q, k, v) = qkv_view(1, 33, 2, 16, torch.float32)
    _, lse = flash_forward(q, k, v, kernels.INTERPRETER_LAUNCH)  # (B, H, T)
    scores = (q @ k.transpose(-2, -1)).double() / math.sqrt(16)
    scores = scores.masked_fill(torch.ones(33, 33, dtype=torch.bool).triu(1), float("-inf"))
    assert torch.allclose(lse.double(), torch.logsumexp(scores, -1) / math.log(2), atol=1e-5)


UNMASKED = [(40, 24, 16), (17, 100, 32), (64, 64, 64), (1, 33, 16), (96, 8, 16)]


@pytest.mark.parametrize("TQ,TK,D", UNMASKED, ids=[f"q{a}-k{b}-D{c}" for a, b, c in UNMASKED])
def test_unmasked_mode_with_another_key_count_matches_float64(TQ, TK, D):
    """Ring attention's blocks off the diagonal (context.py): causal=False, every query sees all TK keys,
    TQ != TK, and the log-sum-exp of every row comes back (base 2) so that blocks can be merged."""
    gen = torch.Generator().manual_seed(TQ * 1000 + TK)
    q, do = torch.randn(2, 3, TQ, D, generator=gen), torch.randn(2, 3, TQ, D, generator=gen)
    k, v = torch.randn(2, 3, TK, D, generator=gen), torch.randn(2, 3, TK, D, generator=gen)
    cfg = kernels.INTERPRETER_LAUNCH
    o, lse = flash_forward(q, k, v, cfg, causal=False)
    grads = flash_backward(q, k, v, o, lse, do, cfg, causal=False)
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    scores = q64 @ k64.transpose(-2, -1) / math.sqrt(D)  # no mask
    o64 = torch.softmax(scores, -1) @ v64
    o64.backward(do.double())
    assert_close((o, *grads), (o64.detach(), q64.grad, k64.grad, v64.grad), torch.float32)
    assert (lse.double() * math.log(2) - torch.logsumexp(scores.detach(), -1)).abs().max() <= 1e-5


def test_backward_is_deterministic():
    _, (q, k, v) = qkv_view(1, 50, 2, 16, torch.float32)
    do = torch.randn(1, 2, 50, 16)
    first, second = run_triton(q, k, v, do), run_triton(q, k, v, do)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_dispatch():
    _, (q, k, v) = qkv_view(1, 9, 2, 16, torch.float32)
    sdpa = kernels.attention_sdpa(q, k, v)
    assert torch.equal(attention(q, k, v, "auto"), sdpa)  # auto on a CPU is SDPA
    # a KV cache (Tq != Tk) goes to SDPA even when Triton is asked for
    assert torch.equal(attention(q[:, :, -1:], k, v, "triton"), kernels.attention_sdpa(q[:, :, -1:], k, v))
    with pytest.raises(RuntimeError, match="head_dim 12 is not one the kernel supports"):
        attention(q[..., :12], k[..., :12], v[..., :12], "triton")
    with pytest.raises(RuntimeError, match="bfloat16"):  # the interpreter's bf16 tl.dot is wrong: refuse it
        attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), "triton")
    with pytest.raises(ValueError, match="unknown attention backend"):
        attention(q, k, v, "flash")


# ----------------------------------------------------------------------------- can it run here?


def test_triton_problem_on_this_cpu():
    """This process has the interpreter: fp32 and fp16 run, bf16 and odd head dims are refused, each with
    one line that says what to do. `auto` never picks the interpreter."""
    cpu = torch.device("cpu")
    assert kernels.triton_problem(cpu, torch.float32, 64) is None
    assert kernels.triton_problem(cpu, torch.float16, 16) is None
    assert "use --precision fp32, or --attn sdpa" in kernels.triton_problem(cpu, torch.bfloat16, 64)
    assert "(16, 32, 64, 128)" in kernels.triton_problem(cpu, torch.float32, 80)
    assert kernels.resolve_backend(cpu, torch.float32, 64) == "sdpa"


def test_triton_problem_on_a_cpu_without_the_interpreter():
    code = ("import torch, kernels\n"
            "print(kernels.triton_problem(torch.device('cpu'), torch.float32, 64))\n"
            "print(kernels.resolve_backend(torch.device('cpu'), torch.float32, 64))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "runs on a CPU only in the Triton interpreter: start Python with TRITON_INTERPRET=1; use --attn sdpa",
        "sdpa"]


@pytest.fixture
def on_a_gpu(monkeypatch):
    """Answers as on a machine with a real GPU: no interpreter, and the device reports `gpu(name, capability)`."""
    monkeypatch.setattr(kernels, "INTERPRETED", False)

    def gpu(name, capability):
        props = SimpleNamespace(name=name, major=capability[0], minor=capability[1])
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    return gpu


def test_triton_problem_on_gpus(on_a_gpu):
    cuda = torch.device("cuda")
    on_a_gpu("Tesla T4", (7, 5))
    assert kernels.triton_problem(cuda, torch.float16, 64) == \
        "Tesla T4 (sm_75) is older than the kernel's sm_80 minimum; use --attn sdpa"
    on_a_gpu("NVIDIA H100 80GB HBM3", (9, 0))
    assert kernels.triton_problem(cuda, torch.bfloat16, 64) is None
    assert kernels.triton_problem(cuda, torch.float32, 64) == \
        "the kernel computes in fp16 or bf16, not float32; use --precision bf16 or fp16, or --attn sdpa"
    assert "(16, 32, 64, 128)" in kernels.triton_problem(cuda, torch.bfloat16, 96)
    assert kernels.resolve_backend(cuda, torch.float32, 64) == "sdpa"
    assert kernels.resolve_backend(cuda, torch.bfloat16, 96) == "sdpa"


def test_auto_takes_our_kernel_only_where_a_gpu_measured_it_faster(on_a_gpu, monkeypatch):
    """`auto` by (capability, head dim, dtype), from support/launches.py's MEASURED: today's table (an
    H200, sm_90, measured ours slower than SDPA forward + backward at head dims 64 and 128 in bf16) gives
    SDPA there, and SDPA where nothing was measured (an A100; fp16 on the H100); a row that measured ours
    faster gives ours, on that capability only; where the kernel cannot run, SDPA whatever the table."""
    from support import launches

    cuda, bf16, fp16 = torch.device("cuda"), torch.bfloat16, torch.float16
    assert launches.MEASURED[(9, 0), 64, bf16].high < 1 and launches.MEASURED[(9, 0), 128, bf16].high < 1
    on_a_gpu("NVIDIA H100 80GB HBM3", (9, 0))
    assert [kernels.resolve_backend(cuda, dt, d) for dt, d in ((bf16, 64), (bf16, 128), (fp16, 64))] == ["sdpa"] * 3
    faster = {**launches.MEASURED, ((9, 0), 64, fp16): launches.Measured(1.05, 1.2, "a test")}
    monkeypatch.setattr(launches, "MEASURED", faster)
    assert kernels.resolve_backend(cuda, fp16, 64) == "triton" and kernels.resolve_backend(cuda, bf16, 64) == "sdpa"
    assert kernels.resolve_backend(cuda, fp16, 96) == "sdpa"  # a head dim the kernel does not take
    on_a_gpu("NVIDIA A100-SXM4-80GB", (8, 0))
    assert kernels.resolve_backend(cuda, fp16, 64) == "sdpa"  # measured on sm_90, not here
    on_a_gpu("Tesla T4", (7, 5))
    monkeypatch.setattr(launches, "MEASURED", {**faster, ((7, 5), 64, fp16): launches.Measured(2, 3, "")})
    assert kernels.resolve_backend(cuda, fp16, 64) == "sdpa"  # older than the kernel's minimum


def test_the_start_up_line_says_what_auto_chose_and_why(on_a_gpu):
    """train.py's start-up line names the backend and, where `auto` chose it on a GPU, why: the
    measurement behind it (its GPU and date), that there is none, or why the kernel cannot run. Asked for
    explicitly, or on a CPU, the backend alone (as every lesson's CPU runs show it)."""
    import config

    def line(precision, head_dim, asked="auto", device="cuda"):
        cfg = config.TrainConfig(precision=precision)
        cfg.attn = config.resolve_attention(config.TrainConfig(attn=asked, precision=precision),
                                            torch.device(device), head_dim)
        return config.describe_attention(cfg, asked, torch.device(device), head_dim)

    assert line("fp32", 64, device="cpu") == "sdpa"
    on_a_gpu("NVIDIA H200", (9, 0))
    assert line("bf16", 64) == ("sdpa (auto: ours 0.70-0.76x SDPA forward+backward on sm_90, head dim 64, "
                                "bfloat16 (H200, 2026-11-26, Triton 3.6))")
    assert line("bf16", 128).startswith("sdpa (auto: ours 0.35-0.43x SDPA forward+backward on sm_90, head dim 128")
    assert line("fp16", 64) == ("sdpa (auto: ours never measured on sm_90, head dim 64, float16; "
                                "tests/bench_attention.py there would say)")
    assert line("fp32", 64) == "sdpa (auto: the kernel computes in fp16 or bf16, not float32)"
    assert line("bf16", 64, asked="triton") == "triton" and line("bf16", 64, asked="sdpa") == "sdpa"


def test_triton_problem_without_triton(monkeypatch):
    monkeypatch.setattr(kernels, "triton", None)
    assert "pip install triton" in kernels.triton_problem(torch.device("cpu"), torch.float32, 64)


# ----------------------------------------------------------------------------- the custom op and torch.compile


class Ops(TorchDispatchMode):
    """Records the name of every op that reaches the dispatcher (a custom op counts as one)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_custom_ops_pass_opcheck():
    """torch.library.opcheck runs each op for real and on fake tensors (same shapes, dtypes and strides?),
    through autograd (registered?), and traced by AOTAutograd with dynamic shapes, forward and backward.
    v's last dimension is not contiguous: the op copies it, and must still agree with its fake."""
    _, (q, k, _) = qkv_view(1, 33, 2, 16, torch.float32)
    v = torch.randn(1, 2, 16, 33).transpose(2, 3).requires_grad_()  # stride(-1) == 33
    torch.library.opcheck(kernels.flash_attn_fwd, (q, k, v))
    o, lse = kernels.flash_attn_fwd(q, k, v)
    do = torch.randn(1, 33, 2, 16).transpose(1, 2)  # (B, H, T, D) view
    torch.library.opcheck(kernels.flash_attn_bwd, [x.detach() for x in (q, k, v, o, lse, do)])


def test_packed_qkv_ops_write_the_gradient_in_place_and_match_the_unpacked_ones():
    """attention_packed(qkv) (the model's call) equals attention(q, k, v) of the three views, output and
    gradient, and its backward stacks and concatenates nothing: dq, dk, dv land in one (B, T, 3, H, D)
    tensor, the projection's own layout. Its two ops pass opcheck too."""
    qkv, (q, k, v) = qkv_view(2, 40, 2, 16, torch.float32)
    do = torch.randn(2, 2, 40, 16)
    attention(q, k, v, "triton").backward(do)
    unpacked = qkv.grad.clone()
    qkv.grad = None
    o = kernels.attention_packed(qkv, "triton")
    with Ops() as ops:
        o.backward(do)
    torch.testing.assert_close(o, attention(q, k, v, "triton"), rtol=0, atol=0)
    torch.testing.assert_close(qkv.grad, unpacked, rtol=0, atol=0)
    assert not {"stack.default", "cat.default", "clone.default", "copy_.default"} & set(ops.names), ops.names
    torch.library.opcheck(kernels.flash_attn_qkv_fwd, (qkv,))
    o, lse = kernels.flash_attn_qkv_fwd(qkv)
    torch.library.opcheck(kernels.flash_attn_qkv_bwd, [x.detach() for x in (qkv, o, lse, do)])


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")  # inside Inductor, not ours
def test_torch_compile_matches_eager():
    """A GPT-2 block with attn="triton", compiled whole (fullgraph=True: a graph break is an error, so the
    op is one node the compiler accepts), gives eager's output and gradients. `auto` traces too."""
    from model import Block, GPTConfig

    torch.manual_seed(0)
    block = Block(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=64, attn="triton"))
    x = torch.randn(2, 40, 32, requires_grad=True)

    def output_and_grads(fn):
        y = fn(x)
        return (y, *torch.autograd.grad(y.square().sum(), [x, *block.parameters()]))

    compiled = output_and_grads(torch.compile(block, fullgraph=True))
    eager = output_and_grads(block)
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    _, (q, k, v) = qkv_view(1, 9, 2, 16, torch.float32)
    auto = torch.compile(lambda q, k, v: attention(q, k, v, "auto"), backend="eager", fullgraph=True)
    assert torch.equal(auto(q, k, v), kernels.attention_sdpa(q, k, v))


def test_sdpa_traces_whole_when_the_sequence_length_is_symbolic():
    """A compiled block that meets a second sequence length is compiled again with the length symbolic
    (Dynamo's automatic dynamic shapes; the torch.compile lesson): SDPA's `is_causal` must then still be a
    bool. `Tq == Tk` of two symbolic sizes is a SymBool, which SDPA refused at trace time: the block fell
    into 5 graphs around the attention, at every length after the first."""
    from model import Block, GPTConfig

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    torch._dynamo.reset()
    block = Block(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=64, attn="sdpa"))
    block.compile(backend=backend, fullgraph=True)  # fullgraph: a graph break is an error
    for T in (16, 32, 48):
        x = torch.randn(2, T, 32)
        with torch.compiler.set_stance("force_eager"):
            eager = block(x)
        torch.testing.assert_close(block(x), eager)
    assert len(graphs) == 2  # one graph at T = 16, one symbolic in T for every other length


def test_model_trained_with_triton_matches_math():
    """A few AdamW steps of the tiny GPT: the per-step losses agree with the math backend's."""
    from model import build, config_from_preset

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 257, (2, 33), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]  # T = 32

    def losses(attn):
        model = build(config_from_preset("tiny", 257, attn=attn), seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        out = []
        for _ in range(3):
            _, loss = model(x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.item())
        return out

    triton_losses, math_losses = losses("triton"), losses("math")
    assert math_losses[-1] < math_losses[0]  # it trains, so the comparison means something
    for got, want in zip(triton_losses, math_losses, strict=True):
        assert abs(got - want) <= 1e-4 * abs(want), (triton_losses, math_losses)


def test_benchmark_explains_that_it_needs_a_gpu():
    """tests/bench_attention.py is for GPU machines; without one it must say so and stop cleanly."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # as if there were no GPU, even where there is one
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "bench_attention.py")],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 1 and "needs a CUDA GPU" in result.stdout, result.stderr


def test_the_tuner_times_candidates_and_picks_the_fastest():
    """tests/tune_attention.py's timing half, in the interpreter on tiny shapes: every candidate gets a
    score and the winner is the one with the least time (the GPU only changes what the times are)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import tune_attention

    shipped = kernels.INTERPRETER_LAUNCH
    for kind, cands in (("fwd", [(32, 16, 4, 1), (16, 16, 4, 1)]), ("bwd", [(16, 32, 4, 1), (16, 16, 4, 1)])):
        best, scores = tune_attention.tune(kind, cands, shipped, [(1, 1, 40, 16)], torch.float32,
                                           torch.device("cpu"), reps=1)
        assert set(scores) == set(cands) and all(s > 0 for s in scores.values())
        assert best == min(scores, key=scores.get)


# ----------------------------------------------------------------------------- grouped-query attention
#
# q has H = 8 heads, k and v H_kv of them: 1 (multi-query), 2 and 4 (grouped), 8 (multi-head). The reference
# repeats each kv head for its group of query heads in float64 (what the kernel must never do), and
# autograd sums the group's gradients back into it.

GQA_HEADS = (1, 2, 4, 8)


def gqa_inputs(B, T, H, H_kv, D, dtype, seed=0):
    """The packed projection (B, T, H + 2 H_kv, D), its q, k, v views, and a dO."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, T, H + 2 * H_kv, D, generator=gen).to(dtype).requires_grad_()
    do = torch.randn(B, H, T, D, generator=gen).to(dtype)
    return qkv, kernels.unpack_qkv(qkv, H_kv), do


def reference_repeated(q, k, v, do, causal=True):
    """Output and gradients in float64, K and V repeated per query head (plain multi-head attention)."""
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    group = q.size(1) // k.size(1)
    k_rep, v_rep = k64.repeat_interleave(group, dim=1), v64.repeat_interleave(group, dim=1)  # (B, H, T, D)
    scores = q64 @ k_rep.transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, H, TQ, TK)
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    o = torch.softmax(scores, -1) @ v_rep  # float64 throughout (attention_math's softmax is fp32)
    o.backward(do.double())
    return o.detach(), q64.grad, k64.grad, v64.grad


GQA_CASES = [(H_kv, T, 16, dtype) for H_kv in GQA_HEADS for T, dtype in ((37, torch.float32), (45, torch.float16))]
GQA_CASES += [(H_kv, 99, 32, torch.float32) for H_kv in (1, 2)]  # several blocks each way, another head dim


@pytest.mark.parametrize("H_kv,T,D,dtype", GQA_CASES,
                         ids=[f"Hkv{h}-T{T}-D{D}-{str(dt)[6:]}" for h, T, D, dt in GQA_CASES])
def test_gqa_forward_and_gradients_match_repeated_kv_in_float64(H_kv, T, D, dtype):
    """The kernel with 8 query heads and H_kv kv heads, causal, T odd (the last blocks stick out): o and
    dq per query head, dk and dv per kv head (its group's sum), against the repeated-K/V reference."""
    _, (q, k, v), do = gqa_inputs(2, T, 8, H_kv, D, dtype, seed=T + H_kv)
    assert k.shape == (2, H_kv, T, D)
    assert_close(run_triton(q, k, v, do), reference_repeated(q, k, v, do), dtype)


@pytest.mark.parametrize("H_kv", (1, 2))
def test_gqa_unmasked_mode_with_another_key_count_matches_float64(H_kv):
    """Ring attention's off-diagonal blocks under GQA: causal=False, TQ != TK, both kernels' group indexing."""
    gen = torch.Generator().manual_seed(H_kv)
    B, H, TQ, TK, D = 2, 4, 40, 24, 16
    q, do = torch.randn(B, H, TQ, D, generator=gen), torch.randn(B, H, TQ, D, generator=gen)
    k, v = torch.randn(B, H_kv, TK, D, generator=gen), torch.randn(B, H_kv, TK, D, generator=gen)
    cfg = kernels.INTERPRETER_LAUNCH
    o, lse = flash_forward(q, k, v, cfg, causal=False)
    grads = flash_backward(q, k, v, o, lse, do, cfg, causal=False)
    assert_close((o, *grads), reference_repeated(q, k, v, do, causal=False), torch.float32)


def test_gqa_with_the_shipped_launch_config_in_the_interpreter():
    """The GPU block sizes (a dK/dV program of 64 keys walking its group's two query heads), several blocks."""
    cfg = kernels.SHIPPED[16, torch.float16]
    T = 2 * max(cfg.block_m, cfg.big) - 9
    _, (q, k, v), do = gqa_inputs(1, T, 2, 1, 16, torch.float16, seed=6)
    o, lse = flash_forward(q, k, v, cfg)
    grads = flash_backward(q, k, v, o, lse, do, cfg)
    assert_close((o, *grads), reference_repeated(q, k, v, do), torch.float16)


def test_gqa_backward_is_deterministic():
    """dK, dV sum a group's query heads in one program, in one order: the same bits every time."""
    _, (q, k, v), do = gqa_inputs(1, 50, 8, 2, 16, torch.float32)
    first, second = run_triton(q, k, v, do), run_triton(q, k, v, do)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize("H_kv", (1, 2, 8))
def test_sdpa_and_math_backends_take_gqa(H_kv):
    """The fallbacks in float64, through the packed layout: SDPA with enable_gqa equals the repeated-K/V
    reference to float64 rounding, the math backend (repeat_interleave) to its fp32 softmax's."""
    qkv, (q, k, v), do = gqa_inputs(2, 21, 8, H_kv, 16, torch.float64)
    o_ref, dq, dk, dv = reference_repeated(q, k, v, do)
    dqkv_ref = torch.cat([dq, dk, dv], dim=1).transpose(1, 2)  # (B, T, H + 2 H_kv, D), the packing
    for backend, tol in (("sdpa", 1e-12), ("math", 1e-6)):
        o = kernels.attention_packed(qkv, backend, n_kv_head=H_kv)
        (dqkv,) = torch.autograd.grad(o, qkv, do)
        torch.testing.assert_close(o, o_ref, rtol=tol, atol=tol)
        torch.testing.assert_close(dqkv, dqkv_ref, rtol=tol, atol=tol)
    # decoding with a KV cache (Tq != Tk) under GQA: SDPA's bottom-right alignment with fewer kv heads
    last = kernels.attention(q[:, :, -3:], k, v, "sdpa")
    torch.testing.assert_close(last, o_ref[:, :, -3:], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("H_kv", (1, 2, 8))
def test_gqa_packed_op_writes_the_gradient_in_place_and_matches_the_unpacked_one(H_kv):
    """attention_packed(qkv, "triton", n_kv_head) on the (B, T, H + 2 H_kv, D) packing: output and qkv
    gradient bitwise equal to attention(q, k, v) of its views, and the backward one op that stacks and
    copies nothing. At H_kv = H the packing is GPT-2's (B, T, 3, H, D) memory: the same bits either way."""
    qkv, (q, k, v), do = gqa_inputs(2, 40, 8, H_kv, 16, torch.float32)
    o_unpacked = attention(q, k, v, "triton")
    o_unpacked.backward(do)
    unpacked = qkv.grad.clone()
    qkv.grad = None
    o = kernels.attention_packed(qkv, "triton", n_kv_head=H_kv)
    with Ops() as ops:
        o.backward(do)
    torch.testing.assert_close(o, o_unpacked, rtol=0, atol=0)
    torch.testing.assert_close(qkv.grad, unpacked, rtol=0, atol=0)
    # one op computes the whole gradient; around it only detaches and autograd's zero gradient of lse
    assert ops.names.count("flash_attn_qkv_bwd.default") == 1, ops.names
    assert set(ops.names) <= {"flash_attn_qkv_bwd.default", "detach.default", "zeros.default"}, ops.names
    if H_kv == 8:
        gpt2 = qkv.detach().view(2, 40, 3, 8, 16).requires_grad_()  # the same memory, GPT-2's view
        o_gpt2 = kernels.attention_packed(gpt2, "triton")
        o_gpt2.backward(do)
        assert torch.equal(o_gpt2, o) and torch.equal(gpt2.grad.view_as(qkv), qkv.grad)


def test_gqa_ops_agree_with_their_fake_implementations():
    """torch.library's checks of all four ops with fewer kv heads than query heads: real against fake
    (shapes, dtypes, strides: dk and dv have H_kv heads), autograd, AOTAutograd with dynamic shapes."""
    qkv, (q, k, v), do = gqa_inputs(1, 33, 4, 2, 16, torch.float32)
    torch.library.opcheck(kernels.flash_attn_qkv_fwd, (qkv, 2))
    o, lse = kernels.flash_attn_qkv_fwd(qkv, 2)
    torch.library.opcheck(kernels.flash_attn_qkv_bwd, [x.detach() for x in (qkv, o, lse, do)] + [2])
    torch.library.opcheck(kernels.flash_attn_fwd, (q, k, v))
    torch.library.opcheck(kernels.flash_attn_bwd, [x.detach() for x in (q, k, v, o, lse, do)])


def allocations(fn) -> list[int]:
    """The size in bytes of every tensor torch allocates while fn runs, from the profiler's memory records
    (inside custom ops too, where a TorchDispatchMode cannot see)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sorted(e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0)


@pytest.mark.parametrize("H_kv", (1, 2, 4))
def test_gqa_allocates_nothing_for_repeated_keys_and_values(H_kv):
    """The model's path, attention_packed with our kernel, forward + backward, allocates exactly: o
    (B, H, T, D), three (B, H, T) fp32 rows (lse, delta, and autograd's zero gradient of lse) and the
    packed gradient (B, T, H + 2 H_kv, D): no byte for K or V at H heads. The same measure sees the
    repetition where it is: the kernel fed repeat_interleave'd K and V allocates 4 more (B, H, T, D)
    tensors at least (K and V copied, then their gradients at H heads)."""
    B, T, H, D = 2, 40, 8, 16
    qkv, (q, k, v), do = gqa_inputs(B, T, H, H_kv, D, torch.float32)
    bhtd, bht = B * H * T * D * 4, B * H * T * 4

    def ours():
        kernels.attention_packed(qkv, "triton", n_kv_head=H_kv).backward(do)

    def repeated():  # a stand-in for what the kernel avoids
        group = H // H_kv
        attention(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), "triton").backward(do)

    expected = sorted([bhtd, bht, bht, bht, qkv.numel() * 4])
    got = allocations(ours)
    assert got == expected, f"allocated {got} bytes, expected {expected}"
    extra = sum(allocations(repeated)) - sum(expected)
    assert extra >= 4 * bhtd, (extra, bhtd)


def test_gqa_shapes_are_checked():
    """Head counts that do not divide, and packings that do not add up: one line, before any work."""
    q, k = torch.randn(1, 6, 8, 16), torch.randn(1, 4, 8, 16)
    for backend in ("math", "sdpa", "triton"):
        with pytest.raises(ValueError, match=r"H_kv dividing H, got \(1, 6, 8, 16\), \(1, 4, 8, 16\)"):
            attention(q, k, k, backend)
    with pytest.raises(ValueError, match="H_kv dividing H"):
        kernels.flash_attn_fwd(q, k[:, :3], k[:, :2])  # k and v of different shapes
    with pytest.raises(ValueError, match=r"n_kv_head = H_kv dividing H; got \(1, 8, 10, 16\) and n_kv_head=None"):
        kernels.attention_packed(torch.randn(1, 8, 10, 16), "sdpa")
    with pytest.raises(ValueError, match="n_kv_head=3"):
        kernels.unpack_qkv(torch.randn(1, 8, 10, 16), 3)  # 4 query heads over 3 kv heads
    with pytest.raises(ValueError, match="n_kv_head=2"):
        kernels.unpack_qkv(torch.randn(1, 8, 3, 4, 16), 2)  # GPT-2's packing is H_kv = H
    q, k, v = kernels.unpack_qkv(torch.randn(1, 8, 12, 16), 2)  # 8 query heads, 2 kv heads
    assert (q.shape, k.shape, v.shape) == ((1, 8, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16))
