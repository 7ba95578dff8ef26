"""What a memory snapshot costs the loop next to a disk save, and the work a failure loses at each's interval.

    python tests/bench_memory.py                          # the `mini` preset on a CPU
    python tests/bench_memory.py --preset tiny --rounds 3 # seconds

In one process (not collected by pytest): the model after a step of AdamW, then, in alternating rounds so
that the machine's load falls on all of them alike, a training step, a disk save (writer.Saver, synchronous
and --async-ckpt, into a temporary directory on --disk-dir) and a memory snapshot (support/memory.py's Tier,
in --mem-dir, /dev/shm), each timed where the loop pays (the seconds inside the call) and to its end
(complete); then the restore of each: checkpoint.restore from disk (every byte hashed, then loaded), the
tier's (its snapshot found, hashed, loaded). Medians, side by side, and the memory's against the disk's.

One process has no partner: the snapshot's copy to another node is not timed here. It is the thread's
work, not the loop's (a gloo send of the snapshot's bytes, the size of the file).

Then the work a failure loses: on average half an interval of steps (a failure falls anywhere in it) and
the restore, at --ckpt-every and --mem-ckpt-every (this benchmark's defaults: a disk checkpoint every 100
steps, a memory snapshot every 10), with what each costs the loop at that interval, a share of its time.
"""

import argparse
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import checkpoint  # noqa: E402
import model as gpt  # noqa: E402
import parallel  # noqa: E402
import train  # noqa: E402
from config import TrainConfig  # noqa: E402
from support import memory, writer  # noqa: E402


def step_fn(model, opt, batch):
    def step():
        loss = model(batch[:, :-1], batch[:, 1:])[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def disk_save(saver: writer.Saver, step: int, model, opt):
    saver.save(step, checkpoint.tensor_entries(model, opt, saver.grid), checkpoint.optimizer_steps(opt), extra={},
               meta={})
    return saver.wait


def snapshot(tier: memory.Tier, step: int, model, opt):
    checkpoint.to_memory(tier, step, lambda: {"step": step}, model, opt)
    return tier.join


def timed(fn) -> tuple[float, float]:
    """(seconds inside fn, seconds until what it started is complete: fn may return a waiter)."""
    t0 = time.perf_counter()
    waiter = fn()
    paid = time.perf_counter() - t0
    if callable(waiter):
        waiter()
    return paid, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="mini")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--ckpt-every", type=int, default=100, help="the disk interval the lost work is given for")
    p.add_argument("--mem-ckpt-every", type=int, default=10, help="the memory interval the lost work is given for")
    p.add_argument("--mem-dir", default="/dev/shm")
    p.add_argument("--disk-dir", default=str(ROOT))
    args = p.parse_args()
    torch.manual_seed(0)
    cfg = gpt.config_from_preset(args.preset, 50304)
    model = gpt.build(cfg, seed=0)
    opt = train.make_optimizer(model, TrainConfig(lr=1e-4))
    batch = torch.randint(0, 50257, (args.batch_size, args.seq_len + 1))
    step = step_fn(model, opt, batch)
    step()  # AdamW's moments exist from here
    grid = parallel.Grid()
    with tempfile.TemporaryDirectory(dir=args.disk_dir) as disk, tempfile.TemporaryDirectory(dir=args.mem_dir) as mem:
        savers = {name: writer.Saver(Path(disk) / name, keep=2, asynchronous=asynchronous, grid=grid, run="bench")
                  for name, asynchronous in (("sync", False), ("async", True))}
        tier = memory.Tier(1, mem, str(Path(disk) / "out"), grid, "bench", 10**9, log=lambda line: None)
        tier.open(checkpoint.memory_bytes(model, opt, grid))
        tier.meta = {}
        times = {k: [] for k in ("step", "sync", "async", "memory", "disk restore", "memory restore")}
        for n in range(1, args.rounds + 1):
            times["step"].append(timed(step))
            for name, saver in savers.items():
                times[name].append(timed(partial(disk_save, saver, n, model, opt)))
            times["memory"].append(timed(partial(snapshot, tier, n, model, opt)))
            times["disk restore"].append(timed(partial(checkpoint.restore, Path(disk) / "sync", model, opt, grid, {},
                                                       "bench", log=lambda line: None)))
            times["memory restore"].append(timed(partial(checkpoint.from_memory, tier, -1, model, opt, grid, {})))
        tier.release()
    med = {k: (statistics.median(a for a, _ in v), statistics.median(b for _, b in v)) for k, v in times.items()}
    size = tier.sizes["own"]
    print(f"{args.preset} on cpu, {gpt.n_params(cfg) / 1e6:.1f}M parameters, a step of {args.batch_size} x "
          f"{args.seq_len} tokens: {med['step'][0]:.3f} s; a checkpoint of this rank {size / 1e6:.1f} MB "
          f"(medians of {args.rounds} rounds)")
    print(f"  {'':<20}{'the loop pays':>16}{'complete':>12}{'restore':>12}")
    for name, label, restore in (("sync", "disk, sync", "disk restore"), ("async", "disk, --async-ckpt", None),
                                 ("memory", "memory snapshot", "memory restore")):
        cells = f"{med[name][0]:>14.4f} s{med[name][1]:>10.4f} s"
        print(f"  {label:<20}{cells}" + (f"{med[restore][0]:>10.4f} s" if restore else ""))
    ratio = {k: med["memory"][0] / med[k][0] for k in ("async", "sync")}
    print(f"  memory / disk: the loop pays {ratio['async']:.2f}x an --async-ckpt save's, {ratio['sync']:.2f}x a "
          f"synchronous one's; the restore takes {med['memory restore'][0] / med['disk restore'][0]:.2f}x")
    print("a failure loses, on average, half an interval of steps and the restore:")
    s = med["step"][0]
    for label, every, paid, restore in (("disk", args.ckpt_every, med["async"][0], med["disk restore"][0]),
                                        ("memory", args.mem_ckpt_every, med["memory"][0], med["memory restore"][0])):
        print(f"  {label + f' every {every} steps:':<26}{every / 2 * s + restore:8.2f} s ({every / 2:g} steps of "
              f"{s:.3f} s, and {restore:.3f} s to restore); the loop pays {paid / (every * s):.2%} of its time for it")


if __name__ == "__main__":
    main()
