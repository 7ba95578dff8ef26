"""Tokenizers: text to the integer ids a model reads, and back.

A model sees only ids from a fixed vocabulary, so every text goes through one `Tokenizer`, and
<|endoftext|> is one more id, put between documents (by data.py: `encode` treats the literal text
"<|endoftext|>" as ordinary characters, so a file cannot forge a document boundary). Two kinds:

    byte   one token per UTF-8 byte (0..255), 256 = <|endoftext|>: 257 ids. Needs no file: for tests.
    gpt2   GPT-2's byte-pair encoding (BPE): start from the 256 byte values and apply 50,000 learned
           merges ("t"+"he" -> "the"), lowest rank first, so common strings become one token:
           50,257 ids, 50256 = <|endoftext|>. tiktoken runs it fast, given the merge ranks.

The ranks are a file normally downloaded from OpenAI. Where that host is unreachable, the same file
comes from the package index pip is configured with: it ships inside the openai-whisper source
distribution, found on the index's PEP 503 "simple" pages (an HTML list of links per project) by a
small client below. Every route checks the file's sha256, because a tokenizer that is silently
different ruins a model (and `identity()`, saved in every checkpoint, names the one it was trained with):

    gpt2_ranks(cache_dir):  <cache_dir>/gpt2.tiktoken, if its sha256 is right
                            else GPT2_URL (OpenAI, 5 s timeout)
                            else each index pip knows: openai-whisper's page -> the sdist (checked
                                 against the index's sha256) -> whisper/assets/gpt2.tiktoken
                            any fetched file must match GPT2_SHA256, then is cached atomically

`python data.py --fetch-tokenizer` does this once, at setup; training and the tests then read the
cached file and never touch the network.
"""

import ast
import base64
import hashlib
import html
import io
import os
import re
import subprocess
import sys
import tarfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "nanoscale"  # the tokenizer file, and data.py's prepared shards
EOT_TEXT = "<|endoftext|>"


class DataError(ValueError):
    """Missing, empty or corrupt data, the tokenizer's file included. The message says what is wrong and
    what to do. data.py raises the same class (it is data.DataError), so a caller catches one error."""


# ---------------------------------------------------------------------------------------------- the two kinds

class Tokenizer:
    """What the rest of the code needs from a tokenizer."""
    name: str  # "gpt2" or "byte"
    vocab_size: int
    eot: int  # id of <|endoftext|>, which separates documents

    def encode(self, text: str) -> list[int]:  # ordinary text: "<|endoftext|>" in it is just characters
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError

    def token_bytes(self, i: int) -> bytes:  # one token's bytes: it may end mid-character (sample.py streams them)
        raise NotImplementedError

    def identity(self) -> str:  # saved in checkpoints: a model is only valid with its own tokenizer
        raise NotImplementedError

    def encode_many(self, texts: list[str], threads: int = 0) -> list[np.ndarray]:
        """Encode documents in bulk on `threads` threads (0: all cores; data.py's workers use 1 each, as
        they already run one per core). Subclasses make it fast."""
        return [np.asarray(self.encode(t), dtype=np.int64) for t in texts]


class ByteTokenizer(Tokenizer):
    """Token = one UTF-8 byte (0..255), and 256 = <|endoftext|>. Needs no file: for tiny tests."""
    name, vocab_size, eot = "byte", 257, 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_many(self, texts: list[str], threads: int = 0) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids) -> str:
        ids = [i for i in map(int, ids) if 0 <= i <= self.eot]  # ignore ids past the vocabulary
        pieces = [EOT_TEXT.encode() if i == self.eot else bytes([i]) for i in ids]
        return b"".join(pieces).decode("utf-8", errors="replace")  # a sample may end mid-character

    def token_bytes(self, i: int) -> bytes:
        return EOT_TEXT.encode() if i == self.eot else bytes([i])

    def identity(self) -> str:
        return "byte:v1"


# ---------------------------------------------------------------------------------------------- the GPT-2 ranks file

