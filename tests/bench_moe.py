"""What routing costs: an MoE layer's forward + backward next to a dense MLP with the same active parameters,
and the experts run as a loop over experts next to one padded batched matmul, side by side in one run.

    python tests/bench_moe.py                      # CPU: mini's width (C 256), E 8, k 2, 8 x 128 tokens
    python tests/bench_moe.py --device cuda --tokens 16384

The dense MLP is k times as wide as one expert (hidden 4 C k): the FLOPs a token spends in the MoE's k experts.
What the MoE adds is the router, the sort by expert and the un-permute, and (on a GPU) the host reading the
counts. The two ways of running the experts get the same sorted rows: a loop of two matmuls per expert over
its run of rows (moe.Experts, what the model uses), or every expert's rows padded to the largest count and
one bmm per matrix. Configurations alternate in rounds; medians (a shared machine only ever adds time).
Not collected by pytest.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import moe  # noqa: E402


def padded_bmm(experts: moe.Experts, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The grouped alternative: rows padded to (E, max count, C), one bmm per matrix, padding dropped."""
    E, most = len(counts), max(counts)
    slots = torch.cat([torch.arange(c) + e * most for e, c in enumerate(counts)])  # each row's padded place
    padded = x.new_zeros(E * most, x.size(1)).index_copy(0, slots, x).view(E, most, -1)
    h = torch.baddbmm(experts.c_fc.bias[:, None], padded, experts.c_fc.weight.transpose(1, 2))
    h = F.gelu(h, approximate="tanh")
    y = torch.baddbmm(experts.c_proj.bias[:, None], h, experts.c_proj.weight.transpose(1, 2))
    return y.view(E * most, -1)[slots]


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--width", type=int, default=256, help="C (mini's)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per call, in sequences of 128")
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    device, C, E, k = torch.device(args.device), args.width, args.experts, args.top_k
    torch.manual_seed(0)
    layer = moe.MoE(C, 4 * C, False, E, k, 1.25).to(device)
    dense = moe.Experts(1, C, 4 * C * k, False).to(device)  # one MLP k experts wide
    for module in (layer, dense):
        for param in module.parameters():
            torch.nn.init.normal_(param, std=0.02)
    x = torch.randn(args.tokens // 128, 128, C, device=device, requires_grad=True)
    rows = torch.randn(args.tokens * k, C, device=device, requires_grad=True)
    counts = torch.distributions.Multinomial(args.tokens * k, torch.ones(E)).sample().long().tolist()  # a routing

    runs = {"moe layer": lambda: layer(x).sum().backward(),
            "dense MLP": lambda: dense(x.view(-1, C), [args.tokens]).sum().backward(),
            "experts: loop": lambda: layer.experts(rows, counts).sum().backward(),
            "experts: padded bmm": lambda: padded_bmm(layer.experts, rows, counts).sum().backward()}
    times = {name: [] for name in runs}
    for fn in runs.values():  # warm up
        fn()
    for _ in range(args.rounds):
        for name, fn in runs.items():
            times[name].append(timed(fn, device))
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    print(f"forward + backward on {args.device}, C {C}, {args.tokens} tokens, medians of {args.rounds} rounds "
          f"(threads: {torch.get_num_threads()})")
    print(f"  MoE layer (E {E}, k {k}, capacity 1.25, GELU experts 4C):  {ms['moe layer']:8.2f} ms")
    print(f"  dense MLP of the same active parameters (hidden {4 * C * k}):  {ms['dense MLP']:8.2f} ms")
    print(f"  MoE / dense: {ms['moe layer'] / ms['dense MLP']:.2f}x")
    print(f"  experts alone, {args.tokens * k} sorted rows: loop over experts {ms['experts: loop']:.2f} ms, padded bmm "
          f"{ms['experts: padded bmm']:.2f} ms (loop / bmm: {ms['experts: loop'] / ms['experts: padded bmm']:.2f}x)")


if __name__ == "__main__":
    main()
