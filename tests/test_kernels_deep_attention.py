"""deep_attention memory: reference == chunked == step (on both backends), attention limits, the Dot delta rule."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch.nn import functional as F

from mnemo.kernels import use_backend
from mnemo.kernels.deep_attention import chunk_deep_attention, reference_deep_attention, step_deep_attention

# The Triton backend runs the chunk loop's reads through the flash-style kernels (the interpreter here).
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                                                    reason="triton is not installed"))]

B, T, H, DK, DV, HID = 3, 14, 2, 4, 3, 5

SETTINGS = [
    dict(memory_depth=2, learning_rule="hebbian", omega_window=1, chunk_size=4, normalize=True),
    dict(memory_depth=2, learning_rule="hebbian", omega_window=1, chunk_size=1, normalize=True),
    dict(memory_depth=2, learning_rule="hebbian", omega_window=1, chunk_size=5, normalize=False),
    dict(memory_depth=1, learning_rule="omega", omega_window=1, chunk_size=3, normalize=True),
    dict(memory_depth=2, learning_rule="omega", omega_window=1, chunk_size=4, normalize=True),
    dict(memory_depth=2, learning_rule="omega", omega_window=3, chunk_size=4, normalize=True),
    dict(memory_depth=2, learning_rule="omega", omega_window=7, chunk_size=4, normalize=True),
    dict(memory_depth=1, learning_rule="omega", omega_window=2, chunk_size=64, normalize=False),
    # The deep-branch gradient clip, small enough to act on most pairs of these inputs.
    dict(memory_depth=2, learning_rule="hebbian", omega_window=1, chunk_size=4, normalize=True, grad_clip=0.3),
    dict(memory_depth=2, learning_rule="omega", omega_window=3, chunk_size=4, normalize=True, grad_clip=0.3),
    dict(memory_depth=2, learning_rule="hebbian", omega_window=1, chunk_size=5, normalize=False, grad_clip=0.3),
]


def make_inputs(seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, DK, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(B, T, H, DV, generator=gen, dtype=dtype)
    eta, gamma = (torch.rand(B, T, H, generator=gen, dtype=dtype) for _ in range(2))
    w1 = torch.randn(H, DV, HID, generator=gen, dtype=dtype) * 0.5
    return q, k, v, eta, gamma, w1


def name(opts):
    return "-".join(f"{v}" for v in opts.values())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opts", SETTINGS, ids=name)
def test_reference_chunk_step_agree(opts, backend):
    q, k, v, eta, gamma, w1 = make_inputs()
    ref = reference_deep_attention(q, k, v, eta, gamma, w1, **opts)
    with use_backend(backend):
        _chunk_then_steps_equal(ref, q, k, v, eta, gamma, w1, opts, _atol(opts, backend))


def _atol(opts, backend):
    """1e-10, but where the Triton backend takes the Hebbian key pass for whole rows: its chunk updates sum in
    float32 whatever the inputs (deep_attention_triton), 8.6e-8 off the float64 reference here."""
    key_pass = opts["learning_rule"] == "hebbian" and opts["memory_depth"] == 2 and opts["normalize"]
    return 1e-6 if backend == "triton" and key_pass else 1e-10


def _chunk_then_steps_equal(ref, q, k, v, eta, gamma, w1, opts, atol):
    out, _ = chunk_deep_attention(q, k, v, eta, gamma, w1, **opts)
    torch.testing.assert_close(out, ref, rtol=0, atol=atol)
    o, state = chunk_deep_attention(*(x[:, :6] for x in (q, k, v, eta, gamma)), w1, **opts)
    outs = [o]
    for t in range(6, T):
        o, state = step_deep_attention(q[:, t], k[:, t], v[:, t], eta[:, t], gamma[:, t], w1, state, **opts)
        outs.append(o[:, None])
    torch.testing.assert_close(torch.cat(outs, 1), ref, rtol=0, atol=atol)


@pytest.mark.parametrize("opts", [SETTINGS[0], SETTINGS[1], SETTINGS[8]], ids=name)
def test_hebbian_decoding_takes_one_step_a_token_without_replaying_its_chunk(opts, monkeypatch):
    """After a prefill (whole rows) or a left-padded one (the chunk loop), each Hebbian token is one step that
    reads the state's open chunk as it stands (``_hebbian_step``), never the chunk loop, and equals the
    token-by-token definition, through chunk ends and every chunk size."""
    from mnemo.kernels import deep_attention

    q, k, v, eta, gamma, w1 = make_inputs(6)
    lengths = torch.tensor([6, 3, 5])
    ref = reference_deep_attention(q, k, v, eta, gamma, w1, **opts)
    for prompt_lengths in (None, lengths):
        o, state = chunk_deep_attention(*(x[:, :6] for x in (q, k, v, eta, gamma)), w1, lengths=prompt_lengths,
                                        **opts)
        prompt = [6] * B if prompt_lengths is None else prompt_lengths.tolist()  # each row's first tokens
        monkeypatch.setattr(deep_attention, "_chunk_loop", None)  # any replay would fail
        for t in range(6, T):
            o, state = step_deep_attention(q[:, t], k[:, t], v[:, t], eta[:, t], gamma[:, t], w1, state, **opts)
            for b in range(B):  # row b's sequence: its prompt's tokens, then the steps'
                seq = [torch.cat([x[b:b + 1, :prompt[b]], x[b:b + 1, 6:t + 1]], 1) for x in (q, k, v, eta, gamma)]
                alone = ref[b:b + 1, :t + 1] if prompt_lengths is None else reference_deep_attention(*seq, w1, **opts)
                torch.testing.assert_close(o[b], alone[0, -1], rtol=0, atol=1e-10)
        monkeypatch.undo()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opts", SETTINGS[::2], ids=name)
def test_ragged_rows_and_arbitrary_splits(opts, backend):
    """Rows with different lengths, fed in pieces of different sizes, equal each row alone."""
    q, k, v, eta, gamma, w1 = make_inputs(1)
    lengths = torch.tensor([14, 5, 9])
    ref = reference_deep_attention(q, k, v, eta, gamma, w1, lengths=lengths, **opts)
    for b, n in enumerate(lengths.tolist()):
        alone = reference_deep_attention(*(x[b:b + 1] for x in (q, k, v, eta, gamma)), w1, lengths=torch.tensor([n]), **opts)
        torch.testing.assert_close(ref[b, :n], alone[0, :n], rtol=0, atol=1e-12)
    # pieces: each row takes a different number of tokens per call
    pieces = [torch.tensor([3, 2, 4]), torch.tensor([6, 1, 0]), torch.tensor([5, 2, 5])]
    state, consumed = None, torch.zeros(3, dtype=torch.long)
    for take in pieces:
        width = int(take.max())
        idx = (consumed[:, None] + torch.arange(width)[None]).clamp(max=T - 1)

        def part(x):
            return x.gather(1, idx.view(3, width, *([1] * (x.dim() - 2))).expand(3, width, *x.shape[2:]))

        with use_backend(backend):
            o, state = chunk_deep_attention(*(part(x) for x in (q, k, v, eta, gamma)), w1, lengths=take,
                                            initial_state=state, **opts)
        for b in range(3):
            n = int(take[b])
            start = int(consumed[b])
            torch.testing.assert_close(o[b, :n], ref[b, start:start + n], rtol=0, atol=1e-10)
        consumed += take


def test_depth_one_is_scaled_dot_product_attention():
    q, k, v, *_ = make_inputs(2, torch.float32)
    out, _ = chunk_deep_attention(q, k, v, None, None, None, memory_depth=1)
    sdpa = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    torch.testing.assert_close(out, sdpa.transpose(1, 2), rtol=0, atol=1e-6)
    ref = reference_deep_attention(q.double(), k.double(), v.double(), None, None, None, memory_depth=1)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-6)


def test_deep_branch_without_learning_is_attention_and_with_learning_differs():
    q, k, v, eta, gamma, w1 = make_inputs(3)
    attention, _ = chunk_deep_attention(q, k, v, None, None, None, memory_depth=1)
    off, _ = chunk_deep_attention(q, k, v, torch.zeros_like(eta), None, torch.zeros_like(w1), memory_depth=2,
                                  chunk_size=4)
    torch.testing.assert_close(off, attention, rtol=0, atol=1e-12)
    on, _ = chunk_deep_attention(q, k, v, eta, None, w1, memory_depth=2, chunk_size=4)
    assert (on - attention).abs().max() > 1e-3


def test_dot_window_one_is_the_delta_rule_with_a_softmax_kernel():
    """Linear branch, window 1: stored values are gated prediction errors at the chunk-start memory."""
    q, k, v, _, gamma, _ = make_inputs(4)
    C = 3
    out, _ = chunk_deep_attention(q, k, v, None, gamma, None, memory_depth=1, learning_rule="omega", chunk_size=C)
    scale = DK**-0.5
    for b in range(B):
        for h in range(H):
            stored = []
            for t in range(T):
                s = t - t % C
                keys = k[b, :s, h]
                if s:
                    w = torch.softmax(keys @ k[b, t, h] * scale, 0)
                    prediction = w @ torch.stack(stored[:s])
                else:
                    prediction = torch.zeros(DV, dtype=v.dtype)
                stored.append(gamma[b, t, h] * (v[b, t, h] - prediction))
                w = torch.softmax(k[b, : t + 1, h] @ q[b, t, h] * scale, 0)
                torch.testing.assert_close(out[b, t, h], w @ torch.stack(stored), rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opts", [SETTINGS[5], SETTINGS[7], SETTINGS[10]], ids=name)
def test_gradients_match_reference(opts, backend):
    inputs = [x.clone().requires_grad_() for x in make_inputs(5)]
    grads = []
    for fn in (reference_deep_attention, lambda *a, **kw: chunk_deep_attention(*a, **kw)[0]):
        for x in inputs:
            x.grad = None
        with use_backend(backend):
            fn(*inputs, **opts).sin().sum().backward()
        # Depth 1 takes no eta or W_1: no gradient on either path.
        grads.append([torch.zeros_like(x) if x.grad is None else x.grad.clone() for x in inputs])
    for label, a, b in zip("q k v eta gamma w1".split(), *grads):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-9, msg=label)


def _saved_bytes(length: int, backend: str) -> int:
    """Bytes that Dot's chunk loop (depth 2, window 3, chunks of 8) keeps for its backward at ``length``."""
    gen = torch.Generator().manual_seed(length)
    q, k, v = (torch.randn(1, length, 2, 8, generator=gen).requires_grad_() for _ in range(3))
    eta, gamma = (torch.rand(1, length, 2, generator=gen) for _ in range(2))
    w1 = (0.1 * torch.randn(2, 8, 8, generator=gen)).requires_grad_()
    storages = {}

    def keep(x):
        storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda x: x), use_backend(backend):
        out, _ = chunk_deep_attention(q, k, v, eta, gamma, w1, memory_depth=2, learning_rule="omega", omega_window=3,
                                      chunk_size=8)
    out.sum().backward()  # the graph it kept is a working one
    return sum(storages.values())


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_dot_chunk_loop_on_the_triton_reads_keeps_for_its_backward_memory_linear_in_the_length():
    """Each chunk writes its window's rows of the omega targets and deep values in place, and its reads keep
    a copy of those rows only: 4x the length keeps about 4x the bytes (4.1x). With a new buffer a chunk, each
    kept by that chunk's reads, the same reads kept 6.1x; the PyTorch path (which does so, and keeps its
    weights over every earlier key) keeps 8.6x: quadratic in the length."""
    ratio = _saved_bytes(128, "triton") / _saved_bytes(32, "triton")
    assert 3.5 < ratio < 4.6, ratio


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_dot_chunk_loop_on_the_triton_reads_gives_its_gradients_under_activation_checkpointing():
    """The reads save the buffers they share with later chunks' in-place writes through ``save_for_backward``
    (a view with its own version counter), so that checkpointing drops and recomputes them like any other
    saved tensor: the gradients are those of the plain backward."""
    inputs = [x.clone().requires_grad_() for x in make_inputs(7)]

    def run(*xs):
        with use_backend("triton"):
            return chunk_deep_attention(*xs, memory_depth=2, learning_rule="omega", omega_window=3, chunk_size=4)[0]

    plain = torch.autograd.grad(run(*inputs).sin().sum(), inputs)
    checkpointed = torch.utils.checkpoint.checkpoint(run, *inputs, use_reentrant=False)
    again = torch.autograd.grad(checkpointed.sin().sum(), inputs)
    for label, a, b in zip("q k v eta gamma w1".split(), again, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=label)


