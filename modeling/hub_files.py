"""The files that let a saved mnemo folder load where mnemo is not installed.

Every mnemo model's ``save_pretrained`` (so also ``push_to_hub``, ``mnemo export``
and Trainer's checkpoints) ends with :func:`write_hub_files`: ``config.json``
gains an ``auto_map`` naming the config and model classes, the folder gets the
flat modules that define them (generated from the package's own source by
:mod:`..conversion.flatten`) and a model card. The folder then loads with
``trust_remote_code=True`` without mnemo, and with mnemo imported through its
registered model types. :func:`push_folder` uploads such a folder.

This module is one of the flat modules, so a model loaded from such a folder saves
the same files again. The card's templates are mnemo's package data: a flat copy
writes no card of its own.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

from ..conversion.flatten import FlatModule, flat_sources

__all__ = ["CARD_MARK", "auto_map", "defining_class", "hub_modules", "push_folder", "write_hub_files"]

# The last line of every card mnemo writes: save_pretrained rewrites such a card and keeps any other README.md.
CARD_MARK = "<!-- Written by mnemo's save_pretrained, which rewrites it: delete this line to keep your edits. -->"

# Inside the package this module is ``mnemo.modeling.hub_files``; a flat copy loaded with trust_remote_code is a
# module of transformers' dynamic-module package, with no mnemo around it.
_PACKAGE = __name__.rsplit(".", 2)[0] if __name__.endswith(".modeling.hub_files") else None


def _package_version() -> str | None:
    return importlib.import_module(_PACKAGE).__version__ if _PACKAGE else None


def defining_class(obj: Any) -> type:
    """The class that defines ``obj``: FSDP2's ``fully_shard`` gives a module a subclass ``FSDP<name>`` made at
    run time, whose module is torch's."""
    cls = type(obj)
    return next((c for c in cls.__mro__ if c.__name__ == cls.__name__.removeprefix("FSDP")), cls)


def hub_modules(model: Any) -> list[FlatModule]:
    """The flat modules that define ``model``'s config and class, and all they import."""
    roots = [type(model.config).__module__, defining_class(model).__module__]
    return flat_sources(roots, _package_version())


def auto_map(model: Any) -> dict[str, str]:
    """``config.json``'s ``auto_map``: the flat module and class of the config, the model and its base model."""

    def flat(cls: type) -> str:
        return f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}"

    classes = {"AutoConfig": flat(type(model.config)), "AutoModelForCausalLM": flat(defining_class(model))}
    base = model.base_model
    if base is not model:
        classes["AutoModel"] = flat(defining_class(base))
    return classes


def _card(model: Any, config: dict, folder: Path, repo_id: str | None, source: str | None) -> str | None:
    if _PACKAGE is None:
        return None
    hub_export = importlib.import_module(f"{_PACKAGE}.conversion.hub_export")
    return hub_export.model_card(model, config, title=(repo_id or folder.name).rsplit("/", 1)[-1],
                                 repo_id=repo_id, source=source) + "\n" + CARD_MARK + "\n"


def write_hub_files(model: Any, folder: str | os.PathLike, *, repo_id: str | None = None,
                    source: str | None = None) -> None:
    """Complete a folder that ``save_pretrained`` wrote so that it loads with ``trust_remote_code=True``.

    Writes the ``auto_map`` and ``use_cache: true`` into ``config.json`` (transformers' Trainer sets
    ``use_cache=False`` for training; a saved model should decode with its cache), the flat modules
    (replacing earlier copies of the same files), and the model card as ``README.md`` unless the folder
    holds a README that mnemo did not write. The weights get the mode of ``config.json`` (the user's
    umask), where safetensors writes them readable by their owner alone.
    """
    folder = Path(folder)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["auto_map"] = auto_map(model)
    config["use_cache"] = True
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    mode = config_path.stat().st_mode & 0o777
    for weights in folder.glob("*.safetensors"):
        os.chmod(weights, mode)
    for module in hub_modules(model):
        (folder / f"{module.name}.py").write_text(module.source, encoding="utf-8")
    readme = folder / "README.md"
    if not readme.is_file() or readme.read_text(encoding="utf-8").rstrip().endswith(CARD_MARK):
        card = _card(model, config, folder, repo_id, source)
        if card is not None:
            readme.write_text(card, encoding="utf-8")


def push_folder(
    folder: Path,
    repo_id: str,
    *,
    token: str | bool | None = None,
    private: bool | None = None,
    commit_message: str | None = None,
    commit_description: str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    tags: list[str] | None = None,
) -> Any:
    """Upload a saved folder to ``repo_id`` (created if missing), as transformers' ``push_to_hub`` does.

    A README the repository already has stays (with ``tags`` added), as transformers keeps it; otherwise
    the folder's card is uploaded, or transformers' default card where the folder has none.
    """
    from huggingface_hub import HfApi, ModelCard
    from transformers.utils.hub import create_and_tag_model_card

    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    readme = folder / "README.md"
    if readme.is_file() and not api.file_exists(repo_id, "README.md", revision=revision):
        card = ModelCard(readme.read_text(encoding="utf-8"))
        card.data.tags = list(dict.fromkeys([*(card.data.tags or []), *(tags or [])]))
    else:
        card = create_and_tag_model_card(repo_id, tags, token=token)
    card.save(readme)
    if revision is not None and not create_pr:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    return api.upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message=commit_message or "Upload model",
                             commit_description=commit_description, revision=revision, create_pr=create_pr)
