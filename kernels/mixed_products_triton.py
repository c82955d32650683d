"""Soup's mixed products in Triton: every token's product with a gated sum of many cached weights.

The ``soup`` aggregation of Memory Caching reads one memory whose weights are a per-token mixture of the
cached ones, ``W_t = sum_n g_{t,n} W_n`` (:func:`~.memory_caching.mc_read`). A mixture never needs to exist:
its product with a token's input is ``x_t W_t^T = sum_n g_{t,n} x_t W_n^T``, and the MLP memory is made of
such products and element-wise functions (:func:`~.mlp_memory.memory_apply`). Batched, each memory's
product goes to memory ``(B, N, H, T, d_out)`` and is summed after; here a program keeps its block of
tokens' sum on chip while it walks the memories:

- :func:`mixed_products` forward, a program per (block of tokens, block of outputs, batch x head):
  ``y += g_n (x W_n^T)`` for every memory ``n``;
- backward, input side, a program per (block of tokens, block of inputs, batch x head): ``z = dy W_n``,
  ``dx += g_n z`` and ``dg_n = <z, x>`` (that is ``<dy, x W_n^T>``: the gate's gradient needs no
  product of its own);
- backward, weight side, a program per (block of outputs, memory and block of inputs, batch x head):
  ``dW_n[blk] = sum_t (g_{t,n} dy_t[blk]) x_t^T``, ``dy`` loaded transposed, so that no product's result is
  transposed into another product (which Triton 3.4-3.7.0 miscompiles on Hopper; docs/kernels.md).

Every output has one writer and a fixed order of sums: runs repeat bit for bit. Operands are float32, with
exact products (``"ieee"``) or TF32 ones (``"tf32"``: where PyTorch's own float32 products
take TF32, as under :func:`~.chunk_loop.tf32_products` for bf16/fp16 problems on CUDA), float32 sums.

Tensors: ``x (B, H, T, d_in)``, ``g (B, H, T, N)``, ``w (B, N, H, d_out, d_in)`` (one piece of
:func:`~.memory_caching.mc_read`'s cached weights), any widths: tiles are blocks of at most 64 along each, at
least 16 (the least a tensor-core product takes), masked. Where the inputs span several blocks, each block's
share of a gate's gradient is written apart and summed after the launch.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .backend import tl, triton
from .titans_triton_update import _precision

__all__ = ["mixed_products"]

# (tokens, outputs, inputs, warps) of every kernel: a chunk's 64 tokens in two blocks, so that a chunk's mixes
# over few rows still spread over the SMs; blocks of 64 along the widths cover a head of 64 in one.
BLOCKS = (32, 64, 64, 4)


def _tile(width: int) -> int:
    return max(16, triton.next_power_of_2(width))


@triton.jit
def _token_tile(T, tile, BT: tl.constexpr):
    rows = tile * BT + tl.arange(0, BT)
    return rows, rows < T


@triton.jit
def _token_block(X, gi, T, rows, live, cols, width):
    """``X[gi, rows, cols]`` of a ``(G, T, width)`` tensor, zero outside it."""
    return tl.load(X + (gi * T + rows[:, None]) * width + cols[None, :], mask=live[:, None] & (cols[None, :] < width),
                   other=0.0)


@triton.jit
def _gates(G, gi, T, N, rows, live, n):
    """Memory ``n``'s gates of ``rows``, zero outside the sequence."""
    return tl.load(G + (gi * T + rows) * N + n, mask=live, other=0.0)


@triton.jit
def _weight_base(gi, n, N, H, DO: tl.constexpr, DI: tl.constexpr):
    """Offset of memory ``n``'s weight of batch x head ``gi`` in ``(B, N, H, DO, DI)``."""
    b, h = gi // H, gi % H
    return ((b * N + n) * H + h) * DO * DI


