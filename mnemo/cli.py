"""The ``mnemo`` command line.

``mnemo demo`` builds a tiny, freshly initialised MoM model and generates from
it (greedy, through the recurrent cache), checking the cached generation against
full recomputation. ``mnemo info`` lists the registered families.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence


def _demo(args: argparse.Namespace) -> int:
    import torch

    from mnemo import MoMConfig, MoMForCausalLM

    torch.manual_seed(args.seed)
    config = MoMConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=16,
        num_memories=4, topk=2, shared_memory=True, chunk_size=16, eos_token_id=None,
    )
    model = MoMForCausalLM(config).eval()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"MoM: {config.num_hidden_layers} layers, {config.num_memories} memories (top-{config.topk}) + shared, "
          f"{n_params:,} parameters (random weights)")
    prompt = torch.randint(0, config.vocab_size, (1, args.prompt_length))
    start = time.perf_counter()
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=args.max_new_tokens, do_sample=False)
        cached_time = time.perf_counter() - start
        recomputed = model.generate(prompt, max_new_tokens=args.max_new_tokens, do_sample=False, use_cache=False)
    new = cached[0, prompt.shape[1]:].tolist()
    print(f"prompt ({prompt.shape[1]} tokens): {prompt[0].tolist()}")
    print(f"generated ({len(new)} tokens, {len(new) / cached_time:.0f} tokens/s with the recurrent cache): {new}")
    same = torch.equal(cached, recomputed)
    print(f"cached decoding == full recomputation: {same}")
    return 0 if same else 1


def _export(args: argparse.Namespace) -> int:
    from mnemo.conversion.hub_export import export_hub_folder

    out = export_hub_folder(args.src, args.out, repo_id=args.repo_id)
    print(f"wrote {out}: load it with AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)")
    return 0


def _push(args: argparse.Namespace) -> int:
    from mnemo.conversion.hub_export import push_to_hub

    url = push_to_hub(args.folder, args.repo_id, token=args.token, private=args.private)
    print(f"uploaded {args.folder} to {args.repo_id}: {url}")
    return 0


def _convert(args: argparse.Namespace) -> int:
    if args.kind == "to-mc":
        from mnemo.conversion.memory_caching import convert_to_memory_caching

        out = convert_to_memory_caching(args.src, args.out, segment_size=args.segment_size,
                                        aggregation=args.aggregation, segmentation=args.segmentation,
                                        ssc_topk=args.ssc_topk, allow_pickle=args.allow_pickle)
    elif args.kind == "from-fla":
        from mnemo.conversion.from_fla import convert_from_fla

        out = convert_from_fla(args.src, args.out, allow_pickle=args.allow_pickle)
    else:
        from mnemo.conversion.from_llama import convert_from_llama

        out = convert_from_llama(args.src, args.out, allow_pickle=args.allow_pickle, memory_depth=args.memory_depth)
    print(f"wrote {out}")
    return 0


def _info(args: argparse.Namespace) -> int:
    import mnemo

    for config_cls, _, lm_cls in mnemo._FAMILIES:
        print(f"{lm_cls.__name__:24s} model_type={config_cls.model_type}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from mnemo import __version__

    parser = argparse.ArgumentParser(prog="mnemo", description="Memory-based sequence models for transformers.")
    parser.add_argument("--version", action="version", version=f"mnemo {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="generate from a tiny MoM model through its recurrent cache")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--prompt-length", type=int, default=16)
    demo.add_argument("--max-new-tokens", type=int, default=32)
    demo.set_defaults(func=_demo)
    export = sub.add_parser("export", help="write a self-contained trust_remote_code Hub folder")
    export.add_argument("src", help="a mnemo checkpoint folder or Hub id")
    export.add_argument("out", help="the folder to write (must not exist or be empty)")
    export.add_argument("--repo-id", default=None, help="the Hub id the folder is meant for (for the model card)")
    export.set_defaults(func=_export)
    push = sub.add_parser("push", help="upload an exported folder to the Hugging Face Hub")
    push.add_argument("folder")
    push.add_argument("repo_id")
    push.add_argument("--token", default=None, help="default: HF_TOKEN or the stored login")
    push.add_argument("--private", action="store_true")
    push.set_defaults(func=_push)
    convert = sub.add_parser("convert", help="convert checkpoints (Memory Caching, flash-linear-attention, Llama)")
    kinds = convert.add_subparsers(dest="kind", required=True)
    to_mc = kinds.add_parser("to-mc", help="a Titans checkpoint to its Memory Caching variant (post-training)")
    to_mc.add_argument("--segment-size", type=int, required=True)
    to_mc.add_argument("--aggregation", default="mean", help="mean (default), residual, grm, soup or ssc")
    to_mc.add_argument("--segmentation", default="constant", help="constant (default) or logarithmic")
    to_mc.add_argument("--ssc-topk", type=int, default=2)
    from_fla = kinds.add_parser("from-fla", help="a flash-linear-attention mom or gated_deltanet checkpoint to MoM")
    from_llama = kinds.add_parser("from-llama", help="a Llama checkpoint to a DeepTransformer (deep branch off)")
    from_llama.add_argument("--memory-depth", type=int, default=1,
                            help="1: exactly the Transformer; 2: add a deep branch to fine-tune")
    for kind in (to_mc, from_fla, from_llama):
        kind.add_argument("src", help="the source checkpoint folder (left untouched)")
        kind.add_argument("out", help="the folder to write (must not exist or be empty)")
        kind.add_argument("--allow-pickle", action="store_true",
                          help="accept pytorch_model.bin weights (read with torch.load(weights_only=True))")
    convert.set_defaults(func=_convert)
    info = sub.add_parser("info", help="list the model families")
    info.set_defaults(func=_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from mnemo.conversion.checkpoint_io import ConversionError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConversionError as err:
        print(f"mnemo {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
