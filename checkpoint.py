"""Checkpoints that lose nothing, and that nothing can silently corrupt.

A checkpoint is everything a run needs to continue as if it had never stopped: the weights, the
optimizer's moments, the loss scaler, the step (which fixes the learning rate), every RNG, the
data loader's position, the config and the tokenizer. Leave one out and a resumed run silently
differs: without the loader position it sees batches twice; without the RNG, whatever draws from
it changes (dropout does not: its masks are keyed by step and place, dropout.py); without the
scaler, fp16 starts over at a scale that overflows.

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

A resuming rank reads its own part, not the world's (`load`): under ZeRO its data-parallel piece
of each optimizer tensor (and at stage 3 nothing more of the weights), so what it maps, hashes and
holds shrinks with dp. Every byte used is still checked, by the rank that uses it: a file is hashed
whole where it is mapped, the first time anything of it is read, and the ranks go on only when every
one of them found every file it read intact (one all-reduce, `restore`).

Saving costs the training loop only a copy: support/writer.py's `Saver` copies this rank's tensors
to the host (on a GPU, on a side stream, fenced before the next update) and writes them, from a
background thread with --async-ckpt.

Above the disk, a tier in host memory (--mem-ckpt-every; support/memory.py keeps the bytes and sends
a copy to another node): every few steps each rank snapshots every tensor it holds, those its peers
hold alike too (`tensor_entries(every_copy=True)`: a restart reads nothing from the others), and
`restore` takes the snapshot first where it is as new as the disk's; it is valid at the layout and
rank that wrote it, so it goes back without resharding (`from_memory`).

The format is sharded from day one: each tensor entry records which slice of the full tensor
the file holds (`shard`: split `dim` into `count` parts, optionally within `groups` blocks, keep
part `index`; `flat`: a range of the flattened slice, for ZeRO), so a checkpoint written by one
layout can be read by another. The data files are safetensors (a JSON header, then raw bytes), the
format Hugging Face uses, so any tool can open them. How each byte reaches the disk and is checked
(atomic writes, safetensors, sha256, the manifest's seal and schema) is storage.py; what a checkpoint
holds, file by file, is `python -m instruments.checkpoints inspect`; a Hugging Face GPT-2 directory to
and from it, instruments/hf.py.
"""

import json
import math
import time
from pathlib import Path

import torch

import fp8
from model import canonical_name
from parallel import placement
from shard import take_shard, unshard
from support import storage
from support.storage import CheckpointError, CorruptCheckpoint  # (raised there; checkpoint.* here)
from support.writer import layout_of, set_rng_state
from zero import ZeroAdamW


class IncompatibleCheckpoint(CheckpointError):
    """Intact, but written by a different setup: continuing from it would be a different run."""


# ----------------------------------------------------------------------------- what a rank saves


def entry(t: torch.Tensor, name: str, p: torch.Tensor, flat: tuple[int, int] | None = None) -> tuple:
    """(tensor, description): `name` is the logical tensor, `shard` the tensor-parallel slice of the
    full tensor that p holds, `flat` a [start, stop) range of that slice's flattened elements
    (ZeRO-1 splits flat buffers, not dimensions)."""
    return t.detach(), {"name": name, "shard": placement(p).shard,
                        "flat": list(flat) if flat else None, "local_shape": list(p.shape)}


def tensor_entries(model: torch.nn.Module, opt, grid, every_copy: bool = False) -> dict[str, tuple]:
    """key -> (tensor, description) for everything this rank writes: its parameters, then AdamW's
    moments keyed by parameter name, so they can be resharded exactly like the parameter. Of a
    tensor that several ranks hold alike, one rank's copy, unless `every_copy` (a memory
    snapshot: each rank keeps all it holds, to restore without the others)."""
    out, owns = {}, (lambda p, **_: True) if every_copy else grid.owns
    for name, p in model.named_parameters():
        if owns(p) and not weights_sharded(opt):  # ZeRO-3: the fp32 masters below are the weights
            out[name] = entry(p, name, p)
    if every_copy or grid.tp_rank == 0 and grid.dp_cp_rank == 0:  # fp8's scales: alike there
        for key, t in fp8.checkpoint_tensors(fp8.states(model)).items():
            out[key] = entry(t, key, t)
    if isinstance(opt, ZeroAdamW):  # ZeRO: this rank's flat slices of the moments and master weights
        for name, p, kind, (a, z), t in opt.pieces(model):
            if owns(p, replicated_over_dp=False):
                out[f"{name}::{kind}@{a}"] = entry(t, f"{name}::{kind}", p, (a, z))
        return out
    for name, p in model.named_parameters():
        state = opt.state.get(p)
        if state and owns(p):
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


