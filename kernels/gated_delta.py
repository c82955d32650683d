"""The gated delta rule: the memory of every MoM memory (docs/semantics.md).

Per head, with a state ``S`` of shape ``(d_k, d_v)`` kept in float32::

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T q_t                     (the output reads the state after the write)

``q`` and ``k`` are L2-normalised per head (``use_qk_l2norm``) and ``q`` is scaled
by ``scale`` (default ``d_k ** -0.5``). ``g`` is the log-decay (``None`` means 0:
the plain delta rule). A token with ``beta = 0`` and ``g = 0`` is an exact no-op on
the state, which is how padding is expressed.

Three entry points share one signature style, tensors laid out as
``(batch, time, heads, dim)``:

- :func:`reference_gated_delta`: the readable token-by-token definition (tests).
- :func:`chunk_gated_delta`: the chunked (WY) form for training and prefill.
- :func:`step_gated_delta`: one token per sequence, for decoding.

Variable-length batches use ``cu_seqlens`` (int64, ``N + 1`` offsets into a
packed batch of size 1), as in flash-attention; ``initial_state`` then has one
entry per sequence.
"""

from __future__ import annotations

from functools import partial

import torch

from .backend import resolve_backend
from .norms import L2_EPS, l2_normalize
from .shared_layouts import shared_per_shape

__all__ = ["reference_gated_delta", "chunk_gated_delta", "step_gated_delta", "step_gated_delta_"]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # States and accumulations are float32 at least; float64 inputs stay float64 (tests).
    return torch.promote_types(x.dtype, torch.float32)


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, scale: float | None, use_qk_l2norm: bool, dtype: torch.dtype):
    q, k = q.to(dtype), k.to(dtype)
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    return q * (q.shape[-1] ** -0.5 if scale is None else scale), k


def _prepare_sequence_inputs(q, k, v, g, beta, scale, use_qk_l2norm):
    """Normalised, scaled, compute-dtype inputs with ``g`` materialised; plus the output dtype."""
    out_dtype = v.dtype
    dtype = _compute_dtype(v)
    q, k = _prepare_qk(q, k, scale, use_qk_l2norm, dtype)
    v, beta = v.to(dtype), beta.to(dtype)
    g = torch.zeros_like(beta) if g is None else g.to(dtype)
    return q, k, v, g, beta, out_dtype


def _check_shapes(q, k, v, g, beta, initial_state, cu_seqlens):
    if q.dim() != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"expected q, k of shape (batch, time, heads, d_k) and v of shape (batch, time, heads, d_v); "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if beta.shape != q.shape[:3] or (g is not None and g.shape != q.shape[:3]):
        raise ValueError(f"g and beta must have shape {tuple(q.shape[:3])} (batch, time, heads)")
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError("with cu_seqlens the batch must be packed into a batch of size 1")
    n = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    expected = (n, q.shape[2], q.shape[3], v.shape[3])
    if initial_state is not None and tuple(initial_state.shape) != expected:
        raise ValueError(f"initial_state must have shape {expected}, got {tuple(initial_state.shape)}")
    return n


# --------------------------------------------------------------------------- reference


def gated_delta_write(S: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
                      beta: torch.Tensor) -> torch.Tensor:
    """One token's write into states ``S (..., d_k, d_v)``, the gated delta rule:
    ``S' = exp(g) S + beta k (v - (exp(g) S)^T k)^T`` for ``k (..., d_k)``, ``v (..., d_v)`` and gates
    ``g`` (log-decay; ``None``: no decay), ``beta`` ``(...)``. The reference and the step both write
    through it."""
    if g is not None:
        S = S * g.exp()[..., None, None]
    residual = v - torch.einsum("...kv,...k->...v", S, k)
    return S + k[..., :, None] * (beta[..., None] * residual)[..., None, :]


