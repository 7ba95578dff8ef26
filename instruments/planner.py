"""A training run on paper: what each GPU holds, what it sends, how long a step takes, how many days.

    p = plan(n_layer, n_head, d_model, vocab, seq_len, batch, n_gpus, tp=8, pp=4, ...)      a GPT-2 shape
    p = plan_model(model.config_from_preset("llama-3-8b"), seq_len, batch, n_gpus, tp=8, ...)  any of model.py's
    p = plan_model(GPTConfig(..., moe_experts=8, moe_top_k=2), seq_len, batch, n_gpus, ep=8)    with experts
    print(format_plan(p))

Before renting a thousand GPUs, a team works the run out on paper: the parameters and FLOPs per token
(PaLM's 6N + 12 L H Q T), the bytes of weights, gradients and optimizer state per GPU (ZeRO's
2Ψ + 2Ψ + 12Ψ, each divided by dp from its stage on), the activations a pipeline stage keeps in
flight (formulas.activation_bytes, the one activation model), the bytes each parallel group sends per
step (Megatron's all-reduces, the pipeline's messages, the gradient reduce), and from all of it the
time of one step on a given GPU:

    step = m (t_mb + logits) + bubble + what the data-parallel reduce leaves exposed
    t_mb = layers per stage x (matmuls + attention + elementwise work + tensor-parallel waits) + messages

A matmul's speed depends on its shape (matmul_seconds: FLOPs at the rate a large matmul sustains,
plus its operands' bytes at memory bandwidth), so a large tp or a small micro-batch, which shrink
the per-GPU matmuls, also slow them. One number is fitted: matmul_eff, 0.73 of peak, from Narayanan
et al. 2021's table 1, which plan() then reproduces within 6% (tests/test_plan.py); GPT-3's 34 days
come out within 4%. Lessons 12 and 19 use it to choose layouts.

With experts (moe.py) a model holds more parameters than a token uses: the plan prints both, counts the
FLOPs (so MFU and the step) on the active ones, splits the experts' memory over `ep` and adds expert
parallelism's all-to-alls (plan_model's docstring says how).

zero_variants() sets ZeRO-3 beside its hybrids for one model at scale (lesson 14): hybrid sharding over a
node (MiCS) and ZeRO++ (qwZ, hpZ, qgZ), with zero.py's formulas, the bytes each puts on NVLink and on the
network, what the step waits for, the days saved, and the cross-node reduction next to the paper's 4x.

The hardware tables live here too: GPUS, what plan() needs of a GPU and its links, and GPU_PEAKS with
`peak_flops`, the denominator of every MFU a run measures (reports.MFU; on a CPU a measured matmul).
"""

import dataclasses
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch

import model as gpt
import moe
from instruments.formulas import context_traffic, layer_activation_bytes, quantized_bytes
from parallel import LayoutError


def state_bytes(n_params: float, dp: int, zero: int = 1, grad_bytes: int = 4) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes of one model replica's parameters on one data-parallel
    rank. Weights are bf16 (2 bytes); the optimizer keeps K = 12 bytes per parameter (fp32 master
    copy, Adam's two moments). ZeRO stage 1 shards the optimizer over dp, stage 2 the gradients too,
    stage 3 the weights too (Rajbhandari et al. 2020, "ZeRO", section 5 and figure 1).
    grad_bytes=4 (fp32 gradients) is Megatron-LM's distributed optimizer and what `ZeroAdamW` does
    under --precision bf16: 6 + 12/dp bytes per parameter. Without ZeRO train.py keeps fp32 weights,
    fp32 gradients and torch's AdamW, whose moments are all its state: 4 + 4 + 8 = 16 (formulas.
    state_formula, what --memory-report prints). grad_bytes=2 is the ZeRO paper's 2Ψ + 2Ψ + KΨ/Nd,
    its stage 0 included."""
    if zero == 0 and grad_bytes == 4:
        return 4 * n_params, 4 * n_params, 8 * n_params
    return (2 * n_params / (dp if zero >= 3 else 1), grad_bytes * n_params / (dp if zero >= 2 else 1),
            12 * n_params / (dp if zero >= 1 else 1))


@dataclass(frozen=True)
class GPU:
    """What plan() needs to know about a GPU and its links (datasheet numbers, bytes and FLOP/s)."""
    name: str
    peak: float  # dense bf16 FLOP/s
    hbm: float  # bytes of memory
    hbm_bw: float  # memory bandwidth, bytes/s
    nvlink: float  # bytes/s per direction to the other GPUs of its node
    net: float  # bytes/s per direction across nodes: one NIC per GPU
    matmul_eff: float  # the share of `peak` a large, well-shaped bf16 matmul sustains (fitted, see plan)


GPUS = {"H100": GPU("H100 SXM", 989e12, 80e9, 3.35e12, 450e9, 50e9, 0.73),  # NVLink 4, a 400 Gb/s NIC
        "A100": GPU("A100 SXM 80GB", 312e12, 80e9, 2.04e12, 300e9, 25e9, 0.73)}  # NVLink 3, 200 Gb/s (Selene)
HEADROOM = 0.75  # the share of a GPU's memory a plan may fill: the rest is for what it does not count
LINK_EFFICIENCY = 0.77  # a ring collective's bus bandwidth / the link's datasheet rate (nccl-tests, 8 A100s:
#                         ~230 of 300 GB/s)
BUCKET_BYTES = 25e6  # train.py's --bucket-mb: the last bucket is launched as the backward ends, never hidden


# ----------------------------------------------------------------------------- the hardware, measured against


# Dense datasheet peaks (no sparsity): 16-bit tensor cores, fp32, and fp8 tensor cores where the GPU has them
GPU_PEAKS = {"H200": (989e12, 67e12, 1979e12), "H100": (989e12, 67e12, 1979e12), "B200": (2250e12, 80e12, 4500e12),
             "A100": (312e12, 19.5e12, None), "L40S": (362e12, 91.6e12, None), "A10": (125e12, 31.2e12, None),
             "4090": (165e12, 82.6e12, None), "3090": (71e12, 35.6e12, None), "V100": (125e12, 15.7e12, None),
             "T4": (65e12, 8.1e12, None)}


def peak_flops(device: torch.device, precision: str, fp8_share: float = 0.0) -> float:
    """Peak dense FLOP/s, the denominator of MFU: the datasheet's for a GPU in the precision the matmuls
    really run in; a measured fp32 matmul rate on CPU. Under fp8 a share of the FLOPs runs at the fp8 peak
    and the rest at the 16-bit one, so the peak is the rate that does both in the least time:
    1 / (share / fp8 peak + (1 - share) / 16-bit peak)."""
    if device.type == "cuda":
        half, single, eight = GPU_PEAKS[_peak_row(device) or "A100"]
        if precision == "fp8-fp32":
            half = half / 2 if torch.get_float32_matmul_precision() != "highest" else single
        if precision in ("fp8", "fp8-fp32") and eight:
            return 1 / (fp8_share / eight + (1 - fp8_share) / half)
        if precision != "fp32":
            return half
        return half / 2 if torch.get_float32_matmul_precision() != "highest" else single  # TF32, or not
    return measured_matmul_flops()


def _peak_row(device: torch.device) -> str | None:
    """The row of GPU_PEAKS whose key is in this GPU's name, if any."""
    name = torch.cuda.get_device_name(device)
    return next((k for k in GPU_PEAKS if k in name), None)


