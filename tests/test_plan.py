"""planner.plan and formulas.py: the paper estimates of lesson 19, held to model.py, to what autograd and the
allocator measure (reports.py), and to published figures."""

import pytest
import torch

import model as gpt
import parallel
import pipeline
from instruments import formulas, planner, reports

GB = 1e9


@pytest.mark.parametrize("preset", ["gpt2", "gpt2-medium", "gpt2-xl", "tiny"])
def test_parameters_and_flops_are_model_pys(preset):
    cfg = gpt.config_from_preset(preset, 50257)
    with torch.device("meta"):
        m = gpt.GPT(cfg)
    p = planner.plan(cfg.n_layer, cfg.n_head, cfg.n_embd, 50257, cfg.block_size, batch=8, n_gpus=1)
    assert p["params"] == gpt.count_params(m)  # gpt2: 124,475,904 with the vocabulary padded to 50304
    assert p["flops_per_token"] == gpt.flops_per_token(cfg, cfg.block_size)


# Narayanan et al. 2021, table 1: (billions of parameters, heads, hidden, layers, tp, pp, GPUs, batch,
# achieved teraFLOP/s per GPU); V = 51200, s = 2048, A100s, full recomputation, fp16
MEGATRON_TABLE_1 = [(1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
                    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
                    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
                    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
                    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
                    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163)]
# how Megatron-LM ran them in 2021: the s x s scores materialized (with dropout on them), no sequence
# parallelism, full recomputation, fp16 gradients all-reduced without ZeRO; micro-batches of 1
MEGATRON_2021 = dict(gpu="A100", recompute="full", attn="math", sp=False, dropout=0.1, zero=0, grad_bytes=2)


def megatron_teraflops(p: dict, heads: int, hidden: int, layers: int, batch: int) -> float:
    """Per-GPU FLOP/s the way the paper counts them (section 5.1): F = 96 B s l h^2 (1 + s/6h + V/16lh)
    per step, full recomputation included, over the modeled step."""
    s, V = 2048, 51200
    flops = 96 * batch * s * layers * hidden**2 * (1 + s / (6 * hidden) + V / (16 * layers * hidden))
    return flops / p["n_gpus"] / p["step_s"] / 1e12


@pytest.mark.parametrize("billions,heads,hidden,layers", [row[:4] for row in MEGATRON_TABLE_1])
def test_megatron_table_1_parameter_counts(billions, heads, hidden, layers):
    p = planner.plan(layers, heads, hidden, 51200, 2048, batch=1, n_gpus=1)
    # their formula has no final LayerNorm (2h); everything else is the same count
    assert round((p["params"] - 2 * hidden) / 1e9, 1) == billions


@pytest.mark.parametrize("billions,heads,hidden,layers,tp,pp,gpus,batch,teraflops", MEGATRON_TABLE_1)
def test_megatron_table_1_throughput_from_the_layout(billions, heads, hidden, layers, tp, pp, gpus, batch, teraflops):
    """The step-time model, with its one fitted number (GPU.matmul_eff), against the 10 measured
    configurations: each within 6% (it spans 135-163 teraFLOP/s: a flat guess of the mean would miss
    two rows by 9%)."""
    p = planner.plan(layers, heads, hidden, 51200, 2048, batch, gpus, tp=tp, pp=pp, **MEGATRON_2021)
    assert megatron_teraflops(p, heads, hidden, layers, batch) == pytest.approx(teraflops, rel=0.06)


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16), (8, 64)])
def test_bubble_is_the_formula_and_the_simulated_1f1b_schedule(pp, m):
    p = planner.plan(8, 8, 512, 1000, 128, batch=2 * m, n_gpus=2 * pp, pp=pp, micro_batch=1)
    assert (p["dp"], p["micro_batches"]) == (2, m)
    assert p["bubble"] == pytest.approx((pp - 1) / (m + pp - 1))
    ops = [pipeline.one_f_one_b(pp, r, m) for r in range(pp)]
    assert p["bubble"] == pytest.approx(pipeline.bubble_fraction(ops))


@pytest.mark.parametrize("pp,m,v", [(2, 2, 2), (2, 4, 4), (3, 6, 2), (4, 4, 2), (4, 8, 2), (4, 16, 3), (8, 64, 2)])
def test_bubble_is_the_formula_and_the_simulated_interleaved_schedule(pp, m, v):
    """Narayanan et al. 2021, section 2.2.2: v chunks per rank cut the bubble to (p-1)/(v m + p-1)."""
    ops = [pipeline.interleaved_1f1b(pp, r, m, v) for r in range(pp)]
    assert pipeline.bubble_fraction(ops) == pytest.approx((pp - 1) / (v * m + pp - 1))
    assert pipeline.bubble_formula(pp, m, v) == pytest.approx((pp - 1) / (v * m + pp - 1))


def test_zero1_shards_only_the_optimizer_over_dp():
    shape = dict(n_layer=32, n_head=32, d_model=4096, vocab=32000, seq_len=4096, batch=512, tp=2)
    one, eight = (planner.plan(n_gpus=2 * dp, **shape)["memory"] for dp in (1, 8))
    assert eight["optimizer"] == pytest.approx(one["optimizer"] / 8)
    assert (eight["weights"], eight["grads"], eight["activations"]) == (one["weights"], one["grads"],
                                                                        one["activations"])
    no_zero = planner.plan(n_gpus=16, zero=0, **shape)["memory"]
    assert no_zero["optimizer"] == 8 / 12 * one["optimizer"]  # unsharded, and torch's AdamW keeps no master copy
    # Megatron's distributed optimizer: 2 + 4 + 12/dp bytes per parameter of this GPU's share
    n_local = planner.plan(n_gpus=16, **shape)["params"] / 2
    assert eight["weights"] + eight["grads"] + eight["optimizer"] == pytest.approx((6 + 12 / 8) * n_local)


