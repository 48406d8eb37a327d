"""Fused kernels against eager PyTorch, torch.compile and Liger-Kernel.

Each operator, forward + backward, at the shapes of 8B, 70B and 405B Llama
models (hidden 4096 / 8192 / 16384, 8k tokens, vocabulary 128,256; the MoE
permute and unpermute routing each token to 8 of 64 experts) in bf16:
median time over CUDA events, achieved bandwidth against the device's HBM
peak (from ``mfuscope.hardware``), peak memory.  Liger-Kernel (the ``bench``
extra) joins on a GPU when it is installed; its kernels need CUDA.  Long-format rows
(provider, op, model, metric, value) are printed and written as JSON.

On a machine without a GPU the script runs the Triton kernels through the
interpreter on small shapes, to check that it runs: those timings mean
nothing, and it says so.

    python benchmarks/bench_kernels.py [--json out.json] [--rounds 20]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

MODELS = {"8b": 4096, "70b": 8192, "405b": 16384}
OPS = ("rms_norm", "add_rms_norm", "swiglu", "rope", "linear_ce", "moe_permute")
TOKENS, VOCAB = 8192, 128256
#: The MoE permute's routing: each token to 8 of 64 experts (DeepSeek-V3's top-8).
TOP_K, EXPERTS = 8, 64


def _inputs(op: str, hidden: int, tokens: int, vocab: int, device, dtype):
    import torch
    g = torch.Generator(device=device).manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype).requires_grad_()
    if op == "rms_norm":
        return r(tokens, hidden), r(hidden)
    if op == "add_rms_norm":
        return r(tokens, hidden), r(tokens, hidden), r(hidden)
    if op == "swiglu":
        ffn = hidden * 7 // 2
        return r(tokens, ffn), r(tokens, ffn)
    if op == "rope":
        heads, d = hidden // 128, 128
        from mfuscope.kernels.rope import rope_angles
        cos, sin = rope_angles(torch.arange(tokens // 2, device=device), d, 500000.0)
        return r(2, heads, tokens // 2, d), r(2, max(heads // 8, 1), tokens // 2, d), cos, sin
    if op == "moe_permute":
        from mfuscope.kernels import moe_positions
        expert = torch.rand(tokens, EXPERTS, device=device, generator=g).topk(TOP_K, dim=-1).indices
        weight = torch.rand(tokens, TOP_K, device=device, generator=g).to(dtype).requires_grad_()
        return r(tokens, hidden), moe_positions(expert), weight
    target = torch.randint(0, vocab, (tokens,), device=device, generator=g)
    return r(tokens, hidden), (0.02 * torch.randn(vocab, hidden, device=device, dtype=dtype)).requires_grad_(), target


def _providers(op: str):
    """provider -> callable(*inputs) returning what to backprop."""
    import torch
    import torch.nn.functional as F

    from mfuscope import kernels

    eager = {"rms_norm": lambda x, w: kernels.rms_norm_reference(x, w),
             "add_rms_norm": lambda x, r, w: kernels.add_rms_norm_reference(x, r, w)[0],
             "swiglu": lambda g, u: F.silu(g) * u,
             "rope": lambda q, k, c, s: kernels.rope_reference(q, c, s) + 0 * kernels.rope_reference(k, c, s).sum(),
             "linear_ce": lambda h, w, t: F.cross_entropy((h @ w.t()).float(), t),
             "moe_permute": lambda x, p, w: kernels.moe_unpermute_reference(kernels.moe_permute_reference(x, p),
                                                                            p, w)}[op]
    fused = {"rms_norm": kernels.rms_norm, "add_rms_norm": lambda x, r, w: kernels.add_rms_norm(x, r, w)[0],
             "swiglu": kernels.swiglu,
             "rope": lambda q, k, c, s: (lambda a, b: a + 0 * b.sum())(*kernels.apply_rope(q, k, c, s)),
             "linear_ce": kernels.fused_linear_cross_entropy,
             "moe_permute": lambda x, p, w: kernels.moe_unpermute(kernels.moe_permute(x, p), p, w)}[op]
    out = {"eager": eager, "mfuscope": fused}
    if torch.cuda.is_available():
        out["torch.compile"] = torch.compile(eager)
        liger = _liger(op)
        if liger:
            out["liger"] = liger
    return out


def _liger(op: str):
    """Liger-Kernel's functional op for ``op`` taking this benchmark's inputs, or None when Liger
    is not installed.  Its RoPE takes Hugging Face's (seq, head_dim) angles, the halves repeated."""
    try:
        from liger_kernel.transformers import functional as lf
    except ImportError:
        return None
    if op == "moe_permute":  # Liger has no MoE permute
        return None
    import torch

    def rope(q, k, c, s):
        a, b = lf.liger_rope(q, k, torch.cat([c, c], -1)[None], torch.cat([s, s], -1)[None])
        return a + 0 * b.sum()
    return {"rms_norm": lambda x, w: lf.liger_rms_norm(x, w, 1e-6, in_place=False),
            "add_rms_norm": lambda x, r, w: lf.liger_fused_add_rms_norm(x, r, w, 1e-6, in_place=False)[0],
            "swiglu": lf.liger_swiglu,
            "rope": rope,
            "linear_ce": lambda h, w, t: lf.liger_fused_linear_cross_entropy(h, w, t)}[op]


