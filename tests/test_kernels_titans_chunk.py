"""The hand-written chunk of a deep memory against autograd over ChunkOperator (float64, every gradient)."""

from __future__ import annotations

import pytest
import torch

from mnemo.kernels.mlp_memory import ChunkOperator
from mnemo.kernels.mlp_memory import MLPMemorySpec, grad_factors, memory_apply
from mnemo.kernels.titans_chunk import chunk_memory

B, H, C, K = 2, 3, 5, 7

SPECS = {
    "linear_l2": MLPMemorySpec(depth=1, d_k=4, d_v=4),
    "linear_dot": MLPMemorySpec(depth=1, d_k=4, d_v=3, objective="dot"),
    "mlp_l2": MLPMemorySpec(depth=2, d_k=4, d_v=4, expansion=2),
    "mlp_dot": MLPMemorySpec(depth=2, d_k=4, d_v=4, expansion=2, objective="dot"),
    "mlp_skip_l2": MLPMemorySpec(depth=2, d_k=5, d_v=3, expansion=2),
    # clips that bind on some tokens and not on others (norms of the problem's gradients: 0.5 to 40)
    "linear_clip": MLPMemorySpec(depth=1, d_k=4, d_v=4, grad_clip=3.0),
    "mlp_clip": MLPMemorySpec(depth=2, d_k=4, d_v=4, expansion=2, grad_clip=3.0),
    "mlp_skip_clip": MLPMemorySpec(depth=2, d_k=5, d_v=3, expansion=2, grad_clip=3.0),
    # gated MLPs z + W1 (gelu(W2 z) * W3 z) (Atlas++'s memory, MC-Titans' memory_gated)
    "gated_l2": MLPMemorySpec(depth=2, gated=True, d_k=4, d_v=4, expansion=2),
    "gated_dot": MLPMemorySpec(depth=2, gated=True, d_k=4, d_v=4, expansion=2, objective="dot"),
    "gated_skip_clip": MLPMemorySpec(depth=2, gated=True, d_k=5, d_v=3, expansion=2, grad_clip=3.0),
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
    m = len(names)

    def fn(*t):
        W_ = dict(zip(names, t[:m]))
        S_ = dict(zip(names, t[m:2 * m]))
        return tuple(flat(*chunk_memory(spec, W_, S_, *t[2 * m:]), names))

    inputs = [*W.values(), *S.values(), q, k, v, a, b, c, sa[..., -1].detach().requires_grad_(),
              sc[..., -1, :].detach().requires_grad_()]
    assert torch.autograd.gradcheck(fn, inputs)


def test_the_clips_bind_on_some_tokens_only():
    for name in ("linear_clip", "mlp_clip", "mlp_skip_clip", "gated_skip_clip"):
        spec = SPECS[name]
        W, S, q, k, v, *_ = problem(spec, True)
        raw = grad_factors(MLPMemorySpec(**{**spec.__dict__, "grad_clip": None}), W, k, v)
        norms = sum(A.pow(2).sum(-1) * B.pow(2).sum(-1) for A, B in raw.values()).sqrt()
        assert (norms > spec.grad_clip).any() and (norms < spec.grad_clip).any(), name


def test_the_clip_stays_differentiable_at_a_zero_gradient():
    """A padded token's factors are zero: the clip's first and second derivatives there are finite (a norm's
    backward is 0/0 at a zero vector, masked to first order only)."""
    from mnemo.kernels.norms import clip_rank_one

    gen = torch.Generator().manual_seed(3)
    leaves = [torch.randn(3, n, generator=gen, dtype=torch.float64) for n in (4, 5, 4, 6)]
    for leaf in leaves:
        leaf[1] = 0.0  # one token without a gradient
        leaf.requires_grad_()
    clipped = clip_rank_one({"w1": (leaves[0], leaves[1]), "w2": (leaves[2], leaves[3])}, 0.5)
    total = sum((a * b.sum(-1, keepdim=True)).pow(2).sum() for a, b in clipped.values())
    first = torch.autograd.grad(total, leaves, create_graph=True)
    second = torch.autograd.grad(sum(g.pow(2).sum() for g in first), leaves)
    assert all(torch.isfinite(g).all() for g in (*first, *second))


# --------------------------------------------------------------------------- the Triton ends

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _update_problem(momentum, M=70, N=33, seed=5):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float32).to(DEVICE)  # noqa: E731
    W, S = r(2, 3, M, N), (r(2, 3, M, N) if momentum else None)
    gates = [r(2, 3), r(2, 3) if momentum else None, r(2, 3) if momentum else None]
    return W, S, gates, r


