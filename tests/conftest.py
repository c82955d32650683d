"""Shared fixtures: tiny model configurations, deterministic seeds, and Triton's interpreter on CPU."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU the Triton kernels run under Triton's interpreter (tiny shapes only).
# The variable must be set before the first kernel is decorated, i.e. before the
# first call that selects the Triton backend.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Parameter sets that repeat what a faster sibling of theirs already checks, on the same code path: they run
# with the long tests (``-m slow``, once in CI) so that the default suite stays short on two cores. Each entry:
# test name -> the ids of its parameter sets that are slow.
SLOW_CASES = {
    # the hidden layer in slices: two sets of slices of 16 and two of 32 stay, across objectives and clips
    "test_the_sliced_triton_chunk_equals_the_torch_chunk": {
        f"{name}-{update}-slices{width}" for name in ("l2", "dot", "l2_clip", "dot_clip")
        for update in ("momentum", "plain") for width in (16, 32)
    } - {"l2_clip-momentum-slices16", "l2-plain-slices32", "dot_clip-momentum-slices32"},
    # MC-Titans' loop (mc_grm) stays: it runs the online memory through the same sliced kernels
    "test_the_chunk_loops_through_the_sliced_kernels_equal_the_torch_path": {"atlas_gd", "atlas_momentum", "titans"},
    # momentum stays in l2_masked, stretches of several chunks in dot
    "test_persistent_backward_equals_autograd_over_the_operator": {"l2-True-16-16-2"},
    # a hundred training steps each; the deep-transformer stays (MC-Titans' steps recompute its memory: its
    # gradients are checked against the kept memory's and the reference in the default run)
    "test_tiny_model_overfits_a_fixed_batch": {"mom", "mc-titans"},
    "test_triton_newton_schulz_of_near_singular_matrices": {"2", "3"},
    "test_mc_titans_with_fused_reads_equals_the_reference": {"mean", "residual", "ssc"},
    # the PyTorch path's case stays; the Triton one runs the same recompute through the interpreter
    "test_mom_layer_gradients_are_those_of_keeping_the_activations": {"triton"},
    # 150 tokens in groups of 2 stay at chunks of 32
    "test_triton_key_pass_equals_the_torch_one": {"150-0.5-reads7-4-16", "150-None-reads6-3-16",
                                                  "150-0.5-reads5-2-16"},
    # DDP for every family and FSDP for the others than MoM: the slow job (two processes each)
    "test_two_processes_match_one": {"atlas-ddp", "deep-transformer-ddp", "mc-titans-ddp", "mom-ddp",
                                     "atlas-fsdp", "deep-transformer-fsdp", "mc-titans-fsdp"},
    # a training step's peak in a subprocess; the default run checks what the recomputing backward keeps
    "test_training_peak_grows_like_the_cached_memories": {"soup-independent", "grm-checkpoint"},
    # one variant per family stays
    "test_autocast_step_shares_one_low_precision_norm_per_block": {
        "atlas-atlas++-window6", "atlas-dla", "atlas-mag-dla", "atlas-mal", "atlas-memory-caching",
        "atlas-omeganet-poly-tensor", "atlas-swla-momentum", "deep-attention-only", "deep-dot-window3-gqa",
        "mc-grm-conv", "mc-log-mean-gated", "mc-plain-titans", "mc-soup-independent", "mc-ssc-linear",
        "mom-deltanet-no-shared", "mom-hybrid", "mom-memory-caching", "mom-top1-expand-v",
    },
    # the interpreter runs every Triton program of a model's step: one variant per family stays (soup: its model
    # test in test_kernels_mixed_products.py)
    "test_every_variant_runs_its_kernels_and_equals_the_torch_path": {
        "atlas-atlas", "atlas-atlas++-window6", "atlas-dla", "atlas-mag-dla", "atlas-mal", "atlas-memory-caching",
        "atlas-swla-momentum", "mc-grm", "mc-grm-conv", "mc-plain-titans", "mc-soup-independent", "mom-default",
        "mom-deltanet-no-shared", "mom-hybrid", "mom-memory-caching", "mom-top1-expand-v",
        # gated memories: their own test in test_triton_backend.py (mc-grm-gated); logarithmic segments: on the
        # PyTorch path in test_memory_caching*.py
        "mc-log-mean-gated",
    },
    # the Hebbian case stays; Dot's chunk loop on the Triton reads: test_kernels_deep_attention.py, both backends
    "test_deep_transformer_decodes_and_pads_through_the_triton_reads": {"deep-dot-window3-gqa"},
    # the convolution's decoding: Atlas' and MoM's variants with convolutions keep it
    "test_greedy_with_and_without_cache_agree": {"mc-grm-conv"},
    # the window of six: the other Atlas presets and the Atlas window tests keep generation's properties
    "test_left_padded_batch_generates_what_each_sample_generates_alone": {"atlas-atlas++-window6"},
    "test_sampling_is_reproducible_and_cache_independent": {"atlas-atlas++-window6"},
    # whole tests: the interpreter runs a model's training steps
    "test_lora_reaches_the_output_and_trains_on_the_triton_path": {""},
    "test_atlas_muon_with_triton_newton_schulz": {""},
    "test_chunk_titans_with_gradients_takes_the_persistent_backward_when_asked": {""},  # the backward is off
    # the persistent forward in training: Titans' and Atlas' calls stay (test_a_training_call_runs_its_forward_...)
    "test_mc_titans_trains_with_its_segments_forward_through_the_persistent_kernel": {""},
    # Muon's momenta in the kernels: the kernels' own test stays (test_momenta_formed_inside_the_kernels_...)
    "test_atlas_muon_under_autocast_forms_its_momenta_in_the_kernels": {""},
}


@pytest.hookimpl(tryfirst=True)  # before the marker selection of ``addopts`` deselects by ``slow``
def pytest_collection_modifyitems(items) -> None:
    for item in items:
        name, _, params = item.name.partition("[")
        if params.rstrip("]") in SLOW_CASES.get(name, ()):
            item.add_marker(pytest.mark.slow)


def _fix_triton_interpreter_scalars() -> None:
    """Triton 3.6's interpreter turns a scalar into an index with ``int(array of shape (1,))``,
    an error since NumPy 2.4; every kernel loop with a runtime bound hits it. Read the
    element instead (the interpreter restores the attribute after each launch)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = interpreter._patch_lang_tensor
    if getattr(original, "index_fixed", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.index_fixed = True
    interpreter._patch_lang_tensor = patched


def _patch_interpreter(method: str, wrap) -> None:
    """Replace Triton's ``InterpreterBuilder.<method>`` by ``wrap(original, np, tl, interpreter)``, once
    (nothing without Triton)."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter.InterpreterBuilder, method)
    if getattr(original, "patched_here", False):
        return
    patched = wrap(original, np, tl, interpreter)
    patched.patched_here = True
    setattr(interpreter.InterpreterBuilder, method, patched)


def _round_bf16_casts(original, np, tl, interpreter):
    """Triton's interpreter converts float32 to bf16 by dropping the low bits (rounding toward zero,
    with or without ``fp_downcast_rounding``); CUDA rounds to nearest even. Truncation is biased, so
    sums of truncated values drift: one build of the gated delta rule read dk 1.9e-2 relative RMS
    against float64 truncating and 1.15e-2 rounding (its bf16 test, d_k = 130). Round as CUDA does, so
    that the bf16 bounds checked here are the ones the GPU is held to."""

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
            return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), dst_type.scalar)
        return original(self, src, dst_type)

    return cast_impl


def _widen_bf16_dots(original, np, tl, interpreter):
    """Triton's interpreter multiplies bf16 operands as their raw 16-bit patterns (it keeps bf16 as
    uint16 and widens only 8-bit floats before ``np.matmul``): a bf16 ``tl.dot`` returns numbers of
    order 1e10. Widen them to float32 first, which is what the GPU's bf16 products with float32
    sums compute."""

    def widen(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        return interpreter.TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    return create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_triton_interpreter_scalars()
    _patch_interpreter("cast_impl", _round_bf16_casts)
    _patch_interpreter("create_dot", _widen_bf16_dots)

from mnemo import (
    AtlasConfig,
    AtlasForCausalLM,
    DeepTransformerConfig,
    DeepTransformerForCausalLM,
    MCTitansConfig,
    MCTitansForCausalLM,
    MoMConfig,
    MoMForCausalLM,
)


def tiny_mom_config(**overrides) -> MoMConfig:
    kwargs = dict(
        vocab_size=97, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=8, expand_v=1.0,
        num_memories=4, topk=2, shared_memory=True, conv_size=4, intermediate_size=64, chunk_size=8,
        eos_token_id=None, bos_token_id=None, pad_token_id=0,
    )
    kwargs.update(overrides)
    return MoMConfig(**kwargs)


def tiny_mom(seed: int = 0, **overrides) -> MoMForCausalLM:
    torch.manual_seed(seed)
    model = MoMForCausalLM(tiny_mom_config(**overrides)).eval()
    # Random decay parameters make the gates matter (the default init decays slowly).
    return model


# Variants that every model-level equivalence test runs over.
MOM_VARIANTS = {
    "default": {},
    "hybrid": {"num_hidden_layers": 3, "attention_layers": [1], "num_attention_heads": 4, "num_key_value_heads": 2},
    "deltanet-no-shared": {"memory_update": "deltanet", "shared_memory": False},
    "top1-expand-v": {"topk": 1, "num_memories": 3, "expand_v": 2.0, "conv_size": 2},
    "memory-caching": {"segment_size": 5, "topk": 1, "num_memories": 3},
    "single-memory": {"num_memories": 1, "topk": 1, "shared_memory": False},  # a Gated DeltaNet
}


@pytest.fixture(params=sorted(MOM_VARIANTS))
def mom_variant(request) -> dict:
    return MOM_VARIANTS[request.param]


def tiny_deep_transformer_config(**overrides) -> DeepTransformerConfig:
    kwargs = dict(
        vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        memory_depth=2, memory_hidden=6, inner_chunk_size=4, memory_init_std=0.5,
        eos_token_id=None, bos_token_id=None, pad_token_id=0,
    )
    kwargs.update(overrides)
    return DeepTransformerConfig(**kwargs)


def tiny_deep_transformer(seed: int = 0, **overrides) -> DeepTransformerForCausalLM:
    torch.manual_seed(seed)
    return DeepTransformerForCausalLM(tiny_deep_transformer_config(**overrides)).eval()


DEEP_VARIANTS = {
    "hebbian": {},
    "dot-window3-gqa": {"learning_rule": "omega", "omega_window": 3, "num_key_value_heads": 2},
    "attention-only": {"memory_depth": 1, "num_key_value_heads": 2},
}

def assert_checkpointing_keeps_the_gradients(model, ids, rtol: float, atol: float) -> None:
    """One training step's gradients with transformers' activation checkpointing equal those without."""
    def grads():
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads()
    model.activation_checkpointing_enable()
    checkpointed = grads()
    assert plain.keys() == checkpointed.keys()
    for name, g in plain.items():
        torch.testing.assert_close(checkpointed[name], g, rtol=rtol, atol=atol, msg=name)


def tiny_mc_titans_config(**overrides) -> MCTitansConfig:
    kwargs = dict(
        vocab_size=97, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=8, memory_expansion=2,
        intermediate_size=64, inner_chunk_size=4, segment_size=6, memory_init_std=0.3, max_lr=0.5,
        eos_token_id=None, bos_token_id=None, pad_token_id=0,
    )
    kwargs.update(overrides)
    return MCTitansConfig(**kwargs)


def tiny_mc_titans(seed: int = 0, **overrides) -> MCTitansForCausalLM:
    torch.manual_seed(seed)
    return MCTitansForCausalLM(tiny_mc_titans_config(**overrides)).eval()


MC_VARIANTS = {
    "grm": {},
    "soup-independent": {"aggregation": "soup", "cache_mode": "independent"},
    "ssc-linear": {"aggregation": "ssc", "ssc_topk": 1, "memory_depth": 1},
    "log-mean-gated": {"segmentation": "logarithmic", "aggregation": "mean", "memory_gated": True},
    "plain-titans": {"segment_size": None},
    "grm-conv": {"conv_size": 3},
}

def tiny_atlas_config(preset: str = "atlas", **overrides) -> AtlasConfig:
    kwargs = dict(
        vocab_size=97, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=8, memory_expansion=2,
        intermediate_size=64, inner_chunk_size=4, omega_window=3, ns_steps=3, memory_init_std=0.3, max_lr=0.5,
        sliding_window=5, eos_token_id=None, bos_token_id=None, pad_token_id=0,
    )
    kwargs.update(overrides)
    return AtlasConfig.preset(preset, **kwargs)


def tiny_atlas(seed: int = 0, preset: str = "atlas", **overrides) -> AtlasForCausalLM:
    torch.manual_seed(seed)
    return AtlasForCausalLM(tiny_atlas_config(preset, **overrides)).eval()


ATLAS_VARIANTS = {
    "atlas": {},
    "atlas++-window6": {"preset": "atlas++", "omega_window": 6},
    "omeganet-poly-tensor": {"preset": "omeganet", "feature_map": "poly_tensor"},
    "dla": {"preset": "dla"},
    "swla-momentum": {"preset": "swla", "inner_optimizer": "momentum"},
    "mal": {"hybrid": "mal"},
    "mag-dla": {"preset": "dla", "hybrid": "mag"},
    "memory-caching": {"segment_size": 5},
}

# Every family and variant, for the tests that hold for all models.
MODEL_VARIANTS = {
    **{f"mom-{k}": (tiny_mom, v) for k, v in MOM_VARIANTS.items()},
    **{f"deep-{k}": (tiny_deep_transformer, v) for k, v in DEEP_VARIANTS.items()},
    **{f"mc-{k}": (tiny_mc_titans, v) for k, v in MC_VARIANTS.items()},
    **{f"atlas-{k}": (tiny_atlas, v) for k, v in ATLAS_VARIANTS.items()},
}


@pytest.fixture(params=sorted(MODEL_VARIANTS))
def make_model(request):
    """A builder of a tiny model of one family and variant: ``make_model(**overrides)``."""
    build, variant = MODEL_VARIANTS[request.param]
    return lambda **overrides: build(**{**variant, **overrides})


@pytest.fixture(scope="module")
def one_thread():
    """Intra-op threads off for a module: tiny tensors gain nothing from them, and on shared cores the
    thread hand-offs dominate (a tiny MoM forward: 17 ms on one thread, 400 ms on two under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def left_pad(seqs, width: int | None = None, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad 1-D token tensors to ``width`` (default: the longest); returns ``(input_ids, attention_mask)``."""
    T = max(len(s) for s in seqs) if width is None else width
    ids = torch.full((len(seqs), T), pad, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, T - len(s):] = s
        mask[i, T - len(s):] = 1
    return ids, mask


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


def assert_graphed_decoding_equals_eager(model, ids, mask, new_tokens: int = 12, steps: int = 6,
                                        atol: float = 0.0) -> None:
    """``generate(cuda_graph=True)`` gives eager ``generate()``'s greedy tokens, and a :class:`DecodeGraph`
    (captured on CUDA) replays steps whose logits equal the eager step's (exactly unless ``atol``). Models
    with rotary positions (``decode_positions``: the graph reads them from the cache) take each eager step
    with the attention mask, as ``generate()`` does, which counts each left-padded row's own tokens."""
    from mnemo import MnemoCache
    from mnemo.modeling.cuda_graph import DecodeGraph

    with torch.no_grad():
        eager = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        graphed = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=0, cuda_graph=True)
        assert torch.equal(graphed, eager)
        caches = MnemoCache(model.config.num_hidden_layers), MnemoCache(model.config.num_hidden_layers)
        for cache in caches:
            model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        step = DecodeGraph(model, caches[1])
        assert step.capture == (ids.device.type == "cuda")
        token = ids[:, -1:]
        for _ in range(steps):
            if not step.matches(caches[1]):  # its room for a growing state used up: another, as generation makes it
                step = DecodeGraph(model, caches[1])
            extra = {}
            if hasattr(model, "decode_positions"):
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
                extra = {"attention_mask": mask}
            expected = model(token, past_key_values=caches[0], use_cache=True, **extra).logits
            torch.testing.assert_close(step(token), expected, rtol=0, atol=atol)
            token = expected[:, -1:].argmax(-1)
