"""mnemo: memory-based sequence models as Hugging Face ``transformers`` models.

Importing ``mnemo`` registers every family with the ``Auto*`` classes, so
``AutoModelForCausalLM.from_pretrained`` loads mnemo checkpoints directly;
:func:`register` does the same explicitly and is idempotent.
"""

from __future__ import annotations

from mnemo.configuration import AtlasConfig, DeepTransformerConfig, MCTitansConfig, MoMConfig
from mnemo.integrations import register_peft_defaults
from mnemo.kernels import use_backend
from mnemo.modeling import (
    AtlasForCausalLM,
    AtlasModel,
    DeepTransformerForCausalLM,
    DeepTransformerModel,
    MCTitansForCausalLM,
    MCTitansModel,
    MnemoCache,
    MoMForCausalLM,
    MoMModel,
)

__version__ = "0.1.0"

_FAMILIES = (
    (MoMConfig, MoMModel, MoMForCausalLM),
    (DeepTransformerConfig, DeepTransformerModel, DeepTransformerForCausalLM),
    (MCTitansConfig, MCTitansModel, MCTitansForCausalLM),
    (AtlasConfig, AtlasModel, AtlasForCausalLM),
)


def register() -> None:
    """Register every mnemo config and model with ``AutoConfig``, ``AutoModel`` and ``AutoModelForCausalLM``,
    and mnemo's LoRA defaults with PEFT when it is installed."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    for config_cls, base_cls, lm_cls in _FAMILIES:
        AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
        AutoModel.register(config_cls, base_cls, exist_ok=True)
        AutoModelForCausalLM.register(config_cls, lm_cls, exist_ok=True)
    register_peft_defaults()


register()


# Loaded when first asked for: the Trainer subclass imports transformers' training stack, and the
# conversions are not needed to run a model.
_LAZY = {
    "MnemoTrainer": "mnemo.training",
    "export_hub_folder": "mnemo.conversion.hub_export",
    "push_to_hub": "mnemo.conversion.hub_export",
    "convert_to_memory_caching": "mnemo.conversion.memory_caching",
    "convert_from_fla": "mnemo.conversion.from_fla",
    "convert_from_llama": "mnemo.conversion.from_llama",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mnemo' has no attribute {name!r}")


__all__ = [
    "AtlasConfig",
    "AtlasForCausalLM",
    "AtlasModel",
    "DeepTransformerConfig",
    "DeepTransformerForCausalLM",
    "DeepTransformerModel",
    "MCTitansConfig",
    "MCTitansForCausalLM",
    "MCTitansModel",
    "MnemoCache",
    "MnemoTrainer",
    "MoMConfig",
    "MoMForCausalLM",
    "MoMModel",
    "__version__",
    "convert_from_fla",
    "convert_from_llama",
    "convert_to_memory_caching",
    "export_hub_folder",
    "push_to_hub",
    "register",
    "use_backend",
]
