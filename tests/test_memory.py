"""The memory tier (support/memory.py): snapshots in host memory, a copy on a partner node, and a restart
that loses seconds. Four CPU processes play two nodes of two (--gpus-per-node 2), each node with a
shared-memory directory of its own (--mem-ckpt-dir <tmp>/shm/node{node}): wiping one is losing a node.

Kills land at random steps (the seed is in the failure message). "Bitwise" is what it is for the disk
checkpoints: the losses of metrics.jsonl and the final weights equal an uninterrupted run's."""

import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TINY, final_weights, metrics, run_train
from test_checkpoint import trained_tiny
from test_stop import signal_at, start

import checkpoint
import parallel
from support import memory, storage
from support.storage import CheckpointError

FLAGS = ["--max-steps", "8", "--eval-every", "4", "--gpus-per-node", "2"]
MEM = ["--mem-ckpt-every", "2"]


def torchrun(corpus: dict, out: Path, *flags: str, nproc: int = 4, restarts: int = 0) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={restarts}", str(ROOT / "train.py"), "--data", corpus["data"], "--cache-dir",
           corpus["cache"], "--out", str(out), *TINY, *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def shm(tmp_path: Path) -> list[str]:
    return ["--mem-ckpt-dir", str(tmp_path / "shm" / "node{node}")]


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.exists() else []


def assert_bitwise(ref: Path, out: Path, seed=None) -> None:
    assert [r["loss"] for r in metrics(out)] == [r["loss"] for r in metrics(ref)], seed
    got, want = final_weights(out), final_weights(ref)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), seed


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    """4 ranks, never interrupted, without the tier: the run every other must equal."""
    out = tmp_path_factory.mktemp("straight")
    result = torchrun(corpus, out, *FLAGS)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_a_killed_rank_restarts_from_memory_bitwise(straight, corpus, tmp_path):
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    rank, step = rng.randrange(4), rng.randrange(3, 8)
    result = torchrun(corpus, tmp_path / "out", *FLAGS, *MEM, *shm(tmp_path), "--crash-at", f"rank:{rank}:step:{step}",
                      restarts=1)
    assert result.returncode == 0, (seed, result.stderr[-3000:])
    assert "exitcode: -9" in result.stderr, seed  # it was killed, and torchrun started it again
    assert f"resuming from memory (step {step - step % 2}, restored in " in result.stdout, (seed, result.stdout)
    assert_bitwise(straight, tmp_path / "out", seed)
    assert files_under(tmp_path / "shm") == []  # a finished run gives its memory back


@pytest.fixture(scope="module")
def killed(corpus, tmp_path_factory):
    """A run killed (no restart), its disk checkpoint at step 4 and snapshots every 2 steps: (its --out, its
    memory, the step it died after, the seed)."""
    seed = random.randrange(10**6)
    step = random.Random(seed).randrange(5, 8)
    tmp = tmp_path_factory.mktemp("killed")
    result = torchrun(corpus, tmp / "out", *FLAGS, *MEM, *shm(tmp), "--ckpt-every", "4", "--crash-at",
                      f"rank:1:step:{step}")
    assert result.returncode != 0, result.stderr[-3000:]
    return tmp / "out", tmp / "shm", step, seed


def copy_of(killed, tmp_path: Path) -> tuple[Path, Path]:
    """The killed run's --out and memory, copied: the memory under the copy's own name (a hash of --out)."""
    out, mem, _, _ = killed
    shutil.copytree(out, tmp_path / "out")
    shutil.copytree(mem, tmp_path / "shm")
    for node in (tmp_path / "shm").iterdir():
        (node / f"nanoscale-{memory.out_id(out)}").rename(node / f"nanoscale-{memory.out_id(tmp_path / 'out')}")
    return tmp_path / "out", tmp_path / "shm"


