"""What the pages point at exists: every lesson, section, file, name, command and flag a page names.

tests/test_lessons.py holds what a page shows to what its commands print. A page also points at things
("lesson 10, section 3", `instruments.reports.resume_changes`, `support/launches.py`, `python -m
instruments.hf export`, `--cp-attn ulysses`), and those go stale without a sound when the course is
renumbered or the code renamed: the page still runs. This file reads every page (lessons/*.md,
README.md, DESIGN.md) and checks each reference against today's lessons and code (`problems`):

* "lesson N" ("lessons N and M", "lessons N–M", "lesson N, section k", "lesson N's section k", "lesson N
  §k", a table's "lesson" column): lesson N and its section k exist, and the sentence around the number is
  not about another lesson (or section); "section k" alone, in a lesson, is one of its own unless the
  sentence cites a paper; `lessonN` in a name (a rendezvous id) is the page's own number; `NN-name.md` is a
  lesson's file (tests/course.py: the lessons are read from lessons/, so a renumbered course is checked
  as it then is).
* `module.name`, `module.Class.method`, `Class.method`, for this repository's modules and classes (read
  with ast: nothing is imported for it): the module defines the name, the class (or a base) the member.
  `model.x` may also be a GPT's (INSTANCES).
* `file.py`, `dir/file.py` in our folders: the file exists (a bare name: anywhere in the repository or
  the standard library), or the page's own blocks write it.
* commands, in ```bash and ```sh blocks and in inline code (`python train.py`, `torchrun … train.py`,
  `python sample.py`, `python data.py`, `python -m pkg.mod sub`, `python tests/x.py`): the program exists,
  its subcommand is one it has, each `--flag` is in its --help, and a value given to a flag with choices
  is one of them ("${ARGS[@]}" is read as the page's array). Flags before the script are torchrun's own,
  checked against torchrun's parser; other programs (pytest, python -m json.tool) are not ours.
* a `--flag` in prose: a flag of one of our programs or of torchrun, or one of FOREIGN.

The parsers are the programs' own: each program's main runs with `parse_args` caught (`parser_of`), so a
flag is what --help lists, without a process spawned. tests/ scripts are read with ast instead (importing
them has side effects: tests/bench.py sets the allocator's environment for the whole process).
"""

import argparse
import ast
import builtins
import functools
import importlib
import re
import shlex
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import torch
from conftest import ROOT
from course import FENCE, Course, blank, lesson_problems, line_of, table_problems, without_code

REPO_DIRS = ("support", "instruments", "tests", "lessons", "docs")
# flags of a program that is not ours, which a page names in prose: SLURM's (lesson 13's job script)
FOREIGN = {"--requeue", "--job-name", "--nodes", "--ntasks-per-node", "--cpus-per-task", "--time"}


def docs(root: Path) -> list[Path]:
    return sorted((root / "lessons").glob("*.md")) + [root / "README.md", root / "DESIGN.md"]


# ----------------------------------------------------------------------------- the code


