"""Memory Caching over matrix memories: the gated delta rule of MoM (docs/semantics.md).

At the end of every segment of ``segment_size`` tokens of a row, each of the
row's memories is cached, and token ``t`` reads its online memory (after its own
write) and every memory cached before it, with MC-Titans' aggregations:

- ``residual``: ``o_t = S_t^T q_t + sum_i S^(i)^T q_t``
- ``mean``:     the same sum divided by ``1 + N_t`` (``N_t`` memories cached so far)
- ``grm``:      ``o_t = gamma_t^on S_t^T q_t + sum_i gamma_t^(i) S^(i)^T q_t`` with
  ``gamma_t = softmax`` (per head) of the scores ``<u_t, r^(i)>`` of the cached
  memories and ``<u_t, r_t^on>`` of the online one
- ``soup``:     mixes the states with the same gates, then reads once. A matrix
  memory reads linearly, so ``(sum_i gamma^(i) S^(i))^T q = sum_i gamma^(i) S^(i)^T q``:
  ``soup`` *is* ``grm`` here and is computed as ``grm``
- ``ssc``:      ``grm`` over the ``ssc_topk`` best-scoring cached memories and the
  online one (cached memories tied with the ``ssc_topk``-th best score, up to
  rounding (``SSC_TIE_TOLERANCE``), are all kept, so a zero gate projection reads like ``mean``)

The gated aggregations are MC-Titans' own (:func:`~.memory_caching.mc_read` on a
linear memory ``M(z) = S^T z``), so both families gate alike: same scores, same
``-inf`` masking of empty cache slots, same ties in ``ssc``.

Summaries are per memory. ``r_e^(i)`` is the mean of the L2-normalised keys that
memory ``e`` received during segment ``i`` of its row (the keys it was written
with: after its short convolution). A memory that received no token in a segment
is still cached (unchanged), with a zero summary: its score is 0. The online
summary ``r_t^on`` is the mean of the memory's keys in the current segment so far,
the current token's included. ``u_t`` is one vector per token and head (the layer
projects it from its input); every memory the token visits scores with it.

Cache. A matrix memory reads linearly, so for ``mean``/``residual``
``sum_i S^(i)^T q = (sum_i S^(i))^T q``: the cache is one running sum of the
cached states per memory and their count, and does not grow with the context.
The gated aggregations weigh each cached state by its own score and keep them one
by one (:class:`CachedStates`: one slot per cached segment, like MC-Titans, plus
per-segment key sums and counts and the online segment's); it grows by one state
per memory and segment. Summaries are kept as sums and counts and divided only
when read, so every path rounds alike. As in MC-Titans, a token reads every
cached state of the memories it visits (``ssc`` scores them all and masks all but
the best), so its cost grows with the number of cached segments.

Segments count a *row's* tokens (its clock): a routed memory that receives no
token in a segment is cached unchanged at that segment's end, like every other
memory of the row. ``positions`` give each token's index on its row's clock.

Entry points: :func:`reference_mc_gated_delta` (one sequence, explicit lists of
cached states, token by token), :func:`chunk_mc_gated_delta` (packed
variable-length sequences, the chunked kernel run segment by segment, one token
per sequence handled by the step kernel), :func:`step_mc_gated_delta` (the
gated aggregations' one-token step for decoding, without a packing plan) and
:func:`step_mc_gated_delta_summed` (the same for ``mean`` and ``residual``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable

import torch

from .backend import resolve_backend
from .gated_delta import _prepare_qk, chunk_gated_delta, reference_gated_delta, step_gated_delta
from .mc_gated_delta_triton import routed_read_triton
from .memory_caching import (
    AGGREGATIONS,
    GATED_AGGREGATIONS,
    LINEAR_AGGREGATIONS,
    check_aggregation,
    close_segments,
    key_mean,
    mc_gates,
    mc_read,
    ssc_select,
    with_extra_slots,
    write_slots_,
)
from .mlp_memory import MLPMemorySpec

__all__ = [
    "AGGREGATIONS",
    "GATED_AGGREGATIONS",
    "LINEAR_AGGREGATIONS",
    "CachedStates",
    "chunk_mc_gated_delta",
    "read_scored",
    "read_states",
    "reference_mc_gated_delta",
    "step_mc_gated_delta_summed",
    "step_mc_gated_delta",
]



# Whether a one-token read of a stack of cached states takes the Triton routed read where it applies;
# benchmarks set it False to time the gather it replaces.
ROUTED_READ = True


# --------------------------------------------------------------------------- the gated cache


@dataclass
class CachedStates:
    """The cached memories of the gated aggregations, one slot per cached segment.

    Leading dimensions ``...`` are the sequences (kernels) or ``(batch, memory)``
    (the layer's cache). Slot ``i`` holds the state cached at the end of the row's
    segment ``i`` and the sum and number of the normalised keys the memory received
    in that segment; a row has ``count`` valid slots, slots past it are zero.
    """

    states: torch.Tensor  # (..., N, H, d_k, d_v)
    key_sum: torch.Tensor  # (..., N, H, d_k)
    key_count: torch.Tensor  # (..., N)
    online_key_sum: torch.Tensor  # (..., H, d_k) the current segment's keys so far
    online_key_count: torch.Tensor  # (...,)

    @classmethod
    def empty(cls, lead: tuple[int, ...], heads: int, d_k: int, d_v: int, *, dtype: torch.dtype,
              device: torch.device | str | None = None) -> "CachedStates":
        """Nothing cached and an empty online segment."""
        z = lambda *shape: torch.zeros(*lead, *shape, dtype=dtype, device=device)  # noqa: E731
        return cls(z(0, heads, d_k, d_v), z(0, heads, d_k), z(0), z(heads, d_k), z())

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors in field order."""
        return tuple(getattr(self, f.name) for f in fields(self))

    @property
    def slots(self) -> int:
        return self.states.shape[-4]

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "CachedStates":
        """``fn`` on every tensor (gathers, reshapes, dtype changes of the leading dimensions)."""
        return CachedStates(*(fn(t) for t in self.tensors()))

    def summary(self) -> torch.Tensor:
        """``r^(i)`` of every slot, ``(..., N, H, d_k)``: zero where no key was received."""
        return key_mean(self.key_sum, self.key_count)

    def with_slots(self, n: int) -> "CachedStates":
        """At least ``n`` slots (new slots are zero)."""
        extra = n - self.slots
        if extra <= 0:
            return self
        return replace(self, states=with_extra_slots(self.states, -4, extra),
                       key_sum=with_extra_slots(self.key_sum, -3, extra),
                       key_count=with_extra_slots(self.key_count, -1, extra))

    def push(self, closing: torch.Tensor, slot: torch.Tensor, state: torch.Tensor, *,
             in_place: bool = False) -> "CachedStates":
        """Cache ``state`` ``(..., H, d_k, d_v)`` and the online segment's key sums in ``slot`` ``(...,)`` where
        ``closing`` ``(...,)``, and restart those online segments empty. The slots must exist (no device read
        here: :meth:`with_slots` first). ``in_place``: the new states are written into ``states`` itself (a
        graphed decode step's buffer, which nothing else holds: a step then moves one state a memory, not the
        whole cache)."""
        at = (torch.arange(self.slots, device=slot.device) == slot[..., None]) & closing[..., None]  # (..., N)
        if in_place:
            if self.slots == 0:  # no slot: nothing can close yet (the caller reserved what the host knows)
                return self
            write_slots_(self.states, state, closing, slot)
            states = self.states
        else:
            states = torch.where(at[..., None, None, None], state.unsqueeze(-4).to(self.states.dtype), self.states)
        return CachedStates(states, *close_segments(self.key_sum, self.key_count, self.online_key_sum,
                                                    self.online_key_count, at, closing))


def read_scored(
    online: torch.Tensor,
    q: torch.Tensor,
    u: torch.Tensor,
    online_summary: torch.Tensor,
    cached: CachedStates,
    cached_valid: torch.Tensor,
    aggregation: str,
    ssc_topk: int,
    state_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gated read of ``L`` tokens of each of ``I`` sequences (``(I, L, H, ·)``, ``q`` normalised and scaled).

    ``online`` are the online memory's reads ``S_t^T q_t`` (the recurrence's outputs), ``cached`` the
    sequences' :class:`CachedStates` ``(I, N, ...)`` with ``cached_valid`` ``(I, N)``. MC-Titans' aggregation
    on the linear memory ``M(z) = S^T z``; ``soup`` is computed as ``grm`` (equal for a linear memory).
    ``state_rows`` ``(I,)``: ``cached.states`` is a larger stack ``(R, N, ...)`` (a layer's cache, every
    memory of every row) and sequence ``i`` reads ``cached.states[state_rows[i]]``; its other fields are the
    sequences' own. For one token a sequence (decoding) without gradients the Triton path reads those states
    where they lie (:func:`~.mc_gated_delta_triton.routed_read_triton`, which has no backward); otherwise they
    are gathered first.
    """
    aggregation = "grm" if aggregation == "soup" else aggregation
    heads_first = lambda x: x.transpose(1, 2)  # noqa: E731  (mc_read's (I, H, L, ·) layout)
    if state_rows is not None:
        recording = torch.is_grad_enabled() and any(
            t.requires_grad for t in (online, q, u, online_summary, *cached.tensors()))
        if (ROUTED_READ and not recording and q.shape[1] == 1 and cached.states.dtype == torch.float32
                and resolve_backend(q, True) == "triton"):
            g_cached, g_online = mc_gates(aggregation, ssc_topk, heads_first(u), heads_first(online_summary),
                                          cached.summary(), cached_valid[:, None, None, :], q.dtype)
            read = routed_read_triton(q[:, 0], g_cached[:, :, 0], cached.states, state_rows)
            return heads_first(g_online * heads_first(online)) + read[:, None].to(online.dtype)
        cached = replace(cached, states=cached.states[state_rows])
    spec = MLPMemorySpec(depth=1, d_k=q.shape[-1], d_v=online.shape[-1])
    y = mc_read(spec, aggregation, ssc_topk, heads_first(q), heads_first(u),
                lambda _name, _x: heads_first(online),  # the online read is already the recurrence's output
                heads_first(online_summary), {"w": cached.states.transpose(-1, -2)}, cached.summary(), cached_valid)
    return heads_first(y)


# --------------------------------------------------------------------------- reference


def reference_mc_gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    positions: list[int],
    segment_size: int,
    aggregation: str,
    *,
    u: torch.Tensor | None = None,
    ssc_topk: int = 2,
) -> torch.Tensor:
    """One sequence (``q, k`` ``(T, H, d_k)``, ``v`` ``(T, H, d_v)``, ``g, beta`` ``(T, H)``) whose tokens sit at
    ``positions`` of its row's clock; the state starts at zero. The gated aggregations take the gate inputs
    ``u`` ``(T, H, d_k)``. Returns the outputs."""
    gated = check_aggregation(aggregation, u, "matrix memories")
    H, K, V = q.shape[1], q.shape[2], v.shape[2]
    state = torch.zeros(1, H, K, V, dtype=torch.promote_types(v.dtype, torch.float32))
    cached: list[torch.Tensor] = []
    summaries: list[torch.Tensor] = []  # r^(i) of this memory, (H, d_k)
    segment_keys: list[torch.Tensor] = []  # its normalised keys in the current segment
    outputs = []
    for t, pos in enumerate(positions):
        while (len(cached) + 1) * segment_size <= pos:  # segment ends passed since the last token
            cached.append(state.clone())
            summaries.append(torch.stack(segment_keys).mean(0) if segment_keys else state.new_zeros(H, K))
            segment_keys = []
        o, state = reference_gated_delta(q[None, t:t + 1], k[None, t:t + 1], v[None, t:t + 1],
                                         None if g is None else g[None, t:t + 1], beta[None, t:t + 1],
                                         initial_state=state)
        qn, kn = _prepare_qk(q[t], k[t], None, True, state.dtype)
        if not gated:
            y = o[0, 0] + sum((torch.einsum("hk,hkv->hv", qn, c[0]) for c in cached), torch.zeros_like(o[0, 0]))
            outputs.append(y / (1 + len(cached)) if aggregation == "mean" else y)
            continue
        segment_keys.append(kn)
        reads = torch.stack([torch.einsum("hk,hkv->hv", qn, c[0]) for c in cached] + [o[0, 0].to(state.dtype)])
        rs = summaries + [torch.stack(segment_keys).mean(0)]
        scores = torch.stack([(u[t].to(state.dtype) * r).sum(-1) for r in rs])  # (N + 1, H)
        if aggregation == "ssc":
            # every cached memory scoring at least the k-th best score is kept (ties included), as in MC-Titans
            scores = torch.cat([ssc_select(scores[:-1], ssc_topk, dim=0), scores[-1:]])
        # grm; soup mixes the states first, which for a matrix memory is the same sum
        outputs.append((torch.softmax(scores, 0)[..., None] * reads).sum(0).to(v.dtype))
    return torch.stack(outputs) if outputs else v.new_zeros(0, H, V)


# --------------------------------------------------------------------------- packed


def _padded_layout(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Sequence and index in it of every packed entry, and the longest length."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    P = int(cu_seqlens[-1])
    L = int(lengths.max()) if P else 0
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)
    local = torch.arange(P, device=cu_seqlens.device) - cu_seqlens[seq]
    return seq, local, L


def _pad(x: torch.Tensor, seq: torch.Tensor, local: torch.Tensor, n: int, length: int) -> torch.Tensor:
    padded = x.new_zeros(n, length, *x.shape[1:])
    padded[seq, local] = x
    return padded


def read_states(q: torch.Tensor, states: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``o[p] = states[s(p)]^T q[p]`` for packed ``q`` ``(P, H, d_k)`` of the sequences ``cu_seqlens`` delimits,
    ``states`` ``(N, H, d_k, d_v)``; ``q`` already normalised and scaled."""
    P, H, K = q.shape
    if P == 0:
        return q.new_zeros(0, H, states.shape[-1])
    seq, local, L = _padded_layout(cu_seqlens)
    padded = _pad(q, seq, local, cu_seqlens.numel() - 1, L)
    return torch.einsum("slhk,shkv->slhv", padded, states.to(q.dtype))[seq, local]


def _read_segment_gated(o, qn, kn, u, pieces, cached: CachedStates, cached_valid, aggregation, ssc_topk):
    """The gated read of one segment's tokens (packed by ``pieces``) and the online key sums after them."""
    seq, local, L = _padded_layout(pieces)
    n = pieces.numel() - 1
    pad = lambda x: _pad(x, seq, local, n, L)  # noqa: E731
    live = torch.arange(L, device=o.device)[None] < (pieces[1:] - pieces[:-1])[:, None]
    # Running summary of the online segment: its keys so far, each token's own included.
    run_sum = cached.online_key_sum[:, None] + pad(kn).cumsum(1)  # (n, L, H, d_k)
    run_count = cached.online_key_count[:, None] + live.to(run_sum.dtype).cumsum(1)
    summary = key_mean(run_sum, run_count)
    y = read_scored(pad(o), pad(qn), pad(u), summary, cached, cached_valid, aggregation, ssc_topk)[seq, local]
    return y, replace(cached, online_key_sum=run_sum[:, -1], online_key_count=run_count[:, -1])


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
    cached: torch.Tensor | CachedStates,
    cached_count: torch.Tensor,
    segment_size: int,
    aggregation: str,
    chunk_size: int = 64,
    u: torch.Tensor | None = None,
    ssc_topk: int = 2,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | CachedStates, torch.Tensor]:
    """Packed sequences with Memory Caching.

    Args:
        q, k, v, g, beta: Packed ``(P, H, ·)`` / ``(P, H)`` inputs of the ``N`` sequences of ``cu_seqlens``.
        initial_state: ``(N, H, d_k, d_v)`` online states.
        positions: ``(P,)`` each token's index on its row's clock.
        sequence_row: ``(N,)`` the row of each sequence.
        row_clock: ``(before, after)`` ``(R,)``: each row's clock before and after these tokens; segment
            ends in ``(before, after]`` cache the row's states.
        cached: the sequences' cached memories: for ``mean``/``residual`` the ``(N, H, d_k, d_v)`` sum of
            the cached states, for the gated aggregations a :class:`CachedStates` ``(N, slots, ...)``.
        cached_count: ``(R,)`` the number of memories each row has cached.
        u: ``(P, H, d_k)`` the gate inputs of the gated aggregations.
        ssc_topk: cached memories each token reads with ``ssc``.

    Returns:
        ``(o, final_state, cached, cached_count)``; outputs ``(P, H, d_v)`` in ``v``'s dtype.
    """
    gated = check_aggregation(aggregation, u, "matrix memories")
    before, after = row_clock
    S = segment_size
    dtype = torch.promote_types(v.dtype, torch.float32)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=q.device), lengths)
    segment = positions // S
    state, cached_count = initial_state.to(dtype), cached_count.clone()
    cached = cached.map(lambda t: t.to(dtype)) if gated else cached.to(dtype)
    out = v.new_zeros(v.shape, dtype=dtype)
    qn, kn = _prepare_qk(q, k, None, True, dtype)
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
                if not gated:
                    read = torch.einsum("phk,phkv->phv", qn[piece], cached.index_select(0, owners))
            else:
                o, state = chunk_gated_delta(*(None if a is None else a.unsqueeze(0) for a in args),
                                             initial_state=state, cu_seqlens=pieces, chunk_size=chunk_size)
                o = o.squeeze(0)
                if not gated:
                    read = read_states(qn[piece], cached, pieces)
            if gated:
                valid = torch.arange(cached.slots, device=q.device)[None] < cached_count[sequence_row][:, None]
                y, cached = _read_segment_gated(o.to(dtype), qn[piece], kn[piece], u[piece].to(dtype), pieces,
                                                cached, valid, aggregation, ssc_topk)
            else:
                y = o.to(dtype) + read
                if aggregation == "mean":
                    y = y / (1 + cached_count[sequence_row[seq[piece]]]).to(dtype)[:, None, None]
            out[piece] = y
        # Rows whose clock passes the end of segment j in this call cache every memory now.
        closes = (before < (j + 1) * S) & (after >= (j + 1) * S)
        if bool(closes.any()):
            by_sequence = closes[sequence_row]
            if gated:
                cached = cached.with_slots(int((cached_count + closes.long()).max()))
                cached = cached.push(by_sequence, cached_count[sequence_row], state)
            else:
                cached = cached + state * by_sequence[:, None, None, None]
            cached_count = cached_count + closes.to(cached_count.dtype)
    return out.to(v.dtype), state, cached, cached_count


