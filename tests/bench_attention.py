"""Benchmark our Triton attention against PyTorch SDPA on a CUDA GPU (not collected by pytest).

    python tests/bench_attention.py                 # bf16, the default grid
    python tests/bench_attention.py --dtype fp16 --quick
    python tests/bench_attention.py --n-kv-head 4   # grouped-query attention: 16 query heads, 4 kv heads
    python tests/bench_attention.py --no-memory --json out.json   # the speed table only, and its numbers
    python tests/bench_attention.py --device cpu --dtype fp16 --shapes 1,2,64,64 --no-memory
                                                    # a smoke run in the Triton interpreter (numbers meaningless)

Prints, for each (B, H, T, D), causal:
  * forward and forward+backward TFLOP/s of ours and of SDPA, and ours / SDPA;
  * forward+backward of `auto` (what --attn auto picks for that shape) / SDPA: never below 1 when the
    choice is right;
  * the peak memory of a forward+backward beyond the inputs;
  * then how that peak memory grows with T at a fixed B*H: flash attention keeps O(T) extra memory
    (the output and one log-sum-exp per row), the math version O(T^2) (the score matrix).

FLOPs are counted as the FlashAttention papers do: 4 B H T^2 D for a full forward (two matmuls),
halved for causal, and 2.5x that for the backward (five matmuls: S is recomputed, then dV, dP, dQ, dK).
Under GQA (--n-kv-head) the FLOPs are the same (every query head still attends); K and V are smaller,
SDPA is called with enable_gqa, and the math version (in the memory table) repeats K and V per query head.
"""

import argparse
import json
import math
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kernels  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
HEADS = 16  # query heads in every shape
BHT = ((16, HEADS, 1024), (8, HEADS, 2048), (4, HEADS, 4096), (2, HEADS, 8192))  # 16M tokens*heads each
GRID = [(B, H, T, D) for D in (64, 128) for B, H, T in BHT]
QUICK = [(4, HEADS, 2048, 64), (4, HEADS, 2048, 128)]


def make_inputs(B, H, T, D, dtype, H_kv, device="cuda"):
    """q (B, H, T, D), k and v (B, H_kv, T, D) as the model makes them: strided views into one fused
    projection (B, T, H + 2 H_kv, D)."""
    qkv = torch.randn(B, T, H + 2 * H_kv, D, device=device, dtype=dtype, requires_grad=True)
    return qkv, kernels.unpack_qkv(qkv, H_kv)


def forward_and_backward(backend, qkv, q, k, v, do):
    """One training step's attention work: a closure for do_bench and the memory probe."""
    def step():
        qkv.grad = None
        kernels.attention(q, k, v, backend).backward(do)
    return step


def bench_ms(fn, device: str = "cuda") -> float:
    if device == "cpu":  # the interpreter: a smoke run, so one call after a first one
        fn()
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100)


def peak_extra_mib(fn, device: str = "cuda") -> float:
    """Peak memory allocated while running fn, beyond what was allocated before it (not measured on a CPU)."""
    if device == "cpu":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def speed_table(shapes, dtype, n_kv_head, device="cuda") -> list[dict]:
    """The table, printed; returned as one dict per shape (TFLOP/s, ratios, MiB) for --json."""
    heads = f"{n_kv_head} kv heads" if n_kv_head else "multi-head"
    print(f"causal attention ({heads}), {dtype}, TFLOP/s (higher is better); memory = peak of forward+backward; "
          "auto = what --attn auto picks for the shape")
    head = (f"{'B':>3} {'H':>3} {'T':>6} {'D':>4} | {'fwd ours':>9} {'sdpa':>7} {'ratio':>6} | "
            f"{'f+b ours':>9} {'sdpa':>7} {'ratio':>6} | {'auto':>7} {'ratio':>6} | {'MiB ours':>9} {'sdpa':>7} | "
            "max|o-sdpa|")
    print(head + "\n" + "-" * len(head))
    rows = []
    for B, H, T, D in shapes:
        qkv, (q, k, v) = make_inputs(B, H, T, D, dtype, n_kv_head or H, device)
        do = torch.randn(B, H, T, D, device=device, dtype=dtype)
        fwd_flops = 4 * B * H * T * T * D / 2
        row = []
        for backend in ("triton", "sdpa"):
            fwd = partial(kernels.attention, q, k, v, backend)
            fwd_bwd = forward_and_backward(backend, qkv, q, k, v, do)
            row.append((fwd_flops / bench_ms(fwd, device) / 1e9, 3.5 * fwd_flops / bench_ms(fwd_bwd, device) / 1e9,
                        peak_extra_mib(fwd_bwd, device)))
        (f_ours, fb_ours, m_ours), (f_sdpa, fb_sdpa, m_sdpa) = row
        fb_auto = 3.5 * fwd_flops / bench_ms(forward_and_backward("auto", qkv, q, k, v, do), device) / 1e9
        with torch.no_grad():
            err = (kernels.attention(q, k, v, "triton") - kernels.attention(q, k, v, "sdpa")).abs().max()
        print(f"{B:>3} {H:>3} {T:>6} {D:>4} | {f_ours:>9.1f} {f_sdpa:>7.1f} {f_ours / f_sdpa:>6.2f} | "
              f"{fb_ours:>9.1f} {fb_sdpa:>7.1f} {fb_ours / fb_sdpa:>6.2f} | {fb_auto:>7.1f} "
              f"{fb_auto / fb_sdpa:>6.2f} | {m_ours:>9.0f} {m_sdpa:>7.0f} | {err.item():.1e}")
        rows.append(dict(B=B, H=H, T=T, D=D, fwd_tflops=f_ours, fwd_tflops_sdpa=f_sdpa, fwd_ratio=f_ours / f_sdpa,
                         fwd_bwd_tflops=fb_ours, fwd_bwd_tflops_sdpa=fb_sdpa, fwd_bwd_ratio=fb_ours / fb_sdpa,
                         auto_tflops=fb_auto, auto_ratio=fb_auto / fb_sdpa, max_error=err.item(),
                         **{key: None if math.isnan(m) else m for key, m in (("mib", m_ours), ("mib_sdpa", m_sdpa))}))
    return rows


