"""AtlasForCausalLM specifics: presets, the hybrid's window in the cache, gradients, validation, and the gated
Memory Caching aggregations (grm, soup, ssc) end to end."""

from __future__ import annotations

import pytest
import torch

from mnemo import AtlasConfig, AtlasForCausalLM

from conftest import left_pad, tiny_atlas, tiny_atlas_config

GATED = ["grm", "soup", "ssc"]
SEGMENT = 4


def test_presets_are_the_papers_variants():
    atlas = AtlasConfig.preset("atlas")
    assert (atlas.inner_optimizer, atlas.feature_map, atlas.objective, atlas.omega_window) == (
        "muon", "poly_elementwise", "l2", 16)
    assert AtlasConfig.preset("atlas++").memory_gated
    assert AtlasConfig.preset("omeganet").inner_optimizer == "gd"
    dla = AtlasConfig.preset("dla")
    assert (dla.objective, dla.omega_window, dla.memory_depth) == ("dot", 1, 2)
    swla = AtlasConfig.preset("swla", omega_window=8)
    assert (swla.objective, swla.memory_depth, swla.omega_window) == ("dot", 1, 8)
    with pytest.raises(ValueError, match="unknown preset"):
        AtlasConfig.preset("titans")


def test_sliding_window_kv_is_trimmed_while_decoding():
    model = tiny_atlas(hybrid="mal", sliding_window=5)
    ids = torch.randint(1, 97, (2, 30))
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, :7] = 0
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        out = model(ids[:, :10], attention_mask=mask[:, :10], use_cache=True)
        cache, logits = out.past_key_values, [out.logits]
        for t in range(10, 30):
            step = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            logits.append(step.logits)
            assert cache[0]["swa.key"].shape[2] <= 5
    valid = mask.bool()
    torch.testing.assert_close(torch.cat(logits, 1)[valid], full[valid], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("overrides", [{}, {"preset": "swla", "inner_optimizer": "momentum"}, {"hybrid": "mag"},
                                       {"feature_map": "poly_tensor"},
                                       {"segment_size": 4, "aggregation": "grm"},
                                       {"segment_size": 4, "aggregation": "soup", "feature_map": "poly_tensor"},
                                       {"segment_size": 3, "aggregation": "ssc", "ssc_topk": 1, "preset": "dla"}])
def test_gradients_reach_every_parameter(overrides):
    model = tiny_atlas(**overrides).train()
    ids = torch.randint(1, 97, (2, 14))
    model(ids, labels=ids).loss.backward()
    assert [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0] == []


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"omega_window": 0}, "omega_window"),
        ({"ns_steps": -1}, "ns_steps"),
        ({"feature_map": "poly_tensor", "head_dim": 64}, "feature_map"),
        ({"feature_map": "poly_tensor", "poly_degree": 3}, "poly_degree"),
        ({"feature_map": "rbf"}, "feature_map"),
        ({"objective": "huber"}, "objective"),
        ({"inner_optimizer": "adam"}, "inner_optimizer"),
        ({"hybrid": "mix"}, "hybrid"),
        ({"memory_depth": 1, "memory_gated": True}, "memory_gated"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"inner_chunk_size": 0}, "inner_chunk_size"),
        ({"memory_grad_clip": -1.0}, "memory_grad_clip"),
        ({"segment_size": 0}, "segment_size"),
        ({"segment_size": 4, "aggregation": "max"}, "aggregation"),
        ({"segment_size": 4, "aggregation": "ssc", "ssc_topk": 0}, "ssc_topk"),
    ],
)
def test_invalid_values_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=rf"^{field}="):
        tiny_atlas_config(**overrides)


def test_paper_340m_shape_on_meta_device():
    config = AtlasConfig(hidden_size=1024, num_hidden_layers=24, num_heads=16)
    with torch.device("meta"):
        model = AtlasForCausalLM(config)
    memory = sum(p.numel() for n, p in model.named_parameters() if ".memory_w" in n)
    assert memory == 24 * 16 * 2 * 64 * 256  # W1 (64 x 256) and W2 (256 x 64) per head
    assert config.head_dim == 64 and config.feature_dim == 64


# --------------------------------------------------------------------------- gated Memory Caching


def tiny_mc_atlas(aggregation: str, seed: int = 0, **overrides) -> AtlasForCausalLM:
    """Memory Caching every 4 tokens; the gate projection drawn at a trained-looking scale, so that the scores
    differ between memories (at the initial std every gate is close to uniform)."""
    model = tiny_atlas(seed=seed, segment_size=SEGMENT, aggregation=aggregation, ssc_topk=1, **overrides)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.attn, "u_proj"):
                layer.attn.u_proj.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(seed))
    return model


