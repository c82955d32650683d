"""Model outputs of the mnemo families: transformers' outputs plus the router's auxiliary loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput

from .cache import MnemoCache


@dataclass
class MnemoModelOutput(ModelOutput):
    """Output of a base model (``MoMModel``, ...)."""

    last_hidden_state: torch.FloatTensor | None = None
    past_key_values: MnemoCache | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    aux_loss: torch.FloatTensor | None = None


@dataclass
class MnemoCausalLMOutput(ModelOutput):
    """Output of a ``...ForCausalLM``: ``loss`` includes ``aux_loss_coef * aux_loss`` when labels are given."""

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    past_key_values: MnemoCache | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    aux_loss: torch.FloatTensor | None = None
