"""Configurations of the mnemo model families, each validating itself on construction."""

from .configuration_atlas import AtlasConfig
from .configuration_deep_transformer import DeepTransformerConfig
from .configuration_mc_titans import MCTitansConfig
from .configuration_mom import MoMConfig

__all__ = ["AtlasConfig", "DeepTransformerConfig", "MCTitansConfig", "MoMConfig"]
