"""Near-duplicate detection that scales: MinHash signatures, LSH buckets, and clusters with one survivor.

    document ──words──▶ 5-word shingles ──hash──▶ set of uint64 ──128 minima──▶ signature (512 bytes)
    signatures ──16 bands of 8 rows──▶ buckets ──each member vs the 2 before it──▶ union-find clusters
    cluster ──keep its earliest document, drop the rest──▶ report: pairs and their estimated Jaccard

MinHash (Broder, "On the resemblance and containment of documents", 1997). Two documents are
compared as sets of shingles (overlapping windows of 5 words); their Jaccard similarity is
J = |A∩B| / |A∪B|. Under a random permutation of all possible shingles, the smallest element of
A∪B is equally likely to be any of them, and it is the minimum of both A and B exactly when it
lies in A∩B: P(min A == min B) = J. 128 permutations give a signature of 128 minima, and the
fraction of equal entries estimates J with a standard error of sqrt(J(1-J)/128) <= 0.044.

A signature depends on the document alone. Each word is hashed from its UTF-8 bytes (blake2b, 8
bytes read little-endian), shingles from their words with splitmix64's finalizer, and the 128 hash
functions are fixed constants: never Python's hash() (salted per process) nor a numbering of words
shared by the corpus (which made a document's signature depend on the documents before it). So
the same text gets the same signature alone or anywhere in any corpus, in any process, on any
machine, and signatures computed by different workers can be compared: the step runs in parallel.

LSH (locality-sensitive hashing; Leskovec, Rajaraman & Ullman, "Mining of Massive Datasets", ch. 3).
Cut the signature into b = 16 bands of r = 8 rows. Two documents whose band k is equal share a
bucket of band k; a pair with similarity s shares at least one bucket with probability
1 - (1 - s^r)^b, an S-curve: 6% at s = 0.5, 61% at 0.7, 95% at 0.8, 99.99% at 0.9. That is the
chance to be *compared*. A compared pair is then joined only if its estimate reaches the threshold,
and near the threshold its error (+-0.035 at s = 0.8) often leaves it short: measured (lesson 4,
and tests/test_data.py on 300-word documents), 67% to 77% of the pairs of similarity [0.80, 0.85)
are found, 98% of [0.85, 0.90), all above 0.9; and a fifth to a quarter of those of [0.75, 0.80)
are joined too.

Linear in a bucket's size. A bucket is found by sorting the band's 64-bit keys (no dictionary of
all documents). Inside it, in an order shuffled differently in every band, each member is compared
on the full signature with the two members before it: k near copies of one template cost at most
2 x 16 x k comparisons, not 16 k^2/2 pairs, and over 16 bands each document meets many partners.
The shuffle is keyed on a hash of each document's signature, never on its position: the same
documents meet the same partners in any corpus order, so the clusters are the same sets of documents
however the corpus is ordered (only which member a cluster keeps follows the order).
Each confirmed pair (estimated J >= threshold) joins two clusters (union-find, the smaller index as
the root). The rule: a cluster keeps its earliest document in corpus order and drops every other
member, so a planted cluster keeps exactly one document, even a chain A~B~C where A and C are
less similar than the threshold (the rule "drop if similar to an earlier *kept* document" keeps
both A and C there).
"""

import hashlib
import sys
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

SHINGLE, NUM_PERM, BANDS = 5, 128, 16  # 5-word shingles; 128 hash functions = 16 bands x 8 rows
ROWS = NUM_PERM // BANDS
WINDOW = 2  # in a bucket, each document is compared with the 2 before it (in an order shuffled per band)
U64, U32 = np.uint64, np.uint32


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: scrambles uint64s so that nearby inputs give unrelated outputs."""
    x = (x ^ (x >> U64(30))) * U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> U64(27))) * U64(0x94D049BB133111EB)
    return x ^ (x >> U64(31))


# the 128 hash functions x -> a*x + b (mod 2^32), a odd so each permutes all uint32s; fixed constants
_A = (mix64(np.arange(NUM_PERM, dtype=U64) + U64(0x5EED)) >> U64(32)).astype(U32) | U32(1)
_B = (mix64(np.arange(NUM_PERM, dtype=U64) + U64(0xB00B5)) >> U64(32)).astype(U32)


def word_hashes(text: str) -> np.ndarray:
    """One uint64 per word (words split at whitespace, as str.split does): the first 8 bytes of the
    word's blake2b digest, read little-endian, so a function of the word's characters alone."""
    if not isinstance(text, str):  # bytes would split, then fail to encode: say what is wrong instead
        raise TypeError(f"MinHash signs text (str), not {type(text).__name__}: decode it first "
                        "(data.py reads every file as UTF-8)")
    words = text.split()
    distinct = {w: i for i, w in enumerate(dict.fromkeys(words))}  # hash each distinct word once
    digests = b"".join(hashlib.blake2b(w.encode("utf-8", "surrogatepass"), digest_size=8).digest()
                       for w in distinct)
    ids = np.fromiter(map(distinct.__getitem__, words), dtype=np.int64, count=len(words))
    return np.frombuffer(digests, dtype="<u8").astype(U64)[ids]


def shingles(text: str) -> np.ndarray:
    """Hashes of a document's overlapping 5-word windows, in order, repeats included."""
    words = word_hashes(text)
    words = np.pad(words, (0, max(0, SHINGLE - len(words))))  # a very short document is one shingle
    n = len(words) - SHINGLE + 1
    h = np.zeros(n, dtype=U64)
    for k in range(SHINGLE):  # h = mix(...mix(mix(w0) ^ w1)... ^ w4): word order matters
        h = mix64(h ^ words[k:k + n])
    return h