def test_option_errors():
    q, k, v, eta, gamma, w1 = make_inputs()
    with pytest.raises(ValueError, match="memory_depth"):
        chunk_deep_attention(q, k, v, eta, gamma, w1, memory_depth=3)
    with pytest.raises(ValueError, match="learning_rule"):
        chunk_deep_attention(q, k, v, eta, gamma, w1, learning_rule="adam")
    with pytest.raises(ValueError, match="omega_window must be 1"):
        chunk_deep_attention(q, k, v, eta, gamma, w1, omega_window=2)
    with pytest.raises(ValueError, match="w1_init"):
        chunk_deep_attention(q, k, v, eta, gamma, None, memory_depth=2)


@pytest.mark.parametrize("rule, window", [("hebbian", 1), ("omega", 3)])
def test_grad_clip_acts_on_the_deep_branch_only(rule, window):
    q, k, v, eta, gamma, w1 = make_inputs(2)
    opts = dict(memory_depth=2, learning_rule=rule, omega_window=window, chunk_size=4)
    free = reference_deep_attention(q, k, v, eta, gamma, w1, **opts)
    clipped = reference_deep_attention(q, k, v, eta, gamma, w1, grad_clip=0.3, **opts)
    assert (free - clipped).abs().max() > 1e-3
    # With W_1 = 0 the deep branch is silent, and what is left (attention / the omega rule's
    # linear branch) must not change with the clip.
    zero = torch.zeros_like(w1)
    eta0 = torch.zeros_like(eta)
    torch.testing.assert_close(reference_deep_attention(q, k, v, eta0, gamma, zero, grad_clip=1e-3, **opts),
                               reference_deep_attention(q, k, v, eta0, gamma, zero, **opts), rtol=0, atol=1e-12)


