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
(`normalize`): durations in any format (pytest's "in 66.46s (0:01:06)" too), throughput, MFU, the
path of the standard library, scratch paths, and the launcher's own warnings. Numbers are then
compared by kind: integers (token counts, bytes, steps) exactly; numbers with a decimal point or an
exponent (losses, norms, ratios) within 1% relative, and two numbers both below 1e-4 in magnitude
(rounding noise, such as the difference between two layouts) count as equal.

Identities (run ids, the cache keys of prepared data) are new on every run or every machine, but not
arbitrary: a lesson that prepared data under one key and then uses it must show the same key twice.
So they are compared as a one-to-one correspondence over the whole lesson (`Identities`): each id the
page shows stands for exactly one id the run printed, and the other way round.

What is deterministic. On one machine the same command gives the same bits every time: training,
evaluation and sampling alike (one thread, as here; the number of threads changes how sums are split,
and so the rounding). Another CPU rounds differently: PyTorch's kernels and MKL's pick their code by
the instruction set and the caches, and the difference grows over a run's steps. A loss then moves in
its 5th digit, and a sampled token can flip, after which the sampled text is another one. So the
comparison has three levels:

* "exact", in the environment the pages were recorded in (`REFERENCE`: Python, PyTorch, machine, no
  GPU, and `cpu_rounding()`, a hash of the bits a few fixed computations give on one thread): all of
  the above, sampled text included;
* "numbers", with the same software on a CPU that rounds otherwise: the same, but for the sampled
  text, which is not compared, and for rounding noise, which grows: two numbers both below 1e-2 in
  magnitude (the difference of two runs' losses, say) count as equal;
* "words", anywhere else (a GPU box, another Python or PyTorch): every line's words, not its numbers
  or samples, so the check is the structure of the output, never skipped.

Off the recording CPU, some blocks claim less than their digits: a run that blows up, a count of values
that cross a rounding boundary, a drawing of a curve, a sample. A comment between such a block and its
output says what its claim is, and that is what the "numbers" and "words" levels check (the "exact"
level compares it as any other; GitHub does not show the comment):

* `<!-- check: chaotic -->`: the run amplifies rounding: the words, and each number (integers too)
  within a factor of 2 of the page's, with its sign (0 only as 0): its order of magnitude;
* `<!-- check: plot -->`: a character drawing: as many lines, the same numbers on each, and every drawn
  character one row higher or lower at most, in its column;
* `<!-- check: sampled -->`: the lines after the first are text a model sampled: not compared.

tests/test_lessons.py runs such blocks where PyTorch's and MKL's kernels round otherwise (`ELSEWHERE`).
"""

import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT

DOCS = sorted((ROOT / "lessons").glob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n?", re.S | re.M)
# python, torch, machine, GPU, cpu_rounding(): where the shown outputs were recorded
REFERENCE = ("3.11", "2.13", "x86_64", "no GPU", "3bdcccf173e4")
MARK = "@@nanoscale-lesson-block@@"


@functools.cache
def cpu_rounding() -> str:
    """How this CPU rounds what the lessons run, as a hash of the bits one thread gets from a few fixed
    computations: matmuls with long inner dimensions (their blocking follows the instruction set and the
    caches), a softmax, exponentials summed, attention forward and backward, LayerNorm, GELU. Measured on
    the recording CPU (an AMD EPYC with AVX-512): PyTorch's AVX2 kernels in its place (ATEN_CPU_CAPABILITY=
    avx2), its scalar ones (=default) and MKL's compatible code (MKL_CBWR=COMPATIBLE) each change it, and
    each changes what the lessons print as a CPU of another kind does (`ELSEWHERE`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the lessons run
    try:
        g = torch.Generator().manual_seed(0)
        a, b, c = (torch.randn(shape, generator=g) for shape in ((256, 1024), (1024, 768), (4096, 64)))
        q = torch.randn(2, 4, 128, 64, generator=g, requires_grad=True)
        y = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        y.square().sum().backward()
        outs = [a @ b, a.t() @ a, a.reshape(64, 4096) @ c, torch.softmax(a, -1), a.exp().sum(0), y, q.grad,
                F.layer_norm(a, (1024,)), F.gelu(a, approximate="tanh")]
        return hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in outs)).hexdigest()[:12]
    finally:
        torch.set_num_threads(threads)


