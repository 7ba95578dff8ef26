"""What a run is asked to do: every flag of train.py, its default, and the defaults that depend on
the device, the data or the model, settled before any slow work starts.

    python train.py --help            # every flag below, with its default and what it must be

A flag is a field of `TrainConfig` (cli.py turns the fields into the parser). Values that make no
sense alone (`--lr -1`) are refused by the parser; combinations that cannot work (a batch that does
not split over the data-parallel ranks, --seq-len longer than the model's context) are a
`ConfigError`, one line, raised before the corpus is read. "auto" and 0 mean "decide for me":
`resolve_defaults` decides what needs only the device and the model, `resolve_steps` what needs
the size of the data.
"""

import math
import os
import re
from dataclasses import dataclass

import torch

import kernels
import model as gpt
import parallel
import pipeline
import stability
from fp8 import fp8_supported
from support import cli, launches, tokenizer
from support.cli import arg, at_least
from support.devices import ConfigError  # raised here too; caught as config.ConfigError
from support.sources import SOURCE_HELP

CACHE_DIR = str(tokenizer.DEFAULT_CACHE_DIR)
DATA_HELP = "corpus: " + SOURCE_HELP
STATS_EVERY = 10  # --stats-every's default (a run without instruments/ takes it as "none asked for")
# (stall: in joining the others, or in the first collective over a group: parallel.py's names)
CRASH_AT = re.compile(r"(rank:\d+:)?((step|save|mem):\d+"
                      r"|stall:(connect|world|tp|cp|dp_cp|pp|embed|ep|edp|zs|zr|node|nodes))")
MAX_TIMEOUT_S = 1e9  # torch.distributed keeps its timeout in a timedelta (at most ~8.6e13 s): 1e300 overflows
MAX_SAMPLE_TOKENS = 100_000  # drawn one at a time at every evaluation: more is a mistake, not a sample


