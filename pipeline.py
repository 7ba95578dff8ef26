"""Pipeline parallelism: the layers cut into p stages, one per rank, and a batch into m micro-batches
that flow through them. A stage runs the forward (F) of a micro-batch once the stage before it has,
and its backward (B) once the stage after it has.

A schedule is just the order in which one stage runs its forwards and backwards:

  gpipe (Huang et al. 2019): all m forwards, then all m backwards. Every stage holds the
      activations of all m micro-batches at once.
  1f1b (PipeDream-Flush; Narayanan et al. 2021, section 2.2.1), in three phases:

          warm-up     p - rank - 1 forwards, while micro-batch 0 goes on to the last stage and its
                      gradient comes back
          steady      one forward, then one backward, in turn
          cool-down   the backwards still to run

          p = 4, m = 6     warm-up     steady                  cool-down
            stage 0        F0 F1 F2    F3 B0 F4 B1 F5 B2       B3 B4 B5
            stage 3                    F0 B0 F1 B1 ... F5 B5

      Each backward frees its micro-batch's activations, so a stage holds at most p - rank of
      them, whatever m is.

Either way each stage idles for (p - 1) of (m + p - 1) time slots: the bubble.

Schedules are data (lists of ops), so `simulate` can lay them on a clock, `draw_schedule` print
them, `check_messages` prove their sends and receives pair up, and the `Pipeline` executor run
whichever one it is given. `generate` samples across the stages.

Interleaved 1F1B (the same paper, section 2.2.2) gives each rank v chunks of layers instead of one
stage, for a bubble about v times smaller. It is an extension, in its own section near the end
(`interleaved_1f1b`, `InterleavedPipeline`): everything before it reads as plain 1F1B, and a first
reading can skip it. Where the code before it is already general, it says so: an op may name a
chunk, and a stage may be a virtual one (`virtual_stage`).
"""

from collections import defaultdict
from dataclasses import dataclass, field

import torch

import dropout
import model as gpt
from parallel import Grid, LayoutError
from shard import rank_layers

Op = tuple  # ("F" | "B", micro): one micro-batch's forward or backward; interleaved, ("F" | "B", micro, chunk)

# ----------------------------------------------------------------------------- schedules


def gpipe(p: int, rank: int, m: int) -> list[tuple[str, int]]:
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def one_f_one_b(p: int, rank: int, m: int) -> list[tuple[str, int]]:
    w = min(p - rank - 1, m)  # the warm-up's forwards
    warm_up = [("F", i) for i in range(w)]
    steady = [op for i in range(w, m) for op in (("F", i), ("B", i - w))]  # forward i, backward i - w
    cool_down = [("B", i) for i in range(m - w, m)]
    return warm_up + steady + cool_down


def op_parts(op: Op) -> tuple[str, int, int]:
    """(kind, micro, chunk); an op without a chunk runs chunk 0, its stage's only one."""
    return (op[0], op[1], op[2] if len(op) > 2 else 0)


def virtual_stage(op: Op, rank: int, p: int) -> int:
    """The stage an op runs: `rank`, the rank's own. (Interleaved, chunk c of rank r is virtual stage
    c * p + r: see the interleaving section.)"""
    return op_parts(op)[2] * p + rank


def n_chunks(stage_ops: list[list[Op]]) -> int:
    """How many chunks each rank holds: 1, or interleaved v."""
    return 1 + max(op_parts(op)[2] for row in stage_ops for op in row)


# ----------------------------------------------------------------------------- the clock


