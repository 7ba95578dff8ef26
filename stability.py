"""What keeps a run stable (lessons 02 and 05): the learning-rate schedule, mixed precision and loss
scaling, gradient clipping, and the loss-spike guard.

Mixed precision: bf16 autocast needs nothing else. fp16 has 5 exponent bits, so small gradients
underflow to zero: the loss is multiplied by a large scale before backward and the gradients
divided by it after. When the scale is too large, some gradient overflows to inf; the step is
skipped and the scale halved (`LossScaler`, written here rather than taken from torch because it
is a lesson).

train.py runs the step; this file says how big the step is, in what precision it is computed,
and when a step must not be taken at all.
"""

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch

import model as gpt


@dataclass(frozen=True)
class Precision:
    """--precision, decided once: the dtype autocast computes matmuls in (None: plain fp32), the dtype
    ZeRO keeps the parameters in (the compute dtype: its fp32 master copy, separate, takes the updates),
    and whether the loss is scaled. Without ZeRO the parameters are fp32 and take the updates themselves:
    in 16 bits a small update would round away."""
    name: str
    compute: torch.dtype | None
    params: torch.dtype
    loss_scaling: bool
    fp8: bool = False  # the blocks' Linears multiply in FP8 (fp8.py); the rest as `compute` says

    def autocast(self, device: torch.device):
        return torch.autocast(device.type, dtype=self.compute) if self.compute else nullcontext()

    def cast_once(self, device: torch.device):
        """Held open around every micro-batch of an optimizer step, so each fp32 weight is cast to the
        compute dtype once per step rather than once per micro-batch: autocast caches the copies it
        makes of leaf tensors until the outermost autocast context exits. This outer context is a
        disabled one, so the backward passes between the forwards run outside autocast, as they should."""
        return torch.autocast(device.type, enabled=False) if self.compute else nullcontext()


PRECISIONS = {"fp32": Precision("fp32", None, torch.float32, False),
              "bf16": Precision("bf16", torch.bfloat16, torch.bfloat16, False),
              "fp16": Precision("fp16", torch.float16, torch.float16, True),
              # FP8 as torchao and TransformerEngine train: bf16 autocast, the blocks' matmuls in fp8
              "fp8": Precision("fp8", torch.bfloat16, torch.bfloat16, False, fp8=True),
              # FP8 with fp32 elsewhere: no rounding but fp8's, so layouts reproduce one process (tests)
              "fp8-fp32": Precision("fp8-fp32", None, torch.float32, False, fp8=True)}


def describe(cfg, model_cfg=None) -> str:
    """--precision as a run says it: fp8's recipe too (what a checkpoint must agree with) and, given the
    model (a GPTConfig), the share of its FLOPs in fp8 (what the start-up line says)."""
    if not PRECISIONS[cfg.precision].fp8:
        return cfg.precision
    recipe = f"delayed scaling, amax history {cfg.fp8_amax_history}" if cfg.fp8_recipe == "delayed" \
        else "current scaling"
    share = f"; {gpt.fp8_flop_share(model_cfg, cfg.seq_len):.0%} of the FLOPs in fp8" if model_cfg else ""
    return f"{cfg.precision} ({recipe}{share})"


def lr_at(step: int, cfg) -> float:
    """Linear warm-up to --lr, then half a cosine down to --min-lr at the last step (cfg: a
    TrainConfig, or anything with lr, min_lr, warmup_steps and max_steps)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


class LossScaler:
    """Dynamic loss scaling for fp16 (Micikevicius et al. 2018, "Mixed Precision Training").

    scale the loss by S before backward  ->  gradients are S times larger, so small ones survive
    unscale: grads /= S, then look for inf/NaN
      overflow    -> skip this step, S *= 0.5
      N clean steps in a row -> S *= 2 (probe for a larger scale again)
    """

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, window: int = 1000):
        self.enabled, self.scale, self.window, self.good_steps = enabled, init_scale if enabled else 1.0, window, 0

    def unscale_(self, grads: list[torch.Tensor]) -> None:
        if self.enabled:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.scale, self.good_steps = self.scale * 0.5, 0
            if self.scale < 2.0**-24:
                raise FloatingPointError("fp16 loss scale collapsed below 2^-24: the gradients are inf or "
                                         "NaN whatever the scale; train in bf16 or fp32")
        else:
            self.good_steps += 1
            if self.good_steps % self.window == 0:
                self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = state["scale"], state["good_steps"]


def clip_(grads: list[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> None:
    """Scale every gradient by min(1, max_norm / ||g||): the direction is kept, the step bounded."""
    if max_norm > 0:
        torch._foreach_mul_(grads, torch.clamp(max_norm / (total_norm + 1e-6), max=1.0))


class SpikeGuard:
    """Flags a loss that is both Z standard deviations and 20% above the recent mean. The second
    condition keeps a flat, low-noise curve (tiny std) from flagging ordinary wiggles. The history is
    on the host; the comparison runs where the loss is, so deciding costs the GPU no wait."""

    def __init__(self, z: float, window: int):
        self.z, self.window, self.history = z, window, []

    def threshold(self) -> float:
        """The loss above which a loss is a spike (inf until the window has filled)."""
        if self.z <= 0 or len(self.history) < self.window:
            return math.inf
        mean = sum(self.history) / len(self.history)
        std = math.sqrt(sum((x - mean) ** 2 for x in self.history) / len(self.history))
        return max(mean + self.z * std, 1.2 * mean)

    def is_spike(self, loss: torch.Tensor) -> torch.Tensor:
        return loss.double() > self.threshold()  # compared in float64, as Python compares the loss's value

    def record(self, loss: float) -> None:
        self.history = (self.history + [loss])[-self.window:]
