"""Defaults that other libraries read by ``model_type``: PEFT's LoRA target modules.

The table and its registration live beside the models (:mod:`mnemo.modeling.lora_targets`),
so that exported folders carry them; they are re-exported here.
"""

from __future__ import annotations

from mnemo.modeling.lora_targets import LORA_TARGET_MODULES, register_peft_defaults

__all__ = ["LORA_TARGET_MODULES", "register_peft_defaults"]
