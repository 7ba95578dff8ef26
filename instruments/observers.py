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
has always had them), and the order reports print in. Each is an Observer (support/observer.py) that overrides
the points it needs; `Fanout` is the Observer the grid holds, passing every call on to each of them.
"""

import contextlib
import functools
from pathlib import Path

from instruments.dashboard import Report, describe
from instruments.reports import MFU, Reports
from instruments.stats import LayerStats
from instruments.timeline import Timeline
from support.observer import Observer


def each(method):
    """The Observer method `method`, fanned out: it calls that method of every observer, in order."""
    def fan(self, *args) -> None:
        for o in self.observers:
            getattr(o, method.__name__)(*args)
    return fan


class Fanout(Observer):
    """One Observer made of several: each call goes to each of them, in order."""

    def __init__(self, observers: list[Observer]):
        self.observers = observers

    resumed, step_begin = each(Observer.resumed), each(Observer.step_begin)
    gradient_event, gather_event = each(Observer.gradient_event), each(Observer.gather_event)
    after_grads, after_update = each(Observer.after_grads), each(Observer.after_update)
    step_end, step_written = each(Observer.step_end), each(Observer.step_written)
    saved, run_end = each(Observer.saved), each(Observer.run_end)

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
