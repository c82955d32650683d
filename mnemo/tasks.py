"""Synthetic recall tasks and perplexity: what the memory models are for, measured.

Three probes, all seeded through a :class:`torch.Generator` so that the same seed
gives the same data on every machine:

- **MQAR** (multi-query associative recall, as in Zoology): a context of
  key-value pairs, then queries that repeat a key and expect its value.
  :func:`mqar_batch` makes batches; :func:`mqar_accuracy` scores a model.
- **Passkey retrieval** (S-NIAH-1): a passkey of digits hidden at a chosen depth
  in filler. :func:`passkey_text_sample` is the text form for models with a
  tokenizer, :func:`passkey_token_sample` the token-id form for models without
  one; :func:`passkey_text_accuracy` and :func:`passkey_token_accuracy` score them.
- **Perplexity** of a text under a model with a tokenizer, over sliding windows:
  :func:`perplexity`.

The scoring loops take ``progress=True`` for a tqdm bar on stderr (:func:`progress_bar`).

Labels follow the transformers causal-LM convention: ``labels`` is aligned with
``input_ids`` (``labels[t]`` is the token at ``t``, or ``-100`` where no loss is
taken) and the model shifts them internally, predicting ``labels[t]`` from the
tokens before ``t``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

IGNORE_INDEX = -100

# Reserved low ids shared by the token-id tasks. Everything from NUM_RESERVED up is task content.
PAD_ID = 0
SEPARATOR_ID = 1  # MQAR: ends the context; passkey: starts the question
FILLER_ID = 2  # MQAR: the gaps between queries
NEEDLE_ID = 3  # passkey: marks the needle, before and after its digits
NUM_RESERVED = 4


def progress_bar(total: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar over ``total`` units on stderr (a no-op one when not ``enabled``); it vanishes once done."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, leave=False, dynamic_ncols=True)


# ---------------------------------------------------------------------------------------------------------------------
# MQAR
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MQARLayout:
    """Which ids are keys and which are values for a vocabulary of ``vocab_size``.

    Ids ``[0, NUM_RESERVED)`` are reserved (pad, separator, filler, needle); keys are
    ``[NUM_RESERVED, value_start)`` and values ``[value_start, vocab_size)``, the
    remaining vocabulary split in two halves (keys take the smaller one when it is odd).
    """

    vocab_size: int

    @property
    def key_start(self) -> int:
        return NUM_RESERVED

    @property
    def value_start(self) -> int:
        return NUM_RESERVED + (self.vocab_size - NUM_RESERVED) // 2

    @property
    def num_keys(self) -> int:
        return self.value_start - self.key_start

    @property
    def num_values(self) -> int:
        return self.vocab_size - self.value_start


def mqar_min_length(num_pairs: int, num_queries: int) -> int:
    """Shortest MQAR sequence: the pairs, the separator, the queries with their answers."""
    return 2 * num_pairs + 1 + 2 * num_queries


def mqar_batch(
    batch_size: int,
    num_pairs: int,
    num_queries: int,
    vocab_size: int,
    generator: torch.Generator | None = None,
    seq_len: int | None = None,
    distinct_queries: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of MQAR sequences ``(input_ids, labels)``, both ``(batch_size, seq_len)`` long tensors.

    Each row is ``k_1 v_1 ... k_N v_N SEP`` followed by a query region: ``num_queries``
    of the ``N`` keys, each immediately followed by its value. With ``distinct_queries``
    (Zoology's form) the queried keys are distinct and in random order; without, each
    query picks a pair uniformly, so keys may be queried again and a model cannot
    narrow the answer down by ruling out values it has already been asked for.

    When ``seq_len`` exceeds :func:`mqar_min_length` the queries are scattered at
    random positions of the region and the gaps hold ``FILLER_ID``, so that the
    distance between a pair and its query varies. Keys within a row are distinct, so
    every queried key appears in the context exactly once, before the query. Values
    are drawn independently (they may repeat). ``labels`` hold the answer value at
    every answer position and ``-100`` elsewhere (the model shifts them).
    """
    layout = MQARLayout(vocab_size)
    if num_pairs < 1 or num_queries < 1:
        raise ValueError(f"num_pairs and num_queries must be >= 1, got {num_pairs} and {num_queries}")
    if distinct_queries and num_queries > num_pairs:
        raise ValueError(f"num_queries ({num_queries}) must be <= num_pairs ({num_pairs}): queried keys are distinct")
    if layout.num_keys < num_pairs or layout.num_values < 1:
        raise ValueError(
            f"vocab_size={vocab_size} leaves {layout.num_keys} key ids for {num_pairs} distinct keys; "
            f"use vocab_size >= {NUM_RESERVED + 2 * num_pairs}"
        )
    min_len = mqar_min_length(num_pairs, num_queries)
    seq_len = min_len if seq_len is None else seq_len
    if seq_len < min_len:
        raise ValueError(f"seq_len={seq_len} is too short for {num_pairs} pairs and {num_queries} queries "
                         f"(needs >= {min_len})")

    B, N, Q = batch_size, num_pairs, num_queries
    keys = torch.rand(B, layout.num_keys, generator=generator).argsort(dim=1)[:, :N] + layout.key_start
    values = torch.randint(layout.value_start, vocab_size, (B, N), generator=generator)
    if distinct_queries:
        queried = torch.rand(B, N, generator=generator).argsort(dim=1)[:, :Q]  # which pairs, in query order
    else:
        queried = torch.randint(0, N, (B, Q), generator=generator)

    input_ids = torch.full((B, seq_len), FILLER_ID, dtype=torch.long)
    input_ids[:, 0:2 * N:2] = keys
    input_ids[:, 1:2 * N:2] = values
    input_ids[:, 2 * N] = SEPARATOR_ID

    # Query start offsets in the region: choose Q sorted slots among R - Q and spread them so pairs never overlap.
    region = seq_len - 2 * N - 1
    slots = torch.rand(B, region - Q, generator=generator).argsort(dim=1)[:, :Q].sort(dim=1).values
    query_pos = 2 * N + 1 + slots + torch.arange(Q)
    input_ids.scatter_(1, query_pos, keys.gather(1, queried))
    answers = values.gather(1, queried)
    input_ids.scatter_(1, query_pos + 1, answers)

    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels.scatter_(1, query_pos + 1, answers)
    return input_ids, labels


