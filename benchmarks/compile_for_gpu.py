"""Compile mnemo's Triton kernels for a GPU without one: shared memory, registers and spills.

``--kernels key_pass`` (default): the DeepTransformer key pass; ``--kernels titans_forward`` /
``titans_backward``: the sliced chunk forward / backward of the Titans memory
(:mod:`mnemo.kernels.titans_chunk_forward_triton`, :mod:`mnemo.kernels.titans_chunk_backward_triton`, at
their default blocks, 64-token chunks, a 256-wide key and 16 hidden slices, with momentum, ``l2`` and
the clip).

Triton compiles for a named target on any machine (``GPUTarget("cuda", 90, 32)`` is Hopper), and its
bundled ``ptxas -v`` reports registers and spills. That tells, before a GPU run, whether a launch fits an
SM (an H100 has 227 KB of shared memory per block) and which warp counts spill. It cannot tell whether
the numbers are right: that needs the GPU tests. Run with the Triton version of the GPU machines
importable (3.6), e.g. ``python benchmarks/compile_for_gpu.py --chunks 64 --widths 64,128``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile for real, whatever the shell says

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler import compile as triton_compile  # noqa: E402

from mnemo.kernels import deep_attention_key_pass_triton as key_pass  # noqa: E402
from mnemo.kernels import titans_chunk_backward_triton as titans_backward  # noqa: E402
from mnemo.kernels import titans_chunk_forward_triton as titans_forward  # noqa: E402

INTS = {"m", "first", "lo", "hi", "top", "N", "T", "BH", "DK", "DV", "HID"}
TITANS_INTS = {"C", "K", "D", "F", "NS", "ROWS1"}
TITANS_SLICES = 16  # the benchmark's hidden layer (1024) in slices of 64
FLOATS = {"scale", "clip"}


def signature(fn, reads: str, constants: dict, ints: set = INTS) -> tuple[dict, dict]:
    """Argument types of a kernel: ``ints`` 32-bit integers, the reads' tensors in ``reads``, other
    pointers float32."""
    types = {}
    for name in fn.arg_names:
        if name in constants:
            types[name] = "constexpr"
        elif name in ints:
            types[name] = "i32"
        elif name in FLOATS:
            types[name] = "fp32"
        else:
            types[name] = f"*{reads}" if name in ("K", "UR", "A", "DA") else "*fp32"
    return types, {name: constants[name] for name in fn.arg_names if name in constants}


def ptxas_report(ptx: str, arch: int) -> str:
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    out = subprocess.run([str(ptxas), "-v", "--gpu-name", f"sm_{arch}a", f.name, "-o", os.devnull],
                         capture_output=True, text=True)
    os.unlink(f.name)
    return " ".join(line.split(":", 1)[-1].strip() for line in out.stderr.splitlines()
                    if "registers" in line or "spill" in line)


def _compile(fn, reads: str, constants: dict, target, warps: int, stages: int, ints: set = INTS) -> dict:
    if "NS" in {p.name for p in fn.params if p.is_constexpr}:  # a kernel that unrolls over the slices
        constants = {**constants, "NS": TITANS_SLICES}
    types, consts = signature(fn, reads, constants, ints)
    hints = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if types[name].startswith("*")}
    kernel = triton_compile(ASTSource(fn, types, consts, hints), target=target,
                            options=dict(num_warps=warps, num_stages=stages))
    return dict(shared_bytes=kernel.metadata.shared, ptxas=ptxas_report(kernel.asm["ptx"], target.arch))


def titans_forward_rows(target, BK: int = 64) -> None:
    blocks = titans_forward.BLOCKS
    constants = dict(HAS_S=True, L2=True, CLIP=True, BC=64, BK=BK, BF=blocks["slice"], BD=blocks["width"],
                     BR=blocks["rows"], BDF=256, U=blocks["share_unroll"], PRECISION="tf32")
    for fn, warps, extra in ((titans_forward._pre_kernel, blocks["warps"], {}),
                             (titans_forward._error_kernel, blocks["warps"], dict(BR=blocks["error_rows"])),
                             (titans_forward._back_kernel, blocks["warps"], {}),
                             (titans_forward._read_kernel, blocks["read_warps"], dict(BW=blocks["read_width"])),
                             (titans_forward._update_kernel, blocks["update_warps"], dict(BD=blocks["update_width"])),
                             (titans_forward._output_kernel, blocks["warps"], dict(BD=blocks["output_width"]))):
        row = dict(triton=triton.__version__, arch=target.arch, kernel=fn.__name__, BK=BK, warps=warps)
        row.update(_compile(fn, "fp32", {**constants, **extra}, target, warps, blocks["stages"], TITANS_INTS))
        print(json.dumps(row), flush=True)


def titans_backward_rows(target, BK: int = 64) -> None:
    blocks = titans_forward.BLOCKS
    constants = dict(HAS_S=True, L2_OBJ=True, CLIP=True, BC=64, BK=BK, BF=blocks["slice"], BD=blocks["width"],
                     BR=blocks["backward_rows"], BKB=blocks["backward_rows"], U=blocks["share_unroll"],
                     PRECISION="tf32")
    for fn, warps in ((titans_backward._slices_kernel, blocks["backward_warps"]),
                      (titans_backward._gates_kernel, blocks["warps"]),
                      (titans_backward._width_kernel, blocks["warps"]),
                      (titans_backward._chain_kernel, blocks["warps"]),
                      (titans_backward._error_grad_kernel, blocks["warps"]),
                      (titans_backward._prediction_kernel, blocks["warps"]),
                      (titans_backward._sum_kernel, blocks["warps"])):
        for w in sorted({warps, 4, 8}) if fn is titans_backward._slices_kernel else (warps,):
            row = dict(triton=triton.__version__, arch=target.arch, kernel=fn.__name__, BK=BK, warps=w)
            stages = blocks["backward_stages"] if fn is titans_backward._slices_kernel else blocks["stages"]
            row.update(_compile(fn, "fp32", constants, target, w, stages, TITANS_INTS))
            print(json.dumps(row), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", choices=("key_pass", "titans_forward", "titans_backward"), default="key_pass")
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--chunks", default="64")
    parser.add_argument("--widths", default="64")
    parser.add_argument("--keys", default="64", help="Titans: blocks of written tokens (Atlas' window: 128)")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--reads", default="bf16,fp32")
    args = parser.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    if args.kernels.startswith("titans"):
        for keys in map(int, args.keys.split(",")):
            (titans_forward_rows if args.kernels == "titans_forward" else titans_backward_rows)(target, keys)
        return
    for reads in args.reads.split(","):
        for chunk in map(int, args.chunks.split(",")):
            for width in map(int, args.widths.split(",")):
                for warps in map(int, args.warps.split(",")):
                    constants = dict(CLIP=True, C=chunk, BK=width, BV=width, BHID=width,
                                     PRECISION="tf32x3" if reads == "fp32" else "ieee", WRITE_READ=reads != "fp32",
                                     FRESH=False)
                    row = dict(triton=triton.__version__, arch=args.arch, reads=reads, chunk=chunk, width=width,
                               warps=warps)
                    bulk = key_pass._bulk_stages(torch.float32 if reads == "fp32" else torch.bfloat16)
                    for label, fn, stages in (("forward", key_pass._forward_step, key_pass._STAGES),
                                              ("forward_reads", key_pass._forward_reads, bulk),
                                              ("backward", key_pass._backward_step, key_pass._STAGES),
                                              ("key_side", key_pass._backward_key_side, bulk),
                                              ("query", key_pass._query_gradients, bulk)):
                        row[label] = _compile(fn, reads, constants, target, warps, stages)
                    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
