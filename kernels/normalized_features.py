"""Queries' and keys' features: the l2 normalisation and the feature map, in one kernel each way.

Over the last dimension (one head)::

    u = x / sqrt(|x|^2 + eps),    y = phi(u),    phi = identity  or  sum_{i=1..p} a_i u^i

(``poly_elementwise``, docs/semantics.md), computed in float32 and returned in ``dtype``.
The PyTorch path is :func:`~.norms.l2_normalize` then :func:`~.feature_maps.apply_feature_map`,
which stay the readable form and the test's reference. On CUDA one Triton kernel computes ``y``
and one its backward (``dx`` and per-block partial sums of ``da``, added in PyTorch: no
atomics), where the PyTorch path runs about ten element-wise kernels forward and twenty backward
over the layer's queries and keys in float32, each a round trip through memory. ``poly_tensor``,
which widens the features, float64, widths over 4096 and a polynomial without coefficients stay on
the PyTorch path, also under ``use_backend("triton")``.
The backward is not itself differentiable (no second derivatives).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .backend import resolve_backend, tl, triton
from .feature_maps import apply_feature_map
from .norms import L2_EPS, l2_normalize


__all__ = ["normalized_features"]

_ROWS = 16  # rows per program
_FUSED_MAPS = ("identity", "poly_elementwise")


def _torch_path(x: torch.Tensor, feature_map: str, coefficients: torch.Tensor | None, dtype: torch.dtype):
    a = coefficients if coefficients is not None else torch.zeros(0)
    return apply_feature_map(feature_map, l2_normalize(x.to(dtype)), a)


@triton.jit
def _tile(X, rows, cols, N, D, eps):
    """The rows' tile of ``x`` in float32, its offsets and mask, ``1 / sqrt(|x|^2 + eps)`` and ``u``."""
    mask = (rows[:, None] < N) & (cols[None, :] < D)
    offsets = rows.to(tl.int64)[:, None] * D + cols[None, :]
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) + eps)
    return offsets, mask, r, x * r[:, None]

@triton.jit
def _forward_kernel(X, A, Y, N, D, eps, DEG: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    """``y = sum_i a_i u^i`` (``u`` for ``DEG = 0``), the powers summed in the reference's order."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    offsets, mask, r, u = _tile(X, rows, tl.arange(0, BD), N, D, eps)
    if DEG == 0:
        y = u
    else:
        power = u
        y = tl.load(A) * u
        for i in tl.static_range(1, DEG):
            power = power * u
            y += tl.load(A + i) * power
    tl.store(Y + offsets, y, mask=mask)

@triton.jit
def _backward_kernel(X, A, DY, DX, DA_PART, N, D, eps, DEG: tl.constexpr, BR: tl.constexpr,
                     BD: tl.constexpr):
    """``du = dy phi'(u)``, ``dx = r (du - u <du, u>)`` and this block's ``sum(dy u^i)`` for ``da_i``."""
    pid = tl.program_id(0)
    rows = pid * BR + tl.arange(0, BR)
    offsets, mask, r, u = _tile(X, rows, tl.arange(0, BD), N, D, eps)
    dy = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
    if DEG == 0:
        du = dy
    else:
        slope = tl.zeros_like(u) + tl.load(A)  # phi'(u) = sum_i i a_i u^(i-1)
        power = u
        tl.store(DA_PART + pid.to(tl.int64) * DEG, tl.sum(tl.sum(dy * power, axis=1), axis=0))
        for i in tl.static_range(1, DEG):
            slope += (i + 1) * tl.load(A + i) * power
            power = power * u
            tl.store(DA_PART + pid.to(tl.int64) * DEG + i, tl.sum(tl.sum(dy * power, axis=1), axis=0))
        du = dy * slope
    dx = r[:, None] * (du - u * tl.sum(du * u, axis=1)[:, None])
    tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=mask)


def _launch(N: int, D: int) -> tuple[tuple[int], int]:
    return (triton.cdiv(N, _ROWS),), max(16, triton.next_power_of_2(D))


def _forward(x: torch.Tensor, coefficients: torch.Tensor, deg: int):
    """The features ``y`` (float32, ``x``'s shape) and the operands the backward takes (coefficients
    ``None`` for the identity map)."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D).contiguous()
    y = torch.empty(x2.shape, dtype=torch.float32, device=x.device)
    a = coefficients.detach().to(x.device, torch.float32).contiguous() if deg else None
    grid, BD = _launch(x2.shape[0], D)
    # The identity map never reads A: any float32 tensor fills the slot, with no allocation (a launch) per call.
    _forward_kernel[grid](x2, y if a is None else a, y, x2.shape[0], D, L2_EPS, DEG=deg, BR=_ROWS, BD=BD,
                          num_warps=4)
    return y.view(x.shape), x2, a


class _NormalizedFeatures(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, coefficients, deg):
        y, x2, a = _forward(x, coefficients, deg)
        ctx.save_for_backward(x2, a)
        ctx.deg, ctx.coefficients_dtype = deg, coefficients.dtype if deg else None
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x2, a = ctx.saved_tensors
        N, D = x2.shape
        grid, BD = _launch(N, D)
        dx = torch.empty_like(x2)
        da_part = torch.empty(grid[0], max(ctx.deg, 1), dtype=torch.float32, device=x2.device)
        A = da_part if a is None else a  # the identity map's slot, never read
        _backward_kernel[grid](x2, A, dy.reshape(N, D).contiguous(), dx, da_part, N, D, L2_EPS, DEG=ctx.deg,
                               BR=_ROWS, BD=BD, num_warps=4)
        da = da_part.sum(0).to(ctx.coefficients_dtype) if ctx.deg else None
        return dx.view(dy.shape), da, None


def normalized_features(x: torch.Tensor, feature_map: str = "identity", coefficients: torch.Tensor | None = None,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``apply_feature_map(feature_map, l2_normalize(x.to(dtype)), coefficients)`` over the last dimension:
    one fused kernel each way on CUDA for ``identity`` and ``poly_elementwise`` in float32."""
    if feature_map == "poly_elementwise" and (coefficients is None or coefficients.dim() != 1):
        raise ValueError("normalized_features: poly_elementwise takes its coefficients a_1..a_p as a 1-d tensor, "
                         f"got {None if coefficients is None else tuple(coefficients.shape)}")
    covered = (feature_map in _FUSED_MAPS and dtype == torch.float32
               and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and x.shape[-1] <= 4096
               and (feature_map == "identity" or coefficients.numel() > 0))
    # Uncovered cases take the PyTorch path even when Triton is asked for: the memory kernels around this
    # step (which honour the request) take float64 and every feature map.
    if covered and resolve_backend(x, has_triton_impl=True) == "triton" and x.numel() > 0:
        deg = coefficients.numel() if feature_map == "poly_elementwise" else 0
        a = coefficients if deg else x.new_zeros(0)
        if torch.is_grad_enabled() and (x.requires_grad or a.requires_grad):
            return _NormalizedFeatures.apply(x, a, deg)
        return _forward(x, a, deg)[0]  # decoding: no autograd node to build
    return _torch_path(x, feature_map, coefficients, dtype)
