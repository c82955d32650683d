"""The Hebbian DeepTransformer's key pass (:class:`~.deep_attention._KeyPass`) as a wavefront of
Triton launches, forward and backward.

The pass is sequential in chunks: chunk ``n``'s keys read the deep values ``U`` of every earlier chunk,
and its own ``U`` comes from that read. The PyTorch pass makes, per chunk, one attention call over the
whole prefix and one update kernel, and its backward an autograd call per chunk and a gradient add over
the prefix: at 128 chunks the host, not the GPU, set the time. Here a read is split into blocks, one
per earlier chunk: block ``(n, j)`` can run as soon as chunk ``j`` is written. The chunks form groups of
``S`` (:func:`_group_size`).

- Forward, group by group: one launch adds the blocks of the group just before to the online-softmax
  accumulators (running max, sum, weighted sum of ``U``) of this group's chunks; then launch ``m`` per
  chunk of the group: a program per later chunk ``n`` of the group adds block ``(n, m - 1)``, and the
  program of chunk ``m`` adds its last block, finishes its read ``a_m`` and runs the chunk's update
  (:func:`~.deep_attention_triton.update_tiles`). The blocks of every earlier group are added on a
  second CUDA stream while the group before runs, so the critical path is one block and one update per
  chunk.
- Backward, group by group from the last: launch ``m`` per chunk of the group: a program per earlier
  chunk ``j`` of the group takes the key side of block ``(m + 1, j)`` of the softmax backward (``dU_j``
  and ``dk_j`` as a key), and the program of chunk ``m``, whose ``dU`` is then complete, runs the update's
  backward (:func:`~.deep_attention_triton.update_backward_tiles`) for ``da_m``. Then one launch takes
  the key side of the blocks of this group's queries for the group just before, and the second stream
  those for every earlier group, while the group before runs.
- The query side of the blocks (``dk_n`` as a query) depends on nothing the wavefront still computes:
  one launch after it takes every block at once, a program per query chunk.

A chunk's write and its backward, the critical path of each pass, take the chunk ``_ROWS`` rows at a time:
every row's read, write and gradients are its own, only ``W_1`` and its gradient sum over the rows, and a
whole chunk's tiles at once did not fit in registers.

Each gradient has one writer and a fixed order, no atomics: runs repeat bit for bit. Each block computes
its scores in both orientations from loads rather than transposing a product, which Triton 3.4-3.7.0
miscompiles on Hopper when it feeds another product.

The reads are in the reads' dtype (bf16 under autocast, as the SDPA reads were: ``a`` and ``da`` are
rounded to it), with float32 sums; the updates are those of :mod:`.deep_attention_triton`.
Tensors are ``(B * H, T, width)`` contiguous, ``e`` ``(B * H, T)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .backend import tl, triton
from .deep_attention_triton import update_backward_tiles, update_tiles

__all__ = ["key_pass_backward_triton", "key_pass_forward_triton"]

# Warps of the step launches (a chunk's update and a few blocks) and of the bulk ones (many programs of
# several blocks each). 8 warps made the bulk launches slower. The steps, with whole chunks in registers, were
# slower with 8 warps too; in blocks of _ROWS rows, 8 warps spread a block's tiles over more threads, so they
# spill less than with 4, and the layer ran faster (benchmarks/RESULTS.md).
_WARPS = 8
_BULK_WARPS = 4
# No software pipelining in the steps: their loops run at most two blocks, and with Triton's default three
# stages the backward's double-buffered tiles took 330 KB of shared memory for float32 reads at C = 64, width
# 64 (an H100 has 227 KB; compiled for sm_90 with Triton 3.6), 98 KB with one stage.
_STAGES = 1
# Rows at a time in a chunk's write and its backward (the critical path of either pass; a power of two, 16 or
# more for tl.dot). Whole 64-row chunks, and blocks of 32 rows, spill far more registers in the write and its
# backward than blocks of 16 (counts in benchmarks/RESULTS.md).
_ROWS = 16
# Chunks per group (None: by _group_size). Larger groups mean fewer bulk launches and state round trips,
# smaller ones less work in the steps, whose grids are the group's chunks times the (batch, head) rows.
_GROUP = None
# Step programs a group may give a launch: _group_size aims at this many, from 4 to 16 chunks a group. A step
# program of 8 warps fills an SM's registers, so one runs per SM, and few (batch, head) rows leave SMs idle
# unless groups grow: with 128 rows, groups of 4 gained nothing over 8 and 16 were slower; with 32 rows, 16
# were the fastest (benchmarks/RESULTS.md). 1024 programs keeps 8 for 128 rows and takes 16 for 64 rows or fewer.
_STEP_PROGRAMS = 1024


def _group_size(rows: int) -> int:
    """Chunks per group for ``rows`` (batch times heads) rows: ``_GROUP`` if set, else the largest power of
    two at most ``_STEP_PROGRAMS / rows``, clamped to 4 .. 16."""
    if _GROUP is not None:
        return _GROUP
    chunks = max(1, _STEP_PROGRAMS // max(rows, 1))
    return max(4, min(16, 1 << (chunks.bit_length() - 1)))


def _bulk_stages(reads: torch.dtype) -> int:
    """The bulk launches loop over several blocks per program (the query gradients over up to N - 1), where
    pipelining pays: two stages for 16-bit reads (24 KB of shared memory at C = 64, width 64), one for
    float32 reads, whose 3xTF32 products would take 295 KB at C = 128, width 64 with two."""
    return 2 if reads.itemsize == 2 else 1


@triton.jit
def _rows(X, bh, rows, cols, T, W):
    """``X[bh, rows, cols]`` of a ``(BH, T, W)`` tensor as float32, zero outside it."""
    return tl.load(X + bh * T * W + rows[:, None] * W + cols[None, :], mask=(rows[:, None] < T) & (cols[None, :] < W),
                   other=0.0).to(tl.float32)


@triton.jit
def _operand(X, bh, rows, cols, T, W):
    """``X[bh, rows, cols]`` in its own dtype, zero outside it: a tile that only feeds products, which take
    the reads' dtype (a float32 copy of it would hold twice the registers)."""
    return tl.load(X + bh * T * W + rows[:, None] * W + cols[None, :], mask=(rows[:, None] < T) & (cols[None, :] < W),
                   other=0.0)