GPT2_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"  # r50k_base == GPT-2
GPT2_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
GPT2_FILE = "gpt2.tiktoken"  # its name in the cache directory
# the same file ships in this source distribution on the package index (PEP 625 spells the name with _)
GPT2_PROJECT, GPT2_SDISTS = "openai-whisper", ("openai_whisper-20250625.tar.gz", "openai-whisper-20250625.tar.gz")
GPT2_SDIST_MEMBER = "whisper/assets/gpt2.tiktoken"
PYPI_SIMPLE = "https://pypi.org/simple"  # the index pip uses when none is configured
# the pre-tokenizer of openai/gpt-2's encoder.py: text is cut into these pieces, then BPE runs inside each
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class GPT2Tokenizer(Tokenizer):
    name, vocab_size, eot = "gpt2", 50257, 50256

    def __init__(self, ranks: bytes):
        import tiktoken
        # the ranks file has one "base64(token bytes) rank" per line; lower ranks merge first
        pairs = (line.split() for line in ranks.splitlines() if line)
        merges = {base64.b64decode(tok): int(rank) for tok, rank in pairs}
        self.enc = tiktoken.Encoding(name="gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=merges,
                                     special_tokens={EOT_TEXT: self.eot}, explicit_n_vocab=self.vocab_size)

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def encode_many(self, texts: list[str], threads: int = 0) -> list[np.ndarray]:
        if threads == 1:  # no thread pool for one thread
            return [np.asarray(self.enc.encode_ordinary(t), dtype=np.uint32) for t in texts]
        batch = self.enc.encode_ordinary_batch(texts, num_threads=threads or os.cpu_count() or 1)  # Rust, in parallel
        return [np.asarray(ids, dtype=np.uint32) for ids in batch]

    def decode(self, ids) -> str:
        return self.enc.decode([i for i in map(int, ids) if 0 <= i < self.vocab_size])

    def token_bytes(self, i: int) -> bytes:
        return self.enc.decode_single_token_bytes(i)

    def identity(self) -> str:
        return f"gpt2:sha256={GPT2_SHA256[:16]}"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    """Write a file all at once (data.py caches Tiny Shakespeare with this too)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)  # readers see no file or the whole file, never half of it


def download(url: str, timeout: float = 5) -> bytes:
    """GET an http(s):// or file:// URL (data.py fetches Tiny Shakespeare with it too). A user:password@
    in it (pip allows one in an index URL) is sent as a Basic authorization header, which urllib does not
    do by itself, and not to a redirect's host."""
    parts, request = urllib.parse.urlsplit(url), urllib.request.Request(url)
    if parts.username is not None:
        login = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        request = urllib.request.Request(parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl())
        request.add_unredirected_header("Authorization", "Basic " + base64.b64encode(login.encode()).decode())
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read()


def _hide_password(url: str) -> str:
    return re.sub(r"//[^/@]*@", "//***@", url)  # an index URL may carry user:token@; keep it out of logs


def pip_index_urls() -> list[str]:
    """The package indexes pip is configured with (its config files and PIP_* variables), index-url
    first. `pip config list` prints them as e.g. global.extra-index-url='https://a/simple https://b/simple'
    or :env:.index-url='https://c/simple'."""
    try:
        listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                                 text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        listing = ""  # no pip: use the default index
    main, extra = [], []
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        key = key.strip().replace("_", "-")
        try:
            value = ast.literal_eval(value)  # pip prints repr(value): quoted, with escapes
        except (ValueError, SyntaxError):
            pass
        if key.endswith("extra-index-url"):
            extra += str(value).split()  # several URLs: separated by spaces or newlines
        elif key.endswith("index-url"):
            main += str(value).split()
    return list(dict.fromkeys((main or [PYPI_SIMPLE]) + extra))  # in order, each once


def index_links(index: str, project: str) -> dict[str, str]:
    """{file name: URL} from a project's page on a PEP 503 "simple" index: <index>/<project>/ is an
    HTML page with one <a href="URL#sha256=...">file name</a> per file."""
    page = index.rstrip("/") + f"/{project}/"
    if page.startswith("file:") and Path(urllib.request.url2pathname(urllib.parse.urlsplit(page).path)).is_dir():
        page += "index.html"  # a local index is a tree of folders, as pip reads it
    text = download(page, timeout=30).decode("utf-8", errors="replace")
    anchors = re.findall(r"<a\s(?:[^>]*\s)?href=[\"']([^\"']*)[\"'][^>]*>([^<]*)</a>", text, flags=re.I)
    return {html.unescape(name).strip(): urllib.parse.urljoin(page, html.unescape(href)) for href, name in anchors}