def environment() -> tuple[str, ...]:
    """A GPU box is another machine even where Python and torch match: its CPU rounds the lessons'
    CPU runs through other kernels (its torch is a CUDA build), so a sampled byte can differ."""
    return (f"{sys.version_info.major}.{sys.version_info.minor}", ".".join(torch.__version__.split(".")[:2]),
            platform.machine(), "GPU" if torch.cuda.is_available() else "no GPU", cpu_rounding())


def level(env: tuple[str, ...]) -> str:
    """How strictly this environment's outputs are compared with the pages' (see the top)."""
    return "exact" if env == REFERENCE else "numbers" if env[:4] == REFERENCE[:4] else "words"


# ----------------------------------------------------------------------------- reading a lesson


CHECK = re.compile(r"<!-- check: (chaotic|plot|sampled) -->")  # how a block's output is compared elsewhere


def output_fences(text: str) -> list[tuple[int, re.Match]]:
    """(n, fence) for each ```text block that directly follows the n-th ```bash block (n from 1): nothing
    but blank lines between them, and at most a CHECK comment."""
    out, prev, n = [], None, 0
    for m in FENCE.finditer(text):
        if m.group(1) == "bash":
            n += 1
        elif m.group(1) == "text" and prev is not None and prev.group(1) == "bash" and \
                not CHECK.sub("", text[prev.end():m.start()], count=1).strip():
            out.append((n, m))
        prev = m
    return out


def blocks(text: str) -> list[tuple[str, list[tuple[str, str]]]]:
    """[(commands, [(shown output, its check)])]: each ```bash block, with the ```text block directly after
    it and the word of the CHECK comment between them ("" where there is none)."""
    out = [(m.group(2), []) for m in FENCE.finditer(text) if m.group(1) == "bash"]
    for n, m in output_fences(text):
        check = CHECK.search(text, text.rfind("```", 0, m.start() - 1), m.start())  # from the command's end
        out[n - 1][1].append((m.group(2), check.group(1) if check else ""))
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
    (re.compile(r"\b\d+:\d\d:\d\d\b"), "<time>"),  # a duration as a clock: h:mm:ss
    (re.compile(r"(\d[\d,.]*|\?)\s?[kMG]?(it|docs?|char|B|band|tok|tokens|files?|rows?)?/s\b"), "<rate>/s"),
    (re.compile(r"(\d[\d,.]*|\?)\s?s/it\b"), "<rate>/s"),
    (re.compile(r"tok_s=\d+"), "tok_s=<rate>"),
    (re.compile(r"\b(mfu|MFU)([=: ]+)\d[\d.]*%"), r"\1\2<mfu>"),
    (re.compile(r"(?<![\w.])\d[\d,]*(\.\d+)?\s?(ms|µs|us|ns|s|sec|min)\b"), "<time>"),  # not "A100s"
    (re.compile(r"<time> \(<time>\)"), "<time>"),  # pytest past a minute: "in 66.46s (0:01:06)"
    (re.compile(r"\d+% of a <time> step"), "<pct> of a <time> step"),
    (re.compile(r"\S*/lib/python3\.\d+"), "<stdlib>"),
    (re.compile(r"/tmp/\S*"), "<tmp>"),
]
# a run id, and the cache key of a prepared corpus (a hash of its files, their times, and the settings)
IDS = re.compile(r"\b(?P<run_id>[0-9a-f]{12})\b|-(?P<cache_key>[0-9a-f]{16})\b")


def split_ids(line: str) -> tuple[str, list[str]]:
    """(the line normalized, its identities in order): each identity is replaced by a placeholder of
    its kind, and compared separately (Identities)."""
    for pattern, placeholder in VARIES:
        line = pattern.sub(placeholder, line)
    ids = [f"{m.lastgroup} {m.group(m.lastgroup)}" for m in IDS.finditer(line)]
    line = IDS.sub(lambda m: "<run id>" if m.lastgroup == "run_id" else "-<cache key>", line)
    return re.sub(r"(?<=\S) {2,}", " ", line), ids  # a wider number shifts the columns after it; indents stay


def normalize(line: str) -> str:
    return split_ids(line)[0]


def kept(lines: list[str]) -> list[str]:
    return [x for x in lines if not LAUNCHER.match(x)]


def shown(lines: list[str]) -> list[str]:
    return [normalize(x) for x in kept(lines)]


