"""Triton kernels for the weight-sized ends of a deep memory's chunk (:mod:`.titans_chunk`).

A chunk reads its weights through cuBLAS matmuls of ``(chunk, width)`` rows; what is
left weight-sized is its final update and that update's backward:

- :func:`final_update`: ``W' = a W + b S + U_w^T B``, ``S' = s S + U_s^T B`` per
  ``(batch, head)``, the rank-``K`` products in the same tile as the gated sums, so
  ``W, S`` are read once and ``W', S'`` written once;
- :func:`step_update`: one token's ``W' = r W + S'``, ``S' = m S - lr A B^T`` (decoding, and the steps of
  logarithmic segments), with its backward;
- :func:`final_update_backward`: ``dW = a dW' + L_w^T R_w`` and
  ``dS = b dW' + s dS' + L_s^T R_s`` (``L, R``: the stacked factors of every use of
  the weight in the chunk) together with the gates' gradients ``<dW', W>``,
  ``<dW', S>``, ``<dS', S>``, as per-tile partial sums: one pass over four
  weight-sized tensors where autograd made a product tensor per gate.

Weights are ``(G, M, N)`` float32 (``G = batch * heads``), factors ``(G, K, M)``
and ``(G, K, N)``, gates ``(G,)``. Products are TF32 where the caller's float32
matmul precision allows it (the memories' policy for bf16/fp16 problems, see
:func:`~.chunk_loop.tf32_wanted`), exact float32 otherwise.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .backend import tl, triton


__all__ = [
    "final_update",
    "final_update_backward",
    "final_update_backward_parts",
    "final_update_backward_stacked",
    "step_update",
]


# 32 x 128 tiles, two stages, four warps: the fastest tiling of those tried for the update and its backward,
# ahead of 64 x 64 tiles with the default three stages (benchmarks/RESULTS.md).
_BM, _BN, _BK, _WARPS, _STAGES = 32, 128, 64, 4, 2


def _precision() -> str:
    return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"


@triton.jit
def _rank_product(acc, L, R, g, K, M, N, rm, rn, mm, mn, BK: tl.constexpr, PRECISION: tl.constexpr):
    """``acc + L[g]^T R[g]`` on the tile ``(rm, rn)``: ``L (G, K, M)`` is read transposed, tile by tile."""
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        mk = rk < K
        lt = tl.load(L + g * K * M + rk[None, :] * M + rm[:, None], mask=mk[None, :] & mm[:, None], other=0.0)
        r = tl.load(R + g * K * N + rk[:, None] * N + rn[None, :], mask=mk[:, None] & mn[None, :], other=0.0)
        acc += tl.dot(lt, r, input_precision=PRECISION)
    return acc


@triton.jit
def _tile(M, N, BM: tl.constexpr, BN: tl.constexpr):
    """This program's weight, its ``BM x BN`` tile (rows, columns, their masks) and the tile's offsets."""
    g = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0)
    n_tiles_n = tl.cdiv(N, BN)
    rm = (t // n_tiles_n) * BM + tl.arange(0, BM)
    rn = (t % n_tiles_n) * BN + tl.arange(0, BN)
    mm, mn = rm < M, rn < N
    return g, rm, rn, mm, mn, mm[:, None] & mn[None, :], g * M * N + rm[:, None] * N + rn[None, :]


@triton.jit
def _final_update_kernel(W, S, W_OUT, S_OUT, UW, US, BF, A, B, SA, M, N, K,
                         HAS_S: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         PRECISION: tl.constexpr):
    g, rm, rn, mm, mn, mask, offs = _tile(M, N, BM, BN)
    acc = _rank_product(tl.zeros((BM, BN), tl.float32), UW, BF, g, K, M, N, rm, rn, mm, mn, BK, PRECISION)
    w = tl.load(W + offs, mask=mask, other=0.0)
    out = tl.load(A + g) * w + acc
    if HAS_S:
        s = tl.load(S + offs, mask=mask, other=0.0)
        out += tl.load(B + g) * s
        acc_s = _rank_product(tl.zeros((BM, BN), tl.float32), US, BF, g, K, M, N, rm, rn, mm, mn, BK, PRECISION)
        tl.store(S_OUT + offs, tl.load(SA + g) * s + acc_s, mask=mask)
    tl.store(W_OUT + offs, out, mask=mask)


@triton.jit
def _final_update_backward_kernel(W, S, DWN, DSN, DW, DS, LW, RW, LS, RS, A, B, SA, PART, M, N, KW, KS,
                                  GATE_STRIDE, HAS_S: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                                  BK: tl.constexpr, PRECISION: tl.constexpr):
    # ``A`` and ``B`` are read at ``g * GATE_STRIDE``: a chunk's last gates are a column of its ``(G, C)``
    # gates, read in place (a contiguous copy of each was two more launches per chunk).
    g, rm, rn, mm, mn, mask, offs = _tile(M, N, BM, BN)
    part = PART + (g * tl.num_programs(0) + tl.program_id(0)) * 3
    dwn = tl.load(DWN + offs, mask=mask, other=0.0)
    w = tl.load(W + offs, mask=mask, other=0.0)
    acc = _rank_product(tl.zeros((BM, BN), tl.float32), LW, RW, g, KW, M, N, rm, rn, mm, mn, BK, PRECISION)
    tl.store(DW + offs, tl.load(A + g * GATE_STRIDE) * dwn + acc, mask=mask)
    tl.store(part, tl.sum(tl.sum(dwn * w, 1), 0))
    if HAS_S:
        dsn = tl.load(DSN + offs, mask=mask, other=0.0)
        s = tl.load(S + offs, mask=mask, other=0.0)
        acc_s = _rank_product(tl.zeros((BM, BN), tl.float32), LS, RS, g, KS, M, N, rm, rn, mm, mn, BK, PRECISION)
        tl.store(DS + offs, tl.load(B + g * GATE_STRIDE) * dwn + tl.load(SA + g) * dsn + acc_s, mask=mask)
        tl.store(part + 1, tl.sum(tl.sum(dwn * s, 1), 0))
        tl.store(part + 2, tl.sum(tl.sum(dsn * s, 1), 0))


def _grid(M: int, N: int, G: int) -> tuple[int, int]:
    return (triton.cdiv(M, _BM) * triton.cdiv(N, _BN), G)


def _flat(x: torch.Tensor | None, lead: int) -> torch.Tensor | None:
    return None if x is None else x.reshape(-1, *x.shape[lead:]).contiguous()


def final_update(W: torch.Tensor, S: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor | None,
                 sa: torch.Tensor | None, U_w: torch.Tensor, U_s: torch.Tensor | None, Bf: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(W', S')`` for weights ``(..., M, N)``, gates ``(...)``, factors ``U (..., K, M)``, ``Bf (..., K, N)``."""
    lead, (M, N), K = W.shape[:-2], W.shape[-2:], Bf.shape[-2]
    Wf, Sf = _flat(W, -2), _flat(S, -2)
    W_out = torch.empty_like(Wf)
    S_out = torch.empty_like(Wf) if S is not None else W_out
    has_s = S is not None
    gates = [_flat(x, len(lead)) if x is not None else _flat(a, len(lead)) for x in (a, b, sa)]
    _final_update_kernel[_grid(M, N, Wf.shape[0])](
        Wf, Sf if has_s else Wf, W_out, S_out, _flat(U_w, -2), _flat(U_s, -2) if has_s else _flat(U_w, -2),
        _flat(Bf, -2), *gates, M, N, K, HAS_S=has_s, BM=_BM, BN=_BN, BK=_BK, PRECISION=_precision(),
        num_warps=_WARPS, num_stages=_STAGES)
    return W_out.view(W.shape), (S_out.view(W.shape) if has_s else None)


