"""The Atlas memory: the Omega rule over a sliding window, with GD, momentum or Muon (docs/semantics.md).

Per head, the memory is the MLP of :class:`~.mlp_memory.MLPMemorySpec` (objective
``l2`` or ``dot``) acting on feature-mapped keys and queries (the layer applies
the feature map). Token ``t`` of an inner chunk that starts from memory ``M^(s)``
takes the window gradient::

    g_t = sum_{i = t-c+1 .. t} gamma_i grad l(M^(s); k_i, v_i)

(window tokens before the chunk are re-evaluated at ``M^(s)``) and the inner optimiser:

- ``gd``:       ``M_t = retention_t M_{t-1} - lr_t g_t``
- ``momentum``: ``S_t = momentum_t S_{t-1} + g_t``,  ``M_t = retention_t M_{t-1} - lr_t S_t``
- ``muon``:     as momentum, with ``NS_k(S_t)`` (Newton-Schulz, per weight matrix
  and per token) in place of ``S_t``.

``y_t = M_t(q_t)``. ``gd`` and ``momentum`` are linear in the gradients, so the
chunked path applies every token's weights through rank-1 factors without
materialising them; ``muon`` is not: every token of a chunk has its own momentum and
update (the paper's algorithm), which :class:`MuonChunk` forms inside the Newton-Schulz
kernels where they take it, and in memory otherwise, and reads without forming its weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch

from .backend import requested_backend, resolve_backend
from .chunk_loop import tf32_products, tf32_wanted
from .mlp_memory import (
    ChunkOperator,
    MLPMemorySpec,
    segment_products,
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
from .titans_chunk import AUTOGRAD_PATH, chunk_memory
from .titans_persistent_triton import first_pass_wanted, loop_first_pass
from .titans_chunk import wanted as fused_chunks

__all__ = [
    "AtlasState",
    "NS_COEFFICIENTS",
    "OPTIMIZERS",
    "chunk_atlas",
    "newton_schulz",
    "newton_schulz_together",
    "reference_atlas",
    "step_atlas",
    "triton_wanted",
    "wide",
]


OPTIMIZERS = ("gd", "momentum", "muon")


@dataclass
class AtlasState:
    """Memory of every row: weights, momenta (``None`` for ``gd``), the weights the current
    inner chunk started from, the position in it, and the last ``c - 1`` tokens (window)."""

    weights: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor] | None
    chunk_start: dict[str, torch.Tensor]
    position: torch.Tensor  # (B,)
    window_k: torch.Tensor  # (B, c - 1, H, d_k), oldest first, right-aligned
    window_v: torch.Tensor  # (B, c - 1, H, d_v)
    window_gamma: torch.Tensor  # (B, c - 1, H)
    window_count: torch.Tensor  # (B,) valid entries (the last ones)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = dict(position=self.position, window_k=self.window_k, window_v=self.window_v,
                   window_gamma=self.window_gamma, window_count=self.window_count)
        for group in ("weights", "momentum", "chunk_start"):
            for n, t in (getattr(self, group) or {}).items():
                out[f"{group}.{n}"] = t
        return out

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> "AtlasState":
        groups: dict[str, dict] = {"weights": {}, "momentum": {}, "chunk_start": {}}
        for key, value in t.items():
            if "." in key:
                group, name = key.split(".", 1)
                groups[group][name] = value
        return cls(position=t["position"], window_k=t["window_k"], window_v=t["window_v"],
                   window_gamma=t["window_gamma"], window_count=t["window_count"],
                   weights=groups["weights"], momentum=groups["momentum"] or None, chunk_start=groups["chunk_start"])

    @classmethod
    def initial(cls, spec: MLPMemorySpec, init: dict[str, torch.Tensor], batch: int, heads: int, window: int,
                optimizer: str) -> "AtlasState":
        ref = next(iter(init.values()))
        dtype = torch.promote_types(ref.dtype, torch.float32)
        weights = {n: w.to(dtype).expand(batch, *w.shape).clone() for n, w in init.items()}
        return cls(
            weights=weights,
            momentum=None if optimizer == "gd" else {n: torch.zeros_like(w) for n, w in weights.items()},
            chunk_start={n: w.clone() for n, w in weights.items()},
            position=torch.zeros(batch, dtype=torch.long, device=ref.device),
            window_k=ref.new_zeros(batch, window - 1, heads, spec.d_k, dtype=dtype),
            window_v=ref.new_zeros(batch, window - 1, heads, spec.d_v, dtype=dtype),
            window_gamma=ref.new_zeros(batch, window - 1, heads, dtype=dtype),
            window_count=torch.zeros(batch, dtype=torch.long, device=ref.device),
        )


def _update(optimizer: str, ns_steps: int, W, S, g, retention, lr, momentum):
    """One optimiser step on dicts of ``(..., out, in)`` matrices; gates broadcast ``(..., 1, 1)``."""
    if optimizer == "gd":
        return {n: retention * W[n] - lr * g[n] for n in W}, S
    S = {n: momentum * S[n] + g[n] for n in W}
    step = dict(zip(W, newton_schulz_together([S[n] for n in W], ns_steps))) if optimizer == "muon" else S
    return {n: retention * W[n] - lr * step[n] for n in W}, S


# --------------------------------------------------------------------------- reference


def reference_atlas(
    spec: MLPMemorySpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    retention: torch.Tensor,
    lr: torch.Tensor,
    momentum: torch.Tensor | None,
    gamma: torch.Tensor,
    init: dict[str, torch.Tensor],
    *,
    optimizer: str = "muon",
    omega_window: int = 16,
    chunk_size: int = 64,
    ns_steps: int = 5,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token by token from the initial weights, one row at a time (inputs already feature-mapped)."""
    B, T, H, _ = q.shape
    dtype = torch.promote_types(v.dtype, torch.float32)
    o = torch.zeros(B, T, H, v.shape[-1], dtype=dtype, device=v.device)
    for b in range(B):
        n_tokens = T if lengths is None else int(lengths[b])
        W = {n: w.to(dtype).clone() for n, w in init.items()}
        S = {n: torch.zeros_like(w) for n, w in W.items()}
        for t in range(n_tokens):
            if t % chunk_size == 0:
                W0 = {n: w.clone() for n, w in W.items()}
            g = {n: torch.zeros_like(w) for n, w in W.items()}
            for i in range(max(0, t - omega_window + 1), t + 1):
                factors = grad_factors(spec, W0, k[b, i].to(dtype)[:, None], v[b, i].to(dtype)[:, None])
                for n, (A, Bf) in factors.items():
                    g[n] = g[n] + gamma[b, i].to(dtype)[:, None, None] * (A[:, 0, :, None] * Bf[:, 0, None, :])
            mom = None if momentum is None else momentum[b, t].to(dtype)[:, None, None]
            W, S = _update(optimizer, ns_steps, W, S, g, retention[b, t].to(dtype)[:, None, None],
                           lr[b, t].to(dtype)[:, None, None], mom)
            o[b, t] = memory_apply(spec, static_apply(W), q[b, t].to(dtype)[:, None])[:, 0]
    return o.to(v.dtype)


