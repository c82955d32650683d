"""Decoding speed of 4-layer models on the GPU: ms per generated token after prompts of several lengths.

What it measures: for 4-layer models at hidden 1024 (bf16, vocab 32,000), after a prefill of a random
prompt of ``P`` tokens at batch ``B``, the time of one greedy decode step (one model forward of one token
per row, through the cache), eager and replayed as a CUDA graph (the path of
``generate(cuda_graph=True)``, for the models whose step can be captured). The cost per token must not
grow with the prompt. Models:

- mnemo: Titans (4 heads x 256, MLP x4, chunk 64), Atlas with Muon and OmegaNet (16 x 64, MLP x4, window
  16), MC-Titans grm and ssc and Atlas (OmegaNet and Muon) with Memory Caching, grm (segments of 256: the
  cache grows by one memory per segment, its slots taken ahead of need, so a captured step serves until
  they run out) and MoM (4 heads x 256, 4 memories top-2 + shared), also with Memory Caching (segments of
  256, grm, whose cache grows as MC-Titans', and mean, a running sum), and the DeepTransformer (16 x 64,
  depth 2, memory hidden 64, chunk 64; Hebbian, and Dot with window 16), whose cache grows with the context
  as a Transformer's (the Hebbian step is graphed with room taken ahead; Dot's runs eager);
- anchors, where installed: flash-linear-attention 0.6.0's ``MomForCausalLM`` and
  ``GatedDeltaNetForCausalLM`` at the same shape, and transformers' Llama (16 heads x 64, SDPA, dynamic
  cache; with ``--generate`` also ``generate(cache_implementation="static")``, transformers' compiled decode
  step, timed per token as the difference of a 136-token and an 8-token generation over 128).

How: per (model, B, P): the prefill's wall time (the first one of a run includes compilation and
autotuning), then ``--warmup`` untimed and ``--steps`` timed eager steps, then the same on the graph
(the first graphed step captures). Peak memory over the prefill and the steps. With ``--generate``,
``generate()``'s tokens per second for ``--generate-tokens`` new tokens, eager and with
``cuda_graph=True``. Shapes with ``B * P`` above ``--max-tokens`` are skipped. ``--sweep module.NAME=0,1``
measures every shape once with each value of a kernel module's switch (an A/B in one process, e.g.
``memory_caching.ONE_TOKEN_READ``), the rows named ``model module.NAME=value``.

Prints one JSON line per (model, B, P), then a markdown table; writes ``bench_decode.json`` to ``--out``
(default ``$OUT`` or the current directory). Run on a GPU machine with mnemo importable, e.g.
``python benchmarks/bench_decode.py --only mom --batches 1,16 --prompts 1024,16384,65536 --generate``.
"""

from __future__ import annotations

import argparse
import time
import traceback
from collections.abc import Callable

import torch

from benchlib import (DEVICE, DTYPE, HIDDEN, VOCAB, Recorder, ints, launch_constant, lift_fla_hopper_guard, names,
                      out_dir, peak_gib, picked, reset_peak, sweep_values)


def titans(segment_size: int | None, aggregation: str = "grm"):
    from mnemo import MCTitansConfig, MCTitansForCausalLM

    return MCTitansForCausalLM(MCTitansConfig(hidden_size=HIDDEN, num_hidden_layers=4, num_heads=4, head_dim=256,
                                              memory_expansion=4, inner_chunk_size=64, segment_size=segment_size,
                                              aggregation=aggregation, vocab_size=VOCAB))


def atlas(preset: str, **overrides):
    from mnemo import AtlasConfig, AtlasForCausalLM

    return AtlasForCausalLM(AtlasConfig.preset(preset, hidden_size=HIDDEN, num_hidden_layers=4, num_heads=16,
                                               vocab_size=VOCAB, **overrides))


def mom(**overrides):
    from mnemo import MoMConfig, MoMForCausalLM

    return MoMForCausalLM(MoMConfig(hidden_size=HIDDEN, num_hidden_layers=4, num_heads=4, head_dim=256,
                                    num_memories=4, topk=2, shared_memory=True, vocab_size=VOCAB, **overrides))