class Code:
    """The repository's modules and classes, read with ast: which names each defines."""

    def __init__(self, root: Path):
        self.root = root
        self.paths = {p.stem: p for p in root.glob("*.py")}
        self.paths |= {f"{d}.{p.stem}": p for d in ("support", "instruments") for p in (root / d).glob("*.py")}
        self.short = {name.split(".")[1]: name for name in self.paths if "." in name}  # cli -> support.cli
        trees = {name: ast.parse(p.read_text()) for name, p in self.paths.items()}
        self.names = {name: self.top_level(tree) for name, tree in trees.items()}
        self.classes: dict[str, list[ast.ClassDef]] = {}
        for tree in trees.values():
            for node in tree.body:
                if isinstance(node, ast.ClassDef):
                    self.classes.setdefault(node.name, []).append(node)

    @staticmethod
    def top_level(tree: ast.Module) -> tuple[set[str], set[str]]:
        """(names a module defines, of which those it imports): defs, classes, assignments (in top-level
        loops and conditions too: `SHIPPED` is filled in a for loop), imports."""
        defined, imported, todo = set(), set(), list(tree.body)
        while todo:
            node = todo.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                defined |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            for name in ("body", "orelse", "handlers", "finalbody"):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    todo += getattr(node, name, [])
        return defined | imported, imported

    def module(self, name: str) -> str | None:
        return name if name in self.paths else self.short.get(name)

    def members(self, name: str, seen: frozenset = frozenset()) -> set[str] | None:
        """What a class of ours has: methods, class attributes, fields, `self.x = ...`, its bases' too; None
        when a base is not ours and not resolvable, so anything may be inherited."""
        found = set()
        for cls in self.classes[name]:
            for node in cls.body:  # at class level: methods, attributes, fields, nested classes
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    found.add(node.name)
                elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    found |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            found |= {node.attr for node in ast.walk(cls) if isinstance(node, ast.Attribute)  # self.x = ...
                      and isinstance(node.ctx, ast.Store) and getattr(node.value, "id", "") == "self"}
            for base in cls.bases:
                base_name = ast.unparse(base)
                if base_name in self.classes and base_name not in seen:
                    inherited = self.members(base_name, seen | {name})
                elif (outside := external(base_name)) is not None:
                    inherited = set(dir(outside))
                else:
                    return None
                if inherited is None:
                    return None
                found |= inherited
        return found

    def where(self, name: str) -> list[str]:
        """The modules that define `name` themselves (not by importing it)."""
        return [m for m, (names, imported) in self.names.items() if name in names - imported]

    def problem(self, dotted: str) -> str | None:
        """What is wrong with a dotted name (`train.setup`, `parallel.Grid.owns`, `GradSync._launch`), if it is
        ours: a module that does not define it, a class without that member."""
        parts = dotted.split(".")
        if parts[0] in INSTANCES and parts[1] in (self.members(INSTANCES[parts[0]]) or ()):
            return None
        found = [(m, parts[i:]) for i in range(len(parts) - 1, 0, -1) if (m := self.module(".".join(parts[:i])))]
        if not found:
            if parts[0] in self.classes and (members := self.members(parts[0])) is not None \
                    and parts[1] not in members:
                return f"class {parts[0]} has no member {parts[1]}"
            return None
        module, rest = found[0]
        path = self.paths[module].relative_to(self.root)
        if rest[0] not in self.names[module][0]:
            where = [f"{m}.{rest[0]}" for m in self.where(rest[0])]
            return f"{path} defines no {rest[0]}" + (f" (it is {' or '.join(where)})" if where else "")
        if len(rest) > 1 and rest[0] in self.classes and (members := self.members(rest[0])) is not None \
                and rest[1] not in members:
            return f"class {rest[0]} ({path}) has no member {rest[1]}"
        return None


# a name that is a module of ours and, by habit, an instance too: `model.generate` is a GPT's method
INSTANCES = {"model": "GPT"}


def external(name: str):
    """A base class that is not ours (nn.Module, torch.autograd.Function, ValueError), or None."""
    scope = {"nn": torch.nn, "torch": torch, "argparse": argparse, "NamedTuple": tuple, "Protocol": object}
    first, *rest = name.split(".")
    obj = scope.get(first, getattr(builtins, first, None))
    for part in rest:
        obj = getattr(obj, part, None)
    return obj


# ----------------------------------------------------------------------------- programs and their flags


@dataclass
class Program:
    flags: dict[str, tuple[str, ...] | None]  # each option string -> the values it accepts (None: any)
    commands: dict[str, "Program"]  # its subcommands (a first positional with choices); empty if it has none


class Caught(Exception):
    """A program's main reached parse_args: its parser is built."""


def parser_of(main) -> argparse.ArgumentParser:
    """The parser `main` builds, caught where it would parse: exactly what `--help` would list."""
    caught = []

    def grab(self, *args, **kwargs):
        caught.append(self)
        raise Caught
    with mock.patch.object(argparse.ArgumentParser, "parse_args", grab):
        try:
            main([])
        except Caught:
            pass
    return caught[0]


