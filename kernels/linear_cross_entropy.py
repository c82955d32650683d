"""The language-model loss without the full logits: the LM head and the cross-entropy, chunk by chunk.

A causal LM's loss needs ``B x T x V`` logits, upcast to float32 by transformers'
``ForCausalLMLoss``: at a 131K vocabulary and 2,048 tokens that is 1 GiB, held from
the forward to the backward, several times the activations of the model itself.
:func:`linear_cross_entropy` computes the same loss over blocks of rows of the hidden
states: each block's logits are made, reduced to the block's loss, and dropped, so at
any time at most one block's logits exist. Every row's loss is computed by the same
operations as transformers' (float32 logits, ``F.cross_entropy``); only the order of
the sum over rows differs.

Two ways to the gradients:

- A plain ``nn.Linear`` head (the usual case, :func:`fuses_head`): each block's gradients with respect to
  its hidden rows and to the head's weight are made in the forward, from the block's
  logits while they exist (``softmax - onehot``, three products per block instead of the
  four of a recomputation), and the backward only scales them by the incoming gradient.
  The head's weight is read only while the forward runs, so sharding that gathers the
  weight for the forward and frees it after the backward of the unit holding it
  (FSDP2, which accelerate's FSDP2 groups with the final norm) sees the usual pattern.
- Any other head (PEFT's LoRA, ``modules_to_save``, a function): the head is called as a
  module, so whatever wraps it is respected, and the backward makes each block's logits
  again (``torch.utils.checkpoint``).

:func:`chunked_cross_entropy` is the same loss from logits that are already there
(evaluation, where the caller wants them): it upcasts one block at a time.

Semantics are exactly transformers' ``ForCausalLMLoss``: ``labels`` are shifted left
by one with ``ignore_index`` appended (or ``shift_labels`` given as they are), the
loss is the mean over positions whose label is not ``ignore_index``, or the sum
divided by ``num_items_in_batch`` when that is given (gradient accumulation).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["causal_targets", "chunked_cross_entropy", "fuses_head", "linear_cross_entropy", "rows_per_chunk"]

# Rows per block are chosen so that one block's float32 logits take about this many bytes: small beside
# the model's own activations, large enough that the per-block work (a few launches, the checkpoint's
# bookkeeping) stays small beside the head's products, which on a GPU takes blocks of thousands of rows.
CHUNK_BYTES = {"cpu": 64 * 2**20, "cuda": 512 * 2**20}


def rows_per_chunk(vocab_size: int, device: str | torch.device = "cpu", chunk_bytes: int | None = None) -> int:
    """Rows of a block whose float32 logits take about ``chunk_bytes`` (default: ``CHUNK_BYTES`` of the
    device type); at least 1, a multiple of 16 from 16."""
    if chunk_bytes is None:
        chunk_bytes = CHUNK_BYTES.get(torch.device(device).type, CHUNK_BYTES["cpu"])
    rows = max(1, chunk_bytes // (4 * max(1, vocab_size)))
    return rows if rows < 16 else rows - rows % 16


def causal_targets(labels: torch.Tensor | None, shift_labels: torch.Tensor | None = None,
                   ignore_index: int = -100) -> torch.Tensor:
    """The flat target of every position: ``labels`` shifted left by one, ``ignore_index`` at the end."""
    if shift_labels is None:
        if labels is None:
            raise ValueError("the loss needs labels or shift_labels")
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return shift_labels.reshape(-1)


def _divisor(targets: torch.Tensor, num_items_in_batch, ignore_index: int) -> torch.Tensor | int:
    # transformers: reduction "mean" over the kept positions, or "sum" / num_items_in_batch.
    if num_items_in_batch is None:
        return (targets != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        return num_items_in_batch.to(targets.device)
    return num_items_in_batch


def _block_loss(head: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor, targets: torch.Tensor,
                ignore_index: int) -> torch.Tensor:
    logits = head(rows).float()
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")


class _LinearCrossEntropy(torch.autograd.Function):
    """The reduced loss of a plain linear head over blocks of rows, its gradients made in the forward."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                ignore_index: int, chunk_rows: int, divisor: torch.Tensor | int) -> torch.Tensor:
        want_rows, want_weight, want_bias = ctx.needs_input_grad[:3]
        total = rows.new_zeros((), dtype=torch.float32)
        # d loss / d (a kept row's loss) in float32, as autograd forms it from the division below.
        scale = torch.ones((), dtype=torch.float32, device=rows.device) / divisor
        grad_rows = torch.empty_like(rows) if want_rows else None
        # Sums over blocks in float32 at least, as the weight's gradient accumulates in its own dtype.
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = torch.zeros_like(weight, dtype=acc) if want_weight else None
        grad_bias = torch.zeros_like(bias, dtype=acc) if want_bias else None
        weight_cast = None  # the weight in the logits' dtype, cast once for every block's input gradient
        for start in range(0, rows.shape[0], chunk_rows):
            block, block_targets = rows[start:start + chunk_rows], targets[start:start + chunk_rows]
            # The products run in the ambient autocast dtype, as the module call's would, and the gradient of
            # the logits goes back into their dtype before its products, as autograd's would.
            logits = F.linear(block, weight, bias)
            # The gradient of the block's float32 logits by the very operations autograd would run on them
            # (a graph of the block alone), so with an incoming gradient of one every bit is the same.
            with torch.enable_grad():
                logits32 = logits.detach().float().requires_grad_()
                block_loss = F.cross_entropy(logits32, block_targets, ignore_index=ignore_index, reduction="sum")
                (grad,) = torch.autograd.grad(block_loss, logits32, grad_outputs=scale)
            total = total + block_loss.detach()
            grad = grad.to(logits.dtype)
            del logits, logits32
            if want_rows:
                if weight_cast is None:
                    weight_cast = weight.to(grad.dtype)
                grad_rows[start:start + chunk_rows] = grad @ weight_cast
            if want_weight:
                grad_weight += (grad.t() @ block.to(grad.dtype)).to(acc)
            if want_bias:
                grad_bias += grad.sum(0).to(acc)
        ctx.save_for_backward(*(g for g in (grad_rows, grad_weight, grad_bias) if g is not None))
        ctx.present = (want_rows, want_weight, want_bias)
        ctx.dtypes = (rows.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return total / divisor

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        saved = iter(ctx.saved_tensors)
        grads = [(next(saved) * grad_loss).to(dtype) if present else None
                 for present, dtype in zip(ctx.present, ctx.dtypes)]
        return (*grads, None, None, None, None)


def fuses_head(head) -> bool:
    """Whether :func:`linear_cross_entropy` makes this head's gradients in the forward: a linear layer whose
    call is ``nn.Linear``'s own (FSDP2's sharded class is; PEFT's LoRA layers and quantised layers, which
    compute something else, are not) with its weight gathered (not an FSDP2 shard) when the loss runs."""
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        return False
    # FSDP2 holds a shard as a DTensor outside its unit's forward and backward; the gathered weight is plain.
    return not hasattr(head.weight, "placements")


def linear_cross_entropy(
    hidden_states: torch.Tensor,
    head: nn.Module | Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    *,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """``cross_entropy(head(hidden_states).float(), targets)`` without holding all the logits.

    Args:
        hidden_states: ``(..., hidden)``, one row per target.
        head: The LM head (any module or function from hidden rows to logits).
        targets: The flat targets, one per row (:func:`causal_targets` makes them from labels).
        num_items_in_batch: When given, the loss is the sum divided by it; else the mean over kept rows.
        ignore_index: Targets with this value add nothing.
        chunk_rows: Rows per block (default: :func:`rows_per_chunk` of the head's output width).

    Returns:
        The scalar loss (float32).
    """
    rows = hidden_states.reshape(-1, hidden_states.shape[-1])
    targets = targets.reshape(-1).to(rows.device)
    if targets.numel() != rows.shape[0]:
        raise ValueError(f"{targets.numel()} targets for {rows.shape[0]} positions of hidden states")
    if chunk_rows is None:
        width = getattr(head, "out_features", None) or getattr(getattr(head, "weight", None), "shape", (1,))[0]
        chunk_rows = rows_per_chunk(int(width), rows.device)
    params = head.parameters() if isinstance(head, nn.Module) else ()
    needs_grad = torch.is_grad_enabled() and (rows.requires_grad or any(p.requires_grad for p in params))
    if needs_grad and fuses_head(head):
        return _LinearCrossEntropy.apply(rows, head.weight, head.bias, targets, ignore_index, chunk_rows,
                                         _divisor(targets, num_items_in_batch, ignore_index))
    total = rows.new_zeros((), dtype=torch.float32)
    for start in range(0, rows.shape[0], chunk_rows):
        block, block_targets = rows[start:start + chunk_rows], targets[start:start + chunk_rows]
        if needs_grad:
            # Saves only the block of hidden rows; the backward makes the block's logits again.
            total = total + checkpoint(_block_loss, head, block, block_targets, ignore_index, use_reentrant=False)
        else:
            total = total + _block_loss(head, block, block_targets, ignore_index)
    return total / _divisor(targets, num_items_in_batch, ignore_index)


def chunked_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """``cross_entropy(logits.float(), targets)`` upcasting one block of rows at a time."""
    flat = logits.reshape(-1, logits.shape[-1])
    return linear_cross_entropy(flat, nn.Identity(), targets, num_items_in_batch=num_items_in_batch,
                                ignore_index=ignore_index,
                                chunk_rows=chunk_rows or rows_per_chunk(flat.shape[-1], flat.device))
