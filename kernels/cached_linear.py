"""Memory Caching over matrix memories: the gated delta rule of MoM (FAMILIES.md §1-2).

At the end of every segment of ``segment_size`` tokens of a row, each of the
row's memories is cached, and token ``t`` reads its online memory (after its own
write) and every memory cached before it:

- ``residual``: ``o_t = S_t^T q_t + sum_i S^(i)^T q_t``
- ``mean``:     the same sum divided by ``1 + N_t`` (``N_t`` memories cached so far)

A matrix memory reads linearly, so ``sum_i S^(i)^T q = (sum_i S^(i))^T q``: the
cache keeps one running sum of the cached states and their count, and does not
grow with the context. Gated aggregations (``grm``, ``soup``, ``ssc``) weigh each
cached memory by its own score and need them one by one; they are MC-Titans'
(``memory_caching.py``).

Segments count a *row's* tokens (its clock): a routed memory that receives no
token in a segment is cached unchanged at that segment's end, like every other
memory of the row. ``positions`` give each token's index on its row's clock.

Entry points: :func:`reference_mc_gated_delta` (one sequence, an explicit list of
cached states, token by token) and :func:`chunk_mc_gated_delta` (packed
variable-length sequences, the chunked kernel run segment by segment, one
token per sequence handled by the step kernel).
"""

from __future__ import annotations

import torch

from .gated_delta import _prepare_qk, chunk_gated_delta, reference_gated_delta, step_gated_delta

__all__ = ["LINEAR_AGGREGATIONS", "chunk_mc_gated_delta", "read_states", "reference_mc_gated_delta"]

LINEAR_AGGREGATIONS = ("mean", "residual")


def _check_aggregation(aggregation: str) -> None:
    if aggregation not in LINEAR_AGGREGATIONS:
        raise ValueError(f"aggregation over matrix memories must be one of {LINEAR_AGGREGATIONS}, got {aggregation!r}")


def reference_mc_gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    positions: list[int],
    segment_size: int,
    aggregation: str,
) -> torch.Tensor:
    """One sequence (``q, k`` ``(T, H, d_k)``, ``v`` ``(T, H, d_v)``, ``g, beta`` ``(T, H)``) whose tokens sit at
    ``positions`` of its row's clock; the state starts at zero. Returns the outputs."""
    _check_aggregation(aggregation)
    H, K, V = q.shape[1], q.shape[2], v.shape[2]
    state = torch.zeros(1, H, K, V, dtype=torch.promote_types(v.dtype, torch.float32))
    cached: list[torch.Tensor] = []
    outputs = []
    for t, pos in enumerate(positions):
        while (len(cached) + 1) * segment_size <= pos:  # segment ends passed since the last token
            cached.append(state.clone())
        o, state = reference_gated_delta(q[None, t:t + 1], k[None, t:t + 1], v[None, t:t + 1],
                                         None if g is None else g[None, t:t + 1], beta[None, t:t + 1],
                                         initial_state=state)
        qn, _ = _prepare_qk(q[t], k[t], None, True, state.dtype)
        y = o[0, 0] + sum((torch.einsum("hk,hkv->hv", qn, c[0]) for c in cached), torch.zeros_like(o[0, 0]))
        outputs.append(y / (1 + len(cached)) if aggregation == "mean" else y)
    return torch.stack(outputs) if outputs else v.new_zeros(0, H, V)


def read_states(q: torch.Tensor, states: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``o[p] = states[s(p)]^T q[p]`` for packed ``q`` ``(P, H, d_k)`` of the sequences ``cu_seqlens`` delimits,
    ``states`` ``(N, H, d_k, d_v)``; ``q`` already normalised and scaled."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    P, H, K = q.shape
    if P == 0:
        return q.new_zeros(0, H, states.shape[-1])
    L = int(lengths.max())
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=q.device), lengths)
    local = torch.arange(P, device=q.device) - cu_seqlens[seq]
    padded = q.new_zeros(lengths.numel(), L, H, K)
    padded[seq, local] = q
    return torch.einsum("slhk,shkv->slhv", padded, states.to(q.dtype))[seq, local]


def chunk_mc_gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    *,
    initial_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    positions: torch.Tensor,
    sequence_row: torch.Tensor,
    row_clock: tuple[torch.Tensor, torch.Tensor],
    cached_sum: torch.Tensor,
    cached_count: torch.Tensor,
    segment_size: int,
    aggregation: str,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed sequences with Memory Caching.

    Args:
        q, k, v, g, beta: Packed ``(P, H, ·)`` / ``(P, H)`` inputs of the ``N`` sequences of ``cu_seqlens``.
        initial_state: ``(N, H, d_k, d_v)`` online states.
        positions: ``(P,)`` each token's index on its row's clock.
        sequence_row: ``(N,)`` the row of each sequence.
        row_clock: ``(before, after)`` ``(R,)``: each row's clock before and after these tokens; segment
            ends in ``(before, after]`` cache the row's states.
        cached_sum, cached_count: ``(N, H, d_k, d_v)`` sum of the cached states and ``(R,)`` their count.

    Returns:
        ``(o, final_state, cached_sum, cached_count)``; outputs ``(P, H, d_v)`` in ``v``'s dtype.
    """
    _check_aggregation(aggregation)
    before, after = row_clock
    S = segment_size
    dtype = torch.promote_types(v.dtype, torch.float32)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=q.device), lengths)
    segment = positions // S
    state, cached_sum, cached_count = initial_state.to(dtype), cached_sum.to(dtype), cached_count.clone()
    out = v.new_zeros(v.shape, dtype=dtype)
    qn, _ = _prepare_qk(q, k, None, True, dtype)
    first, last = int(before.min()) // S, max(int(after.max()) - 1, int(before.min())) // S
    for j in range(first, last + 1):
        piece = torch.nonzero(segment == j).squeeze(1)  # packed order is kept: sorted by sequence, then time
        if piece.numel():
            counts = torch.bincount(seq[piece], minlength=lengths.numel())
            pieces = torch.nn.functional.pad(counts.cumsum(0), (1, 0))
            args = (q[piece], k[piece], v[piece], None if g is None else g[piece], beta[piece])
            if int(counts.max()) == 1:
                owners = seq[piece]
                o, new = step_gated_delta(*args, state.index_select(0, owners))
                state = state.index_copy(0, owners, new.to(dtype))
                read = torch.einsum("phk,phkv->phv", qn[piece], cached_sum.index_select(0, owners))
            else:
                o, state = chunk_gated_delta(*(None if a is None else a.unsqueeze(0) for a in args),
                                             initial_state=state, cu_seqlens=pieces, chunk_size=chunk_size)
                o = o.squeeze(0)
                read = read_states(qn[piece], cached_sum, pieces)
            y = o.to(dtype) + read
            if aggregation == "mean":
                y = y / (1 + cached_count[sequence_row[seq[piece]]]).to(dtype)[:, None, None]
            out[piece] = y
        # Rows whose clock passes the end of segment j in this call cache every memory now.
        closes = (before < (j + 1) * S) & (after >= (j + 1) * S)
        if bool(closes.any()):
            by_sequence = closes[sequence_row][:, None, None, None]
            cached_sum = cached_sum + state * by_sequence
            cached_count = cached_count + closes.to(cached_count.dtype)
    return out.to(v.dtype), state, cached_sum, cached_count
