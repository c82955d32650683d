"""The fused reads of cached memories (:mod:`mnemo.kernels.mc_titans_triton`) against the reads written
memory by memory: Triton's interpreter on the CPU, the compiled kernels on CUDA (real shapes: the GPU file)."""

from __future__ import annotations

import pytest
import torch

import mnemo.kernels.mc_titans as mc
import mnemo.kernels.mc_titans_triton as fused
from mnemo.kernels.backend import use_backend
from mnemo.kernels.mlp_memory import MLPMemorySpec, memory_apply, static_apply

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPEC = MLPMemorySpec(depth=2, d_k=16, d_v=16, expansion=4)  # hidden 64: four hidden blocks of 16
# Two of the state's memories (start 0), then memories of later starts: 20 inside a block of 16 queries, 44
# past the last query (no query reads it), 16 twice (two memories of one start). 40 queries: a partial block.
TQ, STARTS = 40, (0, 0, 8, 16, 16, 20, 44)


def problem(seed: int, select: bool):
    """Queries ``(2, 2, TQ, 16)``, gates ``(N, 2, 2, TQ)`` zero before each memory's start and (``select``)
    zero but for a few queries of the memories after the state's, and the memories' weights."""
    gen = torch.Generator().manual_seed(seed)
    N = len(STARTS)
    q = torch.nn.functional.normalize(torch.randn(2, 2, TQ, SPEC.d_k, generator=gen), dim=-1)
    weights = [torch.randn(N, 2, 2, *shape, generator=gen) * 0.3 for shape in SPEC.shapes.values()]
    g = torch.rand(N, 2, 2, TQ, generator=gen) * (torch.arange(TQ)[None] >= torch.tensor(STARTS)[:, None])[:, None, None]
    if select:
        few = torch.rand(N, 2, 2, TQ, generator=gen) < 0.2
        few[2:, :, :, -1] = True
        g = torch.where(torch.arange(N)[:, None, None, None] >= 2, g * few, g)
    q, g, *weights = (x.to(DEVICE).requires_grad_() for x in (q, g, *weights))
    return q, g, weights


def memory_by_memory(q, g, weights):
    names = list(SPEC.shapes)
    return sum(g[j, ..., None] * memory_apply(SPEC, static_apply({n: w[j] for n, w in zip(names, weights)}), q)
               for j in range(g.shape[0]))


