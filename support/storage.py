"""How bytes reach the disk safely, and how a reader knows they are the bytes that were written.

checkpoint.py decides *what* a checkpoint holds; this file answers three smaller questions about
the files that hold it.

1. How to write a file that a crash cannot leave half-written. `f.write` returns once the bytes
   are in the operating system's page cache, not on the disk: a power cut a moment later loses
   them, and a file written in place can be caught half-new, half-old. So a file that must appear
   whole is written under another name and renamed over the old one (`replace_atomically`):

       write   latest.tmp           the new bytes, under a name no reader looks at
       fsync   latest.tmp           returns only once the device holds them
       rename  latest.tmp -> latest atomic on POSIX: a reader sees the old file or the new, never half
       fsync   the directory        a rename is a change to the directory, which a power cut can
                                    otherwise forget

   Each file is hashed as it is written, in the same pass (`write_durably`, `write_chunks`), and not
   read back: after the fsync a read would come from the page cache, not the device, and so prove
   nothing the hash does not. The reader checks what is on disk (`verify`, below) on every load.

2. How tensors are laid out in a file: safetensors, the format Hugging Face uses.

       8 bytes     N, the length of the header, little-endian
       N bytes     JSON {name: {"dtype": "F32", "shape": [384, 64], "data_offsets": [start, end]},
                         "__metadata__": {str: str}}, padded with spaces to a multiple of 8
       the rest    every tensor's raw bytes, back to back; the offsets count from here

   Unlike a pickle, opening one runs no code, and the data can be memory-mapped: the tensors
   `read_safetensors` returns read from the file only when they are used.

3. How a reader knows nothing changed. Each data file's sha256 and size go into the checkpoint's
   manifest, and the manifest carries the sha256 of its own contents (`seal`), computed over
   canonical JSON (sorted keys, no spaces) so that the same contents always hash the same. A
   flipped bit in a tensor's name is then caught like a flipped bit in its values. A schema check
   (`check_schema`) makes well-formed JSON of the wrong shape fail with a name rather than as a
   KeyError later. `verify` does all of it: the manifest's own hash, its schema, then every file
   against its size and sha256; `verify_mapped` checks a file after mapping it (`map_file`), so that
   the bytes checked are the bytes then read, even if the file is deleted meanwhile (`pin`).
   Whatever they find wrong is a `CorruptCheckpoint`.

4. How a checkpoint directory appears and goes away whole, and how a reader holds on to one (section 4
   below): written aside and renamed into place, `latest` moved last (`prepare`, `commit`), only the
   run's own deleted beyond --keep, renamed out of sight first (`prune`), and what an unfinished save
   left removed (`clear_leftovers`); a reader maps and checks every file before it reads (`pin`,
   `newest`), so a cleanup cannot pull a checkpoint from under it, or each file as it first needs it
   (`pin_file`: a resuming rank reads only the files that hold its part).
"""

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np
import torch

FORMAT, VERSION = "nanoscale-checkpoint", 2


# The errors live here because the checks below raise them; checkpoint.py re-exports them.
class CheckpointError(ValueError):
    """A checkpoint that cannot be used; printed as one line."""


class CorruptCheckpoint(CheckpointError):
    """Damaged, incomplete or from another run: a reader tries the previous checkpoint."""


# ----------------------------------------------------------------------------- bytes on disk


def sha256_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def sha256_file(path: Path, chunk: int = 1 << 24) -> tuple[str, int]:
    """(sha256, size) of a file, read in chunks (hashlib releases the GIL on each)."""
    h, size, buf = hashlib.sha256(), 0, bytearray(chunk)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            h.update(memoryview(buf)[:n])
            size += n
    return h.hexdigest(), size


def write_durably(path: Path, payload: bytes) -> dict:
    """Write and fsync; returns the sha256 and size of what was written."""
    return write_chunks(path, [payload])


