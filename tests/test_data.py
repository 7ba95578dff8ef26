"""data.py: cleaning, shards, the prepared-data cache and the loader's contract (tokenizers: test_tokenizer.py).

Every test uses the byte tokenizer and tiny corpora in tmp_path, so the file runs in seconds and
touches no network.
"""

import hashlib
import json
import os
import struct
import subprocess
import sys
import tracemalloc
import unicodedata

import numpy as np
import pytest
import torch
from conftest import ROOT

import data
from support import dedup, scan, sources, tokenizer

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
        docs += tok.decode(tokens).split(tokenizer.EOT_TEXT)[1:]
    return docs


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

    tok = tokenizer.get_tokenizer("byte")
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
    sig = dedup.signatures(base + near + far)
    assert dedup.near_duplicates(sig, 0.8) == set(range(20, 40))  # every near copy, no far one
    assert 0.85 < np.mean(sig[0] == sig[20]) and np.mean(sig[0] == sig[40]) < 0.3


def test_single_file_is_cut_into_documents_and_split_by_document(tmp_path):
    rng = np.random.default_rng(2)
    path = tmp_path / "book.txt"
    path.write_text("\n\n".join(text(rng, 60) for _ in range(300)))  # ~110 kB
    prepared = data.prepare(byte_cfg(tmp_path, path, val_fraction=0.1), verbose=False)
    stats = json.loads((prepared / "meta.json").read_text())["stats"]
    assert stats["documents"] >= 20 and stats["val_docs"] >= 2
    assert stats["val_tokens"] >= 0.1 * (stats["train_tokens"] + stats["val_tokens"])


# ---------------------------------------------------------------------------------------------- dedup that scales

def test_a_signature_depends_only_on_its_document():
    rng = np.random.default_rng(9)
    docs = [text(rng) for _ in range(6)]
    alone = [dedup.signature(d) for d in docs]
    for order in ([0, 1, 2, 3, 4, 5], [5, 3, 1, 0, 2, 4], [2, 2, 0]):  # in any corpus, in any order
        sig = dedup.signatures([docs[i] for i in order])
        assert all(np.array_equal(sig[k], alone[i]) for k, i in enumerate(order))
    assert len({s.tobytes() for s in alone}) == 6
    code = ("import sys; from support import dedup; "
            "sys.stdout.write(dedup.signature(sys.stdin.read()).astype('<u4').tobytes().hex())")
    for seed in ("1", "2"):  # in other processes, whatever Python's string hashing is salted with
        out = subprocess.run([sys.executable, "-c", code], input=docs[0], capture_output=True, text=True, cwd=ROOT,
                             env={**os.environ, "PYTHONHASHSEED": seed}, check=True).stdout
        assert out == alone[0].astype("<u4").tobytes().hex()
    # and on other machines and versions: pinned, so a change of the hashing is a deliberate one
    # (it must come with a FORMAT_VERSION bump: the prepared caches depend on it)
    fox = dedup.signature("The quick brown fox jumps over the lazy dog, and then naps under the old oak tree.")
    assert hashlib.sha256(fox.astype("<u4").tobytes()).hexdigest() == \
        "0c832c57108dad64a1de72530973bb8fead28f4b11689f27792c3bf9782c95dd"


def test_a_bucket_of_4000_near_copies_costs_linear_work_and_flat_memory():
    rng = np.random.default_rng(10)
    base = text(rng, 400)
    copies = [base] + [edit_words(base, rng.choice(400, 2, replace=False).tolist()) for _ in range(3999)]
    sig = dedup.signatures(copies)
    assert (np.mean(sig[1:] == sig[0], axis=1) >= 0.85).all()  # one bucket in every band, nearly
    tracemalloc.start()
    clusters = dedup.cluster(sig, 0.8)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert clusters.drop.tolist() == list(range(1, 4000))  # one cluster, and its first document is kept
    # each copy is compared with at most WINDOW others per band: 128k pairs, where all pairs of the
    # bucket are 8M per band; the pairs of one bucket as Python tuples alone would take > 1 GB
    assert 4000 * dedup.BANDS <= clusters.compared <= 4000 * dedup.BANDS * dedup.WINDOW
    assert peak < 24e6, f"{peak / 1e6:.1f} MB"


def template_corpus(n: int, seed: int) -> list[str]:
    """n documents from one 200-word template, each with 1-12 words replaced: one huge bucket per band,
    whose members range from near copies of each other to pairs below the threshold."""
    rng = np.random.default_rng(seed)
    base = rng.choice(WORDS, 200)
    docs = []
    for _ in range(n):
        words = base.copy()
        words[rng.choice(200, rng.integers(1, 13))] = rng.choice(WORDS, 1)
        docs.append(" ".join(words))
    return list(dict.fromkeys(docs))


