"""``mnemo demo --conversion``: what Memory Caching conversion buys a trained recurrent model, measured.

The Memory Caching paper (§4.3, "Memory Caching as Post Training") caches the memory of a
model trained without caching at every segment end (the training length ``L``) and reads
the cached memories back, with no learned weights (``mean``, ``residual``) or through gates
fine-tuned briefly (``grm``, ``ssc``), to extend how far the model recalls. This module
measures that claim on tiny models:

1. train a Gated DeltaNet, a MoM, a Titans and an Atlas model (the main demo's models,
   :func:`mnemo.demo.build_model`) on a recall task at length ``L``: token-form passkey
   retrieval (:func:`mnemo.tasks.passkey_token_sample`) and MQAR (:func:`mnemo.tasks.mqar_batch`),
   the generators ``mnemo eval`` uses;
2. convert each with the package's own :func:`~mnemo.conversion.memory_caching.convert_to_memory_caching`
   at ``segment_size=L``, for every aggregation of the settings;
3. fine-tune the gated conversions' gate projections (``u_proj``) alone, everything else frozen,
   on sequences a few segments long;
4. score the source and every conversion at ``L, 2L, 4L, 8L, 16L``.

- :class:`ConversionDemoSettings` with :meth:`~ConversionDemoSettings.quick` (a few minutes on a
  laptop CPU, passkey retrieval only) and :meth:`~ConversionDemoSettings.default` (both tasks,
  longer sequences, sized for a GPU).
- :func:`run_conversion_demo` does all of it and writes ``results.json`` (one row per task,
  family, aggregation, seed and length), ``results.md`` (the table) and ``accuracy.png``
  (accuracy against evaluation length; the source dashed).
- :func:`add_arguments` and :func:`main_from_args` are the command line's glue.

Inside the first segment nothing is cached yet, so every conversion, fine-tuned or not, scores
exactly its source at ``L``: the table's first column is the same for every row of a family.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch
from transformers import PreTrainedModel

from .demo import BASELINE, DemoSettings, _learning_rate, _progress_bar, build_model, threads_per_worker, usable_cores
from .tasks import IGNORE_INDEX, answer_accuracy, mqar_batch, mqar_min_length, passkey_token_sample

FAMILIES = (BASELINE, "MoM", "Titans", "Atlas")
AGGREGATIONS = ("mean", "residual", "grm", "ssc")
TASKS = ("passkey", "mqar")
SOURCE = "source"
RESULT_FILES = ("results.json", "results.md", "accuracy.png")
DEFAULT_OUTPUT = "mnemo-conversion-demo"
# The conversion demo's family names -> the main demo's builders. Titans is MC-Titans with one segment.
_DEMO_FAMILY = {BASELINE: BASELINE, "MoM": "MoM", "Titans": "MC-Titans", "Atlas": "Atlas"}


@dataclass
class ConversionDemoSettings:
    """What the conversion demo trains, converts, fine-tunes and scores.

    ``train_length`` is ``L``: the sources train on sequences of ``L`` tokens (a passkey prompt and its answer,
    or an MQAR sequence), the conversions cache every ``L`` tokens, and every model is scored at
    ``L * m`` for each ``m`` of ``length_multiples``. The sources are the main demo's models
    (:func:`mnemo.demo.build_model` with this width, depth and vocabulary; Titans without caching);
    they train with AdamW, the main demo's warm-up and cosine schedule (over ``steps``), on fresh batches, and
    stop early once they score ``target_accuracy`` on a validation set at ``L`` (``validation_samples``
    sequences of their own, checked every ``check_every`` steps; ``None``: always ``steps``). Models this small
    sit on a plateau for a number of steps that varies with the seed; stopping at a target gives every source
    the same footing at ``L`` (or all of ``steps``, which the results record) without training the quick
    learners for as long as the slow ones need.

    The gated aggregations' gate projections (``u_proj``) are then fine-tuned alone for ``finetune_steps``
    steps on sequences of ``L * finetune_length_multiple`` tokens (several segments, so that there are
    cached memories to choose between); ``finetune_steps=0`` scores them as converted (they read as
    ``mean``). The passkey's needle lies at a uniform random depth in training and at the depths
    ``eval_depths`` (``eval_samples`` prompts per length, spread evenly over them) in scoring; MQAR puts
    ``mqar_pairs`` pairs at the start and scatters as many queries over the rest, however long.

    ``seeds`` are the independent runs (weights, data, held-out sets); the report gives their mean and
    standard deviation. ``model_overrides`` maps a family name to config fields, as in the main demo.
    """

    families: tuple[str, ...] = FAMILIES
    tasks: tuple[str, ...] = ("passkey",)
    aggregations: tuple[str, ...] = AGGREGATIONS
    train_length: int = 32
    length_multiples: tuple[int, ...] = (1, 2, 4, 8, 16)
    vocab_size: int = 32
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 2
    passkey_digits: int = 5
    mqar_pairs: int = 4
    batch_size: int = 64
    steps: int = 600
    target_accuracy: float | None = 0.95
    check_every: int = 25
    validation_samples: int = 64
    learning_rate: float = 3e-3
    weight_decay: float = 0.1
    warmup_steps: int = 20
    finetune_steps: int = 40
    finetune_learning_rate: float = 1e-2
    finetune_length_multiple: int = 4
    finetune_batch_size: int = 16
    ssc_topk: int = 2
    eval_samples: int = 50
    eval_depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    eval_batch_size: int = 64
    model_overrides: dict[str, dict] = field(default_factory=dict)
    seeds: tuple[int, ...] = (0,)
    device: str = "cpu"

    @classmethod
    def quick(cls, **overrides) -> "ConversionDemoSettings":
        """Passkey retrieval at L = 32, batches of 64, each source trained until it scores 95% at L (at most 600
        steps), 40 gate steps at 4L: minutes on two CPU cores."""
        return cls(**overrides)

    @classmethod
    def default(cls, **overrides) -> "ConversionDemoSettings":
        """Both tasks (MQAR with 8 pairs) at L = 64, scored up to 1,024 tokens; at most 1,500 training steps per
        source, 100 gate steps, 200 held-out sequences per length: sized for one GPU (the models are the quick
        run's, which learn the task)."""
        base = dict(tasks=TASKS, train_length=64, mqar_pairs=8, steps=1500, warmup_steps=50, finetune_steps=100,
                    eval_samples=200, validation_samples=128, device="cuda" if torch.cuda.is_available() else "cpu")
        return cls(**{**base, **overrides})

    def __post_init__(self) -> None:
        for name in ("families", "tasks", "aggregations", "length_multiples", "eval_depths", "seeds"):
            setattr(self, name, tuple(getattr(self, name)))
        _check_choices("family", self.families, FAMILIES)
        _check_choices("task", self.tasks, TASKS)
        _check_choices("aggregation", self.aggregations, ("mean", "residual", "grm", "soup", "ssc"))
        for name in ("train_length", "batch_size", "steps", "finetune_length_multiple", "finetune_batch_size",
                     "eval_samples", "eval_batch_size", "passkey_digits", "mqar_pairs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.target_accuracy is not None and not 0.0 < self.target_accuracy <= 1.0:
            raise ValueError(f"target_accuracy must be in (0, 1] or None, got {self.target_accuracy}")
        if self.check_every < 1 or self.validation_samples < 1:
            raise ValueError("check_every and validation_samples must be >= 1")
        if self.finetune_steps < 0:
            raise ValueError(f"finetune_steps must be >= 0, got {self.finetune_steps}")
        if not self.seeds or not self.length_multiples or min(self.length_multiples) < 1:
            raise ValueError("seeds and length_multiples need at least one entry, and multiples are >= 1")
        if "passkey" in self.tasks and self.train_length < self.passkey_digits + 3:
            raise ValueError(f"train_length={self.train_length} cannot hold a {self.passkey_digits}-digit passkey "
                             "prompt and its answer")
        if "mqar" in self.tasks and self.train_length < mqar_min_length(self.mqar_pairs, self.mqar_pairs):
            raise ValueError(f"train_length={self.train_length} cannot hold {self.mqar_pairs} MQAR pairs and as "
                             f"many queries (needs >= {mqar_min_length(self.mqar_pairs, self.mqar_pairs)})")

    @property
    def eval_lengths(self) -> tuple[int, ...]:
        return tuple(self.train_length * m for m in self.length_multiples)

    def to_dict(self) -> dict:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v) for f in fields(self)}


