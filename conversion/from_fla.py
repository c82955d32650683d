"""Import flash-linear-attention (fla 0.6) MoM and Gated DeltaNet checkpoints as ``MoMForCausalLM``.

fla's ``MomForCausalLM`` (``model_type="mom"``) and ``GatedDeltaNetForCausalLM``
(``model_type="gated_deltanet"``) keep their parameters under the names mnemo's MoM
uses (mnemo's layer follows fla's ``MomAttention`` layout), except:

- ``model.embeddings`` is mnemo's ``model.embed_tokens``;
- fla's per-memory lists ``k_proj.<m>`` (and ``v_proj``, ``b_proj``, ``a_proj``)
  are mnemo's ``memories.<m>.k_proj`` (saved checkpoints keep fla's names:
  transformers writes them back on saving);
- a Gated DeltaNet is a MoM with one memory, routed to by every token
  (``num_memories=1, topk=1, shared_memory=False``): its single ``k_proj``,
  ``v_proj``, ``b_proj``, ``a_proj`` become memory 0's, and the router, whose
  softmax over one memory is always 1, gets a zero weight.

What the two compute, per memory layer, is the same: ``q, k, v`` through a
depthwise causal conv and SiLU, ``q, k`` L2-normalised (eps 1e-6) with ``q``
scaled by ``d_k ** -0.5``, ``beta = sigmoid(x W_b)``, log-decay
``g = -exp(A_log) * softplus(x W_a + dt_bias)``, the gated delta rule with the
output read after the write, a per-head ``RMSNorm(o) * silu(x W_g)`` with
``norm_eps``, then ``W_o``; pre-norm blocks with a SwiGLU MLP. For MoM, fla's
decoding path (each memory's convolutions run over its own tokens) is what
mnemo computes everywhere; fla's training path lets the convolutions run across
the packed memory segments, which no weight mapping can reproduce, and fla orders
routed tokens with a non-stable sort, which on CUDA reorders a memory's tokens
when a call routes 32 entries or fewer (batch x tokens x topk).

Options whose math mnemo does not reproduce are refused with a
:class:`ConversionError` naming the option and its value; options that only
pick fla kernels or fusions are ignored; a config key this module does not know
is refused rather than guessed at. Hybrid attention layers (fla's ``attn``) map
to ``attention_layers`` when they are plain causal attention with RoPE.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..configuration.configuration_mom import MoMConfig
from ..modeling.mom_layer import MEMORY_PROJECTIONS, legacy_memory_key
from .checkpoint_io import (
    ConversionError,
    check_state_dict_keys,
    copy_tokenizer_files,
    load_state_dict,
    read_config,
    staged_output,
)

__all__ = ["SUPPORTED_MODEL_TYPES", "convert_from_fla", "fla_config_to_mom", "fla_state_dict_to_mom"]

SUPPORTED_MODEL_TYPES = ("mom", "gated_deltanet")

# fla 0.6's defaults for every key its config classes save: a key missing from
# config.json (older transformers wrote only the keys that differ) takes these.
# These are all the fla keys accepted; among them, attn_mode and fuse_* only pick
# kernels and fusions (same math up to rounding), and MoM's capacity and
# use_layer_wise_balance are read by no fla 0.6 module: all are ignored.
_FLA_DEFAULTS: dict[str, dict[str, Any]] = {
    "mom": {
        "attn_mode": "chunk", "hidden_size": 2048, "conv_size": 4, "num_heads": 4, "head_dim": 256,
        "expand_v": 1.0, "use_output_gate": True, "use_short_conv": True, "max_position_embeddings": 2048,
        "hidden_ratio": 4, "intermediate_size": None, "hidden_act": "swish", "num_hidden_layers": 24,
        "norm_eps": 1e-6, "attn": None, "use_cache": True, "pad_token_id": None, "bos_token_id": 1,
        "eos_token_id": 2, "tie_word_embeddings": False, "initializer_range": 0.02, "num_memories": 4,
        "topk": 2, "capacity": 1.0, "use_layer_wise_balance": True, "aux_loss_scale": 0.01,
        "shared_mem": True, "single_kv_proj": False, "mom_backend": "gated_deltanet", "fuse_norm": True,
        "fuse_swiglu": True, "fuse_cross_entropy": True, "vocab_size": 32000, "attnres_block_size": None,
    },
    "gated_deltanet": {
        "attn_mode": "chunk", "hidden_size": 2048, "expand_v": 2.0, "use_gate": True, "use_short_conv": True,
        "allow_neg_eigval": False, "conv_size": 4, "head_dim": 256, "num_heads": 6, "num_v_heads": None,
        "max_position_embeddings": 2048, "hidden_ratio": 4, "intermediate_size": None, "hidden_act": "swish",
        "num_hidden_layers": 21, "norm_eps": 1e-6, "attn": None, "use_cache": True, "pad_token_id": None,
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "initializer_range": 0.02,
        "fuse_norm": True, "fuse_swiglu": True, "fuse_cross_entropy": True, "fuse_linear_cross_entropy": False,
        "use_l2warp": False, "vocab_size": 32000, "attnres_block_size": None, "output_gate_activation": "swish",
    },
}

# transformers' own bookkeeping and generation keys (4.x and 5.x): they say nothing about the architecture.
_GENERIC_KEYS = frozenset({
    "_name_or_path", "architectures", "auto_map", "chunk_size_feed_forward", "dtype", "torch_dtype",
    "id2label", "label2id", "is_encoder_decoder", "model_type", "output_attentions", "output_hidden_states",
    "problem_type", "return_dict", "transformers_version", "add_cross_attention", "bad_words_ids",
    "begin_suppress_tokens", "cross_attention_hidden_size", "decoder_start_token_id", "diversity_penalty",
    "do_sample", "early_stopping", "encoder_no_repeat_ngram_size", "exponential_decay_length_penalty",
    "finetuning_task", "forced_bos_token_id", "forced_eos_token_id", "is_decoder", "length_penalty",
    "max_length", "min_length", "no_repeat_ngram_size", "num_beam_groups", "num_beams",
    "num_return_sequences", "output_scores", "prefix", "remove_invalid_values", "repetition_penalty",
    "return_dict_in_generate", "sep_token_id", "suppress_tokens", "task_specific_params", "temperature",
    "tf_legacy_loss", "tie_encoder_decoder", "tokenizer_class", "top_k", "top_p", "torchscript",
    "typical_p", "use_bfloat16", "pruned_heads",
})

# option -> (the values mnemo reproduces, why another value is refused)
_REQUIRED_VALUES: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_short_conv": ((True,), "mnemo's MoM always runs the q/k/v short convolutions"),
    "use_output_gate": ((True,), "mnemo's MoM always gates the output norm with silu(x W_g)"),
    "use_gate": ((True,), "mnemo's MoM always gates the output norm with silu(x W_g)"),
    "output_gate_activation": (("swish", "silu"), "mnemo's output gate is silu(x W_g); there is no sigmoid gate"),
    "allow_neg_eigval": ((False,), "mnemo's beta is sigmoid(x W_b) in (0, 1); fla would use 2 * sigmoid"),
    "single_kv_proj": (
        (False,),
        "every mnemo memory has its own trainable k/v/beta/decay projections; fla would tie one set across memories",
    ),
    "mom_backend": (("gated_deltanet",), "mnemo's MoM memories are gated delta rules"),
    "attnres_block_size": ((None,), "attention residuals replace the residual stream; mnemo's blocks are plain pre-norm"),
    "use_l2warp": ((False,), "l2warp adds a max-logit penalty to the training gradient that mnemo's loss lacks"),
    "hidden_act": (("swish", "silu"), "mnemo's MLP is SwiGLU (silu)"),
}

# The keys fla's attention spec may hold, and the RoPE base fla's MomBlock always uses.
_ATTENTION_SPEC_KEYS = frozenset({"layers", "num_heads", "num_kv_heads", "qkv_bias", "window_size", "rope_theta"})
_FLA_DEFAULT_ROPE_THETA = 10000.0

_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.attn\.(.+)$")
_MEMORY_KEY = re.compile(r"\.memories\.(\d+)\.(\w+)\.weight$")


# --------------------------------------------------------------------------- config


def _refuse(option: str, value: Any, why: str) -> ConversionError:
    return ConversionError(f"fla option {option}={value!r} is not supported: {why}")


def _model_type(fla_config: Mapping[str, Any]) -> str:
    model_type = fla_config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConversionError(
            f"model_type={model_type!r} is not an fla checkpoint this converter imports "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    return model_type


def _settings(fla_config: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """fla's defaults overlaid with the config's values; unknown keys are refused."""
    model_type = _model_type(fla_config)
    defaults = _FLA_DEFAULTS[model_type]
    unknown = sorted(set(fla_config) - set(defaults) - _GENERIC_KEYS)
    if unknown:
        listed = ", ".join(f"{key}={fla_config[key]!r}" for key in unknown)
        raise ConversionError(
            f"fla {model_type} config has options this converter does not know, so it cannot tell whether "
            f"mnemo reproduces them: {listed}"
        )
    return model_type, {**defaults, **{k: v for k, v in fla_config.items() if k in defaults}}


def _check_required_values(settings: Mapping[str, Any]) -> None:
    for option, (accepted, why) in _REQUIRED_VALUES.items():
        if option in settings and not any(_same(settings[option], value) for value in accepted):
            raise _refuse(option, settings[option], why)
    num_v_heads = settings.get("num_v_heads")
    if num_v_heads is not None and num_v_heads != settings["num_heads"]:
        raise _refuse(
            "num_v_heads", num_v_heads,
            f"grouped value heads (num_v_heads != num_heads={settings['num_heads']}) are not in mnemo's MoM",
        )


def _same(value: Any, expected: Any) -> bool:
    if isinstance(expected, bool):  # True == 1 in Python: a 1 where fla expects a bool is still refused
        return value is expected
    return value == expected


def _attention_specs(attn: Any) -> list[dict[str, Any]]:
    if attn is None:
        return []
    specs = [attn] if isinstance(attn, dict) else attn
    if not isinstance(specs, list) or not all(isinstance(s, dict) for s in specs):
        raise _refuse("attn", attn, "expected a dict or a list of dicts (fla's attention spec)")
    return specs


def _attention_settings(settings: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """``attention_layers``, heads and RoPE base for fla's ``attn`` spec (plain causal attention with RoPE)."""
    specs = _attention_specs(settings["attn"])
    if not specs:
        return {"attention_layers": []}
    layers: list[int] = []
    shapes = set()
    for spec in specs:
        unknown = sorted(set(spec) - _ATTENTION_SPEC_KEYS)
        if unknown:
            raise _refuse("attn", spec, f"unknown attention option(s) {', '.join(unknown)}")
        if "layers" not in spec or "num_heads" not in spec:
            raise _refuse("attn", spec, "an attention spec needs 'layers' and 'num_heads'")
        num_heads = spec["num_heads"]
        num_kv_heads = spec.get("num_kv_heads") or num_heads
        rope_theta = float(spec.get("rope_theta", _FLA_DEFAULT_ROPE_THETA))
        if spec.get("qkv_bias", False):
            raise _refuse("attn.qkv_bias", spec["qkv_bias"], "mnemo's attention projections have no bias")
        if spec.get("window_size") is not None:
            raise _refuse("attn.window_size", spec["window_size"], "mnemo's MoM attention layers are not windowed")
        if model_type == "mom" and rope_theta != _FLA_DEFAULT_ROPE_THETA:
            # fla 0.6's MomBlock builds its attention without the spec's rope_theta (it uses 10000):
            # which base the checkpoint was trained with cannot be told.
            raise _refuse("attn.rope_theta", spec["rope_theta"], "fla's MoM attention ignores it and uses 10000")
        layers.extend(spec["layers"])
        shapes.add((num_heads, num_kv_heads, rope_theta))
    if len(shapes) > 1:
        raise _refuse("attn", settings["attn"], "mnemo's attention layers share one head count and RoPE base")
    num_heads, num_kv_heads, rope_theta = shapes.pop()
    return {
        "attention_layers": sorted(layers),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "rope_theta": rope_theta,
    }


