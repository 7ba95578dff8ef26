"""The dashboard (dashboard.py), opened in a real browser: headless Chromium renders out/report.html
from file://, and the charts in the rendered DOM must carry the run's own numbers.

Chromium comes from Debian's package (`apt-get install -y chromium`; CI installs it). It is started
with everything that phones home turned off, a proxy that goes nowhere and no name resolution, so
the test cannot reach the network, and neither could the page.
"""

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import ROOT, metrics, run_train

from instruments import dashboard

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
OFFLINE = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND"]
# a spike at step 25 (batch 24 poisoned), rolled back to the checkpoint of step 20; statistics every 2 steps
SPIKE = ["--max-steps", "30", "--lr", "3e-3", "--ckpt-every", "5", "--eval-every", "10", "--poison-step", "24",
         "--spike-z", "4", "--spike-window", "5", "--stats-every", "2"]


def browse(page: Path, *flags: str) -> str:
    """What Chromium makes of the page: the DOM after its scripts ran (--dump-dom), unless flags say else."""
    assert Path(CHROMIUM).exists(), "the dashboard test needs Chromium: apt-get install -y chromium"
    with tempfile.TemporaryDirectory() as profile:
        result = subprocess.run([CHROMIUM, *OFFLINE, f"--user-data-dir={profile}", "--virtual-time-budget=3000",
                                 *(flags or ["--dump-dom"]), page.resolve().as_uri()],
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def attrs(tag: str) -> dict:
    return dict(re.findall(r'([\w-]+)="([^"]*)"', tag))


def lines(dom: str, chart: str) -> dict[str, dict]:
    """The polylines of one chart: series name -> its attributes (points, data-n, data-last)."""
    svg = re.search(rf'<svg[^>]*data-chart="{chart}".*?</svg>', dom, re.S)
    assert svg, f"chart {chart} was not drawn"
    return {a["data-series"]: a for a in map(attrs, re.findall(r"<polyline[^>]*>", svg.group(0)))}


def assert_series(line: dict, values: list[float]) -> None:
    """A series drawn with one point per value, ending at the run's last value (the exact float)."""
    assert int(line["data-n"]) == len(values) == len(line["points"].split())
    assert float(line["data-last"]) == values[-1]


@pytest.fixture(scope="module")
def spiked(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("spiked")
    run_train(corpus, out, *SPIKE)
    return out, browse(out / "report.html")


def test_the_page_draws_the_runs_numbers(spiked):
    out, dom = spiked
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 31))
    loss = lines(dom, "loss")
    assert_series(loss["loss"], [r["loss"] for r in rows])
    assert_series(loss["val loss"], [r["val_loss"] for r in rows if "val_loss" in r])
    assert_series(lines(dom, "lr")["lr"], [r["lr"] for r in rows])
    assert_series(lines(dom, "grad_norm")["grad norm"], [r["grad_norm"] for r in rows])
    assert_series(lines(dom, "tokens")["tokens/s"], [r["tokens_per_sec"] for r in rows])
    assert_series(lines(dom, "mfu")["MFU %"], [100 * r["mfu"] for r in rows])
    assert re.search(r'class="empty" data-chart="loss_scale">no loss scaling in this run \(fp32\)', dom)
    assert re.search(r'class="empty" data-chart="comm">one process: no collectives', dom)
    # the axes carry numbers: the loss chart's y ticks span the losses
    ticks = [float(t) for t in re.findall(r'class="ytick">([\d.]+)<', re.search(
        r'data-chart="loss".*?</svg>', dom, re.S).group(0))]
    assert min(ticks) <= min(r["loss"] for r in rows) and max(ticks) >= max(r["loss"] for r in rows)
    assert '<span id="status" class="badge finished">finished · 30 steps</span>' in dom


def test_per_layer_charts_follow_the_layer_rows(spiked):
    out, dom = spiked
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    layers = [r for r in rows if r.get("event") == "layers"]
    # the rollback from step 25 to 20 dropped the rows of steps 22 and 24; the replay wrote them once
    assert [r["step"] for r in layers] == [1] + list(range(2, 31, 2))
    for stat in ("grad_norm", "update_ratio", "act_rms"):
        drawn = lines(dom, f"layer_{stat}")
        assert list(drawn) == list(layers[-1][stat]) == ["embed", "h.0", "h.1", "h.2", "h.3", "ln_f"][:len(drawn)]
        for layer, line in drawn.items():
            assert_series(line, [r[stat][layer] for r in layers])
    depth = lines(dom, "layer_depth")
    assert float(depth["grad norm"]["data-last"]) == layers[-1]["grad_norm"]["ln_f"]
    # no experts, no expert chart
    assert 'data-chart="layer_moe_' not in dom and dashboard.collect(rows)["layers"]["moe_load"] == {}


def test_expert_load_is_charted_per_moe_block(corpus, tmp_path):
    """With experts in blocks 1 and 3: one chart each, a line per expert following its share in every `layers`
    row, the dropped share, and the even-load line at 1/E; a dense block has none."""
    run_train(corpus, tmp_path, "--moe-experts", "4", "--moe-every", "2", "--moe-capacity-factor", "1.0",
              "--max-steps", "6", "--stats-every", "2")
    layers = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
              if r.get("event") == "layers"]
    assert [r["step"] for r in layers] == [1, 2, 4, 6]
    dom = browse(tmp_path / "report.html")
    assert re.findall(r'data-chart="(layer_moe_[^"]+)"', dom) == ["layer_moe_h.1", "layer_moe_h.3"]
    for block in ("h.1", "h.3"):
        drawn = lines(dom, f"layer_moe_{block}")
        assert list(drawn) == ["expert 0", "expert 1", "expert 2", "expert 3", "dropped"]
        for e in range(4):
            assert_series(drawn[f"expert {e}"], [r["moe_load"][block][e] for r in layers])
        assert_series(drawn["dropped"], [r["moe_dropped"][block] for r in layers])
        chart = re.search(rf'data-chart="layer_moe_{block}".*?</svg>', dom, re.S).group(0)
        assert re.search(r'<line class="hline"[^>]*>', chart) and ">even 1/4<" in chart


