"""Bytes a transformer block keeps for its backward, eager against torch.compile, counted tensor by tensor.

The memory model (``optimizers/cost/memory.py``) counts the Llama block's saved
tensors as eager PyTorch keeps them.  torch.compile's partitioner keeps fewer:
it recomputes cheap elementwise results (a norm's output, SwiGLU's product) from
what it keeps anyway.  An H200 run of the ``gpu_dense_1b`` config with
torch.compile peaked at 77.6 GiB where the eager count predicted 99.2.

This runs one reference-trainer block forward under bf16 autocast on the CPU
(the GPU runs' dtypes: autocast's bf16 matmuls beside a float32 residual
stream), eager and compiled, walks the autograd graph from its output and sums
the distinct storages it holds that are not parameters (nor autocast's bf16
copies of them, which the model counts with the weights), per token, listed by
shape and dtype.

    python benchmarks/saved_activations.py [--config gpu_dense_1b] [--seq 256] [--backend inductor] [--json out.json]
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter


def saved_storages(output, shared) -> list:
    """Distinct tensors (by storage) the autograd graph of ``output`` keeps, ``shared`` left out
    (the parameters, and the rotations every layer reads: the model's, not a layer's)."""
    import torch

    skip = {p.untyped_storage().data_ptr() for p in shared}
    seen, out, stack, visited = set(), [], [output.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        tensors = []
        for name in dir(node):
            if name.startswith("_saved_"):
                value = getattr(node, name)
                tensors += value if isinstance(value, (list, tuple)) else [value]
        saved = getattr(node, "saved_tensors", None)  # custom Functions (torch.compile's graph)
        if isinstance(saved, tuple):
            tensors += list(saved)
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.numel() > 1:
                ptr = t.untyped_storage().data_ptr()
                if ptr not in skip and ptr not in seen:
                    seen.add(ptr)
                    out.append(t)
        stack += [fn for fn, _ in node.next_functions]
    return out


def measure(cfg_name: str, seq: int, compiled: bool, backend: str = "inductor") -> dict:
    import torch

    from mfuscope.reference_trainer.config import load_config
    from mfuscope.reference_trainer.model import TransformerBlock, rotary_table

    model = load_config(cfg_name).model
    widths = {model.dim, model.ffn_dim, model.n_kv_heads * model.head_dim, model.n_heads * model.head_dim}
    if seq in widths:  # autocast's weight copies are told apart by shape: a (seq, width) tensor would pass
        raise ValueError(f"--seq {seq} equals one of the model's widths {sorted(widths)}: take another")
    torch.manual_seed(0)
    block = TransformerBlock(model)
    run = torch.compile(block, backend=backend) if compiled else block
    x = torch.randn(1, seq, model.dim, requires_grad=True)  # the residual stream: float32, as the embedding's
    rotary = rotary_table(torch.arange(seq), model.head_dim, model.rope_theta)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = run(x, rotary)
    weights = {tuple(p.shape) for p in block.parameters()} | {tuple(p.shape[::-1]) for p in block.parameters()}
    kept, total = Counter(), 0
    for t in saved_storages(y, [*block.parameters(), rotary]):
        if tuple(t.shape) in weights:  # autocast's bf16 copy of a weight: the model counts it with the weights
            continue
        nbytes = t.untyped_storage().nbytes()
        total += nbytes
        kept[f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"] += nbytes / seq
    y.sum().backward()  # the graph ran: what it held was what backward needed
    return {"bytes_per_token": total / seq, "tensors": dict(sorted(kept.items(), key=lambda kv: -kv[1]))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="gpu_dense_1b")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--backend", default="inductor",
                    help="torch.compile backend: inductor (the real one), or aot_eager_decomp_partition: the same "
                         "partitioner, and so the same saved set, without Inductor's code generation (seconds)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    out = {"config": args.config, "seq": args.seq}
    for mode in ("eager", "compiled"):
        out[mode] = measure(args.config, args.seq, mode == "compiled", args.backend)
        print(f"{mode:9s} {out[mode]['bytes_per_token']:10,.0f} B a token a layer")
        for shape, per_token in out[mode]["tensors"].items():
            print(f"    {per_token:10,.0f} B a token  {shape}")
    out["compiled_over_eager"] = out["compiled"]["bytes_per_token"] / out["eager"]["bytes_per_token"]
    print(f"compiled / eager: {out['compiled_over_eager']:.3f}")
    if args.json:
        from mfuscope.atomic import write_json
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
