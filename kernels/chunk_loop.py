"""The chunk-to-chunk loop of the deep memories, with a backward that recomputes instead of storing.

Titans, Atlas and Memory Caching advance a memory one inner chunk at a time: a
chunk's gradients are taken at the weights it starts from, so the chunks form a
sequential loop of steps ``(carry, x_j) -> (y_j, carry')`` whose carry is the
memory's weights and momenta. Recorded by autograd as it stands, that loop keeps
every intermediate of every chunk (several weight-sized tensors each) and its
backward pays for slicing the per-chunk inputs out of whole-sequence tensors
once per chunk.

:func:`run_chunks` runs the loop once without recording and keeps only the
carry entering every ``r``-th chunk (``r`` about the square root of the number of
chunks). Its backward walks those stretches from the last one: it re-runs a
stretch under autograd from its checkpoint and back-propagates through it, as
gradient checkpointing does. So memory holds ``n / r`` carries and one stretch's
intermediates instead of ``n`` chunks' worth, for one extra forward pass; gradients
are the same sums as plain autograd's (the per-chunk graphs are the plain loop's),
in another order. A step whose intermediates dwarf its carry asks for a smaller
backward unit: the stretch's carries are recomputed first, then one chunk at a
time is re-run under autograd (one more forward pass, one chunk held).

The step is any function of tensors that does not modify its arguments::

    step(carry, x, consts) -> (ys, new_carry)

with tuples of tensors throughout: ``x`` holds chunk ``j``'s slices of ``xs``
(tensors indexed by chunk first) and ``consts`` is the same for every chunk. It
must read no tensor other than its arguments (the backward differentiates only
those) and must not read values to the host.

On CUDA every chunk is the same few hundred small kernels, so the loop is bound by
the host launching them, not by the GPU. There steps are captured in CUDA graphs
per set of input shapes (:class:`GraphedStep`): with gradients a whole backward
unit is one captured step, its forward and its re-run with the backward, so a unit
costs one replay each way and the weight-sized carry is copied in and out once per
unit; without gradients (prefill) a unit of 8 chunks (or of the snapshot spacing) is one
replay, and the chunks after the last whole unit one replay each.
``loop_options(graphs=False)`` turns this off.

Where the steps are not captured (CPU, or graphs off), recomputing costs the host
two more passes over every small op, where the host launching them is the bottleneck;
there the loop runs under plain autograd by default.
``loop_options(recompute=True)`` (or ``recompute=True``) asks for the recompute anyway,
for its memory; ``recompute=False`` for plain autograd everywhere.

``loop_options(checkpoint_every=r)`` sets the spacing where the caller leaves it to the
default: longer stretches hold more of a stretch's intermediates at once and fewer
carries, and copy the carry in and out of fewer captured units, so they trade memory for
speed (``benchmarks/RESULTS.md`` has the measured trade).
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial

import torch

from .backend import current_paths, requested_backend

__all__ = [
    "GraphedStep",
    "graphed_step",
    "recompute_in_backward",
    "LoopOptions",
    "loop_options",
    "release_graphs",
    "run_chunks",
    "tf32_products",
    "tf32_wanted",
]

Tensors = tuple[torch.Tensor, ...]
Step = Callable[[Tensors, Tensors, Tensors], tuple[Tensors, Tensors]]
# ``first_pass(carry, xs, consts, r) -> (ys, carry, checkpoints)``: the loop's forward in one go, where a
# caller has a faster way than the step chunk by chunk (see :func:`run_chunks`).
FirstPass = Callable[[Tensors, Tensors, Tensors, int], tuple[Tensors, Tensors, list[Tensors]]]


def _stretch(n: int, checkpoint_every: int | None) -> int:
    if checkpoint_every is None:
        checkpoint_every = _asked_spacing()
    if checkpoint_every is not None:
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
        return checkpoint_every
    # The forward keeps n / r carries until the backward, which holds about r of one stretch at a time; with
    # L loops kept at once (a model's memory layers: loop_options(layers=L)) that is L n / r + r carries, least
    # at r = sqrt(L n). A divisor of n where one is near: each stretch length is a graph capture of its own
    # (and the memory its backward holds), so equal stretches take one.
    r = min(n, max(1, math.ceil(math.sqrt(n * _options[-1].layers))))
    return next((d for d in range(r, max(2, r // 2) - 1, -1) if n % d == 0), r)


@dataclass(frozen=True)
class LoopOptions:
    """The chunk loops' settings where their callers leave them open: ``graphs=False`` runs the steps
    uncaptured, ``recompute`` forces the backward's recompute on or off, ``checkpoint_every`` is the
    carry's spacing in chunks (``None``: about the square root of their number times ``layers``), and
    ``layers`` how many loops keep their carries until the backward at once (a model sets its number of
    memory layers, so that the spacing minimises what all of them hold together)."""

    graphs: bool = True
    recompute: bool | None = None
    checkpoint_every: int | None = None
    layers: int = 1

    def __post_init__(self) -> None:
        every = self.checkpoint_every
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"checkpoint_every must be a whole number of chunks >= 1, got {every!r}")
        if isinstance(self.layers, bool) or not isinstance(self.layers, int) or self.layers < 1:
            raise ValueError(f"layers must be a whole number >= 1, got {self.layers!r}")


_options: list[LoopOptions] = [LoopOptions()]


@contextlib.contextmanager
def loop_options(*, graphs: bool | None = None, recompute: bool | None = None,
                 checkpoint_every: int | None = None, layers: int | None = None) -> Iterator[None]:
    """Set the enclosed chunk loops' :class:`LoopOptions` (the arguments left ``None`` keep theirs),
    e.g. ``with loop_options(checkpoint_every=8): trainer.train()``. An argument a caller of
    :func:`run_chunks` passes itself wins over these."""
    asked = dict(graphs=graphs, recompute=recompute, checkpoint_every=checkpoint_every, layers=layers)
    _options.append(replace(_options[-1], **{k: v for k, v in asked.items() if v is not None}))
    try:
        yield
    finally:
        _options.pop()


@contextlib.contextmanager
def _with_options(options: LoopOptions) -> Iterator[None]:
    """The enclosed loops run under ``options`` (captured elsewhere, e.g. by a forward for its backward)."""
    _options.append(options)
    try:
        yield
    finally:
        _options.pop()


def _asked_spacing() -> int | None:
    """The spacing of loops whose caller leaves it to the default (:func:`loop_options`)."""
    return _options[-1].checkpoint_every


def _stack(per_chunk: list[Tensors]) -> Tensors:
    return tuple(torch.stack(ys) for ys in zip(*per_chunk))


def _differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _autocast_state() -> tuple:
    """Autocast as it stands, per device type: the backward recomputes the chunks under the same."""
    return tuple((dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)) for dev in ("cpu", "cuda"))


def _autocast(state: tuple, cache: bool = True) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for dev, enabled, dtype in state:
        stack.enter_context(torch.autocast(dev, dtype=dtype, enabled=enabled, cache_enabled=cache))
    return stack


def tf32_wanted(inputs: torch.Tensor) -> bool:
    """The memories' policy for TF32 products: on CUDA, for problems given in bf16 or fp16.

    Their inputs carry 8 or 11 bits of mantissa, TF32 keeps 11; the memory's state and every
    sum stay float32 (as in the gated delta rule's kernels). float32 problems keep exact products.
    """
    return inputs.is_cuda and inputs.dtype in (torch.bfloat16, torch.float16)


@contextlib.contextmanager
def tf32_products(enabled: bool):
    """Let float32 matmuls on CUDA use TF32 tensor cores inside (restored after)."""
    if not enabled:
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


class _Recomputed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, tf32, n_tensors, *args):
        ctx.fn, ctx.tf32, ctx.args = fn, tf32, args
        ctx.save_for_backward(*args[:n_tensors])
        ctx.n_tensors = n_tensors
        ctx.autocast, ctx.options = _autocast_state(), _options[-1]
        with tf32_products(tf32):
            return fn(*args)

    @staticmethod
    def backward(ctx, grad):
        tensors = ctx.saved_tensors
        leaves = tuple(t.detach().requires_grad_(_differentiable(t) and need)
                       for t, need in zip(tensors, ctx.needs_input_grad[3:]))
        # The backward runs outside the forward's autocast and loop options (on CUDA in another thread):
        # recompute under them, but as one layer: only this recompute's loops keep carries now, not every
        # layer's at once, so their spacing is that of a single loop.
        options = replace(ctx.options, layers=1)
        with torch.enable_grad(), tf32_products(ctx.tf32), _autocast(ctx.autocast), _with_options(options):
            out = ctx.fn(*leaves, *ctx.args[ctx.n_tensors:])
            wanted = [t for t in leaves if t.requires_grad]
            found = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True) if wanted else ())
        return (None, None, None, *(next(found) if t.requires_grad else None for t in leaves),
                *([None] * (len(ctx.args) - ctx.n_tensors)))


def recompute_in_backward(fn: Callable[..., torch.Tensor], tensors: Sequence[torch.Tensor], *rest,
                          tf32: bool = False) -> torch.Tensor:
    """``fn(*tensors, *rest)`` (one tensor out), its intermediates dropped and recomputed in the backward,
    as ``torch.utils.checkpoint`` does, with the forward, the recomputation and the backward's products
    all under :func:`tf32_products` (``tf32``): a checkpoint alone would run the backward's matmuls
    outside it. ``rest`` holds what is not differentiated (tensors or not)."""
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
        with tf32_products(tf32):
            return fn(*tensors, *rest)
    return _Recomputed.apply(fn, tf32, len(tensors), *tensors, *rest)


def copy_all(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """``target.copy_(source)`` for every pair, one ``_foreach_copy_`` per dtype: on CUDA a few launches for
    a unit's inputs instead of one copy each (a Memory Caching layer's loop made about 1,900 copies a step,
    each costing the host a launch)."""
    groups: dict = {}
    for t, s in zip(targets, sources):
        if t is not s:
            pair = groups.setdefault((t.dtype, s.dtype, t.device), ([], []))
            pair[0].append(t)
            pair[1].append(s)
    for t, s in groups.values():
        torch._foreach_copy_(t, s)


def _zeros_for_none(grads: Sequence[torch.Tensor | None], like: Sequence[torch.Tensor]) -> Tensors:
    return tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, like))


class GraphedStep:
    """A step captured in CUDA graphs for one set of input shapes.

    ``fwd.replay()`` runs the step on the static inputs ``carry, x, consts`` into ``ys, carry_out``;
    ``bwd.replay()`` (captured when asked for) re-runs it under autograd from the same inputs and
    back-propagates the static ``d_ys, d_carry_out`` into ``d_carry, d_x, d_consts`` (zeros where an
    input gets no gradient). Callers copy inputs in (:meth:`load`) and results out: every buffer is
    reused by the next replay.
    """

    def __init__(self, step: Step, carry: Tensors, x: Tensors, consts: Tensors, need_x: Sequence[bool],
                 need_consts: Sequence[bool], backward: bool):
        self.carry = tuple(t.detach().clone() for t in carry)
        self.x = tuple(t.detach().clone() for t in x)
        self.consts = tuple(t.detach().clone() for t in consts)
        self.pool = torch.cuda.graph_pool_handle()
        # Autocast's cache of casts must stay off: a cast cached while warming up would be left out
        # of the graph, and every replay would read the warm-up's values.
        self.autocast = _autocast_state()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad(), _autocast(self.autocast, cache=False):
            for _ in range(2):  # warm-up outside the capture: lazy initialisation, library workspaces
                step(self.carry, self.x, self.consts)
        torch.cuda.current_stream().wait_stream(stream)
        self.fwd = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.fwd, pool=self.pool), torch.no_grad(), _autocast(self.autocast, cache=False):
            self.ys, self.carry_out = step(self.carry, self.x, self.consts)
        self.bwd = None
        if backward:
            self._capture_backward(step, need_x, need_consts)

    def _capture_backward(self, step: Step, need_x: Sequence[bool], need_consts: Sequence[bool]) -> None:
        leaves = (
            tuple(t.detach().requires_grad_(_differentiable(t)) for t in self.carry)
            + tuple(t.detach().requires_grad_(want) for t, want in zip(self.x, need_x))
            + tuple(t.detach().requires_grad_(want) for t, want in zip(self.consts, need_consts))
        )
        self.d_ys = tuple(torch.zeros_like(t) for t in self.ys)
        self.d_carry_out = tuple(torch.zeros_like(t) for t in self.carry_out)
        n_carry, n_x = len(self.carry), len(self.x)

        def run():
            with torch.enable_grad(), _autocast(self.autocast, cache=False):
                ys, carry_out = step(leaves[:n_carry], leaves[n_carry:n_carry + n_x], leaves[n_carry + n_x:])
            pairs = [(o, g) for o, g in zip(ys + carry_out, self.d_ys + self.d_carry_out) if o.requires_grad]
            inputs = [t for t in leaves if t.requires_grad]
            found = iter(torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs],
                                             allow_unused=True) if pairs else [None] * len(inputs))
            got = [next(found) if t.requires_grad else None for t in leaves]
            return _zeros_for_none(got, leaves)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        self.bwd = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.bwd, pool=self.pool):
            grads = run()
        self.d_carry = grads[:n_carry]
        self.d_x = grads[n_carry:n_carry + n_x]
        self.d_consts = grads[n_carry + n_x:]

    def load(self, carry: Sequence[torch.Tensor] | None = None, x: Sequence[torch.Tensor] | None = None,
             consts: Sequence[torch.Tensor] | None = None) -> None:
        targets, sources = [], []
        for dst, src in ((self.carry, carry), (self.x, x), (self.consts, consts)):
            if src is not None:
                targets += dst
                sources += src
        copy_all(targets, sources)


_GRAPHS: OrderedDict = OrderedDict()
# Enough for every shape one training step meets (a Memory Caching layer at 32K tokens: 9 cache sizes; the
# soup aggregation, whose chunk step reads the cache itself, a step per cache size and stretch, 18), since a
# shape evicted between steps is captured again on every step.
_MAX_GRAPHS = 32


def _step_key(step: Step):
    """A step's identity for the cache of graphs: a partial by its function and arguments (a partial among
    them by its own key, as :func:`_stretch_step` wraps the caller's step), anything else by itself."""
    if hasattr(step, "func"):
        args = tuple(_step_key(a) if hasattr(a, "func") else a for a in step.args)
        parts = (step.func, args, tuple(sorted(step.keywords.items())))
    else:
        parts = (step,)
    try:
        hash(parts)
    except TypeError:
        return None
    return parts


