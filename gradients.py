"""Gradients across data-parallel ranks: averaging them (what DDP does), sharding the optimizer
(ZeRO-1), and the global gradient norm that clipping needs, all from raw collectives.

    backward ─▶ per-parameter hooks add each gradient into its bucket's flat fp32 buffer
             ─▶ a full bucket launches its all-reduce (ZeRO: reduce-scatter) at once, overlapped
                with the rest of the backward
    finish_grads ─▶ wait, average; sum what tensor / pipeline parallelism left partial
    grad_norm ─▶ each element counted once, whatever the layout (`Grid.owns`)
    ZeroAdamW.step ─▶ AdamW on this rank's shard, then all-gather the new weights

Which rank's copy of a replicated tensor counts is one rule, `Grid.owns`, shared with the
checkpoints (which save exactly the copies that count).
"""

import time

import torch

from parallel import Grid, peer_call


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
    bucket's all-reduce (or, for ZeRO-1, reduce-scatter) is launched asynchronously, so the
    communication of late layers overlaps the backward of early ones. Buckets follow the
    parameters in reverse order, the order backward produces their gradients.

    Gradient accumulation: micro-steps before the last only accumulate; the collectives run once,
    on the last micro-step's backward. Whoever runs the micro-batches says which backward that is,
    with one assignment (DDP's name for the flag): `require_backward_grad_sync = is_last_micro`.
    """

    def __init__(self, model: torch.nn.Module, grid: Grid, bucket_mb: float = 25, overlap: bool = True,
                 zero: bool = False):
        self.grid, self.overlap, self.zero, self.require_backward_grad_sync = grid, overlap, zero, True
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
        if self.require_backward_grad_sync:
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
                lo, hi = b.shard_range(self.grid.dp_rank)
                b.main_grad[lo:hi].copy_(b.shard)
                b.main_grad[lo:hi] /= self.grid.dp
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
            s = slice(*b.shard_range(self.grid.dp_rank))
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

    def memory_bytes(self) -> int:
        """Optimizer state held by this rank: master weights and both moments (fp32)."""
        return sum(st[k].numel() * 4 for st in self.shards for k in ("master", "exp_avg", "exp_avg_sq"))

    def pieces(self, model: torch.nn.Module):
        """(name, param, kind, (start, stop) within the param, tensor) for each part of this rank's
        shards, so a checkpoint can store the state per parameter and reshard it."""
        names = {id(p): n for n, p in model.named_parameters()}
        for b, st in zip(self.sync.buckets, self.shards):
            lo, hi = st["slice"].start, st["slice"].stop
            for p, off, a, z in b.parts(lo, hi):
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
    if grid.pp > 1 and (grid.first_stage or grid.last_stage):
        tied = model.transformer.wte.weight if grid.first_stage else model.lm_head.weight
        grid.all_reduce(tied.grad, "embed")


def grad_norm(model: torch.nn.Module, grid: Grid, sync: GradSync | None = None) -> torch.Tensor:
    """The L2 norm of the whole model's gradient (fp32), identical on every rank: each rank sums the
    squares of the copies it owns (`Grid.owns`: a replica counted once, ZeRO's shards once each),
    then the sums are added over every group that splits the model."""
    sq = torch.zeros((), device=grid.device)
    if sync is not None and sync.zero:  # each data-parallel rank holds one shard of each bucket
        for b in sync.buckets:
            for p, _, a, z in b.parts(*b.shard_range(grid.dp_rank)):
                if grid.owns(p, replicated_over_dp=False):
                    sq += b.main_grad[a:z].pow(2).sum()
    else:
        for p in model.parameters():
            if p.grad is not None and grid.owns(p, replicated_over_dp=False):
                sq += p.grad.float().pow(2).sum()
    for group in ("tp", "pp") + (("dp",) if sync is not None and sync.zero else ()):
        grid.all_reduce(sq, group)
    return sq.sqrt()


# ----------------------------------------------------------------------------- measured against the papers
