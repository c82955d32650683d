"""Several linear projections of one input, as one product over their stacked weights in a decoding step.

A decoding step projects each layer's one token per row through several ``nn.Linear`` of the same input
(queries, keys, values, gate logits, the output gate). With a row or a few, each product is a matrix-vector
product that streams its weight with a handful of thread blocks, and the three gates' are
``hidden -> heads`` products that cuBLAS splits along the input and reduces in extra launches: a layer's
projections were about a dozen launches for a few megabytes. Stacked, they are one product that streams all the
weights at once.

The weights are stacked anew in every call, never kept: a kept copy would go stale when an optimiser changes
the weights in place, and a captured decode step (a CUDA graph) must read the parameters where they lie. So
stacking pays only while a step is bound by its launches, not by its bytes: the copy reads and writes the weights
once more before the product reads them. It is taken where that holds: at most :data:`FEW_ROWS` rows, at most
:data:`MAX_STACKED_BYTES` of weights, and no autograd recording (training keeps each product, and no stacked copy
of the weights is saved for its backward).

Only plain ``nn.Linear`` modules (or subclasses that keep its ``forward``, such as the gate projections) are
stacked: a module that PEFT wraps with an adapter, a quantised one (its own ``forward``, or weights of a tensor
subclass) or one with hooks runs as itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FEW_ROWS", "MAX_STACKED_BYTES", "plain_linear", "project_together"]

# Rows (batch x tokens) up to which the projections share one product: decoding steps, not prefills.
FEW_ROWS = 64
# Weights up to which stacking them pays: the copy costs two passes over them, which at HBM bandwidth (a few
# TB/s) stays below the launches it saves (a few microseconds each) up to some tens of megabytes. A layer of
# hidden 1024 stacks about 10 MB in bf16.
MAX_STACKED_BYTES = 32 * 2**20


def plain_linear(module: nn.Module) -> bool:
    """Whether ``module`` computes exactly ``F.linear(x, weight, bias)``: ``nn.Linear``'s own forward, no hooks
    (forward or backward, its own or global), no forward set on the instance (accelerate's offloading), and
    plain floating-point tensors for weights (not a quantised tensor subclass)."""
    if not isinstance(module, nn.Linear) or type(module).forward is not nn.Linear.forward:
        return False
    hooks = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks,
             nn.modules.module._global_forward_hooks, nn.modules.module._global_forward_pre_hooks,
             nn.modules.module._global_backward_hooks, nn.modules.module._global_backward_pre_hooks)
    tensors = [module.weight] if getattr(module, "bias", None) is None else [module.weight, module.bias]
    return ("forward" not in module.__dict__ and not any(hooks)
            and all(type(t) in (torch.Tensor, nn.Parameter) and t.is_floating_point() for t in tensors))


def project_together(x: torch.Tensor, linears: Sequence[nn.Module]) -> list[torch.Tensor]:
    """``[m(x) for m in linears]``, the plain ones as one product over their stacked weights where that pays
    (see the module): ``x`` of at most :data:`FEW_ROWS` rows (``x.shape[:-1]``), weights of one dtype and device
    and at most :data:`MAX_STACKED_BYTES` together, and no autograd recording."""
    together = [i for i, m in enumerate(linears) if plain_linear(m)]
    mods = [linears[i] for i in together]
    recording = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for m in mods
                                                                    for p in m.parameters()))
    if (recording or x.shape[:-1].numel() > FEW_ROWS or len(mods) < 2
            or len({(m.weight.dtype, m.weight.device) for m in mods}) != 1
            or sum(m.weight.numel() for m in mods) * mods[0].weight.element_size() > MAX_STACKED_BYTES):
        return [m(x) for m in linears]
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
