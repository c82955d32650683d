"""Derivatives of the memories' activations, written out for the hand-made backward passes."""

from __future__ import annotations

import torch

__all__ = ["gelu_derivative"]


def gelu_derivative(x: torch.Tensor) -> torch.Tensor:
    """d/dx of the exact (erf) GELU."""
    cdf = 0.5 * (1.0 + torch.erf(x * 0.7071067811865476))
    return cdf + x * torch.exp(-0.5 * x * x) * 0.3989422804014327
