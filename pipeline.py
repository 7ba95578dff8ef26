"""Pipeline parallelism: the layers cut into p stages, a batch into m micro-batches that flow
through them.

A schedule is just the order in which one stage runs forwards (F) and backwards (B):

  gpipe (Huang et al. 2019): all m forwards, then all m backwards. Every stage holds the
      activations of all m micro-batches at once.
  1f1b (Narayanan et al. 2021, PipeDream-Flush): p - rank - 1 warm-up forwards, then one
      forward / one backward in turn, then the remaining backwards. Same bubble, at most
      p - rank micro-batches of activations alive.

Either way each stage idles for (p - 1) of (m + p - 1) time slots: the bubble.

  interleaved (the same paper, section 2.2.2): each rank holds v chunks of layers instead of one
      contiguous run, so the model is p * v virtual stages, chunk c of rank r being virtual stage
      c * p + r. A micro-batch goes round the ranks v times:

          p = 2, v = 2, 8 layers:   rank 0: h.0-1 (chunk 0)  h.4-5 (chunk 1)
                                    rank 1: h.2-3 (chunk 0)  h.6-7 (chunk 1)
          micro-batch:  rank 0 chunk 0 -> rank 1 chunk 0 -> rank 0 chunk 1 -> rank 1 chunk 1 (loss)

      An op runs one chunk, 1/v of a stage's work, so filling and draining the pipeline costs p - 1
      slots of 1/v the size: the bubble is (p - 1) / (v m + p - 1). The price is v times more
      messages between ranks (a micro-batch crosses p v - 1 boundaries instead of p - 1), more
      activations on the first rank (2 (p - 1) + (v - 1) p + 1 chunks of them: p + (p - 1) / v
      stages' worth instead of p), and Megatron's constraint that m is a multiple of p (micro-batches
      go through in groups of p per chunk).

An op is (kind, micro) or, with chunks, (kind, micro, chunk). Schedules are data (lists of ops), so
`simulate` can lay them on a clock, `draw_schedule` print them, `check_messages` prove their
sends and receives pair up, and the `Pipeline` executor run whichever one it is given. `generate`
samples across the stages.
"""

from collections import defaultdict

import torch

import model as gpt
from parallel import Grid, LayoutError
from shard import rank_layers

Op = tuple  # ("F" | "B", micro) or ("F" | "B", micro, chunk)


def gpipe(p: int, rank: int, m: int) -> list[tuple[str, int]]:
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def one_f_one_b(p: int, rank: int, m: int) -> list[tuple[str, int]]:
    warmup = min(p - rank - 1, m)
    ops = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: forward i + warmup, backward i
        ops += [("F", warmup + i), ("B", i)]
    return ops + [("B", i) for i in range(m - warmup, m)]


def interleaved_1f1b(p: int, rank: int, m: int, v: int) -> list[tuple[str, int, int]]:
    """Megatron's interleaved 1F1B: 1f1b over the m * v chunk-ops of a rank. Forwards go through in
    groups of p micro-batches: micro-batches 0..p-1 through chunk 0, then through chunk 1, ..., then
    p..2p-1 through chunk 0; backwards in the same groups, from the last chunk down. Warm-up is
    (p - rank - 1) * 2 + (v - 1) * p forwards: the last rank can start the backward of micro-batch 0
    once the first group has been through chunks 0..v-2, (v - 1) * p forwards; each rank before it
    waits two slots more (the activation goes down a rank, the gradient comes back), and fills
    them with two more forwards."""
    if m % p:
        raise LayoutError(f"the interleaved schedule needs the micro-batches ({m}) to be a multiple of --pp {p}")

    def nth(kind: str, k: int) -> tuple[str, int, int]:  # the k-th forward or backward chunk-op
        group, j = divmod(k, p * v)
        chunk = j // p if kind == "F" else v - 1 - j // p
        return kind, group * p + j % p, chunk

    total = m * v
    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    ops = [nth("F", k) for k in range(warmup)]
    for k in range(total - warmup):  # steady state: forward k + warmup, backward k
        ops += [nth("F", warmup + k), nth("B", k)]
    return ops + [nth("B", k) for k in range(total - warmup, total)]


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b}


