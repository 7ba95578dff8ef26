"""Context parallelism's attention cores against float64 attention, and their memory, on 2 and 4 gloo ranks.

Every rank draws the same whole-sequence q, k, v, keeps its two chunks (context.split_sequence), runs
ring or Ulysses attention on them, and checks its slice of the output and of the input gradient against
causal attention over the whole sequence in float64. The training runs that prove --cp end to end are
in test_parallel.py (equivalence with one process) and test_resilience.py (checkpoints across layouts).
"""

import math
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import ROOT
from torch.utils._python_dispatch import TorchDispatchMode

import context
import parallel
import shard
from instruments import reports
from kernels import unpack_qkv
from model import GPTConfig

B, T, H, D = 2, 64, 4, 16


def ranks(world: int, fn, *args) -> list:
    """fn(grid, *args) on `world` context-parallel ranks; returns what each rank's fn returned."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").Manager().dict()
    # spawn, not fork: a fork of a process whose OpenMP threads are running can deadlock in a matmul
    mp.start_processes(worker, args=(world, port, fn, args, results), nprocs=world, start_method="spawn")
    return [results[r] for r in range(world)]


def worker(rank, world, port, fn, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results[rank] = fn(parallel.Grid(cp=world, rank=rank, groups={"cp": None}), *args)
    finally:
        dist.destroy_process_group()


def whole_attention(qkv: torch.Tensor, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention over the whole sequence in float64, and the gradient of qkv for dout."""
    qkv = qkv.detach().double().requires_grad_()
    q, k, v = unpack_qkv(qkv)
    s = (q @ k.transpose(-2, -1)) / math.sqrt(D)
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    out = torch.softmax(s, dim=-1) @ v  # (B, H, T, D)
    out.backward(dout.double())
    return out.detach(), qkv.grad


CORES = {"ring": context.RingAttention, "ulysses": context.UlyssesAttention}
# (cp_attn, backend of the blocks, dtype): float64 through the math blocks and SDPA, fp32 through the
# Triton kernel in the interpreter (which computes fp32 and fp16, not float64)
CASES = [("ring", "math", torch.float64), ("ulysses", "sdpa", torch.float64),
         ("ring", "triton", torch.float32), ("ulysses", "triton", torch.float32)]


def errors(grid, attn, backend, dtype) -> tuple[float, float]:
    """Max error of this rank's output and qkv gradient against whole-sequence attention."""
    gen = torch.Generator().manual_seed(0)
    qkv, dout = torch.randn(B, T, 3, H, D, generator=gen), torch.randn(B, H, T, D, generator=gen)
    ref_out, ref_grad = whole_attention(qkv, dout)
    mine = context.positions(T, grid.cp, grid.cp_rank)
    local = qkv.index_select(1, mine).to(dtype).requires_grad_()
    grid.cp_attn = attn
    out = CORES[attn](grid, backend)(local)
    out.backward(dout[:, :, mine].to(dtype))
    return ((out.double() - ref_out[:, :, mine]).abs().max().item(),
            (local.grad.double() - ref_grad[:, mine]).abs().max().item())


def attention_peak(grid, seq_len: int) -> int:
    """Peak bytes allocated on this rank by ring attention's forward and backward, for its slice of a
    seq_len sequence (at cp = 1, plain math attention over all of it)."""
    qkv = torch.randn(1, seq_len, 3, H, D, generator=torch.Generator().manual_seed(0))
    local = (context.split_sequence(qkv, grid) if grid.cp > 1 else qkv).requires_grad_()
    core = context.RingAttention(grid, "math")

    def step():
        out = core(local)
        out.backward(torch.ones_like(out))
    return reports.peak_memory(step, torch.device("cpu"))


PEAK_T = 512


