"""Micro-benchmarks of mnemo's kernels on the GPU, each beside what it replaces or its physical bound.

One subcommand per kernel family; each prints one JSON line per measurement and writes
``bench_kernels_<subcommand>.json`` (environment and rows) to ``--out`` (default ``$OUT`` or the
current directory):

- ``gated-delta``: MoM's recurrence alone, ``chunk_gated_delta`` (4 heads x 256, bf16, T=2048, 16K and
  48K tokens): forward, forward + backward, forward without gradients, and the forward + backward's peak
  above its inputs; with ``--anchor``, flash-linear-attention 0.6.0's ``chunk_gated_delta_rule`` on the same
  inputs in the same process.
- ``newton-schulz``: Muon's orthogonalisation (``mnemo.kernels.atlas.newton_schulz``, 5 steps) on 8,192
  momenta of 64 x 256 (one chunk of one Atlas weight at B=8), float32, float32 with TF32 products and
  bf16, on the PyTorch path and the Triton kernels; FLOPs counted as the iteration on the matrices spends
  them (23.6 MFLOP per matrix forward, forward + backward as 3x), against the GPU's bf16 matmul
  throughput measured first in the same process (an 8192^3 product).
- ``cached-reads``: MC-Titans' reads of its cached memories at the layer's shape (T=8192, batch 2, 4 heads
  x 256, MLP x4, segments of 256: 31 memories), through the read's autograd function on the batched
  products (``use_backend("torch")``) and on the fused kernels, forward and forward + backward, then each
  fused kernel alone (``--blocks`` sweeps their launch constants); ``--aggregation ssc`` reads ssc's top 2.
- ``titans-chunk``: ``chunk_titans`` alone at the layer's shape (4 heads x 256, MLP x4, chunk 64, clip 10,
  momentum) in three builds of one process: ``cublas`` (cuBLAS forward and the written-out PyTorch
  backward: ``comparison_paths(chunk_forward="torch")``), ``sliced_fwd`` (the Triton forward, the PyTorch
  backward) and ``sliced`` (Triton both ways, the default). First every output and gradient against
  float64 at B=2, T=512 (largest error relative to the largest entry; float32 exact and bf16 inputs with
  TF32); then forward (no gradients) and forward + backward at 16K tokens (T=2048 B=8, T=8192 B=2, TF32,
  median of ``--repeats`` loops) and the step's peak. ``--sweep`` adds the ``sliced`` build with other
  launch constants (keys of ``titans_triton_forward.BLOCKS``).
- ``update-tiles``: the chunk's final weight update and its backward (``titans_triton_update``) at 32 x
  (256 x 1024) and 32 x (1024 x 256) float32 weights, 64 factor rows, TF32, for every tile shape, warp
  and stage count of ``--grid`` (set as the module's launch constants), beside the PyTorch versions and a
  plain copy of ``W, S`` (the bandwidth floor).- ``loss-norm-mlp``: what surrounds the memories in a whole model, at 16K tokens, hidden 1024, bf16: the
  LM loss at a 32K vocabulary (transformers' ``ForCausalLMLoss`` over full logits, mnemo's
  ``linear_cross_entropy``, and fla 0.6.0's ``FusedLinearCrossEntropyLoss`` where installed), forward +
  backward time and peak above the inputs; RMSNorm with the residual add and the SwiGLU product, mnemo's
  Triton kernels against its PyTorch path and the plain expressions under autograd.

Run on a GPU machine with mnemo importable, e.g. ``python benchmarks/bench_kernels.py newton-schulz``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchlib import DEVICE, DTYPE, Recorder, ints, median_ms, names, out_dir, peak_gib, release_chunk_graphs

# ----------------------------------------------------------------------------------------------- gated delta


def gated_delta_inputs(B: int, T: int, heads: int = 4, width: int = 256, seed: int = 0) -> list[torch.Tensor]:
    """``q, k, v (B, T, H, W)`` bf16, log decays ``g`` and ``beta (B, T, H)`` float32, all requiring grad."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q, k, v = (torch.randn(B, T, heads, width, device=DEVICE, dtype=DTYPE, generator=gen) for _ in range(3))
    g = -F.softplus(torch.randn(B, T, heads, device=DEVICE, generator=gen))
    beta = torch.rand(B, T, heads, device=DEVICE, generator=gen)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def gated_delta(recorder: Recorder, args: argparse.Namespace) -> None:
    from mnemo.kernels import chunk_gated_delta
    from mnemo.kernels.backend import use_backend

    for B in ints(args.batches):
        q, k, v, g, beta = gated_delta_inputs(B, args.length)
        runs: dict[str, tuple[str, Callable]] = {"mnemo_chunk_gated_delta": ("triton", lambda: chunk_gated_delta(
            q, k, v, g, beta))}
        if args.anchor:
            from benchlib import lift_fla_hopper_guard

            lift_fla_hopper_guard()
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule

            runs["anchor_fla_chunk_gated_delta_rule"] = ("torch", lambda: chunk_gated_delta_rule(
                q, k, v, g, beta, use_qk_l2norm_in_kernel=True))
        for name, (backend, fn) in runs.items():
            with use_backend(backend):
                forward = median_ms(fn, warmup=2, iters=10)
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                both = median_ms(lambda: fn()[0].float().sum().backward(), warmup=2, iters=10)
                peak = (torch.cuda.max_memory_allocated() - base) / 2**30
                with torch.no_grad():
                    no_grad = median_ms(fn, warmup=2, iters=10)
            recorder.record(impl=name, B=B, T=args.length, tokens=B * args.length, fwd_ms=round(forward, 2),
                            fwd_bwd_ms=round(both, 2), no_grad_fwd_ms=round(no_grad, 2),
                            fwd_bwd_peak_gib_above_inputs=round(peak, 2))
    recorder.table(["impl", "B", "T", "fwd_ms", "fwd_bwd_ms", "no_grad_fwd_ms", "fwd_bwd_peak_gib_above_inputs"])


