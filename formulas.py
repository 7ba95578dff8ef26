"""What the papers predict, next to what ran: the formulas behind every report this codebase prints.

    traffic    the bytes each collective should move in a step (Megatron's 4 activations per
               layer, one activation per micro-batch between stages, the gradient volume) —
               `comm_report` puts them beside the bytes `Grid` counted
    overlap    when each gradient bucket's collective started, relative to the end of backward
    memory     weights, gradients and optimizer state against ZeRO's 2Ψ + 2Ψ + 12Ψ (each / dp from
               its stage on); saved activations against activation_bytes, the one activation model
               (flash-aware, by --recompute) that planner.plan() and the lessons use too, with
               Korthikanti et al.'s s b h (34 + 5 a s / h) beside it
    bubble     the pipeline's idle share (p-1)/(v m + p-1), and the warning train.py prints above 30%
    peak       the FLOP/s an MFU is measured against: a table for GPUs, a measured matmul on CPU;
               and the peak bytes a piece of work allocates, measured

Nothing here changes training; train.py calls it for --comm-report, --memory-report, MFU and the
pipeline warning, lessons 07-14 to check their arithmetic. A whole run worked out on paper, before it
runs, is planner.py's question.
"""

import time
from collections import defaultdict

import torch

import gradients
import model as gpt
from gradients import GradSync
from parallel import Grid
from shard import rank_layers
from zero import ZeroAdamW, in_backward

# Datasheet peaks, dense: 16-bit tensor cores, and fp32 without them (what a matmul in fp32 runs at unless
# TF32 is allowed, which PyTorch does not do by default; TF32 runs at half the 16-bit rate).
GPU_PEAKS = {"H200": (989e12, 67e12), "H100": (989e12, 67e12), "A100": (312e12, 19.5e12),
             "L40S": (362e12, 91.6e12), "A10": (125e12, 31.2e12), "4090": (165e12, 82.6e12),
             "3090": (71e12, 35.6e12), "V100": (125e12, 15.7e12), "T4": (65e12, 8.1e12)}


