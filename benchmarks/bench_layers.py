"""One layer's training step on the GPU, every family beside its anchors: time, tokens/s, peak memory.

What it measures: one layer's forward + backward (the first output summed in float32, then
``backward()``) on a random ``(B, T, 1024)`` bf16 input, at the anchors' work: 16,384 tokens per step at
T=2048 (B=8) and T=8192 (B=2). The memories compute in float32 (TF32 products for bf16 problems). Rows:

- anchors: PyTorch SDPA causal attention (16 heads x 64); flash-linear-attention 0.6.0's
  ``GatedDeltaNet`` (4 heads x 256) and ``MomAttention`` (4 memories, top-2 + shared); titans-pytorch's
  ``NeuralMemory`` (4 heads x 256, chunk 64). fla and titans-pytorch are not dependencies of mnemo: their
  rows run where they import and are reported as skipped elsewhere (``benchmarks/README.md`` says how to
  install them). fla's Hopper guard is lifted for timing only (see ``benchlib.lift_fla_hopper_guard``).
- mnemo: MoM (4 heads x 256, 4 memories top-2 + shared; automatic backend and the PyTorch path),
  DeepTransformer (16 x 64; depth 1, depth 2 Hebbian with the automatic key pass and on the PyTorch path),
  Titans and MC-Titans grm / ssc top 2 (4 x 256, MLP x4, chunk 64, segments of 256), Titans and MC-Titans grm
  and soup at 16 x 64, Titans with a gated memory at 16 x 64, and Atlas OmegaNet / momentum / Muon at the
  paper's 340M layer (16 x 64, MLP x4, window 16).

How: each row in turn, in one process, so ratios between rows hold (absolute times only for the GPU
kind). A row's time is the median of ``--repeats`` loops of ``--iters`` steps after ``--warmup`` steps;
its peak is ``torch.cuda.max_memory_allocated`` over those steps, with the chunk loops' captured graphs
of earlier rows released first. A row that fails (out of memory, a missing package) is a row with its
error. ``--sweep`` times every row with each value of one launch constant of the deep memories' chunk
kernels or of a kernel module's switch (``--sweep titans_persistent_triton.FIRST_PASS=0,1``); ``--checkpoint-every``, ``--chunk-forward`` and ``--chunk-backward`` run the deep memories'
chunk loops with another checkpoint spacing or comparison path (``loop_options``, ``comparison_paths``).

Prints one JSON line per row as it goes, then a markdown table (layer, T, B, ms, tok/s, peak GiB);
writes ``bench_layers.json`` (environment and rows) to ``--out`` (default ``$OUT`` or the current
directory). ``--list`` prints the rows' names. Run on a GPU machine with mnemo importable, e.g.
``python benchmarks/bench_layers.py --tf32 --only sdpa,anchor,titans_4x256,mc_titans``.
"""

from __future__ import annotations

import argparse
import contextlib
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from benchlib import (DEVICE, DTYPE, HIDDEN, LENGTHS, TOKENS, Recorder, ints, launch_constant, lift_fla_hopper_guard,
                      median_ms, names, out_dir, peak_gib, picked, release_chunk_graphs, reset_peak, setting,
                      sweep_values, warm_up_gpu)


