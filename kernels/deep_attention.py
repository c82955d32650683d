"""The DeepTransformer memory: softmax attention plus a deep branch (FAMILIES.md §4).

Per head, with keys ``k_j`` (already rotated), raw values ``v_j``, read weights
``w_j(z)`` = softmax over the visible keys of ``z.k_j * scale`` (``normalize``;
raw ``exp`` otherwise), and GELU ``sigma``:

- linear branch: attention over stored pairs ``(k_j, R_j)``; ``R_j = v_j`` for the
  ``hebbian`` rule (the branch IS causal softmax attention), and for the
  ``omega`` rule the gated window sum of prediction errors
  ``r_j = v_j - M^(s)(k_j)`` taken at chunk-start memories ``M^(s)``;
- deep branch (``memory_depth=2``): ``A(z) = sum_j w_j(z) U_j`` and
  ``W_1``; every token ``t`` takes, for each ``i`` of its window
  ``[t - c + 1, t]``, the gradient of its objective at the chunk-start memory:
  ``U_i += eta_t gamma_i (W_1^(s)T r_i) * sigma'(A^(s)(k_i))`` and
  ``W_1 += eta_t gamma_i r_i sigma(A^(s)(k_i))^T`` with ``r_i = v_i`` (hebbian,
  where ``c = 1`` and ``gamma = 1``) or the prediction error (omega); the omega
  linear branch also adds ``gamma_i r_i`` to ``R_i``;
- output ``y_t = sum_j w_j(q_t) R_j(t) + W_1(t) sigma(A_t(q_t))``.

``A^(s)`` and ``M^(s)`` see only keys before the chunk start ``s`` (inner chunks
of ``chunk_size`` tokens counted over each sequence's own tokens). With no
visible key a read is 0. Omega-window choices where FAMILIES.md is silent: the
linear-branch write has learning rate 1 (gated by ``gamma``), the deep branch
uses ``eta``; window tokens before the chunk are re-evaluated at the current
chunk-start memory.

Layout: ``q, k, v`` ``(B, T, H, D)`` compacted per row (valid tokens first,
``lengths[b]`` of them); ``eta, gamma`` ``(B, T, H)``. The state
(:class:`DeepAttentionState`) keeps every pair, the raw inputs of the tokens of
the unfinished chunk (replayed on the next call, so any split of a sequence
gives the same result), the accumulators committed at the last chunk start, and
``W_1`` there.

``grad_clip`` bounds each pair's deep-branch gradient (``U_i``'s and ``W_1``'s parts
together, before ``eta``): the Hebbian update feeds on itself (``U`` grows with ``W_1``,
``sigma(A)`` with ``U``, ``W_1`` with ``sigma(A)``), so unclipped the branch's state
grows exponentially with the context; clipped, ``U`` stays bounded and ``W_1`` grows at
most linearly. The linear (attention) branch is never clipped.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch.nn import functional as F

from .activations import gelu_derivative
from .backend import resolve_backend
from .deep_attention_hebbian import hebbian_deep_attention, read_dtype
from .norms import clip_scale

__all__ = [
    "DeepAttentionState",
    "chunk_deep_attention",
    "reference_deep_attention",
    "step_deep_attention",
    "gelu_derivative",
]

LEARNING_RULES = ("hebbian", "omega")


def _clip_pair(grad_u: torch.Tensor, r: torch.Tensor, sig: torch.Tensor, clip: float | None):
    """``(grad_u, r)`` scaled so that each pair's deep-branch gradient ``(grad_u, r sig^T)`` has norm <= ``clip``."""
    if clip is None:
        return grad_u, r
    scale = clip_scale(grad_u.pow(2).sum(-1) + r.pow(2).sum(-1) * sig.pow(2).sum(-1), clip)[..., None]
    return grad_u * scale, r * scale