@dataclass
class TrainConfig:
    data: str = arg("stdlib", DATA_HELP, group="data")
    tokenizer: str = arg("gpt2", "tokenizer: 'gpt2' (BPE) or 'byte'", choices=["gpt2", "byte"])
    cache_dir: str = arg(CACHE_DIR, "where prepared token shards and the tokenizer live")

    preset: str = arg("auto", "model size: " + ", ".join(gpt.PRESETS), group="model",
                      shown="gpt2 on CUDA, mini on CPU; --arch llama: smollm2-135m on CUDA, llama-mini on CPU")
    arch: str = arg("auto", "architecture: gpt2, or llama (RMSNorm, rotary positions, SwiGLU, grouped-query "
                    "attention, no biases, untied embeddings: model.py); llama at a GPT-2 preset takes its shape",
                    choices=["auto", "gpt2", "llama"], shown="the preset's family: gpt2 unless a llama preset")
    n_kv_head: int = arg(0, "llama: kv heads of grouped-query attention, dividing the heads (the heads: multi-head "
                         "attention; 1: multi-query); part of the architecture", at_least(1), shown="the preset's")
    rope_theta: float = arg(0.0, "llama: the base of the rotary position angles (larger: slower-turning pairs, for "
                            "longer contexts)", (lambda v: 0 < v < math.inf, "must be > 0"),
                            shown="the preset's (10000 unless it says)")
    tie_embeddings: bool | None = arg(None, "llama: the output layer reuses the input embedding (GPT-2 always "
                                      "does)", shown="the preset's (untied unless it says)")
    init_from: str = arg("", "start from Hugging Face GPT-2 or Llama weights: a local model directory (config.json "
                         "and model.safetensors or pytorch_model.bin); its config replaces --preset",
                         shown="none: random init by (seed, name)")
    n_layer: int = arg(0, "transformer blocks; part of the architecture, so a checkpoint of another depth is "
                       "refused", at_least(1), shown="the preset's")
    block_size: int = arg(0, "the model's context, the longest --seq-len (GPT-2: rows of its learned position table) "
                          "(longer than the preset's for long-context runs, lesson 15); part of the architecture, "
                          "like --n-layer", at_least(1), shown="the preset's")
    seq_len: int = arg(0, "tokens per sequence", at_least(1), shown="the model's context on CUDA, 128 on CPU")
    dropout: float = arg(0.0, "dropout probability", (lambda v: 0 <= v < 1, "must be in [0, 1)"))
    attn: str = arg("auto", "attention backend", choices=list(kernels.BACKENDS),
                    shown="SDPA; our Triton kernel where a GPU measured it faster "
                    "(support/launches.py)")
    recompute: str = arg("none", "activation recomputation: keep only each block's input and recompute the "
                         "block in the backward (full), or recompute only the attention core (selective)",
                         choices=["none", "selective", "full"])
    moe_experts: int = arg(0, "mixture of experts: E expert MLPs in each MoE block, a router sending each token to "
                           "--moe-top-k of them (moe.py); part of the architecture", at_least(2),
                           shown="0: dense MLPs")
    moe_top_k: int = arg(2, "MoE: experts per token (1: Switch; 2: GShard, Mixtral); the weights of k > 1 renormalized",
                         at_least(1))
    moe_every: int = arg(1, "MoE: every n-th block's MLP is routed experts (1: all; 2: blocks 1, 3, ...)", at_least(1))
    moe_capacity_factor: float = arg(1.25, "MoE: an expert takes at most ceil(c T k / E) tokens of each sequence; the "
                                     "rest are dropped and pass through on the residual (0: no dropping)",
                                     (lambda v: 0 <= v < math.inf, "must be >= 0"))
    moe_aux_loss: float = arg(1e-2, "MoE: weight of Switch's load-balancing loss (reported as moe_aux: 1 is even)",
                              (lambda v: 0 <= v < math.inf, "must be >= 0"))
    moe_z_loss: float = arg(1e-3, "MoE: weight of the router z-loss, the mean squared logsumexp of the router's "
                            "logits (reported as moe_z)", (lambda v: 0 <= v < math.inf, "must be >= 0"))
    compile: bool | None = arg(None, "torch.compile each transformer block and the fused loss",
                               shown="on with CUDA; off on CPU, where compiling costs more than it saves")

    max_steps: int = arg(0, "optimizer steps", at_least(1), group="optimization",
                         shown="200 on CPU (about 2 minutes); on CUDA two epochs of the data, at most 5000")
    batch_size: int = arg(0, "global batch in sequences per optimizer step", at_least(1),
                          shown="64 on CUDA, 8 on CPU")
    micro_batch_size: int = arg(0, "sequences per forward/backward on one rank; the rest is gradient "
                                "accumulation", at_least(1), shown="the whole per-rank batch")
    lr: float = arg(0.0, "peak learning rate", (lambda v: v > 0, "must be > 0"), shown="6e-4 on CUDA, as GPT-2 "
                    "124M trains; 2e-3 on CPU, where the model is small")
    min_lr: float = arg(-1.0, "learning rate at the end of the cosine decay",
                        (lambda v: v >= 0 or v == -1, "must be >= 0, or -1 for --lr / 10"), shown="--lr / 10")
    warmup_steps: int = arg(0, "linear warm-up steps", at_least(0), shown="5% of --max-steps")
    weight_decay: float = arg(0.1, "AdamW weight decay, on matrices and embeddings only", at_least(0))
    clip: float = arg(1.0, "clip the global gradient norm to this (0: off)", at_least(0))
    seed: int = arg(1337, "seed for the initial weights and the data order",
                    (lambda v: 0 <= v < 2**32, "must be in [0, 2^32)"))
    max_bad_steps: int = arg(5, "stop after this many non-finite steps in a row", at_least(1))

    precision: str = arg("auto", "fp32, bf16 (autocast), fp16 (autocast + loss scaling), fp8 (the blocks' Linears "
                         "in fp8, bf16 elsewhere; see fp8.py) or fp8-fp32 (fp8 Linears, fp32 elsewhere)",
                         choices=["auto", "fp32", "bf16", "fp16", "fp8", "fp8-fp32"], group="precision",
                         shown="bf16 on CUDA, fp32 on CPU")
    fp8_recipe: str = arg("current", "fp8: where each tensor's scale comes from: its amax now (current) or the "
                          "max of the last --fp8-amax-history steps' (delayed, TransformerEngine's)",
                          choices=["current", "delayed"])
    fp8_amax_history: int = arg(1024, "fp8, delayed scaling: steps of amax history", at_least(1))
    loss_scale: float = arg(2.0**16, "fp16: initial loss scale", (lambda v: v > 0, "must be > 0"), shown="65536")
    loss_scale_window: int = arg(1000, "fp16: grow the scale after this many steps without overflow", at_least(1))

    out: str = arg("out", "run directory: metrics.jsonl, report.html, checkpoints (one run at a time holds it)",
                   group="checkpoints and recovery")
    fresh: bool = arg(False, "start a new run at step 0: the previous run in --out is moved to --out/previous/")
    new_data: bool = arg(False, "resume on data that is not the checkpoint's (another --data, or the corpus "
                         "edited since): the run continues from the checkpoint's position in the new data, and says "
                         "so; without this flag such a resume is refused")
    ckpt_every: int = arg(0, "save a checkpoint every N steps (0: only at the end)", at_least(0))
    keep: int = arg(2, "checkpoints to keep (older ones are deleted once a newer one is complete)", at_least(1))
    async_ckpt: bool = arg(False, "save checkpoints in the background: training pays only for a copy")
    mem_ckpt_every: int = arg(0, "snapshot every rank's state into host memory every N steps (0: "
                              "off): files in --mem-ckpt-dir that outlive the process, each copied "
                              "to the same local rank on the next node; a restart resumes from "
                              "them where they are newer than the disk's (support/memory.py)",
                              at_least(0))
    mem_ckpt_dir: str = arg("/dev/shm", "where memory snapshots live (a tmpfs: memory); '{node}' "
                            "in it is the node's number (rank // --gpus-per-node), for nodes "
                            "simulated on one machine")
    spike_z: float = arg(0.0, "loss-spike guard (0: off): a loss more than Z standard deviations above the mean "
                         "of the last --spike-window losses, and 20% above it, is a spike: roll back to the last "
                         "checkpoint and skip that batch", at_least(0))
    spike_window: int = arg(20, "losses the spike guard keeps statistics over", at_least(1))
    max_rollbacks: int = arg(3, "the spike guard gives up (an error) when it rolls back this many times in a row "
                             "without getting past the spike", at_least(1))

    device: str = arg("auto", "cpu, cuda or cuda:N (one process only: under torchrun each takes its local "
                      "rank's GPU)", group="parallelism (launch with torchrun; the data-parallel "
                      "degree is the processes / (tp x cp x pp))", shown="cuda when there is a GPU")
    tp: int = arg(1, "tensor-parallel degree (ranks that split each layer)", at_least(1))
    pp: int = arg(1, "pipeline-parallel degree (stages of layers)", at_least(1))
    sp: bool = arg(False, "sequence parallelism: shard LayerNorm/dropout activations along the sequence across "
                   "the tensor-parallel ranks")
    cp: int = arg(1, "context-parallel degree: ranks that each keep a slice of every sequence (context.py)",
                  at_least(1))
    cp_attn: str = arg("ring", "how attention sees the whole sequence under --cp: ring (keys and values passed "
                       "around the cp ranks) or ulysses (all-to-all to whole sequences of fewer heads)",
                       choices=["ring", "ulysses"])
    pp_schedule: str = arg("1f1b", "pipeline schedule (interleaved: Megatron's interleaved 1F1B, with "
                           "--virtual-stages)", choices=list(pipeline.SCHEDULES))
    virtual_stages: int = arg(1, "interleaved schedule: chunks of layers per pipeline stage (v); the bubble "
                              "shrinks v times, the pipeline messages grow v times", at_least(1))
    ep: int = arg(1, "expert-parallel degree: the data-parallel ranks in groups of N, each rank holding "
                  "--moe-experts / N of every MoE layer's experts; tokens reach them by all-to-all (moe.py)",
                  at_least(1))
    zero: int = arg(0, "ZeRO stage: shard across the data-parallel ranks 1: the optimizer state, 2: and the "
                    "gradients (reduce-scattered every backward), 3: and the weights (gathered per block, "
                    "prefetched); see zero.py", choices=[0, 1, 2, 3])
    zero_shard: int = arg(0, "hybrid ZeRO (MiCS, PyTorch's HSDP): shard ZeRO's state over groups of N consecutive "
                          "data-parallel ranks (one node's) and replicate it across the groups; gradients are "
                          "reduce-scattered in a group, then all-reduced across groups (zero.py)", at_least(1),
                          shown="all of them: plain ZeRO")
    hpz: bool = arg(False, "ZeRO++ hpZ (--zero 3): keep a second copy of the weights sharded over the node's ranks, "
                    "so the backward's all-gathers stay inside the node (zero.py)")
    qwz: bool = arg(False, "ZeRO++ qwZ (--zero 3): all-gather the weights in int8, one scale per --quant-block "
                    "elements (zero.py)")
    qgz: int = arg(0, "ZeRO++ qgZ (--zero 1-3): reduce-scatter the gradients in int8 or int4 blocks, an all-to-all "
                   "inside the node, then one across nodes, summed in fp32 (zero.py; 0: off)", choices=[0, 8, 4])
    quant_block: int = arg(256, "qwZ / qgZ: elements per quantization block, each with its own fp32 scale",
                           at_least(2))
    gpus_per_node: int = arg(0, "ranks per node: which collectives cross nodes (--comm-report's link column, hpZ "
                             "and qgZ's hierarchy); CPU processes pretend to be nodes of this size", at_least(1),
                             shown="the ranks on this machine (torchrun's LOCAL_WORLD_SIZE)")
    bucket_mb: float = arg(25.0, "data-parallel gradient bucket size in MB", (lambda v: v > 0, "must be > 0"))
    no_overlap: bool = arg(False, "all-reduce gradients after the backward instead of during it")
    timeout: float = arg(300.0, "seconds a collective (or a checkpoint commit) may wait for a peer before the "
                         "run fails", (lambda v: 0 < v <= MAX_TIMEOUT_S, f"must be > 0 and at most {MAX_TIMEOUT_S:g} "
                                       "(about 30 years)"))

    eval_every: int = arg(0, "evaluate (and print a sample) every N steps", at_least(1), group="reporting",
                          shown="10 times per run, at most every 10th step; always after the last")
    eval_batches: int = arg(4, "global batches of validation data per evaluation (fewer if the split is "
                            "smaller)", at_least(1))
    sample_tokens: int = arg(96, "tokens to sample at each evaluation (0: none; sample.py draws longer texts)",
                             (lambda v: 0 <= v <= MAX_SAMPLE_TOKENS, f"must be in [0, {MAX_SAMPLE_TOKENS}]"))
    stats_every: int = arg(STATS_EVERY, "per-layer gradient norms, update/weight ratios and activation RMS at step "
                           "1 and every N steps, to metrics.jsonl and the dashboard (0: off; instruments/stats.py)",
                           at_least(0))
    print_grid: bool = arg(False, "print the process grid at start-up")
    print_schedule: bool = arg(False, "print the pipeline schedule the stages ran on the first step")
    print_timeline: bool = arg(False, "print every rank's compute and collectives of the second step on one time "
                               "axis, waiting for peers apart from transfer (instruments/timeline.py); also "
                               "--out/timeline.json")
    comm_report: bool = arg(False, "print the bytes every collective moved on the first step, next to the "
                            "formula they should match")
    memory_report: bool = arg(False, "print, per rank, the bytes of weights, gradients, optimizer state and "
                              "saved activations of the first step, next to ZeRO's formulas and the --arch's "
                              "activation model (and Korthikanti et al.'s, for GPT-2)")

    crash_at: str = arg("", "'step:N' SIGKILLs the process after step N, 'save:N' in the "
                        "middle of the save at step N, 'mem:N' in the middle of its memory snapshot "
                        "of step N; 'stall:connect' hangs it (alive, silent) before it joins the "
                        "others, 'stall:tp' in its first collective over tp (or another group); "
                        "'rank:R:...' only rank R (only in a launcher's first attempt, so a "
                        "restarted job runs through)",
                        (lambda v: v == "" or CRASH_AT.fullmatch(v), "must look like step:N, "
                         "save:N, mem:N, stall:connect, stall:GROUP or rank:R:step:N"),
                        group="fault injection (for tests and lessons)", shown="off")
    poison_step: int = arg(-1, "replace batch N (the one step N + 1 draws) with one rare token repeated",
                           at_least(-1), shown="-1: off")