def test_zero_paper_figure_1():
    """7.5B parameters on 64 GPUs, fp16 gradients: 120 GB, then 31.4, 16.6 and 1.9 GB per GPU."""
    per_gpu = [sum(planner.state_bytes(7.5e9, 64, zero, grad_bytes=2)) / GB for zero in range(4)]
    assert [round(x, 1) for x in per_gpu] == [120.0, 31.4, 16.6, 1.9]


def test_state_without_zero_is_what_train_py_keeps():
    """Without ZeRO train.py keeps fp32 weights and gradients and torch's AdamW (two fp32 moments): 16
    bytes a parameter, formulas.state_formula's 4Ψ + 4Ψ + 2·4Ψ, what --memory-report measures. The
    planner once charged Megatron's 2 + 4 + 12 there, 2Ψ more than the run holds."""
    assert planner.state_bytes(1e9, 8, zero=0) == (4e9, 4e9, 8e9)
    assert planner.state_bytes(1e9, 8, zero=1) == (2e9, 4e9, 1.5e9)  # ZeroAdamW: 16-bit weights, fp32 master
    p = planner.plan(32, 32, 4096, 32000, 4096, batch=64, n_gpus=8, zero=0)["memory"]
    assert p["weights"] + p["grads"] + p["optimizer"] == 16 * p["weights"] / 4


def test_activations_under_1f1b_are_all_layers_whatever_pp():
    """Korthikanti et al. 2022, section 4.2.3: the first stage holds pp micro-batches of L/pp layers."""
    acts = [planner.plan(80, 64, 8192, 32000, 4096, batch=1024, n_gpus=64 * pp, tp=8, pp=pp)
            ["memory"]["activations"] for pp in (1, 2, 4, 8)]
    per_layer = formulas.activation_bytes(4096, 1, 8192, 64, tp=8, sp=True, norm_bytes=4)  # bf16, flash, fp32 norms
    assert per_layer == 4096 * 8192 * (4 * 2 / 8 + 2 * 2 + 2 * 12 / 8)  # fp32 LN inputs / t, outputs whole, rest / t
    assert acts == [per_layer * 80] * 4  # 20.1 GB
    # interleaved: pp + (pp - 1) / vp stages' worth (lesson 11 counts 11 chunks = 5.5 stages for p 4, v 2)
    inter = planner.plan(80, 64, 8192, 32000, 4096, batch=1024, n_gpus=256, tp=8, pp=4, vp=2)
    assert inter["memory"]["activations"] == pytest.approx(per_layer * 20 * 5.5)


def test_one_activation_model_for_plan_and_the_memory_report():
    """plan(), --memory-report (activation_formula) and the lessons count the same tensors; the s x s
    probabilities only where a backend keeps them; Korthikanti's formula is printed beside them."""
    cfg = gpt.GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257)
    for attn in ("flash", "math"):
        for recompute in ("none", "selective", "full"):
            ours, paper = formulas.activation_formula(cfg, 1024, 4, 2, True, recompute, attn, 2, 1, 4, residual_bytes=4)
            p = planner.plan(12, 12, 768, 50257, 1024, batch=8, n_gpus=2, tp=2, micro_batch=4, zero=0,
                              recompute=recompute, attn=attn)
            rebuilt = (recompute == "full") * formulas.activation_bytes(1024, 4, 768, 12, 2, True, "none", attn,
                                                                        2, 1, 0, 4)
            assert p["memory"]["activations"] == pytest.approx(ours * 12 + rebuilt)  # 1 stage, 12 layers
            assert paper == formulas.korthikanti_bytes(1024, 4, 768, 12, 2, True, recompute)
    sbh, scores = 1024 * 4 * 768, 12 * 1024 * 1024 * 4  # and the probabilities: a s^2 b elements
    flash, math_, selective = (formulas.activation_bytes(1024, 4, 768, 12, 1, False, r, a)
                               for r, a in (("none", "flash"), ("none", "math"), ("selective", "math")))
    assert flash == selective == 2 * 16 * sbh and math_ == flash + 2 * scores
    # Korthikanti's 34 s b h: our 32 in bf16 plus two 1-byte residual dropout masks
    assert formulas.activation_bytes(1024, 4, 768, 12, dropout=0.1) == 34 * sbh
    assert formulas.korthikanti_bytes(1024, 4, 768, 12, 1, False, "selective") == 34 * sbh


@pytest.mark.parametrize("preset,tp,pp,gpus", [("smollm2-135m", 1, 1, 8), ("llama-3-8b", 8, 1, 64),
                                                ("llama-3-8b", 4, 2, 64)])