# ----------------------------------------------------------------------------- reading


def pin(path: Path, lazily: bool = False) -> "Reader":
    """A checkpoint opened for reading, every byte checked before it is read (storage.pin: what
    is checked is what is read, even if the run that wrote it deletes it meanwhile). Every file at
    once; `lazily`, each when something of it is first read (a resuming rank reads its part's)."""
    return Reader(Path(path), *storage.pin(path, names=[] if lazily else None))


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


# What names the data a checkpoint was trained on (train.py's meta): a change is refused, or with --new-data said.
DATA = {"data": "--data", "data_sha256": "the prepared data's sha256"}


def data_changes(now: dict, saved: dict) -> list[str]:
    """--new-data: one line per way the data (`now`'s meta) differs from the checkpoint's (`saved`)."""
    return [f"resume: {what} {saved[key]} -> {now[key]}: --new-data goes on from the checkpoint's position in "
            "other data; the steps from here on are not the original run's"
            for key, what in DATA.items() if key in saved and saved[key] != now[key]]


class Reader:
    """Full tensors by logical name, reassembled from whatever layout wrote them, or the part of one
    that a parameter of this rank holds (`local`), from the mapped files of a pinned checkpoint
    (`pin`). A file not pinned yet is mapped and checked when something of it is first read."""

    def __init__(self, path: Path, manifest: dict, raw: dict):
        self.path, self.manifest, self.raw = path, manifest, raw  # raw: files mapped and checked
        self.tensors = {}  # file name -> its tensors (views of its mapped bytes)
        self.entries = {}
        for e in manifest["tensors"]:
            self.entries.setdefault(e["name"], []).append(e)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def mapped(self, name: str):
        """The bytes of file `name`, mapped and checked against the manifest when first needed."""
        if name not in self.raw:
            self.raw[name] = storage.pin_file(self.path, self.manifest, name)
        return self.raw[name]

    def file(self, name: str) -> dict[str, torch.Tensor]:
        if name not in self.tensors:
            self.tensors[name] = storage.safetensors_tensors(self.mapped(name), self.path / name)
        return self.tensors[name]

    def rank_state(self, rank: int) -> dict | None:
        """The run state and RNG states rank `rank` saved (in its file's header)."""
        name = f"rank{rank:05d}.safetensors"
        if name not in self.manifest["files"]:
            return None
        raw = self.mapped(name)  # (checked first: a damaged file is named as one)
        try:
            header = storage.safetensors_metadata(self.path / name, raw)
            return json.loads(header["nanoscale_state"])
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

    def local(self, name: str, p: torch.Tensor, span: tuple | None = None) -> torch.Tensor:
        """The slice of tensor `name` that parameter p holds on this rank (placement(p).shard says which),
        or elements [a, z) of it flattened (`span`: a ZeRO shard's piece of p). When the checkpoint
        holds that very slice (the same tensor-parallel cut), only the stored pieces that overlap
        it are read (a view of a mapped file where one piece covers it); at another --tp, all."""
        spec = json.loads(json.dumps(placement(p).shard))  # as the manifest spells it
        parts = [e for e in self.entries.get(name, ()) if e["shard"] == spec]
        if not parts:  # another tensor-parallel cut (or none stored): all of it, then p's part
            part = cut(self.full(name), p)
            return part if span is None else part.reshape(-1)[span[0]:span[1]]
        if parts[0]["local_shape"] != list(p.shape):
            shape = tuple(parts[0]["local_shape"])
            raise CorruptCheckpoint(f"checkpoint tensor {name} of shape {shape} does not fit a "
                                    f"parameter of shape {tuple(p.shape)}")
        a, z = span or (0, p.numel())
        pieces = [self.stored(e).reshape(-1)[max(a, s) - s:min(z, t) - s]
                  for e, (s, t) in self.ranges(name, parts) if s < z and t > a]
        flat = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return flat if span is not None else flat.view(p.shape)

    def stored(self, e: dict) -> torch.Tensor:
        t = self.file(e["file"]).get(e["key"])
        if t is None or list(t.shape) != (e["local_shape"] if e["flat"] is None else [e["flat"][1] - e["flat"][0]]):
            raise CorruptCheckpoint(f"{self.path / e['file']}: {e['key']} is missing or not the shape in the manifest")
        return t

    def ranges(self, name: str, parts: list[dict]) -> list[tuple[dict, tuple[int, int]]]:
        """One tensor-parallel slice's stored pieces, each with the [start, stop) of the slice's
        flattened elements it holds, in order; they cover it exactly once (read in the manifest)."""
        numel, pos, out = math.prod(parts[0]["local_shape"]), 0, []
        for e in sorted(parts, key=lambda e: e["flat"][0] if e["flat"] else 0):
            s, t = e["flat"] or (0, numel)
            if s != pos:
                raise CorruptCheckpoint(f"{name}: flat pieces leave a gap at element {pos}")
            out.append((e, (s, t)))
            pos = t
        if pos != numel:
            raise CorruptCheckpoint(f"{name}: flat pieces cover {pos} of {numel} elements")
        return out

    def local_slice(self, name: str, parts: list[dict]) -> torch.Tensor:
        pieces = [self.stored(e).reshape(-1) for e, _ in self.ranges(name, parts)]
        return (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).view(parts[0]["local_shape"])


