"""``generate(cuda_graph=True)``: the fixed-buffer decode step (captured as a CUDA graph on GPUs; run
eagerly here) gives exactly what eager decoding gives, keeps the cache's tensors in place, reads
nothing back to the host, and models whose state grows unpredictably are refused with the reason.
MoM and Gated DeltaNet, Titans, MC-Titans with fixed segments and Atlas, with or without Memory Caching (cached
memories and states given slots ahead of need), without attention layers, and the Hebbian DeepTransformer (its
keys and values given room ahead, its rotary positions read from the cache) decode this way."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mnemo import MnemoCache
from mnemo.modeling.cuda_graph import DecodeGraph

from conftest import assert_graphed_decoding_equals_eager, tiny_atlas, tiny_deep_transformer, tiny_mc_titans, tiny_mom

MOM_GRAPHABLE = {
    "default": {},
    "deltanet-no-shared": {"memory_update": "deltanet", "shared_memory": False},
    "gated-deltanet": {"num_memories": 1, "topk": 1, "shared_memory": False},
    # segments of 3 tokens: the 7-token prompts and 12 new tokens close several, in the prefill and the steps
    **{f"mc-{aggregation}": {"segment_size": 3, "aggregation": aggregation}
       for aggregation in ("mean", "residual", "grm", "ssc")},
}


def left_padded(lengths, width, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 97, (len(lengths), width), generator=gen)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, width - n:] = 1
        ids[i, :width - n] = 0
    return ids, mask


@pytest.fixture
def replays(monkeypatch):
    """How many decode steps went through a DecodeGraph."""
    import mnemo.modeling.generation as generation

    calls = []

    class Counted(DecodeGraph):
        def __call__(self, input_ids):
            calls.append(input_ids.shape)
            return super().__call__(input_ids)

    monkeypatch.setattr(generation, "DecodeGraph", Counted)
    return calls


@pytest.fixture
def built(monkeypatch):
    """The room (``steps_left``) of every DecodeGraph built, in order."""
    import mnemo.modeling.generation as generation

    rooms = []

    class Counted(DecodeGraph):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            rooms.append(self.steps_left)

    monkeypatch.setattr(generation, "DecodeGraph", Counted)
    return rooms


GRAPHABLE = {
    **{f"mom-{name}": (tiny_mom, overrides) for name, overrides in MOM_GRAPHABLE.items()},
    "titans": (tiny_mc_titans, {"segment_size": None}),
    "titans-conv": (tiny_mc_titans, {"segment_size": None, "conv_size": 3}),
    # segments of 3 tokens: the 7-token prompts and 12 new tokens close several, in the prefill and the steps
    **{f"mc-titans-{name}": (tiny_mc_titans, {"segment_size": 3, **overrides}) for name, overrides in {
        "grm": {}, "ssc": {"aggregation": "ssc"}, "soup": {"aggregation": "soup"}, "residual": {"aggregation": "residual"},
        "independent": {"cache_mode": "independent", "aggregation": "mean"}}.items()},
    **{f"atlas-{preset}": (tiny_atlas, {"preset": preset}) for preset in ("atlas", "omeganet", "dla", "swla")},
    **{f"mc-atlas-{name}": (tiny_atlas, {"segment_size": 3, **overrides}) for name, overrides in {
        "mean": {}, "grm": {"aggregation": "grm"}, "ssc": {"aggregation": "ssc"},
        "omeganet-residual": {"preset": "omeganet", "aggregation": "residual"}}.items()},
    # chunks of 4: the prompts and new tokens close several; the clip acts on most pairs at this init
    "deep-transformer": (tiny_deep_transformer, {}),
    "deep-transformer-gqa-clip": (tiny_deep_transformer, {"num_key_value_heads": 2, "memory_grad_clip": 0.3}),
}


@pytest.mark.parametrize("variant", sorted(GRAPHABLE))
def test_graphed_generation_equals_eager_generation(variant, replays):
    build, overrides = GRAPHABLE[variant]
    model = build(seed=1, **overrides)
    ids, mask = left_padded([7, 3, 5], 7)
    eager = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    graphed = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                             cuda_graph=True)
    assert torch.equal(graphed, eager)
    assert len(replays) == 11  # every new token but the prefill's
    torch.manual_seed(3)
    sampled = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=True, top_k=20, pad_token_id=0)
    torch.manual_seed(3)
    sampled_graphed = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=True, top_k=20,
                                     pad_token_id=0, cuda_graph=True)
    assert torch.equal(sampled_graphed, sampled)


class NoHostReads(TorchDispatchMode):
    """Fails any op that reads a tensor's value back to the host (``item``, ``bool``, ``int``, ``nonzero``):
    a CUDA graph cannot capture one, so a step that passes here can be captured."""

    READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
             torch.ops.aten.masked_select.default}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            raise AssertionError(f"the decode step reads a value back to the host: {func}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("variant", sorted(GRAPHABLE))
def test_the_graphed_step_reads_nothing_back_to_the_host(variant):
    build, overrides = GRAPHABLE[variant]
    model = build(seed=1, **overrides)
    ids, mask = left_padded([7, 3, 5], 7)
    cache = MnemoCache(model.config.num_hidden_layers)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        step = DecodeGraph(model, cache, capture=False)
        token = ids[:, -1:]
        for _ in range(4):
            if not step.matches(cache):  # its room used up: another, as generation makes it
                step = DecodeGraph(model, cache, capture=False)
            with NoHostReads():
                logits = step(token)
            token = logits[:, -1:].argmax(-1)


@pytest.mark.parametrize("build, overrides", [(tiny_mc_titans, {}), (tiny_atlas, {}), (tiny_mom, {"aggregation": "grm"})],
                         ids=["mc-titans", "mc-atlas", "mc-mom"])
def test_graphs_are_captured_again_when_the_cached_memories_outgrow_their_slots(built, build, overrides):
    """A few cached memories get exactly their slots, so every closed segment needs a new graph, and
    generation still gives eager decoding's tokens (the eager step sizes its cache alike)."""
    model = build(seed=1, segment_size=3, **overrides)
    ids, mask = left_padded([7, 3, 5], 7)
    eager = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    graphed = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                             cuda_graph=True)
    assert torch.equal(graphed, eager)
    # steps after 7, 8, ..., 17 tokens: a new slot is needed at 8, 11, 14 and 17 tokens, so graphs are made
    # after 7 (1 step), 8 (3), 11 (3), 14 (3) and 17 (1 of its 3)
    assert built == [1, 3, 3, 3, 3]


