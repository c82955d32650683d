"""Persistent Triton kernels of the Titans memory: every chunk of a call in one launch, one program a row.

The chunked forward of :mod:`.titans_triton_forward` runs each inner chunk as six launches split
along the hidden layer, plus PyTorch between them, and reloads the memory from HBM every chunk. Its
launches are spread over ``(slices, batch * heads)`` programs so that they fill the GPU, but with the
chunks in sequence (32 of them at T=2048, chunk 64) the layer is a chain of about two hundred small
kernels, each waiting for the one before. Without gradients (a prompt's prefill, evaluation) nothing
of a chunk is needed after it but the memory it leaves, so here one program per ``(batch, head)``
walks all the chunks of its row in a loop: one launch per call.

The memory of a program (``W1 (d, F)``, ``W2 (F, d)`` and the momenta ``S1``, ``S2``, float32) is
256 KB at ``d = 64``, ``F = 256``: as much as an SM's whole register file. It lives in the output
tensors themselves, initialised with the carried state and updated in place chunk after chunk; at
``batch * heads = 128`` programs that is 32 MB, which the 50 MB L2 of an H100 keeps, so a chunk's
weight traffic is L2 traffic, not HBM. The chunk's intermediates (``pre = k W2^T`` and
``e = (err W1) * gelu'(pre)``, ``(C, F)`` each, and ``err``, ``(C, d)``) go to a per-program scratch
in global memory too: they are needed in both orientations, and loading a tile transposed from
memory is how these kernels avoid transposing a product's result into another product (Triton 3.4
to 3.7.0 miscompile that on Hopper, docs/kernels.md).

Per chunk, in program order (``tl.debug_barrier`` between phases that write global memory another
thread of the program reads next):

1. over hidden slices of ``BF``: ``pre = k W2^T`` (stored), the prediction's share
   ``gelu(pre) W1^T`` and ``||gelu(pre)||^2``; then the error ``err = 2 (k + pred - v)`` (``l2``)
   or ``-v`` (``dot``), stored;
2. over slices: ``back = err W1``, ``e = back * gelu'(pre)`` (stored) and ``||e||^2``; the clip's
   per-token scale from the norms (ones without a clip);
3. over slices, the read: the queries' hidden layer through every token's online weights
   ``hp = a (q W2^T) + b (q S2^T) + (c * (q k^T) * scale) e``, ``h = gelu(hp)``, its shares of
   ``h W1^T``, ``h S1^T`` and ``h gelu(pre)^T``; then the output
   ``y = q + a (h W1^T) + b (h S1^T) + (c * (h gelu(pre)^T) * scale) err``;
4. over slices, the update: the final weights ``W' = a_C W + b_C S + (A c_C)^T B`` and momenta
   ``S' = sa S + (A sc)^T B``, written over the old ones.

The chunk coefficients ``a, b, c, sa, sc`` come from :func:`~.titans.titans_coefficients`, computed
for all chunks at once before the launch, as the chunked path does; padding and alignment slots are
zero columns of ``c`` and leave the memory as it is, so tails and right-padded rows need nothing
more. Every product is a ``tl.dot`` of float32 operands (TF32 or IEEE as :func:`_precision` says)
with float32 sums.

Optionally (``checkpoint_every = r``) the program writes the memory entering every ``r``-th chunk
to a checkpoint tensor, for a backward that recomputes stretches from them; and, for rows whose
last token falls inside a chunk, the weights that chunk started from (where a later call resumes).

Scope (:func:`covers`): the depth-2 memory ``z + W1 gelu(W2 z)`` without gate or linear skip,
objectives ``l2`` and ``dot``, with or without the per-token clip, with momentum (or without: no
``S``), head widths up to 64 (widths that are not powers of two are masked), any hidden width
(masked past the last whole slice), chunks up to 64 tokens, float32 state.

Atlas' ``gd`` and ``momentum`` chunks are the same chunk with an Omega window: each chunk's gradients run
over its own ``C`` keys and the ``P = window - 1`` before it (re-evaluated at the chunk's start weights),
with ``c`` and ``sc`` over those ``K = P + C`` keys (:func:`~.atlas.atlas_coefficients`). The ``P`` keys
are a second block of rows (``BP``: 32 for Atlas' window of 16 at its eight warps, 16 at four; :data:`BLOCKS`)
beside the chunk's own, taken through phases 1 and 2 as those are and summed into every product over the
keys in 3 and 4, rather than one block of ``K`` rows padded to 128: the window's block adds a quarter or
a half to the rows' work (16 or 32 rows beside 64) where the padded one would double it, and the chunk's
own tiles, hence the registers and the code of Titans' case, stay as they are: ``P`` is a launch
constant, so that with ``P = 0`` none of the window's code is compiled and Titans' key offsets fold to
what they were. On CUDA Atlas takes it only with :data:`ATLAS_ON_CUDA`.

In training, :func:`loop_first_pass` makes this forward (with checkpoints) the first pass of
:func:`~.chunk_loop.run_chunks`: the loop's outputs and the memory entering every ``r``-th chunk in one
launch, after which the backward re-runs each stretch chunk by chunk from those checkpoints, as it does
after the per-chunk forward (:func:`first_pass_wanted`, :data:`FIRST_PASS`). The checkpoints differ from
the per-chunk launches' by rounding only, so the gradients are the per-chunk path's to rounding.

The backward (:func:`persistent_memory`, an autograd function; :func:`persistent_backward`, one
stretch) takes the stretches between checkpoints from the last: one launch recomputes the stretch's
chunk-start states from its checkpoint (this forward without its reads), one launch walks its chunks
from the last, each program recomputing a chunk's forward from its start state and back-propagating
through it slice by slice, with the gradients of the memory (``dW1 .. dS2``) carried in place in global
memory as the forward carries the memory. It gives the gradients of q, k, v, the chunk coefficients
(hence the gates, through :func:`~.titans.titans_coefficients` under autograd) and the initial state,
without the clip. :func:`~.titans.chunk_titans` and the MC-Titans loop take it for training only where
:data:`TRAINING` is set. It agrees with the per-chunk backward on the GPU (Triton 3.6, Hopper) but is
slower than it at the Titans layers' shapes (benchmarks/RESULTS.md), so it is off by default: one
program a row walks its stretches in sequence, and its scratch of eight ``(C, F)`` tiles a program
goes through HBM.

Sizing on an H100 at ``d = 64``, ``F = 256``, ``C = 64``: slices of 64; a ``(64, 64)`` float32 tile
is 16 registers a thread at eight warps. The read (3.) holds five such tiles across its slices (``q``,
``c * (q k^T)`` and the three sums) and the update (4.) two (``err^T``, ``k``): every slice is read
before any is written so that the two sets are not live at once. Eight warps (four for narrower heads
or chunks); ``tl.dot`` stages its operands through shared memory, about 80 KB at these tiles, under
the 228 KB of an SM. One program per SM: 128 programs on 132 SMs. The backward holds more (its slice
passes are split three ways to keep their accumulators few) and about 160 KB of shared memory, and a
scratch of eight ``(C, F)`` tiles a program (512 KB, which L2 does not keep for 128 programs), plus the
stretch's states; its tiling is a first version, to be measured.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .backend import current_paths, resolve_backend, tl, triton
from .chunk_loop import tf32_products
from .titans_triton_backward import _gelu_curvature
from .titans_triton_forward import _gelu, _gelu_slope
from .titans_triton_update import _precision

__all__ = ["BLOCKS", "PersistentResult", "covers", "first_pass_wanted", "loop_first_pass", "persistent_backward",
           "persistent_forward", "persistent_memory", "wanted"]

# Slice of the hidden layer per step; warps of the forward and of the backward for narrow problems (head
# width and chunk up to 32) and for wider ones. Module-level so that tests can shrink the slice (several
# slices at small hidden widths) and benchmarks try others.
BLOCKS = {"slice": 64, "warps_narrow": 4, "warps_wide": 8, "backward_warps_narrow": 4, "backward_warps_wide": 8,
          "least_rows_wide": 32, "warps_window": None}
# ``least_rows_wide``: the fewest rows the window's block of keys takes in the forward at eight warps. Triton
# 3.6 on Hopper compiles the read's products against a window block of 16 beside a chunk of 64 at eight warps
# into wrong outputs and launches that fault on memory, where four warps or a block of 32 are right, as is a
# chunk of 16 alone (tests/test_gpu_chunk_loop.py checks Atlas' window of 16, whose 15 keys would make such
# a block, and Titans' chunks of 16). The padded rows are masked: they cost only their products, less than
# four warps would (benchmarks/RESULTS.md). ``warps_window``: the warps of a launch with a window (``None``:
# as without one).

# Whether :func:`~.titans.chunk_titans` takes this kernel where it covers the call; benchmarks set it
# False to time the per-chunk launches of :mod:`.titans_triton_forward` instead.
ENABLED = True
# Whether it also takes calls that record gradients (training) through :func:`persistent_memory`. Off
# until its backward has been checked against the reference on the GPU (docs/kernels.md on Triton's
# miscompiles on Hopper); a benchmark or that check sets it.
TRAINING = False
# Whether a Titans chunk loop that records gradients (and does not take TRAINING's path) runs its forward
# pass through this kernel anyway, its backward recomputing chunk by chunk (:func:`loop_first_pass`).
FIRST_PASS = True

# Whether Atlas' chunks take the kernel on CUDA: its Omega window (``P > 0``) and its ``gd`` (no
# momentum, which Titans never launches). Both are right on the GPU (tests/test_gpu_chunk_loop.py), but the
# windowed launch is no faster than the per-chunk launches' forward pass it would replace, and the
# backward's recompute stays per chunk, so the layers gain nothing and it stays off (benchmarks/RESULTS.md).
# Benchmarks sweep it.
ATLAS_ON_CUDA = False

# On CUDA the persistent kernel is taken only with at least this many rows (programs) per SM.
MIN_ROWS_PER_SM = 0.75

MAX_WIDTH = 64
MAX_CHUNK = 64
# Keys before a chunk (Atlas' Omega window less one): a second block of key rows beside the chunk's own.
MAX_WINDOW = 64


def covers(spec, chunk_size: int, window: int = 1) -> bool:
    """Whether :func:`persistent_forward` computes this memory at this inner chunk size, each chunk's keys
    being its own tokens and the ``window - 1`` before them (Atlas' Omega window; Titans' is 1)."""
    return (spec.depth == 2 and not spec.gated and not spec.linear_skip and spec.d_k <= MAX_WIDTH
            and chunk_size <= MAX_CHUNK and 1 <= window <= MAX_WINDOW + 1)


@triton.jit
def _copy_state(SRC1, SRC2, DST1, DST2, src_off1, src_off2, dst_off1, dst_off2, rd, md, D, F,
                BF: tl.constexpr):
    """``DST1 <- SRC1`` (``(D, F)``) and ``DST2 <- SRC2`` (``(F, D)``), slice by slice."""
    for f0 in range(0, F, BF):
        rf = f0 + tl.arange(0, BF)
        mf = rf < F
        m1 = md[:, None] & mf[None, :]
        o1 = rd[:, None] * F + rf[None, :]
        tl.store(DST1 + dst_off1 + o1, tl.load(SRC1 + src_off1 + o1, mask=m1, other=0.0), mask=m1)
        m2 = mf[:, None] & md[None, :]
        o2 = rf[:, None] * D + rd[None, :]
        tl.store(DST2 + dst_off2 + o2, tl.load(SRC2 + src_off2 + o2, mask=m2, other=0.0), mask=m2)


@triton.jit
def _errors(Kx, V, W1, W2, PRE, ERR, key_row, cf_off, err_off, rk, mk, rd, md, D, F,
            L2: tl.constexpr, CLIP: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr,
            PRECISION: tl.constexpr):
    """Phase 1 for the key rows ``rk`` (mask ``mk``): ``pre = k W2^T`` (stored), the prediction and the error
    (stored, and returned for phase 2), with the squared norms the clip takes: ``||gelu(pre)||^2`` and
    ``||k||^2`` (zeros without the clip)."""
    kd = mk[:, None] & md[None, :]
    kd_offs = (key_row + rk[:, None]) * D + rd[None, :]
    k = tl.load(Kx + kd_offs, mask=kd, other=0.0)
    pred = tl.zeros((BK, BD), tl.float32)
    a2 = tl.zeros((BK,), tl.float32)
    k2 = a2
    if CLIP:
        k2 = tl.sum(k * k, 1)
    for f0 in range(0, F, BF):
        rf = f0 + tl.arange(0, BF)
        mf = rf < F
        w2t = tl.load(W2 + rf[None, :] * D + rd[:, None], mask=md[:, None] & mf[None, :], other=0.0)
        pre = tl.dot(k, w2t, input_precision=PRECISION)
        tl.store(PRE + cf_off + rk[:, None] * F + rf[None, :], pre, mask=mk[:, None] & mf[None, :])
        act = _gelu(pre)
        if CLIP:
            a2 += tl.sum(act * act, 1)
        if L2:
            w1t = tl.load(W1 + rd[None, :] * F + rf[:, None], mask=mf[:, None] & md[None, :], other=0.0)
            pred += tl.dot(act, w1t, input_precision=PRECISION)
    v = tl.load(V + kd_offs, mask=kd, other=0.0)
    if L2:
        err = 2.0 * (k + pred - v)
    else:
        err = -v
    tl.store(ERR + err_off + rk[:, None] * D + rd[None, :], err, mask=kd)
    return err, a2, k2


@triton.jit
def _backs(W1, PRE, E, cf_off, err, rk, mk, rd, md, F, CLIP: tl.constexpr, BK: tl.constexpr,
           BF: tl.constexpr, PRECISION: tl.constexpr):
    """Phase 2 for the key rows ``rk``: ``e = (err W1) * gelu'(pre)`` (stored) and ``||e||^2`` (zeros without
    the clip)."""
    e2 = tl.zeros((BK,), tl.float32)
    for f0 in range(0, F, BF):
        rf = f0 + tl.arange(0, BF)
        mf = rf < F
        kf = mk[:, None] & mf[None, :]
        w1 = tl.load(W1 + rd[:, None] * F + rf[None, :], mask=md[:, None] & mf[None, :], other=0.0)
        back = tl.dot(err, w1, input_precision=PRECISION)
        e = back * _gelu_slope(tl.load(PRE + cf_off + rk[:, None] * F + rf[None, :], mask=kf, other=0.0))
        tl.store(E + cf_off + rk[:, None] * F + rf[None, :], e, mask=kf)
        if CLIP:
            e2 += tl.sum(e * e, 1)
    return e2


@triton.jit
def _clip_scale(err, a2, k2, e2, clip, CLIP: tl.constexpr, BK: tl.constexpr):
    """The clip's per-key-row scale of the gradient (ones without the clip)."""
    if CLIP:
        n2 = a2 * tl.sum(err * err, 1) + e2 * k2
        scale = tl.minimum(clip / tl.sqrt(tl.maximum(n2, 1e-30)), 1.0)
    else:
        scale = tl.full((BK,), 1.0, tl.float32)
    return scale


