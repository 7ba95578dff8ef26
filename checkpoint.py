"""Checkpoints that lose nothing, and that nothing can silently corrupt.

A checkpoint is everything a run needs to continue as if it had never stopped: the weights, the
optimizer's moments, the loss scaler, the step (which fixes the learning rate), every RNG, the
data loader's position, the config and the tokenizer. Leave one out and a resumed run silently
differs: without the loader position it sees batches twice; without the RNG, dropout and
sampling change; without the scaler, fp16 starts over at a scale that overflows.

On disk, one directory per checkpoint, one file per rank, and a manifest:

    <out>/ckpt/
        step_00000200/
            rank00000.safetensors   this rank's tensors (its shards); its header also holds the
                                    rank's RNG states and run state (loader position, scaler, ...)
            rank00000.json          what that file holds: names, full shapes, slices, sha256
            manifest.json           every rank's entries + run id + metadata, and the sha256 of
                                    all of that (the manifest's own checksum); written last
        step_00000400/ ...
        latest                      "step_00000400", replaced atomically after the directory is complete

Nothing is trusted that is not checked. Every data file is listed in the manifest with its size and
sha256; the manifest carries the sha256 of its own contents and a schema check, so a flipped bit in
a tensor's name is caught like a flipped bit in its values. A checkpoint that fails any check is
"unusable", and the reader falls back to the previous one; a checkpoint that is fine but from a
different setup (another model, tokenizer, batch, precision) is "incompatible", and the run stops.
Each checkpoint records the id of the run that wrote it, and a run only ever resumes its own.

The write is atomic: files go to `.tmp-step_XXXXXXXX/`, are hashed as they are written and
fsynced; rank 0 waits for every rank's .json, writes the manifest, renames the directory into
place and only then moves `latest`. A crash at any instant leaves the previous checkpoint
intact and `latest` pointing at a complete one. Then the run deletes its own oldest checkpoints
beyond --keep, and only its own: a step_XXXXXXXX directory whose manifest names this run (a copy
of another run's checkpoint, a user's step_00000015.bak, are neither counted nor touched).

Reading while a run writes (sample.py on a training run's --out): a reader *pins* what it reads
(`pin`). It maps every file of the checkpoint, then checks the mapped bytes against the manifest;
a mapped file stays readable after it is deleted, so the run's cleanup cannot pull a checkpoint
from under a reader that has it. Cleanup renames a checkpoint out of sight before deleting it, so a
reader sees all of one or none; one that vanishes while being opened is not "unusable", the reader
lists the directory again and takes the newer one (`newest`).

Saving asynchronously costs the training loop only a copy. On a GPU: a device-to-host copy into
pinned buffers, issued on a side CUDA stream so that it overlaps the next forward and backward
(which only read the weights); the optimizer step, which writes them, first makes the GPU wait for
that copy (`Saver.fence`). Nothing of it is read on the host before then, not even the optimizer's
step count (a tensor, copied with the rest). A background thread then writes the file. Its heavy
parts, writing, hashing and fsync, release Python's GIL, so the training thread keeps launching
work meanwhile. When the disk is slower than --ckpt-every steps, a save finds the previous one
still being written: a periodic save is skipped, with one line, rather than stopping the loop to
wait (the final save waits); --keep counts the checkpoints that were written.

The format is sharded from day one: each tensor entry records which slice of the full tensor
the file holds (`shard`: split `dim` into `count` parts, optionally within `groups` blocks, keep
part `index`; `flat`: a range of the flattened slice, for ZeRO), so a checkpoint written by one
layout can be read by another. The data files are safetensors (a JSON header, then raw bytes), the
format Hugging Face uses, so any tool can open them. How each byte reaches the disk and is checked
(atomic writes, safetensors, sha256, the manifest's seal and schema) is storage.py; converting a
checkpoint to and from a Hugging Face GPT-2 directory is hf.py.
"""

import base64
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

import hf
import storage
from model import canonical_name
from shard import take_shard, unshard
from storage import CheckpointError, CorruptCheckpoint  # raised by storage.py's checks; caught as checkpoint.*
from zero import ZeroAdamW

STEP_DIR = re.compile(r"step_\d{8}")
OPT_STEPS = "optimizer steps"  # the host copy of optimizer_steps(opt), among a save's tensors (not written as one)