@pytest.mark.parametrize("blocks", [(16, 16, 4, 1), (64, 32, 4, 1)], ids=["blocks16", "blocks64"])
@pytest.mark.parametrize("select", [False, True], ids=["every_query", "selective"])
def test_fused_cached_reads_equal_the_reads_memory_by_memory(blocks, select, monkeypatch):
    """``sum_j g_j M_j(q)`` and every gradient through the fused kernels (memories that read every query from
    their start: all of them, or the state's two beside selective batches over their gathered queries) equal
    the reads written memory by memory in float64, to float32's rounding (relative error < 1e-6): blocks of 16 queries (one
    straddles a start, one is partial) and 16 hidden units, or one block of all queries; two rows of two heads
    (a selective batch's rows pair each memory with each batch row). The gates' gradients are compared with
    the reference where a gate is nonzero (elsewhere the aggregations' softmax gives them weight zero), and
    everywhere with the batched products' path, which writes them from each memory's start on."""
    for name in ("FORWARD_BLOCKS", "QUERY_BLOCKS", "WEIGHT_BLOCKS", "FLOAT32_BLOCKS"):
        monkeypatch.setattr(fused, name, blocks)
    calls = []
    monkeypatch.setattr(fused, "cached_reads_forward", _spy(fused.cached_reads_forward, calls))
    q, g, weights = problem(1, select)
    batches = mc._read_batches(SPEC, g.detach(), STARTS, select, 2)
    assert any(b.pick is None for b in batches) and any(b.pick is not None for b in batches) == select
    with use_backend("triton"):
        got = mc._CachedReads.apply(SPEC, False, batches, q, g, *weights)
    assert len(calls) == 1 + sum(b.pick is not None for b in batches)  # the dense memories, each selective batch
    expected = memory_by_memory(q.double(), g.double(), [w.double() for w in weights])
    probe = torch.randn(expected.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(DEVICE)
    got_grads = torch.autograd.grad((got.double() * probe).sum(), (q, g, *weights))
    expected_grads = torch.autograd.grad((expected * probe).sum(), (q, g, *weights))
    for i, (a, b) in enumerate(zip((got, *got_grads), (expected, *expected_grads))):
        if i == 2:
            a, b = a * (g > 0), b * (g > 0)
        assert relative_error(a, b) < 1e-6, i
    assert got_grads[2][6].abs().max() == 0 and got_grads[3][6].abs().max() == 0  # the memory no query reads
    with use_backend("torch"):
        batched = mc._CachedReads.apply(SPEC, False, batches, q, g, *weights)
    dg_batched = torch.autograd.grad((batched.double() * probe).sum(), g)[0]
    assert relative_error(got_grads[1], dg_batched) < 1e-6


def test_fused_cached_reads_in_bf16_operands_stay_within_their_rounding():
    """With bf16 operands (bf16 problems) the reads and gradients stay within bf16's rounding of the float32
    ones (relative error of a few 1e-3), their sums and skip terms being float32."""
    q, g, weights = problem(3, False)
    reads = fused.DenseReads(tuple(range(len(STARTS))), STARTS)
    exact = fused.cached_reads_forward(q.detach(), g.detach(), *(w.detach() for w in weights), reads, "ieee")
    low = fused.cached_reads_forward(q.detach(), g.detach(), *(w.detach().bfloat16() for w in weights), reads, "tf32")
    assert relative_error(low, exact) < 5e-3
    dy = torch.randn(exact.shape, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    grads = []
    for ws in ([w.detach() for w in weights], [w.detach().bfloat16() for w in weights]):
        out = [torch.zeros(x.shape, device=DEVICE) for x in (q, g, *weights)]
        fused.cached_reads_backward(q.detach(), g.detach(), *ws, dy, reads, "ieee", *out)
        grads.append(out)
    for i, (a, b) in enumerate(zip(*grads)):
        assert relative_error(b, a) < 1e-2, i


def test_the_fused_reads_run_only_where_they_compute_the_memory():
    """The fused kernels take float32 MLP memories with an identity skip, no gate, widths they support and
    gates per head, under ``use_backend("triton")`` or for bf16/fp16 problems on CUDA; anything else goes
    through the batched products."""
    q = torch.zeros(2, 2, 8, 16)
    g = torch.zeros(3, 2, 2, 8)
    weights = tuple(torch.zeros(3, 2, 2, *shape) for shape in SPEC.shapes.values())
    with use_backend("triton"):
        assert mc._fused_reads(SPEC, q, g, weights, False) == (torch.float32, "ieee")
        assert mc._fused_reads(SPEC, q, g, weights, True) == fused.operands(True)
        assert mc._fused_reads(SPEC, q, g[:, :, :1], weights, False) is None  # one gate for all heads
        assert mc._fused_reads(SPEC, q.double(), g.double(), tuple(w.double() for w in weights), False) is None
        for other in (MLPMemorySpec(depth=2, gated=True, d_k=16, d_v=16), MLPMemorySpec(depth=1, d_k=16, d_v=16),
                      MLPMemorySpec(depth=2, d_k=16, d_v=32), MLPMemorySpec(depth=2, d_k=8, d_v=8)):
            assert mc._fused_reads(other, q, g, weights, False) is None, other
    with use_backend("torch"):
        assert mc._fused_reads(SPEC, q, g, weights, True) is None
    if not torch.cuda.is_available():
        assert mc._fused_reads(SPEC, q, g, weights, True) is None  # automatic selection: CUDA only
    with pytest.raises(ValueError, match="in order"):
        fused.DenseReads((0, 1), (4, 0))


def test_a_selective_batch_past_the_grid_limit_launches_in_parts(monkeypatch):
    """Rows of heads beyond the grid's limit (a selective batch has one per memory, batch row and head) go in
    several launches that write the same values as one."""
    q, g, weights = problem(7, False)
    reads = fused.DenseReads(tuple(range(len(STARTS))), STARTS)
    args = (q.detach(), g.detach(), *(w.detach() for w in weights))
    whole = fused.cached_reads_forward(*args, reads, "ieee")
    dy = torch.randn(whole.shape, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    grads = []
    for limit in (fused.MAX_GRID_ROWS, 3):  # 4 rows of heads: launches of 3 and 1
        monkeypatch.setattr(fused, "MAX_GRID_ROWS", limit)
        out = [torch.zeros(x.shape, device=DEVICE) for x in args]
        fused.cached_reads_backward(*args, dy, reads, "ieee", *out)
        grads.append([fused.cached_reads_forward(*args, reads, "ieee"), *out])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _spy(fn, calls):
    def wrapped(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)
    return wrapped


@pytest.mark.parametrize("aggregation", ["grm", "ssc", "mean", "residual"])
def test_mc_titans_with_fused_reads_equals_the_reference(aggregation, monkeypatch):
    """The MC-Titans training path on Triton (whole segments in one loop, the cache read by the fused kernels;
    mean and residual weigh every head alike) equals the token-by-token reference, outputs and gradients,
    float32 (relative error < 1e-5)."""
    from mnemo.kernels.memory_caching import MCOptions
    from mnemo.kernels.mc_titans import MCState, chunk_mc_titans, reference_mc_titans

    calls = []
    monkeypatch.setattr(fused, "cached_reads_forward", _spy(fused.cached_reads_forward, calls))
    Bn, Tn, Hn = 2, 48, 2
    spec = MLPMemorySpec(depth=2, d_k=16, d_v=16, expansion=2)
    opts = MCOptions(segment_size=16, aggregation=aggregation, ssc_topk=1, chunk_size=8)
    gen = torch.Generator().manual_seed(5)
    init = {n: torch.randn(Hn, *s, generator=gen) * 0.3 for n, s in spec.shapes.items()}
    q, k, v, u = (torch.randn(Bn, Tn, Hn, 16, generator=gen) for _ in range(4))
    alpha = torch.rand(Bn, Tn, Hn, generator=gen) * 0.1 + 0.9
    eta, theta = torch.rand(Bn, Tn, Hn, generator=gen) * 0.5, torch.rand(Bn, Tn, Hn, generator=gen) * 0.1
    leaves = [x.to(DEVICE).requires_grad_() for x in (q, k, v, u, alpha, eta, theta, *init.values())]

    def run(reference: bool):
        *xs, w1, w2 = leaves
        weights = {"w1": w1, "w2": w2}
        if reference:
            return reference_mc_titans(spec, opts, *(x.double() for x in xs), {n: w.double() for n, w in weights.items()})
        with use_backend("triton"):
            return chunk_mc_titans(spec, opts, *xs, weights, MCState.initial(weights, Bn, 16))[0]

    got = run(False)
    assert calls, "the fused reads did not run"
    expected = run(True)
    probe = torch.randn(expected.shape, generator=gen, dtype=torch.float64).to(DEVICE)
    got_grads = torch.autograd.grad((got.double() * probe).sum(), leaves, allow_unused=True)
    expected_grads = torch.autograd.grad((expected * probe).sum(), leaves, allow_unused=True)
    for i, (a, b) in enumerate(zip((got, *got_grads), (expected, *expected_grads))):
        if b is None:  # u, which mean and residual do not read
            assert a is None or a.abs().max() == 0, i
            continue
        assert relative_error(a, b) < 1e-5, i
