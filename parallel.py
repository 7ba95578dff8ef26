"""Parallelism from raw torch.distributed primitives: how ranks are arranged, and how a layer is split.

The process grid. `world = dp * cp * tp * pp` ranks, numbered so that tensor-parallel ranks are
adjacent (they exchange the most data, so they should share a node), then context parallel
(which passes keys and values around a ring every layer), then data parallel, then pipeline:

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

    pp=2, dp=2, tp=2:         tp group: ranks that split each layer      {0,1} {2,3} {4,5} {6,7}
       stage 0: [0 1] [2 3]   dp group: ranks that hold the same shard   {0,2} {1,3} {4,6} {5,7}
       stage 1: [4 5] [6 7]   pp group: ranks that pass activations      {0,4} {1,5} {2,6} {3,7}

With --cp (context parallelism, context.py) the cp ranks of one data-parallel rank read the same
sequences and each keeps a slice of every one; their weights are replicas, so gradients are averaged
over the `dp_cp` group of all dp x cp ranks that hold the same shard (Megatron's "data parallel
group with context parallel").

`Grid` owns this arithmetic, and every layout fact: the degrees, this rank's coordinates, its
pipeline neighbours, whether the sequence is sharded (`sp`, `cp`), which replica of a tensor counts.
Nothing else computes ranks. Every collective goes through it too, so it can count the bytes; a
point-to-point message goes over its own group (the pipeline's, the cp ring's), which on NCCL is its
own communicator and stream, so a ring's messages overlap a pipeline's.

When a peer fails. gloo's calls return when the data has moved, and raise when a peer is gone or
--timeout passes: `peer_call` makes that one PeerError line (train.py: exit status 3). NCCL's calls
return as soon as the GPU has the work, so nothing raises; its watchdog thread ends a collective that
outlived --timeout and aborts its communicator (`connect` tells it not to end the process too), and
the loop's one wait for the device per step, `Grid.wait_for_device`, is bounded and reads what the
watchdog found, for the same PeerError.

This file also holds Megatron's tensor (and sequence) parallel layers; shard.py builds a rank's part
of the model with them. The other parallel questions live beside it:
pipeline.py (schedules and the executor), gradients.py (data-parallel averaging, ZeRO, the
gradient norm) and formulas.py (what the papers predict, measured against what ran).
"""

import itertools
import os
import re
import time
import weakref
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

import model as gpt
import timeline
from lmhead import lm_head_loss

# How much longer than --timeout the step's sync point waits on NCCL (Grid.wait_for_device): time for the
# watchdog, which ends a collective at --timeout, to notice it and abort its communicator
NCCL_GRACE_S = 30.0

all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class LayoutError(ValueError):
    """An impossible parallel layout; raised before any work, printed as one line."""


class PeerError(RuntimeError):
    """A collective failed: a peer died, hung past --timeout, or the network broke. `where`: this rank and
    the call it was in (a group names its ranks: the peer that failed is among them); `detail`: the
    backend's own words, one line."""

    def __init__(self, where: str, detail: str):
        super().__init__(f"{where}: {detail}")
        self.where, self.detail = where, detail


def peer_call(fn, *args, what: str = "a collective", **kwargs):
    """Run a torch.distributed call; turn its failure into one PeerError line."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as e:
        line = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        line = re.sub(r"^\[[^\]]*:\d+\]\s*", "", line)  # gloo's source location, "[.../pair.cc:537] "
        rank = f"rank {dist.get_rank()}, " if dist.is_initialized() else ""
        raise PeerError(f"{rank}in {what}", line.split(". This is typically caused")[0][:300]) from e


def wait_until(ready, timeout_s: float, where: str, failure=lambda: None, poll_s: float = 1e-3) -> None:
    """Poll ready() until it is true. A PeerError as soon as failure() has something to say (what the backend
    reports), or once timeout_s has passed without either: a bounded wait where the plain one could hang."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if (problem := failure()) or time.monotonic() > deadline:
            raise PeerError(where, problem or f"not done after {timeout_s:g} s (--timeout): a peer died or hangs")
        time.sleep(poll_s)
    if problem := failure():  # a failed collective can let the device pass it, with garbage in its buffer
        raise PeerError(where, problem)