class IncompatibleCheckpoint(CheckpointError):
    """Intact, but written by a different setup: continuing from it would be a different run."""


# ----------------------------------------------------------------------------- what a rank saves


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def rng_state(device: torch.device) -> dict:
    """Every random stream this process draws from, as JSON: Python, NumPy, torch's CPU generator,
    and the generator of this process's GPU."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": random.getstate(), "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
            "torch": _b64(torch.get_rng_state()),
            "cuda": _b64(torch.cuda.get_rng_state(device)) if device.type == "cuda" else None}


def set_rng_state(state: dict, device: torch.device) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(_unb64(state["torch"]))
    if state["cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(_unb64(state["cuda"]), device)


def entry(t: torch.Tensor, name: str, p: torch.Tensor, flat: tuple[int, int] | None = None) -> tuple:
    """(tensor, description): `name` is the logical tensor, `shard` the tensor-parallel slice of the
    full tensor that p holds, `flat` a [start, stop) range of that slice's flattened elements
    (ZeRO-1 splits flat buffers, not dimensions)."""
    return t.detach(), {"name": name, "shard": getattr(p, "shard", None),
                        "flat": list(flat) if flat else None, "local_shape": list(p.shape)}


def tensor_entries(model: torch.nn.Module, opt, grid) -> dict[str, tuple]:
    """key -> (tensor, description) for everything this rank writes: its parameters, then AdamW's
    moments keyed by parameter name, so they can be resharded exactly like the parameter."""
    out = {}
    for name, p in model.named_parameters():
        if grid.owns(p) and not weights_sharded(opt):  # ZeRO-3: the fp32 masters below are the weights
            out[name] = entry(p, name, p)
    if isinstance(opt, ZeroAdamW):  # ZeRO: this rank's flat slices of the moments and master weights
        for name, p, kind, (a, z), t in opt.pieces(model):
            if grid.owns(p, replicated_over_dp=False):
                out[f"{name}::{kind}@{a}"] = entry(t, f"{name}::{kind}", p, (a, z))
        return out
    for name, p in model.named_parameters():
        state = opt.state.get(p)
        if state and grid.owns(p):
            for kind in ("exp_avg", "exp_avg_sq"):
                out[f"{name}::{kind}"] = entry(state[kind], f"{name}::{kind}", p)
    return out


def weights_sharded(opt) -> bool:
    """ZeRO-3: between steps no rank holds whole parameters, only its shard of the optimizer's."""
    return isinstance(opt, ZeroAdamW) and opt.stage == 3


def optimizer_steps(opt) -> torch.Tensor:
    """Updates the optimizer has made (AdamW's bias correction depends on it), as the tensor it keeps:
    read with the other tensors of a save, not on its own (on a GPU each read would wait for it)."""
    if isinstance(opt, ZeroAdamW):
        return opt.steps
    steps = next((s["step"] for s in opt.state.values() if "step" in s), None)  # every parameter's is the same
    return torch.zeros(()) if steps is None else steps


def full_shape(info: dict) -> list[int]:
    shape, spec = list(info["local_shape"]), info["shard"]
    if spec:
        shape[spec["dim"]] *= spec["count"]
    return shape


# ----------------------------------------------------------------------------- writing


