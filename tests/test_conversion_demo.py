"""The Memory Caching conversion demo on toy settings: the conversion is exact inside the first segment for every
family of the demo (as converted and after the gates' fine-tuning, which trains nothing else), and the demo runs
end to end: rows, table, JSON, plot, the refusal of existing results."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from mnemo.conversion_demo import (
    AGGREGATIONS,
    FAMILIES,
    SOURCE,
    ConversionDemoSettings,
    _task,
    add_arguments,
    build_source,
    check_output_dir,
    convert,
    demo_settings,
    finetune_gates,
    gate_parameters,
    main_from_args,
    passkey_accuracy,
    passkey_batch,
    read_results,
    results_table,
    run_conversion_demo,
    settings_from_args,
    summarize,
    train,
)


def toy_settings(**overrides) -> ConversionDemoSettings:
    base = dict(train_length=12, length_multiples=(1, 3), vocab_size=24, hidden_size=16, num_layers=1,
                passkey_digits=3, mqar_pairs=2, batch_size=4, steps=2, warmup_steps=1, finetune_steps=2,
                finetune_length_multiple=2, finetune_batch_size=2, eval_samples=4, device="cpu")
    base.update(overrides)
    return ConversionDemoSettings.quick(**base)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_model_is_its_source_inside_the_first_segment(family, tmp_path):
    """Every aggregation, gated ones before and after the gates' fine-tuning, gives the source's logits on the first
    L tokens and differs after them; the fine-tuning changes the gate projections and nothing else."""
    settings = toy_settings(finetune_learning_rate=0.5)
    L = settings.train_length
    source = build_source(family, settings, seed=3).eval()
    assert getattr(source.config, "segment_size", None) is None
    with torch.no_grad():  # a source whose memories hold something: writes and reads far from their init
        for name, parameter in source.named_parameters():
            if "embed" in name:
                parameter.normal_(0, 1.0)
    source.save_pretrained(tmp_path / "source")
    ids = torch.randint(0, settings.vocab_size, (2, 3 * L), generator=torch.Generator().manual_seed(0))
    expected = _logits(source, ids)
    task = _task("passkey", settings)
    for aggregation in AGGREGATIONS:
        model = convert(tmp_path / "source", tmp_path / aggregation, aggregation, settings)
        assert (model.config.segment_size, model.config.aggregation) == (L, aggregation)
        logits = _logits(model, ids)
        torch.testing.assert_close(logits[:, :L], expected[:, :L], rtol=0, atol=1e-6)
        assert (logits[:, L:] - expected[:, L:]).abs().max() > 1e-4, aggregation
        if aggregation in ("grm", "ssc"):
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            summary = finetune_gates(model, task, settings, seed=0)
            gates = gate_parameters(model)
            assert summary["trainable_parameters"] == sum(p.numel() for p in gates.values()) > 0
            for name, parameter in model.named_parameters():
                changed = not torch.equal(parameter, before[name])
                assert changed == (name in gates), name
            tuned = _logits(model, ids)
            torch.testing.assert_close(tuned[:, :L], expected[:, :L], rtol=0, atol=1e-6)
            assert (tuned[:, L:] - logits[:, L:]).abs().max() > 1e-5  # the trained gates are read after it
        else:
            assert not gate_parameters(model) or family == "Titans"  # only Titans carries u_proj unconverted


def test_passkey_batch_and_accuracy():
    settings = toy_settings(train_length=20, passkey_digits=4)
    ids, labels = passkey_batch(6, 20, settings, torch.Generator().manual_seed(1), depths=[0.0, 1.0])
    assert ids.shape == labels.shape == (6, 20)
    answer = labels != -100
    assert torch.equal(answer.sum(1), torch.full((6,), 4)) and answer[:, -4:].all()
    assert torch.equal(ids[answer], labels[answer])
    assert (ids[:, -5] == 1).all()  # the separator asks the question

    class Oracle(torch.nn.Module):
        """Predicts each next token: all passkeys right, or all wrong when ``wrong``."""

        def __init__(self, wrong: bool = False):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))
            self.wrong = wrong

        def forward(self, input_ids, **_kwargs):
            nxt = torch.roll(input_ids, -1, dims=1) + (1 if self.wrong else 0)
            return argparse.Namespace(logits=torch.nn.functional.one_hot(nxt % 30, 30).float())

    assert passkey_accuracy(Oracle(), ids, labels, batch_size=4) == 1.0
    assert passkey_accuracy(Oracle(wrong=True), ids, labels, batch_size=4) == 0.0


def test_settings_are_checked():
    quick, default = ConversionDemoSettings.quick(), ConversionDemoSettings.default()
    assert quick.tasks == ("passkey",) and set(default.tasks) == {"passkey", "mqar"}
    assert quick.eval_lengths == tuple(quick.train_length * m for m in (1, 2, 4, 8, 16))
    assert default.train_length > quick.train_length and default.steps > quick.steps
    assert json.loads(json.dumps(quick.to_dict()))["families"] == list(FAMILIES)
    for bad in (dict(families=("LSTM",)), dict(tasks=("ppl",)), dict(aggregations=("max",)), dict(steps=0),
                dict(train_length=6), dict(tasks=("mqar",), train_length=12, mqar_pairs=4),
                dict(finetune_steps=-1), dict(seeds=())):
        with pytest.raises(ValueError):
            ConversionDemoSettings.quick(**bad)


def _row(family, aggregation, seed, length, accuracy):
    return {"task": "passkey", "family": family, "aggregation": aggregation, "seed": seed, "length": length,
            "length_multiple": length // 8, "accuracy": accuracy, "parameters_added": 0,
            "trainable_parameters": 0, "finetune_steps": 0}


def test_summary_and_table_give_mean_and_spread_over_seeds():
    by_seed = {0: (1.0, 0.2), 1: (0.8, 0.4), 2: (0.9, 0.0)}  # accuracy at 8 and 16 tokens
    rows = [_row("Titans", SOURCE, seed, length, at[i]) for seed, at in by_seed.items()
            for i, length in enumerate((8, 16))]
    summary = {(s["aggregation"], s["length"]): s for s in summarize(rows)}
    assert summary[(SOURCE, 8)]["mean"] == pytest.approx(0.9)
    assert summary[(SOURCE, 8)]["std"] == pytest.approx(0.1)  # sample standard deviation over the 3 seeds
    assert summary[(SOURCE, 16)]["accuracies"] == [0.2, 0.4, 0.0]
    table = results_table(rows)
    assert "| Titans" in table and "90 ± 10" in table and "20 ± 20" in table and "3 seeds" in table
    lines = [line for line in table.splitlines() if line.startswith("|")]
    assert len({len(line) for line in lines}) == 1, "columns are aligned"
    assert " 90% |" in results_table([_row("Titans", SOURCE, 0, 8, 0.9)])  # one seed: no spread


def test_existing_results_are_refused_before_training(tmp_path, monkeypatch, capsys):
    (tmp_path / "results.json").write_text("{}")
    with pytest.raises(FileExistsError, match="overwrite"):
        check_output_dir(tmp_path)
    assert check_output_dir(tmp_path, overwrite=True) == tmp_path
    import mnemo.conversion_demo as module

    monkeypatch.setattr(module, "run_family", lambda *a, **k: pytest.fail("trained despite the refusal"))
    with pytest.raises(FileExistsError):
        run_conversion_demo(toy_settings(), tmp_path, progress=False)
    parser = argparse.ArgumentParser()
    for flag in ("--quick", "--no-progress"):
        parser.add_argument(flag, action="store_true")
    for option, default in (("--output", None), ("--device", None), ("--seed", 0), ("--steps", None)):
        parser.add_argument(option, default=default, type=type(default) if default is not None else None)
    add_arguments(parser)
    args = parser.parse_args(["--conversion", "--quick", "--seeds", "3", "--seed", "2", "--output", str(tmp_path)])
    assert args.conversion and settings_from_args(args).seeds == (2, 3, 4)
    assert settings_from_args(args).tasks == ConversionDemoSettings.quick().tasks
    assert main_from_args(args) == 2 and "overwrite" in capsys.readouterr().err


def test_demo_end_to_end(tmp_path):
    """Both tasks, every family and aggregation, two lengths: rows, exactness at L, files."""
    settings = toy_settings(tasks=("passkey", "mqar"), check_every=1)  # one validation check, short of the target
    rows = run_conversion_demo(settings, tmp_path / "out", progress=False, workers=1)
    variants = 1 + len(settings.aggregations)
    assert len(rows) == 2 * len(FAMILIES) * variants * 2
    for task in settings.tasks:
        for family in FAMILIES:
            mine = [r for r in rows if r["task"] == task and r["family"] == family]
            assert {r["aggregation"] for r in mine} == {SOURCE, *settings.aggregations}
            at_l = {r["accuracy"] for r in mine if r["length"] == settings.train_length}
            assert len(at_l) == 1, (task, family, at_l)  # inside the first segment every variant is the source
            for r in mine:
                assert 0.0 <= r["accuracy"] <= 1.0
                gated = r["aggregation"] in ("grm", "ssc")
                assert r["finetune_steps"] == (settings.finetune_steps if gated else 0)
                assert (r["trainable_parameters"] > 0) == gated
                assert (r["parameters_added"] > 0) == (gated and family != "Titans")
                assert r["source_steps"] == settings.steps
    out = tmp_path / "out"
    assert read_results(out / "results.json") == json.loads(json.dumps(rows))
    payload = json.loads((out / "results.json").read_text())
    assert payload["settings"]["train_length"] == 12 and len(payload["summary"]) == len(rows)
    assert "mqar accuracy" in (out / "results.md").read_text()
    assert (out / "accuracy.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    with pytest.raises(FileExistsError):
        run_conversion_demo(settings, out, progress=False)


@pytest.mark.slow  # two spawned processes import torch and transformers: about a minute on two shared cores
def test_workers_give_the_sequential_numbers(tmp_path):
    """Runs in worker processes (one thread each) give the rows of a sequential run with one thread."""
    settings = toy_settings(families=("Gated DeltaNet",), aggregations=("mean", "grm"), seeds=(0, 1))
    sequential = run_conversion_demo(settings, tmp_path / "one", progress=False, workers=1, threads=1)
    parallel = run_conversion_demo(settings, tmp_path / "two", progress=False, workers=2, threads=1)
    keys = ("task", "family", "aggregation", "seed", "length", "accuracy", "train_loss")
    assert [tuple(r.get(k) for k in keys) for r in parallel] == [tuple(r.get(k) for k in keys) for r in sequential]
    assert {r["seed"] for r in parallel} == {0, 1}


def test_training_stops_once_the_source_is_done():
    settings = toy_settings(steps=9)
    task = _task("passkey", settings)
    schedule = demo_settings(settings, 0)
    calls = []

    def done() -> bool:
        calls.append(1)
        return len(calls) == 2

    model = build_source("Gated DeltaNet", settings, 0)
    summary = train(model, task, schedule, settings.train_length, 2, torch.Generator().manual_seed(0), done=done,
                    check_every=3)
    assert summary["steps"] == 6 and len(calls) == 2 and not model.training
    assert train(model, task, schedule, settings.train_length, 2, torch.Generator().manual_seed(0))["steps"] == 9


def test_the_command_line_runs_the_conversion_demo_and_checks_its_output_first(tmp_path, capsys, monkeypatch):
    """``mnemo demo --conversion`` reaches this demo, whose output check comes before any training."""
    from mnemo import cli, conversion_demo

    monkeypatch.setattr(conversion_demo, "run_conversion_demo",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("trained before checking")))
    taken = tmp_path / "a-file"
    taken.write_text("keep me")
    assert cli.main(["demo", "--conversion", "--quick", "--output", str(taken)]) == 2
    assert "mnemo demo --conversion: error:" in capsys.readouterr().err
    assert taken.read_text() == "keep me"


def test_the_command_line_has_the_conversion_options():
    """``mnemo demo`` parses the options the conversion demo reads; adding them again changes nothing."""
    from mnemo.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["demo", "--conversion", "--quick", "--seeds", "2", "--seed", "1", "--steps", "7"])
    assert args.conversion and args.output is None
    settings = settings_from_args(args)
    assert (settings.seeds, settings.steps, settings.tasks) == ((1, 2), 7, ("passkey",))
    demo = next(a for a in parser._subparsers._group_actions if a.dest == "command").choices["demo"]
    add_arguments(demo)  # already there: no conflict