def parse_args(argv=None) -> TrainConfig:
    what = ("Train a GPT-2 or a Llama-family model (--arch llama) on a CPU, a GPU or many "
            "(torchrun --nproc-per-node N train.py ...). Every flag has a default; an automatic "
            "one shows what it becomes.")
    p = cli.parser(TrainConfig, what,
                   prog="python train.py", epilog="README.md says what a run prints and writes; lessons/ teach "
                   "what each flag does, one idea at a time.")
    p.usage = "python train.py [flags]   or   torchrun --nproc-per-node N train.py [flags]"
    return TrainConfig(**vars(p.parse_args(argv)))


# The flags that ask for an instrument (instruments/): a copy without that folder refuses them.
INSTRUMENT_FLAGS = {"comm_report": "--comm-report", "memory_report": "--memory-report",
                    "print_schedule": "--print-schedule", "print_timeline": "--print-timeline",
                    "init_from": "--init-from"}


def asking_for_instruments(cfg: TrainConfig) -> list[str]:
    """The flags of `cfg` that need instruments/ (--stats-every too, unless 0 or its default)."""
    asked = [flag for name, flag in INSTRUMENT_FLAGS.items() if getattr(cfg, name)]
    return asked + ([f"--stats-every {cfg.stats_every}"] if cfg.stats_every not in (0, STATS_EVERY) else [])