def deep_transformer(**overrides):
    from mnemo import DeepTransformerConfig, DeepTransformerForCausalLM

    return DeepTransformerForCausalLM(DeepTransformerConfig(hidden_size=HIDDEN, num_hidden_layers=4,
                                                            num_attention_heads=16, intermediate_size=4 * HIDDEN,
                                                            vocab_size=VOCAB, memory_depth=2, **overrides))


def fla_model(kind: str):
    lift_fla_hopper_guard()
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM, MomConfig, MomForCausalLM

    if kind == "gdn":
        return GatedDeltaNetForCausalLM(GatedDeltaNetConfig(hidden_size=HIDDEN, num_hidden_layers=4, num_heads=4,
                                                            head_dim=256, expand_v=1, vocab_size=VOCAB))
    return MomForCausalLM(MomConfig(hidden_size=HIDDEN, num_hidden_layers=4, num_heads=4, head_dim=256, expand_v=1,
                                    num_memories=4, topk=2, shared_mem=True, vocab_size=VOCAB))


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=HIDDEN, num_hidden_layers=4, num_attention_heads=16,
                                        intermediate_size=4 * HIDDEN, vocab_size=VOCAB, attn_implementation="sdpa",
                                        max_position_embeddings=70000))


MODELS: dict[str, Callable] = {
    "titans_4x256_mlp4": lambda: titans(None),
    "atlas_muon_16x64": lambda: atlas("atlas"),
    "atlas_omeganet_16x64": lambda: atlas("omeganet"),
    "mc_titans_grm_seg256": lambda: titans(256),
    "mc_titans_ssc_seg256": lambda: titans(256, "ssc"),
    "mc_atlas_omeganet_grm_seg256": lambda: atlas("omeganet", segment_size=256, aggregation="grm"),
    "mc_atlas_muon_grm_seg256": lambda: atlas("atlas", segment_size=256, aggregation="grm"),
    "mom_4x2_shared": mom,
    "mc_mom_4x2_shared_grm_seg256": lambda: mom(segment_size=256, aggregation="grm"),
    "mc_mom_4x2_shared_mean_seg256": lambda: mom(segment_size=256, aggregation="mean"),
    "deep_transformer_16x64": deep_transformer,
    "dot_w16_16x64": lambda: deep_transformer(learning_rule="omega", omega_window=16),
    "anchor_fla_mom_4x2_shared": lambda: fla_model("mom"),
    "anchor_fla_gated_deltanet_4x256": lambda: fla_model("gdn"),
    "anchor_llama_sdpa_16x64": llama,
}


def is_mnemo(model) -> bool:
    return hasattr(model, "decode_graph_obstacle")


def prefill(model, batch: int, prompt: int):
    """A cached forward of a random prompt: ``(cache, next token, seconds)``."""
    ids = torch.randint(0, VOCAB, (batch, prompt), device=DEVICE)
    with torch.no_grad():
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        torch.cuda.synchronize()
    return out.past_key_values, out.logits[:, -1:].argmax(-1), time.perf_counter() - start


def decode_ms(model, cache, token: torch.Tensor, graph: bool, steps: int, warmup: int) -> float:
    """Milliseconds per one-token greedy step of ``model`` continuing ``cache`` from ``token``."""
    if graph:
        cache.decode_graphs = True  # what generate(cuda_graph=True) sets: the first step captures

    def step(token, cache):
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        return out.logits[:, -1:].argmax(-1), (cache if out.past_key_values is None else out.past_key_values)

    with torch.no_grad():
        for _ in range(warmup):
            token, cache = step(token, cache)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            token, cache = step(token, cache)
        torch.cuda.synchronize()
    if graph:
        cache.decode_graphs, cache.decode_graph = False, None
    return (time.perf_counter() - start) / steps * 1e3


def generate_tok_per_s(model, ids: torch.Tensor, graph: bool, new_tokens: int) -> int:
    """``generate()``'s new tokens per second (all rows), after one short call that compiles and captures."""
    with torch.no_grad():
        model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, cuda_graph=graph)
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, cuda_graph=graph)
        torch.cuda.synchronize()
    return round(ids.shape[0] * new_tokens / (time.perf_counter() - start))


