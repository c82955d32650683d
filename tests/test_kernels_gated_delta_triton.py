"""Triton path of the gated delta rule == the float64 reference (outputs, states, every gradient).

Without a GPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``,
set in conftest), so the shapes are tiny; tests/test_gpu_triton.py repeats the
comparison at real shapes on CUDA, where code generation can go wrong.
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_mom
from mnemo.kernels import chunk_gated_delta, reference_gated_delta, step_gated_delta, step_gated_delta_, use_backend

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_inputs(B, T, H, K, V, gated=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    k = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    g = -torch.rand(B, T, H, generator=gen, dtype=torch.float64) * 2 if gated else None
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta


def outputs_and_grads(fn, inputs, S0, **kwargs):
    """Outputs, final state and the gradients of every input of a fixed scalar loss."""
    leaves = [None if x is None else x.detach().clone().requires_grad_() for x in (*inputs, S0)]
    o, s = fn(*leaves[:5], initial_state=leaves[5], **kwargs)
    (o.double().sin().sum() + s.double().cos().sum()).backward()
    return o.detach(), s.detach(), [None if x is None else x.grad for x in leaves]


def assert_matches_reference(inputs, S0, cu_seqlens=None, chunk_size=16, atol=2e-5, **kwargs):
    ref = outputs_and_grads(reference_gated_delta, inputs, S0, cu_seqlens=cu_seqlens, **kwargs)
    inputs32 = [None if x is None else x.float().to(DEVICE) for x in inputs]
    S0_32 = None if S0 is None else S0.float().to(DEVICE)
    cu = None if cu_seqlens is None else cu_seqlens.to(DEVICE)
    with use_backend("triton"):
        tri = outputs_and_grads(chunk_gated_delta, inputs32, S0_32, cu_seqlens=cu, chunk_size=chunk_size, **kwargs)
    assert tri[0].dtype == torch.float32 and tri[1].dtype == torch.float32
    torch.testing.assert_close(tri[0].cpu().double(), ref[0], rtol=0, atol=atol, msg="output")
    torch.testing.assert_close(tri[1].cpu().double(), ref[1], rtol=0, atol=atol, msg="final state")
    for name, a, b in zip("q k v g beta S0".split(), tri[2], ref[2]):
        if b is not None:
            scale = max(1.0, b.abs().max().item())
            torch.testing.assert_close(a.cpu().double(), b, rtol=0, atol=atol * 5 * scale, msg=f"gradient of {name}")


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("gated", [True, False])
def test_chunk_equals_reference(chunk_size, gated):
    inputs = make_inputs(2, 37, 2, 8, 12, gated=gated, seed=chunk_size)
    S0 = torch.randn(2, 2, 8, 12, dtype=torch.float64)
    assert_matches_reference(inputs, S0, chunk_size=chunk_size)


@pytest.mark.parametrize("K", [5, 130, 256])
def test_chunk_without_initial_state_and_odd_head_dims(K):
    # Odd sizes are padded to power-of-two tiles; d_k > 64 spreads the state over 2-4 row tiles.
    assert_matches_reference(make_inputs(1, 21, 2, K, 20, seed=3), None)
    assert_matches_reference(make_inputs(1, 19, 1, K, 20, seed=4), torch.randn(1, 1, K, 20, dtype=torch.float64))


@pytest.mark.parametrize("gated", [True, False])
def test_gradients_without_l2_norm(gated):
    q, k, v, g, beta = make_inputs(1, 29, 2, 8, 6, gated=gated, seed=7)
    # keys of norm ~1 keep the unnormalised rule contractive
    assert_matches_reference((q, k * 8**-0.5, v, g, beta), torch.randn(1, 2, 8, 6, dtype=torch.float64),
                             use_qk_l2norm=False, scale=0.4)


def test_varlen_with_empty_sequences_equals_reference():
    lengths = [5, 0, 35, 1, 17, 0]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    inputs = make_inputs(1, int(cu[-1]), 2, 8, 8, seed=1)
    S0 = torch.randn(len(lengths), 2, 8, 8, dtype=torch.float64)
    assert_matches_reference(inputs, S0, cu_seqlens=cu)
    with use_backend("triton"):
        _, s = chunk_gated_delta(*(x.float().to(DEVICE) for x in inputs), initial_state=S0.float().to(DEVICE),
                                 cu_seqlens=cu.to(DEVICE), chunk_size=16)
    assert torch.equal(s[1].cpu(), S0[1].float()), "an empty sequence must return its initial state unchanged"


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_layout_lists_every_chunk_then_unowned_empty_ones(chunk_size):
    """The layout is sized by a bound known on the host (no device read): the real chunks in sequence
    order, then chunks of length 0 that no sequence's offsets reach."""
    from mnemo.kernels.gated_delta import _chunk_layout

    lengths = [5, 0, 35, 1, 17, 0, 64, 65]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    offsets, start, length = _chunk_layout(cu, chunk_size, int(cu[-1]))
    expected = [(int(cu[i]) + j, min(chunk_size, n - j)) for i, n in enumerate(lengths)
                for j in range(0, n, chunk_size)]
    real = int(offsets[-1])
    assert real == len(expected) and offsets.tolist() == [0] + torch.tensor(
        [-(-n // chunk_size) for n in lengths]).cumsum(0).tolist()
    assert list(zip(start[:real].tolist(), length[:real].tolist())) == expected
    assert length.numel() == (int(cu[-1]) + len(lengths) * (chunk_size - 1)) // chunk_size >= real
    assert (length[real:] == 0).all() and (start[real:] == 0).all()


@pytest.mark.parametrize("K", [8, 130])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("l2norm", [True, False])
def test_inference_path_equals_reference(K, gated, l2norm):
    """Without gradients the intra-chunk terms come from their own kernel, read from packed tokens."""
    lengths = [5, 0, 35, 17]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    q, k, v, g, beta = make_inputs(1, int(cu[-1]), 2, K, 12, gated=gated, seed=K)
    if not l2norm:  # keys of norm ~1 keep the unnormalised rule contractive (else it grows like 1e15)
        k = k * K**-0.5
    inputs = (q, k, v, g, beta)
    S0 = torch.randn(len(lengths), 2, K, 12, dtype=torch.float64)
    kwargs = dict(cu_seqlens=cu, use_qk_l2norm=l2norm, scale=0.2)
    o_ref, s_ref = reference_gated_delta(*inputs, initial_state=S0, **kwargs)
    with torch.no_grad(), use_backend("triton"):
        o, s = chunk_gated_delta(*(None if x is None else x.float().to(DEVICE) for x in inputs),
                                 initial_state=S0.float().to(DEVICE), chunk_size=16,
                                 **{**kwargs, "cu_seqlens": cu.to(DEVICE)})
    tol = dict(rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(o.cpu().double(), o_ref, **tol)
    torch.testing.assert_close(s.cpu().double(), s_ref, **tol)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("l2norm", [True, False])
def test_step_equals_reference_step(gated, l2norm):
    q, k, v, g, beta = (None if x is None else x[:, 0] for x in make_inputs(3, 1, 2, 8, 20, gated=gated, seed=4))
    state = torch.randn(3, 2, 8, 20, dtype=torch.float64)
    o_ref, s_ref = step_gated_delta(q, k, v, g, beta, state, use_qk_l2norm=l2norm, scale=0.3)
    with use_backend("triton"):
        o, s = step_gated_delta(*(None if x is None else x.float().to(DEVICE) for x in (q, k, v, g, beta, state)),
                                use_qk_l2norm=l2norm, scale=0.3)
    # float32 rounding of float64 values: unnormalised keys give states of size ~10.
    torch.testing.assert_close(o.cpu().double(), o_ref, rtol=1e-6, atol=2e-6)
    torch.testing.assert_close(s.cpu().double(), s_ref, rtol=1e-6, atol=2e-6)


def test_unsupported_shapes_name_the_reason():
    q, k, v, g, beta = (x.float() for x in make_inputs(1, 4, 1, 4, 4))
    with use_backend("triton"), pytest.raises(NotImplementedError, match="Triton"):
        chunk_gated_delta(q, k, v, g, beta, chunk_size=8)
    # Automatic selection on CPU tensors takes the PyTorch path, whatever the shape.
    chunk_gated_delta(q, k, v, g, beta, chunk_size=8)


def test_mom_model_triton_equals_torch_path():
    """The whole MoM model, left-padded batch and cached generation, on both paths."""
    model = tiny_mom(chunk_size=16).to(DEVICE)
    ids = torch.randint(1, 97, (2, 37), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    with torch.no_grad():
        with use_backend("torch"):
            ref = model(ids, attention_mask=mask).logits
            gen_ref = model.generate(ids[:, :20], attention_mask=mask[:, :20], max_new_tokens=5, do_sample=False)
        with use_backend("triton"):
            out = model(ids, attention_mask=mask).logits
            gen = model.generate(ids[:, :20], attention_mask=mask[:, :20], max_new_tokens=5, do_sample=False)
    valid = mask.bool()
    torch.testing.assert_close(out[valid], ref[valid], rtol=1e-4, atol=1e-5)
    assert torch.equal(gen, gen_ref)


def test_lora_reaches_the_output_and_trains_on_the_triton_path():
    """Fused kernels must not bypass adapter weights: the memories' projections run before the kernel."""
    from peft import LoraConfig, get_peft_model

    base = tiny_mom(chunk_size=16).to(DEVICE)
    ids = torch.randint(1, 97, (2, 40), device=DEVICE)
    with torch.no_grad(), use_backend("triton"):
        reference = base(ids).logits
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8))
    adapted = [n for n, _ in model.named_modules() if n.endswith("lora_A")]
    assert all(any(f".{proj}." in n for n in adapted) for proj in ("q_proj", "k_proj", "v_proj")), adapted
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    model.eval()
    with torch.no_grad():
        with use_backend("triton"):
            tuned = model(ids).logits
        with use_backend("torch"):
            tuned_torch = model(ids).logits
    assert (tuned - reference).abs().max() > 1e-3, "a LoRA delta must reach the output on the Triton path"
    torch.testing.assert_close(tuned, tuned_torch, rtol=1e-4, atol=1e-5)
    with torch.no_grad(), use_backend("triton"):
        merged = model.merge_and_unload()(ids).logits
    torch.testing.assert_close(merged, tuned, rtol=1e-4, atol=1e-5)

    model = get_peft_model(tiny_mom(chunk_size=16).to(DEVICE), LoraConfig(task_type="CAUSAL_LM", r=4)).train()
    with use_backend("triton"):
        model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None for g in grads.values())
    # lora_B starts at zero, so only lora_B receives a gradient on the first step; it must be nonzero
    # for the memories' key projections, whose inputs reach the state only through the kernel.
    assert any(g.abs().sum() > 0 for n, g in grads.items() if "k_proj" in n and "lora_B" in n)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_in_place_routed_step_equals_the_step_on_gathered_states(backend):
    """``step_gated_delta_`` steps ``states[slots]`` where they lie and leaves every other state as it was."""
    q, k, v, g, beta = (x[:, 0].float() for x in make_inputs(3, 1, 2, 8, 20, seed=5))
    states = torch.randn(7, 2, 8, 20, generator=torch.Generator().manual_seed(1))
    slots = torch.tensor([5, 0, 3])
    o_ref, s_ref = step_gated_delta(q, k, v, g, beta, states[slots].clone(), scale=0.3)
    expected = states.clone()
    expected[slots] = s_ref
    moved = [x.to(DEVICE) for x in (q, k, v, g, beta, states, slots)]
    pointer = moved[5].data_ptr()
    with use_backend(backend):
        o = step_gated_delta_(*moved[:6], moved[6], scale=0.3)
    assert moved[5].data_ptr() == pointer
    torch.testing.assert_close(o.cpu(), o_ref, rtol=1e-6, atol=2e-6)
    torch.testing.assert_close(moved[5].cpu(), expected, rtol=1e-6, atol=2e-6)


@pytest.mark.parametrize("chunk_size,K,V", [(16, 64, 32), (64, 130, 20)])
def test_bf16_inputs_within_one_percent_of_the_float64_reference(chunk_size, K, V):
    # The bound for bf16 problems; tests/test_gpu_triton.py repeats it at real shapes.
    q, k, v, g, beta = make_inputs(2, 100, 2, K, V, seed=11)
    S0 = torch.randn(2, 2, K, V, dtype=torch.float64)
    ref = outputs_and_grads(reference_gated_delta, (q, k, v, g, beta), S0)
    low = [x.to(DEVICE, torch.bfloat16) for x in (q, k, v)] + [x.float().to(DEVICE) for x in (g, beta)]
    with use_backend("triton"):
        tri = outputs_and_grads(chunk_gated_delta, low, S0.float().to(DEVICE), chunk_size=chunk_size)
    assert tri[0].dtype == torch.bfloat16
    for name, a, b in zip("o S q k v g beta S0".split(), [tri[0], tri[1], *tri[2]], [ref[0], ref[1], *ref[2]]):
        err = ((a.cpu().double() - b).norm() / b.norm()).item()
        assert err < 1e-2, f"{name}: relative RMS error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_second_backward_recomputes_what_the_first_freed(dtype):
    """The backward frees the saved states and ``D`` once it has used them; a second backward through
    the same graph (``retain_graph=True``) recomputes them and gets the first one's gradients exactly."""
    leaves = [x.to(DEVICE, dtype if i < 3 else torch.float32).requires_grad_()
              for i, x in enumerate(make_inputs(1, 45, 2, 8, 12, seed=9))]
    S0 = torch.randn(1, 2, 8, 12, device=DEVICE, requires_grad=True)
    with use_backend("triton"):
        o, s = chunk_gated_delta(*leaves, initial_state=S0, chunk_size=16)
    loss = o.float().sin().sum() + s.cos().sum()
    first = torch.autograd.grad(loss, [*leaves, S0], retain_graph=True)
    second = torch.autograd.grad(loss, [*leaves, S0])
    for name, a, b in zip("q k v g beta S0".split(), first, second):
        assert torch.equal(a, b), f"gradient of {name} differs on the second backward"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_states_made_again_in_the_backward_give_the_kept_states_gradients(dtype, monkeypatch):
    """By default the forward of training keeps neither the chunks' states nor ``D`` and the backward runs
    the forward's kernels again for them: the gradients are those of keeping them, bit for bit, and the
    outputs agree with the kept path's (which reads them from the kept states, in another order)."""
    from mnemo.kernels import gated_delta_triton

    inputs = [x.to(DEVICE, dtype if i < 3 else torch.float32) for i, x in enumerate(make_inputs(2, 45, 2, 8, 12,
                                                                                                seed=4))]
    S0 = torch.randn(2, 2, 8, 12, device=DEVICE)
    w_o, w_s = torch.randn(2, 45, 2, 12, device=DEVICE), torch.randn_like(S0)
    results = {}
    for keep in (True, False):
        monkeypatch.setattr(gated_delta_triton, "KEEP_CHUNK_STATES", keep)
        leaves = [x.detach().clone().requires_grad_() for x in (*inputs, S0)]
        with use_backend("triton"):
            o, s = chunk_gated_delta(*leaves[:5], initial_state=leaves[5], chunk_size=16)
        # a loss linear in the outputs, so that both backwards start from the same gradients
        ((o.float() * w_o).sum() + (s * w_s).sum()).backward()
        results[keep] = (o.detach(), s.detach(), [x.grad for x in leaves])
    (o_keep, s_keep, g_keep), (o_new, s_new, g_new) = results[True], results[False]
    torch.testing.assert_close(o_new.float(), o_keep.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-2 if dtype == torch.bfloat16 else 1e-5)
    assert torch.equal(s_new, s_keep)
    for name, a, b in zip("q k v g beta S0".split(), g_new, g_keep):
        assert torch.equal(a, b), f"gradient of {name} differs when the states are made again"