#: Elements a fused forward + backward must read and write, in units of the first input's size
#: (rope: q and k together): the roofline's traffic.  linear_ce is compute-bound: no bandwidth.
#: moe_permute (permute then unpermute, k slots a token): forward 1 + k and k + 1, backward
#: 1 + 2k (dy and the rows in, their gradients out) and k + 1.
TRAFFIC = {"rms_norm": 5, "add_rms_norm": 8, "swiglu": 8, "rope": 4, "moe_permute": 5 * TOP_K + 4}


def _bytes_moved(op: str, inputs) -> int | None:
    if op not in TRAFFIC:
        return None
    first = inputs[0]
    n = first.numel() + (inputs[1].numel() if op == "rope" else 0)
    return TRAFFIC[op] * n * first.element_size()


def _time(fn, inputs, rounds: int, cuda: bool) -> tuple[float, int]:
    import torch

    def once():
        out = fn(*inputs)
        out.float().sum().backward() if out.dim() else out.backward()
    once()
    samples = []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(rounds):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            once()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            once()
            samples.append(time.perf_counter() - t)
    return statistics.median(samples), torch.cuda.max_memory_allocated() if cuda else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--models", default=",".join(MODELS),
                    help=f"comma-separated shapes to run on a GPU (default: all of {', '.join(MODELS)})")
    ap.add_argument("--ops", default=",".join(OPS), help="comma-separated ops (default: all)")
    args = ap.parse_args()
    for flag, given, known in (("--models", args.models, MODELS), ("--ops", args.ops, OPS)):
        unknown = set(given.split(",")) - set(known)
        if unknown:
            ap.error(f"{flag}: unknown {', '.join(sorted(unknown))} (known: {', '.join(known)})")
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        print("no GPU: the Triton kernels run through the interpreter on small shapes; these timings mean "
              "nothing (run on a GPU for the real table, where torch.compile and Liger-Kernel join)", file=sys.stderr)
    from mfuscope import hardware
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    peak_bw = None
    if cuda:
        acc = hardware.lookup(torch.cuda.get_device_name())
        peak_bw = acc.memory_tbps * 1e12 if acc else None
    models = {m: MODELS[m] for m in args.models.split(",")} if cuda else {"tiny": 256}
    tokens, vocab, rounds = (TOKENS, VOCAB, args.rounds) if cuda else (64, 1000, 2)
    rows = []
    for op in args.ops.split(","):
        for model, hidden in models.items():
            for provider, fn in _providers(op).items():
                inputs = _inputs(op, hidden, tokens, vocab, device, dtype)
                seconds, peak = _time(fn, inputs, rounds, cuda)
                moved = _bytes_moved(op, inputs)
                row = {"op": op, "model": model, "provider": provider, "seconds": seconds,
                       "gb_per_s": moved / seconds / 1e9 if moved else None,
                       "hbm_fraction": moved / seconds / peak_bw if moved and peak_bw else None,
                       "peak_memory_bytes": peak,
                       "device": torch.cuda.get_device_name() if cuda else "cpu (interpreter)",
                       "torch": torch.__version__}
                rows.append(row)
                frac = f"{row['hbm_fraction']:.0%}" if row["hbm_fraction"] else "–"
                bw = f"{row['gb_per_s']:8.1f} GB/s" if row["gb_per_s"] else f"{'–':>13}"
                print(f"{op:<13} {model:<5} {provider:<14} {seconds * 1e3:9.3f} ms  {bw}  HBM {frac:>4}  "
                      f"peak {peak / 2**20:9.1f} MiB")
                if args.json:  # after every row: a machine lent for minutes may be taken back mid-table
                    from mfuscope.atomic import write_json
                    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
