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
import math
import os
import random
import re
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from statistics import median

import numpy as np
import torch
from tqdm import tqdm

import checkpoint
import data
import kernels
import model as gpt
import parallel
import rundir


def arg(default, help: str, check: tuple | None = None, **kw):
    """A flag: its default, its help, and optionally (test, "what it must be") checked by the parser."""
    return field(default=default, metadata={"help": help, "check": check, **kw})


def at_least(lo, note: str = "") -> tuple:
    return (lambda v: v >= lo, f"must be >= {lo}{note}")


AUTO = " (0: automatic)"
CACHE_DIR = str(data.DEFAULT_CACHE_DIR)  # (inside the class, `data` is the field)
CRASH_AT = re.compile(r"(rank:\d+:)?(step|save):\d+")


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
    seq_len: int = arg(0, "tokens per sequence (0: the model's context on CUDA, 128 on CPU)", at_least(0))
    dropout: float = arg(0.0, "dropout probability", (lambda v: 0 <= v < 1, "must be in [0, 1)"))
    attn: str = arg("auto", "attention backend (auto: our Triton kernel on CUDA where it applies, SDPA "
                    "elsewhere)", choices=list(kernels.BACKENDS))
    compile: bool | None = arg(None, "torch.compile each transformer block (default: on with CUDA, off on "
                               "CPU, where compiling costs more than it saves at these sizes)")
    # optimization
    max_steps: int = arg(0, "optimizer steps (0: on CUDA, two epochs of the training data, at most 5000; "
                         "on CPU 200, about 5 minutes)", at_least(0))
    batch_size: int = arg(0, "global batch in sequences per optimizer step (0: 64 on CUDA, 8 on CPU)", at_least(0))
    micro_batch_size: int = arg(0, "sequences per forward/backward on one rank; the rest is gradient "
                                "accumulation (0: the whole per-rank batch)", at_least(0))
    lr: float = arg(0.0, "peak learning rate (0: 6e-4 on CUDA, as GPT-2 124M trains; 2e-3 on CPU, where the "
                    "model is small)", at_least(0, AUTO))
    min_lr: float = arg(-1.0, "learning rate at the end of the cosine decay (-1: --lr / 10)",
                        (lambda v: v >= 0 or v == -1, "must be >= 0, or -1 for --lr / 10"))
    warmup_steps: int = arg(0, "linear warm-up steps (0: 5%% of max-steps)", at_least(0))
    weight_decay: float = arg(0.1, "AdamW weight decay, on matrices and embeddings only", at_least(0))
    clip: float = arg(1.0, "clip the global gradient norm to this (0: off)", at_least(0))
    precision: str = arg("auto", "fp32, bf16 (autocast) or fp16 (autocast + loss scaling); auto: bf16 on "
                         "CUDA, fp32 on CPU", choices=["auto", "fp32", "bf16", "fp16"])
    loss_scale: float = arg(2.0**16, "fp16: initial loss scale", (lambda v: v > 0, "must be > 0"))
    loss_scale_window: int = arg(1000, "fp16: grow the scale after this many steps without overflow", at_least(1))
    max_bad_steps: int = arg(5, "stop after this many non-finite steps in a row", at_least(1))
    # evaluation and logging
    eval_every: int = arg(0, "evaluate (and print a sample) every N steps (0: 10 times per run)", at_least(0))
    eval_batches: int = arg(4, "global batches of validation data per evaluation (fewer if the split is "
                            "smaller)", at_least(1))
    sample_tokens: int = arg(96, "tokens to sample at each evaluation (0: none)", at_least(0))
    # run
    out: str = arg("out", "run directory: metrics.jsonl, checkpoints (one run at a time holds it)")
    seed: int = arg(1337, "seed for the initial weights and the data order",
                    (lambda v: 0 <= v < 2**32, "must be in [0, 2^32)"))
    device: str = arg("auto", "auto (CUDA when there is a GPU), cpu, cuda")
    fresh: bool = arg(False, "start a new run at step 0: the previous run in --out is moved to --out/previous/")
    # checkpoints and guards
    ckpt_every: int = arg(0, "save a checkpoint every N steps (0: only at the end)", at_least(0))
    keep: int = arg(2, "checkpoints to keep (older ones are deleted once a newer one is complete)", at_least(1))
    async_ckpt: bool = arg(False, "save checkpoints in the background: training pays only for a copy")
    spike_z: float = arg(0.0, "loss-spike guard (0: off): a loss more than Z standard deviations above "
                         "the mean of the last --spike-window losses, and 20%% above it, is a spike: "
                         "roll back to the last checkpoint and skip that batch", at_least(0))
    spike_window: int = arg(20, "losses the spike guard keeps statistics over", at_least(1))
    max_rollbacks: int = arg(3, "the spike guard gives up (an error) when it rolls back this many times in a "
                             "row without getting past the spike", at_least(1))
    crash_at: str = arg("", "fault injection for tests: 'step:N' SIGKILLs the process after step N, "
                        "'save:N' in the middle of the save at step N, 'rank:R:step:N' only rank R (only "
                        "in a launcher's first attempt, so a restarted job runs through)",
                        (lambda v: v == "" or CRASH_AT.fullmatch(v), "must look like step:N, save:N or "
                         "rank:R:step:N"))
    poison_step: int = arg(-1, "fault injection for tests: replace batch N (the one step N + 1 draws) with one "
                           "rare token repeated (-1: off)", at_least(-1))
    # parallelism (launch with torchrun; data-parallel degree = processes / (tp * pp))
    tp: int = arg(1, "tensor-parallel degree (ranks that split each layer)", at_least(1))
    pp: int = arg(1, "pipeline-parallel degree (stages of layers)", at_least(1))
    sp: bool = arg(False, "sequence parallelism: shard LayerNorm/dropout activations along the sequence "
                   "across the tensor-parallel ranks")
    pp_schedule: str = arg("1f1b", "pipeline schedule", choices=list(parallel.SCHEDULES))
    zero: int = arg(0, "1: ZeRO-1, shard the optimizer state across data-parallel ranks", choices=[0, 1])
    bucket_mb: float = arg(25.0, "data-parallel gradient bucket size in MB", (lambda v: v > 0, "must be > 0"))
    no_overlap: bool = arg(False, "all-reduce gradients after the backward instead of during it")
    timeout: float = arg(300.0, "seconds a collective (or a checkpoint commit) may wait for a peer before the "
                         "run fails", (lambda v: v > 0, "must be > 0"))
    print_grid: bool = arg(False, "print the process grid at start-up")
    print_schedule: bool = arg(False, "print the pipeline schedule the stages ran on the first step")
    comm_report: bool = arg(False, "print the bytes every collective moved on the first step, next to "
                            "the formula they should match")


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"error: {message} (python train.py --help lists every flag)\n")


