"""The Hebbian DeepTransformer's key pass (:class:`~.deep_attention_hebbian._KeyPass`) as a wavefront of
Triton launches, forward and backward.

The pass is sequential in chunks: chunk ``n``'s keys read the deep values ``U`` of every earlier chunk,
and its own ``U`` comes from that read. The PyTorch pass makes, per chunk, one attention call over the
whole prefix and one update kernel, and its backward an autograd call per chunk and a gradient add over
the prefix: at 128 chunks the host, not the GPU, set the time. Here a read is split into blocks, one
per earlier chunk, and a block ``(n, j)`` can run as soon as chunk ``j`` is written:

- forward launch ``m`` (``m = 0 .. N-1``): a program per chunk ``n >= m`` adds the block ``(n, m - 1)`` to
  chunk ``n``'s online-softmax accumulators (running max, sum, weighted sum of ``U``); the program of
  chunk ``m`` then finishes its read ``a_m`` and runs the chunk's update (:func:`.update_tiles`). A launch's
  critical path is one block and one update, and the ``N - m`` programs run side by side;
- backward launch ``m`` (``m = N-1 .. 0``): a program per chunk ``j <= m`` takes the block ``(m + 1, j)``
  of the softmax backward (``dU_j``, ``dk_j`` as a key, chunk ``m + 1``'s ``dk`` as a query), and the
  program of chunk ``m``, whose ``dU`` is then complete, runs the update's backward
  (:func:`.update_backward_tiles`) for ``da_m``, which the next launch reads. Gradients of a chunk's rows
  as keys are added by the one program that owns them; those of its rows as queries come from every
  program of a launch, by atomic adds (their order, and so the last bits, vary from run to run). Each
  block computes its scores in both orientations from loads rather than transposing a product, which
  Triton 3.4-3.7.0 miscompiles on Hopper when it feeds another product.

That is the scheme with groups of one. With groups of ``G`` (``_GROUP``) a launch touches only every
``G``-th chunk (from ``m`` up in the forward, down in the backward), and a touched chunk takes all ``G``
blocks that became ready since its last touch: the accumulators and key gradients go through memory
``G`` times less often, for ``G`` blocks on a launch's critical path.

The reads are in the reads' dtype (bf16 under autocast, as the SDPA reads were: ``a`` and ``da`` are
rounded to it), with float32 sums; the updates are those of :mod:`.deep_attention_triton`.
Tensors are ``(B * H, T, width)`` contiguous, ``e`` ``(B * H, T)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .deep_attention_triton import update_backward_tiles, update_tiles

__all__ = ["key_pass_backward_triton", "key_pass_forward_triton"]

_WARPS = 4
# No software pipelining: the loops run at most G blocks, and with Triton's default three stages the
# backward's double-buffered tiles took 330 KB of shared memory for float32 reads at C = 64, width 64
# (an H100 has 227 KB; compiled for sm_90 with Triton 3.6), 98 KB with one stage.
_STAGES = 1
# Each launch touches every G-th chunk, which takes the G blocks that became ready since it was last touched:
# G times fewer round trips of the softmax accumulators (forward) and of the key gradients (backward)
# through memory, for G blocks on each launch's critical path. Not yet swept on a GPU.
_GROUP = 4


@triton.jit
def _rows(X, bh, rows, cols, T, W):
    """``X[bh, rows, cols]`` of a ``(BH, T, W)`` tensor as float32, zero outside it."""
    return tl.load(X + bh * T * W + rows[:, None] * W + cols[None, :], mask=(rows[:, None] < T) & (cols[None, :] < W),
                   other=0.0).to(tl.float32)


@triton.jit
def _rows_t(X, bh, rows, cols, T, W):
    """The transpose of :func:`_rows`, loaded transposed."""
    return tl.load(X + bh * T * W + rows[None, :] * W + cols[:, None], mask=(rows[None, :] < T) & (cols[:, None] < W),
                   other=0.0).to(tl.float32)


@triton.jit
def _chunk(n, C: tl.constexpr, T, bh):
    """Chunk ``n``'s rows, which of them are in the sequence, and their offsets in ``(BH, T)`` tensors."""
    rows = n * C + tl.arange(0, C)
    return rows, rows < T, bh * T + rows


