"""Llama checkpoints import as DeepTransformers: the same logits and tokens, or a refusal that names the reason.

Tolerance: logits are compared in float32 with ``atol=1e-5``. Both models compute
the same function; they differ only in how they compute it (transformers' SDPA
attention against mnemo's explicit softmax memory, other summation orders, and
for a left-padded row Llama's RoPE angles count the padding, a shift that only
cancels up to rounding). With weights of std 0.2 the logits are of size ~5, and
these rounding differences stay at a few float32 ulps of that (~2e-6 measured).
A wrong setting is far outside the tolerance: the controls below show that a
wrong ``rope_theta`` or ``norm_eps`` moves the logits by more than 1e-4.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from mnemo import DeepTransformerForCausalLM
from mnemo.conversion.checkpoint_io import ConversionError
from mnemo.conversion.from_llama import convert_from_llama, llama_config_to_deep_transformer

ATOL = 1e-5
VOCAB = 97


def tiny_llama(folder: Path, seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A random float32 Llama saved with ``save_pretrained`` to ``folder``; weights large enough
    (std 0.2) that attention is far from uniform and logits are of size ~5."""
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=None,
    )
    max_shard_size = overrides.pop("max_shard_size", None)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kwargs)).eval()
    if max_shard_size is None:
        model.save_pretrained(folder)
    else:
        model.save_pretrained(folder, max_shard_size=max_shard_size)
    return model


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows; the second and third are left-padded."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (3, 14), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :9] = 0
    ids[mask == 0] = 0
    return ids, mask


def valid_logits(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # padded positions compute nothing that is used (and Llama's may be arbitrary there)
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits[mask.bool()]


def assert_same_model(llama: LlamaForCausalLM, ours: DeepTransformerForCausalLM) -> float:
    ids, mask = batch()
    theirs, mine = valid_logits(llama, ids, mask), valid_logits(ours, ids, mask)
    torch.testing.assert_close(mine, theirs, rtol=0, atol=ATOL)
    new_tokens = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(
        ours.generate(ids, attention_mask=mask, **new_tokens),
        llama.generate(ids, attention_mask=mask, **new_tokens),
    )
    return float((mine - theirs).abs().max())


def no_leftovers(parent: Path, *keep: str) -> bool:
    """Nothing besides ``keep`` in ``parent`` (in particular no staging folder)."""
    return sorted(p.name for p in parent.iterdir()) == sorted(keep)


VARIANTS = {
    "mha": {},
    "gqa": {"num_key_value_heads": 2},
    "tied": {"tie_word_embeddings": True},
    "rope-theta-and-eps": {"rope_theta": 1000.0, "rms_norm_eps": 1e-5},
    "sharded": {"max_shard_size": "8KB"},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_converted_checkpoint_equals_llama(tmp_path, variant):
    src, out = tmp_path / "llama", tmp_path / "converted"
    llama = tiny_llama(src, **VARIANTS[variant])
    if variant == "sharded":
        assert (src / "model.safetensors.index.json").is_file() and not (src / "model.safetensors").exists()
    (src / "tokenizer_config.json").write_text('{"padding_side": "left"}')

    assert convert_from_llama(src, out) == out
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()
    }
    assert no_leftovers(tmp_path, "llama", "converted")
    ours = DeepTransformerForCausalLM.from_pretrained(out).eval()
    assert ours.config.memory_depth == 1 and ours.dtype == torch.float32
    assert_same_model(llama, ours)

    if variant == "tied":
        assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    if variant == "rope-theta-and-eps":
        # controls: the tolerance tells these settings apart
        ids, mask = batch()
        for wrong in ({"rope_theta": 10000.0}, {"norm_eps": 1e-6}):
            other = DeepTransformerForCausalLM.from_pretrained(out, **wrong).eval()
            diff = (valid_logits(other, ids, mask) - valid_logits(ours, ids, mask)).abs().max()
            assert diff > 10 * ATOL, wrong


def test_tensors_are_copied_bit_for_bit_in_the_checkpoint_dtype(tmp_path):
    src = tmp_path / "llama"
    tiny_llama(src).to(torch.bfloat16).save_pretrained(src)
    out = convert_from_llama(src, tmp_path / "converted")
    source, converted = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(converted) == set(source)
    for name, tensor in source.items():
        assert converted[name].dtype == torch.bfloat16 and torch.equal(converted[name], tensor), name
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_stored_rotary_buffers_and_tied_head_are_checked_then_dropped(tmp_path):
    src = tmp_path / "llama"
    llama = tiny_llama(src, tie_word_embeddings=True)
    state = load_file(src / "model.safetensors")
    assert "lm_head.weight" not in state
    head_dim = 8
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = inv_freq
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, src / "model.safetensors")
    assert_same_model(llama, DeepTransformerForCausalLM.from_pretrained(convert_from_llama(src, tmp_path / "a")))

    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = inv_freq / 2  # linear RoPE scaling, factor 2
    save_file(state, src / "model.safetensors")
    with pytest.raises(ConversionError, match=r"model\.layers\.0\.self_attn\.rotary_emb\.inv_freq"):
        convert_from_llama(src, tmp_path / "b")

    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = inv_freq
    state["lm_head.weight"] = state["lm_head.weight"] + 1.0
    save_file(state, src / "model.safetensors")
    with pytest.raises(ConversionError, match="tie_word_embeddings=True.*lm_head.weight differs"):
        convert_from_llama(src, tmp_path / "c")
    assert no_leftovers(tmp_path, "llama", "a")


