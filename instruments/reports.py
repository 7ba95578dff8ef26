"""What a run says about itself beside its progress bar, and how it measures what it says.

    Reports   on a resume, the flags that changed and what each change does; after the first step, what
              the flags ask for: --comm-report (the bytes every collective
              moved, next to formulas.py's), --memory-report (weights, gradients, optimizer state and
              saved activations, next to ZeRO's and the activation model), --print-schedule (the
              pipeline's ops on a clock); after the second, --print-timeline's picture of one step
              (timeline.py); at the end, the line on what checkpoints cost the loop
    MFU       the bar's and metrics.jsonl's mfu: tokens/s x 6N + 12LHQT FLOPs per token (PaLM,
              appendix B) over the hardware's peak (planner.peak_flops), never below a rate a step
              reached (a CPU's, measured at start, is measured again: at most 100%; metrics.jsonl's
              `mfu peak` event says so)

Both are Observers (support/observer.py): train.py's main attaches them (observers.py). Every rank takes part
where numbers are gathered; rank 0 prints. `run` is train.py's Run: the model, the grid, the optimizer.
How memory is measured (SavedActivations: the bytes autograd saves; peak_memory: the allocator's most)
is here too, for the reports and for the tests that hold the formulas to it.
"""

import json
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from statistics import median

import torch
from tqdm import tqdm

import config
import model as gpt
import pipeline
import stability
from gradients import GradSync
from instruments import formulas, planner
from instruments import timeline as timeline_module
from instruments.timeline import Timeline
from model import in_backward
from parallel import Grid
from support import storage, writer
from support.observer import Observer
from zero import ParamGather, ZeroAdamW


class Reports(Observer):
    """The reports of a run, at the points they report on. The first step of this process (the one that
    allocates, compiles and warms up, and whose bytes --comm-report compares) is the one measured."""

    def __init__(self, run, timeline: Timeline | None = None):
        self.run, self.timeline = run, timeline
        self.first, self.memory, self.saves = True, None, []
        self.gradient_events, self.gather_events = [], []  # (what, index, seconds) of the first step

    def gradient_event(self, what: str, bucket: int) -> None:
        if self.first:
            self.gradient_events.append((what, bucket, time.perf_counter()))

    def gather_event(self, what: str, unit: int) -> None:
        if self.first:
            self.gather_events.append((what, unit, time.perf_counter()))

    def resumed(self, manifest: dict) -> None:
        for line in resume_changes(self.run, manifest["meta"].get("config", {}), manifest["layout"]):
            self.run.log(line)

    def step_begin(self, step: int) -> None:
        self.gradient_events, self.gather_events = [], []  # (again, if a spike rolled the first one back)
        if self.first and self.run.cfg.memory_report:  # (again, if a spike rolled the first one back)
            self.memory = {"activations": SavedActivations(self.run.model, self.run.device).__enter__()}

    def after_update(self, updated: bool) -> None:
        if self.memory is not None and "state" not in self.memory:  # reduced gradients, optimizer state made
            self.memory["activations"].__exit__(None, None, None)
            self.memory["state"] = state_memory(self.run.model, self.run.opt, self.run.sync)

    def step_end(self, row: dict) -> None:
        texts = first_step_reports(self.run, self.memory, self.gradient_events, self.gather_events) \
            if self.first else []
        self.first = False
        if self.timeline is not None and row["step"] == self.timeline.step:
            texts.append(timeline_report(self.run, self.timeline))
        for text in texts:
            if text and self.run.grid.is_logger:
                tqdm.write(text)  # through the bar, which clears itself first

    def saved(self, record: dict) -> None:
        self.saves.append(record)

    def run_end(self, status: str) -> None:
        if status != "failed" and self.saves and self.run.grid.is_logger:
            print(saves_summary(self.saves))


