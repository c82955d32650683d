"""The shape every mnemo family shares: a decoder stack and a causal LM around it.

A family defines its config, its block (``block(h, attention_mask=, key_valid=,
positions=, past_key_values=) -> (h, aux)``) and its ``PreTrainedModel`` with
``_init_weights``; these mixins add the embedding, the stack, the final norm,
the LM head and ``forward``/``generate`` (see :mod:`.stack`), and make every saved
folder load where mnemo is not installed (:mod:`.hub_files`).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from transformers import PreTrainedModel
from transformers import initialization as init

from .attention import RotaryEmbedding
from .cache import MnemoCache
from .gates import GateProjection
from .checkpoint_files import explain_unreadable_weights
from .generation import MnemoGenerationMixin, graphed_decode_step
from .hub_files import push_folder, write_hub_files
from .normalization import RMSNorm
from .short_conv import ShortConvolution
from .outputs import MnemoCausalLMOutput, MnemoModelOutput, cache_field, resolve_cache_kwarg
from .stack import causal_lm_forward, decoder_forward


def init_shared_weights(module: nn.Module, std: float) -> bool:
    """Initialise the module types every family shares; ``True`` if ``module`` was one of them.

    transformers' ``initialization`` functions skip tensors loaded from a checkpoint.
    """
    if isinstance(module, GateProjection):
        init.normal_(module.weight, mean=0.0, std=std)
        init.constant_(module.bias, module.bias_init)
    elif isinstance(module, ShortConvolution):
        bound = module.kernel_size[0] ** -0.5
        init.uniform_(module.weight, -bound, bound)
    elif isinstance(module, (nn.Linear, nn.Embedding)):
        init.normal_(module.weight, mean=0.0, std=std)
        if getattr(module, "bias", None) is not None:
            init.zeros_(module.bias)
    elif isinstance(module, RMSNorm):
        init.ones_(module.weight)
    elif isinstance(module, RotaryEmbedding):
        # a non-persistent buffer: rebuilt after loading, never read from a checkpoint
        init.copy_(module.inv_freq, module.compute_inv_freq(module.inv_freq.device))
    else:
        return False
    return True


class MnemoDecoderMixin:
    """``embed_tokens -> layers -> norm``; a subclass sets ``block_class``."""

    block_class: type[nn.Module]

    def __init__(self, config) -> None:
        config.validate_fields()  # a config may have been edited since it was built
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(self.block_class(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: MnemoCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        cache: MnemoCache | None = None,
        **kwargs,
    ) -> MnemoModelOutput | tuple:
        """``cache`` and ``past_key_values`` are the same argument (transformers' new and old names)."""
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        out = decoder_forward(
            self, input_ids, attention_mask, resolve_cache_kwarg(cache, past_key_values), inputs_embeds,
            position_ids, use_cache, output_hidden_states,
        )
        return out if return_dict else out.to_tuple()


class MnemoCausalLMMixin(MnemoGenerationMixin):
    """A base model (``base_model_class``) and a linear LM head; ``generate()`` on the mnemo cache.

    Families list ``MnemoGenerationMixin`` again among their bases, before their
    ``PreTrainedModel``: transformers' ``can_generate()`` looks for it in the direct
    bases, and ``_is_stateful`` must win over ``PreTrainedModel``'s default.
    """

    base_model_class: type[nn.Module]
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config) -> None:
        super().__init__(config)
        self.model = self.base_model_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' ``from_pretrained``; a truncated or corrupt weights file is named in the error."""
        try:
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except Exception as error:
            explained = explain_unreadable_weights(error, pretrained_model_name_or_path, kwargs)
            if explained is None:
                raise
            raise explained from error

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        is_main_process: bool = True,
        state_dict: dict | None = None,
        push_to_hub: bool = False,
        model_card_source: str | None = None,
        **kwargs: Any,
    ) -> None:
        """transformers' ``save_pretrained``, writing a folder that also loads where mnemo is not installed.

        Besides the config and the safetensors weights, the folder gets an ``auto_map`` in
        ``config.json``, the modelling code generated from mnemo's source, and a model card
        (``README.md``, unless the folder holds one that mnemo did not write); it loads with
        ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` without mnemo
        (see :func:`.hub_files.write_hub_files`). Saving again into the same folder (Trainer's
        checkpoints, a new save) replaces these files, as transformers replaces the weights.
        ``repo_id`` names the repository in the card (and, with ``push_to_hub=True``, the
        repository to upload to); ``model_card_source`` is the provenance the card states.
        """
        hub = {name: kwargs.pop(name) for name in ("repo_id", "commit_message", "create_pr", "private", "revision",
                                                   "commit_description", "tags") if name in kwargs}
        super().save_pretrained(save_directory, is_main_process=is_main_process, state_dict=state_dict, **kwargs)
        folder = Path(save_directory)
        if (not self.should_save_on_this_rank(is_main_process) or getattr(self, "_hf_peft_config_loaded", False)
                or not (folder / "config.json").is_file()):
            return  # another rank saves, or transformers saved an adapter alone
        write_hub_files(self, folder, repo_id=hub.get("repo_id"), source=model_card_source)
        if push_to_hub:
            push_folder(folder, hub.pop("repo_id", folder.absolute().name), token=kwargs.get("token"), **hub)

    def push_to_hub(
        self,
        repo_id: str,
        *,
        commit_message: str | None = None,
        commit_description: str | None = None,
        private: bool | None = None,
        token: bool | str | None = None,
        revision: str | None = None,
        create_pr: bool = False,
        max_shard_size: int | str | None = "50GB",
        tags: list[str] | None = None,
    ) -> Any:
        """transformers' ``push_to_hub``: what ``save_pretrained`` writes (code, weights, card) goes to ``repo_id``.

        A README the repository already has stays, as transformers keeps it; otherwise mnemo's card
        is uploaded. Returns the commit's ``CommitInfo``.
        """
        tags = [*(self.model_tags or []), *([tags] if isinstance(tags, str) else tags or [])]
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / repo_id.rsplit("/", 1)[-1]
            self.save_pretrained(folder, max_shard_size=max_shard_size, repo_id=repo_id)
            return push_folder(folder, repo_id, token=token, private=private, commit_message=commit_message,
                               commit_description=commit_description, revision=revision, create_pr=create_pr,
                               tags=tags or None)

    if not hasattr(PreTrainedModel, "activation_checkpointing_enable"):
        # transformers 5.24 renamed gradient checkpointing to activation checkpointing (the old names warn);
        # these let code written for the new names run on the older versions mnemo supports.
        def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict | None = None, **kwargs):
            """Activation (gradient) checkpointing on every block; transformers' name since 5.24."""
            self.gradient_checkpointing_enable(gradient_checkpointing_kwargs=activation_checkpointing_kwargs,
                                               **kwargs)

        def activation_checkpointing_disable(self) -> None:
            """Activation checkpointing off; transformers' name since 5.24."""
            self.gradient_checkpointing_disable()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: MnemoCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        cache: MnemoCache | None = None,
        **kwargs,
    ) -> MnemoCausalLMOutput | tuple:
        """With ``labels``, ``loss`` is the LM loss plus ``aux_loss_coef * aux_loss`` where the family has one.
        ``cache`` and ``past_key_values`` are the same argument (transformers' new and old names)."""
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        cache = resolve_cache_kwarg(cache, past_key_values)
        logits = graphed_decode_step(self, input_ids, cache, inputs_embeds, labels, output_hidden_states)
        if logits is not None:  # generate(cuda_graph=True): the step replayed, the cache advanced in place
            out = MnemoCausalLMOutput(logits=logits, **cache_field(cache))
            return out if return_dict else out.to_tuple()
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            cache=cache,
            inputs_embeds=inputs_embeds,
            position_ids=position_ids,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            return_dict=True,
        )
        aux_coef = getattr(self.config, "aux_loss_coef", 0.0)
        out = causal_lm_forward(self, outputs, labels, logits_to_keep, aux_coef, **kwargs)
        return out if return_dict else out.to_tuple()
