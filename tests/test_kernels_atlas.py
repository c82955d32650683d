"""Atlas memory: reference == chunked == step, Newton-Schulz, and its limits (Titans, linear attention)."""

from __future__ import annotations

import itertools

import pytest
import torch

from mnemo.kernels.atlas import (
    NS_COEFFICIENTS,
    AtlasState,
    chunk_atlas,
    newton_schulz,
    newton_schulz_together,
    reference_atlas,
    step_atlas,
)
from mnemo.kernels.feature_maps import apply_feature_map, initial_coefficients
from mnemo.kernels.mlp_memory import MLPMemorySpec
from mnemo.kernels.titans import TitansState, chunk_titans

B, T, H, DV = 3, 19, 2, 4
TAKES = [torch.tensor([3, 2, 6]), torch.tensor([1, 1, 0]), torch.tensor([9, 4, 1]), torch.tensor([6, 0, 5])]
LENGTHS = torch.stack(TAKES).sum(0)
MEMORIES = {
    "linear": dict(depth=1, d_k=5),
    "mlp": dict(depth=2, d_k=DV),
    "gated-dot": dict(depth=2, gated=True, d_k=DV, objective="dot"),
    "mlp-linear-skip": dict(depth=2, d_k=6),
}


def next_tokens(x, consumed, take):
    """Each row's next ``take`` tokens after the ``consumed`` ones, moved to the front (``None`` stays ``None``)."""
    if x is None:
        return None
    width = int(take.max())
    idx = (consumed[:, None] + torch.arange(width)[None]).clamp(max=x.shape[1] - 1)
    return x.gather(1, idx.view(B, width, *([1] * (x.dim() - 2))).expand(B, width, *x.shape[2:]))


