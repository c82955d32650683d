"""Triton backward of one chunk of an MLP memory, split along the hidden layer.

The backward of :mod:`.titans_triton_forward`'s chunk, written out as in
:mod:`.titans_chunk` (which stays its readable form and its test) and split the same
way: whatever is local to a slice ``j`` of the hidden layer runs in programs over
``(slices, batch * heads)`` (and over blocks of the written tokens where their rows are
independent), whatever sums over slices runs in programs over blocks of the key width,
and the shares are summed by a fixed loop (no atomics: the same bits from run to run).
The weights' gradients are the final update's backward
(:func:`~.titans_triton_update.final_update_backward_parts`) over every use of each
weight, whose factors the launches below write straight into the stacked buffers.

With ``M = dy err^T``, ``N = dhp e^T`` (``dhp``: the gradient of the queries' hidden
layer before its activation), ``s`` the clip's scale and ``cs, ss`` the last row of
``c`` and the momentum's coefficients times ``s``:

1. :func:`_slices_kernel`, a *read* program per slice and an *update* program per slice and
   block of written tokens. The *read* program forms ``M``,
   ``dh = (a dy) W1 + (b dy) S1 + (M c s) gelu(pre)``, ``dhp``, and its shares of ``N``,
   of ``dq`` (``(a dhp) W2 + (b dhp) S2``) and of the gates' row sums. The *update*
   program forms ``M^T``, the final update's terms of ``d gelu(pre)``, ``de``, ``d err``
   and ``dk``, and its shares of the clip's row sums.
2. :func:`_gates_kernel`, programs over blocks of the written tokens: ``N``, ``dc``, the
   momentum coefficients' gradient and the clip's backward (four per-token
   coefficients); the first also ``da`` and ``db``.
3. :func:`_width_kernel`, programs over (rows, width) blocks: ``dq``, the first terms of
   ``dk`` and ``d err``, and the factors that are inputs (``a dy``, ``b dy``, ``err``,
   ``q``, ``k``).
4. :func:`_chain_kernel` (slices): the read's term of ``de``, ``(c qk s)^T dhp``, then
   ``d back``, ``d pre`` and the shares of
   ``d back W1^T`` (and, for ``dot``, of ``d pre W2``).
5. :func:`_error_grad_kernel` (rows, width): ``d err``; for ``l2``, ``d pred = 2 d err``,
   ``dv`` and ``dk``'s identity term.
6. ``l2`` only: :func:`_prediction_kernel` (slices) adds ``d pred W1`` to ``d pre``
   and takes its shares of ``d pre W2``; :func:`_sum_kernel` (rows, width) adds them to ``dk``.
7. The weights' gradients (:func:`~.titans_triton_update.final_update_backward_parts`, one launch per
   weight) and :func:`_last_gates_kernel`, which sums both weights' gate products into the last
   token's ``da``, ``db`` and ``d sa_last``.

No product takes a transposed product's result: operands needed transposed are
loaded transposed from memory (docs/kernels.md on Triton 3.4-3.7.0 on Hopper).
Scope and shapes as in :mod:`.titans_triton_forward`, where the launches fit (:func:`covers`).
"""

from __future__ import annotations

import torch

from .backend import tl, triton
from .titans_triton_forward import (
    BLOCKS,
    ForwardParts,
    _contiguous,
    _gelu,
    _gelu_slope,
    _pow2,
    _last_coefficients,
    _share_exists,
    _token_block,
)
from .titans_triton_update import _precision, final_update_backward_parts

__all__ = ["chunk_backward", "covers"]


def covers(K: int, momentum: bool) -> bool:
    """Whether the backward's launches fit a chunk of ``K`` written tokens. Their slice programs' shared
    memory, compiled for sm_90 with Triton 3.6 when every chunk's tokens were one block (with momentum /
    without): one pipeline stage, 64 / 48 KB for up to 64 tokens and 112 / 80 KB for up to 128 (Atlas'
    Omega window: ``K = C + window - 1``); two stages, 208 KB and 288 / 192 KB, over the 227 KB an H100 or
    H200 block may take with momentum and more than 64 tokens (Atlas with momentum at 16 heads x 64, chunk
    64, window 16 raised OutOfResources). Past 64 tokens the kernels now take blocks of 16, which need
    less; the rule stays until measured again."""
    return BLOCKS["backward_stages"] < 2 or _pow2(K) <= 64 or not momentum


@triton.jit
def _gelu_curvature(x):
    """``gelu''(x) = phi(x) (2 - x^2)``."""
    return tl.exp(-0.5 * x * x) * 0.3989422804014327 * (2.0 - x * x)


@triton.jit
def _ld(ptr, ri, ci, si, sj, mi, mj):
    """The ``(len(ri), len(ci))`` tile at rows ``ri`` (stride ``si``), columns ``ci`` (stride ``sj``),
    zeros where masked; strides swapped load a tile transposed."""
    return tl.load(ptr + ri[:, None] * si + ci[None, :] * sj, mask=mi[:, None] & mj[None, :], other=0.0)


@triton.jit
def _st(ptr, x, ri, ci, si, mi, mj):
    tl.store(ptr + ri[:, None] * si + ci[None, :], x, mask=mi[:, None] & mj[None, :])