class Identities:
    """The one-to-one correspondence between the ids a page shows and those its run printed."""

    def __init__(self):
        self.run_of, self.page_of = {}, {}

    def pair(self, page: list[str], run: list[str]) -> str | None:
        """Record that a page line showing `page` matched a run line printing `run`; what contradicts an
        earlier pair, if anything."""
        for want, got in zip(page, run, strict=True):
            if self.run_of.setdefault(want, got) != got:
                return f"the page shows {want} for both {self.run_of[want]} and {got} of the run"
            if self.page_of.setdefault(got, want) != want:
                return f"the run printed {got} where the page shows both {self.page_of[got]} and {want}"
        return None

    def check(self, want: list[str], got: list[str], pairs: list[tuple[int, int]]) -> str | None:
        """pair() for every matched line of a block: `pairs` from align (lines as `kept` returns them)."""
        for i, page, run in id_pairs(want, got, pairs):
            if problem := self.pair(page, run):
                return f"line {i + 1}: {problem}"
        return None


def id_pairs(want: list[str], got: list[str], pairs: list[tuple[int, int]]):
    """(line, the page's ids, the run's ids) of each pair of matched lines that show as many ids (a
    line with `…` can hide some of the run's: then its ids are not paired)."""
    for i, j in pairs:
        page, run = split_ids(want[i])[1], split_ids(got[j])[1]
        if len(page) == len(run):
            yield i, page, run


# ----------------------------------------------------------------------------- comparing


NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?!\d)")
SAMPLED = re.compile(r"(sample: |^> ).*$")  # text a model sampled


NOISE = {"exact": 1e-4, "numbers": 1e-2}  # below this, two numbers are both rounding noise (see the top)


def same_number(a: str, b: str, noise: float = NOISE["exact"]) -> bool:
    if not any(c in a + b for c in ".eE"):
        return a == b
    x, y = float(a.replace(",", "")), float(b.replace(",", ""))
    return (abs(x) < noise and abs(y) < noise) or abs(x - y) <= 0.01 * max(abs(x), abs(y))


def same_magnitude(a: str, b: str, noise: float = NOISE["numbers"]) -> bool:
    """A chaotic block's numbers on another CPU: the same sign, and within a factor of 2 (0 only as 0)."""
    x, y = float(a.replace(",", "")), float(b.replace(",", ""))
    small = any(c in a + b for c in ".eE") and abs(x) < noise and abs(y) < noise
    return x == y or small or (x * y > 0 and max(abs(x), abs(y)) <= 2 * min(abs(x), abs(y)))


def same_line(expected: str, got: str, level: str, check: str = "") -> bool:
    if "…" in expected:  # the lesson leaves part of the line out
        return re.fullmatch(".*".join(re.escape(piece) for piece in expected.split("…")), got) is not None
    if level != "exact":  # another CPU: the sampled text is another one after a flipped token
        expected, got = SAMPLED.sub(r"\1…", expected), SAMPLED.sub(r"\1…", got)
    if level == "words":  # another environment: the words of the line, not its numbers
        return NUMBER.sub("#", expected) == NUMBER.sub("#", got)
    if NUMBER.sub("#", expected) != NUMBER.sub("#", got):
        return False
    same = same_magnitude if check == "chaotic" and level == "numbers" else \
        functools.partial(same_number, noise=NOISE[level])
    return all(same(a, b) for a, b in zip(NUMBER.findall(expected), NUMBER.findall(got), strict=True))


def same_drawing(expected: list[str], got: list[str], level: str) -> bool:
    """A `plot` block elsewhere: as many lines, the same numbers on each (as same_line compares them), and
    each drawn character of either side within one row, in its column, of the same character of the other."""
    if len(expected) != len(got):
        return False
    for a, b in zip(expected, got):
        xs, ys = NUMBER.findall(a), NUMBER.findall(b)
        if level != "words" and (len(xs) != len(ys) or not all(map(same_number, xs, ys, [NOISE[level]] * len(xs)))):
            return False
    blank = [[NUMBER.sub(lambda m: " " * len(m.group()), line) for line in side] for side in (expected, got)]

    def near(src: list[str], dst: list[str]) -> bool:
        return all(any(c < len(dst[j]) and dst[j][c] == ch for j in range(max(i - 1, 0), min(i + 2, len(dst))))
                   for i, line in enumerate(src) for c, ch in enumerate(line) if ch != " ")
    return near(*blank) and near(*reversed(blank))