def test_grad_clip_stops_the_runaway_of_the_hebbian_branch():
    """Unclipped, the Hebbian deep branch feeds on itself (values sharing a direction, as trained ones do) and
    overflows within a few thousand tokens; clipped, its W_1 grows at most linearly and the output stays finite."""
    gen = torch.Generator().manual_seed(0)
    n = 4096
    q, k = (0.1 * torch.randn(1, n, 1, 8, generator=gen) for _ in range(2))
    v = 1 + 0.1 * torch.randn(1, n, 1, 8, generator=gen)
    eta = torch.full((1, n, 1), 0.5)
    w1 = 0.5 * torch.randn(1, 8, 16, generator=gen)
    opts = dict(memory_depth=2, learning_rule="hebbian", chunk_size=64)
    wild, _ = chunk_deep_attention(q, k, v, eta, None, w1, **opts)
    assert not torch.isfinite(wild).all()
    safe, state = chunk_deep_attention(q, k, v, eta, None, w1, grad_clip=10.0, **opts)
    assert torch.isfinite(safe).all()
    # Linear growth at most: each pair adds at most eta * clip to W_1's norm.
    assert float(state.w1.norm()) <= float(w1.norm()) + 0.5 * 10.0 * n


HEBBIAN_FULL_ROWS = [
    dict(chunk_size=4, grad_clip=None),
    dict(chunk_size=4, grad_clip=0.3),  # the clip acts on most pairs
    dict(chunk_size=5, grad_clip=10.0),  # T = 14: a partial last chunk
    dict(chunk_size=1, grad_clip=0.3),
    dict(chunk_size=16, grad_clip=None),  # one chunk: no key pass read at all
]