def _stack(uses: list[tuple[torch.Tensor, torch.Tensor]], G: int, M: int, N: int, like: torch.Tensor):
    if not uses:
        return like.new_zeros(G, 0, M), like.new_zeros(G, 0, N), 0
    L = torch.cat([left for left, _ in uses], -2)
    R = torch.cat([right for _, right in uses], -2)
    return _flat(L, -2), _flat(R, -2), L.shape[-2]


def final_update_backward(W: torch.Tensor, S: torch.Tensor | None, dW_new: torch.Tensor, dS_new: torch.Tensor | None,
                          a: torch.Tensor, b: torch.Tensor | None, sa: torch.Tensor | None,
                          uses_w: list[tuple[torch.Tensor, torch.Tensor]],
                          uses_s: list[tuple[torch.Tensor, torch.Tensor]]):
    """``(dW, dS, <dW', W>, <dW', S>, <dS', S>)`` (the last three ``(...)``, ``None`` without ``S``).

    ``uses_*`` are ``(L (..., K_i, M), R (..., K_i, N))`` pairs whose products ``L^T R`` add to the
    weight's gradient."""
    lead, (M, N) = W.shape[:-2], W.shape[-2:]
    Wf = _flat(W, -2)
    G = Wf.shape[0]
    flat = lambda x: None if x is None else _flat(x, len(lead))  # noqa: E731
    stacked_s = _stack(uses_s, G, M, N, Wf) if S is not None else None
    dW, dS, *dots = final_update_backward_stacked(
        Wf, _flat(S, -2), _flat(dW_new, -2), _flat(dS_new, -2), flat(a), flat(b), flat(sa),
        _stack(uses_w, G, M, N, Wf), stacked_s)
    if S is None:
        return dW.view(W.shape), None, dots[0].view(lead), None, None
    return dW.view(W.shape), dS.view(W.shape), *(x.view(lead) for x in dots)


