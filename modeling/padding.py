"""Moving each row's valid tokens to the front and back.

Memories whose semantics count tokens (inner chunks, segments) must count each
row's own tokens, so a padded row computes exactly what it would alone: layers
compact the valid tokens of every row to the front (keeping their order), run
the memory with per-row lengths, and scatter the outputs back.
"""

from __future__ import annotations

import torch


class RowCompaction:
    """Gather/scatter of the valid tokens of ``valid (B, T)`` to the front of each row."""

    def __init__(self, valid: torch.Tensor) -> None:
        valid = valid.bool()
        self.order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
        self.lengths = valid.sum(1)

    def compact(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """``x (B, T, ...)`` with each row's valid tokens first."""
        if x is None:
            return None
        B, T = self.order.shape
        return x.gather(1, self.order.view(B, T, *([1] * (x.dim() - 2))).expand_as(x))

    def restore(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`compact` for outputs that are zero past each row's length."""
        B, T = self.order.shape
        return torch.zeros_like(x).scatter(1, self.order.view(B, T, *([1] * (x.dim() - 2))).expand_as(x), x)
