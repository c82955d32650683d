"""The MLP memory every deep memory trains in context: its shape, its forward and its gradients.

One head's memory ``M`` maps keys of width ``d_k`` to values of width ``d_v``:
``M(z) = W z`` (``depth=1``), ``z + W1 sigma(W2 z)`` (``depth=2``, GELU ``sigma``) or
``z + W1 (sigma(W2 z) * W3 z)`` (``gated``); where ``d_k != d_v`` the skip ``z`` is a learned
linear map ``W0 z``. The objective of a key-value pair is ``||M(k) - v||^2`` (``l2``) or
``-<M(k), v>`` (``dot``).

Every gradient of the objective is a sum of rank-1 outer products ``A B^T`` per token
(:func:`grad_factors`), which is what lets the chunked paths of Titans, Atlas and Memory
Caching apply every token's weights without materialising them. This module is the one
definition of ``M(z)`` (:func:`memory_apply`) and of those factors; Titans
(:mod:`.titans`), Atlas (:mod:`.atlas`) and the cached memories (:mod:`.memory_caching`)
all take them from here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from .activations import gelu_derivative
from .norms import clip_rank_one

__all__ = ["Apply", "MLPMemorySpec", "grad_factors", "memory_apply", "raw_grad_factors", "static_apply"]


@dataclass(frozen=True)
class MLPMemorySpec:
    """The memory MLP of one head: ``d_k -> d_v``, hidden ``expansion * d_v``, and its objective.

    The MLP's skip is the identity when ``d_k == d_v`` and otherwise a linear map
    ``w0`` that belongs to the memory (learned initial value, trained in context).
    ``objective`` is ``"l2"`` (``||M(k) - v||^2``) or ``"dot"`` (``-<M(k), v>``).
    ``grad_clip`` bounds the norm of each token's gradient over all the memory's weights
    (``None``: unclipped, the papers' rule); see :func:`grad_factors`.
    """

    depth: int = 2
    gated: bool = False
    d_k: int = 64
    d_v: int = 64
    expansion: int = 4
    objective: str = "l2"
    grad_clip: float | None = None

    def __post_init__(self) -> None:
        if self.depth not in (1, 2):
            raise ValueError(f"memory depth must be 1 (linear) or 2 (MLP), got {self.depth}")
        if self.objective not in ("l2", "dot"):
            raise ValueError(f"objective must be 'l2' or 'dot', got {self.objective!r}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"grad_clip must be > 0 or None, got {self.grad_clip}")

    @property
    def hidden(self) -> int:
        return self.expansion * self.d_v

    @property
    def linear_skip(self) -> bool:
        return self.depth == 2 and self.d_k != self.d_v

    @property
    def shapes(self) -> dict[str, tuple[int, int]]:
        """``(d_out, d_in)`` of every weight matrix."""
        if self.depth == 1:
            return {"w": (self.d_v, self.d_k)}
        shapes = {"w1": (self.d_v, self.hidden), "w2": (self.hidden, self.d_k)}
        if self.gated:
            shapes["w3"] = (self.hidden, self.d_k)
        if self.linear_skip:
            shapes["w0"] = (self.d_v, self.d_k)
        return shapes


Apply = Callable[[str, torch.Tensor], torch.Tensor]


def static_apply(weights: dict[str, torch.Tensor]) -> Apply:
    """``apply(name, x) = x W_name^T`` for weights ``(..., d_out, d_in)`` and ``x`` ``(..., T, d_in)``."""
    return lambda name, x: x @ weights[name].transpose(-1, -2).to(x.dtype)


def memory_apply(spec: MLPMemorySpec, apply: Apply, z: torch.Tensor) -> torch.Tensor:
    """The memory MLP on ``z``, with every weight product delegated to ``apply`` (static,
    per-token online, mixed): the one definition of ``M(z)``."""
    if spec.depth == 1:
        return apply("w", z)
    hidden = F.gelu(apply("w2", z))
    if spec.gated:
        hidden = hidden * apply("w3", z)
    return (apply("w0", z) if spec.linear_skip else z) + apply("w1", hidden)


def grad_factors(spec: MLPMemorySpec, weights: dict[str, torch.Tensor], k: torch.Tensor, v: torch.Tensor):
    """Gradients of the objective as rank-1 factors ``{name: (A, B)}``, ``grad = A B^T`` per token.

    With ``spec.grad_clip`` each token's gradient is rescaled so that its norm over all
    the memory's weights is at most ``grad_clip``. A rank-1 gradient's Frobenius norm is
    ``||A|| ||B||``, so the clip costs two vector norms per weight and never forms a matrix;
    it is applied here, where every path (reference, step, chunked, cached) gets its
    gradients, so the paths stay equal.
    """
    factors = raw_grad_factors(spec, weights, k, v)
    if spec.grad_clip is None:
        return factors
    # Why: the inner descent on an MLP memory diverges once the outer training makes values
    # (hence errors) large; a bounded step keeps the memory finite whatever the gates do.
    return clip_rank_one(factors, spec.grad_clip)


def raw_grad_factors(spec: MLPMemorySpec, weights: dict[str, torch.Tensor], k: torch.Tensor, v: torch.Tensor,
                      keep: dict | None = None):
    """The unclipped factors; ``keep`` (non-gated MLPs) receives the hidden layer's pre-activation
    ``pre``, its gradient ``back`` and the activation's slope ``slope``, which a hand-written
    backward (:mod:`.titans_chunk`) reuses."""
    apply = static_apply(weights)

    def d_loss(prediction):  # dL/dM(k)
        return 2 * (prediction - v) if spec.objective == "l2" else -v.expand_as(prediction)

    if spec.depth == 1:
        return {"w": (d_loss(apply("w", k)), k)}
    pre2 = apply("w2", k)
    act = F.gelu(pre2)
    hidden = act * apply("w3", k) if spec.gated else act
    err = d_loss((apply("w0", k) if spec.linear_skip else k) + apply("w1", hidden))
    back = err @ weights["w1"].to(err.dtype)  # dL/d hidden
    factors = {"w1": (err, hidden)}
    if spec.linear_skip:
        factors["w0"] = (err, k)
    if spec.gated:
        pre3 = apply("w3", k)
        factors["w2"] = (back * pre3 * gelu_derivative(pre2), k)
        factors["w3"] = (back * act, k)
    else:
        slope = gelu_derivative(pre2)
        factors["w2"] = (back * slope, k)
        if keep is not None:
            keep.update(pre=pre2, back=back, slope=slope)
    return factors
