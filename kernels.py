"""Causal attention: one entry point, three implementations, one of them our own GPU kernel.

    attention(q, k, v, backend)      q: (B, H, T, D), k and v: (B, H_kv, T, D)  ->  (B, H, T, D)
    attention_packed(qkv, backend, n_kv_head)    the same, of the model's fused projection (see below)

    math    softmax(q k^T / sqrt(d) + causal mask) v, written out. Materializes the (T, T) score
            matrix: O(T^2) memory. The version to read, and the reference the others are tested against.
    sdpa    torch.nn.functional.scaled_dot_product_attention: PyTorch picks a fused kernel where it has one.
    triton  our FlashAttention-2 kernel below (forward and backward). `auto` picks it where a GPU
            measured it faster than SDPA (support/launches.py, MEASURED); SDPA otherwise.

    resolve_backend(device, dtype, head_dim)   what `auto` means there: "triton" or "sdpa"
    triton_problem(device, dtype, head_dim)    None if the kernel runs there, else one line: why not, what to do

Causality is "bottom-right aligned": with Tq queries and Tk keys, query i sits at position
Tk - Tq + i and sees keys 0..Tk - Tq + i. For training Tq == Tk and this is the usual lower
triangle; when sampling with a KV cache, one new query (Tq = 1) sees every cached key.

FlashAttention (Dao et al. 2022; FlashAttention-2, Dao 2023). Attention does ~4 T^2 d FLOPs but
the math version also writes and reads the T x T scores and probabilities to GPU memory, and at
d = 64 that traffic, not the arithmetic, is the bottleneck. The kernel never forms the matrix: a
program owns BLOCK_M query rows, keeps them in registers, and streams key/value blocks past them,

              keys ->   n=0   n=1   n=2   n=3          stage 1: blocks left of the diagonal,
    queries   m=0     [ 2 ]   .     .     .                     every score visible, no mask
      |       m=1     [ 1 ] [ 2 ]   .     .          stage 2: the diagonal block, causal mask
      v       m=2     [ 1 ] [ 1 ] [ 2 ]   .          `.`:     right of the diagonal, never visited

with an online softmax: keep the running row max m, the running sum l = sum exp(s - m) and the
unnormalized output acc = sum exp(s - m) v. A new block with scores s_j and max m' rescales them:

    m' = max(m, max_j s_j)
    l  <- l e^(m - m') + sum_j e^(s_j - m')          acc <- acc e^(m - m') + sum_j e^(s_j - m') v_j

and at the end o = acc / l, exactly softmax(s) v. We work in base 2 (exp2 is one GPU instruction;
log2(e) is folded into the scale) and save lse = m + log2(l) per row for the backward, which then
rebuilds any probability as p = 2^(s - lse) instead of storing P. The backward, with dO given:

    dV = P^T dO    dP = dO V^T    dS = P * (dP - delta),  delta = rowsum(dO * O)    dQ = dS K    dK = dS^T Q

(times 1/sqrt(d) for dQ and dK). One kernel per key block sums dK, dV over the query blocks, one per
query block sums dQ over the key blocks: every output has a single writer, so no atomics, and the
gradients are bitwise deterministic. Lesson 06 derives all of this step by step.

Grouped-query attention (GQA: Ainslie et al. 2023). Each of the H query heads keeps its own q, but the
keys and values are shared: H_kv kv heads, each read by a group of G = H / H_kv query heads. H_kv = H
is the multi-head attention above (GPT-2), H_kv = 1 multi-query attention (MQA, Shazeer 2019):

    query heads   0 1 2 3 4 5 6 7        H = 8, H_kv = 2, G = 4: query head h reads kv head h // G
    kv heads      0 0 0 0 1 1 1 1

What it saves: K and V projections of 2 H_kv D features instead of 2 H D and, above all, a KV cache
G times smaller: at long contexts and large batches that cache, not the weights, fills the memory, and
reading it for each new token bounds decoding speed. The paper finds quality close to multi-head's.

The plain way (the math backend) repeats each kv head for its group: two (B, H, T, D) copies forward,
and dK, dV at H heads summed back per group. The kernel repeats nothing. A query head's program reads
its kv head's rows where they lie (forward, dQ); a kv head's dK/dV program walks the G query heads of
its group, summing into the same registers: one writer per output, no atomics, the same bits every
time, no memory beyond outputs and gradients (tests/test_kernels.py measures the bytes). The price:
B H_kv dK/dV programs per key block instead of B H, each G times longer (fewer busy cores for MQA at
batch 1). G reaches the kernels as the integer GROUP_SIZE, and Triton compiles an integer equal to 1 as
a constant: without GQA the kv-head arithmetic and the group loop fold away.

The kernels reach PyTorch as torch.library custom ops, nanoscale::flash_attn_fwd (q, k, v -> o, lse)
and nanoscale::flash_attn_bwd (q, k, v, o, lse, dO -> dQ, dK, dV), joined by register_autograd: to
torch.compile each is one opaque node (a "fake" implementation gives its outputs' shapes and strides),
so compiled code calls our launch as it is. The model calls their packed twins, flash_attn_qkv_fwd /
_bwd, which take the fused projection's output whole, (B, T, H + 2 H_kv, D) or GPT-2's (B, T, 3, H, D),
and write its gradient in place.
"""

