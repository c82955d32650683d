"""The hand-written chunk of a deep memory against autograd over ChunkOperator (float64, every gradient)."""

from __future__ import annotations

import pytest
import torch

from mnemo.kernels.titans import ChunkOperator, TitansMemorySpec, grad_factors, memory_apply
from mnemo.kernels.titans_chunk import chunk_memory, supported

B, H, C, K = 2, 3, 5, 7

SPECS = {
    "linear_l2": TitansMemorySpec(depth=1, d_k=4, d_v=4),
    "linear_dot": TitansMemorySpec(depth=1, d_k=4, d_v=3, objective="dot"),
    "mlp_l2": TitansMemorySpec(depth=2, d_k=4, d_v=4, expansion=2),
    "mlp_dot": TitansMemorySpec(depth=2, d_k=4, d_v=4, expansion=2, objective="dot"),
    "mlp_skip_l2": TitansMemorySpec(depth=2, d_k=5, d_v=3, expansion=2),
}


def problem(spec, momentum, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=gen, dtype=torch.float64) * scale).requires_grad_()  # noqa: E731
    W = {n: r(B, H, *s, scale=0.5) for n, s in spec.shapes.items()}
    S = {n: r(B, H, *s, scale=0.1) for n, s in spec.shapes.items()} if momentum else None
    q, k, v = r(B, H, C, spec.d_k), r(B, H, K, spec.d_k), r(B, H, K, spec.d_v)
    a, b, sa = r(B, H, C), r(B, H, C), r(B, H, C)
    c, sc = r(B, H, C, K), r(B, H, C, K)
    return W, S, q, k, v, a, b, c, sa, sc


def by_operator(spec, W, S, q, k, v, a, b, c, sa, sc):
    """The readable definition: ChunkOperator with the given coefficients, under autograd."""
    op = ChunkOperator.__new__(ChunkOperator)
    op.a, op.b, op.c, op.sa, op.sc = a, b, c, sa, sc
    op.W0, op.S0, op.factors = W, S, grad_factors(spec, W, k, v)
    y = memory_apply(spec, op, q)
    W_new, S_new = op.final()
    return y, W_new, (S_new if S is not None else None)


def flat(y, W_new, S_new, names):
    return [y] + [W_new[n] for n in names] + ([S_new[n] for n in names] if S_new is not None else [])


@pytest.mark.parametrize("momentum", [True, False], ids=["momentum", "plain"])
@pytest.mark.parametrize("name", list(SPECS))
def test_values_and_every_gradient_equal_autograd_over_the_operator(name, momentum):
    spec = SPECS[name]
    W, S, q, k, v, a, b, c, sa, sc = problem(spec, momentum)
    names = list(spec.shapes)
    leaves = list(W.values()) + (list(S.values()) if momentum else []) + [q, k, v, a, c]
    if momentum:
        leaves += [b, sa, sc]
    want = flat(*by_operator(spec, W, S, q, k, v, a, b, c, sa, sc), names)
    got = flat(*chunk_memory(spec, W, S, q, k, v, a, b, c, sa[..., -1], sc[..., -1, :]), names)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    gen = torch.Generator().manual_seed(1)
    cotangents = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in want]
    g_want = torch.autograd.grad(want, leaves, cotangents, allow_unused=True)
    g_got = torch.autograd.grad(got, leaves, cotangents, allow_unused=True)
    for i, (x, y) in enumerate(zip(g_got, g_want)):
        y = torch.zeros_like(leaves[i]) if y is None else y
        x = torch.zeros_like(leaves[i]) if x is None else x
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10, msg=lambda m: f"gradient of leaf {i}: {m}")


def test_gradcheck_of_the_mlp_chunk():
    spec = SPECS["mlp_skip_l2"]
    W, S, q, k, v, a, b, c, sa, sc = problem(spec, True, seed=3)
    names = list(spec.shapes)

    def fn(*t):
        W_ = dict(zip(names, t[:3]))
        S_ = dict(zip(names, t[3:6]))
        return tuple(flat(*chunk_memory(spec, W_, S_, *t[6:]), names))

    inputs = [*W.values(), *S.values(), q, k, v, a, b, c, sa[..., -1].detach().requires_grad_(),
              sc[..., -1, :].detach().requires_grad_()]
    assert torch.autograd.gradcheck(fn, inputs)


def test_uncovered_memories_are_refused_by_name():
    gated = TitansMemorySpec(depth=2, gated=True, d_k=4, d_v=4)
    clipped = TitansMemorySpec(depth=2, d_k=4, d_v=4, grad_clip=1.0)
    assert not supported(gated) and not supported(clipped)
    W, S, q, k, v, a, b, c, sa, sc = problem(SPECS["mlp_l2"], True)
    with pytest.raises(ValueError, match="ChunkOperator"):
        chunk_memory(gated, W, S, q, k, v, a, b, c, sa[..., -1], sc[..., -1, :])