def from_parser(p: argparse.ArgumentParser) -> Program:
    flags = {o: tuple(map(str, a.choices)) if a.choices else None for o, a in p._option_string_actions.items()}
    first = next((a for a in p._actions if not a.option_strings), None)
    if isinstance(first, argparse._SubParsersAction):
        return Program(flags, {name: from_parser(sub) for name, sub in first.choices.items()})
    return Program(flags, {str(c): Program({}, {}) for c in (first.choices or ())} if first else {})


def from_source(path: Path) -> Program | None:
    """A tests/ script's flags, from its `add_argument` calls (None: it parses no flags we can read)."""
    flags = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            kw = {k.arg: k.value for k in node.keywords}
            try:
                choices = tuple(map(str, ast.literal_eval(kw["choices"]))) if "choices" in kw else None
            except ValueError:
                choices = None
            for a in node.args:
                if isinstance(a, ast.Constant) and str(a.value).startswith("-"):
                    flags[a.value] = choices
                    if "BooleanOptional" in ast.unparse(kw.get("action", ast.Constant(""))):
                        flags["--no-" + a.value[2:]] = None
    return Program(flags | {"-h": None, "--help": None}, {}) if flags else None


@functools.cache
def programs() -> dict[str, Program | None]:
    """Our programs, by the names a command gives them: "train.py", "data.py", "instruments.hf" (python -m)
    and "instruments/hf.py", "tests/gpu_run.py". train.py's parser is config.parse_args (train.py's main
    calls it first); importing train.py itself would only set its allocator variable in this process."""
    import config
    out = {"train.py": from_parser(parser_of(config.parse_args))}
    for name in ("data", "sample", "instruments.checkpoints", "instruments.hf", "instruments.dashboard"):
        program = from_parser(parser_of(importlib.import_module(name).main))
        out[name] = out[name.replace(".", "/") + ".py"] = program
    for path in sorted((ROOT / "tests").glob("*.py")):
        out[f"tests/{path.name}"] = from_source(path)
    return out


@functools.cache
def torchrun() -> Program:
    import torch.distributed.run
    return from_parser(torch.distributed.run.get_args_parser())


def all_flags() -> dict[str, set[str]]:
    """Every flag of ours and of torchrun, with the values each one accepts anywhere (empty: any)."""
    out: dict[str, set[str]] = {}
    for program in [torchrun(), *filter(None, programs().values())]:
        for sub in [program, *program.commands.values()]:
            for flag, choices in sub.flags.items():
                out.setdefault(flag, set()).update(choices or ["*"])
    return out


PLACEHOLDER = re.compile(r"^([A-Z_]+|[a-z]|\W.*|.*[|{…<$\[].*|\.\.\.|)$")  # N, k, {a,b}, 8|4, …, $X, <id>


def flag_problems(args: list[str], program: Program, name: str) -> list[str]:
    """Each --flag among `args` that `program` does not have, and each value it does not accept."""
    out = []
    for i, arg in enumerate(args):
        if not arg.startswith("--") or arg == "--":
            continue
        flag, _, value = arg.partition("=")
        flag = re.match(r"--[\w-]*", flag).group(0)
        if flag not in program.flags:
            out.append(f"{name} has no flag {flag}")
        elif (choices := program.flags[flag]) is not None:
            value = value or (args[i + 1] if i + 1 < len(args) else "")
            if not PLACEHOLDER.match(value) and value not in choices:
                out.append(f"{name} {flag} takes one of {', '.join(choices)}, not {value}")
    return out


# ----------------------------------------------------------------------------- commands


