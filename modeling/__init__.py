"""Layers, blocks, caches and models of the mnemo families."""

from .cache import LayerCache, MnemoCache
from .modeling_atlas import AtlasForCausalLM, AtlasModel, AtlasPreTrainedModel
from .modeling_deep_transformer import (
    DeepTransformerForCausalLM,
    DeepTransformerModel,
    DeepTransformerPreTrainedModel,
)
from .modeling_mc_titans import MCTitansForCausalLM, MCTitansModel, MCTitansPreTrainedModel
from .modeling_mom import MoMForCausalLM, MoMModel, MoMPreTrainedModel
from .outputs import MnemoCausalLMOutput, MnemoModelOutput

__all__ = [
    "AtlasForCausalLM",
    "AtlasModel",
    "AtlasPreTrainedModel",
    "DeepTransformerForCausalLM",
    "DeepTransformerModel",
    "DeepTransformerPreTrainedModel",
    "LayerCache",
    "MCTitansForCausalLM",
    "MCTitansModel",
    "MCTitansPreTrainedModel",
    "MnemoCache",
    "MnemoCausalLMOutput",
    "MnemoModelOutput",
    "MoMForCausalLM",
    "MoMModel",
    "MoMPreTrainedModel",
]
