"""Mixture of experts (moe.py): routing, capacity and dropping, the router losses, and expert parallelism
proven like every other layout: the same command at dp, with micro-batches and at --ep 2 and 4 gives the
single-process run's losses and weights (fp32, gloo, CPU), with capacity dropping on and off, and the
all-to-alls move the bytes of the formula on every rank."""

import math
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, STEPS, metrics, run_train
from test_parallel import assert_same_run, memory_lines

import config
import model as gpt
import moe
import parallel

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


def test_an_moe_layer_compiles_to_two_graphs():
    """Under --compile an MoE layer breaks its graph once, where the host reads the experts' counts (the
    splits need them; moe.py): two graphs, one break, and that break's reason is the read of the device."""
    m = layer(E=4, k=2, c=1.0)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(m)(torch.randn(2, 8, 16))
    reasons = [str(b.reason) for b in explained.break_reasons]
    assert (explained.graph_count, explained.graph_break_count) == (2, 1), reasons
    assert "tolist" in reasons[0] or "item" in reasons[0] or "data-dependent" in reasons[0].lower(), reasons


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
    expert.expert = True
    assert [g.rank for g in grids if g.owns(expert)] == [0, 2]
    assert [g.rank for g in grids if g.owns(expert, replicated_over_dp=False)] == [0, 2, 4, 6]
    assert "expert parallel (ep 2): {dp 0 dp 1} {dp 2 dp 3}" in str(grids[0])
    # with cp 2 an ep group shares a cp rank, and edp spans the cp ranks: dp 4 x cp 2, ep 2 -> edp of 4
    grids = [parallel.Grid(dp=4, cp=2, ep=2, rank=r) for r in range(8)]
    assert [(g.dp_rank, g.cp_rank, g.ep_rank, g.edp_rank) for g in grids] == [
        (0, 0, 0, 0), (0, 1, 0, 1), (1, 0, 1, 0), (1, 1, 1, 1), (2, 0, 0, 2), (2, 1, 0, 3), (3, 0, 1, 2), (3, 1, 1, 3)]
    assert grids[0].size("edp") == 4 and [g.rank for g in grids if g.owns(expert)] == [0, 2]