def test_clusters_are_the_same_sets_of_documents_in_any_corpus_order():
    docs = template_corpus(3000, seed=12)
    sig = dedup.signatures(docs)

    def clusters(order: np.ndarray) -> set[frozenset[int]]:
        """The partition of the documents (by their index in `docs`), clustering them in `order`."""
        groups = {}
        for position, root in enumerate(dedup.cluster(sig[order], 0.8).root.tolist()):
            groups.setdefault(root, set()).add(int(order[position]))
        return {frozenset(g) for g in groups.values()}

    reference = clusters(np.arange(len(docs)))
    assert max(len(g) for g in reference) > 500 and len(reference) > 100  # big clusters, and many loners
    for seed in range(3):  # which pairs a bucket compares follows content, not position
        assert clusters(np.random.default_rng(seed).permutation(len(docs))) == reference


def test_detection_near_the_threshold_is_what_the_docstring_says():
    """dedup.py's numbers: the S-curve (the chance to be compared) and, lower, the share of pairs found
    after the estimate check, by true Jaccard similarity."""
    rng = np.random.default_rng(13)
    docs, pairs = [], []
    for _ in range(1600):
        a = text(rng, 300).split()
        b = list(a)
        for p in rng.choice(300, rng.integers(1, 9), replace=False):  # 1-8 words replaced: J from ~0.97 to ~0.76
            b[p] = f"new{rng.integers(10**9)}"
        sa, sb = dedup.shingle_hashes(" ".join(a)), dedup.shingle_hashes(" ".join(b))
        pairs.append((len(docs), len(np.intersect1d(sa, sb)) / len(np.union1d(sa, sb))))
        docs += [" ".join(a), " ".join(b)]
    root = dedup.cluster(dedup.signatures(docs), 0.8).root
    found = {(lo, hi): [root[k] == root[k + 1] for k, j in pairs if lo <= j < hi]
             for lo, hi in ((0.75, 0.8), (0.8, 0.85), (0.85, 0.9), (0.9, 1.0))}
    assert all(len(v) > 150 for v in found.values())
    rate = {k: float(np.mean(v)) for k, v in found.items()}
    assert round(dedup.candidate_probability(0.8), 2) == 0.95  # compared: 95% at s = 0.8
    assert 0.15 < rate[0.75, 0.8] < 0.35  # "a fifth to a quarter of [0.75, 0.80) are joined"
    assert 0.60 < rate[0.8, 0.85] < 0.85  # "67% to 77% of [0.80, 0.85)"
    assert 0.95 < rate[0.85, 0.9] < 1 and rate[0.9, 1.0] == 1  # "98% of [0.85, 0.90), all above 0.9"


def test_a_signature_of_bytes_is_refused_clearly():
    with pytest.raises(TypeError, match=r"str\), not bytes: decode it first"):
        dedup.signature(b"some bytes that look like text")


def test_planted_clusters_keep_exactly_their_earliest_document(tmp_path):
    rng = np.random.default_rng(11)
    planted = []
    for _ in range(40):
        base = text(rng, 500)
        variants = [edit_words(base, rng.choice(500, 3, replace=False).tolist()) for _ in range(3)]
        chain = [base]  # a chain: each version edits the one before; its ends are less alike than 0.8
        for _ in range(6):
            chain.append(edit_words(chain[-1], rng.choice(500, 4, replace=False).tolist()))
        planted.append([base, *variants, *chain[1:]])
    ends = [set(dedup.shingle_hashes(cluster[i]).tolist()) for cluster in planted[:1] for i in (0, -1)]
    assert len(ends[0] & ends[1]) / len(ends[0] | ends[1]) < 0.75
    docs = [(c, v) for c in range(40) for v in range(10)]
    order = rng.permutation(len(docs))  # clusters interleaved, versions in any order
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for position, k in enumerate(order):
        c, v = docs[k]
        (corpus / f"{position:04d}.txt").write_text(planted[c][v])
    prepared = data.prepare(byte_cfg(tmp_path, corpus, workers=1), verbose=False)
    kept = sorted(shard_docs(prepared, tokenizer.ByteTokenizer()))
    earliest = {}  # cluster -> its first version in corpus order
    for k in order:
        earliest.setdefault(docs[k][0], planted[docs[k][0]][docs[k][1]])
    assert kept == sorted(earliest.values())  # one per cluster: the earliest in corpus order
    stats = json.loads((prepared / "meta.json").read_text())["stats"]
    assert stats["removed"]["near_dup"] == 360 and stats["near_dup"]["clusters"] == 40
    assert stats["near_dup"]["largest"] == 10


