"""data.py: tokenizers, cleaning, shards, the prepared-data cache and the loader's contract.

Everything but the GPT-2 test uses the byte tokenizer and tiny corpora in tmp_path, so the file runs
in seconds. The GPT-2 test takes the offline route for real (pip download of the whisper sdist).
"""

import hashlib
import json
import unicodedata

import numpy as np
import pytest
import torch

import data

WORDS = [f"w{i}" for i in range(5000)]


def text(rng: np.random.Generator, n_words: int = 400) -> str:
    return " ".join(rng.choice(WORDS, n_words))


def edit_words(doc: str, positions: list[int]) -> str:
    words = doc.split()
    for p in positions:
        words[p] = "changed"
    return " ".join(words)


def byte_cfg(tmp_path, source, **overrides) -> data.DataConfig:
    return data.DataConfig(source=str(source), tokenizer="byte", cache_dir=str(tmp_path / "cache"),
                           **overrides)


def shard_docs(prepared, tok) -> list[str]:
    """The documents in a prepared directory, both splits, as text (each starts after an eot)."""
    docs = []
    for split in ("train", "val"):
        tokens = data.load_tokens(prepared / f"{split}.bin")
        assert len(tokens) == 0 or tokens[0] == tok.eot
        docs += tok.decode(tokens).split(data.EOT_TEXT)[1:]
    return docs


# ---------------------------------------------------------------------------------------------- tokenizers

def test_byte_tokenizer_round_trip():
    tok = data.get_tokenizer("byte")
    s = "héllo wörld ✓ 日本語\n\tdef f(): return 0 <|endoftext|>"
    ids = tok.encode(s)
    assert (tok.name, tok.vocab_size, tok.eot, tok.identity()) == ("byte", 257, 256, "byte:v1")
    assert max(ids) < 256 and tok.decode(ids) == s  # the literal marker is just bytes
    assert tok.decode([104, 105, 256, 104]) == "hi<|endoftext|>h"
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"  # cut mid-character: replaced, no exception
    assert [a.tolist() for a in tok.encode_many([s, ""])] == [ids, []]


def test_gpt2_tokenizer_through_the_package_index(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "GPT2_URL", "http://127.0.0.1:9/r50k_base.tiktoken")  # as if offline
    tok = data.get_tokenizer("gpt2", tmp_path)  # falls back to pip download of the whisper sdist
    cached = tmp_path / "gpt2.tiktoken"
    assert hashlib.sha256(cached.read_bytes()).hexdigest() == data.GPT2_SHA256
    assert tok.encode("Hello world") == [15496, 995]
    assert (tok.vocab_size, tok.eot) == (50257, 50256)
    assert tok.encode("<|endoftext|>") != [50256] and tok.decode([50256]) == "<|endoftext|>"
    s = "    def forward(self, x):  # naïve\n        return x"
    assert tok.decode(tok.encode(s)) == s
    assert [a.tolist() for a in tok.encode_many([s])] == [tok.encode(s)]
    assert tok.identity().startswith("gpt2:sha256=306cd27f")

    cached.write_bytes(b"not the ranks")  # a corrupt cache with every route down: a clear error
    monkeypatch.setattr(data, "_gpt2_ranks_from_pip", lambda: (_ for _ in ()).throw(OSError("no index")))
    with pytest.raises(data.DataError, match="Place r50k_base.tiktoken .* at .*gpt2.tiktoken"):
        data.get_tokenizer("gpt2", tmp_path)


def test_unknown_tokenizer():
    with pytest.raises(data.DataError, match="choose gpt2 or byte"):
        data.get_tokenizer("sentencepiece")


# ---------------------------------------------------------------------------------------------- cleaning