def reference_gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule; returns ``(o, final_state)``."""
    n = _check_shapes(q, k, v, g, beta, initial_state, cu_seqlens)
    q, k, v, g, beta, out_dtype = _prepare_sequence_inputs(q, k, v, g, beta, scale, use_qk_l2norm)
    dtype = q.dtype
    B, T, H, K = q.shape
    V = v.shape[-1]
    if cu_seqlens is None:
        bounds = [(b, 0, T) for b in range(B)]
    else:
        offs = cu_seqlens.tolist()
        bounds = [(0, offs[i], offs[i + 1]) for i in range(n)]
    o = torch.zeros(B, T, H, V, dtype=dtype, device=v.device)
    finals = []
    for i, (b, start, end) in enumerate(bounds):
        S = q.new_zeros(H, K, V) if initial_state is None else initial_state[i].to(dtype)
        for t in range(start, end):
            S = gated_delta_write(S, k[b, t], v[b, t], g[b, t], beta[b, t])
            o[b, t] = torch.einsum("hkv,hk->hv", S, q[b, t])
        finals.append(S)
    return o.to(out_dtype), torch.stack(finals)


# --------------------------------------------------------------------------- step


def step_gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: ``q, k`` ``(N, H, d_k)``, ``v`` ``(N, H, d_v)``, ``g, beta`` ``(N, H)``,
    ``state`` ``(N, H, d_k, d_v)``. Returns ``(o, new_state)``; ``state`` is not modified."""
    out_dtype = v.dtype
    if state.dtype != torch.float64 and resolve_backend(q, has_triton_impl=_triton_covers(q, v, 16),
                                                        what=partial(_uncovered, q, v, 16)) == "triton":
        from .gated_delta_triton import step

        K = q.shape[-1]
        o, new_state = step(q, k, v, g, beta, state, K**-0.5 if scale is None else scale, use_qk_l2norm, L2_EPS)
        return o.to(out_dtype), new_state
    dtype = torch.promote_types(_compute_dtype(v), state.dtype)
    q, k = _prepare_qk(q, k, scale, use_qk_l2norm, dtype)
    v, beta = v.to(dtype), beta.to(dtype)
    S = gated_delta_write(state.to(dtype), k, v, None if g is None else g.to(dtype), beta)
    o = torch.einsum("nhkv,nhk->nhv", S, q)
    return o.to(out_dtype), S


def step_gated_delta_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """:func:`step_gated_delta` on ``states[slots]``, written back in place.

    ``states`` ``(P, H, d_k, d_v)`` holds every state (MoM: every row's every memory) and ``slots``
    ``(N,)`` picks, without repeats, the one each of the ``N`` sequences steps; the others are left
    as they are. Returns ``o`` ``(N, H, d_v)``. Saves gathering the stepped states and scattering
    them back into a copy, which dominate a routed decode step at larger batches.
    """
    out_dtype = v.dtype
    if (states.dtype == torch.float32 and states.is_contiguous()
            and resolve_backend(q, has_triton_impl=_triton_covers(q, v, 16),
                                what=partial(_uncovered, q, v, 16)) == "triton"):
        from .gated_delta_triton import step

        K = q.shape[-1]
        o, _ = step(q, k, v, g, beta, states, K**-0.5 if scale is None else scale, use_qk_l2norm, L2_EPS,
                    slots=slots)
        return o.to(out_dtype)
    o, new = step_gated_delta(q, k, v, g, beta, states[slots], scale=scale, use_qk_l2norm=use_qk_l2norm)
    states.index_copy_(0, slots, new.to(states.dtype))
    return o


# --------------------------------------------------------------------------- chunked


def intra_chunk_terms(q, k, v, g, beta):
    """Everything about a chunk that does not depend on the state entering it.

    ``q, k, v`` are ``(..., C, D)`` and ``g, beta`` ``(..., C)``, one chunk per
    leading index. Within a chunk with cumulative log-decay ``G`` the state after
    token ``t`` is ``S_t = e^{G_t} S_0 + sum_{j<=t} e^{G_t - G_j} k_j d_j^T``, where
    the effective writes ``d = beta * (v - ...)`` solve the unit lower-triangular
    system ``(I + A) D = beta V - diag(beta e^G) K S_0`` with
    ``A_ij = beta_i e^{G_i - G_j} k_i.k_j`` for ``j < i``. Returns the pieces of
    the chunk-to-chunk recurrence (the loop of :func:`_chunk_dense`)::

        D   = U - W S             (the chunk's writes, given its entering state S)
        O   = Q_decayed S + P D   (its outputs)
        S'  = gamma S + K_decayed^T D

    as ``(U, W, P, Q_decayed, K_decayed, gamma)``; ``gamma`` has shape ``(...)``.
    """
    C = q.shape[-2]
    G = g.cumsum(-1)
    idx = torch.arange(C, device=q.device)
    causal = idx[:, None] >= idx[None, :]
    # exp of masked differences, never of a positive number: stable for any decay.
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    strict = decay.masked_fill(torch.eye(C, dtype=torch.bool, device=q.device), 0.0)
    A = (k @ k.transpose(-1, -2)) * strict * beta[..., :, None]
    V = v.shape[-1]
    rhs = torch.cat([beta[..., None] * v, (beta * G.exp())[..., None] * k], dim=-1)
    # unitriangular: the solver takes the diagonal of A as ones.
    UW = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
    P = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * G.exp()[..., None]
    k_decayed = k * (G[..., -1:] - G).exp()[..., None]
    return UW[..., :V], UW[..., V:], P, q_decayed, k_decayed, G[..., -1].exp()