def schedule_ops(schedule: str, p: int, rank: int, m: int, v: int = 1) -> list[Op]:
    """The op list of pipeline rank `rank` under a named schedule (v chunks only for interleaved)."""
    return interleaved_1f1b(p, rank, m, v) if schedule == "interleaved" else SCHEDULES[schedule](p, rank, m)


def op_parts(op: Op) -> tuple[str, int, int]:
    """(kind, micro, chunk); an op without a chunk runs chunk 0, the stage's only one."""
    return (op[0], op[1], op[2] if len(op) > 2 else 0)


def peers(op: Op, rank: int, p: int, v: int) -> tuple[int | None, int | None]:
    """(the pipeline rank op receives its input from, the one it sends its output to); None at the ends
    of the (virtual) pipeline. A forward of virtual stage s takes an activation from s - 1 and gives
    one to s + 1; a backward takes a gradient from s + 1 and gives one to s - 1. Consecutive virtual
    stages are on consecutive ranks, wrapping from rank p - 1 (chunk c) to rank 0 (chunk c + 1)."""
    kind, _, chunk = op_parts(op)
    s = chunk * p + rank
    before = (rank - 1) % p if s > 0 else None
    after = (rank + 1) % p if s < p * v - 1 else None
    return (before, after) if kind == "F" else (after, before)


def simulate(stage_ops: list[list[Op]]) -> list[list[tuple[int, str, int, int]]]:
    """Place each stage's ops on a clock where F and B take one slot, F(i) waits for F(i) on the
    (virtual) stage before and B(i) for B(i) on the one after. With chunks, an op is one chunk's
    work, so a slot is 1/v of a full stage's time. Returns (start, kind, micro, chunk) per stage."""
    p = len(stage_ops)
    ops = [[op_parts(op) for op in row] for row in stage_ops]
    n_virtual = p * (1 + max(c for row in ops for _, _, c in row))
    done, free, pos, timeline = {}, [0] * p, [0] * p, [[] for _ in range(p)]
    moved = True
    while moved:
        moved = False
        for r in range(p):
            while pos[r] < len(ops[r]):
                kind, i, c = ops[r][pos[r]]
                s = c * p + r
                dep = (s - 1 if kind == "F" else s + 1, kind, i)  # the virtual stage this op waits for
                dep = dep if 0 <= dep[0] < n_virtual else None
                if dep is not None and dep not in done:
                    break
                start = max(free[r], done.get(dep, 0))
                done[(s, kind, i)] = free[r] = start + 1
                timeline[r].append((start, kind, i, c))
                pos[r], moved = pos[r] + 1, True
    if any(pos[r] < len(ops[r]) for r in range(p)):
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


def draw_schedule(stage_ops: list[list[Op]]) -> str:
    """The pipeline as text: one row per stage, one column per time slot, '.' where it idles. With
    chunks, a letter names the chunk: F3a is micro-batch 3 through chunk 0, F3b through chunk 1."""
    timeline = simulate(stage_ops)
    span = max(t[0] + 1 for ops in timeline for t in ops)
    ops = [op_parts(op) for op in stage_ops[0]]
    v, m = 1 + max(c for _, _, c in ops), len({i for _, i, _ in ops})
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


