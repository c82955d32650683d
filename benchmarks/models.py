"""Whole-model training: tokens/s and peak GiB of every family beside flash-linear-attention's and a Llama.

Every row is a language model of ``--layers`` blocks at hidden 1024 and a 32,000-token
vocabulary (about 400-600M parameters at 24 layers), trained for a few steps on random
tokens with bf16 autocast and fused AdamW, ``--batch x --length`` tokens per step, all
rows one after another in one process:

- mnemo: Gated DeltaNet (MoM with one memory, 4 heads x 256), MoM (4 memories, top-2 +
  shared), Titans (4 heads x 256, MLP x4), MC-Titans (grm and ssc, segments of 256),
  OmegaNet and Atlas (16 heads x 64), DeepTransformer (depth 2);
- anchors, where installed: fla 0.6.0's ``GatedDeltaNetForCausalLM`` and ``MomForCausalLM``
  (their fused cross-entropy, norms and SwiGLU on, as fla ships them) and transformers'
  ``LlamaForCausalLM`` (SDPA).

``--fsdp`` shards every row with FSDP2 (``fully_shard`` on each block, then the model)
when run under ``torchrun --nproc-per-node N``; ``--accelerate`` lets accelerate shard it
as a user's script would, under ``accelerate launch --config_file accelerate_fsdp2.yaml``.
Either way each process takes ``--batch`` rows, the table gives the tokens/s of all
processes together, and the first step's loss on one fixed global batch, which a
one-process run of the same global batch (``--batch`` times N) must give within bf16
rounding. ``host_ms`` is one more step's time until the host has launched all of it: near
``ms_per_step``, the host, not the GPU, sets the pace.

Run: ``python benchmarks/models.py [--only gdn,llama | --rows gdn,anchor_fla_gdn] [--layers 24] [--batch 8
--length 2048]`` (``--only`` takes substrings, so ``gdn`` also picks fla's; ``--rows`` takes exact names).
"""

from __future__ import annotations

import argparse
import os
import time
import traceback
from collections.abc import Callable

import torch

from benchlib import HIDDEN, VOCAB, Recorder, lift_fla_hopper_guard, names, out_dir, peak_gib, picked, reset_peak


def _mom(layers: int, **overrides):
    from mnemo import MoMConfig, MoMForCausalLM

    kwargs = dict(hidden_size=HIDDEN, num_hidden_layers=layers, num_heads=4, head_dim=256, expand_v=1.0,
                  vocab_size=VOCAB, num_memories=4, topk=2, shared_memory=True)
    return MoMForCausalLM(MoMConfig(**{**kwargs, **overrides}))


def _titans(layers: int, **overrides):
    from mnemo import MCTitansConfig, MCTitansForCausalLM

    kwargs = dict(hidden_size=HIDDEN, num_hidden_layers=layers, num_heads=4, head_dim=256, memory_expansion=4,
                  inner_chunk_size=64, segment_size=None, vocab_size=VOCAB)
    return MCTitansForCausalLM(MCTitansConfig(**{**kwargs, **overrides}))


def _atlas(layers: int, preset: str):
    from mnemo import AtlasConfig, AtlasForCausalLM

    return AtlasForCausalLM(AtlasConfig.preset(preset, hidden_size=HIDDEN, num_hidden_layers=layers, num_heads=16,
                                               vocab_size=VOCAB))


def _deep_transformer(layers: int):
    from mnemo import DeepTransformerConfig, DeepTransformerForCausalLM

    return DeepTransformerForCausalLM(DeepTransformerConfig(hidden_size=HIDDEN, num_hidden_layers=layers,
                                                            num_attention_heads=16, intermediate_size=4 * HIDDEN,
                                                            vocab_size=VOCAB, memory_depth=2))


def _fla(layers: int, kind: str):
    lift_fla_hopper_guard()
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM, MomConfig, MomForCausalLM

    if kind == "gdn":
        return GatedDeltaNetForCausalLM(GatedDeltaNetConfig(hidden_size=HIDDEN, num_hidden_layers=layers,
                                                            num_heads=4, head_dim=256, expand_v=1, vocab_size=VOCAB))
    return MomForCausalLM(MomConfig(hidden_size=HIDDEN, num_hidden_layers=layers, num_heads=4, head_dim=256,
                                    expand_v=1, num_memories=4, topk=2, shared_mem=True, vocab_size=VOCAB))


def _llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=16,
                                        intermediate_size=4 * HIDDEN, vocab_size=VOCAB, attn_implementation="sdpa",
                                        max_position_embeddings=70000))


MODELS: dict[str, Callable[[int], torch.nn.Module]] = {
    "gdn": lambda n: _mom(n, num_memories=1, topk=1, shared_memory=False),
    "mom_4x2_shared": _mom,
    "titans_4x256": _titans,
    "mc_titans_grm": lambda n: _titans(n, segment_size=256),
    "mc_titans_ssc": lambda n: _titans(n, segment_size=256, aggregation="ssc"),
    "mc_titans_grm_kept": lambda n: _titans(n, segment_size=256, recompute_memory=False),
    "omeganet_16x64": lambda n: _atlas(n, "omeganet"),
    "atlas_muon_16x64": lambda n: _atlas(n, "atlas"),
    "deep_transformer": _deep_transformer,
    "anchor_fla_gdn": lambda n: _fla(n, "gdn"),
    "anchor_fla_mom_4x2_shared": lambda n: _fla(n, "mom"),
    "anchor_llama_sdpa": _llama,
}