def command_lines(block: str) -> list[tuple[int, str]]:
    """(line within the block, command) of a shell block: continued lines and bash arrays joined, the text
    of here-documents (a script fed to python) left out."""
    lines, out, i = block.split("\n"), [], 0
    while i < len(lines):
        start, line = i, lines[i]
        code = lambda s: re.sub(r"(^|\s)#.*$", "", s)  # noqa: E731 (what counts, outside a comment)
        while (line.endswith("\\") or code(line).count("(") > code(line).count(")")) and i + 1 < len(lines):
            i += 1
            line = line.removesuffix("\\") + " " + lines[i]
        out.append((start, line))
        if (here := re.search(r"<<-?\s*['\"]?(\w+)['\"]?", code(line))) is not None:
            while i + 1 < len(lines) and lines[i + 1].strip() != here.group(1):
                i += 1
            i += 1
        i += 1
    return out


def arrays(text: str) -> dict[str, list[str]]:
    """The page's bash arrays (`ARGS=(--device cpu ...)`), so that "${ARGS[@]}" is read as its flags."""
    out = {}
    for m in FENCE.finditer(text):
        if m.group(1) in ("bash", "sh"):
            for _, line in command_lines(m.group(2)):
                if (a := re.match(r"\s*(\w+)=\((.*)\)\s*$", line)) is not None:
                    out[a.group(1)] = tokens(a.group(2))
    return out


def tokens(line: str) -> list[str]:
    try:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        return list(lexer)
    except ValueError:  # an unclosed quote: a line of a longer string
        return line.split()


def segments(line: str, named: dict[str, list[str]]) -> list[list[str]]:
    """The simple commands of a shell line: split at | && || ; & and parentheses, redirections, leading
    variable assignments and keywords dropped, "${ARRAY[@]}" expanded."""
    out, current, skip = [], [], False
    for t in tokens(line):
        if skip:
            skip = False
        elif t in ("|", "||", "&&", ";", "&", "(", ")", ";;", "$", "`"):
            out.append(current)
            current = []
        elif re.fullmatch(r"[<>&|]+", t):
            skip = True  # a redirection's target
        elif not current and (re.fullmatch(r"\w+=.*", t) or t in ("do", "then", "else", "if", "while", "!",
                                                                      "time", "exec", "nohup")):
            continue
        elif (a := re.fullmatch(r"\$\{(\w+)\[@\]\}", t)) is not None:
            current += named.get(a.group(1), [t])
        else:
            current.append(t)
    return [c for c in out + [current] if c]


def command_problems(seg: list[str], page: str) -> list[str]:
    """What is wrong with one simple command: a path in our folders that does not exist (`python -m pytest
    tests/x.py`), and, if it runs a program of ours (python X.py, python -m X, torchrun [its flags] X.py),
    its subcommand and flags."""
    paths = [p for t in seg if re.fullmatch(rf"({'|'.join(REPO_DIRS)})/[\w./-]+", t) and (p := file_problem(t, page))]
    return paths + program_problems(seg, page)


def program_problems(seg: list[str], page: str) -> list[str]:
    head, rest = seg[0], seg[1:]
    if head == "torchrun" or (head.startswith("python") and rest[:2] == ["-m", "torch.distributed.run"]):
        rest = rest if head == "torchrun" else rest[2:]
        at = next((i for i, t in enumerate(rest) if t.endswith(".py") or t == "-m"), len(rest))
        found = flag_problems(rest[:at], torchrun(), "torchrun")
        return found + (script_problems(rest[at], rest[at + 1:], page) if at < len(rest) and rest[at] != "-m"
                        else [])
    if not re.fullmatch(r"python(3(\.\d+)?)?", head):
        return []
    rest = [t for t in rest if t not in ("-u", "-B", "-O")]
    if rest[:1] == ["-m"] and len(rest) > 1:
        module = rest[1]
        if module in programs():
            return run_problems(programs()[module], f"python -m {module}", rest[2:])
        first = module.split(".")[0]
        if (first in REPO_DIRS or first in CODE().paths) and CODE().module(module) is None:
            return [f"python -m {module}: there is no module {module}"]
        return []
    return script_problems(rest[0], rest[1:], page) if rest and rest[0].endswith(".py") else []


