"""GPT-2, exactly, on one device; and the Llama family, as a handful of named choices on the same model.

    tokens (B, T) ─▶ wte + wpe ─▶ [ Block ] × n_layer ─▶ ln_f ─▶ lm_head (= wte^T) ─▶ logits (B, T, V)

    Block:  x = x + attn(ln_1(x))        pre-LayerNorm, eps 1e-5
            x = x + mlp(ln_2(x))         mlp = c_proj(gelu_tanh(c_fc(x))), 4x wide; or E routed experts
                                         of that MLP in every moe_every-th block (moe.py)

This is the model of Radford et al. 2019 ("Language Models are Unsupervised Multitask
Learners") with the parameter names of the released checkpoints, so Hugging Face GPT-2
weights load unchanged (their Conv1D weights are our nn.Linear weights transposed).

`arch="llama"` (Touvron et al. 2023, LLaMA; the shape almost every open model has today) changes five
things, each a small choice below, never a second copy of the model:

    normalization   RMSNorm (Zhang & Sennrich 2019): x / rms(x) * g, no mean, no bias   `norm`
    positions       no table: RoPE (Su et al. 2021) rotates each q and k pair of       `rotate`, `Positions`
                    features by an angle pos * theta^(-2i/D), so q.k depends only on
                    the distance between the two positions; any length trains
    MLP             SwiGLU (Shazeer 2020): c_proj(silu(x W) * (x V)), hidden 2/3 * 4C  `MLP`, `ffn_hidden`
                    rounded up to a multiple of 256 (three matrices cost what two did)
    attention       grouped-query (Ainslie et al. 2023): n_kv_head <= n_head kv heads,  `n_kv_head`
                    each shared by n_head / n_kv_head query heads (kernels.py)
    the rest        no biases anywhere; the output layer its own matrix (untied), unless `tie_embeddings`

The parameter names stay GPT-2's (c_attn holds q, k, v; c_fc holds SwiGLU's W and V), so every parallel
transformation below (shard.py, context.py, pipeline.py, zero.py) works on both. The positions are passed
to the rotation explicitly, by a `Positions` layer, so that context parallelism, whose ranks hold
non-contiguous chunks of a sequence, rotates each token by its *global* position (context.py swaps it).

Three things here exist for the rest of the codebase:

1. Layout-independent initialization. `init_value(name, shape, seed)` draws a parameter's
   *full* initial value from a generator seeded by (seed, name) alone. `materialize` builds
   each parameter of a model that was constructed on the `meta` device (no memory), and takes
   an optional `shard_fn` that cuts out the slice a rank keeps (or gives each parameter only its
   shape, for ZeRO-3, whose optimizer draws the values and keeps its own part). So every
   parallel layout, which only changes the slices, starts from exactly the same weights.
2. Seams for parallelism. The forward is `embed -> blocks -> head -> loss`, blocks are
   run in whatever order `transformer.h` holds them, and attention infers its number of heads
   from the projection's width. The loss and the gathering of logits for sampling are layers
   too (`loss`, `gather_vocab`), so shard.py swaps layers (context.py's attention cores among them)
   and drops blocks, and pipeline.py passes `generate` its own `next_logits`; none needs a second
   copy of this file, and no method is replaced at run time.
3. The vocabulary is padded to a multiple of 128 (50257 -> 50304) so the embedding splits
   evenly across tensor-parallel ranks and its matmuls hit fast shapes. The padded logits are
   masked out when sampling.
"""

import functools
import hashlib
import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from dropout import Dropout, keyed, number
from fp8 import fp8_linear
from kernels import attention, attention_packed, unpack_qkv
from lmhead import lm_head_loss
from moe import MoE, active_matmul_delta, is_moe_layer, param_delta


