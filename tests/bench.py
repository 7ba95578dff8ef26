"""Training throughput on one device, side by side (not collected by pytest).

    python tests/bench.py                   # CPU: `mini`, fp32, 8 x 128 tokens a step
    python tests/bench.py --preset small    # CPU: a bigger model
    python tests/bench.py --device cuda     # GPU: GPT-2 124M, bf16, compiled, 32 x 1024 tokens, micro-batch 16
    python tests/bench.py --versus llama-mini   # and a third configuration: another preset (here the Llama
                                                # family at GPT-2 mini's size), its tokens/s over ours
    python tests/bench.py --precision fp8       # and the same model without fp8 (bf16), in the same rounds:
                                                # on a GPU fp8's speed-up, on a CPU the price of its casts
    python tests/bench.py --device cuda --preset llama-3.2-1b --n-layer 8 --seq-len 2048 --batch-size 8 \
        --micro-batch-size 4 --precision fp8 --fp8-recipe delayed --no-unfused --json out.json
                                                # issue 46's fp8 end to end (tests/gpu_run.py runs it)

Two configurations are timed in alternating rounds, so both see the same machine at the same time:

    ours           the model as train.py builds and runs it: the fused, chunked output layer + loss
                   (lmhead.lm_head_loss), weights cast once a step, compiled where train.py compiles
    unfused loss   the same, with the textbook loss: the whole (B, T, V) logits, then F.cross_entropy

Each configuration is built and stepped as train.py builds and steps it: fp8's Linears through
fp8.enable with --fp8-recipe, fp8.end_step after every optimizer step, and compiled where train.py
would compile it (an fp8 model only when config.check_fp8 allows --compile with fp8; the others as
--compile says), so a faster path in the product is what this measures, with no change here.
Every step's loss is kept: the configurations start from the same weights and see the same batch,
so fp8's losses are compared with bf16's step by step (--json writes them).

For each: tokens/s; the training FLOP/s (PaLM's formula, model.flops_per_token) as a share of the
peak: on a CPU the fp32 matmul rate measured in this process (targets: mini >= 50%, small >= 60%),
on a GPU the datasheet's (MFU); the peak memory of a step; and where a step's time goes (forward,
backward, optimizer), from extra steps with a device sync between phases (ours computes the
loss's gradient while the logits are at hand, so its forward grows and its backward shrinks by
as much: compare the sums). Communication is zero
on one device; `train.py --comm-report` counts the bytes of a parallel layout. Last, the memory of
the loss layer alone, fused against unfused, for this configuration's shapes.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as train.py runs: 2 MB pages for big CPU tensors
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import config  # noqa: E402
import fp8  # noqa: E402
import model as gpt  # noqa: E402
import parallel  # noqa: E402
import stability  # noqa: E402
import train  # noqa: E402
from instruments import planner, reports  # noqa: E402

WITHOUT_FP8 = {"fp8": "bf16", "fp8-fp32": "fp32"}  # --precision fp8's baseline: the same run without fp8
GPU_DEFAULTS = dict(preset="gpt2", batch_size=32, seq_len=1024, micro_batch_size=16, precision="bf16", compile=True)
CPU_DEFAULTS = dict(preset="mini", batch_size=8, seq_len=128, micro_batch_size=8, precision="fp32", compile=False)


def fp8_compile_refusal() -> str | None:
    """None when train.py compiles an fp8 model (config.check_fp8 allows --compile with --precision fp8);
    else its one-line reason."""
    try:
        config.check_fp8(config.TrainConfig(precision="fp8", compile=True))
    except ValueError as e:  # ConfigError
        return str(e)
    return None


class UnfusedCrossEntropy(torch.nn.Module):
    """The loss layer as most trainers write it: every logit at once, upcast to fp32."""

    def forward(self, x, weight, targets):
        return F.cross_entropy(F.linear(x, weight).float().flatten(0, 1), targets.flatten())


class Bench:
    """One configuration: its model, optimizer and a fixed batch of random tokens."""

    def __init__(self, args, device: torch.device, fused: bool, preset: str | None = None,
                 precision: str | None = None):
        depth = {"n_layer": args.n_layer} if args.n_layer else {}
        cfg = gpt.config_from_preset(preset or args.preset, 50257, attn=args.attn, **depth)
        self.cfg, self.device, self.precision = cfg, device, stability.PRECISIONS[precision or args.precision]
        self.grid, self.recipe = parallel.Grid(device=device), args.fp8_recipe
        self.model = gpt.build(cfg, seed=0, device=device)
        if not fused:
            self.model.loss = UnfusedCrossEntropy()
        if self.precision.fp8:  # the blocks' Linears in fp8, as train.py enables them
            fp8.enable(self.model, self.grid, args.fp8_recipe, args.fp8_amax_history)
        self.compiled = args.compile and not (self.precision.fp8 and fp8_compile_refusal())
        if self.compiled:
            train.compile_model(self.model, self.grid)
        tc = config.TrainConfig(lr=1e-4, precision=self.precision.name)
        self.opt = train.make_optimizer(self.model, tc)
        gen = torch.Generator().manual_seed(0)
        batch = torch.randint(0, 50257, (args.batch_size, args.seq_len + 1), generator=gen).to(device)
        self.micro = batch.split(args.micro_batch_size)
        self.phases = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        self.losses = []  # every step's, on the device (read once, at the end)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self, timed_phases: bool = False) -> None:
        """One optimizer step as train.py takes it (gradient accumulation over the micro-batches)."""
        mark = [time.perf_counter()]

        def phase(name):
            if timed_phases:
                self.sync()
                now = time.perf_counter()
                self.phases[name] += now - mark[0]
                mark[0] = now

        total = 0.0
        with self.precision.cast_once(self.device):
            for mb in self.micro:
                with self.precision.autocast(self.device):
                    _, loss = self.model(mb[:, :-1], mb[:, 1:])
                phase("forward")
                (loss / len(self.micro)).backward()
                total = total + loss.detach() / len(self.micro)
                phase("backward")
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        fp8.end_step(self.model, self.grid, self.recipe)  # as train.py: the fp8 scalings end their step
        self.losses.append(total)
        phase("optimizer")

    def tokens_per_second(self, steps: int) -> float:
        """After one untimed step: the other configuration ran last, and on a CPU the memory it freed went
        back to the OS, so the first step here pays for faulting its big tensors in again. A training
        run, one configuration from start to end, never pays that."""
        self.step()
        self.sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        self.sync()
        return sum(m.numel() - m.size(0) for m in self.micro) * steps / (time.perf_counter() - t0)


def loss_layer_memory(args, device: torch.device) -> dict[str, int]:
    """Peak bytes of the loss layer's forward + backward at one micro-batch, fused and unfused."""
    cfg = gpt.config_from_preset(args.preset, 50257)
    x = torch.randn(args.micro_batch_size, args.seq_len, cfg.n_embd, device=device, requires_grad=True)
    w = (torch.randn(cfg.padded_vocab, cfg.n_embd, device=device) * 0.02).requires_grad_()
    targets = torch.randint(0, 50257, (args.micro_batch_size, args.seq_len), device=device)
    precision = stability.PRECISIONS[args.precision]

    def forward_backward(layer):
        def run():
            with precision.autocast(device):
                loss = layer(x, w, targets)
            loss.backward()
            x.grad = w.grad = None
        return run
    return {name: reports.peak_memory(forward_backward(layer), device)
            for name, layer in (("fused", gpt.CrossEntropy()), ("unfused", UnfusedCrossEntropy()))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where to run")
    p.add_argument("--preset", help="model preset (default: gpt2 on cuda, mini on cpu)")
    p.add_argument("--batch-size", type=int, help="sequences per optimizer step (default: 32 on cuda, 8 on cpu)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: 1024 on cuda, 128 on cpu)")
    p.add_argument("--micro-batch-size", type=int, help="sequences per forward (default: 16 on cuda, 8 on cpu)")
    p.add_argument("--precision", choices=list(stability.PRECISIONS), help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--fp8-recipe", choices=["current", "delayed"], default="current",
                   help="fp8: where the scales come from (train.py's --fp8-recipe)")
    p.add_argument("--fp8-amax-history", type=int, default=1024, help="fp8, delayed scaling: steps of amax history")
    p.add_argument("--n-layer", type=int, help="blocks, instead of the preset's (a shape's layers, fewer of them)")
    p.add_argument("--attn", default="auto", help="attention backend (kernels.BACKENDS)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, help="default: on for cuda, off for cpu")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per timed round")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds per configuration (median reported)")
    p.add_argument("--versus", help="another preset, timed in the same rounds (e.g. llama-mini against mini)")
    p.add_argument("--unfused", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the textbook unfused loss (--no-unfused: one configuration fewer to build)")
    p.add_argument("--json", help="also write each configuration's numbers and losses to this file")
    args = p.parse_args()
    if args.n_layer is not None and args.n_layer < 1:
        p.error("--n-layer must be at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: this machine has no CUDA GPU (run without --device for the CPU benchmark)")
    for key, value in (GPU_DEFAULTS if args.device == "cuda" else CPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    device = torch.device(args.device)
    head_dim = gpt.config_from_preset(args.preset, 50257).head_dim  # 'auto' resolved as train.py does it
    args.attn = config.resolve_attention(config.TrainConfig(attn=args.attn, precision=args.precision), device, head_dim)
    if args.precision in WITHOUT_FP8 and args.compile and (why := fp8_compile_refusal()):
        print(f"fp8 runs eager, as train.py runs it ({why}); the other configurations compiled")
    benches = {"ours": Bench(args, device, fused=True)}
    if args.unfused:
        benches["unfused loss"] = Bench(args, device, fused=False)
    if args.versus:
        benches[args.versus] = Bench(args, device, fused=True, preset=args.versus)
    if args.precision in WITHOUT_FP8:  # the same model with its Linears in 16 (or 32) bits: fp8's speed-up, or cost
        benches[WITHOUT_FP8[args.precision]] = Bench(args, device, fused=True, precision=WITHOUT_FP8[args.precision])
    args.fp8_share = gpt.fp8_flop_share(benches["ours"].cfg, args.seq_len) if args.precision in WITHOUT_FP8 else 0.0
    peaks = [planner.peak_flops(device, args.precision, args.fp8_share)]  # on a CPU measured between rounds too
    rates = {name: [] for name in benches}
    for b in benches.values():
        for _ in range(3):  # warm-up: compilation, allocations (the first 2 MB pages are slow), first calls
            b.step()
    for _ in range(args.rounds):
        for name, b in benches.items():
            rates[name].append(b.tokens_per_second(args.steps))
        peaks.append(planner.peak_flops(device, args.precision, args.fp8_share))
    print(report(args, device, benches, rates, max(peaks)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(as_json(args, device, benches, rates), f, indent=1)


def as_json(args, device, benches, rates) -> dict:
    """--json: the run's settings, and per configuration its tokens/s (median), compile state and losses."""
    first = benches["ours"].cfg
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "preset": args.preset, "n_layer": first.n_layer, "preset_layers": gpt.PRESETS[args.preset]["n_layer"],
            "precision": args.precision, "fp8_recipe": args.fp8_recipe, "fp8_share": args.fp8_share,
            "batch_size": args.batch_size, "seq_len": args.seq_len, "micro_batch_size": args.micro_batch_size,
            "attn": args.attn, "configs": {name: {"tokens_per_s": statistics.median(rates[name]),
                                                  "precision": b.precision.name, "compiled": b.compiled,
                                                  "losses": [float(v) for v in b.losses]}
                                           for name, b in benches.items()}}


def report(args, device, benches, rates, peak) -> str:
    share = "MFU" if device.type == "cuda" else "% of matmul"
    compiled = ", ".join(name for name, b in benches.items() if b.compiled) or "none"
    depth = f" ({args.n_layer} of its {gpt.PRESETS[args.preset]['n_layer']} layers)" if args.n_layer else ""
    lines = [f"{args.preset}{depth} on {device.type}: {args.precision}, {args.batch_size} x {args.seq_len} tokens "
             f"a step (micro-batch {args.micro_batch_size}), attention {args.attn}, compiled: {compiled}",
             f"peak: {peak / 1e12:.3f} TFLOP/s ({'datasheet' if device.type == 'cuda' else 'fp32 matmul, measured'})",
             f"{'configuration':<15}{'tokens/s':>10}{'TFLOP/s':>9}{share:>12}{'peak MB':>9}"
             f"{'fwd ms':>8}{'bwd ms':>8}{'opt ms':>8}"]
    summary = {}
    for name, b in benches.items():
        tps = statistics.median(rates[name])
        mem = reports.peak_memory(b.step, device)
        for _ in range(args.steps):
            b.step(timed_phases=True)
        ms = {k: v / args.steps * 1e3 for k, v in b.phases.items()}
        summary[name] = tps, mem
        flops_per_token = gpt.flops_per_token(b.cfg, args.seq_len)
        own_peak = peak * planner.peak_flops(device, b.precision.name, args.fp8_share if b.precision.fp8 else 0.0) \
            / planner.peak_flops(device, args.precision, args.fp8_share) if device.type == "cuda" else peak
        flops = tps * flops_per_token
        lines.append(f"{name:<15}{tps:>10,.0f}{flops / 1e12:>9.3f}{flops / own_peak:>12.1%}"
                     f"{mem / 2**20:>9,.0f}{ms['forward']:>8.1f}{ms['backward']:>8.1f}{ms['optimizer']:>8.1f}")
    ours, ours_mem = summary["ours"]
    if args.unfused:
        base, base_mem = summary["unfused loss"]
        lines.append(f"ours / unfused loss: {ours / base:.2f}x tokens/s, {ours_mem / base_mem:.2f}x peak memory of a "
                     "step")
    if args.versus:
        params = gpt.n_params(benches[args.versus].cfg) / gpt.n_params(benches["ours"].cfg)
        lines.append(f"{args.versus} / {args.preset}: {summary[args.versus][0] / ours:.2f}x tokens/s at {params:.3f}x "
                     "the parameters")
    if args.precision in WITHOUT_FP8:
        base, base_mem = summary[WITHOUT_FP8[args.precision]]
        lines.append(f"ours ({args.precision}) / {WITHOUT_FP8[args.precision]}: {ours / base:.2f}x tokens/s, "
                     f"{ours_mem / base_mem:.2f}x peak memory of a step; {args.fp8_share:.0%} of the FLOPs in fp8"
                     + (" (a CPU: _scaled_mm dequantizes and multiplies in fp32, so this is the casts' cost)"
                        if device.type == "cpu" else ""))
        ours_losses, base_losses = (torch.stack(benches[n].losses).float()
                                    for n in ("ours", WITHOUT_FP8[args.precision]))
        apart = ((ours_losses - base_losses).abs() / base_losses.abs()).max().item()
        lines.append(f"loss over the {len(base_losses)} steps each ran (the same batch): {ours_losses[0]:.4f} -> "
                     f"{ours_losses[-1]:.4f} in {args.precision}, {base_losses[0]:.4f} -> {base_losses[-1]:.4f} in "
                     f"{WITHOUT_FP8[args.precision]}, at most {apart:.2%} apart")
    loss = loss_layer_memory(args, device)
    lines.append(f"loss layer alone, forward + backward of one micro-batch: fused {loss['fused'] / 2**20:,.0f} MB, "
                 f"unfused {loss['unfused'] / 2**20:,.0f} MB ({loss['unfused'] / loss['fused']:.1f}x less)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
