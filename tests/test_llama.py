"""The Llama family (model.py, --arch llama): its shapes, each of its choices checked for the property that
justifies it, and the same model on every parallel layout (the single-process run reproduced)."""

import pytest
import torch
from conftest import run_train
from test_parallel import STEPS, assert_same_run, assert_stopped_once

import config
import model as gpt
import shard
from parallel import LayoutError


def llama(**kw) -> gpt.GPTConfig:
    return gpt.config_from_preset("llama-tiny", 257, **kw)


# ----------------------------------------------------------------------------- shapes


@pytest.mark.parametrize("preset,published,exact", [
    ("smollm2-135m", "134.5M", 134_515_008),
    ("llama-3.2-1b", "1.24B", 1_235_814_400),
    ("llama-3-8b", "8.03B", 8_030_261_248),
])
def test_published_shapes_have_their_published_parameter_counts(preset, published, exact):
    cfg = gpt.config_from_preset(preset)  # the preset's own vocabulary
    n = gpt.n_params(cfg)
    assert n == exact
    assert (f"{n / 1e6:.1f}M" if published.endswith("M") else f"{n / 1e9:.2f}B") == published  # to its digits
    with torch.device("meta"):  # the formula is what a built model holds
        assert gpt.count_params(gpt.GPT(cfg)) == exact


def test_llama_tiny_shapes_and_llama_mini_is_gpt2_mini_sized():
    cfg = llama()
    m = gpt.build(cfg, seed=0)
    assert gpt.count_params(m) == gpt.n_params(cfg)
    H, H_kv, D, C = 4, 2, 16, 64
    attn, mlp = m.transformer.h[0].attn, m.transformer.h[0].mlp
    assert attn.c_attn.weight.shape == ((H + 2 * H_kv) * D, C) and mlp.c_fc.weight.shape == (2 * 256, C)
    assert cfg.hidden == 256 and gpt.ffn_hidden_rule(256) == 768 and gpt.ffn_hidden_rule(4096) == 11008
    assert not any(name.endswith(".bias") for name, _ in m.named_parameters())  # no biases
    assert "wpe" not in m.transformer and isinstance(m.transformer.ln_f, torch.nn.RMSNorm)
    assert m.lm_head.weight is not m.transformer.wte.weight  # untied, drawn apart
    assert not torch.equal(m.lm_head.weight, m.transformer.wte.weight)
    assert gpt.build(llama(tie_embeddings=True), 0).lm_head.weight is not None
    mini, gpt2_mini = (gpt.n_params(gpt.config_from_preset(p, 50257)) for p in ("llama-mini", "mini"))
    assert abs(mini / gpt2_mini - 1) < 0.01


def test_flops_per_token_counts_swiglus_three_matrices_and_gqas_smaller_kv():
    """6 N + 12 L H D T, N every weight a matmul uses: counted on a built model, not from the formula."""
    for cfg in (llama(), llama(n_kv_head=1), llama(tie_embeddings=True)):
        m = gpt.build(cfg, seed=0)
        # the input embedding is a lookup; tied, its matrix is the lm_head's (named once, as wte)
        n = sum(p.numel() for name, p in m.named_parameters() if p.dim() == 2 and name != "transformer.wte.weight")
        n += m.lm_head.weight.numel() if cfg.tied else 0
        assert gpt.flops_per_token(cfg, 32) == 6 * n + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * 32


def test_a_gpt2_checkpoints_architecture_is_unchanged():
    """Old GPT-2 checkpoints and run.json files name only GPT-2's fields."""
    assert set(gpt.config_from_preset("tiny", 257).architecture()) == \
        {"n_layer", "n_head", "n_embd", "block_size", "vocab_size"}
    assert llama().architecture()["n_kv_head"] == 2


# ----------------------------------------------------------------------------- RoPE


