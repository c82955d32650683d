"""The routed packed layout and the varlen short convolution with cached windows."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from mnemo.modeling.routing import route
from mnemo.modeling.short_conv import ConvWindows, ShortConvolution


def conv_reference(conv: ShortConvolution, x: torch.Tensor, window: torch.Tensor):
    """One sequence ``(L, C)`` with its cached window ``(K-1, C)``: plain F.conv1d."""
    full = torch.cat([window, x], 0).T[None]  # (1, C, K-1+L)
    y = F.conv1d(full, conv.weight, groups=x.shape[1])[0].T if x.shape[0] else x
    seen = torch.cat([window, x], 0)
    return F.silu(y), seen[seen.shape[0] - (conv.kernel_size[0] - 1):]


def test_packed_conv_equals_per_sequence_conv():
    torch.manual_seed(0)
    for K in (1, 2, 4):
        conv = ShortConvolution(6, K)
        lengths = [3, 0, 1, 7, 2]
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
        x = torch.randn(int(cu[-1]), 6)
        window = torch.randn(len(lengths), K - 1, 6)
        y, nxt = conv(x, ConvWindows.build(cu, K), window)
        for i in range(len(lengths)):
            sl = slice(int(cu[i]), int(cu[i + 1]))
            y_ref, nxt_ref = conv_reference(conv, x[sl], window[i])
            torch.testing.assert_close(y[sl], y_ref)
            torch.testing.assert_close(nxt[i], nxt_ref)


def test_packed_conv_gradients_equal_per_sequence_conv():
    torch.manual_seed(2)
    for K in (1, 2, 4):
        conv = ShortConvolution(5, K).double()
        lengths = [4, 0, 1, 6]
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
        x = torch.randn(int(cu[-1]), 5, dtype=torch.float64, requires_grad=True)
        window = torch.randn(len(lengths), K - 1, 5, dtype=torch.float64, requires_grad=True)
        y, nxt = conv(x, ConvWindows.build(cu, K), window)
        (y.sin().sum() + nxt.cos().sum()).backward()
        packed = [t.grad.clone() for t in (x, window, conv.weight)]
        for t in (x, window, conv.weight):
            t.grad = None
        loss = 0
        for i in range(len(lengths)):
            sl = slice(int(cu[i]), int(cu[i + 1]))
            y_ref, nxt_ref = conv_reference(conv, x[sl], window[i])
            loss = loss + y_ref.sin().sum() + nxt_ref.cos().sum()
        loss.backward()
        for name, a, t in zip(("x", "window", "weight"), packed, (x, window, conv.weight)):
            torch.testing.assert_close(a, t.grad, rtol=0, atol=1e-12, msg=f"K={K}: gradient of {name}")


def test_packed_conv_without_tokens_keeps_the_windows():
    conv = ShortConvolution(3, 4)
    window = torch.randn(2, 3, 3)
    y, nxt = conv(torch.zeros(0, 3), ConvWindows.build(torch.tensor([0, 0, 0]), 4), window)
    assert y.shape == (0, 3) and torch.equal(nxt, window)


def test_conv_split_with_carried_window_equals_one_call():
    torch.manual_seed(1)
    conv = ShortConvolution(4, 4)
    x = torch.randn(10, 4)
    y_full, w_full = conv(x, ConvWindows.build(torch.tensor([0, 10]), 4))
    y1, w1 = conv(x[:3], ConvWindows.build(torch.tensor([0, 3]), 4))
    y2, w2 = conv(x[3:4], ConvWindows.build(torch.tensor([0, 1]), 4), w1)
    y3, w3 = conv(x[4:], ConvWindows.build(torch.tensor([0, 6]), 4), w2)
    torch.testing.assert_close(torch.cat([y1, y2, y3]), y_full)
    torch.testing.assert_close(w3, w_full)


def test_route_layout():
    torch.manual_seed(2)
    B, T, E, k = 3, 9, 4, 2
    logits = torch.randn(B, T, E)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[0, :4] = False
    valid[2, 5] = False
    plan = route(logits, k, valid, shared_memory=True)
    probs = logits.softmax(-1)
    top = probs.topk(k, -1)
    M = E + 1
    assert plan.cu_seqlens.numel() == M * B + 1
    assert int(plan.cu_seqlens[-1]) == int(valid.sum()) * (k + 1)
    for m, (start, end) in enumerate(plan.memory_slices()):
        for s in range(m * B, (m + 1) * B):
            lo, hi = int(plan.cu_seqlens[s]), int(plan.cu_seqlens[s + 1])
            assert start <= lo <= hi <= end
            tokens = plan.token_index[lo:hi]
            b = s - m * B
            assert ((tokens // T) == b).all()
            times = tokens % T
            assert (times[1:] > times[:-1]).all(), "a memory's subsequence keeps the original order"
            for t in times.tolist():
                assert valid[b, t]
                if m < E:
                    assert m in top.indices[b, t].tolist()
            expected = [t for t in range(T) if valid[b, t] and (m == E or m in top.indices[b, t].tolist())]
            assert times.tolist() == expected
    # routed weights of a token sum to one; the shared memory has weight 1
    per_token = torch.zeros(B * T).index_add_(0, plan.token_index, plan.weight)
    torch.testing.assert_close(per_token[valid.flatten()], torch.full((int(valid.sum()),), 2.0))
    assert (per_token[~valid.flatten()] == 0).all()


def test_aux_loss_is_switch_balance_over_valid_tokens():
    torch.manual_seed(3)
    logits = torch.randn(2, 6, 4)
    valid = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    plan = route(logits, 2, valid, shared_memory=False)
    probs = logits.softmax(-1)[valid]
    chosen = probs.topk(2, -1).indices
    f = torch.stack([(chosen == m).sum() for m in range(4)]).float() / (chosen.numel())
    P = probs.mean(0)
    torch.testing.assert_close(plan.aux_loss, 4 * (f * P).sum())
    # perfectly uniform routing gives the minimum value 1
    uniform = route(torch.zeros(1, 8, 4), 4, None, shared_memory=False)
    torch.testing.assert_close(uniform.aux_loss, torch.tensor(1.0))


def test_plan_gather_and_combine_equal_index_select_and_index_add():
    """The plan's gather and combine (gathers only, no atomics) in both directions."""
    torch.manual_seed(3)
    B, T, E = 3, 7, 4
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, :3] = False
    plan = route(torch.randn(B, T, E), 2, valid, shared_memory=True)
    x = torch.randn(B * T, 5, dtype=torch.float64, requires_grad=True)
    y = torch.randn(plan.token_index.numel(), 5, dtype=torch.float64, requires_grad=True)
    gathered, combined = plan.gather(x), plan.combine(y)
    torch.testing.assert_close(gathered, x.index_select(0, plan.token_index), rtol=0, atol=0)
    expected = torch.zeros(B * T, 5, dtype=torch.float64).index_add(0, plan.token_index, y)
    torch.testing.assert_close(combined, expected, rtol=0, atol=1e-15)
    assert torch.equal(combined[~valid.flatten()], torch.zeros_like(combined[~valid.flatten()]))
    gx, gy = torch.randn_like(gathered), torch.randn_like(combined)
    (gathered * gx).sum().backward()
    (combined * gy).sum().backward()
    torch.testing.assert_close(x.grad, torch.zeros_like(x).index_add(0, plan.token_index, gx), rtol=0, atol=1e-15)
    torch.testing.assert_close(y.grad, gy.index_select(0, plan.token_index), rtol=0, atol=0)


def test_memory_ends_are_fresh_offsets_of_unit_stride():
    """``torch._grouped_mm`` takes the plan's ``memory_ends`` as offsets, and torch 2.14 rejects any stride
    but 1 ("Offsets must have stride (1,)"); a slice every ``B`` rows of ``cu_seqlens`` had stride ``B``,
    and with one memory (the Gated DeltaNet baseline) ``contiguous()`` keeps it."""
    from mnemo.modeling.routing import RoutingPlan

    for memories, batch in ((1, 4), (3, 2), (2, 1)):
        cu = torch.arange(memories * batch + 1, dtype=torch.int32) * 5
        empty = torch.empty(0)
        plan = RoutingPlan(empty, empty, cu, empty, empty, empty, batch)
        ends = plan.memory_ends
        assert ends.dtype == torch.int32 and ends.stride() == (1,)
        assert ends.tolist() == [5 * batch * (m + 1) for m in range(memories)]
