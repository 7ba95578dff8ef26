"""One prepared GPU run: the CUDA half of the project in one command that fits a short GPU loan (not collected
by pytest; tests/test_gpu_run.py runs its CPU smoke mode). GPU time comes in short loans (one H100 or H200 for
about 15 minutes, 10 a command), so nothing of the GPU half may need a long sitting. In ONE command of under
8 minutes on one GPU this runs, the most valuable first, each stage with a time limit of its own:

    tests       tests/test_gpu.py: every case that fits one GPU (its 2-GPU cases skip), on 6 pytest workers
    attention   tests/bench_attention.py: our kernel and --attn auto against SDPA, causal, bf16, T 1k-8k, D 64, 128
    gpt2        train.py, GPT-2 124M, bf16, compiled, 32 x 1024 tokens a step: tokens/s from metrics.jsonl
    nanogpt     nanoGPT, unchanged, on the same text, shapes and precision, compiled: tokens/s from its log
    fp8-linear  tests/bench_fp8.py: one Linear 8192 x 4096 x 4096, forward + backward, fp8 against bf16
    llama-fp8   tests/bench.py: the llama-3.2-1b shape (8 of its 16 layers: --llama-layers), 8 x 2048 tokens
                a step, fp8 with delayed scaling against bf16, each compiled where train.py compiles it

and writes one table, every measure beside its target (issue 46's), to --out: gpu_table.md, gpu_table.json
and gpu_run.log (each stage's command and output), rewritten after each stage: a run cut short leaves one.

    python tests/gpu_run.py --prepare              # here, once: .gpu/ gets the tokenizer and nanoGPT
    python3 tests/gpu_run.py --out $OUT            # on the lent GPU (DESIGN.md: the run tool's call)
    python tests/gpu_run.py --device cpu --out /tmp/smoke    # the whole orchestration at toy sizes, on a CPU

The time budget (--budget, 450 s on a GPU): each stage gets the least of its cap and what is left once the
floors of the stages after it are set aside. A stage that hangs is killed (its whole process tree) at its
limit and becomes a row that says so; the stages after it still run. On a CPU (--device cpu) every stage
starts and is read at toy sizes (test_gpu.py skips whole, the kernel runs in the Triton interpreter, train.py
and nanoGPT train a tiny model): numbers that mean nothing, targets not judged.
"""

import argparse
import contextlib
import datetime
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # support/ (the tokenizer), imported where it is needed
CARRIED = ROOT / ".gpu"  # what a GPU call carries (ignored by git): the tokenizer, nanoGPT
GPT2_FILE = "gpt2.tiktoken"
EOT = 50256  # GPT-2's <|endoftext|>, between documents in nanoGPT's train.bin (as its prep scripts do)


@dataclass
class Stage:
    name: str
    cap: float  # seconds it may run at most
    floor: float  # seconds set aside for it while the stages before it run


# (name, cap, floor) on a GPU; on a CPU every stage has ample time (the smoke run is never cut short).
STAGES = {"cuda": [Stage("tests", 210, 60), Stage("attention", 60, 30), Stage("gpt2", 90, 50),
                   Stage("nanogpt", 90, 50), Stage("fp8-linear", 30, 15), Stage("llama-fp8", 120, 60)],
          "cpu": [Stage(name, 600, 300) for name in ("tests", "attention", "gpt2", "nanogpt", "fp8-linear",
                                                     "llama-fp8")]}
BUDGET = {"cuda": 450, "cpu": 3600}

# What each stage runs, by device: issue 46's shapes on a GPU, toys on a CPU.
SIZES = {
    "cuda": dict(pytest=["-n", "6"], test_timeout=180, corpus_bytes=4_000_000, skip=10,
                 attention=["--dtype", "bf16"],
                 gpt2=dict(preset="gpt2", batch=32, seq=1024, steps=30, precision="bf16"),
                 nanogpt=["--compile=True", "--dtype=bfloat16", "--batch_size=32", "--block_size=1024"],
                 fp8_linear="8192,4096,4096", fp8_rounds=10,
                 llama=["--preset", "llama-3.2-1b", "--seq-len", "2048", "--batch-size", "8",
                        "--micro-batch-size", "4", "--steps", "2", "--rounds", "4"]),
    "cpu": dict(pytest=[], test_timeout=0, corpus_bytes=150_000, skip=2,
                attention=["--dtype", "fp16", "--shapes", "1,1,16,64", "1,1,16,128"],
                gpt2=dict(preset="tiny", batch=4, seq=64, steps=6, precision="fp32"),
                nanogpt=["--device=cpu", "--compile=False", "--dtype=float32", "--batch_size=4", "--block_size=64",
                         "--n_layer=2", "--n_head=2", "--n_embd=64"],
                fp8_linear="64,64,64", fp8_rounds=2,
                llama=["--preset", "llama-tiny", "--seq-len", "32", "--batch-size", "2", "--micro-batch-size", "2",
                       "--steps", "1", "--rounds", "2"]),
}