def test_rope_scores_depend_only_on_relative_position():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 24, 3, 16, generator=g, dtype=torch.float64), torch.randn(2, 24, 3, 16, generator=g,
                                                                                        dtype=torch.float64)
    pos = torch.arange(24)

    def scores(shift):
        qr, kr = gpt.rotate(q, pos + shift, 10000.0), gpt.rotate(k, pos + shift, 10000.0)
        return torch.einsum("bthd,bshd->bhts", qr, kr)
    assert torch.allclose(scores(0), scores(1000), atol=1e-9)
    assert not torch.allclose(scores(0), torch.einsum("bthd,bshd->bhts", q, k), atol=1e-3)  # it does rotate
    assert torch.allclose(gpt.rotate(q, pos, 10000.0).norm(dim=-1), q.norm(dim=-1))  # a rotation: lengths kept


def test_rope_at_an_offset_is_the_tail_of_a_longer_sequence():
    x = torch.randn(1, 40, 2, 16, dtype=torch.float64)
    whole = gpt.rotate(x, torch.arange(40), 500.0)
    assert torch.equal(gpt.rotate(x[:, 25:], torch.arange(25, 40), 500.0), whole[:, 25:])
    # and non-contiguous global positions (context parallelism's chunks) turn each token as in one piece
    chunks = torch.tensor([*range(0, 5), *range(35, 40)])
    assert torch.equal(gpt.rotate(x[:, chunks], chunks, 500.0), whole[:, chunks])


# ----------------------------------------------------------------------------- GQA, the cache, the kernel