class MFU(Observer):
    """Model FLOPs utilization: the FLOPs a step needs (gpt.flops_per_token) at the tokens/s it ran, over
    the peak of every device of the run."""

    def __init__(self, run):
        self.flops_per_token = gpt.flops_per_token(run.model_cfg, run.cfg.seq_len)
        share = gpt.fp8_flop_share(run.model_cfg, run.cfg.seq_len) if run.precision.fp8 else 0.0
        self.peak = planner.peak_flops(run.device, run.cfg.precision, share) * run.grid.world
        self.run, self.said = run, False
        if note := planner.unknown_gpu(run.device):
            run.log(note)

    def step_end(self, row: dict) -> None:
        rate = row["tokens_per_sec"] * self.flops_per_token
        if rate > self.peak:
            self.raise_peak(rate, row["step"])
        row["mfu"] = rate / self.peak

    def raise_peak(self, rate: float, step: int) -> None:
        """A step ran faster than the peak, so the peak was wrong. A CPU's is measured, by a short burst of
        matmuls at start, which a busy moment on a shared machine slows: measure it again (once). A GPU's
        comes from its row of the table. Either way the peak never stays below a rate a step reached (MFU is
        at most 100%), and metrics.jsonl says so once, in an `mfu peak` event (not the console: how busy the
        machine was at start is no part of what a run prints, which the lessons hold to their pages)."""
        old, cpu = self.peak, self.run.device.type == "cpu"
        if cpu and not self.said:
            self.peak = planner.measured_matmul_flops() * self.run.grid.world
        self.peak = max(self.peak, rate)
        if not self.said:
            self.said = True
            why = "measured at start while this CPU was busy; re-measured" if cpu else \
                "this GPU's row of planner.GPU_PEAKS; MFU is against the fastest step's rate from here"
            self.run.metrics.log(event="mfu peak", step=step, rate=rate, was=old, now=self.peak, why=why)


# Every flag of train.py is in one of the lists below (tests/test_faults.py holds config.TrainConfig to them, so
# that a new flag is classified, not forgotten). Flags that may change when a run resumes, and what the change
# does, said in one line each:
SCHEDULE = ("lr", "min_lr", "warmup_steps", "max_steps")
UPDATE = ("weight_decay", "clip", "dropout", "loss_scale_window", "max_bad_steps", "max_rollbacks", "spike_z",
          "spike_window", "moe_aux_loss", "moe_z_loss")
LAYOUT = ("tp", "pp", "sp", "cp", "cp_attn", "ep", "zero", "zero_shard", "hpz", "gpus_per_node", "micro_batch_size",
          "pp_schedule", "virtual_stages")
KERNELS = ("attn", "compile", "device", "recompute", "bucket_mb", "no_overlap")
QUANTIZED = ("qwz", "qgz", "quant_block")  # ZeRO++ rounds what it sends to int8 / int4: the math changes
# Flags a checkpoint fixes (train.checkpoint_meta: the model, the tokenizer, the data, the batch, the seed, the
# precision): a change is refused, so there is nothing to say.
FIXED = ("data", "tokenizer", "preset", "arch", "n_kv_head", "rope_theta", "tie_embeddings", "n_layer", "block_size",
         "seq_len", "moe_experts", "moe_top_k", "moe_every", "moe_capacity_factor", "batch_size", "seed", "precision",
         "fp8_recipe", "fp8_amax_history")
# Flags without effect on the math of a step: paths, reporting, checkpoint cadence, fault injection; the starting
# weights (a resume starts from its checkpoint's); the data's and the loss scale's changes have lines of their own
# (checkpoint.data_changes, below).
UNSAID = ("cache_dir", "init_from", "out", "fresh", "new_data", "ckpt_every", "keep", "async_ckpt", "timeout",
          "mem_ckpt_every", "mem_ckpt_dir",
          "eval_every", "eval_batches", "sample_tokens", "stats_every", "print_grid", "print_schedule",
          "print_timeline", "comm_report", "memory_report", "crash_at", "poison_step", "loss_scale")


