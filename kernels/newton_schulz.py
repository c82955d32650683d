"""Muon's Newton-Schulz orthogonalisation of per-token momenta (FAMILIES.md §3): the PyTorch path,
its written-out backward, and the switch to the Triton kernels (:mod:`.newton_schulz_triton`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .backend import requested_backend, resolve_backend

__all__ = ["NS_COEFFICIENTS", "newton_schulz", "newton_schulz_together", "triton_wanted", "wide"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(G: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Quintic Newton-Schulz orthogonalisation of the last two dims (KellerJordan/Muon).

    The input is normalised by its Frobenius norm; tall matrices are transposed so
    that the iteration runs on the smaller Gram matrix. The iteration
    ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` keeps ``X_k = M_k X_0`` for an
    ``r x r`` matrix ``M_k`` (``r`` the short side): ``A_k = M_k G M_k^T`` with the Gram
    matrix ``G = X_0 X_0^T`` and ``M_{k+1} = a M_k + (b A_k + c A_k^2) M_k``. So it runs on
    ``r x r`` matrices from one Gram product, and the long side is touched twice (the Gram
    matrix and ``M X_0``), not three times an iteration: Muon runs this per token and
    weight matrix, where those passes were most of its time. The backward is written out
    (:class:`_NewtonSchulz`): autograd over the same products took four times the forward.
    On CUDA, matrices whose short side is at most 64 run one Triton program each, forward
    and backward (:mod:`.newton_schulz_triton`), unless the products are exact float32.
    """
    tall = G.shape[-2] > G.shape[-1]
    X = G.transpose(-1, -2) if tall else G
    if steps == 0:
        X = X / (X.norm(dim=(-2, -1), keepdim=True) + eps)
    else:
        shape = X.shape
        flat = X.reshape(-1, *shape[-2:])
        iteration = _NewtonSchulzTriton if triton_wanted(flat) else _NewtonSchulz
        X = iteration.apply(flat, steps, eps).reshape(shape)
    return X.transpose(-1, -2) if tall else X


def wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its last two dims ordered short side first (tall matrices transposed, as a view)."""
    return x.transpose(-1, -2) if x.shape[-2] > x.shape[-1] else x


def triton_wanted(X: torch.Tensor) -> bool:
    """Whether ``(..., r, L)`` matrices (``r <= L``) take the Triton kernels: the backend switch, and their limits."""
    try:
        from .newton_schulz_triton import faster, supported  # noqa: PLC0415  (Triton may be absent)
    except ImportError:
        return resolve_backend(X, has_triton_impl=False) == "triton"
    if resolve_backend(X, has_triton_impl=supported(X)) != "triton":
        return False
    return requested_backend() == "triton" or faster(X.dtype)


class _NewtonSchulz(torch.autograd.Function):
    """:func:`newton_schulz` on ``(n, r, L)`` matrices (``r <= L``), ``steps >= 1``, in their own dtype:
    autocast stays out, as for the memories' other products (TF32 where the caller allows it)."""

    @staticmethod
    def forward(ctx, S: torch.Tensor, steps: int, eps: float) -> torch.Tensor:
        with torch.autocast(S.device.type, enabled=False):
            return _NewtonSchulz._forward(ctx, S, steps, eps)

    @staticmethod
    def _forward(ctx, S: torch.Tensor, steps: int, eps: float) -> torch.Tensor:
        a, b, c = NS_COEFFICIENTS
        norm = S.norm(dim=(-2, -1), keepdim=True)
        X0 = S / (norm + eps)
        gram = torch.bmm(X0, X0.transpose(1, 2))
        M = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # the first step, M_0 = I: b G + c G^2, then + a I
        M.diagonal(dim1=-2, dim2=-1).add_(a)
        Ms, As, Ps = [M], [], []
        for _ in range(steps - 1):
            A = torch.bmm(M, torch.bmm(gram, M.transpose(1, 2)))
            P = torch.baddbmm(A, A, A, beta=b, alpha=c)
            M = torch.baddbmm(M, P, M, beta=a)
            Ms.append(M)
            As.append(A)
            Ps.append(P)
        ctx.save_for_backward(X0, norm, gram, *Ms, *As, *Ps)
        ctx.steps, ctx.eps = steps, eps
        return torch.bmm(M, X0)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dN: torch.Tensor):
        with torch.autocast(dN.device.type, enabled=False):
            return _NewtonSchulz._backward(ctx, dN)

    @staticmethod
    def _backward(ctx, dN: torch.Tensor):
        a, b, c = NS_COEFFICIENTS
        steps = ctx.steps
        X0, norm, gram, *rest = ctx.saved_tensors
        dN = dN.to(X0.dtype)
        Ms, As, Ps = rest[:steps], rest[steps:2 * steps - 1], rest[2 * steps - 1:]
        dM = torch.bmm(dN, X0.transpose(1, 2))
        dG = torch.zeros_like(gram)
        # A_k and P_k are symmetric (polynomials of G conjugated by M_k, which commutes with G).
        for k in range(steps - 2, -1, -1):
            M, A, P = Ms[k], As[k], Ps[k]
            dP = torch.bmm(dM, M.transpose(1, 2))
            dM = torch.baddbmm(dM, P, dM, beta=a)
            dA = torch.baddbmm(torch.baddbmm(dP, dP, A, beta=b, alpha=c), A, dP, alpha=c)
            dA_sym = dA + dA.transpose(1, 2)
            dM = torch.baddbmm(dM, dA_sym, torch.bmm(M, gram))
            dG = torch.baddbmm(dG, M.transpose(1, 2), torch.bmm(dA, M))
        # M_1 = a I + b G + c G^2
        dG = dG + b * dM + c * (torch.bmm(dM, gram) + torch.bmm(gram, dM))
        dX0 = torch.baddbmm(torch.bmm(Ms[-1].transpose(1, 2), dN), dG + dG.transpose(1, 2), X0)
        # X0 = S / (||S|| + eps): dS = (dX0 - (d / ||S||) <dX0, X0> X0) / d, d = ||S|| + eps
        d = norm + ctx.eps
        along = (dX0 * X0).sum((-2, -1), keepdim=True) * d / norm.clamp(min=torch.finfo(norm.dtype).tiny)
        return (dX0 - along * X0) / d, None, None