@triton.jit
def _sum_shares(PART, g, NS, n, ri, ci, si, mi, mj, BI: tl.constexpr, BJ: tl.constexpr, U: tl.constexpr):
    """``sum_j PART[g, j]`` on a tile, shares ``(G, NS, n)``-strided (``n`` elements each), in order of ``j``,
    ``U`` shares per step of the loop (their loads overlap; all ``NS`` unrolled cost registers)."""
    acc = tl.zeros((BI, BJ), tl.float32)
    for j0 in range(0, NS, U):
        for u in tl.static_range(U):
            j = j0 + u
            acc += _ld(PART + (g * NS + j) * n, ri, ci, si, 1, mi & _share_exists(j, NS, BI), mj)
    return acc


@triton.jit
def _sum_shares_unrolled(PART, g, NS: tl.constexpr, n, ri, ci, si, mi, mj, BI: tl.constexpr, BJ: tl.constexpr):
    """:func:`_sum_shares` with the loop unrolled, so that the loads overlap (a rolled loop waits on each
    in turn). It made the gates kernel faster but the width kernel, which sums three tensors beside its
    products, slower (benchmarks/RESULTS.md)."""
    acc = tl.zeros((BI, BJ), tl.float32)
    for j in tl.static_range(NS):
        acc += _ld(PART + (g * NS + j) * n, ri, ci, si, 1, mi, mj)
    return acc


@triton.jit
def _read_tokens_term(m, PRE, GC, SCALE, M_OUT, j, g, rc, rk, rf, mc, mk, mf, C, K, F, PRECISION: tl.constexpr):
    """A block ``rk`` of written tokens' term ``(M c s) gelu(pre)`` of ``dh``; the first slice writes the
    block of ``M``."""
    if j == 0:
        _st(M_OUT + g * C * K, m, rc, rk, K, mc, mk)
    ms = m * _ld(GC + g * C * K, rc, rk, K, 1, mc, mk) * tl.load(SCALE + g * K + rk, mask=mk, other=0.0)[None, :]
    return tl.dot(ms, _gelu(_ld(PRE + g * K * F, rk, rf, F, 1, mk, mf)), input_precision=PRECISION)


@triton.jit
def _read_share(DY, ERR, H, PRE, HP, E, QW, QS, GA, GB, GC, SCALE, W1, S1, W2, S2,
                M_OUT, L2, LS2, R1, DHP, PART_N, PART_DA, PART_DB, PART_DQ,
                j, g, NS, C, K, D, F, ROWS1,
                HAS_S: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, TB: tl.constexpr, BF: tl.constexpr,
                BD: tl.constexpr, PRECISION: tl.constexpr):
    """The read's share of slice ``j``, over the written tokens ``BK`` at a time."""
    rf, rc = j * BF + tl.arange(0, BF), tl.arange(0, BC)
    mf, mc = rf < F, rc < C
    a = tl.load(GA + g * C + rc, mask=mc, other=0.0)
    b = tl.load(GB + g * C + rc, mask=mc, other=0.0) if HAS_S else a
    # The first block of written tokens' M = dy err^T in the same loop as dh's weight terms (all of them
    # for up to 64 tokens), the others after it.
    rk = tl.arange(0, BK)
    mk = rk < K
    m = tl.zeros((BC, BK), tl.float32)
    dh = tl.zeros((BC, BF), tl.float32)
    for d0 in range(0, D, BD):
        rd = d0 + tl.arange(0, BD)
        md = rd < D
        dy = _ld(DY + g * C * D, rc, rd, D, 1, mc, md)
        m += tl.dot(dy, _ld(ERR + g * K * D, rd, rk, 1, D, md, mk), input_precision=PRECISION)
        dh += tl.dot(dy * a[:, None], _ld(W1 + g * D * F, rd, rf, F, 1, md, mf), input_precision=PRECISION)
        if HAS_S:
            dh += tl.dot(dy * b[:, None], _ld(S1 + g * D * F, rd, rf, F, 1, md, mf), input_precision=PRECISION)
    dh += _read_tokens_term(m, PRE, GC, SCALE, M_OUT, j, g, rc, rk, rf, mc, mk, mf, C, K, F, PRECISION)
    for t in range(1, TB):
        rk = t * BK + tl.arange(0, BK)
        mk = rk < K
        m = tl.zeros((BC, BK), tl.float32)
        for d0 in range(0, D, BD):
            rd = d0 + tl.arange(0, BD)
            md = rd < D
            m += tl.dot(_ld(DY + g * C * D, rc, rd, D, 1, mc, md), _ld(ERR + g * K * D, rd, rk, 1, D, md, mk),
                        input_precision=PRECISION)
        dh += _read_tokens_term(m, PRE, GC, SCALE, M_OUT, j, g, rc, rk, rf, mc, mk, mf, C, K, F, PRECISION)
    cf_offs = g * C * F
    dhp = dh * _gelu_slope(_ld(HP + cf_offs, rc, rf, F, 1, mc, mf))
    # The factors of W2's and S2's uses: rows 0..C of L2 and LS2.
    _st(L2 + g * (C + K) * F, a[:, None] * dhp, rc, rf, F, mc, mf)
    if HAS_S:
        _st(LS2 + cf_offs, b[:, None] * dhp, rc, rf, F, mc, mf)
    _st(R1 + g * ROWS1 * F, _ld(H + cf_offs, rc, rf, F, 1, mc, mf), rc, rf, F, mc, mf)
    # The read's term of de, (c qk s)^T dhp, has independent rows: the chain kernel's programs over blocks of
    # written tokens form it (here it was a second product per block in the longest program).
    _st(DHP + cf_offs, dhp, rc, rf, F, mc, mf)
    share = g * NS + j
    for t in range(TB):
        rk = t * BK + tl.arange(0, BK)
        mk = rk < K
        _st(PART_N + share * C * K, tl.dot(dhp, _ld(E + g * K * F, rf, rk, 1, F, mf, mk), input_precision=PRECISION),
            rc, rk, K, mc, mk)
    tl.store(PART_DA + share * C + rc, tl.sum(dhp * _ld(QW + cf_offs, rc, rf, F, 1, mc, mf), 1), mask=mc)
    if HAS_S:
        tl.store(PART_DB + share * C + rc, tl.sum(dhp * _ld(QS + cf_offs, rc, rf, F, 1, mc, mf), 1), mask=mc)
    adhp = a[:, None] * dhp
    bdhp = b[:, None] * dhp
    for d0 in range(0, D, BD):
        rd = d0 + tl.arange(0, BD)
        md = rd < D
        dq = tl.dot(adhp, _ld(W2 + g * F * D, rf, rd, D, 1, mf, md), input_precision=PRECISION)
        if HAS_S:
            dq += tl.dot(bdhp, _ld(S2 + g * F * D, rf, rd, D, 1, mf, md), input_precision=PRECISION)
        _st(PART_DQ + share * C * D, dq, rc, rd, D, mc, md)


