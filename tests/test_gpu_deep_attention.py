"""The Hebbian DeepTransformer's whole-row path on CUDA (Triton key-pass kernels, SDPA reads) at
real shapes against the general chunk loop; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from mnemo.kernels.deep_attention import _chunk_torch, chunk_deep_attention

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

B, T, H, D, HID, C = 2, 1024, 4, 64, 64, 64


def _inputs(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    q, k, v = r(B, T, H, D), r(B, T, H, D), r(B, T, H, D)
    eta = torch.rand(B, T, H, generator=gen, device="cuda")
    w1 = r(H, D, HID) * 0.02
    return [x.to(dtype).requires_grad_() for x in (q, k, v)] + [eta.requires_grad_(), w1.requires_grad_()]


def _run(fn, inputs):
    out = fn(inputs)
    grads = torch.autograd.grad(out.float().pow(2).sum(), inputs)
    return out.detach().float(), [g.float() for g in grads]


def _relative(a, b):
    return float((a - b).norm() / b.norm())  # callers pass detached tensors


@pytest.mark.parametrize("clip", [10.0, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_rows_equal_the_chunk_loop(dtype, clip):
    """Outputs and every gradient, relative to their norm: float32 to 1e-5; bf16 inputs (bf16 reads,
    float32 recursion) against the float32 chunk loop to 2e-2."""
    opts = dict(memory_depth=2, learning_rule="hebbian", chunk_size=C, grad_clip=clip)
    inputs = _inputs(dtype)
    got, got_grads = _run(lambda x: chunk_deep_attention(x[0], x[1], x[2], x[3], None, x[4], **opts)[0], inputs)
    exact = [x.detach().float().requires_grad_() for x in inputs]
    want, want_grads = _run(lambda x: _chunk_torch(x[0], x[1], x[2], x[3], None, x[4], None, None, 2, "hebbian", 1,
                                                   C, True, D ** -0.5, clip)[0], exact)
    bound = 1e-5 if dtype == torch.float32 else 2e-2
    errors = {"o": _relative(got, want)}
    errors.update({name: _relative(a, b) for name, a, b in zip("q k v eta w1".split(), got_grads, want_grads)})
    print(dtype, clip, errors)
    assert max(errors.values()) < bound, errors