@pytest.mark.parametrize("momentum", [True, False], ids=["momentum", "plain"])
def test_triton_final_update_equals_the_torch_one(momentum):
    pytest.importorskip("triton")
    from mnemo.kernels.titans_chunk import _final_update_torch
    from mnemo.kernels.titans_triton_update import final_update

    W, S, (a, b, sa), r = _update_problem(momentum)
    U_w, U_s, Bf = r(2, 3, 19, 70), (r(2, 3, 19, 70) if momentum else None), r(2, 3, 19, 33)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        got = final_update(W, S, a, b, sa, U_w, U_s, Bf)
    finally:
        torch.set_float32_matmul_precision(before)
    want = _final_update_torch(W, S, a, b, sa, U_w, U_s, Bf)
    for x, y in zip(got, want):
        if y is None:
            assert x is None
        else:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_uses", [0, 1, 3])
@pytest.mark.parametrize("momentum", [True, False], ids=["momentum", "plain"])
def test_triton_final_update_backward_equals_the_torch_one(momentum, n_uses):
    pytest.importorskip("triton")
    from mnemo.kernels.titans_chunk import _final_update_backward_torch
    from mnemo.kernels.titans_triton_update import final_update_backward

    W, S, (a, b, sa), r = _update_problem(momentum)
    dW, dS = r(2, 3, 70, 33), (r(2, 3, 70, 33) if momentum else None)
    uses_w = [(r(2, 3, 5 + i, 70), r(2, 3, 5 + i, 33)) for i in range(n_uses)]
    uses_s = [(r(2, 3, 7, 70), r(2, 3, 7, 33))][:n_uses] if momentum else []
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        got = final_update_backward(W, S, dW, dS, a, b, sa, uses_w, uses_s)
    finally:
        torch.set_float32_matmul_precision(before)
    want = _final_update_backward_torch(W, S, dW, dS, a, b, sa, uses_w, uses_s)
    for i, (x, y) in enumerate(zip(got, want)):
        if y is None:
            assert x is None
        else:
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4, msg=lambda m: f"output {i}: {m}")


def test_the_final_update_backward_reads_strided_last_gates_in_place():
    """The last token's gates as columns of ``(G, C)`` gates (strided views, as the chunk passes them) give
    the same bits as contiguous copies; gates of two strides are refused by name."""
    pytest.importorskip("triton")
    from mnemo.kernels.titans_triton_update import final_update_backward_stacked

    gen = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=gen).to(DEVICE)  # noqa: E731
    G, M, N, C = 3, 40, 24, 5
    W, S, dW, dS = r(G, M, N), r(G, M, N), r(G, M, N), r(G, M, N)
    a, b, sa = r(G, C), r(G, C), r(G)
    uses = (r(G, 6, M), r(G, 6, N), 6)
    strided = final_update_backward_stacked(W, S, dW, dS, a[:, -1], b[:, -1], sa, uses, uses)
    copied = final_update_backward_stacked(W, S, dW, dS, a[:, -1].clone(), b[:, -1].clone(), sa, uses, uses)
    for x, y in zip(strided, copied):
        assert torch.equal(x, y)
    with pytest.raises(ValueError, match="one stride"):
        final_update_backward_stacked(W, S, dW, dS, a[:, -1], b[:, -1].clone(), sa, uses, uses)


