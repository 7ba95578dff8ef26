"""Choose the attention kernel's launch configurations for a GPU (not collected by pytest).

    python tests/tune_attention.py                  # on a CUDA GPU: time the space, print the winners
    python tests/tune_attention.py --n-kv-head 4    # the same for grouped-query attention (16 query heads)
    python tests/tune_attention.py --prune-only     # any machine: which candidates compile cleanly for sm_80/sm_90

kernels.py never autotunes at run time (Triton's autotuner picks by timing, so two runs could pick
different configurations, and it cannot run without a GPU): it launches the configuration recorded
in kernels.SHIPPED for the head dim and dtype. This tool is how those records are chosen:

  1. the space: forward (BLOCK_M, BLOCK_N, warps, stages) and backward (small, big, warps, stages),
     tuned separately since they are separate launches;
  2. pruned ahead of time, for the GPU's architecture: each candidate kernel is compiled without
     running (tests/test_kernels_aot.py) and dropped if ptxas reports a register spill or it needs
     more shared memory than a block may have;
  3. timed on the GPU: each survivor, at T = 1k, 2k, 4k, 8k (B*H*T fixed), causal; the score is
     the geometric mean of its times, and the best forward and best backward make the Launch.

With --n-kv-head the kernels prune as their grouped-query build (the kv head a run-time value, the
dK/dV program looping over its group) and are timed with that many kv heads; one table serves both
(kernels.SHIPPED has no kv-head key), so a GQA winner is a hint to weigh against the multi-head one.

It prints the winners as SHIPPED lines (support/launches.py), with each one's speed-up over the shipped entry.
Paste them into kernels.py and run tests/test_kernels_aot.py (which then checks them on both
architectures) and tests/bench_attention.py (which compares them with SDPA).
"""

import argparse
import itertools
import math
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

FWD_SPACE = dict(block_m=(64, 128), block_n=(32, 64, 128), warps=(4, 8), stages=(2, 3, 4))
BWD_SPACE = dict(small=(16, 32, 64), big=(64, 128), warps=(4, 8), stages=(2, 3))
HEADS = 16  # query heads in every timed shape
BHT = ((16, HEADS, 1024), (8, HEADS, 2048), (4, HEADS, 4096), (2, HEADS, 8192))


def forward_candidates() -> list[tuple[int, int, int, int]]:
    """(block_m, block_n, warps, stages); block_m must be a multiple of block_n (stage 1 of the forward
    ends on a key-block boundary)."""
    return [c for c in itertools.product(*FWD_SPACE.values()) if c[0] % c[1] == 0]


def backward_candidates() -> list[tuple[int, int, int, int]]:
    """(small, big, warps, stages); big must be a multiple of small."""
    return [c for c in itertools.product(*BWD_SPACE.values()) if c[1] % c[0] == 0]


def aot_jobs(kind: str, cand: tuple, D: int, dtype: str, cap: int, gqa: bool = False) -> list:
    """The kernels a candidate launches, as test_kernels_aot jobs (their grouped-query builds if gqa)."""
    from test_kernels_aot import Job
    if kind == "fwd":
        block_m, block_n, warps, stages = cand
        return [Job("_attn_fwd", D, dtype, cap, block_m, block_n, warps, stages, gqa=gqa)]
    small, big, warps, stages = cand
    return [Job("_attn_bwd_dkdv", D, dtype, cap, small, big, warps, stages, gqa=gqa),
            Job("_attn_bwd_dq", D, dtype, cap, big, small, warps, stages, gqa=gqa)]


def compiles_cleanly(rows: list[dict]) -> bool:
    return all(r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["shared"] <= r["shared_limit"]
               for r in rows)


def prune(kind: str, cands: list[tuple], D: int, dtype: str, cap: int, gqa: bool = False) -> list[tuple]:
    """The candidates whose kernels compile for sm_`cap` without spills and within shared memory.
    (A candidate that does not compile at all, out of resources, is dropped too.)"""
    jobs = {c: aot_jobs(kind, c, D, dtype, cap, gqa) for c in cands}
    flat = [j for js in jobs.values() for j in js]
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        rows = dict(zip(flat, pool.map(_compile_or_none, flat), strict=True))
    return [c for c, js in jobs.items()
            if all(rows[j] is not None for j in js) and compiles_cleanly([rows[j] for j in js])]


def _compile_or_none(job: tuple) -> dict | None:
    import test_kernels_aot as aot
    try:
        return aot.compile_one(job)
    except Exception:  # out of resources, or a configuration Triton refuses: not a candidate
        return None


def geometric_mean(xs: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in xs))


