"""checkpoint.py and the guards: a run can die at any instant and continue as if it had not."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import setup_memory
import torch
from conftest import ROOT, TINY, final_weights, metrics, run_train

import checkpoint

RUN = ["--max-steps", "8", "--ckpt-every", "2", "--eval-every", "4"]


def losses(out):
    return [(r["step"], r["loss"]) for r in metrics(out)]


def assert_bitwise_same(a, b):
    assert losses(a) == losses(b)
    wa, wb = final_weights(a), final_weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_sigkill_and_resume_is_bitwise_identical(precision, corpus, tmp_path):
    flags = [*RUN, "--precision", precision] + (["--loss-scale", str(2.0**20)] if precision == "fp16" else [])
    run_train(corpus, tmp_path / "straight", *flags)
    killed = run_train(corpus, tmp_path / "killed", *flags, "--crash-at", "step:5", check=False)
    assert killed.returncode == -9  # SIGKILL: no chance to clean up
    resumed = run_train(corpus, tmp_path / "killed", *flags)
    assert "resuming from" in resumed.stdout and "step_00000004" in resumed.stdout
    assert_bitwise_same(tmp_path / "straight", tmp_path / "killed")
    if precision == "fp16":  # the scaler's state came back too: it had backed off before the kill
        assert metrics(tmp_path / "killed")[-1]["loss_scale"] < 2.0**20


def test_kill_in_the_middle_of_a_save_leaves_the_previous_checkpoint(corpus, tmp_path):
    run_train(corpus, tmp_path / "straight", *RUN)
    killed = run_train(corpus, tmp_path / "run", *RUN, "--crash-at", "save:6", check=False)
    assert killed.returncode == -9
    ckpt = tmp_path / "run" / "ckpt"
    assert (ckpt / ".tmp-step_00000006").exists()  # the half-written one, never renamed into place
    assert (ckpt / "latest").read_text() == "step_00000004"
    assert checkpoint.latest(ckpt).name == "step_00000004"
    resumed = run_train(corpus, tmp_path / "run", *RUN)
    assert "(step 4)" in resumed.stdout
    assert_bitwise_same(tmp_path / "straight", tmp_path / "run")


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_latest_checkpoint_falls_back_to_the_previous(damage, corpus, tmp_path):
    run_train(corpus, tmp_path, *RUN, "--max-steps", "6", "--keep", "3")
    victim = tmp_path / "ckpt" / "step_00000006" / "rank00000.safetensors"
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        data = data[: len(data) // 2]
    victim.write_bytes(bytes(data))
    messages = []
    assert checkpoint.latest(tmp_path / "ckpt", log=messages.append).name == "step_00000004"
    assert "rank00000.safetensors" in messages[0] and ("sha256" in messages[0] or "truncated" in messages[0])
    resumed = run_train(corpus, tmp_path, *RUN, "--max-steps", "8", "--keep", "3")
    assert "(step 4)" in resumed.stdout
    unusable = next(line for line in resumed.stdout.splitlines() if "checkpoint unusable" in line)
    assert "rank00000.safetensors" in unusable and ("sha256" in unusable or "truncated" in unusable), unusable


def test_incompatible_checkpoint_is_refused(corpus, tmp_path):
    run_train(corpus, tmp_path, *RUN, "--max-steps", "2")
    result = run_train(corpus, tmp_path, *RUN, "--batch-size", "16", check=False)
    assert result.returncode == 2
    assert "incompatible run (batch_size: checkpoint has 8, this run has 16)" in result.stderr
    assert run_train(corpus, tmp_path, *RUN, "--max-steps", "2", "--batch-size", "16", "--fresh").returncode == 0


def test_keep_removes_only_older_complete_checkpoints(corpus, tmp_path):
    run_train(corpus, tmp_path, *RUN, "--keep", "2")
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == ["step_00000006", "step_00000008"]


def test_cleanup_counts_and_deletes_only_this_runs_own_checkpoints(corpus, tmp_path):
    run_train(corpus, tmp_path / "other", *RUN, "--max-steps", "2")  # another run's checkpoint, to copy in
    run, ckpt = tmp_path / "run", tmp_path / "run" / "ckpt"
    run_train(corpus, run, *RUN, "--max-steps", "4", "--keep", "2")
    foreign = tmp_path / "other" / "ckpt" / "step_00000002"
    shutil.copytree(foreign, ckpt / "step_00000099")  # newer than anything of this run
    shutil.copytree(foreign, ckpt / "step_00000006")  # where this run will save its step 6
    shutil.copytree(ckpt / "step_00000004", ckpt / "step_00000004.bak")  # a user's backup
    resumed = run_train(corpus, run, *RUN, "--max-steps", "8", "--keep", "2")
    assert "(step 4)" in resumed.stdout

    def run_of(path):
        return json.loads((path / "manifest.json").read_text())["run"]
    mine = json.loads((run / "run.json").read_text())["run"]
    assert sorted(p.name for p in ckpt.glob("step_*") if run_of(p) == mine and ".bak" not in p.name) == \
        ["step_00000006", "step_00000008"]  # --keep 2 of this run's own
    for copy in [ckpt / "step_00000099", *ckpt.glob("step_00000006.moved-aside-*")]:  # untouched, not deleted
        assert sorted(f.read_bytes() for f in copy.iterdir()) == sorted(f.read_bytes() for f in foreign.iterdir())
    assert len(list(ckpt.glob("step_00000006.moved-aside-*"))) == 1 and (ckpt / "step_00000004.bak").is_dir()

    victim = ckpt / "step_00000008" / "rank00000.safetensors"  # and the run can still fall back
    victim.write_bytes(victim.read_bytes()[:-8])
    fallen = run_train(corpus, run, *RUN, "--max-steps", "10", "--keep", "2")
    assert "written by another run" in fallen.stdout and "resuming from" in fallen.stdout
    assert "(step 6)" in fallen.stdout


def test_async_saves_write_the_same_checkpoints(corpus, tmp_path):
    run_train(corpus, tmp_path / "sync", *RUN)
    run_train(corpus, tmp_path / "async", *RUN, "--async-ckpt")
    assert_bitwise_same(tmp_path / "sync", tmp_path / "async")


def test_inspect_prints_the_manifest(corpus, tmp_path):
    run_train(corpus, tmp_path, *RUN, "--max-steps", "2")
    out = subprocess.run([sys.executable, "-m", "instruments.checkpoints", "inspect", str(tmp_path / "ckpt")],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "step 2" in out and "all 1 files verified" in out
    assert "transformer.h.3.mlp.c_fc.weight" in out and "(256, 64)" in out
    manifest = json.loads((tmp_path / "ckpt" / "step_00000002" / "manifest.json").read_text())
    assert manifest["meta"]["tokenizer"] == "byte:v1"
    assert {e["name"] for e in manifest["tensors"]} >= {"transformer.wte.weight", "transformer.wte.weight::exp_avg"}


def test_spike_guard_rolls_back_and_skips_the_poisoned_batch(corpus, tmp_path):
    flags = ["--max-steps", "30", "--lr", "3e-3", "--ckpt-every", "5", "--eval-every", "30", "--poison-step", "24"]
    guarded = run_train(corpus, tmp_path / "on", *flags, "--spike-z", "4", "--spike-window", "5")
    assert "step 25: loss" in guarded.stdout and "is a spike; rolled back to step 20" in guarded.stdout
    events = [json.loads(line) for line in (tmp_path / "on" / "metrics.jsonl").read_text().splitlines()]
    spike = [e for e in events if e.get("event") == "spike"]
    assert len(spike) == 1 and spike[0]["rolled_back_to"] == 20 and spike[0]["batch"] == 24
    on = metrics(tmp_path / "on")
    assert [r["step"] for r in on] == list(range(1, 31))
    assert [r["batch"] for r in on][20:25] == [20, 21, 22, 23, 25]  # batch 24 was never trained on

    unguarded = run_train(corpus, tmp_path / "off", *flags)  # the same run without the guard
    assert "spike" not in unguarded.stdout
    off = metrics(tmp_path / "off")
    assert off[24]["loss"] > 1.5 * off[23]["loss"]  # the poisoned batch is a spike, and is trained on
    assert [r["loss"] for r in on[:24]] == [r["loss"] for r in off[:24]]  # replayed steps 21-24 exactly
    assert max(r["loss"] for r in on[24:]) < 1.2 * on[23]["loss"]


# ----------------------------------------------------------------------------- what a save costs the loop


def trained_tiny():
    """The tiny model after one step of fused AdamW (whose step counts are tensors, one per parameter)."""
    import model as gpt
    import train
    from config import TrainConfig

    m = gpt.build(gpt.config_from_preset("tiny", 257), seed=0)
    opt = train.make_optimizer(m, TrainConfig())
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return m, opt


def saver(tmp_path, asynchronous):
    import parallel
    from support import writer
    return writer.Saver(tmp_path / "ckpt", keep=5, asynchronous=asynchronous, grid=parallel.Grid(), run="r")


def save(s, step, model, opt, **kwargs) -> bool:
    """What train.save hands the Saver: this rank's tensors and the optimizer's update count."""
    return s.save(step, checkpoint.tensor_entries(model, opt, s.grid), checkpoint.optimizer_steps(opt), **kwargs)


def test_every_byte_is_hashed_once_on_its_way_to_the_disk(tmp_path, monkeypatch):
    """A save hashes each byte it writes once, as it writes it, and reads nothing back: the bytes that
    pass through sha256 are the bytes of the files it leaves, and the manifest's canonical text, which
    its seal hashes (before: every file twice, read back after its fsync)."""
    import hashlib
    from types import SimpleNamespace

    from support import storage

    hashed, sha256 = [], hashlib.sha256

    class Counting:
        def __init__(self, data=b""):
            self.h = sha256(data)
            hashed.append(len(data))

        def update(self, data):
            hashed.append(len(data))
            self.h.update(data)

        def hexdigest(self):
            return self.h.hexdigest()

    monkeypatch.setattr(storage, "hashlib", SimpleNamespace(sha256=Counting))  # storage.py's hashing only
    m, opt = trained_tiny()
    save(saver(tmp_path, asynchronous=False), 1, m, opt, extra={}, meta={})
    monkeypatch.undo()
    written = sum(f.stat().st_size for f in (tmp_path / "ckpt").rglob("*") if f.is_file())
    manifest = storage.verify(tmp_path / "ckpt" / "step_00000001")  # what it hashed is what is there
    seal = len(storage._canonical({k: v for k, v in manifest.items() if k != "sha256"}))  # the manifest's own hash
    assert sum(hashed) == written + seal, (sum(hashed), written, seal)


def test_a_save_reads_nothing_from_the_device_before_the_loop_goes_on(tmp_path):
    """On a GPU each read of a tensor's value by the host waits for everything queued before it. A save
    reads none: the optimizer's step count (one tensor per parameter in fused AdamW) travels with the
    copies and is read by the writer (a stand-in counts the host's reads in the loop's thread)."""
    from test_train import HostReads

    m, opt = trained_tiny()
    s = saver(tmp_path, asynchronous=True)
    with HostReads() as host:
        save(s, 1, m, opt, extra={"step": 1}, meta={})
    s.wait()
    assert [host.calls[i] for i in host.reads] == []  # before: int() of every parameter's step count
    path = tmp_path / "ckpt" / "step_00000001"
    assert checkpoint.pin(path).rank_state(0)["extra"]["opt_step"] == 1


def test_a_save_that_finds_the_last_one_still_writing_is_skipped_not_waited_for(tmp_path, monkeypatch):
    """--async-ckpt with a disk slower than the saves: the periodic save that comes while the previous
    one is still being written is skipped at once (the loop does not wait); the final save waits for it,
    then writes. (The writer here is held until a timer lets it go, so a save that waited would still
    return, just later, and write its checkpoint.)"""
    import threading

    from support import storage

    release, write = threading.Event(), storage.write_safetensors

    def slow_write(*args, **kwargs):
        release.wait()
        return write(*args, **kwargs)

    monkeypatch.setattr(storage, "write_safetensors", slow_write)
    m, opt = trained_tiny()
    s = saver(tmp_path, asynchronous=True)
    assert save(s, 2, m, opt, extra={}, meta={}, skippable=True)
    threading.Timer(2.0, release.set).start()
    assert not save(s, 4, m, opt, extra={}, meta={}, skippable=True)  # step 2's write is still held
    assert not release.is_set() and s.writing == 2
    assert save(s, 6, m, opt, extra={}, meta={})  # the final save: waits for step 2's, then writes
    s.wait()
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000002", "step_00000006"]
    assert (ckpt / "latest").read_text() == "step_00000006"


# ----------------------------------------------------------------------------- what a resume costs a rank


def test_a_zero3_resume_reads_checks_and_holds_only_each_ranks_share(corpus, tmp_path):
    """Resuming --zero 3 at dp 4 (tests/resume_memory.py follows each rank): a rank maps only the files
    that hold its part (its own, and rank 0's for the run state), hashes each of those once, whole, and
    allocates during the load at most its own optimizer state (12 bytes per parameter / dp) and 64 KiB:
    its pieces are views of the mapped files. Before: every rank mapped and hashed every file of the
    world, and held every parameter's slice and its three fp32 moments whole (16 bytes per parameter)."""
    flags = ["--zero", "3", "--n-layer", "8", "--ckpt-every", "0", "--eval-every", "100"]
    run_train(corpus, tmp_path, *flags, "--max-steps", "2", nproc=4)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           str(ROOT / "tests" / "resume_memory.py"), *TINY, "--data", corpus["data"], "--cache-dir", corpus["cache"],
           "--out", str(tmp_path), *flags]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = setup_memory.rank_lines(result.stdout)
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2, 3]
    for r in ranks:
        assert r["step"] == 2 and len(r["sizes"]) == 4
        assert r["hashed"] == r["mapped"] == {name: r["sizes"][name] for name in r["mapped"]}, r
        assert set(r["mapped"]) <= {"rank00000.safetensors", f"rank{r['rank']:05d}.safetensors"}, r
        assert r["peak"] <= r["state"] + 64 * 2**10, f"rank {r['rank']}: {r['peak']:,} bytes at the peak: {r}"


