"""The CUDA path, proven on a CUDA GPU. On a machine without one the whole module is skipped; every idea
here also has a CPU test (tests/test_kernels.py runs the same kernel in the Triton interpreter).

Where the code runs. conftest.py sets TRITON_INTERPRET=1 for the whole pytest session, before kernels.py
is imported, so in *this* process our kernel is interpreted (numpy, on the CPU). Everything that must run
the kernel compiled for the GPU therefore runs in a fresh `python` without the interpreter: `run_python`
starts one per snippet, all at once, and fails with the stderr of any that fails. A snippet calls one of
the `check_*` functions, which take their device, so each can be dry-run on a CPU in the interpreter
(fp16 or fp32 there; its bf16 tl.dot is wrong), e.g. `test_gpu.check_kernel('cpu', 'float16', 16, [1])`.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import setup_memory
import torch
from conftest import ROOT, final_weights, saved_share

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")  # a process group of 2


# ----------------------------------------------------------------------------- shared helpers


def clean_env() -> dict:
    """The environment of a process that runs the kernel compiled: TRITON_INTERPRET=0, not merely absent, so
    that importing conftest (which sets it when absent) cannot switch the interpreter back on."""
    return {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}


def run_python(*snippets: str, timeout: float = 300) -> list[str]:
    """Run each snippet as `python -c`, all at the same time (Triton compiles in each), and return their stdouts."""
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=clean_env(), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for code in snippets]
    try:
        outs = [proc.communicate(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:  # does nothing to those that finished; a timeout must not leave the rest running
            proc.kill()
    for code, proc, (out, err) in zip(snippets, procs, outs, strict=True):
        assert proc.returncode == 0, \
            f"python -c {code!r} failed (exit {proc.returncode}):\n{out[-2000:]}\n{err[-6000:]}"
    return [out for out, _ in outs]


def compiled_kernels(device: str):
    """kernels.py, checked to be the compiled kernel where the device is a GPU."""
    import kernels

    assert torch.device(device).type == "cpu" or not kernels.INTERPRETED, "TRITON_INTERPRET is set"
    return kernels


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------- the attention kernel

KERNEL_LENGTHS = (1, 17, 100, 257, 1000, 4096)  # one row; ragged last blocks; a multiple of every block
KERNEL_CASES = [(dtype, D) for dtype in ("float16", "bfloat16") for D in (16, 32, 64, 128)]


def attention_and_grads(fn, qkv: torch.Tensor, do: torch.Tensor) -> list[torch.Tensor]:
    """o, dq, dk, dv of fn on q, k, v made as the model makes them: strided views of one fused
    (B, T, 3, H, D) projection, whose gradient arrives in that same fused tensor."""
    qkv = qkv.detach().requires_grad_()
    o = fn(*qkv.permute(2, 0, 3, 1, 4))  # (B, H, T, D)
    (dqkv,) = torch.autograd.grad(o, qkv, do)
    return [o, *dqkv.permute(2, 0, 3, 1, 4)]


def check_kernel(device: str, dtype: str, head_dim: int, lengths=KERNEL_LENGTHS, batch: int = 2,
                 heads: int = 2, factor: float = 3.0) -> None:
    """Our kernel's o, dq, dk, dv against a float64 reference, next to SDPA's on the same rounded inputs:
    our max error must be at most `factor` times SDPA's, plus an eighth of the dtype's precision at 1 (a
    floor for T = 1, where both are exact or nearly so; far below what any indexing or masking bug does).
    The backward, run twice, must agree bitwise."""
    kernels = compiled_kernels(device)
    dt = getattr(torch, dtype)
    floor = torch.finfo(dt).eps / 8
    for T in lengths:
        gen = torch.Generator(device).manual_seed(T * 1000 + head_dim)
        qkv = torch.randn(batch, T, 3, heads, head_dim, device=device, generator=gen).to(dt)
        do = torch.randn(batch, heads, T, head_dim, device=device, generator=gen).to(dt)
        want = attention_and_grads(kernels.attention_math, qkv.double(), do.double())
        ours = attention_and_grads(kernels.attention_triton, qkv, do)
        sdpa = attention_and_grads(kernels.attention_sdpa, qkv, do)
        again = attention_and_grads(kernels.attention_triton, qkv, do)
        for name, g, s, a, w in zip(("o", "dq", "dk", "dv"), ours, sdpa, again, want, strict=True):
            where = f"{dtype} D={head_dim} T={T} {name}"
            assert torch.equal(g, a), f"{where}: two runs differ"
            err, err_sdpa = (g.double() - w).abs().max().item(), (s.double() - w).abs().max().item()
            print(f"{where:<24} max error ours {err:.2e}  sdpa {err_sdpa:.2e}")
            assert err <= factor * err_sdpa + floor, f"{where}: max error {err:.2e}, SDPA's {err_sdpa:.2e}"


def test_kernel_matches_float64_like_sdpa_and_is_deterministic():
    """fp16 and bf16, head dims 16 to 128, lengths 1 to 4096, one process per (dtype, head dim)."""
    outs = run_python(*(f"import test_gpu; test_gpu.check_kernel('cuda', {dtype!r}, {D})" for dtype, D in KERNEL_CASES))
    print("".join(outs))  # the table of errors, ours next to SDPA's: pytest -s shows it


def check_ring_blocks(device: str, dtype: str, head_dim: int, T: int = 1024, cp: int = 4, factor: float = 8.0) -> None:
    """Ring attention's arithmetic (context.py) on one GPU: the cp ranks' blocks computed one after another
    by our kernel (causal on the diagonal, the unmasked mode with Tq != Tk off it), merged by their
    log-sum-exps, and the backward of every block from the merged output, put together: o, dq, dk, dv
    against float64, next to SDPA over the whole sequence. Each block's result is rounded to the 16-bit
    dtype before the fp32 merge, so errors may add over the cp blocks: `factor` is 8, not 3; an indexing or
    masking bug is orders of magnitude larger. (No communication here: one GPU cannot hold an NCCL ring.)"""
    import context

    kernels = compiled_kernels(device)
    dt = getattr(torch, dtype)
    gen = torch.Generator(device).manual_seed(head_dim)
    qkv = torch.randn(2, T, 3, 2, head_dim, device=device, generator=gen).to(dt)
    do = torch.randn(2, 2, T, head_dim, device=device, generator=gen).to(dt)
    want = attention_and_grads(kernels.attention_math, qkv.double(), do.double())
    sdpa = attention_and_grads(kernels.attention_sdpa, qkv, do)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)  # (B, H, T, D)
    pos, c = [context.positions(T, cp, r, device) for r in range(cp)], T // (2 * cp)
    o, lse = torch.empty_like(q), torch.empty(q.shape[:-1], device=device)
    for i in range(cp):  # forward: rank i's queries against every rank's block
        shape = q[:, :, pos[i]].shape
        out, l_i = torch.zeros(shape, device=device), torch.full(shape[:-1], -torch.inf, device=device)
        for j in range(cp):
            rows, keys, causal = context.step_blocks(i, j, c)
            o_b, l_b = context.block_attention(q[:, :, pos[i][rows]], k[:, :, pos[j][keys]], v[:, :, pos[j][keys]],
                                               causal, kernel=True)
            context.merge(out[:, :, rows], l_i[:, :, rows], o_b, l_b)
        o[:, :, pos[i]], lse[:, :, pos[i]] = out.to(dt), l_i
    grads = [torch.zeros(q.shape, device=device) for _ in range(3)]
    for i in range(cp):  # backward: every block's share, from the merged output and log-sum-exp
        for j in range(cp):
            rows, keys, causal = context.step_blocks(i, j, c)
            mine, theirs = pos[i][rows], pos[j][keys]
            dq, dk, dv = context.block_attention_backward(q[:, :, mine], k[:, :, theirs], v[:, :, theirs],
                                                          o[:, :, mine], lse[:, :, mine], do[:, :, mine], causal,
                                                          kernel=True)
            grads[0][:, :, mine] += dq
            grads[1][:, :, theirs] += dk
            grads[2][:, :, theirs] += dv
    floor = torch.finfo(dt).eps / 8
    for name, g, s, w in zip(("o", "dq", "dk", "dv"), [o, *grads], sdpa, want, strict=True):
        err, err_sdpa = (g.double() - w).abs().max().item(), (s.double() - w).abs().max().item()
        print(f"ring {dtype} D={head_dim} T={T} cp={cp} {name:<3} max error ours {err:.2e}  sdpa {err_sdpa:.2e}")
        assert err <= factor * err_sdpa + floor, f"ring {name}: max error {err:.2e}, SDPA's {err_sdpa:.2e}"


def test_ring_attention_blocks_on_the_kernel_match_float64():
    """Context parallelism's ring on our kernel, bf16 and fp16, head dims 64 and 128."""
    outs = run_python(*(f"import test_gpu; test_gpu.check_ring_blocks('cuda', {dtype!r}, {D})"
                        for dtype in ("bfloat16", "float16") for D in (64, 128)))
    print("".join(outs))