@triton.jit
def _operand_t(X, bh, rows, cols, T, W):
    """The transpose of :func:`_operand`, loaded transposed."""
    return tl.load(X + bh * T * W + rows[None, :] * W + cols[:, None], mask=(rows[None, :] < T) & (cols[:, None] < W),
                   other=0.0)


@triton.jit
def _span(first, R: tl.constexpr, T, bh):
    """Rows ``first .. first + R - 1``, which of them are in the sequence, and their offsets in ``(BH, T)``
    tensors."""
    rows = first + tl.arange(0, R)
    return rows, rows < T, bh * T + rows


@triton.jit
def _chunk(n, C: tl.constexpr, T, bh):
    """Chunk ``n``'s rows as :func:`_span`."""
    return _span(n * C, C, T, bh)


@triton.jit
def _square(DV, HID, BV: tl.constexpr, BHID: tl.constexpr):
    """Offsets and mask of a ``(d_v, h)`` matrix (``W_1``, its gradient) of the ``(.., BH, d_v, h)`` stacks."""
    rv, rh = tl.arange(0, BV), tl.arange(0, BHID)
    return rv[:, None] * HID + rh[None, :], (rv[:, None] < DV) & (rh[None, :] < HID)


@triton.jit
def _mm(x, y, RD: tl.constexpr, PRECISION: tl.constexpr):
    """``x @ y`` with operands in the reads' dtype, float32 sums."""
    return tl.dot(x.to(RD), y.to(RD), input_precision=PRECISION)