def peak_flops(device: torch.device, precision: str) -> float:
    """Peak dense FLOP/s, the denominator of MFU: the datasheet's for a GPU in the precision the matmuls
    really run in; a measured fp32 matmul rate on CPU."""
    if device.type == "cuda":
        half, single = GPU_PEAKS[_peak_row(device) or "A100"]
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
    return (f"note: {torch.cuda.get_device_name(device)} is not in formulas.GPU_PEAKS, so MFU is measured "
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


def peak_memory(fn, device: torch.device) -> int:
    """The most bytes the allocator held at once while fn() ran, above what it held before: CUDA's
    peak statistics, or on a CPU the running sum of the profiler's allocation and free events."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


# ----------------------------------------------------------------------------- measured against the papers


def expected_traffic(cfg: gpt.GPTConfig, grid: Grid, micro_batch: int, n_micro: int, seq_len: int,
                     sync: GradSync | None, model: torch.nn.Module) -> dict:
    """Bytes this rank's collectives should move in one fp32 training step, by (op, group), from
    the formulas: Megatron's 2 all-reduces forward + 2 backward per layer of B*T*C activations
    (all-gather + reduce-scatter of the same volume under --sp), one activation send per
    micro-batch each way between pipeline stages (interleaved: one per chunk, p v - 1 boundaries
    in all instead of p - 1), and the data-parallel gradient volume. Under
    --recompute full the backward runs each block's forward again, collectives included (Megatron's
    full recomputation costs 2 more all-reduces per layer); the selective kind recomputes only the
    attention core, which communicates nothing, except under context parallelism (context_traffic).
    A context-parallel rank holds seq_len / cp tokens of every activation."""
    e, sp = defaultdict(int), grid.sp
    first, last = grid.first_stage, grid.last_stage
    layers = sum(len(chunk) for chunk in rank_layers(cfg.n_layer, grid.pp, grid.vp, grid.pp_rank))
    seq_len //= grid.cp
    btc, bt = micro_batch * seq_len * cfg.n_embd * 4, micro_batch * seq_len * 4
    if grid.tp > 1:
        per_micro = defaultdict(int)
        again = 2 * layers * btc if cfg.recompute == "full" else 0  # the backward re-runs the forward's pairs
        if sp:
            per_micro[("all_gather", "tp")] += 4 * layers * btc + again + (btc if first else 0) + (btc if last else 0)
            per_micro[("reduce_scatter", "tp")] += 4 * layers * btc + again + (btc if last else 0)
        else:
            per_micro[("all_reduce", "tp")] += 4 * layers * btc + again + (btc if last else 0)
        per_micro[("all_reduce", "tp")] += (btc if first else 0) + (3 * bt if last else 0)
        for k, v in per_micro.items():
            e[k] += n_micro * v
        if sp:  # LayerNorm and row-parallel bias gradients (under ZeRO, this rank's pieces), once per step
            partial = (g.numel() for g in gradients.sequence_parallel_grads(model, sync)) if sync and sync.zero \
                else (p.numel() for p in model.parameters() if getattr(p, "sequence_parallel", False))
            e[("all_reduce", "tp")] += 4 * sum(partial)
    if grid.pp > 1:
        act = btc // grid.tp if sp else btc
        # every chunk sends its output on and its input's gradient back, except at the two ends
        e[("send", "pp")] += n_micro * act * (2 * grid.vp - last - first)
        if first or last:
            e[("all_reduce", "embed")] += 4 * (gradients.tied_grad(model, grid, sync).numel() if sync and sync.zero
                                               else cfg.padded_vocab // grid.tp * cfg.n_embd)
    if grid.cp > 1:
        for k, v in context_traffic(grid, layers * btc // grid.tp, cfg.recompute).items():
            e[k] += n_micro * v
    if sync is not None and grid.dp_cp > 1:
        e.update(zero_traffic(sync, n_micro, next(model.parameters()).element_size()))
    for group in ("tp", "pp") + (("dp_cp",) if sync is not None and sync.zero else ()):
        if grid.size(group) > 1:
            e[("all_reduce", group)] += 4  # the squared gradient norm
    for group in ("pp", "dp_cp"):
        if grid.size(group) > 1:
            e[("all_reduce", group)] += 4  # the loss, for logging and the guards
    return {(op, grid.label(group)): v for (op, group), v in e.items()}


def context_traffic(grid: Grid, act: int, recompute: str) -> dict:
    """Bytes one micro-batch's context-parallel attention sends from this rank, `act` being the bytes of
    one (b, s/cp, h/tp) activation summed over this stage's layers (context.py's docstring):
        ring     forward: cp-1 hops of K and V (2 act each); backward: cp-1 hops of K and V, and cp hops
                 of dK and dV (fp32, the last one home)
        ulysses  forward: an all-to-all of q, k, v (3 act) and one of the output (act); backward the same
    Recomputation (either kind) runs the attention core's forward once more in the backward."""
    again = recompute != "none"
    if grid.cp_attn == "ulysses":
        return {("all_to_all", "cp"): (2 + again) * 4 * act}
    hops = grid.cp - 1
    return {("send", "cp"): (1 + again) * hops * 2 * act + (hops + grid.cp) * 2 * act}


def zero_traffic(sync: GradSync, n_micro: int, weight_bytes: int) -> dict:
    """The data-parallel bytes of one step (over the dp x cp ranks), by ZeRO stage, for Ψ parameters in
    fp32 gradient buckets (padded to dp shards under ZeRO) and weights of `weight_bytes` each:
        0  all-reduce 4Ψ, once per step
        1  reduce-scatter 4Ψ once, all-gather the new weights once: the same ring bytes as stage 0
        2  reduce-scatter 4Ψ every micro-batch (nothing is held whole), all-gather once
        3  reduce-scatter 4Ψ, and all-gather the weights twice (forward, backward), every micro-batch:
           with one micro-batch and 4-byte weights 12Ψ against stage 0's 8Ψ, ZeRO's 1.5x"""
    if not sync.zero:
        return {("all_reduce", "dp_cp"): 4 * sum(b.numel for b in sync.buckets)}
    padded = sum(b.padded for b in sync.buckets)
    reduces = 1 if sync.zero == 1 else n_micro
    gathers = 2 * n_micro if sync.zero == 3 else 1
    return {("reduce_scatter", "dp_cp"): reduces * 4 * padded, ("all_gather", "dp_cp"): gathers * weight_bytes * padded}