import contextlib
import math

import torch
import torch.nn.functional as F

from support.launches import HEAD_DIMS, INTERPRETER_LAUNCH, SHIPPED, Launch, faster  # noqa: F401

try:
    import triton
    import triton.language as tl
except ImportError:  # the math and sdpa backends need no Triton
    triton = None

BACKENDS = ("auto", "math", "sdpa", "triton")


def attention_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention, for teaching and as the test reference."""
    if (group_size := q.size(1) // k.size(1)) > 1:  # GQA, the plain way: a copy of k and v per query head
        k, v = k.repeat_interleave(group_size, dim=1), v.repeat_interleave(group_size, dim=1)  # (B, H, Tk, D)
    Tq, Tk = q.size(-2), k.size(-2)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))  # (B, H, Tq, Tk)
    # key j is visible to query i when j <= i + (Tk - Tq)
    visible = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(diagonal=Tk - Tq)
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return probs @ v  # (B, H, Tq, D)


def attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """PyTorch's fused attention. Its `is_causal` is top-left aligned, so only use it when Tq == Tk.
    enable_gqa: k and v may have fewer heads than q (its fused kernels index them; its math fallback repeats)."""
    Tq, Tk = q.size(-2), k.size(-2)
    gqa = q.size(1) != k.size(1)
    if Tq == 1:  # one new token, which sees the whole cache
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    if Tq == Tk:  # the lower triangle (is_causal a constant: compiled, Tq == Tk may be a SymBool)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    visible = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(diagonal=Tk - Tq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=gqa)


# -------------------------------------------------------------------- launch configurations (support/launches.py)


def launch_config(head_dim: int, dtype: torch.dtype) -> Launch:
    return INTERPRETER_LAUNCH if INTERPRETED else SHIPPED[head_dim, dtype]


def triton_dtypes() -> tuple[torch.dtype, ...]:
    """On a GPU the shipped 16-bit types; the interpreter computes a bf16 tl.dot wrongly but fp32 right."""
    return (torch.float32, torch.float16) if INTERPRETED else (torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------- the kernels

if triton is not None:
    LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * log2(e))

    @triton.jit
    def _head(X, stride_b, stride_h, b, h):
        """Pointer to head h of batch b of a (B, heads, T, D) tensor; int64 so huge batches cannot overflow."""
        return X + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h

    @triton.jit
    def _load_rows(X, stride_t, offs_t, T, HEAD_DIM: tl.constexpr):
        """Rows offs_t of a (T, HEAD_DIM) tile. Rows past T read as 0 whatever memory holds there
        (NaN * 0 would poison a dot product), so any T works with any block size."""
        offs_d = tl.arange(0, HEAD_DIM)
        return tl.load(X + offs_t[:, None] * stride_t + offs_d[None, :], mask=offs_t[:, None] < T, other=0.0)

    @triton.jit
    def _store_rows(X, stride_t, offs_t, T, value, HEAD_DIM: tl.constexpr):
        offs_d = tl.arange(0, HEAD_DIM)
        tl.store(X + offs_t[:, None] * stride_t + offs_d[None, :], value.to(X.dtype.element_ty),
                 mask=offs_t[:, None] < T)

    @triton.jit
    def _fwd_kv_loop(acc, l_i, m_i, q, K, V, skt, svt, offs_m, lo, hi, TK, qk_scale,
                     HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr):
        """Stream key/value blocks [lo, hi) past the query block, updating the online softmax.
        MASK: 0 none, 1 causal (only the diagonal block pays for it; it also hides keys >= TK),
        2 only keys >= TK (the unmasked mode, whose last block may be partial)."""
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k = _load_rows(K, skt, offs_n, TK, HEAD_DIM)  # (BLOCK_N, D)
            v = _load_rows(V, svt, offs_n, TK, HEAD_DIM)  # (BLOCK_N, D)
            s = tl.dot(q, tl.trans(k)) * qk_scale  # (BLOCK_M, BLOCK_N) scores, in log2 units
            if MASK == 1:
                s = tl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))
            if MASK == 2:
                s = tl.where(offs_n[None, :] < TK, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every row sees at least key 0
            alpha = tl.math.exp2(m_i - m_new)  # rescales what was summed under the old max
            p = tl.math.exp2(s - m_new[:, None])  # (BLOCK_M, BLOCK_N)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)  # (BLOCK_M, D), fp32
            m_i = m_new
        return acc, l_i, m_i

    @triton.jit
    def _attn_fwd(Q, K, V, O, LSE,
                  sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot,
                  H, GROUP_SIZE, TQ, TK, sm_scale,
                  HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
        """One program: BLOCK_M queries of one (batch, query head). Writes O and the base-2 lse of each row.
        CAUSAL (TQ == TK): the lower triangle. Otherwise every query sees all TK keys (ring attention's
        blocks off the diagonal, context.py). K and V have H / GROUP_SIZE heads: query head h reads kv
        head h // GROUP_SIZE where it lies, never a copy."""
        # the last query blocks have the most keys to visit: launch them first so none is left at the end
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
        bh = tl.program_id(1)  # (batch, query head), flattened: also the row of LSE
        b, h = bh // H, bh % H
        kv = h // GROUP_SIZE
        Q, K, V = _head(Q, sqb, sqh, b, h), _head(K, skb, skh, b, kv), _head(V, svb, svh, b, kv)
        start_m = pid_m * BLOCK_M
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_rows(Q, sqt, offs_m, TQ, HEAD_DIM)  # (BLOCK_M, D), stays in registers
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max
        l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(s - m_i)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)  # running unnormalized output
        qk_scale = sm_scale * LOG2E
        if CAUSAL:
            # stage 1: key blocks entirely left of the diagonal (BLOCK_M is a multiple of BLOCK_N)
            acc, l_i, m_i = _fwd_kv_loop(acc, l_i, m_i, q, K, V, skt, svt, offs_m, 0, start_m, TK, qk_scale,
                                         HEAD_DIM, BLOCK_N, MASK=0)
            # stage 2: the diagonal block, masked; blocks to its right are never touched
            acc, l_i, m_i = _fwd_kv_loop(acc, l_i, m_i, q, K, V, skt, svt, offs_m, start_m,
                                         tl.minimum(start_m + BLOCK_M, TK), TK, qk_scale,
                                         HEAD_DIM, BLOCK_N, MASK=1)
        else:  # every key, only those past TK masked
            acc, l_i, m_i = _fwd_kv_loop(acc, l_i, m_i, q, K, V, skt, svt, offs_m, 0, TK, TK, qk_scale,
                                         HEAD_DIM, BLOCK_N, MASK=2)
        _store_rows(_head(O, sob, soh, b, h), sot, offs_m, TQ, acc / l_i[:, None], HEAD_DIM)
        tl.store(LSE + bh * TQ + offs_m, m_i + tl.math.log2(l_i), mask=offs_m < TQ)

    @triton.jit
    def _attn_bwd_delta(O, DO, DELTA, sob, soh, sot, sdb, sdh, sdt, H, T,
                        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
        """delta_i = sum_d dO_id O_id = sum_j P_ij dP_ij: the row term of the softmax backward."""
        bh = tl.program_id(1)
        b, h = bh // H, bh % H
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        o = _load_rows(_head(O, sob, soh, b, h), sot, offs_m, T, HEAD_DIM).to(tl.float32)
        do = _load_rows(_head(DO, sdb, sdh, b, h), sdt, offs_m, T, HEAD_DIM).to(tl.float32)
        tl.store(DELTA + bh * T + offs_m, tl.sum(o * do, 1), mask=offs_m < T)

    @triton.jit
    def _dkdv_q_loop(dk, dv, k, v, Q, DO, LSE, DELTA, sqt, sdt, offs_n, lo, hi, TQ, qk_scale,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
        """Stream query blocks [lo, hi) past one key block, summing its dK, dV. Works with the
        transposed scores s^T = K Q^T so that every product has the key block as its rows. Query rows
        past TQ load q = dO = lse = delta = 0, so their p is finite and their dS and dO are 0: no effect
        (and keys past TK loaded k = v = 0, whose rows are never stored)."""
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q = _load_rows(Q, sqt, offs_m, TQ, HEAD_DIM)  # (BLOCK_M, D)
            do = _load_rows(DO, sdt, offs_m, TQ, HEAD_DIM)  # (BLOCK_M, D)
            lse = tl.load(LSE + offs_m, mask=offs_m < TQ, other=0.0)  # (BLOCK_M,)
            delta = tl.load(DELTA + offs_m, mask=offs_m < TQ, other=0.0)  # (BLOCK_M,)
            p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :])  # (BLOCK_N, BLOCK_M) = P^T
            if CAUSAL:
                p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
            dv += tl.dot(p_t.to(do.dtype), do)  # dV = P^T dO
            dp_t = tl.dot(v, tl.trans(do))  # dP^T = V dO^T
            ds_t = p_t * (dp_t - delta[None, :])  # dS^T
            dk += tl.dot(ds_t.to(q.dtype), q)  # dK = dS^T Q (scaled by the caller)
        return dk, dv

    @triton.jit
    def _attn_bwd_dkdv(Q, K, V, DO, DK, DV, LSE, DELTA,
                       sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdb, sdh, sdt, sgb, sgh, sgt,
                       H, GROUP_SIZE, TQ, TK, sm_scale,
                       HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
        """One program: dK and dV of BLOCK_N keys of one (batch, kv head), their only writer. Under GQA the
        GROUP_SIZE query heads that read this kv head all contribute: the program walks them one after the
        other, summing into the same registers (deterministic, no atomics, no per-query-head copies)."""
        pid_n, bkv = tl.program_id(0), tl.program_id(1)  # (batch, kv head), flattened
        H_KV = H // GROUP_SIZE
        b, kv = bkv // H_KV, bkv % H_KV
        start_n = pid_n * BLOCK_N
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_rows(_head(K, skb, skh, b, kv), skt, offs_n, TK, HEAD_DIM)  # (BLOCK_N, D)
        v = _load_rows(_head(V, svb, svh, b, kv), svt, offs_n, TK, HEAD_DIM)  # (BLOCK_N, D)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        qk_scale = sm_scale * LOG2E
        for g in range(0, GROUP_SIZE):  # the group's query heads; one iteration without GQA
            h = kv * GROUP_SIZE + g
            Qh, DOh = _head(Q, sqb, sqh, b, h), _head(DO, sdb, sdh, b, h)
            LSEh, DELTAh = LSE + (b * H + h) * TQ, DELTA + (b * H + h) * TQ
            if CAUSAL:
                # the diagonal block: queries start_n .. start_n + BLOCK_N, masked (BLOCK_N is a multiple of BLOCK_M)
                dk, dv = _dkdv_q_loop(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, sqt, sdt, offs_n, start_n,
                                      tl.minimum(start_n + BLOCK_N, TQ), TQ, qk_scale, HEAD_DIM, BLOCK_M,
                                      CAUSAL=True)
                lo = start_n + BLOCK_N  # every later query sees all of these keys: no mask
            else:
                lo = 0  # every query sees every key
            dk, dv = _dkdv_q_loop(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, sqt, sdt, offs_n, lo, TQ, TQ,
                                  qk_scale, HEAD_DIM, BLOCK_M, CAUSAL=False)
        _store_rows(_head(DK, sgb, sgh, b, kv), sgt, offs_n, TK, dk * sm_scale, HEAD_DIM)
        _store_rows(_head(DV, sgb, sgh, b, kv), sgt, offs_n, TK, dv, HEAD_DIM)

    @triton.jit
    def _dq_kv_loop(dq, q, do, lse, delta, K, V, skt, svt, offs_m, lo, hi, TK, qk_scale,
                    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
        """Stream key blocks [lo, hi) past one query block, summing its dQ. Keys past TK load
        k = v = 0: their dS is not 0, but it multiplies k = 0."""
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k = _load_rows(K, skt, offs_n, TK, HEAD_DIM)  # (BLOCK_N, D)
            v = _load_rows(V, svt, offs_n, TK, HEAD_DIM)  # (BLOCK_N, D)
            p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse[:, None])  # (BLOCK_M, BLOCK_N)
            if CAUSAL:
                p = tl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)
            dp = tl.dot(do, tl.trans(v))  # (BLOCK_M, BLOCK_N)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k)  # dQ = dS K (scaled by the caller)
        return dq

    @triton.jit
    def _attn_bwd_dq(Q, K, V, DO, DQ, LSE, DELTA,
                     sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdb, sdh, sdt, sgb, sgh, sgt,
                     H, GROUP_SIZE, TQ, TK, sm_scale,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
        """One program: dQ of BLOCK_M queries of one (batch, query head), its only writer; it reads its
        kv head's K and V, as the forward does."""
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # longest rows first, as in the forward
        bh = tl.program_id(1)
        b, h = bh // H, bh % H
        K, V = _head(K, skb, skh, b, h // GROUP_SIZE), _head(V, svb, svh, b, h // GROUP_SIZE)
        start_m = pid_m * BLOCK_M
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_rows(_head(Q, sqb, sqh, b, h), sqt, offs_m, TQ, HEAD_DIM)  # (BLOCK_M, D)
        do = _load_rows(_head(DO, sdb, sdh, b, h), sdt, offs_m, TQ, HEAD_DIM)  # (BLOCK_M, D)
        lse = tl.load(LSE + bh * TQ + offs_m, mask=offs_m < TQ, other=0.0)
        delta = tl.load(DELTA + bh * TQ + offs_m, mask=offs_m < TQ, other=0.0)
        dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        qk_scale = sm_scale * LOG2E
        dq = _dq_kv_loop(dq, q, do, lse, delta, K, V, skt, svt, offs_m, 0, start_m if CAUSAL else TK, TK,
                         qk_scale, HEAD_DIM, BLOCK_N, CAUSAL=False)
        if CAUSAL:
            dq = _dq_kv_loop(dq, q, do, lse, delta, K, V, skt, svt, offs_m, start_m,
                             tl.minimum(start_m + BLOCK_M, TK), TK, qk_scale, HEAD_DIM, BLOCK_N, CAUSAL=True)
        _store_rows(_head(DQ, sgb, sgh, b, h), sgt, offs_m, TQ, dq * sm_scale, HEAD_DIM)

    INTERPRETED = not isinstance(_attn_fwd, triton.runtime.JITFunction)  # TRITON_INTERPRET=1 at import
else:
    INTERPRETED = False


# ----------------------------------------------------------------------------- the host side


def _bht(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    """The kernels read rows of D contiguous numbers; any other strides are passed through as they are."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _grid(T: int, block: int, BH: int) -> tuple[int, int]:
    if BH > 65535:  # CUDA's limit on the second grid dimension
        raise ValueError(f"batch * heads = {BH} is more than the kernel's grid allows (65535)")
    return triton.cdiv(T, block), BH


def _empty_bhtd(like: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) laid out as (B, T, H, D): the model's y.transpose(1, 2).reshape is then free."""
    B, H, T, D = like.shape
    return like.new_empty(B, T, H, D).transpose(1, 2)


def _empty_lse(like: torch.Tensor) -> torch.Tensor:  # (B, H, T), contiguous: indexed as bh * T + t
    return like.new_empty(like.shape[:3], dtype=torch.float32)


def flash_forward(q, k, v, cfg: Launch, causal: bool = True):
    """q (B, H, TQ, D), k and v (B, H_kv, TK, D) with H_kv dividing H. Returns o (B, H, TQ, D) and the
    base-2 log-sum-exp of every score row, (B, H, TQ) fp32. causal needs TQ == TK; causal=False lets
    every query see every key."""
    (B, H, TQ, D), TK = q.shape, k.size(2)
    assert cfg.block_m % cfg.block_n == 0, "stage 1 must end on a key-block boundary"
    assert TQ == TK or not causal, "the causal mode is the square lower triangle"
    o, lse = _empty_bhtd(q), _empty_lse(q)
    grid = _grid(TQ, cfg.block_m, B * H)  # a program per (query block, batch, query head)
    _attn_fwd[grid](q, k, v, o, lse, *_bht(q), *_bht(k), *_bht(v), *_bht(o),
                    H, H // k.size(1), TQ, TK, 1 / math.sqrt(D),  # G = H / H_kv
                    HEAD_DIM=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=causal,
                    num_warps=cfg.fwd_warps, num_stages=cfg.fwd_stages)
    return o, lse


def flash_backward(q, k, v, o, lse, do, cfg: Launch, out=None, causal: bool = True):
    """Returns dq (B, H, TQ, D), dk and dv (B, H_kv, TK, D) (written into `out` when given; dk and dv share
    one set of strides). Three launches, each output written by exactly one program: deterministic. `o`
    and `lse` are the rows' final output and base-2 log-sum-exp: from this forward, or, for one block of
    ring attention, the merged ones over every block (then the gradients are this block's share)."""
    (B, H, TQ, D), (H_kv, TK) = q.shape, k.shape[1:3]
    assert cfg.big % cfg.small == 0, "the diagonal stage must end on a block boundary"
    delta = torch.empty_like(lse)  # (B, H, TQ)
    _attn_bwd_delta[_grid(TQ, cfg.big, B * H)](o, do, delta, *_bht(o), *_bht(do), H, TQ, HEAD_DIM=D,
                                               BLOCK_M=cfg.big)
    dq, dk, dv = out or (_empty_bhtd(q), _empty_bhtd(k), _empty_bhtd(k))
    assert dk.stride() == dv.stride(), "one set of strides for dK and dV"
    common = (*_bht(q), *_bht(k), *_bht(v), *_bht(do))
    scalars = (H, H // H_kv, TQ, TK, 1 / math.sqrt(D))
    launch = dict(HEAD_DIM=D, CAUSAL=causal, num_warps=cfg.bwd_warps, num_stages=cfg.bwd_stages)
    # dK, dV: a program per `big` keys of a kv head, walking `small` query blocks of each query head of
    # its group; dQ: a program per `big` queries of a query head, walking `small` key blocks
    _attn_bwd_dkdv[_grid(TK, cfg.big, B * H_kv)](q, k, v, do, dk, dv, lse, delta, *common, *_bht(dk), *scalars,
                                                 BLOCK_M=cfg.small, BLOCK_N=cfg.big, **launch)
    _attn_bwd_dq[_grid(TQ, cfg.big, B * H)](q, k, v, do, dq, lse, delta, *common, *_bht(dq), *scalars,
                                            BLOCK_M=cfg.big, BLOCK_N=cfg.small, **launch)
    return dq, dk, dv


# ----------------------------------------------------------------------------- can the kernel run here?


def triton_problem(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """None when our kernel can run attention with these inputs; otherwise one line: why not, and what to do."""
    device = torch.device(device)
    if triton is None:
        return "the triton package is not installed: pip install triton; or use --attn sdpa"
    if device.type == "cpu" and not INTERPRETED:
        return "runs on a CPU only in the Triton interpreter: start Python with TRITON_INTERPRET=1; use --attn sdpa"
    if device.type not in ("cpu", "cuda"):
        return f"runs on NVIDIA GPUs (or a CPU in the Triton interpreter), not on {device.type}; use --attn sdpa"
    if device.type == "cuda" and not INTERPRETED:  # the interpreter runs anything, slowly
        props = torch.cuda.get_device_properties(device)  # a constant to torch.compile: compiled code may ask
        name, major, minor = props.name, props.major, props.minor
        if torch.version.hip:
            return f"{name}: the launch configurations are checked for NVIDIA GPUs only; use --attn sdpa"
        if (major, minor) < (8, 0):  # the shipped table is compiled and checked for sm_80 and sm_90
            return f"{name} (sm_{major}{minor}) is older than the kernel's sm_80 minimum; use --attn sdpa"
    if dtype not in triton_dtypes():
        dtype_name = str(dtype).removeprefix("torch.")
        if INTERPRETED:
            return (f"the Triton interpreter computes fp32 and fp16, not {dtype_name} (its bf16 tl.dot is "
                    "wrong); use --precision fp32, or --attn sdpa")
        return f"the kernel computes in fp16 or bf16, not {dtype_name}; use --precision bf16 or fp16, or --attn sdpa"
    if head_dim not in HEAD_DIMS:
        return (f"head_dim {head_dim} is not one the kernel supports ({', '.join(map(str, HEAD_DIMS))}); "
                "choose n_embd / n_head among them, or use --attn sdpa")
    return None


def resolve_backend(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """What `auto` means here: our kernel on a GPU that runs it, where one of its kind measured it
    faster than SDPA (support/launches.py, MEASURED); SDPA everywhere else, the interpreter too: no
    default run is slower for the kernel being one to learn from. Decide once, pass it on."""
    on_gpu = torch.device(device).type == "cuda" and not INTERPRETED
    if not on_gpu or triton_problem(device, dtype, head_dim):
        return "sdpa"
    props = torch.cuda.get_device_properties(device)  # a constant to torch.compile
    return "triton" if faster((props.major, props.minor), head_dim, dtype) else "sdpa"


# ----------------------------------------------------------------------------- the custom op
# (one opaque node to torch.compile: the fake implementations give its outputs' metadata, register_autograd
# its backward, and the real ones run eagerly whenever compiled code reaches them)


def check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, square: bool = False) -> None:
    """q (B, H, T, D); k and v (B, H_kv, T, D) alike, H_kv dividing H (and, square, Tk = Tq): one line otherwise."""
    fits = q.dim() == k.dim() == 4 and k.shape == v.shape and (k.size(0), k.size(3)) == (q.size(0), q.size(3))
    if not (fits and k.size(1) > 0 and q.size(1) % k.size(1) == 0):
        raise ValueError(f"attention takes q (B, H, T, D) and k, v (B, H_kv, T, D) with H_kv dividing H, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if square and k.size(2) != q.size(2):
        raise ValueError(f"flash attention takes as many keys as queries, got {k.size(2)} and {q.size(2)}")


def _on_device(x: torch.Tensor):
    """Triton launches on the current CUDA device, which need not be the tensors' one."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


@torch.library.custom_op("nanoscale::flash_attn_fwd", mutates_args=())
def flash_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention. q (B, H, T, D), k and v (B, H_kv, T, D) -> o (B, H, T, D), laid out (B, T, H, D), and
    lse (B, H, T) fp32."""
    check_heads(q, k, v, square=True)
    if problem := triton_problem(q.device, q.dtype, q.size(-1)):
        raise RuntimeError(f"attention backend 'triton': {problem}")
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    with _on_device(q):
        return flash_forward(q, k, v, launch_config(q.size(-1), q.dtype))


@flash_attn_fwd.register_fake
def _flash_attn_fwd_fake(q, k, v):
    check_heads(q, k, v, square=True)
    return _empty_bhtd(q), _empty_lse(q)  # the very allocations flash_forward makes: same strides


@torch.library.custom_op("nanoscale::flash_attn_bwd", mutates_args=())
def flash_attn_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                   do: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients dq (B, H, T, D), dk and dv (B, H_kv, T, D), each laid out (B, T, heads, D), of
    flash_attn_fwd's o, given do."""
    q, k, v, o, do = (_unit_last(x) for x in (q, k, v, o, do))
    with _on_device(q):
        return flash_backward(q, k, v, o, lse.contiguous(), do, launch_config(q.size(-1), q.dtype))


@flash_attn_bwd.register_fake
def _flash_attn_bwd_fake(q, k, v, o, lse, do):
    return _empty_bhtd(q), _empty_bhtd(k), _empty_bhtd(k)


def _setup_context(ctx, inputs, output):
    """Runs after the forward: keep what the backward needs (q, k, v, o, lse), O(T) memory, not O(T^2)."""
    ctx.save_for_backward(*inputs, *output)
    ctx.mark_non_differentiable(output[1])  # lse: an output for the backward, not for a loss


def _backward(ctx, do, _dlse):
    q, k, v, o, lse = ctx.saved_tensors
    return flash_attn_bwd(q, k, v, o, lse, do)


flash_attn_fwd.register_autograd(_backward, setup_context=_setup_context)


# The projection makes q, k, v as one tensor: through three views, their gradients would be stacked and
# copied back into its layout (two copies a layer). These ops take it whole and write dq, dk, dv straight
# into one gradient of its layout. Two packings, one memory order:
#     (B, T, H + 2 H_kv, D)   H query heads, then H_kv key heads, then H_kv value heads (any GQA)
#     (B, T, 3, H, D)         GPT-2's view of its 3 H D features: the first with H_kv = H


def unpack_qkv(qkv: torch.Tensor, n_kv_head: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packed projection -> q (B, H, T, D), k and v (B, H_kv, T, D), views into it (no copy).
    (B, T, 3, H, D) takes no n_kv_head (it is H); (B, T, H + 2 H_kv, D) needs n_kv_head = H_kv."""
    if qkv.dim() == 5 and qkv.size(2) == 3 and n_kv_head in (None, qkv.size(3)):
        return qkv.permute(2, 0, 3, 1, 4).unbind(0)
    heads = qkv.size(2) if qkv.dim() == 4 else 0
    if n_kv_head is None or n_kv_head < 1 or heads <= 2 * n_kv_head or (heads - 2 * n_kv_head) % n_kv_head:
        raise ValueError(f"packed attention takes qkv of shape (B, T, 3, H, D), or (B, T, H + 2 H_kv, D) with "
                         f"n_kv_head = H_kv dividing H; got {tuple(qkv.shape)} and n_kv_head={n_kv_head}")
    q, k, v = qkv.split([heads - 2 * n_kv_head, n_kv_head, n_kv_head], dim=2)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


@torch.library.custom_op("nanoscale::flash_attn_qkv_fwd", mutates_args=())
def flash_attn_qkv_fwd(qkv: torch.Tensor, n_kv_head: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_fwd of the packed q, k, v (either packing, see unpack_qkv)."""
    return flash_attn_fwd(*unpack_qkv(_unit_last(qkv), n_kv_head))


@flash_attn_qkv_fwd.register_fake
def _flash_attn_qkv_fwd_fake(qkv, n_kv_head=None):
    return _flash_attn_fwd_fake(*unpack_qkv(qkv, n_kv_head))


@torch.library.custom_op("nanoscale::flash_attn_qkv_bwd", mutates_args=())
def flash_attn_qkv_bwd(qkv: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, do: torch.Tensor,
                       n_kv_head: int | None = None) -> torch.Tensor:
    """The gradient of flash_attn_qkv_fwd's o with respect to qkv, in qkv's own packed layout: dq, dk and
    dv are written into its three parts (under GQA each kv head's part is its group's sum)."""
    qkv, o, do = _unit_last(qkv), _unit_last(o), _unit_last(do)
    dqkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)  # contiguous
    with _on_device(qkv):
        flash_backward(*unpack_qkv(qkv, n_kv_head), o, lse.contiguous(), do,
                       launch_config(qkv.size(-1), qkv.dtype), out=unpack_qkv(dqkv, n_kv_head))
    return dqkv


@flash_attn_qkv_bwd.register_fake
def _flash_attn_qkv_bwd_fake(qkv, o, lse, do, n_kv_head=None):
    return torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)


def _setup_context_qkv(ctx, inputs, output):
    _setup_context(ctx, inputs[:1], output)  # qkv, o, lse
    ctx.n_kv_head = inputs[1]


def _backward_qkv(ctx, do, _dlse):
    qkv, o, lse = ctx.saved_tensors
    return flash_attn_qkv_bwd(qkv, o, lse, do, ctx.n_kv_head), None  # n_kv_head is no tensor: no gradient


flash_attn_qkv_fwd.register_autograd(_backward_qkv, setup_context=_setup_context_qkv)


# ----------------------------------------------------------------------------- choosing a backend


def attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Our kernel on CUDA, or in the Triton interpreter on a CPU (for teaching: slow, tiny sizes only)."""
    if q.size(-2) != k.size(-2):  # decoding with a KV cache: tiny work, SDPA handles the alignment
        return attention_sdpa(q, k, v)
    o, _ = flash_attn_fwd(q, k, v)  # raises with triton_problem's answer where the kernel cannot run
    return o


def attention_packed(qkv: torch.Tensor, backend: str = "auto", n_kv_head: int | None = None) -> torch.Tensor:
    """attention(q, k, v, backend) of the packed qkv: (B, T, 3, H, D), or (B, T, H + 2 H_kv, D) with
    n_kv_head = H_kv (see unpack_qkv) -> (B, H, T, D). Our kernel takes it whole, so its gradient needs
    no stacking (flash_attn_qkv_fwd); the others get the three views."""
    if backend == "auto":
        backend = resolve_backend(qkv.device, qkv.dtype, qkv.size(-1))
    if backend == "triton":
        o, _ = flash_attn_qkv_fwd(qkv, n_kv_head)
        return o
    return attention(*unpack_qkv(qkv, n_kv_head), backend)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Causal attention through the chosen backend: q (B, H, Tq, D), k and v (B, H_kv, Tk, D) (H_kv = H
    for multi-head attention, fewer for GQA) -> (B, H, Tq, D). Under torch.compile, pass a backend that
    resolve_backend has already chosen: then the choice below is plain string comparison."""
    check_heads(q, k, v)
    if backend == "auto":
        backend = resolve_backend(q.device, q.dtype, q.size(-1))
    if backend not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    return IMPLEMENTATIONS[backend](q, k, v)


IMPLEMENTATIONS = {"math": attention_math, "sdpa": attention_sdpa, "triton": attention_triton}
