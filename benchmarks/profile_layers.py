"""Where a layer's forward+backward spends its time: host wall clock, GPU busy time, kernels by name.

``ONLY=titans_4x256,omeganet python benchmarks/profile_layers.py`` on the GPU machine profiles the
layers of ``bench_layers.py`` (picked by substring, as there) on the same inputs (hidden 1024, bf16,
16K tokens at ``LENGTHS``, default 2048 and 8192). For each: the step's wall time (median of a few),
the kernels' summed time and the GPU's busy time in one profiled step (their gap is overlap; a wall
time well above the busy time means the host set the pace), and the ``ROWS`` (default 25) kernels
with the most time, by count and mean; ``OPS=1`` adds the PyTorch ops by their kernels' time,
``GAPS=1`` the longest stretches of an idle GPU between kernels, ``CPU=1`` the host's calls by
their own time.
``TF32=1`` as in ``bench_layers.py``.
"""

from __future__ import annotations

import os
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from bench_layers import DEV, DT, LAYERS, TOKENS, D, bench
from mnemo.kernels.chunk_loop import release_graphs


def kernel_events(prof) -> list:
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def busy_us(events) -> float:
    """The union of the kernels' intervals: time the GPU ran anything."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    total, end = 0.0, float("-inf")
    for lo, hi in spans:
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


def profile_layer(name: str, B: int, T: int, rows: int) -> None:
    release_graphs()
    torch.cuda.empty_cache()
    layer = LAYERS[name]().to(DEV, DT)
    x = torch.randn(B, T, D, device=DEV, dtype=DT, requires_grad=True)

    def step():
        x.grad = None
        out = layer(x)
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()

    wall = bench(step, iters=3, repeats=3)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    events = kernel_events(prof)
    by_name: dict = defaultdict(lambda: [0, 0.0])
    for e in events:
        by_name[e.name][0] += 1
        by_name[e.name][1] += e.time_range.elapsed_us()
    total = sum(t for _, t in by_name.values())
    print(f"\n## {name}  B={B} T={T}: wall {wall:.2f} ms, kernels {total / 1e3:.2f} ms "
          f"({len(events)} launches), GPU busy {busy_us(events) / 1e3:.2f} ms", flush=True)
    print(f"| kernel | launches | ms | us each |\n|---|---|---|---|")
    for kname, (count, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:rows]:
        print(f"| {kname[:90]} | {count} | {t / 1e3:.2f} | {t / count:.1f} |")
    if os.environ.get("GAPS") == "1":  # where the GPU waited on the host, and between which kernels
        spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events)
        gaps, end, last = [], spans[0][0], ""
        for lo, hi, kname in spans:
            if lo > end:
                gaps.append((lo - end, end - spans[0][0], last, kname))
            if hi > end:
                end, last = hi, kname
        print(f"idle: {sum(g[0] for g in gaps) / 1e3:.2f} ms in {len(gaps)} gaps; the longest:")
        print("| gap us | at ms | after | before |\n|---|---|---|---|")
        for gap, at, after, before in sorted(gaps, reverse=True)[:rows]:
            print(f"| {gap:.0f} | {at / 1e3:.2f} | {after[:50]} | {before[:50]} |")
    if os.environ.get("CPU") == "1":  # the host's side: which calls take its time
        ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        print(f"host: {sum(e.self_cpu_time_total for e in ops) / 1e3:.2f} ms of self time\n"
              f"| call | calls | self ms on the host |\n|---|---|---|")
        for e in ops[:rows]:
            print(f"| {e.key[:80]} | {e.count} | {e.self_cpu_time_total / 1e3:.2f} |")
    if os.environ.get("OPS") == "1":  # the PyTorch ops behind the kernels: which glue to remove
        ops = [e for e in prof.key_averages() if e.key.startswith("aten::") and _self_device_us(e) > 0]
        print(f"| op | calls | self ms on the GPU |\n|---|---|---|")
        for e in sorted(ops, key=lambda e: -_self_device_us(e))[:rows]:
            print(f"| {e.key} | {e.count} | {_self_device_us(e) / 1e3:.2f} |")
    del layer


def _self_device_us(event) -> float:
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)


def main() -> None:
    if os.environ.get("TF32") == "1":
        torch.set_float32_matmul_precision("high")
    only = [n for n in os.environ.get("ONLY", "").split(",") if n]
    rows = int(os.environ.get("ROWS", 25))
    for T in (int(t) for t in os.environ.get("LENGTHS", "2048,8192").split(",")):
        for name in LAYERS:
            if only and not any(part in name for part in only):
                continue
            profile_layer(name, max(1, TOKENS // T), T, rows)


if __name__ == "__main__":
    main()
