"""model.py: GPT-2's shapes, layout-independent init, sampling."""

import pytest
import torch

import dropout
import model as gpt


def tiny(**kw):
    return gpt.config_from_preset("tiny", 257, **kw)


def test_gpt2_small_has_gpt2s_parameter_count():
    cfg = gpt.config_from_preset("gpt2", 50257)
    with torch.device("meta"):
        m = gpt.GPT(cfg)
    # 124,439,808 with GPT-2's 50257-row embedding; padding to 50304 adds 47 rows of 768
    assert gpt.count_params(m) == 124_439_808 + 47 * 768
    assert cfg.padded_vocab == 50304 and cfg.padded_vocab % 128 == 0
    assert m.lm_head.weight is m.transformer.wte.weight


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown preset 'huge'; choose one of"):
        gpt.config_from_preset("huge", 257)


def test_init_depends_only_on_seed_and_name():
    a, b, c = gpt.build(tiny(), seed=1), gpt.build(tiny(), seed=1), gpt.build(tiny(), seed=2)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.dim() >= 2:
            assert not torch.equal(pa, pc), name
    # a slice materialized on its own equals the same slice of the full tensor
    with torch.device("meta"):
        sliced = gpt.GPT(tiny())
    gpt.materialize(sliced, seed=1, shard_fn=lambda name, full: full[: full.shape[0] // 2])
    w = a.transformer.h[1].mlp.c_fc.weight
    assert torch.equal(sliced.transformer.h[1].mlp.c_fc.weight, w[: w.shape[0] // 2])
    # GPT-2's scaled init of the residual projections
    assert a.transformer.h[0].attn.c_proj.weight.std() < a.transformer.h[0].attn.c_attn.weight.std() / 2


def test_attention_backends_agree_and_model_learns_a_batch():
    torch.manual_seed(0)
    x = torch.randint(0, 257, (2, 33))
    losses = {}
    for backend in ("math", "sdpa"):
        m = gpt.build(tiny(attn=backend), seed=0)
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
        for _ in range(30):
            _, loss = m(x[:, :-1], x[:, 1:])
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses[backend] = loss.item()
    assert losses["math"] == pytest.approx(losses["sdpa"], rel=1e-4)
    assert losses["math"] < 2.0  # from ~5.5: it memorized the batch


def test_kv_cache_generation_equals_recomputing_everything():
    m = gpt.build(tiny(), seed=0).eval()
    prompt = torch.randint(0, 257, (2, 5))
    out = m.generate(prompt, 40, temperature=0)
    ref = prompt
    for _ in range(40):
        logits, _ = m(ref)
        logits = logits[:, -1].clone()
        logits[:, 257:] = float("-inf")
        ref = torch.cat([ref, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ref)


def test_generation_beyond_the_context_window_and_padding_never_wins():
    m = gpt.build(tiny(), seed=0).eval()
    with torch.no_grad():
        m.transformer.wte.weight[257:] = 100.0  # padded rows that would win every argmax
    gen = torch.Generator().manual_seed(0)
    out = m.generate(torch.zeros(1, 1, dtype=torch.long), 150, temperature=1.0, top_k=10, generator=gen)
    assert out.shape == (1, 151)  # longer than block_size = 64: the cache is rebuilt as it fills
    assert int(out.max()) < 257


def test_sequence_longer_than_context_is_refused():
    m = gpt.build(tiny(), seed=0)
    with pytest.raises(ValueError, match="longer than the model's context"):
        m(torch.zeros(1, 65, dtype=torch.long))


def test_flops_per_token_matches_the_palm_formula():
    cfg = gpt.config_from_preset("gpt2", 50257)
    N = 12 * 12 * 768 * 768 + 50304 * 768
    assert gpt.flops_per_token(cfg, 1024) == 6 * N + 12 * 12 * 12 * 64 * 1024


def test_fused_loss_equals_cross_entropy(monkeypatch):
    import torch.nn.functional as F

    import lmhead
    torch.manual_seed(0)
    N, C, V = 1000, 32, 4096
    x = torch.randn(N, C, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, C, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (N,))
    monkeypatch.setattr(lmhead, "LOSS_CHUNK_BYTES", 4 * V * 128)  # 8 chunks of 128 rows, the last short
    (lmhead.lm_head_loss(x, w, targets) * 3).backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (F.cross_entropy(x2 @ w2.t(), targets) * 3).backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-12, atol=1e-15)


def fp16_gradient_error(device: str) -> float:
    """Relative error, under fp16 autocast, of the head's weight gradient in the rows of tokens that no row
    targets: confident predictions, so those rows are sums of probabilities of 1e-9 and below. The
    reference starts from the same fp16 logits, in float64, so what is measured is only the gradient's way
    through fp16."""
    gen = torch.Generator().manual_seed(0)
    N, V = 32, 64
    targets = torch.randint(0, V, (N,), generator=gen)
    w = (32 * torch.eye(V) + 0.25 * torch.randn(V, V, generator=gen)).to(device).requires_grad_()
    x = (torch.nn.functional.one_hot(targets, V) + 0.1 * torch.randn(N, V, generator=gen)).to(device).requires_grad_()
    targets = targets.to(device)
    logits = (x.detach().half() @ w.detach().half().t()).double()
    g = torch.softmax(logits, -1) - torch.nn.functional.one_hot(targets, V)
    want = g.t() @ x.detach().half().double() / N
    with torch.autocast(torch.device(device).type, torch.float16):
        loss = gpt.CrossEntropy()(x, w, targets)
    (loss * 1024).backward()  # a loss scale, as the loop applies it
    untargeted = torch.ones(V, dtype=torch.bool, device=device)
    untargeted[targets] = False
    got, want = w.grad[untargeted].double() / 1024, want[untargeted]
    assert want.abs().max() < 3e-8  # below fp16's smallest subnormal's half: flushed to 0 unless lifted
    return ((got - want).norm() / want.norm()).item()


def test_fp16_loss_gradient_keeps_its_small_entries():
    """The fused loss makes the softmax gradient in the forward, before the loss scale exists, and an fp16
    matmul casts it: entries below 6e-5 lose bits, below 3e-8 vanish. It lifts the chunk's gradient by
    a power of two first (as far as the products allow) and divides it out in fp32 after: those rows of
    the weight gradient come out right (without the lift: 73% off)."""
    assert fp16_gradient_error("cpu") < 1e-2


def test_fused_loss_compiles_to_one_graph_that_matches_eager():
    """torch.compile(fullgraph=True) of the loss layer: a graph break is an error; same loss and gradients."""
    torch.manual_seed(0)
    x, w, targets = torch.randn(2, 40, 32), torch.randn(384, 32), torch.randint(0, 384, (2, 40))
    results = []
    for layer in (gpt.CrossEntropy(), torch.compile(gpt.CrossEntropy(), fullgraph=True)):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = layer(xi, wi, targets)
        loss.backward()
        results.append((loss, xi.grad, wi.grad))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_recomputation_trains_bitwise_like_storing_with_the_same_dropout():
    """--recompute selective / full, with dropout: the recomputed forward draws the same masks (Recompute sets
    the first forward's dropout key again, dropout.py), so losses and weights are bitwise those of the run
    that stores its activations. Each step has its own key, and the backward runs outside it, as a pipeline's
    does (another micro-batch's forward may have come in between); the masks change from step to step."""
    x = torch.randint(0, 257, (4, 33))
    runs = {}
    for mode in ("none", "selective", "full"):
        m = gpt.build(tiny(dropout=0.1, recompute=mode), seed=0)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            with dropout.keyed(dropout.step_key(0, step, 0, torch.device("cpu"))):
                _, loss = m(x[:, :-1], x[:, 1:])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        runs[mode] = losses, [p.detach() for p in m.parameters()]
    ref_losses, ref_weights = runs["none"]
    for mode in ("selective", "full"):
        losses, weights = runs[mode]
        assert losses == ref_losses, mode
        assert all(torch.equal(a, b) for a, b in zip(weights, ref_weights, strict=True)), mode
