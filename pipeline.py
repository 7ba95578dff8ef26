"""Pipeline parallelism: the layers cut into p stages, a batch into m micro-batches that flow
through them.

A schedule is just the order in which one stage runs forwards (F) and backwards (B):

  gpipe (Huang et al. 2019): all m forwards, then all m backwards. Every stage holds the
      activations of all m micro-batches at once.
  1f1b (Narayanan et al. 2021, PipeDream-Flush): p - rank - 1 warm-up forwards, then one
      forward / one backward in turn, then the remaining backwards. Same bubble, at most
      p - rank micro-batches of activations alive.

Either way each stage idles for (p - 1) of (m + p - 1) time slots: the bubble. Schedules are
data (lists of ops), so `simulate` can lay them on a clock, `draw_schedule` print them, and the
`Pipeline` executor run whichever one it is given. `generate` samples across the stages.
"""

import torch

import model as gpt
from parallel import Grid, LayoutError


def gpipe(p: int, rank: int, m: int) -> list[tuple[str, int]]:
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def one_f_one_b(p: int, rank: int, m: int) -> list[tuple[str, int]]:
    warmup = min(p - rank - 1, m)
    ops = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: forward i + warmup, backward i
        ops += [("F", warmup + i), ("B", i)]
    return ops + [("B", i) for i in range(m - warmup, m)]


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def simulate(stage_ops: list[list[tuple[str, int]]]) -> list[list[tuple[int, str, int]]]:
    """Place each stage's ops on a clock where F and B take one slot, F(i) waits for F(i) on the
    stage before and B(i) for B(i) on the stage after. Returns (start, kind, micro) per stage."""
    p, done, free, pos = len(stage_ops), {}, [0] * len(stage_ops), [0] * len(stage_ops)
    timeline = [[] for _ in range(p)]
    moved = True
    while moved:
        moved = False
        for s in range(p):
            while pos[s] < len(stage_ops[s]):
                kind, i = stage_ops[s][pos[s]]
                # F(i) needs the previous stage's F(i); B(i) needs the next stage's B(i)
                dep = (s - 1, "F", i) if kind == "F" else (s + 1, "B", i)
                dep = dep if 0 <= dep[0] < p else None
                if dep is not None and dep not in done:
                    break
                start = max(free[s], done.get(dep, 0))
                done[(s, kind, i)] = free[s] = start + 1
                timeline[s].append((start, kind, i))
                pos[s], moved = pos[s] + 1, True
    if any(pos[s] < len(stage_ops[s]) for s in range(p)):
        raise LayoutError("this pipeline schedule deadlocks")
    return timeline


def bubble_fraction(stage_ops: list[list[tuple[str, int]]]) -> float:
    """Idle slots / all slots, for the ops the stages actually ran."""
    timeline = simulate(stage_ops)
    span = max(start + 1 for ops in timeline for start, _, _ in ops)
    busy = sum(len(ops) for ops in timeline)
    return 1 - busy / (span * len(timeline))


def draw_schedule(stage_ops: list[list[tuple[str, int]]]) -> str:
    """The pipeline as text: one row per stage, one column per time slot, '.' where it idles."""
    timeline = simulate(stage_ops)
    span = max(start + 1 for ops in timeline for start, _, _ in ops)
    rows = []
    for s, ops in enumerate(timeline):
        cells = ["  ."] * span
        for start, kind, i in ops:
            cells[start] = f"{kind}{i:>2}"
        rows.append(f"stage {s} |" + " ".join(cells))
    m = sum(1 for kind, _ in stage_ops[0] if kind == "F")
    p = len(stage_ops)
    rows.append(f"bubble {bubble_fraction(stage_ops):.3f} (formula (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.3f})")
    return "\n".join(rows)