@dataclass
class Row:
    """One line of the table; met: None where not judged (a smoke run, no target, nothing measured)."""
    key: str
    measure: str
    measured: str
    target: str = "-"
    met: bool | None = None
    value: float | None = None


@dataclass
class Outcome:
    status: str  # "ok", "failed (exit N)", "timed out after S s" or "not run: ..."
    seconds: float = 0.0
    log: Path | None = None
    tail: str = ""  # the line of its output that says what went wrong, or its last


@dataclass
class Run:
    """Everything the stages share: where things are, the clock and the rows so far."""
    args: argparse.Namespace
    device: str
    work: Path
    out: Path
    deadline: float
    started: float = field(default_factory=time.monotonic)
    env_line: str = ""
    values: dict = field(default_factory=dict)  # measured numbers by key, for rows that combine stages
    outcomes: dict = field(default_factory=dict)  # stage name -> Outcome
    rows: list = field(default_factory=list)
    problems: list = field(default_factory=list)  # what the set-up found missing
    sizes: dict = field(init=False)

    def __post_init__(self):
        self.sizes = SIZES[self.device]

    def judged(self, ok: bool) -> bool | None:
        return ok if self.device == "cuda" else None  # a smoke run's numbers are not measurements


# ----------------------------------------------------------------------------- running a stage, bounded


def descendants(pid: int) -> list[int]:
    """Every process below pid (from /proc), so that a stage's children in sessions of their own are ended too."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found, todo = found + kids, todo + kids
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the stage: its process group (it leads one) and every descendant, in whatever group or session."""
    for kill, target in [(os.killpg, proc.pid)] + [(os.kill, pid) for pid in descendants(proc.pid)]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(target, signal.SIGKILL)
    proc.wait()


def stage_env(run: Run, interpret: bool = False) -> dict:
    """A stage's environment: unbuffered; the Triton interpreter only where asked (test_gpu.py's conftest
    decides for itself); nothing of an enclosing pytest (the smoke test runs this script inside one)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "TRITON_INTERPRET"))}
    return {**env, "PYTHONUNBUFFERED": "1", **({"TRITON_INTERPRET": "1"} if interpret else {})}


def execute(run: Run, name: str, cmd: list[str], timeout: float, cwd: Path = ROOT, interpret: bool = False) -> Outcome:
    """Run one stage's command with its output in its own log, killed whole at `timeout` seconds."""
    log = run.work / f"{name}.log"
    if run.args.hang == name:  # fault injection (tests/test_gpu_run.py): a stage that never ends, whose child
        cmd = [sys.executable, "-c", HANG]  # (in a session of its own) must be ended with it
    with open(log, "w") as f:
        f.write(f"$ (cd {cwd} && {' '.join(cmd)})\n")
        f.flush()
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=cwd, env=stage_env(run, interpret), stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, process_group=0)  # a group of its own, to kill whole
        try:
            code = proc.wait(timeout=timeout)
            status = "ok" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            status = f"timed out after {timeout:.0f} s"
        except BaseException:  # this script stopped (SIGTERM, Ctrl-C): the stage goes with it
            kill_tree(proc)
            raise
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    tail = next((ln for ln in reversed(lines) if re.search(r"error|Error|assert", ln)), lines[-1] if lines else "")
    run.outcomes[name] = Outcome(status, time.monotonic() - t0, log, tail[:200])
    return run.outcomes[name]


HANG = ("import subprocess as s, sys; c = s.Popen([sys.executable, '-c', 'import time; time.sleep(10**6)'], "
        "start_new_session=True); print(f'hanging: pid {c.pid}', flush=True); c.wait()")


