"""Mixture of experts (moe.py): routing, capacity and dropping, the router losses, and expert parallelism
proven like every other layout: the same command at dp, with micro-batches and at --ep 2 and 4 gives the
single-process run's losses and weights (fp32, gloo, CPU), with capacity dropping on and off, and the
all-to-alls move the bytes of the formula on every rank."""

import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, STEPS, TINY, metrics, run_train
from test_parallel import assert_same_run, memory_lines

import config
import model as gpt
import moe
import parallel
from support import interrupt

# ----------------------------------------------------------------------------- the layer, on one device


def collapsed_x(B: int, T: int, C: int, seed: int = 0) -> torch.Tensor:
    """Inputs whose feature 0 is 1: a router that reads only feature 0 sends every token the same way."""
    x = torch.randn(B, T, C, generator=torch.Generator().manual_seed(seed))
    x[..., 0] = 1.0
    return x


def layer(C=16, hidden=32, swiglu=False, E=4, k=1, c=1.0, seed=0) -> moe.MoE:
    m = moe.MoE(C, hidden, swiglu, E, k, c)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return m


def test_tokens_over_capacity_pass_through_exactly():
    """Every token chooses expert 0; capacity ceil(c T k / E) = 2 of each sequence's 8 are kept, the first
    two in token order, and the MoE adds exactly 0 to the residual of the others. A router that sends
    everything one way scores the balance loss's maximum, E."""
    m = layer(E=4, k=1, c=1.0)
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[0, 0] = 20.0
    x = collapsed_x(3, 8, 16)
    out = m(x)
    keep = torch.zeros(3, 8, dtype=torch.bool)
    keep[:, :2] = True
    assert moe.capacity(8, 1, 4, 1.0) == 2
    assert (out[~keep] == 0).all() and (out[keep].abs().sum(-1) > 0).all()
    assert m.dropped.item() == pytest.approx(6 / 8)
    assert m.aux.item() == pytest.approx(4.0, rel=1e-6)
    assert m.load.tolist() == [24.0, 0.0, 0.0, 0.0]


def test_top_k_weights():
    """k = 1: the winner's softmax probability as it is (Switch); k = 2: the two best, renormalized to 1."""
    logits = torch.randn(2, 5, 6, generator=torch.Generator().manual_seed(1))
    probs = logits.softmax(-1)
    one, two = moe.route(logits, 1, 0), moe.route(logits, 2, 0)
    assert torch.equal(one.weights[..., 0], probs.max(-1).values)
    top2 = probs.topk(2, -1)
    assert torch.allclose(two.weights, top2.values / top2.values.sum(-1, keepdim=True))
    assert torch.allclose(two.weights.sum(-1), torch.ones(2, 5))
    assert torch.equal(two.experts, top2.indices)
    assert one.keep.all() and two.keep.all()  # factor 0: nothing dropped


def test_capacity_and_losses_are_per_sequence():
    """A sequence keeps the same tokens, and scores the same balance loss, whatever shares its batch: here
    a collapsed sequence next to a random one, routed together and apart."""
    gen = torch.Generator().manual_seed(2)
    random_seq = torch.randn(1, 16, 4, generator=gen)
    collapsed = torch.zeros(1, 16, 4)
    collapsed[..., 0] = 10.0
    both = moe.route(torch.cat([random_seq, collapsed]), 2, 1.0)
    alone = [moe.route(s, 2, 1.0) for s in (random_seq, collapsed)]
    for i, r in enumerate(alone):
        assert torch.equal(both.keep[i], r.keep[0])
    assert both.aux.item() == pytest.approx((alone[0].aux.item() + alone[1].aux.item()) / 2, rel=1e-6)
    assert both.z.item() == pytest.approx((alone[0].z.item() + alone[1].z.item()) / 2, rel=1e-6)
    assert not alone[1].keep.all() and alone[1].keep[0, :8].all()  # capacity 8 of expert 0: first come


