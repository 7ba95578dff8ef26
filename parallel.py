"""Parallelism from raw torch.distributed primitives.

The process grid. `world = dp * tp * pp` ranks, numbered so that tensor-parallel ranks are
adjacent (they exchange the most data, so they should share a node), then data parallel,
then pipeline:

    rank = (pp_rank * dp + dp_rank) * tp + tp_rank

    pp=2, dp=2, tp=2:         tp group: ranks that split each layer      {0,1} {2,3} {4,5} {6,7}
       stage 0: [0 1] [2 3]   dp group: ranks that hold the same shard   {0,2} {1,3} {4,6} {5,7}
       stage 1: [4 5] [6 7]   pp group: ranks that pass activations      {0,4} {1,5} {2,6} {3,7}

`Grid` owns this arithmetic; nothing else computes ranks.
"""

import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

import model as gpt

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor; same collectives
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class LayoutError(ValueError):
    """An impossible parallel layout; raised before any work, printed as one line."""


class PeerError(RuntimeError):
    """A collective failed: a peer died, hung past --timeout, or the network broke."""


def peer_call(fn, *args, **kwargs):
    """Run a torch.distributed call; turn its failure into one PeerError line."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as e:
        lines = [ln for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
        raise PeerError(lines[0][:300]) from e


class Traffic:
    """Calls and bytes per (collective, group) since the last reset. Bytes are the size of the full
    buffer (all-reduce input, all-gather output, reduce-scatter input, p2p message)."""

    def __init__(self):
        self.counts = defaultdict(lambda: [0, 0])

    def add(self, op: str, group: str, nbytes: int) -> None:
        self.counts[(op, group)][0] += 1
        self.counts[(op, group)][1] += nbytes

    def reset(self) -> None:
        self.counts.clear()

    def bytes(self, op: str | None = None, group: str | None = None) -> int:
        return sum(b for (o, g), (_, b) in self.counts.items() if op in (None, o) and group in (None, g))


@dataclass
class Grid:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    groups: dict = field(default_factory=dict)  # "tp" / "dp" / "pp" / "embed" -> this rank's group
    traffic: "Traffic" = field(default_factory=lambda: Traffic())

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp % self.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.dp)

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank

    @property
    def is_logger(self) -> bool:
        """Rank 0 prints, draws the progress bar and writes files."""
        return self.rank == 0

    def log(self, msg: str) -> None:
        if self.is_logger:
            print(msg, flush=True)

    def barrier(self) -> None:
        if self.world > 1:
            peer_call(dist.barrier)

    def rank0_first(self, fn):
        """Run fn on rank 0, then on the others (e.g. prepare data once, then read the cache)."""
        result = fn() if self.rank == 0 else None
        self.barrier()
        return result if self.rank == 0 else fn()

    def global_loss(self, x: torch.Tensor) -> torch.Tensor:
        """The batch loss on every rank: it lives on the last pipeline stage (the others hold 0, so a
        sum over the pipeline group copies it), and is averaged over data-parallel ranks."""
        x = x.detach().float().clone()
        self.all_reduce(x, "pp")
        self.all_reduce(x, "dp")
        return x / self.dp

    # Every collective in the codebase goes through these four methods, which count the bytes.
    def size(self, group: str) -> int:
        return {"tp": self.tp, "dp": self.dp, "pp": self.pp, "world": self.world,
                "embed": 2 if self.pp > 1 else 1}[group]

    def all_reduce(self, t: torch.Tensor, group: str, op=dist.ReduceOp.SUM, async_op: bool = False):
        if self.size(group) == 1:
            return None
        self.traffic.add("all_reduce", group, t.numel() * t.element_size())
        return peer_call(dist.all_reduce, t, op=op, group=self.groups.get(group), async_op=async_op)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: str, async_op: bool = False):
        """out = concat over the group's ranks of inp, along dim 0."""
        if self.size(group) == 1:
            out.copy_(inp)
            return None
        self.traffic.add("all_gather", group, out.numel() * out.element_size())
        return peer_call(all_gather_single, out, inp, group=self.groups.get(group), async_op=async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group: str, async_op: bool = False):
        """out = this rank's dim-0 slice of the sum over the group of inp."""
        if self.size(group) == 1:
            out.copy_(inp)
            return None
        self.traffic.add("reduce_scatter", group, inp.numel() * inp.element_size())
        return peer_call(reduce_scatter_single, out, inp, group=self.groups.get(group), async_op=async_op)

    def send_recv(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> None:
        """Point-to-point, posted together so that paired sends and receives cannot deadlock."""
        sends = [(t.contiguous(), peer) for t, peer in sends]
        ops = [dist.P2POp(dist.isend, t, peer) for t, peer in sends]
        ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in recvs]
        for t, _ in sends:
            self.traffic.add("send", "pp", t.numel() * t.element_size())
        if ops:
            for work in peer_call(dist.batch_isend_irecv, ops):
                peer_call(work.wait)

    def __str__(self) -> str:
        lines = [f"grid: world {self.world} = dp {self.dp} x tp {self.tp} x pp {self.pp}"]
        for p in range(self.pp):
            row = "  ".join("[" + " ".join(f"{self.rank_of(p, d, t)}" for t in range(self.tp)) + "]"
                            for d in range(self.dp))
            lines.append(f"  stage {p}: {row}    (each [...] is a tensor-parallel group)")
        return "\n".join(lines)


def init_grid(tp: int, pp: int, device: torch.device, timeout_s: float = 300) -> Grid:
    """Join the process group that torchrun describes (or none, for one process) and build the
    tp / dp / pp groups. Every rank creates every group in the same order, as new_group requires."""
    world = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun
    rank = int(os.environ.get("RANK", "0"))
    if world % (tp * pp):
        raise LayoutError(f"world size {world} is not divisible by tp*pp = {tp}*{pp}; launch a multiple "
                          f"of {tp * pp} processes or change --tp/--pp")
    if device.type == "cuda":
        device = local_gpu()
    grid = Grid(tp=tp, pp=pp, dp=world // (tp * pp), rank=rank, device=device)
    if world == 1:
        return grid
    # A launcher that restarts the job (torchrun --max-restarts) keeps its key-value store; keys
    # from the dead attempt would point new groups at dead peers, so each attempt gets a prefix.
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timedelta(seconds=timeout_s)))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                            store=dist.PrefixStore(f"nanoscale/attempt{attempt}", store),
                            timeout=timedelta(seconds=timeout_s))
    ids = torch.arange(world).view(pp, grid.dp, tp)  # ids[pp_rank, dp_rank, tp_rank] = rank
    layouts = {"tp": ids.reshape(-1, tp), "dp": ids.permute(0, 2, 1).reshape(-1, grid.dp),
               "pp": ids.permute(1, 2, 0).reshape(-1, pp)}
    if pp > 1:  # the first and last stage both hold the tied embedding
        layouts["embed"] = torch.stack([ids[0], ids[-1]], dim=-1).reshape(-1, 2)
    for name, members in layouts.items():
        if members.size(1) == world:
            grid.groups[name] = None  # the default group already is this group
            continue
        for ranks in members.tolist() if members.size(1) > 1 else []:  # size-1 groups never talk
            group = dist.new_group(ranks)
            if rank in ranks:
                grid.groups[name] = group
    return grid


