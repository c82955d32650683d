"""RMSNorm (+ residual) and the SwiGLU product: the plain expressions' values and gradients, less kept for the backward.

The PyTorch paths give the plain expressions' forward bit for bit and their gradients to float32 rounding
(RMSNorm computes in float32 whatever its inputs, as before);
the Triton kernels (Triton's interpreter on CPU) give the PyTorch path's within the dtype's rounding.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from mnemo.kernels.backend import use_backend
from mnemo.kernels.rms_norm import rms_norm
from mnemo.kernels.swiglu import silu_mul
from mnemo.modeling.mlp import SwiGLU
from mnemo.modeling.normalization import RMSNorm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton tests: compiled kernels on a GPU


def plain_rms_norm(x, weight, eps, residual=None):
    s = x if residual is None else x + residual
    sf = s.float()
    y = (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(s.dtype)
    return y if residual is None else (y, s)


def _outputs_and_grads(fn, inputs, seed=0, device="cpu"):
    inputs = [t.detach().to(device).requires_grad_() for t in inputs]
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(seed)
    loss = sum((o.float() * torch.randn(o.shape, generator=g).to(device)).sum() for o in outs)
    return outs, torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_torch_path_equals_the_plain_expression(residual):
    x, weight, r = torch.randn(3, 5, 24), torch.randn(24), torch.randn(3, 5, 24)
    inputs = [x, weight] + ([r] if residual else [])
    ours = lambda x, w, *r: rms_norm(x, w, 1e-6, *r)  # noqa: E731
    plain = lambda x, w, *r: plain_rms_norm(x, w, 1e-6, *r)  # noqa: E731
    (o1, g1), (o2, g2) = _outputs_and_grads(ours, inputs), _outputs_and_grads(plain, inputs)
    for a, b in zip(o1, o2):
        assert torch.equal(a, b)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_rms_norm_of_a_bf16_branch_on_a_float32_stream():
    x = torch.randn(4, 40, dtype=torch.bfloat16)
    r = torch.randn(4, 40)
    weight = torch.randn(40)
    (y, s), (dx, dw, dr) = _outputs_and_grads(lambda x, w, r: rms_norm(x, w, 1e-6, r), [x, weight, r])
    (py, ps), (pdx, pdw, pdr) = _outputs_and_grads(lambda x, w, r: plain_rms_norm(x, w, 1e-6, r), [x, weight, r])
    assert s.dtype == y.dtype == torch.float32 and dx.dtype == torch.bfloat16 and dr.dtype == torch.float32
    assert torch.equal(y, py) and torch.equal(s, ps)
    torch.testing.assert_close(dr, pdr, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dw, pdw, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_in_autocast_dtype_is_the_cast_of_the_float32_norm(backend, residual):
    """A block's norm under autocast comes out in autocast's dtype: exactly the float32 norm cast, as each
    projection would have cast it; the gradients are those of the float32 norm given the same bf16 gradient."""
    if backend == "triton":
        pytest.importorskip("triton")
    x, weight, r = torch.randn(37, 48), torch.randn(48), torch.randn(37, 48)
    inputs = [x, weight] + ([r] if residual else [])
    with use_backend(backend):
        low, low_grads = _outputs_and_grads(lambda x, w, *r: rms_norm(x, w, 1e-6, *r, out_dtype=torch.bfloat16),
                                            inputs, device=DEVICE)
        high, high_grads = _outputs_and_grads(
            lambda x, w, *r: (lambda y: (y[0].to(torch.bfloat16), y[1]) if r else y.to(torch.bfloat16))(
                rms_norm(x, w, 1e-6, *r)), inputs, device=DEVICE)
    assert low[0].dtype == torch.bfloat16 and (not residual or low[1].dtype == torch.float32)
    for a, b in zip(low, high):
        assert torch.equal(a, b)
    for a, b in zip(low_grads, high_grads):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    norm = RMSNorm(48, autocast_output=True).to(DEVICE)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        assert norm(x.to(DEVICE)).dtype == torch.bfloat16
    assert norm(x.to(DEVICE)).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_triton_equals_torch(dtype, residual):
    pytest.importorskip("triton")
    x = torch.randn(37, 48, dtype=dtype)  # rows not a multiple of the kernel's block; width not a power of 2
    weight = torch.randn(48)
    inputs = [x, weight] + ([torch.randn(37, 48)] if residual else [])
    fn = lambda x, w, *r: rms_norm(x, w, 1e-6, *r)  # noqa: E731
    with use_backend("torch"):
        o1, g1 = _outputs_and_grads(fn, inputs, device=DEVICE)
    with use_backend("triton"):
        o2, g2 = _outputs_and_grads(fn, inputs, device=DEVICE)
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    for a, b in zip(o1 + g1, o2 + g2):
        assert a.dtype == b.dtype
        torch.testing.assert_close(b, a, **tol)


def test_silu_mul_torch_path_is_autograd_bit_for_bit():
    gate, up = torch.randn(6, 33), torch.randn(6, 33)
    o1, g1 = _outputs_and_grads(silu_mul, [gate, up])
    o2, g2 = _outputs_and_grads(lambda g, u: F.silu(g) * u, [gate, up])
    for a, b in zip(o1 + g1, o2 + g2):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_triton_equals_torch(dtype):
    pytest.importorskip("triton")
    gate, up = torch.randn(5, 301, dtype=dtype), torch.randn(5, 301, dtype=dtype)
    with use_backend("torch"):
        o1, g1 = _outputs_and_grads(silu_mul, [gate, up], device=DEVICE)
    with use_backend("triton"):
        o2, g2 = _outputs_and_grads(silu_mul, [gate, up], device=DEVICE)
    tol = {"rtol": 1.6e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
    for a, b in zip(o1 + g1, o2 + g2):
        torch.testing.assert_close(b, a, **tol)


def _saved_elements(fn, *inputs) -> dict[int, int]:
    """Storages kept for the backward by ``fn(*inputs)``: data pointer -> elements (inputs excluded)."""
    kept: dict[int, int] = {}
    own = {t.untyped_storage().data_ptr() for t in inputs}

    def pack(t):
        if t.untyped_storage().data_ptr() not in own:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() // t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return kept


def test_swiglu_keeps_only_gate_and_up_and_equals_the_plain_block():
    torch.manual_seed(0)
    mlp = SwiGLU(16, 40)
    x = torch.randn(2, 7, 16, requires_grad=True)
    wide = [n for n in _saved_elements(mlp, x).values() if n >= 2 * 7 * 40]
    assert len(wide) == 2, wide  # gate and up; silu(gate) and the product are made again
    plain = lambda x: mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))  # noqa: E731
    o1, g1 = _outputs_and_grads(mlp, [x])
    o2, g2 = _outputs_and_grads(plain, [x])
    assert torch.equal(o1[0], o2[0])
    torch.testing.assert_close(g1[0], g2[0], rtol=1e-6, atol=1e-7)
    params = list(mlp.parameters())
    grads = [torch.autograd.grad(f(x).square().sum(), params) for f in (mlp, plain)]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_rms_norm_keeps_its_input_and_one_number_per_row():
    norm = RMSNorm(32)
    x = torch.randn(4, 9, 32, requires_grad=True)
    kept = _saved_elements(lambda x, _: norm(x), x, norm.weight)
    assert sorted(kept.values()) == [4 * 9], kept  # beside its input and weight: the reciprocal roots
