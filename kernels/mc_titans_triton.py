"""Reads of many cached MLP memories in fused Triton kernels (MC-Titans' training path).

:class:`~.mc_titans._CachedReads` computes ``y_t = sum_j g_{j,t} M_j(q_t)`` over the cached memories
``M_j(z) = z + W1_j gelu(W2_j z)`` (:func:`~.mlp_memory.memory_apply` with an identity skip). Through batched
matmuls every (query, memory) pair's hidden layer, four times a query's width, goes to memory and back
several times per pass, and at T = 8192 those hidden layers (a billion elements) cost as much as the
products. These kernels keep them on chip, hidden block by hidden block, as attention kernels keep
their scores:

- :func:`cached_reads_forward`, a program per (block of queries, batch x head), the heaviest blocks (the
  latest, which read the most memories) first: for each memory the block reads and each hidden block,
  ``pre = q W2^T``, ``y += (g gelu(pre)) W1^T``; then ``y += (sum_j g_j) q``.
- :func:`cached_reads_backward`, query side, the same grid: ``z = dy W1`` per hidden block,
  ``dg_j = <dy, q> + sum z gelu(pre)``, ``dq += (g z gelu'(pre)) W2``; then ``dq += (sum_j g_j) dy``.
  Weight side, a program per (hidden block, memory, batch x head) looping over the blocks of queries
  that read the memory: ``dW1[:, blk] = dy^T (g gelu(pre))`` and ``dW2[blk] = (g z gelu'(pre))^T q``, the
  latter accumulated as its transpose ``q^T (...)`` and stored transposed, so that no product's result
  is transposed into another product (which Triton 3.4-3.7.0 miscompiles on Hopper; docs/kernels.md).

Memories are given as a list ``mems`` of indices into the stacked weights, ordered by their first query
``starts``: a block of queries ending at ``e`` reads the first ``count`` of them, those starting before
``e``. Gates are zero before a memory's start (the aggregations mask them), so a block straddling a start
is right as it is; ``dg`` is written from the start on, as the batched path writes it.

Each output has one writer and a fixed order of sums: runs repeat bit for bit. Operands are those of
``operands``: float32 with ``precision`` (``"ieee"`` exact, ``"tf32"``), or bf16 for bf16/fp16 problems,
with float32 sums, GELUs and skip terms (a query's own term ``g q`` dominates a read: it is added in
float32, not rounded to the operands' dtype).

Tensors: ``q, dy (G, T, D)`` float32, ``g (N, G, T)`` float32, ``w1 (N, G, D, F)``, ``w2 (N, G, F, D)`` in the
operands' dtype, all contiguous, ``G`` = batch x heads, ``F`` the hidden width.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

import torch

from .backend import tl, triton
from .titans_triton_forward import _gelu, _gelu_slope

__all__ = ["ONE_MEMORY", "DenseReads", "cached_reads_backward", "cached_reads_forward", "operands", "supported"]

# (queries, hidden, warps, stages) per kernel for 16-bit operands: the fastest of those tried for each kernel,
# ahead of (64, 64, 8, 2) in all three; twice the hidden block or half the queries were slower in each
# (benchmarks/RESULTS.md).
FORWARD_BLOCKS = (64, 32, 4, 2)
QUERY_BLOCKS = (128, 32, 8, 3)
WEIGHT_BLOCKS = (64, 32, 4, 2)
# float32 operands (exact products: tests, float32 problems that ask for Triton) take twice the shared memory a
# tile: (64, 64, 8, 2) asked for 320 KB in the forward, over the 227 KB of an H100 or H200.
FLOAT32_BLOCKS = (32, 32, 4, 1)


# Operands of bf16/fp16 problems: "bf16" (rounded, as attention's flash kernels read a bf16 model) or "tf32"
# (float32 tiles, the chunk kernels' policy), kept for comparison: much slower per kernel (benchmarks/RESULTS.md).
LOW_PRECISION = "bf16"


def operands(tf32: bool) -> tuple[torch.dtype, str]:
    """The operands' dtype and the products' precision: float32 products (``tf32`` only for bf16/fp16 problems,
    as :func:`~.chunk_loop.tf32_wanted` says) or, for those problems, ``LOW_PRECISION``."""
    if not tf32:
        return torch.float32, "ieee"
    return (torch.bfloat16, "tf32") if LOW_PRECISION == "bf16" else (torch.float32, "tf32")


def supported(d: int, hidden: int) -> bool:
    """Whether the kernels take memories of width ``d`` (a power of two from 16 to 256) and hidden width
    ``hidden`` (a multiple of 16)."""
    return 16 <= d <= 256 and d & (d - 1) == 0 and hidden % 16 == 0


@dataclass(frozen=True)
class DenseReads:
    """The memories read by every query from their start on: indices ``mems`` and ``starts`` (host lists,
    ordered by start)."""

    mems: tuple[int, ...]
    starts: tuple[int, ...]

    def __post_init__(self) -> None:
        if list(self.starts) != sorted(self.starts) or len(self.mems) != len(self.starts):
            raise ValueError("the memories' starts must be given in order, one per memory")

    def tables(self, T: int, block: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(mems, starts, count)`` as int32 device tensors, ``count`` per block of ``block`` queries."""
        n_blocks = triton.cdiv(T, block)
        if self == ONE_MEMORY:  # a selective batch's width changes every step: made on the device, not copied
            zero = torch.zeros(1, dtype=torch.int32, device=device)
            return zero, zero, torch.ones(n_blocks, dtype=torch.int32, device=device)
        return _tables(self, T, block, torch.device(device))


