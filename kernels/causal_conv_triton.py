"""Triton path of the packed causal short convolution (``causal_conv.packed_causal_conv``).

Tap ``i`` of packed token ``t`` (relative position ``p`` in its sequence) reads the
input at relative position ``p - (K - 1) + i``: a packed token when that is
``>= 0``, else row ``K - 1 + (p - (K - 1) + i)`` of the sequence's window. The
forward kernel gathers the ``K`` taps of a ``(tokens, channels)`` tile that way,
accumulates in float32 and applies SiLU; a second small kernel writes each
sequence's next window. The backward recomputes the pre-activation (cheaper than
keeping it), then gives ``dx`` as the same taps mirrored (token ``t`` feeds tap ``i``
of token ``t + K - 1 - i`` when that one is in the same sequence), the window's
gradient the same way, and the weight's gradient as per-tile partial sums reduced
in PyTorch (no atomics: deterministic).
"""

from __future__ import annotations

import torch

from .backend import tl, triton


__all__ = ["packed_causal_conv"]

_BT, _BC = 64, 64


@triton.jit
def _tap(X, WIN, t, c, live, n, start, C, i: tl.constexpr, KS: tl.constexpr, HAS_WIN: tl.constexpr):
    """Tap ``i``'s inputs of the ``(BT, BC)`` tile of tokens ``t``, channels ``c``, in float32."""
    src = t - (KS - 1) + i
    inside = src >= start
    x = tl.load(X + tl.where(inside, src, 0)[:, None].to(tl.int64) * C + c[None, :],
                mask=live & inside[:, None], other=0.0).to(tl.float32)
    if HAS_WIN:
        row = n.to(tl.int64) * (KS - 1) + (KS - 1) + (src - start)
        x += tl.load(WIN + tl.where(inside, 0, row)[:, None] * C + c[None, :],
                     mask=live & (src < start)[:, None], other=0.0).to(tl.float32)
    return x

@triton.jit
def _preactivation(X, WEIGHT, WIN, t, c, live, cm, n, start, C, KS: tl.constexpr, BT: tl.constexpr,
                   BC: tl.constexpr, HAS_WIN: tl.constexpr):
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for i in tl.static_range(KS):
        w = tl.load(WEIGHT + c * KS + i, mask=cm, other=0.0).to(tl.float32)
        acc += _tap(X, WIN, t, c, live, n, start, C, i, KS, HAS_WIN) * w[None, :]
    return acc

@triton.jit
def _tile(SEQ, P, C, BT: tl.constexpr, BC: tl.constexpr):
    """This program's tokens ``t`` and channels ``c``, the channel mask, the tile's mask and each
    token's sequence ``n``."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    tm, cm = t < P, c < C
    return t, c, cm, tm[:, None] & cm[None, :], tl.load(SEQ + t, mask=tm, other=0)

@triton.jit
def _conv_forward_kernel(
    X, WEIGHT, WIN, SEQ, CU, Y, P, C,
    KS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_WIN: tl.constexpr, SILU: tl.constexpr,
):
    t, c, cm, live, n = _tile(SEQ, P, C, BT, BC)
    start = tl.load(CU + n, mask=t < P, other=0)
    y = _preactivation(X, WEIGHT, WIN, t, c, live, cm, n, start, C, KS, BT, BC, HAS_WIN)
    if SILU:
        y = y * tl.sigmoid(y)
    tl.store(Y + t[:, None].to(tl.int64) * C + c[None, :], y.to(Y.dtype.element_ty), mask=live)

@triton.jit
def _next_window_kernel(
    X, WIN, CU, NW, C,
    KS: tl.constexpr, WP: tl.constexpr, BC: tl.constexpr, HAS_WIN: tl.constexpr,
):
    """Row ``j`` of sequence ``n``'s next window: relative input ``L - (K - 1) + j``."""
    n = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    j = tl.arange(0, WP)
    start = tl.load(CU + n)
    rel = tl.load(CU + n + 1) - start - (KS - 1) + j
    live = (j < KS - 1)[:, None] & (c < C)[None, :]
    from_x = rel >= 0
    x = tl.load(X + (start + tl.where(from_x, rel, 0))[:, None].to(tl.int64) * C + c[None, :],
                mask=live & from_x[:, None], other=0.0).to(tl.float32)
    if HAS_WIN:
        row = n.to(tl.int64) * (KS - 1) + (KS - 1) + tl.where(from_x, 0, rel)
        x += tl.load(WIN + row[:, None] * C + c[None, :], mask=live & (rel < 0)[:, None], other=0.0).to(tl.float32)
    out = (n.to(tl.int64) * (KS - 1) + j)[:, None] * C + c[None, :]
    tl.store(NW + out, x.to(NW.dtype.element_ty), mask=live)

