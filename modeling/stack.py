"""What every mnemo model shares around its blocks: masks, positions, the cache, the LM head.

A family's base model owns ``embed_tokens``, ``layers`` (blocks called as
``block(h, attention_mask=, key_valid=, positions=, past_key_values=) -> (h, aux)``)
and ``norm``; its causal LM owns ``model`` and ``lm_head``. The two functions
here are their ``forward`` bodies.
"""

from __future__ import annotations

import torch
from torch import nn

from .cache import MnemoCache
from .generation import check_attention_mask
from .outputs import MnemoCausalLMOutput, MnemoModelOutput


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
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids and inputs_embeds")
    if inputs_embeds is None:
        inputs_embeds = model.embed_tokens(input_ids)
    use_cache = use_cache if use_cache is not None else (config.use_cache and not model.training)
    if getattr(model, "gradient_checkpointing", False) and model.training:
        use_cache = False
    if output_hidden_states is None:
        output_hidden_states = config.output_hidden_states
    if use_cache and past_key_values is None:
        past_key_values = MnemoCache(config.num_hidden_layers)
    cache = past_key_values if use_cache else None

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
    if cache is not None:
        for layer_cache in cache:
            layer_cache.seen_tokens += T
    return MnemoModelOutput(
        last_hidden_state=hidden_states,
        past_key_values=cache,
        hidden_states=all_hidden,
        aux_loss=torch.stack(aux_losses).mean() if aux_losses else None,
    )


def causal_lm_forward(
    lm: nn.Module,
    outputs: MnemoModelOutput,
    labels: torch.LongTensor | None,
    logits_to_keep: int | torch.Tensor,
    aux_loss_coef: float,
    **loss_kwargs,
) -> MnemoCausalLMOutput:
    """Logits of the kept positions; LM loss plus ``aux_loss_coef * aux_loss`` when labels are given."""
    hidden_states = outputs.last_hidden_state
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    logits = lm.lm_head(hidden_states[:, keep, :])
    loss = None
    if labels is not None:
        loss = lm.loss_function(logits, labels, lm.config.vocab_size, **loss_kwargs)
        if outputs.aux_loss is not None and aux_loss_coef > 0:
            loss = loss + aux_loss_coef * outputs.aux_loss.to(loss.device)
    return MnemoCausalLMOutput(
        loss=loss,
        logits=logits,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        aux_loss=outputs.aux_loss,
    )