def resume_changes(run, saved: dict, saved_layout: dict) -> list[str]:
    """One line per flag that differs from the checkpoint's run (its config `saved`, its layout
    `saved_layout`), with what the difference does."""
    cfg, now, lines = run.cfg, asdict(run.cfg), []
    old = config.TrainConfig(**{k: v for k, v in saved.items() if k in now})
    quantized = any(conf.get(q) for conf in (saved, now) for q in ("qwz", "qgz"))
    for name in SCHEDULE + UPDATE + LAYOUT + KERNELS + QUANTIZED:
        if name not in saved or saved[name] == now[name] or name == "quant_block" and not quantized:
            continue
        change = f"resume: --{name.replace('_', '-')} {saved[name]} -> {now[name]}: "
        if name in SCHEDULE:
            now_lr, old_lr = stability.lr_at(run.step, cfg), stability.lr_at(run.step, old)
            effect = (f"the learning-rate schedule changes; step {run.step + 1} trains at {now_lr:.3g} "
                      f"instead of {old_lr:.3g}")
        elif name in UPDATE:
            effect = "the updates from here on differ from the original run's"
        elif name in LAYOUT:
            effect = "a layout change: the same math, dropout's masks included"
        elif name in QUANTIZED:
            effect = "ZeRO++'s quantization changes the math: the updates from here on differ from the original run's"
        else:
            effect = "the same math up to floating-point rounding"
        lines.append(change + effect)
    if saved_layout != writer.layout_of(run.grid):
        lines.append(f"resume: layout {saved_layout} -> {writer.layout_of(run.grid)}: the same math, dropout's "
                     "masks included")
    if run.scaler.enabled and saved.get("loss_scale") != cfg.loss_scale:
        lines.append(f"resume: --loss-scale {cfg.loss_scale:g} is not used: the checkpoint's loss scale "
                     f"{run.scaler.scale:g} continues")
    return lines


def saves_summary(saves: list[dict]) -> str:
    """One line on what checkpoints cost: --async-ckpt exists so that this is a small share of a step."""
    blocking, step = median([s["blocking_s"] for s in saves]), median([s["step_s"] for s in saves])
    return (f"checkpoints: {len(saves)} saved, {median([s['bytes'] for s in saves]) / 1e6:.1f} MB each from rank 0, "
            f"complete after {median([s['write_s'] for s in saves]):.2f} s; the training loop paid "
            f"{1e3 * blocking:.1f} ms a save ({blocking / step:.0%} of a {1e3 * step:.0f} ms step; medians)")


def first_step_reports(run, memory: dict | None, gradient_events: list, gather_events: list) -> list[str]:
    """--comm-report and --print-schedule: what the first step moved and how the pipeline ran (the events:
    when buckets launched and ZeRO-3 units moved, as the Observer heard them). Every rank takes part (the
    numbers are gathered); rank 0 gets the text."""
    cfg, grid, out = run.cfg, run.grid, []
    if cfg.comm_report:
        expected = formulas.expected_traffic(run.model_cfg, grid, cfg.micro_batch_size,
                                             cfg.batch_size // grid.dp // cfg.micro_batch_size, cfg.seq_len,
                                             run.sync, run.model, cfg.fp8_recipe if run.precision.fp8 else None,
                                             run.gather, run.precision.compute)
        text = comm_report(grid, expected)
        matches = traffic_matches(grid, expected)
        out.append(text + f"\nformula matches measurement on every rank: {'yes' if matches else 'NO'}"
                   + ("" if run.precision.compute is None else " (the formula assumes fp32 activations)"))
        if run.sync is not None:
            out.append(overlap_report(run.sync, gradient_events))
        if run.gather is not None:
            out.append(prefetch_report(run.gather, gather_events))
        out.append(zero_memory_report(run.opt, run.model, grid))
    if cfg.memory_report:
        out.append(memory_report(run, memory))
    if cfg.print_schedule and run.pipe:
        out.append(schedule_report(run))
    return out if grid.is_logger else []


def timeline_report(run, timeline: Timeline) -> str:
    """--print-timeline: every rank's compute spans and collectives of the recorded step, drawn on one
    time axis by rank 0 (timeline.py), and saved to --out/timeline.json."""
    ranks = run.grid.gather_objects(timeline.stop())  # once, after the step
    if not run.grid.is_logger:
        return ""
    record = {"step": timeline.step, "ranks": ranks}
    storage.replace_atomically(Path(run.cfg.out) / "timeline.json", json.dumps(record))
    return f"step {timeline.step}: " + timeline_module.draw(ranks)


