"""CPU training throughput against this machine's own matmul rate (not collected by pytest).

    python tests/bench.py [--steps 8] [--preset mini] [--batch-size 8] [--seq-len 128]

Runs the default CPU configuration's training step (GPT-2 tokenizer's 50304-row vocabulary, fp32)
on random tokens, measures tokens/s after a warm-up step, converts it to FLOP/s with the PaLM
formula (model.flops_per_token), and prints it next to a 1024x1024 fp32 matmul measured in the
same process, just before and just after. Target: the training step reaches >= 50% of the matmul.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import config  # noqa: E402
import formulas  # noqa: E402
import model as gpt  # noqa: E402
import train  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=8, help="timed optimizer steps")
    p.add_argument("--preset", default="mini", help="model preset")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    args = p.parse_args()
    cfg = gpt.config_from_preset(args.preset, 50257)
    m = gpt.build(cfg, seed=0)
    opt = train.make_optimizer(m, config.TrainConfig(), torch.device("cpu"))
    x = torch.randint(0, 50257, (args.batch_size, args.seq_len + 1))

    def step():
        _, loss = m(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    peak_before = formulas.measured_matmul_flops(seconds=1.0)
    step()  # warm-up: allocations, first-call overheads
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    dt = (time.perf_counter() - t0) / args.steps
    peak = max(peak_before, formulas.measured_matmul_flops(seconds=1.0))
    tokens = args.batch_size * args.seq_len
    achieved = gpt.flops_per_token(cfg, args.seq_len) * tokens / dt
    print(f"{args.preset}: {tokens / dt:,.0f} tokens/s, {achieved / 1e9:.1f} GFLOP/s of training math")
    print(f"fp32 matmul on this machine: {peak / 1e9:.1f} GFLOP/s ({torch.get_num_threads()} threads)")
    print(f"ratio: {achieved / peak:.1%} (target >= 50%)")


if __name__ == "__main__":
    main()
