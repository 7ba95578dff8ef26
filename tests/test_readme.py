"""The README's two commands are what a new user types first, on whatever machine they have: often a
fresh container where they are root and there is no `sudo`. They must work there, and CI must run
exactly what the README shows (`.ci/run` is the test command, line for line), so neither can drift
from the other.
"""

import ast
import os
import re
import stat
import subprocess
from pathlib import Path

from conftest import ROOT

README = (ROOT / "README.md").read_text()


def readme_commands() -> tuple[list[str], list[str]]:
    """The lines of the README's train command and of its test command (its first two ```sh blocks)."""
    start = README.index("## Two commands")
    section = README[start:README.index("\n## ", start)]
    train, test = re.findall(r"^```sh\n(.*?)^```", section, re.S | re.M)[:2]
    return train.strip().splitlines(), test.strip().splitlines()


def ci_commands() -> list[str]:
    """The lines .ci/run executes after its set-up (`set -euo pipefail`, `cd` to the repository)."""
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    body = lines[next(i for i, ln in enumerate(lines) if ln.startswith("cd ")) + 1:]
    return [ln for ln in body if ln.strip() and not ln.lstrip().startswith("#")]


def test_ci_runs_the_readme_test_command_verbatim():
    train, test = readme_commands()
    assert ci_commands() == test
    assert os.stat(ROOT / ".ci" / "run").st_mode & stat.S_IXUSR
    run = (ROOT / ".ci" / "run").read_text()
    assert run.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in run
    for line in train + test[1:]:  # nothing but the Chromium line may need more than a user's rights
        assert "sudo" not in line and "apt-get" not in line, line
    assert len(train) == 1 and train[0].endswith("&& python train.py")
    assert "ruff check ." in test[-1] and test[-1].endswith("python -m pytest -q -n 2")


def run_chromium_line(tmp_path: Path, tools: list[str]) -> list[str]:
    """Run the test command's first line in bash with a PATH of stubs that log how they were called:
    `tools` among apt-get, sudo, chromium. Returns the log."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir(parents=True)
    for tool in tools:
        stub = bin_dir / tool
        run_rest = 'exec "$@"' if tool == "sudo" else "true"  # sudo runs the command it was given
        stub.write_text(f'#!/bin/sh\necho "{tool} $*" >> {log}\n{run_rest}\n')
        stub.chmod(0o755)
    line = readme_commands()[1][0]
    subprocess.run(["/bin/bash", "-euo", "pipefail", "-c", line], check=True, capture_output=True, text=True,
                   env={"PATH": str(bin_dir), "HOME": str(tmp_path)})
    return log.read_text().splitlines() if log.exists() else []


def test_the_chromium_line_works_as_root_without_sudo_and_as_a_user_with_sudo(tmp_path):
    as_root = run_chromium_line(tmp_path / "root", ["apt-get"])  # a container: root, no sudo
    assert as_root == ["apt-get update -q", "apt-get install -y -q chromium"]
    with_sudo = run_chromium_line(tmp_path / "user", ["apt-get", "sudo"])
    assert with_sudo == ["sudo apt-get update -q", "apt-get update -q", "sudo apt-get install -y -q chromium",
                         "apt-get install -y -q chromium"]
    assert run_chromium_line(tmp_path / "has", ["apt-get", "sudo", "chromium"]) == []  # installed: nothing to do


def skips_in(path: Path) -> list[str]:
    """Where a test file skips: pytest.skip / skipif / importorskip / mark.skip, by line."""
    tree = ast.parse(path.read_text())
    return [f"{path.name}:{node.lineno}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr in ("skip", "skipif", "importorskip")]


def test_the_readme_says_which_tests_the_suite_skips():
    """README: test_gpu.py's tests are the only ones skipped: without CUDA (one mark for the file), and its
    2-GPU cases on one GPU (one mark, `needs_2_gpus`)."""
    assert "its tests are the only ones the suite skips" in README
    others = [s for f in sorted((ROOT / "tests").glob("test_*.py")) if f.name != "test_gpu.py" for s in skips_in(f)]
    assert others == []
    gpu = (ROOT / "tests" / "test_gpu.py").read_text()
    assert 'pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")' in gpu
    assert 'needs_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")' in gpu
    assert len(skips_in(ROOT / "tests" / "test_gpu.py")) == 2
