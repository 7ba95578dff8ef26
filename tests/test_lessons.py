"""Every lesson's commands run, and print what the lesson says they print: the course cannot drift.

How a lesson (and README.md) is read:

* ```bash blocks are commands a reader runs. A lesson's blocks run in order in one bash session
  (`set -euo pipefail`), in a scratch directory whose *.py, lessons/ and tests/ link to the repository.
* A ```text block right after a ```bash block (nothing but blank lines between) is that block's
  output, as a terminal shows it: stdout and stderr together, in order, and a progress bar as its
  final redraw. It is compared line by line with what the block printed.
* A line `...` in an output block stands for any number of lines the lesson leaves out, and `…`
  within a line for any text (for what the normalizer below does not know varies).
* ```sh blocks (GPUs, clusters) are shown, not run; a ```text block anywhere else is an illustration.

What legitimately varies from run to run is normalized on both sides before the comparison
(`normalize`): durations, throughput, MFU, the path of the standard library, scratch paths, and the
launcher's own warnings. Numbers are then compared by kind: integers (token counts, bytes, steps)
exactly; numbers with a decimal point or an exponent (losses, norms, ratios) within 1% relative, and
two numbers both below 1e-4 in magnitude (rounding noise, such as the difference between two layouts)
count as equal.

The numbers were recorded on the CI machine's environment (`REFERENCE`). On another (a GPU box, or
another Python or PyTorch), the same commands train on the same bytes but round differently, and a
sampled token can flip: there the comparison keeps every line's words and drops its numbers and
sampled text, so the check is the structure of the output, never skipped.
"""

import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT

DOCS = sorted((ROOT / "lessons").glob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n?", re.S | re.M)
REFERENCE = ("3.11", "2.13", "x86_64", "no GPU")  # python, torch, machine the shown outputs were recorded on
MARK = "@@nanoscale-lesson-block@@"


def environment() -> tuple[str, str, str, str]:
    """A GPU box is another machine even where Python and torch match: its CPU rounds the lessons'
    CPU runs through other kernels (its torch is a CUDA build), so a sampled byte can differ."""
    return (f"{sys.version_info.major}.{sys.version_info.minor}", ".".join(torch.__version__.split(".")[:2]),
            platform.machine(), "GPU" if torch.cuda.is_available() else "no GPU")


# ----------------------------------------------------------------------------- reading a lesson


def output_fences(text: str) -> list[tuple[int, re.Match]]:
    """(n, fence) for each ```text block that directly follows the n-th ```bash block (n from 1)."""
    out, prev, n = [], None, 0
    for m in FENCE.finditer(text):
        if m.group(1) == "bash":
            n += 1
        elif m.group(1) == "text" and prev is not None and prev.group(1) == "bash" and \
                not text[prev.end():m.start()].strip():
            out.append((n, m))
        prev = m
    return out


def blocks(text: str) -> list[tuple[str, list[str]]]:
    """[(commands, [shown output])]: each ```bash block, with the ```text block directly after it."""
    out = [(m.group(2), []) for m in FENCE.finditer(text) if m.group(1) == "bash"]
    for n, m in output_fences(text):
        out[n - 1][1].append(m.group(2))
    return out


# ----------------------------------------------------------------------------- what a terminal shows


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def terminal(raw: str) -> list[str]:
    """The lines a terminal would show: a '\\r' redraw (a progress bar) keeps only its last state."""
    lines = []
    for line in ANSI.sub("", raw).split("\n"):
        parts = [p for p in line.split("\r") if p.strip()]
        lines.append(parts[-1].rstrip() if parts else "")
    while lines and not lines[-1]:
        lines.pop()
    return lines


LAUNCHER = re.compile(r"^([WIE]\d{4} \d\d:\d\d:\d\d\.\d+ \d+ .*|\*{10,}|Setting OMP_NUM_THREADS.*|"
                      r"W\d{4} .*|.*warnings\.warn\(.*)$")
VARIES = [  # (pattern, placeholder): what differs between two runs of the same command
    (re.compile(r"\d+:\d\d(:\d\d)?<(\d+:\d\d(:\d\d)?|\?)"), "<elapsed>"),  # tqdm's elapsed<remaining
    (re.compile(r"(\d[\d,.]*|\?)\s?[kMG]?(it|docs?|char|B|band|tok|tokens|files?|rows?)?/s\b"), "<rate>/s"),
    (re.compile(r"(\d[\d,.]*|\?)\s?s/it\b"), "<rate>/s"),
    (re.compile(r"tok_s=\d+"), "tok_s=<rate>"),
    (re.compile(r"\b(mfu|MFU)([=: ]+)\d[\d.]*%"), r"\1\2<mfu>"),
    (re.compile(r"\d[\d,]*(\.\d+)?\s?(ms|µs|us|ns|s|sec|min)\b"), "<time>"),
    (re.compile(r"\d+% of a <time> step"), "<pct> of a <time> step"),
    (re.compile(r"\S*/lib/python3\.\d+"), "<stdlib>"),
    (re.compile(r"/tmp/\S*"), "<tmp>"),
    (re.compile(r"\b[0-9a-f]{12}\b"), "<run id>"),
    (re.compile(r"-[0-9a-f]{16}\b"), "-<cache key>"),  # a prepared corpus: a hash of its files and settings
]


def normalize(line: str) -> str:
    for pattern, placeholder in VARIES:
        line = pattern.sub(placeholder, line)
    return re.sub(r"(?<=\S) {2,}", " ", line)  # a wider number shifts the columns after it; indents stay


def shown(lines: list[str]) -> list[str]:
    return [normalize(x) for x in lines if not LAUNCHER.match(x)]


# ----------------------------------------------------------------------------- comparing


NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?!\d)")
SAMPLED = re.compile(r"(sample: |^> ).*$")  # text a model sampled