def write_chunks(path: Path, chunks) -> dict:
    """write_durably for data in pieces (memoryviews of tensors): nothing is joined in memory, and each
    byte is hashed once, on its way to the file."""
    h, size = hashlib.sha256(), 0
    with open(path, "wb") as f:
        for chunk in chunks:
            h.update(chunk)  # hashing and writing a large buffer both run without the GIL
            f.write(chunk)
            size += len(chunk)
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": h.hexdigest(), "bytes": size}


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_atomically(path: Path, text: str) -> None:
    """All of `text` in `path`, or the file as it was."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write_durably(tmp, text.encode())
        os.replace(tmp, path)  # atomic on POSIX: readers see the old or the new file, never half
    except BaseException:
        tmp.unlink(missing_ok=True)  # (a full disk: no half-written copy left behind, taking space)
        raise
    fsync_dir(path.parent)


# ----------------------------------------------------------------------------- safetensors


# The layout is at the top of this file. The dtypes this code writes and reads, by their safetensors names:
SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64}


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, without a copy when it is contiguous."""
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> dict:
    """Write CPU tensors as one safetensors file, durably; returns its sha256 and size."""
    names = {v: k for k, v in SAFETENSORS_DTYPES.items()}
    header, offset = {"__metadata__": {"format": "pt", **(metadata or {})}}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)  # keep the data 8-byte aligned
    pieces = (_raw(t.cpu()) for t in tensors.values())
    return write_chunks(path, [len(head).to_bytes(8, "little") + head, *pieces])


def _safetensors_header(raw: np.ndarray, path: Path) -> tuple[int, dict]:
    n = int.from_bytes(raw[:8].tobytes(), "little") if raw.size >= 8 else -1
    try:
        if not 0 < n <= raw.size - 8:
            raise ValueError("bad header length")
        return n, json.loads(raw[8:8 + n].tobytes())
    except ValueError:
        raise CheckpointError(f"{path}: not a safetensors file (unreadable header)") from None


def map_file(path: Path) -> np.ndarray:
    """The bytes of a file, memory-mapped: read from disk only when used, and still readable after the
    file is deleted (the mapping holds it), so a reader that has mapped a checkpoint keeps it."""
    if Path(path).stat().st_size == 0:
        return np.zeros(0, dtype=np.uint8)  # mmap cannot map zero bytes
    return np.memmap(path, dtype=np.uint8, mode="c")  # copy-on-write: torch wants writable memory


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Tensors backed by a memory map of the file: nothing is read until it is used."""
    return safetensors_tensors(map_file(path), path)


def safetensors_tensors(raw: np.ndarray, path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a mapped safetensors file (`path` names it in errors)."""
    n, header = _safetensors_header(raw, path)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has dtype {info['dtype']}, which this code does not read")
        a, z = info["data_offsets"]
        buf = raw[8 + n + a:8 + n + z]
        dtype = SAFETENSORS_DTYPES[info["dtype"]]
        out[name] = (torch.frombuffer(buf, dtype=dtype) if z > a else torch.empty(0, dtype=dtype)).view(info["shape"])
    return out


def safetensors_metadata(path: Path, raw: np.ndarray | None = None) -> dict[str, str]:
    """The metadata of a safetensors file (from `raw`, its bytes, when they are mapped already)."""
    raw = map_file(path) if raw is None else raw
    return _safetensors_header(raw, path)[1].get("__metadata__", {})


# ----------------------------------------------------------------------------- the manifest


def _canonical(d: dict) -> bytes:
    return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()


def seal(body: dict) -> dict:
    """The manifest with the sha256 of everything else in it."""
    return {**body, "sha256": sha256_bytes(_canonical(body))}


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise CorruptCheckpoint(f"manifest.json: {what}")