class Saver:
    """Writes checkpoints, synchronously or from a background thread (`asynchronous`). Either way
    `save` returns once the state is copied (on a GPU: once the copy is *issued*; call `fence`
    before changing the weights), and `wait` returns once the checkpoint is complete.

    A background write still going when the next save comes is either not waited for, and that save
    is skipped (`skippable`: the periodic saves), or waited for (every other save: the final one).
    Every rank must make the same choice, so they agree on it in one small all-reduce, which also
    orders rank 0's preparation of the directory before anyone writes into it.

    Each finished save is described by a dict: its step, bytes, the seconds the training thread
    spent in `save` (`blocking_s`: the whole write when synchronous, the copy when not), and the
    seconds from the start of the save to the commit (`write_s`)."""

    def __init__(self, ckpt_dir: Path, keep: int, asynchronous: bool, grid, run: str,
                 timeout_s: float = 600.0):
        self.dir, self.keep, self.asynchronous, self.grid = Path(ckpt_dir), keep, asynchronous, grid
        self.run, self.timeout_s = run, timeout_s
        self.thread: threading.Thread | None = None
        self.writing: int | None = None  # the step the background thread is (or was last) writing
        self.error: BaseException | None = None
        self.host: dict[str, torch.Tensor] = {}  # reusable host copies, pinned on a GPU machine
        self.stream, self.copied = None, None  # the side stream of the copy, and its "done" event
        self.last: dict | None = None
        self.finished: list[dict] = []  # saves completed since the caller last looked (pop_finished)

    def save(self, step: int, model, opt, extra: dict, meta: dict, crash_mid_save: bool = False,
             skippable: bool = False) -> bool:
        """Save `step`; False if it was skipped instead (`skippable`, while a save is being written)."""
        t0 = time.perf_counter()
        busy = self.thread is not None and self.thread.is_alive()
        if not (busy and skippable):
            self.wait()  # the previous write must be done before its buffers are reused
            busy = False
        grid, tmp = self.grid, self.dir / f".tmp-step_{step:08d}"
        if grid.rank == 0 and not busy:
            self._fail_cleanly(step, self._prepare_tmp, tmp)
        if not agree(grid, not busy):  # (a collective: after rank 0 prepared the directory, before any write)
            return False
        self.wait()  # finished on this rank: surface its error, if it had one
        entries = tensor_entries(model, opt, grid)
        host = self._to_host({**{key: t for key, (t, _) in entries.items()}, OPT_STEPS: optimizer_steps(opt)})
        rank_state = {"extra": {**extra, "step": step}, "rng": rng_state(grid.device)}
        record = {"step": step}  # the writer adds the bytes and seconds, then appends it to `finished`
        args = (step, tmp, entries, host, self.copied, rank_state, meta, crash_mid_save, record, t0)
        self.writing = step
        if self.asynchronous:
            self.thread = threading.Thread(target=self._write_catching, args=args, name="ckpt-writer")
            self.thread.start()
        else:
            self._fail_cleanly(step, self._write, *args)
        record["blocking_s"] = time.perf_counter() - t0  # what the training loop paid
        return True

    def fence(self) -> None:
        """Before anything changes a tensor the last save copied (the optimizer step): make the GPU
        wait for the copy. The host does not wait."""
        if self.copied is not None:
            torch.cuda.current_stream().wait_event(self.copied)
            self.copied = None

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            err, self.error = self.error, None
            raise CheckpointError(f"the background checkpoint write failed: {err}") from err

    def pop_finished(self) -> list[dict]:
        done, self.finished = self.finished, []
        return done

    def _prepare_tmp(self, tmp: Path) -> None:
        """Rank 0, before every rank writes: an empty temporary directory, and no leftovers. A
        crash mid-save leaves a .tmp- directory; a run that fell back from a corrupt checkpoint
        reaches its step again and replaces it (removed here, before the ranks agree to save, so
        that no rank mistakes the old directory for the new commit)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in [*self.dir.glob(".tmp-step_*"), *self.dir.glob(".del-step_*")]:  # this process holds
            shutil.rmtree(stale)  # the lock on --out: nobody else writes
        self._make_way(self.dir / tmp.name.removeprefix(".tmp-"))
        tmp.mkdir()

    def _fail_cleanly(self, step: int, fn, *args) -> None:
        """A full disk or a read-only directory becomes one CheckpointError line."""
        try:
            fn(*args)
        except OSError as e:
            raise CheckpointError(f"could not write the checkpoint of step {step} in {self.dir}: "
                                  f"{e.strerror or e}") from e

    def _to_host(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy this rank's tensors into host buffers that are allocated once and reused. On a GPU
        the copies are only issued, on a side stream, and `self.copied` records when they finish."""
        on_gpu = self.grid.device.type == "cuda"
        host = {}
        for key, t in tensors.items():
            buf = self.host.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=on_gpu)  # pinned: truly asynchronous
            host[key] = buf
        self.host = host
        if not on_gpu:
            for key, t in tensors.items():
                host[key].copy_(t)
            self.copied = None
            return host
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.grid.device)
        self.stream.wait_stream(torch.cuda.current_stream())  # the weights as of now, after the last update
        with torch.cuda.stream(self.stream):
            for key, t in tensors.items():
                host[key].copy_(t, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record(self.stream)
        return host

    def _write_catching(self, step, *args) -> None:
        try:
            self._fail_cleanly(step, self._write, step, *args)
        except BaseException as e:  # surfaced by the next wait()
            self.error = e

    def _write(self, step, tmp, entries, host, copied, rank_state, meta, crash_mid_save, record, t0) -> None:
        if copied is not None:
            copied.synchronize()  # releases the GIL while the GPU finishes the copy
        g = self.grid
        rank_state["extra"]["opt_step"] = int(host[OPT_STEPS])  # a host copy by now: no wait for a device
        fname = f"rank{g.rank:05d}.safetensors"
        tensors = {key: host[key] for key in entries}
        written = storage.write_safetensors(tmp / fname, tensors, {"nanoscale_state": json.dumps(rank_state)})
        info = {"files": {fname: written},
                "tensors": [{**d, "key": k, "file": fname, "full_shape": full_shape(d),
                             "dtype": str(tensors[k].dtype).removeprefix("torch.")} for k, (_, d) in entries.items()]}
        if crash_mid_save:  # fault injection: die between the data file and its description
            os.kill(os.getpid(), signal.SIGKILL)
        # rank 0 polls for this file, so it appears whole or not at all
        storage.replace_atomically(tmp / f"rank{g.rank:05d}.json", json.dumps(info))
        final = self.dir / f"step_{step:08d}"
        if g.rank == 0:
            self._commit(step, tmp, final, meta)
        else:  # wait() means "complete" on every rank
            wait_for(lambda: final.exists(), f"rank 0 to commit {final}", self.timeout_s)
        record.update(bytes=written["bytes"], write_s=time.perf_counter() - t0)
        self.last = record
        self.finished.append(record)

    def _commit(self, step: int, tmp: Path, final: Path, meta: dict) -> None:
        g = self.grid
        parts = [tmp / f"rank{r:05d}.json" for r in range(g.world)]
        wait_for(lambda: all(p.exists() for p in parts), f"every rank's shard of step {step}", self.timeout_s)
        files, tensors = {}, []
        for p in parts:
            info = json.loads(p.read_text())
            files.update(info["files"])
            tensors += info["tensors"]
        manifest = storage.seal({"format": storage.FORMAT, "version": storage.VERSION, "run": self.run, "step": step,
                                 "meta": meta, "layout": layout_of(g), "files": files,
                                 "tensors": tensors})
        storage.write_durably(tmp / "manifest.json", json.dumps(manifest, indent=1).encode())
        storage.fsync_dir(tmp)
        self._make_way(final)
        os.rename(tmp, final)
        storage.fsync_dir(self.dir)
        if (self.dir / "latest").is_dir():  # junk where the pointer goes (it was reported when read)
            shutil.rmtree(self.dir / "latest")
        storage.replace_atomically(self.dir / "latest", final.name)
        self._prune(final)

    def _prune(self, newest: Path) -> None:
        """Delete this run's oldest checkpoints beyond --keep, only now that a newer one exists. Only this
        run's own count and go: a directory named exactly step_XXXXXXXX whose manifest (its own sha256
        checked) names this run. Another run's checkpoint copied in, a user's step_00000015.bak, one
        whose manifest is damaged: never counted, never deleted."""
        own = [p for p in sorted(self.dir.glob("step_*"))  # the newest is ours: it was just written
               if p == newest or (STEP_DIR.fullmatch(p.name) and self._owns(p))]
        for old in own[:-self.keep]:
            if old != newest:
                self._delete(old)

    def _owns(self, path: Path) -> bool:
        try:
            return storage.read_manifest(path)["run"] == self.run
        except CheckpointError:
            return False

    def _delete(self, path: Path) -> None:
        """Out of sight in one step (a rename: readers see the whole checkpoint or none of it), then
        removed. A reader that pinned it (`pin`) goes on reading the files it mapped."""
        doomed = self.dir / f".del-{path.name}"
        shutil.rmtree(doomed, ignore_errors=True)
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)

    def _make_way(self, final: Path) -> None:
        """Before step N is written where a step_N is: this run's own (a rollback replays its steps) is
        deleted; anything else is moved aside to step_N.moved-aside-<time>, never deleted."""
        if final.is_dir() and self._owns(final):
            self._delete(final)
        elif final.exists():
            os.rename(final, final.with_name(f"{final.name}.moved-aside-{time.time_ns()}"))