@triton.jit
def _conv_backward_pre_kernel(
    X, WEIGHT, WIN, SEQ, CU, DY, DPRE, DW_PARTIAL, P, C,
    KS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_WIN: tl.constexpr, SILU: tl.constexpr,
):
    """The pre-activation's gradient (float32) and this tile's share of the weight's gradient."""
    t, c, cm, live, n = _tile(SEQ, P, C, BT, BC)
    start = tl.load(CU + n, mask=t < P, other=0)
    off = t[:, None].to(tl.int64) * C + c[None, :]
    dpre = tl.load(DY + off, mask=live, other=0.0).to(tl.float32)
    if SILU:
        pre = _preactivation(X, WEIGHT, WIN, t, c, live, cm, n, start, C, KS, BT, BC, HAS_WIN)
        s = tl.sigmoid(pre)
        dpre = dpre * s * (1.0 + pre * (1.0 - s))
    tl.store(DPRE + off, dpre, mask=live)
    partial = DW_PARTIAL + (tl.program_id(0).to(tl.int64) * C + c) * KS
    for i in tl.static_range(KS):
        tl.store(partial + i, tl.sum(dpre * _tap(X, WIN, t, c, live, n, start, C, i, KS, HAS_WIN), axis=0),
                 mask=cm)

@triton.jit
def _conv_backward_x_kernel(
    DPRE, WEIGHT, SEQ, CU, DNW, DX, P, C,
    KS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_DNW: tl.constexpr,
):
    """``dx[t] = sum_i w_i dpre[t + K - 1 - i]`` within ``t``'s sequence, plus its next-window gradient."""
    t, c, cm, live, n = _tile(SEQ, P, C, BT, BC)
    end = tl.load(CU + n + 1, mask=t < P, other=0)
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for i in tl.static_range(KS):
        dst = t + (KS - 1) - i
        ok = dst < end
        w = tl.load(WEIGHT + c * KS + i, mask=cm, other=0.0).to(tl.float32)
        d = tl.load(DPRE + tl.where(ok, dst, 0)[:, None].to(tl.int64) * C + c[None, :],
                    mask=live & ok[:, None], other=0.0)
        acc += d * w[None, :]
    if HAS_DNW:
        j = t - end + (KS - 1)  # the next-window row this token became, if any
        inw = j >= 0
        row = n.to(tl.int64) * (KS - 1) + tl.where(inw, j, 0)
        acc += tl.load(DNW + row[:, None] * C + c[None, :], mask=live & inw[:, None], other=0.0).to(tl.float32)
    tl.store(DX + t[:, None].to(tl.int64) * C + c[None, :], acc.to(DX.dtype.element_ty), mask=live)

@triton.jit
def _conv_backward_window_kernel(
    DPRE, WEIGHT, CU, DNW, DWIN, C,
    KS: tl.constexpr, WP: tl.constexpr, BC: tl.constexpr, HAS_DNW: tl.constexpr,
):
    """Window row ``j`` feeds tap ``i`` of relative token ``j - i`` and, when the sequence has
    ``L <= j`` tokens, row ``j - L`` of the next window."""
    n = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = c < C
    j = tl.arange(0, WP)
    jm = j < KS - 1
    start = tl.load(CU + n)
    length = tl.load(CU + n + 1) - start
    acc = tl.zeros([WP, BC], dtype=tl.float32)
    for i in tl.static_range(KS):
        p = j - i
        ok = jm & (p >= 0) & (p < length)
        w = tl.load(WEIGHT + c * KS + i, mask=cm, other=0.0).to(tl.float32)
        d = tl.load(DPRE + (start + tl.where(ok, p, 0))[:, None].to(tl.int64) * C + c[None, :],
                    mask=ok[:, None] & cm[None, :], other=0.0)
        acc += d * w[None, :]
    if HAS_DNW:
        jn = j - length
        ok = jm & (jn >= 0)
        row = n.to(tl.int64) * (KS - 1) + tl.where(ok, jn, 0)
        acc += tl.load(DNW + row[:, None] * C + c[None, :], mask=ok[:, None] & cm[None, :], other=0.0).to(tl.float32)
    out = (n.to(tl.int64) * (KS - 1) + j)[:, None] * C + c[None, :]
    tl.store(DWIN + out, acc.to(DWIN.dtype.element_ty), mask=jm[:, None] & cm[None, :])