def gated_delta_target(B: int, T: int) -> Callable[[], None]:
    """One forward + backward of the recurrence alone (for ``profile_layers.py``)."""
    from mnemo.kernels import chunk_gated_delta

    q, k, v, g, beta = gated_delta_inputs(B, T)
    return lambda: chunk_gated_delta(q, k, v, g, beta)[0].float().sum().backward()


# ---------------------------------------------------------------------------------------------- Newton-Schulz


def paper_flops(rows: int, cols: int, steps: int = 5) -> float:
    """Forward FLOPs of the iteration on one ``rows x cols`` matrix (``rows <= cols``): ``X X^T``, ``A^2``,
    ``(bA + cA^2) X`` per step, whatever the implementation computes."""
    return steps * (2 * rows * rows * cols + 2 * rows**3 + 2 * rows * rows * cols)


def bf16_matmul_tflops(n: int = 8192) -> float:
    """The GPU's bf16 matmul throughput, measured: the bound Newton-Schulz is held against."""
    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    return 2 * n**3 / median_ms(lambda: a @ a, warmup=3, iters=20) / 1e9


def newton_schulz(recorder: Recorder, args: argparse.Namespace) -> None:
    from mnemo.kernels.atlas import newton_schulz as orthogonalise
    from mnemo.kernels.backend import use_backend

    peak = bf16_matmul_tflops()
    recorder.record(what="bf16_matmul_8192", tflops=round(peak, 1))
    work = paper_flops(args.rows, args.cols, args.steps) * args.count
    kinds = {"float32": (torch.float32, "highest"), "tf32": (torch.float32, "high"), "bf16": (torch.bfloat16, "highest")}
    for kind in names(args.dtypes):
        dtype, precision = kinds[kind]
        torch.set_float32_matmul_precision(precision)
        G = torch.randn(args.count, args.rows, args.cols, device=DEVICE, dtype=dtype, requires_grad=True)
        probe = torch.randn_like(G)

        def train() -> None:
            G.grad = None
            orthogonalise(G, args.steps).backward(probe)

        for backend in names(args.backends):
            with use_backend(backend):
                forward = median_ms(lambda: orthogonalise(G, args.steps), warmup=3, iters=20)
                both = median_ms(train, warmup=3, iters=20)
            recorder.record(dtype=kind, backend=backend, matrices=args.count, fwd_ms=round(forward, 3),
                            fwd_bwd_ms=round(both, 3), fwd_tflops=round(work / forward / 1e9, 1),
                            fwd_bwd_tflops=round(3 * work / both / 1e9, 1),
                            fwd_bwd_of_bf16_peak=round(3 * work / both / 1e9 / peak, 3))
    torch.set_float32_matmul_precision("highest")
    recorder.table(["dtype", "backend", "fwd_ms", "fwd_bwd_ms", "fwd_tflops", "fwd_bwd_tflops", "fwd_bwd_of_bf16_peak"],
                   recorder.rows[1:])


