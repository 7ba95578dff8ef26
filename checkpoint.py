"""Checkpoints that lose nothing.

A checkpoint is everything a run needs to continue as if it had never stopped: the weights, the
optimizer's moments, the loss scaler, the step (which fixes the learning rate), every RNG, the
data loader's position, the config and the tokenizer. Leave one out and a resumed run silently
differs: without the loader position it sees batches twice; without the RNG, dropout and
sampling change; without the scaler, fp16 starts over at a scale that overflows.

On disk, one directory per checkpoint, one file per rank, and a manifest:

    <out>/ckpt/
        step_00000200/
            rank00000.pt        this rank's tensors (its shards) and its RNG states
            rank00000.json      what rank00000.pt holds: names, full shapes, slices, sha256
            manifest.json       all ranks' entries + run metadata; written last by rank 0
        step_00000400/ ...
        latest                  "step_00000400", replaced atomically after the directory is complete

The write is atomic: files go to `.tmp-step_XXXXXXXX/`, are fsynced and read back against their
sha256; rank 0 waits for every rank's .json, writes the manifest, renames the directory into
place and only then moves `latest`. A crash at any instant leaves the previous checkpoint
intact and `latest` pointing at a complete one. Readers verify every file against the manifest
and fall back to the previous checkpoint when one is corrupt.

The format is sharded from day one: each tensor entry records which slice of the full tensor
the file holds (`shard`: split `dim` into `count` parts, optionally within `groups` blocks, keep
part `index`), so a checkpoint written by one layout can be read by another.
"""

import hashlib
import io
import json
import math
import os
import random
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from model import canonical_name
from parallel import take_shard, unshard