def check_compiled_model(device: str, dtype: str = "bfloat16", tol: float = 3e-2, llama: bool = False) -> None:
    """A small GPT-2 with attn="triton" (head dim 64), compiled as train.py does (every block, the fused
    loss) with fullgraph=True (a graph break is an error), one forward and backward under autocast: the
    same loss and gradients as eager, within `tol` (relative norm); and the attention function alone
    compiles as one graph too. llama: the Llama family's block instead (RoPE, SwiGLU, RMSNorm, and 4 query
    heads over 2 kv heads through the kernel's grouped-query path)."""
    from functools import partial

    import parallel
    import train
    from model import GPTConfig, build

    kernels = compiled_kernels(device)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=128, block_size=128, vocab_size=257, attn="triton")
    if llama:
        cfg = GPTConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=256, block_size=128, vocab_size=257,
                        attn="triton")
    idx = torch.randint(0, 257, (2, 101), device=device, generator=torch.Generator(device).manual_seed(0))
    x, y = idx[:, :-1], idx[:, 1:]  # T = 100: a ragged last block
    autocast = torch.autocast(torch.device(device).type, getattr(torch, dtype), enabled=dtype != "float32")

    def loss_and_grads(compile_blocks: bool):
        model = build(cfg, seed=0, device=device)  # the same weights each time: init by (seed, name)
        if compile_blocks:
            train.compile_model(model, parallel.Grid(device=torch.device(device)), fullgraph=True)
        with autocast:
            _, loss = model(x, y)
        loss.backward()
        return loss, {name: p.grad for name, p in model.named_parameters()}

    (loss, grads), (eager_loss, eager_grads) = loss_and_grads(True), loss_and_grads(False)
    assert abs(loss.item() - eager_loss.item()) <= tol * abs(eager_loss.item()), (loss.item(), eager_loss.item())
    for name, g in eager_grads.items():
        assert rel_error(grads[name], g) <= tol, f"{name}: relative error {rel_error(grads[name], g):.1e}"
    qkv = torch.randn(2, 100, 3, 2, 64, device=device).to(getattr(torch, dtype))
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    attn = torch.compile(partial(kernels.attention, backend="triton"), fullgraph=True)
    assert torch.equal(attn(q, k, v), kernels.attention_triton(q, k, v))


