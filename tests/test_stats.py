"""Per-layer statistics (stats.py): the right numbers, the same at every layout, and free of side effects.

* One process, in-process: each layer's gradient norm, update/weight ratio and activation RMS equal
  what plain torch computes from the same step (recomputed blocks counted once).
* Every layout: the `layers` rows of a tp x pp run, a ZeRO-2 run and a context-parallel run equal the
  single-process run's within fp32 rounding (the rule of tests/test_parallel.py: 1e-4 relative).
* The training math is untouched: losses, gradient norms and final weights with statistics every
  step are bitwise those of a run without them.
* A rollback or resume drops the `layers` rows of the steps it replays, and keeps every other event.
* With experts: each MoE block's load per expert and dropped share are what its router chose, counted by
  hand from its inputs over a step's micro-batches; a collapsed router shows as one expert near 1; each
  assignment counts once (not again in a recomputed forward, not on tp ranks but 0); and at dp 2 with
  --ep 2 (and micro-batches) and at tp 2 they are exactly the single process's.
"""

import json
import math

import pytest
import torch
from conftest import final_weights, metrics, run_train
from test_moe import collapsed_model

import model as gpt
import parallel
from instruments import stats
from support import rundir

STEPS = ["--max-steps", "4", "--ckpt-every", "0", "--stats-every", "1"]
LAYOUTS = {
    "tp2xpp2": (4, ["--tp", "2", "--pp", "2", "--micro-batch-size", "2"]),
    "dp2-zero2": (2, ["--zero", "2"]),
    "cp2": (2, ["--cp", "2"]),  # the cp rank that owns no weights; activations cut along the sequence
}


def layer_rows(out) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("event") == "layers"]


@pytest.fixture(scope="module")
def single(corpus, tmp_path_factory):
    """One process with statistics every step, and the same run without them."""
    on, off = tmp_path_factory.mktemp("stats_on"), tmp_path_factory.mktemp("stats_off")
    run_train(corpus, on, *STEPS)
    run_train(corpus, off, *STEPS[:-1], "0")
    return on, off