def test_the_planner_takes_a_llama_from_model_py(preset, tp, pp, gpus):
    """plan_model() of a Llama preset: parameters and FLOPs per token are model.py's own counts (GQA's narrower
    k and v, SwiGLU's three matrices, the untied head), a GPU's weights, gradients and optimizer state its
    share of them, its activations llama_activation_bytes per layer (bf16, fused fp32 RMSNorms) for the
    micro-batches 1F1B holds. GQA shrinks the c_attn weights, so the gradient traffic and the matmul time,
    but not the tensor-parallel all-reduces, which carry the d-wide residual stream: equal to those of the
    same model with all 32 kv heads, and of a GPT-2 of its width and depth."""
    cfg = gpt.config_from_preset(preset)
    s, batch, b = 4096, 256, 1
    p = planner.plan_model(cfg, s, batch, gpus, tp=tp, pp=pp, micro_batch=b)
    with torch.device("meta"):
        n = gpt.count_params(gpt.GPT(cfg))
    assert p["params"] == n == gpt.n_params(cfg)  # 134,515,008 and 8,030,261,248 (tests/test_llama.py)
    assert p["flops_per_token"] == gpt.flops_per_token(cfg, s)
    mem, dp = p["memory"], gpus // (tp * pp)
    assert (mem["weights"], mem["grads"], mem["optimizer"]) == planner.state_bytes(n / (tp * pp), dp)
    layers, m = cfg.n_layer // pp, batch // (dp * b)
    per_layer = formulas.llama_activation_bytes(s, b, cfg.n_embd, cfg.n_head, cfg.kv_heads, cfg.hidden, tp, True,
                                                fused_norm=True)
    assert mem["activations"] == per_layer * layers * min(pp, m)
    assert per_layer == formulas.layer_activation_bytes(cfg, s, b, tp, True, "none", "flash", 2, fused_norm=True)
    if preset != "llama-3-8b":
        return
    assert per_layer == s * b * 4096 * (2 * 4 / tp + 2 * 2 + 2 * (1.5 + 1 + 14) / tp)
    mha = planner.plan_model(gpt.config_from_preset(preset, n_kv_head=32), s, batch, gpus, tp=tp, pp=pp)
    gpt2 = planner.plan(32, 32, 4096, 128256, s, batch, gpus, tp=tp, pp=pp)
    assert p["comm"]["tp"] == mha["comm"]["tp"] == gpt2["comm"]["tp"] and p["comm"]["pp"] == gpt2["comm"]["pp"]
    kv_weights = 32 * 2 * 4096 * (32 - 8) * 128  # k and v of 24 more heads, in every layer
    assert mha["params"] - p["params"] == kv_weights
    assert mha["comm"]["dp"] / p["comm"]["dp"] == pytest.approx(mha["params"] / p["params"])
    assert p["time"]["compute"] < mha["time"]["compute"]  # narrower c_attn matmuls
    with pytest.raises(parallel.LayoutError, match="32 heads, 8 kv heads"):
        planner.plan_model(cfg, s, batch, 128, tp=16)  # tp 16 divides the query heads, not the 8 kv heads


# ----------------------------------------------------------------------------- with experts (moe.py)

MOE_SHAPE = dict(n_layer=4, n_head=4, n_embd=64, block_size=32, vocab_size=256, moe_experts=8, moe_top_k=2, moe_every=2)


def test_total_and_active_parameters_with_experts():
    """A GPT-2 of 4 blocks with 8 experts, top 2, in blocks 1 and 3, counted here from its shapes: all of its
    parameters (= the built model's), the ones a token uses (2 of each MoE block's 8 MLPs, the router, the
    rest), and FLOPs per token of the active matmul weights (6 x them + attention's 12 L H Q T), which MFU is
    on. Mixtral 8x7B's shape (model.py's Llama with 8 experts, top 2): 46.7B in all, 12.9B active (Mistral's
    figures), printed side by side."""
    C, V, T, E, k, s = 64, 256, 32, 8, 2, 32
    attention, norms, mlp, router = 4 * C * C + 4 * C, 4 * C, 4 * C * C + 4 * C + 4 * C * C + C, E * C
    dense, sparse = attention + norms + mlp, attention + norms + E * mlp + router
    rest = V * C + T * C + 2 * C  # the tied embedding, positions, ln_f
    cfg = gpt.GPTConfig(**MOE_SHAPE)
    p = planner.plan_model(cfg, s, batch=8, n_gpus=1)
    with torch.device("meta"):
        assert p["params"] == 2 * dense + 2 * sparse + rest == gpt.count_params(gpt.GPT(cfg))
    assert p["active_params"] == 2 * dense + 2 * (attention + norms + k * mlp + router) + rest
    matmuls = 2 * (4 * C * C + 8 * C * C) + 2 * (4 * C * C + k * 8 * C * C + router) + V * C
    assert p["flops_per_token"] == 6 * matmuls + 12 * 4 * C * s
    assert p["mfu"] == pytest.approx(p["flops_per_token"] * 8 * s / (planner.GPUS["H100"].peak * p["step_s"]))
    mixtral = gpt.GPTConfig(arch="llama", n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, ffn_hidden=14336,
                            vocab_size=32000, block_size=32768, moe_experts=8, moe_top_k=2)
    m = planner.plan_model(mixtral, 4096, batch=512, n_gpus=64, ep=8)
    assert (round(m["params"] / 1e9, 1), round(m["active_params"] / 1e9, 1)) == (46.7, 12.9)
    assert planner.format_plan(m).splitlines()[0].startswith(
        "model   46.70B parameters (8 experts, top 2), 12.88B active per token, ")
    dense_plan = planner.plan_model(gpt.GPTConfig(**(MOE_SHAPE | {"moe_experts": 0})), s, batch=8, n_gpus=1)
    assert dense_plan["active_params"] == dense_plan["params"] and "ep" not in dense_plan["comm"]
    assert "experts" not in planner.format_plan(dense_plan) and "ep" not in dense_plan["time"]


@pytest.mark.parametrize("tp,zero", [(1, 1), (1, 0), (2, 1)])
def test_expert_parallelism_divides_the_expert_memory(tp, zero):
    """dp 8, ep 1, 4 and 8: each GPU holds 1/ep of the experts' weights and gradients, whole on every tp rank
    (moe.py replicates them over tp), the rest as a dense model's. Their optimizer state: ZeRO-1 already
    shards it over dp, and ep x (dp / ep) is still dp, so ep leaves it alone; without ZeRO it is divided too."""
    C, E = 64, 8
    experts = 2 * E * (8 * C * C + 5 * C)  # 2 MoE blocks of 8 GPT-2 MLPs
    for ep in (1, 4, 8):
        p = planner.plan_model(gpt.GPTConfig(**MOE_SHAPE), 32, batch=64, n_gpus=8 * tp, tp=tp, zero=zero, ep=ep)
        here = (p["params"] - experts) / tp + experts / ep  # parameters on one GPU
        mem, w, k = p["memory"], (2 if zero else 4), (12 if zero else 8)  # without ZeRO: fp32 weights, AdamW's moments
        assert (mem["weights"], mem["grads"]) == (pytest.approx(w * here), pytest.approx(4 * here)), ep
        state = (p["params"] - experts) / tp / 8 + experts / 8 if zero else here
        assert mem["optimizer"] == pytest.approx(k * state), ep


