"""Selection of the compute path (``"torch"`` or ``"triton"``) behind the memory-kernel API.

The default is Triton on CUDA tensors when Triton imports, the PyTorch path
otherwise. ``MNEMO_BACKEND=torch|triton`` or the :func:`use_backend` context
manager override it. :func:`comparison_paths` is for tests and benchmarks only: it runs the
deep memories' chunks through the slower paths kept to check the shipped kernels against.

This module imports only the standard library, torch and, where installed, Triton, which
it imports for every other module (``kernels/`` is a leaf package, see docs/kernels.md).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch


class _TritonAbsent:
    """Stands in for ``triton`` and ``triton.language`` where Triton is not installed: a module of
    Triton kernels still imports (``@triton.jit`` leaves its function as it is, any other name is this
    object again), and nothing launches them, since :func:`resolve_backend` picks the PyTorch path."""

    def __getattr__(self, name: str) -> "_TritonAbsent":
        return self

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return self


# The one place that imports Triton: every module of kernels takes ``triton`` and ``tl`` from here, so a
# machine without it (and transformers' import check of an exported folder) never meets a bare import.
try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = _TritonAbsent()
_TRITON_INSTALLED = not isinstance(triton, _TritonAbsent)

BACKENDS = ("torch", "triton")
CHUNK_FORWARDS = ("triton", "torch")
CHUNK_BACKWARDS = ("fused", "torch", "autograd")

_override: list[str] = []


def _check(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}: expected one of {BACKENDS}")
    return name


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run the enclosed memory kernels on ``name`` (``"torch"`` or ``"triton"``)."""
    _override.append(_check(name))
    try:
        yield
    finally:
        _override.pop()


def triton_available() -> bool:
    """Whether Triton is installed (its kernels run only where :func:`resolve_backend` also says so)."""
    return _TRITON_INSTALLED


def requested_backend() -> str | None:
    """The backend asked for by :func:`use_backend` or ``MNEMO_BACKEND``, or ``None`` for automatic."""
    if _override:
        return _override[-1]
    env = os.environ.get("MNEMO_BACKEND")
    return _check(env) if env else None


def resolve_backend(tensor: torch.Tensor, has_triton_impl: bool, what: str | Callable[[], str] | None = None) -> str:
    """The backend that runs a kernel on ``tensor``.

    Automatic selection takes Triton for CUDA tensors when an implementation
    exists; an explicit request for Triton where none exists is an error rather
    than a silent fallback, so that benchmarks never measure the wrong path. ``what`` names
    what lacks one, for that error (a callable where naming it costs work on a hot path).
    """
    asked = requested_backend()
    if asked == "torch":
        return "torch"
    if asked == "triton":
        if not has_triton_impl:
            what = what() if callable(what) else what
            raise NotImplementedError(f"{what or 'this memory kernel'} has no Triton implementation; "
                                      "use backend 'torch'")
        if not triton_available():
            raise RuntimeError("backend 'triton' requested but triton is not installed")
        return "triton"
    if has_triton_impl and tensor.is_cuda and triton_available():
        return "triton"
    return "torch"


@dataclass(frozen=True)
class ComparisonPaths:
    """Which path a deep memory's chunk takes where the shipped one has a slower twin kept to compare:
    ``chunk_forward`` ``"triton"`` (the hidden-layer slices) or ``"torch"`` (cuBLAS products);
    ``chunk_backward`` ``"fused"`` (the hand-written backward, in Triton where the forward ran there),
    ``"torch"`` (the same backward written in PyTorch) or ``"autograd"`` (autograd over the chunk)."""

    chunk_forward: str = "triton"
    chunk_backward: str = "fused"

    def __post_init__(self) -> None:
        if self.chunk_forward not in CHUNK_FORWARDS:
            raise ValueError(f"chunk_forward must be one of {CHUNK_FORWARDS}, got {self.chunk_forward!r}")
        if self.chunk_backward not in CHUNK_BACKWARDS:
            raise ValueError(f"chunk_backward must be one of {CHUNK_BACKWARDS}, got {self.chunk_backward!r}")


_paths: list[ComparisonPaths] = [ComparisonPaths()]


def current_paths() -> ComparisonPaths:
    """The chunk paths in force (the shipped ones unless :func:`comparison_paths` says otherwise)."""
    return _paths[-1]


@contextlib.contextmanager
def comparison_paths(*, chunk_forward: str | None = None, chunk_backward: str | None = None) -> Iterator[None]:
    """For tests and benchmarks: run the enclosed deep-memory chunks through the paths named (see
    :class:`ComparisonPaths`); the values agree with the shipped paths up to the order of sums."""
    asked = {k: v for k, v in dict(chunk_forward=chunk_forward, chunk_backward=chunk_backward).items() if v is not None}
    _paths.append(replace(_paths[-1], **asked))
    try:
        yield
    finally:
        _paths.pop()