@torch.no_grad()
def answer_accuracy(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                    batch_size: int = 64, progress: bool = False, desc: str = "sequences") -> float:
    """Fraction of labelled positions whose token the model predicts exactly (argmax of the previous position)."""
    correct, total = 0, 0
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with progress_bar(input_ids.shape[0], desc, progress) as bar:
            for start in range(0, input_ids.shape[0], batch_size):
                correct_here, total_here = _batch_hits(model, input_ids[start:start + batch_size],
                                                       labels[start:start + batch_size], device)
                correct, total = correct + correct_here, total + total_here
                bar.update(min(batch_size, input_ids.shape[0] - start))
    finally:
        model.train(was_training)
    return correct / max(total, 1)


def _batch_hits(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                device: torch.device) -> tuple[int, int]:
    """Correctly predicted labelled positions of one batch, and how many positions are labelled."""
    ids, lab = input_ids.to(device), labels.to(device)
    predicted = model(ids, use_cache=False).logits[:, :-1].argmax(dim=-1)
    target = lab[:, 1:]
    mask = target != IGNORE_INDEX
    return int((predicted.eq(target) & mask).sum()), int(mask.sum())


def mqar_accuracy(
    model: torch.nn.Module,
    num_pairs: int,
    num_queries: int,
    seq_len: int | None = None,
    num_samples: int = 256,
    vocab_size: int | None = None,
    seed: int = 0,
    batch_size: int = 64,
    distinct_queries: bool = True,
    progress: bool = False,
) -> float:
    """MQAR accuracy of ``model`` on ``num_samples`` fresh sequences: the fraction of query values it predicts
    exactly (greedy, teacher-forced). ``vocab_size`` defaults to the model's."""
    vocab_size = vocab_size if vocab_size is not None else model.config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    input_ids, labels = mqar_batch(num_samples, num_pairs, num_queries, vocab_size, generator, seq_len,
                                   distinct_queries)
    return answer_accuracy(model, input_ids, labels, batch_size, progress=progress, desc="mqar")


# ---------------------------------------------------------------------------------------------------------------------
# Passkey retrieval
# ---------------------------------------------------------------------------------------------------------------------