@triton.jit
def _update_share(DY, ERR, Kx, H, PRE, E, GC, SC, SCALE, DW1N, DS1N, DW2N, DS2N,
                  R1, DACT, DE_UPDATE, PART_Z, PART_DK, PART_R, PART_T,
                  j, kb, g, NS, C, K, D, F, ROWS1,
                  HAS_S: tl.constexpr, L2: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BF: tl.constexpr,
                  BD: tl.constexpr, PRECISION: tl.constexpr):
    """The final update's share of slice ``j`` on block ``kb`` of the written tokens (every row is its own)."""
    rf, rk, rc = j * BF + tl.arange(0, BF), kb * BK + tl.arange(0, BK), tl.arange(0, BC)
    mf, mk, mc = rf < F, rk < K, rc < C
    s, cs, ss = _last_coefficients(GC, SC, SCALE, g, rk, mk, C, K, HAS_S)
    act = _gelu(_ld(PRE + g * K * F, rk, rf, F, 1, mk, mf))
    if L2:  # the factor of W1's prediction use: rows C+K..C+2K of R1
        _st(R1 + g * ROWS1 * F + (C + K) * F, act, rk, rf, F, mk, mf)
    share = g * NS + j
    mt = tl.zeros((BK, BC), tl.float32)
    e1 = tl.zeros((BK, BF), tl.float32)
    e1s = tl.zeros((BK, BF), tl.float32)
    for d0 in range(0, D, BD):
        rd = d0 + tl.arange(0, BD)
        md = rd < D
        err = _ld(ERR + g * K * D, rk, rd, D, 1, mk, md)
        mt += tl.dot(err, _ld(DY + g * C * D, rd, rc, 1, D, md, mc), input_precision=PRECISION)
        e1 += tl.dot(err, _ld(DW1N + g * D * F, rd, rf, F, 1, md, mf), input_precision=PRECISION)
        z = tl.dot(act * cs[:, None], _ld(DW1N + g * D * F, rf, rd, 1, F, mf, md), input_precision=PRECISION)
        if HAS_S:
            e1s += tl.dot(err, _ld(DS1N + g * D * F, rd, rf, F, 1, md, mf), input_precision=PRECISION)
            z += tl.dot(act * ss[:, None], _ld(DS1N + g * D * F, rf, rd, 1, F, mf, md), input_precision=PRECISION)
        _st(PART_Z + share * K * D, z, rk, rd, D, mk, md)
    # d gelu(pre): the read's term (M c s)^T h and the final update's (err cs) dW1' + (err ss) dS1'.
    mcs_t = mt * _ld(GC + g * C * K, rk, rc, 1, K, mk, mc) * s[:, None]
    dact = tl.dot(mcs_t, _ld(H + g * C * F, rc, rf, F, 1, mc, mf), input_precision=PRECISION) + cs[:, None] * e1
    r = tl.sum(act * e1, 1)
    t = tl.sum(act * e1s, 1)
    if HAS_S:
        dact += ss[:, None] * e1s
    _st(DACT + g * K * F, dact, rk, rf, F, mk, mf)
    # The W2 terms: de gets cs (k dW2'^T) + ss (k dS2'^T); dk gets (e cs) dW2' + (e ss) dS2'.
    e = _ld(E + g * K * F, rk, rf, F, 1, mk, mf)
    x2 = tl.zeros((BK, BF), tl.float32)
    y2 = tl.zeros((BK, BF), tl.float32)
    for d0 in range(0, D, BD):
        rd = d0 + tl.arange(0, BD)
        md = rd < D
        kk = _ld(Kx + g * K * D, rk, rd, D, 1, mk, md)
        x2 += tl.dot(kk, _ld(DW2N + g * F * D, rd, rf, 1, D, md, mf), input_precision=PRECISION)
        dk = tl.dot(e * cs[:, None], _ld(DW2N + g * F * D, rf, rd, D, 1, mf, md), input_precision=PRECISION)
        if HAS_S:
            y2 += tl.dot(kk, _ld(DS2N + g * F * D, rd, rf, 1, D, md, mf), input_precision=PRECISION)
            dk += tl.dot(e * ss[:, None], _ld(DS2N + g * F * D, rf, rd, D, 1, mf, md), input_precision=PRECISION)
        _st(PART_DK + share * K * D, dk, rk, rd, D, mk, md)
    de = cs[:, None] * x2
    r += tl.sum(e * x2, 1)
    if HAS_S:
        de += ss[:, None] * y2
        t += tl.sum(e * y2, 1)
    _st(DE_UPDATE + g * K * F, de, rk, rf, F, mk, mf)
    tl.store(PART_R + share * K + rk, r, mask=mk)
    tl.store(PART_T + share * K + rk, t, mask=mk)


