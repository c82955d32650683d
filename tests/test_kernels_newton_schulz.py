"""Muon's Newton-Schulz: the Triton kernels (:mod:`mnemo.kernels.atlas_triton`) against the
PyTorch path in float64, forward and backward. Without a GPU they run under Triton's interpreter,
which checks the algebra; ``tests/test_gpu_newton_schulz.py`` checks the compiled kernels."""

from __future__ import annotations

import pytest
import torch

from mnemo.kernels import atlas as ns_module
from mnemo.kernels.atlas import NS_COEFFICIENTS, _NewtonSchulz, newton_schulz, newton_schulz_together

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (matrices, rows, columns, steps): rows padded to 16, a partial column block, the 340M layer's 64 x 256,
# square matrices, one step (no backward loop), rows not a power of two
CASES = [(3, 8, 20, 5), (2, 64, 256, 5), (2, 16, 16, 3), (2, 5, 70, 1), (1, 33, 100, 2)]


def _reference(S: torch.Tensor, dN: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    S64 = S.detach().double().requires_grad_()
    N = _NewtonSchulz.apply(S64, steps, 1e-7)
    return N.detach(), torch.autograd.grad(N, S64, dN.double())[0]


def _kernels(S: torch.Tensor, dN: torch.Tensor, steps: int, precision: str | None = None):
    from mnemo.kernels.atlas_triton import newton_schulz_backward_triton, newton_schulz_forward_triton

    N, norms, kept = newton_schulz_forward_triton(S, steps, 1e-7, precision, coefficients=NS_COEFFICIENTS)
    assert torch.equal(newton_schulz_forward_triton(S, steps, 1e-7, precision, keep=False, coefficients=NS_COEFFICIENTS)[0], N)
    return N, newton_schulz_backward_triton(S, norms, kept, dN, steps, 1e-7, precision, coefficients=NS_COEFFICIENTS)


@pytest.mark.parametrize("n,r,L,steps", CASES)
def test_triton_newton_schulz_equals_the_torch_path(n, r, L, steps):
    """float32 with exact products against the PyTorch path in float64: output and ``dS``, on contiguous
    matrices and on transposed views (the kernels read strides)."""
    gen = torch.Generator().manual_seed(n * r + L)
    S = torch.randn(n, r, L, generator=gen).to(DEVICE)
    dN = torch.randn(n, r, L, generator=gen).to(DEVICE)
    want_N, want_dS = _reference(S, dN, steps)
    for view in (S, S.transpose(1, 2).contiguous().transpose(1, 2)):
        N, dS = _kernels(view, dN, steps, "ieee")
        assert N.dtype == dS.dtype == torch.float32 and N.is_contiguous() and dS.is_contiguous()
        torch.testing.assert_close(N.double(), want_N, rtol=0, atol=1e-5)
        torch.testing.assert_close(dS.double(), want_dS, rtol=0, atol=1e-5 * want_dS.abs().max().item())


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_triton_newton_schulz_of_near_singular_matrices(rank):
    """Muon's momenta are sums of a few rank-1 gradients: 64 matrices of 4 x 16 and rank 1-3 (plus
    float32 noise), where the iteration amplifies rounding along the small singular values. Against
    float64, the Frobenius error over the batch within 1.5x (``N``) and 2x (``dS``) the PyTorch path's
    float32 error. Measured under Triton 3.9's interpreter with NumPy 2.4 over twelve seeds: 0.61-0.81x
    for ``N``, 0.72-1.65x for ``dS`` (an earlier environment gave 0.65-1.10x over four seeds; single
    matrices vary 0.1x-2.9x): the products' summation order moves the amplified rounding."""
    gen = torch.Generator().manual_seed(rank)
    S = (torch.randn(64, 4, rank, generator=gen) @ torch.randn(64, rank, 16, generator=gen)).to(DEVICE)
    dN = torch.randn(64, 4, 16, generator=gen).to(DEVICE)
    want_N, want_dS = _reference(S, dN, 5)
    N, dS = _kernels(S, dN, 5, "ieee")
    ours = S.clone().requires_grad_()
    torch_N = _NewtonSchulz.apply(ours, 5, 1e-7)
    (torch_dS,) = torch.autograd.grad(torch_N, ours, dN)
    for got, theirs, want, bound in ((N, torch_N, want_N, 1.5), (dS, torch_dS, want_dS, 2.0)):
        assert (got.double() - want).norm() <= bound * (theirs.double() - want).norm()


def test_triton_newton_schulz_with_tf32_products():
    """The TF32 branch (iterates and operands rounded to TF32's 10 mantissa bits; the interpreter's products
    are then exact): relative error against float64 of a TF32 computation, 2.3e-3 / 3.9e-3 measured for
    ``N`` / ``dS`` (the PyTorch path under cuBLAS TF32 on an H100: 4.1e-3 / 7.2e-3)."""
    gen = torch.Generator().manual_seed(0)
    S = torch.randn(16, 64, 256, generator=gen).to(DEVICE)
    dN = torch.randn(16, 64, 256, generator=gen).to(DEVICE)
    want_N, want_dS = _reference(S, dN, 5)
    N, dS = _kernels(S, dN, 5, "tf32")
    for got, want in ((N, want_N), (dS, want_dS)):
        assert 1e-4 < float((got.double() - want).norm() / want.norm()) < 6e-3


def test_triton_newton_schulz_of_a_zero_matrix_is_zero():
    S = torch.zeros(2, 8, 20, device=DEVICE)
    N, _ = _kernels(S, torch.ones_like(S), 5, "ieee")
    assert N.abs().max() == 0 and torch.isfinite(N).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_newton_schulz_in_half_precision_is_as_close_as_the_torch_path(dtype):
    """bf16 / fp16 matrices, products in their dtype and sums in float32, against float64: within 1.5x the
    PyTorch path's own error in that dtype. Measured over seeds 2-6 in bf16: the largest error of the
    output 0.76-0.87x the PyTorch path's, of ``dS`` 0.80-1.33x (relative RMS 1.8-1.9% / 3.0-3.3% against
    1.8-1.9% / 3.3-3.5%): the same rounding points (each iterate rounded when formed), in another order."""
    gen = torch.Generator().manual_seed(1)
    S = torch.randn(4, 64, 256, generator=gen).to(DEVICE)
    dN = torch.randn(4, 64, 256, generator=gen).to(DEVICE)
    want_N, want_dS = _reference(S, dN, 5)
    N, dS = _kernels(S.to(dtype), dN.to(dtype), 5)
    assert N.dtype == dS.dtype == dtype
    low = S.to(dtype).requires_grad_()
    torch_N = _NewtonSchulz.apply(low, 5, 1e-7)
    (torch_dS,) = torch.autograd.grad(torch_N, low, dN.to(dtype))
    for got, ours, want in ((N, torch_N, want_N), (dS, torch_dS, want_dS)):
        assert (got.double() - want).abs().max() <= 1.5 * (ours.double() - want).abs().max()
        assert (got.double() - want).norm() <= 1.5 * (ours.double() - want).norm()


def _count_launches(monkeypatch) -> list[str]:
    from mnemo.kernels import atlas_triton as newton_schulz_triton

    calls = []
    for name in ("newton_schulz_forward_triton", "newton_schulz_backward_triton",
                 "momentum_newton_schulz_forward_triton", "momentum_newton_schulz_backward_triton"):
        original = getattr(newton_schulz_triton, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(newton_schulz_triton, name, spy)
    return calls


def test_newton_schulz_takes_the_triton_kernels_when_asked(monkeypatch):
    """The public functions with ``use_backend("triton")``: tall and wide matrices with leading dims,
    autograd, and :func:`newton_schulz_together` (a launch per matrix, no stacking)."""
    from mnemo.kernels.backend import use_backend

    calls = _count_launches(monkeypatch)
    gen = torch.Generator().manual_seed(2)
    tall = torch.randn(2, 3, 40, 12, generator=gen).to(DEVICE).requires_grad_()
    wide = torch.randn(2, 3, 12, 40, generator=gen).to(DEVICE).requires_grad_()
    probe = [torch.randn(x.shape, generator=gen).to(DEVICE) for x in (tall, wide)]

    def run():
        outs = [newton_schulz(tall, 5), *newton_schulz_together([tall, wide], 5)]
        loss = sum(((o * p).sum() for o, p in zip(outs[1:], probe)), (outs[0] * probe[0]).sum())
        return outs, torch.autograd.grad(loss, (tall, wide))

    with torch.autograd.graph.disable_saved_tensors_hooks("not needed"), use_backend("triton"):
        got, got_grads = run()
    assert calls.count("newton_schulz_forward_triton") == 3 and calls.count("newton_schulz_backward_triton") == 3
    with use_backend("torch"):
        want, want_grads = run()
    for a, b in zip((*got, *got_grads), (*want, *want_grads)):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)


def test_triton_forward_keeps_iterates_only_for_a_gradient(monkeypatch):
    """The forward keeps ``G`` and the iterates in the input's dtype when the input wants a gradient, and nothing
    without one (a decode step's Newton-Schulz); for float32 also each later step's ``A`` and ``P``
    (``(n, 3 steps - 1, r, r)``), for bf16 not (``(n, steps + 1, r, r)``: :func:`~.atlas_triton.kept_tiles`)."""
    from mnemo.kernels import atlas_triton as newton_schulz_triton
    from mnemo.kernels.backend import use_backend

    kept = []
    original = newton_schulz_triton.newton_schulz_forward_triton

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        kept.append(out[2])
        return out

    monkeypatch.setattr(newton_schulz_triton, "newton_schulz_forward_triton", spy)
    S = torch.randn(3, 8, 20, device=DEVICE)
    with use_backend("triton"):
        newton_schulz(S.bfloat16(), 4)
        newton_schulz(S.bfloat16().requires_grad_(), 4)
        newton_schulz(S.clone().requires_grad_(), 4)
    assert kept[0] is None
    assert kept[1].shape == (3, 5, 8, 8) and kept[1].dtype == torch.bfloat16
    assert kept[2].shape == (3, 11, 8, 8) and kept[2].dtype == torch.float32  # M_1..M_4, G, then A_k and P_k
    G = S @ S.transpose(1, 2) / S.norm(dim=(1, 2), keepdim=True) ** 2
    for x in kept[1:]:
        torch.testing.assert_close(x[:, 4].float(), G, rtol=1e-2, atol=1e-2)
    M, A, P = kept[2][:, 1], kept[2][:, 6], kept[2][:, 9]  # M_2, the A and P formed from it
    torch.testing.assert_close(A, M @ G @ M.transpose(1, 2), rtol=1e-4, atol=1e-4)
    a, b, c = NS_COEFFICIENTS
    torch.testing.assert_close(P, b * A + c * A @ A, rtol=1e-4, atol=1e-4)


def test_newton_schulz_keeps_the_torch_path_past_the_kernels_limits():
    """Short sides over 64 and float64 stay on the PyTorch path even when Triton is asked."""
    from mnemo.kernels.backend import use_backend

    with use_backend("triton"), pytest.raises(NotImplementedError):
        newton_schulz(torch.randn(2, 65, 70, device=DEVICE), 5)
    assert not ns_module.triton_wanted(torch.randn(2, 8, 20, dtype=torch.float64))


def test_atlas_muon_with_triton_newton_schulz(monkeypatch):
    """Atlas with Muon, chunked (with gradients, every token's momentum formed inside the kernels) and step by
    step, with every Newton-Schulz call in the Triton kernels, float32: outputs and gradients against float64, within 3x the PyTorch path's float32
    error (its momenta are near-singular, where Newton-Schulz amplifies rounding; measured 0.6-1.05x) or 2e-5
    of the gradient's largest value, where both paths' errors sit (one gradient of 6.9: 2.6e-5 / 4.9e-5 with
    the GELU's slope as an explicit formula, 6.3e-5 / 1.8e-5 with it as one kernel, rounding either way)."""
    from mnemo.kernels.atlas import AtlasState, chunk_atlas, reference_atlas, step_atlas
    from mnemo.kernels.atlas_triton import supported
    from mnemo.kernels.mlp_memory import MLPMemorySpec
    from test_kernels_atlas import B, DV, H, T, inputs

    calls = _count_launches(monkeypatch)
    # The decode steps go through Newton-Schulz here; the fused Muon step has a test of its own below.
    monkeypatch.setattr(ns_module, "_fused_muon_step", lambda *a: False)
    spec = MLPMemorySpec(depth=2, d_k=DV, d_v=DV, expansion=4)
    init, xs = inputs(spec)
    opts = dict(optimizer="muon", omega_window=3, chunk_size=4, ns_steps=5)
    ref = reference_atlas(spec, *xs, init, **opts)

    def run(triton: bool):
        monkeypatch.setattr(ns_module, "triton_wanted", supported if triton else lambda _X: False)
        init32 = {n: w.float().to(DEVICE).requires_grad_() for n, w in init.items()}
        xs32 = [x.float().to(DEVICE).requires_grad_() for x in xs]
        out, _ = chunk_atlas(spec, *xs32, AtlasState.initial(spec, init32, B, H, 3, "muon"), **opts)
        grads = torch.autograd.grad(out.sin().sum(), [*xs32, *init32.values()])
        state, steps = AtlasState.initial(spec, {n: w.detach() for n, w in init32.items()}, B, H, 3, "muon"), []
        with torch.no_grad():
            for t in range(T):
                o, state = step_atlas(spec, *(x[:, t] for x in xs32), state, **opts)
                steps.append(o)
        return out, torch.stack(steps, 1), grads

    out, stepped, grads = run(True)
    # The chunks form their momenta inside the kernels; the decode steps orthogonalise theirs.
    assert calls.count("newton_schulz_forward_triton") == T * len(spec.shapes)
    assert "momentum_newton_schulz_forward_triton" in calls and "momentum_newton_schulz_backward_triton" in calls
    torch_out, torch_stepped, torch_grads = run(False)
    for got, ours in ((out, torch_out), (stepped, torch_stepped)):
        bound = 3 * (ours.double().cpu() - ref).abs().max().item()
        torch.testing.assert_close(got.double().cpu(), ref, rtol=0, atol=max(bound, 1e-6))
    monkeypatch.setattr(ns_module, "triton_wanted", lambda _X: False)
    init64 = {n: w.clone().requires_grad_() for n, w in init.items()}
    xs64 = [x.clone().requires_grad_() for x in xs]
    out64, _ = chunk_atlas(spec, *xs64, AtlasState.initial(spec, init64, B, H, 3, "muon"), **opts)
    for got, ours, want in zip(grads, torch_grads, torch.autograd.grad(out64.sin().sum(), [*xs64, *init64.values()])):
        error = (got.double().cpu() - want).abs().max().item()
        assert error <= max(3 * (ours.double().cpu() - want).abs().max().item(), 2e-5 * want.abs().max().item(), 1e-6)


@pytest.mark.parametrize("live", [[True, True], [True, False]])
@pytest.mark.parametrize("position", [[0, 3], [5, 0]])
def test_fused_muon_decode_step_equals_the_torch_step(monkeypatch, live, position):
    """Atlas' Muon decode step with the weight-sized work in one launch per weight (``muon_step_triton``)
    against the PyTorch step: rows not live stay as they were, rows starting an inner chunk store
    their weights; the wide ``w1`` and tall ``w2`` of a memory whose short side is 6. Against the step in
    float64, within 3x the PyTorch step's float32 error (measured 0.75-1.7x: Newton-Schulz amplifies
    float32 rounding to ~1e-4 here in both)."""
    from mnemo.kernels.atlas import AtlasState, step_atlas
    from mnemo.kernels.backend import use_backend
    from mnemo.kernels.atlas_triton import muon_step_triton
    from mnemo.kernels.mlp_memory import MLPMemorySpec

    calls = []
    monkeypatch.setattr("mnemo.kernels.atlas_triton.muon_step_triton",
                        lambda weights, *a, **k: calls.extend(weights) or muon_step_triton(weights, *a, **k))
    spec = MLPMemorySpec(depth=2, d_k=6, d_v=6, expansion=3)
    B, H, window = 2, 3, 4
    gen = torch.Generator().manual_seed(5)
    r = lambda *shape: torch.randn(*shape, generator=gen).to(DEVICE)  # noqa: E731
    init = {n: r(H, *shape) * 0.5 for n, shape in spec.shapes.items()}
    state = AtlasState.initial(spec, init, B, H, window, "muon")
    state.momentum = {n: r(*m.shape) for n, m in state.momentum.items()}
    state.chunk_start = {n: r(*m.shape) for n, m in state.chunk_start.items()}
    state.window_k, state.window_v = r(*state.window_k.shape), r(*state.window_v.shape)
    state.window_gamma, state.window_count = torch.rand(state.window_gamma.shape, generator=gen).to(DEVICE), \
        torch.tensor([window - 1, 1], device=DEVICE)
    state.position = torch.tensor(position, device=DEVICE)
    token = [r(B, H, 6), r(B, H, 6), r(B, H, 6)] + [torch.rand(B, H, generator=gen).to(DEVICE) for _ in range(4)]
    opts = dict(optimizer="muon", omega_window=window, chunk_size=8, ns_steps=5,
                live=torch.tensor(live, device=DEVICE))
    with use_backend("triton"):
        y, got = step_atlas(spec, *token, state, **opts)
    assert len(calls) == len(spec.shapes)
    with use_backend("torch"):
        y_want, want = step_atlas(spec, *token, state, **opts)
        as64 = lambda x: x.double() if x.is_floating_point() else x  # noqa: E731
        state64 = AtlasState.from_tensors({key: as64(t) for key, t in state.tensors().items()})
        y64, want64 = step_atlas(spec, *(as64(t) for t in token), state64, **opts)
    pairs = [("y", y, y_want, y64)] + [(key, got.tensors()[key], want.tensors()[key], t)
                                        for key, t in want64.tensors().items()]
    for key, ours, theirs, exact in pairs:
        error = (ours.double() - exact).abs().max().item()
        assert error <= max(3 * (theirs.double() - exact).abs().max().item(), 1e-6), key


def _momenta(A, Bf, sc, sa, S0):
    """Every token's momentum ``sa_t S0 + sum_k sc[t, k] A_k Bf_k^T`` as the PyTorch path forms it."""
    return torch.einsum("ntk,nko,nki->ntoi", sc, A, Bf) + sa[..., None, None] * S0[:, None]


# (rows, window tokens K, chunk tokens T, d_out, d_in): a wide and a tall weight, K over one block of tokens
# and not a multiple of it, a short side padded to 16 and one not a power of two
MOMENTUM_CASES = [(2, 7, 5, 8, 20), (2, 7, 5, 20, 8), (1, 37, 3, 16, 64), (2, 5, 4, 70, 12)]


@pytest.mark.parametrize("n,K,T,d_out,d_in", MOMENTUM_CASES)
def test_momenta_formed_inside_the_kernels_equal_the_torch_path(n, K, T, d_out, d_in):
    """Muon's chunk with every token's momentum formed inside the Newton-Schulz kernels
    (:class:`_MomentumNewtonSchulz`) against the PyTorch path (the momenta formed, then orthogonalised) in
    float64: the output and the gradients of every factor, the gates and the start momentum, with exact
    float32 products, within 3x the PyTorch path's own float32 error or 1e-5 of the largest value (the plain
    kernels' bound)."""
    from mnemo.kernels.atlas import _MomentumNewtonSchulz

    gen = torch.Generator().manual_seed(n + K + d_out)
    make = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    # Momenta led by their decayed start, as Muon's are: well conditioned, so that both paths' float32
    # errors stay near rounding (near-singular momenta amplify it 100x: the plain kernels' tests above).
    A, Bf, sc, S0 = make(n, K, d_out) / 2, make(n, K, d_in) / 2, make(n, T, K) / 2, make(n, d_out, d_in)
    sa = 0.5 + torch.rand(n, T, generator=gen) / 2
    dN = make(n, T, d_out, d_in)

    def torch_path(dtype):
        xs = [x.to(dtype).requires_grad_() for x in (A, Bf, sc, sa, S0)]
        S = _momenta(*xs)
        N = _NewtonSchulz.apply(S.reshape(-1, d_out, d_in).transpose(1, 2) if d_out > d_in else S.reshape(-1, d_out, d_in),
                                5, 1e-7)
        N = (N.transpose(1, 2) if d_out > d_in else N).reshape(S.shape)
        return N.detach(), torch.autograd.grad(N, [*xs, S], dN.to(dtype))

    ours = [x.to(DEVICE).requires_grad_() for x in (A, Bf, sc, sa, S0)]
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        got = _MomentumNewtonSchulz.apply(*ours, 5, 1e-7)
        grads = torch.autograd.grad(got, ours, dN.to(DEVICE))
        theirs, their_grads = torch_path(torch.float32)
    finally:
        torch.set_float32_matmul_precision(previous)
    want, (*want_grads, want_dS) = torch_path(torch.float64)
    # sa_t's gradient <dS_t, S_0> cancels: Newton-Schulz does not see its input's scale, so <dS_t, S_t> = 0 and
    # S_0 leads S_t. Its float32 rounding is that of the sum's terms (1e-6 of ||dS_t|| ||S_0||; measured
    # 2.7e-5 on CUDA and 3.3e-5 on the interpreter, 9x and 2.7x the PyTorch path's, against terms of 72), not of
    # the small result.
    terms = (want_dS.flatten(2).norm(dim=-1) * S0.double().flatten(1).norm(dim=-1)[:, None]).max().item()
    assert got.shape == (n, T, d_out, d_in) and got.is_contiguous()
    for name, x, t, y in zip(("N", "A", "Bf", "sc", "sa", "S0"), (got, *grads), (theirs, *their_grads[:5]),
                             (want, *want_grads)):
        error, bound = (x.double().cpu() - y).abs().max().item(), (t.double() - y).abs().max().item()
        floor = 1e-6 * terms if name == "sa" else 1e-5 * y.abs().max().item()
        assert error <= max(3 * bound, floor), (name, error, bound)


def test_momenta_inside_the_kernels_without_a_gradient_keep_nothing(monkeypatch):
    """Without a gradient wanted (the chunk loop's first pass) the fused forward keeps no iterates, and its
    output equals the one that keeps them."""
    from mnemo.kernels import atlas_triton
    from mnemo.kernels.atlas import _MomentumNewtonSchulz

    kept = []
    original = atlas_triton.momentum_newton_schulz_forward_triton
    monkeypatch.setattr(atlas_triton, "momentum_newton_schulz_forward_triton",
                        lambda *a, **k: kept.append(original(*a, **k)) or kept[-1])
    gen = torch.Generator().manual_seed(3)
    args = [torch.randn(*shape, generator=gen).to(DEVICE) for shape in ((2, 6, 8), (2, 6, 20), (2, 4, 6), (2, 4),
                                                                       (2, 8, 20))]
    with torch.no_grad():
        plain = _MomentumNewtonSchulz.apply(*args, 5, 1e-7)
    kept_one = _MomentumNewtonSchulz.apply(*(x.requires_grad_() for x in args), 5, 1e-7)
    assert kept[0][2] is None and kept[1][2].shape == (8, 14, 8, 8)
    assert torch.equal(plain, kept_one.detach())


def test_atlas_muon_under_autocast_forms_its_momenta_in_the_kernels(monkeypatch):
    """Under bf16 autocast Muon's chunk gets its gradient factors and gates in bf16: the momentum kernels form
    ``S_t`` from float32 copies (a backward that mixed bf16 factors with float32 ``dS_t`` failed), and the chunk's
    output and gradients land as close to float32 without autocast as the PyTorch path's under the same autocast,
    which forms ``S_t`` in bf16: within 2x its error or 1e-2 (measured 0.1x-1.6x; relative norms)."""
    from mnemo.kernels.atlas import AtlasState, chunk_atlas
    from mnemo.kernels.backend import use_backend
    from mnemo.kernels.mlp_memory import MLPMemorySpec
    from test_kernels_atlas import B, DV, H, inputs

    calls = _count_launches(monkeypatch)
    spec = MLPMemorySpec(depth=2, d_k=DV, d_v=DV, expansion=4)
    init, xs = inputs(spec)
    opts = dict(optimizer="muon", omega_window=3, chunk_size=4, ns_steps=5)

    def run(backend: str, autocast: bool):
        init32 = {n: w.float().to(DEVICE).requires_grad_() for n, w in init.items()}
        xs32 = [x.float().to(DEVICE).requires_grad_() for x in xs]
        with use_backend(backend), torch.autocast(DEVICE, torch.bfloat16, enabled=autocast):
            out, _ = chunk_atlas(spec, *xs32, AtlasState.initial(spec, init32, B, H, 3, "muon"), **opts)
            grads = torch.autograd.grad(out.float().sin().sum(), [*xs32, *init32.values()])
        return [out.detach().float(), *grads]

    want = run("torch", False)
    theirs = run("torch", True)
    ours = run("triton", True)
    assert "momentum_newton_schulz_backward_triton" in calls
    for got, other, exact in zip(ours, theirs, want):
        assert torch.isfinite(got).all()
        error, bound = float((got - exact).norm() / exact.norm()), float((other - exact).norm() / exact.norm())
        assert error <= max(2 * bound, 1e-2), (error, bound)
