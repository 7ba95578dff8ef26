"""Test-wide setup and helpers.

TRITON_INTERPRET must be set before triton decorates any kernel (it decides at import time), so
it is set here, before any test module imports kernels.py. Tests that compile kernels for real
GPU targets run in a subprocess with the variable removed (see test_kernels_aot.py).

`run_train` runs train.py as a user would: `python train.py ...` for one process, torchrun for
several, on a small corpus with the byte tokenizer and the `tiny` model.
"""

import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
# One thread per process: the suite runs on 2 workers of a 2-core machine, each starting training processes
# of its own; torch's default (a thread per core in every process) makes them wait for each other, many
# times slower than the same work single-threaded. Set before torch is imported; subprocesses inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# A tiny model on a tiny corpus: a step takes milliseconds, so a test can afford several runs.
# --device cpu: these tests prove CPU semantics (gloo, fp32, bitwise resume) on any machine, with or
# without GPUs; tests/test_gpu.py proves the CUDA path.
TINY = ["--device", "cpu", "--preset", "tiny", "--tokenizer", "byte", "--seq-len", "32", "--batch-size", "8",
        "--max-steps", "4", "--sample-tokens", "0", "--eval-every", "2", "--eval-batches", "1"]


STEPS = ["--max-steps", "4", "--ckpt-every", "0"]  # what a layout test runs, at every layout and on one process


@pytest.fixture(scope="module")
def references(corpus, tmp_path_factory):
    """The single-process run of the flags the layouts of a test module share (test_parallel.py: a depth,
    --n-layer; test_moe.py: experts), run once each: (its metrics rows, its final weights)."""
    runs = {}

    def reference(*flags: str):
        if flags not in runs:
            out = tmp_path_factory.mktemp("single")
            run_train(corpus, out, *STEPS, *flags)
            runs[flags] = metrics(out), final_weights(out)
        return runs[flags]
    return reference


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> dict:
    """A ~150 kB text file of real Python source and a cache directory shared by the session."""
    root = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted((stdlib / "json").glob("*.py")) + sorted((stdlib / "email").glob("*.py"))[:12]
    text = "\n\n".join(f.read_text() for f in files)
    (root / "corpus.txt").write_text(text)
    return {"data": str(root / "corpus.txt"), "cache": str(root / "cache")}


@pytest.fixture(scope="session")
def gpu_corpus(tmp_path_factory) -> dict:
    """~2 MB of the standard library (about 0.5M GPT-2 tokens) and a cache holding the GPT-2 tokenizer, for
    training on a GPU with its defaults (tests/test_gpu.py)."""
    from support import tokenizer

    ranks = tokenizer.DEFAULT_CACHE_DIR / tokenizer.GPT2_FILE
    assert ranks.exists(), f"{ranks} is missing: run `python data.py --fetch-tokenizer` (the README's set-up)"
    root = tmp_path_factory.mktemp("gpu_corpus")
    (root / "cache").mkdir()
    (root / "cache" / tokenizer.GPT2_FILE).write_bytes(ranks.read_bytes())
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    text, size = [], 0
    for f in files:
        if size > 2_000_000:
            break
        text.append(f.read_text(errors="replace"))
        size += len(text[-1])
    (root / "corpus.txt").write_text("\n\n".join(text))
    return {"data": str(root / "corpus.txt"), "cache": str(root / "cache")}


def train_command(corpus: dict, out: Path, *flags: str, nproc: int = 1, tiny: bool = True) -> list[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] \
        if nproc > 1 else [sys.executable]
    return launcher + [str(ROOT / "train.py"), "--data", corpus["data"], "--cache-dir", corpus["cache"],
                       "--out", str(out)] + (TINY if tiny else ["--device", "cpu"]) + list(flags)


def run_train(corpus: dict, out: Path, *flags: str, nproc: int = 1, check: bool = True,
              timeout: float = 300, tiny: bool = True, env: dict | None = None,
              preexec_fn=None) -> subprocess.CompletedProcess:
    """train.py as a user runs it; `preexec_fn` runs in the child before train.py starts (limits)."""
    cmd = train_command(corpus, out, *flags, nproc=nproc, tiny=tiny)
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if env is None else env
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT,
                            preexec_fn=preexec_fn)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)}\nexit {result.returncode}\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-5000:]}")
    return result


def start_ranks(corpus: dict, out: Path, world: int, *flags: str) -> list[subprocess.Popen]:
    """`world` processes of train.py that find each other as torchrun's workers do (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT), without a launcher: nothing stops the others when one fails, so each
    process's own exit status and stderr are seen. Each in a session of its own (`stop_ranks` ends it)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(train_command(corpus, out, *flags), env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True))
    return procs


def stop_ranks(procs: list[subprocess.Popen]) -> None:
    """SIGKILL whatever is left of `start_ranks`' processes (and anything they started), and reap them."""
    import signal
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait()


def metrics(out: Path) -> list[dict]:
    """The per-step rows of metrics.jsonl (events such as spikes are left out)."""
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "event" not in r]


def final_weights(out: Path) -> dict:
    import checkpoint
    return checkpoint.consolidate(checkpoint.latest(Path(out) / "ckpt"))


def saved_share(report: str) -> float:
    """--memory-report's activations line: measured / our formula, the "(100.8%)" after it (a GPT-2's line
    goes on with Korthikanti et al.'s formula, a Llama's ends there)."""
    acts = next(ln for ln in report.splitlines() if "activations saved per layer" in ln)
    return float(re.search(r"formula [\d,]+ \(([\d.]+)%\)", acts).group(1)) / 100


def assert_same_weights(got: dict, ref: dict) -> None:
    """The same final weights, up to fp32 rounding. Adam divides each update by sqrt(v): where a gradient is
    nearly zero, the rounding of another reduction order (another layout) is amplified, and a few elements
    of a model land a few 1e-5 apart (measured: at most 1 in 16k, at most 2.6e-5). A layout bug moves
    weights by about the learning rate (1e-3), and almost all of them."""
    assert got.keys() == ref.keys()
    for name, w in ref.items():
        diff = (got[name].float() - w.float()).abs()
        assert diff.max() <= 1e-4, f"{name}: max difference {diff.max():.2e}"
        assert (diff > 1e-5).sum() <= max(1, diff.numel() // 10_000), f"{name}: {(diff > 1e-5).sum()} elements off"



def processes_started(lesson: Path, only: tuple[int, ...] = ()) -> int:
    """How many Python processes a lesson's ```bash blocks start (all, or the numbers in `only`): each torchrun
    its --nproc-per-node, each other `python`, one. A lesson's runtime is mostly their start-up and their steps."""
    blocks = re.findall(r"^```bash\n(.*?)^```", lesson.read_text(), re.S | re.M)
    blocks = [b for n, b in enumerate(blocks, 1) if not only or n in only]
    runs = re.findall(r"torchrun[^\n]*?--nproc-per-node (\d+)|\bpython3? ", "\n".join(blocks))
    return sum(int(n) if n else 1 for n in runs)


def pytest_collection_modifyitems(items):
    """The lessons first (and the tests that run their blocks), the heaviest first, then everything else in
    its own order. Under `-n 2` each worker takes the next test as it finishes one: a two-minute lesson
    started last would leave the other worker idle for its length; short tests behind the long ones fill
    the gaps."""
    def weight(item) -> int:
        params = item.callspec.params if hasattr(item, "callspec") else {}
        if item.path.name != "test_lessons.py" or "doc" not in params:
            return 0
        return 1 + processes_started(Path(params["doc"]), params.get("only", ()))
    items.sort(key=weight, reverse=True)  # stable: the rest keep their order