def unknown_gpu(device: torch.device) -> str | None:
    """The line train.py logs when MFU's denominator is a stand-in: a GPU whose name is not in GPU_PEAKS."""
    if device.type != "cuda" or _peak_row(device):
        return None
    return (f"note: {torch.cuda.get_device_name(device)} is not in planner.GPU_PEAKS, so MFU is measured "
            "against an A100's peak; add its datasheet numbers there")


def measured_matmul_flops(n: int = 1024, seconds: float = 0.3) -> float:
    """This CPU's fp32 matmul rate: the best a well-shaped matmul achieves here. The fastest of the
    calls made in `seconds`, not their mean, so that a busy moment on a shared machine cannot lower
    the bar that a training step is measured against."""
    gen = torch.Generator().manual_seed(0)  # its own stream: the run's RNG state is left alone
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    a @ b
    fastest, end = float("inf"), time.perf_counter() + seconds
    while (t0 := time.perf_counter()) < end:
        a @ b
        fastest = min(fastest, time.perf_counter() - t0)
    return 2 * n**3 / fastest



# ----------------------------------------------------------------------------- a run on paper


def exposed_s(seconds: float, window: float, tail: float) -> float:
    """What a transfer of `seconds` running beside `window` seconds of compute leaves the step waiting for:
    the part that does not fit, and never less than its last bucket (`tail` seconds), launched as the
    compute ends."""
    return max(min(seconds, tail), seconds - window)


def intensity(m: float, k: float, n: float) -> float:
    """Arithmetic intensity of an (m x k) @ (k x n) matmul in a 16-bit dtype, FLOPs per byte moved:
    2mkn / 2(mk + kn + mn) = 1 / (1/m + 1/k + 1/n). The smallest dimension sets it."""
    return 1 / (1 / m + 1 / k + 1 / n)


def matmul_seconds(m: float, k: float, n: float, gpu: GPU) -> float:
    """An (m x k) @ (k x n) bf16 matmul: its FLOPs at the rate a large matmul sustains, plus its bytes
    (two operands read, the result written) at memory bandwidth. Adding the two (rather than taking the
    larger, as a roofline does) charges every matmul the time to stream its operands: efficiency
    matmul_eff * I / (I + matmul_eff * ridge), ridge = peak / hbm_bw."""
    return 2 * m * k * n / (gpu.matmul_eff * gpu.peak) + 2 * (m * k + k * n + m * n) / gpu.hbm_bw


def matmul_efficiency(m: float, k: float, n: float, gpu: GPU) -> float:
    """The share of peak FLOP/s an (m x k) @ (k x n) matmul gets under matmul_seconds."""
    return 2 * m * k * n / (gpu.peak * matmul_seconds(m, k, n, gpu))


def layer_gemms(tokens: int, d: int, tp: int, qkv: int | None = None, hidden: int | None = None,
                gated: bool = False) -> list[tuple[int, float, float]]:
    """The (m, k, n) of a block's four weight matmuls on one tensor-parallel rank: c_attn and c_fc
    column-parallel (n / tp), the two c_proj row-parallel (k / tp); m is the micro-batch's tokens.
    GPT-2's widths by default: q, k, v 3d, the MLP 4d. A Llama's: q, k, v (H + 2 H_kv) D (`qkv`), and
    SwiGLU's c_fc makes the gate and up (`gated`: 2 `hidden`) for a c_proj of `hidden`."""
    qkv, hidden = qkv or 3 * d, hidden or 4 * d
    return [(tokens, d, qkv / tp), (tokens, d / tp, d), (tokens, d, (2 if gated else 1) * hidden / tp),
            (tokens, hidden / tp, d)]


def expert_params(shape: gpt.GPTConfig) -> tuple[int, int]:
    """(the experts' parameters, the share of them one token uses): per MoE layer E, and k, MLPs of the
    block's kind (GPT-2: c_fc and c_proj with their biases; Llama: SwiGLU's three matrices). The router
    is neither: every token uses it, so it counts like any replicated weight. 0 for a dense model."""
    n = moe.moe_layers(shape.n_layer, shape.moe_experts, shape.moe_every)
    mlp = (3 if shape.llama else 2) * shape.n_embd * shape.hidden + (0 if shape.llama else shape.hidden + shape.n_embd)
    return n * shape.moe_experts * mlp, n * shape.moe_top_k * mlp