def wait_for(ready, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise CheckpointError(f"timed out after {timeout_s:.0f}s (--timeout) waiting for {what}")
        time.sleep(0.01)


# ----------------------------------------------------------------------------- reading


def candidates(ckpt_dir: Path, log=print) -> list[Path]:
    """Checkpoint directories to try, best first: the one `latest` names, then every step_*
    directory, newest first. An unreadable `latest` is reported and passed over."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = sorted((p for p in ckpt_dir.glob("step_*") if STEP_DIR.fullmatch(p.name) and p.is_dir()), reverse=True)
    pointer = ckpt_dir / "latest"
    try:
        name = pointer.read_text().strip() if pointer.exists() else None
    except (OSError, UnicodeDecodeError) as e:
        log(f"checkpoint pointer {pointer} is unreadable ({e.__class__.__name__}); trying every checkpoint")
        name = None
    if name is not None and not STEP_DIR.fullmatch(name):
        log(f"checkpoint pointer {pointer} holds {name[:40]!r}, not a checkpoint name; trying every checkpoint")
        name = None
    if name is not None and (ckpt_dir / name) in found:
        found = [ckpt_dir / name] + [p for p in found if p.name != name]
    return found


class Vanished(CheckpointError):
    """Deleted or replaced while it was being opened (a running trainer's cleanup beyond --keep, or a
    rollback rewriting a step): nothing is wrong with it, so it is not reported as unusable; a reader
    lists the directory again."""


PIN_TRIES = 10  # listings a reader tries when the checkpoints keep vanishing under it


def pin(path: Path) -> "Reader":
    """Open a checkpoint for reading, and check all of it: the manifest (its own sha256 and schema), then
    every file, mapped first (storage.map_file) and hashed in place, so that what was checked is what the
    Reader reads. A mapped file stays readable after it is deleted, so once pinned a checkpoint is read
    whole even if its run deletes it meanwhile. One that disappears or changes while it is being opened
    raises Vanished."""
    path, manifest = Path(path), None
    try:
        manifest = storage.read_manifest(path)
        raw = {name: _map(path / name) for name in manifest["files"]}
        for name, want in manifest["files"].items():
            storage.verify_mapped(raw[name], want, path / name)
    except CheckpointError:
        if not _unchanged(path, manifest):
            raise Vanished(f"{path} was deleted or replaced while it was being read") from None
        raise
    return Reader(path, manifest, raw)


def _map(file: Path):
    try:
        return storage.map_file(file)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{file} is missing") from None
    except OSError as e:
        raise CorruptCheckpoint(f"{file} is unreadable ({e.strerror or e})") from None


def _unchanged(path: Path, manifest: dict | None) -> bool:
    """Is the checkpoint at `path` still the one whose manifest was read (none read: is it still there)?"""
    if manifest is None:
        return path.is_dir()
    try:
        return storage.read_manifest(path)["sha256"] == manifest["sha256"]
    except CheckpointError:
        return False


def newest(ckpt_dir: Path, log=print) -> "Reader | None":
    """The newest checkpoint that verifies, pinned; each unusable one is reported by name. When one
    vanishes while being opened (its run saves every step with --keep 1, say) the directory is listed
    again: a newer one is there."""
    for _ in range(PIN_TRIES):
        try:
            return _first_usable(candidates(ckpt_dir, log), log)
        except Vanished:
            continue
    raise CheckpointError(f"the checkpoints in {ckpt_dir} were deleted or replaced {PIN_TRIES} times while being "
                          "opened (a run saving very often with a small --keep?); try again")


def _first_usable(paths: list[Path], log) -> "Reader | None":
    for path in paths:
        try:
            return pin(path)
        except CorruptCheckpoint as e:  # not Vanished: that one goes up, to list the directory again
            log(f"checkpoint unusable, trying an older one: {e}")
    return None


def latest(ckpt_dir: Path, log=print) -> Path | None:
    """The path of the newest checkpoint that verifies (`newest`)."""
    reader = newest(ckpt_dir, log)
    return reader.path if reader else None


def check_compatible(manifest: dict, meta: dict, path: Path, allowed: tuple = ()) -> None:
    """Refuse a checkpoint whose math differs from this run's: every key of `meta` but "config" and the
    `allowed` ones must match (train.py puts there the model, the tokenizer, the data and its sha256, and
    the batch math). A key the checkpoint does not have (written before it was recorded) is not compared."""
    saved = manifest["meta"]
    differ = [key for key, value in meta.items() if key != "config" and key not in allowed and key in saved
              and saved[key] != value]
    if differ:
        diffs = "; ".join(f"{key}: checkpoint has {saved[key]}, this run has {meta[key]}" for key in differ)
        also = ", or pass --new-data to go on with this data on purpose" if any(k.startswith("data") for k in differ) \
            else ""
        raise IncompatibleCheckpoint(f"{path} is from an incompatible run ({diffs}); resume with the same "
                                     f"settings{also}, point --out elsewhere, or pass --fresh to start over")


class Reader:
    """Full tensors by logical name, reassembled from whatever layout wrote them, from the mapped files
    of a pinned checkpoint (`pin`)."""

    def __init__(self, path: Path, manifest: dict, raw: dict):
        self.path, self.manifest, self.raw = path, manifest, raw
        self.files = {name: storage.safetensors_tensors(raw[name], path / name) for name in manifest["files"]}
        self.entries = {}
        for e in manifest["tensors"]:
            self.entries.setdefault(e["name"], []).append(e)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def rank_state(self, rank: int) -> dict | None:
        """The run state and RNG states rank `rank` saved (in its file's header)."""
        name = f"rank{rank:05d}.safetensors"
        if name not in self.manifest["files"]:
            return None
        try:
            return json.loads(storage.safetensors_metadata(self.path / name, self.raw[name])["nanoscale_state"])
        except (KeyError, ValueError):
            raise CorruptCheckpoint(f"{self.path / name}: no run state in its header") from None

    def full(self, name: str) -> torch.Tensor:
        """Concatenate each tensor-parallel slice's flat pieces, then join the slices."""
        if name not in self.entries:
            raise CorruptCheckpoint(f"{self.path}: tensor {name} is not in the checkpoint")
        slices = {}
        for e in self.entries[name]:
            slices.setdefault(e["shard"]["index"] if e["shard"] else 0, []).append(e)
        local = [self.local_slice(name, slices[i]) for i in sorted(slices)]
        spec = self.entries[name][0]["shard"]
        if spec is not None and len(local) != spec["count"]:
            raise CorruptCheckpoint(f"{name}: {len(local)} of {spec['count']} tensor-parallel slices present")
        return local[0] if spec is None else unshard(local, spec)

    def stored(self, e: dict) -> torch.Tensor:
        t = self.files[e["file"]].get(e["key"])
        if t is None or list(t.shape) != (e["local_shape"] if e["flat"] is None else [e["flat"][1] - e["flat"][0]]):
            raise CorruptCheckpoint(f"{self.path / e['file']}: {e['key']} is missing or not the shape in the manifest")
        return t

    def local_slice(self, name: str, parts: list[dict]) -> torch.Tensor:
        if parts[0]["flat"] is None:
            return self.stored(parts[0])
        parts = sorted(parts, key=lambda e: e["flat"][0])
        numel, pos = math.prod(parts[0]["local_shape"]), 0
        for e in parts:
            if e["flat"][0] != pos:
                raise CorruptCheckpoint(f"{name}: flat pieces leave a gap at element {pos}")
            pos = e["flat"][1]
        if pos != numel:
            raise CorruptCheckpoint(f"{name}: flat pieces cover {pos} of {numel} elements")
        return torch.cat([self.stored(e) for e in parts]).view(parts[0]["local_shape"])


def load(reader: Reader, model, opt, grid) -> dict:
    """Load a pinned checkpoint into this rank's model and optimizer; return the run state ('extra', with
    'step'). Every tensor is rebuilt whole, then cut to this rank's slice, so any layout reads any
    other's checkpoint. Everything is read and checked before anything is changed: a checkpoint
    that turns out to be unusable leaves the model as it was."""
    path, manifest = reader.path, reader.manifest
    state0 = reader.rank_state(0)
    if state0 is None:
        raise CorruptCheckpoint(f"{path}: rank 0's file is not in the manifest")
    params = dict(model.named_parameters())
    values, moments = {}, {}  # this rank's slices, on the CPU until everything has been read
    for name, p in params.items():
        key = canonical_name(name)
        master = f"{key}::master"  # ZeRO under bf16 keeps fp32 masters: the better copy of the weights
        values[name] = local_part(reader.full(master if master in reader else key), p, device="cpu")
        for kind in ("exp_avg", "exp_avg_sq", "master"):
            if f"{key}::{kind}" in reader:
                moments[name, kind] = local_part(reader.full(f"{key}::{kind}"), p, torch.float32, "cpu")
    mine = reader.rank_state(grid.rank) if manifest["layout"] == layout_of(grid) else None
    for name in params:  # ZeRO's masters start from the weights when the checkpoint kept none
        moments.setdefault((name, "master"), values[name].float())
    with torch.no_grad():  # now change things
        for name, p in params.items():
            if not weights_sharded(opt):  # ZeRO-3 rebuilds its weight shards from the masters
                p.copy_(values[name])
    load_optimizer(opt, model, moments, state0["extra"]["opt_step"])
    if mine is not None:  # same layout: this rank continues its own random streams exactly
        set_rng_state(mine["rng"], grid.device)
    return state0["extra"]


def load_optimizer(opt, model, moments: dict, steps: int) -> None:
    """AdamW's state from per-parameter moments. torch's own load_state_dict puts each piece on the
    device and in the dtype this optimizer needs (fused AdamW wants its step count on the GPU)."""
    if isinstance(opt, ZeroAdamW):  # ZeRO: cut the full moments into this rank's flat shards
        opt.load_pieces(model, lambda name, p, kind: moments.get((name, kind)), steps)
        return
    index = {id(p): i for i, p in enumerate(p for group in opt.param_groups for p in group["params"])}
    state = {index[id(p)]: {"step": torch.tensor(float(steps)), "exp_avg": moments[name, "exp_avg"],
                            "exp_avg_sq": moments[name, "exp_avg_sq"]}
             for name, p in model.named_parameters() if (name, "exp_avg") in moments and id(p) in index}
    opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})


