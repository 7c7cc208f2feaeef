"""Compile the Hopper launchers' kernels for sm_90a without a GPU, and read their resource use.

The Gluon kernels (Hopper `warpgroup_mma`, TMA, warp specialisation) do not run under Triton's CPU
interpreter, so the CPU tests cannot execute them; they can still be compiled. `hopper_launches`
runs a launcher (`hopper.flash_fwd_hopper` / `hopper.flash_bwd_hopper`) on "meta" tensors with
`plans.launch` intercepted, which records each launch (kernel, arguments, options) instead of making
it; `compile_sm90` compiles one recorded launch with the installed Triton for an sm_90a target and
reads ptxas's report of the cubin: registers a thread, stack (local memory: spills and scratch
arrays), spill stores and loads, the kernel's shared memory, and from the SASS the local loads and
stores inside the loops that issue tensor-core products (`loop_local_accesses`) and how many of those
loops' exponentials come before their wait for every product (`exponentials_under_products`: whether a
softmax overlaps its warpgroup's products in the code ptxas scheduled, not only in the source) and
the barriers those loops execute a step (`loop_barriers`).

What it is for: a CPU test that every default Hopper path compiles with the Triton the project
admits (Triton 3.6 and 3.7 differ in Gluon's API) and fits the 227 KB of shared memory an sm_90 block
may use, and the optimisation log's offline evidence (register budgets, spills) before a GPU session:
`python -m cs336_systems.studies.attention.flash_offline` prints the table (run as a module on a host
without a GPU it restarts itself with TRITON_INTERPRET=0: the package sets the interpreter on import
when no GPU is visible, and interpreted kernels cannot be compiled). It shows that the kernels
compile with Triton 3.7 too; they have run on GPUs with 3.6 only. ptxas does not check that
setmaxnreg's budgets fit the register file: the configurations do (`hopper_configs.check_register_budget`).

Caveat: the signature gives integers their plain type (i32 or i64), with none of the JIT's
specialisations (divisibility by 16, the value 1), so the code ptxas sees can differ slightly from a
launch's; the resource numbers are the same kernel's, not necessarily the same bits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
import triton
from torch import Tensor
from triton.backends.compiler import GPUTarget

from cs336_systems.attention.flash_triton import hopper, hopper_configs, launch, plans
from cs336_systems.attention.flash_triton.tiles import interpreting
from cs336_systems.measure import cli

SM90 = GPUTarget("cuda", 90, 32)
SM90_SHARED_BYTES = 232_448  # the most dynamic shared memory one sm_90 block may use (227 KB)
_OPTIONS = ("num_warps", "num_stages", "maxnreg", "num_ctas")
_TYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int8: "i8",
}


@dataclasses.dataclass(frozen=True)
class Recorded:
    """One launch a launcher made: the kernel, its grid, positional and keyword arguments."""

    kernel: Any
    grid: tuple
    args: tuple
    kwargs: dict

    @property
    def name(self) -> str:
        return self.kernel.__name__


@dataclasses.dataclass(frozen=True)
class Resources:
    """ptxas's report of one compiled kernel (sm_90a)."""

    kernel: str
    registers: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int
    loop_local_accesses: int  # LDL/STL inside the loops that issue HGMMA (`loop_local_accesses`)
    # exponentials (MUFU.EX2) in those loops, and how many of them are issued before the loop's wait for
    # every product (`exponentials_under_products`): what the softmax overlaps with the tensor cores
    loop_exponentials: int
    exponentials_under_products: int
    loop_barriers: int  # BAR.SYNC in those loops (`loop_barriers`): warpgroup barriers a step


@contextlib.contextmanager
def _recording_launches() -> Iterator[list[Recorded]]:
    launches: list[Recorded] = []
    real = plans.launch
    plans.launch = lambda fn, grid, *args, **kwargs: launches.append(Recorded(fn, tuple(grid), args, kwargs))
    try:
        yield launches
    finally:
        plans.launch = real


def hopper_launches(kind: str, d: int, is_causal: bool, cfg=None, n: int = 1024) -> list[Recorded]:
    """The launches of the Hopper forward ("fwd") or backward ("bwd") for (1, 2, n, d) bf16 inputs with
    configuration `cfg` (the launcher's default for d if None), recorded on "meta" tensors."""
    if kind not in ("fwd", "bwd"):
        raise ValueError(f"kind must be 'fwd' or 'bwd', got {kind!r}")
    q, k, v, o, do = (torch.empty(1, 2, n, d, dtype=torch.bfloat16, device="meta") for _ in range(5))
    lse = torch.empty(1, 2, n, dtype=torch.float32, device="meta")
    with _recording_launches() as launches:
        if kind == "fwd":
            hopper.flash_fwd_hopper(q, k, v, o, lse, is_causal, cfg)
        else:
            tensors = launch._prepare(launch._bwd_operands(do, q, k, v, o, lse))  # no device check: meta
            hopper.flash_bwd_hopper(tensors, is_causal, cfg)
    return launches


