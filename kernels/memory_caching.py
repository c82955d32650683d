"""Memory Caching's read, shared by every cached memory (MC paper; docs/semantics.md).

The sequence of each row is cut into segments; at the end of a segment a layer caches its
memory's state ``M^(i)`` and the segment's summary ``r^(i)`` (the mean of its normalised keys).
Token ``t`` reads its online memory ``M_t`` (after its own write) and the cached memories
through ``aggregation``, scored by ``s^(i) = <u_t, r^(i)>`` with the gate projection ``u_t``
(the online memory's summary is the mean of the current segment's keys so far):

- ``residual``: ``M_t(q) + sum_i M^(i)(q)``;  ``mean``: their uniform average;
- ``grm``: ``softmax`` of the scores over cached and online memories, weighted sum;
- ``soup``: the same weights mix the memories' *weights*, then one forward;
- ``ssc``: ``grm`` over the ``ssc_topk`` best cached memories and the online one. Cached
  memories tied with the ``ssc_topk``-th best score are all kept, so a zero gate projection
  reads every memory uniformly, like ``mean``; "tied" means within ``SSC_TIE_TOLERANCE`` of it
  (relative, at least 1 in scale), because two segments with the same keys get summaries that
  differ by rounding when they are computed in different calls (a prefill and a decode step),
  and an exact comparison then kept one memory in one path and two in the other.

This module holds what the three cached memories (:mod:`.mc_gated_delta` for MoM,
:mod:`.mc_titans`, :mod:`.mc_atlas`) share: the options and segmentations
(:class:`MCOptions`, :func:`log_segments`), the gates (:func:`mc_gates`, :func:`ssc_select`),
the read of MLP memories (:func:`mc_read`) and the segment summaries' bookkeeping
(:func:`key_mean`, :func:`with_extra_slots`, :func:`close_segments`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .mlp_memory import MLPMemorySpec, memory_apply, static_apply

__all__ = [
    "AGGREGATIONS",
    "GATED_AGGREGATIONS",
    "LINEAR_AGGREGATIONS",
    "MCOptions",
    "check_aggregation",
    "close_segments",
    "key_mean",
    "log_segments",
    "mc_gates",
    "mc_read",
    "ssc_select",
    "with_extra_slots",
]


LINEAR_AGGREGATIONS = ("mean", "residual")  # no parameters: what post-training conversion starts from
GATED_AGGREGATIONS = ("grm", "soup", "ssc")  # scored by the gate projection u
AGGREGATIONS = LINEAR_AGGREGATIONS + GATED_AGGREGATIONS
# Far above float32 rounding of a score (about 1e-7 of its scale), far below any gap that
# routing learns: scores this close to the k-th best count as tied with it.
SSC_TIE_TOLERANCE = 2.0**-16
SEGMENTATIONS = ("constant", "logarithmic")
CACHE_MODES = ("checkpoint", "independent")


def check_aggregation(aggregation: str, u: torch.Tensor | None, memories: str) -> bool:
    """Validate an aggregation over ``memories`` (for the message); ``True`` for a gated one, which
    needs the gate inputs ``u``."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation over {memories} must be one of {AGGREGATIONS}, got {aggregation!r}")
    gated = aggregation in GATED_AGGREGATIONS
    if gated and u is None:
        raise ValueError(f"aggregation {aggregation!r} scores the memories: pass the gate inputs u")
    return gated


@dataclass(frozen=True)
class MCOptions:
    segment_size: int | None = 256
    segmentation: str = "constant"
    cache_mode: str = "checkpoint"
    aggregation: str = "grm"
    ssc_topk: int = 2
    chunk_size: int = 64

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if self.segmentation not in SEGMENTATIONS:
            raise ValueError(f"segmentation must be one of {SEGMENTATIONS}, got {self.segmentation!r}")
        if self.cache_mode not in CACHE_MODES:
            raise ValueError(f"cache_mode must be one of {CACHE_MODES}, got {self.cache_mode!r}")
        if self.segment_size is not None and self.segment_size < 1:
            raise ValueError(f"segment_size must be >= 1 or None, got {self.segment_size}")
        if self.ssc_topk < 1 or self.chunk_size < 1:
            raise ValueError("ssc_topk and chunk_size must be >= 1")
        if self.segmentation == "logarithmic" and self.cache_mode == "independent":
            raise ValueError("cache_mode='independent' is undefined with logarithmic segments: use 'checkpoint'")

    @property
    def logarithmic(self) -> bool:
        return self.segmentation == "logarithmic"


def log_segments(length: int) -> list[tuple[int, int]]:
    """``[start, end)`` of the segments of a prefix of ``length`` tokens: powers of two, oldest largest."""
    segments, start = [], 0
    for bit in reversed(range(max(length, 1).bit_length())):
        if length >> bit & 1:
            segments.append((start, start + (1 << bit)))
            start += 1 << bit
    return segments


# --------------------------------------------------------------------------- aggregation


