"""Hub folders: every family and variant loads with ``trust_remote_code`` in a process without mnemo.

The exported folders are loaded from a path and from an offline Hub cache in one
fresh interpreter (``hub_loader.py``) that cannot import mnemo; logits and greedy
tokens must equal the in-package model's exactly (same code, same weights, same
thread count). So do a plain ``save_pretrained`` folder, saved again there by the
classes it loaded, and what ``model.push_to_hub`` uploads. Also: the flat files are
the package's source, the model card is filled, LoRA adapters load onto a
remote-code base and PEFT's default targets come with the code, pipelines work, and
pushing calls the Hub client as it should.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model

import mnemo
from conftest import MODEL_VARIANTS, MOM_VARIANTS, tiny_atlas, tiny_mc_titans, tiny_mom
from mnemo.cli import main as cli_main
from mnemo.conversion.checkpoint_io import ConversionError
from mnemo.conversion.flatten import unflatten
from mnemo.conversion.hub_export import export_hub_folder, hub_modules, push_to_hub

LOADER = Path(__file__).with_name("hub_loader.py")
HUB_IDS = {"mom-hybrid": "org/tiny-mom", "deep-hebbian": "org/tiny-deep", "mc-grm": "org/tiny-mc",
           "atlas-mag-dla": "org/tiny-atlas"}
# Gated Memory Caching of MoM and Atlas, exported only here (the shared variants stay few): their kernels
# (per-memory summaries, mc_read) must reach the flat files too. Segments of 4 tokens: several cached.
GATED_MC_VARIANTS = {
    "mom-mc-ssc": (tiny_mom, {"segment_size": 4, "aggregation": "ssc", "ssc_topk": 1, "topk": 1, "num_memories": 3}),
    "atlas-mc-soup": (tiny_atlas, {"segment_size": 4, "aggregation": "soup"}),
}
EXPORTED_VARIANTS = {**MODEL_VARIANTS, **GATED_MC_VARIANTS}
SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"
MAX_NEW = 6


def _inputs(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, vocab, (2, 11), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0  # left padding
    return ids, mask


def _word_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.decoder = decoders.WordPiece()  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")


def _install_in_offline_cache(folder: Path, hub_home: Path, repo_id: str) -> None:
    repo = hub_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / SNAPSHOT
    snapshot.mkdir(parents=True)
    for file in folder.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SNAPSHOT)  # no trailing newline, as the Hub client writes it


class _HubOfCache:
    """``huggingface_hub.HfApi`` for ``model.push_to_hub``: an upload lands in an offline Hub cache."""

    hub_home: Path
    calls: list = []

    def __init__(self, token=None):
        self.calls.append(("init", token))

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))
        return type("RepoUrl", (), {"repo_id": repo_id})()

    def file_exists(self, repo_id, filename, **kwargs):  # noqa: ARG002
        return False  # a new repository: no card of its own

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        self.calls.append(("upload_folder", repo_id, sorted(p.name for p in Path(folder_path).iterdir()), kwargs))
        _install_in_offline_cache(Path(folder_path), self.hub_home, repo_id)
        return type("CommitInfo", (), {"commit_url": f"https://hub.test/{repo_id}/commit/1"})()


def _run_loader(job: dict, tmp: Path) -> dict:
    job_path, result_path = tmp / "job.json", tmp / "result.pt"
    job_path.write_text(json.dumps(job))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HOME=str(tmp / "hf"), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    done = subprocess.run([sys.executable, str(LOADER), str(job_path), str(result_path)], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(result_path, weights_only=False)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Every variant exported, the four in HUB_IDS also installed in an offline Hub cache,
    one with a tokenizer and one with a LoRA adapter; loaded once in a fresh interpreter."""
    tmp = tmp_path_factory.mktemp("hub")
    models, entries = {}, []
    for name, (build, variant) in sorted(EXPORTED_VARIANTS.items()):
        model = build(**variant)
        models[name] = model
        folder = export_hub_folder(model, tmp / "folders" / name, repo_id=HUB_IDS.get(name))
        ids, mask = _inputs(model.config.vocab_size)
        entry = {"name": name, "source": str(folder), "input_ids": ids.tolist(), "attention_mask": mask.tolist(),
                 "max_new_tokens": MAX_NEW, "cuda_graph": not model.decode_graph_obstacle(model.config)}
        entries.append(entry)
        if name in HUB_IDS:
            _install_in_offline_cache(folder, tmp / "hf", HUB_IDS[name])
            entries.append({**entry, "name": f"hub:{name}", "source": HUB_IDS[name]})

    tokenizer = _word_tokenizer(97)
    models["with-tokenizer"] = tiny_mom(seed=3)
    folder = export_hub_folder(models["with-tokenizer"], tmp / "folders" / "with-tokenizer", tokenizer=tokenizer)
    entries.append({**entries[0], "name": "with-tokenizer", "source": str(folder), "pipeline_prompt": "w5 w9 w17",
                    "cuda_graph": False})

    # What users save and push themselves: a plain save_pretrained folder (with a tokenizer, so that a pipeline
    # builds from it), saved again by the exported classes and given PEFT's default targets there; and a
    # push_to_hub upload, loaded by its Hub id.
    models["saved"] = tiny_mom(seed=6, **MOM_VARIANTS["hybrid"])
    models["saved"].save_pretrained(tmp / "folders" / "saved")
    tokenizer.save_pretrained(tmp / "folders" / "saved")
    entries.append({**entries[0], "name": "saved", "source": str(tmp / "folders" / "saved"),
                    "pipeline_prompt": "w5 w9 w17", "cuda_graph": False, "resave": str(tmp / "resaved"),
                    "lora_defaults": str(tmp / "default-adapter")})
    models["pushed"] = tiny_atlas(seed=7, preset="dla")
    with pytest.MonkeyPatch.context() as patch:
        import huggingface_hub

        patch.setattr(huggingface_hub, "HfApi", _HubOfCache)
        _HubOfCache.hub_home, _HubOfCache.calls = tmp / "hf", []
        models["pushed"].push_to_hub("org/tiny-pushed", token="t0k")
    entries.append({**entries[0], "name": "pushed", "source": "org/tiny-pushed", "cuda_graph": False})

    lora = get_peft_model(tiny_mc_titans(seed=4), LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8))
    with torch.no_grad():
        for param_name, p in lora.named_parameters():
            if "lora_B" in param_name:
                p.normal_(0, 0.5)
    lora.eval().save_pretrained(tmp / "adapter")
    base = tiny_mc_titans(seed=4)  # the same weights as the adapted base, never touched by PEFT
    folder = export_hub_folder(base, tmp / "folders" / "lora-base")
    models["lora"] = lora
    entries.append({**entries[0], "name": "lora", "source": str(folder), "adapter": str(tmp / "adapter"),
                    "cuda_graph": False})

    results = _run_loader({"threads": torch.get_num_threads(), "models": entries}, tmp)
    return {"tmp": tmp, "models": models, "entries": {e["name"]: e for e in entries}, "results": results,
            "tokenizer": tokenizer, "push_calls": list(_HubOfCache.calls)}


