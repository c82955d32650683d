"""What every mnemo ``...ForCausalLM`` needs from ``generate()`` and the input checks it shares.

The models are stateful: once the cache holds state only new tokens are fed.
They create their own :class:`MnemoCache` (transformers' default cache cannot
hold recurrent layers), and padding must be on the left.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationMixin

from .cache import MnemoCache


def check_attention_mask(attention_mask: torch.Tensor | None, batch: int, total_length: int) -> None:
    """A 2-D 0/1 mask ``(batch, past + new tokens)``, or a ``ValueError`` naming what is wrong."""
    if attention_mask is None:
        return
    if attention_mask.dim() != 2:
        raise ValueError(
            f"attention_mask must be a 2-D (batch, sequence) 0/1 padding mask; got shape {tuple(attention_mask.shape)}"
        )
    if tuple(attention_mask.shape) != (batch, total_length):
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)} but ({batch}, {total_length}) was expected: "
            "one entry per cached token plus one per new token"
        )


def check_left_padding(attention_mask: torch.Tensor) -> None:
    """Generation continues every row from its last token, so padding must come first."""
    if attention_mask.dim() == 2 and attention_mask.shape[1] > 1:
        m = attention_mask.bool()
        if (m[:, :-1] & ~m[:, 1:]).any():
            raise ValueError(
                "attention_mask has padding after a real token: generate() needs left padding "
                "(tokenizer.padding_side = 'left')"
            )


class MnemoGenerationMixin(GenerationMixin):
    """``generate()`` support for models whose cache is a :class:`MnemoCache`."""

    _is_stateful = True

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        past_key_values: MnemoCache | None = None,
        attention_mask: torch.LongTensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool = True,
        next_sequence_length: int | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        seen = past_key_values.get_seq_length() if past_key_values is not None else 0
        if seen == 0 and attention_mask is not None:
            check_left_padding(attention_mask)
        if use_cache and past_key_values is None:
            past_key_values = MnemoCache(self.config.num_hidden_layers)
        inputs: dict[str, Any] = {"input_ids": input_ids, "inputs_embeds": None}
        if seen > 0:
            # Only what the cache has not seen. With prompt embeddings, input_ids hold generated tokens only.
            if next_sequence_length is not None:
                new = next_sequence_length
            elif attention_mask is not None:
                new = attention_mask.shape[1] - seen
            else:
                new = input_ids.shape[1] - seen if input_ids.shape[1] > seen else 1
            inputs["input_ids"] = input_ids[:, input_ids.shape[1] - new:]
        elif inputs_embeds is not None:
            inputs = {"input_ids": None, "inputs_embeds": inputs_embeds}
        for key in ("is_first_iteration", "labels", "cache_position", "position_ids"):
            kwargs.pop(key, None)
        inputs.update(past_key_values=past_key_values, attention_mask=attention_mask, use_cache=use_cache)
        inputs.update(kwargs)
        return inputs
