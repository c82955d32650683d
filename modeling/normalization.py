"""RMSNorm (the residual add fused in where a block asks) and the gated RMSNorm of the memory outputs, in float32."""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.gated_rms_norm import gated_rms_norm
from ..kernels.rms_norm import rms_norm


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight``; ``norm(x, residual)`` returns ``(norm(x + residual), x + residual)``
    in one kernel each way on CUDA, keeping only the sum for the backward (``kernels/rms_norm.py``).

    ``autocast_output=True`` (a block's norm before its projections): under autocast the norm comes out in
    autocast's dtype, as every projection would cast it. The projections then share one copy instead of
    each casting (and saving for its backward) its own, and their input gradients add in that dtype; the
    residual stream itself stays in its own dtype."""

    def __init__(self, dim: int, eps: float = 1e-6, autocast_output: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.autocast_output = autocast_output

    def _out_dtype(self, x: torch.Tensor) -> torch.dtype | None:
        if self.autocast_output and torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
        return None

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return rms_norm(x, self.weight, self.eps, residual, self._out_dtype(x))

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GatedRMSNorm(RMSNorm):
    """``RMSNorm(x) * silu(gate)`` over the last dimension (one head), as in Gated DeltaNet; one fused
    kernel each way on CUDA (``kernels/gated_rms_norm.py``)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)