@functools.lru_cache(maxsize=64)
def _tables(reads: DenseReads, T: int, block: int, device: torch.device):
    """:meth:`DenseReads.tables`, kept: a training step asks for the same ones every time, and a copy from
    pageable host memory would wait for the device's queue."""
    counts = [bisect.bisect_left(reads.starts, min(T, e + block)) for e in range(0, T, block)]
    return tuple(torch.tensor(x, dtype=torch.int32, device=device) for x in (reads.mems, reads.starts, counts))


# One memory read by every query: a selective batch of memories, each over its own gathered queries, is this
# with a memory and a batch x head per row of heads (:meth:`~.mc_titans._CachedReads._picked`).
ONE_MEMORY = DenseReads((0,), (0,))


def _blocks(blocks: tuple[int, int, int, int], w: torch.Tensor) -> tuple[int, int, int, int]:
    return blocks if w.element_size() == 2 else FLOAT32_BLOCKS


# The most programs a launch may have along a grid axis past the first (CUDA's limit).
MAX_GRID_ROWS = 65535


def _row_launches(rows: int) -> list[tuple[int, int]]:
    """``(first, count)`` of each launch's rows of heads: a selective batch has one per (memory, batch, head),
    which may pass the grid's limit."""
    return [(g0, min(MAX_GRID_ROWS, rows - g0)) for g0 in range(0, rows, MAX_GRID_ROWS)]


def _hidden_block(hidden: int, block: int) -> int:
    while hidden % block:
        block //= 2
    return block


@triton.jit
def _query_tile(g_idx, T, tile, BQ: tl.constexpr, D: tl.constexpr):
    """The rows, their mask and the offsets of query block ``tile`` of ``(G, T, D)`` tensors."""
    rows = tile * BQ + tl.arange(0, BQ)
    live = rows < T
    offs = g_idx * T * D + rows[:, None] * D + tl.arange(0, D)[None, :]
    return rows, live, offs


@triton.jit
def _memory(MEMS, G, s, gi, NG, T, rows, live, D: tl.constexpr, F: tl.constexpr):
    """Entry ``s`` of the memories' list: its index, its gates of ``rows`` and the offset of its weights of
    batch x head ``gi``."""
    j = tl.load(MEMS + s).to(tl.int64)
    return j, tl.load(G + (j * NG + gi) * T + rows, mask=live, other=0.0), (j * NG + gi) * D * F


@triton.jit
def _hidden_slice(W1, W2, base, hid, D: tl.constexpr, F: tl.constexpr):
    """The weights of hidden units ``hid``: ``W1[:, hid] (D, BH)`` and ``W2[hid] (BH, D)``."""
    cols = tl.arange(0, D)
    return tl.load(W1 + base + cols[:, None] * F + hid[None, :]), tl.load(W2 + base + hid[:, None] * D + cols[None, :])