# Every Grid, by its key: the tensor-parallel operator (tp_collective) takes a grid as a number, since an
# operator's arguments are tensors and plain values. Weak: a grid nothing else holds goes away.
GRIDS: "weakref.WeakValueDictionary[int, Grid]" = weakref.WeakValueDictionary()
_GRID_KEYS = itertools.count()


class Traffic:
    """Calls and bytes per (collective, group) since the last reset. Bytes are the size of the full
    buffer (all-reduce input, all-gather output, reduce-scatter input, p2p message). Each call is also
    timed, launch to completion (timeline.py: the dashboard's seconds per collective, --print-timeline)."""

    def __init__(self):
        self.counts = defaultdict(lambda: [0, 0])
        self.time = timeline.Recorder(torch.device("cpu"))  # init_grid gives it the run's device

    def add(self, op: str, group: str, nbytes: int, members: tuple[int, ...]) -> timeline.Comm | None:
        self.counts[(op, group)][0] += 1
        self.counts[(op, group)][1] += nbytes
        return self.time.launch(op, group, members, nbytes)

    def reset(self) -> None:
        self.counts.clear()
        self.time.reset()

    def seconds(self) -> dict[str, float]:
        """{"all_reduce dp": seconds, ...}: launch to completion, summed over this step's calls."""
        return self.time.seconds()