def _general_path(q, k, v, eta, gamma, w1, **opts):
    """The chunk loop with per-chunk weights, which every call with a state or ragged rows takes."""
    from mnemo.kernels.deep_attention import _chunk_loop

    return _chunk_loop(q, k, v, eta, gamma, w1, None, None, 2, "hebbian", 1, opts["chunk_size"], True,
                        q.shape[-1] ** -0.5, opts["grad_clip"])


@pytest.mark.parametrize("opts", HEBBIAN_FULL_ROWS, ids=name)
def test_hebbian_full_rows_equal_the_chunk_loop(opts, monkeypatch):
    """Full rows from an empty state take the key pass and attention reads; outputs, the state
    and every gradient equal the general chunk loop's, and steps continue from that state."""
    import mnemo.kernels.deep_attention as hebbian

    calls, update = [], hebbian.chunk_update
    monkeypatch.setattr(hebbian, "chunk_update", lambda *a: calls.append(1) or update(*a))
    full = dict(memory_depth=2, learning_rule="hebbian", **opts)
    inputs = [x.clone().requires_grad_() for x in make_inputs(7)]
    out, state = chunk_deep_attention(*inputs, **full)
    assert calls, "the whole-row path was not taken"
    grads = torch.autograd.grad(out.sin().sum(), inputs)
    ref_out, ref_state = _general_path(*inputs, **opts)
    ref_grads = torch.autograd.grad(ref_out.sin().sum(), inputs)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    for label, a, b in zip("q k v eta gamma w1".split(), grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=label)
    got, want = state.tensors(), ref_state.tensors()
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-12, msg=key)
    # Decoding continues from the state: steps equal the reference over the longer sequence.
    q, k, v, eta, gamma, w1 = (x.detach() for x in inputs)
    extra = make_inputs(8)
    longer = [torch.cat([a, b[:, :3]], 1) for a, b in zip((q, k, v, eta, gamma), extra)]
    ref = reference_deep_attention(*longer, w1, **full)
    for t in range(T, T + 3):
        o, state = step_deep_attention(*(x[:, t] for x in longer), w1, state, **full)
        torch.testing.assert_close(o, ref[:, t], rtol=0, atol=1e-10)


