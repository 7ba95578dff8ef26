"""Train a GPT: the command line and the loop.

    python train.py                                   # the defaults: stdlib corpus, sized for this device
    python train.py --preset tiny --max-steps 50      # seconds on a CPU
    torchrun --nproc-per-node 4 train.py --tp 2       # 2-way tensor x 2-way data parallel

One optimizer step, whatever the layout:

    global batch (--batch-size sequences) ──▶ this data-parallel rank's rows ──▶ micro-batches
      for each micro-batch:   loss = model(x, y) / n_micro;  (loss * scale).backward()
      gradients: averaged over data-parallel ranks, unscaled, checked finite, clipped to --clip
      AdamW step with lr(step) = linear warm-up, then cosine down to --min-lr

The math of a step depends only on the global batch, the data order and the seed; --tp, --pp,
the data-parallel degree and --micro-batch-size only change how it is computed (DESIGN.md,
principle 3). The tests hold every layout to that.

Mixed precision, loss scaling, the schedule, clipping and the spike guard (lesson 02) live in
stability.py.

Checkpoints (lesson 04) are written by checkpoint.py; a run whose --out holds one resumes from
it. The loss-spike guard rolls back to the last checkpoint and skips the batch that caused it.

What a run measured goes to --out/metrics.jsonl (rundir.py): every step, and every --stats-every
steps each layer's gradient norm, update ratio and activation RMS (stats.py); dashboard.py draws it
all in --out/report.html, rewritten as the run goes. The reports a flag asks for after the first
step (--comm-report, --memory-report, --print-schedule, --print-timeline) are in reports.py.
"""

import contextlib
import os
import random
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median

# Set before torch is imported (it reads this once): on a CPU, tensors of 2 MB and more get 2 MB pages.
# A step allocates its big tensors afresh (one chunk of logits is 200 MB at `mini`), and in 4 KB pages
# each one costs the kernel ~50,000 page faults: with 2 MB pages a CPU step of `mini` runs ~10% faster
# (tests/bench.py). GPU memory is not affected.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import numpy as np
import torch
from tqdm import tqdm

import checkpoint
import cli
import config
import dashboard
import data
import formulas
import gradients
import hf
import interrupt
import model as gpt
import parallel
import pipeline
import reports
import rundir
import shard
import stability
import stats
import tokenizer
import zero

# ----------------------------------------------------------------------------- optimization


def make_optimizer(model: torch.nn.Module, cfg: config.TrainConfig, sync=None, initial=None):
    """AdamW (Loshchilov & Hutter); decay only tensors of 2+ dims: matmul weights and embeddings,
    not biases or LayerNorm gains (decaying a gain toward 0 fights the normalization). With
    --zero the same update runs on this rank's shard only (zero.ZeroAdamW; under ZeRO-3 it builds
    the shards from `initial`). Both skip an update on the device when `found_inf` is set to 1 (the
    attribute torch's fused optimizers read, as GradScaler sets it)."""
    if cfg.zero:
        return zero.ZeroAdamW(sync, cfg.lr, (0.9, 0.95), 1e-8, cfg.weight_decay,
                              stability.PRECISIONS[cfg.precision].params, initial)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    # fused: one kernel reads and writes each parameter, gradient and moment once (foreach runs ~8
    # passes over all of them); on a 2-core CPU 4.6x faster at `small`, 7% of its step
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


def compile_model(model: torch.nn.Module, grid: parallel.Grid, fullgraph: bool = False) -> None:
    """torch.compile, region by region: every block, and on one tensor-parallel rank the fused loss
    (the final LayerNorm alone is one kernel each way; torch will not compile a bare nn module). Each
    region compiles to one graph (no breaks: tests/test_gpu.py compiles them with fullgraph=True);
    the seams between them (pipeline sends, gradient hooks, the vocab-parallel loss's collectives)
    stay eager, so data-parallel buckets still start during the backward."""
    regions = list(model.transformer.h.children())
    if grid.tp == 1 and grid.last_stage:
        regions.append(model.loss)
    if grid.cp > 1:  # ring/Ulysses attention sends messages inside autograd Functions: run it eagerly,
        for block in regions[:len(model.transformer.h)]:  # between two graphs of its block
            block.attn.core.forward = torch.compiler.disable(block.attn.core.forward)
    for module in regions:
        module.compile(fullgraph=fullgraph and grid.cp == 1)


# ----------------------------------------------------------------------------- the loop


