"""Memory Caching over the Titans memory (docs/semantics.md, MC paper): the cached memories of MC-Titans.

Each row's sequence is cut into segments; at a segment's end the layer caches the online Titans
memory's weights and the segment's key summary, and every token reads its online memory and the
cached ones through the aggregation of :mod:`.memory_caching` (``residual``, ``mean``, ``grm``,
``soup``, ``ssc``).

Segmentation ``constant`` cuts every ``segment_size`` tokens (``None``: one
segment, plain Titans) and restarts the inner chunks at each segment start;
``cache_mode="independent"`` also restarts the online memory from its learned
initial weights there. ``logarithmic`` cuts a prefix of length ``L`` into the
powers of two of ``L``'s binary form, oldest largest (a cached memory is the
online memory at a segment end; segments merge as ``L`` grows, and their
summaries merge with them); its inner chunks follow the global clock, and its
chunked path runs the exact step token by token. ``independent`` with
``logarithmic`` is undefined (a merged segment would need its memory retrained
from scratch) and is rejected.

Entry points: :func:`reference_mc_titans` (readable, per row, Python lists),
:func:`chunk_mc_titans` (batched) and :func:`step_mc_titans` (one token). The read through the
aggregation (:func:`~.memory_caching.mc_read`), the gates and the segment summaries are shared
with the other cached memories and live in :mod:`.memory_caching`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import NamedTuple

import torch

from .backend import requested_backend, resolve_backend, triton_available
from .chunk_loop import recompute_in_backward, run_chunks, tf32_products, tf32_wanted
from .memory_caching import (
    DECODE_EXACT_SLOTS,
    MCOptions,
    check_slot_mode,
    close_segments,
    decode_slots,
    decode_steps_within,
    grown_slots,
    key_mean,
    log_segments,
    mc_gates,
    mc_read,
    ssc_select,
    with_extra_slots,
    write_memories,
)
from .mlp_memory import (
    MLPMemorySpec,
    align_rows,
    chunks_last,
    grad_factors,
    memory_apply,
    next_chunk_start,
    resumed_grad_weights,
    static_apply,
)
from .normalized_features import normalized_features
from .norms import l2_normalize
from .titans import (
    TitansChunk,
    TitansState,
    _titans_step,
    step_titans,
    titans_chunk_operator,
    titans_coefficients,
    titans_update,
)
from .titans_chunk import AUTOGRAD_PATH
from .titans_chunk import wanted as fused_chunks
from .titans_persistent_triton import first_pass_wanted, loop_first_pass
from .titans_persistent_triton import titans_chunks as persistent_chunks
from .titans_persistent_triton import wanted as persistent_wanted

__all__ = ["DECODE_EXACT_SLOTS", "MCState", "chunk_mc_titans", "decode_slots", "decode_steps_within",
           "reference_mc_titans", "step_mc_titans"]


_PER_TOKEN = ("q", "k", "v", "u", "retention", "momentum", "lr")


class MCChunk(NamedTuple):
    """The per-chunk inputs of :func:`_mc_chunk_step`, chunk-first ``(n, B, H, C, ...)``: the online
    memory's (as :class:`~.titans.TitansChunk`), the gate projection ``u``, and ``use_stored (n, B)``,
    the resumed rows whose first token is inside the chunk."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    u: torch.Tensor
    retention: torch.Tensor
    momentum: torch.Tensor
    lr: torch.Tensor
    live: torch.Tensor
    stops: torch.Tensor
    use_stored: torch.Tensor


# --------------------------------------------------------------------------- reference


