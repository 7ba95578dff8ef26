"""Where a step's time goes, rank by rank: compute and every collective on one time axis.

A number such as "the wait after the backward was 5 ms" cannot show overlap: it mixes three things,
the transfer itself, the time the data-parallel peer was still computing (a collective cannot finish
before its last member joins), and the collectives that were done long before anyone waited. So we
record, for one step on every rank, when each compute span ran and, for every collective, when this
rank launched it and when it completed, then line the ranks up:

    rank 0  compute  |FFFFFFFBBBBBBBBBBBBBBBBBBB                  O|
            dp       |                 ..====   ...=====  ..==       |
    rank 1  compute  |FFFFFFFBBBBBBBBBBBBBBBBBBBBBB               O|
            dp       |                    ==       ======    ==      |

    F forward  B backward  O optimizer step  : blocked in a collective (a tensor-parallel all-reduce)
    . launched, waiting for a peer  = transferring

A collective's members all launch it, in the same order (that is the contract of every collective),
so the k-th collective of a group on one rank is the k-th on the others. The transfer can only start
when the last member launches: from this rank's launch to that moment it waits for a peer ('.'), from
there to completion it transfers ('='). A transfer drawn under 'B' is hidden behind the backward
(overlap); one drawn under nothing is exposed, and the step pays for it.

How it is measured, and what each clock means:

    CPU (gloo), the host clock (`time.perf_counter`):
      launch     just before the call
      completion the collective's future (`Work.get_future().then`) fires when its data has arrived,
                 even if nobody waits yet; where there is no future (gloo's point-to-point), when the
                 waiting call returns, so a late wait makes that message look longer
    GPU (NCCL), CUDA events: the host returns long before the device is done, so points are moments
    on the device, read after the step (`Clock.settle`):
      launch     recorded on the compute stream where the collective is issued: the moment the device
                 has done everything before it, from which NCCL's stream may run it
      completion recorded through the same future, on a stream NCCL makes wait for the collective's own
                 end: the communication side, not the moment the compute stream is let past it (after
                 `wait()`, maybe much later: a bucket launched mid-backward is waited for only at the
                 end). A synchronous call, and a work without a future, completes where the compute
                 stream is let past it.
      spans      compute spans are events on the compute stream too

Ranks on one machine share its monotonic clock (CPU); elsewhere the clocks are lined up by a barrier at
the start of the recorded step (each rank's time 0 is when it left the barrier).

`Recorder` is an Observer (support/observer.py): Grid hands it every collective, the loop every compute span.
`Timeline`, the instrument a run attaches (under torchrun, or with --print-timeline), times every
collective of every step (`comm_s` in metrics.jsonl: the dashboard charts it) and, with
--print-timeline, records the compute spans of the second step too; reports.py gathers every rank's
record and draws it (`draw`).
"""

import socket
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from parallel import Grid
from support.observer import Observer


class Clock:
    """The host clock on a CPU; CUDA events on the compute stream on a GPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, a, b) -> float:
        """From point a to point b (on a GPU, after `settle`)."""
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def settle(self) -> None:
        """Wait until every recorded point has happened: a CUDA event can be read only once the device has
        passed it, and the optimizer's collectives (ZeRO's all-gathers) are still queued when the step's
        host code returns. Called only on the steps that are read."""
        if self.cuda:
            torch.cuda.synchronize()


@dataclass
class Comm:
    """One collective on this rank: what, between whom, how big, and its two moments."""
    op: str
    group: str
    members: tuple[int, ...]
    nbytes: int
    launch: object
    done: object = None
    blocking: bool = False  # the caller waited in the call (a synchronous collective): no compute meanwhile


class TimedWork:
    """An asynchronous collective's handle that also notes when the collective completed."""

    def __init__(self, work, comm: Comm, clock: Clock):
        self.work, self.comm, self.clock = work, comm, clock
        try:
            work.get_future().then(self._completed)
        except RuntimeError:  # gloo's point-to-point works have no future: timed at wait()
            pass

    def _completed(self, _future) -> None:
        """gloo: runs on the backend's thread when the data has arrived. NCCL: runs at once, with a stream
        made to wait for the collective's end as the current one, so the event recorded here happens when
        the communication is done, whatever the compute stream is doing meanwhile."""
        if self.comm.done is None:
            self.comm.done = self.clock.now()

    def wait(self, *args):
        result = self.work.wait(*args)
        if self.comm.done is None:
            self.comm.done = self.clock.now()
        return result

    def __getattr__(self, name):
        return getattr(self.work, name)