@pytest.mark.parametrize("build", [tiny_mc_titans, tiny_atlas], ids=["mc-titans", "mc-atlas"])
def test_a_decode_graph_refuses_to_step_past_its_room(build):
    model = build(seed=1, segment_size=3)
    ids = torch.randint(1, 97, (2, 5), generator=torch.Generator().manual_seed(0))
    cache = MnemoCache(model.config.num_hidden_layers)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
        step = DecodeGraph(model, cache, capture=False)
        assert step.steps_left == 3  # 2 slots after 5 tokens: steps until the 9th token closes a third segment
        for _ in range(3):
            assert step.matches(cache)
            step(ids[:, -1:])
        assert not step.matches(cache)
        with pytest.raises(ValueError, match="room"):
            step(ids[:, -1:])


@pytest.mark.parametrize("build, overrides", [
    (tiny_mom, {}), (tiny_mc_titans, {}), (tiny_atlas, {"segment_size": 6}),
    (tiny_atlas, {"segment_size": 6, "aggregation": "ssc"}), (tiny_mom, {"segment_size": 6, "aggregation": "grm"}),
    (tiny_mom, {"segment_size": 6, "aggregation": "mean"}), (tiny_deep_transformer, {}),
], ids=["mom", "mc-titans", "mc-atlas", "mc-atlas-ssc", "mc-mom-grm", "mc-mom-mean", "deep-transformer"])
def test_decode_graph_steps_in_place_and_match_the_eager_step(build, overrides):
    """The step writes the graph's buffers where they lie (segments of 6 close one on the way; the
    DeepTransformer's chunks of 4 too, its pairs into the room its buffers were given, where the eager step's
    grow by a pair a step). The DeepTransformer's graphed reads pass over the room's masked pairs as well: the
    same weights in a longer sum, so it agrees to float32 rounding (3.7e-8 measured), not bit for bit."""
    deep = build is tiny_deep_transformer
    atol = 1e-6 if deep else 0.0
    model = build(seed=2, **overrides)
    ids = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        eager_cache, graph_cache = MnemoCache(2), MnemoCache(2)
        model(ids[:, :5], past_key_values=eager_cache, use_cache=True)
        model(ids[:, :5], past_key_values=graph_cache, use_cache=True)
        step = DecodeGraph(model, graph_cache, capture=False)
        if deep:
            assert step.steps_left == 256  # its DECODE_ROOM
        addresses = [{n: t.data_ptr() for n, t in layer.states.items()} for layer in graph_cache]
        for t in range(5, 9):
            expected = model(ids[:, t:t + 1], past_key_values=eager_cache, use_cache=True).logits
            torch.testing.assert_close(step(ids[:, t:t + 1]), expected, rtol=0, atol=atol)
            assert graph_cache.get_seq_length() == eager_cache.get_seq_length() == t + 1
            assert step.matches(graph_cache)
        assert [{n: t.data_ptr() for n, t in layer.states.items()} for layer in graph_cache] == addresses
        for eager_layer, graph_layer in zip(eager_cache, graph_cache):
            for name, tensor in eager_layer.states.items():
                got = graph_layer[name]
                if deep and name in ("keys", "values", "us", "eta", "gamma"):  # the pairs, then the room
                    assert got.shape[2] == 5 + 256 and tensor.shape[2] == 9
                    got = got[:, :, :9]
                torch.testing.assert_close(got, tensor, rtol=0, atol=atol, msg=name)
        with pytest.raises(ValueError, match="shape"):
            step(ids[:, :2])


