"""Triton kernel of MoM's Memory Caching decode: the gated read of the cached states of the routed memories,
taken where they lie in the layer's cache.

A decoding token of a row visits ``S`` of the row's memories, and with a gated aggregation it reads every
state cached for each of them: ``sum_n g_n S_n^T q`` over the ``N`` slots. The cache holds the states of
all memories of all rows, ``(R, N, H, d_k, d_v)`` with ``R = batch * memories``; gathering the visited
memories' states first copies ``S / memories`` of the cache through HBM before the read goes through it
again. Here one launch reads them in place: program ``(p * H + h, v-block, share)`` takes sequence ``p``'s
row of the cache (``rows[p]``), head ``h``, ``BV`` columns of ``d_v`` and one share of the slots, walks
``d_k`` in blocks of ``BK`` and sums ``g_n (q^T S_n)`` over its slots, skipping slots whose gate is exactly
zero (empty slots, whose scores are ``-inf``; the memories ``ssc`` did not select). The slots are shared out
so that a single row's read (B=1) still spreads over the GPU: share ``s`` of ``S`` takes slots
``s, s + S, s + 2S, ...``, with ``S`` set by the rows and the GPU, never by ``N``. Slots past a row's memories
(a captured step's cache holds slots ahead of need) have zero gates and add nothing to any share, and the
parts, as many whatever ``N``, are summed in a fixed order: the read is the same bits with or without them,
so a captured decode step replays the eager one exactly.

Everything is float32, as the cache is. :func:`routed_read_triton` is called by
:func:`~.mc_gated_delta.read_scored`, whose PyTorch path gathers and reads the same states.
"""

from __future__ import annotations

import torch

from .backend import tl, triton

__all__ = ["routed_read_triton"]

# d_k and d_v per tile: a (64, 64) float32 tile is 32 registers a thread at four warps.
_BK, _BV = 64, 64
# Programs per SM the slot shares aim at: the read is a stream of the cache, which wants every SM's loads.
_PROGRAMS_PER_SM = 4
_MAX_SHARES = 16


# Not specialised on the slots' count: a decoding cache grows by one state a segment, and a variant per count
# (Triton specialises 1 and multiples of 16) would compile anew as it grows.
@triton.jit(do_not_specialize=["N"])
def _routed_read_kernel(Q, G, S, ROWS, OUT, H, N, DK, DV, stride_r, stride_n, stride_h, stride_k,
                        BK: tl.constexpr, BV: tl.constexpr):
    """Program ``(p * H + h, v-block, share)``: ``sum_n G[p, h, n] (Q[p, h] S[ROWS[p], n, h])[v-block]`` over
    the share's slots ``share, share + S, ...``, into ``OUT[share, p, h, v-block]``."""
    ph = tl.program_id(0)
    vb = tl.program_id(1)
    share = tl.program_id(2)
    p = ph // H
    h = ph % H
    row = tl.load(ROWS + p).to(tl.int64)
    rv = vb * BV + tl.arange(0, BV)
    mv = rv < DV
    acc = tl.zeros((BV,), tl.float32)
    shares = tl.num_programs(2)
    # int64 offsets and steps: a large cache passes 2^31 elements
    slot = S + row * stride_r + h.to(tl.int64) * stride_h + share.to(tl.int64) * stride_n
    step = shares.to(tl.int64) * stride_n
    for n in range(share, N, shares):
        g = tl.load(G + ph.to(tl.int64) * N + n)
        base = slot
        slot += step
        if g != 0.0:
            read = tl.zeros((BV,), tl.float32)
            for k0 in range(0, DK, BK):
                rk = k0 + tl.arange(0, BK)
                mk = rk < DK
                q = tl.load(Q + ph.to(tl.int64) * DK + rk, mask=mk, other=0.0)
                tile = tl.load(base + rk[:, None] * stride_k + rv[None, :], mask=mk[:, None] & mv[None, :],
                               other=0.0)
                read += tl.sum(q[:, None] * tile, 0)
            acc += g * read
    tl.store(OUT + (share.to(tl.int64) * tl.num_programs(0) + ph) * DV + rv, acc, mask=mv)


def routed_read_triton(q: torch.Tensor, gates: torch.Tensor, states: torch.Tensor, rows: torch.Tensor,
                       shares: int | None = None) -> torch.Tensor:
    """``sum_n gates[p, h, n] * states[rows[p], n, h]^T q[p, h]``: ``q (P, H, d_k)``, ``gates (P, H, N)``,
    ``states (R, N, H, d_k, d_v)`` (last dimension contiguous), ``rows (P,)`` indices into ``R``; float32.
    Returns ``(P, H, d_v)``; no backward (a decoding read). ``shares``: programs a row's slots are dealt to
    (default: enough programs for the GPU's SMs, never a function of ``N``; one on the CPU)."""
    P, H, DK = q.shape
    N, DV = states.shape[1], states.shape[-1]
    if states.stride(-1) != 1:
        states = states.contiguous()
    q = q.to(torch.float32).contiguous()
    gates = gates.to(torch.float32).contiguous()
    rows = rows.to(torch.int64).contiguous()
    blocks = triton.cdiv(DV, _BV)
    if shares is None:
        shares = 1
        if q.is_cuda:
            sms = torch.cuda.get_device_properties(q.device).multi_processor_count
            shares = max(1, min(_MAX_SHARES, _PROGRAMS_PER_SM * sms // max(1, P * H * blocks)))
    if shares < 1:
        raise ValueError(f"shares must be >= 1, got {shares}")
    if not (P * H and N):
        return q.new_zeros(P, H, DV)
    out = torch.empty(shares, P, H, DV, dtype=torch.float32, device=q.device)  # every share is written
    _routed_read_kernel[(P * H, blocks, shares)](
        q, gates, states, rows, out, H, N, DK, DV, states.stride(0), states.stride(1),
        states.stride(2), states.stride(3), BK=min(_BK, max(16, triton.next_power_of_2(DK))),
        BV=min(_BV, max(16, triton.next_power_of_2(DV))), num_warps=4)
    # as many shares whatever the slots: one reduction of one shape, the same order every time
    return out.sum(0) if shares > 1 else out[0]