def reference_mc_titans(
    spec: MLPMemorySpec,
    options: MCOptions,
    q, k, v, u, retention, momentum, lr,
    init: dict[str, torch.Tensor],
    *,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token by token, one row at a time, with plain lists of snapshots."""
    B, T, H, _ = q.shape
    dtype = torch.promote_types(v.dtype, torch.float32)
    o = torch.zeros(B, T, H, v.shape[-1], dtype=dtype, device=v.device)
    S_seg, C = options.segment_size, options.chunk_size
    for b in range(B):
        n_tokens = T if lengths is None else int(lengths[b])
        W = {n: w.to(dtype).clone() for n, w in init.items()}
        M = {n: torch.zeros_like(w) for n, w in W.items()}
        snapshots: list[tuple[int, dict, torch.Tensor]] = []  # (end, weights, key sum)
        keys = []
        for t in range(n_tokens):
            qt, kt = l2_normalize(q[b, t].to(dtype)), l2_normalize(k[b, t].to(dtype))
            keys.append(kt)
            if options.logarithmic:
                segments = log_segments(t + 1)
                ends = {end for _, end in segments[:-1]}
                if t > 0 and t in ends and all(e != t for e, _, _ in snapshots):
                    snapshots.append((t, {n: w.clone() for n, w in W.items()}, None))
                snapshots = [s for s in snapshots if s[0] in ends]
                cached_segments = segments[:-1]
                online_start = segments[-1][0]
                if t % C == 0:
                    W0 = {n: w.clone() for n, w in W.items()}
            else:
                seg_start = t - t % S_seg if S_seg else 0
                if S_seg and t % S_seg == 0 and t > 0 and options.cache_mode == "independent":
                    W = {n: w.to(dtype).clone() for n, w in init.items()}
                    M = {n: torch.zeros_like(w) for n, w in W.items()}
                if (t - seg_start) % C == 0:
                    W0 = {n: w.clone() for n, w in W.items()}
                cached_segments = [(e - S_seg, e) for e, _, _ in snapshots]
                online_start = seg_start
            factors = grad_factors(spec, W0, kt[:, None], v[b, t].to(dtype)[:, None])
            for n, (A, Bf) in factors.items():
                W[n], M[n] = titans_update(W[n], M[n], A[:, 0], Bf[:, 0], retention[b, t], momentum[b, t], lr[b, t])
            # read: the online memory and every cached one
            memories = [s[1] for s in snapshots] + [W]
            summaries = [torch.stack(keys[s:e]).mean(0) for s, e in cached_segments]
            summaries.append(torch.stack(keys[online_start:t + 1]).mean(0))
            outs = torch.stack([memory_apply(spec, static_apply(m), qt[:, None])[:, 0] for m in memories])
            ut = u[b, t].to(dtype)
            scores = torch.stack([(ut * r).sum(-1) for r in summaries])  # (N + 1, H)
            agg = options.aggregation
            if agg == "ssc":
                # Every cached memory scoring at least the k-th best score is kept, ties included, as
                # in mc_read; keeping exactly the indices topk returns made the two disagree on ties
                # (identical segment summaries, or a zero gate projection, which must read as mean).
                scores = torch.cat([ssc_select(scores[:-1], options.ssc_topk, dim=0), scores[-1:]])
            if agg in ("grm", "ssc"):
                o[b, t] = (torch.softmax(scores, 0)[..., None] * outs).sum(0)
            elif agg == "soup":
                gates = torch.softmax(scores, 0)
                mixed = {n: sum(gates[i][:, None, None] * memories[i][n] for i in range(len(memories))) for n in W}
                o[b, t] = memory_apply(spec, static_apply(mixed), qt[:, None])[:, 0]
            elif agg == "residual":
                o[b, t] = outs.sum(0)
            else:
                o[b, t] = outs.mean(0)
            if not options.logarithmic and S_seg and (t + 1) % S_seg == 0:
                snapshots.append((t + 1, {n: w.clone() for n, w in W.items()}, None))
    return o.to(v.dtype)


# --------------------------------------------------------------------------- state


@dataclass
class MCState:
    """Online Titans state plus the cache of segment memories of every row (batch first)."""

    memory: TitansState
    seen: torch.Tensor  # (B,) tokens written
    key_sum: torch.Tensor  # (B, H, d_k) keys of the online segment so far
    key_count: torch.Tensor  # (B,)
    cached: dict[str, torch.Tensor]  # (B, N, H, d_out, d_in)
    cached_key_sum: torch.Tensor  # (B, N, H, d_k)
    cached_key_count: torch.Tensor  # (B, N)
    num_cached: torch.Tensor  # (B,)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = self.memory.tensors("memory.")
        out.update(seen=self.seen, key_sum=self.key_sum, key_count=self.key_count,
                   cached_key_sum=self.cached_key_sum, cached_key_count=self.cached_key_count,
                   num_cached=self.num_cached)
        out.update({f"cached.{n}": t for n, t in self.cached.items()})
        return out

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> "MCState":
        return cls(
            memory=TitansState.from_tensors(t, prefix="memory."),
            seen=t["seen"], key_sum=t["key_sum"], key_count=t["key_count"],
            cached={name.removeprefix("cached."): x for name, x in t.items() if name.startswith("cached.")},
            cached_key_sum=t["cached_key_sum"], cached_key_count=t["cached_key_count"], num_cached=t["num_cached"],
        )

    @classmethod
    def initial(cls, init: dict[str, torch.Tensor], batch: int, d_k: int) -> "MCState":
        memory = TitansState.initial(init, batch)
        w = next(iter(memory.weights.values()))
        H = w.shape[1]
        return cls(
            memory=memory,
            seen=torch.zeros(batch, dtype=torch.long, device=w.device),
            key_sum=w.new_zeros(batch, H, d_k),
            key_count=w.new_zeros(batch),
            cached={n: x.new_zeros(batch, 0, *x.shape[1:]) for n, x in memory.weights.items()},
            cached_key_sum=w.new_zeros(batch, 0, H, d_k),
            cached_key_count=w.new_zeros(batch, 0),
            num_cached=torch.zeros(batch, dtype=torch.long, device=w.device),
        )

    @property
    def cached_valid(self) -> torch.Tensor:
        N = self.cached_key_count.shape[1]
        return torch.arange(N, device=self.seen.device)[None] < self.num_cached[:, None]

    def cached_summary(self) -> torch.Tensor:
        return key_mean(self.cached_key_sum, self.cached_key_count)

    def reserve(self, slots: int) -> None:
        """At least ``slots`` slots in the cache (new ones empty): room for :meth:`push` without device reads."""
        extra = slots - self.cached_key_count.shape[1]
        if extra > 0:
            self.cached = {n: with_extra_slots(c, 1, extra) for n, c in self.cached.items()}
            self.cached_key_sum = with_extra_slots(self.cached_key_sum, 1, extra)
            self.cached_key_count = with_extra_slots(self.cached_key_count, 1, extra)

    def push(self, rows: torch.Tensor, weights: dict[str, torch.Tensor], *, slots: str = "grow") -> None:
        """Cache ``weights`` and the online segment's keys for ``rows`` (bool ``(B,)``), then reset the segment;
        ``slots``: how the cache makes room (:func:`~.memory_caching.check_slot_mode`)."""
        check_slot_mode(slots)
        if slots == "grow":
            needed = grown_slots(rows, self.num_cached)
            if needed is None:
                return
            self.reserve(needed)
        N = self.cached_key_count.shape[1]
        if slots == "in_place" and N == 0:  # no slot: nothing can close yet (the caller reserved what the host knows)
            return
        slot = (torch.arange(N, device=rows.device)[None] == self.num_cached[:, None]) & rows[:, None]  # (B, N)
        self.cached = write_memories(self.cached, weights, rows, self.num_cached, slot, in_place=slots == "in_place")
        self.cached_key_sum, self.cached_key_count, self.key_sum, self.key_count = close_segments(
            self.cached_key_sum, self.cached_key_count, self.key_sum, self.key_count, slot, rows)
        self.num_cached = self.num_cached + rows.long()

    def slots_after(self, closes: torch.Tensor) -> tuple[int, int]:
        """The cache's slots after :meth:`append` of ``closes`` and the fewest memories a row holds then: a
        device-to-host read, which a caller may make before queueing the work whose results it appends
        (so that the read does not wait for that work)."""
        N0 = self.cached_key_count.shape[1]
        if not closes.shape[0]:
            return N0, 0
        count = self.num_cached + closes.long().sum(1)
        most, fewest = torch.stack([count.max(), count.min()]).tolist()
        return max(N0, most), fewest

    def append(self, closes: torch.Tensor, weights: dict[str, torch.Tensor], key_sum: torch.Tensor,
               key_count: torch.Tensor, slots: tuple[int, int] | None = None) -> None:
        """Cache ``n`` memories at once: memory ``j`` (``weights (B, n, H, d_out, d_in)``, its segment's keys
        ``key_sum (B, n, H, d_k)``, ``key_count (B, n)``) for the rows that close segment ``j``
        (``closes (B, n)``, a prefix of each row's segments), after each row's cached memories. The state
        ends as ``n`` calls of :meth:`push` leave it, the online segment's keys aside (the caller's),
        with one copy of the cache instead of one per memory. ``slots``: :meth:`slots_after`, if read."""
        B, n = closes.shape
        N0 = self.cached_key_count.shape[1]
        count = self.num_cached + closes.long().sum(1)
        N, fewest = self.slots_after(closes) if slots is None else slots
        # Every row caches every memory in an empty cache: the memories are the cache. (It may share storage with
        # tensors saved for a backward; the cache is only ever replaced, never written in place.)
        if N0 == 0 and fewest == n:
            self.cached = {name: weights[name].to(c.dtype) for name, c in self.cached.items()}
            self.cached_key_sum = key_sum.to(self.cached_key_sum.dtype)
            self.cached_key_count = key_count.to(self.cached_key_count.dtype)
            self.num_cached = count
            return
        slot = torch.arange(N, device=closes.device)[None]
        new = slot - self.num_cached[:, None]
        # Each slot takes a new memory, its old content, or (a new slot left empty) the zero entry at N0 + n.
        source = torch.where((new >= 0) & (slot < count[:, None]), N0 + new, torch.where(slot < N0, slot, N0 + n))

        def place(old: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
            pool = torch.cat([old, fresh.to(old.dtype), old.new_zeros(B, 1, *old.shape[2:])], 1)
            index = source.reshape(B, N, *([1] * (old.dim() - 2))).expand(B, N, *old.shape[2:])
            return pool.gather(1, index)

        self.cached = {name: place(c, weights[name]) for name, c in self.cached.items()}
        self.cached_key_sum = place(self.cached_key_sum, key_sum)
        self.cached_key_count = place(self.cached_key_count, key_count)
        self.num_cached = count

    def merge_log(self, rows: torch.Tensor, length: torch.Tensor) -> None:
        """Logarithmic segments: keep ``popcount(length) - 1`` cached memories; merge the dropped ones' keys
        into the online segment."""
        keep = torch.zeros_like(length)
        x = length.clone()
        while bool((x > 0).any()):
            keep += x & 1
            x = x >> 1
        keep = torch.where(rows, (keep - 1).clamp(min=0), self.num_cached)
        N = self.cached_key_count.shape[1]
        drop = (torch.arange(N, device=rows.device)[None] >= keep[:, None]) & self.cached_valid  # (B, N)
        self.key_sum = self.key_sum + (self.cached_key_sum * drop[..., None, None]).sum(1)
        self.key_count = self.key_count + (self.cached_key_count * drop).sum(1)
        self.num_cached = torch.minimum(self.num_cached, keep)


def _reset_memory(state: TitansState, init: dict[str, torch.Tensor], rows: torch.Tensor) -> TitansState:
    r = rows[:, None, None, None]
    weights = {n: torch.where(r, init[n].to(w.dtype).expand_as(w), w) for n, w in state.weights.items()}
    momentum = {n: torch.where(r, torch.zeros_like(m), m) for n, m in state.momentum.items()}
    return TitansState(weights, momentum, state.chunk_start, state.position)


# --------------------------------------------------------------------------- step


def step_mc_titans(
    spec: MLPMemorySpec,
    options: MCOptions,
    q, k, v, u, retention, momentum, lr,
    init: dict[str, torch.Tensor],
    state: MCState,
    *,
    live: torch.Tensor | None = None,
    slots: str = "grow",
) -> tuple[torch.Tensor, MCState]:
    """One token per row (``q, k, v, u`` ``(B, H, D)``, gates ``(B, H)``); ``live`` rows only. ``slots``
    (:meth:`MCState.push`): ``"reserved"`` or ``"in_place"`` where the cache has a slot for a segment this
    token closes (:func:`decode_slots`), so fixed segments step without reading anything back."""
    B = q.shape[0]
    dtype = torch.promote_types(v.dtype, torch.float32)
    live = torch.ones(B, dtype=torch.bool, device=q.device) if live is None else live.bool()
    state = replace(state)  # the caller's state object stays as it was
    n = state.seen
    S_seg = options.segment_size
    mem = state.memory
    if options.logarithmic:
        length = n + 1
        state.push(live & (n > 0) & (length % 2 == 1), mem.weights)
        state.merge_log(live, length)
    elif S_seg:
        seg_start = live & (n % S_seg == 0) & (n > 0)
        if options.cache_mode == "independent":
            mem = _reset_memory(mem, init, seg_start)
        mem = TitansState(mem.weights, mem.momentum, mem.chunk_start,
                          torch.where(seg_start, torch.zeros_like(mem.position), mem.position))
    # Normalised once here, for the memory's step and the segment's key sum and cache read alike.
    qn, kn = normalized_features(q, dtype=dtype), normalized_features(k, dtype=dtype)
    y_online, mem = step_titans(spec, qn, kn, v, retention, momentum, lr, mem, chunk_size=options.chunk_size, live=live,
                                use_qk_l2norm=False, out_dtype=dtype)
    state.memory = mem
    state.key_sum = state.key_sum + kn * live[:, None, None]
    state.key_count = state.key_count + live.to(state.key_count.dtype)
    if options.logarithmic or S_seg:
        # The step has read the online memory already; soup mixes its weights instead of reads.
        online = static_apply(mem.weights) if options.aggregation == "soup" else y_online[:, :, None]
        y = mc_read(spec, options.aggregation, options.ssc_topk, qn[:, :, None], u.to(dtype)[:, :, None], online,
                    key_mean(state.key_sum, state.key_count)[:, :, None], state.cached, state.cached_summary(),
                    state.cached_valid)[:, :, 0]
    else:  # Titans: no memory is ever cached, the online memory's read is the output
        y = y_online
    state.seen = n + live.long()
    if not options.logarithmic and S_seg:
        state.push(live & (state.seen % S_seg == 0), mem.weights, slots=slots)
    return y.to(v.dtype), state


# Up to this many cached memories, decoding gives the cache exactly the slots it needs.
# --------------------------------------------------------------------------- chunked


def _segment_chunks(x: torch.Tensor, width: int) -> torch.Tensor:
    """``(B, H, n * width, ...)`` -> ``(n, B, H, width, ...)``: chunks first, for :func:`run_chunks`."""
    B, H, L = x.shape[:3]
    return x.reshape(B, H, L // width, width, *x.shape[3:]).movedim(2, 0)


def _mc_chunk_step(spec: MLPMemorySpec, options: MCOptions, track_start: bool, with_stored: bool,
                   carry, x, consts):
    """One inner chunk of :func:`chunk_mc_titans` as a :func:`~.chunk_loop.run_chunks` step, where the
    chunk reads the cache itself: memories outside :func:`~.titans_chunk.chunk_memory` (``soup``, whose
    mixes need the weights, or memories it does not support) and the chunk of resumed rows
    (``with_stored``). The others run :func:`~.titans._titans_step` and the cache is read for the whole
    segment after their loop (:func:`_read_segment`).

    ``carry``: weights, momenta, (``track_start``) chunk-start weights, in ``spec.shapes`` order,
    then the online segment's ``key_sum, key_count``. ``x``: the chunk's ``q, k, v, u`` and gates
    ``(B, H, C, .)``, ``live (B, C)``, ``stops (B,)`` (rows whose last token is inside),
    ``use_stored (B,)`` (resumed rows whose first token is inside). ``consts``: the cache
    (:meth:`_SegmentCache.consts`: ``valid``, summaries, the weights in pieces), then
    (``with_stored``) the stored chunk-start weights.
    """
    names = list(spec.shapes)
    m = len(names)
    W, M = dict(zip(names, carry[:m])), dict(zip(names, carry[m:2 * m]))
    key_sum, key_count = carry[-2], carry[-1]
    q, k, v, u, retention, momentum, lr, lv, stops, use_stored = MCChunk(*x)
    run_sum = key_sum[:, :, None] + (k * lv[:, None, :, None]).cumsum(2)
    run_count = key_count[:, None] + lv.to(k.dtype).cumsum(1)
    cached_valid, cached_summary = consts[0], consts[1]
    # Per name the state's weights, then one piece per later slot (none: the state's cache alone).
    per_name = 1 + cached_valid.shape[1] - consts[2].shape[1]
    weights = consts[2:2 + m * per_name]
    cached = {n: weights[i * per_name] if per_name == 1 else weights[i * per_name:(i + 1) * per_name]
              for i, n in enumerate(names)}
    grad_w = resumed_grad_weights(W, use_stored, consts[2 + m * per_name:]) if with_stored else W
    online = titans_chunk_operator(spec, W, M, grad_w, k, v, retention, momentum, lr, lv)
    W_new, M_new = online.final()
    summary = run_sum / run_count.clamp(min=1)[:, None, :, None]
    y = mc_read(spec, options.aggregation, options.ssc_topk, q, u, online, summary, cached, cached_summary,
                cached_valid, recompute=True)
    new_carry = tuple(W_new[n] for n in names) + tuple(M_new[n] for n in names)
    if track_start:
        new_carry += next_chunk_start(stops, grad_w, carry[2 * m:3 * m])
    return (y,), new_carry + (run_sum[:, :, -1], run_count[:, -1])


@dataclass
class _SegmentCache:
    """The cached memories the segments of one call of :func:`chunk_mc_titans` read, kept as the tensors they
    are made of rather than as the state's stacked cache: the state's cache at the call's start
    (``weights (B, N0, H, d_out, d_in)`` per name, ``summary (B, N0, H, d_k)``, ``valid (B, N0)``) and, per
    segment closed since, the online memory's weights at its end (``(B, H, d_out, d_in)`` per name, tensors
    the chunk loop holds anyway), its summary ``(B, H, d_k)`` and the rows that closed it ``(B,)``.

    The state stacks a new copy of its whole cache at every segment's close; a segment's read that kept its
    copy for the backward held ``N`` memories at the ``N``-th segment, ``N^2 / 2`` memories over a sequence
    (about 15 GiB per layer at 512 tokens in segments of 16 for 4 rows of 4 heads x 256). Read from these
    pieces (:func:`~.memory_caching.mc_read`), every segment's read keeps the same tensors for its backward:
    the call holds each memory once."""

    weights: dict[str, torch.Tensor]
    summary: torch.Tensor
    valid: torch.Tensor
    fresh: list[tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]]

    @classmethod
    def of(cls, state: MCState, dtype: torch.dtype) -> "_SegmentCache":
        return cls({n: w.to(dtype) for n, w in state.cached.items()}, state.cached_summary().to(dtype),
                   state.cached_valid, [])

    def close(self, weights: dict[str, torch.Tensor], summary: torch.Tensor, rows: torch.Tensor) -> None:
        """Add the memory that ``rows`` cache at a segment's end (none if no row does, as in :meth:`MCState.push`)."""
        if bool(rows.any()):
            self.fresh.append((weights, summary, rows))

    def __len__(self) -> int:
        return self.valid.shape[1] + len(self.fresh)

    def tensors(self, names: list[str]) -> tuple[torch.Tensor, ...]:
        """What the read differentiates: the summaries, then the weights name by name (the state's, then
        each fresh memory's)."""
        return (self.summary, *(s for _, s, _ in self.fresh),
                *(t for n in names for t in (self.weights[n], *(w[n] for w, _, _ in self.fresh))))

    def consts(self, names: list[str]) -> tuple[torch.Tensor, ...]:
        """The cache as :func:`_mc_chunk_step` takes it: ``valid (B, P)``, summaries ``(B, P, H, d_k)``, then
        per name the state's weights and one ``(B, 1, H, d_out, d_in)`` piece per later slot (views of the
        fresh memories, then one shared zero memory), which the step reads as pieces
        (:func:`~.memory_caching.mc_read`); without fresh memories, the state's weights padded, one piece.
        The slots are padded with empty, invalid ones to a power of two ``P``: the cache grows by a memory per
        segment and its size is part of the step's shapes, so a sequence of ``n`` segments runs ``log2 n``
        shapes of the step (CUDA graph captures) instead of ``n``; every aggregation reads an empty slot with
        weight zero."""
        N0, k = self.valid.shape[1], len(self.fresh)
        N = N0 + k
        pad = ((1 << (N - 1).bit_length()) if N else 0) - N
        B = self.valid.shape[0]
        valid = torch.cat([self.valid, *(rows[:, None] for _, _, rows in self.fresh),
                           self.valid.new_zeros(B, pad)], 1)
        summary = torch.cat([self.summary, *(s[:, None] for _, s, _ in self.fresh),
                             self.summary.new_zeros(B, pad, *self.summary.shape[2:])], 1)
        if not k:  # the state's cache alone: one piece, padded
            return (valid, summary, *(with_extra_slots(self.weights[n], 1, pad) if pad else self.weights[n]
                                      for n in names))
        pieces = []
        for n in names:
            base = self.weights[n]
            empty = base.new_zeros(B, 1, *base.shape[2:]) if pad else None
            if empty is not None and base.is_cuda and any(w[n].requires_grad for w, _, _ in self.fresh):
                # An empty slot asks for its gradient as the fresh memories do: which consts ask is part of a
                # captured step's key (CUDA graphs), so that a step keeps one capture per cache size (log2 n over
                # n segments) rather than one per segment. On CUDA the pieces are joined before the read, whose
                # backward makes every slot's gradient anyway.
                empty.requires_grad_()
            pieces += [base, *(w[n][:, None] for w, _, _ in self.fresh), *(empty,) * pad]
        return (valid, summary, *pieces)

    def read_inputs(self, names: list[str], tensors: tuple[torch.Tensor, ...]):
        """The cache as :func:`~.memory_caching.mc_read` takes it, from :meth:`tensors` (or leaves made of them):
        ``(weights, summary, valid)``, the state's memories first, then the fresh ones in order; the weights
        stay in pieces (the state's cache, then one ``(B, 1, H, d_out, d_in)`` view per fresh memory)."""
        k = len(self.fresh)
        summary = torch.cat([tensors[0], *(s[:, None] for s in tensors[1:1 + k])], 1)
        valid = torch.cat([self.valid, *(rows[:, None] for _, _, rows in self.fresh)], 1)
        per_name = tensors[1 + k:]
        weights = {n: (per_name[i * (k + 1)], *(w[:, None] for w in per_name[i * (k + 1) + 1:(i + 1) * (k + 1)]))
                   for i, n in enumerate(names)}
        return weights, summary, valid