@triton.jit
def _persistent_kernel(Q, Kx, V, GA, GB, GC, SA, SC, W1, W2, S1, S2, Y, PRE, E, ERR,
                       CW1, CW2, CS1, CS2, STOP, ST1, ST2, clip, n_chunks, G, C, D, F, R, P: tl.constexpr,
                       HAS_S: tl.constexpr, L2: tl.constexpr, CLIP: tl.constexpr, CKPT: tl.constexpr,
                       TRACK: tl.constexpr, READ: tl.constexpr, BC: tl.constexpr,
                       BP: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr, PRECISION: tl.constexpr):
    """Program ``g``: row ``g`` of ``batch * heads`` over its ``n_chunks`` chunks (see the module); without
    ``READ`` only the memory advances (the backward's recompute of a stretch's states). With ``P > 0`` each
    chunk's keys and values are its ``C`` tokens after the ``P`` before them (Atlas' Omega window), the
    ``P`` rows a second block of keys (``BP``) beside the chunk's own (``BC``)."""
    g = tl.program_id(0).to(tl.int64)
    K = P + C  # key rows a chunk: the window's P, then the chunk's own C
    rc, rd = tl.arange(0, BC), tl.arange(0, BD)
    mc, md = rc < C, rd < D
    rk = P + rc  # the chunk's own key rows
    rp = tl.arange(0, BP)
    mp = rp < P
    cd = mc[:, None] & md[None, :]
    dc = md[:, None] & mc[None, :]
    cc = mc[:, None] & mc[None, :]
    w1_off, w2_off = g * D * F, g * F * D  # this row's W1 (D, F) and W2 (F, D), and of their momenta
    cf_off = g * K * F  # this row's scratch (K, F) of pre and e
    err_off = g * K * D
    if TRACK:
        stop = tl.load(STOP + g)
    for i in range(0, n_chunks):
        row = i * G + g  # (chunk, row) of the chunk-first inputs
        tok = row * C
        key_row = row * K
        if CKPT:
            if i % R == 0:
                ck = (i // R) * G + g
                _copy_state(W1, W2, CW1, CW2, w1_off, w2_off, ck * D * F, ck * F * D, rd, md, D, F, BF)
                if HAS_S:
                    _copy_state(S1, S2, CS1, CS2, w1_off, w2_off, ck * D * F, ck * F * D, rd, md, D, F, BF)
        if TRACK:
            if stop == i:
                _copy_state(W1, W2, ST1, ST2, w1_off, w2_off, w1_off, w2_off, rd, md, D, F, BF)
        cd_offs = (tok + rc[:, None]) * D + rd[None, :]

        # 1. pre = k W2^T (stored), the prediction, ||gelu(pre)||^2; the error.
        err, a2, k2 = _errors(Kx, V, W1 + w1_off, W2 + w2_off, PRE, ERR, key_row, cf_off, err_off, rk, mc, rd, md,
                              D, F, L2, CLIP, BC, BD, BF, PRECISION)
        if P > 0:
            err_p, a2_p, k2_p = _errors(Kx, V, W1 + w1_off, W2 + w2_off, PRE, ERR, key_row, cf_off, err_off, rp, mp,
                                        rd, md, D, F, L2, CLIP, BP, BD, BF, PRECISION)
        tl.debug_barrier()  # pre and err are read below in other threads' layouts

        # 2. e = (err W1) * gelu'(pre) (stored), ||e||^2; the clip's scale.
        e2 = _backs(W1 + w1_off, PRE, E, cf_off, err, rk, mc, rd, md, F, CLIP, BC, BF, PRECISION)
        scale = _clip_scale(err, a2, k2, e2, clip, CLIP, BC)
        if P > 0:
            e2_p = _backs(W1 + w1_off, PRE, E, cf_off, err_p, rp, mp, rd, md, F, CLIP, BP, BF, PRECISION)
            scale_p = _clip_scale(err_p, a2_p, k2_p, e2_p, clip, CLIP, BP)
        tl.debug_barrier()  # e is read below transposed

        # The chunk's coefficients: every token's reads (a, b, c) and the final ones (last row); c and the
        # momentum's sc run over the chunk's K key rows.
        ga = tl.load(GA + tok + rc, mask=mc, other=0.0)
        gb = tl.load(GB + tok + rc, mask=mc, other=0.0) if HAS_S else ga
        c_last = GC + (tok + C - 1) * K
        cs = tl.load(c_last + rk, mask=mc, other=0.0) * scale
        a_last = tl.load(GA + tok + C - 1)
        if HAS_S:
            b_last = tl.load(GB + tok + C - 1)
            sa = tl.load(SA + row)
            ss = tl.load(SC + row * K + rk, mask=mc, other=0.0) * scale
        else:
            b_last = a_last
            sa = a_last
            ss = cs
        if P > 0:
            cs_p = tl.load(c_last + rp, mask=mp, other=0.0) * scale_p
            if HAS_S:
                ss_p = tl.load(SC + row * K + rp, mask=mp, other=0.0) * scale_p
            else:
                ss_p = cs_p

        # 3. The read, slice by slice, and the output. Every slice is read before any is written (4.), so
        # that the read's tiles and the update's are not live at once (registers).
        if READ:
            q = tl.load(Q + cd_offs, mask=cd, other=0.0)
            c_rows = GC + (tok + rc[:, None]) * K
            coef = tl.load(c_rows + rk[None, :], mask=cc, other=0.0)
            kt = tl.load(Kx + (key_row + rk[None, :]) * D + rd[:, None], mask=dc, other=0.0)
            pq = coef * tl.dot(q, kt, input_precision=PRECISION) * scale[None, :]
            hw = tl.zeros((BC, BD), tl.float32)
            hs = tl.zeros((BC, BD), tl.float32)
            p = tl.zeros((BC, BC), tl.float32)
            if P > 0:
                coef_p = tl.load(c_rows + rp[None, :], mask=mc[:, None] & mp[None, :], other=0.0)
                kt_p = tl.load(Kx + (key_row + rp[None, :]) * D + rd[:, None], mask=md[:, None] & mp[None, :],
                               other=0.0)
                pq_p = coef_p * tl.dot(q, kt_p, input_precision=PRECISION) * scale_p[None, :]
                p_p = tl.zeros((BC, BP), tl.float32)
            for f0 in range(0, F, BF):
                rf = f0 + tl.arange(0, BF)
                mf = rf < F
                df = md[:, None] & mf[None, :]
                fd = mf[:, None] & md[None, :]
                o_dft = rd[None, :] * F + rf[:, None]  # W1, S1 (D, F) loaded transposed (F, D)
                o_fdt = rf[None, :] * D + rd[:, None]  # W2, S2 (F, D) loaded transposed (D, F)
                hp = ga[:, None] * tl.dot(q, tl.load(W2 + w2_off + o_fdt, mask=df, other=0.0),
                                          input_precision=PRECISION)
                if HAS_S:
                    hp += gb[:, None] * tl.dot(q, tl.load(S2 + w2_off + o_fdt, mask=df, other=0.0),
                                               input_precision=PRECISION)
                hp += tl.dot(pq, tl.load(E + cf_off + rk[:, None] * F + rf[None, :], mask=mc[:, None] & mf[None, :],
                                         other=0.0), input_precision=PRECISION)
                if P > 0:
                    hp += tl.dot(pq_p, tl.load(E + cf_off + rp[:, None] * F + rf[None, :],
                                               mask=mp[:, None] & mf[None, :], other=0.0), input_precision=PRECISION)
                h = _gelu(hp)
                p += tl.dot(h, _gelu(tl.load(PRE + cf_off + rk[None, :] * F + rf[:, None],
                                             mask=mf[:, None] & mc[None, :], other=0.0)), input_precision=PRECISION)
                if P > 0:
                    p_p += tl.dot(h, _gelu(tl.load(PRE + cf_off + rp[None, :] * F + rf[:, None],
                                                   mask=mf[:, None] & mp[None, :], other=0.0)),
                                  input_precision=PRECISION)
                hw += tl.dot(h, tl.load(W1 + w1_off + o_dft, mask=fd, other=0.0), input_precision=PRECISION)
                if HAS_S:
                    hs += tl.dot(h, tl.load(S1 + w1_off + o_dft, mask=fd, other=0.0), input_precision=PRECISION)
            y = q + ga[:, None] * hw
            if HAS_S:
                y += gb[:, None] * hs
            err = tl.load(ERR + err_off + rk[:, None] * D + rd[None, :], mask=cd, other=0.0)
            y += tl.dot(coef * p * scale[None, :], err, input_precision=PRECISION)
            if P > 0:
                err_p = tl.load(ERR + err_off + rp[:, None] * D + rd[None, :], mask=mp[:, None] & md[None, :],
                                other=0.0)
                y += tl.dot(coef_p * p_p * scale_p[None, :], err_p, input_precision=PRECISION)
            tl.store(Y + cd_offs, y, mask=cd)
            tl.debug_barrier()  # every read of the old weights is done before they are overwritten

        # 4. Slice by slice, the final weights and momenta over the old ones.
        errt = tl.load(ERR + err_off + rk[None, :] * D + rd[:, None], mask=dc, other=0.0)
        k = tl.load(Kx + (key_row + rk[:, None]) * D + rd[None, :], mask=cd, other=0.0)
        if P > 0:
            errt_p = tl.load(ERR + err_off + rp[None, :] * D + rd[:, None], mask=md[:, None] & mp[None, :], other=0.0)
            k_p = tl.load(Kx + (key_row + rp[:, None]) * D + rd[None, :], mask=mp[:, None] & md[None, :], other=0.0)
        for f0 in range(0, F, BF):
            rf = f0 + tl.arange(0, BF)
            mf = rf < F
            cf = mc[:, None] & mf[None, :]
            fc = mf[:, None] & mc[None, :]
            df = md[:, None] & mf[None, :]
            fd = mf[:, None] & md[None, :]
            o_df = rd[:, None] * F + rf[None, :]  # W1, S1 (D, F): rows rd, columns rf
            o_fd = rf[:, None] * D + rd[None, :]  # W2, S2 (F, D): rows rf, columns rd
            act = _gelu(tl.load(PRE + cf_off + rk[:, None] * F + rf[None, :], mask=cf, other=0.0))
            if P > 0:
                act_p = _gelu(tl.load(PRE + cf_off + rp[:, None] * F + rf[None, :], mask=mp[:, None] & mf[None, :],
                                      other=0.0))
            w1 = a_last * tl.load(W1 + w1_off + o_df, mask=df, other=0.0)
            w1 += tl.dot(errt * cs[None, :], act, input_precision=PRECISION)
            if P > 0:
                w1 += tl.dot(errt_p * cs_p[None, :], act_p, input_precision=PRECISION)
            if HAS_S:
                s1 = tl.load(S1 + w1_off + o_df, mask=df, other=0.0)
                w1 += b_last * s1
                s1 = sa * s1 + tl.dot(errt * ss[None, :], act, input_precision=PRECISION)
                if P > 0:
                    s1 += tl.dot(errt_p * ss_p[None, :], act_p, input_precision=PRECISION)
                tl.store(S1 + w1_off + o_df, s1, mask=df)
            tl.store(W1 + w1_off + o_df, w1, mask=df)
            et = tl.load(E + cf_off + rk[None, :] * F + rf[:, None], mask=fc, other=0.0)
            if P > 0:
                et_p = tl.load(E + cf_off + rp[None, :] * F + rf[:, None], mask=mf[:, None] & mp[None, :], other=0.0)
            w2 = a_last * tl.load(W2 + w2_off + o_fd, mask=fd, other=0.0)
            w2 += tl.dot(et * cs[None, :], k, input_precision=PRECISION)
            if P > 0:
                w2 += tl.dot(et_p * cs_p[None, :], k_p, input_precision=PRECISION)
            if HAS_S:
                s2 = tl.load(S2 + w2_off + o_fd, mask=fd, other=0.0)
                w2 += b_last * s2
                s2 = sa * s2 + tl.dot(et * ss[None, :], k, input_precision=PRECISION)
                if P > 0:
                    s2 += tl.dot(et_p * ss_p[None, :], k_p, input_precision=PRECISION)
                tl.store(S2 + w2_off + o_fd, s2, mask=fd)
            tl.store(W2 + w2_off + o_fd, w2, mask=fd)
        tl.debug_barrier()  # the next chunk reads the new weights and overwrites the scratch


class PersistentResult(NamedTuple):
    """:func:`persistent_forward`'s results: the reads ``y (n, G, C, d)``; the final weights and momenta
    (dicts of ``(G, ...)``; momenta ``None`` without momentum); the memory entering chunks ``0, r, 2r, ...``
    as dicts of ``(ceil(n / r), G, ...)`` (``None`` unless asked for); and the chunk-start weights after
    the call (``None`` unless ``stop_chunk`` was given)."""

    y: torch.Tensor
    weights: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor] | None
    checkpoints: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None] | None
    chunk_start: dict[str, torch.Tensor] | None


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def persistent_forward(spec, W: dict[str, torch.Tensor], S: dict[str, torch.Tensor] | None, q: torch.Tensor,
                       k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None, c: torch.Tensor,
                       sa_last: torch.Tensor | None, sc_last: torch.Tensor | None, *,
                       checkpoint_every: int | None = None, stop_chunk: torch.Tensor | None = None,
                       chunk_start: dict[str, torch.Tensor] | None = None, read: bool = True) -> PersistentResult:
    """All ``n`` chunks of ``G = batch * heads`` rows in one launch; no autograd.

    Chunk-first inputs: ``q (n, G, C, d)``, ``k, v (n, G, K, d)``, coefficients ``a, b (n, G, C)``,
    ``c (n, G, C, K)``, ``sa_last (n, G)``, ``sc_last (n, G, K)`` (:func:`~.titans.titans_coefficients`;
    ``b, sa_last, sc_last`` ``None`` without momentum, with ``S``). ``K = C`` for Titans; Atlas' Omega
    window gives each chunk ``K = C + P`` keys, the ``P`` tokens before the chunk first
    (:func:`~.atlas.atlas_coefficients`). Weights and momenta ``w1 (G, d, F)``, ``w2 (G, F, d)``,
    float32, left unchanged. ``checkpoint_every = r`` also returns the memory entering every ``r``-th
    chunk. ``stop_chunk (G,)`` (int, ``-1`` for none) names for each row the chunk its last token falls
    inside: the weights that chunk started from replace that row's ``chunk_start`` (weights ``(G, ...)``)
    in the result, as :func:`~.mlp_memory.next_chunk_start` does chunk by chunk. ``read=False`` skips the
    reads (``y`` is ``None``): only the memory advances.
    """
    n, G, C, D = q.shape
    K = k.shape[2]
    P = K - C
    if not covers(spec, C, P + 1):
        raise ValueError(f"persistent_forward does not cover this memory, chunk or window ({spec}, chunk {C}, "
                         f"{P} keys before it)")
    if v.shape[2] != K or c.shape[-1] != K:
        raise ValueError(f"persistent_forward takes the keys' rows K = {K} in v and c (.., C, K): got v "
                         f"{tuple(v.shape)}, c {tuple(c.shape)}")
    F = spec.hidden
    has_s = S is not None
    f32 = lambda x: x.to(torch.float32).contiguous()  # noqa: E731
    q, k, v, a, c = map(f32, (q, k, v, a, c))
    b, sa_last, sc_last = (f32(b), f32(sa_last), f32(sc_last)) if has_s else (a, a, a)
    # The outputs are the program's working memory: they start as the carried state.
    W1, W2 = f32(W["w1"]).clone(), f32(W["w2"]).clone()
    S1, S2 = (f32(S["w1"]).clone(), f32(S["w2"]).clone()) if has_s else (W1, W2)
    y = torch.empty_like(q) if read else None
    pre, e, err = q.new_empty(G, K, F), q.new_empty(G, K, F), q.new_empty(G, K, D)
    ckpt = checkpoint_every is not None
    if ckpt:
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
        n_ck = -(-n // checkpoint_every)
        CW1, CW2 = W1.new_empty(n_ck, *W1.shape), W2.new_empty(n_ck, *W2.shape)
        CS1, CS2 = (S1.new_empty(n_ck, *S1.shape), S2.new_empty(n_ck, *S2.shape)) if has_s else (CW1, CW2)
    else:
        CW1 = CW2 = CS1 = CS2 = W1
    track = stop_chunk is not None
    if track:
        if chunk_start is None:
            raise ValueError("stop_chunk needs the chunk_start weights it updates")
        ST1, ST2 = f32(chunk_start["w1"]).clone(), f32(chunk_start["w2"]).clone()
        stop = stop_chunk.to(device=q.device, dtype=torch.int32).contiguous()
    else:
        ST1, ST2, stop = W1, W2, q.new_zeros(1, dtype=torch.int32)
    BC, BD, BP = _pow2(C), _pow2(D), _pow2(P)
    BF = min(BLOCKS["slice"], _pow2(F))
    warps = BLOCKS["warps_wide"] if max(BC, BD) > 32 else BLOCKS["warps_narrow"]
    if P and BLOCKS["warps_window"]:
        warps = BLOCKS["warps_window"]
    if P and warps >= 8:  # see BLOCKS; Titans' kernel (P = 0) builds no window block
        BP = max(BP, BLOCKS["least_rows_wide"])
    clip = spec.grad_clip
    if G and n:
        _persistent_kernel[(G,)](
            q, k, v, a, b, c, sa_last, sc_last, W1, W2, S1, S2, q if y is None else y, pre, e, err,
            CW1, CW2, CS1, CS2, stop, ST1, ST2, float(clip) if clip is not None else 0.0, n, G, C, D, F,
            checkpoint_every or 1, P,
            HAS_S=has_s, L2=spec.objective == "l2", CLIP=clip is not None, CKPT=ckpt, TRACK=track, READ=read,
            BC=BC, BP=BP, BD=BD, BF=BF, PRECISION=_precision(), num_warps=warps,
            # one stage: two pipeline the slices' loads for little, at 213 KB of shared memory (head 64, hidden
            # 256, chunk 64, sm_90), more than a block gets before Hopper (benchmarks/history/, 2026-11-28)
            num_stages=1)
    checkpoints = None
    if ckpt:
        checkpoints = ({"w1": CW1, "w2": CW2}, {"w1": CS1, "w2": CS2} if has_s else None)
    return PersistentResult(y, {"w1": W1, "w2": W2}, {"w1": S1, "w2": S2} if has_s else None, checkpoints,
                            {"w1": ST1, "w2": ST2} if track else None)


# --------------------------------------------------------------------------- Titans' chunked forward


def _applies(spec, chunk_size: int, tensors: list[torch.Tensor], tf32: bool, rows: int, window: int = 1) -> bool:
    """What every use of the kernel asks of a call: see :func:`wanted`."""
    if not ENABLED or not covers(spec, chunk_size, window):
        return False
    paths = current_paths()
    if paths.chunk_forward != "triton" or paths.chunk_backward == "autograd":
        return False
    if any(t.is_floating_point() and t.dtype == torch.float64 for t in tensors):
        return False
    # The backend last but one: an explicit "triton" request is only checked where the kernel applies.
    if resolve_backend(tensors[0], has_triton_impl=True) != "triton":
        return False
    # float32-exact products spill this kernel's registers, and there the per-chunk launches are faster
    # (benchmarks/RESULTS.md): on CUDA it takes the problems whose products run in TF32.
    if tensors[0].is_cuda and not tf32:
        return False
    # One program a row walks every chunk of it: with fewer rows than about the GPU's SMs, most SMs idle
    # while the per-chunk launches, spread over hidden slices too, keep them busy (benchmarks/RESULTS.md).
    if tensors[0].is_cuda:
        sms = torch.cuda.get_device_properties(tensors[0].device).multi_processor_count
        if rows < MIN_ROWS_PER_SM * sms:
            return False
    return True


def _recording(tensors: list[torch.Tensor]) -> bool:
    """Whether autograd records a call on ``tensors``."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def wanted(spec, chunk_size: int, on_boundaries: bool, tensors: list[torch.Tensor], tf32: bool, rows: int,
           track_start: bool = False) -> bool:
    """Whether a Titans chunk loop (:func:`~.titans.chunk_titans`, MC-Titans' online memory) runs its chunks
    through :func:`persistent_forward`: on the Triton backend, where no gradient is recorded, for the
    memories and chunks it :func:`covers`, a float32 memory, and calls whose rows all start at a chunk
    boundary (``on_boundaries``: a resumed row takes its first chunk's gradients at stored weights, which
    the chunked path handles). With :data:`TRAINING` also where gradients are recorded, through
    :func:`persistent_memory`, for memories without the clip and calls whose rows end at chunk boundaries
    (no ``track_start``: the training case).
    ``tensors``: every input and state tensor of the call; ``tf32``: whether its products run in TF32
    (:func:`~.chunk_loop.tf32_wanted` of the call's own inputs, before they are widened to float32).
    ``rows``: the call's ``batch * heads``, one program each. ``comparison_paths`` other than the shipped
    ones keep the per-chunk paths they name."""
    if _recording(tensors) and (not TRAINING or spec.grad_clip is not None or track_start):
        return False
    return on_boundaries and _applies(spec, chunk_size, tensors, tf32, rows)


def first_pass_wanted(spec, chunk_size: int, on_boundaries: bool, tensors: list[torch.Tensor], tf32: bool,
                      rows: int, track_start: bool = False, window: int | None = None) -> bool:
    """Whether a chunk loop over :func:`~.titans_chunk.chunk_memory` (Titans', Atlas' ``gd`` and ``momentum``
    with an Omega ``window``) gives its forward pass to :func:`persistent_forward` (:func:`loop_first_pass`):
    in training its backward stays the per-chunk one, recomputing from the kernel's checkpoints; without
    gradients the kernel is the whole loop. Where :data:`FIRST_PASS` is set and the kernel applies as for
    :func:`wanted`, the clip included, for calls that neither resume inside a chunk nor stop inside one
    (``on_boundaries``, no ``track_start``). ``window``: Atlas' Omega window (``None`` for Titans), whose
    calls take it on CUDA only with :data:`ATLAS_ON_CUDA`."""
    if window is not None and tensors[0].is_cuda and not ATLAS_ON_CUDA:
        return False
    return (FIRST_PASS and on_boundaries and not track_start
            and _applies(spec, chunk_size, tensors, tf32, rows, 1 if window is None else window))


def _by_row(carry: tuple[torch.Tensor, ...], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            coefficients: tuple[torch.Tensor, ...], momentum: bool = True):
    """A Titans chunk loop's ``(B, H, ...)`` weights and (``momentum``) momenta, the carry's first four (two
    without), and ``(n, B, H, ...)`` inputs in the kernels' rows (``G = B * H``): ``W``, ``S`` dicts ``(G, ...)``
    (``S`` ``None`` without momentum), the inputs chunk-first ``(n, G, ...)``, and the inverse of the merge
    for ``(G, ...)`` results."""
    n, B, H = q.shape[:3]
    heads = lambda x: x.flatten(0, 1)  # noqa: E731
    W = {"w1": heads(carry[0]), "w2": heads(carry[1])}
    S = {"w1": heads(carry[2]), "w2": heads(carry[3])} if momentum else None
    inputs = [x.reshape(n, B * H, *x.shape[3:]) for x in (q, k, v, *coefficients)]
    return W, S, inputs, lambda x: x.view(B, H, *x.shape[1:])


def loop_first_pass(spec, carry: tuple[torch.Tensor, ...], xs: tuple[torch.Tensor, ...],
                    consts: tuple[torch.Tensor, ...], every: int, *, momentum: bool = True
                    ) -> tuple[tuple[torch.Tensor], tuple[torch.Tensor, ...], list[tuple[torch.Tensor, ...]]]:
    """:func:`~.chunk_loop.run_chunks`' first pass of a chunk loop over :func:`~.titans_chunk.chunk_memory`
    (Titans' ``_titans_step``, Atlas' fused ``gd`` and ``momentum`` chunks; no chunk-start weights carried):
    every chunk in one :func:`persistent_forward` launch, which keeps the memory entering every ``every``-th
    chunk. ``carry``: ``w1, w2`` and (``momentum``) their momenta ``(B, H, ...)``; ``xs``: the chunks' ``q,
    k, v`` first (Atlas' keys and values with their window) and their chunk coefficients last
    (:func:`~.titans.titans_coefficients`, :func:`~.atlas.atlas_coefficients`: ``(n, B, H, C, ...)``);
    ``consts`` empty. Returns ``((y,), carry, checkpoints)`` as that loop's forward does. The backward re-runs
    each stretch chunk by chunk from these checkpoints, which differ from the per-chunk launches' by rounding
    only (both TF32, summed in another order)."""
    # Said by the caller, not read from the carry's length: two weights and their chunk-start weights would
    # pass for weights and momenta.
    if consts or len(carry) != (4 if momentum else 2):
        raise ValueError("the persistent first pass takes the loop without stored or chunk-start weights")
    q = xs[0]
    n = q.shape[0]
    W, S, inputs, split = _by_row(carry, *xs[:3], xs[-5:], momentum)
    res = persistent_forward(spec, W, S, *inputs, checkpoint_every=every if every < n else None)
    final = (res.weights["w1"], res.weights["w2"]) + ((res.momentum["w1"], res.momentum["w2"]) if momentum else ())
    # The memory entering chunk 0 is the carry itself, kept as it came (often a view of the learned initial
    # weights): the kernel's copy of it, the first of its checkpoints, is dropped with its buffer (the later
    # ones are copied out of it), so that the backward holds what the per-chunk forward has it hold.
    checkpoints = [tuple(carry)]
    if res.checkpoints is not None:
        kept_w, kept_s = res.checkpoints
        kept = (kept_w["w1"], kept_w["w2"]) + ((kept_s["w1"], kept_s["w2"]) if momentum else ())
        later = [t[1:].clone() for t in kept]
        checkpoints += [tuple(split(t[i]) for t in later) for i in range(later[0].shape[0])]
    return (res.y.view(q.shape),), tuple(split(x) for x in final), checkpoints


# Left to run as it is under torch.compile (a graph break), as the chunk loop it replaces is.
@torch.compiler.disable
def titans_chunks(spec, carry: tuple[torch.Tensor, ...], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  coefficients: tuple[torch.Tensor, ...], stops: torch.Tensor, track_start: bool, tf32: bool,
                  checkpoint_every: int | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """:func:`~.titans.chunk_titans`' chunk loop in one launch: the same ``(outputs, carry)`` as
    :func:`~.mlp_memory.run_resumable_chunks` there. ``carry``: ``w1, w2`` weights, their momenta and
    (``track_start``) their chunk-start weights, ``(B, H, ...)``; ``q, k, v (n, B, H, C, d)``; the chunks'
    :func:`~.titans.titans_coefficients`; ``stops (n, B)``, the chunk each row's last token falls inside.
    Where gradients are recorded (:data:`TRAINING`, no ``track_start``), through :func:`persistent_memory`
    with checkpoints every ``checkpoint_every`` chunks."""
    W, S, inputs, split = _by_row(carry, q, k, v, coefficients)
    if _recording([*carry, q, k, v, *coefficients]):
        with tf32_products(tf32):
            y, W_new, S_new = persistent_memory(spec, W, S, *inputs, checkpoint_every=checkpoint_every)
        return y.view(q.shape), tuple(split(x) for x in (*W_new.values(), *S_new.values()))
    stop_chunk = start = None
    if track_start:
        stop_chunk = torch.where(stops.any(0), stops.to(torch.int32).argmax(0), -1).repeat_interleave(q.shape[2])
        start = {"w1": carry[4].flatten(0, 1), "w2": carry[5].flatten(0, 1)}
    with tf32_products(tf32):
        res = persistent_forward(spec, W, S, *inputs, stop_chunk=stop_chunk, chunk_start=start)
    out = (res.weights["w1"], res.weights["w2"], res.momentum["w1"], res.momentum["w2"])
    if track_start:
        out += (res.chunk_start["w1"], res.chunk_start["w2"])
    return res.y.view(q.shape), tuple(split(x) for x in out)


# --------------------------------------------------------------------------- the backward


@triton.jit
def _backward_kernel(Q, Kx, V, DY, GA, GB, GC, SA, SC, ST1, ST2, SS1, SS2, DW1, DW2, DS1, DS2,
                     DQ, DK, DV, DGA, DGB, DGC, DSA, DSC,
                     PRE, BACK, E, HP, H, DHP, DPRE, DBACK, ERR, DPRED, n_chunks, G, C, D, F,
                     HAS_S: tl.constexpr, L2: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr,
                     BF: tl.constexpr, PRECISION: tl.constexpr):
    """Program ``g``: the chunks of one stretch from the last, each from its chunk-start state
    ``ST1, ST2`` (momenta ``SS1, SS2``; ``(n, G, ...)``), taking the gradient of the memory after it from
    ``DW1 .. DS2`` and leaving there that of the memory before it (see :func:`persistent_backward`)."""
    g = tl.program_id(0).to(tl.int64)
    rc, rd = tl.arange(0, BC), tl.arange(0, BD)
    mc, md = rc < C, rd < D
    cd = mc[:, None] & md[None, :]
    dc = md[:, None] & mc[None, :]
    cc = mc[:, None] & mc[None, :]
    w_off = g * D * F  # this row's gradients DW1 (D, F), DW2 (F, D), and of the momenta
    cf_off = g * C * F  # this row's scratch (C, F)
    cd_scr = g * C * D  # and (C, D)
    last = (rc == C - 1)
    for ii in range(0, n_chunks):
        i = n_chunks - 1 - ii
        row = i * G + g
        tok = row * C
        s_off = row * D * F  # the chunk-start state
        cd_offs = (tok + rc[:, None]) * D + rd[None, :]
        dc_offs = (tok + rc[None, :]) * D + rd[:, None]  # the same rows, loaded transposed
        k = tl.load(Kx + cd_offs, mask=cd, other=0.0)
        q = tl.load(Q + cd_offs, mask=cd, other=0.0)
        dy = tl.load(DY + cd_offs, mask=cd, other=0.0)

        # The chunk's forward again: pre, back, e, the queries' hidden layer (stored) and the sums.
        pred = tl.zeros((BC, BD), tl.float32)
        for f0 in range(0, F, BF):
            rf = f0 + tl.arange(0, BF)
            mf = rf < F
            pre = tl.dot(k, tl.load(ST2 + s_off + rf[None, :] * D + rd[:, None], mask=md[:, None] & mf[None, :],
                                    other=0.0), input_precision=PRECISION)
            tl.store(PRE + cf_off + rc[:, None] * F + rf[None, :], pre, mask=mc[:, None] & mf[None, :])
            if L2:
                pred += tl.dot(_gelu(pre), tl.load(ST1 + s_off + rd[None, :] * F + rf[:, None],
                                                   mask=mf[:, None] & md[None, :], other=0.0),
                               input_precision=PRECISION)
        if L2:
            err = 2.0 * (k + pred - tl.load(V + cd_offs, mask=cd, other=0.0))
        else:
            err = -tl.load(V + cd_offs, mask=cd, other=0.0)
        tl.store(ERR + cd_scr + rc[:, None] * D + rd[None, :], err, mask=cd)
        tl.debug_barrier()
        for f0 in range(0, F, BF):
            rf = f0 + tl.arange(0, BF)
            mf = rf < F
            cf = mc[:, None] & mf[None, :]
            o_cf = cf_off + rc[:, None] * F + rf[None, :]
            back = tl.dot(err, tl.load(ST1 + s_off + rd[:, None] * F + rf[None, :], mask=md[:, None] & mf[None, :],
                                       other=0.0), input_precision=PRECISION)
            tl.store(BACK + o_cf, back, mask=cf)
            tl.store(E + o_cf, back * _gelu_slope(tl.load(PRE + o_cf, mask=cf, other=0.0)), mask=cf)
        tl.debug_barrier()
        ga = tl.load(GA + tok + rc, mask=mc, other=0.0)
        gb = tl.load(GB + tok + rc, mask=mc, other=0.0) if HAS_S else ga
        coef = tl.load(GC + (tok + rc[:, None]) * C + rc[None, :], mask=cc, other=0.0)
        coef_t = tl.load(GC + (tok + rc[None, :]) * C + rc[:, None], mask=cc, other=0.0)
        c_last = tl.load(GC + (tok + C - 1) * C + rc, mask=mc, other=0.0)
        a_last = tl.load(GA + tok + C - 1)
        if HAS_S:
            b_last = tl.load(GB + tok + C - 1)
            sa = tl.load(SA + row)
            sc = tl.load(SC + tok + rc, mask=mc, other=0.0)
        else:
            b_last = a_last
            sa = a_last
            sc = c_last
        qk = tl.dot(q, tl.load(Kx + dc_offs, mask=dc, other=0.0), input_precision=PRECISION)
        kq = tl.dot(k, tl.load(Q + dc_offs, mask=dc, other=0.0), input_precision=PRECISION)  # (q k^T)^T
        hw = tl.zeros((BC, BD), tl.float32)
        hs = tl.zeros((BC, BD), tl.float32)
        p = tl.zeros((BC, BC), tl.float32)
        for f0 in range(0, F, BF):
            rf = f0 + tl.arange(0, BF)
            mf = rf < F
            cf = mc[:, None] & mf[None, :]
            df = md[:, None] & mf[None, :]
            fd = mf[:, None] & md[None, :]
            o_cf = cf_off + rc[:, None] * F + rf[None, :]
            o_fdt = rf[None, :] * D + rd[:, None]
            o_dft = rd[None, :] * F + rf[:, None]
            hp = ga[:, None] * tl.dot(q, tl.load(ST2 + s_off + o_fdt, mask=df, other=0.0), input_precision=PRECISION)
            if HAS_S:
                hp += gb[:, None] * tl.dot(q, tl.load(SS2 + s_off + o_fdt, mask=df, other=0.0),
                                           input_precision=PRECISION)
            hp += tl.dot(coef * qk, tl.load(E + o_cf, mask=cf, other=0.0), input_precision=PRECISION)
            h = _gelu(hp)
            tl.store(HP + o_cf, hp, mask=cf)
            tl.store(H + o_cf, h, mask=cf)
            p += tl.dot(h, _gelu(tl.load(PRE + cf_off + rc[None, :] * F + rf[:, None], mask=mf[:, None] & mc[None, :],
                                         other=0.0)), input_precision=PRECISION)
            hw += tl.dot(h, tl.load(ST1 + s_off + o_dft, mask=fd, other=0.0), input_precision=PRECISION)
            if HAS_S:
                hs += tl.dot(h, tl.load(SS1 + s_off + o_dft, mask=fd, other=0.0), input_precision=PRECISION)
        tl.debug_barrier()

        # The backward, in three passes over the slices, each with few accumulators (registers). The read
        # of W1 (input h, factors err and gelu(pre)): its gates' gradients, dM1 = dy err^T and its share
        # of c's gradient (stored; the rest is added below).
        g_a = tl.sum(dy * hw, 1)
        g_b = tl.sum(dy * hs, 1)
        dm1 = tl.dot(dy, tl.load(ERR + cd_scr + rc[None, :] * D + rd[:, None], mask=dc, other=0.0),
                     input_precision=PRECISION)
        o_cc = (tok + rc[:, None]) * C + rc[None, :]
        tl.store(DGC + o_cc, dm1 * p, mask=cc)

        # (a) What err's factor needs from every slice: gelu(pre) dW1'^T, gelu(pre) dS1'^T (the final
        # update's terms) and p^T = gelu(pre) h^T.
        bdw1 = tl.zeros((BC, BD), tl.float32)
        bds1 = tl.zeros((BC, BD), tl.float32)
        pt = tl.zeros((BC, BC), tl.float32)
        for f0 in range(0, F, BF):
            rf = f0 + tl.arange(0, BF)
            mf = rf < F
            fc = mf[:, None] & mc[None, :]
            fd = mf[:, None] & md[None, :]
            o_dft = rd[None, :] * F + rf[:, None]
            act = _gelu(tl.load(PRE + cf_off + rc[:, None] * F + rf[None, :], mask=mc[:, None] & mf[None, :],
                                other=0.0))
            bdw1 += tl.dot(act, tl.load(DW1 + w_off + o_dft, mask=fd, other=0.0), input_precision=PRECISION)
            if HAS_S:
                bds1 += tl.dot(act, tl.load(DS1 + w_off + o_dft, mask=fd, other=0.0), input_precision=PRECISION)
            pt += tl.dot(act, tl.load(H + cf_off + rc[None, :] * F + rf[:, None], mask=fc, other=0.0),
                         input_precision=PRECISION)

        # (b) The hidden layer's gradient through the read of W1, then through the GELU (stored); the read
        # of W2 (input q, factors e and k): its gates' gradients, q's, and dM2 = d_hp e^T.
        dmc1 = dm1 * coef
        dq = dy
        dm2 = tl.zeros((BC, BC), tl.float32)
        for f0 in range(0, F, BF):
            rf = f0 + tl.arange(0, BF)
            mf = rf < F
            cf = mc[:, None] & mf[None, :]
            fc = mf[:, None] & mc[None, :]
            df = md[:, None] & mf[None, :]
            fd = mf[:, None] & md[None, :]
            o_cf = cf_off + rc[:, None] * F + rf[None, :]
            o_fc = cf_off + rc[None, :] * F + rf[:, None]
            o_df = rd[:, None] * F + rf[None, :]
            o_fd = rf[:, None] * D + rd[None, :]
            o_fdt = rf[None, :] * D + rd[:, None]
            d_hidden = tl.dot(ga[:, None] * dy, tl.load(ST1 + s_off + o_df, mask=df, other=0.0),
                              input_precision=PRECISION)
            if HAS_S:
                d_hidden += tl.dot(gb[:, None] * dy, tl.load(SS1 + s_off + o_df, mask=df, other=0.0),
                                   input_precision=PRECISION)
            d_hidden += tl.dot(dmc1, _gelu(tl.load(PRE + o_cf, mask=cf, other=0.0)), input_precision=PRECISION)
            d_hp = d_hidden * _gelu_slope(tl.load(HP + o_cf, mask=cf, other=0.0))
            tl.store(DHP + o_cf, d_hp, mask=cf)
            g_a += tl.sum(d_hp * tl.dot(q, tl.load(ST2 + s_off + o_fdt, mask=df, other=0.0),
                                        input_precision=PRECISION), 1)
            dq += tl.dot(ga[:, None] * d_hp, tl.load(ST2 + s_off + o_fd, mask=fd, other=0.0),
                         input_precision=PRECISION)
            if HAS_S:
                g_b += tl.sum(d_hp * tl.dot(q, tl.load(SS2 + s_off + o_fdt, mask=df, other=0.0),
                                            input_precision=PRECISION), 1)
                dq += tl.dot(gb[:, None] * d_hp, tl.load(SS2 + s_off + o_fd, mask=fd, other=0.0),
                             input_precision=PRECISION)
            dm2 += tl.dot(d_hp, tl.load(E + o_fc, mask=fc, other=0.0), input_precision=PRECISION)
        dq += tl.dot(dm2 * coef, k, input_precision=PRECISION)
        tl.debug_barrier()  # d_hp is read below by other threads

        # (c) e's gradient: the final update's terms and the read's, then through e = back * gelu'(pre)
        # (d_back and pre's first share, stored); k's share through the final update, err's through back.
        ckq = coef_t * kq  # (c * q k^T)^T
        dk = tl.zeros((BC, BD), tl.float32)
        d_err = tl.zeros((BC, BD), tl.float32)
        d_c_last = tl.zeros((BC,), tl.float32)
        d_sc = tl.zeros((BC,), tl.float32)
        for f0 in range(0, F, BF):
            rf = f0 + tl.arange(0, BF)
            mf = rf < F
            cf = mc[:, None] & mf[None, :]
            df = md[:, None] & mf[None, :]
            fd = mf[:, None] & md[None, :]
            o_cf = cf_off + rc[:, None] * F + rf[None, :]
            o_dft = rd[None, :] * F + rf[:, None]
            o_fd = rf[:, None] * D + rd[None, :]
            o_fdt = rf[None, :] * D + rd[:, None]
            pre = tl.load(PRE + o_cf, mask=cf, other=0.0)
            e = tl.load(E + o_cf, mask=cf, other=0.0)
            bdw2 = tl.dot(k, tl.load(DW2 + w_off + o_fdt, mask=df, other=0.0), input_precision=PRECISION)
            d_c_last += tl.sum(e * bdw2, 1)
            da2 = c_last[:, None] * bdw2 + tl.dot(ckq, tl.load(DHP + o_cf, mask=cf, other=0.0),
                                                  input_precision=PRECISION)
            dk += tl.dot(e * c_last[:, None], tl.load(DW2 + w_off + o_fd, mask=fd, other=0.0),
                         input_precision=PRECISION)
            if HAS_S:
                bds2 = tl.dot(k, tl.load(DS2 + w_off + o_fdt, mask=df, other=0.0), input_precision=PRECISION)
                d_sc += tl.sum(e * bds2, 1)
                da2 += sc[:, None] * bds2
                dk += tl.dot(e * sc[:, None], tl.load(DS2 + w_off + o_fd, mask=fd, other=0.0),
                             input_precision=PRECISION)
            d_back = da2 * _gelu_slope(pre)
            tl.store(DBACK + o_cf, d_back, mask=cf)
            tl.store(DPRE + o_cf, da2 * tl.load(BACK + o_cf, mask=cf, other=0.0) * _gelu_curvature(pre), mask=cf)
            d_err += tl.dot(d_back, tl.load(ST1 + s_off + o_dft, mask=fd, other=0.0), input_precision=PRECISION)

        # err's gradient: the read's and the final update's terms of its factor.
        d_err += c_last[:, None] * bdw1 + tl.dot(coef_t * pt, dy, input_precision=PRECISION)
        d_c_last += tl.sum(err * bdw1, 1)
        if HAS_S:
            d_err += sc[:, None] * bds1
            d_sc += tl.sum(err * bds1, 1)
        # c's gradient: the read of W2's share and the final update's (last row) over the stored share.
        tl.store(DGC + o_cc, tl.load(DGC + o_cc, mask=cc, other=0.0) + dm2 * qk
                 + tl.where(last[:, None], d_c_last[None, :], 0.0), mask=cc)
        if L2:
            d_pred = 2.0 * d_err
            dk += d_pred
            tl.store(DV + cd_offs, -d_pred, mask=cd)
        else:
            d_pred = d_err
            tl.store(DV + cd_offs, -d_err, mask=cd)
        tl.store(DPRED + cd_scr + rc[:, None] * D + rd[None, :], d_pred, mask=cd)
        tl.debug_barrier()

        # Per slice: gelu(pre)'s gradient, pre's, k's share; then the slice's weight gradients over dW'.
        dyt = tl.load(DY + dc_offs, mask=dc, other=0.0)
        errt = tl.load(ERR + cd_scr + rc[None, :] * D + rd[:, None], mask=dc, other=0.0)
        dm1t = tl.dot(err, dyt, input_precision=PRECISION)
        dpredt = tl.load(DPRED + cd_scr + rc[None, :] * D + rd[:, None], mask=dc, other=0.0)
        dm2t = tl.zeros((BC, BC), tl.float32)
        d_a_last = tl.sum(tl.zeros((BC,), tl.float32), 0)
        d_b_last = d_a_last
        d_sa = d_a_last
        for f0 in range(0, F, BF):
            rf = f0 + tl.arange(0, BF)
            mf = rf < F
            cf = mc[:, None] & mf[None, :]
            fc = mf[:, None] & mc[None, :]
            df = md[:, None] & mf[None, :]
            fd = mf[:, None] & md[None, :]
            o_cf = cf_off + rc[:, None] * F + rf[None, :]
            o_fc = cf_off + rc[None, :] * F + rf[:, None]
            o_df = rd[:, None] * F + rf[None, :]
            o_fd = rf[:, None] * D + rd[None, :]
            pre = tl.load(PRE + o_cf, mask=cf, other=0.0)
            act = _gelu(pre)
            h = tl.load(H + o_cf, mask=cf, other=0.0)
            dw1 = tl.load(DW1 + w_off + o_df, mask=df, other=0.0)
            d_act = tl.dot(err * c_last[:, None], dw1, input_precision=PRECISION)
            d_act += tl.dot(dm1t * coef_t, h, input_precision=PRECISION)
            if HAS_S:
                ds1 = tl.load(DS1 + w_off + o_df, mask=df, other=0.0)
                d_act += tl.dot(err * sc[:, None], ds1, input_precision=PRECISION)
            if L2:
                d_act += tl.dot(d_pred, tl.load(ST1 + s_off + o_df, mask=df, other=0.0), input_precision=PRECISION)
            d_pre = tl.load(DPRE + o_cf, mask=cf, other=0.0) + d_act * _gelu_slope(pre)
            tl.store(DPRE + o_cf, d_pre, mask=cf)
            dk += tl.dot(d_pre, tl.load(ST2 + s_off + o_fd, mask=fd, other=0.0), input_precision=PRECISION)
            dm2t += tl.dot(tl.load(E + o_cf, mask=cf, other=0.0), tl.load(DHP + o_fc, mask=fc, other=0.0),
                           input_precision=PRECISION)
            tl.debug_barrier()  # d_pre is read below transposed, and the slice's dW', dS' are overwritten

            # W1, S1 (D, F): the final update's gates, the read's uses (dy, h), the factors' (err, d_back)
            # and (d_pred, gelu(pre)).
            w1 = tl.load(ST1 + s_off + o_df, mask=df, other=0.0)
            d_a_last += tl.sum(tl.sum(dw1 * w1, 1), 0)
            new = a_last * dw1 + tl.dot(dyt * ga[None, :], h, input_precision=PRECISION)
            new += tl.dot(errt, tl.load(DBACK + o_cf, mask=cf, other=0.0), input_precision=PRECISION)
            if L2:
                new += tl.dot(dpredt, act, input_precision=PRECISION)
            if HAS_S:
                s1 = tl.load(SS1 + s_off + o_df, mask=df, other=0.0)
                d_b_last += tl.sum(tl.sum(dw1 * s1, 1), 0)
                d_sa += tl.sum(tl.sum(ds1 * s1, 1), 0)
                new_s = b_last * dw1 + sa * ds1 + tl.dot(dyt * gb[None, :], h, input_precision=PRECISION)
                tl.store(DS1 + w_off + o_df, new_s, mask=df)
            tl.store(DW1 + w_off + o_df, new, mask=df)
            # W2, S2 (F, D): the read's uses (d_hp, q) and the factor's (d_pre, k).
            dw2 = tl.load(DW2 + w_off + o_fd, mask=fd, other=0.0)
            d_a_last += tl.sum(tl.sum(dw2 * tl.load(ST2 + s_off + o_fd, mask=fd, other=0.0), 1), 0)
            dhpt = tl.load(DHP + o_fc, mask=fc, other=0.0)
            new = a_last * dw2 + tl.dot(dhpt * ga[None, :], q, input_precision=PRECISION)
            new += tl.dot(tl.load(DPRE + o_fc, mask=fc, other=0.0), k, input_precision=PRECISION)
            if HAS_S:
                ds2 = tl.load(DS2 + w_off + o_fd, mask=fd, other=0.0)
                s2 = tl.load(SS2 + s_off + o_fd, mask=fd, other=0.0)
                d_b_last += tl.sum(tl.sum(dw2 * s2, 1), 0)
                d_sa += tl.sum(tl.sum(ds2 * s2, 1), 0)
                new_s = b_last * dw2 + sa * ds2 + tl.dot(dhpt * gb[None, :], q, input_precision=PRECISION)
                tl.store(DS2 + w_off + o_fd, new_s, mask=fd)
            tl.store(DW2 + w_off + o_fd, new, mask=fd)
        # The read of W2's share of k's gradient, (dM2 * c)^T q, with dM2^T summed over the slices above.
        dk += tl.dot(dm2t * coef_t, q, input_precision=PRECISION)
        tl.store(DQ + cd_offs, dq, mask=cd)
        tl.store(DK + cd_offs, dk, mask=cd)
        tl.store(DGA + tok + rc, g_a + tl.where(last, d_a_last, 0.0), mask=mc)
        if HAS_S:
            tl.store(DGB + tok + rc, g_b + tl.where(last, d_b_last, 0.0), mask=mc)
            tl.store(DSA + row, d_sa)
            tl.store(DSC + tok + rc, d_sc, mask=mc)
        tl.debug_barrier()  # the next chunk overwrites the scratch and reads the new dW', dS'


def persistent_backward(spec, states: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None],
                        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None,
                        c: torch.Tensor, sa_last: torch.Tensor | None, sc_last: torch.Tensor | None,
                        dy: torch.Tensor, dW: dict[str, torch.Tensor], dS: dict[str, torch.Tensor] | None
                        ) -> tuple[torch.Tensor, ...]:
    """The backward of ``n`` chunks (one stretch) in one launch, from the last chunk to the first.

    ``states``: the weights and momenta each chunk started from, dicts of ``(n, G, ...)`` (a
    :func:`persistent_forward` of the stretch with ``checkpoint_every=1``); inputs as there; ``dy
    (n, G, C, d)``; ``dW, dS``: the gradient of the memory after the last chunk, ``(G, ...)`` float32,
    overwritten with that of the memory before the first. Returns ``dq, dk, dv`` and the gradients of the
    coefficients ``a, b, c, sa_last, sc_last`` (``None`` for those of momentum without it). No clip.
    """
    if spec.grad_clip is not None or not covers(spec, q.shape[2]):
        raise ValueError(f"persistent_backward does not cover this memory ({spec})")
    n, G, C, D = q.shape
    if k.shape[2] != C or v.shape[2] != C or c.shape[-1] != C:
        raise ValueError(f"persistent_backward takes a chunk's own keys only (Titans'; no Omega window): got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, c {tuple(c.shape)}")
    F = spec.hidden
    has_s = dS is not None
    f32 = lambda x: x.to(torch.float32).contiguous()  # noqa: E731
    q, k, v, a, c, dy = map(f32, (q, k, v, a, c, dy))
    b, sa_last, sc_last = (f32(b), f32(sa_last), f32(sc_last)) if has_s else (a, a, a)
    W_st, S_st = states
    ST1, ST2 = f32(W_st["w1"]), f32(W_st["w2"])
    SS1, SS2 = (f32(S_st["w1"]), f32(S_st["w2"])) if has_s else (ST1, ST2)
    DW1, DW2 = dW["w1"], dW["w2"]
    DS1, DS2 = (dS["w1"], dS["w2"]) if has_s else (DW1, DW2)
    for t in (DW1, DW2, DS1, DS2):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError("the carried gradients must be contiguous float32 (they are updated in place)")
    dq, dk, dv = torch.empty_like(q), torch.empty_like(q), torch.empty_like(q)
    da, dc = torch.empty_like(a), torch.empty_like(c)
    db, dsa, dsc = (torch.empty_like(a), q.new_empty(n, G), torch.empty_like(a)) if has_s else (da, da, da)
    scratch = [q.new_empty(G, C, F) for _ in range(8)]  # pre, back, e, hp, h, d_hp, d_pre, d_back
    err, d_pred = q.new_empty(G, C, D), q.new_empty(G, C, D)
    BC, BD = _pow2(C), _pow2(D)
    BF = min(BLOCKS["slice"], _pow2(F))
    warps = BLOCKS["backward_warps_wide"] if max(BC, BD) > 32 else BLOCKS["backward_warps_narrow"]
    if G and n:
        _backward_kernel[(G,)](
            q, k, v, dy, a, b, c, sa_last, sc_last, ST1, ST2, SS1, SS2, DW1, DW2, DS1, DS2,
            dq, dk, dv, da, db, dc, dsa, dsc, *scratch, err, d_pred, n, G, C, D, F,
            HAS_S=has_s, L2=spec.objective == "l2", BC=BC, BD=BD, BF=BF, PRECISION=_precision(),
            num_warps=warps, num_stages=1)
    if not has_s:
        return dq, dk, dv, da, None, dc, None, None
    return dq, dk, dv, da, db, dc, dsa, dsc


def _spacing(n: int) -> int:
    """About the square root of the number of chunks: ``n / r`` checkpoints, ``r`` states of a stretch."""
    return max(1, int(round(n ** 0.5)))


class _PersistentMemory(torch.autograd.Function):
    """The chunks forward in one launch keeping the memory every ``r`` chunks; the backward, stretch by
    stretch from the last: the stretch's chunk-start states again (one forward launch, ``checkpoint_every
    =1``), then its chunks backward (one launch)."""

    @staticmethod
    def forward(ctx, spec, every, W1, W2, S1, S2, q, k, v, a, b, c, sa_last, sc_last):
        has_s = S1 is not None
        res = persistent_forward(spec, {"w1": W1, "w2": W2}, {"w1": S1, "w2": S2} if has_s else None, q, k, v,
                                 a, b, c, sa_last, sc_last, checkpoint_every=every)
        ck_W, ck_S = res.checkpoints
        ctx.spec, ctx.every, ctx.has_s = spec, every, has_s
        ctx.precision = torch.get_float32_matmul_precision()  # the backward's products as the forward's
        ctx.save_for_backward(q, k, v, a, c, *((b, sa_last, sc_last) if has_s else ()), ck_W["w1"], ck_W["w2"],
                              *((ck_S["w1"], ck_S["w2"]) if has_s else ()))
        if has_s:
            return res.y, res.weights["w1"], res.weights["w2"], res.momentum["w1"], res.momentum["w2"]
        return res.y, res.weights["w1"], res.weights["w2"]

    @staticmethod
    def backward(ctx, dy, *d_state):
        before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(ctx.precision)
        try:
            return _PersistentMemory._backward(ctx, dy, *d_state)
        finally:
            torch.set_float32_matmul_precision(before)

    @staticmethod
    def _backward(ctx, dy, *d_state):
        spec, every, has_s = ctx.spec, ctx.every, ctx.has_s
        saved = ctx.saved_tensors
        q, k, v, a, c = saved[:5]
        if has_s:
            b, sa_last, sc_last = saved[5:8]
            ck = saved[8:12]
        else:
            b = sa_last = sc_last = None
            ck = saved[5:7]
        n, G = q.shape[:2]
        def own(g, like):  # a float32 copy the kernel updates in place
            return (torch.zeros_like(like) if g is None else g.to(torch.float32).clone()).contiguous()

        dW = {"w1": own(d_state[0], ck[0][0]), "w2": own(d_state[1], ck[1][0])}
        dS = {"w1": own(d_state[2], ck[2][0]), "w2": own(d_state[3], ck[3][0])} if has_s else None
        dy = torch.zeros_like(q) if dy is None else dy
        grads = [torch.empty_like(t) for t in (q, k, v, a)] + [None if b is None else torch.empty_like(b),
                                                               torch.empty_like(c)]
        grads += [None, None] if not has_s else [torch.empty_like(sa_last), torch.empty_like(sc_last)]
        for s in reversed(range(-(-n // every))):
            lo, hi = s * every, min(n, (s + 1) * every)
            part = lambda x: None if x is None else x[lo:hi]  # noqa: E731
            W0 = {"w1": ck[0][s], "w2": ck[1][s]}
            S0 = {"w1": ck[2][s], "w2": ck[3][s]} if has_s else None
            inputs = [part(x) for x in (q, k, v, a, b, c, sa_last, sc_last)]
            states = persistent_forward(spec, W0, S0, *inputs, checkpoint_every=1, read=False).checkpoints
            got = persistent_backward(spec, states, *inputs, dy[lo:hi], dW, dS)
            for buf, g in zip(grads, got):
                if buf is not None:
                    buf[lo:hi] = g
        dq, dk, dv, da, db, dc, dsa, dsc = grads
        d_weights = (dW["w1"], dW["w2"]) + ((dS["w1"], dS["w2"]) if has_s else (None, None))
        return (None, None, *d_weights, dq, dk, dv, da, db, dc, dsa, dsc)


def persistent_memory(spec, W: dict[str, torch.Tensor], S: dict[str, torch.Tensor] | None, q: torch.Tensor,
                      k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None, c: torch.Tensor,
                      sa_last: torch.Tensor | None, sc_last: torch.Tensor | None, *,
                      checkpoint_every: int | None = None
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """:func:`persistent_forward` under autograd (arguments as there): the reads ``y (n, G, C, d)`` and the
    final weights and momenta, differentiable in every input. The forward keeps the memory entering every
    ``checkpoint_every``-th chunk (default about the square root of their number); the backward recomputes
    each stretch from it (:class:`_PersistentMemory`). Without the per-token clip."""
    n = q.shape[0]
    every = _spacing(n) if checkpoint_every is None else checkpoint_every
    has_s = S is not None
    out = _PersistentMemory.apply(spec, every, W["w1"], W["w2"], S["w1"] if has_s else None,
                                  S["w2"] if has_s else None, q, k, v, a, b, c, sa_last, sc_last)
    return out[0], {"w1": out[1], "w2": out[2]}, ({"w1": out[3], "w2": out[4]} if has_s else None)
