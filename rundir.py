"""The run directory (--out): who may write it, which run it holds, and what that run measured.

    <out>/
        .lock           an OS lock (flock) held by the process training here. The kernel releases it
                        when that process ends, however it ends: a SIGKILLed run never leaves it stale.
        run.json        {"run": "5f0c9a3e1b2d", "started": ...}: the identity of the run this directory holds
        metrics.jsonl   one JSON line per optimizer step, and one per event (start, resume, spike, checkpoint,
                        and every --stats-every steps `layers`: per-layer statistics, stats.py)
        report.html     the dashboard of metrics.jsonl (dashboard.py), rewritten as the run goes
        ckpt/           the checkpoints (checkpoint.py); each one records the run id that wrote it
        previous/       what --fresh moved aside: earlier runs' run.json, metrics.jsonl, report.html and ckpt/

Two mistakes are silent without this file. Two processes started on one --out interleave their
metrics and write over each other's checkpoints: the lock stops the second with one line. And a run
started over with --fresh kept the old run's checkpoints beside its own, so a fallback from a corrupt
checkpoint could land in the *old* run and report success: --fresh now moves the old run aside, and
checkpoint.restore only ever loads checkpoints of the run named in run.json.
"""

import fcntl
import json
import os
import secrets
import socket
import time
from pathlib import Path


class RunDirError(ValueError):
    """--out cannot be used as asked; printed as one line."""


def check_out(out: Path) -> None:
    """--out and its checkpoint directory must be directories (or not exist yet)."""
    for path in (out, out / "ckpt"):
        if path.exists() and not path.is_dir():
            raise RunDirError(f"--out: {path} is a file, not a directory; remove it or choose another --out")


def lock(out: Path):
    """Take the exclusive lock on --out, or fail with who holds it. Returns the open lock file: it
    must stay open (and referenced) for as long as the run trains."""
    out.mkdir(parents=True, exist_ok=True)
    f = open(out / ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise RunDirError(f"--out {out} is in use by {holder}; wait for it to finish, or choose another "
                          "--out") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}")
    f.flush()
    return f


def claim(out: Path, fresh: bool) -> str:
    """Make --out hold one run and return its id (rank 0 only, under the lock). A new directory, or
    --fresh, starts a new run (--fresh first moves the previous one to previous/<its id>/); otherwise
    the run in run.json continues. Leftovers without a run.json are refused, not guessed at."""
    old = read_run_id(out)
    leftovers = [p for p in (out / "ckpt", out / "metrics.jsonl") if p.exists()]
    if fresh and (old or leftovers):
        aside = out / "previous" / (old or f"unnamed-{time.strftime('%Y%m%d-%H%M%S')}")
        aside.mkdir(parents=True, exist_ok=True)
        page = [out / "report.html"] if (out / "report.html").exists() else []  # its dashboard goes with it
        for p in leftovers + page + ([out / "run.json"] if old else []):
            os.replace(p, aside / p.name)
        print(f"--fresh: moved the previous run's files to {aside}", flush=True)
        old = None
    elif old is None and leftovers:
        raise RunDirError(f"--out {out} holds {', '.join(p.name for p in leftovers)} but no run.json (written "
                          "by an older version?); pass --fresh to move them aside, or choose another --out")
    if old is not None:
        return old
    run = secrets.token_hex(6)
    tmp = out / "run.json.tmp"
    tmp.write_text(json.dumps({"run": run, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")
    os.replace(tmp, out / "run.json")
    return run


def read_run_id(out: Path) -> str | None:
    path = out / "run.json"
    if not path.exists():
        return None
    try:
        run = json.loads(path.read_text())["run"]
        if not isinstance(run, str) or not run:
            raise ValueError
        return run
    except (OSError, ValueError, KeyError, TypeError):
        raise RunDirError(f"{path} is unreadable; restore it, or pass --fresh to start a new run") from None


# Event lines that measure one step (stats.py's per-layer statistics): a replayed step writes them
# again, so they are dropped with the step lines, not kept as history.
STEP_EVENTS = ("layers",)


class Metrics:
    """One JSON line per optimizer step in <out>/metrics.jsonl, written by rank 0 only. Event lines
    ({"event": ...}) are history and are never removed, except those in STEP_EVENTS."""

    def __init__(self, path: Path, enabled: bool, resume_step: int, log=print):
        self.path, self.enabled, self.log_line = path, enabled, log
        self.truncate(resume_step)

    def rows(self) -> list[dict]:
        """The file's rows. A torn last line (the process died mid-write) is dropped, and said so."""
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        rows = []
        for i, line in enumerate(lines):
            try:
                rows.append(json.loads(line))
            except ValueError:
                if i < len(lines) - 1:
                    raise RunDirError(f"{self.path} line {i + 1} is not JSON; repair it or move the file "
                                      "aside") from None
                self.log_line(f"{self.path}: dropped a torn last line (the process died while writing it)")
        return rows

    def truncate(self, step: int) -> None:
        """Drop the step lines after `step`: a resumed or rolled-back run writes them again."""
        if self.enabled and self.path.exists():
            history = lambda r: "event" in r and r["event"] not in STEP_EVENTS
            keep = [r for r in self.rows() if history(r) or r.get("step", 0) <= step]
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
            os.replace(tmp, self.path)

    def log(self, **row) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")


def steps(out: str | Path) -> list[dict]:
    """The per-step rows of a run's metrics.jsonl, events (start, checkpoint, spike) left out: what a
    plot or a comparison of two runs reads."""
    return [r for r in Metrics(Path(out) / "metrics.jsonl", enabled=False, resume_step=0).rows()
            if "event" not in r]
