"""The output layer and its loss, fused: the (B, T, V) logits never exist.

    loss = lm_head_loss(x, weight, targets)      x (B, T, C), weight (V, C)  ->  mean cross-entropy

The logits of GPT-2's output layer are the biggest tensor of a training step: 16 x 1024 tokens
against a 50,304-row vocabulary is 3.3 GB in fp32, and the textbook loss keeps about three copies
(the 16-bit logits, their fp32 upcast, the softmax saved for the backward). Here the logits of a
chunk of rows are made, turned into the loss *and* their gradient at once, and dropped before the
next chunk: memory of one chunk plus a weight-sized gradient, the same FLOPs. model.CrossEntropy
calls it on one device; parallel.VocabParallelLoss calls it with a vocabulary offset and an
all-reduce, which makes it Megatron's vocab-parallel cross-entropy. Lessons 1 and 8.
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
        want_dx, want_dw = ctx.needs_input_grad[:2]
        N, V = x.size(0), weight.size(0)
        dx = torch.empty_like(x) if want_dx else None
        dw = torch.zeros(weight.shape, dtype=_fp32_or_wider(weight.dtype), device=weight.device) if want_dw else None
        losses = torch.empty(N, dtype=_fp32_or_wider(x.dtype), device=x.device)
        rows = loss_chunk_rows(V)
        for lo in range(0, N, rows):
            xc = x[lo:lo + rows]
            losses[lo:lo + rows], g = _loss_chunk(xc, weight, targets[lo:lo + rows] - vocab_start, all_reduce,
                                                  want_dx or want_dw)
            # |g| <= 1, safe in fp16; the mean's 1/N and the loss scale are applied in the backward
            if want_dx and mixed:
                dx[lo:lo + rows] = g @ weight
            elif want_dx:
                torch.mm(g, weight, out=dx[lo:lo + rows])
            if want_dw and mixed:
                dw += g.t() @ xc  # a 16-bit product, summed over the chunks in fp32
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
