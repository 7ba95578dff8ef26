"""Checkpoints from the command line: what one holds, checked file by file, and the full model out of it.

    python -m instruments.checkpoints inspect out/ckpt            # verify every byte, list every tensor
    python -m instruments.checkpoints consolidate out/ckpt m.pt   # the full fp32 model, from any layout

A path is a step_XXXXXXXX directory or a ckpt/ directory (the checkpoint its `latest` names). `inspect`
checks what a reader checks (checkpoint.pin: the manifest's own sha256 and schema, then every file's size
and sha256), but reports every problem instead of stopping at the first, and exits 2 if there was one.
`consolidate` is checkpoint.consolidate written to one torch file. (To a Hugging Face directory:
`python -m instruments.hf export`.)

What these commands write, they write whole or not at all (a temporary name, renamed once complete), and a
path they cannot use (a checkpoint that does not verify, an output that is a file or cannot be written) is
one line and exit status 2, as train.py says its errors.
"""

import argparse
import contextlib
import os
import shutil
import sys
from pathlib import Path

import torch

import checkpoint
from support import storage
from support.storage import CheckpointError, CorruptCheckpoint


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


PATH_HELP = "a step_XXXXXXXX directory, or a ckpt/ directory (uses latest)"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m instruments.checkpoints",
                                description="Inspect and consolidate nanoscale checkpoints.")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("inspect", help="verify a checkpoint (manifest and files) and print what it holds") \
        .add_argument("path", help=PATH_HELP)
    sp = sub.add_parser("consolidate", help="write the full model (any layout) to one torch file")
    sp.add_argument("path", help=PATH_HELP)
    sp.add_argument("file", help="output .pt file: {parameter name: full fp32 tensor}")
    args = p.parse_args(argv)
    one_line_errors(lambda: show(find_checkpoint(args.path)) if args.cmd == "inspect" else
                    consolidate(find_checkpoint(args.path), args.file))


def show(path: Path) -> None:
    text, ok = inspect(path)
    print(text)
    if not ok:
        raise CorruptCheckpoint(f"{path} is unusable (see above)")


def consolidate(path: Path, file: str) -> None:
    file = Path(file)
    writable(file, kind="file")
    weights = checkpoint.consolidate(path)
    tmp = file.with_name(f".{file.name}.tmp-{os.getpid()}")
    try:  # whole or not at all: a failure half-way (a full disk) leaves no half a file under the name
        torch.save(weights, tmp)
        os.replace(tmp, file)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    print(f"wrote {len(weights)} tensors ({sum(t.numel() for t in weights.values()):,} parameters) from {path} "
          f"to {file}")


def one_line_errors(command) -> None:
    """command(), with a checkpoint that cannot be used, or an output that cannot be written (a full disk, no
    permission), said in one line on stderr, and exit status 2, as train.py says its errors."""
    try:
        command()
    except (CheckpointError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def writable(out: Path, kind: str = "directory") -> None:
    """Refuse, before any work, an output path that is a file where a directory is asked for (or the reverse),
    or that lies under a file."""
    out = Path(out)
    there = next(p for p in (out, *out.parents) if p.exists())
    if there == out and out.is_dir() != (kind == "directory"):
        raise CheckpointError(f"{out} is a {'file' if kind == 'directory' else 'directory'}; name a {kind} to write")
    if there != out and not there.is_dir():
        raise CheckpointError(f"{there} is a file, so {out} cannot be made under it; name a {kind} elsewhere")


def write_whole(out_dir: Path, write) -> None:
    """write(tmp) fills a new directory beside `out_dir`; then its files move into out_dir (a new out_dir is that
    directory, renamed). On a failure nothing is left behind: neither the temporary directory nor the parents
    made for it, and an existing out_dir keeps its files."""
    out_dir = Path(out_dir)
    made = [p for p in (out_dir.parent, *out_dir.parent.parents) if not p.exists()]  # deepest first
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # (a leftover of a killed export of the same pid)
        tmp.mkdir()
        write(tmp)
        if not out_dir.exists():
            os.replace(tmp, out_dir)
            return
        for f in sorted(tmp.iterdir(), key=lambda f: f.name == "config.json"):  # the config, what readers open, last
            os.replace(f, out_dir / f.name)
        tmp.rmdir()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for p in made:
            with contextlib.suppress(OSError):
                p.rmdir()
        raise


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