def test_the_report_lists_removed_pairs_with_their_similarity(tmp_path, capsys):
    rng = np.random.default_rng(12)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    base = [text(rng, 300) for _ in range(3)]
    for i, d in enumerate(base):
        (corpus / f"a{i}.txt").write_text(d)
        (corpus / f"b{i}.txt").write_text(edit_words(d, [5 + 50 * i]))  # one word changed
    data.main(["--data", str(corpus), "--tokenizer", "byte", "--cache-dir", str(tmp_path / "c"), "--workers", "1"])
    out = capsys.readouterr().out
    assert "clusters        3  near-duplicate clusters (largest: 2 documents), each keeps its earliest" in out
    examples = [line.split() for line in out.splitlines() if line.startswith("  removed ")]
    assert [(e[1], e[6]) for e in examples] == [(f"b{i}.txt", f"a{i}.txt") for i in range(3)]
    shingles = [set(dedup.shingle_hashes(edit_words(d, [5 + 50 * i])).tolist()) for i, d in enumerate(base)]
    truth = [len(s & t) / len(s | t) for s, t in zip(shingles, (set(dedup.shingle_hashes(d).tolist()) for d in base))]
    for e, j in zip(examples, truth):  # the estimate, next to the true Jaccard of the pair (~0.97)
        assert e[2].startswith("J~") and abs(float(e[2][2:]) - j) < 0.08


def test_preparation_resumes_after_its_last_finished_part(tmp_path, monkeypatch):
    rng = np.random.default_rng(13)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(60):
        (corpus / f"{i:02d}.txt").write_text(text(rng, 200))
    monkeypatch.setattr(scan, "CHUNK_CHARS", 5000)  # 5 documents (~1,200 chars each) a chunk,
    monkeypatch.setattr(scan, "CHUNKS_PER_PART", 3)  # 15 a part
    cfg = byte_cfg(tmp_path, corpus, workers=1)
    whole = data.prepare(byte_cfg(tmp_path / "whole", corpus, workers=2), verbose=False)

    finish_part, parts = scan.Work.finish_part, []
    def crash_after_two(self, docs):
        finish_part(self, docs)
        parts.append(docs)
        if len(parts) == 2:
            raise KeyboardInterrupt  # a stop, right after the second part was made durable
    monkeypatch.setattr(scan.Work, "finish_part", crash_after_two)
    with pytest.raises(KeyboardInterrupt):
        data.prepare(cfg, verbose=False)
    work = next((tmp_path / "cache").glob(".*.work"))
    manifest = json.loads((work / "manifest.json").read_text())
    assert [p["docs"] for p in manifest["parts"]] == [15, 30]
    with open(work / "docs.bin", "ab") as f:
        f.write(b"half a record")  # what a crash mid-way through a part leaves behind: cut away on resume

    read = []
    monkeypatch.setattr(scan, "scan_chunk", lambda texts: read.append(len(texts)) or scan_chunk(texts))
    monkeypatch.setattr(scan.Work, "finish_part", finish_part)
    prepared = data.prepare(cfg, verbose=False)
    assert sum(read) == 30  # only the documents after the last finished part
    assert [(prepared / f).read_bytes() for f in ("train.bin", "val.bin")] == \
        [(whole / f).read_bytes() for f in ("train.bin", "val.bin")]
    assert not work.exists()  # done: the work directory is gone


scan_chunk = scan.scan_chunk


# ---------------------------------------------------------------------------------------------- the split

def val_tokens(sizes: list[int], *args) -> int:
    train, val = data.split_documents(sizes, *args)
    assert sorted(train + val) == list(range(len(sizes))) and not set(train) & set(val)
    return sum(sizes[i] for i in val)