@dataclass
class Run:
    """Everything a step needs, built once by `setup`."""
    cfg: config.TrainConfig
    device: torch.device
    precision: stability.Precision
    grid: parallel.Grid
    tok: tokenizer.Tokenizer
    model_cfg: gpt.GPTConfig
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    scaler: stability.LossScaler
    loader: data.Loader
    val: list
    guard: stability.SpikeGuard
    saver: checkpoint.Saver
    run_id: str
    data_sha256: str  # the prepared data's identity (its shards' sha256), recorded in every checkpoint
    lock: rundir.Lock | None = None  # rank 0's lock on --out: held for as long as this object lives
    sync: gradients.GradSync | None = None  # data-parallel gradient averaging
    pipe: pipeline.Pipeline | None = None  # this rank's pipeline stage, when --pp > 1
    gather: zero.ParamGather | None = None  # ZeRO-3's weight gathering, when --zero 3
    memory: dict | None = None  # --memory-report: what the first step measured ("state", "activations")
    timeline_step: int = 0  # --print-timeline: the step whose compute and collectives are recorded
    layer_stats: stats.LayerStats | None = None  # per-layer statistics every --stats-every steps
    step: int = 0
    saved_step: int = -1  # the step of the newest checkpoint this run has (written or loaded)
    skip_batches: list = field(default_factory=list)  # global batch numbers the spike guard skips
    batches_drawn: int = 0
    spikes: list = field(default_factory=list)  # (step, batch) of rollbacks since the run last got past one

    @property
    def autocast(self):
        return self.precision.autocast(self.device)

    def state_dict(self) -> dict:
        """Where the run is, beyond the weights and the optimizer: what a checkpoint stores as `extra`."""
        return {"step": self.step, "scaler": self.scaler.state_dict(), "loader": self.loader.state_dict(),
                "batches_drawn": self.batches_drawn, "skip_batches": self.skip_batches,
                "guard": self.guard.history}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.scaler.load_state_dict(state["scaler"])
        self.loader.load_state_dict(state["loader"], new_data=self.cfg.new_data)
        self.batches_drawn, self.skip_batches = state["batches_drawn"], list(state["skip_batches"])
        self.guard.history = list(state["guard"])


