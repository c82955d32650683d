"""The fused gated RMSNorm (kernels/gated_rms_norm.py) == its PyTorch line, values and gradients."""

from __future__ import annotations

import pytest
import torch

from mnemo.kernels import use_backend
from mnemo.kernels.gated_rms_norm import gated_rms_norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(shape=(3, 7, 2, 40), seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64) * 3
    gate = torch.randn(*shape, generator=gen, dtype=torch.float64) * 2
    weight = 1 + 0.3 * torch.randn(shape[-1], generator=gen, dtype=torch.float64)
    return x, gate, weight


def value_and_grads(x, gate, weight, dy, backend):
    leaves = [t.detach().clone().requires_grad_() for t in (x, gate, weight)]
    with use_backend(backend):
        y = gated_rms_norm(*leaves, eps=1e-5)
    y.backward(dy.to(y.dtype))
    return [y.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_float32_value_and_gradients_equal_float64(backend):
    if backend == "triton":
        pytest.importorskip("triton")
    x, gate, weight = inputs()
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    expected = value_and_grads(x, gate, weight, dy, "torch")
    got = value_and_grads(*(t.float().to(DEVICE) for t in (x, gate, weight)), dy.to(DEVICE), backend)
    for name, a, b in zip(("y", "dx", "dgate", "dweight"), got, expected):
        assert a.dtype == torch.float32, name
        torch.testing.assert_close(a.cpu().double(), b, rtol=2e-5, atol=2e-5, msg=name)


def test_bf16_inputs_give_bf16_outputs_on_both_paths_within_rounding():
    pytest.importorskip("triton")
    x, gate, weight = inputs(shape=(5, 3, 64), seed=2)
    x, gate = x.to(torch.bfloat16), gate.to(torch.bfloat16)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    a = value_and_grads(x.to(DEVICE), gate.to(DEVICE), weight.float().to(DEVICE), dy.to(DEVICE), "triton")
    b = value_and_grads(x, gate, weight.float(), dy, "torch")
    for name, p, q in zip(("y", "dx", "dgate", "dweight"), a, b):
        assert p.dtype == q.dtype, name
        # one bf16 rounding apart (the interpreter truncates where CUDA rounds to nearest)
        torch.testing.assert_close(p.cpu().float(), q.float(), rtol=2**-6, atol=1e-3, msg=name)


def test_mismatched_shapes_name_the_problem():
    x, gate, weight = inputs()
    with pytest.raises(ValueError, match="gate"):
        gated_rms_norm(x, gate[..., :-1], weight, 1e-5)
