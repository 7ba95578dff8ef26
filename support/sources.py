"""Sources: where the documents come from, read as a stream, and corpora by URL, downloaded once and verified.

    --data stdlib | shakespeare | a file, directory or glob          local: read where it lies
    --data tinystories | tinystories-valid | fineweb-edu | ...       named: a pinned list of URLs
    --data https://host/corpus.jsonl.gz[#sha256=HEX]                  any URL of a .txt, .jsonl(.gz), .parquet
         ──fetch──▶ <cache>/downloads/<hash of the URL>-<name> ──Reader──▶ (text, file, number) ...

Documents. A file of a directory or glob is one document (source code: one module per document).
A corpus file is many: a .jsonl(.gz) line is one document (its "text" field), and so is a .parquet
row (its "text" column, read through pyarrow when it is installed); a text file given on its own,
by URL or by name is cut at <|endoftext|> lines (TinyStories' separator, and GPT-2's) and, where a
piece runs past ~4 KB, at the next blank line (so Tiny Shakespeare becomes ~4 KB documents, not one).
`Reader` yields them one at a time, in order, and never holds more than one file's document (or a
parquet batch) in memory: a corpus larger than RAM streams.

Downloads (`fetch`) go to .part files and resume after an interruption with an HTTP Range request
(`Range: bytes=<have>-`, answered by 206 Partial Content), both when a connection drops mid-way
(retried at once while bytes keep arriving) and when the process itself was stopped (the next run
continues the .part). A finished file is verified before it is used:

  * a pin: the size and sha256 of a named source's file, or `#sha256=HEX` after a URL;
  * otherwise trust on first use: the sha256 of the first complete download is recorded in
    <cache>/downloads/pins.json, and a later download of the same URL must match it.

A file that does not match is deleted and refused with a one-line error (data.DataError), never
read. A verified file gets a small stamp (its size, mtime and sha256), so it is not hashed again.
The named sources' pins are the sha256 and sizes of the Hugging Face LFS objects at the pinned
revisions, as published in the repositories' file listings; they are not computed here.
"""

import codecs
import gzip
import hashlib
import json
import os
import sys
import sysconfig
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from glob import glob
from pathlib import Path

from tqdm import tqdm

from support import tokenizer
from support.tokenizer import EOT_TEXT, DataError

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


@dataclass(frozen=True)
class Remote:
    """A file to download: its URL and, when known, its size and sha256."""
    url: str
    size: int | None = None
    sha256: str | None = None


_TINYSTORIES = "https://huggingface.co/datasets/roneneldan/TinyStories/resolve/f54c09fd23315a6f9c86f9dc80f725de7d8f9c64"
_FINEWEB_EDU = ("https://huggingface.co/datasets/HuggingFaceFW/fineweb-edu/resolve/"
                "87f09149ef4734204d70ed1d046ddc9ca3f2b8f9/sample/10BT")