def _is_int(x, lo: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= lo


def _is_shape(x) -> bool:
    return isinstance(x, list) and all(_is_int(n) for n in x)


def check_schema(m: dict) -> None:
    """Every field a reader relies on is there and has the right type, so that well-formed JSON of
    the wrong shape fails here, with a name, not later as a KeyError."""
    _need(m.get("format") == FORMAT and m.get("version") == VERSION, f"not a {FORMAT} v{VERSION} manifest")
    for key, kind in (("run", str), ("meta", dict), ("layout", dict), ("files", dict), ("tensors", list)):
        _need(isinstance(m.get(key), kind), f"field {key!r} is missing or not a {kind.__name__}")
    _need(_is_int(m.get("step")), "field 'step' is missing or not a non-negative integer")
    _need(all(_is_int(m["layout"].get(k), 1) for k in ("dp", "tp", "pp")), "layout needs dp, tp, pp >= 1")
    for name, f in m["files"].items():
        _need(re.fullmatch(r"rank\d{5}\.safetensors", name) is not None, f"unexpected file name {name!r}")
        _need(isinstance(f, dict) and isinstance(f.get("sha256"), str) and re.fullmatch(r"[0-9a-f]{64}", f["sha256"])
              is not None and _is_int(f.get("bytes")), f"file {name}: needs a sha256 and a size")
    keys = set()
    for i, e in enumerate(m["tensors"]):
        where = f"tensors[{i}]"
        _need(isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("key"), str),
              f"{where}: needs a name and a key")
        _need(e.get("file") in m["files"], f"{where}: file {e.get('file')!r} is not in the files table")
        _need((e["file"], e["key"]) not in keys, f"{where}: key {e['key']!r} appears twice in {e['file']}")
        keys.add((e["file"], e["key"]))
        _need(e.get("dtype") in {"float32", "float16", "bfloat16"}, f"{where}: dtype {e.get('dtype')!r}")
        _need(_is_shape(e.get("local_shape")) and _is_shape(e.get("full_shape")), f"{where}: shapes")
        s = e.get("shard")
        groups = s.get("groups") if isinstance(s, dict) else None  # a count of equal blocks, or their sizes (GQA)
        _need(s is None or (isinstance(s, dict) and all(_is_int(s.get(k)) for k in ("dim", "index", "count"))
                            and (_is_int(groups) or (isinstance(groups, list) and groups and all(map(_is_int, groups))))
                            and s["index"] < s["count"] and s["dim"] < len(e["local_shape"])), f"{where}: shard")
        f = e.get("flat")
        _need(f is None or (isinstance(f, list) and len(f) == 2 and all(_is_int(x) for x in f) and f[0] < f[1]),
              f"{where}: flat range")


def read_manifest(path: Path) -> dict:
    """The manifest, after checking its own sha256 and its schema."""
    try:
        manifest = json.loads((path / "manifest.json").read_bytes())
    except (OSError, ValueError) as e:
        raise CorruptCheckpoint(f"{path}: no readable manifest.json ({e.__class__.__name__})") from None
    if not isinstance(manifest, dict):
        raise CorruptCheckpoint(f"{path}: manifest.json is not a JSON object")
    if manifest.get("format") == FORMAT and manifest.get("version") != VERSION:
        raise CorruptCheckpoint(f"{path}: written in checkpoint format v{manifest.get('version')}, this code reads "
                                f"v{VERSION}; start a new run with --fresh")
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    if manifest.get("sha256") != sha256_bytes(_canonical(body)):
        raise CorruptCheckpoint(f"{path}: manifest.json does not match its own sha256 (corrupted or edited)")
    try:
        check_schema(manifest)
    except CorruptCheckpoint as e:
        raise CorruptCheckpoint(f"{path}: {e}") from None
    return manifest


def verify_file(path: Path, want: dict) -> None:
    if not path.is_file():
        raise CorruptCheckpoint(f"{path} is missing")
    check_bytes(*sha256_file(path), want, path)


def verify_mapped(raw: np.ndarray, want: dict, path: Path) -> None:
    """verify_file for bytes already mapped (map_file): what is checked is what will be read."""
    check_bytes(sha256_bytes(memoryview(raw)), raw.size, want, path)


def check_bytes(digest: str, size: int, want: dict, path: Path) -> None:
    if size != want["bytes"]:
        raise CorruptCheckpoint(f"{path} has {size} bytes, the manifest says {want['bytes']} (truncated?)")
    if digest != want["sha256"]:
        raise CorruptCheckpoint(f"{path} does not match its sha256 in the manifest (corrupted)")


def verify(path: Path) -> dict:
    """Check the manifest, then every file against its size and sha256; return the manifest (what a
    script needs; a reader that then reads the files pins them instead, checkpoint.pin)."""
    manifest = read_manifest(path)
    for name, want in manifest["files"].items():
        verify_file(path / name, want)
    return manifest


# ----------------------------------------------------------------------------- 4. checkpoint directories
#
# A checkpoint is a directory, and it appears and goes away whole. It is written as .tmp-step_N/, every
# rank's files in it; rank 0 then writes the manifest, renames the directory to step_N/ and only then moves
# `latest`. Cleanup renames a checkpoint out of sight (.del-step_N/) before deleting it, and touches only
# the run's own: a directory named exactly step_N whose manifest names the run.

STEP_DIR = re.compile(r"step_\d{8}")


