"""What a rank allocates while train.py sets up, followed allocation by allocation (not collected by pytest).

    torchrun --standalone --nproc-per-node 2 tests/setup_memory.py --zero 3 [train.py's flags]

Runs `train.setup` under the profiler, which records every allocation and free of the run's device
(`profile_memory`), and prints one JSON line per rank: `peak`, the most bytes held at once during
set-up, leaving apart the optimizer's state and the gradient shards (sharded by construction and held
from set-up on, so what ZeRO-3's start-up must not add to is everything else); `shard`, this rank's
weight shards; `model`, the bytes of this rank's parameters in fp32 (after tensor parallelism);
`unit`, the largest ZeRO-3 unit whole in fp32; `draw`, the largest full parameter as (seed, name)
draws it, before any tensor-parallel slice (on the CPU, so counted only there); `n`, the ranks a unit
is sharded over. tests/test_parallel.py (CPU) and tests/test_gpu.py (two GPUs) hold the peak to
shard + unit + draw and a small margin.
"""

import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch._C._profiler import _EventType  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import config  # noqa: E402
import model  # noqa: E402
import train  # noqa: E402


def allocations(prof, device_type: str) -> list:
    """The profiler's allocation events (a free is a negative size) on one kind of device, in time order."""
    def walk(nodes):
        for n in nodes:
            yield n
            yield from walk(n.children)
    events = (n for n in walk(prof.profiler.kineto_results.experimental_event_tree()) if n.tag == _EventType.Allocation)
    return [n.extra_fields for n in sorted(events, key=lambda n: n.start_time_ns)
            if n.extra_fields.device.type == device_type]


def peak_apart_from(events: list, kept_ptrs: set[int]) -> int:
    """The most bytes held at once, leaving out the allocations still held at the end at `kept_ptrs`."""
    last = {}
    for i, e in enumerate(events):
        if e.alloc_size > 0:
            last[e.ptr] = i
        else:
            last.pop(e.ptr, None)
    kept = {i for ptr, i in last.items() if ptr in kept_ptrs}
    held = peak = 0
    for i, e in enumerate(events):
        if i not in kept:  # (a kept allocation is never freed)
            held += e.alloc_size
            peak = max(peak, held)
    return peak


def rank_lines(stdout: str) -> list[dict]:
    """Each rank's JSON line, wherever it landed: rank 0's log lines go as text and newline apart, so
    another rank's line can land after its text, on the same line of the shared stdout (seen loaded)."""
    decoder = json.JSONDecoder()
    return [decoder.raw_decode(stdout, m.start())[0] for m in re.finditer(r'\{"rank": ', stdout)]


def main() -> None:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, profile_memory=True) as prof:
        run = train.setup(config.parse_args(sys.argv[1:]))
    state = {st[k].untyped_storage().data_ptr() for st in run.opt.shards for k in ("master", "exp_avg", "exp_avg_sq")}
    state |= {b.shard_grad.untyped_storage().data_ptr() for b in run.sync.buckets}
    g, on_cpu = run.grid, run.device.type == "cpu"
    # One write of the whole line: the ranks share torchrun's stdout, and print's text and newline go as two
    # writes, so two ranks' lines could run together (seen once in a loaded suite).
    os.write(sys.stdout.fileno(), (json.dumps({
        "rank": g.rank, "peak": peak_apart_from(allocations(prof, run.device.type), state), "n": g.dp_cp,
        "shard": sum(st["flat"].numel() * st["flat"].element_size() for st in run.opt.shards),
        "model": sum(p.numel() * 4 for p in run.model.parameters()),
        "unit": max(b.numel * 4 for b in run.sync.buckets),
        "draw": max(s.numel() * 4 for s in model.full_shapes(run.model_cfg).values()) if on_cpu else 0,
    }) + "\n").encode())


if __name__ == "__main__":
    main()
