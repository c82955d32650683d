"""The ``mnemo`` command line.

``mnemo demo`` trains tiny models of every family on multi-query associative
recall and compares them with a plain recurrent baseline, then exports the best
one as a Hub folder and generates from it without mnemo. ``mnemo eval`` scores a
model on MQAR, passkey retrieval or perplexity; ``export``/``push`` publish,
``convert`` converts checkpoints, ``info`` lists the families.

A mistake the user can fix (a missing folder, an option out of range, no GPU, no
token or network for ``push``) ends in one line on stderr that names the problem
and what to do, with exit code 2, and is found before anything loads or trains;
``--debug`` (or ``MNEMO_DEBUG=1``) shows the traceback instead. Progress bars go to
stderr when it is a terminal, unless ``--no-progress``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

DEBUG_ENV = "MNEMO_DEBUG"
# Below this much weight data on disk, transformers' "Loading weights" bar flashes by and only adds noise.
LARGE_CHECKPOINT_BYTES = 1 << 30
DEMO_OUTPUTS = ("results.json", "results.csv", "accuracy.png", "best-model")


class UsageError(Exception):
    """A mistake the user can fix; the command line prints its message as one line and exits with code 2."""


# ---------------------------------------------------------------------------------------------------------------------
# Checks and helpers shared by the subcommands
# ---------------------------------------------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def progress_wanted(args: argparse.Namespace) -> bool:
    """Bars only for a person watching: not with ``--no-progress``, nor when stderr goes to a file or a pipe."""
    return not getattr(args, "no_progress", False) and sys.stderr.isatty()


def _weight_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())


def show_loading_bar(source: str | os.PathLike, progress: bool) -> bool:
    """Whether transformers' "Loading weights" bar is worth showing: for large local checkpoints and Hub ids."""
    path = Path(source).expanduser()
    return progress and (not path.is_dir() or _weight_bytes(path) >= LARGE_CHECKPOINT_BYTES)


@contextlib.contextmanager
def loading_bars(show: bool) -> Iterator[None]:
    """Hide the bars transformers draws while a model loads ("Loading weights"), unless ``show``.

    Only transformers' own bars are touched (through its tqdm hook); huggingface_hub's download bars stay.
    """
    if show:
        yield
        return
    from transformers.utils import logging as hf_logging

    def quiet(factory, args, kwargs):
        kwargs = {**kwargs, "disable": True}
        return previous(factory, args, kwargs) if previous is not None else factory(*args, **kwargs)

    previous = hf_logging.set_tqdm_hook(quiet)
    try:
        yield
    finally:
        hf_logging.set_tqdm_hook(previous)


_NETWORK_LIBRARIES = {"httpx", "httpx2", "httpcore", "requests", "urllib3"}
_NETWORK_ERRORS = {"ConnectError", "ConnectionError", "ConnectTimeout", "TimeoutException", "Timeout", "ReadTimeout",
                   "NetworkError", "TransportError", "ProxyError", "SSLError", "RemoteProtocolError"}


