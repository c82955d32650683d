"""Memory Caching over matrix memories: the packed, segment-by-segment kernel equals the readable reference,
for every aggregation and any split into calls; the gated aggregations' one-token step equals the kernel."""

from __future__ import annotations

import pytest
import torch

from mnemo.kernels.mc_gated_delta import (
    GATED_AGGREGATIONS,
    CachedStates,
    chunk_mc_gated_delta,
    read_states,
    reference_mc_gated_delta,
    step_mc_gated_delta,
)

H, K, V = 2, 4, 3
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton paths: the interpreter on the CPU

pytestmark = pytest.mark.usefixtures("one_thread")


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


def _run_calls(inputs, cu, positions, sequence_row, rows, cuts, segment_size, aggregation, chunk, u=None,
               ssc_topk=2):
    """Feed every row's tokens in calls split at the row clocks ``cuts`` (one list per call boundary),
    carrying states and cached memories; returns the outputs in packed order and the final carry."""
    q, k, v, g, beta = inputs
    N = cu.numel() - 1
    gated = aggregation in GATED_AGGREGATIONS
    row_of_token = sequence_row[torch.repeat_interleave(torch.arange(N), cu.diff())]
    lengths = torch.tensor(rows)
    bounds = [torch.zeros(len(rows), dtype=torch.long)] + [torch.minimum(torch.tensor(c), lengths) for c in cuts]
    bounds.append(lengths)
    state = torch.zeros(N, H, K, V)
    cached = CachedStates.empty((N,), H, K, V, dtype=torch.float32) if gated else torch.zeros(N, H, K, V)
    count = torch.zeros(len(rows), dtype=torch.long)
    out = torch.zeros(q.shape[0], H, V)
    for before, after in zip(bounds[:-1], bounds[1:]):
        sel = (positions >= before[row_of_token]) & (positions < after[row_of_token])
        sub = torch.nonzero(sel).squeeze(1)
        counts = torch.bincount(torch.repeat_interleave(torch.arange(N), cu.diff())[sub], minlength=N)
        sub_cu = torch.nn.functional.pad(counts.cumsum(0), (1, 0))
        o, state, cached, count = chunk_mc_gated_delta(
            q[sub], k[sub], v[sub], None if g is None else g[sub], beta[sub], initial_state=state,
            cu_seqlens=sub_cu, positions=positions[sub], sequence_row=sequence_row, row_clock=(before, after),
            cached=cached, cached_count=count, segment_size=segment_size, aggregation=aggregation,
            chunk_size=chunk, u=None if u is None else u[sub], ssc_topk=ssc_topk)
        out[sub] = o
    return out, state, cached, count