def script_problems(script: str, args: list[str], page: str) -> list[str]:
    script = script.removeprefix("./")
    if script in programs():
        return run_problems(programs()[script], script, args) if programs()[script] else []
    if problem := file_problem(script, page):
        return [problem]
    if (ROOT / script).is_file() and "/" not in script:  # a file of ours that is not a program
        return [f"{script} is not a program (no command line): its flags cannot be given"] if args else []
    return []


def run_problems(program: Program, name: str, args: list[str]) -> list[str]:
    """A program's arguments: its subcommand (its first positional) is one of its own, its flags in --help."""
    if program.commands:
        sub = next((a for a in args if not a.startswith("-")), None)
        if sub is None or PLACEHOLDER.match(sub):
            return []
        if sub not in program.commands:
            return [f"{name} has no command {sub} (it has: {', '.join(program.commands)})"]
        program = Program(program.flags | program.commands[sub].flags, {})
        name = f"{name} {sub}"
    return flag_problems(args, program, name)


# ----------------------------------------------------------------------------- files, names, the page


@functools.cache
def CODE() -> Code:  # noqa: N802 (one index of the repository, read once)
    return Code(ROOT)


@functools.cache
def COURSE() -> Course:  # noqa: N802
    return Course(ROOT)


@functools.cache
def basenames() -> set[str]:
    """The names of the repository's files, and of the standard library's (a page about the corpus names
    its files: `cp037.py`)."""
    found = {p.name for p in ROOT.iterdir()} | {p.name for d in REPO_DIRS for p in (ROOT / d).rglob("*")}
    return found | {p.name for p in Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")}


def file_problem(name: str, page: str) -> str | None:
    """A file of ours a page names that does not exist. One the page's own blocks write (`cat > x.py`, `> x`,
    `tee x`) exists, and paths outside our folders (runs/, megatron/) are not ours."""
    name = name.rstrip("/")
    made = re.findall(r"(?:>>?|\btee(?: -a)?)\s*['\"]?([\w./-]+)", page)
    if any(path == name or path.endswith("/" + name) for path in made) or "*" in name:
        return None
    if "/" in name:
        return None if name.split("/")[0] not in REPO_DIRS or (ROOT / name).exists() else f"there is no {name}"
    if re.fullmatch(r"\d\d-[\w-]+\.md", name):
        return None if (ROOT / "lessons" / name).exists() else f"there is no lesson file {name}"
    return f"there is no file {name}" if name.endswith(".py") and name not in basenames() else None


FILE_SUFFIXES = {"py", "md", "json", "jsonl", "html", "safetensors", "tiktoken", "bin", "pt", "log", "txt", "bak",
                 "png", "lock", "net", "com", "org"}
COMMAND = re.compile(r"^(\w+=\S* )*(python3?|torchrun)\b")


def span_problems(span: str, page: str, named: dict[str, list[str]]) -> list[str]:
    """What is wrong with one piece of inline code: a command, flags, a file, dotted names."""
    if COMMAND.match(span):
        return [p for seg in segments(span, named) for p in command_problems(seg, page)]
    if span.startswith("--"):
        known, out = all_flags(), []
        for i, word in enumerate(parts := span.split()):
            flag = re.match(r"--[\w-]*", word).group(0) if word.startswith("--") else None
            if flag and flag not in known and flag not in FOREIGN:
                out.append(f"no program of ours (nor torchrun) has a flag {flag}")
            elif flag in known and "*" not in known[flag] and i + 1 < len(parts) and \
                    not PLACEHOLDER.match(parts[i + 1]) and parts[i + 1] not in known[flag]:
                out.append(f"{flag} takes one of {', '.join(sorted(known[flag]))}, not {parts[i + 1]}")
        return out
    if re.fullmatch(r"[\w.\-/]+\.(py|md)|(" + "|".join(REPO_DIRS) + r")/[\w.\-/]*", span):
        return [p] if (p := file_problem(span, page)) else []
    code = re.sub(r"\"[^\"]*\"|'[^']*'", '""', span)  # names, not strings
    dotted = re.findall(r"(?<![\w.])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)", code)
    return [p for d in dotted if d.rsplit(".", 1)[1] not in FILE_SUFFIXES and (p := CODE().problem(d))]


def problems(path: Path, text: str | None = None) -> list[str]:
    """Every stale reference of a page, as "file:line: what: why"."""
    text = path.read_text() if text is None else text
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    own = int(path.name[:2]) if path.parent.name == "lessons" and path.name[:2].isdigit() else None
    page = "\n".join(m.group(2) for m in FENCE.finditer(text))  # what the page's blocks make and show
    named, found = arrays(text), []
    readable = without_code(blank(text, keep=("bash", "sh", "python", "")))  # outputs (```text) left out
    for at, problem in lesson_problems(readable, COURSE(), own) + table_problems(blank(text), COURSE()):
        found.append((line_of(text, at), problem))
    prose = blank(text)
    for m in re.finditer(r"`([^`\n]+)`", prose):
        found += [(line_of(text, m.start()), f"`{m.group(1)}`: {p}") for p in span_problems(m.group(1), page, named)]
    for m in FENCE.finditer(text):
        if m.group(1) in ("bash", "sh"):
            first = line_of(text, m.start(2))
            for k, line in command_lines(m.group(2)):
                for seg in segments(line, named):
                    found += [(first + k, f"`{' '.join(seg)[:60]}`: {p}") for p in command_problems(seg, page)]
    return [f"{where}:{line}: {problem}" for line, problem in sorted(set(found))]


# ----------------------------------------------------------------------------- the tests


DOCS = docs(ROOT)


@pytest.mark.parametrize("doc", DOCS, ids=[p.stem for p in DOCS])
def test_what_a_page_points_at_exists(doc):
    found = problems(doc)
    assert found == [], "stale references:\n" + "\n".join(found)


# (a line planted in a copy of lesson 10, what its message must say); a ```bash block's lines are commands
PLANTED = [
    ("No tensor-parallel degree divides it (lesson 8 splits the vocabulary).", "which is lesson 10 ("),
    ("The loss over a split vocabulary (lesson 10, section 5) is exact.", "lesson 10 section 3 (The vocabulary"),
    ("The ring all-reduce, by hand, in lesson 42.", "there is no lesson 42"),
    ("Lesson 11, section 12 says how.", "lesson 11 has no section 12"),
    ("Lesson 10 §9 pays for it.", "lesson 10 has no section 9"),
    ("Lessons 9–29 split the model.", "there is no lesson 29"),
    ("See section 11 above.", "this lesson has no section 11"),
    ("The plan is in `19-planning.md`.", "there is no lesson file 19-planning.md"),
    ("`train.resume_changes` says what each change means.", "it is instruments.reports.resume_changes"),
    ("`parallel.Grid.no_such_method` counts them.", "class Grid (parallel.py) has no member no_such_method"),
    ("`GradSync.launch_all` launches a bucket.", "class GradSync has no member launch_all"),
    ("`support/launcher.py` holds the table.", "there is no support/launcher.py"),
    ("`launcher.py` holds the table.", "there is no file launcher.py"),
    ("`--sequence-parallel` splits the LayerNorms.", "no program of ours (nor torchrun) has a flag --sequence-par"),
    ("`--cp-attn spiral` is the third way.", "--cp-attn takes one of ring, ulysses, not spiral"),
    ("`python -m instruments.hf import CKPT DIR` converts it.", "python -m instruments.hf has no command import"),
    ("python train.py --device cpu --tp 2 --sequence-parallel", "train.py has no flag --sequence-parallel"),
    ("python sample.py --ckpt runs/tp --tokens 8 --top-p 0.9", "sample.py has no flag --top-p"),
    ("python -m instruments.checkpoints merge runs/tp/ckpt out.pt", "has no command merge"),
    ("python -m instruments.export runs/tp/ckpt", "there is no module instruments.export"),
    ("torchrun --nproc-per-nod 2 train.py --tp 2", "torchrun has no flag --nproc-per-nod"),
    ("torchrun --standalone --nproc-per-node 2 train.py --pp-schedule zigzag", "not zigzag"),
    ("torchrun --rdzv-id lesson11-$$ --nproc-per-node 2 train.py", "a name that says lesson 11, in lesson 10"),
    ("python tests/bench_kernels.py --device cuda", "there is no tests/bench_kernels.py"),
    ("python tests/bench.py --preset gpt2 --gpu", "tests/bench.py has no flag --gpu"),
    ("python -m pytest -q tests/test_kernal.py -k T100", "there is no tests/test_kernal.py"),
    ("| send / recv | activations to the next pipeline stage, gradients back | 9 |", "which is lesson 11 ("),
]
# the same references, right: none is a problem
RIGHT = ["No tensor-parallel degree divides it (lesson 10, section 3, splits the vocabulary).",
         "Lesson 10 §3 splits the embedding over the ranks; lessons 9–20 split the model.",
         "`instruments.reports.resume_changes` says what each change means, and `parallel.Grid.owns` who owns what.",
         "`model.generate` samples (a GPT's method), `GradSync._launch` launches a bucket, and `--cp-attn ulysses`"
         " trades tokens for heads.",
         "python -m instruments.checkpoints consolidate runs/tp/ckpt out.pt",
         "python -m pytest -q tests/test_kernels.py -k T100",
         "torchrun --standalone --nproc-per-node 2 train.py --tp 2 --sp --pp-schedule interleaved --attn math",
         "| send / recv | activations to the next pipeline stage, gradients back | 11 |"]


def plant(text: str, lines: list[str]) -> str:
    """`text` with `lines` added at its end: prose as paragraphs, commands in a ```bash block, table rows
    under a header with a lesson column."""
    commands = [x for x in lines if COMMAND.match(x)]
    rows = [x for x in lines if x.startswith("|")]
    prose = [x for x in lines if x not in commands and x not in rows]
    return (text + "\n" + "".join(f"{x}\n\n" for x in prose) + "```bash\n" + "".join(f"{x}\n" for x in commands)
            + "```\n\n| collective | what for | lesson |\n|---|---|---|\n" + "".join(f"{x}\n" for x in rows))


def test_a_stale_reference_of_each_kind_is_caught_at_its_line(tmp_path):
    copy = tmp_path / "lessons" / "10-tensor-parallel.md"
    copy.parent.mkdir()
    copy.write_text(plant((ROOT / "lessons" / copy.name).read_text(), RIGHT))
    assert problems(copy) == []
    copy.write_text(plant((ROOT / "lessons" / copy.name).read_text(), [x for x, _ in PLANTED]))
    found, lines = problems(copy), copy.read_text().split("\n")
    for planted, says in PLANTED:
        at = f"{copy.name}:{lines.index(planted) + 1}: "
        assert any(p.startswith(at) and says in p for p in found), (planted, says, found)
    assert len(found) == len(PLANTED), "\n".join(found)  # one message each, nothing else


def test_the_course_is_read_from_the_lessons_folder(tmp_path):
    """Renumbered, the course is checked as it then is: nothing in this file lists the lessons."""
    (tmp_path / "lessons").mkdir()
    for name, title in (("01-words.md", "Words: the vocabulary"), ("02-steps.md", "Steps: the optimizer")):
        (tmp_path / "lessons" / name).write_text(f"# Lesson {name[1]} — {title}\n\nIntro.\n\n## 1. The part\n")
    course = Course(tmp_path)
    assert sorted(course.lessons) == [1, 2]
    assert lesson_problems("the optimizer (lesson 2, section 1)", course, None) == []
    assert "there is no lesson 3" in lesson_problems("see lesson 3", course, None)[0][1]
    assert "lesson 1 has no section 2" in lesson_problems("lesson 1, section 2", course, None)[0][1]
    assert "the title says lesson 1, the file name 2" in lesson_problems("# Lesson 1 — Steps\n", course, 2)[0][1]
