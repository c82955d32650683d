"""Property-based fuzzing of the memory kernels and the model forwards (hypothesis, deterministic).

Every example draws tiny shapes: batch sizes, lengths that include 1, ``chunk - 1``,
``chunk``, ``chunk + 1`` and odd lengths, head widths, left padding (a random number of
padding slots per row, sometimes in front of every row, as a collator padding to a fixed
width does), inner chunk sizes, Memory Caching segment sizes, and float32 or bfloat16
inputs. Nothing may crash and the equivalences must hold:

- kernels: chunked == reference, step-by-step == reference, and a schedule that mixes
  them (a chunk, one step, then a chunk, each row taking its own number of tokens) ==
  reference, all with left padding (``lengths`` / ``live`` / no-op tokens);
- models (every family, every variant of ``conftest.MODEL_VARIANTS``): a left-padded
  batch row == that sample alone, and a full forward == a prefill, one-token decode
  steps and a multi-token continuation through the cache.

Tolerances (errors are ``max |a - b|`` over ``max(1, max |expected|)``, the "scale"; the
numbers measured come from ``MNEMO_FUZZ_SCALE=15``, about a thousand examples per kernel):

- float32 kernels, ``F32_TOL = 1e-5`` of the scale, plus ``COND = 16`` times the float32
  error of the reference itself on that example (its distance to the float64 reference on
  the same inputs). The paths compute the same sums in different orders (WY solves, rank-1
  factorisations, batched matmuls), so they differ by float32 rounding only: measured at
  most 1.2e-6 of the scale (float32's epsilon is 1.2e-7), a margin of 8x that still fails
  on any real discrepancy (the bugs these tests found were off by 1e-4 to 1). The second
  term only matters on ill-conditioned draws: unnormalised deep attention (exp weights in
  the hundreds that cancel) lost 10x more float32 precision in the chunked path than in the
  token-by-token reference on the worst draw found (2.3e-3 against 2.5e-4 on outputs near
  229), while both agree to 3e-14 in float64; Muon's Newton-Schulz step normalises nearly
  zero momenta, whose direction is rounding noise (float32 and float64 references then
  differ by O(1) while the float32 paths agree to 1e-6). Where the reference itself
  overflows float32 (a recurrence that diverges: unnormalised attention feeding the omega
  rule's errors back), only float64 is checked.
- float64 (the chunked path of every example, against the float64 reference):
  ``F64_TOL = 1e-12`` of the scale, plus the float32 allowance scaled by the ratio of the two
  precisions' epsilons; measured at most 2.2e-15, diverging examples included.
- bfloat16 kernel inputs: every kernel promotes its inputs to float32 and keeps its states
  in float32, so states are held to the float32 bound; outputs are rounded back to bfloat16
  by each path, and two float32 values that differ by rounding can round to neighbouring
  bfloat16 numbers, so one bfloat16 unit, ``2**-7`` of the value (8 significant bits), is
  also allowed (measured: at most 0.94 of that unit).
- float32 models, ``F32_TOL`` of the logits' scale: measured at most 1.5e-7.
- bfloat16 models: activations are bfloat16 between layers, so a one-unit difference in a
  kernel output can move the next layer's input by one unit and the logits by a few
  units: ``BF16_MODEL_TOL = 4 * 2**-8`` of the logits' scale (measured: at most 2.0e-3,
  one unit on logits below 0.5).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mnemo import MnemoCache
from mnemo.kernels import chunk_gated_delta, reference_gated_delta, step_gated_delta
from mnemo.kernels.atlas import AtlasState, chunk_atlas, reference_atlas, step_atlas
from mnemo.kernels.deep_attention import chunk_deep_attention, reference_deep_attention, step_deep_attention
from mnemo.kernels.memory_caching import MCOptions, ssc_select
from mnemo.kernels.mc_titans import MCState, chunk_mc_titans, reference_mc_titans, step_mc_titans
from mnemo.kernels.mlp_memory import MLPMemorySpec
from mnemo.kernels.titans import TitansState, chunk_titans, reference_titans, step_titans

from conftest import MODEL_VARIANTS, tiny_deep_transformer, tiny_mc_titans

F32_TOL = 1e-5
COND = 16
F64_TOL = 1e-12
BF16_ULP = 2.0**-7  # spacing of bfloat16 numbers relative to the value, at most
BF16_MODEL_TOL = 4 * 2.0**-8
CHUNKS = [1, 2, 3, 4, 5, 8]
DTYPES = [torch.float32, torch.bfloat16]


# MNEMO_FUZZ_SCALE multiplies every example count, for a longer search than CI's (e.g. 20).
SCALE = float(os.environ.get("MNEMO_FUZZ_SCALE", "1"))


def fuzz_settings(n: int):
    # derandomize: the same examples on every run (CI); no deadline: the references are Python loops.
    return settings(max_examples=max(1, round(n * SCALE)), deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- strategies


def lengths_near(chunk: int):
    """1, chunk - 1, chunk, chunk + 1, 2 chunk, or an odd length up to 13."""
    special = sorted({1, max(chunk - 1, 1), chunk, chunk + 1, 2 * chunk})
    return st.one_of(st.sampled_from(special), st.integers(0, 6).map(lambda i: 2 * i + 1))


@st.composite
def layouts(draw):
    """A chunk size, per-row lengths and a padded width ``T >= max(lengths)`` (left padding)."""
    chunk = draw(st.sampled_from(CHUNKS))
    batch = draw(st.integers(1, 3))
    lengths = [draw(lengths_near(chunk)) for _ in range(batch)]
    if draw(st.booleans()):
        lengths[draw(st.integers(0, batch - 1))] = 0  # a row with no token at all
    # Extra columns put padding in front of every row, even the longest.
    width = max(max(lengths) + draw(st.integers(0, 2)), 1)
    return chunk, torch.tensor(lengths), width


def first_takes(chunk: int, batch: int, segment: int | None = None):
    """Tokens each row takes in a schedule's first call: often just before, at or after a chunk
    (or segment) end, where a continuation must pick up the chunk (or segment) state."""
    ends = {chunk - 1, chunk, chunk + 1}
    if segment:
        ends |= {segment - 1, segment, 2 * segment - 1}
    point = st.one_of(st.sampled_from(sorted(ends)), st.integers(0, 9))
    return st.lists(point, min_size=batch, max_size=batch).map(torch.tensor)


# --------------------------------------------------------------------------- helpers


def randn(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def rand(gen, *shape, low=0.0, high=1.0):
    return torch.rand(*shape, generator=gen) * (high - low) + low


def left_valid(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """``(B, width)`` bool: each row's tokens are its last ``lengths[b]`` slots."""
    return torch.arange(width)[None] >= (width - lengths)[:, None]


