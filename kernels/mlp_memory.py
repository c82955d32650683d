"""The MLP memory every deep memory trains in context: its shape, its forward and its gradients.

One head's memory ``M`` maps keys of width ``d_k`` to values of width ``d_v``:
``M(z) = W z`` (``depth=1``), ``z + W1 sigma(W2 z)`` (``depth=2``, GELU ``sigma``) or
``z + W1 (sigma(W2 z) * W3 z)`` (``gated``); where ``d_k != d_v`` the skip ``z`` is a learned
linear map ``W0 z``. The objective of a key-value pair is ``||M(k) - v||^2`` (``l2``) or
``-<M(k), v>`` (``dot``).

Every gradient of the objective is a sum of rank-1 outer products ``A B^T`` per token
(:func:`grad_factors`), which is what lets the chunked paths of Titans, Atlas and Memory
Caching apply every token's weights without materialising them. This module is the one
definition of ``M(z)`` (:func:`memory_apply`), of those factors, and of the chunked form they
allow: inside an inner chunk every token's weights are ``a_t W + b_t S + sum_k c_tk A_k B_k^T``
with scalar coefficients from the gates (:func:`chunk_coefficients`, :class:`ChunkOperator`), and
the chunks of a call run through :func:`run_resumable_chunks`. Titans (:mod:`.titans`), Atlas
(:mod:`.atlas`) and the cached memories take them from here and add only their own gates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from .activations import gelu_derivative
from .chunk_loop import run_chunks
from .norms import clip_rank_one

__all__ = [
    "Apply",
    "ChunkOperator",
    "MLPMemorySpec",
    "align_rows",
    "chunk_coefficients",
    "chunks_first",
    "chunks_last",
    "grad_factors",
    "memory_apply",
    "next_chunk_start",
    "raw_grad_factors",
    "resumed_grad_weights",
    "run_resumable_chunks",
    "segment_products",
    "static_apply",
]


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
    """The unclipped factors; ``keep`` (MLPs) receives the hidden layer's pre-activation ``pre``, its
    gradient ``back`` and the activation's slope ``slope`` (gated: also the activation ``act`` and the
    gate's pre-activation ``gate``), which a hand-written backward (:mod:`.titans_chunk`) reuses."""
    apply = static_apply(weights)

    def d_loss(prediction):  # dL/dM(k)
        return 2 * (prediction - v) if spec.objective == "l2" else -v.expand_as(prediction)

    if spec.depth == 1:
        return {"w": (d_loss(apply("w", k)), k)}
    pre2 = apply("w2", k)
    act = F.gelu(pre2)
    pre3 = apply("w3", k) if spec.gated else None
    hidden = act * pre3 if spec.gated else act
    err = d_loss((apply("w0", k) if spec.linear_skip else k) + apply("w1", hidden))
    back = err @ weights["w1"].to(err.dtype)  # dL/d hidden
    factors = {"w1": (err, hidden)}
    if spec.linear_skip:
        factors["w0"] = (err, k)
    if spec.gated:
        slope = gelu_derivative(pre2)
        factors["w2"] = (back * pre3 * slope, k)
        factors["w3"] = (back * act, k)
        if keep is not None:
            keep.update(pre=pre2, back=back, slope=slope, act=act, gate=pre3)
    elif keep is not None:
        slope = gelu_derivative(pre2)
        factors["w2"] = (back * slope, k)
        keep.update(pre=pre2, back=back, slope=slope)
    else:
        # back * GELU'(pre) in one kernel: a decoding step's dozen elementwise launches were most of its
        # gradient's time (the same erf GELU's derivative, to rounding). Whatever the grad mode: a checkpointed
        # block runs its forward without it and its recompute with it, and the two must agree.
        factors["w2"] = (torch.ops.aten.gelu_backward(back, pre2), k)
    return factors


# ------------------------------------------- The chunked form: every token's weights as coefficients