FORMAT, VERSION = "nanoscale-checkpoint", 1
COMMIT_TIMEOUT_S = 600


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: corrupt, incomplete, or from an incompatible run."""


def sha256_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def write_durably(path: Path, payload: bytes) -> dict:
    """Write, fsync, read back and check the hash: a file that returns is on disk as intended."""
    with open(path, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    digest = sha256_bytes(payload)
    if sha256_bytes(path.read_bytes()) != digest:
        raise CheckpointError(f"{path} does not read back as written")
    return {"sha256": digest, "bytes": len(payload)}


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write_durably(tmp, text.encode())
    os.replace(tmp, path)  # atomic on POSIX: readers see the old or the new pointer, never half
    fsync_dir(path.parent)


# ----------------------------------------------------------------------------- what a rank saves


def rng_state() -> dict:
    np_state = np.random.get_state()
    return {"python": random.getstate(), "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    random.setstate(tuple(x if not isinstance(x, list) else tuple(x) for x in state["python"]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def entry(t: torch.Tensor, name: str, p: torch.Tensor, flat: tuple[int, int] | None = None) -> tuple:
    """(tensor, description): `name` is the logical tensor, `shard` the tensor-parallel slice of the
    full tensor that p holds, `flat` a [start, stop) range of that slice's flattened elements
    (ZeRO-1 splits flat buffers, not dimensions)."""
    return t.detach(), {"name": name, "shard": getattr(p, "shard", None),
                        "flat": list(flat) if flat else None, "local_shape": list(p.shape)}


def owns(grid, p: torch.Tensor, replicated_over_dp: bool = True) -> bool:
    """Replicas are identical, so one rank writes each: the first data-parallel rank (unless ZeRO
    split the tensor over data parallelism), the first tensor-parallel rank for tensors that
    tensor parallelism replicates, and the first pipeline stage for the tied embedding."""
    if getattr(p, "tied_copy", False):
        return False
    sharded_tp = getattr(p, "shard", None) is not None
    return (grid.dp_rank == 0 or not replicated_over_dp) and (sharded_tp or grid.tp_rank == 0)


def tensor_entries(model: torch.nn.Module, opt, grid) -> dict[str, tuple]:
    """key -> (tensor, description) for everything this rank writes: its parameters, then AdamW's
    moments keyed by parameter name, so they can be resharded exactly like the parameter."""
    out = {}
    for name, p in model.named_parameters():
        if owns(grid, p):
            out[name] = entry(p, name, p)
    if hasattr(opt, "pieces"):  # ZeRO-1: this rank's flat slices of the moments and master weights
        for name, p, kind, (a, z), t in opt.pieces(model):
            if owns(grid, p, replicated_over_dp=False):
                out[f"{name}::{kind}@{a}"] = entry(t, f"{name}::{kind}", p, (a, z))
        return out
    for name, p in model.named_parameters():
        state = opt.state.get(p)
        if state and owns(grid, p):
            for kind in ("exp_avg", "exp_avg_sq"):
                out[f"{name}::{kind}"] = entry(state[kind], f"{name}::{kind}", p)
    return out


def optimizer_steps(opt) -> int:
    """Updates the optimizer has made (AdamW's bias correction depends on it)."""
    if hasattr(opt, "pieces"):
        return opt.t
    steps = [int(s["step"]) for s in opt.state.values() if "step" in s]
    return steps[0] if steps else 0


def snapshot(model, opt, grid) -> dict[str, tuple]:
    """CPU copies of this rank's tensors: the training loop may change the originals right after."""
    return {k: (t.to("cpu", copy=True), info) for k, (t, info) in tensor_entries(model, opt, grid).items()}


def full_shape(info: dict) -> list[int]:
    shape, spec = list(info["local_shape"]), info["shard"]
    if spec:
        shape[spec["dim"]] *= spec["count"]
    return shape


# ----------------------------------------------------------------------------- writing


class Saver:
    """Writes checkpoints, synchronously or from a background thread (`asynchronous`). Either way
    `save` returns once the state is copied, and `wait` returns once the checkpoint is complete."""

    def __init__(self, ckpt_dir: Path, keep: int, asynchronous: bool, grid):
        self.dir, self.keep, self.asynchronous, self.grid = Path(ckpt_dir), keep, asynchronous, grid
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def save(self, step: int, model, opt, grid, extra: dict, meta: dict, crash_mid_save: bool = False):
        self.wait()
        tmp = self.dir / f".tmp-step_{step:08d}"
        if grid.rank == 0:  # a crash may have left a partial one behind
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        grid.barrier()
        tensors = snapshot(model, opt, grid)
        rank_state = {"extra": {**extra, "step": step, "opt_step": optimizer_steps(opt)}, "rng": rng_state()}
        args = (step, tmp, tensors, rank_state, meta, crash_mid_save)
        if self.asynchronous:
            self.thread = threading.Thread(target=self._write_catching, args=args, name="ckpt-writer")
            self.thread.start()
        else:
            self._write(*args)

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            err, self.error = self.error, None
            raise CheckpointError(f"the background checkpoint write failed: {err}") from err

    def _write_catching(self, *args) -> None:
        try:
            self._write(*args)
        except BaseException as e:  # surfaced by the next wait()
            self.error = e

    def _write(self, step, tmp, tensors, rank_state, meta, crash_mid_save) -> None:
        g = self.grid
        fname = f"rank{g.rank:05d}.pt"
        payload = io.BytesIO()
        torch.save({"tensors": {k: t for k, (t, _) in tensors.items()}, **rank_state}, payload)
        info = {"files": {fname: write_durably(tmp / fname, payload.getvalue())},
                "tensors": [{**d, "key": k, "file": fname, "full_shape": full_shape(d),
                             "dtype": str(t.dtype).removeprefix("torch.")} for k, (t, d) in tensors.items()]}
        if crash_mid_save:  # fault injection: die between the data file and its description
            os.kill(os.getpid(), signal.SIGKILL)
        replace_atomically(tmp / f"rank{g.rank:05d}.json", json.dumps(info))  # rank 0 polls for it: whole or absent
        final = self.dir / f"step_{step:08d}"
        if g.rank == 0:
            self._commit(step, tmp, final, meta)
        else:  # wait() means "complete" on every rank
            wait_for(lambda: (self.dir / "latest").exists() and final.exists(), f"rank 0 to commit {final}")

    def _commit(self, step: int, tmp: Path, final: Path, meta: dict) -> None:
        g = self.grid
        parts = [tmp / f"rank{r:05d}.json" for r in range(g.world)]
        wait_for(lambda: all(p.exists() for p in parts), f"every rank's shard of step {step}")
        files, tensors = {}, []
        for p in parts:
            info = json.loads(p.read_text())
            files.update(info["files"])
            tensors += info["tensors"]
        manifest = {"format": FORMAT, "version": VERSION, "step": step, "meta": meta,
                    "layout": {"dp": g.dp, "tp": g.tp, "pp": g.pp}, "files": files, "tensors": tensors}
        write_durably(tmp / "manifest.json", json.dumps(manifest, indent=1).encode())
        fsync_dir(tmp)
        shutil.rmtree(final, ignore_errors=True)  # a same-step leftover from a run we rolled back
        os.rename(tmp, final)
        fsync_dir(self.dir)
        replace_atomically(self.dir / "latest", final.name)
        self._prune(final)

    def _prune(self, newest: Path) -> None:
        """Delete the oldest complete checkpoints beyond --keep, only now that a newer one exists."""
        for old in sorted(self.dir.glob("step_*"))[:-self.keep]:
            if old != newest:
                shutil.rmtree(old, ignore_errors=True)


def wait_for(ready, what: str, timeout_s: float = COMMIT_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise CheckpointError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.01)


# ----------------------------------------------------------------------------- reading


def read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: no readable manifest.json ({e.__class__.__name__})") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(f"{path}: not a {FORMAT} v{VERSION} checkpoint")
    return manifest


def verify(path: Path) -> dict:
    """Check every file against the manifest's size and sha256; return the manifest."""
    manifest = read_manifest(path)
    for name, want in manifest["files"].items():
        f = path / name
        if not f.exists():
            raise CheckpointError(f"{f} is missing")
        data = f.read_bytes()
        if len(data) != want["bytes"]:
            raise CheckpointError(f"{f} has {len(data)} bytes, the manifest says {want['bytes']} (truncated?)")
        if sha256_bytes(data) != want["sha256"]:
            raise CheckpointError(f"{f} does not match its sha256 in the manifest (corrupted)")
    return manifest


def latest(ckpt_dir: Path, log=print) -> Path | None:
    """The newest checkpoint that verifies. `latest` is tried first, then every step directory,
    newest first; each unusable one is reported by name."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.exists():
        return None
    pointer = ckpt_dir / "latest"
    candidates = sorted(ckpt_dir.glob("step_*"), reverse=True)
    if pointer.exists():
        first = ckpt_dir / pointer.read_text().strip()
        candidates = [first] + [c for c in candidates if c != first]
    for path in candidates:
        try:
            verify(path)
            return path
        except CheckpointError as e:
            log(f"checkpoint unusable, trying an older one: {e}")
    return None


def check_compatible(manifest: dict, meta: dict, path: Path) -> None:
    """Refuse a checkpoint whose model, tokenizer or batch math differs from this run's."""
    saved = manifest["meta"]
    diffs = []
    for key in ("model", "tokenizer", "batch_size", "seq_len"):
        if saved.get(key) != meta.get(key):
            diffs.append(f"{key}: checkpoint has {saved.get(key)}, this run has {meta.get(key)}")
    if diffs:
        raise CheckpointError(f"{path} is from an incompatible run ({'; '.join(diffs)}); point --out "
                              "elsewhere or pass --fresh to start over")


class Reader:
    """Full tensors by logical name, reassembled from whatever layout wrote them."""

    def __init__(self, path: Path, manifest: dict):
        self.files = {name: torch.load(path / name, map_location="cpu", weights_only=True)
                      for name in manifest["files"]}
        self.entries = {}
        for e in manifest["tensors"]:
            self.entries.setdefault(e["name"], []).append(e)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def full(self, name: str) -> torch.Tensor:
        """Concatenate each tensor-parallel slice's flat pieces, then join the slices."""
        if name not in self.entries:
            raise CheckpointError(f"tensor {name} is not in the checkpoint")
        slices = {}
        for e in self.entries[name]:
            slices.setdefault(e["shard"]["index"] if e["shard"] else 0, []).append(e)
        local = [self.local_slice(name, slices[i]) for i in sorted(slices)]
        spec = self.entries[name][0]["shard"]
        if spec is not None and len(local) != spec["count"]:
            raise CheckpointError(f"{name}: {len(local)} of {spec['count']} tensor-parallel slices present")
        return local[0] if spec is None else unshard(local, spec)

    def local_slice(self, name: str, parts: list[dict]) -> torch.Tensor:
        if parts[0]["flat"] is None:
            return self.files[parts[0]["file"]]["tensors"][parts[0]["key"]]
        parts = sorted(parts, key=lambda e: e["flat"][0])
        numel, pos = math.prod(parts[0]["local_shape"]), 0
        for e in parts:
            if e["flat"][0] != pos:
                raise CheckpointError(f"{name}: flat pieces leave a gap at element {pos}")
            pos = e["flat"][1]
        if pos != numel:
            raise CheckpointError(f"{name}: flat pieces cover {pos} of {numel} elements")
        flat = torch.cat([self.files[e["file"]]["tensors"][e["key"]] for e in parts])
        return flat.view(parts[0]["local_shape"])


def load(path: Path, model, opt, grid, meta: dict) -> dict:
    """Load a verified checkpoint into this rank's model and optimizer; return the run state
    ('extra', with 'step'). Every tensor is rebuilt whole, then cut to this rank's slice, so any
    layout reads any other's checkpoint."""
    manifest = verify(path)
    check_compatible(manifest, meta, path)
    reader = Reader(path, manifest)
    extra = reader.files["rank00000.pt"]["extra"]
    params = dict(model.named_parameters())
    for name, p in params.items():
        name = canonical_name(name)
        value = reader.full(f"{name}::master" if f"{name}::master" in reader else name)
        with torch.no_grad():
            p.copy_(local_part(value, p))
    def state(name: str, p: torch.Tensor, kind: str) -> torch.Tensor | None:
        key = f"{canonical_name(name)}::{kind}"
        return local_part(reader.full(key), p, torch.float32) if key in reader else None

    if hasattr(opt, "load_pieces"):
        opt.load_pieces(model, state, extra["opt_step"])
    else:
        for name, p in params.items():
            if state(name, p, "exp_avg") is not None:
                opt.state[p] = {"step": torch.tensor(float(extra["opt_step"])),
                                "exp_avg": state(name, p, "exp_avg"), "exp_avg_sq": state(name, p, "exp_avg_sq")}
    mine = reader.files.get(f"rank{grid.rank:05d}.pt") if manifest["layout"] == layout_of(grid) else None
    if mine is not None:  # same layout: this rank continues its own random streams exactly
        set_rng_state(mine["rng"])
    return extra


def consolidate(path: Path) -> dict[str, torch.Tensor]:
    """The full model's parameters from a checkpoint of any layout (fp32 master weights when the
    run kept them)."""
    manifest = verify(path)
    reader = Reader(path, manifest)
    names = [n for n in reader.entries if "::" not in n]
    return {n: reader.full(f"{n}::master" if f"{n}::master" in reader else n).float() for n in names}


def layout_of(grid) -> dict:
    return {"dp": grid.dp, "tp": grid.tp, "pp": grid.pp}


def local_part(full: torch.Tensor, p: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The slice of `full` that parameter p holds on this rank (p.shard says which)."""
    part = take_shard(full, getattr(p, "shard", None))
    if part.shape != p.shape:
        raise CheckpointError(f"checkpoint tensor of shape {tuple(part.shape)} does not fit a parameter "
                              f"of shape {tuple(p.shape)}")
    return part.to(device=p.device, dtype=dtype or p.dtype)


# ----------------------------------------------------------------------------- Hugging Face GPT-2
#
# A Hugging Face GPT-2 directory holds config.json and model.safetensors (or pytorch_model.bin).
# Its names are ours, optionally without the "transformer." prefix; its Conv1D weights are our
# nn.Linear weights transposed; its embedding has 50257 rows where ours is padded to 50304.
# safetensors is simple enough to read and write here: an 8-byte little-endian header length,
# a JSON header {name: {dtype, shape, data_offsets}}, then the raw bytes.

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Tensors backed by a memory map of the file: nothing is read until it is used."""
    raw = np.memmap(path, dtype=np.uint8, mode="c")  # copy-on-write: torch wants writable memory
    n = int.from_bytes(raw[:8].tobytes(), "little")
    header = json.loads(raw[8:8 + n].tobytes())
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has dtype {info['dtype']}, not a float type")
        a, z = info["data_offsets"]
        buf = raw[8 + n + a:8 + n + z]
        out[name] = torch.frombuffer(buf, dtype=SAFETENSORS_DTYPES[info["dtype"]]).view(info["shape"])
    return out


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    names = {v: k for k, v in SAFETENSORS_DTYPES.items()}
    header, offset, blobs = {"__metadata__": {"format": "pt"}}, 0, []
    for name, t in tensors.items():
        blob = t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)  # keep the data 8-byte aligned
    write_durably(path, len(head).to_bytes(8, "little") + head + b"".join(blobs))


def hf_config(directory: Path) -> dict:
    """GPTConfig fields from a Hugging Face GPT-2 config.json."""
    try:
        cfg = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{directory}: no readable config.json ({e.__class__.__name__}); point "
                              "--init-from at a Hugging Face GPT-2 model directory") from None
    if cfg.get("model_type") != "gpt2":
        raise CheckpointError(f"{directory} holds a {cfg.get('model_type')!r} model, not GPT-2")
    return {"n_layer": cfg["n_layer"], "n_head": cfg["n_head"], "n_embd": cfg["n_embd"],
            "block_size": cfg["n_positions"], "vocab_size": cfg["vocab_size"]}