def not_measured(outcome: Outcome, rows: list[Row]) -> list[Row]:
    """A stage's rows when it gave nothing to read: its status (and the line that says why) as the measured value."""
    why = f": {outcome.tail}" if outcome.status.startswith("failed") and outcome.tail else ""
    return [Row(r.key, r.measure, outcome.status + why, r.target) for r in rows]


# ----------------------------------------------------------------------------- the stages: command and parse


def stage_tests(run: Run, timeout: float) -> list[Row]:
    """tests/test_gpu.py on this machine's GPU, -v so that a run cut short still says what passed."""
    cmd = [sys.executable, "-m", "pytest", "tests/test_gpu.py", "-v", "-rA", "-p", "no:cacheprovider",
           *run.sizes["pytest"]]
    if run.sizes["test_timeout"] and importlib.util.find_spec("pytest_timeout"):  # a hung case shows where
        cmd += ["--timeout", str(run.sizes["test_timeout"])]
    if run.sizes["pytest"] and xdist_steals():  # idle workers take queued cases (the long resume ones)
        cmd += ["--dist", "worksteal"]
    if run.args.tests:
        cmd += ["-k", run.args.tests]
    outcome = execute(run, "tests", cmd, timeout)
    counts = pytest_counts(outcome.log.read_text(errors="replace"))
    done = sum(counts[k] for k in ("passed", "failed", "error", "skipped"))
    left = max(counts["collected"] - done, 0)
    skips = "; ".join(f"{n} {why}" for why, n in counts["skip_reasons"].items())
    measured = (f"{counts['passed']} passed, {counts['failed'] + counts['error']} failed, {counts['skipped']} "
                f"skipped ({skips or 'none'}), {left} not run, of {counts['collected']}")
    if counts["failed_names"]:
        measured += "; failed: " + ", ".join(counts["failed_names"])
    if left and (missed := not_reached(counts["done"], run.args.tests)):  # for the next call's --tests
        measured += f"; not reached: {' or '.join(missed)}"
    measured = f"{outcome.status}: {measured} so far" if outcome.status.startswith(("timed", "not")) else \
        f"{measured}; {outcome.seconds:.0f} s"
    ok = outcome.status == "ok" and counts["passed"] > 0 and left == 0
    return [Row("tests", "tests/test_gpu.py on one GPU (every case that fits one)", measured,
                "every case that fits one GPU passes", run.judged(ok), float(counts["passed"]))]


def not_reached(done: set[str], expression: str | None) -> list[str]:
    """test_gpu.py's test functions with a case not in `done`: what a second call's --tests names."""
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             "tests/test_gpu.py", *(["-k", expression] if expression else [])], cwd=ROOT,
                            capture_output=True, text=True, timeout=60).stdout
    ids = re.findall(r"^tests/\S+::\S+", listed, re.M)
    return sorted({n.split("::")[1].split("[")[0] for n in ids if n not in done})


def xdist_steals() -> bool:
    """pytest-xdist 3.2 and later schedule by work stealing (--dist worksteal)."""
    version = importlib.metadata.version("pytest-xdist") if importlib.util.find_spec("xdist") else "0"
    return tuple(int(v) for v in re.findall(r"\d+", version)[:2]) >= (3, 2)


def pytest_counts(text: str) -> dict:
    """What pytest -v -rA said: per-test outcomes as they finished (under xdist too), the collected count, and
    the skip reasons of the summary. Read from the live lines, so a run killed mid-way is counted so far."""
    outcome = {}
    for m in re.finditer(r"^(?:\[gw\d+\] \[ *\d+%\] )?(PASSED|FAILED|ERROR|SKIPPED) (tests/\S+::\S+)", text, re.M):
        outcome[m.group(2)] = m.group(1).lower()
    for m in re.finditer(r"^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)", text, re.M):
        outcome[m.group(1)] = m.group(2).lower()
    collected = re.search(r"(\d+) selected|\[(\d+) items?\]", text) or re.search(r"collected (\d+) item", text)
    reasons: dict[str, int] = {}
    for m in re.finditer(r"^SKIPPED \[(\d+)\] [^:]+(?::\d+)?: (.+)$", text, re.M):
        reasons[m.group(2).strip()] = reasons.get(m.group(2).strip(), 0) + int(m.group(1))
    counts = {k: list(outcome.values()).count(k) for k in ("passed", "failed", "error", "skipped")}
    counts["collected"] = int(next(g for g in collected.groups() if g)) if collected else len(outcome)
    counts["skip_reasons"] = reasons
    counts["failed_names"] = sorted(n.split("::", 1)[1] for n, o in outcome.items() if o in ("failed", "error"))
    counts["done"] = set(outcome)
    return counts


