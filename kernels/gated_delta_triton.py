"""Triton path of the gated delta rule: the chunked form for training and prefill, and the decode step.

The chunked form (``gated_delta.intra_chunk_terms``) splits the recurrence into
terms that are independent across chunks and a scan that carries the state from
chunk to chunk::

    D_c     = U_c - W_c S_c
    O_c     = Qd_c S_c + P_c D_c
    S_{c+1} = gamma_c S_c + Kd_c^T D_c

:func:`chunk_packed` runs it over packed tokens, forward and backward, as one
autograd function. First one kernel per (chunk, head) computes ``U, W, P, gamma``
straight from the packed tokens; ``Qd`` and ``Kd`` are the packed ``q, k`` times
per-row factors (norm, scale, decay), so only the factors are stored and every
kernel that needs ``Qd, Kd`` forms them from ``q, k``.

The scan is the only sequential part. It runs in one launch for every
(sequence, head, block of value columns): a column block of the state never
mixes with another one, so the state of one program is a ``(BV, d_k)`` tile
(held transposed, so that each product takes it as its register operand) kept
in registers for the whole sequence, and sequences of any lengths (the routed
subsequences of MoM) share the launch through per-sequence chunk offsets. For
training the scan only carries the state: it saves the state entering each
chunk and ``D``, and the outputs come from a kernel parallel over chunks. By
default the forward of training keeps neither (:data:`KEEP_CHUNK_STATES`): it runs
as the forward without gradients, and the backward runs the intra-chunk forward
and the scan again for them. The backward is split the same way: ``P^T dO`` and ``dP`` in parallel over chunks,
a reverse scan for ``dD`` and the state gradients, then the products of each
chunk's state with its rows (``dW`` and the gradients of ``q, k`` through
``Qd, Kd``, ``dgamma``) in parallel again, and last the intra-chunk backward,
which recomputes the Gram matrices and uses the saved ``(I + A)^-1``. Without
gradients the forward scan writes the outputs itself and saves nothing.

:func:`step` fuses one decoding step (L2 norm, decay, delta write, read) for all
sequences and heads in one launch; given slot indices it steps those states of a
larger state tensor in place (MoM's routed memories, no gather or scatter).

Triton 3.6 on Hopper miscompiles ``tl.dot`` of a transposed ``tl.dot`` result
(see the project's Triton notes): every transposed operand here is loaded
transposed from memory, never produced by ``tl.trans``.

"""

from __future__ import annotations

import torch

from .backend import tl, triton


__all__ = ["chunk_packed", "step", "supports"]

MAX_HEAD_DIM = 256


def supports(key_dim: int, value_dim: int, chunk_size: int) -> bool:
    """Whether these kernels cover the shape (else the caller uses the PyTorch path)."""
    return (
        key_dim <= MAX_HEAD_DIM
        and value_dim <= MAX_HEAD_DIM
        and chunk_size in (16, 32, 64)
    )


# Rows of the per-(chunk, head) factor table ``ROWS`` ``(n_chunks, H, N_ROWS, C)``, float32: ``Qd = q * QS``,
# ``Kd = k * KS`` (raw packed ``q, k``; L2 norm, scale and decay folded in), the decays alone,
# ``EG = e^G`` and ``ER = e^{G_last - G}``, that turn ``dQd, dKd`` into gradients of ``q^, k^``, and
# ``WS = beta e^G r_k``, with which the backward recomputes ``W = T (k * WS)`` instead of saving it.
_QS, _KS, _EG, _ER, _WS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3), tl.constexpr(4)

# Tile helpers. ``r`` indexes a chunk's rows (``tl.arange(0, C)``); ``kk`` / ``vv`` a block of key /
# value columns with ``K`` / ``V`` the true sizes (masks cover padded head dimensions).

@triton.jit
def _rows(ptr, r, cols, n_cols):
    """A ``(C, B)`` tile of a row-major ``(C, n_cols)`` chunk matrix."""
    return tl.load(ptr + r[:, None] * n_cols + cols[None, :], mask=cols[None, :] < n_cols, other=0.0)

@triton.jit
def _rows_t(ptr, r, cols, n_cols):
    """The same tile read transposed from memory: ``(B, C)``."""
    return tl.load(ptr + r[None, :] * n_cols + cols[:, None], mask=cols[:, None] < n_cols, other=0.0)

@triton.jit
def _kv(ptr, kk, vv, K, V):
    """Offsets (from ``ptr``, a pointer or an offset) and mask of the ``(BK, BV)`` block ``kk x vv`` of
    a row-major ``(K, V)`` state."""
    return ptr + kk[:, None] * V + vv[None, :], (kk[:, None] < K) & (vv[None, :] < V)

@triton.jit
def _kv_t(ptr, kk, vv, K, V):
    """The same block addressed transposed, ``(BV, BK)``."""
    return ptr + kk[None, :] * V + vv[:, None], (kk[None, :] < K) & (vv[:, None] < V)

@triton.jit
def _mm(a, b, PRECISION: tl.constexpr):
    """``a @ b`` in float32 at ``PRECISION`` (``tf32`` for bf16/fp16 problems, exact otherwise)."""
    return tl.dot(a, b, input_precision=PRECISION)

@triton.jit
def _token_tile(c, CH_START, CH_LEN, r, vv, H, i_h, V):
    """Offsets and mask of chunk ``c``'s ``(C, BV)`` tile in a packed ``(tokens, H, V)`` tensor."""
    t0 = tl.load(CH_START + c).to(tl.int64)
    length = tl.load(CH_LEN + c)
    return ((t0 + r) * H + i_h)[:, None] * V + vv[None, :], (r < length)[:, None] & (vv < V)[None, :]

@triton.jit
def _token_tile_t(c, CH_START, CH_LEN, r, vv, H, i_h, V):
    """The same tile addressed transposed, ``(BV, C)``."""
    t0 = tl.load(CH_START + c).to(tl.int64)
    length = tl.load(CH_LEN + c)
    return ((t0 + r) * H + i_h)[None, :] * V + vv[:, None], (r < length)[None, :] & (vv < V)[:, None]

@triton.jit
def _row_factor(ROWS, ch, which, r, C: tl.constexpr):
    """One of a (chunk, head)'s per-row factors saved by the intra-chunk kernel (``_QS ... _WS``)."""
    return tl.load(ROWS + (ch * 5 + which) * C + r)

@triton.jit
def _decayed(X, ROWS, which, c, ch, CH_START, CH_LEN, r, kk, H, i_h, K, C: tl.constexpr):
    """``Qd`` or ``Kd`` of chunk ``c``, ``(C, BK)`` float32: its packed ``q`` or ``k`` rows times their
    factors, formed where they are used and never stored."""
    off, mask = _token_tile(c, CH_START, CH_LEN, r, kk, H, i_h, K)
    return tl.load(X + off, mask=mask, other=0.0).to(tl.float32) * _row_factor(ROWS, ch, which, r, C)[:, None]

@triton.jit
def _decayed_t(X, ROWS, which, c, ch, CH_START, CH_LEN, r, kk, H, i_h, K, C: tl.constexpr):
    """The same, loaded transposed: ``(BK, C)``."""
    off, mask = _token_tile_t(c, CH_START, CH_LEN, r, kk, H, i_h, K)
    return tl.load(X + off, mask=mask, other=0.0).to(tl.float32) * _row_factor(ROWS, ch, which, r, C)[None, :]