@dataclass
class Grid:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    rank: int = 0
    sp: bool = False  # sequence parallelism: activations outside attention/MLP split along T over tp
    cp: int = 1  # context parallelism: every activation split along T over cp ranks (context.py)
    cp_attn: str = "ring"  # how attention sees the whole sequence under cp: "ring" or "ulysses"
    whole: bool = False  # set by whole_sequence(): sp and cp off (sampling feeds one token at a time)
    vp: int = 1  # virtual pipeline stages (chunks of layers) per pipeline rank: the interleaved schedule's v
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    groups: dict = field(default_factory=dict)  # "tp" / "dp" / "pp" / "embed" -> this rank's group
    members: dict = field(default_factory=lambda: defaultdict(tuple))  # the same names -> its global ranks
    traffic: "Traffic" = field(default_factory=lambda: Traffic())
    timeout_s: float = 300.0  # --timeout: how long a collective may wait for a peer (connect sets it)
    key: int = field(init=False, repr=False, compare=False)  # names this grid to the tp_collective operator

    def __post_init__(self):
        self.key = next(_GRID_KEYS)
        GRIDS[self.key] = self

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def cp_rank(self) -> int:
        return self.rank // self.tp % self.cp

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.tp * self.cp) % self.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.cp * self.dp)

    @property
    def dp_cp(self) -> int:
        """Ranks that hold the same weights and average their gradients: data and context parallel."""
        return self.dp * self.cp

    @property
    def dp_cp_rank(self) -> int:
        return self.dp_rank * self.cp + self.cp_rank

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
        return ((pp_rank * self.dp + dp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    @property
    def cp_on(self) -> bool:
        """Is the sequence split over context-parallel ranks right now?"""
        return self.cp > 1 and not self.whole

    @property
    def sp_on(self) -> bool:
        return self.sp and not self.whole

    @property
    def cp_next(self) -> int:
        """The next rank on the context-parallel ring (same pp, dp and tp coordinates)."""
        return self.rank_of(self.pp_rank, self.dp_rank, self.tp_rank, (self.cp_rank + 1) % self.cp)

    @property
    def cp_prev(self) -> int:
        return self.rank_of(self.pp_rank, self.dp_rank, self.tp_rank, (self.cp_rank - 1) % self.cp)

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def prev_stage(self) -> int | None:
        """The rank this one receives activations from (same dp and tp coordinates, one stage up)."""
        return None if self.first_stage else self.rank_of(self.pp_rank - 1, self.dp_rank, self.tp_rank, self.cp_rank)

    @property
    def next_stage(self) -> int | None:
        return None if self.last_stage else self.rank_of(self.pp_rank + 1, self.dp_rank, self.tp_rank, self.cp_rank)

    def stage_rank(self, pp_rank: int) -> int:
        """The rank of pipeline stage `pp_rank` (mod pp: an interleaved pipeline wraps from the last
        stage back to the first) in this rank's pipeline."""
        return self.rank_of(pp_rank % self.pp, self.dp_rank, self.tp_rank, self.cp_rank)

    def owns(self, p: torch.Tensor, replicated_over_dp: bool = True) -> bool:
        """Is this rank's copy of p the one that counts? Replicas are identical, so one copy is saved
        and one counts toward the gradient norm: a tensor that tensor parallelism replicates on tp
        rank 0, one that data (and context) parallelism replicates on dp_cp rank 0 (unless ZeRO split
        it over them: `replicated_over_dp=False`), and the pipeline's copy of the tied embedding never.
        Counting a replica twice is the classic clipping bug of model parallelism."""
        if getattr(p, "tied_copy", False):
            return False
        sharded_tp = getattr(p, "shard", None) is not None
        return (self.dp_cp_rank == 0 or not replicated_over_dp) and (sharded_tp or self.tp_rank == 0)

    @contextmanager
    def whole_sequence(self):
        """Sequence and context parallelism off for a while: sampling feeds one token at a time, which
        cannot be split along the sequence. The layers read `sp_on` / `cp_on` on every call."""
        whole, self.whole = self.whole, True
        try:
            yield
        finally:
            self.whole = whole

    @property
    def is_logger(self) -> bool:
        """Rank 0 prints, draws the progress bar and writes files."""
        return self.rank == 0

    def log(self, msg: str) -> None:
        if self.is_logger:
            print(msg, flush=True)

    def span(self, name: str):
        """Time a compute span for --print-timeline ('F', 'B', 'O'); nothing when no step is recorded."""
        return self.traffic.time.span(name)

    def barrier(self) -> None:
        if self.world > 1:
            peer_call(dist.barrier, what="a barrier of every rank")

    def wait_for_device(self) -> None:
        """The step's sync point, bounded. NCCL calls return before the GPU has done them, so a dead or hung
        peer shows only where the host waits for the device (an `.item()`), and there it would wait until
        NCCL's watchdog ends the collective after --timeout. Wait here instead, at most --timeout and a
        grace, watching what NCCL reports (`nccl_failure`), and say it as one PeerError (exit status 3).
        Nothing to do on gloo (its calls return when done, and raise when a peer fails) or alone."""
        if self.device.type != "cuda" or self.world == 1:
            return
        done = torch.cuda.Event()
        done.record()  # after everything this step queued, its collectives' waits included
        wait_until(done.query, self.timeout_s + NCCL_GRACE_S, f"rank {self.rank}, waiting for the GPU to finish "
                   "the step's collectives", failure=self.nccl_failure)

    def nccl_failure(self) -> str | None:
        """What NCCL's watchdog found in this rank's groups (a timeout, an error here or on a peer), if anything."""
        for name, group in self.groups.items():
            backend = (group or dist.group.WORLD)._get_backend(self.device)
            error = backend.get_error() if hasattr(backend, "get_error") else None  # torch >= 2.6
            if error is not None and error.name not in ("SUCCESS", "NO_ERROR"):
                return f"NCCL reports {error.name} in {self.describe('a collective', name)}"
        return None

    def rank0_first(self, fn):
        """Run fn on rank 0, then on the others (e.g. prepare data once, then read the cache)."""
        result = fn() if self.rank == 0 else None
        self.barrier()
        return result if self.rank == 0 else fn()

    def global_loss(self, x: torch.Tensor) -> torch.Tensor:
        """The batch loss on every rank: it lives on the last pipeline stage (the others hold 0, so a
        sum over the pipeline group copies it), and is averaged over data-parallel ranks and over
        context-parallel ones (each holds the mean over its slice of the tokens; the slices are equal)."""
        x = x.detach().float().clone()
        self.all_reduce(x, "pp")
        self.all_reduce(x, "dp_cp")
        return x / self.dp_cp

    # Every collective in the codebase goes through these methods, which count the bytes.
    def size(self, group: str) -> int:
        return {"tp": self.tp, "dp": self.dp, "pp": self.pp, "cp": self.cp, "dp_cp": self.dp_cp,
                "world": self.world, "embed": 2 if self.pp > 1 else 1}[group]

    def label(self, group: str) -> str:
        """The group's name in reports: the dp x cp group is plain "dp" when there is no context parallelism."""
        return "dp" if group == "dp_cp" and self.cp == 1 else group

    def describe(self, op: str, group: str) -> str:
        """'all_reduce over dp (ranks 0, 2)': a call named by its peers, for PeerError."""
        m = self.members.get(group, ())
        ranks = ", ".join(map(str, m)) if len(m) <= 8 else f"{m[0]}, {m[1]}, … {m[-1]}: {len(m)} ranks"
        return f"{op} over {self.label(group)} (ranks {ranks})"

    def all_reduce(self, t: torch.Tensor, group: str, op=dist.ReduceOp.SUM, async_op: bool = False):
        if self.size(group) == 1:
            return None
        comm = self.traffic.add("all_reduce", self.label(group), t.numel() * t.element_size(), self.members[group])
        return self.traffic.time.track(comm, peer_call(dist.all_reduce, t, op=op, group=self.groups.get(group),
                                                       async_op=async_op, what=self.describe("all_reduce", group)))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: str, async_op: bool = False):
        """out = concat over the group's ranks of inp, along dim 0."""
        if self.size(group) == 1:
            out.copy_(inp)
            return None
        comm = self.traffic.add("all_gather", self.label(group), out.numel() * out.element_size(), self.members[group])
        return self.traffic.time.track(comm, peer_call(all_gather_single, out, inp, group=self.groups.get(group),
                                                       async_op=async_op, what=self.describe("all_gather", group)))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group: str, async_op: bool = False):
        """out = this rank's dim-0 slice of the sum over the group of inp."""
        if self.size(group) == 1:
            out.copy_(inp)
            return None
        comm = self.traffic.add("reduce_scatter", self.label(group), inp.numel() * inp.element_size(),
                                self.members[group])
        return self.traffic.time.track(comm, peer_call(reduce_scatter_single, out, inp, group=self.groups.get(group),
                                                       async_op=async_op, what=self.describe("reduce_scatter", group)))

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, group: str) -> None:
        """out[r] = what rank r of the group sent this rank: its inp[this rank] (equal pieces along dim 0)."""
        if self.size(group) == 1:
            out.copy_(inp)
            return
        comm = self.traffic.add("all_to_all", self.label(group), inp.numel() * inp.element_size(), self.members[group])
        self.traffic.time.track(comm, peer_call(dist.all_to_all_single, out, inp, group=self.groups.get(group),
                                                  what=self.describe("all_to_all", group)))

    def send_recv(self, sends: list[tuple], recvs: list[tuple], group: str = "pp", wait: bool = True):
        """Point-to-point, posted together so that paired sends and receives cannot deadlock. Each item
        is (tensor, peer rank) or (tensor, peer, tag): two messages between the same pair in one batch
        need different tags. With wait=False the transfers run on while the caller computes; it gets
        the list of pending works and must wait on each before touching the tensors."""
        sends = [(t.contiguous(), *rest) for t, *rest in sends]
        pg = self.groups.get(group)  # the group's own communicator (on NCCL, its own stream): rings and
        ops = [dist.P2POp(dist.isend, t, peer, group=pg, tag=tag[0] if tag else 0)  # pipelines overlap
               for t, peer, *tag in sends]
        ops += [dist.P2POp(dist.irecv, t, peer, group=pg, tag=tag[0] if tag else 0) for t, peer, *tag in recvs]
        for t, *_ in sends:
            self.traffic.counts[("send", self.label(group))][0] += 1
            self.traffic.counts[("send", self.label(group))][1] += t.numel() * t.element_size()
        if not ops:
            return []
        peers = tuple(sorted({self.rank, *(peer for _, peer, *_ in sends + recvs)}))
        comm = self.traffic.time.launch("p2p", self.label(group), peers, sum(t.numel() * t.element_size()
                                                                              for t, *_ in sends))
        what = f"point-to-point with rank{'s' if len(peers) > 2 else ''} " + ", ".join(
            str(r) for r in peers if r != self.rank)
        works = [self.traffic.time.track(comm, work) for work in peer_call(dist.batch_isend_irecv, ops, what=what)]
        if not wait:
            return works
        for work in works:
            peer_call(work.wait, what=what)
        return []

    def __str__(self) -> str:
        cp = f" x cp {self.cp}" if self.cp > 1 else ""
        lines = [f"grid: world {self.world} = dp {self.dp}{cp} x tp {self.tp} x pp {self.pp}"
                 + (" (sequence parallel over tp)" if self.sp else "")
                 + (f" (context parallel: {self.cp_attn} attention)" if self.cp > 1 else "")
                 + (f" (interleaved: {self.vp} chunks of layers per stage)" if self.vp > 1 else "")]
        for p in range(self.pp):
            rings = [" ".join("[" + " ".join(f"{self.rank_of(p, d, t, c)}" for t in range(self.tp)) + "]"
                              for c in range(self.cp)) for d in range(self.dp)]
            row = "  ".join(f"({r})" for r in rings) if self.cp > 1 else "  ".join(rings)
            lines.append(f"  stage {p}: {row}    (each [...] is a tensor-parallel group"
                         + (", each (...) a context-parallel ring)" if self.cp > 1 else ")"))
        return "\n".join(lines)