def checked(kind, check: tuple | None):
    """An argparse type that converts, then tests the value: a bad flag is refused before any work."""
    def convert(text: str):
        value = kind(text)
        if check and not check[0](value):
            raise argparse.ArgumentTypeError(f"{check[1]}, got {text}")
        return value
    convert.__name__ = kind.__name__  # argparse names the type in "invalid int value"
    return convert


def parse_args(argv=None) -> TrainConfig:
    p = OneLineParser(description=__doc__.split("\n")[0], epilog="Every flag has a default; "
                      "see README.md and lessons/ for what they do.",
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        meta = {k: v for k, v in f.metadata.items() if k != "check"}
        if f.type in (bool, "bool"):
            p.add_argument(flag, action="store_true", **meta)
        elif f.type in (bool | None, "bool | None"):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, **meta)
        else:
            p.add_argument(flag, type=checked(type(f.default), f.metadata["check"]), default=f.default, **meta)
    return TrainConfig(**vars(p.parse_args(argv)))


class ConfigError(ValueError):
    """A flag combination that cannot work; printed as one line."""


# ----------------------------------------------------------------------------- defaults by device


def resolve(cfg: TrainConfig, device: torch.device, bf16_ok: bool = True) -> TrainConfig:
    """Fill the 'auto' / 0 defaults that need no data, and check that the flags make sense together,
    before any slow work. (--max-steps and what depends on it wait for the data: `resolve_steps`.)"""
    cuda = device.type == "cuda"
    if cfg.init_from:
        arch = checkpoint.hf_config(Path(cfg.init_from))
        block, n_head, n_embd = arch["block_size"], arch["n_head"], arch["n_embd"]
        cfg.preset = f"Hugging Face ({cfg.init_from})"
    else:
        if cfg.preset == "auto":
            cfg.preset = "gpt2" if cuda else "mini"
        if cfg.preset not in gpt.PRESETS:
            raise ConfigError(f"unknown preset {cfg.preset!r}; choose one of: {', '.join(gpt.PRESETS)}")
        _, n_head, n_embd, block = gpt.PRESETS[cfg.preset]
    cfg.seq_len = cfg.seq_len or (block if cuda else min(block, 128))
    if cfg.seq_len > block:
        raise ConfigError(f"--seq-len {cfg.seq_len} is longer than the {cfg.preset} model's context "
                          f"({block} tokens); use --seq-len {block} or less")
    cfg.batch_size = cfg.batch_size or (64 if cuda else 8)
    cfg.lr = cfg.lr or (6e-4 if cuda else 2e-3)
    cfg.min_lr = cfg.lr / 10 if cfg.min_lr < 0 else cfg.min_lr
    if cfg.precision == "auto":
        cfg.precision = "bf16" if cuda and bf16_ok else "fp32"
    if cfg.compile is None:
        cfg.compile = cuda
    cfg.attn = resolve_attention(cfg, device, n_embd // n_head)
    return cfg


def resolve_attention(cfg: TrainConfig, device: torch.device, head_dim: int) -> str:
    """'auto' becomes a concrete backend once, here, so that compiled code never has to decide; and
    --attn triton where the kernel cannot run is one clear line now, not a traceback later."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision, torch.float32)
    if cfg.attn == "auto":
        return kernels.resolve_backend(device, dtype, head_dim)
    if cfg.attn == "triton" and (problem := kernels.triton_problem(device, dtype, head_dim)):
        raise ConfigError(f"--attn triton: {problem}")
    return cfg.attn


def resolve_steps(cfg: TrainConfig, device: torch.device, train_tokens: int, log=print) -> None:
    """--max-steps 0: on a CPU 200 steps (minutes); on a GPU two epochs of the data, at most 5000 steps,
    so that the default run fits the corpus instead of repeating it dozens of times."""
    if not cfg.max_steps:
        if device.type == "cuda":
            per_step = cfg.batch_size * cfg.seq_len
            cfg.max_steps = max(1, min(5000, math.ceil(2 * train_tokens / per_step)))
            log(f"max-steps {cfg.max_steps}: two epochs of {train_tokens / 1e6:.1f}M training tokens at "
                f"{per_step:,} tokens a step (--max-steps to choose)")
        else:
            cfg.max_steps = 200
    cfg.warmup_steps = cfg.warmup_steps or max(1, cfg.max_steps // 20)
    cfg.eval_every = cfg.eval_every or max(1, cfg.max_steps // 10)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA device is visible; use --device cpu")
    if name != "cpu" and not name.startswith("cuda"):
        raise ConfigError(f"--device {name}: choose auto, cpu or cuda")
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
    saver: checkpoint.Saver
    run_id: str
    lock: object = None  # the open lock file on --out: held for as long as this object lives
    sync: parallel.GradSync | None = None  # data-parallel gradient averaging
    pipeline: parallel.Pipeline | None = None
    step: int = 0
    skip_batches: list = field(default_factory=list)  # global batch numbers the spike guard skips
    batches_drawn: int = 0
    spikes: list = field(default_factory=list)  # (step, batch) of rollbacks since the run last got past one


def setup(cfg: TrainConfig) -> Run:
    device = pick_device(cfg.device)
    cfg = resolve(cfg, device, bf16_ok=device.type != "cuda" or torch.cuda.is_bf16_supported())
    out = Path(cfg.out)
    rundir.check_out(out)
    grid = parallel.init_grid(cfg.tp, cfg.pp, device, cfg.timeout)
    device = grid.device
    per_rank = check_batch(cfg, grid)  # before the data: a wrong layout fails in a second, not minutes
    lock, run_id = claim_out(cfg, grid)
    torch.manual_seed(cfg.seed)  # dropout's stream; the same on every rank, as tensor parallelism needs
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    prepared = grid.rank0_first(lambda: data.prepare(data.DataConfig(
        source=cfg.data, tokenizer=cfg.tokenizer, cache_dir=cfg.cache_dir), verbose=grid.is_logger))
    tok = data.get_tokenizer(cfg.tokenizer, cfg.cache_dir)
    train_tokens = data.load_tokens(prepared / "train.bin", vocab_size=tok.vocab_size)
    resolve_steps(cfg, device, len(train_tokens), log=grid.log)
    loader = data.Loader(train_tokens, cfg.seq_len, cfg.batch_size, cfg.seed, rank=grid.dp_rank, world=grid.dp)
    val = data.eval_batches(data.load_tokens(prepared / "val.bin", vocab_size=tok.vocab_size), cfg.seq_len,
                            cfg.batch_size, cfg.eval_batches, rank=grid.dp_rank, world=grid.dp)
    if len(val) < cfg.eval_batches:
        grid.log(f"evaluation: {len(val)} batch{'es' if len(val) > 1 else ''} of {cfg.batch_size} sequences, all "
                 f"the validation split holds (--eval-batches {cfg.eval_batches} asked for more)")
    model_cfg = model_config(cfg, tok)
    model = parallel.build_model(model_cfg, grid, cfg.seed, device, cfg.seq_len, cfg.sp)
    if cfg.init_from:  # before the optimizer, so ZeRO's master weights start from these values
        checkpoint.load_hf(model, Path(cfg.init_from))
    if cfg.compile:  # block by block: the seams between blocks (pipeline sends, hooks) stay eager
        for block in model.transformer.h.children():
            block.compile()
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
    saver = checkpoint.Saver(out / "ckpt", keep=cfg.keep, asynchronous=cfg.async_ckpt, grid=grid, run=run_id,
                             timeout_s=cfg.timeout)
    with torch.device("meta"):  # all ranks' shards together, the tied wte/lm_head once
        n_params = gpt.count_params(gpt.GPT(model_cfg))
    grid.log(f"{model_cfg.n_layer}-layer model ({cfg.preset}, {n_params / 1e6:.1f}M parameters) on {device.type}: "
             f"{cfg.precision}, attention {cfg.attn}, compile {'on' if cfg.compile else 'off'}, "
             f"{cfg.max_steps} steps of {cfg.batch_size} x {cfg.seq_len} tokens")
    if cfg.print_grid:
        grid.log(str(grid))
    return Run(cfg, device, grid, tok, model_cfg, model, opt, scaler, loader, val, autocast, guard, saver, run_id,
               lock=lock, sync=sync, pipeline=pipeline)


def check_batch(cfg: TrainConfig, grid: parallel.Grid) -> int:
    """The batch must split over the data-parallel ranks, and each rank's share into micro-batches."""
    if cfg.batch_size % grid.dp:
        raise ConfigError(f"--batch-size {cfg.batch_size} is not divisible by the data-parallel degree {grid.dp}")
    per_rank = cfg.batch_size // grid.dp
    cfg.micro_batch_size = cfg.micro_batch_size or per_rank
    if per_rank % cfg.micro_batch_size:
        raise ConfigError(f"--micro-batch-size {cfg.micro_batch_size} does not divide the per-rank batch "
                          f"{per_rank} (= --batch-size {cfg.batch_size} / {grid.dp} data-parallel ranks)")
    return per_rank


def claim_out(cfg: TrainConfig, grid: parallel.Grid) -> tuple[object, str]:
    """Rank 0 locks --out and settles which run it holds (rundir.py); every rank learns the outcome,
    so a refused launch stops everywhere at once instead of leaving ranks waiting."""
    out, lock, problem = Path(cfg.out), None, ""
    if grid.rank == 0:
        try:
            lock = rundir.lock(out)
            rundir.claim(out, cfg.fresh)
        except rundir.RunDirError as e:
            problem = str(e)
    failed = torch.tensor([float(bool(problem))], device=grid.device)
    grid.all_reduce(failed, "world")
    if failed.item():
        raise rundir.RunDirError(problem or "rank 0 could not claim --out (its error says why)")
    return lock, rundir.read_run_id(out)


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
        run.saver.fence()  # the weights change now: a checkpoint copy still in flight must finish first
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
    """The mean loss over the validation batches, in training-sized micro-batches (no new shapes
    for a compiled model, no more memory than training)."""
    run.model.eval()
    losses = []
    for batch in run.val:
        micro = batch.to(run.device).split(run.cfg.micro_batch_size)
        if run.pipeline:
            loss = run.pipeline.run(micro, run.autocast, sp=run.cfg.sp, train=False)
        else:
            loss = torch.zeros((), device=run.device)
            for mb in micro:
                with run.autocast:
                    loss += run.model(mb[:, :-1], mb[:, 1:])[1].float() / len(micro)
        losses.append(run.grid.global_loss(loss.float()))
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
        out = parallel.generate(run.model, run.grid, start, n_tokens, temperature=0.8, top_k=50, generator=gen)
    run.model.train()
    return run.tok.decode(out[0, 1:].tolist())


def save(run: Run) -> None:
    run.saver.save(run.step, model=run.model, opt=run.opt, extra={
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
    """What a checkpoint must agree with to be resumed: everything that fixes the math of a step
    (checkpoint.check_compatible compares every key but "config")."""
    cfg = run.cfg
    return {"model": run.model_cfg.architecture(), "tokenizer": run.tok.identity(), "data": cfg.data,
            "batch_size": cfg.batch_size, "seq_len": cfg.seq_len, "seed": cfg.seed, "precision": cfg.precision,
            "config": asdict(cfg)}


# Flags that may change when a run resumes, and what the change does (the others must match, or
# make no difference to the math: logging, checkpoint cadence, fault injection).
SCHEDULE = ("lr", "min_lr", "warmup_steps", "max_steps")
UPDATE = ("weight_decay", "clip", "dropout", "loss_scale_window", "max_bad_steps", "spike_z", "spike_window")
LAYOUT = ("tp", "pp", "sp", "zero", "micro_batch_size", "pp_schedule")
KERNELS = ("attn", "compile", "device")


def resume_changes(run: Run, saved: dict, saved_layout: dict) -> list[str]:
    """One line per flag that differs from the checkpoint's run, with what the difference does."""
    cfg, now, lines = run.cfg, asdict(run.cfg), []
    old = TrainConfig(**{k: v for k, v in saved.items() if k in now})
    for name in SCHEDULE + UPDATE + LAYOUT + KERNELS:
        if name not in saved or saved[name] == now[name]:
            continue
        change = f"resume: --{name.replace('_', '-')} {saved[name]} -> {now[name]}: "
        if name in SCHEDULE:
            effect = (f"the learning-rate schedule changes; step {run.step + 1} trains at {lr_at(run.step, cfg):.3g} "
                      f"instead of {lr_at(run.step, old):.3g}")
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


def restore(run: Run, announce: bool) -> bool:
    """Load the newest usable checkpoint of this run, if there is one; say what changed."""
    found = checkpoint.restore(Path(run.cfg.out) / "ckpt", run.model, run.opt, run.grid, checkpoint_meta(run),
                               run.run_id, log=run.grid.log)
    if found is None:
        return False
    path, extra, manifest = found
    run.scaler.load_state_dict(extra["scaler"])
    run.loader.load_state_dict(extra["loader"])
    run.batches_drawn, run.skip_batches = extra["batches_drawn"], list(extra["skip_batches"])
    run.guard.history = list(extra["guard"])
    run.step = extra["step"]
    if announce:
        run.grid.log(f"resuming from {path} (step {run.step})")
        for line in resume_changes(run, manifest["meta"].get("config", {}), manifest["layout"]):
            run.grid.log(line)
    return True


def train(run: Run) -> dict:
    """The loop: resume if --out holds a checkpoint of this run, then step, evaluate, log and save
    until --max-steps. Returns the last step's row of metrics."""
    cfg, grid = run.cfg, run.grid
    resumed = restore(run, announce=True)
    metrics = rundir.Metrics(Path(cfg.out) / "metrics.jsonl", grid.is_logger, run.step, log=grid.log)
    metrics.log(event="resume" if resumed else "start", run=run.run_id, step=run.step)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    flops_per_step = gpt.flops_per_token(run.model_cfg, cfg.seq_len) * tokens_per_step
    peak = peak_flops(run.device, cfg.precision) * grid.world
    bad_in_a_row, last, step_times, saves = 0, {}, [], []
    # the bar goes to stderr; log lines (bar.write) to stdout. `with`: closed even on an error
    with tqdm(total=cfg.max_steps, initial=run.step, disable=not grid.is_logger, dynamic_ncols=True,
              mininterval=1.0) as bar:
        try:
            while run.step < cfg.max_steps:
                t0 = time.perf_counter()
                row = train_step(run)
                if row.pop("spike"):
                    roll_back(run, row, metrics)
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
                row.update(tokens_per_sec=tokens_per_step / dt, mfu=flops_per_step / dt / peak)
                if run.scaler.enabled:
                    row["loss_scale"] = run.scaler.scale
                if not last:  # the first step of this process: print what was asked for
                    for text in report(run):
                        bar.write(text)
                run.step += 1
                after_step(run, row, bar, metrics)
                log_saves(run, metrics, step_times, saves)
                last = row
        finally:
            run.saver.wait()  # never exit with a save half-done
    log_saves(run, metrics, step_times, saves)
    if saves and grid.is_logger:
        print(saves_summary(saves))
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
    bar.update(1)
    bar.set_postfix(loss=f"{row['loss']:.3f}", lr=f"{row['lr']:.1e}", tok_s=f"{row['tokens_per_sec']:.0f}",
                    mfu=f"{row['mfu']:.1%}")
    if (cfg.ckpt_every and run.step % cfg.ckpt_every == 0) or run.step == cfg.max_steps:
        save(run)
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


def saves_summary(saves: list[dict]) -> str:
    """One line on what checkpoints cost: --async-ckpt exists so that this is a small share of a step."""
    blocking, step = median([s["blocking_s"] for s in saves]), median([s["step_s"] for s in saves])
    return (f"checkpoints: {len(saves)} saved, {median([s['bytes'] for s in saves]) / 1e6:.1f} MB each from rank 0, "
            f"complete after {median([s['write_s'] for s in saves]):.2f} s; the training loop paid "
            f"{1e3 * blocking:.1f} ms a save ({blocking / step:.0%} of a {1e3 * step:.0f} ms step; medians)")


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


def roll_back(run: Run, row: dict, metrics: rundir.Metrics) -> None:
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
    run.grid.log(f"step {row['step']}: loss {row['loss']:.3f} is a spike; rolled back to step {run.step} "
                 f"and will skip batch {row['batch']}")


def main(argv=None) -> None:
    cfg = parse_args(argv)
    try:
        run = setup(cfg)
        last = train(run)
        if run.grid.is_logger:
            print(f"done: step {run.step}" + (f", loss {last['loss']:.4f}" if last else " (nothing left to do)")
                  + (f", val loss {last['val_loss']:.4f}" if "val_loss" in last else ""))
    except (ConfigError, data.DataError, checkpoint.CheckpointError, parallel.LayoutError, rundir.RunDirError,
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
