"""One token's gated read of cached MLP memories in one Triton launch
(:func:`mnemo.kernels.mc_mlp_read_triton.cached_mlp_read_triton`), against the PyTorch read of the same memories:
the kernel alone, :func:`~mnemo.kernels.memory_caching.mc_read`, and MC-Titans' and MC-Atlas' decode steps.
Triton's interpreter on the CPU, tiny shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mnemo.kernels import memory_caching, use_backend
from mnemo.kernels.memory_caching import mc_read
from mnemo.kernels.mlp_memory import MLPMemorySpec, static_apply

from conftest import tiny_atlas, tiny_mc_titans

pytest.importorskip("triton")
from mnemo.kernels.mc_mlp_read_triton import cached_mlp_read_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _one_token_read(monkeypatch):
    """The reads under test are taken where asked (:data:`~mnemo.kernels.memory_caching.ONE_TOKEN_READ`)."""
    monkeypatch.setattr(memory_caching, "ONE_TOKEN_READ", True)


def _memories(B: int, N: int, H: int, d: int, hidden: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, d, generator=gen)
    w1 = torch.randn(B, N, H, d, hidden, generator=gen) * 0.3
    w2 = torch.randn(B, N, H, hidden, d, generator=gen) * 0.3
    gates = torch.rand(B, H, N, generator=gen)
    return q, gates, w1, w2


def _reference(q, gates, w1, w2) -> torch.Tensor:
    """``sum_n g_n (q + W1_n gelu(W2_n q))`` in float64, memory by memory."""
    q, gates, w1, w2 = (x.detach().cpu().double() for x in (q, gates, w1, w2))
    out = torch.zeros_like(q)
    for n in range(w1.shape[1]):
        hidden = F.gelu(torch.einsum("bhfd,bhd->bhf", w2[:, n], q))
        out += gates[..., n, None] * (q + torch.einsum("bhdf,bhf->bhd", w1[:, n], hidden))
    return out


@pytest.mark.parametrize("d, hidden, share", [(16, 64, 1), (16, 64, 2), (24, 48, 3), (8, 16, 5), (32, 96, 4)])
def test_the_read_equals_the_memories_read_one_by_one(d, hidden, share):
    q, gates, w1, w2 = _memories(2, 5, 3, d, hidden)
    gates[0, 1, 2] = 0.0
    gates[1, :, 4] = 0.0
    to = lambda x: x.to(DEVICE)  # noqa: E731
    got = cached_mlp_read_triton(to(q), to(gates), to(w1), to(w2), shares=share)
    want = _reference(q, gates, w1, w2)
    assert got.shape == q.shape and got.dtype == torch.float32
    assert ((got.cpu().double() - want).abs().max() / want.abs().max()).item() < 1e-5


def test_slots_whose_gate_is_zero_are_not_read():
    q, gates, w1, w2 = _memories(1, 4, 2, 16, 32, seed=1)
    gates[:, :, 1] = 0.0
    gates[0, 0, 3] = 0.0
    poisoned_w1, poisoned_w2 = w1.clone(), w2.clone()
    poisoned_w1[:, 1] = float("nan")
    poisoned_w2[0, 3, 0] = float("nan")
    got = cached_mlp_read_triton(*(x.to(DEVICE) for x in (q, gates, poisoned_w1, poisoned_w2)), shares=2)
    clean = cached_mlp_read_triton(*(x.to(DEVICE) for x in (q, gates, w1, w2)), shares=2)
    torch.testing.assert_close(got, clean, rtol=0, atol=0)
    # a slot with a gate is read: another memory there gives another read
    w1[0, 2, 1] += 1.0
    moved = cached_mlp_read_triton(*(x.to(DEVICE) for x in (q, gates, w1, w2)), shares=2)
    assert (moved.cpu()[0, 1] - got.cpu()[0, 1]).abs().max() > 1e-3


@pytest.mark.parametrize("shares, exact", [(2, 5), (3, 1), (4, 2), (4, 6)])
def test_slots_ahead_of_need_leave_the_read_bit_for_bit(shares, exact):
    """A captured decode step's cache holds slots ahead of need (zero gates): its read is the eager step's, to
    the bit, and it takes the first slots of a larger stack where they lie. Three blocks of hidden units."""
    q, gates, w1, w2 = (x.to(DEVICE) for x in _memories(2, 11, 2, 16, 96, seed=2))
    gates[..., exact:] = 0.0
    want = cached_mlp_read_triton(q, gates[..., :exact], w1[:, :exact].contiguous(), w2[:, :exact].contiguous(),
                                  shares=shares)
    for n in (exact + 1, 9, 11):
        got = cached_mlp_read_triton(q, gates[..., :n], w1[:, :n], w2[:, :n], shares=shares)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    reference = _reference(q, gates[..., :exact], w1[:, :exact], w2[:, :exact])
    assert (want.cpu().double() - reference).abs().max().item() < 1e-5 * reference.abs().max().item()


def test_inputs_of_the_wrong_shape_are_named():
    q, gates, w1, w2 = _memories(1, 3, 2, 16, 32)
    with pytest.raises(ValueError, match="gates must be"):
        cached_mlp_read_triton(q, gates[..., :2], w1, w2)
    with pytest.raises(ValueError, match="w2 must be"):
        cached_mlp_read_triton(q, gates, w1, w2[:, :, :, :16])


def _mc_read_inputs(aggregation: str, seed: int = 0):
    spec = MLPMemorySpec(depth=2, d_k=16, d_v=16, expansion=2)
    gen = torch.Generator().manual_seed(seed)
    B, H, N, d = 2, 2, 4, 16
    q = F.normalize(torch.randn(B, H, 1, d, generator=gen), dim=-1)
    u = torch.randn(B, H, 1, d, generator=gen)
    online = {"w1": torch.randn(B, H, d, 2 * d, generator=gen) * 0.3, "w2": torch.randn(B, H, 2 * d, d, generator=gen) * 0.3}
    cached = {"w1": torch.randn(B, N, H, d, 2 * d, generator=gen) * 0.3,
              "w2": torch.randn(B, N, H, 2 * d, d, generator=gen) * 0.3}
    summary = F.normalize(torch.randn(B, N, H, d, generator=gen), dim=-1)
    online_summary = F.normalize(torch.randn(B, H, 1, d, generator=gen), dim=-1)
    valid = torch.tensor([[True, True, True, False], [True, True, False, False]])
    q, u, online_summary, summary, valid = (x.to(DEVICE) for x in (q, u, online_summary, summary, valid))
    online, cached = ({n: w.to(DEVICE) for n, w in ws.items()} for ws in (online, cached))
    return spec, aggregation, 1, q, u, static_apply(online), online_summary, cached, summary, valid


@pytest.mark.parametrize("aggregation", ["grm", "ssc", "mean", "residual"])
def test_mc_read_of_one_token_takes_one_launch_and_equals_the_torch_read(aggregation, monkeypatch):
    calls = []
    kernel = memory_caching.cached_mlp_read_triton
    monkeypatch.setattr(memory_caching, "cached_mlp_read_triton", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    inputs = _mc_read_inputs(aggregation)
    with use_backend("torch"):
        want = mc_read(*inputs)
    with use_backend("triton"):
        got = mc_read(*inputs)
    assert calls == [1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(memory_caching, "ONE_TOKEN_READ", False)
    with use_backend("triton"):
        mc_read(*inputs)
    assert calls == [1]


@pytest.mark.parametrize("case", ["two tokens", "bf16", "autocast", "recomputed in the backward"])
def test_reads_the_kernel_does_not_compute_keep_the_batched_products(case, monkeypatch):
    """Several tokens a row, memories in another dtype, products autocast rounds, and a read whose first pass
    runs with grad mode off inside :func:`~mnemo.kernels.chunk_loop.recompute_in_backward`."""
    from mnemo.kernels.chunk_loop import recompute_in_backward

    monkeypatch.setattr(memory_caching, "cached_mlp_read_triton", lambda *a, **k: pytest.fail("not the kernel's"))
    spec, aggregation, topk, q, u, online, online_summary, cached, summary, valid = _mc_read_inputs("grm")
    with use_backend("triton"):
        if case == "two tokens":
            mc_read(spec, aggregation, topk, q.expand(-1, -1, 2, -1), u.expand(-1, -1, 2, -1), online,
                    online_summary.expand(-1, -1, 2, -1), cached, summary, valid)
        elif case == "bf16":
            mc_read(spec, aggregation, topk, q, u, online, online_summary, {n: w.bfloat16() for n, w in cached.items()},
                    summary, valid)
        elif case == "autocast":
            with torch.autocast(q.device.type, dtype=torch.bfloat16):
                mc_read(spec, aggregation, topk, q, u, online, online_summary, cached, summary, valid)
        else:
            q = q.clone().requires_grad_()
            y = recompute_in_backward(lambda q_: mc_read(spec, aggregation, topk, q_, u, online, online_summary,
                                                         cached, summary, valid), (q,))
            y.sum().backward()
            assert q.grad is not None and torch.isfinite(q.grad).all()


def test_a_read_that_records_gradients_keeps_the_batched_products(monkeypatch):
    monkeypatch.setattr(memory_caching, "cached_mlp_read_triton", lambda *a, **k: pytest.fail("the kernel has no backward"))
    inputs = list(_mc_read_inputs("grm"))
    q = inputs[3].clone().requires_grad_()
    inputs[3] = q
    with use_backend("triton"):
        mc_read(*inputs).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def _decode_logits(model, ids: torch.Tensor, steps: int, backend: str) -> torch.Tensor:
    """Logits of ``steps`` greedy one-token steps on ``backend`` after a prefill of ``ids`` on the PyTorch path
    (the same cache for either backend's steps)."""
    logits = []
    with torch.no_grad():
        with use_backend("torch"):
            out = model(ids, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        with use_backend(backend):
            for _ in range(steps):
                out = model(token, past_key_values=out.past_key_values, use_cache=True)
                logits.append(out.logits[:, -1])
                token = out.logits[:, -1:].argmax(-1)
    return torch.stack(logits, 1)


@pytest.mark.parametrize("build, overrides", [
    (tiny_mc_titans, {}),
    (tiny_mc_titans, {"aggregation": "ssc", "ssc_topk": 1}),
    (tiny_mc_titans, {"aggregation": "residual"}),
    (tiny_mc_titans, {"aggregation": "mean", "cache_mode": "independent"}),
    (tiny_atlas, {"preset": "omeganet", "segment_size": 5, "aggregation": "grm"}),
], ids=["mc-titans-grm", "mc-titans-ssc", "mc-titans-residual", "mc-titans-independent-mean", "mc-atlas-grm"])
def test_decode_steps_read_their_cached_memories_in_one_launch(build, overrides, monkeypatch):
    calls = []
    kernel = memory_caching.cached_mlp_read_triton
    monkeypatch.setattr(memory_caching, "cached_mlp_read_triton", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    model = build(**overrides).to(DEVICE)
    ids = torch.randint(1, 97, (2, 13), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    want = _decode_logits(model, ids, 6, "torch")  # across a segment end (18, or 15 for MC-Atlas)
    assert not calls
    got = _decode_logits(model, ids, 6, "triton")
    assert len(calls) >= 6 * model.config.num_hidden_layers  # every layer's read at every step
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
