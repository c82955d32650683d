"""Memory Caching over the Atlas memory (FAMILIES.md §2-3).

At the end of every segment of ``segment_size`` tokens of a row, the row's
memory weights are cached, and token ``t`` reads its online memory (after its
own write, as Atlas does) and every memory cached before it:

- ``residual``: ``y_t = M_t(phi(q_t)) + sum_i M^(i)(phi(q_t))``
- ``mean``:     the same sum divided by ``1 + N_t`` (``N_t`` memories cached so far)

The memory is an MLP, so each cached memory is read on its own (unlike the
matrix memories of ``cached_linear.py``): the cache holds the list, growing by
one memory per segment. The online memory continues across segments
(``checkpoint`` mode): its inner chunks, Omega window and optimiser state are
those of plain Atlas, so inside the first segment the layer is plain Atlas.

Entry points: :func:`reference_mc_atlas` (token by token with the step kernel,
an explicit list) and :func:`chunk_mc_atlas` (the chunked kernel run segment by
segment over compacted rows), plus :class:`CachedMemories`, the list.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .atlas import AtlasState, chunk_atlas, step_atlas
from .titans import TitansMemorySpec, memory_apply, static_apply

__all__ = ["AGGREGATIONS", "CachedMemories", "chunk_mc_atlas", "reference_mc_atlas"]

AGGREGATIONS = ("mean", "residual")


def _check_aggregation(aggregation: str) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation over Atlas memories must be one of {AGGREGATIONS}, got {aggregation!r}")


@dataclass
class CachedMemories:
    """Cached weights ``{name: (B, N, H, d_out, d_in)}`` with ``count (B,)`` valid slots per row."""

    weights: dict[str, torch.Tensor]
    count: torch.Tensor

    @classmethod
    def empty(cls, like: dict[str, torch.Tensor]) -> "CachedMemories":
        w = next(iter(like.values()))
        return cls({n: x.new_zeros(x.shape[0], 0, *x.shape[1:]) for n, x in like.items()},
                   torch.zeros(w.shape[0], dtype=torch.long, device=w.device))

    def push(self, rows: torch.Tensor, weights: dict[str, torch.Tensor]) -> "CachedMemories":
        """A new list with ``weights`` appended for ``rows`` (bool ``(B,)``)."""
        if not bool(rows.any()):
            return self
        cached = self.weights
        N = next(iter(cached.values())).shape[1]
        if int((self.count + rows.long()).max()) > N:  # grow by one slot
            cached = {n: torch.cat([c, c.new_zeros(c.shape[0], 1, *c.shape[2:])], 1) for n, c in cached.items()}
            N += 1
        slot = (torch.arange(N, device=rows.device)[None] == self.count[:, None]) & rows[:, None]
        s = slot[..., None, None, None]
        return CachedMemories({n: torch.where(s, weights[n][:, None].to(c.dtype), c) for n, c in cached.items()},
                              self.count + rows.long())

    def read(self, spec: TitansMemorySpec, q: torch.Tensor) -> torch.Tensor:
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


def reference_mc_atlas(
    spec: TitansMemorySpec,
    q, k, v, alpha, lr, momentum, gamma,
    state: AtlasState,
    *,
    segment_size: int,
    aggregation: str,
    **options,
) -> torch.Tensor:
    """One row's tokens (``(1, T, ...)`` inputs, all valid) from a fresh ``state``, token by token."""
    _check_aggregation(aggregation)
    cached = CachedMemories.empty(state.weights)
    outputs = []
    for t in range(q.shape[1]):
        if t and t % segment_size == 0:
            cached = cached.push(torch.ones(1, dtype=torch.bool, device=q.device), state.weights)
        o, state = step_atlas(spec, q[:, t], k[:, t], v[:, t], alpha[:, t], lr[:, t],
                              None if momentum is None else momentum[:, t], gamma[:, t], state, **options)
        read = cached.read(spec, q[:, t][:, :, None].to(o.dtype))[:, :, 0]
        outputs.append(_combine(o, read, cached.count, aggregation))
    return torch.stack(outputs, 1)


def _front(x: torch.Tensor | None, start: torch.Tensor, width: int) -> torch.Tensor | None:
    """Each row's tokens from ``start`` on, moved to the front: ``(B, width, ...)`` (tail clamped)."""
    if x is None:
        return None
    B, T = x.shape[:2]
    index = (start[:, None] + torch.arange(width, device=x.device)[None]).clamp(max=T - 1)
    return x.gather(1, index.view(B, width, *([1] * (x.dim() - 2))).expand(B, width, *x.shape[2:]))


def chunk_mc_atlas(
    spec: TitansMemorySpec,
    q, k, v, alpha, lr, momentum, gamma,
    state: AtlasState,
    cached: CachedMemories,
    *,
    lengths: torch.Tensor,
    clock: torch.Tensor,
    segment_size: int,
    aggregation: str,
    **options,
) -> tuple[torch.Tensor, AtlasState, CachedMemories]:
    """Compacted rows (``(B, T, ...)``, ``lengths`` valid) whose clocks stand at ``clock`` ``(B,)``.

    Runs the chunked kernel once per segment the rows span (each row's slice of
    the segment moved to the front), reads the cached memories for it, and caches
    the memories of the rows whose clock passes the segment's end.
    """
    _check_aggregation(aggregation)
    S = segment_size
    B, T = q.shape[:2]
    out = None
    first = int(clock.min()) // S
    last = max(int((clock + lengths).max()) - 1, int(clock.min())) // S
    for j in range(first, last + 1):
        start = (j * S - clock).clamp(min=0).minimum(lengths)
        stop = ((j + 1) * S - clock).clamp(min=0).minimum(lengths)
        count = stop - start
        width = int(count.max())
        if width:
            piece = [_front(x, start, width) for x in (q, k, v, alpha, lr, momentum, gamma)]
            if width == 1:
                o, state = step_atlas(spec, *(None if x is None else x[:, 0] for x in piece), state,
                                      live=count > 0, **options)
                o = o[:, None]
            else:
                o, state = chunk_atlas(spec, *piece, state, lengths=count, **options)
            read = cached.read(spec, piece[0].transpose(1, 2).to(o.dtype)).transpose(1, 2)
            y = _combine(o, read, cached.count, aggregation)
            y = y * (torch.arange(width, device=q.device)[None] < count[:, None])[..., None, None]
            if out is None:  # float32 at least: under autocast the reads of cached memories may come back in bf16
                out = y.new_zeros(B, T + 1, *y.shape[2:], dtype=torch.promote_types(y.dtype, torch.float32))
            # Tokens past a row's count go to the spill column T, dropped below.
            index = torch.where(torch.arange(width, device=q.device)[None] < count[:, None],
                                start[:, None] + torch.arange(width, device=q.device)[None], T)
            out = out.scatter(1, index[..., None, None].expand_as(y), y.to(out.dtype))
        closes = (clock < (j + 1) * S) & (clock + lengths >= (j + 1) * S)
        cached = cached.push(closes, state.weights)
    if out is None:
        out = v.new_zeros(B, T + 1, *v.shape[2:], dtype=torch.promote_types(v.dtype, torch.float32))
    return out[:, :T], state, cached