@pytest.mark.parametrize("clip", [None, 0.3])
@pytest.mark.parametrize("rows", [4, 3])
def test_triton_chunk_update_equals_the_torch_one(clip, rows):
    """The key pass's per-chunk kernels (Triton's interpreter on the CPU) against
    :func:`chunk_update` and its autograd backward, on slices of larger buffers as the pass uses them."""
    pytest.importorskip("triton")
    from mnemo.kernels.deep_attention import chunk_update
    from mnemo.kernels.deep_attention_triton import chunk_update_backward_triton, chunk_update_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=gen).to(device)  # noqa: E731
    B_, H_, L, dv, hid = 2, 3, 9, 3, 5
    lo = 2
    a_all, v_all, e_all = r(B_, H_, L, hid), r(B_, H_, L, dv), torch.rand(B_, H_, L, generator=gen).to(device)
    w1 = r(B_, H_, dv, hid)
    a, v, e = a_all[:, :, lo:lo + rows], v_all[:, :, lo:lo + rows], e_all[:, :, lo:lo + rows]
    leaves = [x.clone().requires_grad_() for x in (a, v, w1, e)]
    want = chunk_update(*leaves, clip)
    buffers = [torch.zeros(B_, H_, L, hid, device=device), torch.zeros(B_, H_, L, hid, device=device),
               torch.zeros(B_, H_, L, dv, device=device), torch.zeros(B_, H_, dv, hid, device=device)]
    u_read = torch.zeros(B_, H_, L, hid, device=device, dtype=torch.bfloat16)
    out = [x[:, :, lo:lo + rows] for x in buffers[:3]] + [buffers[3]]
    chunk_update_triton(a, v, w1, e, clip, out, u_read[:, :, lo:lo + rows])
    for got, exp in zip(out, want):
        torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-5)
    assert not buffers[0][:, :, :lo].any() and not buffers[0][:, :, lo + rows:].any()
    torch.testing.assert_close(u_read[:, :, lo:lo + rows], out[0].bfloat16(), rtol=0, atol=0)

    grads = [r(*x.shape) for x in want]
    exp_grads = torch.autograd.grad(want, leaves, grads)
    got_grads = [torch.zeros_like(a_all)[:, :, lo:lo + rows], torch.zeros_like(v_all)[:, :, lo:lo + rows],
                 torch.empty_like(w1), torch.zeros_like(e_all)[:, :, lo:lo + rows]]
    grad_views = [torch.zeros(B_, H_, L, x.shape[-1], device=device)[:, :, lo:lo + rows].copy_(x) for x in grads[:3]]
    chunk_update_backward_triton(a, v, w1, e, clip, (*grad_views, grads[3]), got_grads)
    for label, got, exp in zip("a v w1 e".split(), got_grads, exp_grads):
        torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-4, msg=label)


