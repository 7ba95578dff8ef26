"""Mixture of experts: a block's MLP replaced by E expert MLPs and a router that sends each token to k of
them (Shazeer et al. 2017; GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021), and expert
parallelism, the experts spread over ranks and the tokens sent to them by all-to-all.

    x (B, T, C) ─▶ router: logits = x W_r^T in fp32 (E per token) ─▶ softmax ─▶ top-k experts, weights
               ─▶ capacity: each expert takes at most ceil(c T k / E) tokens of each sequence, the
                  rest dropped (in token order: they pass through the block on the residual alone)
               ─▶ permute: the kept (token, expert) pairs sorted by expert ─▶ each expert's MLP runs on
                  its run of rows (one matmul per expert) ─▶ un-permute, scale by the router's weight,
                  sum a token's k outputs

k = 1 is Switch; k = 2 is GShard's and Mixtral's, the k weights renormalized to sum to 1. The experts are
the block's own MLP kind (GPT-2: GELU, 4C wide; Llama: SwiGLU), stacked: `c_fc.weight` is (E, out, in).
A token's MLP costs what the dense one did, k times; the parameters are E times as many. That is the
point: parameters (what the model can hold) grow without the FLOPs per token (what a step costs).

Every router statistic is per *sequence*, so splitting a batch by sequences (data parallelism,
micro-batches, expert parallelism, which is data parallelism for everything but the experts) drops the
same tokens and computes the same losses as one process (DESIGN.md, principle 3):

    capacity     ceil(c * T * k / E) assignments per expert per sequence; a token's choices rank
                 by (position, choice), so an earlier token always wins a full expert (c = 0: no limit)
    balance      Switch's auxiliary loss per sequence, E * sum_i f_i * P_i, with f_i the fraction of
                 the sequence's T k assignments that chose expert i (before dropping) and P_i the mean
                 router probability of i; 1 when the load is even, E when one expert takes all.
                 Averaged over sequences.
    z-loss       (ST-MoE, Zoph et al. 2022) the mean over tokens of logsumexp(logits)^2: keeps the
                 router's logits small, so its softmax stays in fp32's comfortable range

The objective is the language-model loss + a * aux + z * z_loss, each router loss the mean over the
model's MoE layers (so `--moe-aux-loss` means the same at any depth); train.py reports them apart. The
router's losses are not added to the loss: each layer hands its own to the backward (RouterLoss), so a
pipeline stage, which never sees the loss, and a block recomputed for its backward train their routers too.

Expert parallelism (`--ep N`, DeepSpeed-MoE and Megatron's layout): the data-parallel ranks are cut into
groups of N (the `ep` group); each rank of a group holds E / N of the experts, and the group as a whole
holds all of them. Tokens go to their expert and come back with two all-to-alls:

    rank's kept pairs, sorted by expert ─▶ all-to-all of the counts (how many rows go where)
        ─▶ the host reads its counts and what arrives, at once: the splits of both all-to-alls
        ─▶ dispatch: all-to-all with uneven splits (rank r gets the rows for its experts)
        ─▶ rows regrouped by local expert ─▶ experts ─▶ back to arrival order
        ─▶ combine: the inverse all-to-all ─▶ un-permute, weight, sum

Everything else is replicated over the whole data-parallel group as before. An expert's gradient already sums
the losses of every rank of its ep group (their tokens came to it), so it is all-reduced over the dp / N ranks
that hold the *same* experts (`edp`, Megatron's expert-data-parallel group) and divided by dp: the mean over
all dp ranks, as every other gradient (with --cp: over dp / N x cp, divided by dp x cp). Averaging it over all
of dp instead (the classic bug) would add up the gradients of different experts. Under ZeRO the experts'
optimizer state, gradients and (ZeRO 3) weights are sharded over that same edp group, the rest over dp
(gradients.py, zero.py).

Tensor parallelism leaves the experts whole, replicated on every tp rank (shard.py skips them): the MoE's
input, the LayerNorm's output, is replicated there too, so each rank routes the same tokens the same way
and computes the same gradients; no collective, tp times the expert FLOPs. Splitting each expert over tp
(Megatron's way) would cut those FLOPs and add its two all-reduces per layer: not built.

The host reads the device once per MoE layer and forward (on a GPU it waits there for the GPU):
the counts, and under --ep what the other ranks send this one, exchanged on the device first, so
that one read gives every split; the rest stays on the device (repeat_interleave is told its output
size). On NCCL that read waits at most --timeout, and a collective that NCCL reports failed is one
PeerError line, never its garbage read as split sizes (support/interrupt.host_read).

Under --compile (train.py compiles each block) the routing compiles, its shapes fixed (dropped
assignments go to a last bin rather than being filtered out); all that the counts give a shape to
runs eagerly (`MoE.send`, torch.compiler.disable). A graph holding it would guard on the counts and
compile again at nearly every forward (tests/test_moe.py counts the graphs); the experts are
matmuls, which lose little outside a graph.

Context parallelism (--cp) splits every sequence over ranks, and capacity and the balance loss are per
sequence: each MoE layer all-gathers its tokens' choices over cp (context.SequenceChoices), so every rank
queues a whole sequence's assignments and drops what one process would; f, the shares, is the whole
sequence's, P the rank's own tokens', and the mean of the cp ranks' losses is the one-process loss. With
--ep as well, an ep group's ranks share a cp rank, and the experts' gradients meet over edp x cp.

Not built yet, and refused in one line (config.check_moe): experts with sequence parallelism (each tp
rank would see a slice of every sequence, and tensor parallelism replicates the experts on whole ones),
--init-from, and --precision fp8. (ZeRO 3 with --ep runs: each block's experts are a unit of their
own, sharded over edp; tests/test_moe.py holds it to one process.)

Traffic, counted per rank (--comm-report): each all-to-all of rows counts the bytes of *this rank's own*
token rows (dispatch: the rows it sends; combine: the rows it gets back; the backward's two the same), that
is kept_assignments x C x 4 bytes in fp32. The rows cross in the dtype the experts compute in (under
autocast bf16: 2 bytes, as Megatron and DeepSpeed send them, and so does the formula).
Without dropping every token keeps its k choices, so per MoE
layer and micro-batch: 2 forward + 2 backward all-to-alls of b T k C x 4 bytes each, plus one exchange of
the E int64 counts (forward only); --recompute full runs the forward's three again in the backward. Under
--cp each MoE forward also all-gathers b T k int64 choices over cp. The bytes that cross the links are
(N-1)/N of that when the routing is even (the report's last column); how many rows a rank *receives*
depends on the routing and is not counted.
With dropping on, a rank sends only its kept assignments: fewer bytes than the formula says.
"""

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from dropout import Dropout
from support import interrupt