def _grid(P: int, C: int) -> tuple[int, int]:
    return triton.cdiv(P, _BT), triton.cdiv(C, _BC)


def _window_pow2(kernel_size: int) -> int:
    return max(2, triton.next_power_of_2(kernel_size - 1))


class _PackedCausalConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, window, cu_seqlens, token_sequence, activation):
        P, C = x.shape
        KS = weight.shape[-1]
        N = cu_seqlens.numel() - 1
        y = torch.empty_like(x)
        next_window = x.new_empty(N, KS - 1, C)
        has_win = window is not None
        win = window if has_win else x
        _conv_forward_kernel[_grid(P, C)](
            x, weight, win, token_sequence, cu_seqlens, y, P, C,
            KS=KS, BT=_BT, BC=_BC, HAS_WIN=has_win, SILU=activation, num_warps=4,
        )
        if N > 0:
            _next_window_kernel[(N, triton.cdiv(C, _BC))](
                x, win, cu_seqlens, next_window, C, KS=KS, WP=_window_pow2(KS), BC=_BC, HAS_WIN=has_win, num_warps=4,
            )
        ctx.save_for_backward(x, weight, window, cu_seqlens, token_sequence)
        ctx.activation = activation
        return y, next_window

    @staticmethod
    def backward(ctx, dy, dnw):
        x, weight, window, cu_seqlens, token_sequence = ctx.saved_tensors
        P, C = x.shape
        KS = weight.shape[-1]
        N = cu_seqlens.numel() - 1
        has_win, has_dnw = window is not None, dnw is not None
        dy = torch.zeros_like(x) if dy is None else dy.contiguous()
        dnw = dnw.contiguous() if has_dnw else x
        grid = _grid(P, C)
        dpre = torch.empty(P, C, dtype=torch.float32, device=x.device)
        dw_partial = torch.empty(grid[0], C, KS, dtype=torch.float32, device=x.device)
        _conv_backward_pre_kernel[grid](
            x, weight, window if has_win else x, token_sequence, cu_seqlens, dy, dpre, dw_partial, P, C,
            KS=KS, BT=_BT, BC=_BC, HAS_WIN=has_win, SILU=ctx.activation, num_warps=4,
        )
        dx = torch.empty_like(x)
        _conv_backward_x_kernel[grid](
            dpre, weight, token_sequence, cu_seqlens, dnw, dx, P, C, KS=KS, BT=_BT, BC=_BC, HAS_DNW=has_dnw,
            num_warps=4,
        )
        dwindow = None
        if has_win and ctx.needs_input_grad[2] and N > 0:
            dwindow = torch.empty_like(window)
            _conv_backward_window_kernel[(N, triton.cdiv(C, _BC))](
                dpre, weight, cu_seqlens, dnw, dwindow, C, KS=KS, WP=_window_pow2(KS), BC=_BC, HAS_DNW=has_dnw,
                num_warps=4,
            )
        dweight = dw_partial.sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx, dweight, dwindow, None, None, None


def packed_causal_conv(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor,
                       token_sequence: torch.Tensor, window: torch.Tensor | None, activation: bool = True):
    """``causal_conv.packed_causal_conv`` on Triton: ``x`` ``(P, C)``, ``weight`` ``(C, K)``,
    ``cu_seqlens`` ``(N + 1,)`` and ``token_sequence`` ``(P,)`` int32, ``window`` ``(N, K - 1, C)``
    or ``None`` (zeros). Returns ``(y, next_window)`` in ``x``'s dtype."""
    window = None if window is None else window.contiguous()
    return _PackedCausalConv.apply(x.contiguous(), weight.contiguous(), window, cu_seqlens.contiguous(),
                                   token_sequence.contiguous(), activation)
