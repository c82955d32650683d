"""Feature maps on keys and queries of the Atlas memory (docs/semantics.md)."""

from __future__ import annotations

import math

import torch


def initial_coefficients(feature_map: str, degree: int) -> torch.Tensor:
    """``a_i = 1/i!``: ``i = 1..degree`` for ``poly_elementwise``, ``i = 0..2`` for ``poly_tensor``."""
    if feature_map == "poly_elementwise":
        return torch.tensor([1.0 / math.factorial(i) for i in range(1, degree + 1)])
    if feature_map == "poly_tensor":
        return torch.tensor([1.0, 1.0, 0.5])
    return torch.zeros(0)


def apply_feature_map(feature_map: str, x: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
    """``identity``; ``poly_elementwise``: ``sum_i a_i x^i``; ``poly_tensor``:
    ``[sqrt(a_0), sqrt(a_1) x, sqrt(a_2) sym(x (x) x)]`` with ``<phi(x), phi(y)> = a_0 + a_1 x.y + a_2 (x.y)^2``."""
    if feature_map == "identity":
        return x
    a = coefficients.to(x.dtype)
    if feature_map == "poly_elementwise":
        out, power = torch.zeros_like(x), x
        for coef in a:
            out = out + coef * power
            power = power * x
        return out
    d = x.shape[-1]
    rows, cols = torch.triu_indices(d, d, device=x.device)
    scale = torch.full(rows.shape, math.sqrt(2.0), dtype=x.dtype, device=x.device).masked_fill(rows == cols, 1.0)
    pairs = x[..., rows] * x[..., cols] * scale
    roots = a.abs().sqrt()
    return torch.cat([roots[0] * torch.ones_like(x[..., :1]), roots[1] * x, roots[2] * pairs], dim=-1)