def capacity(T: int, k: int, n_experts: int, factor: float) -> int:
    """Assignments each expert takes from one sequence of T tokens (factor 0: all it could get, T)."""
    return math.ceil(factor * T * k / n_experts) if factor > 0 else T


@dataclass
class Routing:
    experts: torch.Tensor  # (B, T, k) int64: each token's chosen experts, best first
    weights: torch.Tensor  # (B, T, k) fp32: their router weights (renormalized to sum to 1 for k > 1)
    keep: torch.Tensor  # (B, T, k) bool: within the expert's capacity for this sequence
    aux: torch.Tensor  # () Switch's load-balancing loss, the mean over sequences
    z: torch.Tensor  # () the router z-loss, the mean over tokens
    load: torch.Tensor  # (E,) assignments per expert, before dropping


def route(logits: torch.Tensor, k: int, factor: float, gather=None) -> Routing:
    """Top-k routing of logits (B, T, E), fp32, with per-sequence capacity and losses (module docstring).
    `gather` (context parallelism, where T is this rank's slice of each sequence): this rank's choices ->
    (the whole sequences' choices in sequence order, where this rank's tokens sit in them)."""
    B, T, E = logits.shape
    probs = logits.softmax(-1)  # (B, T, E)
    weights, experts = probs.topk(k, dim=-1)  # (B, T, k) each
    if k > 1:
        weights = weights / weights.sum(-1, keepdim=True)
    every, mine = (experts, None) if gather is None else gather(experts)  # (B, S, k): whole sequences
    S = every.size(1)
    chosen = F.one_hot(every.reshape(B, S * k), E)  # (B, S k, E), in (position, choice) order
    # an assignment's place in its expert's queue for this sequence: earlier tokens first
    place = (chosen.cumsum(1) * chosen).sum(-1) - 1  # (B, S k)
    keep = (place < capacity(S, k, E, factor)).view(B, S, k)
    f = chosen.sum(1).float() / (S * k)  # (B, E): the share of each sequence's assignments, all its tokens'
    aux = E * (f * probs.mean(1)).sum(-1).mean()  # P, the router's mean probability: over this rank's tokens
    z = torch.logsumexp(logits, -1).square().mean()
    if mine is not None:  # this rank's tokens; each cp rank's aux has the whole f and its own P, and their mean
        keep, chosen = keep[:, mine], F.one_hot(experts.reshape(B, T * k), E)  # (over cp) is the whole aux
    return Routing(experts, weights, keep, aux, z, chosen.sum((0, 1)).float())


