"""RMSNorm (the residual add fused in where a block asks) and the gated RMSNorm of the memory outputs, in float32."""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.gated_rms_norm import gated_rms_norm
from ..kernels.rms_norm import rms_norm


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight``; ``norm(x, residual)`` returns ``(norm(x + residual), x + residual)``
    in one kernel each way on CUDA, keeping only the sum for the backward (``kernels/rms_norm.py``)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return rms_norm(x, self.weight, self.eps, residual)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GatedRMSNorm(RMSNorm):
    """``RMSNorm(x) * silu(gate)`` over the last dimension (one head), as in Gated DeltaNet; one fused
    kernel each way on CUDA (``kernels/gated_rms_norm.py``)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)
