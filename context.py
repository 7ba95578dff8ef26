"""Context parallelism: each rank holds a slice of every sequence, and attention still sees all of it.

Activation memory grows with the sequence length T, and attention's work with T^2. Megatron's sequence
parallelism (parallel.py) splits only the LayerNorm and dropout regions, and only over the tensor-parallel
ranks: attention and the linear layers still see all T tokens on every rank. With `--cp N`, N ranks each
keep T/N tokens of *every* activation. Embeddings, LayerNorms, MLPs and the loss work token by token, so
they need no communication at all; the weights are replicas whose gradients are averaged over the
data-parallel and context-parallel ranks together (`Grid.dp_cp`). Only attention mixes tokens: a query
needs the keys and values of every earlier token, and most of them live on other ranks. Two ways to
bring them (`--cp-attn`):

ring (Liu et al. 2023, "Ring Attention with Blockwise Transformers"; Megatron-LM's context parallelism).
    Keys and values travel around the ring of cp ranks, one rank's block per step. Each rank attends its
    queries to the block in hand while the next block is already on its way (batch_isend_irecv), and
    merges the partial results by their log-sum-exp, which is the online softmax of kernels.py with one
    block per rank:

        lse = log(e^lse_a + e^lse_b)        o = e^(lse_a - lse) o_a + e^(lse_b - lse) o_b

    The backward sends the keys and values around again; each block's dK, dV ride along with it,
    collecting every rank's share, and one last hop brings them home.

    The causal mask makes late queries expensive and early ones cheap, so rank i keeps two of the 2N
    chunks of each sequence, chunk i and chunk 2N-1-i:

        chunk   0  1  2  3  4  5  6  7        (cp = 4)
        rank    0  1  2  3  3  2  1  0

    Then every step of the ring costs every rank the same: its own block (step 0) is a small causal
    attention; a block from an earlier rank j < i is seen whole by both its chunks' queries, but only
    its first chunk is earlier than them; from a later rank j > i, only the late chunk 2N-1-i sees it,
    all of it. Either way half of the (2c x 2c) scores, c = T/2N, as on the diagonal.

ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses"). One all-to-all turns (T/N tokens, all heads) into
    (all T tokens, H/N heads); attention runs on whole sequences with any backend, our kernel included;
    a second all-to-all turns the output back. Needs the heads (per tensor-parallel rank) divisible by N.

What each rank sends per layer per micro-batch (b sequences of s tokens, h = hidden size per
tensor-parallel rank, e bytes per element), which --comm-report measures:

    ring     forward  (N-1) hops of its K and V:                   (N-1) * 2bsh/N * e
             backward (N-1) hops of K and V, N hops of dK and dV:  (N-1) * 2bsh/N * e + N * 2bsh/N * 4 (fp32)
    ulysses  forward  all-to-all of q, k, v and of the output:     4bsh/N * e   (of which (N-1)/N leaves)
             backward the same two, the other way round

The ring's traffic does not depend on the number of heads and it hides behind the block attention; Ulysses
moves less when N is large (its all-to-alls shrink as 1/N) but cannot go past the number of heads.

The Llama family (model.py) changes two things here. Grouped-query attention: the ring carries H_kv heads of
keys and values, not H (its K, V terms above shrink by H_kv / H), and Ulysses hands each rank H/N query heads
and the H_kv/N kv heads they read, so N must divide the kv heads too: with few kv heads (2 per tensor-parallel
rank, say) Ulysses stops at cp 2 and the ring is the way past it. RoPE: a rank's tokens are two chunks from
far apart, so its attention layers take their positions from `ContextParallelPositions` (the global ones,
`positions` below), and each token turns exactly as it would in one process.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn

from kernels import flash_backward, flash_forward, launch_config, unpack_qkv
from model import Attention, Positions
from parallel import Grid
from support.interrupt import peer_call

KV, DKV = 1, 2  # message tags: keys/values and their gradients may cross between the same two ranks at once


# ----------------------------------------------------------------------------- which tokens a rank holds


@functools.cache
def positions(T: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The positions of the T/cp tokens that cp rank `rank` holds: chunks rank and 2cp-1-rank of 2cp.
    Made on the device (a tensor from a Python list would be a copy from the host, which waits for the
    GPU), once per shape: every layer and micro-batch reuses it. Read-only: callers share it."""
    c = T // (2 * cp)
    early = torch.arange(rank * c, (rank + 1) * c, device=device)
    late = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([early, late])