def static_generate_ms(model, ids: torch.Tensor) -> float:
    """transformers' static cache with its compiled decode step: ms per token as the difference of a 136- and
    an 8-token ``generate()`` over 128 (the first call compiles and is not timed)."""

    def run(new: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, cache_implementation="static")
        torch.cuda.synchronize()
        return time.perf_counter() - start

    with torch.no_grad():
        run(8)
        return (run(136) - run(8)) / 128 * 1e3


def measure(recorder: Recorder, name: str, model, B: int, P: int, args: argparse.Namespace,
            label: str | None = None) -> None:
    """One row: ``name``'s decode steps after a prompt of ``P`` tokens at batch ``B``, recorded as ``label``
    (default ``name``)."""
    label = label or name
    graphable = is_mnemo(model) and not model.decode_graph_obstacle(model.config) and not args.no_graph
    try:
        reset_peak()
        cache, token, seconds = prefill(model, B, P)
        row = dict(model=label, B=B, prompt=P, prefill_s=round(seconds, 2),
                   eager_ms=round(decode_ms(model, cache, token, False, args.steps, args.warmup), 3))
        if graphable:
            row["graph_ms"] = round(decode_ms(model, cache, token, True, args.steps, args.warmup), 3)
        row["peak_gib"] = peak_gib()
        del cache
        if args.generate:
            ids = torch.randint(0, VOCAB, (B, P), device=DEVICE)
            if is_mnemo(model):
                row["generate_tok_per_s"] = generate_tok_per_s(model, ids, False, args.generate_tokens)
                if graphable:
                    row["graph_generate_tok_per_s"] = generate_tok_per_s(model, ids, True, args.generate_tokens)
            elif name == "anchor_llama_sdpa_16x64":
                row["static_compiled_ms"] = round(static_generate_ms(model, ids), 3)
    except Exception as exc:  # noqa: BLE001  (a model that fails is a result too)
        traceback.print_exc()
        row = dict(model=label, B=B, prompt=P, err=repr(exc)[:300])
    recorder.record(**row)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Models: " + ", ".join(MODELS))
    parser.add_argument("--only", help="comma-separated substrings of model names (default: every model)")
    parser.add_argument("--list", action="store_true", help="print the models' names and exit")
    parser.add_argument("--batches", default="1", help="batch sizes B (default %(default)s)")
    parser.add_argument("--prompts", default="1024,16384", help="prompt lengths P (default %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=16 * 16384,
                        help="skip shapes with B * P above this (default %(default)s)")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=8, help="untimed decode steps first (default %(default)s)")
    parser.add_argument("--no-graph", action="store_true", help="eager steps only")
    parser.add_argument("--generate", action="store_true", help="also generate()'s tokens per second")
    parser.add_argument("--generate-tokens", type=int, default=64, help="new tokens per timed generate()")
    parser.add_argument("--sweep", metavar="KEY=V1,V2",
                        help="time each shape with each value of a kernel module's switch, as module.NAME "
                             "(memory_caching.ONE_TOKEN_READ=0,1)")
    parser.add_argument("--out", help="folder for bench_decode.json (default $OUT or .)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    chosen = {name: make for name, make in MODELS.items() if picked(name, names(args.only))}
    if args.list:
        print("\n".join(chosen))
        return 0
    recorder = Recorder()
    shapes = [(B, P) for B in ints(args.batches) for P in ints(args.prompts) if B * P <= args.max_tokens]
    for name, make in chosen.items():
        try:
            model = make().to(DEVICE, DTYPE).eval()
        except ImportError as exc:
            if not name.startswith("anchor_"):
                raise
            recorder.record(model=name, skipped=f"not installed: {exc.name or exc}")
            continue
        for key, value in sweep_values(args.sweep):
            label = f"{name} {key}={value}" if key else name
            with launch_constant(key, value):
                for B, P in shapes:
                    measure(recorder, name, model, B, P, args, label)
        del model
    recorder.table(["model", "B", "prompt", "eager_ms", "graph_ms", "prefill_s", "peak_gib", "generate_tok_per_s",
                    "graph_generate_tok_per_s", "static_compiled_ms", "skipped", "err"])
    recorder.write(out_dir(args.out) / "bench_decode.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