def simulate(stage_ops: list[list[Op]]) -> list[list[tuple[int, str, int, int]]]:
    """Place each stage's ops on a clock where F and B take one slot, F(i) waits for F(i) on the
    stage before and B(i) for B(i) on the one after (interleaved: on the virtual stage before and
    after; an op is one chunk's work, so a slot is 1/v of a stage's time). A backward may also be
    drawn split as zero-bubble schedules split it: B then computes only the input's gradient, and
    ("W", i), the weights' gradient, waits for B(i) on its own stage. Returns (start, kind, micro,
    chunk) per stage."""
    p = len(stage_ops)
    n_stages = p * n_chunks(stage_ops)
    done, free, pos, timeline = {}, [0] * p, [0] * p, [[] for _ in range(p)]
    moved = True
    while moved:
        moved = False
        for r in range(p):
            while pos[r] < len(stage_ops[r]):
                op = stage_ops[r][pos[r]]
                (kind, i, c), s = op_parts(op), virtual_stage(op, r, p)
                dep = (s - 1 if kind == "F" else s + 1, kind, i)  # the stage this op waits for
                dep = (s, "B", i) if kind == "W" else dep  # split backward: W after its own B
                dep = dep if 0 <= dep[0] < n_stages else None
                if dep is not None and dep not in done:
                    break
                start = max(free[r], done.get(dep, 0))
                done[(s, kind, i)] = free[r] = start + 1
                timeline[r].append((start, kind, i, c))
                pos[r], moved = pos[r] + 1, True
    if any(pos[r] < len(stage_ops[r]) for r in range(p)):
        raise LayoutError("this pipeline schedule deadlocks")
    return timeline


def bubble_fraction(stage_ops: list[list[Op]]) -> float:
    """Idle slots / all slots, for the ops the stages actually ran."""
    timeline = simulate(stage_ops)
    span = max(t[0] + 1 for ops in timeline for t in ops)
    busy = sum(len(ops) for ops in timeline)
    return 1 - busy / (span * len(timeline))


def bubble_formula(p: int, m: int, v: int = 1) -> float:
    """The papers' bubble: (p - 1) / (m + p - 1), and (p - 1) / (v m + p - 1) interleaved."""
    return (p - 1) / (v * m + p - 1)


BUBBLE_WARNING = 0.3  # train.py warns when the pipeline would idle more than this share of a step


def bubble_warning(p: int, m: int, v: int = 1) -> str | None:
    """The line train.py logs when a pipeline would idle more than BUBBLE_WARNING of each step: fewer
    than about 2.3 (p-1)/v micro-batches. m >= 4 p, the rule of thumb of lessons 11 and 12, keeps the
    bubble under 20%."""
    if p == 1 or (bubble := bubble_formula(p, m, v)) <= BUBBLE_WARNING:
        return None
    formula = "(p-1)/(v*m+p-1)" if v > 1 else "(p-1)/(m+p-1)"
    return (f"warning: {m} micro-batches for {p} stages: the pipeline idles {bubble:.0%} of each step "
            f"(bubble {formula}, over {BUBBLE_WARNING:.0%}); use more micro-batches (a smaller "
            "--micro-batch-size or a larger --batch-size)")


def draw_schedule(stage_ops: list[list[Op]]) -> str:
    """The pipeline as text: one row per stage, one column per time slot, '.' where it idles.
    Interleaved, a letter names the chunk: F3a is micro-batch 3 through chunk 0, F3b through chunk 1."""
    timeline = simulate(stage_ops)
    span = max(t[0] + 1 for ops in timeline for t in ops)
    v, m = n_chunks(stage_ops), len({op[1] for op in stage_ops[0]})
    width = 3 if v == 1 else len(str(m - 1)) + 2
    rows = []
    for s, ops in enumerate(timeline):
        cells = [".".rjust(width)] * span
        for start, kind, i, c in ops:
            cells[start] = f"{kind}{i:>2}" if v == 1 else f"{kind}{i}{CHUNK_NAMES[c]}".rjust(width)
        rows.append(f"stage {s} |" + " ".join(cells))
    p, formula = len(stage_ops), "(p-1)/(m+p-1)" if v == 1 else "(p-1)/(v*m+p-1)"
    rows.append(f"bubble {bubble_fraction(stage_ops):.3f} (formula {formula} = {bubble_formula(p, m, v):.3f})")
    return "\n".join(rows)