@triton.jit
def _forward_kernel(Q, G, W1, W2, Y, MEMS, COUNT, T, NG, G0, precision: tl.constexpr, D: tl.constexpr,
                    F: tl.constexpr, BQ: tl.constexpr, BH: tl.constexpr):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # the latest blocks read the most memories: first
    gi = G0 + tl.program_id(1).to(tl.int64)
    rows, live, offs = _query_tile(gi, T, tile, BQ, D)
    q = tl.load(Q + offs, mask=live[:, None], other=0.0)
    q_op = q.to(W1.dtype.element_ty)
    acc = tl.zeros((BQ, D), tl.float32)
    g_sum = tl.zeros((BQ,), tl.float32)
    for s in range(0, tl.load(COUNT + tile)):
        _, g, base = _memory(MEMS, G, s, gi, NG, T, rows, live, D, F)
        g_sum += g
        for h0 in range(0, F, BH):
            w1, w2 = _hidden_slice(W1, W2, base, h0 + tl.arange(0, BH), D, F)
            pre = tl.dot(q_op, tl.trans(w2), input_precision=precision)
            act = (_gelu(pre) * g[:, None]).to(q_op.dtype)
            acc += tl.dot(act, tl.trans(w1), input_precision=precision)
    tl.store(Y + offs, acc + g_sum[:, None] * q, mask=live[:, None])


@triton.jit
def _query_backward_kernel(Q, DY, G, W1, W2, DQ, DG, MEMS, STARTS, COUNT, T, NG, G0, precision: tl.constexpr,
                           D: tl.constexpr, F: tl.constexpr, BQ: tl.constexpr, BH: tl.constexpr):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    gi = G0 + tl.program_id(1).to(tl.int64)
    rows, live, offs = _query_tile(gi, T, tile, BQ, D)
    q = tl.load(Q + offs, mask=live[:, None], other=0.0)
    dy = tl.load(DY + offs, mask=live[:, None], other=0.0)
    q_op, dy_op = q.to(W1.dtype.element_ty), dy.to(W1.dtype.element_ty)
    own = tl.sum(q * dy, 1)  # the skip's share of every dg
    dq = tl.zeros((BQ, D), tl.float32)
    g_sum = tl.zeros((BQ,), tl.float32)
    for s in range(0, tl.load(COUNT + tile)):
        j, g, base = _memory(MEMS, G, s, gi, NG, T, rows, live, D, F)
        g_sum += g
        dg = own
        for h0 in range(0, F, BH):
            w1, w2 = _hidden_slice(W1, W2, base, h0 + tl.arange(0, BH), D, F)
            pre = tl.dot(q_op, tl.trans(w2), input_precision=precision)
            z = tl.dot(dy_op, w1, input_precision=precision)  # dy through W1: the hidden layer's gradient
            dg += tl.sum(z * _gelu(pre), 1)
            dpre = (z * _gelu_slope(pre) * g[:, None]).to(q_op.dtype)
            dq += tl.dot(dpre, w2, input_precision=precision)
        tl.store(DG + (j * NG + gi) * T + rows, dg, mask=live & (rows >= tl.load(STARTS + s)))
    tl.store(DQ + offs, dq + g_sum[:, None] * dy, mask=live[:, None])


