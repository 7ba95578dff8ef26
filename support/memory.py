"""Checkpoints in memory: a failure costs seconds, not everything since the last disk checkpoint.

A disk checkpoint costs the loop little (writer.py writes it in the background), but a failure still
loses every step since the last one, and the restart reads the whole checkpoint back from a shared file
system. At scale failures are routine (Llama 3 405B: 419 unexpected interruptions in 54 days on 16,384
GPUs, one every three hours), so large runs keep a tier above the disk: frequent snapshots in host
memory, each also copied to another machine, and a restart that reads memory (Gemini, SOSP 2023;
the local checkpoints of NVIDIA's resiliency extension for Megatron; ByteDance's MegaScale). This file
is that tier: bytes in shared memory and an exchange between partners. What a snapshot holds, and how a
rank's model takes it back, is checkpoint.py's (`to_memory`, `from_memory`).

    every --mem-ckpt-every steps, on every rank
      the loop     agrees with the others (every rank's last snapshot is done, and there is room),
                   copies its tensors into host buffers                        <- all the loop pays
      a thread     writes rank/.tmp-step_N/ (the data file hashed as it is written, a sealed manifest)
                   and renames it rank/step_N/; sends it to its partner, receives its ward's, checks
                   it, keeps it in held-rank/step_N/
    a restart      every rank says what it can restore: its own snapshots and the copies it holds
                   (their manifests checked); all take the newest step every rank has, as its own or
                   on its partner; as new as the newest disk checkpoint or newer: memory, else disk.
                   Its bytes are checked against their sha256 as they are read (one that fails: the
                   next newest step). A rank whose copy is gone (its node was replaced) receives it
                   from its partner, which checked it, and checks it again.

The partner is the same local rank on the next node (--gpus-per-node says what a node is): rank r's
copy lives on rank (r + g) mod world, so losing one node loses no snapshot. On one node there is no
partner (said once at the start): a rank's own copy survives its process, not its machine.

    4 ranks, --gpus-per-node 2:     node 0: ranks 0 1     node 1: ranks 2 3     copies 0 <-> 2, 1 <-> 3

On each node, under --mem-ckpt-dir (tmpfs, /dev/shm: memory; `{node}` in it is the node's number, so
that one machine can play several nodes):

    nanoscale-<12 hex of --out's path>/
        rank00003/step_00000412/      rank00003.safetensors, manifest.json: this rank's newest snapshot
        rank00003/.tmp-step_00000416/  the one being written: never read
        held-rank00001/step_00000412/  rank 1's snapshot, held here for it (rank 3 is its partner)

Why each choice:
- Files in tmpfs, not the process's own memory: they outlive the process (a SIGKILL frees all a process
  holds, and torchrun's restart is a new process), and they are written with storage.py's code (each
  byte hashed on its way, a rename to commit), whose fsync costs nothing there.
- One directory per --out: one run at a time holds --out (rundir's lock), so what is there is this
  run's, or a run's that --out held before (after --fresh): refused by its run id, in one line, and
  deleted. A snapshot is used only at the layout and by the rank that wrote it (the restart case);
  at another layout the disk checkpoint serves, which any layout can read.
- A snapshot is whole or absent: the data file, then the manifest (its sha256 and the file's), then
  the rename. A kill at any instant leaves a .tmp- directory, which nothing reads.
- Bounded: per rank, its newest whole snapshot and the one being written (the same of the copy it
  holds): at most two of each; a round deletes the older before it writes. A round starts only when
  every rank has finished the last one (the loop's agreement), so at a kill every rank has the snapshot
  before the newest, and some the newest: the ranks agree on the newest all of them have. A rank whose
  write fails still takes part in the exchange, sending nothing (its partner must not wait for it).
  --memory-report names the bytes.
- The exchange is its own gloo process group: host bytes over the host's network, never the groups a
  step uses (on one communicator a background transfer would interleave with the loop's collectives:
  gloo pairs messages by their order; NCCL's run on one stream). Sizes go first, then the bytes, both
  partners posting matching sends and receives (batch_isend_irecv); the group waits at most --timeout.
  Its bytes are not a step's: Grid counts a step's traffic for --comm-report's formulas, so the tier
  counts its own (each round's record: bytes written and sent), not there.
- Under --crash-at (fault injection) every round is waited for, so that a kill lands where the flag
  says, not wherever a busy machine's scheduler had got the thread to.
- Released when the run ends (finished, or stopped on request after its disk checkpoint); a run that
  dies leaves them for its restart. Before a round, the free space is checked (os.statvfs): at the
  start, a node that cannot hold one snapshot is one line and exit 2; later a round that does not fit
  is skipped, with one line.
"""

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from support import storage
from support.interrupt import crash_due, peer_call
from support.storage import CheckpointError, CorruptCheckpoint
from support.writer import OPT_STEPS, layout_of, rng_state