@dataclass
class DeepAttentionState:
    """Per-row memory, rows compacted (valid pairs first), batch first.

    ``keys (B, H, L, d_k)``, ``values (B, H, L, d_v)`` raw, ``eta / gamma (B, H, L)``,
    ``targets (B, H, L, d_v)`` omega linear values and ``us (B, H, L, h)`` deep
    keys' values (committed for pairs before ``start``), ``w1 (B, H, d_v, h)`` at
    ``start``; ``count (B,)`` pairs, ``start (B,)`` last chunk start.
    """

    keys: torch.Tensor
    values: torch.Tensor
    eta: torch.Tensor
    gamma: torch.Tensor
    count: torch.Tensor
    start: torch.Tensor
    targets: torch.Tensor | None = None
    us: torch.Tensor | None = None
    w1: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "DeepAttentionState":
        return cls(**tensors)


def _check(memory_depth: int, learning_rule: str, omega_window: int, chunk_size: int) -> None:
    if memory_depth not in (1, 2):
        raise ValueError(f"memory_depth must be 1 or 2, got {memory_depth}")
    if learning_rule not in LEARNING_RULES:
        raise ValueError(f"learning_rule must be one of {LEARNING_RULES}, got {learning_rule!r}")
    if omega_window < 1 or chunk_size < 1:
        raise ValueError("omega_window and chunk_size must be >= 1")
    if learning_rule == "hebbian" and omega_window != 1:
        raise ValueError("the hebbian rule has no window: omega_window must be 1")


def _read_weights(queries, keys, key_mask, scale: float, normalize: bool):
    """``w (B, H, Q, L)``: softmax (or exp) of scaled scores over the allowed keys; 0 if none is allowed."""
    scores = (queries @ keys.transpose(-1, -2)) * scale
    if not normalize:
        return scores.exp() * key_mask
    # At least float32 whatever the matmul gave (bf16 under autocast), and the peak out of the graph:
    # the softmax does not depend on it, and Inductor's backward of the masked ``amax`` gave NaN
    # gradients under bf16 autocast (torch 2.11 and 2.13) where eager did not.
    logits = scores.to(torch.promote_types(scores.dtype, torch.float32))
    finfo = torch.finfo(logits.dtype)
    peak = logits.masked_fill(~key_mask, finfo.min).amax(-1, keepdim=True).detach()
    weights = torch.where(key_mask, logits - peak, float("-inf")).exp()
    return (weights / weights.sum(-1, keepdim=True).clamp(min=finfo.tiny)).to(scores.dtype)


# --------------------------------------------------------------------------- reference


