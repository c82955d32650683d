"""Where a layer's training step, a kernel's or a decode step spends its time or its memory (torch.profiler).

Targets (``--layer``, comma-separated substrings of their names; ``--list`` prints them):

- every layer of ``bench_layers.py`` (same construction: hidden 1024, bf16), one forward + backward at
  ``--tokens`` per step and each of ``--lengths``;
- ``kernel_chunk_titans_4x256``: ``chunk_titans`` alone at the Titans layer's shape (``bench_kernels.py
  titans-chunk``'s inputs); ``kernel_gated_delta_4x256``: MoM's recurrence alone (``bench_kernels.py
  gated-delta``'s inputs; ``--tokens 49152`` for MoM's 48K token-memory pairs at T=2048);
- ``model_<row>``: a whole model of ``models.py`` (``--model-layers`` blocks), forward with the loss from
  labels under bf16 autocast and backward, no optimizer;
- with ``--mode decode``, the models of ``bench_decode.py``: one eager decode step after a prompt of
  ``--prompt`` tokens, per batch of ``--batches`` (with ``--graph``, replays of the captured step instead,
  the path of ``generate(cuda_graph=True)``).

Modes:

- ``time`` (default): the step's wall time (median of a few, unprofiled), then one profiled step: the
  kernels' summed time, the GPU's busy time (their union; the gap to the summed time is overlap, and a wall
  time well above the busy time means the host set the pace), and the ``--rows`` kernels with the most
  time, with launches and time per launch. ``--ops`` adds the PyTorch ops by their kernels' time, ``--gaps``
  the longest stretches of an idle GPU between kernels, ``--cpu`` the host's calls by their own time.
- ``memory``: one step under the allocator's history, replayed to the moment of the peak; the blocks
  alive then, summed by the line of mnemo's source that allocated them (the innermost frame in mnemo,
  else the innermost frame), largest first.
- ``decode``: kernels per decode step and their time, and the kernels by time (``--graph``: over
  ``--graph-steps`` replays of the captured step); ``--sequence`` adds the first profiled step's kernels in
  the order they ran, with their start (us from the first) and duration: where a layer's launches go.

Prints markdown tables; writes nothing. Run on a GPU machine with mnemo importable, e.g.
``python benchmarks/profile_layers.py --tf32 --layer titans_4x256 --lengths 8192 --ops --gaps``.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from benchlib import DEVICE, DTYPE, HIDDEN, LENGTHS, TOKENS, VOCAB, ints, median_ms, names, picked, release_chunk_graphs

KERNEL_TARGETS = ("kernel_chunk_titans_4x256", "kernel_gated_delta_4x256")


def training_targets() -> list[str]:
    from bench_layers import LAYERS
    from models import MODELS

    return [*LAYERS, *KERNEL_TARGETS, *(f"model_{name}" for name in MODELS)]


def model_step(name: str, B: int, T: int, layers: int) -> tuple[Callable[[], None], torch.nn.Module]:
    """A whole model's forward (loss from labels) and backward, as ``models.py`` trains it (no optimizer)."""
    from models import MODELS

    torch.backends.cuda.matmul.allow_tf32 = True
    model = MODELS[name](layers).to(DEVICE)
    ids = torch.randint(0, VOCAB, (B, T), device=DEVICE)

    def step() -> None:
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()

    return step, model


# Blocks of the whole-model targets (``--model-layers``).
MODEL_LAYERS = [24]


def training_step(name: str, B: int, T: int) -> tuple[Callable[[], None], object]:
    """The step of a target and what keeps its state alive (the layer, if any)."""
    if name == "kernel_chunk_titans_4x256":
        from bench_kernels import titans_chunk_target

        return titans_chunk_target(B, T), None
    if name.startswith("model_"):
        return model_step(name.removeprefix("model_"), B, T, MODEL_LAYERS[0])
    if name == "kernel_gated_delta_4x256":
        from bench_kernels import gated_delta_target

        return gated_delta_target(B, T), None
    from bench_layers import LAYERS, backend_context, train_step

    row = LAYERS[name]
    layer = row.make().to(DEVICE, DTYPE)
    x = torch.randn(B, T, HIDDEN, device=DEVICE, dtype=DTYPE, requires_grad=True)
    step = train_step(layer, x)
    if row.backend is None:
        return step, layer

    def under_backend() -> None:
        with backend_context(row.backend):
            step()

    return under_backend, layer


