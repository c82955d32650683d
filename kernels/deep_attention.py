"""The DeepTransformer memory: softmax attention plus a deep branch (docs/semantics.md).

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
visible key a read is 0. Omega-window choices where the papers are silent: the
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

from dataclasses import dataclass, fields, replace

import torch
from torch.nn import functional as F

from .activations import gelu_derivative
from .backend import requested_backend, resolve_backend, triton_available
from .deep_attention_triton_read import WIDEST
from .norms import clip_scale

__all__ = [
    "DeepAttentionState",
    "chunk_deep_attention",
    "chunk_update",
    "hebbian_deep_attention",
    "reference_deep_attention",
    "step_deep_attention",
]


LEARNING_RULES = ("hebbian", "omega")


def _pair_clip_scale(grad_u: torch.Tensor, r: torch.Tensor, sig: torch.Tensor, clip: float) -> torch.Tensor:
    """Each pair's factor ``(..., 1)`` that bounds the norm of its deep-branch gradient ``(grad_u, r sig^T)``
    by ``clip`` (the norm of ``r sig^T`` is ``|r| |sig|``: no outer product is formed)."""
    return clip_scale(grad_u.pow(2).sum(-1) + r.pow(2).sum(-1) * sig.pow(2).sum(-1), clip)[..., None]


def _clip_pair(grad_u: torch.Tensor, r: torch.Tensor, sig: torch.Tensor, clip: float | None):
    """``(grad_u, r)`` scaled so that each pair's deep-branch gradient ``(grad_u, r sig^T)`` has norm <= ``clip``."""
    if clip is None:
        return grad_u, r
    scale = _pair_clip_scale(grad_u, r, sig, clip)
    return grad_u * scale, r * scale