@pytest.mark.parametrize("options", [{"memory_hidden": 16}, {"learning_rule": "omega", "omega_window": 2}])
def test_memory_depth_two_adds_only_the_deep_branch(tmp_path, options):
    src, out = tmp_path / "llama", tmp_path / "converted"
    llama = tiny_llama(src)
    convert_from_llama(src, out, memory_depth=2, inner_chunk_size=4, **options)
    ours = DeepTransformerForCausalLM.from_pretrained(out).eval()
    assert ours.config.memory_depth == 2 and ours.config.inner_chunk_size == 4
    for name, value in options.items():
        assert getattr(ours.config, name) == value

    source, converted = llama.state_dict(), ours.state_dict()
    new = {"self_attn.eta_proj.weight", "self_attn.memory_w1"}
    if options.get("learning_rule") == "omega":
        new.add("self_attn.gamma_proj.weight")
    assert set(converted) - set(source) == {f"model.layers.{i}.{n}" for i in range(2) for n in new}
    assert set(source) <= set(converted)
    for name, tensor in source.items():
        assert torch.equal(converted[name], tensor), name
    for i in range(2):  # the model's own init: W_1 random with memory_init_std, not zeros
        w1 = converted[f"model.layers.{i}.self_attn.memory_w1"]
        assert w1.shape == (4, 8, options.get("memory_hidden", 8))
        assert 0.005 < float(w1.std()) < 0.05

    ids, mask = batch()
    logits = valid_logits(ours, ids, mask)
    assert torch.isfinite(logits).all()
    # documented: the branch is on from the first token, so the logits move (a little)
    assert (logits - valid_logits(llama, ids, mask)).abs().max() > ATOL


def test_converted_model_fine_tunes_with_lora(tmp_path):
    peft = pytest.importorskip("peft")
    src, out = tmp_path / "llama", tmp_path / "converted"
    tiny_llama(src)
    model = DeepTransformerForCausalLM.from_pretrained(convert_from_llama(src, out))
    model = peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM"))
    model.train()
    trainable = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert any("q_proj" in n for n in trainable) and any("down_proj" in n for n in trainable)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids, mask = batch()
    loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
    assert math.isfinite(loss.item())
    loss.backward()
    optimizer.step()
    after = dict(model.named_parameters())
    assert any(not torch.equal(after[n], before) for n, before in trainable.items())


