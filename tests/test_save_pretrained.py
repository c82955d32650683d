"""What ``save_pretrained`` and ``push_to_hub`` write, as transformers users expect it (that the folders load
without mnemo is checked in test_hub_export.py): the card's rules, the cache setting, file modes, pushing, and
errors that name a damaged weights file."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import mnemo
from conftest import tiny_mc_titans, tiny_mom
from mnemo.conversion.checkpoint_io import ConversionError, load_state_dict
from mnemo.conversion.hub_export import export_hub_folder
from mnemo.modeling.hub_files import CARD_MARK, hub_modules


pytestmark = pytest.mark.usefixtures("one_thread")

def test_save_pretrained_writes_what_loads_without_mnemo(tmp_path):
    model = tiny_mc_titans()
    model.save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["auto_map"] == {"AutoConfig": "configuration_mc_titans.MCTitansConfig",
                                  "AutoModel": "modeling_mc_titans.MCTitansModel",
                                  "AutoModelForCausalLM": "modeling_mc_titans.MCTitansForCausalLM"}
    for module in hub_modules(model):
        assert (tmp_path / "saved" / f"{module.name}.py").read_text() == module.source
    card = (tmp_path / "saved" / "README.md").read_text()
    assert "Memory Caching" in card and "path/to/saved" in card and card.rstrip().endswith(CARD_MARK)
    assert not list((tmp_path / "saved").glob("*.bin"))
    reloaded = mnemo.MCTitansForCausalLM.from_pretrained(tmp_path / "saved")  # natively, where mnemo is
    assert type(reloaded) is mnemo.MCTitansForCausalLM


def test_a_readme_of_ones_own_is_kept_and_mnemos_card_is_rewritten(tmp_path):
    model = tiny_mom()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "README.md").write_text("# My model\n")
    model.save_pretrained(tmp_path / "mine")
    assert (tmp_path / "mine" / "README.md").read_text() == "# My model\n"
    model.save_pretrained(tmp_path / "ours")
    (tmp_path / "ours" / "README.md").write_text("stale\n" + CARD_MARK + "\n")
    model.save_pretrained(tmp_path / "ours")  # saving again into the same folder, as Trainer's checkpoints do
    assert "Mixture-of-Memories" in (tmp_path / "ours" / "README.md").read_text()


def test_a_model_saved_after_training_decodes_with_its_cache(tmp_path):
    """transformers' Trainer sets ``config.use_cache = False`` (its TrainingArguments default); saved and exported
    folders, and their cards, keep the model's decoding default."""
    from transformers import Trainer, TrainingArguments

    model = tiny_mom()
    args = TrainingArguments(output_dir=str(tmp_path / "run"), report_to=[], use_cpu=True)
    trainer = Trainer(model=model, args=args)
    assert model.config.use_cache is False
    trainer.save_model(str(tmp_path / "saved"))
    export_hub_folder(model, tmp_path / "exported")
    for folder in ("saved", "exported"):
        assert json.loads((tmp_path / folder / "config.json").read_text())["use_cache"] is True, folder
        assert "| `use_cache` | `true` |" in (tmp_path / folder / "README.md").read_text(), folder
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")  # natively: auto_map is not needed here
    assert type(reloaded) is mnemo.MoMForCausalLM
    assert reloaded.config.use_cache is True and reloaded(torch.tensor([[1, 2, 3]])).cache is not None


def test_saved_and_exported_folders_follow_the_umask(tmp_path):
    """A folder to share or serve gets the user's umask: not the 0700 of a temporary folder, nor the 0600 that
    safetensors gives the weights."""
    old = os.umask(0o027)
    try:
        tiny_mom().save_pretrained(tmp_path / "saved")
        export_hub_folder(tiny_mom(), tmp_path / "exported")
    finally:
        os.umask(old)
    for folder in ("saved", "exported"):
        assert stat.S_IMODE((tmp_path / folder).stat().st_mode) == 0o750, folder
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / folder).iterdir()}
        assert set(modes.values()) == {0o640}, (folder, modes)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "saved"]  # no staging folder left


class _Hub:
    """``huggingface_hub.HfApi`` recording the calls of a push."""

    calls: list = []
    has_card = False

    def __init__(self, token=None):
        self.calls.append(("init", token))

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))
        return type("RepoUrl", (), {"repo_id": repo_id})()

    def file_exists(self, repo_id, filename, **kwargs):  # noqa: ARG002
        return self.has_card

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        files = {p.name: p.read_text() if p.suffix in (".md", ".json") else None for p in Path(folder_path).iterdir()}
        self.calls.append(("upload_folder", repo_id, files, kwargs))
        return "https://hub.test/commit/1"


def test_push_uploads_the_card_unless_the_repository_has_one(tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub import ModelCard
    from transformers.utils import hub

    monkeypatch.setattr(huggingface_hub, "HfApi", _Hub)
    def repository_card(repo_id, tags, **kwargs):  # noqa: ARG001  (transformers' signature: the token)
        return ModelCard(f"---\ntags: {tags}\n---\nthe card of {repo_id}")

    monkeypatch.setattr(hub, "create_and_tag_model_card", repository_card)
    _Hub.calls, _Hub.has_card = [], False
    model = tiny_mom()
    model.save_pretrained(tmp_path / "out", push_to_hub=True, repo_id="me/mom", commit_message="first")
    _, repo_id, files, kwargs = _Hub.calls[-1]
    assert repo_id == "me/mom" and kwargs["commit_message"] == "first"
    assert "modeling_mom.py" in files and "model.safetensors" in files and "auto_map" in files["config.json"]
    assert "me/mom" in files["README.md"] and files["README.md"].rstrip().endswith(CARD_MARK)

    _Hub.calls, _Hub.has_card = [], True
    model.push_to_hub("me/mom", tags=["extra"], revision=None)
    files = _Hub.calls[-1][2]
    assert files["README.md"].startswith("---\ntags:") and "the card of me/mom" in files["README.md"]
    assert "modeling_mom.py" in files


def test_truncated_weights_are_named(tmp_path):
    tiny_mom().save_pretrained(tmp_path / "ckpt")
    weights = tmp_path / "ckpt" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    for load in (mnemo.MoMForCausalLM.from_pretrained, AutoModelForCausalLM.from_pretrained):
        with pytest.raises(OSError, match="model.safetensors is truncated or corrupt: its tensors would need"):
            load(tmp_path / "ckpt")
    with pytest.raises(ConversionError, match="model.safetensors is truncated or corrupt"):
        load_state_dict(tmp_path / "ckpt")
