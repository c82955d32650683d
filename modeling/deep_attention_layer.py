"""Attention whose memory has a deep branch: the DeepTransformer / Dot layer (docs/semantics.md).

Projections and RoPE are Llama's (same names), so with ``memory_depth=1`` the
layer is Llama's attention and Llama weights load as they are. The memory is the
kernel API's ``deep_attention`` kind. Padded tokens are removed before the
memory sees them (each row's valid tokens are compacted to the front), so inner
chunks count each row's own tokens and a padded row computes what it would alone.
"""

from __future__ import annotations

import torch
from torch import nn

from ..configuration.configuration_deep_transformer import DeepTransformerConfig
from ..kernels.deep_attention import DeepAttentionState, chunk_deep_attention
from .attention import RotaryEmbedding, apply_rotary
from .cache import LayerCache
from .outputs import LayerOutput
from .padding import RowCompaction


def _own_positions(hidden_states: torch.Tensor, valid: torch.Tensor | None, cache: LayerCache | None) -> torch.Tensor:
    """Positions of a layer driven without ``position_ids``: each row's real tokens counted from the cache's length."""
    B, T, _ = hidden_states.shape
    past = cache.get_seq_length() if cache is not None else 0
    if valid is None:
        return torch.arange(past, past + T, device=hidden_states.device).expand(B, T)
    return past + (valid.long().cumsum(-1) - 1).clamp(min=0)


# Pairs a decode graph's cache is given room for at once (:meth:`DeepAttentionLayer.reserve_decode_slots`): a
# graph serves that many tokens, then generation captures another; every step's reads also pass over the room
# still empty (masked), so more room means fewer captures but longer reads.
DECODE_ROOM = 256


class DeepAttentionLayer(nn.Module):
    def __init__(self, config: DeepTransformerConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.rotary = RotaryEmbedding(self.head_dim, config.rope_theta)
        self.memory_depth = config.memory_depth
        self.learning_rule = config.learning_rule
        self.options = dict(
            memory_depth=config.memory_depth,
            learning_rule=config.learning_rule,
            omega_window=config.omega_window,
            chunk_size=config.inner_chunk_size,
            normalize=config.normalize,
            grad_clip=config.memory_grad_clip,
        )
        if config.memory_depth == 2:
            self.eta_proj = nn.Linear(hidden, self.num_heads, bias=False)  # deep-branch learning rate
            self.memory_w1 = nn.Parameter(torch.zeros(self.num_heads, self.head_dim, config.memory_hidden))
        if config.learning_rule == "omega":
            self.gamma_proj = nn.Linear(hidden, self.num_heads, bias=False)  # window gates

    def reserve_decode_slots(self, cache: LayerCache) -> int | None:
        """Room in ``cache`` for :data:`DECODE_ROOM` more pairs a row: how many one-token steps it then takes
        in place (``None``: a cache this layer has not filled)."""
        if "keys" not in cache:
            return None
        # at least two: a graph's capture runs two warm-up steps before it puts the cache back
        state, steps = DeepAttentionState.from_tensors(cache.states).with_room(max(DECODE_ROOM, 2))
        cache.update(**state.tensors())
        return steps

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        *,
        position_ids: torch.Tensor | None = None,
    ) -> LayerOutput:
        """``hidden_states`` ``(B, T, d)``; ``attention_mask`` ``(B, T)`` 0/1 for these tokens;
        ``position_ids`` ``(B, T)`` the rotary positions (default: each row's own tokens counted on from
        the cache's length, as the model counts them)."""
        valid = attention_mask
        positions = position_ids if position_ids is not None else _own_positions(hidden_states, valid, cache)
        B, T, _ = hidden_states.shape
        H, D = self.num_heads, self.head_dim
        q = self.q_proj(hidden_states).view(B, T, H, D).transpose(1, 2)
        k = self.k_proj(hidden_states).view(B, T, self.num_kv_heads, D).transpose(1, 2)
        v = self.v_proj(hidden_states).view(B, T, self.num_kv_heads, D).transpose(1, 2)
        cos, sin = self.rotary(positions)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        groups = H // self.num_kv_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # (B, T, H, D)
        eta = torch.sigmoid(self.eta_proj(hidden_states).float()) if self.memory_depth == 2 else None
        gamma = torch.sigmoid(self.gamma_proj(hidden_states).float()) if self.learning_rule == "omega" else None

        lengths, rows = None, None
        if valid is not None:
            rows = RowCompaction(valid)
            lengths = rows.lengths
            q, k, v, eta, gamma = (rows.compact(x) for x in (q, k, v, eta, gamma))

        state = DeepAttentionState.from_tensors(cache.states) if cache is not None and "keys" in cache else None
        o, new_state = chunk_deep_attention(
            q, k, v, eta, gamma, getattr(self, "memory_w1", None),
            lengths=lengths, initial_state=state, in_place=cache is not None and cache.in_place, **self.options,
        )
        if cache is not None:
            cache.states = new_state.tensors()
        if rows is not None:  # back to the original positions; padded positions get zeros
            o = rows.restore(o)
        return LayerOutput(self.o_proj(o.reshape(B, T, H * D).to(hidden_states.dtype)))