@dataclass
class GPTConfig:
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    block_size: int = 1024  # longest sequence (learned position embeddings)
    vocab_size: int = 50257  # real tokens; the embedding holds padded_vocab rows
    dropout: float = 0.0
    attn: str = "auto"  # attention backend, see kernels.py; not part of the architecture
    recompute: str = "none"  # "selective" (the attention core) or "full" (each block); see Recompute
    # The Llama family's choices (module docstring); GPT-2 ignores them.
    arch: str = "gpt2"  # "gpt2" or "llama"
    n_kv_head: int = 0  # kv heads for grouped-query attention; 0: n_head (multi-head)
    ffn_hidden: int = 0  # SwiGLU's hidden width; 0: Llama's rule (ffn_hidden_rule)
    rope_theta: float = 10000.0  # RoPE's base: the slowest pair turns by pos * theta^(-(D-2)/D)
    tie_embeddings: bool = False  # llama: the output layer is wte (GPT-2 always ties)
    norm_eps: float = 1e-5  # llama: RMSNorm's epsilon (GPT-2's LayerNorm: 1e-5)
    # Mixture of experts (moe.py); 0 experts: every MLP dense, as above.
    moe_experts: int = 0  # E: experts in each MoE layer
    moe_top_k: int = 2  # k: experts per token (1: Switch; 2: GShard, Mixtral)
    moe_every: int = 1  # every n-th block's MLP is an MoE (1: all of them)
    moe_capacity_factor: float = 1.25  # c: an expert takes ceil(c T k / E) tokens of a sequence (0: all)

    @property
    def padded_vocab(self) -> int:
        return math.ceil(self.vocab_size / 128) * 128

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def llama(self) -> bool:
        return self.arch == "llama"

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def tied(self) -> bool:
        return not self.llama or self.tie_embeddings

    @property
    def hidden(self) -> int:
        """The MLP's hidden width: 4C for GPT-2; SwiGLU's ffn_hidden for Llama."""
        return (self.ffn_hidden or ffn_hidden_rule(self.n_embd)) if self.llama else 4 * self.n_embd

    def architecture(self) -> dict:
        """The fields that decide parameter shapes (what a checkpoint must agree on). A GPT-2's leaves out
        the Llama fields, and a dense model the MoE ones, so its checkpoints read as they always have."""
        skip = {"dropout", "attn", "recompute"} | (set() if self.llama else set(LLAMA_FIELDS)) \
            | (set() if self.moe_experts else set(MOE_FIELDS))
        return {k: v for k, v in asdict(self).items() if k not in skip}


LLAMA_FIELDS = ("arch", "n_kv_head", "ffn_hidden", "rope_theta", "tie_embeddings", "norm_eps")
MOE_FIELDS = ("moe_experts", "moe_top_k", "moe_every", "moe_capacity_factor")


def ffn_hidden_rule(n_embd: int, multiple: int = 256) -> int:
    """Llama's SwiGLU width: 2/3 of GPT-2's 4C (three matrices instead of two, the same parameters),
    rounded up to a multiple of 256 so the matmuls hit fast shapes and tensor parallelism divides it."""
    return multiple * math.ceil(8 * n_embd / 3 / multiple)


# The four GPT-2 sizes, small ones for CPUs; then the Llama family: two small ones for CPUs, and the
# published shapes of three released models (shapes only: no weights are fetched; with their vocabularies,
# which a run's tokenizer replaces). Published totals: SmolLM2-135M 134.5M, Llama-3.2-1B 1.24B, Llama-3-8B
# 8.03B (tests/test_model.py counts them).
PRESETS = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, block_size=1024),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, block_size=1024),  # 1558M
    "small": dict(n_layer=6, n_head=8, n_embd=384, block_size=256),  # a CPU run that learns in minutes
    "mini": dict(n_layer=4, n_head=4, n_embd=256, block_size=256),  # the default on a CPU
    "tiny": dict(n_layer=4, n_head=4, n_embd=64, block_size=64),  # tests: divisible by tp and pp up to 4
    # tests: tiny's shape, 2 kv heads (a real GQA group of 2), untied
    "llama-tiny": dict(arch="llama", n_layer=4, n_head=4, n_kv_head=2, n_embd=64, block_size=64),
    # lessons: mini's shape, tied as small models are: GPT-2 mini's parameters within 1%
    "llama-mini": dict(arch="llama", n_layer=4, n_head=4, n_kv_head=2, n_embd=256, block_size=256,
                       tie_embeddings=True),
    "smollm2-135m": dict(arch="llama", n_layer=30, n_head=9, n_kv_head=3, n_embd=576, ffn_hidden=1536,
                         block_size=8192, rope_theta=100000.0, tie_embeddings=True, vocab_size=49152),
    # trained at 8192 before its 128K stage, whose RoPE rescaling is not implemented here
    "llama-3.2-1b": dict(arch="llama", n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, ffn_hidden=8192,
                         block_size=8192, rope_theta=500000.0, tie_embeddings=True, vocab_size=128256),
    "llama-3-8b": dict(arch="llama", n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, ffn_hidden=14336,
                       block_size=8192, rope_theta=500000.0, vocab_size=128256),
}