# ----------------------------------------------------------------------------------------------- cached reads

# The MC grm layer's reads at T=8192: batch 2, 4 heads x 256, MLP x4, segments of 256 (31 cached memories,
# memory j read by every query after segment j).
READS_B, READS_H, READS_T, READS_SEGMENT = 2, 4, 8192, 256
FUSED_KERNELS = {"forward": "FORWARD_BLOCKS", "query": "QUERY_BLOCKS", "weight": "WEIGHT_BLOCKS"}


def reads_problem(ssc: bool):
    from mnemo.kernels.memory_caching import ssc_select
    from mnemo.kernels.mlp_memory import MLPMemorySpec

    spec = MLPMemorySpec(depth=2, d_k=256, d_v=256, expansion=4)
    gen = torch.Generator().manual_seed(0)
    starts = tuple(range(READS_SEGMENT, READS_T, READS_SEGMENT))
    N, B, H, T = len(starts), READS_B, READS_H, READS_T
    q = F.normalize(torch.randn(B, H, T, spec.d_k, generator=gen), dim=-1).to(DEVICE).requires_grad_()
    weights = [(torch.randn(N, B, H, *shape, generator=gen) * 0.05).to(DEVICE).requires_grad_()
               for shape in spec.shapes.values()]
    scores = torch.randn(B, H, T, N + 1, generator=gen).to(DEVICE)
    valid = torch.arange(T, device=DEVICE)[:, None] >= torch.tensor(starts + (0,), device=DEVICE)[None]
    scores = scores.masked_fill(~valid, float("-inf"))
    if ssc:
        scores = torch.cat([ssc_select(scores[..., :N], 2), scores[..., N:]], -1)
    g = torch.softmax(scores, -1)[..., :N].movedim(-1, 0).contiguous()
    return spec, starts, q, g.requires_grad_(), weights


def block_sweep(text: str | None) -> dict[str, list[tuple[int, ...]]]:
    """``forward:64,32,4,2;query:128,32,8,3`` -> launch constants to try per fused kernel."""
    sweep: dict[str, list[tuple[int, ...]]] = {}
    for entry in filter(None, (text or "").split(";")):
        kernel, _, values = entry.partition(":")
        sweep.setdefault(kernel, []).append(tuple(ints(values)))
    return sweep


