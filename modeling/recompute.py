"""Activations that the backward recomputes instead of keeping from the forward.

A MoM layer saves several token-sized tensors that are cheap to make again from what
the backward keeps anyway: each memory's gathered copy of the layer input (saved by
the projections), the gathered queries and the projected keys and values (saved by
the short convolutions). :class:`RecomputedSaves` is a ``saved_tensors_hooks`` context
under which such a tensor, once registered with its recipe, is saved as the recipe
and made again when the backward unpacks it; every other saved tensor is kept as
usual. The recipes must give back exactly what the forward computed.
"""

from __future__ import annotations

from typing import Callable

import torch

# A recipe makes rows ``[start, stop)`` of its tensor, or the whole tensor for ``None``.
Recipe = Callable[[int | None, int | None], torch.Tensor]


class RecomputedSaves(torch.autograd.graph.saved_tensors_hooks):
    """Within the context, saved tensors that are (views of) registered tensors are saved as recipes.

    Off during ``torch.compile`` (which traces the saves itself): then every tensor is kept.
    """

    def __init__(self) -> None:
        self._registered: dict[int, tuple[torch.Tensor, Recipe]] = {}
        self._active = False
        super().__init__(self._pack, self._unpack)

    def register(self, tensor: torch.Tensor, recipe: Recipe) -> torch.Tensor:
        """``tensor`` (contiguous) will be saved as ``recipe``; kept referenced until the context exits, so
        that no other tensor takes its memory (and its address) meanwhile. Returns ``tensor``."""
        if self._active:
            self._registered[tensor.untyped_storage().data_ptr()] = (tensor, recipe)
        return tensor

    def __enter__(self) -> "RecomputedSaves":
        self._active = torch.is_grad_enabled() and not torch.compiler.is_compiling()
        if self._active:
            super().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._registered.clear()
        if self._active:
            super().__exit__(*exc)
        self._active = False

    def _pack(self, t: torch.Tensor):
        entry = self._registered.get(t.untyped_storage().data_ptr()) if t.device.type != "meta" else None
        if entry is None or entry[0].dtype != t.dtype:
            return t
        base, recipe = entry
        offset = t.storage_offset() - base.storage_offset()
        row = base.stride(0) if base.dim() > 0 else 1
        if t.dim() == base.dim() and t.stride() == base.stride() and offset % row == 0 and \
                t.shape[1:] == base.shape[1:]:
            start = offset // row  # a block of whole rows: make just those
            return recipe, start, start + t.shape[0], None
        return recipe, None, None, (t.size(), t.stride(), offset)

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        recipe, start, stop, view = packed
        with torch.no_grad():
            out = recipe(start, stop)
        if view is not None:
            size, stride, offset = view
            out = out.as_strided(size, stride, out.storage_offset() + offset)
        return out


def gathered_rows(source: torch.Tensor, index: torch.Tensor) -> Recipe:
    """The recipe of ``source.index_select(0, index)``."""
    return lambda start, stop: source.index_select(0, index[start:stop])


def shared_parts(make: Callable[[], tuple[torch.Tensor, ...]], count: int) -> list[Recipe]:
    """Recipes for ``count`` whole tensors that one computation makes together: the first one unpacked
    runs ``make`` and keeps the others until they are unpacked (a second backward makes them again)."""
    pending: dict[int, torch.Tensor] = {}

    def part(i: int) -> Recipe:
        def recipe(start, stop) -> torch.Tensor:
            if i not in pending:
                pending.update(enumerate(make()))
            whole = pending.pop(i)
            return whole if start is None else whole[start:stop]
        return recipe

    return [part(i) for i in range(count)]
