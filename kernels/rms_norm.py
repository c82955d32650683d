"""RMSNorm of the residual stream, with the residual add fused in, keeping only its input for the backward.

::

    s = x + residual            (when a residual is given; returned as the new residual stream)
    y = s * rsqrt(mean(s^2) + eps) * weight

in float32 whatever the inputs, ``y`` in ``s``'s dtype. Left to autograd, these few
element-wise operations keep ``s`` in float32, its normalised copy and the
reciprocal root for the backward: two row-sized float32 tensors per norm, two norms
per block. :func:`rms_norm` keeps ``s`` and the per-row reciprocal root only and
makes the rest again in the backward, on every device; on CUDA one Triton kernel
computes each direction (the add, the norm and, backward, ``ds`` with per-block
partial sums of ``dweight``, added in PyTorch: no atomics). The forward's values are
those of the plain expression, bit for bit on the PyTorch path.
"""

from __future__ import annotations

import torch

from .backend import resolve_backend, tl, triton

__all__ = ["rms_norm"]

_ROWS = 16  # rows per program


@triton.jit
def _forward_kernel(X, R, S, W, Y, RSTD, N, D, eps, HAS_RESIDUAL: tl.constexpr, BR: tl.constexpr,
                    BD: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    mask = (rows[:, None] < N) & (cols[None, :] < D)
    offsets = rows.to(tl.int64)[:, None] * D + cols[None, :]
    s = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        s = s + tl.load(R + offsets, mask=mask, other=0.0).to(tl.float32)
        s = s.to(S.dtype.element_ty)
        tl.store(S + offsets, s, mask=mask)
        s = s.to(tl.float32)  # normalise the stream as stored, in its dtype
    w = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(s * s, axis=1) / D + eps)
    tl.store(RSTD + rows, r, mask=rows < N)
    tl.store(Y + offsets, (s * r[:, None] * w[None, :]).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _backward_kernel(S, W, RSTD, DY, DS_IN, DS, DW_PART, N, D, HAS_DS_IN: tl.constexpr, BR: tl.constexpr,
                     BD: tl.constexpr):
    """With ``n = s r``: ``dn = dy w``, ``ds = r (dn - n mean(dn n))`` (plus the stream's own gradient) and
    this block's ``sum(dy n)`` over rows for ``dweight``."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    mask = (rows[:, None] < N) & (cols[None, :] < D)
    offsets = rows.to(tl.int64)[:, None] * D + cols[None, :]
    s = tl.load(S + offsets, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
    r = tl.load(RSTD + rows, mask=rows < N, other=0.0)
    n = s * r[:, None]
    dn = dy * w[None, :]
    ds = r[:, None] * (dn - n * (tl.sum(dn * n, axis=1) / D)[:, None])
    if HAS_DS_IN:
        ds = ds + tl.load(DS_IN + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(DS + offsets, ds.to(DS.dtype.element_ty), mask=mask)
    tl.store(DW_PART + tl.program_id(0).to(tl.int64) * D + cols, tl.sum(dy * n, axis=0), mask=cols < D)


def _launch(N: int, D: int) -> tuple[tuple[int], int]:
    return (triton.cdiv(N, _ROWS),), max(16, triton.next_power_of_2(D))


class _RMSNorm(torch.autograd.Function):
    """Saves the (summed) input and the per-row reciprocal root; the backward makes the rest again."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, use_triton, out_dtype):
        D = x.shape[-1]
        dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
        out_dtype = out_dtype or dtype
        if use_triton:
            x2 = x.reshape(-1, D).contiguous()
            r2 = None if residual is None else residual.reshape(-1, D).contiguous()
            s2 = x2 if residual is None else torch.empty(x2.shape, dtype=dtype, device=x.device)
            y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
            rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
            grid, BD = _launch(x2.shape[0], D)
            _forward_kernel[grid](x2, r2 if r2 is not None else x2, s2, weight, y, rstd, x2.shape[0], D, eps,
                                  HAS_RESIDUAL=residual is not None, BR=_ROWS, BD=BD, num_warps=4)
            s, y = s2.view(x.shape), y.view(x.shape)
        else:
            s = x if residual is None else (x + residual).to(dtype)
            sf = s.float()
            rstd = torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)
            y = (sf * rstd * weight.float()).to(out_dtype)
        ctx.save_for_backward(s, rstd, weight)
        ctx.meta = (use_triton, residual is not None, x.dtype, None if residual is None else residual.dtype)
        if residual is None:
            return y
        return y, s

    @staticmethod
    def backward(ctx, dy, ds_in=None):
        s, rstd, weight = ctx.saved_tensors
        use_triton, has_residual, x_dtype, r_dtype = ctx.meta
        D = s.shape[-1]
        if use_triton:
            s2 = s.reshape(-1, D)
            N = s2.shape[0]
            grid, BD = _launch(N, D)
            ds = torch.empty(s2.shape, dtype=torch.float32, device=s.device)
            dw_part = torch.empty(grid[0], D, dtype=torch.float32, device=s.device)
            dsi = ds_in.reshape(N, D).contiguous() if ds_in is not None else None
            _backward_kernel[grid](s2, weight, rstd, dy.reshape(N, D).contiguous(), dsi if dsi is not None else ds,
                                   ds, dw_part, N, D, HAS_DS_IN=dsi is not None, BR=_ROWS, BD=BD, num_warps=4)
            ds, dw = ds.view(s.shape), dw_part.sum(0)
        else:
            n = s.float() * rstd
            dyf = dy.float()
            dn = dyf * weight.float()
            ds = rstd * (dn - n * (dn * n).mean(-1, keepdim=True))
            if ds_in is not None:
                ds = ds + ds_in.float()
            dw = (dyf * n).reshape(-1, D).sum(0)
        dx = ds.to(x_dtype)
        dr = ds.to(r_dtype) if has_residual else None
        return dx, dr, dw.to(weight.dtype), None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None):
    """``RMSNorm(x) * weight`` over the last dimension; with ``residual``, ``(RMSNorm(x + residual) * weight,
    x + residual)``. Float32 inside; the sum in the (promoted) input dtype, the norm in ``out_dtype`` (default:
    the same)."""
    if weight.shape != x.shape[-1:] or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"rms_norm: x {tuple(x.shape)}, weight {tuple(weight.shape)} and residual "
                         f"{None if residual is None else tuple(residual.shape)} do not match")
    covered = x.dtype != torch.float64 and x.shape[-1] <= 8192 and x.numel() > 0
    use_triton = resolve_backend(x, has_triton_impl=covered) == "triton"
    return _RMSNorm.apply(x, residual, weight, eps, use_triton, out_dtype)
