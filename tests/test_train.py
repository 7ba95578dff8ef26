"""train.py: the command line, determinism, precision, the loss scaler, and clear errors."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT, metrics, run_train
from torch.overrides import TorchFunctionMode

import config
import data
import parallel
import stability
import train
from support import interrupt


def test_help_documents_every_flag_under_its_heading_with_its_real_default():
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), "--help"], capture_output=True, text=True).stdout
    for f in config.TrainConfig.__dataclass_fields__:
        assert "--" + f.replace("_", "-") in out, f
    headings = ["data:", "model:", "optimization:", "precision:", "checkpoints and recovery:", "parallelism (",
                "reporting:", "fault injection (for tests and lessons):"]
    at = [out.index("\n" + h) for h in headings]
    assert at == sorted(at)  # in this order, each once
    faults = out[at[-1]:]
    assert "--crash-at" in faults and "--poison-step" in faults and "--crash-at" not in out[:at[-1]]
    flat = " ".join(out.split())
    assert "--preset PRESET model size: gpt2, gpt2-medium" in flat
    assert "(default: gpt2 on CUDA, mini on CPU; --arch llama: smollm2-135m on CUDA, llama-mini on CPU)" in flat
    assert "(default: 200 on CPU" in flat and "(default: 0)" not in flat.split("--max-steps")[1][:200]


def test_a_batch_that_does_not_split_fails_before_any_data_is_read(corpus, tmp_path):
    result = run_train(corpus, tmp_path, "--batch-size", "8", "--micro-batch-size", "3", check=False)
    assert result.returncode == 2 and "does not divide the per-rank batch 8" in result.stderr
    assert "data:" not in result.stdout and not (tmp_path / "metrics.jsonl").exists()


def test_same_seed_gives_bitwise_identical_losses(corpus, tmp_path):
    """Evaluation and sampling too: on one machine, with one thread, a command repeats to the bit (another
    CPU's kernels, or another number of threads, round otherwise: DESIGN.md, "Same bits")."""
    logs = [run_train(corpus, tmp_path / x, "--max-steps", "6", "--sample-tokens", "24").stdout for x in "ab"]
    run_train(corpus, tmp_path / "c", "--max-steps", "2", "--seed", "7")
    a, b, c = (metrics(tmp_path / x) for x in "abc")
    assert [(r["loss"], r.get("val_loss")) for r in a] == [(r["loss"], r.get("val_loss")) for r in b]
    assert [line for line in logs[0].splitlines() if "sample: " in line] == \
        [line for line in logs[1].splitlines() if "sample: " in line] != []
    manifests = [json.loads((tmp_path / x / "ckpt" / "step_00000006" / "manifest.json").read_text()) for x in "ab"]
    assert manifests[0]["files"] == manifests[1]["files"]  # the same bytes, sha256 and all
    assert [r["loss"] for r in a[:2]] != [r["loss"] for r in c]
    assert set(a[-1]) >= {"step", "loss", "lr", "grad_norm", "tokens_per_sec", "mfu", "val_loss"}
    assert not any("signal" in r for r in a)  # the stop signal is the loop's, not a number of the step


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_every_precision_learns(precision, corpus, tmp_path):
    run_train(corpus, tmp_path, "--max-steps", "30", "--precision", precision, "--eval-every", "30",
              "--lr", "3e-3", "--batch-size", "16", "--seq-len", "64")
    rows = metrics(tmp_path)
    assert rows[-1]["val_loss"] < rows[0]["loss"] - 1.5  # from ~5.6 (uniform over 257 bytes)
    skipped = [r for r in rows[5:] if r["skipped"]]
    if precision != "fp16":
        assert not skipped
    else:  # an fp16 overflow now and then is routine at 2^16: the scaler halves the scale and skips that step
        assert len(skipped) <= 2, [r["step"] for r in skipped]
        assert rows[-1]["loss_scale"] == 2.0**16 / 2 ** sum(r["skipped"] for r in rows)


def test_fp16_overflow_is_skipped_and_the_scale_backs_off(corpus, tmp_path):
    run_train(corpus, tmp_path, "--max-steps", "12", "--precision", "fp16", "--loss-scale", str(2.0**20))
    rows = metrics(tmp_path)
    skipped = [r for r in rows if r["skipped"]]
    assert skipped and rows[0]["skipped"]  # 2^20 times the gradients overflows fp16
    assert not rows[-1]["skipped"]  # ...and after halving enough times, training goes on
    assert rows[-1]["loss_scale"] == 2.0**20 / 2 ** len(skipped)
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_loss_scaler_rules():
    s = stability.LossScaler(True, init_scale=1024.0, window=3)
    s.update(overflow=True)
    assert s.scale == 512.0
    for _ in range(3):
        s.update(overflow=False)
    assert s.scale == 1024.0
    g = [torch.full((2,), 1024.0)]
    s.unscale_(g)
    assert torch.equal(g[0], torch.ones(2))
    off = stability.LossScaler(False, init_scale=1024.0)
    assert off.scale == 1.0
    s = stability.LossScaler(True, init_scale=2.0**-23)
    with pytest.raises(FloatingPointError, match="loss scale collapsed"):
        s.update(overflow=True)
        s.update(overflow=True)


def test_lr_schedule_warms_up_then_decays_to_min():
    cfg = config.TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    lrs = [stability.lr_at(s, cfg) for s in range(111)]
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
    opt = train.make_optimizer(m, config.TrainConfig(weight_decay=0.1))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.dim() == 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() == 1 for p in no_decay["params"])


