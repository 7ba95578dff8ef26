"""Activation memory: what autograd keeps for the backward, per layer, counted (reports.SavedActivations)
against formulas.activation_formula, the one model plan(), --memory-report and the lessons use (lessons 03,
14 and 19): each --recompute, bf16 autocast on fp32 and 16-bit parameters, the Llama family's layer."""

import pytest
import torch

import model as gpt
from instruments import formulas, reports


@pytest.mark.parametrize("attn,dropout", [("math", 0.0), ("sdpa", 0.0), ("sdpa", 0.1)])
def test_recomputation_saves_the_activations_the_formula_predicts(attn, dropout):
    """Bytes autograd keeps for the backward, per layer, counted (reports.SavedActivations) against
    formulas.activation_formula for each --recompute: each within 10%, so the factors too. With the
    math backend selective drops the (T, T) probabilities; with a fused kernel there is nothing to drop."""
    measured, predicted = {}, {}
    for mode in ("none", "selective", "full"):
        cfg = gpt.config_from_preset("tiny", 257, recompute=mode, attn=attn, dropout=dropout)
        m = gpt.build(cfg, seed=0)
        x = torch.randint(0, 257, (8, 33), generator=torch.Generator().manual_seed(0))
        with reports.SavedActivations(m, torch.device("cpu")) as acts:
            m(x[:, :-1], x[:, 1:])[1].backward()
        measured[mode] = acts.per_layer
        predicted[mode] = formulas.activation_formula(cfg, 32, 8, 1, False, mode, attn, 4, mask_bytes=1)[0]
        assert measured[mode] == pytest.approx(predicted[mode], rel=0.1), mode
    assert measured["none"] / measured["full"] == pytest.approx(predicted["none"] / predicted["full"], rel=0.1)
    # 16 s b h, + a s^2 b (math) or + 2 s b h of 1-byte masks (dropout.py's bools), against s b h in fp32
    assert predicted["none"] / predicted["full"] == {"math": 18, "sdpa": 16 + 2 / 4 * (dropout > 0)}[attn]
    if attn == "math":  # the probabilities are 2 of the 18
        assert measured["none"] > 1.1 * measured["selective"]
    else:
        assert measured["none"] >= measured["selective"]


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("params", [torch.float32, torch.bfloat16], ids=["fp32-params", "bf16-params"])
def test_saved_activations_under_bf16_autocast_match_the_formula(params, recompute):
    """bf16 compute on fp32 parameters (no ZeRO): the residual stream is fp32, so the LayerNorms keep
    4-byte inputs, and autocast's bf16 copies of the weights, though saved for the backward, are weight
    memory. On bf16 parameters every saved tensor is 2 bytes. Within 3% either way (what the formula
    leaves out, LayerNorm statistics and the attention log-sum-exp, is 1.4% at these widths); counting the
    weight copies as activations was 23% over. Under full recomputation a block keeps its input, the
    residual stream: 4 bytes on fp32 parameters (counted at 2, the formula said half of what was kept)."""
    cfg = gpt.config_from_preset("tiny", 257, attn="sdpa", recompute=recompute)
    m = gpt.build(cfg, seed=0).to(params)
    x = torch.randint(0, 257, (8, 65), generator=torch.Generator().manual_seed(0))
    with reports.SavedActivations(m, torch.device("cpu")) as acts, torch.autocast("cpu", torch.bfloat16):
        m(x[:, :-1], x[:, 1:])
    stream = params.itemsize  # on CUDA the LN inputs are 4 either way: autocast runs layer_norm in fp32 there
    predicted = formulas.activation_formula(cfg, 64, 8, 1, False, recompute, "sdpa", 2, 2, stream,
                                           residual_bytes=stream)[0]
    assert acts.per_layer == pytest.approx(predicted, rel=0.03)
    per_token = 2 * stream + 2 * 14 if recompute == "none" else stream  # LN inputs, 14 bf16 elements; the input
    assert predicted == 64 * 8 * 64 * per_token


@pytest.mark.parametrize("attn", ["sdpa", "math"])
def test_llama_saves_the_activations_its_formula_predicts(attn):
    """llama-tiny (h = 64, SwiGLU f = 4h, 2 of 4 kv heads), fp32: what autograd keeps per layer, counted, against
    formulas.llama_activation_bytes, each --recompute within 3%; term by term, 25 s b h elements: the two
    RMSNorms' inputs and normalized x (4), their outputs (2), q k v with half-width k and v (2), the attention
    output (1), SwiGLU's gate and up, silu(gate) and their product (4 f = 16); math adds the probabilities
    (a s / h = 2) and k, v repeated to every head (2 (1 - r) = 1). Under full recomputation each block keeps
    its input: the first block's is the embedding's output, which the counter once took for a weight (24.9)."""
    s, b, h = 32, 8, 64
    measured = {}
    for mode in ("none", "selective", "full"):
        cfg = gpt.config_from_preset("llama-tiny", 257, recompute=mode, attn=attn)
        m = gpt.build(cfg, seed=0)
        x = torch.randint(0, 257, (b, s + 1), generator=torch.Generator().manual_seed(0))
        with reports.SavedActivations(m, torch.device("cpu")) as acts:
            m(x[:, :-1], x[:, 1:])[1].backward()
        measured[mode] = acts.per_layer
        predicted = formulas.activation_formula(cfg, s, b, 1, False, mode, attn, 4, 4)
        assert predicted[1] is None  # Korthikanti et al. counted GPT-2's layer, not this one
        assert measured[mode] == pytest.approx(predicted[0], rel=0.03), mode
    sbh = s * b * h * 4
    assert formulas.activation_formula(cfg, s, b, 1, False, "none", attn, 4)[0] / sbh == (28 if attn == "math" else 25)
    assert measured["full"] == sbh  # exactly: the block input, on every layer
    assert measured["none"] / measured["selective"] == pytest.approx(28 / 25 if attn == "math" else 1, rel=0.01)


def test_llama_keeps_its_rmsnorms_in_fp32_under_bf16_autocast():
    """bf16 compute: autocast runs rms_norm in fp32, so a Llama layer keeps its RMSNorms' tensors in 4 bytes
    whether the parameters (the residual stream) are fp32 or bf16 (ZeRO's), unlike GPT-2's LayerNorm on a
    CPU (the test above this one); everything else is 2. Within 3%."""
    cfg = gpt.config_from_preset("llama-tiny", 257, attn="sdpa")
    x = torch.randint(0, 257, (8, 65), generator=torch.Generator().manual_seed(0))
    predicted = formulas.activation_formula(cfg, 64, 8, 1, False, "none", "sdpa", 2, 2, norm_bytes=2)[0]
    assert predicted == 64 * 8 * 64 * (4 * 4 + 2 * 21)  # 4 fp32 norm elements, then 21 bf16 ones per token
    for params in (torch.float32, torch.bfloat16):
        m = gpt.build(cfg, seed=0).to(params)
        with reports.SavedActivations(m, torch.device("cpu")) as acts, torch.autocast("cpu", torch.bfloat16):
            m(x[:, :-1], x[:, 1:])
        assert acts.per_layer == pytest.approx(predicted, rel=0.03), params