def test_the_chunk_through_the_triton_ends_equals_autograd_over_the_operator():
    pytest.importorskip("triton")
    from mnemo.kernels import use_backend

    spec = SPECS["mlp_l2"]
    W, S, q, k, v, a, b, c, sa, sc = problem(spec, True, seed=7)
    names = list(spec.shapes)
    leaves = [*W.values(), *S.values(), q, k, v, a, b, c, sa, sc]
    want = flat(*by_operator(spec, W, S, q, k, v, a, b, c, sa, sc), names)
    f32 = [t.detach().float().to(DEVICE).requires_grad_() for t in leaves]
    W32, S32 = dict(zip(names, f32[:2])), dict(zip(names, f32[2:4]))
    q32, k32, v32, a32, b32, c32, sa32, sc32 = f32[4:]
    with use_backend("triton"):
        got = flat(*chunk_memory(spec, W32, S32, q32, k32, v32, a32, b32, c32, sa32[..., -1], sc32[..., -1, :]),
                   names)
        cotangents = [torch.randn(t.shape, dtype=torch.float64) for t in want]
        g_got = torch.autograd.grad(got, f32, [t.float().to(DEVICE) for t in cotangents])
    g_want = torch.autograd.grad(want, leaves, cotangents)
    for x, y in zip(got, want):
        torch.testing.assert_close(x.detach().cpu().double(), y.detach(), rtol=1e-4, atol=1e-4)
    # Gradients span five decades here (dk: 0.4 to 6,000), so each is held to its largest entry: float32
    # gives 1e-7 to 6e-7 of it on both backwards (the sliced one, and ``comparison_paths(chunk_backward="torch")``).
    for i, (x, y) in enumerate(zip(g_got, g_want)):
        error = ((x.cpu().double() - y).abs().max() / y.abs().max()).item()
        assert error < 1e-5, f"gradient {i}: relative error {error:.1e}"


@pytest.mark.parametrize("first", [True, False])
def test_triton_step_update_equals_the_torch_one(first):
    """The decode step's one-pass weight update against :func:`~mnemo.kernels.titans.step_update`:
    a live row, a row that is not (kept as it was) and, ``first``, rows that start an inner chunk."""
    pytest.importorskip("triton")
    from mnemo.kernels.titans import step_update
    from mnemo.kernels.titans_triton_update import step_update as triton_step_update

    gen = torch.Generator().manual_seed(11)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float32).to(DEVICE)  # noqa: E731
    W, S, C = r(2, 3, 70, 33), r(2, 3, 70, 33), r(2, 3, 70, 33)
    A, Bf, a, e, th = r(2, 3, 70), r(2, 3, 33), r(2, 3), r(2, 3), r(2, 3)
    live = torch.tensor([True, False], device=DEVICE)
    at_start = torch.tensor([first, first], device=DEVICE)
    got = triton_step_update(W, S, C, A, Bf, a, e, th, live, at_start)
    want = step_update(W, S, C, A, Bf, a, e, th, live, at_start)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[0][1], W[1]) and torch.equal(got[1][1], S[1]) and torch.equal(got[2][1], C[1])
    assert torch.equal(got[2][0], W[0] if first else C[0])


