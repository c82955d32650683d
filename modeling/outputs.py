"""Model outputs of the mnemo families: transformers' outputs plus the router's auxiliary loss.

transformers 5.24 renamed the cache from ``past_key_values`` to ``cache`` in model outputs,
in the inputs ``generate()`` passes to a model and in ``forward`` signatures, keeping the
old name as a deprecated alias; 5.17 to 5.23 know only ``past_key_values``. The outputs
here carry the cache under the installed version's name (:data:`CACHE_NAME`) and answer to
both (``out.cache`` and ``out.past_key_values``); the models' ``forward`` takes either
keyword (:func:`resolve_cache_kwarg`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from transformers.cache_utils import Cache
from transformers.utils import ModelOutput

from .cache import MnemoCache

# The name transformers' generate() gives the cache in the inputs it passes and reads from outputs.
CACHE_NAME = "cache" if hasattr(ModelOutput, "_replace_old_cache_name") else "past_key_values"
_NEW_NAMES = CACHE_NAME == "cache"


class LayerOutput(NamedTuple):
    """What every memory layer (``MoMLayer``, ``AtlasLayer``, ``MCTitansLayer``, ``DeepAttentionLayer``)
    returns: its output ``(B, T, hidden)`` and its auxiliary loss (MoM's load balancing; ``None`` for
    layers without one)."""

    hidden_states: torch.Tensor
    aux_loss: torch.Tensor | None = None


def _placeholder(cache: Any) -> bool:
    """An empty transformers cache of another kind (``DynamicCache()``): the model starts its own instead."""
    return isinstance(cache, Cache) and not isinstance(cache, MnemoCache) and cache.get_seq_length() == 0


def resolve_cache_kwarg(cache: Any, past_key_values: Any) -> Any:
    """The cache passed to a ``forward`` as ``cache=`` or ``past_key_values=`` (both: the same object).

    An empty placeholder under one name yields to the cache under the other: transformers before 5.24
    keeps a ``generate(cache=DynamicCache())`` argument beside the ``past_key_values`` it updates.
    """
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        if _placeholder(cache) != _placeholder(past_key_values):
            return past_key_values if _placeholder(cache) else cache
        raise ValueError("pass the cache once, as cache= or as past_key_values=, not two different caches")
    return cache if cache is not None else past_key_values


def cache_field(cache: MnemoCache | None) -> dict[str, MnemoCache | None]:
    """The keyword an output's constructor takes the cache by, under the installed transformers."""
    return {CACHE_NAME: cache}


@dataclass
class MnemoModelOutput(ModelOutput):
    """Output of a base model (``MoMModel``, ...); the cache is ``cache`` (alias ``past_key_values``)."""

    last_hidden_state: torch.FloatTensor | None = None
    if _NEW_NAMES:
        cache: MnemoCache | None = None
    else:
        past_key_values: MnemoCache | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    aux_loss: torch.FloatTensor | None = None

    if not _NEW_NAMES:
        @property
        def cache(self) -> MnemoCache | None:
            return self.past_key_values


@dataclass
class MnemoCausalLMOutput(ModelOutput):
    """Output of a ``...ForCausalLM``: ``loss`` includes ``aux_loss_coef * aux_loss`` when labels are given;
    the cache is ``cache`` (alias ``past_key_values``)."""

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    if _NEW_NAMES:
        cache: MnemoCache | None = None
    else:
        past_key_values: MnemoCache | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    aux_loss: torch.FloatTensor | None = None

    if not _NEW_NAMES:
        @property
        def cache(self) -> MnemoCache | None:
            return self.past_key_values