def agree(grid, ok: bool) -> bool:
    """True when every rank says ok: all ranks must pick the same checkpoint."""
    if grid.world == 1:
        return ok
    flag = torch.tensor([0.0 if ok else 1.0], device=grid.device)
    grid.all_reduce(flag, "world")
    return flag.item() == 0


def restore(ckpt_dir: Path, model, opt, grid, meta: dict, run: str, log=print,
            allowed: tuple = ()) -> tuple[Path, dict, dict] | None:
    """Load the newest usable checkpoint of run `run` into the model and optimizer: (its path, its run
    state, its manifest), or None when the directory holds none. Unusable ones are reported and passed over, an
    incompatible one (`meta` differs, but for the `allowed` keys) stops the run, and when checkpoints
    exist but none is usable the run stops rather than silently starting again from step 0."""
    tried = candidates(ckpt_dir, log)
    for path in tried:
        try:
            reader = pin(path)  # this run holds --out's lock: nothing deletes it meanwhile
            manifest = reader.manifest
            if manifest["run"] != run:
                raise CorruptCheckpoint(f"{path} was written by another run ({manifest['run']}; this is {run})")
            check_compatible(manifest, meta, path, allowed)
            extra, ok = load(reader, model, opt, grid), True
        except (CorruptCheckpoint, Vanished) as e:
            log(f"checkpoint unusable, trying an older one: {e}")
            ok = False
        if agree(grid, ok):
            return path, extra, manifest
    if not tried:
        return None
    raise CheckpointError(f"no usable checkpoint of this run in {ckpt_dir} ({len(tried)} tried, see above): repair "
                          "or remove them, or pass --fresh to start a new run (this one is moved aside)")


