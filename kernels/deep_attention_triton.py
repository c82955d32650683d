"""Triton kernels for one chunk of the Hebbian DeepTransformer's key pass (:mod:`.deep_attention_hebbian`).

:func:`~.deep_attention_hebbian.chunk_update` is about thirty small PyTorch kernels (the GELU and
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
buffers: the kernels read and write them in place), ``e`` ``(B, H, rows)``. Sums are float32;
products are TF32 when ``tf32`` (the memories' policy for bf16/fp16 problems, see
:func:`~.chunk_loop.tf32_wanted`) and ``_FP32_PRODUCTS`` otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["chunk_update_backward_triton", "chunk_update_triton"]

_WARPS = 4
# float32 problems: three TF32 products per product, float32's accuracy (2e-7 relative against float64 on an
# H100) at 36 / 58 us for the update / its backward where Triton's exact float32 dot took 287 / 771 us.
_FP32_PRODUCTS = "tf32x3"


def _precision(tf32: bool) -> str:
    return "tf32" if tf32 else _FP32_PRODUCTS

@triton.jit
def _ptrs(X, s0, s1, s2, b, h, rows, cols):
    """Pointers to ``X[b, h, rows, cols]`` for a 4-d view with strides ``(s0, s1, s2, 1)``."""
    return X + b * s0 + h * s1 + rows[:, None] * s2 + cols[None, :]


@triton.jit
def _tile(X, s0, s1, s2, b, h, rows, cols, R, N):
    return tl.load(_ptrs(X, s0, s1, s2, b, h, rows, cols), mask=(rows[:, None] < R) & (cols[None, :] < N),
                   other=0.0).to(tl.float32)


@triton.jit
def _forward_parts(A, sa0, sa1, sa2, V, sv0, sv1, sv2, W, sw0, sw1, sw2, E, se0, se1, se2, b, h, rc, rv, rh, R,
                   DV, HID, clip, CLIP: tl.constexpr, PRECISION: tl.constexpr):
    """Everything the forward and the backward share: the chunk's loads, ``g d``, ``s``, ``d`` and the clip."""
    a = _tile(A, sa0, sa1, sa2, b, h, rc, rh, R, HID)
    v = _tile(V, sv0, sv1, sv2, b, h, rc, rv, R, DV)
    w = _tile(W, sw0, sw1, sw2, b, h, rv, rh, DV, HID)
    e = tl.load(E + b * se0 + h * se1 + rc * se2, mask=rc < R, other=0.0).to(tl.float32)
    g = tl.dot(v, w, input_precision=PRECISION)
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
    return a, v, w, e, g, d, s, gd, pdf, n, scale


