"""Top-k routing of tokens to memories and the packed layout it induces (MoM).

Every (memory, batch row) pair is one sequence of a packed variable-length batch:
the tokens routed to that memory, in their original order. Packed entries are
sorted by ``(memory, row, time)``, so each memory's entries are one contiguous
slice (its projections run on that slice only) and the memory kernels see plain
``cu_seqlens``. Padded tokens are routed nowhere: they write no state, decay no
state and enter no conv window.

Planning reads nothing back to the host when every token is valid: the layout
stays on the device (each memory's slice is ``memory_ends``), so the host is not
held up waiting for the GPU mid-forward. A host read happens only where a caller
asks for the slices as numbers (:meth:`RoutingPlan.memory_slices`) and to drop
padded tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from ..kernels.token_slots import slot_sum


@dataclass
class RoutingPlan:
    token_index: torch.Tensor  # (P,) flat index b * T + t of each packed entry
    weight: torch.Tensor  # (P,) float32 combine weight (routing weight, 1 for the shared memory)
    cu_seqlens: torch.Tensor  # (M * B + 1,) offsets; sequence s = m * B + b
    sequence: torch.Tensor  # (P,) the sequence of each packed entry
    aux_loss: torch.Tensor  # Switch-style load-balancing loss of this layer
    slot_entries: torch.Tensor  # (B * T, slots) packed entry of each token's slot; P where the token is padding
    batch_size: int  # B: sequence s = m * B + b, so memory m owns sequences m * B ... (m + 1) * B - 1

    @property
    def memory_ends(self) -> torch.Tensor:
        """``(M,)`` int32, on the device: the end of each memory's packed rows (its slice starts where the
        previous one ends). A fresh tensor of unit stride: ``torch._grouped_mm`` takes it as offsets, and
        torch 2.14 rejects any other stride ("Offsets must have stride (1,)"), even that of one memory's
        slice, which ``contiguous()`` leaves as it is."""
        ends = self.cu_seqlens[self.batch_size::self.batch_size]
        return ends.to(torch.int32, memory_format=torch.contiguous_format, copy=True)

    def memory_slices(self) -> list[tuple[int, int]]:
        """Packed rows ``[start, end)`` of each memory, on the host (one device-to-host read)."""
        bounds = [0] + self.memory_ends.tolist()
        return list(zip(bounds[:-1], bounds[1:]))

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Rows ``token_index`` of ``x`` ``(B * T, ...)``: every token once per memory it visits."""
        return _GatherTokens.apply(x, self.token_index, self.slot_entries)

    def combine(self, y: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """The inverse of :meth:`gather` up to the sum: ``(P, ...)`` -> ``(B * T, ...)``, each token the
        sum of its entries scaled by ``weight`` ``(P,)`` (default 1; zero for padding), in float32 at least."""
        dtype = torch.promote_types(y.dtype, torch.float32)
        weight = y.new_ones(y.shape[0], dtype=dtype) if weight is None else weight
        out = slot_sum(y.flatten(1), self.slot_entries, weight, self.token_index, dtype)
        return out.view((self.slot_entries.shape[0],) + y.shape[1:])


class _GatherTokens(torch.autograd.Function):
    """``index_select`` whose backward adds each token's copies through ``slot_entries``
    (a gather per token, summed in float32) instead of a scatter-add: no atomics, which
    are slow for bf16 and make the sum's order (and its rounding) nondeterministic."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, slot_entries: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(slot_entries)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (slot_entries,) = ctx.saved_tensors
        shape = (slot_entries.shape[0],) + grad.shape[1:]
        return slot_sum(grad.flatten(1), slot_entries).view(shape), None, None


def top_memories(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router probabilities ``(..., E)`` and the ``topk`` memories of each token with weights summing to 1."""
    probs = F.softmax(logits.float(), dim=-1)
    weight, memory = probs.topk(topk, dim=-1)
    return probs, weight / weight.sum(-1, keepdim=True), memory


def balance_loss(probs: torch.Tensor, memory: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Switch-style load balance over valid tokens, ``E * sum_m f_m P_m`` (no device-to-host reads)."""
    E, topk = probs.shape[-1], memory.shape[-1]
    n_valid = valid.sum().clamp(min=1)
    # A comparison, not F.one_hot: on the CPU one_hot reads the indices' range back to check it.
    chosen = memory[..., None] == torch.arange(E, device=memory.device)
    slot_counts = (chosen.float() * valid[..., None, None]).flatten(0, -2).sum(0)
    fraction = slot_counts / (n_valid * topk)
    mean_prob = (probs * valid[..., None]).flatten(0, -2).sum(0) / n_valid
    return E * (fraction * mean_prob).sum()


def route(
    logits: torch.Tensor,
    topk: int,
    valid: torch.Tensor | None,
    shared_memory: bool,
) -> RoutingPlan:
    """Plan the packed layout for router ``logits`` ``(B, T, E)``; ``valid`` ``(B, T)`` bool or ``None``."""
    B, T, E = logits.shape
    device = logits.device
    probs, weight, memory = top_memories(logits, topk)
    every_token = valid is None
    if every_token:
        valid = torch.ones(B, T, dtype=torch.bool, device=device)

    aux_loss = balance_loss(probs, memory, valid)

    if shared_memory:
        memory = torch.cat([memory, memory.new_full((B, T, 1), E)], dim=-1)
        weight = torch.cat([weight, weight.new_ones(B, T, 1)], dim=-1)
    num_memories = E + int(shared_memory)
    slots = memory.shape[-1]
    token = torch.arange(B * T, device=device).view(B, T, 1).expand(B, T, slots)
    # (token, slot) entry of each kept item; with padding, one host read selects all three
    entries = B * T * slots
    kept_entry = (torch.arange(entries, device=device) if every_token
                  else valid[..., None].expand(B, T, slots).reshape(-1).nonzero().squeeze(1))
    memory, weight, token = (t.reshape(-1).index_select(0, kept_entry) for t in (memory, weight, token))
    sequence = memory * B + token // T
    order = torch.argsort(sequence * T + token % T)
    sequence = sequence[order]
    slot_entries = torch.full((entries,), order.numel(), dtype=torch.long, device=device)
    slot_entries[kept_entry[order]] = torch.arange(order.numel(), device=device)
    # ``sequence`` is sorted: each sequence's first entry is a search away (bincount would read the host)
    cu_seqlens = torch.searchsorted(sequence, torch.arange(num_memories * B + 1, device=device))
    return RoutingPlan(
        token_index=token[order],
        weight=weight[order],
        cu_seqlens=cu_seqlens,
        sequence=sequence,
        aux_loss=aux_loss,
        slot_entries=slot_entries.view(B * T, slots),
        batch_size=B,
    )
