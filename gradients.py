"""Gradients across data-parallel ranks: averaging them (what DDP does), reducing each into the one
rank that owns it (ZeRO-1 and -2), and the global gradient norm that clipping needs, all from raw
collectives. zero.py holds what ZeRO does with the result (the sharded optimizer, and stage 3's
sharded parameters).

    backward ─▶ per-parameter hooks add each gradient into its bucket's flat fp32 buffer
             ─▶ a full bucket launches its all-reduce (ZeRO: reduce-scatter) at once, overlapped
                with the rest of the backward
    finish_grads ─▶ wait, average; sum what tensor / pipeline parallelism left partial
    grad_norm ─▶ each element counted once, whatever the layout (`Grid.owns`)

Where a gradient lives between the backward and the optimizer, by ZeRO stage (Rajbhandari et al.
2020, section 5):

    --zero 0  the whole flat buffer, all-reduced once per step          4 bytes/param
    --zero 1  the whole flat buffer, reduce-scattered once per step;    4 bytes/param
              the optimizer reads only this rank's shard of it
    --zero 2  only the shard: every backward reduce-scatters each       4 bytes/param / dp
    --zero 3  bucket as it completes and drops the whole buffer          (+ a few buckets in flight)

Stage 2 pays for its memory with traffic under gradient accumulation: a bucket cannot wait for the
last micro-batch without being held whole, so each micro-batch's backward reduce-scatters it.

"Data-parallel" here means every rank that holds the same weights: with context parallelism (context.py)
the cp ranks of a data-parallel rank hold replicas too, each with the gradient of its slice of the
tokens, so the buckets are averaged (and ZeRO shards them) over the `dp_cp` group of dp x cp ranks.

Expert parallelism (moe.py): the weights of experts (their placement's replicas: "edp") are not replicas
over the data-parallel ranks, only over the dp / ep that hold the same experts. They get buckets of their
own, summed over that `edp` group (under ZeRO, reduce-scattered and sharded over it), and divided by dp
like every other bucket: each rank's expert gradient already holds the losses of its whole ep group
(their tokens came to it), so the sum over edp covers every rank's loss once.

Hybrid ZeRO (`--zero-shard N`, zero.py): buckets are sharded over the N ranks of the `zs` group
instead, and once reduced there, each shard is all-reduced over the `zr` group (the same shard in
every other group), then divided by dp as always. That all-reduce is the traffic between nodes, the
slow links, so it is not left for after the backward: a bucket's is launched as soon as its (last)
reduce-scatter has landed, IN_FLIGHT buckets behind the newest, and overlaps the rest of the
backward as they do:

    backward   bucket 0 done   bucket 1 done   bucket 2 done: wait for rs 0   ...   finish: wait
    zs (node)  rs 0 ────────   rs 1 ────────   rs 2 ──────
    zr (net)                                   ar 0 ────────────   ar 1 ───   ...

ZeRO++'s qgZ replaces the reduce-scatter (`scatter`, zero.QuantizedReduceScatter).

Which rank's copy of a replicated tensor counts is one rule, `Grid.owns`, shared with the
checkpoints (which save exactly the copies that count).
"""

from collections import deque

import torch

from parallel import Grid, placement
from support.interrupt import peer_call

IN_FLIGHT = 2  # ZeRO-2/3, hybrid ZeRO-1: reduce-scatters still in flight before the backward waits


