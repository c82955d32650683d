"""One inner chunk of a deep memory as one autograd function with a hand-written backward.

:class:`~.titans.ChunkOperator` gives every token of a chunk its online weights
``M_t = a_t W + b_t S + sum_k c_tk A_k B_k^T`` and :func:`~.mlp_memory.memory_apply`
reads them; autograd over that code is exact but pays for it in weight-sized
passes. Every use of a weight (three matmuls for ``W1``, two for ``W2``, the
chunk's final update) gets its own weight-sized gradient, summed afterwards, and
every gate that scales a weight gets its gradient by a weight-sized product and a
sum. On the benchmark shape (4 heads x 256, MLP x4, 16K tokens) those passes, not
the matmuls, were most of the layer's time.

Here the backward is written out once:

- a weight's gradient is one matmul over the stacked ``(left, right)`` factors of
  all its uses, added to the chunk's final-update term in the matmul's epilogue;
- a gate that scales a weight gets its gradient as an inner product of two
  weight-sized tensors (a matmul of flattened views: no weight-sized temporary);
- everything else is ``(chunk, width)``-sized.

Scope: memories of depth 1 (``M(z) = W z``) and depth 2 (``z + W1 gelu(W2 z)``, gated
``z + W1 (gelu(W2 z) * W3 z)``, or ``W0 z + ...`` with a linear skip), objectives ``l2`` and
``dot``, with or without the per-token gradient clip, gradients taken at the weights the chunk
starts from. :class:`~.mlp_memory.ChunkOperator` under autograd stays the readable definition
these functions are tested against; the chunk loops run it instead where a chunk resumes rows
from stored chunk-start weights, and everywhere under ``comparison_paths(chunk_backward=
"autograd")``. The Triton hidden-layer slices (:mod:`.titans_triton_forward`,
:mod:`.titans_triton_backward`) take the ungated MLP with an identity skip; every other memory
reads through cuBLAS products here, its weight-sized final update and that update's backward in
Triton on the Triton backend.

Shapes: weights ``(B, H, d_out, d_in)``; ``q (B, H, C, d_k)``; ``k, v (B, H, K, .)``
(the ``K`` tokens whose gradients the chunk writes: ``K = C`` for Titans, the
Omega window for Atlas); coefficients ``a, b (B, H, C)``, ``c (B, H, C, K)``,
``sa_last (B, H)``, ``sc_last (B, H, K)``.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .activations import gelu_derivative
from .backend import ComparisonPaths, current_paths, resolve_backend
from .mlp_memory import MLPMemorySpec, raw_grad_factors
from .norms import clip_rank_one

__all__ = ["AUTOGRAD_PATH", "chunk_memory", "wanted"]

# What runs without kernels where :func:`wanted` says no, for the error of an explicit request for Triton.
AUTOGRAD_PATH = "under autograd over the chunk operator (comparison_paths(chunk_backward='autograd'))"


def wanted() -> bool:
    """Whether the chunk loops run their memories through :func:`chunk_memory` (which covers every
    MLP memory): unless :func:`~.backend.comparison_paths` asks for autograd over
    :class:`~.mlp_memory.ChunkOperator` (the same values; kept to compare the two)."""
    return current_paths().chunk_backward != "autograd"


def chunk_memory(spec: MLPMemorySpec, W: dict[str, torch.Tensor], S: dict[str, torch.Tensor] | None,
                 q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None,
                 c: torch.Tensor, sa_last: torch.Tensor | None, sc_last: torch.Tensor | None
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """The chunk's reads ``y (B, H, C, d_v)`` and its final weights and momenta (``S``: ``None`` without
    momentum, then ``b, sa_last, sc_last`` are ignored).

    Final values: ``W' = a_C W + b_C S + sum_k c_Ck A_k B_k^T``, ``S' = sa_last S + sum_k sc_last_k A_k B_k^T``.
    """
    names = list(spec.shapes)
    momentum = S is not None
    gates = (a, b, c, sa_last, sc_last) if momentum else (a, c)
    # The memory computes in its own precision (float32 state; TF32 products where the caller allows):
    # autocast stays out of it, in the backward too.
    with torch.autocast(q.device.type, enabled=False):
        out = _ChunkMemory.apply(spec, momentum, len(names), *(W[n] for n in names),
                                 *((S[n] for n in names) if momentum else ()), q, k, v, *gates)
    m = len(names)
    y, W_new = out[0], dict(zip(names, out[1:1 + m]))
    S_new = dict(zip(names, out[1 + m:1 + 2 * m])) if momentum else None
    return y, W_new, S_new


# --------------------------------------------------------------------------- pieces


def _gelu_second_derivative(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * x * x) * (0.3989422804014327 * (2.0 - x * x))


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-1, -2)


def _rowdot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x * y).sum(-1)


def _inner(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``<x, y>`` over the last two dimensions."""
    return (x * y).sum((-1, -2))


