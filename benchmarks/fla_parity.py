"""Parity of flash-linear-attention checkpoints imported with ``convert_from_fla`` (GPU, fla 0.6.0).

For random-init fla ``GatedDeltaNetForCausalLM`` and ``MomForCausalLM`` models
(tiny and small, weights re-drawn so that gates, decays and routing matter), this
saves each with ``save_pretrained``, converts it with
:func:`mnemo.conversion.from_fla.convert_from_fla`, loads it with mnemo on the
PyTorch backend and compares, on random token batches:

- prefill logits, at a length fla runs with its fused recurrent kernel (<= 64
  tokens) and one it runs with its chunked kernel;
- decoding: 16 greedy tokens from each side, and mnemo's logits along fla's
  greedy tokens through its cache (teacher forcing).

Differences are reported relative to the logit scale (max |fla logit|). fla runs
in eval mode without gradients, i.e. its decoding semantics (each MoM memory's
convolutions over its own tokens), which is what mnemo computes. Prints a
markdown table and exits 1 if a relative difference exceeds the tolerance of its
dtype, or if greedy tokens diverge where fla's top two logits are not within that
tolerance of each other (a near tie may flip either way). In bfloat16 a rounding
can flip a routing decision, so a bfloat16 row beyond tolerance still passes when
mnemo's logits are as close to fla's float32 logits as fla's own bfloat16 ones
(within 2x).

Run: ``python benchmarks/fla_parity.py`` (``--cases``, ``--dtypes`` to choose) with CUDA, Triton, fla 0.6.0
and mnemo installed. The first run spends minutes compiling and autotuning fla's kernels.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

# Relative tolerances (max |diff| / max |fla logit|). fla's Triton kernels use TF32 dots for
# float32 inputs; bfloat16 runs round activations to 8 bits of mantissa on both sides.
TOLERANCE = {torch.float32: 5e-3, torch.bfloat16: 5e-2}
GREEDY_TOKENS = 16
SHORT, LONG = 40, 160  # fla: fused recurrent kernel up to 64 tokens, chunked kernel beyond
BATCH = 2
# fla 0.6 orders MoM's routed entries with a non-stable argsort; CUDA sorts 32 entries or fewer with
# a sort that reorders equal keys, which scrambles each memory's tokens. Every prefill here has more
# than 32 (batch x tokens x topk) entries so that fla computes what it means to.
PROMPT = 24


@dataclass
class Case:
    name: str
    model_type: str
    config: dict


CASES = [
    Case("gdn-tiny", "gated_deltanet", dict(hidden_size=128, num_hidden_layers=2, num_heads=2, head_dim=64,
                                            expand_v=2.0, vocab_size=512)),
    Case("gdn-small", "gated_deltanet", dict(hidden_size=512, num_hidden_layers=4, num_heads=4, head_dim=128,
                                             expand_v=2.0, vocab_size=4096)),
    Case("mom-tiny", "mom", dict(hidden_size=128, num_hidden_layers=2, num_heads=2, head_dim=64, expand_v=1.0,
                                 num_memories=4, topk=2, shared_mem=True, vocab_size=512)),
    Case("mom-tiny-noshared-top1", "mom", dict(hidden_size=128, num_hidden_layers=2, num_heads=2, head_dim=64,
                                               expand_v=1.0, num_memories=3, topk=1, shared_mem=False,
                                               vocab_size=512)),
    Case("mom-small", "mom", dict(hidden_size=512, num_hidden_layers=4, num_heads=4, head_dim=128, expand_v=1.0,
                                  num_memories=4, topk=2, shared_mem=True, vocab_size=4096)),
]


def build_fla(case: Case, dtype: torch.dtype, seed: int):
    from fla.models import (
        GatedDeltaNetConfig,
        GatedDeltaNetForCausalLM,
        MomConfig,
        MomForCausalLM,
    )

    config_cls, model_cls = {
        "gated_deltanet": (GatedDeltaNetConfig, GatedDeltaNetForCausalLM),
        "mom": (MomConfig, MomForCausalLM),
    }[case.model_type]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**case.config))
    redraw(model, seed)
    return model.to(device="cuda", dtype=dtype).eval()


@torch.no_grad()
def redraw(model: torch.nn.Module, seed: int) -> None:
    """Weights of unit-scale activations: fla's init (std 0.02) leaves logits and gates nearly flat."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape).uniform_(1, 16, generator=gen).log())
        elif name.endswith("dt_bias"):
            p.copy_(torch.randn(p.shape, generator=gen) - 3)
        elif p.dim() == 1:  # norm weights
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith("embeddings.weight"):
            p.copy_(torch.randn(p.shape, generator=gen))
        else:
            fan_in = p.shape[-1] if p.dim() == 2 else p.shape[-1] * p.shape[1]
            gain = 2.0 if name.endswith("attn.gate.weight") else 1.0  # decisive routing
            p.copy_(gain * torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))