def final_update_backward_stacked(W: torch.Tensor, S: torch.Tensor | None, dW_new: torch.Tensor,
                                  dS_new: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor | None,
                                  sa: torch.Tensor | None, uses_w: tuple[torch.Tensor, torch.Tensor, int],
                                  uses_s: tuple[torch.Tensor, torch.Tensor, int] | None):
    """:func:`final_update_backward` on contiguous ``(G, M, N)`` weights, ``(G,)`` gates and uses
    already stacked: ``(L (G, rows, M), R (G, rows, N), rows)`` (what a kernel wrote in place)."""
    dW, dS, part = final_update_backward_parts(W, S, dW_new, dS_new, a, b, sa, uses_w, uses_s)
    dots = part.sum(1)
    if S is None:
        return dW, None, dots[:, 0], None, None
    return dW, dS, dots[:, 0], dots[:, 1], dots[:, 2]


def final_update_backward_parts(W: torch.Tensor, S: torch.Tensor | None, dW_new: torch.Tensor,
                                dS_new: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor | None,
                                sa: torch.Tensor | None, uses_w: tuple[torch.Tensor, torch.Tensor, int],
                                uses_s: tuple[torch.Tensor, torch.Tensor, int] | None):
    """:func:`final_update_backward_stacked` with the gates' inner products left as per-tile partial sums
    ``(G, tiles, 3)`` (``<dW', W>, <dW', S>, <dS', S>``; only the first is written without ``S``), for a
    caller that sums them with others in one launch. ``a`` and ``b`` may be strided columns (``(G,)``
    views of ``(G, C)`` gates); ``sa`` is contiguous."""
    G, M, N = W.shape
    has_s = S is not None
    LW, RW, KW = uses_w
    LS, RS, KS = uses_s if has_s else (LW, RW, 0)
    dW = torch.empty_like(W)
    dS = torch.empty_like(W) if has_s else dW
    grid = _grid(M, N, G)
    part = W.new_empty(G, grid[0], 3)  # every program writes its own entries
    stride = a.stride(0)
    if has_s and b.stride(0) != stride or a.dim() != 1:
        raise ValueError(f"the gates a, b must be (G,) views with one stride, got {a.stride()} and "
                         f"{None if b is None else b.stride()}")
    sa = sa.contiguous() if has_s else a
    _final_update_backward_kernel[grid](
        W, S if has_s else W, dW_new, dS_new if has_s else W, dW, dS, LW, RW, LS, RS, a, b if has_s else a, sa,
        part, M, N, KW, KS, stride, HAS_S=has_s, BM=_BM, BN=_BN, BK=_BK, PRECISION=_precision(),
        num_warps=_WARPS, num_stages=_STAGES)
    return dW, (dS if has_s else None), part


