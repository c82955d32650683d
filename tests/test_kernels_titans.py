"""Titans memory and Memory Caching kernels: closed-form gradients, reference == chunked == step."""

from __future__ import annotations

import itertools

import pytest
import torch

from mnemo.kernels.memory_caching import MCOptions, log_segments
from mnemo.kernels.mc_titans import MCState, chunk_mc_titans, reference_mc_titans, step_mc_titans
from mnemo.kernels.mlp_memory import MLPMemorySpec, grad_factors, memory_apply, static_apply
from mnemo.kernels.titans import TitansState, chunk_titans, reference_titans, step_titans

B, T, H, D = 3, 21, 2, 4
SPECS = {
    "linear": MLPMemorySpec(depth=1, d_k=D, d_v=D),
    "mlp": MLPMemorySpec(depth=2, d_k=D, d_v=D, expansion=2),
    "gated": MLPMemorySpec(depth=2, gated=True, d_k=D, d_v=D, expansion=2),
}


def inputs(spec, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    init = {n: torch.randn(H, *s, generator=gen, dtype=dtype) * 0.5 for n, s in spec.shapes.items()}
    q, k, v, u = (torch.randn(B, T, H, D, generator=gen, dtype=dtype) for _ in range(4))
    alpha = torch.rand(B, T, H, generator=gen, dtype=dtype) * 0.5 + 0.5
    eta = torch.rand(B, T, H, generator=gen, dtype=dtype)
    theta = torch.rand(B, T, H, generator=gen, dtype=dtype) * 0.05
    return init, q, k, v, u, alpha, eta, theta


def pieces(xs, takes):
    """Feed rows in calls of different sizes: yields (per-call tensors, take, start)."""
    consumed = torch.zeros(B, dtype=torch.long)
    for take in takes:
        width = max(int(take.max()), 1)
        idx = (consumed[:, None] + torch.arange(width)[None]).clamp(max=T - 1)
        yield [x.gather(1, idx.view(B, width, *([1] * (x.dim() - 2))).expand(B, width, *x.shape[2:])) for x in xs], \
            take, consumed.clone()
        consumed += take


TAKES = [torch.tensor([3, 2, 6]), torch.tensor([1, 1, 0]), torch.tensor([9, 4, 1]), torch.tensor([8, 0, 8])]
LENGTHS = torch.stack(TAKES).sum(0)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_closed_form_gradients_equal_autograd(name):
    spec = SPECS[name]
    init, q, k, v, *_ = inputs(spec)
    weights = {n: w.clone().requires_grad_() for n, w in init.items()}
    loss = (memory_apply(spec, static_apply(weights), k[0, :1].transpose(0, 1)) - v[0, :1].transpose(0, 1)).pow(2).sum()
    loss.backward()
    factors = grad_factors(spec, init, k[0, :1].transpose(0, 1), v[0, :1].transpose(0, 1))
    for n, (A, Bf) in factors.items():
        torch.testing.assert_close(A[:, 0, :, None] * Bf[:, 0, None, :], weights[n].grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name, chunk", list(itertools.product(sorted(SPECS), [1, 4, 5, 64])))
def test_titans_reference_chunk_step_agree(name, chunk):
    spec = SPECS[name]
    init, q, k, v, _, alpha, eta, theta = inputs(spec)
    ref = reference_titans(spec, q, k, v, alpha, eta, theta, init, chunk_size=chunk)
    out, _ = chunk_titans(spec, q, k, v, alpha, eta, theta, TitansState.initial(init, B), chunk_size=chunk)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    state, steps = TitansState.initial(init, B), []
    for t in range(T):
        o, state = step_titans(spec, q[:, t], k[:, t], v[:, t], alpha[:, t], eta[:, t], theta[:, t], state,
                               chunk_size=chunk)
        steps.append(o)
    torch.testing.assert_close(torch.stack(steps, 1), ref, rtol=0, atol=1e-12)
    # ragged rows fed in pieces that stop mid-chunk
    ref = reference_titans(spec, q, k, v, alpha, eta, theta, init, chunk_size=chunk, lengths=LENGTHS)
    state = TitansState.initial(init, B)
    for part, take, start in pieces((q, k, v, alpha, eta, theta), TAKES):
        o, state = chunk_titans(spec, *part, state, chunk_size=chunk, lengths=take)
        for b in range(B):
            n, s = int(take[b]), int(start[b])
            torch.testing.assert_close(o[b, :n], ref[b, s:s + n], rtol=0, atol=1e-12)


MC_COMBOS = [
    (seg, segm, mode, agg)
    for seg, segm, mode, agg in itertools.product(
        [None, 5, 8], ["constant", "logarithmic"], ["checkpoint", "independent"],
        ["residual", "grm", "soup", "ssc", "mean"],
    )
    if not (segm == "logarithmic" and (mode == "independent" or seg != 5))
]


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("seg, segm, mode, agg", MC_COMBOS)
def test_mc_reference_chunk_step_agree(depth, seg, segm, mode, agg):
    spec = SPECS["linear" if depth == 1 else "mlp"]
    opts = MCOptions(segment_size=seg, segmentation=segm, cache_mode=mode, aggregation=agg, ssc_topk=1, chunk_size=3)
    init, *xs = inputs(spec, seed=depth)
    ref = reference_mc_titans(spec, opts, *xs, init)
    out, _ = chunk_mc_titans(spec, opts, *xs, init, MCState.initial(init, B, D))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    state, steps = MCState.initial(init, B, D), []
    for t in range(T):
        o, state = step_mc_titans(spec, opts, *(x[:, t] for x in xs), init, state)
        steps.append(o)
    torch.testing.assert_close(torch.stack(steps, 1), ref, rtol=0, atol=1e-12)
    ref = reference_mc_titans(spec, opts, *xs, init, lengths=LENGTHS)
    state = MCState.initial(init, B, D)
    for part, take, start in pieces(xs, TAKES):
        o, state = chunk_mc_titans(spec, opts, *part, init, state, lengths=take)
        for b in range(B):
            n, s = int(take[b]), int(start[b])
            torch.testing.assert_close(o[b, :n], ref[b, s:s + n], rtol=0, atol=1e-12)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("agg, seg", [("residual", 4), ("grm", 4), ("ssc", 4), ("ssc", 2), ("mean", 4)])
@pytest.mark.parametrize("batch", ["memory by memory", "by width", "all at once"])
def test_mc_whole_segments_in_one_loop_equal_the_reference(depth, agg, seg, batch, monkeypatch):
    """The training path: whole segments of whole chunks in one loop, the cache read after it in batches
    of memories (one memory each, as many as hidden layers of 24 queries hold, or as many as the widths allow).
    Outputs and gradients equal the reference's, from an empty state and from one holding cached memories,
    with rows ending at different segments; the state it leaves equals the one-token steps' (same slots).
    ssc over ten segments: most memories read only the queries that chose them."""
    import mnemo.kernels.mc_titans as mc

    spec = SPECS["linear" if depth == 1 else "mlp"]
    per_query = B * H * spec.d_v * (spec.expansion if depth == 2 else 1)
    budget = {"memory by memory": 1, "by width": 24 * per_query, "all at once": 1 << 40}[batch]
    monkeypatch.setattr(mc, "READ_BATCH_ELEMENTS", budget)
    calls = []
    read_batches = mc._read_batches
    monkeypatch.setattr(mc, "_read_batches", lambda *a: calls.append(read_batches(*a)) or calls[-1])
    taken = []
    one_loop = mc._segments_in_one_loop
    monkeypatch.setattr(mc, "_segments_in_one_loop", lambda *a, **k: taken.append(1) or one_loop(*a, **k))
    opts = MCOptions(segment_size=seg, aggregation=agg, ssc_topk=1, chunk_size=2)
    init, *xs = inputs(spec, seed=5 + depth)
    xs = [x[:, :20].clone().requires_grad_() for x in xs]
    init = {n: w.clone().requires_grad_() for n, w in init.items()}
    lengths = torch.tensor([20, 12, 16])  # the second call closes 3, 1 and 2 segments
    ref = reference_mc_titans(spec, opts, *xs, init, lengths=lengths)
    state = MCState.initial(init, B, D)
    first, state = chunk_mc_titans(spec, opts, *(x[:, :8] for x in xs), init, state)
    second, state = chunk_mc_titans(spec, opts, *(x[:, 8:] for x in xs), init, state, lengths=lengths - 8)
    assert len(taken) == 2
    sizes = [b.last - b.first for batches in calls for b in batches]
    assert max(sizes) == 1 if batch == "memory by memory" else max(sizes) > 1
    # by width: the state's two memories (12 queries each) together, the later ones apart
    assert batch != "by width" or sum(map(len, calls)) > len(calls)
    out = torch.cat([first, second], 1) * (torch.arange(20)[None] < lengths[:, None])[..., None, None]
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    probe = torch.randn_like(ref)
    leaves = [*xs, *init.values()]
    grads = torch.autograd.grad((out * probe).sum(), leaves, allow_unused=True)
    expected = torch.autograd.grad((ref * probe).sum(), leaves, allow_unused=True)
    for leaf, g, e in zip(leaves, grads, expected):  # the gates' projection u is unused by residual / mean
        zero = torch.zeros_like(leaf)
        torch.testing.assert_close(zero if g is None else g, zero if e is None else e, rtol=0, atol=1e-10)

    steps = MCState.initial(init, B, D)
    for t in range(20):
        live = t < lengths
        _, steps = step_mc_titans(spec, opts, *(x[:, t] for x in xs), init, steps, live=live)
    assert torch.equal(state.num_cached, steps.num_cached) and torch.equal(state.seen, steps.seen)
    for name in ("key_sum", "key_count", "cached_key_sum", "cached_key_count"):
        torch.testing.assert_close(getattr(state, name), getattr(steps, name), rtol=0, atol=1e-12)
    for name, w in state.cached.items():
        torch.testing.assert_close(w, steps.cached[name], rtol=0, atol=1e-12)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("budget", [1, 24, 1 << 40])
def test_cached_reads_in_batches_equal_the_reads_memory_by_memory(depth, budget, monkeypatch):
    """The cache's reads in batches of memories (:class:`~mnemo.kernels.mc_titans._CachedReads`) equal
    ``sum_j g_j M_j(q)`` written memory by memory, with gradients, for memories that read every query from
    their start and memories that read only the few queries whose gate of them is nonzero; batched one by
    one, by a budget of 24 queries' hidden layers, or all that the widths allow (several selective memories
    per batch, which add into the same queries). The gates' gradients are compared where a gate is nonzero:
    elsewhere the aggregation's softmax gives them weight zero."""
    import mnemo.kernels.mc_titans as mc

    spec = SPECS["linear" if depth == 1 else "mlp"]
    monkeypatch.setattr(mc, "READ_BATCH_ELEMENTS", budget * 2 * spec.d_v * (spec.expansion if depth == 2 else 1))
    Tq, starts = 24, (0, 0, 4, 8, 12, 16)
    N = len(starts)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, Tq, D, generator=gen, dtype=torch.float64, requires_grad=True)
    weights = [(torch.randn(N, 1, 2, *shape, generator=gen, dtype=torch.float64) * 0.5).requires_grad_()
               for shape in spec.shapes.values()]
    g = torch.rand(N, 1, 2, Tq, generator=gen, dtype=torch.float64)
    g = g * (torch.arange(Tq)[None] >= torch.tensor(starts)[:, None])[:, None, None]
    few = torch.rand(N, 1, 2, Tq, generator=gen) < 0.2  # memories 2.. read a few queries each
    few[2:, :, :, -1] = True  # ... at least the last (so every one of them is read)
    g = torch.where(torch.arange(N)[:, None, None, None] >= 2, g * few, g).requires_grad_()

    batches = mc._read_batches(spec, g.detach(), starts, True, 2)
    picked = [b.last - b.first for b in batches if b.pick is not None]
    assert picked and sum(picked) == N - 2 and (max(picked) > 1) == (budget > 1)
    got = mc._CachedReads.apply(spec, False, batches, q, g, *weights)
    expected = sum(g[j, ..., None] * memory_apply(spec, static_apply({n: w[j] for n, w in zip(spec.shapes, weights)}),
                                                  q) for j in range(N))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    probe = torch.randn_like(expected)
    got_grads = torch.autograd.grad((got * probe).sum(), (q, g, *weights))
    expected_grads = torch.autograd.grad((expected * probe).sum(), (q, g, *weights))
    for i, (a, b) in enumerate(zip(got_grads, expected_grads)):
        if i == 1:
            a, b = a * (g > 0), b * (g > 0)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_the_keys_entering_each_segment_follow_the_rows_closes():
    """``_entering`` (one cumulative sum) equals the segment-by-segment running sum that resets where a row
    closes a segment, from a state with keys of its own, for rows that close all, some or none of the
    segments."""
    import mnemo.kernels.mc_titans as mc

    gen = torch.Generator().manual_seed(4)
    n = 5
    state = torch.randn(4, 2, 3, generator=gen, dtype=torch.float64)
    per_segment = torch.randn(4, n, 2, 3, generator=gen, dtype=torch.float64)
    closed = torch.tensor([n, 2, 0, 1])
    expected, run = [], state.clone()
    for i in range(n):
        expected.append(run)
        run = torch.where((i < closed)[:, None, None], torch.zeros_like(run), run + per_segment[:, i])
    expected.append(run)
    torch.testing.assert_close(mc._entering(state, per_segment, closed), torch.stack(expected, 1), rtol=0, atol=1e-12)


def test_logarithmic_segments_are_the_binary_decomposition():
    assert log_segments(37) == [(0, 32), (32, 36), (36, 37)]
    assert log_segments(16) == [(0, 16)]
    spec = SPECS["mlp"]
    init, q, k, v, u, alpha, eta, theta = inputs(spec)
    opts = MCOptions(segmentation="logarithmic", chunk_size=4)
    state = MCState.initial(init, B, D)
    for t in range(T):
        _, state = step_mc_titans(spec, opts, q[:, t], k[:, t], v[:, t], u[:, t], alpha[:, t], eta[:, t],
                                  theta[:, t], init, state)
        segments = log_segments(t + 1)
        assert (state.num_cached == len(segments) - 1).all()
        keys = k[:, : t + 1] * torch.rsqrt((k[:, : t + 1] ** 2).sum(-1, keepdim=True) + 1e-6)
        for i, (s, e) in enumerate(segments[:-1]):
            torch.testing.assert_close(state.cached_summary()[:, i], keys[:, s:e].mean(1), rtol=0, atol=1e-12)
        s, e = segments[-1]
        torch.testing.assert_close(state.key_sum / state.key_count[:, None, None], keys[:, s:e].mean(1),
                                   rtol=0, atol=1e-12)


def test_soup_equals_grm_for_linear_memory_and_differs_for_mlp():
    for name, same in (("linear", True), ("mlp", False)):
        spec = SPECS[name]
        init, *xs = inputs(spec, seed=3)
        outs = [chunk_mc_titans(spec, MCOptions(segment_size=4, aggregation=a, chunk_size=2), *xs, init,
                                MCState.initial(init, B, D))[0] for a in ("grm", "soup")]
        if same:
            torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-12)
        else:
            assert (outs[0] - outs[1]).abs().max() > 1e-6


