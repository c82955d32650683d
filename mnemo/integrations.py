"""Defaults that other libraries read by ``model_type``: PEFT's LoRA target modules.

With ``LoraConfig(task_type="CAUSAL_LM")`` and no ``target_modules``, PEFT looks
the model type up in its mapping. mnemo's defaults adapt the memory and
attention projections and the MLPs, never the router or the gates (learning
rates, decays, window and caching gates), whose scale the inner loops depend on.
"""

from __future__ import annotations

_MLP = ["gate_proj", "up_proj", "down_proj"]
_MAX_MEMORIES = 64  # MoM's per-memory projections are ModuleLists: k_proj.0, k_proj.1, ...

# In MoM, "k_proj"/"v_proj" name the per-memory ModuleLists (flash-linear-attention's layout), so
# the defaults name their members; the k/v projections of MoM's hybrid attention layers are
# therefore not adapted by default (their q_proj and o_proj are).
LORA_TARGET_MODULES: dict[str, list[str]] = {
    "mnemo_mom": ["q_proj", "shared_k", "shared_v", "g_proj", "o_proj", *_MLP]
    + [f"{name}.{i}" for name in ("k_proj", "v_proj") for i in range(_MAX_MEMORIES)],
    "mnemo_deep_transformer": ["q_proj", "k_proj", "v_proj", "o_proj", *_MLP],
    "mnemo_mc_titans": ["q_proj", "k_proj", "v_proj", "g_proj", "o_proj", *_MLP],
    "mnemo_atlas": ["q_proj", "k_proj", "v_proj", "g_proj", "o_proj", *_MLP],
}


def register_peft_defaults() -> bool:
    """Add mnemo's LoRA defaults to PEFT's mapping; ``False`` when PEFT is not installed."""
    try:
        from peft.utils import constants
    except ImportError:
        return False
    for model_type, targets in LORA_TARGET_MODULES.items():
        constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.setdefault(model_type, list(targets))
    return True
