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
    with torch.no_grad():
        got = project_together(x, linears)
    assert products == [48 + 4 + 16 + 48]
    for out, m in zip(got, linears, strict=True):
        assert out.shape == (*shape[:-1], m.out_features)
        torch.testing.assert_close(out, m(x), rtol=1e-6, atol=1e-6)


def test_many_rows_run_each_module(products):
    linears = _linears()
    x = torch.randn(FEW_ROWS + 1, 32)
    with torch.no_grad():
        got = project_together(x, linears)
    assert products == []
    for out, m in zip(got, linears, strict=True):
        assert torch.equal(out, m(x))


def test_under_autograd_each_module_runs_and_gradients_reach_it(products):
    """Training keeps each product: no stacked copy of the weights is saved for the backward."""
    linears, twins = _linears(1), _linears(1)
    x = torch.randn(2, 1, 32, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    sum(o.pow(2).sum() for o in project_together(x, linears)).backward()
    assert products == []
    sum(m(x2).pow(2).sum() for m in twins).backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)
    for m, twin in zip(linears, twins, strict=True):
        torch.testing.assert_close(m.weight.grad, twin.weight.grad, rtol=0, atol=0)


def test_weights_above_the_cap_run_one_by_one(products, monkeypatch):
    linears = _linears()
    x = torch.randn(1, 32)
    total = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    with torch.no_grad():
        monkeypatch.setattr(projections, "MAX_STACKED_BYTES", total)
        project_together(x, linears)
        assert len(products) == 1
        monkeypatch.setattr(projections, "MAX_STACKED_BYTES", total - 1)
        project_together(x, linears)
        assert len(products) == 1


class _Adapted(nn.Module):
    """A stand-in for an adapter-wrapped projection (PEFT's LoRA): its own forward, not ``F.linear``."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base, self.delta = base, nn.Linear(base.in_features, base.out_features, bias=False)

    def forward(self, x):
        return self.base(x) + self.delta(x)


class _Wrapped(torch.Tensor):
    """A tensor subclass standing in for a quantised weight (torchao keeps ``nn.Linear`` and swaps the weight)."""


class _Quantised(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2.0


def test_modules_that_are_not_plain_run_as_themselves(products):
    linears = _linears()
    hooked = nn.Linear(32, 8)
    hooked.register_forward_hook(lambda _module, _args, out: out + 1.0)
    offloaded = nn.Linear(32, 8)
    offloaded.forward = lambda x, m=offloaded: nn.Linear.forward(m, x) - 1.0  # accelerate sets forward on the instance
    backward_hooked = nn.Linear(32, 8)
    backward_hooked.register_full_backward_hook(lambda *_: None)
    subclassed = nn.Linear(32, 8)
    subclassed.weight = nn.Parameter(_Wrapped(subclassed.weight.detach()))  # a quantised weight's tensor subclass
    mixed = [_Adapted(linears[0]), linears[1], _Quantised(32, 8), linears[2], hooked, offloaded, backward_hooked,
             subclassed, linears[3]]
    x = torch.randn(1, 1, 32)
    with torch.no_grad():
        got = project_together(x, mixed)
        assert products == [4 + 16 + 48]
        for out, m in zip(got, mixed, strict=True):
            torch.testing.assert_close(out.as_subclass(torch.Tensor), m(x).as_subclass(torch.Tensor), rtol=1e-6,
                                       atol=1e-6)


def test_weights_changed_in_place_reach_the_next_call():
    """The weights are stacked inside each call, never kept: a weight an optimiser changed in place reaches the
    next step (and a captured step's replay stacks the parameters where they lie)."""
    linears = _linears()
    x = torch.randn(1, 32)
    with torch.no_grad():
        before = project_together(x, linears)
        linears[1].weight.add_(1.0)
        after = project_together(x, linears)
    assert not torch.allclose(after[1], before[1])
    torch.testing.assert_close(after[1], linears[1](x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("build", ["mc_titans", "mc_titans_grm", "atlas", "mom"])
def test_decoding_steps_stack_their_projections_and_decode_as_one_by_one(build, products, monkeypatch):
    """The layers' one-token steps take the stacked product (each layer once or more), and decode what the
    projections one by one decode."""
    from conftest import tiny_atlas, tiny_mc_titans, tiny_mom

    model = {"mc_titans": lambda: tiny_mc_titans(), "mc_titans_grm": lambda: tiny_mc_titans(segment_size=3),
             "atlas": lambda: tiny_atlas(), "mom": lambda: tiny_mom()}[build]().eval()
    ids = torch.randint(1, 97, (2, 9))

    def decode():
        with torch.no_grad():
            cache = model(ids[:, :5], use_cache=True).past_key_values
            steps = []
            for t in range(5, 9):
                out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                steps.append(out.logits)
        return torch.cat(steps, 1)

    stacked = decode()
    assert len(products) >= 4 * model.config.num_hidden_layers
    products.clear()
    monkeypatch.setattr(projections, "FEW_ROWS", 0)
    one_by_one = decode()
    assert products == []
    torch.testing.assert_close(stacked, one_by_one, rtol=1e-5, atol=1e-6)
