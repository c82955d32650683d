"""Normalisations shared by the memory kernels (one definition for every path)."""

from __future__ import annotations

import torch

L2_EPS = 1e-6


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (a zero vector stays zero)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def clip_scale(squared_norm: torch.Tensor, clip: float) -> torch.Tensor:
    """``min(1, clip / ||g||)`` from ``||g||^2``: the factor that brings a gradient's norm down to ``clip``."""
    return (clip / squared_norm.clamp_min(1e-30).sqrt()).clamp(max=1.0)
