"""Memory Caching over the Atlas memory (docs/semantics.md).

At the end of every segment of ``segment_size`` tokens of a row, the row's
memory weights are cached, and token ``t`` reads its online memory (after its
own write, as Atlas does) and every memory cached before it, with the
aggregations of MC-Titans (``memory_caching.py``):

- ``residual``: ``y_t = M_t(phi(q_t)) + sum_i M^(i)(phi(q_t))``
- ``mean``:     the same sum divided by ``1 + N_t`` (``N_t`` memories cached so far)
- ``grm``, ``soup``, ``ssc``: gated by the scores ``s_t^(i) = <u_t, r^(i)>`` of the
  cached memories and of the online one, exactly as MC-Titans gates them (the one
  aggregation, :func:`~.memory_caching.mc_read`, serves both families).

Summaries: the memory receives the feature-mapped keys ``phi(k_t)``, so a
segment's summary ``r^(i)`` is the mean of its keys *as the memory receives
them*, each L2-normalised: ``mean_t phi(k_t) / ||phi(k_t)||``. Normalising keeps
the scores' scale independent of the learnable feature coefficients, as the unit
keys of MC-Titans do; taking the keys after ``phi`` puts the summaries in the
space the memory is written and read in. The gate input ``u_t`` therefore has
the feature width ``spec.d_k`` (larger than the head width with
``poly_tensor``). The online memory's summary is the mean of the current
segment's normalised keys so far, the current token's included.

The memory is an MLP, so each cached memory is read on its own (unlike the
matrix memories of :mod:`.mc_gated_delta`): the cache holds the list, growing by
one memory per segment. The online memory continues across segments
(``checkpoint`` mode): its inner chunks, Omega window and optimiser state are
those of plain Atlas, so inside the first segment the layer is plain Atlas
whatever the aggregation.

Entry points: :func:`reference_mc_atlas` (token by token with the step kernel,
explicit lists), :func:`chunk_mc_atlas` (the chunked kernel run segment by
segment over compacted rows) and :func:`step_mc_atlas` (one token of every row,
the decode step: with slots reserved ahead it reads nothing back to the host, so
a CUDA graph captures it), plus :class:`CachedMemories`, the list.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from .atlas import AtlasState, chunk_atlas, step_atlas
from .norms import l2_normalize
from .memory_caching import (
    AGGREGATIONS,
    GATED_AGGREGATIONS,
    check_aggregation,
    check_slot_mode,
    close_segments,
    grown_slots,
    key_mean,
    mc_read,
    with_extra_slots,
    write_memories,
)
from .mlp_memory import MLPMemorySpec, memory_apply, static_apply

__all__ = ["AGGREGATIONS", "GATED_AGGREGATIONS", "CachedMemories", "chunk_mc_atlas", "reference_mc_atlas",
           "step_mc_atlas"]


@dataclass
class CachedMemories:
    """Cached weights ``{name: (B, N, H, d_out, d_in)}`` with ``count (B,)`` valid slots per row.

    For the gated aggregations it also keeps the summaries as sums and counts of
    normalised keys (divided only when read, so that every path rounds alike):
    ``key_sum (B, N, H, d_k)`` and ``key_count (B, N)`` of each cached segment,
    ``online_key_sum (B, H, d_k)`` and ``online_key_count (B,)`` of the current one.
    """

    weights: dict[str, torch.Tensor]
    count: torch.Tensor
    key_sum: torch.Tensor | None = None
    key_count: torch.Tensor | None = None
    online_key_sum: torch.Tensor | None = None
    online_key_count: torch.Tensor | None = None

    @classmethod
    def empty(cls, like: dict[str, torch.Tensor], summary_dim: int | None = None) -> "CachedMemories":
        """No memory cached for rows shaped like the weights ``like`` (``(B, H, ...)``); with
        ``summary_dim``, empty summaries of that width too."""
        w = next(iter(like.values()))
        B, H = w.shape[:2]
        cached = cls({n: x.new_zeros(x.shape[0], 0, *x.shape[1:]) for n, x in like.items()},
                     torch.zeros(B, dtype=torch.long, device=w.device))
        if summary_dim is not None:
            cached.key_sum = w.new_zeros(B, 0, H, summary_dim)
            cached.key_count = w.new_zeros(B, 0)
            cached.online_key_sum = w.new_zeros(B, H, summary_dim)
            cached.online_key_count = w.new_zeros(B)
        return cached

    @property
    def has_summaries(self) -> bool:
        return self.key_sum is not None

    @property
    def valid(self) -> torch.Tensor:
        """``(B, N)``: which slots of each row hold a cached memory."""
        return torch.arange(self.slots, device=self.count.device)[None] < self.count[:, None]

    def summary(self) -> torch.Tensor:
        """``r^(i)`` of every slot, ``(B, N, H, d_k)`` (zero in empty slots)."""
        return key_mean(self.key_sum, self.key_count)

    @property
    def slots(self) -> int:
        return next(iter(self.weights.values())).shape[1]

    def reserve(self, slots: int) -> "CachedMemories":
        """At least ``slots`` slots (new ones empty): room for :meth:`push` without device reads."""
        extra = slots - self.slots
        if extra <= 0:
            return self
        out = replace(self, weights={n: with_extra_slots(c, 1, extra) for n, c in self.weights.items()})
        if self.has_summaries:
            out.key_sum, out.key_count = with_extra_slots(self.key_sum, 1, extra), with_extra_slots(self.key_count, 1, extra)
        return out

    def push(self, rows: torch.Tensor, weights: dict[str, torch.Tensor], *, slots: str = "grow") -> "CachedMemories":
        """A new list with ``weights`` appended for ``rows`` (bool ``(B,)``); with summaries, the
        online segment's keys move into the new slot and the online segment restarts empty. ``slots``: how
        the cache makes room (:func:`~.memory_caching.check_slot_mode`)."""
        check_slot_mode(slots)
        cached = self
        if slots == "grow":
            needed = grown_slots(rows, self.count)
            if needed is None:
                return self
            cached = self.reserve(needed)
        N = cached.slots
        if slots == "in_place" and N == 0:  # no slot: nothing can close yet (the caller reserved what the host knows)
            return self
        slot = (torch.arange(N, device=rows.device)[None] == self.count[:, None]) & rows[:, None]
        out = replace(cached, weights=write_memories(cached.weights, weights, rows, self.count, slot,
                                                     in_place=slots == "in_place"), count=self.count + rows.long())
        if self.has_summaries:
            out.key_sum, out.key_count, out.online_key_sum, out.online_key_count = close_segments(
                cached.key_sum, cached.key_count, self.online_key_sum, self.online_key_count, slot, rows)
        return out

    def read(self, spec: MLPMemorySpec, q: torch.Tensor) -> torch.Tensor:
        """``sum_i M^(i)(q)`` over each row's valid memories for ``q`` ``(B, H, T, d_k)``."""
        N = next(iter(self.weights.values())).shape[1]
        if N == 0:
            return q.new_zeros(*q.shape[:-1], spec.d_v)
        per_memory = memory_apply(spec, static_apply(self.weights), q[:, None])  # (B, N, H, T, d_v)
        valid = torch.arange(N, device=q.device)[None] < self.count[:, None]
        return (per_memory * valid[:, :, None, None, None].to(per_memory.dtype)).sum(1)


