"""The ``mnemo`` command line.

``mnemo demo`` trains tiny models of every family on multi-query associative
recall and compares them with a plain recurrent baseline, then exports the best
one as a Hub folder and generates from it without mnemo. ``mnemo eval`` scores a
model on MQAR, passkey retrieval or perplexity; ``export``/``push`` publish,
``convert`` converts checkpoints, ``info`` lists the families.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _export_best(results, models, settings, out: Path) -> None:
    """Export the most accurate memory model, reload it without mnemo and generate from it."""
    import json
    import shutil

    import torch

    from mnemo.conversion.hub_export import export_hub_folder
    from mnemo.demo import BASELINE, heldout_set
    from mnemo.remote_check import generate_without_mnemo

    best = max((r for r in results if r.family != BASELINE), key=lambda r: r.final_accuracy, default=None)
    if best is None:
        return
    folder = out / "best-model"
    config = folder / "config.json"
    if config.is_file() and "auto_map" in json.loads(config.read_text()):
        shutil.rmtree(folder)  # the previous demo's export; anything else is refused below
    model = models[best.family].to("cpu").eval()
    export_hub_folder(model, folder, source=f"trained by mnemo demo on MQAR ({best.steps} steps)")
    ids, labels = heldout_set(settings)
    first_answer = int((labels[0] != -100).nonzero()[0])
    prompt = ids[:1, :first_answer]  # the context and the first query's key
    with torch.no_grad():
        local = model.generate(prompt, attention_mask=prompt.new_ones(prompt.shape), max_new_tokens=1,
                               do_sample=False)[0, -1:].tolist()
    remote = generate_without_mnemo(folder, prompt.tolist(), max_new_tokens=1)
    print(f"\nexported {best.family} (best accuracy) to {folder}; reloaded with trust_remote_code "
          f"in a process without mnemo ({remote['class'].split('.')[-1]}):")
    print(f"  first query's key {int(prompt[0, -1])} -> generated value {remote['tokens'][0][0]} "
          f"(expected {int(labels[0, first_answer])}); same as the in-package model: {remote['tokens'][0] == local}")


def _demo(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from mnemo.demo import DemoSettings, plot_results, results_table, run_demo, write_results

    settings = DemoSettings.quick() if args.quick else DemoSettings.default()
    overrides = {"device": args.device, "steps": args.steps}
    settings = replace(settings, seed=args.seed, **{k: v for k, v in overrides.items() if v is not None})
    out = Path(args.output)
    width = f"; memory keys {settings.head_dim} wide per head" if settings.head_dim else ""
    print(f"mnemo demo: multi-query associative recall ({settings.num_pairs} key-value pairs, then queries; "
          f"sequences of {settings.seq_len} tokens{width}), {settings.steps} training steps per model "
          f"on {settings.device}.")
    print("Each memory family is measured against the plain recurrent baseline: one fixed-size gated-delta memory "
          "(Gated DeltaNet).\n")
    results, models = run_demo(settings, progress=not args.no_progress, workers=args.workers)
    print("\n" + results_table(results))
    json_path, csv_path = write_results(results, out, settings)
    png = plot_results(results, out / "accuracy.png")
    print(f"\nwrote {json_path}, {csv_path} and {png}")
    if not args.no_export:
        _export_best(results, models, settings, out)
    return 0


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


def _info(_args: argparse.Namespace) -> int:
    import mnemo

    for config_cls, _, lm_cls in mnemo._FAMILIES:
        print(f"{lm_cls.__name__:24s} model_type={config_cls.model_type}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from mnemo import __version__

    parser = argparse.ArgumentParser(prog="mnemo", description="Memory-based sequence models for transformers.")
    parser.add_argument("--version", action="version", version=f"mnemo {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train tiny models of every family on associative recall and compare them")
    demo.add_argument("--quick", action="store_true", help="a few minutes on a laptop CPU")
    demo.add_argument("--output", default="mnemo-demo", help="folder for results.json/csv, the plot and the export")
    demo.add_argument("--device", default=None, help="default: cuda when available (quick mode: cpu)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--steps", type=_positive_int, default=None, help="training steps per model (default: the mode's)")
    demo.add_argument("--workers", type=_positive_int, default=1,
                      help="train this many families at once, one process each (default 1: one after another)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    demo.add_argument("--no-export", action="store_true", help="skip exporting and reloading the best model")
    demo.set_defaults(func=_demo)
    from mnemo.evaluation import add_eval_parser

    add_eval_parser(sub)
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
    to_mc = kinds.add_parser("to-mc", help="a Titans, MoM or Atlas checkpoint to its Memory Caching variant (post-training)")
    to_mc.add_argument("--segment-size", type=int, required=True)
    to_mc.add_argument("--aggregation", default="mean", help="mean (default), residual, grm, soup or ssc")
    to_mc.add_argument("--segmentation", default="constant", help="constant (default) or, for Titans, logarithmic")
    to_mc.add_argument("--ssc-topk", type=int, default=2, help="cached memories each token reads with ssc")
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
