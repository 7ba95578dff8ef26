"""Which part of the model a rank holds: Megatron's tensor-parallel layers, and one GPT transformed by them
and the other axes, then materialized slice by slice.

    meta GPT (shapes, no memory) ─▶ tensor parallel: Column/Row/Vocab layers (below)
                                 ─▶ context parallel: ring or Ulysses attention cores (context.py)
                                 ─▶ pipeline parallel: keep this stage's blocks (keep_stage)
                                 ─▶ materialize: each parameter's slice of its (seed, name) value
                                    (ZeRO-3: shapes only; zero.ZeroAdamW draws and keeps its shard)

`build_model` is the only way a rank gets a model, so every layout starts from the same weights
(DESIGN.md, principles 1 and 2). Every tensor that is split records how, in its placement
(parallel.Placement's `shard`: split dim `dim` into `count` parts, within `groups` blocks, keep
`index`); `take_shard` cuts that slice out of a full tensor and `unshard` puts the slices back,
which is how checkpoints and Hugging Face weights cross layouts. `check_layout` refuses what cannot
be split, before anything is built. The grid the layers talk through, and its collectives, are
parallel.py's.
"""

import math

import torch
import torch.distributed as dist

import context
import model as gpt
import moe
from dropout import Dropout
from lmhead import lm_head_loss
from parallel import GRIDS, Grid, LayoutError, place, placement

# ----------------------------------------------------------------------------- tensor parallel
#
# Megatron-LM (Shoeybi et al. 2019, section 3): split the first matmul of a pair by columns and
# the second by rows, and the pair needs one all-reduce forward and one backward.
#
#     X ─f─▶ [X A_1 | X A_2] ─gelu─▶ [Y_1 | Y_2] ─▶ Y_1 B_1 + Y_2 B_2 ─g─▶ Z
#            column-parallel (A split by output)    row-parallel (B split by input)
#
#     f: forward identity, backward all-reduce     g: forward all-reduce, backward identity
#
# Sequence parallelism (Korthikanti et al. 2022, section 4.2.2) cuts the LayerNorm/dropout regions
# between the pairs along the sequence: f becomes an all-gather of the sequence, g a
# reduce-scatter of it; the same bytes move, but those activations take 1/tp of the memory.
#
# Each of these is one collective forward and its conjugate backward (the conjugate of an
# all-gather is a reduce-scatter, of an all-reduce the identity), so one autograd Function does
# them all; the named functions below say which pair.


def identity(x: torch.Tensor, grid: Grid) -> torch.Tensor:
    return x


def all_reduce_tp(x: torch.Tensor, grid: Grid) -> torch.Tensor:
    x = x.contiguous().clone()  # never reduce into a tensor autograd still needs
    grid.all_reduce(x, "tp")
    return x


def gather_seq(x: torch.Tensor, grid: Grid) -> torch.Tensor:
    """(B, T/tp, C) from each rank -> (B, T, C) on every rank."""
    out = seq_major(x, x.size(1) * grid.tp)
    grid.all_gather(out.transpose(0, 1), x.transpose(0, 1).contiguous(), "tp")  # collectives concatenate dim 0
    return out


