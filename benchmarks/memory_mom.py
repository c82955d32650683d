"""Where a MoM layer's peak memory goes: the tensors alive at the peak of one forward+backward.

Same layer and work as ``benchmarks/mom.py`` (bf16, hidden 1024, 4 heads x 256, 4 memories
top-2 + shared, 16,384 tokens at T=2048 and T=8192). One step runs under PyTorch's
allocator history; the trace is replayed to the moment of the peak and the blocks alive
then are summed by the line of mnemo's source that allocated them. Run on the GPU machine
from ``benchmarks/`` with mnemo installed; ``T=2048,8192`` picks lengths.
"""

from __future__ import annotations

import os
from collections import defaultdict

import torch

from mnemo.kernels import use_backend
from mnemo.modeling.mom_layer import MoMMemoryLayer

from mom import D, DEV, DT, TOKENS, mom_config  # noqa: E402  (run as a script from benchmarks/)

OURS = ("/kernels/", "/modeling/", "/mnemo/")


def allocation_site(frames: list[dict]) -> str:
    """The innermost frame in mnemo's source, else the innermost frame there is."""
    for f in frames:
        if any(part in f["filename"] for part in OURS):
            return f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}"
    return f"{os.path.basename(frames[0]['filename'])}:{frames[0]['line']} {frames[0]['name']}" if frames else "?"


def live_at_peak(trace: list[dict]) -> tuple[int, dict[int, dict]]:
    """The peak of the bytes allocated during ``trace`` and the blocks alive at that moment."""
    events = [e for e in trace if e["action"] in ("alloc", "free_completed")]
    current = peak = peak_at = 0
    for i, e in enumerate(events):
        current += e["size"] if e["action"] == "alloc" else -e["size"]
        if current > peak:
            peak, peak_at = current, i
    live: dict[int, dict] = {}
    for e in events[: peak_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        else:
            live.pop(e["addr"], None)
    return peak, live


def profile(T: int) -> None:
    B = TOKENS // T
    torch.manual_seed(0)
    layer = MoMMemoryLayer(mom_config(), 0).to(DEV, DT)
    x = torch.randn(B, T, D, device=DEV, dtype=DT, requires_grad=True)

    def step():
        x.grad = None
        layer(x)[0].float().sum().backward()

    with use_backend("triton"):
        step()  # compile
        for p in layer.parameters():
            p.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
    peak, live = live_at_peak(snapshot["device_traces"][0])
    by_site: dict[str, list[int]] = defaultdict(list)
    for e in live.values():
        by_site[allocation_site(e.get("frames", []))].append(e["size"])
    print(f"\nT={T}, B={B}: peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB "
          f"(before the step {base / 2**30:.2f} GiB: weights, input; the step's own peak {peak / 2**30:.2f} GiB)")
    print("\n| allocated at | blocks | MB |\n|---|---|---|")
    for site, sizes in sorted(by_site.items(), key=lambda kv: -sum(kv[1])):
        if sum(sizes) >= 4 << 20:
            print(f"| {site} | {len(sizes)} | {sum(sizes) / 1e6:.0f} |")


if __name__ == "__main__":
    for T in (int(t) for t in os.environ.get("T", "2048,8192").split(",")):
        profile(T)
