"""The GPU half's own machinery, on a CPU: tests/gpu_run.py (the one prepared GPU run) in its smoke mode,
a stage that hangs, and the parsing tests/test_gpu.py does of what train.py prints (which cannot run here)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import gpu_run
from conftest import ROOT, saved_share


def memory_report(corpus: dict, out: Path, preset: str) -> str:
    cmd = [sys.executable, "train.py", "--device", "cpu", "--preset", preset, "--tokenizer", "byte", "--seq-len", "32",
           "--batch-size", "4", "--max-steps", "1", "--sample-tokens", "0", "--zero", "3", "--memory-report",
           "--data", corpus["data"], "--cache-dir", corpus["cache"], "--out", str(out)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_the_gpu_memory_report_test_reads_gpt2_and_llama_lines(corpus, tmp_path):
    """test_gpu.py's test_memory_report_on_cuda reads the activations line of --memory-report (conftest's
    saved_share): a GPT-2's goes on with Korthikanti et al.'s formula after ours, a Llama's ends with ours;
    both must read as ~100%."""
    for preset in ("tiny", "llama-tiny"):
        share = saved_share(memory_report(corpus, tmp_path / preset, preset))
        assert 0.9 < share < 1.1, (preset, share)


def smoke(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess, dict, dict]:
    """tests/gpu_run.py --device cpu: its exit, its gpu_table.json, and that table's rows by key."""
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "tests/gpu_run.py", "--device", "cpu", "--out", str(out), *flags],
                            cwd=ROOT, capture_output=True, text=True)
    table = json.loads((out / "gpu_table.json").read_text())
    return result, table, {r["key"]: r for r in table["rows"]}


def test_the_smoke_run_starts_and_reads_every_stage(tmp_path):
    """The whole orchestration at toy sizes: every stage runs and its output is read into its rows, in the
    order of the stages (test_gpu.py skips whole without CUDA, and says how many cases it holds), and
    nothing is judged against the GPU targets. nanoGPT runs where its folder is found (.gpu/nanogpt after
    --prepare, or shared/peers/ beside the checkout); where it is not (a CI machine), its rows say so."""
    result, table, rows = smoke(tmp_path)
    peer = gpu_run.find_nanogpt()
    assert list(rows) == [k for keys in gpu_run.ROW_KEYS.values() for k in keys], list(rows)
    assert result.returncode == (0 if peer else 1), result.stdout[-3000:] + result.stderr[-3000:]
    tests = re.fullmatch(r"0 passed, 0 failed, (\d+) skipped \((\d+) needs a CUDA GPU; (\d+) needs 2 GPUs\), "
                         r"0 not run, of (\d+); \d+ s", rows["tests"]["measured"])
    assert tests and int(tests[1]) == int(tests[4]) == int(tests[2]) + int(tests[3]) >= 18, rows["tests"]
    for key in ("attention.d64", "attention.d128", "attention.auto", "gpt2.ours", "fp8.linear", "fp8.llama"):
        assert rows[key]["value"] > 0, rows[key]
    assert 0 <= rows["fp8.llama_loss"]["value"] < 0.05, rows["fp8.llama_loss"]  # the same batch, 9 steps
    if peer:
        ratio = rows["gpt2.ours"]["value"] / rows["gpt2.nanogpt"]["value"]
        assert rows["gpt2.ratio"]["measured"] == f"{ratio:.2f}x", rows["gpt2.ratio"]
    else:
        assert rows["gpt2.nanogpt"]["measured"].startswith("not run: nanoGPT not found"), rows["gpt2.nanogpt"]
    assert all(r["met"] is None for r in rows.values())
    assert {n: s["status"] for n, s in table["stages"].items() if n != "nanogpt" or peer} == \
        {n: "ok" for n in gpu_run.RUNNERS if n != "nanogpt" or peer}
    text = (tmp_path / "out" / "gpu_table.md").read_text()
    assert all(r["measure"].replace("|", "\\|") in text for r in rows.values()) and text in result.stdout
    log = (tmp_path / "out" / "gpu_run.log").read_text()
    assert all(f"======== {name}: " in log for name in table["stages"])


def test_a_stage_that_hangs_is_ended_whole_and_the_next_stage_runs(tmp_path):
    """The tests stage never ends (--hang: its process waits on a child in a session of its own): at its cap
    the stage is killed with that child, its row says it timed out, and the next stage still runs and is read.
    The run exits 1 (a stage did not finish) with the table written."""
    result, table, rows = smoke(tmp_path, "--only", "tests,fp8-linear", "--hang", "tests", "--cap", "tests=15")
    assert result.returncode == 1, result.stderr[-3000:]
    assert table["stages"]["tests"]["status"] == "timed out after 15 s", table["stages"]
    assert rows["tests"]["measured"].startswith("timed out after 15 s: 0 passed"), rows["tests"]
    assert table["stages"]["fp8-linear"]["status"] == "ok" and rows["fp8.linear"]["value"] > 0, rows
    child = int(re.search(r"hanging: pid (\d+)", (tmp_path / "out" / "gpu_run.log").read_text()).group(1))
    status = Path(f"/proc/{child}/status")
    try:  # gone, a zombie, or (an instant after the kill) SIGKILL still pending: never asleep as it was
        fields = dict(ln.split(":", 1) for ln in status.read_text().splitlines())
    except FileNotFoundError:
        return
    pending = int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)
    assert fields["State"].split()[0] in "ZX" or pending & (1 << 8), fields["State"]
