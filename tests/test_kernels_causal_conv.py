"""The packed causal short convolution: PyTorch and Triton paths == a per-sequence loop.

Values and every gradient (inputs, weight, window, through the output and the next
window), over sequences shorter than the window, empty ones and long ones. Without
a GPU the Triton kernels run under the interpreter (conftest).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from mnemo.kernels import use_backend
from mnemo.kernels.causal_conv import ConvWindows, packed_causal_conv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def loop_conv(x, weight, cu, window, activation):
    """Each sequence on its own: ``[window, tokens]`` convolved token by token."""
    C, K = weight.shape
    ys, windows = [], []
    for n in range(cu.numel() - 1):
        seq = torch.cat([window[n], x[cu[n]:cu[n + 1]]])
        out = [(seq[t:t + K] * weight.T).sum(0) for t in range(seq.shape[0] - K + 1)]
        y = torch.stack(out) if out else x.new_zeros(0, C)
        ys.append(F.silu(y) if activation else y)
        windows.append(seq[seq.shape[0] - (K - 1):])
    return torch.cat(ys), torch.stack(windows)


def run(backend, x, weight, cu, window, activation, windows_grad):
    leaves = [t.detach().clone().to(DEVICE).requires_grad_() for t in (x, weight, window)]
    windows = ConvWindows.build(cu.to(DEVICE), weight.shape[-1])
    with use_backend(backend):
        y, nxt = packed_causal_conv(leaves[0], leaves[1], windows, leaves[2], activation=activation)
    loss = (y.double() * torch.linspace(-1, 1, y.numel(), dtype=torch.float64, device=DEVICE).view_as(y)).sum()
    if windows_grad:
        loss = loss + nxt.double().sin().sum()
    loss.backward()
    return [t.detach().cpu().double() for t in (y, nxt, *[leaf.grad for leaf in leaves])]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("activation", [True, False])
@pytest.mark.parametrize("windows_grad", [True, False])
@pytest.mark.parametrize("kernel_size", [2, 4])
def test_packed_conv_equals_per_sequence_loop(backend, activation, windows_grad, kernel_size):
    pytest.importorskip("triton") if backend == "triton" else None
    gen = torch.Generator().manual_seed(kernel_size)
    lengths = [5, 0, 1, 2, 70, 3, 0, 9]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    C = 70  # two channel tiles, the second partial
    x = torch.randn(int(cu[-1]), C, generator=gen, dtype=torch.float64)
    weight = torch.randn(C, kernel_size, generator=gen, dtype=torch.float64)
    window = torch.randn(len(lengths), kernel_size - 1, C, generator=gen, dtype=torch.float64)

    leaves = [t.clone().requires_grad_() for t in (x, weight, window)]
    y, nxt = loop_conv(*leaves[:2], cu, leaves[2], activation)
    loss = (y * torch.linspace(-1, 1, y.numel(), dtype=torch.float64).view_as(y)).sum()
    if windows_grad:
        loss = loss + nxt.sin().sum()
    loss.backward()
    expected = [y.detach(), nxt.detach()] + [leaf.grad for leaf in leaves]

    got = run(backend, x.float(), weight.float(), cu, window.float(), activation, windows_grad)
    for name, a, b in zip(["output", "next window", "d x", "d weight", "d window"], got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_packed_conv_without_window_starts_from_zeros(backend):
    pytest.importorskip("triton") if backend == "triton" else None
    gen = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 3, 3, 20])
    x = torch.randn(20, 16, generator=gen)
    weight = torch.randn(16, 4, generator=gen)
    windows = ConvWindows.build(cu.to(DEVICE), 4)
    with use_backend(backend):
        y, nxt = packed_causal_conv(x.to(DEVICE), weight.to(DEVICE), windows, None)
    y0, n0 = loop_conv(x, weight, cu, torch.zeros(3, 3, 16), True)
    torch.testing.assert_close(y.cpu(), y0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nxt.cpu(), n0, rtol=0, atol=0)


def test_triton_conv_keeps_bf16_inputs_within_rounding():
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(2)
    cu = torch.tensor([0, 40, 41, 100])
    x = torch.randn(100, 64, generator=gen)
    weight = torch.randn(64, 4, generator=gen) * 0.5
    window = torch.randn(3, 3, 64, generator=gen)
    ref = loop_conv(x, weight, cu, window, True)
    windows = ConvWindows.build(cu.to(DEVICE), 4)
    with use_backend("triton"):
        y, nxt = packed_causal_conv(*(t.to(DEVICE, torch.bfloat16) for t in (x, weight)), windows,
                                    window.to(DEVICE, torch.bfloat16))
    assert y.dtype == nxt.dtype == torch.bfloat16
    assert ((y.float().cpu() - ref[0]).norm() / ref[0].norm()).item() < 1e-2
