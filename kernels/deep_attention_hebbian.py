"""The Hebbian DeepTransformer memory over whole sequences, with attention kernels (FAMILIES.md §4).

:func:`~.deep_attention.chunk_deep_attention` takes this path for the training case of the
Hebbian rule (``memory_depth=2``, softmax weights, no initial state, every row full). Where the
general chunk loop materialises each chunk's weights over every earlier key (``O(T^2)`` memory),
this path splits the layer into

1. a **key pass**, chunk by chunk: the chunk's keys read the deep values ``U`` of all earlier
   chunks through one non-causal ``scaled_dot_product_attention`` call, ``A^(s)(k_i)``; the
   chunk's pairs then get ``u_i = e_i (W_1^(s)T v_i) * sigma'(A^(s)(k_i))`` (clipped) and
   ``W_1`` its rank-``C`` update (``e = eta gamma``). This recursion is sequential in chunks; it
   runs in :class:`_KeyPass`, whose backward walks the chunks in reverse through each read's own
   small graph, so nothing of size ``T^2`` is stored;
2. **one causal read** of every query over values ``[v | U]``: with the Hebbian rule the pairs
   of a token's own chunk hold their final ``U`` for every query at or after them, so the whole
   read is causal softmax attention (flash kernels on the GPU);
3. the chunk-local term of ``W_1(t) sigma(A_t(q_t))``: ``W_1`` at the chunk start plus the
   chunk's own rank-1 updates up to ``t``, a causal product within each chunk.

The per-chunk update of step 1 is :func:`chunk_update` here (PyTorch, the definition) and, on
the Triton backend (CUDA by default), a single kernel with a written-out backward
(:mod:`.deep_attention_triton`). On CUDA, and wherever Triton is asked for explicitly
(``use_backend("triton")``), the whole of step 1 runs as a wavefront of Triton launches instead,
its reads split into blocks per earlier chunk (:class:`_KeyPassTriton`,
:mod:`.deep_attention_key_pass_triton`), for the shapes :func:`triton_key_pass_wanted` admits.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .activations import gelu_derivative
from .backend import requested_backend, triton_available
from .norms import clip_scale

__all__ = ["chunk_update", "hebbian_deep_attention"]


def chunk_update(a: torch.Tensor, v: torch.Tensor, w1: torch.Tensor, e: torch.Tensor, clip: float | None):
    """One chunk's Hebbian write from its keys' reads ``a (..., C, h)`` of the earlier pairs.

    ``v (..., C, d_v)`` values, ``w1 (..., d_v, h)`` ``W_1`` at the chunk start, ``e (..., C)``
    the pairs' rates. Returns ``(u, sig, er, w1_next)``: the pairs' deep values
    ``u = e (W_1^T v) * sigma'(a)``, ``sig = sigma(a)``, ``er = e v`` (both ``u`` and ``er`` scaled
    by the pair's clip) and ``w1_next = w1 + er^T sig``.
    """
    sig = F.gelu(a)
    grad_u = (v @ w1) * gelu_derivative(a)
    rate = e[..., None]
    if clip is not None:
        rate = rate * clip_scale(grad_u.pow(2).sum(-1) + v.pow(2).sum(-1) * sig.pow(2).sum(-1), clip)[..., None]
    er = rate * v
    return rate * grad_u, sig, er, w1 + er.transpose(-1, -2) @ sig


def _update(a, v, w1, e, clip, out, u_read, tables: dict | None) -> None:
    """:func:`chunk_update` written into ``out = (u, sig, er, w1_next)`` (and ``u`` into ``u_read``):
    one Triton kernel when ``tables`` is given (it caches the kernel's stride tables by the layout
    of ``a``), PyTorch otherwise."""
    if tables is not None:
        from .deep_attention_triton import chunk_update_triton, stride_table

        extra = () if u_read is None else (u_read,)
        if a.stride() not in tables:
            tables[a.stride()] = stride_table(a, v, w1, e, *out, *extra)
        return chunk_update_triton(a, v, w1, e, clip, out, u_read, tables[a.stride()])
    for target, value in zip(out, chunk_update(a.to(v.dtype), v, w1, e, clip)):
        target.copy_(value)
    if u_read is not None:
        u_read.copy_(out[0])


def _update_backward(a, v, w1, e, clip, grads, out, tables: dict | None) -> None:
    """The gradients ``(da, dv, dw1, de)`` of :func:`chunk_update` for its outputs' ``grads``, into ``out``
    (Triton when ``tables`` is given, as :func:`_update`)."""
    if tables is not None:
        from .deep_attention_triton import chunk_update_backward_triton, stride_table

        if a.stride() not in tables:
            tables[a.stride()] = stride_table(a, v, w1, e, *grads)
        return chunk_update_backward_triton(a, v, w1, e, clip, grads, out, tables[a.stride()])
    with torch.enable_grad():
        inputs = [x.detach().requires_grad_() for x in (a.to(v.dtype), v, w1, e)]
        for target, value in zip(out, torch.autograd.grad(chunk_update(*inputs, clip), inputs, grads)):
            target.copy_(value)


def _read_earlier(kc: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax read of queries ``kc`` over all of ``keys``; 0 where there is no key."""
    if keys.shape[-2] == 0:
        return kc.new_zeros(*kc.shape[:-1], values.shape[-1])
    return F.scaled_dot_product_attention(kc, keys, values, scale=scale)