def prepare(ckpt_dir: Path, tmp: Path, run: str) -> None:
    """Before every rank writes (rank 0): an empty temporary directory, and no leftovers. A crash mid-save
    leaves a .tmp- directory; a run that fell back from a corrupt checkpoint reaches its step again and
    replaces it (removed here, before the ranks agree to save, so no rank mistakes the old directory for
    the new commit). The run holds the lock on its --out: nobody else writes here."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    clear_leftovers(ckpt_dir)
    make_way(ckpt_dir / tmp.name.removeprefix(".tmp-"), run)
    tmp.mkdir()


def clear_leftovers(ckpt_dir: Path) -> None:
    """Remove what saves and cleanups that did not finish left: .tmp-step_N/ (a save killed, or cut off by a
    full disk, half way) and .del-step_N/ (a deletion killed half way). Before every save, and when a run
    starts (rundir.Lock), before it writes anything: on a full disk they hold the space the run needs. Only
    directories: a file of such a name is no save's, and stays (a save that needs the name says so)."""
    for stale in [*Path(ckpt_dir).glob(".tmp-step_*"), *Path(ckpt_dir).glob(".del-step_*")]:
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale)


def commit(tmp: Path, final: Path, manifest: dict, ranks: int, timeout_s: float, keep: int) -> None:
    """Rank 0, once its own files are written: wait for every rank's description (rank00000.json, ...),
    seal the manifest (`manifest` plus every rank's "files" and "tensors"), rename the directory into
    place, move `latest` to it, and delete the run's checkpoints beyond the newest `keep`."""
    parts = [tmp / f"rank{r:05d}.json" for r in range(ranks)]
    wait_for(lambda: all(p.exists() for p in parts), f"every rank's shard of step {manifest['step']}", timeout_s)
    manifest = {**manifest, "files": {}, "tensors": []}
    for p in parts:
        info = json.loads(p.read_text())
        manifest["files"].update(info["files"])
        manifest["tensors"] += info["tensors"]
    write_durably(tmp / "manifest.json", json.dumps(seal(manifest), indent=1).encode())
    fsync_dir(tmp)
    make_way(final, manifest["run"])
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if (final.parent / "latest").is_dir():  # junk where the pointer goes (it was reported when read)
        shutil.rmtree(final.parent / "latest")
    replace_atomically(final.parent / "latest", final.name)
    prune(final, manifest["run"], keep)


def prune(newest: Path, run: str, keep: int) -> None:
    """Delete run `run`'s oldest checkpoints beyond `keep`, only now that a newer one exists. Only the
    run's own count and go: another run's checkpoint copied in, a user's step_00000015.bak, one whose
    manifest is damaged are never counted, never deleted."""
    own = [p for p in sorted(newest.parent.glob("step_*"))  # the newest is ours: it was just written
           if p == newest or (STEP_DIR.fullmatch(p.name) and owned_by(p, run))]
    for old in own[:-keep]:
        if old != newest:
            delete(old)


def owned_by(path: Path, run: str) -> bool:
    try:
        return read_manifest(path)["run"] == run
    except CheckpointError:
        return False


def delete(path: Path) -> None:
    """Out of sight in one step (a rename: readers see the whole checkpoint or none of it), then removed.
    A reader that pinned it (`pin`) goes on reading the files it mapped."""
    doomed = path.with_name(f".del-{path.name}")
    shutil.rmtree(doomed, ignore_errors=True)
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def make_way(final: Path, run: str) -> None:
    """Before step N is written where a step_N is: the run's own (a rollback replays its steps) is deleted;
    anything else is moved aside to step_N.moved-aside-<time>, never deleted."""
    if final.is_dir() and owned_by(final, run):
        delete(final)
    elif final.exists():
        os.rename(final, final.with_name(f"{final.name}.moved-aside-{time.time_ns()}"))


