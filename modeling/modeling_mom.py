"""Mixture-of-Memories language models: ``MoMModel`` and ``MoMForCausalLM`` (docs/semantics.md).

A stack of pre-norm blocks, each a MoM memory layer (or, at the indices in
``config.attention_layers``, softmax attention with RoPE) followed by a SwiGLU
MLP. The model returns the router's load-balancing loss as ``aux_loss`` and adds
``aux_loss_coef * aux_loss`` to the language-modelling loss when labels are given.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import WeightRenaming
from transformers.modeling_layers import GradientCheckpointingLayer

from ..configuration.configuration_mom import MoMConfig
from .attention import SoftmaxAttention
from .base import MnemoCausalLMMixin, MnemoDecoderMixin, init_shared_weights
from .generation import MnemoGenerationMixin
from .cache import LayerCache
from .lora_targets import register_peft_defaults
from .mlp import SwiGLU
from .mom_layer import MEMORY_PROJECTIONS, MoMLayer
from .normalization import RMSNorm


class MoMBlock(GradientCheckpointingLayer):
    """``x + attn(norm(x))`` then ``x + mlp(norm(x))``; ``attn`` is a MoM layer or softmax attention."""

    def __init__(self, config: MoMConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.is_attention = layer_idx in config.attention_layers
        self.attn_norm = RMSNorm(config.hidden_size, eps=config.norm_eps, autocast_output=True)
        if self.is_attention:
            self.attn = SoftmaxAttention(
                config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                config.rope_theta, layer_idx,
            )
        else:
            self.attn = MoMLayer(config, layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size, eps=config.norm_eps, autocast_output=True)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        key_valid: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        past_key_values: LayerCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        residual = hidden_states
        hidden_states = self.attn_norm(hidden_states)
        aux = None
        if self.is_attention:
            hidden_states = self.attn(hidden_states, positions, key_valid, past_key_values)
        else:
            hidden_states, aux = self.attn(hidden_states, attention_mask, past_key_values)
        normed, hidden_states = self.mlp_norm(hidden_states, residual)  # the residual add fused into the norm
        hidden_states = hidden_states + self.mlp(normed)
        return hidden_states, aux

    def reserve_decode_slots(self, cache: LayerCache) -> int | None:
        return None if self.is_attention else self.attn.reserve_decode_slots(cache)


class MoMPreTrainedModel(PreTrainedModel):
    config_class = MoMConfig
    config: MoMConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["MoMBlock"]
    _supports_sdpa = True

    def _init_weights(self, module: nn.Module) -> None:
        # A MoM layer's submodules are drawn in the layer's order (``MoMLayer.init_order``), all at once
        # when its router is visited.
        layer_order = getattr(module, "_init_layer_order", None)
        if layer_order is not None:
            for sub in layer_order():
                init_shared_weights(sub, self.config.initializer_range)
            return
        if getattr(module, "_init_by_layer", False):
            return
        if init_shared_weights(module, self.config.initializer_range):
            return
        if isinstance(module, MoMLayer) and module.gated:
            A_log, dt_bias = module.reset_decay_parameters()
            init.copy_(module.A_log, A_log)
            init.copy_(module.dt_bias, dt_bias)


class MoMModel(MnemoDecoderMixin, MoMPreTrainedModel):
    """The MoM stack without the language-modelling head."""

    block_class = MoMBlock


class MoMForCausalLM(MnemoCausalLMMixin, MnemoGenerationMixin, MoMPreTrainedModel):
    """MoM language model. ``generate()`` runs on the recurrent cache (greedy, sampling, beam search)."""

    base_model_class = MoMModel

    @classmethod
    def decode_graph_obstacle(cls, config: MoMConfig) -> str:
        # Attention layers grow their key/value cache every step (Memory Caching's snapshots are given room
        # ahead: reserve_decode_slots).
        if config.attention_layers:
            return "its attention layers grow their key/value cache with every token"
        return ""


# Checkpoints of fla's layout (mnemo's before ``memories``) load through transformers' key renaming:
# ``attn.k_proj.<m>.weight`` -> ``attn.memories.<m>.k_proj.weight`` (see ``mom_layer.legacy_memory_key``).
# Re-registering replaces the same list (a remote-code copy of this module may be imported beside it).
register_checkpoint_conversion_mapping(
    MoMConfig.model_type,
    [WeightRenaming(source_patterns=rf"\.{name}\.(\d+)\.weight", target_patterns=rf".memories.\1.{name}.weight")
     for name in MEMORY_PROJECTIONS],
    overwrite=True,
)


register_peft_defaults(MoMConfig.model_type)  # here, so that exported code registers them too