def test_the_val_split_is_sized_in_tokens():
    sizes = np.random.default_rng(0).integers(100, 5000, 2000).tolist()  # 2,000 documents, ~5M tokens
    total, biggest = sum(sizes), max(sizes)
    got = val_tokens(sizes, 0.01, 262_145, 0)  # the cap (10%, ~500k) allows min_val_tokens
    assert 262_145 <= got < 262_145 + biggest
    got = val_tokens(sizes, 0.01, 10**9, 0)  # it does not: val stops at 10%, as close as documents allow
    assert 0.1 * total - biggest < got <= 0.1 * total
    got = val_tokens(sizes, 0.2, 262_145, 0)  # never less than val_fraction
    assert 0.2 * total <= got < 0.2 * total + biggest
    assert val_tokens(sizes, 0.0, 0, 0) == 0  # both zero: no validation at all
    assert data.split_documents(sizes, 0.01, 10**5, 1) == data.split_documents(sizes, 0.01, 10**5, 1)
    assert data.split_documents(sizes, 0.01, 10**5, 1) != data.split_documents(sizes, 0.01, 10**5, 2)

    gpu_box = [8200] * 574  # the GPU machine's small standard library: 574 files, 4.7M tokens
    assert val_tokens(gpu_box, 0.01, data.DataConfig.min_val_tokens, 1234) >= 4 * 64 * 1024 + 1
    assert val_tokens([10] * 10, 0.01, 1000, 0) == 10  # a tiny corpus: 10%, one document
    assert val_tokens([10] * 10, 0.01, 1, 0) == 10  # at least one document when there are two
    assert val_tokens([50, 50], 0.9, 10**9, 0) == 50  # never all of them
    assert val_tokens([100], 0.5, 10**9, 0) == 0  # one document: nothing to hold out
    for seed in range(6):  # a document past the cap is passed over, unless it comes first: one is a must
        big_first = np.random.default_rng(seed).permutation(3)[0] == 0
        assert val_tokens([900, 50, 50], 0.01, 10**9, seed) == (900 if big_first else 100)


def test_prepare_sizes_val_in_tokens(tmp_path):
    rng = np.random.default_rng(6)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(60):  # 1,000 characters each: 1,001 tokens with the <|endoftext|> before it
        (corpus / f"{i}.txt").write_text(text(rng, 300)[:1000])
    for min_val, val_fraction, expected_docs in [(5000, 0.01, 5), (10**9, 0.01, 6), (5000, 0.2, 12)]:
        cfg = byte_cfg(tmp_path, corpus, min_val_tokens=min_val, val_fraction=val_fraction)
        stats = json.loads((data.prepare(cfg, verbose=False) / "meta.json").read_text())["stats"]
        assert (stats["kept"], stats["val_docs"], stats["val_tokens"]) == (60, expected_docs, 1001 * expected_docs)


# ---------------------------------------------------------------------------------------------- shards, cache

def test_shard_round_trip_and_corruption(tmp_path):
    for dtype in (np.uint16, np.uint32):
        tokens = np.arange(1000, dtype=dtype) * 7
        data.write_tokens(tmp_path / "t.bin", tokens)
        loaded = data.load_tokens(tmp_path / "t.bin", vocab_size=7000)
        assert loaded.dtype == dtype and np.array_equal(loaded, tokens)
    data.write_tokens(tmp_path / "empty.bin", np.zeros(0, np.uint16))
    assert len(data.load_tokens(tmp_path / "empty.bin", vocab_size=257)) == 0

    good = (tmp_path / "t.bin").read_bytes()
    assert len(good) == 56 + 4000 and good[24:56] == hashlib.sha256(good[56:]).digest()  # the header's sha256
    v1 = struct.pack("<8sIIQ", b"NSTOKENS", 1, 4, 1000) + good[56:]  # a shard from before the checksum
    cases = {"bad magic": b"XXXXXXXX" + good[8:], "truncated": good[:-3], "longer than": good + b"\0\0\0\0",
             "version 9": good[:8] + (9).to_bytes(4, "little") + good[12:], "bad magic ": b"NST",
             "truncated in its header": good[:40], "version 1 \\(from before shards carried a checksum": v1}
    for problem, content in cases.items():
        (tmp_path / "bad.bin").write_bytes(content)
        with pytest.raises(data.DataError, match=rf"bad\.bin: .*{problem.strip()}.*delete"):
            data.load_tokens(tmp_path / "bad.bin")
    with pytest.raises(data.DataError, match="not found"):
        data.load_tokens(tmp_path / "missing.bin")


def test_a_flipped_token_is_caught_by_the_checksum(tmp_path):
    tokens = np.random.default_rng(7).integers(0, 50257, 10_000, dtype=np.uint16)
    data.write_tokens(tmp_path / "t.bin", tokens)
    shard = bytearray((tmp_path / "t.bin").read_bytes())
    position = 56 + 2 * 4321
    shard[position:position + 2] = int((tokens[4321] + 1) % 50257).to_bytes(2, "little")  # another valid id
    (tmp_path / "t.bin").write_bytes(shard)
    with pytest.raises(data.DataError, match=r"t\.bin: its tokens do not match its sha256 \(corrupted\); delete"):
        data.load_tokens(tmp_path / "t.bin", vocab_size=50257)