def has_instruments(cfg: TrainConfig) -> bool:
    """Is instruments/ here? A fork may delete it: then a default run says so in one line and trains
    without them, and a flag that needs one (or --stats-every other than 0 and its default) is a
    ConfigError before any work."""
    if os.path.exists(os.path.join(os.path.dirname(os.path.abspath(__file__)), "instruments", "observers.py")):
        return True
    if asked := asking_for_instruments(cfg):
        raise ConfigError(f"{', '.join(asked)} need{'s' if len(asked) == 1 else ''} the instruments, and this "
                          "copy has no instruments/ folder; leave the flag out, or restore the folder")
    if int(os.environ.get("RANK", "0")) == 0:
        print("instruments/ is not here: training without the dashboard, MFU, per-layer statistics and the "
              "checkpoint summary", flush=True)
    return False


# ----------------------------------------------------------------------------- defaults by device


def resolve_defaults(cfg: TrainConfig, device: torch.device, bf16_ok: bool = True,
                     arch: dict | None = None) -> TrainConfig:
    """Fill the 'auto' / 0 defaults that need no data, and check that the flags make sense together,
    before any slow work. (--max-steps and what depends on it wait for the data: `resolve_steps`.)
    `arch`: under --init-from, the GPTConfig fields of that model (instruments/hf.py reads them)."""
    cuda = device.type == "cuda"
    if cfg.init_from:
        family = arch.get("arch", "gpt2")
        if cfg.arch not in ("auto", family):
            raise ConfigError(f"--init-from {cfg.init_from} holds a {family} model; leave out --arch {cfg.arch}")
        block, n_head, n_embd = arch["block_size"], arch["n_head"], arch["n_embd"]
        cfg.preset, cfg.arch = f"Hugging Face ({cfg.init_from})", family
    else:
        if cfg.preset == "auto":
            cfg.preset = ("smollm2-135m" if cuda else "llama-mini") if cfg.arch == "llama" else \
                ("gpt2" if cuda else "mini")
        if cfg.preset not in gpt.PRESETS:
            raise ConfigError(f"unknown preset {cfg.preset!r}; choose one of: {', '.join(gpt.PRESETS)}")
        shape = gpt.PRESETS[cfg.preset]
        n_head, n_embd, block = shape["n_head"], shape["n_embd"], shape["block_size"]
        check_arch(cfg, shape.get("arch", "gpt2"))
    if cfg.n_layer and cfg.init_from:
        raise ConfigError("--n-layer cannot change the depth of a Hugging Face model (--init-from); leave it out")
    if cfg.block_size and cfg.init_from:
        raise ConfigError("--block-size cannot change the position table of a Hugging Face model (--init-from, "
                          f"{block} positions); leave it out")
    block = cfg.block_size or block
    cfg.seq_len = cfg.seq_len or (min(block, 2048 if cfg.arch == "llama" else block) if cuda else min(block, 128))
    if cfg.seq_len > block:
        longer = "" if cfg.init_from or cfg.block_size else \
            f", or give the model a longer context: --block-size {cfg.seq_len}"
        raise ConfigError(f"--seq-len {cfg.seq_len} is longer than the {cfg.preset} model's context "
                          f"({block} tokens); use --seq-len {block} or less{longer}")
    cfg.batch_size = cfg.batch_size or (64 if cuda else 8)
    cfg.lr = cfg.lr or (6e-4 if cuda else 2e-3)
    cfg.min_lr = cfg.lr / 10 if cfg.min_lr < 0 else cfg.min_lr
    if cfg.precision == "auto":
        cfg.precision = "bf16" if cuda and bf16_ok else "fp32"
    check_fp8(cfg, device)
    if cfg.compile is None:
        cfg.compile = cuda and not stability.PRECISIONS[cfg.precision].fp8
    if cfg.zero == 3 and cfg.pp > 1:
        raise ConfigError("--zero 3 with --pp is not supported: ZeRO-3 gathers the tied embedding as one unit on "
                          "one stage; use --zero 1 or 2 with pipeline parallelism")
    check_schedule(cfg)
    check_moe(cfg)
    check_hybrid(cfg)
    cfg.attn = resolve_attention(cfg, device, n_embd // n_head)
    return cfg


def check_arch(cfg: TrainConfig, family: str) -> None:
    """--arch auto becomes the preset's family; a Llama preset cannot be a GPT-2, and the Llama flags
    mean nothing to a GPT-2."""
    if cfg.arch == "auto":
        cfg.arch = family
    if cfg.arch == "gpt2" and family == "llama":
        raise ConfigError(f"--preset {cfg.preset} is a Llama-family shape; use --arch llama (or leave --arch out)")
    llama_flags = {"--n-kv-head": cfg.n_kv_head, "--rope-theta": cfg.rope_theta, "--tie-embeddings": cfg.tie_embeddings}
    if cfg.arch == "gpt2" and (given := [flag for flag, value in llama_flags.items() if value]):
        raise ConfigError(f"{', '.join(given)}: only for --arch llama (GPT-2 has multi-head attention, a "
                          "position table and tied embeddings)")
    n_head = gpt.PRESETS[cfg.preset]["n_head"]
    if cfg.n_kv_head and n_head % cfg.n_kv_head:
        raise ConfigError(f"--n-kv-head {cfg.n_kv_head} does not divide the {cfg.preset} model's {n_head} heads")


def check_fp8(cfg: TrainConfig, device: torch.device | None = None) -> None:
    """The fp8 flags need an fp8 precision; fp8 runs eager (its casts are not written for torch.compile), and
    only where torch._scaled_mm multiplies float8 (`device`: checked there)."""
    fp8 = stability.PRECISIONS[cfg.precision].fp8
    given = [flag for flag, changed in (("--fp8-recipe", cfg.fp8_recipe != "current"),
                                        ("--fp8-amax-history", cfg.fp8_amax_history != 1024)) if changed]
    if given and not fp8:
        raise ConfigError(f"{', '.join(given)}: only with --precision fp8 or fp8-fp32")
    if fp8 and cfg.compile:
        raise ConfigError("--precision fp8 runs eager: leave out --compile (fp8.py's casts are not compiled)")
    if fp8 and device is not None and (why := fp8_supported(device)):
        raise ConfigError(f"--precision {cfg.precision}: {why}")


MOE_DEFAULTS = {"moe_top_k": 2, "moe_every": 1, "moe_capacity_factor": 1.25, "moe_aux_loss": 1e-2, "moe_z_loss": 1e-3,
                "ep": 1}


def check_moe(cfg: TrainConfig) -> None:
    """The MoE flags need experts, and k of them to choose from; expert parallelism splits them evenly
    (that --ep divides the data-parallel degree needs the world size: parallel.layout). What is not
    built yet with experts is refused by name."""
    if not cfg.moe_experts:
        if given := [f"--{k.replace('_', '-')}" for k, v in MOE_DEFAULTS.items() if getattr(cfg, k) != v]:
            raise ConfigError(f"{', '.join(given)}: only with --moe-experts (a mixture of experts)")
        return
    if cfg.moe_top_k > cfg.moe_experts:
        raise ConfigError(f"--moe-top-k {cfg.moe_top_k} is more than the {cfg.moe_experts} experts (--moe-experts)")
    if cfg.moe_experts % cfg.ep:
        raise ConfigError(f"--ep {cfg.ep} does not divide the {cfg.moe_experts} experts (--moe-experts): every "
                          "expert-parallel rank holds as many")
    unsupported = {"--sp": cfg.sp, "--init-from": bool(cfg.init_from),
                   f"--precision {cfg.precision}": stability.PRECISIONS[cfg.precision].fp8}
    if given := [flag for flag, on in unsupported.items() if on]:
        raise ConfigError(f"{', '.join(given)} with --moe-experts: not supported yet (mixture of experts runs with "
                          "data, expert, tensor, pipeline and context parallelism, ZeRO, "
                          "recomputation)")


def gpus_per_node(cfg: TrainConfig) -> int:
    """--gpus-per-node, or the ranks torchrun started on this machine when they fit the layout (0: unknown,
    one node holds every rank)."""
    if cfg.gpus_per_node:
        return cfg.gpus_per_node
    local, world = int(os.environ.get("LOCAL_WORLD_SIZE", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    dp_cp = world // (cfg.tp * cfg.pp * cfg.cp) * cfg.cp
    if not 0 < local < world or not dp_cp:
        return 0
    try:  # the rule --gpus-per-node is held to
        parallel.check_nodes(dp_cp, cfg.tp, 0, local)
    except parallel.LayoutError:
        return 0
    return local


def check_hybrid(cfg: TrainConfig) -> None:
    """Hybrid ZeRO and ZeRO++ (zero.py) need ZeRO, hpZ and qwZ its stage 3 (they are about gathering weights);
    the combinations not built are refused by name (how the sizes fit the world: parallel.check_nodes)."""
    needs = {"--zero-shard": (bool(cfg.zero_shard), 1), "--qgz": (bool(cfg.qgz), 1), "--hpz": (cfg.hpz, 3),
             "--qwz": (cfg.qwz, 3)}
    if given := [f"{flag} needs --zero {stage}{'' if stage == 3 else ' or more'}"
                 for flag, (on, stage) in needs.items() if on and cfg.zero < stage]:
        raise ConfigError("; ".join(given))
    unsupported = {"--zero-shard with --ep": cfg.zero_shard and cfg.ep > 1,
                   "--zero-shard with --hpz": cfg.zero_shard and cfg.hpz,
                   "--zero-shard with --qgz": cfg.zero_shard and cfg.qgz,
                   "--qgz with --ep": cfg.qgz and cfg.ep > 1, "--hpz with --ep": cfg.hpz and cfg.ep > 1,
                   "--qwz with --ep": cfg.qwz and cfg.ep > 1}
    if given := [flag for flag, on in unsupported.items() if on]:
        raise ConfigError(f"{', '.join(given)}: not supported (hybrid sharding already keeps ZeRO's traffic in a node; "
                          "ZeRO++ and experts' edp groups are not combined yet)")


def check_schedule(cfg: TrainConfig) -> None:
    """The interleaved schedule needs chunks (v >= 2) on a pipeline (pp >= 2); chunks need it."""
    if cfg.pp_schedule == "interleaved" and (cfg.virtual_stages < 2 or cfg.pp < 2):
        raise ConfigError(f"--pp-schedule interleaved needs --pp 2 or more and --virtual-stages 2 or more (got "
                          f"--pp {cfg.pp}, --virtual-stages {cfg.virtual_stages}); or use --pp-schedule 1f1b")
    if cfg.virtual_stages > 1 and cfg.pp_schedule != "interleaved":
        raise ConfigError(f"--virtual-stages {cfg.virtual_stages} needs --pp-schedule interleaved (the "
                          f"{cfg.pp_schedule} schedule runs one chunk of layers per stage)")


def resolve_attention(cfg: TrainConfig, device: torch.device, head_dim: int) -> str:
    """'auto' becomes a concrete backend once, here, so that compiled code never has to decide; and
    --attn triton where the kernel cannot run is one clear line now, not a traceback later."""
    dtype = stability.PRECISIONS[cfg.precision].compute or torch.float32
    if cfg.attn == "auto":
        return kernels.resolve_backend(device, dtype, head_dim)
    if cfg.attn == "triton" and (problem := kernels.triton_problem(device, dtype, head_dim)):
        raise ConfigError(f"--attn triton: {problem}")
    return cfg.attn


def describe_attention(cfg: TrainConfig, asked: str, device: torch.device, head_dim: int) -> str:
    """The start-up line's attention: the backend and, where `auto` chose it on a GPU, why."""
    if asked != "auto" or device.type != "cuda" or kernels.INTERPRETED:
        return cfg.attn
    dtype = stability.PRECISIONS[cfg.precision].compute or torch.float32
    if problem := kernels.triton_problem(device, dtype, head_dim):
        return f"{cfg.attn} (auto: {problem.split('; ')[0]})"  # the reason, not the advice
    props = torch.cuda.get_device_properties(device)
    return f"{cfg.attn} (auto: {launches.measured((props.major, props.minor), head_dim, dtype)})"


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
    # 10 evaluations a run, but at most one every 10th step: an evaluation (and its sample) costs a few
    # steps, and a short run would otherwise spend most of its time on them. The last step always has one.
    cfg.eval_every = cfg.eval_every or max(10, cfg.max_steps // 10)


def check_batch(cfg: TrainConfig, grid: parallel.Grid) -> int:
    """The batch must split over the data-parallel ranks, and each rank's share into micro-batches."""
    if cfg.batch_size % grid.dp:
        raise ConfigError(f"--batch-size {cfg.batch_size} is not divisible by the data-parallel degree {grid.dp}")
    per_rank = cfg.batch_size // grid.dp
    cfg.micro_batch_size = cfg.micro_batch_size or per_rank
    if per_rank % cfg.micro_batch_size:
        raise ConfigError(f"--micro-batch-size {cfg.micro_batch_size} does not divide the per-rank batch "
                          f"{per_rank} (= --batch-size {cfg.batch_size} / {grid.dp} data-parallel ranks)")
    m = per_rank // cfg.micro_batch_size
    if cfg.pp_schedule == "interleaved" and m % grid.pp:
        raise ConfigError(f"the interleaved schedule needs the micro-batches per step ({m} = {per_rank} sequences "
                          f"per rank / --micro-batch-size {cfg.micro_batch_size}) to be a multiple of --pp "
                          f"{grid.pp}; change --micro-batch-size or --batch-size")
    return per_rank


VOCAB_SIZES = {t.name: t.vocab_size for t in (tokenizer.ByteTokenizer, tokenizer.GPT2Tokenizer)}


def model_config(cfg: TrainConfig, arch: dict | None = None) -> gpt.GPTConfig:
    """The architecture: a preset, or (--init-from) `arch`, the Hugging Face model's. It needs only the
    tokenizer's name, not its file, so a layout that cannot split it fails before any data."""
    vocab = VOCAB_SIZES[cfg.tokenizer]
    if not cfg.init_from:
        shape = {k: v for k, v in (("n_layer", cfg.n_layer), ("block_size", cfg.block_size),
                                   ("n_kv_head", cfg.n_kv_head), ("rope_theta", cfg.rope_theta)) if v}
        if cfg.tie_embeddings is not None:
            shape["tie_embeddings"] = cfg.tie_embeddings
        if cfg.moe_experts:
            shape.update(moe_experts=cfg.moe_experts, moe_top_k=cfg.moe_top_k, moe_every=cfg.moe_every,
                         moe_capacity_factor=cfg.moe_capacity_factor)
        return gpt.config_from_preset(cfg.preset, vocab, dropout=cfg.dropout, attn=cfg.attn,
                                      recompute=cfg.recompute, arch=cfg.arch, **shape)
    if arch["vocab_size"] != vocab:
        raise ConfigError(f"{cfg.init_from} has a vocabulary of {arch['vocab_size']} tokens but the {cfg.tokenizer} "
                          f"tokenizer has {vocab}; use the tokenizer the model was trained with")
    return gpt.GPTConfig(**arch, dropout=cfg.dropout, attn=cfg.attn, recompute=cfg.recompute)


def check_size(cfg: TrainConfig, model_cfg: gpt.GPTConfig, grid: parallel.Grid) -> None:
    """Refuse a model that cannot fit, in one line, before it is built (--n-layer 100000 would spend
    minutes building, then fail; --block-size 10**21 overflows a tensor's size). What is counted is a
    floor: AdamW's fp32 state (weights, gradients, two moments: 16 bytes a parameter) split over tensor
    and pipeline ranks and as ZeRO shards it, plus what every layer saves for its backward at the least,
    its input (all --recompute full keeps), in 2-byte elements. On a CPU the processes of a node share its
    memory."""
    n = gpt.n_params(model_cfg)
    local, dp, z = n / (grid.tp * grid.pp), grid.dp, cfg.zero
    state = local * (4 / (dp if z >= 3 else 1) + 4 / (dp if z >= 2 else 1) + 8 / (dp if z >= 1 else 1))
    layers = -(-model_cfg.n_layer // grid.pp)
    tokens = cfg.seq_len // grid.cp * cfg.micro_batch_size // (grid.tp if grid.sp else 1)
    act = 2 * tokens * model_cfg.n_embd * layers
    if grid.device.type == "cuda":
        memory, where, sharing = torch.cuda.get_device_properties(grid.device).total_memory, "GPU", 1
    else:
        memory, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "machine"
        sharing = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    need = (state + act) * sharing
    if need > memory:
        per = f" for each of {sharing} processes" if sharing > 1 else ""
        raise ConfigError(f"the model would have {n / 1e9:,.1f}B parameters ({model_cfg.n_layer} layers, a context of "
                          f"{model_cfg.block_size:,}): at least {need / sharing / 1e9:,.1f} GB of training state and "
                          f"activations{per}, more than the {memory / 1e9:.1f} GB of this {where}; choose a smaller "
                          "--preset, --n-layer or --block-size, or split it (--tp, --pp, --zero 3)")
