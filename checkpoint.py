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

The write is atomic, and cleanup and readers cannot tear a checkpoint (support/storage.py): files go to
`.tmp-step_XXXXXXXX/`, hashed as they are written and fsynced; rank 0 waits for every rank's .json,
writes the manifest, renames the directory into place and only then moves `latest`, so a crash at any
instant leaves a complete one behind. The run deletes its own oldest checkpoints beyond --keep (only its
own: a manifest that names this run), renaming each out of sight first; a reader (sample.py on a running
run's --out) *pins* what it reads, mapping every file and checking the mapped bytes, so a cleanup cannot
pull a checkpoint from under it (`pin`, `newest`).

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
(atomic writes, safetensors, sha256, the manifest's seal and schema) is storage.py; what a checkpoint
holds, file by file, is `python -m instruments.checkpoints inspect`; a Hugging Face GPT-2 directory to
and from it, instruments/hf.py.
"""

import base64
import json
import math
import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from model import canonical_name
from shard import take_shard, unshard
from support import storage
from support.storage import CheckpointError, CorruptCheckpoint, Vanished  # raised by storage.py; caught as checkpoint.*
from zero import ZeroAdamW

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


@dataclass
class Write:
    """One save, from the copy of its tensors to its commit (what the writer thread is handed)."""
    step: int
    tmp: Path  # the .tmp- directory it is written into
    entries: dict  # key -> (tensor, description): tensor_entries
    host: dict  # key -> this rank's host copy of each tensor (and OPT_STEPS)
    copied: "torch.cuda.Event | None"  # on a GPU: when the copy into `host` is done
    rank_state: dict  # the run state and RNG states, for the file's header
    meta: dict  # what the manifest records (train.checkpoint_meta)
    crash_mid_save: bool  # fault injection
    t0: float  # when the save began
    record: dict = None  # {"step", "bytes", "write_s", "blocking_s"}: what the save cost, once done

    def __post_init__(self):
        self.record = {"step": self.step}


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
            self._fail_cleanly(step, storage.prepare, self.dir, tmp, self.run)
        if not grid.agree(not busy):  # (a collective: after rank 0 prepared the directory, before any write)
            return False
        self.wait()  # finished on this rank: surface its error, if it had one
        entries = tensor_entries(model, opt, grid)
        host = self._to_host({**{key: t for key, (t, _) in entries.items()}, OPT_STEPS: optimizer_steps(opt)})
        job = Write(step, tmp, entries, host, self.copied, {"extra": {**extra, "step": step},
                                                            "rng": rng_state(grid.device)}, meta, crash_mid_save, t0)
        self.writing = step
        if self.asynchronous:
            self.thread = threading.Thread(target=self._write_catching, args=(job,), name="ckpt-writer")
            self.thread.start()
        else:
            self._fail_cleanly(step, self._write, job)
        job.record["blocking_s"] = time.perf_counter() - t0  # what the training loop paid
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

    def _write_catching(self, job: "Write") -> None:
        try:
            self._fail_cleanly(job.step, self._write, job)
        except BaseException as e:  # surfaced by the next wait()
            self.error = e

    def _write(self, job: "Write") -> None:
        if job.copied is not None:
            job.copied.synchronize()  # releases the GIL while the GPU finishes the copy
        g, tmp, entries = self.grid, job.tmp, job.entries
        job.rank_state["extra"]["opt_step"] = int(job.host[OPT_STEPS])  # a host copy by now: no device wait
        fname = f"rank{g.rank:05d}.safetensors"
        tensors = {key: job.host[key] for key in entries}
        written = storage.write_safetensors(tmp / fname, tensors, {"nanoscale_state": json.dumps(job.rank_state)})
        info = {"files": {fname: written},
                "tensors": [{**d, "key": k, "file": fname, "full_shape": full_shape(d),
                             "dtype": str(tensors[k].dtype).removeprefix("torch.")} for k, (_, d) in entries.items()]}
        if job.crash_mid_save:  # fault injection: die between the data file and its description
            os.kill(os.getpid(), signal.SIGKILL)
        # rank 0 polls for this file, so it appears whole or not at all
        storage.replace_atomically(tmp / f"rank{g.rank:05d}.json", json.dumps(info))
        final = self.dir / f"step_{job.step:08d}"
        if g.rank == 0:  # the manifest, the rename, `latest`, the cleanup beyond --keep
            storage.commit(tmp, final, {"format": storage.FORMAT, "version": storage.VERSION, "run": self.run,
                                        "step": job.step, "meta": job.meta, "layout": layout_of(g)},
                           g.world, self.timeout_s, self.keep)
        else:  # wait() means "complete" on every rank
            storage.wait_for(lambda: final.exists(), f"rank 0 to commit {final}", self.timeout_s)
        job.record.update(bytes=written["bytes"], write_s=time.perf_counter() - job.t0)
        self.last = job.record
        self.finished.append(job.record)

# ----------------------------------------------------------------------------- reading


def pin(path: Path) -> "Reader":
    """A checkpoint opened for reading, every byte checked first (storage.pin: what is checked is what is
    read, even if the run that wrote it deletes it meanwhile)."""
    return Reader(Path(path), *storage.pin(path))


def newest(ckpt_dir: Path, log=print) -> "Reader | None":
    """The newest checkpoint in ckpt_dir that verifies, pinned (storage.newest says which)."""
    found = storage.newest(ckpt_dir, log)
    return Reader(*found) if found else None


def latest(ckpt_dir: Path, log=print) -> Path | None:
    """The path of the newest checkpoint that verifies."""
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
        key = canonical_name(name, model.config.tied)
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


def restore(ckpt_dir: Path, model, opt, grid, meta: dict, run: str, log=print,
            allowed: tuple = ()) -> tuple[Path, dict, dict] | None:
    """Load the newest usable checkpoint of run `run` into the model and optimizer: (its path, its run
    state, its manifest), or None when the directory holds none. Unusable ones are reported and passed over, an
    incompatible one (`meta` differs, but for the `allowed` keys) stops the run, and when checkpoints
    exist but none is usable the run stops rather than silently starting again from step 0."""
    tried = storage.candidates(ckpt_dir, log)
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
        if grid.agree(ok):
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