def test_a_token_outside_the_vocabulary_is_a_clear_error(tmp_path, monkeypatch):
    rng = np.random.default_rng(8)
    (tmp_path / "corpus").mkdir()
    for i in range(3):
        (tmp_path / "corpus" / f"{i}.txt").write_text(text(rng, 500))
    prepared = data.prepare(byte_cfg(tmp_path, tmp_path / "corpus"), verbose=False)
    tokens = np.array(data.load_tokens(prepared / "train.bin", vocab_size=257))
    tokens[1234] = 65535  # fits the uint16 shard, not the byte tokenizer's 257 ids
    data.write_tokens(prepared / "train.bin", tokens)  # with a header sha256 that matches: only the range is wrong
    monkeypatch.setattr(data, "CHECK_TOKENS", 1000)  # so the bad token is in the second chunk
    with pytest.raises(data.DataError, match=rf"train\.bin: token 65535 at position 1234 is outside this "
                                             rf"tokenizer's 257-token vocabulary .*; delete {prepared} and"):
        data.load_tokens(prepared / "train.bin", vocab_size=257)
    assert data.load_tokens(prepared / "train.bin")[1234] == 65535  # without a vocabulary it is not checked


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

    files, tok = sources.resolve(str(corpus), cfg.cache_dir).files, tokenizer.ByteTokenizer()
    key = data.cache_key(cfg, files, tok)
    other_tok = type("Other", (tokenizer.ByteTokenizer,), {"identity": lambda self: "byte:v2"})()
    changed = [data.cache_key(data.DataConfig(**{**vars(cfg), field: value}), files, tok)
               for field, value in [("min_chars", 10), ("val_fraction", 0.5), ("seed", 1), ("dedup", False),
                                    ("near_dup_threshold", 0.9), ("min_val_tokens", 10)]]
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
    with pytest.raises(data.DataError, match=r"the validation split has 51 tokens.*needs at least 81: use a "
                                             r"smaller --batch-size or --seq-len, or more data$"):
        data.eval_batches(TOKENS[:51], T, 8, n_batches=1)
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "a.py").write_text("# a corpus of one document " * 4)  # too small to cut
    prepared = data.prepare(byte_cfg(tmp_path, tmp_path / "one"), verbose=False)
    with pytest.raises(data.DataError, match=r"the validation split is empty: the corpus is a single document "
                                             r".*: give more text or more files$"):
        data.eval_batches(data.load_tokens(prepared / "val.bin"), T, 8, n_batches=1)
    with pytest.raises(data.DataError, match="split evenly over 3"):
        data.Loader(TOKENS, T, 8, seed=0, rank=0, world=3)
    monkeypatch.setattr(sources, "SHAKESPEARE_URL", "http://127.0.0.1:9/input.txt")  # as if offline
    monkeypatch.setenv("no_proxy", "*")  # even where a proxy is configured
    with pytest.raises(data.DataError, match="could not download Tiny Shakespeare.*place it at"):
        data.prepare(byte_cfg(tmp_path, "shakespeare"), verbose=False)
    with pytest.raises(data.DataError, match=r"--val-fraction 1.0 must be in \[0, 1\)"):
        data.prepare(byte_cfg(tmp_path, tmp_path / "latin1.txt", val_fraction=1.0), verbose=False)
    with pytest.raises(data.DataError, match="--min-val-tokens -1 at least 0"):
        data.prepare(byte_cfg(tmp_path, tmp_path / "latin1.txt", min_val_tokens=-1), verbose=False)


def test_cli_prepares_and_reports(tmp_path, capsys):
    rng = np.random.default_rng(4)
    (tmp_path / "corpus").mkdir()
    for i in range(3):
        (tmp_path / "corpus" / f"{i}.txt").write_text(text(rng, 50))
    flags = ["--tokenizer", "byte", "--cache-dir", str(tmp_path / "c")]
    data.main(["--data", str(tmp_path / "corpus"), "--min-val-tokens", "100", *flags])
    out = capsys.readouterr().out
    assert "removed         0  near duplicates" in out and "kept            3" in out and "chars/s per process" in out
    assert "documents: 2 train, 1 val" in out and "% of all)" in out
    with pytest.raises(SystemExit, match="data: error: --data .*nope: no such file"):
        data.main(["--data", str(tmp_path / "nope"), *flags])
