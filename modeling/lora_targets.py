"""PEFT's default LoRA target modules for the mnemo model types.

With ``LoraConfig(task_type="CAUSAL_LM")`` and no ``target_modules``, PEFT looks the
model type up in its mapping. mnemo's defaults adapt the memory and attention
projections and the MLPs, never the router or the gates (learning rates, decays,
window and caching gates), whose scale the inner loops depend on. Each family's
modelling module registers its entry when it is imported, so a folder exported
with its code (``trust_remote_code``) gets them where mnemo is not installed.
"""

from __future__ import annotations

_MLP = ["gate_proj", "up_proj", "down_proj"]

# MoM's routed memories are ``memories.<m>``, each with its ``k_proj`` and ``v_proj``; the same names
# also reach the key and value projections of MoM's hybrid attention layers.
LORA_TARGET_MODULES: dict[str, list[str]] = {
    "mnemo_mom": ["q_proj", "k_proj", "v_proj", "shared_k", "shared_v", "g_proj", "o_proj", *_MLP],
    "mnemo_deep_transformer": ["q_proj", "k_proj", "v_proj", "o_proj", *_MLP],
    "mnemo_mc_titans": ["q_proj", "k_proj", "v_proj", "g_proj", "o_proj", *_MLP],
    "mnemo_atlas": ["q_proj", "k_proj", "v_proj", "g_proj", "o_proj", *_MLP],
}


def register_peft_defaults(*model_types: str) -> bool:
    """Add the LoRA defaults of ``model_types`` (default: every mnemo type) to PEFT's mapping, keeping an
    entry PEFT already has; ``False`` when PEFT is not installed."""
    try:
        from peft.utils import constants
    except ImportError:
        return False
    for model_type in model_types or LORA_TARGET_MODULES:
        constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.setdefault(
            model_type, list(LORA_TARGET_MODULES[model_type]))
    return True