@triton.jit
def _update_kernel(A, sa0, sa1, sa2, V, sv0, sv1, sv2, W, sw0, sw1, sw2, E, se0, se1, se2,
                   U, su0, su1, su2, S, ss0, ss1, ss2, ER, sr0, sr1, sr2, WN, sn0, sn1, sn2, UR, sq0, sq1, sq2,
                   R, DV, HID, clip, CLIP: tl.constexpr, WRITE_READ: tl.constexpr, BC: tl.constexpr,
                   BV: tl.constexpr, BH: tl.constexpr, PRECISION: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    rc, rv, rh = tl.arange(0, BC), tl.arange(0, BV), tl.arange(0, BH)
    a, v, w, e, g, d, s, gd, pdf, n, scale = _forward_parts(A, sa0, sa1, sa2, V, sv0, sv1, sv2, W, sw0, sw1, sw2,
                                                             E, se0, se1, se2, b, h, rc, rv, rh, R, DV, HID, clip,
                                                             CLIP, PRECISION)
    rate = (e * scale)[:, None]
    u = rate * gd
    er = rate * v
    w_next = w + tl.dot(tl.trans(er), s, input_precision=PRECISION)
    m_ch = (rc[:, None] < R) & (rh[None, :] < HID)
    tl.store(_ptrs(U, su0, su1, su2, b, h, rc, rh), u, mask=m_ch)
    tl.store(_ptrs(S, ss0, ss1, ss2, b, h, rc, rh), s, mask=m_ch)
    tl.store(_ptrs(ER, sr0, sr1, sr2, b, h, rc, rv), er, mask=(rc[:, None] < R) & (rv[None, :] < DV))
    tl.store(_ptrs(WN, sn0, sn1, sn2, b, h, rv, rh), w_next, mask=(rv[:, None] < DV) & (rh[None, :] < HID))
    if WRITE_READ:
        tl.store(_ptrs(UR, sq0, sq1, sq2, b, h, rc, rh), u.to(UR.dtype.element_ty), mask=m_ch)


@triton.jit
def _update_backward_kernel(A, sa0, sa1, sa2, V, sv0, sv1, sv2, W, sw0, sw1, sw2, E, se0, se1, se2,
                            DU, su0, su1, su2, DS, ss0, ss1, ss2, DER, sr0, sr1, sr2, DWN, sn0, sn1, sn2,
                            DA, sd0, sd1, sd2, DVO, so0, so1, so2, DW, sg0, sg1, sg2, DE, sx0, sx1, sx2,
                            R, DV, HID, clip, CLIP: tl.constexpr, BC: tl.constexpr, BV: tl.constexpr,
                            BH: tl.constexpr, PRECISION: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    rc, rv, rh = tl.arange(0, BC), tl.arange(0, BV), tl.arange(0, BH)
    a, v, w, e, g, d, s, gd, pdf, n, scale = _forward_parts(A, sa0, sa1, sa2, V, sv0, sv1, sv2, W, sw0, sw1, sw2,
                                                             E, se0, se1, se2, b, h, rc, rv, rh, R, DV, HID, clip,
                                                             CLIP, PRECISION)
    rate = e * scale
    dwn = _tile(DWN, sn0, sn1, sn2, b, h, rv, rh, DV, HID)
    du = _tile(DU, su0, su1, su2, b, h, rc, rh, R, HID)
    der = _tile(DER, sr0, sr1, sr2, b, h, rc, rv, R, DV) + tl.dot(s, tl.trans(dwn), input_precision=PRECISION)
    ds = _tile(DS, ss0, ss1, ss2, b, h, rc, rh, R, HID) + tl.dot(rate[:, None] * v, dwn, input_precision=PRECISION)
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
    dv += tl.dot(dg, tl.trans(w), input_precision=PRECISION)
    dw = dwn + tl.dot(tl.trans(v), dg, input_precision=PRECISION)
    da = dgd * g * pdf * (2.0 - a * a) + ds * d
    m_ch, m_cv = (rc[:, None] < R) & (rh[None, :] < HID), (rc[:, None] < R) & (rv[None, :] < DV)
    tl.store(_ptrs(DA, sd0, sd1, sd2, b, h, rc, rh), da.to(DA.dtype.element_ty), mask=m_ch)
    tl.store(_ptrs(DVO, so0, so1, so2, b, h, rc, rv), dv, mask=m_cv)
    tl.store(_ptrs(DW, sg0, sg1, sg2, b, h, rv, rh), dw, mask=(rv[:, None] < DV) & (rh[None, :] < HID))
    tl.store(DE + b * sx0 + h * sx1 + rc * sx2, de, mask=rc < R)


def _args(*tensors: torch.Tensor) -> list:
    """Each tensor followed by its batch, head and row strides (the kernels' pointer arguments)."""
    args = []
    for x in tensors:
        if x.dim() == 4 and x.stride(3) != 1:
            raise ValueError("the chunk update needs unit stride in the last dimension")
        args += [x, *x.stride()[:3]]
    return args


def _blocks(R: int, DV: int, HID: int) -> dict:
    p = lambda n: max(16, triton.next_power_of_2(n))  # noqa: E731  (tl.dot needs 16 or more)
    return dict(BC=p(R), BV=p(DV), BH=p(HID))


def chunk_update_triton(a: torch.Tensor, v: torch.Tensor, w1: torch.Tensor, e: torch.Tensor, clip: float | None,
                        out: tuple[torch.Tensor, ...], u_read: torch.Tensor | None = None, tf32: bool = False
                        ) -> None:
    """:func:`~.deep_attention_hebbian.chunk_update` written into ``out = (u, sig, er, w1_next)``;
    ``u`` also into ``u_read`` (the reads' dtype) when given."""
    B, H, R, HID = a.shape
    DV = v.shape[-1]
    u, sig, er, w_next = out
    ur = u if u_read is None else u_read
    _update_kernel[(B, H)](*_args(a, v, w1, e, u, sig, er, w_next, ur), R, DV, HID, 0.0 if clip is None else float(clip), CLIP=clip is not None,
                           WRITE_READ=u_read is not None, PRECISION=_precision(tf32), num_warps=_WARPS,
                           **_blocks(R, DV, HID))


def chunk_update_backward_triton(a: torch.Tensor, v: torch.Tensor, w1: torch.Tensor, e: torch.Tensor,
                                 clip: float | None, grads: tuple[torch.Tensor, ...],
                                 out: tuple[torch.Tensor, ...], tf32: bool = False) -> None:
    """The gradients of :func:`chunk_update_triton`'s inputs ``(da, dv, dw1, de)`` written into ``out``,
    for its outputs' gradients ``grads = (du, dsig, der, dw1_next)``."""
    B, H, R, HID = a.shape
    DV = v.shape[-1]
    du, ds, der, dwn = grads
    da, dv, dw, de = out
    _update_backward_kernel[(B, H)](*_args(a, v, w1, e, du, ds, der, dwn, da, dv, dw, de), R, DV, HID, 0.0 if clip is None else float(clip), CLIP=clip is not None,
                                    PRECISION=_precision(tf32), num_warps=_WARPS, **_blocks(R, DV, HID))
