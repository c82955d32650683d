"""MoMForCausalLM: prefill + decode == forward, padding, gradients, losses, save/load, sizes."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from mnemo import MnemoCache, MoMConfig, MoMForCausalLM

from conftest import tiny_mom


def decode_logits(model, ids, split, mask=None):
    """Prefill ``ids[:, :split]`` then feed one token at a time through the cache."""
    out = model(ids[:, :split], attention_mask=None if mask is None else mask[:, :split], use_cache=True)
    cache, logits = out.past_key_values, [out.logits]
    for t in range(split, ids.shape[1]):
        step_mask = None if mask is None else mask[:, : t + 1]
        out = model(ids[:, t : t + 1], attention_mask=step_mask, past_key_values=cache, use_cache=True)
        logits.append(out.logits)
    return torch.cat(logits, 1), cache


@pytest.mark.parametrize("split", [1, 5, 8, 17])
def test_prefill_then_decode_equals_forward(mom_variant, split):
    model = tiny_mom(**mom_variant)
    ids = torch.randint(1, 97, (2, 24))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        stepped, cache = decode_logits(model, ids, split)
    torch.testing.assert_close(stepped, full, rtol=1e-4, atol=1e-5)
    assert cache.get_seq_length() == 24


def test_chunked_prefill_equals_forward(mom_variant):
    model = tiny_mom(**mom_variant)
    ids = torch.randint(1, 97, (2, 40))
    with torch.no_grad():
        full = model(ids).logits
        cache = MnemoCache(model.config.num_hidden_layers)
        parts = [model(ids[:, a:b], past_key_values=cache, use_cache=True).logits for a, b in [(0, 13), (13, 29), (29, 40)]]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-4, atol=1e-5)


def test_left_padded_batch_equals_each_sample_alone(mom_variant):
    model = tiny_mom(**mom_variant)
    lengths = [11, 4, 8]
    T = max(lengths)
    ids = torch.zeros(3, T, dtype=torch.long)
    mask = torch.zeros(3, T, dtype=torch.long)
    seqs = [torch.randint(1, 97, (n,)) for n in lengths]
    for i, s in enumerate(seqs):
        ids[i, T - len(s):] = s
        mask[i, T - len(s):] = 1
    with torch.no_grad():
        batch = model(ids, attention_mask=mask).logits
        for i, s in enumerate(seqs):
            alone = model(s[None]).logits[0]
            torch.testing.assert_close(batch[i, T - len(s):], alone, rtol=1e-4, atol=1e-5)


def test_padding_holes_are_noops():
    """Masked tokens anywhere (not only on the left) leave every state as if they were absent."""
    model = tiny_mom()
    ids = torch.randint(1, 97, (1, 12))
    mask = torch.ones(1, 12, dtype=torch.long)
    mask[0, [2, 3, 7]] = 0
    keep = mask[0].bool()
    with torch.no_grad():
        holes = model(ids, attention_mask=mask).logits[0, keep]
        dense = model(ids[:, keep]).logits[0]
    torch.testing.assert_close(holes, dense, rtol=1e-4, atol=1e-5)


def test_gradients_reach_every_parameter():
    model = tiny_mom(num_hidden_layers=3, attention_layers=[2], num_attention_heads=4).train()
    ids = torch.randint(1, 97, (2, 20))
    model(ids, labels=ids).loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


def test_deltanet_has_no_decay_parameters_and_none_unused():
    model = tiny_mom(memory_update="deltanet", shared_memory=True).train()
    names = [n for n, _ in model.named_parameters()]
    assert not any(key in n for n in names for key in ("A_log", "dt_bias", "a_proj", "shared_a"))
    ids = torch.randint(1, 97, (2, 12))
    model(ids, labels=ids).loss.backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []


def test_loss_includes_aux_loss():
    model = tiny_mom(aux_loss_coef=0.5)
    ids = torch.randint(1, 97, (2, 10))
    out = model(ids, labels=ids)
    lm = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 97), ids[:, 1:].reshape(-1))
    assert out.aux_loss is not None and out.aux_loss.item() >= 1.0 - 1e-6  # Switch loss is >= 1
    torch.testing.assert_close(out.loss, lm + 0.5 * out.aux_loss)
    assert model(ids).aux_loss is not None  # always returned


def test_no_aux_loss_for_attention_only_model():
    model = tiny_mom(num_hidden_layers=1, attention_layers=[0], num_attention_heads=4)
    ids = torch.randint(1, 97, (1, 5))
    out = model(ids, labels=ids)
    assert out.aux_loss is None and torch.isfinite(out.loss)


def test_tiny_model_overfits_a_fixed_batch():
    torch.manual_seed(0)
    model = tiny_mom(hidden_size=64, head_dim=16, intermediate_size=128).train()
    ids = torch.randint(1, 97, (4, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(150):
        loss = model(ids, labels=ids).loss
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert first > 4.0 and loss.item() < 0.5, (first, loss.item())


@pytest.mark.parametrize("tie", [False, True])
def test_save_load_round_trip_is_bit_exact(tmp_path, tie):
    model = tiny_mom(tie_word_embeddings=tie, num_hidden_layers=3, attention_layers=[1], num_attention_heads=4)
    model.save_pretrained(tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert "model.safetensors" in files and not any(f.endswith(".bin") for f in files)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "mnemo_mom"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is MoMForCausalLM
    assert isinstance(AutoConfig.from_pretrained(tmp_path), MoMConfig)
    original = model.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, original[name]), name
    if tie:
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(1, 97, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_attention_mask_errors():
    model = tiny_mom()
    ids = torch.randint(1, 97, (2, 6))
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 5\)"):
        model(ids, attention_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="2-D"):
        model(ids, attention_mask=torch.ones(2, 1, 6, 6))
    cache = model(ids, use_cache=True).past_key_values
    with pytest.raises(ValueError, match=r"\(2, 7\) was expected"):
        model(ids[:, :1], attention_mask=torch.ones(2, 1), past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match="exactly one of input_ids and inputs_embeds"):
        model()


def test_inputs_embeds_equal_input_ids():
    model = tiny_mom()
    ids = torch.randint(1, 97, (2, 7))
    with torch.no_grad():
        a = model(ids).logits
        b = model(inputs_embeds=model.get_input_embeddings()(ids)).logits
    assert torch.equal(a, b)


def test_paper_340m_parameter_count_on_meta_device():
    config = MoMConfig(tie_word_embeddings=True)
    with torch.device("meta"):
        model = MoMForCausalLM(config)
    n = sum(p.numel() for p in model.parameters())
    # flash-linear-attention 0.6.0's MomForCausalLM at the same configuration counts 512,351,424.
    assert n == 512_351_424


def test_bfloat16_weights_keep_float32_states():
    model = tiny_mom()
    ids = torch.randint(1, 97, (2, 20))
    with torch.no_grad():
        ref = model(ids).logits
        half = model.to(torch.bfloat16)
        out = half(ids, use_cache=True)
    assert out.logits.dtype == torch.bfloat16
    assert all(layer["recurrent"].dtype == torch.float32 for layer in out.past_key_values)
    err = (out.logits.float() - ref).norm() / ref.norm()
    assert err < 2e-2, err
    generated = half.generate(ids[:, :5], max_new_tokens=4, do_sample=False)
    assert generated.shape == (2, 9)
