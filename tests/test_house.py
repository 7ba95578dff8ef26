"""The house (DESIGN.md): two tiers around the reference, arrows that run one way, a reading path that
tells the truth, and a fork that can delete the instruments.

    programs       train.py (its main), data.py, sample.py
        ▼
    instruments/   timeline, stats, reports, dashboard, formulas, planner, hf, ...
        ▼
    the reference  model.py ... train.py: what a student reads to learn how a step is trained
        ▼
    support/       sources, scan, dedup, tokenizer, storage, writer, rundir, cli, devices, interrupt, observer,
                   launches

An import may point down or across a tier, never up, and no chain of imports comes back to where it
started (`house` checks every import of every file, those inside functions too).
"""

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, metrics

REFERENCE = ["model", "kernels", "lmhead", "dropout", "parallel", "shard", "context", "pipeline", "gradients",
             "zero", "moe", "stability", "fp8", "fp8_cast", "config", "checkpoint", "train"]  # README's reading order
PROGRAMS = ["train", "data", "sample"]  # train.py is both: its loop is the reference, its main a program
TIER = {"support": 0, "reference": 1, "instruments": 2, "program": 3}


def tier_of(module: str) -> str | None:
    """Which tier a product module belongs to (None: it has none, which is itself wrong)."""
    if module.split(".")[0] in ("support", "instruments"):
        return module.split(".")[0]
    if module in PROGRAMS:
        return "program"
    return "reference" if module in REFERENCE else None


def modules(root: Path) -> dict[str, Path]:
    """Every Python file of the repository, by the name it is imported as (tests/x.py: tests.x)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0].startswith(".") or "site-packages" in rel.parts:
            continue
        name = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        out[name] = path
    return out


def imports(path: Path, known: dict, here: str) -> list[tuple[str, str]]:
    """(module imported, the function it is imported in or "") for each import of a known module in
    `path`, at any depth. `from a import b` imports a.b when that is a module, else a."""
    found = []
    tests = here.startswith("tests.")

    def resolve(name: str) -> str | None:
        for candidate in ([f"tests.{name}"] if tests else []) + [name]:
            if candidate in known:
                return candidate
        return None

    def visit(node, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inside = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Import):
                found.extend((m, function) for a in child.names if (m := resolve(a.name)))
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                for a in child.names:
                    if m := resolve(f"{child.module}.{a.name}") or resolve(child.module):
                        found.append((m, function))
            visit(child, inside)
    visit(ast.parse(path.read_text()), "")
    return found


def house(root: Path) -> list[str]:
    """Every import that breaks the tier rule or closes a cycle, in words ([] when the house stands)."""
    known = modules(root)
    graph = {name: imports(path, known, name) for name, path in known.items()}
    problems = [f"{name}.py has no tier (support/, instruments/, or one of the reference files and programs)"
                for name in known if not name.startswith("tests") and name not in ("support", "instruments")
                and tier_of(name) is None]
    for name, edges in graph.items():
        if name.startswith("tests") or tier_of(name) is None:
            continue
        for target, function in edges:
            low, high = tier_of(name), tier_of(target)
            if name == "train" and high == "instruments" and function != "main":
                problems.append(f"train.py imports {target} outside main: its loop is the reference")
            elif high is not None and TIER[high] > TIER[low]:
                problems.append(f"{name} ({low}) imports {target} ({high}): an arrow up")
    state = {}  # name -> "open" while its imports are being followed, "done" after

    def follow(name: str, path: list[str]) -> None:
        state[name] = "open"
        for target, _ in graph[name]:
            if state.get(target) == "open":
                problems.append("import cycle: " + " -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                follow(target, path + [target])
        state[name] = "done"
    for name in graph:
        if name not in state:
            follow(name, [name])
    return problems


def test_imports_run_one_way_and_never_in_a_cycle():
    assert house(ROOT) == []


def test_the_house_test_finds_an_arrow_up_and_a_cycle(tmp_path):
    (tmp_path / "support").mkdir()
    (tmp_path / "instruments").mkdir()
    (tmp_path / "support" / "storage.py").write_text("def f():\n    import parallel\n")  # support -> reference
    (tmp_path / "parallel.py").write_text("from instruments import timeline\n")  # reference -> instruments
    (tmp_path / "instruments" / "timeline.py").write_text("import parallel\n")  # and back: a cycle
    (tmp_path / "helpers.py").write_text("")  # a file of no tier
    found = "\n".join(house(tmp_path))
    assert "support.storage (support) imports parallel (reference): an arrow up" in found
    assert "parallel (reference) imports instruments.timeline (instruments): an arrow up" in found
    assert "import cycle: " in found and "helpers.py has no tier" in found


def test_no_python_file_is_over_600_lines():
    long = {name: n for name, path in modules(ROOT).items() if (n := len(path.read_text().splitlines())) > 600}
    assert long == {}


def reading_path() -> list[tuple[str, int]]:
    """README's reading path: (file, the line count it states), in its order."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Read the reference"):]
    section = section[:section.index("\n## ", 3)]
    return [(name, int(n.replace(",", ""))) for name, n in re.findall(r"^\| \d+ \| `(\w+\.py)` \| ([\d,]+) \|",
                                                                       section, re.M)]