@pytest.mark.parametrize("shape", [(70, 33), (40, 150)], ids=["tiles3x1", "tiles2x2"])
@pytest.mark.parametrize("first", [True, False])
def test_triton_step_update_backward_equals_autograd_over_the_torch_one(first, shape):
    """Every gradient of the step's update (weights, momenta, chunk-start weights, both factors, the three
    gates) against autograd over :func:`~mnemo.kernels.titans.step_update`, with a live row and one that is
    not, over tiles that split the rows (and the columns): float32 sums to 1e-5 of each gradient's largest
    entry; a cotangent left out (the chunk-start weights unused) counts as zero."""
    pytest.importorskip("triton")
    from mnemo.kernels.titans import step_update
    from mnemo.kernels.titans_triton_update import step_update as triton_step_update

    gen = torch.Generator().manual_seed(12)
    M, N = shape
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float32).to(DEVICE).requires_grad_()  # noqa: E731
    leaves = [r(2, 3, M, N), r(2, 3, M, N), r(2, 3, M, N), r(2, 3, M), r(2, 3, N), r(2, 3), r(2, 3), r(2, 3)]
    live = torch.tensor([True, False], device=DEVICE)
    at_start = torch.tensor([first, first], device=DEVICE)
    probes = [torch.randn(2, 3, M, N, generator=gen).to(DEVICE) for _ in range(3)]
    for used in (3, 2):
        got = triton_step_update(*leaves, live, at_start)
        want = step_update(*leaves, live, at_start)
        g_got = torch.autograd.grad(sum((x * p).sum() for x, p in zip(got[:used], probes)), leaves)
        g_want = torch.autograd.grad(sum((x * p).sum() for x, p in zip(want[:used], probes)), leaves,
                                     allow_unused=True)
        for i, (x, y) in enumerate(zip(g_got, g_want)):
            y = torch.zeros_like(leaves[i]) if y is None else y
            assert x.shape == y.shape, i
            if not y.abs().max():
                assert not x.abs().max(), i
                continue
            error = float((x - y).abs().max() / y.abs().max().clamp(min=1e-30))
            assert error < 1e-5, f"gradient {i} ({used} outputs used): relative error {error:.1e}"


SLICED = {
    "l2": MLPMemorySpec(depth=2, d_k=24, d_v=24, expansion=2),
    "dot": MLPMemorySpec(depth=2, d_k=24, d_v=24, expansion=2, objective="dot"),
    # clips near the median of the problem's per-token gradient norms (l2: 370 to 1830, dot: 40 to 100)
    "l2_clip": MLPMemorySpec(depth=2, d_k=24, d_v=24, expansion=2, grad_clip=1000.0),
    "dot_clip": MLPMemorySpec(depth=2, d_k=24, d_v=24, expansion=2, objective="dot", grad_clip=70.0),
}


