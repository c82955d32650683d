"""Helpers that make every config reject impossible values with a ``ValueError`` naming the field."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def check(condition: bool, field: str, message: str, value: Any) -> None:
    """Raise ``ValueError("<field>=<value>: <message>")`` unless ``condition`` holds."""
    if not condition:
        raise ValueError(f"{field}={value!r}: {message}")


def check_positive_int(field: str, value: Any) -> None:
    check(isinstance(value, int) and not isinstance(value, bool) and value >= 1, field, "must be an integer >= 1", value)


def check_choice(field: str, value: Any, choices: Iterable[str]) -> None:
    choices = tuple(choices)
    check(value in choices, field, f"must be one of {choices}", value)


def check_layer_indices(field: str, value: Any, num_layers: int) -> None:
    check(
        isinstance(value, (list, tuple))
        and all(isinstance(i, int) and 0 <= i < num_layers for i in value)
        and len(set(value)) == len(value),
        field,
        f"must be a list of distinct layer indices in [0, {num_layers})",
        value,
    )


def default_head_dim(hidden_size: Any, num_heads: Any, head_dim: Any) -> Any:
    """``head_dim`` when given, else ``hidden_size // num_heads``, which must divide exactly: a floored width
    would build heads narrower than asked and leave part of the hidden state unread."""
    if head_dim is not None:
        return head_dim
    check_positive_int("num_heads", num_heads)
    check(hidden_size % num_heads == 0, "num_heads",
          f"must divide hidden_size ({hidden_size}), or give head_dim for another head width", num_heads)
    return hidden_size // num_heads


def swiglu_width(hidden_size: int, hidden_ratio: float) -> int:
    """The SwiGLU width ``hidden_size * hidden_ratio * 2/3`` rounded up to a multiple of 256."""
    return 256 * ((int(hidden_size * hidden_ratio * 2 / 3) + 255) // 256)


def check_block(config) -> None:
    """The checks every family's block shares: RMSNorm epsilon and the SwiGLU activation."""
    check(config.norm_eps > 0, "norm_eps", "must be > 0", config.norm_eps)
    check(config.hidden_act in ("silu", "swish"), "hidden_act", "only 'silu' (SwiGLU) is supported",
          config.hidden_act)