# --------------------------------------------------------- A one-token step's weight-sized update


_BM, _BN, _WARPS = 32, 128, 4


@triton.jit
def _step_update_kernel(W, S, C, A, BF, RETENTION, MOMENTUM, LR, LIVE, START, W_OUT, S_OUT, C_OUT, M, N,
                        BM: tl.constexpr, BN: tl.constexpr):
    g, rm, rn, mm, mn, mask, offs = _tile(M, N, BM, BN)
    w = tl.load(W + offs, mask=mask, other=0.0)
    s = tl.load(S + offs, mask=mask, other=0.0)
    c = tl.load(C + offs, mask=mask, other=0.0)
    grad = tl.load(A + g * M + rm, mask=mm, other=0.0)[:, None] * tl.load(BF + g * N + rn, mask=mn, other=0.0)[None, :]
    new_s = tl.load(MOMENTUM + g) * s - tl.load(LR + g) * grad
    live = tl.load(LIVE + g) != 0
    starts = tl.load(START + g) != 0
    tl.store(S_OUT + offs, tl.where(live, new_s, s), mask=mask)
    tl.store(W_OUT + offs, tl.where(live, tl.load(RETENTION + g) * w + new_s, w), mask=mask)
    tl.store(C_OUT + offs, tl.where(live & starts, w, c), mask=mask)


