"""What every mnemo model shares around its blocks: masks, positions, the cache, the LM head.

A family's base model owns ``embed_tokens``, ``layers`` (blocks called as
``block(h, attention_mask=, key_valid=, positions=, past_key_values=) -> (h, aux)``)
and ``norm``; its causal LM owns ``model`` and ``lm_head``. The two functions
here are their ``forward`` bodies.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.chunk_loop import loop_options
from ..kernels.linear_cross_entropy import causal_targets, chunked_cross_entropy, linear_cross_entropy
from .cache import MnemoCache, as_mnemo_cache
from .generation import check_attention_mask
from .outputs import MnemoCausalLMOutput, MnemoModelOutput, cache_field


class PackedDocuments:
    """Rows that hold several documents, marked as transformers' packing collators do: ``position_ids``
    restart at 0 where a document starts. :meth:`unpack` lays every document out as its own
    right-padded row; :meth:`repack` puts per-token outputs back."""

    def __init__(self, position_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        B, T = position_ids.shape
        valid = attention_mask.bool() if attention_mask is not None else torch.ones_like(position_ids, dtype=torch.bool)
        starts = (position_ids == 0) | (torch.arange(T, device=position_ids.device) == 0)[None]
        doc = starts.flatten().long().cumsum(0) - 1  # document of every token, row-major
        n_docs = int(doc[-1]) + 1
        first = torch.zeros(n_docs, dtype=torch.long, device=doc.device).scatter_reduce(
            0, doc, torch.arange(B * T, device=doc.device), reduce="amin", include_self=False)
        local = torch.arange(B * T, device=doc.device) - first[doc]
        length = int(local.max()) + 1
        self.shape = (B, T)
        self.index = doc * length + local  # each token's slot in the (n_docs, length) layout
        self.layout = (n_docs, length)
        self.mask = torch.zeros(n_docs * length, dtype=torch.long, device=doc.device).index_copy(
            0, self.index, valid.flatten().long()).view(n_docs, length)
        self.positions = torch.zeros(n_docs * length, dtype=torch.long, device=doc.device).index_copy(
            0, self.index, position_ids.flatten()).view(n_docs, length)

    @classmethod
    def detect(cls, position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None):
        if position_ids is None or position_ids.dim() != 2 or position_ids.shape[1] < 2:
            return None
        if not bool((position_ids[:, 1:] == 0).any()):
            return None
        return cls(position_ids, attention_mask)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(self.shape[0] * self.shape[1], *x.shape[2:])
        out = flat.new_zeros(self.layout[0] * self.layout[1], *x.shape[2:]).index_copy(0, self.index, flat)
        return out.view(*self.layout, *x.shape[2:])

    def repack(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(self.layout[0] * self.layout[1], *x.shape[2:])
        return flat.index_select(0, self.index).view(*self.shape, *x.shape[2:])


def decoder_forward(
    model: nn.Module,
    input_ids: torch.LongTensor | None,
    attention_mask: torch.Tensor | None,
    past_key_values: MnemoCache | None,
    inputs_embeds: torch.FloatTensor | None,
    position_ids: torch.LongTensor | None,
    use_cache: bool | None,
    output_hidden_states: bool | None,
) -> MnemoModelOutput:
    """Embed, run the blocks over the cache, normalise; the aux loss is the mean over blocks that report one."""
    config = model.config
    past_key_values = as_mnemo_cache(past_key_values, config.num_hidden_layers)
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids and inputs_embeds")
    if inputs_embeds is None:
        inputs_embeds = model.embed_tokens(input_ids)
    use_cache = use_cache if use_cache is not None else (config.use_cache and not model.training)
    if getattr(model, "gradient_checkpointing", False) and model.training:
        use_cache = False
    if output_hidden_states is None:
        output_hidden_states = config.output_hidden_states
    packing = PackedDocuments.detect(position_ids, attention_mask)
    if packing is not None and past_key_values is not None and past_key_values.get_seq_length() > 0:
        raise ValueError("position_ids restart inside a row (packed documents), which cannot continue a cache")
    if packing is not None:
        use_cache = False  # several documents per row leave no single state to continue
    if use_cache and past_key_values is None:
        past_key_values = MnemoCache(config.num_hidden_layers)
    cache = past_key_values if use_cache else None

    if packing is not None:
        # several documents per row: run them as rows of their own, so no state crosses a boundary
        inputs_embeds, attention_mask, position_ids = packing.unpack(inputs_embeds), packing.mask, packing.positions
    B, T, _ = inputs_embeds.shape
    past = cache.get_seq_length() if cache is not None else 0
    check_attention_mask(attention_mask, B, past + T)
    if attention_mask is not None and bool(attention_mask.bool().all()):
        attention_mask = None  # no padding: take the unmasked fast paths
    new_mask = attention_mask[:, -T:] if attention_mask is not None else None
    if position_ids is None:
        # Positions count each row's own tokens, so a left-padded row sees the positions it would alone.
        if attention_mask is not None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
        else:
            position_ids = torch.arange(past, past + T, device=inputs_embeds.device).expand(B, T)

    hidden_states = inputs_embeds
    all_hidden = (hidden_states,) if output_hidden_states else None
    aux_losses = []
    # Every block's chunk loop keeps its carries until the backward: their spacing is chosen for all of them.
    # Under activation checkpointing a block keeps nothing from its forward and its backward re-runs it
    # outside this context, one block at a time: its loops are spaced as one layer's, in both runs, so that
    # the re-run keeps the tensors the checkpoint expects.
    checkpointed = getattr(model, "gradient_checkpointing", False) and model.training
    with loop_options(layers=1 if checkpointed else len(model.layers)):
        for i, block in enumerate(model.layers):
            hidden_states, aux = block(
                hidden_states,
                attention_mask=new_mask,
                key_valid=attention_mask,
                positions=position_ids,
                past_key_values=cache[i] if cache is not None else None,
            )
            if aux is not None:
                aux_losses.append(aux)
            if output_hidden_states:
                all_hidden += (hidden_states,)
    hidden_states = model.norm(hidden_states)
    if output_hidden_states:
        all_hidden = all_hidden[:-1] + (hidden_states,)
    if packing is not None:
        hidden_states = packing.repack(hidden_states)
        all_hidden = tuple(packing.repack(h) for h in all_hidden) if output_hidden_states else None
    if cache is not None:
        for layer_cache in cache:
            layer_cache.seen_tokens += T
    return MnemoModelOutput(
        last_hidden_state=hidden_states,
        **cache_field(cache),
        hidden_states=all_hidden,
        aux_loss=torch.stack(aux_losses).mean() if aux_losses else None,
    )


def _default_loss(lm: nn.Module) -> bool:
    """Whether ``lm`` computes transformers' own causal-LM loss (not one a user or ``loss_type`` put in)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return getattr(lm.loss_function, "__wrapped__", lm.loss_function) is ForCausalLMLoss


