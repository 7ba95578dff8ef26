"""What keyed dropout (dropout.py: the mask a hash of each element's coordinates) costs next to nn.Dropout
(the mask drawn from the process's generator), side by side in one run: one dropout's forward + backward on
a (B, T, C) activation, and a whole training forward + backward of the model with each, and with none.

    python tests/bench_dropout.py                        # CPU: mini (C 256), 8 x 128 tokens, 1 thread
    python tests/bench_dropout.py --device cuda --preset gpt2 --batch 16 --seq-len 1024

Configurations alternate in rounds; medians. On a CPU the time is this thread's CPU time (what a shared
machine's other processes add to wall time is not counted). Not collected by pytest.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as train.py runs (DESIGN.md: big tensors and page faults)
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import dropout  # noqa: E402
import model as gpt  # noqa: E402


def timed(device: torch.device, fn, *args) -> float:
    """Seconds fn(*args) took: on a GPU, wall time to the end of its kernels; on a CPU, this thread's
    CPU time (torch runs on this one thread: --threads 1), which a busy machine's other processes
    do not add to."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter() if device.type == "cuda" else time.thread_time()
    fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() if device.type == "cuda" else time.thread_time()) - start


def with_nn_dropout(m: gpt.GPT) -> gpt.GPT:
    """The same model, each keyed Dropout swapped for nn.Dropout of the same p."""
    for module in list(m.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, dropout.Dropout):
                setattr(module, name, torch.nn.Dropout(child.p))
    return m


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", default="mini")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--p", type=float, default=0.1)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cfg = gpt.config_from_preset(args.preset, 50257, dropout=args.p)
    B, T, C = args.batch, args.seq_len, cfg.n_embd
    key = dropout.step_key(1337, 0, 0, device)

    x = torch.randn(B, T, C, device=device, requires_grad=True)
    layers = {"nn.Dropout": torch.nn.Dropout(args.p), "keyed": dropout.Dropout(args.p).to(device)}
    models = {"no dropout": gpt.build(gpt.config_from_preset(args.preset, 50257), 0, device),
              "nn.Dropout": with_nn_dropout(gpt.build(cfg, 0, device)), "keyed": gpt.build(cfg, 0, device)}
    tokens = torch.randint(0, 50257, (B, T + 1), device=device)

    def layer_step(layer):
        layer(x).sum().backward()

    def model_step(m):
        _, loss = m(tokens[:, :-1], tokens[:, 1:])
        loss.backward()

    times = {f"one dropout, {name}": [] for name in layers} | {f"model, {name}": [] for name in models}
    with dropout.keyed(key):
        for _ in range(args.rounds):
            for name, layer in layers.items():
                times[f"one dropout, {name}"].append(timed(device, layer_step, layer))
            for name, m in models.items():
                times[f"model, {name}"].append(timed(device, model_step, m))
    med = {k: statistics.median(v[1:]) for k, v in times.items()}  # the first round warms up
    print(f"{args.preset}, {B} x {T} tokens, C {C}, p {args.p}, {device}, {args.threads} thread(s); medians of "
          f"{args.rounds - 1} rounds")
    for k, v in med.items():
        print(f"  {k:<24}{v * 1e3:9.2f} ms")
    layer = med["one dropout, keyed"] / med["one dropout, nn.Dropout"]
    extra = (med["model, keyed"] - med["model, nn.Dropout"]) / med["model, nn.Dropout"]
    print(f"keyed / nn.Dropout: {layer:.2f}x for one dropout; the model's forward + backward {extra:+.1%}")


if __name__ == "__main__":
    main()
