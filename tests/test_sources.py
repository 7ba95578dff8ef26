"""sources.py: corpora by URL (downloaded, resumed, verified, cached), named sources, and the record formats.

Every download comes from a small HTTP server this file starts on 127.0.0.1: it serves files from a
dict, answers Range requests with 206 Partial Content, logs each request's Range header, and can cut a
response short (a dropped connection) or fail with an HTTP status, once or always.
"""

import gzip
import hashlib
import io
import json
import os
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from conftest import metrics, run_train

import data
from support import scan, sources, tokenizer

WORDS = [f"w{i}" for i in range(5000)]


class Server:
    """Files served on 127.0.0.1 with Range support, a request log, and faults to inject."""

    def __init__(self):
        self.files: dict[str, bytes] = {}
        self.log: list[tuple[str, str | None]] = []  # (path, Range header)
        self.cut: dict[str, int] = {}  # path -> bytes to send before dropping the connection, once
        self.status: dict[str, int] = {}  # path -> an HTTP error to answer with, always
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                path, wanted = self.path, self.headers.get("Range")
                server.log.append((path, wanted))
                body = server.files.get(path)
                if path in server.status or body is None:
                    self.send_error(server.status.get(path, 404))
                    return
                start = int(re.fullmatch(r"bytes=(\d+)-", wanted)[1]) if wanted else 0
                if start >= len(body) > 0:
                    self.send_error(416)
                    return
                self.send_response(206 if wanted else 200)
                if wanted:
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                self.send_header("Content-Length", str(len(body) - start))
                self.end_headers()
                cut = server.cut.pop(path, None)
                self.wfile.write(body[start:] if cut is None else body[start:start + cut])

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("no_proxy", "*")  # even where a proxy is configured
    monkeypatch.setattr(sources, "BACKOFF_S", 0.0)
    s = Server()
    yield s
    s.httpd.shutdown()


def stories(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, int(rng.integers(60, 120)))) + "." for _ in range(n)]


def jsonl_gz(docs: list[str]) -> bytes:
    lines = "".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs))
    return gzip.compress(lines.encode(), mtime=0)


def byte_cfg(tmp_path, source, cache="cache", **overrides) -> data.DataConfig:
    return data.DataConfig(source=str(source), tokenizer="byte", cache_dir=str(tmp_path / cache), **overrides)


def shard_docs(prepared) -> list[str]:
    tok, docs = tokenizer.ByteTokenizer(), []
    for split in ("train", "val"):
        docs += tok.decode(data.load_tokens(prepared / f"{split}.bin")).split(tokenizer.EOT_TEXT)[1:]
    return docs