def _selection() -> tuple:
    """What, besides its shapes, decides which kernels a captured step replays: autocast, the float32
    matmul precision, the backend asked for and the chunk paths (:func:`~.backend.comparison_paths`). Part of
    a graph's key, so that changing any of them within a process captures anew instead of replaying the other
    choice's kernels."""
    return (_autocast_state(), torch.get_float32_matmul_precision(), requested_backend(), current_paths())


def _signature(tensors: Sequence[torch.Tensor]):
    return tuple((tuple(t.shape), t.dtype, t.device) for t in tensors)


def _graphs_wanted(tensors: Sequence[torch.Tensor], n: int, graphs: bool | None = None) -> bool:
    if graphs is not None:
        return graphs and n > 0 and all(t.is_cuda for t in tensors)
    return (
        n > 2
        and _options[-1].graphs
        and all(t.is_cuda for t in tensors)
        and not torch.cuda.is_current_stream_capturing()
    )


def release_graphs() -> None:
    """Drop every captured step and the GPU memory its graphs hold (the next loop captures again)."""
    _GRAPHS.clear()


def _kept(t: torch.Tensor) -> torch.Tensor:
    return t


def graphed_step(step: Step, carry: Tensors, x: Tensors, consts: Tensors, need_x: Sequence[bool] = (),
                 need_consts: Sequence[bool] = (), backward: bool = False) -> GraphedStep | None:
    """The :class:`GraphedStep` of ``step`` for these shapes (cached), or ``None`` where it cannot be captured."""
    base = _step_key(step)
    if base is None:
        return None
    need_x = tuple(need_x) or (False,) * len(x)
    need_consts = tuple(need_consts) or (False,) * len(consts)
    key = (base, _signature(carry), _signature(x), _signature(consts), need_x, need_consts, _selection())
    graphed = _GRAPHS.get(key)
    if graphed is False:
        return None
    if graphed is not None and (graphed.bwd is not None or not backward):
        _GRAPHS.move_to_end(key)
        return graphed
    try:
        # The capture runs the step under autograd (its warm-ups, the backward's capture): inside a forward
        # that activation checkpointing records, the checkpoint's hooks would count what those runs save as
        # the block's own, and its re-run, which replays this capture, would then save fewer. Hooks of our
        # own, innermost, keep the capture's saves apart.
        with torch.autograd.graph.saved_tensors_hooks(_kept, _kept):
            graphed = GraphedStep(step, carry, x, consts, need_x, need_consts, backward)
    except RuntimeError:  # a step that syncs with the host cannot be captured: run it eagerly
        _GRAPHS[key] = False
        return None
    _GRAPHS[key] = graphed
    while len(_GRAPHS) > _MAX_GRAPHS:
        _GRAPHS.popitem(last=False)
    return graphed