class HostData(TorchDispatchMode):
    """Counts tensors made from Python data (torch.tensor): on a GPU each is a copy from the host, and a
    copy from pageable host memory first waits for the device to finish what it was given."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten.lift_fresh.default
        return func(*args, **(kwargs or {}))


def host_data_per_step(grid, steps: int = 3) -> dict[str, list[int]]:
    """Tensors built from host data in each of a few forward and backward steps of a cp model, per core."""
    counts = {}
    for attn in CORES:
        grid.cp_attn = attn
        model = shard.build_model(GPTConfig(n_layer=2, n_head=H, n_embd=H * D, block_size=T, vocab_size=256,
                                            attn="math"), grid, seed=0, device=torch.device("cpu"), seq_len=T)
        idx = torch.randint(0, 256, (B, T + 1), generator=torch.Generator().manual_seed(0))
        counts[attn] = []
        for _ in range(steps):
            with HostData() as host:
                _, loss = model(idx[:, :-1], idx[:, 1:])
                loss.backward()
            counts[attn].append(host.count)
    return counts


def everything(grid) -> dict:
    return {"errors": {case: errors(grid, *case) for case in CASES}, "peak": attention_peak(grid, PEAK_T),
            "host_data": host_data_per_step(grid)}


@pytest.fixture(scope="module")
def results() -> dict:
    """Each rank's results at cp = 2 and cp = 4 (one launch each: starting processes is the slow part)."""
    return {cp: ranks(cp, everything) for cp in (2, 4)}


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("case", CASES, ids=[f"{a}-{b}" for a, b, _ in CASES])
def test_attention_cores_match_whole_sequence_attention(results, cp, case):
    """float64 in, float64 out: the merged blocks are exactly attention (1e-12). The Triton kernel's blocks
    (fp32, in the interpreter) are merged by their log-sum-exps across the ring."""
    tol = 1e-12 if case[2] == torch.float64 else 2e-5
    for rank, result in enumerate(results[cp]):
        out_err, grad_err = result["errors"][case]
        assert out_err <= tol and grad_err <= tol, f"rank {rank}: output {out_err:.1e}, gradient {grad_err:.1e}"


def test_ring_attention_memory_per_rank_falls_with_cp(results):
    """At a fixed sequence, each rank's attention memory falls at least as 1/cp: its queries, keys, values
    and output are T/cp long, and the score blocks it ever holds at most (T/cp)^2 (with the math blocks,
    a chunk of rows of one at a time; the flash kernel holds none). One process, cp = 1, holds the whole
    T x T scores."""
    peaks = {1: attention_peak(parallel.Grid(), PEAK_T)} | {cp: max(r["peak"] for r in results[cp]) for cp in (2, 4)}
    print(f"\nring attention peak bytes per rank at T = {PEAK_T}: {peaks}")
    assert peaks[1] / peaks[2] >= 2 and peaks[2] / peaks[4] >= 2, peaks


def test_cp_steps_build_no_tensor_from_host_data_after_the_first(results):
    """The positions a cp rank holds, and Ulysses' reordering, are made on the device once per shape: no
    step after the first builds a tensor from Python data (on a GPU each was a host-to-device copy and a
    wait for the device, per layer and micro-batch: tests/test_gpu.py checks there is no wait at all)."""
    for cp in (2, 4):
        for rank, result in enumerate(results[cp]):
            for attn, counts in result["host_data"].items():
                assert counts[1:] == [0, 0], f"cp {cp} rank {rank} {attn}: tensors from host data per step {counts}"


def ring_peak(seq_len: int) -> int:
    """Peak bytes of ring attention's forward and backward on the math blocks, one rank holding it all."""
    qkv = torch.randn(1, seq_len, 3, H, D, generator=torch.Generator().manual_seed(0)).requires_grad_()

    def step():
        out = context.RingAttentionFn.apply(qkv, parallel.Grid(), False)
        out.backward(torch.ones_like(out))
    return reports.peak_memory(step, torch.device("cpu"))


def test_ring_attention_off_the_kernel_grows_linearly_with_the_sequence(monkeypatch):
    """The math blocks (fp32, --attn sdpa, head dims the kernel lacks) make their scores a chunk of query
    rows at a time: doubling T doubles the memory, where whole (T/cp)^2 blocks of scores would quadruple
    it. (A small chunk here, so that T = 512 already needs several.)"""
    monkeypatch.setattr(context, "SCORE_CHUNK_BYTES", 64 * 2**10, raising=False)
    peaks = {T: ring_peak(T) for T in (512, 1024)}
    print(f"\nring attention (math blocks) peak bytes: {peaks}")
    assert peaks[1024] <= 2.2 * peaks[512], peaks