def test_independent_differs_from_checkpoint_after_the_first_segment():
    spec = SPECS["mlp"]
    init, *xs = inputs(spec, seed=4)
    outs = [chunk_mc_titans(spec, MCOptions(segment_size=6, cache_mode=m, chunk_size=3), *xs, init,
                            MCState.initial(init, B, D))[0] for m in ("checkpoint", "independent")]
    torch.testing.assert_close(outs[0][:, :6], outs[1][:, :6], rtol=0, atol=1e-12)
    assert (outs[0][:, 6:] - outs[1][:, 6:]).abs().max() > 1e-6


def test_options_are_validated():
    with pytest.raises(ValueError, match="aggregation"):
        MCOptions(aggregation="max")
    with pytest.raises(ValueError, match="independent"):
        MCOptions(segmentation="logarithmic", cache_mode="independent")
    with pytest.raises(ValueError, match="segment_size"):
        MCOptions(segment_size=0)


# --- The in-context gradient clip (``MLPMemorySpec.grad_clip``) --------------------------------------------------

CLIPPED = MLPMemorySpec(depth=2, d_k=D, d_v=D, expansion=2, grad_clip=0.5)


def test_grad_clip_bounds_each_token_and_leaves_small_gradients_alone():
    spec = MLPMemorySpec(depth=2, d_k=D, d_v=D, expansion=2, grad_clip=10.0)
    init, _, k, v, *_ = inputs(spec)
    k, v = k[0].transpose(0, 1), v[0].transpose(0, 1)  # (H, T, D)
    raw = grad_factors(MLPMemorySpec(depth=2, d_k=D, d_v=D, expansion=2), init, k, v)
    clipped = grad_factors(spec, init, k, v)
    norm = lambda fs: sum(a.pow(2).sum(-1) * b.pow(2).sum(-1) for a, b in fs.values()).sqrt()  # noqa: E731
    before, after = norm(raw), norm(clipped)
    assert (before > 10).any() and (before < 10).any()  # the data exercise both sides of the bound
    torch.testing.assert_close(after, before.clamp(max=10.0), rtol=1e-12, atol=0)


