"""Short causal convolutions of q, k and v, as modules: packed sequences and one-token steps.

The packed computation itself (each sequence continuing its own cached window) is
``kernels.causal_conv``'s, with its PyTorch and Triton paths; this module holds the
``Conv1d`` parameters, the one-token decode step and :func:`convolve_qkv`, which
the layers with one sequence per batch row share.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..kernels.causal_conv import ConvWindows, packed_causal_conv


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
        return packed_causal_conv(x, self.weight, windows, window)

    def step(self, x: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per sequence: ``x`` ``(..., C)``, ``window`` ``(..., K - 1, C)``; the same
        result as :meth:`forward` on a one-token sequence, without building gather indices."""
        weight = self.weight[:, 0, :].to(x.dtype)
        source = torch.cat([window.to(x.dtype), x.unsqueeze(-2)], dim=-2)
        return F.silu((source * weight.transpose(0, 1)).sum(-2)), source[..., 1:, :]


def convolve_qkv(layer: nn.Module, x: torch.Tensor, valid: torch.Tensor | None, cache, heads: int,
                 head_dim: int, projected: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """``q, k, v`` ``(B, T, heads, head_dim)`` of a layer with ``{q,k,v}_proj`` and ``{q,k,v}_conv1d``.

    Each projection is convolved over each row's valid tokens only (padding never
    enters a window), continuing the windows ``conv_q/k/v`` stored in ``cache``
    and storing the next ones; padded positions come back as zeros. ``valid=None``:
    every token is real, so the rows themselves are the packed layout, taken without
    the device-to-host reads and copies that packing by a mask costs. ``projected``: ``x``'s ``q, k, v``
    projections ``(B, T, heads * head_dim)`` where the caller has made them (default: the layer's
    ``{q,k,v}_proj`` of ``x``).
    """
    if projected is None:
        projected = tuple(getattr(layer, f"{name}_proj")(x) for name in "qkv")
    B, T, _ = x.shape
    if T == 1 and cache is not None and all(f"conv_{name}" in cache for name in "qkv"):
        live = torch.ones(B, dtype=torch.bool, device=x.device) if valid is None else valid[:, 0]
        return _step_qkv(layer, projected, live, cache, heads, head_dim)
    kernel_size = layer.q_conv1d.kernel_size[0]
    if valid is None:
        windows = ConvWindows.rows(B, T, kernel_size, x.device)
    else:
        lengths = valid.sum(1)
        windows = ConvWindows.build(F.pad(lengths.cumsum(0), (1, 0)), kernel_size)
    outs = []
    for name, xp in zip("qkv", projected):
        conv = getattr(layer, f"{name}_conv1d")
        window = cache.get(f"conv_{name}") if cache is not None else None
        y, nxt = conv(xp.flatten(0, 1) if valid is None else xp[valid], windows, window)
        if cache is not None:
            cache.update(**{f"conv_{name}": nxt})
        if valid is None:
            full = y.reshape(B, T, -1)
        else:
            full = y.new_zeros(B, T, y.shape[-1])
            full[valid] = y
        outs.append(full.view(B, T, heads, head_dim))
    return outs


def _step_qkv(layer: nn.Module, projected: tuple[torch.Tensor, ...], live: torch.Tensor, cache, heads: int,
              head_dim: int):
    """:func:`convolve_qkv` of one token per row (its projections ``(B, 1, heads * head_dim)``) continuing
    cached windows, without the packed layout's device-to-host reads (a decode step must not stall, and a
    CUDA graph cannot hold them). A padded token (``live`` 0) leaves its row's window as it was and comes
    back as zeros."""
    B = live.shape[0]
    on = live[:, None]
    outs = []
    for name, xp in zip("qkv", projected):
        conv = getattr(layer, f"{name}_conv1d")
        window = cache[f"conv_{name}"]
        y, nxt = conv.step(xp[:, 0], window)
        cache.update(**{f"conv_{name}": torch.where(on[..., None], nxt.to(window.dtype), window)})
        outs.append((y * on).view(B, 1, heads, head_dim))
    return outs
