"""The instruments a training run attaches, and the fan-out through which they share the one seam.

train.py's main calls `attach(run)` once the run is set up, when this folder is there. What it attaches,
in the order each call reaches them:

    MFU          reports.py     mfu in the bar and in metrics.jsonl                           always
    Timeline     timeline.py    seconds per collective (comm_s), --print-timeline's record    under torchrun,
                                                                                              or --print-timeline
    LayerStats   stats.py       per-layer gradient norms, update ratios, activation RMS       --stats-every N > 0
    Report       dashboard.py   out/report.html, redrawn as the run goes                      always
    Reports      reports.py     --comm-report, --memory-report, --print-schedule,             always (the last
                                --print-timeline's picture, what checkpoints cost             line of a run)

The order is the order the numbers of a step's row are added in (mfu before comm_s, as metrics.jsonl
has always had them), and the order reports print in. Each is an Observer (parallel.py) that overrides
the points it needs; `Fanout` is the Observer the grid holds, passing every call on to each of them.
"""

import contextlib
import functools
from pathlib import Path

from instruments.dashboard import Report, describe
from instruments.reports import MFU, Reports
from instruments.stats import LayerStats
from instruments.timeline import Timeline
from parallel import Observer


class Fanout(Observer):
    """One Observer made of several: each call goes to each of them, in order."""

    def __init__(self, observers: list[Observer]):
        self.observers = observers

    def resumed(self, manifest: dict) -> None:
        for o in self.observers:
            o.resumed(manifest)

    def step_begin(self, step: int) -> None:
        for o in self.observers:
            o.step_begin(step)

    @contextlib.contextmanager
    def span(self, name: str):
        with contextlib.ExitStack() as stack:
            for o in self.observers:
                stack.enter_context(o.span(name))
            yield

    def collective(self, op: str, group: str, members: tuple[int, ...], nbytes: int, start):
        for o in reversed(self.observers):  # the first wraps all the others
            start = functools.partial(o.collective, op, group, members, nbytes, start)
        return start()

    def after_grads(self) -> None:
        for o in self.observers:
            o.after_grads()

    def after_update(self, updated: bool) -> None:
        for o in self.observers:
            o.after_update(updated)

    def step_end(self, row: dict) -> None:
        for o in self.observers:
            o.step_end(row)

    def step_written(self, row: dict) -> None:
        for o in self.observers:
            o.step_written(row)

    def saved(self, record: dict) -> None:
        for o in self.observers:
            o.saved(record)

    def run_end(self, status: str) -> None:
        for o in self.observers:
            o.run_end(status)


def attach(run) -> Observer:
    """The instruments of train.py's Run `run` (after setup, before the loop), as one Observer."""
    cfg, grid = run.cfg, run.grid
    timeline = Timeline(grid, cfg.stats_every, cfg.print_timeline, cfg.max_steps) \
        if grid.world > 1 or cfg.print_timeline else None
    stats = LayerStats(run.model, grid, run.sync, run.opt, run.model_cfg.n_layer, cfg.stats_every,
                       skip_first=cfg.comm_report or cfg.memory_report,  # their step's bytes stay exact
                       write=lambda **row: run.metrics.log(**row)) if cfg.stats_every else None
    report = Report(Path(cfg.out), grid.is_logger, describe(cfg, grid, run.run_id))
    observers = [MFU(run), timeline, stats, report, Reports(run, timeline)]
    return Fanout([o for o in observers if o is not None])