def inputs(spec, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    init = {n: torch.randn(H, *s, generator=gen, dtype=dtype) * 0.5 for n, s in spec.shapes.items()}
    q, k = (torch.randn(B, T, H, spec.d_k, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(B, T, H, spec.d_v, generator=gen, dtype=dtype)
    alpha = torch.rand(B, T, H, generator=gen, dtype=dtype) * 0.5 + 0.5
    lr = torch.rand(B, T, H, generator=gen, dtype=dtype) * 0.02
    momentum = torch.rand(B, T, H, generator=gen, dtype=dtype) * 0.5
    gamma = torch.rand(B, T, H, generator=gen, dtype=dtype)
    return init, (q, k, v, alpha, lr, momentum, gamma)


@pytest.mark.parametrize("memory, optimizer, window, chunk", list(itertools.product(
    sorted(MEMORIES), ["gd", "momentum", "muon"], [1, 3, 7], [1, 4])))
def test_reference_chunk_step_agree(memory, optimizer, window, chunk):
    spec = MLPMemorySpec(d_v=DV, expansion=2, **MEMORIES[memory])
    init, xs = inputs(spec)
    if optimizer == "gd":
        xs = xs[:5] + (None,) + xs[6:]
    opts = dict(optimizer=optimizer, omega_window=window, chunk_size=chunk, ns_steps=3)
    ref = reference_atlas(spec, *xs, init, **opts)
    out, _ = chunk_atlas(spec, *xs, AtlasState.initial(spec, init, B, H, window, optimizer), **opts)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    state, steps = AtlasState.initial(spec, init, B, H, window, optimizer), []
    for t in range(T):
        o, state = step_atlas(spec, *(None if x is None else x[:, t] for x in xs), state, **opts)
        steps.append(o)
    torch.testing.assert_close(torch.stack(steps, 1), ref, rtol=0, atol=1e-10)
    ref = reference_atlas(spec, *xs, init, lengths=LENGTHS, **opts)
    state, consumed = AtlasState.initial(spec, init, B, H, window, optimizer), torch.zeros(B, dtype=torch.long)
    for take in TAKES:
        o, state = chunk_atlas(spec, *(next_tokens(x, consumed, take) for x in xs), state, lengths=take, **opts)
        for b in range(B):
            n, s = int(take[b]), int(consumed[b])
            torch.testing.assert_close(o[b, :n], ref[b, s:s + n], rtol=0, atol=1e-10)
        consumed += take


@pytest.mark.parametrize("shape", [(8, 8), (6, 16), (16, 6), (3, 5, 32, 12)])
def test_newton_schulz_pulls_singular_values_towards_one(shape):
    """NS_5(G) = U f(S) V^T: same singular vectors; singular values that are not tiny against
    ||G||_F land in roughly [0.7, 1.2] (the quintic's known band), tiny ones only grow."""
    G = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    X = newton_schulz(G, steps=5)
    U, S, Vh = torch.linalg.svd(G, full_matrices=False)
    inner = U.transpose(-1, -2) @ X @ Vh.transpose(-1, -2)  # X in G's singular bases
    f = torch.diagonal(inner, dim1=-2, dim2=-1)
    assert (inner - torch.diag_embed(f)).abs().max() < 1e-8, "Newton-Schulz keeps the singular vectors"
    relative = S / torch.linalg.matrix_norm(G)[..., None]
    band = f[relative > 0.05]
    assert band.min() > 0.65 and band.max() < 1.2, (band.min(), band.max())
    assert (f > 0).all() and (f < 1.2).all() and (f >= relative - 1e-12).all()
    small = newton_schulz(G, steps=0)
    torch.testing.assert_close(small, G / (G.norm(dim=(-2, -1), keepdim=True) + 1e-7), rtol=0, atol=1e-12)


def _newton_schulz_iteration(G, steps):
    """The iteration as Muon writes it, on the matrices themselves."""
    a, b, c = NS_COEFFICIENTS
    tall = G.shape[-2] > G.shape[-1]
    X = G.transpose(-1, -2) if tall else G
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.transpose(-1, -2)
        X = a * X + (b * A + c * A @ A) @ X
    return X.transpose(-1, -2) if tall else X


@pytest.mark.parametrize("shape", [(8, 8), (6, 16), (16, 6), (3, 5, 32, 12)])
@pytest.mark.parametrize("steps", [1, 2, 5])
def test_newton_schulz_on_the_gram_matrix_equals_the_iteration(shape, steps):
    G = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(steps))
    G[..., 0, :] *= 1e-3  # a small singular value, which the Gram matrix squares
    torch.testing.assert_close(newton_schulz(G, steps), _newton_schulz_iteration(G, steps), rtol=0, atol=1e-12)
    G64 = G.clone().requires_grad_()
    probe = torch.randn_like(G)
    (grad,) = torch.autograd.grad((newton_schulz(G64, steps) * probe).sum(), G64)
    (want,) = torch.autograd.grad((_newton_schulz_iteration(G64, steps) * probe).sum(), G64)
    torch.testing.assert_close(grad, want, rtol=0, atol=1e-10)
    G32 = G.float().requires_grad_()
    torch.testing.assert_close(newton_schulz(G32, steps), _newton_schulz_iteration(G.float(), steps),
                               rtol=0, atol=2e-5)
    newton_schulz(G32, steps).sum().backward()
    G64 = G.clone().requires_grad_()
    _newton_schulz_iteration(G64, steps).sum().backward()
    torch.testing.assert_close(G32.grad.double(), G64.grad, rtol=1e-3, atol=1e-3)


def test_newton_schulz_keeps_its_dtype_under_autocast():
    """The memory's products stay in its own precision: a bf16 autocast region neither lowers the
    iteration nor breaks its backward when a bf16 gradient comes in."""
    G = torch.randn(3, 16, 40, generator=torch.Generator().manual_seed(2), requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = newton_schulz(G, 5)
        (y.to(torch.bfloat16) * 2).float().sum().backward()
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, newton_schulz(G.detach(), 5), rtol=0, atol=0)
    assert G.grad.dtype == torch.float32 and torch.isfinite(G.grad).all()


def test_newton_schulz_together_equals_one_call_per_matrix():
    gen = torch.Generator().manual_seed(4)
    mats = [torch.randn(*shape, dtype=torch.float64, generator=gen) for shape in ((2, 6, 16), (2, 16, 6), (2, 5, 5))]
    for got, x in zip(newton_schulz_together(mats, 5), mats):
        torch.testing.assert_close(got, newton_schulz(x, 5), rtol=0, atol=1e-12)


def test_window_one_gd_l2_is_titans_without_momentum():
    spec = MLPMemorySpec(depth=2, d_k=DV, d_v=DV, expansion=2)
    init, (q, k, v, alpha, lr, _, _) = inputs(spec, seed=1)
    ones = torch.ones_like(alpha)
    atlas, _ = chunk_atlas(spec, q, k, v, alpha, lr, None, ones, AtlasState.initial(spec, init, B, H, 1, "gd"),
                           optimizer="gd", omega_window=1, chunk_size=4)
    titans, _ = chunk_titans(spec, q, k, v, alpha, torch.zeros_like(alpha), lr, TitansState.initial(init, B),
                             chunk_size=4, use_qk_l2norm=False)
    torch.testing.assert_close(atlas, titans, rtol=0, atol=1e-12)


def test_dot_linear_window_one_without_decay_is_linear_attention():
    spec = MLPMemorySpec(depth=1, d_k=5, d_v=DV, objective="dot")
    init, (q, k, v, *_rest) = inputs(spec, seed=2)
    zero_init = {n: torch.zeros_like(w) for n, w in init.items()}
    ones = torch.ones(B, T, H, dtype=torch.float64)
    out, _ = chunk_atlas(spec, q, k, v, ones, ones, None, ones, AtlasState.initial(spec, zero_init, B, H, 1, "gd"),
                         optimizer="gd", omega_window=1, chunk_size=4)
    scores = torch.einsum("bthd,bshd->bhts", q, k).tril()
    linear_attention = torch.einsum("bhts,bshv->bthv", scores, v)
    torch.testing.assert_close(out, linear_attention, rtol=0, atol=1e-12)


def test_feature_maps():
    x, y = torch.randn(2, 7, 6, dtype=torch.float64).unbind(0)
    a = initial_coefficients("poly_tensor", 2).double()
    phi_x, phi_y = (apply_feature_map("poly_tensor", z, a) for z in (x, y))
    assert phi_x.shape[-1] == 1 + 6 + 21
    dots = (x * y).sum(-1)
    torch.testing.assert_close((phi_x * phi_y).sum(-1), a[0] + a[1] * dots + a[2] * dots**2, rtol=0, atol=1e-12)
    c = initial_coefficients("poly_elementwise", 3).double()
    torch.testing.assert_close(c, torch.tensor([1.0, 0.5, 1 / 6], dtype=torch.float64), rtol=1e-7, atol=0)
    torch.testing.assert_close(apply_feature_map("poly_elementwise", x, c), c[0] * x + c[1] * x**2 + c[2] * x**3)
    assert apply_feature_map("identity", x, torch.zeros(0)) is x
