"""MC-Titans' reads of its cached memories at the benchmark's shape: fused Triton kernels against batched products.

The reads of the MC grm layer at T=8192 (batch 2, 4 heads x 256, MLP x4, segments of 256: 31 cached memories,
memory ``j`` read by every query after segment ``j``), through :class:`mnemo.kernels.memory_caching._CachedReads`:
forward alone and forward + backward, on the batched-products path (``use_backend("torch")``, TF32 products) and
on the fused kernels, plus each fused kernel alone. ``BLOCKS=kernel:q,h,warps,stages;...`` (kernels ``forward``,
``query``, ``weight``; several entries of one kernel: a sweep) times the kernels with other launch constants,
``AGGREGATION=ssc`` times ssc's top-2 reads instead (selective batches; the kernels alone are
grm's), ``OPERANDS=bf16,tf32`` the low-precision operands (float32 operands take ``FLOAT32_BLOCKS``, not swept). Prints one JSON line per measurement and writes
``$OUT/bench_cached_reads.json``. Run on the GPU machine with mnemo importable.
"""

from __future__ import annotations

import json
import os

import torch

import mnemo.kernels.memory_caching as mc
import mnemo.kernels.memory_caching_triton as fused
from mnemo.kernels.backend import use_backend
from mnemo.kernels.titans import TitansMemorySpec

B, H, T, SEG = 2, 4, 8192, 256
SPEC = TitansMemorySpec(depth=2, d_k=256, d_v=256, expansion=4)
KERNELS = {"forward": "FORWARD_BLOCKS", "query": "QUERY_BLOCKS", "weight": "WEIGHT_BLOCKS"}


def ms(fn, warmup: int = 2, iters: int = 5) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def problem():
    gen = torch.Generator().manual_seed(0)
    starts = tuple(range(SEG, T, SEG))
    N = len(starts)
    q = torch.nn.functional.normalize(torch.randn(B, H, T, SPEC.d_k, generator=gen), dim=-1).cuda().requires_grad_()
    weights = [(torch.randn(N, B, H, *shape, generator=gen) * 0.05).cuda().requires_grad_()
               for shape in SPEC.shapes.values()]
    scores = torch.randn(B, H, T, N + 1, generator=gen).cuda()
    valid = torch.arange(T, device="cuda")[:, None] >= torch.tensor(starts + (0,), device="cuda")[None]
    scores = scores.masked_fill(~valid, float("-inf"))
    if os.environ.get("AGGREGATION", "grm") == "ssc":
        scores = torch.cat([mc.ssc_select(scores[..., :N], 2), scores[..., N:]], -1)
    g = torch.softmax(scores, -1)[..., :N].movedim(-1, 0).contiguous()
    return starts, q, g.requires_grad_(), weights


def main() -> None:
    out_dir = os.environ.get("OUT", ".")
    starts, q, g, weights = problem()
    ssc = os.environ.get("AGGREGATION", "grm") == "ssc"
    batches = mc._read_batches(SPEC, g.detach(), starts, ssc, H)
    pairs = sum(T - s for s in starts) * B * H
    flops = pairs * 2 * 2 * SPEC.d_k * SPEC.hidden  # forward: two products per (query, memory) pair
    dy = torch.randn(B, H, T, SPEC.d_v, device="cuda")
    rows = []

    def record(name: str, value: float, **extra) -> None:
        row = {"name": name, "ms": round(value, 3), **extra}
        rows.append(row)
        print(json.dumps(row), flush=True)

    def layer_pass(backend: str, backward: bool):
        def run():
            with use_backend(backend):
                y = mc._CachedReads.apply(SPEC, True, batches, q, g, *weights)
                if backward:
                    torch.autograd.grad(y, (q, g, *weights), dy)
        return run

    for backend in ("torch", "triton"):
        for backward in (False, True):
            value = ms(layer_pass(backend, backward))
            record(f"{'ssc ' if ssc else ''}{backend} {'fwd+bwd' if backward else 'fwd'}", value,
                   tflops=None if ssc else round(flops * (4.5 if backward else 1) / value / 1e9, 1))
    sweep = {}
    for entry in filter(None, os.environ.get("BLOCKS", "").split(";")):
        kernel, _, values = entry.partition(":")
        sweep.setdefault(kernel, []).append(tuple(int(v) for v in values.split(",")))
    reads = fused.DenseReads(tuple(range(len(starts))), starts)
    for low in [] if ssc else os.environ.get("OPERANDS", "bf16").split(","):
        fused.LOW_PRECISION = low
        op, precision = fused.operands(True)
        w1, w2 = (w.detach().to(op).contiguous() for w in weights)
        qd, gd = q.detach().contiguous(), g.detach().contiguous()
        dq, dg = torch.zeros_like(qd), torch.zeros_like(gd)
        dw1, dw2 = (torch.empty(w.shape, device="cuda") for w in weights)
        calls = {
            "forward": lambda: fused.cached_reads_forward(qd, gd, w1, w2, reads, precision),
            "query": lambda: fused.query_side(qd, gd, w1, w2, dy, reads, precision, dq, dg),
            "weight": lambda: fused.weight_side(qd, gd, w1, w2, dy, reads, precision, dw1, dw2),
        }
        share = {"forward": 1.0, "query": 1.5, "weight": 2.0}  # products per pair, relative to the forward's
        for kernel, attr in KERNELS.items():
            default = getattr(fused, attr)
            swept = [b for b in sweep.get(kernel, []) if b != default] if op.itemsize == 2 else []
            for blocks in [default] + swept:
                setattr(fused, attr, blocks)
                try:
                    value = ms(calls[kernel])
                    record(f"{kernel} {low}", value, blocks=fused._blocks(blocks, w1), tflops=round(flops * share[kernel] / value / 1e9, 1))
                except Exception as error:  # noqa: BLE001  (a config that does not compile: recorded, not fatal)
                    record(f"{kernel} {low}", float("nan"), blocks=blocks, error=str(error)[:200])
            setattr(fused, attr, default)
        fused.LOW_PRECISION = "bf16"
    info = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "pairs": pairs,
            "forward_tflop": round(flops / 1e12, 3)}
    with open(os.path.join(out_dir, "bench_cached_reads.json"), "w") as f:
        json.dump({"env": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
