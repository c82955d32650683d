"""The package's face: public names, Auto registration, the CLI, and the ``kernels`` folder probe."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

import mnemo
from mnemo.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_public_names_and_registration():
    for name in ("MoMConfig", "MoMForCausalLM", "MoMModel", "MnemoCache", "register", "use_backend"):
        assert hasattr(mnemo, name)
    mnemo.register()  # idempotent
    config = AutoConfig.for_model("mnemo_mom", vocab_size=50, hidden_size=16, num_hidden_layers=1, num_heads=2,
                                  head_dim=4, intermediate_size=32)
    assert isinstance(config, mnemo.MoMConfig)
    assert type(AutoModelForCausalLM.from_config(config)) is mnemo.MoMForCausalLM
    assert type(AutoModel.from_config(config)) is mnemo.MoMModel


def test_kernels_is_a_leaf_package():
    """kernels/ may be imported as a top-level module by transformers' probe: no imports out of it."""
    for path in (ROOT / "kernels").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    top = alias.name.split(".")[0]
                    assert top in {"torch", "triton"} or top in sys.stdlib_module_names, f"{path.name}: {alias.name}"
            if isinstance(node, ast.ImportFrom):
                assert node.level <= 1, f"{path.name} imports from outside kernels/"
                top = (node.module or "").split(".")[0]
                assert node.level == 1 or top in {"torch", "triton"} or top in sys.stdlib_module_names, (
                    f"{path.name} imports {node.module}"
                )


def test_triton_is_imported_in_one_place_under_try():
    """Every kernel module takes ``triton`` from ``backend``, which imports it inside ``try``: transformers'
    import check of an exported folder (which skips ``try`` blocks) then never asks for Triton."""
    from transformers.dynamic_module_utils import get_imports

    for path in (ROOT / "kernels").glob("*.py"):
        assert "triton" not in get_imports(path), f"{path.name} imports triton outside a try block"


def test_every_family_runs_where_triton_is_absent(tmp_path):
    """With Triton not importable, every kernel module still imports and each family trains a step."""
    code = (
        "import importlib, importlib.abc, pkgutil, sys, torch\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'triton' or name.startswith('triton.'):\n"
        "            raise ImportError('no triton here')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import mnemo, mnemo.kernels as K\n"
        "from transformers import AutoModelForCausalLM\n"
        "assert not K.triton_available()\n"
        "for m in pkgutil.iter_modules(K.__path__):\n"
        "    importlib.import_module('mnemo.kernels.' + m.name)\n"
        "torch.manual_seed(0)\n"
        "small = dict(vocab_size=40, hidden_size=16, num_hidden_layers=1, intermediate_size=32)\n"
        "for config in (mnemo.MoMConfig(num_heads=2, head_dim=8, **small),\n"
        "               mnemo.AtlasConfig(num_heads=2, **small),\n"
        "               mnemo.MCTitansConfig(num_heads=2, head_dim=8, segment_size=4, **small),\n"
        "               mnemo.DeepTransformerConfig(num_attention_heads=2, memory_depth=2, **small)):\n"
        "    model = AutoModelForCausalLM.from_config(config)\n"
        "    ids = torch.randint(0, 40, (2, 9))\n"
        "    model(ids, labels=ids).loss.backward()\n"
        "print('ran')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ran" in out.stdout


def test_repo_root_on_sys_path_is_harmless():
    """With the root as working directory, a top-level `kernels` is found; transformers and mnemo still work."""
    code = (
        "import importlib.util, torch, transformers\n"
        "from transformers.utils import is_kernels_available\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "assert spec is not None\n"
        "is_kernels_available()\n"
        "import kernels\n"
        "import mnemo\n"
        "torch.manual_seed(0)\n"
        # no end-of-sequence id: an unseeded random model may emit the default one and stop early
        "m = mnemo.MoMForCausalLM(mnemo.MoMConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_heads=2, "
        "head_dim=4, intermediate_size=32, eos_token_id=None))\n"
        "print(m.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False).shape)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "torch.Size([1, 5])" in out.stdout


def test_cli_info(capsys):
    assert main(["info"]) == 0
    assert "mnemo_mom" in capsys.readouterr().out


def test_every_slow_case_names_a_collected_test():
    """conftest's SLOW_CASES move parameter sets to the long run: an entry whose test or id was renamed would
    silently move nothing, and the default run would grow again."""
    from conftest import SLOW_CASES

    tests = Path(__file__).parent
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "slow", "-p",
                                "no:cacheprovider", str(tests)], capture_output=True, text=True, cwd=tests.parent)
    slow = {line.split("::")[-1] for line in collected.stdout.splitlines() if "::" in line}
    expected = {f"{name}[{case}]" if case else name for name, cases in SLOW_CASES.items() for case in cases}
    assert expected <= slow, sorted(expected - slow)