def setup(cfg: config.TrainConfig) -> Run:
    device = config.pick_device(cfg.device)
    cfg = config.resolve_defaults(cfg, device, bf16_ok=device.type != "cuda" or torch.cuda.is_bf16_supported())
    precision = stability.PRECISIONS[cfg.precision]
    out = Path(cfg.out)
    # Every check that needs only the flags and the world size, before any process talks to another and
    # before any data: a wrong layout fails in a second on every rank alike (main prints it once).
    grid = parallel.layout(cfg.tp, cfg.pp, device, sp=cfg.sp, cp=cfg.cp, cp_attn=cfg.cp_attn, vp=cfg.virtual_stages)
    device = grid.device
    per_rank = config.check_batch(cfg, grid)
    model_cfg = config.model_config(cfg)
    config.check_size(cfg, model_cfg, grid)
    shard.check_layout(model_cfg, grid, cfg.seq_len)
    rundir.check_out(out)
    parallel.connect(grid, cfg.timeout)
    lock, run_id = claim_out(cfg, grid)
    torch.manual_seed(cfg.seed)  # dropout's stream; the same on every rank, as tensor parallelism needs
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    prepared = grid.rank0_first(lambda: data.prepare(data.DataConfig(
        source=cfg.data, tokenizer=cfg.tokenizer, cache_dir=cfg.cache_dir), verbose=grid.is_logger))
    tok = tokenizer.get_tokenizer(cfg.tokenizer, cfg.cache_dir)
    train_tokens = data.load_tokens(prepared / "train.bin", vocab_size=tok.vocab_size)
    config.resolve_steps(cfg, device, len(train_tokens), log=grid.log)
    loader = data.Loader(train_tokens, cfg.seq_len, cfg.batch_size, cfg.seed, rank=grid.dp_rank, world=grid.dp)
    val = data.eval_batches(data.load_tokens(prepared / "val.bin", vocab_size=tok.vocab_size), cfg.seq_len,
                            cfg.batch_size, cfg.eval_batches, rank=grid.dp_rank, world=grid.dp)
    if len(val) < cfg.eval_batches:
        grid.log(f"evaluation: {len(val)} batch{'es' if len(val) > 1 else ''} of {cfg.batch_size} sequences, all "
                 f"the validation split holds (--eval-batches {cfg.eval_batches} asked for more)")
    model, sync, opt, gather = build_model_and_optimizer(cfg, grid, model_cfg, device)
    stages = pipeline.executor(model, grid, cfg.pp_schedule, grad_sync=sync) if grid.pp > 1 else None
    if stages and (warning := formulas.pipeline_warning(grid.pp, per_rank // cfg.micro_batch_size, grid.vp)):
        grid.log(warning)
    scaler = stability.LossScaler(precision.loss_scaling, cfg.loss_scale, cfg.loss_scale_window)
    guard = stability.SpikeGuard(cfg.spike_z, cfg.spike_window)
    saver = checkpoint.Saver(out / "ckpt", keep=cfg.keep, asynchronous=cfg.async_ckpt, grid=grid, run=run_id,
                             timeout_s=cfg.timeout)
    n_params = gpt.n_params(model_cfg)  # all ranks' shards together, the tied wte/lm_head once
    on = device.type if grid.world == 1 else \
        f"{grid.world} {device.type} processes (dp {grid.dp} x tp {grid.tp} x pp {grid.pp} x cp {grid.cp})"
    grid.log(f"{model_cfg.n_layer}-layer model ({cfg.preset}, {n_params / 1e6:.1f}M parameters) on {on}: "
             f"{cfg.precision}, attention {cfg.attn}, compile {'on' if cfg.compile else 'off'}, "
             f"{cfg.max_steps} steps of {cfg.batch_size} x {cfg.seq_len} tokens")
    if cfg.zero and grid.dp == 1:
        grid.log(f"--zero {cfg.zero} shards nothing here: ZeRO splits state across the data-parallel ranks, and "
                 "there is 1 (launch more processes than --tp x --cp x --pp, or leave --zero out)")
    if cfg.print_grid:
        grid.log(str(grid))
    layer_stats = stats.LayerStats(model, grid, sync, opt, model_cfg.n_layer, cfg.stats_every,
                                   skip_first=cfg.comm_report or cfg.memory_report)  # their step's bytes stay exact
    data_sha256 = ", ".join(f"{s} {data.shard_sha256(prepared / f'{s}.bin')[:16]}" for s in ("train", "val"))
    return Run(cfg, device, precision, grid, tok, model_cfg, model, opt, scaler, loader, val, guard, saver, run_id,
               data_sha256, lock=lock, sync=sync, pipe=stages, gather=gather, layer_stats=layer_stats)


def build_model_and_optimizer(cfg: config.TrainConfig, grid: parallel.Grid, model_cfg: gpt.GPTConfig,
                              device: torch.device) -> tuple:
    """This rank's model, its data-parallel gradient sync, its optimizer and, under ZeRO-3, the gathering
    of its weights. ZeRO-3's parameters are built as shapes only: the optimizer draws each one's starting
    value (from (seed, name), or --init-from) and keeps this rank's shard of it, one parameter at a time,
    so no rank ever holds the whole model, not even while it starts (DESIGN.md, principle 2)."""
    zero3 = cfg.zero == 3
    model = shard.build_model(model_cfg, grid, cfg.seed, device, cfg.seq_len, values=not zero3)
    initial = None
    if zero3:
        initial = hf.initial_values(model, Path(cfg.init_from)) if cfg.init_from else \
            shard.initial_values(model, cfg.seed)
    elif cfg.init_from:  # before the optimizer, so ZeRO's master weights start from these values
        hf.load_hf(model, Path(cfg.init_from))
    if cfg.compile:
        compile_model(model, grid)
    sync = None
    if grid.dp_cp > 1 or cfg.zero:
        sync = gradients.GradSync(model, grid, cfg.bucket_mb, overlap=not cfg.no_overlap, zero=cfg.zero,
                                  units=zero.units(model) if zero3 else None)
    opt = make_optimizer(model, cfg, sync, initial)
    # ZeRO-3's weights, gathered around each use: after the optimizer has sharded them
    gather = zero.ParamGather(model, sync, grid, compiled=cfg.compile) if zero3 else None
    return model, sync, opt, gather


def claim_out(cfg: config.TrainConfig, grid: parallel.Grid) -> tuple[rundir.Lock | None, str]:
    """Rank 0 locks --out and settles which run it holds (rundir.py); every rank learns the outcome,
    so a refused launch stops everywhere at once instead of leaving ranks waiting."""
    out, lock, problem = Path(cfg.out), None, ""
    if grid.rank == 0:
        try:
            lock = rundir.lock(out)
            rundir.claim(out, cfg.fresh, log=grid.log)
        except rundir.RunDirError as e:
            problem = str(e)
    rank0_agrees(grid, problem, "rank 0 could not claim --out (its error says why)")
    return lock, rundir.read_run_id(out)


def rank0_agrees(grid: parallel.Grid, problem: str, elsewhere: str) -> None:
    """Raise rank 0's `problem` (a RunDirError) on every rank, `elsewhere` on the others, or nothing."""
    if not checkpoint.agree(grid, not problem):
        raise rundir.RunDirError(problem or elsewhere)


def next_batch(run: Run) -> tuple[int, torch.Tensor]:
    """(number, this rank's rows) of the next global batch, passing over batches the spike guard
    rejected."""
    while True:
        number, batch = run.batches_drawn, run.loader.next_batch()
        run.batches_drawn += 1
        if number not in run.skip_batches:
            break
    if number == run.cfg.poison_step:  # fault injection for the guard's test: one rare token, repeated
        batch = torch.full_like(batch, run.tok.vocab_size - 2)
    if run.device.type == "cuda":  # from pinned memory the copy is queued; from pageable memory the host
        batch = batch.pin_memory()  # would wait for the GPU to finish everything before it
    return number, batch.to(run.device, non_blocking=True)


def forward_backward(run: Run, batch: torch.Tensor) -> torch.Tensor:
    """Gradient accumulation over micro-batches (or a pipeline schedule over them); returns this
    rank's mean loss over its micro-batches (0 on pipeline stages without the loss)."""
    micro = batch.split(run.cfg.micro_batch_size)  # rows of T + 1 tokens: inputs and next-token targets
    with cast_once(run):
        return accumulate(run, micro, run.scaler.scale)


def cast_once(run: Run):
    """Cast the weights to the compute dtype once per step (stability.Precision.cast_once), except
    under ZeRO-3: the cached copies would be whole weights, which ZeRO-3 exists not to hold."""
    return contextlib.nullcontext() if run.gather else run.precision.cast_once(run.device)


def accumulate(run: Run, micro: list[torch.Tensor], scale: float = 1.0) -> torch.Tensor:
    """The mean loss of the micro-batches, and under grad mode their accumulated gradients."""
    train = torch.is_grad_enabled()
    if run.pipe:  # it says which backward is the last (Pipeline.grad_sync)
        return run.pipe.run(micro, run.autocast, train=train, scale=scale)
    total = torch.zeros((), device=run.device)
    for i, mb in enumerate(micro):
        if run.sync is not None:  # communicate only during the last micro-batch's backward
            run.sync.require_backward_grad_sync = i == len(micro) - 1
        with run.grid.span("F"), run.autocast:
            _, loss = run.model(mb[:, :-1], mb[:, 1:])
        if train:
            with run.grid.span("B"):
                (loss * (scale / len(micro))).backward()
        total += loss.detach().float() / len(micro)
    return total


def train_step(run: Run) -> dict:
    """One optimizer step. The update is dropped when the loss or gradients are not finite
    (`skipped`) or the loss is a spike (`spike`: the caller rolls back). That is decided on the device,
    and the optimizer skips there (its `found_inf`): the host reads the step's numbers once, after the
    update is queued, so a GPU never idles mid-step waiting for the host to decide."""
    cfg, lr = run.cfg, stability.lr_at(run.step, run.cfg)
    run.grid.traffic.reset()  # count this step's bytes only
    recorder = run.grid.traffic.time
    if run.step + 1 == run.timeline_step:
        recorder.start(run.grid.barrier)
    elif recorder.clock.cuda:  # CUDA events cost microseconds each: only for the steps that report them
        recorder.on = run.layer_stats.due(run.step + 1)
    run.layer_stats.begin(run.step + 1)
    batch_number, batch = next_batch(run)
    local_loss = forward_backward(run, batch)
    gradients.finish_grads(run.model, run.grid, run.sync)
    loss = run.grid.global_loss(local_loss)  # after the gradients: nothing delays their buckets
    grads = gradients.local_grads(run.model, run.sync)
    run.scaler.unscale_(grads)
    norm = gradients.grad_norm(run.model, run.grid, run.sync)
    run.layer_stats.after_grads()  # per layer, before clipping
    finite_loss, finite = torch.isfinite(loss), torch.isfinite(norm)
    spike = finite_loss & run.guard.is_spike(loss)
    stability.clip_(grads, norm, cfg.clip)  # whatever the outcome: a skipped step's gradients are dropped
    for group in run.opt.param_groups:
        group["lr"] = lr
    run.saver.fence()  # the weights change now: a checkpoint copy still in flight must finish first
    run.opt.found_inf = (~(finite_loss & finite & ~spike)).float()  # 1: the optimizer leaves everything as is
    with run.grid.span("O"):
        run.opt.step()
    # the step's one read of the device, once the update is queued (on NCCL a bounded wait: a dead peer is exit 3)
    run.grid.wait_for_device()
    loss, norm, finite_loss, finite, spike = torch.stack([loss, norm, finite_loss, finite, spike]).tolist()
    updated = finite_loss and finite and not spike
    if updated:
        run.guard.record(loss)
    run.layer_stats.finish(updated=updated)
    if not spike:
        run.scaler.update(overflow=not finite)
    if run.memory is not None and "state" not in run.memory:  # reduced gradients, optimizer state created
        run.memory["state"] = formulas.state_memory(run.model, run.opt, run.sync)
    if run.sync is not None:  # gradients live in its buckets (ZeroAdamW.zero_grad is this too)
        run.sync.zero_grad()
    else:
        run.opt.zero_grad(set_to_none=True)
    # fp16 overflow is routine (the scaler backs off); anywhere else a non-finite step is bad
    bad = not finite_loss or (not finite and not run.scaler.enabled)
    return {"step": run.step + 1, "loss": loss, "lr": lr, "grad_norm": norm,
            "skipped": not (finite_loss and finite), "bad": bad, "spike": bool(spike), "batch": batch_number}


@torch.no_grad()
def evaluate(run: Run) -> float:
    """The mean loss over the validation batches, in training-sized micro-batches (no new shapes
    for a compiled model, no more memory than training)."""
    run.model.eval()
    with cast_once(run):  # the weights do not change: one cast for all batches
        losses = [run.grid.global_loss(accumulate(run, batch.to(run.device).split(run.cfg.micro_batch_size)))
                  for batch in run.val]
    run.grid.wait_for_device()
    run.model.train()
    return torch.stack(losses).mean().item()


@torch.no_grad()
def sample(run: Run, n_tokens: int) -> str:
    """A continuation of <|endoftext|> (the start of a document), the same on every rank. Eager even
    when the blocks are compiled: every new token is a new shape."""
    run.model.eval()
    start = torch.full((1, 1), run.tok.eot, dtype=torch.long, device=run.device)
    gen = torch.Generator(device=run.device).manual_seed(run.cfg.seed)
    with run.autocast, torch.compiler.set_stance("force_eager"):
        out = pipeline.generate(run.model, run.grid, start, n_tokens, temperature=0.8, top_k=50, generator=gen)
    run.model.train()
    return run.tok.decode(out[0, 1:].tolist())


def save(run: Run, skippable: bool = False) -> bool:
    """Checkpoint this step; False when it was skipped (`skippable`: a periodic --async-ckpt save that
    found the previous one still being written; checkpoint.Saver). First, on every rank, make sure no
    other process writes in --out."""
    problem = run.lock.problem(run.run_id) if run.lock else ""
    rank0_agrees(run.grid, problem and f"another process is writing in --out: {problem}; this run stops without "
                 "saving, so as not to mix two runs' files", "rank 0 found another writer in --out (it says which)")
    state = run.state_dict()
    saved = run.saver.save(state.pop("step"), model=run.model, opt=run.opt, extra=state, meta=checkpoint_meta(run),
                           crash_mid_save=crash_due(run, f"save:{run.step}"), skippable=skippable)
    if saved:
        run.saved_step = run.step
    return saved


def crash_due(run: Run, event: str) -> bool:
    """Is --crash-at asking this process to die at `event`?"""
    spec = run.cfg.crash_at
    if spec.startswith("rank:"):
        _, rank, spec = spec.split(":", 2)
        if int(rank) != run.grid.rank or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return False
    return spec == event


def checkpoint_meta(run: Run) -> dict:
    """What a checkpoint must agree with to be resumed: everything that fixes the math of a step
    (checkpoint.check_compatible compares every key but "config"; the DATA keys too, unless --new-data)."""
    cfg = run.cfg
    return {"model": run.model_cfg.architecture(), "tokenizer": run.tok.identity(), "data": cfg.data,
            "data_sha256": run.data_sha256, "batch_size": cfg.batch_size, "seq_len": cfg.seq_len, "seed": cfg.seed,
            "precision": cfg.precision, "config": asdict(cfg)}


# Flags that may change when a run resumes, and what the change does (the others must match, or
# make no difference to the math: logging, checkpoint cadence, fault injection).
SCHEDULE = ("lr", "min_lr", "warmup_steps", "max_steps")
UPDATE = ("weight_decay", "clip", "dropout", "loss_scale_window", "max_bad_steps", "spike_z", "spike_window")
LAYOUT = ("tp", "pp", "sp", "cp", "cp_attn", "zero", "micro_batch_size", "pp_schedule", "virtual_stages")
KERNELS = ("attn", "compile", "device", "recompute")


def resume_changes(run: Run, saved: dict, saved_layout: dict) -> list[str]:
    """One line per flag that differs from the checkpoint's run, with what the difference does."""
    cfg, now, lines = run.cfg, asdict(run.cfg), []
    old = config.TrainConfig(**{k: v for k, v in saved.items() if k in now})
    for name in SCHEDULE + UPDATE + LAYOUT + KERNELS:
        if name not in saved or saved[name] == now[name]:
            continue
        change = f"resume: --{name.replace('_', '-')} {saved[name]} -> {now[name]}: "
        if name in SCHEDULE:
            now_lr, old_lr = stability.lr_at(run.step, cfg), stability.lr_at(run.step, old)
            effect = (f"the learning-rate schedule changes; step {run.step + 1} trains at {now_lr:.3g} "
                      f"instead of {old_lr:.3g}")
        elif name in UPDATE:
            effect = "the updates from here on differ from the original run's"
        elif name in LAYOUT:
            effect = "a layout change: the same math; random streams (dropout) start afresh"
        else:
            effect = "the same math up to floating-point rounding"
        lines.append(change + effect)
    if saved_layout != checkpoint.layout_of(run.grid):
        lines.append(f"resume: layout {saved_layout} -> {checkpoint.layout_of(run.grid)}: the same math; random "
                     "streams (dropout) start afresh")
    if run.scaler.enabled and saved.get("loss_scale") != cfg.loss_scale:
        lines.append(f"resume: --loss-scale {cfg.loss_scale:g} is not used: the checkpoint's loss scale "
                     f"{run.scaler.scale:g} continues")
    return lines


# What names the data a checkpoint was trained on: a change is refused, or with --new-data logged.
DATA = {"data": "--data", "data_sha256": "the prepared data's sha256"}


def data_changes(run: Run, saved: dict) -> list[str]:
    """--new-data: one line per way the data differs from the checkpoint's."""
    now = checkpoint_meta(run)
    return [f"resume: {what} {saved[key]} -> {now[key]}: --new-data goes on from the checkpoint's position in "
            "other data; the steps from here on are not the original run's"
            for key, what in DATA.items() if key in saved and saved[key] != now[key]]


def restore(run: Run, announce: bool) -> bool:
    """Load the newest usable checkpoint of this run, if there is one; say what changed."""
    found = checkpoint.restore(Path(run.cfg.out) / "ckpt", run.model, run.opt, run.grid, checkpoint_meta(run),
                               run.run_id, log=run.grid.log, allowed=DATA if run.cfg.new_data else ())
    if found is None:
        return False
    path, extra, manifest = found
    run.load_state_dict(extra)
    run.saved_step = run.step
    if announce:
        run.grid.log(f"resuming from {path} (step {run.step})")
        for line in resume_changes(run, manifest["meta"].get("config", {}), manifest["layout"]) + \
                data_changes(run, manifest["meta"]):
            run.grid.log(line)
    return True


def train(run: Run, stop: interrupt.Stop) -> dict:
    """The loop: resume if --out holds a checkpoint of this run, then step, evaluate, log and save
    until --max-steps, or until a signal asks it to stop (interrupt.py: then a checkpoint of the step
    every rank stops after, and interrupt.Stopped). Returns the last step's row of metrics."""
    cfg, grid = run.cfg, run.grid
    resumed = restore(run, announce=True)
    if not resumed and grid.is_logger and (lost := max((r["step"] for r in rundir.steps(cfg.out)), default=0)):
        grid.log(f"no checkpoint of run {run.run_id} to resume from: starting again at step 0 (the {lost} steps "
                 "of its last attempt are lost; --ckpt-every N saves as it goes)")
    metrics = rundir.Metrics(Path(cfg.out) / "metrics.jsonl", grid.is_logger, run.step, log=grid.log)
    metrics.log(event="resume" if resumed else "start", run=run.run_id, step=run.step)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    flops_per_step = gpt.flops_per_token(run.model_cfg, cfg.seq_len) * tokens_per_step
    peak = formulas.peak_flops(run.device, cfg.precision) * grid.world
    if note := formulas.unknown_gpu(run.device):
        grid.log(note)
    bad_in_a_row, last, step_times, saves = 0, {}, [], []
    if cfg.print_timeline:  # the second step: the first also allocates, compiles and warms up
        run.timeline_step = run.step + min(2, cfg.max_steps - run.step)
    report = dashboard.Report(Path(cfg.out), grid.is_logger, dashboard.describe(cfg, grid, run.run_id))
    # the bar goes to stderr; log lines (bar.write) to stdout. `with`: closed even on an error
    stopped = 0  # the signal every rank stopped for
    with tqdm(total=cfg.max_steps, initial=run.step, disable=not grid.is_logger, dynamic_ncols=True,
              mininterval=1.0) as bar:
        try:
            stop.deferred = True  # from here a signal is answered between two steps
            while run.step < cfg.max_steps:
                if stopped := stop.agreed(grid):
                    if run.saved_step != run.step:
                        save(run)
                    break
                t0 = time.perf_counter()
                if cfg.memory_report and not last:  # the first step of this process: measure it
                    run.memory = {"activations": formulas.SavedActivations(run.model, run.device)}
                    with run.memory["activations"]:
                        row = train_step(run)
                else:
                    row = train_step(run)
                if row.pop("spike"):
                    roll_back(run, row, metrics, bar)
                    bar.n = run.step
                    continue
                if run.spikes and row["step"] > max(s for s, _ in run.spikes):
                    run.spikes = []  # got past every spike: the next one starts a new count
                bad_in_a_row = bad_in_a_row + 1 if row.pop("bad") else 0
                if row["skipped"] and grid.is_logger:
                    bar.write(f"step {row['step']}: non-finite loss or gradient, update skipped"
                              + (f" (loss scale now {run.scaler.scale:g})" if run.scaler.enabled else ""))
                if bad_in_a_row >= cfg.max_bad_steps:
                    raise FloatingPointError(f"{bad_in_a_row} steps in a row had a non-finite loss or "
                                             "gradient; lower --lr, or check the data")
                dt = time.perf_counter() - t0
                step_times = (step_times + [dt])[-20:]
                row.update(tokens_per_sec=tokens_per_step / dt, mfu=flops_per_step / dt / peak,
                           **stats.comm_seconds(grid))  # parallel runs: time per collective
                if run.device.type == "cuda":  # the most this rank's step held (tests/bench.py measures CPUs)
                    row["peak_mem_gb"] = torch.cuda.max_memory_allocated(run.device) / 1e9
                    torch.cuda.reset_peak_memory_stats(run.device)
                if run.scaler.enabled:
                    row["loss_scale"] = run.scaler.scale
                if not last:  # the first step of this process: print what was asked for
                    for text in reports.first_step_reports(run):
                        bar.write(text)
                if row["step"] == run.timeline_step and (text := reports.timeline_report(run)):
                    bar.write(text)
                run.step += 1
                after_step(run, row, bar, metrics)
                log_saves(run, metrics, step_times, saves)
                report.update(now="val_loss" in row)  # out/report.html: at evaluations, else every few seconds
                last = row
        except BaseException:
            report.update(now=True, status="stopped")
            raise
        finally:
            run.saver.wait()  # never exit with a save half-done
    log_saves(run, metrics, step_times, saves)
    if stopped:
        metrics.log(event="stop", signal=signal.Signals(stopped).name, step=run.step)
    report.update(now=True, status="stopped" if stopped else "finished")
    if saves and grid.is_logger:
        print(reports.saves_summary(saves))
    if stopped:
        raise interrupt.Stopped(stopped, run.step)
    return last


def after_step(run: Run, row: dict, bar, metrics: rundir.Metrics) -> None:
    """Evaluate and sample, log, save, and obey --crash-at (in that order: a checkpoint at step N
    comes with step N's line in metrics.jsonl)."""
    cfg = run.cfg
    if run.step % cfg.eval_every == 0 or run.step == cfg.max_steps:
        row["val_loss"] = evaluate(run)
        text = sample(run, cfg.sample_tokens) if cfg.sample_tokens else ""
        if run.grid.is_logger:
            bar.write(f"step {run.step} val {row['val_loss']:.3f}" + (f" | sample: {text!r}"[:400] if text else ""))
    metrics.log(**row)
    if (layers := run.layer_stats.pop_row()) is not None:
        metrics.log(**layers)
    bar.update(1)
    bar.set_postfix(loss=f"{row['loss']:.3f}", lr=f"{row['lr']:.1e}", tok_s=f"{row['tokens_per_sec']:.0f}",
                    mfu=f"{row['mfu']:.1%}", **({"mem": f"{row['peak_mem_gb']:.1f}G"} if "peak_mem_gb" in row else {}))
    if run.step == cfg.max_steps:  # the last one is always written
        save(run)
    elif cfg.ckpt_every and run.step % cfg.ckpt_every == 0 and not save(run, skippable=True):
        metrics.log(event="checkpoint skipped", step=run.step, writing=run.saver.writing)
        if run.grid.is_logger:
            bar.write(f"step {run.step}: checkpoint skipped: the one of step {run.saver.writing} is still being "
                      "written (a disk this slow needs a larger --ckpt-every)")
    if crash_due(run, f"step:{run.step}"):
        run.saver.wait()
        os.kill(os.getpid(), signal.SIGKILL)


def log_saves(run: Run, metrics: rundir.Metrics, step_times: list[float], saves: list[dict]) -> None:
    """A metrics event per finished checkpoint: its size, how long it took to complete, and what it
    cost the training loop (`blocking_s`) next to a typical step (`step_s`, the median of recent ones)."""
    for done in run.saver.pop_finished():
        done["step_s"] = median(step_times) if step_times else float("nan")
        metrics.log(event="checkpoint", **done)
        saves.append(done)


def roll_back(run: Run, row: dict, metrics: rundir.Metrics, bar) -> None:
    """A loss spike: drop the update, go back to the last complete checkpoint, and never draw the
    offending batch again (PaLM, section 5.1, does the same by hand). The steps between the
    checkpoint and the spike are replayed exactly: same batches, same RNG. A spike that keeps coming
    back is not one bad batch: after --max-rollbacks in a row, the run stops."""
    run.saver.wait()
    run.spikes.append((row["step"], row["batch"]))
    if len(run.spikes) > run.cfg.max_rollbacks:
        metrics.log(event="spike", **row, gave_up=True)
        steps, batches = (", ".join(str(x) for x in xs) for xs in zip(*run.spikes))
        raise FloatingPointError(f"the spike guard rolled back {len(run.spikes) - 1} times in a row and step "
                                 f"{row['step']} spiked again (spikes at steps {steps}, on batches {batches}): "
                                 "the instability is not one bad batch; lower --lr, or raise --spike-z or "
                                 "--max-rollbacks")
    skip = run.skip_batches + [row["batch"]]
    restore(run, announce=False)  # with no checkpoint yet, the run just continues without this batch
    run.skip_batches = skip
    metrics.truncate(run.step)  # the replaced attempt's step lines go; event lines stay
    metrics.log(event="spike", **row, rolled_back_to=run.step)
    if run.grid.is_logger:  # through the bar, which clears itself first (a print would land on its line)
        bar.write(f"step {row['step']}: loss {row['loss']:.3f} is a spike; rolled back to step {run.step} "
                  f"and will skip batch {row['batch']}")


def main(argv=None) -> None:
    cfg = config.parse_args(argv)
    stop = interrupt.Stop()  # SIGINT, SIGTERM: at once during set-up; between two steps once training
    try:
        run = setup(cfg)
        last = train(run, stop)
        if run.grid.is_logger:
            print(f"done: step {run.step}" + (f", loss {last['loss']:.4f}" if last else
                                              f" (nothing left to do: the run in {cfg.out} has finished; --fresh "
                                              "starts a new one there, a larger --max-steps continues it)")
                  + (f", val loss {last['val_loss']:.4f}" if "val_loss" in last else ""))
    except interrupt.Stopped as e:  # every rank stopped at the same step; rank 0 says so
        cli.fail(str(e), e.code, say=int(os.environ.get("RANK", "0")) == 0)
    except (config.ConfigError, parallel.LayoutError) as e:
        if torch.distributed.is_initialized():  # found by some ranks only: each says what it found
            cli.fail(f"error: {e}")
        cli.stop_every_rank(str(e))
    except (data.DataError, checkpoint.CheckpointError, rundir.RunDirError, FloatingPointError) as e:
        cli.fail(f"error: {e}")
    except parallel.PeerError as e:  # a dead or hung peer: one line instead of a traceback wall
        cli.fail(f"error: {e.where}: a peer process failed or timed out ({e.detail}); a restart resumes from the "
                 "last complete checkpoint in --out", 3, cause=False)
    finally:
        parallel.shutdown()


if __name__ == "__main__":
    main()