def test_the_reading_path_lists_the_reference_with_true_line_counts():
    path = reading_path()
    assert [name for name, _ in path] == [f"{m}.py" for m in REFERENCE]
    assert {name: n for name, n in path} == {name: len((ROOT / name).read_text().splitlines()) for name, _ in path}


def test_a_fork_without_the_instruments_trains_in_every_layout(corpus, tmp_path):
    """Copy the repository, delete instruments/, and train there as a forker would: one process, tensor
    parallel on 2, data parallel with ZeRO-1 on 2, with no flag that asks for an instrument (the one-process
    run bitwise the run of the whole repository); and the model tests pass there. A flag that does ask for
    one is one line and exit 2, before any work."""
    fork = tmp_path / "fork"
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if not name.startswith("instruments/") and (ROOT / name).is_file():
            (fork / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, fork / name)
    assert not (fork / "instruments").exists() and (fork / "train.py").exists()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base = ["--data", corpus["data"], "--cache-dir", corpus["cache"], "--device", "cpu", "--preset", "tiny",
            "--tokenizer", "byte", "--seq-len", "32", "--batch-size", "8", "--max-steps", "2", "--sample-tokens", "0"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    for name, launcher, flags in [("one", [sys.executable], []), ("tp2", torchrun, ["--tp", "2"]),
                                  ("zero1", torchrun, ["--zero", "1"])]:
        done = subprocess.run(launcher + ["train.py", *base, "--out", str(tmp_path / name), *flags], cwd=fork,
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        assert "instruments/ is not here" in done.stdout and "done: step 2" in done.stdout
        assert not (tmp_path / name / "report.html").exists()
    whole = subprocess.run([sys.executable, "train.py", *base, "--out", str(tmp_path / "whole")], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)  # the same run, with the instruments
    assert whole.returncode == 0 and (tmp_path / "whole" / "report.html").exists(), whole.stderr[-3000:]
    numbers = lambda out: [(r["loss"], r["grad_norm"], r.get("val_loss")) for r in metrics(out)]
    assert numbers(tmp_path / "one") == numbers(tmp_path / "whole")  # bit for bit
    refused = subprocess.run([sys.executable, "train.py", *base, "--out", str(tmp_path / "x"), "--comm-report"],
                             cwd=fork, env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "error: --comm-report needs the instruments, and this copy has no instruments/ folder; leave the flag out, "
        "or restore the folder"]
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                            "tests/test_model.py"], cwd=fork, env=env, capture_output=True, text=True, timeout=600)
    assert tests.returncode == 0 and " passed" in tests.stdout, tests.stdout[-3000:]


PLACEMENT_FIELDS = {"shard", "expert", "tied_copy", "tied_embedding", "sequence_parallel"}


def loose_placement(root: Path) -> list[str]:
    """Every place a product file reads or writes a parameter's placement as a loose attribute: a
    getattr / hasattr / setattr of one of its names, or a store `x.shard = ...` (the record,
    parallel.placement and parallel.place, is the only way; `Unit.shard` and the like are read freely)."""
    found = []
    for name, path in modules(root).items():
        if name.startswith("tests"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2 \
                    and node.func.id in ("getattr", "hasattr", "setattr") and isinstance(node.args[1], ast.Constant) \
                    and node.args[1].value in PLACEMENT_FIELDS:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr in PLACEMENT_FIELDS:
                found.append(f"{path.relative_to(root)}:{node.lineno}: sets .{node.attr}")
    return found


def test_placement_is_one_record_read_through_parallel_placement():
    assert loose_placement(ROOT) == []


def test_the_placement_check_finds_a_loose_attribute(tmp_path):
    (tmp_path / "gradients.py").write_text("def f(p):\n    return getattr(p, 'expert', False)\n")
    (tmp_path / "shard.py").write_text("def g(p, q):\n    p.tied_copy = hasattr(q, 'shard')\n")
    (tmp_path / "zero.py").write_text("def h(u, p):\n    return u.shard, placement(p).shard\n")  # reads: fine
    assert sorted(loose_placement(tmp_path)) == ["gradients.py:2: getattr(..., 'expert')",
                                                 "shard.py:2: hasattr(..., 'shard')", "shard.py:2: sets .tied_copy"]
