"""The pieces of ``mnemo demo``: train tiny models of every family on MQAR and report what they recall.

Multi-query associative recall is the task that separates memory models from plain
recurrent ones: a fixed-size state has to hold every key-value pair of the context
until it is queried. The demo trains, from the same seed and on the same stream of
fresh batches, a tiny model of each family and the plain recurrent baseline
(Gated DeltaNet, i.e. MoM with a single memory, top-1 routing and no shared memory),
scores them on a fixed held-out set, and reports the accuracies as a table, JSON,
CSV and a plot of accuracy against training steps.

- :class:`DemoSettings` with :meth:`DemoSettings.quick` (a few minutes on a laptop
  CPU) and :meth:`DemoSettings.default` (longer sequences, more pairs and steps).
- :func:`build_model` makes a family's tiny model; :func:`train_family` trains and
  scores it; :func:`run_demo` does both for every family of the settings.
- :func:`results_table`, :func:`write_results` and :func:`plot_results` report.
"""

from __future__ import annotations

import csv
import io
import json
import math
import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from transformers import PreTrainedModel

from .tasks import answer_accuracy, mqar_batch

BASELINE = "Gated DeltaNet"
FAMILIES = ("MoM", "Atlas", "DeepTransformer", "MC-Titans", BASELINE)


@dataclass
class DemoSettings:
    """What the demo trains and how.

    Every family gets the same width, depth, vocabulary, data stream, step count and
    optimiser; they differ only in their memory. ``num_queries=None`` asks as many queries
    as there are pairs; ``distinct_queries=False`` draws each query's pair at random, so
    that ruling out already-answered values is no shortcut (see :func:`~mnemo.tasks.mqar_batch`).
    The learning rate warms up linearly, then follows a cosine down to ``final_lr_ratio``
    of its peak (1.0: constant).
    ``head_dim`` is the key width per head of every state-bound memory (``None``: ``hidden_size //
    num_heads``): it sets how many keys one memory matrix can keep apart. The gated-delta memories keep their
    values ``hidden_size // num_heads`` wide whatever it is; attention (DeepTransformer) is not state-bound and
    keeps ``hidden_size // num_heads`` per head.
    ``eval_every`` is the step interval of the held-out evaluations (the accuracy curve).
    ``model_overrides`` maps a family name to config fields that replace the demo's choices.
    """

    families: tuple[str, ...] = FAMILIES
    vocab_size: int = 36
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 2
    head_dim: int | None = None
    seq_len: int = 33
    num_pairs: int = 8
    num_queries: int | None = None
    distinct_queries: bool = False
    batch_size: int = 32
    steps: int = 200
    learning_rate: float = 3e-3
    weight_decay: float = 0.1
    warmup_steps: int = 20
    final_lr_ratio: float = 1.0
    eval_every: int = 25
    eval_samples: int = 128
    atlas_preset: str = "dla"
    model_overrides: dict[str, dict] = field(default_factory=dict)
    seed: int = 0
    device: str = "cpu"

    @classmethod
    def quick(cls, **overrides) -> "DemoSettings":
        """15-50 s of CPU training per family: the whole demo in about three minutes on two cores.

        8 pairs over 16 possible keys, every pair queried once on average, no gaps; the
        held-out set is scored every 40 steps (scoring is not training, but it is time)."""
        return cls(**{"eval_every": 40, **overrides})

    @classmethod
    def default(cls, **overrides) -> "DemoSettings":
        """Where the baseline's state runs short: 16 pairs (8 of them queried) over 24 possible keys, for
        memories whose keys are 16 wide, 1,500 steps. One Gated DeltaNet matrix per head then has to keep 16
        keys apart in 16 dimensions; the memory families hold more (several matrices, an MLP, cached copies).
        About 10 minutes on two CPU cores with two workers, 4-5 on a GPU with every family at once."""
        base = dict(num_pairs=16, num_queries=8, vocab_size=52, seq_len=49, head_dim=16, steps=1500,
                    eval_every=100, device="cuda" if torch.cuda.is_available() else "cpu")
        return cls(**{**base, **overrides})

    @property
    def queries(self) -> int:
        return self.num_pairs if self.num_queries is None else self.num_queries

    def to_dict(self) -> dict:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v) for f in fields(self)}


