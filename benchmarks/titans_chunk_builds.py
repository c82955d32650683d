"""The Titans chunk's builds side by side on the GPU: errors against float64, then speed.

``python benchmarks/titans_chunk_builds.py`` on the GPU machine. Builds (selected by the
switches the package reads at call time, so all run in one process):

- ``cublas``: the chunk's forward through cuBLAS, its written-out PyTorch backward
  (``MNEMO_CHUNK_FORWARD=torch``);
- ``sliced_fwd``: the sliced Triton forward, the PyTorch backward (``MNEMO_CHUNK_BACKWARD=torch``);
- ``sliced``: the sliced Triton forward and backward (the default).

Errors: ``chunk_titans`` at the layer's shape (4 heads x 256, MLP x4, chunk 64, clip 10,
momentum), B=2, T=512, every output and gradient against float64, relative to the largest
entry, float32 with exact products and with TF32 on bf16 inputs. Speed: forward and
forward+backward at 16K tokens (T=2048, B=8 and T=8192, B=2), TF32, bf16 inputs, median of
``REPEATS`` loops. ``BUILDS=sliced,cublas`` picks builds; ``SWEEP=backward_warps:4,8`` adds the
``sliced`` build with each value of a block constant (``;`` between keys); ``SKIP_ERRORS=1`` times only; ``PROFILE=1``
prints the ``sliced`` build's kernels by CUDA time.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch

from mnemo.kernels.chunk_loop import release_graphs
from mnemo.kernels.titans import TitansMemorySpec, TitansState, chunk_titans

H, D = 4, 256
SPEC = TitansMemorySpec(depth=2, d_k=D, d_v=D, expansion=4, grad_clip=10.0)
BUILDS = {"cublas": {"MNEMO_CHUNK_FORWARD": "torch"}, "sliced_fwd": {"MNEMO_CHUNK_BACKWARD": "torch"}, "sliced": {}}
NAMES = ["q", "k", "v", "alpha", "eta", "theta", "w1", "w2"]


@contextlib.contextmanager
def build(name):
    # Each build captures its own CUDA graphs (the switches are part of their key); the last build's
    # are freed so that its memory does not count in the next one's peak.
    release_graphs()
    saved = {key: os.environ.get(key) for key in ("MNEMO_CHUNK_FORWARD", "MNEMO_CHUNK_BACKWARD")}
    for key in saved:
        os.environ.pop(key, None)
    os.environ.update(BUILDS[name])
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def inputs(B, T, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    init = {n: (torch.randn(H, *s, generator=gen) * 0.02).cuda() for n, s in SPEC.shapes.items()}
    q, k, v = (torch.randn(B, T, H, D, generator=gen).cuda().to(dtype) for _ in range(3))
    alpha = (torch.rand(B, T, H, generator=gen) * 0.1 + 0.9).cuda()
    eta = (torch.rand(B, T, H, generator=gen) * 0.5).cuda()
    theta = (torch.rand(B, T, H, generator=gen) * 0.1).cuda()
    return [q, k, v, alpha, eta, theta, init["w1"], init["w2"]]


def run(xs, B):
    q, k, v, alpha, eta, theta, w1, w2 = xs
    out, state = chunk_titans(SPEC, q, k, v, alpha, eta, theta, TitansState.initial({"w1": w1, "w2": w2}, B))
    return [out, state.weights["w1"], state.weights["w2"], state.momentum["w1"], state.momentum["w2"]]


def grads(xs, B, cotangents=None):
    """Outputs, every input's gradient and the cotangents (drawn from seed 1 where none are given)."""
    leaves = [x.detach().requires_grad_() for x in xs]
    outs = run(leaves, B)
    if cotangents is None:
        gen = torch.Generator().manual_seed(1)
        cotangents = [torch.randn(o.shape, generator=gen).cuda().double() for o in outs]
    return outs, torch.autograd.grad(outs, leaves, [c.to(o.dtype) for c, o in zip(cotangents, outs)]), cotangents


