"""Data preparation at scale: throughput per core, and peak memory as the corpus grows, side by side.

    python tests/bench_data.py                                  # 1x, 3x, 10x the stdlib, GPT-2, every core
    python tests/bench_data.py --sizes 1 3 --workers 1 2 --tokenizer byte

Not collected by pytest. Builds corpora of k copies of this Python's standard library (the default
corpus), each copy varied so that it is new text rather than a near duplicate: copy c appends _c to
every 8th space-separated word, which changes ~half of the 5-word shingles (Jaccard ~0.3 to the
original). Then it prepares each one with `python data.py` semantics in a fresh process per run
(`--run`), so memory peaks do not mix, while a thread samples the memory of that process and of its
workers from /proc every 20 ms (Linux):

  * throughput: characters scanned per second of the scan, per worker process (wall clock), and per
    CPU-second the workers spent (what one core does when the machine is not shared);
  * memory: the peak anonymous memory (RssAnon: the process's own heap, not the page cache behind
    the memory-mapped signature store and token files) of the main process and of the largest worker,
    and the main process's peak RSS (VmHWM, page cache of the mapped files included).

Flat memory means the peaks stay about the same from 1x to 10x; the main process keeps ~60 bytes
per document (its records and masks), never text.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def build(copies: int, out: Path) -> tuple[int, int]:
    """`copies` varied copies of the standard library's .py files under out/; (files, bytes) written."""
    stdlib, files, size = Path(sysconfig.get_paths()["stdlib"]), 0, 0
    sources = []
    for folder, subfolders, names in os.walk(stdlib):
        subfolders[:] = [s for s in subfolders if s not in ("site-packages", "dist-packages")]
        sources += sorted(Path(folder, n) for n in names if n.endswith(".py"))
    for path in sorted(sources):
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for c in range(copies):
            words = text.split(" ")
            if c:
                words[c % 8::8] = [w + f"_{c}" for w in words[c % 8::8]]
            target = out / str(c) / path.relative_to(stdlib)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(" ".join(words))
            files, size = files + 1, size + target.stat().st_size
    return files, size


def _tree(root: int) -> list[int]:
    """root and its descendants, from /proc (a pool's workers are children of the forkserver)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                parents.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += parents.get(pid, [])
    return tree


def _status(pid: int) -> dict:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in lines)
            if k in ("RssAnon", "VmHWM")}


def run_one(args) -> None:
    """--run: prepare one corpus in this process; print one JSON line of what was measured."""
    import data
    me, peaks, stop = os.getpid(), {"main": 0, "worker": 0, "hwm": 0}, threading.Event()

    def sample():
        while not stop.is_set():
            for pid in _tree(me):
                s = _status(pid)
                role = "main" if pid == me else "worker"
                peaks[role] = max(peaks[role], s.get("RssAnon", 0))
            peaks["hwm"] = max(peaks["hwm"], _status(me).get("VmHWM", 0))
            time.sleep(0.02)

    threading.Thread(target=sample, daemon=True).start()
    cfg = data.DataConfig(source=args.run, tokenizer=args.tokenizer, cache_dir=args.cache, workers=args.workers[0])
    start = time.perf_counter()
    out = data.prepare(cfg, verbose=False, force=True)
    wall = time.perf_counter() - start
    stop.set()
    stats = json.loads((out / "meta.json").read_text())["stats"]
    print(json.dumps({"wall": wall, "peaks": peaks, **{k: stats[k] for k in
                      ("documents", "chars", "bytes", "workers", "seconds", "cpu_seconds", "kept")}}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 3, 10], help="copies of the standard library")
    p.add_argument("--workers", type=int, nargs="+", default=[0], help="processes (0: every core); the first "
                   "size is also run with each of these, the others with the last")
    p.add_argument("--tokenizer", default="gpt2", choices=["gpt2", "byte"])
    p.add_argument("--run", help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.run:
        return run_one(args)
    import data
    from support import scan, tokenizer
    workers = [w or scan.cores() for w in args.workers]
    print(f"data preparation of this Python's standard library repeated with variations, {args.tokenizer} "
          f"tokenizer, {scan.cores()} cores")
    print(f"{'corpus':>6} {'MB':>7} {'docs':>7} {'procs':>5} {'wall s':>7} {'scan chars/s':>13} "
          f"{'chars/CPU-s':>12} {'main CPU-s':>10} {'peak anon MB: main':>19} {'worker':>7} {'main RSS MB':>11}")
    rows = [(args.sizes[0], w) for w in workers] + [(k, workers[-1]) for k in args.sizes[1:]]
    with tempfile.TemporaryDirectory() as tmp:
        if args.tokenizer == "gpt2":  # the prepared data goes to a scratch cache: the tokenizer file too
            ranks = Path(data.DEFAULT_CACHE_DIR) / tokenizer.GPT2_FILE
            if not ranks.exists():
                sys.exit(f"error: {ranks} is missing: run python data.py --fetch-tokenizer first")
            (Path(tmp) / "cache").mkdir()
            shutil.copy(ranks, Path(tmp) / "cache" / tokenizer.GPT2_FILE)
        built = {}
        for k, w in rows:
            if k not in built:
                built[k] = build(k, Path(tmp) / f"x{k}")
            cmd = [sys.executable, __file__, "--run", str(Path(tmp) / f"x{k}"), "--workers", str(w),
                   "--tokenizer", args.tokenizer, "--cache", str(Path(tmp) / "cache")]
            r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            per_worker = r["chars"] / r["seconds"]["scan"] / r["workers"] / 1e6
            per_cpu, mb = r["chars"] / r["cpu_seconds"]["workers"] / 1e6, 1 / 2**20
            print(f"{k:>5}x {r['bytes'] / 1e6:7.1f} {r['documents']:7d} {r['workers']:5d} {r['wall']:7.1f} "
                  f"{per_worker:12.2f}M {per_cpu:11.2f}M "
                  f"{r['cpu_seconds']['main']:10.1f} {r['peaks']['main'] * mb:19.0f} "
                  f"{r['peaks']['worker'] * mb if r['workers'] > 1 else float('nan'):7.0f} "
                  f"{r['peaks']['hwm'] * mb:11.0f}", flush=True)


if __name__ == "__main__":
    main()