def same_number(a: str, b: str) -> bool:
    if not any(c in a + b for c in ".eE"):
        return a == b
    x, y = float(a.replace(",", "")), float(b.replace(",", ""))
    return (abs(x) < 1e-4 and abs(y) < 1e-4) or abs(x - y) <= 0.01 * max(abs(x), abs(y))


def same_line(expected: str, got: str, strict: bool) -> bool:
    if "…" in expected:  # the lesson leaves part of the line out
        return re.fullmatch(".*".join(re.escape(piece) for piece in expected.split("…")), got) is not None
    if not strict:  # another environment: the words of the line, not its numbers or samples
        return NUMBER.sub("#", SAMPLED.sub(r"\1…", expected)) == NUMBER.sub("#", SAMPLED.sub(r"\1…", got))
    if NUMBER.sub("#", expected) != NUMBER.sub("#", got):
        return False
    return all(same_number(a, b) for a, b in zip(NUMBER.findall(expected), NUMBER.findall(got), strict=True))


def match(expected: list[str], got: list[str], strict: bool) -> bool:
    """Do the lines match, a `...` line standing for any run of lines?"""
    if not expected:
        return not got
    if expected[0] == "...":
        return any(match(expected[1:], got[i:], strict) for i in range(len(got) + 1))
    return bool(got) and same_line(expected[0], got[0], strict) and match(expected[1:], got[1:], strict)


def first_difference(expected: list[str], got: list[str], strict: bool) -> str:
    """Where the output stops matching, for the failure message."""
    i = 0
    while i < min(len(expected), len(got)) and expected[i] != "..." and same_line(expected[i], got[i], strict):
        i += 1
    want = expected[i] if i < len(expected) else "(end of output)"
    have = got[i] if i < len(got) else "(end of output)"
    return f"line {i + 1}:\n  lesson shows: {want}\n  command gave: {have}"


# ----------------------------------------------------------------------------- running


def run_blocks(doc: Path, cwd: Path) -> tuple[list, list[list[str]], subprocess.CompletedProcess]:
    """Run every ```bash block of `doc` in one shell; the terminal lines each block printed. The shell
    starts in a scratch directory that links to the repository's files, with a fresh home directory
    (shown as ~) that holds only the GPT-2 tokenizer file, as on a machine that ran the set-up."""
    parts = blocks(doc.read_text())
    script = "".join(f"echo '{MARK}'\n{commands}\n" for commands, _ in parts)
    for item in ROOT.iterdir():  # the lesson sees the repository as its working directory
        if item.suffix == ".py" or item.name in ("lessons", "tests"):
            (cwd / item.name).symlink_to(item)
    home = cwd / "home"
    (home / ".cache" / "nanoscale").mkdir(parents=True)
    if (tokenizer_file := Path.home() / ".cache" / "nanoscale" / "gpt2.tiktoken").exists():
        shutil.copy(tokenizer_file, home / ".cache" / "nanoscale")
    # `python` and `torchrun` in the lesson are the ones running this test; output arrives in order
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONUNBUFFERED": "1",
           "COLUMNS": "120", "HOME": str(home), "OMP_NUM_THREADS": "1"}  # one thread: as the suite runs
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, timeout=900)
    text = result.stdout.decode(errors="replace").replace(str(home), "~")
    outputs = [terminal(chunk.lstrip("\n")) for chunk in text.split(MARK + "\n")[1:]]
    return parts, outputs, result


