"""Compile every shipped launch configuration for real GPUs, on a machine without one.

Triton can compile for a target it is not running on: triton.compile(ASTSource(...), target=
GPUTarget("cuda", 80 or 90, 32)) runs the whole pipeline (Triton IR -> LLVM -> PTX -> ptxas -> cubin).
For each kernel x head_dim x {fp16, bf16} x {sm_80 (A100), sm_90 (H100)}, and in bf16 the unmasked mode
(causal=False) that ring attention uses off the diagonal and the grouped-query builds, we check that

  * it compiles, with the launch configuration kernels.py will use on that GPU;
  * the PTX uses tensor cores: `mma.sync` on sm_80, `wgmma` (warpgroup MMA) on sm_90;
  * its shared memory fits the target's per-block limit;
  * ptxas, given the PTX with `-v`, reports 0 bytes of spill stores (no registers spilled to memory);
  * the PTX has no atomic instructions: each output has one writer, so results are deterministic.

Two builds of each kernel reach a GPU, because Triton compiles an integer argument equal to 1 as a
constant: GROUP_SIZE = 1 (multi-head attention: the kv-head arithmetic and the dK/dV program's loop over
its group fold away) and GROUP_SIZE a run-time value (any grouped-query or multi-query attention).

The fp8 cast (fp8_cast.py) is compiled the same way for the GPUs that multiply fp8, sm_89 (Ada) and
sm_90 (Hopper), in each form fp8.py launches it: no spills, and its only atomics the three integer
ones that add a program's statistics (exact in any order, so deterministic too).

This must run without TRITON_INTERPRET (under the interpreter there is nothing to compile), so the
test runs this file as a script in a clean subprocess. Run it yourself to see the resource table:

    python tests/test_kernels_aot.py                          # all of them (1-2 min on 2 cores)
    python tests/test_kernels_aot.py --head-dim 64 --dtype bf16  # one configuration
    python tests/test_kernels_aot.py --cast                   # the fp8 cast
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {  # compute capability -> (ptxas architecture, shared memory per block, tensor-core instruction)
    80: ("sm_80", 166_912, "mma.sync"),
    90: ("sm_90a", 232_448, "wgmma"),
}
POINTERS = {"Q", "K", "V", "O", "DO", "DQ", "DK", "DV", "LSE", "DELTA"}


class Job(NamedTuple):
    """One kernel build: what flash_forward or flash_backward launches."""
    kernel: str
    D: int
    dtype: str
    cap: int
    block_m: int
    block_n: int | None
    warps: int
    stages: int
    causal: bool = True
    gqa: bool = False  # GROUP_SIZE a run-time value (grouped-query attention); else the constant 1


def jobs(head_dims=None, dtypes=None) -> list[Job]:
    """Every build flash_forward and flash_backward launch for each shipped configuration (or those of the
    given head dims / dtypes)."""
    import torch

    import kernels

    names = {torch.float16: "fp16", torch.bfloat16: "bf16"}
    out = []
    for (D, dtype), c in kernels.SHIPPED.items():
        if (head_dims and D not in head_dims) or (dtypes and names[dtype] not in dtypes):
            continue
        for cap in TARGETS:
            fwd = Job("_attn_fwd", D, names[dtype], cap, c.block_m, c.block_n, c.fwd_warps, c.fwd_stages)
            dkdv = Job("_attn_bwd_dkdv", D, names[dtype], cap, c.small, c.big, c.bwd_warps, c.bwd_stages)
            dq = Job("_attn_bwd_dq", D, names[dtype], cap, c.big, c.small, c.bwd_warps, c.bwd_stages)
            out += [fwd, Job("_attn_bwd_delta", D, names[dtype], cap, c.big, None, 4, 3), dkdv, dq]
            if dtype == torch.bfloat16:  # fp16 is the same code: ring attention's unmasked blocks, and GQA
                out += [job._replace(causal=False) for job in (fwd, dkdv, dq)]
                out += [job._replace(gqa=True, causal=causal) for causal in (True, False) for job in (fwd, dkdv, dq)]
    return out


def compile_one(job: tuple) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import kernels

    name, D, dtype, cap, block_m, block_n, warps, stages, causal, gqa = Job(*job)
    fn = getattr(kernels, name)
    # The signature a real launch would get: 16-byte aligned pointers and strides divisible by 16 (true
    # for every (B, H, T, D) layout with D >= 16); H and T arbitrary.
    signature, attrs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        if arg in POINTERS:
            signature[arg] = "*fp32" if arg in ("LSE", "DELTA") else f"*{dtype}"
        elif arg == "sm_scale":
            signature[arg] = "fp32"
        elif arg in ("HEAD_DIM", "BLOCK_M", "BLOCK_N", "CAUSAL") or arg == "GROUP_SIZE" and not gqa:
            signature[arg] = "constexpr"
        else:
            signature[arg] = "i32"
        if arg in POINTERS or arg[0] == "s" and arg != "sm_scale":
            attrs[(i,)] = [["tt.divisibility", 16]]
    constexprs = {"HEAD_DIM": D, "BLOCK_M": block_m}
    if block_n is not None:
        constexprs["BLOCK_N"] = block_n
    if "CAUSAL" in fn.arg_names:
        constexprs["CAUSAL"] = causal
    if "GROUP_SIZE" in fn.arg_names and not gqa:
        constexprs["GROUP_SIZE"] = 1  # as a multi-head launch gets it: Triton specializes integers equal to 1
    target = GPUTarget("cuda", cap, 32)
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                              options={"num_warps": warps, "num_stages": stages})
    ptx = compiled.asm["ptx"]
    arch, smem_limit, mma = TARGETS[cap]
    log = ptxas(ptx, arch)
    modes = ", ".join(mode for mode, on in (("gqa", gqa), ("full", not causal)) if on)
    label = f"{name} ({modes})" if modes else name
    return dict(kernel=label, D=D, dtype=dtype, target=arch, blocks=f"{block_m}x{block_n or '-'}",
                warps=warps, stages=stages,
                registers=int(re.search(r"Used (\d+) registers", log).group(1)),
                spill_stores=int(re.search(r"(\d+) bytes spill stores", log).group(1)),
                spill_loads=int(re.search(r"(\d+) bytes spill loads", log).group(1)),
                shared=compiled.metadata.shared, shared_limit=smem_limit,
                tensor_cores=mma if mma in ptx else "none", atomics=len(re.findall(r"\b(?:atom|red)\.", ptx)))


def ptxas(ptx: str, arch: str) -> str:
    """ptxas -v's report (registers, spills) of assembling the PTX for `arch`."""
    import triton

    exe = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.ptx").write_text(ptx)
        return subprocess.run([str(exe), "-v", f"-arch={arch}", "k.ptx", "-o", "k.cubin"], cwd=tmp,
                              capture_output=True, text=True, check=True).stderr