@triton.jit
def _put(X, bh, rows, cols, T, W, x):
    tl.store(X + bh * T * W + rows[:, None] * W + cols[None, :], x.to(X.dtype.element_ty),
             mask=(rows[:, None] < T) & (cols[None, :] < W))


@triton.jit
def _add(X, bh, rows, cols, T, W, x):
    """``X[bh, rows, cols] += x``; the caller is the only program writing these rows."""
    _put(X, bh, rows, cols, T, W, _rows(X, bh, rows, cols, T, W) + x)


@triton.jit
def _load_state(MX, SUM, ACC, bh, rows, live, stats, T, HID, BHID: tl.constexpr):
    """A query chunk's online-softmax accumulators (running max, sum, weighted sum of ``U``) from memory."""
    return (tl.load(MX + stats, mask=live, other=float("-inf")), tl.load(SUM + stats, mask=live, other=0.0),
            _rows(ACC, bh, rows, tl.arange(0, BHID), T, HID))


@triton.jit
def _store_state(MX, SUM, ACC, bh, rows, live, stats, T, HID, mx, total, acc, BHID: tl.constexpr):
    tl.store(MX + stats, mx, mask=live)
    tl.store(SUM + stats, total, mask=live)
    _put(ACC, bh, rows, tl.arange(0, BHID), T, HID, acc)


@triton.jit
def _read_blocks(q, K, UR, bh, lo, hi, mx, total, acc, T, DK, HID, scale, C: tl.constexpr, BK: tl.constexpr,
                 BHID: tl.constexpr, PRECISION: tl.constexpr):
    """Adds the blocks of key chunks ``lo .. hi - 1`` to the online-softmax accumulators of queries ``q`` (a
    chunk's rows, or a block of them)."""
    RD = K.dtype.element_ty
    rc, rk, rh = tl.arange(0, C), tl.arange(0, BK), tl.arange(0, BHID)
    for j in range(lo, hi):
        keys = j * C + rc
        s = _mm(q, _operand_t(K, bh, keys, rk, T, DK), RD, PRECISION) * scale
        new = tl.maximum(mx, tl.max(s, 1))
        p = tl.exp(s - new[:, None])
        fade = tl.exp(mx - new)
        total = total * fade + tl.sum(p, 1)
        acc = acc * fade[:, None] + _mm(p, _operand(UR, bh, keys, rh, T, HID), RD, PRECISION)
        mx = new
    return mx, total, acc


@triton.jit(do_not_specialize=["first", "lo", "hi"])
def _forward_reads(K, UR, MX, SUM, ACC, first, lo, hi, T, DK, HID, scale, FRESH: tl.constexpr, C: tl.constexpr,
                   BK: tl.constexpr, BHID: tl.constexpr, PRECISION: tl.constexpr):
    """Adds the blocks of key chunks ``lo .. hi - 1`` to the accumulators of chunk ``first + pid`` (from
    empty ones with ``FRESH``)."""
    n = first + tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows, live, stats = _chunk(n, C, T, bh)
    if FRESH:
        mx, total, acc = tl.full((C,), float("-inf"), tl.float32), tl.zeros((C,), tl.float32), tl.zeros((C, BHID),
                                                                                                          tl.float32)
    else:
        mx, total, acc = _load_state(MX, SUM, ACC, bh, rows, live, stats, T, HID, BHID)
    mx, total, acc = _read_blocks(_operand(K, bh, rows, tl.arange(0, BK), T, DK), K, UR, bh, lo, hi, mx, total,
                                  acc, T, DK, HID, scale, C, BK, BHID, PRECISION)
    _store_state(MX, SUM, ACC, bh, rows, live, stats, T, HID, mx, total, acc, BHID)