def memory_table(dtype, n_kv_head, D=64, BH=HEADS, Ts=(1024, 2048, 4096, 8192, 16384)):
    print(f"\npeak extra memory of forward+backward vs T (B*H = {BH}, {n_kv_head or BH} kv heads, D = {D}): "
          "x2 per doubling is linear, x4 quadratic")
    print(f"{'T':>6} | {'ours MiB':>9} {'growth':>7} | {'math MiB':>9} {'growth':>7}")
    last = {}
    for T in Ts:
        qkv, (q, k, v) = make_inputs(1, BH, T, D, dtype, n_kv_head or BH)
        do = torch.randn(1, BH, T, D, device="cuda", dtype=dtype)
        cells = []
        for backend in ("triton", "math"):
            try:
                mib = peak_extra_mib(forward_and_backward(backend, qkv, q, k, v, do))
            except torch.OutOfMemoryError:
                cells.append(f"{'OOM':>9} {'':>7}")
                last[backend] = None
                continue
            growth = f"x{mib / last[backend]:.2f}" if last.get(backend) else ""
            cells.append(f"{mib:>9.1f} {growth:>7}")
            last[backend] = mib
        print(f"{T:>6} | " + " | ".join(cells))
        del qkv, q, k, v, do
        torch.cuda.empty_cache()


def shape(text: str) -> tuple[int, int, int, int]:
    """--shapes B,H,T,D."""
    try:
        B, H, T, D = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give B,H,T,D, four integers") from None
    return B, H, T, D


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--quick", action="store_true", help="two shapes instead of the full grid")
    parser.add_argument("--shapes", type=shape, nargs="+", help="B,H,T,D of each shape instead of the grid")
    parser.add_argument("--n-kv-head", type=int, help="kv heads (grouped-query attention); must divide the "
                        f"{HEADS} query heads (default: {HEADS}, multi-head)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: the Triton interpreter (TRITON_INTERPRET=1), for a smoke run of this script")
    parser.add_argument("--no-memory", action="store_true", help="leave out the memory-growth table")
    parser.add_argument("--json", help="also write the speed table's numbers to this file")
    args = parser.parse_args()
    if args.n_kv_head is not None and (args.n_kv_head < 1 or HEADS % args.n_kv_head):
        parser.error(f"--n-kv-head {args.n_kv_head} does not divide the {HEADS} query heads")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_attention.py needs a CUDA GPU (none found); on a CPU, run the interpreter tests "
              "instead: python -m pytest tests/test_kernels.py")
        return 1
    if args.device == "cpu" and not kernels.INTERPRETED:
        parser.error("--device cpu runs our kernel in the Triton interpreter: set TRITON_INTERPRET=1")
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (Triton interpreter)"
    print(f"device: {name}")
    rows = speed_table(args.shapes or (QUICK if args.quick else GRID), DTYPES[args.dtype], args.n_kv_head, args.device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "dtype": args.dtype, "n_kv_head": args.n_kv_head, "rows": rows}, f, indent=1)
    if not args.no_memory:
        memory_table(DTYPES[args.dtype], args.n_kv_head)
    return 0


if __name__ == "__main__":
    sys.exit(main())