def test_non_empty_output_folder_is_refused_and_left_untouched(tmp_path):
    src, out = tmp_path / "llama", tmp_path / "converted"
    tiny_llama(src)
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="not empty"):
        convert_from_llama(src, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert no_leftovers(tmp_path, "llama", "converted")


def test_pickled_weights_need_allow_pickle(tmp_path):
    src, out = tmp_path / "llama", tmp_path / "converted"
    llama = tiny_llama(src)
    (src / "model.safetensors").unlink()
    torch.save(llama.state_dict(), src / "pytorch_model.bin")
    with pytest.raises(ConversionError, match="allow_pickle"):
        convert_from_llama(src, out)
    assert no_leftovers(tmp_path, "llama")
    converted = convert_from_llama(src, out, allow_pickle=True)
    assert_same_model(llama, DeepTransformerForCausalLM.from_pretrained(converted))


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    src = tmp_path / "llama"
    tiny_llama(src)
    state = load_file(src / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)
    save_file(state, src / "model.safetensors")
    with pytest.raises(ConversionError) as error:
        convert_from_llama(src, tmp_path / "converted")
    message = str(error.value)
    assert "missing (1): model.layers.1.mlp.up_proj.weight" in message
    assert "unexpected (1): model.layers.0.self_attn.q_proj.bias" in message
    assert no_leftovers(tmp_path, "llama")


def test_tensors_that_do_not_fit_the_config_are_named(tmp_path):
    src = tmp_path / "llama"
    tiny_llama(src)
    config = json.loads((src / "config.json").read_text())
    config["intermediate_size"] = 96
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=r"model\.layers\.0\.mlp\.down_proj\.weight \(32, 64\)"):
        convert_from_llama(src, tmp_path / "converted")
    assert no_leftovers(tmp_path, "llama")


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "llama_overrides, config_edit, expected",
    [
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, {},
         "rope_parameters.rope_type='linear'"),
        ({"attention_bias": True}, {}, "attention_bias=True"),
        ({}, {"model_type": "mistral"}, "model_type='mistral'"),
    ],
    ids=["rope-scaling", "attention-bias", "model-type"],
)
def test_checkpoints_the_model_cannot_reproduce_are_refused(tmp_path, llama_overrides, config_edit, expected):
    src = tmp_path / "llama"
    tiny_llama(src, **llama_overrides)
    edit_config(src, **config_edit)
    with pytest.raises(ConversionError, match=expected.replace(".", r"\.")):
        convert_from_llama(src, tmp_path / "converted")
    assert no_leftovers(tmp_path, "llama")


def llama_dict(**changes) -> dict:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4).to_dict()
    config.update(changes)
    return config


def test_config_mapping_covers_every_llama_field():
    config = llama_config_to_deep_transformer(llama_dict(
        num_key_value_heads=2, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 5e5},
        tie_word_embeddings=True, max_position_embeddings=4096, initializer_range=0.01, use_cache=False,
        pad_token_id=3, bos_token_id=4, eos_token_id=[5, 6],
    ))
    expected = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, norm_eps=1e-5, rope_theta=5e5, tie_word_embeddings=True, max_position_embeddings=4096,
        initializer_range=0.01, use_cache=False, pad_token_id=3, bos_token_id=4, eos_token_id=[5, 6], memory_depth=1,
        hidden_act="silu", head_dim=8,
    )
    assert {name: getattr(config, name) for name in expected} == expected

    # transformers 4 layout: rope_theta at the top, rope_scaling null or default; absent fields take Llama's defaults
    legacy = {k: v for k, v in llama_dict().items() if k not in ("rope_parameters", "num_key_value_heads")}
    legacy.update(rope_theta=2e4, rope_scaling=None, torch_dtype="float16")
    config = llama_config_to_deep_transformer(legacy)
    assert config.rope_theta == 2e4 and config.num_key_value_heads == 4
    assert llama_config_to_deep_transformer({**legacy, "rope_scaling": {"type": "default"}}).rope_theta == 2e4
    assert llama_config_to_deep_transformer({"model_type": "llama"}).intermediate_size == 11008


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
         "rope_scaling.rope_type='dynamic'"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}}, "rope_type='llama3'"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
         "partial_rotary_factor=0.5"),
        ({"mlp_bias": True}, "mlp_bias=True"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"head_dim": 16}, "head_dim=16"),
        ({"pretraining_tp": 2}, "pretraining_tp=2"),
        ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config="),
        ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    ],
)
def test_config_options_the_model_cannot_reproduce_are_named(changes, expected):
    with pytest.raises(ConversionError, match=expected.replace(".", r"\.").replace("[", r"\[")):
        llama_config_to_deep_transformer(llama_dict(**changes))


def test_deep_options_need_memory_depth_two():
    with pytest.raises(ConversionError, match="memory_hidden=16.*memory_depth=2"):
        llama_config_to_deep_transformer(llama_dict(), memory_hidden=16)
    with pytest.raises(ConversionError, match="hidden_size=64"):
        llama_config_to_deep_transformer(llama_dict(), memory_depth=2, hidden_size=64)
    with pytest.raises(ConversionError, match="memory_depth=3"):
        llama_config_to_deep_transformer(llama_dict(), memory_depth=3)