def stage_attention(run: Run, timeout: float) -> list[Row]:
    """Our kernel and --attn auto against SDPA, forward + backward (and forward alone, for the record)."""
    target = {64: 1.0, 128: 0.8, None: 0.97}  # the lowest ratio each row may show (auto: within timing noise)
    rows = [Row(f"attention.d{d}", f"attention fwd+bwd ours / SDPA, causal, D {d}", "", f">= {target[d]}x")
            for d in (64, 128)]
    rows += [Row("attention.auto", "attention fwd+bwd --attn auto / SDPA, D 64 and 128", "",
                 "never below SDPA (>= 0.97x: timing noise)"),
             Row("attention.forward", "attention forward ours / SDPA, D 64 | 128", "")]
    out = run.work / "attention.json"
    cmd = [sys.executable, "tests/bench_attention.py", "--device", run.device, *run.sizes["attention"], "--no-memory",
           "--json", str(out)]
    outcome = execute(run, "attention", cmd, timeout, interpret=run.device == "cpu")
    if outcome.status != "ok" or not out.exists():
        return not_measured(outcome, rows)
    shapes = json.loads(out.read_text())["rows"]

    def span(key: str, d: int | None = None) -> tuple[str, float | None]:
        mine = [s for s in shapes if d in (None, s["D"])]
        if not mine:
            return "no shape of this D", None
        low = min(mine, key=lambda s: s[key])
        each = ", ".join(f"T {s['T']}: {s[key]:.2f}" for s in mine) if d else f"lowest at T {low['T']}, D {low['D']}"
        return f"{low[key]:.2f}-{max(s[key] for s in mine):.2f}x ({each})", low[key]

    for row, d in zip(rows, (64, 128, None), strict=False):
        row.measured, row.value = span("auto_ratio" if d is None else "fwd_bwd_ratio", d)
        row.met = run.judged(row.value is not None and row.value >= target[d])
    rows[3].measured = " | ".join(f"D {d}: {span('fwd_ratio', d)[0]}" for d in sorted({s["D"] for s in shapes}))
    return rows


def stage_gpt2(run: Run, timeout: float) -> list[Row]:
    """train.py as a user runs it, at nanoGPT's shapes: tokens/s of each step after the first `skip` (compiling)."""
    g, skip = run.sizes["gpt2"], run.sizes["skip"]
    label = f"{g['preset']} through train.py, {g['precision']}, {g['batch']} x {g['seq']} tokens a step"
    row = Row("gpt2.ours", label, "", ">= 500k tokens/s")
    cmd = [sys.executable, "train.py", "--device", run.device, "--data", str(run.work / "corpus.txt"),
           "--cache-dir", str(run.work / "cache"), "--out", str(run.work / "gpt2"), "--preset", g["preset"],
           "--precision", g["precision"], "--batch-size", str(g["batch"]), "--seq-len", str(g["seq"]),
           "--max-steps", str(g["steps"]), "--eval-every", str(g["steps"]), "--eval-batches", "1",
           "--sample-tokens", "0", "--stats-every", "0"]
    outcome = execute(run, "gpt2", cmd, timeout)
    metrics = run.work / "gpt2" / "metrics.jsonl"
    rows = [json.loads(ln) for ln in metrics.read_text().splitlines()] if metrics.exists() else []
    timed = [r for r in rows if "tokens_per_sec" in r and r["step"] > skip]
    if outcome.status != "ok" or not timed:
        return not_measured(outcome, [row])
    said = re.search(r"attention (\S+), compile (on|off)", outcome.log.read_text(errors="replace"))
    if said:
        row.measure += f", attention {said.group(1)}, compile {said.group(2)}"
    tps = statistics.median(r["tokens_per_sec"] for r in timed)
    mfu = [r["mfu"] for r in timed if "mfu" in r]
    row.measured = f"{tps:,.0f} tokens/s" + (f" (MFU {statistics.median(mfu):.1%})" if mfu else "") + \
        f", median of steps {skip + 1}-{timed[-1]['step']}"
    row.value, row.met = tps, run.judged(tps >= 500_000)
    run.values["gpt2.ours"] = tps
    return [row]