@triton.jit
def _sequence(OFFSETS, ORDER, H, NV):
    """This program's (sequence, head) row ``i_nh``, head, column block and chunk range ``[c_start, c_end)``.

    Programs take the sequences longest first (``ORDER``, by chunk count, descending), all heads and
    column blocks of one sequence together: the GPU starts programs in launch order, so when there are
    more programs than fit at once the longest chains start in the first wave instead of waiting for a
    slot behind short ones (MoM's shared memory sees every token, its routed ones a fraction).
    """
    pid = tl.program_id(0)
    i_n = tl.load(ORDER + pid // (H * NV))
    i_h = (pid // NV) % H
    return i_n * H + i_h, i_h, pid % NV, tl.load(OFFSETS + i_n).to(tl.int64), \
        tl.load(OFFSETS + i_n + 1).to(tl.int64)

@triton.jit
def _scan_forward_kernel(
    U, W, P, Q, K_, ROWS, GAMMA, S0, O, D, STATES, SF, OFFSETS, ORDER, CH_START, CH_LEN,
    H, K, V, NV,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_S0: tl.constexpr, SAVE: tl.constexpr, PRECISION: tl.constexpr,
):
    """The chunk-to-chunk scan of one (sequence, head, block of value columns).

    The program's state ``S[:, vv]`` is held transposed, ``(BV, d_k)``: both products of a chunk,
    ``D^T = U^T - S^T W^T`` and ``S'^T = gamma S^T + D^T Kd``, then take a register operand (the
    state, then ``D^T``) and a tile loaded from memory, and no product's result is transposed.
    With ``SAVE`` it stores the states entering each chunk and ``D`` (the outputs then come from
    the chunk-parallel :func:`_output_kernel`); without, it writes the outputs itself.
    """
    i_nh, i_h, i_v, c_start, c_end = _sequence(OFFSETS, ORDER, H, NV)
    r = tl.arange(0, C)
    kk = tl.arange(0, BK)
    vv = i_v * BV + tl.arange(0, BV)
    state = i_nh.to(tl.int64) * K * V
    st_off, st_mask = _kv_t(0, kk, vv, K, V)  # offsets within one state
    cv_t = r[None, :] * V + vv[:, None]
    cv_mask_t = (r[None, :] >= 0) & (vv[:, None] < V)
    s_t = tl.zeros([BV, BK], dtype=tl.float32)
    if HAS_S0:
        s_t = tl.load(S0 + state + st_off, mask=st_mask, other=0.0).to(tl.float32)

    for c in range(c_start, c_end):
        ch = c * H + i_h
        if SAVE:
            tl.store(STATES + ch * K * V + st_off, s_t.to(STATES.dtype.element_ty), mask=st_mask)
        u_t = tl.load(U + ch * C * V + cv_t, mask=cv_mask_t, other=0.0)
        d_t = u_t - _mm(s_t, _rows_t(W + ch * C * K, r, kk, K), PRECISION)
        if SAVE:
            tl.store(D + ch * C * V + cv_t, d_t.to(D.dtype.element_ty), mask=cv_mask_t)
        else:
            # O^T = S^T Qd^T + D^T P^T, straight into the packed token layout
            o_t = _mm(s_t, _decayed_t(Q, ROWS, _QS, c, ch, CH_START, CH_LEN, r, kk, H, i_h, K, C), PRECISION)
            o_t += _mm(d_t, _rows_t(P + ch * C * C, r, r, C), PRECISION)
            o_off, o_mask = _token_tile_t(c, CH_START, CH_LEN, r, vv, H, i_h, V)
            tl.store(O + o_off, o_t.to(O.dtype.element_ty), mask=o_mask)
        kd = _decayed(K_, ROWS, _KS, c, ch, CH_START, CH_LEN, r, kk, H, i_h, K, C)
        s_t = tl.load(GAMMA + ch) * s_t + _mm(d_t, kd, PRECISION)

    tl.store(SF + state + st_off, s_t, mask=st_mask)

@triton.jit
def _output_kernel(
    Q, ROWS, P, D, STATES, O, CH_START, CH_LEN, H, K, V,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):
    """``O = Qd S + P D`` of one (chunk, head, block of value columns), from the saved states."""
    c = tl.program_id(0).to(tl.int64)
    if tl.load(CH_LEN + c) == 0:  # a chunk of the layout's bound that no sequence owns
        return
    i_h = tl.program_id(1)
    ch = c * H + i_h
    r = tl.arange(0, C)
    kk = tl.arange(0, BK)
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    s_ptr, s_mask = _kv(STATES + ch * K * V, kk, vv, K, V)
    qd = _decayed(Q, ROWS, _QS, c, ch, CH_START, CH_LEN, r, kk, H, i_h, K, C)
    o = _mm(qd, tl.load(s_ptr, mask=s_mask, other=0.0).to(tl.float32), PRECISION)
    o += _mm(_rows(P + ch * C * C, r, r, C), _rows(D + ch * C * V, r, vv, V).to(tl.float32), PRECISION)
    o_off, o_mask = _token_tile(c, CH_START, CH_LEN, r, vv, H, i_h, V)
    tl.store(O + o_off, o.to(O.dtype.element_ty), mask=o_mask)

@triton.jit
def _output_grad_kernel(
    P, D, DO, DD_OUT, DP, CH_START, CH_LEN, H, V,
    C: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr, PRECISION: tl.constexpr,
):
    """The gradients of ``O = ... + P D`` in ``D`` and ``P``, one (chunk, head): ``P^T dO`` (the part
    of ``dD`` known before the state-gradient scan) and ``dP = dO D^T``."""
    c = tl.program_id(0).to(tl.int64)
    if tl.load(CH_LEN + c) == 0:  # a chunk of the layout's bound that no sequence owns
        return
    i_h = tl.program_id(1)
    ch = c * H + i_h
    r = tl.arange(0, C)
    p_t = _rows_t(P + ch * C * C, r, r, C)
    dp = tl.zeros([C, C], dtype=tl.float32)
    for vb in tl.static_range(NV):
        vv = vb * BV + tl.arange(0, BV)
        o_off, o_mask = _token_tile(c, CH_START, CH_LEN, r, vv, H, i_h, V)
        do = tl.load(DO + o_off, mask=o_mask, other=0.0).to(tl.float32)
        tl.store(DD_OUT + ch * C * V + r[:, None] * V + vv[None, :],
                 _mm(p_t, do, PRECISION).to(DD_OUT.dtype.element_ty), mask=(r[:, None] >= 0) & (vv[None, :] < V))
        dp += _mm(do, _rows_t(D + ch * C * V, r, vv, V).to(tl.float32), PRECISION)
    tl.store(DP + ch * C * C + r[:, None] * C + r[None, :], dp)

@triton.jit
def _scan_backward_kernel(
    W, Q, K_, ROWS, GAMMA, DO, DSF, DD, DS_NEXT, DS0, OFFSETS, ORDER, CH_START, CH_LEN,
    H, K, V, NV,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_DSF: tl.constexpr, PRECISION: tl.constexpr,
):
    """The scan in reverse for the state gradients. ``DD`` holds ``P^T dO`` on entry and ``dD`` on
    return; ``DS_NEXT`` gets the gradient of the state leaving each chunk::

        dD = P^T dO + Kd dS',    dS = gamma dS' + Qd^T dO - W^T dD
    """
    i_nh, i_h, i_v, c_start, c_end = _sequence(OFFSETS, ORDER, H, NV)
    r = tl.arange(0, C)
    kk = tl.arange(0, BK)
    vv = i_v * BV + tl.arange(0, BV)
    state = i_nh.to(tl.int64) * K * V
    s_off, s_mask = _kv(0, kk, vv, K, V)  # offsets within one state
    cv = r[:, None] * V + vv[None, :]
    cv_mask = (r[:, None] >= 0) & (vv[None, :] < V)
    ds = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DSF:
        ds = tl.load(DSF + state + s_off, mask=s_mask, other=0.0)

    for j in range(0, c_end - c_start):
        c = c_end - 1 - j
        ch = c * H + i_h
        tl.store(DS_NEXT + ch * K * V + s_off, ds.to(DS_NEXT.dtype.element_ty), mask=s_mask)
        dd = tl.load(DD + ch * C * V + cv, mask=cv_mask, other=0.0).to(tl.float32)
        dd += _mm(_decayed(K_, ROWS, _KS, c, ch, CH_START, CH_LEN, r, kk, H, i_h, K, C), ds, PRECISION)
        tl.store(DD + ch * C * V + cv, dd.to(DD.dtype.element_ty), mask=cv_mask)
        o_off, o_mask = _token_tile(c, CH_START, CH_LEN, r, vv, H, i_h, V)
        do = tl.load(DO + o_off, mask=o_mask, other=0.0).to(tl.float32)
        qd_t = _decayed_t(Q, ROWS, _QS, c, ch, CH_START, CH_LEN, r, kk, H, i_h, K, C)
        w_t = _rows_t(W + ch * C * K, r, kk, K).to(tl.float32)
        ds = tl.load(GAMMA + ch) * ds + _mm(qd_t, do, PRECISION) - _mm(w_t, dd, PRECISION)

    tl.store(DS0 + state + s_off, ds, mask=s_mask)

@triton.jit
def _state_grads_kernel(
    DO, DD, D, STATES, DS_NEXT, ROWS, Q, K_, DW, DQ, DK, RHO_Q, RHO_K, DGAMMA_PART, CH_START, CH_LEN,
    H, K, V,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr,
):
    """The gradients that pair a chunk's state with its rows, one (chunk, head, block of key
    columns), summed over the value columns: ``dW = -dD S^T``, ``dQd = dO S^T``, ``dKd = D dS'^T``
    and this block's share of ``dgamma = sum(S * dS')``. ``dQd`` and ``dKd`` leave as the
    gradients of the normalised ``q^, k^`` that they imply (``Qd = q^ e^G``, ``Kd = k^ e^{G_last - G}``),
    for the intra-chunk backward to complete, each split into its part along this block of the raw
    row (coefficient ``RHO_*``, float32, one per row and block) and the rest (``DQ, DK``, which are
    bf16 for bf16 problems). The L2 norm's backward takes out the part along the row, and these
    gradients point mostly along it: rounded whole, their bf16 error was of the size of what remains
    (dk 4.5e-3 -> 8.2e-3 relative RMS against float64 at d_k = 130); split, only the rest is rounded."""
    c = tl.program_id(0).to(tl.int64)
    if tl.load(CH_LEN + c) == 0:  # a chunk of the layout's bound that no sequence owns
        return
    i_h = tl.program_id(1)
    i_k = tl.program_id(2)
    ch = c * H + i_h
    r = tl.arange(0, C)
    kk = i_k * BK + tl.arange(0, BK)
    dw = tl.zeros([C, BK], dtype=tl.float32)
    dqd = tl.zeros([C, BK], dtype=tl.float32)
    dkd = tl.zeros([C, BK], dtype=tl.float32)
    dgamma = tl.zeros([BK], dtype=tl.float32)
    for v0 in range(0, V, BV):
        vv = v0 + tl.arange(0, BV)
        st_off, st_mask = _kv_t(ch * K * V, kk, vv, K, V)
        s_t = tl.load(STATES + st_off, mask=st_mask, other=0.0).to(tl.float32)
        n_t = tl.load(DS_NEXT + st_off, mask=st_mask, other=0.0).to(tl.float32)
        o_off, o_mask = _token_tile(c, CH_START, CH_LEN, r, vv, H, i_h, V)
        do = tl.load(DO + o_off, mask=o_mask, other=0.0).to(tl.float32)
        dw -= _mm(_rows(DD + ch * C * V, r, vv, V).to(tl.float32), s_t, PRECISION)
        dqd += _mm(do, s_t, PRECISION)
        dkd += _mm(_rows(D + ch * C * V, r, vv, V).to(tl.float32), n_t, PRECISION)
        dgamma += tl.sum(s_t * n_t, axis=0)
    out = ch * C * K + r[:, None] * K + kk[None, :]
    out_mask = (r[:, None] >= 0) & (kk[None, :] < K)
    tl.store(DW + out, dw.to(DW.dtype.element_ty), mask=out_mask)
    tok_off, tok_mask = _token_tile(c, CH_START, CH_LEN, r, kk, H, i_h, K)
    rho_off = ((tl.load(CH_START + c).to(tl.int64) + r) * H + i_h) * tl.num_programs(2) + i_k
    rho_mask = r < tl.load(CH_LEN + c)
    _split_along_row(Q, DQ, RHO_Q, dqd * _row_factor(ROWS, ch, _EG, r, C)[:, None], tok_off, tok_mask, rho_off,
                     rho_mask)
    _split_along_row(K_, DK, RHO_K, dkd * _row_factor(ROWS, ch, _ER, r, C)[:, None], tok_off, tok_mask, rho_off,
                     rho_mask)
    tl.store(DGAMMA_PART + ch * tl.num_programs(2) + i_k, tl.sum(dgamma, axis=0))

@triton.jit
def _split_along_row(X, DX, RHO, dx, off, mask, rho_off, rho_mask):
    """Store ``dx`` ``(C, BK)`` as ``rho`` (per row) times the raw rows ``X`` plus the rest, ``DX``."""
    x = tl.load(X + off, mask=mask, other=0.0).to(tl.float32)
    rho = tl.sum(x * dx, axis=1) / tl.maximum(tl.sum(x * x, axis=1), 1e-30)
    tl.store(DX + off, (dx - rho[:, None] * x).to(DX.dtype.element_ty), mask=mask)
    tl.store(RHO + rho_off, rho, mask=rho_mask)

@triton.jit
def _w_kernel(
    K_, TINV, ROWS, W, CH_START, CH_LEN, H, K,
    C: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
):
    """``W = T (k * WS)`` of one (chunk, head, block of key columns), from the saved ``(I + A)^-1``,
    the packed ``k`` and its row factor: the backward scan's one use of ``W`` recomputes it rather
    than keep it from the forward (a float32 ``(chunks, H, C, d_k)`` tensor less between the two)."""
    c = tl.program_id(0).to(tl.int64)
    if tl.load(CH_LEN + c) == 0:  # a chunk of the layout's bound that no sequence owns
        return
    i_h = tl.program_id(1)
    ch = c * H + i_h
    r = tl.arange(0, C)
    kk = tl.program_id(2) * BK + tl.arange(0, BK)
    t = tl.load(TINV + ch * C * C + r[:, None] * C + r[None, :])
    w = _mm(t, _decayed(K_, ROWS, _WS, c, ch, CH_START, CH_LEN, r, kk, H, i_h, K, C), PRECISION)
    tl.store(W + ch * C * K + r[:, None] * K + kk[None, :], w.to(W.dtype.element_ty),
             mask=(r[:, None] >= 0) & (kk[None, :] < K))

@triton.jit
def _chunk_program(CH_START, CH_LEN, H, C: tl.constexpr):
    """A per-(chunk, head) program's chunk ``ch``, head, row of the flat ``(chunks, H)`` layout, the
    chunk's rows ``r``, which of them hold tokens, and their packed token indices."""
    ch = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    r = tl.arange(0, C)
    tok = tl.load(CH_START + ch).to(tl.int64) + r
    return ch, i_h, ch * H + i_h, r, r < tl.load(CH_LEN + ch), tok

@triton.jit
def _chunk_gates(G, BETA, tok, H, i_h, valid, C: tl.constexpr, HAS_G: tl.constexpr):
    """``g`` (zeros without a decay), ``beta``, the cumulative ``G`` and ``G_last`` of one chunk."""
    if HAS_G:
        g = tl.load(G + tok * H + i_h, mask=valid, other=0.0).to(tl.float32)
    else:
        g = tl.zeros([C], dtype=tl.float32)
    beta = tl.load(BETA + tok * H + i_h, mask=valid, other=0.0).to(tl.float32)
    return g, beta, tl.cumsum(g, axis=0), tl.sum(g, axis=0)

@triton.jit
def _chunk_grams(Q, K_, qk_base, valid, K, C: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr,
                 PRECISION: tl.constexpr):
    """``k k^T``, ``q k^T`` and the squared row norms of one chunk's raw ``q, k``, over column blocks.

    The intra-chunk kernels' column loops are plain loops, not unrolled: one block's tiles are live at
    a time (unrolled, the tiles of every block stay live and spill registers: slower, benchmarks/RESULTS.md)."""
    kk = tl.zeros([C, C], dtype=tl.float32)
    qk = tl.zeros([C, C], dtype=tl.float32)
    q_sq = tl.zeros([C], dtype=tl.float32)
    k_sq = tl.zeros([C], dtype=tl.float32)
    for kb in range(NK):
        cols = kb * BK + tl.arange(0, BK)
        m = valid[:, None] & (cols[None, :] < K)
        m_t = (cols[:, None] < K) & valid[None, :]
        q_b = tl.load(Q + qk_base[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
        k_b = tl.load(K_ + qk_base[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
        k_t = tl.load(K_ + qk_base[None, :] + cols[:, None], mask=m_t, other=0.0).to(tl.float32)
        kk += tl.dot(k_b, k_t, input_precision=PRECISION)
        qk += tl.dot(q_b, k_t, input_precision=PRECISION)
        q_sq += tl.sum(q_b * q_b, axis=1)
        k_sq += tl.sum(k_b * k_b, axis=1)
    return kk, qk, q_sq, k_sq

@triton.jit
def _norm_factors(q_sq, k_sq, scale, eps, C: tl.constexpr, L2NORM: tl.constexpr):
    """Row factors ``r_q, r_k`` with ``q^ = r_q q`` (L2 norm and scale) and ``k^ = r_k k``."""
    if L2NORM:
        rq = scale / tl.sqrt(q_sq + eps)
        rk = 1.0 / tl.sqrt(k_sq + eps)
    else:
        rq = tl.zeros([C], dtype=tl.float32) + scale
        rk = tl.zeros([C], dtype=tl.float32) + 1.0
    return rq, rk

@triton.jit
def _intra_forward_kernel(
    Q, K_, V_, G, BETA, CH_START, CH_LEN, U, W, PM, ROWS, GAMMA, TINV,
    H, K, V, scale, eps,
    C: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
    HAS_G: tl.constexpr, L2NORM: tl.constexpr, SAVE_T: tl.constexpr, PRECISION: tl.constexpr,
):
    """``intra_chunk_terms`` of one (chunk, head), read straight from the packed tokens. ``Qd`` and
    ``Kd`` are not stored: their row factors are (``ROWS``), for the kernels that read ``q, k``."""
    ch, i_h, chh, r, valid, tok = _chunk_program(CH_START, CH_LEN, H, C)
    if tl.load(CH_LEN + ch) == 0:  # a chunk of the layout's bound that no sequence owns
        return
    g, beta, G_cum, G_last = _chunk_gates(G, BETA, tok, H, i_h, valid, C, HAS_G)
    qk_base = tok * H * K + i_h * K
    kk, qk, q_sq, k_sq = _chunk_grams(Q, K_, qk_base, valid, K, C, BK, NK, PRECISION)
    rq, rk = _norm_factors(q_sq, k_sq, scale, eps, C, L2NORM)

    causal = r[:, None] >= r[None, :]
    # exp of masked differences, never of a positive number (as in intra_chunk_terms)
    decay = tl.exp(tl.where(causal, G_cum[:, None] - G_cum[None, :], float("-inf")))
    kk = kk * rk[:, None] * rk[None, :]
    A = tl.where(r[:, None] > r[None, :], kk * decay * beta[:, None], 0.0)
    P = qk * rq[:, None] * rk[None, :] * decay
    tl.store(PM + chh * C * C + r[:, None] * C + r[None, :], P)
    tl.store(GAMMA + chh, tl.exp(G_last))

    # (I + A)^{-1} by forward substitution, one row at a time: rows i.. are still e_i,
    # and row i of A is zero from column i on, so a full-width product is exact.
    T = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for i in range(1, C):
        a_i = tl.sum(tl.where(r[:, None] == i, A, 0.0), axis=0)
        row = tl.where(r == i, 1.0, -tl.sum(a_i[:, None] * T, axis=0))
        T = tl.where(r[:, None] == i, row[None, :], T)
    if SAVE_T:
        tl.store(TINV + chh * C * C + r[:, None] * C + r[None, :], T)

    for vb in range(NV):
        cols = vb * BV + tl.arange(0, BV)
        m = valid[:, None] & (cols[None, :] < V)
        v_b = tl.load(V_ + (tok * H * V + i_h * V)[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
        u = tl.dot(T, v_b * beta[:, None], input_precision=PRECISION)
        tl.store(U + chh * C * V + r[:, None] * V + cols[None, :], u.to(U.dtype.element_ty), mask=(r[:, None] >= 0) & (cols[None, :] < V))
    e_g = tl.exp(G_cum)
    e_rest = tl.exp(G_last - G_cum)
    w_scale = beta * e_g * rk
    rows = ROWS + chh * 5 * C + r
    tl.store(rows + _QS * C, rq * e_g)
    tl.store(rows + _KS * C, rk * e_rest)
    tl.store(rows + _EG * C, e_g)
    tl.store(rows + _ER * C, e_rest)
    tl.store(rows + _WS * C, w_scale)
    for kb in range(NK):
        cols = kb * BK + tl.arange(0, BK)
        m = valid[:, None] & (cols[None, :] < K)
        k_b = tl.load(K_ + qk_base[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(W + chh * C * K + r[:, None] * K + cols[None, :],
                 tl.dot(T, k_b * w_scale[:, None], input_precision=PRECISION).to(W.dtype.element_ty),
                 mask=(r[:, None] >= 0) & (cols[None, :] < K))

@triton.jit
def _intra_backward_matrices_kernel(
    Q, K_, V_, G, BETA, CH_START, CH_LEN, TINV, DU, DW, DPM, SYM, MPE, ROWB, DV, DBETA,
    H, K, V, scale, eps,
    C: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
    HAS_G: tl.constexpr, L2NORM: tl.constexpr, PRECISION: tl.constexpr,
):
    """The first half of the gradients of ``intra_chunk_terms``, one (chunk, head): everything that
    lives in ``(C, C)`` matrices. With hats for the normalised, scaled vectors, ``E_ij = e^{G_i - G_j}``
    (i >= j), ``A = tril_-1(beta_i (k^ k^T)_ij E_ij)`` and ``T = (I + A)^-1`` (saved)::

        U = T (beta v),  W = T (beta e^G k^),  P = (q^ k^T) E,  Qd = q^ e^G,
        Kd = k^ e^{G_last - G},  gamma = e^{G_last}

    so ``dA = -T^T (dU (beta v)^T + dW (beta e^G k^)^T) T^T`` and the rest is the chain rule. Writes
    ``dv`` and ``dbeta`` (complete), the matrices that the rows' gradients need, ``SYM`` (the
    symmetric gradient of ``k^ k^T``) and ``MPE = dP * E``, and per row (``ROWB``) the part of the
    gradient of ``G`` found here and ``|q|^2, |k|^2``. Every transposed matrix is either loaded
    transposed or computed as its own product (``dA^T = -T dT^T T``): no ``tl.trans`` of a product
    feeds a ``tl.dot``. (One kernel for both halves held too many ``(C, C)`` matrices at once to stay in
    registers; the column loops of both halves are plain loops, not unrolled, so that one block's tiles
    are live at a time: unrolled, they spilled registers too. Counts in benchmarks/RESULTS.md.)
    """
    ch, i_h, chh, r, valid, tok = _chunk_program(CH_START, CH_LEN, H, C)
    if tl.load(CH_LEN + ch) == 0:  # a chunk of the layout's bound that no sequence owns
        return
    g, beta, G_cum, G_last = _chunk_gates(G, BETA, tok, H, i_h, valid, C, HAS_G)
    e_g = tl.exp(G_cum)
    qk_base = tok * H * K + i_h * K
    v_base = tok * H * V + i_h * V
    cc = chh * C * C + r[:, None] * C + r[None, :]
    cc_t = chh * C * C + r[None, :] * C + r[:, None]

    kk, qk, q_sq, k_sq = _chunk_grams(Q, K_, qk_base, valid, K, C, BK, NK, PRECISION)
    rq, rk = _norm_factors(q_sq, k_sq, scale, eps, C, L2NORM)
    E = tl.exp(tl.where(r[:, None] >= r[None, :], G_cum[:, None] - G_cum[None, :], float("-inf")))
    # P's part first, so that qk and dP are dead before the T products.
    M = tl.load(DPM + cc).to(tl.float32) * E
    tl.store(MPE + cc, M)
    dPP = M * qk * rq[:, None] * rk[None, :]
    dG = tl.sum(dPP, axis=1) - tl.sum(dPP, axis=0)

    strict = r[:, None] > r[None, :]
    kk = kk * rk[:, None] * rk[None, :]
    A = tl.where(strict, kk * E * beta[:, None], 0.0)
    T = tl.load(TINV + cc)
    T_t = tl.load(TINV + cc_t)

    # dT = dU (beta v)^T + dW (beta e^G k^)^T and its transpose, each as its own product.
    dT = tl.zeros([C, C], dtype=tl.float32)
    dT_t = tl.zeros([C, C], dtype=tl.float32)
    dbeta = tl.zeros([C], dtype=tl.float32)
    for vb in range(NV):
        cols = vb * BV + tl.arange(0, BV)
        m = valid[:, None] & (cols[None, :] < V)
        m_t = (cols[:, None] < V) & valid[None, :]
        cv = chh * C * V + r[:, None] * V + cols[None, :]
        cv_t = chh * C * V + r[None, :] * V + cols[:, None]
        cv_mask = (r[:, None] >= 0) & (cols[None, :] < V)
        cv_mask_t = (cols[:, None] < V) & (r[None, :] >= 0)
        v_b = tl.load(V_ + v_base[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
        v_t = tl.load(V_ + v_base[None, :] + cols[:, None], mask=m_t, other=0.0).to(tl.float32)
        du = tl.load(DU + cv, mask=cv_mask, other=0.0).to(tl.float32)
        du_t = tl.load(DU + cv_t, mask=cv_mask_t, other=0.0).to(tl.float32)
        dT += tl.dot(du, v_t * beta[None, :], input_precision=PRECISION)
        dT_t += tl.dot(v_b * beta[:, None], du_t, input_precision=PRECISION)
        y = tl.dot(T_t, du, input_precision=PRECISION)  # T^T dU = d(beta v)
        tl.store(DV + v_base[:, None] + cols[None, :], (y * beta[:, None]).to(DV.dtype.element_ty), mask=m)
        dbeta += tl.sum(v_b * y, axis=1)
    w_in = beta * e_g * rk  # W's input is w_in * k (raw k)
    for kb in range(NK):
        cols = kb * BK + tl.arange(0, BK)
        m = valid[:, None] & (cols[None, :] < K)
        m_t = (cols[:, None] < K) & valid[None, :]
        ck = chh * C * K + r[:, None] * K + cols[None, :]
        ck_t = chh * C * K + r[None, :] * K + cols[:, None]
        k_b = tl.load(K_ + qk_base[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
        k_t = tl.load(K_ + qk_base[None, :] + cols[:, None], mask=m_t, other=0.0).to(tl.float32)
        dw = tl.load(DW + ck, mask=(r[:, None] >= 0) & (cols[None, :] < K), other=0.0).to(tl.float32)
        dw_t = tl.load(DW + ck_t, mask=(cols[:, None] < K) & (r[None, :] >= 0), other=0.0).to(tl.float32)
        dT += tl.dot(dw, k_t * w_in[None, :], input_precision=PRECISION)
        dT_t += tl.dot(k_b * w_in[:, None], dw_t, input_precision=PRECISION)
        x = tl.dot(T_t, dw, input_precision=PRECISION)  # T^T dW = d(beta e^G k^)
        s = tl.sum(k_b * rk[:, None] * x, axis=1)
        dbeta += e_g * s
        dG += beta * e_g * s

    dA = tl.where(strict, -tl.dot(tl.dot(T_t, dT, input_precision=PRECISION), T_t, input_precision=PRECISION), 0.0)
    dA_t = tl.where(r[:, None] < r[None, :],
                    -tl.dot(tl.dot(T, dT_t, input_precision=PRECISION), T, input_precision=PRECISION), 0.0)
    dbeta += tl.sum(dA * kk * E, axis=1)
    dAA = dA * A
    dG += tl.sum(dAA, axis=1) - tl.sum(dAA, axis=0)
    # d(k^ k^T) symmetrised: dKk + dKk^T with dKk = dA beta_i E_ij
    E_t = tl.exp(tl.where(r[:, None] <= r[None, :], G_cum[None, :] - G_cum[:, None], float("-inf")))
    tl.store(SYM + cc, dA * beta[:, None] * E + dA_t * beta[None, :] * E_t)
    tl.store(DBETA + tok * H + i_h, dbeta, mask=valid)
    rows = ROWB + chh * 3 * C + r
    tl.store(rows, dG)
    tl.store(rows + C, q_sq)
    tl.store(rows + 2 * C, k_sq)

@triton.jit
def _intra_backward_rows_kernel(
    Q, K_, G, BETA, CH_START, CH_LEN, TINV, DW, DGAMMA, SYM, MPE, ROWB,
    DQ, DK, RHO_Q, RHO_K, DQ_SUM, DK_SUM, DQ_OUT, DK_OUT, DG,
    H, K, scale, eps,
    C: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr, RHO_BK: tl.constexpr, RHO_NK: tl.constexpr,
    HAS_G: tl.constexpr, L2NORM: tl.constexpr, PRECISION: tl.constexpr,
):
    """The second half, one (chunk, head): the gradients of ``q, k`` and ``g``, from the matrices of
    :func:`_intra_backward_matrices_kernel`. ``DQ, DK`` and ``RHO_*`` enter holding the gradients of
    ``q^, k^`` through ``Qd, Kd`` as the state-gradient kernel split them (``RHO_BK`` its block of
    columns); they are completed in the packed float32 ``DQ_SUM, DK_SUM`` before the normalisation's
    backward writes ``dq, dk`` in the inputs' dtype (any of these buffers may be one and the same)."""
    ch, i_h, chh, r, valid, tok = _chunk_program(CH_START, CH_LEN, H, C)
    if tl.load(CH_LEN + ch) == 0:  # a chunk of the layout's bound that no sequence owns
        return
    g, beta, G_cum, G_last = _chunk_gates(G, BETA, tok, H, i_h, valid, C, HAS_G)
    e_g = tl.exp(G_cum)
    qk_base = tok * H * K + i_h * K
    cc = chh * C * C + r[:, None] * C + r[None, :]
    cc_t = chh * C * C + r[None, :] * C + r[:, None]
    rows = ROWB + chh * 3 * C + r
    dG = tl.load(rows)
    q_sq = tl.load(rows + C)
    k_sq = tl.load(rows + 2 * C)
    rq, rk = _norm_factors(q_sq, k_sq, scale, eps, C, L2NORM)
    T_t = tl.load(TINV + cc_t)
    sym = tl.load(SYM + cc)
    M = tl.load(MPE + cc)
    M_t = tl.load(MPE + cc_t)

    # dq^ and dk^ per column block (kept unnormalised in DQ, DK, float32), and their row dots. The
    # parts through Qd = q^ e^G and Kd = k^ e^{G_last - G} are already there (dq0, dk0): their decay
    # gradients are the row dots with q^, k^.
    q_dot = tl.zeros([C], dtype=tl.float32)
    k_dot = tl.zeros([C], dtype=tl.float32)
    rho_row = (tok * H + i_h) * RHO_NK
    dG_last = tl.load(DGAMMA + chh).to(tl.float32) * tl.exp(G_last)
    for kb in range(NK):
        cols = kb * BK + tl.arange(0, BK)
        m = valid[:, None] & (cols[None, :] < K)
        q_b = tl.load(Q + qk_base[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
        k_b = tl.load(K_ + qk_base[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
        qh = q_b * rq[:, None]
        kh = k_b * rk[:, None]
        rho_q = tl.load(RHO_Q + rho_row + kb * BK // RHO_BK, mask=valid, other=0.0)
        rho_k = tl.load(RHO_K + rho_row + kb * BK // RHO_BK, mask=valid, other=0.0)
        dq0 = tl.load(DQ + qk_base[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32) \
            + rho_q[:, None] * q_b
        dk0 = tl.load(DK + qk_base[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32) \
            + rho_k[:, None] * k_b
        dw = tl.load(DW + chh * C * K + r[:, None] * K + cols[None, :],
                     mask=(r[:, None] >= 0) & (cols[None, :] < K), other=0.0).to(tl.float32)
        dq_h = tl.dot(M, kh, input_precision=PRECISION) + dq0
        dk_h = (tl.dot(T_t, dw, input_precision=PRECISION) * (beta * e_g)[:, None]
                + tl.dot(sym, kh, input_precision=PRECISION) + tl.dot(M_t, qh, input_precision=PRECISION)
                + dk0)
        dG += tl.sum(dq0 * qh, axis=1)
        s = tl.sum(dk0 * kh, axis=1)
        dG -= s
        dG_last += tl.sum(s, axis=0)
        q_dot += tl.sum(q_b * dq_h, axis=1)
        k_dot += tl.sum(k_b * dk_h, axis=1)
        tl.debug_barrier()  # every thread has read this block of DQ, DK before any overwrites it
        tl.store(DQ_SUM + qk_base[:, None] + cols[None, :], dq_h, mask=m)
        tl.store(DK_SUM + qk_base[:, None] + cols[None, :], dk_h, mask=m)

    dG = dG + tl.where(r == C - 1, dG_last, 0.0)
    dg = tl.sum(dG, axis=0) - tl.cumsum(dG, axis=0) + dG  # G = cumsum(g)
    if HAS_G:
        tl.store(DG + tok * H + i_h, dg, mask=valid)

    # Through the normalisation: d q = r_q (dq^ - q (q . dq^) / (|q|^2 + eps)), same for k, from the
    # sums (other threads wrote them: hence the barrier) into the outputs, which may be the sums
    # themselves (hence the second barrier, before a block is overwritten).
    tl.debug_barrier()
    for kb in range(NK):
        cols = kb * BK + tl.arange(0, BK)
        m = valid[:, None] & (cols[None, :] < K)
        ptr = qk_base[:, None] + cols[None, :]
        dq_h = tl.load(DQ_SUM + ptr, mask=m, other=0.0)
        dk_h = tl.load(DK_SUM + ptr, mask=m, other=0.0)
        if L2NORM:
            q_b = tl.load(Q + ptr, mask=m, other=0.0).to(tl.float32)
            k_b = tl.load(K_ + ptr, mask=m, other=0.0).to(tl.float32)
            dq_h = rq[:, None] * (dq_h - q_b * (q_dot / (q_sq + eps))[:, None])
            dk_h = rk[:, None] * (dk_h - k_b * (k_dot / (k_sq + eps))[:, None])
        else:
            dq_h = dq_h * scale
        tl.debug_barrier()
        tl.store(DQ_OUT + ptr, dq_h.to(DQ_OUT.dtype.element_ty), mask=m)
        tl.store(DK_OUT + ptr, dk_h.to(DK_OUT.dtype.element_ty), mask=m)

@triton.jit
def _step_kernel(
    Q, K_, V_, G, BETA, S, O, S_OUT, SLOTS,
    H, K, V, scale, eps,
    BK: tl.constexpr, BV: tl.constexpr, HAS_G: tl.constexpr, L2NORM: tl.constexpr, HAS_SLOTS: tl.constexpr,
):
    i_nh = tl.program_id(0).to(tl.int64)
    i_sh = i_nh  # this program's (state, head) in S and S_OUT
    if HAS_SLOTS:
        i_sh = tl.load(SLOTS + i_nh // H).to(tl.int64) * H + i_nh % H
    i_v = tl.program_id(1)
    kk = tl.arange(0, BK)
    vv = i_v * BV + tl.arange(0, BV)
    mk = kk < K
    mv = vv < V
    q = tl.load(Q + i_nh * K + kk, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(K_ + i_nh * K + kk, mask=mk, other=0.0).to(tl.float32)
    if L2NORM:
        q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + eps))
        k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + eps))
    q = q * scale
    v = tl.load(V_ + i_nh * V + vv, mask=mv, other=0.0).to(tl.float32)
    beta = tl.load(BETA + i_nh).to(tl.float32)
    kv_off = i_sh * K * V + kk[:, None] * V + vv[None, :]
    kv_mask = mk[:, None] & mv[None, :]
    s = tl.load(S + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
    if HAS_G:
        s = s * tl.exp(tl.load(G + i_nh).to(tl.float32))
    residual = v - tl.sum(s * k[:, None], axis=0)
    s = s + k[:, None] * (beta * residual)[None, :]
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(S_OUT + kv_off, s, mask=kv_mask)
    tl.store(O + i_nh * V + vv, o, mask=mv)


def _block(dim: int) -> int:
    return max(16, triton.next_power_of_2(dim))


def _state_tiles(key_dim: int) -> tuple[int, int]:
    """``(BK, NK)``: the intra-chunk kernels' tile of key columns and how many of them cover ``d_k``."""
    BK = min(64, _block(key_dim))
    return BK, triton.cdiv(key_dim, BK)


def _precision(low_precision: bool) -> str:
    # float32 problems get exact float32 products; bf16/fp16 ones TF32 tensor cores,
    # which keep more mantissa (10 bits) than the inputs had.
    return "tf32" if low_precision else "ieee"


# Launch configurations: the fastest of those tried (benchmarks/RESULTS.md). The scans are latency-bound
# chains of products. The forward scan runs value blocks of 32 with 4 warps rather than 64 with 8 (more
# programs resident per SM hide each other's loads); the backward scan, which carries more per program,
# stays fastest at 64 with 8 warps. The chunk-parallel kernels are bandwidth-bound reads of the saved states.
_SCAN_FWD_BV, _SCAN_FWD_WARPS = 32, 4
_SCAN_BWD_BV, _SCAN_BWD_WARPS = 64, 8
_OUT_BV, _OUT_WARPS = 64, 4
_GRAD_BK, _GRAD_BV, _GRAD_WARPS = 128, 32, 8
_W_BK, _W_WARPS = 128, 4  # faster than 64 x 4 warps, 128 x 8 or 256 x 8 (benchmarks/RESULTS.md)
# (forward, backward matrices, backward rows): one program per (chunk, head)
_INTRA_WARPS, _INTRA_STAGES = (4, 8, 8), (1, 1, 1)


# Whether the forward of training keeps the states entering every chunk and ``D`` for the backward (True), or
# the backward makes them again (False, the default). The states are a (d_k x d_v) matrix per chunk and head:
# at head size 256 they outweigh the layer's other saved activations several times over, most of all in MoM,
# whose tokens visit several memories. Making them again costs one intra-chunk forward and one scan per
# backward, a few percent of a whole model's step; keeping them trades that for peak memory
# (benchmarks/RESULTS.md has both).
KEEP_CHUNK_STATES = False


def _stored_dtype(low_precision: bool) -> torch.dtype:
    """The dtype of the per-chunk tensors that pass between kernels through memory once computed: the
    states entering each chunk and ``D`` (saved by the forward), and the gradients ``dD``, ``dW`` and of
    each state (made and used within the backward).

    None of them is carried from chunk to chunk (the scans carry float32 states and state gradients in
    registers) and each is rounded once, where it is written, after its sums ran in float32: bf16 for
    bf16/fp16 problems halves their traffic and memory (flash-linear-attention keeps these in bf16 too).
    The forward's ``W`` and ``U`` stay float32: its scan subtracts ``W S`` from ``U``, and ``D`` is their small
    difference once the memory predicts its values. Measured against float64 in benchmarks/RESULTS.md.
    """
    return torch.bfloat16 if low_precision else torch.float32


def _intra_launch_args(K: int, V: int, chunk_size: int) -> dict:
    BK, NK = _state_tiles(K)
    BV = min(64, _block(V))
    return dict(C=chunk_size, BK=BK, NK=NK, BV=BV, NV=triton.cdiv(V, BV))


def _intra_forward(q, k, v, g, beta, chunk_start, chunk_len, chunk_size, scale, use_qk_l2norm, eps,
                   low_precision, save_t: bool):
    """``U, W, P``, the row factors and ``gamma`` of every chunk (float32), and ``(I + A)^-1`` if asked."""
    H, K, V = q.shape[1], q.shape[2], v.shape[2]
    n_chunks, C = chunk_start.numel(), chunk_size
    f32 = dict(dtype=torch.float32, device=q.device)
    # Float32 for every problem: bf16 chunk terms (flash-linear-attention's choice) saved little time and
    # took the gradients' error against the float64 reference from 3e-3 to 1.4e-2 (d_k = 130), past the
    # 1e-2 bound (benchmarks/RESULTS.md).
    U, W = torch.empty(n_chunks, H, C, V, **f32), torch.empty(n_chunks, H, C, K, **f32)
    Pm, gamma = torch.empty(n_chunks, H, C, C, **f32), torch.empty(n_chunks, H, **f32)
    rows = torch.empty(n_chunks, H, 5, C, **f32)
    T = torch.empty_like(Pm) if save_t else Pm
    _intra_forward_kernel[(n_chunks, H)](
        q, k, v, g if g is not None else beta, beta, chunk_start, chunk_len, U, W, Pm, rows, gamma, T,
        H, K, V, scale, eps, **_intra_launch_args(K, V, C), HAS_G=g is not None, L2NORM=use_qk_l2norm,
        SAVE_T=save_t, PRECISION=_precision(low_precision), num_warps=_INTRA_WARPS[0], num_stages=_INTRA_STAGES[0],
    )
    return U, W, Pm, rows, gamma, T


def _scan_forward(U, W, P, q, k, rows, gamma, S0, offsets, order, chunk_start, chunk_len, out_dtype, save: bool,
                  low_precision: bool, outputs: bool = True):
    """The outputs ``O``, final states and, when ``save``, ``D`` and the states entering every chunk;
    ``outputs=False`` (with ``save``) skips ``O``, for a backward that makes the saved tensors again."""
    n_chunks, H, C, V = U.shape
    K = W.shape[-1]
    N = offsets.numel() - 1
    O = U.new_empty(q.shape[0], H, V, dtype=out_dtype)
    SF = U.new_empty(N, H, K, V, dtype=torch.float32)
    D = U.new_empty(U.shape, dtype=_stored_dtype(low_precision)) if save else U.new_empty(0)
    states = U.new_empty(n_chunks, H, K, V, dtype=_stored_dtype(low_precision)) if save else U.new_empty(0)
    BK, BV, precision = _block(K), min(_SCAN_FWD_BV, _block(V)), _precision(low_precision)
    NV = triton.cdiv(V, BV)
    _scan_forward_kernel[(N * H * NV,)](
        U, W, P, q, k, rows, gamma, S0 if S0 is not None else U, O, D, states, SF, offsets, order, chunk_start,
        chunk_len, H, K, V, NV, C=C, BK=BK, BV=BV, HAS_S0=S0 is not None, SAVE=save, PRECISION=precision,
        num_warps=_SCAN_FWD_WARPS, num_stages=1,
    )
    if save and outputs:  # the outputs, from the saved states, in parallel over chunks
        BV = min(_OUT_BV, _block(V))
        _output_kernel[(n_chunks, H, triton.cdiv(V, BV))](
            q, rows, P, D, states, O, chunk_start, chunk_len, H, K, V, C=C, BK=BK, BV=BV, PRECISION=precision,
            num_warps=_OUT_WARPS, num_stages=1,
        )
    return O, SF, D, states


def _recompute_w(k, T, rows, chunk_start, chunk_len, low_precision: bool) -> torch.Tensor:
    """``W`` of every chunk as the intra-chunk forward made it (see :func:`_w_kernel`), for the backward
    scan: stored in :func:`_stored_dtype`, as the other per-chunk tensors of the backward. The backward
    scan only multiplies it into ``dD`` (``dS -= W^T dD``), where rounding it costs ~1e-4 relative against
    float64; the forward scan, whose ``D = U - W S`` is a small difference, keeps its ``W`` float32."""
    n_chunks, H, C, _ = T.shape
    K = k.shape[-1]
    W = T.new_empty(n_chunks, H, C, K, dtype=_stored_dtype(low_precision))
    BK = min(_W_BK, _block(K))
    _w_kernel[(n_chunks, H, triton.cdiv(K, BK))](k, T, rows, W, chunk_start, chunk_len, H, K, C=C, BK=BK,
                                                 PRECISION=_precision(low_precision), num_warps=_W_WARPS,
                                                 num_stages=1)
    return W


def _state_path_buffer(x: torch.Tensor) -> torch.Tensor:
    """Where the state-gradient kernel leaves the gradient of ``q^`` or ``k^`` through ``Qd`` or ``Kd``
    (less its part along the row): for bf16 problems the bf16 output ``dq`` or ``dk`` itself, which it
    becomes in the end, else float32 (fp16's range is too narrow for unnormalised gradients)."""
    if x.dtype == torch.bfloat16:
        return torch.empty_like(x)
    return torch.empty(x.shape, dtype=torch.float32, device=x.device)


def _scan_backward(T, P, q, k, rows, gamma, D, states, offsets, order, chunk_start, chunk_len, dO, dSF,
                   low_precision: bool):
    """The scan's gradients: ``dD`` (= ``dU``), ``dW``, ``dP``, ``dgamma``, ``dS0``, and the packed gradients
    of ``q^, k^`` through ``Qd, Kd`` as the state-gradient kernel splits them (completed by the intra-chunk
    backward): ``(rest of dq^, rest of dk^, coefficients along q, along k, their block of columns)``."""
    n_chunks, H, C, V = D.shape
    K = k.shape[-1]
    N = offsets.numel() - 1
    precision, stored = _precision(low_precision), _stored_dtype(low_precision)
    dD, dP = D.new_empty(D.shape, dtype=stored), torch.empty_like(P)
    BV = min(_OUT_BV, _block(V))
    _output_grad_kernel[(n_chunks, H)](
        P, D, dO, dD, dP, chunk_start, chunk_len, H, V, C=C, BV=BV, NV=triton.cdiv(V, BV), PRECISION=precision,
        num_warps=_OUT_WARPS, num_stages=1,
    )
    W = _recompute_w(k, T, rows, chunk_start, chunk_len, low_precision)
    ds_next = torch.empty_like(states)
    dS0 = D.new_empty(N, H, K, V, dtype=torch.float32)
    BV = min(_SCAN_BWD_BV, _block(V))
    NV = triton.cdiv(V, BV)
    _scan_backward_kernel[(N * H * NV,)](
        W, q, k, rows, gamma, dO, dSF if dSF is not None else dS0, dD, ds_next, dS0, offsets, order, chunk_start,
        chunk_len, H, K, V, NV, C=C, BK=_block(K), BV=BV, HAS_DSF=dSF is not None, PRECISION=precision,
        num_warps=_SCAN_BWD_WARPS, num_stages=1,
    )
    del W
    dW = D.new_empty(n_chunks, H, C, K, dtype=stored)
    dq_s, dk_s = _state_path_buffer(q), _state_path_buffer(k)
    BK, BV = min(_GRAD_BK, _block(K)), min(_GRAD_BV, _block(V))
    n_k = triton.cdiv(K, BK)
    rho_q, rho_k = (D.new_empty(q.shape[0], H, n_k, dtype=torch.float32) for _ in range(2))
    dgamma = D.new_empty(n_chunks, H, n_k, dtype=torch.float32)
    _state_grads_kernel[(n_chunks, H, n_k)](
        dO, dD, D, states, ds_next, rows, q, k, dW, dq_s, dk_s, rho_q, rho_k, dgamma, chunk_start, chunk_len,
        H, K, V, C=C, BK=BK, BV=BV, PRECISION=precision, num_warps=_GRAD_WARPS, num_stages=2,
    )
    return dD, dW, dP, dgamma.sum(-1), dS0, (dq_s, dk_s, rho_q, rho_k, BK)


def _intra_backward(q, k, v, g, beta, chunk_start, chunk_len, T, dU, dW, dP, dgamma, state_path, chunk_size, scale,
                    use_qk_l2norm, eps, low_precision):
    """Gradients of the packed ``q, k, v, g, beta``; ``state_path``: the gradients of ``q^, k^`` so far, as
    :func:`_scan_backward` returns them (their buffers become ``dq, dk`` where they have the inputs' dtype).

    The complete gradients of ``q^, k^`` are summed in float32 before the normalisation's backward: for
    bf16 problems in buffers made here, after the states and ``D`` are freed, so that they do not add to
    the state-gradient kernel's peak."""
    dq_s, dk_s, rho_q, rho_k, rho_bk = state_path
    f32 = dict(dtype=torch.float32, device=q.device)
    dq_sum = dq_s if dq_s.dtype == torch.float32 else torch.empty(q.shape, **f32)
    dk_sum = dk_s if dk_s.dtype == torch.float32 else torch.empty(k.shape, **f32)
    dq = dq_s if dq_s.dtype == q.dtype else torch.empty_like(q)
    dk = dk_s if dk_s.dtype == k.dtype else torch.empty_like(k)
    dv = torch.empty_like(v)
    dbeta = torch.empty(beta.shape, **f32)
    dg = torch.empty_like(dbeta) if g is not None else dbeta
    sym, mpe = torch.empty_like(T), torch.empty_like(T)
    rows = torch.empty(T.shape[0], T.shape[1], 3, chunk_size, **f32)
    H, K, V = q.shape[1], q.shape[2], v.shape[2]
    grid = (chunk_start.numel(), H)
    g_or_beta = g if g is not None else beta
    args = _intra_launch_args(K, V, chunk_size)
    flags = dict(HAS_G=g is not None, L2NORM=use_qk_l2norm, PRECISION=_precision(low_precision))
    _intra_backward_matrices_kernel[grid](
        q, k, v, g_or_beta, beta, chunk_start, chunk_len, T, dU, dW, dP, sym, mpe, rows, dv, dbeta,
        H, K, V, scale, eps, **args, **flags, num_warps=_INTRA_WARPS[1], num_stages=_INTRA_STAGES[1],
    )
    _intra_backward_rows_kernel[grid](
        q, k, g_or_beta, beta, chunk_start, chunk_len, T, dW, dgamma, sym, mpe, rows, dq_s, dk_s, rho_q, rho_k,
        dq_sum, dk_sum, dq, dk, dg, H, K, scale, eps, C=chunk_size, BK=args["BK"], NK=args["NK"], RHO_BK=rho_bk,
        RHO_NK=rho_q.shape[-1], **flags, num_warps=_INTRA_WARPS[2], num_stages=_INTRA_STAGES[2],
    )
    return dq, dk, dv, None if g is None else dg.to(g.dtype), dbeta.to(beta.dtype)


def _release(*tensors: torch.Tensor) -> None:
    """Free the memory of saved tensors the backward has used up (the graph keeps only their shells).

    A second backward through the same graph (``retain_graph=True``) finds them empty and recomputes
    them (:func:`_released`). Under ``torch.compile`` they are left to the compiler."""
    if not torch.compiler.is_compiling():
        for t in tensors:
            t.untyped_storage().resize_(0)


def _released(t: torch.Tensor) -> bool:
    return t.numel() > 0 and t.untyped_storage().nbytes() == 0


class _ChunkedGatedDelta(torch.autograd.Function):
    """The chunked gated delta rule over a flat chunk layout: intra-chunk terms, then the scan.

    The forward saves ``(I + A)^-1``, ``P``, the row factors and, with :data:`KEEP_CHUNK_STATES`, the
    states entering each chunk and ``D``; else the backward makes those again. The backward recomputes
    ``W`` and frees the states and ``D`` as soon as the state-gradient kernel has read them, so that they
    are not held beside the intra-chunk backward's buffers."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, S0, offsets, chunk_start, chunk_len, order, config):
        chunk_size, scale, use_qk_l2norm, eps, out_dtype, low_precision = config
        save = any(ctx.needs_input_grad[:6])
        U, W, P, rows, gamma, T = _intra_forward(q, k, v, g, beta, chunk_start, chunk_len, chunk_size, scale,
                                                 use_qk_l2norm, eps, low_precision, save_t=save)
        if order is None:  # the scans take the sequences longest first (see _sequence)
            order = torch.argsort(offsets[1:] - offsets[:-1], descending=True, stable=True)
        O, SF, D, states = _scan_forward(U, W, P, q, k, rows, gamma, S0, offsets, order, chunk_start, chunk_len,
                                         out_dtype, save and KEEP_CHUNK_STATES, low_precision)
        if save:
            ctx.save_for_backward(q, k, v, g, beta, S0, T, P, rows, gamma, D, states, offsets, order, chunk_start,
                                  chunk_len)
        ctx.config = config
        return O, SF

    @staticmethod
    def backward(ctx, dO, dSF):
        q, k, v, g, beta, S0, T, P, rows, gamma, D, states, offsets, order, chunk_start, chunk_len = ctx.saved_tensors
        chunk_size, scale, use_qk_l2norm, eps, out_dtype, low_precision = ctx.config
        if states.numel() == 0 or _released(states):  # not kept, or a second backward: the forward's scan again
            U, W, *_ = _intra_forward(q, k, v, g, beta, chunk_start, chunk_len, chunk_size, scale, use_qk_l2norm,
                                      eps, low_precision, save_t=False)
            _, _, D, states = _scan_forward(U, W, P, q, k, rows, gamma, S0, offsets, order, chunk_start,
                                            chunk_len, out_dtype, True, low_precision, outputs=False)
            del U, W
        dO = D.new_zeros(q.shape[0], D.shape[1], D.shape[-1]) if dO is None else dO.contiguous()
        dU, dW, dP, dgamma, dS0, state_path = _scan_backward(
            T, P, q, k, rows, gamma, D, states, offsets, order, chunk_start, chunk_len, dO,
            None if dSF is None else dSF.contiguous(), low_precision,
        )
        _release(states, D)
        del states, D
        grads = _intra_backward(q, k, v, g, beta, chunk_start, chunk_len, T, dU, dW, dP, dgamma, state_path,
                                chunk_size, scale, use_qk_l2norm, eps, low_precision)
        return (*grads, dS0 if S0 is not None else None, None, None, None, None, None)


def chunk_packed(q, k, v, g, beta, S0, offsets: torch.Tensor, chunk_start: torch.Tensor, chunk_len: torch.Tensor,
                 chunk_size: int, scale: float, use_qk_l2norm: bool, eps: float, out_dtype: torch.dtype,
                 low_precision: bool = False, order: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule over packed tokens, with its backward.

    ``q, k`` ``(P, H, d_k)``, ``v`` ``(P, H, d_v)``, ``g`` (or ``None``) and ``beta`` ``(P, H)`` as
    given (L2 norm and ``scale`` are applied here); ``S0`` ``(N, H, d_k, d_v)`` or ``None``. Sequence
    ``i`` owns chunks ``offsets[i]:offsets[i + 1]`` and chunk ``c`` holds tokens ``chunk_start[c] ...``
    (``chunk_len[c]`` of them). ``order``: the sequences in the order the scans take them, longest first
    (made here when not given). Returns the outputs ``(P, H, d_v)`` (``out_dtype``) and the final states
    (float32).
    """
    q, k, v, beta = (x.contiguous() for x in (q, k, v, beta))
    g = None if g is None else g.contiguous()
    S0 = None if S0 is None else S0.contiguous()
    config = (chunk_size, scale, use_qk_l2norm, eps, out_dtype, low_precision)
    return _ChunkedGatedDelta.apply(q, k, v, g, beta, S0, offsets, chunk_start, chunk_len, order, config)


def step(q, k, v, g, beta, state, scale: float, use_qk_l2norm: bool, eps: float, slots=None):
    """One fused decoding step; shapes as ``gated_delta.step_gated_delta``. Float32 state and output.

    With ``slots`` (``(N,)`` distinct indices into a contiguous float32 ``state`` of any length), sequence
    ``n`` steps ``state[slots[n]]`` in place (each program reads and writes only its own tile) and
    ``state`` itself is returned as the new state.
    """
    N, H, K = q.shape
    V = v.shape[-1]
    q, k, v, beta = (x.contiguous() for x in (q, k, v, beta))
    g = None if g is None else g.contiguous()
    o = torch.empty(N, H, V, dtype=torch.float32, device=v.device)
    if slots is None:
        state = state.contiguous()
        new_state = torch.empty(N, H, K, V, dtype=torch.float32, device=v.device)
    else:
        if state.dtype != torch.float32 or not state.is_contiguous():
            raise ValueError("an in-place step needs a contiguous float32 state")
        slots, new_state = slots.contiguous(), state
    BV = min(64, _block(V))
    _step_kernel[(N * H, triton.cdiv(V, BV))](
        q, k, v, g if g is not None else beta, beta, state, o, new_state, slots if slots is not None else beta,
        H, K, V, scale, eps, BK=_block(K), BV=BV, HAS_G=g is not None, L2NORM=use_qk_l2norm,
        HAS_SLOTS=slots is not None, num_warps=4,
    )
    return o, new_state
