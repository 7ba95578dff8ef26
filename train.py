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
principle 3). The tests hold every layout to that. Mixed precision, loss scaling, the schedule,
clipping (lesson 02) and the spike guard (lesson 05) live in stability.py.

Checkpoints (lesson 05) are written by checkpoint.py; a run whose --out holds one resumes from
it. The loss-spike guard rolls back to the last checkpoint and skips the batch that caused it.

Every step goes to --out/metrics.jsonl (support/rundir.py). What a run measures beyond that is the
instruments' (instruments/: MFU, the per-layer statistics of every --stats-every steps, the time of each
collective, the reports a flag asks for, the dashboard in --out/report.html). The loop calls them only
through the grid's Observer (support/observer.py), at named points of a step; `main` attaches them, all
of them by default and none where instruments/ has been deleted (then a flag that needs one is refused).
"""

import contextlib
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median

# Set before torch is imported (it reads this once): on a CPU, tensors of 2 MB and more get 2 MB pages.
# A step allocates its big tensors afresh (one chunk of logits is 200 MB at `mini`), and in 4 KB pages
# each one costs the kernel ~50,000 page faults: with 2 MB pages a CPU step of `mini` runs ~10% faster
# (tests/bench.py). GPU memory is not affected.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from support import cli  # (light: no torch)

if __name__ == "__main__":  # until main() installs interrupt.Stop, Ctrl-C while the imports below
    cli.exit_on_signals_while_starting()  # load (seconds) is one line and exit 130, not a traceback

import numpy as np
import torch
from tqdm import tqdm

import checkpoint
import config
import data
import dropout
import fp8
import gradients
import model as gpt
import moe
import parallel
import pipeline
import shard
import stability
import zero
from support import cli, devices, interrupt, memory, rundir, tokenizer, writer

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
    stay eager, so data-parallel buckets still start during the backward. (Context parallelism's
    attention cores run eagerly between two graphs of their block: context.py disables compiling them.)"""
    regions = list(model.transformer.h.children())
    if grid.tp == 1 and grid.last_stage:
        regions.append(model.loss)
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
    saver: writer.Saver
    run_id: str
    data_sha256: str  # the prepared data's identity (its shards' sha256), recorded in every checkpoint
    log: Callable[[str], None]  # print on rank 0 (nothing elsewhere)
    lock: rundir.Lock | None = None  # rank 0's lock on --out: held for as long as this object lives
    sync: gradients.GradSync | None = None  # data-parallel gradient averaging
    pipe: pipeline.Pipeline | None = None  # this rank's pipeline stage, when --pp > 1
    gather: zero.ParamGather | None = None  # ZeRO-3's weight gathering, when --zero 3
    metrics: rundir.Metrics | None = None  # --out/metrics.jsonl, once the loop has opened it
    memory: "memory.Tier | None" = None  # --mem-ckpt-every's snapshots (support/memory.py)
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


