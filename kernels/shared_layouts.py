"""Index layouts that depend only on a shape, made once and shared by every layer that asks.

A model's layers all lay out the same batch of equal rows at each step (a conv window
layout, a chunk layout): :func:`shared_per_shape` makes such a layout once per shape and
device instead of once per layer, sparing each layer the few small launches of building it.
Its tensors are never written by their users. Under ``torch.compile`` every call builds
its own, which the compiler traces.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

Layout = TypeVar("Layout")


def shared_per_shape(make: Callable[..., Layout]) -> Callable[..., Layout]:
    """``make(*ints, device)`` cached by its arguments (a few shapes at a time), except while compiling."""
    cached = functools.lru_cache(maxsize=16)(make)

    @functools.wraps(make)
    def layout(*args):
        *sizes, device = args
        if torch.compiler.is_compiling():
            return make(*sizes, device)
        return cached(*sizes, torch.device(device))

    return layout