# --------------------------------------------------------------------------- step


def step_atlas(
    spec: MLPMemorySpec,
    q, k, v, retention, lr, momentum, gamma,
    state: AtlasState,
    *,
    optimizer: str = "muon",
    omega_window: int = 16,
    chunk_size: int = 64,
    ns_steps: int = 5,
    live: torch.Tensor | None = None,
) -> tuple[torch.Tensor, AtlasState]:
    """One token per row (``q, k, v`` ``(B, H, D)``, gates ``(B, H)``); rows not ``live`` are untouched."""
    with tf32_products(tf32_wanted(v)):
        return _step_atlas(spec, q, k, v, retention, lr, momentum, gamma, state, optimizer=optimizer,
                           omega_window=omega_window, chunk_size=chunk_size, ns_steps=ns_steps, live=live)


def _step_atlas(spec, q, k, v, retention, lr, momentum, gamma, state, *, optimizer, omega_window, chunk_size, ns_steps,
                live):
    B = q.shape[0]
    dtype = torch.promote_types(v.dtype, torch.float32)
    live = torch.ones(B, dtype=torch.bool, device=q.device) if live is None else live.bool()
    c = omega_window
    at_start = (state.position == 0)[:, None, None, None]
    start = {n: torch.where(at_start, state.weights[n], state.chunk_start[n]) for n in state.weights}
    wk = torch.cat([state.window_k, k.to(dtype)[:, None]], 1)  # (B, c, H, d_k)
    wv = torch.cat([state.window_v, v.to(dtype)[:, None]], 1)
    valid = torch.arange(c, device=q.device)[None] >= (c - 1 - state.window_count)[:, None]
    wg = torch.cat([state.window_gamma, gamma.to(dtype)[:, None]], 1) * valid[..., None]
    factors = grad_factors(spec, start, wk.transpose(1, 2), wv.transpose(1, 2))  # (B, H, c, .)
    g = {n: torch.einsum("bhc,bhco,bhci->bhoi", wg.transpose(1, 2), A, Bf) for n, (A, Bf) in factors.items()}
    if optimizer == "muon" and _fused_muon_step(state, (q, k, v, retention, lr, momentum, gamma)):
        from .atlas_triton import muon_step_triton  # noqa: PLC0415

        W, S, C = muon_step_triton(state.weights, state.momentum, state.chunk_start, g, retention, lr, momentum, live,
                                   state.position == 0, ns_steps, NS_COEFFICIENTS)
    else:
        mom = None if momentum is None else momentum.to(dtype)[..., None, None]
        W, S = _update(optimizer, ns_steps, state.weights, state.momentum, g, retention.to(dtype)[..., None, None],
                       lr.to(dtype)[..., None, None], mom)
        on = live[:, None, None, None]
        W = {n: torch.where(on, W[n], state.weights[n]) for n in W}
        if S is not None:
            S = {n: torch.where(on, S[n], state.momentum[n]) for n in S}
        C = {n: torch.where(at_start & on, state.weights[n], state.chunk_start[n]) for n in W}
    y = memory_apply(spec, static_apply(W), q.to(dtype)[:, :, None])[:, :, 0]
    shift = live[:, None, None]
    new_state = AtlasState(
        weights=W,
        momentum=S,
        chunk_start=C,
        position=torch.where(live, (state.position + 1) % chunk_size, state.position),
        window_k=torch.where(shift[..., None], wk[:, 1:], state.window_k),
        window_v=torch.where(shift[..., None], wv[:, 1:], state.window_v),
        window_gamma=torch.where(shift, wg[:, 1:], state.window_gamma),
        window_count=torch.where(live, (state.window_count + 1).clamp(max=c - 1), state.window_count),
    )
    return y.to(v.dtype), new_state


