"""Per-head gate projections whose biases start at chosen values (inner-loop learning rates, decays)."""

from __future__ import annotations

from torch import nn


class GateProjection(nn.Linear):
    """A per-head gate logit ``x W + b`` whose bias starts at ``bias_init``."""

    def __init__(self, hidden: int, heads: int, bias_init: float) -> None:
        super().__init__(hidden, heads)
        self.bias_init = bias_init
