"""Triton kernels for Muon's Newton-Schulz iteration (:func:`~.atlas.newton_schulz`), one
program per matrix, forward and backward.

The PyTorch path runs the iteration on the Gram matrix as batched matmuls: each product is
``r x r x r`` per matrix (10 FLOP per byte of its operands), so a batch of them streams every
intermediate through memory and the iteration is memory-bound, about twenty launches forward
and fifty backward. Here a program holds one matrix's ``r x r`` iterates in registers and touches
the long side only in passes over column blocks:

- forward: one pass for ``||S||`` and the Gram matrix ``S S^T``, the iteration
  (``M_1 = a I + b G + c G^2``, ``M_{k+1} = a M_k + (b A_k + c A_k^2) M_k``, ``A_k = M_k G M_k^T``),
  one pass for ``N = M S / (||S|| + eps)``. When a gradient is wanted it keeps ``G``, the iterates
  ``M_1 .. M_steps`` and, for float32, each later step's ``A_k`` and ``P_k`` (``r x r`` each, exact in the
  input's dtype: 3.5x the size of a 64 x 256 input at five steps; bf16 and fp16 form them again,
  :func:`kept_tiles` says why);
- backward: one pass for ``dN X_0^T``, the PyTorch path's backward over the kept iterates in reverse, one
  pass for ``dS``. The scalar ``<dX_0, X_0>`` comes from
  ``r x r`` quantities (``<dN X_0^T, M> + <dG + dG^T, G>``), so ``dS`` is written in that one pass.
  Re-running the iteration here instead, in a per-program cache, made the backward 83 dependent
  ``r x r x r`` products per matrix against 58 now, and it was slower (benchmarks/RESULTS.md): the
  programs are latency-bound, so products saved are time saved (the same reason ``A_k`` and ``P_k`` are kept,
  not formed again from ``M_k``: 12 of the 58).

The iterates are polynomials in ``G`` (symmetric in exact arithmetic), but the kernels transpose
them where the PyTorch path does: ``A = M G M^T`` is the Gram matrix of the iterate actually held,
and with ``M`` in its place float32 gradients of near-singular momenta lost one to two digits.
Transposes go through memory (:func:`_transpose`), never ``tl.trans`` of a product, which Triton
3.4-3.7.0 miscompiles on Hopper when the result feeds another product.

Products run in the input's dtype (bf16 or fp16 operands), or for float32 in TF32 or exact
float32 as ``torch.get_float32_matmul_precision()`` asks, as the PyTorch path's matmuls do (TF32
operands rounded to nearest first: :func:`_mm`); each iterate is rounded to the products'
precision when formed (:func:`_rnd`), sums stay float32. Matrices are ``(n, r, L)`` views with
``r <= L`` and ``r <= 64`` (:func:`supported`); the output is contiguous. Exact float32 products
are slower here than in cuBLAS (:func:`faster`).

In Muon's training chunk each token's momentum ``S_t = sa_t S_0 + sum_k sc[t, k] short_k long_k^T`` is a
rank-``K`` update of the chunk's start momentum (``K`` the window's tokens). Formed in memory it was a
``(C, r, L)`` tensor a weight and chunk, written, cloned, orthogonalised and back-propagated through
autograd: the step's largest memory traffic. The ``FACTORS`` variant of both kernels
(:func:`momentum_newton_schulz_forward_triton`, :func:`momentum_newton_schulz_backward_triton`) forms it
block by block from the factors instead (:func:`_momentum`, one ``r x K x BL`` product a block), once a
program: into the output's place, where the Gram pass reads it back transposed and the last pass reads it
before writing the result over it. The backward writes ``dS_t`` (the factors' gradients are products of
it) and ``<dS_t, S_0>``.

:func:`muon_step_triton` is Atlas' whole Muon decode step on a weight in one launch (the momentum's
update, its Newton-Schulz, the weight's update and the row selects), where the PyTorch path runs
some thirty kernels per weight: a decode step is a string of small launches.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .backend import tl, triton


__all__ = [
    "MomentumFactors",
    "faster",
    "kept_tiles",
    "momentum_newton_schulz_backward_triton",
    "momentum_newton_schulz_forward_triton",
    "muon_step_triton",
    "newton_schulz_backward_triton",
    "newton_schulz_forward_triton",
    "products",
    "supported",
]

MAX_ROWS = 64
_BL = 64  # columns per block of the passes over the long side
# Four warps both ways and blocks of 64 columns: faster than eight warps (forward or backward) or blocks of
# 128 columns (benchmarks/RESULTS.md).
_FORWARD_WARPS, _BACKWARD_WARPS = 4, 4


def supported(S: torch.Tensor) -> bool:
    """Whether the kernels take ``(..., r, L)`` matrices like ``S``: ``r <= 64`` rows (the iterates live
    in registers), ``r <= L``, a floating dtype the tensor cores take."""
    r, L = S.shape[-2:]
    return 1 <= r <= MAX_ROWS and r <= L and S.dtype in (torch.float32, torch.bfloat16, torch.float16)


def faster(dtype: torch.dtype) -> bool:
    """Whether the kernels beat the PyTorch path for ``dtype`` now: not with exact float32 products, where
    Triton's float32 dots are slower than cuBLAS, by far in the backward (benchmarks/RESULTS.md)."""
    return products(dtype) != "ieee" or dtype != torch.float32