class SdpaAttention(nn.Module):
    """The attention anchor: fused q/k/v projection, PyTorch's causal SDPA, output projection."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))


@dataclass(frozen=True)
class Row:
    """A layer to time: its factory and the backend it runs under (``None``: automatic selection)."""

    make: Callable[[], nn.Module]
    backend: str | None = None


def mom_layer() -> nn.Module:
    from mnemo import MoMConfig
    from mnemo.modeling.mom_layer import MoMLayer

    return MoMLayer(MoMConfig(hidden_size=HIDDEN, num_heads=4, head_dim=256, num_memories=4, topk=2,
                              shared_memory=True), 0)


def deep_transformer_layer(depth: int, **overrides) -> nn.Module:
    from mnemo import DeepTransformerConfig
    from mnemo.modeling.deep_attention_layer import DeepAttentionLayer

    layer = DeepAttentionLayer(DeepTransformerConfig(hidden_size=HIDDEN, num_attention_heads=16,
                                                     memory_depth=depth, **overrides), 0)
    if depth == 2:  # zero-initialised, the deep branch would write nothing and its kernels see zeros
        nn.init.normal_(layer.memory_w1, std=0.02)
    return layer


def titans_layer(segment_size: int | None, heads: int = 4, **overrides) -> nn.Module:
    from mnemo import MCTitansConfig
    from mnemo.modeling.mc_titans_layer import MCTitansLayer

    config = MCTitansConfig(hidden_size=HIDDEN, num_heads=heads, head_dim=HIDDEN // heads, memory_expansion=4,
                            inner_chunk_size=64, segment_size=segment_size, **overrides)
    layer = MCTitansLayer(config, 0)
    for p in layer.memory_init().values():  # as for depth 2 above: a memory that starts at zero reads zero
        nn.init.normal_(p, std=0.02)
    return layer


def atlas_layer(preset: str, **overrides) -> nn.Module:
    from mnemo import AtlasConfig
    from mnemo.modeling.atlas_layer import AtlasLayer

    # the paper's 340M layer: 16 heads of 64, MLP memory x4, window 16, chunk 64
    layer = AtlasLayer(AtlasConfig.preset(preset, hidden_size=HIDDEN, num_heads=16, **overrides), 0)
    for p in layer.memory_init().values():
        nn.init.normal_(p, std=0.02)
    return layer


def fla_layer(kind: str) -> nn.Module:
    lift_fla_hopper_guard()
    from fla.layers import GatedDeltaNet, MomAttention

    if kind == "gdn":
        return GatedDeltaNet(hidden_size=HIDDEN, head_dim=256, num_heads=4, expand_v=1)
    return MomAttention(hidden_size=HIDDEN, head_dim=256, num_heads=4, expand_v=1, num_memories=4, topk=2,
                        shared_mem=True)


def titans_pytorch_layer() -> nn.Module:
    from titans_pytorch import NeuralMemory

    return NeuralMemory(dim=HIDDEN, chunk_size=64, heads=4, dim_head=256)


LAYERS: dict[str, Row] = {
    "sdpa_attention_16x64": Row(lambda: SdpaAttention(HIDDEN, 16)),
    "anchor_fla_gated_deltanet_4x256": Row(lambda: fla_layer("gdn")),
    "anchor_fla_mom_attention_4x2_shared": Row(lambda: fla_layer("mom")),
    "anchor_titans_pytorch_neural_memory_c64": Row(titans_pytorch_layer),
    "mom_4x2_shared": Row(mom_layer),
    "mom_4x2_shared_torch": Row(mom_layer, "torch"),
    "deep_transformer_depth1_16x64": Row(lambda: deep_transformer_layer(1)),
    "deep_transformer_depth2_16x64": Row(lambda: deep_transformer_layer(2)),
    "deep_transformer_depth2_16x64_torch": Row(lambda: deep_transformer_layer(2), "torch"),
    # Dot (the omega rule, the Atlas window of 16): the chunk loop, its reads flash-style in Triton or formed in torch
    "dot_depth2_w16_16x64": Row(lambda: deep_transformer_layer(2, learning_rule="omega", omega_window=16)),
    "dot_depth2_w16_16x64_torch": Row(lambda: deep_transformer_layer(2, learning_rule="omega", omega_window=16),
                                      "torch"),
    "titans_4x256_mlp4_c64": Row(lambda: titans_layer(None)),
    "mc_titans_grm_seg256_4x256": Row(lambda: titans_layer(256)),
    "mc_titans_ssc2_seg256_4x256": Row(lambda: titans_layer(256, aggregation="ssc", ssc_topk=2)),
    "titans_16x64_mlp4_c64": Row(lambda: titans_layer(None, heads=16)),
    "titans_gated_16x64_mlp4_c64": Row(lambda: titans_layer(None, heads=16, memory_gated=True)),
    "mc_titans_grm_seg256_16x64": Row(lambda: titans_layer(256, heads=16)),
    "mc_titans_soup_seg256_16x64": Row(lambda: titans_layer(256, heads=16, aggregation="soup")),
    "atlas_omeganet_16x64": Row(lambda: atlas_layer("omeganet")),
    "atlas_momentum_16x64": Row(lambda: atlas_layer("atlas", inner_optimizer="momentum")),
    "atlas_muon_16x64": Row(lambda: atlas_layer("atlas")),
}


def train_step(layer: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    """One forward + backward of ``layer`` on ``x``; tuple outputs (a MoM layer's loss beside its output)
    count by their first element."""

    def step() -> None:
        x.grad = None
        out = layer(x)
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()

    return step


def backend_context(backend: str | None) -> contextlib.AbstractContextManager:
    if backend is None:
        return contextlib.nullcontext()
    from mnemo.kernels.backend import use_backend

    return use_backend(backend)


def loop_context(args: argparse.Namespace) -> contextlib.ExitStack:
    """The chunk loops' spacing, comparison paths and held constants (``--set``) asked for on the command line
    (none: the defaults). Built inside a ``with`` so that a setting that fails restores those made before it."""
    with contextlib.ExitStack() as stack:
        if args.checkpoint_every is not None:
            from mnemo.kernels.chunk_loop import loop_options

            stack.enter_context(loop_options(checkpoint_every=args.checkpoint_every))
        if args.chunk_forward or args.chunk_backward:
            from mnemo.kernels.backend import comparison_paths

            stack.enter_context(comparison_paths(chunk_forward=args.chunk_forward,
                                                 chunk_backward=args.chunk_backward))
        for key, value in args.set:
            stack.enter_context(launch_constant(key, value))
        return stack.pop_all()


def measure(recorder: Recorder, name: str, row: Row, B: int, T: int, args: argparse.Namespace,
            block: tuple[str | None, int | None]) -> None:
    key, value = block
    label = f"{name} {key}={value}" if key else name
    backend = args.backend if args.backend != "auto" else row.backend
    try:
        release_chunk_graphs()
        reset_peak()
        layer = row.make().to(DEVICE, DTYPE)
        x = torch.randn(B, T, HIDDEN, device=DEVICE, dtype=DTYPE, requires_grad=True)
        with backend_context(backend), loop_context(args), launch_constant(key, value):
            ms = median_ms(train_step(layer, x), warmup=args.warmup, iters=args.iters, repeats=args.repeats)
        recorder.record(layer=label, T=T, B=B, backend=backend or "auto", tf32=args.tf32, ms=round(ms, 2),
                        tok_per_s=round(B * T / ms * 1e3), peak_gib=peak_gib(),
                        **({"held": dict(args.set)} if args.set else {}))
    except ImportError as exc:
        if not name.startswith("anchor_"):
            raise
        recorder.record(layer=label, T=T, B=B, skipped=f"not installed: {exc.name or exc}")
    except Exception as exc:  # noqa: BLE001  (a layer that does not fit is a result too)
        traceback.print_exc()
        recorder.record(layer=label, T=T, B=B, err=repr(exc)[:300])


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Rows: " + ", ".join(LAYERS))
    parser.add_argument("--only", help="comma-separated substrings of row names (default: every row)")
    parser.add_argument("--list", action="store_true", help="print the rows' names and exit")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="sequence lengths T (default %(default)s)")
    parser.add_argument("--tokens", type=int, default=TOKENS, help="tokens per step; B = max(1, tokens // T)")
    parser.add_argument("--iters", type=int, default=10, help="steps per timed loop (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=1, help="timed loops; their median counts (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default %(default)s)")
    parser.add_argument("--tf32", action="store_true",
                        help="torch.set_float32_matmul_precision('high') for the whole run")
    parser.add_argument("--backend", choices=("auto", "torch", "triton"), default="auto",
                        help="run every row under this backend (default: each row's own)")
    parser.add_argument("--sweep", metavar="KEY=V1,V2",
                        help="time each row with each value of a key of titans_triton_forward.BLOCKS, of a "
                             "module's constant as module.NAME (titans_persistent_triton.FIRST_PASS=0,1), or of "
                             "a key of a module's dict as module.NAME.key")
    parser.add_argument("--set", metavar="KEY=V", action="append", default=[], type=setting,
                        help="hold a key as --sweep names it at one value for the whole run (repeatable; a key "
                             "that --sweep also names takes the sweep's values)")
    parser.add_argument("--checkpoint-every", type=int, help="the chunk loops' checkpoint spacing (loop_options)")
    parser.add_argument("--chunk-forward", choices=("torch",), help="comparison path of the chunk forward")
    parser.add_argument("--chunk-backward", choices=("torch", "autograd"), help="comparison path of the chunk backward")
    parser.add_argument("--out", help="folder for bench_layers.json (default $OUT or .)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    only = names(args.only)
    chosen = {name: row for name, row in LAYERS.items() if picked(name, only)}
    if args.list:
        print("\n".join(chosen))
        return 0
    if args.tf32:
        torch.set_float32_matmul_precision("high")
    for key, value in [*args.set, *sweep_values(args.sweep)]:  # a misnamed key stops the run before any timing
        with launch_constant(key, value):
            pass
    recorder = Recorder()
    warm_up_gpu()
    for T in ints(args.lengths):
        B = max(1, args.tokens // T)
        for block in sweep_values(args.sweep):
            for name, row in chosen.items():
                measure(recorder, name, row, B, T, args, block)
    recorder.table(["layer", "T", "B", "backend", "ms", "tok_per_s", "peak_gib", "skipped", "err"])
    recorder.write(out_dir(args.out) / "bench_layers.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
