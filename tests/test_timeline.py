"""--print-timeline: every rank's compute and collectives of one step, on one time axis (timeline.py).

What is asserted is the order of events, never their durations: with buckets, gradient all-reduces
launch while the backward still runs; with --no-overlap, only after it has ended.
"""

import json

import pytest
from conftest import run_train

from instruments import timeline

FLAGS = ["--max-steps", "2", "--batch-size", "8", "--micro-batch-size", "2", "--bucket-mb", "0.1",
         "--print-timeline"]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_buckets_overlap_the_backward_and_no_overlap_waits_for_it(overlap, corpus, tmp_path):
    result = run_train(corpus, tmp_path, *FLAGS, *([] if overlap else ["--no-overlap"]), nproc=2)
    assert "step 2: timeline of one step" in result.stdout and "rank 1   compute" in result.stdout
    record = json.loads((tmp_path / "timeline.json").read_text())
    assert record["step"] == 2 and len(record["ranks"]) == 2
    for rank in record["ranks"]:
        names = [name for name, _, _ in rank["spans"]]
        assert names == ["F", "B"] * 2 + ["O"]  # 2 micro-batches of 2 per rank, then the optimizer
        backward_end = max(end for name, _, end in rank["spans"] if name == "B")
        grads = [c for c in rank["comms"] if c[0] == "all_reduce" and c[1] == "dp" and c[3] > 4]  # not the loss
        assert len(grads) > 2  # several buckets
        early = [c for c in grads if c[4] < backward_end]  # launched before the backward ended
        assert (len(early) > 0) == overlap, (len(early), len(grads))
        assert all(c[4] <= c[5] for c in rank["comms"])  # launched before done
        optimizer_start = next(start for name, start, _ in rank["spans"] if name == "O")
        assert all(c[5] <= optimizer_start for c in grads)  # every gradient is in before the update



@pytest.mark.parametrize("zero", ["1", "2"])
def test_hybrid_zero_all_reduces_across_groups_inside_the_backward(zero, corpus, tmp_path):
    """Hybrid ZeRO (shard groups of 2, two "nodes"): each bucket's all-reduce across the groups (zr), the
    traffic that leaves the node, is launched as soon as its reduce-scatter in the group has landed, while
    the backward still runs, not all of them after it; every one is in before the update."""
    run_train(corpus, tmp_path, *FLAGS, "--zero", zero, "--zero-shard", "2", "--gpus-per-node", "2", nproc=4)
    record = json.loads((tmp_path / "timeline.json").read_text())
    for rank in record["ranks"]:
        backward_end = max(end for name, _, end in rank["spans"] if name == "B")
        replicas = [c for c in rank["comms"] if c[0] == "all_reduce" and c[1] == "zr"]
        assert len(replicas) > 2  # one per bucket, once a step
        early = [c for c in replicas if c[4] < backward_end]
        assert len(early) > 0, (len(early), len(replicas))
        optimizer_start = next(start for name, start, _ in rank["spans"] if name == "O")
        assert all(c[5] <= optimizer_start for c in replicas)

