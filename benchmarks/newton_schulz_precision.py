"""How far Muon's Newton-Schulz lands from float64 at the products' precisions, on the CPU.

Atlas runs Newton-Schulz on the Gram matrix of each momentum (:func:`mnemo.kernels.atlas.newton_schulz`):
the iteration works on ``r x r`` matrices ``M_k`` with ``X_k = M_k X_0``. On CUDA, for bf16/fp16 models, its
products take TF32 operands rounded to nearest (the Triton kernels' ``_rnd``). This script emulates exactly
that rounding on the CPU and compares, for 64 x 256 momenta of three kinds (Gaussian; rank 8 plus 10% and
1% Gaussian noise, whose small singular values the iteration must lift by two to three orders of
magnitude):

- the Gram form with TF32 products, and in float32, against the float64 Gram form;
- Muon's own iteration on the long side (``X <- a X + (b A + c A^2) X``, ``A = X X^T``) in bf16, as Muon's
  reference implementation runs it, against the same;
- each of them, and float64 Newton-Schulz itself, against the exact polar factor ``U V^T``.

Prints a table. Run: ``python benchmarks/newton_schulz_precision.py [--matrices 256]``.
"""

from __future__ import annotations

import argparse

import torch

from mnemo.kernels.atlas import NS_COEFFICIENTS, newton_schulz


def to_tf32(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to nearest on TF32's 10 mantissa bits (float32 storage), as the kernels round operands."""
    bits = x.float().view(torch.int32)
    return ((bits + 4096) & -8192).view(torch.float32)


def gram_form_tf32(S: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """The Gram form of the iteration with every product's operands and every iterate rounded to TF32."""
    a, b, c = NS_COEFFICIENTS

    def mm(x, y):
        return torch.bmm(to_tf32(x), to_tf32(y))

    X0 = S.float() / (S.float().norm(dim=(-2, -1), keepdim=True) + eps)
    G = to_tf32(mm(X0, X0.transpose(1, 2)))
    M = b * G + c * mm(G, G)
    M.diagonal(dim1=-2, dim2=-1).add_(a)
    M = to_tf32(M)
    for _ in range(steps - 1):
        A = to_tf32(mm(M, to_tf32(mm(G, M.transpose(1, 2)))))
        M = to_tf32(a * M + mm(to_tf32(b * A + c * mm(A, A)), M))
    return mm(M, X0)


def long_side_bf16(S: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Muon's reference iteration on the long side, in bf16."""
    a, b, c = NS_COEFFICIENTS
    X = S.to(torch.bfloat16)
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        A = X @ X.transpose(-1, -2)
        X = a * X + (b * A + c * A @ A) @ X
    return X


def relative(x: torch.Tensor, reference: torch.Tensor) -> float:
    return float((x.double() - reference).norm() / reference.norm())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--matrices", type=int, default=256, help="momenta of each kind (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    g = torch.Generator().manual_seed(args.seed)
    n = args.matrices
    noise = torch.randn(n, 64, 256, generator=g, dtype=torch.float64)
    low_rank = torch.randn(n, 64, 8, generator=g, dtype=torch.float64) @ torch.randn(n, 8, 256, generator=g,
                                                                                     dtype=torch.float64)
    kinds = {"Gaussian": noise, "rank 8 + 10% noise": low_rank + 0.1 * noise, "rank 8 + 1% noise": low_rank + 0.01 * noise}
    print("| momenta (64 x 256) | Gram form, TF32 | Gram form, float32 | Muon's iteration, bf16 "
          "| against the polar factor: float64 NS / Gram TF32 / Muon bf16 |")
    print("|---|---|---|---|---|")
    for name, S in kinds.items():
        exact = newton_schulz(S, 5)
        U, _, Vh = torch.linalg.svd(S, full_matrices=False)
        polar = U @ Vh
        tf32, bf16 = gram_form_tf32(S), long_side_bf16(S)
        print(f"| {name} | {relative(tf32, exact):.2e} | {relative(newton_schulz(S.float(), 5), exact):.2e} "
              f"| {relative(bf16, exact):.2e} | {relative(exact, polar):.2f} / {relative(tf32, polar):.2f} / "
              f"{relative(bf16, polar):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