def _check_choices(what: str, chosen: Sequence[str], allowed: Sequence[str]) -> None:
    unknown = [c for c in chosen if c not in allowed]
    if unknown or not chosen:
        raise ValueError(f"unknown {what} {unknown or chosen!r}: expected some of {tuple(allowed)}")


def demo_settings(settings: ConversionDemoSettings, seed: int) -> DemoSettings:
    """The main demo's settings that build this demo's sources (and drive the learning-rate schedule)."""
    overrides = {_DEMO_FAMILY[name]: dict(config) for name, config in settings.model_overrides.items()}
    # Titans is MC-Titans with a single segment; the conversion gives it its segments.
    overrides["MC-Titans"] = {"segment_size": None, **overrides.get("MC-Titans", {})}
    return DemoSettings(
        families=tuple(_DEMO_FAMILY[name] for name in settings.families), vocab_size=settings.vocab_size,
        hidden_size=settings.hidden_size, num_layers=settings.num_layers, num_heads=settings.num_heads,
        seq_len=settings.train_length, batch_size=settings.batch_size, steps=settings.steps,
        learning_rate=settings.learning_rate, weight_decay=settings.weight_decay,
        warmup_steps=settings.warmup_steps, model_overrides=overrides, seed=seed, device=settings.device)


def build_source(family: str, settings: ConversionDemoSettings, seed: int) -> PreTrainedModel:
    """A freshly initialised source model of ``family`` (one of :data:`FAMILIES`), without Memory Caching."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}: expected one of {FAMILIES}")
    return build_model(_DEMO_FAMILY[family], demo_settings(settings, seed))


# ---------------------------------------------------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------------------------------------------------


def passkey_batch(batch_size: int, length: int, settings: ConversionDemoSettings, generator: torch.Generator,
                  depths: Sequence[float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` passkey prompts with their answers, ``length`` tokens in all; labels on the answer only.

    Row ``i`` hides its needle at ``depths[i % len(depths)]``, or at a uniform random depth without ``depths``."""
    digits = settings.passkey_digits
    rows, labels = [], []
    for i in range(batch_size):
        depth = float(torch.rand((), generator=generator)) if depths is None else depths[i % len(depths)]
        sample = passkey_token_sample(length - digits, depth, settings.vocab_size, generator, digits)
        row = torch.cat([sample.input_ids, sample.answer_ids])
        label = torch.full_like(row, IGNORE_INDEX)
        label[-digits:] = sample.answer_ids
        rows.append(row)
        labels.append(label)
    return torch.stack(rows), torch.stack(labels)