# ----------------------------------------------------------------------------- bad input: one clear line

def bad_run(corpus, tmp_path, *flags, data_path=None):
    cmd = [sys.executable, str(ROOT / "train.py"), "--data", data_path or corpus["data"], "--cache-dir",
           corpus["cache"], "--out", str(tmp_path / "out"), "--device", "cpu", "--preset", "tiny", "--tokenizer",
           "byte", "--seq-len", "32", "--batch-size", "8", "--max-steps", "2", *flags]
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
    line = bad_run(corpus, tmp_path, "--seq-len", "100")
    assert "longer than the tiny model's context (64 tokens)" in line and "--block-size 100" in line
    line = bad_run(corpus, tmp_path, "--seq-len", "100", "--block-size", "96")
    assert "longer than the tiny model's context (96 tokens); use --seq-len 96 or less" in line
    assert "--block-size 100" not in line


def test_block_size_gives_a_longer_context(corpus, tmp_path):
    """--block-size 128 on the tiny preset (64 positions): the run trains on 128-token sequences, its
    checkpoint records the longer table (so sample.py rebuilds it), and a resume at the preset's context is
    refused as another architecture."""
    import checkpoint

    flags = ["--seq-len", "128", "--block-size", "128", "--max-steps", "2", "--sample-tokens", "0"]
    result = run_train(corpus, tmp_path, *flags)
    assert "2 steps of 8 x 128 tokens" in result.stdout
    state = checkpoint.consolidate(checkpoint.latest(tmp_path / "ckpt"))
    assert state["transformer.wpe.weight"].shape == (128, 64)
    refused = run_train(corpus, tmp_path, "--seq-len", "64", "--max-steps", "4", check=False)
    assert refused.returncode == 2 and "incompatible run (model: checkpoint has" in refused.stderr
    assert "'block_size': 128" in refused.stderr and "'block_size': 64" in refused.stderr


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


# ----------------------------------------------------------------------------- the GPU path, from a CPU


def test_more_processes_than_gpus_is_one_clear_line(monkeypatch):
    from support import devices
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")  # even rank 0, which has a GPU, stops: none is left waiting
    with pytest.raises(devices.LayoutError, match=r"2 processes on this node but 1 visible GPU: launch at most 1 "
                                                   r"per node \(torchrun --nproc-per-node 1\), or add --device cpu"):
        devices.local_gpu()


def test_a_gpu_index_is_honoured_alone_and_refused_under_torchrun(monkeypatch):
    """--device cuda:1 in one process trains on GPU 1, made the current GPU (what bf16 and the kernel are
    asked about); under torchrun each process takes its local rank's GPU, so an index is one clear line,
    not silently replaced. Stand-ins for a machine with two GPUs."""
    import parallel
    from support import devices
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    device = devices.pick_device("cuda:1")
    assert device == torch.device("cuda", 1) and chosen == [device]
    assert parallel.layout(1, 1, device).device == device  # not cuda:LOCAL_RANK (0)
    with pytest.raises(devices.ConfigError, match=r"^--device cuda:2: the visible GPUs are cuda:0 to cuda:1$"):
        devices.pick_device("cuda:2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(devices.ConfigError, match=r"^--device cuda:1: under torchrun each process takes the GPU "
                                                 r"of its local rank; pass --device cuda"):
        devices.pick_device("cuda:1")