def wait_for(ready, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise CheckpointError(f"timed out after {timeout_s:.0f}s (--timeout) waiting for {what}")
        time.sleep(0.01)


# Reading while a run writes (sample.py on a training run's --out): a reader pins what it reads.


def candidates(ckpt_dir: Path, log=print) -> list[Path]:
    """Checkpoint directories to try, best first: the one `latest` names, then every step_*
    directory, newest first. An unreadable `latest` is reported and passed over. A listing taken while
    a run commits a step and deletes an older one can name only the deleted one; `latest`, read after
    it, then names a directory the listing missed, and the directory is listed again."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    for _ in range(PIN_TRIES):
        found = sorted((p for p in ckpt_dir.glob("step_*") if STEP_DIR.fullmatch(p.name) and p.is_dir()),
                       reverse=True)
        name = _pointer(ckpt_dir, log)
        if name is None or ckpt_dir / name in found or not (ckpt_dir / name).is_dir():
            break
    if name is not None and (ckpt_dir / name) in found:
        found = [ckpt_dir / name] + [p for p in found if p.name != name]
    return found


def _pointer(ckpt_dir: Path, log=print) -> str | None:
    """The checkpoint `latest` names, or None (none, or unreadable: said)."""
    pointer = ckpt_dir / "latest"
    try:
        name = pointer.read_text().strip() if pointer.exists() else None
    except (OSError, UnicodeDecodeError) as e:
        log(f"checkpoint pointer {pointer} is unreadable ({e.__class__.__name__}); trying every checkpoint")
        return None
    if name is not None and not STEP_DIR.fullmatch(name):
        log(f"checkpoint pointer {pointer} holds {name[:40]!r}, not a checkpoint name; trying every checkpoint")
        return None
    return name


class Vanished(CheckpointError):
    """Deleted or replaced while it was being opened (a running trainer's cleanup beyond --keep, or a
    rollback rewriting a step): nothing is wrong with it, so it is not reported as unusable; a reader
    lists the directory again."""


PIN_TRIES = 10  # listings a reader tries when the checkpoints keep vanishing under it


def pin(path: Path, names=None) -> tuple[dict, dict[str, np.ndarray]]:
    """Open a checkpoint for reading, and check all of it: (its manifest, its files mapped). The manifest
    first (its own sha256 and schema), then every file, mapped (`map_file`) and hashed in place, so that
    what was checked is what is read. A mapped file stays readable after it is deleted, so once pinned a
    checkpoint is read whole even if its run deletes it meanwhile. One that disappears or changes while it
    is being opened raises Vanished. `names`: only those files now (a reader pins the others as it needs
    them, `pin_file`: a resuming rank reads only the files that hold its part)."""
    path, manifest = Path(path), None
    try:
        manifest = read_manifest(path)
        raw = {name: _map(path / name) for name in (manifest["files"] if names is None else names)}
        for name in raw:
            verify_mapped(raw[name], manifest["files"][name], path / name)
    except CheckpointError:
        if not _unchanged(path, manifest):
            raise Vanished(f"{path} was deleted or replaced while it was being read") from None
        raise
    return manifest, raw


def pin_file(path: Path, manifest: dict, name: str) -> np.ndarray:
    """One more file of a checkpoint that `pin` opened (`manifest`), mapped and checked against that manifest."""
    try:
        raw = _map(path / name)
        verify_mapped(raw, manifest["files"][name], path / name)
        return raw
    except CheckpointError:
        if not _unchanged(path, manifest):
            raise Vanished(f"{path} was deleted or replaced while it was being read") from None
        raise


def _map(file: Path):
    try:
        return map_file(file)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{file} is missing") from None
    except OSError as e:
        raise CorruptCheckpoint(f"{file} is unreadable ({e.strerror or e})") from None


def _unchanged(path: Path, manifest: dict | None) -> bool:
    """Is the checkpoint at `path` still the one whose manifest was read (none read: is it still there)?"""
    if manifest is None:
        return path.is_dir()
    try:
        return read_manifest(path)["sha256"] == manifest["sha256"]
    except CheckpointError:
        return False


def newest(ckpt_dir: Path, log=print) -> tuple[Path, dict, dict] | None:
    """The newest checkpoint that verifies, pinned: (its path, manifest, mapped files); each unusable one is
    reported by name. When one vanishes while being opened (its run saves every step with --keep 1, say)
    the directory is listed again: a newer one is there."""
    for _ in range(PIN_TRIES):
        try:
            for path in candidates(ckpt_dir, log):
                try:
                    return (path, *pin(path))
                except CorruptCheckpoint as e:  # not Vanished: that one goes up, to list the directory again
                    log(f"checkpoint unusable, trying an older one: {e}")
            return None
        except Vanished:
            continue
    raise CheckpointError(f"the checkpoints in {ckpt_dir} were deleted or replaced {PIN_TRIES} times while being "
                          "opened (a run saving very often with a small --keep?); try again")