class Bucket:
    """A run of parameters whose fp32 gradients live side by side in one flat `main_grad` buffer, so
    they are averaged with one collective instead of one per tensor. Under ZeRO the buffer is padded
    to dp equal shards and `shard_grad` is this rank's averaged shard (a view of `main_grad` for
    stage 1; its own buffer for stages 2 and 3, where `main_grad` exists only during a backward)."""

    def __init__(self, params: list[torch.nn.Parameter], pad_to: int, device: torch.device, persistent: bool,
                 group: str = "dp_cp", rank: int = 0, block: int = 1):
        # group: the ranks that sum it (and ZeRO shards it over); rank: this rank's place among them;
        # block: a shard is whole blocks of this many elements (ZeRO++'s quantization, zero.py)
        self.params, self.offsets, n, self.group, self.rank = params, [], 0, group, rank
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.numel, self.device = n, device
        self.padded = -(-n // (pad_to * block)) * pad_to * block  # ZeRO splits the buffer into dp equal shards
        self.shard_size = self.padded // pad_to
        self.main_grad = torch.zeros(self.padded, dtype=torch.float32, device=device) if persistent else None
        self.shard_grad = None
        # ZeRO-1: the reduce-scatter's output, copied into shard_grad once it arrives (shard_grad is a
        # view of main_grad, which the collective is still reading)
        self.received = None
        self.ready, self.work, self.launched = 0, None, False

    def views(self, flat: torch.Tensor):
        """(param, its slice of `flat` shaped like it)"""
        for p, off in zip(self.params, self.offsets):
            yield p, flat[off:off + p.numel()].view(p.shape)

    def parts(self, lo: int, hi: int):
        """(param, its offset, a, z) for each parameter overlapping elements [lo, hi) of the flat
        buffer; [a, z) is the overlap, in buffer coordinates (ZeRO's shard of a bucket cuts
        parameters anywhere)."""
        for p, off in zip(self.params, self.offsets):
            a, z = max(lo, off), min(hi, off + p.numel())
            if a < z:
                yield p, off, a, z

    def shard_range(self, dp_rank: int) -> tuple[int, int]:
        """The elements of the (padded) buffer that data-parallel rank `dp_rank` owns under ZeRO."""
        return dp_rank * self.shard_size, (dp_rank + 1) * self.shard_size


class GradSync:
    """Data-parallel gradient averaging (what DDP does), from raw collectives.

    Each parameter's gradient is added into its bucket's fp32 `main_grad` by a hook that fires
    the moment autograd finishes accumulating it. When the last gradient of a bucket arrives, the
    bucket's all-reduce (or, under ZeRO, reduce-scatter) is launched asynchronously, so the
    communication of late layers overlaps the backward of early ones. Buckets follow the
    parameters in reverse order, the order backward produces their gradients; ZeRO-3 passes its
    own `units` (one bucket per unit of parameters it gathers together).

    Gradient accumulation: micro-steps before the last only accumulate; the collectives run once,
    on the last micro-step's backward. Whoever runs the micro-batches says which backward that is,
    with one assignment (DDP's name for the flag): `require_backward_grad_sync = is_last_micro`.
    ZeRO-2 and -3 ignore the flag: they reduce every backward (see the module docstring).
    """

    def __init__(self, model: torch.nn.Module, grid: Grid, bucket_mb: float = 25, overlap: bool = True,
                 zero: int = 0, units: list[list[torch.nn.Parameter]] | None = None, scatter=None, block: int = 1):
        self.grid, self.overlap, self.zero, self.require_backward_grad_sync = grid, overlap, zero, True
        self.scatter = scatter  # ZeRO++'s qgZ (zero.QuantizedReduceScatter): whole buffer -> this rank's shard
        groups = units[::-1] if units is not None else self._by_size(model, bucket_mb)
        self.buckets = []
        for params in groups:
            group = placement(params[0]).replicas  # dp_cp, or edp (experts)
            group = "zs" if group == "dp_cp" and grid.zs < grid.dp_cp else group
            rank = {"edp": grid.edp_rank, "zs": grid.zs_rank, "dp_cp": grid.dp_cp_rank}[group]
            self.buckets.append(Bucket(params, grid.size(group) if zero else 1, grid.device, persistent=zero < 2,
                                       group=group, rank=rank, block=block if zero else 1))
        self.slot = {}
        for b in self.buckets:
            lo, hi = b.shard_range(b.rank)
            if zero == 1:
                b.shard_grad = b.main_grad[lo:hi]
            elif zero >= 2:
                b.shard_grad = torch.zeros(b.shard_size, dtype=torch.float32, device=grid.device)
            for p, off in zip(b.params, b.offsets):
                self.slot[p] = (b, off)
                p.register_post_accumulate_grad_hook(self._on_grad)
        # ZeRO-2/3 (and hybrid ZeRO-1), in flight: (bucket, received shard, work, the whole buffer
        # it reads, kept alive till done, is it the step's last reduction of the bucket)
        self.pending = deque()
        self.on_reduced = None  # ZeRO-3: called with a bucket whose gradients are all in (frees its weights)

    @staticmethod
    def _by_size(model: torch.nn.Module, bucket_mb: float) -> list[list[torch.nn.Parameter]]:
        params = [p for p in model.parameters() if p.requires_grad][::-1]
        # The pipeline's two copies of the tied embedding get a bucket each, alone, so that under
        # ZeRO both copies are cut at the same element offsets and their shards can be summed.
        tied = [p for p in params if placement(p).tied]
        rest = [p for p in params if not any(p is t for t in tied)]
        experts = [p for p in rest if placement(p).replicas == "edp"]  # summed over edp: apart
        others = [p for p in rest if placement(p).replicas != "edp"]
        return [[p] for p in tied] + GradSync._fill(others, bucket_mb) \
            + GradSync._fill(experts, bucket_mb)

    @staticmethod
    def _fill(params: list[torch.nn.Parameter], bucket_mb: float) -> list[list[torch.nn.Parameter]]:
        """params in order, cut into buckets of at least bucket_mb (the last one smaller)."""
        buckets, current, size = [], [], 0
        for p in params:
            current.append(p)
            size += p.numel() * 4
            if size >= bucket_mb * 2**20:
                buckets.append(current)
                current, size = [], 0
        return buckets + ([current] if current else [])

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        b, off = self.slot[p]
        if b.main_grad is None:  # ZeRO-2/3: a whole-bucket buffer for this backward only
            b.main_grad = torch.zeros(b.padded, dtype=torch.float32, device=b.device)
        b.main_grad[off:off + p.numel()].add_(p.grad.flatten())
        p.grad = None  # the gradient now lives in main_grad
        if self.require_backward_grad_sync or self.zero >= 2:
            b.ready += 1
            if b.ready == len(b.params) and (self.overlap or self.zero >= 2):
                self._launch(b)

    def _launch(self, b: Bucket) -> None:
        self.grid.observer.gradient_event("launch", self.buckets.index(b))
        # ZeRO-2/3 reduce only some backwards' gradients for good (the flag); ZeRO-1 only the last's
        last = self.require_backward_grad_sync or self.zero < 2
        if self.zero >= 2 or b.group == "zs":  # (hybrid ZeRO-1: the shard goes on to the replicas)
            self.pending.append((b, *self._reduce_scatter(b), b.main_grad, last))
            if self.zero >= 2:  # the whole buffer is let go once the reduce-scatter is done
                b.main_grad, b.ready = None, 0
                if self.on_reduced is not None:
                    self.on_reduced(b)
            b.launched = True
            while len(self.pending) > (IN_FLIGHT if self.overlap else 0):
                self._receive()
            return
        if self.zero:  # each rank receives the sum of only its shard
            b.received, b.work = self._reduce_scatter(b)
        else:
            b.work = self.grid.all_reduce(b.main_grad, b.group, async_op=True)
        b.launched = True

    def _reduce_scatter(self, b: Bucket) -> tuple[torch.Tensor, object]:
        """(this rank's shard of the bucket's sum over its group, a fresh buffer; work or None)"""
        if self.scatter is not None:
            return self.scatter(b.main_grad), None
        shard = torch.empty(b.shard_size, device=b.device)
        return shard, self.grid.reduce_scatter(shard, b.main_grad, b.group, async_op=True)

    def _receive(self) -> None:
        """Wait for the oldest reduce-scatter in flight and put its shard in this rank's (ZeRO-2/3
        add it: each backward's is a part of the sum). Hybrid ZeRO: once the step's last one is
        in, the shard's all-reduce over the replicas (`zr`, across nodes) is launched at once, so
        that it too runs during the backward, as the buckets do; `finish` waits for it."""
        b, shard, work, _, last = self.pending.popleft()  # the whole buffer (4th) is freed here
        if work is not None:
            peer_call(work.wait, what=self.grid.describe("the gradients' reduce_scatter", b.group))
        if self.zero >= 2:
            b.shard_grad += shard
        else:  # ZeRO-1: shard_grad is a view of main_grad, which the collective was reading
            b.shard_grad.copy_(shard)
        if last and b.group == "zs":
            b.work = self.grid.all_reduce(b.shard_grad, "zr", async_op=True)

    def finish(self) -> None:
        """After the last backward: launch what is left (everything, without overlap), wait, average,
        and (without ZeRO) point each p.grad at its slice of main_grad."""
        self.grid.observer.gradient_event("backward done", -1)
        for b in self.buckets:
            if (self.zero >= 2 and b.main_grad is not None) or (self.zero < 2 and not b.launched):
                self._launch(b)
        while self.pending:
            self._receive()
        for b in self.buckets:
            if b.work is not None:  # hybrid: the replicas' all-reduce; else the group's reduction
                op, group = ("all_reduce", "zr") if b.group == "zs" else \
                    ("reduce_scatter" if self.zero else "all_reduce", b.group)
                peer_call(b.work.wait, what=self.grid.describe(f"the gradients' {op}", group))
            if self.zero == 1 and b.group != "zs":
                b.shard_grad.copy_(b.received)
            if self.zero:
                b.shard_grad /= self.grid.dp_cp
            else:
                b.main_grad /= self.grid.dp_cp
                for p, view in b.views(b.main_grad):
                    if p.dtype != view.dtype:
                        p.grad_dtype = None  # a bf16 parameter with an fp32 gradient: allowed on purpose
                    p.grad = view
            b.ready, b.work, b.launched = 0, None, False
        self.grid.observer.gradient_event("reduced", -1)

    def zero_grad(self) -> None:
        for b in self.buckets:
            (b.main_grad if self.zero < 2 else b.shard_grad).zero_()
            for p in b.params:
                p.grad = None

    def shard_pieces(self):
        """ZeRO: (param, a, z, this rank's gradient of elements [a, z) of the param, flattened)."""
        for b in self.buckets:
            lo, hi = b.shard_range(b.rank)
            for p, off, a, z in b.parts(lo, hi):
                yield p, a - off, z - off, b.shard_grad[a - lo:z - lo]

    def bucket_of(self, p: torch.nn.Parameter) -> Bucket:
        return self.slot[p][0]


# ----------------------------------------------------------------------------- after the backward
#
# Between the last backward and the optimizer: the gradients tensor and pipeline parallelism leave
# partial (sequence parallelism's LayerNorms and biases, the tied embedding's two copies) are summed,
# and the global norm counts each element once.


def local_grads(model: torch.nn.Module, sync: GradSync | None) -> list[torch.Tensor]:
    """The gradient tensors this rank holds after finish_grads: what is unscaled and clipped (under
    ZeRO, the shards; otherwise every p.grad)."""
    if sync is not None and sync.zero:
        return [b.shard_grad for b in sync.buckets]
    return [p.grad for p in model.parameters() if p.grad is not None]


def sequence_parallel_grads(model: torch.nn.Module, sync: GradSync | None) -> list[torch.Tensor]:
    """The gradients sequence parallelism leaves partial (each tp rank saw only its slice of the
    sequence): LayerNorm gains and biases, row-parallel biases; under ZeRO, this rank's pieces."""
    if sync is not None and sync.zero:
        return [g for p, _, _, g in sync.shard_pieces() if placement(p).sequence_parallel]
    return [p.grad for p in model.parameters()
            if placement(p).sequence_parallel and p.grad is not None]


def tied_grad(model: torch.nn.Module, grid: Grid, sync: GradSync | None) -> torch.Tensor:
    """This stage's copy of the tied embedding's gradient (first or last pipeline stage); under ZeRO,
    its shard (the copy has a bucket alone, so both stages cut it at the same elements)."""
    p = model.transformer.wte.weight if grid.first_stage else model.lm_head.weight
    return sync.bucket_of(p).shard_grad if sync is not None and sync.zero else p.grad


def finish_grads(model: torch.nn.Module, grid: Grid, sync: GradSync | None) -> None:
    """Everything between the last backward and the optimizer: data-parallel averaging, the
    LayerNorm/bias gradients sequence parallelism left partial, and the tied embedding's two
    copies on the first and last pipeline stage (each gets the sum of both gradients)."""
    if sync is not None:
        sync.finish()
    partial = sequence_parallel_grads(model, sync)
    if partial and grid.tp > 1:
        flat = torch.cat([g.flatten() for g in partial])
        grid.all_reduce(flat, "tp")
        torch._foreach_copy_(partial, [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in partial]), partial)])
    if grid.pp > 1 and model.config.tied and (grid.first_stage or grid.last_stage):  # untied (Llama): two matrices
        grid.all_reduce(tied_grad(model, grid, sync), "embed")


