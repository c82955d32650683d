"""``mnemo eval``: score a model on MQAR, passkey retrieval or perplexity.

:func:`evaluate` takes a model (or a folder: a mnemo checkpoint, or an exported
``trust_remote_code`` folder) and a task name, and returns a JSON-serialisable
dict; :func:`format_results` renders it as a small table; :func:`add_eval_parser`
adds the ``eval`` subcommand to an ``argparse`` parser.

MQAR's defaults come from the model when it was trained by ``mnemo demo`` (its
config's ``mqar_task`` records the sequence length, pairs, queries and vocabulary
it was trained on), so ``mnemo eval FOLDER mqar`` scores it on its own task; ``--pairs`` alone
asks a new task, with as many queries as pairs.

The ``eval`` subcommand checks its options and the model folder before loading it,
and shows a progress bar over the samples (see :mod:`mnemo.cli`).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch

from .tasks import (
    mqar_accuracy,
    mqar_batch,
    passkey_text_accuracy,
    passkey_text_sample,
    passkey_token_accuracy,
    passkey_token_sample,
    perplexity,
    progress_bar,
)

TASKS = ("mqar", "passkey", "ppl")
MQAR_DEFAULTS = {"seq_len": 64, "num_pairs": 8}
DEFAULT_LENGTHS = "1k,2k,4k"
DEFAULT_DEPTHS = "0,0.25,0.5,0.75,1"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def parse_length(text: str) -> int:
    """``"4k"`` -> 4096, ``"1.5K"`` -> 1536, ``"512"`` -> 512 (``k`` is 1024, as in long-context benchmarks)."""
    text = text.strip().lower()
    try:
        value = float(text[:-1]) * 1024 if text.endswith("k") else float(text)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a length: use an integer or a k suffix (4k = 4096)") from None
    if value < 1 or not float(value).is_integer():
        raise ValueError(f"length {text!r} must be a positive whole number of tokens")
    return int(value)


def parse_lengths(text: str | list) -> list[int]:
    """A comma-separated list of lengths (``"1k,4k,16k"``), or a list of ints or strings."""
    items = text.split(",") if isinstance(text, str) else text
    return [item if isinstance(item, int) else parse_length(str(item)) for item in items if str(item).strip()]


def parse_depths(text: str | list) -> list[float]:
    """A comma-separated list of needle depths in ``[0, 1]``."""
    items = text.split(",") if isinstance(text, str) else text
    depths = []
    for item in items:
        if not str(item).strip():
            continue
        try:
            depths.append(float(item))
        except ValueError:
            raise ValueError(f"cannot read {str(item).strip()!r} as a depth: use fractions such as 0,0.5,1") from None
    for depth in depths:
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth {depth} is outside [0, 1]")
    return depths


def default_device() -> str:
    """``"cuda"`` when torch sees a GPU, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _has_tokenizer(path: Path) -> bool:
    return any((path / name).exists() for name in _TOKENIZER_FILES)


def load_model(path: str | Path, device: str | None = None, trust_remote_code: bool = True):
    """``(model, tokenizer or None)`` from a mnemo checkpoint folder, an exported folder or a Hub id."""
    import mnemo  # noqa: F401  (registers the mnemo families with the Auto classes)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    model.to(device or default_device()).eval()
    tokenizer = None
    local = Path(path)
    if local.is_dir():
        if _has_tokenizer(local):
            tokenizer = AutoTokenizer.from_pretrained(str(local), trust_remote_code=trust_remote_code)
    else:
        try:  # a Hub id may or may not ship a tokenizer
            tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        except (OSError, ValueError):
            tokenizer = None
    return model, tokenizer