def expert_forward_s(shape: gpt.GPTConfig, tokens: int, ep: int, gpu: GPU) -> float:
    """An MoE layer's MLP forward on one GPU: the router, (tokens, d) @ (d, E); this GPU's E / ep experts, each
    on tokens k ep / E rows (with even routing the ep group's k choices per token spread evenly over its
    experts), whole on every tp rank; the activation on k hidden rows per token; the permutation (a token's
    row copied k times, its k outputs weighted and summed back: 4 k d elements read or written)."""
    E, k, d, f = shape.moe_experts, shape.moe_top_k, shape.n_embd, shape.hidden
    rows = tokens * k * ep / E
    expert = matmul_seconds(rows, d, (2 if shape.llama else 1) * f, gpu) + matmul_seconds(rows, f, d, gpu)
    pointwise = 5 * f if shape.llama else 8 * d  # SwiGLU, or GELU (plan_model)
    return E / ep * expert + matmul_seconds(tokens, d, E, gpu) + 2 * tokens * k * (pointwise + 4 * d) / gpu.hbm_bw


def plan(n_layer: int, n_head: int, d_model: int, vocab: int, seq_len: int, batch: int, n_gpus: int,
         **layout) -> dict:
    """plan_model() of a dense GPT-2-shaped model of these sizes, its position table seq_len long."""
    shape = gpt.GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=d_model, block_size=seq_len, vocab_size=vocab)
    return plan_model(shape, seq_len, batch, n_gpus, **layout)


