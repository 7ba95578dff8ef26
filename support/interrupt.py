"""How a run stops: when it is asked to (Ctrl-C, a scheduler's SIGTERM), when a peer fails, and on purpose.

A scheduler that preempts a job (SLURM, Kubernetes) sends SIGTERM, waits a grace period, then sends
SIGKILL; a person presses Ctrl-C. Python's default turns the first into a silent death and the second
into a KeyboardInterrupt wherever the program happens to be: either way the steps since the last
checkpoint are lost (with the default, no periodic checkpoints, all of them). Instead:

    signal ──▶ handler: note it; the step in flight runs on
    top of the next step ──▶ every rank: all-reduce(max) of the noted signal, launched (`share`)
    end of that step ──▶ read with the step's numbers ──▶ every rank stops after that same step
    stop ──▶ a checkpoint of that step, the writer drained ──▶ one line, exit 128 + signal (130, 143)

Under torchrun the signal reaches the ranks at different moments (torchrun passes it to each worker in
turn; a scheduler may signal one process only), so a rank's own flag cannot decide: a rank that stops
alone leaves the others waiting in the next collective. The all-reduce launched at the top of every step
turns "some rank was signalled" into one step that every rank stops after, and the checkpoint saved there
is consistent. (One 4-byte all-reduce a step: nothing next to a step's gradient traffic. It is not waited
for at the top: its value is read with the step's own numbers, the loop's one read of the device a step,
so the GPU never idles at a step boundary for it; the price is that the run stops after the first step
that starts after the signal, not the one in flight.) torchrun gives its workers 30 s after forwarding a
signal, then kills them: two steps and a save must fit in that.

Before training starts (set-up, data preparation) there is nothing to save, and preparation resumes
where it stopped: a signal stops at once, with one line. After the last step the run is finishing
anyway, and finishes.

A second signal more than REPEAT_S after the first exits at once (os._exit, 128 + signal), keeping the
last complete checkpoint: a save is atomic (checkpoint.py), so one cut short is simply not there. A
repeat within REPEAT_S is the same Ctrl-C arriving twice: the terminal signals every process of the
foreground group, and torchrun forwards the one it got to its workers too.

Once the stop is complete (its checkpoint committed, its line said), the process leaves without the
interpreter's teardown (os._exit, `Stopped.leave`): Python's finalization puts the default handlers back
before it destroys torch's objects, so a Ctrl-C pressed again in those moments ended the process by the
signal (exit status -2 to its parent) instead of the promised 130, and nothing is left to lose. Before
main installs this handler, while the program's imports load, support/cli.py's stands in.

When a peer fails, a collective raises (gloo) or never completes (NCCL: the step's bounded wait,
`wait_for_device`): `peer_call` and `wait_until` make either one PeerError line (train.py: exit status 3).
Every read of a collective's result by the host mid-run goes through `host_read`, which on NCCL waits
that bounded way and checks what NCCL found before it trusts the value.
And on purpose: --crash-at kills the process at a step or in the middle of a save (`crash_due`), or makes
it hang (`stall`), for the tests and lessons that prove nothing is lost and no wait is unbounded.
"""

import os
import re
import signal
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from support import cli

SIGNALS = (signal.SIGINT, signal.SIGTERM)
REPEAT_S = 1.0  # a repeat within this is the same request, delivered twice


class Stopped(BaseException):
    """The run stopped because it was asked to. A BaseException, like KeyboardInterrupt: no `except
    Exception` on the way out may take it for an error and carry on."""

    def __init__(self, signum: int, step: int | None = None):
        self.signum, self.step = signum, step
        self.code = 128 + signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM
        name = signal.Signals(signum).name
        if step is None:
            text = f"stopped by {name} during set-up, before training; nothing new to save; rerun the same " \
                   "command to continue (a data preparation resumes where it stopped)"
        else:
            text = f"stopped at step {step} by {name}; checkpoint saved; rerun the same command to continue"
        super().__init__(text)

    def leave(self) -> None:
        """Exit 128 + the signal, rank 0 saying why, once the stop is complete: without the interpreter's
        teardown (the module docstring says why), the process group shut down first."""
        if dist.is_initialized():
            dist.destroy_process_group()
        cli.fail(str(self), self.code, say=int(os.environ.get("RANK", "0")) == 0, at_once=True)


