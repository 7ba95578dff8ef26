"""Per-layer statistics: what each layer's gradients, updates and activations look like, every N steps.

The global gradient norm (gradients.grad_norm) says *that* something is wrong; these three numbers
per layer say *where*:

    grad_norm[l]     ||g_l||, the gradient of layer l's parameters before clipping. Gradient flow:
                     healthy training keeps the layers within an order of magnitude of each other.
                     Norms that shrink toward the input are vanishing gradients; one layer far above
                     the rest, or a norm that climbs step after step, comes before a loss spike.
    update_ratio[l]  ||ΔW_l|| / ||W_l||, how far one optimizer step moved the layer, relative to its
                     size. Around 1e-3 is the usual rule of thumb: 1e-2 and up, the learning rate is
                     too high for that layer (its weights are being rewritten each step); 1e-5 and
                     down, it has stopped learning. Adam normalizes the gradient, so this, not
                     grad_norm, is what the learning rate sets.
    act_rms[l]       sqrt(mean(x^2)) of block l's output (and of the embedding's), the residual
                     stream. Pre-LayerNorm GPTs add to it in every block, so it grows with depth;
                     growth by orders of magnitude, or a block whose RMS jumps during training, is
                     how activation blow-ups (and fp16/bf16 overflow) announce themselves.

Layers are `embed` (wte, wpe; the tied output layer is wte), `h.0` ... `h.{L-1}` (the blocks) and
`ln_f`.

Under --precision fp8, two more per block: `fp8_x_amax[l]` and `fp8_g_amax[l]`, the largest |x| its Linears
cast to e4m3 and the largest output gradient they cast to e5m2 in the step (the max over its four Linears
and over the ranks: a second all-reduce, a MAX; a gradient's in one process's units, fp8.Scaling's unit).
Each tensor's scale is the format's max over its amax (fp8.py), so this is the chart of the scales too: one
falling by orders of magnitude is where e5m2 runs out of room below, one jumping is where delayed scaling
saturates for a step.

With experts (moe.py), two more per MoE block, the numbers that show a router collapsing:
`moe_load[l]`, the share of the step's assignments (token, choice) that chose each of the E experts, before
dropping (E numbers summing to 1; even load is 1/E each, a collapsed router puts nearly 1 on one expert),
and `moe_dropped[l]`, the share of those assignments dropped over capacity (they pass on the residual
alone). Each block's forward hook reads them from what its MoE keeps after a forward (`load`, `dropped`);
they are summed over micro-batches and ranks as counts, then divided.

Full-model values, whatever the layout. Every number is the one a single process would compute on
the same step (tests/test_stats.py holds tp x pp and ZeRO runs to that):

    each rank sums squares (and, for the RMS, element counts) over the copies it owns:
        tensor-parallel shards: each its own part;  tensor-parallel replicas: tp rank 0's only
        data / context-parallel replicas: one of them, each replica an equal share of the tensors
        (`share`);  ZeRO shards: each its own part (under hybrid ZeRO, shared out like replicas)
        the pipeline's copy of the tied embedding: never;  experts: as Grid.owns, the rule clipping uses
        activations: each rank its own rows (dp), sequence slices (cp, and tp under --sp); outputs
        that tensor parallelism replicates: tp rank 0's only
        expert loads: each data-parallel rank its own tokens (with or without --ep: the router runs
        before the all-to-all, on the rank's own rows); tp rank 0's only (experts and router are
        replicated over tp, so every tp rank routes the same tokens); a recomputed forward: never
    one all-reduce over the whole world adds them: a pipeline stage contributes its own layers,
    zeros elsewhere, so the sum is the gather too. Then per layer: sqrt, and the ratio.

So a stats step costs one small all-reduce (5 numbers per layer, and E + 1 per MoE layer), a copy of
the weights this rank counts (its share of the replicated ones, or, under ZeRO, of its master shard)
held across the optimizer step, and a square-and-sum of every block output. (Were every replica's count
on dp rank 0, as clipping's rule puts it, that copy would be 4 bytes per parameter on that rank alone.)
That is why it runs only every --stats-every steps (tests/bench_stats.py measures it). It reads and
never writes: the losses of a run are bitwise the same with and without it.
"""

import torch

import fp8
import moe
from gradients import GradSync
from model import in_backward
from parallel import Grid, placement
from support.observer import Observer
from zero import ZeroAdamW


def layer_names(n_layer: int) -> list[str]:
    return ["embed"] + [f"h.{i}" for i in range(n_layer)] + ["ln_f"]


def share(sizes: list[int], n: int) -> list[int]:
    """Which of n replicas counts each of the pieces of these sizes: the largest first, each to the replica
    that counts the fewest elements so far (every replica computes the same, from the same pieces in the
    same order). Each counts, and a statistics step copies, at most 1/n of them and one piece more."""
    load, out = [0] * n, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        out[i] = load.index(min(load))
        load[out[i]] += sizes[i]
    return out