def plan_model(shape: gpt.GPTConfig, seq_len: int, batch: int, n_gpus: int, tp: int = 1, pp: int = 1,
               micro_batch: int = 1, zero: int = 1, tokens: float = 0.0, mfu: float | None = None,
               gpu: str | GPU = "H100", grad_bytes: int = 4, recompute: str = "none", attn: str = "flash",
               sp: bool = True, dropout: float = 0.0, vp: int = 1, gpus_per_node: int = 8, ep: int = 1,
               cp: int = 1, cp_attn: str = "ring") -> dict:
    """One training run of a model of model.py's `shape` (GPT-2 or the Llama family: a preset's
    config_from_preset; dense, or with experts), on paper: what each GPU holds, what it sends per optimizer
    step, how long a step takes on this layout and so how long `tokens` take.
    `batch` is the global batch in sequences (train.py's --batch-size); dp = n_gpus / (tp cp pp); ranks
    are laid out as Grid does (tp innermost, then cp, dp, pp), nodes of `gpus_per_node`. `gpu` names
    a row of GPUS. `vp` > 1: the interleaved schedule with vp chunks per stage.

    parameters  model.n_params: for GPT-2 12 L d^2 + 13 L d + (V + s) d + 2 d (Narayanan et al. 2021,
                sec. 5.1 without the final LayerNorm); FLOPs use the weights in matmuls (12 L d^2 + V d):
                6 N + 12 L H Q T per token (PaLM, appendix B; model.flops_per_token). A Llama's come from
                the same two functions: GQA's narrower k and v, SwiGLU's three matrices, the untied head
    Llama       what else changes: tp must divide the kv heads too (shard.py); c_attn is (H + 2 H_kv) D
                wide and c_fc 2 f, so the weights, the gradient traffic and the matmuls shrink with GQA and
                follow f; the activations are llama_activation_bytes (RMSNorms in fp32, through the fused
                kernel). What does not: the tensor-parallel all-reduces and pipeline messages carry the
                d-wide residual stream whatever H_kv (GQA shrinks K and V only inside a rank, and in
                context parallelism's ring, not planned here); the attention core's time is its H query
                heads'. The elementwise work per token: SwiGLU's 5 f / tp (silu reads and writes f, the
                product reads 2 f and writes f) and RoPE's 2 (H + 2 H_kv) D / tp in place of GELU's 8 d / tp
    memory      state_bytes() on the N / (tp pp) parameters this GPU holds, plus activation_bytes()
                per layer and micro-batch in bf16 (the one activation model; `attn="math"` keeps the
                s x s probabilities, flash kernels do not; the LayerNorms keep fp32 inputs, as autocast
                runs them on a GPU; full recomputation keeps each block's input at the residual stream's
                width, the weights': 2 bytes under ZeRO, 4 without); under 1F1B the first stage keeps
                min(pp, m) micro-batches of L/pp layers (interleaved: pp + (pp-1)/vp stages' worth,
                Korthikanti et al. 2022, 4.2.3); under full recomputation one layer is rebuilt whole
                in the backward. `fits`: the total under HEADROOM of the GPU's memory.
    traffic     bytes one GPU sends per step with ring collectives (2(n-1)/n of an all-reduced buffer):
                tp  4 all-reduces (or all-gather + reduce-scatter pairs) of one bf16 s b d activation
                    per layer per micro-batch (Shoeybi et al. 2019, sec. 3), 6 under full recompute;
                pp  one activation forward, one gradient backward per micro-batch and chunk, s b d / tp
                    each: under SP the activation is that long; without it Megatron-LM sends each
                    tensor-parallel rank's 1/tp share and all-gathers it on arrival (Narayanan et al.
                    2021, sec. 4.1; train.py without --sp sends all of it from every rank);
                dp  ZeRO: reduce-scatter the gradients, all-gather bf16 weights; without it,
                    all-reduce the gradients; once per step. Stages 2 and 3 hold no whole gradient, so
                    they reduce-scatter every micro-batch (m times), and stage 3 all-gathers the
                    weights twice per micro-batch (zero_traffic: what train.py measures).
    time        the step of the slowest (last) pipeline stage, built from the layout:
                  t_mb    = layers/stage x (compute + tp) + pp messages   one micro-batch on one stage
                  compute = 3 forwards' worth (the backward is two) + one more under full recompute
                            (selective: the attention core's forward), each forward made of
                            - the four weight matmuls, matmul_seconds(b s, d, 3d/tp) ...: smaller
                              per-GPU matmuls (small micro-batch, large tp) run further below peak
                            - the attention core, a/tp heads of 4 s^2 d/a FLOPs (a flash kernel skips
                              the masked half) plus bytes: q, k, v, o, and under `attn="math"` the
                              s x s scores written, softmaxed, read (and, with dropout, dropped as
                              Megatron-LM does: 6.5 element passes instead of 4)
                            - the memory-bound elementwise work at HBM bandwidth, per token:
                              LayerNorms and residual adds 10 d (11 with dropout masks; / tp under
                              SP), GELU 8 d / tp elements read or written
                  tp      all exposed (nothing overlaps them): ring time at LINK_EFFICIENCY x NVLink
                          within a node, x the network once tp spans nodes
                  step    = m (t_mb + logits) + (pp - 1)/vp t_mb      (the bubble: the last stage also
                            runs the output layer, 3 matmuls of (b s, d, V/tp))
                          + dp: the gradient reduce hides behind the last micro-batch's backward (every
                            micro-batch's under ZeRO-2/3), ZeRO's weight all-gather behind the next
                            step's first forward (Megatron-LM's overlapped gather; train.py gathers after
                            the update), except what does not fit and one bucket's tail
                matmul_eff (0.73 of peak for a large matmul) is the one fitted number: with it, the 10
                configurations of Narayanan et al. 2021, table 1 (full recomputation, materialized
                attention with dropout, no SP, on A100s) come out within 6% of their measured
                teraFLOP/s (tests/test_plan.py). Left out: the optimizer step, kernel launch latency,
                stragglers. `mfu` given: an assumed MFU sets the step time instead.
    experts     a shape with moe_experts E (top k, every moe_every-th block; moe.py), `ep` ranks of dp
                splitting them (dp % ep == 0, E % ep == 0). What changes:
                parameters  `params` is all of them (model.n_params); `active_params` what one token uses:
                            the experts' E MLPs per MoE layer counted k times (expert_params), the router
                            and everything else once. FLOPs per token are 6 x the active matmul weights +
                            attention (model.flops_per_token), so MFU and the step are on active FLOPs
                memory      the experts are split over ep and whole on every tp rank (moe.py replicates
                            them over tp), so a GPU holds experts / (pp ep) of their weights, and their
                            gradients and optimizer state are ZeRO-sharded over the dp / ep ranks holding
                            the same experts (edp); the rest as above, over tp pp and dp. (Activations:
                            counted as a dense layer's; the k hidden rows per token are left out)
                traffic     ep: per MoE layer and micro-batch 2 all-to-alls forward and 2 backward (3 and 3
                            under full recomputation) of the micro-batch's rows, b s k d x 2 bytes each,
                            (ep-1)/ep of which leave the GPU (even routing); over NVLink while tp x ep fits
                            in a node. An MoE layer's tp all-reduces are attention's 2 of the 4 (its MLP
                            talks not). dp: the expert gradients are reduced over edp
                time        an MoE layer's MLP is the router and this GPU's E / ep experts, each on
                            b s k ep / E rows (even routing; smaller matmuls run further below peak), not
                            divided by tp, plus the activation on k rows per token and the permutation
                            (4 k d elements); the all-to-alls are exposed (the next op waits for them).
                            A stage's MoE layers are its layers' average share of them. (`matmul_eff`
                            stays that of a dense layer's four matmuls)
    context     `cp` ranks split every sequence (context.py, `cp_attn` "ring" or "ulysses"): a GPU holds and
                computes s / cp tokens of each (activations, matmuls, messages), and its attention core
                s / cp queries against all s keys (load-balanced halves); the bytes per layer and micro-batch
                are formulas.context_traffic's (ring: K and V in bf16, dK and dV in fp32; Ulysses: the (cp-1)/cp of
                its all-to-alls that leave), over NVLink while
                tp cp fits in a node; ring hops hide behind the attention core's forward and backward
                (what does not fit is exposed), Ulysses' all-to-alls do not. ZeRO shards and gradients are
                reduced over dp x cp (and edp spans cp). MoE's gather of the k choices over cp: left out"""
    gpu = GPUS[gpu] if isinstance(gpu, str) else gpu
    dp = n_gpus // (tp * pp * cp)
    L, H, d, s, b, V = shape.n_layer, shape.n_head, shape.n_embd, seq_len, micro_batch, shape.padded_vocab
    kv = f", {shape.kv_heads} kv heads" if shape.kv_heads != H else ""
    heads = tp * cp if cp_attn == "ulysses" else tp  # Ulysses splits the heads over cp too
    if dp * tp * pp * cp != n_gpus or H % heads or shape.kv_heads % heads or L < pp * vp \
            or batch % (dp * micro_batch) or (vp > 1 and (batch // (dp * micro_batch)) % pp) or s % (2 * cp) \
            or (cp > 1 and attn == "math"):
        raise LayoutError(f"{n_gpus} GPUs as tp {tp} x cp {cp} x pp {pp} x dp, {H} heads{kv}, {L} layers, "
                          f"batch {batch} in micro-batches of {micro_batch}, attention {attn}"
                          f"{f', {vp} chunks per stage' if vp > 1 else ''}: not a possible layout")
    dp_cp, s_cp = dp * cp, s // cp  # the ranks gradients are reduced over; the tokens of a sequence one GPU holds
    E, k = shape.moe_experts, shape.moe_top_k
    if ep > 1 and (not E or dp % ep or E % ep):
        raise LayoutError(f"ep {ep}: " + (f"must divide dp {dp} and the {E} experts" if E else "no experts to split"))
    shape = dataclasses.replace(shape, dropout=dropout)
    n_params = gpt.n_params(shape)
    experts, used = expert_params(shape)  # 0, 0 for a dense model
    flops_per_token = gpt.flops_per_token(shape, s)
    local = (n_params - experts) / (tp * pp)  # the first and last stage also hold V d / tp of embedding: ignored
    expert_local = experts / (pp * ep)  # whole on each tp rank, split over ep
    weights, grads, optimizer = (a + e for a, e in zip(state_bytes(local, dp_cp, zero, grad_bytes),
                                                       state_bytes(expert_local, dp_cp // ep, zero, grad_bytes)))
    m, layers = batch // (dp * b), -(-L // pp)  # micro-batches per pipeline and step; layers of the last stage
    moe_here = layers * moe.moe_layers(L, E, shape.moe_every) / L  # of them MoE layers (on average)
    in_flight = min(m, pp + (pp - 1) / vp if vp > 1 else pp)  # stages' worth of micro-batches stage 0 holds

    stream = 2 if zero else 4  # the residual stream has the weights' dtype: 16 bits under ZeRO, fp32 without

    def per_layer(mode):  # bf16 activations, 1-byte masks, the LayerNorms' inputs in fp32 (autocast), the block
        # input that full recomputation keeps the stream's; a Llama's RMSNorms in fp32 through the fused kernel
        return layer_activation_bytes(shape, s_cp, b, tp, sp, mode, attn, 2, 1, 4, True, residual_bytes=stream)

    activations = per_layer(recompute) * layers * in_flight
    if recompute == "full":
        activations += per_layer("none")
    memory = {"weights": weights, "grads": grads, "optimizer": optimizer, "activations": activations,
              "total": weights + grads + optimizer + activations}
    act = 2 * s_cp * b * d  # one bf16 activation, bytes

    def ring(n):  # the fraction of a buffer each rank sends in a ring reduce-scatter or all-gather
        return (n - 1) / n

    reduces = m if zero >= 2 else 1  # stages 2 and 3 reduce-scatter every micro-batch's gradients
    gathers = 2 * m if zero >= 3 else 1  # stage 3 all-gathers the weights for each forward and backward
    pairs = 6 if recompute == "full" else 4  # tensor-parallel collectives per layer and micro-batch
    tp_layers = layers - moe_here / 2 if E else layers  # an MoE layer's MLP has no tp collectives
    a2a = pairs * 2 * b * s_cp * k * d  # an MoE layer's all-to-alls per micro-batch: bf16 rows of its b s k choices
    kv_bytes = 2 * b * s_cp * shape.kv_heads * shape.head_dim / tp  # K (or V) of one layer, bf16
    cp_layer = 0.0  # context parallelism's bytes per layer and micro-batch (what leaves: all of a ring hop)
    if cp > 1:
        cp_layer = sum(context_traffic(SimpleNamespace(cp=cp, cp_attn=cp_attn), act / tp, recompute, kv_bytes,
                                       2 * kv_bytes).values()) * (ring(cp) if cp_attn == "ulysses" else 1)

    def dp_bytes(n, group):  # n parameters' gradients reduced (under ZeRO: and weights gathered) over a group
        return (n * (grad_bytes * reduces + 2 * gathers) if zero else 2 * n * grad_bytes) * ring(group)

    comm = {"tp": pairs * tp_layers * m * act * 2 * ring(tp),  # an all-reduce = reduce-scatter + all-gather
            **({"ep": m * moe_here * a2a * ring(ep)} if E else {}),
            **({"cp": m * layers * cp_layer} if cp > 1 else {}),
            "pp": 2 * vp * m * act / tp if pp > 1 else 0.0,
            "dp": dp_bytes(local, dp_cp) + dp_bytes(expert_local, dp_cp // ep)}  # experts: over edp
    # each group's link: NVLink while the group stays inside a node (tp innermost, then dp (and ep), then pp)
    link = {g: LINK_EFFICIENCY * (gpu.nvlink if span <= gpus_per_node else gpu.net)
            for g, span in (("tp", tp), ("cp", tp * cp), ("ep", tp * cp * ep), ("dp", tp * dp_cp), ("pp", n_gpus))}
    comm_s = {g: comm[g] / link[g] for g in comm}

    # one micro-batch through one layer on one GPU: a forward, then the backward (twice the forward)
    tokens_mb, head_dim = b * s_cp, d / H
    qkv = (H + 2 * shape.kv_heads) * shape.head_dim  # q, k, v: 3d, or GQA's narrower k and v
    gemms = layer_gemms(tokens_mb, d, tp, qkv, shape.hidden, True) if shape.llama else layer_gemms(tokens_mb, d, tp)
    gemm_s = sum(matmul_seconds(*g, gpu) for g in gemms)
    score_passes = (6.5 if dropout > 0 else 4) if attn == "math" else 0  # s x s elements written or read
    attn_s = b * H / tp * (4 * s_cp * s * head_dim * (1 if attn == "math" else 0.5) / (gpu.matmul_eff * gpu.peak)
                           + 2 * (4 * s_cp * head_dim + score_passes * s_cp * s) / gpu.hbm_bw)
    mlp_pointwise = 5 * shape.hidden if shape.llama else 8 * d  # SwiGLU, or GELU
    pointwise = mlp_pointwise + 2 * qkv if shape.llama else mlp_pointwise  # and RoPE (docstring)
    elementwise_s = 2 * tokens_mb * ((11 if dropout > 0 else 10) * d / (tp if sp else 1) + pointwise / tp) / gpu.hbm_bw
    forward = gemm_s + attn_s + elementwise_s

    def with_backward(fwd):  # the backward is two forwards; recomputation adds the forward, or its attention core
        return 3 * fwd + {"full": fwd, "selective": attn_s, "none": 0.0}[recompute]

    compute = with_backward(forward)
    tp_s = pairs * act * 2 * ring(tp) / link["tp"]
    pp_s = comm_s["pp"] / m
    cp_s = cp_layer / link["cp"]  # a layer's ring hops run beside its attention core; Ulysses waits for its
    cp_s = max(cp_s - with_backward(attn_s), 0.0) if cp_attn == "ring" else cp_s
    moe_extra = ep_s = 0.0  # what an MoE layer adds to a dense one's compute; its all-to-alls
    if E:  # the MLP's matmuls and elementwise work replaced by the experts'
        dense_mlp_s = sum(matmul_seconds(*g, gpu) for g in gemms[2:]) + 2 * tokens_mb * mlp_pointwise / tp / gpu.hbm_bw
        moe_extra = with_backward(forward - dense_mlp_s + expert_forward_s(shape, tokens_mb, ep, gpu)) - compute
        ep_s = a2a * ring(ep) / link["ep"]
    t_mb = layers * (compute + tp_s + cp_s) + pp_s + moe_here * (moe_extra - tp_s / 2 + ep_s)  # MoE: half the tp waits
    logits_s = 3 * matmul_seconds(tokens_mb, d, V / tp, gpu)
    bubble_s = (pp - 1) / vp * t_mb
    per_micro = t_mb + logits_s  # the last stage: its layers and the output layer

    def exposed(seconds, window):
        return exposed_s(seconds, window, BUCKET_BYTES * ring(dp_cp) / link["dp"])

    if dp_cp == 1:
        dp_s = 0.0
    elif zero == 0:
        dp_s = exposed(comm_s["dp"], 2 / 3 * per_micro)
    else:
        reduce_s = (local * grad_bytes * reduces * ring(dp_cp)
                    + expert_local * grad_bytes * reduces * ring(dp_cp // ep)) / link["dp"]
        gather_window = m * per_micro if zero >= 3 else per_micro / 3
        dp_s = exposed(reduce_s, 2 / 3 * per_micro * reduces) + exposed(comm_s["dp"] - reduce_s, gather_window)
    time = {"compute": m * (layers * compute + logits_s + moe_here * moe_extra), "tp": m * tp_layers * tp_s,
            **({"ep": m * moe_here * ep_s} if E else {}), **({"cp": m * layers * cp_s} if cp > 1 else {}),
            "pp": m * pp_s, "bubble": bubble_s, "dp": dp_s}
    modeled = sum(time.values())
    step_s = modeled if mfu is None else flops_per_token * batch * s / (n_gpus * gpu.peak * mfu)
    seconds = tokens / (batch * s) * step_s
    return {"params": n_params, "active_params": n_params - experts + used, "experts": E, "top_k": k, "ep": ep,
            "flops_per_token": flops_per_token, "dp": dp, "tp": tp, "pp": pp, "vp": vp, "cp": cp, "cp_attn": cp_attn,
            "micro_batch": b, "micro_batches": m, "bubble": (pp - 1) / (vp * m + pp - 1), "gpu": gpu,
            "memory": memory, "fits": memory["total"] <= HEADROOM * gpu.hbm,
            "comm": comm, "comm_s": comm_s, "time": time, "modeled_step_s": modeled,
            "matmul_eff": sum(2 * x * y * z for x, y, z in gemms) / (gpu.peak * gemm_s),
            "mfu": flops_per_token * batch * s / (n_gpus * gpu.peak * step_s), "step_s": step_s,
            "tokens_per_s": batch * s / step_s, "n_gpus": n_gpus,
            "tokens": tokens, "days": seconds / 86400, "gpu_hours": seconds * n_gpus / 3600}


def format_plan(p: dict) -> str:
    """plan()'s numbers as a few lines of text (GB = 1e9 bytes)."""
    mem, comm, c, t = p["memory"], p["comm"], p["comm_s"], p["time"]
    chunks = f", {p['vp']} chunks per stage" if p["vp"] > 1 else ""
    cp = f"cp {p['cp']} ({p['cp_attn']}) x " if p["cp"] > 1 else ""
    fits = "fits" if p["fits"] else "does not fit"
    params = f"{p['params'] / 1e9:.2f}B parameters"
    if p["experts"]:  # total and active side by side; the FLOPs (and so MFU) are the active ones
        params += f" ({p['experts']} experts, top {p['top_k']}), {p['active_params'] / 1e9:.2f}B active per token"
        chunks += f"; experts split over ep {p['ep']}"
    lines = [f"model   {params}, {p['flops_per_token']:.3g} FLOPs per token",
             f"layout  {p['n_gpus']} {p['gpu'].name} = dp {p['dp']} x {cp}tp {p['tp']} x pp {p['pp']}{chunks}; "
             f"{p['micro_batches']} micro-batches of {p['micro_batch']} per step, bubble {p['bubble']:.1%}",
             "memory  " + "  ".join(f"{k} {v / 1e9:.1f}" for k, v in mem.items())
             + f" GB per GPU: {fits} in {HEADROOM:.0%} of {p['gpu'].hbm / 1e9:.0f} GB",
             "traffic " + "  ".join(f"{k} {comm[k] / 1e9:.2f} GB ({c[k]:.2f} s)" for k in comm)
             + " per GPU and step",
             "step    " + "  ".join(f"{k} {v:.2f}" for k, v in t.items())
             + f" s ({', '.join(k for k in t if k not in ('compute', 'bubble'))}: exposed); "
             f"matmuls at {p['matmul_eff']:.0%} of peak",
             f"time    {p['step_s']:.2f} s per step, {p['mfu']:.1%} MFU"
             f"{'' if p['step_s'] == p['modeled_step_s'] else ' (assumed)'}: "
             f"{p['tokens_per_s'] / 1e6:.2f}M tokens/s, {p['tokens_per_s'] / p['n_gpus']:,.0f} per GPU"]
    if p["tokens"]:
        lines.append(f"budget  {p['tokens'] / 1e12:g}T tokens: {p['days']:.2f} days, "
                     f"{p['gpu_hours']:,.0f} GPU-hours")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- hybrid ZeRO and ZeRO++ on paper


ZERO_PP_PAPER = 4.0  # Wang et al. 2023 (ZeRO++), abstract and section 4: cross-node volume 3M -> 0.75M per step


def zero_variant_traffic(psi: float, root: float, dp: int, per_node: int, m: int, shard: int = 0, block: int = 256,
                         weight_bytes: int = 2, grad_bytes: int = 4) -> dict[str, list[tuple[str, str, float, str]]]:
    """ZeRO-3's data-parallel traffic per step over dp GPUs in nodes of `per_node`, three ways: {variant:
    [(collective, link, bytes one GPU sends, what hides it)]}. psi parameters, `root` of them the embeddings'
    unit (formulas.zero_traffic: it is gathered twice in the forward, never over the node alone); m
    micro-batches; bytes as a ring puts them on a GPU's link: (n-1)/n of the buffer, 2(n-1)/n for an
    all-reduce. A collective whose ranks sit on more than one node is counted on the network (as --comm-report
    counts it: the ring's slowest hop sets its pace). The terms are formulas.zero_traffic's, per micro-batch:

        ZeRO-3   reduce-scatter 4Ψ (fp32 gradients) and all-gather 2Ψ twice (forward, backward), over dp
        MiCS     the same over a shard group of `shard` GPUs (default: one node), then once a step an
                 all-reduce of the 4Ψ/shard gradient shard across the dp/shard replicas (zr)
        ZeRO++   qwZ: the forward's gather in int8 + a scale per block, (1 + 4/block) bytes an element, over
                 dp; hpZ: the backward's gather (2Ψ of the blocks) over the node; qgZ int4 (the paper's
                 setting): an all-to-all of (1/2 + 4/block) bytes an element inside the node, then one of
                 the node's partial sums, 1/per_node of them, across nodes

    `what hides it`: "backward" (a gradient collective, behind the backward of its micro-batch), "forward"
    (a weight gather, prefetched behind the compute), "step" (after the last backward: exposed)."""
    nodes, shard = dp // per_node, shard or per_node
    blocks = psi - root

    def ring(n):
        return (n - 1) / n

    def link(n):  # consecutive ranks: a group of up to a node's size stays on it
        return "node" if n <= per_node else "network"

    def gathers(n, times):  # `times` gathers of every unit, the embeddings' one as many
        return ("all_gather", link(n), times * m * weight_bytes * psi * ring(n), "forward")

    replicas = dp // shard
    return {
        "ZeRO-3": [("reduce_scatter", link(dp), m * grad_bytes * psi * ring(dp), "backward"), gathers(dp, 2)],
        "MiCS": [("reduce_scatter", link(shard), m * grad_bytes * psi * ring(shard), "backward"), gathers(shard, 2),
                 ("all_reduce zr", link(dp), grad_bytes * psi / shard * 2 * ring(replicas), "step")],
        "ZeRO++": [("all_to_all node", "node", m * quantized_bytes(psi, 4, block) * ring(per_node), "backward"),
                   ("all_to_all nodes", link(dp), m * quantized_bytes(psi / per_node, 4, block) * ring(nodes),
                    "backward"),
                   ("all_gather qwZ", link(dp), m * (quantized_bytes(blocks, 8, block)
                                                     + 2 * quantized_bytes(root, 8, block)) * ring(dp), "forward"),
                   ("all_gather hpZ", "node", m * weight_bytes * blocks * ring(per_node), "forward")]}


def zero_variants(shape: gpt.GPTConfig, seq_len: int, batch: int, n_gpus: int, tokens: float, gpu: str | GPU = "H100",
                  gpus_per_node: int = 8, micro_batch: int = 1, recompute: str = "full", shard: int = 0,
                  block: int = 256) -> dict:
    """ZeRO-3, MiCS (shard group `shard`, default one node) and ZeRO++ (qwZ + hpZ + qgZ int4) for one model on
    n_gpus of pure data parallelism (as the ZeRO++ paper runs them): per variant the bytes one GPU sends per
    step on node and on network links (zero_variant_traffic), their seconds at LINK_EFFICIENCY of NVLink and
    of the NIC, what of it the step waits for, the step, the days for `tokens` and the days saved against
    ZeRO-3, and the memory per GPU.

    The step is plan_model's (zero=3) with its data-parallel wait replaced: the gradient collectives hide
    behind 2/3 of each micro-batch's compute (its backward), the gathers behind all of it, except what does
    not fit and the last bucket's share; MiCS's replica all-reduce comes after the backward, all of it
    exposed. So the ZeRO-3 row is plan_model's own step. (qgZ's all-to-alls are modeled overlapped, as
    DeepSpeed runs them; zero.py's run synchronously.) Memory: ZeRO-3's state over dp, MiCS's over the
    shard group, ZeRO++ adds hpZ's secondary copy, 2 bytes of the blocks' weights / gpus_per_node.

    `ratio`: ZeRO-3's cross-node bytes over ZeRO++'s, next to the paper's 4x (ZERO_PP_PAPER). The paper counts
    M = the fp16 weights' bytes: ZeRO-3 sends 3M across nodes (two gathers, a reduce-scatter of fp16
    gradients), ZeRO++ 0.75M (0.5M of int8 weights, none for the backward, 0.25M of int4 gradients). Ours is
    larger, for two reasons: the gradients here are fp32, so ZeRO-3's reduce-scatter is 4Ψ, not 2Ψ (8Ψ
    in all, not 6Ψ); and zero.py's qgZ sends across nodes only each rank's 1/gpus_per_node share of its node's
    partial sums, where the paper's 0.25M is the int4 gradient whole. `paper_ratio` is the same formulas under
    the paper's two assumptions (2-byte gradients, the int4 gradient whole across nodes, no ring factors):
    6Ψ / ((1 + 4/block) + (1/2 + 4/block))Ψ, under 4 by the scales alone."""
    if n_gpus % gpus_per_node or gpus_per_node < 2 or n_gpus // gpus_per_node < 2:
        raise LayoutError(f"{n_gpus} GPUs in nodes of {gpus_per_node}: the variants need two or more whole nodes")
    if shard and (n_gpus % shard or shard < 2):
        raise LayoutError(f"a shard group of {shard} must divide the {n_gpus} GPUs")
    gpu = GPUS[gpu] if isinstance(gpu, str) else gpu
    p = plan_model(shape, seq_len, batch, n_gpus, micro_batch=micro_batch, zero=3, tokens=tokens, gpu=gpu,
                   recompute=recompute, gpus_per_node=gpus_per_node)
    psi, m = p["params"], p["micro_batches"]
    root = gpt.n_params(dataclasses.replace(shape, n_layer=0))  # embeddings and final norm: formulas.zero_traffic
    rate = {"node": LINK_EFFICIENCY * gpu.nvlink, "network": LINK_EFFICIENCY * gpu.net}
    per_micro = p["time"]["compute"] / m  # tp = pp = 1: a micro-batch is its compute
    window = {"backward": 2 / 3 * per_micro * m, "forward": per_micro * m, "step": 0.0}
    buffer = {"backward": 4 * psi * m, "forward": 2 * 2 * psi * m, "step": 1.0}  # whose last bucket is exposed
    without_dp = p["modeled_step_s"] - p["time"]["dp"]
    weights, grads, optimizer = state_bytes(psi, n_gpus, 3)
    activations = p["memory"]["activations"]
    out = {}
    for name, terms in zero_variant_traffic(psi, root, n_gpus, gpus_per_node, m, shard, block).items():
        by_link = {k: sum(b for _, where, b, _ in terms if where == k) for k in rate}
        wait = 0.0
        for when in window:
            seconds = sum(b / rate[where] for _, where, b, w in terms if w == when)
            wait += exposed_s(seconds, window[when], seconds * min(1.0, BUCKET_BYTES / buffer[when]))
        memory = {"ZeRO-3": weights + grads + optimizer,
                  "MiCS": sum(state_bytes(psi, shard or gpus_per_node, 3)),
                  "ZeRO++": weights + grads + optimizer + 2 * (psi - root) / gpus_per_node}[name] + activations
        step = without_dp + wait
        out[name] = {"node": by_link["node"], "network": by_link["network"], "terms": terms,
                     "comm_s": {k: by_link[k] / rate[k] for k in rate}, "dp_s": wait, "step_s": step,
                     "days": tokens / (batch * seq_len) * step / 86400, "memory": memory,
                     "fits": memory <= HEADROOM * gpu.hbm}
    for v in out.values():
        v["days_saved"] = out["ZeRO-3"]["days"] - v["days"]
    scales = 4 / block
    return {"variants": out, "plan": p, "n_gpus": n_gpus, "gpus_per_node": gpus_per_node, "tokens": tokens,
            "shard": shard or gpus_per_node, "ratio": out["ZeRO-3"]["network"] / out["ZeRO++"]["network"],
            "paper_ratio": 6 / ((1 + scales) + (0.5 + scales)), "paper": ZERO_PP_PAPER}


def format_zero_variants(z: dict) -> str:
    """zero_variants() as a table, one variant a row (GB = 1e9 bytes)."""
    p = z["plan"]
    gpu = p["gpu"]
    lines = [f"{p['params'] / 1e9:.1f}B parameters on {z['n_gpus']} {gpu.name} in nodes of {z['gpus_per_node']}, "
             f"pure ZeRO data parallelism, {p['micro_batches']} micro-batches of {p['micro_batch']} per GPU and step, "
             f"{z['tokens'] / 1e9:g}B tokens; links at {LINK_EFFICIENCY:.0%} of NVLink's {gpu.nvlink / 1e9:.0f} "
             f"GB/s and the NIC's {gpu.net / 1e9:.0f} GB/s",
             f"{'':<8}{'node GB':>9}{'network GB':>12}{'comm s':>8}{'exposed s':>11}{'step s':>8}{'days':>7}"
             f"{'saved':>7}{'memory GB':>11}"]
    for name, v in z["variants"].items():
        lines.append(f"{name:<8}{v['node'] / 1e9:>9.1f}{v['network'] / 1e9:>12.1f}{sum(v['comm_s'].values()):>8.1f}"
                     f"{v['dp_s']:>11.1f}{v['step_s']:>8.1f}{v['days']:>7.1f}{v['days_saved']:>7.1f}"
                     f"{v['memory'] / 1e9:>11.1f}{'' if v['fits'] else '  does not fit'}")
    lines.append(f"cross-node bytes, ZeRO-3 / ZeRO++: {z['ratio']:.2f}x here; the paper's accounting "
                 f"{z['paper_ratio']:.2f}x; the paper reports {z['paper']:g}x")
    return "\n".join(lines)