def read_hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Our names and layouts for the tensors of a Hugging Face GPT-2 directory."""
    directory = Path(directory)
    if (directory / "model.safetensors").exists():
        raw = read_safetensors(directory / "model.safetensors")
    elif (directory / "pytorch_model.bin").exists():
        raw = torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise CheckpointError(f"{directory} has neither model.safetensors nor pytorch_model.bin")
    ours = {}
    for name, t in raw.items():
        name = name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name
        if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
            continue  # the causal-mask buffers of old checkpoints; lm_head is tied to wte
        ours[name] = t.t() if name.endswith(CONV1D) else t
    return ours


def load_hf(model: torch.nn.Module, directory: Path) -> None:
    """Copy Hugging Face GPT-2 weights into this rank's (possibly sharded) model."""
    weights = read_hf_weights(directory)
    for name, p in model.named_parameters():
        name = canonical_name(name)
        if name not in weights:
            raise CheckpointError(f"{directory}: no tensor for {name}")
        w = weights[name].float()
        if name == "transformer.wte.weight":  # pad the vocabulary to the model's multiple of 128
            w = torch.cat([w, w.new_zeros(model.config.padded_vocab - w.shape[0], w.shape[1])])
        with torch.no_grad():
            p.copy_(local_part(w, p))


