"""``mnemo eval``: score a model on MQAR, passkey retrieval or perplexity.

:func:`evaluate` takes a model (or a folder: a mnemo checkpoint, or an exported
``trust_remote_code`` folder) and a task name, and returns a JSON-serialisable
dict; :func:`format_results` renders it as a small table; :func:`add_eval_parser`
adds the ``eval`` subcommand to an ``argparse`` parser.

MQAR's defaults come from the model when it was trained by ``mnemo demo`` (its
config's ``mqar_task`` records the sequence length, pairs, queries and vocabulary
it was trained on), so ``mnemo eval FOLDER mqar`` scores it on its own task.
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
    passkey_text_accuracy,
    passkey_text_sample,
    passkey_token_accuracy,
    passkey_token_sample,
    perplexity,
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
    depths = [float(d) for d in items if str(d).strip()]
    for depth in depths:
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth {depth} is outside [0, 1]")
    return depths


def default_device() -> str:
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


def _mqar(model, seed: int, length: int | None = None, pairs: int | None = None, queries: int | None = None,
          samples: int = 256, vocab_size: int | None = None, batch_size: int = 64,
          distinct_queries: bool | None = None) -> dict:
    trained = dict(getattr(model.config, "mqar_task", None) or {})
    seq_len = length if length is not None else trained.get("seq_len", MQAR_DEFAULTS["seq_len"])
    num_pairs = pairs if pairs is not None else trained.get("num_pairs", MQAR_DEFAULTS["num_pairs"])
    num_queries = queries if queries is not None else trained.get("num_queries") or num_pairs
    vocab = vocab_size if vocab_size is not None else trained.get("vocab_size", model.config.vocab_size)
    distinct = distinct_queries if distinct_queries is not None else trained.get("distinct_queries", True)
    accuracy = mqar_accuracy(model, num_pairs, num_queries, seq_len=seq_len, num_samples=samples, vocab_size=vocab,
                             seed=seed, batch_size=batch_size, distinct_queries=distinct)
    return {"task": "mqar", "accuracy": accuracy, "length": seq_len, "pairs": num_pairs, "queries": num_queries,
            "distinct_queries": distinct, "samples": samples, "vocab_size": vocab, "seed": seed}


def _cell_generator(seed: int, length: int, depth: float) -> torch.Generator:
    # Each (length, depth) cell has samples of its own: adding a length leaves the others unchanged.
    return torch.Generator().manual_seed(seed * 1_000_003 + length * 1009 + round(depth * 1000))


def _passkey(model, tokenizer, seed: int, lengths: str | list = DEFAULT_LENGTHS, depths: str | list = DEFAULT_DEPTHS,
             samples: int = 5, digits: int = 5, form: str | None = None) -> dict:
    form = form or ("text" if tokenizer is not None else "token")
    if form not in ("text", "token"):
        raise ValueError(f"form must be 'text' or 'token', got {form!r}")
    if form == "text" and tokenizer is None:
        raise ValueError("the text form of passkey needs a tokenizer and this model has none: use form='token'")
    cells = []
    for length in parse_lengths(lengths):
        for depth in parse_depths(depths):
            generator = _cell_generator(seed, length, depth)
            if form == "text":
                batch = [passkey_text_sample(tokenizer, length, depth, generator, digits) for _ in range(samples)]
                accuracy = passkey_text_accuracy(model, tokenizer, batch)
            else:
                batch = [passkey_token_sample(length, depth, model.config.vocab_size, generator, digits)
                         for _ in range(samples)]
                accuracy = passkey_token_accuracy(model, batch)
            cells.append({"length": length, "depth": depth, "accuracy": accuracy})
    mean = sum(c["accuracy"] for c in cells) / len(cells) if cells else float("nan")
    return {"task": "passkey", "form": form, "accuracy": mean, "cells": cells, "samples": samples, "digits": digits,
            "seed": seed}


def _ppl(model, tokenizer, text: str | None = None, text_file: str | Path | None = None, context_length: int = 1024,
         stride: int | None = None) -> dict:
    if tokenizer is None:
        raise ValueError("perplexity needs a tokenizer and this model has none; the mqar and passkey tasks work on "
                         "token ids")
    if (text is None) == (text_file is None):
        raise ValueError("pass exactly one of text and text_file for perplexity")
    if text_file is not None:
        text = Path(text_file).read_text(encoding="utf-8")
    result = perplexity(model, tokenizer, text, context_length=context_length, stride=stride)
    return {"task": "ppl", **result, "context_length": context_length,
            "stride": stride if stride is not None else max(context_length // 2, 1),
            **({"text_file": str(text_file)} if text_file is not None else {})}


def evaluate(model_or_path: Any, task: str, *, tokenizer: Any = None, device: str | None = None, seed: int = 0,
             trust_remote_code: bool = True, **options: Any) -> dict:
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
    used, ``model`` (its class) and ``parameters``.
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
        result = _mqar(model, seed, **options)
    elif task == "passkey":
        result = _passkey(model, tokenizer, seed, **options)
    else:
        result = _ppl(model, tokenizer, **options)
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
    named = {t for t in (args.task, args.task_option) if t is not None}
    if len(named) != 1:
        problem = "name the task" if not named else f"two different tasks were named ({', '.join(sorted(named))})"
        raise SystemExit(f"mnemo eval: {problem}: mnemo eval MODEL {{{','.join(TASKS)}}} (or --task TASK)")
    return named.pop()


def _run_eval(args: argparse.Namespace) -> int:
    args.task = _chosen_task(args)
    options: dict[str, Any] = {}
    if args.task == "mqar":
        options = dict(length=args.length, pairs=args.pairs, queries=args.queries, samples=args.samples or 256,
                       distinct_queries=args.distinct_queries)
    elif args.task == "passkey":
        options = dict(lengths=args.lengths, depths=args.depths, samples=args.samples or 5, digits=args.digits,
                       form=args.form)
    else:
        if args.text is None:
            raise SystemExit("mnemo eval ppl needs --text FILE")
        options = dict(text_file=args.text, context_length=args.context_length, stride=args.stride)
    result = evaluate(args.model, args.task, device=args.device, seed=args.seed, **options)
    print(format_results(result))
    if args.output:
        output = Path(args.output)
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(result, indent=2) + "\n")
        print(f"results written to {output}")
    return 0


def add_eval_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``eval`` subcommand (``mnemo eval MODEL {mqar,passkey,ppl} [options]``, or ``--task TASK``)."""
    parser = subparsers.add_parser(
        "eval", help="score a model on MQAR, passkey retrieval or perplexity",
        description="Score a model folder (a mnemo checkpoint or an exported folder) on a task.",
    )
    parser.add_argument("model", help="a model folder (or Hub id)")
    parser.add_argument("task", nargs="?", choices=TASKS, help="the task (or --task)")
    parser.add_argument("--task", dest="task_option", choices=TASKS, default=None, help="the task, as an option")
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="write the results as JSON to this file")
    parser.add_argument("--samples", type=int, default=None,
                        help="mqar: sequences (default 256); passkey: prompts per length and depth (default 5)")
    mqar = parser.add_argument_group("mqar (defaults: what the model was trained on by mnemo demo, if it was)")
    mqar.add_argument("--length", type=parse_length, default=None, help="sequence length (e.g. 64, 1k)")
    mqar.add_argument("--pairs", type=int, default=None, help="key-value pairs in the context")
    mqar.add_argument("--queries", type=int, default=None, help="queries per sequence (default: as many as pairs)")
    mqar.add_argument("--distinct-queries", action=argparse.BooleanOptionalAction, default=None,
                      help="query each pair at most once (default), or draw each query's pair at random")
    passkey = parser.add_argument_group("passkey")
    passkey.add_argument("--lengths", default=DEFAULT_LENGTHS, help=f"prompt lengths (default {DEFAULT_LENGTHS})")
    passkey.add_argument("--depths", default=DEFAULT_DEPTHS, help=f"needle depths (default {DEFAULT_DEPTHS})")
    passkey.add_argument("--digits", type=int, default=5, help="digits of the passkey")
    passkey.add_argument("--form", choices=("text", "token"), default=None,
                         help="text (needs a tokenizer; the default when the model has one) or token ids")
    ppl = parser.add_argument_group("ppl")
    ppl.add_argument("--text", default=None, help="a UTF-8 text file")
    ppl.add_argument("--context-length", type=int, default=1024, help="tokens per window")
    ppl.add_argument("--stride", type=int, default=None, help="tokens between windows (default: half a window)")
    parser.set_defaults(func=_run_eval)
    return parser
