"""generate() on the recurrent cache: greedy, sampling, beam search, left padding, errors."""

from __future__ import annotations

import pytest
import torch

from mnemo import MnemoCache
from mnemo.modeling.outputs import CACHE_NAME

from conftest import left_pad, tiny_mom


def test_greedy_with_and_without_cache_agree(make_model):
    model = make_model()
    prompt = torch.randint(1, 97, (2, 9))
    cached = model.generate(prompt, max_new_tokens=12, do_sample=False)
    uncached = model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=False)
    assert cached.shape == (2, 21)
    assert torch.equal(cached, uncached)


def test_left_padded_batch_generates_what_each_sample_generates_alone(make_model):
    model = make_model()
    seqs = [torch.randint(1, 97, (n,)) for n in (3, 10, 1, 7)]
    ids, mask = left_pad(seqs)
    batch = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    for i, s in enumerate(seqs):
        alone = model.generate(s[None], max_new_tokens=10, do_sample=False)
        assert torch.equal(batch[i, ids.shape[1]:], alone[0, len(s):]), f"row {i}"


def test_sampling_is_reproducible_and_cache_independent(make_model):
    model = make_model()
    prompt = torch.randint(1, 97, (3, 5))
    outs = []
    for use_cache in (True, False):
        torch.manual_seed(7)
        outs.append(model.generate(prompt, max_new_tokens=15, do_sample=True, top_k=20, use_cache=use_cache))
    assert torch.equal(*outs)


def test_num_return_sequences_expands_the_batch(make_model):
    model = make_model()
    prompt = torch.randint(1, 97, (2, 4))
    torch.manual_seed(0)
    out = model.generate(prompt, max_new_tokens=6, do_sample=True, num_return_sequences=3)
    assert out.shape == (6, 10)
    assert torch.equal(out[:, :4], prompt.repeat_interleave(3, 0))


@pytest.mark.parametrize("variant", [{}, {"num_hidden_layers": 3, "attention_layers": [0], "num_attention_heads": 4}])
def test_beam_search_reorders_states(variant):
    """Beam search through the cache equals beam search by recomputation: states follow their beams."""
    model = tiny_mom(**variant)
    prompt = torch.randint(1, 97, (2, 6))
    kwargs = dict(max_new_tokens=10, num_beams=4, num_return_sequences=2, do_sample=False, early_stopping=False)
    cached = model.generate(prompt, **kwargs)
    uncached = model.generate(prompt, use_cache=False, **kwargs)
    assert cached.shape == (4, 16)
    assert torch.equal(cached, uncached)


def test_cache_batch_operations():
    model = tiny_mom()
    ids = torch.randint(1, 97, (2, 5))
    cache = model(ids, use_cache=True).past_key_values
    rec = cache[0]["recurrent"].clone()
    cache.batch_repeat_interleave(2)
    assert torch.equal(cache[0]["recurrent"], rec.repeat_interleave(2, 0))
    cache.reorder_cache(torch.tensor([3, 0, 1, 2]))
    assert torch.equal(cache[0]["recurrent"][1], rec[0]) and torch.equal(cache[0]["recurrent"][0], rec[1])
    cache.batch_select_indices(torch.tensor([1]))
    assert torch.equal(cache[0]["recurrent"], rec[:1])
    assert cache.get_seq_length() == 5 and isinstance(cache, MnemoCache)
    with pytest.raises(NotImplementedError):
        cache.crop(3)


def test_generation_continues_from_a_returned_cache(make_model):
    model = make_model()
    prompt = torch.randint(1, 97, (1, 8))
    out = model.generate(prompt, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    # generate()'s output names the cache as the installed transformers does (cache since 5.24)
    more = model.generate(out.sequences, cache=getattr(out, CACHE_NAME), max_new_tokens=4, do_sample=False)
    direct = model.generate(prompt, max_new_tokens=9, do_sample=False)
    assert torch.equal(more, direct)


def test_right_padding_is_rejected_with_advice(make_model):
    model = make_model()
    ids = torch.randint(1, 97, (2, 5))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="left padding"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3)


def test_inputs_embeds_generation_matches_ids(make_model):
    model = make_model()
    prompt = torch.randint(1, 97, (2, 6))
    a = model.generate(prompt, max_new_tokens=5, do_sample=False)
    b = model.generate(inputs_embeds=model.get_input_embeddings()(prompt), max_new_tokens=5, do_sample=False)
    assert torch.equal(a[:, 6:], b)


def test_models_are_stateful_generators(make_model):
    model = make_model()
    assert model.can_generate() and model._is_stateful
    assert not model._supports_default_dynamic_cache()


def test_the_cache_answers_to_both_names():
    """transformers 5.24 renamed ``past_key_values`` to ``cache``: outputs and ``forward`` take either name."""
    model = tiny_mom()
    ids = torch.randint(1, 97, (2, 11))
    full = model(ids).logits
    with torch.no_grad():
        out = model(ids[:, :7], use_cache=True)
        assert isinstance(out.cache, MnemoCache) and out.past_key_values is out.cache
        by_new_name = model(ids[:, 7:], cache=out.cache).logits
    with torch.no_grad():
        out = model(ids[:, :7], use_cache=True)
        by_old_name = model(ids[:, 7:], past_key_values=out.cache).logits
        with pytest.raises(ValueError, match="once"):
            model(ids[:, 7:], cache=out.cache, past_key_values=MnemoCache(model.config.num_hidden_layers))
    torch.testing.assert_close(by_new_name, full[:, 7:], rtol=1e-5, atol=1e-5)
    assert torch.equal(by_new_name, by_old_name)
    generated = model.generate(ids, max_new_tokens=3, do_sample=False, cache=MnemoCache(model.config.num_hidden_layers))
    assert torch.equal(generated, model.generate(ids, max_new_tokens=3, do_sample=False))


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")  # the name of the report
def test_a_transformers_cache_passed_in_starts_a_mnemo_cache():
    """``generate(..., past_key_values=DynamicCache())`` (what transformers' examples pass) decodes on a fresh
    MnemoCache; a transformers cache that already holds tokens is refused, saying what to pass."""
    from transformers import DynamicCache

    model = tiny_mom()
    prompt = torch.randint(1, 97, (2, 6))
    expected = model.generate(prompt, max_new_tokens=4, do_sample=False)
    assert torch.equal(model.generate(prompt, past_key_values=DynamicCache(), max_new_tokens=4, do_sample=False),
                       expected)
    assert torch.equal(model.generate(prompt, cache=DynamicCache(), max_new_tokens=4, do_sample=False), expected)
    assert torch.equal(model.generate(prompt, cache=DynamicCache(), max_new_tokens=4, do_sample=False,
                                      cuda_graph=True), expected)
    out = model(prompt, past_key_values=DynamicCache(), use_cache=True)
    assert isinstance(out.cache, MnemoCache) and out.cache.get_seq_length() == 6
    torch.testing.assert_close(out.logits, model(prompt).logits, rtol=0, atol=0)

    used = DynamicCache()
    used.update(torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 3, 4), layer_idx=0)
    with pytest.raises(ValueError, match="MnemoCache"):
        model(prompt, cache=used, use_cache=True)