@triton.jit(do_not_specialize=["m", "lo"])
def _forward_step(K, UR, V, E, W1S, U, SIG, ER, A, LSE, MX, SUM, ACC, m, lo, T, BH, DK, DV, HID, scale, clip,
                  CLIP: tl.constexpr, C: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  BHID: tl.constexpr, PRECISION: tl.constexpr, WRITE_READ: tl.constexpr):
    """Block ``(n, m - 1)`` for the group's chunks ``n >= m`` (none when ``m`` starts the group), then chunk
    ``m``'s write, ``R`` rows at a time: each row's read and write is its own, only ``W_1``'s update sums
    over the rows (a whole chunk's tiles at once spilled registers). ``WRITE_READ``: ``UR`` is a copy of ``U`` in the reads' dtype (otherwise
    ``U`` itself). The programs of the chunks' writes come first in the grid: they start in its first wave."""
    bh = tl.program_id(0).to(tl.int64)
    n = m + tl.program_id(1)
    RD = K.dtype.element_ty
    rk, rv, rh = tl.arange(0, BK), tl.arange(0, BV), tl.arange(0, BHID)
    first = tl.maximum(m - 1, lo)
    if n == m:  # the chunk's reads are complete after this block: its write
        square, in_square = _square(DV, HID, BV, BHID)
        wb = W1S + (m * BH + bh) * DV * HID
        w = tl.load(wb + square, mask=in_square, other=0.0)
        dw = tl.zeros((BV, BHID), tl.float32)
        for r in range(0, C, R):
            rows, live, stats = _span(m * C + r, R, T, bh)
            mx, total, acc = _load_state(MX, SUM, ACC, bh, rows, live, stats, T, HID, BHID)
            mx, total, acc = _read_blocks(_operand(K, bh, rows, rk, T, DK), K, UR, bh, first, m, mx, total, acc, T,
                                          DK, HID, scale, C, BK, BHID, PRECISION)
            if m > 0:
                total = tl.where(live, total, 1.0)  # rows past T have no accumulators in memory: a read of 0
                a = (acc / total[:, None]).to(RD).to(tl.float32)
                tl.store(LSE + stats, mx + tl.log(total), mask=live)
            else:  # no earlier key: the read is 0
                a = tl.zeros((R, BHID), tl.float32)
            _put(A, bh, rows, rh, T, HID, a)
            e = tl.load(E + stats, mask=live, other=0.0).to(tl.float32)
            u, sig, er, part = update_tiles(a, _rows(V, bh, rows, rv, T, DV), w, e, clip, CLIP)
            _put(U, bh, rows, rh, T, HID, u)
            if WRITE_READ:
                _put(UR, bh, rows, rh, T, HID, u)
            _put(SIG, bh, rows, rh, T, HID, sig)
            _put(ER, bh, rows, rv, T, DV, er)
            dw += part
        tl.store(wb + BH * DV * HID + square, w + dw, mask=in_square)
    else:
        rows, live, stats = _chunk(n, C, T, bh)
        mx, total, acc = _load_state(MX, SUM, ACC, bh, rows, live, stats, T, HID, BHID)
        mx, total, acc = _read_blocks(_operand(K, bh, rows, rk, T, DK), K, UR, bh, first, m, mx, total, acc, T, DK,
                                      HID, scale, C, BK, BHID, PRECISION)
        _store_state(MX, SUM, ACC, bh, rows, live, stats, T, HID, mx, total, acc, BHID)