def schedule_report(run) -> str:
    """--print-schedule: the ops every stage ran, on a clock, with the bubble they leave next to the
    paper's, and the most activations each stage held (interleaved: of one chunk, 1/v of a stage's)."""
    cfg, grid = run.cfg, run.grid
    mine = ([pipeline.op_parts(op) for op in run.pipe.ops_run], run.pipe.peak_live)
    every = grid.gather_objects(mine)  # every rank's, once, after the step: this pipeline's stages below
    ops, peaks = map(list, zip(*(every[grid.stage_rank(s)] for s in range(grid.pp))))
    m = cfg.batch_size // grid.dp // cfg.micro_batch_size
    chunks = f" of {grid.vp} chunks each (a, b, ...: chunk 0, 1, ...)" if grid.vp > 1 else ""
    held = "(micro-batch, chunk) activations" if grid.vp > 1 else "micro-batches of activations"
    return (f"pipeline schedule {cfg.pp_schedule}, {grid.pp} stages{chunks}, {m} micro-batches:\n"
            + pipeline.draw_schedule(ops) + f"\n{held} held at once, by stage: "
            + ", ".join(f"{s}: {int(n)}" for s, n in enumerate(peaks)))


def memory_report(run, memory: dict) -> str:
    """--memory-report: this rank's memory, measured (`memory`: what the first step's state and
    SavedActivations found) next to the ZeRO and activation formulas; every rank's, gathered to rank 0."""
    cfg, grid = run.cfg, run.grid
    if run.gather is not None and not run.gather.all_free():
        raise RuntimeError("ZeRO-3 left weights gathered after the step")  # a leak the report would hide
    elem = (stability.PRECISIONS[cfg.precision].compute or torch.float32).itemsize
    cuda = run.device.type == "cuda"
    residual = next(run.model.parameters()).dtype.itemsize  # the stream the LayerNorms read (activation_bytes)
    ours, paper = formulas.activation_formula(run.model_cfg, cfg.seq_len // grid.cp, cfg.micro_batch_size, grid.tp,
                                              grid.sp, cfg.recompute, cfg.attn, elem, 1,
                                              4 if cuda else residual, fused_norm=cuda, residual_bytes=residual)
    formula, acts = formulas.state_formula(run.model, run.opt, run.sync, grid), memory["activations"]
    cp = (f"cp {grid.cp_rank}, " if grid.cp > 1 else "") + (f"ep {grid.ep_rank}, " if grid.ep > 1 else "")
    n = f"N = dp x cp = {grid.dp_cp}" if grid.cp > 1 else f"N = dp = {grid.dp}"
    if grid.zs < grid.dp_cp:  # hybrid ZeRO: the state is sharded over a shard group
        n = f"N = zs = {grid.zs} (shard groups of --zero-shard ranks)"
    lines = [f"memory on rank {grid.rank} (dp {grid.dp_rank}, {cp}tp {grid.tp_rank}, pp {grid.pp_rank}), "
             f"ZeRO stage {cfg.zero}, {n}:",
             f"  {'':<12}{'measured bytes':>16}{'formula':>16}  {'':<10}match"]
    for kind, measured in memory["state"].items():
        value, text = formula[kind]
        lines.append(f"  {kind:<12}{measured:>16,}{value:>16,.0f}  {text:<10}{'yes' if measured == value else 'NO'}")
    lines.append(f"  activations saved per layer and micro-batch (--recompute {cfg.recompute}): measured "
                 f"{acts.per_layer:,.0f}, formula {ours:,.0f} ({acts.per_layer / ours:.1%})"
                 + ("" if paper is None else f"; Korthikanti et al. (16-bit, dropout masks) {paper:,.0f}")
                 + ("; the formula is a dense layer's: an MoE layer also keeps its router's tensors and k routed "
                    "copies of its rows, as many as the router keeps (not modeled)" if run.model_cfg.moe_experts
                    else ""))
    if acts.allocated is not None:
        lines.append(f"  allocator: {acts.allocated:,} bytes more held after the blocks' forward than before it")
    if run.gather is not None and run.gather.hpz:
        lines.append(hpz_memory_line(run.gather))
    if getattr(run, "memory", None) is not None:  # --mem-ckpt-every: host memory, not the device's
        lines.append("  " + run.memory.describe())
    lines.append("  ZeRO paper (16-bit weights and gradients, K = 12): 2Ψ+2Ψ+12Ψ (no ZeRO), 2Ψ+2Ψ+12Ψ/N (1), "
                 "2Ψ+(2Ψ+12Ψ)/N (2), (2Ψ+2Ψ+12Ψ)/N (3)")
    return "\n".join(grid.gather_objects("\n".join(lines)))  # text, once, after the step


