"""The output layer and its loss, fused: the (B, T, V) logits never exist.

    loss = lm_head_loss(x, weight, targets)      x (B, T, C), weight (V, C)  ->  mean cross-entropy

The logits of GPT-2's output layer are the biggest tensor of a training step: 16 x 1024 tokens
against a 50,304-row vocabulary is 3.3 GB in fp32, and the textbook loss keeps about three copies
(the 16-bit logits, their fp32 upcast, the softmax saved for the backward). Here the logits of a
chunk of rows are made, turned into the loss *and* their gradient at once, and dropped before the
next chunk: memory of one chunk plus a weight-sized gradient, the same FLOPs. model.CrossEntropy
calls it on one device; parallel.VocabParallelLoss calls it with a vocabulary offset and an
all-reduce, which makes it Megatron's vocab-parallel cross-entropy. Lessons 1 and 10.
"""

import torch
import torch.nn.functional as F

# fp32 logits of one chunk of rows: big enough that its matmuls run at full speed (on a CPU one
# chunk of 1k rows beats many small ones: each chunk also passes over all of dW), small enough that
# the logits of GPT-2 at 16k tokens per micro-batch (3.3 GB in fp32) take 1/13 of that
LOSS_CHUNK_BYTES = 256 * 2**20


def loss_chunk_rows(n_vocab: int) -> int:
    return max(1, LOSS_CHUNK_BYTES // (4 * n_vocab))


class LMHeadCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of logits = x W^T, a chunk of rows at a time: the (N, V) logits never exist.

        for each chunk of rows i:   s = x_i W^T (fp32)     loss_i = logsumexp(s) - s[target]
                                    g = softmax(s) - onehot(target)
                                    dx_i = g W             dW += g^T x_i      (both times 1/N)

    The gradient is computed in the forward, while the chunk's logits are at hand, and kept until
    the backward multiplies it by the incoming scalar: the same FLOPs as the unfused layer (no second
    matmul to rebuild the logits), and memory of one chunk of logits plus a weight-sized dW instead
    of ~12 bytes per logit (16-bit logits, their fp32 copy, the softmax saved for the backward).

    Under fp16 the gradient is lifted by a power of two before the matmuls cast it (`fp16_headroom`):
    made here, before the loss scale, its small entries would otherwise fall below fp16's range.

    `vocab_start` and `all_reduce(t, op)` make it the vocab-parallel loss of Megatron (section 3):
    W holds rows [vocab_start, vocab_start + V_local) of the full table, and per chunk the row max
    (MAX) and then the sum of exponentials and the target's logit (SUM) are reduced over the ranks.
    """

    @staticmethod
    def forward(ctx, x, weight, targets, vocab_start=0, all_reduce=None):
        # x (N, C), weight (V_local, C), targets (N,). Under autocast the matmuls cast their inputs
        # (the weight once per optimizer step: autocast caches it, see stability.Precision), and the
        # softmax runs in fp32 whatever their dtype.
        mixed = torch.is_autocast_enabled(x.device.type)
        fp16 = mixed and torch.get_autocast_dtype(x.device.type) == torch.float16
        want_dx, want_dw = ctx.needs_input_grad[:2]
        N, V = x.size(0), weight.size(0)
        dx = torch.empty_like(x) if want_dx else None
        dw = torch.zeros(weight.shape, dtype=_fp32_or_wider(weight.dtype), device=weight.device) if want_dw else None
        losses = torch.empty(N, dtype=_fp32_or_wider(x.dtype), device=x.device)
        w_max = weight.detach().abs().amax().float() if fp16 else None
        rows = loss_chunk_rows(V)
        for lo in range(0, N, rows):
            xc = x[lo:lo + rows]
            losses[lo:lo + rows], g = _loss_chunk(xc, weight, targets[lo:lo + rows] - vocab_start, all_reduce,
                                                  want_dx or want_dw)
            # |g| <= 1; the mean's 1/N and the loss scale are applied in the backward. In fp16, g is
            # first lifted by a power of two f, and each product divided by f in fp32 (fp16_headroom)
            if want_dx and fp16:
                f = fp16_headroom(g, 2 * w_max)  # a row of |g| sums to at most 2: |g W| <= 2 max|W|
                dx[lo:lo + rows] = g.mul_(f) @ weight
                dx[lo:lo + rows] /= f
                g.div_(f)  # exact: f is a power of two
            elif want_dx and mixed:
                dx[lo:lo + rows] = g @ weight
            elif want_dx:
                torch.mm(g, weight, out=dx[lo:lo + rows])
            if want_dw and fp16:  # |g^T x| <= the largest column sum of |g| times max |x|
                f = fp16_headroom(g, torch.linalg.vector_norm(g, 1, dim=0).amax() * xc.detach().abs().amax())
                dw.addcdiv_(g.mul_(f).t() @ xc, f)  # a 16-bit product, summed over the chunks in fp32
            elif want_dw and mixed:
                dw += g.t() @ xc  # a 16-bit product (bf16 has fp32's range), summed over the chunks in fp32
            elif want_dw:
                dw.addmm_(g.t(), xc)
            del g  # before the next chunk's logits are made: one chunk alive at a time
        ctx.save_for_backward(dx, dw)
        ctx.n, ctx.w_dtype = N, weight.dtype
        return losses.mean()

    @staticmethod
    def backward(ctx, grad):
        dx, dw = ctx.saved_tensors
        scale = grad / ctx.n  # the mean's 1/N times the incoming gradient (an fp16 loss scale, say)
        dx = None if dx is None else dx.mul_(scale.to(dx.dtype))  # used once: scaled in place
        dw = None if dw is None else dw.mul_(scale).to(ctx.w_dtype)
        return dx, dw, None, None, None


def fp16_headroom(g: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """The power of two f to multiply a chunk's gradient g by before an fp16 matmul casts it, for a
    product whose entries are at most `bound`. The softmax's gradient has entries of every size down to
    nothing: fp16 keeps 11 bits only above 6e-5 and flushes what is below 3e-8 (the textbook layer
    casts it after the loss scale, Micikevicius et al. 2018; here it is made in the forward, before any
    scale is known). f lifts them as far as the product allows: f * bound <= 2^15, half of fp16's
    largest, and f |g| <= 2^15 too (|g| <= 1). Never below 1: no worse than no lift. Dividing the
    product by f, in fp32, is exact. A tensor: the host never waits for the device to learn it."""
    return torch.exp2(torch.floor(torch.log2(2.0**15 / bound.clamp_min(1.0)))).clamp_min(1.0)


def _fp32_or_wider(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _loss_chunk(x, w, local_targets, all_reduce, want_grad: bool):
    """Per-row loss of one chunk, and (if wanted) the gradient of the rows' summed loss w.r.t. their logits."""
    s = F.linear(x, w)  # (n, V_local); of w itself, not a view of it: autocast caches only leaf tensors
    s = s.to(_fp32_or_wider(s.dtype))
    m = s.amax(dim=1)
    if all_reduce:
        all_reduce(m, "max")
    mine = (local_targets >= 0) & (local_targets < s.size(1))  # this rank holds the target's row
    idx = local_targets.clamp(0, s.size(1) - 1).unsqueeze(1)
    z = (s.gather(1, idx).squeeze(1) - m) * mine  # the target's logit, shifted
    p = s.sub_(m.unsqueeze(1)).exp_()  # in place: s is not needed again
    stats = torch.stack([p.sum(dim=1), z])
    if all_reduce:
        all_reduce(stats, "sum")
    S, z = stats
    if not want_grad:
        return S.log() - z, None
    p.div_(S.unsqueeze(1))
    p.scatter_add_(1, idx, -mine.to(p.dtype).unsqueeze(1))  # softmax - onehot(target)
    return S.log() - z, p


def lm_head_loss(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_start: int = 0,
                 all_reduce=None) -> torch.Tensor:
    """mean over rows of cross_entropy(x W^T, targets), fused and chunked (LMHeadCrossEntropy).
    x (..., C), weight (V, C), targets (...)."""
    return LMHeadCrossEntropy.apply(x.flatten(0, -2), weight, targets.flatten(), vocab_start, all_reduce)
