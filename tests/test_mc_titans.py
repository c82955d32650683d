"""MCTitansForCausalLM specifics: the cache grows by one memory per segment, gradients, validation."""

from __future__ import annotations

import math

import pytest
import torch

from mnemo import MCTitansConfig, MCTitansForCausalLM

from conftest import tiny_mc_titans, tiny_mc_titans_config


@pytest.mark.parametrize("segment_size", [64, 256])
def test_cache_of_a_1000_token_decode_holds_one_memory_per_segment(segment_size):
    model = tiny_mc_titans(segment_size=segment_size, num_hidden_layers=1, inner_chunk_size=16)
    ids = torch.randint(1, 97, (1, 1000))
    with torch.no_grad():
        out = model(ids[:, :100], use_cache=True)
        cache = out.past_key_values
        for t in range(100, 1000):
            cache = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).past_key_values
    layer = cache[0]
    cached = 1000 // segment_size
    assert int(layer["num_cached"][0]) == cached
    # decoding sizes the cache ahead (a graphed step holds its shape): exactly for a few memories, then with
    # at most a quarter of the slots empty
    slots = layer["cached.w1"].shape[1]
    assert slots == cached if cached <= 8 else cached <= slots < 1.25 * cached
    assert not bool(layer["cached.w1"][0, cached:].any())
    assert cached + 1 == math.ceil(1000 / segment_size)  # with the online memory: one per segment
    assert cache.get_seq_length() == 1000


@pytest.mark.parametrize("segment_size", [1, 3, 256])
def test_decode_slots_are_few_empty_and_last_as_long_as_they_say(segment_size):
    from mnemo.kernels.mc_titans import DECODE_EXACT_SLOTS, decode_slots, decode_steps_within

    for seen in range(0, 200 * segment_size, max(1, segment_size // 3)):
        slots, closed = decode_slots(seen, segment_size), (seen + 1) // segment_size
        assert slots == closed if closed <= DECODE_EXACT_SLOTS else closed <= slots < 1.25 * closed
        steps = decode_steps_within(slots, seen, segment_size)
        assert steps >= 1  # the step it was reserved for
        assert all(decode_slots(seen + j, segment_size) <= slots for j in range(steps))
        assert decode_slots(seen + steps, segment_size) > slots


def test_pushing_into_reserved_slots_in_place_equals_growing_the_cache():
    """The three ways a step caches a memory agree: growing a slot where needed (reading counts back),
    writing into reserved slots, and writing them in place; a row that closes nothing keeps its cache, a
    full one included (its clamped slot is written back as it was)."""
    from mnemo.kernels.mc_titans import MCState

    gen = torch.Generator().manual_seed(0)
    B, H, d = 4, 2, 3
    init = {"w1": torch.randn(H, 5, d, generator=gen), "w2": torch.randn(H, d, 5, generator=gen)}
    state = MCState.initial(init, B, d)
    states = {"grow": state, "reserved": MCState.initial(init, B, d), "in_place": MCState.initial(init, B, d)}
    for mode in ("reserved", "in_place"):
        states[mode].reserve(3)
    for step in range(4):
        rows = torch.tensor([step < 3, step % 2 == 0, False, step != 1])  # rows 0 and 3 fill their 3 slots
        weights = {n: torch.randn(B, *w.shape, generator=gen) for n, w in init.items()}
        keys = torch.randn(B, H, d, generator=gen)
        for mode, st in states.items():
            st.key_sum, st.key_count = st.key_sum + keys, st.key_count + 1
            where = {n: c.data_ptr() for n, c in st.cached.items()}
            st.push(rows, weights, slots=mode)
            if mode == "in_place":  # the same tensors, written where they lie
                assert {n: c.data_ptr() for n, c in st.cached.items()} == where
    grown, reserved, in_place = states["grow"], states["reserved"], states["in_place"]
    n = grown.cached_key_count.shape[1]
    assert n == 3 and torch.equal(grown.num_cached, torch.tensor([3, 2, 0, 3]))
    for other in (reserved, in_place):
        assert torch.equal(other.num_cached, grown.num_cached)
        for name in init:
            torch.testing.assert_close(other.cached[name][:, :n], grown.cached[name], rtol=0, atol=0)
        for a, b in ((other.cached_key_sum[:, :n], grown.cached_key_sum), (other.key_sum, grown.key_sum),
                     (other.cached_key_count[:, :n], grown.cached_key_count), (other.key_count, grown.key_count)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="slots"):
        grown.push(torch.ones(B, dtype=torch.bool), weights, slots="always")


def test_decode_matches_forward_across_segment_and_chunk_boundaries():
    model = tiny_mc_titans(segment_size=5, inner_chunk_size=3, aggregation="ssc", ssc_topk=2)
    ids = torch.randint(1, 97, (2, 23))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :4], use_cache=True)
        cache, logits = out.past_key_values, [out.logits]
        for t in range(4, 23):
            step = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            logits.append(step.logits)
    torch.testing.assert_close(torch.cat(logits, 1), full, rtol=1e-4, atol=1e-5)


