"""dropout.py: a mask that is a function of each element's coordinates, the same whoever computes it.
(The layouts themselves, dp, cp, tp + sp and pp with recomputation, reproducing one process with dropout
on: tests/test_parallel.py; recomputation's replay, bitwise: tests/test_model.py.)"""

import torch

import dropout
import model as gpt

CPU = torch.device("cpu")


def mask(step: int = 0, site: int = 0, first_row: int = 0, rows: int = 8, positions=None, C: int = 64,
         p: float = 0.1) -> torch.Tensor:
    key = dropout.step_key(1337, step, first_row, CPU)
    positions = torch.arange(32) if positions is None else positions
    return dropout.dropped(key, torch.tensor(site), rows, positions, C, p)


def test_a_slice_of_the_rows_or_the_positions_draws_the_same_mask_as_the_whole():
    """What a data-parallel rank (rows 4..7 of the global batch) or a context-parallel one (two chunks of
    positions, not contiguous) computes is exactly its part of what one process computes."""
    whole = mask()  # (8, 32, 64)
    assert torch.equal(mask(first_row=4, rows=4), whole[4:])
    chunks = torch.cat([torch.arange(8, 16), torch.arange(16, 24)])  # cp 2, rank 1: chunks 1 and 2 of 4
    assert torch.equal(mask(positions=chunks), whole[:, chunks])


def test_each_coordinate_changes_the_mask_and_p_is_kept():
    """Another step, dropout site, row or position draws another mask; the fraction dropped is p, to
    within five standard deviations of a binomial of that many elements, and neighbours are uncorrelated."""
    whole = mask(rows=64, C=256, p=0.1)  # 524,288 elements
    n = whole.numel()
    assert abs(whole.float().mean().item() - 0.1) < 5 * (0.1 * 0.9 / n) ** 0.5
    for dim in range(3):  # the drop of an element and of its neighbour along each axis: independent
        a, b = whole.narrow(dim, 0, whole.size(dim) - 1).float(), whole.narrow(dim, 1, whole.size(dim) - 1).float()
        corr = ((a - a.mean()) * (b - b.mean())).mean() / (a.std() * b.std())
        assert abs(corr.item()) < 5 / a.numel() ** 0.5, dim
    base = mask()
    for other in (mask(step=1), mask(site=1), mask(first_row=1, rows=8)[:7], mask(positions=torch.arange(1, 33))):
        same = (other == base[: len(other)]).float().mean().item()
        assert same < 0.85  # two independent masks at p = 0.1 agree on 0.81 of the elements
    assert torch.equal(mask(p=0.0), torch.zeros_like(base))


def test_every_dropout_of_the_model_has_its_own_site_and_a_layer_scales_what_it_keeps():
    cfg = gpt.config_from_preset("tiny", 257, dropout=0.5)
    m = gpt.build(cfg, seed=0)
    sites = [int(d.site) for d in m.modules() if isinstance(d, dropout.Dropout)]
    assert sites == list(range(1 + 2 * cfg.n_layer))  # the embedding's, then two per block
    layer = m.transformer.h[0].mlp.dropout
    x = torch.ones(2, 16, 64)
    y = layer(x)
    assert set(y.unique().tolist()) <= {0.0, 2.0} and 0.3 < (y == 0).float().mean().item() < 0.7
    assert torch.equal(layer.eval()(x), x)  # evaluation drops nothing


def test_a_compiled_block_is_one_graph_for_every_block_and_step():
    """The key's numbers and the site are tensors, so torch.compile traces them as inputs: the model's
    blocks (compiled one by one, as train.compile_model does) share one graph across steps and compute the
    masks the eager blocks do. (Were any an int, each block and each step would compile again, and after
    torch's limit of 8 the blocks would silently run eager.)"""
    torch._dynamo.reset()
    cfg = gpt.config_from_preset("tiny", 257, dropout=0.1, n_layer=10)
    eager, compiled = gpt.build(cfg, seed=0), gpt.build(cfg, seed=0)
    for block in compiled.transformer.h:
        block.compile(backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 16, 64, requires_grad=True)  # as the embedding's output is
    torch._dynamo.utils.counters.clear()
    for step in range(3):
        with dropout.keyed(dropout.step_key(0, step, 2, CPU)):
            a, b = eager.blocks(x), compiled.blocks(x)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
