"""Memory Caching's read, shared by every cached memory (MC paper; docs/semantics.md).

The sequence of each row is cut into segments; at the end of a segment a layer caches its
memory's state ``M^(i)`` and the segment's summary ``r^(i)`` (the mean of its normalised keys).
Token ``t`` reads its online memory ``M_t`` (after its own write) and the cached memories
through ``aggregation``, scored by ``s^(i) = <u_t, r^(i)>`` with the gate projection ``u_t``
(the online memory's summary is the mean of the current segment's keys so far):

- ``residual``: ``M_t(q) + sum_i M^(i)(q)``;  ``mean``: their uniform average;
- ``grm``: ``softmax`` of the scores over cached and online memories, weighted sum;
- ``soup``: the same weights mix the memories' *weights*, then one forward;
- ``ssc``: ``grm`` over the ``ssc_topk`` best cached memories and the online one. Cached
  memories tied with the ``ssc_topk``-th best score are all kept, so a zero gate projection
  reads every memory uniformly, like ``mean``; "tied" means within ``SSC_TIE_TOLERANCE`` of it
  (relative, at least 1 in scale), because two segments with the same keys get summaries that
  differ by rounding when they are computed in different calls (a prefill and a decode step),
  and an exact comparison then kept one memory in one path and two in the other.

This module holds what the three cached memories (:mod:`.mc_gated_delta` for MoM,
:mod:`.mc_titans`, :mod:`.mc_atlas`) share: the options and segmentations
(:class:`MCOptions`, :func:`log_segments`), the gates (:func:`mc_gates`, :func:`ssc_select`),
the read of MLP memories (:func:`mc_read`) and the segment summaries' bookkeeping
(:func:`key_mean`, :func:`with_extra_slots`, :func:`close_segments`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch

from .backend import resolve_backend
from .cache_slots_triton import write_slots_triton
from .chunk_loop import recompute_in_backward
from .mc_mlp_read_triton import cached_mlp_read_triton, covers as one_token_read_covers
from .mixed_products_triton import mixed_products as mixed_products_triton
from .mlp_memory import MLPMemorySpec, memory_apply, static_apply

__all__ = [
    "AGGREGATIONS",
    "DECODE_EXACT_SLOTS",
    "GATED_AGGREGATIONS",
    "LINEAR_AGGREGATIONS",
    "MCOptions",
    "check_aggregation",
    "close_segments",
    "check_slot_mode",
    "decode_slots",
    "decode_steps_within",
    "grown_slots",
    "key_mean",
    "log_segments",
    "mc_gates",
    "mc_read",
    "ssc_select",
    "with_extra_slots",
    "write_memories",
    "write_slots_",
]


LINEAR_AGGREGATIONS = ("mean", "residual")  # no parameters: what post-training conversion starts from
GATED_AGGREGATIONS = ("grm", "soup", "ssc")  # scored by the gate projection u
AGGREGATIONS = LINEAR_AGGREGATIONS + GATED_AGGREGATIONS
# Far above float32 rounding of a score (about 1e-7 of its scale), far below any gap that
# routing learns: scores this close to the k-th best count as tied with it.
SSC_TIE_TOLERANCE = 2.0**-16
SEGMENTATIONS = ("constant", "logarithmic")
CACHE_MODES = ("checkpoint", "independent")
# Whether one token's read of cached MLP memories without gradients (decoding) takes one Triton launch on the
# Triton backend (:func:`~.mc_mlp_read_triton.cached_mlp_read_triton`) instead of the batched products: the
# launch skips the memories whose gate is zero, which the batched products read anyway. Off gives the batched
# products back (an A/B: ``bench_decode.py --sweep memory_caching.ONE_TOKEN_READ=0,1``).
ONE_TOKEN_READ = True

# Whether the soup aggregation's mixes of the cached weights take the Triton kernels (:mod:`.mixed_products_triton`)
# where Triton runs, or the batched products; off is kept for an A/B
# (``bench_layers.py --sweep memory_caching.MIXED_PRODUCTS=0,1``) and refuses an explicit request for Triton.
MIXED_PRODUCTS = True


def check_aggregation(aggregation: str, u: torch.Tensor | None, memories: str) -> bool:
    """Validate an aggregation over ``memories`` (for the message); ``True`` for a gated one, which
    needs the gate inputs ``u``."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation over {memories} must be one of {AGGREGATIONS}, got {aggregation!r}")
    gated = aggregation in GATED_AGGREGATIONS
    if gated and u is None:
        raise ValueError(f"aggregation {aggregation!r} scores the memories: pass the gate inputs u")
    return gated