def _expected(model, entry):
    ids, mask = torch.tensor(entry["input_ids"]), torch.tensor(entry["attention_mask"])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
    return logits, generated


@pytest.mark.parametrize("name", sorted(EXPORTED_VARIANTS))
def test_exported_folder_matches_the_package_model(exported, name):
    model, entry = exported["models"][name], exported["entries"][name]
    logits, generated = _expected(model, entry)
    got = exported["results"][name]
    assert got["class_module"].startswith("transformers_modules.")
    assert torch.equal(got["logits"], logits)
    assert torch.equal(got["generated"], generated)
    assert generated.shape[1] == 11 + MAX_NEW
    if entry["cuda_graph"]:
        assert torch.equal(got["generated_graph"], generated)


@pytest.mark.parametrize("name", sorted(HUB_IDS))
def test_offline_hub_cache_loads_the_same_model(exported, name):
    model, entry = exported["models"][name], exported["entries"][name]
    logits, generated = _expected(model, entry)
    got = exported["results"][f"hub:{name}"]
    assert torch.equal(got["logits"], logits)
    assert torch.equal(got["generated"], generated)


def test_pipeline_on_an_exported_folder(exported):
    from transformers import pipeline

    entry = exported["entries"]["with-tokenizer"]
    local = pipeline("text-generation", model=exported["models"]["with-tokenizer"], tokenizer=exported["tokenizer"])
    expected = local(entry["pipeline_prompt"], max_new_tokens=MAX_NEW, do_sample=False)[0]["generated_text"]
    got = exported["results"]["with-tokenizer"]["pipeline_text"]
    assert got == expected and got.startswith(entry["pipeline_prompt"]) and len(got) > len(entry["pipeline_prompt"])


