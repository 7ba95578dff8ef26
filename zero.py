"""ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models"): data parallelism without every rank holding a copy of everything.

Plain data parallelism keeps, on every one of N ranks, the whole model state. With Ψ parameters
under mixed precision that is 2Ψ bytes of 16-bit weights, 2Ψ of gradients and KΨ = 12Ψ of optimizer
state (fp32 master weights and Adam's two moments). Each stage shards one more of the three over the
N data-parallel ranks (section 5, figure 1):

    stage 1  optimizer state             2Ψ + 2Ψ + 12Ψ/N      reduce-scatter grads, all-gather weights
    stage 2  + gradients                 2Ψ + (2Ψ + 12Ψ)/N    the same bytes (gradients.py)
    stage 3  + the weights themselves    (2Ψ + 2Ψ + 12Ψ)/N    all-gather each unit's weights just
                                                              before its forward and again before its
                                                              backward: 1.5x the bytes of stage 0

Here gradients are fp32 (4Ψ, Megatron-LM's "main grads"), so the middle term is 4Ψ; `--memory-report`
prints both.

Stage 3 in this file, FSDP-style (Zhao et al. 2023, "PyTorch FSDP"): the parameters are grouped in
units (the embeddings with the final LayerNorm, then one unit per block); a unit's weights are one
flat buffer of which each rank keeps 1/N. Around each use:

    forward   gather unit i (waiting for the prefetch) ─▶ start gathering unit i+1 ─▶ compute i ─▶ free i
    backward  gather unit i again ─▶ start gathering unit i-1 ─▶ backward of i ─▶ reduce-scatter its
              gradients (gradients.GradSync) ─▶ free i

so at most two units are whole at once, and each all-gather is in flight while the unit before it computes.
(Under expert parallelism a block's experts are a unit of their own, sharded over `edp`, that moves with its
block: two all-gathers where there was one.) Between uses a parameter keeps its shape but not its values
(`placeholder`: one element, broadcast), so code that only asks for shapes works, and a write to it fails
loudly.

Freeing must free the memory, not just the name. Autograd keeps what a matmul's backward needs: for
y = x Wᵀ that includes a view of W, so of the unit's gathered buffer. Dropping our reference would leave
that view holding the whole buffer until the backward, every block's at once: more memory than no
ZeRO. So each unit has one buffer for the whole run, and freeing shrinks its storage to zero bytes
(`untyped_storage().resize_(0)`); the gather before the backward grows it again and all-gathers into the
same storage, where autograd's views find the weights once more (FSDP does the same).

The embeddings' unit is used twice per forward (the tied wte is also the output layer): gathered for
the embedding, freed, gathered again for the head and kept through the backward, which ends in the
embedding again. Two gathers per forward and backward, like every other unit: 1.5x, exactly.

Hybrid sharding (`--zero-shard N`; MiCS, Zhang et al. 2022; PyTorch's HSDP). ZeRO-3 over thousands of
GPUs puts every all-gather on the network between nodes, the slowest link there is. With shard groups of
N consecutive data-parallel ranks (one node's: the grid's `zs`), each group holds one whole copy of the
state, sharded over its N ranks, and the groups are replicas of each other (`zr`): the all-gathers and
reduce-scatters stay inside a group, and only one all-reduce of each 4Ψ/N gradient shard crosses nodes,
once a step. Memory is that of ZeRO over N ranks instead of over all of them: the price of the fast link.
ZeRO++ keeps the sharding global and makes the traffic cheaper instead (the last section: hpZ, qwZ, qgZ).
"""

from dataclasses import dataclass

import torch

from gradients import Bucket, GradSync
from model import in_backward, placeholder
from parallel import placement
from support.interrupt import peer_call


