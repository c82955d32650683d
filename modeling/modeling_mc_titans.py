"""MC-Titans language models: ``MCTitansModel`` and ``MCTitansForCausalLM`` (docs/semantics.md).

Pre-norm blocks of an MC-Titans memory layer and a SwiGLU MLP, as in the MoM
family. ``segment_size=None`` is plain Titans; otherwise the cache grows by one
cached memory per segment.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer

from ..configuration.configuration_mc_titans import MCTitansConfig
from .base import MnemoCausalLMMixin, MnemoDecoderMixin, init_shared_weights
from .generation import MnemoGenerationMixin
from .cache import LayerCache
from .mc_titans_layer import MCTitansLayer
from .lora_targets import register_peft_defaults
from .mlp import SwiGLU
from .normalization import RMSNorm


class MCTitansBlock(GradientCheckpointingLayer):
    def __init__(self, config: MCTitansConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, eps=config.norm_eps, autocast_output=True)
        self.attn = MCTitansLayer(config, layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size, eps=config.norm_eps, autocast_output=True)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        key_valid: torch.Tensor | None = None,  # noqa: ARG002  (every family's block takes stack.py's arguments)
        positions: torch.Tensor | None = None,  # noqa: ARG002
        past_key_values: LayerCache | None = None,
    ) -> tuple[torch.Tensor, None]:
        memory = self.attn(self.attn_norm(hidden_states), attention_mask, past_key_values).hidden_states
        normed, hidden_states = self.mlp_norm(memory, hidden_states)  # the residual add fused into the norm
        hidden_states = hidden_states + self.mlp(normed)
        return hidden_states, None

    def reserve_decode_slots(self, cache: LayerCache) -> int | None:
        return self.attn.reserve_decode_slots(cache)


class MCTitansPreTrainedModel(PreTrainedModel):
    config_class = MCTitansConfig
    config: MCTitansConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["MCTitansBlock"]

    def _init_weights(self, module: nn.Module) -> None:
        if init_shared_weights(module, self.config.initializer_range):
            return
        if isinstance(module, MCTitansLayer):
            for param in module.memory_init().values():
                init.normal_(param, mean=0.0, std=self.config.memory_init_std)


class MCTitansModel(MnemoDecoderMixin, MCTitansPreTrainedModel):
    """The MC-Titans stack without the language-modelling head."""

    block_class = MCTitansBlock


class MCTitansForCausalLM(MnemoCausalLMMixin, MnemoGenerationMixin, MCTitansPreTrainedModel):
    """MC-Titans language model; ``generate()`` runs on the memory-and-snapshot cache."""

    base_model_class = MCTitansModel

    @classmethod
    def decode_graph_obstacle(cls, config: MCTitansConfig) -> str:
        if config.segmentation == "logarithmic":
            return ("logarithmic segments merge cached memories by each row's length, which the step reads back "
                    "to the host (fixed segments decode through a graph)")
        return ""


register_peft_defaults(MCTitansConfig.model_type)  # here, so that exported code registers them too