CHUNK_NAMES = "abcdefghijklmnopqrstuvwxyz"  # draw_schedule's names of chunks 0, 1, 2, ...

# ----------------------------------------------------------------------------- the messages


def peers(op: Op, rank: int, p: int, v: int = 1) -> tuple[int | None, int | None]:
    """(the pipeline rank op receives its input from, the one it sends its output to); None at the
    ends of the pipeline. A forward takes an activation from the stage before and hands one to the
    stage after; a backward takes a gradient from the stage after and hands one to the stage before.
    (Interleaved, consecutive virtual stages sit on consecutive ranks, so the `% p` wraps from rank
    p - 1's chunk c to rank 0's chunk c + 1.)"""
    s = virtual_stage(op, rank, p)
    before = (rank - 1) % p if s > 0 else None
    after = (rank + 1) % p if s < p * v - 1 else None
    return (before, after) if op[0] == "F" else (after, before)


def message_batches(ops: list[Op], rank: int, p: int, v: int = 1, pair: bool = False) -> list[list[tuple]]:
    """The executor's calls to send_recv on one rank, each a list of (direction, peer, message): the
    sends of an op, then the receives of the next. A message is named by (kind, micro, the stage
    that sends it). With `pair` (interleaved), a unit of ops between two calls is `pair_steady`'s."""
    batches, sends = [], []
    for unit in pair_steady(ops) if pair else [[op] for op in ops]:
        recvs, unit_sends = [], []
        for op in unit:
            (kind, i, _), s = op_parts(op), virtual_stage(op, rank, p)
            before, after = peers(op, rank, p, v)
            if before is not None:
                recvs.append(("recv", before, (kind, i, s - 1 if kind == "F" else s + 1)))
            if after is not None:
                unit_sends.append(("send", after, (kind, i, s)))
        batches.append(sends + recvs)
        sends = unit_sends
    return batches + [sends]


def check_messages(stage_ops: list[list[Op]], pair: bool = False) -> None:
    """Prove, on paper, that the executor's messages pair up: replay its batches (`message_batches`)
    under the strictest semantics, NCCL's, where a batch completes only once every peer has posted
    the other side of each of its messages (gloo may buffer a send; NCCL need not). Raise a
    LayoutError if the ranks would wait on each other forever, or if the n-th message from one rank
    to another is not the n-th the receiver expects: messages have one shape, so a wrong order would
    not fail, it would silently swap activations."""
    batches, channels = message_channels(stage_ops, pair)
    for (src, dst), side in channels.items():
        for n, (sent, received) in enumerate(zip(side["send"], side["recv"], strict=True)):
            if sent[0] != received[0]:
                raise LayoutError(f"message {n} from stage {src} to stage {dst} is {sent[0]} but stage {dst} "
                                  f"expects {received[0]}")
    posted, moved = [0] * len(batches), True  # posted[r]: the batch rank r waits in (all before it are posted)
    while moved:
        moved = False
        for r, mine in enumerate(batches):
            while posted[r] < len(mine) and all(  # each peer has posted its side of each message
                    posted[link[direction == "send"]] >= channels[link][OTHER[direction]][n][1]
                    for direction, link, n in mine[posted[r]]):
                posted[r], moved = posted[r] + 1, True
    if any(posted[r] < len(mine) for r, mine in enumerate(batches)):
        raise LayoutError("the pipeline's sends and receives deadlock")


OTHER = {"send": "recv", "recv": "send"}