def units(ops: list[Op], pair: bool = False) -> list[list[Op]]:
    """The ops the executor runs between two calls to send_recv: one op; or with `pair` (interleaved)
    and a steady state to pair in, a forward with the backward right after it, as Megatron does:
    the pair's two receives are posted before it, its two sends after it, all four in one batch.
    (One op at a time deadlocks the interleaved schedule: in its steady state every rank sends a
    gradient back to the rank before it, which posts that receive only after its next forward, and
    so on around the ring of ranks. check_messages finds that; it passes this rule.)"""
    pair = pair and any(a[0] == "B" and b[0] == "F" for a, b in zip(ops, ops[1:]))  # a steady state
    out = []
    for op in ops:
        if pair and out and len(out[-1]) == 1 and out[-1][0][0] == "F" and op[0] == "B":
            out[-1].append(op)
        else:
            out.append([op])
    return out


def message_batches(ops: list[Op], rank: int, p: int, v: int, pair: bool = False) -> list[list[tuple]]:
    """The executor's calls to send_recv on one rank, each a list of (direction, peer, message): the
    sends of a unit, then the receives of the next. A message is named by (kind, micro, the virtual
    stage that sends it)."""
    batches, sends = [], []
    for unit in units(ops, pair):
        recvs, unit_sends = [], []
        for op in unit:
            kind, i, c = op_parts(op)
            (before, after), s = peers(op, rank, p, v), c * p + rank
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
    p = len(stage_ops)
    v = 1 + max(op_parts(op)[2] for row in stage_ops for op in row)
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