def _arg_type(value: Any) -> Any:
    if hasattr(value, "block_shape") and hasattr(value, "layout"):  # Gluon's host TensorDescriptor
        if value.base.dtype not in _TYPES:
            raise TypeError(f"no Triton type known for {value.base.dtype}")
        return f"tensordesc<{_TYPES[value.base.dtype]}{list(value.block_shape)},{value.layout!r}>"
    if isinstance(value, Tensor):
        if value.dtype not in _TYPES:
            raise TypeError(f"no Triton type known for {value.dtype}")
        return "*" + _TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    if isinstance(value, tuple):
        return tuple(_arg_type(x) for x in value)
    raise TypeError(f"no Triton type known for {type(value).__name__}")


def source(rec: Recorded):
    """(the compiler's source object, compile options) of a recorded launch."""
    fn = rec.kernel
    values = dict(zip(fn.arg_names, rec.args))
    values |= {k: v for k, v in rec.kwargs.items() if k in fn.arg_names}
    options = {k: v for k, v in rec.kwargs.items() if k in _OPTIONS and v is not None}
    signature, constexprs = {}, {}
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        value = values.get(name, param.default)
        if param.is_constexpr or value is None:  # the JIT makes None arguments constants
            signature[name] = "constexpr"
            constexprs[(i,)] = value
        else:
            signature[name] = _arg_type(value)
    if type(fn).__module__.startswith("triton.experimental.gluon"):
        from triton.experimental.gluon._runtime import GluonASTSource

        return GluonASTSource(fn, signature, constexprs), options
    return triton.compiler.ASTSource(fn, signature, constexprs), options