def segment_products(log_d: torch.Tensor) -> torch.Tensor:
    """``P[t, m] = prod_{l=m+1..t} d_l`` for ``m <= t`` (0 above the diagonal), from ``log d`` ``(..., C)``."""
    cum = log_d.cumsum(-1)
    C = log_d.shape[-1]
    idx = torch.arange(C, device=log_d.device)
    lower = idx[:, None] >= idx[None, :]
    return (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()


def chunk_coefficients(band, dM, gm, dS=None, gs=None):
    """The scalar coefficients of :class:`ChunkOperator` (see there) from its gates (``(B, H, C)``,
    ``band (B, H, C, K)``): ``a, b, sa (B, H, C)`` and ``c, sc (B, H, C, K)``, so that
    ``M_t = a_t W0 + b_t S0 + sum_k c_tk A_k B_k^T`` and ``S_t = sa_t S0 + sum_k sc_tk A_k B_k^T``."""
    tiny = 1e-30
    X = segment_products(dM.clamp(min=tiny).log()) * gm[..., None, :]  # (B, H, C, C)
    a = dM.clamp(min=tiny).log().cumsum(-1).exp()
    if dS is None:  # no momentum: S_t = G_t
        Y_gs = torch.diag_embed(torch.ones_like(dM))
        b = torch.zeros_like(dM)
        sa = torch.zeros_like(dM)
    else:
        log_s = dS.clamp(min=tiny).log()
        Y_gs = segment_products(log_s) * gs[..., None, :]
        sa = log_s.cumsum(-1).exp()
        b = (X @ sa[..., None])[..., 0]
    return a, b, (X @ Y_gs) @ band, sa, Y_gs @ band


class ChunkOperator:
    """The online memory of every token of one inner chunk, as an ``apply`` for :func:`memory_apply`.

    The chunk runs the two-level linear recurrence (per weight matrix, scalar gates)::

        S_t = dS_t S_{t-1} + gs_t G_t,    M_t = dM_t M_{t-1} + gm_t S_t,
        G_t = sum_k band[t, k] A_k B_k^T

    from the state before the chunk ``(W0, S0)``, with gradient factors ``(A_k, B_k)``
    taken at the chunk-start weights. Titans: ``dS = momentum``, ``gs = -lr``,
    ``dM = retention``, ``gm = 1``, ``band = I``. Without momentum ``S_t = G_t``.
    Unrolled, ``M_t = a_t W0 + b_t S0 + sum_k c_tk A_k B_k^T``: applying it to
    per-token vectors is a few batched matmuls, with no per-token weights.
    """

    def __init__(self, W0, S0, factors, band, dM, gm, dS=None, gs=None):
        self.a, self.b, self.c, self.sa, self.sc = chunk_coefficients(band, dM, gm, dS, gs)
        self.W0, self.S0, self.factors = W0, S0, factors

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """``W_t x_t`` for every token ``t`` of the chunk; ``x`` ``(B, H, C, d_in)``."""
        A, Bf = self.factors[name]
        out = self.a[..., None] * (x @ self.W0[name].transpose(-1, -2)) + (self.c * (x @ Bf.transpose(-1, -2))) @ A
        if self.S0 is not None:
            out = out + self.b[..., None] * (x @ self.S0[name].transpose(-1, -2))
        return out

    def final(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
        """Weights and momenta after the chunk's last token."""
        weights, momentum = {}, {}
        for n, (A, Bf) in self.factors.items():
            # The rank-C sums ride in the matmul's epilogue (baddbmm), so the weight-sized tensors are
            # read and written as few times as the gated sums allow (no measurable change at the
            # benchmark shape, where the gates' element-wise work elsewhere dominates: benchmarks/RESULTS.md).
            base = self.a[..., -1, None, None] * self.W0[n]
            if self.S0 is not None:
                base = torch.addcmul(base, self.b[..., -1, None, None], self.S0[n])
            weights[n] = _add_rank_update(base, A * self.c[..., -1, :, None], Bf)
            momentum[n] = self.final_momentum(n)
        return weights, momentum

    def final_momentum(self, name: str) -> torch.Tensor:
        """The momentum of weight ``name`` after the chunk's last token."""
        A, Bf = self.factors[name]
        start = None if self.S0 is None else self.sa[..., -1, None, None] * self.S0[name]
        return _add_rank_update(start, A * self.sc[..., -1, :, None], Bf)


def _add_rank_update(base: torch.Tensor | None, A: torch.Tensor, Bf: torch.Tensor) -> torch.Tensor:
    """``base + A^T Bf`` for ``A (..., K, d_out)``, ``Bf (..., K, d_in)``, summed in ``base``'s precision.

    Without autocast the sum is the matmul's epilogue (``baddbmm``): the weight-sized ``base`` is read
    once. Under autocast the product is lowered on its own and added in float32, as a plain sum would
    be, so that the memory itself never drops to the autocast dtype.
    """
    lead = A.shape[:-2]
    A_t, B_ = A.reshape(-1, *A.shape[-2:]).transpose(-1, -2), Bf.reshape(-1, *Bf.shape[-2:])
    if base is None:
        out = torch.bmm(A_t, B_).to(A.dtype)
    elif torch.is_autocast_enabled(A.device.type):
        return base + torch.bmm(A_t, B_).view(*lead, A.shape[-1], Bf.shape[-1])
    else:
        out = torch.baddbmm(base.reshape(-1, *base.shape[-2:]), A_t, B_)
    return out.view(*lead, *out.shape[-2:])


def align_rows(x: torch.Tensor, shift: torch.Tensor, lengths: torch.Tensor, total: int):
    """Place row ``b`` of ``x (B, T, ...)`` at slots ``[shift_b, shift_b + lengths_b)`` of a
    ``(B, total, ...)`` zero buffer; returns the buffer and the slots' ``live`` mask."""
    B, T = x.shape[:2]
    slot = shift[:, None] + torch.arange(T, device=x.device)[None]
    valid = torch.arange(T, device=x.device)[None] < lengths[:, None]
    slot = torch.where(valid, slot, torch.full_like(slot, total))  # invalid tokens go to a spill slot
    out = x.new_zeros(B, total + 1, *x.shape[2:])
    out.scatter_(1, slot.view(B, T, *([1] * (x.dim() - 2))).expand_as(x), x)
    live = torch.zeros(B, total + 1, dtype=torch.bool, device=x.device)
    live.scatter_(1, slot, valid)
    return out[:, :total], live[:, :total], slot


def resumed_grad_weights(W: dict[str, torch.Tensor], use_stored: torch.Tensor,
                         stored: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights a chunk takes its gradients at: the stored chunk-start weights (``spec.shapes``
    order) for rows resuming inside it (``use_stored (B,)``), the carried ``W`` for the others."""
    r = use_stored[:, None, None, None]
    return {n: torch.where(r, c, w) for (n, w), c in zip(W.items(), stored)}


def next_chunk_start(stops: torch.Tensor, grad_w: dict[str, torch.Tensor],
                     chunk_start: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The chunk-start weights after a chunk: its gradient weights for rows whose last token is inside
    it (``stops (B,)``), where a later call resumes; unchanged for the others."""
    here = stops[:, None, None, None]
    return tuple(torch.where(here, grad_w[n], c) for n, c in zip(grad_w, chunk_start))


def run_resumable_chunks(step_for: Callable[[bool], Callable], carry, xs, consts, resumed: torch.Tensor,
                         stored: Sequence[torch.Tensor], **loop) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The chunks of one call (``xs`` chunk-first) through :func:`~.chunk_loop.run_chunks`; returns the
    stacked outputs and the final carry.

    Rows resume inside a chunk by less than ``C`` tokens, so only the first chunk can hold a resumed
    row's first token. Where any row resumes, that chunk runs alone with ``step_for(True)`` and
    ``consts + (resumed, *stored)`` (the stored chunk-start weights), the rest with ``step_for(False)``
    and ``consts``: the rest's step never reads the stored weights.
    """
    outputs, first = [], 0
    if bool(resumed.any()):
        ys, carry = run_chunks(step_for(True), carry, [x[:1] for x in xs], (*consts, resumed, *stored), **loop)
        outputs.append(ys[0])
        first = 1
    if first < xs[0].shape[0]:
        ys, carry = run_chunks(step_for(False), carry, [x[first:] for x in xs], consts, **loop)
        outputs.append(ys[0])
    return (torch.cat(outputs) if len(outputs) > 1 else outputs[0]), carry


def chunks_first(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``(B, H, n * C, ...)`` -> ``(n, B, H, C, ...)``: the per-chunk layout of :func:`~.chunk_loop.run_chunks`."""
    B, H, L = x.shape[:3]
    return x.reshape(B, H, L // chunk_size, chunk_size, *x.shape[3:]).movedim(2, 0)


def chunks_last(y: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`chunks_first`: ``(n, B, H, C, ...)`` -> ``(B, H, n * C, ...)``."""
    n, B, H, C = y.shape[:4]
    return y.movedim(0, 2).reshape(B, H, n * C, *y.shape[4:])
