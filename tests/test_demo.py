"""The demo's pieces on tiny settings: models, training, the table, JSON/CSV, the plot, reproducibility."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from mnemo import AtlasForCausalLM, DeepTransformerForCausalLM, MCTitansForCausalLM, MoMForCausalLM
from mnemo.demo import (
    BASELINE,
    FAMILIES,
    DemoSettings,
    FamilyResult,
    build_model,
    heldout_set,
    plot_results,
    read_results,
    results_table,
    run_demo,
    train_family,
    write_results,
)


def tiny_settings(**overrides) -> DemoSettings:
    base = dict(vocab_size=24, hidden_size=32, num_heads=2, num_layers=1, seq_len=16, num_pairs=3, num_queries=4,
                distinct_queries=False, batch_size=8, steps=4, eval_every=2, eval_samples=16, warmup_steps=2,
                device="cpu")
    base.update(overrides)
    return DemoSettings.quick(**base)


@pytest.fixture(scope="module")
def demo_run():
    """Every family trained for a few steps (shared by the reporting tests)."""
    return run_demo(tiny_settings(), progress=False)


def test_settings():
    quick, default = DemoSettings.quick(), DemoSettings.default()
    assert set(quick.families) == set(FAMILIES) and BASELINE in FAMILIES
    assert default.steps > quick.steps and default.seq_len >= quick.seq_len
    assert default.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert DemoSettings.quick(steps=3).steps == 3
    assert json.loads(json.dumps(quick.to_dict()))["families"] == list(FAMILIES)


def test_models_of_every_family():
    settings = tiny_settings()
    classes = {"MoM": MoMForCausalLM, "Atlas": AtlasForCausalLM, "DeepTransformer": DeepTransformerForCausalLM,
               "MC-Titans": MCTitansForCausalLM, BASELINE: MoMForCausalLM}
    for name in FAMILIES:
        model = build_model(name, settings)
        assert type(model) is classes[name]
        assert model.config.vocab_size == settings.vocab_size and model.config.hidden_size == settings.hidden_size
    mom, baseline = build_model("MoM", settings).config, build_model(BASELINE, settings).config
    assert mom.num_memories > 1 and mom.topk > 1 and mom.shared_memory
    assert (baseline.num_memories, baseline.topk, baseline.shared_memory) == (1, 1, False)
    assert build_model("DeepTransformer", settings).config.memory_depth == 2
    # same seed, same initial weights
    first, second = build_model("MoM", settings), build_model("MoM", settings)
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters()))
    with pytest.raises(ValueError, match="unknown family"):
        build_model("LSTM", settings)


def _heldout_loss(model, settings) -> float:
    ids, labels = heldout_set(settings)
    with torch.no_grad():
        return float(model(ids, labels=labels).loss)


def test_head_dim_narrows_every_state_bound_memory():
    """``head_dim`` sets the key width of every recurrent memory; gated-delta values stay head-wide."""
    settings = tiny_settings(head_dim=8)  # hidden 32, 2 heads: heads 16 wide
    for name in ("MoM", BASELINE, "Atlas", "MC-Titans"):
        assert build_model(name, settings).config.head_dim == 8, name
    for name in ("MoM", BASELINE):
        config = build_model(name, settings).config
        assert config.head_dim * config.expand_v == 16
    attention = build_model("DeepTransformer", settings).config
    assert attention.hidden_size // attention.num_attention_heads == 16
    assert build_model(BASELINE, tiny_settings()).config.head_dim == 16
    default = DemoSettings.default()
    # The default asks the baseline to keep at least as many keys apart as its key width.
    assert default.head_dim <= default.num_pairs and default.head_dim < default.hidden_size // default.num_heads


def test_parallel_workers_give_the_sequential_results():
    """Families trained in worker processes come back with the results and weights of a sequential run
    (on a CPU, every process that trains uses one thread)."""
    settings = tiny_settings(families=("MoM", BASELINE), steps=3)
    sequential, seq_models = run_demo(settings, progress=False)
    parallel, par_models = run_demo(settings, progress=False, workers=2)
    assert [r.family for r in parallel] == list(settings.families)
    for a, b in zip(sequential, parallel):
        assert (a.curve, a.final_loss, a.parameters) == (b.curve, b.final_loss, b.parameters)
    for name in settings.families:
        assert par_models[name].config.mqar_task == seq_models[name].config.mqar_task
        expected = seq_models[name].state_dict()
        for key, value in par_models[name].state_dict().items():
            assert torch.equal(value, expected[key]), (name, key)
    with pytest.raises(ValueError, match="workers"):
        run_demo(settings, progress=False, workers=0)


def test_training_changes_the_weights_and_reduces_the_loss():
    settings = tiny_settings(steps=25, eval_every=25, learning_rate=1e-2)
    model = build_model(BASELINE, settings)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss_before = _heldout_loss(model, settings)
    result = train_family(BASELINE, model, settings, progress=False)
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    assert _heldout_loss(model, settings) < loss_before - 0.1
    assert [step for step, _ in result.curve] == [0, 25]
    assert result.final_accuracy == result.curve[-1][1] and 0.0 <= result.final_accuracy <= 1.0
    assert result.parameters == sum(p.numel() for p in model.parameters())
    assert result.train_seconds > 0 and result.tokens_per_second > 0
    assert model.config.mqar_task == {"seq_len": 16, "num_pairs": 3, "num_queries": 4, "vocab_size": 24,
                                      "distinct_queries": False}
    assert not model.training


def test_training_is_reproducible():
    settings = tiny_settings(steps=3, eval_every=1)
    runs = [train_family("MoM", build_model("MoM", settings), settings, progress=False) for _ in range(2)]
    assert runs[0].curve == runs[1].curve and runs[0].final_loss == runs[1].final_loss
    other = train_family("MoM", build_model("MoM", tiny_settings(steps=3, eval_every=1, seed=5)),
                         tiny_settings(steps=3, eval_every=1, seed=5), progress=False)
    assert other.final_loss != runs[0].final_loss


def test_a_non_finite_gradient_skips_the_step():
    settings = tiny_settings(steps=3, eval_every=3)
    model = build_model(BASELINE, settings)
    calls = []

    def poison_first(grad):
        calls.append(1)
        return grad * float("nan") if len(calls) == 1 else grad

    model.lm_head.weight.register_hook(poison_first)
    result = train_family(BASELINE, model, settings, progress=False)
    assert result.skipped_steps == 1 and len(calls) == 3
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_progress_bar(capsys):
    settings = tiny_settings(steps=2, eval_every=1, families=(BASELINE,))
    train_family(BASELINE, build_model(BASELINE, settings), settings, progress=True)
    assert "2/2" in capsys.readouterr().err


def test_results_table_lists_every_family(demo_run):
    results, models = demo_run
    assert [r.family for r in results] == list(FAMILIES) and set(models) == set(FAMILIES)
    table = results_table(results)
    lines = table.splitlines()
    assert len(lines) == 2 + len(FAMILIES)
    assert len({len(line) for line in lines}) == 1, "columns are aligned"
    for header in ("family", "params", "MQAR accuracy", "train time", "tokens/s"):
        assert header in lines[0]
    for r in results:
        row = next(line for line in lines if line.startswith(f"| {r.family} "))
        assert f"{r.parameters:,}" in row and f"{100 * r.final_accuracy:.1f}%" in row


def test_json_and_csv_round_trip(demo_run, tmp_path):
    results, _ = demo_run
    json_path, csv_path = write_results(results, tmp_path / "out", tiny_settings())
    assert read_results(json_path) == results
    payload = json.loads(json_path.read_text())
    assert payload["settings"]["num_pairs"] == 3
    with csv_path.open() as handle:
        rows = list(csv.DictReader(handle))
    assert [row["family"] for row in rows] == list(FAMILIES)
    for row, r in zip(rows, results):
        assert int(row["parameters"]) == r.parameters
        assert float(row["final_accuracy"]) == r.final_accuracy
        assert float(row["train_seconds"]) == pytest.approx(r.train_seconds)


def test_plot_is_a_png(demo_run, tmp_path):
    pytest.importorskip("matplotlib")
    results, _ = demo_run
    path = plot_results(results, tmp_path / "plots" / "mqar.png")
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000


def test_result_from_dict():
    r = FamilyResult("MoM", "d", 10, 2, 0.5, 1.0, 1.5, 100.0, [(0, 0.1), (2, 0.5)])
    assert FamilyResult.from_dict(json.loads(json.dumps(r.__dict__))) == r


def test_cli_demo_end_to_end_exports_and_reloads_without_mnemo(tmp_path, capsys):
    """``mnemo demo`` as a user runs it (few steps): table, files, plot, export, reload without mnemo."""
    from mnemo.cli import main

    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--steps", "2", "--output", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    for family in ("MoM", "Atlas", "DeepTransformer", "MC-Titans", "Gated DeltaNet"):
        assert f"| {family}" in printed
    assert "same as the in-package model: True" in printed
    assert (out / "accuracy.png").read_bytes().startswith(b"\x89PNG")
    assert {"results.json", "results.csv", "best-model"} <= {p.name for p in out.iterdir()}
    assert (out / "best-model" / "model.safetensors").is_file()
    # A second run into the same folder is refused before training, unless --overwrite says to replace them.
    second = ["demo", "--quick", "--steps", "1", "--output", str(out), "--no-progress"]
    before = (out / "results.json").read_text()
    assert main(second) == 2 and "--overwrite" in capsys.readouterr().err
    assert (out / "results.json").read_text() == before
    assert main([*second, "--overwrite", "--no-export"]) == 0
    assert json.loads((out / "results.json").read_text())["results"][0]["steps"] == 1


@pytest.mark.parametrize("argv", [["--workers", "0"], ["--steps", "-3"]])
def test_cli_demo_refuses_counts_below_one(argv, capsys):
    from mnemo.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--quick", *argv])
    assert exit_info.value.code == 2 and "must be >= 1" in capsys.readouterr().err