def test_expert_all_to_alls_per_step():
    """The all-to-alls of moe.py's docstring: per MoE layer and micro-batch, 2 forward and 2 backward of the
    micro-batch's b s k rows of d bf16 numbers, (ep-1)/ep of them leaving the GPU; exposed, over NVLink
    while tp x ep fits in a node, over the network beyond; none at ep 1. An MoE block's MLP makes no
    tensor-parallel all-reduces: 2 of a dense block's 4."""
    b, s, k, d, m = 2, 32, 2, 64, 4  # 64 sequences over dp 8: 4 micro-batches of 2
    h100, plans = planner.GPUS["H100"], {}
    for ep, tp, per_node in ((1, 1, 8), (4, 1, 8), (8, 2, 8), (8, 1, 4)):
        p = planner.plan_model(gpt.GPTConfig(**MOE_SHAPE), s, batch=64, n_gpus=8 * tp, tp=tp, ep=ep, micro_batch=b,
                               gpus_per_node=per_node)
        assert p["comm"]["ep"] == pytest.approx(4 * 2 * m * b * s * k * d * 2 * (ep - 1) / ep)
        link = h100.nvlink if tp * ep <= per_node else h100.net
        assert p["time"]["ep"] == pytest.approx(p["comm"]["ep"] / (planner.LINK_EFFICIENCY * link))
        assert "  ep " in planner.format_plan(p) and "(tp, ep, pp, dp: exposed)" in planner.format_plan(p)
        plans[ep, tp] = p
    assert plans[1, 1]["comm"]["ep"] == plans[1, 1]["time"]["ep"] == 0
    dense = planner.plan_model(gpt.GPTConfig(**(MOE_SHAPE | {"moe_experts": 0})), s, 64, 16, tp=2, micro_batch=b)
    assert plans[8, 2]["comm"]["tp"] == pytest.approx(dense["comm"]["tp"] * 6 / 8)  # 2 dense blocks x 4 + 2 MoE x 2


@pytest.mark.parametrize("ep,experts,says", [(3, 8, "ep 3: must divide dp 6 and the 8 experts"),
                                             (4, 8, "ep 4: must divide dp 6"), (2, 0, "ep 2: no experts to split")])
def test_bad_expert_layouts_are_one_line(ep, experts, says):
    with pytest.raises(parallel.LayoutError, match=says):
        planner.plan_model(gpt.GPTConfig(**(MOE_SHAPE | {"moe_experts": experts})), 32, 12, 6, ep=ep)


def test_traffic_formulas():
    p = planner.plan(80, 64, 8192, 32000, 4096, batch=1024, n_gpus=512, tp=8, pp=4)
    act = 2 * 4096 * 8192  # one bf16 activation of a sequence
    assert p["comm"]["tp"] == pytest.approx(4 * 20 * 64 * act * 2 * 7 / 8)  # 4 per layer, 20 layers, m = 64
    assert p["comm"]["pp"] == pytest.approx(2 * 64 * act / 8)
    no_zero = planner.plan(80, 64, 8192, 32000, 4096, batch=1024, n_gpus=512, tp=8, pp=4, zero=0)
    # ZeRO: fp32 reduce-scatter + bf16 all-gather, 6 bytes per parameter; an fp32 all-reduce: 8
    assert p["comm"]["dp"] == pytest.approx(0.75 * no_zero["comm"]["dp"])


MEGATRON_ESTIMATES = [  # Narayanan et al. 2021, section 5.1: layout, tokens, their X and days
    ((96, 96, 12288), 8, 16, 1024, 1536, 300e9, 140, 34),  # GPT-3 175B
    ((128, 160, 25600), 8, 64, 3072, 3072, 450e9, 163, 84),  # 1T
]


@pytest.mark.parametrize("shape,tp,pp,gpus,batch,tokens,tflops,days", MEGATRON_ESTIMATES)
def test_megatron_2021_training_time_from_an_assumed_mfu(shape, tp, pp, gpus, batch, tokens, tflops, days):
    """Narayanan et al. 2021, section 5.1: time = 8 T P / (n X). X counts the FLOPs of full activation
    recomputation (8 per parameter and token); model FLOPs are 6, so MFU = X / peak * 6 / 8."""
    mfu = tflops / 312 * 6 / 8  # A100: 312 TFLOP/s bf16
    p = planner.plan(*shape, 51200, 2048, batch, gpus, tp=tp, pp=pp, tokens=tokens, mfu=mfu, gpu="A100")
    assert p["step_s"] == pytest.approx(p["flops_per_token"] * batch * 2048 / (gpus * 312e12 * mfu))
    assert p["days"] == pytest.approx(days, rel=0.05)  # ours also counts attention: +1-3%


@pytest.mark.parametrize("shape,tp,pp,gpus,batch,tokens,tflops,days", MEGATRON_ESTIMATES)
def test_megatron_2021_training_time_from_the_layout(shape, tp, pp, gpus, batch, tokens, tflops, days):
    """The same estimates with no MFU given: plan() models the step from the layout, and lands within
    the same 5% (modeled: 33 and 87 days; the throughput within table 1's 6% of their X)."""
    p = planner.plan(*shape, 51200, 2048, batch, gpus, tp=tp, pp=pp, tokens=tokens, **MEGATRON_2021)
    assert p["days"] == pytest.approx(days, rel=0.05)
    layers, heads, hidden = shape
    assert megatron_teraflops(p, heads, hidden, layers, batch) == pytest.approx(tflops, rel=0.06)