def export_hf(path: Path, out_dir: Path) -> None:
    """Write a checkpoint as a Hugging Face GPT2LMHeadModel directory."""
    manifest = verify(path)
    m, tok = manifest["meta"]["model"], manifest["meta"]["tokenizer"]
    weights = consolidate(path)
    weights["transformer.wte.weight"] = weights["transformer.wte.weight"][: m["vocab_size"]]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_safetensors(out_dir / "model.safetensors",
                      {n: (t.t() if n.endswith(CONV1D) else t).contiguous() for n, t in weights.items()})
    eot = m["vocab_size"] - 1  # <|endoftext|> is the last token of both our tokenizers
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": m["vocab_size"],
              "n_positions": m["block_size"], "n_ctx": m["block_size"], "n_embd": m["n_embd"],
              "n_layer": m["n_layer"], "n_head": m["n_head"], "n_inner": None, "activation_function": "gelu_new",
              "layer_norm_epsilon": 1e-5, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
              "bos_token_id": eot, "eos_token_id": eot, "tie_word_embeddings": True,
              "nanoscale": {"tokenizer": tok, "step": manifest["step"]}}
    replace_atomically(out_dir / "config.json", json.dumps(config, indent=2))


# ----------------------------------------------------------------------------- command line


def inspect(path: Path) -> str:
    manifest = verify(path)
    lines = [f"{path}: step {manifest['step']}, layout {manifest['layout']}, all "
             f"{len(manifest['files'])} files verified",
             f"tokenizer {manifest['meta'].get('tokenizer')}, model {manifest['meta'].get('model')}", ""]
    for name, info in manifest["files"].items():
        lines.append(f"  {name:<16} {info['bytes'] / 1e6:9.2f} MB  sha256 {info['sha256'][:16]}...")
    lines.append("")
    lines.append(f"  {'tensor':<44} {'full shape':<16} {'dtype':<9} {'file':<14} slice")
    for e in manifest["tensors"]:
        spec = e["shard"]
        where = "whole" if spec is None else f"dim {spec['dim']} part {spec['index'] + 1}/{spec['count']}"
        if e["flat"]:
            where += f", elements [{e['flat'][0]}, {e['flat'][1]})"
        lines.append(f"  {e['name']:<44} {str(tuple(e['full_shape'])):<16} {e['dtype']:<9} {e['file']:<14} {where}")
    return "\n".join(lines)