def rows_from(x: torch.Tensor | None, start: torch.Tensor, width: int) -> torch.Tensor | None:
    """Tokens ``[start_b, start_b + width)`` of every row of ``x (B, T, ...)`` (clamped to ``T``)."""
    if x is None:
        return None
    B, T = x.shape[:2]
    idx = (start[:, None] + torch.arange(width)[None]).clamp(max=T - 1)
    return x.gather(1, idx.view(B, width, *([1] * (x.dim() - 2))).expand(B, width, *x.shape[2:]))


def compact(x, lengths, width):
    """Left-padded ``x`` with each row's tokens moved to the front; the tail keeps other (finite)
    values, which the kernels must ignore past ``lengths``."""
    return rows_from(x, width - lengths, width)


def scale_of(expected: torch.Tensor) -> float:
    return max(1.0, expected.double().abs().max().item()) if expected.numel() else 1.0


def cast_floats(obj, dtype):
    """``obj`` with every floating tensor (also inside dicts, lists and tuples) cast to ``dtype``."""
    if torch.is_tensor(obj):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {k: cast_floats(v, dtype) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cast_floats(v, dtype) for v in obj)
    return obj


def reference_with_slack(reference, *args, **kwargs):
    """The reference on the inputs as given, ``COND`` times its own float32 error (the largest
    difference between its float32 and float64 results on the same, already rounded, inputs), and
    its float64 result."""
    expected = reference(*args, **kwargs)
    # float32 copies compute exactly what bfloat16 inputs compute (promoted to float32), unrounded.
    f32_args, f32_kwargs = cast_floats(args, torch.float32), cast_floats(kwargs, torch.float32)
    rounded = any(torch.is_tensor(x) and x.dtype == torch.bfloat16 for x in (*args, *kwargs.values()))
    in_f32 = reference(*f32_args, **f32_kwargs) if rounded else expected
    in_f64 = reference(*cast_floats(args, torch.float64), **cast_floats(kwargs, torch.float64))
    pairs = zip(in_f32, in_f64) if isinstance(in_f64, tuple) else [(in_f32, in_f64)]
    own_error = max(((a.double() - b).abs().max().item() if b.numel() else 0.0) for a, b in pairs)
    # A recurrence that diverges (unnormalised deep attention feeding its errors back) can overflow
    # float32 in the reference itself: such an example is checked in float64 only (infinite slack).
    return expected, COND * own_error if math.isfinite(own_error) else math.inf, in_f64


def assert_float64_close(actual, exact, slack, what):
    """A float64 path against the float64 reference: ``F64_TOL`` of the scale, plus the float32
    slack scaled down by the ratio of the two precisions (the same conditioning, float64 rounding)."""
    bound = F64_TOL * scale_of(exact) + (slack * 2.0**-29 if math.isfinite(slack) else 0.0)
    err = (actual - exact).abs().max().item() if exact.numel() else 0.0
    assert actual.dtype == torch.float64 and err <= bound, f"{what} in float64: error {err:.3g}"


