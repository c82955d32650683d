"""The ``mnemo`` command line as a newcomer meets it: one-line errors found before any work, an output folder
that is never overwritten unasked, progress bars on terminals only, options that do what ``--help`` says, the
demo's threads, and ``mnemo push`` (its flags reach huggingface_hub; its failures are one line)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mnemo.demo
import mnemo.evaluation
from conftest import tiny_mom
from mnemo.cli import UsageError, build_parser, main
from mnemo.demo import BASELINE, DemoSettings, FamilyResult, run_demo, threads_per_worker

ROOT = Path(__file__).resolve().parents[1]


def error_line(capsys, command: str) -> str:
    """The one line a user mistake prints: ``mnemo <command>: error: ...`` and nothing else."""
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"mnemo {command}: error: "), err
    return err


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny MoM saved as a folder, without a tokenizer, with a recorded MQAR task (as mnemo demo leaves it)."""
    folder = tmp_path_factory.mktemp("cli") / "mom"
    model = tiny_mom()
    model.config.mqar_task = {"seq_len": 26, "num_pairs": 3, "num_queries": 5, "vocab_size": 40,
                              "distinct_queries": False}
    model.save_pretrained(folder)
    return folder


@pytest.fixture
def no_loading(monkeypatch):
    """Make loading a model an error: what is refused must be refused before anything loads."""

    def refuse(*_args, **_kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(mnemo.evaluation, "load_model", refuse)


@pytest.fixture
def no_training(monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("training started before the output folder was checked")

    monkeypatch.setattr(mnemo.demo, "run_demo", refuse)


def fake_results(steps: int = 1) -> list[FamilyResult]:
    return [FamilyResult("MoM", "d", 10, steps, 0.5, 1.0, 0.1, 100.0, [(0, 0.1), (steps, 0.5)])]


# ---------------------------------------------------------------------------------------------------------------------
# 1. One clear line instead of a traceback, before anything loads
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["eval", "export"])
@pytest.mark.usefixtures("no_loading")
def test_a_missing_model_folder_is_one_line(command, tmp_path, capsys):
    missing = tmp_path / "no" / "such" / "dir"
    argv = ["eval", str(missing), "mqar"] if command == "eval" else ["export", str(missing), str(tmp_path / "out")]
    assert main(argv) == 2
    assert "no such folder" in error_line(capsys, command)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("config, problem", [(None, "has no config.json"), ({}, "names no model_type"),
                                             ({"model_type": "zzz"}, "'zzz' model")])
@pytest.mark.usefixtures("no_loading")
def test_a_folder_without_a_model_is_one_line(config, problem, tmp_path, capsys):
    folder = tmp_path / "model"
    folder.mkdir()
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    for argv, command in ((["eval", str(folder), "mqar"], "eval"), (["export", str(folder), str(tmp_path / "o")], "export")):
        assert main(argv) == 2
        assert problem in error_line(capsys, command)


def test_export_refuses_a_model_that_is_not_mnemo_and_a_full_output(model_dir, tmp_path, capsys):
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert main(["export", str(llama), str(tmp_path / "out")]) == 2
    assert "not a mnemo one" in error_line(capsys, "export")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("keep")
    assert main(["export", str(model_dir), str(full)]) == 2
    assert "not empty" in error_line(capsys, "export")
    assert [p.name for p in full.iterdir()] == ["keep.txt"]


@pytest.mark.usefixtures("no_loading")
def test_perplexity_without_a_tokenizer_is_refused_before_loading(model_dir, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("some text to score")
    assert main(["eval", str(model_dir), "ppl", "--text", str(text)]) == 2
    assert "has no tokenizer" in error_line(capsys, "eval")
    assert main(["eval", str(model_dir), "ppl"]) == 2
    assert "--text FILE" in error_line(capsys, "eval")
    assert main(["eval", str(model_dir), "ppl", "--text", str(tmp_path / "missing.txt")]) == 2
    assert "no such file" in error_line(capsys, "eval")


@pytest.mark.parametrize("option, value, problem", [
    ("--lengths", "1x", "cannot read '1x' as a length"),
    ("--depths", "2", "outside [0, 1]"),
    ("--depths", "middle", "as a depth"),
    ("--lengths", ",", "at least one length"),
    ("--samples", "0", "must be >= 1"),
])
@pytest.mark.usefixtures("no_loading")
def test_bad_options_are_refused_before_loading(option, value, problem, model_dir, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", str(model_dir), "passkey", option, value])
    assert exit_info.value.code == 2
    line = error_line(capsys, "eval")
    assert f"argument {option}" in line and problem in line and "--help" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
@pytest.mark.usefixtures("no_loading", "no_training")
def test_cuda_without_a_gpu_is_refused_before_any_work(model_dir, tmp_path, capsys):
    assert main(["eval", str(model_dir), "mqar", "--device", "cuda"]) == 2
    line = error_line(capsys, "eval")
    assert "no CUDA GPU" in line and "--device cpu" in line
    assert main(["demo", "--quick", "--device", "cuda", "--output", str(tmp_path / "demo")]) == 2
    assert "use --device cpu" in error_line(capsys, "demo")
    assert main(["eval", str(model_dir), "mqar", "--device", "gpu0"]) == 2
    assert "not a device name" in error_line(capsys, "eval")
    assert not (tmp_path / "demo").exists()


def test_task_options_that_do_not_fit_the_model_are_one_line(model_dir, capsys):
    assert main(["eval", str(model_dir), "mqar", "--pairs", "10", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = [line for line in err.splitlines() if line.startswith("mnemo eval: error:")]
    assert len(line) == 1 and "too short" in line[0] and "--length" in line[0]


@pytest.mark.usefixtures("no_loading")
def test_no_task_or_two_tasks_are_one_line(model_dir, capsys):
    assert main(["eval", str(model_dir)]) == 2
    assert "name the task" in error_line(capsys, "eval")
    assert main(["eval", str(model_dir), "mqar", "--task", "ppl"]) == 2
    assert "two different tasks" in error_line(capsys, "eval")


def test_debug_and_its_environment_variable_show_the_traceback(tmp_path, monkeypatch, capsys):
    missing = str(tmp_path / "missing")
    for argv in (["--debug", "eval", missing, "mqar"], ["eval", missing, "mqar", "--debug"]):
        with pytest.raises(UsageError, match="no such folder"):
            main(argv)
    monkeypatch.setenv("MNEMO_DEBUG", "1")
    with pytest.raises(UsageError):
        main(["eval", missing, "mqar"])
    monkeypatch.setenv("MNEMO_DEBUG", "0")
    assert main(["eval", missing, "mqar"]) == 2
    error_line(capsys, "eval")


def test_the_installed_command_prints_one_line_and_exits_2(tmp_path):
    """What a user sees in a shell: one line on stderr, exit code 2, no traceback."""
    done = subprocess.run([sys.executable, "-m", "mnemo", "eval", str(tmp_path / "no" / "such"), "mqar"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"mnemo eval: error: {tmp_path / 'no' / 'such'}: no such folder; give a model folder (one that holds "
        "config.json) or a Hub id such as owner/name"]


# ---------------------------------------------------------------------------------------------------------------------
# 2. The demo's output folder: checked before training, never overwritten without --overwrite
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("no_training")
def test_demo_refuses_an_output_that_is_a_file(tmp_path, capsys):
    target = tmp_path / "results"
    target.write_text("mine")
    assert main(["demo", "--quick", "--output", str(target)]) == 2
    assert "is a file" in error_line(capsys, "demo")
    assert main(["demo", "--quick", "--output", str(target / "sub")]) == 2
    assert "is a file" in error_line(capsys, "demo")
    assert target.read_text() == "mine"


@pytest.mark.usefixtures("no_training")
def test_demo_refuses_to_overwrite_an_earlier_run(tmp_path, capsys):
    out = tmp_path / "demo"
    out.mkdir()
    (out / "results.json").write_text("earlier")
    assert main(["demo", "--quick", "--output", str(out), "--no-export"]) == 2
    assert "--overwrite" in error_line(capsys, "demo")
    assert (out / "results.json").read_text() == "earlier"


@pytest.mark.usefixtures("no_training")
def test_demo_refuses_a_best_model_it_did_not_write_even_with_overwrite(tmp_path, capsys):
    out = tmp_path / "demo"
    (out / "best-model").mkdir(parents=True)
    (out / "best-model" / "notes.txt").write_text("mine")
    assert main(["demo", "--quick", "--output", str(out), "--overwrite"]) == 2
    assert "not written by mnemo demo" in error_line(capsys, "demo")
    assert (out / "best-model" / "notes.txt").read_text() == "mine"


def test_demo_overwrite_replaces_the_results_and_the_header_counts_steps(tmp_path, capsys, monkeypatch):
    out = tmp_path / "demo"
    out.mkdir()
    (out / "results.json").write_text("earlier")
    monkeypatch.setattr(mnemo.demo, "run_demo", lambda settings, **_: (fake_results(settings.steps), {}))
    assert main(["demo", "--quick", "--steps", "1", "--output", str(out), "--overwrite", "--no-export",
                 "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "1 training step per model" in printed and "1 training steps" not in printed
    assert json.loads((out / "results.json").read_text())["results"][0]["family"] == "MoM"


# ---------------------------------------------------------------------------------------------------------------------
# 3. Progress bars on a terminal, off with --no-progress or when stderr is not a terminal
# ---------------------------------------------------------------------------------------------------------------------


def _eval_passkey(model_dir, *extra) -> int:
    return main(["eval", str(model_dir), "passkey", "--lengths", "24", "--depths", "0,1", "--samples", "2",
                 "--digits", "2", "--device", "cpu", *extra])


def test_eval_shows_a_bar_on_a_terminal_only(model_dir, capsys, monkeypatch):
    assert _eval_passkey(model_dir) == 0
    assert "/4" not in capsys.readouterr().err, "stderr is not a terminal here: no bar"
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert _eval_passkey(model_dir) == 0
    err = capsys.readouterr().err
    assert "passkey" in err and "/4" in err
    assert "Loading weights" not in err, "a small model loads without transformers' bar"
    assert _eval_passkey(model_dir, "--no-progress") == 0
    assert "/4" not in capsys.readouterr().err


def test_scoring_loops_take_a_bar(capsys):
    from mnemo.tasks import mqar_accuracy

    model = tiny_mom()
    quiet = mqar_accuracy(model, 3, 3, seq_len=20, num_samples=6, batch_size=4, seed=1)
    assert capsys.readouterr().err == ""
    assert mqar_accuracy(model, 3, 3, seq_len=20, num_samples=6, batch_size=4, seed=1, progress=True) == quiet
    assert "mqar" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------------
# 4. Options that do what --help says
# ---------------------------------------------------------------------------------------------------------------------


def test_pairs_alone_asks_as_many_queries_as_pairs(model_dir, tmp_path, capsys):
    out = tmp_path / "mqar.json"
    assert main(["eval", str(model_dir), "mqar", "--pairs", "4", "--length", "30", "--samples", "4",
                 "--output", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert (saved["pairs"], saved["queries"], saved["length"]) == (4, 4, 30)
    assert main(["eval", str(model_dir), "mqar", "--samples", "4", "--output", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert (saved["pairs"], saved["queries"], saved["length"]) == (3, 5, 26), "the recorded task, when not changed"
    capsys.readouterr()


def _all_parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all_parsers(sub)


def test_every_argument_has_help_text():
    missing = [f"{parser.prog} {action.dest}" for parser in _all_parsers(build_parser()) for action in parser._actions
               if not isinstance(action, argparse._SubParsersAction) and not action.help]
    assert missing == []


def test_info_prints_aligned_columns(capsys):
    assert main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    column = lines[0].index("model_type")
    for line in lines[2:]:
        assert line[column:].startswith("mnemo_") and line[column - 2:column] == "  ", line


# ---------------------------------------------------------------------------------------------------------------------
# 6-8. A CPU install, the demo's threads, the demo's folder in .gitignore
# ---------------------------------------------------------------------------------------------------------------------


def test_cpu_users_install_the_cpu_torch_wheels_first():
    cpu_index = "https://download.pytorch.org/whl/cpu"
    readme = (ROOT / "README.md").read_text()
    assert cpu_index in readme and readme.index(cpu_index) < readme.index("pip install -e .")
    assert cpu_index in (ROOT / ".ci" / "run").read_text()


def test_the_cpu_demo_trains_on_one_thread_and_gives_the_callers_back(monkeypatch):
    seen = []
    real = mnemo.demo.train_family

    def record(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(mnemo.demo, "train_family", record)
    settings = DemoSettings.quick(vocab_size=24, hidden_size=32, num_layers=1, seq_len=16, num_pairs=3,
                                  batch_size=4, steps=1, eval_every=1, eval_samples=4, families=(BASELINE,))
    callers = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        run_demo(settings, progress=False)
        assert seen == [1] and torch.get_num_threads() == 2
        run_demo(settings, progress=False, threads=2)
        assert seen == [1, 2]
    finally:
        torch.set_num_threads(callers)
    assert threads_per_worker("cpu", 1) == threads_per_worker("cpu", 4) == 1


def test_the_demo_folder_is_ignored_by_git():
    assert "mnemo-demo/" in (ROOT / ".gitignore").read_text().splitlines()


# ---------------------------------------------------------------------------------------------------------------------
# mnemo push: its flags reach huggingface_hub, its failures are one line
# ---------------------------------------------------------------------------------------------------------------------


class FakeApi:
    """Stands in for huggingface_hub.HfApi: records the calls; ``failure`` is raised by create_repo."""

    calls: list = []
    failure: BaseException | None = None

    def __init__(self, token=None):
        FakeApi.calls.append(("init", {"token": token}))

    def create_repo(self, repo_id, **kwargs):
        if FakeApi.failure is not None:
            raise FakeApi.failure
        FakeApi.calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))

    def create_branch(self, repo_id, **kwargs):
        FakeApi.calls.append(("create_branch", {"repo_id": repo_id, **kwargs}))

    def upload_folder(self, **kwargs):
        FakeApi.calls.append(("upload_folder", kwargs))
        return "https://huggingface.co/me/model/commit/abc"


@pytest.fixture
def fake_hub(monkeypatch):
    import huggingface_hub

    FakeApi.calls, FakeApi.failure = [], None
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    return FakeApi


@pytest.fixture
def exported(tmp_path) -> Path:
    folder = tmp_path / "hub"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "mnemo_mom", "auto_map": {}}))
    return folder


def test_push_passes_its_flags_to_the_hub(fake_hub, exported, capsys):
    assert main(["push", str(exported), "me/model", "--token", "hf_x", "--private", "--revision", "dev",
                 "--commit-message", "first model", "--create-pr"]) == 0
    calls = dict(fake_hub.calls)
    assert calls["init"] == {"token": "hf_x"}
    assert calls["create_repo"]["private"] is True
    upload = calls["upload_folder"]
    assert (upload["repo_id"], upload["commit_message"], upload["revision"], upload["create_pr"]) == (
        "me/model", "first model", "dev", True)
    assert "pull request" in capsys.readouterr().out
    fake_hub.calls = []
    assert main(["push", str(exported), "me/model", "--revision", "dev"]) == 0
    calls = dict(fake_hub.calls)
    assert calls["create_branch"]["branch"] == "dev" and calls["upload_folder"]["create_pr"] is False
    assert calls["upload_folder"]["commit_message"] == "Upload mnemo model"


def _http():
    """The HTTP library huggingface_hub raises from (httpx, or the httpx2 of newer releases)."""
    from huggingface_hub.errors import Response

    return sys.modules[Response.__module__.split(".")[0]]


def _hub_http_error(status: int):
    from huggingface_hub.errors import HfHubHTTPError

    http = _http()
    response = http.Response(status, request=http.Request("POST", "https://huggingface.co/api/repos/create"))
    return HfHubHTTPError(f"{status} Client Error: something\nRequest ID: x", response=response)


def _failures():
    from huggingface_hub import errors

    yield pytest.param(lambda: errors.LocalTokenNotFoundError("Token is required"), "HF_TOKEN", id="no-token")
    yield pytest.param(lambda: _hub_http_error(401), "HTTP 401", id="bad-token")
    yield pytest.param(lambda: _hub_http_error(403), "HTTP 403", id="no-write-access")
    yield pytest.param(lambda: _hub_http_error(500), "HTTP 500", id="server-error")
    yield pytest.param(lambda: _http().ConnectError("[Errno -2] Name or service not known"), "network", id="httpx")
    yield pytest.param(lambda: ConnectionError("refused"), "network", id="socket")
    if hasattr(errors, "OfflineModeIsEnabled"):
        yield pytest.param(lambda: errors.OfflineModeIsEnabled("offline"), "HF_HUB_OFFLINE", id="offline")
    try:
        import requests
    except ImportError:
        return
    yield pytest.param(lambda: requests.exceptions.ConnectionError("no route"), "network", id="requests")


@pytest.mark.parametrize("make_error, problem", list(_failures()))
def test_push_failures_are_one_line(make_error, problem, fake_hub, exported, capsys):
    fake_hub.failure = make_error()
    assert main(["push", str(exported), "me/model"]) == 2
    assert problem in error_line(capsys, "push")
    assert not any(name == "upload_folder" for name, _ in fake_hub.calls)
    with pytest.raises(UsageError) as raised:
        main(["push", str(exported), "me/model", "--debug"])
    assert raised.value.__cause__ is fake_hub.failure


def test_push_refuses_what_is_not_an_exported_folder_before_the_network(fake_hub, tmp_path, exported, capsys):
    assert main(["push", str(tmp_path / "missing"), "me/model"]) == 2
    assert "no such folder" in error_line(capsys, "push")
    assert main(["push", str(tmp_path), "me/model"]) == 2
    assert "mnemo export" in error_line(capsys, "push")
    assert main(["push", str(exported), "not a repo id"]) == 2
    assert "owner/name" in error_line(capsys, "push")
    assert fake_hub.calls == []


def test_an_unexpected_error_still_shows_its_traceback(fake_hub, exported):
    fake_hub.failure = RuntimeError("a bug")
    with pytest.raises(RuntimeError, match="a bug"):
        main(["push", str(exported), "me/model"])
