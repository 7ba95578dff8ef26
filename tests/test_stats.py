"""Per-layer statistics (stats.py): the right numbers, the same at every layout, and free of side effects.

* One process, in-process: each layer's gradient norm, update/weight ratio and activation RMS equal
  what plain torch computes from the same step (recomputed blocks counted once).
* Every layout: the `layers` rows of a tp x pp run, a ZeRO-2 run and a context-parallel run equal the
  single-process run's within fp32 rounding (the rule of tests/test_parallel.py: 1e-4 relative).
* The training math is untouched: losses, gradient norms and final weights with statistics every
  step are bitwise those of a run without them.
* A rollback or resume drops the `layers` rows of the steps it replays, and keeps every other event.
"""

import json
import math

import pytest
import torch
from conftest import final_weights, metrics, run_train

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
        layer_stats.begin(n)
        _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        layer_stats.after_grads()
        opt.step()
        layer_stats.finish(updated=True)
        return layer_stats.pop_row()

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