def load(reader: Reader, model, opt, grid) -> dict:
    """Load a pinned checkpoint into this rank's model and optimizer; return the run state ('extra', with
    'step'). Any layout reads any other's checkpoint: each parameter's slice is cut from what the
    checkpoint holds (Reader.local). A rank reads only what it keeps: under ZeRO its pieces of the
    fp32 masters and moments, and the weights only where it holds them whole (not at stage 3, which
    rebuilds its weight shards from the masters), from the masters only where the saved weights are
    in another dtype. So what a rank maps, checks and holds during a load is its share of the
    checkpoint, most of it views of the mapped files. Everything is read and checked before anything
    is changed: a checkpoint that turns out to be unusable leaves the model as it was."""
    path = reader.path
    state0 = reader.rank_state(0)
    if state0 is None:
        raise CorruptCheckpoint(f"{path}: rank 0's file is not in the manifest")
    params = dict(model.named_parameters())
    keys = {name: canonical_name(name, model.config.tied) for name in params}
    values = {} if weights_sharded(opt) else \
        {name: reader.local(weight_key(reader, keys[name], p), p) for name, p in params.items()}
    moments = {}
    if isinstance(opt, ZeroAdamW):  # its pieces; masters start from the weights when none were kept
        for name, p, kind, span, _ in opt.pieces(model):
            key = f"{keys[name]}::{kind}"
            if key not in reader and kind == "master":
                key = weight_key(reader, keys[name], p)
            if key in reader:
                moments[name, kind, span] = reader.local(key, p, span).float()
    else:
        for name, p in params.items():
            for kind in ("exp_avg", "exp_avg_sq"):
                if (key := f"{keys[name]}::{kind}") in reader:  # (a copy: the optimizer keeps it)
                    moments[name, kind] = reader.local(key, p).to(torch.float32, copy=True)
    states = fp8.states(model)
    scales = {key: reader.full(key) for key in fp8.checkpoint_tensors(states) if key in reader}
    mine = reader.rank_state(grid.rank) if reader.manifest["layout"] == layout_of(grid) else None
    with torch.no_grad():  # now change things
        for name, p in params.items():
            if name in values:
                p.copy_(values[name])
    load_optimizer(opt, model, moments, state0["extra"]["opt_step"])
    if scales:
        fp8.load_checkpoint_tensors(states, scales)
    if mine is not None:  # same layout: this rank continues its own random streams exactly
        set_rng_state(mine["rng"], grid.device)
    return state0["extra"]


