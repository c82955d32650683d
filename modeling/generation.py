"""What every mnemo ``...ForCausalLM`` needs from ``generate()`` and the input checks it shares.

The models are stateful: once the cache holds state only new tokens are fed.
They create their own :class:`MnemoCache` (transformers' default cache cannot
hold recurrent layers), and padding must be on the left.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationMixin

from .cache import MnemoCache, as_mnemo_cache
from .cuda_graph import DecodeGraph, check_decode_graph_support
from .outputs import CACHE_NAME, resolve_cache_kwarg


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
    def decode_graph_obstacle(cls, config) -> str:  # noqa: ARG003  (overrides read the config)
        """Why this model cannot decode through a CUDA graph (``""``: it can); families that can override it."""
        return f"{cls.__name__} has no fixed-size decode step without host reads yet"

    def reserve_decode_state(self, cache) -> int | None:
        """Make room in ``cache`` for the one-token steps ahead (Memory Caching's cached memories, sized as the
        eager step sizes them): how many steps it then takes at a fixed size (``None``: any number). Blocks
        whose state grows say so through ``reserve_decode_slots(layer_cache)``."""
        steps = []
        for block, layer in zip(self.model.layers, cache):
            reserve = getattr(block, "reserve_decode_slots", None)
            n = reserve(layer) if callable(reserve) else None
            if n is not None:
                steps.append(n)
        return min(steps) if steps else None

    def generate(self, *args: Any, cuda_graph: bool = False, **kwargs: Any):
        """``transformers``' ``generate()``; ``cuda_graph=True`` replays each one-token decode step as a
        CUDA graph captured after the prefill (greedy decoding and sampling; see :mod:`.cuda_graph`).
        Off CUDA the same fixed-buffer step runs eagerly. Raises a ``ValueError`` naming the reason where
        the model cannot decode this way."""
        if not cuda_graph:
            return super().generate(*args, **kwargs)
        check_decode_graph_support(self)
        config = kwargs.get("generation_config") or self.generation_config
        if kwargs.get("num_beams", getattr(config, "num_beams", 1) or 1) > 1:
            raise ValueError("cuda_graph=True decodes greedily or by sampling: beam search reorders the cache "
                             "every step, which a captured step cannot follow")
        cache = resolve_cache_kwarg(kwargs.pop("cache", None), kwargs.pop("past_key_values", None))
        cache = as_mnemo_cache(cache, self.config.num_hidden_layers)
        if cache is None:
            cache = MnemoCache(self.config.num_hidden_layers)
        kwargs[CACHE_NAME] = cache
        cache.decode_graphs = True
        try:
            return super().generate(*args, **kwargs)
        finally:
            # the graph holds its own memory pool: free it with the generation, keep the cache usable
            cache.decode_graphs, cache.decode_graph = False, None

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
        cache: MnemoCache | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The model's inputs for the next step, the cache under the name ``generate()`` reads back."""
        past_key_values = as_mnemo_cache(resolve_cache_kwarg(cache, past_key_values), self.config.num_hidden_layers)
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
        inputs.update({CACHE_NAME: past_key_values}, attention_mask=attention_mask, use_cache=use_cache)
        inputs.update(kwargs)
        return inputs


def graphed_decode_step(model, input_ids, past_key_values, inputs_embeds, labels, output_hidden_states):
    """The logits of a one-token step replayed through the cache's decode graph, or ``None`` where the
    step is not one (a prefill, labels, embeddings, hidden states asked for, graphs not requested)."""
    cache = past_key_values
    if not (isinstance(cache, MnemoCache) and cache.decode_graphs and input_ids is not None and inputs_embeds is None
            and labels is None and not output_hidden_states and input_ids.shape[1] == 1
            and cache.get_seq_length() > 0):
        return None
    if cache.decode_graph is None or not cache.decode_graph.matches(cache):
        cache.decode_graph = DecodeGraph(model, cache)
    return cache.decode_graph(input_ids)
