"""Memory Caching over the Atlas memory: the segment-by-segment chunked path equals the token-by-token
reference, from any row clock and for any split of the tokens, for every aggregation; the gated ones are
MC-Titans' own (Atlas' limit that is Titans reads exactly as MC-Titans does)."""

from __future__ import annotations

import pytest
import torch

from mnemo.kernels.atlas import AtlasState
from mnemo.kernels.mc_atlas import (
    GATED_AGGREGATIONS,
    CachedMemories,
    chunk_mc_atlas,
    reference_mc_atlas,
    step_mc_atlas,
)
from mnemo.kernels.memory_caching import MCOptions, decode_slots
from mnemo.kernels.mc_titans import reference_mc_titans
from mnemo.kernels.norms import l2_normalize
from mnemo.kernels.mlp_memory import MLPMemorySpec

from test_kernels_atlas import B, DV, H, MEMORIES, T, TAKES, inputs, next_tokens


def gate_inputs(spec, seed=5, dtype=torch.float64):
    return torch.randn(B, T, H, spec.d_k, generator=torch.Generator().manual_seed(seed), dtype=dtype) * 2


def run_chunked(spec, xs, u, init, opts, mc, takes):
    """``chunk_mc_atlas`` over the rows fed ``takes`` tokens per call; each row's outputs, and the cache."""
    fresh = AtlasState.initial(spec, init, B, H, opts["omega_window"], opts["optimizer"])
    gated = mc["aggregation"] in GATED_AGGREGATIONS
    state, cached = fresh, CachedMemories.empty(fresh.weights, spec.d_k if gated else None)
    consumed, pieces = torch.zeros(B, dtype=torch.long), []
    for take in takes:
        o, state, cached = chunk_mc_atlas(spec, *(next_tokens(x, consumed, take) for x in xs), state, cached,
                                          lengths=take, clock=consumed, u=next_tokens(u, consumed, take), **mc,
                                          **opts)
        pieces.append([o[b, :int(take[b])] for b in range(B)])
        assert all(not o[b, int(take[b]):].any() for b in range(B))
        consumed = consumed + take
    return [torch.cat([p[b] for p in pieces]) for b in range(B)], cached


