"""Parallelism from raw torch.distributed primitives: how ranks are arranged, and how they talk.

The process grid. `world = dp * cp * tp * pp` ranks, numbered so that tensor-parallel ranks are
adjacent (they exchange the most data, so they should share a node), then context parallel
(which passes keys and values around a ring every layer), then data parallel, then pipeline:

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

    pp=2, dp=2, tp=2:         tp group: ranks that split each layer      {0,1} {2,3} {4,5} {6,7}
       stage 0: [0 1] [2 3]   dp group: ranks that hold the same shard   {0,2} {1,3} {4,6} {5,7}
       stage 1: [4 5] [6 7]   pp group: ranks that pass activations      {0,4} {1,5} {2,6} {3,7}

With --ep (expert parallelism, moe.py) the data-parallel ranks are cut into groups of ep consecutive
ones: each rank of an `ep` group holds 1/ep of every MoE layer's experts, and the `edp` group joins the
dp/ep ranks that hold the same experts (ep_rank = dp_rank % ep), over which their gradients are summed:

    dp=4, ep=2:   ep groups {dp 0, 1} {dp 2, 3}     edp groups {dp 0, 2} {dp 1, 3}

(With --cp too, an ep group's ranks share a cp rank, and edp spans the cp ranks as well: dp/ep x cp.)

With --cp (context parallelism, context.py) the cp ranks of one data-parallel rank read the same
sequences and each keeps a slice of every one; their weights are replicas, so gradients are averaged
over the `dp_cp` group of all dp x cp ranks that hold the same shard (Megatron's "data parallel
group with context parallel").

`Grid` owns this arithmetic, and every layout fact: the degrees, this rank's coordinates, its
pipeline neighbours, whether the sequence is sharded (`sp`, `cp`), which replica of a tensor counts.
Nothing else computes ranks. Every collective goes through it too, in one wrapper that counts the
bytes (`Traffic`: --comm-report holds them to the papers' formulas); a point-to-point message goes over
its own group (the pipeline's, the cp ring's), which on NCCL is its own communicator and stream, so a
ring's messages overlap a pipeline's. Names that hold the same ranks share one communicator
(dp_cp, zs and node often do; pp and embed at pp 2), but the ring's and the experts'
(`communicators`).

The instruments' seam. `Grid.observer` (support/observer.py) is an object of methods that do nothing,
called at named points of a step: by Grid's wrapper around each collective, and by the loop (train.py) at
the step's begin and end, after the gradients, after the update, around each compute span, after each
checkpoint, on a resume and at the end. The instruments (instruments/: the timeline, per-layer
statistics, the reports, the dashboard) subclass it; train.py's main attaches them when that folder is
there, and nothing here imports one.

When a peer fails. gloo's calls return when the data has moved, and raise when a peer is gone or
--timeout passes: `peer_call` (support/interrupt.py) makes that one PeerError line (train.py: exit
status 3). Every group waits --timeout, not only the world's (`join` gives it to each), and a
peer that never joins is the same line (`connect`). NCCL's calls
return as soon as the GPU has the work, so nothing raises; its watchdog thread ends a collective that
outlived --timeout and aborts its communicator (`connect` tells it not to end the process too), and
every read of a collective's result by the host (`interrupt.host_read`: the loop's one read a
step, `Grid.agree`) waits for the device bounded (`Grid.wait_for_device`) and reads what the
watchdog found before it trusts the value, for the same PeerError.

The other parallel questions live beside it: shard.py (Megatron's tensor-parallel layers, and a
rank's part of the model), context.py (a sequence split over ranks), pipeline.py (schedules and the
executor), gradients.py and zero.py (data-parallel averaging, ZeRO, the gradient norm).
"""

import contextlib
import itertools
import os
import pickle
import weakref
from collections import defaultdict
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from support import interrupt
from support.devices import LayoutError, local_gpu  # (LayoutError: raised here too; caught as parallel.*)
from support.interrupt import peer_call, wait_for_device
from support.observer import Observer

all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


# Every Grid, by its key: the tensor-parallel operator (tp_collective) takes a grid as a number, since an
# operator's arguments are tensors and plain values. Weak: a grid nothing else holds goes away.
GRIDS: "weakref.WeakValueDictionary[int, Grid]" = weakref.WeakValueDictionary()
_GRID_KEYS = itertools.count()