@triton.jit
def _mm(x, y, RD: tl.constexpr, PRECISION: tl.constexpr):
    """``x @ y`` with operands in the reads' dtype, float32 sums."""
    return tl.dot(x.to(RD), y.to(RD), input_precision=PRECISION)


@triton.jit
def _put(X, bh, rows, cols, T, W, x):
    tl.store(X + bh * T * W + rows[:, None] * W + cols[None, :], x.to(X.dtype.element_ty),
             mask=(rows[:, None] < T) & (cols[None, :] < W))


@triton.jit
def _add(X, bh, rows, cols, T, W, x):
    """``X[bh, rows, cols] += x``; the caller is the only program writing these rows."""
    _put(X, bh, rows, cols, T, W, _rows(X, bh, rows, cols, T, W) + x)


@triton.jit
def _forward_step(K, UR, V, E, W1S, U, SIG, ER, A, LSE, MX, SUM, ACC, m, G, T, BH, DK, DV, HID, scale, clip,
                  CLIP: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BHID: tl.constexpr,
                  PRECISION: tl.constexpr, WRITE_READ: tl.constexpr):
    """``WRITE_READ``: ``UR`` is a copy of ``U`` in the reads' dtype (otherwise it is ``U`` itself)."""
    n = m + G * tl.program_id(0)  # the chunks this launch touches: every G-th from m
    bh = tl.program_id(1).to(tl.int64)
    RD = K.dtype.element_ty
    rc, rk, rv, rh = tl.arange(0, C), tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BHID)
    rows, live, stats = _chunk(n, C, T, bh)
    mx = tl.load(MX + stats, mask=live, other=float("-inf"))
    total = tl.load(SUM + stats, mask=live, other=0.0)
    acc = _rows(ACC, bh, rows, rh, T, HID)
    q = _rows(K, bh, rows, rk, T, DK)
    for j in range(tl.maximum(m - G, 0), m):  # the blocks written since this chunk was last touched
        keys = j * C + rc
        s = _mm(q, _rows_t(K, bh, keys, rk, T, DK), RD, PRECISION) * scale
        new = tl.maximum(mx, tl.max(s, 1))
        p = tl.exp(s - new[:, None])
        fade = tl.exp(mx - new)
        total = total * fade + tl.sum(p, 1)
        acc = acc * fade[:, None] + _mm(p, _rows(UR, bh, keys, rh, T, HID), RD, PRECISION)
        mx = new
    if n == m:  # the chunk's read is complete: its write
        if m > 0:
            a = (acc / total[:, None]).to(RD).to(tl.float32)
            tl.store(LSE + stats, mx + tl.log(total), mask=live)
        else:  # no earlier key: the read is 0
            a = tl.zeros((C, BHID), tl.float32)
        _put(A, bh, rows, rh, T, HID, a)
        v = _rows(V, bh, rows, rv, T, DV)
        e = tl.load(E + stats, mask=live, other=0.0).to(tl.float32)
        wb = W1S + (m * BH + bh) * DV * HID
        w = tl.load(wb + rv[:, None] * HID + rh[None, :], mask=(rv[:, None] < DV) & (rh[None, :] < HID), other=0.0)
        u, sig, er, w_next = update_tiles(a, v, w, e, clip, CLIP)
        _put(U, bh, rows, rh, T, HID, u)
        if WRITE_READ:
            _put(UR, bh, rows, rh, T, HID, u)
        _put(SIG, bh, rows, rh, T, HID, sig)
        _put(ER, bh, rows, rv, T, DV, er)
        tl.store(wb + BH * DV * HID + rv[:, None] * HID + rh[None, :], w_next,
                 mask=(rv[:, None] < DV) & (rh[None, :] < HID))
    else:
        tl.store(MX + stats, mx, mask=live)
        tl.store(SUM + stats, total, mask=live)
        _put(ACC, bh, rows, rh, T, HID, acc)


