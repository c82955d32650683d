"""Sums over each token's routed entries (kernels/token_slots.py) == a loop over tokens, both paths."""

from __future__ import annotations

import pytest
import torch

from mnemo.kernels import use_backend
from mnemo.kernels.token_slots import slot_sum

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def routed_layout(N=11, S=3, seed=0):
    """Each token's entries (``P`` for an empty slot) and each entry's token: tokens 4 and 9 are
    padding, the others visit 1 to ``S`` memories, and the entries lie in a shuffled order."""
    gen = torch.Generator().manual_seed(seed)
    visits = torch.randint(1, S + 1, (N,), generator=gen)
    visits[[4, 9]] = 0
    owner = torch.repeat_interleave(torch.arange(N), visits)
    owner = owner[torch.randperm(owner.numel(), generator=gen)]
    P = owner.numel()
    slots = torch.full((N, S), P, dtype=torch.long)
    for e, t in enumerate(owner.tolist()):
        slots[t, int((slots[t] < P).sum())] = e
    return slots, owner, P


def loop_reference(y, slots, weight):
    out = torch.zeros(slots.shape[0], y.shape[1], dtype=torch.float64)
    for t in range(slots.shape[0]):
        for e in slots[t].tolist():
            if e < y.shape[0]:
                out[t] += (1.0 if weight is None else weight[e].double()) * y[e].double()
    return out


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_weighted_sum_and_gradients_equal_the_loop(backend):
    if backend == "triton":
        pytest.importorskip("triton")
    slots, owner, P = routed_layout()
    gen = torch.Generator().manual_seed(1)
    y = torch.randn(P, 40, generator=gen, dtype=torch.float64)
    w = torch.rand(P, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(slots.shape[0], 40, generator=gen, dtype=torch.float64)

    y_ref, w_ref = y.clone().requires_grad_(), w.clone().requires_grad_()
    expected = loop_reference(y_ref, slots, w_ref)
    expected.backward(grad_out)

    y32 = y.float().to(DEVICE).requires_grad_()
    w32 = w.float().to(DEVICE).requires_grad_()
    with use_backend(backend):
        got = slot_sum(y32, slots.to(DEVICE), w32, owner.to(DEVICE), torch.float32)
        got.backward(grad_out.float().to(DEVICE))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.cpu().double(), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y32.grad.cpu().double(), y_ref.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w32.grad.cpu().double(), w_ref.grad, rtol=1e-6, atol=1e-5)
    assert got[4].abs().sum() == 0 and got[9].abs().sum() == 0  # padded tokens


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_unweighted_sum_keeps_the_input_dtype_and_sums_in_float32(backend):
    if backend == "triton":
        pytest.importorskip("triton")
    slots, _, P = routed_layout(seed=2)
    y = torch.randn(P, 24, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with use_backend(backend):
        got = slot_sum(y.to(DEVICE), slots.to(DEVICE))
        got32 = slot_sum(y.to(DEVICE), slots.to(DEVICE), out_dtype=torch.float32)
    assert got.dtype == torch.bfloat16 and got32.dtype == torch.float32
    expected = loop_reference(y.float(), slots, None)
    # float32 sums of at most three bf16 numbers: exact to float32 rounding
    torch.testing.assert_close(got32.cpu().double(), expected, rtol=1e-7, atol=1e-7)
    # then one rounding to bf16 (the interpreter truncates where CUDA rounds to nearest: one ulp)
    torch.testing.assert_close(got.cpu().float(), expected.float(), rtol=2**-7, atol=0)


def test_empty_layouts_and_a_weight_without_tokens():
    slots = torch.full((3, 2), 0, dtype=torch.long)  # no entries: P = 0, every slot empty
    y = torch.zeros(0, 8)
    assert slot_sum(y, slots).abs().sum() == 0
    weighted = slot_sum(y.requires_grad_(), slots, torch.zeros(0), torch.zeros(0, dtype=torch.long), torch.float32)
    assert weighted.shape == (3, 8) and weighted.abs().sum() == 0
    with pytest.raises(ValueError, match="token_index"):
        slot_sum(torch.zeros(2, 4), torch.zeros(1, 2, dtype=torch.long), torch.ones(2))