@pytest.mark.parametrize("doc", DOCS, ids=[p.stem for p in DOCS])
def test_lesson_prints_what_it_shows(doc, tmp_path):
    parts, outputs, result = run_blocks(doc, tmp_path)
    assert parts, f"{doc.name} has no ```bash commands to run"
    transcript = result.stdout.decode(errors="replace")[-6000:]
    assert result.returncode == 0, f"{doc.name}: a command failed (exit {result.returncode}):\n{transcript}"
    assert len(outputs) == len(parts), f"{doc.name}: a block did not run:\n{transcript}"
    strict = environment() == REFERENCE
    for n, ((commands, texts), got) in enumerate(zip(parts, outputs), 1):
        for text in texts:
            want, have = shown(text.rstrip("\n").split("\n")), shown(got)
            assert match(want, have, strict), (
                f"{doc.name}, bash block {n} ({commands.strip().splitlines()[0][:80]}): the shown output has "
                f"drifted at {first_difference(want, have, strict)}\n--- it printed ---\n" + "\n".join(got))


# ----------------------------------------------------------------------------- the checker itself


def test_the_checker_catches_drift_and_forgives_what_varies():
    lesson = "```bash\necho hi\n```\n\n```text\nloss 2.4636\n...\ndone\n```\nprose\n```text\nnot output\n```\n"
    (commands, texts), = blocks(lesson)
    assert commands == "echo hi\n" and texts == ["loss 2.4636\n...\ndone\n"]
    want = shown(["loss 2.4636", "...", "done"])
    assert match(want, shown(["loss 2.4640", "a", "b", "done"]), strict=True)  # 0.02%: rounding
    assert not match(want, shown(["loss 2.5136", "done"]), strict=True)  # 2%: drift
    assert not match(want, shown(["loss 2.4636"]), strict=True)  # a line is missing
    assert match(want, shown(["loss 9.9", "done"]), strict=False)  # another machine: the words only
    assert not match(want, shown(["val 2.4636", "done"]), strict=False)
    assert not match(shown(["34,321 train"]), shown(["34,322 train"]), strict=True)  # integers are exact
    assert match(shown(["difference: 1.8e-07"]), shown(["difference: 0.0"]), strict=True)  # both noise
    bar = "\r  0%|          | 0/60 [00:00<?, ?it/s]\r100%|##########| 60/60 [00:01<00:00, 47.10it/s, loss=2.464]\n"
    assert shown(terminal(bar)) == shown(["100%|##########| 60/60 [00:09<00:00, 6.2it/s, loss=2.464]"])
    assert normalize("paid 48.9 ms a save (271% of a 18 ms step") == "paid <time> a save (<pct> of a <time> step"
    assert normalize("/usr/lib/python3.12/json (20 files)") == "<stdlib>/json (20 files)"
    assert normalize("  a  [00:07<00:00,  2.25it/s]") == normalize("  a [00:00<00:00, 53.57it/s]")
    assert normalize("[00:00<00:00, 13695.69band/s] 10.7MB/s") == normalize("[00:01<00:00, 9.1band/s] 2MB/s")
    assert match(shown(["peak 216 GFLOP/s …"]), shown(["peak 216 GFLOP/s (27.7%)"]), strict=True)
    assert not match(shown(["peak 216 GFLOP/s …"]), shown(["peak 217 GFLOP/s (27.7%)"]), strict=True)


# ----------------------------------------------------------------------------- writing a lesson


def write_outputs(doc: Path) -> list[int]:
    """Run `doc`'s commands and put what each block printed into the ```text block after it, where the
    shown output no longer matches (a matching block, `...` elisions and all, is left as written).
    Returns the numbers of the bash blocks rewritten. For authors: then read the diff, and the prose."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        _, outputs, result = run_blocks(doc, Path(tmp))
    if result.returncode != 0:
        sys.exit(f"{doc.name}: a command failed:\n{result.stdout.decode(errors='replace')[-4000:]}")
    text, rewritten = doc.read_text(), []
    for n, m in reversed(output_fences(text)):
        if not match(shown(m.group(2).rstrip("\n").split("\n")), shown(outputs[n - 1]), strict=True):
            text = text[:m.start()] + "```text\n" + "\n".join(outputs[n - 1]) + "\n```\n" + text[m.end():]
            rewritten.insert(0, n)
    doc.write_text(text)
    return rewritten


if __name__ == "__main__":  # python tests/test_lessons.py lessons/07-data-parallel.md ...
    for arg in sys.argv[1:]:
        print(f"{arg}: rewrote the output of bash blocks {write_outputs(Path(arg).resolve()) or 'none'}")
