"""The SwiGLU feed-forward block shared by every family.

Its backward keeps the block's input, ``gate`` and ``up``: ``silu(gate)`` and the product
that the down projection takes are made again (``kernels/swiglu.py``), which saves two
of the five intermediate-width tensors per token that autograd would keep.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.swiglu import silu_mul, silu_mul_recipe
from .recompute import RecomputedSaves


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        with RecomputedSaves() as saves:
            product = saves.register(silu_mul(gate, up), silu_mul_recipe(gate, up))
            return self.down_proj(product)