def comm_report(grid: Grid, expected: dict) -> str:
    """Measured bytes per (collective, group) next to the formula, and what a ring algorithm puts
    on each rank's link: 2(n-1)/n of the buffer for an all-reduce, (n-1)/n for the others."""
    cp = f"cp {grid.cp_rank}, " if grid.cp > 1 else ""
    lines = [f"communication of one training step on rank {grid.rank} (dp {grid.dp_rank}, {cp}tp {grid.tp_rank}, "
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
    """When each bucket's collective was launched, relative to the end of this rank's backward. (How long
    it then took, and how much of that was waiting for another rank's backward, is what --print-timeline
    shows: one number measured on one rank cannot tell the two apart.)"""
    events = sync.last_events
    done = next(t for what, _, t in events if what == "backward done")
    launches = [(i, t) for what, i, t in events if what == "launch"]
    early = sum(1 for _, t in launches if t < done)
    host = " (host time: on a GPU, when issued; --print-timeline has the device's)" \
        if sync.grid.device.type == "cuda" else ""
    lines = [f"gradient buckets: {len(sync.buckets)}; launched before the backward finished: {early}{host}"]
    for i, t in launches:
        lines.append(f"  bucket {i}: launched {1e3 * (t - done):+8.2f} ms from the end of the backward")
    return "\n".join(lines)


def zero_memory_report(opt, model: torch.nn.Module, grid: Grid) -> str:
    """Optimizer state on this rank against the ZeRO paper's K = 12 bytes per parameter / dp."""
    n = sum(p.numel() for p in model.parameters())
    measured = opt.memory_bytes() if isinstance(opt, ZeroAdamW) else 8 * n  # torch AdamW: two fp32 moments
    formula = (12 if isinstance(opt, ZeroAdamW) else 8) * n / (grid.dp_cp if isinstance(opt, ZeroAdamW) else 1)
    return (f"optimizer state on rank {grid.rank}: {measured:,} bytes for {n:,} local parameters; "
            f"formula {('12 N / dp' + (' cp' if grid.cp > 1 else '')) if isinstance(opt, ZeroAdamW) else '8 N'} "
            f"= {formula:,.0f} "
            f"(padding {measured - formula:,.0f} bytes)")


# ----------------------------------------------------------------------------- memory, measured and predicted


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen = {}
    for t in tensors:
        if t is not None and t.untyped_storage().nbytes() > t.element_size():  # not a ZeRO-3 placeholder
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def state_memory(model: torch.nn.Module, opt, sync: GradSync | None) -> dict[str, int]:
    """Measured: the bytes of the buffers that hold this rank's weights, gradients and optimizer state
    (taken after the gradients are reduced, before the update)."""
    zero = sync.zero if sync is not None else 0
    weights = [b.param_shard for b in sync.buckets] if zero == 3 else list(model.parameters())
    if zero >= 2:
        grads = [b.shard_grad for b in sync.buckets]
    elif sync is not None:
        grads = [b.main_grad for b in sync.buckets]
    else:
        grads = [p.grad for p in model.parameters()]
    if isinstance(opt, ZeroAdamW):
        state = [st[k] for st in opt.shards for k in ("master", "exp_avg", "exp_avg_sq")]
    else:
        state = [st[k] for st in opt.state.values() for k in ("exp_avg", "exp_avg_sq") if k in st]
    return {"weights": storage_bytes(weights), "gradients": storage_bytes(grads), "optimizer": storage_bytes(state)}


def state_formula(model: torch.nn.Module, opt, sync: GradSync | None, grid: Grid) -> dict[str, tuple[float, str]]:
    """ZeRO's formulas (section 5, figure 1) in this codebase's bytes: weights of P bytes (the
    parameter dtype), fp32 gradients (4; without data parallelism, p.grad in the weights' dtype) and
    K = 12 bytes of optimizer state (fp32 master, exp_avg, exp_avg_sq; torch's AdamW on fp32 weights
    keeps only the moments, K = 2P). Ψ is this rank's parameters (tensor/pipeline parallelism already
    divided them), padded to N equal shards under ZeRO; N = dp (times cp: context-parallel ranks hold
    replicas too)."""
    zero, n = (sync.zero if sync is not None else 0), grid.dp_cp
    P = next(model.parameters()).element_size()
    psi = sum(b.padded for b in sync.buckets) if zero else sum(p.numel() for p in model.parameters())
    G = 4 if sync is not None else P
    K = 12 if isinstance(opt, ZeroAdamW) else 2 * P

    def term(bytes_, sharded):
        return (bytes_ * psi / (n if sharded else 1), f"{bytes_}Ψ" + ("/N" if sharded else ""))

    return {"weights": term(P, zero >= 3), "gradients": term(G, zero >= 2), "optimizer": term(K, zero >= 1)}


def activation_bytes(seq_len: int, micro_batch: int, d_model: int, n_head: int, tp: int = 1, sp: bool = False,
                     recompute: str = "none", attn: str = "flash", act_bytes: int = 2, mask_bytes: int = 1,
                     dropout: float = 0.0, norm_bytes: int | None = None) -> float:
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
          (CUDA's fused dropout keeps a 1-byte mask; the CPU's keeps it in the activations' dtype)
    So in bf16 with a flash kernel and no dropout, 32 s b h bytes (16 elements), whatever the
    sequence length. A LayerNorm keeps its input in the residual stream's dtype, which is the
    parameters' (fp32 unless ZeRO keeps them in 16 bits: the embedding starts the stream), and on CUDA
    always in fp32, where autocast runs layer_norm in fp32 and it keeps the fp32 copy it was given:
    `norm_bytes` (default `act_bytes`). `recompute`:
        none       all of the above
        selective  drops the probabilities (and the kernels' logsumexp): with a flash kernel that is
                   all it can drop, so it saves nothing here but costs nearly nothing either
        full       keeps the block input alone: s b h (/t under SP), a factor of 16 on the flash path
                   (and in the backward one layer at a time is rebuilt whole: plan() adds that one)
    Korthikanti et al.'s accounting (korthikanti_bytes) differs in two places: it stores the s x s
    matrix three times over (5 a s / h: probabilities, dropout mask, dropped probabilities), which no
    flash kernel keeps; and under SP Megatron-LM keeps the column-parallel inputs sequence-sharded and
    all-gathers them again in the backward, 2 s b h (1 - 1/t) less than here (not done here). What
    LayerNorm and the kernels keep per row (mean, rstd, logsumexp: (4 + a/t) s b floats) is under 1%
    at these widths and is left out."""
    s, b, h, a, t = seq_len, micro_batch, d_model, n_head, tp
    replicated = s * b * h / t if sp else s * b * h  # what tensor parallelism alone does not split
    if recompute == "full":
        return replicated * act_bytes
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


def activation_formula(cfg: gpt.GPTConfig, seq_len: int, micro_batch: int, tp: int, sp: bool, recompute: str,
                       attn: str, act_bytes: int, mask_bytes: int = 1,
                       norm_bytes: int | None = None) -> tuple[float, float]:
    """(activation_bytes, korthikanti_bytes) of one layer of the model `cfg` describes, per micro-batch."""
    ours = activation_bytes(seq_len, micro_batch, cfg.n_embd, cfg.n_head, tp, sp, recompute, attn, act_bytes,
                            mask_bytes, cfg.dropout, norm_bytes)
    return ours, korthikanti_bytes(seq_len, micro_batch, cfg.n_embd, cfg.n_head, tp, sp, recompute)


class SavedActivations:
    """Counts, on any device, the bytes autograd saves for the backward during the first forward of
    this rank's blocks: every tensor packed while a block runs, plus a block's input wherever it is
    saved (--recompute full saves it outside the block). Weights are not activations (their storage
    is a parameter's), nor are autocast's copies of them in the compute dtype (cached for the whole
    step, so weight memory: `weight_copy`); views of one buffer count once. On a GPU, `allocated` is the
    allocator's view of the same span: the bytes still held after the blocks' forward that were not held
    before it."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.blocks, self.device = list(model.transformer.h.children()), device  # (a stage holds a ModuleDict)
        self.calls, self.inside, self.counting = 0, False, False
        self.saved, self.inputs, self.weights = {}, set(), set()  # storage -> bytes; storages of inputs, weights
        self.allocated = None
        self.handles = [b.register_forward_pre_hook(self._enter) for b in self.blocks]
        self.handles += [b.register_forward_hook(self._leave) for b in self.blocks]
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)
        for h in self.handles:
            h.remove()

    def _enter(self, module, args):
        self.calls += 1  # (pack hooks run with grad mode off: decide here whether this forward counts)
        self.counting = self.calls <= len(self.blocks) and not in_backward()  # (--recompute full: no_grad here)
        if self.counting:
            self.inside = True
            self.inputs.add(args[0].untyped_storage().data_ptr())
            # by storage object, not address: ZeRO-3 frees a block's weights after its forward, and the
            # next activations may be allocated at the address they had
            self.weights |= {p.untyped_storage()._cdata for p in module.parameters()}
            if self.calls == 1 and self.device.type == "cuda":
                self.allocated = -torch.cuda.memory_allocated(self.device)

    def _leave(self, module, args, out):
        self.inside = False
        if self.calls == len(self.blocks) and self.counting:  # the first forward's last block is done
            # with grad mode on, nothing after it is a block's; under --recompute full (grad mode off in
            # here) the last block's input is saved only once its Recompute returns: count that one too
            self.counting = not torch.is_grad_enabled()
            if self.device.type == "cuda" and self.allocated is not None:
                self.allocated += torch.cuda.memory_allocated(self.device)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if self.counting and not in_backward() and (self.inside or ptr in self.inputs):
            if t.untyped_storage()._cdata not in self.weights and not weight_copy(t):
                self.saved[ptr] = t.untyped_storage().nbytes()
        if not self.inside and self.calls >= len(self.blocks):
            self.counting = False  # past the blocks: a freed input's address may be reused from here on
        return t

    @property
    def per_layer(self) -> float:
        return sum(self.saved.values()) / len(self.blocks)


def weight_copy(t: torch.Tensor) -> bool:
    """Is t a parameter seen through casts and views only (autocast's bf16 copy of a weight, its
    transpose)? Followed down its autograd graph while each step has a single input."""
    fn = t.grad_fn
    for _ in range(4):
        if fn is None or hasattr(fn, "variable"):  # a leaf's AccumulateGrad holds the leaf
            return fn is not None and isinstance(fn.variable, torch.nn.Parameter)
        inputs = [f for f, _ in fn.next_functions if f is not None]
        if len(inputs) != 1:
            return False
        fn = inputs[0]
    return False


def memory_report(state: dict[str, int], formula: dict, acts: SavedActivations, predicted: tuple[float, float],
                  grid: Grid, zero: int, recompute: str) -> str:
    """This rank's memory, measured next to the formulas; one block per rank."""
    cp = f"cp {grid.cp_rank}, " if grid.cp > 1 else ""
    n = f"N = dp x cp = {grid.dp_cp}" if grid.cp > 1 else f"N = dp = {grid.dp}"
    lines = [f"memory on rank {grid.rank} (dp {grid.dp_rank}, {cp}tp {grid.tp_rank}, pp {grid.pp_rank}), "
             f"ZeRO stage {zero}, {n}:",
             f"  {'':<12}{'measured bytes':>16}{'formula':>16}  {'':<10}match"]
    for kind, measured in state.items():
        value, text = formula[kind]
        lines.append(f"  {kind:<12}{measured:>16,}{value:>16,.0f}  {text:<10}{'yes' if measured == value else 'NO'}")
    ours, paper = predicted
    lines.append(f"  activations saved per layer and micro-batch (--recompute {recompute}): measured "
                 f"{acts.per_layer:,.0f}, formula {ours:,.0f} ({acts.per_layer / ours:.1%}); Korthikanti et al. "
                 f"(16-bit, dropout masks) {paper:,.0f}")
    if acts.allocated is not None:
        lines.append(f"  allocator: {acts.allocated:,} bytes more held after the blocks' forward than before it")
    lines.append("  ZeRO paper (16-bit weights and gradients, K = 12): 2Ψ+2Ψ+12Ψ (no ZeRO), 2Ψ+2Ψ+12Ψ/N (1), "
                 "2Ψ+(2Ψ+12Ψ)/N (2), (2Ψ+2Ψ+12Ψ)/N (3)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the pipeline's bubble

BUBBLE_WARNING = 0.3  # train.py warns when the pipeline would idle more than this share of a step


def pipeline_warning(pp: int, m: int, vp: int = 1) -> str | None:
    """The line train.py logs when a pipeline would idle more than BUBBLE_WARNING of each step:
    (p-1)/(vp m + p-1) above 30%, i.e. fewer than about 2.3 (p-1)/vp micro-batches. m >= 4 p, the
    rule of thumb of lessons 09 and 10, keeps it under 20%."""
    bubble = (pp - 1) / (vp * m + pp - 1)
    if pp == 1 or bubble <= BUBBLE_WARNING:
        return None
    formula = "(p-1)/(v*m+p-1)" if vp > 1 else "(p-1)/(m+p-1)"
    return (f"warning: {m} micro-batches for {pp} stages: the pipeline idles {bubble:.0%} of each step "
            f"(bubble {formula}, over {BUBBLE_WARNING:.0%}); use more micro-batches (a smaller "
            "--micro-batch-size or a larger --batch-size)")


def traffic_matches(grid: Grid, expected: dict) -> bool:
    """Did every collective on every rank move exactly the bytes of the formula? (A collective: every
    rank must call it.)"""
    counts = grid.traffic.counts
    wrong = sum(counts.get(k, [0, 0])[1] != v for k, v in expected.items()) + sum(k not in expected for k in counts)
    flag = torch.tensor(float(wrong), device=grid.device)
    grid.all_reduce(flag, "world")
    return flag.item() == 0
