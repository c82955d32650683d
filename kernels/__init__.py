"""Memory kernels: one API per memory kind, a PyTorch path everywhere and Triton on CUDA.

This package is a leaf: its modules import only torch, triton and each other,
never the rest of mnemo (docs/kernels.md: ``transformers`` may import a
top-level folder named ``kernels`` when the repository root is on ``sys.path``).
"""

from .backend import BACKENDS, requested_backend, resolve_backend, triton_available, use_backend
from .gated_delta import chunk_gated_delta, reference_gated_delta, step_gated_delta, step_gated_delta_
from .norms import l2_normalize

__all__ = [
    "BACKENDS",
    "chunk_gated_delta",
    "l2_normalize",
    "reference_gated_delta",
    "requested_backend",
    "resolve_backend",
    "step_gated_delta",
    "step_gated_delta_",
    "triton_available",
    "use_backend",
]
