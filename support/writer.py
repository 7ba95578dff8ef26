"""How a checkpoint is written without stopping the loop: the copy, the background writer, the commit.

checkpoint.py says *what* each rank saves (its tensors, each described by the slice of the full tensor it
holds) and how any layout reads it back; storage.py how each byte reaches the disk and is checked. This
file is the `Saver` between them: when a save happens, on which thread, and how every rank learns that it
is complete.

    save ──▶ agree (every rank saves, or every rank skips) ──▶ copy the tensors to host buffers
         ──▶ [background thread] write rankNNNNN.safetensors, then rankNNNNN.json
         ──▶ rank 0: the manifest, the rename, `latest` (storage.commit); the others wait to see it

Saving asynchronously costs the training loop only a copy. On a GPU: a device-to-host copy into
pinned buffers, issued on a side CUDA stream so that it overlaps the next forward and backward
(which only read the weights); the optimizer step, which writes them, first makes the GPU wait for
that copy (`Saver.fence`). Nothing of it is read on the host before then, not even the optimizer's
step count (a tensor, copied with the rest). A background thread then writes the file. Its heavy
parts, writing, hashing and fsync, release Python's GIL, so the training thread keeps launching
work meanwhile (the thread first makes the run's GPU its own: `use_device`). When the disk is slower
than --ckpt-every steps, a save finds the previous one still being written: a periodic save is
skipped, with one line, rather than stopping the loop to wait (the final save waits); --keep counts
the checkpoints that were written. A write that fails (a full disk) takes its files back with it.

A rank's file also carries, in its header, what continues the run exactly on the same layout: the run
state (loader position, loss scaler, ...) and every random stream the process draws from (`rng_state`).
"""

import base64
import json
import os
import random
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from support import storage
from support.storage import CheckpointError

OPT_STEPS = "optimizer steps"  # the host copy of the optimizer's update count, among a save's tensors (not written)


# ----------------------------------------------------------------------------- beside a rank's tensors


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


def use_device(device: torch.device) -> None:
    """Make the run's GPU this thread's. A new thread starts on GPU 0, whatever its process chose, and its
    first CUDA call (the writer's wait for the copy) would create a context there: ~0.5 GB of GPU 0 for
    every rank of the machine."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def layout_of(grid) -> dict:
    """The layout that wrote a checkpoint, as its manifest records it (a reader at the same layout also
    continues each rank's random streams)."""
    cp = {"cp": grid.cp} if grid.cp > 1 else {}  # absent at 1: checkpoints from before cp compare equal
    ep = {"ep": grid.ep} if grid.ep > 1 else {}  # (the same for expert parallelism)
    return {"dp": grid.dp, "tp": grid.tp, "pp": grid.pp, **cp, **ep}


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
    entries: dict  # key -> (tensor, description): checkpoint.tensor_entries
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
        self.finished: list[dict] = []  # saves completed since the caller last looked (pop_finished)

    def save(self, step: int, entries: dict, opt_steps: torch.Tensor, extra: dict, meta: dict,
             crash_mid_save: bool = False, skippable: bool = False) -> bool:
        """Save `step`: `entries` (key -> (tensor, description): checkpoint.tensor_entries) and the
        optimizer's update count (a tensor, read by the writer); False if it was skipped instead
        (`skippable`, while a save is being written)."""
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
        host = self._to_host({**{key: t for key, (t, _) in entries.items()}, OPT_STEPS: opt_steps})
        job = Write(step, tmp, entries, host, self.copied, {"extra": {**extra, "step": step},
                                                            "rng": rng_state(grid.device)}, meta, crash_mid_save, t0)
        self.writing = step
        if self.asynchronous:
            self.thread = threading.Thread(target=self._write_catching, args=(job,), name="ckpt-writer")
            self.thread.start()
        else:
            self._fail_cleanly(step, self._write_or_discard, job)
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
        """The background thread: the write, its error kept for the next wait()."""
        try:
            use_device(self.grid.device)
            self._fail_cleanly(job.step, self._write_or_discard, job)
        except BaseException as e:  # surfaced by the next wait()
            self.error = e

    def _write_or_discard(self, job: "Write") -> None:
        """_write, or on a failed write (a full disk) none of it left behind: this rank's files, and on rank 0
        the whole temporary directory (the others' writes into it then fail too, and each says so)."""
        try:
            self._write(job)
        except OSError:
            if self.grid.rank == 0:
                shutil.rmtree(job.tmp, ignore_errors=True)
            for name in (f"rank{self.grid.rank:05d}.safetensors", f"rank{self.grid.rank:05d}.json"):
                try:
                    (job.tmp / name).unlink(missing_ok=True)
                except OSError:  # (a disk gone read-only: the next run clears it, storage.clear_leftovers)
                    pass
            raise

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
        self.finished.append(job.record)
