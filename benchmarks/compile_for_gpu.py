"""Compile mnemo's Triton kernels for a GPU on a machine without one: shared memory, registers, spills.

What it reports: for each distinct launch a kernel family makes at a given shape, the shared memory the
compiled kernel asks for (and whether it fits the largest block of an SM: 232,448 bytes on an H100) and
the registers and spilled bytes that Triton's bundled ``ptxas -v`` reports for the target. That tells,
before a GPU run, whether a launch can start at all and which warp counts spill. It cannot tell whether
the results are right (the GPU tests do) nor how fast a kernel runs.

How: the family's own launch code runs on tensors of the ``meta`` device with Triton's launch replaced
by a recorder, so the launches are those the code makes at that shape: the kernel, its arguments' types,
its constants, warps and stages, with Triton's specialisations (integers equal to 1, 16-byte alignment
and multiples of 16). Each distinct launch is compiled with Triton's compiler for ``--arch`` (default
90: Hopper). Families:

- ``titans_forward`` / ``titans_backward``: the sliced chunk of a depth-2 MLP memory
  (``mnemo.kernels.titans_triton_forward`` / ``titans_triton_backward``) at ``--memory``: ``titans_4x256``
  (the Titans layer: width 256, hidden 1024, 64 written tokens, momentum), ``titans_16x64``,
  ``atlas_momentum_16x64`` and ``atlas_omeganet_16x64`` (width 64, hidden 256, Omega window 16: 79
  written tokens; with and without momentum); clip 10, ``l2``; TF32 products unless ``--float32``;
- ``persistent``: the persistent chunk loop (``mnemo.kernels.titans_persistent_triton``'s forward, every
  chunk in one launch, with checkpoints) at ``--memory``, 128 rows (B=8 x 16 heads); Atlas' memories take
  it with their Omega window's 15 keys a second block of rows (heads of 64 only: ``titans_4x256`` is
  outside it);
- ``key_pass``: the DeepTransformer key pass's forward and backward
  (``mnemo.kernels.deep_attention_triton_key_pass``) at 16 heads x 64, memory hidden 64, chunk 64, reads
  in each of ``--reads``, at the T=8192 step (B=2: 32 rows of 128 chunks, in groups with bulk launches).

``--set module.NAME=VALUE`` (or ``module.DICT.key=VALUE``) changes a launch constant of a module of
``mnemo.kernels`` first, e.g. ``--set titans_triton_forward.BLOCKS.backward_warps=8`` or
``--set deep_attention_triton_key_pass._WARPS=4``.

Prints one JSON line per distinct launch; writes nothing. Registers vary between Triton versions: run
with the GPU machines' version (3.6) where it matters, e.g.
``python benchmarks/compile_for_gpu.py --kernels titans_backward --memory atlas_momentum_16x64``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

MAX_SHARED = 232448  # bytes a block of an H100 may take
MEMORIES = {  # (width, hidden, written tokens, momentum)
    "titans_4x256": (256, 1024, 64, True),
    "titans_16x64": (64, 256, 64, True),
    "atlas_momentum_16x64": (64, 256, 79, True),
    "atlas_omeganet_16x64": (64, 256, 79, False),
}
TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
         torch.int64: "i64", torch.int8: "i8", torch.bool: "i1"}


@dataclass
class Launch:
    fn: object
    args: dict
    options: dict = field(default_factory=dict)


class Recorder:
    """Triton's launch replaced: ``kernel[grid](...)`` records the kernel and its arguments by name."""

    def __init__(self) -> None:
        self.launches: list[Launch] = []

    def __enter__(self) -> Recorder:
        from triton.runtime.jit import JITFunction

        self.saved = JITFunction.run
        recorder = self

        def run(fn, *args, grid=None, warmup=False, **kwargs):  # noqa: ARG001  (Triton's signature)
            bound = dict(zip(fn.arg_names, args))
            options = {k: v for k, v in kwargs.items() if k not in fn.arg_names}
            bound.update({k: v for k, v in kwargs.items() if k in fn.arg_names})
            recorder.launches.append(Launch(fn, bound, options))

        JITFunction.run = run
        return self

    def __exit__(self, *exc) -> None:
        from triton.runtime.jit import JITFunction

        JITFunction.run = self.saved