def main(argv=None) -> None:
    import argparse
    p = argparse.ArgumentParser(description="Inspect, consolidate and export nanoscale checkpoints.")
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("inspect", help="verify a checkpoint and print its manifest")
    sp.add_argument("path", help="a step_XXXXXXXX directory, or a ckpt/ directory (uses latest)")
    sp = sub.add_parser("consolidate", help="write the full model (any layout) to one torch file")
    sp.add_argument("path", help="a step_XXXXXXXX directory, or a ckpt/ directory (uses latest)")
    sp.add_argument("file", help="output .pt file: {parameter name: full fp32 tensor}")
    sp = sub.add_parser("export-hf", help="write a Hugging Face GPT2LMHeadModel directory")
    sp.add_argument("path", help="a step_XXXXXXXX directory, or a ckpt/ directory (uses latest)")
    sp.add_argument("dir", help="output directory (config.json + model.safetensors)")
    args = p.parse_args(argv)
    try:
        path = resolve(args.path)
        if args.cmd == "inspect":
            print(inspect(path))
        elif args.cmd == "consolidate":
            weights = consolidate(path)
            torch.save(weights, args.file)
            print(f"wrote {len(weights)} tensors ({sum(t.numel() for t in weights.values()):,} parameters) "
                  f"from {path} to {args.file}")
        else:
            export_hf(path, Path(args.dir))
            print(f"wrote a Hugging Face GPT-2 model from {path} to {args.dir}")
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def resolve(path: str | Path) -> Path:
    """A checkpoint directory, or the one `latest` points to in a ckpt/ directory."""
    path = Path(path)
    if (path / "latest").exists():
        return path / (path / "latest").read_text().strip()
    if not (path / "manifest.json").exists():
        raise CheckpointError(f"{path} is neither a checkpoint nor a ckpt/ directory with a `latest` pointer")
    return path


if __name__ == "__main__":
    main()