def stage_nanogpt(run: Run, timeout: float) -> list[Row]:
    """nanoGPT's train.py, unchanged, in its own folder (its configurator is read from there), on the bins of
    the same text; its `iter N: ... time T ms` lines give tokens/s. Then ours / nanoGPT."""
    g, skip, peer = run.sizes["gpt2"], run.sizes["skip"], find_nanogpt(run.args.nanogpt)
    rows = [Row("gpt2.nanogpt", f"nanoGPT (unchanged) on the same text: {' '.join(run.sizes['nanogpt'])}", ""),
            Row("gpt2.ratio", "ours / nanoGPT, tokens/s (the two rows above)", "", ">= 1.15x")]
    if peer is None:
        run.outcomes["nanogpt"] = Outcome("not run: nanoGPT not found (python tests/gpu_run.py --prepare copies "
                                          "../shared/peers/nanogpt into .gpu/)")
        return not_measured(run.outcomes["nanogpt"], rows)
    cmd = [sys.executable, "train.py", f"--dataset={run.work / 'nanogpt_data'}", f"--out_dir={run.work / 'ng'}",
           f"--max_iters={g['steps']}", "--gradient_accumulation_steps=1", "--eval_interval=100000",
           "--eval_iters=2", "--log_interval=1", "--always_save_checkpoint=False", *run.sizes["nanogpt"]]
    outcome = execute(run, "nanogpt", cmd, timeout, cwd=peer)
    times = [float(m.group(2)) for m in re.finditer(r"^iter (\d+): loss \S+, time ([\d.]+)ms",
                                                    outcome.log.read_text(errors="replace"), re.M)
             if int(m.group(1)) > skip]
    if outcome.status != "ok" or not times:
        return not_measured(outcome, rows)
    tps = g["batch"] * g["seq"] / (statistics.median(times) / 1e3)
    rows[0].measured, rows[0].value = f"{tps:,.0f} tokens/s, median of iters {skip + 1}-{skip + len(times)}", tps
    ours = run.values.get("gpt2.ours")
    if ours:
        rows[1].measured, rows[1].value = f"{ours / tps:.2f}x", ours / tps
        rows[1].met = run.judged(ours / tps >= 1.15)
    else:
        rows[1].measured = "no tokens/s of ours to compare (its row says why)"
    return rows


def stage_fp8_linear(run: Run, timeout: float) -> list[Row]:
    m, k, n = run.sizes["fp8_linear"].split(",")
    row = Row("fp8.linear", f"one Linear {m} x {k} -> {n}, forward + backward, fp8 (current scaling) vs bf16, "
              "eager", "", "fp8 >= 1.5x faster")
    out = run.work / "fp8_linear.json"
    cmd = [sys.executable, "tests/bench_fp8.py", "--device", run.device, "--shape", run.sizes["fp8_linear"],
           "--rounds", str(run.sizes["fp8_rounds"]), "--json", str(out)]
    outcome = execute(run, "fp8-linear", cmd, timeout)
    if outcome.status != "ok" or not out.exists():
        return not_measured(outcome, [row])
    r = json.loads(out.read_text())
    speedup = r["bf16_ms"] / r["fp8_ms"]
    row.measured = f"bf16 {r['bf16_ms']:.3f} ms, fp8 {r['fp8_ms']:.3f} ms: {speedup:.2f}x"
    row.value, row.met = speedup, run.judged(speedup >= 1.5)
    return [row]


