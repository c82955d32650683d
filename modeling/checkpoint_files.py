"""Naming the weights file that cannot be read.

safetensors reports a truncated or corrupt file as "incomplete metadata" or "invalid
header length", without the file's name; :func:`safetensors_problem` tells what is
wrong with one file from its header and size alone, and :func:`explain_unreadable_weights`
turns such an error of ``from_pretrained`` into one that names the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

__all__ = ["explain_unreadable_weights", "safetensors_problem"]


def safetensors_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a whole safetensors file (``None`` when its header and size agree)."""
    size = os.path.getsize(path)
    if size < 8:
        return f"it has {size} bytes, fewer than a safetensors header's length field"
    with open(path, "rb") as f:
        header_size = int.from_bytes(f.read(8), "little")
        if 8 + header_size > size:
            return f"its header would need {8 + header_size} bytes but the file has {size}"
        try:
            header = json.loads(f.read(header_size))
            end = max((entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"),
                      default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "its header is not a safetensors header"
    if 8 + header_size + end > size:
        return f"its tensors would need {8 + header_size + end} bytes but the file has {size}"
    return None


def _candidate_folder(name_or_path: str | os.PathLike, kwargs: dict[str, Any]) -> Path | None:
    """The folder ``from_pretrained`` read: a local one, or the Hub cache's snapshot."""
    subfolder = kwargs.get("subfolder") or ""
    if os.path.isdir(name_or_path):
        return Path(name_or_path) / subfolder
    try:
        from huggingface_hub import snapshot_download

        snapshot = snapshot_download(str(name_or_path), revision=kwargs.get("revision"),
                                     cache_dir=kwargs.get("cache_dir"), local_files_only=True)
    except Exception:  # not in the cache, or not a repository id: nothing to inspect
        return None
    return Path(snapshot) / subfolder


def explain_unreadable_weights(error: BaseException, name_or_path: Any, kwargs: dict[str, Any]) -> OSError | None:
    """For safetensors' error on reading ``name_or_path``'s weights, an ``OSError`` naming the file that is
    truncated or corrupt; ``None`` for any other error."""
    if not isinstance(error, SafetensorError) or name_or_path is None:
        return None
    folder = _candidate_folder(name_or_path, kwargs)
    bad = []
    if folder is not None and folder.is_dir():
        for path in sorted(folder.glob("*.safetensors")):
            problem = safetensors_problem(path)
            if problem is not None:
                bad.append(f"{path} is truncated or corrupt: {problem}")
    if not bad:
        bad.append(f"a safetensors weights file of {name_or_path} is truncated or corrupt")
    return OSError("; ".join(bad) + f" (safetensors: {error}). Save or download the checkpoint again.")
