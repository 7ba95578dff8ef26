"""train.py: the command line, determinism, precision, the loss scaler, and clear errors."""

import math
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, metrics, run_train

import data
import train


def test_help_documents_every_flag():
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), "--help"], capture_output=True, text=True).stdout
    for f in train.TrainConfig.__dataclass_fields__:
        assert "--" + f.replace("_", "-") in out, f
    assert "default" in out


def test_same_seed_gives_bitwise_identical_losses(corpus, tmp_path):
    run_train(corpus, tmp_path / "a", "--max-steps", "6")
    run_train(corpus, tmp_path / "b", "--max-steps", "6")
    run_train(corpus, tmp_path / "c", "--max-steps", "6", "--seed", "7")
    a, b, c = (metrics(tmp_path / x) for x in "abc")
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["loss"] for r in a] != [r["loss"] for r in c]
    assert set(a[-1]) >= {"step", "loss", "lr", "grad_norm", "tokens_per_sec", "mfu", "val_loss"}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_every_precision_learns(precision, corpus, tmp_path):
    run_train(corpus, tmp_path, "--max-steps", "30", "--precision", precision, "--eval-every", "30",
              "--lr", "3e-3", "--batch-size", "16", "--seq-len", "64")
    rows = metrics(tmp_path)
    assert rows[-1]["val_loss"] < rows[0]["loss"] - 1.5  # from ~5.6 (uniform over 257 bytes)
    assert not any(r["skipped"] for r in rows[5:])


def test_fp16_overflow_is_skipped_and_the_scale_backs_off(corpus, tmp_path):
    run_train(corpus, tmp_path, "--max-steps", "12", "--precision", "fp16", "--loss-scale", str(2.0**20))
    rows = metrics(tmp_path)
    skipped = [r for r in rows if r["skipped"]]
    assert skipped and rows[0]["skipped"]  # 2^20 times the gradients overflows fp16
    assert not rows[-1]["skipped"]  # ...and after halving enough times, training goes on
    assert rows[-1]["loss_scale"] == 2.0**20 / 2 ** len(skipped)
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_loss_scaler_rules():
    s = train.LossScaler(True, init_scale=1024.0, window=3)
    s.update(overflow=True)
    assert s.scale == 512.0
    for _ in range(3):
        s.update(overflow=False)
    assert s.scale == 1024.0
    g = [torch.full((2,), 1024.0)]
    s.unscale_(g)
    assert torch.equal(g[0], torch.ones(2))
    off = train.LossScaler(False, init_scale=1024.0)
    assert off.scale == 1.0
    s = train.LossScaler(True, init_scale=2.0**-23)
    with pytest.raises(FloatingPointError, match="loss scale collapsed"):
        s.update(overflow=True)
        s.update(overflow=True)


def test_lr_schedule_warms_up_then_decays_to_min():
    cfg = train.TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    lrs = [train.lr_at(s, cfg) for s in range(111)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lrs[110] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))


def test_non_finite_losses_stop_the_run(corpus, tmp_path):
    result = run_train(corpus, tmp_path, "--max-steps", "20", "--lr", "1e9", "--clip", "0", "--max-bad-steps", "2",
                       check=False)
    assert result.returncode == 2
    assert "steps in a row had a non-finite loss or gradient" in result.stderr


def test_weight_decay_only_on_matrices():
    import model as gpt
    m = gpt.build(gpt.config_from_preset("tiny", 257), seed=0)
    opt = train.make_optimizer(m, train.TrainConfig(weight_decay=0.1), torch.device("cpu"))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.dim() == 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() == 1 for p in no_decay["params"])


# ----------------------------------------------------------------------------- bad input: one clear line

def bad_run(corpus, tmp_path, *flags, data_path=None):
    cmd = [sys.executable, str(ROOT / "train.py"), "--data", data_path or corpus["data"], "--cache-dir",
           corpus["cache"], "--out", str(tmp_path / "out"), "--preset", "tiny", "--tokenizer", "byte",
           "--seq-len", "32", "--batch-size", "8", "--max-steps", "2", *flags]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    return result.stderr.strip().splitlines()[-1]


def test_missing_data(corpus, tmp_path):
    assert "error:" in bad_run(corpus, tmp_path, data_path=str(tmp_path / "nope.txt"))


def test_empty_directory(corpus, tmp_path):
    (tmp_path / "empty").mkdir()
    assert "error:" in bad_run(corpus, tmp_path, data_path=str(tmp_path / "empty"))


def test_non_utf8_file(corpus, tmp_path):
    (tmp_path / "latin1.txt").write_bytes("café au lait\n".encode("latin-1") * 50)
    line = bad_run(corpus, tmp_path, data_path=str(tmp_path / "latin1.txt"))
    assert "error:" in line and "latin1.txt" in line


def test_batch_not_divisible_by_micro_batch(corpus, tmp_path):
    assert "--micro-batch-size 3 does not divide" in bad_run(corpus, tmp_path, "--micro-batch-size", "3")


def test_sequence_longer_than_context(corpus, tmp_path):
    assert "longer than the tiny model's context (64 tokens)" in bad_run(corpus, tmp_path, "--seq-len", "100")


def test_unknown_preset(corpus, tmp_path):
    assert "unknown preset 'gpt5'" in bad_run(corpus, tmp_path, "--preset", "gpt5")


def test_corrupt_shard_header(corpus, tmp_path):
    prepared = data.prepare(data.DataConfig(source=corpus["data"], tokenizer="byte", cache_dir=corpus["cache"]),
                            verbose=False)
    shard = prepared / "train.bin"
    original = shard.read_bytes()
    try:
        shard.write_bytes(b"garbage!" + original[8:])
        line = bad_run(corpus, tmp_path)
        assert "error:" in line and "train.bin" in line
    finally:
        shard.write_bytes(original)
