"""Synthetic tasks (MQAR, passkey, perplexity) and ``mnemo eval`` on tiny models of every family."""

from __future__ import annotations

import argparse
import json
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from conftest import tiny_atlas, tiny_deep_transformer, tiny_mc_titans, tiny_mom
from mnemo.cli import UsageError
from mnemo.evaluation import add_eval_parser, evaluate, format_results, parse_depths, parse_length, parse_lengths
from mnemo.tasks import (
    FILLER_ID,
    FILLER_START,
    IGNORE_INDEX,
    NEEDLE_ID,
    NUM_RESERVED,
    PASSKEY_FILLER,
    PASSKEY_INTRO,
    PASSKEY_QUESTION,
    SEPARATOR_ID,
    MQARLayout,
    answer_accuracy,
    extract_digits,
    mqar_accuracy,
    mqar_batch,
    mqar_min_length,
    passkey_text_accuracy,
    passkey_text_sample,
    passkey_token_accuracy,
    passkey_token_sample,
    perplexity,
)

FAMILIES = {
    "mom": tiny_mom,
    "atlas": tiny_atlas,
    "deep-transformer": tiny_deep_transformer,
    "mc-titans": tiny_mc_titans,
}


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def word_tokenizer():
    """A word-level tokenizer built offline: the passkey texts' words, digits one by one, and a few specials."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    text = PASSKEY_INTRO + PASSKEY_FILLER + "The pass key is . Remember it. is the pass key. " + PASSKEY_QUESTION
    words = sorted({word for word, _ in pre_tokenizers.Whitespace().pre_tokenize_str(text)})
    vocab = {"[PAD]": 0, "[UNK]": 1, "[EOS]": 2}
    for token in [str(d) for d in range(10)] + words:
        vocab.setdefault(token, len(vocab))
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]")


# ---------------------------------------------------------------------------------------------------------------------
# MQAR
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seq_len", [None, 40])
@pytest.mark.parametrize("distinct", [True, False])
def test_mqar_invariants(seq_len, distinct):
    B, N, Q, V = 16, 6, 5 if distinct else 9, 40
    ids, labels = mqar_batch(B, N, Q, V, _gen(3), seq_len=seq_len, distinct_queries=distinct)
    length = seq_len or mqar_min_length(N, Q)
    assert ids.shape == labels.shape == (B, length) and ids.dtype == labels.dtype == torch.long
    layout = MQARLayout(V)
    is_key = (ids >= layout.key_start) & (ids < layout.value_start)
    is_value = ids >= layout.value_start
    assert layout.key_start == NUM_RESERVED and layout.value_start + layout.num_values == V
    for b in range(B):
        row, lab = ids[b].tolist(), labels[b].tolist()
        keys, values = row[0:2 * N:2], row[1:2 * N:2]
        assert all(is_key[b, 0:2 * N:2]) and all(is_value[b, 1:2 * N:2])
        assert len(set(keys)) == N, "context keys are distinct"
        assert row[2 * N] == SEPARATOR_ID
        pairs = dict(zip(keys, values))
        answers = [p for p, t in enumerate(lab) if t != IGNORE_INDEX]
        assert len(answers) == Q
        queried = []
        for p in answers:
            key = row[p - 1]
            assert p - 1 > 2 * N, "queries come after the context"
            assert lab[p] == row[p] == pairs[key], "the label is the input token: the model shifts"
            assert row[:p - 1].count(key) >= 1 and row[:2 * N].count(key) == 1, "the key appears once in the context"
            queried.append(key)
        if distinct:
            assert len(set(queried)) == Q
        # the query region holds the queries, their answers and filler, nothing else
        region = [t for p, t in enumerate(row) if p > 2 * N and p not in answers and p + 1 not in answers]
        assert set(region) <= {FILLER_ID}
    # keys and values come from disjoint ranges
    assert not (is_key & is_value).any()


def test_mqar_is_deterministic_per_seed_and_validates():
    a = mqar_batch(4, 4, 4, 30, _gen(1), seq_len=32)
    b = mqar_batch(4, 4, 4, 30, _gen(1), seq_len=32)
    c = mqar_batch(4, 4, 4, 30, _gen(2), seq_len=32)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    with pytest.raises(ValueError, match="too short"):
        mqar_batch(2, 4, 4, 30, _gen(), seq_len=10)
    with pytest.raises(ValueError, match="vocab_size"):
        mqar_batch(2, 20, 4, 30, _gen())
    with pytest.raises(ValueError, match="num_queries"):
        mqar_batch(2, 4, 5, 30, _gen())


class RecallOracle(nn.Module):
    """Predicts, at every position, the value paired with the current token in the context (or a fixed token)."""

    def __init__(self, vocab_size: int, num_pairs: int, shift: int = 0) -> None:
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab_size)
        self.num_pairs, self.shift = num_pairs, shift
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, **kwargs):
        B, T = input_ids.shape
        logits = torch.zeros(B, T, self.config.vocab_size)
        for b in range(B):
            row = input_ids[b].tolist()
            pairs = dict(zip(row[0:2 * self.num_pairs:2], row[1:2 * self.num_pairs:2]))
            for t in range(T):
                source = row[max(t - self.shift, 0)]
                logits[b, t, pairs.get(source, 0)] = 1.0
        return SimpleNamespace(logits=logits)


def test_mqar_accuracy_scores_the_answers_only():
    N, V = 5, 40
    assert mqar_accuracy(RecallOracle(V, N), N, 4, seq_len=30, num_samples=16, seed=0) == 1.0
    # an oracle that looks one token back answers at the wrong positions: never right
    assert mqar_accuracy(RecallOracle(V, N, shift=1), N, 4, seq_len=30, num_samples=16, seed=0) == 0.0
    ids, labels = mqar_batch(8, N, N, V, _gen(), distinct_queries=False)
    assert answer_accuracy(RecallOracle(V, N), ids, labels, batch_size=3) == 1.0


# ---------------------------------------------------------------------------------------------------------------------
# Passkey
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_passkey_token_sample_layout(depth):
    length, V = 80, 60
    s = passkey_token_sample(length, depth, V, _gen(5), num_digits=6)
    ids = s.input_ids
    assert ids.shape == (length,) and ids[-1] == SEPARATOR_ID
    filler_len = length - 6 - 2 - 1
    assert s.needle_position == round(depth * filler_len)
    p = s.needle_position
    assert ids[p] == NEEDLE_ID and ids[p + 7] == NEEDLE_ID
    assert torch.equal(ids[p + 1:p + 7], s.answer_ids)
    assert "".join(str(int(t) - NUM_RESERVED) for t in s.answer_ids) == s.passkey and len(s.passkey) == 6
    rest = torch.cat([ids[:p], ids[p + 8:-1]])
    assert rest.numel() == filler_len and bool((rest >= FILLER_START).all() and (rest < V).all())
    again = passkey_token_sample(length, depth, V, _gen(5), num_digits=6)
    assert torch.equal(again.input_ids, ids)
    with pytest.raises(ValueError):
        passkey_token_sample(5, depth, V, _gen())


class NeedleCopier(nn.Module):
    """Reads the needle's digits and recites them after the separator."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab_size)
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, **kwargs):
        row = input_ids[0].tolist()
        logits = torch.zeros(1, len(row), self.config.vocab_size)
        start = row.index(NEEDLE_ID) + 1
        digits = row[start:row.index(NEEDLE_ID, start)]
        sep = row.index(SEPARATOR_ID)
        for i, d in enumerate(digits):
            if sep + i < len(row):
                logits[0, sep + i, d] = 1.0
        return SimpleNamespace(logits=logits)