@pytest.mark.parametrize("slice_", [16, 32], ids=["slices16", "slices32"])
@pytest.mark.parametrize("momentum", [True, False], ids=["momentum", "plain"])
@pytest.mark.parametrize("name", list(SLICED))
def test_the_sliced_triton_chunk_equals_the_torch_chunk(name, momentum, slice_, monkeypatch):
    """The forward and backward split along the hidden layer (48 hidden units in three slices of 16, or
    a slice of 32 and a partial one; key width in blocks of 16 with a partial last one, also across the
    read's, update's and output's programs with slices of 16, whose forward and backward also take the
    written tokens in blocks of 16, three with a partial one; 12 queries over 36 written tokens) against the
    cuBLAS path and its written-out backward, values and every gradient, each held to float64."""
    pytest.importorskip("triton")
    from mnemo.kernels import titans_triton_forward as sliced
    from mnemo.kernels import use_backend

    monkeypatch.setitem(sliced.BLOCKS, "slice", slice_)
    monkeypatch.setitem(sliced.BLOCKS, "width", 16)
    if slice_ == 16:  # the read, update and output over two width blocks (a partial one); else one of 32
        for key in ("read_width", "update_width", "output_width"):
            monkeypatch.setitem(sliced.BLOCKS, key, 16)
        # the written tokens in blocks, the last partial, wherever they are taken in blocks
        monkeypatch.setitem(sliced.BLOCKS, "chain_rows", 16)
        monkeypatch.setitem(sliced.BLOCKS, "tokens", 16)
        monkeypatch.setitem(sliced.BLOCKS, "tokens_whole", 16)
    spec = SLICED[name]
    assert sliced.covers(spec, 12, 36)
    gen = torch.Generator().manual_seed(5)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).to(DEVICE).requires_grad_()  # noqa: E731
    B_, H_, C_, K_ = 2, 2, 12, 36
    W = {n: r(B_, H_, *s, scale=0.5) for n, s in spec.shapes.items()}
    S = {n: r(B_, H_, *s, scale=0.1) for n, s in spec.shapes.items()} if momentum else None
    q, k, v = r(B_, H_, C_, 24), r(B_, H_, K_, 24), r(B_, H_, K_, 24)
    a, b, c, sa, sc = r(B_, H_, C_), r(B_, H_, C_), r(B_, H_, C_, K_), r(B_, H_), r(B_, H_, K_)
    gates = (a, b, c, sa, sc) if momentum else (a, None, c, None, None)
    leaves = [*W.values(), *(S.values() if momentum else ()), q, k, v, *(x for x in gates if x is not None)]
    names = list(spec.shapes)
    exact = [t.detach().double().requires_grad_() for t in leaves]
    it = iter(exact)
    W64 = {n: next(it) for n in names}
    S64 = {n: next(it) for n in names} if momentum else None
    q64, k64, v64 = next(it), next(it), next(it)
    gates64 = tuple(None if x is None else next(it) for x in gates)
    runs = {"torch": (leaves, W, S, q, k, v, gates), "triton": (leaves, W, S, q, k, v, gates),
            "exact": (exact, W64, S64, q64, k64, v64, gates64)}
    outputs, grads = {}, {}
    gen_cot = torch.Generator().manual_seed(6)
    cotangents = None
    for run, (ls, W_, S_, q_, k_, v_, g_) in runs.items():
        with use_backend("triton" if run == "triton" else "torch"):
            outputs[run] = flat(*chunk_memory(spec, W_, S_, q_, k_, v_, *g_), names)
            if cotangents is None:
                cotangents = [torch.randn(t.shape, generator=gen_cot).to(DEVICE) for t in outputs[run]]
            grads[run] = torch.autograd.grad(outputs[run], ls, [t.to(outputs[run][0].dtype) for t in cotangents])

    def error(x, y):
        return ((x.double() - y).abs().max() / y.abs().max()).item()

    # Both float32 paths sum in their own order: each is held to the float64 result, the sliced one
    # within 4x the cuBLAS path's own error (and 1e-6 of the largest value, which float32 cannot beat).
    for what, got, ref, want in (("output", outputs["triton"], outputs["torch"], outputs["exact"]),
                                 ("gradient of leaf", grads["triton"], grads["torch"], grads["exact"])):
        for i, (x, y, z) in enumerate(zip(got, ref, want)):
            bound = max(4 * error(y, z), 1e-6)
            assert error(x, z) < bound, f"{what} {i}: relative error {error(x, z):.1e} (cuBLAS path {error(y, z):.1e})"
    if spec.grad_clip is not None:  # the clip binds on some tokens and not on others
        from mnemo.kernels.mlp_memory import raw_grad_factors
        from mnemo.kernels.norms import clip_scale

        raw = raw_grad_factors(spec, W, k, v)
        scale = clip_scale(sum(x.pow(2).sum(-1) * y.pow(2).sum(-1) for x, y in raw.values()), spec.grad_clip)
        assert 0 < int((scale < 1).sum()) < scale.numel()


