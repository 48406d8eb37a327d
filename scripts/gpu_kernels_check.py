"""The fused kernels on a GPU against their float32 references: what the interpreter cannot check.

``make test`` runs every kernel through Triton's interpreter, in float32 inside
(the interpreter's bf16 arithmetic is broken), and the LM head's GPU path (bf16
GEMMs on vocabulary slices) in float32 on the CPU: the bf16 tensor-core paths
run only here.  This runs each op forward and backward on CUDA in bf16 at a Llama 3
8B shape (hidden 4096, 8k tokens, vocabulary 128,256; the MoE permute routing
top-8 of 64 experts) and in float32 at a small one, compares the output and
every gradient with the op's PyTorch reference in float32 on the same rounded
inputs (as the CPU tests do), and records the LM head's peak memory against eager
``F.linear`` + ``F.cross_entropy`` (``torch.cuda.max_memory_allocated``).

Tolerance: elementwise ``|got - truth| <= rel (|truth| + rms(truth))`` with
``rel`` one rounding of the output dtype plus float32 accumulation over the
reduced length (``tests/kernel_checks.tolerance``), times 4 for bf16 products
that a GEMM rounds before a softmax (the LM head), as the CPU tests allow.

    python scripts/gpu_kernels_check.py --json gpu_kernels.json
    TRITON_INTERPRET=1 python scripts/gpu_kernels_check.py --device cpu --small   # a dry run of the script

Exit 0: every check passed; 1: one failed; 3: no CUDA (and no ``--device cpu``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def _max_rel(got, truth) -> float:
    g, t = got.double(), truth.double()
    scale = t.pow(2).mean().sqrt().item() if t.numel() else 0.0
    return float(((g - t).abs() / (t.abs() + scale + 1e-300)).max().item()) if t.numel() else 0.0


def _compare(name: str, dtype, fused, reference, inputs, reduced: int, bf16_gemm: bool = False,
             differentiated: int | None = None, roundings: int = 1) -> dict:
    """Forward and backward of ``fused`` against ``reference`` in float32 on the same inputs; the
    gradients of the first ``differentiated`` inputs (default all).  ``roundings``: how many times
    the output dtype rounds on the way to the worst gradient."""
    import torch

    from mfuscope.tests.kernel_checks import tolerance

    seeds: list = []  # the incoming gradients, drawn once in the fused op's dtype and reused, upcast

    def run(fn, cast):
        n = len(inputs) if differentiated is None else differentiated
        leaves = [x.detach().to(cast).requires_grad_(i < n) for i, x in enumerate(inputs)]
        out = fn(*leaves)
        out = out if isinstance(out, tuple) else (out,)
        if not seeds:
            seeds.extend(torch.randn(o.shape, device=o.device).to(o.dtype) for o in out)
        torch.autograd.backward(out, [s.to(o.dtype) for s, o in zip(seeds, out)])
        grads = [x.grad for x in leaves if x.requires_grad]
        return [o.detach() for o in out] + grads

    start = time.perf_counter()
    got = run(fused, dtype)
    truth = run(reference, torch.float32)
    rel = roundings * tolerance(dtype, reduced) * (4 if bf16_gemm and dtype == torch.bfloat16 else 1)
    worst = max(_max_rel(g, t) for g, t in zip(got, truth))
    nan = any(torch.isnan(g).any().item() for g in got)
    return {"op": name, "dtype": str(dtype).replace("torch.", ""), "worst_rel_error": worst, "tolerance": rel,
            "passed": bool(worst <= rel and not nan), "seconds": time.perf_counter() - start}


def _head_memory(device, tokens: int, hidden: int, vocab: int) -> dict:
    """Peak memory above the inputs of eager and fused LM head + loss, forward and backward, bf16."""
    import torch
    import torch.nn.functional as F

    from mfuscope.kernels import fused_linear_cross_entropy

    out = {}
    for how in ("eager", "fused"):
        h = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
        w = (0.02 * torch.randn(vocab, hidden, device=device, dtype=torch.bfloat16)).requires_grad_()
        t = torch.randint(0, vocab, (tokens,), device=device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = F.cross_entropy((h @ w.t()).float(), t) if how == "eager" else fused_linear_cross_entropy(h, w, t)
        loss.backward()
        torch.cuda.synchronize()
        grads = h.grad.nbytes + w.grad.nbytes
        out[how] = {"extra_bytes": torch.cuda.max_memory_allocated() - base - grads, "loss": float(loss)}
        del h, w, t, loss
        torch.cuda.empty_cache()
    out["ratio"] = out["eager"]["extra_bytes"] / max(out["fused"]["extra_bytes"], 1)
    return out


def checks(device: str, small: bool) -> list[dict]:
    import torch

    from mfuscope import kernels
    from mfuscope.kernels.rope import rope_angles

    g = torch.Generator(device=device).manual_seed(0)
    torch.manual_seed(0)  # the incoming gradients
    hidden, tokens, vocab, heads = (64, 32, 1003, 4) if small else (4096, 8192, 128256, 32)
    out = []
    for dtype, h, n, v in ((torch.bfloat16, hidden, tokens, vocab), (torch.float32, 256, 128, 1003)):
        def r(*shape, scale=1.0, dtype=dtype):  # the loop's dtype, bound
            return (scale * torch.randn(*shape, generator=g, device=device)).to(dtype)
        x, w = r(n, h), 1 + r(h, scale=0.1)
        out.append(_compare("rms_norm", dtype, kernels.rms_norm, kernels.rms_norm_reference, (x, w), n))
        out.append(_compare("add_rms_norm", dtype, kernels.add_rms_norm, kernels.add_rms_norm_reference,
                            (x, r(n, h), w), n))
        # swiglu: no reduction, but its backward chains 8 float32 operations, each rounded
        out.append(_compare("swiglu", dtype, kernels.swiglu, kernels.swiglu_reference,
                            (r(n, 2 * h, scale=3), r(n, 2 * h)), 8))
        hd = h // heads
        cos, sin = rope_angles(torch.arange(n // 2, device=device), hd, 500000.0)
        q, k = r(2, heads, n // 2, hd), r(2, max(heads // 4, 1), n // 2, hd)
        # the angles stay float32 for both, as the trainer passes them (cast to bf16 for the fused op
        # alone, they differed from the reference's by a rounding: 1.04e-2 against 7.8e-3 on an H200)
        out.append(_compare("rope", dtype, lambda q, k, c=cos, s=sin: kernels.apply_rope(q, k, c, s),
                            lambda q, k, c=cos, s=sin: (kernels.rope_reference(q, c, s),
                                                        kernels.rope_reference(k, c, s)),
                            (q, k), 1))
        target = torch.randint(0, v, (n,), generator=g, device=device)
        target[::17] = -100
        out.append(_compare("linear_ce", dtype,
                            lambda a, b, t=target: kernels.fused_linear_cross_entropy(a, b, t),
                            lambda a, b, t=target: kernels.linear_cross_entropy_reference(a, b, t),
                            (r(n, h), r(v, h, scale=0.02)), max(h, v), bf16_gemm=True, differentiated=2))
        expert = torch.rand(n, 64, generator=g, device=device).topk(8, dim=-1).indices
        positions = kernels.moe_positions(expert)
        out.append(_compare("moe_permute", dtype,
                            lambda a, p, pos=positions: kernels.moe_unpermute(
                                kernels.moe_permute(a, pos) * 2.0, pos, p),
                            lambda a, p, pos=positions: kernels.moe_unpermute_reference(
                                kernels.moe_permute_reference(a, pos) * 2.0, pos, p),
                            (r(n, h), torch.rand(n, 8, generator=g, device=device).to(dtype)), 8 * h,
                            roundings=2))  # the slots' gradients are rounded, then their sum
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: a dry run of this script (set TRITON_INTERPRET=1 to run the kernels)")
    ap.add_argument("--small", action="store_true", help="small shapes (the dry run's)")
    args = ap.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_kernels_check: no CUDA device here (use --device cpu for a dry run)", file=sys.stderr)
        return 3
    results = checks(args.device, args.small or args.device == "cpu")
    for row in results:
        print(f"{row['op']:<13} {row['dtype']:<9} worst {row['worst_rel_error']:.2e} "
              f"(tolerance {row['tolerance']:.2e}) "
              f"{'ok' if row['passed'] else 'FAILED'}", file=sys.stderr)
    doc = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
           "checks": results}
    if args.device == "cuda":
        doc["lm_head_memory"] = _head_memory(args.device, 4096, 4096, 128256)
        m = doc["lm_head_memory"]
        print(f"LM head + loss, 4k tokens x 128k vocabulary, bf16: eager {m['eager']['extra_bytes'] / 2**20:,.0f} MiB, "
              f"fused {m['fused']['extra_bytes'] / 2**20:,.0f} MiB ({m['ratio']:.1f}x less)", file=sys.stderr)
    if args.json:
        from mfuscope.atomic import write_json
        write_json(args.json, doc)
    print(json.dumps(doc))
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