def _fused_muon_step(state: AtlasState, inputs: Sequence[torch.Tensor]) -> bool:
    """Whether a Muon decode step takes :func:`~.atlas_triton.muon_step_triton`: float32 memory
    whose momenta the Newton-Schulz kernels take, and no gradient wanted (the kernel has no backward:
    steps under autograd keep the PyTorch path)."""
    memory = [*state.weights.values(), *state.momentum.values(), *state.chunk_start.values()]
    if any(t.dtype != torch.float32 for t in memory) or (
            torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (*memory, *inputs))):
        return False
    return all(triton_wanted(wide(w)) for w in state.weights.values())


# --------------------------------------------------------------------------- chunked


class MuonChunk:
    """Muon's chunk: every token's update ``N_t = NS(S_t)`` materialised (Newton-Schulz is not linear in the
    gradients), its momentum ``S_t`` only where the Triton kernels do not form it themselves
    (:func:`momentum_kernels_wanted`), its weights ``W_t = a_t W0 + sum_m X[t, m] N_m`` never.

    A read ``W_t x_t`` is ``a_t W0 x_t + sum_m X[t, m] (N_m x_t)``: one product of the chunk's inputs with every
    token's update, ``P[t, m] = N_m x_t`` (``C x C`` vectors), then each token's gated sum over ``m``. That is as
    many FLOPs as forming the weights (``X`` times the stacked updates) and reading them, without a
    ``(C, d_out, d_in)`` tensor of weights written, scaled, summed and read again, nor its gradient."""

    def __init__(self, W0, S0, factors, band, dM, gm, dS, ns_steps):
        helper = ChunkOperator(W0, S0, factors, band, dM, torch.ones_like(gm), dS, torch.ones_like(gm))
        self.a, self.W0 = helper.a, W0
        self.X = segment_products(dM.clamp(min=1e-30).log()) * gm[..., None, :]  # (B, H, C, C)
        self.updates = {}
        self.momenta = {}  # the last token's, the chunk's final momentum
        for n, (A, Bf) in factors.items():
            if ns_steps >= 1 and momentum_kernels_wanted(S0[n]):
                self.updates[n] = _MomentumNewtonSchulz.apply(A, Bf, helper.sc, helper.sa, S0[n], ns_steps, 1e-7)
                self.momenta[n] = helper.final_momentum(n)
                continue
            # One pass for the decayed start (not in place: the product's output is a view, whose in-place
            # update autograd would undo in the backward with copies of every token's momentum).
            S_t = torch.addcmul(torch.einsum("bhtk,bhko,bhki->bhtoi", helper.sc, A, Bf), helper.sa[..., None, None],
                                S0[n][:, :, None])
            self.updates[n] = newton_schulz(S_t, ns_steps)
            self.momenta[n] = S_t[:, :, -1]

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """``W_t x_t`` for every token ``t`` of the chunk; ``x`` ``(B, H, C, d_in)``."""
        N = self.updates[name]
        B, H, C, d_out, d_in = N.shape
        P = x @ N.reshape(B, H, C * d_out, d_in).transpose(-1, -2)  # (B, H, C_t, C_m * d_out): N_m x_t
        read = (self.X.unsqueeze(-2) @ P.view(B, H, C, C, d_out)).squeeze(-2)
        return read + self.a[..., None] * (x @ self.W0[name].transpose(-1, -2))

    def final(self):
        weights = {n: self.a[..., -1, None, None] * self.W0[n] + torch.einsum("bhm,bhmoi->bhoi", self.X[..., -1, :], N)
                   for n, N in self.updates.items()}
        return weights, self.momenta


def atlas_gates(optimizer: str, inside: torch.Tensor, gamma, retention, lr, mom, live) -> dict[str, torch.Tensor]:
    """The chunk operator's window band and gates (:func:`~.mlp_memory.chunk_coefficients`' arguments) for
    gates ``(R, H, C)``, the window's ``gamma (R, H, C + c - 1)``, ``live (R, C)`` and the band ``inside
    (C, C + c - 1)``; ``dS`` and ``gs`` only with a momentum. A dead token's gates are 1, 1 and 0."""
    band = inside[None, None] * gamma[:, :, None, :] * live[:, None, :, None]
    one, zero = torch.ones_like(retention), torch.zeros_like(retention)
    lvh = live[:, None, :]
    gates = dict(band=band, dM=torch.where(lvh, retention, one), gm=torch.where(lvh, -lr, zero))
    if optimizer != "gd":
        gates.update(dS=torch.where(lvh, mom, one), gs=torch.where(lvh, one, zero))
    return gates


def atlas_coefficients(optimizer: str, inside: torch.Tensor, gamma, retention, lr, mom, live) -> tuple[torch.Tensor, ...]:
    """:func:`~.titans_chunk.chunk_memory`'s coefficients for every chunk at once (chunk first: window
    ``gamma (n, B, H, C + c - 1)``, gates ``(n, B, H, C)``, ``live (n, B, C)``, the window band
    ``inside (C, C + c - 1)``): ``a, b, c, sa_last, sc_last`` (the momentum's unused for ``gd``).
    One batch of small ops before the chunk loop instead of a few dozen per chunk."""
    n, B = retention.shape[:2]
    flat = lambda x: x.reshape(n * B, *x.shape[2:])  # noqa: E731
    gates = atlas_gates(optimizer, inside, *(flat(x) for x in (gamma, retention, lr, mom, live)))
    a, b, c, sa, sc = chunk_coefficients(**gates)
    return tuple(x.reshape(n, B, *x.shape[1:]) for x in (a, b, c, sa[..., -1], sc[..., -1, :]))


