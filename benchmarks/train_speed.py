"""The deep memories' training speed in one table, beside their anchors, with the targets it is held to.

One process, one GPU, in order:

- layers (``bench_layers.py``'s rows and construction: hidden 1024, bf16, forward + backward at 16,384
  tokens per step, B = tokens // T): every family beside PyTorch SDPA, flash-linear-attention's
  GatedDeltaNet layer and titans-pytorch's ``NeuralMemory``, at each of ``--lengths`` (default 2K, 8K,
  16K and 32K; the anchors that do not fit a length report their error and the run goes on);
- whole models (``models.py``'s rows and construction: 24 blocks, hidden 1024, V=32K, bf16 autocast,
  fused AdamW) beside ``LlamaForCausalLM`` (SDPA), at 8 x 2,048 and at 1 x 16,384 tokens per step.

Then one table of every row, and one of the targets (the deep memories' issue): what each compares, the
ratio measured in this process, and whether it is met. A row that failed leaves its targets unmeasured.
Writes ``train_speed.json`` (environment, rows, targets) to ``--out`` (default ``$OUT`` or the current
folder). Run on a GPU machine with mnemo importable (fla and titans-pytorch where installed):
``python benchmarks/train_speed.py`` (about half an hour on an H100), or a part of it, e.g.
``python benchmarks/train_speed.py --lengths 2048 --no-models``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from benchlib import Recorder, ints, names, out_dir, warm_up_gpu


# Layer rows timed at every length, and the whole-model rows; the names are bench_layers.py's and models.py's.
LAYER_ROWS = ("sdpa_attention_16x64", "anchor_fla_gated_deltanet_4x256", "anchor_titans_pytorch_neural_memory_c64",
              "titans_4x256_mlp4_c64", "titans_16x64_mlp4_c64", "mc_titans_grm_seg256_4x256",
              "mc_titans_ssc2_seg256_4x256", "atlas_omeganet_16x64", "atlas_momentum_16x64", "atlas_muon_16x64",
              "deep_transformer_depth2_16x64")
MODEL_ROWS = ("anchor_llama_sdpa", "titans_4x256", "mc_titans_ssc", "omeganet_16x64", "atlas_muon_16x64",
              "deep_transformer")
MODEL_SHAPES = ((8, 2048), (1, 16384))


@dataclass(frozen=True)
class Target:
    """``ours / reference`` of one measure (``ms`` of a layer: lower is better; ``tok_per_s`` of a model:
    higher is better) at one length, against a bound."""

    what: str
    kind: str  # "layer" or "model"
    ours: str
    reference: str
    T: int
    bound: float
    lower_is_better: bool

    def ratio(self, rows: list[dict]) -> float | None:
        key = "ms" if self.kind == "layer" else "tok_per_s"
        found = {}
        for row in rows:
            name = row.get("layer") if self.kind == "layer" else row.get("model")
            if name in (self.ours, self.reference) and row.get("T", row.get("length")) == self.T and key in row:
                found[name] = row[key]
        if len(found) < 2:
            return None
        return found[self.ours] / found[self.reference]

    def met(self, ratio: float | None) -> str:
        if ratio is None:
            return "not measured"
        return "met" if (ratio <= self.bound if self.lower_is_better else ratio >= self.bound) else "missed"


def _targets() -> list[Target]:
    layer = lambda what, ours, ref, T, bound: Target(what, "layer", ours, ref, T, bound, True)  # noqa: E731
    model = lambda what, ours, ref, T, bound: Target(what, "model", ours, ref, T, bound, False)  # noqa: E731
    titans, pytorch = "titans_4x256_mlp4_c64", "anchor_titans_pytorch_neural_memory_c64"
    small, gdn = "titans_16x64_mlp4_c64", "anchor_fla_gated_deltanet_4x256"
    targets = []
    for T in (2048, 8192):
        targets += [
            layer("Titans 4x256 time <= 0.1x titans-pytorch's (10x faster)", titans, pytorch, T, 0.1),
            layer("Titans 16x64 time <= 2x fla GatedDeltaNet's", small, gdn, T, 2.0),
            layer("Atlas (Muon) 16x64 time <= 1.5x Titans 16x64's", "atlas_muon_16x64", small, T, 1.5),
            layer("OmegaNet 16x64 time <= 1.2x Titans 16x64's", "atlas_omeganet_16x64", small, T, 1.2),
            layer("Atlas (momentum) 16x64 time <= 1.2x Titans 16x64's", "atlas_momentum_16x64", small, T, 1.2),
            layer("DeepTransformer depth 2 time <= 3x SDPA's", "deep_transformer_depth2_16x64",
                  "sdpa_attention_16x64", T, 3.0),
        ]
    targets += [
        layer("MC-Titans ssc time < SDPA's at T=16K", "mc_titans_ssc2_seg256_4x256", "sdpa_attention_16x64", 16384,
              1.0),
        layer("MC-Titans ssc time <= 0.5x SDPA's at T=32K", "mc_titans_ssc2_seg256_4x256", "sdpa_attention_16x64",
              32768, 0.5),
        model("Titans model tok/s >= 0.5x Llama's at T=2K", "titans_4x256", "anchor_llama_sdpa", 2048, 0.5),
        model("OmegaNet model tok/s >= 0.5x Llama's at T=2K", "omeganet_16x64", "anchor_llama_sdpa", 2048, 0.5),
        model("Atlas (Muon) model tok/s >= 0.33x Llama's at T=2K", "atlas_muon_16x64", "anchor_llama_sdpa", 2048,
              0.33),
        model("Titans model tok/s >= Llama's at T=16K, B=1", "titans_4x256", "anchor_llama_sdpa", 16384, 1.0),
        model("MC-Titans ssc model tok/s >= Llama's at T=16K, B=1", "mc_titans_ssc", "anchor_llama_sdpa", 16384, 1.0),
    ]
    return targets


def _layers(recorder: Recorder, args: argparse.Namespace) -> None:
    import bench_layers

    layer_args = bench_layers.parse(["--tf32", "--iters", str(args.iters), "--warmup", str(args.warmup)])
    warm_up_gpu()
    rows = [name for name in LAYER_ROWS if name in names(args.only) or not args.only]
    if rows:
        # The first row once more, its result dropped (its JSON line is printed all the same): a process's first
        # training steps pay set-up that the warm-up's products do not (the autograd engine's threads, cuDNN's
        # attention plans), which made the ratios to the first row, SDPA, meaningless (benchmarks/RESULTS.md).
        T = ints(args.lengths)[0]
        bench_layers.measure(Recorder(), rows[0], bench_layers.LAYERS[rows[0]], max(1, args.tokens // T), T,
                             layer_args, (None, None))
    for T in ints(args.lengths):
        for name in rows:
            bench_layers.measure(recorder, name, bench_layers.LAYERS[name], max(1, args.tokens // T), T, layer_args,
                                 (None, None))


def _models(recorder: Recorder, args: argparse.Namespace) -> None:
    import models

    rows = [name for name in MODEL_ROWS if name in names(args.only) or not args.only]
    for batch, length in MODEL_SHAPES:
        model_args = argparse.Namespace(layers=args.layers, batch=batch, length=length, warmup=args.warmup,
                                        iters=args.iters)
        for name in rows:
            try:
                row = models.measure(name, model_args, rank=0, world=1)
            except Exception as error:  # noqa: BLE001  (one row that does not fit must not lose the others)
                row = {"model": name, "length": length, "error": f"{type(error).__name__}: {error}"[:200]}
            torch.cuda.empty_cache()
            recorder.record(**{**row, "T": length})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="2048,8192,16384,32768", help="layer T (default %(default)s)")
    parser.add_argument("--tokens", type=int, default=16384, help="layer tokens per step (default %(default)s)")
    parser.add_argument("--layers", type=int, default=24, help="blocks of the whole models (default %(default)s)")
    parser.add_argument("--only", help=f"rows by exact name (default all): {', '.join(LAYER_ROWS + MODEL_ROWS)}")
    parser.add_argument("--no-layers", action="store_true", help="skip the layers")
    parser.add_argument("--no-models", action="store_true", help="skip the whole models")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", help="folder of train_speed.json (default: $OUT, else the current folder)")
    args = parser.parse_args(argv)
    unknown = [name for name in names(args.only) if name not in LAYER_ROWS + MODEL_ROWS]
    if unknown:
        parser.error(f"--only: no row named {', '.join(unknown)}")
    torch.backends.cuda.matmul.allow_tf32 = True
    recorder = Recorder()
    if not args.no_layers:
        _layers(recorder, args)
    if not args.no_models:
        _models(recorder, args)
    recorder.table(["layer", "model", "T", "B", "batch", "ms", "tok_per_s", "peak_gib", "skipped", "err", "error"])
    targets = []
    for target in _targets():
        ratio = target.ratio(recorder.rows)
        targets.append({"target": target.what, "T": target.T, "ratio": None if ratio is None else round(ratio, 3),
                        "status": target.met(ratio)})
    recorder.table(["target", "T", "ratio", "status"], targets)
    recorder.rows.extend({"target_row": True, **row} for row in targets)
    recorder.write(out_dir(args.out) / "train_speed.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
