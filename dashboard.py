"""The dashboard: out/report.html, one page that shows a run while it trains.

    python train.py ...            # writes out/report.html as it goes: open it in a browser
    python dashboard.py out        # (re)write it from out/metrics.jsonl, e.g. for a finished or killed run

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
    communication host time per collective per step (parallel runs): the time that MFU loses to
                  waiting. Overlapped collectives (data-parallel buckets) count from launch to
                  completion, so part of theirs was hidden behind the backward.

The page is self-contained: the numbers are embedded as JSON, inline JavaScript draws SVG charts,
there is no network, no server and no font to fetch; it works from file://. It is written atomically
(a temporary file renamed over the old one, so a browser never reads half a page) at every evaluation,
at the end, and at most every few seconds in between. While the run trains the page reloads itself
every few seconds; a finished (or stopped) run's page stays still.
"""

import html
import json
import math
import os
import sys
import time
from pathlib import Path

import rundir
from cli import OneLineParser

WRITE_EVERY_S = 5.0  # between evaluations the page is rewritten at most this often
RELOAD_S = 5  # a live page reloads itself this often...
STALE_S = 600  # ...unless it has not been rewritten for this long (the run died without saying so)
STEP_KEYS = ("loss", "lr", "grad_norm", "loss_scale", "tokens_per_sec", "mfu", "peak_mem_gb")


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
    for stat in ("grad_norm", "update_ratio", "act_rms"):
        per_layer[stat] = {n: [number(r.get(stat, {}).get(n)) for r in layers] for n in names}
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


class Report:
    """The training loop's handle on the page (rank 0 writes; the others hold a disabled one)."""

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


def previous_about(path: Path) -> dict:
    """The header the training run wrote into an existing page (its flags are not in metrics.jsonl)."""
    try:
        text = path.read_text(encoding="utf-8")
        start = text.index(DATA_OPEN) + len(DATA_OPEN)
        return json.loads(text[start:text.index("</script>", start)].replace("<\\/", "</"))["about"]
    except (OSError, ValueError, KeyError):
        return {}


def main(argv=None) -> None:
    p = OneLineParser(prog="python dashboard.py", description="(Re)write OUT/report.html from OUT/metrics.jsonl: "
                      "the dashboard a training run keeps up to date, for a run that is over (or was killed).")
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


DATA_OPEN = '<script type="application/json" id="data">'

# ----------------------------------------------------------------------------- the page
#
# Plain SVG from plain JavaScript: a chart is axes with "nice" ticks (1, 2, 5 x 10^k; decades on a log
# scale), one polyline per series (its points are the steps: `data-n` counts them, `data-last` is the
# last value as the run logged it), markers for events, and a legend with the latest values. Hovering
# shows every series' value at the nearest step.

TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>%TITLE%</title>
<style>
body { font: 13px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 0; background: #f4f5f7;
       color: #1d232a; }
header { padding: 14px 22px 6px; }
h1 { font-size: 19px; margin: 0 8px 4px 0; display: inline-block; }
h2 { font-size: 14px; margin: 0 0 2px; }
h3 { font-size: 15px; margin: 14px 22px 0; color: #4a5561; }
.badge { display: inline-block; padding: 2px 9px; border-radius: 10px; font-weight: 600; font-size: 12px;
         vertical-align: 3px; }
.badge.training { background: #d6f5df; color: #146b32; } .badge.finished { background: #dde7f7; color: #1b4f9c; }
.badge.stopped { background: #fbe0dc; color: #a12a1b; }
.about { color: #56616d; margin: 2px 0 8px; }
.cards { display: flex; flex-wrap: wrap; gap: 8px; }
.stat { background: #fff; border-radius: 6px; padding: 6px 11px; box-shadow: 0 1px 2px #0002; min-width: 82px; }
.stat b { display: block; font-size: 16px; } .stat span { color: #68737f; font-size: 11px; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(470px, 1fr)); gap: 12px; padding: 8px 22px; }
.card { background: #fff; border-radius: 6px; padding: 10px 12px 8px; box-shadow: 0 1px 2px #0002;
        position: relative; }
.card.wide { grid-column: 1 / -1; }
.note { color: #68737f; margin: 0 0 4px; font-size: 12px; }
.empty { color: #8a949e; font-style: italic; padding: 26px 0; text-align: center; }
svg.chart { width: 100%; height: auto; display: block; }
svg text { font-size: 10.5px; fill: #56616d; }
.gridline { stroke: #e6e9ec; } .axis { stroke: #9aa3ac; }
.line { fill: none; stroke-width: 1.5; stroke-linejoin: round; }
.legend { display: flex; flex-wrap: wrap; gap: 3px 12px; font-size: 11.5px; color: #3a444e; }
.legend i { display: inline-block; width: 14px; height: 3px; vertical-align: middle; margin-right: 4px; }
.tip { position: absolute; pointer-events: none; background: #1d232aee; color: #fff; font-size: 11.5px;
       padding: 5px 8px; border-radius: 4px; white-space: pre; display: none; z-index: 2; }
footer { color: #8a949e; padding: 4px 22px 18px; font-size: 11.5px; }
</style>
</head>
<body>
<header>
<h1 id="title"></h1><span id="status" class="badge"></span>
<div class="about" id="about"></div>
<div class="cards" id="cards"></div>
</header>
<div class="grid" id="main"></div>
<h3 id="layers-title">Per layer</h3>
<div class="grid" id="layers"></div>
<h3>Communication</h3>
<div class="grid" id="comm"></div>
<footer id="footer"></footer>
""" + DATA_OPEN + """%DATA%</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const S = D.steps, E = D.events, L = D.layers, C = D.comm, A = D.about;
const NS = "http://www.w3.org/2000/svg";
const M = {l: 58, r: 14, t: 10, b: 30};  // margins: the plot area is x in [M.l, W - M.r], y in [M.t, H - M.b]

function el(tag, attrs, text) {
  const e = tag.startsWith("svg:") ? document.createElementNS(NS, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
const finite = v => typeof v === "number" && isFinite(v);
const least = a => a.reduce((m, v) => v < m ? v : m, Infinity);  // Math.min(...a) fails on very long runs
const most = a => a.reduce((m, v) => v > m ? v : m, -Infinity);
// a short number for ticks and labels: 3 significant digits, k/M/G above 10^4, exponents below 10^-3
function fmt(v, digits = 3) {
  if (!finite(v)) return "-";
  const a = Math.abs(v);
  if (a === 0) return "0";
  if (a >= 1e4) {
    const [d, s] = a >= 1e9 ? [1e9, "G"] : a >= 1e6 ? [1e6, "M"] : [1e3, "k"];
    return String(+(v / d).toPrecision(digits)) + s;
  }
  if (a < 1e-3) return v.toExponential(Math.max(0, digits - 2)).replace(/\\.?0+e/, "e");
  return String(+v.toPrecision(digits));
}
function niceStep(span, n) {
  const raw = span / n, mag = Math.pow(10, Math.floor(Math.log10(raw))), r = raw / mag;
  return (r < 1.5 ? 1 : r < 3 ? 2 : r < 7 ? 5 : 10) * mag;
}
// a linear scale over [lo, hi] widened to whole ticks, or a log scale over whole decades
function scale(lo, hi, a, b, log) {
  if (log) {
    let d0 = Math.floor(Math.log10(lo)), d1 = Math.ceil(Math.log10(hi));
    if (d1 === d0) d1 += 1;
    const ticks = [];
    for (let d = d0; d <= d1; d++) {
      ticks.push(Math.pow(10, d));
      if (d1 - d0 <= 2 && d < d1) ticks.push(2 * Math.pow(10, d), 5 * Math.pow(10, d));
    }
    const f = v => a + (Math.log10(v) - d0) / (d1 - d0) * (b - a);
    return {f, ticks: ticks.sort((x, y) => x - y), lo: Math.pow(10, d0), hi: Math.pow(10, d1)};
  }
  if (!(hi > lo)) { const pad = Math.abs(lo) * 0.1 || 1; lo -= pad; hi += pad; }
  const step = niceStep(hi - lo, 5);
  lo = Math.floor(lo / step + 1e-9) * step; hi = Math.ceil(hi / step - 1e-9) * step;
  const ticks = [];
  for (let t = lo; t <= hi + step * 1e-6; t += step) ticks.push(+t.toPrecision(12));
  return {f: v => a + (v - lo) / (hi - lo) * (b - a), ticks, lo, hi};
}

// A chart card. spec: {id, title, note, series: [{name, color, x, y, dots, dash, width}], log, unit,
//   xmax, hlines: [{y, label}], markers: [{x, y, kind, title}], bands: [{x0, x1, title}], vlines: [{x, kind, label}],
//   xticks: [{x, label}] (categories instead of steps), empty: "why there is nothing to show", wide}
function chart(parent, spec) {
  const card = el("section", {class: "card" + (spec.wide ? " wide" : ""), id: "card-" + spec.id});
  card.append(el("h2", {}, spec.title));
  if (spec.note) card.append(el("p", {class: "note"}, spec.note));
  parent.append(card);
  const series = (spec.series || []).filter(s => s.y.some(finite));
  if (!series.length) {
    card.append(el("div", {class: "empty", "data-chart": spec.id}, spec.empty || "nothing logged yet"));
    return card;
  }
  const W = spec.wide ? 1160 : 560, H = spec.wide ? 270 : 230;  // the chart's own units (the SVG scales to fit)
  const ok = spec.log ? v => finite(v) && v > 0 : finite;
  const xs = series.flatMap(s => s.x), ys = series.flatMap(s => s.y.filter(ok));
  for (const h of spec.hlines || []) if (ok(h.y)) ys.push(h.y);
  const X = spec.xticks
    ? {f: v => M.l + (v + 0.5) / spec.xticks.length * (W - M.l - M.r), ticks: []}
    : scale(Math.min(least(xs), 0), Math.max(most(xs), spec.xmax || 0, 1), M.l, W - M.r, false);
  const Y = scale(least(ys), most(ys), H - M.b, M.t, spec.log);
  const svg = el("svg:svg", {viewBox: `0 0 ${W} ${H}`, class: "chart", "data-chart": spec.id,
                             "data-log": spec.log ? "1" : "0"});
  const g = (cls) => svg.appendChild(el("svg:g", {class: cls}));
  const axes = g("axes");
  for (const t of Y.ticks) {
    const y = Y.f(t).toFixed(1);
    axes.append(el("svg:line", {class: "gridline", x1: M.l, x2: W - M.r, y1: y, y2: y}));
    axes.append(el("svg:text", {x: M.l - 5, y: +y + 3.5, "text-anchor": "end", class: "ytick"}, fmt(t)));
  }
  const xt = spec.xticks ? spec.xticks.map((t, i) => ({x: i, label: t.label}))
                         : X.ticks.map(t => ({x: t, label: fmt(t)}));
  const every = Math.max(1, Math.ceil(xt.length / 14));
  xt.forEach((t, i) => {
    const x = X.f(t.x).toFixed(1);
    if (!spec.xticks) axes.append(el("svg:line", {class: "gridline", x1: x, x2: x, y1: M.t, y2: H - M.b}));
    if (i % every === 0) axes.append(el("svg:text", {x, y: H - M.b + 13, "text-anchor": "middle", class: "xtick"},
                                        t.label));
  });
  axes.append(el("svg:line", {class: "axis", x1: M.l, x2: W - M.r, y1: H - M.b, y2: H - M.b}));
  axes.append(el("svg:line", {class: "axis", x1: M.l, x2: M.l, y1: M.t, y2: H - M.b}));
  axes.append(el("svg:text", {x: W - M.r, y: H - 3, "text-anchor": "end"}, spec.xlabel || "step"));
  if (spec.unit) axes.append(el("svg:text", {x: 4, y: M.t + 4, "dominant-baseline": "hanging"}, spec.unit));
  for (const b of spec.bands || []) {
    const x0 = X.f(b.x0), x1 = X.f(b.x1);
    const r = el("svg:rect", {class: "band " + (b.kind || ""), x: x0, y: M.t, width: Math.max(1, x1 - x0),
                              height: H - M.b - M.t, fill: b.color || "#d6272818"});
    r.append(el("svg:title", {}, b.title || ""));
    svg.append(r);
  }
  for (const h of spec.hlines || []) {
    if (!ok(h.y)) continue;
    const y = Y.f(h.y);
    svg.append(el("svg:line", {class: "hline", x1: M.l, x2: W - M.r, y1: y, y2: y, stroke: "#8a949e",
                               "stroke-dasharray": "5 4"}));
    svg.append(el("svg:text", {x: W - M.r - 2, y: y - 3, "text-anchor": "end"}, h.label));
  }
  for (const v of spec.vlines || []) {
    const x = X.f(v.x);
    const line = el("svg:line", {class: "vline " + v.kind, "data-step": v.x, x1: x, x2: x, y1: M.t, y2: H - M.b,
                                 stroke: v.color, "stroke-dasharray": "3 3"});
    line.append(el("svg:title", {}, v.label));
    svg.append(line, el("svg:text", {x: x + 3, y: M.t + 9, fill: v.color}, v.label));
  }
  const clampY = v => Math.min(H - M.b, Math.max(M.t, Y.f(v)));
  for (const s of series) {
    const pts = [];
    s.x.forEach((x, i) => { if (ok(s.y[i])) pts.push(X.f(x).toFixed(1) + "," + Y.f(s.y[i]).toFixed(1)); });
    const last = [...s.y].reverse().find(ok);
    const line = el("svg:polyline", {class: "line", "data-series": s.name, "data-n": pts.length,
                                     "data-last": String(last), points: pts.join(" "), stroke: s.color,
                                     "stroke-width": s.width || 1.5});
    if (s.dash) line.setAttribute("stroke-dasharray", s.dash);
    svg.append(line);
    if (s.dots) s.x.forEach((x, i) => {
      if (!ok(s.y[i])) return;
      const c = el("svg:circle", {class: "dot", "data-series": s.name, cx: X.f(x).toFixed(1),
                                  cy: Y.f(s.y[i]).toFixed(1), r: 2.6, fill: s.color});
      c.append(el("svg:title", {}, `${s.name} at step ${x}: ${s.y[i]}`));
      svg.append(c);
    });
  }
  for (const m of spec.markers || []) {
    const x = X.f(m.x), y = m.y === undefined || !ok(m.y) ? M.t + 6 : clampY(m.y);
    const shape = m.kind === "spike" ? el("svg:path", {d: `M${x},${y - 8} l5,8 l-10,0 z`, fill: "#d62728"})
      : m.kind === "ckpt" ? el("svg:path", {d: `M${x},${H - M.b} l4,6 l-8,0 z`, fill: "#8a949e"})
      : el("svg:path", {d: `M${x - 4},${y - 4} l8,8 m0,-8 l-8,8`, stroke: "#ff7f0e", "stroke-width": 2});
    const mk = el("svg:g", {class: "marker " + m.kind, "data-step": m.x});
    mk.append(shape, el("svg:title", {}, m.title));
    if (m.label) mk.append(el("svg:text", {x: x + 6, y: y + 1, fill: "#d62728"}, m.label));
    svg.append(mk);
  }
  card.append(svg);
  const legend = el("div", {class: "legend"});
  for (const s of series) {
    const last = [...s.y].reverse().find(ok);
    const item = el("span", {class: "key", "data-series": s.name});
    item.append(el("i", {style: `background:${s.color}`}), `${s.name} ${fmt(last, 4)}`);
    legend.append(item);
  }
  card.append(legend);
  tooltip(card, svg, X, series, spec, W, H);
  return card;
}

// hovering: every series' value at the x nearest the pointer
function tooltip(card, svg, X, series, spec, W, H) {
  const tip = el("div", {class: "tip"});
  const cursor = el("svg:line", {x1: 0, x2: 0, y1: M.t, y2: H - M.b, stroke: "#1d232a55", visibility: "hidden"});
  svg.append(cursor);
  card.append(tip);
  const xs = [...new Set(series.flatMap(s => s.x))].sort((a, b) => a - b);
  svg.addEventListener("mousemove", e => {
    const box = svg.getBoundingClientRect(), px = (e.clientX - box.left) * W / box.width;
    let best = xs[0];
    for (const x of xs) if (Math.abs(X.f(x) - px) < Math.abs(X.f(best) - px)) best = x;
    const name = spec.xticks ? spec.xticks[best].label : `step ${best}`;
    const lines = series.map(s => [s.name, s.y[s.x.indexOf(best)]]).filter(([, v]) => v !== undefined);
    tip.textContent = [name, ...lines.map(([n, v]) => `${n}: ${fmt(v, 5)}`)].join("\\n");
    tip.style.display = "block";
    tip.style.left = Math.min(card.clientWidth - 150, (e.clientX - box.left) + 16) + "px";
    tip.style.top = (e.clientY - card.getBoundingClientRect().top + 10) + "px";
    cursor.setAttribute("x1", X.f(best)); cursor.setAttribute("x2", X.f(best));
    cursor.setAttribute("visibility", "visible");
  });
  svg.addEventListener("mouseleave", () => {
    tip.style.display = "none";
    cursor.setAttribute("visibility", "hidden");
  });
}

const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"];
// blocks from the input (dark blue) to the output (orange); the embedding and ln_f in greys
function layerColor(name, names) {
  const blocks = names.filter(n => n.startsWith("h."));
  if (!name.startsWith("h.")) return name === "embed" ? "#555" : "#a0a0a0";
  const t = blocks.length > 1 ? blocks.indexOf(name) / (blocks.length - 1) : 0;
  const stops = [[13, 8, 135], [126, 3, 168], [204, 71, 120], [248, 149, 64], [230, 180, 20]];
  const k = Math.min(stops.length - 2, Math.floor(t * (stops.length - 1))), u = t * (stops.length - 1) - k;
  const c = stops[k].map((v, j) => Math.round(v + (stops[k + 1][j] - v) * u));
  return `rgb(${c.join(",")})`;
}
const median = a => {
  const b = a.filter(finite).sort((x, y) => x - y);
  return b.length ? b[Math.floor(b.length / 2)] : null;
};
const lastOf = a => a ? [...a].reverse().find(finite) : undefined;

function header() {
  const steps = S.step, n = steps.length, last = n ? steps[n - 1] : 0;
  document.getElementById("title").textContent = `nanoscale · run ${A.run || "?"}`;
  const status = document.getElementById("status");
  status.className = "badge " + D.status;
  status.textContent = D.status === "training" ? `training · step ${last}${A.max_steps ? " of " + A.max_steps : ""}`
                     : D.status === "finished" ? `finished · ${last} steps` : `stopped at step ${last}`;
  const parts = ["model", "batch", "precision", "device", "layout"].filter(k => A[k]).map(k => `${k} ${A[k]}`);
  const written = new Date(D.written * 1000);
  document.getElementById("about").textContent = parts.join(" · ") + (parts.length ? " · " : "")
    + `written ${written.toLocaleString()}`;
  const recent = a => median((a || []).slice(-20));
  const spikes = E.spike.length, stats = [
    ["step", A.max_steps ? `${last} / ${A.max_steps}` : String(last)],
    ["loss", fmt(lastOf(S.loss), 4)], ["val loss", fmt(lastOf(S.val.loss), 4)],
    ["best val loss", fmt(least(S.val.loss.filter(finite)), 4)],
    ["tokens/s", fmt(recent(S.tokens_per_sec))], ["MFU", S.mfu ? fmt(100 * recent(S.mfu)) + "%" : "-"],
    ["grad norm", fmt(lastOf(S.grad_norm))], ["spikes", String(spikes)], ["skipped", String(S.skipped.length)],
    ["checkpoints", String(E.checkpoint.length)]];
  const cards = document.getElementById("cards");
  for (const [k, v] of stats) {
    const c = el("div", {class: "stat", "data-stat": k});
    c.append(el("b", {}, v), el("span", {}, k));
    cards.append(c);
  }
  document.getElementById("footer").textContent = "nanoscale dashboard (dashboard.py): everything on this page "
    + "comes from metrics.jsonl in the run directory. " + (D.live ? "" : "The run is not training: the page is still.");
}

function mainCharts() {
  const main = document.getElementById("main"), xmax = A.max_steps;
  const markers = [], bands = [], vlines = [];
  for (const s of E.spike) {
    markers.push({x: s.step, y: s.loss, kind: "spike", label: fmt(s.loss, 4),
      title: `step ${s.step}: loss ${fmt(s.loss, 4)} is a spike; `
      + (s.gave_up ? "the guard gave up" : `rolled back to step ${s.rolled_back_to}, batch ${s.batch} skipped`)});
    if (finite(s.rolled_back_to)) bands.push({x0: s.rolled_back_to, x1: s.step, kind: "replayed",
      title: `steps ${s.rolled_back_to + 1}-${s.step} replayed after the spike`});
  }
  for (const k of S.skipped) {
    const i = S.step.indexOf(k);
    markers.push({x: k, y: S.loss[i], kind: "skip", title: `step ${k}: non-finite loss or gradient, update skipped`});
  }
  for (const c of E.checkpoint) markers.push({x: c.step, kind: "ckpt", title: `checkpoint at step ${c.step}`
    + (finite(c.bytes) ? `: ${fmt(c.bytes / 1e6)} MB, complete after ${fmt(c.write_s)} s` : "")});
  for (const r of E.resume) vlines.push({x: r.step, kind: "resume", color: "#9467bd", label: "resume"});
  chart(main, {id: "loss", title: "Loss", wide: true, xmax, markers, bands, vlines,
    note: "Training loss every step, validation loss at each evaluation. Marked: spikes (red; the shaded span was "
      + "rolled back and replayed), skipped steps (orange x), checkpoints (grey ticks), resumes.",
    series: [{name: "loss", color: "#1f77b4", x: S.step, y: S.loss, width: 1.2},
             {name: "val loss", color: "#ff7f0e", x: S.val.step, y: S.val.loss, dots: true, width: 2}]});
  chart(main, {id: "lr", title: "Learning rate", xmax, note: "Linear warm-up, then cosine decay to --min-lr.",
    series: [{name: "lr", color: "#2ca02c", x: S.step, y: S.lr}]});
  chart(main, {id: "grad_norm", title: "Gradient norm (before clipping)", xmax, log: true,
    note: "Above the dashed --clip line every update is scaled down. A climb over many steps comes before spikes.",
    hlines: A.clip ? [{y: A.clip, label: `clip ${A.clip}`}] : [],
    series: [{name: "grad norm", color: "#d62728", x: S.step, y: S.grad_norm}]});
  chart(main, {id: "tokens", title: "Throughput", xmax, unit: "tokens/s",
    note: "Tokens per second over the whole job (every rank together); evaluation and checkpoints are not counted.",
    series: [{name: "tokens/s", color: "#17becf", x: S.step, y: S.tokens_per_sec}]});
  chart(main, {id: "mfu", title: "MFU", xmax, unit: "%",
    note: "Model FLOPs utilization: 6N + 12LHQT FLOPs per token (PaLM), over the device peak times the ranks.",
    series: [{name: "MFU %", color: "#8c564b", x: S.step, y: (S.mfu || []).map(v => finite(v) ? 100 * v : v)}]});
  chart(main, {id: "loss_scale", title: "Loss scale (fp16)", xmax, log: true,
    note: "Halved at each overflow (a skipped step), doubled after --loss-scale-window clean steps.",
    empty: `no loss scaling in this run (${A.precision || "not fp16"}): only fp16 scales the loss`,
    series: S.loss_scale ? [{name: "loss scale", color: "#9467bd", x: S.step, y: S.loss_scale}] : []});
  if (S.peak_mem_gb) chart(main, {id: "memory", title: "Peak memory", xmax, unit: "GB",
    note: "The most rank 0's step held on the GPU.",
    series: [{name: "peak GB", color: "#7f7f7f", x: S.step, y: S.peak_mem_gb}]});
}

function layerCharts() {
  const box = document.getElementById("layers"), names = L.names, xmax = A.max_steps;
  document.getElementById("layers-title").textContent = "Per layer" + (A.stats_every ? `, every ${A.stats_every} steps`
    + " and at step 1" : "") + " (stats.py)";
  const perLayer = (stat) => names.filter(n => L[stat][n]).map(n => ({name: n, color: layerColor(n, names),
    x: L.step, y: L[stat][n], dash: n.startsWith("h.") ? "" : "4 3", width: 1.3}));
  const empty = A.stats_every === 0 ? "per-layer statistics are off (--stats-every 0)" : "no statistics step yet";
  chart(box, {id: "layer_grad_norm", title: "Gradient norm per layer", log: true, xmax, empty,
    note: "Gradient flow: layers within an order of magnitude of each other is healthy; norms that shrink toward "
      + "the input vanish, one layer far above the rest is where a spike starts.",
    series: perLayer("grad_norm")});
  chart(box, {id: "layer_update_ratio", title: "Update / weight ratio per layer, ||ΔW|| / ||W||", log: true, xmax,
    empty, hlines: [{y: 1e-3, label: "1e-3"}],
    note: "How far one step moves a layer. About 1e-3 is healthy; 1e-2 rewrites the layer every step, 1e-5 has "
      + "stopped learning. With Adam, the learning rate sets this, not the gradient's size.",
    series: perLayer("update_ratio")});
  chart(box, {id: "layer_act_rms", title: "Activation RMS per block output", log: true, xmax, empty,
    note: "The residual stream after each block: it grows with depth (each block adds to it). Orders of magnitude "
      + "of growth, or a jump during training, is an activation blow-up (and fp16 overflow) on its way.",
    series: perLayer("act_rms")});
  const at = L.step.length - 1, xticks = names.map(n => ({label: n}));
  const across = (stat, label, color) => ({name: label, color, x: names.map((_, i) => i),
    y: names.map(n => L[stat][n] ? L[stat][n][at] : null)});
  chart(box, {id: "layer_depth", title: `Across depth at step ${at >= 0 ? L.step[at] : "-"}`, log: true, xticks,
    xlabel: "layer", empty, note: "The latest statistics against the layer, input (left) to output (right).",
    series: at < 0 ? [] : [across("grad_norm", "grad norm", "#d62728"),
                           across("update_ratio", "update ratio", "#2ca02c"),
                           across("act_rms", "activation RMS", "#1f77b4")]});
}

function commChart() {
  const labels = Object.keys(C.seconds);
  chart(document.getElementById("comm"), {id: "comm", title: "Communication time per collective", xmax: A.max_steps,
    unit: "ms", log: true, wide: true,
    empty: "one process: no collectives (a torchrun run shows the time each kind of collective takes per step)",
    note: "Rank 0's time from launch to completion per step, by collective and group (world: the per-layer "
      + "statistics' one all-reduce). Overlapped data-parallel buckets run during the backward, so part of their "
      + "time is hidden; the rest is what MFU loses to waiting.",
    series: labels.map((k, i) => ({name: k, color: PALETTE[i % PALETTE.length], x: C.step,
                                   y: C.seconds[k].map(v => finite(v) ? 1e3 * v : v)}))});
}

header();
mainCharts();
layerCharts();
commChart();
// a live page reloads itself, unless nobody has rewritten it for a long while (the run died silently)
if (D.live && Date.now() / 1000 - D.written < D.stale_s) {
  document.documentElement.dataset.reload = String(D.reload_s);
  setTimeout(() => location.reload(), D.reload_s * 1000);
}
document.documentElement.dataset.rendered = "1";
</script>
</body>
</html>
"""

if __name__ == "__main__":
    main()
