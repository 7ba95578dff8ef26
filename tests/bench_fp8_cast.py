"""The bytes an fp8 cast moves, fused (fp8_cast.py) and not (fp8.py), side by side (not collected by pytest).

    TRITON_INTERPRET=1 python tests/bench_fp8_cast.py          # on a CPU: the kernel in the interpreter
    TRITON_INTERPRET=1 python tests/bench_fp8_cast.py --rows 4096 --cols 3072

One delayed-scaling cast of an activation x, as fp8_linear's forward makes it (the scale is the
history's), with the transposed codes the backward's dW = dYᵀ X wants; from a bf16 x (--precision fp8)
and an fp32 one (fp8-fp32). Both paths are counted, not timed (a CPU says nothing about GPU memory
traffic), and both are measured:

    PyTorch   every aten operation the cast runs (a TorchDispatchMode sees each): the bytes of its
              inputs it reads and of its outputs it writes, the passes over the whole tensor and the
              full-size temporaries left behind (what a GPU runs: one kernel, one round trip to
              memory, per operation). The transposed copy is scaled_matmul's `.t().contiguous()`.
    fused     the kernel's own loads and stores, element by element, as the Triton interpreter runs
              them, and the few small operations around it (the statistics, the scale).

The ratio of the bytes is what fusing buys on a GPU, where a cast is bound by memory, not arithmetic.
"""

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import fp8  # noqa: E402
import fp8_cast  # noqa: E402


class Traffic(TorchDispatchMode):
    """Each aten operation's bytes read (its tensor inputs) and written (its outputs), and which of them
    touch a tensor of `full` elements or more: a pass over the whole tensor."""

    def __init__(self, full: int):
        super().__init__()
        self.full, self.read, self.written, self.passes, self.temporaries = full, 0, 0, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        if func.is_view or name == "detach" or name.startswith("empty"):  # no bytes move
            return out
        ins = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        outs = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        self.read += sum(a.numel() * a.element_size() for a in ins)
        self.written += sum(o.numel() * o.element_size() for o in outs)
        if any(t.numel() >= self.full for t in ins + outs):
            self.passes += 1
            self.temporaries += [o for o in outs if o.numel() >= self.full]
        return out


class KernelTraffic:
    """The interpreter's loads and stores, counted as it runs them: the bytes of the elements each mask
    lets through. (The interpreter's own copies of the arguments, before and after, are hidden from
    Traffic: they are not the kernel's work.)"""

    def __enter__(self):
        from triton.runtime import interpreter as it

        self.read = self.written = 0
        builder, executor = it.InterpreterBuilder, it.GridExecutor
        load, store, launch = builder.create_masked_load, builder.create_masked_store, executor.__call__
        self.undo = lambda: (setattr(builder, "create_masked_load", load),
                             setattr(builder, "create_masked_store", store), setattr(executor, "__call__", launch))

        def counted_load(b, ptrs, mask, other, *rest):
            self.read += int(np.count_nonzero(mask.data)) * it._get_np_dtype(ptrs.get_element_ty()).itemsize
            return load(b, ptrs, mask, other, *rest)

        def counted_store(b, ptrs, value, mask, *rest):
            self.written += int(np.count_nonzero(mask.data)) * value.data.dtype.itemsize
            return store(b, ptrs, value, mask, *rest)

        def unseen(grid_executor, *args, **kwargs):
            with torch.utils._python_dispatch._disable_current_modes():
                return launch(grid_executor, *args, **kwargs)

        builder.create_masked_load, builder.create_masked_store, executor.__call__ = counted_load, counted_store, unseen
        return self

    def __exit__(self, *exc):
        self.undo()


def delayed(fused: bool) -> fp8.Scaling:
    """An e4m3 scaling with a history: its scale is known before the cast."""
    s = fp8.Scaling(fp8.E4M3, "delayed", history=4, fused=fused)
    s.cast(torch.ones(16, 16))
    s.update()
    return s


def measure(x: torch.Tensor) -> dict[str, dict]:
    """-> {path: read, written, passes, temporaries (their dtypes)} of one cast with transposed codes."""
    out = {}
    for name, fused in (("PyTorch (fp8.py)", False), ("fused (fp8_cast.py)", True)):
        scaling = delayed(fused)
        with Traffic(x.numel()) as ops, KernelTraffic() as kernel:
            q, _, q_t = scaling.cast(x, transpose=True)
            if q_t is None:  # the PyTorch path: scaled_matmul's copy for the backward's operand
                q_t = q.t().contiguous()
        out[name] = dict(read=ops.read + kernel.read, written=ops.written + kernel.written,
                         passes=ops.passes + (kernel.read > 0), temporaries=[
                             str(t.dtype).removeprefix("torch.") for t in ops.temporaries
                             if t.data_ptr() not in (q.data_ptr(), q_t.data_ptr())])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1024, help="tokens: micro-batch x sequence length")
    p.add_argument("--cols", type=int, default=768, help="features (GPT-2's n_embd)")
    args = p.parse_args()
    if not fp8_cast.INTERPRETED:
        p.error("run it in the Triton interpreter on a CPU: TRITON_INTERPRET=1 python tests/bench_fp8_cast.py")
    if os.environ.get("OMP_NUM_THREADS") is None:
        torch.set_num_threads(1)
    print(f"one delayed-scaling e4m3 cast of x ({args.rows}, {args.cols}), with its transposed codes")
    print(f"{'x':<6}{'path':<21}{'passes':>7}{'read MB':>9}{'written MB':>11}{'bytes/elem':>11}"
          f"  full-size temporaries")
    gen = torch.Generator().manual_seed(0)
    for label, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        x = torch.randn(args.rows, args.cols, generator=gen).to(dtype)
        rows = measure(x)
        for name, r in rows.items():
            kinds = ", ".join(f"{r['temporaries'].count(k)} {k}" for k in sorted(set(r["temporaries"]))) or "none"
            print(f"{label:<6}{name:<21}{r['passes']:>7}{r['read'] / 1e6:>9.1f}"
                  f"{r['written'] / 1e6:>11.1f}{(r['read'] + r['written']) / x.numel():>11.1f}  {kinds}")
        (a, b) = rows.values()
        print(f"{'':<6}ratio: the fused cast moves {(a['read'] + a['written']) / (b['read'] + b['written']):.1f}x "
              f"fewer bytes, in {b['passes']} pass instead of {a['passes']}")


if __name__ == "__main__":
    main()