def consolidate(source: "Path | Reader") -> dict[str, torch.Tensor]:
    """The full model's parameters from a checkpoint of any layout (fp32 master weights when the
    run kept them): a checkpoint directory, or a Reader that `pin` or `newest` returned."""
    reader = source if isinstance(source, Reader) else pin(Path(source))
    names = dict.fromkeys(n.split("::")[0] for n in reader.entries)  # ZeRO-3 saves only the masters
    return {n: reader.full(f"{n}::master" if f"{n}::master" in reader else n).float() for n in names}


def layout_of(grid) -> dict:
    cp = {"cp": grid.cp} if grid.cp > 1 else {}  # absent at 1: checkpoints from before cp compare equal
    return {"dp": grid.dp, "tp": grid.tp, "pp": grid.pp, **cp}


def local_part(full: torch.Tensor, p: torch.Tensor, dtype: torch.dtype | None = None,
               device: str | torch.device | None = None) -> torch.Tensor:
    """The slice of `full` that parameter p holds on this rank (p.shard says which), on p's device
    unless another is given."""
    part = take_shard(full, getattr(p, "shard", None))
    if part.shape != p.shape:
        raise CorruptCheckpoint(f"checkpoint tensor of shape {tuple(part.shape)} does not fit a parameter "
                                f"of shape {tuple(p.shape)}")
    return part.to(device=device or p.device, dtype=dtype or p.dtype)


