"""RMSNorm times a SiLU gate, the output normalisation of the memory layers, in one kernel each way.

Over the last dimension (one head), in float32 whatever the inputs::

    y = x * rsqrt(mean(x^2) + eps) * weight * silu(gate)

returned in ``x``'s dtype. The PyTorch path is that line; on CUDA one Triton
kernel computes it and one its backward (``dx``, ``dgate`` and per-block partial
sums of ``dweight``, added in PyTorch: no atomics), where the PyTorch path runs
about ten element-wise kernels forward and fifteen backward over the layer's
outputs in float32.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .backend import resolve_backend, tl, triton


__all__ = ["gated_rms_norm"]

_ROWS = 16  # rows per program


def _torch_path(x, gate, weight, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (normed * F.silu(gate.float())).to(x.dtype)


@triton.jit
def _tile(X, G, W, rows, cols, N, D):
    mask = (rows[:, None] < N) & (cols[None, :] < D)
    offsets = rows.to(tl.int64)[:, None] * D + cols[None, :]
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offsets, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
    return offsets, mask, x, g, w

@triton.jit
def _forward_kernel(X, G, W, Y, N, D, eps, BR: tl.constexpr, BD: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    offsets, mask, x, g, w = _tile(X, G, W, rows, cols, N, D)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    y = x * r[:, None] * w[None, :] * (g * tl.sigmoid(g))
    tl.store(Y + offsets, y.to(Y.dtype.element_ty), mask=mask)

@triton.jit
def _backward_kernel(X, G, W, DY, DX, DG, DW_PART, N, D, eps, BR: tl.constexpr, BD: tl.constexpr):
    """With ``n = x r`` and ``s = silu(g)``: ``dg = dy n w s'``, ``dn = dy w s``,
    ``dx = r (dn - n mean(dn n))`` and this block's ``sum(dy n s)`` over rows for ``dweight``."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    offsets, mask, x, g, w = _tile(X, G, W, rows, cols, N, D)
    dy = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    n = x * r[:, None]
    sig = tl.sigmoid(g)
    s = g * sig
    tl.store(DG + offsets, (dy * n * w[None, :] * sig * (1.0 + g * (1.0 - sig))).to(DG.dtype.element_ty),
             mask=mask)
    dn = dy * w[None, :] * s
    dx = r[:, None] * (dn - n * (tl.sum(dn * n, axis=1) / D)[:, None])
    tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW_PART + tl.program_id(0).to(tl.int64) * D + cols, tl.sum(dy * n * s, axis=0), mask=cols < D)


def _launch(N: int, D: int) -> tuple[tuple[int], int]:
    return (triton.cdiv(N, _ROWS),), max(16, triton.next_power_of_2(D))


class _GatedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate, weight, eps):
        D = x.shape[-1]
        x2, g2 = x.reshape(-1, D).contiguous(), gate.reshape(-1, D).contiguous()
        y = torch.empty_like(x2)
        grid, BD = _launch(x2.shape[0], D)
        _forward_kernel[grid](x2, g2, weight, y, x2.shape[0], D, eps, BR=_ROWS, BD=BD, num_warps=4)
        ctx.save_for_backward(x2, g2, weight)
        ctx.eps = eps
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, g2, weight = ctx.saved_tensors
        N, D = x2.shape
        grid, BD = _launch(N, D)
        dx, dg = torch.empty_like(x2), torch.empty_like(g2)
        dw_part = torch.empty(grid[0], D, dtype=torch.float32, device=x2.device)
        _backward_kernel[grid](x2, g2, weight, dy.reshape(N, D).contiguous(), dx, dg, dw_part, N, D, ctx.eps,
                               BR=_ROWS, BD=BD, num_warps=4)
        shape = dy.shape
        return dx.view(shape), dg.view(shape), dw_part.sum(0).to(weight.dtype), None


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm(x) * weight * silu(gate)`` over the last dimension, float32 inside, ``x``'s dtype out."""
    if gate.shape != x.shape or weight.shape != x.shape[-1:]:
        raise ValueError(f"gated_rms_norm: x {tuple(x.shape)}, gate {tuple(gate.shape)} and weight "
                         f"{tuple(weight.shape)} do not match (gate like x, weight like x's last dimension)")
    covered = x.dtype != torch.float64 and x.shape[-1] <= 4096
    if resolve_backend(x, has_triton_impl=covered) == "triton" and x.numel() > 0:
        return _GatedRMSNorm.apply(x, gate, weight, eps)
    return _torch_path(x, gate, weight, eps)