def test_waiting_for_a_peer_is_told_apart_from_the_transfer():
    # rank 0 launches an all-reduce at 1.0, rank 1 only at 3.0; both see it done at 4.0
    comm = lambda launch, done: ["all_reduce", "dp", [0, 1], 16, launch, done]
    ranks = [{"spans": [("B", 0.0, 1.0)], "comms": [comm(1.0, 4.0), comm(5.0, 6.0)]},
             {"spans": [("B", 0.0, 3.0)], "comms": [comm(3.0, 4.0), comm(5.5, 6.0)]}]
    (a, b), (c, d) = timeline.split_waiting(ranks)
    assert (a["wait"], a["transfer"]) == (2.0, 1.0) and (c["wait"], c["transfer"]) == (0.0, 1.0)
    assert (b["wait"], b["transfer"]) == (0.5, 0.5) and (d["wait"], d["transfer"]) == (0.0, 0.5)
    assert timeline.overlapped([(2.5, 4.0), (2.0, 3.5)], [(0.0, 3.0)]) == 1.0  # [2, 3) of [2, 4)
    assert timeline.length([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == 4.0
    picture = timeline.draw(ranks, width=60)
    row0 = picture.splitlines()[2]  # rank 0's dp lane: waits ('.') from 1.0 to 3.0, then transfers ('=')
    assert row0.index(".") < row0.index("=") and "." not in row0[row0.index("="):row0.index("=") + 5]


def test_a_blocking_collective_inside_a_span_is_not_computing():
    # a tensor-parallel all-reduce: called inside the forward span, the caller waits in it
    ranks = [{"spans": [("F", 0.0, 4.0)], "comms": [["all_reduce", "tp", [0, 1], 16, 1.0, 2.0, True]]},
             {"spans": [("F", 0.0, 4.0)], "comms": [["all_reduce", "tp", [0, 1], 16, 1.0, 2.0, True]]}]
    rows = timeline.split_waiting(ranks)[0]
    assert timeline.computing(ranks[0]["spans"], rows) == [(0.0, 1.0), (2.0, 4.0)]
    assert timeline.summary(ranks, timeline.split_waiting(ranks))[1].split()[-1] == "0%"  # none of it hidden
    compute_row = timeline.draw(ranks, width=40).splitlines()[1]
    assert ":" in compute_row and compute_row.index("F") < compute_row.index(":") < compute_row.rindex("F")


def test_cuda_events_are_read_only_after_the_device_has_passed_them(monkeypatch):
    """On a GPU the points are CUDA events, and reading one the device has not reached raises (ZeRO's
    all-gathers are still queued when the step's host code returns). A stand-in for torch.cuda whose
    events refuse to be read before a synchronize: the recorder must synchronize first."""
    synced = []

    class Event:
        def __init__(self, enable_timing: bool):
            self.t = None

        def record(self):
            self.t, synced[:] = len(synced) + 1.0, []  # recorded: not passed until the next synchronize

        def elapsed_time(self, end) -> float:
            if not synced:
                raise RuntimeError("CUDA error: device not ready")
            return (end.t - self.t) * 1e3

    monkeypatch.setattr(timeline.torch.cuda, "Event", Event)
    monkeypatch.setattr(timeline.torch.cuda, "synchronize", lambda: synced.append(True))
    recorder = timeline.Recorder(timeline.torch.device("cpu"))
    recorder.clock.cuda = True
    recorder.start(barrier=lambda: None)
    with recorder.span("O"):
        recorder.track(recorder.launch("all_gather", "dp", (0, 1), 64), None)
    assert recorder.seconds() == {"all_gather dp": 0.0}  # launch and completion of a blocking call
    record = recorder.stop()
    assert [name for name, _, _ in record["spans"]] == ["O"] and len(record["comms"]) == 1


def test_on_a_gpu_a_collective_completes_on_the_communication_side(monkeypatch):
    """On a GPU, completion is an event recorded through the collective's future, on a stream NCCL makes
    wait for the collective's own end: not where the compute stream is let past it (`wait()`), which for a
    bucket launched mid-backward is the end of the backward. Stand-ins for torch.cuda's events and for the
    work: each event notes the stream that was current when it was recorded."""
    stream = ["compute"]

    class Event:
        def __init__(self, enable_timing: bool):
            self.stream = None

        def record(self):
            self.stream = stream[0]

    class Future:
        def then(self, callback):  # NCCL's future: done at once, its callback on a stream after the collective
            stream[0] = "after the collective"
            callback(self)
            stream[0] = "compute"

    class Work:
        def get_future(self):
            return Future()

        def wait(self):
            return True

    monkeypatch.setattr(timeline.torch.cuda, "Event", Event)
    recorder = timeline.Recorder(timeline.torch.device("cpu"))
    recorder.clock.cuda = True
    comm = recorder.launch("all_reduce", "dp", (0, 1), 64)
    work = recorder.track(comm, Work())
    work.wait()  # the end of the backward, long after
    assert comm.launch.stream == "compute" and comm.done.stream == "after the collective"
