"""Import Llama checkpoints as DeepTransformers (docs/semantics.md).

A DeepTransformer with ``memory_depth=1`` is a Llama Transformer with the same
parameter names, so a Llama checkpoint converts by mapping its config and
loading its tensors as they are. :func:`llama_config_to_deep_transformer` maps
the config and refuses, with the option and its value named, every Llama
setting the DeepTransformer does not reproduce exactly (scaled RoPE, biases, a
free head width, other activations, tensor-parallel slicing, unknown options).
:func:`convert_from_llama` reads the weights through the shared checkpoint
helpers (safetensors unless pickles are allowed, missing and unexpected tensors
named, output staged so a failure leaves nothing behind) and writes a
``DeepTransformerForCausalLM`` folder. ``memory_depth=2`` adds a freshly
initialised deep branch to fine-tune from the Transformer.
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..configuration.configuration_deep_transformer import DeepTransformerConfig
from ..modeling.attention import RotaryEmbedding
from ..modeling.modeling_deep_transformer import DeepTransformerForCausalLM
from .checkpoint_io import (
    ConversionError,
    check_state_dict_keys,
    copy_tokenizer_files,
    load_state_dict,
    read_config,
    staged_output,
)

__all__ = ["DEEP_OPTIONS", "convert_from_llama", "llama_config_to_deep_transformer"]

# The DeepTransformerConfig fields that a Llama checkpoint does not determine: the deep branch.
DEEP_OPTIONS = ("learning_rule", "memory_hidden", "omega_window", "inner_chunk_size", "normalize", "memory_init_std")

# What LlamaConfig assumes for a field its config.json leaves out.
_LLAMA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "max_position_embeddings": 2048,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "use_cache": True,
    "pad_token_id": None,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
}

# Llama field -> DeepTransformerConfig field, copied as they are.
_MAPPED = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_hidden_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads",
    "max_position_embeddings": "max_position_embeddings",
    "initializer_range": "initializer_range",
    "rms_norm_eps": "norm_eps",
    "use_cache": "use_cache",
    "pad_token_id": "pad_token_id",
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "tie_word_embeddings": "tie_word_embeddings",
}

# Fields checked (or derived) by the functions below rather than copied.
_CHECKED = {
    "model_type", "num_key_value_heads", "head_dim", "hidden_act", "rope_theta", "rope_parameters", "rope_scaling",
    "attention_bias", "mlp_bias", "attention_dropout", "pretraining_tp",
}

# Bookkeeping, output switches and the generic PretrainedConfig fields (of transformers 4 and 5) that Llama's
# causal LM never reads: they change neither the weights nor what the model computes.
_METADATA = {
    "_name_or_path", "architectures", "transformers_version", "dtype", "torch_dtype", "use_bfloat16",
    "output_attentions", "output_hidden_states", "return_dict", "chunk_size_feed_forward", "id2label",
    "label2id", "problem_type", "tokenizer_class", "prefix", "finetuning_task", "task_specific_params",
    "torchscript", "_from_model_config", "is_encoder_decoder", "is_decoder", "add_cross_attention",
    "cross_attention_hidden_size", "tie_encoder_decoder", "pruned_heads", "tf_legacy_loss", "sep_token_id",
    "decoder_start_token_id",
}

_ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}


def _refusal(option: str, value: Any, why: str) -> ConversionError:
    return ConversionError(f"cannot convert this Llama checkpoint: {option}={value!r}: {why}")


def _generation_keys() -> set[str]:
    # transformers 4 wrote generation defaults into config.json; they only steer generate()
    from transformers import GenerationConfig

    return set(GenerationConfig().to_dict())


def _check_known_options(llama_config: Mapping[str, Any]) -> None:
    known = set(_MAPPED) | _CHECKED | _METADATA | _generation_keys()
    unknown = sorted(set(llama_config) - known)
    if unknown:
        named = ", ".join(f"{option}={llama_config[option]!r}" for option in unknown)
        raise ConversionError(
            f"cannot convert this Llama checkpoint: {named}: not a Llama option this converter knows, so it "
            "cannot tell whether the DeepTransformer reproduces it (remove it from config.json if it does not "
            "change the model)"
        )


def _check_equal(llama_config: Mapping[str, Any], option: str, allowed: tuple, why: str) -> None:
    value = llama_config.get(option, allowed[0])
    if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
        raise _refusal(option, value, why)


def _check_rope_dict(option: str, params: Any) -> None:
    if not isinstance(params, Mapping):
        raise _refusal(option, params, "expected a dict of RoPE parameters")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise _refusal(f"{option}.rope_type", rope_type,
                       "only the default RoPE is reproduced; scaled RoPE (linear, dynamic, yarn, longrope, "
                       "llama3, ...) is not")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise _refusal(f"{option}.partial_rotary_factor", params["partial_rotary_factor"],
                       "the DeepTransformer rotates the whole head")
    for key in sorted(set(params) - _ROPE_KEYS):
        raise _refusal(f"{option}.{key}", params[key], "a RoPE parameter the default RoPE does not have")


def _rope_theta(llama_config: Mapping[str, Any]) -> float:
    """RoPE's base, read where transformers reads it: ``rope_scaling``, then ``rope_parameters``, then the
    top-level ``rope_theta`` (transformers 4 layout)."""
    for option in ("rope_parameters", "rope_scaling"):
        if llama_config.get(option) is not None:
            _check_rope_dict(option, llama_config[option])
    params = llama_config.get("rope_scaling") or llama_config.get("rope_parameters") or {}
    theta = params.get("rope_theta", llama_config.get("rope_theta", _LLAMA_DEFAULTS["rope_theta"]))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise _refusal("rope_theta", theta, "must be a positive number")
    return float(theta)


def _check_architecture(llama_config: Mapping[str, Any]) -> None:
    model_type = llama_config.get("model_type")
    if model_type != "llama":
        raise _refusal("model_type", model_type, "only Llama checkpoints (model_type 'llama') are converted here")
    _check_known_options(llama_config)
    _check_equal(llama_config, "attention_bias", (False,), "the DeepTransformer's q/k/v/o projections have no bias")
    _check_equal(llama_config, "mlp_bias", (False,), "the DeepTransformer's SwiGLU projections have no bias")
    _check_equal(llama_config, "hidden_act", ("silu", "swish"), "the DeepTransformer's MLP is SwiGLU (silu)")
    _check_equal(llama_config, "pretraining_tp", (1, None),
                 "tensor-parallel slicing of the projections is not reproduced")
    _check_equal(llama_config, "attention_dropout", (0.0, 0, None),
                 "the DeepTransformer has no attention dropout, so fine-tuning would differ")
    hidden = llama_config.get("hidden_size", _LLAMA_DEFAULTS["hidden_size"])
    heads = llama_config.get("num_attention_heads", _LLAMA_DEFAULTS["num_attention_heads"])
    head_dim = llama_config.get("head_dim")
    if head_dim is not None and (heads * head_dim != hidden):
        raise _refusal("head_dim", head_dim,
                       f"the DeepTransformer's head width is hidden_size // num_attention_heads "
                       f"({hidden} // {heads}); a different head width cannot be expressed")


def _check_overrides(overrides: Mapping[str, Any]) -> None:
    allowed = ("memory_depth", *DEEP_OPTIONS)
    for name in sorted(set(overrides) - set(allowed)):
        raise ConversionError(
            f"{name}={overrides[name]!r}: not an option of the conversion; the Llama checkpoint fixes every "
            f"other field (allowed: {', '.join(allowed)})"
        )
    deep = sorted(set(overrides) & set(DEEP_OPTIONS))
    if overrides.get("memory_depth", 1) == 1 and deep:
        raise ConversionError(
            f"{deep[0]}={overrides[deep[0]]!r}: a deep-branch option needs memory_depth=2; with memory_depth=1 "
            "the result is exactly the Llama Transformer"
        )


def llama_config_to_deep_transformer(llama_config: Mapping[str, Any], **overrides: Any) -> DeepTransformerConfig:
    """The :class:`DeepTransformerConfig` that computes what a Llama config does.

    Args:
        llama_config: A Llama ``config.json`` as a dict (transformers 4 or 5 layout).
        overrides: ``memory_depth`` (default 1: exactly the Transformer) and, with
            ``memory_depth=2``, the deep-branch options in :data:`DEEP_OPTIONS`.

    Every Llama field is mapped (``rms_norm_eps`` -> ``norm_eps``, RoPE's base from
    ``rope_parameters`` / ``rope_scaling`` / ``rope_theta``, ``num_key_value_heads``
    for GQA, ``tie_word_embeddings``, token ids, ...) or checked; a setting the
    DeepTransformer does not reproduce, or an option this function does not know,
    raises :class:`ConversionError` naming the option and its value.
    """
    _check_architecture(llama_config)
    _check_overrides(overrides)
    fields = {ours: llama_config.get(theirs, _LLAMA_DEFAULTS[theirs]) for theirs, ours in _MAPPED.items()}
    kv_heads = llama_config.get("num_key_value_heads")
    fields["num_key_value_heads"] = fields["num_attention_heads"] if kv_heads is None else kv_heads
    fields["hidden_act"] = "silu"
    fields["rope_theta"] = _rope_theta(llama_config)
    fields["memory_depth"] = 1
    fields.update(overrides)
    try:
        return DeepTransformerConfig(**fields)
    except ValueError as error:
        raise ConversionError(f"cannot convert this Llama checkpoint: {error}") from error


# --------------------------------------------------------------------------- weights


def _meta_model(config: DeepTransformerConfig) -> DeepTransformerForCausalLM:
    # names and shapes only: no memory, no initialisation cost
    with torch.device("meta"):
        return DeepTransformerForCausalLM(config)


def _transformer_config(config: DeepTransformerConfig) -> DeepTransformerConfig:
    plain = copy.deepcopy(config)
    plain.memory_depth, plain.learning_rule, plain.omega_window, plain.normalize = 1, "hebbian", 1, True
    return plain


def _deep_branch_keys(config: DeepTransformerConfig) -> set[str]:
    """The tensors of a DeepTransformer that a Transformer of the same shape lacks (none at depth 1)."""
    ours = set(_meta_model(config).state_dict())
    return ours - set(_meta_model(_transformer_config(config)).state_dict())


def _drop_rotary_buffers(state: dict[str, torch.Tensor], config: DeepTransformerConfig) -> None:
    """Older Llama checkpoints store RoPE's ``inv_freq``; the DeepTransformer recomputes it from ``rope_theta``,
    so a stored one is dropped once it is shown to hold the same frequencies (a different one means a RoPE
    variant the config does not describe)."""
    expected = RotaryEmbedding(config.head_dim, config.rope_theta).inv_freq
    for name in sorted(k for k in state if k.endswith("rotary_emb.inv_freq")):
        stored = state.pop(name)
        tolerance = 4 * torch.finfo(stored.dtype).eps if stored.is_floating_point() else 0.0
        if stored.shape != expected.shape or not torch.allclose(
            stored.float(), expected, rtol=max(tolerance, 1e-6), atol=0.0
        ):
            raise ConversionError(
                f"cannot convert this Llama checkpoint: {name} holds RoPE frequencies that differ from those of "
                f"rope_theta={config.rope_theta} (a scaled RoPE?)"
            )


def _drop_tied_head(state: dict[str, torch.Tensor], config: DeepTransformerConfig) -> None:
    """A tied checkpoint usually omits ``lm_head.weight``; one that stores it must store the embedding."""
    if not config.tie_word_embeddings or "lm_head.weight" not in state:
        return
    head = state.pop("lm_head.weight")
    embed = state.get("model.embed_tokens.weight")
    if embed is not None and not torch.equal(head, embed):
        raise _refusal("tie_word_embeddings", True,
                       "the checkpoint's lm_head.weight differs from model.embed_tokens.weight, so tying them "
                       "would change the logits")


def _check_shapes(state: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor]) -> None:
    wrong = [
        f"{name} {tuple(tensor.shape)} (the config gives {tuple(target[name].shape)})"
        for name, tensor in sorted(state.items())
        if tuple(tensor.shape) != tuple(target[name].shape)
    ]
    if wrong:
        raise ConversionError("the Llama checkpoint's tensors do not fit its config: " + ", ".join(wrong))


def _source_state(src: Path, config: DeepTransformerConfig, allow_pickle: bool) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, exactly those the DeepTransformer takes from a Llama, with their shapes checked."""
    state = load_state_dict(src, allow_pickle=allow_pickle)
    _drop_rotary_buffers(state, config)
    _drop_tied_head(state, config)
    target = _meta_model(config).state_dict()
    expected = set(target) - _deep_branch_keys(config)
    if config.tie_word_embeddings:
        expected -= set(DeepTransformerForCausalLM._tied_weights_keys)
    check_state_dict_keys(state, expected, f"Llama checkpoint {src}")
    _check_shapes(state, target)
    return state


