"""Tile sweep of the deep memories' final-update kernels (``kernels/titans_chunk_triton.py``).

``python benchmarks/sweep_titans_update.py`` on the GPU machine: the update and its backward
at 32 x (256 x 1024) and 32 x (1024 x 256) float32 weights (4 heads x 256, MLP x4, batch 8),
64 factor rows (three uses in the backward), TF32 products, for every tile shape, warp count
and stage count; beside the PyTorch versions and a plain copy of ``W, S`` (the bandwidth floor).
"""

from __future__ import annotations

import itertools

import torch
from bench_layers import bench

import mnemo.kernels.titans_chunk_triton as K
from mnemo.kernels.titans_chunk import _final_update_backward_torch, _final_update_torch


def timed(fn) -> float:
    """Microseconds per call (``bench_layers.bench`` reports milliseconds)."""
    return bench(fn, warmup=3, iters=20) * 1e3


def main():
    torch.set_float32_matmul_precision("high")
    G, rows = 32, 64
    r = lambda *s: torch.randn(*s, device="cuda")  # noqa: E731
    for M, N in ((256, 1024), (1024, 256)):
        W, S, dW, dS, out_w, out_s = (r(G, M, N) for _ in range(6))
        a, b, sa = (torch.rand(G, device="cuda") for _ in range(3))
        U, Us, Bf = r(G, rows, M), r(G, rows, M), r(G, rows, N)
        uses = [(r(G, rows, M), r(G, rows, N)) for _ in range(3)]
        LW, RW = torch.cat([u for u, _ in uses], 1), torch.cat([v for _, v in uses], 1)
        print(M, N, "torch: update %.0f us, backward %.0f us; copy of W, S %.0f us" % (
            timed(lambda: _final_update_torch(W, S, a, b, sa, U, Us, Bf)),
            timed(lambda: _final_update_backward_torch(W, S, dW, dS, a, b, sa, uses, uses[:1])),
            timed(lambda: (W.clone(), S.clone()))))
        for BM, BN, BK, warps, stages in itertools.product((32, 64, 128), (64, 128), (32, 64), (4, 8), (1, 2)):
            grid = (triton_cdiv(M, BM) * triton_cdiv(N, BN), G)
            part = W.new_zeros(G, grid[0], 3)
            config = dict(BM=BM, BN=BN, BK=BK, PRECISION="tf32", num_warps=warps, num_stages=stages)
            fwd = timed(lambda: K._final_update_kernel[grid](W, S, out_w, out_s, U, Us, Bf, a, b, sa, M, N, rows,
                                                             HAS_S=True, **config))
            bwd = timed(lambda: K._final_update_backward_kernel[grid](
                W, S, dW, dS, out_w, out_s, LW, RW, *uses[0], a, b, sa, part, M, N, 3 * rows, rows, HAS_S=True,
                **config))
            print(M, N, BM, BN, BK, warps, stages, "update %.0f us, backward %.0f us" % (fwd, bwd), flush=True)


def triton_cdiv(x: int, y: int) -> int:
    return -(-x // y)


if __name__ == "__main__":
    main()