def _mlp_width(settings: Mapping[str, Any]) -> tuple[float, int]:
    """fla's GatedMLP rule: ``intermediate_size`` or 2/3 * hidden * ratio rounded up to a multiple of 256."""
    ratio = settings["hidden_ratio"] if settings["hidden_ratio"] is not None else 4
    width = settings["intermediate_size"]
    if width is None:
        width = 256 * ((int(settings["hidden_size"] * ratio * 2 / 3) + 255) // 256)
    return float(ratio), width


def _memory_settings(settings: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    if model_type == "gated_deltanet":
        # One memory with routing weight 1: the load-balancing loss is the constant 1, so it is switched off.
        return {"num_memories": 1, "topk": 1, "shared_memory": False, "aux_loss_coef": 0.0}
    return {
        "num_memories": settings["num_memories"],
        "topk": settings["topk"],
        "shared_memory": bool(settings["shared_mem"]),
        # fla's balance loss counts every routed slot (it is topk times mnemo's, whose slot fractions sum
        # to 1): scaling the coefficient by topk gives the same loss and gradient for one layer.
        "aux_loss_coef": float(settings["aux_loss_scale"]) * settings["topk"],
    }


def fla_config_to_mom(fla_config: dict) -> MoMConfig:
    """The :class:`MoMConfig` computing what an fla ``mom`` or ``gated_deltanet`` config computes.

    Raises :class:`ConversionError` naming the first option (and its value) that
    mnemo's MoM does not reproduce.
    """
    model_type, settings = _settings(fla_config)
    _check_required_values(settings)
    hidden_ratio, intermediate_size = _mlp_width(settings)
    kwargs = dict(
        vocab_size=settings["vocab_size"],
        hidden_size=settings["hidden_size"],
        num_hidden_layers=settings["num_hidden_layers"],
        num_heads=settings["num_heads"],
        head_dim=settings["head_dim"],
        expand_v=float(settings["expand_v"]),
        memory_update="gated_deltanet",
        conv_size=settings["conv_size"],
        hidden_ratio=hidden_ratio,
        intermediate_size=intermediate_size,
        hidden_act="silu",
        norm_eps=float(settings["norm_eps"]),
        max_position_embeddings=settings["max_position_embeddings"],
        initializer_range=settings["initializer_range"],
        use_cache=settings["use_cache"],
        pad_token_id=settings["pad_token_id"],
        bos_token_id=settings["bos_token_id"],
        eos_token_id=settings["eos_token_id"],
        tie_word_embeddings=bool(settings["tie_word_embeddings"]),
        **_memory_settings(settings, model_type),
        **_attention_settings(settings, model_type),
    )
    try:
        return MoMConfig(**kwargs)
    except (TypeError, ValueError) as error:
        raise ConversionError(f"the fla {model_type} config maps to an invalid MoMConfig: {error}") from error


# --------------------------------------------------------------------------- weights


def _memory_layers(config: MoMConfig) -> list[int]:
    return [i for i, kind in enumerate(config.block_types) if kind == "mom"]


def _mom_name(fla_name: str, model_type: str, memory_layers: set[int]) -> str:
    if fla_name.startswith("model.embeddings."):
        return "model.embed_tokens." + fla_name[len("model.embeddings."):]
    if model_type == "gated_deltanet":
        match = _LAYER_KEY.match(fla_name)
        if match and int(match.group(1)) in memory_layers:
            module, _, param = match.group(2).partition(".")
            if module in MEMORY_PROJECTIONS and param == "weight":
                return f"model.layers.{match.group(1)}.attn.memories.0.{module}.weight"
    return legacy_memory_key(fla_name)


def _fla_name(mom_name: str, model_type: str, memory_layers: set[int]) -> str:
    """The inverse of :func:`_mom_name`, to name what is missing in the source's own terms."""
    if mom_name.startswith("model.embed_tokens."):
        return "model.embeddings." + mom_name[len("model.embed_tokens."):]
    if model_type == "gated_deltanet":
        match = _LAYER_KEY.match(mom_name)
        if match and int(match.group(1)) in memory_layers:
            for module in MEMORY_PROJECTIONS:
                if match.group(2) == f"memories.0.{module}.weight":
                    return f"model.layers.{match.group(1)}.attn.{module}.weight"
    return _MEMORY_KEY.sub(r".\2.\1.weight", mom_name)


def _target_shapes(config: MoMConfig) -> dict[str, torch.Size]:
    """Name and shape of every tensor of ``MoMForCausalLM(config)``, without allocating it."""
    from ..modeling.modeling_mom import MoMForCausalLM

    with torch.device("meta"):
        model = MoMForCausalLM(config)
    return {name: tensor.shape for name, tensor in model.state_dict().items()}


def _router_names(model_type: str, memory_layers: list[int]) -> list[str]:
    """Tensors mnemo has and fla's Gated DeltaNet lacks: the one-memory routers."""
    if model_type != "gated_deltanet":
        return []
    return [f"model.layers.{i}.attn.gate.weight" for i in memory_layers]


def _drop_tied_head(state: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """Without the LM head when it is tied (transformers saves it or not); a tied head must equal the embedding."""
    if not tied or "lm_head.weight" not in state:
        return state
    head, embedding = state["lm_head.weight"], state.get("model.embeddings.weight")
    if embedding is not None and not (head.shape == embedding.shape and torch.equal(head, embedding)):
        raise _refuse(
            "tie_word_embeddings", True,
            "the checkpoint's lm_head.weight differs from model.embeddings.weight, so the config and weights disagree",
        )
    return {name: tensor for name, tensor in state.items() if name != "lm_head.weight"}


def _check_shapes(converted: Mapping[str, torch.Tensor], shapes: Mapping[str, torch.Size], rename) -> None:
    wrong = [
        f"{rename(name)}: {tuple(tensor.shape)} (expected {tuple(shapes[name])})"
        for name, tensor in converted.items()
        if name in shapes and tensor.shape != shapes[name]
    ]
    if wrong:
        raise ConversionError("tensors whose shape does not match the config:\n" + "\n".join(wrong))


def fla_state_dict_to_mom(state: dict, fla_config: dict) -> dict:
    """fla parameter names and tensors -> mnemo's, checked against what ``fla_config`` implies.

    The tensors are the source's own (no copy). A Gated DeltaNet gains a zero
    router weight per memory layer. Every missing and unexpected tensor is named
    (in the source's terms) and shapes are checked before anything is returned.
    """
    model_type = _model_type(fla_config)
    config = fla_config_to_mom(fla_config)
    memory_layers = _memory_layers(config)
    memory_set = set(memory_layers)
    tied = bool(config.tie_word_embeddings)
    routers = _router_names(model_type, memory_layers)

    shapes = _target_shapes(config)
    expected = [name for name in shapes if not (tied and name == "lm_head.weight") and name not in routers]
    source = _drop_tied_head(dict(state), tied)
    check_state_dict_keys(
        source.keys(),
        [_fla_name(name, model_type, memory_set) for name in expected],
        f"fla {model_type} checkpoint",
    )

    converted = {_mom_name(name, model_type, memory_set): tensor for name, tensor in source.items()}
    _check_shapes(converted, shapes, lambda name: _fla_name(name, model_type, memory_set))
    reference = converted["model.embed_tokens.weight"]
    for name in routers:
        converted[name] = torch.zeros(shapes[name], dtype=reference.dtype)
    return converted


# --------------------------------------------------------------------------- checkpoint


def _common_dtype(state: Mapping[str, torch.Tensor]) -> torch.dtype:
    """The source's floating dtype, or the narrowest one that holds every source tensor exactly."""
    dtypes = {t.dtype for t in state.values() if t.is_floating_point()}
    if len(dtypes) == 1:
        return dtypes.pop()
    dtype = torch.float32
    for other in dtypes:
        dtype = torch.promote_types(dtype, other)
    return dtype


def _build_model(config: MoMConfig, converted: dict[str, torch.Tensor]):
    from transformers.initialization import no_init_weights

    from ..modeling.modeling_mom import MoMForCausalLM

    with no_init_weights():  # every tensor is overwritten below
        model = MoMForCausalLM(config)
    model.to(_common_dtype(converted))
    result = model.load_state_dict(converted, strict=False)
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(result.missing_keys) - allowed_missing or result.unexpected_keys:
        raise ConversionError(f"internal mapping error: {result}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def convert_from_fla(src_dir: str | os.PathLike, out_dir: str | os.PathLike, *, allow_pickle: bool = False) -> Path:
    """Convert the fla checkpoint folder ``src_dir`` into a ``MoMForCausalLM`` folder ``out_dir``.

    ``out_dir`` must not exist or be empty; it is written beside its place and
    moved there only when complete. Weights are read from safetensors (pickled
    files only with ``allow_pickle=True``) and written as safetensors in the
    source's dtype; tokenizer files the source has are copied. Returns ``out_dir``.
    """
    with staged_output(out_dir) as staging:
        fla_config = read_config(src_dir)
        config = fla_config_to_mom(fla_config)
        converted = fla_state_dict_to_mom(load_state_dict(src_dir, allow_pickle=allow_pickle), fla_config)
        model = _build_model(config, converted)
        model.save_pretrained(staging)
        copy_tokenizer_files(src_dir, staging)
    return Path(out_dir)
