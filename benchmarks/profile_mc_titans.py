"""Where an MC-Titans layer's training step spends its time: wall time against the GPU's busy time.

``python benchmarks/profile_mc_titans.py`` on the GPU machine (cwd ``benchmarks/``): the
``bench_layers.py`` layer (grm, segments of 256, 4 heads x 256, MLP x4, chunk 64, bf16) at
16K tokens, T=2048 (B=8) and T=8192 (B=2). A wall time well above the busy time means the
host's per-segment work, not the GPU, sets the pace. Prints the kernels by CUDA time.
"""

from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile

import bench_layers


def main():
    for T in (2048, 8192):
        B = 16384 // T
        layer = bench_layers.titans_layer(256).to("cuda", torch.bfloat16)
        x = torch.randn(B, T, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)

        def step():
            out = layer(x)
            (out[0] if isinstance(out, tuple) else out).float().sum().backward()

        for _ in range(2):
            step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        busy = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
        print(f"MC grm T={T}: wall {wall:.1f} ms, GPU busy {busy:.1f} ms")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=50))


if __name__ == "__main__":
    main()