def hpz_memory_line(gather: ParamGather) -> str:
    """hpZ's price: every block's weights over the node's L ranks, held from a block's forward to its
    backward (at the end of the forward, all of them), beside ZeRO-3's own shard of them over N."""
    units = [gather.units[j] for part in gather.parts[1:] for j in part]
    blocks = sum(u.bucket.padded * u.buffer.element_size() for u in units)
    L, N = gather.grid.node_dp, gather.grid.size(units[0].bucket.group)
    return (f"  hpZ second copy of the blocks' weights: measured peak {gather.secondary_peak:,} bytes, formula "
            f"weights / L = {blocks // L:,} (L = {L} ranks a node; ZeRO-3's own shard, weights / N: {blocks // N:,}) "
            f"{'yes' if gather.secondary_peak == blocks // L else 'NO'}")


# ----------------------------------------------------------------------------- traffic


def comm_report(grid: Grid, expected: dict) -> str:
    """Measured bytes per (collective, group) next to the formula, and what a ring algorithm puts
    on each rank's link: 2(n-1)/n of the buffer for an all-reduce, (n-1)/n for the others."""
    cp = (f"cp {grid.cp_rank}, " if grid.cp > 1 else "") + (f"ep {grid.ep_rank}, " if grid.ep > 1 else "")
    nodes = bool(grid.gpus_per_node)  # --gpus-per-node: which link each group's bytes travel on
    lines = [f"communication of one training step on rank {grid.rank} (dp {grid.dp_rank}, {cp}tp {grid.tp_rank}, "
             f"pp {grid.pp_rank}):",
             f"  {'collective':<15}{'group':<7}{'calls':>6}{'measured bytes':>16}{'formula':>14}  "
             f"{'match':<6}{'ring bytes/rank':>16}" + ("  link" if nodes else "")]
    by_link = defaultdict(lambda: [0, 0])
    for key in sorted(set(grid.traffic.counts) | set(expected)):
        op, group = key
        calls, measured = grid.traffic.counts.get(key, [0, 0])
        n = grid.size(group)
        ring = measured * (2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n if op != "send" else 1)
        link = "network" if grid.crosses_nodes(group) else "node"
        by_link[link][0] += measured
        by_link[link][1] += expected.get(key, 0)
        lines.append(f"  {op:<15}{group:<7}{calls:>6}{measured:>16,}{expected.get(key, 0):>14,}  "
                     f"{'yes' if measured == expected.get(key, 0) else 'NO':<6}{ring:>16,.0f}"
                     + (f"  {link}" if nodes else ""))
    if nodes:  # a collective's bytes counted on the slowest link it uses: across nodes if any rank is elsewhere
        lines += [f"  on {link} links: {m:,} bytes measured, {f:,} by the formulas" for link, (m, f) in
                  sorted(by_link.items())]
    return "\n".join(lines)


def traffic_matches(grid: Grid, expected: dict) -> bool:
    """Did every collective on every rank move exactly the bytes of the formula? (A collective: every
    rank must call it.)"""
    counts = grid.traffic.counts
    wrong = sum(counts.get(k, [0, 0])[1] != v for k, v in expected.items()) + sum(k not in expected for k in counts)
    flag = torch.tensor(float(wrong), device=grid.device)
    grid.all_reduce(flag, "world")
    return flag.item() == 0


