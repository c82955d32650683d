"""The LM loss without full logits: transformers' ``ForCausalLMLoss`` exactly, its gradients, and its memory."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss

from mnemo.kernels.linear_cross_entropy import causal_targets, chunked_cross_entropy, linear_cross_entropy

from conftest import tiny_atlas, tiny_deep_transformer, tiny_mc_titans, tiny_mom


def _labels(B: int, T: int, V: int) -> torch.Tensor:
    labels = torch.randint(0, V, (B, T))
    labels[0, :3] = -100  # a masked prompt
    labels[-1, -4:] = -100  # right padding
    return labels


@pytest.mark.parametrize("num_items", [None, 37, "tensor"])
@pytest.mark.parametrize("chunk_rows", [1, 5, 64])
def test_equals_transformers_loss_and_gradients(num_items, chunk_rows):
    B, T, H, V = 3, 11, 16, 29
    hidden = torch.randn(B, T, H, dtype=torch.float64, requires_grad=True)
    head = nn.Linear(H, V, bias=True).double()
    labels = _labels(B, T, V)
    kwargs = {} if num_items is None else {"num_items_in_batch": torch.tensor(37) if num_items == "tensor" else 37}
    expected = ForCausalLMLoss(head(hidden), labels, V, **kwargs)
    expected_grads = torch.autograd.grad(expected, [hidden, head.weight, head.bias])
    loss = linear_cross_entropy(hidden, head, causal_targets(labels), chunk_rows=chunk_rows, **kwargs)
    grads = torch.autograd.grad(loss, [hidden, head.weight, head.bias])
    torch.testing.assert_close(loss, expected.float(), rtol=1e-6, atol=0)  # the sum is kept in float32
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_shift_labels_ignore_index_and_all_ignored():
    B, T, H, V = 2, 7, 8, 13
    hidden = torch.randn(B, T, H)
    head = nn.Linear(H, V, bias=False)
    shift = torch.randint(0, V, (B, T))
    shift[0, 2] = 5
    for kwargs in ({"shift_labels": shift}, {"shift_labels": shift, "ignore_index": 5}):
        expected = ForCausalLMLoss(head(hidden), None, V, **kwargs)
        targets = causal_targets(None, shift, kwargs.get("ignore_index", -100))
        got = linear_cross_entropy(hidden, head, targets, ignore_index=kwargs.get("ignore_index", -100), chunk_rows=3)
        torch.testing.assert_close(got, expected)
    nothing = torch.full((B, T), -100)
    assert linear_cross_entropy(hidden, head, causal_targets(nothing)).isnan()  # 0 / 0, as transformers
    assert ForCausalLMLoss(head(hidden), nothing, V).isnan()


def test_chunked_from_logits_equals_transformers_loss():
    logits = torch.randn(2, 9, 31, dtype=torch.bfloat16)
    labels = _labels(2, 9, 31)
    torch.testing.assert_close(chunked_cross_entropy(logits, causal_targets(labels), chunk_rows=4),
                               ForCausalLMLoss(logits, labels, 31))


def test_a_lora_head_gets_its_gradients():
    peft = pytest.importorskip("peft")
    H, V = 8, 17

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(H, V, bias=False)

    torch.manual_seed(0)
    model = peft.get_peft_model(Head(), peft.LoraConfig(target_modules=["lm_head"], r=2, init_lora_weights=False))
    hidden = torch.randn(2, 6, H, requires_grad=True)
    labels = _labels(2, 6, V)
    head = model.base_model.model.lm_head
    trainable = [p for p in model.parameters() if p.requires_grad] + [hidden]
    expected = torch.autograd.grad(ForCausalLMLoss(head(hidden), labels, V), trainable)
    got = torch.autograd.grad(linear_cross_entropy(hidden, head, causal_targets(labels), chunk_rows=4), trainable)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7)


BUILDERS = {"mom": tiny_mom, "atlas": tiny_atlas, "deep-transformer": tiny_deep_transformer,
            "mc-titans": tiny_mc_titans}


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_models_train_on_the_same_loss_without_logits(family):
    model = BUILDERS[family]().train()
    ids = torch.randint(1, 97, (2, 12))
    labels = ids.clone()
    labels[:, :2] = -100
    out = model(ids, labels=labels)
    assert out.logits is None  # never made where gradients are recorded
    grads = torch.autograd.grad(out.loss, list(model.parameters()), allow_unused=True)
    reference = model(ids, labels=labels, return_logits=True)
    assert reference.logits.shape == (2, 12, 97)
    expected = ForCausalLMLoss(reference.logits, labels, 97)
    if reference.aux_loss is not None:
        expected = expected + model.config.aux_loss_coef * reference.aux_loss
    expected_grads = torch.autograd.grad(expected, list(model.parameters()), allow_unused=True)
    torch.testing.assert_close(out.loss, expected, rtol=1e-6, atol=1e-7)
    for got, want in zip(grads, expected_grads):
        assert (got is None) == (want is None)
        if got is not None:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        evaluated = model.eval()(ids, labels=labels)
    assert evaluated.logits is not None  # evaluation keeps its logits (for metrics)
    torch.testing.assert_close(evaluated.loss, expected.detach(), rtol=1e-6, atol=1e-7)


def test_a_training_step_never_holds_the_float32_logits():
    """The peak of a training step (resident set, in a fresh process) grows by less than half the float32
    logits: 2,048 tokens at a 131,072-token vocabulary are 1 GiB of logits."""
    script = textwrap.dedent("""
        import resource, torch
        from mnemo import MoMConfig, MoMForCausalLM
        torch.manual_seed(0)
        config = MoMConfig(vocab_size=131072, hidden_size=32, num_hidden_layers=1, num_heads=2, head_dim=8,
                           num_memories=1, topk=1, shared_memory=False, intermediate_size=64, chunk_size=16,
                           tie_word_embeddings=True)
        model = MoMForCausalLM(config).train()
        ids = torch.randint(0, 131072, (4, 512))
        model(ids[:, :16], labels=ids[:, :16]).loss.backward()  # allocates the gradients, warms up
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        model(ids, labels=ids).loss.backward()
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={"OMP_NUM_THREADS": "1", "PATH": "", "HOME": "/tmp"})
    assert out.returncode == 0, out.stderr
    growth = int(out.stdout.split()[-1])
    logits_bytes = 4 * 512 * 131072 * 4
    assert growth < logits_bytes / 2, f"peak grew by {growth / 2**30:.2f} GiB"
