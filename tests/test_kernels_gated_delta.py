"""reference == chunked == step for the gated delta rule (float64 and float32, varlen, states, gradients)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mnemo.kernels import chunk_gated_delta, reference_gated_delta, step_gated_delta, use_backend


def make_inputs(B, T, H, K, V, dtype=torch.float64, gated=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    k = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    g = -torch.rand(B, T, H, generator=gen, dtype=dtype) * 2 if gated else None
    beta = torch.rand(B, T, H, generator=gen, dtype=dtype)
    return q, k, v, g, beta


def run_steps(q, k, v, g, beta, state):
    outs = []
    for t in range(q.shape[1]):
        o, state = step_gated_delta(q[:, t], k[:, t], v[:, t], None if g is None else g[:, t], beta[:, t], state)
        outs.append(o)
    return torch.stack(outs, 1), state


@pytest.mark.parametrize("T", [1, 7, 8, 9, 33])
@pytest.mark.parametrize("chunk_size", [1, 4, 8, 64])
@pytest.mark.parametrize("gated", [True, False])
def test_reference_chunk_step_agree_float64(T, chunk_size, gated):
    q, k, v, g, beta = make_inputs(2, T, 3, 8, 5, gated=gated)
    S0 = torch.randn(2, 3, 8, 5, dtype=torch.float64)
    o_ref, s_ref = reference_gated_delta(q, k, v, g, beta, initial_state=S0)
    o_chk, s_chk = chunk_gated_delta(q, k, v, g, beta, initial_state=S0, chunk_size=chunk_size)
    o_stp, s_stp = run_steps(q, k, v, g, beta, S0)
    torch.testing.assert_close(o_chk, o_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(s_chk, s_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(o_stp, o_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(s_stp, s_ref, rtol=0, atol=1e-10)


def test_float32_chunk_matches_float64_reference():
    q, k, v, g, beta = make_inputs(2, 100, 2, 16, 16)
    o_ref, s_ref = reference_gated_delta(q, k, v, g, beta)
    o, s = chunk_gated_delta(*(x.float() for x in (q, k, v, g, beta)), chunk_size=32)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    torch.testing.assert_close(o.double(), o_ref, rtol=0, atol=2e-5)
    torch.testing.assert_close(s.double(), s_ref, rtol=0, atol=2e-5)


def test_strong_decay_is_stable():
    # Large negative log-decays would overflow a naive exp(-G) factorisation.
    q, k, v, _, beta = make_inputs(1, 64, 2, 8, 8, dtype=torch.float32)
    g = torch.full((1, 64, 2), -30.0)
    o, s = chunk_gated_delta(q, k, v, g, beta, chunk_size=64)
    o_ref, s_ref = reference_gated_delta(q, k, v, g, beta)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-5)


def test_varlen_equals_separate_sequences():
    lengths = [5, 0, 17, 1, 9]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    total = int(cu[-1])
    q, k, v, g, beta = make_inputs(1, total, 2, 4, 6)
    S0 = torch.randn(len(lengths), 2, 4, 6, dtype=torch.float64)
    o, s = chunk_gated_delta(q, k, v, g, beta, initial_state=S0, cu_seqlens=cu, chunk_size=4)
    o_ref, s_ref = reference_gated_delta(q, k, v, g, beta, initial_state=S0, cu_seqlens=cu)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=1e-10)
    for i, n in enumerate(lengths):
        sl = slice(int(cu[i]), int(cu[i + 1]))
        o_i, s_i = reference_gated_delta(*(x[:, sl] for x in (q, k, v, g, beta)), initial_state=S0[i : i + 1])
        torch.testing.assert_close(o[:, sl], o_i, rtol=0, atol=1e-10)
        torch.testing.assert_close(s[i], s_i[0], rtol=0, atol=1e-10)
    assert torch.equal(s[1], S0[1]), "an empty sequence must return its initial state unchanged"


def test_noop_tokens_leave_state_exactly_unchanged():
    q, k, v, g, beta = make_inputs(1, 12, 2, 4, 4)
    g[:, 3:9] = 0.0
    beta[:, 3:9] = 0.0
    _, s_all = chunk_gated_delta(q, k, v, g, beta, chunk_size=4)
    keep = [0, 1, 2, 9, 10, 11]
    _, s_kept = reference_gated_delta(*(x[:, keep] for x in (q, k, v, g, beta)))
    torch.testing.assert_close(s_all, s_kept, rtol=0, atol=1e-12)
    state = torch.randn(1, 2, 4, 4, dtype=torch.float64)
    _, same = step_gated_delta(q[:, 4], k[:, 4], v[:, 4], g[:, 4], beta[:, 4], state)
    assert torch.equal(same, state)


def test_gradients_match_reference():
    inputs = make_inputs(2, 11, 2, 4, 3)
    S0 = torch.randn(2, 2, 4, 3, dtype=torch.float64)
    grads = []
    for fn in (reference_gated_delta, lambda *a, **kw: chunk_gated_delta(*a, chunk_size=4, **kw)):
        leaves = [x.clone().requires_grad_() for x in (*inputs, S0)]
        o, s = fn(*leaves[:5], initial_state=leaves[5])
        (o.sin().sum() + s.cos().sum()).backward()
        grads.append([x.grad for x in leaves])
    for name, a, b in zip("q k v g beta S0".split(), *grads):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-9, msg=f"gradient of {name}")


def test_gradcheck_chunk():
    q, k, v, g, beta = (x.requires_grad_() for x in make_inputs(1, 6, 1, 3, 2))
    assert torch.autograd.gradcheck(
        lambda *xs: chunk_gated_delta(*xs, chunk_size=4)[0], (q, k, v, g, beta), eps=1e-6, atol=1e-6
    )


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(1, 3), T=st.integers(1, 40), H=st.integers(1, 3), K=st.sampled_from([1, 4, 8]),
    V=st.sampled_from([1, 3, 8]), C=st.sampled_from([1, 2, 5, 16, 64]), seed=st.integers(0, 10**6),
)
def test_fuzz_chunk_equals_reference(B, T, H, K, V, C, seed):
    q, k, v, g, beta = make_inputs(B, T, H, K, V, seed=seed)
    o_ref, s_ref = reference_gated_delta(q, k, v, g, beta)
    o, s = chunk_gated_delta(q, k, v, g, beta, chunk_size=C)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-9)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=1e-9)


def test_shape_errors_are_clear():
    q, k, v, g, beta = make_inputs(2, 5, 2, 4, 4)
    with pytest.raises(ValueError, match="initial_state"):
        chunk_gated_delta(q, k, v, g, beta, initial_state=torch.zeros(3, 2, 4, 4))
    with pytest.raises(ValueError, match="batch of size 1"):
        chunk_gated_delta(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_gated_delta(q, k, v, g, beta, chunk_size=0)


def test_backend_selection(monkeypatch):
    q, k, v, g, beta = make_inputs(1, 4, 1, 2, 2)
    with use_backend("torch"):
        chunk_gated_delta(q, k, v, g, beta)
    with pytest.raises(ValueError, match="unknown backend"):
        with use_backend("cuda"):
            pass
    monkeypatch.setenv("MNEMO_BACKEND", "nope")
    with pytest.raises(ValueError, match="unknown backend"):
        chunk_gated_delta(q, k, v, g, beta)
