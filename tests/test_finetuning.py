"""Fine-tuning every family: LoRA with default targets, adapters round trip, merge, gradient checkpointing,
the transformers Trainer."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from conftest import tiny_atlas, tiny_deep_transformer, tiny_mc_titans, tiny_mom

FAMILIES = {
    "mom-hybrid": lambda: tiny_mom(num_hidden_layers=3, attention_layers=[1], num_attention_heads=4),
    "deep-transformer": lambda: tiny_deep_transformer(),
    "mc-titans": lambda: tiny_mc_titans(),
    "atlas-mag": lambda: tiny_atlas(hybrid="mag"),
}
NEVER_ADAPTED = ("gate.", "retention_proj", "momentum_proj", "lr_proj", "window_gate_proj", "eta_proj", "gamma_proj",
                 "u_proj", "b_proj", "a_proj", "shared_b", "shared_a", "conv1d")


def randomise_lora(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_lora_defaults_train_only_adapters_and_merge_exactly(family, tmp_path):
    base = FAMILIES[family]()
    base.save_pretrained(tmp_path / "base")
    ids = torch.randint(1, 97, (2, 13))
    with torch.no_grad():
        reference = base(ids).logits
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8))
    adapted = [n for n, _ in model.named_modules() if n.endswith("lora_A")]
    assert adapted, "the default targets adapt something"
    assert not any(key in n for n in adapted for key in NEVER_ADAPTED), adapted
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)

    randomise_lora(model)
    model.eval()
    with torch.no_grad():
        tuned = model(ids).logits
    assert (tuned - reference).abs().max() > 1e-3, "a LoRA delta must reach the output"
    model.save_pretrained(tmp_path / "adapter")

    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(ids).logits, tuned, rtol=0, atol=0)
        merged = reloaded.merge_and_unload()
        torch.testing.assert_close(merged(ids).logits, tuned, rtol=1e-5, atol=1e-5)

    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gradient_checkpointing_gives_identical_gradients(family):
    model = FAMILIES[family]().train()
    ids = torch.randint(1, 97, (2, 11))

    def grads():
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    out = model(ids, labels=ids, use_cache=True)
    assert out.past_key_values is None, "use_cache is forced off under gradient checkpointing"
    checkpointed = grads()
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_trainer_trains(family, tmp_path):
    model = FAMILIES[family]()
    torch.manual_seed(0)
    data = [{"input_ids": x, "labels": x} for x in torch.randint(1, 97, (8, 12))]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=4,
                             learning_rate=3e-3, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=data)
    result = trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    assert result.global_step == 6


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_documents_equal_each_document_alone(family):
    """position_ids that restart at 0 (transformers' packing collators) keep documents apart."""
    model = FAMILIES[family]()
    docs = [torch.randint(1, 97, (n,)) for n in (7, 3, 11, 1, 6)]
    rows = [torch.cat(docs[:3]), torch.cat(docs[3:] + [torch.zeros(14, dtype=torch.long)])]
    ids = torch.stack(rows)
    position_ids = torch.stack([torch.cat([torch.arange(len(d)) for d in docs[:3]]),
                                torch.cat([torch.arange(len(d)) for d in docs[3:]] + [torch.arange(14)])])
    mask = torch.ones_like(ids)
    mask[1, -14:] = 0
    with torch.no_grad():
        packed = model(ids, attention_mask=mask, position_ids=position_ids).logits
        alone = [model(d[None]).logits[0] for d in docs]
    torch.testing.assert_close(packed[0], torch.cat(alone[:3]), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(packed[1, :7], torch.cat(alone[3:]), rtol=1e-4, atol=1e-5)
    labels = ids.masked_fill(mask == 0, -100)
    loss = model.train()(ids, attention_mask=mask, position_ids=position_ids, labels=labels).loss
    assert torch.isfinite(loss)


def test_mnemo_trainer_logs_the_aux_loss(tmp_path):
    from mnemo import MnemoTrainer

    model = tiny_mom()
    data = [{"input_ids": x, "labels": x} for x in torch.randint(1, 97, (8, 12))]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4,
                             logging_steps=2, report_to=[], use_cpu=True, save_strategy="no")
    trainer = MnemoTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    logged = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logged) == 2 and all(log["aux_loss"] >= 1.0 - 1e-6 for log in logged)  # Switch loss >= 1