# Chunks per captured unit of a loop without gradients (a prompt's prefill): one replay and one copy of the
# carry in and out per unit instead of per chunk.
_PREFILL_UNIT = 8


def _forward(step: Step, carry: Tensors, xs: Tensors, consts: Tensors, every: int | None = None,
             captured: bool = False) -> tuple[Tensors, Tensors, list[Tensors]]:
    """Every chunk from ``carry``: their outputs stacked, the final carry and (``every``) the carries after
    chunks ``every - 1``, ``2 every - 1``, ... before the last.

    ``captured``: in CUDA graphs, units of ``every`` (else :data:`_PREFILL_UNIT`) chunks, then the chunks
    after the last whole unit one at a time, so that inputs of any length take two captures."""
    n = xs[0].shape[0]
    kept: list[Tensors] = []
    if not captured:
        if not every:
            return (*_stretch_step(step, carry, xs, consts), kept)
        parts = []
        for lo in range(0, n, every):
            ys, carry = _stretch_step(step, carry, _slice(xs, lo, min(n, lo + every)), consts)
            parts.append(ys)
            if lo + every < n:
                kept.append(carry)
        return tuple(torch.cat(p) for p in zip(*parts)), carry, kept
    stretch = partial(_stretch_step, step)
    u = every or _PREFILL_UNIT
    whole = n - n % u
    units = [(lo, lo + u) for lo in range(0, whole, u)] + [(j, j + 1) for j in range(whole, n)]
    graphs = {L: graphed_step(stretch, carry, _slice(xs, 0, L), consts) for L in {hi - lo for lo, hi in units}}
    parts = []
    for lo, hi in units:
        ys, carry = _run_unit(stretch, graphs[hi - lo], carry, _slice(xs, lo, hi), consts)
        parts.append(ys)
        if every and hi % every == 0 and hi < n:
            kept.append(carry)
    return tuple(torch.cat(p) for p in zip(*parts)), carry, kept


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    return a if b is None else (b if a is None else a + b)


