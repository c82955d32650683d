"""MoMForCausalLM specifics: gradients, losses, the deltanet variant, sizes, training, gated Memory Caching."""

from __future__ import annotations

import json

import pytest
import torch

from mnemo import MoMConfig, MoMForCausalLM
from mnemo.modeling.mom_layer import MoMLayer

from conftest import left_pad, tiny_mom, tiny_mom_config

pytestmark = pytest.mark.usefixtures("one_thread")


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


def test_paper_340m_parameter_count_on_meta_device():
    config = MoMConfig(tie_word_embeddings=True)
    with torch.device("meta"):
        model = MoMForCausalLM(config)
    n = sum(p.numel() for p in model.parameters())
    # flash-linear-attention 0.6.0's MomForCausalLM at the same configuration counts 512,351,424.
    assert n == 512_351_424


# --------------------------------------------------------------------------- gated Memory Caching

SEGMENT = 4
GATED = ["grm", "soup", "ssc"]


def gated_mom(aggregation: str, seed: int = 5, **overrides) -> MoMForCausalLM:
    """A tiny MoM with Memory Caching every ``SEGMENT`` tokens and a gate projection large enough to matter."""
    model = tiny_mom(seed=seed, segment_size=SEGMENT, aggregation=aggregation, ssc_topk=1, **overrides)
    with torch.no_grad():
        for layer in _mom_layers(model):
            layer.u_proj.weight.normal_(0, 1.0)
            layer.A_log.uniform_(-1, 0.5) if layer.gated else None
    return model


def _mom_layers(model):
    return [block.attn for block in model.model.layers if not block.is_attention]


def _same_weights(model: MoMForCausalLM, zero_gate: bool = False, **config) -> MoMForCausalLM:
    """``model``'s weights in a model of another aggregation or segment size; a ``u_proj`` the source lacks
    is zero, and so is every ``u_proj`` with ``zero_gate``."""
    other = MoMForCausalLM(tiny_mom_config(**{**model.config.to_diff_dict(), **config})).eval()
    missing, unexpected = other.load_state_dict(model.state_dict(), strict=False)
    assert all("u_proj" in n for n in missing + unexpected)
    with torch.no_grad():
        for name, p in other.named_parameters():
            if name in missing or (zero_gate and "u_proj" in name):
                p.zero_()
    return other


def _decode(model, ids, split, mask=None):
    with torch.no_grad():
        out = model(ids[:, :split], attention_mask=None if mask is None else mask[:, :split], use_cache=True)
        cache, logits = out.past_key_values, [out.logits]
        for t in range(split, ids.shape[1]):
            out = model(ids[:, t:t + 1], attention_mask=None if mask is None else mask[:, :t + 1],
                        past_key_values=cache, use_cache=True)
            logits.append(out.logits)
    return torch.cat(logits, 1), cache


@pytest.mark.parametrize("aggregation", GATED)
@pytest.mark.parametrize("variant", [{}, {"memory_update": "deltanet", "shared_memory": False, "topk": 1,
                                          "num_hidden_layers": 3, "attention_layers": [1],
                                          "num_attention_heads": 4}])