def test_gate_projection_only_for_gated_aggregations():
    for overrides, width in [({"segment_size": 4, "aggregation": "grm"}, 2 * 8),
                             ({"segment_size": 4, "aggregation": "ssc", "feature_map": "poly_tensor"}, 2 * 45),
                             ({"segment_size": 4, "aggregation": "mean"}, None),
                             ({"segment_size": 4, "aggregation": "residual"}, None),
                             ({"aggregation": "soup"}, None)]:  # no Memory Caching: nothing to score
        layer = tiny_atlas(**overrides).model.layers[0].attn
        if width is None:
            assert not hasattr(layer, "u_proj"), overrides
        else:  # u lives in the space of the feature-mapped keys the summaries average
            assert layer.u_proj.weight.shape == (width, 32) and layer.u_proj.bias is None, overrides
            assert 0.01 < layer.u_proj.weight.std() < 0.03  # initialised like the other projections


@pytest.mark.parametrize("aggregation", GATED)
def test_gated_decode_of_a_left_padded_batch_equals_forward(aggregation):
    model = tiny_mc_atlas(aggregation)
    seqs = [torch.randint(1, 97, (n,)) for n in (23, 14, 19)]
    ids, mask = left_pad(seqs)
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        out = model(ids[:, :11], attention_mask=mask[:, :11], use_cache=True)
        cache, logits = out.past_key_values, [out.logits]
        for t in range(11, 23):  # single tokens across several segment ends of every row
            step = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            logits.append(step.logits)
    valid = mask.bool()
    torch.testing.assert_close(torch.cat(logits, 1)[valid], full[valid], rtol=1e-4, atol=1e-5)
    layer = cache[0]
    assert layer["mem.mc_count"].tolist() == [len(s) // SEGMENT for s in seqs]
    assert layer["mem.mc_online_key_count"].tolist() == [len(s) % SEGMENT for s in seqs]
    assert layer["mem.mc_key_sum"].shape == (3, 23 // SEGMENT, 2, 8)
    assert all(t.shape[0] == 3 for t in layer.states.values())  # batch first, for beam reorder and select


@pytest.mark.parametrize("aggregation", GATED)
def test_gated_left_padded_batch_equals_each_sample_alone(aggregation):
    model = tiny_mc_atlas(aggregation, preset="omeganet")
    seqs = [torch.randint(1, 97, (n,)) for n in (13, 4, 9)]
    ids, mask = left_pad(seqs)
    with torch.no_grad():
        batch = model(ids, attention_mask=mask).logits
        for i, s in enumerate(seqs):
            alone = model(s[None]).logits[0]
            torch.testing.assert_close(batch[i, ids.shape[1] - len(s):], alone, rtol=1e-4, atol=1e-5)


def test_gated_beam_search_follows_the_beams():
    model = tiny_mc_atlas("ssc")
    prompt = torch.randint(1, 97, (2, 6))
    kwargs = dict(max_new_tokens=8, num_beams=3, num_return_sequences=2, do_sample=False, early_stopping=False)
    cached = model.generate(prompt, **kwargs)
    assert torch.equal(cached, model.generate(prompt, use_cache=False, **kwargs))


def test_gated_save_load_round_trip_is_bit_exact(tmp_path):
    model = tiny_mc_atlas("soup", feature_map="poly_tensor")
    model.save_pretrained(tmp_path)
    loaded = AtlasForCausalLM.from_pretrained(tmp_path).eval()
    assert (loaded.config.aggregation, loaded.config.ssc_topk) == ("soup", 1)
    original = model.state_dict()
    assert loaded.state_dict().keys() == original.keys() and any("u_proj" in n for n in original)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, original[name]), name
    ids = torch.randint(1, 97, (2, 15))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _without_gates(model) -> dict[str, torch.Tensor]:
    return {n: t for n, t in model.state_dict().items() if "u_proj" not in n}


@pytest.mark.parametrize("aggregation", ["ssc", "grm"])
def test_zero_gate_projection_reads_as_mean(aggregation):
    """Equal scores: grm, and ssc because memories tied with the top-k-th score are kept, average every memory."""
    gated = tiny_mc_atlas(aggregation)
    with torch.no_grad():
        for layer in gated.model.layers:
            layer.attn.u_proj.weight.zero_()
    mean = tiny_atlas(seed=1, segment_size=SEGMENT, aggregation="mean")
    mean.load_state_dict(_without_gates(gated))
    ids = torch.randint(1, 97, (2, 18))
    torch.testing.assert_close(_logits(gated, ids), _logits(mean, ids), rtol=1e-5, atol=1e-5)


def test_soup_differs_from_grm_only_for_a_deep_memory():
    ids = torch.randint(1, 97, (2, 18))
    for preset, deep in (("atlas", True), ("swla", False)):
        grm, soup = tiny_mc_atlas("grm", preset=preset), tiny_mc_atlas("soup", preset=preset)
        soup.load_state_dict(grm.state_dict())
        a, b = _logits(grm, ids), _logits(soup, ids)
        torch.testing.assert_close(a[:, :SEGMENT], b[:, :SEGMENT], rtol=0, atol=0)  # one memory: the same read
        if deep:  # mixing the weights of an MLP is not mixing its outputs
            assert (a - b).abs().max() > 1e-4
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_every_aggregation_is_plain_atlas_inside_the_first_segment():
    plain = tiny_atlas(seed=5)
    ids = torch.randint(1, 97, (2, 3 * SEGMENT))
    expected = _logits(plain, ids)
    for aggregation in ["mean", "residual", *GATED]:
        model = tiny_mc_atlas(aggregation, seed=6)
        missing, unexpected = model.load_state_dict(plain.state_dict(), strict=False)
        assert unexpected == [] and all("u_proj" in n for n in missing)
        got = _logits(model, ids)
        torch.testing.assert_close(got[:, :SEGMENT], expected[:, :SEGMENT], rtol=0, atol=1e-6)
        assert (got[:, SEGMENT:] - expected[:, SEGMENT:]).abs().max() > 1e-4, aggregation  # the cache is read after


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("build", ["atlas", "omeganet", "mc_titans_conv"])
def test_rows_without_a_mask_equal_an_all_true_mask(build, device):
    """``valid=None`` (no padding; the models pass it when their mask is all ones) skips the short
    convolutions' packing by mask and the rows' compaction: outputs, the stored convolution windows and
    memory states, and every gradient equal those of an all-true mask, bit for bit (on CUDA through the
    Triton convolution)."""
    from conftest import tiny_mc_titans

    from mnemo.modeling.cache import LayerCache

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = tiny_mc_titans(conv_size=3) if build == "mc_titans_conv" else tiny_atlas(preset=build)
    layer = model.model.layers[0].attn.to(device)
    x = torch.randn(2, 11, 32, generator=torch.Generator().manual_seed(1)).to(device)
    runs = []
    for valid in (None, torch.ones(2, 11, dtype=torch.bool, device=device)):
        h = x.clone().requires_grad_()
        cache = LayerCache()
        out = layer(h, valid, cache).hidden_states
        grads = torch.autograd.grad(out.pow(2).sum(), [h, *layer.parameters()], allow_unused=True)
        runs.append((out, cache.states, grads))
    (out0, states0, grads0), (out1, states1, grads1) = runs
    assert torch.equal(out0, out1)
    assert states0.keys() == states1.keys()
    for name in states0:
        assert torch.equal(states0[name], states1[name]), name
    for g0, g1 in zip(grads0, grads1):
        assert (g0 is None) == (g1 is None) and (g0 is None or torch.equal(g0, g1))


@pytest.mark.parametrize("build", ["mc_titans", "mc_atlas"])
def test_a_layer_driven_on_its_own_keeps_every_cached_memory(build):
    """A layer cache that counts no tokens (a layer driven without a model cache) cannot size the one-token
    step's slots from the host: the step grows them as it needs them, so decoding one token at a time after
    a prefill crosses segment ends (segments of 3) and still equals the full forward."""
    from conftest import tiny_mc_titans

    from mnemo.modeling.cache import LayerCache

    model = tiny_mc_titans(segment_size=3) if build == "mc_titans" else tiny_atlas(segment_size=3)
    layer = model.model.layers[0].attn
    x = torch.randn(2, 10, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = layer(x, None, LayerCache()).hidden_states
        cache = LayerCache()
        pieces = [layer(x[:, :4], None, cache).hidden_states]
        pieces += [layer(x[:, t:t + 1], None, cache).hidden_states for t in range(4, 10)]
    assert cache.seen_tokens == 0
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-5, atol=1e-6)