def _assert_matches_the_chunk_loop(inputs, out, state, opts):
    """``out`` and ``state`` of the whole-row path on float32 ``inputs``, and the gradients of ``out``, against
    the general chunk loop: outputs and states to 1e-5, gradients to 1e-4."""
    grads = torch.autograd.grad(out.sin().sum(), inputs)
    ref_out, ref_state = _general_path(*inputs, **opts)
    ref_grads = torch.autograd.grad(ref_out.sin().sum(), inputs)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    for label, a, b in zip("q k v eta gamma w1".split(), grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=label)
    for key, want in ref_state.tensors().items():
        torch.testing.assert_close(state.tensors()[key], want, rtol=1e-5, atol=1e-5, msg=key)


@pytest.mark.parametrize("opts", HEBBIAN_FULL_ROWS[1:3], ids=name)
def test_hebbian_full_rows_with_triton_chunk_updates(opts):
    """The whole-row path with its chunk updates in Triton (the interpreter on the CPU), float32:
    outputs, state and gradients against the chunk loop."""
    pytest.importorskip("triton")
    from mnemo.kernels.backend import use_backend

    device = "cuda" if torch.cuda.is_available() else "cpu"
    full = dict(memory_depth=2, learning_rule="hebbian", **opts)
    inputs = [x.float().to(device).requires_grad_() for x in make_inputs(9)]
    with use_backend("triton"):
        out, state = chunk_deep_attention(*inputs, **full)
    _assert_matches_the_chunk_loop(inputs, out, state, opts)


KEY_PASS_CASES = [(53, None, torch.float32, 1, 16), (53, 0.5, torch.float32, 1, 16), (48, 2.0, torch.float32, 1, 16),
                  (16, None, torch.float32, 1, 16), (53, 0.5, torch.bfloat16, 1, 16),
                  (150, 0.5, torch.float32, 2, 16), (150, None, torch.float32, 3, 16),
                  (150, 0.5, torch.bfloat16, 4, 16), (53, 0.5, torch.float32, 8, 16),
                  (150, 0.5, torch.float32, 2, 32), (75, None, torch.bfloat16, 1, 32)]


@pytest.mark.parametrize("T_,clip,reads,group,C", KEY_PASS_CASES)
def test_triton_key_pass_equals_the_torch_one(T_, clip, reads, group, C, monkeypatch):
    """The wavefront key pass (:mod:`mnemo.kernels.deep_attention_triton_key_pass`; the interpreter on the
    CPU) against the PyTorch pass, float32: ``u, sig, er, W_1`` at every chunk start and the gradients of
    ``k, v, e, W_1``, with a partial last chunk, one chunk only, with and without the clip acting. With bf16
    reads both round the reads and their gradients to bf16 at different points: relative 2e-2. ``group``:
    chunks per group (T = 150 is ten chunks of 16: groups of 2, 3 and 4 leave a partial last group and take
    the earlier groups' blocks in the bulk launches; 8 is more than the four chunks of T = 53). Chunks of 32
    take a chunk's write and its backward in two blocks of 16 rows (``_ROWS``), the second one partial at
    T = 150 and T = 75."""
    pytest.importorskip("triton")
    from mnemo.kernels import deep_attention_triton_key_pass
    from mnemo.kernels.deep_attention import _KeyPass, _KeyPassTriton

    monkeypatch.setattr(deep_attention_triton_key_pass, "_GROUP", group)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(T_)
    B_, H_, DK_, DV_, HID_ = 2, 2, 8, 8, 12
    k = torch.randn(B_, H_, T_, DK_, generator=gen)
    v = torch.randn(B_, H_, T_, DV_, generator=gen)
    e = torch.rand(B_, H_, T_, generator=gen)
    w1 = torch.randn(B_, H_, DV_, HID_, generator=gen) * 0.5
    inputs = [x.to(device) for x in (k, v, e, w1)]

    def run(triton: bool):
        leaves = [x.clone().requires_grad_() for x in inputs]
        if triton:
            outs = _KeyPassTriton.apply(*leaves, C, 0.35, clip, reads)
        else:
            outs = _KeyPass.apply(*leaves, C, 0.35, clip, reads, True, False)
        probes = [torch.randn(x.shape, generator=torch.Generator().manual_seed(i)).to(device) for i, x in enumerate(outs)]
        return outs, torch.autograd.grad(outs, leaves, probes)

    (got, got_grads), (want, want_grads) = run(True), run(False)
    for label, a, b in zip(["u", "sig", "er", "w1s", "dk", "dv", "de", "dw1"], [*got, *got_grads], [*want, *want_grads]):
        assert a.shape == b.shape and a.dtype == b.dtype, label
        if reads == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=label)
        else:
            assert (a - b).norm() <= 2e-2 * b.norm(), (label, float((a - b).norm() / b.norm()))