def test_cleaning_removes_what_it_should_and_counts_it(tmp_path):
    rng = np.random.default_rng(0)
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    distinct = [text(rng) for _ in range(6)]
    distinct[5] = "cafe\u0301 " + distinct[5]  # decomposed é: NFC composes it
    distinct.append(edit_words(distinct[0], range(0, 400, 4)))  # a quarter of the words changed: kept
    files = {f"a{i}.txt": d for i, d in enumerate(distinct)}
    files |= {
        "sub/dup.txt": distinct[1],  # exact duplicate
        "z_near1.txt": edit_words(distinct[2], [10, 200, 390]),  # near duplicates: a few words changed
        "z_near2.txt": edit_words(distinct[3], [50, 51]),
        "short.txt": "x = 1\n",
        "binary.txt": "\x00\x01\x02\x03 data " * 40,
        "repeated.txt": "spam = 1\n" * 50 + distinct[4][:100],
        ".git/ignored.txt": text(rng),  # hidden: not read at all
    }
    for name, content in files.items():
        (corpus / name).parent.mkdir(exist_ok=True)
        (corpus / name).write_text(content)
    (corpus / "latin1.txt").write_bytes("café crème brûlée ".encode("latin-1") * 10)

    tok = data.get_tokenizer("byte")
    prepared = data.prepare(byte_cfg(tmp_path, corpus, val_fraction=0.2), verbose=False)
    stats = json.loads((prepared / "meta.json").read_text())["stats"]
    assert stats["removed"] == dict(not_utf8=1, binary=1, too_short=1, repeated_lines=1, exact_dup=1,
                                    near_dup=2)
    assert (stats["files"], stats["documents"], stats["kept"], stats["nfc_changed"]) == (14, 13, 7, 1)
    assert stats["val_docs"] >= 1 and stats["train_docs"] + stats["val_docs"] == 7
    expected = sorted(unicodedata.normalize("NFC", d) for d in distinct)
    assert sorted(shard_docs(prepared, tok)) == expected  # each kept document exactly once, in one split


def test_near_duplicate_detection_follows_the_lsh_curve():
    rng = np.random.default_rng(1)
    base = [text(rng, 600) for _ in range(20)]
    near = [edit_words(d, rng.choice(600, 3, replace=False).tolist()) for d in base]
    far = [edit_words(d, rng.choice(600, 300, replace=False).tolist()) for d in base]
    sig = data.minhash_signatures(base + near + far)
    assert data.near_duplicates(sig, 0.8) == set(range(20, 40))  # every near copy, no far one
    assert 0.85 < np.mean(sig[0] == sig[20]) and np.mean(sig[0] == sig[40]) < 0.3


def test_single_file_is_cut_into_documents_and_split_by_document(tmp_path):
    rng = np.random.default_rng(2)
    path = tmp_path / "book.txt"
    path.write_text("\n\n".join(text(rng, 60) for _ in range(300)))  # ~110 kB
    prepared = data.prepare(byte_cfg(tmp_path, path, val_fraction=0.1), verbose=False)
    stats = json.loads((prepared / "meta.json").read_text())["stats"]
    assert stats["documents"] >= 20 and stats["val_docs"] == round(0.1 * stats["kept"])
    train, val = data.split_documents(10, 0.01, seed=0)
    assert len(val) == 1 and sorted(train + val) == list(range(10))  # at least one val document
    assert data.split_documents(10, 0.3, seed=0) == data.split_documents(10, 0.3, seed=0)


# ---------------------------------------------------------------------------------------------- shards, cache

def test_shard_round_trip_and_corruption(tmp_path):
    for dtype in (np.uint16, np.uint32):
        tokens = np.arange(1000, dtype=dtype) * 7
        data.write_tokens(tmp_path / "t.bin", tokens)
        loaded = data.load_tokens(tmp_path / "t.bin")
        assert loaded.dtype == dtype and np.array_equal(loaded, tokens)
    data.write_tokens(tmp_path / "empty.bin", np.zeros(0, np.uint16))
    assert len(data.load_tokens(tmp_path / "empty.bin")) == 0

    good = (tmp_path / "t.bin").read_bytes()
    cases = {"bad magic": b"XXXXXXXX" + good[8:], "truncated": good[:-3], "longer than": good + b"\0\0\0\0",
             "version 9": good[:8] + (9).to_bytes(4, "little") + good[12:], "bad magic ": b"NST"}
    for problem, content in cases.items():
        (tmp_path / "bad.bin").write_bytes(content)
        with pytest.raises(data.DataError, match=rf"bad\.bin: .*{problem.strip()}.*delete"):
            data.load_tokens(tmp_path / "bad.bin")
    with pytest.raises(data.DataError, match="not found"):
        data.load_tokens(tmp_path / "missing.bin")