def shingle_hashes(text: str) -> np.ndarray:
    """The sorted set of a document's shingle hashes (to compute a true Jaccard similarity)."""
    return np.unique(shingles(text))


def signature(text: str, chunk: int = 2048) -> np.ndarray:
    """(NUM_PERM,) uint32: for each hash function the minimum over the document's shingles (a repeated
    shingle cannot change a minimum, so the set needs no deduplicating). Shingle hashes are folded
    to 32 bits: twice as many fit a vector register, and a collision is a 2^-32 event per pair."""
    h = shingles(text)
    x = ((h >> U64(32)) ^ h).astype(U32)
    sig = np.full(NUM_PERM, np.iinfo(U32).max, dtype=U32)
    buf = np.empty((NUM_PERM, min(chunk, len(x))), dtype=U32)
    for s in range(0, len(x), chunk):  # chunks keep the (NUM_PERM, chunk) product small and in cache
        part = buf[:, :len(x[s:s + chunk])]
        np.multiply(_A[:, None], x[None, s:s + chunk], out=part)
        part += _B[:, None]
        np.minimum(sig, part.min(axis=1), out=sig)
    return sig


def signatures(texts: list[str]) -> np.ndarray:
    """(len(texts), NUM_PERM): each row is signature(text), which depends on that text alone."""
    return np.stack([signature(t) for t in texts]) if texts else np.zeros((0, NUM_PERM), dtype=U32)


def jaccard_estimate(sig_a: np.ndarray, sig_b: np.ndarray) -> np.ndarray:
    """The fraction of equal signature entries (along the last axis)."""
    return np.mean(sig_a == sig_b, axis=-1)


def candidate_probability(s: float, bands: int = BANDS, rows: int = ROWS) -> float:
    """The LSH S-curve: the chance that two documents of similarity s share a bucket in some band."""
    return 1 - (1 - s ** rows) ** bands


def band_keys(sig: np.ndarray, band: int) -> np.ndarray:
    """One uint64 per row of `sig`: its band `band` (ROWS entries) hashed into one value."""
    key = np.zeros(len(sig), dtype=U64)
    for r in range(band * ROWS, (band + 1) * ROWS):
        key = mix64(key ^ sig[:, r].astype(U64))
    return key


def band_key_table(sig: np.ndarray, ids: np.ndarray, out: np.ndarray | None = None,
                   chunk: int = 65536) -> np.ndarray:
    """(BANDS, len(ids)): the band keys of rows `ids` of `sig`, in one pass over the rows (a signature
    store on disk is read once, sequentially); `out` may be an on-disk np.memmap."""
    out = np.empty((BANDS, len(ids)), dtype=U64) if out is None else out
    for s in range(0, len(ids), chunk):
        rows = np.asarray(sig[ids[s:s + chunk]])
        for band in range(BANDS):
            out[band, s:s + chunk] = band_keys(rows, band)
    return out


def content_hashes(keys: np.ndarray) -> np.ndarray:
    """One uint64 per document from its BANDS band keys (so from its whole signature, a function of
    its text alone): what orders a bucket's members, so that which pairs are compared, and so the
    clusters, do not depend on where the documents sit in the corpus."""
    h = np.zeros(keys.shape[1], dtype=U64)
    for band in range(BANDS):
        h = mix64(h ^ np.asarray(keys[band]))
    return h


def _find(parent: np.ndarray, x: int) -> int:
    while parent[x] != x:  # path halving: every other node on the way points to its grandparent
        parent[x] = parent[parent[x]]
        x = int(parent[x])
    return x