def weight_key(reader: Reader, key: str, p: torch.Tensor) -> str:
    """Where p's weights are best read: the saved weights, unless they are in another dtype than
    p's and fp32 masters were kept (ZeRO under bf16: the masters are the better copy; stage 3 saves
    only them). In p's dtype the saved weights are the masters rounded, as the update left them."""
    master = f"{key}::master"
    same_dtype = key in reader and reader.entries[key][0]["dtype"] == dtype_name(p.dtype)
    return key if master not in reader or same_dtype else master


def load_optimizer(opt, model, moments: dict, steps: int) -> None:
    """AdamW's state from per-parameter moments. torch's own load_state_dict puts each piece on the
    device and in the dtype this optimizer needs (fused AdamW wants its step count on the GPU)."""
    if isinstance(opt, ZeroAdamW):  # ZeRO: this rank's pieces, already cut
        opt.load_pieces(model, lambda name, p, kind, span: moments.get((name, kind, span)), steps)
        return
    index = {id(p): i for i, p in enumerate(p for group in opt.param_groups for p in group["params"])}
    state = {index[id(p)]: {"step": torch.tensor(float(steps)), "exp_avg": moments[name, "exp_avg"],
                            "exp_avg_sq": moments[name, "exp_avg_sq"]}
             for name, p in model.named_parameters() if (name, "exp_avg") in moments and id(p) in index}
    opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})


def restore(ckpt_dir: Path, model, opt, grid, meta: dict, run: str, log=print,
            allowed: tuple = (), memory=None) -> tuple[Path, dict, dict] | None:
    """Load the newest usable checkpoint of run `run` into the model and optimizer: (its path, its run
    state, its manifest), or None when the directory holds none. Unusable ones are reported and passed over, an
    incompatible one (`meta` differs, but for the `allowed` keys) stops the run, and when checkpoints
    exist but none is usable the run stops rather than silently starting again from step 0. With
    `memory` (support/memory.py's Tier), its snapshot first, where it is newer (`resume`)."""
    if memory is not None:
        return resume(memory, ckpt_dir, model, opt, grid, meta, run, log, allowed)
    tried = storage.candidates(ckpt_dir, log)
    for path in tried:
        problem = ""
        try:
            reader = pin(path, lazily=True)  # this run holds --out's lock: nothing deletes it
            manifest = reader.manifest
            if manifest["run"] != run:
                raise CorruptCheckpoint(f"{path} was written by another run ({manifest['run']}; this is {run})")
            check_compatible(manifest, meta, path, allowed)
            extra = load(reader, model, opt, grid)
        except IncompatibleCheckpoint:  # (the manifest says so, the same on every rank)
            raise
        except CheckpointError as e:  # damaged (or vanished): found by the ranks that read it
            problem = str(e)
        if agree_usable(grid, problem, log):
            return path, extra, manifest
    if not tried:
        return None
    raise CheckpointError(f"no usable checkpoint of this run in {ckpt_dir} ({len(tried)} tried, see above): repair "
                          "or remove them, or pass --fresh to start a new run (this one is moved aside)")


def agree_usable(grid, problem: str, log=print) -> bool:
    """Is the checkpoint usable on every rank? Each rank read and checked the files that hold
    its own part, so each has its own verdict (`problem`, "" when its part was intact): one
    all-reduce of a flag per rank tells every rank all of them. The lowest rank that found a
    problem says it, once (rank 0 may never have read the damaged file)."""
    failed = torch.zeros(grid.world, device=grid.device)
    failed[grid.rank] = float(bool(problem))
    grid.all_reduce(failed, "world")
    first = failed.nonzero().flatten().tolist()[:1]  # (a host read: once per checkpoint tried)
    if first == [grid.rank]:
        say = log if grid.is_logger else lambda line: print(f"rank {grid.rank}: {line}", flush=True)
        say(f"checkpoint unusable, trying an older one: {problem}")
    return not first