def init_grid(tp: int, pp: int, device: torch.device, timeout_s: float = 300, sp: bool = False,
              cp: int = 1, cp_attn: str = "ring", vp: int = 1) -> Grid:
    """`layout`, then `connect`: the grid this process belongs to, with its process groups."""
    grid = layout(tp, pp, device, sp=sp, cp=cp, cp_attn=cp_attn, vp=vp)
    connect(grid, timeout_s)
    return grid


def layout(tp: int, pp: int, device: torch.device, sp: bool = False, cp: int = 1, cp_attn: str = "ring",
           vp: int = 1) -> Grid:
    """The grid that torchrun's WORLD_SIZE and RANK describe, before any process talks to another: every
    rank computes the same one, so an impossible layout fails on every rank alike, at once."""
    world = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun
    rank = int(os.environ.get("RANK", "0"))
    if world % (tp * pp * cp):
        raise LayoutError(f"world size {world} is not divisible by tp*cp*pp = {tp}*{cp}*{pp}; launch a "
                          f"multiple of {tp * cp * pp} processes or change --tp/--cp/--pp")
    if device.type == "cuda" and device.index is None:  # an index was settled by config.pick_device
        device = local_gpu()
    grid = Grid(tp=tp, pp=pp, cp=cp, dp=world // (tp * pp * cp), rank=rank, sp=sp, cp_attn=cp_attn, vp=vp,
                device=device)
    grid.traffic.time = timeline.Recorder(device)
    return grid