@dataclass
class Clusters:
    """The outcome of near-duplicate detection over the documents `ids` (in corpus order)."""
    ids: np.ndarray  # (m,) the documents (rows of the signature store) that took part
    root: np.ndarray  # (m,) for each, the position in ids of the earliest document of its cluster
    compared: int  # pairs compared on the full signature: at most BANDS * WINDOW per document

    @property
    def drop(self) -> np.ndarray:
        """The documents to drop (a subset of ids): every member of a cluster except its earliest."""
        return self.ids[self.root != np.arange(len(self.root))]

    def summary(self, sig: np.ndarray, examples: int = 8) -> dict:
        """How many clusters, the largest, and the first few as (kept, removed, estimated J) triples:
        each cluster's kept document, the first document it drops and their estimated similarity."""
        dropped = np.flatnonzero(self.root != np.arange(len(self.root)))
        roots, first = np.unique(self.root[dropped], return_index=True)  # one removed document per cluster
        largest = int(np.bincount(self.root[dropped]).max()) + 1 if len(dropped) else 0
        pairs = [(int(self.ids[k]), int(self.ids[r]),
                  float(jaccard_estimate(np.asarray(sig[self.ids[k]]), np.asarray(sig[self.ids[r]]))))
                 for k, r in zip(roots[:examples].tolist(), dropped[first[:examples]].tolist())]
        return {"clusters": len(roots), "removed": len(dropped), "largest": largest, "examples": pairs}


def _roots(parent: np.ndarray) -> np.ndarray:
    """Every node's root, by pointer doubling: r <- r[r] until nothing moves (log(depth) passes)."""
    root = parent.copy()
    while True:
        nxt = root[root]
        if np.array_equal(nxt, root):
            return root
        root = nxt


def cluster(sig: np.ndarray, threshold: float, ids: np.ndarray | None = None, keys: np.ndarray | None = None,
            verbose: bool = False, chunk: int = 8192) -> Clusters:
    """Near-duplicate clusters among rows `ids` (default: all) of `sig` ((n, NUM_PERM), an array or an
    on-disk np.memmap); `keys` is their band_key_table if it was computed already.

    Per band: sort by band key, and inside a bucket in an order shuffled per band by content (the
    documents' signatures, not their positions: the clusters do not depend on order); compare each member
    with the WINDOW members before it on the whole signature, and join the two clusters where the
    estimated Jaccard is >= threshold. A bucket of k documents costs WINDOW * k comparisons, and the
    shuffle gives every member other partners in every band, so a cluster is joined up through any of
    them. Memory: a few arrays of len(ids) values per band and `chunk` signature pairs at a time."""
    ids = np.arange(len(sig)) if ids is None else np.asarray(ids)
    m = len(ids)
    keys = band_key_table(sig, ids) if keys is None else keys
    parent = np.arange(m, dtype=np.int64)
    need = threshold * sig.shape[1]  # equal entries a confirmed pair needs
    compared = 0
    content = content_hashes(keys)
    for band in tqdm(range(BANDS), desc="dedup", unit="band", disable=not verbose or m < 2, file=sys.stderr):
        shuffle = mix64(content ^ U64(0x9E3779B97F4A7C15 * (band + 1) % 2**64))
        order = np.lexsort((shuffle, keys[band]))  # by bucket, then in this band's shuffled order
        sorted_keys = np.asarray(keys[band])[order]
        first = np.maximum.accumulate(np.where(np.r_[False, sorted_keys[1:] == sorted_keys[:-1]], 0, np.arange(m)))
        for back in range(1, WINDOW + 1):
            members = np.flatnonzero(np.arange(m) - back >= first)  # positions with a partner `back` before
            for s in range(0, len(members), chunk):
                a, b = order[members[s:s + chunk] - back], order[members[s:s + chunk]]
                compared += len(b)
                equal = (np.asarray(sig[ids[a]]) == np.asarray(sig[ids[b]])).sum(axis=1)
                for i, j in zip(a[equal >= need].tolist(), b[equal >= need].tolist()):
                    ri, rj = _find(parent, i), _find(parent, j)
                    if ri != rj:
                        parent[max(ri, rj)] = min(ri, rj)  # the earlier document stays the root
    return Clusters(ids=ids, root=_roots(parent), compared=compared)


def near_duplicates(sig: np.ndarray, threshold: float) -> set[int]:
    """The documents (rows of sig) to drop: all members of each near-duplicate cluster but its earliest."""
    return set(cluster(sig, threshold).drop.tolist())