def message_channels(stage_ops: list[list[Op]], pair: bool) -> tuple[list, dict]:
    """Every rank's batches as lists of (direction, (src, dst), n: the n-th message from src to dst),
    and per (src, dst) what each side posts, in order: (message, the batch it is posted in)."""
    p, v = len(stage_ops), n_chunks(stage_ops)
    batches, channels = [], defaultdict(lambda: {"send": [], "recv": []})
    for r, ops in enumerate(stage_ops):
        batches.append([])
        for b, batch in enumerate(message_batches(ops, r, p, v, pair)):
            batches[r].append([])
            for direction, peer, what in batch:
                link = (r, peer) if direction == "send" else (peer, r)
                batches[r][b].append((direction, link, len(channels[link][direction])))
                channels[link][direction].append((what, b))
    return batches, channels

# ----------------------------------------------------------------------------- the executor


@dataclass
class RunState:
    """One call of `Pipeline.run`: its micro-batches, how to run them, and what running them leaves."""
    micro: list[torch.Tensor]  # each a (b, T + 1) row of tokens: the inputs and, one position on, the targets
    autocast: object  # the precision's context manager (stability.py)
    train: bool  # False: the forwards alone, nothing stashed (evaluation)
    scale: float  # what the backward multiplies the loss by (fp16's loss scale)
    loss: torch.Tensor  # the mean loss, added up by the last stage (0 elsewhere)
    stash: dict = field(default_factory=dict)  # (micro,) -> (input, output) of its forward, until its backward
    peak: int = 0  # the most micro-batches stashed at once


