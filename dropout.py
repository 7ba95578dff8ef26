"""Dropout whose mask is a function of where an element is, so every layout drops the same ones.

nn.Dropout draws its mask from the process's random stream: the k-th mask is whatever the stream
holds after the k - 1 draws before it. A layout changes who draws what. Two data-parallel ranks
seeded alike draw the same mask for different sequences, where one process draws two different
ones; a context-parallel rank holds two far-apart chunks of each sequence, a sequence-parallel rank
a tp-th of it; a pipeline stage draws only for its own blocks. So no layout would reproduce one
process (DESIGN.md, principle 4) once dropout is on. Here, instead, a mask is a function of the
element's global coordinates, the idea of counter-based random numbers (Salmon et al. 2011,
"Parallel Random Numbers: As Easy as 1, 2, 3", which gave GPUs Philox): hash them, compare with p.

    dropped(seed, step, site, sample, position, channel) = hash(...) < p * 2^32

    seed, step   --seed and the optimizer step (`step_key` hashes them into `Key.salt`)
    site         which dropout of the whole model (`number`: fixed before a layout cuts it)
    sample       the sequence's row in the step's global batch (`Key.sample`: where the rows
                 of a forward start)
    position     the token's in its sequence (`Dropout.positions`: context.py's, where a
                 rank's tokens are not 0..T-1)
    channel      the feature

Every layout holds each element at the same coordinates, so it computes one process's mask:

    data parallel, micro-batches   the loop says where the rows start: dp_rank x the rows of a
                                   rank (`step_key`), + the micro-batch's offset (`rows`)
    context / sequence parallel    the rank's global positions (context.ActivationPositions)
    tensor parallel                replicated activations, the same coordinates: the same mask
                                   on every tp rank, as the replicas must stay equal
    pipeline parallel              a block's sites do not depend on the stage that runs it
    recomputation                  model.Recompute sets the first forward's key again: the
                                   same mask (and no random state to save and restore)

The hash is a few integer operations per element (`mix`: xor-shift, multiply, twice; the
multipliers are below 2^31 and values stay below 2^32, so int64 never overflows, on any device): a
(sample, position) row is hashed once, a channel once, and their xor mixed per element. The mask is
kept as one byte per element (a bool) for the backward, as CUDA's fused dropout keeps it. Eager on
a CPU at `mini`, one dropout's forward and backward takes 1.1 to 1.2 times nn.Dropout's CPU time
between the model's steps (up to 2.5 times in a loop of nothing but dropouts, where the page faults
of its 8-byte temporaries show), and a whole step is the same to within 2%
(tests/bench_dropout.py); torch's compiler fuses the hash into one kernel. The key's numbers are
tensors on the device and the site a buffer: a compiled block reads them as inputs, so one graph
serves every block and every step (an int would be compiled in as a constant, and each new value
compiled again).
"""

from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn as nn

MASK = 0xFFFFFFFF  # values are 32-bit: a product with a multiplier below 2^31 fits in int64
CHANNEL = 1 << 31  # channel c is hashed as c + 2^31, so that no channel hashes as a sample does


def mix(x):
    """A 32-bit integer hash (xor-shift-multiply, as MurmurHash3's finalizer and its kin): every
    output bit depends on every input bit. Of a Python int, or of an int64 tensor of values in
    [0, 2^32), in place: pass one you own (a temporary: no more memory, and on a CPU every new
    tensor of megabytes costs its page faults). The multipliers are odd and below 2^31."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x &= MASK
    x ^= x >> 15
    x *= 0x2C1B3C6D
    x &= MASK
    x ^= x >> 16
    return x


class Key(NamedTuple):
    """What the masks of a forward are drawn from, besides each element's place: 0-dim int64
    tensors on the device (the module docstring says why tensors)."""
    salt: torch.Tensor  # (seed, step), hashed
    sample: torch.Tensor  # the row of the step's global batch where this forward's rows start


def step_key(seed: int, step: int, first_row: int, device: torch.device) -> Key:
    """The key of a step's forwards on a rank whose rows start at `first_row` of the global batch.
    (torch.full writes the numbers on the device; a tensor made from them on the host would be a
    copy, which waits for the GPU.)"""
    salt = mix(mix((seed ^ seed >> 32) & MASK) ^ (step & MASK))
    return Key(*(torch.full((), v, dtype=torch.int64, device=device) for v in (salt, first_row)))


class Dropout(nn.Module):
    """nn.Dropout(p) of (B, T, C) activations, its mask a function of coordinates (see above): zero
    the dropped elements, scale the rest by 1 / (1 - p). `positions(T, start, device)` gives the
    global positions of the T tokens (None: 0..T-1, one process's); `number` sets `site`. Outside a
    `keyed` block the key is all zeros: a training loop of one's own keys each step (`step_key`), as
    train.py does, or every step drops the same elements."""
    key = Key(torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64))  # in use now

    def __init__(self, p: float):
        super().__init__()
        self.p, self.positions = p, None
        site = torch.zeros((), dtype=torch.int64, device="cpu")  # (made whole, even on meta)
        self.register_buffer("site", site, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        B, T, C = x.shape
        pos = torch.arange(T, device=x.device) if self.positions is None else \
            self.positions(T, 0, x.device)
        drop = dropped(Dropout.key, self.site, B, pos, C, self.p)  # (B, T, C) bool
        return x.masked_fill(drop, 0) * (1 / (1 - self.p))  # autograd keeps the bool mask alone

    def extra_repr(self) -> str:
        return f"p={self.p}"


def dropped(key: Key, site: torch.Tensor, B: int, positions: torch.Tensor, C: int,
            p: float) -> torch.Tensor:
    """(B, T, C) bool: what dropout `site` drops of rows key.sample.. at `positions` (T,)."""
    device = positions.device
    h = mix(key.salt ^ site)  # () this dropout in this step
    samples = key.sample + torch.arange(B, device=device)  # (B,)
    rows = mix(mix(h ^ samples)[:, None] ^ positions)  # (B, T)
    channels = mix(h ^ (torch.arange(C, device=device) + CHANNEL))  # (C,)
    return mix(rows[:, :, None] ^ channels) < round(p * 2**32)


@contextmanager
def keyed(key: Key):
    """Within: dropout draws from `key` (the loop's for a step, model.Recompute's for a replay)."""
    before, Dropout.key = Dropout.key, key
    try:
        yield
    finally:
        Dropout.key = before


def rows(n: int):
    """Within: the current key's rows start n further on (a micro-batch n rows into the rank's)."""
    return keyed(Key(Dropout.key.salt, Dropout.key.sample + n))


def number(model: nn.Module) -> None:
    """Each Dropout of a whole model (built, not yet cut by a layout) gets its site: its place."""
    for i, m in enumerate(m for m in model.modules() if isinstance(m, Dropout)):
        m.site.fill_(i)
