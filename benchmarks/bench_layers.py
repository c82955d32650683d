"""Layer forward+backward speed of mnemo's PyTorch paths beside SDPA attention (GPU, bf16).

Same work as shared/anchors/bench_anchors.py: hidden 1024, 16,384 tokens per batch
at T=2048 (B=8) and T=8192 (B=2). Prints one JSON line per measurement and writes
``$OUT/bench_layers.json``. Run on the GPU machine with mnemo importable.
``ONLY=name[,name]`` picks layers (by substring), ``TF32=1`` lets float32 matmuls use TF32 tensor cores
(``torch.set_float32_matmul_precision("high")``), ``ITERS=n`` times n steps, ``LENGTHS=2048,8192,32768``
picks the sequence lengths (batch ``max(1, TOKENS // T)``). ``SWEEP=key=v1,v2`` times every layer with each
value of one launch constant of the deep memories' chunk kernels (``titans_chunk_forward_triton.BLOCKS``).

Where ``titans_pytorch`` is importable, the anchor's Titans layer (its ``NeuralMemory``, 4 heads x 256, chunk
64, as in bench_anchors.py) is timed too, row ``anchor_titans_pytorch_neural_memory_c64``: the anchors' table
was measured on another GPU kind, and a ratio holds only between rows of one process.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F

from mnemo import AtlasConfig, DeepTransformerConfig, MCTitansConfig, MoMConfig
from mnemo.kernels.backend import use_backend
from mnemo.kernels.chunk_loop import release_graphs
from mnemo.modeling.atlas_layer import AtlasMemory
from mnemo.modeling.deep_attention_layer import DeepAttention
from mnemo.modeling.mc_titans_layer import MCTitansLayer
from mnemo.modeling.mom_layer import MoMMemoryLayer

D, TOKENS = 1024, 16384
DEV, DT = "cuda", torch.bfloat16
results: dict = {"env": {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}}
try:
    import transformers
    import triton

    results["env"].update(triton=triton.__version__, transformers=transformers.__version__)
except ImportError:
    pass


def bench(fn, warmup=2, iters=5, repeats=1):
    """Milliseconds per call of ``fn`` run back to back: the median over ``repeats`` timed loops of ``iters``
    calls (one slow loop, from a clock change or another process, then moves nothing)."""
    for _ in range(warmup):
        fn()
    loops = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        loops.append((time.perf_counter() - start) / iters * 1e3)
    return sorted(loops)[len(loops) // 2]


def layer_fwd_bwd_ms(layer: nn.Module, B: int, T: int, **bench_kwargs) -> float:
    """Forward + backward time of ``layer`` on a random ``(B, T, D)`` bf16 input (first output summed)."""
    x = torch.randn(B, T, D, device=DEV, dtype=DT, requires_grad=True)

    def step():
        x.grad = None
        out = layer(x)
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()

    return bench(step, **bench_kwargs)


class SdpaAttention(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))


class DeepLayer(nn.Module):
    """``backend="triton"`` runs the layer under ``use_backend("triton")``: the Hebbian key pass as the
    wavefront kernels, which automatic selection does not take."""

    def __init__(self, depth, backend=None):
        super().__init__()
        self.backend = backend
        self.attn = DeepAttention(DeepTransformerConfig(hidden_size=D, num_attention_heads=16, memory_depth=depth), 0)
        if depth == 2:
            nn.init.normal_(self.attn.memory_w1, std=0.02)

    def forward(self, x):
        positions = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        with use_backend(self.backend) if self.backend else contextlib.nullcontext():
            return self.attn(x, positions)


def titans_layer(segment_size, heads=4, **overrides):
    config = MCTitansConfig(hidden_size=D, num_heads=heads, head_dim=D // heads, memory_expansion=4,
                            inner_chunk_size=64, segment_size=segment_size, **overrides)
    layer = MCTitansLayer(config, 0)
    for p in layer.memory_init().values():
        nn.init.normal_(p, std=0.02)
    return layer


def atlas_layer(preset, **overrides):
    # the paper's 340M layer: hidden 1024, 16 heads of 64, MLP memory x4, window 16, chunk 64
    layer = AtlasMemory(AtlasConfig.preset(preset, hidden_size=D, num_heads=16, **overrides), 0)
    for p in layer.memory_init().values():
        nn.init.normal_(p, std=0.02)
    return layer


LAYERS = {
    "sdpa_attention_16x64": lambda: SdpaAttention(D, 16),
    "mnemo_deep_transformer_depth1_16x64": lambda: DeepLayer(1),
    "mnemo_deep_transformer_depth2_16x64_torch": lambda: DeepLayer(2),
    "mnemo_deep_transformer_depth2_16x64_wavefront": lambda: DeepLayer(2, "triton"),
    "mnemo_mom_4x2_shared_torch": lambda: MoMMemoryLayer(MoMConfig(hidden_size=D, num_heads=4, head_dim=256), 0),
    "mnemo_titans_4x256_mlp4_c64_torch": lambda: titans_layer(None),
    "mnemo_mc_titans_grm_seg256_4x256_mlp4_c64_torch": lambda: titans_layer(256),
    "mnemo_mc_titans_ssc2_seg256_4x256_mlp4_c64_torch": lambda: titans_layer(256, aggregation="ssc", ssc_topk=2),
    "mnemo_titans_16x64_mlp4_c64_torch": lambda: titans_layer(None, heads=16),
    "mnemo_atlas_omeganet_gd_16x64_torch": lambda: atlas_layer("omeganet"),
    "mnemo_atlas_momentum_16x64_torch": lambda: atlas_layer("atlas", inner_optimizer="momentum"),
    "mnemo_atlas_muon_16x64_torch": lambda: atlas_layer("atlas"),
}


try:  # the anchor, where installed (not a dependency of mnemo)
    from titans_pytorch import NeuralMemory

    LAYERS["anchor_titans_pytorch_neural_memory_c64"] = lambda: NeuralMemory(dim=D, chunk_size=64, heads=4,
                                                                             dim_head=256)
except ImportError:
    pass


def record(**row):
    results.setdefault("rows", []).append(row)
    print(json.dumps(row), flush=True)


def main():
    only = [name for name in os.environ.get("ONLY", "").split(",") if name]
    tf32 = os.environ.get("TF32") == "1"
    if tf32:
        torch.set_float32_matmul_precision("high")
    iters = int(os.environ.get("ITERS", 5))
    tokens = int(os.environ.get("TOKENS", TOKENS))
    key, _, values = os.environ.get("SWEEP", "").partition("=")
    from mnemo.kernels.titans_chunk_forward_triton import BLOCKS

    variants = [(key, int(v)) for v in values.split(",")] if key else [(None, None)]
    for T in (int(x) for x in os.environ.get("LENGTHS", "2048,8192").split(",")):
        B = max(1, tokens // T)
        for (name, make), (block, value) in ((item, v) for item in LAYERS.items() for v in variants):
            if only and not any(part in name for part in only):
                continue
            if block:
                BLOCKS[block] = value
                name = f"{name} {block}={value}"
            try:
                # The chunk loops keep CUDA graphs (and their memory pools) of earlier shapes: dropped, so that
                # each layer's peak is its own, not that of every layer measured before it.
                release_graphs()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                layer = make().to(DEV, DT)
                ms = layer_fwd_bwd_ms(layer, B, T, iters=iters)
                record(layer=name, T=T, B=B, tf32=tf32, ms=round(ms, 2), tok_per_s=round(B * T / ms * 1e3),
                       peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
                del layer
            except Exception as exc:  # a layer that does not fit is a result too
                traceback.print_exc()
                record(layer=name, T=T, B=B, err=repr(exc)[:300])
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "bench_layers.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