@triton.jit
def _backward_step(K, UR, V, E, W1S, A, LSE, DA, DD, DKEYS, DU, DSIG, DER, DW1S, DWC, DV_OUT, DE, m, G, N, T, BH, DK,
                   DV, HID, scale, clip, CLIP: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   BHID: tl.constexpr, PRECISION: tl.constexpr):
    j = m - G * tl.program_id(0)  # the chunks this launch touches: every G-th down from m
    bh = tl.program_id(1).to(tl.int64)
    RD = K.dtype.element_ty
    rk, rv, rh = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BHID)
    keys, in_keys, key_stats = _chunk(j, C, T, bh)
    du = _rows(DU, bh, keys, rh, T, HID)
    k = _rows(K, bh, keys, rk, T, DK)
    dk = tl.zeros((C, BK), tl.float32)
    for n in range(m + 1, tl.minimum(m + G, N - 1) + 1):  # the blocks (n, j) whose da the last G launches wrote
        # Both orientations are computed from loads (s^T for the key side, s for the query side): a
        # transposed product fed to another product is what Triton 3.4-3.7.0 miscompiles on Hopper.
        rows, live, stats = _chunk(n, C, T, bh)
        lse = tl.load(LSE + stats, mask=live, other=float("inf"))
        dd = tl.load(DD + stats, mask=live, other=0.0)
        q = _rows(K, bh, rows, rk, T, DK)
        da = _rows(DA, bh, rows, rh, T, HID)
        p_t = tl.exp(_mm(k, _rows_t(K, bh, rows, rk, T, DK), RD, PRECISION) * scale - lse[None, :])
        dp_t = _mm(_rows(UR, bh, keys, rh, T, HID), _rows_t(DA, bh, rows, rh, T, HID), RD, PRECISION)
        du += _mm(p_t, da, RD, PRECISION)
        dk += _mm(p_t * (dp_t - dd[None, :]) * scale, q, RD, PRECISION)
        p = tl.exp(_mm(q, _rows_t(K, bh, keys, rk, T, DK), RD, PRECISION) * scale - lse[:, None])
        dp = _mm(da, _rows_t(UR, bh, keys, rh, T, HID), RD, PRECISION)
        tl.atomic_add(DKEYS + bh * T * DK + rows[:, None] * DK + rk[None, :],
                      _mm(p * (dp - dd[:, None]) * scale, k, RD, PRECISION), mask=live[:, None] & (rk[None, :] < DK))
    _add(DKEYS, bh, keys, rk, T, DK, dk)
    if j == m:  # every later read of this chunk's U is in: its write's backward
        a = _rows(A, bh, keys, rh, T, HID)
        v = _rows(V, bh, keys, rv, T, DV)
        e = tl.load(E + key_stats, mask=in_keys, other=0.0).to(tl.float32)
        square = rv[:, None] * HID + rh[None, :]
        in_square = (rv[:, None] < DV) & (rh[None, :] < HID)
        w = tl.load(W1S + (m * BH + bh) * DV * HID + square, mask=in_square, other=0.0)
        dwn = tl.load(DWC + bh * DV * HID + square, mask=in_square, other=0.0)
        da, dv, dw, de = update_backward_tiles(a, v, w, e, du, _rows(DSIG, bh, keys, rh, T, HID),
                                               _rows(DER, bh, keys, rv, T, DV), dwn, clip, CLIP)
        da = da.to(RD).to(tl.float32)
        _put(DA, bh, keys, rh, T, HID, da)
        tl.store(DD + key_stats, tl.sum(da * a, 1), mask=in_keys)
        _put(DV_OUT, bh, keys, rv, T, DV, dv)
        tl.store(DE + key_stats, de, mask=in_keys)
        dw += tl.load(DW1S + (m * BH + bh) * DV * HID + square, mask=in_square, other=0.0)
        tl.store(DWC + bh * DV * HID + square, dw, mask=in_square)
    else:
        _put(DU, bh, keys, rh, T, HID, du)


def _precision(reads: torch.dtype) -> str:
    """The reads' products: their dtype's for bf16 / fp16; for float32 reads 3xTF32 (float32's accuracy, as
    the updates use), not Triton's default TF32."""
    return "tf32x3" if reads == torch.float32 else "ieee"


