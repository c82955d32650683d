"""Decoding speed of 4-layer models at hidden 1024, eager and through a CUDA graph (GPU, bf16).

One forward per new token with the cache, timed over 32 steps after 8 warm-up steps,
after prompts of several lengths (the cost per token must not grow with them);
"graph" replays the same step as a CUDA graph (``generate(cuda_graph=True)``'s
path). Models: Titans (4 heads x 256, MLP x4, chunk 64), Atlas and OmegaNet at the
paper's 340M layer shape (16 heads x 64, MLP x4, window 16), MC-Titans (segment
256; eager only, its cache grows by one memory per segment) and the MoM of
``benchmarks/mom.py``. ``python benchmarks/decode.py`` on the GPU machine
(``ONLY=titans`` picks models by name, ``PROMPTS=1024,16384``); JSON lines, and
``$OUT/decode.json``.
"""

from __future__ import annotations

import json
import os
import time

import torch

from mnemo import AtlasConfig, AtlasForCausalLM, MCTitansConfig, MCTitansForCausalLM, MoMConfig, MoMForCausalLM

D, VOCAB, DEV, DT = 1024, 32000, "cuda", torch.bfloat16


def decode_ms(model, cache, token: torch.Tensor, graph: bool, steps: int = 32, warmup: int = 8) -> float:
    """Milliseconds per one-token step of ``model`` continuing ``cache`` (greedy, from ``token``)."""
    cache.decode_graphs = graph
    with torch.no_grad():
        for _ in range(warmup):  # the first graphed step captures
            token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
    cache.decode_graphs, cache.decode_graph = False, None
    return (time.perf_counter() - start) / steps * 1e3


def prefill(model, batch: int, prompt: int):
    """A cached forward of a random prompt: ``(cache, next token, seconds)``."""
    ids = torch.randint(0, VOCAB, (batch, prompt), device=DEV)
    with torch.no_grad():
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        torch.cuda.synchronize()
    return out.past_key_values, out.logits[:, -1:].argmax(-1), time.perf_counter() - start


MODELS = {
    "titans_4x256_mlp4": lambda: MCTitansForCausalLM(MCTitansConfig(
        hidden_size=D, num_hidden_layers=4, num_heads=4, head_dim=256, memory_expansion=4, inner_chunk_size=64,
        segment_size=None, vocab_size=VOCAB)),
    "atlas_muon_16x64": lambda: AtlasForCausalLM(AtlasConfig.preset(
        "atlas", hidden_size=D, num_hidden_layers=4, num_heads=16, vocab_size=VOCAB)),
    "atlas_omeganet_16x64": lambda: AtlasForCausalLM(AtlasConfig.preset(
        "omeganet", hidden_size=D, num_hidden_layers=4, num_heads=16, vocab_size=VOCAB)),
    "mc_titans_grm_seg256": lambda: MCTitansForCausalLM(MCTitansConfig(
        hidden_size=D, num_hidden_layers=4, num_heads=4, head_dim=256, memory_expansion=4, inner_chunk_size=64,
        segment_size=256, vocab_size=VOCAB)),
    "mom_4x2_shared": lambda: MoMForCausalLM(MoMConfig(
        hidden_size=D, num_hidden_layers=4, num_heads=4, head_dim=256, num_memories=4, topk=2, shared_memory=True,
        vocab_size=VOCAB)),
}


def main():
    only = os.environ.get("ONLY")
    prompts = [int(p) for p in os.environ.get("PROMPTS", "1024,16384").split(",")]
    results = {"env": {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}, "rows": []}
    for name, make in MODELS.items():
        if only and only not in name:
            continue
        model = make().to(DEV, DT).eval()
        graphable = not model.decode_graph_obstacle(model.config)
        for prompt in prompts:
            try:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                cache, token, seconds = prefill(model, 1, prompt)
                row = dict(model=name, B=1, prompt=prompt, prefill_s=round(seconds, 2),
                           eager_ms=round(decode_ms(model, cache, token, graph=False), 3))
                if graphable:
                    row["graph_ms"] = round(decode_ms(model, cache, token, graph=True), 3)
                row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            except Exception as exc:  # a model that fails is a result too
                row = dict(model=name, B=1, prompt=prompt, err=repr(exc)[:300])
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
        del model
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "decode.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