@triton.jit
def _key_side(K, UR, LSE, DA, DD, DKEYS, DU, bh, keys, lo, hi, T, DK, HID, scale, C: tl.constexpr,
              KR: tl.constexpr, BK: tl.constexpr, BHID: tl.constexpr, PRECISION: tl.constexpr):
    """The key side of the blocks ``(n, j)``, ``n = lo .. hi - 1``, for ``KR`` rows ``keys`` of key chunk ``j``
    (every row's gradients are its own): adds their ``dk`` to ``DKEYS`` and returns their ``dU`` so far
    (``DU``'s plus these blocks'). The scores come transposed from transposed loads, not by transposing a
    product: a transposed product fed to another product is what Triton 3.4-3.7.0 miscompiles on Hopper."""
    RD = K.dtype.element_ty
    rk, rh = tl.arange(0, BK), tl.arange(0, BHID)
    k, u, du = _operand(K, bh, keys, rk, T, DK), _operand(UR, bh, keys, rh, T, HID), _rows(DU, bh, keys, rh, T, HID)
    dk = tl.zeros((KR, BK), tl.float32)
    for n in range(lo, hi):
        rows, live, stats = _chunk(n, C, T, bh)
        lse = tl.load(LSE + stats, mask=live, other=float("inf"))
        dd = tl.load(DD + stats, mask=live, other=0.0)
        p_t = tl.exp(_mm(k, _operand_t(K, bh, rows, rk, T, DK), RD, PRECISION) * scale - lse[None, :])
        dp_t = _mm(u, _operand_t(DA, bh, rows, rh, T, HID), RD, PRECISION)
        du += _mm(p_t, _operand(DA, bh, rows, rh, T, HID), RD, PRECISION)
        dk += _mm(p_t * (dp_t - dd[None, :]) * scale, _operand(K, bh, rows, rk, T, DK), RD, PRECISION)
    _add(DKEYS, bh, keys, rk, T, DK, dk)
    return du


@triton.jit(do_not_specialize=["m", "top"])
def _backward_step(K, UR, V, E, W1S, A, LSE, DA, DD, DKEYS, DU, DSIG, DER, DW1S, DWC, DV_OUT, DE, m, top, T, BH, DK,
                   DV, HID, scale, clip, CLIP: tl.constexpr, C: tl.constexpr, R: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, BHID: tl.constexpr, PRECISION: tl.constexpr):
    """The key side of block ``(m + 1, j)`` for the group's chunks ``j <= m`` (none when ``m`` ends the group,
    at ``top - 1``), then chunk ``m``'s update backward, ``R`` rows at a time as in :func:`_forward_step`
    (only ``W_1``'s gradient sums over the rows); its programs come first in the grid."""
    bh = tl.program_id(0).to(tl.int64)
    j = m - tl.program_id(1)
    RD = K.dtype.element_ty
    rv, rh = tl.arange(0, BV), tl.arange(0, BHID)
    hi = tl.minimum(m + 2, top)
    if j == m:  # every later read of this chunk's U is in after this block: its write's backward
        square, in_square = _square(DV, HID, BV, BHID)
        w = tl.load(W1S + (m * BH + bh) * DV * HID + square, mask=in_square, other=0.0)
        dwn = tl.load(DWC + bh * DV * HID + square, mask=in_square, other=0.0)
        dw = tl.zeros((BV, BHID), tl.float32)
        for r in range(0, C, R):
            keys, in_keys, key_stats = _span(m * C + r, R, T, bh)
            du = _key_side(K, UR, LSE, DA, DD, DKEYS, DU, bh, keys, m + 1, hi, T, DK, HID, scale, C, R, BK, BHID,
                           PRECISION)
            a = _rows(A, bh, keys, rh, T, HID)
            v = _rows(V, bh, keys, rv, T, DV)
            e = tl.load(E + key_stats, mask=in_keys, other=0.0).to(tl.float32)
            da, dv, part, de = update_backward_tiles(a, v, w, e, du, _rows(DSIG, bh, keys, rh, T, HID),
                                                     _rows(DER, bh, keys, rv, T, DV), dwn, clip, CLIP)
            da = da.to(RD).to(tl.float32)
            _put(DA, bh, keys, rh, T, HID, da)
            tl.store(DD + key_stats, tl.sum(da * a, 1), mask=in_keys)
            _put(DV_OUT, bh, keys, rv, T, DV, dv)
            tl.store(DE + key_stats, de, mask=in_keys)
            dw += part
        dw += dwn + tl.load(DW1S + (m * BH + bh) * DV * HID + square, mask=in_square, other=0.0)
        tl.store(DWC + bh * DV * HID + square, dw, mask=in_square)
    else:
        keys = j * C + tl.arange(0, C)
        du = _key_side(K, UR, LSE, DA, DD, DKEYS, DU, bh, keys, m + 1, hi, T, DK, HID, scale, C, C, BK, BHID,
                       PRECISION)
        _put(DU, bh, keys, rh, T, HID, du)


