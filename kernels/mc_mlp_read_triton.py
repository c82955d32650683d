"""Triton kernel of the deep memories' Memory Caching decode: one token's gated read of the cached MLP memories.

A decoding token of MC-Titans or MC-Atlas with a gated aggregation (``grm``, ``ssc``) reads every memory its
row has cached: ``sum_n g_n M_n(q)`` over the ``N`` slots, ``M_n(z) = z + W1_n gelu(W2_n z)``. Through
batched matmuls (:func:`~.mlp_memory.memory_apply` on the stacked weights) that is two matrix-vector products
per memory, a GELU, the skip terms and the gated sum: several launches a layer, each streaming the whole
cache, and ``ssc`` reads all ``N`` memories although its gates leave two of them. Here one launch reads them:
program ``(b * H + h, share of the slots, block of hidden units)`` walks the slots of its share, skips those
whose gate is exactly zero (empty slots, whose scores are ``-inf``; the memories ``ssc`` did not select), and
for the others forms ``pre = W2_n[blk] q`` over its ``BF`` hidden units and adds ``g_n W1_n[:, blk] gelu(pre)``
(and, in the first block, the skip term ``g_n q``) to its part of the read. Hidden units are independent (the
GELU acts on each), so the hidden layer splits over programs and a single row (B=1) with few memories still
spreads over the GPU. Program ``s`` of a row's ``S`` shares takes
slots ``s, s + S, s + 2S, ...``, ``S`` set by the rows and the GPU, never by ``N``: slots past a row's
memories (a captured step's cache holds slots ahead of need) have zero gates and add nothing to any share, and
the parts, as many whatever ``N``, are summed in a fixed order, so the read is the same bits with or without
them and a captured decode step replays the eager one exactly.

Everything is float32, as the cache is. :func:`cached_mlp_read_triton` is called by
:func:`~.memory_caching.mc_read` for one token without gradients, whose PyTorch path reads the same memories.
"""

from __future__ import annotations

import torch

from .backend import tl, triton
from .titans_triton_forward import _gelu

__all__ = ["cached_mlp_read_triton", "covers", "shares_for"]

# Hidden units per program: a (256, 32) float32 tile of W1 and a (32, 256) one of W2 are 32 registers a thread
# each at eight warps.
_BF = 32
_MAX_WIDTH = 256
# Programs per SM the shares aim at: the read is a stream of the cache, which wants every SM's loads.
_PROGRAMS_PER_SM = 4
_MAX_SHARES = 16


def covers(d: int) -> bool:
    """Whether the kernel reads memories of width ``d`` (``d_k = d_v``, up to 256)."""
    return 1 <= d <= _MAX_WIDTH


# Not specialised on the slots' count: a decoding cache grows by one memory a segment, and a variant per count
# (Triton specialises 1 and multiples of 16) would compile anew as it grows.
@triton.jit(do_not_specialize=["N"])
def _read_kernel(Q, G, W1, W2, OUT, H, N, D, F, s1_b, s1_n, s1_h, s2_b, s2_n, s2_h,
                 BD: tl.constexpr, BF: tl.constexpr):
    """Program ``(b * H + h, share, hidden block)``: ``sum_n G[bh, n] (W1_n[:, blk] gelu(W2_n[blk] q))`` over the
    share's slots ``share, share + S, ...``, plus ``G[bh, n] q`` in the first block, into ``OUT[share, blk, bh]``."""
    bh = tl.program_id(0)
    share = tl.program_id(1)
    fb = tl.program_id(2)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rd = tl.arange(0, BD)
    md = rd < D
    rf = fb * BF + tl.arange(0, BF)
    mf = rf < F
    q = tl.load(Q + bh.to(tl.int64) * D + rd, mask=md, other=0.0)
    acc = tl.zeros((BD,), tl.float32)
    shares = tl.num_programs(1)
    # int64 offsets and steps: a cache of many memories passes 2^31 elements
    w1 = W1 + b * s1_b + h * s1_h + share.to(tl.int64) * s1_n
    w2 = W2 + b * s2_b + h * s2_h + share.to(tl.int64) * s2_n
    step1 = shares.to(tl.int64) * s1_n
    step2 = shares.to(tl.int64) * s2_n
    for n in range(share, N, shares):
        g = tl.load(G + bh.to(tl.int64) * N + n)
        base1, base2 = w1, w2
        w1 += step1
        w2 += step2
        if g != 0.0:
            t2 = tl.load(base2 + rf[:, None] * D + rd[None, :], mask=mf[:, None] & md[None, :], other=0.0)  # W2 (F, D)
            hidden = _gelu(tl.sum(t2 * q[None, :], 1))
            t1 = tl.load(base1 + rd[:, None] * F + rf[None, :], mask=md[:, None] & mf[None, :], other=0.0)  # W1 (D, F)
            acc += g * tl.sum(t1 * hidden[None, :], 1)
            if fb == 0:
                acc += g * q
    part = share * tl.num_programs(2) + fb
    tl.store(OUT + (part.to(tl.int64) * tl.num_programs(0) + bh) * D + rd, acc, mask=md)