def test_a_lost_nodes_ranks_restore_from_their_partners_bitwise(straight, killed, corpus, tmp_path):
    out, mem = copy_of(killed, tmp_path)
    step, seed = killed[2:]
    shutil.rmtree(mem / "node1")  # node 1 was replaced: its memory is gone
    result = torchrun(corpus, out, *FLAGS, *MEM, *shm(tmp_path), "--ckpt-every", "4")
    assert result.returncode == 0, (seed, result.stderr[-3000:])
    line = f"resuming from memory (step {step - step % 2}, restored in "
    assert line in result.stdout and "; ranks 2, 3 from their partners on node 0)" in result.stdout, (seed,
                                                                                                       result.stdout)
    assert_bitwise(straight, out, seed)


def test_with_both_copies_of_a_rank_gone_the_disk_serves_bitwise(straight, killed, corpus, tmp_path):
    out, mem = copy_of(killed, tmp_path)
    seed = killed[3]
    shutil.rmtree(mem / "node1")  # rank 2's own copy, and its partner's:
    shutil.rmtree(next((mem / "node0").iterdir()) / "held-rank00002")
    result = torchrun(corpus, out, *FLAGS, *MEM, *shm(tmp_path), "--ckpt-every", "4")
    assert result.returncode == 0, (seed, result.stderr[-3000:])
    assert f"resuming from {out / 'ckpt' / 'step_00000004'} (step 4, restored in " in result.stdout, seed
    assert "s; memory could not serve: rank 2 has no snapshot, of its own or on its partner)" in result.stdout, seed
    assert_bitwise(straight, out, seed)


