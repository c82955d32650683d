"""MoM on the GPU: mnemo's layer and model beside the anchors, one process, one table.

Same work as shared/anchors/bench_anchors.py: bf16, hidden 1024, 4 heads x 256,
4 memories top-2 + shared, 16,384 tokens per batch at T=2048 and T=8192, and
4-layer models decoding after 1K / 16K / 64K-token prompts. Run on the GPU machine
with mnemo installed (``python -m benchmarks.mom`` or ``python benchmarks/mom.py``; ``ONLY=train|kernel|decode``
runs one part; ``ANCHORS=1`` adds fla's layers, ``ANCHOR_DECODE=1`` also its MoM model). The anchors need
flash-linear-attention 0.6.0 (wheels: shared/tools/anchor-wheels.sh). Prints JSON lines as it goes, then
one markdown table per part, and writes ``$OUT/mom.json``.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.nn.functional as F

from mnemo import MoMConfig, MoMForCausalLM
from mnemo.kernels import chunk_gated_delta, use_backend
from mnemo.modeling.mom_layer import MoMMemoryLayer

import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its siblings, as `python -m benchmarks.mom` too
from bench_layers import SdpaAttention, bench, layer_fwd_bwd_ms  # noqa: E402
from decode import decode_ms, prefill  # noqa: E402

D, TOKENS, DEV, DT = 1024, 16384, "cuda", torch.bfloat16
results: dict = {"env": {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}}
try:
    import transformers
    import triton

    results["env"].update(triton=triton.__version__, transformers=transformers.__version__)
except ImportError:
    pass


def record(**row):
    results.setdefault("rows", []).append(row)
    print(json.dumps(row), flush=True)


def fla_modules():
    """fla's layers and models with ``ANCHORS=1``, else None; its Hopper guard is lifted for timing only
    (see ANCHORS.md). fla autotunes on first use, which takes minutes."""
    if not os.environ.get("ANCHORS"):
        return None
    try:
        import fla.ops.common.chunk_o as chunk_o

        chunk_o.TRITON_ABOVE_3_7_1 = True
        import fla.layers
        import fla.models
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as exc:  # the anchors are optional
        record(what="fla_import", err=repr(exc)[:200])
        return None
    return fla.layers, fla.models, chunk_gated_delta_rule


def mom_config(**kw) -> MoMConfig:
    return MoMConfig(hidden_size=D, num_heads=4, head_dim=256, num_memories=4, topk=2, shared_memory=True, **kw)


def train(fla):
    layers = {"mnemo_mom_triton": ("triton", lambda: MoMMemoryLayer(mom_config(), 0)),
              "mnemo_mom_torch": ("torch", lambda: MoMMemoryLayer(mom_config(), 0)),
              "sdpa_attention_16x64": ("torch", lambda: SdpaAttention(D, 16))}
    if fla is not None:
        layers["fla_mom"] = ("torch", lambda: fla[0].MomAttention(
            hidden_size=D, head_dim=256, num_heads=4, expand_v=1, num_memories=4, topk=2, shared_mem=True))
        layers["fla_gated_deltanet"] = ("torch", lambda: fla[0].GatedDeltaNet(
            hidden_size=D, head_dim=256, num_heads=4, expand_v=1))
    for T in (2048, 8192):
        B = TOKENS // T
        for name, (backend, make) in layers.items():
            try:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                layer = make().to(DEV, DT)
                with use_backend(backend):
                    ms = layer_fwd_bwd_ms(layer, B, T, warmup=3, iters=10, repeats=3)
                record(what="train_fwd_bwd", layer=name, T=T, B=B, ms=round(ms, 2),
                       peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
                del layer
            except Exception as exc:
                record(what="train_fwd_bwd", layer=name, T=T, B=B, err=repr(exc)[:300])


def kernel(fla):
    """The recurrence alone, 4 heads x 256, bf16: 16K tokens (B=8, T=2K) and 48K (B=24)."""
    for B in (8, 24):
        T = 2048
        gen = torch.Generator(device=DEV).manual_seed(0)
        q, k, v = (torch.randn(B, T, 4, 256, device=DEV, dtype=DT, generator=gen).requires_grad_() for _ in range(3))
        g = (-F.softplus(torch.randn(B, T, 4, device=DEV, generator=gen))).requires_grad_()
        beta = torch.rand(B, T, 4, device=DEV, generator=gen).requires_grad_()
        runs = {"mnemo_triton": lambda: chunk_gated_delta(q, k, v, g, beta)}
        if fla is not None:
            runs["fla_chunk_gated_delta_rule"] = lambda: fla[2](q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        for name, fn in runs.items():
            with use_backend("triton" if name.startswith("mnemo") else "torch"):
                fwd = bench(lambda: fn(), warmup=2, iters=10)
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                both = bench(lambda: fn()[0].float().sum().backward(), warmup=2, iters=10)
                peak = (torch.cuda.max_memory_allocated() - base) / 2**30
                with torch.no_grad():
                    inference = bench(lambda: fn(), warmup=2, iters=10)
            record(what="kernel", impl=name, B=B, T=T, fwd_ms=round(fwd, 2), fwd_bwd_ms=round(both, 2),
                   no_grad_fwd_ms=round(inference, 2), fwd_bwd_peak_gib_above_inputs=round(peak, 2))


def decode(fla):
    models = {"mnemo_mom": lambda: MoMForCausalLM(mom_config(num_hidden_layers=4, vocab_size=32000))}
    if fla is not None and os.environ.get("ANCHOR_DECODE"):  # ANCHORS.md has them; ~1 s per token at B=16
        models["fla_mom"] = lambda: fla[1].MomForCausalLM(fla[1].MomConfig(
            hidden_size=D, num_hidden_layers=4, num_heads=4, head_dim=256, expand_v=1, num_memories=4, topk=2,
            shared_mem=True, vocab_size=32000))
    for name, make in models.items():
        model = make().to(DEV, DT).eval()
        for B, P in ((1, 1024), (1, 16384), (1, 65536), (16, 1024), (16, 16384)):
            try:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                cache, token, seconds = prefill(model, B, P)
                row = dict(what="decode", model=name, B=B, prompt=P,
                           ms_per_token=round(decode_ms(model, cache, token, graph=False), 2),
                           prefill_s=round(seconds, 2), peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
                if name.startswith("mnemo"):
                    # the same steps replayed as a CUDA graph (generate(cuda_graph=True)'s path)
                    row["graph_ms_per_token"] = round(decode_ms(model, cache, token, graph=True), 3)
                    if P == 1024:
                        ids = torch.randint(0, 32000, (B, P), device=DEV)
                        for graph in (False, True):
                            row["graph_generate_tok_per_s" if graph else "generate_tok_per_s"] = \
                                generate_tok_per_s(model, ids, graph)
                record(**row)
            except Exception as exc:
                record(what="decode", model=name, B=B, prompt=P, err=repr(exc)[:300])
        del model


def generate_tok_per_s(model, ids, graph: bool, new_tokens: int = 64) -> int:
    with torch.no_grad():
        model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, cuda_graph=graph)
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, cuda_graph=graph)
        torch.cuda.synchronize()
    return round(ids.shape[0] * new_tokens / (time.perf_counter() - start))


def print_tables(rows: list[dict]) -> None:
    """One markdown table per part, rows in the order they ran; errors keep their message."""
    for what in ("kernel", "train_fwd_bwd", "decode"):
        part = [r for r in rows if r.get("what") == what]
        if not part:
            continue
        columns = [c for c in dict.fromkeys(k for r in part for k in r) if c != "what"]
        print(f"\n{what}\n\n| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
        for r in part:
            print("| " + " | ".join(str(r.get(c, "")) for c in columns) + " |")


def main():
    fla = fla_modules()
    only = os.environ.get("ONLY")
    for part in (kernel, train, decode):
        if not only or only == part.__name__:
            part(fla)
    print(json.dumps(results["env"]))
    print_tables(results.get("rows", []))
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "mom.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
