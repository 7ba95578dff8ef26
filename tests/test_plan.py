"""formulas.plan: the paper estimates of lesson 12, held to model.py and to published figures."""

import pytest
import torch

import formulas
import model as gpt
import parallel
import pipeline

GB = 1e9


@pytest.mark.parametrize("preset", ["gpt2", "gpt2-medium", "gpt2-xl", "tiny"])
def test_parameters_and_flops_are_model_pys(preset):
    cfg = gpt.config_from_preset(preset, 50257)
    with torch.device("meta"):
        m = gpt.GPT(cfg)
    p = formulas.plan(cfg.n_layer, cfg.n_head, cfg.n_embd, 50257, cfg.block_size, batch=8, n_gpus=1)
    assert p["params"] == gpt.count_params(m)  # gpt2: 124,475,904 with the vocabulary padded to 50304
    assert p["flops_per_token"] == gpt.flops_per_token(cfg, cfg.block_size)


# Narayanan et al. 2021, table 1: (billions of parameters, heads, hidden, layers); V = 51200, s = 2048
MEGATRON_TABLE_1 = [(1.7, 24, 2304, 24), (3.6, 32, 3072, 30), (7.5, 32, 4096, 36), (18.4, 48, 6144, 40),
                    (39.1, 64, 8192, 48), (76.1, 80, 10240, 60), (145.6, 96, 12288, 80),
                    (310.1, 128, 16384, 96), (529.6, 128, 20480, 105), (1008.0, 160, 25600, 128)]


@pytest.mark.parametrize("billions,heads,hidden,layers", MEGATRON_TABLE_1)
def test_megatron_table_1_parameter_counts(billions, heads, hidden, layers):
    p = formulas.plan(layers, heads, hidden, 51200, 2048, batch=1, n_gpus=1)
    # their formula has no final LayerNorm (2h); everything else is the same count
    assert round((p["params"] - 2 * hidden) / 1e9, 1) == billions


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16), (8, 64)])
def test_bubble_is_the_formula_and_the_simulated_1f1b_schedule(pp, m):
    p = formulas.plan(8, 8, 512, 1000, 128, batch=2 * m, n_gpus=2 * pp, pp=pp, micro_batch=1)
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
    one, eight = (formulas.plan(n_gpus=2 * dp, **shape)["memory"] for dp in (1, 8))
    assert eight["optimizer"] == pytest.approx(one["optimizer"] / 8)
    assert (eight["weights"], eight["grads"], eight["activations"]) == (one["weights"], one["grads"],
                                                                        one["activations"])
    no_zero = formulas.plan(n_gpus=16, zero=0, **shape)["memory"]
    assert no_zero["optimizer"] == one["optimizer"]
    # Megatron's distributed optimizer: 2 + 4 + 12/dp bytes per parameter of this GPU's share
    n_local = formulas.plan(n_gpus=16, **shape)["params"] / 2
    assert eight["weights"] + eight["grads"] + eight["optimizer"] == pytest.approx((6 + 12 / 8) * n_local)


def test_zero_paper_figure_1():
    """7.5B parameters on 64 GPUs, fp16 gradients: 120 GB, then 31.4, 16.6 and 1.9 GB per GPU."""
    per_gpu = [sum(formulas.state_bytes(7.5e9, 64, zero, grad_bytes=2)) / GB for zero in range(4)]
    assert [round(x, 1) for x in per_gpu] == [120.0, 31.4, 16.6, 1.9]


def test_activations_under_1f1b_are_all_layers_whatever_pp():
    """Korthikanti et al. 2022, section 4.2.3: the first stage holds pp micro-batches of L/pp layers."""
    acts = [formulas.plan(80, 64, 8192, 32000, 4096, batch=1024, n_gpus=64 * pp, tp=8, pp=pp)
            ["memory"]["activations"] for pp in (1, 2, 4, 8)]
    assert acts == [34 * 4096 * 8192 / 8 * 80] * 4  # 11.4 GB with sequence parallelism


def test_traffic_formulas():
    p = formulas.plan(80, 64, 8192, 32000, 4096, batch=1024, n_gpus=512, tp=8, pp=4)
    act = 2 * 4096 * 8192  # one bf16 activation of a sequence
    assert p["comm"]["tp"] == pytest.approx(4 * 20 * 64 * act * 2 * 7 / 8)  # 4 per layer, 20 layers, m = 64
    assert p["comm"]["pp"] == pytest.approx(2 * 64 * act / 8)
    no_zero = formulas.plan(80, 64, 8192, 32000, 4096, batch=1024, n_gpus=512, tp=8, pp=4, zero=0)
    # ZeRO: fp32 reduce-scatter + bf16 all-gather, 6 bytes per parameter; an fp32 all-reduce: 8
    assert p["comm"]["dp"] == pytest.approx(0.75 * no_zero["comm"]["dp"])