def _stacked_product(pairs: list[tuple[torch.Tensor, torch.Tensor]], base: torch.Tensor | None) -> torch.Tensor:
    """``base + sum_i L_i^T R_i`` as one matmul over the stacked rows of every pair, ``base`` in its epilogue."""
    left = torch.cat([l for l, _ in pairs], -2) if len(pairs) > 1 else pairs[0][0]
    right = torch.cat([r for _, r in pairs], -2) if len(pairs) > 1 else pairs[0][1]
    lead = left.shape[:-2]
    L, R = _t(left).reshape(-1, left.shape[-1], left.shape[-2]), right.reshape(-1, *right.shape[-2:])
    if base is None:
        return torch.bmm(L, R).view(*lead, L.shape[-2], R.shape[-1])
    return torch.baddbmm(base.reshape(-1, *base.shape[-2:]), L, R).view(base.shape)


def _final_update_torch(W, S, a, b, sa, U_w, U_s, Bf):
    """``W' = a W + b S + U_w^T B``, ``S' = sa S + U_s^T B`` (see :func:`~.titans_triton_update.final_update`)."""
    base = a[..., None, None] * W
    if S is None:
        return _stacked_product([(U_w, Bf)], base), None
    base = torch.addcmul(base, b[..., None, None], S)
    return _stacked_product([(U_w, Bf)], base), _stacked_product([(U_s, Bf)], sa[..., None, None] * S)


def _final_update_backward_torch(W, S, dW_new, dS_new, a, b, sa, uses_w, uses_s):
    """See :func:`~.titans_triton_update.final_update_backward`."""
    base = a[..., None, None] * dW_new
    dW = _stacked_product(uses_w, base) if uses_w else base
    if S is None:
        return dW, None, _inner(dW_new, W), None, None
    base = torch.addcmul(sa[..., None, None] * dS_new, b[..., None, None], dW_new)
    dS = _stacked_product(uses_s, base) if uses_s else base
    return dW, dS, _inner(dW_new, W), _inner(dW_new, S), _inner(dS_new, S)


def _final_update_fns(like: torch.Tensor):
    """The final update and its backward: Triton kernels for float32 memories on CUDA (see
    :mod:`.titans_triton_update`)."""
    if resolve_backend(like, has_triton_impl=like.dtype == torch.float32) == "triton":
        from .titans_triton_update import final_update, final_update_backward

        return final_update, final_update_backward
    return _final_update_torch, _final_update_backward_torch


def _read(x, W, S, A, Bf, a, b, c):
    """``out_t = a_t x_t W^T + b_t x_t S^T + sum_k c_tk <x_t, B_k> A_k``: one weight's online read.

    Returns ``out`` and the products its backward needs."""
    xW, xB = x @ _t(W), x @ _t(Bf)  # (C, d_out), (C, K)
    out = a[..., None] * xW + (c * xB) @ A
    xS = None
    if S is not None:
        xS = x @ _t(S)
        out = out + b[..., None] * xS
    return out, (xW, xS, xB)


def _read_backward(g, name, d_out, x, W, S, A, Bf, a, b, c, saved):
    """Adds the read's gate gradients and weight uses into ``g``; returns ``(d x, d A, d B)``."""
    xW, xS, xB = saved
    g.a = g.a + _rowdot(d_out, xW)
    ad = a[..., None] * d_out
    dM = d_out @ _t(A)  # (C, K)
    g.c = g.c + dM * xB
    dMc = dM * c
    dx = ad @ W + dMc @ Bf
    g.uses["W", name].append((ad, x))
    if S is not None:
        g.b = g.b + _rowdot(d_out, xS)
        bd = b[..., None] * d_out
        dx = dx + bd @ S
        g.uses["S", name].append((bd, x))
    return dx, _t(c * xB) @ d_out, _t(dMc) @ x