def config_from_preset(name: str, vocab_size: int | None = None, **overrides) -> GPTConfig:
    """A preset's config; vocab_size (a tokenizer's) replaces the preset's, and overrides any field."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    cfg = GPTConfig(**PRESETS[name])
    for key, value in {**({"vocab_size": vocab_size} if vocab_size else {}), **overrides}.items():
        if key not in {f.name for f in fields(GPTConfig)}:
            raise ValueError(f"unknown config field {key!r}")
        setattr(cfg, key, value)
    if cfg.n_embd % cfg.n_head:
        raise ValueError(f"n_embd={cfg.n_embd} is not divisible by n_head={cfg.n_head}")
    if cfg.n_head % cfg.kv_heads:
        raise ValueError(f"n_kv_head={cfg.kv_heads} does not divide n_head={cfg.n_head}")
    return cfg


# ----------------------------------------------------------------------------- the layers


def in_backward() -> bool:
    """Is autograd running a backward on this thread right now? (A recomputed forward runs inside one.)"""
    return torch._C._current_graph_task_id() != -1


class Recompute(torch.autograd.Function):
    """Activation recomputation (Chen et al. 2016; Korthikanti et al. 2022 for the selective kind):
    run fn without keeping what its backward would need, keep only its inputs, and in the backward
    run fn again, this time recording, and back-propagate through that copy. Memory: fn's inputs
    instead of all its intermediate activations. Cost: one more forward of fn.

    The second forward must compute exactly what the first did: the same dropout masks (a mask is
    a function of the dropout key and each element's place, dropout.py: the first run's key is set
    again for the second), and the same dtypes (autocast is on in the forward, off in the backward,
    so its state is recorded and re-entered)."""

    @staticmethod
    def forward(ctx, fn, *inputs):
        device = inputs[0].device
        ctx.fn, ctx.device = fn, device
        ctx.autocast = torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type)
        ctx.key = Dropout.key
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            return fn(*inputs)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        with keyed(ctx.key), torch.enable_grad(), \
                torch.autocast(ctx.device.type, dtype=ctx.autocast[1], enabled=ctx.autocast[0]):
            outputs = ctx.fn(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        torch.autograd.backward(outputs, grads)  # parameters' gradients accumulate (and their hooks fire) here
        return (None, *(x.grad for x in inputs))


def recompute(fn, *inputs: torch.Tensor):
    """fn(*inputs), its activations recomputed in the backward (when gradients are being recorded)."""
    return Recompute.apply(fn, *inputs) if torch.is_grad_enabled() else fn(*inputs)


class KVCache:
    """Keys and values of the tokens seen so far, so sampling costs O(T) per token, not O(T^2)."""

    def __init__(self):
        self.k = self.v = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.size(2)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # (B, H, T_new, D) each; cat is fine at sampling sizes and keeps the code obvious
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


class Attention(nn.Module):
    """The attention core, softmax(q k^T / sqrt(d) + causal mask) v, of the packed (B, T, 3, H, D) qkv:
    (B, H, T, D) out. A layer of its own so that context parallelism (context.py) can swap in ring or
    Ulysses attention, which see the whole sequence while each rank holds a slice of it."""

    def __init__(self, backend: str):
        super().__init__()
        self.backend = backend

    def forward(self, qkv: torch.Tensor, n_kv_head: int | None = None) -> torch.Tensor:
        return attention_packed(qkv, self.backend, n_kv_head)


def norm(cfg: GPTConfig) -> nn.Module:
    """GPT-2's LayerNorm (x - mean) / std * g + b, or Llama's RMSNorm (Zhang & Sennrich 2019), x / rms(x) * g:
    no centring, no bias; re-scaling is what matters, and it is cheaper."""
    return nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps) if cfg.llama else nn.LayerNorm(cfg.n_embd, eps=1e-5)


def rotate(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE (Su et al. 2021, "RoFormer"): x (..., T, heads, D) at positions pos (T,). Feature i of the first
    half and feature i of the second half form a pair, a point in the plane, turned by the angle
    pos * theta^(-2i/D) (the half-split pairing of Hugging Face's Llama, whose weights then load as they are):

        (a, b) -> (a cos - b sin, a sin + b cos)

    A rotation keeps lengths, and q_m . k_n of two rotated vectors depends on their angles only through
    m - n: attention sees relative positions, and no table caps the length. Fast pairs tell near tokens
    apart, slow ones (up to theta) far ones. The angles are computed in fp32 (fp64 for fp64 x)."""
    D = x.size(-1)
    wide = torch.promote_types(x.dtype, torch.float32)
    freq = theta ** (-torch.arange(0, D, 2, device=x.device, dtype=wide) / D)  # (D/2,)
    angle = pos.to(wide)[:, None] * freq  # (T, D/2)
    cos, sin = angle.cos()[:, None].to(x.dtype), angle.sin()[:, None].to(x.dtype)  # (T, 1, D/2)
    a, b = x[..., : D // 2], x[..., D // 2:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Positions(nn.Module):
    """The positions of the T tokens an attention layer sees, `start` onward (start > 0: after a KV cache).
    A layer of its own so that context parallelism can swap in the global positions of its chunks."""

    def forward(self, T: int, start: int, device: torch.device) -> torch.Tensor:
        return torch.arange(start, start + T, device=device)


class Linear(nn.Linear):
    """A block's matmul: nn.Linear, or FP8 once a run gives it the scaling of its three tensors
    (--precision fp8: fp8.enable). shard.py's tensor-parallel layers take the same `fp8` slot."""
    fp8 = None  # an fp8.Fp8LinearState, or None: F.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.fp8)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp8=None) -> torch.Tensor:
    """y = x W^T + b: F.linear, or its three matmuls in FP8 given an Fp8LinearState (fp8.py)."""
    return F.linear(x, weight, bias) if fp8 is None else fp8_linear(x, weight, bias, fp8)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.backend = cfg.attn
        self.core = Attention(cfg.attn)
        self.recompute_core = cfg.recompute == "selective"
        # q, k, v for all heads at once: 3 H D outputs, or H D + 2 H_kv D under GQA
        width = (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim
        self.c_attn = Linear(cfg.n_embd, width, bias=not cfg.llama)
        self.c_proj = Linear(cfg.n_embd, cfg.n_embd, bias=not cfg.llama)
        self.resid_dropout = Dropout(cfg.dropout)
        # Llama: RoPE, and the share of kv heads among the projection's heads (so that a tensor-parallel
        # rank, holding H/tp query and H_kv/tp kv heads, finds its own)
        self.positions = Positions() if cfg.llama else None
        self.rope_theta, self.kv_share = cfg.rope_theta, cfg.kv_heads / (cfg.n_head + 2 * cfg.kv_heads)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        qkv = self.c_attn(x)  # (B, T, 3 * H * D); under tensor parallelism H is this rank's heads
        B, T, _ = qkv.shape
        n_kv = None
        if self.positions is None:
            qkv = qkv.view(B, T, 3, -1, self.head_dim)  # a view, not a copy; our kernel takes it whole
        else:
            qkv, n_kv = self.rotary(qkv.view(B, T, -1, self.head_dim), 0 if cache is None else cache.length)
        if cache is not None:
            q, k, v = unpack_qkv(qkv, n_kv)  # (B, H, T, D), (B, H_kv, T, D) views
            k, v = cache.append(k, v)  # (B, H_kv, T_past + T, D)
            y = attention(q, k, v, self.backend)
        else:
            core = self.core if n_kv is None else functools.partial(self.core, n_kv_head=n_kv)
            # selective: keep qkv; the softmax and what it needs are rebuilt in the backward
            y = recompute(core, qkv) if self.recompute_core else core(qkv)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, H * D)
        return self.resid_dropout(self.c_proj(y))

    def rotary(self, qkv: torch.Tensor, start: int) -> tuple[torch.Tensor, int]:
        """(B, T, H + 2 H_kv, D) -> the same with q and k rotated by their positions, and H_kv."""
        n_kv = round(qkv.size(2) * self.kv_share)
        q, k, v = qkv.split([qkv.size(2) - 2 * n_kv, n_kv, n_kv], dim=2)
        pos = self.positions(qkv.size(1), start, qkv.device)  # (T,): global ones under context parallelism
        theta = self.rope_theta
        return torch.cat([rotate(q, pos, theta), rotate(k, pos, theta), v], dim=2), n_kv


class MLP(nn.Module):
    """GPT-2: c_proj(gelu(c_fc(x))), 4C wide. Llama: SwiGLU (Shazeer 2020, "GLU Variants Improve
    Transformer"): c_proj(silu(x W) * (x V)), a gate that multiplies; c_fc holds W and V stacked (so
    tensor parallelism splits each by columns, as it splits q, k and v)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.swiglu = cfg.llama
        self.c_fc = Linear(cfg.n_embd, (2 if cfg.llama else 1) * cfg.hidden, bias=not cfg.llama)
        self.c_proj = Linear(cfg.hidden, cfg.n_embd, bias=not cfg.llama)
        self.dropout = Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = self.c_fc(x).chunk(2, dim=-1)  # (B, T, hidden) each; this rank's columns under tp
            return self.dropout(self.c_proj(F.silu(gate) * up))
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, i: int = 0):
        super().__init__()
        self.ln_1 = norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = norm(cfg)
        # block i's MLP: dense, or (moe.py) routed experts of the same kind
        self.mlp = MoE(cfg.n_embd, cfg.hidden, cfg.llama, cfg.moe_experts, cfg.moe_top_k, cfg.moe_capacity_factor,
                       cfg.dropout) if cfg.moe_experts and is_moe_layer(i, cfg.moe_every) else MLP(cfg)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache)
        return x + self.mlp(self.ln_2(x))


class CrossEntropy(nn.Module):
    """The output layer and the mean next-token loss in one: logits = x W^T are made and consumed a
    chunk of rows at a time, in fp32 whatever the matmuls' dtype, and never all at once
    (lmhead.lm_head_loss). A layer, so tensor parallelism can swap in its vocab-parallel loss."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_head_loss(x, weight, targets)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        # Values come from init_value (by name), so skip nn.Embedding's own N(0, 1) draw: on the
        # meta device that draw alone costs a second of start-up (it imports torch._dynamo).
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.padded_vocab, cfg.n_embd, _weight=torch.empty(cfg.padded_vocab, cfg.n_embd)),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd, _weight=torch.empty(cfg.block_size, cfg.n_embd)),
            drop=Dropout(cfg.dropout),
            h=nn.ModuleList([Block(cfg, i) for i in range(cfg.n_layer)]),
            ln_f=norm(cfg),
        ))
        if cfg.llama:
            del self.transformer["wpe"]  # RoPE rotates q and k instead (CausalSelfAttention)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.padded_vocab, bias=False)
        if cfg.tied:
            self.lm_head.weight = self.transformer.wte.weight  # weight tying, as in GPT-2
        self.loss = CrossEntropy()  # shard.py swaps in the vocab-parallel loss
        self.gather_vocab = nn.Identity()  # ...and an all-gather of the vocab shards, for sampling
        number(self)  # each dropout's site: its place in the whole model, whatever a layout keeps

    # The forward in three seams, so a pipeline stage can run only its part.
    def embed(self, idx: torch.Tensor, start: int = 0) -> torch.Tensor:
        T = idx.size(1)
        if start + T > self.config.block_size:
            raise ValueError(f"sequence of {start + T} tokens is longer than the model's context "
                             f"(block_size={self.config.block_size})")
        if self.config.llama:  # positions enter in attention, as rotations
            return self.transformer.drop(self.transformer.wte(idx))  # (B, T, C)
        pos = torch.arange(start, start + T, device=idx.device)
        return self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)

    def blocks(self, x: torch.Tensor, caches: list[KVCache] | None = None, which: range | None = None) -> torch.Tensor:
        """Run the blocks this model holds, in order; `which` (positions among them, default all) runs
        only some, and caches[i] belongs to the block at position i."""
        # children() rather than indexing: a pipeline stage keeps only some blocks, under their global names
        held = list(self.transformer.h.children())
        for i in range(len(held)) if which is None else which:
            block = held[i]
            if self.config.recompute == "full" and not caches:  # keep only each block's input
                x = recompute(block, x)
            else:
                x = block(x, caches[i] if caches else None)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.transformer.ln_f(x))  # (B, T, V_padded)

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean loss of the head's logits against targets, without ever holding the logits."""
        return self.loss(self.transformer.ln_f(x), self.lm_head.weight, targets)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """(logits, None) without targets; (None, loss) with them: training never forms the
        (B, T, V) logits, the largest tensor of a step (see CrossEntropy)."""
        x = self.blocks(self.embed(idx))
        if targets is None:
            return self.head(x), None
        return None, self.head_loss(x, targets)

    def next_logits(self, tokens: torch.Tensor, start: int, caches: list[KVCache]) -> torch.Tensor:
        """Logits (B, V_padded) for the position after `tokens`, which sit at `start` onward and
        attend to what `caches` hold; the caches take their keys and values."""
        return self.gather_vocab(self.head(self.blocks(self.embed(tokens, start), caches))[:, -1, :])

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None,
                 next_logits=None, on_token=None) -> torch.Tensor:
        """Sample continuations of idx (B, T) with a KV cache. When the context fills up, the cache
        is rebuilt from the last half of the window (an O(T) prefill every T/2 tokens).
        `next_logits` (default: this model's) is how a pipeline runs the same loop across stages;
        `on_token(nxt)`, when given, sees each new column of tokens (B, 1) as soon as it is drawn
        (sample.py streams text with it)."""
        next_logits = next_logits or self.next_logits
        window = self.config.block_size
        out = idx[:, -window:]
        caches, seen = None, 0  # `seen` tokens of `out` are in the cache
        for _ in range(max_new_tokens):
            if caches is None or seen >= window:
                out_ctx = out[:, -max(1, window // 2):] if seen >= window else out
                caches = [KVCache() for _ in range(len(self.transformer.h))]
                logits = next_logits(out_ctx, 0, caches)
                seen = out_ctx.size(1)
            else:
                logits = next_logits(out[:, -1:], seen, caches)
                seen += 1
            logits = logits.float()  # (B, V_padded)
            logits[:, self.config.vocab_size:] = float("-inf")  # padding never wins
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
            out = torch.cat([out, nxt], dim=1)
            if on_token is not None:
                on_token(nxt)
        return out


# ----------------------------------------------------------------------------- initialization


def stable_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (seed, name) that is the same on every machine and Python process."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def canonical_name(name: str, tied: bool = True) -> str:
    """Tied, lm_head.weight *is* wte.weight; a pipeline's last stage holds a copy that must match."""
    return "transformer.wte.weight" if tied and name == "lm_head.weight" else name


def init_value(name: str, shape: torch.Size, seed: int, n_layer: int, tied: bool = True) -> torch.Tensor:
    """The full fp32 initial value of parameter `name`: GPT-2's scheme, drawn from its own stream.
    N(0, 0.02) for weights and embeddings, scaled by 1/sqrt(2 n_layer) for the projections that
    write into the residual stream (GPT-2 paper, section 2.3); zero biases; LayerNorm (RMSNorm) gain 1.
    Llama uses the same: an untied lm_head draws its own N(0, 0.02)."""
    name = canonical_name(name, tied)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if ".ln_" in name or name.startswith("transformer.ln_f"):
        return torch.ones(shape)
    std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02
    gen = torch.Generator().manual_seed(stable_seed(seed, name))
    return torch.randn(shape, generator=gen) * std


def full_shapes(cfg: GPTConfig) -> dict[str, torch.Size]:
    """Shapes of every parameter of the unsharded model (built on meta: no memory)."""
    with torch.device("meta"):
        return {n: p.shape for n, p in GPT(cfg).named_parameters(remove_duplicate=False)}


def materialize(model: GPT, seed: int, device: torch.device | str = "cpu", shard_fn=None, values: bool = True) -> GPT:
    """Give every parameter of a meta-built model its initial value. `shard_fn(name, full)` returns
    the part of the full tensor this rank keeps (default: all of it). Peak extra memory is one full
    parameter. `values=False` gives each parameter only its shape (`placeholder`), for ZeRO-3, which
    draws the values itself one parameter at a time and keeps only its shard of each (zero.ZeroAdamW)."""
    shapes = full_shapes(model.config)
    done = {}
    for module_name, module in model.named_modules():
        for pname, param in list(module.named_parameters(recurse=False)):
            name = f"{module_name}.{pname}" if module_name else pname
            if id(param) not in done:  # a tied parameter is created once and shared
                if values:
                    value = init_value(name, shapes[name], seed, model.config.n_layer, model.config.tied)
                    value = (shard_fn(name, value) if shard_fn else value).to(device)
                else:
                    value = placeholder(param.shape, torch.float32, device)
                done[id(param)] = nn.Parameter(value, requires_grad=param.requires_grad)
                done[id(param)].__dict__.update(param.__dict__)  # its placement (parallel.place)
            setattr(module, pname, done[id(param)])
        for bname, buf in module.named_buffers(recurse=False):  # dropout's site, made whole
            setattr(module, bname, buf.to(device))
    return model


def placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """What a ZeRO-3 parameter holds when it is not in use: its shape, over a single element."""
    return torch.empty(1, dtype=dtype, device=device).expand(shape)


def build(cfg: GPTConfig, seed: int, device: torch.device | str = "cpu") -> GPT:
    """The single-device model: construct on meta, then materialize every parameter."""
    with torch.device("meta"):
        model = GPT(cfg)
    return materialize(model, seed, device)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def block_matrices(cfg: GPTConfig) -> int:
    """Weights of one block's matmuls: q and o are C x C, k and v C x H_kv D each (GQA: smaller), and the
    MLP's 2 (GPT-2) or 3 (SwiGLU) C x hidden."""
    C = cfg.n_embd
    return 2 * C * C + 2 * C * cfg.kv_heads * cfg.head_dim + (3 if cfg.llama else 2) * C * cfg.hidden


def n_params(cfg: GPTConfig) -> int:
    """count_params of a GPT of this shape, without building one. GPT-2: per block 12 C^2 + 13 C (attention
    4 C^2 + 4 C, MLP 8 C^2 + 5 C, two LayerNorms 4 C), the tied embedding V C, the position table T C
    and the final LayerNorm 2 C. Llama: per block its matrices and two RMSNorm gains 2 C, the embedding
    V C (twice, untied), the final RMSNorm C. An MoE layer holds E MLPs and a router (moe.param_delta)."""
    C, V = cfg.n_embd, cfg.padded_vocab
    mlp = (3 if cfg.llama else 2) * C * cfg.hidden + (0 if cfg.llama else cfg.hidden + C)
    if cfg.llama:
        return cfg.n_layer * (block_matrices(cfg) + 2 * C) + (1 if cfg.tied else 2) * V * C + C + param_delta(cfg, mlp)
    return cfg.n_layer * (12 * C * C + 13 * C) + (cfg.padded_vocab + cfg.block_size) * C + 2 * C + param_delta(cfg, mlp)


def fp8_flop_share(cfg: GPTConfig, seq_len: int) -> float:
    """The share of flops_per_token that --precision fp8 runs in fp8: the blocks' Linears (not attention's
    two matmuls, nor the output layer)."""
    return 6 * cfg.n_layer * block_matrices(cfg) / flops_per_token(cfg, seq_len)


def flops_per_token(cfg: GPTConfig, seq_len: int) -> float:
    """Training FLOPs per token, PaLM appendix B: 6N + 12 L H Q T. N counts every weight that takes
    part in a matmul: the blocks and the lm_head, not the position table nor the input embedding (a
    lookup; tied, it is the lm_head). 12 L H Q T is attention's scores and mixing, whatever H_kv. An MoE
    layer's N is what a token uses: k experts' MLPs and the router (the active parameters)."""
    L = cfg.n_layer
    n_matmul = L * block_matrices(cfg) + cfg.padded_vocab * cfg.n_embd \
        + active_matmul_delta(cfg, (3 if cfg.llama else 2) * cfg.n_embd * cfg.hidden)
    return 6 * n_matmul + 12 * L * cfg.n_head * cfg.head_dim * seq_len