# --------------------------------------------------------------------------------------------------- time


def kernel_events(prof) -> list:
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def busy_us(events: list) -> float:
    """The union of the kernels' intervals: the time the GPU ran anything."""
    total, end = 0.0, float("-inf")
    for lo, hi in sorted((e.time_range.start, e.time_range.end) for e in events):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


def self_device_us(event) -> float:
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)


def print_gaps(events: list, rows: int) -> None:
    """Where the GPU waited on the host, and between which kernels."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events)
    gaps, end, last = [], spans[0][0], ""
    for lo, hi, kernel in spans:
        if lo > end:
            gaps.append((lo - end, end - spans[0][0], last, kernel))
        if hi > end:
            end, last = hi, kernel
    print(f"idle: {sum(g[0] for g in gaps) / 1e3:.2f} ms in {len(gaps)} gaps; the longest:")
    print("| gap us | at ms | after | before |\n|---|---|---|---|")
    for gap, at, after, before in sorted(gaps, reverse=True)[:rows]:
        print(f"| {gap:.0f} | {at / 1e3:.2f} | {after[:50]} | {before[:50]} |")


def profile_time(name: str, B: int, T: int, args: argparse.Namespace) -> None:
    from torch.profiler import ProfilerActivity, profile

    release_chunk_graphs()
    torch.cuda.empty_cache()
    step, _keep = training_step(name, B, T)
    wall = median_ms(step, warmup=2, iters=3, repeats=3)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    events = kernel_events(prof)
    by_name: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in events:
        by_name[e.name][0] += 1
        by_name[e.name][1] += e.time_range.elapsed_us()
    total = sum(t for _, t in by_name.values())
    print(f"\n## {name}  B={B} T={T}: wall {wall:.2f} ms, kernels {total / 1e3:.2f} ms ({len(events)} launches), "
          f"GPU busy {busy_us(events) / 1e3:.2f} ms", flush=True)
    print("| kernel | launches | ms | us each |\n|---|---|---|---|")
    for kernel, (count, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:args.rows]:
        print(f"| {kernel[:90]} | {count} | {t / 1e3:.2f} | {t / count:.1f} |")
    if args.gaps and events:
        print_gaps(events, args.rows)
    if args.cpu:  # the host's side: which calls take its time
        ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        print(f"host: {sum(e.self_cpu_time_total for e in ops) / 1e3:.2f} ms of self time\n"
              "| call | calls | self ms on the host |\n|---|---|---|")
        for e in ops[:args.rows]:
            print(f"| {e.key[:80]} | {e.count} | {e.self_cpu_time_total / 1e3:.2f} |")
    if args.ops:  # the PyTorch ops behind the kernels: which glue there is to remove
        ops = [e for e in prof.key_averages() if e.key.startswith("aten::") and self_device_us(e) > 0]
        print("| op | calls | self ms on the GPU |\n|---|---|---|")
        for e in sorted(ops, key=lambda e: -self_device_us(e))[:args.rows]:
            print(f"| {e.key} | {e.count} | {self_device_us(e) / 1e3:.2f} |")


# ------------------------------------------------------------------------------------------------- memory

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
    for e in events[:peak_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        else:
            live.pop(e["addr"], None)
    return peak, live


def profile_memory(name: str, B: int, T: int, args: argparse.Namespace) -> None:
    release_chunk_graphs()
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    step, keep = training_step(name, B, T)
    step()  # compile, capture, autotune outside the history
    for p in (keep.parameters() if isinstance(keep, torch.nn.Module) else ()):
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
    print(f"\n## {name}  B={B} T={T}: peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB (before the step "
          f"{base / 2**30:.2f} GiB: weights, inputs; the step's own peak {peak / 2**30:.2f} GiB)")
    print("| allocated at | blocks | MB |\n|---|---|---|")
    for site, sizes in sorted(by_site.items(), key=lambda kv: -sum(kv[1]))[:args.rows]:
        if sum(sizes) >= args.min_mb * 1e6:
            print(f"| {site} | {len(sizes)} | {sum(sizes) / 1e6:.0f} |")


# ------------------------------------------------------------------------------------------------- decode


def profile_decode(name: str, B: int, args: argparse.Namespace) -> None:
    from torch.profiler import ProfilerActivity, profile

    from bench_decode import MODELS

    model = MODELS[name]().to(DEVICE, DTYPE).eval()
    with torch.no_grad():
        cache = model(input_ids=torch.randint(0, VOCAB, (B, args.prompt), device=DEVICE), use_cache=True
                      ).past_key_values
        token = torch.randint(0, VOCAB, (B, 1), device=DEVICE)

        def step():
            return model(input_ids=token, past_key_values=cache, use_cache=True)

        if args.graph:  # what generate(cuda_graph=True) sets: the first step captures, the next ones replay
            cache.decode_graphs = True
        steps = args.graph_steps if args.graph else 1
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps
    kernels = kernel_events(prof)
    kind = "graphed decode step" if args.graph else "decode step"
    print(f"\n## {kind} of {name}, B={B} after {args.prompt} tokens: {len(kernels) / steps:.0f} kernels, "
          f"{sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / steps:.3f} ms of kernel time in "
          f"{wall * 1e3:.2f} ms of wall time a step (profiled; totals below over {steps} step(s))")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))
    if args.sequence:
        ordered = sorted(kernels, key=lambda e: e.time_range.start)[:len(kernels) // steps]
        t0 = ordered[0].time_range.start if ordered else 0.0
        print("| start us | us | kernel |\n|---|---|---|")
        for e in ordered:
            print(f"| {e.time_range.start - t0:.1f} | {e.time_range.elapsed_us():.2f} | {e.name[:100]} |")


# --------------------------------------------------------------------------------------------------- main


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layer", help="comma-separated substrings of target names (required unless --list)")
    parser.add_argument("--list", action="store_true", help="print the targets of --mode and exit")
    parser.add_argument("--mode", choices=("time", "memory", "decode"), default="time")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="T (default %(default)s)")
    parser.add_argument("--tokens", type=int, default=TOKENS, help="tokens per step; B = max(1, tokens // T)")
    parser.add_argument("--tf32", action="store_true", help="torch.set_float32_matmul_precision('high')")
    parser.add_argument("--rows", type=int, default=25, help="rows per table (default %(default)s)")
    parser.add_argument("--ops", action="store_true", help="time: the PyTorch ops by their kernels' time")
    parser.add_argument("--gaps", action="store_true", help="time: the longest idle stretches of the GPU")
    parser.add_argument("--cpu", action="store_true", help="time: the host's calls by their own time")
    parser.add_argument("--min-mb", type=float, default=4, help="memory: smallest allocation site shown (MB)")
    parser.add_argument("--model-layers", type=int, default=24,
                        help="blocks of the whole-model targets model_* (default %(default)s)")
    parser.add_argument("--batches", default="1,16", help="decode: batch sizes (default %(default)s)")
    parser.add_argument("--prompt", type=int, default=1024, help="decode: prompt length (default %(default)s)")
    parser.add_argument("--graph", action="store_true", help="decode: profile replays of the captured step")
    parser.add_argument("--sequence", action="store_true",
                        help="decode: one step's kernels in the order they ran, with start and duration")
    parser.add_argument("--graph-steps", type=int, default=5, help="decode --graph: replays profiled (default %(default)s)")
    args = parser.parse_args(argv)
    if not args.list and not args.layer:
        parser.error("--layer is required (see --list)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.mode == "decode":
        from bench_decode import MODELS

        targets = [name for name in MODELS if picked(name, names(args.layer))]
    else:
        targets = [name for name in training_targets() if picked(name, names(args.layer))]
    if args.list:
        print("\n".join(targets))
        return 0
    if args.tf32:
        torch.set_float32_matmul_precision("high")
    MODEL_LAYERS[0] = args.model_layers
    for name in targets:
        if args.mode == "decode":
            for B in ints(args.batches):
                profile_decode(name, B, args)
            continue
        for T in ints(args.lengths):
            (profile_time if args.mode == "time" else profile_memory)(name, max(1, args.tokens // T), T, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