def errors(B=2, T=512):
    for label, dtype, precision in (("float32, highest", torch.float32, "highest"),
                                    ("bf16 inputs, TF32", torch.bfloat16, "high")):
        xs = inputs(B, T, dtype)
        torch.set_float32_matmul_precision("highest")
        with build("cublas"):
            ref_outs, ref_grads, cot = grads([x.double() for x in xs], B)
        torch.set_float32_matmul_precision(precision)
        for name in BUILDS:
            with build(name):
                outs, gs, _ = grads(xs, B, cot)
            err = lambda x, y: ((x.double() - y).abs().max() / y.abs().max()).item()  # noqa: E731
            o = " ".join(f"{e:.1e}" for e in (err(x, y) for x, y in zip(outs, ref_outs)))
            g = " ".join(f"{n}={err(x, y):.1e}" for n, x, y in zip(NAMES, gs, ref_grads))
            print(f"errors [{label}] {name:10s} outputs(y W1' W2' S1' S2') {o} | grads {g}", flush=True)


def timings():
    torch.set_float32_matmul_precision("high")
    repeats = int(os.environ.get("REPEATS", 3))
    for B, T in ((8, 2048), (2, 8192)):
        xs = [x.requires_grad_() if x.is_floating_point() else x for x in inputs(B, T, torch.bfloat16)]
        for name, blocks in variants():
            with build(name), sliced_blocks(blocks):
                def forward():
                    with torch.no_grad():
                        run(xs, B)

                def step():
                    for x in xs:
                        x.grad = None
                    run(xs, B)[0].float().sum().backward()

                row = []
                for fn in (forward, step):
                    for _ in range(2):
                        fn()
                    loops = []
                    for _ in range(repeats):
                        torch.cuda.synchronize()
                        start = time.perf_counter()
                        for _ in range(3):
                            fn()
                        torch.cuda.synchronize()
                        loops.append((time.perf_counter() - start) / 3 * 1e3)
                    row.append(sorted(loops)[len(loops) // 2])
                torch.cuda.reset_peak_memory_stats()
                step()
                peak = torch.cuda.max_memory_allocated() / 2**30
                if os.environ.get("PROFILE") == "1" and name == "sliced" and not blocks:
                    profile_step(step)
            label = name + "".join(f" {key}={value}" for key, value in blocks.items())
            print(f"time B={B} T={T} {label:10s} forward {row[0]:.1f} ms  fwd+bwd {row[1]:.1f} ms  peak {peak:.2f} GiB",
                  flush=True)


def variants():
    """``(build, blocks)`` to time: each of ``BUILDS``, then the ``sliced`` build with each value of
    ``SWEEP=key:v1,v2`` (a key of :data:`~mnemo.kernels.titans_chunk_forward_triton.BLOCKS`; several keys
    separated by ``;``, each swept from the defaults; ``key=v,key=v`` between them is one variant)."""
    out = [(name, {}) for name in os.environ.get("BUILDS", ",".join(BUILDS)).split(",") if name]
    for sweep in filter(None, os.environ.get("SWEEP", "").split(";")):
        if "=" in sweep:  # one variant of several constants: key=v,key=v
            out.append(("sliced", {key: int(value) for key, value in (x.split("=") for x in sweep.split(","))}))
            continue
        key, values = sweep.split(":")
        out += [("sliced", {key: int(value)}) for value in values.split(",")]
    return out


@contextlib.contextmanager
def sliced_blocks(blocks):
    from mnemo.kernels import titans_chunk_forward_triton as sliced

    saved = dict(sliced.BLOCKS)
    sliced.BLOCKS.update(blocks)
    try:
        yield
    finally:
        sliced.BLOCKS.update(saved)


def profile_step(step):
    """The kernels of one training step by total CUDA time (``PROFILE=1``, the ``sliced`` build)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=50), flush=True)


if __name__ == "__main__":
    import triton

    print(torch.cuda.get_device_name(0), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    if os.environ.get("SKIP_ERRORS") != "1":
        errors()
    timings()