def ssc_select(scores: torch.Tensor, topk: int, dim: int = -1) -> torch.Tensor:
    """``scores`` of cached memories with all but the ``topk`` best (and those tied with the
    ``topk``-th, see ``SSC_TIE_TOLERANCE``) set to ``-inf`` along ``dim``."""
    if scores.shape[dim] <= topk:
        return scores
    kth = scores.topk(topk, dim=dim).values.narrow(dim, topk - 1, 1)
    slack = SSC_TIE_TOLERANCE * kth.abs().clamp(min=1.0)
    return scores.masked_fill(scores < kth - slack, float("-inf"))


def mc_gates(aggregation: str, ssc_topk: int, u: torch.Tensor, online_summary: torch.Tensor,
             cached_summary: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The aggregation's weights of the cached memories ``(B, H, T, N)`` and of the online one ``(B, H, T, 1)``
    for gate projections ``u (B, H, T, d_k)``; ``valid`` (bool, broadcast to ``(B, H, T, N)``) says which
    cached memory each query may read; ``dtype`` (default ``u``'s) is the fixed weights' dtype."""
    if aggregation in ("grm", "soup", "ssc"):
        s_cached = torch.einsum("bhtd,bnhd->bhtn", u, cached_summary).masked_fill(~valid, float("-inf"))
        s_online = (u * online_summary).sum(-1, keepdim=True)
        if aggregation == "ssc":
            s_cached = ssc_select(s_cached, ssc_topk)
        gates = torch.softmax(torch.cat([s_cached, s_online], dim=-1), dim=-1)
        return gates[..., :-1], gates[..., -1:]
    dtype = u.dtype if dtype is None else dtype
    n = valid.sum(-1, keepdim=True).to(dtype)
    scale = 1.0 / (1.0 + n) if aggregation == "mean" else torch.ones_like(n)
    return valid.to(dtype) * scale, scale


def mc_read(
    spec: MLPMemorySpec,
    aggregation: str,
    ssc_topk: int,
    q: torch.Tensor,
    u: torch.Tensor,
    online,
    online_summary: torch.Tensor,
    cached: dict[str, torch.Tensor],
    cached_summary: torch.Tensor,
    cached_valid: torch.Tensor,
) -> torch.Tensor:
    """Read the online and cached memories for queries ``q`` ``(B, H, T, d_k)``.

    ``online`` is an ``apply`` (weights of each token) or, for every aggregation but ``soup``
    (which mixes weights, not reads), the online memory's reads of ``q`` already made; ``cached``
    weights are ``(B, N, H, d_out, d_in)`` with summaries ``(B, N, H, d_k)`` and ``cached_valid (B, N)``.
    """
    g_cached, g_online = mc_gates(aggregation, ssc_topk, u, online_summary, cached_summary,
                                  cached_valid[:, None, None, :], q.dtype)
    if aggregation == "soup":
        if isinstance(online, torch.Tensor):
            raise ValueError("the soup aggregation mixes the online weights themselves: pass them as an apply")

        def mixed(name, x):
            from_cached = torch.einsum("bhti,bnhoi,bhtn->bhto", x, cached[name].to(x.dtype), g_cached)
            return g_online * online(name, x) + from_cached

        return memory_apply(spec, mixed, q)
    y = g_online * (online if isinstance(online, torch.Tensor) else memory_apply(spec, online, q))
    if cached_valid.shape[1]:
        per_memory = memory_apply(spec, static_apply(cached), q[:, None])  # (B, N, H, T, d_v)
        y = y + torch.einsum("bnhtd,bhtn->bhtd", per_memory, g_cached)
    return y


# -------------------------------- Segment summaries: the bookkeeping every caching memory shares


def key_mean(key_sum: torch.Tensor, key_count: torch.Tensor) -> torch.Tensor:
    """``key_sum (..., H, d_k) / key_count (...)``: zero where no key was received."""
    return key_sum / key_count.clamp(min=1)[..., None, None]


def with_extra_slots(t: torch.Tensor, dim: int, extra: int = 1) -> torch.Tensor:
    """``t`` with ``extra`` zero slots appended along ``dim``."""
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t, t.new_zeros(shape)], dim)


def close_segments(
    key_sum: torch.Tensor,
    key_count: torch.Tensor,
    online_key_sum: torch.Tensor,
    online_key_count: torch.Tensor,
    at: torch.Tensor,
    closing: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Move the online segment's keys into slot ``at`` ``(..., N)`` (bool, one slot per closing row) where
    ``closing`` ``(...,)``, and restart those online segments empty. Returns the four tensors, updated."""
    return (
        torch.where(at[..., None, None], online_key_sum.unsqueeze(-3), key_sum),
        torch.where(at, online_key_count.unsqueeze(-1), key_count),
        torch.where(closing[..., None, None], torch.zeros_like(online_key_sum), online_key_sum),
        torch.where(closing, torch.zeros_like(online_key_count), online_key_count),
    )
