"""AtlasForCausalLM specifics: presets, the hybrid's window in the cache, gradients, validation."""

from __future__ import annotations

import pytest
import torch

from mnemo import AtlasConfig, AtlasForCausalLM

from conftest import tiny_atlas, tiny_atlas_config


def test_presets_are_the_papers_variants():
    atlas = AtlasConfig.preset("atlas")
    assert (atlas.inner_optimizer, atlas.feature_map, atlas.objective, atlas.omega_window) == (
        "muon", "poly_elementwise", "l2", 16)
    assert AtlasConfig.preset("atlas++").memory_gated
    assert AtlasConfig.preset("omeganet").inner_optimizer == "gd"
    dla = AtlasConfig.preset("dla")
    assert (dla.objective, dla.omega_window, dla.memory_depth) == ("dot", 1, 2)
    swla = AtlasConfig.preset("swla", omega_window=8)
    assert (swla.objective, swla.memory_depth, swla.omega_window) == ("dot", 1, 8)
    with pytest.raises(ValueError, match="unknown preset"):
        AtlasConfig.preset("titans")


def test_sliding_window_kv_is_trimmed_while_decoding():
    model = tiny_atlas(hybrid="mal", sliding_window=5)
    ids = torch.randint(1, 97, (2, 30))
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, :7] = 0
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        out = model(ids[:, :10], attention_mask=mask[:, :10], use_cache=True)
        cache, logits = out.past_key_values, [out.logits]
        for t in range(10, 30):
            step = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            logits.append(step.logits)
            assert cache[0]["swa.key"].shape[2] <= 5
    valid = mask.bool()
    torch.testing.assert_close(torch.cat(logits, 1)[valid], full[valid], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("overrides", [{}, {"preset": "swla", "inner_optimizer": "momentum"}, {"hybrid": "mag"},
                                       {"feature_map": "poly_tensor"}])
def test_gradients_reach_every_parameter(overrides):
    model = tiny_atlas(**overrides).train()
    ids = torch.randint(1, 97, (2, 14))
    model(ids, labels=ids).loss.backward()
    assert [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0] == []


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"omega_window": 0}, "omega_window"),
        ({"ns_steps": -1}, "ns_steps"),
        ({"feature_map": "poly_tensor", "head_dim": 64}, "feature_map"),
        ({"feature_map": "poly_tensor", "poly_degree": 3}, "poly_degree"),
        ({"feature_map": "rbf"}, "feature_map"),
        ({"objective": "huber"}, "objective"),
        ({"inner_optimizer": "adam"}, "inner_optimizer"),
        ({"hybrid": "mix"}, "hybrid"),
        ({"memory_depth": 1, "memory_gated": True}, "memory_gated"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"inner_chunk_size": 0}, "inner_chunk_size"),
        ({"memory_grad_clip": -1.0}, "memory_grad_clip"),
    ],
)
def test_invalid_values_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=rf"^{field}="):
        tiny_atlas_config(**overrides)


def test_paper_340m_shape_on_meta_device():
    config = AtlasConfig(hidden_size=1024, num_hidden_layers=24, num_heads=16)
    with torch.device("meta"):
        model = AtlasForCausalLM(config)
    memory = sum(p.numel() for n, p in model.named_parameters() if ".memory_w" in n)
    assert memory == 24 * 16 * 2 * 64 * 256  # W1 (64 x 256) and W2 (256 x 64) per head
    assert config.head_dim == 64 and config.feature_dim == 64
