"""Benchmark our Triton attention against PyTorch SDPA on a CUDA GPU (not collected by pytest).

    python tests/bench_attention.py                 # bf16, the default grid
    python tests/bench_attention.py --dtype fp16 --quick

Prints, for each (B, H, T, D), causal:
  * forward and forward+backward TFLOP/s of ours and of SDPA, and ours / SDPA;
  * the peak memory of a forward+backward beyond the inputs;
  * then how that peak memory grows with T at a fixed B*H: flash attention keeps O(T) extra memory
    (the output and one log-sum-exp per row), the math version O(T^2) (the score matrix).

FLOPs are counted as the FlashAttention papers do: 4 B H T^2 D for a full forward (two matmuls),
halved for causal, and 2.5x that for the backward (five matmuls: S is recomputed, then dV, dP, dQ, dK).
"""

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kernels  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
BHT = ((16, 16, 1024), (8, 16, 2048), (4, 16, 4096), (2, 16, 8192))  # 16M tokens*heads each
GRID = [(B, H, T, D) for D in (64, 128) for B, H, T in BHT]
QUICK = [(4, 16, 2048, 64), (4, 16, 2048, 128)]


def make_inputs(B, H, T, D, dtype):
    """q, k, v as the model makes them: strided views into one fused projection."""
    qkv = torch.randn(B, T, 3, H, D, device="cuda", dtype=dtype, requires_grad=True)
    return qkv, qkv.permute(2, 0, 3, 1, 4)


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


def speed_table(shapes, dtype):
    print(f"causal attention, {dtype}, TFLOP/s (higher is better); memory = peak of forward+backward")
    head = (f"{'B':>3} {'H':>3} {'T':>6} {'D':>4} | {'fwd ours':>9} {'sdpa':>7} {'ratio':>6} | "
            f"{'f+b ours':>9} {'sdpa':>7} {'ratio':>6} | {'MiB ours':>9} {'sdpa':>7} | max|o-sdpa|")
    print(head + "\n" + "-" * len(head))
    for B, H, T, D in shapes:
        qkv, (q, k, v) = make_inputs(B, H, T, D, dtype)
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


def memory_table(dtype, D=64, BH=16, Ts=(1024, 2048, 4096, 8192, 16384)):
    print(f"\npeak extra memory of forward+backward vs T (B*H = {BH}, D = {D}): x2 per doubling is linear, "
          "x4 quadratic")
    print(f"{'T':>6} | {'ours MiB':>9} {'growth':>7} | {'math MiB':>9} {'growth':>7}")
    last = {}
    for T in Ts:
        qkv, (q, k, v) = make_inputs(1, BH, T, D, dtype)
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
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_attention.py needs a CUDA GPU (none found); on a CPU, run the interpreter tests "
              "instead: python -m pytest tests/test_kernels.py")
        return 1
    print(f"device: {torch.cuda.get_device_name()}")
    speed_table(QUICK if args.quick else GRID, DTYPES[args.dtype])
    memory_table(DTYPES[args.dtype])
    return 0


if __name__ == "__main__":
    sys.exit(main())