class Pipeline:
    """Runs this stage's ops of a schedule, one at a time. Before an op it receives what the op needs
    (an activation from the stage before for F, a gradient from the stage after for B), in one batch
    (`Grid.send_recv`) with the send of what the op before it made: a send is always in flight
    together with the receive that matches it, so neither side can wait on the other forever
    (`check_messages` proves it for every schedule). Shapes are fixed by the configuration, so no
    message announces a shape.

    A forward stashes its input and output until its micro-batch's backward pops them: that stash is
    the activation memory 1F1B bounds (`peak_live` records the most it held).

    The executor also decides which backward is the last of the step, so it owns the data-parallel
    flag that says when gradients are reduced (`grad_sync`, a gradients.GradSync, or None).

    `InterleavedPipeline` (the last section) is this class with four methods changed: `ops`,
    `units`, `peers` and `place`."""

    def __init__(self, model: gpt.GPT, grid: Grid, schedule: str, grad_sync=None):
        self.model, self.grid, self.schedule, self.grad_sync = model, grid, schedule, grad_sync
        self.p, self.rank = grid.pp, grid.pp_rank
        self.dtype = next(model.parameters()).dtype
        self.ops_run, self.peak_live = [], 0  # what the last run did, for --print-schedule

    def run(self, micro: list[torch.Tensor], autocast, train: bool = True, scale: float = 1.0) -> torch.Tensor:
        """Forward (and backward) of every micro-batch (rows of T+1 tokens); returns the mean loss
        on the last stage, 0 elsewhere. Without training, the schedule's forwards alone, in its order."""
        state = RunState(micro, autocast, train, scale, torch.zeros((), device=self.grid.device))
        ops = [op for op in self.ops(len(micro)) if train or op[0] == "F"]
        sends = []  # what the last op made, for its neighbour: posted with the next op's receive
        for unit in self.units(ops):  # [op], one at a time (interleaved: `pair_steady`)
            received = self.exchange(sends, unit, state)
            sends = []
            for op, x in zip(unit, received):
                y = self.forward(op, x, state) if op[0] == "F" else self.backward(op, x, state)
                if (after := self.peers(op)[1]) is not None:
                    sends.append((y, self.grid.stage_rank(after)))
        self.grid.send_recv(sends, [])
        self.ops_run, self.peak_live = ops, state.peak
        return state.loss

    def ops(self, m: int) -> list[Op]:
        """This stage's ops for m micro-batches, in the schedule's order."""
        return SCHEDULES[self.schedule](self.p, self.rank, m)

    def units(self, ops: list[Op]) -> list[list[Op]]:
        """The ops run between two calls to send_recv: one at a time."""
        return [[op] for op in ops]

    def peers(self, op: Op) -> tuple[int | None, int | None]:
        """(the pipeline rank op receives from, the one it sends to): the stages before and after."""
        return peers(op, self.rank, self.p)

    def place(self, op: Op) -> tuple[range | None, bool, bool]:
        """(which of this rank's blocks op runs: all, does it embed the tokens, does it end in the loss)."""
        return None, self.grid.first_stage, self.grid.last_stage

    def exchange(self, sends: list[tuple[torch.Tensor, int]], unit: list[Op],
                 state: RunState) -> list[torch.Tensor | None]:
        """Post the sends of the ops before with the receives of these ops, in one batch; returns what
        each op received (None where it receives nothing: a forward of the first stage reads the
        tokens, a backward of the last starts from the loss)."""
        before = [self.peers(op)[0] for op in unit]
        bufs = [None if b is None else torch.empty(self.act_shape(state.micro[0]), dtype=self.dtype,
                                                   device=self.grid.device) for b in before]
        self.grid.send_recv(sends, [(buf, self.grid.stage_rank(b)) for buf, b in zip(bufs, before) if buf is not None])
        return bufs

    def act_shape(self, micro: torch.Tensor) -> tuple[int, int, int]:
        T = (micro.size(1) - 1) // self.grid.cp  # each context-parallel rank holds T/cp tokens...
        return micro.size(0), T // self.grid.tp if self.grid.sp else T, self.model.config.n_embd  # ...and SP a tp-th

    def forward(self, op: Op, x: torch.Tensor | None, state: RunState) -> torch.Tensor:
        """Micro-batch op[1] through this stage; returns the activation for the stage after."""
        (which, first, last), i, model = self.place(op), op[1], self.model
        with self.grid.observer.span("F"), torch.set_grad_enabled(state.train), state.autocast, \
                dropout.rows(i * len(state.micro[0])):  # its rows' place, for dropout.py
            x = model.embed(state.micro[i][:, :-1]) if first else x.requires_grad_(state.train)
            y = model.blocks(x, which=which)
            if last:
                y = model.head_loss(y, state.micro[i][:, 1:]) / len(state.micro)
                state.loss += y.detach()
        if state.train:
            state.stash[op[1:]] = (x, y)  # keyed by the op without its kind: (micro,), interleaved (micro, chunk)
            state.peak = max(state.peak, len(state.stash))
        return y.detach()

    def backward(self, op: Op, grad: torch.Tensor | None, state: RunState) -> torch.Tensor | None:
        """Micro-batch op[1] back through this stage; returns the gradient for the stage before."""
        (_, first, last), i = self.place(op), op[1]
        x, y = state.stash.pop(op[1:])
        if self.grad_sync is not None:
            # Reduce a gradient during its last accumulation only: the backward of the last micro-batch,
            # the last op of every schedule (interleaved: the last op of each chunk).
            self.grad_sync.require_backward_grad_sync = i == len(state.micro) - 1
        with self.grid.observer.span("B"):
            if last:
                (y * state.scale).backward()
            else:
                y.backward(grad)
        return None if first else x.grad  # (the first stage's input is the embedding's output, no leaf)



