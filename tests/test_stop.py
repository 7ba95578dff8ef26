"""Ctrl-C and SIGTERM keep the run (interrupt.py): the run stops after a step, saves it, says so in one
line and exits 128 + the signal; the same command then resumes, and the run ends bitwise where one
never interrupted ends. Under torchrun, however the signal reaches the ranks, they stop at one step.

The signals land at random steps (the seed is in the failure message): a stop must work wherever it
falls, not at a step a test was tuned to.
"""

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, final_weights, metrics, run_train, train_command

from support import storage

LONG = ["--max-steps", "300", "--eval-every", "100"]  # ~15 ms a step: time to signal in the middle


def start(corpus: dict, out: Path, *flags: str, nproc: int = 1) -> subprocess.Popen:
    return subprocess.Popen(train_command(corpus, out, *flags, nproc=nproc), cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})


def progress(out: Path) -> tuple[int, int]:
    """(attempts, step): the start and resume events in metrics.jsonl, and the last step logged after the
    last of them (how far the latest process got)."""
    path, attempts, step = out / "metrics.jsonl", 0, 0
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except ValueError:  # the line being written
            continue
        if row.get("event") in ("start", "resume"):
            attempts, step = attempts + 1, 0
        elif "event" not in row:
            step = row["step"]
    return attempts, step


def wait_for(proc: subprocess.Popen, out: Path, attempt: int, step: int) -> None:
    """Until attempt number `attempt` has logged `step`."""
    deadline = time.monotonic() + 180
    while progress(out) < (attempt, step):
        assert proc.poll() is None and time.monotonic() < deadline, f"never reached step {step}"
        time.sleep(0.02)


def signal_at(proc: subprocess.Popen, out: Path, step: int, sig: int, to_rank: int | None = None) -> tuple[str, str]:
    """Send `sig` to the process (or under torchrun to worker `to_rank` alone) once the attempt it started
    has logged `step`; return its stdout and stderr."""
    wait_for(proc, out, progress(out)[0] + 1, step)
    os.kill(proc.pid if to_rank is None else workers(proc.pid)[to_rank], sig)
    return proc.communicate(timeout=120)


def stopped_step(err: str, out: Path, sig: int) -> int:
    """The step of the one "stopped at step N by SIG..." line, checked against the checkpoint `latest` names."""
    lines = re.findall(rf"^stopped at step (\d+) by {signal.Signals(sig).name}; checkpoint saved; rerun the same "
                       "command to continue$", err, re.M)
    assert len(lines) == 1, err[-3000:]
    step = int(lines[0])
    assert (out / "ckpt" / "latest").read_text() == f"step_{step:08d}"
    return step


def test_sigint_and_sigterm_stop_at_a_step_save_it_and_the_rerun_ends_bitwise_like_a_straight_run(corpus, tmp_path):
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    ref, out = tmp_path / "straight", tmp_path / "stopped"
    run_train(corpus, ref, *LONG)
    done = 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        at = done + rng.randrange(5, 100)
        proc = start(corpus, out, *LONG)
        stdout, err = signal_at(proc, out, at, sig)
        assert proc.returncode == 128 + sig, (seed, err[-3000:])
        assert "Traceback" not in err, (seed, err[-3000:])
        if done:
            assert f"resuming from {out / 'ckpt' / f'step_{done:08d}'} (step {done})" in stdout, seed
        step = stopped_step(err, out, sig)
        assert step >= at, seed
        stop_events = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if '"stop"' in ln]
        assert stop_events[-1] == {"event": "stop", "signal": signal.Signals(sig).name, "step": step}
        done = step
    final = run_train(corpus, out, *LONG)
    assert f"(step {done})" in final.stdout, seed
    assert [r["loss"] for r in metrics(out)] == [r["loss"] for r in metrics(ref)], seed
    got, want = final_weights(out), final_weights(ref)
    assert all(torch.equal(got[k], want[k]) for k in want), seed
    again = run_train(corpus, out, *LONG)  # a finished run: nothing to do, and how to start another
    assert "nothing left to do" in again.stdout and "--fresh starts a new one" in again.stdout


def test_a_second_ctrl_c_exits_at_once_and_keeps_the_last_checkpoint(corpus, tmp_path):
    """The first Ctrl-C lands during a long sample (100,000 tokens at step 3): the run would stop after it.
    The second, a few seconds later, exits now, without a save; the checkpoint of step 2 stays whole."""
    proc = start(corpus, tmp_path, "--max-steps", "50", "--ckpt-every", "1", "--eval-every", "3",
                 "--sample-tokens", "100000")
    wait_for(proc, tmp_path, 1, 2)
    time.sleep(1.0)  # step 3 is sampling now
    proc.send_signal(signal.SIGINT)
    time.sleep(2.0)  # more than interrupt.REPEAT_S: a second Ctrl-C, not the first one delivered twice
    assert proc.poll() is None  # the first one waits for the step to end
    proc.send_signal(signal.SIGINT)
    second = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - second < 15 and proc.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1] == "SIGINT again: exiting now, without saving (the last complete checkpoint " \
                                           "is kept)"
    assert (tmp_path / "ckpt" / "latest").read_text() == "step_00000002"
    storage.verify(tmp_path / "ckpt" / "step_00000002")