class ZeroAdamW:
    """The sharded optimizer of ZeRO stages 1-3 (section 5.1): rank r keeps the fp32 master weights,
    exp_avg and exp_avg_sq of shard r of every bucket only, and updates only that shard.

        gradients reduce-scattered ─▶ AdamW on this rank's shard (12 bytes/param / dp)
        stages 1, 2: all-gather the updated shards ─▶ every rank has the whole new model
        stage 3: keep only the shard; ParamGather gathers it when a unit runs

    The parameters live in flat per-bucket buffers so the gather writes straight into them; they may
    be 16-bit while the master shard stays fp32. The update is torch's fused AdamW kernel, the one
    torch.optim.AdamW(fused=True) runs, on this rank's piece of each parameter; like torch's, it leaves
    everything as it was where `found_inf` is 1, deciding on the device.

    Stage 3 never holds a bucket whole, not even to start: `initial(p)` gives p's starting value (this
    rank's tensor-parallel slice, fp32) one parameter at a time, and only its part of this rank's
    shard is kept (the parameters themselves are placeholders: shard.build_model(values=False)).
    Without `initial`, the parameters' own values are the start.
    """

    def __init__(self, sync: GradSync, lr: float, betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, param_dtype: torch.dtype = torch.float32, initial=None):
        self.sync, self.grid, self.stage = sync, sync.grid, sync.zero
        self.betas, self.eps = betas, eps
        self.param_groups = [{"lr": lr}]
        self.steps = torch.zeros((), device=self.grid.device)  # updates made (fp32, as torch's fused AdamW keeps it)
        self.found_inf: torch.Tensor | None = None  # set before step(): 1 skips the update
        self.shards = []
        for b in sync.buckets:
            s = slice(*b.shard_range(b.rank))  # (expert buckets: sharded over edp, gradients.py)
            master = shard_of(b, s, initial or (lambda p: p.detach()))  # fp32, this rank's part only
            if self.stage == 3:  # this rank keeps its shard of the weights, nothing more (ParamGather's Unit)
                flat = master.to(param_dtype, copy=True)
                for p in b.params:
                    p.data = placeholder(p.shape, param_dtype, b.device)
            else:
                flat = torch.zeros(b.padded, dtype=param_dtype, device=b.device)
                for p, view in b.views(flat):
                    view.copy_(p.detach())
                    p.data = view  # the parameter is now a window onto the bucket's flat buffer
            self.shards.append({"flat": flat, "slice": s, "master": master, "group": b.group,
                                "exp_avg": torch.zeros(b.shard_size, device=b.device),
                                "exp_avg_sq": torch.zeros(b.shard_size, device=b.device)})
        self.by_decay = self._by_decay(weight_decay)

    def _by_decay(self, weight_decay: float) -> dict[float, tuple[list, list, list, list]]:
        """The fused kernel's lists: for each weight decay (matrices decay, biases and gains do not; a
        shard cuts through both kinds), views of this rank's pieces of the master weights, gradients
        and moments, one per parameter."""
        groups = {}
        for b, st in zip(self.sync.buckets, self.shards):
            lo, hi = st["slice"].start, st["slice"].stop
            for p, _, a, z in b.parts(lo, hi):
                lists = groups.setdefault(weight_decay if p.dim() >= 2 else 0.0, ([], [], [], []))
                for out, t in zip(lists, (st["master"], b.shard_grad, st["exp_avg"], st["exp_avg_sq"])):
                    out.append(t[a - lo:z - lo])
        return groups

    @torch.no_grad()
    def step(self) -> None:
        (beta1, beta2), lr = self.betas, self.param_groups[0]["lr"]
        self.steps += 1
        for decay, (w, g, m, v) in self.by_decay.items():
            torch._fused_adamw_(w, g, m, v, [], [self.steps] * len(w), lr=lr, beta1=beta1, beta2=beta2,
                                weight_decay=decay, eps=self.eps, amsgrad=False, maximize=False,
                                found_inf=self.found_inf)
        if self.found_inf is not None:  # a skipped update is not counted (the bias correction)
            self.steps -= self.found_inf
        for st in self.shards:
            self._publish(st)
    def _publish(self, st: dict) -> None:
        """The master shard, in the parameters' dtype, where the forward will find it."""
        if self.stage == 3:
            st["flat"].copy_(st["master"])
        else:
            self.grid.all_gather(st["flat"], st["master"].to(st["flat"].dtype), st["group"])

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
        """Fill this rank's shards piece by piece: state(name, p, kind, (a, z)) gives elements
        [a, z) of p's flattened slice in fp32 (for "master", the checkpoint's weights when it kept
        no masters), or None for a moment the checkpoint lacks (it starts from zero). Under stage 3
        the weight shards are then rebuilt from the masters: nothing else holds them."""
        self.steps.fill_(t)
        for name, p, kind, span, dst in self.pieces(model):
            src = state(name, p, kind, span)
            if src is None:
                dst.zero_()
            else:
                dst.copy_(src)
        if self.stage == 3:
            for st in self.shards:
                self._publish(st)


def shard_of(b: Bucket, s: slice, value) -> torch.Tensor:
    """Elements [s] of the bucket's flat fp32 buffer, filled parameter by parameter from value(p) (p's
    whole local tensor, asked for only if part of it falls in [s]): the rest of the bucket is never held."""
    out = torch.zeros(s.stop - s.start, device=b.device)
    for p, off, a, z in b.parts(s.start, s.stop):
        out[a - s.start:z - s.start] = value(p).flatten()[a - off:z - off]
    return out