def mqar_task(model, length: int | None = None, pairs: int | None = None, queries: int | None = None,
              vocab_size: int | None = None, distinct_queries: bool | None = None) -> dict:
    """The MQAR task ``model`` is scored on: what is given, else what ``mnemo demo`` trained it on, else defaults.

    ``pairs`` given without ``queries`` asks as many queries as pairs (the recorded query count belongs to the
    recorded number of pairs). Returns ``seq_len``, ``num_pairs``, ``num_queries``, ``vocab_size``,
    ``distinct_queries``.
    """
    trained = dict(getattr(model.config, "mqar_task", None) or {})
    seq_len = length if length is not None else trained.get("seq_len", MQAR_DEFAULTS["seq_len"])
    num_pairs = pairs if pairs is not None else trained.get("num_pairs", MQAR_DEFAULTS["num_pairs"])
    if queries is not None:
        num_queries = queries
    elif pairs is not None:
        num_queries = pairs
    else:
        num_queries = trained.get("num_queries") or num_pairs
    vocab = vocab_size if vocab_size is not None else trained.get("vocab_size", model.config.vocab_size)
    distinct = distinct_queries if distinct_queries is not None else trained.get("distinct_queries", True)
    return {"seq_len": seq_len, "num_pairs": num_pairs, "num_queries": num_queries, "vocab_size": vocab,
            "distinct_queries": distinct}


def _mqar(model, seed: int, length: int | None = None, pairs: int | None = None, queries: int | None = None,
          samples: int = 256, vocab_size: int | None = None, batch_size: int = 64,
          distinct_queries: bool | None = None, progress: bool = False) -> dict:
    task = mqar_task(model, length, pairs, queries, vocab_size, distinct_queries)
    accuracy = mqar_accuracy(model, task["num_pairs"], task["num_queries"], seq_len=task["seq_len"],
                             num_samples=samples, vocab_size=task["vocab_size"], seed=seed, batch_size=batch_size,
                             distinct_queries=task["distinct_queries"], progress=progress)
    return {"task": "mqar", "accuracy": accuracy, "length": task["seq_len"], "pairs": task["num_pairs"],
            "queries": task["num_queries"], "distinct_queries": task["distinct_queries"], "samples": samples,
            "vocab_size": task["vocab_size"], "seed": seed}


def _cell_generator(seed: int, length: int, depth: float) -> torch.Generator:
    # Each (length, depth) cell has samples of its own: adding a length leaves the others unchanged.
    return torch.Generator().manual_seed(seed * 1_000_003 + length * 1009 + round(depth * 1000))


def passkey_form(tokenizer, form: str | None = None) -> str:
    """``form`` checked against the tokenizer; by default ``"text"`` with a tokenizer and ``"token"`` without."""
    form = form or ("text" if tokenizer is not None else "token")
    if form not in ("text", "token"):
        raise ValueError(f"form must be 'text' or 'token', got {form!r}")
    if form == "text" and tokenizer is None:
        raise ValueError("the text form of passkey needs a tokenizer and this model has none: use form='token'")
    return form


def _passkey(model, tokenizer, seed: int, lengths: str | list = DEFAULT_LENGTHS, depths: str | list = DEFAULT_DEPTHS,
             samples: int = 5, digits: int = 5, form: str | None = None, progress: bool = False) -> dict:
    form = passkey_form(tokenizer, form)
    grid = [(length, depth) for length in parse_lengths(lengths) for depth in parse_depths(depths)]
    cells = []
    # One prompt at a time, so that the bar moves while long prompts are scored; each cell's samples are drawn in
    # the same order as they would be all at once, so the results do not depend on it.
    with progress_bar(len(grid) * samples, "passkey", progress) as bar:
        for length, depth in grid:
            generator = _cell_generator(seed, length, depth)
            hits = 0
            for _ in range(samples):
                if form == "text":
                    sample = passkey_text_sample(tokenizer, length, depth, generator, digits)
                    hits += round(passkey_text_accuracy(model, tokenizer, [sample]))
                else:
                    sample = passkey_token_sample(length, depth, model.config.vocab_size, generator, digits)
                    hits += round(passkey_token_accuracy(model, [sample]))
                bar.update(1)
            cells.append({"length": length, "depth": depth, "accuracy": hits / max(samples, 1)})
    mean = sum(c["accuracy"] for c in cells) / len(cells) if cells else float("nan")
    return {"task": "passkey", "form": form, "accuracy": mean, "cells": cells, "samples": samples, "digits": digits,
            "seed": seed}