def is_network_error(err: BaseException) -> bool:
    """Whether ``err`` (or what caused it) is a failure to reach a server, whichever HTTP library raised it."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (ConnectionError, TimeoutError, socket.gaierror)):
            return True
        if any(cls.__module__.split(".")[0] in _NETWORK_LIBRARIES and cls.__name__ in _NETWORK_ERRORS
               for cls in type(current).__mro__):
            return True
        current = current.__cause__ or current.__context__
    return False


def _looks_like_hub_id(text: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def check_model_source(source: str, *, hub: bool = True, known_type: bool = True, mnemo_only: bool = False) -> None:
    """Refuse, before anything loads, a model that cannot be: a missing folder, one without a usable config.json.

    With ``hub``, a name that is no local path but could be a Hub id (``owner/name``) is left for the Hub to
    answer. ``known_type`` asks for a model type that mnemo or transformers knows (conversions read others),
    ``mnemo_only`` for one of mnemo's.
    """
    path = Path(source).expanduser()
    if not path.exists():
        if hub and _looks_like_hub_id(source):
            return
        hub_id = " or a Hub id such as owner/name" if hub else ""
        raise UsageError(f"{source}: no such folder; give a model folder (one that holds config.json){hub_id}")
    if not path.is_dir():
        raise UsageError(f"{source} is a file, not a model folder: give the folder that holds config.json")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise UsageError(f"{source} has no config.json, so it is not a model folder: give a folder written by "
                         "save_pretrained, mnemo export or mnemo convert")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise UsageError(f"cannot read {config_path}: {_first_line(err)}") from err
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not known_type:
        return
    if not model_type:
        raise UsageError(f"{config_path} names no model_type, so no model class can load it: is it a "
                         "transformers model folder?")
    import mnemo

    mnemo_types = [config_cls.model_type for config_cls, _, _ in mnemo._FAMILIES]
    if mnemo_only and model_type not in mnemo_types:
        raise UsageError(f"{source} holds a {model_type!r} model, not a mnemo one ({', '.join(mnemo_types)}); "
                         "convert it first (mnemo convert --help)")
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING and "auto_map" not in config:
        raise UsageError(f"{source} holds a {model_type!r} model, which neither mnemo nor this transformers "
                         "knows: upgrade transformers, or give a mnemo or transformers checkpoint")


@contextlib.contextmanager
def loading_errors(source: str) -> Iterator[None]:
    """Report a model that fails to load (not on the Hub, no network, a broken file) as one line."""
    from mnemo.conversion.checkpoint_io import ConversionError

    try:
        yield
    except (UsageError, ConversionError):
        raise
    except Exception as err:
        if not (isinstance(err, (OSError, ValueError)) or is_network_error(err)):
            raise
        where = "" if Path(source).expanduser().exists() else " (not a folder here, so it was looked up on the Hub)"
        raise UsageError(f"cannot load {source}{where}: {_first_line(err)}") from err


def check_device(device: str) -> str:
    """``device`` when torch can use it here; otherwise a one-line error saying what to pass instead."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {device!r} is not a device name torch knows: use cpu, cuda or cuda:N") from None
    if parsed.type == "cpu":
        return device
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {device}: no CUDA GPU is usable here (torch {torch.__version__}); "
                             "use --device cpu")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise UsageError(f"--device {device}: only {torch.cuda.device_count()} CUDA GPU(s) here "
                             f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})")
        return device
    backend = getattr(torch, parsed.type, None)
    if parsed.type == "mps":
        backend = torch.backends.mps
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        raise UsageError(f"--device {device}: torch cannot use a {parsed.type} device here; use --device cpu")
    return device


def check_output_folder(out: str | os.PathLike, option: str = "out") -> Path:
    """Refuse an output folder that exists and is not empty, or that cannot be created, before any work."""
    path = Path(out).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UsageError(f"{option} {out} is a file: give a folder that does not exist yet")
        if any(path.iterdir()):
            raise UsageError(f"{option} {out} exists and is not empty: nothing is overwritten; give a new folder")
    _check_creatable(path, option)
    return path


def _check_creatable(path: Path, option: str) -> None:
    ancestor = path.absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UsageError(f"{option} {path}: {ancestor} is a file, so no folder can be made there")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {path}: {ancestor} is not writable; choose another place")


# ---------------------------------------------------------------------------------------------------------------------
# demo
# ---------------------------------------------------------------------------------------------------------------------


def _is_previous_export(folder: Path) -> bool:
    config = folder / "config.json"
    try:
        return config.is_file() and "auto_map" in json.loads(config.read_text(encoding="utf-8"))
    except ValueError:
        return False