def _read_segment(spec: MLPMemorySpec, options: MCOptions, q, u, k, lv, key_sum, key_count, online,
                  cache: _SegmentCache, tf32: bool):
    """The reads of a run of chunks inside one segment (``(B, H, L, .)``, ``lv (B, L)``) from the online
    memory's reads ``online`` and the cache: the cache is constant inside a segment, so every chunk's
    read of it is one batch of matmuls here instead of a per-chunk read inside the loop. Recomputed in
    the backward (its hidden layers are a cached memory's worth per token), from the memories of
    :class:`_SegmentCache` that every segment's read shares, with TF32 products for low-precision problems
    (``tf32``) as inside the loop. Without cached memories every aggregation weighs the online read by
    exactly 1 (a softmax over one score; the mean over one memory), so the read is the online one, without
    the segment's running key means: plain Titans, and an MC layer before its first segment closes."""
    if not len(cache):
        return online
    run_sum = key_sum[:, :, None] + (k * lv[:, None, :, None]).cumsum(2)
    run_count = key_count[:, None] + lv.to(k.dtype).cumsum(1)
    summary = run_sum / run_count.clamp(min=1)[:, None, :, None]
    names = list(spec.shapes)
    # A copy of the list: the cache grows (the segment's close) before the backward runs.
    cache = replace(cache, fresh=list(cache.fresh))

    def read(q, u, online, summary, *pieces):
        cached, cached_summary, valid = cache.read_inputs(names, pieces)
        return mc_read(spec, options.aggregation, options.ssc_topk, q, u, online, summary, cached,
                       cached_summary, valid)

    return recompute_in_backward(read, (q, u, online, summary, *cache.tensors(names)), tf32=tf32)