@triton.jit
def _slices_kernel(DY, ERR, Kx, H, PRE, HP, E, QW, QS, GA, GB, GC, SC, SCALE, W1, S1, W2, S2,
                   DW1N, DS1N, DW2N, DS2N, M_OUT, L2, LS2, R1, DHP, PART_N, PART_DA, PART_DB, PART_DQ,
                   DACT, DE_UPDATE, PART_Z, PART_DK, PART_R, PART_T, C, K, D, F, ROWS1,
                   HAS_S: tl.constexpr, L2_OBJ: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, TB: tl.constexpr,
                   BF: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr):
    """Programs ``(NS * (1 + TB), G)``: the first ``NS`` take the read's share of slice ``j``, the others
    the final update's of slice ``j`` on each of the ``TB`` blocks of written tokens (independent work, so
    one launch). The token blocks are a compile-time count, so that a loop over one block is straight
    code."""
    ns = (F + BF - 1) // BF
    pid = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    if pid < ns:
        _read_share(DY, ERR, H, PRE, HP, E, QW, QS, GA, GB, GC, SCALE, W1, S1, W2, S2,
                    M_OUT, L2, LS2, R1, DHP, PART_N, PART_DA, PART_DB, PART_DQ,
                    pid, g, ns, C, K, D, F, ROWS1, HAS_S, BC, BK, TB, BF, BD, PRECISION)
    else:
        _update_share(DY, ERR, Kx, H, PRE, E, GC, SC, SCALE, DW1N, DS1N, DW2N, DS2N,
                      R1, DACT, DE_UPDATE, PART_Z, PART_DK, PART_R, PART_T,
                      (pid - ns) % ns, (pid - ns) // ns if TB > 1 else 0, g, ns, C, K, D, F, ROWS1, HAS_S, L2_OBJ,
                      BC, BK, BF, BD, PRECISION)


@triton.jit
def _gates_kernel(DY, HW, HS, M_IN, P, QK, GC, SC, SCALE, A2, ERR2, K2, PART_E2, PART_N, PART_DA, PART_DB,
                  PART_R, PART_T, N_OUT, DA, DB, DC, DSC, COEF, clip, C, K, D, NS: tl.constexpr,
                  HAS_S: tl.constexpr, CLIP: tl.constexpr, BC: tl.constexpr, BKB: tl.constexpr,
                  BD: tl.constexpr):
    """Program ``(kb, g)``: columns ``kb`` (a block of the written tokens) of ``N`` and ``dc``, those
    tokens' gates and the clip's backward, as four per-token coefficients ``COEF (G, 4, K)`` of ``err``,
    ``gelu(pre)``, ``e`` and ``k`` (zero without a clip); program ``(0, g)`` also takes ``da, db``."""
    kb = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    rk, rc = kb * BKB + tl.arange(0, BKB), tl.arange(0, BC)
    mk, mc = rk < K, rc < C
    ck = g * C * K
    n = _sum_shares_unrolled(PART_N, g, NS, C * K, rc, rk, K, mc, mk, BC, BKB)
    _st(N_OUT + ck, n, rc, rk, K, mc, mk)
    s = tl.load(SCALE + g * K + rk, mask=mk, other=0.0)
    coef = _ld(GC + ck, rc, rk, K, 1, mc, mk)
    grad = _ld(M_IN + ck, rc, rk, K, 1, mc, mk) * _ld(P + ck, rc, rk, K, 1, mc, mk)
    grad += n * _ld(QK + ck, rc, rk, K, 1, mc, mk)
    r = tl.zeros((BKB,), tl.float32)
    t = tl.zeros((BKB,), tl.float32)
    e2 = tl.zeros((BKB,), tl.float32)
    for j in tl.static_range(NS):
        r += tl.load(PART_R + (g * NS + j) * K + rk, mask=mk, other=0.0)
        t += tl.load(PART_T + (g * NS + j) * K + rk, mask=mk, other=0.0)
        e2 += tl.load(PART_E2 + (g * NS + j) * K + rk, mask=mk, other=0.0)
    last = (rc == C - 1).to(tl.float32)
    _st(DC + ck, grad * s[None, :] + last[:, None] * (s * r)[None, :], rc, rk, K, mc, mk)
    c_last = tl.load(GC + ck + (C - 1) * K + rk, mask=mk, other=0.0)
    ds = tl.sum(grad * coef, 0) + c_last * r
    if HAS_S:
        ds += tl.load(SC + g * K + rk, mask=mk, other=0.0) * t
        tl.store(DSC + g * K + rk, s * t, mask=mk)
    a2 = tl.load(A2 + g * K + rk, mask=mk, other=0.0)
    err2 = tl.load(ERR2 + g * K + rk, mask=mk, other=0.0)
    k2 = tl.load(K2 + g * K + rk, mask=mk, other=0.0)
    if CLIP:  # s = min(1, clip / sqrt(max(n2, 1e-30))), n2 = |gelu(pre)|^2 |err|^2 + |e|^2 |k|^2
        n2 = a2 * err2 + e2 * k2
        raw = clip / tl.sqrt(tl.maximum(n2, 1e-30))
        dn2 = tl.where((raw <= 1.0) & (n2 >= 1e-30), -0.5 * raw / tl.maximum(n2, 1e-30), 0.0) * ds * 2.0
    else:
        dn2 = tl.zeros((BKB,), tl.float32)
    out = COEF + g * 4 * K + rk
    tl.store(out, dn2 * a2, mask=mk)
    tl.store(out + K, dn2 * err2, mask=mk)
    tl.store(out + 2 * K, dn2 * k2, mask=mk)
    tl.store(out + 3 * K, dn2 * e2, mask=mk)
    if kb == 0:
        da = tl.zeros((BC,), tl.float32)
        db = tl.zeros((BC,), tl.float32)
        for d0 in range(0, D, BD):
            rd = d0 + tl.arange(0, BD)
            md = rd < D
            dy = _ld(DY + g * C * D, rc, rd, D, 1, mc, md)
            da += tl.sum(dy * _ld(HW + g * C * D, rc, rd, D, 1, mc, md), 1)
            if HAS_S:
                db += tl.sum(dy * _ld(HS + g * C * D, rc, rd, D, 1, mc, md), 1)
        for j in tl.static_range(NS):
            da += tl.load(PART_DA + (g * NS + j) * C + rc, mask=mc, other=0.0)
            if HAS_S:
                db += tl.load(PART_DB + (g * NS + j) * C + rc, mask=mc, other=0.0)
        tl.store(DA + g * C + rc, da, mask=mc)
        if HAS_S:
            tl.store(DB + g * C + rc, db, mask=mc)