def test_compiled_model_with_triton_attention_matches_eager():
    run_python("import test_gpu; test_gpu.check_compiled_model('cuda')")


def test_compiled_llama_with_grouped_query_triton_attention_matches_eager():
    run_python("import test_gpu; test_gpu.check_compiled_model('cuda', llama=True)")


def check_backend_choice(device: str) -> None:
    """What train.py asks before training: on an A100 or newer, `auto` is ours where support/launches.py has it
    faster than SDPA here, else SDPA (fp32: --attn triton refused in one line); compiled code traces `auto` too."""
    kernels, device = compiled_kernels(device), torch.device(device)
    props = torch.cuda.get_device_properties(device)
    print(f"{props.name} (sm_{props.major}{props.minor})")
    if (capability := (props.major, props.minor)) < (8, 0):
        assert "older than the kernel's sm_80 minimum" in kernels.triton_problem(device, torch.bfloat16, 64)
        return
    for dtype in (torch.bfloat16, torch.float16):
        assert kernels.triton_problem(device, dtype, 64) is None
        assert kernels.resolve_backend(device, dtype, 64) == ["sdpa", "triton"][kernels.faster(capability, 64, dtype)]
    assert "--precision bf16 or fp16" in kernels.triton_problem(device, torch.float32, 64)
    assert kernels.resolve_backend(device, torch.float32, 64) == "sdpa"
    q, k, v = torch.randn(3, 1, 2, 64, 64, device=device, dtype=torch.bfloat16)
    auto = torch.compile(lambda q, k, v: kernels.attention(q, k, v, "auto"), backend="eager", fullgraph=True)
    chosen = kernels.IMPLEMENTATIONS[kernels.resolve_backend(device, torch.bfloat16, 64)]
    assert torch.equal(auto(q, k, v), chosen(q, k, v))