class _Grads:
    """Gradient accumulators of one backward: the gates and each weight's uses ``(left, right)``."""

    def __init__(self, a, c, names):
        self.a = torch.zeros_like(a)
        self.b = torch.zeros_like(a)
        self.c = torch.zeros_like(c)
        self.uses = {(group, n): [] for group in ("W", "S") for n in names}


def _factors(spec, W, k, v):
    """The gradient factors ``{name: (A, B)}`` at ``W`` (the same definition as every other path) and
    the intermediates their backward needs."""
    inner: dict = {}
    return raw_grad_factors(spec, W, k, v, keep=inner), inner


def _unpack(spec, momentum, m, tensors):
    names = list(spec.shapes)
    W = dict(zip(names, tensors[:m]))
    S = dict(zip(names, tensors[m:2 * m])) if momentum else None
    rest = tensors[2 * m:] if momentum else tensors[m:]
    q, k, v = rest[:3]
    if momentum:
        a, b, c, sa_last, sc_last = rest[3:]
    else:
        (a, c), b, sa_last, sc_last = rest[3:], None, None, None
    return names, W, S, q, k, v, a, b, c, sa_last, sc_last


def _clip_backward(spec, raw_A, factors, dA, dB):
    """Gradients of the unclipped factors from those of the clipped ones: the clip's scale is a
    function of ``(K,)``-sized norms, so autograd over :func:`~.norms.clip_rank_one` is cheap."""
    names = list(raw_A)
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for n in names for t in (raw_A[n], factors[n][1])]
        clipped = clip_rank_one({n: (leaves[2 * i], leaves[2 * i + 1]) for i, n in enumerate(names)}, spec.grad_clip)
        outputs = [t for n in names for t in clipped[n]]
        grads = torch.autograd.grad(outputs, leaves, [g for n in names for g in (dA[n], dB[n])])
    return {n: grads[2 * i] for i, n in enumerate(names)}, {n: grads[2 * i + 1] for i, n in enumerate(names)}


def _inputs_of_reads(spec, q, hidden):
    """Which input each weight's read takes: ``q``, or the hidden layer for ``w1``."""
    return {n: (hidden if n == "w1" else q) for n in spec.shapes}


def _sliced_forward_wanted(spec, q, k) -> bool:
    """Whether the chunk's forward runs as the hidden-layer slices of :mod:`.titans_triton_forward`:
    on the Triton backend, for the memories and chunk sizes it covers (``comparison_paths(chunk_forward=
    "torch")`` keeps the cuBLAS forward, to compare the two)."""
    if current_paths().chunk_forward == "torch" or q.dtype != torch.float32:
        return False
    # The backend first: the covers rule is the kernels' own.
    if resolve_backend(q, has_triton_impl=True) != "triton":
        return False
    from .titans_triton_forward import covers

    return covers(spec, q.shape[-2], k.shape[-2])


def _merge_heads(x: torch.Tensor | None) -> torch.Tensor | None:
    """``(B, H, ...)`` as ``(B * H, ...)``: the sliced kernels' ``G`` rows."""
    return None if x is None else x.flatten(0, 1)