@triton.jit
def _width_kernel(DY, Q, Kx, ERR, P, GA, GB, GC, SCALE, N_IN, COEF, PART_DQ, PART_DK, PART_Z,
                  DQ, DK, DERR, L1, LS1, R2, C, K, D, NS, ROWS1,
                  HAS_S: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, TB: tl.constexpr,
                  BD: tl.constexpr, U: tl.constexpr, PRECISION: tl.constexpr):
    """Program ``(r, w, g)``: rows ``r`` (queries for ``dq``, written tokens for the others) and block ``w``
    of the width of ``dq`` (final), of ``dk`` and ``d err`` (their terms so far), and of the factors of
    the weights' uses that are inputs."""
    w = tl.program_id(1)
    g = tl.program_id(2).to(tl.int64)
    rr, rd = tl.program_id(0) * BR + tl.arange(0, BR), w * BD + tl.arange(0, BD)
    rc = tl.arange(0, BC)
    md, mc, mrc, mrk = rd < D, rc < C, rr < C, rr < K
    ck, cd, kd = g * C * K, g * C * D, g * K * D
    s_r = tl.load(SCALE + g * K + rr, mask=mrk, other=0.0)
    dy = _ld(DY + cd, rr, rd, D, 1, mrc, md)
    q = _ld(Q + cd, rr, rd, D, 1, mrc, md)
    kk = _ld(Kx + kd, rr, rd, D, 1, mrk, md)
    err = _ld(ERR + kd, rr, rd, D, 1, mrk, md)
    # dq = dy + sum_j (a dhp W2 + b dhp S2)_j + (N c s) k, the written tokens BK at a time
    dq = dy
    for t in range(TB):
        rk = t * BK + tl.arange(0, BK)
        mk = rk < K
        s = tl.load(SCALE + g * K + rk, mask=mk, other=0.0)
        dqk = _ld(N_IN + ck, rr, rk, K, 1, mrc, mk) * _ld(GC + ck, rr, rk, K, 1, mrc, mk) * s[None, :]
        dq += tl.dot(dqk, _ld(Kx + kd, rk, rd, D, 1, mk, md), input_precision=PRECISION)
    dq += _sum_shares(PART_DQ, g, NS, C * D, rr, rd, D, mrc, md, BR, BD, U)
    _st(DQ + cd, dq, rr, rd, D, mrc, md)
    # dk = (N c s)^T q + sum_j (the final update's terms)_j + the clip's; d err = (P c s)^T dy + ...
    c_t = _ld(GC + ck, rr, rc, 1, K, mrk, mc) * s_r[:, None]
    out = COEF + g * 4 * K + rr
    dk = tl.dot(_ld(N_IN + ck, rr, rc, 1, K, mrk, mc) * c_t, _ld(Q + cd, rc, rd, D, 1, mc, md),
                input_precision=PRECISION)
    dk += _sum_shares(PART_DK, g, NS, K * D, rr, rd, D, mrk, md, BR, BD, U)
    dk += tl.load(out + 3 * K, mask=mrk, other=0.0)[:, None] * kk
    _st(DK + kd, dk, rr, rd, D, mrk, md)
    derr = tl.dot(_ld(P + ck, rr, rc, 1, K, mrk, mc) * c_t, _ld(DY + cd, rc, rd, D, 1, mc, md),
                  input_precision=PRECISION)
    derr += _sum_shares(PART_Z, g, NS, K * D, rr, rd, D, mrk, md, BR, BD, U)
    derr += tl.load(out, mask=mrk, other=0.0)[:, None] * err
    _st(DERR + kd, derr, rr, rd, D, mrk, md)
    a = tl.load(GA + g * C + rr, mask=mrc, other=0.0)
    l1 = L1 + g * ROWS1 * D
    _st(l1, a[:, None] * dy, rr, rd, D, mrc, md)
    _st(l1 + C * D, err, rr, rd, D, mrk, md)
    if HAS_S:
        _st(LS1 + cd, tl.load(GB + g * C + rr, mask=mrc, other=0.0)[:, None] * dy, rr, rd, D, mrc, md)
    r2 = R2 + g * (C + K) * D
    _st(r2, q, rr, rd, D, mrc, md)
    _st(r2 + C * D, kk, rr, rd, D, mrk, md)


