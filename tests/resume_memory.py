"""What a rank allocates, maps and hashes while it resumes (not collected by pytest).

    torchrun --standalone --nproc-per-node 4 tests/resume_memory.py --zero 3 [train.py's flags]

Sets the run up (`train.setup`), then resumes it (`train.restore`) under the profiler, which records every
allocation and free of the run's device (`profile_memory`), with storage.py's file mapping and hashing
followed; prints one JSON line per rank: `step`, where it resumed; `peak`, the most bytes held at once
during the load beyond what was held before it; `state`, the bytes of this rank's optimizer state (fp32
masters and moments: 12 per parameter of its ZeRO shard); `mapped` and `hashed`, {file: bytes} of the
checkpoint files it mapped and the bytes it hashed of each; `sizes`, {file: bytes} of every file of the
checkpoint. tests/test_checkpoint.py holds a ZeRO-3 resume to a share of the checkpoint per rank.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from setup_memory import allocations, peak_apart_from  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import config  # noqa: E402
import train  # noqa: E402
from support import storage  # noqa: E402


def main() -> None:
    run = train.setup(config.parse_args(sys.argv[1:]))
    mapped, hashed = {}, {}
    map_file, verify_mapped = storage.map_file, storage.verify_mapped

    def mapping(path):
        mapped[Path(path).name] = Path(path).stat().st_size
        return map_file(path)

    def hashing(raw, want, path):
        hashed[Path(path).name] = hashed.get(Path(path).name, 0) + raw.size
        return verify_mapped(raw, want, path)

    storage.map_file, storage.verify_mapped = mapping, hashing
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        assert train.restore(run, announce=False), "no checkpoint to resume from"
    ckpt = Path(run.cfg.out) / "ckpt" / (Path(run.cfg.out) / "ckpt" / "latest").read_text()
    os.write(sys.stdout.fileno(), (json.dumps({
        "rank": run.grid.rank, "step": run.step, "peak": peak_apart_from(allocations(prof, "cpu"), set()),
        "state": run.opt.memory_bytes(), "mapped": mapped, "hashed": hashed,
        "sizes": {f.name: f.stat().st_size for f in ckpt.glob("*.safetensors")},
    }) + "\n").encode())


if __name__ == "__main__":
    main()