def _combine(online: torch.Tensor, cached_read: torch.Tensor, count: torch.Tensor, aggregation: str) -> torch.Tensor:
    y = online + cached_read
    if aggregation == "mean":
        y = y / (1 + count).to(y.dtype).view(-1, *([1] * (y.dim() - 1)))
    return y


def _stack(items: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """``items`` (each shaped like ``like``, ``(1, ...)``) stacked on a new dim 1, possibly empty."""
    return torch.stack(items, 1) if items else like.new_zeros(like.shape[0], 0, *like.shape[1:])


def _gated_read(spec: MLPMemorySpec, aggregation: str, ssc_topk: int,
                cached: CachedMemories) -> Callable[..., torch.Tensor]:
    """The read of one segment's tokens: the online memory and the memories ``cached`` before the segment."""
    names = list(cached.weights)

    def read(apply, q: torch.Tensor, u: torch.Tensor, online_summary: torch.Tensor, cached_valid: torch.Tensor,
             cached_summary: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        return mc_read(spec, aggregation, ssc_topk, q, u, apply, online_summary, dict(zip(names, weights)),
                       cached_summary, cached_valid)

    return read


def _read_consts(cached: CachedMemories) -> tuple[torch.Tensor, ...]:
    """The tensors :func:`_gated_read`'s read takes after its per-token inputs."""
    return (cached.valid, cached.summary(), *cached.weights.values())


def reference_mc_atlas(
    spec: MLPMemorySpec,
    q, k, v, retention, lr, momentum, gamma,
    state: AtlasState,
    *,
    segment_size: int,
    aggregation: str,
    u: torch.Tensor | None = None,
    ssc_topk: int = 2,
    **options,
) -> torch.Tensor:
    """One row's tokens (``(1, T, ...)`` inputs, all valid) from a fresh ``state``, token by token.

    The cached memories, their summaries and the current segment's keys are plain
    lists; ``u`` ``(1, T, H, d_k)`` are the gate inputs of the gated aggregations.
    """
    check_aggregation(aggregation, u, "Atlas memories")
    memories: list[dict[str, torch.Tensor]] = []  # M^(i), oldest first
    summaries: list[torch.Tensor] = []  # r^(i), (1, H, d_k)
    segment_keys: list[torch.Tensor] = []  # normalised keys of the online segment so far
    outputs = []
    for t in range(q.shape[1]):
        if t and t % segment_size == 0:  # the previous token closed a segment
            memories.append(state.weights)
            summaries.append(torch.stack(segment_keys).mean(0))
            segment_keys = []
        o, state = step_atlas(spec, q[:, t], k[:, t], v[:, t], retention[:, t], lr[:, t],
                              None if momentum is None else momentum[:, t], gamma[:, t], state, **options)
        segment_keys.append(l2_normalize(k[:, t].to(o.dtype)))
        qt = q[:, t][:, :, None].to(o.dtype)  # (1, H, 1, d_k)
        if aggregation in GATED_AGGREGATIONS:
            # mc_read takes the lists as (1, N, ...) stacks
            cached = {n: _stack([m[n] for m in memories], w) for n, w in state.weights.items()}
            cached_summary = _stack(summaries, segment_keys[0])
            valid = torch.ones(1, len(memories), dtype=torch.bool, device=q.device)
            online_summary = torch.stack(segment_keys).mean(0)[:, :, None]
            y = mc_read(spec, aggregation, ssc_topk, qt, u[:, t][:, :, None].to(o.dtype), static_apply(state.weights),
                        online_summary, cached, cached_summary, valid)[:, :, 0]
        else:
            reads = [o] + [memory_apply(spec, static_apply(m), qt)[:, :, 0] for m in memories]
            y = sum(reads) / len(reads) if aggregation == "mean" else sum(reads)
        outputs.append(y)
    return torch.stack(outputs, 1)


def _front(x: torch.Tensor | None, start: torch.Tensor, width: int) -> torch.Tensor | None:
    """Each row's tokens from ``start`` on, moved to the front: ``(B, width, ...)`` (tail clamped)."""
    if x is None:
        return None
    B, T = x.shape[:2]
    index = (start[:, None] + torch.arange(width, device=x.device)[None]).clamp(max=T - 1)
    return x.gather(1, index.view(B, width, *([1] * (x.dim() - 2))).expand(B, width, *x.shape[2:]))


def step_mc_atlas(
    spec: MLPMemorySpec,
    q, k, v, retention, lr, momentum, gamma,
    state: AtlasState,
    cached: CachedMemories,
    *,
    live: torch.Tensor,
    clock: torch.Tensor,
    segment_size: int,
    aggregation: str,
    u: torch.Tensor | None = None,
    ssc_topk: int = 2,
    slots: str = "grow",
    **options,
) -> tuple[torch.Tensor, AtlasState, CachedMemories]:
    """One token per row (``q, k, v, u`` ``(B, H, d)``, gates ``(B, H)``), ``live`` rows only, clocks at
    ``clock`` ``(B,)``: :func:`chunk_mc_atlas` of one token, with every row in one step. ``slots``
    (:meth:`CachedMemories.push`): ``"reserved"`` or ``"in_place"`` where the cache has a slot for a segment
    this token closes (:func:`~.memory_caching.decode_slots`), so the step reads nothing back to the host."""
    check_aggregation(aggregation, u, "Atlas memories")
    dtype = torch.promote_types(v.dtype, torch.float32)
    o, state = step_atlas(spec, q, k, v, retention, lr, momentum, gamma, state, live=live, **options)
    if aggregation in GATED_AGGREGATIONS:
        if not cached.has_summaries:
            raise ValueError(f"aggregation {aggregation!r} needs a cache that keeps segment summaries")
        run_sum = cached.online_key_sum + l2_normalize(k.to(dtype)) * live[:, None, None]
        run_count = cached.online_key_count + live.to(dtype)
        # the step's own output is the online read alone: read again with the cache
        y = _gated_read(spec, aggregation, ssc_topk, cached)(
            static_apply(state.weights), q.to(dtype)[:, :, None], u.to(dtype)[:, :, None],
            key_mean(run_sum, run_count)[:, :, None], *_read_consts(cached))[:, :, 0]
        cached = replace(cached, online_key_sum=run_sum, online_key_count=run_count)
    else:
        y = _combine(o, cached.read(spec, q.to(o.dtype)[:, :, None])[:, :, 0], cached.count, aggregation)
    y = y * live[:, None, None]
    closes = live & ((clock + 1) % segment_size == 0)
    return y, state, cached.push(closes, state.weights, slots=slots)


def chunk_mc_atlas(
    spec: MLPMemorySpec,
    q, k, v, retention, lr, momentum, gamma,
    state: AtlasState,
    cached: CachedMemories,
    *,
    lengths: torch.Tensor,
    clock: torch.Tensor,
    segment_size: int,
    aggregation: str,
    u: torch.Tensor | None = None,
    ssc_topk: int = 2,
    **options,
) -> tuple[torch.Tensor, AtlasState, CachedMemories]:
    """Compacted rows (``(B, T, ...)``, ``lengths`` valid) whose clocks stand at ``clock`` ``(B,)``.

    Runs the chunked kernel once per segment the rows span (each row's slice of
    the segment moved to the front), reads the cached memories for it, and caches
    the memories of the rows whose clock passes the segment's end. The gated
    aggregations need the gate inputs ``u`` ``(B, T, H, d_k)`` and a ``cached``
    list with summaries (``CachedMemories.empty(weights, d_k)``).
    """
    check_aggregation(aggregation, u, "Atlas memories")
    gated = aggregation in GATED_AGGREGATIONS
    if gated and not cached.has_summaries:
        raise ValueError(f"aggregation {aggregation!r} needs a cache that keeps segment summaries")
    S = segment_size
    B, T = q.shape[:2]
    dtype = torch.promote_types(v.dtype, torch.float32)
    out = None
    first = int(clock.min()) // S
    last = max(int((clock + lengths).max()) - 1, int(clock.min())) // S
    for j in range(first, last + 1):
        start = (j * S - clock).clamp(min=0).minimum(lengths)
        stop = ((j + 1) * S - clock).clamp(min=0).minimum(lengths)
        count = stop - start
        width = int(count.max())
        if width:
            piece = [_front(x, start, width) for x in (q, k, v, retention, lr, momentum, gamma)]
            live = torch.arange(width, device=q.device)[None] < count[:, None]
            if gated:
                # Running summary of the online segment: its keys so far, each token's own included.
                keys = l2_normalize(piece[1].to(dtype)) * live[..., None, None]
                run_sum = cached.online_key_sum[:, None] + keys.cumsum(1)  # (B, width, H, d_k)
                run_count = cached.online_key_count[:, None] + live.to(dtype).cumsum(1)
                online_summary = key_mean(run_sum, run_count)
                gates_in = _front(u, start, width).to(dtype)
                read = _gated_read(spec, aggregation, ssc_topk, cached)
            if width == 1:
                o, state = step_atlas(spec, *(None if x is None else x[:, 0] for x in piece), state,
                                      live=count > 0, **options)
                o = o[:, None]
                if gated:  # the step's own output is the online read alone: read again with the cache
                    o = read(static_apply(state.weights), piece[0].to(dtype).transpose(1, 2),
                             gates_in.transpose(1, 2), online_summary.transpose(1, 2),
                             *_read_consts(cached)).transpose(1, 2)
            elif gated:
                o, state = chunk_atlas(spec, *piece, state, lengths=count, read=read,
                                       read_inputs=(gates_in, online_summary), read_consts=_read_consts(cached),
                                       **options)
            else:
                o, state = chunk_atlas(spec, *piece, state, lengths=count, **options)
            if gated:
                y = o
                cached = replace(cached, online_key_sum=run_sum[:, -1], online_key_count=run_count[:, -1])
            else:
                read_cached = cached.read(spec, piece[0].transpose(1, 2).to(o.dtype)).transpose(1, 2)
                y = _combine(o, read_cached, cached.count, aggregation)
            y = y * live[..., None, None]
            if out is None:  # float32 at least: under autocast the reads of cached memories may come back in bf16
                out = y.new_zeros(B, T + 1, *y.shape[2:], dtype=torch.promote_types(y.dtype, torch.float32))
            # Tokens past a row's count go to the spill column T, dropped below.
            index = torch.where(live, start[:, None] + torch.arange(width, device=q.device)[None], T)
            out = out.scatter(1, index[..., None, None].expand_as(y), y.to(out.dtype))
        closes = (clock < (j + 1) * S) & (clock + lengths >= (j + 1) * S)
        cached = cached.push(closes, state.weights)
    if out is None:
        out = v.new_zeros(B, T + 1, *v.shape[2:], dtype=torch.promote_types(v.dtype, torch.float32))
    return out[:, :T], state, cached