def stage_llama_fp8(run: Run, timeout: float) -> list[Row]:
    """tests/bench.py --precision fp8 --fp8-recipe delayed: fp8 and bf16 in alternating rounds, one process."""
    rows = [Row("fp8.llama", "llama end to end, fp8 (delayed scaling) / bf16, tokens/s", "", ">= 1.2x"),
            Row("fp8.llama_loss", "llama loss, fp8 against bf16 at every step (the same batch)", "",
                "within 1%")]
    out = run.work / "llama_fp8.json"
    cmd = [sys.executable, "tests/bench.py", "--device", run.device, *run.sizes["llama"], "--precision", "fp8",
           "--fp8-recipe", "delayed", "--no-unfused", "--json", str(out)]
    if run.args.llama_layers:
        cmd += ["--n-layer", str(run.args.llama_layers)]
    outcome = execute(run, "llama-fp8", cmd, timeout)
    if outcome.status != "ok" or not out.exists():
        return not_measured(outcome, rows)
    r = json.loads(out.read_text())
    fp8, bf16 = r["configs"]["ours"], r["configs"]["bf16"]
    compiled = f"fp8 compile {'on' if fp8['compiled'] else 'off'}, bf16 compile {'on' if bf16['compiled'] else 'off'}"
    shape = f"{r['preset']} ({r['n_layer']} of {r['preset_layers']} layers), {r['batch_size']} x {r['seq_len']} " \
        f"a step, attention {r['attn']}, {compiled}, {r['fp8_share']:.0%} of the FLOPs in fp8"
    rows[0].measure = f"{shape}: fp8 (delayed scaling) / bf16, tokens/s"
    ratio = fp8["tokens_per_s"] / bf16["tokens_per_s"]
    rows[0].measured = f"fp8 {fp8['tokens_per_s']:,.0f}, bf16 {bf16['tokens_per_s']:,.0f} tokens/s: {ratio:.2f}x"
    rows[0].value, rows[0].met = ratio, run.judged(ratio >= 1.2)
    apart = max(abs(a - b) / abs(b) for a, b in zip(fp8["losses"], bf16["losses"], strict=True))
    rows[1].measured = f"at most {apart:.2%} apart over {len(bf16['losses'])} steps ({bf16['losses'][0]:.3f} -> " \
        f"{bf16['losses'][-1]:.3f} in bf16)"
    rows[1].value, rows[1].met = apart, run.judged(apart <= 0.01)
    return rows


RUNNERS = {"tests": stage_tests, "attention": stage_attention, "gpt2": stage_gpt2, "nanogpt": stage_nanogpt,
           "fp8-linear": stage_fp8_linear, "llama-fp8": stage_llama_fp8}
ROW_KEYS = {"tests": ["tests"], "attention": ["attention.d64", "attention.d128", "attention.auto", "attention.forward"],
            "gpt2": ["gpt2.ours"], "nanogpt": ["gpt2.nanogpt", "gpt2.ratio"], "fp8-linear": ["fp8.linear"],
            "llama-fp8": ["fp8.llama", "fp8.llama_loss"]}


# ----------------------------------------------------------------------------- what the stages stand on


def find_nanogpt(given: str | None = None) -> Path | None:
    """nanoGPT's folder: --nanogpt, else the carried copy (.gpu/nanogpt), else shared/peers/nanogpt in or beside
    this checkout. None where there is none (a CI machine has no peers: the row says so)."""
    places = [Path(given)] if given else [CARRIED / "nanogpt", ROOT / "shared" / "peers" / "nanogpt",
                                          ROOT.parent / "shared" / "peers" / "nanogpt"]
    return next((p.resolve() for p in places if all((p / f).is_file() for f in ("train.py", "model.py",
                                                                                "configurator.py"))), None)


def prepare(nanogpt: str | None) -> int:
    """--prepare, here, before a GPU call: .gpu/ gets the GPT-2 tokenizer and nanoGPT, all the call carries
    (the device has no network, and a `../shared` beside the checkout does not travel)."""
    from support import tokenizer

    ranks, peer = tokenizer.DEFAULT_CACHE_DIR / GPT2_FILE, find_nanogpt(nanogpt)
    if not ranks.is_file() or peer is None:
        print(f"error: {ranks} is missing: run `python data.py --fetch-tokenizer` first" if peer else "error: "
              "nanoGPT is not in .gpu/, shared/peers/ or ../shared/peers/: give its folder, --nanogpt DIR",
              file=sys.stderr)
        return 2
    CARRIED.mkdir(exist_ok=True)
    shutil.copyfile(ranks, CARRIED / GPT2_FILE)
    if peer != (CARRIED / "nanogpt").resolve():  # its files (a flat folder), writable, without their modes
        (CARRIED / "nanogpt").mkdir(exist_ok=True)
        for f in (f for f in peer.iterdir() if f.is_file()):
            shutil.copyfile(f, CARRIED / "nanogpt" / f.name)
    size = sum(f.stat().st_size for f in CARRIED.rglob("*") if f.is_file())
    print(f"{CARRIED} (ignored by git, carried by the call): the tokenizer and nanoGPT (from {peer}), "
          f"{size / 2**20:.1f} MiB")
    print('the GPU call: run(command="python3 tests/gpu_run.py --out $OUT", carry=[".gpu"], timeout_s=600)')
    return 0