def test_the_background_writer_computes_on_the_runs_gpu(tmp_path, monkeypatch):
    """A new thread's current GPU is GPU 0, whatever its process chose: the writer's first CUDA call
    (waiting for the copy to the host) would make a context on GPU 0 for every rank (~0.5 GB each). So
    the writer thread sets the run's device first. Here a rank on GPU 1, on a CPU: the copy and the RNG
    states are stand-ins, and a recorder stands in for torch.cuda.set_device (tests/test_gpu.py checks
    the thread's device on a GPU)."""
    import threading

    from support import writer

    set_to = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: set_to.append((d, threading.current_thread().name)))
    monkeypatch.setattr(writer, "rng_state", lambda device: {})
    monkeypatch.setattr(writer.Saver, "_to_host", lambda self, tensors: {k: t.clone() for k, t in tensors.items()})
    m, opt = trained_tiny()
    s = saver(tmp_path, asynchronous=True)
    s.grid.device = torch.device("cuda", 1)
    assert save(s, 1, m, opt, extra={}, meta={})
    s.wait()
    assert set_to == [(torch.device("cuda", 1), "ckpt-writer")]
    assert (tmp_path / "ckpt" / "latest").read_text() == "step_00000001"


def check_writer_device(out: str) -> None:
    """An asynchronous save on the run's GPU (GPU 1 where there are two, as LOCAL_RANK 1's; else GPU 0): the
    writer thread computes on that GPU. A new thread starts on GPU 0, and its first CUDA call (the wait for
    the copy to the host) used to create a context there: ~0.5 GB of GPU 0 per rank (writer.use_device)."""
    import model as gpt
    import parallel
    from support import writer

    device = torch.device("cuda", min(torch.cuda.device_count(), 2) - 1)
    torch.cuda.set_device(device)  # what train.py does for its rank (support/devices.py)
    model = gpt.build(gpt.config_from_preset("tiny", 257), seed=0).to(device)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    saver = writer.Saver(Path(out) / "ckpt", keep=2, asynchronous=True, grid=parallel.Grid(device=device), run="r")
    seen, write = [], saver._write
    saver._write = lambda job: (seen.append(torch.cuda.current_device()), write(job))[1]
    saver.save(1, checkpoint.tensor_entries(model, opt, saver.grid), checkpoint.optimizer_steps(opt),
               extra={"step": 1}, meta={})
    saver.wait()
    assert seen == [device.index], f"the writer thread ran on GPU {seen}, the run on GPU {device.index}"
    assert (Path(out) / "ckpt" / "latest").read_text() == "step_00000001"


