"""Triton kernels on CUDA at the shapes we ship, against float64 references; skipped without CUDA.

What the interpreter cannot see (code generation, tensor-core precision) is checked
here: MoM's head size (4 heads x 256), routed subsequences of uneven lengths, every
chunk size the Triton path accepts, float32 and bf16, all gradients.
"""

from __future__ import annotations

import pytest
import torch

from mnemo import MoMConfig, MoMForCausalLM
from mnemo.kernels import chunk_gated_delta, step_gated_delta, use_backend

from conftest import assert_graphed_decoding_equals_eager

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

H, K, V = 4, 256, 256


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def routed_inputs(lengths, dtype, seed=0):
    """A packed batch shaped like one MoM layer's routed subsequences."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device="cuda")
    total = int(cu[-1])

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    q, k, v = randn(1, total, H, K).to(dtype), randn(1, total, H, K).to(dtype), randn(1, total, H, V).to(dtype)
    # MoM's decay and write strength: g = -A softplus(a + dt_bias) (mostly slow decays), beta = sigmoid.
    g = -torch.nn.functional.softplus(randn(1, total, H) - 4) * 2
    beta = torch.sigmoid(randn(1, total, H))
    S0 = randn(len(lengths), H, K, V) * 0.1
    return (q, k, v, g, beta), S0, cu


def run(backend, inputs, S0, cu, chunk_size, cast=None):
    leaves = [(x if cast is None else x.to(cast)).detach().clone().requires_grad_() for x in (*inputs, S0)]
    with use_backend(backend):
        o, s = chunk_gated_delta(*leaves[:5], initial_state=leaves[5], cu_seqlens=cu, chunk_size=chunk_size)
    gen = torch.Generator(device="cuda").manual_seed(1)
    do = torch.randn(o.shape, generator=gen, device="cuda")
    ds = torch.randn(s.shape, generator=gen, device="cuda")
    ((o.double() * do).sum() + (s.double() * ds).sum()).backward()
    return [o.detach(), s.detach()] + [x.grad for x in leaves]


NAMES = ["output", "final state", "dq", "dk", "dv", "dg", "dbeta", "dS0"]


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_float32_equals_float64_torch_path(chunk_size):
    inputs, S0, cu = routed_inputs([700, 0, 1, 1300, 64, 333], torch.float32, seed=chunk_size)
    ref = run("torch", inputs, S0, cu, chunk_size, cast=torch.float64)
    tri = run("triton", inputs, S0, cu, chunk_size)
    for name, a, b in zip(NAMES, tri, ref):
        assert rel_rms(a, b) < 1e-4, f"{name}: relative RMS error {rel_rms(a, b):.2e}"


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_bf16_within_one_percent(chunk_size):
    inputs, S0, cu = routed_inputs([2048, 900, 1500, 17], torch.bfloat16, seed=10 + chunk_size)
    ref = run("torch", inputs, S0, cu, chunk_size, cast=torch.float64)
    tri = run("triton", inputs, S0, cu, chunk_size)
    assert tri[0].dtype == torch.bfloat16
    errors = {name: rel_rms(a, b) for name, a, b in zip(NAMES, tri, ref)}
    print(f"bf16, chunk {chunk_size}: " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()))
    for name, error in errors.items():
        assert error < 1e-2, f"{name}: relative RMS error {error:.2e}"


def test_long_sequence_state_stays_accurate_in_bf16():
    inputs, S0, cu = routed_inputs([65536], torch.bfloat16, seed=3)
    with torch.no_grad():
        with use_backend("torch"):
            ref = chunk_gated_delta(*(x.double() for x in inputs), initial_state=S0.double(), cu_seqlens=cu)
        with use_backend("triton"):
            tri = chunk_gated_delta(*inputs, initial_state=S0, cu_seqlens=cu)
    assert rel_rms(tri[1], ref[1]) < 1e-2
    assert rel_rms(tri[0], ref[0]) < 1e-2


def test_chunked_form_makes_no_device_to_host_read():
    """The chunk layout is sized on the host: a read would stall the GPU before every recurrence."""
    inputs, S0, cu = routed_inputs([700, 0, 1300, 64, 2048], torch.bfloat16)
    leaves = [x.detach().clone().requires_grad_() for x in (*inputs, S0)]
    with use_backend("triton"):
        chunk_gated_delta(*leaves[:5], initial_state=leaves[5], cu_seqlens=cu)  # compiled outside the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            o, s = chunk_gated_delta(*leaves[:5], initial_state=leaves[5], cu_seqlens=cu)
            (o.float().sum() + s.sum()).backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)


def test_mom_layer_trains_without_a_device_to_host_read():
    """Routing, projections and recurrence stay on the device: a host read mid-forward made the host wait for
    the GPU and the GPU then wait for every launch after it."""
    from mnemo.modeling.mom_layer import MoMLayer

    config = MoMConfig(hidden_size=256, num_heads=2, head_dim=128, num_memories=4, topk=2, shared_memory=True)
    layer = MoMLayer(config, 0).cuda().bfloat16()
    x = torch.randn(2, 300, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with use_backend("triton"):
        layer(x)[0].float().sum().backward()  # compiled outside the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            layer(x)[0].float().sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)


def test_step_equals_torch_step():
    (q, k, v, g, beta), S0, _ = routed_inputs([1] * 48, torch.bfloat16, seed=5)
    args = (q[0], k[0], v[0], g[0], beta[0], S0)
    with use_backend("torch"):
        o_ref, s_ref = step_gated_delta(*(x.double() for x in args))
    with use_backend("triton"):
        o, s = step_gated_delta(*args)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    # the output is rounded to bf16 (relative RMS ~1e-3); the float32 state only by float32 arithmetic
    assert rel_rms(o, o_ref) < 4e-3 and rel_rms(s, s_ref) < 1e-6


def mom(**overrides):
    torch.manual_seed(0)
    kwargs = dict(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_heads=2, head_dim=128,
                  num_memories=4, topk=2, intermediate_size=512, chunk_size=64)
    config = MoMConfig(**{**kwargs, **overrides})
    return MoMForCausalLM(config).cuda().eval()


@pytest.mark.parametrize("overrides", [{}, {"segment_size": 96}], ids=["mom", "mom-memory-caching"])
def test_model_triton_equals_torch_path(overrides):
    model = mom(**overrides)
    ids = torch.randint(1, 512, (3, 300), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :40] = 0
    with torch.no_grad():
        with use_backend("torch"):
            ref = model(ids, attention_mask=mask).logits
            gen_ref = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
        with use_backend("triton"):
            out = model(ids, attention_mask=mask).logits
            gen = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    valid = mask.bool()
    torch.testing.assert_close(out[valid], ref[valid], rtol=1e-3, atol=1e-4)
    assert torch.equal(gen, gen_ref)


def test_long_prompt_prefill_and_decode_match_torch_path():
    model = mom()
    ids = torch.randint(1, 512, (1, 65536), device="cuda")
    tokens = {}
    with torch.no_grad():
        for backend in ("torch", "triton"):
            with use_backend(backend):
                tokens[backend] = model.generate(ids, max_new_tokens=32, do_sample=False)[0, -32:]
    assert torch.equal(tokens["triton"], tokens["torch"])


SINGLE_MEMORY = {"num_memories": 1, "topk": 1, "shared_memory": False}  # a Gated DeltaNet


@pytest.mark.parametrize("overrides", [{}, SINGLE_MEMORY], ids=["mom", "single-memory"])
def test_bf16_training_step_is_finite(overrides):
    model = mom(**overrides).train()
    ids = torch.randint(1, 512, (4, 512), device="cuda")
    with use_backend("triton"), torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_single_memory_path_equals_the_routed_path_under_bf16_autocast(monkeypatch):
    """The Gated DeltaNet's path without routing (bf16 block norms shared by the projections, keys and
    values made again in the backward by the Triton convolution) against the routed path on the same
    weights, both under bf16 autocast: the loss and every gradient within bf16 rounding."""
    from mnemo.modeling.mom_layer import MoMLayer

    model = mom(**SINGLE_MEMORY).train()
    ids = torch.randint(1, 512, (4, 512), device="cuda")

    def step():
        model.zero_grad()
        with use_backend("triton"), torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    single = step()
    monkeypatch.setattr(MoMLayer, "forward", lambda self, h, mask=None, cache=None: self._packed_forward(h, mask, cache))
    routed = step()
    torch.testing.assert_close(single[0], routed[0], rtol=1e-3, atol=0)
    assert single[1].keys() == routed[1].keys()
    flat = [torch.cat([g[n].flatten().float() for n in sorted(routed[1])]) for g in (single[1], routed[1])]
    assert rel_rms(flat[0], flat[1]) < 2e-2


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_graph_decoding_equals_eager_decoding(backend, dtype):
    """``generate(cuda_graph=True)`` captures the step (a real CUDA graph here) and gives eager's tokens."""
    ids = torch.randint(1, 512, (3, 200), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :40] = 0
    with use_backend(backend):
        assert_graphed_decoding_equals_eager(mom().to(dtype), ids, mask, new_tokens=24, steps=8)
