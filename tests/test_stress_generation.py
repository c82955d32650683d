"""Stress generation: 32 left-padded prompts of 1 to 64 tokens; every row generates what its prompt
generates alone, greedy and sampled, for tiny models of every family.

The prompts' lengths cover 1 and 64, the inner-chunk and segment boundaries of the tiny
configurations (3 to 9, 15 to 17, 31 to 33, 63) and random lengths. The batch is padded to a
fixed width of 67 columns, as a collator padding to a fixed length does, so every row, the
64-token one included, starts with padding.

Greedy: ``generate(do_sample=False)``; each row's new tokens must equal those of the prompt
generated alone, and each step's raw logits (``output_logits=True``) must agree within float32
rounding (``LOGITS_TOL`` of their scale; measured: below 2e-7), which catches a discrepancy too
small to change an argmax.

Sampling: ``generate(do_sample=True)`` draws every row from one global random stream, so a
row's sample depends on the batch it sits in (its size and the row's position), and "row ==
alone" would not be a valid comparison. The sampler here is instead
:class:`RowSeededGumbelSampler`, a ``LogitsProcessor`` run with ``do_sample=False``: it applies
temperature and top-k to each row's own logits and adds Gumbel noise drawn from a generator
seeded by that prompt's own seed and the step. The argmax of logits plus Gumbel noise is an
exact sample from the softmax of the logits (the Gumbel-max trick), so this is genuine
temperature / top-k sampling, and each row's token depends only on its own logits and its own
random stream: with the same seed, a row and its prompt alone must draw the same tokens.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from conftest import MODEL_VARIANTS, left_pad

# One or two variants of every family: recurrent and hybrid MoM, the Hebbian and Dot
# DeepTransformers, MC-Titans with checkpointed and independent segments, Atlas and a MAG hybrid.
STRESS_MODELS = ["mom-default", "mom-hybrid", "deep-hebbian", "deep-dot-window3-gqa", "mc-grm",
                 "mc-soup-independent", "atlas-atlas", "atlas-mag-dla"]
NUM_PROMPTS, MAX_PROMPT, WIDTH, NEW_TOKENS = 32, 64, 67, 6
LOGITS_TOL = 1e-5
VOCAB = 97


pytestmark = pytest.mark.usefixtures("one_thread")


def prompts() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(2024)
    boundaries = [1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, MAX_PROMPT]
    randoms = torch.randint(1, MAX_PROMPT + 1, (NUM_PROMPTS - len(boundaries),), generator=gen).tolist()
    lengths = boundaries + randoms
    assert len(lengths) == NUM_PROMPTS and min(lengths) == 1 and max(lengths) == MAX_PROMPT
    return [torch.randint(1, VOCAB, (n,), generator=gen) for n in lengths]


class RowSeededGumbelSampler(LogitsProcessor):
    """Temperature and top-k sampling, one random stream per row (use with ``do_sample=False``).

    ``seeds[i]`` seeds row ``i``'s stream; the noise of step ``s`` comes from a generator seeded
    by ``(seeds[i], s)``, so a row's draws do not depend on the other rows or on the batch size.
    """

    def __init__(self, seeds: list[int], temperature: float = 0.8, top_k: int = 20) -> None:
        self.seeds, self.temperature, self.top_k, self.step = list(seeds), temperature, top_k, 0

    def __call__(self, _input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        assert scores.shape[0] == len(self.seeds), "one seed per row"
        logits = scores.float() / self.temperature
        kth = logits.topk(self.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
        noise = []
        for seed in self.seeds:
            gen = torch.Generator().manual_seed(seed * 1_000_003 + self.step)
            uniform = torch.rand(logits.shape[-1], generator=gen, dtype=torch.float64)
            noise.append(-torch.log(-torch.log(uniform.clamp(1e-12, 1 - 1e-12))))
        self.step += 1
        return logits + torch.stack(noise).to(logits)


def generate(model, ids, mask=None, seeds=None):
    processors = LogitsProcessorList([RowSeededGumbelSampler(seeds)]) if seeds is not None else None
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                              logits_processor=processors, return_dict_in_generate=True, output_logits=True,
                              pad_token_id=0)


def check_rows_equal_alone(name: str, sampled: bool):
    build, variant = MODEL_VARIANTS[name]
    model = build(**variant)
    seqs = prompts()
    ids, mask = left_pad(seqs, WIDTH)
    # Seeds are the prompts' own identities (here their index), never their place in a batch.
    batch = generate(model, ids, mask, seeds=list(range(NUM_PROMPTS)) if sampled else None)
    new = batch.sequences[:, WIDTH:]
    assert new.shape == (NUM_PROMPTS, NEW_TOKENS)
    for i, s in enumerate(seqs):
        alone = generate(model, s[None], seeds=[i] if sampled else None)
        assert torch.equal(new[i], alone.sequences[0, len(s):]), f"{name}: prompt {i} ({len(s)} tokens)"
        for step, (row, single) in enumerate(zip(batch.logits, alone.logits)):
            err = (row[i] - single[0]).abs().max().item() / max(1.0, single.abs().max().item())
            assert err <= LOGITS_TOL, f"{name}: prompt {i} ({len(s)} tokens), step {step}: logits differ by {err:.3g}"
    return batch


@pytest.mark.parametrize("name", STRESS_MODELS)
def test_greedy_batch_rows_equal_prompts_alone(name):
    check_rows_equal_alone(name, sampled=False)


@pytest.mark.parametrize("name", STRESS_MODELS)
def test_sampled_batch_rows_equal_prompts_alone(name):
    batch = check_rows_equal_alone(name, sampled=True)
    # The sampler samples: the tiny models' logits are nearly flat, so most draws are not the argmax.
    argmax = torch.stack(batch.logits, 1).argmax(-1)
    assert (batch.sequences[:, WIDTH:] != argmax).float().mean() > 0.5


def test_row_seeded_sampler_draws_from_the_tempered_top_k_distribution():
    """The Gumbel-max draws of one row over many seeds follow softmax(top-k(logits) / temperature)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    draws = 4000
    counts = torch.zeros(6)
    for seed in range(draws):
        counts[RowSeededGumbelSampler([seed], temperature=0.8, top_k=4)(None, logits).argmax()] += 1
    kept = logits[0, :4] / 0.8
    expected = torch.cat([torch.softmax(kept, 0), torch.zeros(2)])
    assert counts[4:].sum() == 0, "tokens outside the top k are never drawn"
    # Binomial standard deviation is at most sqrt(0.25 / 4000) = 0.008: 4 sigma.
    assert (counts / draws - expected).abs().max() < 0.032, (counts / draws, expected)