def test_prepare_is_cached_and_the_key_follows_every_input(tmp_path):
    rng = np.random.default_rng(3)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"{i}.txt").write_text(text(rng, 100))
    cfg = byte_cfg(tmp_path, corpus)
    first = data.prepare(cfg, verbose=False)
    stamp = (first / "meta.json").stat().st_mtime_ns
    assert data.prepare(cfg, verbose=False) == first and (first / "meta.json").stat().st_mtime_ns == stamp

    files, tok = data.find_files(str(corpus), cfg.cache_dir), data.ByteTokenizer()
    key = data.cache_key(cfg, files, tok)
    other_tok = type("Other", (data.ByteTokenizer,), {"identity": lambda self: "byte:v2"})()
    changed = [data.cache_key(data.DataConfig(**{**vars(cfg), field: value}), files, tok)
               for field, value in [("min_chars", 10), ("val_fraction", 0.5), ("seed", 1), ("dedup", False),
                                    ("near_dup_threshold", 0.9)]]
    changed.append(data.cache_key(cfg, files, other_tok))
    (corpus / "0.txt").write_text(text(rng, 101))  # a source file changes
    changed.append(data.cache_key(cfg, files, tok))
    assert key not in changed and len(set(changed)) == len(changed)
    assert data.prepare(cfg, verbose=False) != first  # so the edit is picked up
    assert not list((tmp_path / "cache").glob(".*tmp*"))  # no temporary directories left behind


# ---------------------------------------------------------------------------------------------- loader

T, N_WINDOWS = 10, 100
TOKENS = np.arange(T * N_WINDOWS + 1, dtype=np.uint16)  # window i starts with token i*T: easy to identify