@pytest.mark.parametrize("build, overrides, reason", [
    (tiny_mom, {"num_hidden_layers": 3, "attention_layers": [1], "num_attention_heads": 4}, "attention layers"),
    (tiny_mc_titans, {"segmentation": "logarithmic"}, "logarithmic"),
    (tiny_atlas, {"hybrid": "mag"}, "sliding-window attention"),
    (tiny_deep_transformer, {"learning_rule": "omega", "omega_window": 3}, "omega rule"),
    (tiny_deep_transformer, {"normalize": False}, "unnormalised reads"),
    (tiny_deep_transformer, {"memory_depth": 1}, "memory_depth=1"),
], ids=["mom-hybrid", "mc-titans-log", "atlas-mag", "dot", "deep-transformer-exp", "transformer"])
def test_graphed_generation_refuses_a_growing_state(build, overrides, reason):
    model = build(**overrides)
    with pytest.raises(ValueError, match=reason):
        model.generate(torch.randint(1, 97, (1, 4)), max_new_tokens=2, cuda_graph=True)


def test_deep_transformer_graphs_are_captured_again_when_their_room_is_used_up(built, monkeypatch):
    """Room for 3 pairs a row at a time: the 7-token prompts and 12 new tokens need a graph every 3 steps, and
    generation still gives eager decoding's tokens; a multi-token forward continues the reserved cache too."""
    import mnemo.modeling.deep_attention_layer as layer
    monkeypatch.setattr(layer, "DECODE_ROOM", 3)
    model = tiny_deep_transformer(seed=1)
    ids, mask = left_padded([7, 3, 5], 7)
    eager = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    cache = MnemoCache(model.config.num_hidden_layers)
    graphed = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                             cuda_graph=True, past_key_values=cache)
    assert torch.equal(graphed, eager)
    assert built == [3, 3, 3, 3]  # 11 steps after the prefill: the fourth graph's room outlasts them
    # the reserved buffers (room past every row's pairs) continue through the chunk loop as a grown cache would
    more = torch.randint(1, 97, (3, 5), generator=torch.Generator().manual_seed(4))
    full_mask = torch.cat([mask, torch.ones(3, 11 + 5, dtype=torch.long)], 1)
    with torch.no_grad():
        got = model(more, attention_mask=full_mask, past_key_values=cache, use_cache=True).logits
        want = model(torch.cat([graphed[:, :-1], more], 1), attention_mask=full_mask).logits[:, -5:]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_graphed_generation_refuses_beam_search_and_frees_the_graph():
    model = tiny_mom()
    ids = torch.randint(1, 97, (1, 4))
    with pytest.raises(ValueError, match="beam search"):
        model.generate(ids, max_new_tokens=2, num_beams=2, cuda_graph=True)
    cache = MnemoCache(model.config.num_hidden_layers)
    out = model.generate(ids, max_new_tokens=3, do_sample=False, past_key_values=cache, cuda_graph=True)
    assert out.shape == (1, 7) and cache.decode_graph is None and not cache.decode_graphs
    # the cache continues eagerly, as if it had been decoded eagerly all along
    eager = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert torch.equal(out, eager)