def test_plain_titans_has_no_cached_memories():
    model = tiny_mc_titans(segment_size=None)
    cache = model(torch.randint(1, 97, (1, 40)), use_cache=True).past_key_values
    assert cache[0]["cached.w1"].shape[1] == 0


def test_gradients_reach_every_parameter():
    for overrides in ({}, {"memory_gated": True, "aggregation": "soup"}, {"memory_depth": 1}):
        model = tiny_mc_titans(**overrides).train()
        ids = torch.randint(1, 97, (2, 20))
        model(ids, labels=ids).loss.backward()
        assert [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0] == []


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"segment_size": 0}, "segment_size"),
        ({"segment_size": -4}, "segment_size"),
        ({"aggregation": "max"}, "aggregation"),
        ({"segmentation": "fibonacci"}, "segmentation"),
        ({"cache_mode": "frozen"}, "cache_mode"),
        ({"segmentation": "logarithmic", "cache_mode": "independent"}, "cache_mode"),
        ({"ssc_topk": 0}, "ssc_topk"),
        ({"memory_depth": 3}, "memory_depth"),
        ({"memory_depth": 1, "memory_gated": True}, "memory_gated"),
        ({"inner_chunk_size": 0}, "inner_chunk_size"),
        ({"max_lr": 0.0}, "max_lr"),
        ({"memory_grad_clip": 0.0}, "memory_grad_clip"),
        ({"conv_size": 1}, "conv_size"),
    ],
)
def test_invalid_values_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=rf"^{field}="):
        tiny_mc_titans_config(**overrides)


def test_defaults_and_meta_device_size():
    config = MCTitansConfig()
    assert (config.segment_size, config.aggregation, config.segmentation, config.cache_mode) == (
        256, "grm", "constant", "checkpoint")
    assert config.inner_chunk_size == 64 and config.memory_expansion == 4
    with torch.device("meta"):
        model = MCTitansForCausalLM(config)
    memory = sum(p.numel() for n, p in model.named_parameters() if ".memory_w" in n)
    assert memory == 24 * 4 * 2 * 256 * 1024  # W1 (256 x 1024) and W2 (1024 x 256) per head


@pytest.mark.parametrize("clip", [None, 10.0])
def test_memory_grad_clip_keeps_a_runaway_memory_finite(clip):
    """Weights that drive values and the learning-rate gate up (what outer training did in a long bf16 run) make
    the unclipped in-context descent overflow; the default clip keeps the logits finite."""
    model = MCTitansForCausalLM(tiny_mc_titans_config(max_lr=1.0, memory_grad_clip=clip)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.attn.v_proj.weight.mul_(200)
            layer.attn.lr_proj.bias.fill_(6.0)
            layer.attn.momentum_proj.bias.fill_(3.0)
            layer.attn.retention_proj.bias.fill_(12.0)
        logits = model(torch.randint(1, 97, (2, 300), generator=torch.Generator().manual_seed(0))).logits
    assert bool(torch.isfinite(logits).all()) == (clip is not None)