def test_the_sliced_forward_is_taken_where_it_covers_the_memory(monkeypatch):
    """On the Triton backend a covered chunk runs through the sliced forward (and ``comparison_paths(chunk_forward="torch")``
    keeps cuBLAS); a memory with a linear skip is not covered."""
    pytest.importorskip("triton")
    from mnemo.kernels import titans_chunk, use_backend
    from mnemo.kernels.backend import comparison_paths

    calls = []
    import mnemo.kernels.titans_triton_forward as sliced

    real = sliced.chunk_forward
    monkeypatch.setattr(sliced, "chunk_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    spec = SLICED["l2_clip"]
    x = torch.zeros(1, 1, 4, 24, device=DEVICE)
    with use_backend("triton"):
        assert titans_chunk._sliced_forward_wanted(spec, x, x)
        with comparison_paths(chunk_forward="torch"):
            assert not titans_chunk._sliced_forward_wanted(spec, x, x)
        assert not titans_chunk._sliced_forward_wanted(SPECS["mlp_skip_l2"], x[..., :5], x[..., :5])
        assert not titans_chunk._sliced_forward_wanted(spec, x.double(), x.double())
    with use_backend("torch"):
        assert not titans_chunk._sliced_forward_wanted(spec, x, x)
    W = {n: torch.randn(1, 1, *s, device=DEVICE) for n, s in spec.shapes.items()}
    g = torch.rand(1, 1, 4, device=DEVICE)
    with use_backend("triton"):
        chunk_memory(spec, W, None, x, x, x, g, None, torch.rand(1, 1, 4, 4, device=DEVICE), None, None)
    assert calls == [1]


@pytest.fixture
def sliced_backward_calls(monkeypatch):
    """Slices and width blocks of 16, and a list that records each call of the sliced backward."""
    pytest.importorskip("triton")
    from mnemo.kernels import titans_triton_backward as sliced_backward
    from mnemo.kernels import titans_triton_forward as sliced

    monkeypatch.setitem(sliced.BLOCKS, "slice", 16)
    monkeypatch.setitem(sliced.BLOCKS, "width", 16)
    calls = []
    real = sliced_backward.chunk_backward
    monkeypatch.setattr(sliced_backward, "chunk_backward", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_the_sliced_backward_follows_the_sliced_forward(sliced_backward_calls):
    """A chunk whose forward ran sliced runs its backward through the Triton launches;
    ``comparison_paths(chunk_backward="torch")`` takes the written-out PyTorch backward, with the same
    gradients."""
    from mnemo.kernels import use_backend
    from mnemo.kernels.backend import comparison_paths

    calls = sliced_backward_calls
    spec = SLICED["l2"]
    gen = torch.Generator().manual_seed(2)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).to(DEVICE).requires_grad_()  # noqa: E731
    W = {n: r(1, 2, *s, scale=0.5) for n, s in spec.shapes.items()}
    q, k, v, a, c = r(1, 2, 8, 24), r(1, 2, 8, 24), r(1, 2, 8, 24), r(1, 2, 8), r(1, 2, 8, 8)
    leaves = [*W.values(), q, k, v, a, c]
    grads, cotangents = {}, None
    for choice in ("fused", "torch"):
        with use_backend("triton"), comparison_paths(chunk_backward=choice):
            y, W_new, _ = chunk_memory(spec, W, None, q, k, v, a, None, c, None, None)
            outputs = [y, *W_new.values()]
            cotangents = cotangents or [torch.randn(t.shape, generator=gen).to(DEVICE) for t in outputs]
            grads[choice] = torch.autograd.grad(outputs, leaves, cotangents)
    assert calls == [1]
    for i, (x, y) in enumerate(zip(grads["fused"], grads["torch"])):
        assert ((x - y).abs().max() / y.abs().max()).item() < 1e-5, f"gradient of leaf {i}"


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("momentum", [True, False], ids=["momentum", "plain"])
def test_the_sliced_backward_is_left_where_its_launches_do_not_fit(momentum, stages, sliced_backward_calls,
                                                                    monkeypatch):
    """More than 64 written tokens (an Omega window) with momentum and two pipeline stages: the slice
    programs would need 288 KB of shared memory on the GPU, so the PyTorch backward takes the sliced
    forward's intermediates; with one stage or without momentum the sliced backward runs. Gradients
    against autograd over the operator either way."""
    from mnemo.kernels import titans_triton_forward as sliced
    from mnemo.kernels import use_backend

    monkeypatch.setitem(sliced.BLOCKS, "backward_stages", stages)

    spec = MLPMemorySpec(depth=2, d_k=16, d_v=16, expansion=2)
    gen = torch.Generator().manual_seed(4)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=gen, dtype=torch.float64) * scale).requires_grad_()  # noqa: E731
    C, K = 8, 72
    W = {n: r(1, 1, *s, scale=0.3) for n, s in spec.shapes.items()}
    S = {n: r(1, 1, *s, scale=0.1) for n, s in spec.shapes.items()} if momentum else None
    q, k, v = r(1, 1, C, 16, scale=0.3), r(1, 1, K, 16, scale=0.3), r(1, 1, K, 16, scale=0.3)
    a, b, c = r(1, 1, C), r(1, 1, C), r(1, 1, C, K, scale=0.1)
    sa, sc = r(1, 1), r(1, 1, K, scale=0.1)
    leaves = [*W.values(), *(S.values() if momentum else ()), q, k, v, a, c]
    want_out = by_operator(spec, W, S, q, k, v, a, b if momentum else None, c, sa, sc)
    want_out = flat(*want_out, list(spec.shapes))
    weights = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in want_out]
    want = torch.autograd.grad(sum((t * w).sum() for t, w in zip(want_out, weights)), leaves)
    f32 = lambda x: x.to(DEVICE, torch.float32)  # noqa: E731
    with use_backend("triton"):
        args = [{n: f32(x) for n, x in W.items()}, {n: f32(x) for n, x in S.items()} if momentum else None,
                *(f32(x) for x in (q, k, v, a)), f32(b) if momentum else None, f32(c),
                f32(sa) if momentum else None, f32(sc) if momentum else None]
        out = flat(*chunk_memory(spec, *args), list(spec.shapes))
        f32_leaves = [*args[0].values(), *(args[1].values() if momentum else ()), *args[2:6], args[7]]
        got = torch.autograd.grad(sum((t * f32(w)).sum() for t, w in zip(out, weights)), f32_leaves)
    assert sliced_backward_calls == ([] if momentum and stages == 2 else [1])
    for i, (x, y) in enumerate(zip(got, want)):
        assert ((x.cpu().double() - y).abs().max() / y.abs().max()).item() < 1e-4, f"gradient of leaf {i}"