class Recorder(Observer):
    """This rank's collectives since the last reset, timed while `on`; and, while `spans_on`, its compute
    spans. On a CPU timing is always on (a clock read costs nanoseconds); on a GPU each point is a CUDA
    event, so it is turned on only for the steps that report it (Timeline)."""

    def __init__(self, device: torch.device):
        self.clock = Clock(device)
        self.on = not self.clock.cuda
        self.comms: list[Comm] = []
        self.spans: list[tuple[str, object, object]] = []
        self.spans_on, self.t0 = False, None

    def reset(self) -> None:
        self.comms, self.spans = [], []

    def launch(self, op: str, group: str, members: tuple[int, ...], nbytes: int) -> Comm | None:
        if not self.on:
            return None
        comm = Comm(op, group, members, nbytes, self.clock.now())
        self.comms.append(comm)
        return comm

    def track(self, comm: Comm | None, work):
        """A synchronous call has completed when it returns; an asynchronous one when its work says so (a
        batch of point-to-point messages: when each of its works says so)."""
        if comm is None:
            return work
        if work is None:
            comm.done, comm.blocking = self.clock.now(), True
            return None
        if isinstance(work, list):
            return [TimedWork(w, comm, self.clock) for w in work]
        return TimedWork(work, comm, self.clock)

    def collective(self, op: str, group: str, members: tuple[int, ...], nbytes: int, start):
        comm = self.launch(op, group, members, nbytes)
        return self.track(comm, start())

    @contextmanager
    def span(self, name: str):
        """A compute span of the recorded step ('F' forward, 'B' backward, 'O' optimizer)."""
        if not self.spans_on:
            yield
            return
        start = self.clock.now()
        yield
        self.spans.append((name, start, self.clock.now()))

    def seconds(self) -> dict[str, float]:
        """Launch-to-completion seconds per "collective group" since the last reset (call after the
        step: every collective has completed by then)."""
        out = defaultdict(float)
        if self.comms:
            self.clock.settle()
        for c in self.comms:
            if c.done is not None:
                out[f"{c.op} {c.group}"] += self.clock.seconds(c.launch, c.done)
        return dict(out)

    def start(self, barrier) -> None:
        """Record the compute spans of this step, on a clock lined up with the other ranks."""
        self.reset()
        barrier()
        self.t0, self.spans_on, self.on = self.clock.now(), True, True

    def stop(self) -> dict:
        """This rank's step, in seconds from its time 0: plain data, for gathering to rank 0. On a CPU
        also the host and its monotonic clock at time 0, which every process on one machine shares."""
        self.spans_on, self.on = False, not self.clock.cuda
        self.clock.settle()
        at = lambda point: self.clock.seconds(self.t0, point)
        return {"spans": [(name, at(a), at(b)) for name, a, b in self.spans],
                "comms": [(c.op, c.group, list(c.members), c.nbytes, at(c.launch), at(c.done), c.blocking)
                          for c in self.comms if c.done is not None],
                "host": socket.gethostname(), "t0": None if self.clock.cuda else self.t0}


class Timeline(Recorder):
    """The timeline of a training run: every collective of every step timed, their seconds added to the
    step's row (`comm_s`, under torchrun; on a GPU only every `every` steps, the --stats-every of the
    dashboard's other charts, as CUDA events cost microseconds each), and with `print_step`
    (--print-timeline) the compute and collectives of the second step this process runs recorded, for
    reports.py to draw."""

    def __init__(self, grid: Grid, every: int, print_step: bool, max_steps: int):
        super().__init__(grid.device)
        self.grid, self.every, self.print_step, self.max_steps = grid, every, print_step, max_steps
        self.step = None  # the step recorded for --print-timeline (the first also allocates and compiles)

    def step_begin(self, step: int) -> None:
        self.reset()
        if self.print_step and self.step is None:
            self.step = step + min(1, self.max_steps - step)
        if step == self.step:
            self.start(self.grid.barrier)
        elif self.clock.cuda:
            self.on = bool(self.every) and (step == 1 or step % self.every == 0)

    def step_end(self, row: dict) -> None:
        if self.grid.world > 1 and (times := self.seconds()):
            row["comm_s"] = times  # launch to completion, summed over this step's calls of each


# ----------------------------------------------------------------------------- lining the ranks up


def line_up(ranks: list[dict]) -> list[dict]:
    """The ranks on one time axis. Ranks that share a host and a host clock are placed by that clock (a
    barrier lines up only as well as the processes are scheduled when they leave it: on a CPU with more
    processes than cores, tens of milliseconds apart); otherwise each rank's time 0 is its barrier exit."""
    if any(r.get("t0") is None for r in ranks) or len({r.get("host") for r in ranks}) > 1:
        return ranks
    origin = min(r["t0"] for r in ranks)
    out = []
    for r in ranks:
        d = r["t0"] - origin
        out.append({**r, "spans": [(n, a + d, b + d) for n, a, b in r["spans"]],
                    "comms": [(*c[:4], c[4] + d, c[5] + d, *c[6:]) for c in r["comms"]]})
    return out