def _chunk_dense(q, k, v, g, beta, S, chunk_size: int):
    """Chunked WY form on dense ``(N, H, T, D)`` tensors, ``T`` a multiple of ``chunk_size``.

    The intra-chunk terms (:func:`intra_chunk_terms`) are batched over all chunks
    at once; only the carry of ``S`` across chunks is a loop.
    """
    N, H, T, K = k.shape
    V = v.shape[-1]
    C = chunk_size
    n = T // C
    q, k, v = (x.reshape(N, H, n, C, x.shape[-1]) for x in (q, k, v))
    U, W, P, q_decayed, k_decayed, chunk_decay = intra_chunk_terms(q, k, v, g.reshape(N, H, n, C), beta.reshape(N, H, n, C))
    chunk_decay = chunk_decay[..., None, None]

    # Chunk-major copies so that the sequential carry reads contiguous blocks.
    # unbind (not indexing) keeps the backward linear in the number of chunks.
    U, W, P, q_decayed, k_decayed, chunk_decay = (
        x.movedim(2, 0).contiguous().unbind(0) for x in (U, W, P, q_decayed, k_decayed, chunk_decay)
    )
    outputs = []
    for c in range(n):
        D = U[c] - W[c] @ S
        outputs.append(q_decayed[c] @ S + P[c] @ D)
        S = chunk_decay[c] * S + k_decayed[c].transpose(-1, -2) @ D
    o = torch.stack(outputs, dim=2).reshape(N, H, T, V)
    return o, S


