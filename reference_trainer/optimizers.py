"""One optimizer per model part, stepped as one (torchtitan's ``OptimizersContainer``).

A rank of an interleaved or zero-bubble pipeline holds several stage modules.  DCP's state-dict
helpers name an optimizer's state through the one module that holds its parameters, so each part
has its own optimizer; AdamW and SGD update each parameter on its own, so the numbers are those of
one optimizer over all of them.  Checkpoints save each part's model and optimizer state under the
full model's parameter names (reference_trainer/checkpointing.py), whatever the parts.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class PartOptimizers:
    def __init__(self, parts: list[nn.Module], make: Callable[[list], torch.optim.Optimizer]):
        self.parts = parts
        self.optimizers = [make(list(m.parameters())) for m in parts]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def register_step_pre_hook(self, hook):
        """A hook run once per step (before the first part's optimizer)."""
        return self.optimizers[0].register_step_pre_hook(hook)