FORMAT, VERSION = "nanoscale-memory-snapshot", 1
STEP = re.compile(r"step_(\d{8})")


def start(cfg, grid, run: str, estimate, log=print) -> "Tier | None":
    """The tier of a run (train.setup), or None without --mem-ckpt-every. `cfg`: train.py's TrainConfig;
    `estimate()`: the bytes of this rank's snapshot (checkpoint.memory_bytes). Collective."""
    if not cfg.mem_ckpt_every:
        return None
    tier = Tier(cfg.mem_ckpt_every, cfg.mem_ckpt_dir, cfg.out, grid, run, cfg.max_steps, cfg.crash_at, log)
    tier.open(estimate())
    return tier


@contextlib.contextmanager
def lifetime(tier: "Tier | None"):
    """Around the training loop: when it ends as it should (finished, or stopped on request after its
    disk checkpoint) the tier's memory is released; when it fails, the last round is waited for and the
    snapshots stay, for the restart."""
    try:
        yield
    except BaseException:
        if tier is not None:
            tier.join()
        raise
    if tier is not None:
        tier.release()


def out_id(out: str | Path) -> str:
    """The name of an --out among the tiers of a machine: 12 hex digits of its absolute path."""
    return hashlib.sha256(str(Path(out).resolve()).encode()).hexdigest()[:12]


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still put in the file system of `path` (or of its nearest parent)."""
    while not path.exists():
        path = path.parent
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@dataclass
class Round:
    """One snapshot, from the loop's copy to the partner's receipt (what the thread is handed)."""
    step: int
    host: dict  # key -> this rank's host copy (and OPT_STEPS)
    keys: list  # the tensor keys of the file, in order
    copied: "torch.cuda.Event | None"  # on a GPU: when the copy into `host` is done
    state: dict  # the run state and RNG states, for the file's header
    meta: dict  # what the manifest records (train.checkpoint_meta): a restart checks it
    record: dict = field(default_factory=dict)  # {"step", "bytes", "sent", "write_s", "blocking_s"}


class Tier:
    """The memory tier of one rank: `snapshot` every `every` steps, `restore` at a start, `release` at
    the end. `grid`: the run's parallel.Grid (rank, world, gpus_per_node, its collectives)."""

    def __init__(self, every: int, pattern: str, out: str, grid, run: str, last: int, crash_at: str = "",
                 log=print):
        self.every, self.pattern, self.grid, self.run, self.log = every, pattern, grid, run, log
        self.last, self.crash_at = last, crash_at  # (no snapshot of the last step: the run ends there)
        self.meta: dict = {}  # what every snapshot records, and a restart checks (checkpoint.resume sets it)
        g, world = grid.gpus_per_node, grid.world
        self.per_node = g if 0 < g < world else 0  # 0: one node, no partner
        self.nodes = world // self.per_node if self.per_node else 1
        self.partner = (grid.rank + self.per_node) % world if self.per_node else None  # holds our copy
        self.ward = (grid.rank - self.per_node) % world if self.per_node else None  # whose copy we hold
        self.root = self.node_dir(self.node_of(grid.rank)) / f"nanoscale-{out_id(out)}"
        self.own = self.root / f"rank{grid.rank:05d}"
        self.held = self.root / f"held-rank{self.ward:05d}" if self.per_node else None
        self.layout = layout_of(grid)
        self.group = None  # the exchange's own process group (open)
        self.sizes = {"own": 0, "held": 0}  # bytes of this rank's snapshot and of the copy it holds
        self.thread: threading.Thread | None = None
        self.error, self.writing, self.host = "", None, {}
        self.why = ""  # why the last restore could not serve
        self.finished: list[dict] = []  # rounds done since the caller last looked (pop_finished)

    def node_of(self, rank: int) -> int:
        return rank // self.per_node if self.per_node else 0

    def node_dir(self, node: int) -> Path:
        return Path(self.pattern.replace("{node}", str(node)))

    # ------------------------------------------------------------------------- at the start

    def open(self, estimate: int) -> None:
        """Check the room, make the directories and the exchange's group (a collective: every rank). `estimate`:
        the bytes of this rank's snapshot. The room is checked per node: its ranks' snapshots and the copies they
        hold must fit once, or the run stops here in one line (exit 2)."""
        grid = self.grid
        sizes = grid.gather_objects(estimate)
        self.sizes = {"own": estimate, "held": sizes[self.ward] if self.per_node else 0}
        mine = [r for r in range(grid.world) if self.node_of(r) == self.node_of(grid.rank)]
        need = sum(sizes[r] + (sizes[(r - self.per_node) % grid.world] if self.per_node else 0) for r in mine)
        problem = ""
        try:
            self.own.mkdir(parents=True, exist_ok=True)
            if self.held:
                self.held.mkdir(parents=True, exist_ok=True)
            if (free := free_bytes(self.root)) < need:
                held = " and the copies they hold" if self.per_node else ""
                problem = (f"--mem-ckpt-dir {self.root.parent} has {free / 1e6:,.1f} MB free, and one memory snapshot "
                           f"of node {self.node_of(grid.rank)} needs {need / 1e6:,.1f} MB (the state of its "
                           f"{len(mine)} rank{'s' if len(mine) > 1 else ''}{held}); make room (a larger /dev/shm), "
                           "choose another --mem-ckpt-dir, or leave out --mem-ckpt-every")
        except OSError as e:
            problem = f"--mem-ckpt-dir {self.root.parent} cannot be written ({e.strerror or e}); choose another"
        problems = [p for p in grid.gather_objects(problem) if p]
        if problems:
            raise CheckpointError(problems[0])
        if self.per_node:  # every rank makes every group, in the same order
            self.group = dist.new_group(list(range(grid.world)), timeout=timedelta(seconds=grid.timeout_s),
                                        backend="gloo")
        copies = (f"each copied to the same local rank on the next node ({self.nodes} nodes of {self.per_node})"
                  if self.per_node else "one node, so no partner holds a copy: a lost machine loses them "
                  "(--gpus-per-node sets the nodes)")
        self.log(f"memory snapshots every {self.every} steps in {self.pattern}, {estimate / 1e6:,.1f} MB a rank; "
                 + copies)

    def due(self, step: int) -> bool:
        """A snapshot at this step? Not at the last one: the run ends there, with its disk checkpoint."""
        return step % self.every == 0 and step < self.last

    # ------------------------------------------------------------------------- taking a snapshot

    def snapshot(self, step: int, entries: dict, opt_steps: torch.Tensor, extra: dict) -> bool:
        """Snapshot `step`: `entries` (key -> (tensor, description), every tensor this rank holds), the
        optimizer's update count (a tensor, read by the thread) and the run state. Collective: the ranks
        agree to go, or all skip it (a round still running somewhere, or no room: one line). Returns
        once the tensors are copied (on a GPU: once the copy is queued)."""
        t0 = time.perf_counter()
        busy = self.thread is not None and self.thread.is_alive()
        need, free = self.sizes["own"] + self.sizes["held"], free_bytes(self.root)
        why = (f"its snapshot of step {self.writing} is still being written or sent" if busy else
               f"{self.root.parent} has {free / 1e6:,.1f} MB free, and this snapshot and the copy it holds need "
               f"{need / 1e6:,.1f} MB" if free < need else "")
        said = self.grid.gather_objects((why, "" if busy else self.error))
        for rank, (_, error) in enumerate(said):
            if error:
                self.log(f"memory snapshot of step {self.writing} failed on rank {rank}: {error}")
        if not busy:
            self.join()
            self.error = ""
        if reasons := [(r, w) for r, (w, _) in enumerate(said) if w]:
            self.log(f"step {step}: memory snapshot skipped: rank {reasons[0][0]}: {reasons[0][1]}")
            return False
        tensors = {**{key: t for key, (t, _) in entries.items()}, OPT_STEPS: opt_steps}
        job = Round(step, self.to_host(tensors), list(entries), None,
                    {"extra": dict(extra), "rng": rng_state(self.grid.device)}, self.meta)
        if self.grid.device.type == "cuda":
            job.copied = torch.cuda.Event()
            job.copied.record()  # on the loop's stream: the next update is queued after the copy
        self.writing = step
        self.thread = threading.Thread(target=self.round, args=(job,), name="memory-snapshot", daemon=True)
        self.thread.start()
        if self.crash_at:  # fault injection: each round is waited for, so that a kill lands where it says
            self.join()  # (between two rounds, or in one), not where a busy machine's scheduler happened to be
        job.record.update(step=step, blocking_s=time.perf_counter() - t0)
        return True

    def to_host(self, tensors: dict) -> dict:
        """Host buffers allocated once and reused (pinned on a GPU machine). On a GPU the copies are queued on
        the loop's own stream: the optimizer step after them waits for them there, and the host does not."""
        cuda, host = self.grid.device.type == "cuda", {}
        for key, t in tensors.items():
            buf = self.host.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda)
            host[key] = buf.copy_(t.detach(), non_blocking=cuda)
        self.host = host
        return host

    def round(self, job: Round) -> None:
        """The thread: this rank's snapshot into its directory, then the exchange with the partners. A rank
        whose own write failed still takes part in the exchange, sending nothing: its partner must not wait
        for it until --timeout."""
        t0, written, failed = time.perf_counter(), None, None
        try:
            if job.copied is not None:
                job.copied.synchronize()
            prune(self.own, job.step)
            written = self.write_own(job)
        except Exception as e:  # (a full /dev/shm): said at the next round
            failed = e
        try:
            job.record.update(bytes=int(written[1].size) if written else 0, write_s=time.perf_counter() - t0)
            if self.per_node:
                prune(self.held, job.step)
                job.record["sent"] = self.exchange(job.step, written)
            if failed is not None:
                raise failed
            self.finished.append(job.record)
        except BaseException as e:  # said at the next round (the loop's thread), or left for the restart
            self.error = f"{type(e).__name__}: {e}"

    def write_own(self, job: Round) -> tuple[dict, np.ndarray]:
        rank = self.grid.rank
        job.state["extra"].update(step=job.step, opt_step=int(job.host[OPT_STEPS]))  # a host copy by now
        tmp, name = self.own / f".tmp-step_{job.step:08d}", f"rank{rank:05d}.safetensors"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        written = storage.write_safetensors(tmp / name, {k: job.host[k] for k in job.keys},
                                            {"nanoscale_state": json.dumps(job.state)})
        if crash_due(self.crash_at, rank, f"mem:{job.step}"):  # fault injection: after the data, before its manifest
            os.kill(os.getpid(), signal.SIGKILL)
        manifest = storage.seal({"format": FORMAT, "version": VERSION, "run": self.run, "step": job.step,
                                 "rank": rank, "layout": self.layout, "meta": job.meta, "files": {name: written}})
        commit(tmp, json.dumps(manifest).encode(), None, None)
        self.sizes["own"] = written["bytes"]
        return manifest, storage.map_file(self.own / f"step_{job.step:08d}" / name)

    def exchange(self, step: int, written: tuple[dict, np.ndarray] | None) -> int:
        """Send this rank's snapshot (`written`: its manifest and bytes; None: its write failed) to its partner,
        and receive its ward's, checked and kept. Returns the bytes sent."""
        payload = written and (json.dumps(written[0]).encode(), written[1])
        got = self.transfer(step, payload, True, True, f"the memory snapshots of step {step}")
        if got is not None:
            self.keep_held(*got, step)
        return len(payload[0]) + payload[1].size if payload else 0

    def transfer(self, step: int, payload: tuple | None, send: bool, receive: bool, what: str) -> tuple | None:
        """Point-to-point on the exchange's group: when `send`, `payload` (manifest bytes, data bytes; None:
        nothing, its sizes 0) to the partner; when `receive`, the ward's. Sizes first (8 bytes each), then the
        bytes; the partners post matching sends and receives. Returns what was received, or None."""
        sizes_in = torch.zeros(2, dtype=torch.int64)
        sizes = [len(payload[0]), payload[1].size] if payload else [0, 0]
        self.p2p([(torch.tensor(sizes, dtype=torch.int64), self.partner, 0)] if send else [],
                 [(sizes_in, self.ward, 0)] if receive else [], what)
        n_text, n_data = sizes_in.tolist()
        coming = receive and n_text > 0
        text, data = torch.empty(n_text, dtype=torch.uint8), torch.empty(n_data, dtype=torch.uint8)
        self.p2p([(as_tensor(payload[0]), self.partner, 1), (as_tensor(payload[1]), self.partner, 2)]
                 if send and payload else [], [(text, self.ward, 1), (data, self.ward, 2)] if coming else [], what)
        return (bytes(text.numpy()), data.numpy()) if coming else None

    def p2p(self, sends: list, recvs: list, what: str) -> None:
        ops = [dist.P2POp(dist.isend, t, peer, group=self.group, tag=tag) for t, peer, tag in sends]
        ops += [dist.P2POp(dist.irecv, t, peer, group=self.group, tag=tag) for t, peer, tag in recvs]
        if ops:
            for work in peer_call(dist.batch_isend_irecv, ops, what=what):
                peer_call(work.wait, what=what)

    def keep_held(self, text: bytes, data: np.ndarray, step: int) -> None:
        """The ward's snapshot, checked (its manifest's seal, its run, rank and step, the data's sha256 as it is
        written), kept in held-rank/step_N/."""
        manifest = parse(text, self.held)
        expect(manifest, self.run, self.ward, step, self.held)
        tmp = self.held / f".tmp-step_{step:08d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        commit(tmp, text, manifest, data)
        self.sizes["held"] = data.size

    def join(self) -> None:
        """Wait for the round in flight; its failure was recorded (said at the next round's agreement)."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def pop_finished(self) -> list[dict]:
        done, self.finished = self.finished, []
        return done

    # ------------------------------------------------------------------------- after a failure

    def restore(self, disk_step: int) -> tuple[dict, dict, dict, str] | None:
        """At a start: the newest snapshot every rank can restore, if it is as new as `disk_step` (the newest
        disk checkpoint's, -1: none) or newer. Collective. Returns (this rank's tensors by key, its run and RNG
        state, its manifest, which ranks took theirs from a partner: "; rank 3 from its partner on node 0"),
        or None, and `why` says why not ("" when there is nothing to say: a new run)."""
        self.join()
        own, held, notes = self.scan(self.own, self.grid.rank), {}, []
        notes += own.pop("notes")
        if self.per_node:
            held = self.scan(self.held, self.ward)
            notes += held.pop("notes")
        table = self.grid.gather_objects({"own": sorted(own), "held": sorted(held), "disk": disk_step, "notes": notes})
        for row in table:
            for note in row["notes"]:
                self.log(note)
        refused = set()  # steps a rank's bytes did not verify: the next newest is tried
        while True:
            step, self.why = self.agreed(table, refused)
            if step is None:
                return None
            needy = [r for r in range(self.grid.world) if step not in table[r]["own"]]
            if got := self.fetch(step, own, held, needy):
                manifest, raw = got
                path = self.own / f"step_{step:08d}" / next(iter(manifest["files"]))
                state = json.loads(storage.safetensors_metadata(path, raw)["nanoscale_state"])
                return storage.safetensors_tensors(raw, path), state, manifest, self.where(step, needy)
            refused.add(step)

    def fetch(self, step: int, own: dict, held: dict, needy: list[int]) -> tuple[dict, np.ndarray] | None:
        """This rank's snapshot of `step`, its bytes checked against their sha256 now (as they are read): its own
        copy, or (a rank in `needy`) the one its partner holds, checked by the partner, sent, and checked again.
        Collective: None on every rank when any rank's bytes did not verify (each said in one line)."""
        mine, send, problem = None, None, ""
        try:
            if step in own:
                mine = checked(*own[step])
            if self.per_node and self.ward in needy:
                send = checked(*held[step])
        except CheckpointError as e:
            problem = f"memory snapshot unusable: {e}"
        if not self.all_well(problem):  # (before the transfer: a partner with nothing to send sends nothing)
            return None
        try:
            got = self.transfer(step, send and (json.dumps(send[0]).encode(), send[1]), send is not None,
                                self.grid.rank in needy, f"the memory snapshot of step {step} from a partner")
            if got is not None:
                mine = self.take_back(*got, step)
        except CheckpointError as e:
            problem = f"rank {self.grid.rank}'s copy from its partner is unusable: {e}"
        return mine if self.all_well(problem) else None

    def all_well(self, problem: str) -> bool:
        """Every rank's problem ("" for none), said by rank 0; True when there is none anywhere."""
        problems = [p for p in self.grid.gather_objects(problem) if p]
        for p in problems:
            self.log(p)
        return not problems

    def scan(self, folder: Path, rank: int) -> dict:
        """The complete snapshots in `folder` that rank `rank` of this run wrote at this layout, their manifests
        checked (their bytes are, when they are used: `checked`): step -> (manifest, data file); "notes": a line
        for each one refused. Another run's are deleted: this run holds --out, and the directory is --out's."""
        found, notes = {}, []
        for path in sorted(p for p in folder.glob("step_*") if STEP.fullmatch(p.name)) if folder.is_dir() else []:
            try:
                manifest = parse((path / "manifest.json").read_bytes(), path)
                if manifest["run"] != self.run:
                    notes.append(f"memory snapshot {path} is another run's ({manifest['run']}; this is {self.run}): "
                                 "not used, and deleted")
                    shutil.rmtree(path, ignore_errors=True)
                    continue
                if manifest["layout"] != self.layout or manifest["rank"] != rank:
                    notes.append(f"memory snapshot {path} was taken at another layout ({manifest['layout']}, rank "
                                 f"{manifest['rank']}; this is {self.layout}, rank {rank}): not used")
                    continue
                found[manifest["step"]] = (manifest, path / next(iter(manifest["files"])))
            except (OSError, CheckpointError) as e:
                notes.append(f"memory snapshot {path} unusable: {e}")
        return {**found, "notes": notes}

    def agreed(self, table: list[dict], refused: set) -> tuple[int | None, str]:
        """The newest step every rank can restore, by its own copy or by the one its partner holds, if it is
        not older than the newest disk checkpoint (and its bytes were not `refused`); else (None, why: "" when
        there is nothing to say)."""
        world, disk = self.grid.world, max(row["disk"] for row in table)
        reach = [set(table[r]["own"]) | (set(table[(r + self.per_node) % world]["held"]) if self.per_node else set())
                 for r in range(world)]
        common = set.intersection(*reach) - refused
        if not any(reach) and disk < 0:
            return None, ""  # a new run
        if not common:
            lost = [str(r) for r in range(world) if not reach[r]]
            if len(lost) == 1:
                return None, f"rank {lost[0]} has no snapshot, of its own or on its partner"
            if lost:
                return None, f"ranks {', '.join(lost)} have no snapshot, of their own or on their partners"
            return None, ("no snapshot every rank has verified" if refused else "no step is held for every rank")
        if max(common) < disk:
            return None, (f"the newest snapshot every rank has (step {max(common)}) is older than the disk "
                          f"checkpoint of step {disk}")
        return max(common), ""

    def take_back(self, text: bytes, data: np.ndarray, step: int) -> tuple[dict, np.ndarray]:
        """A rank's own snapshot, from its partner: checked again (the seal, run, rank, step, and its sha256 as it is
        written back into this rank's directory, where the next failure finds it)."""
        manifest = parse(text, self.own)
        expect(manifest, self.run, self.grid.rank, step, self.own)
        if manifest["layout"] != self.layout:
            raise CorruptCheckpoint(f"the copy of step {step} from rank {self.partner} is of another layout")
        tmp = self.own / f".tmp-step_{step:08d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        commit(tmp, text, manifest, data)
        return manifest, data

    def where(self, step: int, needy: list[int]) -> str:
        """"; rank 3 from its partner on node 0": for the resume line."""
        by_node = {}
        for r in needy:
            by_node.setdefault(self.node_of((r + self.per_node) % self.grid.world), []).append(str(r))
        parts = [f"rank {rs[0]} from its partner" if len(rs) == 1 else f"ranks {', '.join(rs)} from their partners"
                 for rs in by_node.values()]
        return "".join(f"; {p} on node {n}" for p, n in zip(parts, by_node))

    def forget_after(self, step: int) -> None:
        """Drop the snapshots (own and held) newer than `step`, where the run goes on from: an abandoned attempt's."""
        self.join()
        for folder in (self.own, self.held):
            for path in folder.glob("step_*") if folder and folder.is_dir() else []:
                if STEP.fullmatch(path.name) and int(path.name[5:]) > step:
                    shutil.rmtree(path, ignore_errors=True)

    # ------------------------------------------------------------------------- at the end

    def release(self) -> None:
        """The run is over (finished, or stopped with its disk checkpoint): its memory goes back."""
        self.join()
        for folder in (self.own, self.held):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
        try:
            self.root.rmdir()  # the last rank of the node to finish
        except OSError:
            pass

    def describe(self) -> str:
        """--memory-report's line: the bytes this rank keeps in the tier, at most."""
        own, held = self.sizes["own"], self.sizes["held"]
        copy = f" and {held:,} of rank {self.ward}'s, held for it" if self.per_node else ""
        return (f"memory snapshots (--mem-ckpt-every {self.every}): {own:,} bytes of this rank's state{copy}; at "
                f"most twice that at once ({2 * (own + held):,} bytes: the newest and the one being written) in "
                f"{self.root}")