@triton.jit
def _forward_kernel(X, G, W, Y, T, N, H, precision: tl.constexpr, DI: tl.constexpr, DO: tl.constexpr,
                    BT: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr):
    tile, ob = tl.program_id(0), tl.program_id(1)
    gi = tl.program_id(2).to(tl.int64)
    rows, live = _token_tile(T, tile, BT)
    outs = ob * BO + tl.arange(0, BO)
    acc = tl.zeros((BT, BO), tl.float32)
    for n in range(0, N):
        base = _weight_base(gi, n, N, H, DO, DI)
        part = tl.zeros((BT, BO), tl.float32)
        for i0 in range(0, DI, BI):
            cin = i0 + tl.arange(0, BI)
            x = _token_block(X, gi, T, rows, live, cin, DI)
            # W_n[outs, cin] loaded as its transpose (BI, BO): the product is x W_n^T with no transposed result
            w_t = tl.load(W + base + outs[None, :] * DI + cin[:, None], mask=(outs[None, :] < DO) & (cin[:, None] < DI),
                          other=0.0)
            part += tl.dot(x, w_t, input_precision=precision)
        acc += part * _gates(G, gi, T, N, rows, live, n)[:, None]
    tl.store(Y + (gi * T + rows[:, None]) * DO + outs[None, :], acc, mask=live[:, None] & (outs[None, :] < DO))


@triton.jit
def _input_backward_kernel(X, G, W, DY, DX, DG, T, N, H, precision: tl.constexpr, DI: tl.constexpr,
                           DO: tl.constexpr, BT: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr):
    tile, ib = tl.program_id(0), tl.program_id(1)
    gi = tl.program_id(2).to(tl.int64)
    rows, live = _token_tile(T, tile, BT)
    cin = ib * BI + tl.arange(0, BI)
    x = _token_block(X, gi, T, rows, live, cin, DI)
    dx = tl.zeros((BT, BI), tl.float32)
    for n in range(0, N):
        base = _weight_base(gi, n, N, H, DO, DI)
        z = tl.zeros((BT, BI), tl.float32)
        for o0 in range(0, DO, BO):
            outs = o0 + tl.arange(0, BO)
            dy = _token_block(DY, gi, T, rows, live, outs, DO)
            w = tl.load(W + base + outs[:, None] * DI + cin[None, :], mask=(outs[:, None] < DO) & (cin[None, :] < DI),
                        other=0.0)
            z += tl.dot(dy, w, input_precision=precision)
        dx += z * _gates(G, gi, T, N, rows, live, n)[:, None]
        # this block of inputs' share of dg_n; the blocks' shares are summed after the launch
        tl.store(DG + ((gi * T + rows) * N + n) * tl.num_programs(1) + ib, tl.sum(z * x, 1), mask=live)
    tl.store(DX + (gi * T + rows[:, None]) * DI + cin[None, :], dx, mask=live[:, None] & (cin[None, :] < DI))


@triton.jit
def _weight_backward_kernel(X, G, DY, DW, T, N, H, precision: tl.constexpr, DI: tl.constexpr, DO: tl.constexpr,
                            BT: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr):
    ob, nb = tl.program_id(0), tl.program_id(1)
    gi = tl.program_id(2).to(tl.int64)
    n_in = tl.cdiv(DI, BI)
    n, ib = nb // n_in, nb % n_in
    outs, cin = ob * BO + tl.arange(0, BO), ib * BI + tl.arange(0, BI)
    acc = tl.zeros((BO, BI), tl.float32)
    for tile in range(0, tl.cdiv(T, BT)):
        rows, live = _token_tile(T, tile, BT)
        # dy's block loaded as its transpose (BO, BT), scaled by the memory's gates along the tokens
        dy_t = tl.load(DY + (gi * T + rows[None, :]) * DO + outs[:, None], mask=live[None, :] & (outs[:, None] < DO),
                       other=0.0)
        g = _gates(G, gi, T, N, rows, live, n)
        acc += tl.dot(dy_t * g[None, :], _token_block(X, gi, T, rows, live, cin, DI), input_precision=precision)
    tl.store(DW + _weight_base(gi, n, N, H, DO, DI) + outs[:, None] * DI + cin[None, :], acc,
             mask=(outs[:, None] < DO) & (cin[None, :] < DI))


