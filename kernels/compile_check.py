"""Compile every kernel for real GPUs on a machine without one, and say what each costs in registers.

Triton's interpreter runs the kernels' arithmetic on CPU, but not the compiler:
a kernel can pass every interpreted test and still fail to compile, or
compile into a program that spills registers to local memory and runs at a
fraction of HBM bandwidth.  This check closes that gap without a GPU:

1. It runs each op's launcher on ``meta`` tensors (no data, no arithmetic) at
   the shapes of Llama 3 8B, 70B and 405B inside ``_dispatch.recording``, which
   lists the launches -- kernel, arguments, constants, warps -- the op would
   make on a GPU of that many SMs.
2. It compiles each distinct launch ahead of time with ``triton.compile`` for
   each target architecture (sm_80 A100, sm_90 H100/H200, sm_100 B200),
   specializing arguments as Triton's JIT does (16-byte aligned pointers, ints
   divisible by 16, ints equal to 1 as constants).
3. It reads the cubin's resource usage with ``cuobjdump -res-usage`` (bundled
   with Triton): registers per thread, stack and local bytes (spills),
   shared memory.

A launch passes when it compiles and spills nothing.  Run it on each Triton
version the kernels must support (3.6 to 3.9; ``make test`` runs it on the
pinned 3.6, where nothing spills -- 3.9 compiles everything too, and spills 16
to 88 bytes a thread in one launch, as docs/kernels.md says):

    python -m mfuscope.kernels.compile_check [--arch 80,90,100] [--models 8b,70b,405b] [--json out.json]

Exit status 0 when every launch passes, 1 when one fails or spills, 2 when
this machine cannot run the check (no Triton, or its CUDA tools missing).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Shape:
    """A model's widths, as its kernels see them."""

    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int = 128
    tokens: int = 8192  # one 8k sequence


#: Llama 3 (Meta's model cards): the benchmark's shapes.
SHAPES = {"8b": Shape(4096, 14336, 32, 8), "70b": Shape(8192, 28672, 64, 8), "405b": Shape(16384, 53248, 128, 8)}

#: Experts a token is routed to in the MoE permute's launches (DeepSeek-V3's 8; Mixtral's 2 unrolls less).
TOP_K = 8

#: Compute capability -> (GPU it stands for, its streaming multiprocessors).
ARCHES = {80: ("A100", 108), 90: ("H100/H200", 132), 100: ("B200", 148)}

_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
          torch.int32: "i32", torch.bool: "i1"}


@dataclass
class Result:
    kernel: str
    models: str
    arch: int
    num_warps: int
    constexprs: dict[str, Any]
    ok: bool
    registers: int | None = None
    spill_bytes: int | None = None   # stack frame + local memory a thread uses: spilled registers
    shared_bytes: int | None = None
    compile_s: float | None = None
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.ok and not self.spill_bytes


def record(shape: Shape, multiprocessors: int):
    """The launches the ops make at ``shape`` on a GPU of ``multiprocessors`` SMs (bf16 activations)."""
    from ._dispatch import recording
    from .moe_routing import permute, unpermute, unpermute_backward
    from .rms_norm import norm_backward, norm_forward
    from .rope import rotate
    from .swiglu import backward as swiglu_backward
    from .swiglu import forward as swiglu_forward

    meta = {"device": "meta"}
    bf16, f32 = torch.bfloat16, torch.float32
    t, h = shape.tokens, shape.hidden
    with recording(multiprocessors) as launches:
        x, w = torch.empty(t, h, dtype=bf16, **meta), torch.empty(h, dtype=bf16, **meta)
        rstd = torch.empty(t, dtype=f32, **meta)
        norm_forward(x, None, w, 1e-6, bf16, bf16)
        norm_backward(x, None, x, w, rstd)
        norm_forward(x, x, w, 1e-6, bf16, bf16)     # add_rms_norm
        norm_backward(x, x, x, w, rstd)
        g = torch.empty(t, shape.ffn, dtype=bf16, **meta)
        swiglu_forward(g, g)
        swiglu_backward(g, g, g)
        cos = torch.empty(t, shape.head_dim // 2, dtype=f32, **meta)
        for heads in (shape.heads, shape.kv_heads):
            q = torch.empty(1, heads, t, shape.head_dim, dtype=bf16, **meta)
            for interleaved in (False, True):
                rotate(q, cos, cos, interleaved, 1.0)
        positions = torch.empty(t, TOP_K, dtype=torch.int64, **meta)  # MoE routing, top-8 at the model's width
        rows, weight = torch.empty(t * TOP_K, h, dtype=bf16, **meta), torch.empty(t, TOP_K, dtype=bf16, **meta)
        permute(x, positions)
        unpermute(rows, positions, weight)
        unpermute_backward(x, rows, positions, weight)
    return launches


def _signature(launch) -> tuple[dict[str, str], dict[str, Any], dict[tuple[int], list]]:
    """(signature, constexprs, attrs) for ``triton.compile``, specialized as the JIT would."""
    signature, constexprs, attrs = {}, {}, {}
    args = iter(launch.args)
    for i, param in enumerate(launch.kernel.params):
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", launch.constexprs[param.name]
            continue
        value = next(args)
        if isinstance(value, torch.Tensor):
            signature[param.name] = "*" + _TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch's allocations are 16-byte aligned
        elif isinstance(value, int) and not isinstance(value, bool):
            if value == 1:  # the JIT compiles an argument equal to 1 as that constant
                signature[param.name], constexprs[param.name] = "constexpr", 1
            else:
                signature[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
                if value % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            raise TypeError(f"{launch.kernel.__name__}: argument {param.name} of type {type(value).__name__}")
    return signature, constexprs, attrs


def _cuda_tool(name: str) -> Path:
    import triton
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: this Triton build has no CUDA tools to compile with")
    return path


def _resources(cubin: bytes) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([str(_cuda_tool("cuobjdump")), "-res-usage", str(path)], capture_output=True,
                             text=True, check=True).stdout
    fields = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out))
    if "REG" not in fields:
        raise RuntimeError(f"cuobjdump printed no resource usage: {out.strip()[:200]}")
    return {k: int(v) for k, v in fields.items()}