# --------------------------------------------------------------------------- step


def step_mc_gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    u: torch.Tensor,
    state: torch.Tensor,
    cached: CachedStates,
    cached_valid: torch.Tensor,
    *,
    aggregation: str,
    ssc_topk: int = 2,
    live: torch.Tensor | None = None,
    state_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, CachedStates]:
    """One token per sequence with a gated aggregation, without device-to-host reads (decoding).

    ``q, k, u`` ``(N, H, d_k)``, ``v`` ``(N, H, d_v)``, ``g, beta`` ``(N, H)``, ``state`` ``(N, H, d_k, d_v)``,
    ``cached`` the sequences' :class:`CachedStates` ``(N, slots, ...)`` with ``cached_valid`` ``(N, slots)``;
    ``live`` ``(N,)``: a padded token (``False``, written with ``beta = g = 0``) leaves the key sums too.
    ``state_rows`` ``(N,)``: ``cached.states`` is the stack of a layer's cache and sequence ``i`` reads row
    ``state_rows[i]`` of it (:func:`read_scored`), so that the caller gathers none of the states.
    Closing a segment is the caller's (:meth:`CachedStates.push`), which knows the rows' clocks.

    Returns ``(o, new_state, cached)`` with the online key sums advanced.
    """
    check_aggregation(aggregation, u, "matrix memories")
    if aggregation not in GATED_AGGREGATIONS:
        raise ValueError(f"the one-token step serves the gated aggregations {GATED_AGGREGATIONS}, got {aggregation!r}")
    dtype = torch.promote_types(v.dtype, torch.float32)
    o, new = step_gated_delta(q, k, v, g, beta, state)
    qn, kn = _prepare_qk(q, k, None, True, dtype)
    weight = torch.ones(q.shape[0], dtype=dtype, device=q.device) if live is None else live.to(dtype)
    cached = replace(cached, online_key_sum=cached.online_key_sum.to(dtype) + kn * weight[:, None, None],
                     online_key_count=cached.online_key_count.to(dtype) + weight)
    summary = key_mean(cached.online_key_sum, cached.online_key_count)
    y = read_scored(o.to(dtype)[:, None], qn[:, None], u.to(dtype)[:, None], summary[:, None],
                    cached.map(lambda t: t.to(dtype)), cached_valid, aggregation, ssc_topk, state_rows)[:, 0]
    return y.to(v.dtype), new, cached