def causal_lm_forward(
    lm: nn.Module,
    outputs: MnemoModelOutput,
    labels: torch.LongTensor | None,
    logits_to_keep: int | torch.Tensor,
    aux_loss_coef: float,
    return_logits: bool | None = None,
    **loss_kwargs,
) -> MnemoCausalLMOutput:
    """Logits of the kept positions; LM loss plus ``aux_loss_coef * aux_loss`` when labels are given.

    With labels (or ``shift_labels``) and every position kept, the loss is transformers' causal-LM loss
    computed without the full float32 logits (``kernels/linear_cross_entropy.py``). In training (``train()``
    mode, gradients recorded) the logits are then not made at all and ``logits`` is ``None`` unless
    ``return_logits=True``; otherwise (evaluation) they are returned unless ``return_logits=False``, and the
    loss upcasts them one block at a time. A model whose
    ``loss_function`` is not transformers' default keeps computing its loss from the full logits.
    """
    hidden_states = outputs.last_hidden_state
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    wants_loss = labels is not None or loss_kwargs.get("shift_labels") is not None
    fused = wants_loss and isinstance(logits_to_keep, int) and logits_to_keep == 0 and _default_loss(lm)
    if return_logits is None:
        return_logits = not (fused and lm.training and torch.is_grad_enabled())
    logits = lm.lm_head(hidden_states[:, keep, :]) if return_logits or not fused else None
    loss = None
    if fused:
        ignore_index = loss_kwargs.get("ignore_index", -100)
        targets = causal_targets(labels, loss_kwargs.get("shift_labels"), ignore_index)
        reduce = {"num_items_in_batch": loss_kwargs.get("num_items_in_batch"), "ignore_index": ignore_index}
        if logits is not None:
            loss = chunked_cross_entropy(logits, targets, **reduce)
        else:
            loss = linear_cross_entropy(hidden_states, lm.lm_head, targets, **reduce)
    elif wants_loss:
        loss = lm.loss_function(logits, labels, lm.config.vocab_size, **loss_kwargs)
    if loss is not None and outputs.aux_loss is not None and aux_loss_coef > 0:
        loss = loss + aux_loss_coef * outputs.aux_loss.to(loss.device)
    return MnemoCausalLMOutput(
        loss=loss,
        logits=logits,
        **cache_field(outputs.cache),
        hidden_states=outputs.hidden_states,
        aux_loss=outputs.aux_loss,
    )
