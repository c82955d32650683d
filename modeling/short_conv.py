"""Causal depthwise short convolutions over packed variable-length sequences.

The memories of a MoM layer each see their own subsequence of tokens, and each
keeps the last ``kernel_size - 1`` inputs of that subsequence as conv state. The
convolution therefore runs over a packed batch (``cu_seqlens`` offsets) where
every sequence starts from its own cached window. :class:`ConvWindows` computes,
once per layer call, where each tap of each token reads from (the packed input
or the cached window) and which inputs become the next window; every conv of the
layer (q, k, v) then reuses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class ConvWindows:
    """Gather indices into ``cat([window.flatten(0, 1), packed])`` for one packed batch.

    ``taps``: ``(P, K)``, the inputs of each token (last column: the token itself).
    ``next_window``: ``(N, K - 1)``, the inputs that form each sequence's next window.
    """

    taps: torch.Tensor
    next_window: torch.Tensor
    num_sequences: int

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor, kernel_size: int) -> "ConvWindows":
        device = cu_seqlens.device
        n = cu_seqlens.numel() - 1
        w = kernel_size - 1
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        total = int(cu_seqlens[-1])
        seq = torch.repeat_interleave(torch.arange(n, device=device), lengths)
        pos = torch.arange(total, device=device)
        local = pos - cu_seqlens[seq]
        j = torch.arange(kernel_size, device=device)
        src = local[:, None] - w + j  # local index of each tap; < 0 reads the cached window
        taps = torch.where(src >= 0, n * w + pos[:, None] - w + j, seq[:, None] * w + local[:, None] + j)
        r = torch.arange(w, device=device)
        src_next = lengths[:, None] - w + r
        start = cu_seqlens[:-1, None]
        next_window = torch.where(
            src_next >= 0, n * w + start + src_next, torch.arange(n, device=device)[:, None] * w + lengths[:, None] + r
        )
        return cls(taps=taps, next_window=next_window, num_sequences=n)


class ShortConvolution(nn.Conv1d):
    """Depthwise causal convolution followed by SiLU (weights ``(channels, 1, kernel_size)``)."""

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__(channels, channels, kernel_size, groups=channels, bias=False)

    def forward(
        self, x: torch.Tensor, windows: ConvWindows, window: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: packed ``(P, C)``; ``window``: ``(N, K - 1, C)`` cached inputs (zeros if ``None``).

        Returns ``(silu(conv(x)), next_window)``.
        """
        k = self.kernel_size[0]
        n, c = windows.num_sequences, x.shape[-1]
        if window is None:
            window = x.new_zeros(n, k - 1, c)
        source = torch.cat([window.to(x.dtype).reshape(n * (k - 1), c), x], dim=0)
        weight = self.weight[:, 0, :].to(x.dtype)
        # One index_select per tap: its backward is an index_add, far cheaper than a (P, K, C) gather's.
        y = source.index_select(0, windows.taps[:, 0]) * weight[:, 0]
        for j in range(1, k):
            y = y + source.index_select(0, windows.taps[:, j]) * weight[:, j]
        return F.silu(y), source[windows.next_window]

    def step(self, x: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per sequence: ``x`` ``(..., C)``, ``window`` ``(..., K - 1, C)``; the same
        result as :meth:`forward` on a one-token sequence, without building gather indices."""
        weight = self.weight[:, 0, :].to(x.dtype)
        source = torch.cat([window.to(x.dtype), x.unsqueeze(-2)], dim=-2)
        return F.silu((source * weight.transpose(0, 1)).sum(-2)), source[..., 1:, :]


def convolve_qkv(layer: nn.Module, x: torch.Tensor, valid: torch.Tensor, cache, heads: int, head_dim: int):
    """``q, k, v`` ``(B, T, heads, head_dim)`` of a layer with ``{q,k,v}_proj`` and ``{q,k,v}_conv1d``.

    Each projection is convolved over each row's valid tokens only (padding never
    enters a window), continuing the windows ``conv_q/k/v`` stored in ``cache``
    and storing the next ones; padded positions come back as zeros.
    """
    B, T, _ = x.shape
    lengths = valid.sum(1)
    windows = ConvWindows.build(F.pad(lengths.cumsum(0), (1, 0)), layer.q_conv1d.kernel_size[0])
    outs = []
    for name in ("q", "k", "v"):
        proj, conv = getattr(layer, f"{name}_proj"), getattr(layer, f"{name}_conv1d")
        window = cache.get(f"conv_{name}") if cache is not None else None
        y, nxt = conv(proj(x)[valid], windows, window)
        if cache is not None:
            cache.update(**{f"conv_{name}": nxt})
        full = y.new_zeros(B, T, y.shape[-1])
        full[valid] = y
        outs.append(full.view(B, T, heads, head_dim))
    return outs
