"""Several projections of one input as one product over their stacked weights (a decoding step's projections)."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import mnemo.modeling.projections as projections
from mnemo.modeling.gates import GateProjection
from mnemo.modeling.projections import FEW_ROWS, project_together


def _linears(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Linear(32, 48, bias=False), GateProjection(32, 4, 2.0), nn.Linear(32, 16, bias=True),
            nn.Linear(32, 48, bias=False)]


@pytest.fixture
def products(monkeypatch):
    """The products ``project_together`` launches itself."""
    calls = []
    real = projections.F.linear
    monkeypatch.setattr(projections, "F", SimpleNamespace(linear=lambda *a, **k: calls.append(a[1].shape[0]) or real(*a, **k)))
    return calls


@pytest.mark.parametrize("shape", [(1, 1, 32), (3, 1, 32), (2, 5, 32)])
def test_few_rows_take_one_product_equal_to_the_modules(shape, products):
    linears = _linears()
    x = torch.randn(*shape)
    got = project_together(x, linears)
    assert products == [48 + 4 + 16 + 48]
    for out, m in zip(got, linears, strict=True):
        assert out.shape == (*shape[:-1], m.out_features)
        torch.testing.assert_close(out, m(x), rtol=1e-6, atol=1e-6)


def test_many_rows_run_each_module(products):
    linears = _linears()
    x = torch.randn(FEW_ROWS + 1, 32)
    got = project_together(x, linears)
    assert products == []
    for out, m in zip(got, linears, strict=True):
        assert torch.equal(out, m(x))


def test_gradients_reach_each_weight_as_through_the_modules():
    linears, twins = _linears(1), _linears(1)
    x = torch.randn(2, 1, 32, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    sum(o.pow(2).sum() for o in project_together(x, linears)).backward()
    sum(m(x2).pow(2).sum() for m in twins).backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-6)
    for m, twin in zip(linears, twins, strict=True):
        torch.testing.assert_close(m.weight.grad, twin.weight.grad, rtol=1e-5, atol=1e-6)
        if m.bias is not None:
            torch.testing.assert_close(m.bias.grad, twin.bias.grad, rtol=1e-5, atol=1e-6)


class _Adapted(nn.Module):
    """A stand-in for an adapter-wrapped projection (PEFT's LoRA): its own forward, not ``F.linear``."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base, self.delta = base, nn.Linear(base.in_features, base.out_features, bias=False)

    def forward(self, x):
        return self.base(x) + self.delta(x)


class _Quantised(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2.0


def test_modules_that_are_not_plain_run_as_themselves(products):
    linears = _linears()
    hooked = nn.Linear(32, 8)
    hooked.register_forward_hook(lambda _module, _args, out: out + 1.0)
    offloaded = nn.Linear(32, 8)
    offloaded.forward = lambda x, m=offloaded: nn.Linear.forward(m, x) - 1.0  # accelerate sets forward on the instance
    mixed = [_Adapted(linears[0]), linears[1], _Quantised(32, 8), linears[2], hooked, offloaded, linears[3]]
    x = torch.randn(1, 1, 32)
    got = project_together(x, mixed)
    assert products == [4 + 16 + 48]
    for out, m in zip(got, mixed, strict=True):
        torch.testing.assert_close(out, m(x), rtol=1e-6, atol=1e-6)


def test_weights_changed_in_place_reach_the_next_call():
    """The weights are stacked inside each call, never kept: a weight an optimiser changed in place reaches the
    next step (and a captured step's replay stacks the parameters where they lie)."""
    linears = _linears()
    x = torch.randn(1, 32)
    before = project_together(x, linears)
    with torch.no_grad():
        linears[1].weight.add_(1.0)
    after = project_together(x, linears)
    assert not torch.allclose(after[1], before[1])
    torch.testing.assert_close(after[1], linears[1](x), rtol=1e-6, atol=1e-6)
