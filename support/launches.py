"""The Triton attention kernel's launch configurations: block sizes, warps and pipeline stages, per
(head_dim, dtype). Numbers the kernel stands on, not how attention is computed (kernels.py is that):
chosen on a GPU by tests/tune_attention.py, proven to compile for sm_80 and sm_90 without spilling by
tests/test_kernels_aot.py. kernels.py re-exports them (kernels.SHIPPED, kernels.Launch)."""

from typing import NamedTuple

import torch


class Launch(NamedTuple):
    """Forward: a program owns BLOCK_M queries and steps through keys BLOCK_N at a time. Backward: the
    dK/dV program owns `big` keys and steps through queries `small` at a time; the dQ program owns `big`
    queries and steps through keys `small` at a time."""
    block_m: int
    block_n: int
    fwd_warps: int
    fwd_stages: int
    small: int
    big: int
    bwd_warps: int
    bwd_stages: int


# No autotuning (it cannot run without a GPU): one entry per (head_dim, dtype), each compiled ahead of
# time for sm_80 and sm_90 by tests/test_kernels_aot.py, which checks tensor cores, shared memory and
# that ptxas spills no registers. fp16 and bf16 share entries: same sizes, same tensor-core shapes.
SHIPPED: dict[tuple[int, torch.dtype], Launch] = {}
for _dtype in (torch.float16, torch.bfloat16):
    SHIPPED[16, _dtype] = Launch(128, 64, 4, 3, 32, 128, 4, 3)
    SHIPPED[32, _dtype] = Launch(128, 64, 4, 3, 32, 128, 4, 3)
    # Forward: tune_attention.py's winner on an H200 (sm_90, bf16, Triton 3.6), 2026-11-26: 1.03x the
    # previous entry at D = 64, 1.38x at D = 128. Backward: the winner there (32, 64, 4 warps, 3 stages) was
    # 1.3x faster at D = 64 and 2.5x at D = 128, but spills registers under Triton 3.8 at D = 128 (and for
    # GQA on sm_80 at 64), so these stay as they were until a GPU run under Triton 3.8 weighs the spill.
    SHIPPED[64, _dtype] = Launch(64, 64, 4, 3, 32, 128, 8, 3)
    SHIPPED[128, _dtype] = Launch(64, 64, 4, 3, 32, 64, 8, 3)
HEAD_DIMS = (16, 32, 64, 128)
# In the interpreter: small blocks (quick to interpret, and tiny tests still cross block boundaries).
INTERPRETER_LAUNCH = Launch(32, 16, 4, 1, 16, 32, 4, 1)