def test_backend_choice_on_this_gpu():
    print(run_python("import test_gpu; test_gpu.check_backend_choice('cuda')")[0])


# ----------------------------------------------------------------------------- training on the GPU
# train.py as a user runs it on a GPU machine: its CUDA defaults (gpt2 preset, bf16, `auto`'s attention, compiled
# blocks, fused AdamW), a corpus of GPT-2 tokens (conftest.gpu_corpus), the real tokenizer (fetched by the
# README's set-up command; nothing here reaches the network).


def train_on_gpu(corpus: dict, out: Path, *flags: str, check: bool = True,
                 nproc: int = 1) -> subprocess.CompletedProcess:
    """python train.py (or torchrun) with the CUDA defaults, on `corpus`, in a process without the interpreter."""
    launcher = [sys.executable] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd = launcher + ["train.py", "--data", corpus["data"], "--cache-dir", corpus["cache"], "--out", str(out), *flags]
    result = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=900)
    if check:
        assert result.returncode == 0, f"{' '.join(cmd)}: exit {result.returncode}\n" \
                                       f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "event" not in r}


def test_the_default_run_trains_on_this_gpu(gpu_corpus, tmp_path):
    """`python train.py` with every CUDA default (only the length cut): the loss falls, the start-up line says why."""
    result = train_on_gpu(gpu_corpus, tmp_path / "run", "--max-steps", "30", "--eval-every", "15")
    run = losses(tmp_path / "run")
    assert run[30] < run[1] - 1.0, f"the loss did not fall: step 1 {run[1]:.3f}, step 30 {run[30]:.3f}"
    assert "bf16, attention " in result.stdout and "(auto: " in result.stdout, result.stdout[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    peaks = [r["peak_mem_gb"] for r in rows if "peak_mem_gb" in r]
    assert len(peaks) == 30 and 0 < max(peaks) < torch.cuda.get_device_properties(0).total_memory / 1e9


# The reproduction: gpt2 with micro-batches, checkpoints every 8 steps, SIGKILL after step 13, resume.
RESUME = ["--preset", "gpt2", "--seq-len", "256", "--batch-size", "32", "--micro-batch-size", "16",
          "--max-steps", "24", "--ckpt-every", "8", "--eval-every", "12", "--sample-tokens", "16", "--attn", "triton"]
# --attn triton, and fp32 --attn math: SDPA's fused backward (what `auto` picks where it measured faster, and
# in fp32) accumulates with atomics, not bitwise reproducible even without a crash; our kernel and math are.
# The CUDA defaults (bf16, compiled blocks, fused AdamW); the fp16 loss scaler; ZeRO-1's fp32 master weights.
VARIANTS = {"bf16": ["--precision", "bf16"],
            "fp16": ["--precision", "fp16", "--no-compile"],
            "fp32": ["--precision", "fp32", "--attn", "math", "--no-compile"],
            "bf16-zero1": ["--precision", "bf16", "--zero", "1", "--no-compile"],
            "bf16-zero3-compiled": ["--precision", "bf16", "--zero", "3"]}


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_killed_run_resumes_bitwise_on_cuda(variant, gpu_corpus, tmp_path):
    """Killed with SIGKILL after step 13, resumed from the step-8 checkpoint (saved asynchronously): the
    same losses at every step and the same final weights, bit for bit, as a run that was never killed
    (saving synchronously). Sampling with the KV cache runs at every evaluation."""
    flags = [*RESUME, *VARIANTS[variant]]
    train_on_gpu(gpu_corpus, tmp_path / "straight", *flags)
    killed = train_on_gpu(gpu_corpus, tmp_path / "killed", *flags, "--async-ckpt", "--crash-at", "step:13", check=False)
    assert killed.returncode != 0, "--crash-at step:13 did not kill the run"
    resumed = train_on_gpu(gpu_corpus, tmp_path / "killed", *flags, "--async-ckpt")
    assert "resuming from" in resumed.stdout + resumed.stderr
    assert losses(tmp_path / "killed") == losses(tmp_path / "straight")
    want, got = final_weights(tmp_path / "straight"), final_weights(tmp_path / "killed")
    for name, w in want.items():
        assert torch.equal(got[name], w), f"{variant}: {name} differs after the resume"


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("preset", ["gpt2", "smollm2-135m"])
def test_memory_report_on_cuda(preset, recompute, gpu_corpus, tmp_path):
    """GPT-2 and a Llama (GQA, SwiGLU, RMSNorm by torch's fused kernel) under ZeRO-3 on one GPU: weights, gradients,
    optimizer state equal the formulas; activations saved (bf16) within 10% of ours; the allocator's view too."""
    result = train_on_gpu(gpu_corpus, tmp_path / "run", "--preset", preset, "--seq-len", "256", "--batch-size", "8",
                          "--max-steps", "2", "--zero", "3", "--recompute", recompute, "--memory-report",
                          "--no-compile")
    out = result.stdout
    for kind in ("weights", "gradients", "optimizer"):
        row = next(ln for ln in out.splitlines() if ln.strip().startswith(kind + " "))
        assert row.rstrip().endswith("yes"), row
    assert 0.9 < saved_share(out) < 1.1, out
    assert "allocator:" in out


def test_more_processes_than_gpus_is_one_line(gpu_corpus, tmp_path):
    """torchrun with one process more than this node has GPUs: refused at start-up, before any data is
    read, one line said once that says how many to launch, instead of `CUDA error: invalid device ordinal`.
    Like every layout error under torchrun (cli.stop_every_rank, tests/test_parallel.py), rank 0 then exits
    2 and the others 0, so torchrun exits non-zero with that line as the cause in its summary."""
    n = torch.cuda.device_count() + 1
    result = train_on_gpu(gpu_corpus, tmp_path / "run", "--preset", "tiny", "--max-steps", "1", nproc=n, check=False)
    said = result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"{n} processes on this node but {n - 1} visible GPU" in errors[0], said[-3000:]
    assert errors[0].endswith(f"(all {n} processes stopped)") and result.returncode != 0, said[-3000:]
    assert "invalid device ordinal" not in said and 'train.py", line' not in said and "data:" not in result.stdout


# ----------------------------------------------------------------------------- host waits, memory held


def check_syncs(device: str, data: str, cache: str, out: str) -> None:
    """A training step synchronizes the host with the GPU once (its one read, after the update is queued),
    and an asynchronous checkpoint not at all: counted by CUDA's own sync debug mode (every synchronizing
    call warns)."""
    import warnings

    import checkpoint
    import config
    import train
    from support import writer

    flags = ["--device", device, "--preset", "tiny", "--tokenizer", "byte", "--seq-len", "64", "--batch-size", "8",
             "--stats-every", "0", "--no-compile", "--spike-z", "4", "--spike-window", "2"]
    run = train.setup(config.parse_args([*flags, "--data", data, "--cache-dir", cache, "--out", out]))
    saver = writer.Saver(Path(out) / "ckpt", keep=2, asynchronous=True, grid=run.grid, run=run.run_id)
    for _ in range(3):  # warm-up: the optimizer's state is created; the spike guard is armed
        train.train_step(run)
        run.step += 1
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        train.train_step(run)
        step = len(seen)
        saver.save(run.step, checkpoint.tensor_entries(run.model, run.opt, run.grid),
                   checkpoint.optimizer_steps(run.opt), extra={"step": run.step}, meta={})
        torch.cuda.set_sync_debug_mode("default")
    saver.wait()
    syncs = [str(w.message)[:120] for w in seen]
    assert step == 1, f"a step synchronized {step} times: {syncs[:step]}"
    assert len(seen) == step, f"an asynchronous save synchronized {len(seen) - step} times: {syncs[step:]}"


def test_a_step_and_an_async_save_wait_for_the_gpu_once(gpu_corpus, tmp_path):
    run_python(f"import test_gpu; test_gpu.check_syncs('cuda', {gpu_corpus['data']!r}, {gpu_corpus['cache']!r}, "
               f"{str(tmp_path / 'run')!r})")


def test_fp16_zero3_holds_no_fp16_copy_of_the_weights_on_cuda(gpu_corpus, tmp_path):
    """GPT-2 under ZeRO-3 in fp16 on one GPU: the weights are gathered in fp16 (2Ψ/N), so autocast makes no
    copies, and what the allocator holds after the blocks' forward is the saved activations plus the
    embeddings' unit (gathered for the head), within 10%. fp32 weights would add an fp16 copy of every
    block's weights, kept by each layer's backward (12 x 14 MB, ~28% of the activations here)."""
    result = train_on_gpu(gpu_corpus, tmp_path / "run", "--preset", "gpt2", "--seq-len", "256", "--batch-size", "8",
                          "--max-steps", "2", "--zero", "3", "--precision", "fp16", "--memory-report", "--no-compile")
    out = result.stdout
    weights = next(ln for ln in out.splitlines() if ln.strip().startswith("weights "))
    assert weights.split()[3] == "2Ψ/N" and weights.rstrip().endswith("yes"), weights
    acts = next(ln for ln in out.splitlines() if "activations saved per layer" in ln)
    per_layer = int(acts.split("measured ")[1].split(" ")[0].rstrip(",").replace(",", ""))
    allocator = next(ln for ln in out.splitlines() if "allocator:" in ln)
    held = int(allocator.split("allocator: ")[1].split(" ")[0].replace(",", ""))
    root = 2 * (50304 * 768 + 1024 * 768 + 2 * 768)  # wte, wpe and ln_f in fp16
    assert held <= 1.1 * 12 * per_layer + root, (held, per_layer, root)


@needs_2_gpus
def test_zero3_start_up_on_two_gpus_holds_no_whole_model(gpu_corpus, tmp_path):
    """GPT-2 under ZeRO-3 over two GPUs: what each GPU holds at once during train.setup (optimizer state and
    gradient shards apart) is its weight shard, one unit whole and a MiB: never the whole model (on the CPU too)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "tests/setup_memory.py",
           "--preset", "gpt2", "--seq-len", "256", "--batch-size", "8", "--zero", "3", "--no-compile",
           "--data", gpu_corpus["data"], "--cache-dir", gpu_corpus["cache"], "--out", str(tmp_path / "run")]
    result = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = setup_memory.rank_lines(result.stdout)  # (the whole model in fp32: r["model"])
    assert len(ranks) == 2 and all(r["peak"] <= r["shard"] + r["unit"] + 2**20 for r in ranks), ranks


# ----------------------------------------------------------------------------- NCCL, streams and syncs (issue 31)
# What only a GPU shows: a dead peer under NCCL, collectives timed on their own stream, steps that never
# wait for the host, fp16 matmuls. The cases with a process group of 2 need 2 GPUs and skip on one.

def torchrun_python(code: str, tmp_path: Path, nproc: int = 2, timeout: float = 600) -> str:
    """`code` as a script under torchrun on `nproc` GPUs, without the interpreter; its stdout."""
    script = tmp_path / "snippet.py"
    script.write_text(code)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script)]
    result = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result.stdout


@needs_2_gpus
def test_a_dead_peer_on_nccl_is_one_line_and_exit_status_3(corpus, tmp_path):
    """tests/test_parallel.py's dead rank, on NCCL: no launcher to clean up, rank 1 SIGKILLed after step 3.
    NCCL's calls return before the GPU runs them, so rank 0 learns it only at the step's sync point:
    the watchdog ends the stuck collective after --timeout and, told not to end the process
    (TORCH_NCCL_ASYNC_ERROR_HANDLING=2), lets the loop say it in one line and exit with status 3."""
    import socket
    import time

    from support import interrupt

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {**clean_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}
        cmd = [sys.executable, "train.py", "--data", corpus["data"], "--cache-dir", corpus["cache"], "--out",
               str(tmp_path), "--device", "cuda", "--preset", "tiny", "--tokenizer", "byte", "--seq-len", "32",
               "--batch-size", "8", "--max-steps", "200", "--eval-every", "100", "--sample-tokens", "0",
               "--no-compile", "--crash-at", "rank:1:step:3", "--timeout", "20"]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    start = time.monotonic()
    try:
        _, err = procs[0].communicate(timeout=240)
        procs[1].wait(timeout=30)
    finally:
        for proc in procs:
            proc.kill()
    assert procs[1].returncode == -9, procs[1].returncode  # the injected SIGKILL
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert procs[0].returncode == 3, f"exit {procs[0].returncode}\n{err[-4000:]}"  # not the watchdog's SIGABRT
    assert len(lines) == 1 and lines[0].startswith("error: rank 0, "), err[-4000:]
    assert ": a peer process failed or timed out (" in lines[0] and "Traceback" not in err, err[-4000:]
    assert time.monotonic() - start < 20 + interrupt.NCCL_GRACE_S + 60


def check_cp_step_never_waits_for_the_host(cp_attn: str, device: str = "cuda") -> None:
    """Under torchrun on 2 GPUs: after a first step, a cp = 2 forward and backward never makes the host
    wait for the device (torch.cuda.set_sync_debug_mode("error") raises at any such wait): the positions
    a rank holds are made on the device, once. Ring messages travel over NCCL point-to-point."""
    import parallel
    import shard
    from model import GPTConfig

    grid = parallel.init_grid(1, 1, torch.device(device), cp=2, cp_attn=cp_attn)
    model = shard.build_model(GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=256, vocab_size=256,
                                        attn="sdpa"), grid, seed=0, device=grid.device, seq_len=256)
    idx = torch.randint(0, 256, (2, 257), device=grid.device, generator=torch.Generator(grid.device).manual_seed(0))

    def step():
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        return loss

    first = step()
    if grid.device.type == "cuda":  # (a dry run on CPU processes checks the rest)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        second = step()
    finally:
        if grid.device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(first, second)
    parallel.shutdown()


@needs_2_gpus
@pytest.mark.parametrize("cp_attn", ["ring", "ulysses"])
def test_a_cp_step_never_waits_for_the_host(cp_attn, tmp_path):
    torchrun_python(f"import test_gpu; test_gpu.check_cp_step_never_waits_for_the_host({cp_attn!r})", tmp_path)


def check_tp_blocks_compile_whole(sp: bool, device: str = "cuda") -> None:
    """Under torchrun on 2 GPUs: train.compile_model with fullgraph=True (a graph break is an error) at tp 2,
    bf16: the loss and gradients of eager within bf16's rounding, and Grid counts the same collectives."""
    import parallel
    import shard
    import train
    from model import GPTConfig

    grid = parallel.init_grid(2, 1, torch.device(device), sp=sp)
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=256, block_size=256, vocab_size=512, attn="sdpa")
    idx = torch.randint(0, 512, (2, 257), device=grid.device, generator=torch.Generator(grid.device).manual_seed(0))

    def run(compiled: bool):
        model = shard.build_model(cfg, grid, seed=0, device=grid.device, seq_len=256)
        if compiled:
            train.compile_model(model, grid, fullgraph=True)
        for _ in range(2):  # the second: compiled, no tracing left
            grid.traffic.reset()
            model.zero_grad()
            with torch.autocast(grid.device.type, torch.bfloat16):
                _, loss = model(idx[:, :-1], idx[:, 1:])
            loss.backward()
        return loss, {n: p.grad for n, p in model.named_parameters()}, dict(grid.traffic.counts)

    (loss, grads, counts), (want, want_grads, want_counts) = run(True), run(False)
    assert abs(loss.item() - want.item()) <= 3e-2 * abs(want.item())
    for name, g in want_grads.items():
        assert rel_error(grads[name], g) <= 3e-2, name
    assert counts == want_counts, (counts, want_counts)
    parallel.shutdown()