def test_device_cuda_without_a_gpu_is_one_line(corpus, tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, whatever this machine has
    result = run_train(corpus, tmp_path, "--device", "cuda", check=False, env=env)
    assert result.returncode == 2 and "no CUDA device is visible; use --device cpu" in result.stderr
    assert "Traceback" not in result.stderr


def test_attn_triton_where_it_cannot_run_is_one_line(corpus, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a CPU without the interpreter
    result = run_train(corpus, tmp_path, "--attn", "triton", check=False, env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--attn triton" in result.stderr and "TRITON_INTERPRET=1" in result.stderr


def test_gpu_defaults_fit_the_corpus(tmp_path):
    """What `python train.py` chooses on a GPU, worked out here for a ~1M-token corpus: GPT-2 on 64 x 1024
    tokens a step, about two epochs, and a validation split that holds at least one evaluation batch."""
    cuda = torch.device("cuda")  # only a name here: nothing runs on it
    cfg = config.resolve_defaults(config.TrainConfig(attn="sdpa"), cuda)
    assert (cfg.preset, cfg.seq_len, cfg.batch_size, cfg.precision, cfg.compile) == ("gpt2", 1024, 64, "bf16", True)
    words = [f"w{i}" for i in range(5000)]
    rng = np.random.default_rng(0)
    for i in range(100):  # 100 documents, ~10 kB each: ~1M byte tokens
        (tmp_path / f"doc{i}.txt").write_text(" ".join(rng.choice(words, 1700)))
    prepared = data.prepare(data.DataConfig(source=str(tmp_path), tokenizer="byte", cache_dir=str(tmp_path / "c")),
                            verbose=False)
    train_tokens, val_tokens = (data.load_tokens(prepared / f"{s}.bin", vocab_size=257) for s in ("train", "val"))
    assert 0.9e6 < len(train_tokens) + len(val_tokens) < 1.2e6
    notes = []
    config.resolve_steps(cfg, cuda, len(train_tokens), log=notes.append)
    assert cfg.max_steps == math.ceil(2 * len(train_tokens) / (64 * 1024)) and "two epochs" in notes[0]
    assert len(data.eval_batches(val_tokens, 1024, 64, 4)) >= 1  # the failure on a small stdlib: 0


def test_a_1m_token_corpus_trains_with_no_size_flags(tmp_path):
    rng = np.random.default_rng(1)
    words = [f"w{i}" for i in range(3000)]
    for i in range(100):
        (tmp_path / f"doc{i}.txt").write_text(" ".join(rng.choice(words, 1700)))
    cmd = [sys.executable, str(ROOT / "train.py"), "--data", str(tmp_path), "--tokenizer", "byte", "--device", "cpu",
           "--preset", "tiny", "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "out"),
           "--sample-tokens", "0"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = metrics(tmp_path / "out")
    assert len(rows) == 200 and rows[-1]["val_loss"] < rows[0]["loss"]


def test_compiled_blocks_train_like_eager(corpus, tmp_path):
    """--compile (torch.compile of every block; off by default on a CPU) gives the same run, up to rounding."""
    run_train(corpus, tmp_path / "eager", "--max-steps", "3")
    run_train(corpus, tmp_path / "compiled", "--max-steps", "3", "--compile")
    for a, b in zip(metrics(tmp_path / "eager"), metrics(tmp_path / "compiled"), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert ("val_loss" in b) == ("val_loss" in a)
        assert b.get("val_loss", 0.0) == pytest.approx(a.get("val_loss", 0.0), rel=1e-5)


class StepOnly:
    """What train.forward_backward reads from a Run, for a model on one CPU process."""

    def __init__(self, model, precision: str, micro_batch_size: int):
        self.model, self.precision, self.device = model, stability.PRECISIONS[precision], torch.device("cpu")
        self.cfg = config.TrainConfig(micro_batch_size=micro_batch_size)
        self.scaler, self.pipe, self.sync, self.gather = stability.LossScaler(False), None, None, None
        self.grid, self.step = parallel.Grid(), 0

    @property
    def autocast(self):
        return self.precision.autocast(self.device)


def test_bf16_casts_each_weight_once_per_step_whatever_the_micro_batches():
    from torch.utils._python_dispatch import TorchDispatchMode

    import model as gpt

    class CountWeightCasts(TorchDispatchMode):
        def __init__(self, params):
            super().__init__()
            self.ptrs, self.casts = {p.data_ptr() for p in params}, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.ptrs:
                self.casts += 1
            return func(*args, **(kwargs or {}))

    batch = torch.randint(0, 257, (8, 33))
    casts = {}
    for micro in (8, 2):
        m = gpt.build(gpt.config_from_preset("tiny", 257), seed=0)
        with CountWeightCasts(m.parameters()) as count:
            train.forward_backward(StepOnly(m, "bf16", micro), batch)
        casts[micro] = count.casts
    per_block = 4 * 2  # the weights and biases of the four linear layers
    assert casts == {8: 4 * per_block + 1, 2: 4 * per_block + 1}  # + the tied embedding, as the output layer


# ----------------------------------------------------------------------------- what a step costs the host


class HostReads(TorchFunctionMode):
    """A stand-in for the device-to-host syncs of a step: every read of a tensor's value by Python (on a GPU
    each one waits for the GPU to finish everything queued before it), in order among the step's calls."""

    READS = ("item", "tolist", "__bool__", "__float__", "__int__")

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(getattr(func, "__name__", ""))
        return func(*args, **(kwargs or {}))

    @property
    def reads(self) -> list[int]:
        return [i for i, name in enumerate(self.calls) if name in self.READS]


def in_process_run(corpus, out, *flags):
    """train.setup for one CPU process in this one (the tiny model, the test corpus)."""
    from conftest import TINY
    return train.setup(config.parse_args([*TINY, "--data", corpus["data"], "--cache-dir", corpus["cache"],
                                          "--out", str(out), *flags]))


@pytest.mark.parametrize("flags", [[], ["--precision", "fp16"], ["--zero", "1"]], ids=["fp32", "fp16", "zero1"])
def test_a_step_reads_the_device_once_after_the_update_is_queued(flags, corpus, tmp_path):
    """Whether to take the step (finite loss and gradients, no spike) is decided on the device, and the
    optimizer skips on the device when it must not update: the host reads the step's numbers once, after
    the update has been queued, so the GPU never idles waiting for the host mid-step. (Before: six reads,
    two of them before the optimizer step.) The signal every rank stops for rides on the same read (under
    torchrun it was a read of its own at the top of every step)."""
    run = in_process_run(corpus, tmp_path, "--spike-z", "4", "--spike-window", "2", *flags)
    stop = interrupt.Stop.__new__(interrupt.Stop)  # (no handlers in the test's process)
    stop.signum = 0
    for _ in range(2):  # the spike guard is armed from here on
        train.train_step(run, stop)
        run.step += 1
    stop.signum = 15  # a SIGTERM noted before the step: every rank stops after it
    with HostReads() as host:
        row = train.train_step(run, stop)
    update = host.calls.index("_fused_adamw_")
    assert len(host.reads) == 1 and host.reads[0] > update, [host.calls[i] for i in host.reads]
    assert math.isfinite(row["loss"]) and not row["skipped"] and not row["spike"] and row["signal"] == 15


def test_a_skipped_step_leaves_the_weights_and_the_optimizer_as_they_were(corpus, tmp_path):
    """A non-finite gradient (fp16 at a loss scale of 2^40 overflows): the optimizer is still called,
    and skips on the device: weights, moments and its step count unchanged; the scale backs off."""
    run = in_process_run(corpus, tmp_path, "--precision", "fp16", "--loss-scale", str(2.0**40))
    before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    row = train.train_step(run)
    assert row["skipped"] and not row["bad"] and run.scaler.scale == 2.0**39
    assert all(torch.equal(p, before[n]) for n, p in run.model.named_parameters())
    assert run.opt.state and all(float(s["step"]) == 0 and not s["exp_avg"].any() for s in run.opt.state.values())


def test_the_gradient_norm_is_a_few_ops_whatever_the_number_of_parameters():
    """~600 small kernels a step at GPT-2 when each gradient is squared, summed and added on its own:
    here the number of (non-view) ops of the norm is counted for 2 and 8 layers, with and without ZeRO."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import gradients
    import model as gpt
    import zero

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += not func.is_view
            return func(*args, **(kwargs or {}))

    counts = {}
    for n_layer in (2, 8):
        for stage in (0, 2):
            m = gpt.build(gpt.config_from_preset("tiny", 257, n_layer=n_layer), seed=0)
            grid, sync = parallel.Grid(), None
            for p in m.parameters():
                p.grad = torch.randn_like(p)
            if stage:
                sync = gradients.GradSync(m, grid, zero=stage)
                zero.ZeroAdamW(sync, 1e-3)
                for b in sync.buckets:
                    b.shard_grad.normal_()
            with Ops() as ops:
                norm = gradients.grad_norm(m, grid, sync)
            counts[n_layer, stage] = ops.n
            want = [p.grad for p in m.parameters()] if not stage else [b.shard_grad for b in sync.buckets]
            assert norm.item() == pytest.approx(torch.cat([g.flatten() for g in want]).norm().item(), rel=1e-5)
    assert counts[2, 0] == counts[8, 0] <= 6 and counts[2, 2] == counts[8, 2] <= 6, counts