def _weights_dtype(state: Mapping[str, torch.Tensor]) -> torch.dtype:
    """The checkpoint's dtype; where it mixes several, the smallest that holds them all exactly."""
    dtypes = {tensor.dtype for tensor in state.values() if tensor.is_floating_point()}
    return functools.reduce(torch.promote_types, sorted(dtypes, key=str)) if dtypes else torch.float32


def _load_model(config: DeepTransformerConfig, state: dict[str, torch.Tensor]) -> DeepTransformerForCausalLM:
    """The model with the checkpoint's tensors; the deep branch (if any) from the model's own initialisation."""
    # from_pretrained builds on the meta device and initialises only the tensors the state dict lacks
    model, info = DeepTransformerForCausalLM.from_pretrained(
        None, config=config, state_dict=state, dtype=_weights_dtype(state), output_loading_info=True
    )
    missing, new = set(info["missing_keys"]), _deep_branch_keys(config)
    if missing != new or info["unexpected_keys"] or info["mismatched_keys"] or info.get("error_msgs"):
        raise ConversionError(f"loading the converted weights went wrong: {info}")
    return model


def _generation_config(src: Path, config: DeepTransformerConfig):
    from transformers import GenerationConfig

    if (src / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(src)
    return GenerationConfig.from_model_config(config)


def convert_from_llama(
    src_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    allow_pickle: bool = False,
    memory_depth: int = 1,
    **deep_options: Any,
) -> Path:
    """Convert a Llama checkpoint folder into a ``DeepTransformerForCausalLM`` checkpoint folder.

    Args:
        src_dir: A folder with ``config.json`` (``model_type="llama"``) and the weights:
            ``model.safetensors`` or safetensors shards with their index (pickled
            ``pytorch_model.bin`` files only with ``allow_pickle=True``).
        out_dir: The folder to write; it must not exist or be empty. It receives the
            model (``save_pretrained``, safetensors, in the checkpoint's dtype),
            ``generation_config.json`` (the source's, else one from the config) and
            the tokenizer files the source has.
        allow_pickle: Read pickled weights (with ``torch.load(weights_only=True)``).
        memory_depth: 1 (default): the result is exactly the Llama Transformer, every
            tensor taken from the source, and its logits equal the Llama model's.
            2: "ready to fine-tune": the deep branch is added (options in
            :data:`DEEP_OPTIONS`, e.g. ``learning_rule``, ``memory_hidden``).
        deep_options: Deep-branch options; only with ``memory_depth=2``.

    With ``memory_depth=2`` the deep-branch tensors (per layer ``self_attn.eta_proj``,
    ``self_attn.memory_w1``, and ``self_attn.gamma_proj`` for the omega rule) are the
    only ones not taken from the source; they get the model's own initialisation
    (``eta_proj`` normal with ``initializer_range``, ``memory_w1`` normal with
    ``memory_init_std``). The branch is then on from the first token: ``W_1``'s
    random start and the learning-rate gate ``sigmoid(eta_proj x)`` (about 0.5)
    add a small term to every attention output, so the logits are close to the
    Llama's but not equal (with the hebbian rule and the default init, a change of
    about 0.1% of their size in a small test model). ``learning_rule="omega"``
    changes far more: its attention reads prediction errors instead of the values,
    so the converted model computes something else until it is fine-tuned.
    ``memory_init_std=0`` would keep the hebbian logits equal, but the branch then
    stays zero and receives zero gradient, so it could never learn.

    Tensors the checkpoint lacks or has in excess are named (nothing is partially
    loaded); RoPE ``inv_freq`` buffers are dropped once checked against
    ``rope_theta``; a tied checkpoint's ``lm_head.weight`` is dropped once checked
    equal to the embedding. The output is written beside ``out_dir`` and moved
    there only when complete.

    Returns:
        The path of the written folder.
    """
    src = Path(src_dir)
    config = llama_config_to_deep_transformer(read_config(src), memory_depth=memory_depth, **deep_options)
    with staged_output(out_dir) as staging:
        model = _load_model(config, _source_state(src, config, allow_pickle))
        model.config.converted_from = f"the Llama checkpoint {src.absolute().name}"
        model.generation_config = _generation_config(src, model.config)
        model.save_pretrained(staging)
        copy_tokenizer_files(src, staging)
    return Path(out_dir)