class AtlasChunk(NamedTuple):
    """The per-chunk inputs of :func:`_atlas_chunk_step`, chunk-first: the chunk's queries
    ``(n, B, H, C, d_k)``, its window of keys, values and ``gamma`` (``C + c - 1`` tokens), its gates
    ``(n, B, H, C)``, ``live (n, B, C)`` and ``stops (n, B)``. The read's inputs and (fused) the
    chunks' :func:`atlas_coefficients` follow these fields."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    gamma: torch.Tensor
    retention: torch.Tensor
    lr: torch.Tensor
    momentum: torch.Tensor
    live: torch.Tensor
    stops: torch.Tensor


def _atlas_chunk_step(spec: MLPMemorySpec, optimizer: str, ns_steps: int, track_start: bool, n_extra: int,
                      fused: bool, with_stored: bool, read, carry, x, consts):
    """One inner chunk of :func:`chunk_atlas` as a :func:`~.chunk_loop.run_chunks` step.

    ``carry``: weights, (not ``gd``) momenta and (``track_start``) chunk-start weights, in
    ``spec.shapes`` order. ``x``: the chunk's ``q`` ``(B, H, C, d_k)``, its window ``k, v, gamma``
    (``C + c - 1`` tokens), ``retention, lr, momentum`` ``(B, H, C)``, ``live (B, C)``, ``stops (B,)``
    ``n_extra`` read inputs and, ``fused``, the chunk's :func:`atlas_coefficients`. ``consts``: the window band ``(C, C + c - 1)``, the read's
    constants, then (``with_stored``) ``use_stored (B,)`` and the stored chunk-start weights.
    ``fused`` (``gd`` and ``momentum`` without a read of their own): chunks whose gradients are
    taken at the carried weights run through :func:`~.titans_chunk.chunk_memory`.
    """
    names = list(spec.shapes)
    m = len(names)
    W = dict(zip(names, carry[:m]))
    S = None if optimizer == "gd" else dict(zip(names, carry[m:2 * m]))
    fields = len(AtlasChunk._fields)
    q, k, v, gamma, retention, lr, mom, lv, stops = AtlasChunk(*x[:fields])
    extra = x[fields:fields + n_extra]
    inside = consts[0]
    n_stored = m + 1 if with_stored else 0
    read_consts = consts[1:len(consts) - n_stored]
    grad_w = resumed_grad_weights(W, consts[len(consts) - n_stored], consts[len(consts) - m:]) if with_stored else W
    if fused and not with_stored:
        y, W, S = chunk_memory(spec, W, S, q, k, v, *x[fields + n_extra:])
        new_carry = tuple(W[n] for n in names) + (() if optimizer == "gd" else tuple(S[n] for n in names))
        if track_start:
            new_carry += next_chunk_start(stops, grad_w, carry[len(carry) - m:])
        return (y,), new_carry
    # The operator's band and gates, which the fused chunks take precomputed for all chunks at once
    # (atlas_coefficients): built here they were seven launches a chunk, in every pass, for nothing.
    gates = atlas_gates(optimizer, inside, gamma, retention, lr, mom, lv)
    factors = grad_factors(spec, grad_w, k, v)
    if optimizer == "muon":
        op = MuonChunk(W, S, factors, gates["band"], gates["dM"], gates["gm"], gates["dS"], ns_steps)
    else:
        op = ChunkOperator(W, None if optimizer == "gd" else S, factors, **gates)
    y = memory_apply(spec, op, q) if read is None else read(op, q, *extra, *read_consts)
    W, S = op.final()
    new_carry = tuple(W[n] for n in names)
    if optimizer != "gd":
        new_carry += tuple(S[n] for n in names)
    if track_start:
        new_carry += next_chunk_start(stops, grad_w, carry[len(carry) - m:])
    return (y,), new_carry


def _first_pass(spec: MLPMemorySpec, momentum: bool, carry, xs, _consts, every: int):
    """:func:`~.titans_persistent_triton.loop_first_pass` for the fused chunks of :func:`chunk_atlas`, whose
    one constant, the window band, their coefficients already hold."""
    return loop_first_pass(spec, carry, xs, (), every, momentum=momentum)


def chunk_atlas(
    spec: MLPMemorySpec,
    q, k, v, retention, lr, momentum, gamma,
    state: AtlasState,
    *,
    optimizer: str = "muon",
    omega_window: int = 16,
    chunk_size: int = 64,
    ns_steps: int = 5,
    lengths: torch.Tensor | None = None,
    read: Callable[..., torch.Tensor] | None = None,
    read_inputs: Sequence[torch.Tensor] = (),
    read_consts: Sequence[torch.Tensor] = (),
) -> tuple[torch.Tensor, AtlasState]:
    """``T`` new tokens per row (compacted, ``lengths`` valid), continuing ``state``.

    Rows are shifted by their position in the current inner chunk (as in
    :func:`~.titans.chunk_titans`) and each row's last ``c - 1`` tokens from the
    state sit just before its first new token, so every window is complete.

    ``read(apply, q, *inputs, *consts)``, when given, replaces each inner chunk's read
    ``memory_apply(spec, apply, q)``: ``apply`` gives every token's online weights
    (after its own write), ``q`` and ``inputs`` (per-token tensors ``(B, T, H, ...)``
    laid out like ``q``) come as the chunk's ``(B, H, C, ...)`` slices and ``consts``
    are ``read_consts`` as given. Memory Caching reads its cached memories alongside
    the online one through it. ``read`` must take every tensor it reads as an
    argument (the chunks' backward recomputes it and differentiates only its arguments).
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    fused = fused_chunks() and optimizer != "muon" and read is None
    # Muon's chunks run their Newton-Schulz, the work Muon adds, through the Triton kernels (atlas_triton.py).
    muon_kernels = optimizer == "muon" and _newton_schulz_covers(spec, q.dtype)
    resolve_backend(q, has_triton_impl=fused or muon_kernels,
                    what=f"Atlas' chunk with GD or momentum read through Memory Caching, or {AUTOGRAD_PATH}")
    B, T, H, _ = q.shape
    C, c = chunk_size, omega_window
    dtype = torch.promote_types(v.dtype, torch.float32)
    device = q.device
    lengths = torch.full((B,), T, dtype=torch.long, device=device) if lengths is None else lengths
    shift = state.position
    span = -(-int((shift + lengths).max()) // C) * C if B else 0
    span = max(span, C)
    pre = c - 1
    total = pre + span
    momentum = torch.zeros_like(retention) if momentum is None else momentum
    # new tokens at [pre + shift, pre + shift + len), the state's window right before them
    bufs, live = {}, None
    for name, x in (("q", q), ("k", k), ("v", v), ("retention", retention), ("lr", lr), ("mom", momentum),
                    ("gamma", gamma)):
        buf, live, slot = align_rows(x.to(dtype), shift + pre, lengths, total)
        bufs[name] = buf
    extra = [align_rows(x.to(dtype), shift + pre, lengths, total)[0].transpose(1, 2) for x in read_inputs]
    window_len = torch.full_like(lengths, pre)
    present = live.clone()
    for name, w in (("k", state.window_k), ("v", state.window_v), ("gamma", state.window_gamma)):
        buf, _, _ = align_rows(w.to(dtype), shift, window_len, total)
        bufs[name] = bufs[name] + buf
    win_valid = torch.arange(pre, device=device)[None] >= (pre - state.window_count)[:, None]
    win_slots = shift[:, None] + torch.arange(pre, device=device)[None]
    present = present | torch.zeros_like(present).scatter(1, win_slots, win_valid) if pre else present
    bufs = {n: b.transpose(1, 2) for n, b in bufs.items()}  # (B, H, total, ...)
    bufs["gamma"] = bufs["gamma"] * present[:, None, :]

    names = list(spec.shapes)
    m = len(names)
    end = shift + lengths
    n_chunks = span // C
    starts = torch.arange(n_chunks, device=device)[:, None] * C
    stops = (end[None] > starts) & (end[None] < starts + C)  # (n, B): rows whose last token is inside
    # Only rows that stop inside a chunk change their chunk-start weights; with none (whole chunks,
    # the training case) the carry leaves them out.
    track_start = bool(stops.any())
    stored = tuple(state.chunk_start[n].to(dtype) for n in names)
    carry = tuple(state.weights[n].to(dtype) for n in names)
    if optimizer != "gd":
        carry += tuple(state.momentum[n].to(dtype) for n in names)
    if track_start:
        carry += stored

    def own(x):  # (B, H, total, ...) -> each chunk's own tokens, (n, B, H, C, ...)
        return chunks_first(x[:, :, pre:], C)

    def windowed(x):  # each chunk's tokens with the c - 1 before them: (n, B, H, C + c - 1, ...)
        w = x.unfold(2, C + pre, C)  # (B, H, n, ..., C + pre)
        return w.movedim(-1, 3).movedim(2, 0)

    chunks = AtlasChunk(q=own(bufs["q"]), k=windowed(bufs["k"]), v=windowed(bufs["v"]), gamma=windowed(bufs["gamma"]),
                        retention=own(bufs["retention"]), lr=own(bufs["lr"]), momentum=own(bufs["mom"]),
                        live=live[:, pre:].reshape(B, n_chunks, C).movedim(1, 0), stops=stops)
    xs = [*chunks, *(own(x) for x in extra)]
    pos = torch.arange(C + pre, device=device)
    t_pos, i_pos = pos[pre:], pos
    inside = (i_pos[None, :] <= t_pos[:, None]) & (t_pos[:, None] <= i_pos[None, :] + c - 1)  # (C, C + c - 1)
    if fused:
        xs += atlas_coefficients(optimizer, inside, chunks.gamma, chunks.retention, chunks.lr, chunks.momentum,
                                 chunks.live)
    read_consts = tuple(read_consts)
    # The forward pass in one launch where the persistent kernel applies (without gradients, the whole loop);
    # in training the backward recomputes chunk by chunk from its checkpoints.
    first = (partial(_first_pass, spec, optimizer != "gd") if fused and first_pass_wanted(
        spec, C, not bool(shift.any()), [q, k, v, *carry], tf32_wanted(v), B * H, track_start, c) else None)
    # A read of cached memories brings a new closure and a cache one memory larger on every segment:
    # each call would be a new graph capture, so such chunks run uncaptured.
    o, carry = run_resumable_chunks(
        lambda with_stored: partial(_atlas_chunk_step, spec, optimizer, ns_steps, track_start, len(extra), fused,
                                    with_stored, read),
        carry, xs, (inside, *read_consts), state.position > 0, stored,
        tf32=tf32_wanted(v), graphs=False if read is not None else None, first_pass=first,
        # Muon's per-token momenta are far larger than the carry: its backward holds one chunk at a time.
        backward_unit=1 if optimizer == "muon" else None)
    o = chunks_last(o).transpose(1, 2)  # (B, span, H, d_v)
    W = dict(zip(names, carry[:m]))
    S = None if optimizer == "gd" else dict(zip(names, carry[m:2 * m]))
    k_ = 2 * m if optimizer != "gd" else m
    chunk_start = dict(zip(names, carry[k_:k_ + m])) if track_start else dict(zip(names, stored))
    o = o.gather(1, (slot - pre).clamp(0, span - 1).view(B, T, 1, 1).expand(B, T, H, o.shape[-1]))
    o = o * (torch.arange(T, device=device)[None] < lengths[:, None])[..., None, None]
    # the last c - 1 tokens of each row form the next window
    last = (pre + end)[:, None] - pre + torch.arange(pre, device=device)[None]  # buffer slots
    last_c = last.clamp(min=0, max=total - 1)

    def take(x):  # x (B, H, total, ...) -> (B, pre, H, ...)
        idx = last_c[:, None, :].expand(B, H, pre).reshape(B, H, pre, *([1] * (x.dim() - 3)))
        return x.gather(2, idx.expand(B, H, pre, *x.shape[3:])).transpose(1, 2)

    ok = present.gather(1, last_c) & (last >= 0)
    new_state = AtlasState(
        weights=W, momentum=S, chunk_start=chunk_start, position=end % C,
        window_k=take(bufs["k"]) * ok[..., None, None], window_v=take(bufs["v"]) * ok[..., None, None],
        window_gamma=take(bufs["gamma"]) * ok[..., None],
        window_count=ok.sum(1),
    )
    return o.to(v.dtype), new_state


# ------------------------------------------------------------ Muon's Newton-Schulz orthogonalisation


NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(G: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Quintic Newton-Schulz orthogonalisation of the last two dims (KellerJordan/Muon).

    The input is normalised by its Frobenius norm; tall matrices are transposed so
    that the iteration runs on the smaller Gram matrix. The iteration
    ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` keeps ``X_k = M_k X_0`` for an
    ``r x r`` matrix ``M_k`` (``r`` the short side): ``A_k = M_k G M_k^T`` with the Gram
    matrix ``G = X_0 X_0^T`` and ``M_{k+1} = a M_k + (b A_k + c A_k^2) M_k``. So it runs on
    ``r x r`` matrices from one Gram product, and the long side is touched twice (the Gram
    matrix and ``M X_0``), not three times an iteration: Muon runs this per token and
    weight matrix, where those passes were most of its time. The backward is written out
    (:class:`_NewtonSchulz`): autograd over the same products was far slower (benchmarks/RESULTS.md).
    On CUDA, matrices whose short side is at most 64 run one Triton program each, forward
    and backward (:mod:`.atlas_triton`), unless the products are exact float32.
    """
    tall = G.shape[-2] > G.shape[-1]
    X = G.transpose(-1, -2) if tall else G
    if steps == 0:
        X = X / (X.norm(dim=(-2, -1), keepdim=True) + eps)
    else:
        shape = X.shape
        flat = X.reshape(-1, *shape[-2:])
        iteration = _NewtonSchulzTriton if triton_wanted(flat) else _NewtonSchulz
        X = iteration.apply(flat, steps, eps).reshape(shape)
    return X.transpose(-1, -2) if tall else X


def wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its last two dims ordered short side first (tall matrices transposed, as a view)."""
    return x.transpose(-1, -2) if x.shape[-2] > x.shape[-1] else x


def _newton_schulz_covers(spec: MLPMemorySpec, dtype: torch.dtype) -> bool:
    """Whether the Triton kernels take the Newton-Schulz of every weight of ``spec`` in ``dtype``."""
    from .atlas_triton import supported

    return all(supported(torch.empty(0, *sorted(shape), dtype=dtype)) for shape in spec.shapes.values())


def triton_wanted(X: torch.Tensor) -> bool:
    """Whether ``(..., r, L)`` matrices (``r <= L``) take the Triton kernels: the backend switch, and their limits."""
    from .atlas_triton import faster, supported

    if resolve_backend(X, has_triton_impl=supported(X)) != "triton":
        return False
    return requested_backend() == "triton" or faster(X.dtype)


class _NewtonSchulz(torch.autograd.Function):
    """:func:`newton_schulz` on ``(n, r, L)`` matrices (``r <= L``), ``steps >= 1``, in their own dtype:
    autocast stays out, as for the memories' other products (TF32 where the caller allows it)."""

    @staticmethod
    def forward(ctx, S: torch.Tensor, steps: int, eps: float) -> torch.Tensor:
        with torch.autocast(S.device.type, enabled=False):
            return _NewtonSchulz._forward(ctx, S, steps, eps)

    @staticmethod
    def _forward(ctx, S: torch.Tensor, steps: int, eps: float) -> torch.Tensor:
        a, b, c = NS_COEFFICIENTS
        norm = S.norm(dim=(-2, -1), keepdim=True)
        X0 = S / (norm + eps)
        gram = torch.bmm(X0, X0.transpose(1, 2))
        M = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # the first step, M_0 = I: b G + c G^2, then + a I
        M.diagonal(dim1=-2, dim2=-1).add_(a)
        Ms, As, Ps = [M], [], []
        for _ in range(steps - 1):
            A = torch.bmm(M, torch.bmm(gram, M.transpose(1, 2)))
            P = torch.baddbmm(A, A, A, beta=b, alpha=c)
            M = torch.baddbmm(M, P, M, beta=a)
            Ms.append(M)
            As.append(A)
            Ps.append(P)
        ctx.save_for_backward(X0, norm, gram, *Ms, *As, *Ps)
        ctx.steps, ctx.eps = steps, eps
        return torch.bmm(M, X0)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dN: torch.Tensor):
        with torch.autocast(dN.device.type, enabled=False):
            return _NewtonSchulz._backward(ctx, dN)

    @staticmethod
    def _backward(ctx, dN: torch.Tensor):
        a, b, c = NS_COEFFICIENTS
        steps = ctx.steps
        X0, norm, gram, *rest = ctx.saved_tensors
        dN = dN.to(X0.dtype)
        Ms, As, Ps = rest[:steps], rest[steps:2 * steps - 1], rest[2 * steps - 1:]
        dM = torch.bmm(dN, X0.transpose(1, 2))
        dG = torch.zeros_like(gram)
        # A_k and P_k are symmetric (polynomials of G conjugated by M_k, which commutes with G).
        for k in range(steps - 2, -1, -1):
            M, A, P = Ms[k], As[k], Ps[k]
            dP = torch.bmm(dM, M.transpose(1, 2))
            dM = torch.baddbmm(dM, P, dM, beta=a)
            dA = torch.baddbmm(torch.baddbmm(dP, dP, A, beta=b, alpha=c), A, dP, alpha=c)
            dA_sym = dA + dA.transpose(1, 2)
            dM = torch.baddbmm(dM, dA_sym, torch.bmm(M, gram))
            dG = torch.baddbmm(dG, M.transpose(1, 2), torch.bmm(dA, M))
        # M_1 = a I + b G + c G^2
        dG = dG + b * dM + c * (torch.bmm(dM, gram) + torch.bmm(gram, dM))
        dX0 = torch.baddbmm(torch.bmm(Ms[-1].transpose(1, 2), dN), dG + dG.transpose(1, 2), X0)
        # X0 = S / (||S|| + eps): dS = (dX0 - (d / ||S||) <dX0, X0> X0) / d, d = ||S|| + eps
        d = norm + ctx.eps
        along = (dX0 * X0).sum((-2, -1), keepdim=True) * d / norm.clamp(min=torch.finfo(norm.dtype).tiny)
        return (dX0 - along * X0) / d, None, None


def newton_schulz_together(matrices: Sequence[torch.Tensor], steps: int = 5) -> list[torch.Tensor]:
    """:func:`newton_schulz` of each matrix, those of one shape (after tall ones are transposed) in one call:
    a decode step orthogonalises two small momenta per head, and each PyTorch call is some twenty
    launches (the Triton kernel is one, and takes each matrix as it is)."""
    groups: dict[tuple, list[int]] = {}
    for i, x in enumerate(matrices):
        groups.setdefault((wide(x).shape, x.dtype), []).append(i)
    out: list[torch.Tensor] = [None] * len(matrices)  # type: ignore[list-item]
    for members in groups.values():
        # The Triton kernels read strided views: a launch per matrix beats stacking them first.
        if len(members) == 1 or triton_wanted(wide(matrices[members[0]])):
            for i in members:
                out[i] = newton_schulz(matrices[i], steps)
            continue
        stacked = torch.stack([wide(matrices[i]) for i in members])
        for i, x in zip(members, newton_schulz(stacked, steps).unbind(0)):
            out[i] = x.transpose(-1, -2) if x.shape != matrices[i].shape else x
    return out


class _NewtonSchulzTriton(torch.autograd.Function):
    """:class:`_NewtonSchulz` through the Triton kernels; the products' precision is fixed at the forward."""

    @staticmethod
    def forward(ctx, S: torch.Tensor, steps: int, eps: float) -> torch.Tensor:
        from .atlas_triton import newton_schulz_forward_triton, products  # noqa: PLC0415

        ctx.products = products(S.dtype)
        N, norms, kept = newton_schulz_forward_triton(S, steps, eps, ctx.products, keep=ctx.needs_input_grad[0],
                                                      coefficients=NS_COEFFICIENTS)
        ctx.save_for_backward(S, norms, kept)
        ctx.steps, ctx.eps = steps, eps
        return N

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dN: torch.Tensor):
        from .atlas_triton import newton_schulz_backward_triton  # noqa: PLC0415

        S, norms, kept = ctx.saved_tensors
        return newton_schulz_backward_triton(S, norms, kept, dN, ctx.steps, ctx.eps, ctx.products,
                                             coefficients=NS_COEFFICIENTS), None, None


# Muon's chunk forms every token's momentum inside the Newton-Schulz kernels where they take it; off, it forms
# them in memory and orthogonalises them there (the path before, kept to compare: benchmarks/RESULTS.md).
MOMENTA_IN_KERNELS = True


def momentum_kernels_wanted(S0: torch.Tensor) -> bool:
    """Whether Muon's chunk forms its per-token momenta inside the Newton-Schulz kernels
    (:class:`_MomentumNewtonSchulz`): float32 momenta ``S0 (..., d_out, d_in)`` the kernels take."""
    return MOMENTA_IN_KERNELS and S0.dtype == torch.float32 and triton_wanted(wide(S0))


class _MomentumNewtonSchulz(torch.autograd.Function):
    """``NS(S_t)`` for every token's momentum ``S_t = sa_t S_0 + sum_k sc[t, k] A_k Bf_k^T`` of a chunk
    (``A (..., K, d_out)``, ``Bf (..., K, d_in)``, ``sc (..., T, K)``, ``sa (..., T)``, ``S0 (..., d_out, d_in)``),
    as ``(..., T, d_out, d_in)``, contiguous.

    The Triton kernels form each ``S_t`` block by block from the factors, each program its own token's, once a
    pass, into the place of its result (``N_t`` forward, ``dS_t`` backward), which then overwrites it: no tensor
    of momenta is made, cloned or kept for the backward. The backward returns ``dS_t``, from which the factors'
    gradients are a few batched products here: the momenta's clones, sums and products through autograd were
    memory traffic over the largest tensors of Muon's step (benchmarks/RESULTS.md).
    """

    @staticmethod
    def forward(ctx, A, Bf, sc, sa, S0, steps: int, eps: float):
        from .atlas_triton import MomentumFactors, momentum_newton_schulz_forward_triton, products  # noqa: PLC0415

        lead, (d_out, d_in) = S0.shape[:-2], S0.shape[-2:]
        tall = d_out > d_in
        K, T = A.shape[-2], sc.shape[-2]
        flat = lambda x: x.reshape(-1, *x.shape[len(lead):])  # noqa: E731
        # Under autocast the factors and gates arrive in its dtype: the kernels form S_t in float32 from them, and
        # the backward forms it again from the same float32 copies (the gradients go back in each input's dtype).
        A_, Bf_, S0_ = flat(A).float(), flat(Bf).float(), flat(S0)
        f = MomentumFactors(short=Bf_ if tall else A_, long=A_ if tall else Bf_, sc=flat(sc).float().contiguous(),
                            sa=flat(sa).float().contiguous(), S0=S0_.transpose(1, 2) if tall else S0_, tall=tall)
        ctx.products = products(torch.float32)
        keep = any(ctx.needs_input_grad[:5])
        N, norms, kept = momentum_newton_schulz_forward_triton(f, steps, eps, ctx.products, keep=keep,
                                                               coefficients=NS_COEFFICIENTS)
        ctx.save_for_backward(A_, Bf_, f.sc, f.sa, S0_, norms, kept)
        ctx.steps, ctx.eps, ctx.tall, ctx.lead, ctx.K = steps, eps, tall, lead, K
        return N.view(*lead, T, d_out, d_in)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dN: torch.Tensor):
        from .atlas_triton import MomentumFactors, momentum_newton_schulz_backward_triton  # noqa: PLC0415

        A, Bf, sc, sa, S0, norms, kept = ctx.saved_tensors
        tall, lead, K = ctx.tall, ctx.lead, ctx.K
        short, long = (Bf, A) if tall else (A, Bf)
        f = MomentumFactors(short=short, long=long, sc=sc, sa=sa, S0=S0.transpose(1, 2) if tall else S0, tall=tall)
        dN = dN.reshape(-1, *dN.shape[len(lead):]).to(torch.float32).contiguous()
        dS, d_sa = momentum_newton_schulz_backward_triton(f, norms, kept, dN, ctx.steps, ctx.eps, ctx.products,
                                                          coefficients=NS_COEFFICIENTS)
        n, T, r, L = dS.shape
        with torch.autocast(dS.device.type, enabled=False):
            # Z[t, :, k] = dS_t long_k: the gradients of sc[t, k] and of short_k
            Z = torch.bmm(dS.view(n, T * r, L), long.transpose(1, 2)).view(n, T, r, K)
            d_sc = (Z * short.transpose(1, 2)[:, None]).sum(2)
            d_short = (Z * sc[:, :, None, :]).sum(1).transpose(1, 2)
            # D[k] = sum_t sc[t, k] dS_t, then long_k's gradient short_k^T D[k]; S_0's is sum_t sa_t dS_t (its own
            # product: a slice of one stacked product is a copy of all of it for the next batched product)
            flat = dS.view(n, T, r * L)
            D = torch.bmm(sc.transpose(1, 2), flat).view(n, K, r, L)
            d_long = (short[:, :, None, :] @ D).squeeze(2)
            d_S0 = torch.bmm(sa[:, None, :], flat).view(n, r, L)
            d_S0 = d_S0.transpose(1, 2) if tall else d_S0
        d_A, d_Bf = (d_long, d_short) if tall else (d_short, d_long)
        unflat = lambda x: x.reshape(*lead, *x.shape[1:])  # noqa: E731
        return unflat(d_A), unflat(d_Bf), unflat(d_sc), unflat(d_sa), unflat(d_S0), None, None
