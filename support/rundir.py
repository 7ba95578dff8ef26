"""The run directory (--out): who may write it, which run it holds, and what that run measured.

    <out>/
        .lock           who holds the lock: "pid 1234 on host, since ...". The lock itself is an OS lock
                        (flock) on the directory <out>, held by the process training here; the kernel
                        releases it when that process ends, however it ends: a SIGKILLed run never
                        leaves it stale.
        run.json        {"run": "5f0c9a3e1b2d", "started": ...}: the identity of the run this directory holds
        metrics.jsonl   one JSON line per optimizer step, and one per event (start, resume, spike, checkpoint,
                        and every --stats-every steps `layers`: per-layer statistics, stats.py)
        report.html     the dashboard of metrics.jsonl (dashboard.py), rewritten as the run goes
        ckpt/           the checkpoints (checkpoint.py); each one records the run id that wrote it. It may be a
                        link to a directory elsewhere; that directory is locked too (flock), and its .owner
                        ({"run", "out"}) names the run whose checkpoints it holds
        previous/       what --fresh moved aside: earlier runs' run.json, metrics.jsonl, report.html and ckpt/
        .fresh.json     only while --fresh moves a run aside: what goes where (see `move_aside`)

Two mistakes are silent without this file. Two processes started on one --out interleave their
metrics and write over each other's checkpoints: the lock stops the second with one line. And a run
started over with --fresh kept the old run's checkpoints beside its own, so a fallback from a corrupt
checkpoint could land in the *old* run and report success: --fresh now moves the old run aside, and
checkpoint.restore only ever loads checkpoints of the run named in run.json.

What is locked is the directory itself, not a file in it: a lock file can be deleted under a live run,
and the next process then locks a new file of the same name and both write here. The directory cannot
be swapped while it is open; if it is moved away or run.json changes hands anyway (a process that
ignores the lock, a person), `Lock.problem` notices before the next checkpoint is written.

The directory the checkpoints go to is locked as well, where it really is: two --out whose ckpt/ is one
directory through a link would each move the other's checkpoint of a step it saves aside and point
`latest` at its own, and the first could no longer resume. Its .owner refuses the second run after the
first has stopped too. Taking the locks also clears what failed saves left in ckpt/ (a half-written
.tmp-step_N/) before anything is written: on a full disk that is the room the run needs (`Lock`).

Moving a run aside touches several files; a kill between two of them must not leave half a run in
each place. So --fresh first writes a journal (.fresh.json: the files, and where they go), then moves
them, then deletes it: whatever stops the process, the next run on this --out finds the journal and
finishes the move before anything else (`claim`).
"""

import errno
import fcntl
import json
import os
import secrets
import socket
import time
from pathlib import Path

from support.storage import clear_leftovers, fsync_dir, replace_atomically


class RunDirError(ValueError):
    """--out cannot be used as asked; printed as one line."""


def problem_with(e: OSError) -> str:
    """An OSError in a few words: "No space left on device", "Read-only file system", ..."""
    return e.strerror or str(e)


def check_out(out: Path) -> None:
    """--out and its checkpoint directory must be directories (or not exist yet), and --out writable:
    said now, before any process talks to another and before any data is read."""
    try:
        for path in (out, out / "ckpt"):
            if path.exists() and not path.is_dir():
                raise RunDirError(f"--out: {path} is a file, not a directory; remove it or choose another --out")
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".probe-{socket.gethostname()}-{os.getpid()}"  # permissions alone do not tell (root,
        probe.touch()  # a read-only file system): try
        probe.unlink()
    except OSError as e:
        raise RunDirError(f"--out {out} cannot be written ({problem_with(e)}); choose another --out") from None