CAST_TARGETS = {89: ("sm_89", 101_376), 90: ("sm_90a", 232_448)}  # the GPUs that multiply fp8


def cast_jobs() -> list[tuple]:
    """fp8_cast's builds, as fp8.py launches them, from fp32 and bf16 inputs: the cast-transpose of x,
    dY (e5m2) and a kept weight, a weight's codes alone and its transposed codes alone (ZeRO-3)."""
    forms = (("e4m3", True, True), ("e5m2", True, True), ("e4m3", True, False), ("e4m3", False, True))
    return [(cap, dtype, *form) for cap in CAST_TARGETS for dtype in ("fp32", "bf16") for form in forms]


def compile_cast(job: tuple) -> dict:
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import fp8_cast

    cap, dtype, fmt, rows, cols = job
    fn = fp8_cast._cast_transpose
    types = {"X": "*i16" if dtype == "bf16" else "*fp32", "Q": "*u8", "QT": "*u8", "SCALE": "*fp32",
             "STATS": "*i64", "M": "i32", "N": "i32", "sxm": "i32", "sxn": "i32"}  # bf16: read as its bits
    signature = {arg: types.get(arg, "constexpr") for arg in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(fn.arg_names) if types.get(arg, "")[:1] == "*"}
    block, tiles = fp8_cast.GPU_LAUNCH
    constexprs = dict(fp8_cast.constants({"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]),
                      BF16_BITS=dtype == "bf16", ROWS=rows, COLS=cols, BLOCK=block, TILES=tiles)
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", cap, 32),
                              options={"num_warps": 4})
    ptx, (arch, smem_limit) = compiled.asm["ptx"], CAST_TARGETS[cap]
    log = ptxas(ptx, arch)
    return dict(kernel=f"_cast_transpose ({fmt}{', rows' * rows}{', cols' * cols})", dtype=dtype, target=arch,
                registers=int(re.search(r"Used (\d+) registers", log).group(1)),
                spill_stores=int(re.search(r"(\d+) bytes spill stores", log).group(1)),
                spill_loads=int(re.search(r"(\d+) bytes spill loads", log).group(1)),
                shared=compiled.metadata.shared, shared_limit=smem_limit,
                atomics=re.findall(r"\b(?:atom|red)\.[\w.]+", ptx))


def compile_all(head_dims=None, dtypes=None) -> list[dict]:
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return list(pool.map(compile_one, jobs(head_dims, dtypes)))


def table(rows: list[dict]) -> str:
    head = (f"{'kernel':<26} {'D':>3} {'dtype':<5} {'target':<6} {'blocks':>7} {'warps':>5} {'stages':>6} "
            f"{'regs':>4} {'smem (limit)':>16} {'spill st/ld':>11} {'tensor cores':>12}")
    lines = [head, "-" * len(head)]
    for r in rows:
        smem = f"{r['shared']} ({r['shared_limit'] // 1024}K)"
        lines.append(f"{r['kernel']:<26} {r['D']:>3} {r['dtype']:<5} {r['target']:<6} {r['blocks']:>7} "
                     f"{r['warps']:>5} {r['stages']:>6} {r['registers']:>4} {smem:>16} "
                     f"{r['spill_stores']:>5}/{r['spill_loads']:<5} {r['tensor_cores']:>12}")
    return "\n".join(lines)


def run_in_clean_process(*flags: str) -> list[dict]:
    """This file as a script, with the interpreter switched off. (Triton's compile cache may answer: its
    key is the kernel's source, constants, options, target and Triton version, so a hit is the same build.)"""
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        out = Path(tmp) / "rows.json"
        subprocess.run([sys.executable, __file__, *flags, "--json", str(out)], env=env, check=True, timeout=600)
        return json.loads(out.read_text())


def test_the_fp8_cast_compiles_for_sm89_and_sm90_without_spilling():
    """Every form of fp8_cast's kernel fp8.py launches: no spills, within shared memory, and atomics only
    where a program adds its statistics: one integer max and two integer adds (no float atomics, whose
    order would change the bits)."""
    rows = run_in_clean_process("--cast")
    print("\n" + cast_table(rows))
    assert len(rows) == len(cast_jobs()) and {r["target"] for r in rows} == {"sm_89", "sm_90a"}
    for r in rows:
        where = f"{r['kernel']} {r['dtype']} {r['target']}"
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, f"{where} spills registers"
        assert r["shared"] <= r["shared_limit"], f"{where} needs {r['shared']} B of shared memory"
        kinds = sorted(re.sub(r"\.(global|gpu|relaxed|acq_rel|sys)", "", a) for a in r["atomics"])
        assert kinds == ["atom.add.u64", "atom.add.u64", "atom.max.s64"], f"{where}: {r['atomics']}"


def cast_table(rows: list[dict]) -> str:
    lines = [f"{'kernel':<34} {'dtype':<5} {'target':<6} {'regs':>4} {'smem':>6} {'spill st/ld':>11}"]
    lines += [f"{r['kernel']:<34} {r['dtype']:<5} {r['target']:<6} {r['registers']:>4} {r['shared']:>6} "
              f"{r['spill_stores']:>5}/{r['spill_loads']:<5}" for r in rows]
    return "\n".join(lines)


def test_every_shipped_config_compiles_for_sm80_and_sm90():
    rows = run_in_clean_process()
    print("\n" + table(rows))
    assert len(rows) == len(jobs()) and {r["target"] for r in rows} == {"sm_80", "sm_90a"}
    assert {r["dtype"] for r in rows} == {"fp16", "bf16"}
    built = {r["kernel"] for r in rows}
    assert {f"{k} (gqa)" for k in ("_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq")} <= built, built
    for r in rows:
        where = f"{r['kernel']} D={r['D']} {r['dtype']} {r['target']}"
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, f"{where} spills registers"
        assert r["shared"] <= r["shared_limit"], f"{where} needs {r['shared']} B of shared memory"
        assert r["atomics"] == 0, f"{where} uses atomics"
        if r["kernel"] != "_attn_bwd_delta":  # delta is a row sum, no matrix product
            mma = TARGETS[80 if r["target"] == "sm_80" else 90][2]
            assert r["tensor_cores"] == mma, f"{where} does not use {mma}"


def main():
    parser = argparse.ArgumentParser(description="compile the shipped attention kernels for sm_80 and sm_90")
    parser.add_argument("--head-dim", type=int, action="append", help="only this head dim (repeatable)")
    parser.add_argument("--dtype", choices=("fp16", "bf16"), action="append", help="only this dtype")
    parser.add_argument("--cast", action="store_true", help="the fp8 cast (fp8_cast.py) instead")
    parser.add_argument("--json", help="write the rows to this file instead of printing the table")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET"):  # e.g. started from a test: compiling needs the real Triton
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        return subprocess.run([sys.executable, __file__, *sys.argv[1:]], env=env).returncode
    sys.path.insert(0, str(ROOT))
    if args.cast:
        with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            rows = list(pool.map(compile_cast, cast_jobs()))
        print(cast_table(rows)) if not args.json else Path(args.json).write_text(json.dumps(rows))
        return 1 if any(r["spill_stores"] for r in rows) else 0
    rows = compile_all(args.head_dim, args.dtype)
    if args.json:
        Path(args.json).write_text(json.dumps(rows))
    else:
        print(table(rows))
        bad = [r for r in rows if r["spill_stores"] or r["shared"] > r["shared_limit"]]
        print(f"{len(rows)} kernels compiled, {len(bad)} spill registers or overflow shared memory")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())


def test_the_tuner_prunes_configurations_that_spill():
    """tests/tune_attention.py keeps only candidates that compile cleanly: at head dim 64 on sm_90 the
    backward with 8 warps does, with 4 warps ptxas spills (it would need more than 255 registers)."""
    code = ("import sys; sys.path[:0] = [{root!r}, {tests!r}]; import tune_attention as t; "
            "print(t.prune('bwd', [(32, 128, 8, 3), (32, 128, 4, 3)], 64, 'bf16', 90))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code.format(root=str(ROOT), tests=str(ROOT / "tests"))], env=env,
                         capture_output=True, text=True, timeout=600, check=True).stdout
    assert out.strip() == "[(32, 128, 8, 3)]", out
