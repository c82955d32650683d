"""Sums over each token's entries in a routed, packed layout (MoM's output combine and token gathers).

A routed layout holds every token once per memory it visits. ``slot_entries``
``(N, S)`` names each token's entries (rows of a packed ``(P, D)`` tensor), with
``P`` marking an empty slot (a padded token). :func:`slot_sum` gives each token
the sum of its entries, optionally weighted, summed in float32::

    out[t] = sum_s weight[e] * y[e]     (e = slot_entries[t, s] < P)

Every token reads its own entries (a gather, no scatter-add): no atomics, and the
sum's order (hence its rounding) does not depend on the launch. Its backward
needs each entry's token, ``token_index`` ``(P,)``:
``dy[e] = weight[e] * dout[token[e]]`` and ``dweight[e] = y[e] . dout[token[e]]``.

On CUDA one Triton kernel runs each direction; elsewhere, the same sums in
PyTorch (one ``index_select`` per slot).
"""

from __future__ import annotations

import torch

from .backend import resolve_backend, tl, triton


__all__ = ["slot_sum"]


def _sum_torch(y: torch.Tensor, slot_entries: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    P = y.shape[0]
    dtype = torch.promote_types(y.dtype, torch.float32)
    total = y.new_zeros(slot_entries.shape[0], y.shape[1], dtype=dtype)
    if P == 0:  # no entries: every slot is empty
        return total
    for s in range(slot_entries.shape[1]):  # in slot order, as the kernel sums
        entry = slot_entries[:, s]
        present = entry < P
        entry = entry.clamp(max=P - 1)
        scale = present.to(dtype) if weight is None else torch.where(present, weight.to(dtype)[entry], 0.0)
        total = total + y.index_select(0, entry).to(dtype) * scale[:, None]
    return total


def _entry_grads_torch(y, weight, token_index, grad):
    picked = grad.index_select(0, token_index).to(torch.promote_types(grad.dtype, torch.float32))
    dweight = (picked * y.to(picked.dtype)).sum(-1)
    return picked * weight.to(picked.dtype)[:, None], dweight


@triton.jit
def _slot_sum_kernel(Y, ENTRIES, WEIGHT, OUT, N, P, D, S: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                     BN: tl.constexpr, BD: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    live = rows < N
    total = tl.zeros([BN, BD], dtype=tl.float32)
    for s in tl.static_range(S):  # in slot order, as the PyTorch path sums
        entry = tl.load(ENTRIES + rows.to(tl.int64) * S + s, mask=live, other=P)
        present = entry < P
        y = tl.load(Y + entry[:, None] * D + cols[None, :], mask=present[:, None] & (cols[None, :] < D),
                    other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            y = y * tl.load(WEIGHT + entry, mask=present, other=0.0).to(tl.float32)[:, None]
        total += y
    tl.store(OUT + rows.to(tl.int64)[:, None] * D + cols[None, :], total.to(OUT.dtype.element_ty),
             mask=live[:, None] & (cols[None, :] < D))

@triton.jit
def _entry_grads_kernel(Y, WEIGHT, TOKEN, GRAD, DY, DWEIGHT, P, D, BP: tl.constexpr, BD: tl.constexpr):
    """``dy[e] = weight[e] * grad[token[e]]`` and ``dweight[e] = y[e] . grad[token[e]]`` for a block of entries."""
    entries = tl.program_id(0) * BP + tl.arange(0, BP)
    live = entries < P
    token = tl.load(TOKEN + entries, mask=live, other=0).to(tl.int64)
    w = tl.load(WEIGHT + entries, mask=live, other=0.0).to(tl.float32)
    dot = tl.zeros([BP], dtype=tl.float32)
    for d0 in range(0, D, BD):
        cols = d0 + tl.arange(0, BD)
        m = live[:, None] & (cols[None, :] < D)
        g = tl.load(GRAD + token[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
        y = tl.load(Y + entries.to(tl.int64)[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(DY + entries.to(tl.int64)[:, None] * D + cols[None, :], (g * w[:, None]).to(DY.dtype.element_ty),
                 mask=m)
        dot += tl.sum(g * y, axis=1)
    tl.store(DWEIGHT + entries, dot, mask=live)


def _sum_triton(y, slot_entries, weight, out_dtype):
    N, S = slot_entries.shape
    P, D = y.shape
    out = torch.empty(N, D, dtype=out_dtype, device=y.device)
    BN, BD = 16, min(256, max(16, triton.next_power_of_2(D)))
    _slot_sum_kernel[(triton.cdiv(N, BN), triton.cdiv(D, BD))](
        y, slot_entries, weight if weight is not None else y, out, N, P, D, S=S, HAS_WEIGHT=weight is not None,
        BN=BN, BD=BD, num_warps=4,
    )
    return out


def _entry_grads_triton(y, weight, token_index, grad, dy_dtype):
    P, D = y.shape
    dy = torch.empty(P, D, dtype=dy_dtype, device=y.device)
    dweight = torch.empty(P, dtype=torch.float32, device=y.device)
    BP, BD = 16, min(256, max(16, triton.next_power_of_2(D)))
    _entry_grads_kernel[(triton.cdiv(P, BP),)](y, weight, token_index, grad, dy, dweight, P, D, BP=BP, BD=BD,
                                               num_warps=4)
    return dy, dweight


def _use_triton(y: torch.Tensor) -> bool:
    return resolve_backend(y, has_triton_impl=y.dtype != torch.float64) == "triton"


class _SlotSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, slot_entries, weight, token_index, out_dtype):
        ctx.save_for_backward(y, weight, token_index)
        return _slot_sum(y, slot_entries, weight, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        y, weight, token_index = ctx.saved_tensors
        grad = grad.contiguous()
        if _use_triton(y) and y.shape[0] > 0:
            dy, dweight = _entry_grads_triton(y, weight, token_index, grad, y.dtype)
        else:
            dy, dweight = _entry_grads_torch(y, weight, token_index, grad)
        return dy.to(y.dtype), None, dweight.to(weight.dtype), None, None


def _slot_sum(y, slot_entries, weight, out_dtype):
    if _use_triton(y) and slot_entries.numel() > 0:
        return _sum_triton(y, slot_entries.contiguous(), None if weight is None else weight.contiguous(), out_dtype)
    return _sum_torch(y, slot_entries, weight).to(out_dtype)


def slot_sum(
    y: torch.Tensor,
    slot_entries: torch.Tensor,
    weight: torch.Tensor | None = None,
    token_index: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Each token's (weighted) sum over its entries: ``y`` ``(P, D)`` -> ``(N, D)`` in ``out_dtype``
    (default ``y``'s dtype), summed in float32 at least; zero for a token with no entry.

    With ``weight`` ``(P,)`` the sum is differentiable in ``y`` and ``weight`` and needs ``token_index``
    ``(P,)``, each entry's token; without, it is a plain function (the backward of a token gather).
    """
    y = y.contiguous()
    out_dtype = y.dtype if out_dtype is None else out_dtype
    if weight is None:
        return _slot_sum(y, slot_entries, None, out_dtype)
    if token_index is None:
        raise ValueError("a weighted slot_sum needs token_index, the token of each entry, for its backward")
    return _SlotSum.apply(y, slot_entries, weight, token_index, out_dtype)