def connect(grid: Grid, timeout_s: float = 300) -> None:
    """Join the process group that torchrun describes (none for one process) and build the tp / cp / dp /
    dp_cp / pp groups. Every rank creates every group in the same order, as new_group requires."""
    world, rank, tp, pp, cp = grid.world, grid.rank, grid.tp, grid.pp, grid.cp
    grid.timeout_s = timeout_s
    if world == 1:
        return
    # A launcher that restarts the job (torchrun --max-restarts) keeps its key-value store; keys
    # from the dead attempt would point new groups at dead peers, so each attempt gets a prefix.
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timedelta(seconds=timeout_s)))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    nccl = grid.device.type == "cuda"
    if nccl:  # read when the process group is made. On a collective that outlives --timeout (or a NCCL error)
        # the watchdog aborts the communicators, which lets the stuck kernels return; 2 stops there. The
        # default (torch's 3, torchrun's 1) then ends the process from the watchdog's thread, with its own
        # log; with 2 the loop's sync point (Grid.wait_for_device) says it in one line, exit status 3.
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
    # device_id: NCCL makes every group's communicator now, all ranks together (new_group splits it), so a
    # group's first call may be point-to-point between two of its ranks (batch_isend_irecv requires that)
    dist.init_process_group("nccl" if nccl else "gloo", rank=rank, world_size=world,
                            store=dist.PrefixStore(f"nanoscale/attempt{attempt}", store),
                            timeout=timedelta(seconds=timeout_s), device_id=grid.device if nccl else None)
    ids = torch.arange(world).view(pp, grid.dp, cp, tp)  # ids[pp_rank, dp_rank, cp_rank, tp_rank] = rank
    layouts = {"tp": ids.reshape(-1, tp), "cp": ids.permute(0, 1, 3, 2).reshape(-1, cp),
               "dp": ids.permute(0, 2, 3, 1).reshape(-1, grid.dp),
               "dp_cp": ids.permute(0, 3, 1, 2).reshape(-1, grid.dp * cp),
               "pp": ids.permute(1, 2, 3, 0).reshape(-1, pp)}
    if pp > 1:  # the first and last stage both hold the tied embedding
        layouts["embed"] = torch.stack([ids[0], ids[-1]], dim=-1).reshape(-1, 2)
    layouts["world"] = ids.reshape(1, world)
    for name, members in layouts.items():
        grid.members[name] = tuple(next((r for r in members.tolist() if rank in r), ()))
        if members.size(1) == world:
            grid.groups[name] = None  # the default group already is this group
            continue
        for ranks in members.tolist() if members.size(1) > 1 else []:  # size-1 groups never talk
            group = dist.new_group(ranks)
            if rank in ranks:
                grid.groups[name] = group


