"""What a new user met in their first hour (issue 30), kept: bad input that ran, a silent choice, a
traceback where one line is promised, a startup line that did not say the layout, leftovers of an
interrupted preparation.

Flag checks run in process (the parser exits with one line, which capsys reads): they cost no start of
Python and torch. One run through train.py each proves the line reaches a user the same way.
"""

import resource
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT, run_train

import config
import data
import parallel


def refused(capsys, *argv: str) -> str:
    """The one line config.parse_args says before it exits 2."""
    with pytest.raises(SystemExit) as e:
        config.parse_args(list(argv))
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    return err.strip()


@pytest.mark.parametrize("argv,message", [
    (["--batch-size", "0"], "argument --batch-size: must be >= 1, got 0"),  # was silently 8
    (["--lr", "inf"], "argument --lr: must be a finite number, got inf"),  # trained NaN weights, exit 0
    (["--weight-decay", "inf"], "argument --weight-decay: must be a finite number, got inf"),
    (["--lr", "0"], "argument --lr: must be > 0, got 0"),  # was silently 2e-3
    (["--timeout", "inf"], "argument --timeout: must be a finite number, got inf"),  # OverflowError under torchrun
    (["--timeout", "1e300"], "argument --timeout: must be > 0 and at most 1e+09 (about 30 years), got 1e300"),
    (["--sample-tokens", str(10**21)], f"argument --sample-tokens: must be in [0, 100000], got {10**21}"),
])
def test_impossible_flag_values_are_refused_by_the_parser(argv, message, capsys):
    assert message in refused(capsys, *argv)


def settle(*argv: str) -> tuple[config.TrainConfig, object]:
    """What setup() decides before it builds anything, on one CPU process: (config, model config)."""
    cfg = config.resolve_defaults(config.parse_args(["--device", "cpu", "--tokenizer", "byte", *argv]),
                                  torch.device("cpu"))
    grid = parallel.Grid(device=torch.device("cpu"))
    config.check_batch(cfg, grid)
    model_cfg = config.model_config(cfg)
    config.check_size(cfg, model_cfg, grid)
    return cfg, model_cfg


@pytest.mark.parametrize("argv,what", [
    (["--preset", "tiny", "--n-layer", "100000"], "100000 layers, a context of 64"),
    (["--preset", "tiny", "--block-size", str(10**21)], f"4 layers, a context of {10**21:,}"),  # a TypeError before
])
def test_a_model_that_cannot_fit_is_refused_before_it_is_built(argv, what):
    with pytest.raises(config.ConfigError, match=rf"the model would have [\d,.]+B parameters \({what}\): at least "
                                                 r"[\d,.]+ GB of training state and activations, more than the "):
        settle(*argv)
    settle("--preset", "tiny", "--n-layer", "64")  # a deep model that fits is not refused