class Pipeline:
    """Runs this stage's op list. Before an op it receives what the op needs (an activation from
    the previous stage for F, a gradient from the next stage for B); the sends of the op before
    are posted in the same batch, so a send and its matching receive are always in flight
    together and neither side can wait on the other forever. Interleaved, a steady-state forward
    and the backward after it count as one op here (`units`); `check_messages` proves the rule for
    every schedule. Shapes are fixed by the configuration, so no message announces a shape.

    Interleaved, this rank runs v chunks: each op runs one chunk's blocks (`model.blocks(which=...)`),
    the previous and next ranks wrap around (rank p - 1, chunk c feeds rank 0, chunk c + 1), and the
    stash of activations waiting for their backward is keyed by (micro-batch, chunk).

    The executor also decides which backward is the last of the step, so it owns the data-parallel
    flag that says when gradients are reduced (`grad_sync`, a gradients.GradSync, or None)."""

    def __init__(self, model: gpt.GPT, grid: Grid, schedule: str, grad_sync=None):
        self.model, self.grid, self.schedule, self.grad_sync = model, grid, schedule, grad_sync
        self.p, self.v, self.rank = grid.pp, grid.vp, grid.pp_rank
        self.last = self.p * self.v - 1  # the last virtual stage, which computes the loss
        self.chunks = chunk_positions(model, grid)
        self.dtype = next(model.parameters()).dtype
        self.ops_run, self.peak_live = [], 0

    def act_shape(self, micro: torch.Tensor) -> tuple[int, int, int]:
        T = (micro.size(1) - 1) // self.grid.cp  # each context-parallel rank holds T/cp tokens...
        return micro.size(0), T // self.grid.tp if self.grid.sp else T, self.model.config.n_embd  # ...and SP a tp-th

    def run(self, micro: list[torch.Tensor], autocast, train: bool = True, scale: float = 1.0) -> torch.Tensor:
        """Forward (and backward) of every micro-batch (rows of T+1 tokens); returns the mean loss
        on the last stage, 0 elsewhere. Without training, the schedule's forwards alone, in its order."""
        ops = [op_parts(op) for op in schedule_ops(self.schedule, self.p, self.rank, len(micro), self.v)]
        ops = ops if train else [op for op in ops if op[0] == "F"]
        self.micro, self.autocast, self.train, self.scale = micro, autocast, train, scale
        self.stash, self.total, sends = {}, torch.zeros((), device=self.grid.device), []
        self.ops_run, self.peak_live = [], 0
        for unit in units(ops, pair=self.schedule == "interleaved"):
            inputs = self.exchange(sends, unit)
            sends = []
            for op, buf in zip(unit, inputs):
                out = self.forward(*op[1:], buf) if op[0] == "F" else self.backward(*op[1:], buf)
                after = peers(op, self.rank, self.p, self.v)[1]
                if after is not None:
                    sends.append((out, self.grid.stage_rank(after)))
                self.ops_run.append(op)
        self.grid.send_recv(sends, [])
        return self.total

    def exchange(self, sends: list[tuple[torch.Tensor, int]], unit: list[Op]) -> list[torch.Tensor | None]:
        """Post the previous unit's sends with the receives of this unit's ops, in one batch; returns
        what each op received (None where it receives nothing: a forward of virtual stage 0 reads the
        tokens, a backward of the last starts from the loss)."""
        before = [peers(op, self.rank, self.p, self.v)[0] for op in unit]
        bufs = [None if b is None else torch.empty(self.act_shape(self.micro[0]), dtype=self.dtype,
                                                   device=self.grid.device) for b in before]
        self.grid.send_recv(sends, [(buf, self.grid.stage_rank(b)) for buf, b in zip(bufs, before) if buf is not None])
        return bufs

    def forward(self, i: int, chunk: int, buf: torch.Tensor | None) -> torch.Tensor:
        """Micro-batch i through one chunk; returns the activation for the next virtual stage."""
        model, s = self.model, chunk * self.p + self.rank
        with self.grid.span("F"), torch.set_grad_enabled(self.train), self.autocast:
            x = model.embed(self.micro[i][:, :-1]) if s == 0 else buf.requires_grad_(self.train)
            y = model.blocks(x, which=self.chunks[chunk])
            if s == self.last:
                y = model.head_loss(y, self.micro[i][:, 1:]) / len(self.micro)
                self.total += y.detach()
        if self.train:
            self.stash[(i, chunk)] = (x, y)
            self.peak_live = max(self.peak_live, len(self.stash))
        return y.detach()

    def backward(self, i: int, chunk: int, buf: torch.Tensor | None) -> torch.Tensor | None:
        """Micro-batch i back through one chunk; returns the gradient for the previous virtual stage."""
        x, y = self.stash.pop((i, chunk))
        if self.grad_sync is not None:
            # Reduce a gradient during its last accumulation only: chunk c's parameters get theirs in
            # the backward of (the last micro-batch, c), the last op of that chunk in every schedule.
            self.grad_sync.require_backward_grad_sync = i == len(self.micro) - 1
        s = chunk * self.p + self.rank
        with self.grid.span("B"):
            if s == self.last:
                (y * self.scale).backward()
            else:
                y.backward(buf)
        return None if s == 0 else x.grad  # (virtual stage 0's input is the embedding's output, no leaf)

    def all_stage_ops(self) -> list[list[tuple[str, int, int]]]:
        """Every stage's executed op sequence, gathered over the pipeline group."""
        codes = torch.tensor([((k == "B") * 1000 + c) * 1_000_000 + i for k, i, c in self.ops_run],
                             dtype=torch.long, device=self.grid.device)
        out = codes.new_empty((self.grid.pp, codes.numel()))
        self.grid.all_gather(out.view(-1), codes, "pp")
        return [[("B" if c >= 1_000_000_000 else "F", c % 1_000_000, c // 1_000_000 % 1000) for c in row.tolist()]
                for row in out]


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
                x = torch.empty(*tokens.shape, model.config.n_embd, dtype=self.dtype, device=tokens.device)
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


def chunk_positions(model: gpt.GPT, grid: Grid) -> list[range]:
    """Where each of this rank's chunks sits among the blocks it holds (keep_stage keeps them in
    layer order): the `which` of model.blocks."""
    sizes = [len(chunk) for chunk in rank_layers(model.config.n_layer, grid.pp, grid.vp, grid.pp_rank)]
    return [range(sum(sizes[:c]), sum(sizes[:c + 1])) for c in range(grid.vp)]
