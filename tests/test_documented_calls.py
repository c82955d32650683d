"""The calls the README and docs show run without a FutureWarning on every supported transformers.

transformers 5.24 renamed ``generate(past_key_values=)`` to ``cache=`` and
``gradient_checkpointing_enable()`` to ``activation_checkpointing_enable()``, the old
names warning; the docs show the new ones, which mnemo's models also answer on the
older versions it supports.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import tiny_mom


pytestmark = pytest.mark.usefixtures("one_thread")

def test_documented_calls_do_not_warn(tmp_path):
    model = tiny_mom()
    ids = torch.randint(1, 97, (2, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = model(ids, use_cache=True)
        model(ids[:, -1:], cache=out.cache, use_cache=True)
        prompt = torch.randint(1, 97, (2, 4))
        out = model(prompt, use_cache=True)
        more = torch.cat([prompt, torch.randint(1, 97, (2, 1))], dim=1)
        continued = model.generate(more, cache=out.cache, max_new_tokens=3, do_sample=False)
        assert torch.equal(continued, model.generate(more, max_new_tokens=3, do_sample=False))
        model.generate(prompt, max_new_tokens=3, do_sample=False, cuda_graph=True)

        model.save_pretrained(tmp_path / "model")
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "model").train()
        model.activation_checkpointing_enable()
        assert model.model.gradient_checkpointing
        model(ids, labels=ids).loss.backward()
        model.activation_checkpointing_disable()