def test_gated_prefill_and_decode_equal_forward(aggregation, variant, monkeypatch):
    model = gated_mom(aggregation, **variant)
    steps = []
    decode_step = MoMLayer._decode_step
    monkeypatch.setattr(MoMLayer, "_decode_step", lambda self, *a: steps.append(1) or decode_step(self, *a))
    ids = torch.randint(1, 97, (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids).logits
    for split in (1, 9):
        stepped, cache = _decode(model, ids, split)
        torch.testing.assert_close(stepped, full, rtol=1e-4, atol=1e-5)
    assert len(steps) == len(_mom_layers(model)) * (18 + 10)  # every one-token call took the decode step
    layer = cache[0]
    M = model.config.num_memories + int(model.config.shared_memory)
    H, D = model.config.num_heads, model.config.head_dim
    assert layer["mc_states"].shape == (2, M, 19 // SEGMENT, H, D, D)
    assert layer["mc_key_sum"].shape == (2, M, 19 // SEGMENT, H, D)
    assert layer["mc_count"].tolist() == [19 // SEGMENT] * 2 and "mc_sum" not in layer
    # per-memory summaries: every routed key went into exactly one segment sum or the online one
    total = layer["mc_key_count"].sum((1, 2)) + layer["mc_online_key_count"].sum(1)
    assert total.tolist() == [19.0 * (model.config.topk + int(model.config.shared_memory))] * 2


@pytest.mark.parametrize("aggregation", GATED)
def test_gated_left_padded_batch_equals_each_sample_alone(aggregation):
    model = gated_mom(aggregation)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(1, 97, (n,), generator=g) for n in (17, 6, 11)]
    ids, mask = left_pad(seqs)
    full = ids.shape[1]
    extra = torch.randint(1, 97, (3, 5), generator=g)
    ids = torch.cat([ids, extra], 1)
    mask = torch.cat([mask, torch.ones_like(extra)], 1)
    batch, _ = _decode(model, ids, full, mask)
    for i, s in enumerate(seqs):
        alone, _ = _decode(model, torch.cat([s, extra[i]])[None], len(s))
        torch.testing.assert_close(batch[i, full - len(s):], alone[0], rtol=1e-4, atol=1e-5)


def test_gated_save_load_is_bit_exact(tmp_path):
    model = gated_mom("ssc")
    model.save_pretrained(tmp_path)
    loaded = MoMForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.ssc_topk == 1 and loaded.config.aggregation == "ssc"
    assert model.state_dict().keys() == loaded.state_dict().keys()
    assert any(n.endswith("u_proj.weight") for n in loaded.state_dict())
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    ids = torch.randint(1, 97, (2, 15))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_soup_equals_grm_and_ssc_with_a_zero_gate_projection_equals_mean():
    grm = gated_mom("grm")
    ids = torch.randint(1, 97, (2, 18), generator=torch.Generator().manual_seed(3))
    soup = _same_weights(grm, aggregation="soup")
    soup.load_state_dict(grm.state_dict())
    with torch.no_grad():
        assert torch.equal(soup(ids).logits, grm(ids).logits)  # a matrix memory reads linearly: soup is grm
        mean = _same_weights(grm, aggregation="mean")(ids).logits
        ssc = _same_weights(grm, zero_gate=True, aggregation="ssc")  # every score 0: all memories tied
        torch.testing.assert_close(ssc(ids).logits, mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(_decode(ssc, ids, 7)[0], mean, rtol=1e-5, atol=1e-5)
        assert (grm(ids).logits - mean).abs().max() > 1e-3  # a trained gate projection does change the read


@pytest.mark.parametrize("aggregation", GATED)
def test_gated_gradients_reach_every_parameter(aggregation):
    model = gated_mom(aggregation).train()
    ids = torch.randint(1, 97, (2, 14))
    model(ids, labels=ids).loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []
    assert all(layer.u_proj.weight.grad.abs().sum() > 0 for layer in _mom_layers(model))


def test_u_proj_exists_only_for_gated_memory_caching():
    assert not hasattr(_mom_layers(tiny_mom(segment_size=4, aggregation="mean"))[0], "u_proj")
    assert not hasattr(_mom_layers(tiny_mom(aggregation="grm"))[0], "u_proj")  # no caching, nothing to score
    layer = _mom_layers(tiny_mom(segment_size=4, aggregation="grm"))[0]
    assert layer.u_proj.weight.shape == (2 * 8, 32)


@pytest.mark.parametrize("aggregation", ["mean", "residual", *GATED])
def test_every_aggregation_is_plain_mom_inside_the_first_segment(aggregation):
    plain = tiny_mom(seed=6)
    cached = _same_weights(plain, segment_size=SEGMENT, aggregation=aggregation)
    if cached.config.gated_aggregation:
        with torch.no_grad():
            for layer in _mom_layers(cached):
                layer.u_proj.weight.normal_(0, 1.0)
    ids = torch.randint(1, 97, (2, 3 * SEGMENT), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        a, b = plain(ids).logits, cached(ids).logits
    torch.testing.assert_close(b[:, :SEGMENT], a[:, :SEGMENT], rtol=0, atol=1e-6)
    assert (b[:, SEGMENT:] - a[:, SEGMENT:]).abs().max() > 1e-4  # cached memories are read after it


def test_gated_generation_with_the_cache_equals_recomputation():
    """generate() on the growing cache (greedy, beam search's reorders, repeated rows) == without a cache."""
    model = gated_mom("grm")
    prompt = torch.randint(1, 97, (2, 6), generator=torch.Generator().manual_seed(5))
    for kwargs in (dict(do_sample=False), dict(num_beams=3, num_return_sequences=2, do_sample=False,
                                                early_stopping=False)):
        cached = model.generate(prompt, max_new_tokens=9, **kwargs)
        assert torch.equal(cached, model.generate(prompt, max_new_tokens=9, use_cache=False, **kwargs))


def _old_names(state: dict) -> dict:
    """A state dict in fla's layout, which mnemo's MoM used before its memories were modules."""
    import re

    return {re.sub(r"\.memories\.(\d+)\.(\w+)\.weight$", r".\2.\1.weight", name): t for name, t in state.items()}


def test_checkpoints_with_the_old_per_memory_names_still_load(tmp_path):
    """``k_proj.<m>`` (fla's and older mnemo checkpoints) loads as ``memories.<m>.k_proj`` through
    ``load_state_dict`` and ``from_pretrained``; saved checkpoints keep that layout (transformers writes the
    names back), so older readers and fla's tools read them too."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    model = tiny_mom(num_hidden_layers=3, attention_layers=[1], num_attention_heads=4)
    old = _old_names(model.state_dict())
    assert "model.layers.0.attn.k_proj.3.weight" in old and "model.layers.1.attn.k_proj.weight" in old
    fresh = tiny_mom(seed=9, num_hidden_layers=3, attention_layers=[1], num_attention_heads=4)
    fresh.load_state_dict(old)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name

    model.save_pretrained(tmp_path / "ckpt")
    saved = load_file(tmp_path / "ckpt" / "model.safetensors")
    assert "model.layers.0.attn.k_proj.3.weight" in saved and not any(".memories." in n for n in saved)
    save_file({n: t.contiguous() for n, t in old.items()}, tmp_path / "ckpt" / "model.safetensors",
              metadata={"format": "pt"})
    for load in (MoMForCausalLM.from_pretrained, AutoModelForCausalLM.from_pretrained):
        reloaded = load(tmp_path / "ckpt")
        for (name, a), b in zip(model.state_dict().items(), reloaded.state_dict().values()):
            assert torch.equal(a, b), name


def test_lora_adapter_config_names_modules(tmp_path):
    """With the default targets, the saved adapter config lists module names (PEFT used to shorten MoM's
    ``k_proj.4`` ... ``k_proj.63`` to bare '4' ... '63'), and every memory's and attention layer's key and value
    projections are adapted."""
    from peft import LoraConfig, get_peft_model

    from mnemo.integrations import LORA_TARGET_MODULES

    model = get_peft_model(tiny_mom(num_hidden_layers=3, attention_layers=[1], num_attention_heads=4),
                           LoraConfig(task_type="CAUSAL_LM"))
    model.save_pretrained(tmp_path / "adapter")
    targets = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["target_modules"]
    assert sorted(targets) == sorted(LORA_TARGET_MODULES["mnemo_mom"])
    assert all(t.isidentifier() for t in targets), targets
    adapted = {name for name, module in model.named_modules() if hasattr(module, "lora_A")}
    for memory in range(4):
        assert f"base_model.model.model.layers.0.attn.memories.{memory}.k_proj" in adapted
        assert f"base_model.model.model.layers.0.attn.memories.{memory}.v_proj" in adapted
    assert {"base_model.model.model.layers.1.attn.k_proj", "base_model.model.model.layers.1.attn.v_proj"} <= adapted
