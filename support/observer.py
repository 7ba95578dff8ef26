"""The seam between the reference and the instruments: what a run tells them, and when.

The reference (the step, Grid's collectives, the saves) calls one `Observer`, `Grid.observer` (parallel.py),
at the named points below; this one does nothing. The instruments (instruments/: the timeline, per-layer
statistics, the reports, the dashboard) subclass it and override the points they need, and train.py's
main attaches them (instruments/observers.py). No plugin registry and no string events: a new instrument
is a class with some of these methods. The core never reads anything back, so a run without instruments
computes exactly what a run with them does.
"""

import contextlib


class Observer:
    """What the core tells the instruments, and when: each method does nothing here, and an instrument
    (instruments/) overrides the ones it needs. The run holds one, `Grid.observer` (several instruments
    share it through a fan-out); the core never reads anything back from it, so a run without instruments
    trains exactly as one with them.

        resumed(manifest)       the run goes on from a checkpoint (its manifest: the flags and layout it had)
        step_begin(step)        before step `step` (1, 2, ...) draws its batch
        span(name)              around the compute of a step: "F" forward, "B" backward, "O" optimizer
        collective(...)         around each collective: start() launches it and returns its handle
        gradient_event(what, i) gradient bucket i "launch"ed, the "backward done", all "reduced"
        gather_event(what, i)   ZeRO-3's units of use i (0 the embeddings, i block i - 1 and its experts):
                                "gather" launched, "ready" (or "ready (landed early)"),
                                "compute" begins, "free"d: with the above, how communication overlaps compute
        after_grads()           the gradients are reduced and unscaled, not yet clipped
        after_update(updated)   the optimizer has stepped (updated) or skipped; gradients still there
        step_end(row)           the step's numbers, before they are written: an instrument adds its own
        step_written(row)       the step's line is in metrics.jsonl (a checkpoint of the step may follow)
        saved(record)           a checkpoint is complete: its step, bytes and what it cost the loop
        run_end(status)         the loop is over: "finished", "stopped" (a signal) or "failed" (an error)
    """

    def resumed(self, manifest: dict) -> None: ...

    def step_begin(self, step: int) -> None: ...

    def span(self, name: str):
        return contextlib.nullcontext()

    def collective(self, op: str, group: str, members: tuple[int, ...], nbytes: int, start):
        return start()

    def gradient_event(self, what: str, bucket: int) -> None: ...

    def gather_event(self, what: str, unit: int) -> None: ...

    def after_grads(self) -> None: ...

    def after_update(self, updated: bool) -> None: ...

    def step_end(self, row: dict) -> None: ...

    def step_written(self, row: dict) -> None: ...

    def saved(self, record: dict) -> None: ...

    def run_end(self, status: str) -> None: ...