@pytest.mark.parametrize("shape,gpu_hours", [
    ((32, 32, 4096), 184_320),  # Llama 2 7B
    ((80, 64, 8192), 1_720_320),  # Llama 2 70B (GQA and a wider MLP: our N is ~6% low)
])
def test_llama2_gpu_hours_imply_a_plausible_mfu(shape, gpu_hours):
    """Touvron et al. 2023, table 2: A100-80GB hours for 2T tokens. At 100% MFU the plan needs
    gpu_hours_at_1; the published hours then imply the MFU, which must look like a real run's."""
    p = planner.plan(*shape, 32000, 4096, 1024, 2048, tp=8, tokens=2e12, mfu=1.0, gpu="A100")
    implied = p["gpu_hours"] / gpu_hours
    assert 0.40 < implied < 0.48, implied


def test_impossible_layouts_are_refused():
    for kw in (dict(n_gpus=12, tp=8), dict(n_gpus=8, tp=3), dict(n_gpus=8, pp=16), dict(n_gpus=8, batch=12),
               dict(n_gpus=8, pp=2, vp=2, batch=12), dict(n_gpus=8, pp=8, vp=2)):  # m = 3 not a multiple of pp; 16 > 8
        args = dict(n_layer=8, n_head=8, d_model=512, vocab=1000, seq_len=128, batch=16) | kw
        with pytest.raises(parallel.LayoutError):
            planner.plan(**args)


def test_format_plan_prints_every_section():
    text = planner.format_plan(planner.plan(32, 32, 4096, 32000, 4096, 1024, 64, tp=2, tokens=2e12))
    for word in ("model", "layout", "memory", "traffic", "step", "bubble", "MFU", "budget", "GPU-hours", "fits"):
        assert word in text


def test_zero3_moves_one_and_a_half_times_the_bytes_and_recomputation_keeps_one_input_per_layer():
    """ZeRO section 7: stage 3 all-gathers the 16-bit weights twice and reduce-scatters the 16-bit
    gradients once: 3Ψ against an all-reduce's 2Ψ. Full recomputation keeps each layer's input (and
    rebuilds one layer at a time); its forward runs twice, tensor-parallel pairs too."""
    shape = dict(n_layer=32, n_head=32, d_model=4096, vocab=32000, seq_len=4096, batch=64, n_gpus=64,
                 micro_batch=1, grad_bytes=2)  # one micro-batch per step on each of 64 data-parallel ranks
    dp = {z: planner.plan(zero=z, **shape)["comm"]["dp"] for z in range(4)}
    assert dp[1] == dp[2] == dp[0] and dp[3] == pytest.approx(1.5 * dp[0])
    accum = dict(shape, batch=256)  # 4 micro-batches: stage 2 reduce-scatters each, stage 3 gathers twice each
    assert planner.plan(zero=2, **accum)["comm"]["dp"] > 2 * planner.plan(zero=1, **accum)["comm"]["dp"]
    kw = {k: v for k, v in shape.items() if k != "n_gpus"}
    full, none = (planner.plan(tp=8, n_gpus=64, recompute=r, **kw) for r in ("full", "none"))
    per_layer = formulas.activation_bytes(4096, 1, 4096, 32, 8, True, norm_bytes=4)  # what "none" keeps per layer
    assert none["memory"]["activations"] == pytest.approx(32 * per_layer)
    # full: each layer's input (2 s b h / t under SP: ZeRO's 16-bit weights make a 16-bit stream), and one layer
    # rebuilt whole in the backward; without ZeRO the stream is fp32, and the input 4 s b h / t
    assert full["memory"]["activations"] == pytest.approx(32 * 2 * 4096 * 4096 / 8 + per_layer)
    full0 = planner.plan(tp=8, n_gpus=64, recompute="full", zero=0, **kw)["memory"]["activations"]
    assert full0 == pytest.approx(32 * 4 * 4096 * 4096 / 8 + per_layer)
    assert full["comm"]["tp"] == pytest.approx(1.5 * none["comm"]["tp"])
    assert full["time"]["compute"] > 1.3 * none["time"]["compute"]  # a second forward: 4 passes for 3


# ----------------------------------------------------------------------------- step time from the layout

LLAMA70 = (80, 64, 8192, 32000, 4096, 1024)  # lesson 19's shape, 4M-token steps


def test_matmul_efficiency_is_the_stated_model():
    """time = FLOPs at matmul_eff x peak + bytes at memory bandwidth, so efficiency =
    matmul_eff I / (I + matmul_eff ridge), I = 1 / (1/m + 1/k + 1/n) FLOPs per byte."""
    h100 = planner.GPUS["H100"]
    ridge = h100.peak / h100.hbm_bw
    for m, k, n in ((4096, 8192, 3072), (1024, 768, 96), (64, 64, 64)):
        i = planner.intensity(m, k, n)
        assert i == pytest.approx(m * k * n / (m * k + k * n + m * n))
        assert planner.matmul_efficiency(m, k, n, h100) == pytest.approx(
            h100.matmul_eff * i / (i + h100.matmul_eff * ridge))
    big = planner.matmul_efficiency(16384, 16384, 16384, h100)
    assert 0.9 * h100.matmul_eff < big < h100.matmul_eff
    assert planner.matmul_efficiency(64, 64, 64, h100) < 0.1  # far below the ridge: memory-bound