def align(expected: list[str], got: list[str], level: str, check: str = "", at: tuple[int, int] = (0, 0)) \
        -> list | None:
    """The (expected, got) line pairs that match, a `...` line standing for any run of lines; None when
    the lines do not match."""
    if not expected:
        return None if got else []
    if expected[0] == "...":
        return next((pairs for i in range(len(got) + 1) if (pairs := align(
            expected[1:], got[i:], level, check, (at[0] + 1, at[1] + i))) is not None), None)
    if not got or not same_line(expected[0], got[0], level, check):
        return None
    rest = align(expected[1:], got[1:], level, check, (at[0] + 1, at[1] + 1))
    return None if rest is None else [at] + rest


def compare(want: list[str], have: list[str], level: str, check: str = "") -> list | None:
    """align() of a block's kept lines as its CHECK says, off the machine it was recorded on (see the top)."""
    if check == "plot" and level != "exact":
        return [(i, i) for i in range(len(want))] if same_drawing(want, have, level) else None
    if check == "sampled" and level != "exact":
        want = want[:1] + ["..."]
    return align(shown(want), shown(have), level, check)


def match(expected: list[str], got: list[str], level: str, check: str = "") -> bool:
    return compare(expected, got, level, check) is not None


def first_difference(expected: list[str], got: list[str], level: str, check: str = "") -> str:
    """Where the output stops matching, for the failure message."""
    i = 0
    while i < min(len(expected), len(got)) and expected[i] != "..." and same_line(expected[i], got[i], level, check):
        i += 1
    want = expected[i] if i < len(expected) else "(end of output)"
    have = got[i] if i < len(got) else "(end of output)"
    return f"line {i + 1}:\n  lesson shows: {want}\n  command gave: {have}"


# ----------------------------------------------------------------------------- running


def run_blocks(doc: Path, cwd: Path, only: tuple[int, ...] = (), env: dict | None = None) \
        -> tuple[list, list[list[str]], subprocess.CompletedProcess]:
    """Run the ```bash blocks of `doc` (all, or the numbers in `only`, from 1) in one shell, with `env` added
    to its environment; the blocks run, and the terminal lines each printed. The shell starts in a scratch
    directory that links to the repository's files, with a fresh home directory (shown as ~) that holds
    only the GPT-2 tokenizer file, as on a machine that ran the set-up."""
    parts = [part for n, part in enumerate(blocks(doc.read_text()), 1) if not only or n in only]
    script = "".join(f"echo '{MARK}'\n{commands}\n" for commands, _ in parts)
    for item in ROOT.iterdir():  # the lesson sees the repository as its working directory
        if item.suffix == ".py" or item.name in ("lessons", "tests", "support", "instruments"):
            (cwd / item.name).symlink_to(item)
    home = cwd / "home"
    (home / ".cache" / "nanoscale").mkdir(parents=True)
    if (tokenizer_file := Path.home() / ".cache" / "nanoscale" / "gpt2.tiktoken").exists():
        shutil.copy(tokenizer_file, home / ".cache" / "nanoscale")
    # `python` and `torchrun` in the lesson are the ones running this test; output arrives in order
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONUNBUFFERED": "1",
           "COLUMNS": "120", "HOME": str(home), "OMP_NUM_THREADS": "1", **(env or {})}  # one thread: as recorded
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, timeout=900)
    text = result.stdout.decode(errors="replace").replace(str(home), "~")
    outputs = [terminal(chunk.lstrip("\n")) for chunk in text.split(MARK + "\n")[1:]]
    return parts, outputs, result


def check_outputs(doc: Path, parts: list, outputs: list[list[str]], result, strictness: str) -> None:
    """Each block printed what the page shows, at `strictness` (see the top); ids one-to-one over them."""
    transcript = result.stdout.decode(errors="replace")[-6000:]
    assert result.returncode == 0, f"{doc.name}: a command failed (exit {result.returncode}):\n{transcript}"
    assert len(outputs) == len(parts), f"{doc.name}: a block did not run:\n{transcript}"
    ids = Identities()
    for (commands, texts), got in zip(parts, outputs):
        where = f"{doc.name}, the bash block {commands.strip().splitlines()[0][:80]!r}"
        for text, check in texts:
            want, have = kept(text.rstrip("\n").split("\n")), kept(got)
            pairs = compare(want, have, strictness, check)
            drift = first_difference(shown(want), shown(have), strictness, check)
            assert pairs is not None, f"{where}: the shown output has drifted at {drift}\n--- it printed ---\n" + \
                "\n".join(got)
            problem = ids.check(want, have, pairs)
            assert problem is None, f"{where}, {problem}\n--- it printed ---\n" + "\n".join(got)