@triton.jit
def _chain_kernel(PRE, BACK, E, W1, W2, DHP, GC, QK, SCALE, DE_UPDATE, DACT, COEF, R1, L2, PART_Z, PART_DK,
                  C, K, D, F, ROWS1, L2_OBJ: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BF: tl.constexpr,
                  BD: tl.constexpr, PRECISION: tl.constexpr):
    """Program ``(j, g, r)``: the read's term of ``de``, ``(c qk s)^T dhp`` (over all ``BC`` queries), then
    ``d back`` and ``d pre`` of slice ``j`` (``d pre`` without the prediction's term for ``l2``), and its
    shares of ``d back W1^T`` (and of ``d pre W2`` for ``dot``), on the ``r``-th block of ``BK`` written
    tokens (every row is its own)."""
    j = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    ns = tl.num_programs(0)
    rf, rk, rc = j * BF + tl.arange(0, BF), tl.program_id(2) * BK + tl.arange(0, BK), tl.arange(0, BC)
    mf, mk, mc = rf < F, rk < K, rc < C
    kf = g * K * F
    pre = _ld(PRE + kf, rk, rf, F, 1, mk, mf)
    out = COEF + g * 4 * K + rk
    # The read's term of de: (c qk s)^T dhp, the left operand loaded transposed.
    s = tl.load(SCALE + g * K + rk, mask=mk, other=0.0)
    cqk_t = _ld(GC + g * C * K, rk, rc, 1, K, mk, mc) * _ld(QK + g * C * K, rk, rc, 1, K, mk, mc) * s[:, None]
    de = tl.dot(cqk_t, _ld(DHP + g * C * F, rc, rf, F, 1, mc, mf), input_precision=PRECISION)
    de += _ld(DE_UPDATE + kf, rk, rf, F, 1, mk, mf)
    de += tl.load(out + 2 * K, mask=mk, other=0.0)[:, None] * _ld(E + kf, rk, rf, F, 1, mk, mf)
    dact = _ld(DACT + kf, rk, rf, F, 1, mk, mf) + tl.load(out + K, mask=mk, other=0.0)[:, None] * _gelu(pre)
    slope = _gelu_slope(pre)
    dback = de * slope
    dpre = de * _ld(BACK + kf, rk, rf, F, 1, mk, mf) * _gelu_curvature(pre) + dact * slope
    _st(R1 + g * ROWS1 * F + C * F, dback, rk, rf, F, mk, mf)
    _st(L2 + g * (C + K) * F + C * F, dpre, rk, rf, F, mk, mf)
    share = g * ns + j
    for d0 in range(0, D, BD):
        rd = d0 + tl.arange(0, BD)
        md = rd < D
        _st(PART_Z + share * K * D,
            tl.dot(dback, _ld(W1 + g * D * F, rf, rd, 1, F, mf, md), input_precision=PRECISION), rk, rd, D, mk, md)
        if not L2_OBJ:
            _st(PART_DK + share * K * D,
                tl.dot(dpre, _ld(W2 + g * F * D, rf, rd, D, 1, mf, md), input_precision=PRECISION), rk, rd, D, mk, md)


