"""Checkpoints across layouts, killed ranks under the launcher, and two "nodes" on one machine."""

import os
import socket
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, TINY, assert_same_weights, final_weights, metrics, run_train

RUN = ["--max-steps", "8", "--ckpt-every", "4", "--eval-every", "4"]


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    """The run that never changes layout or dies."""
    out = tmp_path_factory.mktemp("straight")
    run_train(corpus, out, *RUN)
    return out


def assert_continues_like(straight, out, rel=1e-5):
    ref, got = metrics(straight), metrics(out)
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=rel), b["step"]
    assert_same_weights(final_weights(out), final_weights(straight))


@pytest.mark.parametrize("saved,loaded", [
    ((4, ["--tp", "2", "--pp", "2", "--micro-batch-size", "2"]), (4, ["--pp", "4", "--micro-batch-size", "1"])),
    ((4, ["--zero", "3"]), (2, ["--zero", "1"])),
    ((4, ["--zero", "3"]), (1, [])),
    ((1, []), (4, ["--tp", "2", "--cp", "2", "--zero", "3"])),
    ((4, ["--cp", "2", "--cp-attn", "ulysses", "--zero", "1"]), (4, ["--zero", "3"])),
], ids=["tp2pp2-to-pp4", "dp4zero3-to-dp2zero1", "dp4zero3-to-1", "1-to-tp2cp2zero3", "cp2dp2zero1-to-dp4zero3"])
def test_a_checkpoint_continues_at_another_layout(saved, loaded, straight, corpus, tmp_path):
    (n1, f1), (n2, f2) = saved, loaded
    killed = run_train(corpus, tmp_path, *RUN, *f1, "--crash-at", "rank:0:step:4", nproc=n1, check=False)
    assert killed.returncode != 0
    resumed = run_train(corpus, tmp_path, *RUN, *f2, nproc=n2)
    assert "(step 4)" in resumed.stdout
    assert_continues_like(straight, tmp_path)


def test_a_killed_rank_restarts_and_resumes_under_torchrun(corpus, tmp_path):
    flags = [*RUN, "--ckpt-every", "2"]
    run_train(corpus, tmp_path / "straight", *flags, nproc=2)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
           str(ROOT / "train.py"), "--data", corpus["data"], "--cache-dir", corpus["cache"], "--out",
           str(tmp_path / "killed"), *TINY, *flags, "--crash-at", "rank:1:step:5"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from" in result.stdout and "(step 4)" in result.stdout  # the second attempt
    assert [r["loss"] for r in metrics(tmp_path / "killed")] == [r["loss"] for r in metrics(tmp_path / "straight")]
    wa, wb = final_weights(tmp_path / "straight"), final_weights(tmp_path / "killed")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_two_launchers_on_localhost_reproduce_one_process(straight, corpus, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launchers = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", f"--node-rank={node}",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=nanoscale-test",
         str(ROOT / "train.py"), "--data", corpus["data"], "--cache-dir", corpus["cache"], "--out", str(tmp_path),
         *TINY, *RUN, "--tp", "2"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node in range(2)]
    outputs = [p.communicate(timeout=300) for p in launchers]
    for p, (_, err) in zip(launchers, outputs):
        assert p.returncode == 0, err[-3000:]
    assert_continues_like(straight, tmp_path)