def cached_reads(recorder: Recorder, args: argparse.Namespace) -> None:
    import mnemo.kernels.mc_titans as mc
    import mnemo.kernels.mc_titans_triton as fused
    from mnemo.kernels.backend import use_backend

    ssc = args.aggregation == "ssc"
    spec, starts, q, g, weights = reads_problem(ssc)
    batches = mc._read_batches(spec, g.detach(), starts, ssc, READS_H)
    pairs = sum(READS_T - s for s in starts) * READS_B * READS_H
    flops = pairs * 2 * 2 * spec.d_k * spec.hidden  # forward: two products per (query, memory) pair
    dy = torch.randn(READS_B, READS_H, READS_T, spec.d_v, device=DEVICE)
    recorder.record(what="problem", aggregation=args.aggregation, memories=len(starts), pairs=pairs,
                    forward_tflop=round(flops / 1e12, 3))

    def reads(backend: str, backward: bool) -> Callable[[], None]:
        def run() -> None:
            with use_backend(backend):
                y = mc._CachedReads.apply(spec, True, batches, q, g, *weights)
                if backward:
                    torch.autograd.grad(y, (q, g, *weights), dy)
        return run

    for backend in ("torch", "triton"):
        for backward in (False, True):
            ms = median_ms(reads(backend, backward), warmup=2, iters=5)
            # ssc's selective reads pad their batches: no count of useful FLOPs
            tflops = None if ssc else round(flops * (4.5 if backward else 1) / ms / 1e9, 1)
            recorder.record(what="reads", aggregation=args.aggregation, path=backend,
                            direction="fwd+bwd" if backward else "fwd", ms=round(ms, 3), tflops=tflops)
    if ssc:  # the kernels alone read grm's dense problem
        return
    sweep = block_sweep(args.blocks)
    dense = fused.DenseReads(tuple(range(len(starts))), starts)
    share = {"forward": 1.0, "query": 1.5, "weight": 2.0}  # products per pair, relative to the forward's
    for low in names(args.operands):
        fused.LOW_PRECISION = low
        op, precision = fused.operands(True)
        w1, w2 = (w.detach().to(op).contiguous() for w in weights)
        qd, gd = q.detach().contiguous(), g.detach().contiguous()
        dq, dg = torch.zeros_like(qd), torch.zeros_like(gd)
        dw1, dw2 = (torch.empty(w.shape, device=DEVICE) for w in weights)
        calls = {
            "forward": lambda: fused.cached_reads_forward(qd, gd, w1, w2, dense, precision),
            "query": lambda: fused.query_side(qd, gd, w1, w2, dy, dense, precision, dq, dg),
            "weight": lambda: fused.weight_side(qd, gd, w1, w2, dy, dense, precision, dw1, dw2),
        }
        for kernel, attr in FUSED_KERNELS.items():
            default = getattr(fused, attr)
            # float32 operands take the module's own float32 tiles: only the low-precision ones are swept
            tried = [default] + ([b for b in sweep.get(kernel, []) if b != default] if op.itemsize == 2 else [])
            for blocks in tried:
                setattr(fused, attr, blocks)
                try:
                    ms = median_ms(calls[kernel], warmup=2, iters=5)
                    recorder.record(what="kernel", kernel=kernel, operands=low, blocks=list(blocks), ms=round(ms, 3),
                                    tflops=round(flops * share[kernel] / ms / 1e9, 1))
                except Exception as error:  # noqa: BLE001  (a launch that does not fit is a result, not fatal)
                    recorder.record(what="kernel", kernel=kernel, operands=low, blocks=list(blocks),
                                    err=str(error)[:200])
            setattr(fused, attr, default)
    fused.LOW_PRECISION = "bf16"


# ----------------------------------------------------------------------------------------------- Titans chunk

CHUNK_HEADS, CHUNK_WIDTH = 4, 256
CHUNK_INPUTS = ["q", "k", "v", "retention", "momentum", "lr", "w1", "w2"]
CHUNK_BUILDS = {"cublas": dict(chunk_forward="torch"), "sliced_fwd": dict(chunk_backward="torch"), "sliced": {}}


def chunk_spec():
    from mnemo.kernels.mlp_memory import MLPMemorySpec

    return MLPMemorySpec(depth=2, d_k=CHUNK_WIDTH, d_v=CHUNK_WIDTH, expansion=4, grad_clip=10.0)


