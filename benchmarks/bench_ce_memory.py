"""Peak extra memory of the LM head + loss: eager ``F.linear`` + ``F.cross_entropy`` against
``fused_linear_cross_entropy``, on CPU, at the issue's size by default (4,096 tokens, hidden
4,096, vocabulary 128,256, float32).

Three ways: ``eager``; ``fused``, the op on CPU tensors as a user gets it (its CPU path,
chunks of tokens); ``sliced``, the op's GPU path (slices of the vocabulary, ``--slice-mib`` of
logits at a time) run on the CPU.

Each way runs in a fresh process that allocates the inputs, warms both paths up on a tiny
problem, resets the kernel's resident-memory peak (``/proc/self/clear_refs``), then runs
forward and backward.  Extra memory = peak resident memory (VmHWM) - resident memory before -
the gradients the call returns (hidden's and weight's, which any implementation must
produce).  glibc's allocator runs with a fixed mmap threshold of 128 KiB
(``MALLOC_MMAP_THRESHOLD_``, unless the environment sets it): every larger buffer is mapped on
its own and returned when freed.  By default glibc raises the threshold after the first large
free and keeps later freed buffers in its heap for reuse, which measures the allocator, not the
algorithm: a way that frees and remakes a slice buffer measured 4.7-6 MiB here and 22 MiB in a
loaded CI run; with the threshold fixed, 4.5-4.6 MiB.

    python benchmarks/bench_ce_memory.py [--tokens 4096 --hidden 4096 --vocab 128256]
        [--ways eager,fused,sliced] [--slice-mib 256] [--json out.json]

At the default size each way does about 13 TFLOP of matmuls: minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

_SCRIPT = r'''
import sys, torch, torch.nn.functional as F
from mfuscope.kernels import fused_linear_cross_entropy
from mfuscope.kernels import linear_cross_entropy as module
def kib(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key + ":"))
how, n, h, v, slice_bytes = sys.argv[1], *map(int, sys.argv[2:6])
module._takes_gpu_path = lambda hidden: how == "sliced"
module.GRAD_SLICE_BYTES = slice_bytes
torch.manual_seed(0)
hidden = torch.randn(n, h, requires_grad=True)
weight = (0.02 * torch.randn(v, h)).requires_grad_()
target = torch.randint(0, v, (n,))
w0, h0 = torch.randn(16, h, requires_grad=True), torch.randn(8, h, requires_grad=True)  # warm both paths up
fused_linear_cross_entropy(h0, w0, torch.randint(0, 16, (8,))).backward()
F.cross_entropy(h0 @ w0.t(), torch.randint(0, 16, (8,))).backward()
del w0, h0
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from here
base = kib("VmRSS") * 1024
if how == "eager":
    loss = F.cross_entropy(hidden @ weight.t(), target)
else:
    loss = fused_linear_cross_entropy(hidden, weight, target)
loss.backward()
grads = hidden.grad.nbytes + weight.grad.nbytes
print(kib("VmHWM") * 1024 - base - grads, grads, float(loss))
'''


PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def measure(how: str, tokens: int, hidden: int, vocab: int, slice_bytes: int, timeout: float = 3600) -> dict:
    """``{"extra_bytes", "gradient_bytes", "loss"}`` of one way, from a fresh process."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))  # freed buffers leave resident memory
    done = subprocess.run([sys.executable, "-c", _SCRIPT, how, str(tokens), str(hidden), str(vocab), str(slice_bytes)],
                          capture_output=True, text=True, env=env, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"{how} run failed:\n{done.stderr[-2000:]}")
    extra, grads, loss = done.stdout.split()[-3:]
    return {"extra_bytes": int(extra), "gradient_bytes": int(grads), "loss": float(loss)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--ways", default="eager,fused,sliced", help="eager, fused and/or sliced, comma-separated")
    ap.add_argument("--slice-mib", type=float, default=256, help="the sliced way's working set (GRAD_SLICE_BYTES)")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args(argv)
    ways = args.ways.split(",")
    if "eager" not in ways or any(w not in ("eager", "fused", "sliced") for w in ways):
        print(f"bench_ce_memory: --ways {args.ways}: eager and any of fused, sliced", file=sys.stderr)
        return 2
    if not os.path.exists("/proc/self/clear_refs"):
        print("bench_ce_memory: peak resident memory is read from Linux's /proc (clear_refs, VmHWM)", file=sys.stderr)
        return 2
    logits = args.tokens * args.vocab * 4
    print(f"{args.tokens} tokens, hidden {args.hidden}, vocabulary {args.vocab}: float32 logits "
          f"{logits / 2**20:,.0f} MiB", file=sys.stderr)
    out = {"tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab, "logits_bytes": logits}
    for how in ways:
        out[how] = measure(how, args.tokens, args.hidden, args.vocab, int(args.slice_mib * 2**20))
        print(f"{how:6s} extra {out[how]['extra_bytes'] / 2**20:10,.1f} MiB   loss {out[how]['loss']:.6f}",
              file=sys.stderr, flush=True)
    for how in ways[1:]:
        # Resident memory grows a page at a time: below one page the ratio is a bound.
        extra = out[how]["extra_bytes"]
        out[f"ratio_{how}"] = out["eager"]["extra_bytes"] / max(extra, PAGE)
        print(f"{how} takes {'at least ' if extra < PAGE else ''}{out[f'ratio_{how}']:,.1f}x less extra memory "
              "than eager")
    if args.json:
        from mfuscope.atomic import write_json
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