def grad_norm(model: torch.nn.Module, grid: Grid, sync: GradSync | None = None) -> torch.Tensor:
    """The L2 norm of the whole model's gradient (fp32), identical on every rank: each rank sums the
    squares of the copies it owns (`Grid.owns`: a replica counted once, ZeRO's shards once each),
    then the sums are added over every group that splits the model. The norms of all of a rank's
    tensors are one call (`torch._foreach_norm`: on a GPU a couple of kernels for all of them, where
    squaring, summing and adding each tensor apart is three launches per tensor, ~450 at GPT-2)."""
    zero = sync is not None and sync.zero
    if zero:  # each data-parallel rank holds one shard of each bucket
        mine = [(p, g) for p, _, _, g in sync.shard_pieces() if grid.owns(p, replicated_over_dp=False)]
    else:
        mine = [(p, p.grad) for p in model.parameters()
                if p.grad is not None and grid.owns(p, replicated_over_dp=False)]
    if grid.ep > 1 and not zero:  # each rank of an ep group holds other experts: their squares summed over it
        # (ZeRO: a rank holds a shard of its ep rank's experts; the sum over dp below meets every shard once)
        experts = squares([g for p, g in mine if "ep" in placement(p).split], grid.device)
        grid.all_reduce(experts, "ep")
        sq = squares([g for p, g in mine if "ep" not in placement(p).split], grid.device) + experts
    else:
        sq = squares([g for _, g in mine], grid.device)
    for group in ("tp", "pp") + (("dp_cp",) if zero else ()):
        grid.all_reduce(sq, group)
    return sq.sqrt()


def squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of the squares of every element of grads (fp32)."""
    if not grads:
        return torch.zeros((), device=device)
    return torch.stack(torch._foreach_norm(grads, dtype=torch.float32)).square().sum()