_FINEWEB_EDU_10BT = [  # sample/10BT: 14 parquet files, 9.67M documents, ~10B GPT-2 tokens, 28.5 GB
    ("000_00000", 2152819114, "b1ba7b2ce4cb5ea6ef42dca40263eabb85f37700d01693a68e9b30a31d78e871"),
    ("001_00000", 2152222432, "3fcf2dc69cd52503986276d3d2d26a8c356d0f2ea28a0de4fdbda8cf87755693"),
    ("002_00000", 2151796315, "547ae182d132c9f06b6ce63149567208ea9f57630bfd9b1a2938e504f0c9ebd7"),
    ("003_00000", 2152437524, "22184e6eb25759ddd97783751ffc73e1705dfa2542e630dae1f2a8bac8ee6ddb"),
    ("004_00000", 2152338550, "33557ddd87a07a4ae6fcaf7a4789c7b484e5cc0c273ca12a65b74200e6d8748b"),
    ("005_00000", 2152189947, "e08d79927ecb377786572cd854817c748ceb8880878b1a0eb91abf8c85d505ea"),
    ("006_00000", 2152689867, "554fa2613c9261d6c9c396caab881de3160175794c6c3e1856bf28a0e9cb9b76"),
    ("007_00000", 2150686637, "4b7d1f697d4afff7f5f65cb7aa4d83acc6db716da4d46ea23399d0c50608c6e3"),
    ("008_00000", 2151274846, "a6d9dcc0c72ecd7c7f0173c2d06b3a4249a2ccaa94961469d1a522ca689bbf1a"),
    ("009_00000", 2151913277, "f836cd3c70b95776699eb6c356b2dbf702816e25dcf39992f5c80a29029d23c3"),
    ("010_00000", 2152798864, "e5a2eae25f057f0856a10bfae314c6ca8ea8bb08456d2131e9e89b2b8305e2f6"),
    ("011_00000", 2152323681, "db71cf0425bb3d1813a09f12ff1acd6dabdfb91a2e4f141960254ee5a7f036e7"),
    ("012_00000", 2152069689, "08b47a3e1c25161f796d2f8dbf99ccf60affdebdcea4910833d0d5783315551f"),
    ("013_00000", 540632672, "b393f51fefab26cd6f4c8f65707c1924f6666c4961a0ebebe04bb57f7ec832de"),
]
_FINEWEB_EDU_FILES = [Remote(f"{_FINEWEB_EDU}/{name}.parquet", size, sha) for name, size, sha in _FINEWEB_EDU_10BT]
_TINYSTORIES_VALID = Remote(f"{_TINYSTORIES}/TinyStories-valid.txt", 19_447_282,
                            "94e431816c4cce81ff71e4408ff8d3bda9a42e8d2663986697c3954288cb38b4")
_TINYSTORIES_TRAIN = Remote(f"{_TINYSTORIES}/TinyStories-train.txt", 1_924_281_556,
                            "c5cf5e22ff13614e830afbe61a99fbcbe8bcb7dd72252b989fa1117a368d401f")
NAMED: dict[str, list[Remote]] = {  # each URL pinned at a revision, with the size and sha256 of its file
    "tinystories-valid": [_TINYSTORIES_VALID],  # 19 MB, 22k short stories (Eldan & Li, 2023)
    "tinystories": [_TINYSTORIES_TRAIN, _TINYSTORIES_VALID],  # 1.9 GB, ~2.1M stories, ~470M GPT-2 tokens
    "fineweb-edu": _FINEWEB_EDU_FILES[:1],  # educational web pages (FineWeb-Edu): 2.2 GB, ~0.75B GPT-2 tokens
    "fineweb-edu-10bt": _FINEWEB_EDU_FILES,  # the whole 10BT sample: enough for GPT-2 124M
}
SOURCE_HELP = (f"'stdlib' (Python's own .py files), 'shakespeare', a named corpus ({', '.join(NAMED)}), an "
               "http(s) URL of a .txt, .jsonl(.gz) or .parquet file (append #sha256=HEX to pin it), a text "
               "file, a directory (recursive), or a glob")
DOC_CHARS = 4096  # a text file on its own is cut at a blank line once a document reaches this size
RETRIES, BACKOFF_S, TIMEOUT_S = 3, 2.0, 60  # attempts without progress before a download gives up


# ---------------------------------------------------------------------------------------------- downloads

def is_url(source: str) -> bool:
    return source.startswith(("http://", "https://"))


def parse_url(source: str) -> Remote:
    """A URL, with an optional #sha256=<64 hex digits> pin."""
    url, fragment = urllib.parse.urldefrag(source)
    if not fragment:
        return Remote(url)
    digest = fragment.removeprefix("sha256=").lower()
    if not fragment.startswith("sha256=") or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise DataError(f"--data {source}: the part after # must be sha256=<64 hex digits>")
    return Remote(url, sha256=digest)


def download_path(url: str, cache_dir: str | Path) -> Path:
    """Where a URL is cached: named by a hash of the URL, ending in the file's own name (so its type shows)."""
    name = Path(urllib.parse.urlsplit(url).path).name or "download"
    return Path(cache_dir) / "downloads" / f"{hashlib.sha256(url.encode()).hexdigest()[:12]}-{name}"