def signature(launch: Launch) -> tuple[dict, dict, dict]:
    """Argument types, constants and alignment hints of a recorded launch, as Triton's launcher derives them."""
    fn = launch.fn
    types, constants, hints = {}, {}, {}
    dns = set(getattr(fn, "do_not_specialize", []) or [])
    for i, param in enumerate(fn.params):
        name = param.name
        value = launch.args.get(name, param.default if param.has_default else None)
        frozen = i in dns or name in dns
        if param.is_constexpr:
            types[name], constants[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            types[name] = "*" + TYPES[value.dtype]
            if (value.storage_offset() * value.element_size()) % 16 == 0:
                hints[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            types[name] = "i1"
        elif isinstance(value, int):
            if value == 1 and not frozen:
                types[name], constants[name] = "constexpr", 1
                continue
            types[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0 and not frozen:
                hints[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            types[name] = "fp32"
        else:  # None: an absent optional operand
            types[name], constants[name] = "constexpr", value
    return types, constants, hints


def ptxas_path(arch: int) -> str:
    """The ptxas Triton itself compiles with for ``arch`` (newer Triton bundles one per architecture)."""
    import triton

    try:
        from triton.backends.nvidia.compiler import get_ptxas

        try:
            return get_ptxas(arch).path
        except TypeError:
            return get_ptxas().path
    except (ImportError, AttributeError):
        return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas")


def ptxas_report(ptx: str, arch: int) -> str:
    ptxas = ptxas_path(arch)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        out = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}a", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=False)
    finally:
        os.unlink(f.name)
    return " ".join(line.split(":", 1)[-1].strip() for line in out.stderr.splitlines()
                    if "registers" in line or "spill" in line)


def compile_launch(launch: Launch, arch: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    types, constants, hints = signature(launch)
    options = {k: v for k, v in launch.options.items() if k in ("num_warps", "num_stages", "num_ctas", "maxnreg")}
    kernel = triton_compile(ASTSource(launch.fn, types, constants, hints), target=GPUTarget("cuda", arch, 32),
                            options=options)
    shared = kernel.metadata.shared
    return dict(triton=triton.__version__, arch=arch, kernel=launch.fn.__name__, **options, shared_bytes=shared,
                fits=shared <= MAX_SHARED, ptxas=ptxas_report(kernel.asm["ptx"], arch),
                constants={k: v for k, v in constants.items() if isinstance(v, (int, float, str, bool))})


# ------------------------------------------------------------------------------------- the families' launches

META = dict(device="meta")


def titans_launches(memory: str, backward: bool) -> list[Launch]:
    from mnemo.kernels.mlp_memory import MLPMemorySpec
    from mnemo.kernels.titans_triton_backward import chunk_backward
    from mnemo.kernels.titans_triton_forward import chunk_forward

    D, F, K, momentum = MEMORIES[memory]
    spec = MLPMemorySpec(depth=2, d_k=D, d_v=D, expansion=F // D, grad_clip=10.0)
    G, C = 8, 64  # batch x heads of the T=8192 step; a chunk of 64 queries
    f32 = dict(META, dtype=torch.float32)
    W = {name: torch.empty(G, *shape, **f32) for name, shape in spec.shapes.items()}
    S = {name: torch.empty_like(w) for name, w in W.items()} if momentum else None
    q, k, v = torch.empty(G, C, D, **f32), torch.empty(G, K, D, **f32), torch.empty(G, K, D, **f32)
    a, c = torch.empty(G, C, **f32), torch.empty(G, C, K, **f32)
    b, sa_last, sc_last = (torch.empty(G, C, **f32), torch.empty(G, **f32), torch.empty(G, K, **f32)) if momentum \
        else (None, None, None)
    with Recorder() as forward:
        y, W_new, S_new, parts = chunk_forward(spec, W, S, q, k, v, a, b, c, sa_last, sc_last)
    if not backward:
        return forward.launches
    with Recorder() as rec:
        chunk_backward(spec, W, S, q, k, a, b, c, sa_last, sc_last, parts, torch.empty_like(y),
                       {n: torch.empty_like(w) for n, w in W_new.items()},
                       {n: torch.empty_like(s) for n, s in S_new.items()} if momentum else None)
    return rec.launches


def persistent_launches(memory: str) -> list[Launch]:
    from mnemo.kernels.mlp_memory import MLPMemorySpec
    from mnemo.kernels.titans_persistent_triton import persistent_forward

    D, F, K, momentum = MEMORIES[memory]
    spec = MLPMemorySpec(depth=2, d_k=D, d_v=D, expansion=F // D, grad_clip=10.0)
    n, G, C = 8, 128, 64  # checkpoints every 4 chunks; the launch is the same for any number
    f32 = dict(META, dtype=torch.float32)
    W = {name: torch.empty(G, *shape, **f32) for name, shape in spec.shapes.items()}
    S = {name: torch.empty_like(w) for name, w in W.items()} if momentum else None
    q, k, v = torch.empty(n, G, C, D, **f32), torch.empty(n, G, K, D, **f32), torch.empty(n, G, K, D, **f32)
    a, c = torch.empty(n, G, C, **f32), torch.empty(n, G, C, K, **f32)
    b, sa_last, sc_last = ((torch.empty(n, G, C, **f32), torch.empty(n, G, **f32), torch.empty(n, G, K, **f32))
                           if momentum else (None, None, None))
    with Recorder() as rec:
        persistent_forward(spec, W, S, q, k, v, a, b, c, sa_last, sc_last, checkpoint_every=4)
    return rec.launches


def key_pass_launches(reads: torch.dtype, chunk: int = 64, width: int = 64, hidden: int = 64, T: int = 8192,
                      BH: int = 32) -> list[Launch]:
    from mnemo.kernels.deep_attention_triton_key_pass import key_pass_backward_triton, key_pass_forward_triton

    f32 = dict(META, dtype=torch.float32)
    keys = torch.empty(BH, T, width, device="meta", dtype=reads)
    v, e, w1 = torch.empty(BH, T, width, **f32), torch.empty(BH, T, **f32), torch.empty(BH, width, hidden, **f32)
    with Recorder() as rec:
        u, sig, er, w1s, u_read, a, lse = key_pass_forward_triton(keys, v, e, w1, chunk, width**-0.5, 10.0)
        key_pass_backward_triton(keys, v, e, w1s, u_read, a, lse, torch.empty_like(u), torch.empty_like(sig),
                                 torch.empty_like(er), torch.empty_like(w1s), chunk, width**-0.5, 10.0)
    return rec.launches


def distinct(launches: list[Launch]) -> list[Launch]:
    """One launch per kernel, types and constants: a pass launches the same step kernel once per chunk."""
    seen, out = set(), []
    for launch in launches:
        types, constants, _ = signature(launch)
        key = (launch.fn, tuple(types.items()), tuple((k, repr(v)) for k, v in constants.items()),
               tuple(sorted(launch.options.items())))
        if key not in seen:
            seen.add(key)
            out.append(launch)
    return out


def apply_setting(text: str) -> None:
    """``module.NAME=VALUE`` or ``module.DICT.key=VALUE`` on a module of ``mnemo.kernels``."""
    target, _, value = text.partition("=")
    module, *path = target.split(".")
    obj = importlib.import_module(f"mnemo.kernels.{module}")
    for part in path[:-1]:
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    if isinstance(obj, dict):
        obj[path[-1]] = int(value)
    else:
        setattr(obj, path[-1], int(value))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", default="titans_forward,titans_backward,key_pass",
                        help="comma-separated families (default %(default)s)")
    parser.add_argument("--memory", choices=tuple(MEMORIES), default="titans_4x256",
                        help="the shape of the titans families (default %(default)s)")
    parser.add_argument("--reads", default="bf16,fp32", help="key_pass: the reads' dtypes (default %(default)s)")
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default %(default)s)")
    parser.add_argument("--float32", action="store_true", help="titans: exact float32 products instead of TF32")
    parser.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                        help="change a launch constant first (repeatable)")
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # compile for real, whatever the shell says
    for setting in args.set:
        apply_setting(setting)
    torch.set_float32_matmul_precision("highest" if args.float32 else "high")
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    for family in args.kernels.split(","):
        if family == "key_pass":
            runs = [(f"key_pass reads={r}", key_pass_launches(dtypes[r])) for r in args.reads.split(",")]
        elif family == "persistent":
            runs = [(f"persistent {args.memory}", persistent_launches(args.memory))]
        else:
            runs = [(f"{family} {args.memory}", titans_launches(args.memory, family == "titans_backward"))]
        for label, launches in runs:
            for launch in distinct(launches):
                try:
                    row = compile_launch(launch, args.arch)
                except Exception as error:  # noqa: BLE001  (a launch that does not compile is the finding)
                    row = dict(kernel=launch.fn.__name__, err=f"{type(error).__name__}: {error}"[:300])
                print(json.dumps({"family": label, **row}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
