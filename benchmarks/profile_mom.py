"""Where one MoM layer's forward+backward spends its GPU time (torch.profiler), bf16, hidden 1024.

``python benchmarks/profile_mom.py`` on the GPU machine prints the kernels by total
CUDA time for the layer (B=8, T=2048) and for the gated delta rule alone (48K tokens);
``PART=decode`` prints them for one decode step of the 4-layer model of
``benchmarks/mom.py`` at batch 1 and 16, with the number of kernels a step launches.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from mnemo import MoMConfig
from mnemo.kernels import chunk_gated_delta
from mnemo.modeling.mom_layer import MoMMemoryLayer


def show(fn, title, rows=45):
    import time

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    # kernel time below wall time is the GPU waiting for the host (launches, synchronisations)
    print(f"=== {title}: {len(kernels)} kernels, {sum(e.device_time for e in kernels) / 1e3:.2f} ms of kernel time "
          f"in {wall * 1e3:.2f} ms of wall time (profiled)")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=60))


def decode():
    from mnemo import MnemoCache, MoMForCausalLM

    config = MoMConfig(hidden_size=1024, num_heads=4, head_dim=256, num_memories=4, topk=2, shared_memory=True,
                       num_hidden_layers=4, vocab_size=32000)
    model = MoMForCausalLM(config).cuda().bfloat16().eval()
    for B in (1, 16):
        cache = MnemoCache(4)
        with torch.no_grad():
            model(torch.randint(0, 32000, (B, 1024), device="cuda"), past_key_values=cache, use_cache=True)
            nxt = torch.randint(0, 32000, (B, 1), device="cuda")
            step = lambda: model(nxt, past_key_values=cache, use_cache=True)  # noqa: E731
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        print(f"=== decode step, 4 layers, B={B}: {len(kernels)} kernels, "
              f"{sum(e.device_time for e in kernels) / 1e3:.3f} ms of kernel time")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60))


def main():
    import os

    if os.environ.get("PART") == "decode":
        return decode()
    layer = MoMMemoryLayer(MoMConfig(hidden_size=1024, num_heads=4, head_dim=256), 0).cuda().bfloat16()
    x = torch.randn(8, 2048, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    show(lambda: layer(x)[0].float().sum().backward(), "MoM layer fwd+bwd, B=8 T=2048")
    q, k, v = (torch.randn(1, 49152, 4, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = (-torch.rand(1, 49152, 4, device="cuda")).requires_grad_()
    beta = torch.rand(1, 49152, 4, device="cuda").requires_grad_()
    cu = torch.arange(25, device="cuda") * 2048
    show(lambda: chunk_gated_delta(q, k, v, g, beta, cu_seqlens=cu)[0].float().sum().backward(),
         "chunk_gated_delta fwd+bwd, 24 x 2048 tokens")


if __name__ == "__main__":
    main()