def _loop_inputs(spec, B, T, H, seed=3):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).to(DEVICE)  # noqa: E731
    init = {n: r(H, *s, scale=0.3) for n, s in spec.shapes.items()}
    q, k, v = r(B, T, H, spec.d_k), r(B, T, H, spec.d_k), r(B, T, H, spec.d_v)
    alpha = (torch.rand(B, T, H, generator=gen) * 0.1 + 0.9).to(DEVICE)
    eta = (torch.rand(B, T, H, generator=gen) * 0.5).to(DEVICE)
    theta = (torch.rand(B, T, H, generator=gen) * 0.1).to(DEVICE)
    return init, [q, k, v, alpha, eta, theta]


def _titans_loop(spec, init, q, k, v, alpha, eta, theta):
    from mnemo.kernels.titans import TitansState, chunk_titans

    B, T = q.shape[:2]
    lengths = torch.tensor([T, T - 13], device=q.device)  # a row that ends inside a chunk
    return chunk_titans(spec, q, k, v, alpha, eta, theta, TitansState.initial(init, B), chunk_size=8,
                        lengths=lengths)[0]


def _atlas_loop(spec, init, q, k, v, alpha, eta, theta, optimizer):
    from mnemo.kernels.atlas import AtlasState, chunk_atlas

    B, T, H = q.shape[:3]
    state = AtlasState.initial(spec, init, B, H, 3, optimizer)
    return chunk_atlas(spec, q, k, v, alpha, theta, eta, alpha, state, optimizer=optimizer, omega_window=3,
                       chunk_size=8)[0]


def _mc_loop(spec, init, q, k, v, alpha, eta, theta):
    from mnemo.kernels.memory_caching import MCOptions
    from mnemo.kernels.mc_titans import MCState, chunk_mc_titans

    B = q.shape[0]
    opts = MCOptions(segment_size=16, aggregation="grm", chunk_size=8)
    return chunk_mc_titans(spec, opts, q, k, v, q.flip(1), alpha, eta, theta, init, MCState.initial(init, B, spec.d_v))[0]


