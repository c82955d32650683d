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
- backward launch ``m`` (``m = N-1 .. 0``): a program per chunk ``j <= m`` takes the key side of the block
  ``(m + 1, j)`` of the softmax backward (``dU_j`` and ``dk_j`` as a key), and the program of chunk ``m``,
  whose ``dU`` is then complete, runs the update's backward (:func:`.update_backward_tiles`) for ``da_m``,
  which the next launch reads. The query side of the blocks (``dk_n`` as a query) depends on nothing
  that the wavefront still computes, so one launch after it takes every block at once, a program per
  query chunk: each gradient has one writer, no atomics, and runs repeat bit for bit. Each block
  computes its scores in both orientations from loads rather than transposing a product, which Triton
  3.4-3.7.0 miscompiles on Hopper when it feeds another product.

That is the scheme with groups of one. With groups of ``G`` (``_GROUP``) a launch touches, besides
its own chunk ``m``, only every ``G``-th chunk (from ``m + 1`` up in the forward, from ``m - 1`` down in
the backward), and a touched chunk takes all ``G`` blocks that became ready since its last touch: the
accumulators and key gradients go through memory ``G`` times less often. Every chunk is also touched by
the launch just before its own, so on its own launch, the critical path, it takes one block only.

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
# through memory, for G blocks on each launch's critical path. Swept on an H100 (bf16 reads, C = 64, width 64,
# 16 heads, 16K tokens): G = 4 with 4 warps was the fastest or within 2% of it at T = 2048 and 8192 (G = 1:
# 18-19% slower; 8 warps: 16-21% slower).
_GROUP = 4


def _query_stages(reads: torch.dtype) -> int:
    """The query-gradient launch loops over up to N - 1 blocks per program, where pipelining pays: two
    stages for 16-bit reads (24 KB of shared memory at C = 64, width 64), one for float32 reads, whose
    3xTF32 products would take 295 KB at C = 128, width 64 with two."""
    return 2 if reads.itemsize == 2 else 1


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
    pid = tl.program_id(0)
    # Program 0 takes chunk m, whose read lacks only block m - 1 (it was touched by the last launch); the
    # others take every G-th chunk from m + 1, with the G blocks written since their last touch.
    n = tl.where(pid == 0, m, m + 1 + G * (pid - 1))
    span = tl.where(pid == 0, 1, G)
    bh = tl.program_id(1).to(tl.int64)
    RD = K.dtype.element_ty
    rc, rk, rv, rh = tl.arange(0, C), tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BHID)
    rows, live, stats = _chunk(n, C, T, bh)
    mx = tl.load(MX + stats, mask=live, other=float("-inf"))
    total = tl.load(SUM + stats, mask=live, other=0.0)
    acc = _rows(ACC, bh, rows, rh, T, HID)
    q = _rows(K, bh, rows, rk, T, DK)
    for j in range(tl.maximum(m - span, 0), m):
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
    """The key side of the blocks ``(n, j)`` for ``n`` in ``m + 1 .. m + G``, then chunk ``m``'s update backward."""
    pid = tl.program_id(0)
    # Program 0 takes chunk m, whose dU lacks only block (m + 1, m) (it was touched by the last launch);
    # the others take every G-th chunk down from m - 1, with the G blocks whose da was written since their
    # last touch.
    j = tl.where(pid == 0, m, m - 1 - G * (pid - 1))
    span = tl.where(pid == 0, 1, G)
    bh = tl.program_id(1).to(tl.int64)
    RD = K.dtype.element_ty
    rk, rv, rh = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BHID)
    keys, in_keys, key_stats = _chunk(j, C, T, bh)
    du = _rows(DU, bh, keys, rh, T, HID)
    k = _rows(K, bh, keys, rk, T, DK)
    u = _rows(UR, bh, keys, rh, T, HID)
    dk = tl.zeros((C, BK), tl.float32)
    for n in range(m + 1, tl.minimum(m + span, N - 1) + 1):
        # The scores come transposed from transposed loads, not by transposing a product: a transposed
        # product fed to another product is what Triton 3.4-3.7.0 miscompiles on Hopper.
        rows, live, stats = _chunk(n, C, T, bh)
        lse = tl.load(LSE + stats, mask=live, other=float("inf"))
        dd = tl.load(DD + stats, mask=live, other=0.0)
        p_t = tl.exp(_mm(k, _rows_t(K, bh, rows, rk, T, DK), RD, PRECISION) * scale - lse[None, :])
        dp_t = _mm(u, _rows_t(DA, bh, rows, rh, T, HID), RD, PRECISION)
        du += _mm(p_t, _rows(DA, bh, rows, rh, T, HID), RD, PRECISION)
        dk += _mm(p_t * (dp_t - dd[None, :]) * scale, _rows(K, bh, rows, rk, T, DK), RD, PRECISION)
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


@triton.jit
def _query_gradients(K, UR, LSE, DA, DD, DKEYS, N, T, DK, HID, scale, C: tl.constexpr, BK: tl.constexpr,
                     BHID: tl.constexpr, PRECISION: tl.constexpr):
    """Chunk ``n``'s gradient as the reads' queries, added to ``DKEYS``: every ``da`` is known by now, so
    the blocks ``(n, j < n)`` run side by side, the longest rows first, each row by one program."""
    n = N - 1 - tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    RD = K.dtype.element_ty
    rk, rh = tl.arange(0, BK), tl.arange(0, BHID)
    rows, live, stats = _chunk(n, C, T, bh)
    lse = tl.load(LSE + stats, mask=live, other=float("inf"))
    dd = tl.load(DD + stats, mask=live, other=0.0)
    q = _rows(K, bh, rows, rk, T, DK)
    da = _rows(DA, bh, rows, rh, T, HID)
    dq = tl.zeros((C, BK), tl.float32)
    for j in range(0, n):
        keys = j * C + tl.arange(0, C)
        p = tl.exp(_mm(q, _rows_t(K, bh, keys, rk, T, DK), RD, PRECISION) * scale - lse[:, None])
        dp = _mm(da, _rows_t(UR, bh, keys, rh, T, HID), RD, PRECISION)
        dq += _mm(p * (dp - dd[:, None]) * scale, _rows(K, bh, keys, rk, T, DK), RD, PRECISION)
    _add(DKEYS, bh, rows, rk, T, DK, dq)


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
        _forward_step[(1 + (N - 2 - m) // G + 1, BH)](
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
        _backward_step[(1 + (m - 1) // G + 1, BH)](
            keys, u_read, v, e, w1s, a, lse, da, dd, dk, du, dsig, der, dw1s, carry, dv, de, m, G, N, T, BH, DK, DV,
            HID, scale, 0.0 if clip is None else float(clip), CLIP=clip is not None, C=chunk,
            PRECISION=_precision(keys.dtype), num_warps=_WARPS, num_stages=_STAGES, **_blocks(DK, DV, HID))
    if N > 1:  # chunk 0 reads nothing
        blocks = _blocks(DK, DV, HID)
        _query_gradients[(N - 1, BH)](keys, u_read, lse, da, dd, dk, N, T, DK, HID, scale, C=chunk,
                                      BK=blocks["BK"], BHID=blocks["BHID"], PRECISION=_precision(keys.dtype),
                                      num_warps=_WARPS, num_stages=_query_stages(keys.dtype))
    return dk, dv, de, carry