def split_sequence(x: torch.Tensor, grid: Grid, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of x along `dim`. No communication either way: the gradient of the other
    tokens is other ranks' business (index_select's backward scatters into zeros)."""
    return x.index_select(dim, positions(x.size(dim), grid.cp, grid.cp_rank, x.device))


def split_input(grid: Grid, dim: int):
    """A forward pre-hook that gives an embedding only this rank's tokens (dim 1 of the token ids) or
    their positions (dim 0 of the position indices): nothing is looked up, or all-reduced under tensor
    parallelism, for tokens another rank holds."""
    def hook(module, args):
        return (split_sequence(args[0], grid, dim), *args[1:]) if grid.cp_on else None
    return hook


class ContextParallelPositions(Positions):
    """RoPE's positions (model.Positions) for this rank's T/cp tokens: not 0..T/cp-1 but the global positions
    of its two chunks, so every token turns as it would in one process."""

    def __init__(self, grid: Grid):
        super().__init__()
        self.grid = grid

    def forward(self, T: int, start: int, device: torch.device) -> torch.Tensor:
        if not self.grid.cp_on:
            return super().forward(T, start, device)
        return positions(T * self.grid.cp, self.grid.cp, self.grid.cp_rank, device) + start


class ActivationPositions(ContextParallelPositions):
    """The global positions of the T tokens this rank holds between the attention cores, where
    dropout draws its masks by position (dropout.py): its two chunks, and under sequence
    parallelism this tp rank's contiguous tp-th of them (shard.split_seq)."""

    def forward(self, T: int, start: int, device: torch.device) -> torch.Tensor:
        g = self.grid
        if not g.sp_on:
            return super().forward(T, start, device)
        return super().forward(T * g.tp, start, device).chunk(g.tp)[g.tp_rank]


class ContextParallelLoss(nn.Module):
    """The model's loss layer, given this rank's targets: the mean over its tokens. The slices are the
    same size, so the mean over the cp ranks (the gradient average, the reported loss) is the whole mean."""

    def __init__(self, inner: nn.Module, grid: Grid):
        super().__init__()
        self.inner, self.grid = inner, grid

    def forward(self, x, weight, targets):
        return self.inner(x, weight, split_sequence(targets, self.grid) if self.grid.cp_on else targets)


