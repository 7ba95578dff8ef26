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

Mixed precision (lesson 02): bf16 autocast needs nothing else. fp16 has 5 exponent bits, so
small gradients underflow to zero: the loss is multiplied by a large scale before backward
and the gradients divided by it after. When the scale is too large, some gradient overflows to
inf; the step is skipped and the scale halved (`LossScaler`, written here rather than taken
from torch because it is a lesson).

Checkpoints (lesson 04) are written by checkpoint.py; a run whose --out holds one resumes from
it. The loss-spike guard rolls back to the last checkpoint and skips the batch that caused it.
"""

import argparse
import json
import math
import os
import random
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import checkpoint
import data
import kernels
import model as gpt
import parallel


def arg(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


CACHE_DIR = str(data.DEFAULT_CACHE_DIR)  # (inside the class, `data` is the field)


@dataclass
class TrainConfig:
    # data
    data: str = arg("stdlib", "corpus: 'stdlib' (Python's own library), 'shakespeare', or a file/dir/glob")
    tokenizer: str = arg("gpt2", "tokenizer: 'gpt2' (BPE) or 'byte'", choices=["gpt2", "byte"])
    cache_dir: str = arg(CACHE_DIR, "where prepared token shards and the tokenizer live")
    # model
    preset: str = arg("auto", "model size: auto (gpt2 on CUDA, mini on CPU) or one of "
                      + ", ".join(gpt.PRESETS))
    init_from: str = arg("", "start from Hugging Face GPT-2 weights: a local model directory (config.json "
                         "and model.safetensors or pytorch_model.bin); its config replaces --preset")
    seq_len: int = arg(0, "tokens per sequence (0: the model's context on CUDA, 128 on CPU)")
    dropout: float = arg(0.0, "dropout probability")
    attn: str = arg("auto", "attention backend (auto: Triton on CUDA, SDPA elsewhere)",
                    choices=list(kernels.BACKENDS))
    # optimization
    max_steps: int = arg(0, "optimizer steps (0: 5000 on CUDA, 200 on CPU: about 5 minutes)")
    batch_size: int = arg(0, "global batch in sequences per optimizer step (0: 64 on CUDA, 8 on CPU)")
    micro_batch_size: int = arg(0, "sequences per forward/backward on one rank; the rest is gradient "
                                "accumulation (0: the whole per-rank batch)")
    lr: float = arg(0.0, "peak learning rate (0: 6e-4 on CUDA, as GPT-2 124M trains; 2e-3 on CPU, where the "
                    "model is small)")
    min_lr: float = arg(-1.0, "learning rate at the end of the cosine decay (-1: --lr / 10)")
    warmup_steps: int = arg(0, "linear warm-up steps (0: 5%% of max-steps)")
    weight_decay: float = arg(0.1, "AdamW weight decay, on matrices and embeddings only")
    clip: float = arg(1.0, "clip the global gradient norm to this (0: off)")
    precision: str = arg("auto", "fp32, bf16 (autocast) or fp16 (autocast + loss scaling); auto: bf16 on "
                         "CUDA, fp32 on CPU", choices=["auto", "fp32", "bf16", "fp16"])
    loss_scale: float = arg(2.0**16, "fp16: initial loss scale")
    loss_scale_window: int = arg(1000, "fp16: grow the scale after this many steps without overflow")
    max_bad_steps: int = arg(5, "stop after this many non-finite steps in a row")
    # evaluation and logging
    eval_every: int = arg(0, "evaluate (and print a sample) every N steps (0: 10 times per run)")
    eval_batches: int = arg(4, "global batches of validation data per evaluation")
    sample_tokens: int = arg(96, "tokens to sample at each evaluation (0: none)")
    # run
    out: str = arg("out", "run directory: metrics.jsonl, checkpoints")
    seed: int = arg(1337, "seed for the initial weights and the data order")
    device: str = arg("auto", "auto, cpu, cuda")
    fresh: bool = arg(False, "ignore checkpoints in --out and start from step 0")
    # checkpoints and guards
    ckpt_every: int = arg(0, "save a checkpoint every N steps (0: only at the end)")
    keep: int = arg(2, "checkpoints to keep (older ones are deleted once a newer one is complete)")
    async_ckpt: bool = arg(False, "write checkpoints from a background thread while training goes on")
    spike_z: float = arg(0.0, "loss-spike guard (0: off): a loss more than Z standard deviations above "
                         "the mean of the last --spike-window losses, and 20%% above it, is a spike: "
                         "roll back to the last checkpoint and skip that batch")
    spike_window: int = arg(20, "losses the spike guard keeps statistics over")
    crash_at: str = arg("", "fault injection for tests: 'step:N' SIGKILLs the process after step N, "
                        "'save:N' in the middle of the save at step N, 'rank:R:step:N' only rank R (only "
                        "in a launcher's first attempt, so a restarted job runs through)")
    poison_step: int = arg(-1, "fault injection for tests: replace batch N (the one step N draws) with one rare token "
                           "repeated")
    # parallelism (launch with torchrun; data-parallel degree = processes / (tp * pp))
    tp: int = arg(1, "tensor-parallel degree (ranks that split each layer)")
    pp: int = arg(1, "pipeline-parallel degree (stages of layers)")
    sp: bool = arg(False, "sequence parallelism: shard LayerNorm/dropout activations along the sequence "
                   "across the tensor-parallel ranks")
    pp_schedule: str = arg("1f1b", "pipeline schedule", choices=list(parallel.SCHEDULES))
    zero: int = arg(0, "1: ZeRO-1, shard the optimizer state across data-parallel ranks", choices=[0, 1])
    bucket_mb: float = arg(25.0, "data-parallel gradient bucket size in MB")
    no_overlap: bool = arg(False, "all-reduce gradients after the backward instead of during it")
    timeout: float = arg(300.0, "seconds a collective may wait for a peer before the run fails")
    print_grid: bool = arg(False, "print the process grid at start-up")
    print_schedule: bool = arg(False, "print the pipeline schedule the stages ran on the first step")
    comm_report: bool = arg(False, "print the bytes every collective moved on the first step, next to "
                            "the formula they should match")


def parse_args(argv=None) -> TrainConfig:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="Every flag has a default; "
                                "see README.md and lessons/ for what they do.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        meta = dict(f.metadata)
        if f.type is bool or f.type == "bool":
            p.add_argument(flag, action="store_true", help=meta["help"])
        else:
            p.add_argument(flag, type=type(f.default), default=f.default, **meta)
    return TrainConfig(**vars(p.parse_args(argv)))


class ConfigError(ValueError):
    """A flag combination that cannot work; printed as one line."""


# ----------------------------------------------------------------------------- defaults by device


def resolve(cfg: TrainConfig, device: torch.device) -> TrainConfig:
    """Fill the 'auto' / 0 defaults for this device and check the flags make sense together."""
    cuda = device.type == "cuda"
    if cfg.init_from:
        block = checkpoint.hf_config(Path(cfg.init_from))["block_size"]
        cfg.preset = f"Hugging Face ({cfg.init_from})"
    else:
        if cfg.preset == "auto":
            cfg.preset = "gpt2" if cuda else "mini"
        if cfg.preset not in gpt.PRESETS:
            raise ConfigError(f"unknown preset {cfg.preset!r}; choose one of: {', '.join(gpt.PRESETS)}")
        block = gpt.PRESETS[cfg.preset][3]
    cfg.seq_len = cfg.seq_len or (block if cuda else min(block, 128))
    if cfg.seq_len > block:
        raise ConfigError(f"--seq-len {cfg.seq_len} is longer than the {cfg.preset} model's context "
                          f"({block} tokens); use --seq-len {block} or less")
    cfg.max_steps = cfg.max_steps or (5000 if cuda else 200)
    cfg.batch_size = cfg.batch_size or (64 if cuda else 8)
    cfg.lr = cfg.lr or (6e-4 if cuda else 2e-3)
    cfg.min_lr = cfg.lr / 10 if cfg.min_lr < 0 else cfg.min_lr
    cfg.warmup_steps = cfg.warmup_steps or max(1, cfg.max_steps // 20)
    cfg.eval_every = cfg.eval_every or max(1, cfg.max_steps // 10)
    if cfg.precision == "auto":
        cfg.precision = "bf16" if cuda and torch.cuda.is_bf16_supported() else "fp32"
    for name in ("max_steps", "batch_size", "seq_len", "eval_batches", "tp", "pp", "keep"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    return cfg


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA device is visible; use --device cpu")
    return torch.device(name)


# ----------------------------------------------------------------------------- optimization


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to --lr, then half a cosine down to --min-lr at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device, sync=None):
    """AdamW (Loshchilov & Hutter); decay only tensors of 2+ dims: matmul weights and embeddings,
    not biases or LayerNorm gains (decaying a gain toward 0 fights the normalization). With
    --zero 1 the same update runs on this rank's shard only (parallel.ZeroAdamW)."""
    if cfg.zero:
        param_dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
        return parallel.ZeroAdamW(sync, cfg.lr, (0.9, 0.95), 1e-8, cfg.weight_decay, param_dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, **fast)