def test_a_collapsed_router_is_one_line_at_the_top(tmp_path):
    """test_stats.py's seeded collapse, three statistics steps written as a run's metrics.jsonl: in every
    block's chart expert 0's line ends above 0.99, the others below 0.01."""
    import torch
    from test_moe import collapsed_model
    from test_stats import moe_step
    cfg, model = collapsed_model(257, capacity_factor=1.0)
    idx = torch.randint(0, 257, (4, 33), generator=torch.Generator().manual_seed(2))
    rows = []
    for step in (1, 2, 3):
        rows += [{"step": step, "loss": 5.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_sec": 1e3, "mfu": 0.1},
                 moe_step(cfg, model, [idx]) | {"step": step}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    dashboard.write(tmp_path, dashboard.page_data(tmp_path, {"run": "collapsed", "max_steps": 3}, "finished"))
    dom = browse(tmp_path / "report.html")
    for block in ("h.0", "h.1", "h.2", "h.3"):
        drawn = lines(dom, f"layer_moe_{block}")
        assert int(drawn["expert 0"]["data-n"]) == 3 and float(drawn["expert 0"]["data-last"]) > 0.99, block
        assert all(float(drawn[f"expert {e}"]["data-last"]) < 0.01 for e in (1, 2, 3)), block
        assert 0.74 < float(drawn["dropped"]["data-last"]) <= 0.75, block


def test_spikes_rollbacks_and_checkpoints_are_marked(spiked):
    out, dom = spiked
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    spikes = [e for e in events if e.get("event") == "spike"]
    assert [(s["step"], s["rolled_back_to"]) for s in spikes] == [(25, 20)]
    assert re.search(r'<g class="marker spike" data-step="25"><path[^>]*></path><title>step 25: loss '
                     r'[\d.]+ is a spike; rolled back to step 20, batch 24 skipped</title>', dom)
    assert re.search(r'<rect class="band replayed"[^>]*><title>steps 21-25 replayed after the spike</title>', dom)
    saves = [e["step"] for e in events if e.get("event") == "checkpoint"]
    assert sorted(int(s) for s in re.findall(r'class="marker ckpt" data-step="(\d+)"', dom)) == sorted(saves)
    assert re.search(r'data-stat="spikes"><b>1</b>', dom)


def test_a_live_page_reloads_and_a_finished_one_does_not(spiked, tmp_path):
    out, dom = spiked
    html = lambda dom: attrs(re.search(r"<html[^>]*>", dom).group(0))
    assert html(dom)["data-rendered"] == "1" and "data-reload" not in html(dom)
    shutil.copy(out / "metrics.jsonl", tmp_path / "metrics.jsonl")
    dashboard.write(tmp_path, dashboard.page_data(tmp_path, {"run": "x", "max_steps": 40}, "training"))
    live = browse(tmp_path / "report.html")
    assert html(live)["data-reload"] == "5"  # seconds; the budget Chromium runs the page for is shorter
    assert '<span id="status" class="badge training">training · step 30 of 40</span>' in live
    assert not list(tmp_path.glob(".*tmp"))  # written atomically: nothing left beside it


def test_the_page_is_self_contained(spiked):
    out, _ = spiked
    page = (out / "report.html").read_text()
    assert not re.search(r"<(link|img|iframe)\b|<script[^>]*\bsrc=|@import|url\(", page)
    assert re.findall(r"https?://[^\s\"']+", page) == ["http://www.w3.org/2000/svg"]  # a name, never fetched


def test_the_command_rewrites_the_page(spiked, tmp_path):
    out, dom = spiked
    for name in ("metrics.jsonl", "run.json"):
        shutil.copy(out / name, tmp_path / name)
    done = subprocess.run([sys.executable, "-m", "instruments.dashboard", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == f"wrote {tmp_path / 'report.html'} (30 steps)\n"
    assert lines(browse(tmp_path / "report.html"), "loss")["loss"] == lines(dom, "loss")["loss"]
    bad = subprocess.run([sys.executable, "-m", "instruments.dashboard", str(tmp_path / "nothing")],
                         cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and bad.stderr.startswith("error: ")


def test_parallel_runs_chart_the_time_of_each_collective(corpus, tmp_path):
    run_train(corpus, tmp_path, "--zero", "1", "--max-steps", "6", nproc=2)
    rows = metrics(tmp_path)
    comm = lines(browse(tmp_path / "report.html"), "comm")
    # ZeRO-1's collectives every step, and at step 1 the statistics' one all-reduce over the world
    assert set(comm) == {k for r in rows for k in r["comm_s"]} == \
        {"all_reduce dp", "reduce_scatter dp", "all_gather dp", "all_reduce world"}
    for name, line in comm.items():
        assert_series(line, [1e3 * r["comm_s"][name] for r in rows if name in r["comm_s"]])
    assert all(v > 0 for r in rows for v in r["comm_s"].values())


def test_a_screenshot_shows_the_charts(spiked, tmp_path):
    """Pixels, not just DOM: the rendered page is mostly white cards with coloured lines on them."""
    out, _ = spiked
    browse(out / "report.html", "--hide-scrollbars", "--window-size=1200,900", f"--screenshot={tmp_path / 'p.png'}")
    png = (tmp_path / "p.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
