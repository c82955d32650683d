"""Normalisations shared by the memory kernels (one definition for every path)."""

from __future__ import annotations

import torch

L2_EPS = 1e-6


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (a zero vector stays zero)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