# Elements of the hidden layers of one batch of cached reads (256 MiB in float32): consecutive memories
# are read together while their queries' hidden layers fit in it (at least one memory a batch).
READ_BATCH_ELEMENTS = 1 << 26
# Selective memories share a batch when the widest reads at most this many times the queries of the narrowest:
# a batch's padding (queries of zero gate) is then at most 1 - 1 / READ_BATCH_SPREAD of its reads.
READ_BATCH_SPREAD = 2


@dataclass(frozen=True)
class _ReadBatch:
    """Cached memories ``[first, last)`` read in one batch of products: every query from ``start`` on
    (``pick`` is ``None``), or, per memory, the queries at ``pick (G, B, H, width)``: those whose gate of
    it is nonzero, padded with queries of zero gate to the batch's widest."""

    first: int
    last: int
    start: int
    pick: torch.Tensor | None = None


def _read_batches(spec: MLPMemorySpec, g: torch.Tensor, starts: tuple[int, ...], select: bool,
                  heads: int) -> list[_ReadBatch]:
    """How :class:`_CachedReads` reads memories ``j < N = len(starts)`` (gates ``g (>= N, B, H, T)``, nonzero
    from ``starts[j]`` on; queries of ``heads`` heads) in batches of consecutive memories. With ``select``
    (``ssc``, whose gates are zero but for a few memories per query) a memory reads only the queries that
    chose it wherever they are at most half of its queries: one device-to-host read of every memory's
    width. Batches hold memories of one kind and at most ``READ_BATCH_ELEMENTS`` of hidden layer: those
    that read every query from their start, of one start (the state's memories); the selective ones, of
    widths within ``READ_BATCH_SPREAD`` of each other (padding wastes at most half of a batch of small reads
    at the default 2)."""
    N, (_, B, _, T) = len(starts), g.shape
    hidden = spec.d_v if spec.depth == 1 else spec.hidden * (2 if spec.gated else 1)
    per_query = B * heads * hidden
    spans = [T - s for s in starts]
    widths, order = spans, None
    if select and N:
        chosen = g > 0
        counts = chosen[:N].sum(-1).amax((1, 2)).tolist()
        widths = [c if 2 * c <= span else span for c, span in zip(counts, spans)]
        if any(w < span for w, span in zip(widths, spans)):
            # Per memory, the queries that chose it first (in order), then the others: one sort for all.
            order = torch.argsort((~chosen[:N]).to(torch.int8), dim=-1, stable=True)
    batches, j = [], 0
    while j < N:
        if widths[j] == 0:
            j += 1
            continue
        picked = widths[j] < spans[j]
        last, widest, narrowest = j + 1, widths[j], widths[j]
        while last < N and widths[last] and (widths[last] < spans[last]) == picked:
            if not picked and starts[last] != starts[j]:
                break  # reading the earlier queries would cost products of zero weight
            wide, narrow = max(widest, widths[last]), min(narrowest, widths[last])
            if wide > READ_BATCH_SPREAD * narrow or (last + 1 - j) * wide * per_query > READ_BATCH_ELEMENTS:
                break
            widest, narrowest, last = wide, narrow, last + 1
        if picked:
            batches.append(_ReadBatch(j, last, 0, order[j:last, ..., :widest]))
        else:
            batches.append(_ReadBatch(j, last, starts[j]))
        j = last
    return batches


