"""Reading source checkpoints and writing converted ones, safely.

Every conversion goes through these helpers so that they share one set of
guarantees: weights load from safetensors unless the caller opts into pickled
files (then with ``torch.load(weights_only=True)``); a state dict that does not
match the target model is refused with the missing and unexpected tensors named;
the output folder is written beside its final place and moved there only when
complete, so a failed conversion leaves no half-written output and never touches
the source or an existing, non-empty folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

__all__ = [
    "ConversionError",
    "TOKENIZER_FILES",
    "check_state_dict_keys",
    "copy_tokenizer_files",
    "load_state_dict",
    "read_config",
    "staged_output",
]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)


class ConversionError(ValueError):
    """A checkpoint cannot be converted as asked; the message says why."""


def read_config(src_dir: str | os.PathLike) -> dict:
    """The ``config.json`` of a checkpoint folder, as a dict."""
    path = Path(src_dir) / "config.json"
    if not path.is_file():
        raise ConversionError(f"{src_dir} has no config.json: not a checkpoint folder")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _shards(src: Path, index_name: str, single_name: str) -> list[Path] | None:
    if (src / single_name).is_file():
        return [src / single_name]
    index = src / index_name
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return [src / name for name in sorted(set(weight_map.values()))]
    return None


def load_state_dict(src_dir: str | os.PathLike, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder (single file or sharded with an index), on the CPU.

    Reads ``model.safetensors`` (or its shards). Pickled ``pytorch_model.bin`` files are
    refused unless ``allow_pickle=True``, and even then are read with
    ``torch.load(weights_only=True)``, which executes no code.
    """
    src = Path(src_dir)
    if not src.is_dir():
        raise ConversionError(f"{src_dir} is not a folder")
    shards = _shards(src, "model.safetensors.index.json", "model.safetensors")
    if shards is not None:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        from ..modeling.checkpoint_files import safetensors_problem

        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            try:
                state.update(load_file(str(shard), device="cpu"))
            except SafetensorError as error:
                why = safetensors_problem(shard) or str(error)
                raise ConversionError(f"{shard} is truncated or corrupt: {why}") from error
        return state
    shards = _shards(src, "pytorch_model.bin.index.json", "pytorch_model.bin")
    if shards is None:
        raise ConversionError(f"{src_dir} holds no weights (model.safetensors or pytorch_model.bin)")
    if not allow_pickle:
        raise ConversionError(
            f"{src_dir} holds only pickled weights ({shards[0].name}); pickles can run code when loaded. "
            "Pass allow_pickle=True (--allow-pickle) to read them with torch.load(weights_only=True)."
        )
    state = {}
    for shard in shards:
        state.update(torch.load(shard, map_location="cpu", weights_only=True))
    return state


def check_state_dict_keys(provided: Iterable[str], expected: Iterable[str], what: str) -> None:
    """Raise :class:`ConversionError` naming every missing and unexpected tensor, if any."""
    provided, expected = set(provided), set(expected)
    missing, unexpected = sorted(expected - provided), sorted(provided - expected)
    if missing or unexpected:
        lines = [f"{what}: the checkpoint does not match the target model."]
        if missing:
            lines.append(f"missing ({len(missing)}): " + ", ".join(missing))
        if unexpected:
            lines.append(f"unexpected ({len(unexpected)}): " + ", ".join(unexpected))
        raise ConversionError("\n".join(lines))


def copy_tokenizer_files(src_dir: str | os.PathLike, out_dir: str | os.PathLike) -> list[str]:
    """Copy the tokenizer files a checkpoint folder has; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        path = Path(src_dir) / name
        if path.is_file():
            shutil.copy2(path, Path(out_dir) / name)
            copied.append(name)
    return copied


def check_output_dir(out_dir: str | os.PathLike) -> Path:
    """Refuse an output folder that exists and is not empty (nothing is overwritten)."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConversionError(f"{out_dir} exists and is not empty: refusing to overwrite it")
    return out


@contextlib.contextmanager
def staged_output(out_dir: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary folder beside ``out_dir``; move it into place only if the block succeeds.

    ``out_dir`` must not exist or be empty. On any error the temporary folder is
    removed and ``out_dir`` is left as it was. The folder yielded has ``out_dir``'s
    name (what is written there may name itself after its folder) and the mode
    ``mkdir`` gives under the user's umask; it lies in a private temporary folder
    (mode 0700), removed afterwards.
    """
    out = check_output_dir(out_dir).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    holder = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        staging = holder / out.name
        staging.mkdir()
        yield staging
        check_output_dir(out)  # nothing appeared there meanwhile
        if out.exists():
            out.rmdir()
        os.replace(staging, out)
    finally:
        shutil.rmtree(holder, ignore_errors=True)
