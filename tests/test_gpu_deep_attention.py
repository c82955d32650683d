"""The Hebbian DeepTransformer's whole-row path on CUDA (Triton key-pass kernels, SDPA reads) at
real shapes against the general chunk loop; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from mnemo.kernels import deep_attention
from mnemo.kernels.deep_attention import _chunk_torch, chunk_deep_attention

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

B, T, H, D, HID, C = 2, 1024, 4, 64, 64, 64


def _inputs(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    q, k, v = r(B, T, H, D), r(B, T, H, D), r(B, T, H, D)
    eta = torch.rand(B, T, H, generator=gen, device="cuda")
    w1 = r(H, D, HID) * 0.02
    return [x.to(dtype).requires_grad_() for x in (q, k, v)] + [eta.requires_grad_(), w1.requires_grad_()]


def _run(fn, inputs):
    out = fn(inputs)
    grads = torch.autograd.grad(out.float().pow(2).sum(), inputs)
    return out.detach().float(), [g.float() for g in grads]


def _relative(a, b):
    return float((a - b).norm() / b.norm())  # callers pass detached tensors


def _errors(fn, inputs, want, want_grads):
    out, grads = _run(fn, inputs)
    errors = {"o": _relative(out, want)}
    errors.update({name: _relative(a, b) for name, a, b in zip("q k v eta w1".split(), grads, want_grads)})
    return errors


@pytest.mark.parametrize("key_pass", ["sdpa", "wavefront", "wavefront_groups_of_4"])
@pytest.mark.parametrize("clip", [10.0, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_rows_equal_the_chunk_loop(dtype, clip, key_pass, monkeypatch):
    """Outputs and every gradient, relative to their norm, against the float32 chunk loop: float32 to
    1e-5. bf16 (inputs in bf16, and float32 inputs under bf16 autocast): no more than twice the bf16
    chunk loop's own error (under autocast), or 1e-2. The clip's gradient cancels: at clip 0.5 the
    bf16 ``W_1`` gradient is off by a few percent on either path. ``wavefront``: the key pass in the
    Triton wavefront kernels, which automatic selection takes on CUDA (here its 16 chunks are one
    group); ``wavefront_groups_of_4``: the same in four groups, through the bulk launches and the
    second stream; ``sdpa``: SDPA reads chunk by chunk with the Triton chunk updates, the path for
    shapes the wavefront does not take."""
    from mnemo.kernels import deep_attention_triton_key_pass

    opts = dict(memory_depth=2, learning_rule="hebbian", chunk_size=C, grad_clip=clip)
    if key_pass == "wavefront_groups_of_4":
        monkeypatch.setattr(deep_attention_triton_key_pass, "_GROUP", 4)
        key_pass = "wavefront"
    inputs = _inputs(dtype)
    wanted = deep_attention.triton_key_pass_wanted
    taken = []
    monkeypatch.setattr(deep_attention, "triton_key_pass_wanted",
                        lambda *args: taken.append(key_pass == "wavefront" and wanted(*args)) or taken[-1])

    def fast(x):
        return chunk_deep_attention(x[0], x[1], x[2], x[3], None, x[4], **opts)[0]

    loop = lambda x: _chunk_torch(x[0], x[1], x[2], x[3], None, x[4], None, None, 2, "hebbian", 1,  # noqa: E731
                                  C, True, D ** -0.5, clip)[0]
    exact = [x.detach().float().requires_grad_() for x in inputs]
    want, want_grads = _run(loop, exact)
    errors = _errors(fast, inputs, want, want_grads)
    assert taken and all(t == (key_pass == "wavefront") for t in taken), taken
    print(dtype, clip, "whole rows", errors)
    if dtype == torch.float32:
        assert max(errors.values()) < 1e-5, errors
        return
    with torch.autocast("cuda", dtype=torch.bfloat16):
        baseline = _errors(loop, exact, want, want_grads)
        autocast = _errors(fast, exact, want, want_grads)
    print(dtype, clip, "chunk loop", baseline, "whole rows under autocast", autocast)
    for name, base in baseline.items():
        bound = max(2 * base, 1e-2)
        assert errors[name] < bound and autocast[name] < bound, (name, errors[name], autocast[name], base)