@dataclass
class DeepAttentionState:
    """Per-row memory, rows compacted (valid pairs first), batch first.

    ``keys (B, H, L, d_k)``, ``values (B, H, L, d_v)`` raw, ``eta / gamma (B, H, L)``,
    ``targets (B, H, L, d_v)`` omega linear values and ``us (B, H, L, h)`` deep
    keys' values (committed for pairs before ``start``; under the Hebbian rule also the open chunk's,
    which are final when written), ``w1 (B, H, d_v, h)`` at ``start`` and, under the Hebbian rule,
    ``w1_now`` after the last pair; ``count (B,)`` pairs, ``start (B,)`` last chunk start.
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
    w1_now: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def with_room(self, steps: int) -> tuple["DeepAttentionState", int]:
        """This state with its pairs' buffers (``keys, values, eta, gamma, us, targets``) zero-padded along
        time so that every row can take ``steps`` more pairs, and how many more the fullest row can take
        (at least ``steps``; reads the rows' counts back to the host). Decoding steps that are told their
        state has room (``in_place``) write their pair where it lies instead of growing the buffers."""
        L = self.keys.shape[2]
        fullest = int(self.count.max()) if self.count.numel() else 0
        size = max(L, fullest + steps)
        grown = {}
        for name in ("keys", "values", "eta", "gamma", "us", "targets"):
            x = getattr(self, name)
            if x is not None and size > L:
                x = torch.cat([x, x.new_zeros(*x.shape[:2], size - L, *x.shape[3:])], 2)
            grown[name] = x
        return replace(self, **grown), size - fullest

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


def _seen(position: torch.Tensor, key_start: torch.Tensor, key_end: torch.Tensor) -> torch.Tensor:
    """Whether each query ``(B, Q)`` sees each key ``position``: ``(B, Q, n)``."""
    return (position >= key_start[:, None, None]) & (position < key_end[:, :, None])


def _reads(queries: torch.Tensor, keys: torch.Tensor, key_start: torch.Tensor, key_end: torch.Tensor,
           values: tuple[torch.Tensor, ...], scale: float, normalize: bool, window: slice | None,
           triton: bool, mutable_from: int | None = None) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
    """The chunk loop's reads: each of ``values (B, H, L, .)`` read by ``queries (B, H, Q, d_k)`` over the
    keys ``key_start[b] <= j < key_end[b, i]`` of ``keys (B, H, L, d_k)``; with ``window`` (a span of key
    positions), also those keys' weights ``(B, H, Q, n)``. PyTorch forms every weight; Triton
    (:func:`~.deep_attention_triton_read.masked_read`) reads flash-style and the window's weights are
    formed apart from the reads' log-sum-exp; its values' rows from ``mutable_from`` on may then be written
    in place after the read (:func:`_commit`)."""
    if triton:
        from .deep_attention_triton_read import masked_read  # noqa: PLC0415  (looked up here: tests count calls)

        outs, lse = masked_read(queries, keys, values, key_start, key_end, scale, normalize, mutable_from)
        if window is None:
            return outs, None
        allowed = _seen(torch.arange(window.start, window.stop, device=keys.device), key_start, key_end)
        with torch.autocast(keys.device.type, enabled=False):  # in the reads' own precision, as their lse
            scores = (queries @ keys[:, :, window].transpose(-1, -2)) * scale
        if normalize:
            scores = scores - lse[..., None]
        # -inf before the exp, not a zero after it: a masked score's exp could overflow, and 0 * inf is NaN.
        return outs, torch.where(allowed[:, None], scores, float("-inf")).exp()
    if keys.shape[2] == 0:  # a state without pairs yet: no key to read, and no window
        return tuple(queries.new_zeros(*queries.shape[:3], x.shape[-1]) for x in values), None
    allowed = _seen(torch.arange(keys.shape[2], device=keys.device), key_start, key_end)
    weights = _read_weights(queries, keys, allowed[:, None], scale, normalize)
    return tuple(weights @ x for x in values), (None if window is None else weights[..., window])


def _commit(buffer: torch.Tensor, lo: int, hi: int, delta: torch.Tensor, in_place: bool) -> torch.Tensor:
    """``buffer`` with ``delta`` added to its rows ``lo:hi`` (a chunk's writes to the omega targets or the deep
    values). In place where the reads keep a copy of the rows a later write can change (the Triton reads,
    ``mutable_from``): one buffer for the whole sequence. Otherwise a new buffer, since the PyTorch reads
    keep theirs for the backward: a chunk loop over ``N`` chunks then holds ``N`` of them, quadratic in
    the length."""
    if in_place:
        buffer[:, :, lo:hi] += delta
        return buffer
    return buffer.index_add(2, torch.arange(lo, hi, device=buffer.device), delta)


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


def _chunk_loop(q, k, v, eta, gamma, w1_init, lengths, state, memory_depth, learning_rule, omega_window,
                chunk_size, normalize, scale, grad_clip=None, triton=False):
    """The chunk loop of the module docstring over any rows and state; its reads run through the
    flash-style Triton kernels of :mod:`.deep_attention_triton_read` with ``triton``."""
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

    get = (lambda name: getattr(state, name)) if state is not None else (lambda _name: None)
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
    key_start = offset[:, 0]  # every key a row sees lies in [key_start, row_end) of the buffer
    sigma = F.gelu

    # The loop's bounds read back once: a read a chunk would wait for the GPU to catch up with the host
    # every chunk, in a loop whose host time exceeds its GPU time.
    starts, last_end = set(new_start.tolist()), int(row_end.max()) if B else S
    for a in range(S, Z, C):
        if a in starts:
            m = (new_start == a)[:, None, None, None]
            if omega:
                snap_R = torch.where(m, R, snap_R)
            if deep:
                snap_U = torch.where(m, U, snap_U)
                snap_W1 = torch.where(m, W1, snap_W1)
        if last_end <= a:
            break
        lo = max(a - c + 1, 0)
        O = torch.arange(lo, a + C, device=device)  # window tokens of this chunk
        o_valid = valid[:, O]
        Ko, Vo, Go = K[:, :, O], V[:, :, O], GAM[:, :, O]
        # Reads never look past the chunk: restrict every key operand to the first a + C positions.
        Kp, Rp, Up = K[:, :, :a + C], R[:, :, :a + C], None if U is None else U[:, :, :a + C]

        if omega or deep:
            # The window tokens read the keys before the chunk start.
            open_end = row_end.clamp(max=a)[:, None].expand(B, len(O))
            read_open, _ = _reads(Ko, Kp, key_start, open_end, ((Up,) if deep else ()) + ((Rp,) if omega else ()),
                                  scale, normalize, None, triton, lo)
            a_open = read_open[0] if deep else None
            if omega:
                pred = read_open[-1]
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

        # The chunk's queries read causally; the weights of its window keys take the chunk's own writes.
        causal_end = torch.minimum(row_end[:, None], torch.arange(a + 1, a + C + 1, device=device)[None])
        (lin, *read_deep), w_window = _reads(Qb[:, :, a:a + C], Kp, key_start, causal_end,
                                             (Rp,) + ((Up,) if deep else ()), scale, normalize,
                                             slice(lo, a + C) if omega or deep else None, triton, lo)
        if omega:
            lin = lin + (w_window * gate * counts[:, None]) @ r_open
        y = lin
        if deep:
            E = gate * lr  # (B, H, C, n_open)
            A_t = read_deep[0] + (w_window * E) @ grad_u
            s_t = sigma(A_t)
            y = y + s_t @ W1.transpose(-1, -2) + ((s_t @ sig_open.transpose(-1, -2)) * E) @ r_deep
        outputs[:, :, a:a + C] = y

        # End of chunk: commit this chunk's updates, to the window's rows lo .. a + C (the only rows a later
        # chunk's writes reach of those this chunk read: the reads' mutable_from).
        if omega:
            R = _commit(R, lo, a + C, gate[..., 0, :, None] * counts[:, None, -1, :, None] * r_open, triton)
        if deep:
            E_end = E[:, :, -1]  # (B, H, n_open)
            U = _commit(U, lo, a + C, E_end[..., None] * grad_u, triton)
            W1 = W1 + (r_deep * E_end[..., None]).transpose(-1, -2) @ sig_open

    if any(start >= Z for start in starts):
        m = (new_start >= Z)[:, None, None, None]
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
        # Under the Hebbian rule the open chunk's pairs hold their final deep values already, and with ``W_1``
        # after the last token they let the next token take :func:`_hebbian_step` instead of a replay.
        us=(_gather_time(snap_U, back, committed_new) if omega else _gather_time(U, back, keep)) if deep else None,
        w1=snap_W1 if deep else None,
        w1_now=W1 if deep and not omega else None,
    )
    return o.to(v.dtype), out_state


def _hebbian_rows(q, k, v, eta, gamma, w1_init, chunk_size, scale, grad_clip, triton):
    """Full rows from an empty state under the Hebbian rule: attention kernels and a chunk recursion
    over the pairs (the Hebbian section below) instead of the per-chunk weights of every key."""
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
    state = DeepAttentionState(keys=keys, values=values, eta=eta, gamma=gamma, count=count,
                               start=torch.full_like(count, start), us=us, w1=w1s[T // chunk_size], w1_now=w1s[-1])
    # (B, T, H, d_v) in v's dtype in one copy, so that the layer's merge of the heads is a view.
    return o.transpose(1, 2).to(v.dtype, memory_format=torch.contiguous_format), state


def _append(x: torch.Tensor, count: torch.Tensor, new: torch.Tensor, in_place: bool) -> torch.Tensor:
    """``x (B, H, L, ...)`` with ``new (B, H, ...)`` after each row's ``count`` pairs: written where it lies
    with ``in_place`` (``x`` has room: :meth:`DeepAttentionState.with_room`), else in a copy one pair
    longer, ``(B, H, L + 1, ...)``."""
    B, H = x.shape[:2]
    out = x if in_place else torch.cat([x, x.new_zeros(B, H, 1, *x.shape[3:])], 2)
    index = count.view(B, 1, 1, *([1] * (x.dim() - 3))).expand(B, H, 1, *x.shape[3:])
    return out.scatter_(2, index, new.unsqueeze(2).to(out.dtype))


def _hebbian_step(q, k, v, eta, gamma, state: DeepAttentionState, chunk_size: int, scale: float,
                  grad_clip: float | None, in_place: bool = False):
    """One new token per row under the Hebbian rule (decoding), from a state that holds the open chunk's
    deep values and ``W_1`` after its last pair: the token's key reads the committed pairs (``A^(s)(k_t)``),
    its pair is written (:func:`chunk_update`, one row), and its query reads every pair; two reads of one
    query and no replay of the open chunk, whose pairs the chunk loop would recompute from the raw inputs.
    Nothing is read back to the host, and with ``in_place`` (a state given room) nothing changes size: a
    CUDA graph can capture the step."""
    B, _, H, _ = q.shape
    dtype = state.w1.dtype
    first = lambda x: x[:, 0].to(dtype)  # noqa: E731  (B, 1, H, ...) -> (B, H, ...)
    qt, kt, vt = first(q), first(k), first(v)
    ones = qt.new_ones(B, H)
    eta_t = ones if eta is None else first(eta)
    gamma_t = ones if gamma is None else first(gamma)
    count, start = state.count, state.start
    zero = torch.zeros_like(count)
    (a,), _ = _reads(kt[:, :, None], state.keys, zero, start[:, None], (state.us,), scale, True, None, False)
    u, sig, er, _ = chunk_update(a, vt[:, :, None], state.w1, (eta_t * gamma_t)[..., None], grad_clip)
    w1_now = state.w1_now + er.transpose(-1, -2) @ sig
    keys, values, us, etas, gammas = (
        _append(x, count, new, in_place) for x, new in zip((state.keys, state.values, state.us, state.eta, state.gamma),
                                                 (kt, vt, u[:, :, 0], eta_t, gamma_t)))
    (lin, deep), _ = _reads(qt[:, :, None], keys, zero, (count + 1)[:, None], (values, us), scale, True, None, False)
    y = lin + F.gelu(deep) @ w1_now.transpose(-1, -2)  # (B, H, 1, d_v)
    count = count + 1
    closes = (count - start) == chunk_size  # the token ends its chunk: the next one starts a new chunk
    new_state = DeepAttentionState(
        keys=keys, values=values, eta=etas, gamma=gammas, count=count, start=torch.where(closes, count, start),
        us=us, w1=torch.where(closes[:, None, None, None], w1_now, state.w1), w1_now=w1_now)
    return y.transpose(1, 2).to(v.dtype), new_state


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
    in_place: bool = False,
) -> tuple[torch.Tensor, DeepAttentionState]:
    """Chunked deep attention over ``T`` new tokens per row; returns ``(o, state)``.

    ``memory_depth=1`` with the hebbian rule is causal softmax attention and runs
    through ``scaled_dot_product_attention`` (flash kernels on GPU). ``memory_depth=2`` with the
    hebbian rule, softmax reads, no state and full rows (training, a prompt's prefill) takes
    the Hebbian section below (attention kernels, Triton chunk updates on CUDA), and one token a row
    after a state (decoding) :func:`_hebbian_step`; everything else the chunk loop here (its reads
    flash-style in Triton on the Triton backend).

    ``in_place``: a decoding step may write its pair into ``initial_state``'s buffers, which have room for
    it (:meth:`DeepAttentionState.with_room`; the fixed-size step of a CUDA graph).
    """
    _check(memory_depth, learning_rule, omega_window, chunk_size)
    T = q.shape[1]
    attention = memory_depth == 1 and learning_rule == "hebbian"
    hebbian_deep = memory_depth == 2 and learning_rule == "hebbian" and normalize
    whole_rows = (hebbian_deep and initial_state is None and T > 0 and w1_init is not None
                  and (lengths is None or bool((lengths == T).all())))
    one_token = (hebbian_deep and initial_state is not None and initial_state.w1_now is not None and T == 1
                 and (lengths is None or bool((lengths == 1).all())))
    # Attention itself (depth 1) runs through the attention kernels, its fast path on every device, the
    # Hebbian rows through the key pass and a decoding step through two reads of one query; the chunk loop
    # reads through the Triton kernels where its widths fit their tiles.
    widths = (q.shape[-1], v.shape[-1], 0 if w1_init is None else w1_init.shape[-1])
    backend = resolve_backend(q, has_triton_impl=attention or whole_rows or one_token or max(widths) <= WIDEST,
                              what=lambda: f"the DeepTransformer's chunk loop at widths {widths} (up to {WIDEST})")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if attention:
        if not normalize:
            raise ValueError("memory_depth=1 with normalize=False is unnormalised attention: use memory_depth=2")
        return _attention_torch(q, k, v, lengths, initial_state, scale)
    if memory_depth == 2 and w1_init is None:
        raise ValueError("memory_depth=2 needs w1_init, the deep branch's initial W_1 (H, d_v, memory_hidden)")
    if one_token:
        return _hebbian_step(q, k, v, eta, gamma, initial_state, chunk_size, scale, grad_clip, in_place)
    if whole_rows:
        return _hebbian_rows(q, k, v, eta, gamma, w1_init, chunk_size, scale, grad_clip, backend == "triton")
    return _chunk_loop(q, k, v, eta, gamma, w1_init, lengths, initial_state, memory_depth, learning_rule,
                       omega_window, chunk_size, normalize, scale, grad_clip, backend == "triton")


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


# -------------------------- The Hebbian rule over whole sequences: a key pass and one causal read
#
# :func:`chunk_deep_attention` takes this path for the training case of the
# Hebbian rule (``memory_depth=2``, softmax weights, no initial state, every row full). Where the
# general chunk loop reads every earlier key a chunk (on the PyTorch path it materialises those weights,
# ``O(T^2)`` memory) and keeps each chunk's accumulators for the backward, this path splits the layer into
#
# 1. a **key pass**, chunk by chunk: the chunk's keys read the deep values ``U`` of all earlier
#    chunks through one non-causal ``scaled_dot_product_attention`` call, ``A^(s)(k_i)``; the
#    chunk's pairs then get ``u_i = e_i (W_1^(s)T v_i) * sigma'(A^(s)(k_i))`` (clipped) and
#    ``W_1`` its rank-``C`` update (``e = eta gamma``). This recursion is sequential in chunks; it
#    runs in :class:`_KeyPass`, whose backward walks the chunks in reverse through each read's own
#    small graph, so nothing of size ``T^2`` is stored;
# 2. **one causal read** of every query over values ``[v | U]``: with the Hebbian rule the pairs
#    of a token's own chunk hold their final ``U`` for every query at or after them, so the whole
#    read is causal softmax attention (flash kernels on the GPU);
# 3. the chunk-local term of ``W_1(t) sigma(A_t(q_t))``: ``W_1`` at the chunk start plus the
#    chunk's own rank-1 updates up to ``t``, a causal product within each chunk.
#
# The per-chunk update of step 1 is :func:`chunk_update` here (PyTorch, the definition) and, on
# the Triton backend (CUDA by default), a single kernel with a written-out backward
# (:mod:`.deep_attention_triton`). On CUDA, and wherever Triton is asked for explicitly
# (``use_backend("triton")``), the whole of step 1 runs as a wavefront of Triton launches instead,
# its reads split into blocks per earlier chunk (:class:`_KeyPassTriton`,
# :mod:`.deep_attention_triton_key_pass`), for the shapes :func:`triton_key_pass_wanted` admits.


def chunk_update(a: torch.Tensor, v: torch.Tensor, w1: torch.Tensor, e: torch.Tensor, clip: float | None):
    """One chunk's Hebbian write from its keys' reads ``a (..., C, h)`` of the earlier pairs.

    ``v (..., C, d_v)`` values, ``w1 (..., d_v, h)`` ``W_1`` at the chunk start, ``e (..., C)``
    the pairs' rates. Returns ``(u, sig, er, w1_next)``: the pairs' deep values
    ``u = e (W_1^T v) * sigma'(a)``, ``sig = sigma(a)``, ``er = e v`` (both ``u`` and ``er`` scaled
    by the pair's clip) and ``w1_next = w1 + er^T sig``.
    """
    sig = F.gelu(a)
    grad_u = (v @ w1) * gelu_derivative(a)
    rate = e[..., None]
    if clip is not None:
        rate = rate * _pair_clip_scale(grad_u, v, sig, clip)
    er = rate * v
    return rate * grad_u, sig, er, w1 + er.transpose(-1, -2) @ sig


def _update(a, v, w1, e, clip, out, u_read, tables: dict | None) -> None:
    """:func:`chunk_update` written into ``out = (u, sig, er, w1_next)`` (and ``u`` into ``u_read``):
    one Triton kernel when ``tables`` is given (it caches the kernel's stride tables by the layout
    of ``a``), PyTorch otherwise."""
    if tables is not None:
        from .deep_attention_triton import chunk_update_triton, stride_table

        extra = () if u_read is None else (u_read,)
        if a.stride() not in tables:
            tables[a.stride()] = stride_table(a, v, w1, e, *out, *extra)
        return chunk_update_triton(a, v, w1, e, clip, out, u_read, tables[a.stride()])
    for target, value in zip(out, chunk_update(a.to(v.dtype), v, w1, e, clip)):
        target.copy_(value)
    if u_read is not None:
        u_read.copy_(out[0])


def _update_backward(a, v, w1, e, clip, grads, out, tables: dict | None) -> None:
    """The gradients ``(da, dv, dw1, de)`` of :func:`chunk_update` for its outputs' ``grads``, into ``out``
    (Triton when ``tables`` is given, as :func:`_update`)."""
    if tables is not None:
        from .deep_attention_triton import chunk_update_backward_triton, stride_table

        if a.stride() not in tables:
            tables[a.stride()] = stride_table(a, v, w1, e, *grads)
        return chunk_update_backward_triton(a, v, w1, e, clip, grads, out, tables[a.stride()])
    with torch.enable_grad():
        inputs = [x.detach().requires_grad_() for x in (a.to(v.dtype), v, w1, e)]
        for target, value in zip(out, torch.autograd.grad(chunk_update(*inputs, clip), inputs, grads)):
            target.copy_(value)


def _read_earlier(kc: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax read of queries ``kc`` over all of ``keys``; 0 where there is no key."""
    if keys.shape[-2] == 0:
        return kc.new_zeros(*kc.shape[:-1], values.shape[-1])
    return F.scaled_dot_product_attention(kc, keys, values, scale=scale)


class _KeyPass(torch.autograd.Function):
    """Step 1 of the module docstring: the chunk recursion of the pairs' deep values and ``W_1``.

    Inputs ``k (B, H, T, d_k)``, ``v (B, H, T, d_v)``, ``e (B, H, T)``, ``w1 (B, H, d_v, h)``, all in
    the float compute dtype; the reads run in ``read_dtype`` (bf16 under autocast). Outputs
    ``u, sig (B, H, T, h)``, ``er (B, H, T, d_v)`` and ``w1s (N + 1, B, H, d_v, h)``, ``W_1`` at
    every chunk start and after the last chunk.

    With ``track``, each chunk's read keeps its own small autograd graph for the backward (the
    attention saves only its output and log-sum-exp; its inputs are views of the pass's buffers).
    Those views are taken with ``.data``: later chunks write further rows of the same buffers,
    which never changes the rows a read saw, and a shared version counter would reject that.
    """

    @staticmethod
    def forward(ctx, k, v, e, w1, chunk: int, scale: float, clip: float | None, read_dtype: torch.dtype,
                track: bool, triton: bool):
        B, H, T, _ = k.shape
        n_chunks = -(-T // chunk)
        keys = k.to(read_dtype)
        u = k.new_empty(B, H, T, w1.shape[-1])
        sig, er = torch.empty_like(u), torch.empty_like(v)
        u_read = u if read_dtype == u.dtype else torch.empty_like(u, dtype=read_dtype)
        w1s = w1.new_empty(n_chunks + 1, *w1.shape)
        w1s[0] = w1
        tables = {} if triton else None
        ctx.reads = []
        with torch.autocast(k.device.type, enabled=False):
            for n in range(n_chunks):
                lo, hi = n * chunk, min((n + 1) * chunk, T)
                with torch.set_grad_enabled(track and lo > 0):
                    leaves = [x.data.requires_grad_(track and lo > 0)
                              for x in (keys[:, :, lo:hi], keys[:, :, :lo], u_read[:, :, :lo])]
                    a = _read_earlier(*leaves, scale)
                ctx.reads.append((a, leaves))
                _update(a.detach(), v[:, :, lo:hi], w1s[n], e[:, :, lo:hi], clip,
                        (u[:, :, lo:hi], sig[:, :, lo:hi], er[:, :, lo:hi], w1s[n + 1]),
                        None if u_read is u else u_read[:, :, lo:hi], tables)
        ctx.save_for_backward(v, e, w1s)
        ctx.options = chunk, clip, triton, k.shape
        return u, sig, er, w1s

    @staticmethod
    def backward(ctx, du, dsig, der, dw1s):
        v, e, w1s = ctx.saved_tensors
        chunk, clip, triton, key_shape = ctx.options
        tables = {} if triton else None
        dk, dv, de = v.new_zeros(key_shape), torch.empty_like(v), torch.empty_like(e)
        # ``du`` gathers the later chunks' reads of each pair's value; the kernels need unit strides.
        du = du.clone(memory_format=torch.contiguous_format)
        dsig, der, dw1s = (x.contiguous() for x in (dsig, der, dw1s))
        dw1 = dw1s[-1]
        T = v.shape[2]
        with torch.autocast(v.device.type, enabled=False):
            for n in reversed(range(len(ctx.reads))):
                lo, hi = n * chunk, min((n + 1) * chunk, T)
                a, leaves = ctx.reads[n]
                da, dw1_n = torch.empty_like(a), torch.empty_like(dw1)
                _update_backward(a.detach(), v[:, :, lo:hi], w1s[n], e[:, :, lo:hi], clip,
                                 (du[:, :, lo:hi], dsig[:, :, lo:hi], der[:, :, lo:hi], dw1),
                                 (da, dv[:, :, lo:hi], dw1_n, de[:, :, lo:hi]), tables)
                dw1 = dw1_n.add_(dw1s[n])
                if lo == 0:
                    continue
                dkc, dkp, dup = torch.autograd.grad(a, leaves, da)
                dk[:, :, lo:hi] += dkc
                dk[:, :, :lo] += dkp
                du[:, :, :lo] += dup
        return dk, dv, de, dw1, None, None, None, None, None, None


class _KeyPassTriton(torch.autograd.Function):
    """:class:`_KeyPass` (same inputs and outputs, float32) through the wavefront kernels of
    :mod:`.deep_attention_triton_key_pass`, forward and backward."""

    @staticmethod
    def forward(ctx, k, v, e, w1, chunk: int, scale: float, clip: float | None, read_dtype: torch.dtype):
        from .deep_attention_triton_key_pass import key_pass_forward_triton  # noqa: PLC0415

        B, H, T, _ = k.shape
        flat = lambda x, dtype=torch.float32: x.to(dtype).reshape(B * H, *x.shape[2:]).contiguous()  # noqa: E731
        keys, v, e, w1 = flat(k, read_dtype), flat(v), flat(e), flat(w1)
        with torch.autocast(k.device.type, enabled=False):
            u, sig, er, w1s, u_read, a, lse = key_pass_forward_triton(keys, v, e, w1, chunk, scale, clip)
        ctx.save_for_backward(keys, v, e, w1s, u_read, a, lse)
        ctx.options = chunk, scale, clip, (B, H)
        heads = lambda x: x.unflatten(0, (B, H))  # noqa: E731
        return heads(u), heads(sig), heads(er), w1s.unflatten(1, (B, H))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, du, dsig, der, dw1s):
        from .deep_attention_triton_key_pass import key_pass_backward_triton  # noqa: PLC0415

        chunk, scale, clip, (B, H) = ctx.options
        flat = lambda x: x.flatten(0, 1)  # noqa: E731
        with torch.autocast(du.device.type, enabled=False):
            grads = key_pass_backward_triton(*ctx.saved_tensors, flat(du), flat(dsig), flat(der), dw1s.flatten(1, 2),
                                             chunk, scale, clip)
        return (*(x.unflatten(0, (B, H)) for x in grads), None, None, None, None)


def triton_key_pass_wanted(k: torch.Tensor, chunk: int, reads: torch.dtype, w1: torch.Tensor) -> bool:
    """Whether :func:`hebbian_deep_attention` runs its key pass through :class:`_KeyPassTriton`: on CUDA
    tensors when Triton imports, or wherever Triton is asked for (its interpreter on the CPU), never under
    ``use_backend("torch")``; for float32 recursions with reads in float32, bf16 or fp16, chunks a power
    of two from 16 to 128 and widths up to 128, chunk times width at most 8,192. Compiled for an H100
    (Triton 3.6), the backward's shared memory is 196 KB at 64 x 128 or 128 x 64 (float32 reads) and
    384 KB at 128 x 128, over the 227 KB an SM has. Where it runs, the pass makes the Hebbian depth-2
    layer's forward and backward several times faster than the PyTorch key pass (benchmarks/RESULTS.md)."""
    asked = requested_backend()
    if not (asked == "triton" or (asked is None and k.is_cuda and triton_available())):
        return False
    width = max(k.shape[-1], *w1.shape[-2:])
    return (k.dtype == torch.float32 and reads in (torch.float32, torch.bfloat16, torch.float16)
            and 16 <= chunk <= 128 and chunk & (chunk - 1) == 0 and width <= 128 and chunk * width <= 8192)


def read_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of the attention reads for inputs like ``x``: autocast's where it is on, else ``x``'s
    own (a bf16 model reads in bf16, through flash kernels, while the recursion runs in float32)."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def hebbian_deep_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, e: torch.Tensor, w1: torch.Tensor,
                           *, chunk_size: int, scale: float, grad_clip: float | None, reads: torch.dtype,
                           triton: bool = False):
    """The Hebbian deep memory over full rows from an empty state.

    ``q, k (B, H, T, d_k)``, ``v (B, H, T, d_v)``, ``e (B, H, T)`` = ``eta gamma``, ``w1 (B, H, d_v, h)``,
    all float32 or wider but ``q``, which only the final read takes (in ``reads``: a query already in
    that dtype is not copied); attention reads run in ``reads``, the chunk updates in Triton with
    ``triton``. Returns ``o (B, H, T, d_v)`` and, for the state, ``u (B, H, T, h)`` and ``w1s``.
    """
    B, H, T, _ = q.shape
    C, dv = chunk_size, v.shape[-1]
    track = torch.is_grad_enabled() and any(x.requires_grad for x in (k, v, e, w1))
    if triton and triton_key_pass_wanted(k, C, reads, w1):
        u, sig, er, w1s = _KeyPassTriton.apply(k, v, e, w1, C, scale, grad_clip, reads)
    else:
        u, sig, er, w1s = _KeyPass.apply(k, v, e, w1, C, scale, grad_clip, reads, track, triton)
    with torch.autocast(q.device.type, enabled=False):
        read = F.scaled_dot_product_attention(q.to(reads), k.to(reads), torch.cat([v, u], -1).to(reads),
                                              is_causal=True, scale=scale).to(v.dtype)
        lin, s = read[..., :dv], F.gelu(read[..., dv:])
        n_chunks = w1s.shape[0] - 1
        pad = n_chunks * C - T

        def chunked(x):  # (B, H, N, C, .); a view where T fills the chunks (a pad is a copy each way)
            return (F.pad(x, (0, 0, 0, pad)) if pad else x).unflatten(2, (n_chunks, C))

        s_c, sig_c, er_c = chunked(s), chunked(sig), chunked(er)
        w1_start = w1s[:-1].permute(1, 2, 0, 3, 4)  # (B, H, N, d_v, h)
        mine = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        within = (s_c @ sig_c.transpose(-1, -2)).masked_fill(~mine, 0.0)
        deep = s_c @ w1_start.transpose(-1, -2) + within @ er_c
    return lin + deep.flatten(2, 3)[:, :, :T], u, w1s