@triton.jit(do_not_specialize=["first", "lo", "hi"])
def _backward_key_side(K, UR, LSE, DA, DD, DKEYS, DU, first, lo, hi, T, DK, HID, scale, C: tl.constexpr,
                       BK: tl.constexpr, BHID: tl.constexpr, PRECISION: tl.constexpr):
    """The key side of the blocks ``(n, j)`` for query chunks ``n = lo .. hi - 1`` and key chunk
    ``j = first + pid``."""
    bh = tl.program_id(1).to(tl.int64)
    keys = (first + tl.program_id(0)) * C + tl.arange(0, C)
    du = _key_side(K, UR, LSE, DA, DD, DKEYS, DU, bh, keys, lo, hi, T, DK, HID, scale, C, C, BK, BHID, PRECISION)
    _put(DU, bh, keys, tl.arange(0, BHID), T, HID, du)


@triton.jit
def _query_gradients(K, UR, LSE, DA, DD, DKEYS, N, T, DK, HID, scale, C: tl.constexpr, BK: tl.constexpr,
                     BHID: tl.constexpr, PRECISION: tl.constexpr):
    """Chunk ``n``'s gradient as the reads' queries, added to ``DKEYS``: every ``da`` is known by now, so
    the blocks ``(n, j < n)`` run side by side, the longest rows first, each row by one program."""
    n = N - 1 - tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    RD = K.dtype.element_ty
    rk, rh = tl.arange(0, BK), tl.arange(0, BHID)
    rows, live, stats = _chunk(n, C, T, bh)
    lse = tl.load(LSE + stats, mask=live, other=float("inf"))
    dd = tl.load(DD + stats, mask=live, other=0.0)
    q = _operand(K, bh, rows, rk, T, DK)
    da = _operand(DA, bh, rows, rh, T, HID)
    dq = tl.zeros((C, BK), tl.float32)
    for j in range(0, n):
        keys = j * C + tl.arange(0, C)
        p = tl.exp(_mm(q, _operand_t(K, bh, keys, rk, T, DK), RD, PRECISION) * scale - lse[:, None])
        dp = _mm(da, _operand_t(UR, bh, keys, rh, T, HID), RD, PRECISION)
        dq += _mm(p * (dp - dd[:, None]) * scale, _operand(K, bh, keys, rk, T, DK), RD, PRECISION)
    _add(DKEYS, bh, rows, rk, T, DK, dq)


class _SideStream:
    """Launches off the critical path on a second CUDA stream, ordered against the current one by named
    events. Elsewhere (Triton's interpreter on the CPU) everything runs in one sequence, which the events'
    order already respects."""

    def __init__(self, device: torch.device):
        cuda = device.type == "cuda"
        self.main = torch.cuda.current_stream(device) if cuda else None
        self.side = torch.cuda.Stream(device) if cuda else None
        self.events: dict = {}

    @contextlib.contextmanager
    def side_launches(self, then) -> Iterator[None]:
        """Launches on the side stream once the current stream reaches this point; event ``then`` marks
        their end."""
        if self.side is None:
            yield
            return
        self.side.wait_event(self.main.record_event())
        with torch.cuda.stream(self.side):
            yield
        self.events[then] = self.side.record_event()

    def wait(self, name) -> None:
        """The current stream waits for event ``name``, if there is one."""
        if name in self.events:
            self.main.wait_event(self.events[name])

    def join(self) -> None:
        if self.side is not None:
            self.main.wait_stream(self.side)


