"""What the per-layer statistics (instruments/stats.py) cost a step, side by side in one run.

    python tests/bench_stats.py                                # CPU: the `mini` preset
    python tests/bench_stats.py --device cuda --preset gpt2    # a GPU (blocks compiled, bf16)

Runs train.py once with --stats-every 2 (not collected by pytest), so statistics steps and plain
steps alternate in the same process, under the same load: from metrics.jsonl the time of every step
(tokens / tokens_per_sec: forward, backward, statistics and update; evaluation is outside it), the
median and the fastest of each kind (on a shared machine other work only ever adds time, so the
fastest is the steadier estimate), their ratios, and what that costs on average at --stats-every N
(one step in N pays it). A second run with --stats-every 0 gives the plain step without the forward hooks
installed at all (another process: compare it loosely).
"""

import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_checkpoint import parser

ROOT = Path(__file__).resolve().parent.parent


def step_times(args, out: Path, every: int) -> dict[int, float]:
    cmd = [sys.executable, str(ROOT / "train.py"), "--device", args.device, "--preset", args.preset, "--out", str(out),
           "--max-steps", str(args.steps), "--eval-every", str(10 * args.steps), "--sample-tokens", "0",
           "--eval-batches", "1", "--tokenizer", args.tokenizer, "--stats-every", str(every), *args.flags]
    printed = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    batch, seq = re.search(r"steps of (\d+) x (\d+) tokens", printed).groups()  # train.py's first line says
    tokens = int(batch) * int(seq)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: tokens / r["tokens_per_sec"] for r in rows if "event" not in r}


def main() -> None:
    p = parser(__doc__, "mini", "the --stats-every to state the average cost at")
    args, args.flags = p.parse_known_args()  # the rest goes to train.py (--batch-size, --seq-len, ...)
    skip = 5  # warm-up: allocation, compilation
    with tempfile.TemporaryDirectory() as tmp:
        mixed = step_times(args, Path(tmp) / "mixed", 2)
        off = step_times(args, Path(tmp) / "off", 0)
    stats_steps = [t for s, t in mixed.items() if s > skip and s % 2 == 0]
    plain_steps = [t for s, t in mixed.items() if s > skip and s % 2 == 1]
    print(f"{args.preset} on {args.device}: seconds per step over {len(stats_steps)} + {len(plain_steps)} "
          "alternating steps of one run")
    print(f"  {'':<22}{'median':>10}{'fastest':>10}")
    ratios = []
    for name, times in (("step with statistics", stats_steps), ("plain step", plain_steps)):
        print(f"  {name:<22}{statistics.median(times):>10.4f}{min(times):>10.4f}")
    for pick in (statistics.median, min):
        ratios.append(pick(stats_steps) / pick(plain_steps))
    print(f"  {'ratio':<22}{ratios[0]:>10.3f}{ratios[1]:>10.3f}")
    print(f"  at --stats-every {args.every}: {(ratios[0] - 1) / args.every:+.2%} / {(ratios[1] - 1) / args.every:+.2%} "
          "a step on average")
    no_hooks = [t for s, t in off.items() if s > skip]
    print(f"  --stats-every 0 (no hooks; a separate run): {statistics.median(no_hooks):.4f} / {min(no_hooks):.4f} s; "
          f"the plain step above is {statistics.median(plain_steps) / statistics.median(no_hooks):.3f} / "
          f"{min(plain_steps) / min(no_hooks):.3f} of it")


if __name__ == "__main__":
    main()
