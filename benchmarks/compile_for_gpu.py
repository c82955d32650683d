"""Compile the DeepTransformer key-pass kernels for a GPU without one: shared memory, registers and spills.

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

INTS = {"m", "first", "lo", "hi", "top", "N", "T", "BH", "DK", "DV", "HID"}
FLOATS = {"scale", "clip"}


def signature(fn, reads: str, constants: dict) -> tuple[dict, dict]:
    """Argument types of a kernel: the reads' tensors in ``reads``, other pointers float32."""
    types = {}
    for name in fn.arg_names:
        if name in constants:
            types[name] = "constexpr"
        elif name in INTS:
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--chunks", default="64")
    parser.add_argument("--widths", default="64")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--reads", default="bf16,fp32")
    args = parser.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
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
                                              ("reads", key_pass._forward_reads, bulk),
                                              ("backward", key_pass._backward_step, key_pass._STAGES),
                                              ("key_side", key_pass._backward_key_side, bulk),
                                              ("query", key_pass._query_gradients, bulk)):
                        types, consts = signature(fn, reads, constants)
                        hints = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
                                 if types[name].startswith("*")}
                        kernel = triton_compile(ASTSource(fn, types, consts, hints), target=target,
                                                options=dict(num_warps=warps, num_stages=stages))
                        row[label] = dict(shared_bytes=kernel.metadata.shared,
                                          ptxas=ptxas_report(kernel.asm["ptx"], args.arch))
                    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
