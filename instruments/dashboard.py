"""The dashboard: out/report.html, one page that shows a run while it trains.

    python train.py ...            # writes out/report.html as it goes: open it in a browser
    python -m instruments.dashboard out   # (re)write it from out/metrics.jsonl (a finished or killed run)

Why a picture. A large run goes wrong quietly. The essays this project grew from (Chinese engineering
write-ups on why large-model training is hard) keep coming back to it: a loss spike is found by
"stopping the model, analysing the gradient norm, checking the data fed in at that moment: a needle in
the ocean"; a 2,000-GPU cluster whose monitors showed busy GPUs was at under 30% MFU; "monitoring is
the basis of fault tolerance: if it is poor, problems go unnoticed"; and what they ask for next is
gradient flow, activation statistics and communication latency on one dashboard. metrics.jsonl has
the numbers; this page makes them something you look at.

What to look at, chart by chart:

    loss          the training loss every step, the validation loss at each evaluation (dots). Val
                  above train and rising: memorizing. Marked: spikes (red triangles; the shaded
                  span is what the spike guard rolled back and replayed), skipped steps (orange x:
                  non-finite loss or gradient), checkpoints (grey ticks), resumes (purple lines).
    lr            the schedule: warm-up, then cosine. A spike right after warm-up ends says the
                  peak is too high.
    grad norm     the global norm before clipping (--clip, dashed): a norm that sits above the clip
                  means every step is being clipped, i.e. the lr is effectively lower than the chart
                  above says; a norm that climbs for many steps comes before a spike.
    loss scale    fp16 only: halves on each overflow, grows after --loss-scale-window clean steps.
                  A scale that keeps falling means the gradients really are non-finite.
    tokens/s, MFU the throughput and the share of the hardware's peak it uses (PaLM's 6N + 12LHQT
                  FLOPs per token). A drop that lasts is a straggler, a slow disk, a recompile.
    per layer     every --stats-every steps (stats.py): each layer's gradient norm (gradient flow:
                  vanishing toward the input, one layer exploding), ||ΔW||/||W|| (about 1e-3 is
                  healthy; 1e-2 rewrites the layer every step, 1e-5 has stopped it learning) and the
                  RMS of each block's output (the residual stream grows with depth; a jump is an
                  activation blow-up). "Across depth" shows the latest of each against the layer.
    experts       with --moe-experts, one chart per MoE block: each expert's share of the block's
                  assignments over steps (a line per expert; dashed, even load 1/E) and the share
                  dropped over capacity. Router collapse is one line climbing to 1 while the others
                  fall to 0, and the dropped share climbing with it (capacity caps the winner); a
                  healthy router keeps its lines in a band around 1/E.
    communication host time per collective per step (parallel runs): the time that MFU loses to
                  waiting. Overlapped collectives (data-parallel buckets) count from launch to
                  completion, so part of theirs was hidden behind the backward.

The page is self-contained: the numbers are embedded as JSON, inline JavaScript draws SVG charts,
there is no network, no server and no font to fetch; it works from file://. It is written atomically
(a temporary file renamed over the old one, so a browser never reads half a page) at every evaluation,
at the end, and at most every few seconds in between. While the run trains the page reloads itself
every few seconds; a finished (or stopped) run's page stays still. The page itself (its HTML, style
and script) is dashboard.html, beside this file; this file fills in the numbers.
"""

import html
import json
import math
import os
import sys
import time
from pathlib import Path

from support import rundir
from support.cli import OneLineParser
from support.observer import Observer

WRITE_EVERY_S = 5.0  # between evaluations the page is rewritten at most this often
RELOAD_S = 5  # a live page reloads itself this often...
STALE_S = 600  # ...unless it has not been rewritten for this long (the run died without saying so)
STEP_KEYS = ("loss", "lr", "grad_norm", "loss_scale", "tokens_per_sec", "mfu", "peak_mem_gb")