def _assert_carry_close(a, b):
    for x, y in zip(a, b):
        if isinstance(x, CachedStates):
            for tx, ty in zip(x.tensors(), y.tensors()):
                torch.testing.assert_close(tx, ty, rtol=1e-5, atol=1e-5)
        elif x.dtype == torch.long:
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("aggregation", ["mean", "residual"])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("segment_size,chunk", [(5, 4), (1, 2), (8, 3), (40, 16)])
def test_chunk_equals_reference_and_any_split(aggregation, gated, segment_size, chunk):
    rows, memories = [13, 21, 1], 3
    cu, positions, sequence_row = _routed(rows, memories, seed=segment_size)
    P = int(cu[-1])
    inputs = _inputs(P, gated, seed=chunk)
    q, k, v, g, beta = inputs
    N = cu.numel() - 1
    o, state, csum, ccount = _run_calls(inputs, cu, positions, sequence_row, rows, [], segment_size, aggregation,
                                        chunk)
    for s in range(N):
        a, b = int(cu[s]), int(cu[s + 1])
        if b > a:
            ref = reference_mc_gated_delta(q[a:b], k[a:b], v[a:b], None if g is None else g[a:b], beta[a:b],
                                           positions[a:b].tolist(), segment_size,
                                           aggregation)
            torch.testing.assert_close(o[a:b], ref, rtol=1e-5, atol=1e-5)
    assert ccount.tolist() == [n // segment_size for n in rows]

    # Split every row's clock at 7: two calls carry states, sums and counts exactly.
    split = _run_calls(inputs, cu, positions, sequence_row, rows, [[7, 7, 0]], segment_size, aggregation, chunk)
    _assert_carry_close(split, (o, state, csum, ccount))


@pytest.mark.parametrize("aggregation,ssc_topk", [("grm", 2), ("soup", 2), ("ssc", 1), ("ssc", 2)])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("segment_size,chunk", [(4, 3), (1, 2), (7, 16)])
def test_gated_aggregations_chunk_equals_reference_and_any_split(aggregation, ssc_topk, gated, segment_size, chunk):
    rows, memories = [13, 21, 1], 3
    cu, positions, sequence_row = _routed(rows, memories, seed=segment_size + 1)
    P = int(cu[-1])
    inputs = _inputs(P, gated, seed=chunk)
    q, k, v, g, beta = inputs
    u = 2 * torch.randn(P, H, K, generator=torch.Generator().manual_seed(5))
    # The gate input is one per token: every memory the token visits scores with the same u_t.
    u = u[positions] + 0.1 * sequence_row[torch.repeat_interleave(torch.arange(cu.numel() - 1), cu.diff())][:, None, None]
    run = lambda cuts: _run_calls(inputs, cu, positions, sequence_row, rows, cuts, segment_size,  # noqa: E731
                                  aggregation, chunk, u=u, ssc_topk=ssc_topk)
    o, state, cached, count = run([])
    for s in range(cu.numel() - 1):
        a, b = int(cu[s]), int(cu[s + 1])
        if b > a:
            ref = reference_mc_gated_delta(q[a:b], k[a:b], v[a:b], None if g is None else g[a:b], beta[a:b],
                                           positions[a:b].tolist(), segment_size, aggregation, u=u[a:b],
                                           ssc_topk=ssc_topk)
            torch.testing.assert_close(o[a:b], ref, rtol=1e-5, atol=1e-5)
    assert count.tolist() == [n // segment_size for n in rows]
    assert cached.slots == max(rows) // segment_size
    # Every memory of a row is cached at each of the row's segment ends, with its summary's key count.
    row_of_seq = sequence_row.tolist()
    for s in range(cu.numel() - 1):
        seg = positions[int(cu[s]):int(cu[s + 1])] // segment_size
        n = int(count[row_of_seq[s]])
        expected = torch.bincount(seg, minlength=n + 1)[:n].float() if n else torch.zeros(0)
        torch.testing.assert_close(cached.key_count[s, :n], expected)
    # Any split into calls, one-token calls (the step path) included, carries everything.
    for cuts in ([[7, 7, 0]], [[3, 4, 1], [4, 5, 1], [12, 17, 1]], [[t, t, t] for t in range(5, 20)]):
        _assert_carry_close(run(cuts), (o, state, cached, count))


def test_soup_is_grm_and_a_zero_gate_input_reads_like_mean():
    rows, memories, segment_size = [17, 9], 2, 4
    cu, positions, sequence_row = _routed(rows, memories, seed=3)
    inputs = _inputs(int(cu[-1]), True, seed=4)
    u = torch.randn(int(cu[-1]), H, K, generator=torch.Generator().manual_seed(6))
    out = {}
    for aggregation, gate_input in (("grm", u), ("soup", u), ("ssc", torch.zeros_like(u)), ("mean", None)):
        out[aggregation] = _run_calls(inputs, cu, positions, sequence_row, rows, [], segment_size, aggregation, 4,
                                      u=gate_input, ssc_topk=1)[0]
    assert torch.equal(out["soup"], out["grm"])
    torch.testing.assert_close(out["ssc"], out["mean"], rtol=1e-5, atol=1e-6)
    assert (out["grm"] - out["mean"]).abs().max() > 1e-3


def test_step_equals_chunk_for_gated_aggregations():
    """The one-token step (decoding, no packing plan) reads and advances the key sums as the packed kernel does."""
    N, S, slots = 4, 3, 2
    g0 = torch.Generator().manual_seed(7)
    cached = CachedStates(torch.randn(N, slots, H, K, V, generator=g0), torch.randn(N, slots, H, K, generator=g0),
                          torch.tensor([[2.0, 0.0], [1.0, 3.0], [0.0, 0.0], [4.0, 1.0]]),
                          torch.randn(N, H, K, generator=g0), torch.tensor([1.0, 0.0, 2.0, 1.0]))
    count = torch.tensor([2, 1, 0, 2])  # valid slots of each sequence's row (rows = sequences here)
    q, k, v, g, beta = _inputs(N, True, seed=8)
    u = torch.randn(N, H, K, generator=g0)
    state = torch.randn(N, H, K, V, generator=g0)
    for aggregation in GATED_AGGREGATIONS:
        valid = torch.arange(slots)[None] < count[:, None]
        o, new, after = step_mc_gated_delta(q, k, v, g, beta, u, state, cached, valid, aggregation=aggregation,
                                            ssc_topk=1)
        clock = count * S + cached.online_key_count.long()
        ref_o, ref_state, ref_cached, _ = chunk_mc_gated_delta(
            q, k, v, g, beta, initial_state=state, cu_seqlens=torch.arange(N + 1), positions=clock,
            sequence_row=torch.arange(N), row_clock=(clock, clock + 1), cached=cached, cached_count=count,
            segment_size=S, aggregation=aggregation, u=u, ssc_topk=1)
        torch.testing.assert_close(o, ref_o, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(new, ref_state, rtol=1e-5, atol=1e-6)
        # the kernel also closed the segments the token ended; the step leaves that to its caller
        closing = (clock + 1) % S == 0
        pushed = after.with_slots(ref_cached.slots).push(closing, count, new)
        _assert_carry_close((pushed,), (ref_cached,))


@pytest.mark.parametrize("dk, dv", [(24, 40), (80, 100)])
@pytest.mark.parametrize("shares", [None, 1, 4, 6])
def test_the_routed_read_takes_the_states_where_they_lie(dk, dv, shares):
    """:func:`routed_read_triton` (Triton's interpreter here) equals gathering each sequence's row of the stack
    and reading it, with rows repeated and skipped, zero gates (skipped slots) and the slots dealt to shares;
    widths that are not powers of two, and wider than one tile, are masked. Reading another row differs."""
    pytest.importorskip("triton")
    from mnemo.kernels.mc_gated_delta_triton import routed_read_triton

    gen = torch.Generator().manual_seed(11)
    R, N, heads = 5, 6, 2
    states = torch.randn(R, N, heads, dk, dv, generator=gen)
    rows = torch.tensor([3, 0, 3, 4])
    q = torch.randn(len(rows), heads, dk, generator=gen)
    gates = torch.rand(len(rows), heads, N, generator=gen)
    gates[:, :, -2:] = 0.0  # empty slots
    gates[1, 0, 1] = 0.0
    got = routed_read_triton(*(x.to(DEVICE) for x in (q, gates, states, rows)), shares=shares).cpu()
    want = torch.einsum("phk,pnhkv,phn->phv", q.double(), states[rows].double(), gates.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    other = routed_read_triton(*(x.to(DEVICE) for x in (q, gates, states, torch.tensor([3, 1, 3, 4]))),
                               shares=shares).cpu()
    assert (other - got)[1].abs().max() > 1e-3 and torch.equal(other[0], got[0])


@pytest.mark.parametrize("shares, exact", [(2, 5), (3, 1), (4, 2), (4, 7)])
def test_routed_slots_ahead_of_need_leave_the_read_bit_for_bit(shares, exact):
    """A captured decode step's cache holds slots ahead of need (zero gates): the routed read is the eager
    step's, to the bit, whatever the slots' count, and it reads the first slots of a larger stack in place."""
    pytest.importorskip("triton")
    from mnemo.kernels.mc_gated_delta_triton import routed_read_triton

    gen = torch.Generator().manual_seed(17)
    R, N, heads, dk, dv = 3, 12, 2, 32, 48
    states = torch.randn(R, N, heads, dk, dv, generator=gen).to(DEVICE)
    rows = torch.tensor([2, 0]).to(DEVICE)
    q = torch.randn(len(rows), heads, dk, generator=gen).to(DEVICE)
    gates = torch.rand(len(rows), heads, N, generator=gen).to(DEVICE)
    gates[..., exact:] = 0.0
    want = routed_read_triton(q, gates[..., :exact].contiguous(), states[:, :exact].contiguous(), rows,
                              shares=shares)
    for n in (exact + 1, 9, N):
        got = routed_read_triton(q, gates[..., :n].contiguous(), states[:, :n], rows, shares=shares)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    reference = torch.einsum("phk,pnhkv,phn->phv", q.double().cpu(), states[rows, :exact].double().cpu(),
                             gates[..., :exact].double().cpu())
    torch.testing.assert_close(want.double().cpu(), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_step_reads_a_stack_of_states_as_the_gathered_ones(backend, monkeypatch):
    """``state_rows``: the one-token step given a layer's whole stack of cached states (rows of sequences
    picked by index, as the MoM layer's decode does) equals the step given each sequence's gathered states,
    for every gated aggregation, on the PyTorch path and on the Triton one (the routed read, one launch a
    step)."""
    if backend == "triton":
        pytest.importorskip("triton")
    import mnemo.kernels.mc_gated_delta as mc_gated_delta
    from mnemo.kernels.backend import use_backend

    launches = []
    real = mc_gated_delta.routed_read_triton
    monkeypatch.setattr(mc_gated_delta, "routed_read_triton", lambda *a, **kw: launches.append(1) or real(*a, **kw))

    N, slots, R = 4, 3, 6
    g0 = torch.Generator().manual_seed(12)
    stack = torch.randn(R, slots, H, K, V, generator=g0)
    rows = torch.tensor([5, 2, 2, 0])
    key_sum, key_count = torch.randn(N, slots, H, K, generator=g0), torch.tensor([[2.0, 1.0, 0.0]] * N)
    online = (torch.randn(N, H, K, generator=g0), torch.tensor([1.0, 0.0, 2.0, 1.0]))
    count = torch.tensor([2, 1, 0, 2])
    q, k, v, g, beta = _inputs(N, True, seed=13)
    u = torch.randn(N, H, K, generator=g0)
    state = torch.randn(N, H, K, V, generator=g0)
    valid = torch.arange(slots)[None] < count[:, None]
    to = lambda *xs: [x.to(DEVICE if backend == "triton" else "cpu") for x in xs]  # noqa: E731
    q, k, v, g, beta, u, state, valid, stack, rows, key_sum, key_count = to(q, k, v, g, beta, u, state, valid, stack,
                                                                            rows, key_sum, key_count)
    online = tuple(to(*online))
    for aggregation in GATED_AGGREGATIONS:
        with use_backend(backend):
            got = step_mc_gated_delta(q, k, v, g, beta, u, state, CachedStates(stack, key_sum, key_count, *online),
                                      valid, aggregation=aggregation, ssc_topk=1, state_rows=rows)
            want = step_mc_gated_delta(q, k, v, g, beta, u, state,
                                       CachedStates(stack[rows], key_sum, key_count, *online), valid,
                                       aggregation=aggregation, ssc_topk=1)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
        assert torch.equal(got[1], want[1])
        torch.testing.assert_close(got[2].online_key_sum, want[2].online_key_sum)
    assert len(launches) == (len(GATED_AGGREGATIONS) if backend == "triton" else 0)


def test_a_read_of_a_stack_that_records_gradients_gathers_the_states(monkeypatch):
    """The routed read has no backward: with gradients recorded, the Triton backend's read of a stack gathers
    the states (no launch), and the gradients of the gate inputs, queries and states equal the gathered
    read's."""
    pytest.importorskip("triton")
    import mnemo.kernels.mc_gated_delta as mc_gated_delta
    from mnemo.kernels.backend import use_backend
    from mnemo.kernels.mc_gated_delta import read_scored

    launches = []
    real = mc_gated_delta.routed_read_triton
    monkeypatch.setattr(mc_gated_delta, "routed_read_triton", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    g0 = torch.Generator().manual_seed(14)
    N, slots, R = 3, 4, 5
    rows = torch.tensor([4, 1, 4])
    leaves = [torch.randn(N, 1, H, V, generator=g0), torch.randn(N, 1, H, K, generator=g0),
              torch.randn(N, 1, H, K, generator=g0), torch.randn(N, 1, H, K, generator=g0),
              torch.randn(R, slots, H, K, V, generator=g0)]
    key_sum, key_count = torch.randn(N, slots, H, K, generator=g0), torch.tensor([[2.0, 1.0, 3.0, 0.0]] * N)
    valid = torch.tensor([[True, True, True, False]] * N)
    grads = {}
    for stacked in (True, False):
        x = [t.clone().to(DEVICE).requires_grad_() for t in leaves]
        online, q, u, summary, states = x
        cached = CachedStates(states if stacked else states[rows.to(DEVICE)], key_sum.to(DEVICE),
                              key_count.to(DEVICE), torch.zeros(N, H, K, device=DEVICE), torch.zeros(N, device=DEVICE))
        with use_backend("triton"):
            y = read_scored(online, q, u, summary, cached, valid.to(DEVICE), "grm", 1,
                            rows.to(DEVICE) if stacked else None)
        grads[stacked] = torch.autograd.grad((y * torch.arange(y.numel(), device=DEVICE).view_as(y).sin()).sum(), x)
    assert launches == []
    for a, b in zip(grads[True], grads[False]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_read_states_matches_a_loop():
    cu = torch.tensor([0, 3, 3, 7])
    q = torch.randn(7, H, K)
    states = torch.randn(3, H, K, V)
    got = read_states(q, states, cu)
    for s in range(3):
        for p in range(int(cu[s]), int(cu[s + 1])):
            torch.testing.assert_close(got[p], torch.einsum("hk,hkv->hv", q[p], states[s]))


def test_gated_aggregations_need_gate_inputs_and_unknown_ones_are_refused():
    q, k, v, g, beta = _inputs(2, True, 0)
    with pytest.raises(ValueError, match="gate inputs u"):
        reference_mc_gated_delta(q, k, v, g, beta, [0, 1], 1, "grm")
    with pytest.raises(ValueError, match="must be one of"):
        reference_mc_gated_delta(q, k, v, g, beta, [0, 1], 1, "max")