@pytest.mark.parametrize("chunk", [1, 4, 5, 64])
def test_clipped_titans_reference_chunk_step_agree(chunk):
    init, q, k, v, _, alpha, eta, theta = inputs(CLIPPED)
    ref = reference_titans(CLIPPED, q, k, v, alpha, eta, theta, init, chunk_size=chunk)
    unclipped = reference_titans(MLPMemorySpec(depth=2, d_k=D, d_v=D, expansion=2), q, k, v, alpha, eta, theta,
                                 init, chunk_size=chunk)
    assert (ref - unclipped).abs().max() > 1e-6  # the clip is active on these inputs
    out, _ = chunk_titans(CLIPPED, q, k, v, alpha, eta, theta, TitansState.initial(init, B), chunk_size=chunk)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    state, steps = TitansState.initial(init, B), []
    for t in range(T):
        o, state = step_titans(CLIPPED, q[:, t], k[:, t], v[:, t], alpha[:, t], eta[:, t], theta[:, t], state,
                               chunk_size=chunk)
        steps.append(o)
    torch.testing.assert_close(torch.stack(steps, 1), ref, rtol=0, atol=1e-12)


def test_grad_clip_prevents_the_runaway_of_the_in_context_descent():
    """Large values and a large step make unclipped descent on an MLP memory overflow; the clip keeps it finite."""
    spec = MLPMemorySpec(depth=2, d_k=D, d_v=D, expansion=2)
    init, q, k, v, _, alpha, eta, theta = inputs(spec, dtype=torch.float32)
    long = lambda x: x.repeat(1, 40, *([1] * (x.dim() - 2)))  # noqa: E731  840 tokens
    q, k, v, alpha, eta, theta = (long(x) for x in (q, k, v, alpha, eta, theta))
    alpha, eta, theta, v = torch.ones_like(alpha), torch.full_like(eta, 0.9), torch.full_like(theta, 0.5), 20 * v
    args = (q, k, v, alpha, eta, theta)
    wild, _ = chunk_titans(spec, *args, TitansState.initial(init, B), chunk_size=16)
    assert not torch.isfinite(wild).all()
    guarded = MLPMemorySpec(depth=2, d_k=D, d_v=D, expansion=2, grad_clip=10.0)
    safe, _ = chunk_titans(guarded, *args, TitansState.initial(init, B), chunk_size=16)
    assert torch.isfinite(safe).all()