@torch.no_grad()
def greedy(model, prompt: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens through the model's cache and the logits each was chosen from."""
    out = model(input_ids=prompt, use_cache=True)
    cache, step_logits, tokens = out.past_key_values, [out.logits[:, -1].float()], []
    for _ in range(steps):
        token = step_logits[-1].argmax(-1, keepdim=True)
        tokens.append(token)
        if len(tokens) == steps:
            break
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        step_logits.append(out.logits[:, -1].float())
    return torch.cat(tokens, 1), torch.stack(step_logits, 1)


@torch.no_grad()
def teacher_forced(model, prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The model's logits along given tokens, one step at a time through its cache."""
    out = model(input_ids=prompt, use_cache=True)
    cache, step_logits = out.past_key_values, [out.logits[:, -1].float()]
    for j in range(tokens.shape[1] - 1):
        out = model(input_ids=tokens[:, j:j + 1], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        step_logits.append(out.logits[:, -1].float())
    return torch.stack(step_logits, 1)


def relative(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / max(scale, 1e-30), scale


def greedy_verdict(ours: torch.Tensor, theirs: torch.Tensor, their_logits: torch.Tensor, tol: float) -> tuple[str, bool]:
    """``k/16`` agreeing tokens per row; a divergence is acceptable only at a near tie of fla's logits."""
    scale = their_logits.abs().max().item()
    parts, ok = [], True
    for row in range(ours.shape[0]):
        differ = (ours[row] != theirs[row]).nonzero()
        if differ.numel() == 0:
            parts.append(f"{ours.shape[1]}/{ours.shape[1]}")
            continue
        d = int(differ[0])
        top2 = their_logits[row, d].topk(2).values
        tie = (top2[0] - top2[1]).item() <= tol * scale
        ok &= tie
        parts.append(f"{d}/{ours.shape[1]}" + (" (near tie)" if tie else ""))
    return ", ".join(parts), ok


def _prefill(model, ids: torch.Tensor, mnemo_side: bool) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, **({"use_cache": False} if mnemo_side else {})).logits.float()


def run_case(case: Case, dtype: torch.dtype, workdir: Path) -> list[dict]:
    """bfloat16 rows also hold both sides against fla in float32: a routing decision that rounding flips
    moves a token to another memory, so bfloat16 MoM logits of two correct implementations can differ
    by more than rounding. Such a row passes when mnemo is as close to float32 as fla itself (2x slack)."""
    from mnemo.conversion.from_fla import convert_from_fla

    from mnemo import MoMForCausalLM

    tol = TOLERANCE[dtype]
    fla_model = build_fla(case, dtype, seed=0)
    reference = build_fla(case, torch.float32, seed=0) if dtype != torch.float32 else None
    src, out = workdir / f"{case.name}-{dtype}-fla", workdir / f"{case.name}-{dtype}-mnemo"
    fla_model.save_pretrained(src)
    convert_from_fla(src, out)
    ours = MoMForCausalLM.from_pretrained(out, dtype=dtype).to("cuda").eval()
    gen = torch.Generator().manual_seed(1)
    vocab = case.config["vocab_size"]
    name, dtype_name = case.name, str(dtype).removeprefix("torch.")
    rows = []
    for length in (SHORT, LONG):
        ids = torch.randint(0, vocab, (BATCH, length), generator=gen).cuda()
        theirs, mine = _prefill(fla_model, ids, False), _prefill(ours, ids, True)
        rel, scale = relative(mine, theirs)
        note, ok = "", rel <= tol
        if reference is not None:
            exact = _prefill(reference, ids, False)
            mine_err, their_err = relative(mine, exact)[0], relative(theirs, exact)[0]
            note = f"vs fla float32: mnemo {mine_err:.2e}, fla {their_err:.2e}"
            ok = ok or mine_err <= 2 * their_err
        rows.append(dict(case=name, dtype=dtype_name, what=f"prefill T={length}", rel=rel, scale=scale,
                         greedy=note, ok=ok))
    prompt = torch.randint(0, vocab, (BATCH, PROMPT), generator=gen).cuda()
    their_tokens, their_logits = greedy(fla_model, prompt, GREEDY_TOKENS)
    my_tokens, _ = greedy(ours, prompt, GREEDY_TOKENS)
    forced = teacher_forced(ours, prompt, their_tokens)
    rel, scale = relative(forced, their_logits)
    verdict, greedy_ok = greedy_verdict(my_tokens, their_tokens, their_logits, tol)
    ok = rel <= tol and greedy_ok
    if reference is not None and not ok:
        exact = teacher_forced(reference, prompt, their_tokens)
        ok = relative(forced, exact)[0] <= 2 * relative(their_logits, exact)[0]
        verdict += " (judged against fla float32)"
    rows.append(dict(case=name, dtype=dtype_name, what=f"decode {GREEDY_TOKENS} steps", rel=rel, scale=scale,
                     greedy=verdict, ok=ok))
    return rows


def _row(r: dict) -> str:
    return (f"| {r['case']} | {r['dtype']} | {r['what']} | {r['rel']:.2e} | {r['scale']:.3g} | {r['greedy']} | "
            f"{'yes' if r['ok'] else 'NO'} |")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(c.name for c in CASES),
                        help="comma-separated case names (default: all)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if not torch.cuda.is_available():
        print("fla_parity needs CUDA (fla's kernels are Triton).", file=sys.stderr)
        return 2
    import mnemo

    mnemo.use_backend("torch")
    cases = [c for name in args.cases.split(",") for c in CASES if c.name == name]
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    print("tolerance (max |diff| / max |fla logit|): "
          + ", ".join(f"{str(k).removeprefix('torch.')} {v:g}" for k, v in TOLERANCE.items()) + "\n")
    print("| case | dtype | compared | rel. max diff | logit scale | greedy tokens equal / notes | ok |")
    print("|---|---|---|---|---|---|---|", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            for dtype in dtypes:
                try:
                    new = run_case(case, dtype, Path(tmp))
                except Exception as error:  # report every case, then fail
                    new = [dict(case=case.name, dtype=str(dtype).removeprefix("torch."), what="error",
                                rel=float("nan"), scale=float("nan"),
                                greedy=f"{type(error).__name__}: {error}"[:200].replace("\n", " "), ok=False)]
                for r in new:
                    print(_row(r), flush=True)
                rows.extend(new)
    failures = sum(not r["ok"] for r in rows)
    print(f"\n{len(rows) - failures}/{len(rows)} comparisons within tolerance")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