def sha(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


# ---------------------------------------------------------------------------------------------- downloads

def test_a_dropped_download_resumes_with_range_is_verified_and_cached(tmp_path, server):
    docs = stories(300)
    body = jsonl_gz(docs)
    server.files["/corpus.jsonl.gz"] = body
    server.cut["/corpus.jsonl.gz"] = len(body) // 2  # the first response stops half-way
    url = f"{server.url}/corpus.jsonl.gz#sha256={sha(body)}"
    prepared = data.prepare(byte_cfg(tmp_path, url, workers=1), verbose=False)
    assert server.log == [("/corpus.jsonl.gz", None), ("/corpus.jsonl.gz", f"bytes={len(body) // 2}-")]
    cached = sources.download_path(f"{server.url}/corpus.jsonl.gz", tmp_path / "cache")
    assert cached.read_bytes() == body and cached.name.endswith("-corpus.jsonl.gz")
    assert sorted(shard_docs(prepared)) == sorted(docs)  # each line's "text" is one document
    assert data.prepare(byte_cfg(tmp_path, url), verbose=False) == prepared
    assert len(server.log) == 2  # cached: not downloaded again, and its stamp spares hashing it again


def test_a_part_left_by_a_stopped_process_is_resumed(tmp_path, server):
    body = "".join(f"{s}\n<|endoftext|>\n" for s in stories(50)).encode()
    server.files["/tiny.txt"] = body
    remote = sources.Remote(f"{server.url}/tiny.txt", len(body), sha(body))
    part = sources.download_path(remote.url, tmp_path)
    part = part.with_name(part.name + ".part")
    part.parent.mkdir(parents=True)
    part.write_bytes(body[:1000])  # as if the previous run was killed after 1,000 bytes
    assert sources.fetch(remote, tmp_path, verbose=False).read_bytes() == body
    assert server.log == [("/tiny.txt", "bytes=1000-")] and not part.exists()


def test_a_corrupt_download_is_refused_with_one_line(tmp_path, server, capsys):
    body = jsonl_gz(stories(50))
    server.files["/c.jsonl.gz"] = body[:-10] + b"0123456789"  # flipped bytes on the way
    url = f"{server.url}/c.jsonl.gz"
    with pytest.raises(SystemExit) as stop:
        data.main(["--data", f"{url}#sha256={sha(body)}", "--tokenizer", "byte", "--cache-dir", str(tmp_path)])
    message = str(stop.value)
    got = sha(body[:-10] + b"0123456789")
    assert message == (f"data: error: {url}: the download has sha256 {got[:16]}..., not {sha(body)[:16]}..., its "
                       f"pinned sha256; corrupted or changed, so it was deleted: run again to download it afresh")
    assert not list((tmp_path / "downloads").glob("*c.jsonl.gz*"))  # nothing left that could be read

    # without a pin: trust on first use, then the same URL must give the same bytes
    first = sources.fetch(sources.parse_url(url), tmp_path, verbose=False)
    assert json.loads((tmp_path / "downloads" / "pins.json").read_text())[url]["sha256"] == sha(first.read_bytes())
    first.unlink()
    server.files["/c.jsonl.gz"] = body  # changed upstream
    with pytest.raises(data.DataError, match=r"not .*, the sha256 recorded at its first download in .*pins\.json"):
        sources.fetch(sources.parse_url(url), tmp_path, verbose=False)

    # a cached file that changed after it was verified is hashed again, and refused
    server.files["/d.txt"] = b"a story " * 100
    cached = sources.fetch(sources.Remote(f"{server.url}/d.txt", 800, sha(b"a story " * 100)), tmp_path, verbose=False)
    cached.write_bytes(b"A story " + b"a story " * 99)
    with pytest.raises(data.DataError, match=r"d\.txt: the download has sha256 .*, its pinned sha256"):
        sources.fetch(sources.Remote(f"{server.url}/d.txt", 800, sha(b"a story " * 100)), tmp_path, verbose=False)
    with pytest.raises(data.DataError, match=r"the download has 800 bytes, not the pinned 801"):
        sources.fetch(sources.Remote(f"{server.url}/d.txt", 801, sha(b"a story " * 100)), tmp_path, verbose=False)


def test_downloads_that_cannot_succeed_say_why(tmp_path, server):
    with pytest.raises(data.DataError, match=r"/missing\.txt: HTTP 404 "):
        sources.fetch(sources.Remote(f"{server.url}/missing.txt"), tmp_path, verbose=False)
    assert len(server.log) == 1  # a 404 is not retried
    server.files["/busy.txt"], server.status["/busy.txt"] = b"x", 503
    with pytest.raises(data.DataError, match=r"download failed \(HTTP 503 .*\) after 3 tries; 0 bytes are kept in "
                                             r".*busy\.txt\.part, and the next run resumes from there"):
        sources.fetch(sources.Remote(f"{server.url}/busy.txt"), tmp_path, verbose=False)
    with pytest.raises(data.DataError, match=r"the part after # must be sha256=<64 hex digits>"):
        data.prepare(byte_cfg(tmp_path, f"{server.url}/x.txt#md5=abc"), verbose=False)


def test_named_sources_are_pinned_and_verified(tmp_path, server, monkeypatch):
    for name, remotes in sources.NAMED.items():
        for r in remotes:  # a pinned revision (40 hex digits in the URL), the size and sha256 of the file
            assert r.url.startswith("https://huggingface.co/datasets/") and re.search(r"/resolve/[0-9a-f]{40}/", r.url)
            assert r.size > 10**6 and re.fullmatch(r"[0-9a-f]{64}", r.sha256), name
            assert r.url.endswith((".txt", ".parquet"))
    assert len({r.sha256 for rs in sources.NAMED.values() for r in rs}) == 16  # 14 FineWeb-Edu + 2 TinyStories

    body = "".join(f"{s}\n<|endoftext|>\n" for s in stories(200)).encode()
    server.files["/TinyStories-valid.txt"] = body
    monkeypatch.setitem(sources.NAMED, "tinystories-valid",
                        [sources.Remote(f"{server.url}/TinyStories-valid.txt", len(body), sha(body))])
    prepared = data.prepare(byte_cfg(tmp_path, "tinystories-valid"), verbose=False)
    assert prepared.name.startswith("tinystories-valid-byte-")
    assert sorted(d.strip() for d in shard_docs(prepared)) == sorted(stories(200))  # cut at <|endoftext|>
    monkeypatch.setitem(sources.NAMED, "tinystories-valid",
                        [sources.Remote(f"{server.url}/TinyStories-valid.txt", len(body), "0" * 64)])
    with pytest.raises(data.DataError, match="not 0000000000000000..., its pinned sha256"):
        data.prepare(byte_cfg(tmp_path, "tinystories-valid", cache="other"), verbose=False)


# ---------------------------------------------------------------------------------------------- processes, training

def test_a_url_corpus_prepares_bitwise_alike_on_1_and_2_processes_and_trains(tmp_path, server, monkeypatch):
    body = jsonl_gz(stories(600, seed=1))
    server.files["/stories.jsonl.gz"] = body
    url = f"{server.url}/stories.jsonl.gz#sha256={sha(body)}"
    monkeypatch.setattr(scan, "CHUNK_CHARS", 8192)  # ~40 chunks, so the pool gets work
    shards = {}
    for workers in (1, 2):
        prepared = data.prepare(byte_cfg(tmp_path, url, cache=f"c{workers}", workers=workers), verbose=False)
        assert json.loads((prepared / "meta.json").read_text())["stats"]["workers"] == workers
        shards[workers] = [(prepared / f"{split}.bin").read_bytes() for split in ("train", "val")]
    assert shards[1] == shards[2] and len(shards[1][0]) > 100_000

    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "no_proxy": "*"}
    result = run_train({"data": url, "cache": str(tmp_path / "train-cache")}, out, env=env)
    assert f"data: downloading {server.url}/stories.jsonl.gz" in result.stderr
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and np.isfinite(rows[-1]["val_loss"])
    trained = next((tmp_path / "train-cache").glob("stories.jsonl.gz-byte-*"))
    assert [(trained / f"{s}.bin").read_bytes() for s in ("train", "val")] == shards[1]