class Pipeline:
    """Runs this stage's op list. Before an op it receives what the op needs (an activation from
    the previous stage for F, a gradient from the next stage for B); the sends of the op before
    are posted in the same batch, so a send and its matching receive are always in flight
    together and neither side can wait on the other forever. Shapes are fixed by the
    configuration, so no message announces a shape.

    The executor also decides which backward is the last of the step, so it owns the data-parallel
    flag that says when gradients are reduced (`grad_sync`, a gradients.GradSync, or None)."""

    def __init__(self, model: gpt.GPT, grid: Grid, schedule: str, grad_sync=None):
        self.model, self.grid, self.schedule, self.grad_sync = model, grid, SCHEDULES[schedule], grad_sync
        self.first, self.last = grid.first_stage, grid.last_stage
        self.prev, self.next = grid.prev_stage, grid.next_stage
        self.dtype = next(model.parameters()).dtype
        self.ops_run, self.peak_live = [], 0

    def act_shape(self, micro: torch.Tensor) -> tuple[int, int, int]:
        T = (micro.size(1) - 1) // self.grid.cp  # each context-parallel rank holds T/cp tokens...
        return micro.size(0), T // self.grid.tp if self.grid.sp else T, self.model.config.n_embd  # ...and SP a tp-th

    def run(self, micro: list[torch.Tensor], autocast, train: bool = True, scale: float = 1.0) -> torch.Tensor:
        """Forward (and backward) of every micro-batch (rows of T+1 tokens); returns the mean loss
        on the last stage, 0 elsewhere."""
        m, model = len(micro), self.model
        ops = self.schedule(self.grid.pp, self.grid.pp_rank, m) if train else [("F", i) for i in range(m)]
        shape = self.act_shape(micro[0])
        stash, sends, total = {}, [], torch.zeros((), device=self.grid.device)
        self.ops_run, self.peak_live = [], 0
        for kind, i in ops:
            buf = None
            if (kind == "F" and not self.first) or (kind == "B" and not self.last):
                buf = torch.empty(shape, dtype=self.dtype, device=self.grid.device)
            recvs = [(buf, self.prev if kind == "F" else self.next)] if buf is not None else []
            self.grid.send_recv(sends, recvs)
            sends = []
            if kind == "F":
                with torch.set_grad_enabled(train), autocast:
                    x = model.embed(micro[i][:, :-1]) if self.first else buf.requires_grad_(train)
                    y = model.blocks(x)
                    if self.last:
                        y = model.head_loss(y, micro[i][:, 1:]) / m
                        total += y.detach()
                if train:
                    stash[i] = (x, y)
                    self.peak_live = max(self.peak_live, len(stash))
                if not self.last:
                    sends.append((y.detach(), self.next))
            else:
                x, y = stash.pop(i)
                if self.grad_sync is not None:  # reduce gradients during the step's last backward only
                    self.grad_sync.require_backward_grad_sync = i == m - 1
                if self.last:
                    (y * scale).backward()
                else:
                    y.backward(buf)
                if not self.first:
                    sends.append((x.grad, self.prev))
            self.ops_run.append((kind, i))
        self.grid.send_recv(sends, [])
        return total

    def all_stage_ops(self) -> list[list[tuple[str, int]]]:
        """Every stage's executed op sequence, gathered over the pipeline group."""
        codes = torch.tensor([(0 if k == "F" else 1) * 1_000_000 + i for k, i in self.ops_run],
                             dtype=torch.long, device=self.grid.device)
        out = codes.new_empty((self.grid.pp, codes.numel()))
        self.grid.all_gather(out.view(-1), codes, "pp")
        return [[("F" if c < 1_000_000 else "B", c % 1_000_000) for c in row.tolist()] for row in out]



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
    """`next_logits` for one pipeline stage: model.next_logits with the stage boundaries crossed."""

    def __init__(self, model: gpt.GPT, grid: Grid):
        self.model, self.grid = model, grid
        self.dtype = next(model.parameters()).dtype

    def __call__(self, tokens: torch.Tensor, start: int, caches) -> torch.Tensor:
        model, grid = self.model, self.grid
        if grid.first_stage:
            x = model.embed(tokens, start)
        else:
            x = torch.empty(*tokens.shape, model.config.n_embd, dtype=self.dtype, device=tokens.device)
            grid.send_recv([], [(x, grid.prev_stage)])
        y = model.blocks(x, caches)
        if not grid.last_stage:
            grid.send_recv([(y, grid.next_stage)], [])
            logits = torch.zeros(y.size(0), 1, model.config.padded_vocab // grid.tp, device=y.device)
        else:
            logits = model.head(y[:, -1:]).float()
        grid.all_reduce(logits, "pp")  # (B, 1, V/tp) on every stage
        return model.gather_vocab(logits[:, -1, :])