class Traffic:
    """Calls and bytes per (collective, group) since the last reset. Bytes are the size of the full
    buffer (all-reduce input, all-gather output, reduce-scatter input, each message sent)."""

    def __init__(self):
        self.counts = defaultdict(lambda: [0, 0])

    def add(self, op: str, group: str, nbytes: int) -> None:
        self.counts[(op, group)][0] += 1
        self.counts[(op, group)][1] += nbytes

    def reset(self) -> None:
        self.counts.clear()


@dataclass(frozen=True)
class Placement:
    """Where a parameter's values live across the grid: one record, read by `owns`, the gradient
    buckets and norms, the checkpoints (a plain parameter: the default, whole and replicated)."""
    shard: dict | None = None  # its tensor-parallel (or expert-parallel) slice: shard.shard_spec
    replicas: str = "dp_cp"  # the group of copies whose gradients are summed ("edp": experts)
    split: tuple[str, ...] = ()  # groups that split it beyond tp ("ep"): norms sum over them
    sequence_parallel: bool = False  # its gradient is partial over tp (sp's norms and biases)
    tied: bool = False  # one of the pipeline's two copies of the tied embedding: a bucket alone
    tied_copy: bool = False  # the last pipeline stage's copy of it, which never counts


PLAIN = Placement()


def placement(p: torch.Tensor) -> Placement:
    """p's record, or a plain parameter's."""
    return p.__dict__.get("placement", PLAIN)