def _unshared(sources: Sequence[torch.Tensor | None], targets: Sequence[torch.Tensor]) -> list:
    """``sources``, each cloned where it shares memory with a target, unless it is its own target itself:
    a gradient that passed a carry through to another index of the step (a view of that index's buffer)
    would be overwritten by the copies before it is read, and one that is a transposed view of its own
    buffer cannot be copied into it."""
    ptrs = {t.untyped_storage().data_ptr() for t in targets}
    return [a if a is None or a is targets[i] or a.untyped_storage().data_ptr() not in ptrs else a.clone()
            for i, a in enumerate(sources)]


def _backward_one(step: Step, graphed: GraphedStep | None, carry: Tensors, x: Tensors, consts_in: Tensors,
                  need_x: Sequence[bool], d_ys: Sequence[torch.Tensor | None],
                  d_carry: Sequence[torch.Tensor | None], d_more: Sequence[torch.Tensor | None] = (),
                  own: bool = True) -> list[torch.Tensor | None]:
    """One chunk's backward from the carry entering it: gradients of its carry, ``x`` and ``consts``
    (``None`` where there is none). The carry's gradient out of the unit is ``d_carry + d_more`` (``d_more``:
    a snapshot's gradient, or empty). Graphed, the gradients of ``x`` and ``consts`` are the graph's own
    buffers, valid until its next replay: the caller copies them out at once; so is the carry's where
    ``own`` is false (else a clone): a caller that hands it to the next unit at once and replays no other
    graph in between saves a carry-sized copy."""
    d_more = tuple(d_more) or (None,) * len(d_carry)
    if graphed is not None:
        # The carry's gradient first: the previous unit's may be (a view of) one of this graph's buffers,
        # which the loads below overwrite. A snapshot's gradient is added on the way in, in one pass.
        copies, absent = [], []
        for buf, a, b in zip(graphed.d_carry_out, _unshared(d_carry, graphed.d_carry_out), d_more):
            if a is not None and b is not None:
                torch.add(a, b, out=buf)
            elif a is not None or b is not None:
                copies.append((buf, a if b is None else b))
            else:
                absent.append(buf)
        copy_all([buf for buf, _ in copies], [g for _, g in copies])
        pairs = list(zip(graphed.d_ys, d_ys))
        copy_all([b for b, g in pairs if g is not None], [g for _, g in pairs if g is not None])
        absent += [b for b, g in pairs if g is None]
        if absent:
            torch._foreach_zero_(absent)
        graphed.load(carry, x)
        graphed.bwd.replay()
        # A carry's gradient kept across a forward replay (the next stretch's recompute) must be owned: the
        # forward graph shares the backward's memory pool and may reuse it.
        d_carry_in = [t.clone() for t in graphed.d_carry] if own else list(graphed.d_carry)
        return d_carry_in + list(graphed.d_x + graphed.d_consts)
    d_carry = [_add(a, b) for a, b in zip(d_carry, d_more)]
    carry_in = tuple(t.detach().requires_grad_(_differentiable(t)) for t in carry)
    x_in = tuple(t.detach().requires_grad_(want) for t, want in zip(x, need_x))
    with torch.enable_grad():
        y, carry_out = step(carry_in, x_in, consts_in)
    outputs, grad_outputs = [], []
    for out, g in zip(y + carry_out, list(d_ys) + list(d_carry)):
        if g is not None and out.requires_grad:
            outputs.append(out)
            grad_outputs.append(g)
    leaves = carry_in + x_in + consts_in
    inputs = [t for t in leaves if t.requires_grad]
    found = iter(torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True)
                 if outputs else [None] * len(inputs))
    return [next(found) if t.requires_grad else None for t in leaves]


