"""Atlas language models: ``AtlasModel`` and ``AtlasForCausalLM`` (docs/semantics.md).

One block shape covers Atlas, Atlas++, OmegaNet, DLA and SWLA (see
``AtlasConfig.preset``) and the sliding-window hybrids: ``hybrid="mal"`` runs
sliding-window attention and then the memory in sequence, ``hybrid="mag"`` runs
both on the same input and combines them as ``RMSNorm(swa) * sigmoid(RMSNorm(memory))``.
The attention's KV pairs live in the same cache and are trimmed to the window.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer

from ..configuration.configuration_atlas import AtlasConfig
from ..kernels.feature_maps import initial_coefficients
from .atlas_layer import AtlasLayer
from .attention import SoftmaxAttention
from .base import MnemoCausalLMMixin, MnemoDecoderMixin, init_shared_weights
from .cache import LayerCache
from .generation import MnemoGenerationMixin
from .lora_targets import register_peft_defaults
from .mlp import SwiGLU
from .normalization import RMSNorm


class _Prefixed:
    """A view of a LayerCache whose entries carry a prefix, so two sub-layers share one layer cache."""

    def __init__(self, cache: LayerCache, prefix: str) -> None:
        self.cache, self.prefix = cache, prefix

    @property
    def states(self) -> dict[str, torch.Tensor]:
        return self.cache.group(self.prefix)

    def __contains__(self, name: str) -> bool:
        return self.prefix + name in self.cache.states

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.cache.states[self.prefix + name]

    def get(self, name: str) -> torch.Tensor | None:
        return self.cache.states.get(self.prefix + name)

    def group(self, prefix: str) -> dict[str, torch.Tensor]:
        return self.cache.group(self.prefix + prefix)

    def update(self, **tensors: torch.Tensor) -> None:
        self.cache.update(**{self.prefix + k: v for k, v in tensors.items()})

    @property
    def seen_tokens(self) -> int:
        return self.cache.seen_tokens

    @property
    def in_place(self) -> bool:
        return self.cache.in_place


class AtlasBlock(GradientCheckpointingLayer):
    def __init__(self, config: AtlasConfig, layer_idx: int) -> None:
        super().__init__()
        self.hybrid = config.hybrid
        self.attn_norm = RMSNorm(config.hidden_size, eps=config.norm_eps, autocast_output=True)
        self.attn = AtlasLayer(config, layer_idx)
        if config.hybrid is not None:
            self.swa = SoftmaxAttention(config.hidden_size, config.num_heads, config.num_heads, config.rope_theta,
                                        layer_idx, sliding_window=config.sliding_window)
            if config.hybrid == "mal":
                self.swa_norm = RMSNorm(config.hidden_size, eps=config.norm_eps, autocast_output=True)
            else:
                self.swa_out_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
                self.memory_out_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp_norm = RMSNorm(config.hidden_size, eps=config.norm_eps, autocast_output=True)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        key_valid: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        past_key_values: LayerCache | None = None,
    ) -> tuple[torch.Tensor, None]:
        memory_cache = swa_cache = None
        if past_key_values is not None:
            memory_cache, swa_cache = _Prefixed(past_key_values, "mem."), _Prefixed(past_key_values, "swa.")
        if self.hybrid == "mal":
            hidden_states = hidden_states + self.swa(self.swa_norm(hidden_states), positions, key_valid, swa_cache)
        if self.hybrid == "mag":
            x = self.attn_norm(hidden_states)
            swa = self.swa(x, positions, key_valid, swa_cache)
            memory = self.attn(x, attention_mask, memory_cache).hidden_states
            mixed = self.swa_out_norm(swa) * torch.sigmoid(self.memory_out_norm(memory))
        else:
            mixed = self.attn(self.attn_norm(hidden_states), attention_mask, memory_cache).hidden_states
        normed, hidden_states = self.mlp_norm(mixed, hidden_states)  # the residual add fused into the norm
        hidden_states = hidden_states + self.mlp(normed)
        return hidden_states, None

    def reserve_decode_slots(self, cache: LayerCache) -> int | None:
        return self.attn.reserve_decode_slots(_Prefixed(cache, "mem."))


class AtlasPreTrainedModel(PreTrainedModel):
    config_class = AtlasConfig
    config: AtlasConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["AtlasBlock"]

    def _init_weights(self, module: nn.Module) -> None:
        if init_shared_weights(module, self.config.initializer_range):
            return
        if isinstance(module, AtlasLayer):
            for param in module.memory_init().values():
                init.normal_(param, mean=0.0, std=self.config.memory_init_std)
            if hasattr(module, "feature_coefficients"):
                coefficients = initial_coefficients(self.config.feature_map, self.config.poly_degree)
                init.copy_(module.feature_coefficients, coefficients.to(module.feature_coefficients.device))


class AtlasModel(MnemoDecoderMixin, AtlasPreTrainedModel):
    """The Atlas stack without the language-modelling head."""

    block_class = AtlasBlock


class AtlasForCausalLM(MnemoCausalLMMixin, MnemoGenerationMixin, AtlasPreTrainedModel):
    """Atlas / Atlas++ / OmegaNet / DLA / SWLA language model; ``generate()`` on the memory cache."""

    base_model_class = AtlasModel

    @classmethod
    def decode_graph_obstacle(cls, config: AtlasConfig) -> str:
        if config.hybrid is not None:
            return f"its {config.hybrid!r} hybrid's sliding-window attention keeps a key/value cache that grows"
        return ""


register_peft_defaults(AtlasConfig.model_type)  # here, so that exported code registers them too
