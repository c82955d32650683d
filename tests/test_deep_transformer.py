"""DeepTransformerForCausalLM specifics: it is Llama at depth 1, learning switches the deep branch on."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from mnemo import DeepTransformerConfig, DeepTransformerForCausalLM

from conftest import tiny_deep_transformer, tiny_deep_transformer_config


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_depth_one_is_llama_with_the_same_weights(kv_heads):
    model = tiny_deep_transformer(memory_depth=1, num_key_value_heads=kv_heads, num_hidden_layers=3)
    c = model.config
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=kv_heads,
        intermediate_size=c.intermediate_size, rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta,
        attn_implementation="sdpa", pad_token_id=0, bos_token_id=None, eos_token_id=None,
    )).eval()
    result = llama.load_state_dict(model.state_dict(), strict=False)
    assert not result.missing_keys and not result.unexpected_keys
    ids = torch.randint(1, 97, (2, 17))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, llama(ids).logits, rtol=0, atol=1e-6)
    mask = torch.ones(2, 17, dtype=torch.long)
    mask[1, :6] = 0
    with torch.no_grad():
        ours = model(ids, attention_mask=mask).logits[mask.bool()]
        theirs = llama(ids, attention_mask=mask).logits[mask.bool()]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    prompt = ids[:, :5]
    assert torch.equal(
        model.generate(prompt, max_new_tokens=8, do_sample=False),
        llama.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0),
    )


def test_deep_branch_off_equals_attention_and_on_differs():
    deep = tiny_deep_transformer(memory_depth=2)
    flat = tiny_deep_transformer(memory_depth=1)
    flat.load_state_dict(deep.state_dict(), strict=False)
    ids = torch.randint(1, 97, (2, 12))
    with torch.no_grad():
        assert (deep(ids).logits - flat(ids).logits).abs().max() > 1e-4  # learning on: a different model
        for layer in deep.model.layers:
            layer.self_attn.memory_w1.zero_()  # W_1(0) = 0
            # the learning-rate gate forced to 0: sigmoid(-inf)
            layer.self_attn.eta_proj.register_forward_hook(lambda _m, _i, o: torch.full_like(o, float("-inf")))
        torch.testing.assert_close(deep(ids).logits, flat(ids).logits, rtol=0, atol=1e-6)


def test_gradients_reach_every_parameter():
    for overrides in ({}, {"learning_rule": "omega", "omega_window": 2}):
        model = tiny_deep_transformer(**overrides).train()
        ids = torch.randint(1, 97, (2, 11))
        model(ids, labels=ids).loss.backward()
        assert [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0] == []


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"memory_depth": 3}, "memory_depth"),
        ({"learning_rule": "sgd"}, "learning_rule"),
        ({"omega_window": 4}, "omega_window"),
        ({"learning_rule": "omega", "omega_window": 0}, "omega_window"),
        ({"num_attention_heads": 5}, "num_attention_heads"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"memory_depth": 1, "normalize": False}, "normalize"),
        ({"inner_chunk_size": 0}, "inner_chunk_size"),
        ({"memory_grad_clip": 0.0}, "memory_grad_clip"),
        ({"memory_hidden": 0}, "memory_hidden"),
        ({"hidden_size": 30, "num_attention_heads": 6}, "num_attention_heads"),
    ],
)
def test_invalid_values_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=rf"^{field}="):
        tiny_deep_transformer_config(**overrides)


def test_paper_760m_shape_on_meta_device():
    config = DeepTransformerConfig(hidden_size=1536, num_hidden_layers=24, num_attention_heads=16)
    with torch.device("meta"):
        model = DeepTransformerForCausalLM(config)
    n = sum(p.numel() for p in model.parameters())
    deep = sum(p.numel() for name, p in model.named_parameters() if "memory_w1" in name or "eta_proj" in name)
    assert deep == 24 * (16 * 96 * 96 + 1536 * 16)
    assert 700e6 < n < 900e6


def test_attention_only_cache_crops_and_recurrent_caches_refuse():
    model = tiny_deep_transformer(memory_depth=1)
    ids = torch.randint(1, 97, (2, 12))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        cache.crop(8)
        assert cache.get_seq_length() == 8
        cropped = model(ids[:, 8:], past_key_values=cache, use_cache=True).logits
        full = model(ids).logits[:, 8:]
    torch.testing.assert_close(cropped, full, rtol=1e-5, atol=1e-6)
    deep_cache = tiny_deep_transformer()(ids, use_cache=True).past_key_values
    with pytest.raises(NotImplementedError, match="rolled back"):
        deep_cache.crop(8)
