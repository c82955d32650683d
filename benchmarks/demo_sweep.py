"""Choose the demo's settings: train every family under several candidate settings, in parallel, one thread each.

What it measures: for each candidate of a grid (named overrides of
:meth:`mnemo.demo.DemoSettings.quick`: steps, learning rate, pairs, key width, model overrides) and each
family it trains (all of ``mnemo.demo.FAMILIES`` unless the candidate names some), the held-out MQAR
accuracy after training and the seconds of single-thread training.

How: each (candidate, family) pair is one job in a pool of single-threaded worker processes (``spawn``),
longest first, so a many-core machine covers a grid in the time of its slowest job. Candidates named
``-gpu`` train on the GPU.

Writes one JSON line per finished job to ``<out>/sweep.jsonl`` (as each ends, so a time limit keeps every
finished job), then prints a markdown table: per candidate, every family's accuracy (seconds), the margin
of the weakest memory family over the Gated DeltaNet baseline, and the summed seconds.
``python benchmarks/demo_sweep.py --grid state --workers 14 --out sweep/`` (``--only A,B`` picks
candidates, ``--steps N`` makes a smoke run of a grid).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

# Each candidate may name ``families`` to train only those. Grids: ``learning`` (how fast each family learns
# the quick task) and ``capacity`` (more pairs than the baseline's state holds comfortably).
def _pairs(n: int, queries: int = 8, **rest) -> dict:
    return dict(num_pairs=n, num_queries=queries, vocab_size=4 + 2 * (n + 8), seq_len=2 * n + 1 + 2 * queries, **rest)


GRIDS: dict[str, dict[str, dict]] = {
    "learning": {
    "quick": {},
    "quick-800": dict(steps=800, eval_every=100),
    "lr1e-3-800": dict(steps=800, eval_every=100, learning_rate=1e-3),
    "bs64": dict(batch_size=64),
    "dt-depth1": dict(families=("DeepTransformer",), model_overrides={"DeepTransformer": {"memory_depth": 1}}),
    "dt-depth1-800": dict(families=("DeepTransformer",), steps=800, eval_every=100,
                          model_overrides={"DeepTransformer": {"memory_depth": 1}}),
    "dt-std0.05": dict(families=("DeepTransformer",), model_overrides={"DeepTransformer": {"memory_init_std": 0.05}}),
    "dt-heads4": dict(families=("DeepTransformer",), model_overrides={"DeepTransformer": {"num_attention_heads": 4}}),
    "atlas-atlas": dict(families=("Atlas",), atlas_preset="atlas"),
    "atlas-omeganet": dict(families=("Atlas",), atlas_preset="omeganet"),
    "atlas-swla": dict(families=("Atlas",), atlas_preset="swla"),
    "atlas-dla-lr0.3": dict(families=("Atlas",), model_overrides={"Atlas": {"max_lr": 0.3}}),
    "mct-mean": dict(families=("MC-Titans",), model_overrides={"MC-Titans": {"aggregation": "mean"}}),
    "mct-lr0.1": dict(families=("MC-Titans",), model_overrides={"MC-Titans": {"max_lr": 0.1}}),
    "mct-titans": dict(families=("MC-Titans",), model_overrides={"MC-Titans": {"segment_size": None}}),
    "mct-linear": dict(families=("MC-Titans",), model_overrides={"MC-Titans": {"memory_depth": 1}}),
    "mct-chunk4": dict(families=("MC-Titans",), model_overrides={"MC-Titans": {"inner_chunk_size": 4}}),
},
    "capacity": {
        "quick": {},
        "n16-400": _pairs(16, steps=400, eval_every=50),
        "n24-400": _pairs(24, steps=400, eval_every=50),
        "n32-600": _pairs(32, steps=600, eval_every=100),
        "n24-800-cos": _pairs(24, steps=800, eval_every=100, final_lr_ratio=0.1),
        "h4-n16-400": _pairs(16, steps=400, eval_every=50, num_heads=4),
        "h4-n24-600": _pairs(24, steps=600, eval_every=100, num_heads=4),
        "d32-n16-400": _pairs(16, steps=400, eval_every=50, hidden_size=32),
    },
}
# MoM alone: routed top-1 plus the shared memory (two memories over each token, like the variants that learned
# on the default settings) on the quick and the default settings, two seeds.
_DEFAULT = dict(seq_len=64, num_pairs=12, steps=500, eval_every=50, final_lr_ratio=0.1)
_TOP1 = dict(families=("MoM",), model_overrides={"MoM": {"topk": 1}})
GRIDS["mom"] = {
    "mom-top1-quick": dict(_TOP1),
    "mom-top1-quick-s1": dict(_TOP1, seed=1),
    "mom-top1-default": dict(_TOP1, **_DEFAULT),
    "mom-top1-default-s1": dict(_TOP1, **_DEFAULT, seed=1),
    "mom-default-s1": dict(families=("MoM",), **_DEFAULT, seed=1),
    "mom-default-s2": dict(families=("MoM",), **_DEFAULT, seed=2),
    "mom-default-s3": dict(families=("MoM",), **_DEFAULT, seed=3),
    "mom-default-1000": dict(families=("MoM",), **{**_DEFAULT, "steps": 1000, "eval_every": 100}),
}
# The baseline's state runs out: every recurrent memory's keys narrowed to ``head_dim`` (the demo's setting;
# gated-delta values stay head-wide) against more pairs than that width. Each family then holds as many keys as
# its memory allows: Gated DeltaNet one d_k x d_v matrix per head, MoM several, Atlas and MC-Titans an MLP (and
# MC-Titans cached copies of it). Runs named ``-gpu`` train on the GPU for longer; ``hd16-n16-gpu`` is what
# ``DemoSettings.default()`` became.
BASELINE_NAME = "Gated DeltaNet"  # mnemo.demo.BASELINE, without importing torch here
_STATE = dict(families=("MoM", "Atlas", "MC-Titans", BASELINE_NAME))
_POLY = dict(families=("Atlas",), model_overrides={"Atlas": {"feature_map": "poly_tensor"}})
GRIDS["state"] = {
    "hd16-n16": _pairs(16, steps=800, eval_every=100, head_dim=16, **_STATE),
    "hd16-n24": _pairs(24, steps=800, eval_every=100, head_dim=16, **_STATE),
    "hd16-n16-lr5e-3": _pairs(16, steps=800, eval_every=100, learning_rate=5e-3, head_dim=16, **_STATE),
    "hd32-n32": _pairs(32, steps=800, eval_every=100, **_STATE),
    "hd8-n16-poly": _pairs(16, steps=800, eval_every=100, head_dim=8, **_POLY),
    "hd16-n24-poly": _pairs(24, steps=800, eval_every=100, head_dim=16, **_POLY),
    "hd16-n24-gpu": _pairs(24, steps=1500, eval_every=250, head_dim=16, device="cuda", **_STATE),
    "hd32-n48-gpu": _pairs(48, steps=1000, eval_every=250, device="cuda", **_STATE),
    "hd16-n16-gpu": _pairs(16, steps=1500, eval_every=250, head_dim=16, device="cuda", **_STATE),
    "hd16-n20-gpu": _pairs(20, steps=1500, eval_every=250, head_dim=16, device="cuda", **_STATE),
    "hd16-n24-gpu-s1": _pairs(24, steps=1500, eval_every=250, head_dim=16, device="cuda", seed=1,
                              families=("MoM", BASELINE_NAME)),
    "hd16-n24-poly-gpu": _pairs(24, steps=1500, eval_every=250, head_dim=16, device="cuda", **_POLY),
    # Quick-sized candidates (one CPU thread): every pair queried, or another seed.
    "q-hd16-n16-allq": _pairs(16, 16, steps=600, eval_every=100, head_dim=16, **_STATE),
    "q-hd16-n16-s1": _pairs(16, steps=600, eval_every=100, head_dim=16, seed=1, **_STATE),
    # Attention is not state-bound; these ask how many steps it needs to start recalling at all.
    "dt-2000-gpu": dict(families=("DeepTransformer",), steps=2000, eval_every=250, device="cuda"),
    "dt-depth1-2000-gpu": dict(families=("DeepTransformer",), steps=2000, eval_every=250, device="cuda",
                               model_overrides={"DeepTransformer": {"memory_depth": 1}}),
}
CANDIDATES: dict[str, dict] = {name: c for grid in GRIDS.values() for name, c in grid.items()}


def _job(candidate: str, family: str, steps: int | None = None) -> dict:
    import torch

    torch.set_num_threads(1)
    from mnemo.demo import DemoSettings, build_model, train_family

    overrides = {k: v for k, v in CANDIDATES[candidate].items() if k != "families"}
    if steps is not None:  # a smoke run of the grid
        overrides.update(steps=steps, eval_every=steps, eval_samples=16)
    settings = DemoSettings.quick(**overrides)
    start = time.perf_counter()
    result = train_family(family, build_model(family, settings), settings, progress=False)
    return {"candidate": candidate, "family": family, "accuracy": result.final_accuracy,
            "train_seconds": result.train_seconds, "wall_seconds": time.perf_counter() - start,
            "curve": result.curve, "skipped": result.skipped_steps, "parameters": result.parameters}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=max(1, multiprocessing.cpu_count() - 2))
    parser.add_argument("--only", default=None)
    parser.add_argument("--grid", choices=tuple(GRIDS), default="learning")
    parser.add_argument("--out", default="demo-sweep")
    parser.add_argument("--steps", type=int, default=None, help="train every candidate this many steps instead")
    args = parser.parse_args()
    from mnemo.demo import BASELINE, FAMILIES

    names = args.only.split(",") if args.only else list(GRIDS[args.grid])
    jobs = [(c, f, args.steps) for c in names for f in CANDIDATES[c].get("families", FAMILIES)]
    # Longest candidates first, so the pool does not end on one long job.
    jobs.sort(key=lambda job: -CANDIDATES[job[0]].get("steps", 200) * CANDIDATES[job[0]].get("seq_len", 33))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        # Written as each job ends (not in submission order), so a time limit keeps every finished job.
        for future in as_completed([pool.submit(_job, *job) for job in jobs]):
            res = future.result()
            results.append(res)
            with (out / "sweep.jsonl").open("a") as handle:
                handle.write(json.dumps(res) + "\n")
    print("| candidate | " + " | ".join(FAMILIES) + " | weakest memory - baseline | seconds (sum) |")
    print("|---|" + "---|" * (len(FAMILIES) + 2))
    for c in names:
        row = {r["family"]: r for r in results if r["candidate"] == c}
        memories = [f for f in FAMILIES if f != BASELINE and f in row]
        margin = (min(row[f]["accuracy"] for f in memories) - row[BASELINE]["accuracy"]
                  if memories and BASELINE in row else float("nan"))
        cells = [f"{100 * row[f]['accuracy']:.1f}% ({row[f]['train_seconds']:.0f}s)" if f in row else "-"
                 for f in FAMILIES]
        print(f"| {c} | " + " | ".join(cells) + f" | {100 * margin:+.1f} | {sum(r['train_seconds'] for r in row.values()):.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