# ----------------------------------------------------------------------------- the files


def as_tensor(b: bytes | np.ndarray) -> torch.Tensor:
    """Bytes as a uint8 tensor for gloo (a mapped file's without a copy)."""
    return torch.from_numpy(b) if isinstance(b, np.ndarray) else torch.frombuffer(bytearray(b), dtype=torch.uint8)


def checked(manifest: dict, file: Path) -> tuple[dict, np.ndarray]:
    """A snapshot's data file, mapped, and its bytes checked against the manifest (what is checked is what is
    read): (manifest, bytes)."""
    try:
        raw = storage.map_file(file)
    except OSError as e:
        raise CorruptCheckpoint(f"{file} is unreadable ({e.strerror or e})") from None
    storage.verify_mapped(raw, manifest["files"][file.name], file)
    return manifest, raw


def parse(text: bytes, where: Path) -> dict:
    """A snapshot's manifest, after checking its seal (its own sha256) and its shape."""
    try:
        manifest = json.loads(text)
        body = {k: v for k, v in manifest.items() if k != "sha256"}
    except (ValueError, AttributeError):
        raise CorruptCheckpoint(f"{where}: the manifest is not JSON") from None
    if storage.seal(body) != manifest:
        raise CorruptCheckpoint(f"{where}: the manifest does not match its own sha256 (torn or corrupted)")
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CorruptCheckpoint(f"{where}: not a {FORMAT} v{VERSION} manifest")
    files = manifest.get("files")
    if not (isinstance(manifest.get("step"), int) and isinstance(manifest.get("rank"), int) and isinstance(files, dict)
            and len(files) == 1 and isinstance(manifest.get("meta"), dict) and isinstance(manifest.get("run"), str)):
        raise CorruptCheckpoint(f"{where}: the manifest lacks its step, rank, run, meta or its one file")
    return manifest


