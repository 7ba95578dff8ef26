"""What a checkpoint costs the training loop: no saves vs synchronous vs asynchronous, side by side.

    python tests/bench_checkpoint.py                          # CPU: the `small` preset
    python tests/bench_checkpoint.py --device cuda --preset gpt2 --batch-size 32 --micro-batch-size 16

Runs train.py three times with the same flags (not collected by pytest): without checkpoints (only
the final one), saving every --every steps synchronously, and the same with --async-ckpt. From each
run's metrics.jsonl it takes the time of every step (tokens / tokens_per_sec: forward, backward and
update) and, from the checkpoint events, the time the training loop spent inside the save. It prints
the median time of ordinary steps, of the step that saves (its step plus the save's blocking time) and
of the step right after a save (on a GPU that step's update waits for the save's device-to-host copy),
each as a ratio to the run without saves; then, per run, the seconds the loop spent inside a save against
that run's own ordinary steps (steady where the machine's load drifts between the runs), and async
against sync. The target for --async-ckpt: < 1.05 on the saving step, 1.00 elsewhere.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(args, out: Path, extra: list[str]) -> tuple[dict[int, float], dict[int, float], int]:
    """(step -> seconds of its step, step -> seconds the loop spent saving at that step, saves skipped)"""
    cmd = [sys.executable, str(ROOT / "train.py"), "--device", args.device, "--preset", args.preset, "--out", str(out),
           "--max-steps", str(args.steps), "--eval-every", str(10 * args.steps), "--sample-tokens", "0",
           "--eval-batches", "1", "--tokenizer", args.tokenizer, *args.train_flags, *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: args.tokens_per_step / r["tokens_per_sec"] for r in rows if "event" not in r}
    saves = {r["step"]: r["blocking_s"] for r in rows if r.get("event") == "checkpoint"}
    return steps, saves, sum(r.get("event") == "checkpoint skipped" for r in rows)


def parser(doc: str, preset: str, every: str) -> argparse.ArgumentParser:
    """The flags this benchmark and tests/bench_stats.py share: `--steps` of `--preset` on `--device`."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", default=preset)
    p.add_argument("--tokenizer", default="gpt2")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10, help=every)
    return p


def main() -> None:
    p = parser(__doc__, "small", "save every N steps")
    p.add_argument("--seq-len", type=int, default=0, help="0: train.py's default for the device")
    p.add_argument("--batch-size", type=int, default=0, help="0: train.py's default for the device")
    p.add_argument("--micro-batch-size", type=int, default=0)
    args = p.parse_args()
    seq_len = args.seq_len or (1024 if args.device == "cuda" else 128)
    batch = args.batch_size or (64 if args.device == "cuda" else 8)
    args.tokens_per_step = seq_len * batch
    args.train_flags = ["--seq-len", str(seq_len), "--batch-size", str(batch)]
    if args.micro_batch_size:
        args.train_flags += ["--micro-batch-size", str(args.micro_batch_size)]
    skip = 5  # the first steps warm up (allocation, compilation)
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run(args, Path(tmp) / name, extra) for name, extra in (
            ("no saves", []), ("sync", ["--ckpt-every", str(args.every)]),
            ("async", ["--ckpt-every", str(args.every), "--async-ckpt"]))}
    base = statistics.median(t for s, t in results["no saves"][0].items() if s > skip and s < args.steps)
    print(f"{args.preset} on {args.device}, {args.tokens_per_step:,} tokens a step, a checkpoint every {args.every} "
          f"steps; median seconds, and the ratio to the run without saves ({base:.4f} s a step):")
    print(f"  {'':<10}{'ordinary step':>22}{'the step that saves':>26}{'the step after':>22}")
    paid = {}
    for name, (steps, saves, skipped) in results.items():
        saving = [s for s in saves if skip < s < args.steps]
        ordinary = [t for s, t in steps.items() if skip < s < args.steps and s not in saves and s - 1 not in saves]
        cells = [statistics.median(ordinary)]
        if saving:
            cells += [statistics.median(steps[s] + saves[s] for s in saving),
                      statistics.median(steps[s + 1] for s in saving if s + 1 in steps)]
            paid[name] = statistics.median(saves[s] for s in saving), cells[0], skipped
        print(f"  {name:<10}" + "".join(f"{c:>12.4f} ({c / base:5.2f}x)" + " " * 4 for c in cells))
    # Each run against its own steps: steady whatever else the machine does between the runs.
    for name, (seconds, step, skipped) in paid.items():
        print(f"  {name}: the loop paid {seconds:.4f} s a save, {seconds / step:.2f}x one of that run's ordinary "
              f"steps" + (f"; {skipped} saves skipped (the previous one still being written)" if skipped else ""))
    if len(paid) == 2:
        print(f"  async / sync, seconds the loop paid a save: {paid['async'][0] / paid['sync'][0]:.3f}")


if __name__ == "__main__":
    main()