def units(model: torch.nn.Module) -> list[list[torch.nn.Parameter]]:
    """ZeRO-3's units, in forward order: the embeddings and the final LayerNorm (the tied wte is the
    output layer too; an untied output layer, Llama's, joins them), then one per block. Under expert
    parallelism a block's experts are a unit of their own, right after the rest of the block: they are
    sharded over another group (edp, gradients.py), so they are another buffer and another all-gather."""
    t = model.transformer
    root = [*t.wte.parameters(), *(t.wpe.parameters() if "wpe" in t else []), *t.ln_f.parameters()]
    if not model.config.tied:
        root += list(model.lm_head.parameters())
    out = [root]
    for block in t.h:
        params = list(block.parameters())
        experts = [p for p in params if placement(p).replicas == "edp"]
        rest = [p for p in params if placement(p).replicas != "edp"]
        out += [rest] + ([experts] if experts else [])
    return out


class _BeforeBackward(torch.autograd.Function):
    """Identity forward; in the backward, call `fn` first: the hook that gathers a unit's weights
    before the backward that needs them (and prefetches the next)."""

    @staticmethod
    def forward(ctx, x, fn):
        ctx.fn = fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.fn()
        return grad, None


@dataclass
class Unit:
    """ZeRO-3's state of one unit: its bucket of parameters (gradients.Bucket, whose gradients GradSync
    reduces), this rank's shard of their weights (the optimizer's "flat"), the buffer they are gathered
    into (one for the run: 0 bytes while free), where they are, and the all-gather in flight."""
    bucket: Bucket
    shard: torch.Tensor
    buffer: torch.Tensor
    state: str = "free"  # free, gathering or whole
    gathering: object = None  # the all-gather's handle while state is "gathering"
    quantized: tuple | None = None  # qwZ: (codes, scales) being gathered, dequantized into buffer on arrival
    secondary: torch.Tensor | None = None  # hpZ: this rank's part of the weights among its node's ranks