def workers(launcher: int) -> dict[int, int]:
    """{rank: pid} of the processes torchrun (pid `launcher`) started."""
    children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    ranks = {}
    for pid in map(int, children):
        env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
        ranks[int(env["RANK"])] = pid
    return ranks


def test_under_torchrun_the_ranks_agree_on_the_step_they_stop_at(corpus, tmp_path):
    """SIGTERM to torchrun (it passes it on to each worker in turn), then SIGINT to rank 1 alone: either
    way both ranks stop after the same step and save it, and the run resumes bitwise."""
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    ref, out = tmp_path / "straight", tmp_path / "stopped"
    run_train(corpus, ref, *LONG, nproc=2)
    done = 0
    for sig, to_rank_1 in ((signal.SIGTERM, False), (signal.SIGINT, True)):
        at = done + rng.randrange(5, 100)
        proc = start(corpus, out, *LONG, nproc=2)
        stdout, err = signal_at(proc, out, at, sig, to_rank=1 if to_rank_1 else None)
        assert proc.returncode != 0, (seed, err[-3000:])
        assert 'train.py", line' not in err, (seed, err[-3000:])  # torchrun's own traceback only
        step = stopped_step(err, out, sig)
        manifest = storage.verify(out / "ckpt" / f"step_{step:08d}")
        assert manifest["layout"]["dp"] == 2 and len(manifest["files"]) == 2 and manifest["step"] == step
        if to_rank_1:  # the workers exited 130; torchrun's summary says so, with the line as the cause
            assert "exitcode  : 130" in err and "traceback : stopped at step" in err, err[-3000:]
        done = step
    final = run_train(corpus, out, *LONG, nproc=2)
    assert f"(step {done})" in final.stdout, seed
    assert [r["loss"] for r in metrics(out)] == [r["loss"] for r in metrics(ref)], seed
    got, want = final_weights(out), final_weights(ref)
    assert all(torch.equal(got[k], want[k]) for k in want), seed


# ----------------------------------------------------------------------------- before main, and after the stop


def loading(pid: int, library: str) -> bool:
    """Has process `pid` mapped a shared library whose path holds `library` (its import of it has begun)?"""
    try:
        return library in Path(f"/proc/{pid}/maps").read_text()
    except OSError:  # gone
        return False


STARTING = "stopped by SIGINT while starting, before any work; nothing to save"


@pytest.mark.parametrize("program,library", [("train.py", "/torch/"), ("sample.py", "/torch/"),
                                             ("data.py", "/numpy/")])
def test_ctrl_c_while_a_program_imports_is_one_line(program, library, corpus, tmp_path):
    """Ctrl-C in the first seconds, while the imports load (torch takes seconds; before main() installs
    its handler) was a KeyboardInterrupt traceback, from every rank under torchrun. Now: one line, exit 130.
    The signal is sent the moment the process has begun to load `library` (read from /proc, no sleep); if
    it landed after the imports after all (the line says so: another line), the test runs again."""
    args = {"train.py": ["--data", corpus["data"], "--cache-dir", corpus["cache"], "--out", str(tmp_path)],
            "sample.py": ["--ckpt", str(tmp_path), "--device", "cpu"],
            "data.py": ["--data", corpus["data"], "--cache-dir", str(tmp_path / "cache"), "--tokenizer", "byte"]}
    for _ in range(20):
        proc = subprocess.Popen([sys.executable, program, *args[program]], cwd=ROOT, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        while proc.poll() is None and not loading(proc.pid, library):
            pass
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=300)
        if STARTING in err or "Traceback" in err:  # it landed during the imports
            break
    assert "Traceback" not in err, err[-3000:]
    assert proc.returncode == 130 and err.splitlines() == [STARTING], err[-3000:]


def test_a_second_ctrl_c_after_the_stop_is_complete_still_exits_130(corpus, tmp_path):
    """Once the stop's checkpoint is complete and its line said, the process leaves. Ctrl-C pressed again then
    (here: every few milliseconds until it is gone) landed in the interpreter's teardown, after Python had put
    the default handlers back: the process died by the signal (-2), not with the promised 130."""
    proc = start(corpus, tmp_path, *LONG)
    wait_for(proc, tmp_path, 1, 5)
    proc.send_signal(signal.SIGINT)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr))
    reader.start()
    while proc.poll() is None and not any(line.startswith("stopped at step") for line in lines):
        pass
    while proc.poll() is None:  # the same key, again and again, until the process is gone
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
        time.sleep(0.002)
    reader.join()
    proc.stdout.close()
    err = "".join(lines)
    assert proc.returncode == 130, (proc.returncode, err[-2000:])
    step = stopped_step(err, tmp_path, signal.SIGINT)
    storage.verify(tmp_path / "ckpt" / f"step_{step:08d}")
