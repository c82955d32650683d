"""MC-Titans language models: ``MCTitansModel`` and ``MCTitansForCausalLM`` (FAMILIES.md §2).

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
from .cache import LayerCache, MnemoCache
from .generation import MnemoGenerationMixin
from .mc_titans_layer import GateProjection, MCTitansLayer
from .mlp import SwiGLU
from .normalization import RMSNorm
from .outputs import MnemoCausalLMOutput, MnemoModelOutput
from .stack import causal_lm_forward, decoder_forward


class MCTitansBlock(GradientCheckpointingLayer):
    def __init__(self, config: MCTitansConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = MCTitansLayer(config, layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        key_valid: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        past_key_values: LayerCache | None = None,
    ) -> tuple[torch.Tensor, None]:
        hidden_states = hidden_states + self.attn(self.attn_norm(hidden_states), attention_mask, past_key_values)
        hidden_states = hidden_states + self.mlp(self.mlp_norm(hidden_states))
        return hidden_states, None


class MCTitansPreTrainedModel(PreTrainedModel):
    config_class = MCTitansConfig
    config: MCTitansConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["MCTitansBlock"]

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, GateProjection):
            init.normal_(module.weight, mean=0.0, std=std)
            init.constant_(module.bias, module.bias_init)
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        elif isinstance(module, RMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, MCTitansLayer):
            for param in module.memory_init().values():
                init.normal_(param, mean=0.0, std=self.config.memory_init_std)


class MCTitansModel(MCTitansPreTrainedModel):
    """The MC-Titans stack without the language-modelling head."""

    def __init__(self, config: MCTitansConfig) -> None:
        config.validate_mc_titans()
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(MCTitansBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: MnemoCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> MnemoModelOutput | tuple:
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        out = decoder_forward(
            self, input_ids, attention_mask, past_key_values, inputs_embeds, position_ids, use_cache,
            output_hidden_states,
        )
        return out if return_dict else out.to_tuple()


class MCTitansForCausalLM(MCTitansPreTrainedModel, MnemoGenerationMixin):
    """MC-Titans language model; ``generate()`` runs on the memory-and-snapshot cache."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: MCTitansConfig) -> None:
        super().__init__(config)
        self.model = MCTitansModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: MnemoCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> MnemoCausalLMOutput | tuple:
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            position_ids=position_ids,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            return_dict=True,
        )
        out = causal_lm_forward(self, outputs, labels, logits_to_keep, 0.0, **kwargs)
        return out if return_dict else out.to_tuple()