def time_ms(fn, device, reps: int = 20) -> float:
    """Median wall time of fn() in ms, synchronized (CUDA events would do; this also runs on a CPU)."""
    import torch
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def score(kind: str, cand: tuple, shipped, shapes, dtype, device, reps: int, n_kv_head: int | None = None) -> float:
    """Geometric mean over shapes of the candidate's time (fwd: the forward; bwd: the backward), with
    n_kv_head kv heads (default: as many as query heads)."""
    import torch

    import kernels
    if kind == "fwd":
        cfg = shipped._replace(block_m=cand[0], block_n=cand[1], fwd_warps=cand[2], fwd_stages=cand[3])
    else:
        cfg = shipped._replace(small=cand[0], big=cand[1], bwd_warps=cand[2], bwd_stages=cand[3])
    times = []
    for B, H, T, D in shapes:
        gen = torch.Generator(device).manual_seed(0)
        q, do = (torch.randn(B, H, T, D, device=device, generator=gen).to(dtype) for _ in range(2))
        k, v = (torch.randn(B, n_kv_head or H, T, D, device=device, generator=gen).to(dtype) for _ in range(2))
        if kind == "fwd":
            times.append(time_ms(partial(kernels.flash_forward, q, k, v, cfg), device, reps))
        else:
            o, lse = kernels.flash_forward(q, k, v, shipped)
            times.append(time_ms(partial(kernels.flash_backward, q, k, v, o, lse, do, cfg), device, reps))
    return geometric_mean(times)


def tune(kind: str, cands: list[tuple], shipped, shapes, dtype, device, reps: int = 20,
         n_kv_head: int | None = None) -> tuple[tuple, dict]:
    """The fastest candidate and every candidate's score."""
    scores = {c: score(kind, c, shipped, shapes, dtype, device, reps, n_kv_head) for c in cands}
    return min(scores, key=scores.get), scores


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--head-dim", type=int, action="append", help="tune only this head dim (default: 64 and 128)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="the dtype to time in")
    p.add_argument("--prune-only", action="store_true", help="list the candidates that compile cleanly; time nothing")
    p.add_argument("--capability", type=int, choices=(80, 90), help="with --prune-only: the target (default both)")
    p.add_argument("--reps", type=int, default=20, help="timed repetitions per candidate and shape")
    p.add_argument("--n-kv-head", type=int, default=HEADS,
                   help=f"kv heads of the timed shapes (grouped-query attention below {HEADS}); divides {HEADS}")
    args = p.parse_args()
    if args.n_kv_head < 1 or HEADS % args.n_kv_head:
        p.error(f"--n-kv-head {args.n_kv_head} does not divide the {HEADS} query heads")
    gqa = args.n_kv_head < HEADS
    if os.environ.get("TRITON_INTERPRET"):
        sys.exit("tune_attention.py compiles and times real kernels: run it without TRITON_INTERPRET")
    import torch

    import kernels
    head_dims = args.head_dim or [64, 128]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    if args.prune_only:
        for cap, D in itertools.product([args.capability] if args.capability else [80, 90], head_dims):
            for kind, cands in (("fwd", forward_candidates()), ("bwd", backward_candidates())):
                kept = prune(kind, cands, D, args.dtype, cap, gqa)
                print(f"sm_{cap} D={D} {kind}{' (gqa)' if gqa else ''}: {len(kept)} of {len(cands)} compile "
                      f"without spills: {kept}")
        return 0
    if not torch.cuda.is_available():
        print("tune_attention.py times kernels on a CUDA GPU; this machine has none (--prune-only works anywhere)")
        return 1
    device = torch.device("cuda")
    cap = torch.cuda.get_device_capability()[0] * 10
    cap = 90 if cap >= 90 else 80
    print(f"{torch.cuda.get_device_name()}: pruning for sm_{cap}, timing in {args.dtype}, "
          f"{HEADS} query heads, {args.n_kv_head} kv heads")
    for D in head_dims:
        shipped = kernels.SHIPPED[D, dtype]
        shapes = [(B, H, T, D) for B, H, T in BHT]
        winners = {}
        for kind, cands in (("fwd", forward_candidates()), ("bwd", backward_candidates())):
            kept = prune(kind, cands, D, args.dtype, cap, gqa)
            best, scores = tune(kind, kept, shipped, shapes, dtype, device, args.reps, args.n_kv_head)
            current = (shipped[:4] if kind == "fwd" else shipped[4:])
            base = scores.get(tuple(current)) or score(kind, tuple(current), shipped, shapes, dtype, device,
                                                       args.reps, args.n_kv_head)
            winners[kind] = best
            print(f"D={D} {kind}: {len(kept)} of {len(cands)} candidates compile cleanly; best {best} "
                  f"{scores[best]:.3f} ms (geometric mean), shipped {tuple(current)} {base:.3f} ms: "
                  f"{base / scores[best]:.2f}x")
        launch = kernels.Launch(*winners["fwd"], *winners["bwd"])
        print(f"    SHIPPED[{D}, _dtype] = Launch{tuple(launch)}  # sm_{cap}, tuned {time.strftime('%Y-%m-%d')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