def _ppl(model, tokenizer, text: str | None = None, text_file: str | Path | None = None, context_length: int = 1024,
         stride: int | None = None, progress: bool = False) -> dict:
    if tokenizer is None:
        raise ValueError("perplexity needs a tokenizer and this model has none; the mqar and passkey tasks work on "
                         "token ids")
    if (text is None) == (text_file is None):
        raise ValueError("pass exactly one of text and text_file for perplexity")
    if text_file is not None:
        text = Path(text_file).read_text(encoding="utf-8")
    result = perplexity(model, tokenizer, text, context_length=context_length, stride=stride, progress=progress)
    return {"task": "ppl", **result, "context_length": context_length,
            "stride": stride if stride is not None else max(context_length // 2, 1),
            **({"text_file": str(text_file)} if text_file is not None else {})}


def evaluate(model_or_path: Any, task: str, *, tokenizer: Any = None, device: str | None = None, seed: int = 0,
             trust_remote_code: bool = True, progress: bool = False, **options: Any) -> dict:
    """Run ``task`` (``"mqar"``, ``"passkey"`` or ``"ppl"``) on a model and return its results.

    ``model_or_path`` is a model (then ``tokenizer`` is used as given) or a folder / Hub
    id, loaded with ``AutoModelForCausalLM`` (``trust_remote_code`` for exported
    folders) and, when the folder has one, ``AutoTokenizer``. Options per task:

    - ``mqar``: ``length``, ``pairs``, ``queries`` (default: as many as pairs), ``samples``,
      ``vocab_size``, ``batch_size``, ``distinct_queries``;
    - ``passkey``: ``lengths`` (``"1k,4k,16k"`` or a list), ``depths`` (fractions),
      ``samples`` per cell, ``digits``, ``form`` (``"text"`` with a tokenizer, else ``"token"``);
    - ``ppl``: ``text_file`` or ``text``, ``context_length``, ``stride``.

    The result holds ``task``, the headline ``accuracy`` or ``perplexity``, the options
    used, ``model`` (its class) and ``parameters``. ``progress`` shows a bar over the samples.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: expected one of {TASKS}")
    if isinstance(model_or_path, (str, Path)):
        model, loaded_tokenizer = load_model(model_or_path, device, trust_remote_code)
        tokenizer = tokenizer if tokenizer is not None else loaded_tokenizer
        source = str(model_or_path)
    else:
        model = model_or_path
        if device is not None:
            model.to(device)
        source = None
    model.eval()
    torch.manual_seed(seed)
    if task == "mqar":
        result = _mqar(model, seed, progress=progress, **options)
    elif task == "passkey":
        result = _passkey(model, tokenizer, seed, progress=progress, **options)
    else:
        result = _ppl(model, tokenizer, progress=progress, **options)
    result["model"] = type(model).__name__
    result["parameters"] = sum(p.numel() for p in model.parameters())
    if source is not None:
        result["source"] = source
    return result


# ---------------------------------------------------------------------------------------------------------------------
# Reporting and the command line
# ---------------------------------------------------------------------------------------------------------------------


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _percent(x: float) -> str:
    return "nan" if isinstance(x, float) and math.isnan(x) else f"{100 * x:.1f}%"


def format_results(result: dict) -> str:
    """A small plain-text table of an :func:`evaluate` result."""
    header = f"{result.get('model', 'model')} ({result.get('parameters', 0):,} parameters)"
    if result["task"] == "mqar":
        rows = [["task", "length", "pairs", "queries", "samples", "accuracy"],
                ["mqar", str(result["length"]), str(result["pairs"]), str(result["queries"]), str(result["samples"]),
                 _percent(result["accuracy"])]]
    elif result["task"] == "passkey":
        lengths = sorted({c["length"] for c in result["cells"]})
        depths = sorted({c["depth"] for c in result["cells"]})
        by_cell = {(c["length"], c["depth"]): c["accuracy"] for c in result["cells"]}
        rows = [[f"passkey ({result['form']}) depth"] + [str(length) for length in lengths]]
        rows += [[f"{d:g}"] + [_percent(by_cell[(length, d)]) for length in lengths] for d in depths]
        rows.append(["mean"] + [_percent(sum(by_cell[(length, d)] for d in depths) / len(depths))
                                for length in lengths])
    else:
        rows = [["task", "tokens", "context", "stride", "nll", "perplexity"],
                ["ppl", str(result["tokens"]), str(result["context_length"]), str(result["stride"]),
                 f"{result['nll']:.4f}", f"{result['perplexity']:.3f}"]]
    return header + "\n" + _table(rows)


def _chosen_task(args: argparse.Namespace) -> str:
    """The task named positionally (``mnemo eval MODEL mqar``) or by ``--task mqar``; both must agree."""
    from .cli import UsageError

    named = {t for t in (args.task, args.task_option) if t is not None}
    if len(named) != 1:
        problem = "name the task" if not named else f"two different tasks were named ({', '.join(sorted(named))})"
        raise UsageError(f"{problem}: mnemo eval MODEL {{{','.join(TASKS)}}} (or --task TASK)")
    return named.pop()


def _task_options(args: argparse.Namespace) -> dict[str, Any]:
    if args.task == "mqar":
        return dict(length=args.length, pairs=args.pairs, queries=args.queries, samples=args.samples or 256,
                    distinct_queries=args.distinct_queries)
    if args.task == "passkey":
        return dict(lengths=args.lengths, depths=args.depths, samples=args.samples or 5, digits=args.digits,
                    form=args.form)
    return dict(text_file=args.text, context_length=args.context_length, stride=args.stride)


def _check_before_loading(args: argparse.Namespace) -> None:
    """What can be checked without the model: the text file, the windows, a tokenizer for the text tasks."""
    from .cli import UsageError

    if args.task == "ppl":
        if args.text is None:
            raise UsageError("ppl scores a text with the model's tokenizer: pass --text FILE (a UTF-8 text file)")
        if not Path(args.text).is_file():
            raise UsageError(f"--text {args.text}: no such file")
        stride = args.stride if args.stride is not None else max(args.context_length // 2, 1)
        if args.context_length < 2 or stride >= args.context_length:
            raise UsageError(f"--context-length {args.context_length} with --stride {stride}: need a context of at "
                             "least 2 tokens and a stride shorter than it")
    local = Path(args.model).expanduser()
    if _needs_tokenizer(args) and local.is_dir() and not _has_tokenizer(local):
        raise UsageError(_no_tokenizer(args))
    if args.output is not None and Path(args.output).is_dir():
        raise UsageError(f"--output {args.output} is a folder: give the path of a JSON file to write")


def _needs_tokenizer(args: argparse.Namespace) -> bool:
    return args.task == "ppl" or (args.task == "passkey" and args.form == "text")


def _no_tokenizer(args: argparse.Namespace) -> str:
    what = "perplexity" if args.task == "ppl" else "the text form of passkey"
    return (f"{args.model} has no tokenizer, which {what} needs: save one with the model "
            "(tokenizer.save_pretrained), or score it on mqar or passkey --form token")


def _check_with_model(model, tokenizer, args: argparse.Namespace, options: dict[str, Any]) -> None:
    """Options that only make sense against the model (its vocabulary, its recorded task): one sample is built."""
    from .cli import UsageError

    if _needs_tokenizer(args) and tokenizer is None:
        raise UsageError(_no_tokenizer(args))
    try:
        if args.task == "mqar":
            task = mqar_task(model, options["length"], options["pairs"], options["queries"],
                             distinct_queries=options["distinct_queries"])
            mqar_batch(1, task["num_pairs"], task["num_queries"], task["vocab_size"], None, task["seq_len"],
                       task["distinct_queries"])
        elif args.task == "passkey" and passkey_form(tokenizer, options["form"]) == "token":
            passkey_token_sample(min(options["lengths"]), 0.0, model.config.vocab_size, None, options["digits"])
    except ValueError as err:
        hint = "--length, --pairs or --queries" if args.task == "mqar" else "--lengths or --digits"
        raise UsageError(f"{err}: change {hint}") from err


def _run_eval(args: argparse.Namespace) -> int:
    from .cli import (
        check_device,
        check_model_source,
        loading_bars,
        loading_errors,
        progress_wanted,
        show_loading_bar,
    )

    args.task = _chosen_task(args)
    device = check_device(args.device or default_device())
    check_model_source(args.model)
    _check_before_loading(args)
    options = _task_options(args)
    progress = progress_wanted(args)
    with loading_errors(args.model), loading_bars(show_loading_bar(args.model, progress)):
        model, tokenizer = load_model(args.model, device)
    _check_with_model(model, tokenizer, args, options)
    result = evaluate(model, args.task, tokenizer=tokenizer, seed=args.seed, progress=progress, **options)
    result["source"] = str(args.model)
    print(format_results(result))
    if args.output:
        output = Path(args.output)
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(result, indent=2) + "\n")
        print(f"results written to {output}")
    return 0


def _cli_type(parse: Any, what: str) -> Any:
    """``parse`` as an argparse type: its ValueError becomes argparse's one-line error, found before any loading."""

    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        if isinstance(value, list) and not value:
            raise argparse.ArgumentTypeError(f"give at least one {what}")
        return value

    convert.__name__ = what  # argparse names the type in some messages
    return convert


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise ValueError(f"must be >= 1, got {value}")
    return value


def add_eval_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``eval`` subcommand (``mnemo eval MODEL {mqar,passkey,ppl} [options]``, or ``--task TASK``)."""
    parser = subparsers.add_parser(
        "eval", help="score a model on MQAR, passkey retrieval or perplexity",
        description="Score a model folder (a mnemo checkpoint or an exported folder) on a task.",
    )
    count = _cli_type(_positive, "count")
    parser.add_argument("model", help="a model folder (or Hub id)")
    parser.add_argument("task", nargs="?", choices=TASKS, help="the task (or --task)")
    parser.add_argument("--task", dest="task_option", choices=TASKS, default=None, help="the task, as an option")
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the generated samples (default 0): the same seed scores the same samples")
    parser.add_argument("--output", default=None, help="write the results as JSON to this file")
    parser.add_argument("--samples", type=count, default=None,
                        help="mqar: sequences (default 256); passkey: prompts per length and depth (default 5)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (there is none either when stderr is not a terminal)")
    mqar = parser.add_argument_group("mqar (defaults: what the model was trained on by mnemo demo, if it was)")
    mqar.add_argument("--length", type=_cli_type(parse_length, "length"), default=None,
                      help="sequence length (e.g. 64, 1k)")
    mqar.add_argument("--pairs", type=count, default=None, help="key-value pairs in the context")
    mqar.add_argument("--queries", type=count, default=None, help="queries per sequence (default: as many as pairs)")
    mqar.add_argument("--distinct-queries", action=argparse.BooleanOptionalAction, default=None,
                      help="query each pair at most once (default), or draw each query's pair at random")
    passkey = parser.add_argument_group("passkey")
    passkey.add_argument("--lengths", type=_cli_type(parse_lengths, "length"), default=DEFAULT_LENGTHS,
                         help=f"prompt lengths (default {DEFAULT_LENGTHS})")
    passkey.add_argument("--depths", type=_cli_type(parse_depths, "depth"), default=DEFAULT_DEPTHS,
                         help=f"needle depths, fractions of the prompt (default {DEFAULT_DEPTHS})")
    passkey.add_argument("--digits", type=count, default=5, help="digits of the passkey (default 5)")
    passkey.add_argument("--form", choices=("text", "token"), default=None,
                         help="text (needs a tokenizer; the default when the model has one) or token ids")
    ppl = parser.add_argument_group("ppl")
    ppl.add_argument("--text", default=None, help="a UTF-8 text file")
    ppl.add_argument("--context-length", type=count, default=1024, help="tokens per window (default 1024)")
    ppl.add_argument("--stride", type=count, default=None, help="tokens between windows (default: half a window)")
    parser.set_defaults(func=_run_eval)
    return parser