@pytest.mark.parametrize("swiglu", [False, True], ids=["gelu", "swiglu"])
def test_layer_is_the_routed_sum_of_expert_mlps(swiglu):
    """The permuted, batched computation equals the definition token by token: out = sum over the token's
    kept choices of weight x that expert's MLP (GELU for GPT-2, SwiGLU for Llama), 0 for dropped ones."""
    m = layer(swiglu=swiglu, E=4, k=2, c=1.0, seed=3)
    x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(4))
    out = m(x)
    r = moe.route(torch.nn.functional.linear(x, m.router.weight), 2, 1.0)
    assert not r.keep.all()  # some dropped, so the check covers them
    want = torch.zeros_like(x)
    for b in range(2):
        for t in range(12):
            for j in range(2):
                if r.keep[b, t, j]:
                    want[b, t] += r.weights[b, t, j] * expert_mlp(m, int(r.experts[b, t, j]), x[b, t][None])[0]
    assert torch.allclose(out, want, atol=1e-6)


def expert_mlp(m: moe.MoE, e: int, x: torch.Tensor) -> torch.Tensor:
    return m.experts.mlp(m.experts.c_fc.layers()[e], m.experts.c_proj.layers()[e], x)


def expert_share(model: gpt.GPT, idx: torch.Tensor) -> list[float]:
    """Each MoE layer's largest share of the assignments of a forward of idx (1: all to one expert)."""
    with torch.no_grad():
        model(idx, idx)
    return [(m.load.max() / m.load.sum()).item() for m in model.modules() if isinstance(m, moe.MoE)]


def collapsed_model(vocab: int, capacity_factor: float) -> tuple[gpt.GPTConfig, gpt.GPT]:
    """tiny with E 4, k 1, every router collapsed onto expert 0: ln_2 makes feature 0 large, each router reads it."""
    cfg = gpt.config_from_preset("tiny", vocab, moe_experts=4, moe_top_k=1, moe_capacity_factor=capacity_factor)
    model = gpt.build(cfg, seed=0)
    with torch.no_grad():
        for block in model.transformer.h:
            block.ln_2.bias[0] = 3.0
            block.mlp.router.weight[0, 0] = 1.0
    return cfg, model


def test_aux_loss_pulls_a_collapsed_router_back_to_balance(corpus):
    """Routers seeded to send every token to expert 0 (ln_2 makes feature 0 large, each router reads it),
    trained 30 steps on the corpus (AdamW, the routers only: the rest frozen, so what moves them is their
    own objective): with the load-balancing loss the largest expert's share falls to near 1/E in every
    layer; without it, no layer gets close (the language-model loss alone does not balance)."""
    data = torch.tensor(list(open(corpus["data"], "rb").read()[:8 * 33]), dtype=torch.long).view(8, 33)
    shares = {}
    for a in (1.0, 0.0):
        _, model = collapsed_model(256, capacity_factor=0)
        before = expert_share(model, data[:, :-1])
        opt = torch.optim.AdamW([p for n, p in model.named_parameters() if "router" in n], lr=0.01, weight_decay=0)
        for step in range(30):
            batch = data[step % 2 * 4:step % 2 * 4 + 4]
            _, loss = model(batch[:, :-1], batch[:, 1:])
            aux, _, _ = moe.router_losses(model)
            (loss + a * aux).backward()
            opt.step()
            opt.zero_grad()
        shares[a] = before, expert_share(model, data[:, :-1])
    (before_on, on), (before_off, off) = shares[1.0], shares[0.0]
    assert min(before_on) > 0.99 and min(before_off) > 0.99  # collapsed at the start (measured: 1.0, 0.996)
    assert max(on) < 0.4, on  # measured 0.30-0.31; balanced is 0.25
    assert min(off) > 0.5, off  # measured 0.66-0.86