class _Launcher:
    """Launches for one pass. Triton's launcher binds, specialises and checks every argument on every call,
    about as long as a step's kernel takes, so the pass alone ran host-bound; within a pass only
    the chunk indices change, and those kernels do not specialise on them (``do_not_specialize``). So the
    first launch of a kernel and set of constants goes through Triton, which compiles it, and the pass's
    later ones go straight to that compiled kernel. Not in Triton's interpreter, whose launches are its
    own."""

    def __init__(self, device: torch.device):
        self.direct = device.type == "cuda"
        self.compiled: dict = {}

    def __call__(self, fn, grid: tuple[int, int], *args, num_warps: int, num_stages: int, **constants) -> None:
        key = (fn, *constants.items())
        kernel = self.compiled.get(key)
        if kernel is None or not self.direct:
            self.compiled[key] = fn[grid](*args, num_warps=num_warps, num_stages=num_stages, **constants)
            return
        values = (*args, *(constants[name] for name in fn.arg_names[len(args):]))
        stream = torch.cuda.current_stream().cuda_stream
        kernel.run(grid[0], grid[1], 1, stream, kernel.function, kernel.packed_metadata,
                   kernel.launch_metadata(grid, stream, *values), triton.knobs.runtime.launch_enter_hook,
                   triton.knobs.runtime.launch_exit_hook, *values)


def _precision(reads: torch.dtype) -> str:
    """The reads' products: their dtype's for bf16 / fp16; for float32 reads 3xTF32 (float32's accuracy, as
    the updates use), not Triton's default TF32."""
    return "tf32x3" if reads == torch.float32 else "ieee"


def _options(reads: torch.dtype, chunk: int, DK: int, DV: int, HID: int, clip: float | None):
    """The constants and launch options of the step kernels and of the bulk ones, and the clip's two
    arguments."""
    p = lambda n: max(16, triton.next_power_of_2(n))  # noqa: E731  (tl.dot needs 16 or more)
    shared = dict(C=chunk, BK=p(DK), BHID=p(HID), PRECISION=_precision(reads))
    step = dict(shared, R=min(_ROWS, chunk), BV=p(DV), num_warps=_WARPS, num_stages=_STAGES)
    bulk = dict(shared, num_warps=_BULK_WARPS, num_stages=_bulk_stages(reads))
    return step, bulk, (0.0 if clip is None else float(clip), clip is not None)