def test_grouped_query_attention_is_multi_head_with_repeated_kv():
    gqa = gpt.build(llama(), seed=3).double()
    mha = gpt.build(llama(n_kv_head=4), seed=3).double()
    H, H_kv, D = 4, 2, 16
    with torch.no_grad():
        for name, p in mha.named_parameters():
            src = gqa.get_parameter(name)
            if name.endswith("c_attn.weight"):  # q as it is; each kv head repeated for its group of 2
                q, k, v = src.split([H * D, H_kv * D, H_kv * D])
                def rep(w): return w.view(H_kv, D, -1).repeat_interleave(H // H_kv, 0).reshape(H * D, -1)
                p.copy_(torch.cat([q, rep(k), rep(v)]))
            else:
                p.copy_(src)
    idx = torch.randint(0, 257, (2, 32))
    assert torch.allclose(gqa(idx)[0], mha(idx)[0], atol=1e-12)


def test_kv_cache_sampling_equals_the_full_forward():
    m = gpt.build(llama(), seed=1).double().eval()
    idx = torch.randint(0, 257, (2, 20))
    caches = [gpt.KVCache() for _ in m.transformer.h]
    m.next_logits(idx[:, :12], 0, caches)  # prefill, then one token at a time at its position
    for t in range(12, 20):
        step = m.next_logits(idx[:, t:t + 1], t, caches)
        full = m(idx[:, :t + 1])[0][:, -1]
        assert torch.allclose(step, full, atol=1e-10), t
    out = m.generate(idx[:, :5], 10, temperature=0)  # greedy: each token the argmax of the full forward
    for t in range(5, 15):
        assert torch.equal(out[:, t], m(out[:, :t])[0][:, -1, :257].argmax(-1))


def test_the_kernel_runs_a_gqa_llama_as_sdpa_does():
    """The model's packed GQA projection through our Triton kernel (interpreter, fp32) against SDPA in
    float64: the loss and every gradient."""
    losses, grads = {}, {}
    idx = torch.randint(0, 257, (2, 33))
    for backend, dtype in (("triton", torch.float32), ("sdpa", torch.float64)):
        m = gpt.build(llama(attn=backend, n_layer=2), seed=2).to(dtype)
        losses[backend] = m(idx[:, :-1], idx[:, 1:])[1]
        losses[backend].backward()
        grads[backend] = {n: p.grad.double() for n, p in m.named_parameters()}
    assert losses["triton"].item() == pytest.approx(losses["sdpa"].item(), rel=1e-5)
    for name, g in grads["sdpa"].items():
        assert torch.allclose(grads["triton"][name], g, atol=1e-5, rtol=1e-4), name


# ----------------------------------------------------------------------------- flags


@pytest.mark.parametrize("flags,message", [
    (["--arch", "gpt2", "--preset", "llama-tiny"], "--preset llama-tiny is a Llama-family shape; use --arch llama"),
    (["--n-kv-head", "2"], "--n-kv-head: only for --arch llama"),
    (["--arch", "llama", "--preset", "tiny", "--n-kv-head", "3"], "--n-kv-head 3 does not divide the tiny "
     "model's 4 heads"),
])
def test_bad_architecture_flags_are_one_line(flags, message):
    with pytest.raises(config.ConfigError, match=message):
        config.resolve_defaults(config.parse_args(["--device", "cpu", *flags]), torch.device("cpu"))


def test_arch_llama_takes_a_gpt2_presets_shape_and_the_llama_defaults():
    cfg = config.resolve_defaults(config.parse_args(["--arch", "llama", "--preset", "tiny", "--tokenizer", "byte"]),
                                  torch.device("cpu"))
    m = config.model_config(cfg)
    assert (m.arch, m.n_layer, m.n_embd, m.kv_heads, m.rope_theta, m.tied) == ("llama", 4, 64, 4, 10000.0, False)
    auto = config.resolve_defaults(config.parse_args(["--arch", "llama"]), torch.device("cpu"))
    assert auto.preset == "llama-mini"


# ----------------------------------------------------------------------------- every layout

LLAMA = ["--preset", "llama-tiny"]  # 4 layers, 4 query heads and 2 kv heads of 16, untied: all through the layouts
LAYOUTS = {
    # tensor parallelism splits q heads and kv heads; the vocab-parallel embedding and the fused loss of the
    # untied output layer; sequence parallelism over RMSNorm's region
    "tp2-sp": (2, ["--tp", "2", "--sp"]),
    "tp2xpp2-recompute-selective": (4, ["--tp", "2", "--pp", "2", "--micro-batch-size", "2",
                                        "--recompute", "selective"]),
    # the untied head on the last stage, the embedding on the first: no tied-gradient sum between them
    "pp2-interleaved-v2-zero1": (2, ["--pp", "2", "--pp-schedule", "interleaved", "--virtual-stages", "2",
                                     "--micro-batch-size", "2", "--zero", "1"]),
    "dp2-zero3-recompute-full": (2, ["--zero", "3", "--micro-batch-size", "2", "--recompute", "full"]),
    # context parallelism: RoPE by each chunk's global positions; the ring carries H_kv heads
    "cp2xdp2-zero2": (4, ["--cp", "2", "--zero", "2"]),
    "cp2xtp2-sp": (4, ["--cp", "2", "--tp", "2", "--sp"]),
    "cp2-ulysses-recompute-selective": (2, ["--cp", "2", "--cp-attn", "ulysses", "--recompute", "selective"]),
}


@pytest.fixture(scope="module")
def llama_reference(corpus, tmp_path_factory):
    from conftest import final_weights, metrics
    out = tmp_path_factory.mktemp("llama_single")
    run_train(corpus, out, *STEPS, *LLAMA)
    return metrics(out), final_weights(out)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_llama_layout_reproduces_single_process(layout, llama_reference, corpus, tmp_path):
    """...and every collective moves the bytes of its formula (instruments/formulas.py: GQA's smaller K and V
    in the ring and the all-to-alls, no tied-embedding sum between pipeline stages)."""
    nproc, flags = LAYOUTS[layout]
    result = run_train(corpus, tmp_path, *STEPS, *LLAMA, *flags, "--comm-report", nproc=nproc)
    assert_same_run(llama_reference, tmp_path)
    assert "formula matches measurement on every rank: yes" in result.stdout, result.stdout[-3000:]


def test_a_llama_checkpoint_continues_at_another_layout(llama_reference, corpus, tmp_path):
    """Saved at tp 2 x pp 2 (GQA's unequal q/k/v slices, the untied head on the last stage), killed, resumed on
    one process: the run is the uninterrupted single-process one."""
    flags = [*STEPS, *LLAMA, "--ckpt-every", "2"]
    killed = run_train(corpus, tmp_path, *flags, "--tp", "2", "--pp", "2", "--micro-batch-size", "2",
                       "--crash-at", "step:2", nproc=4, check=False)
    assert killed.returncode != 0
    resumed = run_train(corpus, tmp_path, *flags)
    assert "(step 2)" in resumed.stdout
    assert_same_run(llama_reference, tmp_path)


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("nproc,flags", [(1, []), (2, ["--tp", "2", "--sp"])], ids=["one", "tp2-sp"])
def test_memory_report_holds_a_llama_to_its_activation_model(nproc, flags, recompute, corpus, tmp_path):
    """--memory-report --arch llama: on every rank the bytes autograd saved per layer within 10% of
    formulas.llama_activation_bytes (tests/test_plan.py has it term by term), whose value the report prints:
    at tp 2 with --sp the RMSNorms' region is cut by the sequence, q/k/v, SwiGLU and the attention by heads."""
    from instruments import formulas
    out = run_train(corpus, tmp_path, "--max-steps", "1", *LLAMA, "--memory-report", "--recompute", recompute,
                    *flags, nproc=nproc).stdout
    lines = [ln for ln in out.splitlines() if "activations saved per layer" in ln]
    assert len(lines) == nproc, out[-3000:]
    tp = 2 if flags else 1
    want = formulas.llama_activation_bytes(32, 8, 64, 4, 2, 256, tp, bool(flags), recompute, act_bytes=4)
    for ln in lines:
        assert f"formula {want:,.0f} (" in ln and "Korthikanti" not in ln, ln
        assert 0.9 < float(ln.split("(")[-1].split("%")[0]) / 100 < 1.1, ln


@pytest.mark.parametrize("tp,cp,attn,message", [
    (4, 1, "ring", "--tp 4 does not divide the model's 2 kv heads (grouped-query attention: every tensor-parallel "
                   "rank needs kv heads of its own); use --tp 2 or more kv heads (--n-kv-head)"),
    (2, 2, "ulysses", "--cp-attn ulysses needs the kv heads (each cp rank attends with whole ones) per "
                      "tensor-parallel rank (1) divisible by --cp 2; use --cp-attn ring"),
])
def test_layouts_that_cannot_split_the_kv_heads_are_refused(tp, cp, attn, message):
    grid = type("Grid", (), dict(tp=tp, cp=cp, pp=1, vp=1, sp=False, cp_attn=attn))()
    with pytest.raises(LayoutError) as refused:
        shard.check_layout(llama(), grid, seq_len=32)
    assert str(refused.value) == message


def test_tp_refusal_is_one_line_before_any_work(corpus, tmp_path):
    result = run_train(corpus, tmp_path, *LLAMA, "--tp", "2", "--n-kv-head", "1", nproc=2, check=False, timeout=120)
    assert_stopped_once(result, "--tp 2 does not divide the model's 1 kv heads", 2)


def test_beyond_the_position_table_cp2_reproduces_one_process_at_8192_tokens(corpus, tmp_path):
    """No table caps a Llama's context: llama-tiny (64 positions as a preset) trains on 8,192-token sequences, and
    context parallelism over 2 ranks, rotating each chunk by its global positions, reproduces one process."""
    from conftest import final_weights, metrics
    long = [*LLAMA, "--n-layer", "2", "--block-size", "8192", "--seq-len", "8192", "--batch-size", "1",
            "--max-steps", "2", "--ckpt-every", "0"]
    run_train(corpus, tmp_path / "one", *long)
    run_train(corpus, tmp_path / "cp2", *long, "--cp", "2", nproc=2)
    assert_same_run((metrics(tmp_path / "one"), final_weights(tmp_path / "one")), tmp_path / "cp2")