def newton_schulz_together(matrices: Sequence[torch.Tensor], steps: int = 5) -> list[torch.Tensor]:
    """:func:`newton_schulz` of each matrix, those of one shape (after tall ones are transposed) in one call:
    a decode step orthogonalises two small momenta per head, and each PyTorch call is some twenty
    launches (the Triton kernel is one, and takes each matrix as it is)."""
    groups: dict[tuple, list[int]] = {}
    for i, x in enumerate(matrices):
        groups.setdefault((wide(x).shape, x.dtype), []).append(i)
    out: list[torch.Tensor] = [None] * len(matrices)  # type: ignore[list-item]
    for members in groups.values():
        # The Triton kernels read strided views: a launch per matrix beats stacking them first.
        if len(members) == 1 or triton_wanted(wide(matrices[members[0]])):
            for i in members:
                out[i] = newton_schulz(matrices[i], steps)
            continue
        stacked = torch.stack([wide(matrices[i]) for i in members])
        for i, x in zip(members, newton_schulz(stacked, steps).unbind(0)):
            out[i] = x.transpose(-1, -2) if x.shape != matrices[i].shape else x
    return out


class _NewtonSchulzTriton(torch.autograd.Function):
    """:class:`_NewtonSchulz` through the Triton kernels; the products' precision is fixed at the forward."""

    @staticmethod
    def forward(ctx, S: torch.Tensor, steps: int, eps: float) -> torch.Tensor:
        from .newton_schulz_triton import newton_schulz_forward_triton, products  # noqa: PLC0415

        ctx.products = products(S.dtype)
        N, norms, kept = newton_schulz_forward_triton(S, steps, eps, ctx.products, keep=ctx.needs_input_grad[0])
        ctx.save_for_backward(S, norms, kept)
        ctx.steps, ctx.eps = steps, eps
        return N

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dN: torch.Tensor):
        from .newton_schulz_triton import newton_schulz_backward_triton  # noqa: PLC0415

        S, norms, kept = ctx.saved_tensors
        return newton_schulz_backward_triton(S, norms, kept, dN, ctx.steps, ctx.eps, ctx.products), None, None
