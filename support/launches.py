"""The Triton attention kernel's launch configurations: block sizes, warps and pipeline stages, per
(head_dim, dtype); and what a GPU measured of it against SDPA, which `--attn auto` goes by. Numbers
the kernel stands on, not how attention is computed (kernels.py is that): chosen on a GPU by
tests/tune_attention.py, proven to compile for sm_80 and sm_90 without spilling by
tests/test_kernels_aot.py, timed by tests/bench_attention.py. kernels.py re-exports the table
(kernels.SHIPPED, kernels.Launch)."""

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



class Measured(NamedTuple):
    """Our kernel's forward + backward TFLOP/s over SDPA's, at the worst and the best of
    tests/bench_attention.py's shapes (causal, 16 heads, T 1k to 8k), and the run that measured
    them."""
    low: float
    high: float
    source: str


# What `--attn auto` goes by (kernels.resolve_backend): our kernel only where a GPU measured it
# faster than SDPA, forward + backward (training's work), at every shape; SDPA where it was slower
# or never measured, so that nobody's default run is slower for the kernel being one to learn from.
# By (compute capability, head_dim, dtype); a GPU run of tests/bench_attention.py adds or replaces
# rows (README, "Measured", has the runs).
MEASURED: dict[tuple[tuple[int, int], int, torch.dtype], Measured] = {
    ((9, 0), 64, torch.bfloat16): Measured(0.70, 0.76, "H200, 2026-11-26, Triton 3.6"),
    ((9, 0), 128, torch.bfloat16): Measured(0.35, 0.43, "H200, 2026-11-26, Triton 3.6"),
}


def faster(capability: tuple[int, int], head_dim: int, dtype: torch.dtype) -> bool:
    """Has a GPU of this capability measured ours faster than SDPA at this head_dim and dtype?"""
    m = MEASURED.get((capability, head_dim, dtype))
    return m is not None and m.low > 1


def measured(capability: tuple[int, int], head_dim: int, dtype: torch.dtype) -> str:
    """What MEASURED says there, in words: why `auto` chose as it did on a GPU that runs ours."""
    name = str(dtype).removeprefix("torch.")
    where = f"sm_{capability[0]}{capability[1]}, head dim {head_dim}, {name}"
    if (m := MEASURED.get((capability, head_dim, dtype))) is None:
        return f"ours never measured on {where}; tests/bench_attention.py there would say"
    return f"ours {m.low:.2f}-{m.high:.2f}x SDPA forward+backward on {where} ({m.source})"