@pytest.mark.parametrize("aggregation", ["mean", "residual", "grm", "soup", "ssc"])
@pytest.mark.parametrize("memory, optimizer, window, chunk, segment", [
    ("mlp", "muon", 3, 4, 5), ("linear", "gd", 1, 1, 3), ("gated-dot", "momentum", 7, 4, 8), ("mlp", "gd", 3, 4, 1),
    ("mlp-linear-skip", "momentum", 2, 2, 4),
])
def test_chunk_equals_reference_for_any_split(aggregation, memory, optimizer, window, chunk, segment):
    spec = MLPMemorySpec(d_v=DV, expansion=2, **MEMORIES[memory])
    init, xs = inputs(spec)
    if optimizer == "gd":
        xs = xs[:5] + (None,) + xs[6:]
    u = gate_inputs(spec) if aggregation in GATED_AGGREGATIONS else None
    opts = dict(optimizer=optimizer, omega_window=window, chunk_size=chunk, ns_steps=3)
    fresh = lambda n: AtlasState.initial(spec, init, n, H, window, optimizer)  # noqa: E731
    lengths = torch.stack(TAKES).sum(0)
    # ssc_topk=1: with several cached memories the selection (and its ties) matters
    mc = dict(segment_size=segment, aggregation=aggregation, ssc_topk=1)
    cut = lambda x, b: None if x is None else x[b:b + 1, :int(lengths[b])]  # noqa: E731
    expected = [reference_mc_atlas(spec, *(cut(x, b) for x in xs), fresh(1), u=cut(u, b), **mc, **opts)[0]
                for b in range(B)]

    # One call over left-compacted rows of different lengths, then the same tokens in pieces (uneven per
    # row, some empty), which continue exactly.
    for takes in ([lengths], TAKES):
        got, cached = run_chunked(spec, xs, u, init, opts, mc, takes)
        for b in range(B):
            torch.testing.assert_close(got[b], expected[b], rtol=0, atol=1e-10)
        assert cached.count.tolist() == [int(n) // segment for n in lengths]  # cached as soon as a segment ends
        if aggregation in GATED_AGGREGATIONS:
            # each cached summary covers one whole segment, the online one the tokens since the last cut
            counts = [[segment] * (int(n) // segment) for n in lengths]
            assert [row[:len(c)] for row, c in zip(cached.key_count.tolist(), counts)] == counts
            assert cached.online_key_count.tolist() == [int(n) % segment for n in lengths]
            for b in range(B):
                n = int(lengths[b])
                keys = l2_normalize(xs[1][b, n - n % segment:n])
                torch.testing.assert_close(cached.online_key_sum[b], keys.sum(0), rtol=0, atol=1e-12)
        else:
            assert not cached.has_summaries


@pytest.mark.parametrize("slots", ["reserved", "in_place"])
@pytest.mark.parametrize("aggregation", ["mean", "residual", "grm", "soup", "ssc"])
def test_one_token_steps_equal_the_chunked_path(aggregation, slots):
    """The decode step (every row one token, rows idle by turns, their clocks apart) from a cache with its
    slots reserved ahead, written in place or not, equals ``chunk_mc_atlas`` one token at a time (which
    grows its cache by reading counts back): outputs, states and cached memories, in float64."""
    spec = MLPMemorySpec(d_v=DV, expansion=2, **MEMORIES["mlp"])
    init, xs = inputs(spec)
    u = gate_inputs(spec) if aggregation in GATED_AGGREGATIONS else None
    opts = dict(optimizer="muon", omega_window=3, chunk_size=4, ns_steps=3)
    mc = dict(segment_size=3, aggregation=aggregation, ssc_topk=1)
    fresh = AtlasState.initial(spec, init, B, H, 3, "muon")
    empty = CachedMemories.empty(fresh.weights, spec.d_k if aggregation in GATED_AGGREGATIONS else None)
    prefix = torch.tensor([4, 2, 0])  # clocks apart: rows close their segments at different steps
    o, state, cached = chunk_mc_atlas(spec, *(None if x is None else x[:, :4] for x in xs), fresh, empty,
                                      lengths=prefix, clock=torch.zeros(B, dtype=torch.long),
                                      u=None if u is None else u[:, :4], **mc, **opts)
    grown_state, grown, clock = state, cached, prefix.clone()
    for step in range(12):
        live = torch.tensor([step % 3 != 1, True, step % 4 != 0])
        take = (clock, live.long())
        piece = [None if x is None else next_tokens(x, *take) for x in xs]
        want, grown_state, grown = chunk_mc_atlas(spec, *piece, grown_state, grown, lengths=live.long(), clock=clock,
                                                  u=None if u is None else next_tokens(u, *take), **mc, **opts)
        seen = int(clock.max())  # what the host knows: no row has seen more
        cached = cached.reserve(decode_slots(seen, 3))
        if slots == "in_place":  # the step may write these tensors: the grown cache must not share them
            cached.weights = {n: w.clone() for n, w in cached.weights.items()}
        got, state, cached = step_mc_atlas(spec, *(None if x is None else x[:, 0] for x in piece), state, cached,
                                           live=live, clock=clock, u=None if u is None else next_tokens(u, *take)[:, 0],
                                           slots=slots, **mc, **opts)
        torch.testing.assert_close(got, want[:, 0], rtol=0, atol=1e-12)
        clock = clock + live.long()
        assert torch.equal(cached.count, grown.count)
        for name, w in grown.weights.items():
            torch.testing.assert_close(cached.weights[name][:, :w.shape[1]], w, rtol=0, atol=1e-12)
        for name, w in grown_state.tensors().items():
            torch.testing.assert_close(state.tensors()[name], w, rtol=0, atol=1e-12)
        if grown.has_summaries:
            n = grown.key_count.shape[1]
            for ours, theirs in ((cached.key_sum[:, :n], grown.key_sum), (cached.key_count[:, :n], grown.key_count),
                                 (cached.online_key_sum, grown.online_key_sum),
                                 (cached.online_key_count, grown.online_key_count)):
                torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)
    assert int(cached.count.max()) >= 4  # several segments closed on the way


@pytest.mark.parametrize("aggregation", GATED_AGGREGATIONS)
@pytest.mark.parametrize("memory", ["mlp", "linear"])
def test_gated_aggregations_are_mc_titans_at_atlas_titans_limit(aggregation, memory):
    """Window 1, gradient descent and unit window gates make the Atlas memory Titans without momentum
    (test_kernels_atlas): with normalised keys and queries, the cached reads are MC-Titans' reference,
    whose aggregations are written out token by token."""
    spec = MLPMemorySpec(d_v=DV, expansion=2, **MEMORIES[memory])
    init, (q, k, v, alpha, lr, _, _) = inputs(spec, seed=3)
    u = gate_inputs(spec, seed=4)
    ones = torch.ones_like(alpha)
    qn, kn = l2_normalize(q), l2_normalize(k)
    opts = dict(optimizer="gd", omega_window=1, chunk_size=2)
    got, _ = run_chunked(spec, (qn, kn, v, alpha, lr, None, ones), u, init, opts,
                         dict(segment_size=4, aggregation=aggregation, ssc_topk=1), [torch.full((B,), T)])
    options = MCOptions(segment_size=4, aggregation=aggregation, ssc_topk=1, chunk_size=2)
    titans = reference_mc_titans(spec, options, q, k, v, u, alpha, torch.zeros_like(alpha), lr, init)
    # The one difference: Atlas normalises its (already unit) keys once more for the summaries.
    torch.testing.assert_close(torch.stack(got), titans, rtol=0, atol=1e-6)


@pytest.mark.parametrize("memory", ["mlp", "linear"])
def test_zero_gate_inputs_read_as_the_mean(memory):
    """All scores equal: grm, and ssc because ties are kept, average every memory like mean; soup averages
    the weights, the same read only for a linear memory."""
    spec = MLPMemorySpec(d_v=DV, expansion=2, **MEMORIES[memory])
    init, xs = inputs(spec, seed=6)
    opts = dict(optimizer="muon", omega_window=3, chunk_size=4, ns_steps=3)
    out = {}
    for aggregation in ("mean", "grm", "ssc", "soup"):
        u = torch.zeros(B, T, H, spec.d_k, dtype=torch.float64)
        got, _ = run_chunked(spec, xs, u, init, opts, dict(segment_size=3, aggregation=aggregation, ssc_topk=1),
                             TAKES)
        out[aggregation] = torch.cat(got)
    torch.testing.assert_close(out["grm"], out["mean"], rtol=0, atol=1e-12)
    torch.testing.assert_close(out["ssc"], out["mean"], rtol=0, atol=1e-12)
    if memory == "linear":
        torch.testing.assert_close(out["soup"], out["mean"], rtol=0, atol=1e-12)
    else:
        assert (out["soup"] - out["mean"]).abs().max() > 1e-4


def test_unknown_or_ungated_aggregations_are_refused():
    spec = MLPMemorySpec(d_v=DV, expansion=2, **MEMORIES["mlp"])
    init, xs = inputs(spec)
    state = AtlasState.initial(spec, init, 1, H, 3, "muon")
    with pytest.raises(ValueError, match="must be one of"):
        reference_mc_atlas(spec, *(x[:1] for x in xs), state, segment_size=2, aggregation="max")
    with pytest.raises(ValueError, match="gate inputs u"):
        reference_mc_atlas(spec, *(x[:1] for x in xs), state, segment_size=2, aggregation="grm")
    with pytest.raises(ValueError, match="summaries"):  # a cache built for mean cannot serve grm
        chunk_mc_atlas(spec, *xs, AtlasState.initial(spec, init, B, H, 3, "muon"),
                       CachedMemories.empty(state.weights), lengths=torch.full((B,), T),
                       clock=torch.zeros(B, dtype=torch.long), segment_size=2, aggregation="ssc",
                       u=gate_inputs(spec))