# ----------------------------------------------------------------------------- interleaving: v chunks per rank
#
# Interleaved 1F1B (Narayanan et al. 2021, section 2.2.2): each rank holds v chunks of layers instead
# of one contiguous run, so the model is p * v virtual stages, chunk c of rank r being virtual stage
# c * p + r (`virtual_stage`). A micro-batch goes round the ranks v times:
#
#     p = 2, v = 2, 8 layers:   rank 0: h.0-1 (chunk 0)  h.4-5 (chunk 1)
#                               rank 1: h.2-3 (chunk 0)  h.6-7 (chunk 1)
#     micro-batch:  rank 0 chunk 0 -> rank 1 chunk 0 -> rank 0 chunk 1 -> rank 1 chunk 1 (loss)
#
# An op runs one chunk, 1/v of a stage's work, so filling and draining the pipeline costs p - 1
# slots of 1/v the size: the bubble is (p - 1) / (v m + p - 1). The price is v times more messages
# between ranks (a micro-batch crosses p v - 1 boundaries instead of p - 1), more activations on the
# first rank (2 (p - 1) + (v - 1) p + 1 chunks of them: p + (p - 1) / v stages' worth instead of p),
# and Megatron's constraint that m is a multiple of p (micro-batches go through in groups of p per
# chunk).
#
# The simulator, the drawing and the proof of the messages above already take chunks. What this
# section adds: the schedule, a steady forward paired with its backward in one exchange, and the
# executor's four changes.


def interleaved_1f1b(p: int, rank: int, m: int, v: int) -> list[tuple[str, int, int]]:
    """Megatron's interleaved 1F1B: 1F1B's three phases over the m * v chunk-ops of a rank. Forwards
    go through in groups of p micro-batches: micro-batches 0..p-1 through chunk 0, then through
    chunk 1, ..., then p..2p-1 through chunk 0; backwards in the same groups, from the last chunk
    down. Warm-up is (p - rank - 1) * 2 + (v - 1) * p forwards: the last rank can start the backward
    of micro-batch 0 once the first group has been through chunks 0..v-2, (v - 1) * p forwards;
    each rank before it waits two slots more (the activation goes down a rank, the gradient comes
    back), and fills them with two more forwards."""
    if m % p:
        raise LayoutError(f"the interleaved schedule needs the micro-batches ({m}) to be a multiple of --pp {p}")

    def nth(kind: str, k: int) -> tuple[str, int, int]:  # the k-th forward or backward chunk-op
        group, j = divmod(k, p * v)
        chunk = j // p if kind == "F" else v - 1 - j // p
        return kind, group * p + j % p, chunk

    n, w = m * v, min((p - rank - 1) * 2 + (v - 1) * p, m * v)  # chunk-ops of each kind; the warm-up's
    warm_up = [nth("F", k) for k in range(w)]
    steady = [op for k in range(w, n) for op in (nth("F", k), nth("B", k - w))]
    cool_down = [nth("B", k) for k in range(n - w, n)]
    return warm_up + steady + cool_down


def pair_steady(ops: list[Op]) -> list[list[Op]]:
    """The interleaved executor's units, the ops between two calls to send_recv: one op, or, in a
    steady state, a forward with the backward right after it, as Megatron does: the pair's two
    receives are posted before it, its two sends after it, all four in one batch. (One op at a time
    deadlocks the interleaved schedule: in its steady state every rank sends a gradient back to the
    rank before it, which posts that receive only after its next forward, and so on around the ring
    of ranks. check_messages finds that; it passes this rule.)"""
    steady = any(a[0] == "B" and b[0] == "F" for a, b in zip(ops, ops[1:]))
    out = []
    for op in ops:
        if steady and out and len(out[-1]) == 1 and out[-1][0][0] == "F" and op[0] == "B":
            out[-1].append(op)
        else:
            out.append([op])
    return out