def place(p: torch.Tensor, **changes) -> None:
    """Set fields of p's record (the only writer; model.materialize carries it over)."""
    p.placement = replace(placement(p), **changes)


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
    ep: int = 1  # expert parallelism: consecutive data-parallel ranks that split the experts (moe.py)
    vp: int = 1  # virtual pipeline stages (chunks of layers) per pipeline rank: the interleaved schedule's v
    zero_shard: int = 0  # hybrid ZeRO: shard over groups of this many dp x cp ranks (0: all of them; zero.py)
    gpus_per_node: int = 0  # ranks per node: which groups cross nodes (0: one node holds every rank)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    groups: dict = field(default_factory=dict)  # "tp" / "dp" / "pp" / "embed" -> this rank's group
    members: dict = field(default_factory=lambda: defaultdict(tuple))  # the same names -> its global ranks
    traffic: Traffic = field(default_factory=Traffic)  # this step's bytes, counted (--comm-report)
    observer: Observer = field(default_factory=Observer)  # the instruments, when a run attaches them
    timeout_s: float = 300.0  # --timeout: how long a collective may wait for a peer (connect sets it)
    crash_at: str = ""  # --crash-at, for its stalls (interrupt.stall; connect sets it)
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
    def ep_rank(self) -> int:
        """Which part of the experts this rank holds: its place in its group of ep data-parallel ranks."""
        return self.dp_rank % self.ep

    @property
    def edp_rank(self) -> int:
        """This rank's place among the dp / ep x cp ranks that hold the same experts (their `edp` group)."""
        return self.dp_rank // self.ep * self.cp + self.cp_rank

    @property
    def dp_cp(self) -> int:
        """Ranks that hold the same weights and average their gradients: data and context parallel."""
        return self.dp * self.cp

    @property
    def dp_cp_rank(self) -> int:
        return self.dp_rank * self.cp + self.cp_rank

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
        return ((pp_rank * self.dp + dp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    # Hybrid ZeRO (zero.py) cuts the dp x cp ranks into shard groups of `zs` consecutive ones (`zs`; the
    # same place in each: `zr`, the replicas), and nodes into `node` (the dp x cp ranks of one node) and
    # `nodes` (the same place on every node): consecutive ranks share a node, tp ranks first.
    @property
    def zs(self) -> int:
        """ZeRO's shard group: --zero-shard N, or every dp x cp rank (plain ZeRO)."""
        return self.zero_shard or self.dp_cp

    @property
    def zs_rank(self) -> int:
        return self.dp_cp_rank % self.zs

    @property
    def zr_rank(self) -> int:
        """Which replica of the shards this rank's shard group is."""
        return self.dp_cp_rank // self.zs

    @property
    def node_dp(self) -> int:
        """dp x cp ranks per node (--gpus-per-node over tp: a node holds whole tp groups), at most all of them."""
        return min(self.gpus_per_node // self.tp, self.dp_cp) if self.gpus_per_node else self.dp_cp

    def crosses_nodes(self, group: str) -> bool:
        """Do the group's ranks sit on more than one node?"""
        nodes = {r // self.gpus_per_node for r in self.members.get(group, ())} if self.gpus_per_node else ()
        return len(nodes) > 1

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
        Counting a replica twice is the classic clipping bug of model parallelism. An expert's
        weights (replicas "edp") are split over the ep ranks, and copied on the dp / ep groups of
        them, the cp and the tp ranks: tp and cp rank 0's of the first group count."""
        where = placement(p)
        if where.tied_copy:
            return False
        if where.replicas == "edp":  # split over ep; copies over tp, cp and the dp / ep groups
            return (self.edp_rank == 0 or not replicated_over_dp) and self.tp_rank == 0
        # (hybrid ZeRO: the shards of the first shard group; the other groups hold replicas of them)
        counted = self.dp_cp_rank == 0 or (not replicated_over_dp and self.zr_rank == 0)
        return counted and (where.shard is not None or self.tp_rank == 0)

    @contextlib.contextmanager
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

    def barrier(self) -> None:
        if self.world > 1:
            peer_call(dist.barrier, what="a barrier of every rank")

    def wait_for_device(self) -> None:
        """The step's sync point, bounded: on NCCL a dead or hung peer is one PeerError line after at most
        --timeout, where the plain wait would hang (support/interrupt.py)."""
        wait_for_device(self)

    def agree(self, ok: bool) -> bool:
        """True when every rank says ok (one small all-reduce): for what all ranks must decide alike."""
        if self.world == 1:
            return ok
        flag = torch.tensor([0.0 if ok else 1.0], device=self.device)
        self.all_reduce(flag, "world")
        return interrupt.host_read(self, flag, "agreeing with every rank (over world)") == [0]

    def rank0_first(self, fn):
        """Run fn on rank 0, then on the others (e.g. prepare data once, then read the cache)."""
        result = fn() if self.rank == 0 else None
        self.barrier()
        return result if self.rank == 0 else fn()

    # Every collective in the codebase goes through these methods, and each through `collective`.
    def size(self, group: str) -> int:
        return {"tp": self.tp, "dp": self.dp, "pp": self.pp, "cp": self.cp, "dp_cp": self.dp_cp,
                "world": self.world, "embed": 2 if self.pp > 1 else 1, "ep": self.ep,
                "edp": self.dp // self.ep * self.cp, "zs": self.zs, "zr": self.dp_cp // self.zs,
                "node": self.node_dp, "nodes": self.dp_cp // self.node_dp}[group]

    def label(self, group: str) -> str:
        """The group's name in reports: the dp x cp group is plain "dp" when there is no context parallelism."""
        return "dp" if group == "dp_cp" and self.cp == 1 else group

    def describe(self, op: str, group: str) -> str:
        """'all_reduce over dp (ranks 0, 2)': a call named by its peers, for PeerError."""
        m = self.members.get(group, ())
        ranks = ", ".join(map(str, m)) if len(m) <= 8 else f"{m[0]}, {m[1]}, … {m[-1]}: {len(m)} ranks"
        return f"{op} over {self.label(group)} (ranks {ranks})"

    def collective(self, name: str, group: str, nbytes: int, call, *args, **kwargs):
        """The one wrapper: count the call's bytes, let the observer see it, make it (a failure is a
        PeerError line). Returns the call's handle (async_op) or None."""
        self.traffic.add(name, self.label(group), nbytes)
        if self.crash_at and interrupt.crash_due(self.crash_at, self.rank, f"stall:{group}"):
            interrupt.stall()  # (fault injection: this rank never joins the call)
        start = lambda: peer_call(call, *args, group=self.groups.get(group), what=self.describe(name, group), **kwargs)
        return self.observer.collective(name, self.label(group), self.members[group], nbytes, start)

    def all_reduce(self, t: torch.Tensor, group: str, op=dist.ReduceOp.SUM, async_op: bool = False):
        if self.size(group) == 1:
            return None
        return self.collective("all_reduce", group, t.numel() * t.element_size(), dist.all_reduce, t, op=op,
                               async_op=async_op)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: str, async_op: bool = False):
        """out = concat over the group's ranks of inp, along dim 0."""
        if self.size(group) == 1:
            out.copy_(inp)
            return None
        return self.collective("all_gather", group, out.numel() * out.element_size(), all_gather_single, out, inp,
                               async_op=async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group: str, async_op: bool = False):
        """out = this rank's dim-0 slice of the sum over the group of inp."""
        if self.size(group) == 1:
            out.copy_(inp)
            return None
        return self.collective("reduce_scatter", group, inp.numel() * inp.element_size(), reduce_scatter_single, out,
                               inp, async_op=async_op)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, group: str, out_splits: list[int] | None = None,
                   in_splits: list[int] | None = None, nbytes: int | None = None) -> None:
        """out[r] = what rank r of the group sent this rank: its inp[this rank] (equal pieces along dim 0, or
        uneven ones: in_splits[r] rows of inp go to rank r, out_splits[r] rows come from it). Counted: the
        bytes of inp, or `nbytes` where the caller says what its formula counts (expert parallelism's rows
        of this rank's own tokens, moe.py: what a rank receives depends on the routing)."""
        if self.size(group) == 1:
            out.copy_(inp)
            return
        self.collective("all_to_all", group, inp.numel() * inp.element_size() if nbytes is None else nbytes,
                        dist.all_to_all_single, out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits)

    def gather_objects(self, obj) -> list:
        """Every rank's `obj` (any picklable value, counted by its pickled size), in rank order, on every
        rank: what a report gathers to rank 0 once, after a step."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        self.collective("all_gather_object", "world", len(pickle.dumps(obj)), dist.all_gather_object, out, obj)
        return out

    def send_recv(self, sends: list[tuple], recvs: list[tuple], group: str = "pp", wait: bool = True):
        """Point-to-point, posted together so that paired sends and receives cannot deadlock. Each item
        is (tensor, peer rank) or (tensor, peer, tag): two messages between the same pair in one batch
        need different tags. With wait=False the transfers run on while the caller computes; it gets
        the list of pending works and must wait on each before touching the tensors. Each message sent
        is counted ("send"); the observer sees the batch as one "p2p" among its peers."""
        sends = [(t.contiguous(), *rest) for t, *rest in sends]
        pg = self.groups.get(group)  # the group's own communicator (on NCCL, its own stream): rings and
        ops = [dist.P2POp(dist.isend, t, peer, group=pg, tag=tag[0] if tag else 0)  # pipelines overlap
               for t, peer, *tag in sends]
        ops += [dist.P2POp(dist.irecv, t, peer, group=pg, tag=tag[0] if tag else 0) for t, peer, *tag in recvs]
        for t, *_ in sends:
            self.traffic.add("send", self.label(group), t.numel() * t.element_size())
        if not ops:
            return []
        peers = tuple(sorted({self.rank, *(peer for _, peer, *_ in sends + recvs)}))
        what = f"point-to-point with rank{'s' if len(peers) > 2 else ''} " + ", ".join(
            str(r) for r in peers if r != self.rank)
        works = self.observer.collective("p2p", self.label(group), peers, sum(t.numel() * t.element_size()
                                                                              for t, *_ in sends),
                                         lambda: peer_call(dist.batch_isend_irecv, ops, what=what))
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
        if self.ep > 1:
            groups = " ".join("{" + " ".join(f"dp {d}" for d in range(g, g + self.ep)) + "}"
                              for g in range(0, self.dp, self.ep))
            lines.append(f"  expert parallel (ep {self.ep}): {groups}: each group holds every expert, dp rank d its "
                         f"part d % {self.ep}; the same parts (edp) sum their gradients")
        if self.zs < self.dp_cp:
            lines.append(f"  hybrid ZeRO: shard groups (zs) of {self.zs} consecutive dp x cp ranks, "
                         f"{self.dp_cp // self.zs} replicas of the shards (zr)")
        if self.gpus_per_node:
            lines.append(f"  nodes of {self.gpus_per_node} ranks: {self.node_dp} dp x cp ranks per node, "
                         f"a dp x cp group on {self.dp_cp // self.node_dp}")
        return "\n".join(lines)


def init_grid(tp: int, pp: int, device: torch.device, timeout_s: float = 300, sp: bool = False,
              cp: int = 1, cp_attn: str = "ring", vp: int = 1, ep: int = 1, **nodes) -> Grid:
    """`layout`, then `connect`: the grid this process belongs to, with its process groups."""
    grid = layout(tp, pp, device, sp=sp, cp=cp, cp_attn=cp_attn, vp=vp, ep=ep, **nodes)
    connect(grid, timeout_s)
    return grid


def layout(tp: int, pp: int, device: torch.device, sp: bool = False, cp: int = 1, cp_attn: str = "ring",
           vp: int = 1, ep: int = 1, zero_shard: int = 0, gpus_per_node: int = 0) -> Grid:
    """The grid that torchrun's WORLD_SIZE and RANK describe, before any process talks to another: every
    rank computes the same one, so an impossible layout fails on every rank alike, at once."""
    world = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun
    rank = int(os.environ.get("RANK", "0"))
    if world % (tp * pp * cp):
        raise LayoutError(f"world size {world} is not divisible by tp*cp*pp = {tp}*{cp}*{pp}; launch a "
                          f"multiple of {tp * cp * pp} processes or change --tp/--cp/--pp")
    dp = world // (tp * pp * cp)
    if dp % ep:
        raise LayoutError(f"--ep {ep} does not divide the data-parallel degree {dp} (= {world} processes / tp*cp*pp): "
                          "expert-parallel groups are cut out of the data-parallel ranks")
    check_nodes(dp * cp, tp, zero_shard, gpus_per_node)
    if device.type == "cuda" and device.index is None:  # an index was settled by devices.pick_device
        device = local_gpu()
    return Grid(tp=tp, pp=pp, cp=cp, dp=dp, rank=rank, sp=sp, cp_attn=cp_attn, vp=vp, ep=ep, device=device,
                zero_shard=zero_shard, gpus_per_node=gpus_per_node)


def check_nodes(dp_cp: int, tp: int, zero_shard: int, gpus_per_node: int) -> None:
    """Hybrid ZeRO's shard groups divide the dp x cp ranks evenly, and a node holds whole tp groups and a
    whole number of ... dp x cp ranks that divides them (or all of them)."""
    if zero_shard and dp_cp % zero_shard:
        raise LayoutError(f"--zero-shard {zero_shard} does not divide the {dp_cp} data-parallel ranks (x cp): shard "
                          "groups are equal")
    if gpus_per_node and (gpus_per_node % tp or dp_cp % min(gpus_per_node // tp, dp_cp)):
        raise LayoutError(f"--gpus-per-node {gpus_per_node} does not fit the layout: a node holds whole "
                          f"tensor-parallel groups (tp {tp}) and a number of data-parallel ranks (x cp) that divides "
                          f"their {dp_cp}")


def connect(grid: Grid, timeout_s: float = 300, crash_at: str = "") -> None:
    """Join the process group that torchrun describes (none for one process) and build the
    groups (`join`). A peer that does not come within --timeout is one PeerError line, as a peer
    that fails in training is."""
    grid.timeout_s, grid.crash_at = timeout_s, crash_at
    if grid.world == 1:
        return
    if interrupt.crash_due(crash_at, grid.rank, "stall:connect"):
        interrupt.stall()  # (fault injection: a peer that hangs before it joins)
    try:
        join(grid, timedelta(seconds=timeout_s))
    except dist.DistError as e:  # (DistStoreError: a rank that never came, or hangs in its set-up)
        at = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        where = f"rank {grid.rank}, joining the {grid.world} processes of the job (at {at})"
        raise interrupt.PeerError(where, interrupt.in_a_line(e)) from e


def join(grid: Grid, timeout: timedelta) -> None:
    """The process group, then every group of `group_layouts`: every rank creates every group in
    the same order, as new_group requires, each with --timeout (new_group's default is torch's own:
    30 minutes on gloo, 10 on NCCL), one communicator for names that hold the same ranks."""
    world, rank = grid.world, grid.rank
    # A launcher that restarts the job (torchrun --max-restarts) keeps its key-value store; keys
    # from the dead attempt would point new groups at dead peers, so each attempt gets a prefix.
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
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
                            timeout=timeout, device_id=grid.device if nccl else None)
    made = {}  # key -> its communicator
    for name, ranks, key in communicators(group_layouts(grid)):
        if key is not None and key not in made:
            made[key] = dist.new_group(list(ranks), timeout=timeout)
        if rank not in ranks:
            grid.members.setdefault(name, ())  # (embed: a middle pipeline stage is in none)
            continue
        grid.members[name] = ranks
        if len(ranks) == world:
            grid.groups[name] = None  # the default group already is this group
        elif key is not None:
            grid.groups[name] = made[key]


def group_layouts(grid: Grid) -> dict[str, torch.Tensor]:
    """Every group of each name, a row of global ranks each: tp, cp, dp, dp_cp, pp; zs / zr and
    node / nodes (groups of consecutive dp x cp ranks, and the same place in each); ep / edp with
    experts; embed (the first and the last stage) with a pipeline; world."""
    world, tp, pp, cp = grid.world, grid.tp, grid.pp, grid.cp
    ids = torch.arange(world).view(pp, grid.dp, cp, tp)  # ids[pp_rank, dp_rank, cp_rank, tp_rank] = rank
    layouts = {"tp": ids.reshape(-1, tp), "cp": ids.permute(0, 1, 3, 2).reshape(-1, cp),
               "dp": ids.permute(0, 2, 3, 1).reshape(-1, grid.dp),
               "dp_cp": ids.permute(0, 3, 1, 2).reshape(-1, grid.dp * cp),
               "pp": ids.permute(1, 2, 3, 0).reshape(-1, pp)}
    rows = layouts["dp_cp"]  # groups of n consecutive dp x cp ranks, and the same place in each
    for inner, outer, n in (("zs", "zr", grid.zs), ("node", "nodes", grid.node_dp)):
        layouts[inner] = rows.reshape(-1, n)
        layouts[outer] = rows.reshape(rows.size(0), -1, n).transpose(1, 2).reshape(-1, rows.size(1) // n)
    if grid.ep > 1:  # dp ranks in groups of ep consecutive ones (ep), and the same place in each group (edp)
        experts = ids.view(pp, grid.dp // grid.ep, grid.ep, cp, tp)
        layouts["ep"] = experts.permute(0, 1, 3, 4, 2).reshape(-1, grid.ep)
        layouts["edp"] = experts.permute(0, 2, 4, 1, 3).reshape(-1, grid.dp // grid.ep * cp)
    if pp > 1:  # the first and last stage both hold the tied embedding
        layouts["embed"] = torch.stack([ids[0], ids[-1]], dim=-1).reshape(-1, 2)
    layouts["world"] = ids.reshape(1, world)
    return layouts


# A communicator of their own, even where another name holds the same ranks (cp and dp_cp at dp 1,
# ep and dp_cp when ep is all of dp): on NCCL a communicator is one stream, and the forward and the
# backward wait for the ring's messages and the experts' all-to-alls, which must not queue behind
# the gradient buckets' reductions that run beside the backward.
OWN_COMMUNICATOR = ("cp", "ep")


def communicators(layouts: dict[str, torch.Tensor]) -> list[tuple[str, tuple, tuple | None]]:
    """(name, ranks, key) for every group of every name, in one order on every rank. Groups of one
    key are one communicator (new_group makes a new one at every call: on NCCL, GPU memory and a
    stream each): the key is the ranks, so that dp_cp, zs and node are one where they hold the same
    ranks, as are pp and embed at pp 2. None: no communicator of its own (the world's group, one
    rank's). dp without cp holds dp_cp's ranks, so it is dp_cp's communicator."""
    world, out = layouts["world"].size(1), []
    for name, rows in layouts.items():
        for ranks in map(tuple, rows.tolist()):
            own = 1 < len(ranks) < world
            key = (ranks, name if name in OWN_COMMUNICATOR else "") if own else None
            out.append((name, ranks, key))
    return out


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