@torch.no_grad()
def passkey_accuracy(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                     batch_size: int = 64) -> float:
    """Fraction of rows whose whole passkey the model predicts (teacher-forced argmax at every digit, which is
    greedy generation of the passkey), as :func:`mnemo.tasks.passkey_token_accuracy` scores it, in batches."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    hits = 0
    try:
        for start in range(0, input_ids.shape[0], batch_size):
            ids = input_ids[start:start + batch_size].to(device)
            target = labels[start:start + batch_size, 1:].to(device)
            predicted = model(ids, use_cache=False).logits[:, :-1].argmax(-1)
            answer = target != IGNORE_INDEX
            hits += int(((predicted == target) | ~answer).all(-1).sum())
    finally:
        model.train(was_training)
    return hits / max(input_ids.shape[0], 1)


@dataclass(frozen=True)
class _Task:
    name: str
    batch: Callable[[int, int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    heldout: Callable[[int, int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]  # (count, length, generator)
    accuracy: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], float]


def _task(name: str, settings: ConversionDemoSettings) -> _Task:
    if name == "passkey":
        return _Task(
            name,
            batch=lambda n, length, g: passkey_batch(n, length, settings, g),
            heldout=lambda n, length, g: passkey_batch(n, length, settings, g, settings.eval_depths),
            accuracy=lambda m, ids, lab: passkey_accuracy(m, ids, lab, settings.eval_batch_size))
    pairs = settings.mqar_pairs
    # Each query draws its pair at random (the main demo's choice), so ruling out answered pairs is no shortcut.
    return _Task(
        name,
        batch=lambda n, length, g: mqar_batch(n, pairs, pairs, settings.vocab_size, g, length, False),
        heldout=lambda n, length, g: mqar_batch(n, pairs, pairs, settings.vocab_size, g, length, False),
        accuracy=lambda m, ids, lab: answer_accuracy(m, ids, lab, settings.eval_batch_size))


def _generator(seed: int, *salt: int) -> torch.Generator:
    # Separate streams for training, fine-tuning and each held-out length: adding a length changes no other.
    value = seed
    for s in salt:
        value = value * 1_000_003 + s
    return torch.Generator().manual_seed(value % (2**63))


_STREAM = {"train": 1, "finetune": 2, "heldout": 3, "validation": 4}
_TASK_ID = {"passkey": 1, "mqar": 2}


# ---------------------------------------------------------------------------------------------------------------------
# Training, conversion, fine-tuning, scoring
# ---------------------------------------------------------------------------------------------------------------------


def train(model: PreTrainedModel, task: _Task, schedule: DemoSettings, length: int, batch_size: int,
          generator: torch.Generator, parameters: list[torch.nn.Parameter] | None = None, weight_decay: float = 0.0,
          label: str = "", progress: bool = False, done: Callable[[], bool] | None = None,
          check_every: int = 25) -> dict:
    """Train ``parameters`` (default: all of ``model``'s) for up to ``schedule.steps`` steps on fresh
    ``length``-token batches of ``task``, with AdamW and the main demo's schedule (``schedule.learning_rate``,
    warm-up, cosine over ``schedule.steps``); every ``check_every`` steps, stop early once ``done()`` says so.

    As in the main demo, the gradient is clipped at norm 1 and a step whose gradient is not finite is skipped
    and counted. Returns the steps taken, the last loss, the skipped steps and the training time (checks
    included)."""
    device = torch.device(schedule.device)
    model.to(device).train()
    parameters = list(model.parameters()) if parameters is None else parameters
    decay = [p for p in parameters if p.dim() >= 2]
    no_decay = [p for p in parameters if p.dim() < 2]
    embeddings = {id(p) for n, p in model.named_parameters() if "embed" in n}
    no_decay += [p for p in decay if id(p) in embeddings]
    decay = [p for p in decay if id(p) not in embeddings]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=schedule.learning_rate, betas=(0.9, 0.98))
    loss_value, skipped, steps, start = float("nan"), 0, 0, time.perf_counter()
    with _progress_bar(schedule.steps, label, progress) as bar:
        for step in range(schedule.steps):
            input_ids, labels = task.batch(batch_size, length, generator)
            for group in optimizer.param_groups:
                group["lr"] = _learning_rate(step, schedule)
            loss = model(input_ids.to(device), labels=labels.to(device)).loss
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(parameters, 1.0)
            if torch.isfinite(grad_norm):
                optimizer.step()
            else:  # one diverging batch must not poison the weights; the count is reported
                skipped += 1
            optimizer.zero_grad(set_to_none=True)
            loss_value = float(loss.detach())
            bar.set_postfix(loss=f"{loss_value:.3f}", refresh=False)
            bar.update(1)
            steps = step + 1
            if done is not None and steps % check_every == 0 and steps < schedule.steps:
                finished = done()
                model.train()
                if finished:
                    break
    model.eval()
    return {"steps": steps, "loss": loss_value, "skipped_steps": skipped, "seconds": time.perf_counter() - start}


def convert(source_dir: str | Path, out_dir: str | Path, aggregation: str, settings: ConversionDemoSettings,
            device: str | None = None) -> PreTrainedModel:
    """The Memory Caching variant of the checkpoint in ``source_dir``, cached every ``settings.train_length``
    tokens, written to ``out_dir`` by :func:`~mnemo.conversion.memory_caching.convert_to_memory_caching` and
    loaded from there."""
    from transformers import AutoModelForCausalLM

    from .conversion.memory_caching import convert_to_memory_caching

    out = convert_to_memory_caching(source_dir, out_dir, segment_size=settings.train_length,
                                    aggregation=aggregation, ssc_topk=settings.ssc_topk)
    return AutoModelForCausalLM.from_pretrained(out).to(device or settings.device).eval()


def gate_parameters(model: PreTrainedModel) -> dict[str, torch.nn.Parameter]:
    """The gate projections (``u_proj``) that score the cached memories: the conversion adds them to MoM and
    Atlas and resets Titans' (never read while a model has one segment) to zero."""
    return {name: p for name, p in model.named_parameters() if name.endswith(".u_proj.weight")}