@triton.jit
def _error_grad_kernel(DERR, PART_Z, PART_DK, DK, DV, L1, C, K, D, NS: tl.constexpr, ROWS1,
                       L2_OBJ: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    """Program ``(r, w, g)``: ``d err``, then ``dv``; ``l2``: ``d pred`` (rows C+K.. of L1) and ``dk``'s
    identity term; ``dot``: ``dk``'s last shares."""
    w = tl.program_id(1)
    g = tl.program_id(2).to(tl.int64)
    rd, rk = w * BD + tl.arange(0, BD), tl.program_id(0) * BR + tl.arange(0, BR)
    md, mk = rd < D, rk < K
    kd = g * K * D
    derr = _ld(DERR + kd, rk, rd, D, 1, mk, md)
    derr += _sum_shares_unrolled(PART_Z, g, NS, K * D, rk, rd, D, mk, md, BR, BD)
    dk = _ld(DK + kd, rk, rd, D, 1, mk, md)
    if L2_OBJ:
        dpred = 2.0 * derr
        _st(L1 + g * ROWS1 * D + (C + K) * D, dpred, rk, rd, D, mk, md)
        _st(DV + kd, -dpred, rk, rd, D, mk, md)
        dk += dpred
    else:
        _st(DV + kd, -derr, rk, rd, D, mk, md)
        dk += _sum_shares_unrolled(PART_DK, g, NS, K * D, rk, rd, D, mk, md, BR, BD)
    _st(DK + kd, dk, rk, rd, D, mk, md)


@triton.jit
def _prediction_kernel(PRE, W1, W2, L1, L2, PART_DK, C, K, D, F, ROWS1,
                       BK: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr):
    """``l2``, program ``(j, g, r)``: ``d pre += (d pred W1) gelu'(pre)`` on slice ``j``, and its share of
    ``d pre W2``, on the ``r``-th block of ``BK`` written tokens."""
    j = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    ns = tl.num_programs(0)
    rf, rk = j * BF + tl.arange(0, BF), tl.program_id(2) * BK + tl.arange(0, BK)
    mf, mk = rf < F, rk < K
    dact = tl.zeros((BK, BF), tl.float32)
    for d0 in range(0, D, BD):
        rd = d0 + tl.arange(0, BD)
        md = rd < D
        dpred = _ld(L1 + g * ROWS1 * D + (C + K) * D, rk, rd, D, 1, mk, md)
        dact += tl.dot(dpred, _ld(W1 + g * D * F, rd, rf, F, 1, md, mf), input_precision=PRECISION)
    l2 = L2 + g * (C + K) * F + C * F
    dpre = _ld(l2, rk, rf, F, 1, mk, mf) + dact * _gelu_slope(_ld(PRE + g * K * F, rk, rf, F, 1, mk, mf))
    _st(l2, dpre, rk, rf, F, mk, mf)
    share = g * ns + j
    for d0 in range(0, D, BD):
        rd = d0 + tl.arange(0, BD)
        md = rd < D
        _st(PART_DK + share * K * D,
            tl.dot(dpre, _ld(W2 + g * F * D, rf, rd, D, 1, mf, md), input_precision=PRECISION), rk, rd, D, mk, md)


@triton.jit
def _sum_kernel(DK, PART_DK, K, D, NS: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    w = tl.program_id(1)
    g = tl.program_id(2).to(tl.int64)
    rd, rk = w * BD + tl.arange(0, BD), tl.program_id(0) * BR + tl.arange(0, BR)
    md, mk = rd < D, rk < K
    kd = g * K * D
    dk = _ld(DK + kd, rk, rd, D, 1, mk, md)
    dk += _sum_shares_unrolled(PART_DK, g, NS, K * D, rk, rd, D, mk, md, BR, BD)
    _st(DK + kd, dk, rk, rd, D, mk, md)


@triton.jit
def _last_gates_kernel(PART1, PART2, DA, DB, DSA, P1, P2, C, HAS_S: tl.constexpr, BP: tl.constexpr):
    """Program ``g``: the final updates' gate products summed over both weights' tiles, added to the last
    token's ``da`` and ``db`` and written as ``d sa_last`` (seven small launches before)."""
    g = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, BP)
    for i in tl.static_range(3 if HAS_S else 1):
        t = (tl.sum(tl.load(PART1 + (g * P1 + r) * 3 + i, mask=r < P1, other=0.0), 0)
             + tl.sum(tl.load(PART2 + (g * P2 + r) * 3 + i, mask=r < P2, other=0.0), 0))
        if i == 0:
            tl.store(DA + g * C + C - 1, tl.load(DA + g * C + C - 1) + t)
        elif i == 1:
            tl.store(DB + g * C + C - 1, tl.load(DB + g * C + C - 1) + t)
        else:
            tl.store(DSA + g, t)


def chunk_backward(spec, W: dict[str, torch.Tensor], S: dict[str, torch.Tensor] | None, q: torch.Tensor,
                   k: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None, c: torch.Tensor,
                   sa_last: torch.Tensor | None, sc_last: torch.Tensor | None, parts: ForwardParts,
                   d_y: torch.Tensor, dW_new: dict[str, torch.Tensor], dS_new: dict[str, torch.Tensor] | None):
    """Every gradient of :func:`~.titans_triton_forward.chunk_forward`'s chunk, arguments
    flattened to ``G = batch * heads``: ``(dW, dS, dq, dk, dv, da, db, dc, d sa_last, d sc_last)``
    (weights as dicts; ``dS, db, d sa_last, d sc_last`` are ``None`` without momentum).

    The same values as :mod:`.titans_chunk`'s written-out backward, summed in another order."""
    G, C, D = q.shape
    K, F = k.shape[1], spec.hidden
    has_s = S is not None
    l2, clip = spec.objective == "l2", spec.grad_clip
    q, k, a, b, c, sc_last, d_y = _contiguous(q, k, a, b, c, sc_last, d_y)
    W1, W2 = W["w1"].contiguous(), W["w2"].contiguous()
    dW1n, dW2n = dW_new["w1"].contiguous(), dW_new["w2"].contiguous()
    S1, S2 = (S["w1"].contiguous(), S["w2"].contiguous()) if has_s else (W1, W2)
    dS1n, dS2n = (dS_new["w1"].contiguous(), dS_new["w2"].contiguous()) if has_s else (dW1n, dW2n)
    BF, BD = min(BLOCKS["slice"], _pow2(F)), min(BLOCKS["width"], _pow2(D))
    BC, BK = _pow2(C), _token_block(K)
    NS, KB = triton.cdiv(F, BF), triton.cdiv(K, _token_block(K))
    new = lambda *shape: q.new_empty(*shape)  # noqa: E731
    # The stacked factors of every weight's uses: W1 (rows: C queries, K errors, K predictions for l2),
    # W2 (C queries, K keys), S1 and S2 (C queries).
    rows1 = C + 2 * K if l2 else C + K
    L1, R1, L2, R2 = new(G, rows1, D), new(G, rows1, F), new(G, C + K, F), new(G, C + K, D)
    LS1, LS2 = (new(G, C, D), new(G, C, F)) if has_s else (L1, L2)
    m, n, dc = new(G, C, K), new(G, C, K), new(G, C, K)
    part_n, part_da, part_db = new(G, NS, C, K), new(G, NS, C), new(G, NS, C)
    dhp, de_update, dact = new(G, C, F), new(G, K, F), new(G, K, F)
    part_dq, part_z, part_dk = new(G, NS, C, D), new(G, NS, K, D), new(G, NS, K, D)
    part_r, part_t = new(G, NS, K), new(G, NS, K)
    da, db, dsc, coef = new(G, C), new(G, C), new(G, K), new(G, 4, K)
    dq, dk, dv, derr = new(G, C, D), new(G, K, D), new(G, K, D), new(G, K, D)
    gb, gsc = (b, sc_last) if has_s else (a, parts.scale)
    prec = _precision()
    launch = dict(num_warps=BLOCKS["warps"], num_stages=BLOCKS["stages"])
    _slices_kernel[(NS * (1 + KB), G)](
        d_y, parts.err, k, parts.hidden, parts.pre, parts.hidden_pre, parts.e, parts.qw,
        parts.qs if has_s else parts.qw, a, gb, c, gsc, parts.scale, W1, S1, W2, S2,
        dW1n, dS1n, dW2n, dS2n, m, L2, LS2, R1, dhp, part_n, part_da, part_db, part_dq,
        dact, de_update, part_z, part_dk, part_r, part_t, C, K, D, F, rows1,
        HAS_S=has_s, L2_OBJ=l2, BC=BC, BK=BK, TB=KB, BF=BF, BD=BD, PRECISION=prec,
        num_warps=BLOCKS["backward_warps_long" if _pow2(K) > 64 and not has_s else "backward_warps"],
        num_stages=BLOCKS["backward_stages"])
    BR, BKB = BLOCKS["backward_rows"], BLOCKS["backward_rows"]
    _gates_kernel[(triton.cdiv(K, BKB), G)](
        d_y, parts.hw, parts.hs if has_s else parts.hw, m, parts.p, parts.qk, c, gsc, parts.scale,
        parts.a2, parts.err2, parts.k2, parts.part_e2, part_n, part_da, part_db, part_r, part_t,
        n, da, db, dc, dsc, coef, float(clip) if clip is not None else 0.0, C, K, D, NS,
        HAS_S=has_s, CLIP=clip is not None, BC=BC, BKB=BKB, BD=BD, **launch)
    _width_kernel[(triton.cdiv(max(C, K), BR), triton.cdiv(D, BD), G)](
        d_y, q, k, parts.err, parts.p, a, gb, c, parts.scale, n, coef, part_dq, part_dk, part_z,
        dq, dk, derr, L1, LS1, R2, C, K, D, NS, rows1, HAS_S=has_s, BR=BR, BC=BC, BK=BK, TB=KB, BD=BD,
        U=BLOCKS["share_unroll"], PRECISION=prec, **launch)
    # The written tokens' rows are independent in the chain and prediction kernels: blocks of them, so that
    # a window's 79 rows are not padded to 128 (whose tiles spilled) and more programs share the work.
    BKR = min(_pow2(K), max(16, BLOCKS["chain_rows"]))
    row_slices = (NS, G, triton.cdiv(K, BKR))
    _chain_kernel[row_slices](
        parts.pre, parts.back, parts.e, W1, W2, dhp, c, parts.qk, parts.scale, de_update, dact, coef, R1, L2,
        part_z, part_dk, C, K, D, F, rows1, L2_OBJ=l2, BC=BC, BK=BKR, BF=BF, BD=BD, PRECISION=prec, **launch)
    rows_k = (triton.cdiv(K, BR), triton.cdiv(D, BD), G)
    _error_grad_kernel[rows_k](derr, part_z, part_dk, dk, dv, L1, C, K, D, NS, rows1, L2_OBJ=l2, BR=BR, BD=BD,
                               **launch)
    if l2:
        _prediction_kernel[row_slices](parts.pre, W1, W2, L1, L2, part_dk, C, K, D, F, rows1,
                                       BK=BKR, BF=BF, BD=BD, PRECISION=prec, **launch)
        _sum_kernel[rows_k](dk, part_dk, K, D, NS, BR=BR, BD=BD, **launch)
    # The weights: the final update's term plus every use, with the gates' inner products.
    a_last, b_last = a[:, -1], (b[:, -1] if has_s else None)
    dW1, dS1, part1 = final_update_backward_parts(
        W1, S1 if has_s else None, dW1n, dS1n if has_s else None, a_last, b_last, sa_last,
        (L1, R1, rows1), (LS1, parts.hidden, C) if has_s else None)
    dW2, dS2, part2 = final_update_backward_parts(
        W2, S2 if has_s else None, dW2n, dS2n if has_s else None, a_last, b_last, sa_last,
        (L2, R2, C + K), (LS2, q, C) if has_s else None)
    dsa = new(G) if has_s else None
    P1, P2 = part1.shape[1], part2.shape[1]
    _last_gates_kernel[(G,)](part1, part2, da, db if has_s else da, dsa if has_s else da, P1, P2, C,
                             HAS_S=has_s, BP=triton.next_power_of_2(max(P1, P2)))
    dW = {"w1": dW1, "w2": dW2}
    if not has_s:
        return dW, None, dq, dk, dv, da, None, dc, None, None
    return dW, {"w1": dS1, "w2": dS2}, dq, dk, dv, da, db, dc, dsa, dsc