@needs_2_gpus
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp-sp"])
def test_tensor_parallel_blocks_compile_whole_on_cuda(sp, tmp_path):
    torchrun_python(f"import test_gpu; test_gpu.check_tp_blocks_compile_whole({sp})", tmp_path)


def check_collective_timed_on_its_stream(device: str) -> None:
    """A process group of one GPU: an asynchronous all-reduce, then ~100 ms of matmuls on the compute stream,
    then the wait. Its recorded completion is the collective's own (about nothing for one rank), not the
    wait's, which comes after all that compute."""
    import socket

    import torch.distributed as dist

    from instruments import timeline

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    gpu = torch.device(torch.device(device).type, torch.cuda.current_device())  # device_id needs an index
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=gpu)
    recorder = timeline.Recorder(torch.device(device))
    recorder.on = True  # on a GPU only for the steps that report it
    x, a = torch.ones(1 << 20, device=device), torch.randn(4096, 4096, device=device)
    comm = recorder.launch("all_reduce", "dp", (0,), x.numel() * 4)
    work = recorder.track(comm, dist.all_reduce(x, async_op=True))
    for _ in range(50):
        a = torch.tanh(a @ a)
    end_of_compute = recorder.clock.now()
    work.wait()
    collective = recorder.seconds()["all_reduce dp"]  # after the device has passed every point
    compute = recorder.clock.seconds(comm.launch, end_of_compute)
    print(f"all-reduce {1e3 * collective:.2f} ms, compute after it {1e3 * compute:.1f} ms")
    assert compute > 0.02 and collective < 0.2 * compute
    dist.destroy_process_group()