def step_mc_gated_delta_summed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    state: torch.Tensor,
    cached_sum: torch.Tensor,
    cached_count: torch.Tensor,
    *,
    aggregation: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence with ``mean`` or ``residual``, without device-to-host reads (decoding).

    The online read plus the read of the running sum ``cached_sum`` ``(N, H, d_k, d_v)`` of the sequences'
    cached states (``mean``: divided by ``1 + cached_count`` ``(N,)``), as :func:`chunk_mc_gated_delta` reads a
    one-token piece; the other inputs as :func:`step_mc_gated_delta`'s. Closing a segment (adding the new
    state to the sum) is the caller's, which knows the rows' clocks. Returns ``(o, new_state)``.
    """
    if aggregation not in LINEAR_AGGREGATIONS:
        raise ValueError(f"the summed step serves the aggregations {LINEAR_AGGREGATIONS}, got {aggregation!r}")
    dtype = torch.promote_types(v.dtype, torch.float32)
    o, new = step_gated_delta(q, k, v, g, beta, state)
    qn, _ = _prepare_qk(q, k, None, True, dtype)
    y = o.to(dtype) + torch.einsum("phk,phkv->phv", qn, cached_sum.to(dtype))
    if aggregation == "mean":
        y = y / (1 + cached_count).to(dtype)[:, None, None]
    return y.to(v.dtype), new