def reduce_scatter_seq(x: torch.Tensor, grid: Grid) -> torch.Tensor:
    """(B, T, C) partial sums on each rank -> this rank's (B, T/tp, C) slice of the sum."""
    out = seq_major(x, x.size(1) // grid.tp)
    grid.reduce_scatter(out.transpose(0, 1), x.transpose(0, 1).contiguous(), "tp")
    return out


def split_seq(x: torch.Tensor, grid: Grid) -> torch.Tensor:
    """(B, T, C), the same on every rank -> this rank's (B, T/tp, C) slice; no communication."""
    if x.size(1) % grid.tp:
        raise LayoutError(f"--sp needs the sequence length ({x.size(1)}) divisible by --tp {grid.tp}")
    return x.chunk(grid.tp, dim=1)[grid.tp_rank].clone(memory_format=torch.contiguous_format)


def seq_major(x: torch.Tensor, T: int) -> torch.Tensor:
    """A new (B, T, C) laid out as (T, B, C): what the sequence collectives fill, along dim 0."""
    return x.new_empty((T, x.size(0), *x.shape[2:])).transpose(0, 1)


class Conjugate(torch.autograd.Function):
    """y = forward(x); dL/dx = backward(dL/dy): a collective and the one its gradient needs."""

    @staticmethod
    def forward(ctx, x, grid, forward, backward):
        ctx.grid, ctx.backward = grid, backward
        return collective(forward, x, grid)

    @staticmethod
    def backward(ctx, grad):
        return collective(ctx.backward, grad, ctx.grid), None, None, None


def copy_to_tp(x, grid):  # Megatron's f: x is replicated; its gradient is a sum over the ranks
    return Conjugate.apply(x, grid, identity, all_reduce_tp)


def reduce_from_tp(x, grid):  # Megatron's g: partial sums become the output; the gradient is replicated
    return Conjugate.apply(x, grid, all_reduce_tp, identity)


def gather_from_sp(x, grid):  # sequence-parallel f: all-gather the sequence; reduce-scatter back
    return Conjugate.apply(x, grid, gather_seq, reduce_scatter_seq)


def scatter_to_sp(x, grid):  # sequence-parallel g: reduce-scatter partial sums; all-gather back
    return Conjugate.apply(x, grid, reduce_scatter_seq, gather_seq)


def split_to_sp(x, grid):  # into the sequence-parallel region: keep this rank's slice; all-gather back
    return Conjugate.apply(x, grid, split_seq, gather_seq)


# torch.compile and the collectives. Traced, the collectives' Python (Grid's counting, the observer, the
# process group) would cut every block into several graphs. So each runs as one operator, tp_collective
# (a torch.library custom op, as kernels.py's attention is): the compiler sees a call with known output
# shapes and keeps the block one graph; the call runs the Python above at run time, every time, so Grid
# counts each collective (and its observer sees it), compiled or not.

TP_COLLECTIVES = {fn.__name__: fn for fn in (all_reduce_tp, gather_seq, reduce_scatter_seq, split_seq)}


def collective(fn, x: torch.Tensor, grid: Grid) -> torch.Tensor:
    """fn(x, grid), through tp_collective."""
    if fn is identity:
        return x.view_as(x)  # autograd wants a new tensor, even from the identity
    return tp_collective(x, grid.key, fn.__name__)


@torch.library.custom_op("nanoscale::tp_collective", mutates_args=())
def tp_collective(x: torch.Tensor, grid: int, name: str) -> torch.Tensor:
    """TP_COLLECTIVES[name](x, the grid with this key)."""
    return TP_COLLECTIVES[name](x, GRIDS[grid])


@tp_collective.register_fake
def _tp_collective_fake(x, grid, name):  # the output each makes: shape and layout, no data
    tp = GRIDS[grid].tp
    if name == "all_reduce_tp":
        return x.new_empty(x.shape)
    if name == "split_seq":
        return x.new_empty((x.size(0), x.size(1) // tp, *x.shape[2:]))
    return seq_major(x, x.size(1) * tp if name == "gather_seq" else x.size(1) // tp)


class SplitSeq(torch.nn.Module):
    """After the embedding: enter the sequence-parallel region (when the grid has one)."""

    def __init__(self, grid: Grid):
        super().__init__()
        self.grid = grid

    def forward(self, x):
        return split_to_sp(x, self.grid) if self.grid.sp_on else x


def shard_spec(grid: Grid, dim: int, groups: int | list[int] = 1, over: str = "tp") -> dict:
    """Which slice of the full tensor this rank holds: split `dim` into `groups` blocks (q, k, v
    for the fused projection; a list gives their sizes, unequal under GQA) and keep part `index` of
    `count` from each, one part per rank of the group `over` (tp; experts: ep)."""
    index, count = (grid.ep_rank, grid.ep) if over == "ep" else (grid.tp_rank, grid.tp)
    return {"dim": dim, "index": index, "count": count, "groups": groups}


def meta_param(*shape, **where) -> torch.nn.Parameter:
    """A parameter of this shape on meta (no memory), placed as `where` says (parallel.place)."""
    p = torch.nn.Parameter(torch.empty(*shape, device="meta"))
    if where:
        place(p, **where)
    return p


class ColumnParallelLinear(torch.nn.Module):
    """y = x A^T + b with A split by output features: each rank computes its own columns of y.
    `groups` > 1 splits each of that many blocks of outputs (q, k and v) separately, so every
    rank gets whole heads of each (a list: the blocks' sizes, for GQA's H D, H_kv D, H_kv D)."""
    fp8 = None  # --precision fp8 (fp8.enable): this rank's w and the output's gradient are split

    def __init__(self, in_features: int, out_features: int, grid: Grid, bias: bool = True,
                 groups: int | list[int] = 1):
        super().__init__()
        self.grid = grid
        spec = shard_spec(grid, 0, groups)
        self.weight = meta_param(out_features // grid.tp, in_features, shard=spec)
        self.bias = meta_param(out_features // grid.tp, shard=spec) if bias else None

    def forward(self, x):
        x = gather_from_sp(x, self.grid) if self.grid.sp_on else copy_to_tp(x, self.grid)
        return gpt.linear(x, self.weight, self.bias, self.fp8)  # (B, T, out / tp)


class RowParallelLinear(torch.nn.Module):
    """y = x A^T + b with A split by input features: each rank holds a slice of x's features and
    produces a partial sum of y; g sums them. The bias is replicated and added once, after."""
    fp8 = None  # --precision fp8 (fp8.enable): this rank's x and w are split

    def __init__(self, in_features: int, out_features: int, grid: Grid, bias: bool = True):
        super().__init__()
        self.grid = grid
        self.weight = meta_param(out_features, in_features // grid.tp, shard=shard_spec(grid, 1))
        self.bias = meta_param(out_features, sequence_parallel=grid.sp) if bias else None

    def forward(self, x):
        y = gpt.linear(x, self.weight, None, self.fp8)  # (B, T, out), a partial sum
        y = scatter_to_sp(y, self.grid) if self.grid.sp_on else reduce_from_tp(y, self.grid)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(torch.nn.Module):
    """Rank r holds rows [r V/tp, (r+1) V/tp) of the table. Each rank looks up the tokens it owns,
    writes zeros for the rest, and g sums the ranks' partial embeddings."""

    def __init__(self, vocab: int, dim: int, grid: Grid):
        super().__init__()
        self.grid = grid
        self.weight = meta_param(vocab // grid.tp, dim, shard=shard_spec(grid, 0))

    @property
    def vocab_start(self) -> int:
        return self.grid.tp_rank * self.weight.size(0)

    def forward(self, idx):
        local = idx - self.vocab_start
        outside = (local < 0) | (local >= self.weight.size(0))
        out = torch.nn.functional.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, C)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.grid)


class VocabParallelLoss(torch.nn.Module):
    """The model's loss layer under tensor parallelism (model.CrossEntropy on one device). Rank r
    holds rows [vocab_start, vocab_start + V/tp) of the output layer and computes only those logits,
    a chunk of rows at a time (lmhead.lm_head_loss). The loss never gathers them (Megatron, section 3):

        m   = max over all ranks of the logits          (all-reduce MAX, B*T floats)
        S   = sum over all ranks of exp(logit - m)      (all-reduce SUM of S and z_t
        z_t = the target's logit - m, from its owner     together, 2 B*T floats)
        loss = log S - z_t;   d loss / d logits = softmax - onehot(target)

    Its input enters the tensor-parallel region like any column-parallel layer's: f (or the
    sequence all-gather under --sp), so the partial input gradients of the ranks are summed."""

    def __init__(self, grid: Grid, vocab_start: int):
        super().__init__()
        self.grid, self.vocab_start = grid, vocab_start

    def forward(self, x, weight, targets):
        x = gather_from_sp(x, self.grid) if self.grid.sp_on else copy_to_tp(x, self.grid)
        return lm_head_loss(x, weight, targets, self.vocab_start, self.reduce)

    def reduce(self, t: torch.Tensor, op: str) -> None:
        self.grid.all_reduce(t, "tp", op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)


class GatherVocab(torch.nn.Module):
    """(B, V/tp) vocab shards -> (B, V) on every rank, for sampling (nn.Identity on one device)."""

    def __init__(self, grid: Grid):
        super().__init__()
        self.grid = grid

    def forward(self, x):  # zeros: a failed gather must not hand sampling garbage before the read
        out = x.new_zeros((self.grid.tp * x.size(0), *x.shape[1:]))  # (tp * B, V/tp), by rank
        self.grid.all_gather(out, x.contiguous(), "tp")
        return torch.cat(out.chunk(self.grid.tp), dim=-1)


def apply_tensor_parallel(model: gpt.GPT, grid: Grid) -> None:
    """Swap a meta-built GPT's layers for their tensor-parallel versions, in place."""
    cfg = model.config
    C, V, F, bias = cfg.n_embd, cfg.padded_vocab, cfg.hidden, not cfg.llama
    # whole heads of q, k and v (GPT-2: three equal blocks; GQA: H query heads, H_kv key and value heads)
    qkv = [cfg.n_head * cfg.head_dim] + 2 * [cfg.kv_heads * cfg.head_dim] if cfg.llama else 3
    for block in model.transformer.h:
        block.attn.c_attn = ColumnParallelLinear(C, (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim, grid, bias, qkv)
        block.attn.c_proj = RowParallelLinear(C, C, grid, bias)
        if isinstance(block.mlp, moe.MoE):  # experts replicated over tp (moe.py says why)
            continue
        # SwiGLU's W and V split alike, so a rank's gate and up columns meet (model.MLP)
        block.mlp.c_fc = ColumnParallelLinear(C, (2 if cfg.llama else 1) * F, grid, bias, 2 if cfg.llama else 1)
        block.mlp.c_proj = RowParallelLinear(F, C, grid, bias)
    model.transformer.wte = VocabParallelEmbedding(V, C, grid)
    model.lm_head = ColumnParallelLinear(C, V, grid, bias=False)
    if cfg.tied:
        model.lm_head.weight = model.transformer.wte.weight  # still tied: both hold vocab rows of rank r
    model.transformer.drop = torch.nn.Sequential(SplitSeq(grid), model.transformer.drop)
    if grid.sp:  # LayerNorms now see only their slice of the sequence: their gradients are partial sums
        for name, p in model.named_parameters():
            if ".ln_" in name or "ln_f" in name:
                place(p, sequence_parallel=True)
    model.loss = VocabParallelLoss(grid, model.transformer.wte.vocab_start)
    model.gather_vocab = GatherVocab(grid)


# ----------------------------------------------------------------------------- building a rank's model


def check_layout(cfg: gpt.GPTConfig, grid: Grid, seq_len: int) -> None:
    if cfg.n_head % grid.tp:
        raise LayoutError(f"--tp {grid.tp} does not divide the model's {cfg.n_head} attention heads")
    if cfg.kv_heads % grid.tp:  # each rank holds whole kv heads; replicating them is not implemented
        raise LayoutError(f"--tp {grid.tp} does not divide the model's {cfg.kv_heads} kv heads (grouped-query "
                          f"attention: every tensor-parallel rank needs kv heads of its own); use --tp "
                          f"{math.gcd(cfg.kv_heads, grid.tp)} or more kv heads (--n-kv-head)")
    if cfg.hidden % grid.tp:
        raise LayoutError(f"--tp {grid.tp} does not divide the MLP's hidden width {cfg.hidden}")
    if cfg.padded_vocab % grid.tp:
        raise LayoutError(f"--tp {grid.tp} does not divide the padded vocabulary {cfg.padded_vocab}")
    if cfg.n_layer < grid.pp * grid.vp:
        stages = f"--pp {grid.pp} stages" if grid.vp == 1 else \
            f"--pp {grid.pp} x --virtual-stages {grid.vp} = {grid.pp * grid.vp} virtual stages"
        raise LayoutError(f"{stages} but the model has only {cfg.n_layer} layers; use fewer stages, or more "
                          "layers (--n-layer)")
    if grid.sp and grid.tp == 1:
        raise LayoutError("--sp (sequence parallelism) needs --tp 2 or more")
    if grid.sp and seq_len % (grid.tp * grid.cp):
        raise LayoutError(f"--sp needs --seq-len ({seq_len}) divisible by --tp {grid.tp}"
                          + (f" times --cp {grid.cp}" if grid.cp > 1 else ""))
    if grid.cp > 1 and seq_len % (2 * grid.cp):  # (at cp 1 the sequence stays whole: any length)
        raise LayoutError(f"--cp {grid.cp} cuts each sequence into 2*cp = {2 * grid.cp} chunks: --seq-len "
                          f"{seq_len} must be divisible by {2 * grid.cp}")
    if grid.cp > 1 and grid.cp_attn == "ulysses" and (cfg.kv_heads // grid.tp) % grid.cp:
        kind = "heads" if cfg.kv_heads == cfg.n_head else "kv heads (each cp rank attends with whole ones)"
        raise LayoutError(f"--cp-attn ulysses needs the {kind} per tensor-parallel rank ({cfg.kv_heads // grid.tp}) "
                          f"divisible by --cp {grid.cp}; use --cp-attn ring")


def apply_expert_parallel(model: gpt.GPT, grid: Grid) -> None:
    """Each MoE layer keeps E / ep of its experts, this rank's run of them along the experts' dim 0
    (their copies are the `edp` group, over which their gradients meet: gradients.py), and sends
    tokens to the others (moe.py)."""
    for layer in model.modules():
        if isinstance(layer, moe.MoE):
            for stacked in (layer.experts.c_fc, layer.experts.c_proj):
                for name, p in list(stacked.named_parameters(recurse=False)):
                    part = meta_param(p.size(0) // grid.ep, *p.shape[1:], replicas="edp",
                                      split=("ep",), shard=shard_spec(grid, 0, over="ep"))
                    setattr(stacked, name, part)
            layer.exchange = moe.ExpertParallel(grid)


def stage_layers(n_layer: int, pp: int, stage: int) -> range:
    """Blocks of a pipeline stage: as even as possible, the remainder to the later stages
    (the first stage also runs the embedding, the last the loss)."""
    bounds = [n_layer * s // pp for s in range(pp + 1)]
    return range(bounds[stage], bounds[stage + 1])


def rank_layers(n_layer: int, pp: int, vp: int, pp_rank: int) -> list[range]:
    """The chunks of blocks pipeline rank `pp_rank` holds. Interleaved (Narayanan et al. 2021,
    section 2.2.2), the layers are cut into pp * vp virtual stages, and virtual stage c * pp + rank is
    chunk c of that rank: with pp = 2, vp = 2 and 8 layers, rank 0 holds h.0-1 and h.4-5, rank 1
    h.2-3 and h.6-7. With vp = 1, one chunk: stage_layers."""
    return [stage_layers(n_layer, pp * vp, c * pp + pp_rank) for c in range(vp)]


def keep_stage(model: gpt.GPT, grid: Grid) -> None:
    """Drop what this pipeline stage does not run. Blocks keep their global names (h.5 stays h.5),
    so checkpoints from any layout line up; an interleaved stage keeps its chunks in layer order.
    The embedding stays with the first stage and the loss with the last (virtual stage 0 and
    pp * vp - 1 are on those ranks)."""
    h = model.transformer.h
    held = [i for chunk in rank_layers(len(h), grid.pp, grid.vp, grid.pp_rank) for i in chunk]
    model.transformer.h = torch.nn.ModuleDict({str(i): h[i] for i in held})
    first, last, tied = grid.first_stage, grid.last_stage, model.config.tied
    if first and not last and tied:
        place(model.transformer.wte.weight, tied=True)  # its twin is the last stage's lm_head
    if not first:
        del model.transformer["wte"]
        if "wpe" in model.transformer:  # GPT-2's position table (Llama has none)
            del model.transformer["wpe"]
    if not last:
        del model.transformer["ln_f"]
        model.lm_head = None
    elif not first and tied:  # the last stage keeps its own copy of the tied embedding, synced by grad all-reduce
        w = model.lm_head.weight
        w = meta_param(*w.shape, shard=placement(w).shard, tied=True, tied_copy=True)
        model.lm_head.weight = w


def build_model(cfg: gpt.GPTConfig, grid: Grid, seed: int, device: torch.device, seq_len: int,
                values: bool = True) -> torch.nn.Module:
    """This rank's part of the model: the full GPT built on meta (no memory), transformed by tensor,
    context and pipeline parallelism, then each remaining parameter materialized as this rank's slice of
    its layout-independent initial value. `values=False` (ZeRO-3): shapes only, and `initial_values`
    draws each parameter's slice when the optimizer builds its shard."""
    check_layout(cfg, grid, seq_len)
    with torch.device("meta"):
        model = gpt.GPT(cfg)
    if grid.tp > 1:
        apply_tensor_parallel(model, grid)
    if grid.cp > 1:
        context.apply_context_parallel(model, grid)
    if grid.pp > 1:
        keep_stage(model, grid)
    if grid.ep > 1:
        apply_expert_parallel(model, grid)
    for layer in moe.layers_of(model):  # with peers, its read of the counts is bounded (moe.py)
        layer.grid = grid if grid.world > 1 else None
    if grid.cp > 1 or grid.sp:  # a rank's tokens are not 0..T-1: dropout by global positions
        for m in model.modules():
            if isinstance(m, Dropout):
                m.positions = context.ActivationPositions(grid)
    specs = {name: placement(p).shard for name, p in model.named_parameters(remove_duplicate=False)}
    return gpt.materialize(model, seed, device, shard_fn=lambda name, full: take_shard(full, specs[name]),
                           values=values)


def initial_values(model: torch.nn.Module, seed: int):
    """p -> this rank's slice of parameter p's initial value (fp32, on the CPU): what build_model gives
    p, drawn only when asked."""
    names, shapes = {id(p): n for n, p in model.named_parameters()}, gpt.full_shapes(model.config)

    def value(p: torch.nn.Parameter) -> torch.Tensor:
        name = names[id(p)]
        full = gpt.init_value(name, shapes[name], seed, model.config.n_layer, model.config.tied)
        return take_shard(full, placement(p).shard)
    return value


def take_shard(full: torch.Tensor, spec: dict | None) -> torch.Tensor:
    """The part of a full tensor that `spec` names (see shard_spec)."""
    if spec is None:
        return full
    blocks = split_groups(full, spec["groups"], spec["dim"])
    return torch.cat([b.chunk(spec["count"], dim=spec["dim"])[spec["index"]] for b in blocks], dim=spec["dim"])


def unshard(pieces: list[torch.Tensor], spec: dict) -> torch.Tensor:
    """The full tensor from every rank's take_shard(full, spec), in rank order."""
    groups = spec["groups"] if isinstance(spec["groups"], int) else [g // spec["count"] for g in spec["groups"]]
    chunks = [split_groups(piece, groups, spec["dim"]) for piece in pieces]  # chunks[rank][group]
    return torch.cat([chunks[r][g] for g in range(len(chunks[0])) for r in range(len(pieces))], dim=spec["dim"])


def split_groups(x: torch.Tensor, groups: int | list[int], dim: int) -> tuple[torch.Tensor, ...]:
    """x cut along dim into `groups` equal blocks, or blocks of the sizes a list gives."""
    return x.chunk(groups, dim=dim) if isinstance(groups, int) else x.split(groups, dim=dim)