def reference_deep_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    eta: torch.Tensor | None,
    gamma: torch.Tensor | None,
    w1_init: torch.Tensor | None,
    *,
    lengths: torch.Tensor | None = None,
    memory_depth: int = 2,
    learning_rule: str = "hebbian",
    omega_window: int = 1,
    chunk_size: int = 64,
    normalize: bool = True,
    scale: float | None = None,
    grad_clip: float | None = None,
) -> torch.Tensor:
    """Token-by-token definition (no initial state); returns ``o (B, T, H, d_v)`` (0 past ``lengths``)."""
    _check(memory_depth, learning_rule, omega_window, chunk_size)
    B, T, H, dk = q.shape
    dtype = torch.promote_types(v.dtype, torch.float32)
    scale = dk**-0.5 if scale is None else scale
    deep, omega = memory_depth == 2, learning_rule == "omega"
    c = omega_window
    o = torch.zeros(B, T, H, v.shape[-1], dtype=dtype, device=v.device)
    sigma = F.gelu

    def read(query, keys, vals):  # query (H, dk), keys (H, n, dk), vals (H, n, x) -> (H, x)
        if keys.shape[1] == 0:
            return vals.new_zeros(H, vals.shape[-1])
        mask = torch.ones(H, 1, keys.shape[1], dtype=torch.bool, device=keys.device)
        w = _read_weights(query[:, None], keys, mask, scale, normalize)[:, 0]
        return torch.einsum("hn,hnx->hx", w, vals)

    for b in range(B):
        n_tokens = T if lengths is None else int(lengths[b])
        K = k[b, :n_tokens].to(dtype).transpose(0, 1)  # (H, n, dk)
        V = v[b, :n_tokens].to(dtype).transpose(0, 1)
        R = torch.zeros_like(V) if omega else V.clone()
        U = V.new_zeros(H, n_tokens, w1_init.shape[-1]) if deep else None
        W1 = w1_init.to(dtype).clone() if deep else None
        for t in range(n_tokens):
            if t % chunk_size == 0:  # chunk start: freeze the memory that this chunk's gradients see
                s, R_s, U_s, W1_s = t, R.clone(), None if U is None else U.clone(), None if W1 is None else W1.clone()
            if omega or deep:
                for i in range(max(0, t - c + 1), t + 1):
                    g_i = 1.0 if gamma is None else gamma[b, i].to(dtype)[:, None]
                    e_t = 1.0 if eta is None else eta[b, t].to(dtype)[:, None]
                    a_i = read(K[:, i], K[:, :s], U_s[:, :s]) if deep else None
                    if omega:
                        pred = read(K[:, i], K[:, :s], R_s[:, :s])
                        if deep:
                            pred = pred + torch.einsum("hvm,hm->hv", W1_s, sigma(a_i))
                        r_i = V[:, i] - pred
                        R = R.index_add(1, torch.tensor([i], device=R.device), (g_i * r_i)[:, None])
                    else:
                        r_i = V[:, i]
                    if deep:
                        grad_u = torch.einsum("hvm,hv->hm", W1_s, r_i) * gelu_derivative(a_i)
                        grad_u, r_deep = _clip_pair(grad_u, r_i, sigma(a_i), grad_clip)
                        U = U.index_add(1, torch.tensor([i], device=U.device), (e_t * g_i * grad_u)[:, None])
                        W1 = W1 + (e_t * g_i)[..., None] * r_deep[:, :, None] * sigma(a_i)[:, None, :]
            y = read(q[b, t].to(dtype), K[:, : t + 1], R[:, : t + 1])
            if deep:
                y = y + torch.einsum("hvm,hm->hv", W1, sigma(read(q[b, t].to(dtype), K[:, : t + 1], U[:, : t + 1])))
            o[b, t] = y
    return o.to(v.dtype)


# --------------------------------------------------------------------------- chunked


