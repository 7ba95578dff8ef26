"""sample.py: text from a checkpoint of any layout or from a Hugging Face directory, streamed as it is drawn.

Two tiny runs train the same model from the same seed, one at one process and one at tp 2 x pp 2.
The layouts compute the same math (their weights agree to ~3e-5, their logits to ~2e-6), so the
strongest statement that holds, and the one asserted, is the same token ids from both checkpoints on
one process, greedy and sampled, and through a Hugging Face export; under torchrun, greedy (see there).
"""

import ast
import io
import os
import random
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, run_train, train_command

import checkpoint
import parallel
import sample
from instruments import hf
from support import tokenizer

LOGGED = 24  # the runs log a sample of this many tokens at their last step; sample.py's defaults must match it


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("runs")
    logs = {"one": run_train(corpus, root / "one", "--sample-tokens", str(LOGGED)).stdout,
            "tp2pp2": run_train(corpus, root / "tp2pp2", "--sample-tokens", str(LOGGED), "--tp", "2", "--pp", "2",
                                nproc=4).stdout}
    return {name: (root / name, logged_sample(log)) for name, log in logs.items()}


@pytest.fixture(autouse=True)
def one_thread():
    """One thread, as train.py's subprocesses here have: a tiny model's sampling is thousands of tiny ops, and on
    a busy 2-core machine more threads mostly wait for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def logged_sample(log: str) -> str:
    """The text of the last `step N val ... | sample: '...'` line train.py printed."""
    return ast.literal_eval(re.findall(r"^step \d+ val [\d.]+ \| sample: (.*)$", log, re.M)[-1])


def sample_ids(*flags: str) -> list[list[int]]:
    """sample.run on this process: the token ids of each sample."""
    cfg = sample.parse_args(["--device", "cpu", *flags])
    return sample.run(cfg, parallel.init_grid(1, 1, torch.device("cpu")), out=io.StringIO(), err=io.StringIO())


def sample_text(capsys, *flags: str) -> str:
    """What `python sample.py ...` prints on stdout (run in this process)."""
    sample.main(["--device", "cpu", *flags])
    return capsys.readouterr().out


def test_the_same_text_from_checkpoints_saved_at_one_process_and_at_tp2_pp2(runs, capsys):
    one, tp = runs["one"][0], runs["tp2pp2"][0]
    for name, (out, logged) in runs.items():  # the defaults draw what training drew with the run's weights
        assert sample_text(capsys, "--ckpt", str(out), "--tokens", str(LOGGED)) == logged + "\n", name
    for flags in (["--temperature", "0"], [], ["--seed", "7", "--prompt", "import "],
                  ["--temperature", "1", "--top-k", "0", "--seed", "3"]):
        ids = sample_ids("--ckpt", str(one), "--tokens", "100", *flags)
        assert len(ids[0]) == 100
        assert sample_ids("--ckpt", str(tp), "--tokens", "100", *flags) == ids, flags
    text = sample_text(capsys, "--ckpt", str(tp / "ckpt"), "--prompt", "import ", "--tokens", "50")
    assert text.startswith("import ") and len(text) > len("import \n")


def test_the_same_seed_gives_the_same_text_and_another_seed_another(runs, capsys):
    ckpt = str(runs["one"][0] / "ckpt" / "step_00000004")  # a checkpoint named directly
    text = sample_text(capsys, "--ckpt", ckpt, "--seed", "5")
    assert text.strip() and sample_text(capsys, "--ckpt", ckpt, "--seed", "5") == text
    assert sample_text(capsys, "--ckpt", ckpt, "--seed", "6") != text
    first, second = sample_ids("--ckpt", ckpt, "--seed", "5", "--samples", "2")  # one generator, two draws
    assert first == sample_ids("--ckpt", ckpt, "--seed", "5")[0] and second != first


def test_torchrun_tp2_pp2_samples_what_one_process_samples(runs, capsys):
    """Greedy: split over 4 ranks, the logits are summed in another order (~1e-6 apart), which cannot change
    an argmax with a margin of 0.67. A seeded draw can change: top-k keeps the 50 largest logits, and where
    the 50th and 51st are within rounding the kept set, so every probability, differs (measured once in 60
    tokens, on another corpus). Same-layout draws are bitwise reproducible (the test above)."""
    tp = runs["tp2pp2"][0]
    flags = ["--ckpt", str(tp), "--device", "cpu", "--tokens", "60", "--prompt", "def ", "--temperature", "0"]
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                             str(ROOT / "sample.py"), "--tp", "2", "--pp", "2", *flags],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == sample_text(capsys, *flags)  # printed once, by rank 0
    assert result.stderr.count("sampling ") == 1 and "on cpu, tp 2 x pp 2" in result.stderr


def test_a_hugging_face_export_samples_the_same_text(runs, capsys, tmp_path):
    tp = runs["tp2pp2"][0]
    hf.main(["export", str(tp / "ckpt"), str(tmp_path / "hf")])  # consolidated from tp 2 x pp 2
    assert "wrote a Hugging Face GPT-2 model" in capsys.readouterr().out
    expected = sample_text(capsys, "--ckpt", str(tp), "--tokens", "60", "--seed", "11")
    assert sample_text(capsys, "--hf", str(tmp_path / "hf"), "--tokens", "60", "--seed", "11") == expected
    assert sample_text(capsys, "--ckpt", str(tmp_path / "hf"), "--tokens", "60", "--seed", "11") == expected


def test_tokens_are_written_as_they_are_drawn(runs):
    """Each token's text is handed to `write` before the next token's forward pass starts."""
    source = sample.find_source(sample.parse_args(["--ckpt", str(runs["one"][0])]), print)
    grid = parallel.init_grid(1, 1, torch.device("cpu"))
    model = sample.build(source, grid, sample.stability.PRECISIONS["fp32"])
    forwards, writes = [0], []
    model.transformer.wte.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    gen = torch.Generator().manual_seed(0)
    ids = sample.generate(model, grid, source.tok, [source.tok.eot], 30, 1.0, 0, gen,
                          lambda text: writes.append((forwards[0], text)))
    assert [n for n, _ in writes] == list(range(1, 31)) + [30]  # one write per token, then the held-back tail
    assert "".join(text for _, text in writes) == source.tok.decode(ids)


def test_a_character_split_across_tokens_is_held_back_until_it_is_whole(monkeypatch):
    text = "naïve ✓ 🙂 end"
    stream, shown = sample.Utf8Stream(), ""
    for byte in text.encode():  # the byte tokenizer: one byte a token
        piece = stream.feed(bytes([byte]))
        shown += piece
        assert "\ufffd" not in piece and text.startswith(shown)
    assert shown + stream.finish() == text
    rng = random.Random(0)
    for _ in range(200):  # any bytes, in any pieces: the stream adds up to the finished text, U+FFFD and all
        data = bytes(rng.randrange(256) if rng.random() < 0.3 else rng.choice(text.encode()) for _ in range(40))
        cuts = sorted(rng.sample(range(1, 40), 8))
        stream = sample.Utf8Stream()
        pieces = [stream.feed(data[a:b]) for a, b in zip([0] + cuts, cuts + [40])]
        assert "".join(pieces) + stream.finish() == data.decode("utf-8", errors="replace")
    monkeypatch.setattr(tokenizer, "download", lambda *a, **k: pytest.fail("fetched"))
    gpt2 = tokenizer.get_tokenizer("gpt2")  # "✓" is two GPT-2 tokens: b"\xe2\x9c", b"\x93"
    ids = gpt2.encode(text)
    assert b"".join(gpt2.token_bytes(i) for i in ids) == text.encode() and len(ids) > len(text.split())
    assert gpt2.token_bytes(gpt2.eot) == tokenizer.EOT_TEXT.encode()


def error_of(capsys, *flags: str) -> str:
    with pytest.raises(SystemExit) as exit:
        sample.main(["--device", "cpu", *flags])
    err = capsys.readouterr().err
    assert exit.value.code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err  # one line
    return err


def test_bad_input_is_one_line(runs, capsys, tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "sample.py"), "--ckpt", str(tmp_path / "nothing")],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2 and result.stderr == f"error: {tmp_path / 'nothing'}: no such directory; " \
        "--ckpt takes a run directory (train.py's --out), a ckpt/ directory, a step_XXXXXXXX checkpoint or a " \
        "Hugging Face GPT-2 directory\n" and result.stdout == ""
    assert "holds no checkpoint" in error_of(capsys, "--ckpt", str(tmp_path))
    assert "longer than the model's context of 64 tokens" in error_of(capsys, "--ckpt", str(runs["one"][0]),
                                                                      "--prompt", "x" * 64)
    assert "argument --temperature: must be >= 0, got -1" in error_of(capsys, "--temperature", "-1")
    assert "no config.json; --hf takes" in error_of(capsys, "--hf", str(tmp_path))
    broken = tmp_path / "ckpt" / "step_00000004"  # a copy of the run's checkpoint with one byte flipped
    shutil.copytree(runs["one"][0] / "ckpt" / "step_00000004", broken)
    data = bytearray((broken / "rank00000.safetensors").read_bytes())
    data[-1] ^= 1
    (broken / "rank00000.safetensors").write_bytes(data)
    assert "sha256" in error_of(capsys, "--ckpt", str(broken))
    with pytest.raises(SystemExit):  # a ckpt/ directory: each unusable checkpoint is reported, then one error
        sample.main(["--device", "cpu", "--ckpt", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("checkpoint unusable, trying an older one: ") and "sha256" in err[0]
    assert err[1:] == [f"error: no usable checkpoint in {tmp_path / 'ckpt'} (each one's problem is above)"]


def test_sampling_while_a_run_saves_every_step_with_keep_1(corpus, tmp_path):
    """sample.py on a run's --out while the run replaces its only checkpoint every step: each read pins
    the checkpoint it picked (its files mapped, then checked), so cleanup cannot delete it from under
    the reader, and one that vanishes before it is pinned is passed over in silence for the newer one."""
    out = tmp_path / "run"
    trainer = subprocess.Popen(train_command(corpus, out, "--max-steps", "40", "--ckpt-every", "1", "--keep", "1",
                                             "--eval-every", "40"), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        while not (out / "ckpt" / "latest").exists() and trainer.poll() is None:
            time.sleep(0.01)
        failures, steps, reads = [], set(), 0
        while trainer.poll() is None:
            err = io.StringIO()
            try:
                sample.run(sample.parse_args(["--device", "cpu", "--ckpt", str(out), "--tokens", "2"]),
                           parallel.init_grid(1, 1, torch.device("cpu")), out=io.StringIO(), err=err)
                steps.add(re.search(r"step_(\d+)", err.getvalue()).group(1))
                reads += 1
            except Exception as e:  # noqa: BLE001 -- every way a read can fail is a failure here
                failures.append(f"{e.__class__.__name__}: {e}")
            if "unusable" in err.getvalue():  # misleading: a replaced checkpoint is not a broken one
                failures.append(err.getvalue())
    finally:
        trainer.kill() if trainer.poll() is None else None
    assert trainer.wait() == 0, trainer.stderr.read()[-3000:]
    assert not failures, f"{len(failures)} failures in {reads} reads: {failures[:3]}"
    assert reads >= 10 and len(steps) >= 3  # many reads, of checkpoints that kept changing under them


def test_a_pinned_checkpoint_is_read_whole_after_it_is_deleted(runs, tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(runs["one"][0] / "ckpt", ckpt)
    reader = checkpoint.pin(ckpt / "step_00000004")
    expected = checkpoint.consolidate(runs["one"][0] / "ckpt" / "step_00000004")
    shutil.rmtree(ckpt / "step_00000004")  # the run's cleanup, right after the reader pinned it
    got = checkpoint.consolidate(reader)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)

    # vanishing after its manifest was read, before its files were mapped: the directory is listed again
    shutil.copytree(runs["one"][0] / "ckpt" / "step_00000004", ckpt / "step_00000004")
    (ckpt / "latest").write_text("step_00000004")
    opened, map_file = [], checkpoint.storage.map_file

    def cleanup_strikes(file):
        if not opened:  # the first file the reader maps: the run commits step 6, then deletes step 4
            shutil.copytree(runs["one"][0] / "ckpt" / "step_00000004", ckpt / "step_00000006")
            (ckpt / "latest").write_text("step_00000006")
            shutil.rmtree(ckpt / "step_00000004")
        opened.append(file)
        return map_file(file)
    monkeypatch.setattr(checkpoint.storage, "map_file", cleanup_strikes)
    messages = []
    found = checkpoint.newest(ckpt, log=messages.append)
    assert found.path == ckpt / "step_00000006" and messages == []  # no "unusable" for a replaced checkpoint


def test_help_documents_every_flag_with_its_default(capsys):
    with pytest.raises(SystemExit):
        sample.parse_args(["--help"])
    text = capsys.readouterr().out
    for name in vars(sample.SampleConfig()):
        assert f"--{name.replace('_', '-')}" in text
    assert "(default: 0.8)" in text and "(default: 1337)" in text