# dashboard.html, beside this file, is the page: its HTML, style and script, with two holes that
# `render` fills, %TITLE% and %DATA% (the numbers as JSON, in the script element DATA_OPEN opens). It is
# found beside this file's real path (a scratch directory may link to the .py files alone).
# Plain SVG from plain JavaScript: a chart is axes with "nice" ticks (1, 2, 5 x 10^k; decades on a
# log scale), one polyline per series (its points are the steps: `data-n` counts them, `data-last` is
# the last value as the run logged it), markers for events, and a legend with the latest values.
# Hovering shows every series' value at the nearest step.

TEMPLATE = (Path(__file__).resolve().parent / "dashboard.html").read_text(encoding="utf-8")
DATA_OPEN = '<script type="application/json" id="data">'  # where the numbers start (previous_about reads them back)


def number(v):
    """A JSON-safe number: NaN and infinities (a skipped step's loss) become null."""
    return v if isinstance(v, (int, float)) and math.isfinite(v) else None


def collect(rows: list[dict]) -> dict:
    """metrics.jsonl's rows, as the page's columns: steps, per-layer rows, events."""
    steps = sorted((r for r in rows if "event" not in r), key=lambda r: r["step"])
    out = {"step": [r["step"] for r in steps]}
    for key in STEP_KEYS:
        if any(key in r for r in steps):
            out[key] = [number(r.get(key)) for r in steps]
    out["skipped"] = [r["step"] for r in steps if r.get("skipped")]
    evals = [r for r in steps if "val_loss" in r]
    out["val"] = {"step": [r["step"] for r in evals], "loss": [number(r["val_loss"]) for r in evals]}
    labels = sorted({k for r in steps for k in r.get("comm_s", {})})
    comm = {"step": [r["step"] for r in steps if "comm_s" in r]}
    comm["seconds"] = {k: [number(r["comm_s"].get(k)) for r in steps if "comm_s" in r] for k in labels}
    layers = sorted((r for r in rows if r.get("event") == "layers"), key=lambda r: r["step"])
    names = list(layers[-1]["grad_norm"]) if layers else []
    per_layer = {"names": names, "step": [r["step"] for r in layers]}
    for stat in ("grad_norm", "update_ratio", "act_rms", "fp8_x_amax", "fp8_g_amax"):
        per_layer[stat] = {n: [number(r.get(stat, {}).get(n)) for r in layers] for n in names}
    experts = [n for n in names if any(n in r.get("moe_load", {}) for r in layers)]  # MoE blocks, in depth order
    per_layer["moe_load"] = {n: [[number(v) for v in r["moe_load"][n]] if n in r.get("moe_load", {}) else None
                                 for r in layers] for n in experts}
    per_layer["moe_dropped"] = {n: [number(r.get("moe_dropped", {}).get(n)) for r in layers] for n in experts}
    events = {"spike": [], "checkpoint": [], "resume": []}
    for r in rows:
        if r.get("event") in events:
            events[r["event"]].append({k: number(v) if isinstance(v, float) else v for k, v in r.items()
                                       if k in ("step", "loss", "batch", "rolled_back_to", "gave_up", "bytes",
                                                "write_s", "blocking_s")})
    return {"steps": out, "comm": comm, "layers": per_layer, "events": events}


def describe(cfg, grid, run_id: str) -> dict:
    """What the page's header says about the run (cfg: a config.TrainConfig, grid: a parallel.Grid)."""
    layout = f"dp {grid.dp} x tp {grid.tp} x pp {grid.pp}" + (f" x cp {grid.cp}" if grid.cp > 1 else "")
    return {"run": run_id, "model": cfg.preset + (f", {cfg.n_layer} layers" if cfg.n_layer else ""),
            "batch": f"{cfg.batch_size} x {cfg.seq_len} tokens", "precision": cfg.precision,
            "device": grid.device.type, "layout": f"{grid.world} process{'es' if grid.world > 1 else ''}: {layout}"
            + (" + sp" if grid.sp else "") + (f", ZeRO-{cfg.zero}" if cfg.zero else ""),
            "max_steps": cfg.max_steps, "clip": cfg.clip, "stats_every": cfg.stats_every}