@pytest.mark.parametrize("doc", DOCS, ids=[p.stem for p in DOCS])
def test_lesson_prints_what_it_shows(doc, tmp_path):
    parts, outputs, result = run_blocks(doc, tmp_path)
    assert parts, f"{doc.name} has no ```bash commands to run"
    check_outputs(doc, parts, outputs, result, level(environment()))


# Where a CPU rounds otherwise (measured here: each changes cpu_rounding): PyTorch's AVX2 kernels, its scalar
# ones, and MKL's most compatible code. The blocks whose claim is a blow-up, a count of values that cross a
# rounding boundary, a drawing or a sample are checked there, with the blocks they need run first, each
# lesson under kernels that change what it prints here (measured; the others pass it too, at more cost).
# (Lesson 1's blocks print the same digits under all three today, measured: nothing to check there.)
ELSEWHERE = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2"}, "scalar": {"ATEN_CPU_CAPABILITY": "default"},
             "mkl": {"MKL_CBWR": "COMPATIBLE"}}
NEEDED = {"02-stable-training": (1, 8), "17-fp8": (1, 6, 7)}
RUNS = [("02-stable-training", "avx2"), ("02-stable-training", "mkl"), ("17-fp8", "scalar")]


def environment_under(env: dict) -> tuple[str, ...]:
    """environment() in a process with `env` added to this one's (torch reads these variables at start-up)."""
    code = "import sys; sys.path.insert(0, 'tests'); import test_lessons; print(*test_lessons.environment(), sep='|')"
    return tuple(subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True,
                                cwd=ROOT, check=True, env={**os.environ, **env}).stdout.strip().split("|"))


@pytest.mark.parametrize("doc, only, cpu", [(ROOT / "lessons" / f"{name}.md", NEEDED[name], cpu) for name, cpu in RUNS],
                         ids=[f"{name}-{cpu}" for name, cpu in RUNS])
def test_a_lessons_claims_hold_on_a_cpu_that_rounds_otherwise(doc, only, cpu, tmp_path):
    there = environment_under(ELSEWHERE[cpu])
    assert level(there) != "exact"  # the checker knows it is elsewhere
    parts, outputs, result = run_blocks(doc, tmp_path, only, ELSEWHERE[cpu])
    assert len(parts) == len(only)
    check_outputs(doc, parts, outputs, result, level(there))
    if environment() == REFERENCE:  # and what passed is not what the page shows: the kernels changed it
        assert any(compare(kept(text.rstrip("\n").split("\n")), kept(got), "exact", check) is None
                   for (_, texts), got in zip(parts, outputs) for text, check in texts)


# ----------------------------------------------------------------------------- the checker itself


def test_the_checker_catches_drift_and_forgives_what_varies():
    lesson = "```bash\necho hi\n```\n\n```text\nloss 2.4636\n...\ndone\n```\nprose\n```text\nnot output\n```\n"
    (commands, texts), = blocks(lesson)
    assert commands == "echo hi\n" and texts == [("loss 2.4636\n...\ndone\n", "")]
    want = shown(["loss 2.4636", "...", "done"])
    assert match(want, shown(["loss 2.4640", "a", "b", "done"]), "exact")  # 0.02%: rounding
    assert align(want, shown(["loss 2.4640", "a", "b", "done"]), "exact") == [(0, 0), (2, 3)]
    assert not match(want, shown(["loss 2.5136", "done"]), "exact")  # 2%: drift
    assert not match(want, shown(["loss 2.4636"]), "exact")  # a line is missing
    assert match(want, shown(["loss 9.9", "done"]), "words")  # another machine: the words only
    assert not match(want, shown(["val 2.4636", "done"]), "words")
    assert not match(shown(["34,321 train"]), shown(["34,322 train"]), "exact")  # integers are exact
    assert match(shown(["difference: 1.8e-07"]), shown(["difference: 0.0"]), "exact")  # both noise
    bar = "\r  0%|          | 0/60 [00:00<?, ?it/s]\r100%|##########| 60/60 [00:01<00:00, 47.10it/s, loss=2.464]\n"
    assert shown(terminal(bar)) == shown(["100%|##########| 60/60 [00:09<00:00, 6.2it/s, loss=2.464]"])
    assert normalize("paid 48.9 ms a save (271% of a 18 ms step") == "paid <time> a save (<pct> of a <time> step"
    assert normalize("/usr/lib/python3.12/json (20 files)") == "<stdlib>/json (20 files)"
    assert normalize("  a  [00:07<00:00,  2.25it/s]") == normalize("  a [00:00<00:00, 53.57it/s]")
    assert normalize("[00:00<00:00, 13695.69band/s] 10.7MB/s") == normalize("[00:01<00:00, 9.1band/s] 2MB/s")
    assert match(shown(["peak 216 GFLOP/s …"]), shown(["peak 216 GFLOP/s (27.7%)"]), "exact")
    assert not match(shown(["peak 216 GFLOP/s …"]), shown(["peak 217 GFLOP/s (27.7%)"]), "exact")


