"""Causal softmax attention with RoPE and a KV cache (the hybrid layers; Llama layout).

Padding is a 2-D 0/1 mask over all positions seen so far. A padded key is never
attended to; a padded query attends to itself only, so that its (unused) row is
finite rather than NaN.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .cache import LayerCache


class RotaryEmbedding(nn.Module):
    """RoPE with the rotate-half convention of Llama (so Llama checkpoints import as they are)."""

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.register_buffer("inv_freq", self.compute_inv_freq(), persistent=False)

    def compute_inv_freq(self, device: torch.device | None = None) -> torch.Tensor:
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        return 1.0 / (self.theta**exponent)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` ``(B, T)`` -> ``cos, sin`` ``(B, T, head_dim)`` in float32."""
        freqs = positions.float()[..., None] * self.inv_freq.float()
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``(B, H, T, D)``; ``cos, sin`` ``(B, T, D)``."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    return x * cos + _rotate_half(x) * sin


def attention_mask_4d(
    key_valid: torch.Tensor | None,
    query_len: int,
    past_len: int,
    window: int | None = None,
    device: torch.device | None = None,
) -> torch.Tensor | None:
    """Boolean ``(B, 1, T, past + T)`` mask: causal, no padded keys, each query sees itself, and with
    ``window`` only the keys less than ``window`` real tokens back."""
    if key_valid is None and window is None:
        return None
    total = past_len + query_len
    device = key_valid.device if key_valid is not None else device
    q_pos = torch.arange(past_len, total, device=device)[:, None]
    k_pos = torch.arange(total, device=device)[None, :]
    allowed = (k_pos <= q_pos)[None]
    if key_valid is not None:
        allowed = allowed & key_valid[:, None, :].bool()
    if window is not None:
        valid = key_valid.bool() if key_valid is not None else torch.ones(1, total, dtype=torch.bool, device=device)
        tokens = valid.long().cumsum(-1)  # real tokens up to each slot
        distance = tokens[:, past_len:, None] - tokens[:, None, :]
        allowed = allowed & (distance < window)
    allowed = allowed | (k_pos == q_pos)[None]
    return allowed[:, None]


class SoftmaxAttention(nn.Module):
    """Multi-head (optionally grouped-query) causal attention with RoPE."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_key_value_heads: int,
        rope_theta: float,
        layer_idx: int,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.num_heads = num_heads
        self.num_kv_heads = num_key_value_heads
        self.head_dim = hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)
        self.rotary = RotaryEmbedding(self.head_dim, rope_theta)

    def forward(
        self,
        hidden_states: torch.Tensor,
        positions: torch.Tensor,
        key_valid: torch.Tensor | None = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        """``key_valid``: ``(B, past + T)`` 0/1 over every position the layer can see, or ``None``."""
        B, T, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary(positions)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        past, dropped = 0, 0
        if cache is not None:
            if "key" in cache:
                past = cache["key"].shape[2]
                dropped = int(cache["dropped"][0])  # oldest slots trimmed out of a sliding window
                k = torch.cat([cache["key"], k], dim=2)
                v = torch.cat([cache["value"], v], dim=2)
            cache.update(key=k, value=v, dropped=torch.full((B,), dropped, device=k.device))
        if key_valid is not None:
            key_valid = key_valid[:, dropped:]

        mask = attention_mask_4d(key_valid, T, past, self.sliding_window, device=q.device)
        causal = mask is None and past == 0 and T > 1
        if mask is None and past > 0 and T > 1:
            mask = attention_mask_4d(torch.ones(B, past + T, dtype=torch.bool, device=q.device), T, past)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=self.num_kv_heads != self.num_heads
        )
        if cache is not None and self.sliding_window is not None:
            self._trim(cache, key_valid, B)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))

    def _trim(self, cache: LayerCache, key_valid: torch.Tensor | None, batch: int) -> None:
        """Drop the oldest slots that no later query of any row can see (exact with any padding)."""
        slots = cache["key"].shape[2]
        valid = key_valid.bool() if key_valid is not None else torch.ones(batch, slots, dtype=torch.bool,
                                                                          device=cache["key"].device)
        tokens = valid.long().cumsum(-1)
        # the next query of a row is token tokens[:, -1] + 1; it sees tokens > that - window
        needed = valid & (tokens > (tokens[:, -1:] + 1 - self.sliding_window))
        first = needed.float().argmax(-1)
        first = torch.where(needed.any(-1), first, torch.full_like(first, slots))
        cut = int(first.min())
        if cut > 0:
            cache.update(key=cache["key"][:, :, cut:], value=cache["value"][:, :, cut:],
                         dropped=cache["dropped"] + cut)