class ParamGather:
    """ZeRO-3's parameter side: module hooks gather each unit's weights before it runs, prefetch the
    next unit's, and free them after (see the module docstring). GradSync's reduce-scatter of a
    unit's gradients (`on_reduced`) frees the weights after the backward."""

    def __init__(self, model: torch.nn.Module, opt: ZeroAdamW, compiled: bool = False, qwz_block: int = 0,
                 hpz: bool = False):
        sync = opt.sync
        self.grid, self.sync, self.qwz_block, self.hpz = sync.grid, sync, qwz_block, hpz
        self.secondary_peak = 0  # hpZ: the most bytes of second copies held at once (--memory-report)
        self.units: list[Unit] = []  # forward order: root, block 0, (block 0's experts,) block 1, ...
        self.parts: list[list[int]] = []  # the units each use gathers: [root], [block 0(, its experts)], ...
        for b, st in zip(sync.buckets[::-1], opt.shards[::-1]):
            buffer = torch.empty(b.padded, dtype=st["flat"].dtype, device=b.device)
            buffer.untyped_storage().resize_(0)
            self.units.append(Unit(b, st["flat"], buffer))
            if b.group == "edp":  # a block's experts: used with the rest of it
                self.parts[-1].append(len(self.units) - 1)
            else:
                self.parts.append([len(self.units) - 1])
        self.use_of = {j: i for i, part in enumerate(self.parts) for j in part}  # (the observer's events: by use)
        t, last = model.transformer, len(self.parts) - 1
        # A compiled module runs its hooks inside its compiled call: gathering and freeing (collectives,
        # storage, bookkeeping) stay out of the graph, or torch.compile would trace them once per shape.
        eager = torch.compiler.disable if compiled else (lambda hook: hook)
        # root: gathered for the embedding and freed after it (wte and wpe run, then dropout), then
        # gathered again for the head; in training kept through the backward until reduce-scattered
        t.wte.register_forward_pre_hook(eager(lambda m, args: self.use(0, prefetch=1)))
        t.drop.register_forward_hook(eager(lambda m, args, out: self.free(0)))
        t.ln_f.register_forward_pre_hook(eager(lambda m, args: self.use(0, prefetch=None)))
        for module in (model.loss, model.lm_head):
            module.register_forward_hook(eager(self._after_head))
        for i, block in enumerate(t.h, start=1):
            block.register_forward_pre_hook(eager(lambda m, args, i=i: self.use(i, prefetch=self._next(i))))
            block.register_forward_hook(eager(lambda m, args, out, i=i: self._after_block(i, out)))
        index = {id(u.bucket): i for i, u in enumerate(self.units)}
        sync.on_reduced = lambda b: self.free_unit(index[id(b)])
        self.last = last

    def _next(self, i: int) -> int | None:
        """The unit to prefetch while unit i runs: the next in the forward (the root, for the head,
        after the last block), the previous in a backward (no further than block 0)."""
        if in_backward():
            return i - 1 if i > 1 else None
        return i + 1 if i < len(self.parts) - 1 else 0

    def gather(self, i: int) -> None:
        """Start the all-gathers of use i's weights (asynchronous), unless whole or on their way."""
        for j in self.parts[i]:
            u = self.units[j]
            if u.state != "free":
                continue
            u.buffer.untyped_storage().resize_(u.bucket.padded * u.buffer.element_size())  # back from 0 bytes
            u.state, u.gathering = "gathering", self._all_gather(u)
            self.grid.observer.gather_event("gather", i)

    def _all_gather(self, u: Unit):
        """Launch a unit's all-gather: its shards over their group, or (hpZ, in the backward) the node's
        copy over the node's ranks, or (qwZ) int8 codes and their scales."""
        if u.secondary is not None and in_backward():  # hpZ: what the forward's gather left on this node
            return self.grid.all_gather(u.buffer, u.secondary, "node", async_op=True)
        if not self.qwz_block:
            return self.grid.all_gather(u.buffer, u.shard, u.bucket.group, async_op=True)
        codes, scales = quantize(u.shard.float(), self.qwz_block, 8)
        u.quantized = (codes.new_empty(u.bucket.padded), scales.new_empty(u.bucket.padded // self.qwz_block))
        return [self.grid.all_gather(out, part, u.bucket.group, async_op=True)
                for out, part in zip(u.quantized, (codes, scales))]

    def wait(self, j: int) -> None:
        u = self.units[j]
        if u.state != "gathering":
            return
        works = [w for w in (u.gathering if isinstance(u.gathering, list) else [u.gathering]) if w is not None]
        landed = all(w.is_completed() for w in works)  # already there: the gather was hidden
        for w in works:
            peer_call(w.wait, what=self.grid.describe("ZeRO-3's all_gather of weights", u.bucket.group))
        if u.quantized is not None:  # qwZ: the int8 blocks, back to the weights' dtype
            u.buffer.copy_(dequantize(*u.quantized, self.qwz_block, 8))
            u.quantized = None
        if self.hpz and self.use_of[j] > 0:  # a block's forward keeps the node's part; its backward used it
            n, part = self.grid.node_dp, u.bucket.padded // self.grid.node_dp
            u.secondary = None if in_backward() else u.buffer[self.grid.dp_cp_rank % n * part:][:part].clone()
            held = sum(v.secondary.nbytes for v in self.units if v.secondary is not None)
            self.secondary_peak = max(self.secondary_peak, held)
        u.state, u.gathering = "whole", None
        for p, view in u.bucket.views(u.buffer):
            p.data = view
        self.grid.observer.gather_event("ready" if not landed else "ready (landed early)", self.use_of[j])

    def use(self, i: int, prefetch: int | None) -> None:
        """Before use i (the root, a block) computes: its weights whole, the next one's on their way."""
        self.gather(i)
        for j in self.parts[i]:
            self.wait(j)
        if prefetch is not None:
            self.gather(prefetch)
        self.grid.observer.gather_event("compute", i)

    def free(self, i: int) -> None:
        for j in self.parts[i]:
            self.free_unit(j)

    def free_unit(self, j: int) -> None:
        u = self.units[j]
        self.wait(j)  # a gather in flight writes into its buffer: let it land first
        u.state = "free"
        for p in u.bucket.params:
            p.data = placeholder(p.shape, u.shard.dtype, u.bucket.device)
        u.buffer.untyped_storage().resize_(0)  # the memory itself, under autograd's views too
        self.grid.observer.gather_event("free", self.use_of[j])

    def _after_block(self, i: int, out: torch.Tensor):
        if in_backward():  # a recomputed forward (--recompute full): its backward follows at once
            return None
        self.free(i)
        if torch.is_grad_enabled():
            return _BeforeBackward.apply(out, lambda: self.use(i, prefetch=self._next(i)))
        return None

    def _after_head(self, module, args, out):
        if not torch.is_grad_enabled():  # evaluation, sampling: nothing comes back for the weights
            self.free(0)
            for u in self.units:  # (nor for hpZ's copies of them)
                u.secondary = None
            return None
        if isinstance(out, torch.Tensor) and out.dim() == 0:  # the loss: its backward starts the step's
            return _BeforeBackward.apply(out, lambda: self.gather(self.last))
        return None

    def all_free(self) -> bool:
        """Is every unit back to its shard (as between steps it must be)?"""
        return all(u.state == "free" for u in self.units)


# ----------------------------------------------------------------------------- ZeRO++
#
# ZeRO++ (Wang et al. 2023, "ZeRO++: Extremely Efficient Collective Communication for Giant Model
# Training"): three changes to ZeRO-3's traffic, each behind its own flag.
#
#   qwZ  the weights' all-gathers carry int8 codes and one fp32 scale per block of --quant-block
#        elements instead of the weights (2 or 4 bytes each): (1 + 4 / block) bytes an element
#   hpZ  the forward's all-gather of a block leaves each rank a second copy of 1/L of the block's weights,
#        L being the dp x cp ranks of its node; the backward gathers from those copies, over the node
#        only: the backward's all-gather never leaves the node, for (weights / L) more memory per rank
#   qgZ  the gradients' reduce-scatter becomes two all-to-alls of int8 (or int4) blocks: inside the node
#        first (each rank receives, from each of the node's ranks, the parts of every shard it will
#        pass on; it sums them in fp32), then across nodes (the partial sums of its own shard from every
#        node, summed in fp32). Quantizing once per hop instead of once per ring step (a ring of n ranks
#        would re-quantize n-1 times) keeps the error of one hop, and what crosses nodes is 1/L of
#        what the node exchanged. Here the two run at once, in the hook of the bucket's last gradient
#        (the second needs the first's sums), so unlike DeepSpeed's they do not overlap the backward
#
# A block's scale is its largest |x| over the largest code (127 for int8, 7 for int4), so each element is
# off by at most half a scale: |x - dequantize(quantize(x))| <= max|block| / (2 x 127) (int8; / 14 for int4).


def quantize(x: torch.Tensor, block: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (n,) fp32, n a multiple of block -> (codes, scales): per block one fp32 scale and the elements
    rounded to the nearest multiple of it, int8 (int4: two codes to a byte, biased by 8)."""
    top = 2 ** (bits - 1) - 1
    blocks = x.view(-1, block)
    scales = blocks.abs().amax(1).clamp(min=torch.finfo(torch.float32).tiny) / top  # (n / block,)
    codes = torch.round(blocks / scales[:, None]).clamp_(-top, top).to(torch.int8).flatten()
    if bits == 4:
        nibbles = (codes + 8).to(torch.uint8).view(-1, 2)  # 1..15
        codes = nibbles[:, 0] | (nibbles[:, 1] << 4)
    return codes, scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, block: int, bits: int) -> torch.Tensor:
    """The fp32 elements that `quantize` encoded."""
    if bits == 4:
        codes = torch.stack([codes & 15, codes >> 4], dim=1).flatten().to(torch.int8) - 8
    return (codes.float().view(-1, block) * scales[:, None]).flatten()


class QuantizedReduceScatter:
    """qgZ: GradSync's reduce-scatter (gradients.py), hierarchical and quantized. The dp x cp ranks are M
    nodes of L (rank = node x L + local), and rank r owns shard r of a bucket's buffer (S elements each):

        buffer as (M, L, S): shard n' L + l' sits at [n', l']
        1. inside the node: all-to-all of [:, l'] (quantized) to local rank l'; sum what arrives (fp32)
           -> this rank holds its node's sum of the shards n' L + local, for every node n'
        2. across nodes: all-to-all of row n' (quantized) to node n'; sum what arrives
           -> the sum over every rank of shard node x L + local = this rank's shard"""

    def __init__(self, grid, bits: int, block: int):
        self.grid, self.bits, self.block = grid, bits, block

    def __call__(self, full: torch.Tensor) -> torch.Tensor:
        L, M = self.grid.node_dp, self.grid.dp_cp // self.grid.node_dp
        S = full.numel() // (M * L)
        mine = self.exchange(full.view(M, L, S).transpose(0, 1), "node").sum(0)  # (M, S): this node's sums
        return self.exchange(mine, "nodes").sum(0)  # (S,)

    def exchange(self, rows: torch.Tensor, group: str) -> torch.Tensor:
        """rows (R, ...), R the group's size: row r goes to the group's rank r, quantized; returns what each
        rank sent this one, dequantized, (R, ...) fp32."""
        codes, scales = quantize(rows.contiguous().flatten(), self.block, self.bits)
        got = codes.new_empty(codes.shape), scales.new_empty(scales.shape)
        for out, inp in zip(got, (codes, scales)):
            self.grid.all_to_all(out, inp, group)
        return dequantize(*got, self.block, self.bits).view(rows.shape)