def setup(run: Run) -> None:
    """The tokenizer where train.py and test_gpu.py look for it, the text both trainers read, nanoGPT's
    train.bin / val.bin of it (GPT-2 tokens, <|endoftext|> between files), and the machine's versions; what
    is missing goes to run.problems (lines of the table's header)."""
    import numpy as np

    from support import tokenizer

    home = tokenizer.DEFAULT_CACHE_DIR / GPT2_FILE
    if not home.exists() and (CARRIED / GPT2_FILE).exists():  # a fresh GPU machine: the carried copy
        home.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(CARRIED / GPT2_FILE, home)
    (run.work / "cache").mkdir()
    texts = []  # this machine's standard library, whole files in sorted order, about corpus_bytes of them
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if sum(map(len, texts)) < run.sizes["corpus_bytes"]:
            texts.append(f.read_text(errors="replace"))
    (run.work / "corpus.txt").write_text("\n\n".join(texts))
    if home.exists():
        shutil.copyfile(home, run.work / "cache" / GPT2_FILE)
        tok = tokenizer.get_tokenizer("gpt2", run.work / "cache")
        ids = np.concatenate([np.append(t, EOT) for t in tok.encode_many(texts)]).astype(np.uint16)
        (run.work / "nanogpt_data").mkdir()
        cut = int(len(ids) * 0.95)  # nanoGPT's own prep scripts keep a few percent for validation
        ids[:cut].tofile(run.work / "nanogpt_data" / "train.bin")
        ids[cut:].tofile(run.work / "nanogpt_data" / "val.bin")
    else:
        run.problems.append(f"the GPT-2 tokenizer is in neither {home} nor {CARRIED}: run tests/gpu_run.py --prepare")
    probe = subprocess.run([sys.executable, "-c", VERSIONS], capture_output=True, text=True, timeout=120,
                           env=stage_env(run))
    run.env_line = probe.stdout.strip() or f"versions unknown: {probe.stderr.strip()[-200:]}"


VERSIONS = ("import platform, torch, triton; g = torch.cuda.get_device_name() if torch.cuda.is_available() else "
            "'no GPU'; print(f'{g}; torch {torch.__version__}, CUDA {torch.version.cuda}, triton {triton.__version__}, "
            "Python {platform.python_version()}')")


# ----------------------------------------------------------------------------- the run and its table


def run_stages(run: Run, stages: list[Stage]) -> None:
    """Each stage in order, with min(its cap, what is left once the later stages' floors are set aside)."""
    for i, stage in enumerate(stages):
        left = run.deadline - time.monotonic()
        timeout = min(stage.cap, left - sum(s.floor for s in stages[i + 1:]))
        if timeout < min(stage.cap, stage.floor) / 2:
            outcome = Outcome(f"not run: {max(left, 0):.0f} s left of the {run.args.budget:.0f} s budget")
            rows = not_measured(outcome, [Row(k, k, "") for k in ROW_KEYS[stage.name]])
        else:
            print(f"[{time.monotonic() - run.started:5.0f} s] {stage.name}: up to {timeout:.0f} s", flush=True)
            rows = RUNNERS[stage.name](run, timeout)
            outcome = run.outcomes.setdefault(stage.name, Outcome("not run"))
        run.outcomes[stage.name] = outcome
        run.rows += rows
        print(f"[{time.monotonic() - run.started:5.0f} s] {stage.name}: {outcome.status}", flush=True)
        write_table(run, stages)


