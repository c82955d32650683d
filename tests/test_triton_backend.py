"""``use_backend("triton")`` across every family and variant: the model runs through its Triton kernels and
equals the PyTorch path (loss and every gradient, forward and backward, on the Triton interpreter here)."""

from __future__ import annotations

import pytest
import torch

from mnemo.kernels import use_backend

from conftest import MODEL_VARIANTS

pytest.importorskip("triton")

# MoM's kernels take chunks of 16, 32 or 64 (the tiny models' chunks are 8).
OVERRIDES = {name: {"chunk_size": 16} for name in MODEL_VARIANTS if name.startswith("mom-")}
VARIANTS = sorted(MODEL_VARIANTS)


def _model(name: str):
    build, overrides = MODEL_VARIANTS[name]
    return build(**{**overrides, **OVERRIDES.get(name, {})}).train()


def _step(model, ids: torch.Tensor, backend: str):
    model.zero_grad()
    with use_backend(backend):
        loss = model(ids, labels=ids).loss
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", VARIANTS)  # most in the slow job (conftest.SLOW_CASES)
def test_every_variant_runs_its_kernels_and_equals_the_torch_path(name):
    model = _model(name)
    ids = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    loss, grads = _step(model, ids, "torch")
    loss_k, grads_k = _step(model, ids, "triton")
    torch.testing.assert_close(loss_k, loss, rtol=1e-5, atol=1e-6)
    assert grads_k.keys() == grads.keys()
    for n, g in grads.items():
        torch.testing.assert_close(grads_k[n], g, rtol=1e-4, atol=1e-5, msg=n)


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


@pytest.mark.parametrize("name", ["deep-hebbian", "deep-dot-window3-gqa"])
def test_deep_transformer_decodes_and_pads_through_the_triton_reads(name, monkeypatch):
    """The DeepTransformer's chunk loop (a state to continue, padded rows, the omega rule) on ``use_backend("triton")``
    reads flash-style in Triton: a left-padded prefill then token-by-token decoding gives the PyTorch path's
    logits, and the full forward's."""
    import mnemo.kernels.deep_attention_triton_read as read

    from conftest import left_pad

    calls = []
    monkeypatch.setattr(read, "masked_read", _counted(read.masked_read, calls, "read"))
    model = _model(name).eval()
    ids, mask = left_pad([torch.randint(1, 97, (n,)) for n in (13, 5, 9)])

    def decode(backend: str) -> torch.Tensor:
        with torch.no_grad(), use_backend(backend):
            out = model(ids[:, :7], attention_mask=mask[:, :7], use_cache=True)
            logits, cache = [out.logits], out.past_key_values
            for t in range(7, ids.shape[1]):
                out = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=cache, use_cache=True)
                logits.append(out.logits)
        return torch.cat(logits, 1)

    want = decode("torch")
    assert not calls
    got = decode("triton")
    assert calls
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.no_grad(), use_backend("triton"):
        full = model(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(full[real], want[real], rtol=1e-4, atol=1e-5)