def test_smaller_micro_batches_and_more_tp_run_the_matmuls_further_below_peak():
    """Narayanan et al. 2021, section 3.4 (figure 7) and 3.3: per-GPU matmuls shrink with the
    micro-batch (m = b s) and with tp (k or n = 4h/tp), and so does their efficiency."""
    eff = {(tp, b): planner.plan(*LLAMA70, 512, tp=tp, pp=4 if tp == 4 else 2, micro_batch=b)["matmul_eff"]
           for tp in (4, 8) for b in (1, 2, 4)}
    assert eff[8, 1] < eff[8, 2] < eff[8, 4]
    assert eff[4, 1] < eff[4, 2] < eff[4, 4]
    assert all(eff[8, b] < eff[4, b] for b in (1, 2, 4))
    # GPT-2 124M at tp 4: k = 192 or n = 576, small enough to lose a large share of the peak
    gpt2 = planner.plan(12, 12, 768, 50257, 1024, 512, 64, tp=4, micro_batch=1)
    assert gpt2["matmul_eff"] < 0.7 * eff[8, 1]


def test_tensor_parallelism_across_nodes_is_slower():
    """tp 16 on nodes of 8 GPUs puts every layer's all-reduces on the network; the same tp 16 inside a
    node of 16 GPUs keeps them on NVLink."""
    within = planner.plan(*LLAMA70, 512, tp=16, gpus_per_node=16)
    across = planner.plan(*LLAMA70, 512, tp=16)
    tp8 = planner.plan(*LLAMA70, 512, tp=8, pp=2)
    assert across["time"]["tp"] == pytest.approx(within["time"]["tp"] * 450 / 50)  # NVLink / the NIC
    assert across["step_s"] > 3 * within["step_s"] and across["step_s"] > 3 * tp8["step_s"]


def test_more_micro_batches_shrink_the_bubble():
    """The bubble is (p - 1)/vp micro-batch times of one stage: a larger batch (more micro-batches)
    leaves it the same in seconds and smaller as a share; interleaving divides it by about vp."""
    shares = []
    for batch in (256, 512, 1024, 2048):
        p = planner.plan(80, 64, 8192, 32000, 4096, batch, 512, tp=8, pp=4)
        shares.append(p["time"]["bubble"] / p["modeled_step_s"])
        per_stage = (p["time"]["compute"] + p["time"]["tp"] + p["time"]["pp"]) / p["micro_batches"]
        assert p["time"]["bubble"] < 3 * per_stage  # (p - 1) = 3 micro-batches of a stage without the loss layer
    assert shares == sorted(shares, reverse=True)
    one, two = (planner.plan(*LLAMA70, 512, tp=8, pp=4, vp=v)["time"]["bubble"] for v in (1, 2))
    assert two == pytest.approx(one / 2, rel=0.01)  # (v m messages: a little more than half)


def test_the_layouts_of_lesson_12_are_ranked():
    """Every 512-GPU row of lesson 19 used to take the same 8.70 s: now the layout decides."""
    steps = {(tp, pp): planner.plan(*LLAMA70, 512, tp=tp, pp=pp)["step_s"]
             for tp, pp in ((4, 4), (8, 1), (8, 2), (8, 4))}
    assert len({round(s, 2) for s in steps.values()}) == 4
    assert steps[4, 4] < steps[8, 4]  # half the tp traffic and larger matmuls beat a 4% smaller bubble here
    for b in (1, 2):  # more tp: more exposed all-reduces
        assert planner.plan(*LLAMA70, 512, tp=8, pp=2, micro_batch=b)["time"]["tp"] > \
            planner.plan(*LLAMA70, 512, tp=4, pp=4, micro_batch=b)["time"]["tp"]


def test_step_is_its_parts_and_data_parallel_traffic_hides_but_for_its_tail():
    p = planner.plan(*LLAMA70, 512, tp=8, pp=2)
    assert p["step_s"] == pytest.approx(sum(p["time"].values()))
    assert p["mfu"] == pytest.approx(p["flops_per_token"] * 1024 * 4096 / (512 * 989e12 * p["step_s"]))
    tail = planner.BUCKET_BYTES * 31 / 32 / (planner.LINK_EFFICIENCY * 50e9)
    assert tail < p["time"]["dp"] < p["comm_s"]["dp"]  # partly hidden, never less than its last bucket
    # one micro-batch per step: its whole backward hides the reduce-scatter, so more of it is hidden
    single = planner.plan(*LLAMA70, 2048, tp=8, pp=1, micro_batch=4, zero=1)
    assert single["time"]["dp"] < 0.5 * single["comm_s"]["dp"]
    alone = planner.plan(*LLAMA70[:5], 64, 64, tp=8, pp=8)  # dp = 1: nothing to reduce
    assert alone["time"]["dp"] == 0 and alone["comm"]["dp"] == 0


def test_headroom_decides_what_fits():
    p = planner.plan(*LLAMA70, 512, tp=8, pp=1)  # 70 GB of 80: over 75%
    assert p["memory"]["total"] > planner.HEADROOM * 80e9 and not p["fits"]
    q = planner.plan(*LLAMA70, 512, tp=8, pp=2)
    assert q["memory"]["total"] <= planner.HEADROOM * 80e9 and q["fits"]


@pytest.mark.parametrize("pp,m,vp,warns", [(4, 4, 1, True), (4, 8, 1, False), (2, 2, 1, True), (2, 4, 1, False),
                                           (4, 8, 2, False), (4, 4, 2, False), (8, 16, 1, True), (8, 32, 1, False),
                                           (1, 1, 1, False)])
def test_pipeline_warning_when_the_bubble_exceeds_its_threshold(pp, m, vp, warns):
    """train.py logs this line: lesson 11's --pp 4 --micro-batch-size 2 (m = 4: 43%) warns, its
    --pp 4 run with m = 8 (27%) does not; m >= 4 p never warns."""
    line = pipeline.bubble_warning(pp, m, vp)
    assert (line is not None) == warns == ((pp - 1) / (vp * m + pp - 1) > pipeline.BUBBLE_WARNING)
    if warns:
        assert line.startswith(f"warning: {m} micro-batches for {pp} stages") and "%" in line
    assert pipeline.bubble_warning(pp, 4 * pp, vp) is None