def test_off_the_kernel_long_keys_keep_a_chunk_of_rows_and_take_fewer_heads():
    """At long sequences the math blocks' chunks no longer shrink to a few query rows with every head (21
    rows at 64k keys and 12 heads: each matmul read every head's keys for 21 rows): a chunk keeps
    CHUNK_ROWS rows and takes as many heads as its score budget holds. Every (head, row) once, each chunk in
    the budget."""
    B, H, T = 1, 12, 65536
    q = torch.empty(B, H, T, 64, device="meta")
    chunks = list(context.query_chunks(q, q, causal=True))
    seen = torch.zeros(H, T, dtype=torch.int32)
    for heads, rows, keys in chunks:
        seen[heads, rows] += 1
        assert rows.stop - rows.start == context.CHUNK_ROWS and keys == slice(0, rows.stop)
        assert B * (heads.stop - heads.start) * context.CHUNK_ROWS * T * 4 <= context.SCORE_CHUNK_BYTES
    assert seen.eq(1).all() and len(chunks) == H // 2 * T // context.CHUNK_ROWS  # 2 of the 12 heads a chunk


@pytest.mark.parametrize("budget", [2**20, 32 * 512, 8 * 512], ids=["whole", "2-heads-a-chunk", "16-rows-of-1-head"])
@pytest.mark.parametrize("causal", [True, False])
def test_the_math_blocks_are_the_same_however_they_are_chunked(monkeypatch, budget, causal):
    """The math blocks forward and backward (grouped-query attention: 4 heads over 2 kv heads) with the
    scores whole, two heads a chunk, and half the rows of one head a chunk: the same outputs and gradients."""
    gen = torch.Generator().manual_seed(0)
    q, out_grad = (torch.randn(2, 4, 32, 16, generator=gen) for _ in range(2))
    k, v = (torch.randn(2, 2, 32, 16, generator=gen) for _ in range(2))
    whole = context.block_attention(q, k, v, causal, kernel=False)
    whole_grads = context.block_attention_backward(q, k, v, *whole, out_grad, causal, kernel=False)
    monkeypatch.setattr(context, "SCORE_CHUNK_BYTES", budget)
    chunked = context.block_attention(q, k, v, causal, kernel=False)
    grads = context.block_attention_backward(q, k, v, *chunked, out_grad, causal, kernel=False)
    for got, want in zip([*chunked, *grads], [*whole, *whole_grads], strict=True):
        torch.testing.assert_close(got, want)


def test_positions_give_every_rank_an_early_and_a_late_chunk():
    """chunk i and chunk 2cp-1-i: together the ranks hold every position once, and every rank holds as many
    causal scores (its queries' positions summed, plus one each) as every other."""
    T = 32
    for cp in (1, 2, 4):
        held = [context.positions(T, cp, r) for r in range(cp)]
        assert sorted(torch.cat(held).tolist()) == list(range(T))
        assert len({int((p + 1).sum()) for p in held}) == 1


@pytest.mark.parametrize("causal", [True, False])
def test_block_math_is_fp32_under_autocast(causal):
    """Without the kernel, a ring block is computed in fp32 even inside the bf16 autocast that train.py
    runs the forward in: its log-sum-exp must be the one the backward (never autocast) rebuilds P from.
    Bitwise the results outside autocast (under it, matmuls in bf16 put the log-sum-exp ~0.06 off)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 2, 8, 16, generator=gen).to(torch.bfloat16) for _ in range(4))
    plain = context.block_attention(q, k, v, causal, kernel=False)
    with torch.autocast("cpu", torch.bfloat16):
        autocast = context.block_attention(q, k, v, causal, kernel=False)
        grads = context.block_attention_backward(q, k, v, plain[0], plain[1], dout, causal, kernel=False)
    assert all(torch.equal(a, b) and a.dtype == torch.float32 for a, b in zip(autocast, plain))
    plain_grads = context.block_attention_backward(q, k, v, plain[0], plain[1], dout, causal, kernel=False)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))


def test_only_a_process_that_builds_a_cp_core_imports_torch_dynamo():
    """torch.compiler.disable imports torch._dynamo, 1.7 s of CPU: the cores apply it to their forward when the
    first one is built, so a process that only parses flags, samples or reads checkpoints does not pay it."""
    code = "import sys, train, sample; from instruments import checkpoints; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    for core in CORES.values():  # and a built core still runs eagerly under torch.compile
        core(parallel.Grid(), "math")
        assert core.forward._torchdynamo_disable