def test_collectives_are_timed_on_the_communication_side():
    print(run_python("import test_gpu; test_gpu.check_collective_timed_on_its_stream('cuda')")[0])


def test_the_fused_fp8_cast_gives_quantizes_bits_on_cuda():  # tests/test_fp8_cast.py: in the interpreter
    print(run_python("import test_fp8_cast; test_fp8_cast.check_fused('cuda')")[0])


def test_fp16_loss_gradient_keeps_its_small_entries_on_cuda():
    import test_model

    assert test_model.fp16_gradient_error("cuda") < 1e-2


def test_ring_attention_off_the_kernel_grows_linearly_on_cuda(monkeypatch):
    """fp32 ring attention (the math blocks) on the GPU: doubling T doubles the memory (test_context.py: on a CPU)."""
    import context
    import parallel
    from instruments import reports

    monkeypatch.setattr(context, "SCORE_CHUNK_BYTES", 2**20)
    cuda = torch.device("cuda")

    def peak(T: int) -> int:
        qkv = torch.randn(1, T, 3, 4, 64, device=cuda).requires_grad_()

        def step():
            out = context.RingAttentionFn.apply(qkv, parallel.Grid(device=cuda), False)
            out.backward(torch.ones_like(out))
        return reports.peak_memory(step, cuda)

    peaks = {T: peak(T) for T in (2048, 4096)}
    assert peaks[4096] <= 2.2 * peaks[2048], peaks


def test_expert_parallel_rows_cross_in_bf16_and_the_gpu_is_read_once():
    import test_moe  # its check_exchange, under CUDA's autocast (where index_copy does not promote)
    test_moe.check_exchange("cuda")

def test_the_checkpoint_writer_thread_computes_on_the_runs_gpu(tmp_path):  # (GPU 1 where there are 2)
    run_python(f"import test_checkpoint; test_checkpoint.check_writer_device({str(tmp_path / 'run')!r})")
