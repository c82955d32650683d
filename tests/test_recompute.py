"""Saved activations made again in the backward: the same gradients as keeping them, and really not kept."""

from __future__ import annotations

import pytest
import torch

import mnemo.modeling.mom_layer as mom_layer
from mnemo.kernels import use_backend
from mnemo.modeling.recompute import RecomputedSaves, gathered_rows, shared_parts

from conftest import tiny_mom_config

pytest.importorskip("triton")


def counted(recipe, calls: list):
    def wrapped(start, stop):
        calls.append((start, stop))
        return recipe(start, stop)
    return wrapped


def toy_loss(x, w, index, saves: RecomputedSaves | None):
    """A gather whose rows feed products (saved as row blocks) and an elementwise op (saved whole)."""
    gathered = x.index_select(0, index)
    if saves is not None:
        calls: list = []
        saves.register(gathered, counted(gathered_rows(x.detach(), index), calls))
        saves.calls = calls
    return (gathered[2:5] @ w).sin().sum() + (gathered[5:] @ w).cos().sum() + gathered.exp().sum()


def test_recipes_replace_the_saved_tensors_and_give_the_same_gradients():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([3, 0, 5, 5, 1, 2, 4, 0])
    expected = torch.autograd.grad(toy_loss(x, w, index, None), (x, w))
    with RecomputedSaves() as saves:
        loss = toy_loss(x, w, index, saves)
    got = torch.autograd.grad(loss, (x, w), retain_graph=True)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    # the two products saved their row blocks, exp its output (not registered) and nothing else
    assert sorted(saves.calls) == [(2, 5), (5, 8)]
    again = torch.autograd.grad(loss, (x, w))  # a second backward makes them again
    assert all(torch.equal(a, b) for a, b in zip(again, expected)) and len(saves.calls) == 4


def test_shared_parts_are_made_once_per_backward():
    made = []

    def make():
        made.append(1)
        return torch.arange(6.0).view(3, 2), torch.ones(2)

    first, second = shared_parts(make, 2)
    assert torch.equal(second(None, None), torch.ones(2)) and torch.equal(first(1, 3), torch.arange(2.0, 6.0).view(2, 2))
    assert len(made) == 1
    first(None, None)
    assert len(made) == 2


def test_no_recipes_without_gradients_or_under_no_grad():
    x = torch.randn(4, 2)
    with torch.no_grad(), RecomputedSaves() as saves:
        assert saves.register(x, gathered_rows(x, torch.arange(4))) is x
        assert not saves._registered


class KeepEverything(RecomputedSaves):
    def register(self, tensor, _recipe):
        return tensor


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mom_layer_gradients_are_those_of_keeping_the_activations(monkeypatch, backend):
    """The layer's gathered inputs, queries, keys and values are recomputed in the backward, bit for bit."""
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() and backend == "triton" else "cpu"
    layer = mom_layer.MoMLayer(tiny_mom_config(chunk_size=16), 0).to(device)
    x = torch.randn(2, 37, layer.gate.in_features, device=device, requires_grad=True)

    def grads():
        layer.zero_grad()
        x.grad = None
        with use_backend(backend):
            out, aux = layer(x)
        (out.sin().sum() + aux).backward()
        return [x.grad.clone()] + [p.grad.clone() for p in layer.parameters() if p.grad is not None]

    made, made_kv = [], []
    original, original_parts = mom_layer.gathered_rows, mom_layer.shared_parts
    monkeypatch.setattr(mom_layer, "gathered_rows", lambda *a: counted(original(*a), made))
    monkeypatch.setattr(mom_layer, "shared_parts",
                        lambda *a: [counted(r, made_kv) for r in original_parts(*a)])
    recomputed = grads()
    assert made, "the backward must make the gathered rows again"
    if backend == "triton":  # its convolutions save their inputs as they are: the projected keys and values
        assert len(made_kv) == 2, "the backward must make the keys and values again"
    monkeypatch.setattr(mom_layer, "RecomputedSaves", KeepEverything)
    kept = grads()
    assert len(recomputed) == len(kept)
    for a, b in zip(recomputed, kept):
        assert torch.equal(a, b)