def test_a_damaged_file_that_only_one_rank_reads_sends_every_rank_back(corpus, tmp_path):
    """--zero 3 at dp 2: rank 1's file holds rank 1's shard, which only rank 1 reads on a resume at the
    same layout. Damaged, rank 1 finds it (its hash), says so, and every rank falls back together to the
    previous checkpoint: the one all-reduce of their verdicts, restore's."""
    flags = ["--zero", "3", "--ckpt-every", "1", "--eval-every", "100"]
    run_train(corpus, tmp_path, *flags, "--max-steps", "2", nproc=2)
    victim = tmp_path / "ckpt" / "step_00000002" / "rank00001.safetensors"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    resumed = run_train(corpus, tmp_path, *flags, "--max-steps", "3", nproc=2).stdout
    assert "rank 1: checkpoint unusable, trying an older one: " in resumed and "rank00001.safetensors" in resumed
    assert "resuming from" in resumed and "(step 1)" in resumed


def test_a_listing_that_a_saving_run_overtakes_is_taken_again(tmp_path, monkeypatch):
    """A reader lists ckpt/ while the run commits step 6 and deletes step 5 (--keep 1): the listing can
    name step_00000005 alone, gone by the time it is looked at, while `latest` already names step 6.
    Then the directory is listed again, rather than said to hold no checkpoint (sample.py on a run that
    saves every step saw that once in 89 reads). A stand-in for the listing returns the stale one once."""
    from support import storage

    ckpt = tmp_path / "ckpt"
    (ckpt / "step_00000006").mkdir(parents=True)
    (ckpt / "latest").write_text("step_00000006")
    glob, listed = Path.glob, []

    def overtaken(self, pattern):
        listed.append(pattern)
        return iter([ckpt / "step_00000005"]) if len(listed) == 1 else glob(self, pattern)
    monkeypatch.setattr(Path, "glob", overtaken)
    assert storage.candidates(ckpt) == [ckpt / "step_00000006"]