class _CachedReads(torch.autograd.Function):
    """``y = sum_j g_j M_j(q)`` over the cached memories ``j`` (weights ``(N, B, H, d_out, d_in)``, gates
    ``g (N, B, H or 1, T)``), in the batches of :func:`_read_batches`. Where the fused kernels of
    :mod:`.mc_titans_triton` run (:func:`_fused_reads`), the memories that read every query from their
    start are read in one launch a pass, query block by query block, and each batch of selective memories
    in one launch over its gathered queries (a memory and a batch x head per row of the kernels' grid); the
    hidden layers never leave the chip. Elsewhere a batch is one batch of products, its hidden layers (a
    memory's worth of width per query) recomputed in the backward. Batches are what made ssc's many small
    selective reads cheap (their launches, one memory at a time, set the pace of the layer); memories that
    read every query from different starts stay one per batch, whose products a shared start would only
    pad with zero gates. Sums over the memories of a batch that land on one query go through one
    ``scatter_add_`` per memory (distinct positions each), so that the result does not depend on the order
    of atomic additions."""

    @staticmethod
    def forward(ctx, spec: MLPMemorySpec, tf32: bool, batches: list[_ReadBatch], q, g, *weights):
        names = list(spec.shapes)
        fused = _fused_reads(spec, q, g, weights, tf32)
        ctx.spec, ctx.tf32, ctx.batches, ctx.fused = spec, tf32, batches, fused
        ctx.save_for_backward(q, g, *weights)
        if fused is not None:
            from .mc_titans_triton import ONE_MEMORY, cached_reads_forward  # noqa: PLC0415

            operands, precision = fused
            w_op = [w.to(operands) for w in weights]
            dense = _dense_reads(batches)
            y = (q.new_zeros(*q.shape[:-1], spec.d_v) if dense is None
                 else cached_reads_forward(q, g, *w_op, dense, precision))
            for batch in (batch for batch in batches if batch.pick is not None):
                qb, gb, wb = _CachedReads._picked(q, g, w_op, batch)
                out = cached_reads_forward(qb, gb, *wb, ONE_MEMORY, precision)
                _CachedReads._add(y, out.view(*batch.pick.shape, -1), batch)
            return y
        y = q.new_zeros(*q.shape[:-1], spec.d_v)
        with tf32_products(tf32):
            for batch in batches:
                w = {n: x[batch.first:batch.last] for n, x in zip(names, weights)}
                qb, gb = _CachedReads._rows(q, batch), _CachedReads._gates(g, batch)
                _CachedReads._add(y, gb[..., None] * memory_apply(spec, static_apply(w), qb), batch)
        return y

    @staticmethod
    def _rows(x: torch.Tensor, batch: _ReadBatch) -> torch.Tensor:
        """The batch's rows of a per-query ``x (B, H, T, d)`` (queries, output gradients): ``(1 or G, B, H, L, d)``."""
        if batch.pick is None:
            return x[None, :, :, batch.start:]
        pick = batch.pick
        return x[None].expand(pick.shape[0], *x.shape).gather(3, pick[..., None].expand(*pick.shape, x.shape[-1]))

    @staticmethod
    def _gates(g: torch.Tensor, batch: _ReadBatch) -> torch.Tensor:
        """The batch's gates ``(G, B, H, L)``."""
        g = g[batch.first:batch.last]
        return g[..., batch.start:] if batch.pick is None else g.gather(3, batch.pick)

    @staticmethod
    def _picked(q: torch.Tensor, g: torch.Tensor, weights: list[torch.Tensor], batch: _ReadBatch):
        """A selective batch as one memory read by ``G * B`` rows of heads for the fused kernels: its gathered
        queries ``(G * B, H, L, d)``, gates ``(1, G * B, H, L)`` and weights ``(1, G * B, H, d_out, d_in)`` (a
        view of the batch's consecutive memories)."""
        G, B, H, L = batch.pick.shape
        qb = _CachedReads._rows(q, batch).reshape(G * B, H, L, q.shape[-1])
        gb = _CachedReads._gates(g, batch).reshape(1, G * B, H, L)
        wb = [w[batch.first:batch.last].reshape(1, G * B, *w.shape[2:]) for w in weights]
        return qb, gb, wb

    @staticmethod
    def _add(target: torch.Tensor, x: torch.Tensor, batch: _ReadBatch) -> None:
        """``target (B, H, T, .) +=`` the batch's ``x (G, B, H, L, .)`` at its queries."""
        if batch.pick is None:
            target[:, :, batch.start:] += x.sum(0) if x.shape[0] > 1 else x[0]
            return
        for pick, xj in zip(batch.pick, x):
            target.scatter_add_(2, pick[..., None].expand_as(xj), xj)

    @staticmethod
    def backward(ctx, dy):
        q, g, *weights = ctx.saved_tensors
        spec, names = ctx.spec, list(ctx.spec.shapes)
        dq, dg = q.new_zeros(q.shape), g.new_zeros(g.shape)  # contiguous, as the fused kernels write them
        if ctx.fused is not None:
            return None, None, None, *_CachedReads._fused_backward(ctx.fused, ctx.batches, q, g, weights, dy, dq, dg)
        pieces = []  # per batch, (first, last, weight gradients)
        for batch in ctx.batches:
            wb = [w[batch.first:batch.last].detach().requires_grad_() for w in weights]
            qb = _CachedReads._rows(q, batch).detach().requires_grad_()
            gb = _CachedReads._gates(g, batch).detach().requires_grad_()
            with torch.enable_grad(), tf32_products(ctx.tf32):
                out = gb[..., None] * memory_apply(spec, static_apply(dict(zip(names, wb))), qb)
                dyb = _CachedReads._rows(dy, batch).expand_as(out)
                d_q, d_g, *d_w = torch.autograd.grad(out, (qb, gb, *wb), dyb)
            _CachedReads._add(dq, d_q, batch)
            if batch.pick is None:
                dg[batch.first:batch.last, ..., batch.start:] = d_g
            else:
                dg[batch.first:batch.last].scatter_(3, batch.pick, d_g)
            pieces.append((batch.first, batch.last, d_w))
        return None, None, None, dq, dg, *_join_weight_grads(weights, pieces)  # spec, tf32, batches

    @staticmethod
    def _fused_backward(fused, batches, q, g, weights, dy, dq, dg):
        """``dq, dg`` and the weights' gradients through the fused kernels: the memories that read every query
        from their start in one pass, each selective batch in one over its gathered rows."""
        from .mc_titans_triton import ONE_MEMORY, cached_reads_backward  # noqa: PLC0415

        operands, precision = fused
        # Cast again rather than kept from the forward: the cast is cheap beside a bf16 copy of every cached
        # memory held from the forward to the backward.
        w_op = [w.to(operands) for w in weights]
        dense = _dense_reads(batches)
        read = sum(batch.last - batch.first for batch in batches)  # batches never share a memory
        # Every memory's gradient is written by a kernel, or, where some memory no query reads, zero first.
        dw = [(w.new_empty if read == w.shape[0] else w.new_zeros)(w.shape) for w in weights]
        if dense is not None:
            cached_reads_backward(q, g, *w_op, dy, dense, precision, dq, dg, *dw)
        for batch in (batch for batch in batches if batch.pick is not None):
            qb, gb, wb = _CachedReads._picked(q, g, w_op, batch)
            dyb = _CachedReads._rows(dy, batch).reshape(qb.shape)
            dq_b, dg_b = torch.empty_like(qb), torch.empty_like(gb)  # one memory from query 0: every row written
            dw_b = [d[batch.first:batch.last].view(1, -1, *d.shape[2:]) for d in dw]  # written in place
            cached_reads_backward(qb, gb, *wb, dyb, ONE_MEMORY, precision, dq_b, dg_b, *dw_b)
            _CachedReads._add(dq, dq_b.view(*batch.pick.shape, -1), batch)
            dg[batch.first:batch.last].scatter_(3, batch.pick, dg_b.view(batch.pick.shape))
        return dq, dg, *dw