def _sha256_file(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            sha.update(block)
    return sha.hexdigest()


def _pins_file(cache_dir: str | Path) -> Path:
    return Path(cache_dir) / "downloads" / "pins.json"


def _first_use_pin(url: str, cache_dir: str | Path) -> str | None:
    pins = _pins_file(cache_dir)
    return json.loads(pins.read_text()).get(url, {}).get("sha256") if pins.exists() else None


def _record_pin(url: str, size: int, digest: str, cache_dir: str | Path) -> None:
    pins = _pins_file(cache_dir)
    table = json.loads(pins.read_text()) if pins.exists() else {}
    table[url] = {"sha256": digest, "size": size, "first_download": time.strftime("%Y-%m-%d")}
    tokenizer.write_atomic(pins, json.dumps(table, indent=1, sort_keys=True).encode())


def _verify(path: Path, remote: Remote, cache_dir: str | Path) -> None:
    """Check a downloaded file against its pin (or the first download's sha256), or delete it and say why."""
    stat, stamp = path.stat(), path.with_name(path.name + ".sha256")
    first_use = remote.sha256 is None
    pin, problem = _first_use_pin(remote.url, cache_dir) if first_use else remote.sha256, None
    if remote.size is not None and stat.st_size != remote.size:
        problem = f"has {stat.st_size:,} bytes, not the pinned {remote.size:,}"
    else:
        known = json.loads(stamp.read_text()) if stamp.exists() else {}
        unchanged = known.get("size") == stat.st_size and known.get("mtime_ns") == stat.st_mtime_ns
        digest = known["sha256"] if unchanged else _sha256_file(path)  # verified before: not read again
        if pin is not None and digest != pin:
            whose = (f"the sha256 recorded at its first download in {_pins_file(cache_dir)} (remove its entry "
                     f"there if it changed upstream on purpose)" if first_use else "its pinned sha256")
            problem = f"has sha256 {digest[:16]}..., not {pin[:16]}..., {whose}"
    if problem:
        path.unlink()
        stamp.unlink(missing_ok=True)
        raise DataError(f"{remote.url}: the download {problem}; corrupted or changed, so it was deleted: run "
                        f"again to download it afresh")
    if pin is None:  # trust on first use: remember what it was
        _record_pin(remote.url, stat.st_size, digest, cache_dir)
    stamp.write_text(json.dumps({"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest}))


class _Incomplete(OSError):
    """The connection closed before Content-Length bytes arrived."""


def _get(url: str, part: Path, bar: tqdm) -> None:
    """One attempt: append the rest of `url` to `part`, asking only for what is missing (HTTP Range)."""
    have = part.stat().st_size if part.exists() else 0
    headers = {"User-Agent": "nanoscale-data"} | ({"Range": f"bytes={have}-"} if have else {})
    try:
        response = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=TIMEOUT_S)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # "range not satisfiable": the .part is already whole
            return
        raise
    with response:
        if have and (response.status != 206 or
                     not response.headers.get("Content-Range", "").startswith(f"bytes {have}-")):
            have = 0  # the server ignored the range: it sends the whole file again
        length = response.headers.get("Content-Length")
        expected = have + int(length) if length is not None else None
        bar.reset(total=expected)
        bar.update(have)
        with open(part, "r+b" if have else "wb") as f:
            f.seek(have)
            f.truncate()
            while block := response.read(1 << 20):
                f.write(block)
                bar.update(len(block))
        if expected is not None and part.stat().st_size < expected:
            raise _Incomplete(f"connection closed at byte {part.stat().st_size:,} of {expected:,}")


def fetch(remote: Remote, cache_dir: str | Path, verbose: bool = True) -> Path:
    """The verified local copy of a remote file: downloaded (resuming any .part) on first use, then cached."""
    path = download_path(remote.url, cache_dir)
    if path.exists():
        _verify(path, remote, cache_dir)
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    if verbose:
        resumed = f" (resuming at byte {part.stat().st_size:,})" if part.exists() else ""
        print(f"data: downloading {remote.url}{resumed}", file=sys.stderr)
    failures = 0
    with tqdm(desc="download", unit="B", unit_scale=True, disable=not verbose, file=sys.stderr) as bar:
        while True:
            before = part.stat().st_size if part.exists() else 0
            try:
                _get(remote.url, part, bar)
                break
            except urllib.error.HTTPError as e:
                if e.code < 500 and e.code != 429:  # 404, 403...: asking again will not help
                    raise DataError(f"{remote.url}: HTTP {e.code} {e.reason}") from None
                error = f"HTTP {e.code} {e.reason}"
            except (OSError, urllib.error.URLError) as e:  # refused, reset, timed out, cut short
                error = str(getattr(e, "reason", e))
            progressed = part.exists() and part.stat().st_size > before
            failures = 0 if progressed else failures + 1  # a connection that drops mid-way is resumed at once
            if failures >= RETRIES:
                have = part.stat().st_size if part.exists() else 0
                raise DataError(f"{remote.url}: download failed ({error}) after {RETRIES} tries; {have:,} bytes "
                                f"are kept in {part}, and the next run resumes from there")
            time.sleep(BACKOFF_S * failures)
    _verify(part, remote, cache_dir)  # before it gets its final name: a bad file is never used
    os.replace(part, path)
    stamp = part.with_name(part.name + ".sha256")
    if stamp.exists():
        os.replace(stamp, path.with_name(path.name + ".sha256"))
    return path


# ---------------------------------------------------------------------------------------------- resolving

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


@dataclass
class Corpus:
    """The files of a source, in corpus order (the order decides which of two duplicates is kept)."""
    files: list[Path]
    label: str  # a short name for the prepared directory
    root: Path  # document names are relative to it
    split_text: bool  # a text file holds many documents (it came alone, by URL or by name)


def _label(text: str) -> str:
    return "".join(c if c.isalnum() or c in "_.-" else "_" for c in text)[:40] or "data"


def resolve(source: str, cache_dir: str | Path, verbose: bool = True) -> Corpus:
    """The files a source names, downloading (and verifying) remote ones first."""
    if source in NAMED or is_url(source):
        remotes = NAMED.get(source) or [parse_url(source)]
        files = [fetch(r, cache_dir, verbose) for r in remotes]
        label = source if source in NAMED else Path(urllib.parse.urlsplit(remotes[0].url).path).name
        return Corpus(files, _label(label), files[0].parent, split_text=True)
    if source == "stdlib":  # the standard library that ships with this Python, not installed packages
        root, files = Path(sysconfig.get_paths()["stdlib"]), []
        for folder, subfolders, names in os.walk(root):
            subfolders[:] = [s for s in subfolders if s not in ("site-packages", "dist-packages")]
            files += [Path(folder, n) for n in names if n.endswith(".py")]
    elif source == "shakespeare":
        files = [shakespeare_file(cache_dir)]
        root = files[0].parent
    elif any(c in source for c in "*?["):
        files = [Path(p) for p in glob(os.path.expanduser(source), recursive=True)]
        root = Path(os.path.commonpath([p.parent for p in files])) if files else Path(".")
    else:
        root = Path(source).expanduser()
        if not root.exists():
            raise DataError(f"--data {source}: no such file or directory (expected {SOURCE_HELP})")
        hidden = lambda p: any(s.startswith(".") for s in p.relative_to(root).parts)  # .git and the like
        files = [p for p in root.rglob("*") if not hidden(p)] if root.is_dir() else [root]
        root = root if root.is_dir() else root.parent
    files = sorted(p for p in files if p.is_file())
    if not files:
        raise DataError(f"--data {source}: no files there (expected {SOURCE_HELP})")
    name = next((s for s in reversed(Path(source).parts) if not any(c in s for c in "*?[")), "data")
    return Corpus(files, _label(name), root, split_text=len(files) == 1)


# ---------------------------------------------------------------------------------------------- reading

class NotUtf8(ValueError):
    def __init__(self, offset: int, byte: int):
        super().__init__(f"byte {byte:#x} at offset {offset}")


def _lines(stream) -> iter:
    """The lines of a binary stream decoded as UTF-8, each with its '\\n' (only '\\n' ends a line)."""
    decoder, rest, done, first = codecs.getincrementaldecoder("utf-8")(), "", 0, True
    while True:
        block = stream.read(1 << 20)
        pending = len(decoder.getstate()[0])  # bytes of a character split across blocks
        try:
            text = decoder.decode(block, final=not block)
        except UnicodeDecodeError as e:
            raise NotUtf8(done - pending + e.start, e.object[e.start]) from None
        done += len(block)
        if first and text:
            text, first = text.removeprefix("\ufeff"), False  # a byte-order mark is not text
        lines = (rest + text).split("\n")
        rest = lines.pop()
        yield from (line + "\n" for line in lines)
        if not block:
            if rest:
                yield rest
            return


def split_text(lines, chars: int = DOC_CHARS):
    """Documents of a text file: cut at <|endoftext|> lines, and at a blank line once a piece has `chars`."""
    doc, size = [], 0
    for line in lines:
        boundary = line.strip() == EOT_TEXT or (size >= chars and not line.strip())
        if boundary:
            text = "".join(doc)
            if text.strip():
                yield text
            doc, size = [], 0
        else:
            doc.append(line)
            size += len(line)
    text = "".join(doc)
    if text.strip():
        yield text


def jsonl_documents(lines, path: Path):
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise DataError(f"{path}: line {number} is not JSON ({e})") from None
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str):
            fields = ", ".join(record) if isinstance(record, dict) else type(record).__name__
            raise DataError(f'{path}: line {number} has no "text" string (it has: {fields})')
        yield text


def parquet_documents(path: Path, batch_rows: int = 1024):
    """The "text" column of a parquet file, a batch of rows at a time, with the fraction of rows read."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading .parquet needs pyarrow, which is not installed: pip install pyarrow "
                        f"(or give a .txt or .jsonl(.gz) corpus)") from None
    table = pq.ParquetFile(path)
    if "text" not in table.schema_arrow.names:
        raise DataError(f'{path}: no "text" column (columns: {", ".join(table.schema_arrow.names)})')
    rows, done = max(table.metadata.num_rows, 1), 0
    for batch in table.iter_batches(batch_size=batch_rows, columns=["text"]):
        done += batch.num_rows
        for text in batch.column(0).to_pylist():
            yield text or "", done / rows


class Reader:
    """The documents of a corpus in order, one at a time: (text, file number, document number in the file).

    `position` is how many bytes of the source files are behind the last document (for a progress bar);
    `bytes` and `not_utf8` count what was read and what was skipped."""

    def __init__(self, corpus: Corpus):
        self.corpus, self.position, self.bytes, self.not_utf8 = corpus, 0, 0, 0
        self.total = sum(p.stat().st_size for p in corpus.files)

    def name(self, file: int, number: int) -> str:
        """A document's name for reports: its file (relative to the corpus root), and #number if it has many."""
        path = self.corpus.files[file]
        name = str(path.relative_to(self.corpus.root)) if path.is_relative_to(self.corpus.root) else path.name
        return name if self._kind(path) == "whole" else f"{name}#{number}"

    def _kind(self, path: Path) -> str:
        if path.name.endswith(".parquet"):
            return "parquet"
        if path.name.endswith((".jsonl", ".jsonl.gz")):
            return "jsonl"
        return "text" if self.corpus.split_text else "whole"

    def __iter__(self):
        done = 0
        for f, path in enumerate(self.corpus.files):
            size = path.stat().st_size
            for number, (text, fraction) in enumerate(self._documents(path)):
                self.position = done + int(fraction * size)
                yield text, f, number
            done += size
            self.position, self.bytes = done, self.bytes + size

    def _documents(self, path: Path):
        """(text, fraction of the file read) for each document of one file."""
        kind = self._kind(path)
        if kind == "parquet":
            yield from parquet_documents(path)
            return
        if kind == "whole":
            raw = path.read_bytes()
            try:
                yield raw.decode("utf-8-sig"), 1.0  # -sig: drop a byte-order mark
            except UnicodeDecodeError:
                self.not_utf8 += 1  # a binary file among source files: skipped, counted
            return
        size = max(path.stat().st_size, 1)
        with open(path, "rb") as raw:
            stream = gzip.open(raw) if path.name.endswith(".gz") else raw
            lines = _lines(stream)
            docs = jsonl_documents(lines, path) if kind == "jsonl" else split_text(lines)
            try:
                for text in docs:
                    yield text, raw.tell() / size
            except NotUtf8 as e:
                where = " (decompressed)" if path.name.endswith(".gz") else ""
                raise DataError(f"{path} is not UTF-8 text ({e}{where}): convert it (e.g. iconv -t utf-8) or "
                                f"pass another file") from None
            except (OSError, EOFError) as e:  # a truncated or corrupt .gz
                raise DataError(f"{path}: cannot be read ({e}); delete it and fetch it again") from None

