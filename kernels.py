"""Causal attention: one entry point, three implementations.

    attention(q, k, v, backend)      q, k, v: (B, n_head, T, head_dim)  ->  (B, n_head, T, head_dim)

    math    softmax(q k^T / sqrt(d) + causal mask) v, written out. Materializes the (T, T) score
            matrix: O(T^2) memory. The version to read, and the reference the others are tested
            against.
    sdpa    torch.nn.functional.scaled_dot_product_attention: PyTorch picks a fused kernel
            (FlashAttention / memory-efficient) where it has one.
    triton  our own FlashAttention-2 style kernel (forward and backward), added by lesson 05.

Causality is "bottom-right aligned": with Tq queries and Tk keys, query i sits at position
Tk - Tq + i and sees keys 0..Tk - Tq + i. For training Tq == Tk and this is the usual lower
triangle; when sampling with a KV cache, one new query (Tq = 1) sees every cached key.
"""

import math

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "math", "sdpa", "triton")


def attention_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention, for teaching and as the test reference."""
    Tq, Tk = q.size(-2), k.size(-2)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))  # (B, H, Tq, Tk)
    # key j is visible to query i when j <= i + (Tk - Tq)
    visible = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(diagonal=Tk - Tq)
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return probs @ v  # (B, H, Tq, D)


def attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """PyTorch's fused attention. Its `is_causal` is top-left aligned, so only use it when Tq == Tk."""
    Tq, Tk = q.size(-2), k.size(-2)
    if Tq == Tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if Tq == 1:  # one new token sees the whole cache
        return F.scaled_dot_product_attention(q, k, v, is_causal=False)
    visible = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(diagonal=Tk - Tq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Causal attention through the chosen backend. `auto` = Triton on CUDA, SDPA elsewhere."""
    if backend == "auto":
        backend = "sdpa"
    if backend == "math":
        return attention_math(q, k, v)
    if backend == "sdpa":
        return attention_sdpa(q, k, v)
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
