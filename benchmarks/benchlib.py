"""Helpers shared by the benchmark scripts: GPU timing, peak memory, the run's environment, JSON rows.

Not a script. ``bench_layers.py``, ``bench_decode.py``, ``bench_kernels.py`` and ``profile_layers.py``
import it as a sibling module (run them as ``python benchmarks/<script>.py``). Only torch is imported
at module level, so every script's ``--help`` works on a machine without a GPU, Triton or the anchors.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

# The anchors' work (flash-linear-attention 0.6.0, titans-pytorch, PyTorch SDPA): hidden 1024, bf16,
# 16,384 tokens per step at T=2048 (B=8) and T=8192 (B=2).
HIDDEN = 1024
TOKENS = 16384
LENGTHS = (2048, 8192)
VOCAB = 32000
DEVICE = "cuda"
DTYPE = torch.bfloat16


def environment() -> dict:
    """GPU, library versions and the checkout's commit, for the header of every result file."""
    env = {"torch": torch.__version__, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    for name in ("triton", "transformers", "fla", "titans_pytorch"):
        try:
            env[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001  (absent or broken: the row says so, the run goes on)
            continue
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
        dirty = subprocess.run(["git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
        env["commit"] += "+changes" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        pass  # a copy without its git metadata
    return env


def median_ms(fn: Callable[[], object], warmup: int = 2, iters: int = 5, repeats: int = 1) -> float:
    """Milliseconds per call of ``fn`` run back to back: the median over ``repeats`` timed loops of ``iters``
    calls, so that one slow loop (a clock change, another process) moves nothing."""
    for _ in range(warmup):
        fn()
    loops = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        loops.append((time.perf_counter() - start) / iters * 1e3)
    return sorted(loops)[len(loops) // 2]


def warm_up_gpu(seconds: float = 2.0) -> None:
    """Products on the GPU for ``seconds`` before anything is timed: a process's first timed row otherwise
    runs while the GPU's clocks are still rising from idle (and pays one-time library set-up)."""
    a = torch.randn(4096, 4096, device=DEVICE, dtype=DTYPE)
    torch.cuda.synchronize()
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def reset_peak() -> None:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2)


def release_chunk_graphs() -> None:
    """Drop the chunk loops' captured graphs: each layer's peak is then its own, not that of every layer
    measured before it in the process (their graph pools stay allocated otherwise)."""
    from mnemo.kernels.chunk_loop import release_graphs

    release_graphs()


def ints(text: str) -> list[int]:
    """``"2048,8192"`` -> ``[2048, 8192]``."""
    return [int(part) for part in text.split(",") if part]


def names(text: str | None) -> list[str]:
    return [part for part in (text or "").split(",") if part]


def picked(name: str, only: Iterable[str]) -> bool:
    """Whether ``name`` is selected by ``--only`` substrings (none given: everything)."""
    only = list(only)
    return not only or any(part in name for part in only)


@contextlib.contextmanager
def launch_constant(key: str | None, value: int | None) -> Iterator[None]:
    """For the block, ``titans_triton_forward.BLOCKS[key] = value``; for a dotted ``module.NAME`` key,
    ``mnemo.kernels.module.NAME = value`` (a module's switch, e.g. ``titans_persistent_triton.FIRST_PASS``);
    for ``module.NAME.key``, ``mnemo.kernels.module.NAME[key] = value`` (e.g.
    ``titans_persistent_triton.BLOCKS.warps_window``); the default restored after."""
    if key is None:
        yield
        return
    if "." in key:
        module, name, *item = key.split(".", 2)
        holder = importlib.import_module(f"mnemo.kernels.{module}")
        if not hasattr(holder, name):
            raise ValueError(f"launch constant {key!r}: mnemo.kernels.{module} has no {name}")
        if item:
            table = getattr(holder, name)
            if not isinstance(table, dict) or item[0] not in table:
                raise ValueError(f"launch constant {key!r}: mnemo.kernels.{module}.{name} has no key {item[0]!r}")
            get, put = (lambda: table[item[0]]), (lambda x: table.__setitem__(item[0], x))
        else:
            get, put = (lambda: getattr(holder, name)), (lambda x: setattr(holder, name, x))
    else:
        from mnemo.kernels.titans_triton_forward import BLOCKS

        get, put = (lambda: BLOCKS[key]), (lambda x: BLOCKS.__setitem__(key, x))
    saved = get()
    put(value if saved is None else type(saved)(value))
    try:
        yield
    finally:
        put(saved)


def setting(text: str) -> tuple[str, int]:
    """``--set key=v`` -> ``(key, v)`` (an argparse type)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--set takes key=value, got {text!r}")
    try:
        return key, int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--set takes an integer value, got {text!r}") from None


def sweep_values(spec: str | None) -> list[tuple[str | None, int | None]]:
    """``--sweep key=v1,v2`` -> ``[(key, v1), (key, v2)]``; none: one variant with the defaults."""
    if not spec:
        return [(None, None)]
    key, _, values = spec.partition("=")
    return [(key, value) for value in ints(values)]


def out_dir(arg: str | None) -> Path:
    """``--out``, else ``$OUT``, else the current directory."""
    path = Path(arg or os.environ.get("OUT") or ".")
    path.mkdir(parents=True, exist_ok=True)
    return path


class Recorder:
    """Rows printed as JSON lines as they come, then written with the environment to one JSON file."""

    def __init__(self) -> None:
        self.env = environment()
        self.rows: list[dict] = []
        print(json.dumps({"env": self.env}), flush=True)

    def record(self, **row) -> dict:
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        return row

    def write(self, path: Path) -> None:
        path.write_text(json.dumps({"env": self.env, "rows": self.rows}, indent=1))
        print(f"wrote {path}", flush=True)

    def table(self, columns: list[str], rows: list[dict] | None = None) -> None:
        """A markdown table of ``rows`` (default: all) over ``columns``; absent cells stay empty."""
        rows = self.rows if rows is None else rows
        print("\n| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
        for row in rows:
            print("| " + " | ".join("" if row.get(c) is None else str(row[c]) for c in columns) + " |")
        print(flush=True)


def lift_fla_hopper_guard() -> None:
    """flash-linear-attention 0.6.0 refuses its gated chunk backward on Hopper with Triton older than 3.7.1
    (its issue #640: wrong gradients there). The guard is lifted for timing only: fla cannot train these
    layers correctly on such a stack, but its speed is the anchor."""
    import fla.ops.common.chunk_o as chunk_o

    chunk_o.TRITON_ABOVE_3_7_1 = True