def _timeline(state: DeepAttentionState | None, new: torch.Tensor, lengths: torch.Tensor, chunk: int, S: int):
    """Indices that lay every row out on one buffer: committed pairs end at ``S`` (a chunk
    boundary for every row), then the unfinished chunk's pairs and the new tokens."""
    B, T = new.shape[0], new.shape[1]
    device = new.device
    count = state.count if state is not None else torch.zeros(B, dtype=torch.long, device=device)
    start = state.start if state is not None else torch.zeros(B, dtype=torch.long, device=device)
    L = state.keys.shape[2] if state is not None else 0
    pending = count - start
    span = int((pending + lengths).max()) if B else 0
    span = max(chunk, -(-span // chunk) * chunk)
    tau = torch.arange(S + span, device=device)
    offset = (S - start)[:, None]
    local = tau[None] - offset  # index into the row's own timeline
    total = count[:, None] + lengths[:, None]
    valid = (local >= 0) & (local < total)
    source = torch.where(local < count[:, None], local, L + local - count[:, None]).clamp(0, L + T - 1)
    return source, valid, offset, pending, start, span


def _gather_time(x: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``x (B, H, N, ...)`` gathered along time at ``index (B, Z)`` -> ``(B, H, Z, ...)``, zero where invalid."""
    B, H = x.shape[:2]
    idx = index[:, None, :].expand(B, H, -1)
    extra = x.shape[3:]
    idx = idx.reshape(B, H, -1, *([1] * len(extra))).expand(B, H, index.shape[1], *extra)
    out = x.gather(2, idx)
    mask = valid[:, None].reshape(B, 1, -1, *([1] * len(extra)))
    return out * mask


def _chunk_torch(q, k, v, eta, gamma, w1_init, lengths, state, memory_depth, learning_rule, omega_window,
                 chunk_size, normalize, scale, grad_clip=None):
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    dtype = torch.promote_types(v.dtype, torch.float32)
    device = q.device
    deep, omega = memory_depth == 2, learning_rule == "omega"
    C, c = chunk_size, omega_window
    if lengths is None:
        lengths = torch.full((B,), T, dtype=torch.long, device=device)
    eta = torch.ones(B, T, H, dtype=dtype, device=device) if eta is None else eta
    gamma = torch.ones(B, T, H, dtype=dtype, device=device) if gamma is None else gamma

    S = int(state.start.max()) if state is not None and B else 0
    source, valid, offset, pending, start, span = _timeline(state, q, lengths, C, S)
    Z = S + span

    def cat_time(cached, new):  # cached (B, H, L, ...) or None, new (B, T, H, ...) -> (B, H, L + T, ...)
        new = new.to(dtype).transpose(1, 2)
        return new if cached is None else torch.cat([cached.to(dtype), new], dim=2)

    get = (lambda name: getattr(state, name)) if state is not None else (lambda name: None)
    K = _gather_time(cat_time(get("keys"), k), source, valid)
    V = _gather_time(cat_time(get("values"), v), source, valid)
    ETA = _gather_time(cat_time(get("eta"), eta), source, valid)
    GAM = _gather_time(cat_time(get("gamma"), gamma), source, valid)
    # Accumulators: committed ones for pairs before each row's start, zero after.
    committed = valid & (torch.arange(Z, device=device)[None] < S)
    zeros_new = lambda width: torch.zeros(B, T, H, width, dtype=dtype, device=device)  # noqa: E731
    R = _gather_time(cat_time(get("targets"), zeros_new(dv)), source, committed) if omega else V
    U = _gather_time(cat_time(get("us"), zeros_new(w1_init.shape[-1])), source, committed) if deep else None
    if deep:
        W1 = state.w1.to(dtype) if state is not None else w1_init.to(dtype).expand(B, -1, -1, -1).clone()

    # Queries only for the new tokens, placed after each row's replayed pending tokens.
    new_pos = (S + pending)[:, None] + torch.arange(T, device=device)[None]
    new_valid = torch.arange(T, device=device)[None] < lengths[:, None]
    # Padded tokens (past a row's length) are written to a spill slot at Z that is dropped: clamped
    # into the buffer instead, a row whose last real token sits at Z - 1 (its length fills the last
    # chunk while another row or T is longer) had that token's query overwritten with zeros.
    spill = torch.where(new_valid, new_pos, torch.full_like(new_pos, Z))
    Qb = torch.zeros(B, H, Z + 1, dk, dtype=dtype, device=device)
    Qb.scatter_(2, spill[:, None, :, None].expand(B, H, T, dk), q.to(dtype).transpose(1, 2))
    Qb = Qb[:, :, :Z]

    row_end = S + pending + lengths  # buffer position after each row's last token
    new_start = S + ((pending + lengths) // C) * C  # buffer position of each row's next chunk start
    snap_R, snap_U, snap_W1 = (R.clone() if omega else None), (U.clone() if deep else None), (W1.clone() if deep else None)
    outputs = torch.zeros(B, H, Z, dv, dtype=dtype, device=device)
    tau = torch.arange(Z, device=device)
    sigma = F.gelu

    for a in range(S, Z, C):
        at_start = (new_start == a)
        if at_start.any():
            m = at_start[:, None, None, None]
            if omega:
                snap_R = torch.where(m, R, snap_R)
            if deep:
                snap_U = torch.where(m, U, snap_U)
                snap_W1 = torch.where(m, W1, snap_W1)
        if bool((row_end <= a).all()):
            break
        lo = max(a - c + 1, 0)
        O = torch.arange(lo, a + C, device=device)  # window tokens of this chunk
        o_valid = valid[:, O]
        Ko, Vo, Go = K[:, :, O], V[:, :, O], GAM[:, :, O]
        # Reads never look past the chunk: restrict every key operand to the first a + C positions.
        Kp, Rp, Up, valid_p, tau_p = K[:, :, :a + C], R[:, :, :a + C], None if U is None else U[:, :, :a + C], \
            valid[:, :a + C], tau[:a + C]

        if omega or deep:
            key_mask = (valid_p & (tau_p[None] < a))[:, None, None, :]  # keys before the chunk start
            w_open = _read_weights(Ko, Kp, key_mask, scale, normalize)  # (B, H, n_open, a + C)
            a_open = w_open @ Up if deep else None
            if omega:
                pred = w_open @ Rp
                if deep:
                    pred = pred + sigma(a_open) @ W1.transpose(-1, -2)
                r_open = (Vo - pred) * o_valid[:, None, :, None]
            else:
                r_open = Vo
            if deep:
                grad_u = (r_open @ W1) * gelu_derivative(a_open)
                sig_open = sigma(a_open)
                grad_u, r_deep = _clip_pair(grad_u, r_open, sig_open, grad_clip)

            # Window weights: token t' of the chunk updates pair i when i <= t' <= i + c - 1.
            t_chunk = torch.arange(a, a + C, device=device)
            inside = (O[None, :] <= t_chunk[:, None]) & (t_chunk[:, None] <= O[None, :] + c - 1)  # (C, n_open)
            t_valid = valid[:, a:a + C]
            counts = (inside[None] & t_valid[:, :, None]).to(dtype).cumsum(1)  # (B, C, n_open)
            lr = (ETA[:, :, a:a + C, None] * inside[None, None]).cumsum(2)  # (B, H, C, n_open)
            gate = Go[..., None, :]  # (B, H, 1, n_open)

        causal = tau_p[None, :] <= torch.arange(a, a + C, device=device)[:, None]  # (C, a + C)
        w_out = _read_weights(Qb[:, :, a:a + C], Kp, valid_p[:, None, None, :] & causal[None, None], scale, normalize)
        lin = w_out @ Rp
        if omega:
            lin = lin + (w_out[..., O] * gate * counts[:, None]) @ r_open
        y = lin
        if deep:
            E = gate * lr  # (B, H, C, n_open)
            A_t = w_out @ Up + (w_out[..., O] * E) @ grad_u
            s_t = sigma(A_t)
            y = y + s_t @ W1.transpose(-1, -2) + ((s_t @ sig_open.transpose(-1, -2)) * E) @ r_deep
        outputs[:, :, a:a + C] = y

        # End of chunk: commit this chunk's updates.
        if omega:
            R = R.index_add(2, O, gate[..., 0, :, None] * counts[:, None, -1, :, None] * r_open)
        if deep:
            E_end = E[:, :, -1]  # (B, H, n_open)
            U = U.index_add(2, O, E_end[..., None] * grad_u)
            W1 = W1 + (r_deep * E_end[..., None]).transpose(-1, -2) @ sig_open

    at_end = new_start >= Z
    if at_end.any():
        m = at_end[:, None, None, None]
        if omega:
            snap_R = torch.where(m, R, snap_R)
        if deep:
            snap_U = torch.where(m, U, snap_U)
            snap_W1 = torch.where(m, W1, snap_W1)

    o = outputs.gather(2, new_pos.clamp(max=Z - 1)[:, None, :, None].expand(B, H, T, dv)).transpose(1, 2)
    o = o * new_valid[:, :, None, None]

    # New state: every pair of each row, compacted; accumulators valid before the new start.
    new_count = (state.count if state is not None else torch.zeros_like(lengths)) + lengths
    L_new = int(new_count.max()) if B else 0
    back = offset + torch.arange(L_new, device=device)[None]  # buffer position of each cached index
    keep = torch.arange(L_new, device=device)[None] < new_count[:, None]
    back = back.clamp(max=Z - 1)
    committed_new = keep & (back < new_start[:, None])
    out_state = DeepAttentionState(
        keys=_gather_time(K, back, keep),
        values=_gather_time(V, back, keep),
        eta=_gather_time(ETA, back, keep),
        gamma=_gather_time(GAM, back, keep),
        count=new_count,
        start=new_start - offset[:, 0],
        targets=_gather_time(snap_R, back, committed_new) if omega else None,
        us=_gather_time(snap_U, back, committed_new) if deep else None,
        w1=snap_W1 if deep else None,
    )
    return o.to(v.dtype), out_state


def _hebbian_rows(q, k, v, eta, gamma, w1_init, chunk_size, scale, grad_clip, triton):
    """Full rows from an empty state under the Hebbian rule: attention kernels and a chunk recursion
    over the pairs (:mod:`.deep_attention_hebbian`) instead of the per-chunk weights of every key."""
    B, T, H, _ = q.shape
    dtype = torch.promote_types(v.dtype, torch.float32)
    heads_first = lambda x: x.to(dtype).transpose(1, 2)  # noqa: E731
    ones = torch.ones(B, H, T, dtype=dtype, device=q.device)
    eta = ones if eta is None else heads_first(eta)
    gamma = ones if gamma is None else heads_first(gamma)
    keys, values = heads_first(k), heads_first(v)
    w1 = w1_init.to(dtype).expand(B, -1, -1, -1)
    # The queries go to the read as they are (bf16 models: no float32 round trip, exact either way).
    o, us, w1s = hebbian_deep_attention(q.transpose(1, 2), keys, values, eta * gamma, w1, chunk_size=chunk_size,
                                        scale=scale, grad_clip=grad_clip, reads=read_dtype(k), triton=triton)
    count = torch.full((B,), T, dtype=torch.long, device=q.device)
    start = (T // chunk_size) * chunk_size
    if start < T:  # the open chunk's deep values are not committed yet
        us = us * (torch.arange(T, device=q.device) < start)[None, None, :, None]
    state = DeepAttentionState(keys=keys, values=values, eta=eta, gamma=gamma, count=count,
                               start=torch.full_like(count, start), us=us, w1=w1s[T // chunk_size])
    # (B, T, H, d_v) in v's dtype in one copy, so that the layer's merge of the heads is a view.
    return o.transpose(1, 2).to(v.dtype, memory_format=torch.contiguous_format), state


def _attention_torch(q, k, v, lengths, state, scale):
    """memory_depth 1 with the hebbian rule: exactly causal softmax attention (SDPA)."""
    B, T, H, dk = q.shape
    device = q.device
    if lengths is None and state is None:
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, scale=scale)
        count = torch.full((B,), T, dtype=torch.long, device=device)
        new_state = DeepAttentionState(keys=k.transpose(1, 2), values=v.transpose(1, 2),
                                       eta=q.new_zeros(B, H, T), gamma=q.new_zeros(B, H, T), count=count, start=count)
        return o.transpose(1, 2), new_state
    if lengths is None:
        lengths = torch.full((B,), T, dtype=torch.long, device=device)
    count = state.count if state is not None else torch.zeros(B, dtype=torch.long, device=device)
    L = state.keys.shape[2] if state is not None else 0
    new_count = count + lengths
    L_new = max(int(new_count.max()) if B else 0, 1)
    pos = torch.arange(L_new, device=device)[None]
    source = torch.where(pos < count[:, None], pos, L + pos - count[:, None]).clamp(0, L + T - 1)
    keep = pos < new_count[:, None]

    def cat_time(cached, new):
        new = new.transpose(1, 2)
        return new if cached is None else torch.cat([cached.to(new.dtype), new], dim=2)

    keys = _gather_time(cat_time(None if state is None else state.keys, k), source, keep)
    values = _gather_time(cat_time(None if state is None else state.values, v), source, keep)
    q_pos = count[:, None] + torch.arange(T, device=device)[None]  # (B, T)
    mask = (pos[:, None, :] <= q_pos[:, :, None]) & keep[:, None, :]
    mask = mask | (pos[:, None, :] == q_pos[:, :, None].clamp(max=L_new - 1))  # a padded query sees one key
    o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask[:, None], scale=scale)
    o = o.transpose(1, 2) * (torch.arange(T, device=device)[None] < lengths[:, None])[..., None, None]
    zeros = keys.new_zeros(B, H, L_new)
    return o, DeepAttentionState(keys=keys, values=values, eta=zeros, gamma=zeros, count=new_count, start=new_count)


def chunk_deep_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    eta: torch.Tensor | None,
    gamma: torch.Tensor | None,
    w1_init: torch.Tensor | None,
    *,
    lengths: torch.Tensor | None = None,
    initial_state: DeepAttentionState | None = None,
    memory_depth: int = 2,
    learning_rule: str = "hebbian",
    omega_window: int = 1,
    chunk_size: int = 64,
    normalize: bool = True,
    scale: float | None = None,
    grad_clip: float | None = None,
) -> tuple[torch.Tensor, DeepAttentionState]:
    """Chunked deep attention over ``T`` new tokens per row; returns ``(o, state)``.

    ``memory_depth=1`` with the hebbian rule is causal softmax attention and runs
    through ``scaled_dot_product_attention`` (flash kernels on GPU). ``memory_depth=2`` with the
    hebbian rule, softmax reads, no state and full rows (training, a prompt's prefill) takes
    :mod:`.deep_attention_hebbian` (attention kernels, Triton chunk updates on CUDA); everything else
    the chunk loop here.
    """
    _check(memory_depth, learning_rule, omega_window, chunk_size)
    T = q.shape[1]
    whole_rows = (memory_depth == 2 and learning_rule == "hebbian" and normalize and initial_state is None and T > 0
                  and w1_init is not None and (lengths is None or bool((lengths == T).all())))
    backend = resolve_backend(q, has_triton_impl=whole_rows)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if memory_depth == 1 and learning_rule == "hebbian":
        if not normalize:
            raise ValueError("memory_depth=1 with normalize=False is unnormalised attention: use memory_depth=2")
        return _attention_torch(q, k, v, lengths, initial_state, scale)
    if memory_depth == 2 and w1_init is None:
        raise ValueError("memory_depth=2 needs w1_init, the deep branch's initial W_1 (H, d_v, memory_hidden)")
    if whole_rows:
        return _hebbian_rows(q, k, v, eta, gamma, w1_init, chunk_size, scale, grad_clip, backend == "triton")
    return _chunk_torch(q, k, v, eta, gamma, w1_init, lengths, initial_state, memory_depth, learning_rule,
                        omega_window, chunk_size, normalize, scale, grad_clip)


def step_deep_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    eta: torch.Tensor | None,
    gamma: torch.Tensor | None,
    w1_init: torch.Tensor | None,
    state: DeepAttentionState | None,
    **options,
) -> tuple[torch.Tensor, DeepAttentionState]:
    """One token per row (``q, k, v`` ``(B, H, D)``, ``eta, gamma`` ``(B, H)``).

    The tokens of the unfinished inner chunk are replayed from the state, so the
    step reproduces the chunked forward exactly at every position in the chunk.
    """
    unsqueeze = lambda x: None if x is None else x.unsqueeze(1)  # noqa: E731
    o, new = chunk_deep_attention(unsqueeze(q), unsqueeze(k), unsqueeze(v), unsqueeze(eta), unsqueeze(gamma),
                                  w1_init, initial_state=state, **options)
    return o[:, 0], new