def _join_weight_grads(weights: list[torch.Tensor], pieces: list) -> list[torch.Tensor]:
    """The weights' gradients of :class:`_CachedReads` from the batches' ``pieces`` (``(first, last, grads)`` in
    order of memories), joined by one ``cat`` (which never holds a whole gradient beside the batches' until
    the end), zero for the memories no query reads."""
    N, parts, done = weights[0].shape[0], [[] for _ in weights], 0
    for first, last, grads in pieces:
        for part, w, d in zip(parts, weights, grads):
            if first > done:
                part.append(w.new_zeros(first - done, *w.shape[1:]))
            part.append(d)
        done = last
    for part, w in zip(parts, weights):
        if done < N or not part:
            part.append(w.new_zeros(N - done, *w.shape[1:]))
    return [torch.cat(part) if len(part) > 1 else part[0] for part in parts]


def _fused_reads(spec: MLPMemorySpec, q: torch.Tensor, g: torch.Tensor, weights: tuple[torch.Tensor, ...],
                 tf32: bool):
    """``(operands, precision)`` of :mod:`.mc_titans_triton`'s kernels for these reads, or ``None`` where
    those kernels do not run: they run on CUDA for bf16/fp16 problems (``tf32``) when Triton imports, or
    wherever Triton is asked for (its interpreter on the CPU), never under ``use_backend("torch")``; for MLP
    memories with an identity skip, no gate, widths the kernels take, gates per head, all in float32."""
    asked = requested_backend()
    if asked == "torch" or not (asked == "triton" or (q.is_cuda and tf32 and triton_available())):
        return None
    if spec.depth != 2 or spec.gated or spec.linear_skip or g.shape[2] != q.shape[1]:
        return None
    if any(x.dtype != torch.float32 for x in (q, g, *weights)):
        return None
    from .mc_titans_triton import operands, supported  # noqa: PLC0415

    return operands(tf32) if supported(spec.d_k, spec.hidden) else None


def _dense_reads(batches: list[_ReadBatch]):
    """The memories of ``batches`` that read every query from their start, ordered by start, as the fused
    kernels take them (``None``: there are none)."""
    from .mc_titans_triton import DenseReads  # noqa: PLC0415

    dense = sorted((batch.start, j) for batch in batches if batch.pick is None for j in range(batch.first, batch.last))
    return DenseReads(tuple(j for _, j in dense), tuple(s for s, _ in dense)) if dense else None


def _entering(state_value: torch.Tensor, per_segment: torch.Tensor, closed: torch.Tensor) -> torch.Tensor:
    """The online segment's keys (sums or counts) as each of ``n`` segments starts and after the last:
    ``(B, n + 1, ...)`` from the state's ``(B, ...)``, each segment's own ``per_segment (B, n, ...)`` and the
    number of segments each row closes, ``closed (B,)``, its first ones. Segment ``i`` starts with the
    state's keys if it is the first or the row closes none, plus those of the segments from the row's last
    close up to ``i``: one cumulative sum for all segments instead of a loop over them."""
    B, n = per_segment.shape[:2]
    index = torch.arange(n + 1, device=per_segment.device)
    shape = (B, n + 1) + (1,) * (per_segment.dim() - 2)
    opened = per_segment * (index[None, :n] >= closed[:, None]).reshape(B, n, *shape[2:])  # after the last close
    before = torch.cat([torch.zeros_like(opened[:, :1]), opened], 1).cumsum(1)  # segment i: those before it
    carried = ((index[None] == 0) | (closed[:, None] == 0)).reshape(shape)
    return carried * state_value[:, None] + before


