"""Long training and long contexts on one GPU: no NaN, no drift, for every family of the demo.

What it checks, for each family of ``mnemo.demo`` (its demo-sized model), each in its own process so
the families run side by side (share the GPU through MPS where available):

1. Long training: up to ``--steps`` AdamW steps (lr 1e-3, weight decay 0.1, gradient clip 1.0) on MQAR
   (``--pairs`` pairs, ``--seq-len`` tokens, batch 32) under bf16 autocast, capped by ``--train-seconds``
   (with ``--weights`` a later call resumes where the last one stopped). Every step counts non-finite
   losses and gradient norms on the GPU (read every ``--sync-every`` steps, so the host never waits per
   step); every ``--check-every`` steps a cached forward checks every memory state for NaN/inf.
2. Long context with the trained weights: a ``--context``-token prompt (MQAR blocks back to back)
   prefilled through the cache in pieces of ``--piece`` tokens, then ``--decode`` greedy steps, once in
   float32 and once under bf16 autocast: whether the greedy tokens agree (and the first divergence),
   whether logits and states stay finite, and the relative error of the bf16 run's memory states against
   float32 after each piece, with its growth per 1K tokens.

Writes ``<out>/<family>.json`` (the report, after each phase, so a time limit keeps the first) and
``<out>/<family>.log``; prints one markdown table over the families (steps, seconds, first and last loss,
non-finite counts, the long-context figures, peak memory). ``python benchmarks/robustness.py --out
results/ --compile`` launches every family; ``--family NAME`` runs one (what the launcher does);
``--phase train|context`` with ``--weights DIR`` splits the two across calls.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch


def _states(cache) -> dict[str, torch.Tensor]:
    out = {}
    for i, layer in enumerate(cache.layers):
        for name, tensor in getattr(layer, "states", {}).items():
            if torch.is_tensor(tensor) and tensor.is_floating_point():
                out[f"{i}.{name}"] = tensor
    return out


def _finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _let_inductor_retile() -> None:
    """torch 2.11's Triton tiler raises ``CantSplit`` without the arguments its constructor requires, so a
    ``TypeError`` escapes where Inductor means to try another tiling (Atlas' backward graph hits it). Give the
    exception defaults so that Inductor's own fallback runs; a no-op where the constructor needs nothing."""
    import inspect

    try:
        from torch._inductor.codegen.simd import CantSplit
    except ImportError:
        return
    init = CantSplit.__init__
    if init is Exception.__init__ or getattr(CantSplit, "_defaults_given", False):
        return
    required = [p for p in list(inspect.signature(init).parameters.values())[1:]
                if p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD]
    if not required:
        return

    def with_defaults(self, *args, **kwargs):
        if args or kwargs:
            init(self, *args, **kwargs)
        else:
            Exception.__init__(self)
            for p in required:
                setattr(self, p.name, None)

    CantSplit.__init__ = with_defaults
    CantSplit._defaults_given = True


def train(name: str, args, weights: Path | None = None) -> tuple[torch.nn.Module, dict]:
    """Train up to ``--steps`` steps in total, resuming from ``weights/train_state.pt`` when an earlier run left one
    (model, optimiser, data stream and counters), and leaving one there for the next run."""
    from transformers import AutoModelForCausalLM

    from mnemo.demo import DemoSettings, build_model
    from mnemo.tasks import mqar_batch

    settings = DemoSettings.default(device=args.device, seq_len=args.seq_len, num_pairs=args.pairs,
                                    vocab_size=4 + 2 * args.pairs + 64)
    resume = weights / "train_state.pt" if weights is not None else None
    generator = torch.Generator().manual_seed(0)
    if resume is not None and resume.is_file():
        model = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32).to(args.device).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=args.device == "cuda")
        saved = torch.load(resume, weights_only=True)  # written by this script
        optimizer.load_state_dict(saved["optimizer"])
        generator.set_state(saved["generator"])
        report, step, first = json.loads(saved["report"]), int(saved["step"]), saved["first_losses"].tolist()
        elapsed = report.get("train_seconds", 0.0)
    else:
        model = build_model(name, settings).to(args.device).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=args.device == "cuda")
        report = {"family": name, "nonfinite_loss": 0, "nonfinite_grad": 0, "nonfinite_state": 0}
        step, first, elapsed = 0, [], 0.0
    # Tiny models are bound by kernel launches; a compiled forward fuses the element-wise work around them.
    # If Inductor still fails on a family's first compiled step, that family trains eagerly.
    _let_inductor_retile()
    forward = torch.compile(model) if args.compile else model
    # The checks stay on the GPU and are read every `sync_every` steps: a host sync per step would stall the
    # launch queue that bounds these tiny models. A non-finite gradient anywhere makes the total norm non-finite.
    bad_loss = torch.zeros((), dtype=torch.long, device=args.device)
    bad_grad = torch.zeros_like(bad_loss)
    start, losses, pending, first_step_done = time.perf_counter(), [], [], None
    while step < args.steps and time.perf_counter() - start < args.train_seconds:
        ids, labels = mqar_batch(32, settings.num_pairs, settings.queries, settings.vocab_size, generator,
                                 settings.seq_len)
        ids, labels = ids.to(args.device), labels.to(args.device)
        try:
            with torch.autocast(args.device, dtype=torch.bfloat16):
                loss = forward(input_ids=ids, labels=labels).loss
            loss.backward()
        except Exception as err:  # noqa: BLE001 - an Inductor failure on the first step means: train eagerly
            if forward is model or losses or pending:
                raise
            report["compile_error"] = f"{type(err).__name__}: {err}"[:200]
            forward = model
            optimizer.zero_grad(set_to_none=True)
            continue
        loss = loss.detach()
        bad_loss += ~torch.isfinite(loss)
        bad_grad += ~torch.isfinite(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        pending.append(loss)
        step += 1
        if len(pending) >= args.sync_every:
            losses += torch.stack(pending).tolist()
            pending = []
            if first_step_done is None:  # steady-state speed: the first steps of a run pay for compilation
                first_step_done, first_counted = time.perf_counter(), len(losses)
        if step % args.check_every == 0:
            with torch.no_grad(), torch.autocast(args.device, dtype=torch.bfloat16):
                cache = model(input_ids=ids, use_cache=True).past_key_values
            report["nonfinite_state"] += not _finite(_states(cache).values())
    losses += torch.stack(pending).tolist() if pending else []
    report["nonfinite_loss"] += int(bad_loss)
    report["nonfinite_grad"] += int(bad_grad)
    first = (first + losses)[:50]
    if first_step_done is not None and len(losses) > first_counted:
        report["steps_per_second"] = round((len(losses) - first_counted) / (time.perf_counter() - first_step_done), 2)
    report.update(steps=step, train_seconds=round(elapsed + time.perf_counter() - start, 1),
                  first_loss=round(sum(first) / max(len(first), 1), 4),
                  last_loss=round(sum(losses[-50:]) / len(losses[-50:]), 4) if losses else report.get("last_loss"))
    if weights is not None:
        model.save_pretrained(weights)
        torch.save({"optimizer": optimizer.state_dict(), "generator": generator.get_state(), "step": step,
                    "report": json.dumps(report), "first_losses": torch.tensor(first)}, weights / "train_state.pt")
    return model.eval(), report


@torch.no_grad()
def long_context(model, args, report: dict) -> None:
    from mnemo.tasks import mqar_batch

    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    # A long recall-shaped prompt: MQAR blocks back to back, so the argmax is not a coin toss.
    blocks = [mqar_batch(1, args.pairs, args.pairs, vocab, generator, args.seq_len)[0]
              for _ in range(-(-args.context // args.seq_len))]
    prompt = torch.cat(blocks, 1)[:, :args.context].to(args.device)

    def run(bf16: bool):
        cache, states_at = None, []
        for s in range(0, prompt.shape[1], args.piece):
            with torch.autocast(args.device, dtype=torch.bfloat16, enabled=bf16):
                out = model(input_ids=prompt[:, s:s + args.piece], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            states_at.append({k: v.float().clone() for k, v in _states(cache).items()})
        tokens, logits = [], out.logits[:, -1]
        finite = bool(torch.isfinite(logits).all())
        for _ in range(args.decode):
            nxt = logits.argmax(-1, keepdim=True)
            tokens.append(int(nxt))
            with torch.autocast(args.device, dtype=torch.bfloat16, enabled=bf16):
                out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[:, -1]
            finite &= bool(torch.isfinite(logits).all())
        report["logits_finite" + ("_bf16" if bf16 else "")] = finite
        return tokens, states_at

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    ref_tokens, ref_states = run(False)
    fp32_seconds = time.perf_counter() - start
    bf_tokens, bf_states = run(True)
    diverge = next((i for i, (a, b) in enumerate(zip(ref_tokens, bf_tokens)) if a != b), None)
    growth = []
    for ref, got in zip(ref_states, bf_states):  # float64 sums: a large but finite state must not read as inf
        num = sum(float((got[k].double() - ref[k].double()).pow(2).sum()) for k in ref)
        den = sum(float(ref[k].double().pow(2).sum()) for k in ref)
        growth.append(math.sqrt(num / max(den, 1e-30)))
    # Equal tokens mean nothing if both runs produced NaN logits (argmax of NaN is 0): report finiteness too.
    report.update(states_finite=_finite(ref_states[-1].values()) and _finite(bf_states[-1].values()),
                  state_max_abs=max((float(t.abs().max()) for t in ref_states[-1].values() if t.numel()),
                                    default=0.0))
    per_k = (growth[-1] - growth[0]) / max((len(growth) - 1) * args.piece / 1024, 1e-9) if len(growth) > 1 else 0.0
    report.update(context=prompt.shape[1], decode=args.decode, same_tokens=diverge is None,
                  first_divergence=diverge, state_rel_error_first=growth[0] if growth else None,
                  state_rel_error_last=growth[-1] if growth else None, state_error_growth_per_1k=per_k,
                  fp32_prefill_decode_seconds=round(fp32_seconds, 1),
                  peak_memory_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None)


def run_family(name: str, args, path: Path) -> dict:
    """Train and/or decode long (``--phase``); the report is written after each phase so that a time limit keeps
    the first. With ``--weights DIR`` the trained model is saved to (train) or loaded from (context) ``DIR/name``."""
    import mnemo
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    weights = Path(args.weights) / name.replace(" ", "-") if args.weights else None
    with mnemo.use_backend(args.backend):
        if args.phase == "context":
            report = json.loads(path.read_text()) if path.is_file() else {"family": name}
            model = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32).to(args.device).eval()
        else:
            model, report = train(name, args, weights)
            path.write_text(json.dumps(report, indent=2))
            if args.phase == "train":
                return report
        try:
            long_context(model, args, report)
        except Exception as err:  # a failure here is a result to report, not a reason to lose the training figures
            report["long_context_error"] = f"{type(err).__name__}: {err}"[:500]
    path.write_text(json.dumps(report, indent=2))
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default=None)
    parser.add_argument("--out", default="robustness-results")
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--train-seconds", type=float, default=300)
    parser.add_argument("--check-every", type=int, default=500)
    parser.add_argument("--sync-every", type=int, default=100, help="steps between reads of the loss on the host")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=16)
    parser.add_argument("--context", type=int, default=65_536)
    parser.add_argument("--piece", type=int, default=8_192)
    parser.add_argument("--decode", type=int, default=256)
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--compile", action="store_true", help="train through torch.compile")
    parser.add_argument("--families", default=None, help="comma-separated families to launch (default: all)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--phase", choices=("both", "train", "context"), default="both")
    parser.add_argument("--weights", default=None, help="folder for the trained models between phases")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.family:
        run_family(args.family, args, out / f"{args.family}.json")
        return 0
    from mnemo.demo import FAMILIES

    forwarded = [a for a in sys.argv[1:]]
    families = FAMILIES if args.families is None else tuple(args.families.split(","))
    procs = {name: subprocess.Popen([sys.executable, __file__, "--family", name, *forwarded],
                                    stdout=open(out / f"{name}.log", "w"), stderr=subprocess.STDOUT,
                                    env={**os.environ})
             for name in families}
    for proc in procs.values():
        proc.wait()
    columns = ["family", "steps", "train_seconds", "first_loss", "last_loss", "nonfinite_loss", "nonfinite_grad",
               "nonfinite_state", "context", "logits_finite", "states_finite", "state_max_abs",
               "same_tokens", "first_divergence", "state_rel_error_last",
               "state_error_growth_per_1k", "peak_memory_gib", "long_context_error"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for name in families:
        path = out / f"{name}.json"
        report = json.loads(path.read_text()) if path.is_file() else {"family": name, "long_context_error": "crashed"}
        cells = []
        for c in columns:
            v = report.get(c, "")
            cells.append(f"{v:.2e}" if isinstance(v, float) and c.startswith("state") else str(v))
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