class Stacked(nn.Module):
    """E linear layers' weights (E, out, in) and biases (E, out), one tensor each: y_e = x W_e^T + b_e."""

    def __init__(self, n: int, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, out_features, in_features))
        self.bias = nn.Parameter(torch.empty(n, out_features)) if bias else None

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(W_e, b_e) of each expert, as views. unbind, not weight[e]: its backward stacks the E gradients
        into one tensor, where E indexings would each add a whole (E, out, in) tensor of zeros."""
        biases = self.bias.unbind(0) if self.bias is not None else [None] * self.weight.size(0)
        return list(zip(self.weight.unbind(0), biases))


class Experts(nn.Module):
    """The MLPs of this rank's experts, run on rows sorted by expert: counts[e] rows for expert e.
    One matmul pair per expert over all its rows (a loop over experts, never over tokens), which wastes
    nothing on padding; tests/bench_moe.py times it against one batched matmul over rows padded to the
    largest count."""

    def __init__(self, n: int, n_embd: int, hidden: int, swiglu: bool):
        super().__init__()
        self.swiglu = swiglu
        self.c_fc = Stacked(n, n_embd, (2 if swiglu else 1) * hidden, bias=not swiglu)
        self.c_proj = Stacked(n, hidden, n_embd, bias=not swiglu)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        fc, proj = self.c_fc.layers(), self.c_proj.layers()
        return torch.cat([self.mlp(fc[e], proj[e], rows) for e, rows in enumerate(x.split(counts))])  # (sum, C)

    def mlp(self, fc: tuple, proj: tuple, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, *fc)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            return F.linear(F.silu(gate) * up, *proj)
        return F.linear(F.gelu(h, approximate="tanh"), *proj)


@functools.cache
def eager_send(cls: type) -> None:
    """torch.compiler.disable on MoE.send, when the first MoE layer is built: as a decorator it would
    import torch._dynamo (1.7 s of CPU) in every process that imports model.py."""
    cls.send = torch.compiler.disable(cls.send)


class MoE(nn.Module):
    """A block's MLP as routed experts. After each forward it keeps what the router decided, for the
    loss and the reports: `aux`, `z` (scalars), `load` (assignments per expert) and `dropped` (the fraction
    of assignments over capacity), of this rank's tokens. `exchange` is expert parallelism's seam: None on one
    rank; an ExpertParallel (which shard.py sets) sends the rows to the ranks of their experts and back.
    `gather` is context parallelism's (context.SequenceChoices): capacity counts whole sequences."""

    def __init__(self, n_embd: int, hidden: int, swiglu: bool, n_experts: int, top_k: int,
                 capacity_factor: float, dropout: float = 0.0):
        super().__init__()
        eager_send(MoE)  # eager: no compiled graph guards on the counts (module docstring)
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.router = nn.Linear(n_embd, n_experts, bias=False)
        self.experts = Experts(n_experts, n_embd, hidden, swiglu)
        self.dropout = Dropout(dropout)  # dropout.py: the same mask at every layout
        self.exchange = self.gather = None
        self.grid = None  # where there are other ranks (shard.py): bounds the read of the device
        self.aux = self.z = self.load = self.dropped = None
        self.rows_sent = 0  # kept assignments of the training forwards so far: what --comm-report's formula counts
        # (a block recomputed for its backward, --recompute full, runs its forward twice: both count, alike)
        self.loss_weights = (0.0, 0.0)  # the objective's weights of aux and z, over the model's MoE layers (train_with)
        self.backward_scale = 1.0  # what the backward multiplies this micro-batch's objective by (begin_step)
        self.step_sums, self.step_forwards = None, 0  # (aux, z, dropped) summed over the step's training forwards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):  # the router in fp32, whatever the precision
            logits = F.linear(x.float(), self.router.weight.float())  # (B, T, E)
        r = route(logits, self.top_k, self.capacity_factor, self.gather)
        self.aux, self.z, self.load, self.dropped = r.aux, r.z, r.load, (~r.keep).float().mean()
        # every assignment (token, choice) by expert, in token order within one; dropped ones in a last bin
        expert = torch.where(r.keep, r.experts, self.n_experts).flatten()  # (B T k,)
        order = torch.argsort(expert, stable=True)
        counts = torch.zeros(self.n_experts + 1, dtype=torch.long, device=x.device).index_add_(
            0, expert, torch.ones_like(expert))
        return self.send(x, order, counts[:-1], r.weights)  # (fixed shapes until here)

    def send(self, x: torch.Tensor, order: torch.Tensor, counts: torch.Tensor,
             weights: torch.Tensor) -> torch.Tensor:
        """The kept assignments' rows through their experts (here, or over the ep group) and back,
        weighted and summed per token: all that the counts (E,), on the device, give a shape to."""
        B, T, C = x.shape
        if self.training:
            numbers = torch.stack([self.aux, self.z, self.dropped]).detach()
            self.step_sums = numbers if self.step_sums is None else self.step_sums + numbers
            self.step_forwards += 1
        got = counts[:0] if self.exchange is None else self.exchange.arriving(counts)
        # The one read of the device: this rank's assignments per expert (the splits of its rows),
        # and under --ep what each rank of the group sends this rank's experts (what arrives)
        both = self.read(torch.cat([counts, got]))
        counts, arriving = both[:self.n_experts], both[self.n_experts:]
        kept = sum(counts)
        self.rows_sent += kept if self.training else 0
        token, weight = order[:kept] // self.top_k, weights.flatten()[order[:kept]]  # (kept,) each
        rows = x.reshape(B * T, C)[token].to(compute_dtype(x))  # (kept, C): as matmuls take them
        y = self.experts(rows, counts) if self.exchange is None else \
            self.exchange(self.experts, rows, counts, got, arriving)
        out = y.new_zeros(B * T, C).index_add_(0, token, y * weight[:, None].to(y.dtype))
        a, z = self.loss_weights
        if torch.is_grad_enabled() and (a or z):
            out = RouterLoss.apply(out, a * self.aux + z * self.z, self.backward_scale)
        return self.dropout(out.view(B, T, C))

    def read(self, t: torch.Tensor) -> list:
        """t's values on the host; on NCCL at most --timeout, a failed collective one PeerError."""
        if self.grid is None:
            return t.tolist()
        where = f"rank {self.grid.rank}, reading an MoE layer's counts"
        return interrupt.host_read(self.grid, t, where)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype autocast runs matmuls in, or x's own: the experts' input, so the rows cross the ep
    group in it (bf16: half the bytes of fp32) and come back in it."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