def test_lora_adapter_loads_onto_a_remote_code_base(exported):
    lora, entry = exported["models"]["lora"], exported["entries"]["lora"]
    logits, generated = _expected(lora, entry)
    base_logits, _ = _expected(tiny_mc_titans(seed=4), entry)
    got = exported["results"]["lora"]
    assert not torch.allclose(logits, base_logits, atol=1e-3)  # the adapter matters
    torch.testing.assert_close(got["logits"], logits, rtol=0, atol=1e-6)
    assert torch.equal(got["generated"], generated)


def test_a_saved_folder_loads_without_mnemo(exported):
    """A plain ``save_pretrained`` folder loads, generates and builds a pipeline where mnemo is absent; the
    classes loaded there save it again, and that folder loads the same model too."""
    from transformers import pipeline

    model, entry = exported["models"]["saved"], exported["entries"]["saved"]
    logits, generated = _expected(model, entry)
    got = exported["results"]["saved"]
    assert got["class_module"].startswith("transformers_modules.")
    assert torch.equal(got["logits"], logits) and torch.equal(got["generated"], generated)
    assert torch.equal(got["resaved_logits"], logits)
    local = pipeline("text-generation", model=model, tokenizer=exported["tokenizer"])
    expected_text = local(entry["pipeline_prompt"], max_new_tokens=MAX_NEW, do_sample=False)[0]["generated_text"]
    assert got["pipeline_text"] == expected_text
    saved, resaved = exported["tmp"] / "folders" / "saved", exported["tmp"] / "resaved"
    code = sorted(p.name for p in saved.glob("*.py"))
    assert code == sorted(f"{m.name}.py" for m in hub_modules(model)) == sorted(p.name for p in resaved.glob("*.py"))
    assert all((saved / name).read_text() == (resaved / name).read_text() for name in code)
    assert json.loads((resaved / "config.json").read_text())["auto_map"] == \
        json.loads((saved / "config.json").read_text())["auto_map"]


def test_push_to_hub_uploads_a_folder_that_loads_without_mnemo(exported):
    model, entry = exported["models"]["pushed"], exported["entries"]["pushed"]
    logits, generated = _expected(model, entry)
    got = exported["results"]["pushed"]
    assert torch.equal(got["logits"], logits) and torch.equal(got["generated"], generated)
    calls = exported["push_calls"]
    assert calls[0] == ("init", "t0k") and calls[1][:2] == ("create_repo", "org/tiny-pushed")
    _, repo_id, files, _ = calls[-1]
    assert repo_id == "org/tiny-pushed"
    assert {"config.json", "model.safetensors", "modeling_atlas.py", "README.md"} <= set(files)
    card = next((exported["tmp"] / "hf" / "hub").glob("models--org--tiny-pushed/snapshots/*/README.md")).read_text()
    assert "org/tiny-pushed" in card and "Atlas" in card