def assert_kernel_close(actual, expected, dtype, what, slack=0.0):
    """``F32_TOL`` of the scale plus ``slack``; bfloat16 outputs may also differ by one bfloat16 unit."""
    if math.isinf(slack):
        return  # float32 overflowed in the reference: see reference_with_slack
    actual, expected = actual.double(), expected.double()
    bound = F32_TOL * scale_of(expected) + slack + (BF16_ULP * expected.abs() if dtype == torch.bfloat16 else 0.0)
    excess = (actual - expected).abs() - bound
    assert actual.shape == expected.shape, what
    assert torch.isfinite(actual).all(), f"{what}: not finite"
    assert not (excess > 0).any(), f"{what}: max error {(actual - expected).abs().max().item():.3g}"


def resume_schedule(chunk, step, xs, lengths, first):
    """Run compacted inputs ``xs (B, T, ...)`` as: a chunk of ``min(first_b, lengths_b)`` tokens per row,
    one step for the rows with tokens left, then a chunk of the rest; outputs placed per row."""
    B = lengths.shape[0]
    consumed = torch.zeros(B, dtype=torch.long)
    placed, state = [], None
    for phase in ("chunk", "step", "chunk"):
        if phase == "step":
            take = (consumed < lengths).long()
            o, state = step([None if x is None else x[:, 0] for x in (rows_from(x, consumed, 1) for x in xs)],
                            take.bool(), state)
            o = o[:, None]
        else:
            take = torch.minimum(first, lengths) if not placed else lengths - consumed
            width = max(int(take.max()), 1)
            o, state = chunk([rows_from(x, consumed, width) for x in xs], take, state)
        placed.append((o, consumed.clone(), take))
        consumed = consumed + take
    assert torch.equal(consumed, lengths)
    return placed


def check_placed(placed, expected, dtype, what, slack):
    for o, start, take in placed:
        for b in range(expected.shape[0]):
            s, n = int(start[b]), int(take[b])
            assert_kernel_close(o[b, :n], expected[b, s:s + n], dtype, f"{what}, row {b}", slack)


def check_left_padded(out, expected, lengths, width, dtype, what, slack):
    """``out`` in the left-padded layout against ``expected`` compacted."""
    for b, n in enumerate(lengths.tolist()):
        assert_kernel_close(out[b, width - n:], expected[b, :n], dtype, f"{what}, row {b}", slack)


# --------------------------------------------------------------------------- gated delta rule


@fuzz_settings(100)
@given(layout=layouts(), heads=st.integers(1, 2), d_k=st.integers(1, 5), d_v=st.integers(1, 4),
       gated=st.booleans(), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1))
