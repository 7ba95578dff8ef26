"""What a run says about itself, beside its progress bar: the reports a flag asks for after the first
step (--comm-report, --memory-report, --print-schedule), the --print-timeline picture of one step, and
the line on what checkpoints cost the loop.

Each puts a measurement next to what the papers predict (formulas.py) or draws it (pipeline.py's
schedule, timeline.py's time axis). Every rank takes part where the numbers are gathered; rank 0
gets the text. `run` is train.py's Run: the model, the grid, the optimizer and what the step measured.
"""

import json
from pathlib import Path
from statistics import median

import torch

import formulas
import pipeline
import stability
import storage
import timeline


def saves_summary(saves: list[dict]) -> str:
    """One line on what checkpoints cost: --async-ckpt exists so that this is a small share of a step."""
    blocking, step = median([s["blocking_s"] for s in saves]), median([s["step_s"] for s in saves])
    return (f"checkpoints: {len(saves)} saved, {median([s['bytes'] for s in saves]) / 1e6:.1f} MB each from rank 0, "
            f"complete after {median([s['write_s'] for s in saves]):.2f} s; the training loop paid "
            f"{1e3 * blocking:.1f} ms a save ({blocking / step:.0%} of a {1e3 * step:.0f} ms step; medians)")


def first_step_reports(run) -> list[str]:
    """--comm-report and --print-schedule: what the first step moved and how the pipeline ran.
    Every rank takes part (the numbers are gathered); rank 0 gets the text."""
    cfg, grid, out = run.cfg, run.grid, []
    if cfg.comm_report:
        expected = formulas.expected_traffic(run.model_cfg, grid, cfg.micro_batch_size,
                                             cfg.batch_size // grid.dp // cfg.micro_batch_size, cfg.seq_len,
                                             run.sync, run.model)
        text = formulas.comm_report(grid, expected)
        matches = formulas.traffic_matches(grid, expected)
        out.append(text + f"\nformula matches measurement on every rank: {'yes' if matches else 'NO'}"
                   + ("" if cfg.precision == "fp32" else " (the formula assumes fp32 activations)"))
        if run.sync is not None:
            out.append(formulas.overlap_report(run.sync))
        if run.gather is not None:
            out.append(run.gather.prefetch_report())
        out.append(formulas.zero_memory_report(run.opt, run.model, grid))
    if cfg.memory_report:
        out.append(memory_report(run))
    if cfg.print_schedule and run.pipe:
        out.append(schedule_report(run))
    return out if grid.is_logger else []


def timeline_report(run) -> str:
    """--print-timeline: every rank's compute spans and collectives of the recorded step, drawn on one
    time axis by rank 0 (timeline.py), and saved to --out/timeline.json."""
    record = run.grid.traffic.time.stop()
    ranks = [record]
    if run.grid.world > 1:
        ranks = [None] * run.grid.world
        torch.distributed.all_gather_object(ranks, record)  # once, after the step: not counted traffic
    if not run.grid.is_logger:
        return ""
    record = {"step": run.timeline_step, "ranks": ranks}
    storage.replace_atomically(Path(run.cfg.out) / "timeline.json", json.dumps(record))
    return f"step {run.timeline_step}: " + timeline.draw(ranks)


def schedule_report(run) -> str:
    """--print-schedule: the ops every stage ran, on a clock, with the bubble they leave next to the
    paper's, and the most activations each stage held (interleaved: of one chunk, 1/v of a stage's)."""
    cfg, grid = run.cfg, run.grid
    ops = run.pipe.all_stage_ops()
    peaks = torch.zeros(grid.pp, dtype=torch.long, device=grid.device)
    grid.all_gather(peaks, torch.tensor([run.pipe.peak_live], device=grid.device), "pp")
    m = cfg.batch_size // grid.dp // cfg.micro_batch_size
    chunks = f" of {grid.vp} chunks each (a, b, ...: chunk 0, 1, ...)" if grid.vp > 1 else ""
    held = "(micro-batch, chunk) activations" if grid.vp > 1 else "micro-batches of activations"
    return (f"pipeline schedule {cfg.pp_schedule}, {grid.pp} stages{chunks}, {m} micro-batches:\n"
            + pipeline.draw_schedule(ops) + f"\n{held} held at once, by stage: "
            + ", ".join(f"{s}: {int(n)}" for s, n in enumerate(peaks)))


def memory_report(run) -> str:
    """--memory-report: every rank's lines, gathered to rank 0 (one rank's memory is not another's)."""
    cfg, grid = run.cfg, run.grid
    if run.gather is not None and not run.gather.all_free():
        raise RuntimeError("ZeRO-3 left weights gathered after the step")  # a leak the report would hide
    elem = (stability.PRECISIONS[cfg.precision].compute or torch.float32).itemsize
    cuda = run.device.type == "cuda"
    residual = next(run.model.parameters()).dtype.itemsize  # the stream the LayerNorms read (activation_bytes)
    predicted = formulas.activation_formula(run.model_cfg, cfg.seq_len // grid.cp, cfg.micro_batch_size, grid.tp,
                                            grid.sp, cfg.recompute, cfg.attn, elem, 1 if cuda else elem,
                                            4 if cuda else residual)
    text = formulas.memory_report(run.memory["state"], formulas.state_formula(run.model, run.opt, run.sync, grid),
                                  run.memory["activations"], predicted, grid, cfg.zero, cfg.recompute)
    if grid.world == 1:
        return text
    texts = [None] * grid.world
    torch.distributed.all_gather_object(texts, text)  # text, once, after the step: not counted traffic
    return "\n".join(texts)