class _KeyPass(torch.autograd.Function):
    """Step 1 of the module docstring: the chunk recursion of the pairs' deep values and ``W_1``.

    Inputs ``k (B, H, T, d_k)``, ``v (B, H, T, d_v)``, ``e (B, H, T)``, ``w1 (B, H, d_v, h)``, all in
    the float compute dtype; the reads run in ``read_dtype`` (bf16 under autocast). Outputs
    ``u, sig (B, H, T, h)``, ``er (B, H, T, d_v)`` and ``w1s (N + 1, B, H, d_v, h)``, ``W_1`` at
    every chunk start and after the last chunk.

    With ``track``, each chunk's read keeps its own small autograd graph for the backward (the
    attention saves only its output and log-sum-exp; its inputs are views of the pass's buffers).
    Those views are taken with ``.data``: later chunks write further rows of the same buffers,
    which never changes the rows a read saw, and a shared version counter would reject that.
    """

    @staticmethod
    def forward(ctx, k, v, e, w1, chunk: int, scale: float, clip: float | None, read_dtype: torch.dtype,
                track: bool, triton: bool):
        B, H, T, _ = k.shape
        n_chunks = -(-T // chunk)
        keys = k.to(read_dtype)
        u = k.new_empty(B, H, T, w1.shape[-1])
        sig, er = torch.empty_like(u), torch.empty_like(v)
        u_read = u if read_dtype == u.dtype else torch.empty_like(u, dtype=read_dtype)
        w1s = w1.new_empty(n_chunks + 1, *w1.shape)
        w1s[0] = w1
        tables = {} if triton else None
        ctx.reads = []
        with torch.autocast(k.device.type, enabled=False):
            for n in range(n_chunks):
                lo, hi = n * chunk, min((n + 1) * chunk, T)
                with torch.set_grad_enabled(track and lo > 0):
                    leaves = [x.data.requires_grad_(track and lo > 0)
                              for x in (keys[:, :, lo:hi], keys[:, :, :lo], u_read[:, :, :lo])]
                    a = _read_earlier(*leaves, scale)
                ctx.reads.append((a, leaves))
                _update(a.detach(), v[:, :, lo:hi], w1s[n], e[:, :, lo:hi], clip,
                        (u[:, :, lo:hi], sig[:, :, lo:hi], er[:, :, lo:hi], w1s[n + 1]),
                        None if u_read is u else u_read[:, :, lo:hi], tables)
        ctx.save_for_backward(v, e, w1s)
        ctx.options = chunk, clip, triton, k.shape
        return u, sig, er, w1s

    @staticmethod
    def backward(ctx, du, dsig, der, dw1s):
        v, e, w1s = ctx.saved_tensors
        chunk, clip, triton, key_shape = ctx.options
        tables = {} if triton else None
        dk, dv, de = v.new_zeros(key_shape), torch.empty_like(v), torch.empty_like(e)
        # ``du`` gathers the later chunks' reads of each pair's value; the kernels need unit strides.
        du = du.clone(memory_format=torch.contiguous_format)
        dsig, der, dw1s = (x.contiguous() for x in (dsig, der, dw1s))
        dw1 = dw1s[-1]
        T = v.shape[2]
        with torch.autocast(v.device.type, enabled=False):
            for n in reversed(range(len(ctx.reads))):
                lo, hi = n * chunk, min((n + 1) * chunk, T)
                a, leaves = ctx.reads[n]
                da, dw1_n = torch.empty_like(a), torch.empty_like(dw1)
                _update_backward(a.detach(), v[:, :, lo:hi], w1s[n], e[:, :, lo:hi], clip,
                                 (du[:, :, lo:hi], dsig[:, :, lo:hi], der[:, :, lo:hi], dw1),
                                 (da, dv[:, :, lo:hi], dw1_n, de[:, :, lo:hi]), tables)
                dw1 = dw1_n.add_(dw1s[n])
                if lo == 0:
                    continue
                dkc, dkp, dup = torch.autograd.grad(a, leaves, da)
                dk[:, :, lo:hi] += dkc
                dk[:, :, :lo] += dkp
                du[:, :, :lo] += dup
        return dk, dv, de, dw1, None, None, None, None, None, None


class _KeyPassTriton(torch.autograd.Function):
    """:class:`_KeyPass` (same inputs and outputs, float32) through the wavefront kernels of
    :mod:`.deep_attention_key_pass_triton`, forward and backward."""

    @staticmethod
    def forward(ctx, k, v, e, w1, chunk: int, scale: float, clip: float | None, read_dtype: torch.dtype):
        from .deep_attention_key_pass_triton import key_pass_forward_triton  # noqa: PLC0415

        B, H, T, _ = k.shape
        flat = lambda x, dtype=torch.float32: x.to(dtype).reshape(B * H, *x.shape[2:]).contiguous()  # noqa: E731
        keys, v, e, w1 = flat(k, read_dtype), flat(v), flat(e), flat(w1)
        with torch.autocast(k.device.type, enabled=False):
            u, sig, er, w1s, u_read, a, lse = key_pass_forward_triton(keys, v, e, w1, chunk, scale, clip)
        ctx.save_for_backward(keys, v, e, w1s, u_read, a, lse)
        ctx.options = chunk, scale, clip, (B, H)
        heads = lambda x: x.unflatten(0, (B, H))  # noqa: E731
        return heads(u), heads(sig), heads(er), w1s.unflatten(1, (B, H))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, du, dsig, der, dw1s):
        from .deep_attention_key_pass_triton import key_pass_backward_triton  # noqa: PLC0415

        chunk, scale, clip, (B, H) = ctx.options
        flat = lambda x: x.flatten(0, 1)  # noqa: E731
        with torch.autocast(du.device.type, enabled=False):
            grads = key_pass_backward_triton(*ctx.saved_tensors, flat(du), flat(dsig), flat(der), dw1s.flatten(1, 2),
                                             chunk, scale, clip)
        return (*(x.unflatten(0, (B, H)) for x in grads), None, None, None, None)