# ----------------------------------------------------------------------------- command line


def inspect(path: Path) -> tuple[str, bool]:
    """A report of a checkpoint: the manifest's own check, every file's check, every tensor; and
    whether all of it verified."""
    try:
        manifest = storage.read_manifest(path)
    except CorruptCheckpoint as e:
        return f"{path}: BROKEN manifest: {e}", False
    broken = []
    lines = [f"{path}: step {manifest['step']} of run {manifest['run']}, layout {manifest['layout']}",
             f"tokenizer {manifest['meta'].get('tokenizer')}, model {manifest['meta'].get('model')}", "",
             f"  manifest.json     ok: its own sha256 {manifest['sha256'][:16]}... and schema check"]
    for name, info in manifest["files"].items():
        try:
            storage.verify_file(path / name, info)
            status = f"ok: sha256 {info['sha256'][:16]}..."
        except CorruptCheckpoint as e:
            broken.append(name)
            status = f"BROKEN: {e}"
        lines.append(f"  {name:<22} {info['bytes'] / 1e6:9.2f} MB  {status}")
    lines.append(f"  all {len(manifest['files'])} files verified" if not broken else
                 f"  {len(broken)} of {len(manifest['files'])} files BROKEN: {', '.join(broken)}")
    lines.append("")
    lines.append(f"  {'tensor':<44} {'full shape':<16} {'dtype':<9} {'file':<22} slice")
    for e in manifest["tensors"]:
        spec = e["shard"]
        where = "whole" if spec is None else f"dim {spec['dim']} part {spec['index'] + 1}/{spec['count']}"
        if e["flat"]:
            where += f", elements [{e['flat'][0]}, {e['flat'][1]})"
        lines.append(f"  {e['name']:<44} {str(tuple(e['full_shape'])):<16} {e['dtype']:<9} {e['file']:<22} {where}")
    return "\n".join(lines), not broken