def finetune_gates(model: PreTrainedModel, task: _Task, settings: ConversionDemoSettings, seed: int,
                   label: str = "", progress: bool = False) -> dict:
    """Fine-tune the gate projections alone (every other weight frozen) on sequences of
    ``finetune_length_multiple`` segments. Returns :func:`train`'s summary and the trainable count.

    Only the gates train, so the model stays exactly its source inside the first segment, where they are
    not read."""
    gates = gate_parameters(model)
    if not gates:
        raise ValueError(f"{type(model).__name__} has no gate projection to fine-tune (aggregation "
                         f"{model.config.aggregation!r})")
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name in gates)
    schedule = replace(demo_settings(settings, seed), steps=settings.finetune_steps,
                       learning_rate=settings.finetune_learning_rate,
                       warmup_steps=min(settings.warmup_steps, max(settings.finetune_steps // 10, 1)))
    summary = train(model, task, schedule, settings.train_length * settings.finetune_length_multiple,
                    settings.finetune_batch_size, _generator(seed, _STREAM["finetune"], _TASK_ID[task.name]),
                    list(gates.values()), label=label, progress=progress)
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    summary["trainable_parameters"] = sum(p.numel() for p in gates.values())
    return summary


def heldout_sets(task: _Task, settings: ConversionDemoSettings, seed: int) -> dict[int, tuple]:
    """The fixed scoring batches of ``task`` at every evaluation length, from streams of their own."""
    return {length: task.heldout(settings.eval_samples, length,
                                 _generator(seed, _STREAM["heldout"], _TASK_ID[task.name], length))
            for length in settings.eval_lengths}


def score(model: torch.nn.Module, task: _Task, heldout: dict[int, tuple]) -> dict[int, float]:
    """Accuracy of ``model`` on each length's held-out batch."""
    return {length: task.accuracy(model, ids, labels) for length, (ids, labels) in heldout.items()}


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _scored_rows(base: dict, model: torch.nn.Module, task: _Task, heldout: dict[int, tuple],
                 train_length: int) -> list[dict]:
    start = time.perf_counter()
    accuracies = score(model, task, heldout)
    base = {**base, "eval_seconds": time.perf_counter() - start}
    return [{**base, "length": length, "length_multiple": length // train_length, "accuracy": accuracy}
            for length, accuracy in accuracies.items()]


def run_family(family: str, task_name: str, settings: ConversionDemoSettings, seed: int, workdir: str | Path,
               progress: bool = True) -> list[dict]:
    """Train one source, convert it with every aggregation, fine-tune the gated ones, score them all.

    Returns one row per (aggregation, length); the source's rows have aggregation ``"source"``."""
    task = _task(task_name, settings)
    workdir = Path(workdir)
    heldout = heldout_sets(task, settings, seed)
    model = build_source(family, settings, seed)
    done = None
    if settings.target_accuracy is not None:  # a validation set of its own: the scored sets stay unseen
        val_ids, val_labels = task.heldout(settings.validation_samples, settings.train_length,
                                           _generator(seed, _STREAM["validation"], _TASK_ID[task_name]))

        def done() -> bool:
            return task.accuracy(model, val_ids, val_labels) >= settings.target_accuracy

    trained = train(model, task, demo_settings(settings, seed), settings.train_length, settings.batch_size,
                    _generator(seed, _STREAM["train"], _TASK_ID[task_name]), weight_decay=settings.weight_decay,
                    label=f"{family} {task_name}", progress=progress, done=done, check_every=settings.check_every)
    source_dir = workdir / f"{task_name}-{family.replace(' ', '-')}-{seed}"
    model.save_pretrained(source_dir)
    base = {"task": task_name, "family": family, "seed": seed, "parameters": _count(model),
            "source_steps": trained["steps"]}
    source_row = {**base, "aggregation": SOURCE, "parameters_added": 0, "trainable_parameters": 0,
                  "finetune_steps": 0, "train_loss": trained["loss"], "skipped_steps": trained["skipped_steps"],
                  "train_seconds": trained["seconds"]}
    rows = _scored_rows(source_row, model, task, heldout, settings.train_length)
    for aggregation in settings.aggregations:
        converted = convert(source_dir, source_dir.with_name(f"{source_dir.name}-{aggregation}"), aggregation,
                            settings)
        row = {**base, "aggregation": aggregation, "parameters_added": _count(converted) - _count(model),
               "trainable_parameters": 0, "finetune_steps": 0}
        if aggregation in ("grm", "soup", "ssc") and settings.finetune_steps > 0:
            tuned = finetune_gates(converted, task, settings, seed, label=f"{family} {aggregation}",
                                   progress=progress)
            row.update(trainable_parameters=tuned["trainable_parameters"], finetune_steps=settings.finetune_steps,
                       train_loss=tuned["loss"], skipped_steps=tuned["skipped_steps"],
                       train_seconds=tuned["seconds"])
        rows += _scored_rows(row, converted, task, heldout, settings.train_length)
    return rows


def check_output_dir(output_dir: str | Path, overwrite: bool = False) -> Path:
    """Refuse an output folder that already holds results (unless ``overwrite``), before any training."""
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise FileExistsError(f"{output_dir} exists and is not a folder")
    existing = [name for name in RESULT_FILES if (output_dir / name).exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{output_dir} already holds {', '.join(existing)}: use --overwrite "
                              "(overwrite=True) to replace them, or another folder")
    return output_dir


def _job(family: str, task_name: str, settings: ConversionDemoSettings, seed: int, workdir: str,
         threads: int | None, progress: bool) -> list[dict]:
    """One (family, task, seed) in a worker process, or in this one with its thread count for the duration."""
    caller_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return run_family(family, task_name, settings, seed, workdir, progress=progress)
    finally:
        torch.set_num_threads(caller_threads)


def default_workers(settings: ConversionDemoSettings) -> int:
    """One process per core on a CPU (each with one thread: see :func:`mnemo.demo.threads_per_worker`); on a
    GPU, four sharing it (models this small leave it idle between their small kernels)."""
    jobs = len(settings.seeds) * len(settings.tasks) * len(settings.families)
    return min(usable_cores() if torch.device(settings.device).type == "cpu" else 4, jobs)


def run_conversion_demo(settings: ConversionDemoSettings, output_dir: str | Path, progress: bool = True,
                        overwrite: bool = False, workers: int = 1, threads: int | None = None) -> list[dict]:
    """Run the whole demo for every seed, task and family of ``settings``, write the report to ``output_dir``
    (:func:`write_results`, :func:`plot_results`) and return the rows.

    The output folder is checked first: one that already holds results is refused unless ``overwrite``.
    Each (seed, task, family) is seeded on its own and runs in this process (``workers=1``) or in one of
    ``workers`` spawned processes (:func:`default_workers` is what the command line takes; a script that asks
    for several must call this under ``if __name__ == "__main__":``), with ``threads`` torch threads (default:
    :func:`mnemo.demo.threads_per_worker`, one on a CPU), so the numbers do not depend on how many run at
    once. The checkpoints (sources and conversions) live in a temporary folder, removed at the end. With
    several workers, a line per finished run replaces the progress bars."""
    output_dir = check_output_dir(output_dir, overwrite)
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    threads = threads if threads is not None else threads_per_worker(settings.device, workers)
    jobs = [(family, task, seed) for seed in settings.seeds for task in settings.tasks for family in settings.families]
    start = time.perf_counter()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="mnemo-conversion-") as workdir:
        if workers == 1:
            for family, task, seed in jobs:
                rows += _job(family, task, settings, seed, workdir, threads, progress)
        else:
            # Spawned, not forked: a forked child of a process that has touched CUDA or OpenMP threads can hang.
            with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=multiprocessing.get_context("spawn")) as pool:
                futures = [pool.submit(_job, family, task, settings, seed, workdir, threads, False)
                           for family, task, seed in jobs]
                for done, ((family, task, seed), future) in enumerate(zip(jobs, futures), 1):
                    job_rows = future.result()
                    rows += job_rows
                    if progress:
                        print(f"[{done}/{len(jobs)}] {family}, {task}, seed {seed}: {_job_line(job_rows)} "
                              f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    write_results(rows, output_dir, settings, seconds=time.perf_counter() - start)
    plot_results(rows, output_dir / "accuracy.png")
    return rows


def _job_line(rows: list[dict]) -> str:
    longest = max(r["length"] for r in rows)
    at = {r["aggregation"]: r["accuracy"] for r in rows if r["length"] == longest}
    return f"at {longest} tokens " + ", ".join(f"{name} {100 * value:.0f}%" for name, value in at.items())


# ---------------------------------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------------------------------


def summarize(rows: list[dict]) -> list[dict]:
    """One entry per (task, family, aggregation, length): the mean accuracy over seeds, its standard deviation
    (0 for one seed), the per-seed values, the parameter counts and the steps trained (``steps``: the source's
    training steps per seed for the source, the gates' fine-tuning steps for the others), in the rows' order."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["task"], row["family"], row["aggregation"], row["length"]), []).append(row)
    summary = []
    for (task, family, aggregation, length), members in groups.items():
        values = [m["accuracy"] for m in members]
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
        first = members[0]
        summary.append({"task": task, "family": family, "aggregation": aggregation, "length": length,
                        "length_multiple": first["length_multiple"], "mean": mean, "std": std,
                        "accuracies": values, "seeds": [m["seed"] for m in members],
                        "parameters_added": first["parameters_added"],
                        "trainable_parameters": first["trainable_parameters"],
                        "finetune_steps": first["finetune_steps"],
                        "steps": [m.get("source_steps", 0) for m in members] if aggregation == SOURCE
                        else [m["finetune_steps"] for m in members]})
    return summary


def _cell(mean: float, std: float, seeds: int) -> str:
    return f"{100 * mean:.0f}%" if seeds == 1 else f"{100 * mean:.0f} ± {100 * std:.0f}"


def _steps(per_seed: list[int]) -> str:
    return str(per_seed[0]) if len(set(per_seed)) == 1 else "/".join(str(n) for n in per_seed)


def results_table(rows: list[dict]) -> str:
    """A markdown table per task (aligned, so it reads as plain text): family, aggregation, accuracy at every
    length (mean ± standard deviation over seeds, in %, with several seeds), parameters added, gate
    parameters fine-tuned, and steps: the source's training steps (per seed, ``/`` between them), or the gates'
    fine-tuning steps."""
    summary = summarize(rows)
    out = []
    for task in dict.fromkeys(s["task"] for s in summary):
        entries = [s for s in summary if s["task"] == task]
        multiples = list(dict.fromkeys(s["length_multiple"] for s in entries))
        lengths = {s["length_multiple"]: s["length"] for s in entries}
        seeds = max(len(s["accuracies"]) for s in entries)
        header = ["family", "aggregation"] + [f"{m}L = {lengths[m]}" if m > 1 else f"L = {lengths[m]}"
                                              for m in multiples]
        header += ["params added", "gates trained", "steps"]
        table = [header]
        for family, aggregation in dict.fromkeys((s["family"], s["aggregation"]) for s in entries):
            cells = {s["length_multiple"]: s for s in entries
                     if s["family"] == family and s["aggregation"] == aggregation}
            first = next(iter(cells.values()))
            table.append([family, aggregation] + [_cell(cells[m]["mean"], cells[m]["std"], seeds) for m in multiples]
                         + [f"{first['parameters_added']:,}", f"{first['trainable_parameters']:,}",
                            _steps(first["steps"])])
        widths = [max(len(r[i]) for r in table) for i in range(len(header))]

        def line(cells: list[str]) -> str:
            return "| " + " | ".join(c.ljust(w) if i < 2 else c.rjust(w)
                                     for i, (c, w) in enumerate(zip(cells, widths))) + " |"

        rule = "|" + "|".join("-" * (w + 2) if i < 2 else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|"
        spread = f", mean ± standard deviation over {seeds} seeds, in %" if seeds > 1 else ""
        out.append(f"{task} accuracy by evaluation length{spread}\n\n"
                   + "\n".join([line(table[0]), rule] + [line(r) for r in table[1:]]))
    return "\n\n".join(out)


def write_results(rows: list[dict], output_dir: str | Path, settings: ConversionDemoSettings | None = None,
                  seconds: float | None = None) -> tuple[Path, Path]:
    """Write ``results.json`` (the rows, their summary over seeds, the settings) and ``results.md`` (the table)."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    payload: dict = {"results": rows, "summary": summarize(rows)}
    if settings is not None:
        payload["settings"] = settings.to_dict()
    if seconds is not None:
        payload["seconds"] = seconds
    json_path = output_dir / "results.json"
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    md_path = output_dir / "results.md"
    md_path.write_text(results_table(rows) + "\n")
    return json_path, md_path


def read_results(path: str | Path) -> list[dict]:
    """The rows of a ``results.json`` written by :func:`write_results`."""
    return json.loads(Path(path).read_text())["results"]


# The source dashed; residual dotted, because with a normalised output it draws the same line as mean.
_STYLE = {SOURCE: ("--", "o"), "mean": ("-", "o"), "residual": (":", "s"), "grm": ("-", "^"), "ssc": ("-", "v"),
          "soup": ("-", "D")}


def plot_results(rows: list[dict], path: str | Path, title: str | None = None) -> Path:
    """Accuracy against evaluation length (log scale), one panel per task and family, one line per variant
    (mean over seeds, bars of one standard deviation); the source dashed. A PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed, and no GUI toolkit to import
    from matplotlib import pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    summary = summarize(rows)
    tasks = list(dict.fromkeys(s["task"] for s in summary))
    families = list(dict.fromkeys(s["family"] for s in summary))
    fig, axes = plt.subplots(len(tasks), len(families), figsize=(3.2 * len(families), 2.9 * len(tasks)),
                             dpi=120, squeeze=False, sharey=True)
    try:
        for i, task in enumerate(tasks):
            for j, family in enumerate(families):
                ax = axes[i][j]
                entries = [s for s in summary if s["task"] == task and s["family"] == family]
                variants = list(dict.fromkeys(s["aggregation"] for s in entries))
                for k, aggregation in enumerate(variants):
                    line = sorted((s for s in entries if s["aggregation"] == aggregation), key=lambda s: s["length"])
                    fmt, marker = _STYLE.get(aggregation, ("-", "o"))
                    shift = 2 ** (0.035 * (k - (len(variants) - 1) / 2))  # side by side, so the bars stay apart
                    ax.errorbar([s["length"] * shift for s in line], [100 * s["mean"] for s in line],
                                yerr=[100 * s["std"] for s in line], fmt=fmt, marker=marker, markersize=3.5,
                                capsize=2, color="black" if aggregation == SOURCE else None, label=aggregation,
                                zorder=3 if aggregation == SOURCE else 2)
                ticks = sorted({(s["length"], s["length_multiple"]) for s in entries})
                ax.set_xscale("log", base=2)
                ax.set_xticks([n for n, _ in ticks], [f"{n}\n({m}L)" if m > 1 else f"{n}\n(L)" for n, m in ticks],
                              fontsize="small")
                ax.minorticks_off()
                ax.set_ylim(-3, 103)
                ax.grid(alpha=0.3)
                ax.set_title(f"{family}, {task}", fontsize="medium")
                if i == len(tasks) - 1:
                    ax.set_xlabel("evaluation length (tokens)")
                if j == 0:
                    ax.set_ylabel("accuracy (%)")
        axes[0][-1].legend(loc="best", fontsize="small")
        fig.suptitle(title or "Memory Caching conversion: accuracy beyond the training length")
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--conversion``, ``--seeds`` and ``--overwrite`` to the ``mnemo demo`` parser, each unless it has it.

    The conversion demo also reads the main demo's ``--quick``, ``--output``, ``--device``, ``--seed``,
    ``--steps`` (the sources' step limit), ``--workers``, ``--threads`` and ``--no-progress`` where the
    parser has them."""
    present = parser._option_string_actions
    group = parser.add_argument_group("Memory Caching conversion")
    if "--conversion" not in present:
        group.add_argument("--conversion", action="store_true",
                           help="train recurrent models at length L, convert them to Memory Caching (every L "
                                "tokens) and score every variant from L to 16L (docs/demo.md)")
    if "--seeds" not in present:
        group.add_argument("--seeds", type=int, default=1,
                           help="with --conversion: independent runs, seeds SEED, SEED+1, ...; the table gives "
                                "their mean and standard deviation (default 1)")
    if "--overwrite" not in present:
        group.add_argument("--overwrite", action="store_true", help="replace the results already in --output")


def settings_from_args(args: argparse.Namespace) -> ConversionDemoSettings:
    """The settings that ``mnemo demo --conversion [--quick]`` asks for."""
    if args.seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {args.seeds}")
    seed = getattr(args, "seed", None) or 0
    overrides: dict = {"seeds": tuple(range(seed, seed + args.seeds))}
    if getattr(args, "device", None):
        overrides["device"] = args.device
    if getattr(args, "steps", None):
        overrides["steps"] = args.steps
    return (ConversionDemoSettings.quick if getattr(args, "quick", False) else ConversionDemoSettings.default)(
        **overrides)


def main_from_args(args: argparse.Namespace) -> int:
    """``mnemo demo --conversion``: check the arguments and the output folder, run the demo, print the table.

    A mistake the user can fix (an option out of range, no GPU, results already in the output folder) prints
    one line on stderr and returns 2 before anything trains. ``--workers`` above 1 sets the processes;
    otherwise :func:`default_workers` does (one per core on a CPU)."""
    try:
        settings = settings_from_args(args)
        if torch.device(settings.device).type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {settings.device}: no CUDA device here; use --device cpu (or --quick)")
        output = Path(getattr(args, "output", None) or DEFAULT_OUTPUT).expanduser()
        overwrite = getattr(args, "overwrite", False)
        check_output_dir(output, overwrite)
    except (ValueError, FileExistsError) as err:
        print(f"mnemo demo --conversion: error: {err}", file=sys.stderr)
        return 2
    workers = getattr(args, "workers", None) or 1
    workers = workers if workers > 1 else default_workers(settings)
    lengths = ", ".join(str(n) for n in settings.eval_lengths)
    until = (f"until {100 * settings.target_accuracy:.0f}% at L, at most {settings.steps} steps"
             if settings.target_accuracy is not None else f"{settings.steps} steps")
    print(f"mnemo demo --conversion: {', '.join(settings.families)} trained on {' and '.join(settings.tasks)} at "
          f"L = {settings.train_length} tokens ({until}), converted to Memory Caching every L tokens "
          f"({', '.join(settings.aggregations)}; the gates fine-tuned alone for {settings.finetune_steps} steps at "
          f"{settings.finetune_length_multiple}L), scored at {lengths} tokens; seeds {list(settings.seeds)}, on "
          f"{settings.device}, {workers} process{'es' if workers > 1 else ''}.\n", flush=True)
    start = time.perf_counter()
    progress = not getattr(args, "no_progress", False) and sys.stderr.isatty()
    rows = run_conversion_demo(settings, output, progress=progress, overwrite=overwrite, workers=workers,
                               threads=getattr(args, "threads", None))
    print("\n" + results_table(rows))
    print(f"\nwrote {output / 'results.json'}, {output / 'results.md'} and {output / 'accuracy.png'} "
          f"({time.perf_counter() - start:.0f} s)")
    return 0
