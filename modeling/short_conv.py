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
    """Where each sequence's cached window and tokens sit in one extended packed sequence.

    Sequence ``i`` becomes the block ``[window_i, tokens_i]`` (``K - 1 + L_i`` rows)
    and the blocks are laid back to back, so one ungapped depthwise ``conv1d`` over
    the whole thing computes every token from its own window and predecessors and
    never reads across a sequence boundary. Indices into that extended sequence:

    ``placement``: ``(N * (K - 1) + P,)``, where ``cat([window.flatten(0, 1), packed])`` goes.
    ``outputs``: ``(P,)``, the conv output row of each token.
    ``next_window``: ``(N * (K - 1),)``, the rows that form each sequence's next window.
    """

    placement: torch.Tensor
    outputs: torch.Tensor
    next_window: torch.Tensor
    num_sequences: int

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor, kernel_size: int) -> "ConvWindows":
        device = cu_seqlens.device
        n = cu_seqlens.numel() - 1
        w = kernel_size - 1
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        seq = torch.repeat_interleave(torch.arange(n, device=device), lengths)
        pos = torch.arange(int(cu_seqlens[-1]), device=device)
        block_start = cu_seqlens[:-1] + torch.arange(n, device=device) * w  # where window i begins
        r = torch.arange(w, device=device)
        window_rows = (block_start[:, None] + r).flatten()
        token_rows = pos + (seq + 1) * w
        next_window = ((block_start + lengths)[:, None] + r).flatten()
        return cls(placement=torch.cat([window_rows, token_rows]), outputs=token_rows - w,
                   next_window=next_window, num_sequences=n)


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
        if x.shape[0] == 0:  # no tokens: nothing to convolve, every window stays
            return x, window.to(x.dtype)
        source = torch.cat([window.to(x.dtype).reshape(n * (k - 1), c), x], dim=0)
        # A scatter and a gather (whose backwards are a gather and a scatter to distinct
        # rows) around one conv1d: no per-tap gathers with atomic scatter-add backwards.
        extended = source.new_zeros(source.shape).index_copy(0, windows.placement, source)
        y = F.conv1d(extended.T.unsqueeze(0), self.weight.to(x.dtype), groups=c)[0]
        y = y.T.index_select(0, windows.outputs)
        return F.silu(y), extended.index_select(0, windows.next_window).view(n, k - 1, c)

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
    if T == 1 and cache is not None and all(f"conv_{name}" in cache for name in "qkv"):
        return _step_qkv(layer, x, valid[:, 0], cache, heads, head_dim)
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


def _step_qkv(layer: nn.Module, x: torch.Tensor, live: torch.Tensor, cache, heads: int, head_dim: int):
    """:func:`convolve_qkv` of one token per row continuing cached windows, without the packed
    layout's device-to-host reads (a decode step must not stall, and a CUDA graph cannot hold them).
    A padded token (``live`` 0) leaves its row's window as it was and comes back as zeros."""
    B = x.shape[0]
    on = live[:, None]
    outs = []
    for name in ("q", "k", "v"):
        proj, conv = getattr(layer, f"{name}_proj"), getattr(layer, f"{name}_conv1d")
        window = cache[f"conv_{name}"]
        y, nxt = conv.step(proj(x[:, 0]), window)
        cache.update(**{f"conv_{name}": torch.where(on[..., None], nxt.to(window.dtype), window)})
        outs.append((y * on).view(B, 1, heads, head_dim))
    return outs
