"""PyTorch's parallel wrappers as oracles: our data-parallel buckets against DistributedDataParallel, our
tensor- and sequence-parallel layers against DTensor's parallelize_module, our vocab-parallel loss against
loss_parallel, our ZeRO-3 step against FSDP2's fully_shard, our 1F1B pipeline against
torch.distributed.pipelining (tests/oracles.py runs them all, in one torchrun launch of 2 gloo ranks;
lessons/20-pytorch-apis.md shows its output).

The product uses none of them (DESIGN.md, principle 5); here they are a second, independent implementation
of the same math. Each difference is relative to the largest element of the tensor compared (fp32 rounding
is relative), and TOLERANCE is 8 units in fp32's last place (eps = 1.2e-7): two programs that add the same
numbers in another order (DTensor's bias gradient, the pipeline's loss over chunks of rows against one
cross_entropy of the logits) differ by one or two. Each check also runs with a plausible bug put into ours
(no division by the world size, the wrong slice, f without its all-reduce, ...), which must move it by
more than BROKEN (10^4 x the tolerance; the smallest, a softmax shifted by each rank's own max, moves the
loss by ~5%): the comparison is shown able to fail, in the same run.
"""

import os
import re
import subprocess
import sys

from conftest import ROOT

TOLERANCE, BROKEN = 1e-6, 1e-2
CHECKS = {  # the line's name -> its oracle
    "data parallel gradients": "ddp",
    "tensor parallel MLP output": "dtensor",
    "tensor parallel MLP gradients": "dtensor",
    "sequence parallel MLP output": "dtensor",
    "sequence parallel MLP gradients": "dtensor",
    "vocab-parallel loss and gradients": "loss_parallel",
    "ZeRO-3 weights after 2 AdamW steps": "fsdp2",
    "pipeline 1F1B gradients": "pipelining",
}
LINE = re.compile(r"^(.+): max \|ours - (\w+)\| = (\S+); broken \((.+)\): (\S+)$", re.M)


def test_each_piece_equals_its_oracle_and_a_bug_does_not():
    """One launch for every check (one test: under xdist two would launch twice)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "tests" / "oracles.py")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    out = result.stdout
    found = {m[1]: (m[2], float(m[3]), m[4], float(m[5])) for m in LINE.finditer(out)}
    assert found.keys() == CHECKS.keys(), out
    for name, (oracle, diff, bug, broken) in found.items():
        assert oracle == CHECKS[name], name
        assert diff <= TOLERANCE, f"{name}: ours and {oracle} differ by {diff:.1e} (relative)"
        assert broken >= BROKEN, f"{name}: the bug '{bug}' moved it by only {broken:.1e}: the check cannot fail"
    # torch's default AdamW (foreach) rounds otherwise than the fused kernel ZeroAdamW runs: near-zero
    # elements, which Adam divides by ~sqrt(v), land apart; still far below what the bug does
    foreach = float(re.search(r"foreach, not fused: max \|ours - fsdp2\| = (\S+)\)", out)[1])
    assert foreach < 1e-2
    # torch's context_parallel replaces the CUDA attention kernels only: on CPU it has no strategy for the
    # CPU's attention operator. When that changes, compare it with context.py's ring attention in oracles.py.
    line = re.search(r"^context parallel: torch's context_parallel on CPU/gloo: (.+)$", out, re.M)[1]
    assert "_scaled_dot_product_flash_attention_for_cpu" in line and "sharding strategy" in line, line