def _merge_heads_of(tensors: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    return None if tensors is None else {n: x.flatten(0, 1) for n, x in tensors.items()}


def _split_heads(x: torch.Tensor | None, lead: torch.Size) -> torch.Tensor | None:
    """``(B * H, ...)`` back to ``lead + (...)``."""
    return None if x is None else x.view(*lead, *x.shape[1:])


def _sliced_backward_wanted(k: torch.Tensor, momentum: bool, paths: ComparisonPaths) -> bool:
    """Whether a chunk whose forward ran sliced also runs its backward sliced: where its launches fit
    (:func:`~.titans_triton_backward.covers`), unless ``comparison_paths(chunk_backward="torch")`` takes
    the written-out PyTorch backward instead (to compare the two). Elsewhere the PyTorch backward takes
    the sliced forward's intermediates."""
    if paths.chunk_backward == "torch":
        return False
    from .titans_triton_backward import covers

    return covers(k.shape[-2], momentum)


def _from_parts(spec, parts, lead, k):
    """The factors, intermediates and read products of the backward from the sliced forward's
    :class:`~.titans_triton_forward.ForwardParts` (``(G, ...)``, viewed as ``lead + ...``)."""
    view = lambda x: _split_heads(x, lead)  # noqa: E731
    pre, back, e, err, scale = map(view, (parts.pre, parts.back, parts.e, parts.err, parts.scale))
    act = F.gelu(pre)
    clipped = spec.grad_clip is not None
    factors = {"w1": (err * scale[..., None] if clipped else err, act),
               "w2": (e * scale[..., None] if clipped else e, k)}
    inner = dict(pre=pre, back=back, slope=gelu_derivative(pre), hidden_pre=view(parts.hidden_pre),
                 hidden=view(parts.hidden))
    if clipped:
        inner["raw"] = {"w1": err, "w2": e}
    saved = {"w2": (view(parts.qw), view(parts.qs), view(parts.qk)),
             "w1": (view(parts.hw), view(parts.hs), view(parts.p))}
    return factors, inner, saved


class _ChunkMemory(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec, momentum, m, *tensors):
        names, W, S, q, k, v, a, b, c, sa_last, sc_last = _unpack(spec, momentum, m, tensors)
        # The backward takes the path chosen with the forward, wherever it runs.
        ctx.spec, ctx.momentum, ctx.m, ctx.paths = spec, momentum, m, current_paths()
        ctx.save_for_backward(*tensors)
        if _sliced_forward_wanted(spec, q, k):
            from .titans_triton_forward import chunk_forward

            lead = ctx.lead = q.shape[:2]
            y, W_new, S_new, ctx.parts = chunk_forward(
                spec, _merge_heads_of(W), _merge_heads_of(S),
                *map(_merge_heads, (q, k, v, a, b, c, sa_last, sc_last)))
            out = [W_new[n] for n in names] + ([S_new[n] for n in names] if momentum else [])
            return tuple(_split_heads(t, lead) for t in (y, *out))
        ctx.parts = None
        factors, inner = _factors(spec, W, k, v)
        if spec.grad_clip is not None:
            inner["raw"] = {n: A for n, (A, _) in factors.items()}
            factors = clip_rank_one(factors, spec.grad_clip)
        Sn = (lambda n: S[n]) if momentum else (lambda _n: None)
        saved = {}
        if spec.depth == 1:
            y, saved["w"] = _read(q, W["w"], Sn("w"), *factors["w"], a, b, c)
        else:
            hidden_pre, saved["w2"] = _read(q, W["w2"], Sn("w2"), *factors["w2"], a, b, c)
            hidden = F.gelu(hidden_pre)
            if spec.gated:
                gate_pre, saved["w3"] = _read(q, W["w3"], Sn("w3"), *factors["w3"], a, b, c)
                inner.update(read_act=hidden, gate_pre=gate_pre)
                hidden = hidden * gate_pre
            y, saved["w1"] = _read(hidden, W["w1"], Sn("w1"), *factors["w1"], a, b, c)
            if spec.linear_skip:
                skip, saved["w0"] = _read(q, W["w0"], Sn("w0"), *factors["w0"], a, b, c)
                y = y + skip
            else:
                y = y + q
            inner.update(hidden_pre=hidden_pre, hidden=hidden)

        a_last, c_last = a[..., -1], c[..., -1, :]
        b_last = b[..., -1] if momentum else None
        update, _ = _final_update_fns(q)
        W_new, S_new = [], []
        for n in names:
            A, Bf = factors[n]
            W_n, S_n = update(W[n], Sn(n), a_last, b_last, sa_last, A * c_last[..., None],
                              A * sc_last[..., None] if momentum else None, Bf)
            W_new.append(W_n)
            if momentum:
                S_new.append(S_n)

        # Intermediates only ride on ctx (no input or output: those are saved tensors).
        ctx.factors = {n: (A, None if Bf is k else Bf) for n, (A, Bf) in factors.items()}
        ctx.inner, ctx.saved = inner, saved
        return (y, *W_new, *S_new)

    @staticmethod
    def backward(ctx, d_y, *d_new):
        with torch.autocast(d_y.device.type, enabled=False):
            return _ChunkMemory._backward(ctx, d_y, *d_new)

    @staticmethod
    def _backward(ctx, d_y, *d_new):
        spec, momentum, m = ctx.spec, ctx.momentum, ctx.m
        names, W, S, q, k, v, a, b, c, sa_last, sc_last = _unpack(spec, momentum, m, ctx.saved_tensors)
        if ctx.parts is not None and _sliced_backward_wanted(k, momentum, ctx.paths):
            return _ChunkMemory._sliced_backward(ctx, names, W, S, q, k, a, b, c, sa_last, sc_last, d_y, d_new)
        if ctx.parts is not None:
            factors, inner, saved = _from_parts(spec, ctx.parts, ctx.lead, k)
        else:
            factors = {n: (A, k if Bf is None else Bf) for n, (A, Bf) in ctx.factors.items()}
            inner, saved = ctx.inner, ctx.saved
        Sn = (lambda n: S[n]) if momentum else (lambda _n: None)
        dW_new = dict(zip(names, d_new[:m]))
        dS_new = dict(zip(names, d_new[m:2 * m])) if momentum else None
        g = _Grads(a, c, names)
        dA: dict[str, torch.Tensor] = {}
        dB: dict[str, torch.Tensor] = {}

        def add(store, n, x):
            store[n] = x if n not in store else store[n] + x

        # The final update W' = a_C W + b_C S + sum_k c_Ck A_k B_k^T, S' = sa S + sum_k sc_k A_k B_k^T.
        a_last, c_last = a[..., -1], c[..., -1, :]
        d_c_last, d_sc = torch.zeros_like(c_last), torch.zeros_like(c_last)
        for n in names:
            A, Bf = factors[n]
            BdW = Bf @ _t(dW_new[n])  # (K, d_out)
            d_c_last = d_c_last + _rowdot(A, BdW)
            add(dA, n, c_last[..., None] * BdW)
            add(dB, n, (A * c_last[..., None]) @ dW_new[n])
            if momentum:
                BdS = Bf @ _t(dS_new[n])
                d_sc = d_sc + _rowdot(A, BdS)
                add(dA, n, sc_last[..., None] * BdS)
                add(dB, n, (A * sc_last[..., None]) @ dS_new[n])

        # The reads, last layer first.
        x_of = _inputs_of_reads(spec, q, inner.get("hidden"))

        def back(n, d_out):
            dx, dA_r, dB_r = _read_backward(g, n, d_out, x_of[n], W[n], Sn(n), *factors[n], a, b, c, saved[n])
            add(dA, n, dA_r)
            add(dB, n, dB_r)
            return dx

        if spec.depth == 1:
            dq = back("w", d_y)
        else:
            d_hidden = back("w1", d_y)
            dq = back("w0", d_y) if spec.linear_skip else d_y
            if spec.gated:  # hidden = gelu(pre) * gate
                dq = dq + back("w3", d_hidden * inner["read_act"])
                d_hidden = d_hidden * inner["gate_pre"]
            dq = dq + back("w2", d_hidden * gelu_derivative(inner["hidden_pre"]))

        if spec.grad_clip is not None:
            dA, dB = _clip_backward(spec, inner["raw"], factors, dA, dB)

        # The gradient factors, taken at W (the chunk-start weights).
        if spec.depth == 1:
            d_err, dk = dA["w"], dB["w"]
            if spec.objective == "l2":
                d_pred = 2 * d_err
                dk = dk + d_pred @ W["w"]
                g.uses["W", "w"].append((d_pred, k))
        else:
            err = inner["raw"]["w1"] if spec.grad_clip is not None else factors["w1"][0]
            act = factors["w1"][1]  # the keys' hidden layer (gated: gelu(pre) * gate)
            pre, back_, slope = inner["pre"], inner["back"], inner["slope"]
            if spec.gated:
                # A_w2 = back * gate * gelu'(pre), A_w3 = back * gelu(pre), hidden = gelu(pre) * gate
                gate, gelu_pre = inner["gate"], inner["act"]
                d_back = dA["w2"] * gate * slope + dA["w3"] * gelu_pre
                d_pre = dA["w2"] * back_ * gate * _gelu_second_derivative(pre)
                d_gelu = dA["w3"] * back_
                d_gate = dA["w2"] * back_ * slope
            else:
                d_back = dA["w2"] * slope
                d_pre = dA["w2"] * back_ * _gelu_second_derivative(pre)
            d_err = dA["w1"] + d_back @ _t(W["w1"])
            g.uses["W", "w1"].append((err, d_back))
            d_act = dB["w1"]
            dk = dB["w2"]
            if spec.linear_skip:
                d_err = d_err + dA["w0"]
                dk = dk + dB["w0"]
            if spec.objective == "l2":
                d_pred = 2 * d_err
                d_act = d_act + d_pred @ W["w1"]
                g.uses["W", "w1"].append((d_pred, act))
                if spec.linear_skip:
                    dk = dk + d_pred @ W["w0"]
                    g.uses["W", "w0"].append((d_pred, k))
                else:
                    dk = dk + d_pred
            if spec.gated:
                d_gelu = d_gelu + d_act * gate
                d_gate = d_gate + d_act * gelu_pre
                dk = dk + dB["w3"] + d_gate @ W["w3"]
                g.uses["W", "w3"].append((d_gate, k))
                d_act = d_gelu
            d_pre = d_pre + d_act * slope
            dk = dk + d_pre @ W["w2"]
            g.uses["W", "w2"].append((d_pre, k))
        dv = -2 * d_err if spec.objective == "l2" else -d_err

        # The weights: the final update's term plus every use, in one product each; the gates that
        # scale whole weights get their inner products in the same pass.
        _, update_backward = _final_update_fns(q)
        b_last = b[..., -1] if momentum else None
        d_a_last, d_b_last, d_sa = torch.zeros_like(a_last), torch.zeros_like(a_last), torch.zeros_like(a_last)
        dW, dS = [], []
        for n in names:
            dW_n, dS_n, da_n, db_n, dsa_n = update_backward(
                W[n], Sn(n), dW_new[n], dS_new[n] if momentum else None, a_last, b_last, sa_last,
                g.uses["W", n], g.uses["S", n])
            dW.append(dW_n)
            d_a_last = d_a_last + da_n
            if momentum:
                dS.append(dS_n)
                d_b_last, d_sa = d_b_last + db_n, d_sa + dsa_n

        da, dc = g.a, g.c
        da[..., -1] += d_a_last
        dc[..., -1, :] += d_c_last
        if momentum:
            db = g.b
            db[..., -1] += d_b_last
            d_gates = (da, db, dc, d_sa, d_sc)
        else:
            d_gates = (da, dc)
        return (None, None, None, *dW, *dS, dq, dk, dv, *d_gates)

    @staticmethod
    def _sliced_backward(ctx, names, W, S, q, k, a, b, c, sa_last, sc_last, d_y, d_new):
        """The backward of the sliced forward as its own Triton launches (:mod:`.titans_triton_backward`)."""
        from .titans_triton_backward import chunk_backward

        spec, momentum, m, lead = ctx.spec, ctx.momentum, ctx.m, ctx.lead
        dW_new = _merge_heads_of(dict(zip(names, d_new[:m])))
        dS_new = _merge_heads_of(dict(zip(names, d_new[m:2 * m]))) if momentum else None
        dW, dS, dq, dk, dv, da, db, dc, dsa, dsc = chunk_backward(
            spec, _merge_heads_of(W), _merge_heads_of(S), *map(_merge_heads, (q, k, a, b, c, sa_last, sc_last)),
            ctx.parts, _merge_heads(d_y), dW_new, dS_new)
        weights = [dW[n] for n in names] + ([dS[n] for n in names] if momentum else [])
        d_gates = (da, db, dc, dsa, dsc) if momentum else (da, dc)
        return (None, None, None, *(_split_heads(t, lead) for t in (*weights, dq, dk, dv, *d_gates)))