def setup(cfg: config.TrainConfig, arch: dict | None = None, init_values=None) -> Run:
    """Everything before the first step. --init-from (instruments/hf.py, which `main` asks): `arch`, the
    GPTConfig fields of that model, and `init_values(model)`, which gives p -> this rank's slice of p's
    starting value; without them every parameter starts from (seed, name)."""
    device, attn_asked = devices.pick_device(cfg.device), cfg.attn  # (`auto` is resolved next)
    cfg = config.resolve_defaults(cfg, device, bf16_ok=device.type != "cuda" or torch.cuda.is_bf16_supported(),
                                  arch=arch)
    precision = stability.PRECISIONS[cfg.precision]
    out = Path(cfg.out)
    # Every check that needs only the flags and the world size, before any process talks to another and
    # before any data: a wrong layout fails in a second on every rank alike (main prints it once).
    grid = parallel.layout(cfg.tp, cfg.pp, device, sp=cfg.sp, cp=cfg.cp, cp_attn=cfg.cp_attn, vp=cfg.virtual_stages,
                           ep=cfg.ep, zero_shard=cfg.zero_shard, gpus_per_node=config.gpus_per_node(cfg))
    device, log = grid.device, cli.printer(grid.is_logger)
    per_rank = config.check_batch(cfg, grid)
    model_cfg = config.model_config(cfg, arch)
    config.check_size(cfg, model_cfg, grid)
    shard.check_layout(model_cfg, grid, cfg.seq_len)
    rundir.check_out(out)
    parallel.connect(grid, cfg.timeout, cfg.crash_at)
    lock, run_id = rundir.claim_on_every_rank(out, cfg.fresh, grid, log)
    torch.manual_seed(cfg.seed)  # (dropout draws from none of these: dropout.py)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    prepared = grid.rank0_first(lambda: data.prepare(data.DataConfig(
        source=cfg.data, tokenizer=cfg.tokenizer, cache_dir=cfg.cache_dir), verbose=grid.is_logger))
    tok = tokenizer.get_tokenizer(cfg.tokenizer, cfg.cache_dir)
    train_tokens = data.load_tokens(prepared / "train.bin", vocab_size=tok.vocab_size)
    config.resolve_steps(cfg, device, len(train_tokens), log=log)
    loader = data.Loader(train_tokens, cfg.seq_len, cfg.batch_size, cfg.seed, rank=grid.dp_rank, world=grid.dp)
    val = data.eval_batches(data.load_tokens(prepared / "val.bin", vocab_size=tok.vocab_size), cfg.seq_len,
                            cfg.batch_size, cfg.eval_batches, rank=grid.dp_rank, world=grid.dp)
    if len(val) < cfg.eval_batches:
        log(f"evaluation: {len(val)} batch{'es' if len(val) > 1 else ''} of {cfg.batch_size} sequences, all "
            f"the validation split holds (--eval-batches {cfg.eval_batches} asked for more)")
    model, sync, opt, gather = build_model_and_optimizer(cfg, grid, model_cfg, device, init_values)
    stages = pipeline.executor(model, grid, cfg.pp_schedule, grad_sync=sync) if grid.pp > 1 else None
    if stages and (warning := pipeline.bubble_warning(grid.pp, per_rank // cfg.micro_batch_size, grid.vp)):
        log(warning)
    scaler = stability.LossScaler(precision.loss_scaling, cfg.loss_scale, cfg.loss_scale_window)
    guard = stability.SpikeGuard(cfg.spike_z, cfg.spike_window)
    saver = writer.Saver(out / "ckpt", keep=cfg.keep, asynchronous=cfg.async_ckpt, grid=grid, run=run_id,
                             timeout_s=cfg.timeout)
    n_params = gpt.n_params(model_cfg)  # all ranks' shards together, the tied wte/lm_head once
    on = device.type if grid.world == 1 else \
        f"{grid.world} {device.type} processes (dp {grid.dp} x tp {grid.tp} x pp {grid.pp} x cp {grid.cp})"
    log(f"{model_cfg.n_layer}-layer model ({cfg.preset}, {n_params / 1e6:.1f}M parameters) on {on}: "
        f"{stability.describe(cfg, model_cfg)}, attention "
        f"{config.describe_attention(cfg, attn_asked, device, model_cfg.head_dim)}, "
        f"compile {'on' if cfg.compile else 'off'}, "
        f"{cfg.max_steps} steps of {cfg.batch_size} x {cfg.seq_len} tokens")
    if cfg.zero and grid.dp == 1:
        log(f"--zero {cfg.zero} shards nothing here: ZeRO splits state across the data-parallel ranks, and "
            "there is 1 (launch more processes than --tp x --cp x --pp, or leave --zero out)")
    if cfg.print_grid:
        log(str(grid))
    data_sha256 = ", ".join(f"{s} {data.shard_sha256(prepared / f'{s}.bin')[:16]}" for s in ("train", "val"))
    tier = memory.start(cfg, grid, run_id, lambda: checkpoint.memory_bytes(model, opt, grid), log)
    return Run(cfg, device, precision, grid, tok, model_cfg, model, opt, scaler, loader, val, guard, saver, run_id,
               data_sha256, log, lock=lock, sync=sync, pipe=stages, gather=gather, memory=tier)


def build_model_and_optimizer(cfg: config.TrainConfig, grid: parallel.Grid, model_cfg: gpt.GPTConfig,
                              device: torch.device, init_values=None) -> tuple:
    """This rank's model, its data-parallel gradient sync, its optimizer and, under ZeRO-3, the gathering
    of its weights. ZeRO-3's parameters are built as shapes only: the optimizer draws each one's starting
    value (from (seed, name), or --init-from's `init_values`) and keeps this rank's shard of it, one
    parameter at a time, so no rank ever holds the whole model, not even while it starts (DESIGN.md,
    principle 2)."""
    zero3 = cfg.zero == 3
    model = shard.build_model(model_cfg, grid, cfg.seed, device, cfg.seq_len, values=not zero3)
    initial = None
    if zero3:
        initial = init_values(model) if init_values else shard.initial_values(model, cfg.seed)
    elif init_values:  # before the optimizer, so ZeRO's master weights start from these values
        value = init_values(model)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(value(p))
    moe.train_with(model, cfg.moe_aux_loss, cfg.moe_z_loss)  # experts: the router losses' weights
    if stability.PRECISIONS[cfg.precision].fp8:
        fp8.enable(model, grid, cfg.fp8_recipe, cfg.fp8_amax_history, keep_weights=not zero3)
    if cfg.compile:
        compile_model(model, grid)
    sync = None
    if grid.dp_cp > 1 or cfg.zero:  # (ZeRO++: qgZ's reduce-scatter; shards of whole quantization blocks)
        scatter = zero.QuantizedReduceScatter(grid, cfg.qgz, cfg.quant_block) if cfg.qgz else None
        sync = gradients.GradSync(model, grid, cfg.bucket_mb, overlap=not cfg.no_overlap, zero=cfg.zero,
                                  units=zero.units(model) if zero3 else None, scatter=scatter,
                                  block=cfg.quant_block if cfg.qgz or cfg.qwz else 1)
    opt = make_optimizer(model, cfg, sync, initial)
    # ZeRO-3's weights, gathered around each use: after the optimizer has sharded them
    gather = zero.ParamGather(model, opt, compiled=cfg.compile, qwz_block=cfg.quant_block if cfg.qwz else 0,
                              hpz=cfg.hpz) if zero3 else None
    return model, sync, opt, gather


def next_batch(run: Run) -> tuple[int, torch.Tensor]:
    """(number, this rank's rows) of the next global batch not rejected by the spike guard."""
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
    moe.begin_step(run.model, run.scaler.scale / len(micro))  # experts: their router losses' share (moe.RouterLoss)
    first_row = run.grid.dp_rank * len(batch)  # this rank's, in the global batch: dropout's key
    key = dropout.step_key(run.cfg.seed, run.step, first_row, run.device)
    with cast_once(run), dropout.keyed(key):
        return accumulate(run, micro, train=True, scale=run.scaler.scale)


def cast_once(run: Run):
    """Cast the weights to the compute dtype once per step (stability.Precision.cast_once), except
    under ZeRO-3: the cached copies would be whole weights, which ZeRO-3 exists not to hold."""
    return contextlib.nullcontext() if run.gather else run.precision.cast_once(run.device)


def accumulate(run: Run, micro: list[torch.Tensor], train: bool, scale: float = 1.0) -> torch.Tensor:
    """The mean loss of the micro-batches, and when `train` their accumulated gradients."""
    if run.pipe:  # it says which backward is the last (Pipeline.grad_sync)
        return run.pipe.run(micro, run.autocast, train=train, scale=scale)
    total = torch.zeros((), device=run.device)
    for i, mb in enumerate(micro):
        if run.sync is not None:  # communicate only during the last micro-batch's backward
            run.sync.require_backward_grad_sync = i == len(micro) - 1
        with run.grid.observer.span("F"), run.autocast, dropout.rows(i * len(micro[0])):
            _, loss = run.model(mb[:, :-1], mb[:, 1:])
        if train:
            with run.grid.observer.span("B"):
                (loss * (scale / len(micro))).backward()
        total += loss.detach().float() / len(micro)
    return total


def train_step(run: Run, stop: interrupt.Stop | None = None) -> dict:
    """One optimizer step. The update is dropped when the loss or gradients are not finite
    (`skipped`) or the loss is a spike (`spike`: the caller rolls back). That is decided on the device,
    and the optimizer skips there (its `found_inf`): the host reads the step's numbers once, after the
    update is queued, so a GPU never idles mid-step waiting for the host to decide."""
    cfg, lr = run.cfg, stability.lr_at(run.step, run.cfg)
    asked = [stop.share(run.grid)] if stop else []  # every rank's stop signal, reduced meanwhile
    run.grid.traffic.reset()  # count this step's bytes only
    run.grid.observer.step_begin(run.step + 1)
    batch_number, batch = next_batch(run)
    local_loss = forward_backward(run, batch)
    gradients.finish_grads(run.model, run.grid, run.sync)
    # after the gradients; 0-d each (experts: and the router's aux, z, dropped)
    loss, *router = global_loss(run.grid, torch.cat([local_loss[None], moe.step_numbers(run.model)]))
    grads = gradients.local_grads(run.model, run.sync)
    run.scaler.unscale_(grads)
    norm = gradients.grad_norm(run.model, run.grid, run.sync)
    run.grid.observer.after_grads()  # before clipping: the gradients as the backward made them
    finite_loss, finite = torch.isfinite(loss), torch.isfinite(norm)
    spike = finite_loss & run.guard.is_spike(loss)
    stability.clip_(grads, norm, cfg.clip)  # whatever the outcome: a skipped step's gradients are dropped
    for group in run.opt.param_groups:
        group["lr"] = lr
    run.saver.fence()  # the weights change now: a checkpoint copy still in flight must finish first
    run.opt.found_inf = (~(finite_loss & finite & ~spike)).float()  # 1: the optimizer leaves everything as is
    with run.grid.observer.span("O"):
        run.opt.step()
    overflow = fp8.end_step(run.model, run.grid, cfg.fp8_recipe)  # fp8: [saturated elements] (else [])
    numbers = [loss, norm, finite_loss, finite, spike, *router, *overflow, *(a() for a in asked)]
    # the step's one read of the device, once the update is queued (on NCCL a bounded wait: a dead peer is exit 3)
    loss, norm, finite_loss, finite, spike, *extra = interrupt.host_read(
        run.grid, torch.stack(numbers), "waiting for the GPU to finish the step's collectives")
    signum = int(extra.pop()) if asked else 0  # (the stop signal: 0, none)
    router, overflow = extra[:len(router)], extra[len(router):]  # experts: aux, z, dropped
    updated = finite_loss and finite and not spike
    if updated:
        run.guard.record(loss)
    run.grid.observer.after_update(updated)  # the update is done; the gradients are still there
    if not spike:
        run.scaler.update(overflow=not finite)
    if run.sync is not None:  # gradients live in its buckets (ZeroAdamW.zero_grad is this too)
        run.sync.zero_grad()
    else:
        run.opt.zero_grad(set_to_none=True)
    # fp16 overflow is routine (the scaler backs off); anywhere else a non-finite step is bad
    bad = not finite_loss or (not finite and not run.scaler.enabled)
    return {"step": run.step + 1, "loss": loss, "lr": lr, "grad_norm": norm,
            "skipped": not (finite_loss and finite), "bad": bad, "spike": bool(spike), "batch": batch_number,
            "signal": signum, **dict(zip(("moe_aux", "moe_z", "moe_dropped"), router)),
            **({"fp8_overflow": int(overflow[0])} if overflow else {})}


def global_loss(grid: parallel.Grid, x: torch.Tensor) -> torch.Tensor:
    """The batch loss on every rank: it lives on the last pipeline stage (the others hold 0, so a sum
    over the pipeline group copies it), and is averaged over data-parallel ranks and over context-parallel
    ones (each holds the mean over its slice of the tokens; the slices are equal); x: with the router's numbers."""
    x = x.detach().float().clone()
    grid.all_reduce(x, "pp")
    grid.all_reduce(x, "dp_cp")
    return x / grid.dp_cp


@torch.no_grad()
def evaluate(run: Run) -> float:
    """The mean loss over the validation batches, in training-sized micro-batches (no new shapes
    for a compiled model, no more memory than training)."""
    run.model.eval()
    with cast_once(run):  # the weights do not change: one cast for all batches
        losses = [global_loss(run.grid, accumulate(run, batch.to(run.device).split(run.cfg.micro_batch_size),
                                                   train=False)) for batch in run.val]
    run.model.train()
    return interrupt.host_read(run.grid, torch.stack(losses).mean(), "reading the eval loss")[0]


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
    return run.tok.decode(interrupt.host_read(run.grid, out[0, 1:], "reading a sample"))


def save(run: Run, skippable: bool = False) -> bool:
    """Checkpoint this step; False when it was skipped (`skippable`: a periodic --async-ckpt save that
    found the previous one still being written; support/writer.py). First, on every rank, make sure no
    other process writes in --out."""
    rundir.check_no_other_writer(run.lock, run.run_id, run.grid)
    state = run.state_dict()
    saved = run.saver.save(state.pop("step"), checkpoint.tensor_entries(run.model, run.opt, run.grid),
                           checkpoint.optimizer_steps(run.opt), extra=state, meta=checkpoint_meta(run),
                           crash_mid_save=interrupt.crash_due(run.cfg.crash_at, run.grid.rank, f"save:{run.step}"),
                           skippable=skippable)
    if saved:
        run.saved_step = run.step
    return saved


def checkpoint_meta(run: Run) -> dict:
    """What a checkpoint must agree with to be resumed: everything that fixes the math of a step
    (checkpoint.check_compatible compares every key but "config"; the DATA keys too, unless --new-data)."""
    cfg = run.cfg
    return {"model": run.model_cfg.architecture(), "tokenizer": run.tok.identity(), "data": cfg.data,
            "data_sha256": run.data_sha256, "batch_size": cfg.batch_size, "seq_len": cfg.seq_len, "seed": cfg.seed,
            "precision": stability.describe(cfg), "config": asdict(cfg)}


def restore(run: Run, announce: bool) -> bool:
    """Load this run's newest usable checkpoint (first: memory's, if newer); say what changed."""
    found = checkpoint.restore(Path(run.cfg.out) / "ckpt", run.model, run.opt, run.grid, checkpoint_meta(run),
                               run.run_id, run.log, checkpoint.DATA if run.cfg.new_data else (),
                               memory=run.memory if announce else None)
    if found is None:
        return False
    path, extra, manifest = found  # path: on disk, or words (with --mem-ckpt-every)
    run.load_state_dict(extra)
    run.saved_step = -1 if manifest["format"] == memory.FORMAT else run.step  # memory: none on disk
    if announce:
        run.log(f"resuming from {path}" + ("" if isinstance(path, str) else f" (step {run.step})"))
        run.grid.observer.resumed(manifest)  # (reports.py says which flags changed, and what that does)
        for line in checkpoint.data_changes(checkpoint_meta(run), manifest["meta"]):
            run.log(line)
    return True


def train(run: Run, stop: interrupt.Stop) -> dict:
    """The loop: resume if --out holds a checkpoint of this run, then step, evaluate, log and save
    until --max-steps, or until a signal asks it to stop (support/interrupt.py: then a checkpoint of the step
    every rank stops after, and interrupt.Stopped). Returns the last step's row of metrics."""
    cfg, grid = run.cfg, run.grid
    resumed = restore(run, announce=True)
    if not resumed and grid.is_logger:
        rundir.say_lost_steps(cfg.out, run.run_id, run.log)
    run.metrics = rundir.Metrics(Path(cfg.out) / "metrics.jsonl", grid.is_logger, run.step, log=run.log)
    run.metrics.log(event="resume" if resumed else "start", run=run.run_id, step=run.step)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    bad_in_a_row, last, step_times = 0, {}, []
    # the bar goes to stderr; log lines (bar.write) to stdout. `with`: closed even on an error
    stopped = 0  # the signal every rank stopped for
    with tqdm(total=cfg.max_steps, initial=run.step, disable=not grid.is_logger, dynamic_ncols=True,
              mininterval=1.0) as bar, memory.lifetime(run.memory):  # (freed if the loop ends well)
        try:
            stop.deferred = True  # from here a signal is answered between two steps
            while run.step < cfg.max_steps:
                if stopped:  # the same on every rank: read with the last step's numbers
                    if run.saved_step != run.step:
                        save(run)
                    break
                t0 = time.perf_counter()
                row = train_step(run, stop)
                signum = row.pop("signal")  # (after the last step the run is done: it ends there)
                stopped = signum if row["step"] < cfg.max_steps else 0
                if row.pop("spike"):
                    roll_back(run, row, bar)
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
                row["tokens_per_sec"] = tokens_per_step / dt
                run.grid.observer.step_end(row)  # instruments add what they measured (mfu, comm_s) and report
                if run.device.type == "cuda":  # the most this rank's step held (tests/bench.py measures CPUs)
                    row["peak_mem_gb"] = torch.cuda.max_memory_allocated(run.device) / 1e9
                    torch.cuda.reset_peak_memory_stats(run.device)
                if run.scaler.enabled:
                    row["loss_scale"] = run.scaler.scale
                run.step += 1
                after_step(run, row, bar)
                log_saves(run, step_times)
                last = row
        except BaseException:
            run.grid.observer.run_end("failed")
            raise
        finally:
            run.saver.wait()  # never exit with a save half-done
    log_saves(run, step_times)
    if stopped:
        run.metrics.log(event="stop", signal=signal.Signals(stopped).name, step=run.step)
    run.grid.observer.run_end("stopped" if stopped else "finished")
    if stopped:
        raise interrupt.Stopped(stopped, run.step)
    return last


def after_step(run: Run, row: dict, bar) -> None:
    """Evaluate and sample, log, save, and obey --crash-at (in that order: a checkpoint at step N
    comes with step N's line in metrics.jsonl)."""
    cfg = run.cfg
    if run.step % cfg.eval_every == 0 or run.step == cfg.max_steps:
        row["val_loss"] = evaluate(run)
        text = sample(run, cfg.sample_tokens) if cfg.sample_tokens else ""
        if run.grid.is_logger:
            bar.write(f"step {run.step} val {row['val_loss']:.3f}" + (f" | sample: {text!r}"[:400] if text else ""))
    run.metrics.log(**row)
    run.grid.observer.step_written(row)
    bar.update(1)
    bar.set_postfix(loss=f"{row['loss']:.3f}", lr=f"{row['lr']:.1e}", tok_s=f"{row['tokens_per_sec']:.0f}",
                    **({"aux": f"{row['moe_aux']:.3f}", "z": f"{row['moe_z']:.2f}"} if "moe_aux" in row else {}),
                    **({"mfu": f"{row['mfu']:.1%}"} if "mfu" in row else {}),
                    **({"mem": f"{row['peak_mem_gb']:.1f}G"} if "peak_mem_gb" in row else {}))
    if run.step == cfg.max_steps:  # the last one is always written
        save(run)
    elif cfg.ckpt_every and run.step % cfg.ckpt_every == 0 and not save(run, skippable=True):
        run.metrics.log(event="checkpoint skipped", step=run.step, writing=run.saver.writing)
        if run.grid.is_logger:
            bar.write(f"step {run.step}: checkpoint skipped: the one of step {run.saver.writing} is still being "
                      "written (a disk this slow needs a larger --ckpt-every)")
    checkpoint.to_memory(run.memory, run.step, run.state_dict, run.model, run.opt)  # when due
    if interrupt.crash_due(cfg.crash_at, run.grid.rank, f"step:{run.step}"):
        run.saver.wait()
        os.kill(os.getpid(), signal.SIGKILL)


def log_saves(run: Run, step_times: list[float]) -> None:
    """A metrics event per finished checkpoint: its size, how long it took to complete, and what it
    cost the training loop (`blocking_s`) next to a typical step (`step_s`, the median of recent ones)."""
    for done in run.saver.pop_finished():
        done["step_s"] = median(step_times) if step_times else float("nan")
        run.metrics.log(event="checkpoint", **done)
        run.grid.observer.saved(done)


def roll_back(run: Run, row: dict, bar) -> None:
    """A loss spike: drop the update, go back to the last complete checkpoint, and never draw the
    offending batch again (PaLM, section 5.1, does the same by hand). The steps between the
    checkpoint and the spike are replayed exactly: same batches, same RNG. A spike that keeps coming
    back is not one bad batch: after --max-rollbacks in a row, the run stops."""
    run.saver.wait()
    run.spikes.append((row["step"], row["batch"]))
    if len(run.spikes) > run.cfg.max_rollbacks:
        run.metrics.log(event="spike", **row, gave_up=True)
        steps, batches = (", ".join(str(x) for x in xs) for xs in zip(*run.spikes))
        raise FloatingPointError(f"the spike guard rolled back {len(run.spikes) - 1} times in a row and step "
                                 f"{row['step']} spiked again (spikes at steps {steps}, on batches {batches}): "
                                 "the instability is not one bad batch; lower --lr, or raise --spike-z or "
                                 "--max-rollbacks")
    skip = run.skip_batches + [row["batch"]]
    restore(run, announce=False)  # with no checkpoint yet, the run just continues without this batch
    run.skip_batches = skip
    run.metrics.truncate(run.step)  # the replaced attempt's step lines go; event lines stay
    run.metrics.log(event="spike", **row, rolled_back_to=run.step)
    if run.grid.is_logger:  # through the bar, which clears itself first (a print would land on its line)
        bar.write(f"step {row['step']}: loss {row['loss']:.3f} is a spike; rolled back to step {run.step} "
                  f"and will skip batch {row['batch']}")


def main(argv=None) -> None:
    cfg = config.parse_args(argv)
    stop = interrupt.Stop()  # SIGINT, SIGTERM: at once during set-up; between two steps once training
    try:
        instruments = config.has_instruments(cfg)
        if cfg.init_from:  # (refused above where there are no instruments)
            from instruments import hf
            run = setup(cfg, *hf.start(cfg.init_from))
        else:
            run = setup(cfg)
        if instruments:
            from instruments import observers
            run.grid.observer = observers.attach(run)
        last = train(run, stop)
        if run.grid.is_logger:
            print(f"done: step {run.step}" + (f", loss {last['loss']:.4f}" if last else
                                              f" (nothing left to do: the run in {cfg.out} has finished; --fresh "
                                              "starts a new one there, a larger --max-steps continues it)")
                  + (f", val loss {last['val_loss']:.4f}" if "val_loss" in last else ""))
    except interrupt.Stopped as e:  # every rank stopped at the same step: rank 0 says so, all leave
        e.leave()
    except (config.ConfigError, parallel.LayoutError, checkpoint.IncompatibleCheckpoint) as e:
        if torch.distributed.is_initialized() and type(e) is not checkpoint.IncompatibleCheckpoint:
            cli.fail(f"error: {e}")  # found by some ranks only: each says what it found
        cli.stop_every_rank(str(e))  # found by all alike (a checkpoint: all read the same manifest)
    except (data.DataError, checkpoint.CheckpointError, rundir.RunDirError, FloatingPointError) as e:
        cli.fail(f"error: {e}")
    except interrupt.PeerError as e:  # a dead or hung peer: one line instead of a traceback wall
        cli.fail(f"error: {e.where}: a peer process failed or timed out ({e.detail}); a restart resumes from the "
                 "last complete checkpoint in --out", 3, cause=False)
    finally:
        parallel.shutdown()


if __name__ == "__main__":
    main()
