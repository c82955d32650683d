"""The flash-style reads of the DeepTransformer's chunk loop (:mod:`mnemo.kernels.deep_attention_triton_read`)
against the weights formed in PyTorch: outputs, log-sum-exp and every gradient (the log-sum-exp's included),
for softmax and raw ``exp`` reads, one or two value tensors, queries that see no key, key spans that start
inside a block, and more queries and keys than one block holds."""

from __future__ import annotations

import pytest
import torch

from mnemo.kernels.deep_attention import _read_weights

pytest.importorskip("triton")

from mnemo.kernels.deep_attention_triton_read import masked_read  # noqa: E402


def _torch_read(q, k, values, key_start, key_end, scale, normalize):
    position = torch.arange(k.shape[2])
    allowed = (position >= key_start[:, None, None]) & (position < key_end[:, :, None])
    weights = _read_weights(q, k, allowed[:, None], scale, normalize)
    lse = torch.zeros(q.shape[:3], dtype=q.dtype)
    if normalize:
        scores = torch.where(allowed[:, None], (q @ k.transpose(-1, -2)) * scale, float("-inf"))
        lse = torch.where(allowed.any(-1)[:, None], scores.logsumexp(-1), 0.0)
    return tuple(weights @ v for v in values), lse


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("normalize", [True, False], ids=["softmax", "exp"])
@pytest.mark.parametrize("widths", [(10,), (10, 20), (7, 130)], ids=["one", "two", "wide"])
def test_masked_read_equals_the_weights_formed_in_torch(dtype, atol, normalize, widths):
    gen = torch.Generator().manual_seed(len(widths) + normalize)
    B, H, NQ, NK, DK = 2, 3, 37, 90, 12
    q = torch.randn(B, H, NQ, DK, generator=gen, dtype=dtype).requires_grad_()
    k = torch.randn(B, H, NK, DK, generator=gen, dtype=dtype).requires_grad_()
    values = [torch.randn(B, H, NK, d, generator=gen, dtype=dtype).requires_grad_() for d in widths]
    key_start = torch.tensor([0, 20])
    key_end = torch.randint(0, NK + 1, (B, NQ), generator=gen)
    key_end[0, 3] = 0  # no key at all
    key_end[1, 5] = 10  # ends before the span starts: no key either
    scale = 0.3
    outs, lse = masked_read(q, k, tuple(values), key_start, key_end, scale, normalize)
    want, want_lse = _torch_read(q, k, values, key_start, key_end, scale, normalize)
    scale_of = lambda x: max(1.0, x.abs().max().item())  # noqa: E731  (the raw kernel's reads run large)
    for got, ref in zip((*outs, lse), (*want, want_lse)):
        torch.testing.assert_close(got, ref, rtol=0, atol=atol * scale_of(ref))
    for o in outs:
        assert o[0, :, 3].abs().max() == 0 and o[1, :, 5].abs().max() == 0
    cotangents = [torch.randn(o.shape, generator=gen, dtype=dtype) for o in (*outs, lse)]
    inputs = [q, k, *values]
    loss = lambda reads: sum((x * c).sum() for x, c in zip(reads, cotangents))  # noqa: E731
    got = torch.autograd.grad(loss((*outs, lse)), inputs)
    ref = torch.autograd.grad(loss((*want, want_lse)), inputs)
    for label, g, r in zip(["q", "k"] + [f"v{i}" for i in range(len(values))], got, ref):
        torch.testing.assert_close(g, r, rtol=0, atol=atol * scale_of(r), msg=label)


@pytest.mark.parametrize("mutable_from", [0, 30, 89])
def test_values_written_in_place_after_a_read_from_mutable_from_leave_its_gradients_as_they_were(mutable_from):
    gen = torch.Generator().manual_seed(mutable_from)
    B, H, NQ, NK, DK = 2, 2, 20, 90, 8
    q, k = (torch.randn(B, H, n, DK, generator=gen, dtype=torch.float64).requires_grad_() for n in (NQ, NK))
    leaf = torch.randn(B, H, NK, 6, generator=gen, dtype=torch.float64).requires_grad_()
    later = torch.randn(B, H, NK - mutable_from, 6, generator=gen, dtype=torch.float64)
    key_start, key_end = torch.tensor([0, 7]), torch.randint(0, NK + 1, (B, NQ), generator=gen)
    cotangent = torch.randn(B, H, NQ, 6, generator=gen, dtype=torch.float64)
    (want,), _ = masked_read(q, k, (leaf,), key_start, key_end, 0.3, True)
    want_grads = torch.autograd.grad((want * cotangent).sum(), (q, k, leaf))
    buffer = leaf * 1.0  # the loop's buffers: not leaves, written in place
    (out,), _ = masked_read(q, k, (buffer,), key_start, key_end, 0.3, True, mutable_from)
    buffer[:, :, mutable_from:] += later  # a later chunk's writes
    got_grads = torch.autograd.grad((out * cotangent).sum(), (q, k, leaf))  # dq, dk take the values as read
    assert torch.equal(out, want) and all(torch.equal(g, w) for g, w in zip(got_grads, want_grads))


def test_masked_read_names_what_it_takes():
    x = torch.zeros(1, 1, 4, 4)
    ends = torch.full((1, 4), 4)
    with pytest.raises(ValueError, match="one or two value tensors"):
        masked_read(x, x, (x, x, x), torch.zeros(1), ends, 1.0, True)
    with pytest.raises(TypeError, match="float32 or float64"):
        masked_read(x.half(), x.half(), (x.half(),), torch.zeros(1), ends, 1.0, True)
    with pytest.raises(ValueError, match="widths up to 256"):
        masked_read(x, x, (torch.zeros(1, 1, 4, 300),), torch.zeros(1), ends, 1.0, True)
    with pytest.raises(ValueError, match="mutable_from must lie in"):
        masked_read(x, x, (x,), torch.zeros(1), ends, 1.0, True, 5)


def test_chunk_loop_wider_than_the_reads_tiles_is_named_on_the_triton_backend():
    from mnemo.kernels import use_backend
    from mnemo.kernels.deep_attention import chunk_deep_attention

    q = torch.zeros(1, 3, 1, 4)
    with use_backend("triton"), pytest.raises(NotImplementedError, match="chunk loop at widths"):
        chunk_deep_attention(q, q, torch.zeros(1, 3, 1, 300), None, None, None, memory_depth=1, learning_rule="omega")
    chunk_deep_attention(q, q, torch.zeros(1, 3, 1, 300), None, None, None, memory_depth=1, learning_rule="omega")
