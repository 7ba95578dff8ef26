"""An fp8 Linear against F.linear at a preset's Linear shapes, side by side (not collected by pytest).

    python tests/bench_fp8.py                     # CPU: `mini`'s four Linears, 8 x 128 tokens
    python tests/bench_fp8.py --device cuda --preset gpt2 --tokens 16384
    python tests/bench_fp8.py --device cuda --shape 8192,4096,4096   # one Linear: M tokens, K in, N out
                                                                     # (issue 46's: fp8 >= 1.5x bf16)

Each of a block's Linears (qkv, attention out, MLP in and out) runs forward and backward in three
ways, alternating in rounds so all see the same machine at the same time; the median of the rounds:

    fp32   F.linear in fp32
    bf16   F.linear under bf16 autocast, the fp32 master weight cast at use (as --precision bf16 trains)
    fp8    the same Linear given an fp8.Fp8LinearState (model.linear, the seam every Linear of the model
           calls under --precision fp8), under the same autocast: x, W in e4m3, dY in e5m2; current
           scaling or delayed (--fp8-recipe); each call ends as a training step does, with the
           state's update (fp8.end_step's: the amax into the history, delayed's next scale)

On a CPU, _scaled_mm dequantizes and multiplies in fp32, so the ratio fp8 / bf16 is the price of the
casts (amax, scale, clamp, counts: several passes over each operand); on an H100 the fp8 matmuls run
at twice the bf16 rate and the ratio is the speed-up that is left after the casts.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import fp8  # noqa: E402
import model as gpt  # noqa: E402


def linears(preset: str) -> list[tuple[str, int, int]]:
    """(name, in features K, out features N) of one block's Linears."""
    e = gpt.PRESETS[preset]["n_embd"]
    return [("attn.c_attn", e, 3 * e), ("attn.c_proj", e, e), ("mlp.c_fc", e, 4 * e), ("mlp.c_proj", 4 * e, e)]


def shape(text: str) -> tuple[int, int, int]:
    """--shape M,K,N."""
    try:
        m, k, n = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give M,K,N, three integers") from None
    if min(m, k, n) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: M, K and N must be at least 1")
    return m, k, n


def run(kind: str, x, w, b, dy, state) -> None:
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    b = None if b is None else b.detach().requires_grad_()
    device = x.device.type
    if kind == "fp32":
        y = F.linear(x.float(), w, b)
    else:
        with torch.autocast(device, dtype=torch.bfloat16):
            y = gpt.linear(x, w, b, state if kind == "fp8" else None)
    y.backward(dy.to(y.dtype))
    if kind == "fp8":  # the end of a step (fp8.end_step, after every step of train.py)
        state.update()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", default="mini", choices=list(gpt.PRESETS))
    p.add_argument("--tokens", type=int, default=8 * 128, help="rows of x: micro-batch x sequence length")
    p.add_argument("--shape", type=shape, help="one Linear of M,K,N (x: M x K, W: N x K, no bias) instead of "
                   "the preset's four")
    p.add_argument("--fp8-recipe", choices=["current", "delayed"], default="current",
                   help="where the fp8 scales come from (train.py's --fp8-recipe)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--json", help="also write the medians (ms) to this file")
    args = p.parse_args()
    if args.tokens < 1 or args.rounds < 1:
        p.error("--tokens and --rounds must be at least 1")
    device = torch.device(args.device)
    reason = fp8.fp8_supported(device)
    if reason:
        print(reason, file=sys.stderr)
        raise SystemExit(2)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    kinds = ["fp32", "bf16", "fp8"]
    g = torch.Generator().manual_seed(0)
    cases = []
    tokens = args.shape[0] if args.shape else args.tokens
    shapes = [(f"{args.shape[1]}->{args.shape[2]}", *args.shape[1:])] if args.shape else linears(args.preset)
    for name, k, n in shapes:
        x = torch.randn(tokens, k, generator=g).to(device, torch.bfloat16)
        w = (torch.randn(n, k, generator=g) * k ** -0.5).to(device)
        b = None if args.shape else torch.zeros(n, device=device)
        dy = torch.randn(tokens, n, generator=g).to(device) * 1e-3
        cases.append((name, k, n, (x, w, b, dy, fp8.Fp8LinearState(args.fp8_recipe, device=device))))
    times = {(name, kind): [] for name, *_ in cases for kind in kinds}
    for r in range(args.rounds + 1):  # round 0 warms up
        for name, _, _, inputs in cases:
            for kind in kinds:
                sync()
                t0 = time.perf_counter()
                run(kind, *inputs)
                sync()
                if r:
                    times[name, kind].append(time.perf_counter() - t0)
    threads = f"{torch.get_num_threads()} threads" if device.type == "cpu" else torch.cuda.get_device_name(device)
    what = "one Linear" if args.shape else f"{args.preset}'s Linears"
    print(f"{what}, {tokens} tokens, forward + backward, {device} ({threads}), fp8 {args.fp8_recipe} scaling, "
          f"median of {args.rounds} rounds, ms")
    print(f"{'layer':<12} {'K -> N':>12} " + " ".join(f"{k:>8}" for k in kinds) + f" {'fp8/bf16':>9}")
    total, rows = dict.fromkeys(kinds, 0.0), []
    for name, k, n, _ in cases:
        ms = {kind: 1e3 * statistics.median(times[name, kind]) for kind in kinds}
        rows.append({"layer": name, "M": tokens, "K": k, "N": n, **{f"{kd}_ms": ms[kd] for kd in kinds}})
        for kind in kinds:
            total[kind] += ms[kind]
        print(f"{name:<12} {f'{k} -> {n}':>12} " + " ".join(f"{ms[kd]:8.2f}" for kd in kinds)
              + f" {ms['fp8'] / ms['bf16']:9.2f}")
    print(f"{'block':<12} {'':>12} " + " ".join(f"{total[kd]:8.2f}" for kd in kinds)
          + f" {total['fp8'] / total['bf16']:9.2f}")
    print(f"ratio fp8 / bf16 = {total['fp8'] / total['bf16']:.2f}, fp8 / fp32 = {total['fp8'] / total['fp32']:.2f}"
          + (" (a CPU: the casts' overhead, not a speed-up)" if device.type == "cpu" else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": threads, "recipe": args.fp8_recipe, "rows": rows,
                       **{f"{kd}_ms": total[kd] for kd in kinds}}, f, indent=1)


if __name__ == "__main__":
    main()
