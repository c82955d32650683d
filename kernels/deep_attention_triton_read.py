"""Triton kernels for the reads of the DeepTransformer's chunk loop (:mod:`.deep_attention`).

Outside the Hebbian rule's training case, the chunk loop walks the sequence a chunk at a time, and every
chunk reads every earlier pair twice: its window tokens' keys read the memory as it stood at the chunk
start (the omega rule's predictions, the deep branch's ``A^(s)``), and its queries read it causally.
The values of those reads change from chunk to chunk (the omega targets ``R`` and the deep values ``U``
take each chunk's writes), so no single attention call covers the sequence; and written in PyTorch each
read materialises its weights over every earlier key. Here a read is flash-style: one program per block
of queries walks the keys with its running maximum and sum on chip, and writes the outputs and the
log-sum-exp, nothing of size queries x keys.

A read is, per ``(batch, head)`` and query ``i``, over the keys ``j`` with
``key_start[b] <= j < key_end[b, i]`` (the rows' valid spans are contiguous, and causality or the chunk
start bounds them above):

- ``normalize``: ``o_i = sum_j p_ij v_j``, ``p_ij = exp(s_ij - lse_i)``, ``s_ij = scale q_i.k_j``,
  ``lse_i = log sum_j exp(s_ij)``;
- otherwise the raw kernel ``o_i = sum_j exp(s_ij) v_j`` (``lse`` is 0);

with one or two value tensors read by the same weights (the omega targets and the deep values), and 0
where a query sees no key (``lse`` 0 there too). The caller forms the few weights it needs one by one
(the chunk's window keys) from ``lse``, so ``lse`` takes a gradient: with ``D_i = sum_x do_i.o_i -
dlse_i``, ``ds_ij = p_ij (do_i.v_j - D_i)`` (``p_ij do_i.v_j`` for the raw kernel), ``dq = scale ds k``,
``dk = scale ds^T q`` and ``dv = p^T do``. The queries are scaled in PyTorch before the kernels (a Python
float reaches a kernel as float32, which would round a float64 read's scale; autograd carries the scale
into ``dq``). The backward is two kernels, one over blocks of queries for
``dq`` and one over blocks of keys for ``dk, dv``, each recomputing ``p``; every transposed operand is
loaded transposed, so that no product's result is transposed into another product (which Triton
3.4-3.7.0 miscompiles on Hopper; docs/kernels.md). Every output has one writer: runs repeat bit for bit.

Tensors ``(B, H, rows, width)`` with unit stride in ``width`` (the loop's views of its buffers), float32
or float64; products as exact as PyTorch's beside them (:func:`_precision`); any widths, in masked tiles of
16 to 256.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .backend import tl, triton
from .mixed_products_triton import _tile

__all__ = ["masked_read"]

WIDEST = 256  # the widest tiles (queries, keys, values): wider ones need more shared memory than an SM has


def _width(x: torch.Tensor | None) -> int:
    return 16 if x is None else _tile(x.shape[-1])


def _blocks(*widths: int) -> dict[str, int]:
    """Queries and keys a block, warps and pipeline stages for tiles of these widths: a chunk of 64 queries in
    two blocks, so that few rows still spread over the SMs; tiles wider than 128 in smaller blocks and one
    stage, so that a block's tiles fit in the shared memory."""
    if max(widths) <= 128:
        return dict(BQ=32, BK=64, num_warps=4, num_stages=2)
    return dict(BQ=16, BK=32, num_warps=4, num_stages=1)


@triton.jit
def _rows(X, b, h, sb, sh, st, rows, cols, n_rows, width):
    """``X[b, h, rows, cols]`` as a ``(rows, cols)`` tile, zero outside the tensor."""
    return tl.load(X + b * sb + h * sh + rows[:, None] * st + cols[None, :],
                   mask=(rows[:, None] < n_rows) & (cols[None, :] < width), other=0.0)


@triton.jit
def _cols(X, b, h, sb, sh, st, rows, cols, n_rows, width):
    """``X[b, h, rows, cols]`` transposed: a ``(cols, rows)`` tile, zero outside the tensor."""
    return tl.load(X + b * sb + h * sh + rows[None, :] * st + cols[:, None],
                   mask=(rows[None, :] < n_rows) & (cols[:, None] < width), other=0.0)