# ---------------------------------------------------------------------------------------------- formats

def test_record_formats_and_their_errors(tmp_path, monkeypatch):
    def docs_of(path):
        return [text for text, _, _ in sources.Reader(sources.resolve(str(path), tmp_path, verbose=False))]

    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n\n{"text": "two\\nlines", "n": 2}\n')
    assert docs_of(tmp_path / "a.jsonl") == ["one", "two\nlines"]
    (tmp_path / "b.jsonl").write_text('{"text": "one"}\n{"story": "two"}\n')
    with pytest.raises(data.DataError, match=r'b\.jsonl: line 2 has no "text" string \(it has: story\)'):
        docs_of(tmp_path / "b.jsonl")
    (tmp_path / "c.jsonl").write_text('{"text": "one"}\nnot json\n')
    with pytest.raises(data.DataError, match=r"c\.jsonl: line 2 is not JSON \(Expecting value"):
        docs_of(tmp_path / "c.jsonl")
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(b'{"text": "one"}\n' * 1000)[:-20])
    with pytest.raises(data.DataError, match=r"d\.jsonl\.gz: cannot be read .*delete it and fetch it again"):
        docs_of(tmp_path / "d.jsonl.gz")

    paragraphs = [f"paragraph {i} " + "word " * 200 for i in range(40)]  # ~1 KB each
    (tmp_path / "book.txt").write_text("\ufeff" + "\n\n".join(paragraphs[:20]) + "\n<|endoftext|>\n" +
                                       "\n\n".join(paragraphs[20:]))
    book = docs_of(tmp_path / "book.txt")
    assert [len(d) // 1000 for d in book] == [5] * 8  # 5 paragraphs: cut at the first blank line after 4 KB
    assert "".join(book).count("paragraph") == 40 and book[0].startswith("paragraph 0 ")  # no byte-order mark
    assert book[3].rstrip().endswith(paragraphs[19].rstrip()) and book[4].startswith("paragraph 20")  # and at eot

    (tmp_path / "bad.txt").write_bytes(b"good text " * 200_000 + b"\xff more")  # past the first 1 MB block
    with pytest.raises(data.DataError, match=r"bad\.txt is not UTF-8 text \(byte 0xff at offset 2000000\)"):
        docs_of(tmp_path / "bad.txt")

    (tmp_path / "f.jsonl").write_text(json.dumps({"text": "a lone surrogate \ud800 " + "word " * 20}) + "\n")
    assert docs_of(tmp_path / "f.jsonl") == ["a lone surrogate \ud800 " + "word " * 20]  # JSON can escape one...
    prepared = data.prepare(byte_cfg(tmp_path, tmp_path / "f.jsonl"), verbose=False)
    assert shard_docs(prepared) == ["a lone surrogate ? " + "word " * 20]  # ...which is no text: replaced

    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if pyarrow were not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "e.parquet").write_bytes(b"PAR1")
    with pytest.raises(data.DataError, match=r"e\.parquet: reading \.parquet needs pyarrow, which is not installed: "
                                             r"pip install pyarrow \(or give a \.txt or \.jsonl\(\.gz\) corpus\)"):
        docs_of(tmp_path / "e.parquet")


def test_parquet_rows_are_documents(tmp_path, server):
    import pyarrow as pa
    import pyarrow.parquet as pq
    docs = stories(500, seed=2)
    buffer = io.BytesIO()
    pq.write_table(pa.table({"id": list(range(500)), "text": docs}), buffer, row_group_size=64)
    server.files["/web.parquet"] = buffer.getvalue()
    prepared = data.prepare(byte_cfg(tmp_path, f"{server.url}/web.parquet", workers=2), verbose=False)
    assert sorted(shard_docs(prepared)) == sorted(docs)
    buffer = io.BytesIO()
    pq.write_table(pa.table({"content": docs}), buffer)
    server.files["/other.parquet"] = buffer.getvalue()
    with pytest.raises(data.DataError, match=r'other\.parquet: no "text" column \(columns: content\)'):
        data.prepare(byte_cfg(tmp_path, f"{server.url}/other.parquet"), verbose=False)
