"""The deep memories' chunk loop on CUDA: the graphed steps equal the eager ones; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from mnemo.kernels.atlas import AtlasState, chunk_atlas
from mnemo.kernels.backend import comparison_paths
from mnemo.kernels.chunk_loop import loop_options
from mnemo.kernels.memory_caching import MCOptions
from mnemo.kernels.mc_titans import MCState, chunk_mc_titans
from mnemo.kernels.mlp_memory import MLPMemorySpec
from mnemo.kernels.titans import TitansState, chunk_titans, reference_titans

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

B, T, H, D = 2, 200, 2, 32
SPEC = MLPMemorySpec(depth=2, d_k=D, d_v=D, expansion=4)


def make_inputs(dtype=torch.float32, seed=0, device="cuda"):
    gen = torch.Generator().manual_seed(seed)
    init = {n: (torch.randn(H, *s, generator=gen) * 0.1).to(device).requires_grad_() for n, s in SPEC.shapes.items()}
    q, k, v, u = (torch.randn(B, T, H, D, generator=gen).to(device, dtype).requires_grad_() for _ in range(4))
    alpha = (torch.rand(B, T, H, generator=gen) * 0.1 + 0.9).to(device).requires_grad_()
    eta = (torch.rand(B, T, H, generator=gen) * 0.5).to(device).requires_grad_()
    theta = (torch.rand(B, T, H, generator=gen) * 0.05).to(device).requires_grad_()
    return init, q, k, v, u, alpha, eta, theta


def titans(init, q, k, v, _u, alpha, eta, theta):
    lengths = torch.tensor([T, T - 37], device=q.device)
    return chunk_titans(SPEC, q, k, v, alpha, eta, theta, TitansState.initial(init, B), chunk_size=16,
                        lengths=lengths)[0]


def mc_titans(init, q, k, v, u, alpha, eta, theta):
    opts = MCOptions(segment_size=64, aggregation="grm", chunk_size=16)
    return chunk_mc_titans(SPEC, opts, q, k, v, u, alpha, eta, theta, init, MCState.initial(init, B, D))[0]


def atlas_muon(init, q, k, v, _u, alpha, eta, theta):
    state = AtlasState.initial(SPEC, init, B, H, 4, "muon")
    return chunk_atlas(SPEC, q, k, v, alpha, theta, eta, alpha, state, optimizer="muon", omega_window=4,
                       chunk_size=16, ns_steps=3)[0]


def output_and_grads(run, inputs):
    init, *xs = inputs
    leaves = [x for x in xs] + list(init.values())
    out = run(init, *xs)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device, out.dtype)
    grads = torch.autograd.grad((out * weight).sum(), leaves, allow_unused=True)
    return [out] + [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]


@pytest.mark.parametrize("run", [titans, mc_titans, atlas_muon])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphed_chunks_equal_eager_chunks(run, dtype):
    inputs = make_inputs(dtype)
    graphed = output_and_grads(run, inputs)
    # the same recompute, uncaptured (plain autograd would run its backward outside the TF32 products)
    with loop_options(graphs=False, recompute=True):
        eager = output_and_grads(run, inputs)
    for a, b in zip(graphed, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("run", [titans, mc_titans, atlas_muon])
def test_graphed_prefill_equals_eager_chunks(run):
    """Without gradients the chunks run in captured units (8 chunks, or MC's stretches of 4) and the chunks
    after the last whole unit one at a time: 13 chunks here, so both kinds run. Same values as uncaptured."""
    inputs = make_inputs()
    init, *xs = inputs
    with torch.no_grad():
        graphed = run(init, *xs)
        with loop_options(graphs=False):
            eager = run(init, *xs)
    torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-6)


def test_prefills_of_any_length_take_two_captures():
    """Units of 8 chunks and single chunks: a prompt of another length captures nothing new."""
    from mnemo.kernels import chunk_loop

    init, q, k, v, u, alpha, eta, theta = make_inputs()
    chunk_loop.release_graphs()

    def prefill(length):
        with torch.no_grad():
            return chunk_titans(SPEC, q[:, :length], k[:, :length], v[:, :length], alpha[:, :length],
                                eta[:, :length], theta[:, :length], TitansState.initial(init, B), chunk_size=16)[0]

    prefill(200)  # 13 chunks: one unit of 8, five single chunks
    captured = len(chunk_loop._GRAPHS)
    assert captured == 2
    prefill(150)  # 10 chunks
    prefill(60)   # 4 chunks
    assert len(chunk_loop._GRAPHS) == captured


def test_graphed_chunks_under_autocast_equal_eager_ones():
    """Within bf16 rounding: the matmuls run in bf16 here, and the captured ones round like the eager
    ones only up to the last bit (max abs difference 3.8e-4 measured on an H100). A graph that replayed
    a stale autocast cast (the cast cache left on while capturing) was off by far more."""
    inputs = make_inputs()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        graphed = output_and_grads(titans, inputs)
    # the same recompute, uncaptured (plain autograd would run its backward outside the TF32 products)
    with loop_options(graphs=False, recompute=True), torch.autocast("cuda", dtype=torch.bfloat16):
        eager = output_and_grads(titans, inputs)
    for a, b in zip(graphed, eager):
        err = ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()
        assert err < 1e-2, err


def test_graphed_titans_equals_the_float64_reference():
    inputs = make_inputs()
    got = output_and_grads(titans, inputs)
    cpu = [{n: w.detach().cpu().double().requires_grad_() for n, w in inputs[0].items()}]
    cpu += [x.detach().cpu().double().requires_grad_() for x in inputs[1:]]
    init, q, k, v, u, alpha, eta, theta = cpu
    lengths = torch.tensor([T, T - 37])
    ref = reference_titans(SPEC, q, k, v, alpha, eta, theta, init, chunk_size=16, lengths=lengths)
    weight = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)).double()
    leaves = [q, k, v, u, alpha, eta, theta] + list(init.values())
    expected = torch.autograd.grad((ref * weight).sum(), leaves, allow_unused=True)
    expected = [ref] + [torch.zeros_like(x) if g is None else g for g, x in zip(expected, leaves)]
    for a, b in zip(got, expected):
        err = (a.cpu().double() - b).norm() / b.norm().clamp(min=1e-30)
        assert err < 1e-4, float(err)


@pytest.mark.parametrize("build", ["titans", "atlas"])
def test_graphed_models_train_alike_with_gradient_checkpointing(build):
    """transformers' gradient checkpointing re-runs each block in the backward, where the chunk loop
    captures and replays its graphs inside autograd's own backward: the gradients are unchanged."""
    from conftest import assert_checkpointing_keeps_the_gradients, tiny_atlas, tiny_mc_titans

    model = (tiny_mc_titans(segment_size=None) if build == "titans" else tiny_atlas()).cuda().train()
    ids = torch.randint(1, 97, (2, 40), generator=torch.Generator().manual_seed(0)).cuda()
    assert_checkpointing_keeps_the_gradients(model, ids, rtol=1e-5, atol=1e-6)


def _real_shape_inputs(dtype, spec, Bn=2, Tn=256, Hn=4):
    gen = torch.Generator().manual_seed(3)
    init = {n: (torch.randn(Hn, *s, generator=gen) * 0.02).cuda().requires_grad_() for n, s in spec.shapes.items()}
    q, k, v, u = (torch.randn(Bn, Tn, Hn, spec.d_k, generator=gen).to("cuda", dtype).requires_grad_()
                  for _ in range(4))
    alpha = (torch.rand(Bn, Tn, Hn, generator=gen) * 0.1 + 0.9).cuda().requires_grad_()
    eta = (torch.rand(Bn, Tn, Hn, generator=gen) * 0.5).cuda().requires_grad_()
    theta = (torch.rand(Bn, Tn, Hn, generator=gen) * 0.1).cuda().requires_grad_()
    return init, q, k, v, u, alpha, eta, theta


def _real_titans(spec):
    def run(init, q, k, v, _u, alpha, eta, theta):
        return chunk_titans(spec, q, k, v, alpha, eta, theta, TitansState.initial(init, q.shape[0]), chunk_size=64)[0]
    return run


def _real_mc(spec, aggregation="grm", segment=128, topk=2):
    def run(init, q, k, v, u, alpha, eta, theta):
        opts = MCOptions(segment_size=segment, aggregation=aggregation, ssc_topk=topk, chunk_size=64)
        return chunk_mc_titans(spec, opts, q, k, v, u, alpha, eta, theta, init,
                               MCState.initial(init, q.shape[0], spec.d_k))[0]
    return run


def _real_atlas(spec, optimizer):
    def run(init, q, k, v, _u, alpha, eta, theta):
        # unit keys as the layer gives them: a window of 16 raw keys of norm 8 diverges either way
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
        state = AtlasState.initial(spec, init, q.shape[0], q.shape[2], 16, optimizer)
        return chunk_atlas(spec, q, k, v, alpha, theta, eta, alpha, state, optimizer=optimizer, omega_window=16,
                           chunk_size=64)[0]
    return run


# The configs' default per-token gradient clip (10), as the layers run them.
WIDE = MLPMemorySpec(depth=2, d_k=256, d_v=256, expansion=4, grad_clip=10.0)
NARROW = MLPMemorySpec(depth=2, d_k=64, d_v=64, expansion=4, grad_clip=10.0)
REAL = {
    "titans_4x256": (WIDE, _real_titans),
    "mc_grm_4x256": (WIDE, _real_mc),
    # four segments, the top memory of up to three: each cached memory reads the queries that chose it
    "mc_ssc1_seg64_4x256": (WIDE, lambda s: _real_mc(s, "ssc", 64, 1)),
    "atlas_gd_16x64": (NARROW, lambda s: _real_atlas(s, "gd")),
    "atlas_momentum_16x64": (NARROW, lambda s: _real_atlas(s, "momentum")),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(REAL))
def test_hand_written_chunks_equal_autograd_over_the_operator_at_real_shapes(name, dtype):
    """The fused chunks (kernels/titans_chunk.py, Triton final updates) against autograd over
    ChunkOperator, both graphed, at the benchmark's head shapes. float32 problems: exact products;
    bf16 problems: TF32 products on both sides, summed in other orders."""
    if "ssc" in name and dtype == torch.bfloat16:
        pytest.skip("the per-segment path scores under TF32: near ties pick another memory there")
    spec, make = REAL[name]
    heads = 16 if "16x64" in name else 4
    inputs = _real_shape_inputs(dtype, spec, Hn=heads)
    fused = output_and_grads(make(spec), inputs)
    with comparison_paths(chunk_backward="autograd"):
        plain = output_and_grads(make(spec), inputs)
    # float32: the momentum gate's gradient is a sum of cancelling terms, 3e-4 / 4e-4 from float64 on
    # either path (fused / autograd, CPU, Atlas momentum 16 x 64, T=256); everything else is within 2e-6.
    # TF32: the gates' gradients sit 3e-2 to 5e-2 from float64 on either path (Atlas momentum 16 x 64 on an
    # H100: retention 3.4e-2 / 3.2e-2, momentum 4.7e-2 / 4.5e-2, fused / autograd); the paths differ by 1.2e-2.
    bound = 1e-3 if dtype == torch.float32 else 3e-2
    for i, (a, b) in enumerate(zip(fused, plain)):
        err = ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()
        assert err < bound, (i, err)


def _real_reads(aggregation):
    """18 memories over 2,048 queries at the benchmark's head shape (4 x 256, MLP x4): three of them (a
    state's) read every query, the others each from the end of its segment of 128; gates of ``grm`` or ssc
    top 2. Returns the spec, ``starts``, ``q``, ``g (N, B, H, T)``, the weights and the reference's outputs."""
    import mnemo.kernels.memory_caching as mc
    from mnemo.kernels.mlp_memory import memory_apply, static_apply

    spec, (Bn, Hn, Tn, seg) = WIDE, (2, 4, 2048, 128)
    starts = (0, 0, 0) + tuple(range(seg, Tn, seg))
    N = len(starts)
    gen = torch.Generator().manual_seed(6)
    q = torch.nn.functional.normalize(torch.randn(Bn, Hn, Tn, spec.d_k, generator=gen), dim=-1).cuda().requires_grad_()
    weights = [(torch.randn(N, Bn, Hn, *shape, generator=gen) * 0.05).cuda().requires_grad_()
               for shape in spec.shapes.values()]
    scores = torch.randn(Bn, Hn, Tn, N + 1, generator=gen).cuda() * 3
    valid = torch.arange(Tn, device="cuda")[:, None] >= torch.tensor(starts + (0,), device="cuda")[None]
    scores = scores.masked_fill(~valid, float("-inf"))
    if aggregation == "ssc":
        scores = torch.cat([mc.ssc_select(scores[..., :N], 2), scores[..., N:]], -1)
    g = torch.softmax(scores, -1)[..., :N].movedim(-1, 0).contiguous().requires_grad_()  # (N, B, H, T)
    names = list(spec.shapes)
    expected = sum(g[j, ..., None] * memory_apply(spec, static_apply({n: w[j] for n, w in zip(names, weights)}), q)
                   for j in range(N))
    return spec, starts, q, g, weights, expected


def _relative_errors(got, expected, leaves, g):
    """The relative errors of ``got`` and its gradients for a random probe against ``expected``'s; the gates'
    (``leaves[1]``) where a gate is nonzero."""
    probe = torch.randn(expected.shape, generator=torch.Generator().manual_seed(7)).cuda()
    got_grads = torch.autograd.grad((got * probe).sum(), leaves)
    expected_grads = torch.autograd.grad((expected * probe).sum(), leaves)
    errors = []
    for i, (a, b) in enumerate(zip((got, *got_grads), (expected, *expected_grads))):
        if i == 2:
            a, b = a * (g > 0), b * (g > 0)
        errors.append(((a.float() - b.float()).norm() / b.float().norm()).item())
    return errors


@pytest.mark.parametrize("aggregation", ["grm", "ssc"])
def test_cached_reads_in_batches_equal_the_reads_memory_by_memory_at_real_shapes(aggregation):
    """The cache's reads of the training path in batches of products against ``sum_j g_j M_j(q)`` written
    memory by memory, float32 products (``use_backend("torch")``: no fused kernels), at the benchmark's head
    shape (:func:`_real_reads`); ssc top 2 makes selective batches of several memories. The gates'
    gradients are compared where a gate is nonzero."""
    import mnemo.kernels.mc_titans as mc
    from mnemo.kernels.backend import use_backend

    spec, starts, q, g, weights, expected = _real_reads(aggregation)
    batches = mc._read_batches(spec, g.detach(), starts, aggregation == "ssc", q.shape[1])
    if aggregation == "grm":
        assert max(b.last - b.first for b in batches) == 3 and len(batches) == len(starts) - 2
    else:
        assert max(b.last - b.first for b in batches if b.pick is not None) > 1
    with use_backend("torch"):
        got = mc._CachedReads.apply(spec, False, batches, q, g, *weights)
    errors = _relative_errors(got, expected, (q, g, *weights), g)
    assert max(errors) < 1e-5, errors


@pytest.mark.parametrize("operands", ["float32", "bf16"])
@pytest.mark.parametrize("aggregation", ["grm", "ssc"])
def test_fused_cached_reads_equal_the_reads_memory_by_memory_at_real_shapes(aggregation, operands, monkeypatch):
    """The fused Triton reads (:mod:`mnemo.kernels.mc_titans_triton`, compiled for this GPU) at the
    benchmark's head shape (:func:`_real_reads`) against ``sum_j g_j M_j(q)`` in float32: exact float32
    operands (Triton asked for, a float32 problem) to 1e-5; bf16 operands (what a bf16 problem takes) to
    bf16's rounding, 1e-2. grm: every memory in one pass; ssc top 2: selective batches of several memories,
    each over its gathered queries."""
    import mnemo.kernels.mc_titans as mc
    import mnemo.kernels.mc_titans_triton as fused
    from mnemo.kernels.backend import use_backend

    calls = []
    forward = fused.cached_reads_forward
    monkeypatch.setattr(fused, "cached_reads_forward", lambda *a: calls.append(a[-1]) or forward(*a))
    spec, starts, q, g, weights, expected = _real_reads(aggregation)
    batches = mc._read_batches(spec, g.detach(), starts, aggregation == "ssc", q.shape[1])
    with use_backend("triton"):
        got = mc._CachedReads.apply(spec, operands == "bf16", batches, q, g, *weights)
    launches = any(b.pick is None for b in batches) + sum(b.pick is not None for b in batches)
    assert launches == (1 if aggregation == "grm" else len(batches))
    assert calls == ["ieee" if operands == "float32" else "tf32"] * launches
    errors = _relative_errors(got, expected, (q, g, *weights), g)
    assert max(errors) < (1e-5 if operands == "float32" else 1e-2), errors


def _layer_of_16_heads(kind: str) -> torch.nn.Module:
    from mnemo import AtlasConfig, MCTitansConfig
    from mnemo.modeling.atlas_layer import AtlasLayer
    from mnemo.modeling.mc_titans_layer import MCTitansLayer

    if kind in ("omeganet", "atlas_momentum"):
        preset, optimizer = ("omeganet", "gd") if kind == "omeganet" else ("atlas", "momentum")
        return AtlasLayer(AtlasConfig.preset(preset, hidden_size=1024, num_heads=16, inner_optimizer=optimizer), 0)
    config = MCTitansConfig(hidden_size=1024, num_heads=16, head_dim=64, memory_expansion=4, inner_chunk_size=64,
                            segment_size=256 if kind == "mc_titans_grm" else None)
    return MCTitansLayer(config, 0)


@pytest.mark.parametrize("kind", ["titans", "mc_titans_grm", "omeganet", "atlas_momentum"])
def test_training_takes_the_persistent_forward_as_its_first_pass(kind, monkeypatch):
    """A bf16 Titans / MC-Titans / Atlas (OmegaNet, momentum: window 16) layer of 16 heads of 64 at 8 x 512
    tokens (128 rows: the persistent kernel's case, TF32) in training: the chunk loop's forward pass is one
    persistent launch a call (two for MC-Titans, whose backward recomputes its memory), and the outputs and
    every gradient equal those with ``FIRST_PASS`` off to two bf16 roundings (the kernels sum their TF32
    products in another order)."""
    import mnemo.kernels.titans_persistent_triton as persistent

    calls = []
    real = persistent.persistent_forward
    monkeypatch.setattr(persistent, "persistent_forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(persistent, "ATLAS_ON_CUDA", True)  # Atlas takes it on CUDA only with the switch
    torch.manual_seed(0)
    layer = _layer_of_16_heads(kind).cuda().to(torch.bfloat16)
    for p in layer.memory_init().values():  # a memory that starts at zero reads zero
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(8, 512, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    got = {}
    for first_pass in (False, True):
        monkeypatch.setattr(persistent, "FIRST_PASS", first_pass)
        calls.clear()
        layer.zero_grad()
        x.grad = None
        y = layer(x)
        y = y[0] if isinstance(y, tuple) else y
        y.float().mul(torch.linspace(-1, 1, y.shape[-1], device="cuda")).sum().backward()
        got[first_pass] = {"output": y.detach(), "x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}
        assert len(calls) == (0 if not first_pass else (2 if kind == "mc_titans_grm" else 1))
    assert got[True].keys() == got[False].keys()
    # bf16: one rounding moves an entry by up to 2^-8 of itself (half an ulp at the bottom of its binade), so
    # two move it by up to 2^-7 of the largest entry: one ulp of an entry at a power of two
    for name, b in got[False].items():
        a = got[True][name]
        assert (a is None) == (b is None), name
        if b is not None:
            assert ((a.double() - b.double()).abs().max() / b.double().abs().max()) <= 2 ** -7, name


@pytest.mark.parametrize("momentum", [True, False], ids=["momentum", "gd"])
@pytest.mark.parametrize("window, C", [(16, 64), (17, 64), (33, 64), (65, 64), (1, 16), (16, 16)])
def test_the_windowed_persistent_forward_at_atlas_shape(momentum, window, C):
    """:func:`persistent_forward` at Atlas' shape (heads of 64, hidden 256, chunks of 64, window 16: 15 keys
    before each chunk, the clip) over 4 chunks of 128 rows in TF32, the check behind ``ATLAS_ON_CUDA``: the
    outputs and final state against the float64 chunk loop within twice the error of the per-chunk kernels
    (:func:`~mnemo.kernels.titans_chunk.chunk_memory`, TF32) on the same problem, and far from the outputs
    without the window's keys. Also the other windows up to ``MAX_WINDOW + 1`` and chunks of 16 (Titans' window
    of 1 among them): at eight warps a window block of fewer than 32 keys is padded to 32, which Triton 3.6
    on Hopper needs (``BLOCKS['least_rows_wide']``)."""
    import mnemo.kernels.titans_persistent_triton as persistent
    from mnemo.kernels.backend import use_backend
    from mnemo.kernels.chunk_loop import tf32_products
    from mnemo.kernels.titans_chunk import chunk_memory
    from test_kernels_titans_persistent import _error, _torch_loop, _window_problem

    spec = MLPMemorySpec(depth=2, d_k=64, d_v=64, expansion=4, grad_clip=10.0)
    problem = _window_problem(spec, momentum, n=4, G=128, C=C, window=window, seed=3)
    W, S, q, k, v, a, b, c, sa, sc = problem
    y64, W64, S64, _ = _torch_loop(spec, *problem, every=4)
    with tf32_products(True):
        res = persistent.persistent_forward(spec, *problem)
        with use_backend("triton"):
            W_c, S_c, ys = {n: w[:, None] for n, w in W.items()}, S and {n: s[:, None] for n, s in S.items()}, []
            for i in range(q.shape[0]):
                per = [None if x is None else x[i][:, None] for x in (q, k, v, a, b, c, sa, sc)]
                y_i, W_c, S_c = chunk_memory(spec, W_c, S_c, *per)
                ys.append(y_i[:, 0])
        P = window - 1
        without = persistent.persistent_forward(spec, W, S, q, k[:, :, P:], v[:, :, P:], a, b, c[..., P:], sa,
                                                None if sc is None else sc[..., P:])
    per_chunk = _error(torch.stack(ys), y64)
    assert _error(res.y, y64) <= 2 * per_chunk + 1e-6, (_error(res.y, y64), per_chunk)
    for n in W:
        bound = 2 * _error(W_c[n][:, 0], W64[n][:, 0]) + 1e-6
        assert _error(res.weights[n], W64[n][:, 0]) <= bound, n
        if momentum:
            assert _error(res.momentum[n], S64[n][:, 0]) <= 2 * _error(S_c[n][:, 0], S64[n][:, 0]) + 1e-6, n
    if window > 1:  # the window's keys move the outputs by far more than the kernels' rounding
        assert _error(without.y, y64) > 10 * per_chunk


def test_soup_captures_its_chunk_step_once_per_cache_size(monkeypatch):
    """MC-Titans soup reads its cache inside the chunk step, whose constants grow by a memory a segment: over 32
    segments of four chunks (the chunk loop captures stretches of more than two) a training step captures a
    graph per cache size and stretch, not one per segment (the empty slots ask for gradients as the fresh
    memories do), and a second step replays every capture: none is evicted between steps."""
    import mnemo.kernels.chunk_loop as loop
    from mnemo import MCTitansConfig
    from mnemo.modeling.mc_titans_layer import MCTitansLayer

    config = MCTitansConfig(hidden_size=256, num_heads=4, head_dim=64, memory_expansion=4, inner_chunk_size=16,
                            segment_size=64, aggregation="soup")
    layer = MCTitansLayer(config, 0).cuda().to(torch.bfloat16)
    for p in layer.memory_init().values():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(1, 2048, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    captures = []

    class Counted(loop.GraphedStep):
        def __init__(self, *args, **kwargs):
            captures.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(loop, "GraphedStep", Counted)
    loop.release_graphs()
    layer(x)[0].float().sum().backward()
    first = len(captures)
    layer(x)[0].float().sum().backward()
    assert 0 < first <= 20, first  # one a segment would be 32 and more
    assert len(captures) == first