def triton_key_pass_wanted(k: torch.Tensor, chunk: int, reads: torch.dtype, w1: torch.Tensor) -> bool:
    """Whether :func:`hebbian_deep_attention` runs its key pass through :class:`_KeyPassTriton`: on CUDA
    tensors when Triton imports, or wherever Triton is asked for (its interpreter on the CPU), never under
    ``use_backend("torch")``; for float32 recursions with reads in float32, bf16 or fp16, chunks a power
    of two from 16 to 128 and widths up to 128, chunk times width at most 8,192. Compiled for an H100
    (Triton 3.6), the backward's shared memory is 196 KB at 64 x 128 or 128 x 64 (float32 reads) and
    384 KB at 128 x 128, over the 227 KB an SM has. On an H100 the pass took the Hebbian depth-2 layer
    from 83.6 to 24.5 ms (forward + backward, 16 heads of 64, 16K tokens at T = 8192)."""
    asked = requested_backend()
    if not (asked == "triton" or (asked is None and k.is_cuda and triton_available())):
        return False
    width = max(k.shape[-1], *w1.shape[-2:])
    return (k.dtype == torch.float32 and reads in (torch.float32, torch.bfloat16, torch.float16)
            and 16 <= chunk <= 128 and chunk & (chunk - 1) == 0 and width <= 128 and chunk * width <= 8192)


def read_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of the attention reads for inputs like ``x``: autocast's where it is on, else ``x``'s
    own (a bf16 model reads in bf16, through flash kernels, while the recursion runs in float32)."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def hebbian_deep_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, e: torch.Tensor, w1: torch.Tensor,
                           *, chunk_size: int, scale: float, grad_clip: float | None, reads: torch.dtype,
                           triton: bool = False):
    """The Hebbian deep memory over full rows from an empty state.

    ``q, k (B, H, T, d_k)``, ``v (B, H, T, d_v)``, ``e (B, H, T)`` = ``eta gamma``, ``w1 (B, H, d_v, h)``,
    all float32 or wider but ``q``, which only the final read takes (in ``reads``: a query already in
    that dtype is not copied); attention reads run in ``reads``, the chunk updates in Triton with
    ``triton``. Returns ``o (B, H, T, d_v)`` and, for the state, ``u (B, H, T, h)`` and ``w1s``.
    """
    B, H, T, _ = q.shape
    C, dv = chunk_size, v.shape[-1]
    track = torch.is_grad_enabled() and any(x.requires_grad for x in (k, v, e, w1))
    if triton and triton_key_pass_wanted(k, C, reads, w1):
        u, sig, er, w1s = _KeyPassTriton.apply(k, v, e, w1, C, scale, grad_clip, reads)
    else:
        u, sig, er, w1s = _KeyPass.apply(k, v, e, w1, C, scale, grad_clip, reads, track, triton)
    with torch.autocast(q.device.type, enabled=False):
        read = F.scaled_dot_product_attention(q.to(reads), k.to(reads), torch.cat([v, u], -1).to(reads),
                                              is_causal=True, scale=scale).to(v.dtype)
        lin, s = read[..., :dv], F.gelu(read[..., dv:])
        n_chunks = w1s.shape[0] - 1
        pad = n_chunks * C - T

        def chunked(x):  # (B, H, N, C, .); a view where T fills the chunks (a pad is a copy each way)
            return (F.pad(x, (0, 0, 0, pad)) if pad else x).unflatten(2, (n_chunks, C))

        s_c, sig_c, er_c = chunked(s), chunked(sig), chunked(er)
        w1_start = w1s[:-1].permute(1, 2, 0, 3, 4)  # (B, H, N, d_v, h)
        mine = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        within = (s_c @ sig_c.transpose(-1, -2)).masked_fill(~mine, 0.0)
        deep = s_c @ w1_start.transpose(-1, -2) + within @ er_c
    return lin + deep.flatten(2, 3)[:, :, :T], u, w1s
