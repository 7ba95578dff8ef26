"""Benchmark our Triton attention against PyTorch SDPA on a CUDA GPU (not collected by pytest).

    python tests/bench_attention.py                 # bf16, the default grid
    python tests/bench_attention.py --dtype fp16 --quick
    python tests/bench_attention.py --n-kv-head 4   # grouped-query attention: 16 query heads, 4 kv heads

Prints, for each (B, H, T, D), causal:
  * forward and forward+backward TFLOP/s of ours and of SDPA, and ours / SDPA;
  * the peak memory of a forward+backward beyond the inputs;
  * then how that peak memory grows with T at a fixed B*H: flash attention keeps O(T) extra memory
    (the output and one log-sum-exp per row), the math version O(T^2) (the score matrix).

FLOPs are counted as the FlashAttention papers do: 4 B H T^2 D for a full forward (two matmuls),
halved for causal, and 2.5x that for the backward (five matmuls: S is recomputed, then dV, dP, dQ, dK).
Under GQA (--n-kv-head) the FLOPs are the same (every query head still attends); K and V are smaller,
SDPA is called with enable_gqa, and the math version (in the memory table) repeats K and V per query head.
"""

import argparse
import sys
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


def make_inputs(B, H, T, D, dtype, H_kv):
    """q (B, H, T, D), k and v (B, H_kv, T, D) as the model makes them: strided views into one fused
    projection (B, T, H + 2 H_kv, D)."""
    qkv = torch.randn(B, T, H + 2 * H_kv, D, device="cuda", dtype=dtype, requires_grad=True)
    return qkv, kernels.unpack_qkv(qkv, H_kv)


def forward_and_backward(backend, qkv, q, k, v, do):
    """One training step's attention work: a closure for do_bench and the memory probe."""
    def step():
        qkv.grad = None
        kernels.attention(q, k, v, backend).backward(do)
    return step


def bench_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100)


def peak_extra_mib(fn) -> float:
    """Peak memory allocated while running fn, beyond what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def speed_table(shapes, dtype, n_kv_head):
    heads = f"{n_kv_head} kv heads" if n_kv_head else "multi-head"
    print(f"causal attention ({heads}), {dtype}, TFLOP/s (higher is better); memory = peak of forward+backward")
    head = (f"{'B':>3} {'H':>3} {'T':>6} {'D':>4} | {'fwd ours':>9} {'sdpa':>7} {'ratio':>6} | "
            f"{'f+b ours':>9} {'sdpa':>7} {'ratio':>6} | {'MiB ours':>9} {'sdpa':>7} | max|o-sdpa|")
    print(head + "\n" + "-" * len(head))
    for B, H, T, D in shapes:
        qkv, (q, k, v) = make_inputs(B, H, T, D, dtype, n_kv_head or H)
        do = torch.randn(B, H, T, D, device="cuda", dtype=dtype)
        fwd_flops = 4 * B * H * T * T * D / 2
        row = []
        for backend in ("triton", "sdpa"):
            fwd = partial(kernels.attention, q, k, v, backend)
            fwd_bwd = forward_and_backward(backend, qkv, q, k, v, do)
            row.append((fwd_flops / bench_ms(fwd) / 1e9, 3.5 * fwd_flops / bench_ms(fwd_bwd) / 1e9,
                        peak_extra_mib(fwd_bwd)))
        (f_ours, fb_ours, m_ours), (f_sdpa, fb_sdpa, m_sdpa) = row
        with torch.no_grad():
            err = (kernels.attention(q, k, v, "triton") - kernels.attention(q, k, v, "sdpa")).abs().max()
        print(f"{B:>3} {H:>3} {T:>6} {D:>4} | {f_ours:>9.1f} {f_sdpa:>7.1f} {f_ours / f_sdpa:>6.2f} | "
              f"{fb_ours:>9.1f} {fb_sdpa:>7.1f} {fb_ours / fb_sdpa:>6.2f} | {m_ours:>9.0f} {m_sdpa:>7.0f} | "
              f"{err.item():.1e}")


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--quick", action="store_true", help="two shapes instead of the full grid")
    parser.add_argument("--n-kv-head", type=int, help="kv heads (grouped-query attention); must divide the "
                        f"{HEADS} query heads (default: {HEADS}, multi-head)")
    args = parser.parse_args()
    if args.n_kv_head is not None and (args.n_kv_head < 1 or HEADS % args.n_kv_head):
        parser.error(f"--n-kv-head {args.n_kv_head} does not divide the {HEADS} query heads")
    if not torch.cuda.is_available():
        print("bench_attention.py needs a CUDA GPU (none found); on a CPU, run the interpreter tests "
              "instead: python -m pytest tests/test_kernels.py")
        return 1
    print(f"device: {torch.cuda.get_device_name()}")
    speed_table(QUICK if args.quick else GRID, DTYPES[args.dtype], args.n_kv_head)
    memory_table(DTYPES[args.dtype], args.n_kv_head)
    return 0


if __name__ == "__main__":
    sys.exit(main())