@pytest.mark.parametrize("loop", ["titans", "atlas_gd", "atlas_momentum", "mc_grm"])
def test_the_chunk_loops_through_the_sliced_kernels_equal_the_torch_path(loop, sliced_backward_calls):
    """Titans (a row ending mid-chunk), Atlas with GD and momentum (an Omega window of 3: 10 written tokens
    per chunk of 8) and MC-Titans (grm, segments of 16) with their chunks run through the sliced Triton
    forward and backward, against the same loops on the PyTorch path: output and every gradient held to
    float64, within 4x the PyTorch path's float32 error (and 1e-6 of the largest entry). ``eta``'s
    gradient sums terms that cancel: the two float32 paths differ there by 1.8e-5 of its largest entry."""
    from mnemo.kernels import use_backend

    calls = sliced_backward_calls
    spec = MLPMemorySpec(depth=2, d_k=16, d_v=16, expansion=2, grad_clip=30.0)
    run = {"titans": _titans_loop, "mc_grm": _mc_loop,
           "atlas_gd": lambda *a: _atlas_loop(*a, optimizer="gd"),
           "atlas_momentum": lambda *a: _atlas_loop(*a, optimizer="momentum")}[loop]
    init, xs = _loop_inputs(spec, B=2, T=32, H=2)
    results = {}
    for name, backend, dtype in (("exact", "torch", torch.float64), ("torch", "torch", torch.float32),
                                 ("triton", "triton", torch.float32)):
        leaves = [x.to(dtype).requires_grad_() for x in xs] + [w.to(dtype).requires_grad_() for w in init.values()]
        with use_backend(backend):
            out = run(spec, dict(zip(init, leaves[len(xs):])), *leaves[:len(xs)])
            weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device, dtype)
            grads = torch.autograd.grad((out * weight).sum(), leaves, allow_unused=True)
        results[name] = [out] + [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]
    assert calls, "the sliced backward was not taken"

    def error(x, y):
        return ((x.double() - y).abs().max() / y.abs().max().clamp(min=1e-30)).item()

    momentum_gradient = 5  # after the output and the gradients of q, k, v and the retention
    for i, (x, y, z) in enumerate(zip(results["triton"], results["torch"], results["exact"])):
        # The momentum gate's gradient cancels: there the float32 paths sit up to 1.8e-5 of its largest entry
        # apart, so it is held to 3e-5 rather than to the PyTorch path's own (smaller) error.
        bound = max(4 * error(y, z), 3e-5 if i == momentum_gradient else 1e-6)
        assert error(x, z) < bound, (f"{loop}: {'output' if i == 0 else f'gradient {i}'}: {error(x, z):.1e} "
                                     f"(PyTorch path {error(y, z):.1e})")


def test_a_covered_chunk_runs_without_triton(monkeypatch):
    """``pip install mnemo`` brings no Triton: a chunk that the sliced kernels cover runs forward and
    backward on the PyTorch path, without importing their modules."""
    import sys

    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    for name in ("mnemo.kernels.titans_triton_forward", "mnemo.kernels.titans_triton_backward"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    spec = SLICED["l2_clip"]
    gen = torch.Generator().manual_seed(4)
    W = {n: (torch.randn(1, 2, *s, generator=gen) * 0.5).requires_grad_() for n, s in spec.shapes.items()}
    q, k, v = (torch.randn(1, 2, 8, 24, generator=gen).requires_grad_() for _ in range(3))
    a, c = torch.rand(1, 2, 8, generator=gen), torch.rand(1, 2, 8, 8, generator=gen)
    y, W_new, _ = chunk_memory(spec, W, None, q, k, v, a, None, c, None, None)
    torch.autograd.grad([y.sum(), *(w.sum() for w in W_new.values())], [*W.values(), q, k, v])
    assert "mnemo.kernels.titans_triton_forward" not in sys.modules