def test_a_snapshot_torn_by_a_kill_is_never_used(straight, corpus, tmp_path):
    """Rank 1 dies in the middle of its snapshot of step 6 (its data written, not its manifest): the
    others' snapshots of step 6 are whole, rank 1's is not, nor is its copy on rank 3; step 4 serves."""
    out, flags = tmp_path / "out", [*FLAGS, *MEM, *shm(tmp_path)]
    assert torchrun(corpus, out, *flags, "--crash-at", "rank:1:mem:6").returncode != 0
    torn = next((tmp_path / "shm" / "node0").iterdir()) / "rank00001" / ".tmp-step_00000006"
    assert (torn / "rank00001.safetensors").is_file() and not (torn / "manifest.json").exists()
    result = torchrun(corpus, out, *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from memory (step 4, restored in " in result.stdout, result.stdout
    assert_bitwise(straight, out)


def test_tensor_parallel_zero3_resumes_from_memory_bitwise(corpus, tmp_path):
    """Every tensor a rank holds comes back where it was: its tensor-parallel slices, ZeRO-3's flat pieces
    of the fp32 masters and moments (its weights are rebuilt from them); a node is a tensor-parallel pair."""
    flags = [*FLAGS, "--tp", "2", "--zero", "3"]
    assert torchrun(corpus, tmp_path / "straight", *flags).returncode == 0
    result = torchrun(corpus, tmp_path / "out", *flags, *MEM, *shm(tmp_path), "--crash-at", "rank:3:step:5",
                      restarts=1)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from memory (step 4, restored in " in result.stdout, result.stdout
    assert_bitwise(tmp_path / "straight", tmp_path / "out")


# ----------------------------------------------------------------------------- one process


def test_another_runs_snapshots_are_refused_and_a_finished_run_frees_its_own(corpus, tmp_path):
    flags = ["--max-steps", "6", "--eval-every", "6", *MEM, *shm(tmp_path)]
    assert run_train(corpus, tmp_path / "out", *flags, "--crash-at", "step:5", check=False).returncode == -9
    left = files_under(tmp_path / "shm")
    assert [p.name for p in left] == ["manifest.json", "rank00000.safetensors"] * 2  # steps 2 and 4
    fresh = run_train(corpus, tmp_path / "out", *flags, "--fresh")  # a new run in the same --out
    notes = [line for line in fresh.stdout.splitlines() if line.startswith("memory snapshot ")]
    assert len(notes) == 2 and all("is another run's" in n and ": not used, and deleted" in n for n in notes)
    assert "resuming" not in fresh.stdout
    assert files_under(tmp_path / "shm") == []


def test_a_stopped_run_saves_to_disk_and_frees_its_memory(corpus, tmp_path):
    proc = start(corpus, tmp_path / "out", "--max-steps", "300", "--eval-every", "100", *MEM, *shm(tmp_path))
    _, err = signal_at(proc, tmp_path / "out", random.randrange(5, 40), signal.SIGTERM)
    assert proc.returncode == 143, err[-2000:]
    assert (tmp_path / "out" / "ckpt" / "latest").exists() and files_under(tmp_path / "shm") == []


def test_the_memory_report_names_the_bytes(corpus, tmp_path):
    result = run_train(corpus, tmp_path / "out", "--max-steps", "2", *MEM, *shm(tmp_path), "--memory-report")
    line = next(ln for ln in result.stdout.splitlines() if "memory snapshots (--mem-ckpt-every 2):" in ln)
    own = int(line.split(": ")[1].split(" bytes")[0].replace(",", ""))
    assert own > 2_700_000 and f"({2 * own:,} bytes: the newest and the one being written)" in line


# ----------------------------------------------------------------------------- the tier, in one process


def tier(tmp_path: Path, run: str = "r1", said: list | None = None, crash_at: str = "") -> memory.Tier:
    """One process's tier (no partner), 10 MB a snapshot; the lines it says after opening go to `said`."""
    t = memory.Tier(2, str(tmp_path / "shm"), str(tmp_path / "out"), parallel.Grid(), run, 100, crash_at, print)
    t.open(10_000_000)
    t.log = print if said is None else said.append
    return t


def take(t: memory.Tier, step: int, model, opt) -> None:
    checkpoint.to_memory(t, step, lambda: {"step": step, "data": "position"}, model, opt)
    t.join()


def weights(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def killed_in_a_snapshot(tmp_path: Path, point: str) -> None:
    """(A child process) step 2's snapshot whole, then step 4's, killed at `point` of its writing."""
    model, opt = trained_tiny()
    t = tier(tmp_path, crash_at="mem:4" if point == "mem:4" else "")
    take(t, 2, model, opt)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # step 4's weights differ from step 2's
    calls, write, rename = [], storage.write_chunks, os.rename

    def cut(path, chunks):  # the n-th file: half of its bytes, then the kill
        calls.append(path)
        if point == f"file {len(calls)}":
            data = b"".join(bytes(c) for c in chunks)
            Path(path).write_bytes(data[:len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        return write(path, chunks)

    def renamed(a, b):
        if point == "rename":
            os.kill(os.getpid(), signal.SIGKILL)
        return rename(a, b)
    storage.write_chunks, os.rename = cut, renamed
    take(t, 4, model, opt)


@pytest.mark.parametrize("point", ["file 1", "mem:4", "file 2", "rename"],
                         ids=["mid-data", "data-not-manifest", "mid-manifest", "before-rename"])
def test_a_snapshot_killed_at_any_point_of_its_writing_is_never_read(point, tmp_path):
    child = multiprocessing.get_context("fork").Process(target=killed_in_a_snapshot, args=(tmp_path, point))
    child.start()
    child.join()
    assert child.exitcode == -signal.SIGKILL
    notes = []
    found = tier(tmp_path, said=notes).restore(-1)
    assert found is not None and found[2]["step"] == 2 and notes == []
    model, _ = trained_tiny()
    saved = found[0]
    assert all(torch.equal(saved[n], w) for n, w in weights(model).items())


def test_a_damaged_snapshot_is_refused_by_its_sha256_and_the_one_before_serves(tmp_path):
    model, opt = trained_tiny()
    t = tier(tmp_path)
    take(t, 2, model, opt)
    take(t, 4, model, opt)
    data = next((t.own / "step_00000004").glob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1
    data.write_bytes(bytes(raw))
    notes = []
    found = tier(tmp_path, said=notes).restore(-1)
    assert found[2]["step"] == 2
    assert len(notes) == 1 and notes[0].startswith("memory snapshot unusable: ") and "step_00000004" in notes[0]
    assert "does not match its sha256" in notes[0]


def test_another_runs_snapshot_is_refused_in_one_line_and_deleted(tmp_path):
    model, opt = trained_tiny()
    take(tier(tmp_path, run="r1"), 2, model, opt)
    notes = []
    assert tier(tmp_path, run="r2", said=notes).restore(-1) is None
    assert len(notes) == 1 and "is another run's (r1; this is r2): not used, and deleted" in notes[0]
    assert files_under(tmp_path / "shm") == []


def test_too_little_shared_memory_is_one_line_at_the_start_and_a_skip_later(tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "free_bytes", lambda path: 1_000_000)
    with pytest.raises(CheckpointError, match=r"has 1\.0 MB free, and one memory snapshot of node 0 needs 10\.0 MB "
                                              r"\(the state of its 1 rank\)"):
        tier(tmp_path)
    monkeypatch.undo()
    model, opt = trained_tiny()
    lines = []
    t = tier(tmp_path, said=lines)
    monkeypatch.setattr(memory, "free_bytes", lambda path: 1_000_000)
    take(t, 2, model, opt)
    assert lines[-1].startswith("step 2: memory snapshot skipped: rank 0: ") and "1.0 MB free" in lines[-1]
    assert files_under(t.own) == []


def test_newer_snapshots_than_the_step_the_run_goes_on_from_are_dropped_and_older_ones_pruned(tmp_path):
    """Bounded: a round keeps the newest whole snapshot before it and drops the rest (a replayed step's,
    newer: an abandoned attempt's); a resume forgets those after its step."""
    model, opt = trained_tiny()
    t = tier(tmp_path)
    for step in (2, 4, 6):
        take(t, step, model, opt)
    assert sorted(p.name for p in t.own.iterdir()) == ["step_00000004", "step_00000006"]
    t.forget_after(4)
    assert sorted(p.name for p in t.own.iterdir()) == ["step_00000004"]
    take(t, 6, model, opt)
    take(t, 2, model, opt)  # a rollback replays step 2: 4 and 6 are another attempt's
    assert sorted(p.name for p in t.own.iterdir()) == ["step_00000002"]


def a_rank_whose_write_fails(tmp_path: Path, rank: int, port: int, results) -> None:
    """(A child process: rank `rank` of 2, one a node.) Rank 0's snapshot cannot be written; both take one."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
    grid = parallel.Grid(dp=2, rank=rank, gpus_per_node=1)
    parallel.connect(grid, 60.0)  # were rank 1 to wait for rank 0's bytes, it would time out after this
    said = []
    t = memory.Tier(2, str(tmp_path / "node{node}"), str(tmp_path / "out"), grid, "r1", 100, "", said.append)
    t.open(10_000_000)
    if rank == 0:
        def full(job):
            raise OSError(28, "No space left on device")
        t.write_own = full
    model, opt = trained_tiny()
    take(t, 2, model, opt)
    error, held = t.error, sorted(p.name for p in t.held.iterdir())
    take(t, 4, model, opt)
    results.put((rank, error, held, said[1:]))
    parallel.shutdown()


def test_a_rank_whose_snapshot_fails_still_answers_its_partner(tmp_path):
    """Rank 0 cannot write its snapshot (a full /dev/shm): it still takes part in the exchange, sending
    nothing, so rank 1's round ends at once, with rank 0 holding rank 1's copy; rank 0's failure is said
    at the next round. (Before, rank 1 waited for bytes that never came, until --timeout.)"""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    ranks = [ctx.Process(target=a_rank_whose_write_fails, args=(tmp_path, r, port, results)) for r in range(2)]
    for p in ranks:
        p.start()
    try:
        got = dict((r, rest) for r, *rest in (results.get(timeout=300) for _ in ranks))
    finally:
        for p in ranks:
            p.join(timeout=60)
            if p.is_alive():  # (a rank that hangs: the test failed, and leaves nothing behind)
                p.kill()
    assert got[1][0] == "" and got[1][1] == []  # rank 1: done, and it holds nothing of rank 0's
    assert got[0][0] == "OSError: [Errno 28] No space left on device" and got[0][1] == ["step_00000002"]
    assert got[0][2] == ["memory snapshot of step 2 failed on rank 0: OSError: [Errno 28] No space left on device"]