def test_key_pass_group_size_follows_the_rows(monkeypatch):
    """Groups of chunks by the step grid's size: 16 chunks for 64 (batch, head) rows or fewer, 8 for 128,
    4 for 256 or more; ``_GROUP`` overrides."""
    pytest.importorskip("triton")
    from mnemo.kernels import deep_attention_triton_key_pass as kp

    assert [kp._group_size(r) for r in (1, 32, 64, 65, 128, 129, 256, 4096)] == [16, 16, 16, 8, 8, 4, 4, 4]
    monkeypatch.setattr(kp, "_GROUP", 3)
    assert kp._group_size(128) == 3


@pytest.mark.parametrize("grad_clip", [None, 0.3])
def test_hebbian_full_rows_with_the_triton_key_pass(grad_clip, monkeypatch):
    """``use_backend("triton")`` with chunks of 16 takes the wavefront key pass: the layer's outputs, state and
    gradients against the general chunk loop in float32 (T = 40: three chunks, the last partial)."""
    pytest.importorskip("triton")
    import mnemo.kernels.deep_attention as hebbian
    from mnemo.kernels.backend import use_backend

    calls, original = [], hebbian._KeyPassTriton.apply
    monkeypatch.setattr(hebbian._KeyPassTriton, "apply", lambda *a: calls.append(1) or original(*a))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(3)
    shapes = [(2, 40, 2, 8), (2, 40, 2, 8), (2, 40, 2, 8), (2, 40, 2), (2, 40, 2), (2, 8, 12)]
    inputs = [torch.randn(s, generator=gen) for s in shapes]
    inputs[3], inputs[4], inputs[5] = inputs[3].sigmoid(), inputs[4].sigmoid(), inputs[5] * 0.5
    inputs = [x.to(device).requires_grad_() for x in inputs]
    opts = dict(chunk_size=16, grad_clip=grad_clip)
    with use_backend("triton"):
        out, state = chunk_deep_attention(*inputs, memory_depth=2, learning_rule="hebbian", **opts)
    assert calls == [1]
    _assert_matches_the_chunk_loop(inputs, out, state, opts)


def test_triton_key_pass_is_taken_only_when_asked_and_supported():
    """On CPU tensors automatic selection keeps the SDPA key pass (on CUDA it takes the wavefront, which
    ``tests/test_gpu_deep_attention.py`` asserts); ``use_backend("triton")`` takes the wavefront kernels for
    float32 recursions, chunks a power of two from 16 to 128 and widths up to 128 whose tiles fit an SM's
    shared memory (chunk x width <= 8,192)."""
    from mnemo.kernels.backend import use_backend
    from mnemo.kernels.deep_attention import triton_key_pass_wanted

    k, w1 = torch.zeros(1, 1, 4, 64), torch.zeros(1, 1, 64, 64)
    assert not triton_key_pass_wanted(k, 64, torch.bfloat16, w1)  # CPU tensors: only when asked
    with use_backend("torch"):
        assert not triton_key_pass_wanted(k, 64, torch.bfloat16, w1)
    with use_backend("triton"):
        assert triton_key_pass_wanted(k, 64, torch.bfloat16, w1)
        assert triton_key_pass_wanted(k, 16, torch.float32, w1)
        assert not triton_key_pass_wanted(k, 48, torch.bfloat16, w1)
        assert not triton_key_pass_wanted(k, 256, torch.bfloat16, w1)
        assert not triton_key_pass_wanted(k.double(), 64, torch.float64, w1.double())
        assert not triton_key_pass_wanted(k, 64, torch.bfloat16, torch.zeros(1, 1, 64, 256))
        assert triton_key_pass_wanted(k, 128, torch.bfloat16, w1)
        assert triton_key_pass_wanted(k, 64, torch.float32, torch.zeros(1, 1, 64, 128))
        assert not triton_key_pass_wanted(k, 128, torch.float32, torch.zeros(1, 1, 64, 128))
