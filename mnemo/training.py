"""``MnemoTrainer``: transformers' ``Trainer`` that also logs the router's load-balancing loss.

The loss it optimises is the model's own (for MoM, the LM loss plus
``aux_loss_coef * aux_loss``); it adds ``aux_loss``, averaged over the steps since
the last log, beside ``loss`` in every training log.
"""

from __future__ import annotations

from typing import Any

from transformers import Trainer


class MnemoTrainer(Trainer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._aux_total = 0.0
        self._aux_count = 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        aux = outputs.get("aux_loss") if isinstance(outputs, dict) else getattr(outputs, "aux_loss", None)
        if aux is not None and model.training:
            self._aux_total += float(aux.detach())
            self._aux_count += 1
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if self._aux_count and "loss" in logs:
            logs["aux_loss"] = round(self._aux_total / self._aux_count, 6)
            self._aux_total, self._aux_count = 0.0, 0
        super().log(logs, *args, **kwargs)
