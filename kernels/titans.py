"""The Titans neural memory (docs/semantics.md): an MLP trained in context by momentum SGD.

Per head, memory ``M`` is ``M(z) = W z`` (``depth=1``), ``z + W1 sigma(W2 z)``
(``depth=2``, GELU) or ``z + W1 (sigma(W2 z) * W3 z)`` (``gated``). Token ``t`` of
an inner chunk takes the gradient of ``||M(k_t) - v_t||^2`` at the memory the
chunk started from, ``u_t``, then, with the token's gates ``retention``, ``momentum``
and ``lr`` (:func:`titans_update`)::

    S_t = momentum_t S_{t-1} - lr_t u_t       (per weight matrix)
    M_t = retention_t M_{t-1} + S_t
    y_t = M_t(q_t)

"The memory the chunk started from" is the memory before the chunk's first
token is written (so ``inner_chunk_size=1`` is per-token online gradient
descent). Every gradient is a sum of rank-1 outer products ``A_j B_j^T`` (closed
form, no autograd over tokens), so inside a chunk the weights of every token are
``M_i = a_i M_0 + b_i S_0 + sum_j c_ij A_j B_j^T`` with scalar coefficients from
cumulative products of the gates, and applying them to per-token vectors is a
handful of batched matmuls: per-token weights are never materialised.

A token with ``live = 0`` is an exact no-op (its gates are 1, 1 and 0 and its
momentum is not added to the memory): padding and alignment slots.

Weights are dicts of tensors ``(..., H, d_out, d_in)``; tensors are laid out
``(B, T, H, D)`` at the API and ``(B, H, T, D)`` inside.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple
from functools import partial

import torch

from .backend import resolve_backend
from .chunk_loop import tf32_products, tf32_wanted
from .normalized_features import normalized_features
from .mlp_memory import (
    ChunkOperator,
    MLPMemorySpec,
    align_rows,
    chunk_coefficients,
    chunks_first,
    chunks_last,
    grad_factors,
    memory_apply,
    next_chunk_start,
    resumed_grad_weights,
    run_resumable_chunks,
    static_apply,
)
from .norms import l2_normalize
from .titans_chunk import AUTOGRAD_PATH, chunk_memory
from .titans_chunk import wanted as fused_chunks
from .titans_persistent_triton import first_pass_wanted, loop_first_pass
from .titans_persistent_triton import titans_chunks as persistent_chunks
from .titans_persistent_triton import wanted as persistent_wanted

__all__ = [
    "TitansState",
    "chunk_titans",
    "reference_titans",
    "step_titans",
]


@dataclass
class TitansState:
    """Memory of every row: current weights and momenta, the weights the current inner chunk
    started from, and the number of tokens written in that chunk (``(B,)``)."""

    weights: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]
    chunk_start: dict[str, torch.Tensor]
    position: torch.Tensor

    def tensors(self, prefix: str = "") -> dict[str, torch.Tensor]:
        out = {f"{prefix}position": self.position}
        for group in ("weights", "momentum", "chunk_start"):
            out.update({f"{prefix}{group}.{n}": t for n, t in getattr(self, group).items()})
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str = "") -> "TitansState":
        groups: dict[str, dict[str, torch.Tensor]] = {"weights": {}, "momentum": {}, "chunk_start": {}}
        for key, t in tensors.items():
            if key.startswith(prefix) and "." in key[len(prefix):]:
                group, name = key[len(prefix):].split(".", 1)
                groups[group][name] = t
        return cls(position=tensors[f"{prefix}position"], **groups)

    @classmethod
    def initial(cls, init: dict[str, torch.Tensor], batch: int) -> "TitansState":
        """Rows starting from the learned initial weights ``init`` ``(H, d_out, d_in)``, zero momentum."""
        weights = {
            n: w.to(torch.promote_types(w.dtype, torch.float32)).expand(batch, *w.shape).clone()
            for n, w in init.items()
        }
        return cls(
            weights=weights,
            momentum={n: torch.zeros_like(w) for n, w in weights.items()},
            chunk_start={n: w.clone() for n, w in weights.items()},
            position=torch.zeros(batch, dtype=torch.long, device=next(iter(init.values())).device),
        )


# --------------------------------------------------------------------------- step / reference


def _prepare(q, k, use_qk_l2norm: bool, dtype: torch.dtype):
    """``q`` and ``k`` in ``dtype``, l2-normalised when asked (on CUDA, one fused kernel each way per tensor)."""
    if not use_qk_l2norm:
        return q.to(dtype), k.to(dtype)
    return normalized_features(q, dtype=dtype), normalized_features(k, dtype=dtype)


def step_titans(
    spec: MLPMemorySpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    retention: torch.Tensor,
    momentum: torch.Tensor,
    lr: torch.Tensor,
    state: TitansState,
    *,
    chunk_size: int = 64,
    live: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, TitansState]:
    """One token per row: ``q, k, v`` ``(B, H, D)``, gates ``(B, H)``, ``live`` ``(B,)`` bool (default all).
    The read comes in ``out_dtype`` (default ``v``'s)."""
    with tf32_products(tf32_wanted(v)):
        y, state = _step_titans(spec, q, k, v, retention, momentum, lr, state, chunk_size, live, use_qk_l2norm)
    return y.to(v.dtype if out_dtype is None else out_dtype), state


def _step_titans(spec, q, k, v, retention, momentum, lr, state, chunk_size, live, use_qk_l2norm):
    dtype = torch.promote_types(v.dtype, torch.float32)
    q, k = _prepare(q, k, use_qk_l2norm, dtype)
    v = v.to(dtype)
    B = q.shape[0]
    live = torch.ones(B, dtype=torch.bool, device=q.device) if live is None else live.bool()
    first = state.position == 0
    start = {n: torch.where(first[:, None, None, None], state.weights[n], state.chunk_start[n]) for n in state.weights}
    factors = grad_factors(spec, start, k[:, :, None], v[:, :, None])
    gates = tuple(x.to(dtype) for x in (retention, momentum, lr))
    memory = [*state.weights.values(), *state.momentum.values(), *state.chunk_start.values()]
    kernel = all(t.dtype == torch.float32 for t in (*memory, *gates))
    what = lambda: f"a Titans step of {memory[0].dtype} memories and {gates[0].dtype} gates"  # noqa: E731
    if resolve_backend(q, has_triton_impl=kernel, what=what) == "triton":
        from .titans_triton_update import step_update as update
    else:
        update = step_update
    weights, momenta, chunk_start = {}, {}, {}
    for n, (A, Bf) in factors.items():
        weights[n], momenta[n], chunk_start[n] = update(
            state.weights[n], state.momentum[n], state.chunk_start[n], A[:, :, 0], Bf[:, :, 0], *gates, live, first)
    y = memory_apply(spec, static_apply(weights), q[:, :, None])[:, :, 0]
    position = torch.where(live, (state.position + 1) % chunk_size, state.position)
    return y, TitansState(weights, momenta, chunk_start, position)


def step_update(W: torch.Tensor, S: torch.Tensor, C: torch.Tensor, A: torch.Tensor, Bf: torch.Tensor,
                retention: torch.Tensor, momentum: torch.Tensor, lr: torch.Tensor, live: torch.Tensor,
                at_start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A one-token step's weights, momenta and chunk-start weights (``(B, H, M, N)``) from the token's
    rank-1 gradient ``A B^T`` (``A (B, H, M)``, ``Bf (B, H, N)``) and gates ``(B, H)``: on ``live``
    rows :func:`titans_update`; rows ``at_start`` of an inner chunk store ``W`` as its start.
    (:mod:`.titans_triton_update` does the same in one pass.)"""
    on = live[:, None, None, None]
    new_w, new_s = titans_update(W, S, A, Bf, retention, momentum, lr)
    return torch.where(on, new_w, W), torch.where(on, new_s, S), torch.where(on & at_start[:, None, None, None], W, C)


def titans_update(W: torch.Tensor, S: torch.Tensor, A: torch.Tensor, Bf: torch.Tensor, retention: torch.Tensor,
                  momentum: torch.Tensor, lr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's write of one weight matrix, Titans' rule: ``S' = momentum S - lr A B^T`` and
    ``W' = retention W + S'`` for weights and momenta ``(..., M, N)``, the token's rank-1 gradient
    ``A (..., M)``, ``Bf (..., N)`` and gates ``(...)``. The one definition the reference, the step
    and Memory Caching's reference use."""
    new_s = momentum[..., None, None] * S - lr[..., None, None] * (A[..., :, None] * Bf[..., None, :])
    return retention[..., None, None] * W + new_s, new_s


def reference_titans(
    spec: MLPMemorySpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    retention: torch.Tensor,
    momentum: torch.Tensor,
    lr: torch.Tensor,
    init: dict[str, torch.Tensor],
    *,
    chunk_size: int = 64,
    lengths: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """Token-by-token definition from the initial weights, one row at a time; ``o`` is 0 past ``lengths``."""
    B, T, H, _ = q.shape
    dtype = torch.promote_types(v.dtype, torch.float32)
    o = torch.zeros(B, T, H, v.shape[-1], dtype=dtype, device=v.device)
    for b in range(B):
        n = T if lengths is None else int(lengths[b])
        W = {name: w.to(dtype).clone() for name, w in init.items()}
        S = {name: torch.zeros_like(w) for name, w in W.items()}
        for t in range(n):
            if t % chunk_size == 0:
                W0 = {name: w.clone() for name, w in W.items()}
            qt, kt = q[b, t].to(dtype), k[b, t].to(dtype)
            if use_qk_l2norm:
                qt, kt = l2_normalize(qt), l2_normalize(kt)
            factors = grad_factors(spec, W0, kt[:, None], v[b, t].to(dtype)[:, None])
            for name, (A, Bf) in factors.items():
                W[name], S[name] = titans_update(W[name], S[name], A[:, 0], Bf[:, 0], retention[b, t], momentum[b, t],
                                                 lr[b, t])
            o[b, t] = memory_apply(spec, static_apply(W), qt[:, None])[:, 0]
    return o.to(v.dtype)


# --------------------------------------------------------------------------- chunked


def titans_gates(retention, momentum, lr, live) -> dict[str, torch.Tensor]:
    """Titans' chunk gates in :func:`chunk_coefficients`' terms (gates ``(B, H, C)``, ``live (B, C)``):
    a slot that is not live neither decays nor writes."""
    lv = live[:, None, :]
    one, zero = torch.ones_like(retention), torch.zeros_like(retention)
    return dict(band=torch.diag_embed(torch.where(lv, one, zero)), dM=torch.where(lv, retention, one),
                gm=torch.where(lv, one, zero), dS=torch.where(lv, momentum, one), gs=torch.where(lv, -lr, zero))


def titans_coefficients(retention, momentum, lr, live) -> tuple[torch.Tensor, ...]:
    """The coefficients :func:`~.titans_chunk.chunk_memory` takes, for many chunks at once: gates
    ``(n, B, H, C)`` and ``live (n, B, C)`` (chunk first) give ``a, b (n, B, H, C)``,
    ``c (n, B, H, C, C)``, ``sa_last (n, B, H)`` and ``sc_last (n, B, H, C)``.

    Computed before the chunk loop, as one batch of small ops rather than a few dozen per chunk,
    and fed to the loop as per-chunk inputs (their gradients flow back through these ops)."""
    n, B = retention.shape[:2]
    flat = lambda x: x.reshape(n * B, *x.shape[2:])  # noqa: E731
    a, b, c, sa, sc = chunk_coefficients(**titans_gates(flat(retention), flat(momentum), flat(lr), flat(live)))
    return tuple(x.reshape(n, B, *x.shape[1:]) for x in (a, b, c, sa[..., -1], sc[..., -1, :]))


def titans_chunk_operator(spec, W0, S0, grad_weights, k, v, retention, momentum, lr, live) -> ChunkOperator:
    """One inner chunk (``(B, H, C, .)`` inputs, gates ``(B, H, C)``, ``live (B, C)``): its operator."""
    return ChunkOperator(W0, S0, grad_factors(spec, grad_weights, k, v), **titans_gates(retention, momentum, lr, live))


class TitansChunk(NamedTuple):
    """The per-chunk inputs of :func:`_titans_step`, each chunk-first ``(n, B, H, C, ...)``
    (``live (n, B, C)``, ``stops (n, B)``); :func:`~.chunk_loop.run_chunks` slices them chunk by
    chunk. The fused path appends the chunks' :func:`titans_coefficients` after these fields."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    retention: torch.Tensor
    momentum: torch.Tensor
    lr: torch.Tensor
    live: torch.Tensor
    stops: torch.Tensor


def _titans_step(spec: MLPMemorySpec, track_start: bool, fused: bool, carry, x, consts):
    """One inner chunk as a :func:`~.chunk_loop.run_chunks` step.

    ``carry`` is the weights, momenta and (``track_start``) chunk-start weights in
    ``spec.shapes`` order; ``x`` the chunk's ``q, k, v, retention, momentum, lr`` ``(B, H, C, .)``,
    ``live (B, C)``, ``stops (B,)`` (rows whose last token falls inside the chunk) and, ``fused``,
    the chunk's :func:`titans_coefficients`; ``consts`` is empty or ``(use_stored (B,), *stored_chunk_start)`` for the chunk where
    resumed rows take their gradients at the stored chunk-start weights. ``fused``: the chunks
    whose gradients are taken at the carried weights run through
    :func:`~.titans_chunk.chunk_memory` (its hand-written backward), the others through
    :class:`ChunkOperator` under autograd.
    """
    names = list(spec.shapes)
    m = len(names)
    W, S = dict(zip(names, carry[:m])), dict(zip(names, carry[m:2 * m]))
    q, k, v, retention, momentum, lr, live, stops = TitansChunk(*x[:len(TitansChunk._fields)])
    if fused and not consts:
        y, W_new, S_new = chunk_memory(spec, W, S, q, k, v, *x[len(TitansChunk._fields):])
        grad_w = W
    else:
        grad_w = resumed_grad_weights(W, consts[0], consts[1:]) if consts else W
        op = titans_chunk_operator(spec, W, S, grad_w, k, v, retention, momentum, lr, live)
        y = memory_apply(spec, op, q)
        W_new, S_new = op.final()
    new_carry = tuple(W_new[n] for n in names) + tuple(S_new[n] for n in names)
    if track_start:
        new_carry += next_chunk_start(stops, grad_w, carry[2 * m:])
    return (y,), new_carry


def chunk_titans(
    spec: MLPMemorySpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    retention: torch.Tensor,
    momentum: torch.Tensor,
    lr: torch.Tensor,
    state: TitansState,
    *,
    chunk_size: int = 64,
    lengths: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    checkpoint_every: int | None = None,
) -> tuple[torch.Tensor, TitansState]:
    """Chunked Titans over ``T`` new tokens per row (compacted, ``lengths`` valid), continuing ``state``.

    Each row is shifted by its position in the current inner chunk so that every
    row's chunk grid lines up; the slots before a row's first token are no-ops and
    the chunk holding it takes its gradients at the stored chunk-start weights.
    The chunks run through :func:`~.chunk_loop.run_chunks` (``checkpoint_every``:
    its checkpoint spacing for the backward).
    """
    resolve_backend(q, has_triton_impl=fused_chunks(), what=f"Titans' chunks {AUTOGRAD_PATH}")
    B, T, H, _ = q.shape
    C = chunk_size
    dtype = torch.promote_types(v.dtype, torch.float32)
    q, k = _prepare(q, k, use_qk_l2norm, dtype)
    lengths = torch.full((B,), T, dtype=torch.long, device=q.device) if lengths is None else lengths
    shift = state.position
    end = shift + lengths
    total = -(-int(end.max()) // C) * C if B else 0
    total = max(total, C)
    n = total // C
    per_token = {}
    for name, x in (("q", q), ("k", k), ("v", v), ("retention", retention), ("momentum", momentum), ("lr", lr)):
        buf, live, slot = align_rows(x.to(dtype), shift, lengths, total)
        # (n, B, H, C, ...), contiguous here so that the aligned buffer is freed (run_chunks would copy it)
        per_token[name] = chunks_first(buf.transpose(1, 2), C).contiguous()
    live_chunks = live.reshape(B, n, C).movedim(1, 0)
    starts = torch.arange(n, device=q.device)[:, None] * C
    stops = (end[None] > starts) & (end[None] < starts + C)  # (n, B): rows whose last token is inside
    chunks = TitansChunk(**per_token, live=live_chunks, stops=stops)
    names = list(spec.shapes)
    # Only rows that stop inside a chunk change their chunk-start weights; with none (whole chunks,
    # the training case) the carry leaves them out.
    track_start = bool(stops.any())
    carry = tuple(state.weights[n_].to(dtype) for n_ in names) + tuple(state.momentum[n_].to(dtype) for n_ in names)
    stored = tuple(state.chunk_start[n_].to(dtype) for n_ in names)
    if track_start:
        carry += stored
    on_boundaries = not bool(state.position.any())
    tensors = [q, k, v, retention, momentum, lr, *carry]
    if persistent_wanted(spec, C, on_boundaries, tensors, tf32_wanted(v), B * H, track_start):
        # On Triton without gradients (with them only where the module asks): every chunk in one launch.
        coefficients = titans_coefficients(chunks.retention, chunks.momentum, chunks.lr, chunks.live)
        o, carry = persistent_chunks(spec, carry, chunks.q, chunks.k, chunks.v, coefficients, stops, track_start,
                                     tf32_wanted(v), checkpoint_every)
    else:
        xs = list(chunks)
        fused = fused_chunks()
        if fused:
            xs += titans_coefficients(chunks.retention, chunks.momentum, chunks.lr, chunks.live)
        step = partial(_titans_step, spec, track_start, fused)
        # Training: the forward pass in one launch where the kernel applies, the backward chunk by chunk.
        first = (partial(loop_first_pass, spec) if fused and first_pass_wanted(
            spec, C, on_boundaries, tensors, tf32_wanted(v), B * H, track_start) else None)
        o, carry = run_resumable_chunks(lambda _with_stored: step, carry, xs, (), state.position > 0, stored,
                                        checkpoint_every=checkpoint_every, tf32=tf32_wanted(v), first_pass=first)
    o = chunks_last(o).transpose(1, 2)  # (B, total, H, d_v)
    m = len(names)
    W, S = dict(zip(names, carry[:m])), dict(zip(names, carry[m:2 * m]))
    chunk_start = dict(zip(names, carry[2 * m:])) if track_start else dict(zip(names, stored))
    gather = slot.clamp(max=total - 1)
    o = o.gather(1, gather.view(B, T, 1, 1).expand(B, T, H, o.shape[-1]))
    o = o * (torch.arange(T, device=q.device)[None] < lengths[:, None])[..., None, None]
    new_position = end % C
    return o.to(v.dtype), TitansState(W, S, chunk_start, new_position)