def main(argv=None) -> None:
    import argparse
    p = argparse.ArgumentParser(description="Inspect, consolidate and export nanoscale checkpoints.")
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("inspect", help="verify a checkpoint (manifest and files) and print what it holds")
    sp.add_argument("path", help="a step_XXXXXXXX directory, or a ckpt/ directory (uses latest)")
    sp = sub.add_parser("consolidate", help="write the full model (any layout) to one torch file")
    sp.add_argument("path", help="a step_XXXXXXXX directory, or a ckpt/ directory (uses latest)")
    sp.add_argument("file", help="output .pt file: {parameter name: full fp32 tensor}")
    sp = sub.add_parser("export-hf", help="write a Hugging Face GPT2LMHeadModel directory")
    sp.add_argument("path", help="a step_XXXXXXXX directory, or a ckpt/ directory (uses latest)")
    sp.add_argument("dir", help="output directory (config.json + model.safetensors)")
    args = p.parse_args(argv)
    try:
        path = find_checkpoint(args.path)
        if args.cmd == "inspect":
            text, ok = inspect(path)
            print(text)
            if not ok:
                raise CorruptCheckpoint(f"{path} is unusable (see above)")
        elif args.cmd == "consolidate":
            weights = consolidate(path)
            torch.save(weights, args.file)
            print(f"wrote {len(weights)} tensors ({sum(t.numel() for t in weights.values()):,} parameters) "
                  f"from {path} to {args.file}")
        else:
            reader = pin(path)
            hf.export_hf(consolidate(reader), reader.manifest, Path(args.dir))
            print(f"wrote a Hugging Face GPT-2 model from {path} to {args.dir}")
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or the one `latest` points to in a ckpt/ directory."""
    path = Path(path)
    if (path / "latest").is_file():
        try:
            return path / (path / "latest").read_text().strip()
        except (OSError, UnicodeDecodeError):
            raise CheckpointError(f"{path / 'latest'} is unreadable; name a step_XXXXXXXX directory instead") from None
    if not (path / "manifest.json").exists():
        raise CheckpointError(f"{path} is neither a checkpoint nor a ckpt/ directory with a `latest` pointer")
    return path


if __name__ == "__main__":
    main()
