"""Muon's Newton-Schulz kernels compiled on CUDA at the Atlas 340M layer's shape (64 x 256 momenta)
against the PyTorch path in float64, in float32 (exact and TF32 products) and bf16; skipped without CUDA.

The interpreter (``tests/test_kernels_newton_schulz.py``) checks the algebra; this checks the code
Triton generates (its round trips through memory and barriers among them) on the machine's stack."""

from __future__ import annotations

import pytest
import torch

from mnemo.kernels.backend import use_backend
from mnemo.kernels.chunk_loop import tf32_products
from mnemo.kernels.atlas import _NewtonSchulz, newton_schulz

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def _momenta(n: int, rank: int | None, seed: int) -> torch.Tensor:
    """``n`` matrices of 64 x 256: dense, or of rank ``rank`` plus 10% noise, like a window's momenta (the
    noise keeps the small singular values above rounding: on exactly rank-deficient bf16 matrices both
    paths return rounding noise, relative errors above 1)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    noise = torch.randn(n, 64, 256, generator=gen, device="cuda")
    if rank is None:
        return noise
    low = torch.randn(n, 64, rank, generator=gen, device="cuda") @ torch.randn(n, rank, 256, generator=gen,
                                                                                device="cuda")
    return low + 0.1 * noise * low.std()


def _both(S: torch.Tensor, dN: torch.Tensor, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = S.detach().requires_grad_()
    with use_backend(backend):
        N = newton_schulz(leaf, 5)
    return N.detach().double(), torch.autograd.grad(N, leaf, dN)[0].double()


FP32, TF32, BF16 = (torch.float32, False), (torch.float32, True), (torch.bfloat16, False)


@pytest.mark.parametrize("dtype,tf32,rank", [(*FP32, None), (*FP32, 16), (*TF32, None), (*TF32, 16), (*BF16, None)],
                         ids=["fp32", "fp32-rank16", "tf32", "tf32-rank16", "bf16"])
def test_triton_newton_schulz_on_cuda(dtype, tf32, rank):
    """The kernels' relative error (Frobenius, over 512 matrices) against float64 is within 1.5x the
    PyTorch path's in the same dtype and product precision, output and gradient. Measured on an H100
    (``N`` / ``dS``): TF32 0.23% / 0.39% against 0.41% / 0.72%, bf16 1.9% / 3.2% against 1.8% / 3.4%.
    Low-rank momenta are left out in bf16: there the small singular directions are rounding noise
    and both paths are 77% off or more."""
    S = _momenta(512, rank, 0)
    dN = torch.randn(S.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    leaf = S.double().requires_grad_()
    want_N = _NewtonSchulz.apply(leaf, 5, 1e-7)
    (want_dS,) = torch.autograd.grad(want_N, leaf, dN.double())
    with tf32_products(tf32):
        got = _both(S.to(dtype), dN.to(dtype), "triton")
        ours = _both(S.to(dtype), dN.to(dtype), "torch")
    for label, a, b, want in zip(("N", "dS"), got, ours, (want_N.detach(), want_dS)):
        error, theirs = float((a - want).norm() / want.norm()), float((b - want).norm() / want.norm())
        assert error <= 1.5 * theirs + 1e-6, (label, error, theirs)


def test_triton_newton_schulz_of_tall_views_on_cuda():
    """Atlas' second weight is 256 x 64: the kernels read its transposed view in place."""
    W = _momenta(64, None, 2).transpose(1, 2).contiguous()  # (64, 256, 64)
    with use_backend("triton"):
        got = newton_schulz(W, 5)
    with use_backend("torch"):
        want = newton_schulz(W, 5)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