def test_passkey_token_accuracy_checks_every_digit():
    samples = [passkey_token_sample(40, d, 50, _gen(i)) for i, d in enumerate([0.0, 0.5, 1.0])]
    assert passkey_token_accuracy(NeedleCopier(50), samples) == 1.0
    assert passkey_token_accuracy(RecallOracle(50, 0), samples) == 0.0


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_passkey_text_sample(depth):
    tok = word_tokenizer()
    s = passkey_text_sample(tok, 300, depth, _gen(2))
    assert s.passkey in s.needle and s.needle in s.prompt and len(s.passkey) == 5
    assert s.prompt.startswith(PASSKEY_INTRO) and s.prompt.endswith(PASSKEY_QUESTION)
    assert s.filler_before == round(depth * s.filler_total) and s.filler_total > 5
    # the needle sits after exactly filler_before filler sentences
    assert s.prompt.index(s.needle) == len(PASSKEY_INTRO) + s.filler_before * len(PASSKEY_FILLER)
    n_tokens = len(tok(s.prompt, add_special_tokens=False)["input_ids"])
    assert 300 - 2 * len(tok(PASSKEY_FILLER)["input_ids"]) < n_tokens <= 300
    assert passkey_text_sample(tok, 300, depth, _gen(2)).prompt == s.prompt