def test_router_losses_reach_the_gradients_without_a_path_to_the_loss(corpus):
    """The router's losses ride the backward of their layer's output (moe.RouterLoss), so back-propagating
    the language-model loss alone (what a pipeline stage or a recomputed block does) gives the gradients of
    loss + a x aux + z x z-loss written out, with the blocks recomputed (--recompute full) or not. Without
    the weights the routers' gradients differ: the router losses are not a rounding error here."""
    data = torch.tensor(list(open(corpus["data"], "rb").read()[:4 * 33]), dtype=torch.long).view(4, 33)

    def grads(recompute: str, weights: tuple[float, float], explicit: bool) -> dict:
        cfg = gpt.config_from_preset("tiny", 256, moe_experts=4, moe_top_k=2, recompute=recompute)
        model = gpt.build(cfg, seed=0)
        moe.train_with(model, *weights)
        moe.begin_step(model, 1.0)
        _, loss = model(data[:, :-1], data[:, 1:])
        if explicit:
            aux, z, _ = moe.router_losses(model)
            loss = loss + 0.5 * aux + 0.1 * z
        loss.backward()
        return {n: p.grad for n, p in model.named_parameters()}

    want = grads("none", (0.0, 0.0), explicit=True)
    for recompute in ("none", "full"):
        got = grads(recompute, (0.5, 0.1), explicit=False)
        for name, g in want.items():
            assert torch.allclose(got[name], g, rtol=1e-5, atol=1e-7), (recompute, name)
    plain = grads("none", (0.0, 0.0), explicit=False)
    router = [n for n in want if "router" in n]
    assert all((plain[n] - want[n]).norm() > 0.01 * want[n].norm() for n in router)


def test_an_moe_layer_compiles_its_routing_and_runs_the_rest_eagerly():
    """Under --compile an MoE layer is one graph, the routing (its shapes fixed), and a call of MoE.send, which
    runs eagerly: what depends on the experts' counts (the splits the host reads) enters no graph, so no graph
    guards on them (test_compiled_moe_blocks_do_not_recompile)."""
    m = layer(E=4, k=2, c=1.0)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(m)(torch.randn(2, 8, 16))
    reasons = [str(b.reason) for b in explained.break_reasons]
    assert explained.graph_count == 1 and len(reasons) == 1, reasons
    assert "torch.compiler.disable" in reasons[0] and "MoE.send" in reasons[0], reasons


def test_parameter_counts():
    """n_params and the active FLOPs of an MoE model, without building one, match the built model."""
    for preset in ("tiny", "llama-tiny"):
        cfg = gpt.config_from_preset(preset, 256, moe_experts=4, moe_top_k=2, moe_every=2)
        dense = gpt.config_from_preset(preset, 256)
        assert gpt.n_params(cfg) == gpt.count_params(gpt.build(cfg, 0))
        mlp = (3 if cfg.llama else 2) * cfg.n_embd * cfg.hidden
        assert gpt.flops_per_token(cfg, 32) - gpt.flops_per_token(dense, 32) == 6 * 2 * (mlp + 4 * cfg.n_embd)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("flags,says", [
    (["--moe-top-k", "1"], "--moe-top-k: only with --moe-experts"),
    (["--ep", "2"], "--ep: only with --moe-experts"),
    (["--moe-experts", "4", "--moe-top-k", "5"], "--moe-top-k 5 is more than the 4 experts"),
    (["--moe-experts", "4", "--ep", "3"], "--ep 3 does not divide the 4 experts"),
    (["--moe-experts", "4", "--tp", "2", "--sp"], "--sp with --moe-experts: not supported yet"),
])
def test_bad_moe_flags_are_one_line(flags, says):
    cfg = config.parse_args(["--device", "cpu", "--preset", "tiny", *flags])
    with pytest.raises(config.ConfigError, match=says.replace("(", r"\(")):
        config.resolve_defaults(cfg, torch.device("cpu"))