def _rows_major(w: torch.Tensor) -> torch.Tensor:
    """``w`` with each memory's matrix row-major (its leading dimensions strided as they are): the kernel's
    layout; a copy only where the matrices themselves are not."""
    if w.stride(-1) == 1 and w.stride(-2) == w.shape[-1]:
        return w
    return w.contiguous()


def shares_for(rows: int, hidden: int, device: torch.device) -> int:
    """The slot shares of a row: enough programs for every SM with ``rows`` (batch x heads) rows of ``hidden``
    units (one on the CPU, at most :data:`_MAX_SHARES`); never a function of the slots, so that a cache with more
    of them reads the same bits (see the module)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(_MAX_SHARES, triton.cdiv(_PROGRAMS_PER_SM * sms, max(1, rows * triton.cdiv(hidden, _BF)))))


def cached_mlp_read_triton(q: torch.Tensor, gates: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                           shares: int | None = None) -> torch.Tensor:
    """``sum_n gates[b, h, n] (q[b, h] + w1[b, n, h] gelu(w2[b, n, h] q[b, h]))``: ``q (B, H, d)``,
    ``gates (B, H, N)``, cached weights ``w1 (B, N, H, d, F)``, ``w2 (B, N, H, F, d)`` (each memory's matrices
    row-major; the leading dimensions strided as they come); float32. Returns ``(B, H, d)``; no backward (a
    decoding read). ``shares``: programs a row's slots are dealt to (default :func:`shares_for`)."""
    B, H, D = q.shape
    N, F = w1.shape[1], w1.shape[-1]
    if not covers(D) or F < 1:
        raise ValueError(f"cached_mlp_read_triton reads memories of width 1 to {_MAX_WIDTH} with a hidden layer, "
                         f"got width {D}, hidden {F}")
    for name, t, shape in (("gates", gates, (B, H, N)), ("w1", w1, (B, N, H, D, F)), ("w2", w2, (B, N, H, F, D))):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {shape} for q {tuple(q.shape)} and {N} slots, got {tuple(t.shape)}")
    shares = shares_for(B * H, F, q.device) if shares is None else shares
    if shares < 1:
        raise ValueError(f"shares must be >= 1, got {shares}")
    if not (B * H and N):
        return q.new_zeros(B, H, D, dtype=torch.float32)
    w1, w2 = _rows_major(w1), _rows_major(w2)
    q = q.to(torch.float32).contiguous()
    gates = gates.to(torch.float32).contiguous()
    blocks = triton.cdiv(F, _BF)
    parts = torch.empty(shares * blocks, B, H, D, dtype=torch.float32, device=q.device)  # every part is written
    _read_kernel[(B * H, shares, blocks)](
        q, gates, w1, w2, parts, H, N, D, F, w1.stride(0), w1.stride(1), w1.stride(2),
        w2.stride(0), w2.stride(1), w2.stride(2), BD=max(16, triton.next_power_of_2(D)), BF=_BF, num_warps=8)
    # as many parts whatever the slots: one reduction of one shape, the same order every time
    return parts.sum(0)