class InterleavedPipeline(Pipeline):
    """The executor with v chunks of layers per rank. Four methods change: the ops
    (`interleaved_1f1b`, each naming its chunk), the units of an exchange (`pair_steady`), where an
    op's messages go (virtual stages: rank p - 1's chunk c feeds rank 0's chunk c + 1), and where an
    op runs (its chunk's blocks, `model.blocks(which=...)`; the embedding in virtual stage 0 only,
    the loss in the last). The stash needs no change: its key, the op without its kind, is
    (micro-batch, chunk) now."""

    def __init__(self, model: gpt.GPT, grid: Grid, schedule: str = "interleaved", grad_sync=None):
        super().__init__(model, grid, schedule, grad_sync)
        self.v, self.chunks = grid.vp, chunk_positions(model, grid)

    def ops(self, m: int) -> list[Op]:
        return interleaved_1f1b(self.p, self.rank, m, self.v)

    def units(self, ops: list[Op]) -> list[list[Op]]:
        return pair_steady(ops)

    def peers(self, op: Op) -> tuple[int | None, int | None]:
        return peers(op, self.rank, self.p, self.v)

    def place(self, op: Op) -> tuple[range | None, bool, bool]:
        s = virtual_stage(op, self.rank, self.p)
        return self.chunks[op[2]], s == 0, s == self.p * self.v - 1


def chunk_positions(model: gpt.GPT, grid: Grid) -> list[range]:
    """Where each of this rank's chunks sits among the blocks it holds (keep_stage keeps them in
    layer order): the `which` of model.blocks. Without interleaving, one chunk: all of them."""
    sizes = [len(chunk) for chunk in rank_layers(model.config.n_layer, grid.pp, grid.vp, grid.pp_rank)]
    return [range(sum(sizes[:c]), sum(sizes[:c + 1])) for c in range(grid.vp)]


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b}  # what --pp-schedule names


def executor(model: gpt.GPT, grid: Grid, schedule: str, grad_sync=None) -> Pipeline:
    """The executor of a named schedule: InterleavedPipeline for interleaved, Pipeline for the others."""
    return (InterleavedPipeline if schedule == "interleaved" else Pipeline)(model, grid, schedule, grad_sync)


# ----------------------------------------------------------------------------- sampling across stages


@torch.no_grad()
def generate(model: gpt.GPT, grid: Grid, idx: torch.Tensor, max_new_tokens: int, **kw) -> torch.Tensor:
    """model.generate on any layout, with sequence and context parallelism off (one token at a time
    cannot be split along the sequence). With pipeline stages, every stage runs the same sampling loop in
    lockstep and only `next_logits` differs: the first stage embeds, each stage receives its input
    from the previous one and sends its output on, and the last stage's logits for the newest
    position are summed over the pipeline group (the others add zeros), so every stage draws the
    same token."""
    with grid.whole_sequence():
        if grid.pp == 1:
            return model.generate(idx, max_new_tokens, **kw)
        return model.generate(idx, max_new_tokens, next_logits=StageLogits(model, grid), **kw)


class StageLogits:
    """`next_logits` for one pipeline stage: model.next_logits with the stage boundaries crossed, once
    per chunk when the stages are interleaved (the token goes round the ranks v times)."""

    def __init__(self, model: gpt.GPT, grid: Grid):
        self.model, self.grid = model, grid
        self.dtype = next(model.parameters()).dtype
        self.chunks = chunk_positions(model, grid)

    def __call__(self, tokens: torch.Tensor, start: int, caches) -> torch.Tensor:
        model, grid = self.model, self.grid
        for chunk, which in enumerate(self.chunks):
            before, after = peers(("F", 0, chunk), grid.pp_rank, grid.pp, grid.vp)
            if before is None:
                x = model.embed(tokens, start)
            else:
                # zeros: a failed receive must not hand sampling garbage (NaN) before the read
                x = torch.zeros(*tokens.shape, model.config.n_embd, dtype=self.dtype,
                                device=tokens.device)
                grid.send_recv([], [(x, grid.stage_rank(before))])
            y = model.blocks(x, caches, which)
            if after is not None:
                grid.send_recv([(y, grid.stage_rank(after))], [])
        if grid.last_stage:
            logits = model.head(y[:, -1:]).float()
        else:
            logits = torch.zeros(y.size(0), 1, model.config.padded_vocab // grid.tp, device=y.device)
        grid.all_reduce(logits, "pp")  # (B, 1, V/tp) on every stage
        return model.gather_vocab(logits[:, -1, :])
