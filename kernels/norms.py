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


def clip_rank_one(factors: dict, clip: float) -> dict:
    """Rescale each token's gradient, given as rank-1 factors ``{name: (A, B)}`` (``grad = A B^T`` per
    token, rows ``(..., K, .)``), so that its norm over all the memory's weights is at most ``clip``.

    A rank-1 gradient's Frobenius norm is ``||A|| ||B||``: the clip costs two vector norms per weight
    and never forms a matrix; the scale rides on ``A``.
    """
    wide = lambda x: x.to(torch.promote_types(x.dtype, torch.float32))  # noqa: E731  (bf16 inputs: norms in fp32)
    # Sums of squares, not norms: a norm's gradient is 0/0 at a zero vector (a padded token's factors), masked to
    # zero only to first order, and the clip must stay differentiable to every order there.
    squared = sum(wide(a).pow(2).sum(-1) * wide(b).pow(2).sum(-1) for a, b in factors.values())
    scale = clip_scale(squared, clip)
    return {name: (a * scale.unsqueeze(-1).to(a.dtype), b) for name, (a, b) in factors.items()}
