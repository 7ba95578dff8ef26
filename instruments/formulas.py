"""What the papers predict: the formulas every report of this codebase holds a measurement to.

    traffic    the bytes each collective should move in a step (Megatron's 4 activations per
               layer, one activation per micro-batch between stages, the gradient volume by ZeRO
               stage) — reports.py puts them beside the bytes `Grid` counted (--comm-report)
    memory     weights, gradients and optimizer state against ZeRO's 2Ψ + 2Ψ + 12Ψ (each / dp from
               its stage on); saved activations, activation_bytes, the one activation model
               (flash-aware, by --recompute) that planner.plan(), --memory-report and the lessons
               use, with Korthikanti et al.'s s b h (34 + 5 a s / h) beside it, and the same model
               of a Llama layer (llama_activation_bytes: RMSNorm, GQA's narrower k and v, SwiGLU)

Nothing here measures or prints: reports.py measures and says, planner.py works a whole run out on
paper, and lessons 09-15 check their arithmetic with these. (The pipeline's bubble, (p-1)/(v m + p-1),
is pipeline.py's: the schedules' own simulator checks it.)
"""

from collections import defaultdict

import torch

import fp8
import gradients
import model as gpt
import moe
from gradients import GradSync
from parallel import Grid, placement
from shard import rank_layers
from zero import ParamGather, ZeroAdamW

# ----------------------------------------------------------------------------- traffic