def window_ids(batch: torch.Tensor) -> list[int]:
    return (batch[:, 0] // T).tolist()


def test_loader_sees_every_window_once_per_epoch():
    loader = data.Loader(TOKENS, T, global_batch=8, seed=0)
    assert loader.windows_per_epoch == N_WINDOWS
    seen = []
    for _ in range(N_WINDOWS // 8):  # 12 steps; the last 4 windows of the epoch are dropped
        batch = loader.next_batch()
        assert batch.shape == (8, T + 1) and batch.dtype == torch.int64
        assert torch.equal(batch, batch[:, :1] + torch.arange(T + 1))  # whole windows: tokens[i*T : i*T+T+1]
        seen += window_ids(batch)
    assert len(set(seen)) == 96 and seen == loader.order(0)[:96].tolist()
    assert loader.epoch == 0
    loader.next_batch()
    assert loader.epoch == 1 and loader.order(1).tolist() != loader.order(0).tolist()


def test_loader_is_deterministic_by_seed():
    a, b, c = (data.Loader(TOKENS, T, 8, seed=s) for s in (5, 5, 6))
    batches = [[x.next_batch() for _ in range(20)] for x in (a, b, c)]
    assert all(torch.equal(x, y) for x, y in zip(batches[0], batches[1], strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(batches[0], batches[2], strict=True))


@pytest.mark.parametrize("world", [2, 4])
def test_global_batch_is_the_same_on_any_number_of_ranks(world):
    single = data.Loader(TOKENS, T, 8, seed=1)
    ranks = [data.Loader(TOKENS, T, 8, seed=1, rank=r, world=world) for r in range(world)]
    for _ in range(30):  # crosses two epoch boundaries
        parts = [r.next_batch() for r in ranks]
        assert all(p.shape == (8 // world, T + 1) for p in parts)
        assert torch.equal(torch.cat(parts), single.next_batch())
    single_val = data.eval_batches(TOKENS, T, 8, n_batches=3)
    rank_val = [data.eval_batches(TOKENS, T, 8, n_batches=3, rank=r, world=world) for r in range(world)]
    for k in range(3):
        assert torch.equal(torch.cat([v[k] for v in rank_val]), single_val[k])


def test_state_dict_resumes_exactly_even_on_another_layout():
    loader = data.Loader(TOKENS, T, 8, seed=2)
    for _ in range(17):
        loader.next_batch()
    state = loader.state_dict()
    assert all(isinstance(v, int) for v in state.values())
    expected = [loader.next_batch() for _ in range(10)]
    resumed = data.Loader(TOKENS, T, 8, seed=2)
    resumed.load_state_dict(state)
    assert all(torch.equal(resumed.next_batch(), e) for e in expected)
    halves = [data.Loader(TOKENS, T, 8, seed=2, rank=r, world=2) for r in range(2)]
    for h in halves:
        h.load_state_dict(state)
    assert all(torch.equal(torch.cat([h.next_batch() for h in halves]), e) for e in expected)
    with pytest.raises(data.DataError, match="seq_len=10 but this run has 5"):
        data.Loader(TOKENS, 5, 8, seed=2).load_state_dict(state)


def test_eval_batches_are_the_first_windows_in_order():
    batches = data.eval_batches(TOKENS, T, 8, n_batches=2)
    assert [window_ids(b) for b in batches] == [list(range(8)), list(range(8, 16))]
    assert len(data.eval_batches(TOKENS, T, 8, n_batches=1000)) == N_WINDOWS // 8  # fewer if short
    assert len(data.eval_batches(TOKENS[:T * 8 + 1], T, 8, n_batches=4)) == 1


# ---------------------------------------------------------------------------------------------- bad input

def test_bad_input_gives_a_clear_data_error(tmp_path, monkeypatch):
    assert issubclass(data.DataError, ValueError)
    with pytest.raises(data.DataError, match="no such file or directory"):
        data.prepare(byte_cfg(tmp_path, tmp_path / "nope"), verbose=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(data.DataError, match="no files there"):
        data.prepare(byte_cfg(tmp_path, tmp_path / "empty"), verbose=False)
    with pytest.raises(data.DataError, match="no files there"):
        data.prepare(byte_cfg(tmp_path, tmp_path / "empty" / "*.txt"), verbose=False)
    (tmp_path / "empty" / "blank.txt").write_text("\n")
    with pytest.raises(data.DataError, match="no documents left after cleaning"):
        data.prepare(byte_cfg(tmp_path, tmp_path / "empty"), verbose=False)
    (tmp_path / "latin1.txt").write_bytes("naïve text ".encode("latin-1") * 20)
    with pytest.raises(data.DataError, match=r"latin1\.txt is not UTF-8 text \(byte 0xef at offset 2\)"):
        data.prepare(byte_cfg(tmp_path, tmp_path / "latin1.txt"), verbose=False)
    with pytest.raises(data.DataError, match=r"the train split has 51 tokens.*needs at least 81"):
        data.Loader(TOKENS[:51], T, 8, seed=0)
    with pytest.raises(data.DataError, match=r"the validation split has 0 tokens"):
        data.eval_batches(np.zeros(0, np.uint16), T, 8, n_batches=1)
    with pytest.raises(data.DataError, match="split evenly over 3"):
        data.Loader(TOKENS, T, 8, seed=0, rank=0, world=3)
    monkeypatch.setattr(data, "SHAKESPEARE_URL", "http://127.0.0.1:9/input.txt")  # as if offline
    with pytest.raises(data.DataError, match="could not download Tiny Shakespeare.*place it at"):
        data.prepare(byte_cfg(tmp_path, "shakespeare"), verbose=False)
    with pytest.raises(data.DataError, match="val fraction"):
        data.prepare(byte_cfg(tmp_path, tmp_path / "latin1.txt", val_fraction=1.0), verbose=False)


def test_cli_prepares_and_reports(tmp_path, capsys):
    rng = np.random.default_rng(4)
    (tmp_path / "corpus").mkdir()
    for i in range(3):
        (tmp_path / "corpus" / f"{i}.txt").write_text(text(rng, 50))
    flags = ["--tokenizer", "byte", "--cache-dir", str(tmp_path / "c")]
    data.main(["--data", str(tmp_path / "corpus"), *flags])
    out = capsys.readouterr().out
    assert "removed         0  near duplicates" in out and "kept            3" in out and "tokens/s" in out
    with pytest.raises(SystemExit, match="data: error: --data .*nope: no such file"):
        data.main(["--data", str(tmp_path / "nope"), *flags])
