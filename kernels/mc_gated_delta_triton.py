"""Triton kernel of MoM's Memory Caching decode: the gated read of the cached states of the routed memories,
taken where they lie in the layer's cache.

A decoding token of a row visits ``S`` of the row's memories, and with a gated aggregation it reads every
state cached for each of them: ``sum_n g_n S_n^T q`` over the ``N`` slots. The cache holds the states of
all memories of all rows, ``(R, N, H, d_k, d_v)`` with ``R = batch * memories``; gathering the visited
memories' states first copies ``S / memories`` of the cache through HBM before the read goes through it
again. Here one launch reads them in place: program ``(p * H + h, v-block, split)`` takes sequence ``p``'s
row of the cache (``rows[p]``), head ``h``, ``BV`` columns of ``d_v`` and one share of the slots, walks
``d_k`` in blocks of ``BK`` and sums ``g_n (q^T S_n)`` over its slots, skipping slots whose gate is exactly
zero (empty slots, whose scores are ``-inf``; the memories ``ssc`` did not select). The slots are split so
that a single row's read (B=1) still spreads over the GPU; the shares are summed afterwards in a fixed
order, so a read repeats bit for bit (a captured decode step replays the eager one exactly).

Everything is float32, as the cache is. :func:`routed_read_triton` is called by
:func:`~.mc_gated_delta.read_scored`, whose PyTorch path gathers and reads the same states.
"""

from __future__ import annotations

import torch

from .backend import tl, triton

__all__ = ["routed_read_triton"]

# d_k and d_v per tile: a (64, 64) float32 tile is 32 registers a thread at four warps.
_BK, _BV = 64, 64
# Programs per SM the slot split aims at: the read is a stream of the cache, which wants every SM's loads.
_PROGRAMS_PER_SM = 4


@triton.jit(do_not_specialize=["per_split"])
def _routed_read_kernel(Q, G, S, ROWS, OUT, H, N, DK, DV, per_split, stride_r, stride_n, stride_h, stride_k,
                        BK: tl.constexpr, BV: tl.constexpr):
    """Program ``(p * H + h, v-block, split)``: ``sum_n G[p, h, n] (Q[p, h] S[ROWS[p], n, h])[v-block]`` over
    slots ``split * per_split ..`` of the split, into ``OUT[split, p, h, v-block]``."""
    ph = tl.program_id(0)
    vb = tl.program_id(1)
    split = tl.program_id(2)
    p = ph // H
    h = ph % H
    row = tl.load(ROWS + p).to(tl.int64)
    rv = vb * BV + tl.arange(0, BV)
    mv = rv < DV
    acc = tl.zeros((BV,), tl.float32)
    first = split * per_split
    last = tl.minimum(first + per_split, N)
    slot = S + row * stride_r + h.to(tl.int64) * stride_h + first.to(tl.int64) * stride_n  # int64: a large cache
    for n in range(first, last):
        g = tl.load(G + ph.to(tl.int64) * N + n)
        base = slot
        slot += stride_n
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
    tl.store(OUT + (split.to(tl.int64) * tl.num_programs(0) + ph) * DV + rv, acc, mask=mv)


def routed_read_triton(q: torch.Tensor, gates: torch.Tensor, states: torch.Tensor, rows: torch.Tensor,
                       splits: int | None = None) -> torch.Tensor:
    """``sum_n gates[p, h, n] * states[rows[p], n, h]^T q[p, h]``: ``q (P, H, d_k)``, ``gates (P, H, N)``,
    ``states (R, N, H, d_k, d_v)`` (last dimension contiguous), ``rows (P,)`` indices into ``R``; float32.
    Returns ``(P, H, d_v)``; no backward (a decoding read). ``splits``: shares of the slots (default: enough
    programs for the GPU's SMs; one on the CPU)."""
    P, H, DK = q.shape
    N, DV = states.shape[1], states.shape[-1]
    if states.stride(-1) != 1:
        states = states.contiguous()
    q = q.to(torch.float32).contiguous()
    gates = gates.to(torch.float32).contiguous()
    rows = rows.to(torch.int64).contiguous()
    blocks = triton.cdiv(DV, _BV)
    if splits is None and q.is_cuda and N:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        splits = max(1, min(N, _PROGRAMS_PER_SM * sms // max(1, P * H * blocks)))
    per_split = max(1, triton.cdiv(N, splits or 1))
    splits = max(1, triton.cdiv(N, per_split))
    out = torch.empty(splits, P, H, DV, dtype=torch.float32, device=q.device)
    if P * H:
        _routed_read_kernel[(P * H, blocks, splits)](
            q, gates, states, rows, out, H, N, DK, DV, per_split, states.stride(0), states.stride(1),
            states.stride(2), states.stride(3), BK=min(_BK, max(16, triton.next_power_of_2(DK))),
            BV=min(_BV, max(16, triton.next_power_of_2(DV))), num_warps=4)
    return out.sum(0) if splits > 1 else out[0]