def test_a_block_past_a_minute_is_still_timing():
    """A loaded machine: pytest adds h:mm:ss once a run passes 60 s; tqdm's bar shows hours."""
    assert normalize("2 passed, 38 deselected in 66.46s (0:01:06)") == normalize("2 passed, 38 deselected in 16.56s")
    assert normalize("1 passed in 3725.10s (1:02:05)") == normalize("1 passed in 0.91s")
    assert normalize("60/60 [1:01:57<00:00, 61.9s/it]") == normalize("60/60 [00:03<00:00, 17.1it/s]")
    assert normalize("took 0:01:06 in all") == normalize("took 12.5 s in all")
    assert not match(shown(["2 passed in 16.56s"]), shown(["1 passed in 66.46s (0:01:06)"]), "exact")
    assert normalize("Megatron 1T on 3072 A100s") == "Megatron 1T on 3072 A100s"  # a GPU, not a duration


def test_sampled_text_is_exact_where_the_cpu_rounds_as_recorded_and_free_elsewhere():
    page = shown(["step 20 val 6.231 | sample: ' inbox  def'", "done: step 20, loss 4.2926, val loss 6.2307"])
    other_cpu = shown(["step 20 val 6.230 | sample: ' inbox  for'", "done: step 20, loss 4.2926, val loss 6.2301"])
    assert not match(page, other_cpu, "exact")  # here a sample is deterministic: another one is drift
    assert match(page, other_cpu, "numbers")  # on another CPU a token can flip, the numbers cannot drift
    assert not match(page, shown(["step 20 val 6.931 | sample: 'x'", "done: step 20, loss 4.2926, val loss 6.2301"]),
                     "numbers")
    noise = shown(["|loss - fp32| steps 1-10: 2.1e-04, 31-40: 1.4e-03"])  # two runs' difference: noise, which
    assert match(noise, shown(["|loss - fp32| steps 1-10: 2.6e-04, 31-40: 0.9e-03"]), "numbers")  # grows
    assert not match(noise, shown(["|loss - fp32| steps 1-10: 2.6e-04, 31-40: 0.9e-03"]), "exact")
    assert level(REFERENCE) == "exact" and level(REFERENCE[:4] + ("0123456789ab",)) == "numbers"
    assert level(("3.12",) + REFERENCE[1:]) == "words"
    code = "import sys; sys.path.insert(0, 'tests'); import test_lessons; print(test_lessons.cpu_rounding())"
    scalar = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True,
                            env={**os.environ, "ATEN_CPU_CAPABILITY": "default"}).stdout.strip()
    assert len(scalar) == 12 and scalar != cpu_rounding()  # PyTorch's scalar kernels round otherwise: noticed


