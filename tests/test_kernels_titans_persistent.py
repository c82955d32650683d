"""The persistent Titans forward (:mod:`mnemo.kernels.titans_persistent_triton`, one launch for all the chunks)
against the PyTorch chunk loop and the token-by-token reference: Triton's interpreter on the CPU, tiny shapes."""

from __future__ import annotations

import pytest
import torch

from mnemo.kernels.backend import use_backend
from mnemo.kernels.mlp_memory import ChunkOperator, MLPMemorySpec, grad_factors, memory_apply
from mnemo.kernels.titans import TitansState, chunk_titans, reference_titans, titans_coefficients
from mnemo.kernels.titans_chunk import chunk_memory

pytest.importorskip("triton")
import mnemo.kernels.titans_persistent_triton as persistent  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Which path a call takes: on CUDA, float32 problems keep the per-chunk launches (their exact products
# spill the persistent kernel), so the tests of that choice run on the interpreter; the kernels themselves
# are checked on either device.
ROUTING = pytest.mark.skipif(DEVICE == "cuda", reason="float32 problems keep the per-chunk path on CUDA")

SPECS = {
    "l2": MLPMemorySpec(depth=2, d_k=16, d_v=16, expansion=4),
    "dot": MLPMemorySpec(depth=2, d_k=16, d_v=16, expansion=4, objective="dot"),
    # binds on some tokens only (their gradients' norms at the first chunk are about 10 to 24)
    "clip": MLPMemorySpec(depth=2, d_k=16, d_v=16, expansion=4, grad_clip=15.0),
    # a width that is not a power of two, a hidden layer of one whole slice of 32 and a partial one
    "l2_masked": MLPMemorySpec(depth=2, d_k=24, d_v=24, expansion=2),
}


def _error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def _chunk_problem(spec, momentum: bool, n: int, G: int, C: int, seed: int = 0):
    """Chunk-first inputs ``(n, G, C, d)``, the chunks' coefficients (the last chunk half padding) and a
    state, float32 on the test device."""
    gen = torch.Generator().manual_seed(seed)
    d, F = spec.d_k, spec.hidden
    r = lambda *s, scale=1.0: torch.randn(*s, generator=gen) * scale  # noqa: E731
    q, k = (torch.nn.functional.normalize(r(n, G, C, d), dim=-1) for _ in range(2))
    v = r(n, G, C, d)
    retention = torch.rand(n, G, 1, C, generator=gen) * 0.5 + 0.5
    eta = torch.rand(n, G, 1, C, generator=gen)
    lr = torch.rand(n, G, 1, C, generator=gen) * 0.1
    live = torch.ones(n, G, C, dtype=torch.bool)
    live[-1, :, C // 2:] = False
    a, b, c, sa, sc = (x[:, :, 0] for x in titans_coefficients(retention, eta, lr, live))
    W = {"w1": r(G, d, F, scale=0.3), "w2": r(G, F, d, scale=0.3)}
    S = {"w1": r(G, d, F, scale=0.05), "w2": r(G, F, d, scale=0.05)} if momentum else None
    if not momentum:  # the chunk takes a and c only (any values: both paths are given the same)
        b = sa = sc = None
    to = lambda x: None if x is None else x.to(DEVICE)  # noqa: E731
    return ({n_: to(w) for n_, w in W.items()}, None if S is None else {n_: to(w) for n_, w in S.items()},
            *map(to, (q, k, v, a, b, c, sa, sc)))


def _torch_loop(spec, W, S, q, k, v, a, b, c, sa, sc, every):
    """The chunks one at a time through the PyTorch chunk (float64): outputs, final state, and the state
    entering every ``every``-th chunk."""
    wide = lambda x: None if x is None else x.double()[:, None]  # noqa: E731  (G, 1, ...): one head a row
    W = {n_: wide(w) for n_, w in W.items()}
    S = None if S is None else {n_: wide(w) for n_, w in S.items()}
    ys, kept = [], []
    with use_backend("torch"):
        for i in range(q.shape[0]):
            if i % every == 0:
                kept.append((W, S))
            per = [None if x is None else wide(x[i]) for x in (q, k, v, a, b, c, sa, sc)]
            y, W, S = chunk_memory(spec, W, S, *per)
            ys.append(y[:, 0])
    return torch.stack(ys), W, S, kept


def _equals_the_torch_loop(spec, problem, every: int = 2):
    """:func:`persistent_forward` on ``problem`` (``W, S, q, k, v, a, b, c, sa, sc``) against :func:`_torch_loop`:
    outputs, final weights and momenta, and the checkpoints every ``every`` chunks to 1e-5. Returns the
    kernel's result, the loop's outputs and its checkpoints."""
    W, S = problem[:2]
    res = persistent.persistent_forward(spec, *problem, checkpoint_every=every)
    y, W_end, S_end, kept = _torch_loop(spec, *problem, every=every)
    assert _error(res.y, y) < 1e-5
    for n_ in W:
        assert _error(res.weights[n_], W_end[n_][:, 0]) < 1e-5, n_
        if S is not None:
            assert _error(res.momentum[n_], S_end[n_][:, 0]) < 1e-5, n_
    assert (res.momentum is None) == (S is None)
    ck_W, ck_S = res.checkpoints
    assert ck_W["w1"].shape[0] == len(kept)
    for j, (W_j, S_j) in enumerate(kept):
        for n_ in W:
            assert _error(ck_W[n_][j], W_j[n_][:, 0]) < 1e-5, (j, n_)
            if S is not None:
                assert _error(ck_S[n_][j], S_j[n_][:, 0]) < 1e-5, (j, n_)
    return res, y, kept


@pytest.mark.parametrize("name, slice_, C, momentum", [
    ("l2", 16, 16, True), ("l2", 16, 16, False), ("l2", 64, 16, True), ("dot", 32, 16, True), ("dot", 32, 16, False),
    ("clip", 16, 16, True), ("clip", 16, 16, False), ("l2_masked", 32, 12, True)])
def test_persistent_forward_equals_the_torch_chunk_loop(name, slice_, C, momentum, monkeypatch):
    """Outputs, final weights and momenta, and the checkpoints every two chunks (of five), against the
    PyTorch chunk run chunk by chunk in float64; float32 with IEEE products here."""
    monkeypatch.setitem(persistent.BLOCKS, "slice", slice_)
    spec = SPECS[name]
    problem = _chunk_problem(spec, momentum, n=5, G=2, C=C)
    W = problem[0]
    res, _, kept = _equals_the_torch_loop(spec, problem)
    assert len(kept) == 3
    for n_ in W:  # the carried state is left as it was
        assert not torch.equal(res.weights[n_], W[n_])


def _window_problem(spec, momentum: bool, n: int, G: int, C: int, window: int, seed: int = 0):
    """:func:`_chunk_problem` with Atlas' Omega window: each chunk's keys and values are the ``window - 1``
    tokens before it and its own (zeros before the first token), with the chunks' coefficients from
    :func:`~mnemo.kernels.atlas.atlas_coefficients` (the last chunk half padding)."""
    from mnemo.kernels.atlas import atlas_coefficients

    gen = torch.Generator().manual_seed(seed)
    d, F, P = spec.d_k, spec.hidden, window - 1
    r = lambda *s, scale=1.0: torch.randn(*s, generator=gen) * scale  # noqa: E731
    q = torch.nn.functional.normalize(r(n, G, C, d), dim=-1)
    pad = lambda x: torch.cat([x.new_zeros(G, P, *x.shape[2:]), x], 1)  # noqa: E731  (G, P + n C, ...)
    k = pad(torch.nn.functional.normalize(r(G, n * C, d), dim=-1))
    v = pad(r(G, n * C, d))
    gamma = pad(torch.rand(G, n * C, generator=gen))
    windowed = lambda x: torch.stack([x[:, i * C:i * C + P + C] for i in range(n)])  # noqa: E731  (n, G, K, ...)
    retention = torch.rand(n, G, 1, C, generator=gen) * 0.5 + 0.5
    # momenta near 1: the window's keys reach the chunk's final momentum through the product of the chunk's
    # gates, which uniform ones would make about 2^-C, and so untested
    eta = torch.rand(n, G, 1, C, generator=gen) * 0.1 + 0.9
    lr = torch.rand(n, G, 1, C, generator=gen) * 0.1
    live = torch.ones(n, G, C, dtype=torch.bool)
    live[-1, :, C // 2:] = False
    pos = torch.arange(P + C)
    inside = (pos[None, :] <= pos[P:, None]) & (pos[P:, None] <= pos[None, :] + P)
    a, b, c, sa, sc = (x[:, :, 0] for x in atlas_coefficients(
        "momentum" if momentum else "gd", inside, windowed(gamma)[:, :, None], retention, lr, eta, live))
    W = {"w1": r(G, d, F, scale=0.3), "w2": r(G, F, d, scale=0.3)}
    S = {"w1": r(G, d, F, scale=0.05), "w2": r(G, F, d, scale=0.05)} if momentum else None
    if not momentum:
        b = sa = sc = None
    to = lambda x: None if x is None else x.to(DEVICE)  # noqa: E731
    return ({n_: to(w) for n_, w in W.items()}, None if S is None else {n_: to(w) for n_, w in S.items()},
            *map(to, (q, windowed(k), windowed(v), a, b, c, sa, sc)))


@pytest.mark.parametrize("name, window, C, momentum, warps, window_warps", [
    ("l2", 4, 16, True, 4, None), ("l2", 4, 16, False, 4, None), ("clip", 5, 16, True, 4, None),
    ("dot", 17, 16, False, 4, None), ("l2_masked", 3, 12, True, 4, None), ("l2", 4, 16, True, 8, None),
    ("dot", 17, 16, False, 8, None), ("l2", 4, 16, False, 8, 4)])
def test_persistent_forward_with_an_omega_window_equals_the_torch_chunk_loop(name, window, C, momentum, warps,
                                                                            window_warps, monkeypatch):
    """Atlas' chunks (``gd``, ``momentum``): each chunk's gradients over its own keys and the ``window - 1``
    before it, those a second block of key rows (15 of a block of 32 with the window of 16 Atlas takes at its
    eight warps; here 3 of 16, 16 of 16 and 2 of 16 at four warps, 3 and 16 of 32 at eight, the block padded
    as ``least_rows_wide`` asks, and 3 of 16 where ``warps_window`` takes four warps instead). Outputs, final
    state and checkpoints against the PyTorch chunk in float64, as for Titans; then dropping the window's keys
    from the kernel gives other outputs."""
    monkeypatch.setitem(persistent.BLOCKS, "slice", 32)
    monkeypatch.setitem(persistent.BLOCKS, "warps_narrow", warps)
    monkeypatch.setitem(persistent.BLOCKS, "warps_window", window_warps)
    launches = []
    monkeypatch.setattr(persistent, "_persistent_kernel", _Recording(persistent._persistent_kernel, launches))
    spec = SPECS[name]
    problem = _window_problem(spec, momentum, n=4, G=2, C=C, window=window)
    W, S, q, k, v, a, b, c, sa, sc = problem
    _, y, _ = _equals_the_torch_loop(spec, problem)
    used = window_warps or warps
    assert [(launch["BP"], launch["num_warps"]) for launch in launches] == [(16 if used == 4 else 32, used)]
    P = window - 1
    without = persistent.persistent_forward(spec, W, S, q, k[:, :, P:], v[:, :, P:], a, b, c[..., P:], sa,
                                            None if sc is None else sc[..., P:])
    assert _error(without.y, y) > 1e-3


class _Recording:
    """A kernel whose launches record their keyword arguments, then launch."""

    def __init__(self, kernel, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(kwargs)
            return self.kernel[grid](*args, **kwargs)
        return launch


def test_the_persistent_kernel_refuses_keys_it_cannot_take():
    spec = SPECS["l2"]
    W, S, q, k, v, a, b, c, sa, sc = _window_problem(spec, True, n=2, G=1, C=16, window=4)
    with pytest.raises(ValueError, match="keys' rows"):
        persistent.persistent_forward(spec, W, S, q, k, v[:, :, 1:], a, b, c, sa, sc)
    assert persistent.covers(spec, 64, 65) and not persistent.covers(spec, 64, 66)
    with pytest.raises(ValueError, match="window"):
        persistent.persistent_forward(spec, W, S, q, k[:, :, 4:], v[:, :, 4:], a, b, c[..., 4:], sa, sc[..., 4:])


@pytest.mark.parametrize("momentum", [True, False], ids=["momentum", "no_momentum"])
def test_rows_that_stop_inside_a_chunk_keep_that_chunks_start_weights(momentum, monkeypatch):
    """``stop_chunk``: a row whose last token falls inside chunk 2 (of four) gets the weights entering
    chunk 2 as its chunk-start weights, a row that stops nowhere keeps the ones it had; the reads and the
    final memory are those of the call without it. Runs on either device: on CUDA this is the check that
    lets calls whose rows stop inside a chunk take the kernel there."""
    monkeypatch.setitem(persistent.BLOCKS, "slice", 32)
    spec = SPECS["l2"]
    W, S, q, k, v, a, b, c, sa, sc = _chunk_problem(spec, momentum, n=4, G=2, C=16, seed=6)
    before = {n_: torch.randn(w.shape, generator=torch.Generator().manual_seed(7)).to(DEVICE) for n_, w in W.items()}
    stop = torch.tensor([2, -1], dtype=torch.int32, device=DEVICE)
    res = persistent.persistent_forward(spec, W, S, q, k, v, a, b, c, sa, sc, stop_chunk=stop, chunk_start=before)
    plain = persistent.persistent_forward(spec, W, S, q, k, v, a, b, c, sa, sc)
    _, _, _, kept = _torch_loop(spec, W, S, q, k, v, a, b, c, sa, sc, every=1)
    for n_ in W:
        assert _error(res.chunk_start[n_][0], kept[2][0][n_][0, 0]) < 1e-5, n_
        assert torch.equal(res.chunk_start[n_][1], before[n_][1]), n_
        assert torch.equal(res.weights[n_], plain.weights[n_]), n_
    assert torch.equal(res.y, plain.y)


def test_the_clip_binds_on_some_tokens_only():
    spec = SPECS["clip"]
    W, _, _, k, v, *_ = _chunk_problem(spec, True, n=5, G=3, C=16)
    factors = grad_factors(SPECS["l2"], {n_: w[:, None] for n_, w in W.items()}, k[0][:, None], v[0][:, None])
    norms = sum(A.pow(2).sum(-1) * B.pow(2).sum(-1) for A, B in factors.values()).sqrt()
    assert (norms > spec.grad_clip).any() and (norms < spec.grad_clip).any()


B, H, T, C_TITANS = 2, 2, 40, 16


def _titans_problem(spec, momentum: bool, seed: int = 1, length: int = T):
    gen = torch.Generator().manual_seed(seed)
    d = spec.d_k
    init = {n_: torch.randn(H, *s, generator=gen) * 0.3 for n_, s in spec.shapes.items()}
    q, k, v = (torch.randn(B, length, H, d, generator=gen) for _ in range(3))
    retention = torch.rand(B, length, H, generator=gen) * 0.5 + 0.5
    eta = torch.rand(B, length, H, generator=gen) if momentum else torch.zeros(B, length, H)
    lr = torch.rand(B, length, H, generator=gen) * 0.1
    return init, q, k, v, retention, eta, lr


@pytest.fixture
def persistent_calls(monkeypatch):
    """Slices of 32 (two at hidden 64) and a list that records each launch of the persistent forward."""
    monkeypatch.setitem(persistent.BLOCKS, "slice", 32)
    calls = []
    real = persistent.persistent_forward
    monkeypatch.setattr(persistent, "persistent_forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def _state_error(got: TitansState, want: TitansState) -> float:
    assert torch.equal(got.position, want.position)
    return max(_error(getattr(got, group)[n_], getattr(want, group)[n_])
               for group in ("weights", "momentum", "chunk_start") for n_ in got.weights)


def _rows_from(x: torch.Tensor, start: torch.Tensor, width: int) -> torch.Tensor:
    """Tokens ``start_b .. start_b + width`` of each row (clamped at the end)."""
    idx = (start[:, None] + torch.arange(width)[None]).clamp(max=x.shape[1] - 1).to(x.device)
    return x.gather(1, idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand(*idx.shape, *x.shape[2:]))


@ROUTING
@pytest.mark.parametrize("momentum", [True, False], ids=["momentum", "no_momentum"])
def test_chunk_titans_without_gradients_takes_the_persistent_kernel(momentum, persistent_calls):
    """B=2, H=2, d=16, hidden 64, chunk 16, rows of 40 and 29 tokens in two calls: the first call (25 and
    12 tokens) ends inside the second and the first chunk; on the Triton backend without gradients it is
    one persistent launch with the PyTorch path's outputs and state (chunk-start weights included). The
    second call resumes mid-chunk from that state, which the chunked path takes (no second launch), and
    both calls together equal the float64 reference."""
    spec = SPECS["l2"]
    init, q, k, v, retention, eta, lr = _titans_problem(spec, momentum)
    lengths, takes = torch.tensor([T, 29]), torch.tensor([25, 12])
    args = [x.to(DEVICE) for x in (q, k, v, retention, eta, lr)]
    first = [x[:, :25] for x in args]
    rest = [_rows_from(x, takes, 17) for x in args]
    outs, states = {}, {}
    for backend in ("torch", "triton"):
        with use_backend(backend), torch.no_grad():
            state = TitansState.initial({n_: w.to(DEVICE) for n_, w in init.items()}, B)
            o1, state = chunk_titans(spec, *first, state, chunk_size=C_TITANS, lengths=takes.to(DEVICE))
            states[backend, 1] = state
            o2, state = chunk_titans(spec, *rest, state, chunk_size=C_TITANS, lengths=(lengths - takes).to(DEVICE))
            states[backend, 2] = state
            outs[backend] = [torch.cat([o1[b, :takes[b]], o2[b, :lengths[b] - takes[b]]]).cpu() for b in range(B)]
        if backend == "triton":
            assert persistent_calls == [1]
    assert _state_error(states["triton", 1], states["torch", 1]) < 1e-5
    assert _state_error(states["triton", 2], states["torch", 2]) < 1e-5
    ref = reference_titans(spec, *(x.double() for x in (q, k, v, retention, eta, lr)),
                           {n_: w.double() for n_, w in init.items()}, chunk_size=C_TITANS, lengths=lengths)
    for backend in ("torch", "triton"):
        for b in range(B):
            assert _error(outs[backend][b], ref[b, :lengths[b]]) < 1e-5, (backend, b)


@ROUTING
def test_a_whole_call_equals_the_torch_path_and_the_reference(persistent_calls):
    """The plain prefill: every row from the initial state over T=40 tokens (two whole chunks and a tail)."""
    spec = SPECS["clip"]
    init, q, k, v, retention, eta, lr = _titans_problem(spec, True, seed=2)
    args = [x.to(DEVICE) for x in (q, k, v, retention, eta, lr)]
    got = {}
    for backend in ("torch", "triton"):
        with use_backend(backend), torch.no_grad():
            state = TitansState.initial({n_: w.to(DEVICE) for n_, w in init.items()}, B)
            got[backend] = chunk_titans(spec, *args, state, chunk_size=C_TITANS)
    assert persistent_calls == [1]
    assert _error(got["triton"][0], got["torch"][0]) < 1e-5
    assert _state_error(got["triton"][1], got["torch"][1]) < 1e-5
    ref = reference_titans(spec, *(x.double() for x in (q, k, v, retention, eta, lr)),
                           {n_: w.double() for n_, w in init.items()}, chunk_size=C_TITANS)
    assert _error(got["triton"][0].cpu(), ref) < 1e-5


def test_the_persistent_kernel_is_left_where_it_does_not_apply(persistent_calls, monkeypatch):
    """With gradients recorded, or ``ENABLED`` off, ``chunk_titans`` keeps the chunked path; gated memories
    and chunks past 64 are not covered."""
    spec = SPECS["l2"]
    init, q, k, v, retention, eta, lr = _titans_problem(spec, True)
    args = [x[:, :8].to(DEVICE) for x in (q, k, v, retention, eta, lr)]
    state = TitansState.initial({n_: w.to(DEVICE) for n_, w in init.items()}, B)
    with use_backend("triton"):
        leaf = args[0].clone().requires_grad_()
        chunk_titans(spec, leaf, *args[1:], state, chunk_size=C_TITANS)[0].sum().backward()
        assert leaf.grad is not None
    assert persistent_calls == []
    monkeypatch.setattr(persistent, "ENABLED", False)
    with use_backend("triton"), torch.no_grad():
        chunk_titans(spec, *args, state, chunk_size=C_TITANS)
    assert persistent_calls == []
    assert not persistent.covers(MLPMemorySpec(depth=2, gated=True, d_k=16, d_v=16), C_TITANS)
    assert not persistent.covers(MLPMemorySpec(depth=2, d_k=16, d_v=8), C_TITANS)
    assert not persistent.covers(spec, 128)


# --------------------------------------------------------------------------- the backward


def _by_operator(spec, W, S, q, k, v, a, b, c, sa_last, sc_last):
    """One chunk as :class:`ChunkOperator` with the given coefficients: the readable definition, for autograd."""
    op = ChunkOperator.__new__(ChunkOperator)
    op.a, op.b, op.c = a, b, c
    op.sa, op.sc = sa_last[..., None], sc_last[..., None, :]  # read by final() with or without momentum
    op.W0, op.S0, op.factors = W, S, grad_factors(spec, W, k, v)
    y = memory_apply(spec, op, q)
    W_new, S_new = op.final()
    return y, W_new, (S_new if S is not None else None)


def _operator_loop(spec, W, S, q, k, v, a, b, c, sa, sc):
    W = {n_: w[:, None] for n_, w in W.items()}
    S = None if S is None else {n_: w[:, None] for n_, w in S.items()}
    ys = []
    for i in range(q.shape[0]):
        y, W, S = _by_operator(spec, W, S, *(None if x is None else x[i][:, None] for x in (q, k, v, a, b, c, sa, sc)))
        ys.append(y[:, 0])
    return [torch.stack(ys), *(w[:, 0] for w in W.values()), *(() if S is None else (w[:, 0] for w in S.values()))]


@pytest.mark.parametrize("name, momentum, slice_, C, every", [
    ("l2", True, 16, 16, 2), ("dot", False, 32, 16, 3), ("l2_masked", True, 32, 12, 1)])
def test_persistent_backward_equals_autograd_over_the_operator(name, momentum, slice_, C, every, monkeypatch):
    """Values and the gradients of the initial weights and momenta, q, k, v, the chunks' coefficients and,
    through :func:`titans_coefficients`, the three gates (four chunks, the last half padding, recomputed in
    stretches of ``every``): against autograd over the operator chunk by chunk in float64. The gates'
    gradients are held to 1e-5 or, where the coefficients' logs and exponentials lose more in float32
    (momentum gates near zero), to four times what the float32 PyTorch path loses."""
    monkeypatch.setitem(persistent.BLOCKS, "slice", slice_)
    spec = SPECS[name]
    n, G = 4, 2
    gen = torch.Generator().manual_seed(3)
    d, F = spec.d_k, spec.hidden
    r = lambda *s, scale=1.0: torch.randn(*s, generator=gen) * scale  # noqa: E731
    q, k = (torch.nn.functional.normalize(r(n, G, C, d), dim=-1) for _ in range(2))
    gates = (torch.rand(n, G, 1, C, generator=gen) * 0.5 + 0.5, torch.rand(n, G, 1, C, generator=gen),
             torch.rand(n, G, 1, C, generator=gen) * 0.1)
    live = torch.ones(n, G, C, dtype=torch.bool)
    live[-1, :, C // 2:] = False
    base = [r(G, d, F, scale=0.3), r(G, F, d, scale=0.3), r(G, d, F, scale=0.05), r(G, F, d, scale=0.05), q, k,
            r(n, G, C, d), *gates]
    if not momentum:
        base = base[:2] + base[4:]
    cotangents, got = None, {}
    for run, dtype in (("triton", torch.float32), ("torch32", torch.float32), ("exact", torch.float64)):
        leaves = [x.to(DEVICE, dtype).requires_grad_() for x in base]
        W = dict(zip(("w1", "w2"), leaves[:2]))
        S = dict(zip(("w1", "w2"), leaves[2:4])) if momentum else None
        q_, k_, v_, *g_ = leaves[-6:]
        coefficients = [x[:, :, 0] for x in titans_coefficients(*g_, live.to(DEVICE))]
        a, b, c, sa, sc = coefficients
        if run == "triton":
            y, W_new, S_new = persistent.persistent_memory(spec, W, S, q_, k_, v_, a, *(
                (b, c, sa, sc) if momentum else (None, c, None, None)), checkpoint_every=every)
            outputs = [y, *W_new.values(), *(S_new.values() if momentum else ())]
        else:
            outputs = _operator_loop(spec, W, S, q_, k_, v_, a, b, c, sa, sc)
        if cotangents is None:
            cot_gen = torch.Generator().manual_seed(4)
            cotangents = [torch.randn(t.shape, generator=cot_gen) for t in outputs]
        inputs = leaves + ([a, b, c, sa, sc] if momentum else [a, c])
        grads = torch.autograd.grad(outputs, inputs, [t.to(DEVICE, dtype) for t in cotangents])
        got[run] = (outputs, grads)
    for x, y in zip(got["triton"][0], got["exact"][0]):
        assert _error(x, y) < 1e-5
    n_gates = 3
    for i, (x, x32, y) in enumerate(zip(got["triton"][1], got["torch32"][1], got["exact"][1])):
        is_gate = len(base) - n_gates <= i < len(base)
        bound = max(1e-5, 4 * _error(x32, y)) if is_gate else 1e-5
        assert _error(x, y) < bound, f"gradient {i}: {_error(x, y):.2e} (float32 PyTorch path {_error(x32, y):.2e})"


@ROUTING
def test_chunk_titans_with_gradients_takes_the_persistent_backward_when_asked(monkeypatch):
    """``TRAINING`` on: a call that records gradients (whole chunks: two of 16) runs through
    :func:`persistent_memory`, with the outputs and the gradients of q, k, v, the gates and the learned
    initial weights of the PyTorch path, each held to float64 (the gates as in the test above); off (the
    default), it keeps the chunked path."""
    monkeypatch.setitem(persistent.BLOCKS, "slice", 32)
    calls = []
    real = persistent.persistent_memory
    monkeypatch.setattr(persistent, "persistent_memory", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    spec = SPECS["l2"]
    init, q, k, v, retention, eta, lr = _titans_problem(spec, True, seed=5)
    base = [x[:, :32] for x in (q, k, v, retention, eta, lr)] + [init["w1"], init["w2"]]
    results = {}
    runs = (("exact", "torch", False, torch.float64), ("torch", "torch", False, torch.float32),
            ("off", "triton", False, torch.float32), ("on", "triton", True, torch.float32))
    for run, backend, training, dtype in runs:
        monkeypatch.setattr(persistent, "TRAINING", training)
        leaves = [x.to(DEVICE, dtype).requires_grad_() for x in base]
        with use_backend(backend):
            o, state = chunk_titans(spec, *leaves[:6], TitansState.initial(dict(zip(("w1", "w2"), leaves[6:])), B),
                                    chunk_size=C_TITANS)
        outputs = [o, *state.weights.values(), *state.momentum.values()]
        gen = torch.Generator().manual_seed(8)
        cotangents = [torch.randn(t.shape, generator=gen).to(DEVICE, dtype) for t in outputs]
        results[run] = (outputs, torch.autograd.grad(outputs, leaves, cotangents))
        assert calls == ([1] if training else [])
    exact_out, exact_grads = results["exact"]
    for run in ("off", "on"):
        for x, y in zip(results[run][0], exact_out):
            assert _error(x, y) < 1e-5, run
        for i, (x, x32, y) in enumerate(zip(results[run][1], results["torch"][1], exact_grads)):
            bound = max(1e-5, 4 * _error(x32, y)) if 3 <= i < 6 else 1e-5
            assert _error(x, y) < bound, (run, i, _error(x, y), _error(x32, y))


@ROUTING
def test_a_titans_model_prefills_through_the_persistent_kernel(persistent_calls):
    """MC-Titans without segments (the Titans model) on the Triton backend without gradients: each layer's
    prompt (two whole chunks and half of one) is one persistent launch, with the PyTorch path's logits and
    cache; a continuation, which starts inside that chunk, and the decode steps keep their own paths, and
    greedy generation gives the PyTorch path's tokens."""
    from mnemo import MCTitansConfig, MCTitansForCausalLM

    torch.manual_seed(0)
    config = MCTitansConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_heads=2, head_dim=16,
                            memory_expansion=4, inner_chunk_size=16, segment_size=None, intermediate_size=64)
    model = MCTitansForCausalLM(config).eval()
    ids = torch.randint(1, 64, (2, 40))
    more = torch.randint(1, 64, (2, 9))
    got = {}
    for backend in ("torch", "triton"):
        with use_backend(backend), torch.no_grad():
            out = model(ids, use_cache=True)
            cache = out.past_key_values
            calls = len(persistent_calls)
            nxt = model(more, past_key_values=cache, use_cache=True).logits
            tokens = model.generate(ids, max_new_tokens=4, do_sample=False)
        got[backend] = out.logits, nxt, tokens
        if backend == "triton":
            assert calls == config.num_hidden_layers  # one launch a layer for the prompt
            # the continuation resumes mid-chunk; generate's prompt is one launch a layer again
            assert len(persistent_calls) == 2 * config.num_hidden_layers
        else:
            assert persistent_calls == []
    assert _error(got["triton"][0], got["torch"][0]) < 1e-5
    assert _error(got["triton"][1], got["torch"][1]) < 1e-5
    assert torch.equal(got["triton"][2], got["torch"][2])


# --------------------------------------------------------------------------- the forward pass of training


def _late_checkpoints(real):
    """A first pass whose second checkpoint is the first one again (stale): a mutation the tests catch."""
    def first_pass(*args, **kwargs):
        ys, carry, kept = real(*args, **kwargs)
        return ys, carry, [kept[0], kept[0], *kept[2:]]
    return first_pass


def _first_pass_equals_the_per_chunk_forward(module, call, persistent_calls, monkeypatch) -> list[torch.Tensor]:
    """``call() -> (outputs, leaves)``, a training call of a chunk loop of ``module`` (which imports
    ``loop_first_pass``), with :data:`FIRST_PASS` off, on, and on with a stale checkpoint. On: one persistent
    launch, and outputs and the gradients of every leaf (under fixed cotangents) those of the per-chunk
    forward to 1e-5; stale: other gradients. Returns the outputs with the first pass."""
    results = {}
    for run, first_pass in (("off", False), ("on", True), ("stale", True)):
        monkeypatch.setattr(persistent, "FIRST_PASS", first_pass)
        if run == "stale":
            monkeypatch.setattr(module, "loop_first_pass", _late_checkpoints(persistent.loop_first_pass))
        persistent_calls.clear()
        outputs, leaves = call()
        gen = torch.Generator().manual_seed(8)
        cotangents = [torch.randn(t.shape, generator=gen).to(DEVICE) for t in outputs]
        results[run] = (outputs, torch.autograd.grad(outputs, leaves, cotangents))
        assert persistent_calls == ([1] if first_pass else [])
    for x, y in zip(results["on"][0], results["off"][0]):
        assert _error(x, y) < 1e-5
    for i, (x, y) in enumerate(zip(results["on"][1], results["off"][1])):
        assert _error(x, y) < 1e-5, (i, _error(x, y))
    assert max(_error(x, y) for x, y in zip(results["stale"][1], results["off"][1])) > 1e-3
    return results["on"][0]


@ROUTING
@pytest.mark.parametrize("name", ["l2", "clip"])
def test_a_training_call_runs_its_forward_through_the_persistent_kernel(name, persistent_calls, monkeypatch):
    """Gradients recorded and the loop recomputing (as on CUDA, where its steps are captured), three whole
    chunks of 16 in stretches of 2: the forward pass is one persistent launch and the backward the per-chunk
    one from its checkpoints. Outputs, final state and the gradients of q, k, v, the gates and the learned
    initial weights equal those with :data:`FIRST_PASS` off (the per-chunk forward) to 1e-5, and the
    outputs the float64 reference; a stale checkpoint gives other gradients."""
    import mnemo.kernels.titans as titans_module
    from mnemo.kernels.chunk_loop import loop_options

    spec = SPECS[name]
    init, q, k, v, retention, eta, lr = _titans_problem(spec, True, seed=9, length=3 * C_TITANS)
    base = [q, k, v, retention, eta, lr, init["w1"], init["w2"]]

    def call():
        leaves = [x.to(DEVICE).requires_grad_() for x in base]
        with use_backend("triton"), loop_options(recompute=True):
            o, state = chunk_titans(spec, *leaves[:6], TitansState.initial(dict(zip(("w1", "w2"), leaves[6:])), B),
                                    chunk_size=C_TITANS, checkpoint_every=2)
        return [o, *state.weights.values(), *state.momentum.values()], leaves

    outputs = _first_pass_equals_the_per_chunk_forward(titans_module, call, persistent_calls, monkeypatch)
    ref = reference_titans(spec, *(x.double() for x in base[:6]), {n_: w.double() for n_, w in init.items()},
                           chunk_size=C_TITANS)
    assert _error(outputs[0].detach().cpu(), ref) < 1e-5


@ROUTING
def test_mc_titans_trains_with_its_segments_forward_through_the_persistent_kernel(persistent_calls, monkeypatch):
    """An MC-Titans model (segments of 32, chunks of 16, 64 tokens: two segments a layer, two layers) in
    training with the loop recomputing: each layer's online memory runs every segment forward in one
    persistent launch (its checkpoints at the segments' ends are the memories to cache), twice a layer (the
    forward without gradients, then again in the backward: ``recompute_memory``), and the loss and every
    parameter's gradient equal those with :data:`FIRST_PASS` off to 1e-5."""
    from mnemo import MCTitansConfig, MCTitansForCausalLM
    from mnemo.kernels.chunk_loop import loop_options

    torch.manual_seed(0)
    config = MCTitansConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=16,
                            memory_expansion=4, inner_chunk_size=16, segment_size=32, intermediate_size=64)
    model = MCTitansForCausalLM(config)
    ids = torch.randint(1, 64, (2, 64))
    got = {}
    for run, backend, first_pass in (("off", "triton", False), ("on", "triton", True), ("exact", "torch", False)):
        monkeypatch.setattr(persistent, "FIRST_PASS", first_pass)
        persistent_calls.clear()
        model.zero_grad()
        model.to(torch.float64 if run == "exact" else torch.float32)
        with use_backend(backend), loop_options(recompute=True):
            loss = model(ids, labels=ids).loss
            loss.backward()
        got[run] = loss.detach(), {n_: p.grad.clone() for n_, p in model.named_parameters()}
        assert config.memory_recomputed
        assert len(persistent_calls) == (2 * config.num_hidden_layers if first_pass else 0)
    assert _error(got["on"][0], got["off"][0]) < 1e-6
    for n_, g in got["on"][1].items():
        # Gradients of about 1e-8 (u's, through the cache's gates) lose more than 1e-5 to float32 rounding in
        # either path: held to twice what the per-chunk path loses against float64.
        off, exact = got["off"][1][n_], got["exact"][1][n_]
        assert _error(g, exact) < max(1e-5, 2 * _error(off, exact)), (n_, _error(g, exact), _error(off, exact))


def _atlas_problem(spec, seed: int, length: int):
    """Atlas' inputs (already feature-mapped) for :func:`~mnemo.kernels.atlas.chunk_atlas`: ``(B, length, H,
    ...)`` and the learned initial weights ``(H, ...)``."""
    gen = torch.Generator().manual_seed(seed)
    init = {n_: torch.randn(H, *s, generator=gen) * 0.3 for n_, s in spec.shapes.items()}
    q, k = (torch.nn.functional.normalize(torch.randn(B, length, H, spec.d_k, generator=gen), dim=-1)
            for _ in range(2))
    v = torch.randn(B, length, H, spec.d_v, generator=gen)
    retention = torch.rand(B, length, H, generator=gen) * 0.5 + 0.5
    lr = torch.rand(B, length, H, generator=gen) * 0.1
    eta = torch.rand(B, length, H, generator=gen) * 0.9
    gamma = torch.rand(B, length, H, generator=gen)
    return init, [q, k, v, retention, lr, eta, gamma]


def _atlas_in_two_calls_equals_the_torch_path(optimizer: str, seed: int, cut: int, launches: list, persistent_calls):
    """Atlas (Omega window 5, chunks of 16, the clip) over 48 tokens in two calls, ``cut`` tokens then the rest,
    without gradients on each backend: the Triton one makes ``launches`` persistent launches, and its outputs
    and state equal the PyTorch path's, and the outputs the float64 reference, to 1e-5."""
    from mnemo.kernels.atlas import AtlasState, chunk_atlas, reference_atlas

    spec, window = SPECS["clip"], 5
    init, xs = _atlas_problem(spec, seed=seed, length=3 * C_TITANS)
    if optimizer == "gd":
        xs[5] = None
    opts = dict(optimizer=optimizer, omega_window=window, chunk_size=C_TITANS)
    outs, states = {}, {}
    for backend in ("torch", "triton"):
        with use_backend(backend), torch.no_grad():
            state = AtlasState.initial(spec, {n_: w.to(DEVICE) for n_, w in init.items()}, B, H, window, optimizer)
            parts = []
            for lo, hi in ((0, cut), (cut, 3 * C_TITANS)):
                o, state = chunk_atlas(spec, *(None if x is None else x[:, lo:hi].to(DEVICE) for x in xs), state,
                                       **opts)
                parts.append(o)
            outs[backend], states[backend] = torch.cat(parts, 1).cpu(), state
    assert persistent_calls == launches
    assert _error(outs["triton"], outs["torch"]) < 1e-5
    for name, t in states["torch"].tensors().items():
        got = states["triton"].tensors()[name]
        assert (torch.equal(got, t) if not t.is_floating_point() else _error(got, t) < 1e-5), name
    ref = reference_atlas(spec, *(None if x is None else x.double() for x in xs),
                          {n_: w.double() for n_, w in init.items()}, **opts)
    assert _error(outs["triton"], ref) < 1e-5


@ROUTING
@pytest.mark.parametrize("optimizer", ["gd", "momentum"])
def test_chunk_atlas_without_gradients_takes_the_persistent_kernel(optimizer, persistent_calls):
    """Atlas (Omega window 5, chunks of 16, the clip) over 48 tokens in two calls of 32 and 16, both from
    chunk boundaries: on the Triton backend without gradients each call is one persistent launch, the
    second with the window the first left in the state. Outputs and state equal the PyTorch path's, and
    both calls together the float64 reference."""
    _atlas_in_two_calls_equals_the_torch_path(optimizer, 4, 2 * C_TITANS, [1, 1], persistent_calls)


@ROUTING
@pytest.mark.parametrize("optimizer", ["gd", "momentum"])
def test_an_atlas_training_call_runs_its_forward_through_the_persistent_kernel(optimizer, persistent_calls,
                                                                                monkeypatch):
    """Atlas' ``gd`` and ``momentum`` chunks (window 5, the clip) in training with the loop recomputing,
    three chunks in stretches of 2 (as on CUDA): the forward pass is one persistent launch and the backward
    the per-chunk one from its checkpoints. Outputs, final state and the gradients of every input and of
    the initial weights equal those with :data:`FIRST_PASS` off to 1e-5; a stale checkpoint gives other
    gradients."""
    import mnemo.kernels.atlas as atlas_module
    from mnemo.kernels.atlas import AtlasState, chunk_atlas
    from mnemo.kernels.chunk_loop import loop_options

    spec, window = SPECS["clip"], 5
    init, xs = _atlas_problem(spec, seed=5, length=3 * C_TITANS)
    if optimizer == "gd":
        xs = xs[:5] + xs[6:]

    def call():
        leaves = [x.to(DEVICE).requires_grad_() for x in (*xs, *init.values())]
        inputs = leaves[:len(xs)]
        if optimizer == "gd":
            inputs.insert(5, None)
        state = AtlasState.initial(spec, dict(zip(init, leaves[len(xs):])), B, H, window, optimizer)
        with use_backend("triton"), loop_options(recompute=True, checkpoint_every=2):
            o, state = chunk_atlas(spec, *inputs, state, optimizer=optimizer, omega_window=window,
                                   chunk_size=C_TITANS)
        return [o, *state.weights.values(), *(state.momentum or {}).values()], leaves

    _first_pass_equals_the_per_chunk_forward(atlas_module, call, persistent_calls, monkeypatch)


@ROUTING
@pytest.mark.parametrize("optimizer", ["gd", "momentum"])
def test_atlas_calls_that_stop_or_resume_inside_a_chunk_keep_the_per_chunk_path(optimizer, persistent_calls):
    """Atlas over 48 tokens in calls of 24 and 24 (chunks of 16): the first stops inside its second chunk and the
    second resumes there, which the persistent kernel does not take (the chunk-start weights such rows keep):
    no launch, and the outputs and state those of the PyTorch path and the float64 reference."""
    _atlas_in_two_calls_equals_the_torch_path(optimizer, 6, 24, [], persistent_calls)