def layer_of(name: str) -> str:
    """The layer a parameter belongs to, from its name (blocks keep their global names on every stage)."""
    parts = name.split(".")
    if parts[:2] == ["transformer", "h"]:
        return f"h.{parts[2]}"
    if parts[:2] == ["transformer", "ln_f"]:
        return "ln_f"
    return "embed"  # wte, wpe, and lm_head.weight (the tied wte, or the last stage's copy of it)


class LayerStats(Observer):
    """The per-layer statistics of every `every`-th step (and step 1), at the Observer's points:

        begin(step)            before the forward: is this a stats step? (hooks record activations)
        after_grads()          gradients reduced and unscaled, not yet clipped: their squares; the weights
        finish(updated)        after the optimizer (or its skip): the update, one all-reduce, the row
        pop_row()              {"event": "layers", "step": ..., "grad_norm": {...}, ...} or None

    Every rank calls the first three at the same points (the all-reduce needs them all); `every` = 0
    makes them no-ops and registers no hooks. `skip_first`: leave out the first step this process runs,
    whose traffic and memory --comm-report and --memory-report compare with their formulas. `write`
    (train.py's metrics.jsonl) gets the row once the step's own line is written."""

    def __init__(self, model: torch.nn.Module, grid: Grid, sync: GradSync | None,
                 opt: torch.optim.Optimizer | ZeroAdamW, n_layer: int, every: int, skip_first: bool = False,
                 write=None):
        self.model, self.grid, self.sync, self.opt, self.every, self.write = model, grid, sync, opt, every, write
        self.layers = layer_names(n_layer)
        index = {name: i for i, name in enumerate(self.layers)}
        self.index = {id(p): index[layer_of(n)] for n, p in model.named_parameters(remove_duplicate=False)}
        self.zero = bool(sync is not None and sync.zero)
        self.active, self.skip_first, self.row = False, skip_first, None
        cfg = model.config  # the MoE layers of the whole model, from its shape (a pipeline stage holds some)
        self.n_experts = cfg.moe_experts
        self.moe_layers = [f"h.{i}" for i in range(n_layer) if cfg.moe_experts and moe.is_moe_layer(i, cfg.moe_every)]
        self.moe_row = {index[name]: j for j, name in enumerate(self.moe_layers)}  # layer -> its row of moe_count
        if every:
            self._hook(model.transformer.drop, index["embed"])  # the embedding's output (first stage)
            for name, block in model.transformer.h.named_children():
                self._hook(block, index[f"h.{name}"])

    def _hook(self, module: torch.nn.Module, i: int) -> None:
        # Eager even inside a compiled block (a graph break at its end): the hook reads a Python flag
        # and accumulates into a tensor, neither of which belongs in a graph. (A block's expert load is
        # read here too, from its MoE, rather than by a hook of the MoE's own: one more break per block.)
        record = torch.compiler.disable(lambda m, args, out: self._record(i, m, out))
        module.register_forward_hook(record)

    def _record(self, i: int, module: torch.nn.Module, out: torch.Tensor) -> None:
        if not self.active or in_backward():  # a block recomputed for its backward ran its forward already
            return
        g = self.grid
        if i in self.moe_row and g.tp_rank == 0:  # experts replicated over tp: every tp rank routes the same tokens
            self._count_load(self.moe_row[i], module.mlp)
        if g.tp > 1 and not g.sp_on and g.tp_rank != 0:  # the same output on every tensor-parallel rank
            return
        self.act_sq[i] += out.detach().float().pow(2).sum()
        self.act_n[i] += out.numel()

    def _count_load(self, j: int, m: moe.MoE) -> None:
        """The j-th MoE layer's forward: its assignments per expert, and how many of them it dropped, as counts."""
        load = m.load.detach().double()  # (E,): this forward's B T k assignments, before dropping
        self.moe_count[j, :-1] += load
        self.moe_count[j, -1] += (m.dropped.detach().double() * load.sum()).round()  # a fraction of them, counted

    def due(self, step: int) -> bool:
        return bool(self.every) and (step == 1 or step % self.every == 0)

    def begin(self, step: int) -> None:
        self.row, self.step = None, step
        self.active = self.due(step) and not self.skip_first
        self.skip_first = False
        if self.active:
            n, dev = len(self.layers), self.grid.device
            self.act_sq, self.act_n = torch.zeros(n, device=dev), torch.zeros(n, dtype=torch.float64, device=dev)
            # per MoE layer: assignments to each expert, then those dropped
            self.moe_count = torch.zeros(len(self.moe_layers), self.n_experts + 1, dtype=torch.float64, device=dev)

    def _owned(self):
        """(layer index, this rank's gradient, this rank's weights) for each piece of the model whose
        copy counts here; under ZeRO the pieces of the shards (the fp32 master weights)."""
        g = self.grid
        if self.zero:
            grads = {(id(p), a): grad for p, a, _, grad in self.sync.shard_pieces()}
            pieces = [(p, grads[(id(p), a)], w) for _, p, kind, (a, _), w in self.opt.pieces(self.model)
                      if kind == "master"]
            # (hybrid ZeRO: the shard groups hold replicas of each other's shards)
            replicas, place = g.dp_cp // g.zs, g.zr_rank
        else:
            pieces = [(p, p.grad, p.detach()) for p in self.model.parameters() if p.grad is not None]
            replicas, place = g.dp_cp, g.dp_cp_rank
        spread = [(p, grad, w) for p, grad, w in pieces  # a replica's count, spread over its replicas
                  if placement(p).replicas != "edp" and not placement(p).tied_copy
                  and (placement(p).shard is not None or g.tp_rank == 0)]
        here = share([w.numel() for _, _, w in spread], replicas)
        counted = {id(w) for (_, _, w), j in zip(spread, here) if j == place}
        for p, grad, w in pieces:
            if id(w) in counted or (placement(p).replicas == "edp"
                                    and g.owns(p, replicated_over_dp=not self.zero)):
                yield self.index[id(p)], grad, w

    def after_grads(self) -> None:
        if not self.active:
            return
        pieces = list(self._owned())
        self.piece_layer = torch.tensor([i for i, _, _ in pieces], dtype=torch.long, device=self.grid.device)
        self.grad_sq = self._sum_by_layer([g for _, g, _ in pieces])
        self.weight_sq = self._sum_by_layer([w for _, _, w in pieces])
        self.before = [w.detach().float().clone() for _, _, w in pieces]  # held across the optimizer step
        self.pieces = pieces

    def _sum_by_layer(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Per layer, the sum of the squares of the elements of `tensors` (one per owned piece)."""
        out = torch.zeros(len(self.layers), dtype=torch.float64, device=self.grid.device)
        if tensors:
            norms = torch.stack([t.float().norm() for t in tensors]).double()
            out.index_add_(0, self.piece_layer, norms * norms)
        return out

    def finish(self, updated: bool) -> None:
        """The step's update (when there was one), the one all-reduce, and the row."""
        if not self.active:
            return
        self.active = False
        delta = torch.zeros_like(self.weight_sq)
        if updated and self.before:
            torch._foreach_sub_(self.before, [w.detach().float() for _, _, w in self.pieces])  # in place: -ΔW
            delta = self._sum_by_layer(self.before)
        n = len(self.layers)
        total = torch.cat([self.grad_sq, self.weight_sq, delta, self.act_sq.double(), self.act_n,
                           self.moe_count.flatten()])  # (E + 1 counts per MoE layer; none without experts)
        self.grid.all_reduce(total, "world")
        grad_sq, weight, delta, act_sq, act_n = total[:5 * n].view(5, -1).tolist()
        self.before = self.pieces = None
        row = {"event": "layers", "step": self.step,
               "grad_norm": {name: v ** 0.5 for name, v in zip(self.layers, grad_sq)}}
        if updated:
            row["update_ratio"] = {name: (d / w) ** 0.5 for name, d, w in zip(self.layers, delta, weight) if w > 0}
        row["act_rms"] = {name: (s / n) ** 0.5 for name, s, n in zip(self.layers, act_sq, act_n) if n > 0}
        self.row = row | self.expert_load(total[5 * n:]) | self.fp8_amax()

    def expert_load(self, counts: torch.Tensor) -> dict:
        """Per MoE block, each expert's share of the step's assignments and the share dropped (empty without
        experts), from the all-reduced counts: per MoE layer, E experts' assignments and the dropped ones."""
        if not self.moe_layers:
            return {}
        per_layer = [(name, row[:-1], row[-1], sum(row[:-1]))
                     for name, row in zip(self.moe_layers, counts.view(len(self.moe_layers), -1).tolist())]
        return {"moe_load": {name: [c / n for c in load] for name, load, _, n in per_layer if n > 0},
                "moe_dropped": {name: d / n for name, _, d, n in per_layer if n > 0}}

    def fp8_amax(self) -> dict:
        """Per block, the step's largest x and output gradient its fp8 Linears cast (empty without fp8)."""
        states = fp8.states(self.model)
        if not states:
            return {}
        amax = torch.zeros(2, len(self.layers), device=self.grid.device)
        for name, state in states:  # amax_history[0]: the step fp8.end_step has just rolled in
            i = self.layers.index(layer_of(name + ".weight"))
            amax[0, i] = torch.maximum(amax[0, i], state.x.amax_history[0])
            amax[1, i] = torch.maximum(amax[1, i], state.g.amax_history[0])
        self.grid.all_reduce(amax, "world", op=torch.distributed.ReduceOp.MAX)
        x, g = amax.tolist()
        return {"fp8_x_amax": {n: v for n, v in zip(self.layers, x) if n.startswith("h.")},
                "fp8_g_amax": {n: v for n, v in zip(self.layers, g) if n.startswith("h.")}}

    def pop_row(self) -> dict | None:
        row, self.row = self.row, None
        return row

    # the Observer's points
    def step_begin(self, step: int) -> None:
        self.begin(step)

    def after_update(self, updated: bool) -> None:
        self.finish(updated)

    def step_written(self, row: dict) -> None:
        if (layers := self.pop_row()) is not None:
            self.write(**layers)