def _tool(name: str) -> str:
    """A CUDA tool bundled with Triton (ptxas, cuobjdump)."""
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_sm90(rec: Recorded) -> Resources:
    """Compile one recorded launch for sm_90a and read ptxas's resource report."""
    src, options = source(rec)
    compiled = triton.compile(src, target=SM90, options=options)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        cubin = os.path.join(tmp, "kernel.cubin")
        report = subprocess.run(
            [_tool("ptxas"), "-arch=sm_90a", "-v", ptx, "-o", cubin],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
        sass = subprocess.run(
            [_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True
        ).stdout

    def number(pattern: str) -> int:
        match = re.search(pattern, report)
        return int(match.group(1)) if match else 0

    exps = exponentials_under_products(sass)
    return Resources(
        kernel=rec.name,
        registers=number(r"Used (\d+) registers"),
        stack_bytes=number(r"(\d+) bytes (?:cumulative )?stack"),
        spill_stores=number(r"(\d+) bytes spill stores"),
        spill_loads=number(r"(\d+) bytes spill loads"),
        shared_bytes=int(compiled.metadata.shared),
        loop_local_accesses=loop_local_accesses(sass),
        loop_exponentials=sum(n for n, _ in exps),
        exponentials_under_products=sum(k for _, k in exps),
        loop_barriers=loop_barriers(sass),
    )


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def _product_loops(code: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(first, last address) of the innermost loops that issue tensor-core products (HGMMA). A loop is
    the span of a predicated backward branch (an unpredicated one returns from out-of-line code, such
    as a barrier's retry, into the body)."""
    loops = []
    for address, ins in code:
        back = re.match(r"@!?P\d+\s+BRA\s+0x([0-9a-f]+)", ins)
        if back and int(back.group(1), 16) < address:
            loops.append((int(back.group(1), 16), address))
    products = [(a, b) for a, b in loops if any(a <= x <= b and "HGMMA" in ins for x, ins in code)]
    return [(a, b) for a, b in products if not any(a <= c < d <= b and (c, d) != (a, b) for c, d in products)]


def _count_in_product_loops(sass: str, opcode: str) -> int:
    """Instructions matching `opcode` (a regex of the opcode, predicated or not) inside the innermost
    product loops, summed over those loops: what a kernel pays every step, not once."""
    code = [(int(a, 16), ins) for a, ins in _SASS_LINE.findall(sass)]
    hits = [x for x, ins in code if re.match(rf"(@!?P\d+\s+)?{opcode}", ins)]
    return sum(a <= x <= b for a, b in _product_loops(code) for x in hits)


def loop_local_accesses(sass: str) -> int:
    """Local-memory loads and stores (LDL/STL: spills) inside the innermost loops that issue tensor-core
    products (HGMMA), per iteration summed over those loops."""
    return _count_in_product_loops(sass, r"(LDL|STL)\b")


def loop_barriers(sass: str) -> int:
    """Barrier instructions (BAR.SYNC, named or not) inside the innermost product loops, summed over those
    loops (Triton puts one before an elected mbarrier arrive and before a wait that may conflict with an
    earlier barrier access; OPTIMIZATION_LOG.md, session 21)."""
    return _count_in_product_loops(sass, r"BAR\.SYNC")


def exponentials_under_products(sass: str) -> list[tuple[int, int]]:
    """Per innermost product loop with exponentials: (its MUFU.EX2 count, how many come before its first
    wait for every outstanding product, `WARPGROUP.DEPBAR.LE gsb0, 0x0`). A softmax that overlaps its
    warpgroup's products has them all before that wait; ptxas moving the wait up leaves none
    ([Note: the wait for P V after the softmax] in hopper_ws_kernels.py)."""
    code = [(int(a, 16), ins) for a, ins in _SASS_LINE.findall(sass)]
    out = []
    for a, b in _product_loops(code):
        exps = [x for x, ins in code if a <= x <= b and re.match(r"(@!?P\d+\s+)?MUFU\.EX2\b", ins)]
        waits = [
            x for x, ins in code if a <= x <= b and re.search(r"WARPGROUP\.DEPBAR\.LE\s+gsb0, 0x0\b", ins)
        ]
        if exps:
            out.append((len(exps), sum(x < min(waits, default=b + 1) for x in exps)))
    return out


def default_paths() -> list[tuple[str, int, Callable[[], Any]]]:
    """(kind, head dim, configuration factory) of the launchers' default Hopper paths."""
    dims = (64, 80, 128)
    return [("fwd", d, lambda d=d: hopper_configs.heuristic_fwd(d)) for d in dims] + [
        ("bwd", d, lambda d=d: hopper_configs.heuristic_bwd(d)) for d in dims
    ]


def resource_table(is_causal: bool = True) -> list[dict[str, Any]]:
    """Every Gluon kernel of the default Hopper paths compiled for sm_90a: one row each."""
    rows = []
    for kind, d, cfg in default_paths():
        config = cfg()
        for rec in hopper_launches(kind, d, is_causal, config):
            if not type(rec.kernel).__module__.startswith("triton.experimental.gluon"):
                continue  # the tl helpers (Delta, zeroing, casts) are the CPU interpreter's kernels
            res = compile_sm90(rec)
            rows.append({"kind": kind, "d": d, "config": type(config).__name__} | dataclasses.asdict(res))
    return rows


def main(argv: list[str] | None = None) -> None:
    p = cli.make_parser(__doc__, "python -m cs336_systems.studies.attention.flash_offline --json")
    p.add_argument("--non-causal", action="store_true", help="compile the non-causal kernels")
    p.add_argument("--json", action="store_true", help="print the rows as one JSON list")
    args = p.parse_args(argv)
    if interpreting():
        raise SystemExit(
            "the kernels were imported for Triton's interpreter, which cannot compile them: run with "
            "TRITON_INTERPRET=0 (cs336_systems sets it to 1 on import when no GPU is visible)"
        )
    rows = resource_table(is_causal=not args.non_causal)
    if args.json:
        print(json.dumps({"triton": triton.__version__, "rows": rows}))
        return
    print(f"Triton {triton.__version__}, sm_90a; shared memory limit {SM90_SHARED_BYTES} bytes")
    for row in rows:
        print(
            f"{row['kind']} d={row['d']:<4} {row['kernel']:<32} {row['registers']:>4} regs  "
            f"stack {row['stack_bytes']:>4} B  spills {row['spill_stores']}/{row['spill_loads']} B  "
            f"shared {row['shared_bytes']:>6} B  LDL/STL in product loops {row['loop_local_accesses']}  "
            f"exponentials under products {row['exponentials_under_products']}/{row['loop_exponentials']}  "
            f"barriers in product loops {row['loop_barriers']}"
        )


if __name__ == "__main__":
    if interpreting() and os.environ.get("TRITON_INTERPRET") != "0":  # set by cs336_systems on a CPU host
        os.execve(
            sys.executable,
            [sys.executable, "-m", "cs336_systems.studies.attention.flash_offline", *sys.argv[1:]],
            {**os.environ, "TRITON_INTERPRET": "0"},
        )
    main()