def test_peft_defaults_come_with_the_exported_code(exported):
    """``get_peft_model(model, LoraConfig(task_type="CAUSAL_LM"))`` without ``target_modules`` adapts, where
    mnemo is absent, what it adapts in the package, and its adapter config names modules."""
    from mnemo.integrations import LORA_TARGET_MODULES

    got = exported["results"]["saved"]
    local = get_peft_model(tiny_mom(seed=6, **MOM_VARIANTS["hybrid"]), LoraConfig(task_type="CAUSAL_LM", r=2))
    assert got["lora_modules"] == sorted({n for n, m in local.named_modules() if hasattr(m, "lora_A")})
    assert any(".memories.0.k_proj" in n for n in got["lora_modules"])
    assert "base_model.model.model.layers.1.attn.k_proj" in got["lora_modules"]  # the hybrid's attention layer
    config = json.loads((exported["tmp"] / "default-adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(LORA_TARGET_MODULES["mnemo_mom"])


def test_flat_files_are_the_package_source(exported):
    folder = exported["tmp"] / "folders" / "atlas-mag-dla"
    modules = hub_modules(exported["models"]["atlas-mag-dla"])
    assert sorted(p.stem for p in folder.glob("*.py")) == sorted(m.name for m in modules)
    for module in modules:
        text = (folder / f"{module.name}.py").read_text()
        assert text == module.source
        # a module imported only where it runs (a Triton path) may not be loaded yet
        original = Path(importlib.import_module(module.module).__file__).read_text()
        assert unflatten(module) == original
        for line in text.splitlines():
            stripped = line.strip()
            if stripped.startswith("from .") and " import " in stripped:
                target = stripped[len("from ."):].split(" ", 1)[0]
                assert "." not in target and (folder / f"{target}.py").is_file(), line
            assert "from .." not in stripped and not stripped.startswith(("import mnemo", "from mnemo"))


def test_exported_files_pass_transformers_import_check(exported):
    """Every exported file passes transformers' check, and none needs Triton (imported only under ``try``)."""
    from transformers.dynamic_module_utils import check_imports, get_imports

    for folder in (exported["tmp"] / "folders").iterdir():
        for file in folder.glob("*.py"):
            check_imports(str(file))
            assert "triton" not in get_imports(str(file)), f"{folder.name}/{file.name} needs triton"


def test_config_and_card(exported):
    folder = exported["tmp"] / "folders" / "mom-hybrid"
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"] == {"AutoConfig": "configuration_mom.MoMConfig",
                                  "AutoModel": "modeling_mom.MoMModel",
                                  "AutoModelForCausalLM": "modeling_mom.MoMForCausalLM"}
    assert (folder / "model.safetensors").is_file() and (folder / "generation_config.json").is_file()
    assert not list(folder.glob("*.bin"))
    card = (folder / "README.md").read_text()
    model = exported["models"]["mom-hybrid"]
    assert "{{" not in card and "org/tiny-mom" in card and "Mixture-of-Memories" in card
    assert f"{sum(p.numel() for p in model.parameters()):,} parameters" in card
    assert "| `attention_layers` | `[1]` |" in card and "| `use_cache` | `true` |" in card
    assert '"k_proj", "v_proj"' in card and "k_proj.0" not in card
    for name, folder_name in [("MC", "mc-grm"), ("Atlas", "atlas-dla"), ("DeepTransformer", "deep-hebbian")]:
        assert name in (exported["tmp"] / "folders" / folder_name / "README.md").read_text()


def test_export_refuses_a_non_empty_folder_and_non_models(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="not empty"):
        export_hub_folder(tiny_mom(), out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    with pytest.raises(TypeError, match="merge_and_unload"):
        export_hub_folder(get_peft_model(tiny_mom(), LoraConfig(task_type="CAUSAL_LM")), tmp_path / "x")
    with pytest.raises(TypeError, match="ForCausalLM"):
        export_hub_folder(tiny_mom().model, tmp_path / "y")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no partial folders left


def test_cli_export_from_a_checkpoint_folder_carries_the_tokenizer(tmp_path):
    model = tiny_mom(seed=5)
    model.save_pretrained(tmp_path / "ckpt")
    _word_tokenizer(97).save_pretrained(tmp_path / "ckpt")
    assert cli_main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hub"), "--repo-id", "me/mom"]) == 0
    names = {p.name for p in (tmp_path / "hub").iterdir()}
    assert {"config.json", "model.safetensors", "modeling_mom.py", "tokenizer.json", "README.md"} <= names
    reloaded = mnemo.MoMForCausalLM.from_pretrained(tmp_path / "hub")
    for (n, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), n


class _FakeApi:
    calls: list = []

    def __init__(self, token=None):
        self.calls.append(("init", token))

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", kwargs))
        return type("Commit", (), {"commit_url": f"https://hub.test/{kwargs['repo_id']}/commit/1"})()


def test_push_uploads_through_the_hub_client(tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", _FakeApi)
    _FakeApi.calls = []
    folder = export_hub_folder(tiny_mom(), tmp_path / "hub")
    assert push_to_hub(folder, "me/mom", token="t0k", private=True) == "https://hub.test/me/mom/commit/1"
    assert _FakeApi.calls[0] == ("init", "t0k")
    assert _FakeApi.calls[1] == ("create_repo", "me/mom", {"repo_type": "model", "private": True, "exist_ok": True})
    upload = _FakeApi.calls[2][1]
    assert upload["folder_path"] == str(folder) and upload["repo_id"] == "me/mom"
    _FakeApi.calls = []
    assert cli_main(["push", str(folder), "me/other"]) == 0
    assert _FakeApi.calls[0] == ("init", None) and _FakeApi.calls[2][1]["repo_id"] == "me/other"
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ConversionError, match="not an exported"):
        push_to_hub(tmp_path / "plain", "me/mom")
