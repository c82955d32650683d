"""The chunk loop's recompute backward gives plain autograd's gradients (kernels/chunk_loop.py)."""

from __future__ import annotations

import pytest
import torch

from mnemo.kernels.backend import comparison_paths
from mnemo.kernels.chunk_loop import loop_options, run_chunks
from mnemo.kernels.atlas import AtlasState, chunk_atlas, reference_atlas
from mnemo.kernels.mc_atlas import GATED_AGGREGATIONS, CachedMemories, chunk_mc_atlas, reference_mc_atlas
from mnemo.kernels.memory_caching import MCOptions
from mnemo.kernels.mc_titans import MCState, chunk_mc_titans, reference_mc_titans
from mnemo.kernels.mlp_memory import MLPMemorySpec
from mnemo.kernels.titans import TitansState, chunk_titans, reference_titans

N, B, D = 7, 3, 5


def toy_step(carry, x, consts):
    """A nonlinear recurrence with a pass-through carry, a mask and a constant that needs gradients."""
    h, kept = carry
    inp, mask = x
    (w,) = consts
    new_h = torch.where(mask[:, None], torch.tanh(h @ w + inp), h)
    return (new_h.sum(-1), new_h * 2), (new_h, kept)


def toy_inputs():
    gen = torch.Generator().manual_seed(0)
    h0 = torch.randn(B, D, generator=gen, dtype=torch.float64, requires_grad=True)
    kept = torch.randn(B, D, generator=gen, dtype=torch.float64, requires_grad=True)
    inp = torch.randn(N, B, D, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(N, B, generator=gen) > 0.3
    w = (torch.randn(D, D, generator=gen, dtype=torch.float64) * 0.5).requires_grad_()
    return h0, kept, inp, mask, w


def toy_loss(ys, carry):
    a, b = ys
    return (a * torch.arange(1, N + 1)[:, None]).sum() + b.pow(2).sum() + (carry[0] * carry[1]).sum()


def plain_loop(h0, kept, inp, mask, w):
    """The toy loop under plain autograd: stacked outputs and the final carry."""
    carry, ys = (h0, kept), []
    for j in range(N):
        y, carry = toy_step(carry, (inp[j], mask[j]), (w,))
        ys.append(y)
    return tuple(torch.stack(t) for t in zip(*ys)), carry


def assert_run_chunks_is_plain_autograd(**options):
    """``run_chunks`` (with ``options``) gives the plain loop's outputs exactly and its gradients to 1e-12."""
    h0, kept, inp, mask, w = toy_inputs()
    plain_ys, carry = plain_loop(h0, kept, inp, mask, w)
    expected = torch.autograd.grad(toy_loss(plain_ys, carry), (h0, kept, inp, w))
    got_ys, got_carry = run_chunks(toy_step, (h0, kept), (inp, mask), (w,), **options)
    assert type(got_ys[0].grad_fn).__name__ == "_ChunkLoopBackward"
    for a, b in zip(got_ys + got_carry, plain_ys + carry):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    got = torch.autograd.grad(toy_loss(got_ys, got_carry), (h0, kept, inp, w))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("unit", [None, 1, 2])
@pytest.mark.parametrize("every", [None, 1, 2, 3, 7, 10])
def test_gradients_equal_plain_autograd(every, unit):
    assert_run_chunks_is_plain_autograd(checkpoint_every=every, recompute=True, backward_unit=unit)


def test_the_backward_recomputes_under_the_forwards_autocast():
    """Chunks run under autocast are recomputed under it too (matmuls in bf16 here), though the
    backward itself runs outside it; recomputing in float64 would give other carries."""
    h0, kept, inp, mask, w = (t.float().detach().requires_grad_(t.requires_grad) for t in toy_inputs())
    mask = mask.bool()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # float32 matmuls are what autocast lowers
        plain = toy_loss(*plain_loop(h0, kept, inp, mask, w))
        got_ys, got_carry = run_chunks(toy_step, (h0, kept), (inp, mask), (w,), checkpoint_every=3, recompute=True)
        loss = toy_loss(got_ys, got_carry)
    expected = torch.autograd.grad(plain, (h0, kept, inp, w))
    got = torch.autograd.grad(loss, (h0, kept, inp, w))
    for a, b in zip(got[:3], expected[:3]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # Plain autograd sums w's gradient over chunks in bf16 (autocast casts w once, and the gradients
    # meet on that bf16 copy); the loop sums each chunk's in float32: bf16 rounding apart.
    torch.testing.assert_close(got[3], expected[3], rtol=3e-2, atol=3e-2)


class ReplayOnCPU:
    """Stands in for :class:`GraphedStep` without CUDA: every replay reruns the step on the static input
    buffers and overwrites the same output buffers, as a graph replay does. The loop's copies in and out
    (what CI cannot otherwise run) are then checked against plain autograd."""

    def __init__(self, step, carry, x, consts, need_x=(), need_consts=(), backward=False):
        import types

        self.step = step
        self.carry, self.x, self.consts = ([t.detach().clone() for t in ts] for ts in (carry, x, consts))
        self.carry, self.x, self.consts = tuple(self.carry), tuple(self.x), tuple(self.consts)
        with torch.no_grad():
            ys, carry_out = step(self.carry, self.x, self.consts)
        self.ys, self.carry_out = tuple(t.clone() for t in ys), tuple(t.clone() for t in carry_out)
        self.fwd = types.SimpleNamespace(replay=self._forward)
        self.need_x = tuple(need_x) or (False,) * len(x)
        self.need_consts = tuple(need_consts) or (False,) * len(consts)
        self.d_ys = tuple(torch.zeros_like(t) for t in self.ys)
        self.d_carry_out = tuple(torch.zeros_like(t) for t in self.carry_out)
        self.d_carry, self.d_x, self.d_consts = (tuple(torch.zeros_like(t) for t in ts)
                                                 for ts in (self.carry, self.x, self.consts))
        self.bwd = types.SimpleNamespace(replay=self._backward) if backward else None

    def load(self, carry=None, x=None, consts=None):
        for dst, src in ((self.carry, carry), (self.x, x), (self.consts, consts)):
            for d, t in zip(dst, src or ()):
                if d is not t:
                    d.copy_(t)

    def _forward(self):
        with torch.no_grad():
            ys, carry_out = self.step(self.carry, self.x, self.consts)
        for dst, src in zip(self.ys + self.carry_out, ys + carry_out):
            dst.copy_(src)

    def _backward(self):
        leaves = (tuple(t.detach().clone().requires_grad_(t.is_floating_point()) for t in self.carry)
                  + tuple(t.detach().clone().requires_grad_(w) for t, w in zip(self.x, self.need_x))
                  + tuple(t.detach().clone().requires_grad_(w) for t, w in zip(self.consts, self.need_consts)))
        n_c, n_x = len(self.carry), len(self.x)
        with torch.enable_grad():
            ys, carry_out = self.step(leaves[:n_c], leaves[n_c:n_c + n_x], leaves[n_c + n_x:])
        pairs = [(o, g) for o, g in zip(ys + carry_out, self.d_ys + self.d_carry_out) if o.requires_grad]
        inputs = [t for t in leaves if t.requires_grad]
        found = iter(torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True))
        for dst, t in zip(self.d_carry + self.d_x + self.d_consts, leaves):
            g = next(found) if t.requires_grad else None
            dst.zero_() if g is None else dst.copy_(g)


@pytest.fixture
def replay_on_cpu(monkeypatch):
    from mnemo.kernels import chunk_loop

    monkeypatch.setattr(chunk_loop, "_graphs_wanted", lambda _tensors, _n, graphs=None: graphs is not False)
    monkeypatch.setattr(chunk_loop, "graphed_step", ReplayOnCPU)


@pytest.mark.parametrize("unit", [None, 1, 2])
@pytest.mark.parametrize("every", [None, 1, 3])
@pytest.mark.usefixtures("replay_on_cpu")
def test_replayed_steps_equal_plain_autograd(every, unit):
    # replayed steps recompute by default
    assert_run_chunks_is_plain_autograd(checkpoint_every=every, backward_unit=unit)
    h0, kept, inp, mask, w = toy_inputs()
    with torch.no_grad():
        plain = plain_loop(h0, kept, inp, mask, w)
        free_ys, free_carry = run_chunks(toy_step, (h0, kept), (inp, mask), (w,))
    for a, b in zip(free_ys + free_carry, plain[0] + plain[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _first_pass_of_the_toy_loop(calls, late=False):
    """A first pass for the toy loop (its chunks one at a time outside ``run_chunks``, recording the
    calls); ``late`` hands back the carries one chunk too late (a mutation the tests must catch)."""

    def first_pass(carry, xs, consts, r):
        calls.append(r)
        inp, mask = xs
        ys, kept = [], []
        for j in range(inp.shape[0]):
            if j % r == 0 and not late:
                kept.append(carry)
            y, carry = toy_step(carry, (inp[j], mask[j]), consts)
            if j % r == 0 and late:
                kept.append(carry)
            ys.append(y)
        return tuple(torch.stack(t) for t in zip(*ys)), carry, kept

    return first_pass


@pytest.mark.parametrize("every", [1, 3, 7])
@pytest.mark.parametrize("loop_mode", ["recompute", "replayed"])
def test_a_first_pass_takes_the_forwards_place_and_the_backward_is_the_steps(every, loop_mode, request):
    """Where the loop recomputes, ``first_pass`` gives its outputs, final carry and checkpoints (called
    once, with the spacing) and the backward re-runs the step from those checkpoints: the plain loop's
    outputs exactly and its gradients to 1e-12, captured or not; without gradients it is the whole loop.
    Checkpoints one chunk late give other gradients, and a wrong number of them is named."""
    if loop_mode == "replayed":
        request.getfixturevalue("replay_on_cpu")
    recompute = True if loop_mode == "recompute" else None
    calls = []
    assert_run_chunks_is_plain_autograd(checkpoint_every=every, recompute=recompute,
                                        first_pass=_first_pass_of_the_toy_loop(calls))
    assert calls == [every]
    h0, kept, inp, mask, w = toy_inputs()
    if every < N:
        plain_ys, carry = plain_loop(h0, kept, inp, mask, w)
        expected = torch.autograd.grad(toy_loss(plain_ys, carry), (h0, kept, inp, w))
        late = _first_pass_of_the_toy_loop([], late=True)
        got_ys, got_carry = run_chunks(toy_step, (h0, kept), (inp, mask), (w,), checkpoint_every=every,
                                       recompute=recompute, first_pass=late)
        got = torch.autograd.grad(toy_loss(got_ys, got_carry), (h0, kept, inp, w))
        assert any((a - b).abs().max() > 1e-6 for a, b in zip(got, expected))
    with pytest.raises(ValueError, match="checkpoints"):
        run_chunks(toy_step, (h0, kept), (inp, mask), (w,), checkpoint_every=every, recompute=recompute,
                   first_pass=lambda *args: _first_pass_of_the_toy_loop([])(*args)[:2] + ([],))
    calls.clear()
    with torch.no_grad():
        plain_ys, plain_carry = plain_loop(h0, kept, inp, mask, w)
        ys, carry = run_chunks(toy_step, (h0, kept), (inp, mask), (w,), first_pass=_first_pass_of_the_toy_loop(calls))
        _, _, snaps = run_chunks(toy_step, (h0, kept), (inp, mask), (w,), checkpoint_every=every, snapshots=True,
                                 first_pass=_first_pass_of_the_toy_loop(calls))
        _, _, plain_snaps = run_chunks(toy_step, (h0, kept), (inp, mask), (w,), checkpoint_every=every,
                                       snapshots=True)
    assert calls == [N, every]  # without gradients it is the whole loop: one stretch, or the snapshots' spacing
    for a, b in zip(ys + carry, plain_ys + plain_carry):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert len(snaps) == len(plain_snaps) == -(-N // every) - 1
    for a, b in zip([t for s in snaps for t in s], [t for s in plain_snaps for t in s]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_uncaptured_loops_run_under_plain_autograd_unless_asked():
    h0, kept, inp, mask, w = toy_inputs()
    ys, _ = run_chunks(toy_step, (h0, kept), (inp, mask), (w,))  # CPU: no graphs, so no recompute
    assert type(ys[0].grad_fn).__name__ != "_ChunkLoopBackward"
    with loop_options(recompute=True):
        ys, _ = run_chunks(toy_step, (h0, kept), (inp, mask), (w,))
    assert type(ys[0].grad_fn).__name__ == "_ChunkLoopBackward"


def test_without_gradients_no_graph_is_kept():
    h0, kept, inp, mask, w = toy_inputs()
    with torch.no_grad():
        ys, carry = run_chunks(toy_step, (h0, kept), (inp, mask), (w,))
    assert ys[0].grad_fn is None and carry[0].grad_fn is None


def test_bad_inputs_are_named():
    h0, kept, inp, mask, w = toy_inputs()
    with pytest.raises(ValueError, match="chunks first"):
        run_chunks(toy_step, (h0, kept), (inp, mask[:3]), (w,))
    with pytest.raises(ValueError, match="checkpoint_every"):
        run_chunks(toy_step, (h0, kept), (inp, mask), (w,), checkpoint_every=0)


def test_spacing_minimises_the_carries_all_layers_keep(monkeypatch):
    """A model's ``L`` memory layers keep ``n / r`` carries each until the backward, which holds about ``r``
    of one stretch: the default spacing is about ``sqrt(L n)`` (a near divisor of ``n``, at most ``n``), and a
    model's forward announces its layers."""
    from mnemo.kernels import chunk_loop

    assert chunk_loop._stretch(32, None) == 4  # sqrt(32) rounded up is 6; 4 is the nearest divisor below
    with loop_options(layers=24):
        assert chunk_loop._stretch(32, None) == 16  # sqrt(768) -> 28 -> the divisor 16
        assert chunk_loop._stretch(8, None) == 8  # never past the loop's own length
        assert chunk_loop._stretch(32, 2) == 2  # the caller's spacing wins
    with pytest.raises(ValueError, match="layers"):
        with loop_options(layers=0):
            pass
    from conftest import tiny_mc_titans

    seen = []
    real = chunk_loop._stretch
    monkeypatch.setattr(chunk_loop, "_stretch", lambda n, every: seen.append(
        (chunk_loop._options[-1].layers, torch.is_grad_enabled())) or real(n, every))
    ids = torch.randint(1, 97, (2, 12))
    model = tiny_mc_titans(recompute_memory=False).train()
    model(ids, labels=ids).loss.backward()
    assert seen and {layers for layers, _ in seen} == {model.config.num_hidden_layers}
    # A memory recomputed in the backward keeps nothing from its forward (which runs without gradients): the
    # loops that keep carries run in the backward, one layer at a time.
    seen.clear()
    model = tiny_mc_titans().train()
    model(ids, labels=ids).loss.backward()
    assert model.config.num_hidden_layers > 1 and {layers for layers, grad in seen if grad} == {1}


@pytest.mark.parametrize("build", ["atlas", "mc_titans"])
def test_activation_checkpointing_re_runs_the_loops_as_they_ran(build):
    """transformers' activation checkpointing re-runs a block in the backward, outside the model's forward:
    its recomputing loops must be spaced as in the forward (else the re-run keeps other tensors and the
    checkpoint refuses it), and the gradients are those of the plain step."""
    from conftest import assert_checkpointing_keeps_the_gradients, tiny_atlas, tiny_mc_titans

    model = (tiny_atlas() if build == "atlas" else tiny_mc_titans()).train()
    ids = torch.randint(1, 97, (2, 40), generator=torch.Generator().manual_seed(0))
    with loop_options(recompute=True):
        assert_checkpointing_keeps_the_gradients(model, ids, rtol=1e-6, atol=1e-7)


class WarmingReplayOnCPU(ReplayOnCPU):
    """:class:`ReplayOnCPU` that also warms its backward up under autograd when made, as a CUDA capture does."""

    def __init__(self, step, carry, x, consts, need_x=(), need_consts=(), backward=False):
        super().__init__(step, carry, x, consts, need_x, need_consts, backward)
        if backward:
            self._backward()


@pytest.mark.parametrize("build", ["titans", "atlas"])
def test_a_capture_inside_a_checkpointed_forward_is_not_the_blocks_own(build, monkeypatch):
    """A step first met inside a block that activation checkpointing records is captured there, and its
    capture runs it under autograd: what that saves must not count as the block's, whose re-run in the
    backward replays the capture instead (the checkpoint compares the two runs' saved tensors)."""
    from conftest import tiny_atlas, tiny_mc_titans
    from mnemo.kernels import chunk_loop

    monkeypatch.setattr(chunk_loop, "_graphs_wanted", lambda _tensors, _n, graphs=None: graphs is not False)
    monkeypatch.setattr(chunk_loop, "GraphedStep", WarmingReplayOnCPU)
    chunk_loop.release_graphs()
    try:
        model = (tiny_mc_titans(segment_size=None) if build == "titans" else tiny_atlas()).train()
        model.activation_checkpointing_enable()
        ids = torch.randint(1, 97, (2, 40), generator=torch.Generator().manual_seed(0))
        model(ids, labels=ids).loss.backward()  # every step captured inside the checkpointed blocks
        assert any(isinstance(g, WarmingReplayOnCPU) for g in chunk_loop._GRAPHS.values())
        checkpointed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    finally:
        chunk_loop.release_graphs()
    model.zero_grad()
    model.activation_checkpointing_disable()
    with loop_options(graphs=False, recompute=False):
        model(ids, labels=ids).loss.backward()
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(checkpointed[name], p.grad, rtol=1e-6, atol=1e-7, msg=name)


# --- Titans: the chunked path's gradients equal the token-by-token reference's ------------------------------
# Every kernel test below runs three times: through the recompute (the CUDA default), under plain autograd
# (the default where the steps are not captured), and through the graphed path's copies with the graphs
# replayed on the CPU.


@pytest.fixture(params=["recompute", "plain", "replayed"])
def loop_mode(request):
    if request.param == "replayed":  # the graphed path's bookkeeping, with CPU stand-ins for the graphs
        request.getfixturevalue("replay_on_cpu")
        yield request.param
        return
    with loop_options(recompute=request.param == "recompute"):
        yield request.param

H, T, DK = 2, 19, 4
SPECS = {
    "linear": MLPMemorySpec(depth=1, d_k=DK, d_v=DK),
    "mlp": MLPMemorySpec(depth=2, d_k=DK, d_v=DK, expansion=2),
    "gated_skip_dot": MLPMemorySpec(depth=2, gated=True, d_k=DK, d_v=DK + 1, expansion=2, objective="dot"),
    "clipped": MLPMemorySpec(depth=2, d_k=DK, d_v=DK, expansion=2, grad_clip=0.3),
}


def titans_inputs(spec):
    gen = torch.Generator().manual_seed(1)
    f64 = dict(generator=gen, dtype=torch.float64)
    init = {n: (torch.randn(H, *s, **f64) * 0.5).requires_grad_() for n, s in spec.shapes.items()}
    q, k = (torch.randn(B, T, H, DK, **f64).requires_grad_() for _ in range(2))
    v = torch.randn(B, T, H, spec.d_v, **f64).requires_grad_()
    alpha = (torch.rand(B, T, H, **f64) * 0.5 + 0.5).requires_grad_()
    eta = torch.rand(B, T, H, **f64).requires_grad_()
    theta = (torch.rand(B, T, H, **f64) * 0.05).requires_grad_()
    return init, q, k, v, alpha, eta, theta


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("chunk, every", [(4, None), (4, 1), (5, 2), (64, None)])
@pytest.mark.usefixtures("loop_mode")
def test_titans_gradients_equal_the_reference(name, chunk, every):
    spec = SPECS[name]
    init, q, k, v, alpha, eta, theta = titans_inputs(spec)
    lengths = torch.tensor([T, 11, 6])
    leaves = [q, k, v, alpha, eta, theta, *init.values()]
    weight = torch.randn(B, T, H, spec.d_v, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ref = reference_titans(spec, q, k, v, alpha, eta, theta, init, chunk_size=chunk, lengths=lengths)
    expected = torch.autograd.grad((ref * weight).sum(), leaves)
    out, _ = chunk_titans(spec, q, k, v, alpha, eta, theta, TitansState.initial(init, B), chunk_size=chunk,
                          lengths=lengths, checkpoint_every=every)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    got = torch.autograd.grad((out * weight).sum(), leaves)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("chunk", [4, 5])
@pytest.mark.usefixtures("loop_mode")
def test_titans_gradients_flow_through_a_resumed_state(chunk):
    """A prefix of ragged length, then the rest from its state: gradients of both calls' outputs reach
    every input as in one reference pass (the resumed chunk reads the stored chunk-start weights)."""
    spec = SPECS["mlp"]
    init, q, k, v, alpha, eta, theta = titans_inputs(spec)
    leaves = [q, k, v, alpha, eta, theta, *init.values()]
    weight = torch.randn(B, T, H, DK, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ref = reference_titans(spec, q, k, v, alpha, eta, theta, init, chunk_size=chunk)
    expected = torch.autograd.grad((ref * weight).sum(), leaves)
    first = torch.tensor([7, 3, 9])
    width = int(first.max())
    idx = (first[:, None] + torch.arange(T - int(first.min()))[None]).clamp(max=T - 1)

    def rest(x):
        return x.gather(1, idx.view(B, -1, *([1] * (x.dim() - 2))).expand(B, idx.shape[1], *x.shape[2:]))

    xs = (q, k, v, alpha, eta, theta)
    o1, state = chunk_titans(spec, *(x[:, :width] for x in xs), TitansState.initial(init, B), chunk_size=chunk,
                             lengths=first)
    o2, _ = chunk_titans(spec, *(rest(x) for x in xs), state, chunk_size=chunk, lengths=T - first)
    loss = sum((o1[b, :first[b]] * weight[b, :first[b]]).sum() + (o2[b, :T - first[b]] * weight[b, first[b]:]).sum()
               for b in range(B))
    got = torch.autograd.grad(loss, leaves)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


# --- Memory Caching: the same, segment by segment -----------------------------------------------------------

def grads(loss, leaves):
    """Gradients with zeros for leaves the loss does not use (``u`` under ``residual``)."""
    got = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(got, leaves)]


MC_CASES = [
    (None, "checkpoint", "grm"),
    (5, "checkpoint", "grm"),
    (8, "independent", "soup"),
    (8, "checkpoint", "ssc"),
    (5, "checkpoint", "residual"),
]


@pytest.mark.parametrize("seg, mode, agg", MC_CASES)
@pytest.mark.usefixtures("loop_mode")
def test_mc_titans_gradients_equal_the_reference(seg, mode, agg):
    spec = SPECS["mlp"]
    init, q, k, v, alpha, eta, theta = titans_inputs(spec)
    u = torch.randn(B, T, H, DK, generator=torch.Generator().manual_seed(4), dtype=torch.float64).requires_grad_()
    opts = MCOptions(segment_size=seg, cache_mode=mode, aggregation=agg, ssc_topk=1, chunk_size=3)
    leaves = [q, k, v, u, alpha, eta, theta, *init.values()]
    xs = (q, k, v, u, alpha, eta, theta)
    weight = torch.randn(B, T, H, DK, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    lengths = torch.tensor([T, 12, 7])
    ref = reference_mc_titans(spec, opts, *xs, init, lengths=lengths)
    expected = grads((ref * weight).sum(), leaves)
    out, _ = chunk_mc_titans(spec, opts, *xs, init, MCState.initial(init, B, DK), lengths=lengths)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    got = grads((out * weight).sum(), leaves)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)

    # in two calls, the second resuming inside a segment and an inner chunk
    first = torch.tensor([7, 4, 2])
    idx = (first[:, None] + torch.arange(T - int(first.min()))[None]).clamp(max=T - 1)
    rest = [x.gather(1, idx.view(B, -1, *([1] * (x.dim() - 2))).expand(B, idx.shape[1], *x.shape[2:])) for x in xs]
    ref = reference_mc_titans(spec, opts, *xs, init)
    expected = grads((ref * weight).sum(), leaves)
    o1, state = chunk_mc_titans(spec, opts, *(x[:, :int(first.max())] for x in xs), init,
                                MCState.initial(init, B, DK), lengths=first)
    o2, _ = chunk_mc_titans(spec, opts, *rest, init, state, lengths=T - first)
    loss = sum((o1[b, :first[b]] * weight[b, :first[b]]).sum() + (o2[b, :T - first[b]] * weight[b, first[b]:]).sum()
               for b in range(B))
    got = grads(loss, leaves)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


# --- Atlas (Omega window, GD / momentum / Muon) and Atlas with Memory Caching -------------------------------

ATLAS_CASES = [("mlp", "muon", 3, 4), ("gated-dot", "momentum", 4, 5), ("linear", "gd", 1, 4), ("mlp", "gd", 7, 3)]


def atlas_case(memory, optimizer):
    from test_kernels_atlas import MEMORIES, inputs

    spec = MLPMemorySpec(d_v=4, expansion=2, **MEMORIES[memory])
    init, xs = inputs(spec)
    if optimizer == "gd":
        xs = xs[:5] + (None,) + xs[6:]
    init = {n: w.requires_grad_() for n, w in init.items()}
    xs = tuple(None if x is None else x.requires_grad_() for x in xs)
    return spec, init, xs, [x for x in xs if x is not None] + list(init.values())


@pytest.mark.parametrize("memory, optimizer, window, chunk", ATLAS_CASES)
@pytest.mark.usefixtures("loop_mode")
def test_atlas_gradients_equal_the_reference(memory, optimizer, window, chunk):
    from test_kernels_atlas import B as AB, H as AH, TAKES as ATAKES, next_tokens

    spec, init, xs, leaves = atlas_case(memory, optimizer)
    opts = dict(optimizer=optimizer, omega_window=window, chunk_size=chunk, ns_steps=3)
    lengths = torch.stack(ATAKES).sum(0)
    ref = reference_atlas(spec, *xs, init, lengths=lengths, **opts)
    weight = torch.randn(ref.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    expected = grads((ref * weight).sum(), leaves)
    # in pieces: later calls resume mid-chunk with the window carried in the state
    state, consumed, loss = AtlasState.initial(spec, init, AB, AH, window, optimizer), torch.zeros(AB, dtype=torch.long), 0
    for take in ATAKES:
        o, state = chunk_atlas(spec, *(next_tokens(x, consumed, take) for x in xs), state, lengths=take, **opts)
        for b in range(AB):
            n, s = int(take[b]), int(consumed[b])
            torch.testing.assert_close(o[b, :n], ref[b, s:s + n], rtol=0, atol=1e-10)
            loss = loss + (o[b, :n] * weight[b, s:s + n]).sum()
        consumed = consumed + take
    got = grads(loss, leaves)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("aggregation", ["grm", "residual"])
@pytest.mark.usefixtures("loop_mode")
def test_atlas_memory_caching_gradients_equal_the_reference(aggregation):
    from test_kernels_atlas import B as AB, H as AH, TAKES as ATAKES, next_tokens

    spec, init, xs, leaves = atlas_case("mlp", "momentum")
    gated = aggregation in GATED_AGGREGATIONS
    u = (torch.randn(AB, xs[0].shape[1], AH, spec.d_k, generator=torch.Generator().manual_seed(7),
                     dtype=torch.float64) * 2).requires_grad_() if gated else None
    leaves = leaves + ([u] if gated else [])
    opts = dict(optimizer="momentum", omega_window=3, chunk_size=4, ns_steps=3)
    mc = dict(segment_size=5, aggregation=aggregation, ssc_topk=1)
    lengths = torch.stack(ATAKES).sum(0)
    fresh = lambda n: AtlasState.initial(spec, init, n, AH, 3, "momentum")  # noqa: E731
    cut = lambda x, b: None if x is None else x[b:b + 1, :int(lengths[b])]  # noqa: E731
    weight = torch.randn(AB, xs[0].shape[1], AH, spec.d_v, generator=torch.Generator().manual_seed(8),
                         dtype=torch.float64)
    ref_loss = sum((reference_mc_atlas(spec, *(cut(x, b) for x in xs), fresh(1), u=cut(u, b), **mc, **opts)[0]
                    * cut(weight, b)).sum() for b in range(AB))
    expected = grads(ref_loss, leaves)
    state = fresh(AB)
    cached = CachedMemories.empty(state.weights, spec.d_k if gated else None)
    consumed, loss = torch.zeros(AB, dtype=torch.long), 0
    for take in ATAKES:
        o, state, cached = chunk_mc_atlas(spec, *(next_tokens(x, consumed, take) for x in xs), state, cached,
                                          lengths=take, clock=consumed, u=next_tokens(u, consumed, take), **mc,
                                          **opts)
        for b in range(AB):
            n, s = int(take[b]), int(consumed[b])
            loss = loss + (o[b, :n] * weight[b, s:s + n]).sum()
        consumed = consumed + take
    got = grads(loss, leaves)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


def test_tf32_policy_is_for_low_precision_cuda_problems_and_restores_the_setting():
    from mnemo.kernels.chunk_loop import tf32_products, tf32_wanted

    assert not tf32_wanted(torch.zeros(2, dtype=torch.bfloat16))  # CPU: exact products always
    assert not tf32_wanted(torch.zeros(2))
    before = torch.get_float32_matmul_precision()
    with tf32_products(True):
        assert torch.get_float32_matmul_precision() == "high"
    assert torch.get_float32_matmul_precision() == before
    with pytest.raises(RuntimeError), tf32_products(True):
        raise RuntimeError("an error inside still restores it")
    assert torch.get_float32_matmul_precision() == before


def test_recompute_in_backward_equals_plain_autograd():
    from mnemo.kernels.chunk_loop import recompute_in_backward

    gen = torch.Generator().manual_seed(0)
    x, w = (torch.randn(4, 5, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = torch.rand(4, 5, generator=gen) > 0.5

    def fn(x, w, mask, power):
        return ((x * w).masked_fill(mask, 0.0) ** power).sin()

    plain = fn(x, w, mask, 3)
    got = recompute_in_backward(fn, (x, w), mask, 3)
    assert type(got.grad_fn).__name__ == "_RecomputedBackward"
    torch.testing.assert_close(got, plain, rtol=0, atol=0)
    cot = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(got, (x, w), cot), torch.autograd.grad(plain, (x, w), cot)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with torch.no_grad():
        assert recompute_in_backward(fn, (x, w), mask, 3).grad_fn is None


@pytest.mark.parametrize("loop_mode", ["plain", "recompute", "replayed"])
@pytest.mark.parametrize("every", [2, 3, 7])
def test_snapshots_are_the_carries_at_stretch_ends_with_their_gradients(every, loop_mode, request):
    if loop_mode == "replayed":
        request.getfixturevalue("replay_on_cpu")
    h0, kept, inp, mask, w = toy_inputs()
    carry, ys, plain_snaps = (h0, kept), [], []
    for j in range(N):
        y, carry = toy_step(carry, (inp[j], mask[j]), (w,))
        ys.append(y)
        if (j + 1) % every == 0 and j + 1 < N:
            plain_snaps.append(carry)
    plain_ys = tuple(torch.stack(t) for t in zip(*ys))

    def loss(ys, carry, snaps):
        return toy_loss(ys, carry) + sum((s[0] * (i + 2)).sin().sum() for i, s in enumerate(snaps))

    expected = torch.autograd.grad(loss(plain_ys, carry, plain_snaps), (h0, kept, inp, w))
    recompute = {"plain": False, "recompute": True, "replayed": None}[loop_mode]
    got_ys, got_carry, snaps = run_chunks(toy_step, (h0, kept), (inp, mask), (w,), checkpoint_every=every,
                                          recompute=recompute, snapshots=True)
    assert len(snaps) == len(plain_snaps) == -(-N // every) - 1
    for a, b in zip([t for s in snaps for t in s], [t for s in plain_snaps for t in s]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    got = torch.autograd.grad(loss(got_ys, got_carry, snaps), (h0, kept, inp, w))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        free = run_chunks(toy_step, (h0, kept), (inp, mask), (w,), checkpoint_every=every, snapshots=True)[2]
    for a, b in zip([t for s in free for t in s], [t for s in plain_snaps for t in s]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("snapshots", [False, True])
def test_a_carry_gradient_left_in_a_graph_buffer_is_owned_when_returned(snapshots, monkeypatch):
    """With one unit per stretch the loop hands a unit's carry gradient to the next unit straight from the
    graph's buffer; the one it returns must be its own. Graphs kept across loops (as the cache of graphs
    does) and a second loop's backward must leave the first loop's gradients as they were."""
    from mnemo.kernels import chunk_loop

    kept_graphs: dict = {}

    def cached(step, carry, x, consts, need_x=(), need_consts=(), backward=False):
        key = (x[0].shape[0], backward)
        if key not in kept_graphs:
            kept_graphs[key] = ReplayOnCPU(step, carry, x, consts, need_x, need_consts, backward)
        return kept_graphs[key]

    monkeypatch.setattr(chunk_loop, "_graphs_wanted", lambda _tensors, _n, graphs=None: graphs is not False)
    monkeypatch.setattr(chunk_loop, "graphed_step", cached)

    def grads(scale):
        h0, kept, inp, mask, w = toy_inputs()
        h0 = (h0 * scale).detach().requires_grad_()
        out = run_chunks(toy_step, (h0, kept), (inp, mask), (w,), checkpoint_every=3, snapshots=snapshots)
        loss = toy_loss(out[0], out[1]) + (sum(s[0].sum() for s in out[2]) if snapshots else 0)
        return torch.autograd.grad(loss, (h0, kept, w))

    first = grads(1.0)
    saved = [g.clone() for g in first]
    grads(-2.0)
    for a, b in zip(first, saved):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_gradient_that_shares_another_buffer_is_copied_before_it_is_overwritten():
    from mnemo.kernels.chunk_loop import _unshared

    targets = [torch.arange(4.0).view(2, 2), torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2, 2)]
    own, other, transposed, free = targets[0], targets[0], targets[2].mT, torch.ones(2, 2)
    got = _unshared([own, other, transposed, free, None], targets + [torch.zeros(1)])
    assert got[0] is own and got[3] is free and got[4] is None  # its own target, or no target: as it is
    for i, source in ((1, other), (2, transposed)):  # another's buffer, or a view of its own: copied
        assert got[i] is not source
        assert all(got[i].untyped_storage().data_ptr() != t.untyped_storage().data_ptr() for t in targets)
        torch.testing.assert_close(got[i], source)


def test_a_returned_carry_gradient_is_owned_when_uncaptured_units_follow_a_captured_one(monkeypatch):
    """A unit without a graph (its capture failed) passes the ``kept`` entry's gradient through as the very
    tensor it got, the graph's buffer of the unit after it: the loop must still return its own copy."""
    from mnemo.kernels import chunk_loop

    kept_graphs: dict = {}

    def only_short_units(step, carry, x, consts, need_x=(), need_consts=(), backward=False):
        if x[0].shape[0] != 1:
            return None
        return kept_graphs.setdefault(backward, ReplayOnCPU(step, carry, x, consts, need_x, need_consts, backward))

    monkeypatch.setattr(chunk_loop, "_graphs_wanted", lambda _tensors, _n, graphs=None: graphs is not False)
    monkeypatch.setattr(chunk_loop, "graphed_step", only_short_units)

    def grads(scale):
        h0, kept, inp, mask, w = toy_inputs()
        h0 = (h0 * scale).detach().requires_grad_()  # kept's gradient is the final h: it changes with h0
        ys, carry = run_chunks(toy_step, (h0, kept), (inp, mask), (w,), checkpoint_every=3)
        return torch.autograd.grad(toy_loss(ys, carry), (h0, kept, w))

    first = grads(1.0)
    saved = [g.clone() for g in first]
    grads(-2.0)
    for a, b in zip(first, saved):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("loop_mode", ["recompute", "replayed"])
def test_the_spacing_asked_by_loop_options_is_the_default_one(loop_mode, request):
    """``loop_options(checkpoint_every=...)`` sets the stretches where the caller gives none (seen in the
    snapshots, one per stretch end), keeps plain autograd's gradients, and yields to an explicit spacing."""
    if loop_mode == "replayed":
        request.getfixturevalue("replay_on_cpu")
    h0, kept, inp, mask, w = toy_inputs()
    plain_ys, plain_carry = run_chunks(toy_step, (h0, kept), (inp, mask), (w,), recompute=False)
    expected = torch.autograd.grad(toy_loss(plain_ys, plain_carry), (h0, kept, inp, w))
    recompute = {"recompute": True, "replayed": None}[loop_mode]
    with loop_options(checkpoint_every=2):
        ys, carry, snaps = run_chunks(toy_step, (h0, kept), (inp, mask), (w,), recompute=recompute, snapshots=True)
        assert len(snaps) == -(-N // 2) - 1  # the default for 7 chunks would be 3: two snapshots
        for a, b in zip(torch.autograd.grad(toy_loss(ys, carry), (h0, kept, inp, w)), expected):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        explicit = run_chunks(toy_step, (h0, kept), (inp, mask), (w,), checkpoint_every=7, snapshots=True)[2]
        assert explicit == []
    for bad in (0, "two", -3, 2.5, True):
        with pytest.raises(ValueError, match="checkpoint_every"):
            with loop_options(checkpoint_every=bad):
                pass


@pytest.mark.parametrize("agg", ["grm", "ssc", "residual", "mean"])
@pytest.mark.usefixtures("loop_mode")
def test_mc_titans_whole_segments_run_in_one_loop_and_equal_the_reference(agg, monkeypatch):
    """Whole segments of whole chunks take one chunk loop whose checkpoints are the cached memories
    (mc_titans._segments_in_one_loop); two calls of whole segments equal one reference run."""
    from mnemo.kernels import mc_titans

    taken = []
    original = mc_titans._segments_in_one_loop
    monkeypatch.setattr(mc_titans, "_segments_in_one_loop", lambda *a: taken.append(1) or original(*a))
    spec, Tn = SPECS["clipped"], 24
    gen = torch.Generator().manual_seed(8)
    init = {n: (torch.randn(H, *s, generator=gen, dtype=torch.float64) * 0.5).requires_grad_()
            for n, s in spec.shapes.items()}
    q, k, v, u = (torch.randn(B, Tn, H, DK, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(4))
    alpha = (torch.rand(B, Tn, H, generator=gen, dtype=torch.float64) * 0.5 + 0.5).requires_grad_()
    eta, theta = (torch.rand(B, Tn, H, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(2))
    xs = (q, k, v, u, alpha, eta, theta)
    leaves = [*xs, *init.values()]
    opts = MCOptions(segment_size=6, aggregation=agg, ssc_topk=1, chunk_size=3)
    weight = torch.randn(B, Tn, H, DK, generator=gen, dtype=torch.float64)
    ref = reference_mc_titans(spec, opts, *xs, init)
    expected = grads((ref * weight).sum(), leaves)
    o1, state = chunk_mc_titans(spec, opts, *(x[:, :12] for x in xs), init, MCState.initial(init, B, DK))
    o2, _ = chunk_mc_titans(spec, opts, *(x[:, 12:] for x in xs), init, state)
    assert len(taken) == 2
    out = torch.cat([o1, o2], 1)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for a, b in zip(grads((out * weight).sum(), leaves), expected):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_a_graph_key_changes_with_what_selects_the_kernels(monkeypatch):
    """A captured chunk replays the kernels chosen when it was captured: the backend asked for, the chunk
    kernels' switches, autocast and the float32 matmul precision are part of its key, so that changing any
    of them within a process captures anew."""
    from mnemo.kernels import use_backend
    from mnemo.kernels.chunk_loop import _selection

    monkeypatch.delenv("MNEMO_BACKEND", raising=False)
    seen = {_selection()}
    for backend in ("torch", "triton"):
        with use_backend(backend):
            seen.add(_selection())
    for paths in (dict(chunk_forward="torch"), dict(chunk_backward="torch"), dict(chunk_backward="autograd")):
        with comparison_paths(**paths):
            seen.add(_selection())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        seen.add(_selection())
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if before == "highest" else "highest")
    try:
        seen.add(_selection())
    finally:
        torch.set_float32_matmul_precision(before)
    assert len(seen) == 8


class _ReplayedOnCpu:
    """A stand-in for :class:`~mnemo.kernels.chunk_loop.GraphedStep` on the CPU: static input and output
    buffers that every ``fwd.replay()`` overwrites, as a CUDA graph's do, so that a caller which keeps a
    buffer instead of copying it reads a later unit's values."""

    def __init__(self, step, carry, x, consts, *args, **kwargs):
        from mnemo.kernels.chunk_loop import GraphedStep

        self.load = GraphedStep.load.__get__(self)
        self.step = step
        self.carry, self.x, self.consts = (tuple(t.clone() for t in ts) for ts in (carry, x, consts))
        self.ys, self.carry_out = (tuple(t.clone() for t in ts) for ts in step(self.carry, self.x, self.consts))
        self.fwd = self

    def replay(self):
        ys, carry_out = self.step(self.carry, self.x, self.consts)
        for dst, src in zip(self.ys + self.carry_out, ys + carry_out):
            dst.copy_(src)


@pytest.mark.parametrize("n", [3, 8, 13, 16])
@pytest.mark.parametrize("snapshots", [False, True])
def test_the_captured_prefill_units_equal_the_plain_loop(n, snapshots, monkeypatch):
    """Without gradients the captured loop runs units of 8 chunks (or of the snapshot spacing) and single
    chunks after the last whole unit. With replays that overwrite their buffers (a CPU stand-in for CUDA
    graphs), outputs, final carry and snapshots equal the uncaptured loop's; 13 chunks leave a tail."""
    from mnemo.kernels import chunk_loop

    gen = torch.Generator().manual_seed(3)
    h0, kept0 = torch.randn(B, D, generator=gen), torch.randn(B, D, generator=gen)
    xs = (torch.randn(n, B, D, generator=gen), torch.rand(n, B, generator=gen) > 0.3)
    w = torch.randn(D, D, generator=gen) * 0.5
    loop = dict(checkpoint_every=3, snapshots=snapshots)
    with torch.no_grad():
        want = run_chunks(toy_step, (h0, kept0), xs, (w,), graphs=False, **loop)
        monkeypatch.setattr(chunk_loop, "graphed_step", _ReplayedOnCpu)
        monkeypatch.setattr(chunk_loop, "_graphs_wanted", lambda *a, **k: True)
        got = run_chunks(toy_step, (h0, kept0), xs, (w,), **loop)
    flat = lambda r: [t for part in r for t in (part if isinstance(part, tuple) else  # noqa: E731
                                                 [x for c in part for x in c])]
    assert len(flat(got)) == len(flat(want))
    for x, y in zip(flat(got), flat(want)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
