"""Segment summaries of Memory Caching: the bookkeeping every caching family shares.

A gated aggregation scores cached memory ``i`` by ``<u_t, r^(i)>``, where the summary
``r^(i)`` is the mean of the normalised keys that memory received in its segment.
Summaries are kept as sums and counts and divided only when read, so that a prefill
and a decode step round alike. The cached slots hold ``key_sum (..., N, H, d_k)`` and
``key_count (..., N)``; the online segment ``online_key_sum (..., H, d_k)`` and
``online_key_count (...,)``. MC-Titans' ``MCState``, Atlas' ``CachedMemories`` and
MoM's ``CachedStates`` keep them in these layouts (their leading dimensions differ)
and share these functions.
"""

from __future__ import annotations

import torch

__all__ = ["close_segments", "key_mean", "with_extra_slots"]


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