class SequenceChoices:
    """MoE.gather (moe.py) under context parallelism: an expert's capacity counts a whole sequence's
    assignments, earliest first, and the balance loss the whole sequence's shares, so every cp rank needs
    every token's choices. One all-gather of them (k int64 per token, small beside the activations), put in
    sequence order; then each rank drops exactly the tokens one process would."""

    def __init__(self, grid: Grid):
        self.grid = grid

    def __call__(self, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        g = self.grid
        if not g.cp_on:
            return experts, None
        B, t, k = experts.shape  # this rank's t = T/cp tokens
        gathered = experts.new_empty(g.cp * B, t, k)  # rank by rank
        g.all_gather(gathered, experts.contiguous(), "cp")
        _, back = rank_order(t * g.cp, g.cp, experts.device)
        whole = gathered.view(g.cp, B, t, k).transpose(0, 1).reshape(B, t * g.cp, k)[:, back]
        return whole, positions(t * g.cp, g.cp, g.cp_rank, experts.device)


# ----------------------------------------------------------------------------- attention on one block


# Off the kernel, a block's scores are made a chunk of query rows (and heads) at a time
# (`query_chunks`): memory of one chunk of fp32 scores, however long the sequence, instead of the
# whole (T/cp)^2 block at once. A chunk keeps CHUNK_ROWS rows, with fewer heads as the keys grow:
# each matmul reads all of its heads' keys for its rows, so a few rows a chunk would read them again
# and again for little work (at 64k keys and 12 heads, all heads would leave 21 rows a chunk).
SCORE_CHUNK_BYTES = 64 * 2**20
CHUNK_ROWS = 128


def block_attention(q, k, v, causal: bool, kernel: bool):
    """Attention of queries q (B, H, Tq, D) to one block of keys and values (B, H, Tk, D): causal (the
    square lower triangle) or every key visible. Returns the output (fp32) and the natural log-sum-exp
    of every score row (B, H, Tq), which is what merging blocks needs."""
    if kernel:  # the kernel reads a kv head for each group of query heads where it lies (GQA)
        o, lse2 = flash_forward(q, k, v, launch_config(q.size(-1), q.dtype), causal=causal)
        return o.float(), lse2 * math.log(2)  # the kernel works in base 2
    k, v = repeat_kv(k, q.size(1)), repeat_kv(v, q.size(1))
    # fp32 even under autocast, which would run these matmuls in 16 bits: the backward rebuilds P in fp32
    # from this log-sum-exp, and the two must agree
    with torch.autocast(q.device.type, enabled=False):
        wide = torch.promote_types(q.dtype, torch.float32)  # fp32 (fp64 for fp64 inputs)
        out = q.new_empty(q.shape, dtype=wide)
        lse = q.new_empty(q.shape[:-1], dtype=wide)
        for h, rows, keys in query_chunks(q, k, causal):
            s = scores(q[:, h, rows], k[:, h, keys], causal, rows.start)  # (B, h, rows, Tk)
            lse[:, h, rows] = s.logsumexp(-1)
            out[:, h, rows] = torch.exp(s - lse[:, h, rows, None]) @ v[:, h, keys].to(wide)
        return out, lse


def block_attention_backward(q, k, v, out, lse, dout, causal: bool, kernel: bool):
    """This block's share of dq, dk, dv (fp32), from the rows' *final* output and log-sum-exp (merged
    over every block): P = exp(S - lse) is then the block's slice of the true softmax."""
    if kernel:
        grads = flash_backward(q, k, v, out, (lse / math.log(2)).contiguous(), dout,
                               launch_config(q.size(-1), q.dtype), causal=causal)
        return [g.float() for g in grads]
    H_kv = k.size(1)
    k, v = repeat_kv(k, q.size(1)), repeat_kv(v, q.size(1))
    with torch.autocast(q.device.type, enabled=False):  # fp32, as the forward, whatever the caller's autocast
        q, k, v, out, dout = (x.to(lse.dtype) for x in (q, k, v, out, dout))
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for h, rows, keys in query_chunks(q, k, causal):
            qc, kc, vc = q[:, h, rows], k[:, h, keys], v[:, h, keys]
            oc, doc = out[:, h, rows], dout[:, h, rows]
            s = scores(qc, kc, causal, rows.start)  # (B, h, rows, Tk)
            p = torch.exp(s - lse[:, h, rows, None])
            delta = (doc * oc).sum(-1, keepdim=True)  # rowsum(dO * O) = rowsum(P * dP)
            ds = p * (doc @ vc.transpose(-2, -1) - delta) / math.sqrt(q.size(-1))  # dS, times the scores' scale
            dq[:, h, rows] = ds @ kc
            dk[:, h, keys] += ds.transpose(-2, -1) @ qc
            dv[:, h, keys] += p.transpose(-2, -1) @ doc
        G = q.size(1) // H_kv  # GQA: a kv head's gradient is the sum over its group's query heads
        return dq, dk.unflatten(1, (H_kv, G)).sum(2), dv.unflatten(1, (H_kv, G)).sum(2)


def repeat_kv(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """(B, H_kv, T, D) -> (B, n_head, T, D), each kv head repeated for its group (the math path's GQA)."""
    return x if x.size(1) == n_head else x.repeat_interleave(n_head // x.size(1), dim=1)


def query_chunks(q, k, causal: bool):
    """(heads, rows of queries, keys they see) in chunks whose fp32 scores take about
    SCORE_CHUNK_BYTES: every head and as many rows as fit; where that is fewer than CHUNK_ROWS rows
    (long keys), CHUNK_ROWS rows (or all, if fewer) of as many heads as fit; and where not even one
    head's fit, as many rows as do. Under the causal mask the rows [a, b) see only keys [0, b)."""
    B, H, Tq, _ = q.shape
    row = B * k.size(2) * 4  # the bytes of one row of one head's scores
    n = max(1, min(Tq, max(CHUNK_ROWS, SCORE_CHUNK_BYTES // (row * H)), SCORE_CHUNK_BYTES // row))
    h = max(1, min(H, SCORE_CHUNK_BYTES // (row * n)))
    for first in range(0, H, h):
        for a in range(0, Tq, n):
            rows = slice(a, min(a + n, Tq))
            keys = slice(0, rows.stop) if causal else slice(None)
            yield slice(first, min(first + h, H)), rows, keys


def scores(q, k, causal: bool, first_row: int = 0) -> torch.Tensor:
    """q k^T / sqrt(d), masked, in fp32 at least. Causal: query i (counted from `first_row`) sees keys 0..i."""
    wide = torch.promote_types(q.dtype, torch.float32)
    s = (q.to(wide) @ k.to(wide).transpose(-2, -1)) / math.sqrt(q.size(-1))
    if causal:
        visible = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(first_row)
        s = s.masked_fill(~visible, float("-inf"))
    return s


def step_blocks(i: int, j: int, c: int) -> tuple[slice, slice, bool]:
    """(rows of my queries, rows of rank j's keys, causal) that rank i computes on rank j's block, when
    every rank holds chunks (rank, 2cp-1-rank) of c tokens each. See the module docstring."""
    if j == i:
        return slice(None), slice(None), True
    if j < i:
        return slice(None), slice(0, c), False
    return slice(c, None), slice(None), False


def merge(out: torch.Tensor, lse: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """Fold one block's (o_b, lse_b) into the running (out, lse), in place."""
    new = torch.logaddexp(lse, lse_b)
    out.mul_(torch.exp(lse - new)[..., None]).add_(o_b * torch.exp(lse_b - new)[..., None])
    lse.copy_(new)


# ----------------------------------------------------------------------------- ring attention


def split_packed(qkv: torch.Tensor, n_kv_head: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed projection (B, Tl, 3, H, D), or (B, Tl, H + 2 H_kv, D) under GQA -> q (B, H, Tl, D), a
    view, and the block that travels, k and v as one (B, Tl, 2, H_kv, D): under GQA the ring moves
    H_kv heads, not H, of keys and values (and of their gradients)."""
    q, _, _ = unpack_qkv(qkv, n_kv_head)
    kv = qkv[:, :, 1:] if n_kv_head is None else qkv[:, :, q.size(1):].unflatten(2, (2, n_kv_head))
    return q, kv.contiguous()


class RingAttentionFn(torch.autograd.Function):
    """qkv (B, T/cp, 3, H, D) of this rank's tokens (or GQA's (B, T/cp, H + 2 H_kv, D)) -> (B, H, T/cp, D),
    attending to every rank's keys."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, grid: Grid, kernel: bool, n_kv_head: int | None = None) -> torch.Tensor:
        ctx.grid, ctx.kernel, ctx.n_kv_head = grid, kernel, n_kv_head
        q, kv = split_packed(qkv, n_kv_head)  # (B, H, Tl, D); (B, Tl, 2, H_kv, D): the block that travels
        wide = torch.promote_types(qkv.dtype, torch.float32)  # partial results are merged in fp32 at least
        out = torch.zeros(q.shape, dtype=wide, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=wide, device=q.device)
        for step in range(grid.cp):
            incoming = torch.empty_like(kv) if step < grid.cp - 1 else None
            works = ring_pass(grid, [(kv, incoming, KV)])  # in flight while we compute on kv
            rows, keys, causal = step_blocks(grid.cp_rank, (grid.cp_rank - step) % grid.cp, q.size(2) // 2)
            o_b, lse_b = block_attention(q[:, :, rows], *heads_first(kv[:, keys]), causal, kernel)
            merge(out[:, :, rows], lse[:, :, rows], o_b, lse_b)
            wait_all(works)
            kv = incoming
        B, H, Tl, D = q.shape
        out = qkv.new_empty(B, Tl, H, D).transpose(1, 2).copy_(out)  # laid out (B, T, H, D): the model's
        ctx.save_for_backward(qkv, out, lse)  # transpose back is free, and c_proj saves this very tensor
        return out  # O(T/cp) per rank is all that is kept: no scores

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        grid, kernel = ctx.grid, ctx.kernel
        qkv, out, lse = ctx.saved_tensors
        q, kv = split_packed(qkv, ctx.n_kv_head)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)
        acc = None  # dK, dV (B, Tl, 2, H_kv, D) fp32 of the block in hand, summed over the ranks it has visited
        for step in range(grid.cp):
            incoming = torch.empty_like(kv) if step < grid.cp - 1 else None
            acc_in = torch.empty_like(acc) if step > 0 else None  # the next block's sum so far
            works = ring_pass(grid, [(kv, incoming, KV), (acc, acc_in, DKV)])
            rows, keys, causal = step_blocks(grid.cp_rank, (grid.cp_rank - step) % grid.cp, q.size(2) // 2)
            dq_b, dk_b, dv_b = block_attention_backward(q[:, :, rows], *heads_first(kv[:, keys]), out[:, :, rows],
                                                        lse[:, :, rows], dout[:, :, rows], causal, kernel)
            dq[:, :, rows] += dq_b
            mine = kv.new_zeros(kv.shape, dtype=lse.dtype)
            mine[:, keys] = torch.stack([dk_b, dv_b], dim=2).transpose(1, 3)  # (B, Tk, 2, H, D)
            wait_all(works)
            acc = mine if acc_in is None else acc_in.add_(mine)
            kv = incoming
        if grid.cp > 1:  # the block in hand is the next rank's: one last hop takes every sum home
            home = torch.empty_like(acc)
            wait_all(ring_pass(grid, [(acc, home, DKV)]))
            acc = home
        if ctx.n_kv_head is None:
            dqkv = torch.cat([dq.transpose(1, 2).unsqueeze(2), acc], dim=2)  # (B, Tl, 3, H, D)
        else:
            dqkv = torch.cat([dq.transpose(1, 2), acc.flatten(2, 3)], dim=2)  # (B, Tl, H + 2 H_kv, D)
        return dqkv.to(qkv.dtype), None, None, None


def heads_first(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, Tk, 2, H_kv, D) -> k, v as (B, H_kv, Tk, D) views."""
    return kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)


def ring_pass(grid: Grid, messages: list[tuple]) -> list:
    """Send each (outgoing, incoming, tag) one step around the ring: outgoing to the next rank while
    incoming arrives from the previous one (incoming None: this message does not move this step).
    Returns the works to wait for."""
    messages = [m for m in messages if m[1] is not None]
    sends = [(out, grid.cp_next, tag) for out, _, tag in messages]
    recvs = [(inc, grid.cp_prev, tag) for _, inc, tag in messages]
    return grid.send_recv(sends, recvs, group="cp", wait=False) if messages else []


def wait_all(works: list) -> None:
    for work in works:
        peer_call(work.wait, what="ring attention's point-to-point over cp")


@functools.cache
def eager_forward(core: type) -> None:
    """torch.compiler.disable on a cp core's forward: messages inside autograd Functions do not compile, so
    under torch.compile the core runs eagerly, between two graphs of its block. Done when the first core is
    built, not as a decorator: disable imports torch._dynamo, 1.7 s of CPU at the start of every process
    that imports this file, though only cp runs build a core."""
    core.forward = torch.compiler.disable(core.forward)


class RingAttention(nn.Module):
    """The attention core under --cp-attn ring (model.Attention on one rank). The blocks run on our
    Triton kernel where the backend is `triton`, else on the math version above (CPUs)."""

    def __init__(self, grid: Grid, backend: str):
        super().__init__()
        self.grid, self.backend, self.local = grid, backend, Attention(backend)
        eager_forward(RingAttention)

    def forward(self, qkv, n_kv_head=None):  # (B, T/cp, 3, H, D) or (B, T/cp, H + 2 H_kv, D)
        if not self.grid.cp_on:
            return self.local(qkv, n_kv_head)
        return RingAttentionFn.apply(qkv, self.grid, self.backend == "triton", n_kv_head)


# ----------------------------------------------------------------------------- Ulysses


def all_to_all(x: torch.Tensor, grid: Grid, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Cut x into cp pieces along scatter_dim, send piece r to cp rank r, and concatenate the pieces that
    arrive, in rank order, along gather_dim."""
    send = torch.stack(x.chunk(grid.cp, dim=scatter_dim))  # (cp, ...) contiguous: piece r goes to rank r
    recv = torch.empty_like(send)
    grid.all_to_all(recv, send, "cp")
    return torch.cat(recv.unbind(0), dim=gather_dim)


class AllToAll(torch.autograd.Function):
    """all_to_all forward; its gradient is the same exchange the other way round."""

    @staticmethod
    def forward(ctx, x, grid, scatter_dim, gather_dim):
        ctx.grid, ctx.dims = grid, (scatter_dim, gather_dim)
        return all_to_all(x, grid, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return all_to_all(grad, ctx.grid, gather_dim, scatter_dim), None, None, None


class UlyssesAttention(nn.Module):
    """The attention core under --cp-attn ulysses: sequence-sharded in, head-sharded for attention,
    sequence-sharded out."""

    def __init__(self, grid: Grid, backend: str):
        super().__init__()
        self.grid, self.backend, self.local = grid, backend, Attention(backend)
        eager_forward(UlyssesAttention)  # eager between two graphs of a compiled block, as the ring core

    def forward(self, qkv, n_kv_head=None):  # (B, T/cp, 3, H, D) or (B, T/cp, H + 2 H_kv, D)
        if not self.grid.cp_on:
            return self.local(qkv, n_kv_head)
        cp = self.grid.cp  # shard.check_layout made sure it divides the (kv) heads
        if n_kv_head is None:
            whole = AllToAll.apply(qkv, self.grid, 3, 1)  # (B, T, 3, H/cp, D): every rank's tokens, in rank order
        else:  # GQA: each cp rank gets H/cp query heads and the H_kv/cp kv heads they read
            q, k, v = qkv.split([qkv.size(2) - 2 * n_kv_head, n_kv_head, n_kv_head], dim=2)
            by_rank = torch.cat([x.unflatten(2, (cp, -1)) for x in (q, k, v)], dim=3)  # (B, T/cp, cp, heads/cp, D)
            whole = AllToAll.apply(by_rank, self.grid, 2, 1).squeeze(2)  # (B, T, (H + 2 H_kv)/cp, D)
            n_kv_head //= cp
        order, in_order = rank_order(whole.size(1), cp, qkv.device)
        y = self.local(whole.index_select(1, in_order), n_kv_head)  # (B, H/cp, T, D), causal in true order
        return AllToAll.apply(y.index_select(2, order), self.grid, 2, 1)  # (B, H, T/cp, D)


@functools.cache
def rank_order(T: int, cp: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions of the T tokens gathered from the cp ranks in rank order, and the permutation that
    puts them back in true order; once per shape, on the device (see `positions`)."""
    order = torch.cat([positions(T, cp, r, device) for r in range(cp)])
    return order, order.argsort()


# ----------------------------------------------------------------------------- the transformation


def apply_context_parallel(model: nn.Module, grid: Grid) -> None:
    """Swap a meta-built GPT's attention cores for the cp ones, embed only this rank's tokens at their
    own positions, and give the loss this rank's targets. (After tensor parallelism: the loss wraps the
    vocab-parallel one, and the sequence-parallel split then cuts this rank's T/cp tokens over tp.)"""
    core = {"ring": RingAttention, "ulysses": UlyssesAttention}[grid.cp_attn]
    for block in model.transformer.h:
        block.attn.core = core(grid, block.attn.backend)
        if block.attn.positions is not None:  # RoPE: rotate by global positions
            block.attn.positions = ContextParallelPositions(grid)
        if hasattr(block.mlp, "gather"):  # experts (moe.MoE): capacity over whole sequences
            block.mlp.gather = SequenceChoices(grid)
    model.transformer.wte.register_forward_pre_hook(split_input(grid, dim=1))  # ids (B, T) -> (B, T/cp)
    if "wpe" in model.transformer:  # GPT-2's table
        model.transformer.wpe.register_forward_pre_hook(split_input(grid, dim=0))  # positions (T,) -> (T/cp,)
    model.loss = ContextParallelLoss(model.loss, grid)