def test_n_layer_100000_is_one_line_from_train_py(corpus, tmp_path):
    result = run_train(corpus, tmp_path, "--n-layer", "100000", check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith("error: the model would have")
    assert "data:" not in result.stdout  # before any work


def test_short_runs_leave_most_steps_to_training():
    """The default evaluation interval: 10 evaluations a run, never more often than every 10th step (each
    one also samples); the last step always evaluates."""
    for steps, evaluations in ((5, 1), (20, 2), (50, 5), (200, 10), (1000, 10)):
        cfg = config.TrainConfig(max_steps=steps)
        config.resolve_steps(cfg, torch.device("cpu"), 10**6)
        evals = [s for s in range(1, steps + 1) if s % cfg.eval_every == 0 or s == steps]
        assert len(evals) == evaluations, (steps, cfg.eval_every)


def test_the_startup_line_names_the_layout_and_a_zero_that_does_nothing_says_so(corpus, tmp_path):
    one = run_train(corpus, tmp_path / "one", "--zero", "1", "--max-steps", "1")
    assert "-layer model (tiny, 0.2M parameters) on cpu: fp32" in one.stdout
    assert one.stdout.count("--zero 1 shards nothing here") == 1
    two = run_train(corpus, tmp_path / "two", "--zero", "2", "--tp", "2", "--max-steps", "1", nproc=2)
    assert "-layer model (tiny, 0.2M parameters) on 2 cpu processes (dp 1 x tp 2 x pp 1 x cp 1): fp32" in two.stdout
    assert two.stdout.count("--zero 2 shards nothing here: ZeRO splits state across the data-parallel ranks, "
                            "and there is 1") == 1


def test_a_flag_error_under_torchrun_exits_non_zero_said_once(corpus, tmp_path):
    """`torchrun ... && next` must stop: the launcher exits non-zero, the line is said once, by rank 0, and
    torchrun's summary gives it as the cause (README: what torchrun adds around it)."""
    result = run_train(corpus, tmp_path, "--timeout", "1e300", nproc=2, check=False, timeout=120)
    assert result.returncode != 0
    line = "error: argument --timeout: must be > 0 and at most 1e+09 (about 30 years), got 1e300 (python " \
           "train.py --help lists every flag) (all 2 processes stopped)"
    assert result.stderr.splitlines().count(line) == 1, result.stderr[-3000:]
    assert f"traceback : {line}" in result.stderr  # the summary's root cause
    assert 'train.py", line' not in result.stderr and not (tmp_path / "run.json").exists()


def test_a_checkpoint_of_another_model_under_torchrun_is_said_once(corpus, tmp_path):
    """The README's examples one after another in the same --out: the second, another model, is an incompatible
    run. Under torchrun that line was said by every rank, and torchrun, seeing the first exit 2, killed the
    others (exitcode -15 in its summary). Every rank finds it alike (they read the same checkpoint): rank 0
    says it and exits 2, the others exit 0 quietly, as a flag error does."""
    run_train(corpus, tmp_path, "--max-steps", "1", nproc=2)
    result = run_train(corpus, tmp_path, "--max-steps", "1", "--n-layer", "2", nproc=2, check=False)
    said = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(said) == 1 and "is from an incompatible run" in said[0], result.stderr[-3000:]
    assert said[0].endswith("pass --fresh to start over (all 2 processes stopped)"), said[0]
    assert result.returncode == 1 and f"traceback : {said[0]}" in result.stderr  # torchrun: one failure, rank 0's
    assert "exitcode  : 2" in result.stderr and "exitcode  : -15" not in result.stderr, result.stderr[-3000:]
    assert 'train.py", line' not in result.stderr


# ----------------------------------------------------------------------------- data preparation


def byte_corpus(corpus: dict, cache) -> data.DataConfig:
    return data.DataConfig(source=corpus["data"], tokenizer="byte", cache_dir=str(cache), workers=1)


def test_an_interrupted_preparation_leaves_no_temporary_folders(corpus, tmp_path, monkeypatch):
    cfg = byte_corpus(corpus, tmp_path)
    out = data.prepare(cfg, verbose=False)
    stale = tmp_path / f".{out.name}.tmp-killed"  # what a preparation SIGKILLed while writing shards leaves
    stale.mkdir()
    (stale / "train.bin").write_bytes(b"half")
    original = data.write_splits

    def interrupted(tmp, *args):
        original(tmp, *args)
        raise KeyboardInterrupt  # Ctrl-C while the shards are being written
    monkeypatch.setattr(data, "write_splits", interrupted)
    with pytest.raises(KeyboardInterrupt):
        data.prepare(cfg, verbose=False, force=True)
    assert list(tmp_path.glob(".*.tmp-*")) == []
    monkeypatch.setattr(data, "write_splits", original)
    assert data.prepare(cfg, verbose=False) == out and (out / "meta.json").exists()


def test_a_full_disk_during_preparation_is_one_line_and_the_rerun_resumes(corpus, tmp_path):
    """RLIMIT_FSIZE in the child, as in tests/test_rundir.py: the work files stop growing at 20 kB."""
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))
    cmd = [sys.executable, str(ROOT / "data.py"), "--data", corpus["data"], "--tokenizer", "byte", "--cache-dir",
           str(tmp_path), "--workers", "1"]
    full = subprocess.run(cmd, capture_output=True, text=True, timeout=120, preexec_fn=limit, cwd=ROOT)
    assert full.returncode != 0 and "Traceback" not in full.stderr, full.stderr[-3000:]
    line = full.stderr.strip().splitlines()[-1]
    assert line == f"data: error: preparing --data {corpus['data']} in {tmp_path} failed: File too large; fix " \
                   "that and rerun: the preparation resumes where it stopped"
    assert list(tmp_path.glob(".*.tmp-*")) == []
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert again.returncode == 0 and "kept" in again.stdout, again.stderr[-3000:]
    resumed = data.load_tokens(next(tmp_path.glob("*/train.bin")))
    straight = data.load_tokens(data.prepare(byte_corpus(corpus, tmp_path / "ref"), verbose=False) / "train.bin")
    assert np.array_equal(resumed, straight)