def write_table(run: Run, stages: list[Stage]) -> str:
    """gpu_table.md, gpu_table.json and gpu_run.log under --out: the rows so far, and for the stages still to
    come a row each that says so."""
    rows = list(run.rows)
    for stage in stages:
        if stage.name not in run.outcomes:
            rows += [Row(k, k, "not run yet") for k in ROW_KEYS[stage.name]]
    mark = {True: "yes", False: "NO", None: "-"}
    elapsed = time.monotonic() - run.started
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    ran = ", ".join(f"{name} {o.status} ({o.seconds:.0f} s)" if o.seconds else f"{name} {o.status}"
                    for name, o in run.outcomes.items())
    lines = [f"GPU run of {date}: {run.env_line}", "",
             f"`tests/gpu_run.py --device {run.device}`: {elapsed:.0f} s of a {run.args.budget:.0f} s budget"
             + ("" if run.device == "cuda" else " (a CPU smoke run: toy sizes, targets not judged)")
             + f". Stages: {ran or 'none yet'}.", *(f"Set-up: {p}" for p in run.problems), "",
             "| measure | measured | target (issue 46) | met |", "|---|---|---|---|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in (r.measure, r.measured, r.target, mark[r.met])) + " |"
              for r in rows]
    text = "\n".join(lines) + "\n"
    (run.out / "gpu_table.md").write_text(text)
    record = {"date": date, "device": run.device, "environment": run.env_line, "budget_s": run.args.budget,
              "seconds": elapsed, "problems": run.problems, "rows": [asdict(r) for r in rows],
              "stages": {n: {"status": o.status, "seconds": o.seconds} for n, o in run.outcomes.items()}}
    (run.out / "gpu_table.json").write_text(json.dumps(record, indent=1))
    with open(run.out / "gpu_run.log", "w") as log:
        for name, outcome in run.outcomes.items():
            path = run.work / f"{name}.log"
            said = path.read_text(errors="replace") if path.exists() else ""
            log.write(f"\n======== {name}: {outcome.status}\n{said}")
    return text


def stage_cap(text: str) -> tuple[str, float]:
    """--cap STAGE=SECONDS."""
    name, _, seconds = text.partition("=")
    if name not in RUNNERS or not re.fullmatch(r"\d+(\.\d*)?", seconds):
        raise argparse.ArgumentTypeError(f"{text!r}: give STAGE=SECONDS, a stage among {', '.join(RUNNERS)}")
    return name, float(seconds)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", help="folder for gpu_table.md, gpu_table.json and gpu_run.log (on the GPU: $OUT)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the smoke run, toy sizes")
    p.add_argument("--budget", type=float, help="seconds for the whole run (default: 450 on cuda)")
    p.add_argument("--only", help=f"comma-separated stages to run, of: {', '.join(RUNNERS)}")
    p.add_argument("--cap", action="append", default=[], metavar="STAGE=SECONDS", type=stage_cap,
                   help="the most a stage may run, instead of its own cap (repeatable)")
    p.add_argument("--tests", help="the tests stage: a pytest -k expression (e.g. the cases a run did not reach)")
    p.add_argument("--llama-layers", type=int, help="the llama-fp8 stage: blocks of the llama-3.2-1b shape "
                   "(default: 8 of its 16 on a GPU, to fit the budget)")
    p.add_argument("--nanogpt", help="nanoGPT's folder (default: .gpu/nanogpt, shared/peers/nanogpt, ../shared/...)")
    p.add_argument("--prepare", action="store_true", help="fill .gpu/ (the tokenizer, nanoGPT) for a GPU call")
    p.add_argument("--hang", choices=list(RUNNERS), help="fault injection (tests): this stage's command never ends")
    args = p.parse_args(argv)
    if args.prepare:
        return prepare(args.nanogpt)
    if not args.out:
        p.error("--out is required (or --prepare)")
    chosen = args.only.split(",") if args.only else list(RUNNERS)
    if unknown := [s for s in chosen if s not in RUNNERS]:
        p.error(f"--only: unknown stage {', '.join(unknown)}; choose among {', '.join(RUNNERS)}")
    args.budget = args.budget or BUDGET[args.device]
    if args.llama_layers is None and args.device == "cuda":
        args.llama_layers = 8  # the shape's layers, half as many: the stage fits its floor (the table says so)
    if args.llama_layers is not None and args.llama_layers < 1:
        p.error("--llama-layers must be at least 1")
    caps = dict(args.cap)
    stages = [Stage(s.name, caps.get(s.name, s.cap), s.floor) for s in STAGES[args.device] if s.name in chosen]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_run-"))
    run = Run(args, args.device, work, out, time.monotonic() + args.budget)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # the finally below still writes
    try:
        setup(run)
        if args.device == "cuda" and run.env_line.startswith("no GPU"):
            print(f"error: --device cuda, but this machine has no CUDA GPU ({run.env_line}); the smoke run is "
                  "--device cpu", file=sys.stderr)
            return 2
        run_stages(run, stages)
    finally:
        text = write_table(run, stages)
        shutil.rmtree(work, ignore_errors=True)
    print(text, flush=True)
    return 0 if all(o.status == "ok" for o in run.outcomes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
