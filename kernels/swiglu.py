"""The SwiGLU product ``silu(gate) * up``, keeping only its two inputs for the backward.

Left to autograd, ``F.silu(gate) * up`` keeps ``gate``, ``silu(gate)`` and ``up``: three
tensors of the MLP's intermediate width per token. :func:`silu_mul` keeps ``gate`` and
``up`` (which the projections made anyway) and makes ``silu`` again in the backward;
on CUDA one Triton kernel computes each direction. The product itself, which the
down projection keeps as its input, is cheap to make again too: :func:`silu_mul_recipe`
gives the recipe for ``modeling/recompute.py``'s saved-tensor hooks.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.nn import functional as F

from .backend import resolve_backend, tl, triton

__all__ = ["silu_mul", "silu_mul_recipe"]

_BLOCK = 1024


@triton.jit
def _forward_kernel(G, U, P, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    g = tl.load(G + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offsets, mask=mask, other=0.0).to(tl.float32)
    silu = (g * tl.sigmoid(g)).to(P.dtype.element_ty).to(tl.float32)  # rounded as F.silu's output
    tl.store(P + offsets, (silu * u).to(P.dtype.element_ty), mask=mask)


@triton.jit
def _backward_kernel(G, U, DP, DG, DU, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    g = tl.load(G + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offsets, mask=mask, other=0.0).to(tl.float32)
    dp = tl.load(DP + offsets, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = (g * sig).to(DU.dtype.element_ty).to(tl.float32)
    tl.store(DU + offsets, (dp * silu).to(DU.dtype.element_ty), mask=mask)
    dsilu = (dp * u).to(DG.dtype.element_ty).to(tl.float32)  # autograd rounds it before silu's backward
    tl.store(DG + offsets, (dsilu * sig * (1.0 + g * (1.0 - sig))).to(DG.dtype.element_ty), mask=mask)


def _torch_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, use_triton):
        ctx.save_for_backward(gate, up)
        ctx.use_triton = use_triton
        if not use_triton:
            return _torch_forward(gate, up)
        g, u = gate.contiguous(), up.contiguous()
        out = torch.empty_like(g)
        _forward_kernel[(triton.cdiv(g.numel(), _BLOCK),)](g, u, out, g.numel(), BLOCK=_BLOCK, num_warps=4)
        return out

    @staticmethod
    def backward(ctx, dp):
        gate, up = ctx.saved_tensors
        if not ctx.use_triton:
            # The operations autograd would run over F.silu(gate) * up, silu made again.
            silu = F.silu(gate)
            dgate = torch.ops.aten.silu_backward(dp * up, gate)
            return dgate, dp * silu, None
        g, u, d = gate.contiguous(), up.contiguous(), dp.contiguous()
        dgate, dup = torch.empty_like(g), torch.empty_like(u)
        _backward_kernel[(triton.cdiv(g.numel(), _BLOCK),)](g, u, d, dgate, dup, g.numel(), BLOCK=_BLOCK,
                                                             num_warps=4)
        return dgate, dup, None


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, saving only ``gate`` and ``up`` for the backward."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} "
                         "must have one shape and dtype")
    covered = gate.dtype != torch.float64 and gate.numel() > 0
    use_triton = resolve_backend(gate, has_triton_impl=covered) == "triton"
    return _SiluMul.apply(gate, up, use_triton)


def silu_mul_recipe(gate: torch.Tensor, up: torch.Tensor) -> Callable[[int | None, int | None], torch.Tensor]:
    """Rows ``[start, stop)`` of ``silu_mul(gate, up)`` (all of it for ``None``), made again: a recipe for the
    saved-tensor hooks of ``modeling/recompute.py``."""
    def recipe(start: int | None, stop: int | None) -> torch.Tensor:
        with torch.no_grad():
            return silu_mul(gate[start:stop], up[start:stop])
    return recipe
