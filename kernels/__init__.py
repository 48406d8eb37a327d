"""Fused training kernels in Triton, each beside its PyTorch reference.

Each operator is one module (kernels, launchers, a ``torch.library`` custom op
with its fake and autograd), so ``torch.compile`` traces through it.  CUDA
tensors run the Triton kernel; CPU tensors run the reference, or the kernel
through Triton's interpreter under ``TRITON_INTERPRET=1`` (see ``_dispatch``).
"""
import sys

if __name__ == "kernels":
    # Imported by the folder's own name: a checkout's root is on sys.path (pytest, ``python -c``) and
    # Hugging Face's transformers probes for its ``kernels`` package by importing that name.  A second
    # copy of these modules would register every custom op again under it, and a test's patch of one
    # copy would miss the op the other registered: hand back the one package instead.
    import importlib

    sys.modules[__name__] = importlib.import_module("mfuscope.kernels")
else:
    from .add_rms_norm import add_rms_norm, add_rms_norm_reference
    from .apply import Applied, apply
    from .linear_cross_entropy import fused_linear_cross_entropy, linear_cross_entropy_reference
    from .moe_routing import moe_permute, moe_permute_reference, moe_positions, moe_unpermute, moe_unpermute_reference
    from .rms_norm import rms_norm, rms_norm_reference
    from .rope import apply_rope, rope_reference
    from .swiglu import swiglu, swiglu_reference

__all__ = ["Applied", "apply", "add_rms_norm", "add_rms_norm_reference", "apply_rope", "rope_reference",
           "fused_linear_cross_entropy", "linear_cross_entropy_reference", "moe_permute", "moe_permute_reference",
           "moe_positions", "moe_unpermute", "moe_unpermute_reference",
           "rms_norm", "rms_norm_reference", "swiglu", "swiglu_reference"]
