"""Every lesson's commands run, so the course never rots.

A lesson marks the commands a reader should run as ```bash blocks; this test runs each lesson's
blocks in order, in one shell, inside a scratch directory that links to the repository's files.
Commands that need a GPU or a cluster are shown in ```sh blocks, which are not run.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

LESSONS = sorted((ROOT / "lessons").glob("*.md"))
BASH_BLOCK = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)


def lesson_script(path: Path) -> str:
    return "\n".join(BASH_BLOCK.findall(path.read_text()))


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_lesson_commands_run(lesson, tmp_path):
    script = lesson_script(lesson)
    assert script.strip(), f"{lesson.name} has no ```bash commands to run"
    for item in ROOT.iterdir():  # the lesson sees the repository as its working directory
        if item.suffix == ".py" or item.name in ("lessons", "tests"):
            (tmp_path / item.name).symlink_to(item)
    # `python` and `torchrun` in the lesson are the ones running this test
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{lesson.name} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