@pytest.mark.parametrize("variant", ["deep-transformer", "deep-transformer-gqa-clip"])
def test_deep_transformer_graphed_steps_take_each_left_padded_rows_own_positions(variant):
    """The graphed step reads its rotary positions from the cache's per-row counts: on a left-padded batch its
    logits equal the eager step's given the attention mask (each row's own tokens counted), to float32
    rounding (its reads also pass over the room's masked pairs); the host's count, which includes the
    padding, moves the padded rows' logits by about 1e-3."""
    build, overrides = GRAPHABLE[variant]
    assert_graphed_decoding_equals_eager(build(seed=1, **overrides), *left_padded([7, 3, 5], 7), atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", sorted(GRAPHABLE))
def test_captured_graph_on_cuda_equals_eager_decoding(variant):
    """A real CUDA graph: replayed steps give eager's logits exactly and generate() eager's tokens (the
    DeepTransformer's to float32 rounding: its graphed reads pass over the room's masked pairs too)."""
    build, overrides = GRAPHABLE[variant]
    ids, mask = (t.cuda() for t in left_padded([7, 3, 5], 7))
    atol = 1e-5 if variant.startswith("deep-transformer") else 0.0
    assert_graphed_decoding_equals_eager(build(seed=1, **overrides).cuda(), ids, mask, atol=atol)


@pytest.fixture
def failing_capture(monkeypatch):
    """CUDA graphs whose warm-up steps run (eagerly, here) and whose capture then fails."""
    import contextlib

    class FakeStream:
        def wait_stream(self, other):
            pass

    def fail(_graph):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda _s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    monkeypatch.setattr(torch.cuda, "graph", fail)


@pytest.mark.usefixtures("failing_capture")
def test_a_step_that_cannot_be_captured_leaves_the_cache_as_the_prefill_left_it():
    """The capture's warm-up steps run for real; when the capture then fails, the cache's tensors, their
    values and its token count are those of the prefill, and the error says what went wrong."""
    model = tiny_mom(seed=2)
    cache = MnemoCache(2)
    with torch.no_grad():
        model(torch.randint(1, 97, (2, 5)), past_key_values=cache, use_cache=True)
    tensors = [dict(layer.states) for layer in cache]
    values = [{n: t.clone() for n, t in layer.states.items()} for layer in cache]
    with pytest.raises(RuntimeError, match="capturing the decode step as a CUDA graph failed"):
        DecodeGraph(model, cache, capture=True)
    assert cache.get_seq_length() == 5
    for layer, before, copies in zip(cache, tensors, values):
        assert layer.states.keys() == before.keys() and all(layer.states[n] is t for n, t in before.items())
        for name, tensor in copies.items():
            assert torch.equal(layer.states[name], tensor), name


@pytest.mark.usefixtures("failing_capture")
def test_a_failed_deep_transformer_capture_leaves_a_cache_that_decodes_as_the_prefill_left_it():
    """The DeepTransformer's pairs are scratch to the capture (``decode_scratch``: no copy of every pair to undo
    the warm-up): its two warm-up pairs stay past each row's count, which is put back with ``W_1`` and the
    chunk bookkeeping, so the next eager step equals one after a plain prefill."""
    model = tiny_deep_transformer(seed=2)
    ids = torch.randint(1, 97, (2, 6), generator=torch.Generator().manual_seed(1))
    caches = MnemoCache(2), MnemoCache(2)
    with torch.no_grad():
        for cache in caches:
            model(ids[:, :5], past_key_values=cache, use_cache=True)
        before = [{n: t.clone() for n, t in layer.states.items()} for layer in caches[1]]
        with pytest.raises(RuntimeError, match="capturing the decode step as a CUDA graph failed"):
            DecodeGraph(model, caches[1], capture=True)
        for layer, copies in zip(caches[1], before):
            for name, tensor in copies.items():
                got = layer.states[name]
                if name in model.decode_scratch:
                    assert got.shape[2] == 5 + 256 and got[:, :, 5:7].abs().sum() > 0  # the warm-up's pairs
                    got = got[:, :, :5]
                assert torch.equal(got, tensor), name
        want, got = (model(ids[:, 5:], past_key_values=cache, use_cache=True).logits for cache in caches)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