class RouterLoss(torch.autograd.Function):
    """`out` as it is; its backward also starts the backward of the router's `loss`, with gradient `weight`:
    the same gradients as if weight x loss had been added to what the step back-propagates (Megatron's way
    of carrying an auxiliary loss). So the router's losses need no path to the end of the model: a pipeline
    stage back-propagates its own layers' (they never reach the last stage's loss), and a block recomputed
    for its backward (--recompute full: its first forward keeps no graph) makes them again as it runs."""

    @staticmethod
    def forward(ctx, out, loss, weight):
        ctx.weight = weight
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_full((), ctx.weight, dtype=torch.float32), None


def train_with(model: nn.Module, aux_weight: float, z_weight: float) -> None:
    """The objective is the language-model loss + aux_weight x aux + z_weight x z, each router loss the mean
    over the model's MoE layers (the whole model's: a pipeline stage holds some of them)."""
    n = moe_layers(model.config.n_layer, model.config.moe_experts, model.config.moe_every)
    for m in layers_of(model):
        m.loss_weights = (aux_weight / n, z_weight / n)


def begin_step(model: nn.Module, backward_scale: float) -> None:
    """Before a step's micro-batches: the scale their backward applies to the objective (the loss scale over
    the number of micro-batches), and the step's router numbers from zero."""
    for m in layers_of(model):
        m.backward_scale, m.step_sums, m.step_forwards = backward_scale, None, 0


def step_numbers(model: nn.Module) -> torch.Tensor:
    """This rank's share of the step's (aux, z, dropped), each the mean over forwards (micro-batches; a
    recomputed forward repeats its original exactly, so counting both leaves the mean) and over the whole
    model's MoE layers: the sum over this rank's layers of their means, over all the model's layers (so a sum
    over the pipeline stages is the mean); empty for a dense model."""
    cfg, device = model.config, next(model.parameters()).device
    if not cfg.moe_experts:
        return torch.zeros(0, device=device)
    mine = [m.step_sums / m.step_forwards for m in layers_of(model) if m.step_forwards]
    return torch.stack(mine).sum(0) / moe_layers(cfg.n_layer, cfg.moe_experts, cfg.moe_every) if mine \
        else torch.zeros(3, device=device)