def key_pass_forward_triton(keys: torch.Tensor, v: torch.Tensor, e: torch.Tensor, w1: torch.Tensor, chunk: int,
                            scale: float, clip: float | None):
    """The pass's forward on ``keys (BH, T, d_k)`` in the reads' dtype, ``v (BH, T, d_v)``, ``e (BH, T)``,
    ``w1 (BH, d_v, h)`` (float32, contiguous). Returns ``u, sig (BH, T, h)``, ``er (BH, T, d_v)``,
    ``w1s (N + 1, BH, d_v, h)`` and, for the backward, ``u_read`` (``u`` in the reads' dtype), the reads
    ``a`` (reads' dtype) and their log-sum-exps ``(BH, T)``."""
    BH, T, DK = keys.shape
    DV, HID = w1.shape[-2:]
    N = -(-T // chunk)
    f32 = dict(device=v.device, dtype=torch.float32)
    u, sig = torch.empty(BH, T, HID, **f32), torch.empty(BH, T, HID, **f32)
    er = torch.empty(BH, T, DV, **f32)
    w1s = torch.empty(N + 1, BH, DV, HID, **f32)
    w1s[0] = w1
    u_read = u if keys.dtype == u.dtype else torch.empty_like(u, dtype=keys.dtype)
    a = torch.empty_like(sig, dtype=keys.dtype)
    lse = torch.zeros(BH, T, **f32)
    mx, total = torch.full((BH, T), float("-inf"), **f32), torch.zeros(BH, T, **f32)
    acc = torch.zeros(BH, T, HID, **f32)
    S, side, launch = _group_size(BH), _SideStream(keys.device), _Launcher(keys.device)
    step, bulk, clipped = _options(keys.dtype, chunk, DK, DV, HID, clip)

    def reads(first, lo, hi, fresh):  # chunks first .. first + S - 1 read key chunks lo .. hi - 1
        launch(_forward_reads, (min(S, N - first), BH), keys, u_read, mx, total, acc, first, lo, hi, T, DK, HID,
               scale, FRESH=fresh, **bulk)

    for g, lo in enumerate(range(0, N, S)):
        if lo > 0:  # the reads of the group before: the rest came on the side stream
            side.wait(("far", g))
            reads(lo, lo - S, lo, fresh=lo == S)
        for m in range(lo, min(lo + S, N)):
            launch(_forward_step, (BH, min(lo + S, N) - m), keys, u_read, v, e, w1s, u, sig, er, a, lse, mx, total,
                   acc, m, lo, T, BH, DK, DV, HID, scale, *clipped, WRITE_READ=u_read is not u, **step)
        far = lo + 2 * S  # the group after next reads this one and every earlier one beside the next group
        if far < N:
            with side.side_launches(then=("far", g + 2)):
                reads(far, 0, lo + S, fresh=True)
    side.join()
    return u, sig, er, w1s, u_read, a, lse


def key_pass_backward_triton(keys: torch.Tensor, v: torch.Tensor, e: torch.Tensor, w1s: torch.Tensor,
                             u_read: torch.Tensor, a: torch.Tensor, lse: torch.Tensor, du: torch.Tensor,
                             dsig: torch.Tensor, der: torch.Tensor, dw1s: torch.Tensor, chunk: int, scale: float,
                             clip: float | None):
    """The gradients ``(dk, dv, de, dw1)`` (float32) of the pass for its outputs' ``du, dsig, der, dw1s``."""
    BH, T, DK = keys.shape
    DV, HID = w1s.shape[-2:]
    N = -(-T // chunk)
    f32 = dict(device=v.device, dtype=torch.float32)
    dk = torch.zeros(BH, T, DK, **f32)
    du = du.to(torch.float32, memory_format=torch.contiguous_format, copy=True)  # accumulated in place
    dsig, der, dw1s = (x.to(torch.float32).contiguous() for x in (dsig, der, dw1s))
    da, dd = torch.empty_like(a), torch.zeros(BH, T, **f32)
    carry = dw1s[N].clone()
    dv, de = torch.empty(BH, T, DV, **f32), torch.empty(BH, T, **f32)
    S, side, launch = _group_size(BH), _SideStream(keys.device), _Launcher(keys.device)
    step, bulk, clipped = _options(keys.dtype, chunk, DK, DV, HID, clip)

    def key_side(first, count, lo, hi):  # key chunks first .. first + count - 1, query chunks lo .. hi - 1
        launch(_backward_key_side, (count, BH), keys, u_read, lse, da, dd, dk, du, first, lo, hi, T, DK, HID, scale,
               **bulk)

    groups = list(range(0, N, S))
    for g in reversed(range(len(groups))):
        lo, top = groups[g], min(groups[g] + S, N)
        side.wait(("far", g + 2))  # every side launch that wrote to this group's chunks
        for m in reversed(range(lo, top)):
            launch(_backward_step, (BH, m - lo + 1), keys, u_read, v, e, w1s, a, lse, da, dd, dk, du, dsig, der, dw1s,
                   carry, dv, de, m, top, T, BH, DK, DV, HID, scale, *clipped, **step)
        if lo > 0:  # the group before, next on the critical path, here; earlier groups on the side stream
            side.wait(("far", g + 1))
            key_side(lo - S, S, lo, top)
            if lo > S:
                with side.side_launches(then=("far", g)):
                    key_side(0, lo - S, lo, top)
    side.join()
    if N > 1:  # chunk 0 reads nothing
        launch(_query_gradients, (N - 1, BH), keys, u_read, lse, da, dd, dk, N, T, DK, HID, scale, **bulk)
    return dk, dv, de, carry