@dataclass(frozen=True)
class MCOptions:
    segment_size: int | None = 256
    segmentation: str = "constant"
    cache_mode: str = "checkpoint"
    aggregation: str = "grm"
    ssc_topk: int = 2
    chunk_size: int = 64

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if self.segmentation not in SEGMENTATIONS:
            raise ValueError(f"segmentation must be one of {SEGMENTATIONS}, got {self.segmentation!r}")
        if self.cache_mode not in CACHE_MODES:
            raise ValueError(f"cache_mode must be one of {CACHE_MODES}, got {self.cache_mode!r}")
        if self.segment_size is not None and self.segment_size < 1:
            raise ValueError(f"segment_size must be >= 1 or None, got {self.segment_size}")
        if self.ssc_topk < 1 or self.chunk_size < 1:
            raise ValueError("ssc_topk and chunk_size must be >= 1")
        if self.segmentation == "logarithmic" and self.cache_mode == "independent":
            raise ValueError("cache_mode='independent' is undefined with logarithmic segments: use 'checkpoint'")

    @property
    def logarithmic(self) -> bool:
        return self.segmentation == "logarithmic"


def log_segments(length: int) -> list[tuple[int, int]]:
    """``[start, end)`` of the segments of a prefix of ``length`` tokens: powers of two, oldest largest."""
    segments, start = [], 0
    for bit in reversed(range(max(length, 1).bit_length())):
        if length >> bit & 1:
            segments.append((start, start + (1 << bit)))
            start += 1 << bit
    return segments


# --------------------------------------------------------------------------- aggregation


def ssc_select(scores: torch.Tensor, topk: int, dim: int = -1) -> torch.Tensor:
    """``scores`` of cached memories with all but the ``topk`` best (and those tied with the
    ``topk``-th, see ``SSC_TIE_TOLERANCE``) set to ``-inf`` along ``dim``."""
    if scores.shape[dim] <= topk:
        return scores
    kth = scores.topk(topk, dim=dim).values.narrow(dim, topk - 1, 1)
    slack = SSC_TIE_TOLERANCE * kth.abs().clamp(min=1.0)
    return scores.masked_fill(scores < kth - slack, float("-inf"))


