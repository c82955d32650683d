"""Causal depthwise short convolutions over packed variable-length sequences.

The memories of a MoM layer each see their own subsequence of tokens, and each
keeps the last ``kernel_size - 1`` inputs of that subsequence as conv state. The
convolution therefore runs over a packed batch (``cu_seqlens`` offsets) where
every sequence starts from its own cached window. :class:`ConvWindows` is
computed once per layer call and reused by every conv of the layer (q, k, v).

Two paths compute :func:`packed_causal_conv`: PyTorch (one ``conv1d`` over the
sequences laid out with their windows) and Triton (``causal_conv_triton``: one
kernel reads each input once per tap straight from the packed tokens or the
window, fused with SiLU, and its backward recomputes the convolution instead of
keeping it). The backend rule is the memory kernels' (``backend.py``).
"""

from __future__ import annotations

import functools

import torch
from torch.nn import functional as F

from .backend import resolve_backend
from .shared_layouts import shared_per_shape

__all__ = ["ConvWindows", "packed_causal_conv"]


class ConvWindows:
    """Where each sequence's tokens sit: ``cu_seqlens`` (int32) and ``token_sequence`` (``(P,)``
    int32, the sequence of each packed token), which the Triton path reads.

    The PyTorch path lays sequence ``i`` out as the block ``[window_i, tokens_i]``
    (``K - 1 + L_i`` rows), blocks back to back, so one ungapped depthwise ``conv1d``
    over the whole thing computes every token from its own window and predecessors and
    never reads across a sequence boundary. Its indices into that extended sequence are
    built on first use only (the Triton path never needs them):

    ``placement``: ``(N * (K - 1) + P,)``, where ``cat([window.flatten(0, 1), packed])`` goes.
    ``outputs``: ``(P,)``, the conv output row of each token.
    ``next_window``: ``(N * (K - 1),)``, the rows that form each sequence's next window.
    """

    def __init__(self, cu_seqlens: torch.Tensor, token_sequence: torch.Tensor, kernel_size: int) -> None:
        self.cu_seqlens = cu_seqlens
        self.token_sequence = token_sequence
        self.kernel_size = kernel_size
        self.num_sequences = cu_seqlens.numel() - 1

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor, kernel_size: int,
              token_sequence: torch.Tensor | None = None) -> "ConvWindows":
        """The layout of ``cu_seqlens``; ``token_sequence`` (each packed token's sequence), when the caller
        has it, saves the host read that computing it takes."""
        if token_sequence is None:
            n = cu_seqlens.numel() - 1
            lengths = cu_seqlens[1:] - cu_seqlens[:-1]
            token_sequence = torch.repeat_interleave(torch.arange(n, device=cu_seqlens.device), lengths)
        return cls(cu_seqlens.to(torch.int32), token_sequence.to(torch.int32), kernel_size)

    @staticmethod
    def rows(batch: int, length: int, kernel_size: int, device: torch.device) -> "ConvWindows":
        """The layout of ``batch`` rows of ``length`` tokens each, every row one sequence, shared by every
        layer that asks for it (``shared_layouts.py``)."""
        return _rows_windows(batch, length, kernel_size, device)

    @functools.cached_property
    def _extended_layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        device, n, w = self.cu_seqlens.device, self.num_sequences, self.kernel_size - 1
        cu = self.cu_seqlens.long()
        seq = self.token_sequence.long()
        lengths = cu[1:] - cu[:-1]
        block_start = cu[:-1] + torch.arange(n, device=device) * w  # where window i begins
        r = torch.arange(w, device=device)
        window_rows = (block_start[:, None] + r).flatten()
        token_rows = torch.arange(seq.numel(), device=device) + (seq + 1) * w
        next_window = ((block_start + lengths)[:, None] + r).flatten()
        return torch.cat([window_rows, token_rows]), token_rows - w, next_window

    @property
    def placement(self) -> torch.Tensor:
        return self._extended_layout[0]

    @property
    def outputs(self) -> torch.Tensor:
        return self._extended_layout[1]

    @property
    def next_window(self) -> torch.Tensor:
        return self._extended_layout[2]


@shared_per_shape
def _rows_windows(batch: int, length: int, kernel_size: int, device: torch.device) -> ConvWindows:
    return ConvWindows.build(torch.arange(batch + 1, device=device) * length, kernel_size,
                             token_sequence=torch.arange(batch, device=device).repeat_interleave(length))


def _torch_packed_conv(x: torch.Tensor, weight: torch.Tensor, windows: ConvWindows, window: torch.Tensor,
                       activation: bool) -> tuple[torch.Tensor, torch.Tensor]:
    n, c = windows.num_sequences, x.shape[-1]
    k = weight.shape[-1]
    source = torch.cat([window.to(x.dtype).reshape(n * (k - 1), c), x], dim=0)
    # A scatter and a gather (whose backwards are a gather and a scatter to distinct
    # rows) around one conv1d: no per-tap gathers with atomic scatter-add backwards.
    extended = source.new_zeros(source.shape).index_copy(0, windows.placement, source)
    y = F.conv1d(extended.T.unsqueeze(0), weight.view(c, 1, k).to(x.dtype), groups=c)[0]
    y = y.T.index_select(0, windows.outputs)
    return F.silu(y) if activation else y, extended.index_select(0, windows.next_window).view(n, k - 1, c)


def packed_causal_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    windows: ConvWindows,
    window: torch.Tensor | None = None,
    activation: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of packed sequences, each continuing its own window.

    ``x``: ``(P, C)`` packed tokens; ``weight``: ``(C, K)`` (or ``(C, 1, K)``, a ``Conv1d``'s);
    ``window``: ``(N, K - 1, C)`` each sequence's last inputs before these tokens
    (zeros if ``None``). Returns ``(silu(conv(x)), next_window)`` (no SiLU when
    ``activation`` is false), both in ``x``'s dtype; the next window holds each
    sequence's last ``K - 1`` inputs (from the old window where it has fewer tokens).
    """
    k = weight.shape[-1]
    n, c = windows.num_sequences, x.shape[-1]
    weight = weight.reshape(c, k)
    if x.shape[0] == 0:  # no tokens: nothing to convolve, every window stays
        return x, (x.new_zeros(n, k - 1, c) if window is None else window.to(x.dtype))
    if resolve_backend(x, has_triton_impl=True) == "triton":
        from .causal_conv_triton import packed_causal_conv as triton_conv

        return triton_conv(x, weight, windows.cu_seqlens, windows.token_sequence, window, activation)
    if window is None:
        window = x.new_zeros(n, k - 1, c)
    return _torch_packed_conv(x, weight, windows, window, activation)
