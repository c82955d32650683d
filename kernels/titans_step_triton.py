"""Triton kernel for the weight-sized part of a deep memory's one-token step (:func:`~.titans.step_titans`).

A decode step updates every weight of the memory by a rank-1 gradient:
``S' = e S - th A B^T``, ``W' = a W + S'`` on live rows, and stores ``W`` as the chunk-start
weights on rows that start an inner chunk. In PyTorch that is about ten passes over each
weight-sized tensor (the outer product, the products, the sums, three selects); here it is one
pass that reads ``W, S`` and the chunk-start weights and writes their new values. At batch 1 a
decode step is a string of small kernels, and these passes were a fifth of Titans' step.

Weights are ``(G, M, N)`` float32 (``G = batch * heads``), factors ``A (G, M)``, ``B (G, N)``,
gates ``(G,)`` and the row flags ``live, at_start`` as ``(G,)`` int8.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .titans_chunk_triton import _tile

__all__ = ["step_update"]

_BM, _BN, _WARPS = 32, 128, 4


@triton.jit
def _step_update_kernel(W, S, C, A, BF, GA, GE, GT, LIVE, START, W_OUT, S_OUT, C_OUT, M, N,
                        BM: tl.constexpr, BN: tl.constexpr):
    g, rm, rn, mm, mn, mask, offs = _tile(M, N, BM, BN)
    w = tl.load(W + offs, mask=mask, other=0.0)
    s = tl.load(S + offs, mask=mask, other=0.0)
    c = tl.load(C + offs, mask=mask, other=0.0)
    grad = tl.load(A + g * M + rm, mask=mm, other=0.0)[:, None] * tl.load(BF + g * N + rn, mask=mn, other=0.0)[None, :]
    new_s = tl.load(GE + g) * s - tl.load(GT + g) * grad
    live = tl.load(LIVE + g) != 0
    starts = tl.load(START + g) != 0
    tl.store(S_OUT + offs, tl.where(live, new_s, s), mask=mask)
    tl.store(W_OUT + offs, tl.where(live, tl.load(GA + g) * w + new_s, w), mask=mask)
    tl.store(C_OUT + offs, tl.where(live & starts, w, c), mask=mask)


def step_update(W: torch.Tensor, S: torch.Tensor, C: torch.Tensor, A: torch.Tensor, Bf: torch.Tensor,
                a: torch.Tensor, e: torch.Tensor, th: torch.Tensor, live: torch.Tensor, at_start: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(W', S', C')`` for weights ``(B, H, M, N)``, factors ``A (B, H, M)``, ``Bf (B, H, N)``, gates
    ``(B, H)`` and row flags ``live, at_start (B,)``; see :func:`~.titans.step_update`."""
    B, H, M, N = W.shape
    flat = lambda x: x.reshape(B * H, *x.shape[2:]).contiguous()  # noqa: E731
    flag = lambda x: x[:, None].expand(B, H).reshape(-1).to(torch.int8)  # noqa: E731
    W_out, S_out, C_out = torch.empty_like(W), torch.empty_like(W), torch.empty_like(W)
    grid = (triton.cdiv(M, _BM) * triton.cdiv(N, _BN), B * H)
    _step_update_kernel[grid](flat(W), flat(S), flat(C), flat(A), flat(Bf), flat(a), flat(e), flat(th),
                              flag(live), flag(at_start), W_out, S_out, C_out, M, N, BM=_BM, BN=_BN,
                              num_warps=_WARPS)
    return W_out, S_out, C_out