class Stop:
    """The handler of SIGINT and SIGTERM for one run; `deferred` is set once the training loop starts.
    Install it from the main thread (Python runs signal handlers there)."""

    def __init__(self):
        self.signum, self.at, self.deferred = 0, 0.0, False
        for s in SIGNALS:
            signal.signal(s, self.handle)

    def handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self.signum:
            if now - self.at < REPEAT_S:
                return
            print(f"\n{signal.Signals(signum).name} again: exiting now, without saving (the last complete "
                  "checkpoint is kept)", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.signum, self.at = signum, now
        if not self.deferred:
            raise Stopped(signum)

    def share(self, grid) -> Callable[[], torch.Tensor]:
        """Start agreeing on the signal every rank stops for (the largest any rank noted so far; 0: none):
        an all-reduce (max) over every rank, launched now and not waited for. Returns what gives the
        agreed value, a 0-d tensor on the device, for the step to read with its own numbers. Collective:
        every rank calls it at the same point of every step (the top)."""
        flag = torch.full((), float(self.signum), device=grid.device)  # (a fill: no copy, no sync)
        work = grid.all_reduce(flag, "world", op=dist.ReduceOp.MAX, async_op=True)

        def agreed() -> torch.Tensor:
            if work is not None:
                peer_call(work.wait, what=grid.describe("the stop signal's all_reduce", "world"))
            return flag
        return agreed


# ----------------------------------------------------------------------------- when a peer fails


class PeerError(RuntimeError):
    """A collective failed: a peer died, hung past --timeout, or the network broke. `where`: this rank and
    the call it was in (a group names its ranks: the peer that failed is among them); `detail`: the
    backend's own words, one line."""

    def __init__(self, where: str, detail: str):
        super().__init__(f"{where}: {detail}")
        self.where, self.detail = where, detail


def peer_call(fn, *args, what: str = "a collective", **kwargs):
    """Run a torch.distributed call; turn its failure into one PeerError line."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as e:
        rank = f"rank {dist.get_rank()}, " if dist.is_initialized() else ""
        raise PeerError(f"{rank}in {what}", in_a_line(e)) from e


def in_a_line(e: BaseException) -> str:
    """What the backend said, as one line: its first, without gloo's source location or torch's advice."""
    line = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
    line = re.sub(r"^\[[^\]]*:\d+\]\s*", "", line)  # gloo's source location, "[.../pair.cc:537] "
    return line.split(". This is typically caused")[0][:300]


def wait_until(ready, timeout_s: float, where: str, failure=lambda: None, poll_s: float = 1e-3) -> None:
    """Poll ready() until it is true. A PeerError as soon as failure() has something to say (what the backend
    reports), or once timeout_s has passed without either: a bounded wait where the plain one could hang."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if (problem := failure()) or time.monotonic() > deadline:
            raise PeerError(where, problem or f"not done after {timeout_s:g} s (--timeout): a peer died or hangs")
        time.sleep(poll_s)
    if problem := failure():  # a failed collective can let the device pass it, with garbage in its buffer
        raise PeerError(where, problem)


# How much longer than --timeout the step's sync point waits on NCCL (wait_for_device): time for the
# watchdog, which ends a collective at --timeout, to notice it and abort its communicator
NCCL_GRACE_S = 30.0


def wait_for_device(grid, what: str = "waiting for the GPU to finish the step's collectives") -> None:
    """The step's sync point, bounded (parallel.Grid.wait_for_device). NCCL calls return before the GPU has
    done them, so a dead or hung peer shows only where the host waits for the device (an `.item()`), and
    there it would wait until NCCL's watchdog ends the collective after --timeout. Wait here instead, at
    most --timeout and a grace, watching what NCCL reports (`nccl_failure`), and say it as one PeerError
    (exit status 3). Nothing to do on gloo (its calls return when done, and raise when a peer fails) or alone."""
    if grid.device.type != "cuda" or grid.world == 1:
        return
    done = torch.cuda.Event()
    done.record()  # after everything this step queued, its collectives' waits included
    wait_until(done.query, grid.timeout_s + NCCL_GRACE_S, f"rank {grid.rank}, {what}",
               failure=lambda: nccl_failure(grid))


def host_read(grid, t: torch.Tensor, what: str) -> list:
    """t's values on the host (a list; of one value for a 0-d t), where t holds what collectives made: the
    one safe way to read one mid-run. On NCCL a collective whose communicator the watchdog aborted lets the
    device pass it with its buffer as it was (this rank's own value, or garbage), and a plain read would
    take that for the result and carry on: wait for the device here, bounded (`wait_for_device`), and ask
    what NCCL found before trusting the value (a PeerError "rank R, `what`: ...", exit status 3). On gloo,
    whose calls raise when a peer fails, and alone, just the read."""
    wait_for_device(grid, what)
    return t.tolist() if t.dim() else [t.item()]


def nccl_failure(grid) -> str | None:
    """What NCCL's watchdog found in the grid's groups (a timeout, an error here or on a peer), if anything."""
    for name, group in grid.groups.items():
        backend = (group or dist.group.WORLD)._get_backend(grid.device)
        error = backend.get_error() if hasattr(backend, "get_error") else None  # torch >= 2.6
        if error is not None and error.name not in ("SUCCESS", "NO_ERROR"):
            return f"NCCL reports {error.name} in {grid.describe('a collective', name)}"
    return None


def crash_due(spec: str, rank: int, event: str) -> bool:
    """Is --crash-at `spec` asking process `rank` to die at `event` ("step:N", "save:N"), or to stall there
    ("stall:connect", "stall:GROUP": `stall`)? A "rank:R:..." spec names one rank, and only in a launcher's
    first attempt, so that a restarted job runs through."""
    if spec.startswith("rank:"):
        _, who, spec = spec.split(":", 2)
        if int(who) != rank or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return False
    return spec == event


def stall() -> None:
    """--crash-at stall:...: this process stops answering and never exits, as a hung peer does (a deadlock,
    a stuck link): its peers wait in the call it never joins, until --timeout. A signal during set-up still
    stops it (`Stop`); a launcher that gives up on the job kills it."""
    while True:
        time.sleep(3600)