def page_data(out: Path, about: dict, status: str) -> dict:
    rows = rundir.Metrics(out / "metrics.jsonl", enabled=False, resume_step=0, log=lambda _: None).rows()
    return {"about": about, "status": status, "live": status == "training", "written": time.time(),
            "reload_s": RELOAD_S, "stale_s": STALE_S, **collect(rows)}


def render(data: dict) -> str:
    """The page: the template with the data embedded (`</` escaped, so no value can close the script)."""
    blob = json.dumps(data, allow_nan=False, separators=(",", ":")).replace("</", "<\\/")
    title = html.escape(f"nanoscale run {data['about'].get('run', '')}".strip())
    return TEMPLATE.replace("%TITLE%", title).replace("%DATA%", blob)


def write(out: Path, data: dict) -> Path:
    """out/report.html, atomically: a reader sees the old page or the new one, never half of one."""
    path, tmp = out / "report.html", out / ".report.html.tmp"
    tmp.write_text(render(data), encoding="utf-8")
    os.replace(tmp, path)
    return path


class Report(Observer):
    """The training loop's handle on the page (rank 0 writes; the others hold a disabled one): redrawn once
    a step's line is written (at once after an evaluation, else every few seconds) and when the run ends."""

    def __init__(self, out: Path, enabled: bool, about: dict):
        self.out, self.enabled, self.about, self.last, self.failed = out, enabled, about, 0.0, False

    def update(self, now: bool = False, status: str = "training") -> None:
        """Rewrite the page if `now` (an evaluation, the end) or if the last write is a few seconds old.
        A page that cannot be written costs one warning, never the run."""
        if not self.enabled or (not now and time.monotonic() - self.last < WRITE_EVERY_S):
            return
        self.last = time.monotonic()
        try:
            write(self.out, page_data(self.out, self.about, status))
        except Exception as e:  # a full disk, an unreadable metrics.jsonl: the run goes on without its page
            if not self.failed:
                print(f"warning: could not write {self.out / 'report.html'}: {e}", flush=True)
            self.failed = True

    def step_written(self, row: dict) -> None:
        self.update(now="val_loss" in row)

    def run_end(self, status: str) -> None:
        self.update(now=True, status="finished" if status == "finished" else "stopped")


def previous_about(path: Path) -> dict:
    """The header the training run wrote into an existing page (its flags are not in metrics.jsonl)."""
    try:
        text = path.read_text(encoding="utf-8")
        start = text.index(DATA_OPEN) + len(DATA_OPEN)
        return json.loads(text[start:text.index("</script>", start)].replace("<\\/", "</"))["about"]
    except (OSError, ValueError, KeyError):
        return {}


def main(argv=None) -> None:
    p = OneLineParser(prog="python -m instruments.dashboard", description="(Re)write OUT/report.html from "
                      "OUT/metrics.jsonl: the dashboard a training run keeps up to date, for a run that is over (or "
                      "was killed).")
    p.add_argument("out", help="a run directory (train.py --out)")
    args = p.parse_args(argv)
    out = Path(args.out)
    if not (out / "metrics.jsonl").is_file():
        print(f"error: {out / 'metrics.jsonl'} not found; give a run directory (what train.py --out names)",
              file=sys.stderr)
        sys.exit(2)
    about = previous_about(out / "report.html") or {"run": rundir.read_run_id(out) or ""}
    try:
        data = page_data(out, about, "stopped")
    except rundir.RunDirError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    last = data["steps"]["step"][-1] if data["steps"]["step"] else 0
    data["status"] = "finished" if last and last == about.get("max_steps") else "stopped"
    print(f"wrote {write(out, data)} ({last} steps)")


if __name__ == "__main__":
    main()
