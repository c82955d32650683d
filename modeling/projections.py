"""Several linear projections of one input, as one product over their stacked weights when the input has few rows.

A decoding step projects each layer's one token per row through several ``nn.Linear`` of the same input
(queries, keys, values, gate logits, the output gate). With a row or a few, each product is a matrix-vector
product that streams its weight with a handful of thread blocks, and the three gates' are
``hidden -> heads`` products that cuBLAS splits along the input and reduces in extra launches: a layer's
projections were about a dozen launches for a few megabytes. Stacked, they are one product that streams all the
weights at once. With many rows (training, a prefill) every projection is a matrix product that fills the GPU on
its own and stacking would only copy the weights, so they run one by one, as the modules themselves.

Only plain ``nn.Linear`` modules (or subclasses that keep its ``forward``, such as the gate projections) are
stacked: a module that PEFT wraps with an adapter, a quantised one or one with hooks runs as itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FEW_ROWS", "plain_linear", "project_together"]

# Rows (batch x tokens) up to which the projections share one product: decoding steps, not prefills.
FEW_ROWS = 64


def plain_linear(module: nn.Module) -> bool:
    """Whether ``module`` computes exactly ``F.linear(x, weight, bias)``: ``nn.Linear``'s own forward, no hooks,
    no forward set on the instance (accelerate's offloading), unquantised floating-point weights."""
    return (isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward
            and "forward" not in module.__dict__ and not module._forward_hooks and not module._forward_pre_hooks
            and not nn.modules.module._global_forward_hooks and not nn.modules.module._global_forward_pre_hooks
            and module.weight.is_floating_point())


def project_together(x: torch.Tensor, linears: Sequence[nn.Module]) -> list[torch.Tensor]:
    """``[m(x) for m in linears]``, the plain ones as one product over their stacked weights when ``x`` has at
    most :data:`FEW_ROWS` rows (``x.shape[:-1]``)."""
    together = [i for i, m in enumerate(linears) if plain_linear(m)]
    if x.shape[:-1].numel() > FEW_ROWS or len(together) < 2 or len(
            {(linears[i].weight.dtype, linears[i].weight.device) for i in together}) != 1:
        return [m(x) for m in linears]
    mods = [linears[i] for i in together]
    weight = torch.cat([m.weight for m in mods])
    bias = None
    if any(m.bias is not None for m in mods):
        # one block of zeros for each run of modules without a bias: fewer launches than a block each
        pieces, zeros = [], 0
        for m in mods:
            if m.bias is None:
                zeros += m.out_features
                continue
            if zeros:
                pieces.append(m.weight.new_zeros(zeros))
                zeros = 0
            pieces.append(m.bias)
        if zeros:
            pieces.append(mods[0].weight.new_zeros(zeros))
        bias = torch.cat(pieces)
    parts = F.linear(x, weight, bias).split([m.out_features for m in mods], -1)
    outs = [None] * len(linears)
    for i, part in zip(together, parts):
        outs[i] = part
    return [out if out is not None else m(x) for out, m in zip(outs, linears)]