def mc_gates(aggregation: str, ssc_topk: int, u: torch.Tensor, online_summary: torch.Tensor,
             cached_summary: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The aggregation's weights of the cached memories ``(B, H, T, N)`` and of the online one ``(B, H, T, 1)``
    for gate projections ``u (B, H, T, d_k)``; ``valid`` (bool, broadcast to ``(B, H, T, N)``) says which
    cached memory each query may read; ``dtype`` (default ``u``'s) is the fixed weights' dtype."""
    if aggregation in ("grm", "soup", "ssc"):
        s_cached = torch.einsum("bhtd,bnhd->bhtn", u, cached_summary).masked_fill(~valid, float("-inf"))
        s_online = (u * online_summary).sum(-1, keepdim=True)
        if aggregation == "ssc":
            s_cached = ssc_select(s_cached, ssc_topk)
        gates = torch.softmax(torch.cat([s_cached, s_online], dim=-1), dim=-1)
        return gates[..., :-1], gates[..., -1:]
    dtype = u.dtype if dtype is None else dtype
    n = valid.sum(-1, keepdim=True).to(dtype)
    scale = 1.0 / (1.0 + n) if aggregation == "mean" else torch.ones_like(n)
    return valid.to(dtype) * scale, scale


def mc_read(
    spec: MLPMemorySpec,
    aggregation: str,
    ssc_topk: int,
    q: torch.Tensor,
    u: torch.Tensor,
    online,
    online_summary: torch.Tensor,
    cached: dict[str, torch.Tensor | Sequence[torch.Tensor]],
    cached_summary: torch.Tensor,
    cached_valid: torch.Tensor,
    *,
    recompute: bool = False,
) -> torch.Tensor:
    """Read the online and cached memories for queries ``q`` ``(B, H, T, d_k)``.

    ``online`` is an ``apply`` (weights of each token) or, for every aggregation but ``soup``
    (which mixes weights, not reads), the online memory's reads of ``q`` already made; ``cached``
    weights are ``(B, N, H, d_out, d_in)`` with summaries ``(B, N, H, d_k)`` and ``cached_valid (B, N)``.

    A cached weight may also come as the pieces it is made of along ``N`` (a sequence of
    ``(B, n_i, H, d_out, d_in)``, cut alike for every weight). A caller whose cache grows memory by memory
    passes the same pieces to every read, so that what the reads keep for the backward is each memory
    once, not a copy of the whole cache per read. On the CPU the pieces are read one by one: a joined copy
    of a cache that grows from read to read is a transient allocation larger each time, which the
    allocator's heap keeps (a training step over 63 memories peaked 1.8x higher for ``grm``, 10x for
    ``soup``). On CUDA, where launching the products of many small pieces would set the pace, they are
    joined first, inside what the backward recomputes.
    ``recompute``: the reads of the cached memories keep only their inputs and are made again in the
    backward (:func:`~.chunk_loop.recompute_in_backward`) instead of keeping their hidden layers, a
    memory's worth of width per query and memory; for a caller that does not recompute the read itself.
    """
    g_cached, g_online = mc_gates(aggregation, ssc_topk, u, online_summary, cached_summary,
                                  cached_valid[:, None, None, :], q.dtype)
    names = list(spec.shapes)
    pieces = [(cached[n],) if isinstance(cached[n], torch.Tensor) else tuple(cached[n]) for n in names]
    if len({len(p) for p in pieces}) != 1:
        raise ValueError("every cached weight must come in as many pieces")
    n_pieces = len(pieces[0])

    join = n_pieces > 1 and q.is_cuda

    def from_cached(fn, x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        if join:  # inside what the backward recomputes: the joined copy is never kept
            fn = partial(_on_joined, fn, n_pieces)
        if recompute:
            return recompute_in_backward(fn, (x, g_cached, *weights))
        return fn(x, g_cached, *weights)

    if aggregation == "soup":
        if isinstance(online, torch.Tensor):
            raise ValueError("the soup aggregation mixes the online weights themselves: pass them as an apply")
        by_name = dict(zip(names, pieces))

        def mixed(name, x):
            return g_online * online(name, x) + from_cached(_mixed_products, x, *by_name[name])

        return memory_apply(spec, mixed, q)
    y = g_online * (online if isinstance(online, torch.Tensor) else memory_apply(spec, online, q))
    if cached_valid.shape[1]:
        if _one_token_read(spec, q, g_cached, pieces):
            by_name = dict(zip(names, pieces))
            # the linear aggregations' gates come broadcast over heads and tokens
            gates = g_cached.expand(*q.shape[:3], g_cached.shape[-1])[:, :, 0]
            read = cached_mlp_read_triton(q[:, :, 0], gates, by_name["w1"][0], by_name["w2"][0])
            return y + read[:, :, None].to(y.dtype)
        read = partial(_gated_reads, spec, 1 if q.is_cuda else n_pieces)
        y = y + from_cached(read, q, *(t for p in pieces for t in p))
    return y


def _one_token_read(spec: MLPMemorySpec, q: torch.Tensor, g: torch.Tensor, pieces: list[tuple[torch.Tensor, ...]]
                    ) -> bool:
    """Whether :func:`mc_read` reads its cached memories in one launch (:data:`ONE_TOKEN_READ`): one token a row
    (decoding) of float32 memories ``z + W1 gelu(W2 z)`` in one piece, none of them asking for gradients, outside
    autocast (whose products the batched path would round), on the Triton backend."""
    if not ONE_TOKEN_READ or q.shape[2] != 1 or spec.depth != 2 or spec.gated or spec.linear_skip:
        return False
    if not one_token_read_covers(spec.d_k) or any(len(p) != 1 for p in pieces):
        return False
    tensors = [q, g, *(p[0] for p in pieces)]
    if any(t.dtype != torch.float32 for t in tensors) or torch.is_autocast_enabled(q.device.type):
        return False
    # The kernel has no backward. Grad mode is no guide: a read recomputed in the backward
    # (recompute_in_backward) runs its first pass with it off, on tensors that ask for gradients.
    if any(t.requires_grad for t in tensors):
        return False
    return resolve_backend(q, has_triton_impl=True) == "triton"


def _mixed_products(x: torch.Tensor, g: torch.Tensor, *pieces: torch.Tensor) -> torch.Tensor:
    """``sum_n g_n W_n x`` per token over the pieces of one cached weight: soup's share of the cached
    memories in a mixed weight's product."""
    covered = MIXED_PRODUCTS and all(t.dtype == torch.float32 for t in (x, g, *pieces))
    triton = resolve_backend(x, has_triton_impl=covered, what=lambda: _uncovered_mix(x, pieces[0])) == "triton"
    out = None
    for i, gates in _nonempty(pieces, g):
        if triton:  # the tokens' sums stay on chip while the kernel walks the memories
            part = mixed_products_triton(x, gates, pieces[i])
        else:
            # Each memory's product, then the gated sum: plain batched products (the three-operand einsum over
            # pieces of one memory made a CPU training step 6x slower).
            part = torch.einsum("bnhto,bhtn->bhto", x[:, None] @ pieces[i].to(x.dtype).transpose(-1, -2), gates)
        out = part if out is None else out + part
    return out


def _uncovered_mix(x: torch.Tensor, w: torch.Tensor) -> str:
    if not MIXED_PRODUCTS:
        return "the soup aggregation's mixed products with memory_caching.MIXED_PRODUCTS off"
    return f"the soup aggregation's mixed products of {x.dtype} inputs and {w.dtype} weights (the kernels take float32)"


def _gated_reads(spec: MLPMemorySpec, n_pieces: int, q: torch.Tensor, g: torch.Tensor,
                 *weights: torch.Tensor) -> torch.Tensor:
    """``sum_n g_n M_n(q)`` over the cached memories, given name by name (``spec.shapes`` order) in
    ``n_pieces`` pieces along ``N`` each."""
    names = list(spec.shapes)
    by_name = [weights[j * n_pieces:(j + 1) * n_pieces] for j in range(len(names))]
    out = None
    for i, gates in _nonempty(by_name[0], g):
        piece = {name: w[i] for name, w in zip(names, by_name)}
        per_memory = memory_apply(spec, static_apply(piece), q[:, None])  # (B, n, H, T, d_v)
        part = torch.einsum("bnhtd,bhtn->bhtd", per_memory, gates)
        out = part if out is None else out + part
    return out


def _on_joined(fn, n_pieces: int, x: torch.Tensor, g: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
    """``fn(x, g, *weights)`` with every run of ``n_pieces`` consecutive pieces (one weight's) joined along ``N``."""
    return fn(x, g, *(torch.cat(list(weights[i:i + n_pieces]), 1) for i in range(0, len(weights), n_pieces)))


def _nonempty(pieces: Sequence[torch.Tensor], g: torch.Tensor):
    """``(index, gates)`` of the pieces of at least one memory, with their share of the gates ``g (..., N)``;
    the first piece alone where all are empty (its products are the zeros of an empty sum, with their
    gradients)."""
    starts = [0]
    for w in pieces:
        starts.append(starts[-1] + w.shape[1])
    chosen = [i for i, w in enumerate(pieces) if w.shape[1]] or [0]
    for i in chosen:
        yield i, g[..., starts[i]:starts[i + 1]]


# -------------------------------- Segment summaries: the bookkeeping every caching memory shares


def key_mean(key_sum: torch.Tensor, key_count: torch.Tensor) -> torch.Tensor:
    """``key_sum (..., H, d_k) / key_count (...)``: zero where no key was received."""
    return key_sum / key_count.clamp(min=1)[..., None, None]


def with_extra_slots(t: torch.Tensor, dim: int, extra: int = 1) -> torch.Tensor:
    """``t`` with ``extra`` zero slots appended along ``dim``."""
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t, t.new_zeros(shape)], dim)


