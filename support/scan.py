"""Pass 1 of data preparation: every document, once, through the workers, in order, resumably.

    Reader ──chunks of ~1M characters──▶ --workers processes: for each document, from it alone:
                                          NFC, quality filters, blake2b digest, MinHash signature, tokens
           ──results in order──▶ Work: docs.bin (46-byte records), sig.bin (512-byte signatures),
                                        tokens.bin ([eot] doc [eot] doc ...), manifest.json (finished parts)

Every core. A chunk's results depend only on its documents and are taken back in corpus order, so
the files (and the shards data.py writes from them) are bitwise the same for any number of
processes. At most two chunks per worker are in flight: memory does not grow with the corpus. On
Linux the workers are forked (they run numpy, hashlib and tiktoken code only, which is safe in a
forked child, as PyTorch's DataLoader workers do), so nothing re-imports the main script; elsewhere
they are spawned.

Resumable. Every CHUNKS_PER_PART chunks, the work files are fsynced and then manifest.json records
their sizes: a finished part. A run that stops (a crash, Ctrl-C, a preempted node) resumes after
the last finished part: the files are cut back to it and the reader skips the documents it covers.
"""

import hashlib
import itertools
import json
import multiprocessing
import os
import re
import signal
import sys
import time
import unicodedata
import warnings
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Protocol

import numpy as np
from tqdm import tqdm

from support import dedup, sources, tokenizer
from support.tokenizer import DataError


class Settings(Protocol):
    """What this pass reads of data.py's DataConfig (the flags of `python data.py`)."""
    tokenizer: str
    cache_dir: str
    dedup: bool
    min_chars: int
    max_repeated: float
    max_control: float


FILTERS = ("not_utf8", "binary", "too_short", "repeated_lines", "exact_dup", "near_dup")
KEPT = 0  # a document's status: kept, or the filter that removed it (a file that is not UTF-8 has no record)
STATUS = {name: code for code, name in enumerate(FILTERS[1:], start=1)}
CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # control characters other than \t \n \r
CHUNK_CHARS = 1 << 20  # characters of text a worker gets at a time
CHUNKS_PER_PART = 64  # chunks per finished part of the manifest
RECORD = np.dtype([("status", "u1"), ("nfc", "u1"), ("file", "<u4"), ("number", "<u8"), ("chars", "<u8"),
                   ("tokens", "<u8"), ("digest", "<u8", (2,))])  # one per document read: 46 bytes


# ---------------------------------------------------------------------------------------------- each document, alone

def repeated_fraction(text: str) -> float:
    """The fraction of non-blank characters in lines that repeat an earlier line."""
    seen, repeated, total = set(), 0, 0
    for line in text.splitlines():
        if line.strip():
            total += len(line)
            repeated += len(line) if line in seen else 0
            seen.add(line)
    return repeated / max(total, 1)


def quality_problem(text: str, cfg: Settings) -> str | None:
    """The name of the first quality filter a document fails, or None."""
    if len(CONTROL.findall(text)) > cfg.max_control * len(text):
        return "binary"
    if len(text.strip()) < cfg.min_chars:
        return "too_short"
    if repeated_fraction(text) > cfg.max_repeated:
        return "repeated_lines"
    return None


_WORKER: tuple = ()  # (cfg, tokenizer, token dtype) of this process, set by _init_worker


def _init_worker(cfg: Settings) -> None:
    if multiprocessing.parent_process() is not None:  # a worker process: its parent answers Ctrl-C and SIGTERM
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # (and stops the pool); a forked child inherits the
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # parent's handlers otherwise (interrupt.py)
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


# ---------------------------------------------------------------------------------------------- every core, in order

def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _pool(workers: int, cfg: Settings) -> ProcessPoolExecutor:
    """Worker processes. On Linux they are forked: they run only numpy, hashlib and tiktoken code, which
    are safe in a forked child (as PyTorch's DataLoader workers are), they share this process's loaded
    modules copy-on-write, and nothing re-imports the main script (so prepare() also works from a
    notebook, a heredoc or a script without `if __name__ == "__main__":`). Elsewhere: spawn."""
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method),
                               initializer=_init_worker, initargs=(cfg,))


def _in_order(chunks, cfg: Settings, workers: int, inline: list):
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


# ---------------------------------------------------------------------------------------------- resumable output

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


def scan(reader: sources.Reader, cfg: Settings, work: Work, workers: int, verbose: bool) -> dict:
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
