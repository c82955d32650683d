"""Triton kernels for one chunk of the Hebbian DeepTransformer's key pass (:mod:`.deep_attention`).

:func:`~.deep_attention.chunk_update` is about thirty small PyTorch kernels (the GELU and
its derivative, the clip's three norms, the scales, the rank-``C`` update of ``W_1``), and the key
pass runs it once per chunk, in sequence: at 128 chunks the launches alone outweighed the
attention reads. Here it is one program per ``(batch, head)`` with the chunk in registers, and
its backward likewise, written out (the chunk is ``C x d_v`` and ``C x h`` tiles; the grid is only
``batch x heads`` programs, so each must be short):

with ``g = v W_1``, ``d = sigma'(a)``, ``s = sigma(a)``, ``n = |g d|^2 + |v|^2 |s|^2`` per pair, the
clip ``c = min(1, clip / sqrt(n))`` and ``f = e c``: ``u = f g d``, ``er = f v``, ``W_1' = W_1 + er^T s``;
so for incoming ``du, ds, der, dW`` (``der`` and ``ds`` first take ``W_1'``'s part: ``der += s dW^T``,
``ds += er dW``), ``df = <du, g d> + <der, v>``, ``de = c df`` and, where the clip acts,
``dn = -df e c / (2 n)``, which adds ``2 dn`` times ``g d``, ``|s|^2 v`` and ``|v|^2 s`` to the
gradients of ``g d``, ``v`` and ``s``.

Tensors are ``(B, H, rows, width)`` views with unit stride in ``width`` (slices of the pass's
buffers: the kernels read and write them in place), ``e`` ``(B, H, rows)``. Their strides travel in
a small device table (:func:`stride_table`), built once per pass: the chunks' views move, their
strides do not, and with every stride passed as an integer Triton's launcher took longer on the
host per launch than the kernel took to run.

Sums are float32 and products 3xTF32 (float32's accuracy). Plain TF32, the memories' policy for
bf16 problems elsewhere, is not enough here: where the clip acts, its gradient removes the
component of ``du`` along ``g d``, and TF32's error in ``g`` left 7% of the bf16 ``W_1`` gradient
(0.2% with 3xTF32, the chunk loop under bf16 autocast 0.4%; T = 1024, clip 0.5).
"""

from __future__ import annotations

import torch

from .backend import tl, triton

__all__ = ["chunk_update_backward_triton", "chunk_update_triton", "stride_table"]

_WARPS = 4
_PRODUCTS = tl.constexpr("tf32x3")  # float32's accuracy, far faster than exact float32 dots (benchmarks/RESULTS.md)


@triton.jit
def _ptrs(X, TAB, i: tl.constexpr, b, h, rows, cols):
    """Pointers to ``X[b, h, rows, cols]``, ``X`` the ``i``-th operand of the stride table ``TAB``."""
    return X + b * tl.load(TAB + 3 * i) + h * tl.load(TAB + 3 * i + 1) + rows[:, None] * tl.load(TAB + 3 * i + 2) \
        + cols[None, :]


@triton.jit
def _tile(X, TAB, i: tl.constexpr, b, h, rows, cols, R, N):
    return tl.load(_ptrs(X, TAB, i, b, h, rows, cols), mask=(rows[:, None] < R) & (cols[None, :] < N),
                   other=0.0).to(tl.float32)


@triton.jit
def _update_parts(a, v, w, e, clip, CLIP: tl.constexpr):
    """What the update and its backward share, from the chunk's ``a (C, h)``, ``v (C, d_v)``, ``w1 (d_v, h)``
    and ``e (C,)`` (float32 tiles, zero outside the chunk): ``g``, ``d``, ``s``, ``g d``, the GELU's density
    and the clip's ``n`` and scale."""
    g = tl.dot(v, w, input_precision=_PRODUCTS)
    cdf = 0.5 * (1.0 + tl.math.erf(a * 0.7071067811865476))
    pdf = tl.exp(-0.5 * a * a) * 0.3989422804014327
    d = cdf + a * pdf
    s = a * cdf
    gd = g * d
    scale = tl.full(e.shape, 1.0, tl.float32)
    n = tl.full(e.shape, 0.0, tl.float32)
    if CLIP:
        n = tl.sum(gd * gd, 1) + tl.sum(v * v, 1) * tl.sum(s * s, 1)
        scale = tl.minimum(clip / tl.sqrt(tl.maximum(n, 1e-30)), 1.0)
    return g, d, s, gd, pdf, n, scale


