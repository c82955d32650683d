"""Post-training conversion of a recurrent checkpoint into its Memory Caching variant.

The MC paper (§4.3, "Memory Caching as Post Training") caches the memory of a
model trained without caching at the end of every segment and reads the cached
memories back at inference. Here a checkpoint trained with ``segment_size=None``
gets the chosen ``segment_size`` and ``aggregation``; every trained tensor is kept
as it is and no parameter is added:

- Titans (``MCTitansForCausalLM``) becomes MC-Titans: any aggregation.
- MoM (``MoMForCausalLM``) caches all its matrix memories (``kernels/mc_gated_delta.py``).
- Atlas (``AtlasForCausalLM``, every preset and hybrid) caches its MLP memory
  (``kernels/mc_atlas.py``).

Every family takes every aggregation: ``mean`` and ``residual`` add no parameter.
The gated ones (``grm``, ``soup``, ``ssc``) score each cached memory through a gate
projection ``u_proj``: MoM and Atlas have none without caching, so the conversion
adds it; MC-Titans has one that is never used while a model has one segment, so
it is untrained in the source. Either way the conversion sets it to zero, which
makes the gated aggregations start as the uniform average of the online and
cached memories (``mean``; ``ssc`` keeps tied scores, so it reads them all) until
they are fine-tuned. Inside the first segment nothing is cached yet, so every
aggregation gives the source's outputs there exactly.

"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..configuration.configuration_atlas import AtlasConfig
from ..configuration.configuration_mc_titans import MCTitansConfig
from ..configuration.configuration_mom import MoMConfig
from .checkpoint_io import (
    ConversionError,
    check_state_dict_keys,
    copy_tokenizer_files,
    load_state_dict,
    read_config,
    staged_output,
)

__all__ = ["convert_to_memory_caching"]

GATED = ("grm", "soup", "ssc")
# model_type -> (config class, family name)
_SOURCES = {
    MCTitansConfig.model_type: (MCTitansConfig, "Titans"),
    MoMConfig.model_type: (MoMConfig, "MoM"),
    AtlasConfig.model_type: (AtlasConfig, "Atlas"),
}


def _target_config(source: dict, src_name: str, **mc):
    model_type = source.get("model_type")
    if model_type not in _SOURCES:
        raise ConversionError(f"cannot convert model_type {model_type!r} to Memory Caching")
    config_cls, family = _SOURCES[model_type]
    if source.get("segment_size") is not None:
        raise ConversionError(
            f"the source already caches its memory (segment_size={source['segment_size']}); "
            "convert a checkpoint trained with segment_size=None"
        )
    fields = {k: v for k, v in source.items() if k not in ("architectures", "auto_map", "transformers_version")}
    if config_cls is MCTitansConfig:
        fields.update(mc, cache_mode="checkpoint")
    else:
        fields.update(segment_size=mc["segment_size"], aggregation=mc["aggregation"], ssc_topk=mc["ssc_topk"])
    fields["converted_from"] = (f"{src_name} ({family}, one segment) by Memory Caching post-training conversion "
                                f"(segment_size={mc['segment_size']}, aggregation={mc['aggregation']})")
    try:
        return config_cls(**fields)
    except ValueError as err:
        raise ConversionError(str(err)) from err


def _is_gate_projection(name: str) -> bool:
    return name.endswith(".u_proj.weight")


def convert_to_memory_caching(
    src_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    segment_size: int,
    aggregation: str = "mean",
    segmentation: str = "constant",
    ssc_topk: int = 2,
    allow_pickle: bool = False,
) -> Path:
    """Write the Memory Caching variant of the checkpoint in ``src_dir`` to ``out_dir``.

    Args:
        src_dir: A Titans (``MCTitansForCausalLM``), MoM or Atlas checkpoint folder, ``segment_size=None``.
        out_dir: The folder to write; it must not exist or be empty.
        segment_size: Tokens per cached segment (the paper caches every training length).
        aggregation: ``"mean"``, ``"residual"`` (no parameters), or the gated ``"grm"``, ``"soup"``,
            ``"ssc"`` (gate projection ``u_proj`` added or set to zero: they start as ``mean``).
        segmentation: ``"constant"`` or, for Titans, ``"logarithmic"``.
        ssc_topk: Cached memories each token reads with ``"ssc"``.
        allow_pickle: Accept ``pytorch_model.bin`` weights (read with ``weights_only=True``).

    Returns:
        The path of the written checkpoint.
    """
    from ..modeling.modeling_atlas import AtlasForCausalLM
    from ..modeling.modeling_mc_titans import MCTitansForCausalLM
    from ..modeling.modeling_mom import MoMForCausalLM
    from ..modeling.mom_layer import legacy_memory_key

    if not isinstance(segment_size, int) or isinstance(segment_size, bool) or segment_size < 1:
        raise ConversionError(f"segment_size must be an integer >= 1, got {segment_size!r}")
    config = _target_config(read_config(src_dir), Path(src_dir).name, segment_size=segment_size,
                            aggregation=aggregation, segmentation=segmentation, ssc_topk=ssc_topk)
    if not isinstance(config, MCTitansConfig) and segmentation != "constant":
        raise ConversionError(f"segmentation {segmentation!r} is only available for Titans; MoM and Atlas "
                              "segments are constant")
    state = load_state_dict(src_dir, allow_pickle=allow_pickle)
    if isinstance(config, MoMConfig):  # saved MoM checkpoints name each memory's projections as fla does
        state = {legacy_memory_key(name): tensor for name, tensor in state.items()}
    model_cls = {MCTitansConfig: MCTitansForCausalLM, MoMConfig: MoMForCausalLM, AtlasConfig: AtlasForCausalLM}
    model = model_cls[type(config)](config)
    expected = model.state_dict()
    if config.tie_word_embeddings:
        state.setdefault("lm_head.weight", state.get("model.embed_tokens.weight"))
    if aggregation in GATED:  # the gate projections the gated aggregations add start at zero (read as ``mean``)
        state.update({name: torch.zeros_like(t) for name, t in expected.items()
                      if name not in state and _is_gate_projection(name)})
    check_state_dict_keys(state, expected, f"converting {Path(src_dir).name} to Memory Caching")
    dtype = state["model.embed_tokens.weight"].dtype
    model = model.to(dtype)
    model.load_state_dict(state, strict=True)
    if aggregation in GATED:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if _is_gate_projection(name):
                    param.zero_()
    src = Path(src_dir)
    if (src / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(src)
    with staged_output(out_dir) as staging:
        model.save_pretrained(staging)
        copy_tokenizer_files(src, staging)
    return Path(out_dir)