def split_waiting(ranks: list[dict]) -> list[list[dict]]:
    """Per rank, its collectives with `wait` (launch until the last member launched) and `transfer`
    (from then until done), in seconds. Point-to-point messages have no such split: all transfer."""
    seen = defaultdict(int)  # (rank, members, op) -> how many so far: the k-th on every member
    launches = defaultdict(dict)  # (members, op, k) -> {rank: launch}
    keyed = []
    for rank, record in enumerate(ranks):
        mine = []
        for op, group, members, nbytes, launch, done, *blocking in record["comms"]:
            key = (tuple(members), op, seen[(rank, tuple(members), op)])
            seen[(rank, tuple(members), op)] += 1
            launches[key][rank] = launch
            mine.append((key, dict(op=op, group=group, nbytes=nbytes, launch=launch, done=done,
                                   blocking=bool(blocking and blocking[0]))))
        keyed.append(mine)
    out = []
    for mine in keyed:
        rows = []
        for key, c in mine:
            joined = max(launches[key].values()) if c["op"] != "p2p" else c["launch"]
            start = min(max(joined, c["launch"]), c["done"])
            rows.append({**c, "wait": start - c["launch"], "transfer": c["done"] - start, "start": start})
        out.append(rows)
    return out


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The same moments as disjoint intervals: time during which at least one of them ran."""
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif b > a:
            out.append((a, b))
    return out


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in union(intervals))


def overlapped(intervals: list[tuple[float, float]], busy: list[tuple[float, float]]) -> float:
    """Seconds of the union of `intervals` during which this rank was computing (`busy`, disjoint)."""
    return sum(max(0.0, min(b, d) - max(a, c)) for a, b in union(intervals) for c, d in busy)


def computing(spans: list[tuple[str, float, float]], rows: list[dict]) -> list[tuple[float, float]]:
    """When this rank computed: its spans, less the time it sat inside a blocking collective (a tensor-
    parallel all-reduce runs inside a forward span, but nothing is computed while it waits for it)."""
    out = union([(a, b) for _, a, b in spans])
    for c in rows:
        if c["blocking"]:
            out = [piece for a, b in out for piece in ((a, min(b, c["launch"])), (max(a, c["done"]), b))
                   if piece[1] > piece[0]]
    return out


def lanes(rows: list[dict]) -> dict[str, list[list[dict]]]:
    """Collectives per group, spread over as few lanes as keep them from overlapping in the drawing."""
    out = defaultdict(list)
    for c in sorted(rows, key=lambda c: c["launch"]):
        group_lanes = out[c["group"]]
        for lane in group_lanes:
            if lane[-1]["done"] <= c["launch"]:
                lane.append(c)
                break
        else:
            group_lanes.append([c])
    return out


def draw(ranks: list[dict], width: int = 96) -> str:
    """The ASCII timeline of one step: per rank a compute row and a row per lane of collectives."""
    ranks = line_up(ranks)
    timed = split_waiting(ranks)
    end = max([b for r in ranks for _, _, b in r["spans"]] + [c["done"] for rows in timed for c in rows] + [1e-9])
    col = lambda t: min(width - 1, max(0, int(t / end * width)))
    lines = [f"timeline of one step ({1e3 * end:.1f} ms, one column = {1e3 * end / width:.2f} ms):"]
    for rank, (record, rows) in enumerate(zip(ranks, timed)):
        row = [" "] * width
        for name, a, b in record["spans"]:
            for i in range(col(a), max(col(a) + 1, col(b))):
                row[i] = name[0]
        for c in rows:
            for i in range(col(c["launch"]), col(c["done"]) if c["blocking"] else 0):
                if row[i] != " ":
                    row[i] = ":"  # inside a span, but blocked in a collective
        lines.append(f"rank {rank:<3} compute   |{''.join(row)}|")
        for group, group_lanes in sorted(lanes(rows).items()):
            for lane in group_lanes:
                row = [" "] * width
                for c in lane:
                    for i in range(col(c["launch"]), col(c["start"])):
                        row[i] = "."
                    for i in range(col(c["start"]), max(col(c["start"]) + 1, col(c["done"]))):
                        row[i] = "="
                lines.append(f"         {group:<9} |{''.join(row)}|")
    lines.append("F forward  B backward  O optimizer step  : blocked in a collective  "
                 ". launched, waiting for a peer to launch  = transferring")
    return "\n".join(lines + summary(ranks, timed))


def summary(ranks: list[dict], timed: list[list[dict]]) -> list[str]:
    """Per rank and collective, in wall time (overlapping calls count once): how long at least one call
    waited for peers, how long at least one transferred, and how much of that transfer time this rank was
    computing anyway (hidden) rather than idle (exposed)."""
    lines = [f"{'rank':<5} {'collective':<20} {'calls':>5} {'wait for peers':>15} {'transfer':>10} "
             f"{'hidden by compute':>18}"]
    for rank, (record, rows) in enumerate(zip(ranks, timed)):
        by_name = defaultdict(list)
        for c in rows:
            by_name[f"{c['op']} {c['group']}"].append(c)
        for name, calls in sorted(by_name.items()):
            wait = length([(c["launch"], c["start"]) for c in calls])
            moving = [(c["start"], c["done"]) for c in calls]
            transfer = length(moving)
            busy = computing(record["spans"], rows)
            share = f"{overlapped(moving, busy) / transfer:.0%}" if transfer > 0 else "-"
            lines.append(f"{rank:<5} {name:<20} {len(calls):>5} {1e3 * wait:>12.2f} ms {1e3 * transfer:>7.2f} ms "
                         f"{share:>18}")
    return lines