def _blocks(DK: int, DV: int, HID: int) -> dict:
    p = lambda n: max(16, triton.next_power_of_2(n))  # noqa: E731  (tl.dot needs 16 or more)
    return dict(BK=p(DK), BV=p(DV), BHID=p(HID))


def key_pass_forward_triton(keys: torch.Tensor, v: torch.Tensor, e: torch.Tensor, w1: torch.Tensor, chunk: int,
                            scale: float, clip: float | None):
    """The pass's forward on ``keys (BH, T, d_k)`` in the reads' dtype, ``v (BH, T, d_v)``, ``e (BH, T)``,
    ``w1 (BH, d_v, h)`` (float32, contiguous). Returns ``u, sig (BH, T, h)``, ``er (BH, T, d_v)``,
    ``w1s (N + 1, BH, d_v, h)`` and, for the backward, ``u_read`` (``u`` in the reads' dtype), the reads
    ``a`` (reads' dtype) and their log-sum-exps ``(BH, T)``."""
    BH, T, DK = keys.shape
    DV, HID = w1.shape[-2:]
    N = -(-T // chunk)
    f32 = dict(device=v.device, dtype=torch.float32)
    u, sig = torch.empty(BH, T, HID, **f32), torch.empty(BH, T, HID, **f32)
    er = torch.empty(BH, T, DV, **f32)
    w1s = torch.empty(N + 1, BH, DV, HID, **f32)
    w1s[0] = w1
    u_read = u if keys.dtype == u.dtype else torch.empty_like(u, dtype=keys.dtype)
    a = torch.empty_like(sig, dtype=keys.dtype)
    lse = torch.zeros(BH, T, **f32)
    mx, total = torch.full((BH, T), float("-inf"), **f32), torch.zeros(BH, T, **f32)
    acc = torch.zeros(BH, T, HID, **f32)
    G = _GROUP
    for m in range(N):
        _forward_step[((N - 1 - m) // G + 1, BH)](
            keys, u_read, v, e, w1s, u, sig, er, a, lse, mx, total, acc, m, G, T, BH, DK, DV, HID, scale,
            0.0 if clip is None else float(clip), CLIP=clip is not None, C=chunk, PRECISION=_precision(keys.dtype),
            WRITE_READ=u_read is not u, num_warps=_WARPS, num_stages=_STAGES, **_blocks(DK, DV, HID))
    return u, sig, er, w1s, u_read, a, lse


def key_pass_backward_triton(keys: torch.Tensor, v: torch.Tensor, e: torch.Tensor, w1s: torch.Tensor,
                             u_read: torch.Tensor, a: torch.Tensor, lse: torch.Tensor, du: torch.Tensor,
                             dsig: torch.Tensor, der: torch.Tensor, dw1s: torch.Tensor, chunk: int, scale: float,
                             clip: float | None):
    """The gradients ``(dk, dv, de, dw1)`` (float32) of the pass for its outputs' ``du, dsig, der, dw1s``."""
    BH, T, DK = keys.shape
    DV, HID = w1s.shape[-2:]
    N = -(-T // chunk)
    f32 = dict(device=v.device, dtype=torch.float32)
    dk = torch.zeros(BH, T, DK, **f32)
    du = du.to(torch.float32, memory_format=torch.contiguous_format, copy=True)  # accumulated in place
    dsig, der, dw1s = (x.to(torch.float32).contiguous() for x in (dsig, der, dw1s))
    da, dd = torch.empty_like(a), torch.zeros(BH, T, **f32)
    carry = dw1s[N].clone()
    dv, de = torch.empty(BH, T, DV, **f32), torch.empty(BH, T, **f32)
    G = _GROUP
    for m in reversed(range(N)):
        _backward_step[(m // G + 1, BH)](
            keys, u_read, v, e, w1s, a, lse, da, dd, dk, du, dsig, der, dw1s, carry, dv, de, m, G, N, T, BH, DK, DV,
            HID, scale, 0.0 if clip is None else float(clip), CLIP=clip is not None, C=chunk,
            PRECISION=_precision(keys.dtype), num_warps=_WARPS, num_stages=_STAGES, **_blocks(DK, DV, HID))
    return dk, dv, de, carry