def _segments_in_one_loop(spec: MLPMemorySpec, options: MCOptions, bufs: dict, live: torch.Tensor,
                          W: dict, M: dict, state: MCState, seg: int, tf32: bool):
    """Whole segments of whole chunks (the training case, ``checkpoint`` caching, fused chunks): the
    online memory runs through every chunk in one loop, whose checkpoints sit at the segments' ends
    and come back as the memories to cache. Then every query reads the cache in batches of memories
    (:class:`_CachedReads`; memory ``j`` is read by the segments after ``j``), with the gates
    of all segments computed at once, and the cache grows once. Returns the outputs (chunk first,
    one entry) and the final weights and momenta; ``state`` ends as the per-segment path leaves it."""
    names = list(spec.shapes)
    m, C = len(names), options.chunk_size
    B, total = live.shape
    n, n_seg = total // C, total // seg
    q, u, k = bufs["q"], bufs["u"], bufs["k"]
    dtype = k.dtype
    H, d_k = k.shape[1], k.shape[-1]

    # Segment summaries: the keys each segment received, the first one continuing the state's online segment.
    lv = live.to(dtype)
    keys = (k * lv[:, None, :, None]).reshape(B, H, n_seg, seg, d_k)
    seg_sum, seg_count = keys.sum(3), lv.reshape(B, n_seg, seg).sum(2)
    closes = live[:, seg - 1::seg]  # (B, n_seg)
    closed = closes.sum(1)  # the rows' tokens are a prefix of the segments', so are the segments they close
    enter_sum = _entering(state.key_sum.to(dtype), seg_sum.movedim(2, 1), closed)  # (B, n_seg + 1, H, d_k)
    enter_count = _entering(state.key_count.to(dtype), seg_count, closed)
    run_sum, run_count = enter_sum[:, -1], enter_count[:, -1]  # the online segment's keys after the call
    enter_sum, enter_count = enter_sum[:, :-1], enter_count[:, :-1]
    new_sum, new_count = enter_sum + seg_sum.movedim(2, 1), enter_count + seg_count  # (B, n_seg, H, d_k), (B, n_seg)
    key_so_far = keys.cumsum(3) + enter_sum.movedim(1, 2)[:, :, :, None]
    count_so_far = lv.reshape(B, n_seg, seg).cumsum(2) + enter_count[:, :, None]
    online_summary = (key_so_far / count_so_far.clamp(min=1)[:, None, :, :, None]).reshape(B, H, total, d_k)

    # Every query's gates over the state's cached memories and the ones this call caches before it.
    N0 = state.cached_key_count.shape[1]
    summaries = torch.cat([state.cached_summary().to(dtype), key_mean(new_sum, new_count)], 1)
    segment_of = torch.arange(total, device=live.device) // seg
    fresh = (torch.arange(n_seg, device=live.device)[None] < segment_of[:, None])[None] & closes[:, None, :]
    valid = torch.cat([state.cached_valid[:, None, :].expand(B, total, N0), fresh], 2)[:, None]  # (B, 1, T, N)
    g_cached, g_online = mc_gates(options.aggregation, options.ssc_topk, u, online_summary, summaries, valid)

    starts = (0,) * N0 + tuple(range(seg, total, seg))
    # (N, B, H, T); mean and residual weigh every head alike (N, B, 1, T): expanded, so that the fused reads take them.
    g_memories = g_cached.movedim(-1, 0).expand(-1, -1, H, -1)
    # The device-to-host reads before the online memory runs, where they wait for little: ssc's selection,
    # the cache's size after this call.
    batches = _read_batches(spec, g_memories.detach(), starts, options.aggregation == "ssc", H)
    slots = state.slots_after(closes)

    chunks = TitansChunk(**{name: _segment_chunks(bufs[name], C) for name in _PER_TOKEN if name != "u"},
                         live=live.reshape(B, n, C).movedim(1, 0),
                         stops=torch.zeros(n, B, dtype=torch.bool, device=live.device))
    xs = [*chunks, *titans_coefficients(chunks.retention, chunks.momentum, chunks.lr, chunks.live)]
    step = partial(_titans_step, spec, False, True)
    carry = (*(W[n_] for n_ in names), *(M[n_] for n_ in names))
    # The forward pass in one launch where the kernel applies (its checkpoints are the segments' ends).
    first = (partial(loop_first_pass, spec) if first_pass_wanted(spec, C, True, [*xs[:6], *carry], tf32, B * H)
             else None)
    ys, carry, ends = run_chunks(step, carry, xs, (), checkpoint_every=seg // C, tf32=tf32, snapshots=True,
                                 first_pass=first)
    ends.append(carry)
    online = chunks_last(ys[0])  # (B, H, total, d_v)
    # Memories first (n_seg, B, H, d_out, d_in), so that a batch of consecutive memories is one contiguous
    # block of weights (a batch of products without a copy); the state takes them batch first.
    stacked = {name: torch.stack([end[i] for end in ends]) for i, name in enumerate(names)}
    memories = [stacked[name][:-1] for name in names]  # the last segment's memory is read by none of these queries
    if N0:
        memories = [torch.cat([state.cached[name].to(dtype).movedim(1, 0), x]) for name, x in zip(names, memories)]
    y = g_online * online + _CachedReads.apply(spec, tf32, batches, q, g_memories, *memories)

    state.append(closes, {name: x.movedim(0, 1) for name, x in stacked.items()}, new_sum, new_count, slots)
    state.key_sum, state.key_count = run_sum, run_count
    return [_segment_chunks(y, C)], dict(zip(names, carry[:m])), dict(zip(names, carry[m:2 * m]))