def _shard(model: torch.nn.Module, args: argparse.Namespace) -> torch.nn.Module:
    """FSDP2: every block its own unit, then the model. By default float32 parameters under autocast, as the
    one-process rows: the same numbers, sharded. ``--no-reshard`` keeps each block's gathered weights from
    the forward to the backward (one all-gather per block instead of two); ``--bf16-params`` gathers bf16
    weights and reduces float32 gradients, half the bytes of each all-gather."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16_params
              else MixedPrecisionPolicy())
    for unit in (*model.model.layers, model):
        fully_shard(unit, reshard_after_forward=not args.no_reshard, mp_policy=policy)
    return model


def _sharding(args: argparse.Namespace) -> str:
    """How ``--fsdp`` sharded the row, for its table."""
    return "+".join(["fully_shard", *(["no_reshard"] if args.no_reshard else []),
                     *(["bf16_params"] if args.bf16_params else [])])


def measure(name: str, args: argparse.Namespace, rank: int, world: int, accelerator=None) -> dict:
    """Tokens/s (all processes), peak GiB (this process) and the first step's loss of one model."""
    torch.manual_seed(0)
    model = MODELS[name](args.layers).cuda()
    params = sum(p.numel() for p in model.parameters())
    if world > 1 and accelerator is None:
        model = _shard(model, args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    if accelerator is not None:  # the config file's FSDP2, applied by accelerate's own preparation
        model, optimizer = accelerator.prepare(model, optimizer)
    g = torch.Generator(device="cuda").manual_seed(1234)
    fixed = torch.randint(0, VOCAB, (args.batch * world, args.length), device="cuda", generator=g)
    ids = fixed[rank * args.batch:(rank + 1) * args.batch]
    losses = []

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    reset_peak()
    step()  # compiles, autotunes; its loss is the fixed batch's at the initial weights
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.iters):
        step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / args.iters
    # The host's share of a step: the time until it has launched everything. Where it nearly equals the
    # step time, the host (launches, hooks, Python) sets the pace, not the GPU.
    start = time.perf_counter()
    step()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    first = losses[0].float()
    if world > 1:
        torch.distributed.all_reduce(first)
        first /= world
    return {"model": name, "params_M": round(params / 1e6, 1), "batch": args.batch * world, "length": args.length,
            "processes": world,
            "sharded_by": "accelerate" if accelerator is not None else _sharding(args) if world > 1 else "",
            "tok_per_s": round(args.batch * world * args.length / seconds), "ms_per_step": round(1e3 * seconds, 1),
            "host_ms": round(1e3 * host, 1), "peak_gib": round(peak_gib(), 2), "first_loss": round(float(first), 5)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help=f"comma-separated rows (substrings) of: {', '.join(MODELS)}")
    parser.add_argument("--rows", help="comma-separated rows by their exact names, in that order (instead of --only)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (per process with --fsdp)")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (run under torchrun)")
    parser.add_argument("--no-reshard", action="store_true",
                        help="--fsdp: keep each block's gathered weights from its forward to its backward")
    parser.add_argument("--bf16-params", action="store_true",
                        help="--fsdp: gather bf16 weights, reduce float32 gradients (MixedPrecisionPolicy)")
    parser.add_argument("--accelerate", action="store_true",
                        help="shard as accelerate's config says (run under accelerate launch --config_file ...)")
    parser.add_argument("--out", help="folder of models.json (default: $OUT, else the current folder)")
    args = parser.parse_args(argv)
    rank, world, accelerator = 0, 1, None
    if args.accelerate:
        from accelerate import Accelerator

        accelerator = Accelerator()
        rank, world = accelerator.process_index, accelerator.num_processes
    elif args.fsdp:
        torch.distributed.init_process_group("nccl")
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    torch.backends.cuda.matmul.allow_tf32 = True
    recorder = Recorder() if rank == 0 else None
    rows = [name for name in MODELS if picked(name, names(args.only))]
    if args.rows:
        rows = names(args.rows)
        unknown = [name for name in rows if name not in MODELS]
        if unknown:
            parser.error(f"--rows: no row named {', '.join(unknown)} (rows: {', '.join(MODELS)})")
    for name in rows:
        try:
            row = measure(name, args, rank, world, accelerator)
        except Exception as error:  # noqa: BLE001  (one broken row must not lose the others)
            traceback.print_exc()
            row = {"model": name, "error": f"{type(error).__name__}: {error}"[:200]}
        torch.cuda.empty_cache()
        if rank == 0:
            recorder.record(**row)
    if rank == 0:
        recorder.table(["model", "params_M", "batch", "length", "processes", "sharded_by", "tok_per_s", "ms_per_step",
                        "host_ms", "peak_gib", "first_loss"])
        sharded = args.fsdp or args.accelerate
        recorder.write(out_dir(args.out) / ("models_fsdp.json" if sharded else "models.json"))
    if args.fsdp or (accelerator is not None and world > 1):
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
