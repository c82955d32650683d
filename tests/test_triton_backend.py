"""``use_backend("triton")`` across every family and variant: where a variant has Triton kernels the model
runs through them and equals the PyTorch path (loss and every gradient, forward and backward, on the Triton
interpreter here); where it has none, the request fails and names what lacks them."""

from __future__ import annotations

import pytest
import torch

from mnemo.kernels import use_backend

from conftest import MODEL_VARIANTS

pytest.importorskip("triton")

# What each variant without Triton kernels is told it lacks.
NO_KERNELS = {
    "deep-dot-window3-gqa": "omega or delta rule",
}
# MoM's kernels take chunks of 16, 32 or 64 (the tiny models' chunks are 8).
OVERRIDES = {name: {"chunk_size": 16} for name in MODEL_VARIANTS if name.startswith("mom-")}
WITH_KERNELS = sorted(set(MODEL_VARIANTS) - set(NO_KERNELS))


def _model(name: str):
    build, overrides = MODEL_VARIANTS[name]
    return build(**{**overrides, **OVERRIDES.get(name, {})}).train()


def _step(model, ids: torch.Tensor, backend: str):
    model.zero_grad()
    with use_backend(backend):
        loss = model(ids, labels=ids).loss
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", WITH_KERNELS)  # most in the slow job (conftest.SLOW_CASES)
def test_variants_with_kernels_run_them_and_equal_the_torch_path(name):
    model = _model(name)
    ids = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    loss, grads = _step(model, ids, "torch")
    loss_k, grads_k = _step(model, ids, "triton")
    torch.testing.assert_close(loss_k, loss, rtol=1e-5, atol=1e-6)
    assert grads_k.keys() == grads.keys()
    for n, g in grads.items():
        torch.testing.assert_close(grads_k[n], g, rtol=1e-4, atol=1e-5, msg=n)


@pytest.mark.parametrize("name", sorted(NO_KERNELS))
def test_variants_without_kernels_name_what_lacks_them(name):
    model = _model(name)
    ids = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    # a training step: a layer that recomputes its memory in the backward meets its steps' kernels there
    with use_backend("triton"), pytest.raises(NotImplementedError, match=NO_KERNELS[name]):
        model(ids, labels=ids).loss.backward()
    model(ids, labels=ids).loss.backward()  # the automatic choice runs them on the PyTorch path


@pytest.mark.parametrize("build,overrides", [
    ("mc", {"memory_gated": True}),
    ("mc", {"memory_gated": True, "segment_size": None}),
    ("atlas", {"preset": "atlas++", "inner_optimizer": "momentum"}),
], ids=["mc-grm-gated", "titans-gated", "atlas++-momentum"])
def test_gated_memories_run_the_chunk_kernels_and_equal_the_torch_path(build, overrides, monkeypatch):
    """Gated MLP memories ``z + W1 (gelu(W2 z) * W3 z)`` in chunks: on ``use_backend("triton")`` each chunk is the
    hand-written chunk (:func:`~mnemo.kernels.titans_chunk.chunk_memory`) with its weight-sized update in Triton,
    and the loss and every gradient equal the PyTorch path, which runs the same hand-written chunk, and autograd
    over the chunk operator (the readable definition)."""
    import mnemo.kernels.titans_chunk as titans_chunk
    import mnemo.kernels.titans_triton_update as update
    from mnemo.kernels.backend import comparison_paths

    from conftest import tiny_atlas, tiny_mc_titans

    calls = []
    monkeypatch.setattr(update, "final_update", _counted(update.final_update, calls, "forward"))
    monkeypatch.setattr(update, "final_update_backward", _counted(update.final_update_backward, calls, "backward"))
    chunks = []
    monkeypatch.setattr(titans_chunk._ChunkMemory, "apply", _counted(titans_chunk._ChunkMemory.apply, chunks, "chunk"))
    model = (tiny_mc_titans if build == "mc" else tiny_atlas)(**overrides).train()
    assert any(n.endswith("w3") for n, _ in model.named_parameters())
    ids = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    with comparison_paths(chunk_backward="autograd"):
        loss_op, grads_op = _step(model, ids, "torch")
    assert not calls and not chunks
    loss, grads = _step(model, ids, "torch")
    assert not calls and chunks  # the PyTorch path runs the same chunks, with PyTorch's update
    chunks.clear()
    loss_k, grads_k = _step(model, ids, "triton")
    assert chunks and "forward" in calls and "backward" in calls
    for got_loss, got_grads in ((loss_k, grads_k), (loss, grads)):
        torch.testing.assert_close(got_loss, loss_op, rtol=1e-5, atol=1e-6)
        assert got_grads.keys() <= grads_op.keys()  # autograd gives the unused gate projection zeros
        for n, g in grads_op.items():
            torch.testing.assert_close(got_grads.get(n, torch.zeros_like(g)), g, rtol=1e-4, atol=1e-5, msg=n)


def _counted(fn, calls: list, label: str):
    def wrapped(*args, **kwargs):
        calls.append(label)
        return fn(*args, **kwargs)

    return wrapped
