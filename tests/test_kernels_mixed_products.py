"""Soup's mixed products in Triton (:mod:`mnemo.kernels.mixed_products_triton`) against the products written
memory by memory in float64: Triton's interpreter on the CPU, the compiled kernels on CUDA."""

from __future__ import annotations

import pytest
import torch

import mnemo.kernels.mixed_products_triton as mixed

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def problem(seed: int, B: int, H: int, T: int, N: int, d_in: int, d_out: int):
    """Inputs, gates in [0, 1) with some memories' zero for some tokens (as a softmax masks them), and weights."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, T, d_in, generator=gen)
    g = torch.rand(B, H, T, N, generator=gen) * (torch.rand(B, H, T, N, generator=gen) < 0.8)
    w = torch.randn(B, N, H, d_out, d_in, generator=gen) * d_in ** -0.5
    return [t.to(DEVICE).requires_grad_() for t in (x, g, w)]


def by_memory(x, g, w):
    return torch.einsum("bnhto,bhtn->bhto", x[:, None] @ w.transpose(-1, -2), g)


# widths of a first layer (16 -> 64), a second (64 -> 16), square, narrower than a tile (8 -> 16, 16 -> 8) and
# of no power of two (24 -> 40), wider than a block of 64 (80 -> 130: two blocks of inputs, three of outputs);
# 21 tokens (a partial block), 37 (two)
@pytest.mark.parametrize("T,N,d_in,d_out", [(21, 3, 16, 64), (37, 5, 64, 16), (21, 1, 32, 32), (9, 6, 16, 16),
                                            (37, 2, 8, 16), (9, 3, 16, 8), (21, 2, 24, 40),
                                            (37, 2, 80, 130)])
def test_mixed_products_and_their_gradients_equal_the_products_memory_by_memory(T, N, d_in, d_out):
    """``sum_n g_n x W_n^T`` and the gradients of ``x``, ``g`` and every ``W_n`` equal the batched products in
    float64 to float32's rounding (relative error < 1e-6 of the largest entry), over two rows of three heads."""
    x, g, w = problem(T + N, 2, 3, T, N, d_in, d_out)
    got = mixed.mixed_products(x, g, w, "ieee")
    expected = by_memory(x.double(), g.double(), w.double())
    probe = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEVICE)
    got_grads = torch.autograd.grad((got.double() * probe).sum(), (x, g, w))
    expected_grads = torch.autograd.grad((expected * probe).sum(), (x, g, w))
    for name, a, b in zip(("y", "dx", "dg", "dw"), (got, *got_grads), (expected, *expected_grads)):
        assert a.shape == b.shape and a.dtype == torch.float32, name
        assert relative_error(a, b) < 1e-6, name


def test_no_memories_mix_to_zero_with_zero_gradients():
    """An empty cache (``N = 0``) reads zeros, and its inputs' gradient is zero."""
    x, g, w = problem(0, 1, 2, 5, 0, 16, 32)
    y = mixed.mixed_products(x, g, w)
    assert y.shape == (1, 2, 5, 32) and y.abs().max() == 0
    (dx,) = torch.autograd.grad(y.sum(), x)
    assert dx.abs().max() == 0


def test_mixed_products_name_what_they_do_not_take():
    x, g, w = problem(0, 1, 2, 5, 2, 16, 32)
    with pytest.raises(ValueError, match=r"g \(B, H, T, N\)"):
        mixed.mixed_products(x, g[..., :1], w)
    with pytest.raises(ValueError, match="float32"):
        mixed.mixed_products(x.double(), g, w)


def test_a_soup_model_trains_prefills_and_decodes_through_the_kernels(monkeypatch):
    """MC-Titans with the soup aggregation on ``use_backend("triton")``: a training step (loss and every
    gradient), a prefill and a decode step take the mixed-products kernels and equal the PyTorch path
    (relative error < 1e-5 of the largest entry)."""
    import mnemo.kernels.memory_caching as memory_caching
    from mnemo.kernels import use_backend

    from conftest import tiny_mc_titans

    calls = []

    def spy(*args, **kwargs):
        calls.append(args[0].requires_grad)
        return mixed.mixed_products(*args, **kwargs)

    monkeypatch.setattr(memory_caching, "mixed_products_triton", spy)
    model = tiny_mc_titans(aggregation="soup", cache_mode="independent", num_hidden_layers=1).to(DEVICE).train()
    ids = torch.randint(1, 97, (2, 14), generator=torch.Generator().manual_seed(0)).to(DEVICE)

    def step(backend):
        model.zero_grad()
        with use_backend(backend):
            loss = model(ids, labels=ids).loss
            loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]

    expected = step("torch")
    assert not calls
    got = step("triton")
    assert calls and any(calls)  # the training step's mixes, with their gradients
    for a, b in zip(got, expected, strict=True):
        assert relative_error(a, b) < 1e-5

    model.eval()
    outputs = {}
    for backend in ("torch", "triton"):
        calls.clear()
        with use_backend(backend), torch.no_grad():
            out = model(ids[:, :13], use_cache=True)
            prefill_calls = len(calls)
            step_logits = model(ids[:, 13:], past_key_values=out.past_key_values, use_cache=True).logits
        outputs[backend] = (out.logits, step_logits, prefill_calls, len(calls) - prefill_calls)
    assert outputs["torch"][2:] == (0, 0)
    assert outputs["triton"][2] > 0 and outputs["triton"][3] > 0  # the prefill's mixes and the decode step's
    for a, b in zip(outputs["triton"][:2], outputs["torch"][:2]):
        assert relative_error(a, b) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need CUDA")
@pytest.mark.parametrize("precision", ["ieee", "tf32"])
@pytest.mark.parametrize("d_in,d_out", [(64, 256), (256, 64)], ids=["first_layer", "second_layer"])
def test_mixed_products_at_real_shapes_on_the_gpu(d_in, d_out, precision):
    """The compiled kernels at the benchmark's shape (a chunk of 64 tokens of 2 rows x 16 heads of 64, MLP x4,
    48 cached memories) against float64: exact float32 products to 1e-5 of the largest entry, TF32 products
    (11 bits of mantissa, sums of 256 terms) to 5e-3."""
    x, g, w = problem(3, 2, 16, 64, 48, d_in, d_out)
    got = mixed.mixed_products(x, g, w, precision)
    expected = by_memory(x.double(), g.double(), w.double())
    probe = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEVICE)
    got_grads = torch.autograd.grad((got.double() * probe).sum(), (x, g, w))
    expected_grads = torch.autograd.grad((expected * probe).sum(), (x, g, w))
    bound = 1e-5 if precision == "ieee" else 5e-3
    errors = [relative_error(a, b) for a, b in zip((got, *got_grads), (expected, *expected_grads))]
    assert max(errors) < bound, errors