def consolidate(source: "Path | Reader") -> dict[str, torch.Tensor]:
    """The full model's parameters from a checkpoint of any layout (fp32 master weights when the
    run kept them): a checkpoint directory, or a Reader that `pin` or `newest` returned."""
    reader = source if isinstance(source, Reader) else pin(Path(source))
    names = dict.fromkeys(n.split("::")[0] for n in reader.entries)  # ZeRO-3 saves only the masters
    return {n: reader.full(f"{n}::master" if f"{n}::master" in reader else n).float() for n in names
            if n in reader or f"{n}::master" in reader}  # not a module's fp8 scales ("<module>::fp8.x.scale")


def local_part(full: torch.Tensor, p: torch.Tensor, dtype: torch.dtype | None = None,
               device: str | torch.device | None = None) -> torch.Tensor:
    """The slice of `full` that parameter p holds on this rank (placement(p).shard), on p's device
    unless another is given."""
    return cut(full, p).to(device=device or p.device, dtype=dtype or p.dtype)


def cut(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """take_shard(full, placement(p).shard), checked to have p's shape."""
    part = take_shard(full, placement(p).shard)
    if part.shape != p.shape:
        raise CorruptCheckpoint(f"checkpoint tensor of shape {tuple(part.shape)} does not fit a parameter "
                                f"of shape {tuple(p.shape)}")
    return part


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16", as the manifest names a tensor's dtype."""
    return str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------- the memory tier


def to_memory(memory, step: int, state, model, opt) -> None:
    """--mem-ckpt-every, at the end of every step: when a snapshot is due, this rank's whole state
    into the memory tier (`memory`: support/memory.py's Tier; None: off): every tensor it holds,
    those other ranks hold alike too (a restart reads nothing from the others), the optimizer's
    update count, and `state()` (train.Run.state_dict)."""
    if memory is None or not memory.due(step):
        return
    extra = state()
    del extra["step"]
    entries = tensor_entries(model, opt, memory.grid, every_copy=True)
    memory.snapshot(step, entries, optimizer_steps(opt), extra)


def memory_bytes(model, opt, grid) -> int:
    """The bytes of a memory snapshot of this rank, before the first step too (torch's AdamW
    makes its two fp32 moments then)."""
    entries = tensor_entries(model, opt, grid, every_copy=True)
    n = sum(t.numel() * t.element_size() for t, _ in entries.values())
    if not isinstance(opt, ZeroAdamW):
        params = [p for group in opt.param_groups for p in group["params"]]
        n += sum(8 * p.numel() for p in params if not opt.state.get(p))
    return n


def resume(memory, ckpt_dir: Path, model, opt, grid, meta: dict, run: str, log=print,
           allowed: tuple = ()) -> tuple["Path | str", dict, dict] | None:
    """`restore` with the memory tier first (`memory`: support/memory.py's Tier): its newest
    snapshot every rank has, where it is as new as the newest checkpoint on disk or newer.
    Returns (where, run state, manifest), or None; `where` says it in words: "memory (step 412,
    restored in 0.010 s; rank 3 from its partner on node 0)", or the disk checkpoint's path, its
    step and why memory could not serve. Snapshots newer than the step the run goes on from are
    an abandoned attempt's: forgotten."""
    memory.meta, t0 = meta, time.perf_counter()  # (meta: what snapshots record, a restart checks)
    found = from_memory(memory, newest_step(ckpt_dir, run), model, opt, grid, meta, allowed)
    if found is None:
        disk = restore(ckpt_dir, model, opt, grid, meta, run, log, allowed)
        found = disk and (*disk, f"; memory could not serve: {memory.why}" if memory.why else "")
    memory.forget_after(found[1]["step"] if found else 0)
    if not found:
        return None
    where, extra, manifest, detail = found
    took = time.perf_counter() - t0
    return f"{where} (step {extra['step']}, restored in {took:.3f} s{detail})", extra, manifest


def newest_step(ckpt_dir: Path, run: str) -> int:
    """The step of run `run`'s newest checkpoint on disk (its manifest checked, not its files),
    or -1."""
    for path in storage.candidates(ckpt_dir, log=lambda _: None):
        try:
            manifest = storage.read_manifest(path)
        except CheckpointError:
            continue
        if manifest["run"] == run:
            return manifest["step"]
    return -1


def from_memory(memory, disk_step: int, model, opt, grid, meta: dict,
                allowed: tuple = ()) -> tuple[str, dict, dict, str] | None:
    """This rank's memory snapshot (memory.restore: the newest every rank has, if not older than
    `disk_step`) into its model and optimizer: ("memory", run state, manifest, which ranks took
    theirs from a partner), or None (`memory.why` says why). It is this very rank's, at this
    layout: every tensor goes back where tensor_entries(every_copy=True) took it from, without
    resharding. Checked on every rank before anything changes: if a rank finds a tensor missing
    or of another shape, the disk serves instead; another setup's is refused, as on disk."""
    found = memory.restore(disk_step)
    if found is None:
        return None
    saved, state, manifest, detail = found
    check_compatible(manifest, meta, "the memory snapshot", allowed)  # every rank stops alike
    try:
        check_own(saved, model, opt, grid)
        problem = ""
    except CorruptCheckpoint as e:
        problem = f"rank {grid.rank}: {e}"
    if problems := [p for p in grid.gather_objects(problem) if p]:
        memory.why = problems[0]
        return None
    load_own(saved, state, model, opt, grid)
    return "memory", state["extra"], manifest, detail


MOMENTS = ("exp_avg", "exp_avg_sq")


def check_own(saved: dict[str, torch.Tensor], model, opt, grid) -> None:
    """Does a memory snapshot fit this rank's model and optimizer, key by key, shape by shape?"""
    params = dict(model.named_parameters())
    want = {k: t.shape for k, (t, _) in tensor_entries(model, opt, grid, every_copy=True).items()}
    moments = set()
    if not isinstance(opt, ZeroAdamW):  # torch's AdamW makes its moments at its first step
        names = {id(p): name for name, p in params.items()}
        moments = {f"{names[id(p)]}::{kind}" for group in opt.param_groups
                   for p in group["params"] for kind in MOMENTS}
        want |= {key: params[key.split("::")[0]].shape for key in moments}
    problems = {"missing": set(want) - set(saved) - moments,
                "not in the model": set(saved) - set(want),
                "of another shape": {k for k in set(saved) & set(want)
                                     if tuple(saved[k].shape) != tuple(want[k])}}
    if any(problems.values()):
        said = "; ".join(f"{what}: {', '.join(sorted(keys)[:3])}"
                         for what, keys in problems.items() if keys)
        raise CorruptCheckpoint(f"the memory snapshot does not fit this rank's model ({said})")


def load_own(saved: dict[str, torch.Tensor], state: dict, model, opt, grid) -> None:
    """Put a checked memory snapshot (check_own) back: the weights, the optimizer (its moments,
    ZeRO's flat pieces and masters), fp8's scales, and this rank's random streams."""
    params, steps = dict(model.named_parameters()), state["extra"]["opt_step"]
    with torch.no_grad():
        for name, p in params.items():
            if name in saved:
                p.copy_(saved[name])
    if isinstance(opt, ZeroAdamW):  # "name::kind@a": this rank's [a, a + n) of p's flat slice
        pieces = {key.rsplit("@", 1)[0]: (int(key.rsplit("@", 1)[1]), t)
                  for key, t in saved.items() if "@" in key}

        def whole(name: str, p: torch.Tensor, kind: str, span: tuple) -> torch.Tensor:
            return pieces[f"{name}::{kind}"][1]  # this rank's own piece: the span (check_own)
        opt.load_pieces(model, whole, steps)
    else:
        moments = {(name, kind): saved[f"{name}::{kind}"].clone() for name in params
                   for kind in MOMENTS if f"{name}::{kind}" in saved}
        load_optimizer(opt, model, moments, steps)
    states = fp8.states(model)
    if scales := {key: saved[key].clone() for key in fp8.checkpoint_tensors(states)}:
        fp8.load_checkpoint_tensors(states, scales)
    set_rng_state(state["rng"], grid.device)
