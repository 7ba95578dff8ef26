"""Which device a process computes on: the one --device names in one process, and under torchrun the GPU
of its local rank. A device that is not there is one line before any work: `ConfigError` for the flag,
`LayoutError` for more processes on a node than it has GPUs (config.py and parallel.py raise them too,
for the flags and layouts that cannot work).
"""

import os
import re

import torch


class ConfigError(ValueError):
    """A flag combination that cannot work; printed as one line."""


class LayoutError(ValueError):
    """An impossible parallel layout; raised before any work, printed as one line."""


def pick_device(name: str) -> torch.device:
    """The device the flag names. `cuda:N` is honoured in one process, and made the current GPU, so that
    every later question about "the GPU" (bf16, our kernel, memory) is about this one; under torchrun
    each process takes the GPU of its local rank (`local_gpu`), so an index is refused there."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA device is visible; use --device cpu")
    if name != "cpu" and not re.fullmatch(r"cuda(:\d+)?", name):
        raise ConfigError(f"--device {name}: choose auto, cpu, cuda or cuda:N")
    device = torch.device(name)
    if device.index is not None:
        if "LOCAL_RANK" in os.environ:  # set by torchrun
            raise ConfigError(f"--device {name}: under torchrun each process takes the GPU of its local rank; "
                              "pass --device cuda (and choose the GPUs with CUDA_VISIBLE_DEVICES)")
        if device.index >= (n := torch.cuda.device_count()):
            raise ConfigError(f"--device {name}: the visible GPUs are cuda:0" + (f" to cuda:{n - 1}" if n > 1 else ""))
        torch.cuda.set_device(device)
    return device


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
