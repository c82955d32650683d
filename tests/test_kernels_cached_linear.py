"""Memory Caching over matrix memories: the packed, segment-by-segment kernel equals the readable reference."""

from __future__ import annotations

import pytest
import torch

from mnemo.kernels.cached_linear import chunk_mc_gated_delta, read_states, reference_mc_gated_delta

H, K, V = 2, 4, 3


def _inputs(P: int, gated: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(P, H, K, generator=g), torch.randn(P, H, K, generator=g)
    v = torch.randn(P, H, V, generator=g)
    decay = -torch.rand(P, H, generator=g) if gated else None
    return q, k, v, decay, torch.rand(P, H, generator=g)


def _routed(rows: list[int], memories: int, seed: int):
    """A MoM-like packing: every token of every row goes to one of ``memories`` sequences of that row
    (order (memory, row, time)); returns cu_seqlens, clock positions and the sequence rows."""
    g = torch.Generator().manual_seed(seed)
    choice = [torch.randint(0, memories, (n,), generator=g) for n in rows]
    seqs, cu, sequence_row = [], [0], []
    for m in range(memories):
        for b, n in enumerate(rows):
            pos = torch.nonzero(choice[b] == m).squeeze(1)
            seqs.append(pos)
            cu.append(cu[-1] + pos.numel())
            sequence_row.append(b)
    return torch.tensor(cu), torch.cat(seqs), torch.tensor(sequence_row)


@pytest.mark.parametrize("aggregation", ["mean", "residual"])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("segment_size,chunk", [(5, 4), (1, 2), (8, 3), (40, 16)])
def test_chunk_equals_reference_and_any_split(aggregation, gated, segment_size, chunk):
    rows, memories = [13, 21, 1], 3
    cu, positions, sequence_row = _routed(rows, memories, seed=segment_size)
    P = int(cu[-1])
    q, k, v, g, beta = _inputs(P, gated, seed=chunk)
    N = cu.numel() - 1
    lengths = torch.tensor(rows)

    def run(sel_tokens, state, csum, ccount, before, after):
        sub = torch.nonzero(sel_tokens).squeeze(1)
        counts = torch.bincount(torch.repeat_interleave(torch.arange(N), cu.diff())[sub], minlength=N)
        sub_cu = torch.nn.functional.pad(counts.cumsum(0), (1, 0))
        return chunk_mc_gated_delta(q[sub], k[sub], v[sub], None if g is None else g[sub], beta[sub],
                                    initial_state=state, cu_seqlens=sub_cu, positions=positions[sub],
                                    sequence_row=sequence_row, row_clock=(before, after), cached_sum=csum,
                                    cached_count=ccount, segment_size=segment_size, aggregation=aggregation,
                                    chunk_size=chunk)

    zeros = (torch.zeros(N, H, K, V), torch.zeros(N, H, K, V), torch.zeros(3, dtype=torch.long))
    o, state, csum, ccount = run(torch.ones(P, dtype=torch.bool), *zeros, torch.zeros(3, dtype=torch.long), lengths)
    for s in range(N):
        a, b = int(cu[s]), int(cu[s + 1])
        if b > a:
            ref = reference_mc_gated_delta(q[a:b], k[a:b], v[a:b], None if g is None else g[a:b], beta[a:b],
                                           positions[a:b].tolist(), segment_size,
                                           aggregation)
            torch.testing.assert_close(o[a:b], ref, rtol=1e-5, atol=1e-5)
    assert ccount.tolist() == [n // segment_size for n in rows]

    # Split every row's clock at 7: two calls carry states, sums and counts exactly.
    split = torch.tensor([7, 7, 0])
    first = positions < split[sequence_row[torch.repeat_interleave(torch.arange(N), cu.diff())]]
    o1, st1, cs1, cc1 = run(first, *zeros, torch.zeros(3, dtype=torch.long), torch.minimum(split, lengths))
    o2, st2, cs2, cc2 = run(~first, st1, cs1, cc1, torch.minimum(split, lengths), lengths)
    both = torch.zeros_like(o)
    both[first], both[~first] = o1, o2
    torch.testing.assert_close(both, o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st2, state, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cs2, csum, rtol=1e-5, atol=1e-5)
    assert torch.equal(cc2, ccount)


def test_read_states_matches_a_loop():
    cu = torch.tensor([0, 3, 3, 7])
    q = torch.randn(7, H, K)
    states = torch.randn(3, H, K, V)
    got = read_states(q, states, cu)
    for s in range(3):
        for p in range(int(cu[s]), int(cu[s + 1])):
            torch.testing.assert_close(got[p], torch.einsum("hk,hkv->hv", q[p], states[s]))


def test_gated_aggregations_are_refused():
    q, k, v, g, beta = _inputs(2, True, 0)
    with pytest.raises(ValueError, match="grm"):
        reference_mc_gated_delta(q, k, v, g, beta, [0, 1], 1, "grm")
