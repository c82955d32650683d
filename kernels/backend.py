"""Selection of the compute path (``"torch"`` or ``"triton"``) behind the memory-kernel API.

The default is Triton on CUDA tensors when Triton imports, the PyTorch path
otherwise. ``MNEMO_BACKEND=torch|triton`` or the :func:`use_backend` context
manager override it. This module imports only the standard library and torch
(``kernels/`` must stay a leaf package, see ARCHITECTURE.md).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

BACKENDS = ("torch", "triton")

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
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def requested_backend() -> str | None:
    """The backend asked for by :func:`use_backend` or ``MNEMO_BACKEND``, or ``None`` for automatic."""
    if _override:
        return _override[-1]
    env = os.environ.get("MNEMO_BACKEND")
    return _check(env) if env else None


def resolve_backend(tensor: torch.Tensor, has_triton_impl: bool) -> str:
    """The backend that runs a kernel on ``tensor``.

    Automatic selection takes Triton for CUDA tensors when an implementation
    exists; an explicit request for Triton where none exists is an error rather
    than a silent fallback, so that benchmarks never measure the wrong path.
    """
    asked = requested_backend()
    if asked == "torch":
        return "torch"
    if asked == "triton":
        if not has_triton_impl:
            raise NotImplementedError("this memory kernel has no Triton implementation yet; use backend 'torch'")
        if not triton_available():
            raise RuntimeError("backend 'triton' requested but triton is not installed")
        return "triton"
    if has_triton_impl and tensor.is_cuda and triton_available():
        return "triton"
    return "torch"
