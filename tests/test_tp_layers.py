"""Each tensor-parallel layer against its dense counterpart, forward and backward, on 2 gloo ranks.

Every rank builds the dense layer from the same seed, builds the parallel layer from its slice
(shard.take_shard), runs the same input, and checks the output and every gradient (of the
input, and of its weight slice) against the dense ones; with --sp the input and output are the
rank's slice of the sequence.
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import lmhead
import model as gpt
import parallel
import shard
from parallel import place, placement

B, T, C, V = 2, 8, 16, 384


def ranks(world: int, fn, *args) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # spawn, not fork: a fork of a process whose OpenMP threads are running can deadlock in a matmul
    mp.start_processes(worker, args=(world, port, fn, args), nprocs=world, start_method="spawn")


def worker(rank, world, port, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        grid = parallel.Grid(tp=world, rank=rank, groups={"tp": None})
        fn(grid, *args)
    finally:
        dist.destroy_process_group()


def local_seq(x, grid, sp):
    return x.chunk(grid.tp, dim=1)[grid.tp_rank] if sp else x


def last_dim(x, spec):
    """The same cut as a weight's output rows, applied to the features of an activation."""
    return shard.take_shard(x, {**spec, "dim": x.dim() - 1})


def materialize(module, full: dict[str, torch.Tensor]) -> None:
    for name, p in list(module.named_parameters()):
        new = torch.nn.Parameter(shard.take_shard(full[name], placement(p).shard))
        place(new, shard=placement(p).shard)
        setattr(module, name, new)


def check_linear(grid, kind, groups, sp):
    torch.manual_seed(0)
    d_in, d_out = (C, 3 * C) if kind == "column" else (4 * C, C)
    dense = torch.nn.Linear(d_in, d_out)
    x = torch.randn(B, T, d_in, requires_grad=True)
    grid.sp = sp
    if kind == "column":
        layer = shard.ColumnParallelLinear(d_in, d_out, grid, groups=groups)
        x_local = local_seq(x, grid, sp).detach().requires_grad_()  # input: replicated, or sequence-sharded
        want_out = last_dim(dense(x), placement(layer.weight).shard)  # output: this rank's columns, all positions
    else:
        layer = shard.RowParallelLinear(d_in, d_out, grid)
        x_local = shard.take_shard(x, {"dim": 2, "index": grid.tp_rank, "count": grid.tp, "groups": 1})
        x_local = x_local.detach().requires_grad_()  # input: this rank's features
        want_out = local_seq(dense(x), grid, sp)  # output: the full sum, for this rank's positions
    materialize(layer, {"weight": dense.weight.detach(), "bias": dense.bias.detach()})
    out = layer(x_local)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    g = torch.randn(B, T, d_out)  # the same upstream gradient everywhere
    dense(x).backward(g)
    g_local = last_dim(g, placement(layer.weight).shard) if kind == "column" else local_seq(g, grid, sp)
    out.backward(g_local)
    torch.testing.assert_close(layer.weight.grad, shard.take_shard(dense.weight.grad, placement(layer.weight).shard))
    bias_grad = layer.bias.grad.clone()
    if kind == "row" and sp:  # each rank saw only its positions: partial, summed by finish_grads
        dist.all_reduce(bias_grad)
    torch.testing.assert_close(bias_grad, shard.take_shard(dense.bias.grad, placement(layer.bias).shard))
    want_x_grad = local_seq(x.grad, grid, sp) if kind == "column" else \
        shard.take_shard(x.grad, {"dim": 2, "index": grid.tp_rank, "count": grid.tp, "groups": 1})
    torch.testing.assert_close(x_local.grad, want_x_grad, rtol=1e-5, atol=1e-6)


