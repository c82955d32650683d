"""DeepTransformer language models: ``DeepTransformerModel`` and ``DeepTransformerForCausalLM`` (docs/semantics.md).

Llama's architecture (pre-norm blocks of attention and SwiGLU, RoPE, RMSNorm,
the same parameter names) with the attention memory replaced by
:class:`DeepAttentionLayer`. ``memory_depth=1`` gives a Transformer++ that equals
``transformers``' ``LlamaForCausalLM`` with the same weights.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer

from ..configuration.configuration_deep_transformer import DeepTransformerConfig
from .base import MnemoCausalLMMixin, MnemoDecoderMixin, init_shared_weights
from .generation import MnemoGenerationMixin
from .cache import LayerCache
from .deep_attention_layer import DeepAttentionLayer
from .lora_targets import register_peft_defaults
from .mlp import SwiGLU
from .normalization import RMSNorm


class DeepTransformerBlock(GradientCheckpointingLayer):
    def __init__(self, config: DeepTransformerConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.norm_eps, autocast_output=True)
        self.self_attn = DeepAttentionLayer(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.norm_eps, autocast_output=True)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        key_valid: torch.Tensor | None = None,  # noqa: ARG002  (every family's block takes stack.py's arguments)
        positions: torch.Tensor | None = None,
        past_key_values: LayerCache | None = None,
    ) -> tuple[torch.Tensor, None]:
        attended = self.self_attn(self.input_layernorm(hidden_states), attention_mask, past_key_values,
                                  position_ids=positions)
        normed, hidden_states = self.post_attention_layernorm(attended.hidden_states, hidden_states)
        hidden_states = hidden_states + self.mlp(normed)
        return hidden_states, None

    def reserve_decode_slots(self, cache: LayerCache) -> int | None:
        return self.self_attn.reserve_decode_slots(cache)


class DeepTransformerPreTrainedModel(PreTrainedModel):
    config_class = DeepTransformerConfig
    config: DeepTransformerConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DeepTransformerBlock"]
    _supports_sdpa = True

    def _init_weights(self, module: nn.Module) -> None:
        if init_shared_weights(module, self.config.initializer_range):
            return
        if isinstance(module, DeepAttentionLayer) and module.memory_depth == 2:
            init.normal_(module.memory_w1, mean=0.0, std=self.config.memory_init_std)


class DeepTransformerModel(MnemoDecoderMixin, DeepTransformerPreTrainedModel):
    """The DeepTransformer stack without the language-modelling head."""

    block_class = DeepTransformerBlock


class DeepTransformerForCausalLM(MnemoCausalLMMixin, MnemoGenerationMixin, DeepTransformerPreTrainedModel):
    """DeepTransformer / Dot language model; ``generate()`` runs on its KV-and-memory cache."""

    base_model_class = DeepTransformerModel
    # The cache's pairs: a graph's warm-up steps write them past each row's count, which the capture puts back,
    # so they need no copy to undo them (a copy of every pair at each capture).
    decode_scratch = ("keys", "values", "us", "eta", "gamma")

    @classmethod
    def decode_graph_obstacle(cls, config: DeepTransformerConfig) -> str:
        if config.memory_depth == 1:
            return "memory_depth=1 (attention) decodes through its growing KV cache eagerly"
        if config.learning_rule == "omega":
            return ("the omega rule (Dot) replays each token's open chunk, whose length changes from step to step "
                    "(the Hebbian rule decodes through a graph)")
        if not config.normalize:
            return "unnormalised reads (normalize=False) replay each token's open chunk (softmax reads decode through a graph)"
        return ""

    def decode_positions(self, cache) -> torch.Tensor:
        """The rotary positions ``(B, 1)`` of a decoding step, from the cache on the device: each row's own
        tokens so far (what ``generate()`` counts under left padding), so that a captured step advances them."""
        return cache[0]["count"][:, None]


register_peft_defaults(DeepTransformerConfig.model_type)  # here, so that exported code registers them too
