"""Post-training Memory Caching: Titans, MoM and Atlas checkpoints become their Memory Caching variants, exact
inside the first segment, with every aggregation."""

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
    atlas = tmp_path / "atlas"
    tiny_atlas().save_pretrained(atlas)
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
    with pytest.raises(ConversionError, match="ssc_topk"):
        convert_to_memory_caching(atlas, tmp_path / "t", segment_size=5, aggregation="ssc", ssc_topk=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atlas", "full", "mc"]
    assert cli_main(["convert", "to-mc", str(atlas), str(tmp_path / "w"), "--segment-size", "5",
                     "--aggregation", "grm"]) == 0
    assert AtlasForCausalLM.from_pretrained(tmp_path / "w").config.aggregation == "grm"
    assert cli_main(["convert", "to-mc", str(atlas), str(tmp_path / "w2"), "--segment-size", "5",
                     "--segmentation", "logarithmic"]) == 2
    assert not (tmp_path / "w2").exists()


RECURRENT_SOURCES = {
    "mom-hybrid": (MoMForCausalLM, lambda: tiny_mom(seed=12, num_hidden_layers=3, attention_layers=[1],
                                                    num_attention_heads=4)),
    "atlas": (AtlasForCausalLM, lambda: tiny_atlas(seed=12)),
    "atlas-mag-dla": (AtlasForCausalLM, lambda: tiny_atlas(seed=12, preset="dla", hybrid="mag")),
}


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("family", sorted(RECURRENT_SOURCES))
def test_mom_and_atlas_conversion(tmp_path, family, aggregation):
    model_cls, build = RECURRENT_SOURCES[family]
    source = build()
    source.save_pretrained(tmp_path / "src")
    out = convert_to_memory_caching(tmp_path / "src", tmp_path / "mc", segment_size=SEGMENT, aggregation=aggregation,
                                    ssc_topk=1)
    converted = model_cls.from_pretrained(out).eval()
    assert (converted.config.segment_size, converted.config.aggregation) == (SEGMENT, aggregation)
    assert converted.config.ssc_topk == 1
    for name, tensor in source.state_dict().items():
        assert torch.equal(converted.state_dict()[name], tensor), name
    added = converted.state_dict().keys() - source.state_dict().keys()
    if aggregation in ("grm", "soup", "ssc"):  # one zero gate projection per memory layer
        assert added and all(name.endswith(".u_proj.weight") for name in added)
        assert all(not converted.state_dict()[name].any() for name in added)
    else:
        assert not added
    ids = torch.randint(1, 97, (2, 3 * SEGMENT), generator=torch.Generator().manual_seed(2))
    a, b = _logits(source, ids), _logits(converted, ids)
    torch.testing.assert_close(b[:, :SEGMENT], a[:, :SEGMENT], rtol=0, atol=1e-6)
    assert (b[:, SEGMENT:] - a[:, SEGMENT:]).abs().max() > 1e-4
    with torch.no_grad():
        cached = converted.generate(ids[:, :9], max_new_tokens=12, do_sample=False)
        recomputed = converted.generate(ids[:, :9], max_new_tokens=12, do_sample=False, use_cache=False)
    assert torch.equal(cached, recomputed)


@pytest.mark.parametrize("family", sorted(RECURRENT_SOURCES))
def test_gated_conversion_of_mom_and_atlas_reads_as_the_mean(tmp_path, family):
    """A zero gate projection scores every memory alike: grm and ssc read as mean (ties kept in ssc); soup too
    for MoM's matrix memories, and the converted gates train."""
    model_cls, build = RECURRENT_SOURCES[family]
    build().save_pretrained(tmp_path / "src")
    ids = torch.randint(1, 97, (2, 4 * SEGMENT), generator=torch.Generator().manual_seed(3))
    models = {a: model_cls.from_pretrained(convert_to_memory_caching(
        tmp_path / "src", tmp_path / a, segment_size=SEGMENT, aggregation=a, ssc_topk=1)).eval()
        for a in ("mean", "grm", "ssc", "soup")}
    logits = {a: _logits(m, ids) for a, m in models.items()}
    torch.testing.assert_close(logits["grm"], logits["mean"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits["ssc"], logits["mean"], rtol=1e-5, atol=1e-5)
    if family.startswith("mom"):
        torch.testing.assert_close(logits["soup"], logits["mean"], rtol=1e-5, atol=1e-5)
    grm = models["grm"].train()
    grm(input_ids=ids, labels=ids).loss.backward()
    gates = [p.grad for n, p in grm.named_parameters() if n.endswith(".u_proj.weight")]
    assert gates and all(g is not None and g.abs().sum() > 0 for g in gates)