def _packed_to_padded_index(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """Flat index into a ``(N, length)`` grid for every packed position."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)
    local = torch.arange(int(cu_seqlens[-1]), device=cu_seqlens.device) - cu_seqlens[seq]
    return seq * length + local


def _chunk_torch(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm, chunk_size):
    n = _check_shapes(q, k, v, g, beta, initial_state, cu_seqlens)
    q, k, v, g, beta, out_dtype = _prepare_sequence_inputs(q, k, v, g, beta, scale, use_qk_l2norm)
    dtype = q.dtype
    B, T, H, K = q.shape
    V = v.shape[-1]
    S0 = q.new_zeros(n, H, K, V) if initial_state is None else initial_state.to(dtype)

    if cu_seqlens is None:
        length = T
    else:
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        length = int(lengths.max()) if n > 0 else 0
    if length == 0 or n == 0:
        return v.new_zeros(B, T, H, V).to(out_dtype), S0

    C = min(chunk_size, length)
    padded = -(-length // C) * C
    if cu_seqlens is None:
        # (B, T, H, D) -> (N, H, T_padded, D); the padding is zeros: beta = g = 0 is a no-op.
        def to_grid(x):
            x = x.transpose(1, 2)
            return torch.nn.functional.pad(x, (0, 0, 0, padded - T)) if x.dim() == 4 else torch.nn.functional.pad(x, (0, padded - T))

        o, S = _chunk_dense(*(to_grid(x) for x in (q, k, v, g, beta)), S0, C)
        return o[:, :, :T].transpose(1, 2).to(out_dtype), S

    index = _packed_to_padded_index(cu_seqlens, padded)

    def to_grid(x):
        grid = x.new_zeros((n * padded,) + x.shape[2:]).index_copy(0, index, x[0])
        return grid.reshape((n, padded) + x.shape[2:]).transpose(1, 2)

    o, S = _chunk_dense(*(to_grid(x) for x in (q, k, v, g, beta)), S0, C)
    o = o.transpose(1, 2).reshape(n * padded, H, V).index_select(0, index)
    return o.unsqueeze(0).to(out_dtype), S


def _chunk_layout(cu_seqlens: torch.Tensor, chunk_size: int, tokens: int):
    """The flat chunk layout of a packed batch of ``tokens`` rows: each sequence split into whole chunks,
    back to back.

    Returns each sequence's first chunk (``N + 1`` offsets) and each chunk's first token and length.
    The number of chunks laid out is a bound known on the host, ``(tokens + N (C - 1)) / C`` (each
    sequence ends at most one partial chunk), so the layout needs no device-to-host read: reading
    the exact count made the host wait for every kernel queued before the recurrence and left the GPU
    idle while it launched the next ones. Chunks past the last sequence's have length 0; no sequence
    owns them, so the scans never visit them and no kernel writes a token for them.
    """
    device = cu_seqlens.device
    n = cu_seqlens.numel() - 1
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    chunks = (lengths + chunk_size - 1) // chunk_size
    offsets = torch.nn.functional.pad(chunks.cumsum(0), (1, 0))
    n_chunks = (tokens + n * (chunk_size - 1)) // chunk_size
    index = torch.arange(n_chunks, device=device)
    # the sequence owning chunk c is the first whose chunks end after c; n for the unowned ones
    owner = torch.searchsorted(offsets[1:], index, right=True)
    seq = owner.clamp(max=max(n - 1, 0))
    chunk_start = cu_seqlens[seq] + (index - offsets[seq]) * chunk_size
    chunk_len = torch.minimum(cu_seqlens[seq + 1] - chunk_start, torch.full_like(chunk_start, chunk_size))
    owned = owner < n
    return offsets, torch.where(owned, chunk_start, 0), torch.where(owned, chunk_len, 0).to(torch.int32)


@shared_per_shape
def _rows_layout(batch: int, length: int, chunk_size: int, device: torch.device):
    """:func:`_chunk_layout` of ``batch`` rows of ``length`` tokens, and the order in which the scans take
    them (all equally long: as they come), shared by every layer that asks for it (``shared_layouts.py``)."""
    cu = torch.arange(batch + 1, device=device) * length
    return (*_chunk_layout(cu, chunk_size, batch * length), torch.arange(batch, device=device))


def _chunk_triton(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm, chunk_size):
    """The chunked form over the flat chunk layout, every part in Triton: the intra-chunk terms
    read from the packed tokens, then the state scan."""
    from .gated_delta_triton import chunk_packed

    n = _check_shapes(q, k, v, g, beta, initial_state, cu_seqlens)
    out_dtype = v.dtype
    low_precision = out_dtype in (torch.bfloat16, torch.float16)
    B, T, H, K = q.shape
    V = v.shape[-1]
    S0 = None if initial_state is None else initial_state.float()
    if n == 0 or B * T == 0:
        return v.new_zeros(B, T, H, V), q.new_zeros(n, H, K, V, dtype=torch.float32) if S0 is None else S0
    if cu_seqlens is None:
        offsets, chunk_start, chunk_len, order = _rows_layout(B, T, chunk_size, q.device)
    else:
        offsets, chunk_start, chunk_len = _chunk_layout(cu_seqlens.to(q.device), chunk_size, B * T)
        order = None

    o, S = chunk_packed(
        *(None if x is None else x.reshape((B * T,) + x.shape[2:]) for x in (q, k, v, g, beta)), S0,
        offsets, chunk_start, chunk_len, chunk_size, K**-0.5 if scale is None else scale, use_qk_l2norm, L2_EPS,
        out_dtype, low_precision, order=order,
    )
    return o.view(B, T, H, V), S


def _triton_covers(q: torch.Tensor, v: torch.Tensor, chunk_size: int) -> bool:
    from .gated_delta_triton import supports

    return q.dtype != torch.float64 and supports(q.shape[-1], v.shape[-1], chunk_size)


def _uncovered(q: torch.Tensor, v: torch.Tensor, chunk_size: int) -> str:
    """What :func:`_triton_covers` turned down, for the error of an explicit Triton request."""
    return (f"the gated delta rule in {q.dtype} with key / value dims {q.shape[-1]} / {v.shape[-1]} and chunks of "
            f"{chunk_size} (its kernels take float32, bf16 or fp16, dims up to 256, chunks of 16, 32 or 64)")


def chunk_gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule; returns ``(o, final_state)`` (final state float32).

    Sequences of length 0 in a varlen batch return their initial state unchanged.
    The Triton path covers head dimensions up to 256, chunk sizes 16, 32 and 64
    and float32/bf16/fp16 inputs; other problems run on the PyTorch path.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    covered = _triton_covers(q, v, chunk_size)
    if resolve_backend(q, has_triton_impl=covered, what=partial(_uncovered, q, v, chunk_size)) == "triton":
        return _chunk_triton(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm, chunk_size)
    return _chunk_torch(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm, chunk_size)
