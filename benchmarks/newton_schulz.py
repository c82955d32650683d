"""Newton-Schulz (Muon's orthogonalisation) on a chunk's worth of per-token momenta, beside the GPU's
measured bf16 matmul throughput (GPU).

Atlas' 340M layer (16 heads x 64, MLP x4) gives every token two 64 x 256 momenta per head; one chunk
of 64 tokens at B=8 is 8,192 matrices. FLOPs are counted as the paper's iteration spends them
(``X X^T``, ``A^2``, ``(bA + cA^2) X`` for 5 steps: 23.6 MFLOP per matrix forward) whatever the
implementation does, and forward+backward as three times the forward. Each dtype runs on the PyTorch
path (batched matmuls) and the Triton kernels (one program per matrix). Prints one JSON line per
measurement. ``python benchmarks/newton_schulz.py``.
"""

from __future__ import annotations

import json
import time

import torch

from mnemo.kernels.backend import use_backend
from mnemo.kernels.newton_schulz import newton_schulz


def timed(fn, warmup=3, iters=20):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def paper_flops(rows: int, cols: int, steps: int = 5) -> float:
    """Forward FLOPs of the iteration on one ``rows x cols`` matrix (``rows <= cols``)."""
    return steps * (2 * rows * rows * cols + 2 * rows**3 + 2 * rows * rows * cols)


def main():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    peak = 2 * 8192**3 / timed(lambda: a @ a) / 1e12
    print(json.dumps({"bf16_matmul_tflops": round(peak, 1)}), flush=True)
    count, rows, cols = 8192, 64, 256
    for dtype, tf32 in ((torch.float32, False), (torch.float32, True), (torch.bfloat16, False)):
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        G = torch.randn(count, rows, cols, device="cuda", dtype=dtype, requires_grad=True)
        probe = torch.randn_like(G)
        for backend in ("torch", "triton"):
            with use_backend(backend):
                fwd = timed(lambda: newton_schulz(G, 5))

                def step():
                    G.grad = None
                    newton_schulz(G, 5).backward(probe)

                both = timed(step)
            work = paper_flops(rows, cols) * count
            print(json.dumps({"dtype": str(dtype).split(".")[-1] + ("+tf32" if tf32 else ""), "backend": backend,
                              "matrices": count, "fwd_ms": round(fwd * 1e3, 3), "fwd_bwd_ms": round(both * 1e3, 3),
                              "fwd_tflops": round(work / fwd / 1e12, 1),
                              "fwd_bwd_tflops": round(3 * work / both / 1e12, 1),
                              "fwd_bwd_of_peak": round(3 * work / both / 1e12 / peak, 3)}), flush=True)
    torch.set_float32_matmul_precision("highest")


if __name__ == "__main__":
    main()