def products(dtype: torch.dtype) -> str:
    """The products' ``input_precision`` for inputs of ``dtype``, by the float32 matmul precision now."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"


_OPERANDS = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _mm(x, y, DT: tl.constexpr, PRECISION: tl.constexpr):
    if PRECISION == "tf32":
        # Triton's TF32 products truncate their operands on Hopper (a 64 x 256 x 64 product came out 2.6x
        # further from float64 than cuBLAS's, whose TF32 rounds): round them to nearest first. It took
        # the output's error from 3.7% to 0.23% (the PyTorch path's 0.41%) at the 340M layer's shape.
        return tl.dot(_rnd(x.to(tl.float32), DT, PRECISION), _rnd(y.to(tl.float32), DT, PRECISION),
                      input_precision=PRECISION)
    return tl.dot(x.to(DT), y.to(DT), input_precision=PRECISION)


@triton.jit
def _block(X, sr, sl, rr, cols, r, L):
    """``X[rr, cols]`` as an ``(R, BL)`` tile, zero outside the matrix."""
    return tl.load(X + rr[:, None] * sr + cols[None, :] * sl, mask=(rr[:, None] < r) & (cols[None, :] < L), other=0.0)


@triton.jit
def _block_t(X, sr, sl, rr, cols, r, L):
    """``X[rr, cols]^T`` as a ``(BL, R)`` tile, loaded transposed (not ``tl.trans``: see the module note)."""
    return tl.load(X + rr[None, :] * sr + cols[:, None] * sl, mask=(rr[None, :] < r) & (cols[:, None] < L), other=0.0)


@triton.jit
def _rnd(x, DT: tl.constexpr, PRECISION: tl.constexpr):
    """``x`` rounded to the products' precision, as each iterate is when formed: a polynomial's linear
    and higher terms must see the same matrix (bf16 operands with float32 iterates doubled the
    error against float64, 4.2% against the PyTorch path's 1.9% for 64 x 256 matrices)."""
    if DT != tl.float32:
        return x.to(DT).to(tl.float32)
    elif PRECISION == "tf32":  # to nearest, on TF32's 10 mantissa bits (truncation is biased: sums of it drift)
        return ((x.to(tl.int32, bitcast=True) + 4096) & -8192).to(tl.float32, bitcast=True)
    else:
        return x


@triton.jit
def _transpose(x, BUF, rr, r):
    """``x^T`` through memory (``BUF``: ``r x r`` floats of this program's output, rewritten later).
    ``tl.trans`` of a product that feeds another product is what Triton 3.4-3.7.0 miscompiles on
    Hopper; a round trip with barriers is the way around it that fla took."""
    real = (rr[:, None] < r) & (rr[None, :] < r)
    tl.store(BUF + rr[:, None] * r + rr[None, :], x, mask=real)
    tl.debug_barrier()
    y = tl.load(BUF + rr[None, :] * r + rr[:, None], mask=real, other=0.0)
    tl.debug_barrier()
    return y


@triton.jit
def _first(G, eye, a, b, c, DT: tl.constexpr, PRECISION: tl.constexpr):
    """``M_1 = a I + b G + c G^2`` (the first step from ``M_0 = I``)."""
    return _rnd(a * eye + b * G + c * _mm(G, G, DT, PRECISION), DT, PRECISION)


@triton.jit
def _gram_poly(M, Mt, G, b, c, DT: tl.constexpr, PRECISION: tl.constexpr):
    """``A = M G M^T`` and ``P = b A + c A^2`` for an iterate ``M`` and its transpose ``Mt`` (as loaded from
    memory). ``A`` is the Gram matrix of the iterate ``M X_0`` as computed, so the iteration corrects its
    own rounding; with ``M`` in place of ``M^T`` (equal in exact arithmetic) float32 gradients of
    near-singular momenta came out ten times further from float64 than the PyTorch path's."""
    A = _rnd(_mm(M, _rnd(_mm(G, Mt, DT, PRECISION), DT, PRECISION), DT, PRECISION), DT, PRECISION)
    return A, _rnd(b * A + c * _mm(A, A, DT, PRECISION), DT, PRECISION)


@triton.jit
def _step(M, G, BUF, rr, r, a, b, c, DT: tl.constexpr, PRECISION: tl.constexpr, KEEP: tl.constexpr, A_BUF, P_BUF):
    """The next iterate ``a M + P M`` (:func:`_gram_poly`), ``M^T`` through ``BUF``; ``KEEP``: ``A`` and ``P``
    stored at ``A_BUF`` and ``P_BUF``."""
    A, P = _gram_poly(M, _transpose(M, BUF, rr, r), G, b, c, DT, PRECISION)
    if KEEP:
        _store_square(A_BUF, A, rr, r)
        _store_square(P_BUF, P, rr, r)
    return _rnd(a * M + _mm(P, M, DT, PRECISION), DT, PRECISION)


@triton.jit
def _iterate(G, eye, steps, BUF, rr, r, a, b, c, DT: tl.constexpr, PRECISION: tl.constexpr,
             KEEP: tl.constexpr, KEEP_AP: tl.constexpr = False):
    """``M_steps`` (``steps >= 1``). ``KEEP``: ``BUF`` holds :func:`kept_tiles` tiles of ``r x r``: ``M_k`` is left
    in tile ``k - 1`` (the transpose of each step stores it there anyway) and, ``KEEP_AP``, the ``A`` and ``P``
    formed from the iterate in tile ``j`` in tiles ``steps + 1 + j`` and ``2 steps + j`` (tile ``steps`` is the
    caller's, for ``G``); otherwise one tile of scratch."""
    M = _first(G, eye, a, b, c, DT, PRECISION)
    for k in range(steps - 1):
        if KEEP:
            M = _step(M, G, BUF + k * r * r, rr, r, a, b, c, DT, PRECISION, KEEP_AP, BUF + (steps + 1 + k) * r * r,
                      BUF + (2 * steps + k) * r * r)
        else:
            M = _step(M, G, BUF, rr, r, a, b, c, DT, PRECISION, False, BUF, BUF)
    if KEEP:
        _store_square(BUF + (steps - 1) * r * r, M, rr, r)
    return M


@triton.jit
def _momentum(X, s_r, s_l, rr, cols, r, L, SH, LO, SCT, sa, sh_k, sh_r, lo_k, lo_l, K, BK: tl.constexpr,
              DT: tl.constexpr, PRECISION: tl.constexpr):
    """The ``(R, BL)`` block ``S_t[rr, cols]`` of Muon's momentum ``S_t = sa_t S_0 + sum_k sc[t, k] short_k
    long_k^T``, formed from its factors (``X`` is ``S_0``, ``SCT`` the row ``sc[t, :]``), not read from a tensor
    of momenta."""
    acc = sa * _block(X, s_r, s_l, rr, cols, r, L).to(tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        w = tl.load(SCT + ks, mask=ks < K, other=0.0)
        sh = tl.load(SH + ks[None, :] * sh_k + rr[:, None] * sh_r, mask=(ks[None, :] < K) & (rr[:, None] < r), other=0.0)
        lo = tl.load(LO + ks[:, None] * lo_k + cols[None, :] * lo_l, mask=(ks[:, None] < K) & (cols[None, :] < L),
                     other=0.0)
        acc += _mm(sh * w[None, :], lo, DT, PRECISION)
    return acc


@triton.jit
def _store_block(Y, y_r, y_l, x, rr, cols, r, L):
    tl.store(Y + rr[:, None] * y_r + cols[None, :] * y_l, x, mask=(rr[:, None] < r) & (cols[None, :] < L))


@triton.jit
def _store_square(BUF, x, rr, r):
    tl.store(BUF + rr[:, None] * r + rr[None, :], x, mask=(rr[:, None] < r) & (rr[None, :] < r))


@triton.jit
def _square(BUF, rr, r):
    """The ``r x r`` tile at ``BUF`` (row-major), as float32 zero-padded to ``R x R``."""
    return tl.load(BUF + rr[:, None] * r + rr[None, :], mask=(rr[:, None] < r) & (rr[None, :] < r),
                   other=0.0).to(tl.float32)


@triton.jit
def _square_t(BUF, rr, r):
    """The transpose of :func:`_square`, loaded transposed."""
    return tl.load(BUF + rr[None, :] * r + rr[:, None], mask=(rr[:, None] < r) & (rr[None, :] < r),
                   other=0.0).to(tl.float32)


@triton.jit
def _forward_kernel(S, N, NORM, KEPT, SCRATCH, s_n, s_r, s_l, y_r, y_l, r, L, eps, a, b, c,
                    SH, LO, SC, SA, sh_n, sh_k, sh_r, lo_n, lo_k, lo_l, sc_n, sc_t, sa_n, K, T,
                    STEPS: tl.constexpr, R: tl.constexpr, BL: tl.constexpr, DT: tl.constexpr,
                    PRECISION: tl.constexpr, KEEP: tl.constexpr, FACTORS: tl.constexpr, BK: tl.constexpr,
                    KEEP_AP: tl.constexpr):
    """Program ``i``'s ``N = NS(S)``, stored through the strides ``(y_r, y_l)`` at ``N + i r L``. ``KEEP``: the
    iterates ``M_1 .. M_STEPS``, ``G`` and (``KEEP_AP``) each later step's ``A`` and ``P`` go to ``KEPT``
    (:func:`kept_tiles` tiles of ``r x r`` per matrix, in the input's dtype: each was rounded to the products' precision when formed, so the
    copy is exact) for the backward. ``FACTORS``: program ``i`` is token ``i % T`` of row ``i // T``, whose momentum :func:`_momentum`
    forms from the row's factors (``S`` holds the rows' ``S_0``) once, into ``N``'s place, where the Gram
    product reads it back transposed and the last pass reads it before writing ``N`` over it; the iteration's
    transposes then go through ``SCRATCH`` (``r x r`` a program) unless ``KEEP``."""
    i = tl.program_id(0).to(tl.int64)
    row, t = i // T, i % T  # T = 1 without factors: row i
    X = S + row * s_n
    SH, LO, SCT = SH + row * sh_n, LO + row * lo_n, SC + row * sc_n + t * sc_t
    sa = 1.0
    if FACTORS:
        sa = tl.load(SA + row * sa_n + t)
    Y = N + i * r * L
    rr = tl.arange(0, R)
    gram = tl.zeros((R, R), tl.float32)
    squares = tl.zeros((R, BL), tl.float32)
    for l0 in range(0, L, BL):
        cols = l0 + tl.arange(0, BL)
        if FACTORS:
            x = _momentum(X, s_r, s_l, rr, cols, r, L, SH, LO, SCT, sa, sh_k, sh_r, lo_k, lo_l, K, BK, DT, PRECISION)
            _store_block(Y, y_r, y_l, x, rr, cols, r, L)
            tl.debug_barrier()
            xt = _block_t(Y, y_r, y_l, rr, cols, r, L)
        else:
            x = _block(X, s_r, s_l, rr, cols, r, L)
            xt = _block_t(X, s_r, s_l, rr, cols, r, L)
        gram += _mm(x, xt, DT, PRECISION)
        squares += x.to(tl.float32) * x.to(tl.float32)
    norm = tl.sqrt(tl.sum(squares))
    d = norm + eps
    G = _rnd(gram / (d * d), DT, PRECISION)
    eye = tl.where(rr[:, None] == rr[None, :], 1.0, 0.0)
    if KEEP:
        tiles = STEPS + 1
        if KEEP_AP:
            tiles = 3 * STEPS - 1
        kept = KEPT + i * tiles * r * r
        _store_square(kept + STEPS * r * r, G, rr, r)
        M = _iterate(G, eye, STEPS, kept, rr, r, a, b, c, DT, PRECISION, True, KEEP_AP)
    elif FACTORS:
        M = _iterate(G, eye, STEPS, SCRATCH + i * r * r, rr, r, a, b, c, DT, PRECISION, False)
    else:
        M = _iterate(G, eye, STEPS, Y, rr, r, a, b, c, DT, PRECISION, False)
    M = M / d  # N = M X_0 = (M / d) S
    tl.store(NORM + i, norm)
    for l0 in range(0, L, BL):
        cols = l0 + tl.arange(0, BL)
        if FACTORS:
            x = _block(Y, y_r, y_l, rr, cols, r, L)
        else:
            x = _block(X, s_r, s_l, rr, cols, r, L)
        y = _mm(M, x, DT, PRECISION)
        tl.debug_barrier()  # the block is read before it is written over
        _store_block(Y, y_r, y_l, y.to(N.dtype.element_ty), rr, cols, r, L)


@triton.jit
def _backward_kernel(S, NORM, KEPT, DN, DS, DSA, SCRATCH, s_n, s_r, s_l, d_n, d_r, d_l, r, L, eps, tiny, a, b, c,
                     SH, LO, SC, SA, sh_n, sh_k, sh_r, lo_n, lo_k, lo_l, sc_n, sc_t, sa_n, K, T,
                     STEPS: tl.constexpr, R: tl.constexpr, BL: tl.constexpr, DT: tl.constexpr,
                     PRECISION: tl.constexpr, FACTORS: tl.constexpr, BK: tl.constexpr, KEEP_AP: tl.constexpr):
    """From the forward's kept ``G``, iterates and (``KEEP_AP``) each later step's ``A_k``, ``P_k`` (otherwise
    formed again from ``M_k``): one pass for ``dN X_0^T``, the PyTorch path's backward over the steps in reverse,
    one pass for ``dS``. ``FACTORS`` (as in
    :func:`_forward_kernel`): the momentum is formed again from its factors once, into ``dS``'s place (the
    transposes then go through ``SCRATCH``), and ``DSA + i`` gets ``<dS, S_0>``, its ``sa_t``'s gradient."""
    i = tl.program_id(0).to(tl.int64)
    row, t = i // T, i % T
    X = S + row * s_n
    SH, LO, SCT = SH + row * sh_n, LO + row * lo_n, SC + row * sc_n + t * sc_t
    sa = 1.0
    if FACTORS:
        sa = tl.load(SA + row * sa_n + t)
    Y = DN + i * d_n
    Z = DS + i * r * L  # dS; without factors also the transposes' scratch, before the last pass writes it
    BUF = Z
    if FACTORS:
        BUF = SCRATCH + i * r * r
    tiles = STEPS + 1
    if KEEP_AP:
        tiles = 3 * STEPS - 1
    kept = KEPT + i * tiles * r * r
    rr = tl.arange(0, R)
    eye = tl.where(rr[:, None] == rr[None, :], 1.0, 0.0)
    G = _square(kept + STEPS * r * r, rr, r)
    dM = tl.zeros((R, R), tl.float32)
    for l0 in range(0, L, BL):
        cols = l0 + tl.arange(0, BL)
        if FACTORS:
            x = _momentum(X, s_r, s_l, rr, cols, r, L, SH, LO, SCT, sa, sh_k, sh_r, lo_k, lo_l, K, BK, DT, PRECISION)
            _store_block(Z, L, 1, x, rr, cols, r, L)
            tl.debug_barrier()
            xt = _block_t(Z, L, 1, rr, cols, r, L)
        else:
            xt = _block_t(X, s_r, s_l, rr, cols, r, L)
        dM += _mm(_block(Y, d_r, d_l, rr, cols, r, L), xt, DT, PRECISION)
    norm = tl.load(NORM + i)
    d = norm + eps
    dM = _rnd(dM / d, DT, PRECISION)  # dN X_0^T
    inner = tl.sum(dM * _square(kept + (STEPS - 1) * r * r, rr, r))  # <M^T dN, X_0>
    dG = tl.zeros((R, R), tl.float32)
    for back in range(STEPS - 1):  # the PyTorch path's backward, its step k = STEPS - 2 - back
        k = STEPS - 2 - back
        M = _square(kept + k * r * r, rr, r)
        Mt = _square_t(kept + k * r * r, rr, r)
        if KEEP_AP:
            A = _square(kept + (STEPS + 1 + k) * r * r, rr, r)
            P = _square(kept + (2 * STEPS + k) * r * r, rr, r)
        else:
            A, P = _gram_poly(M, Mt, G, b, c, DT, PRECISION)
        dP = _rnd(_mm(dM, Mt, DT, PRECISION), DT, PRECISION)
        dA = _rnd(b * dP + c * (_mm(dP, A, DT, PRECISION) + _mm(A, dP, DT, PRECISION)), DT, PRECISION)
        dA_sym = _rnd(dA + _transpose(dA, BUF, rr, r), DT, PRECISION)
        MG = _rnd(_mm(M, G, DT, PRECISION), DT, PRECISION)
        dM = _rnd(a * dM + _mm(P, dM, DT, PRECISION) + _mm(dA_sym, MG, DT, PRECISION), DT, PRECISION)
        dG += _mm(Mt, _rnd(_mm(dA, M, DT, PRECISION), DT, PRECISION), DT, PRECISION)
    dG += b * dM + c * (_mm(dM, G, DT, PRECISION) + _mm(G, dM, DT, PRECISION))  # M_1 = a I + b G + c G^2
    dG += _transpose(dG, BUF, rr, r)
    inner += tl.sum(dG * G)  # + <(dG + dG^T) X_0, X_0>
    along = inner * d / tl.maximum(norm, tiny)
    # dS = (dX_0 - along X_0) / d with dX_0 = M^T dN + (dG + dG^T) X_0 and X_0 = S / d
    Mt_last = _square_t(kept + (STEPS - 1) * r * r, rr, r) / d
    C = (dG - along * eye) / (d * d)
    start = tl.zeros((R, BL), tl.float32)  # <dS, S_0>'s terms
    for l0 in range(0, L, BL):
        cols = l0 + tl.arange(0, BL)
        if FACTORS:
            x = _block(Z, L, 1, rr, cols, r, L)
        else:
            x = _block(X, s_r, s_l, rr, cols, r, L)
        z = _mm(Mt_last, _block(Y, d_r, d_l, rr, cols, r, L), DT, PRECISION) + _mm(C, x, DT, PRECISION)
        tl.debug_barrier()  # the block is read before it is written over
        _store_block(Z, L, 1, z.to(DS.dtype.element_ty), rr, cols, r, L)
        if FACTORS:
            start += z * _block(X, s_r, s_l, rr, cols, r, L)
    if FACTORS:
        tl.store(DSA + i, tl.sum(start))


@triton.jit
def _muon_step_kernel(W, S, C, GRAD, GATES, FLAGS, W_OUT, S_OUT, C_OUT, s_r, s_l, r, L, eps, a, b, c,
                      STEPS: tl.constexpr, R: tl.constexpr, BL: tl.constexpr, DT: tl.constexpr,
                      PRECISION: tl.constexpr):
    """One decode step of Muon on one ``(row, head)`` matrix (contiguous ``(G, rows, cols)`` tensors read
    through the wide view's strides ``s_r, s_l``): ``S' = m S + g``, ``W' = retention W - lr NS(S')`` on live
    rows, ``C' = W`` on live rows that start an inner chunk. ``GATES (G, 3)``: ``retention, lr, m``;
    ``FLAGS (G, 2)``: live, at start."""
    i = tl.program_id(0).to(tl.int64)
    base = i * r * L
    rr = tl.arange(0, R)
    retention, lr, mom = tl.load(GATES + 3 * i), tl.load(GATES + 3 * i + 1), tl.load(GATES + 3 * i + 2)
    live = tl.load(FLAGS + 2 * i) != 0
    starts = live & (tl.load(FLAGS + 2 * i + 1) != 0)
    gram = tl.zeros((R, R), tl.float32)
    squares = tl.zeros((R, BL), tl.float32)
    for l0 in range(0, L, BL):
        cols = l0 + tl.arange(0, BL)
        x = mom * _block(S + base, s_r, s_l, rr, cols, r, L) + _block(GRAD + base, s_r, s_l, rr, cols, r, L)
        xt = mom * _block_t(S + base, s_r, s_l, rr, cols, r, L) + _block_t(GRAD + base, s_r, s_l, rr, cols, r, L)
        gram += _mm(x, xt, DT, PRECISION)
        squares += x * x
    norm = tl.sqrt(tl.sum(squares))
    d = norm + eps
    G = _rnd(gram / (d * d), DT, PRECISION)
    eye = tl.where(rr[:, None] == rr[None, :], 1.0, 0.0)
    M = _iterate(G, eye, STEPS, W_OUT + base, rr, r, a, b, c, DT, PRECISION, False) / d
    for l0 in range(0, L, BL):
        cols = l0 + tl.arange(0, BL)
        offs = rr[:, None] * s_r + cols[None, :] * s_l
        mask = (rr[:, None] < r) & (cols[None, :] < L)
        s_old = tl.load(S + base + offs, mask=mask, other=0.0)
        x = mom * s_old + tl.load(GRAD + base + offs, mask=mask, other=0.0)
        w = tl.load(W + base + offs, mask=mask, other=0.0)
        tl.store(S_OUT + base + offs, tl.where(live, x, s_old), mask=mask)
        tl.store(W_OUT + base + offs, tl.where(live, retention * w - lr * _mm(M, x, DT, PRECISION), w), mask=mask)
        tl.store(C_OUT + base + offs, tl.where(starts, w, tl.load(C + base + offs, mask=mask, other=0.0)),
                 mask=mask)


def muon_step_triton(weights: dict[str, torch.Tensor], momenta: dict[str, torch.Tensor],
                     chunk_start: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], retention: torch.Tensor,
                     lr: torch.Tensor, momentum: torch.Tensor, live: torch.Tensor, at_start: torch.Tensor,
                     steps: int, coefficients: tuple[float, float, float], eps: float = 1e-7
                     ) -> tuple[dict, dict, dict]:
    """A Muon decode step of every weight of a memory (see :func:`~.atlas.step_atlas`), one launch per
    weight: new weights, momenta and chunk-start weights from the old ones and the window gradients
    (dicts of ``(B, H, rows, cols)`` float32), gates ``(B, H)`` and row flags ``(B,)``. A momentum's
    Newton-Schulz runs on its wide view (tall matrices through their transposed strides)."""
    B, H = retention.shape
    gates = torch.stack([retention, lr, momentum], -1).to(torch.float32).reshape(B * H, 3)
    flags = torch.stack([live, at_start], -1)[:, None].expand(B, H, 2).reshape(B * H, 2).to(torch.int8)
    out: tuple[dict, dict, dict] = ({}, {}, {})
    for name in weights:
        W, S, C, grad = (x[name].contiguous() for x in (weights, momenta, chunk_start, grads))
        rows, cols = W.shape[-2:]
        tall = rows > cols
        r, L = (cols, rows) if tall else (rows, cols)
        s_r, s_l = (1, cols) if tall else (cols, 1)
        W_out, S_out, C_out = torch.empty_like(W), torch.empty_like(W), torch.empty_like(W)
        _muon_step_kernel[(B * H,)](W, S, C, grad, gates, flags, W_out, S_out, C_out, s_r, s_l, r, L, eps,
                                    *coefficients, STEPS=steps, R=_rows(r), BL=_BL, DT=tl.float32,
                                    PRECISION=products(torch.float32), num_warps=_FORWARD_WARPS)
        for new, tensor in zip(out, (W_out, S_out, C_out)):
            new[name] = tensor
    return out


def kept_tiles(steps: int, dtype: torch.dtype) -> int:
    """The ``r x r`` tiles the forward keeps a matrix of ``dtype`` for the backward: ``M_1 .. M_steps``, ``G`` and,
    for float32, the ``A_k`` and ``P_k`` of the ``steps - 1`` steps after the first (read, not formed again: the
    backward's programs are latency-bound, and these were 12 of its 58 dependent products at five steps). bf16
    and fp16 form them again: with the extra stores the compiled bf16 forward fell outside the accuracy that
    tests/test_gpu_newton_schulz.py asks of it (benchmarks/history, entry 51), for a cause not yet found, while
    float32 and TF32 did not move."""
    return 3 * steps - 1 if dtype == torch.float32 else steps + 1


def _rows(r: int) -> int:
    return max(16, triton.next_power_of_2(r))


# The factor arguments of the kernels where the matrices are read, not formed (their loops never run).
def _no_factors(S: torch.Tensor) -> tuple:
    return (S, S, S, S, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1)


def _block_of_tokens(K: int) -> int:
    return min(32, max(16, triton.next_power_of_2(K)))


def newton_schulz_forward_triton(S: torch.Tensor, steps: int, eps: float, precision: str | None = None,
                                 keep: bool = True, *, coefficients: tuple[float, float, float]
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(N, norms, kept)`` for ``(n, r, L)`` matrices ``S`` (:func:`supported`), ``steps >= 1``: ``N``
    contiguous in ``S``'s dtype, ``norms`` ``(n,)`` float32 and, with ``keep``, the Gram matrices and
    iterates ``(n, kept_tiles(steps), r, r)`` in ``S``'s dtype (3.5x the size of ``S`` for ``L = 4r``, five
    steps); the last two are the backward's inputs. ``precision``: the products'
    ``input_precision`` (default :func:`products`); ``coefficients``: the iteration's ``(a, b, c)``."""
    n, r, L = S.shape
    N = torch.empty(n, r, L, device=S.device, dtype=S.dtype)
    norms = torch.empty(n, device=S.device, dtype=torch.float32)
    kept = torch.empty(n, kept_tiles(steps, S.dtype), r, r, device=S.device, dtype=S.dtype) if keep else None
    if n:
        _forward_kernel[(n,)](S, N, norms, N if kept is None else kept, N, *S.stride(), L, 1, r, L, eps, *coefficients,
                              *_no_factors(S), STEPS=steps, R=_rows(r), BL=_BL, DT=_OPERANDS[S.dtype],
                              PRECISION=precision or products(S.dtype), KEEP=keep, FACTORS=False, BK=16,
                              KEEP_AP=kept_tiles(steps, S.dtype) > steps + 1,
                              num_warps=_FORWARD_WARPS)
    return N, norms, kept


def newton_schulz_backward_triton(S: torch.Tensor, norms: torch.Tensor, kept: torch.Tensor, dN: torch.Tensor,
                                  steps: int, eps: float, precision: str | None = None, *,
                                  coefficients: tuple[float, float, float]) -> torch.Tensor:
    """``dS`` (contiguous, ``S``'s dtype) for the forward's ``S``, its ``norms`` and ``kept`` iterates, and
    ``dN`` (``(n, r, L)``)."""
    n, r, L = S.shape
    dS = torch.empty(n, r, L, device=S.device, dtype=S.dtype)
    if n:
        _backward_kernel[(n,)](S, norms, kept, dN, dS, norms, dS, *S.stride(), *dN.stride(), r, L, eps,
                               torch.finfo(torch.float32).tiny, *coefficients, *_no_factors(S), STEPS=steps,
                               R=_rows(r), BL=_BL, DT=_OPERANDS[S.dtype], PRECISION=precision or products(S.dtype),
                               FACTORS=False, BK=16, KEEP_AP=kept.shape[1] > steps + 1, num_warps=_BACKWARD_WARPS)
    return dS


class MomentumFactors(NamedTuple):
    """Muon's per-token momenta of one weight in a chunk, as the kernels take them: ``S_t = sa_t S_0 +
    sum_k sc[t, k] short_k long_k^T`` for rows ``(n, ...)``: ``short (n, K, r)``, ``long (n, K, L)``, ``sc (n, T, K)``,
    ``sa (n, T)`` and ``S0 (n, r, L)`` (any strides), with ``r <= L`` (the weight's wide orientation); ``tall``:
    the weight is ``(L, r)``, and ``N`` is stored in that orientation."""

    short: torch.Tensor
    long: torch.Tensor
    sc: torch.Tensor
    sa: torch.Tensor
    S0: torch.Tensor
    tall: bool

    def arguments(self) -> tuple:
        n, K, r = self.short.shape
        T = self.sc.shape[1]
        return (self.short, self.long, self.sc, self.sa, self.short.stride(0), self.short.stride(1),
                self.short.stride(2), self.long.stride(0), self.long.stride(1), self.long.stride(2),
                self.sc.stride(0), self.sc.stride(1), self.sa.stride(0), K, T)


def momentum_newton_schulz_forward_triton(f: MomentumFactors, steps: int, eps: float, precision: str | None = None,
                                          keep: bool = True, *, coefficients: tuple[float, float, float]
                                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`newton_schulz_forward_triton` of every token's momentum ``S_t`` (:class:`MomentumFactors`, float32,
    ``sc`` and ``sa`` with unit last stride), each formed on chip from its factors: ``N`` ``(n, T, d_out, d_in)``
    contiguous in the weight's orientation, ``norms`` and ``kept`` ``(n * T, ...)``."""
    if any(x.dtype != torch.float32 for x in f[:5]) or f.sc.stride(-1) != 1 or f.sa.stride(-1) != 1:
        raise ValueError("the momentum kernels take float32 factors, with sc and sa of unit last stride")
    n, K, r = f.short.shape
    L, T = f.long.shape[-1], f.sc.shape[1]
    N = torch.empty(n, T, *((L, r) if f.tall else (r, L)), device=f.S0.device, dtype=torch.float32)
    norms = torch.empty(n * T, device=f.S0.device, dtype=torch.float32)
    kept = torch.empty(n * T, kept_tiles(steps, torch.float32), r, r, device=f.S0.device, dtype=torch.float32) \
        if keep else None
    if n * T:
        # the iteration's transposes: in the kept iterates' place, or r x r of scratch a program
        scratch = kept if keep else torch.empty(n * T, r, r, device=N.device, dtype=torch.float32)
        _forward_kernel[(n * T,)](f.S0, N, norms, scratch, scratch, *f.S0.stride(),
                                  *((1, r) if f.tall else (L, 1)), r, L, eps, *coefficients, *f.arguments(),
                                  STEPS=steps, R=_rows(r), BL=_BL, DT=tl.float32,
                                  PRECISION=precision or products(torch.float32), KEEP=keep, FACTORS=True, KEEP_AP=True,
                                  BK=_block_of_tokens(K), num_warps=_FORWARD_WARPS)
    return N, norms, kept


def momentum_newton_schulz_backward_triton(f: MomentumFactors, norms: torch.Tensor, kept: torch.Tensor,
                                           dN: torch.Tensor, steps: int, eps: float, precision: str | None = None, *,
                                           coefficients: tuple[float, float, float]
                                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dS, dsa)`` for the forward's factors, ``norms`` and ``kept``, and ``dN`` (``(n, T, d_out, d_in)``,
    contiguous): every token's ``dS_t`` ``(n, T, r, L)`` in the wide orientation, and ``<dS_t, S_0>``
    ``(n, T)``, the gradient of ``sa_t``. The factors' other gradients are products of ``dS`` (the caller's)."""
    n, K, r = f.short.shape
    L, T = f.long.shape[-1], f.sc.shape[1]
    dS = torch.empty(n, T, r, L, device=dN.device, dtype=torch.float32)
    dsa = torch.empty(n, T, device=dN.device, dtype=torch.float32)
    if n * T:
        scratch = torch.empty(n * T, r, r, device=dN.device, dtype=torch.float32)  # the transposes'
        _backward_kernel[(n * T,)](f.S0, norms, kept, dN, dS, dsa, scratch, *f.S0.stride(), r * L,
                                   *((1, r) if f.tall else (L, 1)),
                                   r, L, eps, torch.finfo(torch.float32).tiny, *coefficients, *f.arguments(),
                                   STEPS=steps, R=_rows(r), BL=_BL, DT=tl.float32,
                                   PRECISION=precision or products(torch.float32), FACTORS=True, KEEP_AP=True,
                                   BK=_block_of_tokens(K), num_warps=_BACKWARD_WARPS)
    return dS, dsa