def compile_launch(launch, arch: int, models: str, num_warps: int | None = None) -> Result:
    """Compile ``launch`` for compute capability ``arch``; ``num_warps`` overrides the op's choice."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    warps = num_warps or launch.num_warps
    signature, constexprs, attrs = _signature(launch)
    name = launch.kernel.__name__
    shown = {k: v for k, v in constexprs.items() if k.isupper()}
    start = time.perf_counter()
    try:
        compiled = triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs),
                                  target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
        use = _resources(compiled.asm["cubin"])
    except Exception as e:  # a compile error is this check's finding, not a crash
        return Result(name, models, arch, warps, shown, False, error=f"{type(e).__name__}: {str(e).strip()[:300]}")
    return Result(name, models, arch, warps, shown, True, registers=use["REG"],
                  spill_bytes=use.get("STACK", 0) + use.get("LOCAL", 0), shared_bytes=use.get("SHARED", 0),
                  compile_s=time.perf_counter() - start)


def check(models: list[str], arches: list[int], progress=None) -> list[Result]:
    """Every distinct launch of ``models`` compiled for each of ``arches``."""
    results = []
    for arch in arches:
        distinct: dict[tuple, tuple[Any, list[str]]] = {}
        for model in models:
            for launch in record(SHAPES[model], ARCHES[arch][1]):
                signature, constexprs, attrs = _signature(launch)
                key = (launch.kernel.__name__, tuple(signature.items()), tuple(sorted(constexprs.items())),
                       tuple(sorted(attrs)), launch.num_warps)
                distinct.setdefault(key, (launch, []))[1].append(model)
        for i, (launch, used_by) in enumerate(distinct.values()):
            if progress:
                progress(f"sm_{arch}: {i + 1}/{len(distinct)} {launch.kernel.__name__}")
            results.append(compile_launch(launch, arch, ",".join(dict.fromkeys(used_by))))
    return results


def table(results: list[Result]) -> str:
    head = (f"{'kernel':28s} {'arch':>6s} {'models':14s} {'warps':>5s} {'regs':>5s} {'spill B':>7s} {'smem B':>7s}"
            "  constants")
    lines = [head, "-" * len(head)]
    for r in results:
        consts = " ".join(f"{k}={v}" for k, v in r.constexprs.items())
        if r.ok:
            lines.append(f"{r.kernel:28s} {'sm_' + str(r.arch):>6s} {r.models:14s} {r.num_warps:5d} {r.registers:5d} "
                         f"{r.spill_bytes:7d} {r.shared_bytes:7d}  {consts}" + ("  SPILLS" if r.spill_bytes else ""))
        else:
            lines.append(f"{r.kernel:28s} {'sm_' + str(r.arch):>6s} {r.models:14s} {r.num_warps:5d}  FAILED: {r.error}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mfuscope.kernels.compile_check", description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="80,90,100", help="compute capabilities, comma-separated (default 80,90,100)")
    ap.add_argument("--models", default=",".join(SHAPES), help=f"shapes from {', '.join(SHAPES)} (default all)")
    ap.add_argument("--json", type=Path, help="also write the results here as JSON")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("compile_check: unset TRITON_INTERPRET: the interpreter replaces the compiler", file=sys.stderr)
        return 2
    try:
        import triton
        arches = [int(a) for a in args.arch.split(",")]
        models = args.models.split(",")
        unknown = [a for a in arches if a not in ARCHES] + [m for m in models if m not in SHAPES]
        if unknown:
            raise ValueError(f"unknown --arch/--models {', '.join(map(str, unknown))}: "
                             f"arches {', '.join(map(str, ARCHES))}, models {', '.join(SHAPES)}")
        _cuda_tool("cuobjdump")
    except (ImportError, ValueError, FileNotFoundError) as e:
        print(f"compile_check: {e}", file=sys.stderr)
        return 2
    print(f"triton {triton.__version__}, torch {torch.__version__}", file=sys.stderr)
    results = check(models, arches, progress=lambda msg: print(f"  compiling {msg}", file=sys.stderr, flush=True))
    print(table(results))
    bad = [r for r in results if not r.passed]
    print(f"\n{len(results) - len(bad)} of {len(results)} launches compile without spilling"
          + (f"; {len(bad)} do not" if bad else ""))
    if args.json:
        from mfuscope.atomic import write_json
        write_json(args.json, {"triton": triton.__version__, "results": [asdict(r) for r in results]})
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