NUM_DIGIT_IDS = 10
DIGIT_START = NUM_RESERVED  # token form: digit d is id DIGIT_START + d
FILLER_START = DIGIT_START + NUM_DIGIT_IDS  # token form: filler ids are [FILLER_START, vocab_size)


def random_passkey(num_digits: int, generator: torch.Generator | None = None) -> str:
    """A passkey of ``num_digits`` digits, the first one non-zero."""
    first = torch.randint(1, 10, (1,), generator=generator)
    rest = torch.randint(0, 10, (num_digits - 1,), generator=generator)
    return "".join(str(int(d)) for d in torch.cat([first, rest]))


@dataclass
class PasskeyTokenSample:
    """A token-form passkey prompt.

    ``input_ids`` ``(length,)`` is the prompt: filler, ``NEEDLE d_1 ... d_n NEEDLE``
    starting at ``needle_position``, more filler, then ``SEPARATOR``; the model must
    continue with ``answer_ids`` (the digits again). ``depth`` is the fraction of the
    filler that lies before the needle.
    """

    input_ids: torch.Tensor
    answer_ids: torch.Tensor
    passkey: str
    needle_position: int
    depth: float


def passkey_token_sample(
    length: int,
    depth: float,
    vocab_size: int,
    generator: torch.Generator | None = None,
    num_digits: int = 5,
) -> PasskeyTokenSample:
    """A token-form passkey prompt of exactly ``length`` tokens.

    Layout: ids ``[0, 4)`` reserved (pad, separator, filler, needle), ``[4, 14)`` the
    digits 0-9, ``[14, vocab_size)`` filler drawn uniformly. The needle is
    ``NEEDLE d_1 ... d_n NEEDLE``, placed after ``round(depth * filler_length)``
    filler tokens; the prompt ends with ``SEPARATOR`` and the answer is ``d_1 ... d_n``.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if vocab_size <= FILLER_START:
        raise ValueError(f"the token form needs vocab_size > {FILLER_START} (reserved ids, digits, filler)")
    needle_len = num_digits + 2
    filler_len = length - needle_len - 1
    if filler_len < 0:
        raise ValueError(f"length={length} cannot hold a {num_digits}-digit needle and the question")
    passkey = random_passkey(num_digits, generator)
    digits = torch.tensor([DIGIT_START + int(c) for c in passkey], dtype=torch.long)
    filler = torch.randint(FILLER_START, vocab_size, (filler_len,), generator=generator)
    before = round(depth * filler_len)
    needle = torch.cat([torch.tensor([NEEDLE_ID]), digits, torch.tensor([NEEDLE_ID])])
    input_ids = torch.cat([filler[:before], needle, filler[before:], torch.tensor([SEPARATOR_ID])])
    return PasskeyTokenSample(input_ids, digits, passkey, before, depth)


@torch.no_grad()
def passkey_token_accuracy(model: torch.nn.Module, samples: list[PasskeyTokenSample]) -> float:
    """Fraction of samples whose whole passkey the model reproduces after the prompt.

    Scored teacher-forced (one forward pass over prompt and answer, argmax at every
    digit): all digits right is exactly greedy generation producing the passkey.
    """
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    hits = 0
    try:
        for sample in samples:
            ids = torch.cat([sample.input_ids, sample.answer_ids])[None].to(device)
            n = sample.answer_ids.numel()
            logits = model(ids, use_cache=False).logits[0, -n - 1:-1]
            hits += int(torch.equal(logits.argmax(-1).cpu(), sample.answer_ids))
    finally:
        model.train(was_training)
    return hits / max(len(samples), 1)


PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                 "I will quiz you about the important information there. ")
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_NEEDLE = "The pass key is {passkey}. Remember it. {passkey} is the pass key. "
PASSKEY_QUESTION = "What is the pass key? The pass key is"


@dataclass
class PasskeyTextSample:
    """A text-form passkey prompt: ``prompt`` hides ``needle`` after ``filler_before`` of
    ``filler_total`` filler sentences; the answer is ``passkey``."""

    prompt: str
    passkey: str
    needle: str
    filler_before: int
    filler_total: int
    depth: float


def _num_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def passkey_text_sample(
    tokenizer,
    length: int,
    depth: float,
    generator: torch.Generator | None = None,
    num_digits: int = 5,
) -> PasskeyTextSample:
    """A text-form passkey prompt of about ``length`` tokens (never more, unless even no filler is longer).

    The prompt is an introduction, filler sentences with the needle ("The pass key is
    71432. Remember it. ...") after a ``depth`` fraction of them, then the question
    "What is the pass key? The pass key is"; the model answers with the digits.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    passkey = random_passkey(num_digits, generator)
    needle = PASSKEY_NEEDLE.format(passkey=passkey)
    fixed = _num_tokens(tokenizer, PASSKEY_INTRO + needle + PASSKEY_QUESTION)
    per_filler = max(_num_tokens(tokenizer, PASSKEY_FILLER * 8) / 8, 1.0)
    total = max(int((length - fixed) / per_filler), 0)
    before = round(depth * total)
    prompt = PASSKEY_INTRO + PASSKEY_FILLER * before + needle + PASSKEY_FILLER * (total - before) + PASSKEY_QUESTION
    return PasskeyTextSample(prompt, passkey, needle, before, total, depth)


def extract_digits(text: str) -> str:
    """The first run of digits in ``text``, spaces inside it removed (tokenizers may decode digits apart)."""
    match = re.search(r"\d[\d ]*", text)
    return match.group(0).replace(" ", "") if match else ""


@torch.no_grad()
def passkey_text_accuracy(model: torch.nn.Module, tokenizer, samples: list[PasskeyTextSample],
                          max_new_tokens: int | None = None) -> float:
    """Fraction of samples whose greedy continuation starts with the passkey's digits."""
    device = next(model.parameters()).device
    model.eval()
    hits = 0
    for sample in samples:
        encoded = tokenizer(sample.prompt, return_tensors="pt")
        budget = max_new_tokens or 2 * _num_tokens(tokenizer, " " + sample.passkey) + 4
        out = model.generate(
            encoded["input_ids"].to(device), attention_mask=encoded["attention_mask"].to(device),
            max_new_tokens=budget, do_sample=False, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
        )
        text = tokenizer.decode(out[0, encoded["input_ids"].shape[1]:], skip_special_tokens=True)
        hits += int(extract_digits(text) == sample.passkey)
    return hits / max(len(samples), 1)


# ---------------------------------------------------------------------------------------------------------------------
# Perplexity
# ---------------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def perplexity(model: torch.nn.Module, tokenizer, text: str, context_length: int = 1024,
               stride: int | None = None, progress: bool = False) -> dict:
    """Perplexity of ``text`` under ``model`` over sliding windows.

    The first window scores its first ``context_length`` tokens; each next window moves
    ``stride`` tokens on (default: half the context length) and scores only the
    ``stride`` tokens it adds, each with at least ``context_length - stride`` tokens of
    context. Every token after the first is scored exactly once. The loss is computed
    from the logits here so that auxiliary losses (MoM's router) never enter the
    number. Returns ``{"perplexity", "nll", "tokens"}``.
    """
    if tokenizer is None:
        raise ValueError("perplexity needs a tokenizer and this model has none; the mqar and passkey tasks "
                         "work on token ids")
    stride = max(context_length // 2, 1) if stride is None else stride
    if context_length < 2 or not 0 < stride < context_length:
        # a window of L tokens predicts L - 1 of them: a stride of L would leave a token per window unscored
        raise ValueError(f"need context_length >= 2 and 0 < stride < context_length, got "
                         f"context_length={context_length}, stride={stride}")
    ids = tokenizer(text, return_tensors="pt")["input_ids"][0]
    if ids.numel() < 2:
        raise ValueError("the text is shorter than two tokens: nothing to score")
    device = next(model.parameters()).device
    model.eval()
    nll_sum, count = 0.0, 0
    first, end = 1, min(context_length, ids.numel())  # targets [first, end) of this window
    with progress_bar(ids.numel() - 1, "ppl (tokens)", progress) as bar:
        while first < ids.numel():
            begin = max(0, end - context_length)
            window = ids[begin:end][None].to(device)
            logits = model(window, use_cache=False).logits[0].float()
            # position p of the window predicts token begin + p + 1
            nll_sum += float(F.cross_entropy(logits[first - 1 - begin:end - 1 - begin], ids[first:end].to(device),
                                             reduction="sum"))
            count += end - first
            bar.update(end - first)
            first, end = end, min(end + stride, ids.numel())
    nll = nll_sum / count
    return {"perplexity": math.exp(nll), "nll": nll, "tokens": count}
