"""Triton forward of one chunk of an MLP memory, split along the hidden layer.

:func:`~.titans_chunk.chunk_memory` with cuBLAS runs a chunk of the depth-2 memory
``M(z) = z + W1 gelu(W2 z)`` as about a dozen weight-sized matmuls of ``(chunk,
width)`` rows and a few dozen element-wise kernels on ``(chunk, hidden)`` rows. With
16K tokens at T=8192 there are 128 chunks in sequence and every one of those kernels
is a few microseconds of launch for a few microseconds of work.

Everything a chunk computes is either local to a slice of the hidden layer (columns
``j`` of ``W1``, rows ``j`` of ``W2`` and of their momenta, the hidden activations
``j``) or a sum over slices of ``(chunk, width)``-sized terms. So a chunk is six
launches, each over ``(hidden slices, batch * heads)`` programs (and blocks of the
written tokens for the pre and back kernels, of the width for the read and the update)
or over blocks of rows (and of the width, for the output). Past 64 written tokens
(Atlas' Omega window) the kernels but the output take them in blocks of 16
(:func:`_token_block`): a grid axis where their rows are independent, a loop where
they are summed over.

1. :func:`_pre_kernel`: ``pre = k W2^T``, ``q W2^T``, ``q S2^T`` of the slice, the
   slice's share of the prediction ``gelu(pre) W1^T`` and of ``||gelu(pre)||^2``;
   the first slice also writes ``q k^T``.
2. :func:`_error_kernel` (rows): the error ``dL/dM(k)`` from the summed shares, and
   the squared norms the clip needs.
3. :func:`_back_kernel`: the slice's ``back = err W1`` and factor ``e = back * gelu'(pre)``.
4. :func:`_read_kernel`: the clip's scale; the queries' hidden layer through the
   online weights, its shares of ``h W1^T``, ``h S1^T`` and ``h gelu(pre)^T``;
5. :func:`_update_kernel` (slices and width blocks): the slice's final weights and
   momenta, written once;
6. :func:`_output_kernel` (rows): the shares summed, and the read ``y``.

The shares are summed by a fixed loop, not atomics, so results are the same from run
to run. The intermediates a backward needs (``pre``, ``back``, ``e``, the hidden
layer and the read's products) are outputs, in :class:`ForwardParts`.

No product takes a transposed product's result: operands needed transposed are
loaded transposed from memory (docs/kernels.md on Triton 3.4-3.7.0 on Hopper).

The chunked forward without gradients (a prompt's prefill) is faster through these kernels than
through cuBLAS (benchmarks/RESULTS.md). The read and the update are separate launches, each over
width blocks too: as one launch of ``(slices, batch * heads)`` programs, a small ``G`` gives few
programs, each streaming every weight, and that was slower (benchmarks/RESULTS.md).

Scope (:func:`covers`): depth 2 without gate or linear skip, objectives ``l2`` and
``dot``, any clip, with or without momentum, float32. Shapes as in
:mod:`.titans_chunk`: weights ``w1 (G, d, F)``, ``w2 (G, F, d)``, ``q (G, C, d)``,
``k, v (G, K, d)``, ``c (G, C, K)``, with ``G = batch * heads``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backend import tl, triton
from .titans_triton_update import _precision

__all__ = ["ForwardParts", "covers", "chunk_forward"]

# Slice of the hidden layer per program, block of the key width per step, width blocks of the read's,
# update's and output's programs, rows per program of the output's and the error's row kernels, warps and
# pipeline stages; the backward's (titans_chunk_backward_triton) rows or token columns per program of its
# gates and width kernels, its slice programs' warps, and the written tokens per program of its chain and
# prediction kernels. Module-level so that tests can shrink them.
# Each choice below was the fastest of those tried (benchmarks/RESULTS.md): slices of 64 rather than 32 in
# the forward; the update over width blocks of 64 (rather than 32 or 128), the read over blocks of 128
# (rather than 64 or the whole width); four warps for the read and the update. The backward's slice
# programs: four warps and one pipeline stage, 64 KB of shared memory where two stages take 208 KB, so that
# two programs share an SM (its registers allow two of four warps); faster than eight warps or four with two
# stages. The chain and prediction kernels over blocks of 16 written tokens: in one block Atlas' window (79
# tokens) is padded to 128, whose tiles do not stay in registers. Slice programs over more than 64 written
# tokens (blocks of 128) without momentum, OmegaNet's window, take 8 warps, which were faster there; with
# momentum 8 warps were no clear gain, so those stay at 4 (both chosen before the blocks of written tokens
# below). Written tokens: one block up to 64 of them, past that blocks of 16 in the kernels that had taken
# them in one block but the output (the error, gates and chain kernels have row blocks of their own): for
# Atlas' window (K = 79) blocks of 16 beat one block and blocks of 32 or 64, with momentum or without.
# Titans (K = 64) keeps its one block, which beat blocks of 16 or 32.
BLOCKS = {"slice": 64, "width": 64, "read_width": 128, "update_width": 64, "output_width": 64, "rows": 16,
          "error_rows": 4, "warps": 4, "read_warps": 4, "update_warps": 4, "stages": 2,
          "share_unroll": 4, "backward_rows": 16, "backward_warps": 4, "backward_stages": 1, "chain_rows": 16,
          "backward_warps_long": 8, "tokens": 16, "tokens_whole": 64}


def covers(spec, C: int, K: int) -> bool:
    """Whether :func:`chunk_forward` computes this memory and chunk."""
    return (spec.depth == 2 and not spec.gated and not spec.linear_skip and C <= 128 and K <= 128)


@triton.jit
def _gelu(x):
    return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))


@triton.jit
def _gelu_slope(x):
    return 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476)) + x * tl.exp(-0.5 * x * x) * 0.3989422804014327


@triton.jit
def _share_exists(j, NS, B: tl.constexpr):
    """``j < NS`` as a ``(B,)`` mask, for loops that take several shares per step past the last one (a
    tensor, not a scalar: Triton's interpreter masks loads by arrays only)."""
    return (tl.zeros((B,), tl.int32) + j) < NS


@triton.jit
def _pre_kernel(Q, Kx, W1, W2, S2, PRE, QW, QS, QK, PART_PRED, PART_A2, C, K, D, F,
                HAS_S: tl.constexpr, L2: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, TB: tl.constexpr,
                BF: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr):
    """Program ``(j, t, g)`` of ``(NS, TB + 1, G)``: slice ``j`` on block ``t`` of the ``TB`` blocks of
    written tokens (every row is its own), the first slice also ``q k^T`` on the block's columns;
    ``t = TB`` takes the queries' ``q W2^T`` and ``q S2^T`` instead."""
    j, t = tl.program_id(0), tl.program_id(1)
    g = tl.program_id(2).to(tl.int64)
    ns = tl.num_programs(0)
    rf, rc = j * BF + tl.arange(0, BF), tl.arange(0, BC)
    mf, mc = rf < F, rc < C
    if t == TB:
        qw = tl.zeros((BC, BF), tl.float32)
        qs = tl.zeros((BC, BF), tl.float32)
        for d0 in range(0, D, BD):
            rd = d0 + tl.arange(0, BD)
            md = rd < D
            qq = tl.load(Q + g * C * D + rc[:, None] * D + rd[None, :], mask=mc[:, None] & md[None, :], other=0.0)
            w2t = tl.load(W2 + g * F * D + rf[None, :] * D + rd[:, None], mask=md[:, None] & mf[None, :], other=0.0)
            qw += tl.dot(qq, w2t, input_precision=PRECISION)
            if HAS_S:
                s2t = tl.load(S2 + g * F * D + rf[None, :] * D + rd[:, None], mask=md[:, None] & mf[None, :],
                              other=0.0)
                qs += tl.dot(qq, s2t, input_precision=PRECISION)
        cf = mc[:, None] & mf[None, :]
        tl.store(QW + g * C * F + rc[:, None] * F + rf[None, :], qw, mask=cf)
        if HAS_S:
            tl.store(QS + g * C * F + rc[:, None] * F + rf[None, :], qs, mask=cf)
    else:
        rk = t * BK + tl.arange(0, BK)
        mk = rk < K
        pre = tl.zeros((BK, BF), tl.float32)
        for d0 in range(0, D, BD):
            rd = d0 + tl.arange(0, BD)
            md = rd < D
            kk = tl.load(Kx + g * K * D + rk[:, None] * D + rd[None, :], mask=mk[:, None] & md[None, :], other=0.0)
            w2t = tl.load(W2 + g * F * D + rf[None, :] * D + rd[:, None], mask=md[:, None] & mf[None, :], other=0.0)
            pre += tl.dot(kk, w2t, input_precision=PRECISION)
        tl.store(PRE + g * K * F + rk[:, None] * F + rf[None, :], pre, mask=mk[:, None] & mf[None, :])
        act = _gelu(pre)
        tl.store(PART_A2 + (g * ns + j) * K + rk, tl.sum(act * act, 1), mask=mk)
        if L2:
            for d0 in range(0, D, BD):
                rd = d0 + tl.arange(0, BD)
                md = rd < D
                w1t = tl.load(W1 + g * D * F + rd[None, :] * F + rf[:, None], mask=mf[:, None] & md[None, :],
                              other=0.0)
                part = tl.dot(act, w1t, input_precision=PRECISION)
                tl.store(PART_PRED + ((g * ns + j) * K + rk[:, None]) * D + rd[None, :], part,
                         mask=mk[:, None] & md[None, :])
        if j == 0:
            qk = tl.zeros((BC, BK), tl.float32)
            for d0 in range(0, D, BD):
                rd = d0 + tl.arange(0, BD)
                md = rd < D
                qq = tl.load(Q + g * C * D + rc[:, None] * D + rd[None, :], mask=mc[:, None] & md[None, :],
                             other=0.0)
                kt = tl.load(Kx + g * K * D + rk[None, :] * D + rd[:, None], mask=md[:, None] & mk[None, :],
                             other=0.0)
                qk += tl.dot(qq, kt, input_precision=PRECISION)
            tl.store(QK + g * C * K + rc[:, None] * K + rk[None, :], qk, mask=mc[:, None] & mk[None, :])


@triton.jit
def _error_kernel(Kx, V, PART_PRED, PART_A2, ERR, ERR2, K2, A2, K, D, NS: tl.constexpr,
                  L2: tl.constexpr, BR: tl.constexpr, BDF: tl.constexpr):
    g = tl.program_id(1).to(tl.int64)
    rr = tl.program_id(0) * BR + tl.arange(0, BR)
    rd = tl.arange(0, BDF)
    mr, md = rr < K, rd < D
    m = mr[:, None] & md[None, :]
    offs = g * K * D + rr[:, None] * D + rd[None, :]
    kk = tl.load(Kx + offs, mask=m, other=0.0)
    vv = tl.load(V + offs, mask=m, other=0.0)
    a2 = tl.zeros((BR,), tl.float32)
    if L2:
        pred = kk
        for j in tl.static_range(NS):  # unrolled: the shares' loads overlap
            pred += tl.load(PART_PRED + ((g * NS + j) * K + rr[:, None]) * D + rd[None, :], mask=m, other=0.0)
        err = 2.0 * (pred - vv)
    else:
        err = -vv
    for j in tl.static_range(NS):
        a2 += tl.load(PART_A2 + (g * NS + j) * K + rr, mask=mr, other=0.0)
    tl.store(ERR + offs, err, mask=m)
    tl.store(ERR2 + g * K + rr, tl.sum(err * err, 1), mask=mr)
    tl.store(K2 + g * K + rr, tl.sum(kk * kk, 1), mask=mr)
    tl.store(A2 + g * K + rr, a2, mask=mr)


@triton.jit
def _back_kernel(ERR, W1, PRE, BACK, E, PART_E2, K, D, F,
                 BK: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr, PRECISION: tl.constexpr):
    """Program ``(j, t, g)``: slice ``j`` on block ``t`` of the written tokens."""
    j = tl.program_id(0)
    g = tl.program_id(2).to(tl.int64)
    ns = tl.num_programs(0)
    rf = j * BF + tl.arange(0, BF)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    mf, mk = rf < F, rk < K
    back = tl.zeros((BK, BF), tl.float32)
    for d0 in range(0, D, BD):
        rd = d0 + tl.arange(0, BD)
        md = rd < D
        err = tl.load(ERR + g * K * D + rk[:, None] * D + rd[None, :], mask=mk[:, None] & md[None, :], other=0.0)
        w1 = tl.load(W1 + g * D * F + rd[:, None] * F + rf[None, :], mask=md[:, None] & mf[None, :], other=0.0)
        back += tl.dot(err, w1, input_precision=PRECISION)
    kf = mk[:, None] & mf[None, :]
    offs = g * K * F + rk[:, None] * F + rf[None, :]
    e = back * _gelu_slope(tl.load(PRE + offs, mask=kf, other=0.0))
    tl.store(BACK + offs, back, mask=kf)
    tl.store(E + offs, e, mask=kf)
    tl.store(PART_E2 + (g * ns + j) * K + rk, tl.sum(e * e, 1), mask=mk)


@triton.jit
def _clip_scale(PART_E2, ERR2, K2, A2, g, rk, mk, K, NS, CLIP: tl.constexpr, clip, BK: tl.constexpr):
    """The clip's per-token scale ``min(1, clip / ||grad||)``: one for every token without a clip."""
    if CLIP:
        e2 = tl.zeros((BK,), tl.float32)
        for j in range(NS):
            e2 += tl.load(PART_E2 + (g * NS + j) * K + rk, mask=mk, other=0.0)
        n2 = tl.load(A2 + g * K + rk, mask=mk, other=0.0) * tl.load(ERR2 + g * K + rk, mask=mk, other=0.0)
        n2 += e2 * tl.load(K2 + g * K + rk, mask=mk, other=0.0)
        return tl.minimum(clip / tl.sqrt(tl.maximum(n2, 1e-30)), 1.0)
    return tl.full((BK,), 1.0, tl.float32)


@triton.jit
def _read_kernel(W1, S1, PRE, E, QW, QS, QK, GA, GB, GC, PART_E2, ERR2, K2, A2, SCALE, HP, H, PART_HW, PART_HS,
                 PART_P, clip, C, K, D, F,
                 HAS_S: tl.constexpr, CLIP: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, TB: tl.constexpr,
                 BF: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr, PRECISION: tl.constexpr):
    """Program ``(j, w, g)``: the clip's scale, the queries' hidden layer on slice ``j`` through every token's
    online weights, and its shares of ``h W1^T`` and ``h S1^T`` on width block ``w`` (``BW`` columns, in
    steps of ``BD``) and of ``h gelu(pre)^T``. Every width block computes the hidden layer again (three
    ``(chunk, slice)`` loads and one product, from L2) so that enough programs stream ``W1`` and ``S1``;
    the first one writes it. The written tokens are taken ``BK`` at a time."""
    j = tl.program_id(0)
    w = tl.program_id(1)
    g = tl.program_id(2).to(tl.int64)  # a third grid axis: the width blocks are the second
    ns = tl.num_programs(0)
    rf, rc = j * BF + tl.arange(0, BF), tl.arange(0, BC)
    mf, mc = rf < F, rc < C
    cf = mc[:, None] & mf[None, :]
    cf_offs = g * C * F + rc[:, None] * F + rf[None, :]
    hp = tl.load(GA + g * C + rc, mask=mc, other=0.0)[:, None] * tl.load(QW + cf_offs, mask=cf, other=0.0)
    if HAS_S:
        hp += tl.load(GB + g * C + rc, mask=mc, other=0.0)[:, None] * tl.load(QS + cf_offs, mask=cf, other=0.0)
    for t in range(TB):
        rk = t * BK + tl.arange(0, BK)
        mk = rk < K
        ck = mc[:, None] & mk[None, :]
        s = _clip_scale(PART_E2, ERR2, K2, A2, g, rk, mk, K, ns, CLIP, clip, BK)
        if (j == 0) & (w == 0):
            tl.store(SCALE + g * K + rk, s, mask=mk)
        e = tl.load(E + g * K * F + rk[:, None] * F + rf[None, :], mask=mk[:, None] & mf[None, :], other=0.0)
        coef = tl.load(GC + g * C * K + rc[:, None] * K + rk[None, :], mask=ck, other=0.0)
        qk = tl.load(QK + g * C * K + rc[:, None] * K + rk[None, :], mask=ck, other=0.0)
        hp += tl.dot(coef * qk * s[None, :], e, input_precision=PRECISION)
    h = _gelu(hp)
    if w == 0:
        tl.store(HP + cf_offs, hp, mask=cf)
        tl.store(H + cf_offs, h, mask=cf)
        for t in range(TB):
            rk = t * BK + tl.arange(0, BK)
            mk = rk < K
            act_t = _gelu(tl.load(PRE + g * K * F + rk[None, :] * F + rf[:, None], mask=mf[:, None] & mk[None, :],
                                  other=0.0))
            tl.store(PART_P + ((g * ns + j) * C + rc[:, None]) * K + rk[None, :],
                     tl.dot(h, act_t, input_precision=PRECISION), mask=mc[:, None] & mk[None, :])
    # W1 and S1 (D, F), read transposed: tiles of columns rf, rows rd.
    for d0 in range(w * BW, tl.minimum(D, (w + 1) * BW), BD):
        rd = d0 + tl.arange(0, BD)
        md = rd < D
        m1t = mf[:, None] & md[None, :]
        o1t = g * D * F + rd[None, :] * F + rf[:, None]
        cd = mc[:, None] & md[None, :]
        part = ((g * ns + j) * C + rc[:, None]) * D + rd[None, :]
        tl.store(PART_HW + part, tl.dot(h, tl.load(W1 + o1t, mask=m1t, other=0.0), input_precision=PRECISION),
                 mask=cd)
        if HAS_S:
            tl.store(PART_HS + part,
                     tl.dot(h, tl.load(S1 + o1t, mask=m1t, other=0.0), input_precision=PRECISION), mask=cd)


@triton.jit
def _update_kernel(Kx, W1, W2, S1, S2, W1_OUT, W2_OUT, S1_OUT, S2_OUT, PRE, E, ERR, GA, GB, GC, SA, SC, SCALE,
                   C, K, D, F,
                   HAS_S: tl.constexpr, BK: tl.constexpr, TB: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr,
                   PRECISION: tl.constexpr):
    """Program ``(j, w, g)``: the final values of ``W1, S1`` (columns of slice ``j``) and ``W2, S2`` (its
    rows) on width block ``w``, summing over the written tokens ``BK`` at a time. Apart from the read, and
    over width blocks too, so that enough programs stream the weights: one program per slice held the
    whole width (four warps per SM at T=8192, B=2)."""
    j, w = tl.program_id(0), tl.program_id(1)
    g = tl.program_id(2).to(tl.int64)
    rf, rd = j * BF + tl.arange(0, BF), w * BD + tl.arange(0, BD)
    mf, md = rf < F, rd < D
    a_last = tl.load(GA + g * C + C - 1)
    b_last = tl.load(GB + g * C + C - 1) if HAS_S else a_last
    sa = tl.load(SA + g) if HAS_S else a_last
    # W1 and S1 (D, F), the tile of rows rd, columns rf, then W2 and S2 (F, D), rows rf, columns rd: one
    # weight at a time, each accumulator started from the carried terms (their loads ahead of the products).
    offs = g * D * F + rd[:, None] * F + rf[None, :]
    mask = md[:, None] & mf[None, :]
    acc_w, acc_s = _carried_terms(W1, S1, offs, mask, a_last, b_last, sa, HAS_S)
    acc_w, acc_s = _add_written_terms(acc_w, acc_s, ERR, D, rd, md, PRE, F, rf, mf, GC, SC, SCALE, g, C, K,
                                      True, HAS_S, BK, TB, PRECISION)
    _store_final(W1_OUT, S1_OUT, offs, mask, acc_w, acc_s, HAS_S)
    offs = g * F * D + rf[:, None] * D + rd[None, :]
    mask = mf[:, None] & md[None, :]
    acc_w, acc_s = _carried_terms(W2, S2, offs, mask, a_last, b_last, sa, HAS_S)
    acc_w, acc_s = _add_written_terms(acc_w, acc_s, E, F, rf, mf, Kx, D, rd, md, GC, SC, SCALE, g, C, K,
                                      False, HAS_S, BK, TB, PRECISION)
    _store_final(W2_OUT, S2_OUT, offs, mask, acc_w, acc_s, HAS_S)


@triton.jit
def _add_written_terms(acc_w, acc_s, LEFT, NL, rl, ml, RIGHT, NR, rr, mr, GC, SC, SCALE, g, C, K,
                       GELU: tl.constexpr, HAS_S: tl.constexpr, BK: tl.constexpr, TB: tl.constexpr,
                       PRECISION: tl.constexpr):
    """``acc_w + (left cs) right`` and ``acc_s + (left ss) right`` over the written tokens, ``BK`` at a
    time: ``left`` is columns ``rl`` of ``LEFT (G, K, NL)`` loaded transposed, ``right`` columns ``rr`` of
    ``RIGHT (G, K, NR)``, through the GELU for ``GELU``."""
    for t in range(TB):
        rk = t * BK + tl.arange(0, BK)
        mk = rk < K
        _, cs, ss = _last_coefficients(GC, SC, SCALE, g, rk, mk, C, K, HAS_S)
        left_t = tl.load(LEFT + g * K * NL + rk[None, :] * NL + rl[:, None], mask=ml[:, None] & mk[None, :],
                         other=0.0)
        right = tl.load(RIGHT + g * K * NR + rk[:, None] * NR + rr[None, :], mask=mk[:, None] & mr[None, :],
                        other=0.0)
        if GELU:
            right = _gelu(right)
        acc_w += tl.dot(left_t * cs[None, :], right, input_precision=PRECISION)
        if HAS_S:
            acc_s += tl.dot(left_t * ss[None, :], right, input_precision=PRECISION)
    return acc_w, acc_s


@triton.jit
def _carried_terms(W, S, offs, mask, a_last, b_last, sa, HAS_S: tl.constexpr):
    """A tile's terms of the chunk's final weight ``a W + b S`` and momentum ``sa S`` (the second is the
    first again without momentum, and unused)."""
    w = a_last * tl.load(W + offs, mask=mask, other=0.0)
    s = w
    if HAS_S:
        s = tl.load(S + offs, mask=mask, other=0.0)
        w += b_last * s
        s = sa * s
    return w, s


@triton.jit
def _store_final(W_OUT, S_OUT, offs, mask, w, s, HAS_S: tl.constexpr):
    tl.store(W_OUT + offs, w, mask=mask)
    if HAS_S:
        tl.store(S_OUT + offs, s, mask=mask)


@triton.jit
def _last_coefficients(GC, SC, SCALE, g, rk, mk, C, K, HAS_S: tl.constexpr):
    """The written tokens' clip scale ``s`` and their coefficients in the chunk's final weights and
    momenta, scale included: the last row of ``c`` and ``sc`` (``cs`` again without momentum)."""
    s = tl.load(SCALE + g * K + rk, mask=mk, other=0.0)
    cs = tl.load(GC + g * C * K + (C - 1) * K + rk, mask=mk, other=0.0) * s
    ss = tl.load(SC + g * K + rk, mask=mk, other=0.0) * s if HAS_S else cs
    return s, cs, ss


@triton.jit
def _output_kernel(Q, ERR, GA, GB, GC, SCALE, PART_HW, PART_HS, PART_P, HW, HS, P, Y, C, K, D, NS,
                   HAS_S: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, U: tl.constexpr,
                   PRECISION: tl.constexpr):
    """Program ``(r, w, g)``: rows block ``r`` of the chunk's queries, block ``w`` of the value width, all
    the written tokens in one block (blocks of 16 made the shares of ``p`` slower for Atlas' window,
    benchmarks/RESULTS.md)."""
    g = tl.program_id(2).to(tl.int64)
    w = tl.program_id(1)
    rr = tl.program_id(0) * BR + tl.arange(0, BR)
    rd, rk = w * BD + tl.arange(0, BD), tl.arange(0, BK)
    mr, md, mk = rr < C, rd < D, rk < K
    m = mr[:, None] & md[None, :]
    mp = mr[:, None] & mk[None, :]
    hw = tl.zeros((BR, BD), tl.float32)
    hs = tl.zeros((BR, BD), tl.float32)
    p = tl.zeros((BR, BK), tl.float32)
    # U shares per step: all NS unrolled hold too many registers and made this kernel far slower, a rolled
    # loop waits on each share's loads in turn (benchmarks/RESULTS.md).
    for j0 in range(0, NS, U):
        for u in tl.static_range(U):
            j = j0 + u
            ok = _share_exists(j, NS, BR)[:, None]
            part = ((g * NS + j) * C + rr[:, None]) * D + rd[None, :]
            hw += tl.load(PART_HW + part, mask=m & ok, other=0.0)
            if HAS_S:
                hs += tl.load(PART_HS + part, mask=m & ok, other=0.0)
            p += tl.load(PART_P + ((g * NS + j) * C + rr[:, None]) * K + rk[None, :], mask=mp & ok, other=0.0)
    offs = g * C * D + rr[:, None] * D + rd[None, :]
    tl.store(HW + offs, hw, mask=m)
    if w == 0:
        tl.store(P + g * C * K + rr[:, None] * K + rk[None, :], p, mask=mp)
    y = tl.load(Q + offs, mask=m, other=0.0) + tl.load(GA + g * C + rr, mask=mr, other=0.0)[:, None] * hw
    if HAS_S:
        tl.store(HS + offs, hs, mask=m)
        y += tl.load(GB + g * C + rr, mask=mr, other=0.0)[:, None] * hs
    s = tl.load(SCALE + g * K + rk, mask=mk, other=0.0)
    coef = tl.load(GC + g * C * K + rr[:, None] * K + rk[None, :], mask=mp, other=0.0)
    err = tl.load(ERR + g * K * D + rk[:, None] * D + rd[None, :], mask=mk[:, None] & md[None, :], other=0.0)
    y += tl.dot(coef * p * s[None, :], err, input_precision=PRECISION)
    tl.store(Y + offs, y, mask=m)


@dataclass
class ForwardParts:
    """What the chunk's forward computed on the way, ``(G, ...)``: the backward's inputs.

    ``pre = k W2^T``, ``back = err W1``, ``e = back * gelu'(pre)`` (the unclipped ``w2``
    factor), ``err`` (the unclipped ``w1`` factor), ``scale`` (the clip's, ones without
    one), ``qw = q W2^T``, ``qs = q S2^T``, ``qk = q k^T``, the hidden layer ``hidden_pre``
    and ``hidden``, and ``hw = hidden W1^T``, ``hs = hidden S1^T``, ``p = hidden gelu(pre)^T``.
    ``qs`` and ``hs`` are ``None`` without momentum. The clip's squared norms ride along for
    its backward: ``a2 = ||gelu(pre)||^2``, ``err2 = ||err||^2``, ``k2 = ||k||^2`` per token
    and the slices' shares of ``||e||^2``, ``part_e2 (G, slices, K)``.
    """

    pre: torch.Tensor
    back: torch.Tensor
    e: torch.Tensor
    err: torch.Tensor
    scale: torch.Tensor
    qw: torch.Tensor
    qs: torch.Tensor | None
    qk: torch.Tensor
    hidden_pre: torch.Tensor
    hidden: torch.Tensor
    hw: torch.Tensor
    hs: torch.Tensor | None
    p: torch.Tensor
    a2: torch.Tensor
    err2: torch.Tensor
    k2: torch.Tensor
    part_e2: torch.Tensor


def _contiguous(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Each tensor contiguous (the kernels index rows of ``G``), ``None`` kept."""
    return [None if x is None else x.contiguous() for x in tensors]


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _token_block(K: int) -> int:
    """Written tokens per block of the kernels that take them in blocks: all of them in one block up to
    ``BLOCKS["tokens_whole"]``, else blocks of ``BLOCKS["tokens"]``. Atlas' Omega window writes
    ``K = C + window - 1`` tokens (79 at chunk 64, window 16), which one block pads to 128."""
    whole = _pow2(K)
    return whole if whole <= BLOCKS["tokens_whole"] else max(16, BLOCKS["tokens"])


def chunk_forward(spec, W: dict[str, torch.Tensor], S: dict[str, torch.Tensor] | None, q: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None, c: torch.Tensor,
                  sa_last: torch.Tensor | None, sc_last: torch.Tensor | None):
    """The chunk's read ``y (G, C, d)``, final weights and momenta (dicts of ``(G, ...)``, ``None``
    without momentum) and its :class:`ForwardParts`; arguments flattened to ``G = batch * heads``.

    The same values as :func:`~.titans_chunk.chunk_memory`'s PyTorch path, summed in another order."""
    G, C, D = q.shape
    K, F = k.shape[1], spec.hidden
    has_s = S is not None
    q, k, v, a, b, c, sa_last, sc_last = _contiguous(q, k, v, a, b, c, sa_last, sc_last)
    W1, W2 = W["w1"].contiguous(), W["w2"].contiguous()
    S1, S2 = (S["w1"].contiguous(), S["w2"].contiguous()) if has_s else (W1, W2)
    BF, BD, BR = min(BLOCKS["slice"], _pow2(F)), min(BLOCKS["width"], _pow2(D)), BLOCKS["rows"]
    launch = dict(num_warps=BLOCKS["warps"], num_stages=BLOCKS["stages"])
    BC, BK, BDF = _pow2(C), _token_block(K), _pow2(D)
    KB = triton.cdiv(K, BK)
    NS = triton.cdiv(F, BF)
    new = lambda *shape: q.new_empty(*shape)  # noqa: E731
    pre, back, e = new(G, K, F), new(G, K, F), new(G, K, F)
    qw, qk = new(G, C, F), new(G, C, K)
    qs = new(G, C, F) if has_s else qw
    part_pred, part_a2, part_e2 = new(G, NS, K, D), new(G, NS, K), new(G, NS, K)
    err, err2, k2, a2, scale = new(G, K, D), new(G, K), new(G, K), new(G, K), new(G, K)
    hp, h = new(G, C, F), new(G, C, F)
    part_hw, part_p = new(G, NS, C, D), new(G, NS, C, K)
    part_hs = new(G, NS, C, D) if has_s else part_hw
    hw, p, y = new(G, C, D), new(G, C, K), new(G, C, D)
    hs = new(G, C, D) if has_s else hw
    W1_out, W2_out = torch.empty_like(W1), torch.empty_like(W2)
    S1_out, S2_out = (torch.empty_like(W1), torch.empty_like(W2)) if has_s else (W1_out, W2_out)
    l2, clip = spec.objective == "l2", spec.grad_clip
    prec = _precision()
    slices = (NS, KB, G)
    _pre_kernel[(NS, KB + 1, G)](q, k, W1, W2, S2, pre, qw, qs, qk, part_pred, part_a2, C, K, D, F,
                        HAS_S=has_s, L2=l2, BC=BC, BK=BK, TB=KB, BF=BF, BD=BD, PRECISION=prec, **launch)
    _error_kernel[(triton.cdiv(K, BLOCKS["error_rows"]), G)](k, v, part_pred, part_a2, err, err2, k2, a2, K, D, NS,
                                                             L2=l2, BR=BLOCKS["error_rows"], BDF=BDF, **launch)
    _back_kernel[slices](err, W1, pre, back, e, part_e2, K, D, F, BK=BK, BF=BF, BD=BD, PRECISION=prec,
                         **launch)
    gb, gsa, gsc = (b, sa_last, sc_last) if has_s else (a, a, a)
    BW = max(BD, min(BLOCKS["read_width"], _pow2(D)))
    _read_kernel[(NS, triton.cdiv(D, BW), G)](
        W1, S1, pre, e, qw, qs, qk, a, gb, c, part_e2, err2, k2, a2, scale, hp, h, part_hw, part_hs, part_p,
        float(clip) if clip is not None else 0.0, C, K, D, F,
        HAS_S=has_s, CLIP=clip is not None, BC=BC, BK=BK, TB=KB, BF=BF, BD=BD, BW=BW,
        PRECISION=prec, num_warps=BLOCKS["read_warps"], num_stages=BLOCKS["stages"])
    BDU = min(BLOCKS["update_width"], _pow2(D))
    _update_kernel[(NS, triton.cdiv(D, BDU), G)](
        k, W1, W2, S1, S2, W1_out, W2_out, S1_out, S2_out, pre, e, err, a, gb, c, gsa, gsc, scale, C, K, D, F,
        HAS_S=has_s, BK=BK, TB=KB, BF=BF, BD=BDU, PRECISION=prec, num_warps=BLOCKS["update_warps"],
        num_stages=BLOCKS["stages"])
    BDO = min(BLOCKS["output_width"], _pow2(D))
    _output_kernel[(triton.cdiv(C, BR), triton.cdiv(D, BDO), G)](
        q, err, a, gb, c, scale, part_hw, part_hs, part_p, hw, hs, p, y, C, K, D, NS,
        HAS_S=has_s, BR=BR, BK=_pow2(K), BD=BDO, U=BLOCKS["share_unroll"], PRECISION=prec, **launch)
    parts = ForwardParts(pre=pre, back=back, e=e, err=err, scale=scale, qw=qw, qs=qs if has_s else None, qk=qk,
                         hidden_pre=hp, hidden=h, hw=hw, hs=hs if has_s else None, p=p,
                         a2=a2, err2=err2, k2=k2, part_e2=part_e2)
    W_new = {"w1": W1_out, "w2": W2_out}
    S_new = {"w1": S1_out, "w2": S2_out} if has_s else None
    return y, W_new, S_new, parts