def test_a_check_comment_says_what_another_cpu_may_change():
    """Measured: lesson 2's warm-up-1 run on the recording CPU (the page) and in PyTorch's scalar kernels."""
    page = "--warmup-steps 1: losses 5.80 11.82 16.15 14.23 16.44 10.27 | highest 16.44 (step 5), 16 above, val 4.457"
    scalar = "--warmup-steps 1: losses 5.80 11.82 16.15 14.27 12.56 6.82 | highest 16.15 (step 3), 15 above, val 4.054"
    lesson = f"```bash\nrun\n```\n\n<!-- check: chaotic -->\n```text\n{page}\n```\n"
    assert blocks(lesson) == [("run\n", [(page + "\n", "chaotic")])] and len(output_fences(lesson)) == 1
    assert match([page], [scalar], "numbers", "chaotic") and not match([page], [scalar], "numbers")
    assert not match([page], [scalar], "exact", "chaotic")  # where the CPU rounds as recorded: as any block
    calm = page.replace("16.15 14.23 16.44 10.27", "6.15 4.23 6.44 5.07")  # no blow-up: the claim is gone
    assert not match([page], [calm], "numbers", "chaotic")
    assert not match(["saturated 0, 87"], ["saturated 1, 87"], "numbers", "chaotic")  # none is none
    assert not match(["difference -0.5"], ["difference 0.5"], "numbers", "chaotic")
    drawing = [" 5.87 |*", " 3.64 | **  o", " 2.38 |    *", "      +-----"]
    moved = [" 5.86 |*", " 3.65 | *   o", " 2.38 |  * *", "      +-----"]  # a mark one row down
    assert match(drawing, moved, "numbers", "plot") and match(drawing, moved, "words", "plot")
    assert not match(drawing, moved, "numbers") and not match(drawing, moved, "exact", "plot")
    assert not match(drawing, [" 5.87 | *", " 3.64 |     o", " 2.38 |    *", "      +-----"], "numbers", "plot")
    assert not match(drawing, [" 5.87 |*  *", " 3.64 | **  o", " 2.38 |", "      +-----"], "numbers", "plot")  # 2 rows
    assert not match(drawing, [" 5.07 |*"] + drawing[1:], "numbers", "plot") and not match(drawing, drawing[1:],
                                                                                          "numbers", "plot")
    sample = ["sampling runs/one (step 60): seed 1337", "wrenl", "    =  g"]
    assert match(sample, sample[:1] + ["wrenX"], "numbers", "sampled")
    assert not match(sample, sample[:1] + ["wrenX"], "exact", "sampled")
    assert not match(sample, ["sampling runs/two (step 60): seed 1337"] + sample[1:], "numbers", "sampled")


def test_every_check_comment_is_above_an_output():
    """A CHECK comment anywhere else (above a command, say) would change nothing, silently."""
    for doc in DOCS:
        text = doc.read_text()
        placed = [check for _, texts in blocks(text) for _, check in texts if check]
        assert len(placed) == len(CHECK.findall(text)) == text.count("<!-- check"), doc.name
    assert blocks("<!-- check: plot -->\n```bash\nrun\n```\n\n```text\n1\n```\n") == [("run\n", [("1\n", "")])]


def test_identities_are_one_to_one_over_a_lesson():
    """Run ids and cache keys differ from run to run, but a page that shows two keys where the run printed
    one (stale output: "prepared …7cb53eca" then "using prepared …019de12a") has drifted."""
    prepared = "data: kept 5 of 5 documents -> cache/json-byte-{}"
    using = "data: using prepared cache/json-byte-{}"
    page = [prepared.format("7cb53eca643d1ab7"), using.format("019de12a1a3e16f1")]
    for run, ok in [([prepared.format("1111111111111111"), using.format("1111111111111111")], False),
                    ([prepared.format("1111111111111111"), using.format("2222222222222222")], True)]:
        ids = Identities()
        problems = [ids.check([want], [got], align(shown([want]), shown([got]), "exact"))
                    for want, got in zip(page, run)]
        assert (problems == [None, None]) == ok, problems
    ids = Identities()  # and the other way round: one id of the page for two of the run
    assert ids.pair(["run_id 0db1f8466ea8"], ["run_id aaaaaaaaaaaa"]) is None
    assert "both" in ids.pair(["run_id 0db1f8466ea8"], ["run_id bbbbbbbbbbbb"])
    assert split_ids("run cc5d98c8ce52 holds out") == ("run <run id> holds out", ["run_id cc5d98c8ce52"])

    # the writer rewrites the blocks whose ids are not one-to-one, and only those (and drifted ones)
    page += ["run 0db1f8466ea8 started", "loss 2.5"]
    lesson = "".join(f"```bash\ncmd {n}\n```\n\n```text\n{line}\n```\n" for n, line in enumerate(page, 1))
    fences = output_fences(lesson)
    run = [prepared.format("1111111111111111"), using.format("1111111111111111"), "run aaaaaaaaaaaa started"]
    assert stale(fences, [[run[0]], [run[1]], [run[2]], ["loss 2.5"]]) == {0: [run[0]], 1: [run[1]]}
    assert stale(fences, [[run[0]], [using.format("2222222222222222")], [run[2]], ["loss 2.5"]]) == {}
    assert stale(fences, [[run[0]], [using.format("2222222222222222")], [run[2]], ["loss 3.5"]]) == {3: ["loss 3.5"]}
    page = ['{"run": "0db1f8466ea8", "started": "…"}', "moved to previous/d08e1d0bdb82"]  # one run, two ids
    fences = output_fences("".join(f"```bash\ncmd\n```\n\n```text\n{line}\n```\n" for line in page))
    assert stale(fences, [['{"run": "aaaaaaaaaaaa", "started": "2026-11-25"}'], ["moved to previous/aaaaaaaaaaaa"]]) \
        == {0: ['{"run": "aaaaaaaaaaaa", "started": "…"}'], 1: ["moved to previous/aaaaaaaaaaaa"]}  # "…" stays