def _check(x: torch.Tensor, g: torch.Tensor, w: torch.Tensor) -> None:
    B, H, T, DI = x.shape
    if w.dim() != 5 or w.shape[0] != B or w.shape[2] != H or w.shape[4] != DI or g.shape != (B, H, T, w.shape[1]):
        raise ValueError(f"mixed products take x (B, H, T, d_in), g (B, H, T, N), w (B, N, H, d_out, d_in); got "
                         f"{tuple(x.shape)}, {tuple(g.shape)}, {tuple(w.shape)}")
    if any(t.dtype != torch.float32 for t in (x, g, w)):
        raise ValueError("mixed products take float32 operands")


def _blocks(d_in: int, d_out: int) -> tuple[int, int, int, int]:
    BT, BO, BI, warps = BLOCKS
    return BT, min(BO, _tile(d_out)), min(BI, _tile(d_in)), warps


def _forward(x, g, w, precision):
    B, H, T, DI = x.shape
    N, DO = w.shape[1], w.shape[3]
    BT, BO, BI, warps = _blocks(DI, DO)
    y = x.new_empty(B, H, T, DO)
    if T:
        _forward_kernel[(triton.cdiv(T, BT), triton.cdiv(DO, BO), B * H)](
            x, g, w, y, T, N, H, precision, DI, DO, BT, BO, BI, num_warps=warps)
    return y


def _backward(x, g, w, dy, precision, inputs: bool, weights: bool):
    """``(dx, dg)`` where ``inputs`` asks (else ``None``s), ``dw`` where ``weights`` does."""
    B, H, T, DI = x.shape
    N, DO = w.shape[1], w.shape[3]
    if not T or not N:
        return torch.zeros_like(x), torch.empty_like(g), torch.zeros_like(w)
    BT, BO, BI, warps = _blocks(DI, DO)
    dx = dg = dw = None
    if inputs:
        dx = torch.empty_like(x)
        n_in = triton.cdiv(DI, BI)
        dg = g.new_empty(*g.shape, n_in)
        _input_backward_kernel[(triton.cdiv(T, BT), n_in, B * H)](
            x, g, w, dy, dx, dg, T, N, H, precision, DI, DO, BT, BO, BI, num_warps=warps)
        dg = dg.sum(-1) if n_in > 1 else dg[..., 0]
    if weights:
        dw = torch.empty_like(w)
        _weight_backward_kernel[(triton.cdiv(DO, BO), N * triton.cdiv(DI, BI), B * H)](
            x, g, dy, dw, T, N, H, precision, DI, DO, BT, BO, BI, num_warps=warps)
    return dx, dg, dw


class _MixedProducts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g, w, precision):
        x, g, w = x.contiguous(), g.contiguous(), w.contiguous()
        ctx.save_for_backward(x, g, w)
        ctx.precision = precision
        return _forward(x, g, w, precision)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, g, w = ctx.saved_tensors
        need_x, need_g, need_w = ctx.needs_input_grad[:3]
        dx, dg, dw = _backward(x, g, w, dy.float().contiguous(), ctx.precision, need_x or need_g, need_w)
        return dx, dg, dw, None


def mixed_products(x: torch.Tensor, g: torch.Tensor, w: torch.Tensor, precision: str | None = None) -> torch.Tensor:
    """``sum_n g_{t,n} x_t W_n^T``: ``x (B, H, T, d_in)``, ``g (B, H, T, N)``, ``w (B, N, H, d_out, d_in)``, all
    float32; returns ``(B, H, T, d_out)`` float32, differentiable in all three (once). ``precision``: ``"ieee"``
    or ``"tf32"`` (default: what PyTorch's float32 products take now)."""
    _check(x, g, w)
    return _MixedProducts.apply(x, g, w, _precision() if precision is None else precision)