def stats_step(layer_stats: stats.LayerStats, model: gpt.GPT, opt, batches: list[torch.Tensor], n: int = 1):
    """Step n, as train.py runs it: a forward and backward per micro-batch of `batches`, the update; its row."""
    layer_stats.begin(n)
    for x in batches:
        _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
    layer_stats.after_grads()
    opt.step()
    layer_stats.finish(updated=True)
    return layer_stats.pop_row()


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_statistics_are_what_torch_computes(recompute):
    torch.manual_seed(0)
    cfg = gpt.config_from_preset("tiny", 257, recompute=recompute)
    model = gpt.build(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    layer_stats = stats.LayerStats(model, parallel.Grid(), None, opt, cfg.n_layer, every=2)
    outputs = {}
    blocks = [(f"h.{i}", block) for i, block in enumerate(model.transformer.h)]
    for name, module in [("embed", model.transformer.drop)] + blocks:
        module.register_forward_hook(lambda m, a, out, name=name: outputs.update({name: out.detach().clone()}))
    x = torch.randint(0, 257, (2, 17))

    def step(n: int) -> dict | None:
        return stats_step(layer_stats, model, opt, [x], n)

    assert step(1) is not None and step(3) is None  # step 1 and every 2nd: not step 3
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.zero_grad()
    outputs.clear()
    row = step(4)
    assert row["event"] == "layers" and row["step"] == 4
    assert list(row["grad_norm"]) == ["embed", "h.0", "h.1", "h.2", "h.3", "ln_f"]
    for layer in row["grad_norm"]:
        names = [n for n, _ in model.named_parameters() if stats.layer_of(n) == layer]
        grad = math.sqrt(sum(model.get_parameter(n).grad.double().pow(2).sum().item() for n in names))
        delta = math.sqrt(sum((model.get_parameter(n) - before[n]).double().pow(2).sum().item() for n in names))
        weight = math.sqrt(sum(before[n].double().pow(2).sum().item() for n in names))
        assert row["grad_norm"][layer] == pytest.approx(grad, rel=1e-6), layer
        assert row["update_ratio"][layer] == pytest.approx(delta / weight, rel=1e-5), layer
    assert list(row["act_rms"]) == ["embed", "h.0", "h.1", "h.2", "h.3"]  # ln_f's output is normalized anyway
    for layer, out in outputs.items():
        assert row["act_rms"][layer] == pytest.approx(out.double().pow(2).mean().sqrt().item(), rel=1e-6), layer
    # each output counted once: a block recomputed for its backward runs its forward a second time
    assert layer_stats.act_n.tolist() == [x[:, :-1].numel() * cfg.n_embd] * 5 + [0]
    assert "moe_load" not in row and "moe_dropped" not in row  # a dense model's rows are as they were


# ----------------------------------------------------------------------------- experts


def moe_step(cfg: gpt.GPTConfig, model: gpt.GPT, batches: list[torch.Tensor]) -> dict:
    """A statistics step of `model` on its own, over `batches` (micro-batches)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return stats_step(stats.LayerStats(model, parallel.Grid(), None, opt, cfg.n_layer, every=1), model, opt, batches)


def test_expert_load_is_what_the_routers_chose():
    """E 4, k 2, capacity factor 1 (ceil(1 x 16 x 2 / 4) = 8 assignments per expert and sequence), MoE in
    blocks 1 and 3, two micro-batches: each MoE block's shares and dropped fraction are counted here from the
    router's own logits on the block's inputs (top 2 of x W_r^T; dropped: per sequence and expert, what is
    over 8), summed over both micro-batches."""
    cfg = gpt.config_from_preset("tiny", 257, moe_experts=4, moe_top_k=2, moe_every=2, moe_capacity_factor=1.0)
    model = gpt.build(cfg, seed=0)
    logits = {}  # each MoE's router logits, x W_r^T, on each micro-batch's input (before the update moves W_r)
    for i in (1, 3):
        model.transformer.h[i].mlp.register_forward_hook(
            lambda m, args, out, i=i: logits.setdefault(f"h.{i}", []).append((args[0] @ m.router.weight.T).detach()))
    gen = torch.Generator().manual_seed(1)
    row = moe_step(cfg, model, [torch.randint(0, 257, (2, 17), generator=gen) for _ in range(2)])
    assert list(row["moe_load"]) == list(row["moe_dropped"]) == ["h.1", "h.3"]
    for name, per_micro in logits.items():
        per_seq = torch.stack([torch.bincount(seq.topk(2, -1).indices.flatten(), minlength=4)
                               for seq in torch.cat(per_micro)])  # (4 sequences, 4 experts): assignments
        assert per_seq.sum() == 4 * 16 * 2
        want_load = (per_seq.sum(0) / per_seq.sum()).tolist()
        want_dropped = (per_seq - 8).clamp(min=0).sum().item() / per_seq.sum().item()
        assert row["moe_load"][name] == pytest.approx(want_load, abs=1e-12), name
        assert row["moe_dropped"][name] == pytest.approx(want_dropped, abs=1e-12), name
        assert 0 < want_dropped < 0.5  # some dropped, so the check covers them


def test_a_collapsed_router_shows_one_expert_near_all_of_the_load():
    """tests/test_moe.py's seeded collapse (ln_2 makes feature 0 large, every router reads it): expert 0 takes
    nearly every assignment in every block, and capacity (a quarter of each sequence) drops nearly 3/4."""
    cfg, model = collapsed_model(257, capacity_factor=1.0)
    row = moe_step(cfg, model, [torch.randint(0, 257, (4, 33), generator=torch.Generator().manual_seed(2))])
    assert list(row["moe_load"]) == ["h.0", "h.1", "h.2", "h.3"]
    for name, load in row["moe_load"].items():
        assert sum(load) == pytest.approx(1.0) and load[0] > 0.99 and load.index(max(load)) == 0, (name, load)
        assert 0.74 < row["moe_dropped"][name] <= 0.75, name


def test_each_assignment_is_counted_once():
    """The counts under the shares: a block recomputed for its backward (--recompute full) routes its tokens
    a second time, which is not counted; a tensor-parallel rank other than 0 routes the same tokens as rank 0
    (experts and router replicated over tp), and counts none of them."""
    cfg = gpt.config_from_preset("tiny", 257, moe_experts=4, moe_top_k=2, moe_capacity_factor=1.0, recompute="full")
    model = gpt.build(cfg, seed=0)
    x = torch.randint(0, 257, (2, 17), generator=torch.Generator().manual_seed(3))
    for rank, counted in ((0, 2 * 16 * 2), (1, 0)):  # tp rank 0: B T k assignments in each block; rank 1: none
        layer_stats = stats.LayerStats(model, parallel.Grid(tp=2, rank=rank), None, None, cfg.n_layer, every=1)
        layer_stats.begin(1)
        model(x[:, :-1], x[:, 1:])[1].backward()
        assert layer_stats.moe_count[:, :-1].sum(1).tolist() == [counted] * 4, rank


MOE = ["--moe-experts", "4", "--moe-capacity-factor", "1.0"]  # tiny: every block an MoE, some tokens dropped
MOE_LAYOUTS = {
    "dp2-ep2-accum": (2, ["--ep", "2", "--micro-batch-size", "2"]),  # each rank its tokens, in 2 micro-batches
    "tp2": (2, ["--tp", "2"]),  # experts and router replicated over tp: tp rank 0's count only
}


@pytest.fixture(scope="module")
def moe_single(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("stats_moe")
    run_train(corpus, out, *STEPS, *MOE)
    return out


@pytest.mark.parametrize("layout", MOE_LAYOUTS)
def test_expert_load_is_the_single_process_one(layout, moe_single, corpus, tmp_path):
    """The same routing at every layout (moe.py: capacity is per sequence), so the same counts: each block's
    shares and dropped fraction equal one process's exactly, and its other statistics within fp32 rounding."""
    nproc, flags = MOE_LAYOUTS[layout]
    run_train(corpus, tmp_path, *STEPS, *MOE, *flags, nproc=nproc)
    ref, got = layer_rows(moe_single), layer_rows(tmp_path)
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [1, 2, 3, 4]
    for a, b in zip(ref, got):
        assert list(b["moe_load"]) == list(a["moe_load"]) == ["h.0", "h.1", "h.2", "h.3"]
        for layer, load in a["moe_load"].items():
            assert b["moe_load"][layer] == pytest.approx(load, abs=1e-12), f"step {a['step']} {layer}"
            assert b["moe_dropped"][layer] == pytest.approx(a["moe_dropped"][layer], abs=1e-12)
            assert len(load) == 4 and sum(load) == pytest.approx(1.0)
        assert any(v > 0 for v in a["moe_dropped"].values())
        for stat in ("grad_norm", "act_rms"):
            for layer, value in a[stat].items():
                assert b[stat][layer] == pytest.approx(value, rel=1e-4), f"step {a['step']} {stat} {layer}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layer_statistics_are_the_single_process_ones(layout, single, corpus, tmp_path):
    nproc, flags = LAYOUTS[layout]
    run_train(corpus, tmp_path, *STEPS, *flags, nproc=nproc)
    ref, got = layer_rows(single[0]), layer_rows(tmp_path)
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [1, 2, 3, 4]
    for a, b in zip(ref, got):
        for stat in ("grad_norm", "update_ratio", "act_rms"):
            assert b[stat].keys() == a[stat].keys()
            for layer, value in a[stat].items():
                assert b[stat][layer] == pytest.approx(value, rel=1e-4), f"step {a['step']} {stat} {layer}"


def test_per_layer_gradient_norms_make_up_the_global_one(single):
    steps = {r["step"]: r for r in metrics(single[0])}
    for row in layer_rows(single[0]):
        total = math.sqrt(sum(v * v for v in row["grad_norm"].values()))
        assert total == pytest.approx(steps[row["step"]]["grad_norm"], rel=1e-5)


def test_statistics_do_not_change_the_training(single):
    on, off = single
    assert [(r["loss"], r["grad_norm"], r.get("val_loss")) for r in metrics(on)] == \
        [(r["loss"], r["grad_norm"], r.get("val_loss")) for r in metrics(off)]
    assert layer_rows(on) and not layer_rows(off)
    a, b = final_weights(on), final_weights(off)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_replayed_steps_lose_their_layer_rows(tmp_path):
    m = rundir.Metrics(tmp_path / "metrics.jsonl", enabled=True, resume_step=0)
    for step in range(1, 5):
        m.log(step=step, loss=1.0)
        m.log(event="layers", step=step, grad_norm={"h.0": 1.0})
    m.log(event="checkpoint", step=4)
    m.truncate(2)  # a rollback (or a resume) to step 2
    kept = [(r.get("event"), r["step"]) for r in m.rows()]
    assert kept == [(None, 1), ("layers", 1), (None, 2), ("layers", 2), ("checkpoint", 4)]


# ----------------------------------------------------------------------------- what a statistics step holds


@pytest.mark.parametrize("rank", [0, 1])
def test_a_statistics_step_adds_a_share_of_the_weights_on_every_data_parallel_rank(rank):
    """A statistics step holds a copy of the weights it counts across the update (for ||ΔW||). Each rank
    of dp 2 counts a share of the replicated weights, so its step's peak (every allocation and free, from
    the profiler) is at most a plain step's plus 4 bytes per parameter / dp, one tensor more and 16 KiB.
    Before: dp rank 0 counted, and copied, every weight (+4 bytes per parameter on it alone)."""
    from setup_memory import allocations, peak_apart_from
    from torch.profiler import ProfilerActivity, profile

    cfg = gpt.config_from_preset("tiny", 257)
    model = gpt.build(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    grid = parallel.Grid(dp=2, rank=rank)  # a rank of a data-parallel job, without a process group
    grid.all_reduce = lambda *args, **kwargs: None  # (the sum over ranks: not what is measured here)
    layer_stats = stats.LayerStats(model, grid, None, opt, cfg.n_layer, every=2)
    x = torch.randint(0, 257, (2, 17), generator=torch.Generator().manual_seed(0))
    stats_step(layer_stats, model, opt, [x], 1)  # the first: AdamW allocates its moments

    def peak(n: int) -> int:
        opt.zero_grad()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            stats_step(layer_stats, model, opt, [x], n)
        return peak_apart_from(allocations(prof, "cpu"), set())

    plain, with_stats = peak(3), peak(4)
    params = [p.numel() * 4 for p in model.parameters()]
    bound = plain + sum(params) // 2 + max(params) + 16 * 2**10
    assert with_stats <= bound, f"rank {rank}: {with_stats:,} bytes at the peak of a statistics step, bound {bound:,}"