def test_gated_delta_chunk_step_reference(layout, heads, d_k, d_v, gated, dtype, seed):
    """Left padding as no-op tokens (beta = g = 0), and as varlen sequences (cu_seqlens)."""
    C, lengths, T = layout
    B = lengths.numel()
    gen = torch.Generator().manual_seed(seed)
    q, k = randn(gen, B, T, heads, d_k, dtype=dtype), randn(gen, B, T, heads, d_k, dtype=dtype)
    v = randn(gen, B, T, heads, d_v, dtype=dtype)
    valid = left_valid(lengths, T)
    g = -rand(gen, B, T, heads, high=3.0) * valid[..., None] if gated else None
    beta = rand(gen, B, T, heads) * valid[..., None]
    S0 = randn(gen, B, heads, d_k, d_v)

    o_chunk, s_chunk = chunk_gated_delta(q, k, v, g, beta, initial_state=S0, chunk_size=C)
    o_64, s_64 = chunk_gated_delta(*cast_floats((q, k, v, g, beta, S0), torch.float64)[:5],
                                   initial_state=S0.double(), chunk_size=C)
    state, steps = S0, []
    for t in range(T):
        o, state = step_gated_delta(q[:, t], k[:, t], v[:, t], None if g is None else g[:, t], beta[:, t], state)
        steps.append(o)
    o_step = torch.stack(steps, 1)
    # a chunk, one step and a chunk, carrying the state
    cut = min(T - 1, T // 2)
    o1, s = chunk_gated_delta(*(None if x is None else x[:, :cut] for x in (q, k, v, g, beta)), initial_state=S0,
                              chunk_size=C)
    o2, s = step_gated_delta(*(None if x is None else x[:, cut] for x in (q, k, v, g, beta)), s)
    o3, s_mixed = chunk_gated_delta(*(None if x is None else x[:, cut + 1:] for x in (q, k, v, g, beta)),
                                    initial_state=s, chunk_size=C)
    o_mixed = torch.cat([o1, o2[:, None], o3], 1)
    # the valid tokens of every row packed as varlen sequences
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    packed = [None if x is None else x[valid][None] for x in (q, k, v, g, beta)]
    o_var, s_var = chunk_gated_delta(*packed, initial_state=S0, cu_seqlens=cu, chunk_size=C)

    for b, n in enumerate(lengths.tolist()):
        alone = [None if x is None else x[b:b + 1, T - n:] for x in (q, k, v, g, beta)]
        (o_ref, s_ref), slack, (o_exact, s_exact) = reference_with_slack(reference_gated_delta, *alone,
                                                                          initial_state=S0[b:b + 1])
        assert_float64_close(o_64[b:b + 1, T - n:], o_exact, slack, f"chunk output, row {b}")
        assert_float64_close(s_64[b:b + 1], s_exact, slack, f"chunk state, row {b}")
        for name, o, s in (("chunk", o_chunk, s_chunk), ("step", o_step, state), ("mixed", o_mixed, s_mixed)):
            assert_kernel_close(o[b:b + 1, T - n:], o_ref, dtype, f"{name} output, row {b}", slack)
            assert_kernel_close(s[b:b + 1], s_ref, torch.float32, f"{name} state, row {b}", slack)
        start = int(cu[b])
        assert_kernel_close(o_var[:, start:start + n], o_ref, dtype, f"varlen output, row {b}", slack)
        assert_kernel_close(s_var[b:b + 1], s_ref, torch.float32, f"varlen state, row {b}", slack)
    assert s_chunk.dtype == s_var.dtype == torch.float32 and o_chunk.dtype == dtype


# --------------------------------------------------------------------------- Titans


def titans_spec(depth: int, gated: bool, width: int) -> MLPMemorySpec:
    return MLPMemorySpec(depth=depth, gated=gated and depth == 2, d_k=width, d_v=width, expansion=2)


def titans_inputs(gen, spec, B, T, H, dtype):
    init = {n: randn(gen, H, *s, scale=0.5, dtype=dtype) for n, s in spec.shapes.items()}
    q, k, v, u = (randn(gen, B, T, H, spec.d_k, dtype=dtype) for _ in range(4))
    alpha = rand(gen, B, T, H, low=0.5)
    eta = rand(gen, B, T, H)
    theta = rand(gen, B, T, H, high=0.1)
    return init, (q, k, v, u, alpha, eta, theta)


@fuzz_settings(80)
@given(layout=layouts(), heads=st.integers(1, 2), width=st.integers(1, 4), depth=st.sampled_from([1, 2]),
       gated=st.booleans(), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_titans_chunk_step_reference(layout, heads, width, depth, gated, dtype, seed, data):
    """Linear, MLP and gated memories; rows compacted with ``lengths`` (chunk) or stepped with ``live``."""
    C, lengths, T = layout
    B = lengths.numel()
    first = data.draw(first_takes(C, B), label="first call")
    gen = torch.Generator().manual_seed(seed)
    spec = titans_spec(depth, gated, width)
    init, (q, k, v, _, alpha, eta, theta) = titans_inputs(gen, spec, B, T, heads, dtype)
    xs = (q, k, v, alpha, eta, theta)
    packed = [compact(x, lengths, T) for x in xs]
    ref, slack, exact = reference_with_slack(reference_titans, spec, *packed, init, chunk_size=C, lengths=lengths)
    init_64 = cast_floats(init, torch.float64)
    out_64, _ = chunk_titans(spec, *cast_floats(packed, torch.float64), TitansState.initial(init_64, B),
                             chunk_size=C, lengths=lengths)
    assert_float64_close(out_64, exact, slack, "chunk")

    out, _ = chunk_titans(spec, *packed, TitansState.initial(init, B), chunk_size=C, lengths=lengths)
    for b, n in enumerate(lengths.tolist()):
        assert_kernel_close(out[b, :n], ref[b, :n], dtype, f"chunk, row {b}", slack)
    assert (out[lengths[:, None] <= torch.arange(T)[None]] == 0).all(), "outputs past a row's length are 0"

    valid, state, steps = left_valid(lengths, T), TitansState.initial(init, B), []
    for t in range(T):
        o, state = step_titans(spec, *(x[:, t] for x in xs), state, chunk_size=C, live=valid[:, t])
        steps.append(o)
    check_left_padded(torch.stack(steps, 1), ref, lengths, T, dtype, "step", slack)

    def chunk(parts, take, state):
        return chunk_titans(spec, *parts, state or TitansState.initial(init, B), chunk_size=C, lengths=take)

    def step(parts, live, state):
        return step_titans(spec, *parts, state, chunk_size=C, live=live)

    placed = resume_schedule(chunk, step, packed, lengths, first)
    check_placed(placed, ref, dtype, "chunk, step, chunk", slack)


# --------------------------------------------------------------------------- Memory Caching


@st.composite
def mc_options(draw, chunk: int):
    segmentation = draw(st.sampled_from(["constant", "constant", "logarithmic"]))
    # Short segments first: many cached memories in few tokens (hypothesis favours early choices).
    segment = draw(st.sampled_from([2, 1, 3, 5, 6, 8, None])) if segmentation == "constant" else 4
    mode = draw(st.sampled_from(["checkpoint", "independent"])) if segmentation == "constant" else "checkpoint"
    return MCOptions(segment_size=segment, segmentation=segmentation, cache_mode=mode,
                     aggregation=draw(st.sampled_from(["ssc", "grm", "soup", "residual", "mean"])),
                     ssc_topk=draw(st.integers(1, 2)), chunk_size=chunk)


@fuzz_settings(200)
@given(data=st.data(), layout=layouts(), heads=st.integers(1, 2), width=st.integers(2, 4),
       depth=st.sampled_from([1, 2]), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1))
def test_memory_caching_chunk_step_reference(data, layout, heads, width, depth, dtype, seed):
    """Every aggregation, constant (or no) and logarithmic segments, checkpoint and independent modes."""
    # Head width >= 2: with width 1 every normalised key is +-1 (up to the L2 epsilon), so ssc's
    # scores are near-ties that the paths' different rounding may order differently (a legitimate
    # discontinuity of a top-k choice, not an error). Exact ties come from a zero gate projection
    # (the state ``convert to-mc`` leaves), where every path must keep every tied memory.
    C, lengths, T = layout
    B = lengths.numel()
    opts = data.draw(mc_options(C))
    first = data.draw(first_takes(C, B, opts.segment_size), label="first call")
    gen = torch.Generator().manual_seed(seed)
    spec = titans_spec(depth, False, width)
    init, xs = titans_inputs(gen, spec, B, T, heads, dtype)
    if opts.aggregation in ("grm", "soup", "ssc") and data.draw(st.booleans(), label="zero gate projection"):
        xs = xs[:3] + (torch.zeros_like(xs[3]),) + xs[4:]
    packed = [compact(x, lengths, T) for x in xs]
    ref, slack, exact = reference_with_slack(reference_mc_titans, spec, opts, *packed, init, lengths=lengths)
    init_64 = cast_floats(init, torch.float64)
    out_64, _ = chunk_mc_titans(spec, opts, *cast_floats(packed, torch.float64), init_64,
                                MCState.initial(init_64, B, width), lengths=lengths)
    assert_float64_close(out_64, exact, slack, "chunk")

    out, _ = chunk_mc_titans(spec, opts, *packed, init, MCState.initial(init, B, width), lengths=lengths)
    for b, n in enumerate(lengths.tolist()):
        assert_kernel_close(out[b, :n], ref[b, :n], dtype, f"chunk, row {b}", slack)

    valid, state, steps = left_valid(lengths, T), MCState.initial(init, B, width), []
    for t in range(T):
        o, state = step_mc_titans(spec, opts, *(x[:, t] for x in xs), init, state, live=valid[:, t])
        steps.append(o)
    check_left_padded(torch.stack(steps, 1), ref, lengths, T, dtype, "step", slack)

    def chunk(parts, take, state):
        return chunk_mc_titans(spec, opts, *parts, init, state or MCState.initial(init, B, width), lengths=take)

    def step(parts, live, state):
        return step_mc_titans(spec, opts, *parts, init, state, live=live)

    placed = resume_schedule(chunk, step, packed, lengths, first)
    check_placed(placed, ref, dtype, "chunk, step, chunk", slack)


# --------------------------------------------------------------------------- Atlas


@fuzz_settings(80)
@given(layout=layouts(), heads=st.integers(1, 2), d_v=st.integers(1, 4), extra_k=st.integers(0, 2),
       depth=st.sampled_from([1, 2]), gated=st.booleans(), objective=st.sampled_from(["l2", "dot"]),
       optimizer=st.sampled_from(["gd", "momentum", "muon"]), window=st.sampled_from([1, 2, 3, 5]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_atlas_chunk_step_reference(layout, heads, d_v, extra_k, depth, gated, objective, optimizer, window, dtype,
                                    seed, data):
    """Every optimiser, Omega window, objective and memory shape (with a linear skip when d_k != d_v)."""
    C, lengths, T = layout
    B = lengths.numel()
    first = data.draw(first_takes(C, B), label="first call")
    gen = torch.Generator().manual_seed(seed)
    spec = MLPMemorySpec(depth=depth, gated=gated and depth == 2, d_k=d_v + extra_k, d_v=d_v, expansion=2,
                            objective=objective)
    init = {n: randn(gen, heads, *s, scale=0.5, dtype=dtype) for n, s in spec.shapes.items()}
    q, k = randn(gen, B, T, heads, spec.d_k, dtype=dtype), randn(gen, B, T, heads, spec.d_k, dtype=dtype)
    v = randn(gen, B, T, heads, d_v, dtype=dtype)
    alpha, lr, gamma = rand(gen, B, T, heads, low=0.5), rand(gen, B, T, heads, high=0.05), rand(gen, B, T, heads)
    momentum = None if optimizer == "gd" else rand(gen, B, T, heads, high=0.5)
    xs = (q, k, v, alpha, lr, momentum, gamma)
    opts = dict(optimizer=optimizer, omega_window=window, chunk_size=C, ns_steps=3)
    packed = [None if x is None else compact(x, lengths, T) for x in xs]
    ref, slack, exact = reference_with_slack(reference_atlas, spec, *packed, init, lengths=lengths, **opts)
    init_64 = cast_floats(init, torch.float64)
    out_64, _ = chunk_atlas(spec, *cast_floats(packed, torch.float64),
                            AtlasState.initial(spec, init_64, B, heads, window, optimizer), lengths=lengths, **opts)
    assert_float64_close(out_64, exact, slack, "chunk")

    def initial():
        return AtlasState.initial(spec, init, B, heads, window, optimizer)

    out, _ = chunk_atlas(spec, *packed, initial(), lengths=lengths, **opts)
    for b, n in enumerate(lengths.tolist()):
        assert_kernel_close(out[b, :n], ref[b, :n], dtype, f"chunk, row {b}", slack)

    valid, state, steps = left_valid(lengths, T), initial(), []
    for t in range(T):
        o, state = step_atlas(spec, *(None if x is None else x[:, t] for x in xs), state, live=valid[:, t], **opts)
        steps.append(o)
    check_left_padded(torch.stack(steps, 1), ref, lengths, T, dtype, "step", slack)

    def chunk(parts, take, state):
        return chunk_atlas(spec, *parts, state or initial(), lengths=take, **opts)

    def step(parts, live, state):
        return step_atlas(spec, *parts, state, live=live, **opts)

    placed = resume_schedule(chunk, step, packed, lengths, first)
    check_placed(placed, ref, dtype, "chunk, step, chunk", slack)


# --------------------------------------------------------------------------- DeepTransformer memory


@st.composite
def deep_options(draw, chunk: int):
    depth = draw(st.sampled_from([1, 2]))
    rule = "omega" if depth == 1 else draw(st.sampled_from(["hebbian", "omega"]))
    return dict(memory_depth=depth, learning_rule=rule,
                omega_window=1 if rule == "hebbian" else draw(st.sampled_from([1, 2, 3, 5])),
                chunk_size=chunk, normalize=draw(st.sampled_from([True, True, False])))


@fuzz_settings(80)
@given(data=st.data(), layout=layouts(), heads=st.integers(1, 2), d_k=st.integers(1, 4), d_v=st.integers(1, 3),
       hidden=st.integers(1, 4), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1))
def test_deep_attention_chunk_step_reference(data, layout, heads, d_k, d_v, hidden, dtype, seed):
    """Hebbian and omega rules, linear and deep branches, softmax and unnormalised reads."""
    C, lengths, T = layout
    B = lengths.numel()
    opts = data.draw(deep_options(C))
    first = data.draw(first_takes(C, B), label="first call")
    gen = torch.Generator().manual_seed(seed)
    q, k = randn(gen, B, T, heads, d_k, dtype=dtype), randn(gen, B, T, heads, d_k, dtype=dtype)
    v = randn(gen, B, T, heads, d_v, dtype=dtype)
    eta, gamma = rand(gen, B, T, heads), rand(gen, B, T, heads)
    w1 = randn(gen, heads, d_v, hidden, scale=0.5)
    xs = (q, k, v, eta, gamma)
    packed = [compact(x, lengths, T) for x in xs]
    ref, slack, exact = reference_with_slack(reference_deep_attention, *packed, w1, lengths=lengths, **opts)
    out_64, _ = chunk_deep_attention(*cast_floats(packed, torch.float64), w1.double(), lengths=lengths, **opts)
    assert_float64_close(out_64, exact, slack, "chunk")

    out, _ = chunk_deep_attention(*packed, w1, lengths=lengths, **opts)
    for b, n in enumerate(lengths.tolist()):
        assert_kernel_close(out[b, :n], ref[b, :n], dtype, f"chunk, row {b}", slack)

    # One token per row and call; a padded slot is a row with no token (length 0) in that call.
    valid, state, steps = left_valid(lengths, T), None, []
    for t in range(T):
        o, state = step_deep_attention(*(x[:, t] for x in xs), w1, state, lengths=valid[:, t].long(), **opts)
        steps.append(o)
    check_left_padded(torch.stack(steps, 1), ref, lengths, T, dtype, "step", slack)

    def chunk(parts, take, state):
        return chunk_deep_attention(*parts, w1, lengths=take, initial_state=state, **opts)

    def step(parts, live, state):
        return step_deep_attention(*parts, w1, state, lengths=live.long(), **opts)

    placed = resume_schedule(chunk, step, packed, lengths, first)
    check_placed(placed, ref, dtype, "chunk, step, chunk", slack)


# --------------------------------------------------------------------------- models


FAMILIES = ("mom", "deep", "mc", "atlas")


@st.composite
def model_cases(draw, family: str):
    """A variant of ``family`` with drawn chunk (and segment) sizes, a left-padded batch and a dtype."""
    name = draw(st.sampled_from(sorted(n for n in MODEL_VARIANTS if n.startswith(family + "-"))))
    build, variant = MODEL_VARIANTS[name]
    overrides = dict(variant)
    chunk = draw(st.sampled_from(CHUNKS))
    overrides["chunk_size" if family == "mom" else "inner_chunk_size"] = chunk
    # Memory Caching variants (MC-Titans' default segment is 6): constant segments of a drawn size.
    segment = overrides.get("segment_size", 6 if family == "mc" else None)
    if segment is not None and overrides.get("segmentation", "constant") == "constant":
        overrides["segment_size"] = draw(st.sampled_from([1, 2, 3, 5, 6, 8]))
    batch = draw(st.integers(1, 4))
    lengths = [draw(lengths_near(chunk)) for _ in range(batch)]
    width = max(lengths) + draw(st.integers(0, 2))
    dtype = draw(st.sampled_from(DTYPES))
    return name, build, overrides, lengths, width, dtype, draw(st.integers(0, 2**31 - 1))


def build_case(build, overrides, lengths, width, dtype, seed):
    model = build(seed=seed % 1000, **overrides).to(dtype)
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(1, 97, (n,), generator=gen) for n in lengths]
    # Padding slots hold random tokens, not the pad id: whatever they hold must not matter.
    ids = torch.randint(1, 97, (len(seqs), width), generator=gen)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = s
        mask[i, width - len(s):] = 1
    return model, seqs, ids, mask


def assert_logits_close(actual, expected, dtype, what):
    actual, expected = actual.double(), expected.double()
    assert torch.isfinite(actual).all(), f"{what}: logits not finite"
    err = (actual - expected).abs().max().item() / scale_of(expected)
    assert err <= (F32_TOL if dtype == torch.float32 else BF16_MODEL_TOL), f"{what}: error {err:.3g}"


@pytest.mark.parametrize("family", FAMILIES)
@fuzz_settings(24)
@given(data=st.data())
def test_left_padded_rows_equal_samples_alone(family, data):
    name, build, overrides, lengths, width, dtype, seed = data.draw(model_cases(family), label="case")
    model, seqs, ids, mask = build_case(build, overrides, lengths, width, dtype, seed)
    with torch.no_grad():
        batch = model(ids, attention_mask=mask).logits
        assert batch.dtype == dtype
        for i, s in enumerate(seqs):
            alone = model(s[None]).logits[0]
            assert_logits_close(batch[i, width - len(s):], alone, dtype, f"{name} {overrides} row {i}")


@pytest.mark.parametrize("family", FAMILIES)
@fuzz_settings(24)
@given(data=st.data())
def test_prefill_decode_and_continuation_equal_forward(family, data):
    """A prefill, one-token decode steps, then the rest in one call through the cache == one forward."""
    name, build, overrides, lengths, width, dtype, seed = data.draw(model_cases(family), label="case")
    model, seqs, ids, mask = build_case(build, overrides, lengths, width, dtype, seed)
    prefill = data.draw(st.integers(1, width), label="prefill")
    decoded = data.draw(st.integers(prefill, width), label="decoded up to")
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        cache, parts = MnemoCache(model.config.num_hidden_layers), []
        bounds = [(0, prefill)] + [(t, t + 1) for t in range(prefill, decoded)] + [(decoded, width)]
        for a, b in bounds:
            if b > a:
                out = model(ids[:, a:b], attention_mask=mask[:, :b], past_key_values=cache, use_cache=True)
                parts.append(out.logits)
    assert cache.get_seq_length() == width
    keep = mask.bool()
    what = f"{name} {overrides} lengths {lengths} prefill {prefill} decoded {decoded}"
    assert_logits_close(torch.cat(parts, 1)[keep], full[keep], dtype, what)
    if dtype == torch.bfloat16:
        for layer in cache:
            for key, tensor in layer.states.items():
                if key.split(".")[-1] in ("recurrent", "us", "targets", "w1", "w", "w2", "w3", "w0"):
                    assert tensor.dtype == torch.float32, f"{name}: state {key} is {tensor.dtype}"


# --------------------------------------------------------------------------- regressions


def test_deep_attention_longest_row_filling_its_last_chunk_in_a_wider_call():
    """The longest row's length is a multiple of the chunk size and the call has more slots (padding
    columns): its last token's query was overwritten by a padded slot's (zeros)."""
    gen = torch.Generator().manual_seed(0)
    B, T, H, D = 2, 9, 2, 3
    q, k, v = (torch.randn(B, T, H, D, generator=gen) for _ in range(3))
    eta, gamma = torch.rand(B, T, H, generator=gen), torch.rand(B, T, H, generator=gen)
    w1 = torch.randn(H, D, 4, generator=gen)
    lengths = torch.tensor([4, 3])
    for opts in (dict(memory_depth=2, learning_rule="hebbian"), dict(memory_depth=1, learning_rule="omega",
                                                                      omega_window=2)):
        ref = reference_deep_attention(q, k, v, eta, gamma, w1, lengths=lengths, chunk_size=4, **opts)
        out, _ = chunk_deep_attention(q, k, v, eta, gamma, w1, lengths=lengths, chunk_size=4, **opts)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_deep_transformer_batch_padded_in_front_of_every_row():
    """Padding to a fixed width (``pad_to_multiple_of``) leaves padding before the longest row too."""
    for overrides in ({}, {"learning_rule": "omega", "omega_window": 3}):
        model = tiny_deep_transformer(**overrides)
        seqs = [torch.randint(1, 97, (n,)) for n in (4, 3)]
        ids = torch.zeros(2, 5, dtype=torch.long)
        mask = torch.zeros(2, 5, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, 5 - len(s):], mask[i, 5 - len(s):] = s, 1
        with torch.no_grad():
            batch = model(ids, attention_mask=mask).logits
            for i, s in enumerate(seqs):
                torch.testing.assert_close(batch[i, 5 - len(s):], model(s[None]).logits[0], rtol=0, atol=1e-5)


def test_memory_caching_chunk_after_a_step_that_closes_a_segment():
    """Segments of 6 tokens, inner chunks of 4: a one-token step ending a segment leaves the memory at
    position 2 of its chunk; the next multi-token call starts a segment and must start a fresh chunk."""
    spec = MLPMemorySpec(depth=2, d_k=4, d_v=4, expansion=2)
    gen = torch.Generator().manual_seed(0)
    init, xs = titans_inputs(gen, spec, 2, 12, 2, torch.float32)
    opts = MCOptions(segment_size=6, chunk_size=4, aggregation="grm")
    ref = reference_mc_titans(spec, opts, *xs, init)
    o1, state = chunk_mc_titans(spec, opts, *(x[:, :5] for x in xs), init, MCState.initial(init, 2, 4))
    o2, state = step_mc_titans(spec, opts, *(x[:, 5] for x in xs), init, state)
    o3, state = chunk_mc_titans(spec, opts, *(x[:, 6:] for x in xs), init, state)
    torch.testing.assert_close(torch.cat([o1, o2[:, None], o3], 1), ref, rtol=0, atol=1e-5)

    model = tiny_mc_titans()  # segment_size=6, inner_chunk_size=4
    ids = torch.randint(1, 97, (2, 16))
    with torch.no_grad():
        full = model(ids).logits
        cache, parts = MnemoCache(model.config.num_hidden_layers), []
        for a, b in [(0, 5), (5, 6), (6, 11), (11, 16)]:
            parts.append(model(ids[:, a:b], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-5)


def test_ssc_ties_keep_every_tied_memory_in_every_path():
    """Tied scores (a zero gate projection, as after ``convert to-mc``): ssc reads every memory
    tied with the k-th best, so it equals ``mean``; the reference used to keep exactly k."""
    spec = MLPMemorySpec(depth=2, d_k=4, d_v=4, expansion=2)
    gen = torch.Generator().manual_seed(1)
    init, (q, k, v, u, alpha, eta, theta) = titans_inputs(gen, spec, 2, 11, 2, torch.float32)
    xs = (q, k, v, torch.zeros_like(u), alpha, eta, theta)
    outs = {}
    for aggregation in ("ssc", "mean"):
        opts = MCOptions(segment_size=2, chunk_size=2, aggregation=aggregation, ssc_topk=1)
        ref = reference_mc_titans(spec, opts, *xs, init)
        out, _ = chunk_mc_titans(spec, opts, *xs, init, MCState.initial(init, 2, 4))
        state, steps = MCState.initial(init, 2, 4), []
        for t in range(11):
            o, state = step_mc_titans(spec, opts, *(x[:, t] for x in xs), init, state)
            steps.append(o)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.stack(steps, 1), ref, rtol=0, atol=1e-5)
        outs[aggregation] = ref
    torch.testing.assert_close(outs["ssc"], outs["mean"], rtol=0, atol=1e-5)


def test_ssc_counts_scores_equal_up_to_rounding_as_tied():
    """Repeated tokens in one-token segments give identical segment summaries; a prefill and a
    chunk compute them in different calls, 1e-8 apart, and an exact comparison kept two memories
    in the full forward and one after the prefill (an error of 1.3e-3 in the last logit)."""
    scores = torch.tensor([[0.5, 0.25, 0.5 + 1e-8, -1.0]])
    assert torch.isfinite(ssc_select(scores, 1)).tolist() == [[True, False, True, False]]
    assert torch.isfinite(ssc_select(scores, 3)).tolist() == [[True, True, True, False]]
    assert torch.equal(ssc_select(scores[:, :2], 2), scores[:, :2])
    # The fuzz example that found it: a 5-token row, prefill 1, then the other 4 in one call.
    model = tiny_mc_titans(seed=2, aggregation="ssc", ssc_topk=1, memory_depth=1, inner_chunk_size=1,
                           segment_size=1)
    ids = torch.randint(1, 97, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids).logits
        cache = MnemoCache(model.config.num_hidden_layers)
        parts = [model(ids[:, a:b], past_key_values=cache, use_cache=True).logits for a, b in [(0, 1), (1, 5)]]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-5)