@pytest.mark.parametrize("shape,tp,pp,gpus,batch,tokens,tflops,days", [
    ((96, 96, 12288), 8, 16, 1024, 1536, 300e9, 140, 34),  # GPT-3 175B
    ((128, 160, 25600), 8, 64, 3072, 3072, 450e9, 163, 84),  # 1T
])
def test_megatron_2021_training_time_estimates(shape, tp, pp, gpus, batch, tokens, tflops, days):
    """Narayanan et al. 2021, section 5.1: time = 8 T P / (n X). X counts the FLOPs of full activation
    recomputation (8 per parameter and token); model FLOPs are 6, so MFU = X / peak * 6 / 8."""
    mfu = tflops / 312 * 6 / 8  # A100: 312 TFLOP/s bf16
    p = formulas.plan(*shape, 51200, 2048, batch, gpus, tp=tp, pp=pp, tokens=tokens, mfu=mfu,
                      peak_flops=312e12)
    assert p["days"] == pytest.approx(days, rel=0.05)  # ours also counts attention: +1-3%


@pytest.mark.parametrize("shape,gpu_hours", [
    ((32, 32, 4096), 184_320),  # Llama 2 7B
    ((80, 64, 8192), 1_720_320),  # Llama 2 70B (GQA and a wider MLP: our N is ~6% low)
])
def test_llama2_gpu_hours_imply_a_plausible_mfu(shape, gpu_hours):
    """Touvron et al. 2023, table 2: A100-80GB hours for 2T tokens. At 100% MFU the plan needs
    gpu_hours_at_1; the published hours then imply the MFU, which must look like a real run's."""
    p = formulas.plan(*shape, 32000, 4096, 1024, 2048, tp=8, tokens=2e12, mfu=1.0, peak_flops=312e12)
    implied = p["gpu_hours"] / gpu_hours
    assert 0.40 < implied < 0.48, implied


def test_impossible_layouts_are_refused():
    for kw in (dict(n_gpus=12, tp=8), dict(n_gpus=8, tp=3), dict(n_gpus=8, pp=16), dict(n_gpus=8, batch=12)):
        args = dict(n_layer=8, n_head=8, d_model=512, vocab=1000, seq_len=128, batch=16) | kw
        with pytest.raises(parallel.LayoutError):
            formulas.plan(**args)


def test_format_plan_prints_every_section():
    text = formulas.format_plan(formulas.plan(32, 32, 4096, 32000, 4096, 1024, 64, tokens=2e12))
    for word in ("model", "layout", "memory", "traffic", "time", "budget", "GPU-hours"):
        assert word in text


def test_zero3_moves_one_and_a_half_times_the_bytes_and_recomputation_keeps_one_input_per_layer():
    """ZeRO section 7: stage 3 all-gathers the 16-bit weights twice and reduce-scatters the 16-bit
    gradients once: 3Ψ against an all-reduce's 2Ψ. Korthikanti et al.: full recomputation keeps 2 s b h
    per layer of the 34 s b h that selective keeps; and its forward runs twice, tensor-parallel pairs too."""
    shape = dict(n_layer=32, n_head=32, d_model=4096, vocab=32000, seq_len=4096, batch=64, n_gpus=64,
                 micro_batch=1, grad_bytes=2)  # one micro-batch per step on each of 64 data-parallel ranks
    dp = {z: formulas.plan(zero=z, **shape)["comm"]["dp"] for z in range(4)}
    assert dp[1] == dp[2] == dp[0] and dp[3] == pytest.approx(1.5 * dp[0])
    accum = dict(shape, batch=256)  # 4 micro-batches: stage 2 reduce-scatters each, stage 3 gathers twice each
    assert formulas.plan(zero=2, **accum)["comm"]["dp"] > 2 * formulas.plan(zero=1, **accum)["comm"]["dp"]
    full, selective = (formulas.plan(tp=8, n_gpus=64, recompute=r, **{k: v for k, v in shape.items()
                                                                     if k != "n_gpus"}) for r in ("full", "selective"))
    assert full["memory"]["activations"] == pytest.approx(selective["memory"]["activations"] * 2 / 34)
    assert full["comm"]["tp"] == pytest.approx(1.5 * selective["comm"]["tp"])