def test_bad_expert_layouts(corpus, tmp_path, monkeypatch):
    """One expert is no mixture (the parser), and --ep must divide the data-parallel degree (the layout,
    before any process talks): one line, exit 2."""
    with pytest.raises(SystemExit):
        config.parse_args(["--moe-experts", "1"])
    result = run_train(corpus, tmp_path, "--moe-experts", "4", "--ep", "2", check=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["error: --ep 2 does not divide the data-parallel degree 1 (= 1 "
                                                  "processes / tp*cp*pp): expert-parallel groups are cut out of the "
                                                  "data-parallel ranks"], result.stderr
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(parallel.LayoutError, match="--ep 4 does not divide the data-parallel degree 2"):
        parallel.layout(2, 1, torch.device("cpu"), ep=4)


# ----------------------------------------------------------------------------- layouts

MOE = ["--moe-experts", "4"]
DROP = ["--moe-capacity-factor", "1.0"]  # capacity 16 of a sequence's 64 assignments per expert: some dropped
NO_DROP = ["--moe-capacity-factor", "0"]
LAYOUTS = {
    "dp2-accum-zero1": (2, DROP, ["--micro-batch-size", "2", "--zero", "1"]),
    "ep2": (2, DROP, ["--ep", "2"]),
    "tp2xep2": (4, DROP, ["--tp", "2", "--ep", "2"]),  # experts replicated over tp, split over ep
    "ep4-accum-zero1": (4, DROP, ["--ep", "4", "--micro-batch-size", "1", "--zero", "1"]),
    "ep2xdp4-nodrop-zero2": (4, NO_DROP, ["--ep", "2", "--micro-batch-size", "1", "--zero", "2", "--memory-report"]),
    "pp2xep2-1f1b": (4, DROP, ["--pp", "2", "--ep", "2", "--micro-batch-size", "1"]),
    "tp2xpp2-recompute": (4, DROP, ["--tp", "2", "--pp", "2", "--micro-batch-size", "2", "--recompute", "full"]),
    "ep2-nodrop-recompute": (2, NO_DROP, ["--ep", "2", "--micro-batch-size", "2", "--recompute", "full"]),
    "ep2xdp4-zero3": (4, DROP, ["--ep", "2", "--zero", "3", "--memory-report"]),  # experts: a unit apiece
    "cp2-ring": (2, DROP, ["--cp", "2"]),  # capacity over whole sequences: every cp rank gathers the choices
    "cp2xep2-ulysses-zero1": (4, DROP, ["--cp", "2", "--ep", "2", "--cp-attn", "ulysses", "--zero", "1"]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_expert_layout_reproduces_single_process(layout, references, corpus, tmp_path):
    """Losses, gradient norms, router losses, the dropped fraction and final weights (the expert shards
    consolidated) of one process, at every layout. ep2xdp4 averages expert gradients over edp (2 of the 4
    dp ranks): averaging them over all of dp, the classic bug, mixes different experts and fails it. Under
    ZeRO the expert state is sharded over edp, the rest over dp: the memory report's formulas hold."""
    nproc, capacity, flags = LAYOUTS[layout]
    result = run_train(corpus, tmp_path, *STEPS, *MOE, *capacity, *flags, "--comm-report", nproc=nproc)
    reference = references(*MOE, *capacity)  # the single-process run, once per capacity
    assert_same_run(reference, tmp_path)
    for ref, got in zip(reference[0], metrics(tmp_path)):
        for key in ("moe_aux", "moe_z"):
            assert got[key] == pytest.approx(ref[key], rel=1e-5), (got["step"], key)
        assert got["moe_dropped"] == pytest.approx(ref["moe_dropped"], abs=1e-7)
        assert (got["moe_dropped"] > 0) == (capacity is DROP)
    assert "formula matches measurement on every rank: yes" in result.stdout, result.stdout[-3000:]
    if "--memory-report" in flags:
        for kind in ("weights", "gradients", "optimizer"):
            lines = memory_lines(result.stdout, kind)
            assert len(lines) == nproc and all(ln.endswith("yes") for ln in lines), lines
    if capacity is NO_DROP and "--ep" in flags:  # the closed form: 4 all-to-alls of b T k C fp32 per layer
        b, T, k, C, E, layers = int(flags[flags.index("--micro-batch-size") + 1]), 32, 2, 64, 4, 4
        n_micro = 8 // (nproc * b)
        passes = 3 if "full" in flags else 2  # forward, backward; --recompute full: the forward's again
        want = n_micro * layers * (2 * passes * b * T * k * C * 4 + E * 8 * (passes - 1))
        row = next(ln.split() for ln in result.stdout.splitlines() if ln.strip().startswith("all_to_all"))
        assert int(row[3].replace(",", "")) == want, row  # rank 0's; every rank's: the formula's line above
        assert math.isclose(int(row[-1].replace(",", "")), want / 2, abs_tol=1)  # (ep-1)/ep on the links


def test_a_checkpoint_saved_at_ep2_resumes_at_ep1(references, corpus, tmp_path):
    """Saved at --ep 2 with ZeRO-1 (each rank its half of every expert stack, described by its slice, and
    its flat pieces of the optimizer state), resumed on one process without ZeRO, where each stack is whole
    again: the run goes on as if it had never changed layout."""
    run_train(corpus, tmp_path, *STEPS, *MOE, *DROP, "--ep", "2", "--zero", "1", "--max-steps", "2",
              "--ckpt-every", "2", nproc=2)
    resumed = run_train(corpus, tmp_path, *STEPS, *MOE, *DROP).stdout
    assert "resume: layout {'dp': 2, 'tp': 1, 'pp': 1, 'ep': 2} -> {'dp': 1, 'tp': 1, 'pp': 1}" in resumed, resumed
    assert_same_run(references(*MOE, *DROP), tmp_path)
    sampled = subprocess.run([sys.executable, str(ROOT / "sample.py"), "--ckpt", str(tmp_path / "ckpt"), "--device",
                              "cpu", "--tokens", "8"], capture_output=True, text=True, cwd=ROOT)
    assert sampled.returncode == 0 and "4-layer model, byte tokenizer" in sampled.stderr, sampled.stderr
    assert sampled.stdout.strip(), "no text sampled"


def test_a_checkpoint_saved_at_ep2_zero3_resumes_at_ep4(references, corpus, tmp_path):
    """Saved at --ep 2 under ZeRO-3 (each expert stack a unit of its own, sharded over edp), resumed on four
    processes at --ep 4 with ZeRO-1, where each rank holds a quarter of every stack: the same run."""
    run_train(corpus, tmp_path, *STEPS, *MOE, *DROP, "--ep", "2", "--zero", "3", "--max-steps", "2",
              "--ckpt-every", "2", nproc=2)
    resumed = run_train(corpus, tmp_path, *STEPS, *MOE, *DROP, "--ep", "4", "--zero", "1", nproc=4).stdout
    assert "resume: layout {'dp': 2, 'tp': 1, 'pp': 1, 'ep': 2} -> {'dp': 4, 'tp': 1, 'pp': 1, 'ep': 4}" in resumed, \
        resumed
    assert_same_run(references(*MOE, *DROP), tmp_path)


def test_the_grid_cuts_expert_groups_out_of_data_parallel_ranks():
    """dp 4 x tp 2 with --ep 2: ep groups of consecutive dp ranks, edp the same place in each; an expert's
    weights count (norm, checkpoint) on tp rank 0 of the first ep group, or (ZeRO, the norm of shards) on
    every tp rank 0."""
    grids = [parallel.Grid(dp=4, tp=2, ep=2, rank=r) for r in range(8)]
    assert [(g.dp_rank, g.ep_rank, g.edp_rank) for g in grids[::2]] == [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]
    expert = torch.nn.Parameter(torch.zeros(1))
    parallel.place(expert, replicas="edp", split=("ep",))
    assert [g.rank for g in grids if g.owns(expert)] == [0, 2]
    assert [g.rank for g in grids if g.owns(expert, replicated_over_dp=False)] == [0, 2, 4, 6]
    assert "expert parallel (ep 2): {dp 0 dp 1} {dp 2 dp 3}" in str(grids[0])
    # with cp 2 an ep group shares a cp rank, and edp spans the cp ranks: dp 4 x cp 2, ep 2 -> edp of 4
    grids = [parallel.Grid(dp=4, cp=2, ep=2, rank=r) for r in range(8)]
    assert [(g.dp_rank, g.cp_rank, g.ep_rank, g.edp_rank) for g in grids] == [
        (0, 0, 0, 0), (0, 1, 0, 1), (1, 0, 1, 0), (1, 1, 1, 1), (2, 0, 0, 2), (2, 1, 0, 3), (3, 0, 1, 2), (3, 1, 1, 3)]
    assert grids[0].size("edp") == 4 and [g.rank for g in grids if g.owns(expert)] == [0, 2]


# ----------------------------------------------------------------------------- the device: dtypes, reads, failures


@contextlib.contextmanager
def device_reads(device: torch.device):
    """Counts what makes the host wait for the device inside the block. On CUDA, CUDA's own sync debug mode;
    elsewhere a stand-in that counts the Python calls that would wait there: a read of values (tolist, item),
    a Python list copied to the device, repeat_interleave without its output size."""
    seen = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield seen
            finally:
                torch.cuda.set_sync_debug_mode(0)
        seen += [str(w.message) for w in caught if "synchroniz" in str(w.message)]
        return
    T, originals = torch.Tensor, (torch.Tensor.tolist, torch.Tensor.item, torch.tensor, torch.Tensor.repeat_interleave)

    def counted(name, fn, waits=lambda *a, **kw: True):
        return lambda *a, **kw: (seen.append(name) if waits(*a, **kw) else None, fn(*a, **kw))[1]
    T.tolist, T.item = counted("tolist", originals[0]), counted("item", originals[1])
    torch.tensor = counted("a list to the device", originals[2], lambda *a, **kw: kw.get("device") is not None)
    T.repeat_interleave = counted("repeat_interleave", originals[3], lambda *a, **kw: "output_size" not in kw)
    try:
        yield seen
    finally:
        T.tolist, T.item, torch.tensor, T.repeat_interleave = originals


def check_exchange(device: str) -> None:
    """An MoE layer whose rows go through expert parallelism's exchange (a 1-rank ep group: the same path, each
    all-to-all a copy), under autocast in bf16, fed what a block feeds it: a LayerNorm's output, in fp32 (CUDA's
    autocast keeps layer_norm in fp32; the experts' matmuls return bf16). Its output and every gradient equal the
    plain layer's, bit for bit; the rows cross in bf16, the counts in int64; and each forward, plain or
    exchanged, waits for the device once (tests/test_gpu.py runs it on a GPU)."""
    dev = torch.device(device)
    grid, sent = parallel.Grid(device=dev), []
    a2a = grid.all_to_all
    grid.all_to_all = lambda out, inp, group, **kw: (sent.append(inp.dtype), a2a(out, inp, group, **kw))[1]
    x = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(5)).to(dev)
    runs = []
    for exchange in (None, moe.ExpertParallel(grid)):
        m = layer(E=4, k=2, c=1.0).to(dev)
        m.exchange, h = exchange, x.clone().requires_grad_()
        with torch.autocast(dev.type, torch.bfloat16):
            normed = F.layer_norm(h, (16,))
            with device_reads(dev) as reads:
                out = m(normed)
        out.float().square().sum().backward()
        runs.append([out, h.grad, *(p.grad for p in m.parameters())])
        assert len(reads) == 1, reads  # the one read of the device per forward
    assert normed.dtype == torch.float32 and out.dtype == torch.bfloat16
    assert sent == [torch.int64] + [torch.bfloat16] * 4, sent  # counts; rows and gradients, both ways
    for plain, exchanged in zip(*runs, strict=True):
        assert torch.equal(plain, exchanged)


def test_the_exchange_sends_rows_in_the_compute_dtype_and_reads_the_device_once():
    """check_exchange on the CPU; and experts that return another dtype than the rows they were given (CUDA's
    autocast does that where CPU's does not: there index_copy promotes) still give the plain layer's output."""
    check_exchange("cpu")
    m = layer(E=4, k=2, c=1.0)
    x = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(6))
    forward = m.experts.forward
    m.experts.forward = lambda rows, counts: forward(rows, counts).bfloat16()  # fp32 rows in, bf16 out
    plain = m(x)
    m.exchange = moe.ExpertParallel(parallel.Grid())
    assert plain.dtype == torch.bfloat16 and torch.equal(m(x), plain)


def test_under_bf16_the_rows_cross_in_two_bytes_as_the_formula_says(corpus, tmp_path):
    """--precision bf16 at --ep 2 without dropping: the all-to-alls carry b T k C rows in bf16 (half of fp32's
    bytes), and --comm-report's formula says the same, byte for byte; every other row of the report is fp32."""
    result = run_train(corpus, tmp_path, *MOE, *NO_DROP, "--ep", "2", "--precision", "bf16", "--max-steps", "1",
                       "--comm-report", nproc=2)
    b, T, k, C, E, layers = 4, 32, 2, 64, 4, 4
    want = layers * (4 * b * T * k * C * 2 + E * 8)  # 4 all-to-alls of rows a layer, and the counts
    row = next(ln.split() for ln in result.stdout.splitlines() if ln.strip().startswith("all_to_all"))
    assert row[2:6] == ["20", f"{want:,}", f"{want:,}", "yes"], row
    assert "formula matches measurement on every rank: yes" in result.stdout, result.stdout[-3000:]


def test_a_rank_whose_experts_get_no_rows_still_counts_its_own():
    """A rank whose experts nobody routes to runs them on no rows, and its combine sends back 0 rows of which
    5 arrive: its own tokens' rows, which the formula counts (C x 4 bytes each), as the dispatch's backward."""
    counted = []
    grid = parallel.Grid(dp=2, ep=2)
    grid.all_to_all = lambda out, inp, group, nbytes, **kw: counted.append(nbytes)
    y = torch.zeros(0, 16, requires_grad=True)  # what this rank's experts made: nothing
    moe.AllToAll.apply(y, grid, [0, 0], [3, 2], 5).sum().backward()
    assert counted == [5 * 16 * 4] * 2, counted


class FailedGroup:
    """A process group as NCCL leaves it when its watchdog aborted a collective: it reports the error."""

    def _get_backend(self, device):
        return type("Backend", (), {"get_error": lambda self: type("Error", (), {"name": "TIMEOUT"})()})()


def test_a_failed_count_exchange_is_a_peer_error_not_garbage_splits(monkeypatch):
    """On NCCL a collective that failed (a dead peer; the watchdog aborted it) lets the device pass it, with
    whatever its output held. The counts that arrive are the splits of the rows: read from garbage they ask
    for negative or huge allocations, a traceback. With stand-ins for CUDA's event, a failed group and an
    all-to-all that leaves garbage, the dispatch is one PeerError (train.py: exit status 3) instead."""

    class Event:  # the device has passed the failed collective
        def record(self):
            pass

        def query(self):
            return True
    monkeypatch.setattr(torch.cuda, "Event", Event)
    grid = parallel.Grid(dp=2, ep=2, device=torch.device("cuda"), groups={"ep": FailedGroup()}, members={"ep": (0, 1)})
    monkeypatch.setattr(grid, "all_to_all", lambda out, inp, group, **kw: out.fill_(-(2 ** 40)))  # garbage
    m = layer(E=4, k=2, c=1.0)
    m.grid, m.exchange = grid, moe.ExpertParallel(grid)
    with pytest.raises(interrupt.PeerError, match=r"NCCL reports TIMEOUT in a collective over ep \(ranks 0, 1\)"):
        m(torch.randn(2, 8, 16))


def test_a_rank_dying_in_the_dispatch_stops_the_other_with_one_line(corpus, tmp_path):
    """--ep 2 on two processes, no launcher: rank 1 SIGKILLs itself inside an MoE layer's dispatch (its
    counts exchanged, its rows not yet sent) at step 2. Rank 0 says so in one line, exit status 3."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dying = (f"import os, signal, sys; sys.path.insert(0, {str(ROOT)!r}); import moe, train\n"
             "calls, forward = [0], moe.AllToAll.forward\n"
             "def dies(ctx, *args):\n"
             "    calls[0] += 1  # 8 a step: 4 layers, dispatch and combine\n"
             "    if os.environ['RANK'] == '1' and calls[0] == 9:\n"
             "        os.kill(os.getpid(), signal.SIGKILL)\n"
             "    return forward(ctx, *args)\n"
             "moe.AllToAll.forward = staticmethod(dies)\n"
             "train.main(sys.argv[1:])\n")
    procs = []
    for rank in range(2):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-c", dying, "--data", corpus["data"], "--cache-dir", corpus["cache"], "--out",
               str(tmp_path), *TINY, *MOE, "--ep", "2", "--max-steps", "20", "--timeout", "30"]
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    try:
        _, err = procs[0].communicate(timeout=240)
        procs[1].wait(timeout=30)
    finally:
        for proc in procs:
            proc.kill()
    assert procs[1].returncode == -signal.SIGKILL
    assert procs[0].returncode == 3, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith("error: rank 0, ") and "over ep (ranks 0, 1)" in lines[0], err
    assert ": a peer process failed or timed out (" in lines[0] and "Traceback" not in err, err[-3000:]


def test_compiled_moe_blocks_do_not_recompile():
    """The blocks of a tiny MoE model compiled as train.py compiles them, trained 50 steps of 2 micro-batches
    with an evaluation every 10: the routing changes every forward, and with it how many rows each expert
    takes. What depends on those counts runs eagerly (moe.py), so the blocks compile their graphs in the first
    step (the block up to its MoE, the routing, the rest of the block) and again for the first evaluation
    (no_grad), and never after. Before, the graph after the read guarded on the counts: a new one nearly
    every forward, until Dynamo's limit of 8 left the layer eager. (Counted by a backend that runs the
    graphs as traced: the guards that decide a recompilation are Dynamo's, whatever the backend.)"""
    graphs, made = [], []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    torch._dynamo.reset()
    cfg = gpt.config_from_preset("tiny", 256, moe_experts=4, moe_top_k=2, moe_capacity_factor=1.0)
    model = gpt.build(cfg, seed=0)
    for block in model.transformer.h:
        block.compile(backend=backend)
    moe.train_with(model, 1e-2, 1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randint(0, 256, (50, 2, 4, 17), generator=torch.Generator().manual_seed(0))
    for step in range(50):
        moe.begin_step(model, 0.5)
        for micro in data[step]:
            _, loss = model(micro[:, :-1], micro[:, 1:])
            (loss / 2).backward()
        opt.step()
        opt.zero_grad()
        if step % 10 == 9:
            with torch.no_grad():
                model.eval()
                model(data[step, 0, :, :-1], data[step, 0, :, 1:])
                model.train()
        made.append(len(graphs))
    assert made[0] == made[8] and made[9] == made[-1] and made[-1] <= 6, made  # measured: 3, then 6