@triton.jit
def _step_update_backward_kernel(W, S, A, BF, RETENTION, MOMENTUM, LR, LIVE, START, DW_NEW, DS_NEW, DC_NEW, DW, DS,
                                 DC, DA_PART, DB_PART, GATE_PART, M, N, BM: tl.constexpr, BN: tl.constexpr):
    g, rm, rn, mm, mn, mask, offs = _tile(M, N, BM, BN)
    t = tl.program_id(0)
    n_tiles_n, n_tiles = tl.cdiv(N, BN), tl.num_programs(0)
    dw_new = tl.load(DW_NEW + offs, mask=mask, other=0.0)
    ds_new = tl.load(DS_NEW + offs, mask=mask, other=0.0)
    dc_new = tl.load(DC_NEW + offs, mask=mask, other=0.0)
    live = tl.load(LIVE + g) != 0
    starts = tl.load(START + g) != 0
    retention, momentum, lr = tl.load(RETENTION + g), tl.load(MOMENTUM + g), tl.load(LR + g)
    # On a live row W' = r W + S' and S' = m S - lr A B^T: S' reaches the loss through both outputs.
    ds_total = tl.where(live, ds_new + dw_new, 0.0)
    kept_start = live & starts
    tl.store(DW + offs, tl.where(live, retention * dw_new, dw_new) + tl.where(kept_start, dc_new, 0.0), mask=mask)
    tl.store(DS + offs, tl.where(live, momentum * ds_total, ds_new), mask=mask)
    tl.store(DC + offs, tl.where(kept_start, 0.0, dc_new), mask=mask)
    w = tl.load(W + offs, mask=mask, other=0.0)
    s = tl.load(S + offs, mask=mask, other=0.0)
    a = tl.load(A + g * M + rm, mask=mm, other=0.0)
    b = tl.load(BF + g * N + rn, mask=mn, other=0.0)
    # Each tile's shares of the factors' and gates' gradients, summed over the tiles after the launch.
    tl.store(DA_PART + (g * n_tiles_n + t % n_tiles_n) * M + rm, -lr * tl.sum(ds_total * b[None, :], 1), mask=mm)
    tl.store(DB_PART + (g * tl.cdiv(M, BM) + t // n_tiles_n) * N + rn, -lr * tl.sum(ds_total * a[:, None], 0),
             mask=mn)
    gates = GATE_PART + (g * n_tiles + t) * 3
    tl.store(gates, tl.where(live, tl.sum(tl.sum(dw_new * w, 1), 0), 0.0))
    tl.store(gates + 1, tl.sum(tl.sum(ds_total * s, 1), 0))
    tl.store(gates + 2, -tl.sum(tl.sum(ds_total * (a[:, None] * b[None, :]), 1), 0))


class _StepUpdate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, W, S, C, A, Bf, retention, momentum, lr, live, at_start):
        B, H, M, N = W.shape
        flat = lambda x: x.reshape(B * H, *x.shape[2:]).contiguous()  # noqa: E731
        flag = lambda x: x[:, None].expand(B, H).reshape(-1).to(torch.int8).contiguous()  # noqa: E731
        tensors = [flat(x) for x in (W, S, A, Bf, retention, momentum, lr)] + [flag(live), flag(at_start)]
        ctx.save_for_backward(*tensors)
        Wf, Sf, Af, Bff, rf, mf, lf, live_f, start_f = tensors
        W_out, S_out, C_out = torch.empty_like(W), torch.empty_like(W), torch.empty_like(W)
        grid = (triton.cdiv(M, _BM) * triton.cdiv(N, _BN), B * H)
        _step_update_kernel[grid](Wf, Sf, flat(C), Af, Bff, rf, mf, lf, live_f, start_f, W_out, S_out, C_out, M, N,
                                  BM=_BM, BN=_BN, num_warps=_WARPS)
        return W_out, S_out, C_out

    @staticmethod
    @once_differentiable
    def backward(ctx, dW_new, dS_new, dC_new):
        Wf, Sf, Af, Bff, rf, mf, lf, live_f, start_f = ctx.saved_tensors
        G, M, N = Wf.shape
        lead = next(x for x in (dW_new, dS_new, dC_new) if x is not None).shape[:2]
        grad = lambda x: Wf.new_zeros(G, M, N) if x is None else x.reshape(G, M, N).contiguous()  # noqa: E731
        dW_new, dS_new, dC_new = grad(dW_new), grad(dS_new), grad(dC_new)
        dW, dS, dC = torch.empty_like(Wf), torch.empty_like(Wf), torch.empty_like(Wf)
        tiles_m, tiles_n = triton.cdiv(M, _BM), triton.cdiv(N, _BN)
        dA_part, dB_part = Wf.new_empty(G, tiles_n, M), Wf.new_empty(G, tiles_m, N)
        gate_part = Wf.new_empty(G, tiles_m * tiles_n, 3)
        _step_update_backward_kernel[(tiles_m * tiles_n, G)](
            Wf, Sf, Af, Bff, rf, mf, lf, live_f, start_f, dW_new, dS_new, dC_new, dW, dS, dC, dA_part, dB_part,
            gate_part, M, N, BM=_BM, BN=_BN, num_warps=_WARPS)
        gates = gate_part.sum(1)
        weights = (x.view(*lead, M, N) for x in (dW, dS, dC))
        return (*weights, dA_part.sum(1).view(*lead, M), dB_part.sum(1).view(*lead, N),
                *(gates[:, i].view(lead) for i in range(3)), None, None)


def step_update(W: torch.Tensor, S: torch.Tensor, C: torch.Tensor, A: torch.Tensor, Bf: torch.Tensor,
                retention: torch.Tensor, momentum: torch.Tensor, lr: torch.Tensor, live: torch.Tensor,
                at_start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(W', S', C')`` for weights ``(B, H, M, N)``, factors ``A (B, H, M)``, ``Bf (B, H, N)``, gates
    ``(B, H)`` and row flags ``live, at_start (B,)``; see :func:`~.titans.step_update`. Differentiable in every
    tensor but the flags: the backward is one pass over the weight-sized tensors, its factors' and gates'
    gradients summed over tiles after it (the steps of logarithmic segments in training)."""
    return _StepUpdate.apply(W, S, C, A, Bf, retention, momentum, lr, live, at_start)
