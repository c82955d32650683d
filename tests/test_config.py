"""MoMConfig validates itself: impossible values raise ValueError naming the field."""

from __future__ import annotations

import pytest

from mnemo import MoMConfig, MoMForCausalLM

from conftest import tiny_mom_config


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"topk": 5, "num_memories": 4}, "topk"),
        ({"topk": 0}, "topk"),
        ({"num_memories": 0}, "num_memories"),
        ({"memory_update": "lstm"}, "memory_update"),
        ({"hidden_size": 30, "attention_layers": [0], "num_attention_heads": 4}, "num_attention_heads"),
        ({"num_attention_heads": 4, "num_key_value_heads": 3, "attention_layers": [1]}, "num_key_value_heads"),
        ({"attention_layers": [5]}, "attention_layers"),
        ({"attention_layers": [1, 1]}, "attention_layers"),
        ({"head_dim": 0}, "head_dim"),
        ({"expand_v": 0.3}, "expand_v"),
        ({"conv_size": 0}, "conv_size"),
        ({"chunk_size": -1}, "chunk_size"),
        ({"aux_loss_coef": -1.0}, "aux_loss_coef"),
        ({"hidden_act": "relu"}, "hidden_act"),
        ({"num_heads": 2.5}, "num_heads"),
        ({"ssc_topk": 0, "segment_size": 4, "aggregation": "ssc"}, "ssc_topk"),
        ({"aggregation": "max", "segment_size": 4}, "aggregation"),
    ],
)
def test_invalid_values_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=rf"^{field}="):
        tiny_mom_config(**overrides)


def test_a_config_mutated_into_an_invalid_state_is_rejected_by_the_model():
    config = tiny_mom_config()
    config.topk = 9
    with pytest.raises(ValueError, match="^topk="):
        MoMForCausalLM(config)


def test_defaults_are_the_papers_340m_model_and_round_trip(tmp_path):
    config = MoMConfig()
    assert (config.hidden_size, config.num_hidden_layers, config.num_heads, config.head_dim) == (1024, 24, 4, 256)
    assert (config.num_memories, config.topk, config.shared_memory, config.conv_size) == (4, 2, True, 4)
    assert config.intermediate_size == 2048 and config.vocab_size == 32000
    config.save_pretrained(tmp_path)
    again = MoMConfig.from_pretrained(tmp_path)
    assert again.to_dict() == config.to_dict()


def test_block_types():
    config = tiny_mom_config(num_hidden_layers=4, attention_layers=[3], num_attention_heads=4)
    assert config.block_types == ["mom", "mom", "mom", "attention"]


def test_widths_that_do_not_divide_are_refused_unless_head_dim_is_given():
    """A width derived as ``hidden_size // heads`` must divide exactly in every family (it used to floor: 65 over
    2 heads built heads of 32); an explicit ``head_dim`` chooses another width. MC-Titans derives none: its
    ``head_dim`` is always explicit."""
    from mnemo import AtlasConfig, DeepTransformerConfig

    with pytest.raises(ValueError, match="num_heads=2: must divide hidden_size \\(65\\), or give head_dim"):
        AtlasConfig(hidden_size=65, num_heads=2)
    with pytest.raises(ValueError, match="num_heads"):
        AtlasConfig.preset("dla", hidden_size=65, num_heads=2)
    assert AtlasConfig(hidden_size=65, num_heads=2, head_dim=32).head_dim == 32
    assert AtlasConfig(hidden_size=64, num_heads=2).head_dim == 32
    with pytest.raises(ValueError, match="num_attention_heads"):
        DeepTransformerConfig(hidden_size=65, num_attention_heads=2)
    with pytest.raises(ValueError, match="num_attention_heads"):
        MoMConfig(hidden_size=65, attention_layers=[0], num_attention_heads=2)
