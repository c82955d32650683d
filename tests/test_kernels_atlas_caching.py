"""Memory Caching over the Atlas memory: the segment-by-segment chunked path equals the token-by-token
reference, from any row clock and for any split of the tokens."""

from __future__ import annotations

import pytest
import torch

from mnemo.kernels.atlas import AtlasState
from mnemo.kernels.atlas_caching import CachedMemories, chunk_mc_atlas, reference_mc_atlas
from mnemo.kernels.titans import TitansMemorySpec

from test_kernels_atlas import B, DV, H, MEMORIES, TAKES, inputs, next_tokens


@pytest.mark.parametrize("aggregation", ["mean", "residual"])
@pytest.mark.parametrize("memory, optimizer, window, chunk, segment", [
    ("mlp", "muon", 3, 4, 5), ("linear", "gd", 1, 1, 3), ("gated-dot", "momentum", 7, 4, 8), ("mlp", "gd", 3, 4, 1),
])
def test_chunk_equals_reference_for_any_split(aggregation, memory, optimizer, window, chunk, segment):
    spec = TitansMemorySpec(d_v=DV, expansion=2, **MEMORIES[memory])
    init, xs = inputs(spec)
    if optimizer == "gd":
        xs = xs[:5] + (None,) + xs[6:]
    opts = dict(optimizer=optimizer, omega_window=window, chunk_size=chunk, ns_steps=3)
    fresh = lambda n: AtlasState.initial(spec, init, n, H, window, optimizer)  # noqa: E731
    lengths = torch.stack(TAKES).sum(0)
    mc = dict(segment_size=segment, aggregation=aggregation)
    expected = [reference_mc_atlas(spec, *(None if x is None else x[b:b + 1, :int(lengths[b])] for x in xs),
                                   fresh(1), **mc, **opts) for b in range(B)]

    # One call over left-compacted rows of different lengths.
    state = fresh(B)
    out, state, cached = chunk_mc_atlas(spec, *xs, state, CachedMemories.empty(state.weights), lengths=lengths,
                                        clock=torch.zeros(B, dtype=torch.long), **mc, **opts)
    for b in range(B):
        torch.testing.assert_close(out[b, :int(lengths[b])], expected[b][0], rtol=0, atol=1e-10)
        assert not out[b, int(lengths[b]):].any()
    assert cached.count.tolist() == [int(n) // segment for n in lengths]  # cached as soon as a segment ends

    # The same tokens in pieces (uneven per row, some empty) continue exactly.
    state, consumed = fresh(B), torch.zeros(B, dtype=torch.long)
    cached = CachedMemories.empty(state.weights)
    pieces = []
    for take in TAKES:
        o, state, cached = chunk_mc_atlas(spec, *(next_tokens(x, consumed, take) for x in xs), state, cached,
                                          lengths=take,
                                          clock=consumed, **mc, **opts)
        pieces.append([o[b, :int(take[b])] for b in range(B)])
        consumed = consumed + take
    for b in range(B):
        got = torch.cat([p[b] for p in pieces])
        torch.testing.assert_close(got, expected[b][0], rtol=0, atol=1e-10)


def test_gated_aggregations_are_refused():
    spec = TitansMemorySpec(d_v=DV, expansion=2, **MEMORIES["mlp"])
    init, xs = inputs(spec)
    with pytest.raises(ValueError, match="grm"):
        reference_mc_atlas(spec, *(x[:1] for x in xs), AtlasState.initial(spec, init, 1, H, 3, "muon"),
                           segment_size=2, aggregation="grm")