def expect(manifest: dict, run: str, rank: int, step: int, where: Path) -> None:
    got = (manifest["run"], manifest["rank"], manifest["step"])
    if got != (run, rank, step):
        raise CorruptCheckpoint(f"{where}: received the snapshot of run {got[0]}, rank {got[1]}, step {got[2]}; "
                                f"expected run {run}, rank {rank}, step {step}")


def commit(tmp: Path, text: bytes, manifest: dict | None, data: np.ndarray | None) -> None:
    """Finish a snapshot in `tmp` and rename it into place (step_N/ beside it, replacing one there: a replayed
    step's). With `data`: its file is written first, and checked against `manifest` as it is written."""
    if data is not None:
        (name, want), = manifest["files"].items()
        written = storage.write_chunks(tmp / name, [memoryview(data)])
        storage.check_bytes(written["sha256"], written["bytes"], want, tmp / name)
    storage.write_durably(tmp / "manifest.json", text)
    final = tmp.with_name(tmp.name.removeprefix(".tmp-"))
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)


def prune(folder: Path, step: int) -> None:
    """Before the snapshot of `step` is written in `folder`: keep the newest complete one older than it, drop
    the rest (older ones, torn .tmp- ones, and newer ones: an abandoned attempt's)."""
    if not folder.is_dir():
        folder.mkdir(parents=True)
    done = sorted(int(p.name[5:]) for p in folder.glob("step_*") if STEP.fullmatch(p.name) and int(p.name[5:]) < step)
    for path in folder.iterdir():
        if not (STEP.fullmatch(path.name) and done and int(path.name[5:]) == done[-1]):
            shutil.rmtree(path, ignore_errors=True)
