"""The GPU half's own machinery, on a CPU: the parsing tests/test_gpu.py does of what train.py prints
(which cannot run here)."""

import subprocess
import sys
from pathlib import Path

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