def test_mfu_denominator_is_the_rate_the_matmuls_run_at(monkeypatch):
    """On a GPU (a name only here: nothing runs on it): the 16-bit tensor-core peak for bf16 and fp16;
    for fp32 the plain fp32 peak, unless TF32 is allowed (then half the 16-bit rate)."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda")
    assert planner.peak_flops(cuda, "bf16") == planner.peak_flops(cuda, "fp16") == 989e12
    assert planner.peak_flops(cuda, "fp32") == 67e12  # PyTorch's default: "highest", no TF32
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert planner.peak_flops(cuda, "fp32") == 989e12 / 2
    assert planner.unknown_gpu(cuda) is None and planner.unknown_gpu(torch.device("cpu")) is None
    # fp8: its share of the FLOPs at the fp8 peak (twice the 16-bit one), the rest at the 16-bit peak
    assert planner.peak_flops(cuda, "fp8", 0.0) == 989e12
    assert planner.peak_flops(cuda, "fp8", 1.0) == pytest.approx(1979e12)
    assert planner.peak_flops(cuda, "fp8", 0.8) == pytest.approx(1 / (0.8 / 1979e12 + 0.2 / 989e12))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA B200")
    assert planner.peak_flops(cuda, "fp8", 1.0) == pytest.approx(4500e12)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA RTX PRO 6000")  # not in the table:
    assert planner.peak_flops(cuda, "bf16") == 312e12  # an A100's peak stands in, and train.py says so
    assert planner.unknown_gpu(cuda).startswith("note: NVIDIA RTX PRO 6000 is not in planner.GPU_PEAKS")


def test_mfu_never_exceeds_100_percent_when_the_cpu_peak_was_measured_low(monkeypatch):
    """The CPU's peak is the best of a short burst of matmuls at start; on a busy machine that burst can be slow
    (mfu=509% was seen). A step faster than the peak re-measures it, once, and metrics.jsonl says so in one
    event; the peak never stays below a rate a step reached, so MFU is at most 100%."""
    from types import SimpleNamespace

    import config
    import stability
    measured = iter([1e9, 4e9])  # at start, while the machine was busy; then again, idle
    monkeypatch.setattr(planner, "measured_matmul_flops", lambda: next(measured))
    events = []
    run = SimpleNamespace(model_cfg=gpt.config_from_preset("tiny", 257), cfg=config.TrainConfig(seq_len=32),
                          precision=stability.PRECISIONS["fp32"], device=torch.device("cpu"),
                          grid=parallel.Grid(rank=0), log=print,
                          metrics=SimpleNamespace(log=lambda **row: events.append(row)))
    mfu = reports.MFU(run)
    flops = gpt.flops_per_token(run.model_cfg, 32)
    rows = [{"step": i + 1, "tokens_per_sec": rate / flops} for i, rate in enumerate((0.5e9, 3e9, 2e9, 5e9))]
    for row in rows:
        mfu.step_end(row)
    assert [round(r["mfu"], 6) for r in rows] == [0.5, 0.75, 0.5, 1.0]  # peaks 1, 4 (re-measured), 4, 5 GFLOP/s
    assert len(events) == 1 and events[0]["event"] == "mfu peak" and events[0]["step"] == 2, events
    assert (events[0]["was"], events[0]["now"]) == (1e9, 4e9) and "re-measured" in events[0]["why"]


def test_the_fused_loss_never_holds_the_logits(monkeypatch):
    """Memory of the loss and its backward (lmhead.lm_head_loss), fp32: one chunk of logits + dW, against
    ~3 copies of all logits for the unfused loss."""
    import torch.nn.functional as F

    import lmhead
    torch.manual_seed(0)
    N, C, V = 1000, 32, 4096
    x = torch.randn(N, C, requires_grad=True)
    w = torch.randn(V, C, requires_grad=True)
    targets = torch.randint(0, V, (N,))
    monkeypatch.setattr(lmhead, "LOSS_CHUNK_BYTES", 4 * V * 128)  # 8 chunks of 128 rows, the last short
    cpu = torch.device("cpu")
    fused = reports.peak_memory(lambda: lmhead.lm_head_loss(x, w, targets).backward(), cpu)
    unfused = reports.peak_memory(lambda: F.cross_entropy(x @ w.t(), targets).backward(), cpu)
    logits = N * V * 4
    assert unfused >= 2 * logits and fused <= logits / 4 and unfused >= 4 * fused, (fused, unfused, logits)


def test_kv_cache_bytes_are_what_sampling_holds():
    """formulas.kv_cache_bytes against the caches a prefill fills, for multi-head GPT-2 and GQA Llama (2 of 4
    kv heads: half the bytes)."""
    held = {}
    for preset in ("tiny", "llama-tiny"):
        cfg = gpt.config_from_preset(preset, 257)
        caches = [gpt.KVCache() for _ in range(cfg.n_layer)]
        with torch.no_grad():
            gpt.build(cfg, seed=0).next_logits(torch.randint(0, 257, (3, 20)), 0, caches)
        held[preset] = sum(c.k.nbytes + c.v.nbytes for c in caches)
        assert held[preset] == formulas.kv_cache_bytes(cfg, 3, 20, element_bytes=4)
    assert held["llama-tiny"] * 2 == held["tiny"]


def test_zero_variants_bytes_by_link_are_the_hand_computation():
    t = planner.zero_variant_traffic(1000, 200, dp=16, per_node=4, m=2, block=50)  # Ψ = 1000, the embeddings' 200

    def on(name, link):
        return sum(b for _, where, b, _ in t[name] if where == link)

    # ZeRO-3: reduce-scatter 4Ψ and two gathers of 2Ψ per micro-batch, all over 16 ranks on 4 nodes
    assert (on("ZeRO-3", "node"), on("ZeRO-3", "network")) == (0, 2 * (4 + 2 * 2) * 1000 * 15 / 16)
    # MiCS: the same inside the node (4 ranks); once a step the 4Ψ/4 shard all-reduced over 4 replicas
    assert (on("MiCS", "node"), on("MiCS", "network")) == (2 * 8000 * 3 / 4, 1000 * 2 * 3 / 4)
    # ZeRO++: int4 (1/2 + 4/50 bytes an element) all-to-alls of Ψ in the node, Ψ/4 across nodes; the backward's
    # 2Ψ of the blocks in the node; the forward's int8 (1 + 4/50) over all 16, the embeddings' unit twice
    node = 2 * (500 + 80) * 3 / 4 + 2 * 2 * 800 * 3 / 4
    network = 2 * (125 + 20) * 3 / 4 + 2 * ((800 + 64) + 2 * (200 + 16)) * 15 / 16
    assert (on("ZeRO++", "node"), on("ZeRO++", "network")) == (node, network)
    wide = planner.zero_variant_traffic(1000, 200, dp=16, per_node=4, m=2, shard=8, block=50)["MiCS"]
    assert {where for _, where, _, _ in wide} == {"network"}  # a shard group wider than a node: all across


def test_zero_variants_gpt3_at_1024_gpus():
    gpt3 = gpt.GPTConfig(n_layer=96, n_head=96, n_embd=12288, block_size=2048, vocab_size=50257)
    z = planner.zero_variants(gpt3, 2048, 2048, 1024, 300e9)
    v, p = z["variants"], z["plan"]
    # the ZeRO-3 row is plan_model's own (zero=3): its data-parallel bytes, its step, its days
    assert v["ZeRO-3"]["network"] == pytest.approx(p["comm"]["dp"]) and v["ZeRO-3"]["node"] == 0
    assert v["ZeRO-3"]["days"] == pytest.approx(p["days"]) and v["ZeRO-3"]["days_saved"] == 0
    assert v["ZeRO++"]["network"] < v["MiCS"]["network"] * 3 < v["ZeRO-3"]["network"]
    assert 0 < v["MiCS"]["days_saved"] and 0 < v["ZeRO++"]["days_saved"] < v["ZeRO-3"]["days"]
    assert not v["MiCS"]["fits"] and v["ZeRO-3"]["fits"] and v["ZeRO++"]["fits"]  # MiCS: 18 bytes / 8 GPUs, no
    assert v["ZeRO++"]["memory"] - v["ZeRO-3"]["memory"] == pytest.approx(2 * (p["params"] - 643325952) / 8)
    # the paper's accounting (fp16 gradients, the int4 gradient whole across nodes): its 4x but for the scales
    assert z["paper_ratio"] == pytest.approx(6 / (1.5 + 8 / 256)) and abs(z["paper_ratio"] / 4 - 1) < 0.03
    assert z["ratio"] > 7 and "does not fit" in planner.format_zero_variants(z)  # ours: fp32 gradients, 1/8 across
    for gpus, shard in [(8, 0), (12, 0), (16, 3)]:  # one node, part of a node, a shard group that does not divide
        with pytest.raises(parallel.LayoutError):
            planner.zero_variants(gpt3, 2048, 2 * gpus, gpus, 1e9, shard=shard)


@pytest.mark.parametrize("cp_attn", ["ring", "ulysses"])
def test_context_parallel_plans_split_the_sequence_and_send_context_traffic(cp_attn):
    """cp ranks hold s / cp tokens each: activations / cp; ZeRO shards over dp x cp, so dp 4 x cp 2 holds
    what dp 8 does; the bytes are context_traffic's: ring, per layer and micro-batch, K and V (bf16) once
    forward and once backward, dK and dV (fp32) cp times; Ulysses, 2 all-to-alls of q, k, v and the output
    each way. A Llama-3-8B shape (GQA: 8 of 32 heads) at 32k tokens, on two nodes."""
    shape = gpt.config_from_preset("llama-3-8b", 128256)
    kw = dict(seq_len=32768, batch=16, n_gpus=16, tp=4, zero=3, cp_attn=cp_attn)
    one, two = (planner.plan_model(shape, cp=cp, **kw) for cp in (1, 2))
    assert (one["dp"], two["dp"], two["micro_batches"]) == (4, 2, 8)  # m per step doubles: dp halves
    assert two["memory"]["activations"] == pytest.approx(one["memory"]["activations"] / 2)
    assert two["memory"]["weights"] == one["memory"]["weights"]  # sharded over dp x cp = 4 either way
    kv = 2 * 16384 * 8 * 128 / 4  # bf16 K of one layer on one rank: s/cp tokens of 8 kv heads of 128, / tp
    act = 2 * 16384 * 4096 / 4
    if cp_attn == "ring":  # 8 micro-batches of 32 layers
        assert two["comm"]["cp"] == pytest.approx(8 * 32 * (2 * kv + 2 * kv + 2 * 2 * (2 * kv)))
    else:  # q, k, v and the output, forward and backward, of which (cp - 1) / cp = 1/2 leaves the GPU
        assert two["comm"]["cp"] == pytest.approx(8 * 32 * 2 * (2 * act + 2 * kv) / 2)
    assert "cp" not in one["comm"] and two["time"]["cp"] >= 0
    assert f"x cp 2 ({cp_attn}) x tp 4" in planner.format_plan(two)
    with pytest.raises(parallel.LayoutError):  # a cp that does not divide the GPUs, or a 2 cp block per rank
        planner.plan_model(shape, cp=3, **kw)