def _gpt2_ranks_from_sdist(index: str) -> bytes:
    """Download the whisper sdist from one index (checking the sha256 the index gives) and take out the ranks."""
    links = index_links(index, GPT2_PROJECT)
    name = next((n for n in GPT2_SDISTS if n in links), None)
    if name is None:
        raise RuntimeError(f"its {GPT2_PROJECT} page has no {GPT2_SDISTS[0]}")
    url, fragment = urllib.parse.urldefrag(links[name])
    sdist = download(url, timeout=60)  # ~0.8 MB, through whatever slow proxy the cluster has
    if fragment.startswith("sha256=") and _sha256(sdist) != fragment.removeprefix("sha256="):
        raise RuntimeError(f"{name} does not match the sha256 its index gives")
    with tarfile.open(fileobj=io.BytesIO(sdist), mode="r:gz") as tar:
        member = next((m for m in tar.getmembers() if m.name.endswith("/" + GPT2_SDIST_MEMBER)), None)
        if member is None:
            raise RuntimeError(f"{name} has no {GPT2_SDIST_MEMBER}")
        return tar.extractfile(member).read()


def _gpt2_ranks_from_index() -> bytes:
    """Many clusters reach only a package index: the whisper sdist there carries the same file."""
    failures = []
    for index in pip_index_urls():  # the first index that has it wins; the final sha256 check is the judge
        try:
            return _gpt2_ranks_from_sdist(index)
        except urllib.error.HTTPError as e:  # name the URL (in .filename): the project's page or its file
            failures.append(f"{_hide_password(e.filename)}: {e}")
        except Exception as e:
            failures.append(f"{_hide_password(index)}: {getattr(e, 'reason', e)}")  # reason: no "<urlopen error>"
    raise RuntimeError(", ".join(failures))


def gpt2_ranks(cache_dir: str | Path) -> bytes:
    """The GPT-2 BPE ranks, sha256-checked: from <cache_dir>/gpt2.tiktoken, else the URL, else the index."""
    path = Path(cache_dir) / GPT2_FILE
    if path.exists():
        data = path.read_bytes()
        if _sha256(data) == GPT2_SHA256:
            return data
        print(f"data: {path} has the wrong sha256; fetching it again", file=sys.stderr)
    failures = []
    for route, fetch in ((f"downloading {GPT2_URL}", lambda: download(GPT2_URL)),
                         (f"the package index ({GPT2_SDISTS[0]} ships {GPT2_SDIST_MEMBER})",
                          _gpt2_ranks_from_index)):
        since = f" (the route before failed: {failures[-1]})" if failures else ""
        print(f"data: fetching the GPT-2 tokenizer: {route}{since}", file=sys.stderr)
        try:
            data = fetch()
        except Exception as e:  # any failure just means: try the next route
            failures.append(f"{route}: {e}")
            continue
        if _sha256(data) == GPT2_SHA256:
            write_atomic(path, data)
            return data
        failures.append(f"{route}: wrong sha256 {_sha256(data)}")
    raise DataError(f"could not get the GPT-2 tokenizer ({'; '.join(failures)}). Place r50k_base.tiktoken "
                    f"(sha256 {GPT2_SHA256}) at {path}, or use --tokenizer byte")


def get_tokenizer(name: str, cache_dir: str | Path | None = None) -> Tokenizer:
    """The tokenizer called `name` ("gpt2" or "byte"); gpt2 reads its ranks file from cache_dir."""
    if name == "byte":
        return ByteTokenizer()
    if name == "gpt2":
        return GPT2Tokenizer(gpt2_ranks(cache_dir or DEFAULT_CACHE_DIR))
    raise DataError(f"unknown tokenizer {name!r}: choose gpt2 or byte")