def local_gpu() -> torch.device:
    """This process's GPU: one per local rank. More processes on a node than GPUs is a clear error,
    raised by every rank alike (so none is left waiting for the others)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    visible = torch.cuda.device_count()
    if max(local_world, local_rank + 1) > visible:
        raise LayoutError(f"{max(local_world, local_rank + 1)} processes on this node but {visible} visible GPU"
                          f"{'s' if visible != 1 else ''}: launch at most {visible} per node (torchrun "
                          f"--nproc-per-node {visible}), or add --device cpu to rehearse the layout on CPU "
                          "processes (gloo)")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- tensor parallel
#
# Megatron-LM (Shoeybi et al. 2019, section 3): split the first matmul of a pair by columns and
# the second by rows, and the pair needs one all-reduce forward and one backward.
#
#     X ─f─▶ [X A_1 | X A_2] ─gelu─▶ [Y_1 | Y_2] ─▶ Y_1 B_1 + Y_2 B_2 ─g─▶ Z
#            column-parallel (A split by output)    row-parallel (B split by input)
#
#     f: forward identity, backward all-reduce     g: forward all-reduce, backward identity
#
# Sequence parallelism (Korthikanti et al. 2022, section 4.2.2) cuts the LayerNorm/dropout regions
# between the pairs along the sequence: f becomes an all-gather of the sequence, g a
# reduce-scatter of it; the same bytes move, but those activations take 1/tp of the memory.
#
# Each of these is one collective forward and its conjugate backward (the conjugate of an
# all-gather is a reduce-scatter, of an all-reduce the identity), so one autograd Function does
# them all; the named functions below say which pair.


def identity(x: torch.Tensor, grid: Grid) -> torch.Tensor:
    return x


def all_reduce_tp(x: torch.Tensor, grid: Grid) -> torch.Tensor:
    x = x.contiguous().clone()  # never reduce into a tensor autograd still needs
    grid.all_reduce(x, "tp")
    return x


def gather_seq(x: torch.Tensor, grid: Grid) -> torch.Tensor:
    """(B, T/tp, C) from each rank -> (B, T, C) on every rank."""
    out = seq_major(x, x.size(1) * grid.tp)
    grid.all_gather(out.transpose(0, 1), x.transpose(0, 1).contiguous(), "tp")  # collectives concatenate dim 0
    return out


def reduce_scatter_seq(x: torch.Tensor, grid: Grid) -> torch.Tensor:
    """(B, T, C) partial sums on each rank -> this rank's (B, T/tp, C) slice of the sum."""
    out = seq_major(x, x.size(1) // grid.tp)
    grid.reduce_scatter(out.transpose(0, 1), x.transpose(0, 1).contiguous(), "tp")
    return out


def split_seq(x: torch.Tensor, grid: Grid) -> torch.Tensor:
    """(B, T, C), the same on every rank -> this rank's (B, T/tp, C) slice; no communication."""
    if x.size(1) % grid.tp:
        raise LayoutError(f"--sp needs the sequence length ({x.size(1)}) divisible by --tp {grid.tp}")
    return x.chunk(grid.tp, dim=1)[grid.tp_rank].clone(memory_format=torch.contiguous_format)


def seq_major(x: torch.Tensor, T: int) -> torch.Tensor:
    """A new (B, T, C) laid out as (T, B, C): what the sequence collectives fill, along dim 0."""
    return x.new_empty((T, x.size(0), *x.shape[2:])).transpose(0, 1)


class Conjugate(torch.autograd.Function):
    """y = forward(x); dL/dx = backward(dL/dy): a collective and the one its gradient needs."""

    @staticmethod
    def forward(ctx, x, grid, forward, backward):
        ctx.grid, ctx.backward = grid, backward
        return collective(forward, x, grid)

    @staticmethod
    def backward(ctx, grad):
        return collective(ctx.backward, grad, ctx.grid), None, None, None


def copy_to_tp(x, grid):  # Megatron's f: x is replicated; its gradient is a sum over the ranks
    return Conjugate.apply(x, grid, identity, all_reduce_tp)


def reduce_from_tp(x, grid):  # Megatron's g: partial sums become the output; the gradient is replicated
    return Conjugate.apply(x, grid, all_reduce_tp, identity)


def gather_from_sp(x, grid):  # sequence-parallel f: all-gather the sequence; reduce-scatter back
    return Conjugate.apply(x, grid, gather_seq, reduce_scatter_seq)


def scatter_to_sp(x, grid):  # sequence-parallel g: reduce-scatter partial sums; all-gather back
    return Conjugate.apply(x, grid, reduce_scatter_seq, gather_seq)


def split_to_sp(x, grid):  # into the sequence-parallel region: keep this rank's slice; all-gather back
    return Conjugate.apply(x, grid, split_seq, gather_seq)


# torch.compile and the collectives. Traced, the collectives' Python (Grid's counting and timing, the
# process group) would cut every block into several graphs. So each runs as one operator, tp_collective
# (a torch.library custom op, as kernels.py's attention is): the compiler sees a call with known output
# shapes and keeps the block one graph; the call runs the Python above at run time, every time, so Grid
# counts and times each collective, compiled or not.

TP_COLLECTIVES = {fn.__name__: fn for fn in (all_reduce_tp, gather_seq, reduce_scatter_seq, split_seq)}


def collective(fn, x: torch.Tensor, grid: Grid) -> torch.Tensor:
    """fn(x, grid), through tp_collective."""
    if fn is identity:
        return x.view_as(x)  # autograd wants a new tensor, even from the identity
    return tp_collective(x, grid.key, fn.__name__)


@torch.library.custom_op("nanoscale::tp_collective", mutates_args=())
def tp_collective(x: torch.Tensor, grid: int, name: str) -> torch.Tensor:
    """TP_COLLECTIVES[name](x, the grid with this key)."""
    return TP_COLLECTIVES[name](x, GRIDS[grid])


@tp_collective.register_fake
def _tp_collective_fake(x, grid, name):  # the output each makes: shape and layout, no data
    tp = GRIDS[grid].tp
    if name == "all_reduce_tp":
        return x.new_empty(x.shape)
    if name == "split_seq":
        return x.new_empty((x.size(0), x.size(1) // tp, *x.shape[2:]))
    return seq_major(x, x.size(1) * tp if name == "gather_seq" else x.size(1) // tp)


class SplitSeq(torch.nn.Module):
    """After the embedding: enter the sequence-parallel region (when the grid has one)."""

    def __init__(self, grid: Grid):
        super().__init__()
        self.grid = grid

    def forward(self, x):
        return split_to_sp(x, self.grid) if self.grid.sp_on else x


def shard_spec(grid: Grid, dim: int, groups: int = 1) -> dict:
    """Which slice of the full tensor this rank holds: split `dim` into `groups` blocks (q, k, v
    for the fused projection) and keep part `index` of `count` from each."""
    return {"dim": dim, "index": grid.tp_rank, "count": grid.tp, "groups": groups}


def meta_param(*shape, spec: dict | None = None, **attrs) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.empty(*shape, device="meta"))
    p.shard = spec
    p.__dict__.update(attrs)
    return p


class ColumnParallelLinear(torch.nn.Module):
    """y = x A^T + b with A split by output features: each rank computes its own columns of y.
    `groups` > 1 splits each of that many blocks of outputs (q, k and v) separately, so every
    rank gets whole heads of each."""

    def __init__(self, in_features: int, out_features: int, grid: Grid, bias: bool = True, groups: int = 1):
        super().__init__()
        self.grid = grid
        spec = shard_spec(grid, 0, groups)
        self.weight = meta_param(out_features // grid.tp, in_features, spec=spec)
        self.bias = meta_param(out_features // grid.tp, spec=spec) if bias else None

    def forward(self, x):
        x = gather_from_sp(x, self.grid) if self.grid.sp_on else copy_to_tp(x, self.grid)
        return torch.nn.functional.linear(x, self.weight, self.bias)  # (B, T, out / tp)


class RowParallelLinear(torch.nn.Module):
    """y = x A^T + b with A split by input features: each rank holds a slice of x's features and
    produces a partial sum of y; g sums them. The bias is replicated and added once, after."""

    def __init__(self, in_features: int, out_features: int, grid: Grid):
        super().__init__()
        self.grid = grid
        self.weight = meta_param(out_features, in_features // grid.tp, spec=shard_spec(grid, 1))
        self.bias = meta_param(out_features, sequence_parallel=grid.sp)

    def forward(self, x):
        y = torch.nn.functional.linear(x, self.weight)  # (B, T, out), a partial sum
        y = scatter_to_sp(y, self.grid) if self.grid.sp_on else reduce_from_tp(y, self.grid)
        return y + self.bias


class VocabParallelEmbedding(torch.nn.Module):
    """Rank r holds rows [r V/tp, (r+1) V/tp) of the table. Each rank looks up the tokens it owns,
    writes zeros for the rest, and g sums the ranks' partial embeddings."""

    def __init__(self, vocab: int, dim: int, grid: Grid):
        super().__init__()
        self.grid = grid
        self.weight = meta_param(vocab // grid.tp, dim, spec=shard_spec(grid, 0))

    @property
    def vocab_start(self) -> int:
        return self.grid.tp_rank * self.weight.size(0)

    def forward(self, idx):
        local = idx - self.vocab_start
        outside = (local < 0) | (local >= self.weight.size(0))
        out = torch.nn.functional.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, C)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.grid)


class VocabParallelLoss(torch.nn.Module):
    """The model's loss layer under tensor parallelism (model.CrossEntropy on one device). Rank r
    holds rows [vocab_start, vocab_start + V/tp) of the output layer and computes only those logits,
    a chunk of rows at a time (lmhead.lm_head_loss). The loss never gathers them (Megatron, section 3):

        m   = max over all ranks of the logits          (all-reduce MAX, B*T floats)
        S   = sum over all ranks of exp(logit - m)      (all-reduce SUM of S and z_t
        z_t = the target's logit - m, from its owner     together, 2 B*T floats)
        loss = log S - z_t;   d loss / d logits = softmax - onehot(target)

    Its input enters the tensor-parallel region like any column-parallel layer's: f (or the
    sequence all-gather under --sp), so the partial input gradients of the ranks are summed."""

    def __init__(self, grid: Grid, vocab_start: int):
        super().__init__()
        self.grid, self.vocab_start = grid, vocab_start

    def forward(self, x, weight, targets):
        x = gather_from_sp(x, self.grid) if self.grid.sp_on else copy_to_tp(x, self.grid)
        return lm_head_loss(x, weight, targets, self.vocab_start, self.reduce)

    def reduce(self, t: torch.Tensor, op: str) -> None:
        self.grid.all_reduce(t, "tp", op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)


class GatherVocab(torch.nn.Module):
    """(B, V/tp) vocab shards -> (B, V) on every rank, for sampling (nn.Identity on one device)."""

    def __init__(self, grid: Grid):
        super().__init__()
        self.grid = grid

    def forward(self, x):
        out = x.new_empty((self.grid.tp * x.size(0), *x.shape[1:]))  # (tp * B, V/tp): ranks stacked on dim 0
        self.grid.all_gather(out, x.contiguous(), "tp")
        return torch.cat(out.chunk(self.grid.tp), dim=-1)


def apply_tensor_parallel(model: gpt.GPT, grid: Grid) -> None:
    """Swap a meta-built GPT's layers for their tensor-parallel versions, in place."""
    cfg = model.config
    C, V = cfg.n_embd, cfg.padded_vocab
    for block in model.transformer.h:
        block.attn.c_attn = ColumnParallelLinear(C, 3 * C, grid, groups=3)  # whole heads of q, k, v
        block.attn.c_proj = RowParallelLinear(C, C, grid)
        block.mlp.c_fc = ColumnParallelLinear(C, 4 * C, grid)
        block.mlp.c_proj = RowParallelLinear(4 * C, C, grid)
    model.transformer.wte = VocabParallelEmbedding(V, C, grid)
    model.lm_head = ColumnParallelLinear(C, V, grid, bias=False)
    model.lm_head.weight = model.transformer.wte.weight  # still tied: both hold vocab rows of rank r
    model.transformer.drop = torch.nn.Sequential(SplitSeq(grid), model.transformer.drop)
    if grid.sp:  # LayerNorms now see only their slice of the sequence: their gradients are partial sums
        for name, p in model.named_parameters():
            if ".ln_" in name or "ln_f" in name:
                p.sequence_parallel = True
    model.loss = VocabParallelLoss(grid, model.transformer.wte.vocab_start)
    model.gather_vocab = GatherVocab(grid)
