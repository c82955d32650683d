"""Triton kernel of a decode step's segment-end write: a new memory copied into its cache slot only where a row
closes a segment.

A graphed decode step of a Memory Caching model (MC-Titans, MC-Atlas, MoM with a gated aggregation) holds its cache
in the graph's own buffers and writes the online memory into slot ``index[r]`` of each row ``r`` that closes a
segment. A captured step cannot branch on the host, so in PyTorch that write runs every step as a gather of each
row's slot, a ``where`` and an ``index_put``: three passes over one memory a row although a segment closes once in
``segment_size`` steps. Here program ``(row, block)`` reads ``rows[row]`` and returns at once where the row closes
nothing; a closing row's programs copy its memory into the slot. A step that closes nothing moves no memory.

:func:`write_slots_triton` is called by :func:`~.memory_caching.write_slots_`, whose PyTorch path writes the same
values.
"""

from __future__ import annotations

import torch

from .backend import tl, triton

__all__ = ["write_slots_triton"]

_BLOCK = 2048


# Not specialised on the slots' count: a decoding cache grows by one memory a segment, and a variant per count would
# compile anew as it grows.
@triton.jit(do_not_specialize=["N", "s_row"])
def _write_kernel(CACHE, VALUES, ROWS, INDEX, N, E, s_row, s_slot, BLOCK: tl.constexpr):
    """Program ``(row, block)``: where ``ROWS[row]``, elements ``block * BLOCK ...`` of ``VALUES[row]`` into
    ``CACHE[row, INDEX[row]]`` (clamped to the slots)."""
    r = tl.program_id(0).to(tl.int64)
    if tl.load(ROWS + r) == 0:  # the row closes no segment: its slots keep what they hold
        return
    n = tl.maximum(tl.minimum(tl.load(INDEX + r), N - 1), 0)
    e = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = e < E
    x = tl.load(VALUES + r * E + e, mask=m)
    tl.store(CACHE + r * s_row + n * s_slot + e, x.to(CACHE.dtype.element_ty), mask=m)


def write_slots_triton(cache: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, index: torch.Tensor) -> None:
    """``cache[r, index[r]] = values[r]`` (in ``cache``'s dtype) for every row ``r`` with ``rows[r]``, in place.

    ``cache`` ``(R, N, *inner)`` with each slot contiguous, ``values`` ``(R, *inner)`` apart from it (rows are
    written in any order), ``rows`` ``(R,)`` bool, ``index`` ``(R,)`` integer, clamped to ``0 .. N - 1``. Nothing
    is read back to the host: the step a CUDA graph captures is the step it replays."""
    R, N = cache.shape[:2]
    inner = cache.shape[2:]
    if values.shape != (R, *inner):
        raise ValueError(f"values must be {(R, *inner)} for a cache of {tuple(cache.shape)}, got {tuple(values.shape)}")
    if rows.shape != (R,) or index.shape != (R,) or rows.dtype != torch.bool:
        raise ValueError(f"rows (bool) and index must be ({R},), got {tuple(rows.shape)} {rows.dtype} and "
                         f"{tuple(index.shape)}")
    if N == 0 or R == 0:
        return
    E = cache[0, 0].numel()
    if cache.stride(1) < E or not cache[0, 0].is_contiguous():
        raise ValueError("each slot of the cache must be contiguous")
    values = values.contiguous()
    grid = (R, triton.cdiv(E, _BLOCK))
    flags = rows.contiguous().view(torch.uint8)
    _write_kernel[grid](cache, values, flags, index.long().contiguous(), N, E, cache.stride(0), cache.stride(1),
                        BLOCK=_BLOCK, num_warps=4)