@triton.jit
def update_tiles(a, v, w, e, clip, CLIP: tl.constexpr):
    """The write ``(u, sig, er, dw1)`` of a chunk's rows from their tiles (see :func:`_update_parts`):
    ``W_1`` after the chunk is ``w1 + dw1``, the sum of ``dw1`` over the chunk's rows. Every other output
    is a row's own, so a caller may take a chunk in blocks of rows (fewer live registers)."""
    g, d, s, gd, pdf, n, scale = _update_parts(a, v, w, e, clip, CLIP)
    rate = (e * scale)[:, None]
    # er^T s as v^T (rate s): the transposed operand is a load, never a computed tile (Triton 3.4-3.7.0
    # miscompiles a transposed computed tile fed to a product on Hopper).
    return rate * gd, s, rate * v, tl.dot(tl.trans(v), rate * s, input_precision=_PRODUCTS)


@triton.jit
def update_backward_tiles(a, v, w, e, du, ds, der, dwn, clip, CLIP: tl.constexpr):
    """The gradients ``(da, dv, dw1, de)`` of :func:`update_tiles` for its outputs' ``(du, dsig, der, dw1_next)``,
    ``dw1`` without ``dw1_next``'s own part: as in the forward, a sum over the chunk's rows (``dw1_next``
    reaches every row's ``der`` and ``dsig``), so the rows may come in blocks."""
    g, d, s, gd, pdf, n, scale = _update_parts(a, v, w, e, clip, CLIP)
    rate = e * scale
    der = der + tl.dot(s, tl.trans(dwn), input_precision=_PRODUCTS)
    ds = ds + tl.dot(rate[:, None] * v, dwn, input_precision=_PRODUCTS)
    df = tl.sum(du * gd, 1) + tl.sum(der * v, 1)
    dv = rate[:, None] * der
    dgd = rate[:, None] * du
    de = df * scale
    if CLIP:
        nc = tl.maximum(n, 1e-30)
        acts = (clip / tl.sqrt(nc) <= 1.0) & (n >= 1e-30)
        dn = tl.where(acts, -0.5 * df * e * scale / nc, 0.0)
        dgd += (2.0 * dn)[:, None] * gd
        dv += (2.0 * dn * tl.sum(s * s, 1))[:, None] * v
        ds += (2.0 * dn * tl.sum(v * v, 1))[:, None] * s
    dg = dgd * d
    dv += tl.dot(dg, tl.trans(w), input_precision=_PRODUCTS)
    dw = tl.dot(tl.trans(v), dg, input_precision=_PRODUCTS)
    da = dgd * g * pdf * (2.0 - a * a) + ds * d
    return da, dv, dw, de


@triton.jit
def _loads(A, V, W, E, TAB, b, h, rc, rv, rh, R, DV, HID):
    """The chunk's ``a, v, w1, e`` (operands 0-3 of the table) as float32 tiles."""
    a = _tile(A, TAB, 0, b, h, rc, rh, R, HID)
    v = _tile(V, TAB, 1, b, h, rc, rv, R, DV)
    w = _tile(W, TAB, 2, b, h, rv, rh, DV, HID)
    e = tl.load(E + b * tl.load(TAB + 9) + h * tl.load(TAB + 10) + rc * tl.load(TAB + 11), mask=rc < R, other=0.0)
    return a, v, w, e.to(tl.float32)