def _stretch_step(step: Step, carry: Tensors, xs: Tensors, consts: Tensors) -> tuple[Tensors, Tensors]:
    """``step`` over every chunk of ``xs`` (chunk index first), as one step: stacked outputs, final carry."""
    # unbind, not one index per chunk: under autograd each index's backward is a zero tensor the size of
    # the whole stretch and an add of it, per input and chunk; unbind's is one stack per input.
    ys = []
    for x in zip(*(t.unbind(0) for t in xs)):
        y, carry = step(carry, x, consts)
        ys.append(y)
    return _stack(ys), carry


def _slice(xs: Sequence[torch.Tensor], lo: int, hi: int) -> Tensors:
    return tuple(x[lo:hi] for x in xs)


def _run_unit(stretch: Step, graphed: GraphedStep | None, carry: Tensors, xs: Tensors, consts: Tensors
              ) -> tuple[Tensors, Tensors]:
    """A few chunks without gradients, captured or not: their stacked outputs and the carry after them
    (owned by the caller: a graph's buffers are cloned)."""
    if graphed is None:
        return stretch(carry, xs, consts)
    graphed.load(carry, xs, consts)
    graphed.fwd.replay()
    return tuple(t.clone() for t in graphed.ys), tuple(t.clone() for t in graphed.carry_out)