def expected_traffic(cfg: gpt.GPTConfig, grid: Grid, micro_batch: int, n_micro: int, seq_len: int,
                     sync: GradSync | None, model: torch.nn.Module, fp8_recipe: str | None = None,
                     gather: ParamGather | None = None, compute: torch.dtype | None = None) -> dict:
    """Bytes this rank's collectives should move in one fp32 training step, by (op, group), from
    the formulas: Megatron's 2 all-reduces forward + 2 backward per layer of B*T*C activations
    (all-gather + reduce-scatter of the same volume under --sp), one activation send per
    micro-batch each way between pipeline stages (interleaved: one per chunk, p v - 1 boundaries
    in all instead of p - 1), and the data-parallel gradient volume. Under
    --recompute full the backward runs each block's forward again, collectives included (Megatron's
    full recomputation costs 2 more all-reduces per layer); the selective kind recomputes only the
    attention core, which communicates nothing, except under context parallelism (context_traffic).
    A context-parallel rank holds seq_len / cp tokens of every activation. `compute`: autocast's dtype, the
    one expert parallelism's rows cross in (the other activations are counted in fp32)."""
    e, sp = defaultdict(int), grid.sp
    first, last = grid.first_stage, grid.last_stage
    layers = sum(len(chunk) for chunk in rank_layers(cfg.n_layer, grid.pp, grid.vp, grid.pp_rank))
    seq_len //= grid.cp
    btc, bt = micro_batch * seq_len * cfg.n_embd * 4, micro_batch * seq_len * 4
    if grid.tp > 1:
        per_micro = defaultdict(int)
        # each layer's attention and MLP end in a row-parallel all-reduce, forward and backward (an MoE's experts
        # are replicated over tp, and talk not); --recompute full runs the forward's again in the backward
        outputs = 2 * layers - sum(isinstance(m, moe.MoE) for m in model.modules())
        pairs, again = 2 * outputs * btc, outputs * btc if cfg.recompute == "full" else 0
        if sp:
            per_micro[("all_gather", "tp")] += pairs + again + (btc if first else 0) + (btc if last else 0)
            per_micro[("reduce_scatter", "tp")] += pairs + again + (btc if last else 0)
        else:
            per_micro[("all_reduce", "tp")] += pairs + again + (btc if last else 0)
        per_micro[("all_reduce", "tp")] += (btc if first else 0) + (3 * bt if last else 0)
        for k, v in per_micro.items():
            e[k] += n_micro * v
        if sp:  # LayerNorm and row-parallel bias gradients (under ZeRO, this rank's pieces), once per step
            partial = (g.numel() for g in gradients.sequence_parallel_grads(model, sync)) if sync and sync.zero \
                else (p.numel() for p in model.parameters() if placement(p).sequence_parallel)
            e[("all_reduce", "tp")] += 4 * sum(partial)
    if grid.pp > 1:
        act = btc // grid.tp if sp else btc
        # every chunk sends its output on and its input's gradient back, except at the two ends
        e[("send", "pp")] += n_micro * act * (2 * grid.vp - last - first)
        if (first or last) and cfg.tied:  # an untied output layer (Llama's) has no twin to sum with
            e[("all_reduce", "embed")] += 4 * (gradients.tied_grad(model, grid, sync).numel() if sync and sync.zero
                                               else cfg.padded_vocab // grid.tp * cfg.n_embd)
    if grid.cp > 1:
        kv = layers * micro_batch * seq_len * cfg.kv_heads * cfg.head_dim * 4 // grid.tp  # K (or V) under GQA
        for k, v in context_traffic(grid, layers * btc // grid.tp, cfg.recompute, kv).items():
            e[k] += n_micro * v
        if cfg.moe_experts:  # each MoE layer's forward gathers every token's k choices (context.SequenceChoices)
            forwards = len(moe.layers_of(model)) * (2 if cfg.recompute == "full" else 1)
            e[("all_gather", "cp")] += n_micro * forwards * micro_batch * seq_len * grid.cp * cfg.moe_top_k * 8
    if fp8_recipe:
        for k, v in fp8_traffic(grid, layers, n_micro, cfg.recompute, fp8_recipe, first_fp8_step(model)).items():
            e[k] += v
    if sync is not None and grid.dp_cp > 1:
        e.update(zero_traffic(sync, n_micro, next(model.parameters()).element_size(), gather))
    if grid.ep > 1:
        e.update(expert_traffic(cfg, model, n_micro, cfg.recompute == "full", (compute or torch.float32).itemsize))
    zero = sync is not None and sync.zero
    norm_groups = ("tp", "pp") + (("dp_cp",) if zero else ()) + (() if zero else ("ep",))
    for group in norm_groups:
        if grid.size(group) > 1:
            e[("all_reduce", group)] += 4  # the squared gradient norm (ep: of the experts)
    for group in ("pp", "dp_cp"):
        if grid.size(group) > 1:  # the loss (with experts: and aux, z, dropped), for logging and the guards
            e[("all_reduce", group)] += 16 if cfg.moe_experts else 4
    return {(op, grid.label(group)): v for (op, group), v in e.items()}


def fp8_traffic(grid: Grid, layers: int, n_micro: int, recompute: str, recipe: str, first_step: bool) -> dict:
    """--precision fp8's amax all-reduces (fp8.py), 4 bytes each. A cast of a tensor split over ranks takes
    the max over them (current scaling; delayed scaling on its first step only). Per layer and micro-batch:
    forward 6 over tp (column-parallel c_attn and c_fc: w; row-parallel c_proj twice: x and w) and 4 over cp
    (every Linear's x); backward 2 over tp (the column-parallel layers' output gradients) and 4 over cp
    (every output gradient); full recomputation casts the forward's again. Delayed scaling then ends every
    step with one all-reduce of all 3 x 4 amaxes per layer over tp and one over dp x cp."""
    e, again = defaultdict(int), 1 + (recompute == "full")
    if recipe == "current" or first_step:
        e[("all_reduce", "tp")] += 4 * n_micro * layers * (6 * again + 2) if grid.tp > 1 else 0
        e[("all_reduce", "cp")] += 4 * n_micro * layers * (4 * again + 4) if grid.cp > 1 else 0
    if recipe == "delayed":
        for group in ("tp", "dp_cp"):
            e[("all_reduce", group)] += 4 * 12 * layers if grid.size(group) > 1 else 0
    return {k: v for k, v in e.items() if v}


def first_fp8_step(model: torch.nn.Module) -> bool:
    """Whether the step just taken was the first of the fp8 scalings (fp8.end_step has counted it)."""
    return any(state.x.updates == 1 for _, state in fp8.states(model))


def expert_traffic(cfg: gpt.GPTConfig, model: torch.nn.Module, n_micro: int, recomputed: bool, elem: int = 4) -> dict:
    """Bytes of expert parallelism's all-to-alls on this rank in one step (moe.py's docstring): per MoE
    layer, the rows of this rank's kept assignments (b T k a micro-batch without dropping) dispatched and
    combined forward and the same two backward, 4 x rows x C x elem bytes (the dtype the experts compute in:
    4 in fp32, 2 under bf16 or fp16 autocast), and one exchange of E int64 counts a micro-batch; --recompute
    full runs the forward's three again. The expert weights' gradients are summed over edp like any bucket
    (zero_traffic)."""
    layers, forwards = moe.layers_of(model), 2 if recomputed else 1  # the forward (and its recomputation)
    rows = sum(m.rows_sent for m in layers)  # every forward's: the backward's are one forward's
    counts = n_micro * len(layers) * forwards * cfg.moe_experts * 8
    return {("all_to_all", "ep"): 2 * (rows + rows // forwards) * cfg.n_embd * elem + counts}


def context_traffic(grid: Grid, act: int, recompute: str, kv: int | None = None, grad_kv: int | None = None) -> dict:
    """Bytes one micro-batch's context-parallel attention sends from this rank, `act` being the bytes of
    one (b, s/cp, h/tp) activation summed over this stage's layers (context.py's docstring), and `kv` those
    of K (or V): act again, or act H_kv / H under grouped-query attention; `grad_kv` those of dK (fp32:
    kv again in an fp32 run, 2 kv in bf16; the planner's case):
        ring     forward: cp-1 hops of K and V (2 kv); backward: cp-1 hops of K and V, and cp hops
                 of dK and dV (fp32, the last one home)
        ulysses  forward: an all-to-all of q, k, v (act + 2 kv) and one of the output (act); backward the same
    Recomputation (either kind) runs the attention core's forward once more in the backward."""
    again, kv = recompute != "none", act if kv is None else kv
    if grid.cp_attn == "ulysses":
        return {("all_to_all", "cp"): (2 + again) * (2 * act + 2 * kv)}
    hops = grid.cp - 1
    return {("send", "cp"): (1 + again) * hops * 2 * kv + hops * 2 * kv + grid.cp * 2 * (grad_kv or kv)}


def zero_traffic(sync: GradSync, n_micro: int, weight_bytes: int, gather: ParamGather | None = None) -> dict:
    """The data-parallel bytes of one step (over the dp x cp ranks), by ZeRO stage, for Ψ parameters in
    fp32 gradient buckets (padded to dp shards under ZeRO) and weights of `weight_bytes` each:
        0  all-reduce 4Ψ, once per step
        1  reduce-scatter 4Ψ once, all-gather the new weights once: the same ring bytes as stage 0
        2  reduce-scatter 4Ψ every micro-batch (nothing is held whole), all-gather once
        3  reduce-scatter 4Ψ, and all-gather the weights twice (forward, backward), every micro-batch:
           with one micro-batch and 4-byte weights 12Ψ against stage 0's 8Ψ, ZeRO's 1.5x
    Hybrid ZeRO (zs, shard groups of N): those collectives over the N ranks of a group, and an all-reduce
    of each 4Ψ/N shard across the groups (zr) once a step. ZeRO++ (zero.py): qgZ's reduce-scatter is an
    all-to-all of quantized Ψ inside the node and one of Ψ/L across nodes (L: dp x cp ranks per node), at
    (bits/8 + 4/block) bytes an element; qwZ's gathers carry (1 + 4/block) bytes an element; hpZ's
    backward gathers (of blocks; the embeddings' unit is gathered twice in the forward) run over the node."""
    grid, out = sync.grid, defaultdict(int)
    if not sync.zero:
        for b in sync.buckets:  # expert parallelism's expert buckets: over edp
            out[("all_reduce", b.group)] += 4 * b.numel
        return {k: v for k, v in out.items() if grid.size(k[1]) > 1}
    reduces = 1 if sync.zero == 1 else n_micro
    qwz, hpz = (gather.qwz_block, gather.hpz) if gather is not None else (0, False)
    for b in sync.buckets:  # (expert parallelism's expert buckets: over edp)
        if sync.scatter is not None:  # qgZ
            q = sync.scatter
            out[("all_to_all", "node")] += reduces * quantized_bytes(b.padded, q.bits, q.block)
            out[("all_to_all", "nodes")] += reduces * quantized_bytes(b.padded // grid.node_dp, q.bits, q.block)
        else:
            out[("reduce_scatter", b.group)] += reduces * 4 * b.padded
        if b.group == "zs":
            out[("all_reduce", "zr")] += 4 * b.shard_size
        if sync.zero < 3:
            out[("all_gather", b.group)] += weight_bytes * b.padded
            continue
        gathered = quantized_bytes(b.padded, 8, qwz) if qwz else weight_bytes * b.padded
        backward_on_node = hpz and b is not sync.buckets[-1]  # (the last bucket: the embeddings' unit)
        out[("all_gather", b.group)] += (1 if backward_on_node else 2) * n_micro * gathered
        if backward_on_node:
            out[("all_gather", "node")] += n_micro * weight_bytes * b.padded
    return {k: v for k, v in out.items() if grid.size(k[1]) > 1}


def quantized_bytes(n: int, bits: int, block: int) -> int:
    """n elements as ZeRO++ sends them: bits/8 bytes of code each, and a 4-byte scale per block."""
    return n * bits // 8 + n // block * 4



# ----------------------------------------------------------------------------- memory


def kv_cache_bytes(cfg: gpt.GPTConfig, batch: int, tokens: int, element_bytes: int = 2) -> int:
    """What sampling keeps (model.KVCache): every layer's k and v of every token, 2 L b T H_kv D elements.
    Grouped-query attention divides it by H / H_kv (Llama-3-8B: by 4), which at long contexts and large
    batches is most of a server's memory, and the bytes every new token must read."""
    return 2 * cfg.n_layer * batch * tokens * cfg.kv_heads * cfg.head_dim * element_bytes



def state_formula(model: torch.nn.Module, opt, sync: GradSync | None, grid: Grid) -> dict[str, tuple[float, str]]:
    """ZeRO's formulas (section 5, figure 1) in this codebase's bytes: weights of P bytes (the
    parameter dtype), fp32 gradients (4; without data parallelism, p.grad in the weights' dtype) and
    K = 12 bytes of optimizer state (fp32 master, exp_avg, exp_avg_sq; torch's AdamW on fp32 weights
    keeps only the moments, K = 2P). Ψ is this rank's parameters (tensor/pipeline parallelism already
    divided them), padded to N equal shards under ZeRO; N = dp (times cp: context-parallel ranks hold
    replicas too; an expert's N is dp / ep, the ranks that hold the same experts)."""
    zero = sync.zero if sync is not None else 0
    P = next(model.parameters()).element_size()
    psi = sum(b.padded for b in sync.buckets) if zero else sum(p.numel() for p in model.parameters())
    shard = sum(b.padded / grid.size(b.group) for b in sync.buckets) if zero else psi  # Ψ/N
    G = 4 if sync is not None else P
    K = 12 if isinstance(opt, ZeroAdamW) else 2 * P

    def term(bytes_, sharded):
        return (bytes_ * (shard if sharded else psi), f"{bytes_}Ψ" + ("/N" if sharded else ""))

    return {"weights": term(P, zero >= 3), "gradients": term(G, zero >= 2), "optimizer": term(K, zero >= 1)}


def activation_bytes(seq_len: int, micro_batch: int, d_model: int, n_head: int, tp: int = 1, sp: bool = False,
                     recompute: str = "none", attn: str = "flash", act_bytes: int = 2, mask_bytes: int = 1,
                     dropout: float = 0.0, norm_bytes: int | None = None, residual_bytes: int | None = None) -> float:
    """The activation-memory model of this codebase: bytes one layer of `model.py` saves for its
    backward, per micro-batch, on one tensor-parallel rank. `plan()`, `--memory-report` and the
    lessons all use it (measured on the tiny model: SavedActivations, tests/test_model.py). In
    elements of `act_bytes`, per layer:
        the two LayerNorms' inputs, of `norm_bytes` each (see below)                  2 s b h   (/t under SP)
        their outputs, as c_attn and c_fc keep them (under SP: after the all-gather)    2 s b h
        q, k, v (the attention's saved input) 3, the attention output (c_proj's input,
        the same buffer) 1, GELU's input 4 and output 4 (the MLP is 4h wide)         12 s b h / t
        the softmax probabilities, math backend only (flash kernels keep none)        a s^2 b / t
        dropout masks (dropout > 0), two residual dropouts of `mask_bytes` per element   2 s b h   (/t under SP)
          (a bool, 1 byte, on every device: dropout.py's mask, as CUDA's fused dropout keeps)
    So with a flash kernel and no dropout, 16 elements per s b h, whatever the sequence length. A
    LayerNorm keeps its input in the residual stream's dtype, which is the parameters' (fp32 in
    train.py; 16-bit parameters keep a 16-bit stream: the embedding starts it), and on CUDA
    always in fp32, where autocast runs layer_norm in fp32 and it keeps the fp32 copy it was given:
    `norm_bytes` (default `act_bytes`). So in bf16 on fp32 parameters (this codebase's recipe) a layer
    keeps 2 x 4 + 2 x 14 = 36 s b h bytes. `recompute`:
        none       all of the above
        selective  drops the probabilities (and the kernels' logsumexp): with a flash kernel that is
                   all it can drop, so it saves nothing here but costs nearly nothing either
        full       keeps the block input alone, the residual stream, of `residual_bytes` (the parameters'
                   dtype; default `act_bytes`): s b h (/t under SP), a factor of 36/4 = 9 in bf16 on
                   fp32 parameters (and in the backward one layer at a time is rebuilt whole: plan() adds it)
    Korthikanti et al.'s accounting (korthikanti_bytes) differs in two places: it stores the s x s
    matrix three times over (5 a s / h: probabilities, dropout mask, dropped probabilities), which no
    flash kernel keeps; and under SP Megatron-LM keeps the column-parallel inputs sequence-sharded and
    all-gathers them again in the backward, 2 s b h (1 - 1/t) less than here (not done here). What
    LayerNorm and the kernels keep per row (mean, rstd, logsumexp: (4 + a/t) s b floats) is under 1%
    at these widths and is left out."""
    s, b, h, a, t = seq_len, micro_batch, d_model, n_head, tp
    replicated = s * b * h / t if sp else s * b * h  # what tensor parallelism alone does not split
    if recompute == "full":
        return replicated * (residual_bytes or act_bytes)
    saved = (norm_bytes or act_bytes) * 2 * replicated + act_bytes * (2 * s * b * h + 12 * s * b * h / t)
    saved += act_bytes * a * s * s * b / t if attn == "math" and recompute != "selective" else 0
    return saved + (2 * replicated * mask_bytes if dropout > 0 else 0)


def korthikanti_bytes(seq_len: int, micro_batch: int, d_model: int, n_head: int, tp: int, sp: bool,
                      recompute: str) -> float:
    """Korthikanti et al. 2022 (section 4, table 2), 16-bit activations, 1-byte dropout masks: a layer
    keeps s b h (34 + 5 a s / h) bytes per micro-batch; with tensor parallelism t, 10 + 24/t + 5as/(ht)
    (the LayerNorm/dropout regions are replicated), with sequence parallelism all of it / t; selective
    recomputation drops the 5as/h of the attention core; full keeps only the layer's input, 2sbh (/t
    under SP). The reference `--memory-report` prints beside activation_bytes."""
    s, b, h, a, t = seq_len, micro_batch, d_model, n_head, tp
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    scores = 0 if recompute == "selective" else 5 * a * s / h
    return s * b * h * (34 + scores) / t if sp else s * b * h * (10 + 24 / t + scores / t)


def llama_activation_bytes(seq_len: int, micro_batch: int, d_model: int, n_head: int, n_kv_head: int, hidden: int,
                           tp: int = 1, sp: bool = False, recompute: str = "none", attn: str = "flash",
                           act_bytes: int = 2, mask_bytes: int = 1, dropout: float = 0.0, norm_bytes: int = 4,
                           fused_norm: bool = False, residual_bytes: int | None = None) -> float:
    """activation_bytes for a Llama-family layer (model.py's arch="llama"), counted as GPT-2's is: bytes one
    layer saves for its backward, per micro-batch, on one tensor-parallel rank, with f = `hidden` (SwiGLU's
    width) and r = n_kv_head / n_head. In elements of `act_bytes`, per layer:
        the two RMSNorms: each its input and x / rms(x) (the gain's gradient needs
          it; torch's fused CUDA kernel keeps only the input: `fused_norm`),
          of `norm_bytes`                                               4 s b h, 2 s b h fused (/t under SP)
        their outputs, as c_attn and c_fc keep them (under SP: after the all-gather)      2 s b h
        q, k, v after RoPE, the attention's saved input: k and v are r as wide      (1 + 2 r) s b h / t
          (the rotation itself keeps only its cos and sin, 2 s D per layer: left out)
        the attention output (c_proj's input)                                             s b h / t
        SwiGLU: c_fc's output (gate and up, one buffer) 2 f, silu(gate) f, and the
          product, c_proj's input, f                                                    4 s b f / t
        the math backend only: the probabilities a s^2 b, and k and v repeated for
          each query head, 2 (1 - r) s b h more (flash kernels keep neither)   (a s^2 b + 2 (1 - r) s b h) / t
        dropout masks (dropout > 0), as GPT-2's                                  2 s b h   (/t under SP)
    An RMSNorm keeps fp32 (`norm_bytes` 4) whatever the compute dtype: autocast runs rms_norm in fp32,
    casting a 16-bit stream up (measured on the CPU; on CUDA this is the assumption, as for LayerNorm).
    llama-tiny in fp32 (h = 64, f = 4h, r = 1/2): 4 + 2 + 2 + 1 + 16 = 25 s b h elements, and SavedActivations
    measures 25.16 (tests/test_plan.py): the 0.16 is RMSNorm's 1/rms(x) (2 s b floats), the kernel's
    logsumexp (a s b) and RoPE's cos and sin, under 0.1% of a layer at Llama-3-8B's widths: left out.
    (The 24.9 once measured there was 25.16 less the first block's input, which an embedding lookup
    produces and SavedActivations took for a copy of the table.) At Llama-3-8B's shape in bf16 on a GPU
    (f = 3.5 h, r = 1/4, fused fp32 norms) that is 2 x 4 + 2 (2 + 1.5 + 1 + 14) = 45 bytes per s b h, where
    a GPT-2 layer keeps 2 x 4 + 2 (2 + 3 + 1 + 8) = 36: GQA saves 3, the wider MLP costs 12. `recompute`:
    none keeps all of it; selective drops the math backend's term (and the logsumexp); full keeps the block
    input alone, s b h (/t under SP) of `residual_bytes`, as GPT-2's."""
    s, b, h, a, f, t, r = seq_len, micro_batch, d_model, n_head, hidden, tp, n_kv_head / n_head
    replicated = s * b * h / t if sp else s * b * h  # what tensor parallelism alone does not split
    if recompute == "full":
        return replicated * (residual_bytes or act_bytes)
    norms = (2 if fused_norm else 4) * replicated * norm_bytes
    saved = norms + act_bytes * (2 * s * b * h + ((1 + 2 * r) * s * b * h + s * b * h + 4 * s * b * f) / t)
    if attn == "math" and recompute != "selective":
        saved += act_bytes * (a * s * s * b + 2 * (1 - r) * s * b * h) / t
    return saved + (2 * replicated * mask_bytes if dropout > 0 else 0)


def layer_activation_bytes(cfg: gpt.GPTConfig, seq_len: int, micro_batch: int, tp: int, sp: bool, recompute: str,
                           attn: str, act_bytes: int, mask_bytes: int = 1, norm_bytes: int | None = None,
                           fused_norm: bool = False, residual_bytes: int | None = None) -> float:
    """The activation model of the architecture `cfg` describes: activation_bytes for GPT-2,
    llama_activation_bytes for the Llama family (its RMSNorms keep fp32: `norm_bytes` is GPT-2's LayerNorm's)."""
    if cfg.llama:
        return llama_activation_bytes(seq_len, micro_batch, cfg.n_embd, cfg.n_head, cfg.kv_heads, cfg.hidden, tp,
                                      sp, recompute, attn, act_bytes, mask_bytes, cfg.dropout, 4, fused_norm,
                                      residual_bytes)
    return activation_bytes(seq_len, micro_batch, cfg.n_embd, cfg.n_head, tp, sp, recompute, attn, act_bytes,
                            mask_bytes, cfg.dropout, norm_bytes, residual_bytes)


def activation_formula(cfg: gpt.GPTConfig, seq_len: int, micro_batch: int, tp: int, sp: bool, recompute: str,
                       attn: str, act_bytes: int, mask_bytes: int = 1, norm_bytes: int | None = None,
                       fused_norm: bool = False, residual_bytes: int | None = None) -> tuple[float, float | None]:
    """(layer_activation_bytes, korthikanti_bytes) of one layer of the model `cfg` describes, per micro-batch;
    Korthikanti et al. counted GPT-2's layer, so a Llama's has no second number (None)."""
    ours = layer_activation_bytes(cfg, seq_len, micro_batch, tp, sp, recompute, attn, act_bytes, mask_bytes,
                                  norm_bytes, fused_norm, residual_bytes)
    paper = None if cfg.llama else korthikanti_bytes(seq_len, micro_batch, cfg.n_embd, cfg.n_head, tp, sp, recompute)
    return ours, paper