@triton.jit
def _query_block(Q, KSTART, KEND, sqb, sqh, sqt, H, NQ, DK, BQ: tl.constexpr, BDK: tl.constexpr):
    """This program's batch x head, batch and head, its block of queries (rows, which are real, the tile), and
    the span of keys they see (its start for the batch row, its end for each query; 0 for rows past ``NQ``)."""
    bh = tl.program_id(1).to(tl.int64)  # offsets past 2**31 elements at long contexts and wide values
    b, h = bh // H, bh % H
    rq = tl.program_id(0) * BQ + tl.arange(0, BQ)
    live = rq < NQ
    q = _rows(Q, b, h, sqb, sqh, sqt, rq, tl.arange(0, BDK), NQ, DK)
    return bh, b, h, rq, live, q, tl.load(KSTART + b), tl.load(KEND + b * NQ + rq, mask=live, other=0)


@triton.jit
def _read_forward(Q, K, V1, V2, O1, O2, LSE, KSTART, KEND,
                  sqb, sqh, sqt, skb, skh, skt, s1b, s1h, s1t, s2b, s2h, s2t, sob, soh, sot, spb, sph, spt,
                  H, NQ, DK, D1, D2,
                  BQ: tl.constexpr, BK: tl.constexpr, BDK: tl.constexpr, BD1: tl.constexpr, BD2: tl.constexpr,
                  TWO: tl.constexpr, NORMALIZE: tl.constexpr, PRECISION: tl.constexpr):
    bh, b, h, rq, live, q, start, end = _query_block(Q, KSTART, KEND, sqb, sqh, sqt, H, NQ, DK, BQ, BDK)
    cdk, c1, c2 = tl.arange(0, BDK), tl.arange(0, BD1), tl.arange(0, BD2)
    hi = tl.max(end, 0)
    m = tl.full((BQ,), float("-inf"), dtype=q.dtype)
    den = tl.zeros((BQ,), dtype=q.dtype)
    acc1 = tl.zeros((BQ, BD1), dtype=q.dtype)
    acc2 = tl.zeros((BQ, BD2), dtype=q.dtype)
    for j0 in range((start // BK) * BK, hi, BK):
        rk = j0 + tl.arange(0, BK)
        kt = _cols(K, b, h, skb, skh, skt, rk, cdk, hi, DK)
        s = tl.dot(q, kt, input_precision=PRECISION)
        allowed = (rk[None, :] >= start) & (rk[None, :] < end[:, None])
        if NORMALIZE:
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            # A row that has seen no key yet keeps its maximum at -inf: shift by 0 there, not by -inf.
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - shift[:, None])
            alpha = tl.exp(m - shift)
            den = den * alpha + tl.sum(p, 1)
            acc1 = acc1 * alpha[:, None]
            if TWO:
                acc2 = acc2 * alpha[:, None]
            m = m_new
        else:
            p = tl.where(allowed, tl.exp(s), 0.0)
        p = p.to(q.dtype)
        acc1 += tl.dot(p, _rows(V1, b, h, s1b, s1h, s1t, rk, c1, hi, D1), input_precision=PRECISION)
        if TWO:
            acc2 += tl.dot(p, _rows(V2, b, h, s2b, s2h, s2t, rk, c2, hi, D2), input_precision=PRECISION)
    lse = tl.zeros((BQ,), dtype=q.dtype)
    if NORMALIZE:
        seen = den > 0
        inv = tl.where(seen, 1.0 / tl.where(seen, den, 1.0), 0.0)
        acc1 = acc1 * inv[:, None]
        acc2 = acc2 * inv[:, None]
        lse = tl.where(seen, m + tl.log(tl.where(seen, den, 1.0)), 0.0)
    o = O1 + b * sob + h * soh + rq[:, None] * sot + c1[None, :]
    tl.store(o, acc1, mask=live[:, None] & (c1[None, :] < D1))
    if TWO:
        o = O2 + b * spb + h * sph + rq[:, None] * spt + c2[None, :]
        tl.store(o, acc2, mask=live[:, None] & (c2[None, :] < D2))
    tl.store(LSE + bh * NQ + rq, lse, mask=live)


@triton.jit
def _weights(s, rk, start, end, lse, NORMALIZE: tl.constexpr):
    """The read's weights from its scaled scores ``s``, for keys ``rk`` along the columns."""
    allowed = (rk[None, :] >= start) & (rk[None, :] < end[:, None])
    if NORMALIZE:
        return tl.where(allowed, tl.exp(s - lse[:, None]), 0.0)
    return tl.where(allowed, tl.exp(s), 0.0)


@triton.jit
def _read_backward_queries(Q, K, V1, V2, DO1, DO2, LSE, DELTA, KSTART, KEND, DQ,
                           sqb, sqh, sqt, skb, skh, skt, s1b, s1h, s1t, s2b, s2h, s2t,
                           H, NQ, DK, D1, D2,
                           BQ: tl.constexpr, BK: tl.constexpr, BDK: tl.constexpr, BD1: tl.constexpr,
                           BD2: tl.constexpr, TWO: tl.constexpr, NORMALIZE: tl.constexpr, PRECISION: tl.constexpr):
    """``dq`` of a block of queries (``DO1, DO2, DQ`` contiguous ``(B * H, NQ, width)``)."""
    bh, b, h, rq, live, q, start, end = _query_block(Q, KSTART, KEND, sqb, sqh, sqt, H, NQ, DK, BQ, BDK)
    cdk, c1, c2 = tl.arange(0, BDK), tl.arange(0, BD1), tl.arange(0, BD2)
    do1 = _rows(DO1, bh, 0, NQ * D1, 0, D1, rq, c1, NQ, D1)
    do2 = _rows(DO2, bh, 0, NQ * D2, 0, D2, rq, c2, NQ, D2) if TWO else do1
    lse = tl.load(LSE + bh * NQ + rq, mask=live, other=0.0)
    delta = tl.load(DELTA + bh * NQ + rq, mask=live, other=0.0)
    hi = tl.max(end, 0)
    dq = tl.zeros((BQ, BDK), dtype=q.dtype)
    for j0 in range((start // BK) * BK, hi, BK):
        rk = j0 + tl.arange(0, BK)
        s = tl.dot(q, _cols(K, b, h, skb, skh, skt, rk, cdk, hi, DK), input_precision=PRECISION)
        p = _weights(s, rk, start, end, lse, NORMALIZE)
        dp = tl.dot(do1, _cols(V1, b, h, s1b, s1h, s1t, rk, c1, hi, D1), input_precision=PRECISION)
        if TWO:
            dp += tl.dot(do2, _cols(V2, b, h, s2b, s2h, s2t, rk, c2, hi, D2), input_precision=PRECISION)
        ds = (p * (dp - delta[:, None])).to(q.dtype)
        dq += tl.dot(ds, _rows(K, b, h, skb, skh, skt, rk, cdk, hi, DK), input_precision=PRECISION)
    tl.store(DQ + (bh * NQ + rq[:, None]) * DK + cdk[None, :], dq, mask=live[:, None] & (cdk[None, :] < DK))


@triton.jit
def _read_backward_keys(Q, K, V1, V2, DO1, DO2, LSE, DELTA, KSTART, KEND, DK_, DV1, DV2,
                        sqb, sqh, sqt, skb, skh, skt, s1b, s1h, s1t, s2b, s2h, s2t,
                        H, NQ, NK, DK, D1, D2,
                        BQ: tl.constexpr, BK: tl.constexpr, BDK: tl.constexpr, BD1: tl.constexpr,
                        BD2: tl.constexpr, TWO: tl.constexpr, NORMALIZE: tl.constexpr, PRECISION: tl.constexpr):
    """``dk, dv`` of a block of keys (``DK_, DV1, DV2`` contiguous ``(B * H, NK, width)``): the products
    run with the keys along the rows (``s^T = k q^T``), so no result is transposed."""
    bh = tl.program_id(1).to(tl.int64)  # offsets past 2**31 elements at long contexts and wide values
    b, h = bh // H, bh % H
    rk = tl.program_id(0) * BK + tl.arange(0, BK)
    cdk, c1, c2 = tl.arange(0, BDK), tl.arange(0, BD1), tl.arange(0, BD2)
    k = _rows(K, b, h, skb, skh, skt, rk, cdk, NK, DK)
    v1 = _rows(V1, b, h, s1b, s1h, s1t, rk, c1, NK, D1)
    v2 = _rows(V2, b, h, s2b, s2h, s2t, rk, c2, NK, D2) if TWO else v1
    start = tl.load(KSTART + b)
    dk = tl.zeros((BK, BDK), dtype=k.dtype)
    dv1 = tl.zeros((BK, BD1), dtype=k.dtype)
    dv2 = tl.zeros((BK, BD2), dtype=k.dtype)
    for i0 in range(0, NQ, BQ):
        rq = i0 + tl.arange(0, BQ)
        live = rq < NQ
        end = tl.load(KEND + b * NQ + rq, mask=live, other=0)
        lse = tl.load(LSE + bh * NQ + rq, mask=live, other=0.0)
        delta = tl.load(DELTA + bh * NQ + rq, mask=live, other=0.0)
        st = tl.dot(k, _cols(Q, b, h, sqb, sqh, sqt, rq, cdk, NQ, DK), input_precision=PRECISION)
        allowed = (rk[:, None] >= start) & (rk[:, None] < end[None, :])
        if NORMALIZE:
            pt = tl.where(allowed, tl.exp(st - lse[None, :]), 0.0)
        else:
            pt = tl.where(allowed, tl.exp(st), 0.0)
        do1 = _rows(DO1, bh, 0, NQ * D1, 0, D1, rq, c1, NQ, D1)
        dv1 += tl.dot(pt.to(k.dtype), do1, input_precision=PRECISION)
        dpt = tl.dot(v1, _cols(DO1, bh, 0, NQ * D1, 0, D1, rq, c1, NQ, D1), input_precision=PRECISION)
        if TWO:
            dv2 += tl.dot(pt.to(k.dtype), _rows(DO2, bh, 0, NQ * D2, 0, D2, rq, c2, NQ, D2), input_precision=PRECISION)
            dpt += tl.dot(v2, _cols(DO2, bh, 0, NQ * D2, 0, D2, rq, c2, NQ, D2), input_precision=PRECISION)
        dst = (pt * (dpt - delta[None, :])).to(k.dtype)
        dk += tl.dot(dst, _rows(Q, b, h, sqb, sqh, sqt, rq, cdk, NQ, DK), input_precision=PRECISION)
    live_k = rk[:, None] < NK
    tl.store(DK_ + (bh * NK + rk[:, None]) * DK + cdk[None, :], dk, mask=live_k & (cdk[None, :] < DK))
    tl.store(DV1 + (bh * NK + rk[:, None]) * D1 + c1[None, :], dv1, mask=live_k & (c1[None, :] < D1))
    if TWO:
        tl.store(DV2 + (bh * NK + rk[:, None]) * D2 + c2[None, :], dv2, mask=live_k & (c2[None, :] < D2))


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _strides(x: torch.Tensor | None) -> tuple[int, int, int]:
    return (0, 0, 0) if x is None else x.stride()[:3]


def _precision(x: torch.Tensor) -> str:
    # As exact as the PyTorch reads beside them: float32's own products where PyTorch's float32 products are
    # (``"highest"``, its default), 3xTF32 where it allows TF32 (never plain TF32: the omega rule feeds
    # each chunk's reads into the next chunk's targets, and the loop amplifies their error).
    if x.dtype == torch.float64 or torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32x3"


def _unversioned(x: torch.Tensor) -> torch.Tensor:
    """``x``'s elements in a tensor with a version counter of its own: saved for the backward through
    ``save_for_backward`` (so that saved-tensor hooks, checkpointing among them, see it), without the check that
    would refuse the in-place writes its caller makes to other rows of the same storage."""
    return torch.empty(0, dtype=x.dtype, device=x.device).set_(x.untyped_storage(), x.storage_offset(), x.shape,
                                                               x.stride())


class _MaskedRead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v1, v2, key_start, key_end, normalize: bool, mutable_from: int | None):
        B, H, NQ, DK = q.shape
        D1, D2 = v1.shape[-1], 0 if v2 is None else v2.shape[-1]
        o1 = q.new_empty(B, H, NQ, D1)
        o2 = None if v2 is None else q.new_empty(B, H, NQ, D2)
        lse = q.new_empty(B, H, NQ)
        widths = (_width(q), _width(v1), _width(v2))
        # the tiles and block shapes of every kernel, the backward's too
        blocks = dict(BDK=widths[0], BD1=widths[1], BD2=widths[2], TWO=v2 is not None, NORMALIZE=normalize,
                      PRECISION=_precision(q), **_blocks(*widths))
        grid = (triton.cdiv(NQ, blocks["BQ"]), B * H)
        _read_forward[grid](q, k, v1, v1 if v2 is None else v2, o1, o1 if o2 is None else o2, lse, key_start, key_end,
                            *q.stride()[:3], *k.stride()[:3], *v1.stride()[:3], *_strides(v2), *o1.stride()[:3],
                            *_strides(o2), H, NQ, DK, D1, D2, **blocks)
        if mutable_from is None:
            ctx.save_for_backward(q, k, v1, v2, o1, o2, lse, key_start, key_end)
        else:  # a copy of the rows that may change; the rest by reference, outside autograd's version checks
            tails = [None if x is None else x[:, :, mutable_from:].clone() for x in (v1, v2)]
            heads = [None if x is None else _unversioned(x[:, :, :mutable_from]) for x in (v1, v2)]
            ctx.save_for_backward(q, k, *tails, o1, o2, lse, key_start, key_end, *heads)
        ctx.normalize, ctx.blocks, ctx.mutable_from = normalize, blocks, mutable_from
        if not normalize:
            ctx.mark_non_differentiable(lse)
        return o1, o2, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, do1, do2, dlse):
        q, k, v1, v2, o1, o2, lse, key_start, key_end, *heads = ctx.saved_tensors
        if ctx.mutable_from is not None:  # the values as they were read
            v1, v2 = (None if tail is None else torch.cat([head, tail], 2) for head, tail in zip(heads, (v1, v2)))
        normalize, blocks = ctx.normalize, ctx.blocks
        B, H, NQ, DK = q.shape
        NK, D1 = k.shape[2], v1.shape[-1]
        D2 = 0 if v2 is None else v2.shape[-1]
        two = v2 is not None
        do1 = torch.zeros_like(o1) if do1 is None else do1.contiguous()
        if two:
            do2 = torch.zeros_like(o2) if do2 is None else do2.contiguous()
        delta = torch.zeros_like(lse)
        if normalize:  # D = sum_x do.o - dlse (the raw kernel's weights have no normaliser to differentiate)
            delta = (do1 * o1).sum(-1) + ((do2 * o2).sum(-1) if two else 0.0)
            if dlse is not None:
                delta = delta - dlse
            delta = delta.contiguous()
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        dk = k.new_empty(B, H, NK, DK)
        dv1 = v1.new_empty(B, H, NK, D1)
        dv2 = v2.new_empty(B, H, NK, D2) if two else None
        common = (q, k, v1, v2 if two else v1, do1, do2 if two else do1, lse, delta, key_start, key_end)
        strides = (*q.stride()[:3], *k.stride()[:3], *v1.stride()[:3], *_strides(v2))
        _read_backward_queries[(triton.cdiv(NQ, blocks["BQ"]), B * H)](*common, dq, *strides, H, NQ, DK, D1, D2,
                                                              **blocks)
        _read_backward_keys[(triton.cdiv(NK, blocks["BK"]), B * H)](*common, dk, dv1, dv2 if two else dv1, *strides,
                                                                   H, NQ, NK, DK, D1, D2, **blocks)
        return dq, dk, dv1, dv2, None, None, None, None


def masked_read(q: torch.Tensor, k: torch.Tensor, values: tuple[torch.Tensor, ...], key_start: torch.Tensor,
                key_end: torch.Tensor, scale: float, normalize: bool,
                mutable_from: int | None = None) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Reads of one or two ``values (B, H, NK, d)`` by the queries ``q (B, H, NQ, d_k)`` over the keys
    ``k (B, H, NK, d_k)`` that each query sees, ``key_start[b] <= j < key_end[b, i]`` (``(B,)`` and
    ``(B, NQ)`` integers, clamped to the keys there are); see the module docstring. Returns
    ``(outs, lse)``: a tuple with one ``(B, H, NQ, d)`` read per value tensor, and ``(B, H, NQ)``
    (differentiable for softmax reads; 0 for the raw kernel). Widths up to :data:`WIDEST`.

    ``mutable_from``: the caller may write the values' rows from this one on in place after the call, and
    no earlier row (the chunk loop's buffers, which take each chunk's writes in place). The backward then
    uses a copy of those rows, taken here, and the earlier ones as they stand: autograd's version check,
    which would refuse any in-place write, is left out for the values."""
    if not 1 <= len(values) <= 2:
        raise ValueError(f"masked_read takes one or two value tensors, got {len(values)}")
    widths = [x.shape[-1] for x in (q, *values)]
    if max(widths) > WIDEST:
        raise ValueError(f"masked_read takes widths up to {WIDEST}, got {widths}")
    dtype = q.dtype
    if dtype not in (torch.float32, torch.float64) or any(x.dtype != dtype for x in (k, *values)):
        raise TypeError(f"masked_read takes float32 or float64 tensors of one dtype, got "
                        f"{[str(x.dtype) for x in (q, k, *values)]}")
    q, k, *values = (_unit_stride(x) for x in (q, k, *values))
    v2 = values[1] if len(values) == 2 else None
    NK = k.shape[2]
    key_start = key_start.clamp(0, NK).to(torch.int32).contiguous()
    key_end = key_end.clamp(0, NK).to(torch.int32).contiguous()
    if mutable_from is not None and not 0 <= mutable_from <= NK:
        raise ValueError(f"masked_read's mutable_from must lie in [0, {NK}] (the keys), got {mutable_from}")
    o1, o2, lse = _MaskedRead.apply(q * scale, k, values[0], v2, key_start, key_end, bool(normalize), mutable_from)
    return ((o1,) if v2 is None else (o1, o2)), lse