def local_gpu() -> torch.device:
    """This process's GPU: one per local rank. More processes on a node than GPUs is a clear error,
    raised by every rank alike (so none is left waiting for the others)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    visible = torch.cuda.device_count()
    if max(local_world, local_rank + 1) > visible:
        raise LayoutError(f"{max(local_world, local_rank + 1)} processes on this node but {visible} visible GPU"
                          f"{'s' if visible != 1 else ''}: launch at most {visible} per node (torchrun "
                          f"--nproc-per-node {visible}), or add --device cpu to rehearse the layout on CPU "
                          "processes (gloo)")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- data parallel


class Bucket:
    """A run of parameters whose fp32 gradients live side by side in one flat `main_grad`
    buffer, so they are averaged with one collective instead of one per tensor."""

    def __init__(self, params: list[torch.nn.Parameter], pad_to: int, device: torch.device):
        self.params, self.offsets, n = params, [], 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        padded = -(-n // pad_to) * pad_to  # ZeRO splits the buffer into dp equal shards
        self.main_grad = torch.zeros(padded, dtype=torch.float32, device=device)
        self.shard_size = padded // pad_to
        self.ready, self.work, self.launched = 0, None, False

    def views(self, flat: torch.Tensor):
        """(param, its slice of `flat` shaped like it)"""
        for p, off in zip(self.params, self.offsets):
            yield p, flat[off:off + p.numel()].view_as(p)


class GradSync:
    """Data-parallel gradient averaging (what DDP does), from raw collectives.

    Each parameter's gradient is added into its bucket's fp32 `main_grad` by a hook that fires
    the moment autograd finishes accumulating it. When the last gradient of a bucket arrives, the
    bucket's all-reduce (or, for ZeRO-1, reduce-scatter) is launched asynchronously, so the
    communication of late layers overlaps the backward of early ones. Buckets follow the
    parameters in reverse order, the order backward produces their gradients.

    Gradient accumulation: micro-steps before the last only accumulate (`sync = False`); the
    collectives run once, on the last micro-step's backward.
    """

    def __init__(self, model: torch.nn.Module, grid: Grid, bucket_mb: float = 25, overlap: bool = True,
                 zero: bool = False):
        self.grid, self.overlap, self.zero, self.sync = grid, overlap, zero, True
        params = [p for p in model.parameters() if p.requires_grad][::-1]
        # The pipeline's two copies of the tied embedding get a bucket each, alone, so that under
        # ZeRO both copies are cut at the same element offsets and their shards can be summed.
        tied = [p for p in params if getattr(p, "tied_copy", False) or getattr(p, "tied_embedding", False)]
        self.buckets, current, size = [[p] for p in tied], [], 0
        for p in (p for p in params if not any(p is t for t in tied)):
            current.append(p)
            size += p.numel() * 4
            if size >= bucket_mb * 2**20:
                self.buckets.append(current)
                current, size = [], 0
        if current:
            self.buckets.append(current)
        self.buckets = [Bucket(b, grid.dp if zero else 1, grid.device) for b in self.buckets]
        self.slot = {}
        for b in self.buckets:
            for p, off in zip(b.params, b.offsets):
                self.slot[p] = (b, off)
                p.register_post_accumulate_grad_hook(self._on_grad)
        self.events, self.last_events = [], []  # (what, bucket, seconds): the overlap, measured

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        b, off = self.slot[p]
        b.main_grad[off:off + p.numel()].add_(p.grad.flatten())
        p.grad = None  # the gradient now lives in main_grad
        if self.sync:
            b.ready += 1
            if self.overlap and b.ready == len(b.params):
                self._launch(b)

    def _launch(self, b: Bucket) -> None:
        self.events.append(("launch", self.buckets.index(b), time.perf_counter()))
        if self.zero:  # each rank receives the sum of only its shard
            b.shard = torch.empty(b.shard_size, device=b.main_grad.device)
            b.work = self.grid.reduce_scatter(b.shard, b.main_grad, "dp", async_op=True)
        else:
            b.work = self.grid.all_reduce(b.main_grad, "dp", async_op=True)
        b.launched = True

    def finish(self) -> None:
        """After the last backward: launch what is left (everything, without overlap), wait, average,
        and point each p.grad at its slice of main_grad."""
        self.events.append(("backward done", -1, time.perf_counter()))
        for b in self.buckets:
            if not b.launched:
                self._launch(b)
        for b in self.buckets:
            if b.work is not None:
                peer_call(b.work.wait)
            if self.zero:
                lo = self.grid.dp_rank * b.shard_size
                b.main_grad[lo:lo + b.shard_size].copy_(b.shard)
                b.main_grad[lo:lo + b.shard_size] /= self.grid.dp
            else:
                b.main_grad /= self.grid.dp
            b.ready, b.work, b.launched = 0, None, False
            for p, view in b.views(b.main_grad):
                if p.dtype != view.dtype:
                    p.grad_dtype = None  # a bf16 parameter with an fp32 gradient: allowed on purpose
                p.grad = view
        self.events.append(("reduced", -1, time.perf_counter()))
        self.last_events, self.events = self.events, []

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.main_grad.zero_()
            for p in b.params:
                p.grad = None


class ZeroAdamW:
    """ZeRO stage 1 (Rajbhandari et al. 2020, "ZeRO", section 5.1): the optimizer state is split
    across the data-parallel ranks instead of replicated.

        reduce-scatter grads ─▶ rank r holds the averaged grad of shard r of every bucket
        AdamW on shard r only: fp32 master weights, exp_avg, exp_avg_sq  (12 bytes/param / dp)
        all-gather the updated shards ─▶ every rank has the whole new model

    Same bytes on the wire as an all-reduce (which *is* a reduce-scatter then an all-gather), a
    dp-th of the optimizer memory. The parameters live in flat per-bucket buffers so the gather
    writes straight into them; they may be bf16 while the master shard stays fp32.
    The update is AdamW exactly as torch.optim.AdamW computes it.
    """

    def __init__(self, sync: GradSync, lr: float, betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, param_dtype: torch.dtype = torch.float32):
        self.sync, self.grid = sync, sync.grid
        self.betas, self.eps, self.t = betas, eps, 0
        self.param_groups = [{"lr": lr}]
        self.shards = []
        for b in sync.buckets:
            master = torch.zeros(b.main_grad.numel(), device=b.main_grad.device)  # fp32, all of it for now
            decay = torch.zeros_like(master)
            for (p, view), off in zip(b.views(master), b.offsets):
                view.copy_(p.detach())
                decay[off:off + p.numel()] = weight_decay if p.dim() >= 2 else 0.0
            flat = master.to(param_dtype)
            for p, view in b.views(flat):
                p.data = view  # the parameter is now a window onto the bucket's flat buffer
            lo = self.grid.dp_rank * b.shard_size
            s = slice(lo, lo + b.shard_size)
            self.shards.append({"flat": flat, "slice": s, "master": master[s].clone(),
                                "exp_avg": torch.zeros(b.shard_size, device=flat.device),
                                "exp_avg_sq": torch.zeros(b.shard_size, device=flat.device),
                                "decay": decay[s].clone()})

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        lr, (beta1, beta2) = self.param_groups[0]["lr"], self.betas
        bias1, bias2 = 1 - beta1**self.t, 1 - beta2**self.t
        for b, st in zip(self.sync.buckets, self.shards):
            g, w = b.main_grad[st["slice"]], st["master"]
            w.mul_(1 - lr * st["decay"])
            st["exp_avg"].lerp_(g, 1 - beta1)
            st["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (st["exp_avg_sq"].sqrt() / bias2**0.5).add_(self.eps)
            w.addcdiv_(st["exp_avg"], denom, value=-lr / bias1)
            self.grid.all_gather(st["flat"], w.to(st["flat"].dtype), "dp")

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.sync.zero_grad()

    def state_bytes(self) -> int:
        """Optimizer state held by this rank: master weights and both moments (fp32)."""
        return sum(st[k].numel() * 4 for st in self.shards for k in ("master", "exp_avg", "exp_avg_sq"))

    def pieces(self, model: torch.nn.Module):
        """(name, param, kind, (start, stop) within the param, tensor) for each part of this rank's
        shards, so a checkpoint can store the state per parameter and reshard it."""
        names = {id(p): n for n, p in model.named_parameters()}
        for b, st in zip(self.sync.buckets, self.shards):
            lo, hi = st["slice"].start, st["slice"].stop
            for p, off in zip(b.params, b.offsets):
                a, z = max(lo, off), min(hi, off + p.numel())
                if a < z:
                    for kind in ("master", "exp_avg", "exp_avg_sq"):
                        yield names[id(p)], p, kind, (a - off, z - off), st[kind][a - lo:z - lo]

    @torch.no_grad()
    def load_pieces(self, model: torch.nn.Module, state, t: int) -> None:
        """Fill this rank's shards from full per-parameter state: state(name, p, kind) gives p's
        slice in fp32, or None when the checkpoint has none (a master then starts from the
        parameter, a moment from zero)."""
        self.t = t
        for name, p, kind, (a, z), dst in self.pieces(model):
            src = state(name, p, kind)
            if src is None and kind == "master":
                src = p.detach().float()
            if src is None:
                dst.zero_()
            else:
                dst.copy_(src.flatten()[a:z])


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


class TPContext:
    """What every tensor-parallel layer shares: the grid and whether the sequence is sharded."""

    def __init__(self, grid: Grid, sp: bool):
        self.grid, self.sp = grid, sp


class CopyToTP(torch.autograd.Function):
    """Megatron's f: the input is already replicated; its gradient is a sum over the ranks."""

    @staticmethod
    def forward(ctx, x, tp: TPContext):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.tp.grid.all_reduce(grad, "tp")
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """Megatron's g: partial sums become the full output; the gradient is already replicated."""

    @staticmethod
    def forward(ctx, x, tp: TPContext):
        x = x.contiguous().clone()
        tp.grid.all_reduce(x, "tp")
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def gather_seq(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """(B, T/tp, C) from each rank -> (B, T, C) on every rank."""
    xs = x.transpose(0, 1).contiguous()  # (T/tp, B, C): collectives concatenate along dim 0
    out = xs.new_empty((xs.size(0) * tp.grid.tp, *xs.shape[1:]))
    tp.grid.all_gather(out, xs, "tp")
    return out.transpose(0, 1)


def reduce_scatter_seq(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """(B, T, C) partial sums on each rank -> this rank's (B, T/tp, C) slice of the sum."""
    xs = x.transpose(0, 1).contiguous()  # (T, B, C)
    out = xs.new_empty((xs.size(0) // tp.grid.tp, *xs.shape[1:]))
    tp.grid.reduce_scatter(out, xs, "tp")
    return out.transpose(0, 1)


class GatherSeq(torch.autograd.Function):
    """Sequence-parallel f: all-gather forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return gather_seq(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_seq(grad, ctx.tp), None


class ReduceScatterSeq(torch.autograd.Function):
    """Sequence-parallel g: reduce-scatter forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return reduce_scatter_seq(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return gather_seq(grad, ctx.tp), None


class SplitSeq(torch.nn.Module):
    """Enter the sequence-parallel region after the embedding: keep this rank's slice of the
    (replicated) sequence; backward all-gathers the slices' gradients."""

    def __init__(self, tp: TPContext):
        super().__init__()
        self.tp = tp

    def forward(self, x):
        if not self.tp.sp:
            return x
        return SplitSeqFn.apply(x, self.tp)


class SplitSeqFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        if x.size(1) % tp.grid.tp:
            raise LayoutError(f"--sp needs the sequence length ({x.size(1)}) divisible by --tp {tp.grid.tp}")
        return x.chunk(tp.grid.tp, dim=1)[tp.grid.tp_rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return gather_seq(grad, ctx.tp), None


def shard_spec(tp: TPContext, dim: int, groups: int = 1) -> dict:
    """Which slice of the full tensor this rank holds: split `dim` into `groups` blocks (q, k, v
    for the fused projection) and keep part `index` of `count` from each."""
    return {"dim": dim, "index": tp.grid.tp_rank, "count": tp.grid.tp, "groups": groups}


def meta_param(*shape, spec: dict | None = None, **attrs) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.empty(*shape, device="meta"))
    p.shard = spec
    p.__dict__.update(attrs)
    return p


class ColumnParallelLinear(torch.nn.Module):
    """y = x A^T + b with A split by output features: each rank computes its own columns of y.
    `groups` > 1 splits each of that many blocks of outputs (q, k and v) separately, so every
    rank gets whole heads of each."""

    def __init__(self, in_features: int, out_features: int, tp: TPContext, bias: bool = True,
                 groups: int = 1):
        super().__init__()
        self.tp = tp
        spec = shard_spec(tp, 0, groups)
        self.weight = meta_param(out_features // tp.grid.tp, in_features, spec=spec)
        self.bias = meta_param(out_features // tp.grid.tp, spec=spec) if bias else None

    def forward(self, x):
        x = GatherSeq.apply(x, self.tp) if self.tp.sp else CopyToTP.apply(x, self.tp)
        return torch.nn.functional.linear(x, self.weight, self.bias)  # (B, T, out / tp)


class RowParallelLinear(torch.nn.Module):
    """y = x A^T + b with A split by input features: each rank holds a slice of x's features and
    produces a partial sum of y; g sums them. The bias is replicated and added once, after."""

    def __init__(self, in_features: int, out_features: int, tp: TPContext):
        super().__init__()
        self.tp = tp
        self.weight = meta_param(out_features, in_features // tp.grid.tp, spec=shard_spec(tp, 1))
        self.bias = meta_param(out_features, sequence_parallel=tp.sp)

    def forward(self, x):
        y = torch.nn.functional.linear(x, self.weight)  # (B, T, out), a partial sum
        y = ReduceScatterSeq.apply(y, self.tp) if self.tp.sp else ReduceFromTP.apply(y, self.tp)
        return y + self.bias


class VocabParallelEmbedding(torch.nn.Module):
    """Rank r holds rows [r V/tp, (r+1) V/tp) of the table. Each rank looks up the tokens it owns,
    writes zeros for the rest, and g sums the ranks' partial embeddings."""

    def __init__(self, vocab: int, dim: int, tp: TPContext):
        super().__init__()
        self.tp = tp
        self.weight = meta_param(vocab // tp.grid.tp, dim, spec=shard_spec(tp, 0))

    @property
    def vocab_start(self) -> int:
        return self.tp.grid.tp_rank * self.weight.size(0)

    def forward(self, idx):
        local = idx - self.vocab_start
        outside = (local < 0) | (local >= self.weight.size(0))
        out = torch.nn.functional.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, C)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return ReduceFromTP.apply(out, self.tp)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split by vocabulary, never gathering them (Megatron, section 3):

        m   = max over all ranks of the logits          (all-reduce MAX, B*T floats)
        z_t = the target's logit - m, from its owner     (all-reduce SUM, B*T floats)
        S   = sum over all ranks of exp(logit - m)       (all-reduce SUM, B*T floats)
        loss = log S - z_t;   d loss / d logits = softmax - onehot(target)
    """

    @staticmethod
    def forward(ctx, logits, targets, tp: TPContext, vocab_start: int):
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        logits = logits.float().flatten(0, 1)  # (N, V/tp)
        targets = targets.flatten()  # (N,)
        grid = tp.grid
        m = logits.max(dim=-1).values
        grid.all_reduce(m, "tp", op=dist.ReduceOp.MAX)
        shifted = logits - m.unsqueeze(1)
        local = targets - vocab_start
        mine = (local >= 0) & (local < logits.size(1))
        local = local.clamp(0, logits.size(1) - 1)
        z_t = shifted.gather(1, local.unsqueeze(1)).squeeze(1) * mine
        grid.all_reduce(z_t, "tp")
        exp = shifted.exp()
        S = exp.sum(dim=-1)
        grid.all_reduce(S, "tp")
        ctx.save_for_backward(exp / S.unsqueeze(1), local, mine)
        return (S.log() - z_t).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine = ctx.saved_tensors
        g = softmax.clone()
        g[torch.arange(g.size(0), device=g.device), local] -= mine.float()
        g *= grad / g.size(0)
        return g.view(ctx.shape).to(ctx.dtype), None, None, None


def apply_tensor_parallel(model: gpt.GPT, grid: Grid, sp: bool) -> TPContext:
    """Swap a meta-built GPT's layers for their tensor-parallel versions, in place."""
    tp = TPContext(grid, sp)
    cfg = model.config
    C, V = cfg.n_embd, cfg.padded_vocab
    for block in model.transformer.h:
        block.attn.c_attn = ColumnParallelLinear(C, 3 * C, tp, groups=3)  # whole heads of q, k, v
        block.attn.c_proj = RowParallelLinear(C, C, tp)
        block.mlp.c_fc = ColumnParallelLinear(C, 4 * C, tp)
        block.mlp.c_proj = RowParallelLinear(4 * C, C, tp)
    model.transformer.wte = VocabParallelEmbedding(V, C, tp)
    model.lm_head = ColumnParallelLinear(C, V, tp, bias=False)
    model.lm_head.weight = model.transformer.wte.weight  # still tied: both hold vocab rows of rank r
    model.transformer.drop = torch.nn.Sequential(SplitSeq(tp), model.transformer.drop)
    if sp:  # LayerNorms now see only their slice of the sequence: their gradients are partial sums
        for name, p in model.named_parameters():
            if ".ln_" in name or "ln_f" in name:
                p.sequence_parallel = True
    vocab_start = grid.tp_rank * (V // grid.tp)
    model.loss_fn = lambda logits, targets: VocabParallelCrossEntropy.apply(logits, targets, tp, vocab_start)
    model.gather_logits = lambda logits: gather_last_dim(logits, grid)
    plain_generate = model.generate

    def generate(*args, **kwargs):  # one token at a time cannot be split along the sequence
        tp.sp = False
        try:
            return plain_generate(*args, **kwargs)
        finally:
            tp.sp = sp
    model.generate = generate
    return tp


def gather_last_dim(x: torch.Tensor, grid: Grid) -> torch.Tensor:
    """(B, V/tp) vocab shards -> (B, V) on every rank, for sampling."""
    out = x.new_empty((grid.tp * x.size(0), *x.shape[1:]))  # (tp * B, V/tp): ranks stacked on dim 0
    grid.all_gather(out, x.contiguous(), "tp")
    return torch.cat(out.chunk(grid.tp), dim=-1)


# ----------------------------------------------------------------------------- pipeline parallel
#
# The layers are cut into p stages; a batch is cut into m micro-batches that flow through them.
# A schedule is just the order in which one stage runs forwards (F) and backwards (B):
#
#   gpipe (Huang et al. 2019): all m forwards, then all m backwards. Every stage holds the
#       activations of all m micro-batches at once.
#   1f1b (Narayanan et al. 2021, PipeDream-Flush): p - rank - 1 warm-up forwards, then one
#       forward / one backward in turn, then the remaining backwards. Same bubble, at most
#       p - rank micro-batches of activations alive.
#
# Either way each stage idles for (p - 1) of (m + p - 1) time slots: the bubble.


def gpipe(p: int, rank: int, m: int) -> list[tuple[str, int]]:
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def one_f_one_b(p: int, rank: int, m: int) -> list[tuple[str, int]]:
    warmup = min(p - rank - 1, m)
    ops = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: forward i + warmup, backward i
        ops += [("F", warmup + i), ("B", i)]
    return ops + [("B", i) for i in range(m - warmup, m)]


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def simulate(stage_ops: list[list[tuple[str, int]]]) -> list[list[tuple[int, str, int]]]:
    """Place each stage's ops on a clock where F and B take one slot, F(i) waits for F(i) on the
    stage before and B(i) for B(i) on the stage after. Returns (start, kind, micro) per stage."""
    p, done, free, pos = len(stage_ops), {}, [0] * len(stage_ops), [0] * len(stage_ops)
    timeline = [[] for _ in range(p)]
    moved = True
    while moved:
        moved = False
        for s in range(p):
            while pos[s] < len(stage_ops[s]):
                kind, i = stage_ops[s][pos[s]]
                # F(i) needs the previous stage's F(i); B(i) needs the next stage's B(i)
                dep = (s - 1, "F", i) if kind == "F" else (s + 1, "B", i)
                dep = dep if 0 <= dep[0] < p else None
                if dep is not None and dep not in done:
                    break
                start = max(free[s], done.get(dep, 0))
                done[(s, kind, i)] = free[s] = start + 1
                timeline[s].append((start, kind, i))
                pos[s], moved = pos[s] + 1, True
    if any(pos[s] < len(stage_ops[s]) for s in range(p)):
        raise LayoutError("this pipeline schedule deadlocks")
    return timeline


def bubble_fraction(stage_ops: list[list[tuple[str, int]]]) -> float:
    """Idle slots / all slots, for the ops the stages actually ran."""
    timeline = simulate(stage_ops)
    span = max(start + 1 for ops in timeline for start, _, _ in ops)
    busy = sum(len(ops) for ops in timeline)
    return 1 - busy / (span * len(timeline))


def draw_schedule(stage_ops: list[list[tuple[str, int]]]) -> str:
    """The pipeline as text: one row per stage, one column per time slot, '.' where it idles."""
    timeline = simulate(stage_ops)
    span = max(start + 1 for ops in timeline for start, _, _ in ops)
    rows = []
    for s, ops in enumerate(timeline):
        cells = ["  ."] * span
        for start, kind, i in ops:
            cells[start] = f"{kind}{i:>2}"
        rows.append(f"stage {s} |" + " ".join(cells))
    m = sum(1 for kind, _ in stage_ops[0] if kind == "F")
    p = len(stage_ops)
    rows.append(f"bubble {bubble_fraction(stage_ops):.3f} (formula (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.3f})")
    return "\n".join(rows)


class Pipeline:
    """Runs this stage's op list. Before an op it receives what the op needs (an activation from
    the previous stage for F, a gradient from the next stage for B); the sends of the op before
    are posted in the same batch, so a send and its matching receive are always in flight
    together and neither side can wait on the other forever. Shapes are fixed by the
    configuration, so no message announces a shape."""

    def __init__(self, model: gpt.GPT, grid: Grid, schedule: str):
        self.model, self.grid, self.schedule = model, grid, SCHEDULES[schedule]
        self.first, self.last = grid.pp_rank == 0, grid.pp_rank == grid.pp - 1
        self.prev = grid.rank_of(grid.pp_rank - 1, grid.dp_rank, grid.tp_rank) if not self.first else None
        self.next = grid.rank_of(grid.pp_rank + 1, grid.dp_rank, grid.tp_rank) if not self.last else None
        self.dtype = next(model.parameters()).dtype
        self.ops_run, self.peak_live = [], 0

    def act_shape(self, micro: torch.Tensor, sp: bool) -> tuple[int, int, int]:
        T = micro.size(1) - 1
        return micro.size(0), T // self.grid.tp if sp else T, self.model.config.n_embd

    def run(self, micro: list[torch.Tensor], autocast, sp: bool = False, train: bool = True,
            scale: float = 1.0, before_last_backward=lambda: None) -> torch.Tensor:
        """Forward (and backward) of every micro-batch (rows of T+1 tokens); returns the mean loss
        on the last stage, 0 elsewhere."""
        m, model = len(micro), self.model
        ops = self.schedule(self.grid.pp, self.grid.pp_rank, m) if train else [("F", i) for i in range(m)]
        shape = self.act_shape(micro[0], sp)
        stash, sends, total = {}, [], torch.zeros((), device=self.grid.device)
        self.ops_run, self.peak_live = [], 0
        for kind, i in ops:
            buf = None
            if (kind == "F" and not self.first) or (kind == "B" and not self.last):
                buf = torch.empty(shape, dtype=self.dtype, device=self.grid.device)
            recvs = [(buf, self.prev if kind == "F" else self.next)] if buf is not None else []
            self.grid.send_recv(sends, recvs)
            sends = []
            if kind == "F":
                with torch.set_grad_enabled(train), autocast:
                    x = model.embed(micro[i][:, :-1]) if self.first else buf.requires_grad_(train)
                    y = model.blocks(x)
                    if self.last:
                        y = model.loss_fn(model.head(y), micro[i][:, 1:]) / m
                        total += y.detach()
                if train:
                    stash[i] = (x, y)
                    self.peak_live = max(self.peak_live, len(stash))
                if not self.last:
                    sends.append((y.detach(), self.next))
            else:
                x, y = stash.pop(i)
                if i == m - 1:
                    before_last_backward()
                if self.last:
                    (y * scale).backward()
                else:
                    y.backward(buf)
                if not self.first:
                    sends.append((x.grad, self.prev))
            self.ops_run.append((kind, i))
        self.grid.send_recv(sends, [])
        return total

    def all_stage_ops(self) -> list[list[tuple[str, int]]]:
        """Every stage's executed op sequence, gathered over the pipeline group."""
        codes = torch.tensor([(0 if k == "F" else 1) * 1_000_000 + i for k, i in self.ops_run],
                             dtype=torch.long, device=self.grid.device)
        out = codes.new_empty((self.grid.pp, codes.numel()))
        self.grid.all_gather(out.view(-1), codes, "pp")
        return [[("F" if c < 1_000_000 else "B", c % 1_000_000) for c in row.tolist()] for row in out]


@torch.no_grad()
def generate(model: gpt.GPT, grid: Grid, idx: torch.Tensor, max_new_tokens: int, **kw) -> torch.Tensor:
    """model.generate on any layout. With pipeline stages, every stage runs the same sampling loop
    in lockstep; only the seams change: the first stage embeds, each stage receives its input from
    the previous one and sends its output on, and the last stage's logits for the newest position
    are summed over the pipeline group so every stage draws the same token."""
    if grid.pp == 1:
        return model.generate(idx, max_new_tokens, **kw)
    first, last = grid.pp_rank == 0, grid.pp_rank == grid.pp - 1
    prev = grid.rank_of(grid.pp_rank - 1, grid.dp_rank, grid.tp_rank)
    nxt = grid.rank_of(grid.pp_rank + 1, grid.dp_rank, grid.tp_rank)
    C, V = model.config.n_embd, model.config.padded_vocab // grid.tp
    dtype = next(model.parameters()).dtype
    plain_embed, plain_blocks, plain_head = model.embed, model.blocks, model.head

    def embed(tokens, start=0):
        if first:
            return plain_embed(tokens, start)
        return torch.zeros(*tokens.shape, C, dtype=dtype, device=tokens.device)  # arrives in blocks()

    def blocks(x, caches=None):
        if not first:
            x = torch.empty_like(x)
            grid.send_recv([], [(x, prev)])
        y = plain_blocks(x, caches)
        if not last:
            grid.send_recv([(y, nxt)], [])
        return y

    def head(x):
        logits = plain_head(x[:, -1:]).float() if last else torch.zeros(x.size(0), 1, V, device=x.device)
        grid.all_reduce(logits, "pp")  # (B, 1, V/tp) on every stage
        return logits

    model.embed, model.blocks, model.head = embed, blocks, head
    try:
        return model.generate(idx, max_new_tokens, **kw)
    finally:
        del model.embed, model.blocks, model.head  # back to the class's methods


# ----------------------------------------------------------------------------- building a rank's model


def check_layout(cfg: gpt.GPTConfig, grid: Grid, seq_len: int, sp: bool) -> None:
    if cfg.n_head % grid.tp:
        raise LayoutError(f"--tp {grid.tp} does not divide the model's {cfg.n_head} attention heads")
    if cfg.padded_vocab % grid.tp:
        raise LayoutError(f"--tp {grid.tp} does not divide the padded vocabulary {cfg.padded_vocab}")
    if cfg.n_layer < grid.pp:
        raise LayoutError(f"--pp {grid.pp} stages but the model has only {cfg.n_layer} layers")
    if sp and grid.tp == 1:
        raise LayoutError("--sp (sequence parallelism) needs --tp 2 or more")
    if sp and seq_len % grid.tp:
        raise LayoutError(f"--sp needs --seq-len ({seq_len}) divisible by --tp {grid.tp}")


def stage_layers(n_layer: int, pp: int, stage: int) -> range:
    """Blocks of a pipeline stage: as even as possible, the remainder to the later stages
    (the first stage also runs the embedding, the last the loss)."""
    bounds = [n_layer * s // pp for s in range(pp + 1)]
    return range(bounds[stage], bounds[stage + 1])


def keep_stage(model: gpt.GPT, grid: Grid) -> None:
    """Drop what this pipeline stage does not run. Blocks keep their global names (h.5 stays h.5),
    so checkpoints from any layout line up."""
    h = model.transformer.h
    model.transformer.h = torch.nn.ModuleDict({str(i): h[i] for i in stage_layers(len(h), grid.pp, grid.pp_rank)})
    first, last = grid.pp_rank == 0, grid.pp_rank == grid.pp - 1
    if first and not last:
        model.transformer.wte.weight.tied_embedding = True  # its twin is the last stage's lm_head
    if not first:
        del model.transformer["wte"], model.transformer["wpe"]
    if not last:
        del model.transformer["ln_f"]
        model.lm_head = None
    elif not first:  # the last stage keeps its own copy of the tied embedding, synced by grad all-reduce
        w = model.lm_head.weight
        model.lm_head.weight = meta_param(*w.shape, spec=w.shard if hasattr(w, "shard") else None,
                                          tied_copy=True)


def build_model(cfg: gpt.GPTConfig, grid: Grid, seed: int, device: torch.device, seq_len: int,
                sp: bool = False) -> torch.nn.Module:
    """This rank's part of the model: the full GPT built on meta (no memory), transformed by tensor
    and pipeline parallelism, then each remaining parameter materialized as this rank's slice of
    its layout-independent initial value."""
    check_layout(cfg, grid, seq_len, sp)
    with torch.device("meta"):
        model = gpt.GPT(cfg)
    if grid.tp > 1:
        apply_tensor_parallel(model, grid, sp)
    if grid.pp > 1:
        keep_stage(model, grid)
    specs = {name: getattr(p, "shard", None) for name, p in model.named_parameters(remove_duplicate=False)}
    return gpt.materialize(model, seed, device, shard_fn=lambda name, full: take_shard(full, specs[name]))


def take_shard(full: torch.Tensor, spec: dict | None) -> torch.Tensor:
    """The part of a full tensor that `spec` names (see shard_spec)."""
    if spec is None:
        return full
    blocks = full.chunk(spec["groups"], dim=spec["dim"])
    return torch.cat([b.chunk(spec["count"], dim=spec["dim"])[spec["index"]] for b in blocks], dim=spec["dim"])


def unshard(pieces: list[torch.Tensor], spec: dict) -> torch.Tensor:
    """The full tensor from every rank's take_shard(full, spec), in rank order."""
    chunks = [piece.chunk(spec["groups"], dim=spec["dim"]) for piece in pieces]  # chunks[rank][group]
    return torch.cat([chunks[r][g] for g in range(spec["groups"]) for r in range(len(pieces))], dim=spec["dim"])


def finish_grads(model: torch.nn.Module, grid: Grid, sync: GradSync | None) -> None:
    """Everything between the last backward and the optimizer: data-parallel averaging, the
    LayerNorm/bias gradients sequence parallelism left partial, and the tied embedding's two
    copies on the first and last pipeline stage (each gets the sum of both gradients)."""
    if sync is not None:
        sync.finish()
    partial = [p.grad for p in model.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if partial and grid.tp > 1:
        flat = torch.cat([g.flatten() for g in partial])
        grid.all_reduce(flat, "tp")
        torch._foreach_copy_(partial, [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in partial]), partial)])
    if grid.pp > 1 and grid.pp_rank in (0, grid.pp - 1):
        tied = model.transformer.wte.weight if grid.pp_rank == 0 else model.lm_head.weight
        grid.all_reduce(tied.grad, "embed")


def counted(p: torch.nn.Parameter, grid: Grid) -> bool:
    """Does this rank's copy of p count toward the global gradient norm? A tensor replicated across
    tensor-parallel ranks counts once (on tp rank 0), the pipeline's copy of the tied embedding
    not at all: the classic double-count bugs of clipping under model parallelism."""
    if getattr(p, "tied_copy", False):
        return False
    return getattr(p, "shard", None) is not None or grid.tp_rank == 0


def grad_norm(model: torch.nn.Module, grid: Grid, sync: GradSync | None = None) -> torch.Tensor:
    """The L2 norm of the whole model's gradient (fp32), identical on every rank."""
    sq = torch.zeros((), device=grid.device)
    if sync is not None and sync.zero:  # each data-parallel rank holds one shard of each bucket
        for b in sync.buckets:
            lo, hi = grid.dp_rank * b.shard_size, (grid.dp_rank + 1) * b.shard_size
            for p, off in zip(b.params, b.offsets):
                a, z = max(lo, off), min(hi, off + p.numel())  # p's part of this rank's shard
                if a < z and counted(p, grid):
                    sq += b.main_grad[a:z].pow(2).sum()
    else:
        for p in model.parameters():
            if p.grad is not None and counted(p, grid):
                sq += p.grad.float().pow(2).sum()
    for group in ("tp", "pp") + (("dp",) if sync is not None and sync.zero else ()):
        grid.all_reduce(sq, group)
    return sq.sqrt()


# ----------------------------------------------------------------------------- measured against the papers


def expected_traffic(cfg: gpt.GPTConfig, grid: Grid, micro_batch: int, n_micro: int, seq_len: int,
                     sp: bool, sync: GradSync | None, model: torch.nn.Module) -> dict:
    """Bytes this rank's collectives should move in one fp32 training step, by (op, group), from
    the formulas: Megatron's 2 all-reduces forward + 2 backward per layer of B*T*C activations
    (all-gather + reduce-scatter of the same volume under --sp), one activation send per
    micro-batch each way between pipeline stages, and the data-parallel gradient volume."""
    e = defaultdict(int)
    first, last = grid.pp_rank == 0, grid.pp_rank == grid.pp - 1
    layers = len(stage_layers(cfg.n_layer, grid.pp, grid.pp_rank))
    btc, bt = micro_batch * seq_len * cfg.n_embd * 4, micro_batch * seq_len * 4
    if grid.tp > 1:
        per_micro = defaultdict(int)
        if sp:
            per_micro[("all_gather", "tp")] += 4 * layers * btc + (btc if first else 0) + (btc if last else 0)
            per_micro[("reduce_scatter", "tp")] += 4 * layers * btc + (btc if last else 0)
        else:
            per_micro[("all_reduce", "tp")] += 4 * layers * btc + (btc if last else 0)
        per_micro[("all_reduce", "tp")] += (btc if first else 0) + (3 * bt if last else 0)
        for k, v in per_micro.items():
            e[k] += n_micro * v
        if sp:  # LayerNorm and row-parallel bias gradients, once per step
            e[("all_reduce", "tp")] += 4 * sum(p.numel() for p in model.parameters()
                                               if getattr(p, "sequence_parallel", False))
    if grid.pp > 1:
        act = btc // grid.tp if sp else btc
        e[("send", "pp")] += n_micro * act * ((not last) + (not first))
        if first or last:
            e[("all_reduce", "embed")] += cfg.padded_vocab // grid.tp * cfg.n_embd * 4
    if sync is not None and grid.dp > 1:
        if sync.zero:
            padded = sum(b.main_grad.numel() for b in sync.buckets)
            e[("reduce_scatter", "dp")] += 4 * padded
            e[("all_gather", "dp")] += padded * next(model.parameters()).element_size()
        else:
            e[("all_reduce", "dp")] += 4 * sum(b.numel for b in sync.buckets)
    for group in ("tp", "pp") + (("dp",) if sync is not None and sync.zero else ()):
        if grid.size(group) > 1:
            e[("all_reduce", group)] += 4  # the squared gradient norm
    for group in ("pp", "dp"):
        if grid.size(group) > 1:
            e[("all_reduce", group)] += 4  # the loss, for logging and the guards
    return dict(e)


def comm_report(grid: Grid, expected: dict) -> str:
    """Measured bytes per (collective, group) next to the formula, and what a ring algorithm puts
    on each rank's link: 2(n-1)/n of the buffer for an all-reduce, (n-1)/n for the others."""
    lines = [f"communication of one training step on rank {grid.rank} (dp {grid.dp_rank}, tp {grid.tp_rank}, "
             f"pp {grid.pp_rank}):",
             f"  {'collective':<15}{'group':<7}{'calls':>6}{'measured bytes':>16}{'formula':>14}  "
             f"{'match':<6}{'ring bytes/rank':>16}"]
    for key in sorted(set(grid.traffic.counts) | set(expected)):
        op, group = key
        calls, measured = grid.traffic.counts.get(key, [0, 0])
        n = grid.size(group)
        ring = measured * (2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n if op != "send" else 1)
        lines.append(f"  {op:<15}{group:<7}{calls:>6}{measured:>16,}{expected.get(key, 0):>14,}  "
                     f"{'yes' if measured == expected.get(key, 0) else 'NO':<6}{ring:>16,.0f}")
    return "\n".join(lines)


def overlap_report(sync: GradSync) -> str:
    """When each bucket's collective started relative to the end of the backward pass."""
    events = sync.last_events
    done = next(t for what, _, t in events if what == "backward done")
    launches = [(i, t) for what, i, t in events if what == "launch"]
    early = sum(1 for _, t in launches if t < done)
    lines = [f"gradient buckets: {len(sync.buckets)}; launched before the backward finished: {early}"]
    for i, t in launches:
        lines.append(f"  bucket {i}: launched {1e3 * (t - done):+8.2f} ms from the end of the backward")
    reduced = next(t for what, _, t in events if what == "reduced")
    lines.append(f"  waiting for communication after the backward: {1e3 * (reduced - done):.2f} ms")
    return "\n".join(lines)


def zero_memory_report(opt, model: torch.nn.Module, grid: Grid) -> str:
    """Optimizer state on this rank against the ZeRO paper's K = 12 bytes per parameter / dp."""
    n = sum(p.numel() for p in model.parameters())
    measured = opt.state_bytes() if isinstance(opt, ZeroAdamW) else 8 * n  # torch AdamW: two fp32 moments
    formula = (12 if isinstance(opt, ZeroAdamW) else 8) * n / (grid.dp if isinstance(opt, ZeroAdamW) else 1)
    return (f"optimizer state on rank {grid.rank}: {measured:,} bytes for {n:,} local parameters; "
            f"formula {'12 N / dp' if isinstance(opt, ZeroAdamW) else '8 N'} = {formula:,.0f} "
            f"(padding {measured - formula:,.0f} bytes)")


# ----------------------------------------------------------------------------- planning a run on paper


def state_bytes(n_params: float, dp: int, zero: int = 1, grad_bytes: int = 4) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes of one model replica's parameters on one data-parallel
    rank. Weights are bf16 (2 bytes); the optimizer keeps K = 12 bytes per parameter (fp32 master
    copy, Adam's two moments). ZeRO stage 1 shards the optimizer over dp, stage 2 the gradients too,
    stage 3 the weights too (Rajbhandari et al. 2020, "ZeRO", section 5 and figure 1).
    grad_bytes=4 (fp32 gradients, zero=1) is Megatron-LM's distributed optimizer and what
    `ZeroAdamW` does under --precision bf16: 6 + 12/dp bytes per parameter. grad_bytes=2 is the
    ZeRO paper's 2Ψ + 2Ψ + KΨ/Nd."""
    return (2 * n_params / (dp if zero >= 3 else 1), grad_bytes * n_params / (dp if zero >= 2 else 1),
            12 * n_params / (dp if zero >= 1 else 1))


def plan(n_layer: int, n_head: int, d_model: int, vocab: int, seq_len: int, batch: int, n_gpus: int,
         tp: int = 1, pp: int = 1, micro_batch: int = 1, zero: int = 1, tokens: float = 0.0,
         mfu: float = 0.40, peak_flops: float = 989e12, grad_bytes: int = 4,
         nvlink_bw: float = 450e9, net_bw: float = 50e9) -> dict:
    """One training run of a dense GPT-2-shaped model, on paper: what each GPU holds, what it sends
    per optimizer step, and how long `tokens` take at an assumed model-FLOPs utilization `mfu`.
    `batch` is the global batch in sequences (train.py's --batch-size); dp = n_gpus / (tp pp).
    The defaults describe H100 SXM: 989 TFLOP/s dense bf16, ~450 GB/s NVLink, a 400 Gb/s NIC per GPU.

    parameters  12 L d^2 + 13 L d + (V + s) d + 2 d: model.py exactly (Narayanan et al. 2021, sec. 5.1
                without the final LayerNorm); FLOPs use the 12 L d^2 + V d in matmuls:
                6 N + 12 L H Q T per token (PaLM, appendix B; model.flops_per_token)
    memory      state_bytes() on the N / (tp pp) parameters this GPU holds, plus activations with
                sequence parallelism and selective recomputation (flash attention keeps no s x s
                scores): 34 s b d / tp bytes per layer and micro-batch (Korthikanti et al. 2022,
                table 2); under 1F1B the first stage keeps min(pp, m) micro-batches of L/pp layers.
    traffic     bytes one GPU sends per step with ring collectives (2(n-1)/n of an all-reduced buffer):
                tp  4 all-reduces (or all-gather + reduce-scatter pairs) of one bf16 s b d activation
                    per layer per micro-batch (Shoeybi et al. 2019, sec. 3), over NVLink;
                pp  one activation forward, one gradient backward per micro-batch, s b d / tp each;
                dp  ZeRO: reduce-scatter the gradients, all-gather bf16 weights (twice for stage 3);
                    without it, all-reduce the gradients. Once per step: a ZeRO-2 that reduces after
                    every micro-batch moves m times the gradient bytes.
    time        flops / (n_gpus peak mfu). MFU is an assumption, measured elsewhere: it already pays
                for the bubble and any communication that is not hidden."""
    dp = n_gpus // (tp * pp)
    if dp * tp * pp != n_gpus or n_head % tp or n_layer < pp or batch % (dp * micro_batch):
        raise LayoutError(f"{n_gpus} GPUs as tp {tp} x pp {pp} x dp, {n_head} heads, {n_layer} layers, "
                          f"batch {batch} in micro-batches of {micro_batch}: not a possible layout")
    L, d, s, b, V = n_layer, d_model, seq_len, micro_batch, -(-vocab // 128) * 128
    n_params = 12 * L * d * d + 13 * L * d + (V + s) * d + 2 * d
    flops_per_token = 6 * (12 * L * d * d + V * d) + 12 * L * d * s
    local = n_params / (tp * pp)  # the first and last stage also hold V d / tp of embedding: ignored
    weights, grads, optimizer = state_bytes(local, dp, zero, grad_bytes)
    m, layers = batch // (dp * b), -(-L // pp)  # micro-batches per pipeline and step; layers per stage
    activations = 34 * s * b * d / tp * layers * min(pp, m)
    act = 2 * s * b * d  # one bf16 activation, bytes

    def ring(n):  # the fraction of a buffer each rank sends in a ring reduce-scatter or all-gather
        return (n - 1) / n

    gathers = 2 if zero >= 3 else 1  # stage 3 all-gathers the weights again for the backward
    comm = {"tp": 4 * layers * m * act * 2 * ring(tp),  # an all-reduce = reduce-scatter + all-gather
            "pp": 2 * m * act / tp if pp > 1 else 0.0,
            "dp": (local * (grad_bytes + 2 * gathers) if zero else 2 * local * grad_bytes) * ring(dp)}
    step_s = flops_per_token * batch * s / (n_gpus * peak_flops * mfu)
    seconds = tokens / (batch * s) * step_s
    return {"params": n_params, "flops_per_token": flops_per_token, "dp": dp, "tp": tp, "pp": pp,
            "micro_batches": m, "bubble": (pp - 1) / (m + pp - 1),
            "memory": {"weights": weights, "grads": grads, "optimizer": optimizer, "activations": activations,
                       "total": weights + grads + optimizer + activations},
            "comm": comm, "comm_s": {"tp": comm["tp"] / nvlink_bw, "pp": comm["pp"] / net_bw,
                                     "dp": comm["dp"] / net_bw},
            "mfu": mfu, "step_s": step_s, "tokens_per_s": batch * s / step_s, "n_gpus": n_gpus,
            "tokens": tokens, "days": seconds / 86400, "gpu_hours": seconds * n_gpus / 3600}


def format_plan(p: dict) -> str:
    """plan()'s numbers as a few lines of text (GB = 1e9 bytes)."""
    mem, comm, t = p["memory"], p["comm"], p["comm_s"]
    lines = [f"model   {p['params'] / 1e9:.2f}B parameters, {p['flops_per_token']:.3g} FLOPs per token",
             f"layout  {p['n_gpus']} GPUs = dp {p['dp']} x tp {p['tp']} x pp {p['pp']}; "
             f"{p['micro_batches']} micro-batches per step, bubble {p['bubble']:.1%}",
             "memory  " + "  ".join(f"{k} {v / 1e9:.1f}" for k, v in mem.items()) + " GB per GPU",
             "traffic " + "  ".join(f"{k} {comm[k] / 1e9:.2f} GB ({t[k]:.2f} s)" for k in comm)
             + " per GPU and step",
             f"time    {p['step_s']:.2f} s per step at {p['mfu']:.0%} MFU: "
             f"{p['tokens_per_s'] / 1e6:.2f}M tokens/s, {p['tokens_per_s'] / p['n_gpus']:,.0f} per GPU"]
    if p["tokens"]:
        lines.append(f"budget  {p['tokens'] / 1e12:g}T tokens: {p['days']:.2f} days, "
                     f"{p['gpu_hours']:,.0f} GPU-hours")
    return "\n".join(lines)
