"""MoMForCausalLM specifics: gradients, losses, the deltanet variant, sizes, training."""

from __future__ import annotations

import torch

from mnemo import MoMConfig, MoMForCausalLM

from conftest import tiny_mom


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