class Lock:
    """The exclusive lock on --out, and on the directory its checkpoints go to (ckpt/, or where a link
    puts it): flocks on the directories, held while this object lives (rank 0)."""

    def __init__(self, out: Path):
        self.out, self.fd, self.ckpt_fd = out, None, None  # (set first: __del__ runs even when os.open fails)
        self.fd = os.open(out, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.close()
            holder = (out / ".lock").read_text().strip() if (out / ".lock").is_file() else ""
            raise RunDirError(f"--out {out} is in use by {holder or 'another process'}; wait for it to finish, or "
                              "choose another --out") from None
        st = os.fstat(self.fd)
        self.identity, self.ckpt_identity = (st.st_dev, st.st_ino), None
        self.note = f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
        try:  # ckpt/ too, where it is; then what failed saves left there, before anything is written: on a
            self.lock_checkpoints()  # full disk, that is the room the run needs
            if self.ckpt_fd is not None and self.checkpoints_owner() in (None, read_run_id(out)):
                clear_leftovers(out / "ckpt")  # (another run's directory is not touched: `take` refuses it)
        except (OSError, RunDirError) as e:
            self.close()
            raise e if isinstance(e, RunDirError) else self.cannot(e) from None
        try:
            replace_atomically(out / ".lock", self.note)
        except OSError as e:
            self.close()
            raise RunDirError(f"--out {out}: could not write {out / '.lock'} ({problem_with(e)})") from None

    def take(self, run: str) -> None:
        """Once the run is known (`claim`): lock the directory its checkpoints go to (made if need be:
        --fresh moved the old one away), which must be this run's, and record that it is (.owner)."""
        try:
            self.lock_checkpoints(run)
            self.own_checkpoints(run)
        except OSError as e:
            raise self.cannot(e) from None

    def cannot(self, e: OSError) -> RunDirError:
        return RunDirError(f"--out {self.out}: {problem_with(e)} ({e.filename or self.out}); fix that and rerun "
                           "the same command")

    def lock_checkpoints(self, run: str | None = None) -> None:
        """Lock the directory the checkpoints go to, where ckpt/ is (a link may put it anywhere): two runs
        whose ckpt/ is one directory would each move the other's checkpoint of a step it saves aside and
        point `latest` at its own. Without `run`, if it is there; with it, made if need be, and it must
        be this run's (its .owner names the run whose checkpoints it holds: two runs in turn would do the
        same)."""
        ckpt = self.out / "ckpt"
        if run is not None:
            ckpt.resolve().mkdir(parents=True, exist_ok=True)  # (through a link, the directory it names)
        elif not ckpt.is_dir():
            return
        fd = os.open(ckpt, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) in (self.ckpt_identity, self.identity):  # locked already (or --out itself)
            os.close(fd)
        else:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                owner = self.checkpoints_owner(whole=True) or {}
                holder = f"run {owner['run']} (--out {owner['out']})" if owner else "another process"
                raise RunDirError(f"--out {self.out}: {self.where()}, which {holder} is using; give each run a "
                                  "checkpoint directory of its own") from None
            if self.ckpt_fd is not None:
                os.close(self.ckpt_fd)  # (the one locked before was moved away: --fresh)
            self.ckpt_fd, self.ckpt_identity = fd, (st.st_dev, st.st_ino)
        owner = self.checkpoints_owner(whole=True)
        if run is not None and owner and owner["run"] != run:
            raise RunDirError(f"--out {self.out}: {self.where()}, which holds the checkpoints of run {owner['run']} "
                              f"(--out {owner['out']}), not of this run ({run}); give each run a checkpoint "
                              "directory of its own, or pass --fresh to set this one aside")

    def own_checkpoints(self, run: str) -> None:
        """Record in ckpt/ that it holds this run's checkpoints (.owner), unless it says so already."""
        if self.checkpoints_owner(whole=True) != {"run": run, "out": str(self.out.resolve())}:
            replace_atomically(self.out / "ckpt" / OWNER, json.dumps({"run": run, "out": str(self.out.resolve())}))

    def checkpoints_owner(self, whole: bool = False):
        """The run whose checkpoints ckpt/ holds (its .owner; None when it names none): its id, or with
        `whole` {"run", "out"}."""
        try:
            owner = json.loads((self.out / "ckpt" / OWNER).read_text())
            return owner if whole else owner["run"]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def where(self) -> str:
        ckpt = self.out / "ckpt"
        return f"its checkpoints go to {ckpt.resolve()}" + (f" (through the link {ckpt})" if ckpt.is_symlink() else "")

    def problem(self, run: str) -> str:
        """Why another process may be writing here ("" when none): the directory at --out is no longer
        the one locked, run.json names another run, or .lock another holder, or the checkpoints now go
        to a directory another run holds."""
        try:
            st = os.stat(self.out)
            if (st.st_dev, st.st_ino) != self.identity:
                return f"--out {self.out} is no longer the directory this run locked (moved or replaced)"
            holder = read_run_id(self.out)
            if holder != run:
                named = f"run {holder}" if holder else "no run"
                return f"{self.out / 'run.json'} now names {named} (this is run {run})"
            note = (self.out / ".lock").read_text().strip() if (self.out / ".lock").is_file() else self.note
            if note != self.note:
                return f"{self.out / '.lock'} now names {note!r} (this run is {self.note!r})"
        except (OSError, RunDirError) as e:
            return f"--out {self.out} cannot be read ({e})"
        try:
            self.lock_checkpoints(run)  # ckpt/ deleted: made again; now another run's: refused
            self.own_checkpoints(run)
        except RunDirError as e:
            return str(e)
        except OSError:  # (a full or read-only disk: the save says so)
            pass
        return ""

    def close(self) -> None:
        for name in ("ckpt_fd", "fd"):
            if getattr(self, name, None) is not None:
                os.close(getattr(self, name))  # the kernel releases the flock
                setattr(self, name, None)

    __del__ = close  # like a file object: a lock no one holds any more is released


OWNER = ".owner"  # in the checkpoint directory: {"run", "out"}, the run whose checkpoints it holds


def lock(out: Path) -> Lock:
    """Take the exclusive lock on --out, or fail with who holds it. Keep the returned Lock (referenced)
    for as long as the run trains."""
    out.mkdir(parents=True, exist_ok=True)
    return Lock(out)


def claim_on_every_rank(out: Path, fresh: bool, grid, log=print) -> tuple[Lock | None, str]:
    """Rank 0 locks --out and settles which run it holds (`lock`, `claim`), then locks and owns the
    directory its checkpoints go to; every rank learns the outcome (`grid`, a parallel.Grid, agrees), so a
    refused launch stops everywhere at once instead of leaving ranks waiting. Returns (rank 0's lock, the
    run's id)."""
    held, problem = None, ""
    if grid.rank == 0:
        try:
            held = lock(out)
            held.take(claim(out, fresh, log=log))
        except RunDirError as e:
            problem = str(e)
            if held is not None:
                held.close()
    raise_on_every_rank(grid, problem, "rank 0 could not claim --out (its error says why)")
    return held, read_run_id(out)


def raise_on_every_rank(grid, problem: str, elsewhere: str) -> None:
    """Raise rank 0's `problem` as a RunDirError on every rank (`elsewhere` on the others), or nothing."""
    if not grid.agree(not problem):
        raise RunDirError(problem or elsewhere)


def check_no_other_writer(lock, run: str, grid) -> None:
    """Before a save, on every rank: no other process writes in --out (rank 0 looks; `lock` is None elsewhere)."""
    problem = lock.problem(run) if lock else ""
    raise_on_every_rank(grid, problem and f"another process is writing in --out: {problem}; this run stops "
                        "without saving, so as not to mix two runs' files", "rank 0 found another writer in --out "
                        "(it says which)")


def say_lost_steps(out: str | Path, run: str, log=print) -> None:
    """A run that starts again at step 0 says how many steps of its last attempt had no checkpoint."""
    if lost := max((r["step"] for r in steps(out)), default=0):
        log(f"no checkpoint of run {run} to resume from: starting again at step 0 (the {lost} steps of its last "
            "attempt are lost; --ckpt-every N saves as it goes)")


# The files that make up a run, in the order --fresh moves them: run.json last.
RUN_FILES = ("ckpt", "metrics.jsonl", "report.html", "timeline.json", "run.json")
JOURNAL = ".fresh.json"


def claim(out: Path, fresh: bool, log=print) -> str:
    """Make --out hold one run and return its id (rank 0 only, under the lock). A new directory, or
    --fresh, starts a new run (--fresh first moves the previous one to previous/<its id>/); otherwise
    the run in run.json continues. Leftovers without a run.json are refused, not guessed at. A move
    that a kill interrupted is finished first."""
    try:
        if (out / JOURNAL).exists():
            finish_move(out, log, interrupted=True)
        old = read_run_id(out)
        leftovers = [p for p in (out / "ckpt", out / "metrics.jsonl") if p.exists()]
        if fresh and (old or leftovers):
            move_aside(out, old, log)
            old = None
        elif old is None and leftovers:
            raise RunDirError(f"--out {out} holds {', '.join(p.name for p in leftovers)} but no run.json (written "
                              "by an older version?); pass --fresh to move them aside, or choose another --out")
        if old is not None:
            return old
        run = secrets.token_hex(6)
        started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        replace_atomically(out / "run.json", json.dumps({"run": run, "started": started}) + "\n")
        return run
    except OSError as e:
        raise RunDirError(f"--out {out}: {problem_with(e)} ({getattr(e, 'filename', '') or out}); fix that and rerun "
                          "the same command") from None


def move_aside(out: Path, old: str | None, log=print) -> None:
    """--fresh: the previous run's files to previous/<its id>/ (a new name if that is taken), as one
    step: the journal is written first, so a kill at any point leaves a move the next run finishes."""
    name = old or f"unnamed-{time.strftime('%Y%m%d-%H%M%S')}"
    aside, n = out / "previous" / name, 1
    while aside.exists():  # never mix two runs in one folder
        n += 1
        aside = out / "previous" / f"{name}-{n}"
    files = [f for f in RUN_FILES if (out / f).exists()]
    replace_atomically(out / JOURNAL, json.dumps({"run": old, "to": str(aside.relative_to(out)), "files": files}))
    finish_move(out, log)


def finish_move(out: Path, log=print, interrupted: bool = False) -> None:
    """Carry out the journal: move each listed file that is still in place, then delete the journal.
    Safe to repeat from any point (a file already moved is not there any more)."""
    try:
        plan = json.loads((out / JOURNAL).read_text())
        aside, files = out / plan["to"], list(plan["files"])
    except (ValueError, KeyError, TypeError):
        raise RunDirError(f"{out / JOURNAL} is unreadable: a --fresh was interrupted; move the previous run's "
                          f"files ({', '.join(RUN_FILES)}) into {out / 'previous'}/ by hand and delete it") from None
    if interrupted:
        log(f"--fresh was interrupted while moving run {plan.get('run') or '(unnamed)'} aside: finishing the move "
            f"to {aside}; a new run starts here")
    aside.mkdir(parents=True, exist_ok=True)
    for f in files:
        if (out / f).exists() or (out / f).is_symlink():
            os.replace(out / f, aside / f)
    fsync_dir(aside)
    fsync_dir(out)
    (out / JOURNAL).unlink()
    if not interrupted:
        log(f"--fresh: moved the previous run's files to {aside}")


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
            try:
                replace_atomically(self.path, "".join(json.dumps(r) + "\n" for r in keep))
            except OSError as e:
                raise RunDirError(self.cannot_write(e)) from None

    def log(self, **row) -> None:
        """Append one line, whole or not at all: on a full disk the part that fit is cut off again (a
        torn line in the middle of the file would make it unreadable once more lines follow)."""
        if not self.enabled:
            return
        line = memoryview((json.dumps(row) + "\n").encode())
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:  # (--out made read-only, or its disk gone, mid-run)
            raise RunDirError(self.cannot_write(e)) from None
        try:
            size = os.lseek(fd, 0, os.SEEK_END)
            try:
                while line:
                    line = line[os.write(fd, line):]
            except OSError as e:
                os.ftruncate(fd, size)  # shrinking needs no space
                raise RunDirError(self.cannot_write(e)) from None
        finally:
            os.close(fd)

    def cannot_write(self, e: OSError) -> str:
        fix = "make room" if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) else "fix that"
        return (f"could not write {self.path} ({problem_with(e)}); {fix}, then rerun the same command: it "
                "continues from the last checkpoint")


def steps(out: str | Path) -> list[dict]:
    """The per-step rows of a run's metrics.jsonl, events (start, checkpoint, spike) left out: what a
    plot or a comparison of two runs reads."""
    return [r for r in Metrics(Path(out) / "metrics.jsonl", enabled=False, resume_step=0).rows()
            if "event" not in r]