def check_demo_output(out: Path, *, overwrite: bool, export: bool) -> None:
    """Refuse, before any training, an ``--output`` that the demo's results cannot go to or would overwrite."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--output {out} is a file: give a folder (it is created when missing)")
    _check_creatable(out, "--output")
    if not out.is_dir():
        return
    written = [name for name in DEMO_OUTPUTS if (out / name).exists()]
    if written and not overwrite:
        raise UsageError(f"--output {out} already holds an earlier run's {', '.join(written)}: pass --overwrite to "
                         "replace them, or give another --output")
    best = out / "best-model"
    if export and best.exists() and not (best.is_dir() and (not any(best.iterdir()) or _is_previous_export(best))):
        raise UsageError(f"{best} was not written by mnemo demo, which would replace it with the exported model: "
                         "move it away, give another --output, or pass --no-export")


def _export_best(results, models, settings, out: Path) -> None:
    """Export the most accurate memory model, reload it without mnemo and generate from it."""
    import shutil

    import torch

    from mnemo.conversion.hub_export import export_hub_folder
    from mnemo.demo import BASELINE, heldout_set
    from mnemo.remote_check import generate_without_mnemo

    best = max((r for r in results if r.family != BASELINE), key=lambda r: r.final_accuracy, default=None)
    if best is None:
        return
    folder = out / "best-model"
    if _is_previous_export(folder):
        shutil.rmtree(folder)  # the previous demo's export (check_demo_output refused anything else)
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


def _plural(count: int, word: str) -> str:
    return f"{count:,} {word}" + ("" if count == 1 else "s")


def _demo(args: argparse.Namespace) -> int:
    from dataclasses import replace

    if args.conversion:
        from mnemo.conversion_demo import main_from_args

        return main_from_args(args)
    from mnemo.demo import DemoSettings, plot_results, results_table, run_demo, write_results

    args.output = args.output or "mnemo-demo"
    settings = DemoSettings.quick() if args.quick else DemoSettings.default()
    overrides = {"device": args.device, "steps": args.steps}
    settings = replace(settings, seed=args.seed, **{k: v for k, v in overrides.items() if v is not None})
    check_device(settings.device)
    out = Path(args.output).expanduser()
    check_demo_output(out, overwrite=args.overwrite, export=not args.no_export)
    width = f"; memory keys {settings.head_dim} wide per head" if settings.head_dim else ""
    print(f"mnemo demo: multi-query associative recall ({settings.num_pairs} key-value pairs, then queries; "
          f"sequences of {settings.seq_len} tokens{width}), {_plural(settings.steps, 'training step')} per model "
          f"on {settings.device}.")
    print("Each memory family is measured against the plain recurrent baseline: one fixed-size gated-delta memory "
          "(Gated DeltaNet).\n")
    results, models = run_demo(settings, progress=progress_wanted(args), workers=args.workers, threads=args.threads)
    print("\n" + results_table(results))
    json_path, csv_path = write_results(results, out, settings)
    png = plot_results(results, out / "accuracy.png")
    print(f"\nwrote {json_path}, {csv_path} and {png}")
    if not args.no_export:
        _export_best(results, models, settings, out)
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# export, push, convert, info
# ---------------------------------------------------------------------------------------------------------------------


def _export(args: argparse.Namespace) -> int:
    check_model_source(args.src, mnemo_only=True)
    check_output_folder(args.out)
    from mnemo.conversion.hub_export import export_hub_folder

    with loading_errors(args.src), loading_bars(show_loading_bar(args.src, progress_wanted(args))):
        out = export_hub_folder(args.src, args.out, repo_id=args.repo_id)
    print(f"wrote {out}: load it with AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)")
    return 0


def _hub_failure(err: BaseException, repo_id: str) -> str | None:
    """The one line that explains a failed upload, or None when ``err`` is not about the Hub, the network or auth."""
    from huggingface_hub import errors

    def kind(*names: str) -> tuple[type, ...]:
        return tuple(getattr(errors, name) for name in names if hasattr(errors, name))

    login = "pass --token, set HF_TOKEN or log in with `hf auth login`"
    if isinstance(err, kind("LocalTokenNotFoundError")):
        return f"no Hugging Face token was found: {login}"
    if isinstance(err, kind("OfflineModeIsEnabled")):
        return "HF_HUB_OFFLINE is set, so nothing can be uploaded: unset it and push again"
    if isinstance(err, kind("HFValidationError")):
        return f"{repo_id!r} is not a Hub repository id ({_first_line(err)}): use owner/name"
    if isinstance(err, kind("HfHubHTTPError")):
        status = getattr(getattr(err, "response", None), "status_code", None)
        if status == 401:
            return f"the Hub did not accept the token (HTTP 401): {login}"
        if status == 403:
            return (f"the token may not write to {repo_id} (HTTP 403): use a token with write access to that "
                    "namespace, or push to a repository of your own")
        return f"the Hub refused the upload to {repo_id} (HTTP {status}): {_first_line(err)}"
    if is_network_error(err):
        return (f"could not reach the Hugging Face Hub ({type(err).__name__}: {_first_line(err)}): check the "
                "network connection (and proxy settings), then push again")
    return None


def _push(args: argparse.Namespace) -> int:
    folder = Path(args.folder).expanduser()
    if not folder.is_dir():
        raise UsageError(f"{args.folder}: no such folder; push uploads a folder written by mnemo export")
    if not _is_previous_export(folder):
        raise UsageError(f"{args.folder} is not an exported mnemo folder (no config.json with auto_map): "
                         f"write one with mnemo export MODEL {args.folder}")
    if not _looks_like_hub_id(args.repo_id):
        raise UsageError(f"{args.repo_id!r} is not a Hub repository id: use owner/name")
    from mnemo.conversion.hub_export import push_to_hub

    try:
        url = push_to_hub(folder, args.repo_id, token=args.token, private=args.private,
                          commit_message=args.commit_message, revision=args.revision, create_pr=args.create_pr)
    except Exception as err:
        problem = _hub_failure(err, args.repo_id)
        if problem is None:
            raise
        raise UsageError(problem) from err
    where = f"a pull request on {args.repo_id}" if args.create_pr else args.repo_id
    if args.revision and not args.create_pr:
        where += f" (branch {args.revision})"
    print(f"uploaded {args.folder} to {where}: {url}")
    return 0


def _convert(args: argparse.Namespace) -> int:
    check_model_source(args.src, hub=False, known_type=False)  # the conversions read the folder's files
    check_output_folder(args.out)
    show = show_loading_bar(args.src, progress_wanted(args))
    with loading_errors(args.src), loading_bars(show):
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

            out = convert_from_llama(args.src, args.out, allow_pickle=args.allow_pickle,
                                     memory_depth=args.memory_depth)
    print(f"wrote {out}")
    return 0


def _info(_args: argparse.Namespace) -> int:
    import mnemo

    rows = [("class", "model_type", "config")]
    rows += [(lm_cls.__name__, config_cls.model_type, config_cls.__name__) for config_cls, _, lm_cls in mnemo._FAMILIES]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    rows.insert(1, tuple("-" * width for width in widths))
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# The parser and the entry point
# ---------------------------------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose error is its one ``prog: error: message`` line (exit code 2), without the usage
    block above it, which for ``eval`` is a dozen lines that hide the message; ``--help`` shows it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_common(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS as the default, so that `mnemo --debug eval ...` is not undone by the subcommand's own default.
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help=f"show the full traceback of an error (also: {DEBUG_ENV}=1)")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _add_common(sub)


def _add_no_progress(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars (there are none either when stderr is not a terminal)")


def build_parser() -> argparse.ArgumentParser:
    from mnemo import __version__

    parser = _Parser(prog="mnemo", description="Memory-based sequence models for transformers.")
    parser.add_argument("--version", action="version", version=f"mnemo {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train tiny models of every family on associative recall and compare them")
    demo.add_argument("--quick", action="store_true", help="a few minutes on a laptop CPU")
    demo.add_argument("--output", default=None,
                      help="folder for results.json/csv, the plot and the export (default: mnemo-demo; with "
                           "--conversion: mnemo-conversion-demo)")
    demo.add_argument("--overwrite", action="store_true",
                      help="replace the results of an earlier run in --output (refused without it)")
    demo.add_argument("--device", default=None, help="default: cuda when available (quick mode: cpu)")
    demo.add_argument("--seed", type=int, default=0,
                      help="seed of the models' weights and the data (default 0); only the timings vary")
    demo.add_argument("--steps", type=_positive_int, default=None, help="training steps per model (default: the mode's)")
    demo.add_argument("--workers", type=_positive_int, default=1,
                      help="train this many families at once, one process each (default 1: one after another)")
    demo.add_argument("--threads", type=_positive_int, default=None,
                      help="torch threads per training process (default on a CPU: 1, steady when the cores are "
                           "shared; use --workers to use more cores)")
    _add_no_progress(demo)
    demo.add_argument("--no-export", action="store_true", help="skip exporting and reloading the best model")
    demo.add_argument("--conversion", action="store_true",
                      help="instead: train recurrent models at length L, convert them to Memory Caching (every L "
                           "tokens) and score every variant from L to 16L (docs/demo.md)")
    demo.add_argument("--seeds", type=_positive_int, default=1,
                      help="with --conversion: independent runs, seeds SEED, SEED+1, ...; the table gives their "
                           "mean and standard deviation (default 1)")
    demo.set_defaults(func=_demo)
    from mnemo.evaluation import add_eval_parser

    add_eval_parser(sub)
    export = sub.add_parser("export", help="write a self-contained trust_remote_code Hub folder")
    export.add_argument("src", help="a mnemo checkpoint folder or Hub id")
    export.add_argument("out", help="the folder to write (must not exist or be empty)")
    export.add_argument("--repo-id", default=None, help="the Hub id the folder is meant for (for the model card)")
    _add_no_progress(export)
    export.set_defaults(func=_export)
    push = sub.add_parser("push", help="upload an exported folder to the Hugging Face Hub",
                          description="Upload a folder written by `mnemo export` to a Hub model repository.")
    push.add_argument("folder", help="a folder written by mnemo export")
    push.add_argument("repo_id", help="the Hub model repository, owner/name (created when missing)")
    push.add_argument("--token", default=None, help="a token with write access (default: HF_TOKEN or the stored login)")
    push.add_argument("--private", action="store_true", help="create the repository private (an existing one keeps "
                                                             "its visibility)")
    push.add_argument("--revision", default=None,
                      help="the branch to commit to, created from the default branch when missing (default: main)")
    push.add_argument("--commit-message", default="Upload mnemo model",
                      help="the commit's message (default: 'Upload mnemo model')")
    push.add_argument("--create-pr", action="store_true",
                      help="open a pull request with the upload instead of committing to the branch")
    push.set_defaults(func=_push)
    convert = sub.add_parser("convert", help="convert checkpoints (Memory Caching, flash-linear-attention, Llama)")
    kinds = convert.add_subparsers(dest="kind", required=True)
    to_mc = kinds.add_parser("to-mc", help="a Titans, MoM or Atlas checkpoint to its Memory Caching variant (post-training)")
    to_mc.add_argument("--segment-size", type=_positive_int, required=True, help="tokens per cached segment")
    to_mc.add_argument("--aggregation", default="mean", help="mean (default), residual, grm, soup or ssc")
    to_mc.add_argument("--segmentation", default="constant", help="constant (default) or, for Titans, logarithmic")
    to_mc.add_argument("--ssc-topk", type=_positive_int, default=2, help="cached memories each token reads with ssc")
    from_fla = kinds.add_parser("from-fla", help="a flash-linear-attention mom or gated_deltanet checkpoint to MoM")
    from_llama = kinds.add_parser("from-llama", help="a Llama checkpoint to a DeepTransformer (deep branch off)")
    from_llama.add_argument("--memory-depth", type=_positive_int, default=1,
                            help="1: exactly the Transformer; 2: add a deep branch to fine-tune")
    for kind in (to_mc, from_fla, from_llama):
        kind.add_argument("src", help="the source checkpoint folder (left untouched)")
        kind.add_argument("out", help="the folder to write (must not exist or be empty)")
        kind.add_argument("--allow-pickle", action="store_true",
                          help="accept pytorch_model.bin weights (read with torch.load(weights_only=True))")
        _add_no_progress(kind)
    convert.set_defaults(func=_convert)
    info = sub.add_parser("info", help="list the model families")
    info.set_defaults(func=_info)
    _add_common(parser)
    return parser


def _debugging(args: argparse.Namespace) -> bool:
    return getattr(args, "debug", False) or os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false")


def main(argv: Sequence[str] | None = None) -> int:
    from mnemo.conversion.checkpoint_io import ConversionError

    args = build_parser().parse_args(argv)
    name = f"mnemo {args.command}" + (f" {args.kind}" if getattr(args, "kind", None) else "")
    try:
        return args.func(args)
    except (UsageError, ConversionError) as err:
        if _debugging(args):
            raise
        print(f"{name}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if _debugging(args):
            raise
        print(f"\n{name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