def check_embedding_and_loss(grid):
    torch.manual_seed(0)
    dense = torch.nn.Embedding(V, C)
    idx, targets = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    emb = shard.VocabParallelEmbedding(V, C, grid)
    materialize(emb, {"weight": dense.weight.detach()})
    torch.testing.assert_close(emb(idx), dense(idx))
    g = torch.randn(B, T, C)
    dense(idx).backward(g)
    emb(idx).backward(g)
    torch.testing.assert_close(emb.weight.grad, shard.take_shard(dense.weight.grad, placement(emb.weight).shard))

    # the loss: the head's weight is the embedding's, the input replicated; chunks of 5 rows (of 16)
    lmhead.LOSS_CHUNK_BYTES = 5 * 4 * V // grid.tp
    x = torch.randn(B, T, C, requires_grad=True)
    x_local = x.detach().clone().requires_grad_()
    loss = shard.VocabParallelLoss(grid, emb.vocab_start)(x_local, emb.weight, targets)
    want = F.cross_entropy((x @ dense.weight.t()).flatten(0, 1), targets.flatten())
    torch.testing.assert_close(loss, want)
    emb.weight.grad = dense.weight.grad = None
    (loss * 3).backward()
    (want * 3).backward()
    torch.testing.assert_close(x_local.grad, x.grad)  # the ranks' partial sums, all-reduced by f
    torch.testing.assert_close(emb.weight.grad, shard.take_shard(dense.weight.grad, placement(emb.weight).shard))


@pytest.mark.parametrize("kind,groups,sp", [("column", 1, False), ("column", 3, False), ("column", 3, True),
                                            ("row", 1, False), ("row", 1, True)])
def test_linear_layers_match_dense(kind, groups, sp):
    ranks(2, check_linear, kind, groups, sp)


def test_vocab_parallel_embedding_and_cross_entropy_match_dense():
    ranks(2, check_embedding_and_loss)


def test_qkv_split_keeps_whole_heads():
    """groups=3: each rank gets its heads' rows of q, of k and of v, not a third of the stack."""
    full = torch.arange(12).view(12, 1)  # rows: q0 q1 q2 q3 | k0 k1 k2 k3 | v0 v1 v2 v3 (1 row per head)
    spec = {"dim": 0, "index": 1, "count": 2, "groups": 3}
    assert shard.take_shard(full, spec).flatten().tolist() == [2, 3, 6, 7, 10, 11]
    parts = [shard.take_shard(full, {**spec, "index": r}) for r in range(2)]
    assert torch.equal(shard.unshard(parts, spec), full)


def test_layouts_that_cannot_split_are_refused():
    cfg = gpt.GPTConfig(n_layer=2, n_head=5, n_embd=80, block_size=64, vocab_size=257)
    with pytest.raises(parallel.LayoutError, match="does not divide the padded vocabulary 384"):
        shard.check_layout(cfg, parallel.Grid(tp=5), seq_len=64)
    with pytest.raises(parallel.LayoutError, match="does not divide the model's 5 attention heads"):
        shard.check_layout(cfg, parallel.Grid(tp=2), seq_len=64)
    with pytest.raises(parallel.LayoutError, match="needs --tp 2 or more"):
        shard.check_layout(cfg, parallel.Grid(tp=1, sp=True), seq_len=64)


def check_compiled_blocks(grid, sp):
    """Each tensor-parallel block is one graph to torch.compile (no break at its collectives); compiled, the
    model's loss and every gradient are eager's, and Grid counts the same collectives, call by call."""
    grid.sp = sp
    cfg = gpt.GPTConfig(n_layer=2, n_head=2, n_embd=C, block_size=T, vocab_size=V, attn="math")
    idx = torch.randint(0, V, (B, T + 1), generator=torch.Generator().manual_seed(0))

    def loss_grads_and_counts(model):
        grid.traffic.reset()
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        return loss, {n: p.grad for n, p in model.named_parameters()}, dict(grid.traffic.counts)

    eager = shard.build_model(cfg, grid, 0, torch.device("cpu"), T)
    compiled = shard.build_model(cfg, grid, 0, torch.device("cpu"), T)
    for block in compiled.transformer.h:
        x = torch.randn(B, T // grid.tp if sp else T, C)
        explained = torch._dynamo.explain(block)(x)
        assert explained.graph_count == 1, [str(b.reason)[:200] for b in explained.break_reasons]
        block.compile(backend="aot_eager", fullgraph=True)  # a break would be an error
    (loss, grads, counts), (want, want_grads, want_counts) = (loss_grads_and_counts(m) for m in (compiled, eager))
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=name)
    assert counts == want_counts and counts[("all_gather" if sp else "all_reduce", "tp")][0] > 0, counts


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp-sp"])
def test_tensor_parallel_blocks_compile_to_one_graph_each(sp):
    ranks(2, check_compiled_blocks, sp)