def overlap_report(sync: GradSync, events: list[tuple[str, int, float]]) -> str:
    """When each bucket's collective was launched, relative to the end of this rank's backward. (How long
    it then took, and how much of that was waiting for another rank's backward, is what --print-timeline
    shows: one number measured on one rank cannot tell the two apart.)"""
    done = next(t for what, _, t in events if what == "backward done")
    launches = [(i, t) for what, i, t in events if what == "launch"]
    early = sum(1 for _, t in launches if t < done)
    host = " (host time: on a GPU, when issued; --print-timeline has the device's)" \
        if sync.grid.device.type == "cuda" else ""
    lines = [f"gradient buckets: {len(sync.buckets)}; launched before the backward finished: {early}{host}"]
    for i, t in launches:
        lines.append(f"  bucket {i}: launched {1e3 * (t - done):+8.2f} ms from the end of the backward")
    return "\n".join(lines)


def prefetch_report(gather: ParamGather, events: list[tuple[str, int, float]]) -> str:
    """--comm-report under ZeRO-3, from zero.ParamGather's events of the first forward: for how many blocks
    the next unit's all-gather was launched before the block began computing and waited for only after it
    had finished (so it was in flight during the compute), and how many of those had already landed when
    waited for."""
    first = {}
    for what, i, t in events:
        first.setdefault((what.split(" ")[0], i), t)
        first.setdefault((what, i), t)
    blocks = range(1, len(gather.parts) - 1)
    spans = [i for i in blocks if first[("gather", i + 1)] < first[("compute", i)]
             and first[("free", i)] < first[("ready", i + 1)]]
    early = [i for i in spans if ("ready (landed early)", i + 1) in first
             and first[("ready (landed early)", i + 1)] == first[("ready", i + 1)]]
    return (f"ZeRO-3 prefetch: the next unit's all-gather was in flight while the block computed for "
            f"{len(spans)} of {len(blocks)} blocks; already complete when needed: {len(early)} (first forward"
            + ("; host time: on a GPU, when issued and when seen complete)" if gather.grid.device.type == "cuda"
               else ")"))


def zero_memory_report(opt, model: torch.nn.Module, grid: Grid) -> str:
    """Optimizer state on this rank against the ZeRO paper's K = 12 bytes per parameter / dp."""
    n = sum(p.numel() for p in model.parameters())
    measured = opt.memory_bytes() if isinstance(opt, ZeroAdamW) else 8 * n  # torch AdamW: two fp32 moments
    formula = (12 if isinstance(opt, ZeroAdamW) else 8) * n / (grid.zs if isinstance(opt, ZeroAdamW) else 1)
    over = "zs" if grid.zs < grid.dp_cp else "dp" + (" cp" if grid.cp > 1 else "")  # (hybrid: a shard group)
    return (f"optimizer state on rank {grid.rank}: {measured:,} bytes for {n:,} local parameters; "
            f"formula {f'12 N / {over}' if isinstance(opt, ZeroAdamW) else '8 N'} "
            f"= {formula:,.0f} "
            f"(padding {measured - formula:,.0f} bytes)")



# ----------------------------------------------------------------------------- memory, measured


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
    weights = [st["flat"] for st in opt.shards] if zero == 3 else list(model.parameters())
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


# What autograd records for a cast or a view: the only steps between a weight and its copy.
CASTS_AND_VIEWS = {"ToCopyBackward0", "TBackward0", "TransposeBackward0", "ViewBackward0", "UnsafeViewBackward0",
                   "PermuteBackward0", "ExpandBackward0", "AliasBackward0"}


def weight_copy(t: torch.Tensor) -> bool:
    """Is t a parameter seen through casts and views only (autocast's bf16 copy of a weight, its
    transpose)? Followed down its autograd graph while each step is one of those. (Not any step with a
    single input: an embedding's lookup has one too, the table, and Llama's first block reads it as it
    is, without GPT-2's added positions.)"""
    fn = t.grad_fn
    for _ in range(4):
        if fn is None or hasattr(fn, "variable"):  # a leaf's AccumulateGrad holds the leaf
            return fn is not None and isinstance(fn.variable, torch.nn.Parameter)
        inputs = [f for f, _ in fn.next_functions if f is not None]
        if len(inputs) != 1 or fn.name() not in CASTS_AND_VIEWS:
            return False
        fn = inputs[0]
    return False


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