def chunk_mc_titans(
    spec: MLPMemorySpec,
    options: MCOptions,
    q, k, v, u, retention, momentum, lr,
    init: dict[str, torch.Tensor],
    state: MCState,
    *,
    lengths: torch.Tensor | None = None,
    slots: str = "grow",
) -> tuple[torch.Tensor, MCState]:
    """``T`` new tokens per row (compacted, ``lengths`` valid), continuing ``state``. ``slots``: for one
    token per row, how its step caches a memory (:func:`step_mc_titans`)."""
    # soup's mixes of the cached weights run in Triton (memory_caching._mixed_products), its online memory on
    # the chunk operator: the mix applies that memory's per-token weights to the mixed hidden layer, which the
    # fused chunk kernels do not expose.
    resolve_backend(q, has_triton_impl=fused_chunks(), what=f"MC-Titans' chunks {AUTOGRAD_PATH}")
    B, T, H, _ = q.shape
    lengths = torch.full((B,), T, dtype=torch.long, device=q.device) if lengths is None else lengths
    if options.logarithmic or T == 1:
        outs = []
        for t in range(T):
            o, state = step_mc_titans(spec, options, q[:, t], k[:, t], v[:, t], u[:, t], retention[:, t], momentum[:, t],
                                      lr[:, t], init, state, live=t < lengths,
                                      slots=slots if T == 1 else "grow")
            outs.append(o)
        return torch.stack(outs, 1) * (torch.arange(T, device=q.device)[None] < lengths[:, None])[..., None, None], state

    dtype = torch.promote_types(v.dtype, torch.float32)
    state = replace(state)
    C, S_seg = options.chunk_size, options.segment_size
    q, k = normalized_features(q, dtype=dtype), normalized_features(k, dtype=dtype)
    shift = state.seen % S_seg if S_seg else state.memory.position
    span = int((shift + lengths).max())
    seg = S_seg or max(C, -(-span // C) * C)
    total = max(seg, -(-span // seg) * seg)
    bufs = {}
    for name, x in (("q", q), ("k", k), ("v", v), ("u", u), ("retention", retention), ("momentum", momentum), ("lr", lr)):
        buf, live, slot = align_rows(x.to(dtype), shift, lengths, total)
        bufs[name] = buf.transpose(1, 2)
    mem = state.memory
    names = list(spec.shapes)
    m = len(names)
    W = {n: w.to(dtype) for n, w in mem.weights.items()}
    M = {n: x.to(dtype) for n, x in mem.momentum.items()}
    end = shift + lengths
    # A row whose first new token starts a segment starts a fresh inner chunk (inner chunks restart
    # at every segment start), whatever position its memory holds: the one-token step leaves the
    # position reached in a segment's last chunk and resets it only at the next token, so resuming
    # from it took the first chunk's gradients at a stale chunk-start memory.
    resumed = (mem.position > 0) & (shift > 0) if S_seg else (mem.position > 0)
    stored = tuple(mem.chunk_start[n].to(dtype) for n in names)
    any_resumed = bool(resumed.any())
    # Rows whose last token falls inside a chunk: only they change their chunk-start weights, and
    # without any (whole chunks, the training case) the carry leaves those weights out.
    grid = [(c0, min(c0 + C, s0 + seg)) for s0 in range(0, total, seg) for c0 in range(s0, s0 + seg, C)]
    bounds = torch.tensor(grid, device=end.device)  # (chunks, 2): one comparison for all, not three launches each
    track_start = bool(((end[None] > bounds[:, :1]) & (end[None] < bounds[:, 1:])).any())
    chunk_start = stored
    outputs = []
    key_sum, key_count = state.key_sum.to(dtype), state.key_count.to(dtype)
    fused = fused_chunks() and options.aggregation != "soup"
    if (fused and S_seg and options.cache_mode == "checkpoint" and seg % C == 0 and total > seg
            and not any_resumed and not track_start):
        outputs, W, M = _segments_in_one_loop(spec, options, bufs, live, W, M, state, seg, tf32_wanted(v))
        segments = ()
    else:
        segments = range(0, total, seg)
    # Training reads the memories as the pieces they are made of, so that each is kept once for the backward
    # (:class:`_SegmentCache`); without a backward the reads take the state's stacked cache, one batch each.
    segment_cache = _SegmentCache.of(state, dtype)
    pieces = torch.is_grad_enabled() and any(
        x.requires_grad for x in (*bufs.values(), *W.values(), *M.values(), *segment_cache.weights.values()))
    reads = (lambda: segment_cache) if pieces else (lambda: _SegmentCache.of(state, dtype))
    closed = []  # with pieces: (closes, weights, key sums, key counts) of every segment's end, in order
    for s0 in segments:
        if options.cache_mode == "independent" and S_seg:
            starts = live[:, s0] & (state.seen + (s0 - shift) > 0)
            r = starts[:, None, None, None]
            W = {n: torch.where(r, init[n].to(dtype).expand_as(w), w) for n, w in W.items()}
            M = {n: torch.where(r, torch.zeros_like(x), x) for n, x in M.items()}
        s1 = min(s0 + seg, total)
        # the chunks of a segment come in at most two widths: whole chunks, then its remainder
        for c0, c1 in ((s0, s0 + (s1 - s0) // C * C), (s0 + (s1 - s0) // C * C, s1)):
            if c1 == c0:
                continue
            width = min(C, c1 - c0)
            lo = torch.arange(c0, c1, width, device=q.device)[:, None]  # (n, 1)
            # Shifts stay inside the first segment: only its chunks can hold a resumed row's first token.
            chunks = MCChunk(**{name: _segment_chunks(bufs[name][:, :, c0:c1], width) for name in _PER_TOKEN},
                             live=live[:, c0:c1].reshape(B, -1, width).movedim(1, 0),
                             stops=(end[None] > lo) & (end[None] < lo + width),
                             use_stored=resumed[None] & (shift[None] >= lo) & (shift[None] < lo + width))
            with_stored = any_resumed and s0 == 0
            xs = list(chunks)
            outside = fused and not with_stored  # the cache is read after the loop
            start_carry = tuple(chunk_start) if track_start else ()
            if outside:
                # The online memory alone; the running key sums feed only the cache's gates, read after
                # the loop, so the stretch's keys are added once below instead of a cumulative sum (and
                # its backward) per chunk inside the loop.
                online_only = TitansChunk(chunks.q, chunks.k, chunks.v, chunks.retention, chunks.momentum, chunks.lr,
                                          chunks.live, chunks.stops)
                coefficients = titans_coefficients(chunks.retention, chunks.momentum, chunks.lr, chunks.live)
                carry = (*(W[n] for n in names), *(M[n] for n in names), *start_carry)
                # Every row starts this stretch on a chunk boundary (no stored chunk-start weights are read),
                # so the persistent kernel can walk its chunks in one launch where it applies.
                tensors = [*online_only[:6], *carry]
                if persistent_wanted(spec, width, True, tensors, tf32_wanted(v), B * H, track_start):
                    y, carry = persistent_chunks(spec, carry, chunks.q, chunks.k, chunks.v, coefficients,
                                                 chunks.stops, track_start, tf32_wanted(v))
                    ys = (y,)
                else:
                    # Training: the forward pass in one launch where the kernel applies, the backward chunk
                    # by chunk.
                    first = (partial(loop_first_pass, spec) if first_pass_wanted(
                        spec, width, True, tensors, tf32_wanted(v), B * H, track_start) else None)
                    ys, carry = run_chunks(partial(_titans_step, spec, track_start, True), carry,
                                           [*online_only, *coefficients], (), tf32=tf32_wanted(v), first_pass=first)
                seg_of = lambda name: bufs[name][:, :, c0:c1]  # noqa: E731
                y = _read_segment(spec, options, seg_of("q"), seg_of("u"), seg_of("k"), live[:, c0:c1], key_sum,
                                  key_count, chunks_last(ys[0]), reads(), tf32_wanted(v))
                ys = (_segment_chunks(y, width),)
                lv = live[:, c0:c1].to(dtype)
                key_sum = key_sum + (seg_of("k") * lv[:, None, :, None]).sum(2)
                key_count = key_count + lv.sum(1)
            else:
                carry = (*(W[n] for n in names), *(M[n] for n in names), *start_carry, key_sum, key_count)
                step = partial(_mc_chunk_step, spec, options, track_start, with_stored)
                cache = reads().consts(names)
                ys, carry = run_chunks(step, carry, xs, cache + (stored if with_stored else ()),
                                       tf32=tf32_wanted(v))
                key_sum, key_count = carry[-2], carry[-1]
            outputs.append(ys[0])
            W, M = dict(zip(names, carry[:m])), dict(zip(names, carry[m:2 * m]))
            if track_start:
                chunk_start = carry[2 * m:3 * m]
        state.key_sum, state.key_count = key_sum, key_count
        if S_seg:
            closes = live[:, s1 - 1]
            if pieces:
                segment_cache.close(W, key_mean(key_sum, key_count), closes)
                # The reads take the pieces: the state caches all of this call's memories once at the end. A
                # push per segment restacks the whole cache, N^2 / 2 memories of copies over N segments.
                closed.append((closes, W, key_sum, key_count))
                c = closes[:, None, None]
                key_sum, key_count = torch.where(c, 0.0, key_sum), torch.where(closes, 0.0, key_count)
                state.key_sum, state.key_count = key_sum, key_count
            else:
                state.push(closes, W)
                key_sum, key_count = state.key_sum, state.key_count
    if closed:
        state.append(torch.stack([x[0] for x in closed], 1), {n: torch.stack([x[1][n] for x in closed], 1) for n in names},
                     torch.stack([x[2] for x in closed], 1), torch.stack([x[3] for x in closed], 1))
    outputs = torch.cat([y.movedim(0, 2).flatten(2, 3) for y in outputs], dim=2)  # (B, H, total, d_v)
    chunk_start = dict(zip(names, chunk_start))
    o = outputs.transpose(1, 2).gather(1, slot.clamp(max=total - 1).view(B, T, 1, 1).expand(B, T, H, v.shape[-1]))
    o = o * (torch.arange(T, device=q.device)[None] < lengths[:, None])[..., None, None]
    new_seen = state.seen + lengths
    in_segment = new_seen % S_seg if S_seg else new_seen
    state.memory = TitansState(W, M, chunk_start, (in_segment % C) if S_seg else new_seen % C)
    state.seen = new_seen
    return o.to(v.dtype), state