@dataclass
class FamilyResult:
    """One family's run: held-out MQAR accuracy along training (``curve``: ``(step, accuracy)``) and at the end.

    ``skipped_steps`` counts the updates left out because the gradient was not finite."""

    family: str
    description: str
    parameters: int
    steps: int
    final_accuracy: float
    final_loss: float
    train_seconds: float
    tokens_per_second: float
    curve: list[tuple[int, float]] = field(default_factory=list)
    skipped_steps: int = 0

    @classmethod
    def from_dict(cls, data: dict) -> "FamilyResult":
        data = dict(data)
        data["curve"] = [tuple(point) for point in data.get("curve", [])]
        return cls(**data)


# ---------------------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------------------


def _common(settings: DemoSettings) -> dict:
    # No special tokens: MQAR's reserved ids are data, and generation should not stop on one of them.
    return dict(vocab_size=settings.vocab_size, hidden_size=settings.hidden_size,
                num_hidden_layers=settings.num_layers, intermediate_size=2 * settings.hidden_size,
                pad_token_id=None, bos_token_id=None, eos_token_id=None)


def _head_dim(settings: DemoSettings) -> int:
    return settings.head_dim or settings.hidden_size // settings.num_heads


def _mom(settings: DemoSettings, name: str, **memories):
    from mnemo import MoMConfig, MoMForCausalLM

    chunk = min(64, settings.seq_len)
    # Values as wide as the model's heads, keys as narrow as the settings ask (expand_v makes up the difference).
    expand_v = max(1, settings.hidden_size // settings.num_heads // _head_dim(settings))
    kwargs = dict(num_heads=settings.num_heads, head_dim=_head_dim(settings), expand_v=expand_v, chunk_size=chunk,
                  **memories, **_common(settings))
    return MoMForCausalLM(MoMConfig(**{**kwargs, **settings.model_overrides.get(name, {})}))


def _atlas(settings: DemoSettings):
    from mnemo import AtlasConfig, AtlasForCausalLM

    # A full-strength inner step (max_lr 1) on an MLP memory whose initial weights are not near zero: with the
    # defaults (0.1, 0.02) each write barely moves the memory's output and the demo's Atlas stayed at 21% on
    # --quick; with these it reached 94% (one thread, seed 0). The in-context gradient clip keeps it finite.
    kwargs = dict(num_heads=settings.num_heads, head_dim=_head_dim(settings), memory_expansion=2,
                  inner_chunk_size=16, ns_steps=3, max_lr=1.0, memory_init_std=1.0, **_common(settings))
    if settings.atlas_preset != "dla":  # DLA is the online rule: its window is 1 by definition
        kwargs["omega_window"] = 4
    kwargs.update(settings.model_overrides.get("Atlas", {}))
    return AtlasForCausalLM(AtlasConfig.preset(settings.atlas_preset, **kwargs))


def _deep_transformer(settings: DemoSettings):
    from mnemo import DeepTransformerConfig, DeepTransformerForCausalLM

    kwargs = dict(num_attention_heads=settings.num_heads, memory_depth=2, inner_chunk_size=16, memory_init_std=0.5,
                  max_position_embeddings=max(2048, settings.seq_len), **_common(settings))
    kwargs.update(settings.model_overrides.get("DeepTransformer", {}))
    return DeepTransformerForCausalLM(DeepTransformerConfig(**kwargs))


def _mc_titans(settings: DemoSettings):
    from mnemo import MCTitansConfig, MCTitansForCausalLM

    # Titans' short convolutions, a full-strength inner step and MLP weights not near zero, as for Atlas: with
    # max_lr 0.03, init std 0.02 and no convolutions the demo's MC-Titans stayed at 23% on --quick; with these
    # it reached 73% (one thread, seed 0). The in-context gradient clip (memory_grad_clip) keeps the
    # descent finite at this step size.
    kwargs = dict(num_heads=settings.num_heads, head_dim=_head_dim(settings), memory_expansion=2,
                  inner_chunk_size=16, segment_size=max(16, settings.seq_len // 4), aggregation="grm",
                  conv_size=4, max_lr=1.0, memory_init_std=1.0, **_common(settings))
    kwargs.update(settings.model_overrides.get("MC-Titans", {}))
    return MCTitansForCausalLM(MCTitansConfig(**kwargs))


_BUILDERS: dict[str, tuple[Callable[[DemoSettings], PreTrainedModel], Callable[[DemoSettings], str]]] = {
    "MoM": (lambda s: _mom(s, "MoM", num_memories=4, topk=2, shared_memory=True),
            lambda _s: "4 gated-delta memories, top-2 routing, + shared memory"),
    "Atlas": (_atlas, lambda s: f"Atlas preset {s.atlas_preset!r}: deep MLP memory trained in context"),
    "DeepTransformer": (_deep_transformer, lambda _s: "attention + deep (Hebbian) memory branch"),
    "MC-Titans": (_mc_titans, lambda s: f"Titans MLP memory, cached every {max(16, s.seq_len // 4)} tokens (GRM)"),
    BASELINE: (lambda s: _mom(s, BASELINE, num_memories=1, topk=1, shared_memory=False),
               lambda _s: "plain recurrent baseline: one gated-delta memory (MoM, 1 memory, top-1)"),
}


def build_model(name: str, settings: DemoSettings) -> PreTrainedModel:
    """A freshly initialised tiny model of family ``name`` (one of :data:`FAMILIES`), seeded by ``settings.seed``."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown family {name!r}: expected one of {FAMILIES}")
    torch.manual_seed(settings.seed)
    return _BUILDERS[name][0](settings)


def describe(name: str, settings: DemoSettings) -> str:
    """One line saying what ``name``'s memory is in the demo."""
    return _BUILDERS[name][1](settings)


# ---------------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------------


def heldout_set(settings: DemoSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed evaluation batches, drawn from a stream of their own so that training never sees them."""
    generator = torch.Generator().manual_seed(settings.seed + 1_000_003)
    return mqar_batch(settings.eval_samples, settings.num_pairs, settings.queries, settings.vocab_size, generator,
                      settings.seq_len, settings.distinct_queries)


def _learning_rate(step: int, settings: DemoSettings) -> float:
    """Linear warm-up, then cosine decay to ``final_lr_ratio`` times the peak."""
    if step < settings.warmup_steps:
        return settings.learning_rate * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(settings.steps - settings.warmup_steps, 1)
    floor = settings.final_lr_ratio
    return settings.learning_rate * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def _progress_bar(total: int, name: str, enabled: bool, position: int = 0):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=f"{name:>16s}", disable=not enabled, leave=True, dynamic_ncols=True,
                position=position)


def train_family(name: str, model: PreTrainedModel, settings: DemoSettings, progress: bool = True, *,
                 bar_position: int = 0) -> FamilyResult:
    """Train ``model`` with AdamW on fresh MQAR batches and score it on the held-out set every ``eval_every`` steps.

    The batch stream is seeded by ``settings.seed`` alone, so every family sees the same
    data; the same seed gives the same accuracies and losses again on the same machine and
    thread count (a different thread count changes float rounding, hence the trajectory).
    A step whose gradient is not finite is skipped and counted. Time spent on evaluation
    is not counted in ``train_seconds``.
    """
    device = torch.device(settings.device)
    model.to(device).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "embed" in n]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": settings.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=settings.learning_rate, betas=(0.9, 0.98))
    generator = torch.Generator().manual_seed(settings.seed)
    eval_ids, eval_labels = heldout_set(settings)

    def evaluate() -> float:
        return answer_accuracy(model, eval_ids, eval_labels, batch_size=max(settings.batch_size, 64))

    curve = [(0, evaluate())]
    train_seconds, loss_value, skipped = 0.0, float("nan"), 0
    with _progress_bar(settings.steps, name, progress, bar_position) as bar:
        for step in range(settings.steps):
            start = time.perf_counter()
            input_ids, labels = mqar_batch(settings.batch_size, settings.num_pairs, settings.queries,
                                           settings.vocab_size, generator, settings.seq_len, settings.distinct_queries)
            for group in optimizer.param_groups:
                group["lr"] = _learning_rate(step, settings)
            loss = model(input_ids.to(device), labels=labels.to(device)).loss
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if torch.isfinite(grad_norm):
                optimizer.step()
            else:  # one diverging batch must not poison the weights; the count is reported
                skipped += 1
            optimizer.zero_grad(set_to_none=True)
            loss_value = float(loss.detach())
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            train_seconds += time.perf_counter() - start
            done = step + 1
            if done % settings.eval_every == 0 or done == settings.steps:
                curve.append((done, evaluate()))
                bar.set_postfix(loss=f"{loss_value:.3f}", acc=f"{curve[-1][1]:.3f}")
            bar.update(1)
    model.eval()
    # Saved with the config, so that ``mnemo eval`` scores the model on the task it learnt by default.
    model.config.mqar_task = {"seq_len": settings.seq_len, "num_pairs": settings.num_pairs,
                              "num_queries": settings.queries, "vocab_size": settings.vocab_size,
                              "distinct_queries": settings.distinct_queries}
    tokens = settings.steps * settings.batch_size * settings.seq_len
    return FamilyResult(
        family=name,
        description=describe(name, settings) if name in _BUILDERS else "",
        parameters=sum(p.numel() for p in model.parameters()),
        steps=settings.steps,
        final_accuracy=curve[-1][1],
        final_loss=loss_value,
        train_seconds=train_seconds,
        tokens_per_second=tokens / train_seconds if train_seconds > 0 else float("nan"),
        curve=curve,
        skipped_steps=skipped,
    )


def usable_cores() -> int:
    """The cores this process may run on (its affinity, as under ``taskset`` or a container's CPU set)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def threads_per_worker(device: str, workers: int) -> int | None:
    """The torch threads each process that trains a family uses (``None``: torch's default, left alone).

    On a CPU, one. The demo's models are so small (hidden 64, batches of 32 x 33 tokens) that a second
    intra-op thread shortens a step little (107 to 87 ms on two idle cores), while every operator then ends
    in a barrier where the threads wait for each other: when other processes share the cores, a descheduled
    thread holds the other up (beside two busy loops a step took 370 ms with two threads, 232 ms with one;
    docs/demo.md). One thread per worker is steady under load, leaves the cores to ``--workers``, and gives
    the same numbers on every machine whatever its core count. On a GPU the host threads only launch
    kernels: each worker gets its share of the cores, as before.
    """
    if torch.device(device).type == "cpu":
        return 1
    return max(1, usable_cores() // workers) if workers > 1 else None


def _train_in_worker(name: str, settings: DemoSettings, progress: bool, position: int,
                     threads: int | None) -> tuple[FamilyResult, bytes, dict]:
    """One family trained in a worker process: its result, its weights (serialised) and the task it learnt."""
    if threads is not None:
        torch.set_num_threads(threads)
    model = build_model(name, settings)
    result = train_family(name, model, settings, progress=progress, bar_position=position)
    buffer = io.BytesIO()
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, buffer)
    return result, buffer.getvalue(), model.config.mqar_task


def run_demo(settings: DemoSettings, progress: bool = True, workers: int = 1,
             threads: int | None = None) -> tuple[list[FamilyResult], dict[str, PreTrainedModel]]:
    """Build and train every family of ``settings``; returns the results and the trained models by family.

    ``workers > 1`` trains that many families at once, each in its own process (on a GPU, all of them on the
    same device). ``threads`` is the torch thread count of each process that trains (default:
    :func:`threads_per_worker`, one on a CPU); a sequential run sets it for its duration and restores the
    caller's. Every family is seeded on its own, so with the same thread count the results are those of a
    sequential run.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    workers = max(1, min(workers, len(settings.families)))
    threads = threads if threads is not None else threads_per_worker(settings.device, workers)
    results, models = [], {}
    if workers == 1:
        caller_threads = torch.get_num_threads()
        if threads is not None:
            torch.set_num_threads(threads)
        try:
            for name in settings.families:
                model = build_model(name, settings)
                results.append(train_family(name, model, settings, progress=progress))
                models[name] = model
        finally:
            torch.set_num_threads(caller_threads)
        return results, models
    # Spawned, not forked: a forked child of a process that has touched CUDA or OpenMP threads can hang.
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_train_in_worker, name, settings, progress, position, threads)
                   for position, name in enumerate(settings.families)]
        for name, future in zip(settings.families, futures):
            result, weights, task = future.result()
            model = build_model(name, settings)
            model.load_state_dict(torch.load(io.BytesIO(weights), weights_only=True))
            model.config.mqar_task = task
            results.append(result)
            models[name] = model.to(settings.device).eval()
    return results, models


# ---------------------------------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------------------------------

_COLUMNS = ("family", "params", "MQAR accuracy", "train time", "tokens/s")


def _row(result: FamilyResult) -> tuple[str, ...]:
    return (result.family, f"{result.parameters:,}", f"{100 * result.final_accuracy:.1f}%",
            f"{result.train_seconds:.1f} s", f"{result.tokens_per_second:,.0f}")


def results_table(results: list[FamilyResult]) -> str:
    """A markdown table (aligned, so it also reads as plain text): family, parameters, accuracy, time, tokens/s."""
    rows = [_COLUMNS] + [_row(r) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    left = {0}  # the family name reads left-aligned, numbers right-aligned

    def line(cells):
        return "| " + " | ".join(c.ljust(w) if i in left else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    rule = "|" + "|".join(("-" * (w + 2)) if i in left else ("-" * (w + 1) + ":") for i, w in enumerate(widths)) + "|"
    return "\n".join([line(rows[0]), rule] + [line(r) for r in rows[1:]])


_CSV_FIELDS = ("family", "description", "parameters", "steps", "final_accuracy", "final_loss", "train_seconds",
               "tokens_per_second", "skipped_steps")


def write_results(results: list[FamilyResult], output_dir: str | Path,
                  settings: DemoSettings | None = None) -> tuple[Path, Path]:
    """Write ``results.json`` (everything, curves and settings included) and ``results.csv`` (one row per family)."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    payload = {"results": [asdict(r) for r in results]}
    if settings is not None:
        payload["settings"] = settings.to_dict()
    json_path = output_dir / "results.json"
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    csv_path = output_dir / "results.csv"
    with csv_path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=_CSV_FIELDS)
        writer.writeheader()
        for r in results:
            writer.writerow({name: getattr(r, name) for name in _CSV_FIELDS})
    return json_path, csv_path


def read_results(path: str | Path) -> list[FamilyResult]:
    """The results of a ``results.json`` written by :func:`write_results`."""
    return [FamilyResult.from_dict(r) for r in json.loads(Path(path).read_text())["results"]]


def plot_results(results: list[FamilyResult], path: str | Path, title: str | None = None) -> Path:
    """Plot held-out MQAR accuracy against training steps, one line per family, to a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed, and no GUI toolkit to import
    from matplotlib import pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    try:
        for r in results:
            steps, accuracy = zip(*r.curve) if r.curve else ((), ())
            style = "--" if r.family == BASELINE else "-"
            ax.plot(steps, [100 * a for a in accuracy], style, marker="o", markersize=3, label=r.family)
        ax.set_xlabel("training step")
        ax.set_ylabel("held-out MQAR accuracy (%)")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
        ax.set_title(title or "Multi-query associative recall")
        ax.legend(loc="best", fontsize="small")
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
    return path