class LossScaler:
    """Dynamic loss scaling for fp16 (Micikevicius et al. 2018, "Mixed Precision Training").

    scale the loss by S before backward  ->  gradients are S times larger, so small ones survive
    unscale: grads /= S, then look for inf/NaN
      overflow    -> skip this step, S *= 0.5
      N clean steps in a row -> S *= 2 (probe for a larger scale again)
    """

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, window: int = 1000):
        self.enabled, self.scale, self.window, self.good_steps = enabled, init_scale if enabled else 1.0, window, 0

    def unscale_(self, grads: list[torch.Tensor]) -> None:
        if self.enabled:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.scale, self.good_steps = self.scale * 0.5, 0
            if self.scale < 2.0**-24:
                raise FloatingPointError("fp16 loss scale collapsed below 2^-24: the gradients are inf or "
                                         "NaN whatever the scale; train in bf16 or fp32")
        else:
            self.good_steps += 1
            if self.good_steps % self.window == 0:
                self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = state["scale"], state["good_steps"]


def clip_(grads: list[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> None:
    """Scale every gradient by min(1, max_norm / ||g||): the direction is kept, the step bounded."""
    if max_norm > 0:
        torch._foreach_mul_(grads, torch.clamp(max_norm / (total_norm + 1e-6), max=1.0))


class SpikeGuard:
    """Flags a loss that is both Z standard deviations and 20% above the recent mean. The second
    condition keeps a flat, low-noise curve (tiny std) from flagging ordinary wiggles."""

    def __init__(self, z: float, window: int):
        self.z, self.window, self.history = z, window, []

    def is_spike(self, loss: float) -> bool:
        if self.z <= 0 or len(self.history) < self.window:
            return False
        mean = sum(self.history) / len(self.history)
        std = math.sqrt(sum((x - mean) ** 2 for x in self.history) / len(self.history))
        return loss > mean + self.z * std and loss > 1.2 * mean

    def record(self, loss: float) -> None:
        self.history = (self.history + [loss])[-self.window:]


# ----------------------------------------------------------------------------- measuring


def peak_flops(device: torch.device, precision: str) -> float:
    """Peak dense FLOP/s, the denominator of MFU: a table for GPUs (16-bit tensor cores; TF32 for
    fp32), a measured fp32 matmul rate on CPU."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        table = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12,
                 "4090": 165e12, "3090": 71e12, "V100": 125e12, "T4": 65e12}
        peak = next((v for k, v in table.items() if k in name), 312e12)
        return peak / 2 if precision == "fp32" else peak
    return measured_matmul_flops()


def measured_matmul_flops(n: int = 1024, seconds: float = 0.3) -> float:
    """This CPU's fp32 matmul rate: the best a well-shaped matmul achieves here."""
    gen = torch.Generator().manual_seed(0)  # its own stream: the run's RNG state is left alone
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    a @ b
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
    return 2 * n**3 * reps / (time.perf_counter() - t0)


class Metrics:
    """One JSON line per optimizer step in <out>/metrics.jsonl, written by rank 0 only."""

    def __init__(self, path: Path, enabled: bool, resume_step: int):
        self.path, self.enabled = path, enabled
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
        self.truncate(resume_step)

    def truncate(self, step: int) -> None:
        """Drop lines from after `step`: a resumed or rolled-back run writes them again."""
        if self.enabled and self.path.exists():
            keep = [line for line in self.path.read_text().splitlines()
                    if line and json.loads(line).get("step", 0) <= step]
            self.path.write_text("".join(line + "\n" for line in keep))

    def log(self, **row) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")


# ----------------------------------------------------------------------------- the loop


@dataclass
class Run:
    """Everything a step needs, built once by `setup`."""
    cfg: TrainConfig
    device: torch.device
    grid: parallel.Grid
    tok: data.Tokenizer
    model_cfg: gpt.GPTConfig
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    scaler: LossScaler
    loader: data.Loader
    val: list
    autocast: object
    guard: SpikeGuard
    sync: parallel.GradSync | None = None  # data-parallel gradient averaging
    pipeline: parallel.Pipeline | None = None
    step: int = 0
    skip_batches: list = field(default_factory=list)  # global batch numbers the spike guard skips
    batches_drawn: int = 0


def setup(cfg: TrainConfig) -> Run:
    cfg = resolve(cfg, pick_device(cfg.device))
    grid = parallel.init_grid(cfg.tp, cfg.pp, pick_device(cfg.device), cfg.timeout)
    device = grid.device
    torch.manual_seed(cfg.seed)  # dropout's stream; the same on every rank, as tensor parallelism needs
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    prepared = grid.rank0_first(lambda: data.prepare(data.DataConfig(
        source=cfg.data, tokenizer=cfg.tokenizer, cache_dir=cfg.cache_dir), verbose=grid.is_logger))
    tok = data.get_tokenizer(cfg.tokenizer, cfg.cache_dir)
    if cfg.batch_size % grid.dp:
        raise ConfigError(f"--batch-size {cfg.batch_size} is not divisible by the data-parallel degree {grid.dp}")
    per_rank = cfg.batch_size // grid.dp
    cfg.micro_batch_size = cfg.micro_batch_size or per_rank
    if per_rank % cfg.micro_batch_size:
        raise ConfigError(f"--micro-batch-size {cfg.micro_batch_size} does not divide the per-rank batch "
                          f"{per_rank} (= --batch-size {cfg.batch_size} / {grid.dp} data-parallel ranks)")
    loader = data.Loader(data.load_tokens(prepared / "train.bin"), cfg.seq_len, cfg.batch_size, cfg.seed,
                         rank=grid.dp_rank, world=grid.dp)
    val = data.eval_batches(data.load_tokens(prepared / "val.bin"), cfg.seq_len, cfg.batch_size,
                            cfg.eval_batches, rank=grid.dp_rank, world=grid.dp)
    model_cfg = model_config(cfg, tok)
    model = parallel.build_model(model_cfg, grid, cfg.seed, device, cfg.seq_len, cfg.sp)
    if cfg.init_from:  # before the optimizer, so ZeRO's master weights start from these values
        checkpoint.load_hf(model, Path(cfg.init_from))
    sync = None
    if grid.dp > 1 or cfg.zero:
        sync = parallel.GradSync(model, grid, cfg.bucket_mb, overlap=not cfg.no_overlap, zero=bool(cfg.zero))
    opt = make_optimizer(model, cfg, device, sync)
    pipeline = parallel.Pipeline(model, grid, cfg.pp_schedule) if grid.pp > 1 else None
    if pipeline and cfg.pp_schedule == "1f1b" and cfg.micro_batch_size * grid.pp > per_rank:
        grid.log(f"warning: {per_rank // cfg.micro_batch_size} micro-batches for {grid.pp} stages: the "
                 "pipeline bubble dominates; use more micro-batches (smaller --micro-batch-size)")
    scaler = LossScaler(cfg.precision == "fp16", cfg.loss_scale, cfg.loss_scale_window)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
    autocast = torch.autocast(device.type, dtype=dtype) if dtype else nullcontext()
    guard = SpikeGuard(cfg.spike_z, cfg.spike_window)
    if cfg.print_grid:
        grid.log(str(grid))
    return Run(cfg, device, grid, tok, model_cfg, model, opt, scaler, loader, val, autocast, guard,
               sync=sync, pipeline=pipeline)


def model_config(cfg: TrainConfig, tok: data.Tokenizer) -> gpt.GPTConfig:
    """The architecture: a preset, or the config.json of the Hugging Face model to start from."""
    if not cfg.init_from:
        return gpt.config_from_preset(cfg.preset, tok.vocab_size, dropout=cfg.dropout, attn=cfg.attn)
    hf = checkpoint.hf_config(Path(cfg.init_from))
    if hf["vocab_size"] != tok.vocab_size:
        raise ConfigError(f"{cfg.init_from} has a vocabulary of {hf['vocab_size']} tokens but the {tok.name} "
                          f"tokenizer has {tok.vocab_size}; use the tokenizer the model was trained with")
    return gpt.GPTConfig(**hf, dropout=cfg.dropout, attn=cfg.attn)


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
    return number, batch.to(run.device)


def forward_backward(run: Run, batch: torch.Tensor) -> torch.Tensor:
    """Gradient accumulation over micro-batches (or a pipeline schedule over them); returns this
    rank's mean loss over its micro-batches (0 on pipeline stages without the loss)."""
    micro = batch.split(run.cfg.micro_batch_size)  # rows of T + 1 tokens: inputs and next-token targets
    scale = run.scaler.scale
    if run.pipeline:
        total = run.pipeline.run(micro, run.autocast, sp=run.cfg.sp, scale=scale,
                                 before_last_backward=lambda: set_sync(run, True))
    else:
        total = torch.zeros((), device=run.device)
        for i, mb in enumerate(micro):
            set_sync(run, i == len(micro) - 1)  # communicate only on the last micro-batch
            with run.autocast:
                _, loss = run.model(mb[:, :-1], mb[:, 1:])
            (loss * (scale / len(micro))).backward()
            total += loss.detach() / len(micro)
    return total


def set_sync(run: Run, on: bool) -> None:
    if run.sync is not None:
        run.sync.sync = on


def train_step(run: Run) -> dict:
    """One optimizer step. The update is dropped when the loss or gradients are not finite
    (`skipped`) or the loss is a spike (`spike`: the caller rolls back)."""
    cfg, lr = run.cfg, lr_at(run.step, run.cfg)
    run.grid.traffic.reset()  # count this step's bytes only
    batch_number, batch = next_batch(run)
    if run.pipeline:
        set_sync(run, False)  # the pipeline turns it on before the last backward
    local_loss = forward_backward(run, batch)
    parallel.finish_grads(run.model, run.grid, run.sync)
    loss = run.grid.global_loss(local_loss)  # after the gradients: nothing delays their buckets
    grads = [p.grad for p in run.model.parameters() if p.grad is not None]
    run.scaler.unscale_(grads)
    norm = parallel.grad_norm(run.model, run.grid, run.sync)
    finite_loss, finite = bool(torch.isfinite(loss)), bool(torch.isfinite(norm))
    spike = finite_loss and run.guard.is_spike(loss.item())
    if finite_loss and finite and not spike:
        clip_(grads, norm, cfg.clip)
        for group in run.opt.param_groups:
            group["lr"] = lr
        run.opt.step()
        run.guard.record(loss.item())
    if not spike:
        run.scaler.update(overflow=not finite)
    run.opt.zero_grad(set_to_none=True)
    if run.sync is not None:
        run.sync.zero_grad()
    # fp16 overflow is routine (the scaler backs off); anywhere else a non-finite step is bad
    bad = not finite_loss or (not finite and not run.scaler.enabled)
    return {"step": run.step + 1, "loss": loss.item(), "lr": lr, "grad_norm": norm.item(),
            "skipped": not (finite_loss and finite), "bad": bad, "spike": spike, "batch": batch_number}


@torch.no_grad()
def evaluate(run: Run) -> float:
    run.model.eval()
    losses = []
    for batch in run.val:
        batch = batch.to(run.device)
        if run.pipeline:
            loss = run.pipeline.run(batch.split(run.cfg.micro_batch_size), run.autocast, sp=run.cfg.sp,
                                    train=False)
        else:
            with run.autocast:
                _, loss = run.model(batch[:, :-1], batch[:, 1:])
        losses.append(run.grid.global_loss(loss.float()))
    run.model.train()
    return torch.stack(losses).mean().item()


@torch.no_grad()
def sample(run: Run, n_tokens: int) -> str:
    """A continuation of <|endoftext|> (the start of a document), the same on every rank."""
    run.model.eval()
    start = torch.full((1, 1), run.tok.eot, dtype=torch.long, device=run.device)
    gen = torch.Generator(device=run.device).manual_seed(run.cfg.seed)
    with run.autocast:
        out = parallel.generate(run.model, run.grid, start, n_tokens, temperature=0.8, top_k=50, generator=gen)
    run.model.train()
    return run.tok.decode(out[0, 1:].tolist())


def save(run: Run, saver: checkpoint.Saver) -> None:
    saver.save(run.step, model=run.model, opt=run.opt, grid=run.grid, extra={
        "scaler": run.scaler.state_dict(), "loader": run.loader.state_dict(),
        "batches_drawn": run.batches_drawn, "skip_batches": run.skip_batches, "guard": run.guard.history},
        meta=checkpoint_meta(run), crash_mid_save=crash_due(run, f"save:{run.step}"))


def crash_due(run: Run, event: str) -> bool:
    """Is --crash-at asking this process to die at `event`?"""
    spec = run.cfg.crash_at
    if spec.startswith("rank:"):
        _, rank, spec = spec.split(":", 2)
        if int(rank) != run.grid.rank or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return False
    return spec == event


def checkpoint_meta(run: Run) -> dict:
    """What a checkpoint must agree with to be resumed: the model, the tokenizer, the batch math."""
    return {"model": run.model_cfg.architecture(), "tokenizer": run.tok.identity(),
            "batch_size": run.cfg.batch_size, "seq_len": run.cfg.seq_len, "seed": run.cfg.seed,
            "data": run.cfg.data, "config": asdict(run.cfg)}


def restore(run: Run, path: Path) -> None:
    extra = checkpoint.load(path, model=run.model, opt=run.opt, grid=run.grid, meta=checkpoint_meta(run))
    run.scaler.load_state_dict(extra["scaler"])
    run.loader.load_state_dict(extra["loader"])
    run.batches_drawn, run.skip_batches = extra["batches_drawn"], list(extra["skip_batches"])
    run.guard.history = list(extra["guard"])
    run.step = extra["step"]


def train(run: Run) -> dict:
    """The loop: resume if --out holds a checkpoint, then step, evaluate, log and save until
    --max-steps. Returns the last step's row of metrics."""
    cfg, grid = run.cfg, run.grid
    out = Path(cfg.out)
    saver = checkpoint.Saver(out / "ckpt", keep=cfg.keep, asynchronous=cfg.async_ckpt, grid=grid)
    if not cfg.fresh and (found := checkpoint.latest(out / "ckpt", log=grid.log)):
        restore(run, found)
        grid.log(f"resuming from {found} (step {run.step})")
    metrics = Metrics(out / "metrics.jsonl", grid.is_logger, run.step)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    flops_per_step = gpt.flops_per_token(run.model_cfg, cfg.seq_len) * tokens_per_step
    peak = peak_flops(run.device, cfg.precision) * grid.world
    bad_in_a_row, last = 0, {}
    # the bar goes to stderr; log lines (bar.write) to stdout. `with`: closed even on an error
    with tqdm(total=cfg.max_steps, initial=run.step, disable=not grid.is_logger, dynamic_ncols=True,
              mininterval=1.0) as bar:
        try:
            while run.step < cfg.max_steps:
                t0 = time.perf_counter()
                row = train_step(run)
                if row.pop("spike"):
                    metrics.truncate(roll_back(run, row, saver, out))
                    metrics.log(event="spike", **row, rolled_back_to=run.step)
                    bar.n = run.step
                    continue
                bad_in_a_row = bad_in_a_row + 1 if row.pop("bad") else 0
                if row["skipped"] and grid.is_logger:
                    bar.write(f"step {row['step']}: non-finite loss or gradient, update skipped"
                              + (f" (loss scale now {run.scaler.scale:g})" if run.scaler.enabled else ""))
                if bad_in_a_row >= cfg.max_bad_steps:
                    raise FloatingPointError(f"{bad_in_a_row} steps in a row had a non-finite loss or "
                                             "gradient; lower --lr, or check the data")
                dt = time.perf_counter() - t0
                row.update(tokens_per_sec=tokens_per_step / dt, mfu=flops_per_step / dt / peak)
                if run.scaler.enabled:
                    row["loss_scale"] = run.scaler.scale
                if not last:  # the first step of this process: print what was asked for
                    for text in report(run):
                        bar.write(text)
                run.step += 1
                after_step(run, row, bar, saver, metrics)
                last = row
        finally:
            saver.wait()  # never exit with a save half-done
    return last


def after_step(run: Run, row: dict, bar, saver: checkpoint.Saver, metrics: Metrics) -> None:
    """Evaluate and sample, log, save, and obey --crash-at (in that order: a checkpoint at step N
    comes with step N's line in metrics.jsonl)."""
    cfg = run.cfg
    if run.step % cfg.eval_every == 0 or run.step == cfg.max_steps:
        row["val_loss"] = evaluate(run)
        text = sample(run, cfg.sample_tokens) if cfg.sample_tokens else ""
        if run.grid.is_logger:
            bar.write(f"step {run.step} val {row['val_loss']:.3f}" + (f" | sample: {text!r}"[:400] if text else ""))
    metrics.log(**row)
    bar.update(1)
    bar.set_postfix(loss=f"{row['loss']:.3f}", lr=f"{row['lr']:.1e}", tok_s=f"{row['tokens_per_sec']:.0f}",
                    mfu=f"{row['mfu']:.1%}")
    if (cfg.ckpt_every and run.step % cfg.ckpt_every == 0) or run.step == cfg.max_steps:
        save(run, saver)
    if crash_due(run, f"step:{run.step}"):
        saver.wait()
        os.kill(os.getpid(), signal.SIGKILL)


def report(run: Run) -> list[str]:
    """--comm-report and --print-schedule: what the first step moved and how the pipeline ran.
    Every rank takes part (the numbers are gathered); rank 0 gets the text."""
    cfg, grid, out = run.cfg, run.grid, []
    if cfg.comm_report:
        expected = parallel.expected_traffic(run.model_cfg, grid, cfg.micro_batch_size,
                                             cfg.batch_size // grid.dp // cfg.micro_batch_size, cfg.seq_len,
                                             cfg.sp, run.sync, run.model)
        text = parallel.comm_report(grid, expected)
        wrong = torch.tensor(float(sum(grid.traffic.counts.get(k, [0, 0])[1] != v for k, v in expected.items())
                                   + sum(k not in expected for k in grid.traffic.counts)), device=grid.device)
        grid.all_reduce(wrong, "world")
        out.append(text + f"\nformula matches measurement on every rank: {'yes' if wrong == 0 else 'NO'}"
                   + ("" if cfg.precision == "fp32" else " (the formula assumes fp32 activations)"))
        if run.sync is not None:
            out.append(parallel.overlap_report(run.sync))
        out.append(parallel.zero_memory_report(run.opt, run.model, grid))
    if cfg.print_schedule and run.pipeline:
        ops = run.pipeline.all_stage_ops()
        peaks = torch.zeros(grid.pp, dtype=torch.long, device=grid.device)
        grid.all_gather(peaks, torch.tensor([run.pipeline.peak_live], device=grid.device), "pp")
        out.append(f"pipeline schedule {cfg.pp_schedule}, {len(ops)} stages, {len(ops[0]) // 2} micro-batches:\n"
                   + parallel.draw_schedule(ops) + "\nmicro-batches of activations held at once, by stage: "
                   + ", ".join(f"{s}: {int(n)}" for s, n in enumerate(peaks)))
    return out if grid.is_logger else []


def roll_back(run: Run, row: dict, saver: checkpoint.Saver, out: Path) -> int:
    """A loss spike: drop the update, go back to the last complete checkpoint, and never draw the
    offending batch again (PaLM, section 5.1, does the same by hand). The steps between the
    checkpoint and the spike are replayed exactly: same batches, same RNG."""
    saver.wait()
    skip = run.skip_batches + [row["batch"]]
    found = checkpoint.latest(out / "ckpt", log=run.grid.log)
    if found:
        restore(run, found)
    run.skip_batches = skip
    run.grid.log(f"step {row['step']}: loss {row['loss']:.3f} is a spike; rolled back to step {run.step} "
                 f"and will skip batch {row['batch']}")
    return run.step


def main(argv=None) -> None:
    cfg = parse_args(argv)
    try:
        run = setup(cfg)
        last = train(run)
        if run.grid.is_logger:
            print(f"done: step {run.step}" + (f", loss {last['loss']:.4f}" if last else " (nothing left to do)")
                  + (f", val loss {last['val_loss']:.4f}" if "val_loss" in last else ""))
    except (ConfigError, data.DataError, checkpoint.CheckpointError, parallel.LayoutError,
            FloatingPointError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except parallel.PeerError as e:  # a dead or hung peer: one line instead of a traceback wall
        print(f"error: a peer process failed or timed out ({e}); a restart resumes from the last "
              "complete checkpoint in --out", file=sys.stderr)
        sys.exit(3)
    finally:
        parallel.shutdown()


if __name__ == "__main__":
    main()