# ----------------------------------------------------------------------------- writing a lesson


def stale(fences: list, outputs: list[list[str]]) -> dict[int, list[str]]:
    """The output fences to rewrite (by position in `fences`), with their new lines: the run's output
    where the page's does not match; and where a block matches but its ids are tangled with ids that are
    not one-to-one (a page id paired with two of the run's, or the other way round, directly or through
    other pairs), the page's own lines with the run's ids put in, so that its `...` and `…` stay."""
    new, pages, pairs = {}, {}, []  # pairs: (fence, page line, page id, run id)
    for k, (n, m) in enumerate(fences):
        page = m.group(2).rstrip("\n").split("\n")
        want, have = kept(page), kept(outputs[n - 1])
        lines = align(shown(want), shown(have), "exact")
        if lines is None:  # rewritten: the run's lines stand for the page's (a new block's may be shorter)
            new[k], want, lines, page = outputs[n - 1], have, [(i, i) for i in range(len(have))], outputs[n - 1]
        at = [x for x, line in enumerate(page) if not LAUNCHER.match(line)]  # a kept line's place in the page
        pages[k] = page
        pairs += [(k, at[i], a, b) for i, ids, run in id_pairs(want, have, lines) for a, b in zip(ids, run)]
    group = {}  # union-find over ("page", id) and ("run", id): a pair joins its two

    def root(x):
        while group.setdefault(x, x) != x:
            x = group[x]
        return x
    for _, _, a, b in pairs:
        group[root(("page", a))] = root(("run", b))
    members = {}
    for _, _, a, b in pairs:
        members.setdefault(root(("page", a)), set()).update({("page", a), ("run", b)})
    tangled = {r for r, ids in members.items() if len({i for side, i in ids if side == "page"}) > 1
               or len({i for side, i in ids if side == "run"}) > 1}
    for k in {k for k, _, a, _ in pairs if root(("page", a)) in tangled} - new.keys():
        new[k] = list(pages[k])
        for _, x, a, b in (pair for pair in pairs if pair[0] == k):
            new[k][x] = new[k][x].replace(a.split()[1], b.split()[1])  # "cache_key 7cb5..." -> its value
    return new


def write_outputs(doc: Path) -> list[int]:
    """Run `doc`'s commands and put what each block printed into the ```text block after it, where the
    shown output no longer matches (a matching block, `...` elisions and all, is left as written; see
    `stale`). Returns the numbers of the bash blocks rewritten. For authors: then read the diff, and the prose."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        _, outputs, result = run_blocks(doc, Path(tmp))
    if result.returncode != 0:
        sys.exit(f"{doc.name}: a command failed:\n{result.stdout.decode(errors='replace')[-4000:]}")
    text = doc.read_text()
    fences = output_fences(text)
    rewrite = stale(fences, outputs)
    for k in sorted(rewrite, reverse=True):
        m = fences[k][1]
        text = text[:m.start()] + "```text\n" + "\n".join(rewrite[k]) + "\n```\n" + text[m.end():]
    doc.write_text(text)
    return sorted({fences[k][0] for k in rewrite})


if __name__ == "__main__":  # python tests/test_lessons.py lessons/09-data-parallel.md ...
    if (env := environment()) != REFERENCE:
        print(f"note: this is not the environment the pages were recorded in: REFERENCE = {env} here")
    for arg in sys.argv[1:]:
        print(f"{arg}: rewrote the output of bash blocks {write_outputs(Path(arg).resolve()) or 'none'}")
