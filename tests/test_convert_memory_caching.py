"""Post-training Memory Caching: a Titans checkpoint becomes MC-Titans, exact inside the first segment."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_atlas, tiny_mc_titans, tiny_mom
from mnemo import AtlasForCausalLM, MCTitansForCausalLM, MoMForCausalLM
from mnemo.cli import main as cli_main
from mnemo.conversion.checkpoint_io import ConversionError
from mnemo.conversion.memory_caching import convert_to_memory_caching

SEGMENT = 7
AGGREGATIONS = ["mean", "residual", "grm", "soup", "ssc"]


@pytest.fixture(scope="module")
def titans_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("titans") / "titans"
    model = tiny_mc_titans(seed=11, segment_size=None)
    with torch.no_grad():  # a trained-looking gate projection, which the conversion must reset
        for layer in model.model.layers:
            layer.attn.u_proj.weight.normal_(0, 1.0)
    model.save_pretrained(path)
    return path


def _logits(model, ids, mask=None):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_conversion_is_exact_in_the_first_segment_and_caches_after(titans_dir, tmp_path, aggregation):
    out = convert_to_memory_caching(titans_dir, tmp_path / "mc", segment_size=SEGMENT, aggregation=aggregation)
    source = MCTitansForCausalLM.from_pretrained(titans_dir).eval()
    converted = MCTitansForCausalLM.from_pretrained(out).eval()
    assert converted.config.segment_size == SEGMENT and converted.config.aggregation == aggregation
    assert "converted_from" in converted.config.to_dict()
    ids = torch.randint(1, 97, (2, 3 * SEGMENT + 2), generator=torch.Generator().manual_seed(0))
    a, b = _logits(source, ids), _logits(converted, ids)
    torch.testing.assert_close(b[:, :SEGMENT], a[:, :SEGMENT], rtol=0, atol=1e-6)
    assert (b[:, SEGMENT:] - a[:, SEGMENT:]).abs().max() > 1e-4  # cached memories are read after it

    src_state, new_state = source.state_dict(), converted.state_dict()
    assert src_state.keys() == new_state.keys()  # no parameter added
    for name, tensor in src_state.items():
        if name.endswith("u_proj.weight") and aggregation in ("grm", "soup", "ssc"):
            assert not new_state[name].any()
        else:
            assert torch.equal(new_state[name], tensor), name

    full = _logits(converted, ids)
    prefix = converted(input_ids=ids[:, :10], use_cache=True)
    steps = [prefix.logits]
    cache = prefix.past_key_values
    with torch.no_grad():
        for t in range(10, ids.shape[1]):
            step = converted(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            steps.append(step.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


def test_gated_aggregations_start_as_the_mean(titans_dir, tmp_path):
    ids = torch.randint(1, 97, (1, 3 * SEGMENT), generator=torch.Generator().manual_seed(1))
    logits = {}
    for aggregation in ("mean", "grm", "soup"):
        out = convert_to_memory_caching(titans_dir, tmp_path / aggregation, segment_size=SEGMENT,
                                        aggregation=aggregation)
        logits[aggregation] = _logits(MCTitansForCausalLM.from_pretrained(out).eval(), ids)
    torch.testing.assert_close(logits["grm"], logits["mean"], rtol=1e-5, atol=1e-5)
    # soup mixes the weights of a deep memory: the same gates, a different read
    assert (logits["soup"] - logits["mean"]).abs().max() > 1e-5


def test_cli_converts_and_refusals_leave_nothing_behind(titans_dir, tmp_path):
    assert cli_main(["convert", "to-mc", str(titans_dir), str(tmp_path / "mc"), "--segment-size", "5",
                     "--aggregation", "grm"]) == 0
    assert MCTitansForCausalLM.from_pretrained(tmp_path / "mc").config.segment_size == 5
    with pytest.raises(ConversionError, match="already caches"):
        convert_to_memory_caching(tmp_path / "mc", tmp_path / "again", segment_size=5)
    mom = tmp_path / "mom"
    tiny_mom().save_pretrained(mom)
    with pytest.raises(ConversionError, match="'grm' is not available for MoM"):
        convert_to_memory_caching(mom, tmp_path / "x", segment_size=5, aggregation="grm")
    atlas = tmp_path / "atlas"
    tiny_atlas().save_pretrained(atlas)
    with pytest.raises(ConversionError, match="'ssc' is not available for Atlas"):
        convert_to_memory_caching(atlas, tmp_path / "x", segment_size=5, aggregation="ssc")
    with pytest.raises(ConversionError, match="only available for Titans"):
        convert_to_memory_caching(atlas, tmp_path / "x", segment_size=5, segmentation="logarithmic")
    with pytest.raises(ConversionError, match="aggregation"):
        convert_to_memory_caching(titans_dir, tmp_path / "y", segment_size=5, aggregation="max")
    with pytest.raises(ConversionError, match="segment_size"):
        convert_to_memory_caching(titans_dir, tmp_path / "z", segment_size=0)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep").write_text("x")
    with pytest.raises(ConversionError, match="not empty"):
        convert_to_memory_caching(titans_dir, tmp_path / "full", segment_size=5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atlas", "full", "mc", "mom"]
    assert cli_main(["convert", "to-mc", str(atlas), str(tmp_path / "w"), "--segment-size", "5",
                     "--aggregation", "grm"]) == 2


RECURRENT_SOURCES = {
    "mom-hybrid": (MoMForCausalLM, lambda: tiny_mom(seed=12, num_hidden_layers=3, attention_layers=[1],
                                                    num_attention_heads=4)),
    "atlas": (AtlasForCausalLM, lambda: tiny_atlas(seed=12)),
    "atlas-mag-dla": (AtlasForCausalLM, lambda: tiny_atlas(seed=12, preset="dla", hybrid="mag")),
}


@pytest.mark.parametrize("aggregation", ["mean", "residual"])
@pytest.mark.parametrize("family", sorted(RECURRENT_SOURCES))
def test_mom_and_atlas_conversion(tmp_path, family, aggregation):
    model_cls, build = RECURRENT_SOURCES[family]
    source = build()
    source.save_pretrained(tmp_path / "src")
    out = convert_to_memory_caching(tmp_path / "src", tmp_path / "mc", segment_size=SEGMENT, aggregation=aggregation)
    converted = model_cls.from_pretrained(out).eval()
    assert (converted.config.segment_size, converted.config.aggregation) == (SEGMENT, aggregation)
    for name, tensor in source.state_dict().items():
        assert torch.equal(converted.state_dict()[name], tensor), name
    assert converted.state_dict().keys() == source.state_dict().keys()
    ids = torch.randint(1, 97, (2, 3 * SEGMENT), generator=torch.Generator().manual_seed(2))
    a, b = _logits(source, ids), _logits(converted, ids)
    torch.testing.assert_close(b[:, :SEGMENT], a[:, :SEGMENT], rtol=0, atol=1e-6)
    assert (b[:, SEGMENT:] - a[:, SEGMENT:]).abs().max() > 1e-4
    with torch.no_grad():
        cached = converted.generate(ids[:, :9], max_new_tokens=12, do_sample=False)
        recomputed = converted.generate(ids[:, :9], max_new_tokens=12, do_sample=False, use_cache=False)
    assert torch.equal(cached, recomputed)
