"""The run directory under abuse (rundir.py): an --out that cannot be written, a --fresh killed half way,
a lock file deleted under a live run, a disk that fills up while metrics.jsonl grows. Each is one line
and a clean state, never a traceback or two runs mixed in one folder.

A full disk is simulated with RLIMIT_FSIZE in the child (`ulimit -f`): a write past the limit stops
part way and the next fails (EFBIG, "File too large", where a full disk says ENOSPC), the same path
through the code as a disk that fills mid-line, and it needs no root and no special file system.
"""

import errno
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, run_train, train_command

import parallel
from support import rundir


def last_line(result) -> str:
    assert result.returncode != 0, result.stdout[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.stderr.strip().splitlines()[-1]


# ----------------------------------------------------------------------------- an --out that cannot be written


@pytest.mark.parametrize("out", ["/sys/nanoscale/run", "/sys", "name-too-long"])
def test_an_out_that_cannot_be_written_is_one_line_before_any_work(out, corpus, tmp_path):
    """Under a read-only parent, read-only itself (sysfs refuses even root), or a name over 255 bytes."""
    out = tmp_path / ("x" * 300) / "run" if out == "name-too-long" else Path(out)
    result = run_train(corpus, out, check=False)
    assert result.returncode == 2
    assert last_line(result).startswith(f"error: --out {out} cannot be written (")
    assert "choose another --out" in last_line(result) and "data:" not in result.stdout  # before any work


# ----------------------------------------------------------------------------- --fresh, killed at any point


def old_run(out: Path) -> dict[str, bytes]:
    """A run's files in `out` (run.json of run "old", a checkpoint, metrics, the page); {relative path: bytes}."""
    files = {"run.json": b'{"run": "old"}\n', "ckpt/step_00000002/rank00000.safetensors": b"weights",
             "ckpt/latest": b"step_00000002", "metrics.jsonl": b'{"step": 1, "loss": 5.0}\n',
             "report.html": b"<html>"}
    for name, content in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(content)
    return files


def contents(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def fresh_killed_at(out: Path, k: int) -> bool:
    """Run rundir.claim(out, fresh=True) in a forked child that SIGKILLs itself at its k-th file-system
    change (os.replace, os.unlink, os.mkdir). False when it finished before k changes."""
    pid = os.fork()
    if pid == 0:  # the child: count the changes, die at the k-th
        calls = [0]

        def die_at_k(fn):
            def wrapped(*args, **kwargs):
                calls[0] += 1
                if calls[0] == k:
                    os.kill(os.getpid(), signal.SIGKILL)
                return fn(*args, **kwargs)
            return wrapped
        for name in ("replace", "unlink", "mkdir"):
            setattr(os, name, die_at_k(getattr(os, name)))
        try:
            rundir.claim(out, fresh=True)
            os._exit(0)
        except BaseException:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert not (os.WIFEXITED(status) and os.WEXITSTATUS(status)), "claim failed in the child"
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def test_fresh_killed_at_any_point_never_mixes_or_loses_a_run(tmp_path, capsys):
    """A kill at each step of moving the old run aside, then the next run (the same command without
    --fresh): the old run is whole in one place, either still in --out (the kill came before the journal
    was written: --fresh never happened) or in previous/old/ with a new run in --out (the move is
    finished first, and said). Never half in each, never a file lost, and --fresh works afterwards."""
    k = 0
    while True:
        k += 1
        out = tmp_path / f"kill-{k}"
        out.mkdir()
        files = old_run(out)
        if not fresh_killed_at(out, k):
            break
        journal = (out / ".fresh.json").exists()
        capsys.readouterr()
        run = rundir.claim(out, fresh=False)  # the rerun
        said = capsys.readouterr().out
        assert not (out / ".fresh.json").exists()
        aside = out / "previous" / "old"
        if aside.exists():
            assert contents(aside) == files, k
            assert run != "old" and not (out / "ckpt").exists() and not (out / "metrics.jsonl").exists(), k
            assert ("--fresh was interrupted" in said) == journal, (k, said)
        else:
            assert run == "old" and not (out / "previous").exists(), k
            assert {n: c for n, c in contents(out).items() if n in files} == files, k
        rundir.claim(out, fresh=True)  # and a later --fresh just works
        moved = [p for p in (out / "previous").iterdir()]
        assert sum(contents(p) == files for p in moved) == 1, k
    assert k >= 9  # every change of a --fresh was a kill point: the journal, 2 folders, 4 moves, run.json


# ----------------------------------------------------------------------------- the lock


def test_deleting_the_lock_file_lets_no_second_run_in_and_a_foreign_writer_stops_the_first(corpus, tmp_path):
    """The lock is on the directory, so deleting .lock changes nothing; a process that ignores the lock
    and takes run.json over (as an old version's --fresh would) is noticed before the next save."""
    first = subprocess.Popen(train_command(corpus, tmp_path, "--max-steps", "100000", "--eval-every", "100000",
                                           "--ckpt-every", "5"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ckpt" / "latest").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        (tmp_path / ".lock").unlink()
        second = run_train(corpus, tmp_path, check=False)
        assert f"--out {tmp_path} is in use by another process" in last_line(second)
        (tmp_path / "run.json").write_text(json.dumps({"run": "intruder"}))
        saved = set((tmp_path / "ckpt").glob("step_*"))
        _, err = first.communicate(timeout=120)
    finally:
        first.kill()
        first.wait()
    assert first.returncode == 2, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: another process is writing in --out: ") and "now names run intruder" in line
    # a save that had checked before the takeover may finish; none starts after it
    assert len(set((tmp_path / "ckpt").glob("step_*")) - saved) <= 1


def test_two_runs_whose_checkpoints_are_one_directory_through_a_link_are_refused(corpus, tmp_path):
    """Two --out whose ckpt/ is one directory (the second's a link to the first's): each run would move the
    other's checkpoint of the same step aside and point `latest` at its own, and the first could no longer
    resume. The directory the checkpoints go to is locked too, and remembers whose it is (.owner): the
    second run is one line and exit 2, while the first trains and after it has stopped, and the first
    resumes from its own checkpoints."""
    first_out, second_out = tmp_path / "first", tmp_path / "second"
    first = subprocess.Popen(train_command(corpus, first_out, "--max-steps", "100000", "--eval-every", "100000",
                                           "--ckpt-every", "2"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    second_out.mkdir()
    (second_out / "run.json").write_text(json.dumps({"run": "second"}))  # a run of its own, checkpoints elsewhere
    (second_out / "ckpt").symlink_to(first_out / "ckpt")
    try:
        while not (first_out / "ckpt" / "latest").exists():
            assert first.poll() is None, first.communicate()[1][-3000:]
            time.sleep(0.1)
        while_running = run_train(corpus, second_out, "--ckpt-every", "2", check=False)
        assert first.poll() is None  # (the first run still held its lock)
    finally:
        first.kill()
        first.wait()
    run = json.loads((first_out / "run.json").read_text())["run"]
    real = (first_out / "ckpt").resolve()
    assert while_running.returncode == 2
    assert last_line(while_running).startswith(f"error: --out {second_out}: its checkpoints go to {real} (through "
                                               f"the link {second_out / 'ckpt'}), which run {run} (--out ")
    after = run_train(corpus, second_out, "--ckpt-every", "2", check=False)
    assert after.returncode == 2
    assert f"which holds the checkpoints of run {run} (--out {first_out.resolve()})" in last_line(after)
    assert not list(real.glob("*moved-aside*"))
    step = int((real / "latest").read_text().removeprefix("step_"))
    resumed = run_train(corpus, first_out, "--max-steps", str(step + 1), "--ckpt-every", "2")
    assert f"(step {step})" in resumed.stdout
    assert run_train(corpus, second_out, "--max-steps", "2", "--fresh").returncode == 0  # --fresh sets the link aside
    assert not (second_out / "ckpt").is_symlink() and (second_out / "previous").is_dir()


# ----------------------------------------------------------------------------- a full disk


def file_size_limit(limit: int):
    """preexec_fn: files this process writes stop growing at `limit` bytes (SIGXFSZ ignored: the write
    fails with EFBIG instead of killing the process)."""
    def limit_it():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return limit_it


def test_a_full_disk_while_appending_metrics_is_one_line_and_no_half_line(corpus, tmp_path):
    run_train(corpus, tmp_path, "--max-steps", "2")  # prepares the data too: the limited runs write no shards
    flags = ["--max-steps", "1000", "--eval-every", "1000", "--stats-every", "0"]
    limit = (tmp_path / "metrics.jsonl").stat().st_size + 3000  # ~15 more steps' lines
    full = run_train(corpus, tmp_path, *flags, check=False, preexec_fn=file_size_limit(limit))
    metrics = tmp_path / "metrics.jsonl"
    assert last_line(full) == f"error: could not write {metrics} (File too large); make room, then rerun the same " \
                              "command: it continues from the last checkpoint"
    text = metrics.read_text()
    assert text.endswith("\n") and len(text) <= limit
    assert [json.loads(line)["step"] for line in text.splitlines() if '"loss"' in line][-1] > 5
    still_full = run_train(corpus, tmp_path, *flags, check=False, preexec_fn=file_size_limit(200))
    assert last_line(still_full).startswith(f"error: could not write {metrics} (File too large)")
    assert metrics.read_text() == text  # the start-up rewrite (drop steps after the checkpoint) left it whole


def test_metrics_log_cuts_a_partly_written_line(tmp_path):
    """In process, the unit under the test above: the part of a line that fit is cut off again."""
    path = tmp_path / "metrics.jsonl"
    code = (f"import sys, resource, signal; sys.path.insert(0, {str(ROOT)!r}); from support import rundir\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            f"m = rundir.Metrics(__import__('pathlib').Path({str(path)!r}), True, 0)\n"
            "m.log(step=1, loss=1.0)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (60, 60))\n"
            "try:\n    m.log(step=2, note='x' * 100)\nexcept rundir.RunDirError as e:\n    print(e)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.startswith(f"could not write {path} (File too large)"), result.stderr
    assert path.read_text() == '{"step": 1, "loss": 1.0}\n'


def test_a_save_that_fills_the_disk_leaves_no_temporary_directory(corpus, tmp_path):
    """A checkpoint that does not fit: one line, and the half-written .tmp-step_N/ is removed, not left
    taking the space the rerun needs."""
    run_train(corpus, tmp_path, "--max-steps", "2")  # prepares the data too: the limited run writes no shards
    limit = (tmp_path / "ckpt" / "step_00000002" / "rank00000.safetensors").stat().st_size // 2
    full = run_train(corpus, tmp_path, "--max-steps", "4", check=False, preexec_fn=file_size_limit(limit))
    assert last_line(full).startswith(f"error: could not write the checkpoint of step 4 in {tmp_path / 'ckpt'}: "
                                      "File too large")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [".owner", "latest", "step_00000002"]


def test_a_rerun_on_a_full_disk_first_removes_what_a_failed_save_left(tmp_path, monkeypatch, capsys):
    """A save killed half way (or cut off by a full disk before this version) left .tmp-step_N/, and the
    disk is full while it is there: the rerun clears it before it writes anything (.lock first), so it
    starts instead of failing on .lock with "No space left on device". A stand-in for the file writes
    of storage.py is the disk: full while a leftover is in ckpt/."""
    from support import storage

    out = tmp_path / "out"
    (out / "ckpt" / ".tmp-step_00000006").mkdir(parents=True)
    (out / "ckpt" / ".tmp-step_00000006" / "rank00000.safetensors").write_bytes(b"half a checkpoint")
    (out / "ckpt" / ".del-step_00000002").mkdir()  # a cleanup killed half way
    (out / "run.json").write_text(json.dumps({"run": "mine"}))
    write = storage.write_chunks

    def disk(path, chunks):
        if list((out / "ckpt").glob(".tmp-step_*")):
            raise OSError(28, "No space left on device", str(path))
        return write(path, chunks)
    monkeypatch.setattr(storage, "write_chunks", disk)
    held, run = rundir.claim_on_every_rank(out, False, parallel.Grid())
    assert run == "mine" and (out / ".lock").read_text() == held.note
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == [".owner"]
    held.close()


# ----------------------------------------------------------------------------- --out made read-only mid-run


def test_an_out_made_read_only_mid_run_is_one_line(tmp_path, monkeypatch):
    """--out remounted read-only while the run trains: the next line of metrics.jsonl cannot even be opened.
    One line (a RunDirError, which train.py says and exits 2 on), not a traceback. (Root writes through any
    permission, so a stand-in for os.open refuses as a read-only file system does.)"""
    m = rundir.Metrics(tmp_path / "metrics.jsonl", True, 0)
    m.log(step=1, loss=1.0)
    opened = os.open

    def read_only(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return opened(path, flags, *args, **kwargs)
    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(rundir.RunDirError) as e:
        m.log(step=2, loss=1.0)
    monkeypatch.undo()
    assert str(e.value) == f"could not write {tmp_path / 'metrics.jsonl'} (Read-only file system); fix that, then " \
                           "rerun the same command: it continues from the last checkpoint"
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'