def layers_of(model: nn.Module) -> list["MoE"]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def router_losses(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(aux, z, dropped) of the last forward, each the mean over the model's MoE layers; None without any."""
    layers = layers_of(model)
    if not layers:
        return None
    return tuple(torch.stack([getattr(m, what) for m in layers]).mean() for what in ("aux", "z", "dropped"))


def is_moe_layer(i: int, every: int) -> bool:
    """Every `every`-th block has experts, the last of each group: every=2 puts them in blocks 1, 3, ..."""
    return (i + 1) % every == 0


def moe_layers(n_layer: int, n_experts: int, every: int) -> int:
    return sum(is_moe_layer(i, every) for i in range(n_layer)) if n_experts else 0


def param_delta(cfg, dense_mlp: int) -> int:
    """Parameters an MoE model has beyond its dense twin: per MoE layer E - 1 more MLPs and the router."""
    n = moe_layers(cfg.n_layer, cfg.moe_experts, cfg.moe_every)
    return n * ((cfg.moe_experts - 1) * dense_mlp + cfg.moe_experts * cfg.n_embd)


def active_matmul_delta(cfg, dense_matrices: int) -> int:
    """Matmul weights a token uses beyond the dense twin's: per MoE layer k - 1 more MLPs and the router."""
    n = moe_layers(cfg.n_layer, cfg.moe_experts, cfg.moe_every)
    return n * ((cfg.moe_top_k - 1) * dense_matrices + cfg.moe_experts * cfg.n_embd)


# ----------------------------------------------------------------------------- expert parallelism


class AllToAll(torch.autograd.Function):
    """Rows to the ranks of the ep group, `send[r]` of them to rank r, `recv[r]` arriving from it; the
    backward sends the gradients back the same way. `own`: the rows that are this rank's tokens (counted
    by the grid, both ways; module docstring)."""

    @staticmethod
    def forward(ctx, x, grid, send, recv, own):
        ctx.grid, ctx.send, ctx.recv, ctx.own = grid, send, recv, own
        out = x.new_empty(sum(recv), x.size(1))
        grid.all_to_all(out, x.contiguous(), "ep", out_splits=recv, in_splits=send,
                        nbytes=own * row_bytes(x))
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(sum(ctx.send), grad.size(1))
        ctx.grid.all_to_all(out, grad.contiguous(), "ep", out_splits=ctx.send, in_splits=ctx.recv,
                            nbytes=ctx.own * row_bytes(grad))
        return out, None, None, None, None


def row_bytes(x: torch.Tensor) -> int:
    return x.size(1) * x.element_size()  # (not x[:1].nbytes: a rank may be sent no rows at all)


class ExpertParallel:
    """MoE.exchange under --ep: rows sorted by (global) expert go to the rank holding it, run there,
    and come back in the order they left."""

    def __init__(self, grid):
        self.grid = grid

    def arriving(self, counts: torch.Tensor) -> torch.Tensor:
        """(E,) rows this rank sends each expert -> (ep x E/ep,) on the device: [s x E/ep + j], the
        rows rank s sends this rank's expert j. The host reads both at once (MoE.send)."""
        got = torch.zeros_like(counts)  # not empty: a failed collective leaves no garbage here
        self.grid.all_to_all(got, counts, "ep")
        return got

    def __call__(self, experts: Experts, rows: torch.Tensor, counts: list[int], got: torch.Tensor,
                 arriving: list[int]) -> torch.Tensor:
        grid, ep = self.grid, self.grid.ep
        local = len(counts) // ep  # experts per rank
        send = [sum(counts[r * local:(r + 1) * local]) for r in range(ep)]  # rows to each rank
        recv = [sum(arriving[s * local:(s + 1) * local]) for s in range(ep)]  # and from each
        arrived = AllToAll.apply(rows, grid, send, recv, sum(send))  # by source rank, then expert
        # regroup by local expert (rows from each source stay in order), run, and put back
        expert_of = torch.arange(local, device=rows.device).repeat(ep)
        expert_of = expert_of.repeat_interleave(got, output_size=sum(recv))  # (no device read)
        order = torch.argsort(expert_of, stable=True)
        y = experts(arrived[order], [sum(arriving[j::local]) for j in range(local)])
        y = y.new_empty(y.shape).index_copy(0, order, y)  # in the experts' dtype (autocast's)
        return AllToAll.apply(y, grid, recv, send, sum(send))
