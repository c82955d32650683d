"""Self-contained Hub folders (``trust_remote_code``) and pushing them to the Hub.

Every mnemo model's ``save_pretrained`` writes what ``AutoModelForCausalLM.from_pretrained(folder,
trust_remote_code=True)`` needs on a machine without mnemo (:mod:`..modeling.hub_files`):
``config.json`` with an ``auto_map``, the flat modules generated from the package's own
source (:mod:`.flatten`), ``model.safetensors``, ``generation_config.json`` and a model card
filled here from the family's template (:func:`model_card`). :func:`export_hub_folder` does
that for a model or a checkpoint folder into a new folder, with the tokenizer when there is
one; the folder is written beside its destination and moved into place only when complete.
:func:`push_to_hub` uploads such a folder with ``huggingface_hub``.
"""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import Any

from ..model_cards import render_card
from ..modeling.hub_files import defining_class, hub_modules
from .checkpoint_io import ConversionError, copy_tokenizer_files, staged_output

__all__ = ["export_hub_folder", "hub_modules", "model_card", "push_to_hub"]


def _package_version() -> str:
    from mnemo import __version__

    return __version__


def _load(model_or_path: Any):
    if isinstance(model_or_path, (str, os.PathLike)):
        import mnemo  # noqa: F401  (registers the families with the Auto classes)
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model_or_path, dtype="auto")
    return model_or_path


def _check_model(model: Any) -> None:
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        hint = " (merge a PEFT model first: model.merge_and_unload())" if hasattr(model, "peft_config") else ""
        raise TypeError(f"expected a mnemo model or a checkpoint folder, got {type(model).__name__}{hint}")
    module = type(model).__module__
    if not module.startswith("mnemo.modeling.") or not type(model).__name__.endswith("ForCausalLM"):
        raise TypeError(f"{type(model).__name__} is not a mnemo *ForCausalLM model")


def _config_table(config: Any, values: dict) -> str:
    declared = [p for p in inspect.signature(type(config).__init__).parameters if p not in ("self", "kwargs")]
    return "\n".join(f"| `{name}` | `{json.dumps(values.get(name))}` |" for name in declared)


def _lora_targets(model: Any) -> list[str]:
    from mnemo.integrations import LORA_TARGET_MODULES

    names = [name for name, _ in model.named_modules()]
    return [
        target for target in LORA_TARGET_MODULES.get(model.config.model_type, [])
        if any(name == target or name.endswith("." + target) for name in names)
    ]


def model_card(model: Any, config: dict, *, title: str, repo_id: str | None = None, source: str | None = None) -> str:
    """The filled model card of ``model`` whose saved ``config.json`` holds ``config``.

    ``repo_id`` is where the card says to load it from (default ``path/to/<title>``); ``source`` is the
    provenance (default: the config's ``converted_from``, else "a mnemo checkpoint").
    """
    if source is None:
        converted = getattr(model.config, "converted_from", None)
        source = f"converted from {converted}" if converted else f"a mnemo {_package_version()} checkpoint"
    fields = {
        "title": title,
        "repo_id": repo_id or f"path/to/{title}",
        "version": _package_version(),
        "model_type": model.config.model_type,
        "architecture": defining_class(model).__name__,
        "parameters": f"{sum(p.numel() for p in model.parameters()):,}",
        "source": source,
        "lora_targets": json.dumps(_lora_targets(model)),
        "config_table": _config_table(model.config, config),
    }
    return render_card(model.config.model_type, fields)


def export_hub_folder(
    model_or_path: Any,
    out_dir: str | os.PathLike,
    repo_id: str | None = None,
    *,
    tokenizer: Any = None,
    source: str | None = None,
) -> Path:
    """Write a folder that loads with ``trust_remote_code=True`` where mnemo is not installed.

    What ``save_pretrained`` writes, into a new folder, with the tokenizer and the provenance.

    Args:
        model_or_path: A mnemo ``*ForCausalLM`` model, or a checkpoint folder or Hub id
            that mnemo loads (its tokenizer files are copied along).
        out_dir: The folder to write; it must not exist or be empty.
        repo_id: The Hub id the folder is meant for (used by the model card only).
        tokenizer: A tokenizer to save with the model.
        source: Provenance for the model card (default: the config's ``converted_from``,
            else "a mnemo checkpoint").

    Returns:
        The path of the written folder.
    """
    model = _load(model_or_path)
    _check_model(model)
    with staged_output(out_dir) as staging:
        model.save_pretrained(staging, repo_id=repo_id, model_card_source=source)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        elif isinstance(model_or_path, (str, os.PathLike)) and Path(model_or_path).is_dir():
            copy_tokenizer_files(model_or_path, staging)
    return Path(out_dir)


def push_to_hub(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    token: str | None = None,
    private: bool = False,
    commit_message: str = "Upload mnemo model",
    revision: str | None = None,
    create_pr: bool = False,
) -> str:
    """Upload an exported folder to ``repo_id`` (created if missing); returns the commit URL.

    The token comes from ``token``, else from the usual places (``HF_TOKEN``, the
    stored login). ``revision`` names the branch to commit to (it is created from
    the default branch when missing); ``create_pr`` opens a pull request instead of
    committing to the branch, as ``huggingface_hub`` does.
    """
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file() or "auto_map" not in json.loads(config_path.read_text(encoding="utf-8")):
        raise ConversionError(f"{folder} is not an exported mnemo folder (no config.json with auto_map)")
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    if revision is not None and not create_pr:
        api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
    commit = api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                               commit_message=commit_message, revision=revision, create_pr=create_pr)
    return str(getattr(commit, "commit_url", commit))
