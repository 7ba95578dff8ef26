"""The fault-injection campaign, kept: each way a run was once made to go silently wrong, or to die
with a traceback instead of one line, is reproduced here and must now be caught.

Findings (issue "Nothing silently wrong"): 1 the manifest was not integrity-checked; 2 a precision
change on resume was accepted and wrong; 3 a --fresh run could later resume another run's
checkpoint, or silently restart when every checkpoint was corrupt; 4 the spike guard could loop
forever; 5 two runs could share one --out; 6 tracebacks where one line is promised; 7 token shards
had no checksum; 8 a stalled commit ignored --timeout, and so did a stalled peer in any group but the
world's (30 minutes instead) or before the ranks had joined (a traceback).
"""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, TINY, metrics, run_train, start_ranks, stop_ranks

import checkpoint
import data
import model as gpt
import parallel
from support import rundir, storage, writer

RUN = ["--max-steps", "6", "--ckpt-every", "2", "--eval-every", "6", "--keep", "3"]


def last_line(result) -> str:
    assert result.returncode != 0, result.stdout[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.stderr.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    """A run that saved at steps 2, 4 and 6, never interrupted: the reference, and the source of copies."""
    out = tmp_path_factory.mktemp("straight")
    run_train(corpus, out, *RUN)
    return out


def copy_of(straight: Path, tmp_path: Path, keep_steps=(2, 4)) -> Path:
    """The straight run as if it had died after step `keep_steps[-1]`'s checkpoint (later ones removed)."""
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    for p in (out / "ckpt").glob("step_*"):
        if int(p.name[5:]) not in keep_steps:
            shutil.rmtree(p)
    (out / "ckpt" / "latest").write_text(f"step_{keep_steps[-1]:08d}")
    return out


# ----------------------------------------------------------------------------- 1: the manifest


def flip_key(m: dict) -> None:  # h.0 -> h.1 in one tensor's key: valid JSON, wrong tensor
    e = next(e for e in m["tensors"] if e["key"] == "transformer.h.0.attn.c_proj.weight")
    e["key"] = "transformer.h.1.attn.c_proj.weight"


def flip_name(m: dict) -> None:
    e = next(e for e in m["tensors"] if e["name"] == "transformer.h.0.attn.c_proj.weight")
    e["name"] = "transformer.h.0.attn.c_proj.weighu"


DAMAGES = {
    "key-bit-flip": lambda path: edit_manifest(path, flip_key),
    "name-bit-flip": lambda path: edit_manifest(path, flip_name),
    "a-list": lambda path: path.write_text("[1, 2]"),
    "only-format": lambda path: path.write_text(json.dumps({"format": "nanoscale-checkpoint", "version": 2})),
    "resealed-wrong-shape": lambda path: path.write_text(json.dumps(storage.seal(
        {"format": "nanoscale-checkpoint", "version": 2, "run": "x", "step": 4, "files": [], "tensors": {}}))),
}


def edit_manifest(path: Path, change) -> None:
    m = json.loads(path.read_text())
    change(m)
    path.write_text(json.dumps(m, indent=1))  # the old self-hash stays: an edit it no longer matches


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_manifest_is_unusable_and_the_run_falls_back(damage, straight, corpus, tmp_path):
    out = copy_of(straight, tmp_path)
    DAMAGES[damage](out / "ckpt" / "step_00000004" / "manifest.json")
    inspected = subprocess.run([sys.executable, "-m", "instruments.checkpoints", "inspect", str(out / "ckpt")],
                               cwd=ROOT, capture_output=True, text=True)
    assert inspected.returncode == 2 and "manifest" in inspected.stdout + inspected.stderr
    assert "Traceback" not in inspected.stderr
    resumed = run_train(corpus, out, *RUN)
    assert "checkpoint unusable, trying an older one" in resumed.stdout and "manifest.json" in resumed.stdout
    assert "(step 2)" in resumed.stdout
    assert [r["loss"] for r in metrics(out)] == [r["loss"] for r in metrics(straight)]


def test_inspect_names_the_broken_file(straight, tmp_path):
    out = copy_of(straight, tmp_path)
    victim = out / "ckpt" / "step_00000004" / "rank00000.safetensors"
    raw = bytearray(victim.read_bytes())
    raw[-100] ^= 1
    victim.write_bytes(bytes(raw))
    result = subprocess.run([sys.executable, "-m", "instruments.checkpoints", "inspect", str(out / "ckpt")],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2
    assert "manifest.json     ok" in result.stdout
    assert "rank00000.safetensors" in result.stdout and "BROKEN" in result.stdout and "sha256" in result.stdout


# ----------------------------------------------------------------------------- 2: what may change on resume


@pytest.mark.parametrize("saved,resumed", [("fp16", "fp32"), ("fp32", "fp16")])
def test_a_precision_change_on_resume_is_refused(saved, resumed, corpus, tmp_path):
    run_train(corpus, tmp_path, "--max-steps", "2", "--precision", saved)
    line = last_line(run_train(corpus, tmp_path, "--max-steps", "4", "--precision", resumed, check=False))
    assert f"precision: checkpoint has {saved}, this run has {resumed}" in line


def test_legitimate_changes_on_resume_are_logged_with_their_effect(straight, corpus, tmp_path):
    out = copy_of(straight, tmp_path)
    resumed = run_train(corpus, out, *RUN, "--lr", "1e-3", "--micro-batch-size", "4")
    assert "resume: --lr 0.002 -> 0.001: the learning-rate schedule changes; step 5 trains at" in resumed.stdout
    assert "resume: --micro-batch-size 8 -> 4: a layout change" in resumed.stdout


def resume_lines(saved: dict, **now) -> list[str]:
    """What a resume says (reports.resume_changes) when a checkpoint of a run with config `saved` (TrainConfig
    fields over the defaults) is resumed with `now`'s, at dp 4."""
    from dataclasses import asdict
    from types import SimpleNamespace

    import config
    from instruments import reports
    grid = parallel.Grid(dp=4, rank=0)
    run = SimpleNamespace(cfg=config.TrainConfig(**now), step=4, grid=grid, scaler=SimpleNamespace(enabled=False))
    return reports.resume_changes(run, asdict(config.TrainConfig(**saved)), writer.layout_of(grid))


def test_hybrid_zero_and_zero_plus_plus_changes_are_said_on_resume():
    """--zero-shard 2 resumed at 4, and a ZeRO++ run (--hpz --qwz --qgz 8) resumed as plain --zero 3, said
    nothing (the flag lists left them out), though qwZ and qgZ's quantization changes the math."""
    assert resume_lines({"zero": 1, "zero_shard": 2}, zero=1, zero_shard=4) == [
        "resume: --zero-shard 2 -> 4: a layout change: the same math, dropout's masks included"]
    lines = resume_lines({"zero": 3, "hpz": True, "qwz": True, "qgz": 8}, zero=3)
    assert [line.split(":")[1] for line in lines] == [" --hpz True -> False", " --qwz True -> False", " --qgz 8 -> 0"]
    assert "a layout change: the same math" in lines[0]
    assert all("ZeRO++'s quantization" in line and "differ from the original run's" in line for line in lines[1:])
    # the block size matters where something is quantized, and only there
    assert len(resume_lines({"zero": 3, "qwz": True}, zero=3, qwz=True, quant_block=128)) == 1
    assert resume_lines({"zero": 3}, zero=3, quant_block=128) == []


def test_every_flag_is_classified_for_resume():
    """Each flag of train.py is in one list of reports.py: said on resume with its effect (schedule, update,
    layout, kernels, quantization), fixed by the checkpoint (a change is refused: train.checkpoint_meta), or
    without effect on the math (reporting, cadence, paths, fault injection). A new flag that is in none
    fails here, so that whether a resume must say it is decided, not forgotten."""
    from dataclasses import fields

    import config
    from instruments import reports
    lists = {name: getattr(reports, name) for name in ("SCHEDULE", "UPDATE", "LAYOUT", "KERNELS", "QUANTIZED",
                                                        "FIXED", "UNSAID")}
    flags = [f.name for f in fields(config.TrainConfig)]
    for flag in flags:
        found = [name for name, names in lists.items() if flag in names]
        assert len(found) == 1, f"--{flag.replace('_', '-')} is in {found or 'none'} of reports.py's lists"
    assert sorted(n for names in lists.values() for n in names) == sorted(flags)  # and nothing that is not a flag


def test_a_changed_corpus_of_the_same_length_is_noticed_on_resume(corpus, tmp_path):
    text = Path(corpus["data"]).read_text()
    own = {"data": str(tmp_path / "corpus.txt"), "cache": corpus["cache"]}
    Path(own["data"]).write_text(text)
    run_train(own, tmp_path / "run", *RUN, "--max-steps", "4")
    Path(own["data"]).write_text(text.swapcase())  # the same length, other data: re-prepared, other tokens
    refused = run_train(own, tmp_path / "run", *RUN, check=False)
    line = last_line(refused)
    assert refused.returncode == 2 and line.startswith("error: ") and "data_sha256: checkpoint has train " in line
    assert "--new-data" in line and [r["step"] for r in metrics(tmp_path / "run")] == [1, 2, 3, 4]  # no step
    accepted = run_train(own, tmp_path / "run", *RUN, "--new-data")
    assert "resume: the prepared data's sha256 train " in accepted.stdout and "(step 4)" in accepted.stdout
    assert "the steps from here on are not the original run's" in accepted.stdout
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2, 3, 4, 5, 6]


# ----------------------------------------------------------------------------- 3: one run per directory


def test_fresh_moves_the_old_run_aside_and_never_falls_back_into_it(straight, corpus, tmp_path):
    out = copy_of(straight, tmp_path, keep_steps=(2, 4, 6))
    old_id = json.loads((out / "run.json").read_text())["run"]
    fresh = run_train(corpus, out, "--max-steps", "2", "--fresh")
    assert (out / "previous" / old_id / "ckpt" / "step_00000006").is_dir()
    new_id = json.loads((out / "run.json").read_text())["run"]
    assert new_id != old_id and "--fresh: moved the previous run's files" in fresh.stdout
    assert [p.name for p in (out / "ckpt").glob("step_*")] == ["step_00000002"]
    victim = out / "ckpt" / "step_00000002" / "rank00000.safetensors"
    victim.write_bytes(victim.read_bytes()[:1000])  # the new run's only checkpoint is now corrupt
    rows_before = (out / "metrics.jsonl").read_text()
    line = last_line(run_train(corpus, out, "--max-steps", "4", check=False))
    assert "no usable checkpoint of this run" in line
    assert (out / "metrics.jsonl").read_text() == rows_before  # nothing restarted, nothing rewritten


def test_a_checkpoint_of_another_run_is_never_loaded(straight, corpus, tmp_path):
    out = copy_of(straight, tmp_path)
    owner = json.loads((out / "run.json").read_text())["run"]
    (out / "run.json").write_text(json.dumps({"run": "someone-else"}))
    refused = last_line(run_train(corpus, out, *RUN, check=False))  # ckpt/.owner names the run that wrote them
    assert f"which holds the checkpoints of run {owner}" in refused and "not of this run (someone-else)" in refused
    (out / "ckpt" / ".owner").unlink()  # a directory from before .owner: each checkpoint's manifest says whose
    result = run_train(corpus, out, *RUN, check=False)
    assert "no usable checkpoint of this run" in last_line(result)
    assert "written by another run" in result.stdout


def test_leftovers_without_a_run_id_are_refused(corpus, tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "metrics.jsonl").write_text("")
    line = last_line(run_train(corpus, tmp_path, check=False))
    assert "no run.json" in line and "--fresh" in line


# ----------------------------------------------------------------------------- 4: the spike guard gives up


def test_the_spike_guard_gives_up_instead_of_looping(corpus, tmp_path):
    result = run_train(corpus, tmp_path, "--max-steps", "40", "--lr", "10", "--warmup-steps", "400", "--ckpt-every",
                       "4", "--spike-z", "3", "--spike-window", "4", "--eval-every", "1000", "--max-rollbacks", "2",
                       check=False)
    line = last_line(result)
    assert "the spike guard rolled back 2 times in a row" in line and "lower --lr" in line
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    spikes = [r for r in rows if r.get("event") == "spike"]  # every rollback stays on record, and the last straw
    streak = spikes[-3:]  # (an earlier spike the run got past may come before: it started a new count)
    assert len(streak) == 3 and streak[-1]["gave_up"] and not any(r.get("gave_up") for r in spikes[:-1])
    assert len({r["batch"] for r in streak}) == 3


# ----------------------------------------------------------------------------- 5: one run per --out at a time


def test_a_second_run_on_the_same_out_is_refused(corpus, tmp_path):
    cmd = [sys.executable, str(ROOT / "train.py"), "--data", corpus["data"], "--cache-dir", corpus["cache"],
           "--out", str(tmp_path), *TINY, "--max-steps", "100000", "--eval-every", "100000"]
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "metrics.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.2)  # the first run holds the lock from before it writes metrics
        second = run_train(corpus, tmp_path, check=False)
        line = last_line(second)
        assert f"--out {tmp_path} is in use by pid {first.pid}" in line
    finally:
        first.kill()
        first.wait()
    assert run_train(corpus, tmp_path, "--max-steps", "2", "--fresh").returncode == 0  # the kernel freed the lock


# ----------------------------------------------------------------------------- 6: one line, not a traceback


@pytest.mark.parametrize("flag,value,message", [
    ("--spike-window", "0", "argument --spike-window: must be >= 1, got 0"),
    ("--lr", "-1", "argument --lr: must be > 0, got -1"),
    ("--dropout", "1.5", "argument --dropout: must be in [0, 1), got 1.5"),
    ("--loss-scale", "0", "argument --loss-scale: must be > 0, got 0"),
    ("--crash-at", "soon", "argument --crash-at: must look like step:N"),
])
def test_bad_flag_values_are_refused_by_the_parser(flag, value, message, corpus, tmp_path):
    result = run_train(corpus, tmp_path, flag, value, check=False)
    assert message in last_line(result) and result.returncode == 2
    assert not (tmp_path / "run.json").exists() and "data:" not in result.stdout  # before any work


def test_out_that_is_a_file(corpus, tmp_path):
    (tmp_path / "out").write_text("not a directory")
    assert "is a file, not a directory" in last_line(run_train(corpus, tmp_path / "out", check=False))


def test_ckpt_that_is_a_file(corpus, tmp_path):
    (tmp_path / "ckpt").write_text("not a directory")
    assert "is a file, not a directory" in last_line(run_train(corpus, tmp_path, check=False))


@pytest.mark.parametrize("pointer", ["not-utf8", "a-directory"])
def test_an_unreadable_latest_pointer_is_passed_over(pointer, straight, corpus, tmp_path):
    out = copy_of(straight, tmp_path)
    latest = out / "ckpt" / "latest"
    latest.unlink()
    if pointer == "not-utf8":
        latest.write_bytes(b"\xff\xfe step")
    else:
        latest.mkdir()
    resumed = run_train(corpus, out, *RUN)
    assert "latest is unreadable" in resumed.stdout or "not a checkpoint name" in resumed.stdout
    assert "(step 4)" in resumed.stdout


def test_a_torn_last_metrics_line_is_dropped_and_said(straight, corpus, tmp_path):
    out = copy_of(straight, tmp_path)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 4.9')  # the process died mid-line
    resumed = run_train(corpus, out, *RUN)
    assert "dropped a torn last line" in resumed.stdout
    assert [r["loss"] for r in metrics(out)] == [r["loss"] for r in metrics(straight)]


def test_a_save_that_cannot_be_written_is_one_line(corpus, tmp_path):
    run_train(corpus, tmp_path, "--max-steps", "2")
    (tmp_path / "ckpt" / ".tmp-step_00000004").write_text("in the way")  # a file where a directory must go
    line = last_line(run_train(corpus, tmp_path, "--max-steps", "4", check=False))
    assert "could not write the checkpoint of step 4" in line


def test_a_full_disk_during_a_save_is_a_checkpoint_error(tmp_path, monkeypatch):
    saver, model, opt = tiny_saver(tmp_path)

    def full(path, chunks):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(storage, "write_chunks", full)
    with pytest.raises(checkpoint.CheckpointError, match="could not write the checkpoint of step 1.*No space left"):
        saver.save(1, checkpoint.tensor_entries(model, opt, saver.grid), checkpoint.optimizer_steps(opt), extra={},
                   meta={})


# ----------------------------------------------------------------------------- 7: token shards


def test_a_corrupted_token_shard_is_one_line(corpus, tmp_path):
    prepared = data.prepare(data.DataConfig(source=corpus["data"], tokenizer="byte", cache_dir=corpus["cache"]),
                            verbose=False)
    shard = prepared / "train.bin"
    original = shard.read_bytes()
    raw = bytearray(original)
    raw[len(raw) // 2] = (raw[len(raw) // 2] + 1) % 256  # another valid byte token
    try:
        shard.write_bytes(bytes(raw))
        line = last_line(run_train(corpus, tmp_path, check=False))
        assert "train.bin" in line and "sha256" in line
    finally:
        shard.write_bytes(original)


# ----------------------------------------------------------------------------- 8: --timeout everywhere


def tiny_saver(tmp_path, rank=0, world=1, timeout_s=600.0):
    grid = parallel.Grid(dp=world, rank=rank)  # a rank of a data-parallel job, without a process group
    grid.all_reduce = lambda *args, **kwargs: None  # the ranks agree to save (no peer to say otherwise)
    model = gpt.build(gpt.config_from_preset("tiny", 257), seed=0)
    opt = torch.optim.AdamW(model.parameters())
    return writer.Saver(tmp_path / "ckpt", keep=2, asynchronous=False, grid=grid, run="r",
                        timeout_s=timeout_s), model, opt


def test_a_stalled_commit_honours_the_timeout(tmp_path):
    saver, model, opt = tiny_saver(tmp_path, rank=1, world=2, timeout_s=1.0)
    (tmp_path / "ckpt" / ".tmp-step_00000001").mkdir(parents=True)  # rank 0 made it, then stalled
    with pytest.raises(checkpoint.CheckpointError, match=r"timed out after 1s \(--timeout\)"):
        saver.save(1, checkpoint.tensor_entries(model, opt, saver.grid), checkpoint.optimizer_steps(opt), extra={},
                   meta={})


def test_a_peer_stalled_in_a_tensor_parallel_collective_ends_the_run_at_the_timeout(corpus, tmp_path):
    """Every group waits at most --timeout for a peer, not only the world's: rank 1 stops answering in its
    first collective over tp (alive and silent, as a hung process is). Its tp partner, rank 0, waits there;
    ranks 2 and 3 wait for them in a data-parallel all-reduce. Each says one PeerError line and exits 3,
    rank 0 naming the tp call. (Before: torch's default for a new group, 30 minutes on gloo and 10 on NCCL,
    so the run hung long past --timeout, and the bound on the wait below, far shorter, failed the test.)"""
    procs = start_ranks(corpus, tmp_path, 4, "--tp", "2", "--max-steps", "50", "--timeout", "30",
                        "--crash-at", "rank:1:stall:tp")
    try:
        errs = {r: procs[r].communicate(timeout=300)[1] for r in (0, 2, 3)}
        assert procs[1].poll() is None  # it stalled: it did not die
    finally:
        stop_ranks(procs)
    for r, err in errs.items():
        lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert procs[r].returncode == 3 and len(lines) == 1 and "Traceback" not in err, (r, err[-3000:])
        assert lines[0].startswith(f"error: rank {r}, in ") and "a peer process failed or timed out" in lines[0]
    assert "over tp (ranks 0, 1): a peer process failed or timed out" in errs[0], errs[0][-2000:]


def test_a_peer_that_stalls_before_joining_is_one_line_and_exit_3(corpus, tmp_path):
    """Rank 1 hangs in set-up and never joins: rank 0 waits for it --timeout while the process group forms,
    then says one PeerError line and exits 3, as for a peer that stalls in training. (Before: the store's
    DistStoreError as a traceback, exit 1.)"""
    result = run_train(corpus, tmp_path, "--timeout", "5", "--crash-at", "rank:1:stall:connect", nproc=2,
                       check=False)
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith("error: rank 0, joining "), result.stderr[-3000:]
    assert "a peer process failed or timed out" in lines[0]
    assert 'train.py", line' not in result.stderr and "exitcode  : 3" in result.stderr, result.stderr[-3000:]


# ----------------------------------------------------------------------------- the run directory, in process


def test_metrics_keep_events_and_drop_later_steps(tmp_path):
    path = tmp_path / "metrics.jsonl"
    m = rundir.Metrics(path, True, 0)
    for step in (1, 2, 3):
        m.log(step=step, loss=1.0)
    m.log(event="spike", step=3)
    m.truncate(1)
    assert [(r.get("event"), r["step"]) for r in m.rows()] == [(None, 1), ("spike", 3)]
    path.write_text(path.read_text() + '{"step": 2, "lo\n{"step": 3}\n')  # a broken line in the middle
    with pytest.raises(rundir.RunDirError, match="line 3 is not JSON"):
        m.rows()


def test_shard_checksum_is_checked_on_open(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16) % 257
    data.write_tokens(tmp_path / "t.bin", tokens)
    assert np.array_equal(data.load_tokens(tmp_path / "t.bin", vocab_size=257), tokens)
    raw = bytearray((tmp_path / "t.bin").read_bytes())
    raw[-2] ^= 1
    (tmp_path / "t.bin").write_bytes(bytes(raw))
    with pytest.raises(data.DataError, match="sha256"):
        data.load_tokens(tmp_path / "t.bin", vocab_size=257)