def chunk_inputs(B: int, T: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """``q, k, v`` in ``dtype``, the gates (retention near 1, momentum, learning rate) and the initial
    weights ``w1, w2`` (float32), in the order of :data:`CHUNK_INPUTS`."""
    gen = torch.Generator().manual_seed(seed)
    init = {n: (torch.randn(CHUNK_HEADS, *s, generator=gen) * 0.02).to(DEVICE) for n, s in chunk_spec().shapes.items()}
    q, k, v = (torch.randn(B, T, CHUNK_HEADS, CHUNK_WIDTH, generator=gen).to(DEVICE, dtype) for _ in range(3))
    retention = (torch.rand(B, T, CHUNK_HEADS, generator=gen) * 0.1 + 0.9).to(DEVICE)
    momentum = (torch.rand(B, T, CHUNK_HEADS, generator=gen) * 0.5).to(DEVICE)
    lr = (torch.rand(B, T, CHUNK_HEADS, generator=gen) * 0.1).to(DEVICE)
    return [q, k, v, retention, momentum, lr, init["w1"], init["w2"]]


def run_chunk(xs: list[torch.Tensor], B: int) -> list[torch.Tensor]:
    """``chunk_titans``'s output and final state: ``[y, W1', W2', S1', S2']``."""
    from mnemo.kernels.titans import TitansState, chunk_titans

    q, k, v, retention, momentum, lr, w1, w2 = xs
    out, state = chunk_titans(chunk_spec(), q, k, v, retention, momentum, lr,
                              TitansState.initial({"w1": w1, "w2": w2}, B))
    return [out, state.weights["w1"], state.weights["w2"], state.momentum["w1"], state.momentum["w2"]]


@contextlib.contextmanager
def chunk_build(name: str, blocks: dict[str, int] | None = None):
    """The build's comparison paths and launch constants; graphs of the build before are released, so that
    neither its replays nor its memory count here."""
    from mnemo.kernels import titans_triton_forward
    from mnemo.kernels.backend import comparison_paths

    release_chunk_graphs()
    saved = dict(titans_triton_forward.BLOCKS)
    titans_triton_forward.BLOCKS.update(blocks or {})
    try:
        with comparison_paths(**CHUNK_BUILDS[name]):
            yield
    finally:
        titans_triton_forward.BLOCKS.update(saved)


def chunk_gradients(xs: list[torch.Tensor], B: int, cotangents: list[torch.Tensor] | None = None):
    """Outputs, every input's gradient and the cotangents (drawn from seed 1 where none are given)."""
    leaves = [x.detach().requires_grad_() for x in xs]
    outs = run_chunk(leaves, B)
    if cotangents is None:
        gen = torch.Generator().manual_seed(1)
        cotangents = [torch.randn(o.shape, generator=gen).to(DEVICE).double() for o in outs]
    grads = torch.autograd.grad(outs, leaves, [c.to(o.dtype) for c, o in zip(cotangents, outs)])
    return outs, grads, cotangents


def chunk_errors(recorder: Recorder, builds: list[str], B: int = 2, T: int = 512) -> None:
    def err(x: torch.Tensor, y: torch.Tensor) -> float:
        return float((x.detach().double() - y.detach()).abs().max() / y.detach().abs().max())

    for label, dtype, precision in (("float32_exact", torch.float32, "highest"), ("bf16_tf32", DTYPE, "high")):
        xs = chunk_inputs(B, T, dtype)
        torch.set_float32_matmul_precision("highest")
        with chunk_build("cublas"):
            ref_outs, ref_grads, cotangents = chunk_gradients([x.double() for x in xs], B)
        torch.set_float32_matmul_precision(precision)
        for name in builds:
            with chunk_build(name):
                outs, grads, _ = chunk_gradients(xs, B, cotangents)
            recorder.record(what="errors", inputs=label, build=name,
                            outputs={n: f"{err(x, y):.1e}" for n, x, y in zip(["y", "W1", "W2", "S1", "S2"], outs,
                                                                              ref_outs)},
                            grads={n: f"{err(x, y):.1e}" for n, x, y in zip(CHUNK_INPUTS, grads, ref_grads)})


def chunk_variants(builds: list[str], sweep: str | None) -> list[tuple[str, dict[str, int]]]:
    """Each build, then the ``sliced`` build with each value of ``key:v1,v2`` (``;`` between keys, each
    swept from the defaults; ``key=v,key=v`` is one variant of several constants)."""
    out: list[tuple[str, dict[str, int]]] = [(name, {}) for name in builds]
    for entry in filter(None, (sweep or "").split(";")):
        if "=" in entry:
            out.append(("sliced", {key: int(value) for key, value in (x.split("=") for x in entry.split(","))}))
            continue
        key, values = entry.split(":")
        out += [("sliced", {key: value}) for value in ints(values)]
    return out


def chunk_train_step(xs: list[torch.Tensor], B: int) -> Callable[[], None]:
    def step() -> None:
        for x in xs:
            x.grad = None
        run_chunk(xs, B)[0].float().sum().backward()

    return step


def titans_chunk_target(B: int, T: int) -> Callable[[], None]:
    """One forward + backward of ``chunk_titans`` alone, bf16 inputs (for ``profile_layers.py``)."""
    return chunk_train_step([x.requires_grad_() for x in chunk_inputs(B, T, DTYPE)], B)


def titans_chunk(recorder: Recorder, args: argparse.Namespace) -> None:
    builds = names(args.builds)
    if not args.skip_errors:
        chunk_errors(recorder, builds)
    torch.set_float32_matmul_precision("high")
    for T in ints(args.lengths):
        B = max(1, args.tokens // T)
        xs = [x.requires_grad_() for x in chunk_inputs(B, T, DTYPE)]
        step = chunk_train_step(xs, B)

        def forward() -> None:
            with torch.no_grad():
                run_chunk(xs, B)

        for name, blocks in chunk_variants(builds, args.sweep):
            with chunk_build(name, blocks):
                forward_ms = median_ms(forward, warmup=2, iters=3, repeats=args.repeats)
                step_ms = median_ms(step, warmup=2, iters=3, repeats=args.repeats)
                torch.cuda.reset_peak_memory_stats()
                step()
                recorder.record(what="time", build=name, blocks=blocks, B=B, T=T, forward_ms=round(forward_ms, 1),
                                fwd_bwd_ms=round(step_ms, 1), peak_gib=peak_gib())
    recorder.table(["build", "blocks", "B", "T", "forward_ms", "fwd_bwd_ms", "peak_gib"],
                   [r for r in recorder.rows if r.get("what") == "time"])


# ------------------------------------------------------------------------------------------ final update tiles


def default_tile_grid() -> list[tuple[int, int, int, int, int]]:
    return list(itertools.product((32, 64, 128), (64, 128), (32, 64), (4, 8), (1, 2)))


def tile_grid(text: str | None) -> list[tuple[int, int, int, int, int]]:
    """``32,128,64,4,2;64,64,32,4,1`` -> ``(BM, BN, BK, warps, stages)`` per entry; none: the full grid."""
    if not text:
        return default_tile_grid()
    return [tuple(ints(entry)) for entry in text.split(";") if entry]  # type: ignore[misc]


def update_tiles(recorder: Recorder, args: argparse.Namespace) -> None:
    import mnemo.kernels.titans_triton_update as update
    from mnemo.kernels.titans_chunk import _final_update_backward_torch, _final_update_torch

    torch.set_float32_matmul_precision("high")
    G, rows = 32, 64

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=DEVICE)

    saved = (update._BM, update._BN, update._BK, update._WARPS, update._STAGES)
    for M, N in ((256, 1024), (1024, 256)):
        W, S, dW, dS = (r(G, M, N) for _ in range(4))
        a, b, sa = (torch.rand(G, device=DEVICE) for _ in range(3))
        U, Us, Bf = r(G, rows, M), r(G, rows, M), r(G, rows, N)
        uses = [(r(G, rows, M), r(G, rows, N)) for _ in range(3)]  # a weight's three uses in a chunk's backward

        def us(fn: Callable[[], object]) -> float:
            return round(median_ms(fn, warmup=3, iters=20) * 1e3, 1)

        recorder.record(what="torch", M=M, N=N, update_us=us(lambda: _final_update_torch(W, S, a, b, sa, U, Us, Bf)),
                        backward_us=us(lambda: _final_update_backward_torch(W, S, dW, dS, a, b, sa, uses, uses[:1])),
                        copy_w_s_us=us(lambda: (W.clone(), S.clone())))
        for tiles in tile_grid(args.grid):
            update._BM, update._BN, update._BK, update._WARPS, update._STAGES = tiles
            try:
                recorder.record(what="triton", M=M, N=N, tiles=list(tiles),
                                update_us=us(lambda: update.final_update(W, S, a, b, sa, U, Us, Bf)),
                                backward_us=us(lambda: update.final_update_backward(W, S, dW, dS, a, b, sa, uses,
                                                                                    uses[:1])))
            except Exception as error:  # noqa: BLE001  (tiles over the shared memory: recorded, not fatal)
                recorder.record(what="triton", M=M, N=N, tiles=list(tiles), err=str(error)[:200])
    update._BM, update._BN, update._BK, update._WARPS, update._STAGES = saved


# --------------------------------------------------------------------------------------------- loss-norm-mlp

def loss_norm_mlp(recorder: Recorder, args: argparse.Namespace) -> None:
    from transformers.loss.loss_utils import ForCausalLMLoss

    from benchlib import HIDDEN, VOCAB, lift_fla_hopper_guard, reset_peak

    from mnemo.kernels.backend import use_backend
    from mnemo.kernels.linear_cross_entropy import causal_targets, linear_cross_entropy
    from mnemo.kernels.rms_norm import rms_norm
    from mnemo.kernels.swiglu import silu_mul

    N, H, V, I = args.tokens, HIDDEN, VOCAB, 4 * HIDDEN
    hidden = torch.randn(N // 2048, 2048, H, device=DEVICE, dtype=DTYPE, requires_grad=True)
    head = torch.nn.Linear(H, V, bias=False, device=DEVICE)
    labels = torch.randint(0, V, (N // 2048, 2048), device=DEVICE)

    def timed(what: str, fn) -> None:
        def step():
            with torch.autocast("cuda", dtype=DTYPE):
                out = fn()
            out.float().sum().backward() if out.dim() else out.backward()
        step()
        torch.cuda.synchronize()
        reset_peak()
        base = torch.cuda.memory_allocated() / 2**30
        ms = median_ms(step, warmup=2, iters=10, repeats=3)
        recorder.record(what=what, tokens=N, fwd_bwd_ms=round(ms, 3), peak_gib_above_inputs=round(peak_gib() - base, 2))

    timed("loss: transformers ForCausalLMLoss (full logits)", lambda: ForCausalLMLoss(head(hidden), labels, V))
    timed("loss: mnemo linear_cross_entropy", lambda: linear_cross_entropy(hidden, head, causal_targets(labels)))
    try:
        lift_fla_hopper_guard()
        from fla.modules import FusedLinearCrossEntropyLoss

        fla_loss = FusedLinearCrossEntropyLoss()
        shifted = causal_targets(labels)
        timed("loss: fla FusedLinearCrossEntropyLoss",
              lambda: fla_loss(hidden.reshape(-1, H), shifted, head.weight))
    except Exception as error:  # noqa: BLE001  (anchor absent or broken: the row says so)
        recorder.record(what="loss: fla FusedLinearCrossEntropyLoss", err=str(error)[:200])

    x = torch.randn(N, H, device=DEVICE, dtype=DTYPE, requires_grad=True)
    r = torch.randn(N, H, device=DEVICE, requires_grad=True)
    w = torch.ones(H, device=DEVICE, requires_grad=True)

    def plain_norm():
        s = x + r
        return (s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w).to(s.dtype) + s

    timed("rms_norm + residual: plain under autograd", plain_norm)
    for backend in ("torch", "triton"):
        with use_backend(backend):
            timed(f"rms_norm + residual: mnemo {backend}", lambda: sum(rms_norm(x, w, 1e-6, r)))
    g = torch.randn(N, I, device=DEVICE, dtype=DTYPE, requires_grad=True)
    u = torch.randn(N, I, device=DEVICE, dtype=DTYPE, requires_grad=True)
    timed("silu(gate) * up: plain under autograd", lambda: F.silu(g) * u)
    for backend in ("torch", "triton"):
        with use_backend(backend):
            timed(f"silu(gate) * up: mnemo {backend}", lambda: silu_mul(g, u))


# ------------------------------------------------------------------------------------------------------ main

COMMANDS: dict[str, Callable[[Recorder, argparse.Namespace], None]] = {
    "gated-delta": gated_delta,
    "newton-schulz": newton_schulz,
    "cached-reads": cached_reads,
    "titans-chunk": titans_chunk,
    "update-tiles": update_tiles,
    "loss-norm-mlp": loss_norm_mlp,
}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="folder for bench_kernels_<subcommand>.json (default $OUT or .)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("gated-delta", help="MoM's recurrence alone, beside fla's chunk kernel")
    p.add_argument("--batches", default="8,24", help="batch sizes at T (default %(default)s: 16K and 48K tokens)")
    p.add_argument("--length", type=int, default=2048, help="T (default %(default)s)")
    p.add_argument("--anchor", action="store_true", help="also fla 0.6.0's chunk_gated_delta_rule")

    p = sub.add_parser("newton-schulz", help="Newton-Schulz against the bf16 matmul throughput")
    p.add_argument("--count", type=int, default=8192, help="matrices (default %(default)s)")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--cols", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dtypes", default="float32,tf32,bf16", help="of float32, tf32, bf16 (default %(default)s)")
    p.add_argument("--backends", default="torch,triton", help="(default %(default)s)")

    p = sub.add_parser("cached-reads", help="MC-Titans' reads of its cached memories")
    p.add_argument("--aggregation", choices=("grm", "ssc"), default="grm")
    p.add_argument("--blocks", metavar="KERNEL:Q,H,WARPS,STAGES;...",
                   help="launch constants to try per fused kernel (forward, query, weight)")
    p.add_argument("--operands", default="bf16", help="low-precision operands: bf16 and/or tf32")

    p = sub.add_parser("titans-chunk", help="chunk_titans alone: builds, errors against float64, time")
    p.add_argument("--builds", default=",".join(CHUNK_BUILDS), help="(default %(default)s)")
    p.add_argument("--lengths", default="2048,8192", help="T (default %(default)s)")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per step; B = tokens // T")
    p.add_argument("--repeats", type=int, default=3, help="timed loops of 3 steps, median (default %(default)s)")
    p.add_argument("--sweep", metavar="KEY:V1,V2;...", help="the sliced build with other launch constants")
    p.add_argument("--skip-errors", action="store_true", help="time only")

    p = sub.add_parser("update-tiles", help="the final weight update's tiles")
    p.add_argument("--grid", metavar="BM,BN,BK,WARPS,STAGES;...", help="tiles to time (default: a grid of 72)")

    p = sub.add_parser("loss-norm-mlp", help="the LM loss, RMSNorm + residual and SwiGLU beside their anchors")
    p.add_argument("--tokens", type=int, default=16384, help="tokens (multiple of 2048; default %(default)s)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    recorder = Recorder()
    COMMANDS[args.command](recorder, args)
    recorder.write(out_dir(args.out) / f"bench_kernels_{args.command.replace('-', '_')}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