@triton.jit
def _update_kernel(A, V, W, E, U, S, ER, WN, UR, TAB, R, DV, HID, clip, CLIP: tl.constexpr,
                   WRITE_READ: tl.constexpr, BC: tl.constexpr, BV: tl.constexpr, BH: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    rc, rv, rh = tl.arange(0, BC), tl.arange(0, BV), tl.arange(0, BH)
    a, v, w, e = _loads(A, V, W, E, TAB, b, h, rc, rv, rh, R, DV, HID)
    u, s, er, dw = update_tiles(a, v, w, e, clip, CLIP)
    w_next = w + dw
    m_ch = (rc[:, None] < R) & (rh[None, :] < HID)
    tl.store(_ptrs(U, TAB, 4, b, h, rc, rh), u, mask=m_ch)
    tl.store(_ptrs(S, TAB, 5, b, h, rc, rh), s, mask=m_ch)
    tl.store(_ptrs(ER, TAB, 6, b, h, rc, rv), er, mask=(rc[:, None] < R) & (rv[None, :] < DV))
    tl.store(_ptrs(WN, TAB, 7, b, h, rv, rh), w_next, mask=(rv[:, None] < DV) & (rh[None, :] < HID))
    if WRITE_READ:
        tl.store(_ptrs(UR, TAB, 8, b, h, rc, rh), u.to(UR.dtype.element_ty), mask=m_ch)


@triton.jit
def _update_backward_kernel(A, V, W, E, DU, DS, DER, DWN, DA, DVO, DW, DE, TAB, R, DV, HID, clip,
                            CLIP: tl.constexpr, BC: tl.constexpr, BV: tl.constexpr, BH: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    rc, rv, rh = tl.arange(0, BC), tl.arange(0, BV), tl.arange(0, BH)
    a, v, w, e = _loads(A, V, W, E, TAB, b, h, rc, rv, rh, R, DV, HID)
    dwn = _tile(DWN, TAB, 7, b, h, rv, rh, DV, HID)
    da, dv, dw, de = update_backward_tiles(
        a, v, w, e, _tile(DU, TAB, 4, b, h, rc, rh, R, HID), _tile(DS, TAB, 5, b, h, rc, rh, R, HID),
        _tile(DER, TAB, 6, b, h, rc, rv, R, DV), dwn, clip, CLIP)
    m_ch, m_cv = (rc[:, None] < R) & (rh[None, :] < HID), (rc[:, None] < R) & (rv[None, :] < DV)
    tl.store(_ptrs(DA, TAB, 0, b, h, rc, rh), da.to(DA.dtype.element_ty), mask=m_ch)
    tl.store(_ptrs(DVO, TAB, 1, b, h, rc, rv), dv, mask=m_cv)
    tl.store(_ptrs(DW, TAB, 2, b, h, rv, rh), dwn + dw, mask=(rv[:, None] < DV) & (rh[None, :] < HID))
    tl.store(DE + b * tl.load(TAB + 9) + h * tl.load(TAB + 10) + rc * tl.load(TAB + 11), de, mask=rc < R)


def stride_table(*operands: torch.Tensor) -> torch.Tensor:
    """The batch, head and row strides of ``(a, v, w1, e, u, sig, er, w1_next[, u_read])`` (the update)
    or of ``(a, v, w1, e, du, dsig, der, dw1_next)`` (its backward: ``da`` shares ``a``'s, ``dv`` ``v``'s,
    ``dw1`` ``w1``'s and ``de`` ``e``'s) as one device tensor."""
    strides = []
    for x in operands:
        if x.dim() == 4 and x.stride(3) != 1:
            raise ValueError("the chunk update needs unit stride in the last dimension")
        strides += x.stride()[:3]
    return torch.tensor(strides, dtype=torch.int64).to(operands[0].device, non_blocking=True)


def _blocks(R: int, DV: int, HID: int) -> dict:
    p = lambda n: max(16, triton.next_power_of_2(n))  # noqa: E731  (tl.dot needs 16 or more)
    return dict(BC=p(R), BV=p(DV), BH=p(HID))


def chunk_update_triton(a: torch.Tensor, v: torch.Tensor, w1: torch.Tensor, e: torch.Tensor, clip: float | None,
                        out: tuple[torch.Tensor, ...], u_read: torch.Tensor | None = None,
                        table: torch.Tensor | None = None) -> None:
    """:func:`~.deep_attention.chunk_update` written into ``out = (u, sig, er, w1_next)``;
    ``u`` also into ``u_read`` (the reads' dtype) when given. ``table``: :func:`stride_table` of these
    operands, or of any with the same strides (the caller's cache)."""
    B, H, R, HID = a.shape
    DV = v.shape[-1]
    extra = () if u_read is None else (u_read,)
    table = stride_table(a, v, w1, e, *out, *extra) if table is None else table
    _update_kernel[(B, H)](a, v, w1, e, *out, out[0] if u_read is None else u_read, table, R, DV, HID,
                           0.0 if clip is None else float(clip), CLIP=clip is not None,
                           WRITE_READ=u_read is not None, num_warps=_WARPS, **_blocks(R, DV, HID))


def chunk_update_backward_triton(a: torch.Tensor, v: torch.Tensor, w1: torch.Tensor, e: torch.Tensor,
                                 clip: float | None, grads: tuple[torch.Tensor, ...],
                                 out: tuple[torch.Tensor, ...], table: torch.Tensor | None = None) -> None:
    """The gradients of :func:`chunk_update_triton`'s inputs ``(da, dv, dw1, de)`` written into ``out``
    (with the strides of ``(a, v, w1, e)``), for its outputs' gradients ``grads = (du, dsig, der, dw1_next)``."""
    B, H, R, HID = a.shape
    DV = v.shape[-1]
    for x, y in zip(out, (a, v, w1, e)):
        if x.stride() != y.stride():
            raise ValueError("each gradient must have its input's strides")
    table = stride_table(a, v, w1, e, *grads) if table is None else table
    _update_backward_kernel[(B, H)](a, v, w1, e, *grads, *out, table, R, DV, HID,
                                    0.0 if clip is None else float(clip), CLIP=clip is not None, num_warps=_WARPS,
                                    **_blocks(R, DV, HID))