# The arguments of _ChunkLoop.forward before its tensors.
_LOOP_ARGS = 9


class _ChunkLoop(torch.autograd.Function):
    """The loop in stretches of ``r`` chunks, each run in units of ``u`` chunks (``u`` divides ``r``).

    The forward keeps the carry entering each stretch. The backward takes the stretches from the
    last: it recomputes the carries entering the stretch's units from its checkpoint (none when a
    unit is the whole stretch), then re-runs one unit at a time under autograd and back-propagates
    through it. On CUDA a unit is one captured step (:func:`_stretch_step` in a
    :class:`GraphedStep`), so it costs one replay each way and the carry is copied per unit, not
    per chunk. ``u = r`` runs every chunk forward twice in all and holds a stretch's intermediates
    at once; ``u = 1`` three times, holding one chunk's.
    """

    @staticmethod
    def forward(ctx, step: Step, n_carry: int, n_xs: int, checkpoint_every: int | None, graphs: bool | None,
                tf32: bool, unit: int | None, snapshots: bool, first_pass: FirstPass | None, *tensors):
        carry = tensors[:n_carry]
        xs = tensors[n_carry:n_carry + n_xs]
        consts = tensors[n_carry + n_xs:]
        n = xs[0].shape[0]
        r = _stretch(n, checkpoint_every)
        u = r if unit is None else max(1, min(unit, r))
        r = -(-r // u) * u
        need = ctx.needs_input_grad[_LOOP_ARGS:]
        need_xs, need_consts = need[n_carry:n_carry + n_xs], need[n_carry + n_xs:]
        stretch = partial(_stretch_step, step)
        graphed: dict[int, GraphedStep | None] = {}
        checkpoints, outputs = [], []
        with tf32_products(tf32):
            if _graphs_wanted(tensors, n, graphs):
                for lo in range(0, n, u):
                    L = min(n, lo + u) - lo
                    if L not in graphed:
                        graphed[L] = graphed_step(stretch, carry, _slice(xs, lo, lo + L), consts, need_xs,
                                                  need_consts, backward=True)
            if first_pass is not None:
                ys, carry, checkpoints = first_pass(carry, xs, consts, r)
                if len(checkpoints) != -(-n // r):
                    raise ValueError(f"first_pass gave {len(checkpoints)} checkpoints for {n} chunks every {r}")
            else:
                for lo in range(0, n, u):
                    hi = min(n, lo + u)
                    if lo % r == 0:
                        checkpoints.append(carry)
                    ys, carry = _run_unit(stretch, graphed.get(hi - lo), carry, _slice(xs, lo, hi), consts)
                    outputs.append(ys)
                ys = tuple(torch.cat(parts) for parts in zip(*outputs))
        ctx.step, ctx.graphed, ctx.r, ctx.u, ctx.n, ctx.tf32 = stretch, graphed, r, u, n, tf32
        ctx.autocast = _autocast_state()
        ctx.sizes = (n_carry, n_xs, len(consts), len(ys))
        ctx.snapshots = snapshots
        ctx.save_for_backward(*xs, *consts, *(t for c in checkpoints for t in c))
        # An output that is an input object would be taken for the input by autograd.
        carry = tuple(t.clone() if any(t is s for s in tensors) else t for t in carry)
        outputs = ys + carry
        if snapshots:  # the carries after each stretch but the last: the checkpoints after the first
            outputs += tuple(t for c in checkpoints[1:] for t in c)
        ctx.mark_non_differentiable(*(t for t in outputs if not _differentiable(t)))
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        n_carry, n_xs, n_consts, n_ys = ctx.sizes
        stretch, r, u, n = ctx.step, ctx.r, ctx.u, ctx.n
        saved = ctx.saved_tensors
        xs, consts = saved[:n_xs], saved[n_xs:n_xs + n_consts]
        flat = saved[n_xs + n_consts:]
        checkpoints = [flat[i:i + n_carry] for i in range(0, len(flat), n_carry)]
        d_ys, d_carry = grads[:n_ys], list(grads[n_ys:n_ys + n_carry])
        d_snaps = grads[n_ys + n_carry:]
        need = ctx.needs_input_grad[_LOOP_ARGS:]
        need_xs, need_consts = need[n_carry:n_carry + n_xs], need[n_carry + n_xs:]
        d_xs = [torch.zeros_like(x) if want else None for x, want in zip(xs, need_xs)]
        d_consts: list[torch.Tensor | None] = [None] * n_consts
        consts_in = tuple(c.detach().requires_grad_(want) for c, want in zip(consts, need_consts))

        # With one unit per stretch no forward graph replays between two backward replays, so a unit's carry
        # gradient can stay in its graph's buffer until the next unit copies it in (one copy fewer per unit).
        one_unit = u == r
        borrowed = False  # whether d_carry is a graph's buffer
        for s in reversed(range(len(checkpoints))):
            snap: Sequence[torch.Tensor | None] = ()
            if ctx.snapshots and s + 1 < len(checkpoints):  # the carry after stretch s is also an output
                snap = d_snaps[s * n_carry:(s + 1) * n_carry]
            units = [(lo, min(n, lo + u)) for lo in range(s * r, min(n, (s + 1) * r), u)]
            carries = [checkpoints[s]]
            with torch.no_grad(), _autocast(ctx.autocast), tf32_products(ctx.tf32):
                for lo, hi in units[:-1]:  # the carries entering the stretch's units
                    carries.append(_run_unit(stretch, ctx.graphed.get(hi - lo), carries[-1], _slice(xs, lo, hi),
                                             consts)[1])
            for (lo, hi), carry in reversed(list(zip(units, carries))):
                graphed = ctx.graphed.get(hi - lo)
                if graphed is not None:
                    graphed.load(consts=consts)
                with _autocast(ctx.autocast), tf32_products(ctx.tf32):
                    got = _backward_one(stretch, graphed, carry, _slice(xs, lo, hi), consts_in, need_xs,
                                        [None if d is None else d[lo:hi] for d in d_ys], d_carry, snap,
                                        own=not one_unit)
                snap = ()  # the snapshot's gradient enters at the stretch's end only
                d_carry = got[:n_carry]
                # Sticky: an uncaptured unit that passes a carry through hands back the very tensor it got.
                borrowed = borrowed or (graphed is not None and one_unit)
                pairs = [(d[lo:hi], g) for d, g in zip(d_xs, got[n_carry:n_carry + n_xs])
                         if g is not None and d is not None]
                copy_all([d for d, _ in pairs], [g for _, g in pairs])
                for i, g in enumerate(got[n_carry + n_xs:]):
                    if g is not None and need_consts[i]:
                        # in place: a cache of memories makes these as large as the carry, once per memory
                        d_consts[i] = g.clone() if d_consts[i] is None else d_consts[i].add_(g)
        d_carry = [g if want else None for g, want in zip(d_carry, need[:n_carry])]
        if borrowed:  # the graph's buffers are the next loop's
            d_carry = [None if g is None else g.clone() for g in d_carry]
        return (*(None,) * _LOOP_ARGS, *d_carry, *d_xs, *d_consts)


# torch.compile runs the loop as it is (a graph break): traced, every chunk would be unrolled into one
# graph, which compiled for minutes, and the CUDA graphs cannot be traced at all.
@torch.compiler.disable
def run_chunks(
    step: Step,
    carry: Sequence[torch.Tensor],
    xs: Sequence[torch.Tensor],
    consts: Sequence[torch.Tensor] = (),
    *,
    checkpoint_every: int | None = None,
    graphs: bool | None = None,
    recompute: bool | None = None,
    tf32: bool = False,
    backward_unit: int | None = None,
    snapshots: bool = False,
    first_pass: FirstPass | None = None,
) -> tuple[Tensors, Tensors] | tuple[Tensors, Tensors, list[Tensors]]:
    """Run ``step`` over the chunks of ``xs`` (chunk index first); returns ``(ys, carry)``.

    ``ys`` stacks each chunk's outputs along a new first dimension. With gradients,
    the carry is kept every ``checkpoint_every`` chunks (default: :func:`loop_options`' where set, else
    about the square root of their number) and the rest is recomputed in the backward. ``graphs``
    forces CUDA graphs on or off (default: on for CUDA tensors and more than two
    chunks, unless ``loop_options(graphs=False)``); a caller whose inputs change shape
    from call to call turns them off, as each new shape is a new capture.
    ``recompute`` chooses between that recompute and plain autograd over the loop
    (every chunk's graph kept); by default (``None``) it recomputes exactly where the
    steps are captured in graphs, unless :func:`loop_options` says otherwise.
    ``tf32`` lets the steps' float32 matmuls on CUDA use TF32 tensor cores (the
    caller's choice for bf16/fp16 problems, whose inputs carry fewer bits than TF32).
    ``backward_unit`` is how many chunks the recompute's backward holds under autograd at once:
    ``None`` (a whole stretch: each chunk runs forward twice in all) or ``1`` for steps whose
    intermediates dwarf their carry (Atlas' per-token Muon momenta: three forwards, one chunk held).
    ``snapshots`` adds a third result: the carries after every stretch but the last (after chunks
    ``r - 1``, ``2r - 1``, ... with ``r`` the checkpoint spacing), differentiable like the rest.
    ``first_pass`` takes the forward's place where no gradient is recorded and where the loop recomputes
    in its backward (not under plain autograd, which records ``step``): called as
    ``first_pass(carry, xs, consts, r)`` without recording, it returns the stacked outputs, the final
    carry and the carries entering chunks ``0, r, 2r, ...``, as the chunk-by-chunk forward would. The
    backward still re-runs each stretch with ``step`` from those carries, so the gradients are ``step``'s:
    a first pass must compute what ``step`` computes, to rounding (one kernel for the whole loop, say).
    """
    carry, xs, consts = tuple(carry), tuple(xs), tuple(consts)
    if not xs or xs[0].shape[0] == 0:
        raise ValueError("run_chunks needs at least one per-chunk input with at least one chunk")
    n = xs[0].shape[0]
    if any(x.shape[0] != n for x in xs):
        raise ValueError(f"every per-chunk input must have {n} chunks first, got {[x.shape[0] for x in xs]}")
    _stretch(n, checkpoint_every)  # a bad spacing is an error whichever way the loop runs
    # Chunk-first and contiguous, once per call: callers lay their inputs out chunk-first by views, and a
    # step's kernels would otherwise copy each chunk's slices contiguous, several launches per chunk. A
    # caller that drops its views' buffers passes contiguous inputs (no copy here, no second copy held).
    xs = tuple(x.contiguous() for x in xs)
    tensors = carry + xs + consts
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        if recompute is None:
            asked = _options[-1].recompute
            recompute = asked if asked is not None else _graphs_wanted(tensors, n, graphs)
        if recompute:
            out = _ChunkLoop.apply(step, len(carry), len(xs), checkpoint_every, graphs, tf32, backward_unit,
                                   snapshots, first_pass, *tensors)
            m = len(carry)
            n_snap = (-(-n // _stretch(n, checkpoint_every)) - 1) * m if snapshots else 0
            ys_end = len(out) - m - n_snap
            ys, carry = tuple(out[:ys_end]), tuple(out[ys_end:ys_end + m])
            if not snapshots:
                return ys, carry
            flat = out[ys_end + m:]
            return ys, carry, [tuple(flat[i:i + m]) for i in range(0, n_snap, m)]
        graphs = False  # autograd records the loop below: replays would overwrite what it saved
    elif first_pass is not None:
        with tf32_products(tf32):
            ys, carry, kept = first_pass(carry, xs, consts, _stretch(n, checkpoint_every) if snapshots else n)
        return (ys, carry, list(kept[1:])) if snapshots else (ys, carry)
    with tf32_products(tf32):
        ys, carry, kept = _forward(step, carry, xs, consts, _stretch(n, checkpoint_every) if snapshots else None,
                                   _graphs_wanted(tensors, n, graphs))
    return (ys, carry, kept) if snapshots else (ys, carry)
