"""The Hebbian DeepTransformer's whole-row path on CUDA (Triton key-pass kernels, SDPA reads) at
real shapes against the general chunk loop; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from mnemo.kernels import deep_attention
from mnemo.kernels.deep_attention import _chunk_loop, chunk_deep_attention

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

    loop = lambda x: _chunk_loop(x[0], x[1], x[2], x[3], None, x[4], None, None, 2, "hebbian", 1,  # noqa: E731
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


def _relative_errors(got, want):
    return [_relative(a.detach().double(), b.detach()) for a, b in zip(got, want)]


@pytest.mark.parametrize("precision", ["float32", "tf32x3", "float64"])
@pytest.mark.parametrize("normalize", [True, False], ids=["softmax", "exp"])
@pytest.mark.parametrize("widths", [(64,), (64, 64), (64, 256)], ids=["one", "two", "wide"])
def test_masked_read_at_the_chunk_loops_shapes(normalize, widths, precision, monkeypatch):
    """The flash-style reads of the chunk loop against float64 weights formed in PyTorch: a chunk of 64
    queries and a window of 15 over 4,096 keys, spans that start inside a block, a query that sees nothing,
    a scale that float32 rounds (0.3); outputs, log-sum-exp and every gradient to 1e-5 of their norms for
    float32 products (PyTorch's default precision) and 3xTF32 ones (where TF32 is allowed), 1e-12 in float64."""
    from mnemo.kernels.deep_attention import _read_weights
    from mnemo.kernels.deep_attention_triton_read import masked_read

    if precision == "tf32x3":
        monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    dtype = torch.float64 if precision == "float64" else torch.float32
    gen = torch.Generator(device="cuda").manual_seed(0)
    NQ, NK, scale = 79, 4096, 0.3
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda", dtype=dtype)  # noqa: E731
    # the raw kernel's exp needs scores that stay in range: smaller queries there
    q = (r(2, 16, NQ, 64) * (0.4 if normalize else 0.1)).requires_grad_()
    k, values = r(2, 16, NK, 64).requires_grad_(), [r(2, 16, NK, d).requires_grad_() for d in widths]
    key_start = torch.tensor([0, 700], device="cuda")
    key_end = torch.randint(0, NK + 1, (2, NQ), generator=gen, device="cuda")
    key_end[1, 3] = 0
    outs, lse = masked_read(q, k, tuple(values), key_start, key_end, scale, normalize)
    exact = [x.detach().double().requires_grad_() for x in (q, k, *values)]
    position = torch.arange(NK, device="cuda")
    allowed = (position >= key_start[:, None, None]) & (position < key_end[:, :, None])
    weights = _read_weights(exact[0], exact[1], allowed[:, None], scale, normalize)
    want = [weights @ v for v in exact[2:]]
    scores = torch.where(allowed[:, None], (exact[0] @ exact[1].transpose(-1, -2)) * scale, float("-inf"))
    want_lse = torch.where(allowed.any(-1)[:, None], scores.logsumexp(-1), 0.0) if normalize else lse.double() * 0
    cotangents = [torch.randn_like(x) for x in want] + [torch.randn_like(want_lse)]
    loss = lambda reads: sum((x * c.to(x.dtype)).sum() for x, c in zip(reads, cotangents))  # noqa: E731
    grads = torch.autograd.grad(loss((*outs, lse)), [q, k, *values])
    want_grads = torch.autograd.grad(loss((*want, want_lse)), exact)
    errors = _relative_errors([*outs, *grads], [*want, *want_grads])
    if normalize:
        errors.append(float((lse.detach().double() - want_lse).abs().max()))
    print(precision, normalize, widths, errors)
    assert max(errors) < (1e-12 if precision == "float64" else 1e-5), errors


@pytest.mark.parametrize("rule,window,depth,normalize", [
    ("omega", 16, 2, True), ("omega", 1, 1, True), ("omega", 4, 2, False), ("hebbian", 1, 2, True),
], ids=["dot-w16", "delta-linear", "dot-w4-exp", "hebbian-padded"])
def test_chunk_loop_reads_in_triton_equal_the_torch_reads(rule, window, depth, normalize):
    """The chunk loop (ragged rows, the omega rule, raw reads, the Hebbian rule where the whole-row path does not
    apply) with its reads in Triton against the same loop with the reads formed in PyTorch, float32: outputs
    and every gradient to 1e-5 of their norms."""
    inputs = _inputs(torch.float32) + [torch.rand(B, T, H, device="cuda").requires_grad_()]
    # The raw kernel sums exp over every earlier key, and its deep branch feeds on those sums: past a few
    # chunks the recursion overflows float32 on either path. Raw reads run over four chunks.
    steps = T if normalize else 4 * C
    inputs = [x if i == 4 else x[:, :steps] for i, x in enumerate(inputs)]  # all but W_1 run along time
    lengths = torch.tensor([steps, steps - 100], device="cuda")

    def run(triton):
        q, k, v, eta, w1, gamma = inputs
        out = _chunk_loop(q, k, v, eta, gamma, w1, lengths, None, depth, rule, window, C, normalize, D ** -0.5, 10.0,
                          triton)[0]
        grads = torch.autograd.grad(out.pow(2).sum(), inputs, allow_unused=True)  # depth 1 takes no eta or W_1
        return [out.detach()] + [g for g in grads if g is not None]

    want = run(False)
    assert all(bool(x.isfinite().all()) for x in want)
    got = run(True)
    assert len(got) == len(want)
    errors = _relative_errors(got, [x.double() for x in want])
    print(rule, window, depth, normalize, errors)
    assert max(errors) < 1e-5, errors


def test_dot_chunk_loop_peak_grows_linearly_with_the_length_on_the_triton_reads():
    """Dot's chunk loop (window 16) writes its buffers in place on the Triton reads: a training step's peak at
    4x the length stays under 4.6x (a buffer a chunk, kept by every chunk's reads, grew quadratically)."""
    def peak(steps):
        inputs = [x.detach()[:1, :steps].clone().requires_grad_() if i != 4 else x
                  for i, x in enumerate(_inputs(torch.float32) + [torch.rand(B, T, H, device="cuda")])]
        q, k, v, eta, w1, gamma = inputs
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = _chunk_loop(q, k, v, eta, gamma, w1, None, None, 2, "omega", 16, C, True, D ** -0.5, 10.0, True)[0]
        out.pow(2).sum().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    short, long = peak(T // 4), peak(T)
    print("peak bytes", short, long, long / short)
    assert long < 4.6 * short, (short, long)