@triton.jit
def _weight_backward_kernel(Q, DY, G, W1, W2, DW1, DW2, MEMS, STARTS, T, NG, G0, precision: tl.constexpr,
                            D: tl.constexpr, F: tl.constexpr, BQ: tl.constexpr, BH: tl.constexpr):
    h0 = tl.program_id(0) * BH
    s = tl.program_id(1)
    gi = G0 + tl.program_id(2).to(tl.int64)
    j = tl.load(MEMS + s).to(tl.int64)
    start = tl.load(STARTS + s)
    cols, hid = tl.arange(0, D), h0 + tl.arange(0, BH)
    base = (j * NG + gi) * D * F
    w1, w2 = _hidden_slice(W1, W2, base, hid, D, F)
    dw1 = tl.zeros((D, BH), tl.float32)
    dw2_t = tl.zeros((D, BH), tl.float32)
    for tile in range(start // BQ, tl.cdiv(T, BQ)):
        rows, live, offs = _query_tile(gi, T, tile, BQ, D)
        q = tl.load(Q + offs, mask=live[:, None], other=0.0).to(W1.dtype.element_ty)
        dy = tl.load(DY + offs, mask=live[:, None], other=0.0).to(W1.dtype.element_ty)
        g = tl.load(G + (j * NG + gi) * T + rows, mask=live, other=0.0)
        pre = tl.dot(q, tl.trans(w2), input_precision=precision)
        z = tl.dot(dy, w1, input_precision=precision)
        act = (_gelu(pre) * g[:, None]).to(q.dtype)
        dpre = (z * _gelu_slope(pre) * g[:, None]).to(q.dtype)
        dw1 += tl.dot(tl.trans(dy), act, input_precision=precision)
        dw2_t += tl.dot(tl.trans(q), dpre, input_precision=precision)
    tl.store(DW1 + base + cols[:, None] * F + hid[None, :], dw1)
    tl.store(DW2 + base + hid[None, :] * D + cols[:, None], dw2_t)  # dW2 (F, D) stored from its transpose


def cached_reads_forward(q: torch.Tensor, g: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, reads: DenseReads,
                         precision: str) -> torch.Tensor:
    """``sum_j g_j M_j(q)`` over the memories of ``reads``: ``q (B, H, T, D)`` float32, ``g (N, B, H, T)``,
    ``w1 (N, B, H, D, F)``, ``w2 (N, B, H, F, D)`` in the operands' dtype. Returns ``(B, H, T, D)`` float32."""
    B, H, T, D = q.shape
    F = w1.shape[-1]
    BQ, BH, warps, stages = _blocks(FORWARD_BLOCKS, w1)
    mems, _, count = reads.tables(T, BQ, q.device)
    q = q.contiguous()  # (B, H, ...) contiguous is (B * H, ...): the kernels index batch x heads
    y = torch.empty_like(q)
    g, w1, w2 = g.contiguous(), w1.contiguous(), w2.contiguous()
    for g0, rows in _row_launches(B * H):
        _forward_kernel[(triton.cdiv(T, BQ), rows)](
            q, g, w1, w2, y, mems, count, T, B * H, g0, precision, D, F, BQ, _hidden_block(F, BH), num_warps=warps,
            num_stages=stages)
    return y


def cached_reads_backward(q: torch.Tensor, g: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, dy: torch.Tensor,
                          reads: DenseReads, precision: str, dq: torch.Tensor, dg: torch.Tensor, dw1: torch.Tensor,
                          dw2: torch.Tensor) -> None:
    """The gradients of :func:`cached_reads_forward` for ``dy (B, H, T, D)``: ``dq`` (its output; the
    kernels write it), ``dg`` of the memories of ``reads`` (from their starts on) and their ``dw1, dw2``
    (float32, contiguous, shaped as ``g``, ``w1``, ``w2``), written in place."""
    for x in (dq, dg, dw1, dw2):
        if not x.is_contiguous() or x.dtype != torch.float32:
            raise ValueError("the cached reads' gradients are written into contiguous float32 tensors")
    q, dy, g, w1, w2 = (x.contiguous() for x in (q, dy.float(), g, w1, w2))
    query_side(q, g, w1, w2, dy, reads, precision, dq, dg)
    weight_side(q, g, w1, w2, dy, reads, precision, dw1, dw2)


def query_side(q, g, w1, w2, dy, reads: DenseReads, precision: str, dq: torch.Tensor, dg: torch.Tensor) -> None:
    """``dq`` and ``dg`` of :func:`cached_reads_backward` (contiguous operands)."""
    B, H, T, D = q.shape
    F = w1.shape[-1]
    BQ, BH, warps, stages = _blocks(QUERY_BLOCKS, w1)
    mems, starts, count = reads.tables(T, BQ, q.device)
    for g0, rows in _row_launches(B * H):
        _query_backward_kernel[(triton.cdiv(T, BQ), rows)](
            q, dy, g, w1, w2, dq, dg, mems, starts, count, T, B * H, g0, precision, D, F, BQ, _hidden_block(F, BH),
            num_warps=warps, num_stages=stages)


def weight_side(q, g, w1, w2, dy, reads: DenseReads, precision: str, dw1: torch.Tensor, dw2: torch.Tensor) -> None:
    """``dw1`` and ``dw2`` of :func:`cached_reads_backward` (contiguous operands)."""
    B, H, T, D = q.shape
    F = w1.shape[-1]
    BQ, BH, warps, stages = _blocks(WEIGHT_BLOCKS, w1)
    BH = _hidden_block(F, BH)
    mems, starts, _ = reads.tables(T, BQ, q.device)
    op = w1.dtype  # every query block is read once per hidden block: in the operands' dtype
    q, dy = q.to(op), dy.to(op)
    for g0, rows in _row_launches(B * H):
        _weight_backward_kernel[(F // BH, len(reads.mems), rows)](
            q, dy, g, w1, w2, dw1, dw2, mems, starts, T, B * H, g0, precision, D, F, BQ, BH, num_warps=warps,
            num_stages=stages)
