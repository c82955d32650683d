"""The fused l2 normalisation and feature map (kernels/normalized_features.py) == its PyTorch lines."""

from __future__ import annotations

import pytest
import torch

from mnemo.kernels import use_backend
from mnemo.kernels.feature_maps import apply_feature_map, initial_coefficients
from mnemo.kernels.norms import l2_normalize
from mnemo.kernels.normalized_features import normalized_features

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [("identity", 0), ("poly_elementwise", 2), ("poly_elementwise", 3)]


def inputs(shape=(3, 37, 2, 40), seed=0, degree=2):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64) * 3
    if x.numel():
        x[0, 0, 0] = 0.0  # a zero vector stays zero, with a finite gradient
    a = initial_coefficients("poly_elementwise", degree).double() + 0.2 * torch.randn(degree, generator=gen,
                                                                                     dtype=torch.float64)
    dy = torch.randn(shape, generator=gen, dtype=torch.float64)
    return x, a, dy


def value_and_grads(x, a, dy, feature_map, backend, reference=False):
    x, a = x.detach().clone().requires_grad_(), a.detach().clone().requires_grad_()
    with use_backend(backend):
        if reference:
            y = apply_feature_map(feature_map, l2_normalize(x.float() if x.dtype != torch.float64 else x), a)
        else:
            y = normalized_features(x, feature_map, a if feature_map != "identity" else None,
                                    dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
    y.backward(dy.to(y.dtype))
    return y.detach(), x.grad, a.grad


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("feature_map,degree", CASES)
def test_float32_value_and_gradients_equal_float64(backend, feature_map, degree):
    if backend == "triton":
        pytest.importorskip("triton")
    x, a, dy = inputs(degree=max(degree, 1))
    y64, dx64, da64 = value_and_grads(x, a, dy, feature_map, "torch", reference=True)
    y, dx, da = value_and_grads(x.float().to(DEVICE), a.float().to(DEVICE), dy.to(DEVICE), feature_map, backend)
    assert y.dtype == dx.dtype == torch.float32
    torch.testing.assert_close(y.cpu().double(), y64, rtol=2e-6, atol=2e-6, msg="y")
    torch.testing.assert_close(dx.cpu().double(), dx64, rtol=2e-5, atol=2e-5, msg="dx")
    if feature_map == "identity":
        assert da is None
    else:  # sums over all 8,880 entries
        torch.testing.assert_close(da.cpu().double(), da64, rtol=2e-5, atol=1e-3, msg="da")


@pytest.mark.parametrize("feature_map,degree", CASES)
def test_bf16_inputs_give_float32_features_and_bf16_gradients(feature_map, degree):
    pytest.importorskip("triton")
    x, a, dy = inputs(shape=(5, 3, 64), seed=2, degree=max(degree, 1))
    x = x.to(torch.bfloat16)
    got = value_and_grads(x.to(DEVICE), a.float().to(DEVICE), dy.to(DEVICE), feature_map, "triton")
    want = value_and_grads(x, a.float(), dy, feature_map, "torch", reference=True)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.bfloat16
    torch.testing.assert_close(got[0].cpu(), want[0], rtol=2e-6, atol=2e-6, msg="y")
    # one bf16 rounding apart (the interpreter truncates where CUDA rounds to nearest)
    torch.testing.assert_close(got[1].cpu().float(), want[1].float(), rtol=2**-6, atol=1e-3, msg="dx")


def test_float64_and_poly_tensor_take_the_pytorch_lines_even_under_triton():
    x, a, dy = inputs(degree=2)
    with use_backend("triton"):
        y = normalized_features(x, "poly_elementwise", a, dtype=torch.float64)
        t = normalized_features(x.float(), "poly_tensor", torch.tensor([1.0, 1.0, 0.5]))
    assert torch.equal(y, apply_feature_map("poly_elementwise", l2_normalize(x), a))
    assert torch.equal(t, apply_feature_map("poly_tensor", l2_normalize(x.float()), torch.tensor([1.0, 1.0, 0.5])))
    assert t.shape[-1] == 1 + 40 + 40 * 41 // 2


def test_missing_coefficients_name_the_problem():
    x, _, _ = inputs()
    with pytest.raises(ValueError, match="coefficients"):
        normalized_features(x, "poly_elementwise", None)
    with pytest.raises(ValueError, match="1-d"):
        normalized_features(x, "poly_elementwise", torch.ones(2, 2))


@pytest.mark.parametrize("feature_map,degree", CASES)
def test_without_gradients_no_autograd_node_and_the_reference_features(feature_map, degree):
    pytest.importorskip("triton")
    x, a, _ = inputs(degree=max(degree, 1))
    coefficients = a.float().to(DEVICE) if feature_map != "identity" else None
    with torch.no_grad(), use_backend("triton"):
        plain = normalized_features(x.float().to(DEVICE), feature_map, coefficients)
    assert plain.grad_fn is None
    want = apply_feature_map(feature_map, l2_normalize(x), a)
    torch.testing.assert_close(plain.cpu().double(), want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("case", ["fp16", "strided", "wide", "coefficients_only", "x_only", "no_rows"])
def test_other_layouts_and_gradient_sets_match_the_reference(case):
    pytest.importorskip("triton")
    shape = (4, 9, 3, 200) if case == "wide" else (0, 3, 40) if case == "no_rows" else (4, 9, 3, 40)
    x, a, dy = inputs(shape=shape, seed=5, degree=3)
    x_dtype = torch.float16 if case == "fp16" else torch.float32
    xs = x.to(x_dtype)
    if case == "strided":  # a transposed view, not contiguous
        xs = xs.transpose(0, 1).contiguous().transpose(0, 1)
    leaves = [xs.detach().clone().to(DEVICE).requires_grad_(case != "coefficients_only"),
              a.float().to(DEVICE).requires_grad_(case != "x_only")]
    assert leaves[0].is_contiguous() == (case != "strided")
    with use_backend("triton"):
        y = normalized_features(leaves[0], "poly_elementwise", leaves[1])
    y.backward(dy.float().to(DEVICE))
    ref = [xs.detach().clone().requires_grad_(case != "coefficients_only"),
           a.float().requires_grad_(case != "x_only")]
    want = apply_feature_map("poly_elementwise", l2_normalize(ref[0].float()), ref[1])
    want.backward(dy.float())
    torch.testing.assert_close(y.detach().cpu(), want.detach(), rtol=1e-5, atol=1e-5)
    for got, expected in zip(leaves, ref):
        assert (got.grad is None) == (expected.grad is None)
        if expected.grad is not None:
            assert got.grad.dtype == expected.grad.dtype
            tol = dict(rtol=2**-9, atol=1e-3) if case == "fp16" else dict(rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(got.grad.cpu().float(), expected.grad.float(), **tol)


def test_a_polynomial_without_coefficients_is_the_reference_zero_map():
    x, _, _ = inputs()
    empty = torch.zeros(0)
    with use_backend("triton"):
        y = normalized_features(x.float(), "poly_elementwise", empty)
    assert torch.equal(y, torch.zeros_like(y))
