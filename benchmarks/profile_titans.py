"""Where the Titans memory's chunked forward+backward spends its GPU time (torch.profiler).

``python benchmarks/profile_titans.py`` on the GPU machine: ``chunk_titans`` alone at the
layer shape of ``bench_layers.py`` (4 heads x 256, MLP memory x4, chunk 64, bf16 inputs,
float32 memory), 16K tokens at T=2048 (B=8) and T=8192 (B=2): wall time of the forward
and of forward+backward, peak memory, and the kernels by total CUDA time.
``TF32=1`` lets float32 matmuls use TF32 tensor cores.
"""

from __future__ import annotations

import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from mnemo.kernels.titans import TitansMemorySpec, TitansState, chunk_titans

H, D = 4, 256


def main():
    if os.environ.get("TF32") == "1":
        torch.set_float32_matmul_precision("high")
    torch.manual_seed(0)
    spec = TitansMemorySpec(depth=2, d_k=D, d_v=D, expansion=4)
    for B, T in ((8, 2048), (2, 8192)):
        init = {n: (torch.randn(H, *s, device="cuda") * 0.02).requires_grad_() for n, s in spec.shapes.items()}
        q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        alpha = torch.rand(B, T, H, device="cuda") * 0.1 + 0.9
        eta = torch.rand(B, T, H, device="cuda") * 0.5
        theta = torch.rand(B, T, H, device="cuda") * 0.1

        def forward():
            return chunk_titans(spec, q, k, v, alpha, eta, theta, TitansState.initial(init, B))[0]

        def train_step():
            forward().float().sum().backward()

        for fn, name in ((forward, "forward"), (train_step, "forward+backward")):
            for _ in range(2):
                fn()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            print(f"B={B} T={T} {name}: {(time.perf_counter() - start) / 3 * 1e3:.1f} ms", flush=True)
        torch.cuda.reset_peak_memory_stats()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            train_step()
            torch.cuda.synchronize()
        print(f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60))


if __name__ == "__main__":
    main()