def test_extract_digits():
    assert extract_digits(" 7 1 4 3 2. Remember") == "71432"
    assert extract_digits("is 123 and 45") == "123"
    assert extract_digits("none") == ""


def test_passkey_text_accuracy_generates():
    tok = word_tokenizer()
    model = tiny_deep_transformer(vocab_size=len(tok))
    samples = [passkey_text_sample(tok, 120, 0.5, _gen(i)) for i in range(2)]
    accuracy = passkey_text_accuracy(model, tok, samples)
    assert 0.0 <= accuracy <= 1.0


# ---------------------------------------------------------------------------------------------------------------------
# Perplexity
# ---------------------------------------------------------------------------------------------------------------------

TEXT = PASSKEY_FILLER * 2 + "The pass key is 12345. " + PASSKEY_QUESTION + " 12345."


def test_perplexity_is_exp_of_the_mean_loss():
    tok = word_tokenizer()
    model = tiny_mom(vocab_size=len(tok), aux_loss_coef=0.0)  # the model's own loss is then the LM loss alone
    ids = tok(TEXT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = math.exp(float(model(ids, labels=ids).loss))
    result = perplexity(model, tok, TEXT, context_length=ids.shape[1] + 5)
    assert result["tokens"] == ids.shape[1] - 1
    assert result["perplexity"] == pytest.approx(expected, rel=1e-5)


def test_sliding_window_perplexity_matches_a_masked_label_loop():
    tok = word_tokenizer()
    model = tiny_deep_transformer(vocab_size=len(tok))
    ids = tok(TEXT, return_tensors="pt")["input_ids"][0]
    L, stride = 24, 10
    # independently: each window's labels are -100 except the tokens it adds; the model's loss averages them
    nll, count, prev_end = 0.0, 0, 0
    with torch.no_grad():
        for end in [L] + list(range(L + stride, ids.numel() + stride, stride)):
            end = min(end, ids.numel())
            begin = max(0, end - L)
            window = ids[begin:end][None]
            labels = window.clone()
            labels[0, :max(prev_end - begin, 1)] = IGNORE_INDEX
            n = int((labels[0, 1:] != IGNORE_INDEX).sum())
            nll += float(model(window, labels=labels).loss) * n
            count += n
            prev_end = end
            if end == ids.numel():
                break
    result = perplexity(model, tok, TEXT, context_length=L, stride=stride)
    assert count == result["tokens"] == ids.numel() - 1
    assert result["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-5)
    # a longer context changes the number: the windows are really cut
    assert result["perplexity"] != pytest.approx(perplexity(model, tok, TEXT, context_length=200)["perplexity"])


def test_perplexity_errors():
    model = tiny_mom()
    with pytest.raises(ValueError, match="tokenizer"):
        perplexity(model, None, TEXT)
    with pytest.raises(ValueError, match="stride"):
        perplexity(model, word_tokenizer(), TEXT, context_length=8, stride=8)
    with pytest.raises(ValueError, match="tokenizer"):
        evaluate(model, "ppl", text=TEXT)


# ---------------------------------------------------------------------------------------------------------------------
# evaluate and the eval subcommand
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_evaluate_every_family(family):
    model = FAMILIES[family]()
    result = evaluate(model, "mqar", length=30, pairs=4, queries=3, samples=8, seed=1)
    assert result["task"] == "mqar" and 0.0 <= result["accuracy"] <= 1.0
    assert (result["length"], result["pairs"], result["queries"], result["vocab_size"]) == (30, 4, 3, 97)
    again = evaluate(model, "mqar", length=30, pairs=4, queries=3, samples=8, seed=1)
    assert again["accuracy"] == result["accuracy"]
    passkey = evaluate(model, "passkey", lengths="16,24", depths=[0.0, 1.0], samples=1, digits=3)
    assert passkey["form"] == "token" and len(passkey["cells"]) == 4
    assert {(c["length"], c["depth"]) for c in passkey["cells"]} == {(16, 0.0), (16, 1.0), (24, 0.0), (24, 1.0)}
    json.dumps([result, passkey])  # serialisable as they are
    assert result["model"] in format_results(result) and "passkey" in format_results(passkey)


def test_evaluate_uses_the_trained_task_and_loads_folders(tmp_path):
    model = tiny_mc_titans()
    model.config.mqar_task = {"seq_len": 26, "num_pairs": 3, "num_queries": 5, "vocab_size": 40,
                              "distinct_queries": False}
    model.save_pretrained(tmp_path / "model")
    result = evaluate(tmp_path / "model", "mqar", samples=4)
    assert (result["length"], result["pairs"], result["queries"], result["vocab_size"]) == (26, 3, 5, 40)
    assert result["distinct_queries"] is False
    assert result["model"] == "MCTitansForCausalLM" and result["source"].endswith("model")
    assert evaluate(tmp_path / "model", "mqar", samples=4, length=30)["length"] == 30


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mnemo")
    add_eval_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def test_eval_subcommand_mqar_and_passkey(tmp_path, capsys):
    tiny_atlas().save_pretrained(tmp_path / "atlas")
    out = tmp_path / "out" / "mqar.json"
    args = _parser().parse_args(["eval", str(tmp_path / "atlas"), "mqar", "--length", "30", "--pairs", "4",
                                 "--samples", "8", "--output", str(out), "--device", "cpu"])
    assert args.func(args) == 0
    saved = json.loads(out.read_text())
    assert saved["task"] == "mqar" and saved["length"] == 30 and saved["samples"] == 8
    assert "accuracy" in capsys.readouterr().out
    args = _parser().parse_args(["eval", str(tmp_path / "atlas"), "passkey", "--lengths", "24,0.03125k",
                                 "--depths", "0,0.5", "--samples", "1", "--digits", "2"])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "passkey (token)" in printed and "32" in printed


def test_eval_task_as_an_option(tmp_path, capsys):
    """``--task mqar`` works as the positional task does; no task, or two different ones, is an error."""
    tiny_atlas().save_pretrained(tmp_path / "atlas")
    common = ["--length", "30", "--pairs", "4", "--samples", "4", "--device", "cpu"]
    args = _parser().parse_args(["eval", str(tmp_path / "atlas"), "--task", "mqar", *common])
    assert args.func(args) == 0 and "accuracy" in capsys.readouterr().out
    args = _parser().parse_args(["eval", str(tmp_path / "atlas"), "mqar", "--task", "mqar", *common])
    assert args.func(args) == 0
    for argv, problem in ((["eval", str(tmp_path / "atlas")], "name the task"),
                          (["eval", str(tmp_path / "atlas"), "mqar", "--task", "ppl"], "two different tasks")):
        args = _parser().parse_args(argv)
        with pytest.raises(UsageError, match=problem):
            args.func(args)


def test_eval_subcommand_ppl_with_a_saved_tokenizer(tmp_path, capsys):
    tok = word_tokenizer()
    folder = tmp_path / "lm"
    tiny_deep_transformer(vocab_size=len(tok)).save_pretrained(folder)
    tok.save_pretrained(folder)
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    args = _parser().parse_args(["eval", str(folder), "ppl", "--text", str(text), "--context-length", "16",
                                 "--stride", "8", "--output", str(tmp_path / "ppl.json")])
    assert args.func(args) == 0
    saved = json.loads((tmp_path / "ppl.json").read_text())
    assert saved["perplexity"] > 1.0 and saved["tokens"] == len(tok(TEXT)["input_ids"]) - 1
    assert "perplexity" in capsys.readouterr().out
    text_form = evaluate(str(folder), "passkey", lengths="100", depths="0.5", samples=1)
    assert text_form["form"] == "text"


def test_length_parsing():
    assert parse_length("1k") == 1024 and parse_length("16K") == 16384 and parse_length("1.5k") == 1536
    assert parse_length("500") == 500
    assert parse_lengths("1k,4k,16k") == [1024, 4096, 16384]
    assert parse_depths("0,0.5,1") == [0.0, 0.5, 1.0]
    for bad in ("k", "abc", "0", "1.3"):
        with pytest.raises(ValueError):
            parse_length(bad)
    with pytest.raises(ValueError):
        parse_depths("1.5")
    with pytest.raises(ValueError, match="unknown task"):
        evaluate(tiny_mom(), "glue")