def close_segments(
    key_sum: torch.Tensor,
    key_count: torch.Tensor,
    online_key_sum: torch.Tensor,
    online_key_count: torch.Tensor,
    at: torch.Tensor,
    closing: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Move the online segment's keys into slot ``at`` ``(..., N)`` (bool, one slot per closing row) where
    ``closing`` ``(...,)``, and restart those online segments empty. Returns the four tensors, updated."""
    return (
        torch.where(at[..., None, None], online_key_sum.unsqueeze(-3), key_sum),
        torch.where(at, online_key_count.unsqueeze(-1), key_count),
        torch.where(closing[..., None, None], torch.zeros_like(online_key_sum), online_key_sum),
        torch.where(closing, torch.zeros_like(online_key_count), online_key_count),
    )


# --------------------------------------------------------------------------- decode slots


DECODE_EXACT_SLOTS = 8


def decode_slots(seen: int, segment_size: int) -> int:
    """The cache's slots for a one-token step after ``seen`` tokens (the most any row has seen): one for
    every segment closed by then, exactly up to :data:`DECODE_EXACT_SLOTS` and beyond that rounded up to a
    quarter of the power of two below (8 -> 8, 9 -> 10, 17 -> 20, 33 -> 40): at most a quarter of them
    empty. A captured decode step holds the cache's shape, so it serves until its slots run out, which
    then takes a number of segments that grows with the cache; the eager step sizes its cache alike, so
    both read caches of one shape."""
    closed = (seen + 1) // segment_size
    if closed <= DECODE_EXACT_SLOTS:
        return closed
    step = 1 << (closed.bit_length() - 3)
    return -(-closed // step) * step


def decode_steps_within(slots: int, seen: int, segment_size: int) -> int:
    """How many one-token steps from ``seen`` tokens a cache of ``slots`` slots takes before it must grow."""
    return max(0, (slots + 1) * segment_size - 1 - seen)


SLOT_MODES = ("grow", "reserved", "in_place")


def check_slot_mode(slots: str) -> None:
    """``slots`` of a cache's ``push``: ``"grow"`` adds a slot where a row needs one (reading the counts back to
    the host); ``"reserved"``: the caller made room, so nothing is read back (a step a CUDA graph can capture);
    ``"in_place"``: also writes each row's new memory into the cache's own tensors (a graphed step's buffers,
    which nothing else holds: a step then moves one memory a row, not the whole cache)."""
    if slots not in SLOT_MODES:
        raise ValueError(f"slots must be one of {SLOT_MODES}, got {slots!r}")


def grown_slots(rows: torch.Tensor, count: torch.Tensor) -> int | None:
    """The slots a ``"grow"`` push of ``rows`` (bool ``(B,)``) onto caches holding ``count`` ``(B,)`` memories
    needs, read back to the host; ``None`` when no row closes a segment."""
    if not bool(rows.any()):
        return None
    return int((count + rows.long()).max())


def write_slots_(cache: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, index: torch.Tensor) -> None:
    """``cache[..., index, :] = values`` where ``rows``, in place: ``cache`` ``(*lead, N, *inner)``, ``values``
    ``(*lead, *inner)``, ``rows`` (bool) and ``index`` ``(*lead)``, clamped to ``0 .. N - 1``; nothing without slots.

    A graphed decode step's segment-end write, which runs every step. On the Triton backend, one launch whose
    programs return at once where a row closes nothing (:func:`~.cache_slots_triton.write_slots_triton`); in
    PyTorch, each row's slot gathered, chosen and put back (a full row that closes nothing writes back what it
    holds). Either way the cache's version moves on, so a backward that saved it refuses to run."""
    lead = rows.shape
    N = cache.shape[len(lead)]
    if N == 0:
        return
    L = rows.numel()
    if (resolve_backend(cache, has_triton_impl=True) == "triton" and cache.is_contiguous()
            and not (torch.is_grad_enabled() and (cache.requires_grad or values.requires_grad))
            and values.untyped_storage().data_ptr() != cache.untyped_storage().data_ptr()):
        write_slots_triton(cache.view(L, *cache.shape[len(lead):]), values.reshape(L, *values.shape[len(lead):]),
                           rows.reshape(L), index.reshape(L))
        torch.autograd.graph.increment_version(cache)
        return
    where = tuple(torch.arange(n, device=rows.device).view([-1 if i == d else 1 for i in range(len(lead))]).expand(lead)
                  for d, n in enumerate(lead))
    where += (index.clamp(0, N - 1),)
    cache[where] = torch.where(rows.view(*lead, *([1] * (values.dim() - len(lead)))), values.to(cache.dtype),
                               cache[where])


def write_memories(cached: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], rows: torch.Tensor,
                   count: torch.Tensor, slot: torch.Tensor, *, in_place: bool) -> dict[str, torch.Tensor]:
    """``weights`` ``{name: (B, ...)}`` of ``rows`` (bool ``(B,)``) in the slot ``count`` ``(B,)`` of each row's
    cached ``{name: (B, N, ...)}`` (``slot`` ``(B, N)``: that slot, where ``rows``). ``in_place`` writes into
    the cached tensors themselves (``N >= 1``) and returns them; otherwise new tensors."""
    if in_place:
        for n, c in cached.items():
            write_slots_(c, weights[n], rows, count)
        return cached
    s = slot.view(*slot.shape, *([1] * (next(iter(cached.values())).dim() - 2)))
    return {n: torch.where(s, weights[n][:, None].to(c.dtype), c) for n, c in cached.items()}
